//! The reader: reads and queries away from the loop that applies writes and
//! sync.
//!
//! It runs on its own thread and keeps its own replica of each container it
//! is asked about, loaded from the store on first use and kept current from
//! the change batches the executor persists. Point reads, whole-container
//! reads, exports, `state.query`, `state.describe` and the lifecycle scan
//! run here, so a long query holds up other reads, never writes or sync.
//!
//! Consistency: the executor hands every persisted batch to the reader
//! *before* it acknowledges. API reads arrive on a second queue, and each
//! turn takes the reads it serves first and only then drains the batch
//! queue: a read sent after an acknowledgement was sent after its batch, so
//! the batch is in the queue by the time the read is taken, and a read that
//! follows an acknowledged write sees it. If the queue is full,
//! the executor marks the container stale instead of waiting, and the reader
//! reloads it from the store (which holds every acknowledged change) before
//! its next read of it. Reads may see newer state than the write they
//! follow, never older.
//!
//! Bounded: the queues (4096 messages each), the replicas (at most the
//! engine's container limit), one thread.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};

use nuwa_agent::asm_model::registry::Registry;
use nuwa_agent::state::Container;
use nuwa_store::Storage;
use tokio::sync::mpsc;
use tracing::{debug, warn};

use super::exec::open::load_container;
use crate::api::{ApiError, ApiRequest, ErrorCode, Tool};
use nuwa_agent::asm::{self, Containers};

/// Messages waiting for the reader.
pub(in crate::daemon) const QUEUE: usize = 4096;
/// How long one `state.query` may run on the reader.
const QUERY_TIME_BUDGET: std::time::Duration = std::time::Duration::from_secs(2);
/// Messages taken per turn: their change batches are applied together.
const TURN: usize = 1024;

pub(crate) enum ReadMsg {
    /// A persisted batch of `container`.
    Changes {
        container: String,
        changes: Vec<Vec<u8>>,
    },
    /// Drop the replica (the loop reloaded or reset the container).
    Reset { container: String },
    /// The schema registry changed.
    Registry(Box<Registry>),
    /// Lifecycle: which items of these containers have expired?
    Scan {
        schemas: Vec<nuwa_agent::asm_model::schema::AsmSchema>,
        now_secs: i64,
    },
    /// Drop the replicas not read for [`REPLICA_IDLE`].
    Trim,
}

/// A replica not read this long is dropped by [`ReadMsg::Trim`] (it loads
/// again from the store when read).
const REPLICA_IDLE: std::time::Duration = std::time::Duration::from_secs(60);

/// What the reader tells the loop.
pub(in crate::daemon) enum ReaderEvent {
    /// The lifecycle scan of `container` as it was at `heads`.
    Scanned {
        container: String,
        heads: Vec<[u8; 32]>,
        scan: asm::Scan,
    },
}

/// The loop's and the API's side of the reader.
#[derive(Clone)]
pub(crate) struct ReaderHandle {
    tx: mpsc::Sender<ReadMsg>,
    stale: Arc<Mutex<BTreeSet<String>>>,
}

impl ReaderHandle {
    /// Hands over a persisted batch without waiting; a full queue marks the
    /// container stale instead.
    pub(in crate::daemon) fn changes(&self, container: &str, changes: &[Vec<u8>]) {
        let msg = ReadMsg::Changes {
            container: container.to_owned(),
            changes: changes.to_vec(),
        };
        if self.tx.try_send(msg).is_err() {
            self.mark_stale(container);
        }
    }

    pub(in crate::daemon) fn reset(&self, container: &str) {
        if self
            .tx
            .try_send(ReadMsg::Reset {
                container: container.to_owned(),
            })
            .is_err()
        {
            self.mark_stale(container);
        }
    }

    fn mark_stale(&self, container: &str) {
        let mut stale = self.stale.lock().unwrap_or_else(|p| p.into_inner());
        stale.insert(container.to_owned());
    }

