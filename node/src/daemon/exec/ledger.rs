//! The store's side of persisting: one group commit per turn, each
//! container's log sequence numbers and changes logged since its
//! snapshot, the heads records that let start-up skip loading documents,
//! and compaction (a container saved as one snapshot once 2,048 changes
//! were logged after the last one, or when a batch that big arrives at
//! once). Every durable batch is handed to the reader before anything is
//! acknowledged, and reported as a change event.

use std::collections::BTreeMap;
use std::sync::Arc;

use anyhow::{Context, Result};
use nuwa_agent::Agent;
use nuwa_agent::sync::Origin;
use nuwa_store::Storage;
use tracing::debug;

use super::super::catch_up::CatchUps;
use super::super::heads_record::{self, HeadsRecord};
use super::super::reader::ReaderHandle;
use super::open::LoadedContainer;
use crate::home;

/// Changes logged since the last snapshot before a container is compacted.
pub(in crate::daemon) const COMPACT_AFTER_CHANGES: u64 = 2048;

/// Per container: the last log sequence number, and changes logged since
/// the snapshot.
#[derive(Default)]
pub(in crate::daemon) struct Ledger {
    pub(in crate::daemon) last_seq: BTreeMap<String, u64>,
    pub(in crate::daemon) logged: BTreeMap<String, u64>,
}

/// What writing needs beyond the ledger.
pub(super) struct StoreIo<'a> {
    pub store: &'a Arc<dyn Storage>,
    pub reader: &'a ReaderHandle,
    pub events: &'a tokio::sync::broadcast::Sender<nuwa_agent::api::ChangeEvent>,
    pub catch_ups: &'a mut CatchUps,
    pub agent: &'a Agent,
}

impl Ledger {
    /// A container read back from the store replaces what was known of it.
    pub(super) fn reloaded(&mut self, name: &str, loaded: &LoadedContainer) {
        self.last_seq.insert(name.to_owned(), loaded.last_seq);
        self.logged.insert(name.to_owned(), loaded.logged);
    }

    /// Makes every batch durable: one group commit (one flush) for all the
    /// containers of this turn, then reports each as a change event.
    pub(super) async fn persist(
        &mut self,
        mut io: StoreIo<'_>,
        batches: BTreeMap<(String, Origin), Vec<Vec<u8>>>,
    ) -> Result<()> {
        let mut logged: Vec<(String, Origin, Vec<Vec<u8>>)> = Vec::with_capacity(batches.len());
        for ((container, origin), changes) in batches {
            let n = changes.len() as u64;
            let big = n >= COMPACT_AFTER_CHANGES || io.catch_ups.has_snapshot(&container);
            let document = io.agent.session().engine().container(&container).is_some();
            if big && document {
                // A batch this large (a cold sync, a long partition
                // healing) would be compacted right after being logged. The
                // document already holds every one of these changes, so one
                // snapshot makes them durable at a fraction of the cost of
                // logging each (a 100,000-change cold sync: one ~0.5 MB
                // write instead of ~90 MB of log). Nothing is acknowledged
                // before it returns.
                drop(changes);
                self.compact(reborrow(&mut io), &container).await?;
                // The reader reloads it from the snapshot when next asked.
                io.reader.reset(&container);
                emit_change_event(&io, &container, n as usize, origin);
            } else {
                logged.push((container, origin, changes));
            }
        }
        if logged.is_empty() {
            return Ok(());
        }
        let records = self.heads_records(io.agent, &logged);
        // On the loop's own thread, which waits for it in any case: a hand-off
        // to a blocking thread cost 80-100 µs of wake-up per write on a busy
        // 2-core machine, on every device a change reaches (the loop runs in
        // `block_on` on the main thread, never on a runtime worker).
        tracing::trace!(target: "nuwa_path", "to store");
        let batches: Vec<(&str, &[Vec<u8>])> = logged
            .iter()
            .map(|(c, _, changes)| (c.as_str(), changes.as_slice()))
            .collect();
        let seqs = io
            .store
            .append_many_with_meta(&batches, &records)
            .context("cannot persist changes")?;
        tracing::trace!(target: "nuwa_path", "flushed");
        for ((container, origin, changes), seq) in logged.into_iter().zip(seqs) {
            let n = changes.len() as u64;
            // Durable: readers may see it now (before any acknowledgement).
            io.reader.changes(&container, &changes);
            self.last_seq.insert(container.clone(), seq);
            emit_change_event(&io, &container, n as usize, origin);
            let count = self.logged.entry(container.clone()).or_default();
            *count += n;
            if *count >= COMPACT_AFTER_CHANGES {
                self.compact(reborrow(&mut io), &container).await?;
            }
        }
        Ok(())
    }

