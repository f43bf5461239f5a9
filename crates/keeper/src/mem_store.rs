//! [`MemKeeperStore`]: the [`KeeperStore`] contract in memory, for the
//! keeper's tests and for simulations. It does no IO; "durable" means for
//! as long as the value lives (a keeper restart is modelled by taking the
//! store back with `Keeper::into_store` and building a new keeper on it).

use std::collections::BTreeMap;
use std::ops::Bound;

use crate::store::{
    AgentHash, AgentRecord, AgentState, Entry, KeeperStore, KeeperStoreError, Page, Pushed, Usage,
};

/// A [`KeeperStore`] in memory. A clone is a copy of the store as it is
/// (a backup, for tests that roll a keeper back).
#[derive(Debug, Default, Clone)]
pub struct MemKeeperStore {
    agents: BTreeMap<AgentHash, MemAgent>,
}

#[derive(Debug, Clone)]
struct MemAgent {
    state: AgentState,
    log: BTreeMap<u64, Entry>,
}

impl MemKeeperStore {
    /// An empty store.
    #[must_use]
    pub fn new() -> Self {
        Self::default()
    }
}

fn usage_of<'a>(entries: impl Iterator<Item = &'a Entry>) -> Usage {
    entries.fold(Usage::default(), |u, e| Usage {
        bytes: u.bytes.saturating_add(e.size()),
        envelopes: u.envelopes + 1,
    })
}

impl KeeperStore for MemKeeperStore {
    fn agent_count(&self) -> usize {
        self.agents.len()
    }

    fn agent_hashes(&self) -> Vec<AgentHash> {
        self.agents.keys().copied().collect()
    }

    fn agent(&self, agent: &AgentHash) -> Option<AgentState> {
        self.agents.get(agent).map(|a| a.state.clone())
    }

    fn usage_through(&self, agent: &AgentHash, through: u64) -> Result<Usage, KeeperStoreError> {
        Ok(self
            .agents
            .get(agent)
            .map(|a| usage_of(a.log.range(..=through).map(|(_, e)| e)))
            .unwrap_or_default())
    }

    fn push(
        &mut self,
        agent: &AgentHash,
        record: &AgentRecord,
        entries: &[Entry],
        replaces_through: u64,
    ) -> Result<Pushed, KeeperStoreError> {
        // Every check before the first change, so a refused push leaves
        // nothing behind.
        let next_seq = self.agents.get(agent).map_or(1, |a| a.state.next_seq);
        if replaces_through >= next_seq {
            return Err(KeeperStoreError::ReplacesAhead {
                replaces_through,
                newest: next_seq - 1,
            });
        }
        let end = next_seq
            .checked_add(entries.len() as u64)
            .ok_or(KeeperStoreError::SeqExhausted)?;
        let a = self.agents.entry(*agent).or_insert_with(|| MemAgent {
            state: AgentState {
                record: record.clone(),
                next_seq,
                usage: Usage::default(),
            },
            log: BTreeMap::new(),
        });
        let kept = a.log.split_off(&replaces_through.saturating_add(1));
        let freed = usage_of(a.log.values());
        let added = usage_of(entries.iter());
        a.log = kept;
        a.log.extend((next_seq..end).zip(entries.iter().cloned()));
        a.state = AgentState {
            record: record.clone(),
            next_seq: end,
            usage: Usage {
                bytes: a
                    .state
                    .usage
                    .bytes
                    .saturating_add(added.bytes)
                    .saturating_sub(freed.bytes),
                envelopes: a
                    .state
                    .usage
                    .envelopes
                    .saturating_add(added.envelopes)
                    .saturating_sub(freed.envelopes),
            },
        };
        Ok(Pushed {
            first_seq: next_seq,
            usage: a.state.usage,
        })
    }

    fn pull(
        &self,
        agent: &AgentHash,
        since: u64,
        max_bytes: u64,
        max_entries: usize,
    ) -> Result<Page, KeeperStoreError> {
        let mut page = Page::default();
        let Some(a) = self.agents.get(agent) else {
            return Ok(page);
        };
        let mut size = 0u64;
        for (seq, e) in a.log.range((Bound::Excluded(since), Bound::Unbounded)) {
            if !page.entries.is_empty()
                && (size.saturating_add(e.size()) > max_bytes || page.entries.len() >= max_entries)
            {
                page.more = true;
                break;
            }
            size = size.saturating_add(e.size());
            page.entries.push((*seq, e.clone()));
        }
        Ok(page)
    }

    fn prune(&mut self, received_before_ms: u64) -> Result<u64, KeeperStoreError> {
        let mut dropped = 0u64;
        for a in self.agents.values_mut() {
            // Entries are in the order received: the old ones lead.
            let old: Vec<u64> = a
                .log
                .iter()
                .take_while(|(_, e)| e.received_ms < received_before_ms)
                .map(|(seq, _)| *seq)
                .collect();
            if old.is_empty() {
                continue;
            }
            let freed = usage_of(old.iter().filter_map(|seq| a.log.get(seq)));
            for seq in &old {
                a.log.remove(seq);
            }
            a.state.usage.bytes = a.state.usage.bytes.saturating_sub(freed.bytes);
            a.state.usage.envelopes = a.state.usage.envelopes.saturating_sub(freed.envelopes);
            dropped += old.len() as u64;
        }
        Ok(dropped)
    }
}
