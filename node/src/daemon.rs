//! `nuwa-node run`: the daemon, a shell around the IO-free
//! [`nuwa_agent::Agent`]. One loop owns the agent; the network, mDNS, the
//! local API, the reader and the catch-up workers feed it through bounded
//! channels. Everything they bring becomes an [`Input`]; everything the
//! agent decides comes back as effects, which one executor
//! ([`exec`](self::exec)) performs: it persists, acknowledges, sends, and
//! is the only code that touches the store, the home's files and the
//! network.
//!
//! Order of trust on a new connection: Noise proves the peer holds the key
//! behind its PeerId → both sides send a Hello → the agent's session checks
//! it against the DID document → only then does the engine learn about the
//! peer, and only verified peers' envelopes are opened.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use nuwa_agent::{Agent, Effect, Input};
use nuwa_discovery::DiscoveryEvent;
use nuwa_net::{Multiaddr, NetEvent};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tracing::{error, info};

use crate::api::{self, ApiRequest};
use crate::home::{self, Home};

mod catch_up;
mod exec;
mod inputs;
mod meta;
pub(crate) mod reader;

pub(crate) use exec::open::load_container;
use exec::{Executor, Hands, setup};
pub(crate) use inputs::stderr_is_tty;
pub(crate) use setup::wait_listening;

/// Options of `nuwa-node run` and `sync --once`: where the shell listens,
/// and the agent's configuration.
#[derive(Debug, Clone)]
pub struct RunOptions {
    pub listen: Vec<Multiaddr>,
    pub api_listen: SocketAddr,
    pub mdns_interfaces: Vec<String>,
    pub agent: nuwa_agent::Config,
    /// `--json sync --once`: its result is one JSON document on stdout.
    pub once_json: bool,
}

const TICK: Duration = Duration::from_millis(200);
/// API requests taken per loop turn (one durable group commit).
const MAX_API_BATCH: usize = 512;
/// Most network events handled as one turn.
const MAX_NET_RUN: usize = 256;

/// What the loop receives from.
struct Sources {
    net: mpsc::Receiver<NetEvent>,
    api: mpsc::Receiver<ApiRequest>,
    reader: mpsc::Receiver<reader::ReaderEvent>,
    mdns: Option<nuwa_discovery::flume::Receiver<DiscoveryEvent>>,
    caught_up: mpsc::Receiver<catch_up::Back>,
}

/// The daemon: the agent and the hands that carry out what it decides.
struct Daemon {
    agent: Agent,
    exec: Executor,
    /// `sync --once`: how it ended, once it has.
    once: Option<nuwa_agent::OnceResult>,
}

pub async fn run(home: Home, mut opts: RunOptions) -> Result<()> {
    let shutdown = shutdown_signal();
    let cancel = CancellationToken::new();
    let lock = setup::lock(&home)?;
    let did = home.log.did().to_owned();
    let context_id = home.info.context_id.clone();
    let store = setup::open_store(&home)?;
    let (net, net_events, listen_addrs) =
        setup::start_network(&home, &opts, cancel.clone()).await?;
    let metrics = Arc::new(crate::metrics::Metrics::new());
    metrics.watch_net(net.clone());
    let (reads, read_lane, reader_events) = reader::spawn(
        store.clone(),
        home.device.public().to_vec(),
        nuwa_agent::asm_model::registry::Registry::with_core(),
        nuwa_agent::sync::Config::default().max_containers,
    )
    .context("cannot start the reader thread")?;
    let (api_tx, api_rx) = mpsc::channel::<ApiRequest>(1024);
    let feeds = api::Feeds::new();
    let lanes = api::Lanes {
        writes: api_tx,
        reads: read_lane,
    };
    let served = setup::serve_api(&home, &opts, lanes, &feeds, &metrics, &cancel).await?;
    opts.agent.api_url = served.url.clone();
    let (mdns, mdns_events) = setup::start_mdns(&home, &mut opts, &net, &listen_addrs).unzip();
    let watching = match &mdns {
        Some(_) => nuwa_discovery::watched_interfaces(&opts.mdns_interfaces),
        None => Vec::new(),
    };
    let hands = Hands {
        home,
        store,
        net: net.clone(),
        reader: reads,
        feeds,
        metrics,
    };
    let (mut exec, boot) = Executor::open(hands, &opts.agent, listen_addrs, watching)?;
    if let Some(m) = mdns {
        exec.set_mdns(m);
    }
    let caught_up = exec
        .catch_up_receiver()
        .context("the catch-up channel was taken twice")?;
    let agent = Agent::new(opts.agent.clone(), boot, home::now_ms());
    let mut d = Daemon {
        agent,
        exec,
        once: None,
    };
    // The core models' genesis changes, durable before anything else runs.
    d.turn(Input::Start).await;
    let sources = Sources {
        net: net_events,
        api: api_rx,
        reader: reader_events,
        mdns: mdns_events,
        caught_up,
    };
    info!(did = %did, context_id = %context_id, peer_id = %net.local_peer_id(), "daemon running");
    let ended = d.run_loop(sources, shutdown).await;
    cancel.cancel();
    let once = d
        .once
        .take()
        .map(|r| inputs::finished(r, &opts, d.exec.metrics()));
    d.close().await?;
    // Before the lock: a daemon that takes it next binds its own socket.
    drop(served);
    drop(lock);
    ended?;
    info!("stopped cleanly");
    match once {
        Some(Err(reason)) => Err(anyhow::anyhow!(reason)),
        _ => Ok(()),
    }
}

