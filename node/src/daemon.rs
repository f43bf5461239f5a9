//! `nuwa-node run`: the daemon, a thin runtime around the IO-free
//! [`nuwa_sync::Session`]. One loop owns the session and the store handle;
//! the network actor, mDNS and the local API feed it through bounded
//! channels. Every decision about peers (admission, envelopes, key epochs,
//! DID-log re-checks) is the session's; the loop turns IO into session
//! inputs and hands the session's effects to one executor
//! ([`exec`](self::exec)), the only place that persists, acknowledges,
//! seals and sends, in that order.
//!
//! Order of trust on a new connection: Noise proves the peer holds the key
//! behind its PeerId → both sides send a Hello → the session checks it
//! against the agent's DID document → only then does the engine learn about
//! the peer, and only verified peers' envelopes are opened. Anything else is
//! counted, recorded for `status`, and the peer is disconnected.

use crate::metrics::Event;
use std::collections::{BTreeMap, VecDeque};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use nuwa_discovery::{Announcement, DiscoveryEvent, Mdns, MdnsConfig};
use nuwa_net::{Multiaddr, NetConfig, NetEvent, NetHandle, PeerId};
use nuwa_proto::Frame;
use nuwa_state::Container;
use nuwa_store::{SledStore, Storage};
use nuwa_sync::{Effect, Engine, Membership, PeerState, Rejection, SecureChannel, Session};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tracing::{debug, error, info, warn};

use crate::api::{self, ApiError, ApiFile, ApiRequest, ErrorCode};
use crate::home::{self, Home};
use nuwa_agent::status::{ContainerStatus, DeviceStatus, PeerStatus, RejectionStatus, Status};

mod approve;
mod asm;
mod batch;
mod catch_up;
mod exec;
mod heads_record;
mod keeper;
mod lifecycle;
mod meta;
pub(crate) mod reader;
mod seen;
mod wide;

/// How long a rendezvous registration lasts (devices and pairing codes);
/// refreshed at half of it.
pub(crate) const RENDEZVOUS_TTL_SECS: u64 = 2 * 3600;

use exec::Ack;

pub use asm::LIFECYCLE_EVERY_MS;

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
    /// Keepers: store-and-forward nodes for devices never online together.
    pub keepers: Vec<Multiaddr>,
    pub api_listen: SocketAddr,
    /// Resident memory (MB) above which containers are evicted at once.
    pub memory_budget_mb: u64,
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
/// Up to this many containers stay in memory at start; with more, all but
/// the schema registry start evicted.
const LOADED_AT_START: usize = 256;
/// How often memory is checked and idle containers evicted.
const EVICT_EVERY_MS: u64 = 5_000;
/// A container unused this long leaves memory.
const IDLE_EVICT_MS: u64 = 60_000;
/// Changes logged since the last snapshot before a container is compacted.
const COMPACT_AFTER_CHANGES: u64 = 2048;

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
    /// Admission, envelopes, key epochs and the sync engine (IO-free).
    session: Session,
    store: Arc<dyn Storage>,
    net: NetHandle,
    rejections: BTreeMap<(String, String), RejectionRecord>,
    rejection_order: VecDeque<(String, String)>,
    /// Writes metadata caches off the loop.
    meta: meta::MetaWriter,
    /// Reads and queries, on their own thread.
    reader: reader::ReaderHandle,
    /// Typed counters, gauges and histograms (`GET /metrics`, `status`).
    metrics: Arc<crate::metrics::Metrics>,
    /// Changes logged per container since its last snapshot.
    logged: BTreeMap<String, u64>,
    /// Containers moved aside at start (see `open_session`).
    quarantined: Vec<nuwa_agent::status::QuarantineStatus>,
    /// Highest change-log sequence number per container.
    last_seq: BTreeMap<String, u64>,
    /// Local changes made during this loop turn, persisted by the next
    /// [`Daemon::execute`] (with origin `local`) before anything is
    /// acknowledged or sent.
    staged: Vec<(String, Vec<u8>)>,
    /// `memory.budget_mb`, in bytes.
    memory_budget: u64,
    next_evict_ms: u64,
    /// While a run of incoming frames and gossip is handled, the effects of
    /// each, executed together at the end (one group commit for the run).
    deferred: Option<Vec<Effect>>,
    /// The public half of `HOME/master.key`, if this home holds it (read
    /// once at start: `status` asks whether this device is an admin on
    /// every call, and the secret is read only to sign).
    master_public: Option<[u8; 32]>,
    /// Announcements of our agent whose key we do not know yet; retried
    /// when the DID log grows.
    unknown_announcements: BTreeMap<String, (Announcement, Vec<Multiaddr>)>,
    listen_addrs: Vec<Multiaddr>,
    api_url: String,
    fatal: Option<anyhow::Error>,
    wide: wide::Wide,
    /// Name and last time each device was seen verified, by context id
    /// (persisted encrypted, for `device list`).
    seen: nuwa_agent::devices::Seen,
    /// `device approve`: candidates waiting to pair and the approval underway.
    pairing: approve::Pairing,
    mdns_on: bool,
    /// Typed state: the schema registry and the lifecycle timer.
    asm: asm::Asm,
    /// Change events for `/v1/state.events`.
    events: tokio::sync::broadcast::Sender<api::ChangeEvent>,
    /// Clock offsets already warned about, per peer (so redials do not
    /// repeat the warning every few seconds).
    skew_warned: BTreeMap<String, i64>,
    /// Keepers: what was pushed to and pulled from each.
    keepers: keeper::Keepers,
    /// Big sync messages being applied on worker threads.
    catch_ups: catch_up::CatchUps,
    /// When the daemon started (status: uptime).
    started: std::time::Instant,
    /// Last ping round trip per peer, in milliseconds.
    rtt_ms: BTreeMap<PeerId, u64>,
    /// Interfaces mDNS watches (empty when it is off or sees nothing).
    mdns_watching: Vec<String>,
    /// When each running catch-up started, by container.
    catch_up_started: BTreeMap<String, u64>,
    /// This device was listed in the DID log and no longer is: it refuses
    /// local writes and redials with backoff (see [`Daemon::check_revoked`]).
    revoked: bool,
}

