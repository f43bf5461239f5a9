//! `nuwa-node rendezvous`: an infrastructure node. It runs the stock libp2p
//! rendezvous server, serves the private DHT (and bootstraps devices into
//! it), relays circuits for devices behind NAT (with the limits of
//! [`InfraLimits::default`], reasoned in ARCHITECTURE.md), and answers
//! AutoNAT v2 dial-back requests so devices learn whether they are
//! reachable.
//!
//! It is an untrusted introducer: it holds no agent keys and sees no state.
//! Devices verify everything it hands them against their DID document. It
//! still refuses DHT records that do not verify on their own (the pointer
//! record carries the agent's self-certifying DID log), and it bounds
//! registrations per peer and in total so that floods degrade nothing for
//! honest agents.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::Path;
use std::time::Duration;

use anyhow::{Context, Result};
use nuwa_agent::identity::keys::DeviceKey;
use nuwa_agent::proto::Frame;
use nuwa_agent::proto::keeper::KeeperRequest;
use nuwa_agent::sync::pointer::AgentPointer;
use nuwa_net::{
    Features, InfraLimits, Multiaddr, NetConfig, NetCount, NetEvent, NetHandle, PeerId,
};
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::home;

const INFRA_KEY: &str = "infra.key";

fn load_or_create_key(dir: &Path) -> Result<DeviceKey> {
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let path = dir.join(INFRA_KEY);
    if path.exists() {
        let bytes =
            std::fs::read(&path).with_context(|| format!("cannot read {}", path.display()))?;
        return DeviceKey::from_seed_file_bytes(&bytes)
            .with_context(|| format!("cannot read {}", path.display()));
    }
    let key = DeviceKey::generate().context("cannot generate the node key")?;
    home::write_private(&path, &key.to_seed_file_bytes())?;
    Ok(key)
}

pub async fn run(
    dir: &Path,
    listen: Vec<Multiaddr>,
    max_registrations_per_peer: usize,
    max_registrations: usize,
    keeper: Option<nuwa_keeper::KeeperConfig>,
) -> Result<()> {
    let key = load_or_create_key(dir)?;
    let cancel = CancellationToken::new();
    let config = NetConfig {
        listen: listen.clone(),
        // Infrastructure connections carry DHT and rendezvous traffic only.
        idle_connection_timeout: Duration::from_secs(300),
        features: Features {
            kad: true,
            rendezvous_client: false,
            gossip: false,
            nat_traversal: false,
            infrastructure: Some(InfraLimits {
                max_registrations_per_peer,
                max_registrations_total: max_registrations,
                ..InfraLimits::default()
            }),
        },
        ..NetConfig::default()
    };
    let (net, mut events) = nuwa_net::spawn(key.seed(), config, cancel.clone())
        .await
        .context("cannot start the network")?;
    let me = net.local_peer_id();
    let keeper = match keeper {
        Some(config) => Some(KeeperThread::start(
            &dir.join("keeper"),
            config,
            net.clone(),
        )?),
        None => None,
    };
    let mut counters: BTreeMap<&'static str, u64> = BTreeMap::new();
    let mut report = tokio::time::interval(Duration::from_secs(60));
    report.tick().await;
    let mut shutdown = Box::pin(super_shutdown());
    info!(peer_id = %me, "rendezvous node starting");
    loop {
        tokio::select! {
            _ = &mut shutdown => break,
            _ = report.tick() => log_counters(&counters, &net, "rendezvous node counters"),
            ev = events.recv() => {
                let Some(ev) = ev else { break };
                match ev {
                    NetEvent::Listening(addr) => {
                        // Operators and scripts read these lines.
                        println!("{addr}/p2p/{me}");
                        let _ = std::io::stdout().flush();
                    }
                    NetEvent::KadInboundRecord { from, key, value } => {
                        let now = home::now_unix_secs();
                        match AgentPointer::decode(&value).and_then(|p| p.verify(&key, now)) {
                            Ok(()) => {
                                *counters.entry("dht_records_stored").or_default() += 1;
                                let _ = net.kad_store(key, value).await;
                            }
                            Err(e) => {
                                *counters.entry("dht_records_refused").or_default() += 1;
                                info!(peer = %from, reason = %e, "forged or invalid DHT record refused");
                            }
                        }
                    }
                    NetEvent::Frame { peer, frame } => match (&keeper, Frame::decode(&frame)) {
                        (Some(k), Ok(Frame::KeeperRequest(req))) => {
                            if !k.submit(peer, *req) {
                                *counters.entry("keeper_requests_dropped_busy").or_default() += 1;
                            }
                        }
                        (_, Err(e)) => {
                            *counters.entry("malformed_frames").or_default() += 1;
                            debug!(%peer, error = %e, "malformed frame");
                        }
                        _ => {
                            *counters.entry("sync_frames_ignored").or_default() += 1;
                            debug!(%peer, "sync frame sent to an infrastructure node ignored");
                        }
                    },
                    NetEvent::Connected { peer, .. } => debug!(%peer, "connected"),
                    _ => {}
                }
            }
        }
    }
    log_counters(&counters, &net, "rendezvous node counters at exit");
    if let Some(k) = keeper {
        k.stop();
    }
    cancel.cancel();
    info!("rendezvous node stopped");
    Ok(())
}