impl Daemon {
    /// One input: the agent decides, the executor performs, and whatever
    /// the executor brings back goes to the agent in the same turn.
    async fn turn(&mut self, input: Input) {
        let mut next = Some(input);
        while let Some(input) = next.take() {
            tracing::trace!(target: "nuwa_path", "turn");
            let effects = self.agent.handle(input, home::now_ms());
            tracing::trace!(target: "nuwa_path", "decided");
            let effects = self.take_outcomes(effects);
            let back = self.exec.execute(&self.agent, effects).await;
            let mut back = back.into_iter();
            next = back.next();
            for more in back {
                let effects = self.agent.handle(more, home::now_ms());
                let effects = self.take_outcomes(effects);
                self.exec.execute(&self.agent, effects).await;
            }
        }
    }

    /// The effects that are the loop's own (`sync --once` progress and
    /// end); the rest go to the executor.
    fn take_outcomes(&mut self, effects: Vec<Effect>) -> Vec<Effect> {
        let mut rest = Vec::with_capacity(effects.len());
        for e in effects {
            match e {
                Effect::Progress(line) => inputs::progress(&line, self.agent.config().once_tty),
                Effect::Finished(result) => self.once = Some(result),
                other => rest.push(other),
            }
        }
        rest
    }

    async fn run_loop(
        &mut self,
        mut src: Sources,
        shutdown: impl std::future::Future<Output = ()>,
    ) -> Result<()> {
        let mut tick = tokio::time::interval(TICK);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tokio::pin!(shutdown);
        // Each arm holds the loop while it runs: timed, so that a turn that
        // holds it too long shows in `loop_turn_seconds`.
        let turns = self.exec.metrics().clone();
        loop {
            tokio::select! {
                _ = &mut shutdown => {
                    info!("shutting down");
                    break;
                }
                ev = src.net.recv() => {
                    let Some(ev) = ev else { error!("network task stopped"); break };
                    let _turn = crate::metrics::TurnTimer::start(&turns, "network");
                    let run = inputs::net_run(ev, &mut src.net, MAX_NET_RUN, &mut self.exec);
                    self.turn(Input::Net(run)).await;
                }
                Some(finished) = src.caught_up.recv() => {
                    let _turn = crate::metrics::TurnTimer::start(&turns, "catch-up result");
                    let (container, input) = self.exec.catch_up_returned(finished);
                    self.turn(input).await;
                    self.exec.catch_up_settled(&container);
                }
                req = src.api.recv() => {
                    let Some(first) = req else { break };
                    let _turn = crate::metrics::TurnTimer::start(&turns, "api");
                    let batch = inputs::api_batch(first, &mut src.api, MAX_API_BATCH, &mut self.exec);
                    if !batch.is_empty() {
                        self.turn(Input::Api(batch)).await;
                    }
                }
                ev = src.reader.recv() => {
                    // The reader thread died: reads cannot be served.
                    let Some(reader::ReaderEvent::Scanned { container, heads, scan }) = ev else {
                        error!("the reader stopped");
                        break;
                    };
                    let _turn = crate::metrics::TurnTimer::start(&turns, "reader");
                    self.turn(Input::Scanned { container, heads, scan }).await;
                }
                ev = recv_opt(&mut src.mdns) => match ev {
                    Some(ev) => {
                        let _turn = crate::metrics::TurnTimer::start(&turns, "discovery");
                        self.turn(Input::Mdns(inputs::mdns(ev))).await;
                    }
                    None => src.mdns = None,
                },
                _ = tick.tick() => {
                    let _turn = crate::metrics::TurnTimer::start(&turns, "tick");
                    let rss_bytes = self.exec.rss_bytes();
                    self.turn(Input::Tick { rss_bytes }).await;
                    self.exec.gauges(&self.agent);
                }
            }
            if let Some(e) = self.exec.take_fatal() {
                error!(error = %e, "fatal storage error; stopping so that nothing unacknowledged is reported durable");
                return Err(e);
            }
            if self.once.is_some() {
                break;
            }
        }
        Ok(())
    }

    /// The last records (devices seen), then the executor's shutdown.
    async fn close(mut self) -> Result<()> {
        let effects = self.agent.shutdown(home::now_ms());
        self.exec.execute(&self.agent, effects).await;
        self.exec.close().await
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
