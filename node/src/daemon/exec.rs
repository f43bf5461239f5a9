//! The executor: the only code of the daemon that touches the store, the
//! home's files, the network, mDNS, the reader and the API's waiting
//! replies. The agent decides; this performs one handle's effects in the
//! phases `nuwa_agent::effect` describes:
//!
//! 1. **persist**: changes, one group commit (one flush) for every
//!    container of the turn, then the key ring and grant, then the DID
//!    chain, then new homes and compactions; metadata records go to an
//!    ordered writer off the loop;
//! 2. **acknowledge**: the replies waiting on that durability;
//! 3. **send**: frames and gossip the agent sealed leave only now;
//! 4. **the rest**: dials, lookups, registrations, workers, counters.
//!
//! So nothing reaches a peer, and nothing is acknowledged, before it is
//! durable here. A storage error fails every waiting reply and stops the
//! daemon, so nothing unacknowledged is ever reported durable.
//!
//! The IO handles are private to this module: the loop in `daemon.rs`
//! hands effects over and feeds back what the executor returns, and cannot
//! reach the store or the network itself.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{Context, Result};
use nuwa_agent::api::{ApiError, ErrorCode};
use nuwa_agent::sync::Origin;
use nuwa_agent::{Agent, Boot, Effect, Input, KadOp, Phases, RequestId};
use nuwa_discovery::Mdns;
use nuwa_net::{GossipId, NetHandle};
use nuwa_store::Storage;
use tracing::{debug, trace, warn};

use super::catch_up::CatchUps;
use super::meta::MetaWriter;
use super::reader::ReaderHandle;
use ledger::Ledger;
use replies::Replies;
pub(super) use replies::Waiting;

mod ledger;
pub(super) mod open;
mod replies;
mod resident;
pub(super) mod setup;
use crate::home::{self, Home};
use crate::metrics::{Event, Metrics};

/// The daemon's hands.
pub(super) struct Executor {
    home_dir: PathBuf,
    store: Arc<dyn Storage>,
    net: NetHandle,
    mdns: Option<Mdns>,
    reader: ReaderHandle,
    meta: MetaWriter,
    /// Change events and the access view, for the API.
    feeds: crate::api::Feeds,
    metrics: Arc<Metrics>,
    /// Big sync messages being applied on worker threads.
    catch_ups: CatchUps,
    /// Sequence numbers and changes logged since the last snapshot, per
    /// container.
    ledger: Ledger,
    /// API replies waiting for the agent's answer.
    pub(super) replies: Replies,
    /// Gossip messages waiting for the agent's verdict, by token.
    gossip: BTreeMap<u64, GossipId>,
    /// A storage error: the daemon stops.
    fatal: Option<anyhow::Error>,
}

/// What the executor needs to be built.
pub(super) struct Hands {
    pub home: Home,
    pub store: Arc<dyn Storage>,
    pub net: NetHandle,
    pub reader: ReaderHandle,
    pub feeds: crate::api::Feeds,
    pub metrics: Arc<Metrics>,
}

impl Executor {
    /// The executor, and what the agent boots from: the containers the
    /// store holds (unreadable ones moved aside), the metadata records it
    /// names, and the home's keys.
    pub(super) fn open(
        hands: Hands,
        config: &nuwa_agent::Config,
        listen_addrs: Vec<nuwa_net::Multiaddr>,
        mdns_watching: Vec<String>,
    ) -> Result<(Executor, Boot)> {
        let Hands {
            home,
            store,
            net,
            reader,
            feeds,
            metrics,
        } = hands;
        let opened = open::open_engine(&home, &store, &metrics)?;
        metrics.add(
            Event::ContainersQuarantined,
            opened.quarantined.len() as u64,
        );
        let meta = Agent::meta_keys(config)
            .into_iter()
            .filter_map(|k| match store.get_meta(&k) {
                Ok(Some(v)) => Some((k, v)),
                Ok(None) => None,
                Err(e) => {
                    warn!(key = %k, error = %e, "cannot read a metadata record; starting without it");
                    None
                }
            })
            .collect();
        let boot = Boot {
            device: nuwa_agent::identity::keys::DeviceKey::from_seed(&home.device.seed()),
            master: home::read_master(&home.dir)?,
            name: home.info.name.clone(),
            log: home.log.clone(),
            keys: home.keys.clone(),
            grant: home.grant.clone(),
            engine: opened.engine,
            quarantined: opened.quarantined,
            meta,
            listen_addrs,
            peer_id: net.local_peer_id(),
            mdns_watching,
        };
        let exec = Executor {
            home_dir: home.dir.clone(),
            meta: MetaWriter::spawn(store.clone()),
            store,
            net,
            mdns: None,
            reader,
            feeds,
            replies: Replies::new(metrics.clone()),
            metrics,
            catch_ups: CatchUps::new(),
            ledger: opened.ledger,
            gossip: BTreeMap::new(),
            fatal: None,
        };
        Ok((exec, boot))
    }