/// The keeper on a thread of its own: sled writes and flushes never hold
/// the network loop. Requests wait in a bounded queue (a full one drops the
/// request, which the device asks again); answers go straight to the
/// network.
struct KeeperThread {
    tx: Option<std::sync::mpsc::SyncSender<(PeerId, KeeperRequest)>>,
    handle: Option<std::thread::JoinHandle<()>>,
    /// Requests queued per peer: one device has at most a push and a pull
    /// under way, so a peer past [`MAX_QUEUED_PER_PEER`] is flooding, and its
    /// extra requests are dropped before they can fill the queue that every
    /// other agent's devices share.
    queued: std::sync::Arc<std::sync::Mutex<std::collections::HashMap<PeerId, usize>>>,
}

const MAX_QUEUED_PER_PEER: usize = 8;

impl KeeperThread {
    fn start(path: &Path, config: nuwa_keeper::KeeperConfig, net: NetHandle) -> Result<Self> {
        let store = nuwa_store::SledKeeperStore::open(path)
            .with_context(|| format!("cannot open the keeper's store in {}", path.display()))?;
        let mut keeper = nuwa_keeper::Keeper::new(Box::new(store), config);
        info!(path = %path.display(), agents = keeper.stats().agents, "keeper store opened");
        let (tx, rx) = std::sync::mpsc::sync_channel::<(PeerId, KeeperRequest)>(1024);
        let queued: std::sync::Arc<std::sync::Mutex<std::collections::HashMap<PeerId, usize>>> =
            Default::default();
        let done = queued.clone();
        let handle = std::thread::Builder::new()
            .name("keeper".into())
            .spawn(move || {
                let mut last_prune = 0u64;
                let mut last_report = home::now_ms();
                while let Ok((peer, req)) = rx.recv() {
                    let now = home::now_ms();
                    let resp = keeper.handle(req, now);
                    if let Ok(mut q) = done.lock()
                        && let Some(n) = q.get_mut(&peer)
                    {
                        *n = n.saturating_sub(1);
                        if *n == 0 {
                            q.remove(&peer);
                        }
                    }
                    let bytes = Frame::KeeperResponse(Box::new(resp)).encode();
                    if net.try_send(peer, bytes).is_err() {
                        debug!(%peer, "keeper answer not sent (network behind)");
                    }
                    if now.saturating_sub(last_prune) > 3_600_000 {
                        last_prune = now;
                        if let Err(e) = keeper.prune(now) {
                            warn!(error = %e, "keeper retention pass failed");
                        }
                    }
                    if now.saturating_sub(last_report) > 60_000 {
                        last_report = now;
                        let s = keeper.stats();
                        info!(pushes = s.pushes, pulls = s.pulls, stored = s.envelopes_stored, served = s.envelopes_served, compacted = s.envelopes_compacted, refused = ?s.refused, agents = s.agents, "keeper counters");
                    }
                }
                let s = keeper.stats();
                info!(pushes = s.pushes, pulls = s.pulls, stored = s.envelopes_stored, served = s.envelopes_served, compacted = s.envelopes_compacted, refused = ?s.refused, agents = s.agents, "keeper counters at exit");
            })
            .context("cannot start the keeper thread")?;
        Ok(KeeperThread {
            tx: Some(tx),
            handle: Some(handle),
            queued,
        })
    }

    /// Queues a request; false if the peer has too many queued already or
    /// the queue is full (the device asks again).
    fn submit(&self, peer: PeerId, req: KeeperRequest) -> bool {
        let Ok(mut q) = self.queued.lock() else {
            return false;
        };
        let n = q.entry(peer).or_default();
        if *n >= MAX_QUEUED_PER_PEER {
            return false;
        }
        let sent = self
            .tx
            .as_ref()
            .is_some_and(|tx| tx.try_send((peer, req)).is_ok());
        if sent {
            *n += 1;
        }
        sent
    }

    fn stop(mut self) {
        self.tx = None;
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

/// One log line with the node's own counters and the relay's grants and
/// refusals (operators and the NAT lab read it).
fn log_counters(counters: &BTreeMap<&'static str, u64>, net: &NetHandle, what: &str) {
    let net = net.counters();
    info!(
        ?counters,
        relay_reservations_accepted = net.get(NetCount::RelayReservationsAccepted),
        relay_reservations_denied = net.get(NetCount::RelayReservationsDenied),
        relay_circuits_accepted = net.get(NetCount::RelayCircuitsAccepted),
        relay_circuits_denied = net.get(NetCount::RelayCircuitsDenied),
        relay_circuits_cut = net.get(NetCount::RelayCircuitsCut),
        connections_refused = net.get(NetCount::ConnectionsRefused),
        "{what}"
    );
}

async fn super_shutdown() {
    let ctrl_c = tokio::signal::ctrl_c();
    match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
        Ok(mut term) => {
            tokio::select! {
                _ = ctrl_c => {}
                _ = term.recv() => {}
            }
        }
        Err(_) => {
            let _ = ctrl_c.await;
        }
    }
}
