//! The [`Agent`]: one device of an agent as a state machine. Everything the
//! shell learns comes in as an [`Input`] with the time; everything to do
//! goes out as [`Effect`]s, which the shell performs in the order
//! [`crate::effect`] describes (persist, acknowledge, send, the rest).
//!
//! It owns the IO-free [`Session`] (admission, envelopes, key epochs, the
//! sync engine) and adds every decision around it: the device's lifecycle
//! and admin changes, pairing approvals, discovery planning and hint
//! checks, the keeper client, typed state, the revoked-write gate, and what
//! `status` and `sync --once` report.

use std::collections::BTreeMap;

use nuwa_crypto::epoch::KeyRing;
use nuwa_identity::chain::DidChain;
use nuwa_identity::keys::DeviceKey;
use nuwa_proto::Frame;
use nuwa_sync::{Engine, Membership, SecureChannel, Session, SessionConfig};
use tracing::warn;

use crate::api::{ApiError, Reply, Request};
use crate::book::Book;
use crate::count::Count;
use crate::discovery::Discovery;
use crate::effect::Effect;
use crate::input::{Input, NetEvent, RequestId};
use crate::keeper::Keepers;
use crate::peer::{Multiaddr, PeerId};
use crate::standing::Standing;

/// How the agent runs: which discovery sources, which infrastructure, the
/// memory budget, and whether it is a one-shot sync.
#[derive(Debug, Clone)]
pub struct Config {
    /// Redial peers that verified before (the known-peers cache).
    pub known_peers: bool,
    /// mDNS runs (it announces us, and approvals search it).
    pub mdns: bool,
    /// Why mDNS does not run though configured to (for `status`, `doctor`).
    pub mdns_failed: Option<String>,
    pub dht: bool,
    pub bootstrap: Vec<(PeerId, Multiaddr)>,
    pub rendezvous: bool,
    pub rendezvous_servers: Vec<(PeerId, Multiaddr)>,
    /// Store-and-forward nodes for devices never online together.
    pub keepers: Vec<(PeerId, Multiaddr)>,
    /// Peers named on the command line (`--peer`), with their PeerId when
    /// the address names one.
    pub static_peers: Vec<(Option<PeerId>, Multiaddr)>,
    /// Resident memory above which containers are evicted at once.
    pub memory_budget_bytes: u64,
    /// `sync --once`: stop when converged, or after this many ms.
    pub once_ms: Option<u64>,
    /// `sync --once` redraws its progress line in place (a terminal).
    pub once_tty: bool,
    /// How often the typed-state lifecycle (TTL, retention) runs.
    pub lifecycle_every_ms: u64,
    /// The local API's address, for `status`.
    pub api_url: String,
    pub session: SessionConfig,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            known_peers: true,
            mdns: false,
            mdns_failed: None,
            dht: false,
            bootstrap: Vec::new(),
            rendezvous: false,
            rendezvous_servers: Vec::new(),
            keepers: Vec::new(),
            static_peers: Vec::new(),
            memory_budget_bytes: 256_000_000,
            once_ms: None,
            once_tty: false,
            lifecycle_every_ms: crate::constants::LIFECYCLE_EVERY_MS,
            api_url: String::new(),
            session: SessionConfig::default(),
        }
    }
}

/// What the shell loaded from the device's home before the agent starts.
pub struct Boot {
    pub device: DeviceKey,
    /// The master key of `init`, on the home that holds it.
    pub master: Option<DeviceKey>,
    pub name: String,
    pub log: DidChain,
    pub keys: KeyRing,
    /// The grant of the current key epoch (forwarded in every `Hello`).
    pub grant: Option<Vec<u8>>,
    /// The containers the store holds (loaded, or cold with their heads).
    pub engine: Engine,
    /// Containers moved aside at start because their records did not open.
    pub quarantined: Vec<crate::status::QuarantineStatus>,
    /// The metadata records [`Agent::meta_keys`] names, as stored.
    pub meta: BTreeMap<String, Vec<u8>>,
    /// Where the network listens (up before the agent starts).
    pub listen_addrs: Vec<Multiaddr>,
    /// This device's PeerId (from its key).
    pub peer_id: PeerId,
    /// The interfaces mDNS actually watches (empty when off or none).
    pub mdns_watching: Vec<String>,
}

/// Collects the effects of one [`Agent::handle`].
#[derive(Default)]
pub(crate) struct Out {
    pub(crate) effects: Vec<Effect>,
}