    /// Never waits: a registry update lost to a full queue is sent again
    /// with the next change of the registry, and the loop serves schema
    /// lookups itself.
    pub(in crate::daemon) fn registry(&self, registry: &Registry) {
        let _ = self
            .tx
            .try_send(ReadMsg::Registry(Box::new(registry.clone())));
    }

    /// Asks the reader to drop replicas it has not read for a minute.
    pub(in crate::daemon) fn trim(&self) {
        let _ = self.tx.try_send(ReadMsg::Trim);
    }

    pub(in crate::daemon) fn scan(
        &self,
        schemas: Vec<nuwa_agent::asm_model::schema::AsmSchema>,
        now_secs: i64,
    ) {
        let _ = self.tx.try_send(ReadMsg::Scan { schemas, now_secs });
    }
}

struct Reader {
    store: Arc<dyn Storage>,
    actor: Vec<u8>,
    replicas: BTreeMap<String, Container>,
    /// When each replica was last read.
    last_read: BTreeMap<String, std::time::Instant>,
    registry: Registry,
    stale: Arc<Mutex<BTreeSet<String>>>,
    events: mpsc::Sender<ReaderEvent>,
    max_containers: usize,
}

impl Containers for Reader {
    fn get_container(&self, name: &str) -> Option<&Container> {
        self.replicas.get(name)
    }
}

/// Starts the reader thread. It stops when every handle is dropped. The
/// returned sender is the API's lane for reads.
pub(in crate::daemon) fn spawn(
    store: Arc<dyn Storage>,
    actor: Vec<u8>,
    registry: Registry,
    max_containers: usize,
) -> std::io::Result<(
    ReaderHandle,
    mpsc::Sender<ApiRequest>,
    mpsc::Receiver<ReaderEvent>,
)> {
    let (tx, rx) = mpsc::channel(QUEUE);
    let (api_tx, api_rx) = mpsc::channel(QUEUE);
    let (events_tx, events_rx) = mpsc::channel(64);
    let stale = Arc::new(Mutex::new(BTreeSet::new()));
    let reader = Reader {
        store,
        actor,
        replicas: BTreeMap::new(),
        last_read: BTreeMap::new(),
        registry,
        stale: stale.clone(),
        events: events_tx,
        max_containers,
    };
    std::thread::Builder::new()
        .name("nuwa-reader".into())
        .spawn(move || reader.run(rx, api_rx))?;
    Ok((ReaderHandle { tx, stale }, api_tx, events_rx))
}

/// Reads yield the CPU to sync: on Linux the reader thread runs at nice
/// +19, so on a busy device a client reading in a loop slows down before
/// the loop that applies and sends changes does.
fn lower_priority() {
    #[cfg(target_os = "linux")]
    {
        // SAFETY: gettid has no preconditions; setpriority on this thread's
        // id changes only this thread's nice value.
        let r = unsafe {
            let tid = libc::gettid();
            libc::setpriority(libc::PRIO_PROCESS, tid as libc::id_t, 19)
        };
        if r != 0 {
            debug!(error = %std::io::Error::last_os_error(), "reader keeps the default priority");
        }
    }
}

impl Reader {
    fn run(mut self, rx: mpsc::Receiver<ReadMsg>, api: mpsc::Receiver<ApiRequest>) {
        let span = tracing::info_span!("reader");
        let _enter = span.enter();
        lower_priority();
        let runtime = match tokio::runtime::Builder::new_current_thread().build() {
            Ok(r) => r,
            Err(e) => {
                warn!(error = %e, "the reader cannot start");
                return;
            }
        };
        runtime.block_on(self.serve_turns(rx, api));
    }