    /// mDNS started with our first announcement: its handle is ours.
    pub(super) fn set_mdns(&mut self, mdns: Mdns) {
        self.mdns = Some(mdns);
    }

    /// The receiving end of finished catch-ups, for the loop (once).
    pub(super) fn catch_up_receiver(
        &mut self,
    ) -> Option<tokio::sync::mpsc::Receiver<super::catch_up::Back>> {
        self.catch_ups.take_receiver()
    }

    /// A gossip message to hold until the agent's verdict; the token names
    /// it in the agent's input.
    pub(super) fn hold_gossip(&mut self, id: GossipId) -> u64 {
        let token = self.gossip.keys().next_back().map_or(1, |t| t + 1);
        self.gossip.insert(token, id);
        token
    }

    /// The storage error that stops the daemon, if one happened.
    pub(super) fn take_fatal(&mut self) -> Option<anyhow::Error> {
        self.fatal.take()
    }

    pub(super) fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }

    /// Performs one handle's effects in their phases (sends first when the
    /// core's [`Phases`] allow it); returns what the agent must hear back
    /// (containers read back from the store).
    pub(super) async fn execute(&mut self, agent: &Agent, effects: Vec<Effect>) -> Vec<Input> {
        let Phases {
            send_before_persist,
            persist,
            acknowledge,
            send,
            rest,
        } = Phases::of(effects);
        for s in send_before_persist {
            self.send(s).await;
        }
        trace!(target: "nuwa_path", "sent");
        if let Err(e) = self.persist(agent, persist).await {
            let msg = format!("{e:#}");
            for a in acknowledge {
                if let Effect::Reply { id, .. } = a {
                    self.replies.answer(
                        id,
                        Err(ApiError::new(ErrorCode::StorageFailed, msg.clone())),
                    );
                }
            }
            self.fatal = Some(e);
            return Vec::new();
        }
        trace!(target: "nuwa_path", "durable");
        for a in acknowledge {
            if let Effect::Reply { id, result } = a {
                self.replies.answer(id, result);
            }
        }
        for s in send {
            self.send(s).await;
        }
        let mut back = Vec::new();
        for r in rest {
            if let Some(input) = self.rest(agent, r).await {
                back.push(input);
            }
        }
        back
    }

    /// Phase 1. Changes first, in one group commit; then metadata (a
    /// keeper cursor must never be durable before the changes it covers);
    /// then keys, grant and the chain (keys before the chain: a chain whose
    /// epoch key is lost must never be on disk); then homes and
    /// compactions.
    async fn persist(&mut self, agent: &Agent, effects: Vec<Effect>) -> Result<()> {
        let mut changes: BTreeMap<(String, Origin), Vec<Vec<u8>>> = BTreeMap::new();
        let mut wholes = Vec::new();
        let mut sealed_at = Vec::new();
        let mut metas = Vec::new();
        let mut files = Vec::new();
        for e in effects {
            match e {
                Effect::Persist {
                    container,
                    changes: c,
                    origin,
                    sealed_at_ms,
                } => {
                    sealed_at.extend(sealed_at_ms);
                    changes.entry((container, origin)).or_default().extend(c);
                }
                Effect::PersistWhole { container, changes } => wholes.push((container, changes)),
                Effect::SaveMeta { key, bytes } => metas.push((key, bytes)),
                other => files.push(other),
            }
        }
        let mut ledger = std::mem::take(&mut self.ledger);
        let mut persisted = ledger.persist(self.store_io(agent), changes).await;
        for (container, n) in wholes {
            if persisted.is_err() {
                break;
            }
            persisted = ledger
                .persist_whole(self.store_io(agent), &container, n)
                .await;
        }
        self.ledger = ledger;
        persisted?;
        for (key, bytes) in metas {
            self.meta.put(key, bytes);
        }
        let durable_at = home::now_ms();
        for t in sealed_at {
            self.metrics
                .observe_propagation_apply(std::time::Duration::from_millis(
                    durable_at.saturating_sub(t),
                ));
        }
        // Keys, then the grant, then the chain, then the rest.
        files.sort_by_key(|e| match e {
            Effect::SaveKeys { .. } => 0,
            Effect::SaveLog(_) => 1,
            _ => 2,
        });
        for e in files {
            self.persist_file(agent, e).await?;
        }
        Ok(())
    }

    async fn persist_file(&mut self, agent: &Agent, e: Effect) -> Result<()> {
        match e {
            Effect::SaveKeys { keys, grant } => {
                home::save_keys(&self.home_dir, &keys).context("cannot save the key ring")?;
                if let Some(grant) = grant {
                    home::save_grant(&self.home_dir, &grant)
                        .context("cannot save the epoch grant")?;
                }
            }
            Effect::SaveLog(log) => {
                home::save_log(&self.home_dir, &log).context("cannot save the DID log")?;
            }
            Effect::WriteHome { request, home: new } => {
                // The new home's lock is held until it is written.
                let lock = self.replies.take_home_lock(request);
                let out = PathBuf::from(&new.out);
                let written = home::write_new_home(
                    &out,
                    &new.device,
                    &new.name,
                    &new.log,
                    &new.keys,
                    new.grant.as_deref(),
                );
                drop(lock);
                if let Err(e) = written {
                    // The chain lists a key nobody holds: revocable, and
                    // the request says what happened.
                    self.replies.fail_later(
                        request,
                        ApiError::new(ErrorCode::StorageFailed, format!("{e:#}")),
                    );
                }
            }
            Effect::Compact { container } => {
                let mut ledger = std::mem::take(&mut self.ledger);
                let r = ledger.compact(self.store_io(agent), &container).await;
                self.ledger = ledger;
                r?;
            }
            other => debug!(effect = ?other, "not a persist effect"),
        }
        Ok(())
    }

    /// What the ledger needs to write: the store, the reader, the change
    /// events, and the agent's documents.
    fn store_io<'a>(&'a mut self, agent: &'a Agent) -> ledger::StoreIo<'a> {
        ledger::StoreIo {
            store: &self.store,
            reader: &self.reader,
            events: &self.feeds.events,
            catch_ups: &mut self.catch_ups,
            agent,
            metrics: &self.metrics,
        }
    }

    /// Phase 3.
    async fn send(&mut self, e: Effect) {
        match e {
            Effect::Send { peer, frame } => {
                let _ = self.net.send(peer, frame).await;
            }
            Effect::TrySend { peer, frame } => {
                let _ = self.net.try_send(peer, frame);
            }
            Effect::Publish { topic, bytes } => {
                let _ = self.net.gossip_publish(topic, bytes).await;
            }
            Effect::GossipVerdict { token, accept } => {
                if let Some(id) = self.gossip.remove(&token) {
                    let _ = self.net.gossip_report(id, accept).await;
                }
            }
            other => debug!(effect = ?other, "not a send effect"),
        }
    }

    /// Phase 4.
    async fn rest(&mut self, agent: &Agent, e: Effect) -> Option<Input> {
        match e {
            Effect::Disconnect(peer) => drop(self.net.disconnect(peer).await),
            Effect::Dial { peer, addrs } => drop(self.net.dial(peer, addrs).await),
            Effect::DialInfra { peer, addrs } => drop(self.net.dial_infra(peer, addrs).await),
            Effect::AddAddress { peer, addr } => drop(self.net.add_address(peer, addr).await),
            Effect::Kad(op) => self.kad(op).await,
            Effect::RendezvousRegister {
                server,
                namespace,
                ttl_secs,
            } => drop(
                self.net
                    .rendezvous_register(server, namespace, ttl_secs)
                    .await,
            ),
            Effect::RendezvousDiscover { server, namespace } => {
                drop(self.net.rendezvous_discover(server, namespace).await)
            }
            Effect::ReserveRelay { relay, addr } => drop(self.net.reserve_relay(relay, addr).await),
            Effect::ReleaseRelay(relay) => drop(self.net.release_relay(relay).await),
            Effect::Subscribe(topic) => drop(self.net.gossip_subscribe(topic).await),
            Effect::Announce(txt) => self.announce(txt),
            Effect::RunCatchUp(job) => self.catch_ups.start(*job, agent, &self.metrics),
            Effect::Reload(container) => return Some(self.reload(agent, container).await),
            Effect::Load(container) => {
                let actor = agent.session().engine().actor().to_vec();
                self.catch_ups
                    .load(container, self.store.clone(), actor, &self.metrics);
            }
            Effect::ReaderRegistry(reg) => self.reader.registry(&reg),
            Effect::Access(view) => {
                self.feeds.access.send_replace(view);
            }
            Effect::ReaderScan { schemas, now_secs } => self.reader.scan(schemas, now_secs),
            Effect::ReleaseMemory => {
                self.reader.trim();
                release_free_memory();
                // Reading smaps takes about a millisecond: not on the loop.
                tokio::task::spawn_blocking(|| {
                    let code = resident::release_code_pages();
                    debug!(code_bytes = code, "code pages given back");
                });
            }
            Effect::Count(c) => self.metrics.agent(c, 1),
            Effect::CountBy(c, n) => self.metrics.agent(c, n),
            Effect::CountSync(c) => self.metrics.sync(c),
            Effect::CountRejection { source, reason } => self.metrics.rejected(source, reason),
            Effect::CountEnvelopeRejected(label) => self.metrics.envelope_rejected(label),
            other => debug!(effect = ?other, "handled by the loop"),
        }
        None
    }

    async fn kad(&mut self, op: KadOp) {
        let _ = match op {
            KadOp::Bootstrap => self.net.kad_bootstrap().await,
            KadOp::Store { key, value } => self.net.kad_store(key, value).await,
            KadOp::PutRecord { key, value } => self.net.kad_put_record(key, value).await,
            KadOp::StartProviding(key) => self.net.kad_start_providing(key).await,
            KadOp::GetProviders(key) => self.net.kad_get_providers(key).await,
            KadOp::GetRecord(key) => self.net.kad_get_record(key).await,
        };
    }

    fn announce(&mut self, txt: Vec<(String, String)>) {
        if let Some(m) = &self.mdns {
            if let Err(e) = m.update_txt(txt) {
                warn!(error = %e, "cannot refresh the mDNS announcement");
            }
        }
    }

    /// Automerge panicked on a peer's bytes: the agent dropped the
    /// half-updated container, and it is read back from the store, which
    /// holds everything the container held before (every change is
    /// persisted before the next input is handled). The daemon keeps
    /// running.
    async fn reload(&mut self, agent: &Agent, name: String) -> Input {
        let store = self.store.clone();
        let actor = agent.session().engine().actor().to_vec();
        let task_name = name.clone();
        let loaded = tokio::task::spawn_blocking(move || {
            open::load_container(store.as_ref(), &actor, &task_name)
        })
        .await
        .context("store task panicked");
        match loaded {
            Ok(Ok(Some(loaded))) => {
                self.ledger.reloaded(&name, &loaded);
                Input::Reloaded {
                    container: name,
                    loaded: Some(Box::new(loaded.container)),
                }
            }
            // Never persisted: the container was empty before this input.
            Ok(Ok(None)) => Input::Reloaded {
                container: name,
                loaded: None,
            },
            Ok(Err(err)) | Err(err) => {
                self.fatal = Some(err.context(format!("cannot reload container {name:?}")));
                Input::Reloaded {
                    container: name,
                    loaded: None,
                }
            }
        }
    }

    /// At shutdown: compactions running off the loop, the last metadata
    /// records, then one more flush.
    pub(super) async fn close(mut self) -> Result<()> {
        self.ledger.settle(None).await?;
        if let Some(m) = self.mdns {
            if let Err(e) = m.shutdown() {
                debug!(error = %e, "mDNS shutdown");
            }
        }
        self.meta.flush().await;
        self.store.flush().context("final store flush")?;
        let _ = std::fs::remove_file(self.home_dir.join(home::API_FILE));
        Ok(())
    }

    /// The process's resident memory, for the agent's memory budget.
    pub(super) fn rss_bytes(&self) -> Option<u64> {
        open::rss_bytes()
    }

    /// Prepares `device provision`'s new home (its directory, lock and
    /// device key) before the agent lists the key; the lock is held until
    /// the home is written.
    pub(super) fn prepare_home(
        &mut self,
        id: RequestId,
        out: &str,
    ) -> Result<nuwa_agent::identity::keys::DeviceKey, ApiError> {
        let (lock, device) = home::prepare_new_home(std::path::Path::new(out))
            .map_err(|e| ApiError::new(ErrorCode::BadRequest, format!("{e:#}")))?;
        self.replies.hold_home_lock(id, lock);
        Ok(device)
    }

    /// A catch-up came back from its worker: its snapshot waits for the
    /// compaction that persists it; the agent gets the document.
    pub(super) fn catch_up_returned(&mut self, finished: super::catch_up::Back) -> (String, Input) {
        self.catch_ups.returned(finished)
    }

    /// The agent took a catch-up back and its effects ran: a snapshot
    /// nobody wrote was superseded.
    pub(super) fn catch_up_settled(&mut self, container: &str) {
        self.catch_ups.forget_snapshot(container);
    }

    /// The gauges `status` and `/metrics` show, as of this tick.
    pub(super) fn gauges(&self, agent: &Agent) {
        let s = agent.session();
        self.metrics
            .gauges
            .peers_verified
            .set(s.verified().count() as i64);
        self.metrics
            .gauges
            .containers
            .set(s.engine().container_count() as i64);
        self.metrics.gauges.envelopes_held.set(s.held_len() as i64);
    }
}

