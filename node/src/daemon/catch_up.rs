//! Catch-up off the loop: the engine sets aside a sync message that carries
//! a big document ([`nuwa_agent::sync::CatchUp`]); this module runs it on a
//! blocking thread, together with the snapshot that will make it durable
//! (saving and compressing a big document costs as much as the apply), and
//! hands the result back to the loop, which swaps the document in and
//! persists it. Evicted containers that a peer's input needs are read back
//! from the store the same way ([`CatchUps::load`]). The loop keeps serving
//! everything else meanwhile.

use std::collections::BTreeMap;
use std::sync::Arc;

use nuwa_agent::state::{Container, Hash};
use nuwa_agent::sync::{CatchUp, CaughtUp};
use nuwa_store::Storage;
use tokio::sync::mpsc;
use tracing::{debug, warn};

use crate::metrics::{Event, Metrics};
use nuwa_agent::{Agent, Input};

/// Catch-ups whose results may wait in the channel at once; a worker
/// blocks when it is full (the loop drains it every turn).
const FINISHED_MAX: usize = 16;

/// What a worker hands back to the loop.
pub(super) enum Back {
    CaughtUp(Box<Finished>),
    /// An evicted container read from the store (`Ok(None)`: nothing of it
    /// is stored).
    Loaded {
        container: String,
        loaded: Result<Option<Box<Container>>, String>,
    },
}

/// A catch-up back from its worker.
pub(super) struct Finished {
    done: CaughtUp,
    /// The caught-up document saved (and compressed as its container asks),
    /// when it brought enough changes to be persisted as a snapshot.
    snapshot: Option<Vec<u8>>,
}

/// The daemon's side of off-loop catch-ups.
pub(super) struct CatchUps {
    tx: mpsc::Sender<Back>,
    rx: Option<mpsc::Receiver<Back>>,
    /// Snapshots made by workers, by container, with the heads they cover;
    /// taken by the compaction that persists the caught-up document.
    snapshots: BTreeMap<String, (Vec<Hash>, Vec<u8>)>,
}

impl CatchUps {
    pub(super) fn new() -> Self {
        let (tx, rx) = mpsc::channel(FINISHED_MAX);
        CatchUps {
            tx,
            rx: Some(rx),
            snapshots: BTreeMap::new(),
        }
    }

    /// The receiving end, for the loop (once).
    pub(super) fn take_receiver(&mut self) -> Option<mpsc::Receiver<Back>> {
        self.rx.take()
    }

    /// A worker's snapshot of `container` if it covers exactly `heads`.
    pub(super) fn take_snapshot(&mut self, container: &str, heads: &[Hash]) -> Option<Vec<u8>> {
        let (covers, bytes) = self.snapshots.remove(container)?;
        (covers == heads).then_some(bytes)
    }

    /// Whether a worker's snapshot of `container` waits to be written.
    pub(super) fn has_snapshot(&self, container: &str) -> bool {
        self.snapshots.contains_key(container)
    }
}

impl CatchUps {
    /// Runs a catch-up the agent set aside on a blocking thread.
    pub(super) fn start(&mut self, job: CatchUp, agent: &Agent, metrics: &Metrics) {
        metrics.add(Event::CatchUpsOffLoop, 1);
        let container = job.container().to_owned();
        let compression = agent.compression_of(&container);
        debug!(container, "catch-up off the loop");
        let tx = self.tx.clone();
        tokio::task::spawn_blocking(move || {
            let finished = run(job, compression);
            // The loop is gone only at shutdown, and then nothing waits
            // for this result: the peer sends it again next time.
            let _ = tx.blocking_send(Back::CaughtUp(Box::new(finished)));
        });
    }

    /// Reads the evicted `container` from the store on a blocking thread
    /// (a million entries take seconds), for a peer's input that waits.
    pub(super) fn load(
        &mut self,
        container: String,
        store: Arc<dyn Storage>,
        actor: Vec<u8>,
        metrics: &Metrics,
    ) {
        metrics.add(Event::ContainersLoaded, 1);
        metrics.add(Event::ContainersLoadedOffLoop, 1);
        debug!(container, "loading an evicted container off the loop");
        let tx = self.tx.clone();
        tokio::task::spawn_blocking(move || {
            let loaded = super::exec::open::load_container(store.as_ref(), &actor, &container)
                .map(|l| l.map(|l| Box::new(l.container)))
                .map_err(|e| format!("{e:#}"));
            // As above: at shutdown nobody waits for it.
            let _ = tx.blocking_send(Back::Loaded { container, loaded });
        });
    }

    /// A worker's result came back, as the agent's input. A catch-up's
    /// snapshot waits for the compaction that persists it; the agent gets
    /// the caught-up document.
    pub(super) fn returned(&mut self, back: Back) -> (String, Input) {
        let f = match back {
            Back::CaughtUp(f) => *f,
            Back::Loaded { container, loaded } => {
                let input = Input::Loaded {
                    container: container.clone(),
                    loaded,
                };
                return (container, input);
            }
        };
        let container = f.done.container().to_owned();
        debug!(done = ?f.done, "catch-up back");
        if let Some(snapshot) = f.snapshot {
            self.snapshots
                .insert(container.clone(), (f.done.doc().heads(), snapshot));
        }
        (container, Input::CaughtUp(Box::new(f.done)))
    }

    /// After the agent took a catch-up back: a snapshot nobody wrote was
    /// superseded (the container moved meanwhile; another round runs).
    pub(super) fn forget_snapshot(&mut self, container: &str) {
        if self.snapshots.remove(container).is_some() {
            debug!(container, "catch-up snapshot superseded");
        }
    }
}

fn run(job: CatchUp, compression: Option<nuwa_agent::asm_model::model::Compression>) -> Finished {
    let done = job.run();
    // A whole document is always persisted as a snapshot: the document as
    // it came (it loaded strictly, as a snapshot loads), else saved here,
    // so that the loop does not save it.
    // So is one that brought as much as a log due for compaction holds
    // (smaller than the changes, and written in one piece).
    let brought = nuwa_agent::storage::Logged {
        changes: done.new_changes() as u64,
        bytes: done.new_change_bytes() as u64,
    };
    let snapshot = if done.is_whole() || nuwa_agent::storage::compaction_due(brought, 0) {
        let saved = done.whole_document().unwrap_or_else(|| done.doc().save());
        match compression {
            None => Some(saved),
            Some(c) => match nuwa_agent::asm_model::snapshot::compress(&saved, c) {
                Ok(bytes) => Some(bytes),
                Err(e) => {
                    warn!(container = done.container(), error = %e, "cannot compress the catch-up snapshot; the loop saves it");
                    None
                }
            },
        }
    } else {
        None
    };
    Finished { done, snapshot }
}