    async fn serve_turns(
        &mut self,
        mut rx: mpsc::Receiver<ReadMsg>,
        mut api: mpsc::Receiver<ApiRequest>,
    ) {
        let mut api_open = true;
        loop {
            // Wait for anything; the loop's queue closing ends the reader.
            let mut reads = Vec::new();
            let mut turn = Vec::new();
            tokio::select! {
                biased;
                m = rx.recv() => match m {
                    Some(m) => turn.push(m),
                    None => return,
                },
                r = api.recv(), if api_open => match r {
                    Some(r) => reads.push(r),
                    None => api_open = false,
                },
            }
            // Reads first, then every batch queued so far: each read taken
            // here was sent after the batches it must see (see the module
            // docs), so they are all in `rx` now.
            while reads.len() < TURN {
                match api.try_recv() {
                    Ok(r) => reads.push(r),
                    Err(_) => break,
                }
            }
            while let Ok(m) = rx.try_recv() {
                turn.push(m);
            }
            // Change batches first, grouped per container: Automerge
            // applies many changes together far faster than one by one.
            // Reads in this turn may so see newer state, never older.
            let mut changes: BTreeMap<String, Vec<Vec<u8>>> = BTreeMap::new();
            let mut scans = Vec::new();
            for m in turn {
                match m {
                    ReadMsg::Changes {
                        container,
                        changes: c,
                    } => changes.entry(container).or_default().extend(c),
                    ReadMsg::Reset { container } => {
                        changes.remove(&container);
                        self.replicas.remove(&container);
                    }
                    ReadMsg::Registry(r) => self.registry = *r,
                    ReadMsg::Scan { schemas, now_secs } => scans.push((schemas, now_secs)),
                    ReadMsg::Trim => {
                        let now = std::time::Instant::now();
                        let last_read = &self.last_read;
                        self.replicas.retain(|name, _| {
                            last_read
                                .get(name)
                                .is_some_and(|t| now.duration_since(*t) < REPLICA_IDLE)
                        });
                        let replicas = &self.replicas;
                        self.last_read.retain(|name, _| replicas.contains_key(name));
                    }
                }
            }
            for (name, batch) in changes {
                self.apply(&name, batch);
            }
            for req in reads {
                self.serve(req);
            }
            for (schemas, now_secs) in scans {
                self.scan(schemas, now_secs);
            }
        }
    }

    /// Applies a persisted batch to the replica, if one is loaded (the
    /// store has it otherwise, for a later load).
    fn apply(&mut self, name: &str, batch: Vec<Vec<u8>>) {
        let Some(c) = self.replicas.get_mut(name) else {
            return;
        };
        if let Err(e) = c.apply_changes(batch) {
            // The loop applied these same bytes; reload from the store
            // rather than serve a replica that may differ.
            debug!(container = name, error = %e, "reader replica dropped");
            self.replicas.remove(name);
        }
    }

    /// Loads `name` if it is stale or not held yet.
    fn ensure(&mut self, name: &str) -> Result<(), ApiError> {
        self.last_read
            .insert(name.to_owned(), std::time::Instant::now());
        let stale = {
            let mut s = self.stale.lock().unwrap_or_else(|p| p.into_inner());
            s.remove(name)
        };
        if stale {
            self.replicas.remove(name);
        }
        if self.replicas.contains_key(name) {
            return Ok(());
        }
        if self.replicas.len() >= self.max_containers {
            // Keep memory bounded: forget the first replica (it reloads
            // from the store when read again).
            self.replicas.pop_first();
        }
        match load_container(self.store.as_ref(), &self.actor, name) {
            Ok(Some(loaded)) => {
                self.replicas.insert(name.to_owned(), loaded.container);
                Ok(())
            }
            Ok(None) => Ok(()),
            Err(e) => {
                warn!(container = name, error = %format!("{e:#}"), "reader cannot load a container");
                Err(ApiError::new(
                    ErrorCode::StorageFailed,
                    format!("cannot read container {name:?}: {e:#}"),
                ))
            }
        }
    }