pub async fn run(home: Home, opts: RunOptions) -> Result<()> {
    let shutdown = shutdown_signal();
    let cancel = CancellationToken::new();
    let lock = home::lock(&home.dir)?;
    let did = home.log.did().to_owned();
    let context_id = home.info.context_id.clone();
    let store: Arc<dyn Storage> = Arc::new(
        SledStore::open(&home.dir.join(home::STORE_DIR), home.at_rest.clone())
            .with_context(|| format!("cannot open the store in {}", home.dir.display()))?,
    );
    let opened = open_session(&home, store.as_ref())?;
    if let Err(r) = opened.session.self_authorised(home::now_ms()) {
        warn!(
            reason = %r,
            "this device is not an active member of the agent's DID document; \
             peers will refuse it until it is added"
        );
    }

    let net_config = NetConfig {
        listen: opts.listen.clone(),
        features: nuwa_net::Features {
            kad: opts.dht,
            rendezvous_client: opts.rendezvous,
            gossip: true,
            nat_traversal: true,
            infrastructure: None,
        },
        advertise_listen: Some(nuwa_net::reach::listen_scopes(
            wide::infra_scope(&opts),
            &opts.listen,
        )),
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

    let metrics = Arc::new(crate::metrics::Metrics::new());
    metrics.watch_net(net.clone());
    let (reads, read_lane, mut reader_events) = reader::spawn(
        store.clone(),
        home.device.public().to_vec(),
        nuwa_asm::registry::Registry::with_core(),
        nuwa_sync::Config::default().max_containers,
    )
    .context("cannot start the reader thread")?;
    let (api_tx, mut api_rx) = mpsc::channel::<ApiRequest>(1024);
    let token = {
        let mut t = [0u8; 32];
        getrandom::fill(&mut t).map_err(|e| anyhow::anyhow!("no randomness: {e}"))?;
        hex::encode(t)
    };
    let (events_tx, _) = tokio::sync::broadcast::channel::<api::ChangeEvent>(1024);
    let lanes = api::Lanes {
        writes: api_tx,
        reads: read_lane,
    };
    let (api_addr, api_web) = api::serve(
        opts.api_listen,
        token.clone(),
        lanes.clone(),
        events_tx.clone(),
        metrics.clone(),
        api::Limits::default(),
        cancel.clone(),
    )
    .await
    .context("cannot start the local API")?;
    // The same API for apps on this device, by a path in the home (NIP-6
    // IPC discovery). A daemon without it still serves TCP.
    #[cfg(unix)]
    let api_socket = match api::serve_socket(
        &home.dir.join(home::API_SOCKET),
        token.clone(),
        lanes,
        events_tx.clone(),
        metrics.clone(),
        api_web,
        cancel.clone(),
    )
    .await
    {
        Ok(file) => {
            info!(path = %file.path().display(), "local API socket ready");
            Some(file)
        }
        Err(e) => {
            warn!(error = %e, "local API socket unavailable; apps must use TCP and the token");
            None
        }
    };
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
        let ann = sign_announcement(opened.session.membership(), &local_peer, port);
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

    let mut d = Daemon::new(
        &home,
        opened,
        store,
        net.clone(),
        listen_addrs,
        api_url,
        &opts,
        mdns.is_some(),
        events_tx,
        metrics.clone(),
        reads,
    );
    d.seen = match d.store.get_meta(nuwa_agent::devices::SEEN_META) {
        Ok(Some(bytes)) => nuwa_agent::devices::Seen::from_bytes(&bytes),
        _ => nuwa_agent::devices::Seen::default(),
    };
    d.check_revoked();
    d.metrics
        .add(Event::ContainersQuarantined, d.quarantined.len() as u64);
    d.asm_start().await;
    // The core models' genesis changes, durable before anything else runs.
    d.execute(Vec::new(), Vec::new()).await;
    d.start_wide().await;

    let mut tick = tokio::time::interval(TICK);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut announce = tokio::time::interval(ANNOUNCE_REFRESH);
    announce.tick().await;
    tokio::pin!(shutdown);
    let once_deadline = opts.once.map(|t| home::now_ms() + t.as_millis() as u64);
    let mut once_last_line = String::new();
    let mut once_result: Option<Result<(), String>> = None;
    let mut caught_up = d
        .catch_ups
        .take_receiver()
        .context("the catch-up channel was taken twice")?;
    // Each arm holds the loop while it runs: timed, so that a turn that
    // holds it too long shows in `loop_turn_seconds`.
    let turns = d.metrics.clone();
    info!(did = %did, context_id = %context_id, peer_id = %local_peer, "daemon running");
    loop {
        tokio::select! {
            _ = &mut shutdown => {
                info!("shutting down");
                break;
            }
            ev = net_events.recv() => match ev {
                Some(ev) if carries_data(&ev) => {
                    let _turn = crate::metrics::TurnTimer::start(&turns, "network frames");
                    // A run of frames and gossip already waiting is handled
                    // as one turn: one group commit instead of one each
                    // (2,000 containers' deltas arrive as 2,000 messages).
                    d.deferred = Some(Vec::new());
                    d.session.defer_gossip(true);
                    d.on_net(ev).await;
                    let mut spill = None;
                    for _ in 1..MAX_NET_RUN {
                        match net_events.try_recv() {
                            Ok(ev) if carries_data(&ev) => d.on_net(ev).await,
                            Ok(ev) => {
                                spill = Some(ev);
                                break;
                            }
                            Err(_) => break,
                        }
                    }
                    d.session.defer_gossip(false);
                    let mut effects = d.deferred.take().unwrap_or_default();
                    effects.extend(d.session.apply_queued());
                    d.execute(effects, Vec::new()).await;
                    if let Some(ev) = spill {
                        d.on_net(ev).await;
                    }
                }
                Some(ev) => {
                    let _turn = crate::metrics::TurnTimer::start(&turns, "network");
                    d.on_net(ev).await
                }
                None => { error!("network task stopped"); break; }
            },
            Some(finished) = caught_up.recv() => {
                let _turn = crate::metrics::TurnTimer::start(&turns, "catch-up result");
                d.on_caught_up(finished).await;
            }
            req = api_rx.recv() => {
                let Some(first) = req else { break };
                let _turn = crate::metrics::TurnTimer::start(&turns, "api");
                let mut batch = vec![first];
                while batch.len() < MAX_API_BATCH {
                    match api_rx.try_recv() {
                        Ok(r) => batch.push(r),
                        Err(_) => break,
                    }
                }
                d.on_api_batch(batch).await;
            }
            ev = reader_events.recv() => match ev {
                Some(ev) => {
                    let _turn = crate::metrics::TurnTimer::start(&turns, "reader");
                    d.on_reader(ev).await
                }
                // The reader thread died: reads cannot be served.
                None => { error!("the reader stopped"); break; }
            },
            ev = recv_opt(&mut mdns_events) => match ev {
                Some(ev) => {
                    let _turn = crate::metrics::TurnTimer::start(&turns, "discovery");
                    d.on_discovery(ev).await
                }
                None => { mdns_events = None; }
            },
            _ = tick.tick() => {
                let _turn = crate::metrics::TurnTimer::start(&turns, "tick");
                let now = home::now_ms();
                d.pairing_tick(now).await;
                d.asm_lifecycle(now).await;
                let effects = d.session.tick(now);
                d.execute(effects, Vec::new()).await;
                d.metrics.peers_verified.set(d.session.verified().count() as i64);
                d.metrics.containers.set(d.session.engine().container_count() as i64);
                d.memory_tick(now);
                d.metrics.envelopes_held.set(d.session.held_len() as i64);
                d.wide_tick(now).await;
                d.keeper_tick(now).await;
                d.remember_seen(now, false);
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
                    if let Err(e) = m.update_announcement(sign_announcement(d.session.membership(), &local_peer, port)) {
                        warn!(error = %e, "cannot refresh the mDNS announcement");
                    }
                }
            }
        }
        // Whatever this turn set aside runs on worker threads.
        d.start_catch_ups();
        if let Some(e) = d.fatal.take() {
            error!(error = %e, "fatal storage error; stopping so that nothing unacknowledged is reported durable");
            cancel.cancel();
            let _ = std::fs::remove_file(home.dir.join(home::API_FILE));
            return Err(e);
        }
    }
    d.remember_seen(home::now_ms(), true);
    cancel.cancel();
    if let Some(m) = mdns {
        if let Err(e) = m.shutdown() {
            debug!(error = %e, "mDNS shutdown");
        }
    }
    d.meta.flush().await;
    d.store.flush().context("final store flush")?;
    let _ = std::fs::remove_file(home.dir.join(home::API_FILE));
    // Before the lock: a daemon that takes it next binds its own socket.
    #[cfg(unix)]
    drop(api_socket);
    drop(lock);
    info!("stopped cleanly");
    match once_result {
        Some(Err(reason)) => Err(anyhow::anyhow!(reason)),
        _ => Ok(()),
    }
}

