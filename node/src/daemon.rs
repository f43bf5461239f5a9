//! `nuwa-node run`: the daemon. One loop owns the sync engine, the
//! membership checks, the secure channel and the store; the network actor,
//! mDNS and the local API feed it through bounded channels.
//!
//! Order of trust on a new connection: Noise proves the peer holds the key
//! behind its PeerId → both sides send a Hello → the Hello is checked
//! against the agent's DID document (membership) → only then does the engine
//! learn about the peer, and only verified peers' envelopes are opened.
//! Anything else is counted, recorded for `status`, and the peer is
//! disconnected.

use std::collections::{BTreeMap, VecDeque};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use nuwa_discovery::{Announcement, DiscoveryEvent, Mdns, MdnsConfig};
use nuwa_net::{Multiaddr, NetConfig, NetEvent, NetHandle, PeerId};
use nuwa_proto::{Frame, SyncPayload};
use nuwa_state::Container;
use nuwa_store::{SledStore, Storage};
use nuwa_sync::{Action, Engine, Membership, Rejection, SecureChannel};
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;
use tracing::{debug, error, info, warn};

use crate::api::{self, ApiError, ApiFile, ApiRequest, PutBody, PutReply};
use crate::home::{self, Home};
use crate::status::{ContainerStatus, DeviceStatus, PeerStatus, RejectionStatus, Status};

mod approve;
mod asm;
mod lifecycle;
mod wide;

pub use asm::{LIFECYCLE_EVERY_MS, Tool};

/// Options of `nuwa-node run` and `sync --once`.
#[derive(Debug, Clone)]
pub struct RunOptions {
    pub listen: Vec<Multiaddr>,
    pub peers: Vec<Multiaddr>,
    pub known_peers: bool,
    pub mdns: bool,
    pub mdns_interfaces: Vec<String>,
    pub dht: bool,
    pub bootstrap: Vec<Multiaddr>,
    pub rendezvous: bool,
    pub rendezvous_servers: Vec<Multiaddr>,
    pub api_listen: SocketAddr,
    /// `sync --once`: stop when converged with every verified peer (Ok) or
    /// when this much time has passed (Err with the reason).
    pub once: Option<Duration>,
    /// How often the ASM lifecycle task runs.
    pub lifecycle_every: Duration,
}

/// Oldest mDNS announcement accepted, and how often ours is re-signed.
const ANNOUNCE_MAX_AGE_SECS: i64 = 600;
const ANNOUNCE_REFRESH: Duration = Duration::from_secs(120);
const TICK: Duration = Duration::from_millis(200);
/// Rejection records kept for `status`.
const MAX_REJECTIONS: usize = 256;
/// API requests taken per loop turn (one durable group commit).
const MAX_API_BATCH: usize = 512;
/// Changes logged since the last snapshot before a container is compacted.
const COMPACT_AFTER_CHANGES: u64 = 2048;

#[derive(Debug, Clone)]
enum PeerState {
    /// Connected; Hello not yet verified. Nothing but a Hello is accepted.
    Pending { public: [u8; 32], remote: Multiaddr },
    Verified {
        context_id: String,
        public: [u8; 32],
        remote: Multiaddr,
        since_ms: u64,
    },
}

#[derive(Debug, Clone)]
struct RejectionRecord {
    label: &'static str,
    reason: String,
    count: u64,
    last_ms: u64,
}

struct Daemon {
    home_dir: PathBuf,
    name: String,
    membership: Membership,
    secure: SecureChannel,
    engine: Engine,
    store: Arc<dyn Storage>,
    net: NetHandle,
    peers: BTreeMap<PeerId, PeerState>,
    rejections: BTreeMap<(String, String), RejectionRecord>,
    rejection_order: VecDeque<(String, String)>,
    counters: BTreeMap<String, u64>,
    /// Changes logged per container since its last snapshot.
    logged: BTreeMap<String, u64>,
    /// Highest change-log sequence number per container.
    last_seq: BTreeMap<String, u64>,
    /// Announcements of our agent whose key we do not know yet; retried
    /// when the DID log grows.
    unknown_announcements: BTreeMap<String, (Announcement, Vec<Multiaddr>)>,
    listen_addrs: Vec<Multiaddr>,
    api_url: String,
    fatal: Option<anyhow::Error>,
    wide: wide::Wide,
    /// Name and last time each device was seen verified, by context id
    /// (persisted encrypted, for `device list`).
    seen: crate::devices::Seen,
    /// Envelopes of an epoch whose key has not arrived yet (arrival time,
    /// peer, envelope), replayed when its grant comes.
    held: VecDeque<(u64, PeerId, nuwa_crypto::Envelope)>,
    /// `device approve`: candidates waiting to pair and the approval underway.
    pairing: approve::Pairing,
    mdns_on: bool,
    /// Typed state: the schema registry and the lifecycle timer.
    asm: asm::Asm,
    /// Change events for `/v1/state.events`.
    events: tokio::sync::broadcast::Sender<api::ChangeEvent>,
    /// Whether changes being persisted come from the local API.
    local_origin: bool,
}