impl Out {
    pub(crate) fn push(&mut self, e: Effect) {
        self.effects.push(e);
    }

    pub(crate) fn count(&mut self, c: Count) {
        self.effects.push(Effect::Count(c));
    }

    pub(crate) fn count_by(&mut self, c: Count, n: u64) {
        self.effects.push(Effect::CountBy(c, n));
    }

    pub(crate) fn reply(&mut self, id: RequestId, result: Result<Reply, ApiError>) {
        self.effects.push(Effect::Reply { id, result });
    }

    pub(crate) fn send(&mut self, peer: PeerId, frame: &Frame) {
        self.effects.push(Effect::Send {
            peer,
            frame: frame.encode(),
        });
    }
}

/// One device of an agent.
pub struct Agent {
    config: Config,
    /// Admission, envelopes, key epochs and the sync engine.
    pub(crate) session: Session,
    /// This device's admin keys, the chain as last saved, and whether it
    /// was revoked.
    pub(crate) standing: Standing,
    /// Where peers are found and how they are reached.
    pub(crate) discovery: Discovery,
    /// The keeper client: what was pushed to and pulled from each keeper.
    pub(crate) keepers: Keepers,
    /// `device approve`: candidates waiting to pair and the approval underway.
    pub(crate) pairing: crate::approve::Pairing,
    /// Typed state: the schema registry and the lifecycle timer.
    pub(crate) asm: crate::asm::Asm,
    /// What `status` reports that nothing else keeps: rejections, clock
    /// warnings, names and last-seen times, round trips.
    pub(crate) book: Book,
    /// `sync --once`: the deadline and the last progress line.
    pub(crate) once: Option<crate::report::Once>,
    /// When this device last pruned expired devices from the DID chain.
    pub(crate) pruning: crate::expiry::Pruning,
    /// The access view last handed to the shell (app capabilities).
    pub(crate) apps: crate::apps::Apps,
}

impl Agent {
    /// The metadata records the shell reads into [`Boot::meta`].
    pub fn meta_keys(config: &Config) -> Vec<String> {
        let mut keys = vec![
            crate::discovery::KNOWN_PEERS_META.to_owned(),
            crate::devices::SEEN_META.to_owned(),
            crate::stranded::LOCAL_WRITES_META.to_owned(),
        ];
        keys.extend(
            config
                .keepers
                .iter()
                .map(|(p, _)| crate::keeper::meta_key(p)),
        );
        keys
    }

    pub fn new(config: Config, boot: Boot, now_ms: u64) -> Agent {
        let discovery = Discovery::new(&config, &boot, now_ms);
        let keepers = Keepers::new(&config.keepers, &boot.meta);
        let book = Book::new(&boot, now_ms);
        let once = config
            .once_ms
            .map(|ms| crate::report::Once::new(now_ms + ms));
        let standing = Standing::new(boot.master, &boot.log, &boot.meta, now_ms);
        let context_id = nuwa_identity::keys::context_id_for(&boot.device.public());
        let mut membership = Membership::new(
            boot.log.clone(),
            context_id.clone(),
            boot.name,
            DeviceKey::from_seed(&boot.device.seed()),
        );
        if let Some(grant) = boot.grant {
            membership.set_epoch_grant(grant);
        }
        let secure = SecureChannel::new(boot.log.did().to_owned(), context_id, boot.keys);
        let session = Session::new(membership, secure, boot.engine, config.session.clone());
        let mut agent = Agent {
            asm: crate::asm::Asm::new(config.lifecycle_every_ms),
            apps: crate::apps::Apps::default(),
            config,
            session,
            standing,
            discovery,
            keepers,
            pairing: crate::approve::Pairing::default(),
            book,
            once,
            pruning: Default::default(),
        };
        agent
            .standing
            .check_revoked(agent.session.membership(), now_ms);
        if let Err(r) = agent.session.self_authorised(now_ms) {
            warn!(
                reason = %r,
                "this device is not an active member of the agent's DID document; \
                 peers will refuse it until it is added"
            );
        }
        agent
    }

    pub fn config(&self) -> &Config {
        &self.config
    }

    /// The session (read-only): the engine's containers, the chain, keys.
    pub fn session(&self) -> &Session {
        &self.session
    }