/// A session over what the home's store holds, with the bookkeeping the
/// executor needs per container.
struct Opened {
    session: Session,
    quarantined: Vec<nuwa_agent::status::QuarantineStatus>,
    logged: BTreeMap<String, u64>,
    last_seq: BTreeMap<String, u64>,
}

fn open_session(home: &Home, store: &dyn Storage) -> Result<Opened> {
    let mut membership = Membership::new(
        home.log.clone(),
        home.info.context_id.clone(),
        home.info.name.clone(),
        nuwa_identity::keys::DeviceKey::from_seed(&home.device.seed()),
    );
    if let Some(grant) = &home.grant {
        membership.set_epoch_grant(grant.clone());
    }
    let actor = home.device.public().to_vec();
    let mut engine = Engine::new(actor.clone(), nuwa_sync::Config::default());
    let mut logged = BTreeMap::new();
    let mut last_seq = BTreeMap::new();
    // One unreadable container must not stop the device: its records are
    // moved aside (kept) and peers resync it, since to them it is simply
    // missing here.
    let (names, unnamed) = store.list_containers_quarantining()?;
    let mut quarantined: Vec<nuwa_agent::status::QuarantineStatus> = unnamed
        .into_iter()
        .map(|q| nuwa_agent::status::QuarantineStatus {
            container: None,
            reason: format!("name record {}: {}", q.id, q.reason),
            records: q.records,
        })
        .collect();
    let cold_at_start = names.len() > LOADED_AT_START;
    debug!(
        containers = names.len(),
        rss_mb = rss_bytes().unwrap_or(0) / 1_000_000,
        "loading containers"
    );
    let mut cold: Vec<(String, usize, usize, u64, u64)> = Vec::new();
    let mut cold_heads: Vec<nuwa_state::Hash> = Vec::new();
    if cold_at_start {
        cold.reserve_exact(names.len());
    }
    for name in names {
        if cold_at_start && name != asm::REGISTRY_CONTAINER {
            // The heads record spares reading the container at all.
            let record = store
                .get_meta(&heads_record::key(&name))
                .ok()
                .flatten()
                .and_then(|b| heads_record::HeadsRecord::decode(&b));
            if let Some(r) = record {
                cold_heads.extend_from_slice(&r.heads);
                cold.push((
                    name,
                    r.heads.len(),
                    r.changes as usize,
                    r.last_seq,
                    r.logged,
                ));
                continue;
            }
        }
        let loaded = match load_container(store, &actor, &name) {
            Ok(Some(loaded)) => loaded,
            Ok(None) => continue,
            Err(e) => {
                let reason = format!("{e:#}");
                let records = store
                    .quarantine_container(&name)
                    .with_context(|| format!("cannot move unreadable container {name:?} aside"))?;
                warn!(container = %name, %reason, records, "container unreadable: quarantined; peers will resync it");
                quarantined.push(nuwa_agent::status::QuarantineStatus {
                    container: Some(name),
                    reason,
                    records,
                });
                continue;
            }
        };
        if cold_at_start && name != asm::REGISTRY_CONTAINER {
            // More containers than memory should hold: keep what digests
            // and status need; the document loads again on first use.
            // Heads go to one flat buffer and the maps are built after the
            // loop, so that no small allocation that lives on lands
            // between the documents freed here (the heap pages holding it
            // could not go back to the system).
            let c = loaded.container;
            let heads = c.heads();
            cold_heads.extend_from_slice(&heads);
            cold.push((
                name,
                heads.len(),
                c.change_count(),
                loaded.last_seq,
                loaded.logged,
            ));
        } else {
            engine.insert_container(name.clone(), loaded.container);
            last_seq.insert(name.clone(), loaded.last_seq);
            logged.insert(name, loaded.logged);
        }
    }
    // Loading every container allocated and freed a lot: give it back
    // before the long-lived maps are built.
    release_free_memory();
    let mut at = 0;
    for (name, n_heads, changes, seq, n_logged) in cold {
        let heads = cold_heads[at..at + n_heads].to_vec();
        at += n_heads;
        last_seq.insert(name.clone(), seq);
        logged.insert(name.clone(), n_logged);
        engine.insert_cold(name, heads, changes);
    }
    info!(
        containers = engine.container_count(),
        in_memory = engine.loaded_count(),
        rss_mb = rss_bytes().unwrap_or(0) / 1_000_000,
        "store opened"
    );
    let secure = SecureChannel::new(
        home.log.did().to_owned(),
        home.info.context_id.clone(),
        home.keys.clone(),
    );
    Ok(Opened {
        quarantined,
        session: Session::new(
            membership,
            secure,
            engine,
            nuwa_sync::SessionConfig::default(),
        ),
        logged,
        last_seq,
    })
}

