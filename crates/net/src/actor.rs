//! The network actor: one task that owns the swarm, takes the owner's
//! commands and turns the swarm's events into [`NetEvent`]s, never awaiting
//! its owner (see `outbox`). Its handlers are grouped by what they handle:
//! `commands` (the owner's), `events` (the swarm's own: listeners and
//! connections), `behaviours` (each protocol's), and `frames` (outbound
//! frames and which connection carries them).

mod behaviours;
mod commands;
mod events;
mod frames;
mod liveness;

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::time::Duration;

use futures::StreamExt;
use libp2p::core::transport::ListenerId;
use libp2p::request_response::OutboundRequestId;
use libp2p::swarm::ConnectionId;
use libp2p::{Multiaddr, PeerId, Swarm, kad};
use nuwa_counters::Counters;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use crate::handle::Command;
use crate::outbox::{self, Delivery, Outbox};
use crate::swarm::Behaviour;
use crate::{NetConfig, NetCount, NetEvent, Scope, reach};

/// Gossip publishes held while no peer is subscribed yet.
const MAX_PENDING_PUBLISHES: usize = 1024;

/// How long relayed connections stay open next to a new direct one at most:
/// frames already under way on them finish first.
const RELAYED_CLOSE_GRACE: Duration = Duration::from_secs(10);

#[derive(Default)]
struct PeerQueue {
    queue: VecDeque<Vec<u8>>,
    in_flight: Option<OutboundRequestId>,
    /// A copy of the frame in flight, sent again once if the connection it
    /// went on closes while another one to the peer stays up (a relayed
    /// connection closed next to a new direct one).
    in_flight_frame: Option<(Vec<u8>, bool)>,
    /// The head frame is waiting for a direct connection (counted once).
    deferred: bool,
    /// When the frame in flight went out, and its size (see `liveness`).
    sent: Option<(tokio::time::Instant, usize)>,
}

/// One open connection to a peer.
struct Conn {
    id: ConnectionId,
    remote: Multiaddr,
    relayed: bool,
    since: tokio::time::Instant,
}

/// The actor's state: the swarm and what it keeps about peers, queues and
/// addresses between events.
pub(crate) struct Actor {
    swarm: Swarm<Behaviour>,
    /// Events to the owner; never awaited (see `outbox`).
    events: Outbox<NetEvent>,
    queues: BTreeMap<PeerId, PeerQueue>,
    config: NetConfig,
    counters: Counters<NetCount>,
    pending_publishes: VecDeque<(String, Vec<u8>)>,
    /// Queries whose results carry the key we asked for.
    get_queries: HashMap<kad::QueryId, Vec<u8>>,
    /// Open connections per peer, oldest first.
    conns: BTreeMap<PeerId, Vec<Conn>>,
    /// The remote address last reported for each peer (`Connected` or
    /// `PathChanged`).
    reported_path: BTreeMap<PeerId, Multiaddr>,
    /// Circuit listeners (reservations) per relay, and back.
    relay_listeners: BTreeMap<PeerId, ListenerId>,
    listener_relays: HashMap<ListenerId, PeerId>,
    /// Scopes of listen addresses we advertise unconfirmed (see `reach`).
    vouched: Vec<Scope>,
    /// Our listening sockets, never dialed.
    own_sockets: BTreeSet<(std::net::IpAddr, u16, bool)>,
    /// The external addresses last reported.
    reported_external: BTreeSet<Multiaddr>,
    infrastructure: bool,
    /// Peers with a direct connection whose relayed ones close once
    /// nothing is in flight (or at the latest at the given time).
    relayed_to_close: BTreeMap<PeerId, tokio::time::Instant>,
    /// Peers whose hole punch failed since their last direct connection:
    /// frames for them no longer wait for one.
    punch_failed: BTreeSet<PeerId>,
    /// Peers dialed again after a stall (see `liveness`), and when: their
    /// connections older than that close once a new one is up.
    /// (suspected at, last dialed).
    suspect: BTreeMap<PeerId, (tokio::time::Instant, tokio::time::Instant)>,
    /// The listen addresses each connected peer last told us (identify),
    /// for dialing it again after a stall (see `liveness`).
    identified: BTreeMap<PeerId, Vec<Multiaddr>>,
    /// When each peer last got a probe (see `liveness`).
    probed: BTreeMap<PeerId, tokio::time::Instant>,
    /// Peers whose direct path a relayed connection replaced: when to look
    /// whether they are direct again, and fresh relayed connections left
    /// (see `liveness`).
    repunch: BTreeMap<PeerId, (tokio::time::Instant, u8)>,
    /// When every connected peer was last dialed again after a stall.
    last_refresh: Option<tokio::time::Instant>,
    /// Peers dialed from the listening port (infrastructure nodes).
    reuse_port_peers: BTreeSet<PeerId>,
}