pub async fn run(home: Home, opts: RunOptions) -> Result<()> {
    let cancel = CancellationToken::new();
    let lock = lock_home(&home.dir)?;
    let now = home::now_ms();
    let context_id = home.info.context_id.clone();
    let did = home.log.did().to_owned();
    let mut membership = Membership::new(
        home.log.clone(),
        context_id.clone(),
        home.info.name.clone(),
        nuwa_identity::keys::DeviceKey::from_seed(&home.device.seed()),
    );
    if let Some(grant) = &home.grant {
        membership.set_epoch_grant(grant.clone());
    }
    match membership.self_authorised(now) {
        Ok(()) => {}
        Err(r) => warn!(
            reason = %r,
            "this device is not an active member of the agent's DID document; \
             peers will refuse it until it is added"
        ),
    }
    let store: Arc<dyn Storage> = Arc::new(
        SledStore::open(&home.dir.join(home::STORE_DIR), home.at_rest.clone())
            .with_context(|| format!("cannot open the store in {}", home.dir.display()))?,
    );
    let actor = home.device.public().to_vec();
    let mut engine = Engine::new(actor.clone(), nuwa_sync::Config::default());
    let mut logged = BTreeMap::new();
    let mut last_seq = BTreeMap::new();
    for name in store.list_containers()? {
        let Some(loaded) = load_container(store.as_ref(), &actor, &name)? else {
            continue;
        };
        engine.insert_container(name.clone(), loaded.container);
        last_seq.insert(name.clone(), loaded.last_seq);
        logged.insert(name, loaded.logged);
    }
    info!(containers = engine.containers().count(), "store opened");

    let net_config = NetConfig {
        listen: opts.listen.clone(),
        features: nuwa_net::Features {
            kad: opts.dht,
            rendezvous_client: opts.rendezvous,
            gossip: true,
            infrastructure: None,
        },
        ..NetConfig::default()
    };
    let (net, mut net_events) = nuwa_net::spawn(home.device.seed(), net_config, cancel.clone())
        .await
        .context("cannot start the network")?;
    let local_peer = net.local_peer_id();

    // Wait until the listeners are up so that mDNS announces a real port.
    let mut listen_addrs = Vec::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while listen_addrs.len() < opts.listen.len().max(1) {
        match tokio::time::timeout_at(deadline, net_events.recv()).await {
            Ok(Some(NetEvent::Listening(a))) => listen_addrs.push(a),
            Ok(Some(_)) => {}
            Ok(None) => anyhow::bail!("the network stopped during start-up"),
            Err(_) => break,
        }
    }
    if listen_addrs.is_empty() {
        anyhow::bail!("no listen address came up within 5 s; check --listen");
    }
    for a in &listen_addrs {
        info!(address = %format!("{a}/p2p/{local_peer}"), "listening");
    }

    let (api_tx, mut api_rx) = mpsc::channel::<ApiRequest>(1024);
    let token = {
        let mut t = [0u8; 32];
        getrandom::fill(&mut t).map_err(|e| anyhow::anyhow!("no randomness: {e}"))?;
        hex::encode(t)
    };
    let (events_tx, _) = tokio::sync::broadcast::channel::<api::ChangeEvent>(1024);
    let api_addr = api::serve(
        opts.api_listen,
        token.clone(),
        api_tx,
        events_tx.clone(),
        cancel.clone(),
    )
    .await
    .context("cannot start the local API")?;
    let api_url = format!("http://{api_addr}");
    home::write_private(
        &home.dir.join(home::API_FILE),
        &serde_json::to_vec_pretty(&ApiFile {
            url: api_url.clone(),
            token,
            pid: std::process::id(),
        })?,
    )?;
    info!(url = %api_url, "local API ready");

    let port = listen_addrs.iter().find_map(tcp_port).unwrap_or(0);
    let mut mdns = None;
    let mut mdns_events = None;
    if opts.mdns {
        let ann = sign_announcement(&membership, &local_peer, port);
        match Mdns::start(MdnsConfig {
            instance_name: local_peer.to_string(),
            port,
            interfaces: opts.mdns_interfaces.clone(),
            announcement: ann,
            refresh_secs: ANNOUNCE_REFRESH.as_secs(),
        }) {
            Ok((m, rx)) => {
                mdns = Some(m);
                mdns_events = Some(rx);
                info!("mDNS discovery started");
            }
            // A dead discovery source must not stop the others.
            Err(e) => warn!(error = %e, "mDNS unavailable; continuing without it"),
        }
    }

    let secure = SecureChannel::new(did.clone(), context_id.clone(), home.keys.clone());
    let mut d = Daemon {
        home_dir: home.dir.clone(),
        name: home.info.name.clone(),
        membership,
        secure,
        engine,
        store,
        net: net.clone(),
        peers: BTreeMap::new(),
        rejections: BTreeMap::new(),
        rejection_order: VecDeque::new(),
        counters: BTreeMap::new(),
        logged,
        last_seq,
        unknown_announcements: BTreeMap::new(),
        listen_addrs,
        api_url,
        fatal: None,
        wide: wide::Wide::new(&did, &opts),
        seen: crate::devices::Seen::default(),
        held: VecDeque::new(),
        pairing: approve::Pairing::default(),
        mdns_on: mdns.is_some(),
        asm: asm::Asm::new(opts.lifecycle_every),
        events: events_tx,
        local_origin: false,
    };
    d.seen = crate::devices::Seen::load(d.store.as_ref());
    d.asm_start().await;
    d.start_wide().await;

    let mut tick = tokio::time::interval(TICK);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut announce = tokio::time::interval(ANNOUNCE_REFRESH);
    announce.tick().await;
    let shutdown = shutdown_signal();
    tokio::pin!(shutdown);
    let once_deadline = opts.once.map(|t| home::now_ms() + t.as_millis() as u64);
    let mut once_last_line = String::new();
    let mut once_result: Option<Result<(), String>> = None;
    info!(did = %did, context_id = %context_id, peer_id = %local_peer, "daemon running");
    loop {
        tokio::select! {
            _ = &mut shutdown => {
                info!("shutting down");
                break;
            }
            ev = net_events.recv() => match ev {
                Some(ev) => d.on_net(ev).await,
                None => { error!("network task stopped"); break; }
            },
            req = api_rx.recv() => {
                let Some(first) = req else { break };
                let mut batch = vec![first];
                while batch.len() < MAX_API_BATCH {
                    match api_rx.try_recv() {
                        Ok(r) => batch.push(r),
                        Err(_) => break,
                    }
                }
                d.on_api_batch(batch).await;
            }
            ev = recv_opt(&mut mdns_events) => match ev {
                Some(ev) => d.on_discovery(ev).await,
                None => { mdns_events = None; }
            },
            _ = tick.tick() => {
                let now = home::now_ms();
                d.secure.prune(now);
                d.expire_held(now);
                d.pairing_tick(now).await;
                d.asm_lifecycle(now).await;
                let actions = d.engine.tick(now);
                d.perform(actions).await;
                d.wide_tick(now).await;
                if let Some(deadline) = once_deadline {
                    match d.once_progress(now, deadline, &mut once_last_line) {
                        None => {}
                        Some(result) => {
                            once_result = Some(result);
                            break;
                        }
                    }
                }
            }
            _ = announce.tick() => {
                if let Some(m) = &mdns {
                    if let Err(e) = m.update_announcement(sign_announcement(&d.membership, &local_peer, port)) {
                        warn!(error = %e, "cannot refresh the mDNS announcement");
                    }
                }
            }
        }
        if let Some(e) = d.fatal.take() {
            error!(error = %e, "fatal storage error; stopping so that nothing unacknowledged is reported durable");
            cancel.cancel();
            let _ = std::fs::remove_file(home.dir.join(home::API_FILE));
            return Err(e);
        }
    }
    cancel.cancel();
    if let Some(m) = mdns {
        if let Err(e) = m.shutdown() {
            debug!(error = %e, "mDNS shutdown");
        }
    }
    d.store.flush().context("final store flush")?;
    let _ = std::fs::remove_file(home.dir.join(home::API_FILE));
    drop(lock);
    info!("stopped cleanly");
    match once_result {
        Some(Err(reason)) => Err(anyhow::anyhow!(reason)),
        _ => Ok(()),
    }
}