    /// Handles one input at `now_ms` (Unix milliseconds) and returns what
    /// to do, for the executor's phases.
    pub fn handle(&mut self, input: Input, now_ms: u64) -> Vec<Effect> {
        let mut out = Out::default();
        match input {
            Input::Start => self.start(now_ms, &mut out),
            Input::Tick { rss_bytes } => self.tick(now_ms, rss_bytes, &mut out),
            Input::Net(events) => self.on_net_run(events, now_ms, &mut out),
            Input::Mdns(ev) => self.on_mdns(ev, now_ms, &mut out),
            Input::Api(batch) => self.on_api_batch(batch, now_ms, &mut out),
            Input::CaughtUp(done) => {
                self.book.catch_up_finished(done.container());
                let effects = self.session.finish_catch_up(*done, now_ms);
                self.absorb(effects, now_ms, &mut out);
            }
            Input::Reloaded { container, loaded } => {
                if let Some(c) = loaded {
                    self.session.insert_container(container, *c);
                }
            }
            Input::Loaded { container, loaded } => {
                let effects =
                    self.session
                        .finish_load(&container, loaded.map(|c| c.map(|c| *c)), now_ms);
                self.absorb(effects, now_ms, &mut out);
            }
            Input::Scanned {
                container,
                heads,
                scan,
            } => self.on_scanned(container, heads, scan, &mut out),
        }
        self.finish(now_ms, &mut out);
        out.effects
    }

    fn start(&mut self, now_ms: u64, out: &mut Out) {
        self.asm_start(out);
        self.discovery_start(now_ms, out);
    }

    fn tick(&mut self, now_ms: u64, rss_bytes: Option<u64>, out: &mut Out) {
        self.pairing_tick(now_ms, out);
        self.asm_lifecycle(now_ms, out);
        let effects = self.session.tick(now_ms);
        self.absorb(effects, now_ms, out);
        self.memory_tick(now_ms, rss_bytes, out);
        self.release_tick(now_ms, out);
        self.discovery_tick(now_ms, out);
        self.keeper_tick(now_ms, out);
        self.remember_seen(now_ms, false, out);
        self.drop_expired_peers(now_ms, out);
        self.prune_expired(now_ms, out);
        self.once_tick(now_ms, out);
    }

    /// A run of network events: frames and gossip are handled with gossip
    /// deltas queued, then applied together.
    fn on_net_run(&mut self, events: Vec<NetEvent>, now_ms: u64, out: &mut Out) {
        self.session.defer_gossip(true);
        for ev in events {
            self.on_net(ev, now_ms, out);
        }
        self.session.defer_gossip(false);
        let effects = self.session.apply_queued();
        self.absorb(effects, now_ms, out);
    }

    fn on_net(&mut self, ev: NetEvent, now_ms: u64, out: &mut Out) {
        match ev {
            NetEvent::Listening(a) => self.book.listening(a),
            NetEvent::Connected {
                peer,
                public,
                remote,
            } => {
                if self.discovery.is_infra(&peer) {
                    // Bootstrap, rendezvous and keeper nodes are
                    // introducers, not devices: no Hello, no state.
                    self.on_infra_connected(peer, now_ms, out);
                    return;
                }
                tracing::debug!(%peer, %remote, "connected; sending hello");
                let effects =
                    self.session
                        .connected(&peer.to_string(), public, remote.to_string(), now_ms);
                self.absorb(effects, now_ms, out);
                if public.is_some() {
                    self.pairing_on_connected(peer, out);
                }
            }
            NetEvent::Rtt { peer, rtt_ms } => self.book.rtt(peer, rtt_ms),
            NetEvent::Disconnected { peer } => {
                self.book.forget_rtt(&peer);
                self.discovery.on_disconnected(&peer);
                self.keepers.on_disconnected(&peer);
                let effects = self.session.disconnected(&peer.to_string());
                self.absorb(effects, now_ms, out);
            }
            NetEvent::Frame { peer, bytes } => self.on_frame(peer, &bytes, now_ms, out),
            NetEvent::SendFailed { peer, reason } => {
                out.count(Count::SendFailed);
                tracing::debug!(%peer, %reason, "frame not delivered");
            }
            NetEvent::InboundError { peer, reason } => {
                out.count(Count::InboundFrameError);
                tracing::debug!(%peer, %reason, "unreadable frame from peer");
            }
            NetEvent::DialFailed { peer, reason } => {
                out.count(Count::DialFailed);
                tracing::debug!(?peer, %reason, "dial failed");
            }
            other => self.on_wide_event(other, now_ms, out),
        }
    }