    fn serve(&mut self, req: ApiRequest) {
        match req {
            ApiRequest::Get(q, reply) => {
                let r = self.ensure(&q.container).and_then(|()| {
                    nuwa_agent::read::get(self.replicas.get(&q.container), &self.registry, &q)
                });
                let _ = reply.send(r);
            }
            ApiRequest::Export(name, reply) => {
                let r = self
                    .ensure(&name)
                    .and_then(|()| nuwa_agent::read::export(self.replicas.get(&name), &name));
                let _ = reply.send(r);
            }
            ApiRequest::Tool(Tool::Query(q), reply) => {
                let from = q["from"].as_str().unwrap_or_default().to_owned();
                let r = self.ensure(&from).and_then(|()| {
                    let deadline = std::time::Instant::now() + QUERY_TIME_BUDGET;
                    let expired = move || std::time::Instant::now() > deadline;
                    asm::query(&self.registry, self, &q, &expired)
                });
                let _ = reply.send(r);
            }
            ApiRequest::Tool(Tool::Describe(name), reply) => {
                let r = self
                    .ensure(&name)
                    .and_then(|()| asm::describe(&self.registry, self, &name));
                let _ = reply.send(r);
            }
            other => {
                // Only reads are routed here; anything else is a bug in the
                // routing, answered rather than dropped.
                answer_misrouted(other);
            }
        }
    }

    fn scan(&mut self, schemas: Vec<nuwa_agent::asm_model::schema::AsmSchema>, now_secs: i64) {
        for schema in schemas {
            let name = schema.id.full.clone();
            if self.ensure(&name).is_err() {
                continue;
            }
            let Some(c) = self.replicas.get(&name) else {
                continue;
            };
            let Ok(items) = nuwa_agent::asm_model::doc::items(c.doc(), &schema.layout) else {
                continue;
            };
            let scan = asm::scan(&schema, &items, now_secs);
            let _ = self.events.try_send(ReaderEvent::Scanned {
                container: name,
                heads: c.heads(),
                scan,
            });
        }
    }
}

fn answer_misrouted(req: ApiRequest) {
    let e = || {
        ApiError::new(
            ErrorCode::Internal,
            "request routed to the reader by mistake",
        )
    };
    match req {
        ApiRequest::Status(_) | ApiRequest::Devices(_) => {}
        ApiRequest::Put(_, r) => drop(r.send(Err(e()))),
        ApiRequest::Revoke(_, r) => drop(r.send(Err(e()))),
        ApiRequest::Admin(_, r) => drop(r.send(Err(e()))),
        ApiRequest::Approve(_, r) => drop(r.send(Err(e()))),
        ApiRequest::Provision(_, r) => drop(r.send(Err(e()))),
        ApiRequest::Tool(_, r) => drop(r.send(Err(e()))),
        ApiRequest::Batch(_, r) => drop(r.send(Err(e()))),
        ApiRequest::App(_, r) => drop(r.send(Err(e()))),
        ApiRequest::Get(_, r) => drop(r.send(Err(e()))),
        ApiRequest::Export(_, r) => drop(r.send(Err(e()))),
    }
}

#[cfg(test)]
mod tests {
    //! The reader's consistency promise (see the module docs), on the real
    //! reader thread over an in-memory store, with real Automerge changes
    //! made by another actor the way the executor's container makes them.

    use std::sync::Arc;

    use nuwa_agent::asm_model::registry::Registry;
    use nuwa_agent::state::Container;
    use nuwa_store::{MemStore, Storage};
    use serde_json::{Value, json};
    use tokio::sync::{mpsc, oneshot};

    use super::{ReadMsg, ReaderHandle};
    use crate::api::{ApiError, ApiRequest, GetQuery};

    const NOTES: &str = "notes";

    /// The reader over a fresh store, and its read lane.
    fn start() -> (Arc<MemStore>, ReaderHandle, mpsc::Sender<ApiRequest>) {
        let store = Arc::new(MemStore::new());
        let (handle, reads, _events) =
            super::spawn(store.clone(), vec![1; 32], Registry::with_core(), 16).unwrap();
        (store, handle, reads)
    }

