//! `nuwa-node rendezvous`: an infrastructure node. It runs the stock libp2p
//! rendezvous server, serves the private DHT (and bootstraps devices into
//! it), relays circuits for devices behind NAT (with the limits of
//! [`InfraLimits::default`], reasoned in docs/decisions.md), and answers
//! AutoNAT v2 dial-back requests so devices learn whether they are
//! reachable.
//!
//! It is an untrusted introducer: it holds no agent keys and sees no state.
//! Devices verify everything it hands them against their DID document.
//! What it stores and queues, and when its keeper prunes, is decided by
//! `nuwa_agent::infra`; this is the shell that runs it.

use std::io::Write;
use std::path::Path;
use std::time::Duration;

use anyhow::{Context, Result};
use nuwa_agent::identity::keys::DeviceKey;
use nuwa_agent::infra::{Infra, InfraCount, InfraEffect, InfraInput, KeeperHost};
use nuwa_agent::proto::keeper::KeeperRequest;
use nuwa_counters::Counters;
use nuwa_net::{
    Features, InfraLimits, Multiaddr, NetConfig, NetCount, NetEvent, NetHandle, PeerId,
};
use tokio_util::sync::CancellationToken;
use tracing::{debug, info};

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
    let (answered_tx, mut answered) = tokio::sync::mpsc::unbounded_channel();
    let mut infra = Infra::new(keeper.is_some());
    let keeper = match keeper {
        Some(config) => Some(KeeperThread::start(
            &dir.join("keeper"),
            config,
            net.clone(),
            answered_tx,
        )?),
        None => None,
    };
    let mut report = tokio::time::interval(Duration::from_secs(60));
    report.tick().await;
    let mut shutdown = Box::pin(super_shutdown());
    info!(peer_id = %me, "rendezvous node starting");
    loop {
        let input = tokio::select! {
            _ = &mut shutdown => break,
            _ = report.tick() => {
                log_counters(infra.counters(), &net, "rendezvous node counters");
                continue;
            }
            Some(peer) = answered.recv() => InfraInput::Answered { peer },
            ev = events.recv() => match ev {
                None => break,
                Some(NetEvent::Listening(addr)) => {
                    // Operators and scripts read these lines.
                    println!("{addr}/p2p/{me}");
                    let _ = std::io::stdout().flush();
                    continue;
                }
                Some(NetEvent::KadInboundRecord { from, key, value }) => {
                    InfraInput::Record { from, key, value }
                }
                Some(NetEvent::Frame { peer, frame }) => InfraInput::Frame { peer, frame },
                Some(_) => continue,
            },
        };
        match infra.handle(input, home::now_ms()) {
            Some(InfraEffect::Store { key, value }) => {
                let _ = net.kad_store(key, value).await;
            }
            Some(InfraEffect::Keep { peer, request }) => {
                if !keeper.as_ref().is_some_and(|k| k.submit(peer, *request)) {
                    infra.handle(InfraInput::NotQueued { peer }, home::now_ms());
                }
            }
            None => {}
        }
    }
    log_counters(infra.counters(), &net, "rendezvous node counters at exit");
    if let Some(k) = keeper {
        k.stop();
    }
    cancel.cancel();
    info!("rendezvous node stopped");
    Ok(())
}

/// The keeper on a thread of its own: sled writes and flushes never hold
/// the network loop. Requests wait in a bounded queue (the loop bounds each
/// peer's share, see `nuwa_agent::infra`); answers go straight to the
/// network, and each answered peer back to the loop.
struct KeeperThread {
    tx: Option<std::sync::mpsc::SyncSender<(PeerId, KeeperRequest)>>,
    handle: Option<std::thread::JoinHandle<()>>,
}

impl KeeperThread {
    fn start(
        path: &Path,
        config: nuwa_keeper::KeeperConfig,
        net: NetHandle,
        answered: tokio::sync::mpsc::UnboundedSender<PeerId>,
    ) -> Result<Self> {
        let store = nuwa_store::SledKeeperStore::open(path)
            .with_context(|| format!("cannot open the keeper's store in {}", path.display()))?;
        let keeper = nuwa_keeper::Keeper::new(Box::new(store), config);
        info!(path = %path.display(), agents = keeper.stats().agents, "keeper store opened");
        let mut host = KeeperHost::new(keeper, home::now_ms());
        let (tx, rx) = std::sync::mpsc::sync_channel::<(PeerId, KeeperRequest)>(1024);
        let log = |s: nuwa_keeper::KeeperStats, what: &str| {
            info!(pushes = s.pushes, pulls = s.pulls, stored = s.envelopes_stored, served = s.envelopes_served, compacted = s.envelopes_compacted, refused = ?s.refused, agents = s.agents, "{what}");
        };
        let handle = std::thread::Builder::new()
            .name("keeper".into())
            .spawn(move || {
                while let Ok((peer, req)) = rx.recv() {
                    let now = home::now_ms();
                    let bytes = host.serve(req, now);
                    let _ = answered.send(peer);
                    if net.try_send(peer, bytes).is_err() {
                        debug!(%peer, "keeper answer not sent (network behind)");
                    }
                    if let Some(s) = host.report_due(now) {
                        log(s, "keeper counters");
                    }
                }
                log(host.stats(), "keeper counters at exit");
            })
            .context("cannot start the keeper thread")?;
        Ok(KeeperThread {
            tx: Some(tx),
            handle: Some(handle),
        })
    }

    /// Queues a request; false if the queue is full (the device asks
    /// again).
    fn submit(&self, peer: PeerId, req: KeeperRequest) -> bool {
        self.tx
            .as_ref()
            .is_some_and(|tx| tx.try_send((peer, req)).is_ok())
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
fn log_counters(counters: &Counters<InfraCount>, net: &NetHandle, what: &str) {
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