/// Returns freed heap pages to the system (glibc keeps them otherwise, so
/// RSS would not fall after eviction).
pub(super) fn release_free_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only walks the allocator's own free lists.
    unsafe {
        libc::malloc_trim(0);
    }
}

#[cfg(test)]
mod tests {
    //! Goal: the executor acknowledges only what is durable, sends a
    //! handle's changes before it flushes them, and sends after the flush
    //! when the handle also saves files (the core's `Phases`). Method: the
    //! real agent and executor over a store that, at every write it makes
    //! durable, checks which network commands were issued and that no
    //! reply was delivered; a verified peer is connected so that the writes
    //! have somewhere to go.

    use std::sync::{Arc, Mutex};

    use nuwa_agent::api::{PutBody, Request, Tool};
    use nuwa_agent::{Agent, Input, NetEvent, RequestId};
    use nuwa_store::{ContainerRecord, MemStore, Storage, StoreError};
    use tokio::sync::oneshot;

    use super::{Executor, Hands, Waiting};
    use crate::home;

    type Check = Box<dyn Fn(&str) + Send + Sync>;

    /// A store that runs a check before every write it makes durable.
    struct CheckingStore {
        inner: MemStore,
        check: Mutex<Option<Check>>,
        persisted: Mutex<Vec<String>>,
        /// Makes every change append this slow (a busy disk).
        append_delay_ms: std::sync::atomic::AtomicU64,
        /// When set, a snapshot write waits for a message on it first.
        snapshot_gate: Mutex<Option<std::sync::mpsc::Receiver<()>>>,
        /// Snapshot writes begun.
        snapshots_begun: std::sync::atomic::AtomicU64,
    }