impl Actor {
    /// An actor driving `swarm` that hands its events to `events`.
    pub(crate) fn new(
        swarm: Swarm<Behaviour>,
        events: mpsc::Sender<NetEvent>,
        config: NetConfig,
        counters: Counters<NetCount>,
    ) -> Actor {
        let infrastructure = config.features.infrastructure.is_some();
        let vouched = config.advertise_listen.clone().unwrap_or_else(|| {
            let mut v = reach::listen_scopes(None, &config.listen);
            // An infrastructure node is placed where devices reach it: every
            // address it listens on, but loopback only on a one-host testnet.
            if infrastructure {
                v.push(Scope::Public);
            }
            v
        });
        Actor {
            swarm,
            events: Outbox::new(events, outbox::MAX_BACKLOG),
            queues: BTreeMap::new(),
            config,
            counters,
            pending_publishes: VecDeque::new(),
            get_queries: HashMap::new(),
            conns: BTreeMap::new(),
            reported_path: BTreeMap::new(),
            relay_listeners: BTreeMap::new(),
            listener_relays: HashMap::new(),
            vouched,
            own_sockets: BTreeSet::new(),
            reported_external: BTreeSet::new(),
            infrastructure,
            relayed_to_close: BTreeMap::new(),
            punch_failed: BTreeSet::new(),
            suspect: BTreeMap::new(),
            probed: BTreeMap::new(),
            identified: BTreeMap::new(),
            repunch: BTreeMap::new(),
            last_refresh: None,
            reuse_port_peers: BTreeSet::new(),
        }
    }

    pub(crate) async fn run(
        mut self,
        mut commands: mpsc::Receiver<Command>,
        cancel: CancellationToken,
    ) {
        // Frames held for a direct connection are looked at again four
        // times a second (their grace may have run out), and so are frames
        // in flight (a stall is the first sign of a dead path).
        let mut deferred = tokio::time::interval(Duration::from_millis(250));
        deferred.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            // Nothing here awaits the owner: events leave with try_send, and
            // held ones move when `drain` finds room, polled next to the
            // swarm and the commands rather than instead of them.
            tokio::select! {
                _ = cancel.cancelled() => break,
                cmd = commands.recv() => match cmd {
                    Some(cmd) => self.on_command(cmd),
                    None => break,
                },
                ev = self.swarm.select_next_some() => {
                    for out in self.on_swarm_event(ev) {
                        self.emit(out);
                    }
                    self.on_external_change();
                }
                _ = deferred.tick() => {
                    let waiting: Vec<PeerId> = self
                        .queues
                        .iter()
                        .filter(|(_, q)| q.deferred)
                        .map(|(p, _)| *p)
                        .collect();
                    for p in waiting {
                        self.pump(p);
                    }
                    self.close_relayed();
                    self.watch_stalls();
                    self.repunch_stale();
                }
                drained = self.events.drain(), if self.events.has_backlog() => {
                    if drained.is_err() {
                        break;
                    }
                }
            }
            if self.events.is_closed() {
                break;
            }
        }
        debug!("network actor stopped");
    }

    /// Hands `ev` to the owner without waiting. A dropped event is counted
    /// by kind and returned, so that the caller can release what it stands
    /// for (an inbound request, a gossip verdict).
    fn emit(&mut self, ev: NetEvent) -> Option<NetEvent> {
        let dropped = self.events.push(ev)?;
        let c = &self.counters;
        match &dropped {
            NetEvent::Frame { .. } => c.inc(NetCount::FramesDropped),
            NetEvent::GossipMessage { .. } => c.inc(NetCount::GossipDropped),
            other => {
                if other.must_deliver() {
                    warn!(
                        backlog = self.events.backlog_len(),
                        "the owner is not reading network events; a connection event was dropped"
                    );
                }
                c.inc(NetCount::EventsDropped)
            }
        }
        Some(dropped)
    }
}