async fn recv_opt(
    rx: &mut Option<nuwa_discovery::flume::Receiver<DiscoveryEvent>>,
) -> Option<DiscoveryEvent> {
    match rx {
        Some(rx) => rx.recv_async().await.ok(),
        None => std::future::pending().await,
    }
}

async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(s) => s,
                Err(_) => {
                    let _ = ctrl_c.await;
                    return;
                }
            };
        tokio::select! {
            _ = ctrl_c => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    let _ = ctrl_c.await;
}

/// Holds an exclusive lock on the home so that two daemons never share a
/// store.
pub(crate) fn lock_home(dir: &std::path::Path) -> Result<std::fs::File> {
    use std::os::unix::fs::OpenOptionsExt;
    let path = dir.join(home::LOCK_FILE);
    let f = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .mode(0o600)
        .open(&path)
        .with_context(|| format!("cannot open {}", path.display()))?;
    f.try_lock().map_err(|_| {
        anyhow::anyhow!(
            "another nuwa-node daemon is already running with home {}; stop it first or use another --home",
            dir.display()
        )
    })?;
    Ok(f)
}

fn tcp_port(addr: &Multiaddr) -> Option<u16> {
    addr.iter().find_map(|p| match p {
        nuwa_net::Protocol::Tcp(port) => Some(port),
        _ => None,
    })
}

fn sign_announcement(m: &Membership, peer: &PeerId, port: u16) -> Announcement {
    Announcement::new_signed(
        m.did(),
        m.context_id(),
        peer.to_string(),
        port,
        home::now_unix_secs(),
        |bytes| m.device().sign(bytes),
    )
}