    impl CheckingStore {
        fn before_write(&self, what: &str) {
            if let Some(check) = self.check.lock().unwrap().as_ref() {
                check(what);
            }
            self.persisted.lock().unwrap().push(what.to_owned());
        }
    }

    impl Storage for CheckingStore {
        fn append_changes(&self, c: &str, changes: &[Vec<u8>]) -> Result<u64, StoreError> {
            let delay = self
                .append_delay_ms
                .load(std::sync::atomic::Ordering::Relaxed);
            std::thread::sleep(std::time::Duration::from_millis(delay));
            self.before_write(c);
            self.inner.append_changes(c, changes)
        }
        fn save_snapshot(&self, c: &str, s: &[u8], covers: u64) -> Result<(), StoreError> {
            (self.snapshots_begun).fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            if let Some(gate) = self.snapshot_gate.lock().unwrap().as_ref() {
                gate.recv().unwrap();
            }
            self.before_write(c);
            self.inner.save_snapshot(c, s, covers)
        }
        fn load_container(&self, c: &str) -> Result<Option<ContainerRecord>, StoreError> {
            self.inner.load_container(c)
        }
        fn list_containers(&self) -> Result<Vec<String>, StoreError> {
            self.inner.list_containers()
        }
        fn put_meta(&self, k: &str, v: &[u8]) -> Result<(), StoreError> {
            self.persisted.lock().unwrap().push(format!("meta:{k}"));
            self.inner.put_meta(k, v)
        }
        fn get_meta(&self, k: &str) -> Result<Option<Vec<u8>>, StoreError> {
            self.inner.get_meta(k)
        }
        fn flush(&self) -> Result<(), StoreError> {
            self.inner.flush()
        }
    }