impl Daemon {
    #[allow(clippy::too_many_arguments)]
    fn new(
        home: &Home,
        opened: Opened,
        store: Arc<dyn Storage>,
        net: NetHandle,
        listen_addrs: Vec<Multiaddr>,
        api_url: String,
        opts: &RunOptions,
        mdns_on: bool,
        events: tokio::sync::broadcast::Sender<api::ChangeEvent>,
        metrics: Arc<crate::metrics::Metrics>,
        reader: reader::ReaderHandle,
    ) -> Self {
        let meta = meta::MetaWriter::spawn(store.clone());
        let mut opened = opened;
        let loader_store = store.clone();
        let actor = home.device.public().to_vec();
        let loads = metrics.clone();
        opened.session.set_loader(Box::new(move |name: &str| {
            loads.inc(Event::ContainersLoaded);
            load_container(loader_store.as_ref(), &actor, name)
                .map(|l| l.map(|l| l.container))
                .map_err(|e| format!("{e:#}"))
        }));
        let master_public = std::fs::read(home.dir.join(home::MASTER_KEY))
            .ok()
            .and_then(|b| nuwa_identity::keys::DeviceKey::from_seed_file_bytes(&b).ok())
            .map(|k| k.public());
        Daemon {
            home_dir: home.dir.clone(),
            name: home.info.name.clone(),
            session: opened.session,
            store,
            net,
            rejections: BTreeMap::new(),
            rejection_order: VecDeque::new(),
            meta,
            reader,
            metrics,
            logged: opened.logged,
            quarantined: opened.quarantined,
            last_seq: opened.last_seq,
            staged: Vec::new(),
            memory_budget: opts.memory_budget_mb.saturating_mul(1_000_000),
            next_evict_ms: 0,
            deferred: None,
            master_public,
            unknown_announcements: BTreeMap::new(),
            listen_addrs,
            api_url,
            fatal: None,
            wide: wide::Wide::new(home.log.did(), opts),
            seen: nuwa_agent::devices::Seen::default(),
            pairing: approve::Pairing::default(),
            mdns_on,
            asm: asm::Asm::new(opts.lifecycle_every),
            events,
            skew_warned: BTreeMap::new(),
            keepers: keeper::Keepers::new(
                opts.keepers
                    .iter()
                    .filter_map(|a| nuwa_net::peer_of(a).map(|p| (p, a.clone())))
                    .collect(),
            ),
            catch_ups: catch_up::CatchUps::new(),
            started: std::time::Instant::now(),
            rtt_ms: BTreeMap::new(),
            mdns_watching: if mdns_on {
                nuwa_discovery::watched_interfaces(&opts.mdns_interfaces)
            } else {
                Vec::new()
            },
            catch_up_started: BTreeMap::new(),
            revoked: false,
        }
    }