/// A container as the store holds it: decrypted, decompressed, loaded.
struct LoadedContainer {
    container: Container,
    /// Sequence number of the last logged change.
    last_seq: u64,
    /// Changes logged after the snapshot.
    logged: u64,
}

fn load_container(
    store: &dyn Storage,
    actor: &[u8],
    name: &str,
) -> Result<Option<LoadedContainer>> {
    let Some(rec) = store.load_container(name)? else {
        return Ok(None);
    };
    let logged = rec.changes.len() as u64;
    let snapshot = match rec.snapshot.as_deref() {
        Some(s) => Some(
            crate::snapshot::decompress(s)
                .with_context(|| format!("cannot read the snapshot of container {name:?}"))?,
        ),
        None => None,
    };
    let container = Container::load(actor, snapshot.as_deref(), rec.changes)
        .with_context(|| format!("cannot load container {name:?}"))?;
    Ok(Some(LoadedContainer {
        container,
        last_seq: rec.last_seq,
        logged,
    }))
}

impl Daemon {
    fn count(&mut self, what: &str) {
        self.add(what, 1);
    }

    fn add(&mut self, what: &str, n: u64) {
        *self.counters.entry(what.to_owned()).or_default() += n;
    }

    fn reject(&mut self, source: &str, who: String, rejection: &Rejection) {
        self.count(&format!("rejected_{source}_{}", rejection.label()));
        let key = (source.to_owned(), who);
        let now = home::now_ms();
        match self.rejections.get_mut(&key) {
            Some(r) => {
                r.count += 1;
                r.last_ms = now;
                r.label = rejection.label();
                r.reason = rejection.to_string();
            }
            None => {
                if self.rejection_order.len() >= MAX_REJECTIONS {
                    if let Some(old) = self.rejection_order.pop_front() {
                        self.rejections.remove(&old);
                    }
                }
                self.rejection_order.push_back(key.clone());
                self.rejections.insert(
                    key,
                    RejectionRecord {
                        label: rejection.label(),
                        reason: rejection.to_string(),
                        count: 1,
                        last_ms: now,
                    },
                );
            }
        }
    }

    async fn on_net(&mut self, ev: NetEvent) {
        match ev {
            NetEvent::Listening(a) => {
                if !self.listen_addrs.contains(&a) {
                    self.listen_addrs.push(a);
                }
            }
            NetEvent::Connected {
                peer,
                public,
                remote,
            } => {
                if self.wide.is_infra(&peer) {
                    // Bootstrap and rendezvous nodes are introducers, not
                    // devices: no Hello, no state.
                    self.on_infra_connected(peer).await;
                    return;
                }
                let Some(public) = public else {
                    self.reject("connection", peer.to_string(), &Rejection::UnknownKey);
                    let _ = self.net.disconnect(peer).await;
                    return;
                };
                debug!(%peer, %remote, "connected; sending hello");
                self.peers
                    .insert(peer, PeerState::Pending { public, remote });
                match self.membership.hello(home::now_ms()) {
                    Ok(hello) => {
                        let _ = self.net.send(peer, Frame::Hello(hello).encode()).await;
                    }
                    Err(e) => warn!(error = %e, "cannot build hello"),
                }
                self.pairing_on_connected(peer).await;
            }
            NetEvent::Disconnected { peer } => {
                self.wide.on_disconnected(&peer);
                if let Some(PeerState::Verified { context_id, .. }) = self.peers.remove(&peer) {
                    info!(%peer, context_id = %context_id, "peer disconnected");
                    self.seen.saw(&context_id, "", home::now_ms());
                    self.seen.save(self.store.as_ref());
                }
                self.engine.peer_down(&peer.to_string());
            }
            NetEvent::Frame { peer, frame } => self.on_frame(peer, frame).await,
            NetEvent::SendFailed { peer, reason } => {
                self.count("send_failed");
                debug!(%peer, %reason, "frame not delivered");
            }
            NetEvent::InboundError { peer, reason } => {
                self.count("inbound_frame_error");
                debug!(%peer, %reason, "unreadable frame from peer");
            }
            NetEvent::DialFailed { peer, reason } => {
                self.count("dial_failed");
                debug!(?peer, %reason, "dial failed");
            }
            other => self.on_wide_event(other).await,
        }
    }

