//! [`SledKeeperStore`]: the keeper's records and envelope logs in sled, behind
//! [`nuwa_keeper::KeeperStore`]. The keeper decides what to store; this
//! module only lays it out, commits it atomically and makes it durable.
//!
//! # Layout
//!
//! The layout the keeper wrote before its storage moved here, unchanged, so
//! an existing keeper directory opens as it is (`tests/keeper_store.rs`
//! opens one written then, `tests/fixtures/keeper-v1`):
//!
//! | tree      | key                        | value                                   |
//! |-----------|----------------------------|-----------------------------------------|
//! | `agents`  | agent hash (32 bytes)      | JSON `{did, doc, next_seq, last_push_ms}` |
//! | `entries` | agent hash ‖ seq (u64 BE)  | received ms (u64 BE) ‖ envelope bytes    |
//!
//! The agent hash is the SHA-256 of the DID, and `seq` is big-endian so an
//! agent's entries sort by sequence number under its prefix. Unlike
//! [`crate::SledStore`], nothing is sealed with an at-rest key: envelopes
//! arrive sealed under the agent's sync key, which the keeper never holds,
//! and the records hold the DID proof's document, public anyway.
//!
//! # Durability
//!
//! A push (its entries, the entries it replaces, the agent record) is one
//! sled transaction over both trees, flushed before [`KeeperStore::push`]
//! returns, so a crash keeps all of it or none, and everything acknowledged.
//! Every agent's record and usage is read once at open (the usage by
//! scanning its entries) and kept in memory, where the keeper asks for it on
//! every request; only entries are read from sled afterwards.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::fmt;
use std::path::{Path, PathBuf};

use nuwa_keeper::{
    AgentDoc, AgentHash, AgentRecord, AgentState, ENTRY_HEADER_BYTES, Entry, KeeperStore,
    KeeperStoreError, Page, Pushed, Usage,
};
use serde::{Deserialize, Serialize};
use sled::Tree;
use sled::transaction::{ConflictableTransactionError, TransactionError, Transactional};

use crate::sled_store::open_db;

const AGENTS_TREE: &str = "agents";
const ENTRIES_TREE: &str = "entries";

/// The keeper's store in a sled database.
pub struct SledKeeperStore {
    path: PathBuf,
    db: sled::Db,
    entries: Tree,
    agents_tree: Tree,
    /// Every agent on disk, as committed: written after each commit, so it
    /// never runs ahead of sled.
    agents: BTreeMap<AgentHash, AgentState>,
}

/// An agent record as it is written (field order and names are the format).
#[derive(Serialize)]
struct DiskRecordOut<'a> {
    did: &'a str,
    doc: &'a Option<AgentDoc>,
    next_seq: u64,
    last_push_ms: &'a BTreeMap<String, u64>,
}

/// An agent record as it is read. Records written before DID proofs have no
/// `doc`, and before restart floors no `last_push_ms`.
#[derive(Deserialize)]
struct DiskRecordIn {
    did: String,
    #[serde(default)]
    doc: Option<AgentDoc>,
    next_seq: u64,
    #[serde(default)]
    last_push_ms: BTreeMap<String, u64>,
}

fn entry_key(agent: &AgentHash, seq: u64) -> [u8; 40] {
    let mut k = [0u8; 40];
    k[..32].copy_from_slice(agent);
    k[32..].copy_from_slice(&seq.to_be_bytes());
    k
}

fn entry_value(e: &Entry) -> Vec<u8> {
    let mut v = Vec::with_capacity(ENTRY_HEADER_BYTES as usize + e.envelope.len());
    v.extend_from_slice(&e.received_ms.to_be_bytes());
    v.extend_from_slice(&e.envelope);
    v
}

/// The receipt time of a stored value; 0 for one too short to hold it, so
/// retention drops it first.
fn received_ms(value: &[u8]) -> u64 {
    value
        .get(..8)
        .and_then(|b| b.try_into().ok())
        .map_or(0, u64::from_be_bytes)
}

fn backend(op: &'static str) -> impl Fn(sled::Error) -> KeeperStoreError {
    move |e| KeeperStoreError::Backend {
        op,
        source: Box::new(e),
    }
}

fn not_durable(e: sled::Error) -> KeeperStoreError {
    KeeperStoreError::NotDurable {
        source: Box::new(e),
    }
}