    /// A whole document came into an empty container (a cold sync): it is
    /// made durable as one snapshot (a catch-up's worker has usually saved
    /// it already), then reported as a change event of `n` changes.
    pub(super) async fn persist_whole(
        &mut self,
        mut io: StoreIo<'_>,
        container: &str,
        n: usize,
    ) -> Result<()> {
        self.compact(reborrow(&mut io), container).await?;
        // The reader reloads it from the snapshot when next asked.
        io.reader.reset(container);
        emit_change_event(&io, container, n, Origin::Peer);
        Ok(())
    }

    /// The heads records of the containers about to be logged, as they
    /// will be once the append is done (see `heads_record.rs`).
    fn heads_records(
        &self,
        agent: &Agent,
        logged: &[(String, Origin, Vec<Vec<u8>>)],
    ) -> Vec<(String, Vec<u8>)> {
        let mut after: BTreeMap<&str, (u64, u64)> = BTreeMap::new();
        for (c, _, changes) in logged {
            let n = changes.len() as u64;
            let e = after.entry(c.as_str()).or_insert_with(|| {
                (
                    self.last_seq.get(c).copied().unwrap_or(0),
                    self.logged.get(c).copied().unwrap_or(0),
                )
            });
            e.0 += n;
            e.1 += n;
        }
        let engine = agent.session().engine();
        after
            .into_iter()
            .filter_map(|(c, (last_seq, logged))| {
                let record = HeadsRecord {
                    heads: engine.heads_of(c)?,
                    changes: engine.change_count_of(c)? as u64,
                    last_seq,
                    logged,
                };
                Some((heads_record::key(c), record.encode()?))
            })
            .collect()
    }

    /// Saves `container` as one snapshot covering its whole log.
    pub(super) async fn compact(&mut self, io: StoreIo<'_>, container: &str) -> Result<()> {
        let Some(doc) = io.agent.session().engine().container(container) else {
            return Ok(());
        };
        // Every logged change up to `covers` is already in the document.
        // A catch-up's worker may have saved exactly this document already.
        let heads = doc.heads();
        let (mut snapshot, final_form) = match io.catch_ups.take_snapshot(container, &heads) {
            // Already compressed as the container asks.
            Some(ready) => {
                debug!(
                    container,
                    bytes = ready.len(),
                    "snapshot saved off the loop"
                );
                (ready, true)
            }
            None => (doc.save(), false),
        };
        if let (false, Some(c)) = (final_form, io.agent.compression_of(container)) {
            let plain = snapshot.len();
            snapshot = nuwa_agent::asm_model::snapshot::compress(&snapshot, c)?;
            debug!(
                container,
                plain,
                stored = snapshot.len(),
                "compressed snapshot"
            );
        }
        let covers = self.last_seq.get(container).copied().unwrap_or(0);
        let store = io.store.clone();
        let name = container.to_owned();
        tokio::task::spawn_blocking(move || store.save_snapshot(&name, &snapshot, covers))
            .await
            .context("store task panicked")?
            .with_context(|| format!("cannot compact container {container:?}"))?;
        self.logged.insert(container.to_owned(), 0);
        debug!(container, "compacted");
        Ok(())
    }
}

fn reborrow<'b>(io: &'b mut StoreIo<'_>) -> StoreIo<'b> {
    StoreIo {
        store: io.store,
        reader: io.reader,
        events: io.events,
        catch_ups: io.catch_ups,
        agent: io.agent,
    }
}

fn emit_change_event(io: &StoreIo<'_>, container: &str, n: usize, origin: Origin) {
    if io.events.receiver_count() > 0 {
        tracing::trace!(target: "nuwa_path", "event");
        let heads = io
            .agent
            .session()
            .engine()
            .heads_of(container)
            .map(|h| h.iter().map(hex::encode).collect())
            .unwrap_or_default();
        let _ = io.events.send(nuwa_agent::api::ChangeEvent {
            container: container.to_owned(),
            changes: n,
            heads,
            origin: origin.as_str(),
            at_unix_ms: home::now_ms(),
        });
    }
}