    async fn on_frame(&mut self, peer: PeerId, bytes: Vec<u8>) {
        let frame = match Frame::decode(&bytes) {
            Ok(f) => f,
            Err(e) => {
                self.count("malformed_frame");
                debug!(%peer, error = %e, "malformed frame");
                return;
            }
        };
        let now = home::now_ms();
        if let Frame::Pairing { step, body } = frame {
            self.on_pairing_frame(peer, step, body).await;
            return;
        }
        match (frame, self.peers.get(&peer).cloned()) {
            (Frame::Hello(hello), Some(PeerState::Pending { public, remote })) => {
                match self.membership.verify_hello(&public, &hello, now) {
                    Ok(v) => {
                        if v.log_extended {
                            self.on_log_extended().await;
                        }
                        info!(%peer, context_id = %v.context_id, address = %remote, "peer verified");
                        self.seen.saw(&v.context_id, &v.name, now);
                        self.seen.save(self.store.as_ref());
                        self.count("peers_verified");
                        self.peers.insert(
                            peer,
                            PeerState::Verified {
                                context_id: v.context_id,
                                public,
                                remote,
                                since_ms: now,
                            },
                        );
                        self.on_verified(peer).await;
                        self.on_grant(peer, &v.epoch_grant).await;
                        let actions = self.engine.peer_up(&peer.to_string(), now);
                        self.perform(actions).await;
                    }
                    Err(r) => {
                        info!(%peer, reason = %r, "peer rejected");
                        self.reject("connection", peer.to_string(), &r);
                        self.peers.remove(&peer);
                        let _ = self.net.disconnect(peer).await;
                    }
                }
            }
            (Frame::Hello(hello), Some(PeerState::Verified { public, .. })) => {
                // A verified peer re-sends its Hello when its DID log grew:
                // adopt the newer log, or drop the peer if it no longer
                // passes.
                match self.membership.verify_hello(&public, &hello, now) {
                    Ok(v) => {
                        self.count("hello_refreshed");
                        if v.log_extended {
                            self.on_log_extended().await;
                        }
                        self.on_grant(peer, &v.epoch_grant).await;
                    }
                    Err(r) => {
                        info!(%peer, reason = %r, "verified peer rejected on refresh");
                        self.reject("connection", peer.to_string(), &r);
                        self.drop_peer(peer).await;
                    }
                }
            }
            (
                Frame::Envelope(env),
                Some(PeerState::Verified {
                    context_id, public, ..
                }),
            ) => match self.secure.open(&env, &context_id, &public, now) {
                Ok(payload) => self.on_payload(peer, payload, now).await,
                Err(nuwa_sync::OpenError::UnknownEpoch { epoch, newest }) if epoch > newest => {
                    self.hold(peer, env);
                }
                Err(e) => {
                    self.count(&format!("envelope_rejected_{}", e.label()));
                    debug!(%peer, error = %e, "envelope rejected");
                }
            },
            (_, _) => {
                // State from a peer that has not passed the Hello checks is
                // never opened.
                self.count("frame_from_unverified_peer");
                debug!(%peer, "frame from an unverified peer dropped");
            }
        }
    }

    /// Our DID log grew (a peer brought a verified extension): persist it,
    /// pass it on to every verified peer in a fresh Hello, re-check every
    /// verified peer against the new document, and retry announcements
    /// whose keys we did not know.
    async fn on_log_extended(&mut self) {
        info!(
            len = self.membership.log().len(),
            "adopted a newer DID log from a peer"
        );
        if let Err(e) = home::save_log(&self.home_dir, self.membership.log()) {
            warn!(error = %e, "cannot persist the newer DID log");
        }
        let now = home::now_ms();
        if let Err(r) = self.membership.self_authorised(now) {
            warn!(
                reason = %r,
                "this device is no longer an active device of the agent (revoked?); \
                 its peers will refuse it and it receives nothing new"
            );
        }
        let verified: Vec<(PeerId, [u8; 32])> = self
            .peers
            .iter()
            .filter_map(|(p, s)| match s {
                PeerState::Verified { public, .. } => Some((*p, *public)),
                PeerState::Pending { .. } => None,
            })
            .collect();
        for (peer, public) in verified {
            if let Err(r) = self.membership.authorise_public(&public, now) {
                info!(%peer, reason = %r, "peer no longer authorised by the DID document");
                self.reject("connection", peer.to_string(), &r);
                self.drop_peer(peer).await;
                continue;
            }
            if let Ok(hello) = self.membership.hello(now) {
                self.count("hello_refresh_sent");
                let _ = self.net.send(peer, Frame::Hello(hello).encode()).await;
            }
        }
        self.retry_unknown_announcements().await;
    }

    /// Forgets a peer and closes its connections.
    async fn drop_peer(&mut self, peer: PeerId) {
        self.peers.remove(&peer);
        self.engine.peer_down(&peer.to_string());
        let _ = self.net.disconnect(peer).await;
    }

    async fn on_payload(&mut self, peer: PeerId, payload: SyncPayload, now: u64) {
        match self.engine.handle(&peer.to_string(), payload, now) {
            Ok(actions) => self.perform(actions).await,
            Err(e) => {
                self.count("payload_rejected");
                debug!(%peer, error = %e, "payload rejected");
                self.reload_if_poisoned(&e).await;
            }
        }
    }

