//! Small metadata records (the known-peers cache, devices' names and last
//! seen times) written off the daemon loop. A sled write with its flush
//! takes milliseconds, and these are caches: the loop hands the newest
//! value to one writer task and moves on. The task writes in order and
//! coalesces, so for each key the last value handed over is the last one
//! written. Bounded: a full queue drops the value (a later save carries a
//! newer one), counted in the log at debug level.

use std::collections::BTreeMap;
use std::sync::Arc;

use nuwa_store::Storage;
use tokio::sync::mpsc;
use tracing::{debug, warn};

/// Values waiting to be written.
const QUEUE: usize = 64;

enum Msg {
    Put(String, Vec<u8>),
    /// Answered once everything handed over before it is written.
    Flush(tokio::sync::oneshot::Sender<()>),
}

pub(super) struct MetaWriter {
    tx: mpsc::Sender<Msg>,
}

impl MetaWriter {
    /// Starts the writer; it stops when the `MetaWriter` is dropped, after
    /// writing what it was handed.
    pub(super) fn spawn(store: Arc<dyn Storage>) -> Self {
        let (tx, mut rx) = mpsc::channel::<Msg>(QUEUE);
        tokio::spawn(async move {
            while let Some(first) = rx.recv().await {
                let mut batch: BTreeMap<String, Vec<u8>> = BTreeMap::new();
                let mut flushes = Vec::new();
                let mut next = Some(first);
                while let Some(msg) = next {
                    match msg {
                        Msg::Put(k, v) => {
                            batch.insert(k, v);
                        }
                        Msg::Flush(done) => flushes.push(done),
                    }
                    next = rx.try_recv().ok();
                }
                for (key, value) in batch {
                    let store = store.clone();
                    let k = key.clone();
                    let r = tokio::task::spawn_blocking(move || store.put_meta(&k, &value)).await;
                    match r {
                        Ok(Ok(())) => {}
                        Ok(Err(e)) => warn!(%key, error = %e, "cannot persist metadata"),
                        Err(e) => warn!(%key, error = %e, "metadata writer panicked"),
                    }
                }
                for done in flushes {
                    let _ = done.send(());
                }
            }
        });
        MetaWriter { tx }
    }

    /// Hands `value` over for `key`; never waits.
    pub(super) fn put(&self, key: impl Into<String>, value: Vec<u8>) {
        let key = key.into();
        if self.tx.try_send(Msg::Put(key.clone(), value)).is_err() {
            debug!(%key, "metadata writer busy; dropped a cache update");
        }
    }

    /// Waits until everything handed over so far is written (shutdown).
    ///
    /// Cancel safety: cancelling only stops the wait.
    pub(super) async fn flush(&self) {
        let (done, wait) = tokio::sync::oneshot::channel();
        if self.tx.send(Msg::Flush(done)).await.is_ok() {
            let _ = wait.await;
        }
    }
}