impl SledKeeperStore {
    /// Opens (or creates) the keeper's store in `dir`, reading every agent's
    /// record and usage. A lock held by a store of this process that was
    /// just dropped is waited for, briefly; one held by another process is
    /// refused.
    ///
    /// # Errors
    /// [`KeeperStoreError::Backend`] if sled cannot open `dir` or read it,
    /// [`KeeperStoreError::Corrupt`] for an agent record that cannot be read.
    pub fn open(dir: &Path) -> Result<SledKeeperStore, KeeperStoreError> {
        // sled's default page cache, as the keeper had before its store
        // moved here.
        let db = open_db(dir, None).map_err(backend("opening the database"))?;
        let entries = db
            .open_tree(ENTRIES_TREE)
            .map_err(backend("opening the entries tree"))?;
        let agents_tree = db
            .open_tree(AGENTS_TREE)
            .map_err(backend("opening the agents tree"))?;
        let mut agents = BTreeMap::new();
        for item in agents_tree.iter() {
            let (k, v) = item.map_err(backend("reading agent records"))?;
            let hash: AgentHash = k
                .as_ref()
                .try_into()
                .map_err(|_| KeeperStoreError::Corrupt {
                    what: "agent record".to_owned(),
                    reason: format!("its key is {} bytes, not 32", k.len()),
                })?;
            let disk: DiskRecordIn =
                serde_json::from_slice(&v).map_err(|e| KeeperStoreError::Corrupt {
                    what: "agent record".to_owned(),
                    reason: e.to_string(),
                })?;
            let mut usage = Usage::default();
            for e in entries.scan_prefix(hash) {
                let (_, v) = e.map_err(backend("reading entries"))?;
                usage.bytes += v.len() as u64;
                usage.envelopes += 1;
            }
            agents.insert(
                hash,
                AgentState {
                    record: AgentRecord {
                        did: disk.did,
                        doc: disk.doc,
                        last_push_ms: disk.last_push_ms,
                    },
                    next_seq: disk.next_seq,
                    usage,
                },
            );
        }
        Ok(SledKeeperStore {
            path: dir.to_owned(),
            db,
            entries,
            agents_tree,
            agents,
        })
    }

    /// The directory this store lives in.
    #[must_use]
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl fmt::Debug for SledKeeperStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SledKeeperStore")
            .field("path", &self.path)
            .field("agents", &self.agents.len())
            .finish_non_exhaustive()
    }
}

impl KeeperStore for SledKeeperStore {
    fn agent_count(&self) -> usize {
        self.agents.len()
    }

    fn agent_hashes(&self) -> Vec<AgentHash> {
        self.agents.keys().copied().collect()
    }

    fn agent(&self, agent: &AgentHash) -> Option<AgentState> {
        self.agents.get(agent).cloned()
    }

    fn usage_through(&self, agent: &AgentHash, through: u64) -> Result<Usage, KeeperStoreError> {
        let mut usage = Usage::default();
        for item in self
            .entries
            .range(entry_key(agent, 0)..=entry_key(agent, through))
        {
            let (_, v) = item.map_err(backend("reading entries"))?;
            usage.bytes += v.len() as u64;
            usage.envelopes += 1;
        }
        Ok(usage)
    }