    /// Automerge panicked on a peer's bytes: the engine dropped the
    /// half-updated container, and it is rebuilt from the store, which holds
    /// everything the container held before (every change is persisted
    /// before the next input is handled). The daemon keeps running.
    pub(crate) async fn reload_if_poisoned(&mut self, e: &nuwa_sync::EngineError) {
        let Some(name) = e.poisoned_container().map(str::to_owned) else {
            return;
        };
        self.count("containers_poisoned");
        warn!(container = %name, error = %e, "peer input left the container untrustworthy; reloading it from the store");
        let store = self.store.clone();
        let actor = self.membership.device().public().to_vec();
        let task_name = name.clone();
        let loaded =
            tokio::task::spawn_blocking(move || load_container(store.as_ref(), &actor, &task_name))
                .await
                .context("store task panicked");
        match loaded {
            Ok(Ok(Some(loaded))) => {
                self.engine.insert_container(name.clone(), loaded.container);
                self.last_seq.insert(name.clone(), loaded.last_seq);
                self.logged.insert(name, loaded.logged);
            }
            // Never persisted: the container was empty before this input.
            Ok(Ok(None)) => {}
            Ok(Err(err)) | Err(err) => {
                self.fatal = Some(err.context(format!("cannot reload container {name:?}")));
            }
        }
    }

    async fn perform(&mut self, actions: Vec<Action>) {
        let now = home::now_ms();
        // Persist first (grouped per container), then send.
        let mut persist: BTreeMap<String, Vec<Vec<u8>>> = BTreeMap::new();
        let mut sends = Vec::new();
        for a in actions {
            match a {
                Action::Persist { container, changes } => {
                    persist.entry(container).or_default().extend(changes)
                }
                Action::Send { peer, payload } => sends.push((peer, payload)),
                Action::Converged { peer, container } => {
                    let ctx = peer
                        .parse::<PeerId>()
                        .ok()
                        .and_then(|p| match self.peers.get(&p) {
                            Some(PeerState::Verified { context_id, .. }) => {
                                Some(context_id.clone())
                            }
                            _ => None,
                        })
                        .unwrap_or_default();
                    info!(container = %container, peer_context = %ctx, "container converged with peer");
                }
            }
        }
        for (container, changes) in persist {
            if let Err(e) = self.persist(&container, changes).await {
                self.fatal = Some(e);
                return;
            }
        }
        for (peer, payload) in sends {
            let Ok(peer_id) = peer.parse::<PeerId>() else {
                continue;
            };
            match self.secure.seal(self.membership.device(), &payload, now) {
                Ok(env) => {
                    let bytes = Frame::Envelope(env).encode();
                    if bytes.len() > nuwa_proto::MAX_FRAME_BYTES {
                        self.count("frame_too_large");
                        warn!(%peer_id, len = bytes.len(), "payload exceeds the frame cap; relying on the sync protocol");
                        continue;
                    }
                    self.count("frames_sent");
                    self.add("bytes_sent", bytes.len() as u64);
                    let _ = self.net.send(peer_id, bytes).await;
                }
                Err(e) => warn!(error = %e, "cannot seal payload"),
            }
        }
    }

    async fn persist(&mut self, container: &str, changes: Vec<Vec<u8>>) -> Result<()> {
        let n = changes.len() as u64;
        if n >= COMPACT_AFTER_CHANGES && self.engine.container(container).is_some() {
            // A batch this large (a cold sync, a long partition healing)
            // would be compacted right after being logged. The document
            // already holds every one of these changes, so one snapshot
            // makes them durable at a fraction of the cost of logging each
            // (a 100,000-change cold sync: one ~0.5 MB write instead of
            // ~90 MB of log). Nothing is acknowledged before it returns.
            drop(changes);
            self.compact(container).await?;
            self.emit_change_event(container, n as usize);
            return Ok(());
        }
        let store = self.store.clone();
        let name = container.to_owned();
        let seq = tokio::task::spawn_blocking(move || store.append_changes(&name, &changes))
            .await
            .context("store task panicked")?
            .with_context(|| format!("cannot persist changes of container {container:?}"))?;
        self.last_seq.insert(container.to_owned(), seq);
        self.emit_change_event(container, n as usize);
        let logged = self.logged.entry(container.to_owned()).or_default();
        *logged += n;
        if *logged >= COMPACT_AFTER_CHANGES {
            self.compact(container).await?;
        }
        Ok(())
    }

    fn emit_change_event(&self, container: &str, n: usize) {
        if self.events.receiver_count() > 0 {
            let heads = self
                .engine
                .container(container)
                .map(|c| c.heads().iter().map(hex::encode).collect())
                .unwrap_or_default();
            let _ = self.events.send(api::ChangeEvent {
                container: container.to_owned(),
                changes: n,
                heads,
                origin: if self.local_origin { "local" } else { "peer" },
                at_unix_ms: home::now_ms(),
            });
        }
    }

    async fn compact(&mut self, container: &str) -> Result<()> {
        let Some(doc) = self.engine.container(container) else {
            return Ok(());
        };
        // Every logged change up to `covers` is already in the document.
        let mut snapshot = doc.save();
        if let Some(c) = self.asm.registry.get(container).and_then(|s| s.compression) {
            let plain = snapshot.len();
            snapshot = crate::snapshot::compress(&snapshot, c)?;
            debug!(
                container,
                plain,
                stored = snapshot.len(),
                "compressed snapshot"
            );
        }
        let covers = self.last_seq.get(container).copied().unwrap_or(0);
        let store = self.store.clone();
        let name = container.to_owned();
        tokio::task::spawn_blocking(move || store.save_snapshot(&name, &snapshot, covers))
            .await
            .context("store task panicked")?
            .with_context(|| format!("cannot compact container {container:?}"))?;
        self.logged.insert(container.to_owned(), 0);
        debug!(container, "compacted");
        Ok(())
    }

