//! The store's side of persisting: one group commit per turn, each
//! container's log sequence numbers and what it logged since its
//! snapshot, the heads records that let start-up skip loading documents,
//! and compaction (when the core's rule, `nuwa_agent::storage`, says the
//! log is due: the document copied on the loop, saved and written on a
//! low-priority thread; or at once when a batch that big arrives whole).
//! Every durable batch is handed to the reader before anything is
//! acknowledged, and reported as a change event.

use std::collections::BTreeMap;
use std::sync::Arc;

use anyhow::{Context, Result};
use nuwa_agent::Agent;
use nuwa_agent::storage::heads::{self, HeadsRecord};
use nuwa_agent::storage::{COMPACT_AFTER_CHANGES, Logged, compaction_due};
use nuwa_agent::sync::Origin;
use nuwa_store::Storage;
use tokio::sync::oneshot;
use tracing::debug;

use super::super::catch_up::CatchUps;
use super::super::reader::ReaderHandle;
use super::open::LoadedContainer;
use crate::home;
use crate::metrics::{Event, Metrics};

/// Per container: the last log sequence number, what was logged since the
/// snapshot and the snapshot's stored size (once known).
#[derive(Default)]
pub(in crate::daemon) struct Ledger {
    pub(in crate::daemon) last_seq: BTreeMap<String, u64>,
    pub(in crate::daemon) logged: BTreeMap<String, Logged>,
    snapshot_bytes: BTreeMap<String, u64>,
    /// Compactions off the loop (one per container): their snapshot's size.
    compacting: BTreeMap<String, oneshot::Receiver<Result<u64>>>,
}

/// What writing needs beyond the ledger.
pub(super) struct StoreIo<'a> {
    pub store: &'a Arc<dyn Storage>,
    pub reader: &'a ReaderHandle,
    pub events: &'a crate::api::ChangeEvents,
    pub catch_ups: &'a mut CatchUps,
    pub agent: &'a Agent,
    pub metrics: &'a Metrics,
}

impl Ledger {
    /// A container read back from the store replaces what was known of it.
    pub(super) fn reloaded(&mut self, name: &str, loaded: &LoadedContainer) {
        self.last_seq.insert(name.to_owned(), loaded.last_seq);
        self.logged.insert(name.to_owned(), loaded.logged);
        self.snapshot_bytes
            .insert(name.to_owned(), loaded.snapshot_bytes);
    }

