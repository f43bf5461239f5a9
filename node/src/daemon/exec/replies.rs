//! API requests waiting for the agent's answer: the channel each one's
//! reply goes back on, by request id, and for `device provision` the lock
//! on the new home until it is written. Answering a write records how long
//! it took to be acknowledged durable.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

use nuwa_agent::RequestId;
use nuwa_agent::api::{
    ApiError, ApproveReply, BatchReply, ErrorCode, PutReply, Reply, RevokeReply,
};
use serde_json::Value;
use tokio::sync::oneshot;

use crate::home::HomeLock;
use crate::metrics::Metrics;

/// Where one request's answer goes.
pub(in crate::daemon) enum Waiting {
    Status(oneshot::Sender<nuwa_agent::status::Status>),
    Devices(oneshot::Sender<Vec<nuwa_agent::devices::DeviceEntry>>),
    Put(oneshot::Sender<Result<PutReply, ApiError>>),
    Revoke(oneshot::Sender<Result<RevokeReply, ApiError>>),
    Approve(oneshot::Sender<Result<ApproveReply, ApiError>>),
    Value(oneshot::Sender<Result<Value, ApiError>>),
    Batch(oneshot::Sender<Result<BatchReply, ApiError>>),
}

#[derive(Default)]
pub(in crate::daemon) struct Replies {
    waiting: BTreeMap<RequestId, (Waiting, Instant)>,
    next_id: u64,
    /// Locks on new homes, held until they are written.
    homes: BTreeMap<RequestId, HomeLock>,
    /// Requests whose effects failed after the agent answered them.
    failed: BTreeMap<RequestId, ApiError>,
    metrics: Option<Arc<Metrics>>,
}

impl Replies {
    pub(in crate::daemon) fn new(metrics: Arc<Metrics>) -> Self {
        Replies {
            metrics: Some(metrics),
            ..Replies::default()
        }
    }

    /// Remembers where a request's answer goes; returns its id.
    pub(in crate::daemon) fn wait(&mut self, w: Waiting) -> RequestId {
        self.next_id += 1;
        let id = RequestId(self.next_id);
        self.waiting.insert(id, (w, Instant::now()));
        id
    }

    pub(super) fn hold_home_lock(&mut self, id: RequestId, lock: HomeLock) {
        self.homes.insert(id, lock);
    }

    pub(super) fn take_home_lock(&mut self, id: RequestId) -> Option<HomeLock> {
        self.homes.remove(&id)
    }

    /// The request's answer, when it comes, is this error instead.
    pub(super) fn fail_later(&mut self, id: RequestId, e: ApiError) {
        self.failed.insert(id, e);
    }

    /// Sends a request's answer.
    pub(in crate::daemon) fn answer(&mut self, id: RequestId, result: Result<Reply, ApiError>) {
        self.homes.remove(&id);
        let result = match self.failed.remove(&id) {
            Some(e) => Err(e),
            None => result,
        };
        let Some((waiting, started)) = self.waiting.remove(&id) else {
            return;
        };
        let metrics = self.metrics.as_deref();
        if !matches!(waiting, Waiting::Status(_) | Waiting::Devices(_)) {
            if let Some(m) = metrics {
                m.observe_write_ack(started.elapsed());
            }
        }
        deliver(waiting, result, metrics);
    }
}

fn mismatch() -> ApiError {
    ApiError::new(
        ErrorCode::Internal,
        "the agent answered this request with another kind of reply",
    )
}

/// Sends `result` on the channel of its kind (a reply of another kind is
/// a bug, answered as `internal`).
fn deliver(waiting: Waiting, result: Result<Reply, ApiError>, metrics: Option<&Metrics>) {
    match (waiting, result) {
        (Waiting::Status(tx), Ok(Reply::Status(mut s))) => {
            if let Some(m) = metrics {
                s.counters = m.counters();
            }
            let _ = tx.send(*s);
        }
        (Waiting::Devices(tx), Ok(Reply::Devices(d))) => drop(tx.send(d)),
        (Waiting::Put(tx), r) => drop(tx.send(r.and_then(|r| match r {
            Reply::Put(p) => Ok(p),
            _ => Err(mismatch()),
        }))),
        (Waiting::Revoke(tx), r) => drop(tx.send(r.and_then(|r| match r {
            Reply::Revoke(p) => Ok(p),
            _ => Err(mismatch()),
        }))),
        (Waiting::Approve(tx), r) => drop(tx.send(r.and_then(|r| match r {
            Reply::Approve(p) => Ok(p),
            _ => Err(mismatch()),
        }))),
        (Waiting::Value(tx), r) => drop(tx.send(r.and_then(|r| match r {
            Reply::Value(v) => Ok(v),
            _ => Err(mismatch()),
        }))),
        (Waiting::Batch(tx), r) => drop(tx.send(r.and_then(|r| match r {
            Reply::Batch(b) => Ok(b),
            _ => Err(mismatch()),
        }))),
        // Status and device list cannot fail; a failed one just drops its
        // channel (the client sees the daemon go away).
        (Waiting::Status(_) | Waiting::Devices(_), _) => {}
    }
}