    async fn on_api_batch(&mut self, batch: Vec<ApiRequest>) {
        self.local_origin = true;
        self.on_api_batch_inner(batch).await;
        self.local_origin = false;
    }

    async fn on_api_batch_inner(&mut self, batch: Vec<ApiRequest>) {
        // Apply every put of the batch, persist them in one group commit
        // per container, and only then acknowledge and push to peers.
        let mut pending: Vec<(oneshot::Sender<Result<PutReply, ApiError>>, PutBody)> = Vec::new();
        let mut changes: BTreeMap<String, Vec<Vec<u8>>> = BTreeMap::new();
        for req in batch {
            match req {
                ApiRequest::Put(body, reply) => {
                    match self
                        .engine
                        .local_put(&body.container, &body.key, &body.value)
                    {
                        Ok(change) => {
                            // `None`: the key already held this value.
                            if let Some(change) = change {
                                changes
                                    .entry(body.container.clone())
                                    .or_default()
                                    .push(change);
                            }
                            pending.push((reply, body));
                        }
                        Err(e) => {
                            let _ =
                                reply.send(Err(ApiError::new(400, "invalid_write", e.to_string())));
                        }
                    }
                }
                ApiRequest::Get(q, reply) => {
                    let r = match self.engine.container(&q.container) {
                        None => Err(ApiError::new(
                            404,
                            "no_such_container",
                            format!("container {:?} does not exist on this device", q.container),
                        )),
                        Some(c) => match &q.key {
                            None => Ok(c.to_json()),
                            Some(k) => c.get(k).ok_or_else(|| {
                                ApiError::new(
                                    404,
                                    "no_such_key",
                                    format!("key {k:?} is not set in container {:?}", q.container),
                                )
                            }),
                        },
                    };
                    let _ = reply.send(r);
                }
                ApiRequest::Export(name, reply) => {
                    let r = self
                        .engine
                        .container(&name)
                        .map(|c| c.save())
                        .ok_or_else(|| {
                            ApiError::new(
                                404,
                                "no_such_container",
                                format!("container {name:?} does not exist on this device"),
                            )
                        });
                    let _ = reply.send(r);
                }
                ApiRequest::Revoke(body, reply) => {
                    let _ = reply.send(self.on_revoke(body).await);
                }
                ApiRequest::Approve(body, reply) => self.on_approve(body, reply).await,
                ApiRequest::Tool(t, reply) => {
                    let _ = reply.send(self.on_tool(t).await);
                }
                ApiRequest::Status(reply) => {
                    let _ = reply.send(self.status());
                }
                ApiRequest::Devices(reply) => {
                    let now = home::now_ms();
                    let mut seen = self.seen.clone();
                    seen.saw(self.membership.context_id(), &self.name, now);
                    for s in self.peers.values() {
                        if let PeerState::Verified { context_id, .. } = s {
                            seen.saw(context_id, "", now);
                        }
                    }
                    let _ = reply.send(crate::devices::list(
                        self.membership.log(),
                        &seen,
                        self.membership.context_id(),
                        now,
                    ));
                }
            }
        }
        for (container, ch) in changes {
            if let Err(e) = self.persist(&container, ch).await {
                for (reply, _) in pending.drain(..) {
                    let _ = reply.send(Err(ApiError::new(500, "storage_failed", e.to_string())));
                }
                self.fatal = Some(e);
                return;
            }
        }
        for (reply, body) in pending {
            let heads = self
                .engine
                .container(&body.container)
                .map(|c| c.heads().iter().map(hex::encode).collect())
                .unwrap_or_default();
            let _ = reply.send(Ok(PutReply {
                container: body.container,
                key: body.key,
                heads,
                durable: true,
            }));
        }
        let actions = self.engine.flush();
        let actions = self.gossip_deltas(actions).await;
        self.perform(actions).await;
    }

    async fn on_discovery(&mut self, ev: DiscoveryEvent) {
        match ev {
            DiscoveryEvent::Discovered {
                announcement,
                addrs,
            } => {
                let addrs: Vec<Multiaddr> = addrs
                    .iter()
                    .map(|sa| {
                        let ip = match sa.ip() {
                            std::net::IpAddr::V4(v4) => nuwa_net::Protocol::Ip4(v4),
                            std::net::IpAddr::V6(v6) => nuwa_net::Protocol::Ip6(v6),
                        };
                        Multiaddr::empty()
                            .with(ip)
                            .with(nuwa_net::Protocol::Tcp(sa.port()))
                    })
                    .collect();
                self.on_announcement(announcement, addrs).await;
            }
            DiscoveryEvent::Malformed { instance, reason } => {
                self.reject("mdns", instance, &Rejection::Malformed(reason));
            }
            DiscoveryEvent::Expired { instance } => {
                if let Ok(peer) = instance.parse::<PeerId>() {
                    self.wide.mdns_hints.remove(&peer);
                    self.pairing_candidate_gone(&peer);
                }
            }
        }
    }