    /// Makes every batch durable: one group commit (one flush) for all the
    /// containers of this turn, then reports each as a change event.
    pub(super) async fn persist(
        &mut self,
        mut io: StoreIo<'_>,
        batches: BTreeMap<(String, Origin), Vec<Vec<u8>>>,
    ) -> Result<()> {
        self.reap()?;
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
            let log = self.logged.entry(container.clone()).or_default();
            log.add(Logged::of(&changes));
            let snapshot = self.snapshot_bytes.get(&container).copied().unwrap_or(0);
            if compaction_due(*log, snapshot) && !self.compacting.contains_key(&container) {
                self.compact_off_loop(&io, &container)?;
            }
        }
        Ok(())
    }

    /// Starts compacting `container` on a thread of its own, at the lowest
    /// CPU priority: the document is copied here (12 ms at a million
    /// entries) and saved there (200 ms). The snapshot covers what was
    /// logged when it was copied, and drops only that from the log.
    fn compact_off_loop(&mut self, io: &StoreIo<'_>, container: &str) -> Result<()> {
        let Some(doc) = io.agent.session().engine().container(container) else {
            return Ok(());
        };
        let doc = doc.fork();
        let covers = self.last_seq.get(container).copied().unwrap_or(0);
        let compression = io.agent.compression_of(container);
        let (store, name) = (io.store.clone(), container.to_owned());
        let (tx, rx) = oneshot::channel();
        debug!(container, covers, "compacting off the loop");
        io.metrics.add(Event::CompactionsOffLoop, 1);
        let compact = move || -> Result<u64> {
            #[cfg(target_os = "linux")]
            // SAFETY: no preconditions. Linux only: there `0` is this thread.
            unsafe {
                libc::setpriority(libc::PRIO_PROCESS, 0, 19)
            };
            let mut snapshot = doc.save();
            drop(doc);
            if let Some(c) = compression {
                snapshot = nuwa_agent::asm_model::snapshot::compress(&snapshot, c)?;
            }
            store
                .save_snapshot(&name, &snapshot, covers)
                .with_context(|| format!("cannot compact container {name:?}"))?;
            Ok(snapshot.len() as u64)
        };
        std::thread::Builder::new()
            .name("nuwa-compact".into())
            .spawn(move || tx.send(compact()))
            .context("cannot start a compaction thread")?;
        self.logged.insert(container.to_owned(), Logged::default());
        self.compacting.insert(container.to_owned(), rx);
        Ok(())
    }

    /// Takes in the compactions that finished: their snapshot's size, or
    /// their error (the daemon stops, as for any write that failed).
    fn reap(&mut self) -> Result<()> {
        let mut done = Vec::new();
        for (c, rx) in &mut self.compacting {
            match rx.try_recv() {
                Err(oneshot::error::TryRecvError::Empty) => {}
                r => done.push((c.clone(), r.context("a compaction thread died"))),
            }
        }
        for (c, r) in done {
            self.compacting.remove(&c);
            self.snapshot_bytes.insert(c, r??);
        }
        Ok(())
    }

    /// Waits for the compaction of `container` running off the loop, or
    /// of every container (before another snapshot of it is written, and
    /// at shutdown).
    pub(super) async fn settle(&mut self, container: Option<&str>) -> Result<()> {
        let jobs: Vec<_> = match container {
            Some(c) => self.compacting.remove_entry(c).into_iter().collect(),
            None => std::mem::take(&mut self.compacting).into_iter().collect(),
        };
        for (c, rx) in jobs {
            let bytes = rx.await.context("a compaction thread died")??;
            self.snapshot_bytes.insert(c, bytes);
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
    /// will be once the append is done (see `nuwa_agent::storage::heads`).
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
                    self.logged.get(c).map_or(0, |l| l.changes),
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
                Some((heads::key(c), record.encode()?))
            })
            .collect()
    }

    /// Saves `container` as one snapshot covering its whole log.
    pub(super) async fn compact(&mut self, io: StoreIo<'_>, container: &str) -> Result<()> {
        self.settle(Some(container)).await?;
        let Some(doc) = io.agent.session().engine().container(container) else {
            return Ok(());
        };
        // Every logged change up to `covers` is already in the document.
        // A catch-up's worker may have saved exactly this document already.
        let heads = doc.heads();
        let (mut snapshot, by_worker) = match io.catch_ups.take_snapshot(container, &heads) {
            // Already compressed as the container asks.
            Some(ready) => (ready, true),
            None => (doc.save(), false),
        };
        if let (false, Some(c)) = (by_worker, io.agent.compression_of(container)) {
            snapshot = nuwa_agent::asm_model::snapshot::compress(&snapshot, c)?;
        }
        let covers = self.last_seq.get(container).copied().unwrap_or(0);
        let store = io.store.clone();
        let name = container.to_owned();
        let bytes = snapshot.len() as u64;
        tokio::task::spawn_blocking(move || store.save_snapshot(&name, &snapshot, covers))
            .await
            .context("store task panicked")?
            .with_context(|| format!("cannot compact container {container:?}"))?;
        self.logged.insert(container.to_owned(), Logged::default());
        self.snapshot_bytes.insert(container.to_owned(), bytes);
        debug!(container, bytes, by_worker, "compacted");
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
        metrics: io.metrics,
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
        let _ = io.events.send(Arc::new(nuwa_agent::api::ChangeEvent {
            container: container.to_owned(),
            changes: n,
            heads,
            origin: origin.as_str(),
            at_unix_ms: home::now_ms(),
        }));
    }
}
