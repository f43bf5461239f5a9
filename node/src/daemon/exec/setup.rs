//! Starting the daemon's IO: the home's lock and store, the network and
//! its listeners, the local API (its token in `api.json`, its socket), and
//! mDNS with the first announcement. Part of the executor's module: the
//! handles made here go to the executor (or, as receivers, to the loop).

use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use nuwa_discovery::{DiscoveryEvent, Mdns, MdnsConfig};
use nuwa_net::{Multiaddr, NetConfig, NetEvent, NetHandle};
use nuwa_store::{SledStore, Storage};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use super::super::RunOptions;
use crate::api::{self, ApiFile};
use crate::home::{self, Home};

/// The home's lock, held by the daemon for its life.
pub(in crate::daemon) fn lock(home: &Home) -> Result<home::HomeLock> {
    home::lock(&home.dir)
}

/// Opens the home's store (sled, encrypted at rest).
pub(in crate::daemon) fn open_store(home: &Home) -> Result<Arc<dyn Storage>> {
    let store = SledStore::open(&home.dir.join(home::STORE_DIR), home.at_rest.clone())
        .with_context(|| format!("cannot open the store in {}", home.dir.display()))?;
    Ok(Arc::new(store))
}

/// The scope of the nearest infrastructure node configured, which decides
/// which listen addresses are advertised before any confirmation (see
/// `nuwa_net::reach`).
fn infra_scope(agent: &nuwa_agent::Config) -> Option<nuwa_net::Scope> {
    let mut addrs: Vec<&Multiaddr> = agent.keepers.iter().map(|(_, a)| a).collect();
    if agent.dht {
        addrs.extend(agent.bootstrap.iter().map(|(_, a)| a));
    }
    if agent.rendezvous {
        addrs.extend(agent.rendezvous_servers.iter().map(|(_, a)| a));
    }
    addrs
        .into_iter()
        .filter_map(nuwa_net::reach::scope_of)
        .min()
}

/// Starts the swarm and waits until its listeners are up, so that mDNS
/// announces a real port.
pub(in crate::daemon) async fn start_network(
    home: &Home,
    opts: &RunOptions,
    cancel: CancellationToken,
) -> Result<(NetHandle, mpsc::Receiver<NetEvent>, Vec<Multiaddr>)> {
    let net_config = NetConfig {
        listen: opts.listen.clone(),
        features: nuwa_net::Features {
            kad: opts.agent.dht,
            rendezvous_client: opts.agent.rendezvous,
            gossip: true,
            nat_traversal: true,
            infrastructure: None,
        },
        advertise_listen: Some(nuwa_net::reach::listen_scopes(
            infra_scope(&opts.agent),
            &opts.listen,
        )),
        ..NetConfig::default()
    };
    let (net, mut events) = nuwa_net::spawn(home.device.seed(), net_config, cancel)
        .await
        .context("cannot start the network")?;
    let listen_addrs = wait_listening(&mut events, &opts.listen).await?;
    for a in &listen_addrs {
        info!(address = %format!("{a}/p2p/{}", net.local_peer_id()), "listening");
    }
    Ok((net, events, listen_addrs))
}

/// Waits (at most 5 s) until every address of `listen` is up by the core's
/// rule (`nuwa_agent::listen::ready`); what came up, in report order.
pub(crate) async fn wait_listening(
    events: &mut mpsc::Receiver<NetEvent>,
    listen: &[Multiaddr],
) -> Result<Vec<Multiaddr>> {
    let mut up = Vec::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while !nuwa_agent::listen::ready(listen, &up) {
        match tokio::time::timeout_at(deadline, events.recv()).await {
            Ok(Some(NetEvent::Listening(a))) => up.push(a),
            Ok(Some(_)) => {}
            Ok(None) => anyhow::bail!("the network stopped during start-up"),
            Err(_) => break,
        }
    }
    for a in nuwa_agent::listen::pending(listen, &up) {
        warn!(listen = %a, "this listen address did not come up within 5 s");
    }
    anyhow::ensure!(
        !up.is_empty(),
        "no listen address came up within 5 s; check --listen"
    );
    Ok(up)
}

/// The local API, up: its address (written to `api.json` with a fresh
/// token) and, on unix, its socket in the home, removed when dropped.
pub(in crate::daemon) struct Served {
    pub(in crate::daemon) url: String,
    #[cfg(unix)]
    _socket: Option<api::SocketFile>,
}

pub(in crate::daemon) async fn serve_api(
    home: &Home,
    opts: &RunOptions,
    lanes: api::Lanes,
    feeds: &api::Feeds,
    metrics: &Arc<crate::metrics::Metrics>,
    cancel: &CancellationToken,
) -> Result<Served> {
    let token = {
        let mut t = [0u8; 32];
        getrandom::fill(&mut t).map_err(|e| anyhow::anyhow!("no randomness: {e}"))?;
        hex::encode(t)
    };
    let (api_addr, api_web) = api::serve(
        opts.api_listen,
        token.clone(),
        lanes.clone(),
        feeds.clone(),
        metrics.clone(),
        api::Limits::default(),
        cancel.clone(),
    )
    .await
    .context("cannot start the local API")?;
    // The same API for apps on this device, by a path in the home (NIP-6
    // IPC discovery). A daemon without it still serves TCP.
    #[cfg(unix)]
    let socket = match api::serve_socket(
        &home.dir.join(home::API_SOCKET),
        token.clone(),
        lanes,
        feeds.clone(),
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
    let url = format!("http://{api_addr}");
    home::write_private(
        &home.dir.join(home::API_FILE),
        &serde_json::to_vec_pretty(&ApiFile {
            url: url.clone(),
            token,
            pid: std::process::id(),
        })?,
    )?;
    info!(url = %url, "local API ready");
    Ok(Served {
        url,
        #[cfg(unix)]
        _socket: socket,
    })
}

/// mDNS with our first signed announcement (the agent re-signs it every
/// two minutes). A dead discovery source must not stop the others, but is
/// reported: `opts.agent.mdns_failed` says why, for `status` and `doctor`.
pub(in crate::daemon) fn start_mdns(
    home: &Home,
    opts: &mut RunOptions,
    net: &NetHandle,
    listen: &[Multiaddr],
) -> Option<(Mdns, nuwa_discovery::flume::Receiver<DiscoveryEvent>)> {
    if !opts.agent.mdns {
        return None;
    }
    let peer = net.local_peer_id();
    let started = nuwa_agent::listen::mdns_port(&opts.listen, listen)
        .map_err(|e| e.to_string())
        .and_then(|port| {
            let txt = nuwa_agent::announce::Announcement::new_signed(
                home.log.did(),
                &home.info.context_id,
                peer.to_string(),
                port,
                home::now_unix_secs(),
                |bytes| home.device.sign(bytes),
            )
            .to_txt();
            Mdns::start(MdnsConfig {
                instance_name: peer.to_string(),
                port,
                interfaces: opts.mdns_interfaces.clone(),
                txt,
                refresh_secs: nuwa_agent::ANNOUNCE_REFRESH_MS / 1000,
            })
            .map_err(|e| nuwa_agent::explain(&e))
        });
    let reason = match started {
        Ok(up) => return Some(up),
        Err(reason) => reason,
    };
    warn!(%reason, "mDNS FAILED: no device on this LAN can find this one (see `nuwa-node doctor`)");
    (opts.agent.mdns, opts.agent.mdns_failed) = (false, Some(reason));
    None
}