    /// Whether this device was revoked: its key was listed by an earlier
    /// version of the DID document and the current one lacks it (an
    /// expired key is not revoked: renewing it brings it back).
    fn is_revoked_now(&self) -> bool {
        let m = self.session.membership();
        let ctx = m.context_id();
        let listed_before = m.log().documents().any(|d| {
            d.verification_method
                .iter()
                .any(|vm| nuwa_identity::document::DidDocument::fragment(&vm.id) == ctx)
        });
        let listed_now = m
            .log()
            .current()
            .verification_method
            .iter()
            .any(|vm| nuwa_identity::document::DidDocument::fragment(&vm.id) == ctx);
        listed_before && !listed_now
    }

    /// Re-checks [`Daemon::revoked`] (at start and when the log grows),
    /// and says once what it means.
    fn check_revoked(&mut self) {
        let now = self.is_revoked_now();
        if now && !self.revoked {
            warn!(
                context_id = %self.session.membership().context_id(),
                "this device was revoked from the agent: its peers refuse it, it receives \
                 nothing new and it refuses local writes (they would never sync). To use this \
                 machine again: export what you need (`nuwa-node state export`), stop the \
                 daemon, move this home aside and pair anew (`nuwa-node pair`)"
            );
        }
        self.revoked = now;
    }

    /// The error for a write on a revoked device.
    fn revoked_error(&self) -> ApiError {
        ApiError::new(
            ErrorCode::DeviceRevoked,
            format!(
                "this device ({}) was revoked from the agent, so nothing written here would \
                 reach another device; the write was refused. To use this machine again: \
                 export what you need (`nuwa-node state export`), stop the daemon, move this \
                 home aside and pair anew (`nuwa-node pair`, approved on the device holding \
                 the master key)",
                self.session.membership().context_id()
            ),
        )
    }
}

/// Most network events handled as one turn (see `deferred`).
const MAX_NET_RUN: usize = 256;

/// Frames and gossip: the events whose effects may wait for the end of a
/// run of them.
fn carries_data(ev: &NetEvent) -> bool {
    matches!(ev, NetEvent::Frame { .. } | NetEvent::GossipMessage { .. })
}