    /// One read through the API's lane to the reader, as `GET /v1/state/get`
    /// sends it: the value of `key`, or the whole container.
    async fn read(reads: &mpsc::Sender<ApiRequest>, key: Option<&str>) -> Result<Value, ApiError> {
        let (tx, rx) = oneshot::channel();
        let q = GetQuery {
            container: NOTES.into(),
            key: key.map(str::to_owned),
            raw: false,
        };
        reads.send(ApiRequest::Get(q, tx)).await.unwrap();
        let answer = tokio::time::timeout(std::time::Duration::from_secs(10), rx)
            .await
            .expect("the reader answers within 10 s")
            .expect("the reader keeps the reply");
        answer.map(|bytes| serde_json::from_slice(&bytes).unwrap())
    }

    /// A put on the writer's container: the change bytes it made.
    fn put(writer: &mut Container, key: &str, value: Value) -> Vec<u8> {
        writer.put(key, &value).unwrap().expect("a new change")
    }

    // Goal: a read sent after a batch was persisted and handed to the
    // reader (what the executor does before it acknowledges) sees that
    // batch, round after round, once the reader holds a replica of the
    // container (so the value comes from the handed batch, not a reload).
    #[tokio::test]
    async fn a_read_after_a_handed_over_batch_sees_it() {
        let (store, reader, reads) = start();
        let mut writer = Container::new(&[2; 32]);
        let mut expected = serde_json::Map::new();
        for i in 0..50u64 {
            let today = put(&mut writer, "today", json!(format!("v{i}")));
            let numbered = put(&mut writer, &format!("k{i}"), json!(i));
            let batch = vec![today, numbered];
            store.append_changes(NOTES, &batch).unwrap();
            reader.changes(NOTES, &batch);
            expected.insert("today".into(), json!(format!("v{i}")));
            expected.insert(format!("k{i}"), json!(i));
            assert_eq!(
                read(&reads, Some("today")).await.unwrap(),
                json!(format!("v{i}")),
                "round {i}: the point read missed the acknowledged write"
            );
            assert_eq!(
                read(&reads, None).await.unwrap(),
                Value::Object(expected.clone()),
                "round {i}: the whole-container read missed the acknowledged write"
            );
        }
    }

    // Goal: when a batch cannot be queued for the reader (its queue is
    // full), the container is marked stale and the next read reloads it
    // from the store, so it still sees the persisted write. First shown
    // needed: a change only in the store is not seen while the replica is
    // held and not stale.
    #[tokio::test]
    async fn a_container_marked_stale_is_reloaded_from_the_store() {
        let (store, reader, reads) = start();
        let mut writer = Container::new(&[2; 32]);
        let v1 = vec![put(&mut writer, "today", json!("v1"))];
        store.append_changes(NOTES, &v1).unwrap();
        reader.changes(NOTES, &v1);
        assert_eq!(read(&reads, Some("today")).await.unwrap(), json!("v1"));

        // Persisted, but not (yet) handed over: the held replica answers.
        let v2 = vec![put(&mut writer, "today", json!("v2"))];
        store.append_changes(NOTES, &v2).unwrap();
        assert_eq!(
            read(&reads, Some("today")).await.unwrap(),
            json!("v1"),
            "precondition: the reader serves its held replica"
        );

        // Handing v2 over finds the queue full: a handle sharing the
        // reader's stale set whose queue holds one message and takes one.
        let (tx, _queued) = mpsc::channel(1);
        tx.try_send(ReadMsg::Trim).unwrap();
        let full = ReaderHandle {
            tx,
            stale: reader.stale.clone(),
        };
        full.changes(NOTES, &v2);
        assert!(
            reader.stale.lock().unwrap().contains(NOTES),
            "a full queue marks the container stale"
        );
        assert_eq!(
            read(&reads, Some("today")).await.unwrap(),
            json!("v2"),
            "the stale container was not reloaded from the store"
        );
        assert_eq!(
            read(&reads, None).await.unwrap(),
            json!({"today": "v2"}),
            "the reloaded container holds exactly what the store holds"
        );
        assert!(
            reader.stale.lock().unwrap().is_empty(),
            "the reload clears the stale mark"
        );
    }
}