    struct Setup {
        _dir: tempfile::TempDir,
        store: Arc<CheckingStore>,
        net: nuwa_net::NetHandle,
        exec: Executor,
        agent: Agent,
        b: home::Home,
        now: u64,
    }

    /// Device A's real agent and executor over a checking store, started.
    async fn start_a() -> Setup {
        let dir = tempfile::tempdir().unwrap();
        let (a_dir, b_dir) = (dir.path().join("a"), dir.path().join("b"));
        let recovery = nuwa_agent::identity::keys::DeviceKey::generate().unwrap();
        home::init(&a_dir, "a", &recovery.public()).unwrap();
        home::provision(&a_dir, &b_dir, "b", None).unwrap();
        let (a, b) = (home::load(&a_dir).unwrap(), home::load(&b_dir).unwrap());
        let store = Arc::new(CheckingStore {
            inner: MemStore::new(),
            check: Mutex::new(None),
            persisted: Mutex::new(Vec::new()),
            append_delay_ms: Default::default(),
            snapshot_gate: Mutex::new(None),
            snapshots_begun: Default::default(),
        });
        let a_peer = nuwa_agent::peer::id_of(&a.device.public()).unwrap();
        let net = nuwa_net::NetHandle::detached(a_peer);
        let metrics = Arc::new(crate::metrics::Metrics::new());
        let (reader, _, _) = super::super::reader::spawn(
            store.clone(),
            a.device.public().to_vec(),
            nuwa_agent::asm_model::registry::Registry::with_core(),
            16,
        )
        .unwrap();
        let hands = Hands {
            home: a,
            store: store.clone(),
            net: net.clone(),
            reader,
            feeds: crate::api::Feeds::new(),
            metrics,
        };
        let config = nuwa_agent::Config::default();
        let (mut exec, boot) = Executor::open(hands, &config, Vec::new(), Vec::new()).unwrap();
        let now = home::now_ms();
        let mut agent = Agent::new(config, boot, now);
        let effects = agent.handle(Input::Start, now);
        exec.execute(&agent, effects).await;
        Setup {
            _dir: dir,
            store,
            net,
            exec,
            agent,
            b,
            now,
        }
    }