/// Returns freed heap pages to the system (glibc keeps them otherwise, so
/// RSS would not fall after eviction).
fn release_free_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only walks the allocator's own free lists.
    unsafe {
        libc::malloc_trim(0);
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

/// Resolves on the first SIGINT or SIGTERM. The handlers are installed when
/// this is called, not when the future is first polled: a Ctrl-C that lands
/// after `api.json` is written but before the main loop starts must still
/// reach the shutdown path (the default action would kill the process and
/// leave a stale `api.json`).
fn shutdown_signal() -> impl std::future::Future<Output = ()> {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        let interrupt = signal(SignalKind::interrupt());
        let terminate = signal(SignalKind::terminate());
        async move {
            match (interrupt, terminate) {
                (Ok(mut interrupt), Ok(mut terminate)) => {
                    tokio::select! {
                        _ = interrupt.recv() => {}
                        _ = terminate.recv() => {}
                    }
                }
                _ => {
                    let _ = tokio::signal::ctrl_c().await;
                }
            }
        }
    }
    #[cfg(not(unix))]
    async move {
        let _ = tokio::signal::ctrl_c().await;
    }
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

/// This process's resident memory in bytes (Linux; `None` elsewhere).
fn rss_bytes() -> Option<u64> {
    let statm = std::fs::read_to_string("/proc/self/statm").ok()?;
    let pages: u64 = statm.split_whitespace().nth(1)?.parse().ok()?;
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    Some(pages * u64::try_from(page).ok()?)
}

impl Daemon {
    /// Evicts containers unused for a minute, and, while resident memory is
    /// over the budget, the least recently used ones; then hands freed
    /// memory back to the system. Runs every few seconds.
    fn memory_tick(&mut self, now: u64) {
        if now < self.next_evict_ms {
            return;
        }
        self.next_evict_ms = now + EVICT_EVERY_MS;
        let keep = [asm::REGISTRY_CONTAINER];
        let mut evicted = self.session.evict_idle(IDLE_EVICT_MS, usize::MAX, &keep);
        let over = rss_bytes().is_some_and(|rss| rss > self.memory_budget);
        if over {
            let loaded = self.session.engine().loaded_count();
            evicted += self.session.evict_idle(IDLE_EVICT_MS, loaded / 2, &keep);
        }
        if evicted > 0 {
            self.add(Event::ContainersEvicted, evicted as u64);
            self.reader.trim();
            release_free_memory();
            debug!(
                evicted,
                in_memory = self.session.engine().loaded_count(),
                over_budget = over,
                "containers left memory"
            );
        }
    }

    /// Saves devices' names and last-seen times (off the loop).
    fn save_seen(&self) {
        self.meta.put(
            nuwa_agent::devices::SEEN_META,
            self.seen.to_bytes(home::now_ms()),
        );
    }

    fn count(&self, e: Event) {
        self.metrics.inc(e);
    }

    fn add(&self, e: Event, n: u64) {
        self.metrics.add(e, n);
    }

    fn reject(&mut self, source: &str, who: String, rejection: &Rejection) {
        self.metrics.rejected(source, rejection.label());
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

    /// Whether `peer` has an open connection the session knows of.
    fn is_connected(&self, peer: &PeerId) -> bool {
        self.session.peers().contains_key(&peer.to_string())
    }

    fn is_verified(&self, peer: &PeerId) -> bool {
        self.session.context_of(&peer.to_string()).is_some()
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
                debug!(%peer, %remote, "connected; sending hello");
                let effects = self.session.connected(
                    &peer.to_string(),
                    public,
                    remote.to_string(),
                    home::now_ms(),
                );
                self.execute(effects, Vec::new()).await;
                if public.is_some() {
                    self.pairing_on_connected(peer).await;
                }
            }
            NetEvent::Rtt { peer, rtt } => {
                self.rtt_ms.insert(peer, rtt.as_millis() as u64);
            }
            NetEvent::Disconnected { peer } => {
                self.rtt_ms.remove(&peer);
                self.wide.on_disconnected(&peer);
                self.keepers.on_disconnected(&peer);
                let effects = self.session.disconnected(&peer.to_string());
                self.execute(effects, Vec::new()).await;
            }
            NetEvent::Frame { peer, frame } => self.on_frame(peer, frame).await,
            NetEvent::SendFailed { peer, reason } => {
                self.count(Event::SendFailed);
                debug!(%peer, %reason, "frame not delivered");
            }
            NetEvent::InboundError { peer, reason } => {
                self.count(Event::InboundFrameError);
                debug!(%peer, %reason, "unreadable frame from peer");
            }
            NetEvent::DialFailed { peer, reason } => {
                self.count(Event::DialFailed);
                debug!(?peer, %reason, "dial failed");
            }
            other => self.on_wide_event(other).await,
        }
    }

    async fn on_frame(&mut self, peer: PeerId, bytes: Vec<u8>) {
        let frame = match Frame::decode(&bytes) {
            Ok(f) => f,
            Err(e) => {
                self.count(Event::MalformedFrame);
                debug!(%peer, error = %e, "malformed frame");
                return;
            }
        };
        let now = home::now_ms();
        let key = peer.to_string();
        let effects = match frame {
            Frame::Pairing { step, body } => {
                // Pairing talks to a device that has no listed key yet:
                // keep its Hello deadline from cutting the exchange.
                self.session.touch_pending(&key, now);
                self.on_pairing_frame(peer, step, body).await;
                return;
            }
            Frame::Hello(hello) => self.session.on_hello(&key, &hello, now),
            Frame::Envelope(env) => self.session.on_envelope(&key, env, now),
            Frame::DidEntriesRequest { from_seq } => self.session.on_did_request(&key, from_seq),
            Frame::DidEntries {
                from_seq,
                entries_json,
                more,
            } => self
                .session
                .on_did_entries(&key, from_seq, &entries_json, more, now),
            Frame::KeeperResponse(resp) => {
                self.on_keeper_response(peer, *resp).await;
                return;
            }
            Frame::KeeperRequest(_) => {
                // Devices are not keepers.
                self.count(Event::KeeperResponsesUnexpected);
                return;
            }
        };
        self.execute(effects, Vec::new()).await;
    }

    async fn on_api_batch(&mut self, batch: Vec<ApiRequest>) {
        let started = std::time::Instant::now();
        // Apply every write of the batch; the executor then persists them
        // in one group commit per container, and only then acknowledges
        // and pushes to peers.
        let mut acks: Vec<Ack> = Vec::new();
        let mut effects: Vec<Effect> = Vec::new();
        for req in batch {
            let req = match req {
                // A revoked device takes no writes: they would never sync.
                ApiRequest::Put(_, reply) if self.revoked => {
                    let _ = reply.send(Err(self.revoked_error()));
                    continue;
                }
                ApiRequest::Batch(_, reply) if self.revoked => {
                    let _ = reply.send(Err(self.revoked_error()));
                    continue;
                }
                ApiRequest::Tool(t, reply) if self.revoked && t.writes() => {
                    let _ = reply.send(Err(self.revoked_error()));
                    continue;
                }
                req => req,
            };
            match req {
                ApiRequest::Put(body, reply) => {
                    match self
                        .session
                        .local_put(&body.container, &body.key, &body.value)
                    {
                        Ok(change) => {
                            // `None`: the key already held this value.
                            if let Some(change) = change {
                                self.staged.push((body.container.clone(), change));
                            }
                            acks.push(Ack::Put {
                                reply,
                                container: body.container,
                                key: body.key,
                            });
                        }
                        Err(e) => {
                            let _ = reply
                                .send(Err(ApiError::new(ErrorCode::InvalidWrite, e.to_string())));
                        }
                    }
                }
                // Reads have their own lane to the reader; the server never
                // sends them here.
                ApiRequest::Get(_, reply) => drop(reply.send(Err(misrouted()))),
                ApiRequest::Export(_, reply) => drop(reply.send(Err(misrouted()))),
                ApiRequest::Revoke(body, reply) => match self.on_revoke(body) {
                    Ok((r, e)) => {
                        effects.extend(e);
                        acks.push(Ack::Revoke(reply, r));
                    }
                    Err(e) => {
                        let _ = reply.send(Err(e));
                    }
                },
                ApiRequest::Admin(change, reply) => match self.on_admin_change(change) {
                    Ok((r, e)) => {
                        effects.extend(e);
                        acks.push(Ack::Value(reply, r));
                    }
                    Err(e) => {
                        let _ = reply.send(Err(e));
                    }
                },
                ApiRequest::Approve(body, reply) => self.on_approve(body, reply).await,
                ApiRequest::Provision(body, reply) => match self.on_provision(body) {
                    Ok((r, e)) => {
                        effects.extend(e);
                        acks.push(Ack::Value(reply, r));
                    }
                    Err(e) => {
                        let _ = reply.send(Err(e));
                    }
                },
                ApiRequest::Batch(body, reply) => {
                    let r = self.on_batch(body).await;
                    acks.push(Ack::Batch(reply, r));
                }
                ApiRequest::Tool(t, reply) => match self.on_tool(t).await {
                    // Answered once what the tool wrote is durable.
                    Ok(v) => acks.push(Ack::Value(reply, v)),
                    Err(e) => {
                        let _ = reply.send(Err(e));
                    }
                },
                ApiRequest::Status(reply) => {
                    let _ = reply.send(self.status());
                }
                ApiRequest::Devices(reply) => {
                    let now = home::now_ms();
                    let mut seen = self.seen.clone();
                    let m = self.session.membership();
                    seen.saw(m.context_id(), &self.name, now);
                    for (_, ctx) in self.session.verified() {
                        seen.saw(ctx, "", now);
                    }
                    let _ = reply.send(nuwa_agent::devices::list(
                        m.log(),
                        &seen,
                        m.context_id(),
                        now,
                    ));
                }
            }
        }
        let writes = acks.len();
        self.execute(effects, acks).await;
        let took = started.elapsed();
        for _ in 0..writes {
            self.metrics.observe_write_ack(took);
        }
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
        if matches!(&ann.agent, nuwa_discovery::AgentRef::Did(d) if d.starts_with(nuwa_agent::pairing::PAIR_AGENT_PREFIX))
        {
            self.on_pairing_announcement(&ann, addrs);
            return;
        }
        if !ann.matches_agent(self.session.membership().did()) {
            let theirs = match &ann.agent {
                nuwa_discovery::AgentRef::Did(d) => d.clone(),
                nuwa_discovery::AgentRef::DidHash(h) => format!("did hash {}", hex::encode(h)),
            };
            self.reject("mdns", who, &Rejection::DifferentAgent(theirs));
            return;
        }
        let key = match self
            .session
            .membership()
            .key_of_context(&ann.context_id, now)
        {
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
        self.count(Event::MdnsAnnouncementsVerified);
        if self.is_connected(&peer) || addrs.is_empty() {
            return;
        }
        debug!(%peer, context_id = %ann.context_id, "dialing peer found by mDNS");
        // Only verified announcements of active devices get here, so the
        // map is bounded by the DID document.
        self.wide.mdns_hints.insert(peer, addrs.clone());
        if self.revoked {
            // Refused anyway: the backed-off redial (wide_tick) uses the
            // hint when its time comes.
            return;
        }
        let _ = self.net.dial(Some(peer), addrs).await;
    }

    async fn retry_unknown_announcements(&mut self) {
        let pending = std::mem::take(&mut self.unknown_announcements);
        for (_, (ann, addrs)) in pending {
            Box::pin(self.on_announcement(ann, addrs)).await;
        }
    }

    fn status(&mut self) -> Status {
        let now = home::now_ms();
        let peer_id = self.net.local_peer_id().to_string();
        let verified: Vec<String> = self.session.verified().map(|(p, _)| p.clone()).collect();
        let mut sync: BTreeMap<String, Vec<nuwa_agent::status::PeerSyncStatus>> = BTreeMap::new();
        for p in &verified {
            let report = self.session.sync_report(p);
            sync.insert(
                p.clone(),
                report
                    .into_iter()
                    .map(|r| nuwa_agent::status::PeerSyncStatus {
                        container: r.container,
                        state: r.state.as_str().to_owned(),
                        behind: r.behind,
                    })
                    .collect(),
            );
        }
        let in_sync = !verified.is_empty()
            && sync
                .values()
                .all(|v| v.iter().all(|c| c.state == "in_sync" || c.state == "ahead"));
        let catch_ups: Vec<nuwa_agent::status::CatchUpStatus> = self
            .session
            .engine()
            .catch_up_progress()
            .into_iter()
            .map(|c| nuwa_agent::status::CatchUpStatus {
                started_unix_ms: self
                    .catch_up_started
                    .get(&c.container)
                    .copied()
                    .unwrap_or(now),
                container: c.container,
                peer_id: c.peer,
                changes: c.changes,
                bytes: c.bytes,
            })
            .collect();
        let m = self.session.membership();
        Status {
            agent_did: m.did().to_owned(),
            device: DeviceStatus {
                context_id: m.context_id().to_owned(),
                peer_id: peer_id.clone(),
                name: self.name.clone(),
                authorised: m.self_authorised(now).is_ok(),
                did_log_len: m.log().len(),
                hello_bytes: m
                    .hello(now)
                    .map(|h| Frame::Hello(h).encode().len())
                    .unwrap_or(0),
            },
            listen_addrs: self
                .listen_addrs
                .iter()
                .map(|a| format!("{a}/p2p/{peer_id}"))
                .collect(),
            api_url: self.api_url.clone(),
            peers: self
                .session
                .peers()
                .iter()
                .filter_map(|(p, s)| match s {
                    PeerState::Verified {
                        context_id,
                        remote,
                        since_ms,
                        clock_offset_ms,
                        ..
                    } => {
                        // The connection in use now, if it changed since
                        // (a hole punch replaced the relayed one).
                        let remote = p
                            .parse::<PeerId>()
                            .ok()
                            .and_then(|id| self.wide.paths.get(&id))
                            .map(|a| a.to_string())
                            .unwrap_or_else(|| remote.clone());
                        let path = path_of_text(&remote);
                        Some(PeerStatus {
                            peer_id: p.clone(),
                            context_id: context_id.clone(),
                            address: remote,
                            verified_at_unix_ms: *since_ms,
                            clock_offset_ms: *clock_offset_ms,
                            transport: path.transport.to_owned(),
                            relayed: path.relayed,
                            name: self.seen.name_of(context_id).unwrap_or_default().to_owned(),
                            rtt_ms: p
                                .parse::<PeerId>()
                                .ok()
                                .and_then(|id| self.rtt_ms.get(&id).copied()),
                            sync: sync.get(p).cloned().unwrap_or_default(),
                        })
                    }
                    PeerState::Pending { .. } => None,
                })
                .collect(),
            clock_skew: self
                .session
                .skewed()
                .iter()
                .map(|(peer, offset_ms)| nuwa_agent::status::ClockSkewStatus {
                    peer_id: peer.clone(),
                    offset_ms: *offset_ms,
                    window_ms: nuwa_sync::secure::REPLAY_WINDOW_SECS * 1000,
                })
                .collect(),
            quarantined: self.quarantined.clone(),
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
            // The network's counters are in the registry too (see
            // `Metrics::watch_net`).
            counters: self.metrics.counters(),
            containers: {
                let e = self.session.engine();
                e.container_names()
                    .into_iter()
                    .map(|name| ContainerStatus {
                        name: name.clone(),
                        heads: e
                            .heads_of(name)
                            .unwrap_or_default()
                            .iter()
                            .map(hex::encode)
                            .collect(),
                        changes: e.change_count_of(name).unwrap_or(0),
                    })
                    .collect()
            },
            reachability: nuwa_agent::status::ReachabilityStatus {
                nat: self.wide.nat.as_str().to_owned(),
                advertised: self.wide.advertised.iter().map(|a| a.to_string()).collect(),
                relays: self.wide.relays.iter().map(|r| r.to_string()).collect(),
            },
            keepers: self.keeper_status(),
            version: env!("CARGO_PKG_VERSION").to_owned(),
            uptime_s: self.started.elapsed().as_secs(),
            key_epoch: self.session.secure().epoch(),
            in_sync,
            catch_ups,
            mdns: nuwa_agent::status::MdnsStatus {
                enabled: self.mdns_on,
                interfaces: self.mdns_watching.clone(),
            },
            rendezvous: self.wide.rendezvous_status(),
            dht_pointer: self.wide.pointer_bytes.map(|bytes| {
                nuwa_agent::status::DhtPointerStatus {
                    bytes,
                    limit: nuwa_sync::pointer::MAX_POINTER_BYTES as u64,
                }
            }),
            master_key: self.master_public.is_some(),
            admin: {
                let doc = self.session.log().current();
                let now = home::now_unix_secs();
                [
                    Some(self.session.membership().device().public()),
                    self.master_public,
                ]
                .into_iter()
                .flatten()
                .any(|p| {
                    doc.method_for_public(
                        &p,
                        nuwa_identity::document::Relationship::CapabilityDelegation,
                        now,
                    )
                    .is_ok()
                })
            },
            recovery_key: !nuwa_agent::lifecycle::recovery_keys(self.session.log().current())
                .is_empty(),
        }
    }
}

fn misrouted() -> ApiError {
    ApiError::new(
        ErrorCode::Internal,
        "a read was routed to the daemon loop instead of the reader",
    )
}

/// The path of a connection from its remote address as text (the session
/// keeps addresses as text).
fn path_of_text(remote: &str) -> nuwa_net::Path {
    remote
        .parse::<Multiaddr>()
        .map(|a| nuwa_net::path_of(&a))
        .unwrap_or(nuwa_net::Path {
            transport: "other",
            relayed: false,
        })
}