    async fn on_announcement(&mut self, ann: Announcement, addrs: Vec<Multiaddr>) {
        let now = home::now_ms();
        let who = ann.peer_id.clone();
        if who == self.net.local_peer_id().to_string() {
            return;
        }
        if matches!(&ann.agent, nuwa_discovery::AgentRef::Did(d) if d.starts_with(crate::pairing::PAIR_AGENT_PREFIX))
        {
            self.on_pairing_announcement(&ann, addrs);
            return;
        }
        if !ann.matches_agent(self.membership.did()) {
            let theirs = match &ann.agent {
                nuwa_discovery::AgentRef::Did(d) => d.clone(),
                nuwa_discovery::AgentRef::DidHash(h) => format!("did hash {}", hex::encode(h)),
            };
            self.reject("mdns", who, &Rejection::DifferentAgent(theirs));
            return;
        }
        let key = match self.membership.key_of_context(&ann.context_id, now) {
            Ok(k) => k,
            Err(r) => {
                if matches!(r, Rejection::UnknownKey) {
                    // Maybe a device newer than our DID log: retried when
                    // the log grows.
                    if self.unknown_announcements.len() < 64 {
                        self.unknown_announcements
                            .insert(who.clone(), (ann.clone(), addrs.clone()));
                    }
                }
                self.reject("mdns", who, &r);
                return;
            }
        };
        if let Err(e) = ann.verify(&key, (now / 1000) as i64, ANNOUNCE_MAX_AGE_SECS) {
            self.reject("mdns", who, &Rejection::Malformed(e.to_string()));
            return;
        }
        let Ok(peer) = nuwa_net::peer_id_from_public(&key) else {
            return;
        };
        if peer.to_string() != ann.peer_id {
            self.reject(
                "mdns",
                who,
                &Rejection::ContextMismatch {
                    claimed: ann.peer_id.clone(),
                    actual: peer.to_string(),
                },
            );
            return;
        }
        self.count("mdns_announcements_verified");
        if self.peers.contains_key(&peer) || addrs.is_empty() {
            return;
        }
        debug!(%peer, context_id = %ann.context_id, "dialing peer found by mDNS");
        // Only verified announcements of active devices get here, so the
        // map is bounded by the DID document.
        self.wide.mdns_hints.insert(peer, addrs.clone());
        let _ = self.net.dial(Some(peer), addrs).await;
    }

    async fn retry_unknown_announcements(&mut self) {
        let pending = std::mem::take(&mut self.unknown_announcements);
        for (_, (ann, addrs)) in pending {
            Box::pin(self.on_announcement(ann, addrs)).await;
        }
    }

    fn status(&self) -> Status {
        let now = home::now_ms();
        let peer_id = self.net.local_peer_id().to_string();
        Status {
            agent_did: self.membership.did().to_owned(),
            device: DeviceStatus {
                context_id: self.membership.context_id().to_owned(),
                peer_id: peer_id.clone(),
                name: self.name.clone(),
                authorised: self.membership.self_authorised(now).is_ok(),
                did_log_len: self.membership.log().len(),
            },
            listen_addrs: self
                .listen_addrs
                .iter()
                .map(|a| format!("{a}/p2p/{peer_id}"))
                .collect(),
            api_url: self.api_url.clone(),
            peers: self
                .peers
                .iter()
                .filter_map(|(p, s)| match s {
                    PeerState::Verified {
                        context_id,
                        remote,
                        since_ms,
                        ..
                    } => Some(PeerStatus {
                        peer_id: p.to_string(),
                        context_id: context_id.clone(),
                        address: remote.to_string(),
                        verified_at_unix_ms: *since_ms,
                    }),
                    PeerState::Pending { .. } => None,
                })
                .collect(),
            rejections: self
                .rejection_order
                .iter()
                .filter_map(|k| {
                    self.rejections.get(k).map(|r| RejectionStatus {
                        source: k.0.clone(),
                        peer: k.1.clone(),
                        label: r.label.to_owned(),
                        reason: r.reason.clone(),
                        count: r.count,
                        last_unix_ms: r.last_ms,
                    })
                })
                .collect(),
            counters: {
                let mut c = self.counters.clone();
                let stats = self.net.stats();
                for (k, v) in [
                    ("oversized_frames_refused", stats.oversized_frames_refused),
                    ("gossip_publish_dropped", stats.gossip_publish_dropped),
                ] {
                    if v > 0 {
                        c.insert(k.into(), v);
                    }
                }
                c
            },
            containers: self
                .engine
                .containers()
                .map(|(name, c)| ContainerStatus {
                    name: name.clone(),
                    heads: c.heads().iter().map(hex::encode).collect(),
                    changes: c.change_count(),
                })
                .collect(),
        }
    }
}