    /// A's agent and executor with B connected and verified.
    async fn start_a_with_b() -> Setup {
        let mut s = start_a().await;
        // B connects and proves itself, so writes have somewhere to go.
        let b_peer = nuwa_agent::peer::id_of(&s.b.device.public()).unwrap();
        let connected = NetEvent::Connected {
            peer: b_peer,
            public: Some(s.b.device.public()),
            remote: "/ip4/127.0.0.1/tcp/1".parse().unwrap(),
        };
        let effects = s.agent.handle(Input::Net(vec![connected]), s.now);
        s.exec.execute(&s.agent, effects).await;
        let b_membership = nuwa_agent::sync::Membership::new(
            s.b.log.clone(),
            s.b.info.context_id.clone(),
            "b".into(),
            nuwa_agent::identity::keys::DeviceKey::from_seed(&s.b.device.seed()),
        );
        let hello = nuwa_agent::proto::Frame::Hello(b_membership.hello(s.now).unwrap());
        let frame = NetEvent::Frame {
            peer: b_peer,
            bytes: hello.encode(),
        };
        let effects = s.agent.handle(Input::Net(vec![frame]), s.now);
        s.exec.execute(&s.agent, effects).await;
        assert_eq!(
            s.agent.session().verified().count(),
            1,
            "b must be verified"
        );
        s
    }

    #[tokio::test]
    async fn a_batch_is_acknowledged_after_it_is_durable_and_sent_before() {
        let Setup {
            _dir,
            store,
            net,
            mut exec,
            mut agent,
            now,
            ..
        } = start_a_with_b().await;
        // The batch: a put, then a tool that writes (a schema registration).
        let (put_tx, put_rx) = oneshot::channel();
        let (tool_tx, tool_rx) = oneshot::channel();
        let put_id: RequestId = exec.replies.wait(Waiting::Put(put_tx));
        let tool_id: RequestId = exec.replies.wait(Waiting::Value(tool_tx));
        let replies = Arc::new(Mutex::new((put_rx, tool_rx)));
        let commands_before = net.commands_issued();
        {
            let net = net.clone();
            let replies = replies.clone();
            *store.check.lock().unwrap() = Some(Box::new(move |container: &str| {
                assert!(
                    net.commands_issued() > commands_before,
                    "{container:?} was flushed before its changes were sent"
                );
                let mut r = replies.lock().unwrap();
                assert!(
                    r.0.try_recv().is_err() && r.1.try_recv().is_err(),
                    "a reply was delivered before {container:?} was durable"
                );
            }));
        }
        store.persisted.lock().unwrap().clear();
        let schema: serde_json::Value = serde_json::from_str(include_str!(
            "../../../crates/asm/schemas/examples/note.json"
        ))
        .unwrap();
        let put = Request::Put(PutBody {
            container: "notes".into(),
            key: "today".into(),
            value: serde_json::json!("buy milk"),
        });
        let tool = Request::Tool(Tool::SchemaAdd(schema));
        let effects = agent.handle(Input::Api(vec![(put_id, put), (tool_id, tool)]), now);
        exec.execute(&agent, effects).await;
        assert!(exec.take_fatal().is_none());
        let persisted = store.persisted.lock().unwrap().clone();
        assert!(
            persisted.iter().any(|c| c == "notes")
                && persisted
                    .iter()
                    .any(|c| c == nuwa_agent::asm::REGISTRY_CONTAINER),
            "both writes persisted: {persisted:?}"
        );
        let mut r = replies.lock().unwrap();
        let put = r.0.try_recv().expect("put answered").expect("put accepted");
        assert!(put.durable);
        r.1.try_recv()
            .expect("tool answered")
            .expect("tool accepted");
    }