    fn push(
        &mut self,
        agent: &AgentHash,
        record: &AgentRecord,
        entries: &[Entry],
        replaces_through: u64,
    ) -> Result<Pushed, KeeperStoreError> {
        let (next_seq, used) = self
            .agents
            .get(agent)
            .map_or((1, Usage::default()), |a| (a.next_seq, a.usage));
        if replaces_through >= next_seq {
            return Err(KeeperStoreError::ReplacesAhead {
                replaces_through,
                newest: next_seq - 1,
            });
        }
        let end = next_seq
            .checked_add(entries.len() as u64)
            .ok_or(KeeperStoreError::SeqExhausted)?;
        // Everything is read and encoded before the transaction, whose
        // closure sled may run more than once.
        let mut batch = sled::Batch::default();
        let mut freed = Usage::default();
        if replaces_through > 0 {
            for item in self
                .entries
                .range(entry_key(agent, 0)..=entry_key(agent, replaces_through))
            {
                let (k, v) = item.map_err(backend("reading entries to replace"))?;
                freed.bytes += v.len() as u64;
                freed.envelopes += 1;
                batch.remove(k);
            }
        }
        let mut added = 0u64;
        for (seq, e) in (next_seq..end).zip(entries) {
            let value = entry_value(e);
            added += value.len() as u64;
            batch.insert(&entry_key(agent, seq)[..], value);
        }
        let record_bytes = serde_json::to_vec(&DiskRecordOut {
            did: &record.did,
            doc: &record.doc,
            next_seq: end,
            last_push_ms: &record.last_push_ms,
        })
        .map_err(|e| KeeperStoreError::Backend {
            op: "encoding an agent record",
            source: Box::new(e),
        })?;
        (&self.entries, &self.agents_tree)
            .transaction(|(entries_tx, agents_tx)| {
                entries_tx.apply_batch(&batch)?;
                agents_tx.insert(&agent[..], record_bytes.as_slice())?;
                Ok::<_, ConflictableTransactionError<Infallible>>(())
            })
            .map_err(|e| match e {
                TransactionError::Storage(source) => KeeperStoreError::Backend {
                    op: "committing a push",
                    source: Box::new(source),
                },
                TransactionError::Abort(never) => match never {},
            })?;
        // Committed: the cache follows sled even if the flush fails below,
        // so a retried push never reuses these sequence numbers.
        let usage = Usage {
            bytes: used.bytes.saturating_add(added).saturating_sub(freed.bytes),
            envelopes: used
                .envelopes
                .saturating_add(entries.len() as u64)
                .saturating_sub(freed.envelopes),
        };
        self.agents.insert(
            *agent,
            AgentState {
                record: record.clone(),
                next_seq: end,
                usage,
            },
        );
        self.db.flush().map_err(not_durable)?;
        Ok(Pushed {
            first_seq: next_seq,
            usage,
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
        // No entry can come after the last sequence number.
        let Some(first) = since.checked_add(1) else {
            return Ok(page);
        };
        let mut size = 0u64;
        for item in self
            .entries
            .range(entry_key(agent, first)..=entry_key(agent, u64::MAX))
        {
            let (k, v) = item.map_err(backend("reading entries"))?;
            let len = v.len() as u64;
            if !page.entries.is_empty()
                && (size.saturating_add(len) > max_bytes || page.entries.len() >= max_entries)
            {
                page.more = true;
                break;
            }
            let seq = k
                .get(32..40)
                .and_then(|b| b.try_into().ok())
                .map_or(0, u64::from_be_bytes);
            let envelope = v
                .get(ENTRY_HEADER_BYTES as usize..)
                .ok_or_else(|| KeeperStoreError::Corrupt {
                    what: format!("entry {seq}"),
                    reason: format!("it is {len} bytes, too short for its receipt time"),
                })?
                .to_vec();
            size = size.saturating_add(len);
            page.entries.push((
                seq,
                Entry {
                    received_ms: received_ms(&v),
                    envelope,
                },
            ));
        }
        Ok(page)
    }

    fn prune(&mut self, received_before_ms: u64) -> Result<u64, KeeperStoreError> {
        let mut dropped = 0u64;
        for (hash, state) in &mut self.agents {
            let mut batch = sled::Batch::default();
            let mut freed = Usage::default();
            for item in self.entries.scan_prefix(hash) {
                let (k, v) = item.map_err(backend("reading entries to prune"))?;
                if received_ms(&v) >= received_before_ms {
                    // Entries are in the order received.
                    break;
                }
                freed.bytes += v.len() as u64;
                freed.envelopes += 1;
                batch.remove(k);
            }
            if freed.envelopes > 0 {
                self.entries
                    .apply_batch(batch)
                    .map_err(backend("dropping old entries"))?;
                state.usage.bytes = state.usage.bytes.saturating_sub(freed.bytes);
                state.usage.envelopes = state.usage.envelopes.saturating_sub(freed.envelopes);
                dropped += freed.envelopes;
            }
        }
        if dropped > 0 {
            self.db.flush().map_err(not_durable)?;
        }
        Ok(dropped)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // Goal: the record format is the one the keeper wrote before this
    // module: every agent record of the pre-trait fixture decodes and
    // encodes again to the same bytes.
    #[test]
    fn agent_records_round_trip_byte_for_byte() {
        let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/keeper-v1");
        let dir = tempfile::tempdir().expect("tempdir");
        for f in ["conf", "db"] {
            std::fs::copy(fixture.join(f), dir.path().join(f)).expect("copy the fixture");
        }
        let db = open_db(dir.path(), None).expect("open");
        let agents = db.open_tree(AGENTS_TREE).expect("agents tree");
        let mut n = 0;
        for item in agents.iter() {
            let (_, v) = item.expect("read");
            let disk: DiskRecordIn = serde_json::from_slice(&v).expect("decode");
            let again = serde_json::to_vec(&DiskRecordOut {
                did: &disk.did,
                doc: &disk.doc,
                next_seq: disk.next_seq,
                last_push_ms: &disk.last_push_ms,
            })
            .expect("encode");
            assert_eq!(String::from_utf8_lossy(&again), String::from_utf8_lossy(&v));
            n += 1;
        }
        assert_eq!(n, 2, "both agents of the fixture");
    }
}