    fn on_frame(&mut self, peer: PeerId, bytes: &[u8], now_ms: u64, out: &mut Out) {
        let frame = match Frame::decode(bytes) {
            Ok(f) => f,
            Err(e) => {
                out.count(Count::MalformedFrame);
                tracing::debug!(%peer, error = %e, "malformed frame");
                return;
            }
        };
        let key = peer.to_string();
        let effects = match frame {
            Frame::Pairing { step, body } => {
                // Pairing talks to a device that has no listed key yet:
                // keep its Hello deadline from cutting the exchange.
                self.session.touch_pending(&key, now_ms);
                self.on_pairing_frame(peer, step, body, now_ms, out);
                return;
            }
            Frame::Hello(hello) => self.session.on_hello(&key, &hello, now_ms),
            Frame::Envelope(env) => self.session.on_envelope(&key, env, now_ms),
            Frame::DidEntriesRequest { from_seq } => self.session.on_did_request(&key, from_seq),
            Frame::DidEntries {
                from_seq,
                entries_json,
                more,
            } => self
                .session
                .on_did_entries(&key, from_seq, &entries_json, more, now_ms),
            Frame::KeeperResponse(resp) => {
                self.on_keeper_response(peer, *resp, now_ms, out);
                return;
            }
            Frame::KeeperRequest(_) => {
                // Devices are not keepers.
                out.count(Count::KeeperResponsesUnexpected);
                return;
            }
        };
        self.absorb(effects, now_ms, out);
    }

    fn on_api_batch(&mut self, batch: Vec<(RequestId, Request)>, now_ms: u64, out: &mut Out) {
        // Every write of the batch is applied here; the executor pushes the
        // changes to peers, makes them durable in one group commit per
        // container and only then sends the replies (`Phases`).
        let mut pending: Vec<(RequestId, crate::api::Pending)> = Vec::new();
        for (id, req) in batch {
            if self.standing.revoked() && req.writes() {
                // A revoked device takes no writes: they would never sync.
                out.reply(id, Err(self.standing.revoked_error(&self.session)));
                continue;
            }
            match self.on_request(id, req, now_ms, out) {
                Ok(Some(p)) => pending.push((id, p)),
                Ok(None) => {}
                Err(e) => out.reply(id, Err(e)),
            }
        }
        // Replies carry the heads as they are once every write of the
        // batch is in (the executor sends them after persisting).
        for (id, p) in pending {
            let reply = p.finish(|c| self.heads_hex(c));
            out.reply(id, Ok(reply));
        }
    }

    /// One request: answered now (`None`, having pushed its reply, or an
    /// error), or a reply that waits for the rest of the batch.
    fn on_request(
        &mut self,
        id: RequestId,
        req: Request,
        now_ms: u64,
        out: &mut Out,
    ) -> Result<Option<crate::api::Pending>, ApiError> {
        use crate::api::Pending;
        match req {
            Request::Put(body) => {
                crate::asm::check_untyped_write(&self.asm.registry, &body.container)?;
                crate::asm::check_new_name(&body.container)?;
                crate::asm::check_new_key(&body.key)?;
                let change = self
                    .session
                    .local_put(&body.container, &body.key, &body.value)
                    .map_err(|e| {
                        ApiError::new(crate::api::ErrorCode::InvalidWrite, e.to_string())
                    })?;
                self.stage(&body.container, change, out);
                Ok(Some(Pending::Put {
                    container: body.container,
                    key: body.key,
                }))
            }
            Request::Revoke(body) => {
                let reply = self.on_revoke(body, now_ms, out)?;
                Ok(Some(Pending::Ready(Reply::Revoke(reply))))
            }
            Request::Admin(change) => {
                let reply = self.on_admin_change(change, now_ms, out)?;
                Ok(Some(Pending::Ready(Reply::Value(reply))))
            }
            Request::Provision { body, device } => {
                let reply = self.on_provision(id, body, device, now_ms, out)?;
                Ok(Some(Pending::Ready(Reply::Value(reply))))
            }
            Request::Approve(body) => {
                self.on_approve(id, body, now_ms, out);
                Ok(None)
            }
            Request::Batch(body) => {
                let reply = self.on_batch(body, out);
                Ok(Some(Pending::Batch(reply)))
            }
            Request::Tool(tool) => {
                let value = self.on_tool(tool, now_ms, out)?;
                Ok(Some(Pending::Ready(Reply::Value(value))))
            }
            Request::Status => {
                out.reply(id, Ok(Reply::Status(Box::new(self.status(now_ms)))));
                Ok(None)
            }
            Request::Devices => {
                out.reply(id, Ok(Reply::Devices(self.devices(now_ms))));
                Ok(None)
            }
            Request::AppGrant(body) => {
                let value = self.on_app_grant(body, now_ms, out)?;
                Ok(Some(Pending::Ready(Reply::Value(value))))
            }
            Request::AppRevoke(body) => {
                let value = self.on_app_revoke(body, now_ms, out)?;
                Ok(Some(Pending::Ready(Reply::Value(value))))
            }
            Request::AppList => {
                let list = serde_json::to_value(self.app_list())
                    .map_err(|e| ApiError::new(crate::api::ErrorCode::Internal, e.to_string()))?;
                out.reply(id, Ok(Reply::Value(list)));
                Ok(None)
            }
        }
    }