    // Goal: a handle that saves more than changes (here a compaction, as
    // a revocation saves keys and the chain) sends nothing before all of
    // it is durable. Method: a put's effects with a compaction added; the
    // store checks at each write that nothing went to the network yet.
    #[tokio::test]
    async fn a_handle_that_saves_files_sends_only_after_they_are_durable() {
        let Setup {
            _dir,
            store,
            net,
            mut exec,
            mut agent,
            now,
            ..
        } = start_a_with_b().await;
        let (tx, rx) = oneshot::channel();
        let id = exec.replies.wait(Waiting::Put(tx));
        let put = Request::Put(PutBody {
            container: "notes".into(),
            key: "k".into(),
            value: serde_json::json!(1),
        });
        let mut effects = agent.handle(Input::Api(vec![(id, put)]), now);
        assert!(
            effects
                .iter()
                .any(|e| matches!(e, nuwa_agent::Effect::Publish { .. })),
            "the put is pushed to B"
        );
        effects.push(nuwa_agent::Effect::Compact {
            container: "notes".into(),
        });
        let commands_before = net.commands_issued();
        {
            let net = net.clone();
            *store.check.lock().unwrap() = Some(Box::new(move |what: &str| {
                assert_eq!(
                    net.commands_issued(),
                    commands_before,
                    "something went to the network before {what:?} was durable"
                );
            }));
        }
        store.persisted.lock().unwrap().clear();
        exec.execute(&agent, effects).await;
        assert!(exec.take_fatal().is_none());
        let persisted = store.persisted.lock().unwrap().clone();
        assert!(
            persisted.iter().filter(|c| *c == "notes").count() >= 2,
            "the put and the compaction were written: {persisted:?}"
        );
        assert!(net.commands_issued() > commands_before, "then sent");
        assert!(rx.await.unwrap().unwrap().durable);
    }

    // Goal: metadata saved by an input (the keeper's pull cursor, say)
    // becomes durable only after the changes of the same input, so a crash
    // in between never leaves a cursor past changes the store lacks.
    // Method: a SaveMeta effect placed before a write's effects, on a store
    // whose change appends are slow.
    #[tokio::test]
    async fn metadata_is_written_after_the_changes_of_its_input() {
        let Setup {
            _dir,
            store,
            mut exec,
            mut agent,
            now,
            ..
        } = start_a().await;
        let put = Request::Put(PutBody {
            container: "notes".into(),
            key: "k".into(),
            value: serde_json::json!(1),
        });
        let (tx, _rx) = oneshot::channel();
        let id = exec.replies.wait(Waiting::Put(tx));
        let mut effects = vec![nuwa_agent::Effect::SaveMeta {
            key: "cursor".into(),
            bytes: vec![7],
        }];
        effects.extend(agent.handle(Input::Api(vec![(id, put)]), now));
        store.persisted.lock().unwrap().clear();
        store
            .append_delay_ms
            .store(200, std::sync::atomic::Ordering::Relaxed);
        exec.execute(&agent, effects).await;
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        let persisted = loop {
            let p = store.persisted.lock().unwrap().clone();
            if p.iter().any(|w| w == "meta:cursor") {
                break p;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "cursor never written: {p:?}"
            );
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        };
        let at = |what: &str| persisted.iter().position(|w| w == what);
        assert!(
            at("notes").is_some() && at("notes") < at("meta:cursor"),
            "the cursor was durable before the changes: {persisted:?}"
        );
    }