    /// A local change: persisted with origin `local` in this handle's
    /// effects, before anything is acknowledged or sent.
    pub(crate) fn stage(&mut self, container: &str, change: Option<Vec<u8>>, out: &mut Out) {
        if let Some(change) = change {
            out.push(Effect::Persist {
                container: container.to_owned(),
                changes: vec![change],
                origin: nuwa_sync::Origin::Local,
                sealed_at_ms: None,
            });
        }
    }

    /// Hex heads of a container (empty if it does not exist).
    pub(crate) fn heads_hex(&self, container: &str) -> Vec<String> {
        self.session
            .engine()
            .heads_of(container)
            .map(|h| h.iter().map(hex::encode).collect())
            .unwrap_or_default()
    }

    /// Whether `peer` has an open connection the session knows of.
    pub(crate) fn is_connected(&self, peer: &PeerId) -> bool {
        self.session.peers().contains_key(&peer.to_string())
    }

    pub(crate) fn is_verified(&self, peer: &PeerId) -> bool {
        self.session.context_of(&peer.to_string()).is_some()
    }

    /// This device's PeerId.
    pub fn peer_id(&self) -> PeerId {
        self.book.peer_id
    }

    /// How `container` asks to be compressed when saved (its schema's
    /// `x-asm` compression), if at all.
    pub fn compression_of(&self, container: &str) -> Option<nuwa_asm::model::Compression> {
        self.asm.registry.get(container).and_then(|s| s.compression)
    }

    /// The daemon is stopping: the last record of devices seen.
    pub fn shutdown(&mut self, now_ms: u64) -> Vec<Effect> {
        let mut out = Out::default();
        self.remember_seen(now_ms, true, &mut out);
        self.save_local_writes(now_ms, true, &mut out);
        out.effects
    }

    /// The end of every handle: local changes made durable in this handle
    /// are sealed and sent (the executor may send them before they are
    /// flushed, never acknowledges them before: `Phases`), big
    /// sync messages go to workers, and a changed schema registry reaches
    /// the reader.
    fn finish(&mut self, now_ms: u64, out: &mut Out) {
        let effects = self.session.flush();
        self.absorb(effects, now_ms, out);
        for catch_up in self.session.take_catch_ups() {
            self.book.catch_up_started(catch_up.container(), now_ms);
            out.push(Effect::RunCatchUp(Box::new(catch_up)));
        }
        for container in self.session.take_loads() {
            out.push(Effect::Load(container));
        }
        // `sync --once` ends in the handle that converged it, not at the
        // next tick (its persists run first: the executor's phases).
        if self.once.is_some() {
            self.once_tick(now_ms, out);
        }
        self.refresh_registry(out);
        self.refresh_access(now_ms, out);
        self.save_local_writes(now_ms, false, out);
    }

    /// Notes this handle's local changes (see [`crate::stranded`]) and
    /// saves the record when it is due, or at once (`force`).
    fn save_local_writes(&mut self, now_ms: u64, force: bool, out: &mut Out) {
        for e in &out.effects {
            if let Effect::Persist {
                container,
                origin: nuwa_sync::Origin::Local,
                ..
            } = e
            {
                self.standing.writes.wrote(container, now_ms);
            }
        }
        if let Some(bytes) = self.standing.writes.take_save(now_ms, force) {
            out.push(Effect::SaveMeta {
                key: crate::stranded::LOCAL_WRITES_META.to_owned(),
                bytes,
            });
        }
    }
}