    /// A put of `value` under `key` in `container`, executed; its reply.
    async fn put(
        s: &mut Setup,
        container: &str,
        key: &str,
        value: serde_json::Value,
    ) -> nuwa_agent::api::PutReply {
        let (tx, rx) = oneshot::channel();
        let id = s.exec.replies.wait(Waiting::Put(tx));
        let put = Request::Put(PutBody {
            container: container.into(),
            key: key.into(),
            value,
        });
        let effects = s.agent.handle(Input::Api(vec![(id, put)]), s.now);
        let done = s.exec.execute(&s.agent, effects);
        tokio::time::timeout(std::time::Duration::from_secs(20), done)
            .await
            .expect("the turn held the loop");
        assert!(s.exec.take_fatal().is_none());
        rx.await.unwrap().unwrap()
    }

    // Goal: a container whose log is due for compaction is compacted off
    // the loop. The turn that makes it due returns while the snapshot is
    // still being written, writes go on meanwhile, the snapshot covers
    // only what was logged when it began (nothing written meanwhile is
    // dropped from the log), and shutdown waits for it. Method: puts of
    // 40 kB of incompressible text until a snapshot write begins, on a
    // store whose snapshot writes wait for the test's signal.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_due_compaction_runs_off_the_loop_and_loses_nothing_written_meanwhile() {
        use std::sync::atomic::Ordering::SeqCst;
        let mut s = start_a().await;
        let (release, gate) = std::sync::mpsc::channel();
        *s.store.snapshot_gate.lock().unwrap() = Some(gate);
        let value = |i: usize| {
            let mut rng = fastrand::Rng::with_seed(i as u64);
            serde_json::json!((0..40_000).map(|_| rng.alphanumeric()).collect::<String>())
        };
        let mut written = 0;
        while s.store.snapshots_begun.load(SeqCst) == 0 {
            assert!(written < 60, "no compaction after {written} puts of 40 kB");
            put(&mut s, "notes", &format!("k{written}"), value(written)).await;
            written += 1;
        }
        for i in written..written + 3 {
            put(&mut s, "notes", &format!("k{i}"), value(i)).await;
        }
        let rec = s.store.inner.load_container("notes").unwrap().unwrap();
        assert_eq!((rec.snapshot_covers, rec.changes.len()), (0, written + 3));
        release.send(()).unwrap();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        let rec = loop {
            let rec = s.store.inner.load_container("notes").unwrap().unwrap();
            if rec.snapshot.is_some() {
                break rec;
            }
            assert!(std::time::Instant::now() < deadline, "no snapshot written");
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        };
        // A megabyte of changes made the log due (Automerge deflates each
        // 40 kB put to about 26 kB), not 2,048 of them; the snapshot
        // covers what was logged then, and what came after stays logged.
        let covers = rec.snapshot_covers as usize;
        assert!((20..=50).contains(&covers), "compacted after {covers} puts");
        assert_eq!(rec.changes.len(), written + 3 - covers);
        let loaded = super::open::load_container(s.store.as_ref(), b"reader", "notes")
            .unwrap()
            .unwrap();
        for i in 0..written + 3 {
            assert_eq!(loaded.container.get(&format!("k{i}")), Some(value(i)));
        }
        // The next one is due only once the log weighs half the snapshot;
        // one at shutdown is waited for.
        let begun = s.store.snapshots_begun.load(SeqCst);
        put(&mut s, "notes", "last", value(999)).await;
        assert_eq!(s.store.snapshots_begun.load(SeqCst), begun);
        let (release, gate) = std::sync::mpsc::channel();
        *s.store.snapshot_gate.lock().unwrap() = Some(gate);
        let mut i = 1000;
        while s.store.snapshots_begun.load(SeqCst) == begun {
            assert!(i < 1100, "no second compaction");
            put(&mut s, "notes", &format!("k{i}"), value(i)).await;
            i += 1;
        }
        release.send(()).unwrap();
        s.exec.close().await.unwrap();
        let rec = s.store.inner.load_container("notes").unwrap().unwrap();
        assert!(rec.snapshot_covers > covers as u64, "the second one landed");
        let loaded = super::open::load_container(s.store.as_ref(), b"reader", "notes")
            .unwrap()
            .unwrap();
        assert_eq!(
            loaded.container.get(&format!("k{}", i - 1)),
            Some(value(i - 1))
        );
    }
}
