//! The libp2p side of nuwa-sync, run as an actor behind a [`NetHandle`].
//!
//! One swarm (TCP and QUIC, Noise, Yamux, plus relay circuits) carries:
//! - `/nuwa/sync/1`: request-response of opaque, length-prefixed frames with
//!   a hard cap (see `codec`);
//! - identify and ping;
//! - a private Kademlia DHT on `/nuwa/kad/1.0.0`, with every inbound record
//!   held back for the caller to verify before it is stored;
//! - rendezvous (client on devices, server on infrastructure nodes);
//! - relay (server on infrastructure nodes, client everywhere);
//! - AutoNAT v2 (server on infrastructure nodes, client on devices) and
//!   DCUtR hole punching (devices), with the address policy of `reach`:
//!   only addresses a peer elsewhere can use are advertised;
//! - gossipsub with manual validation: nothing is forwarded until the caller
//!   accepts it.
//!
//! The crate does not parse frames, records or gossip payloads. It does not
//! know the DID document, and it does not decide who is trusted. It reports
//! the Ed25519 key behind each PeerId (Noise proved possession of it) and
//! leaves every verdict to the caller.
//!
//! Outbound frames to one peer go in order, one at a time: the next frame
//! leaves when the previous one was acknowledged. Every queue is bounded,
//! and so are connections (see [`ConnectionLimits`]).
//!
//! Backpressure never makes the actor and its owner wait on each other (see
//! `outbox`): the actor never awaits the event channel. When it is full,
//! connection lifecycle events wait in a bounded, ordered backlog, while
//! inbound frames, gossip and DHT or rendezvous results are dropped and
//! counted in [`NetCount`] (anti-entropy and repeated lookups heal them).
//! The owner never waits to send a frame or a publish: past a share of the
//! command queue they are dropped and counted; control commands keep order.
//!
//! This is the only crate that imports libp2p. It re-exports [`PeerId`],
//! [`Multiaddr`] and [`Protocol`] so that callers can name peers and
//! addresses without depending on libp2p themselves.

mod codec;
mod counts;
mod outbox;
pub mod reach;

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use futures::StreamExt;
use libp2p::core::ConnectedPoint;
use libp2p::core::transport::ListenerId;
use libp2p::request_response::{self, OutboundRequestId, ProtocolSupport};
use libp2p::swarm::behaviour::toggle::Toggle;
use libp2p::swarm::dial_opts::{DialOpts, PeerCondition};
use libp2p::swarm::{
    ConnectionDenied, ConnectionId, DialError, ListenError, NetworkBehaviour, SwarmEvent,
};
use libp2p::{
    StreamProtocol, Swarm, autonat, connection_limits, dcutr, gossipsub, identify, kad, noise,
    ping, relay, rendezvous, tcp, yamux,
};
use tokio::sync::mpsc::{self, error::TrySendError};
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, trace, warn};
use zeroize::Zeroizing;

pub use libp2p::multiaddr::Protocol;
pub use libp2p::{Multiaddr, PeerId};

use codec::FrameCodec;
pub use counts::NetCount;
use nuwa_counters::Counters;
use outbox::{Delivery, Outbox};
pub use reach::Scope;

/// The sync protocol id.
pub const SYNC_PROTOCOL: &str = "/nuwa/sync/1";
/// The private DHT's protocol id.
pub const KAD_PROTOCOL: &str = "/nuwa/kad/1.0.0";
/// identify's protocol version string.
pub const IDENTIFY_VERSION: &str = "/nuwa/id/1.0.0";
/// Largest gossip message; bigger deltas go over the sync stream.
pub const MAX_GOSSIP_BYTES: usize = 64 * 1024;
/// Gossip publishes held while no peer is subscribed yet.
const MAX_PENDING_PUBLISHES: usize = 1024;

/// Which optional behaviours run.
#[derive(Debug, Clone)]
pub struct Features {
    /// Private Kademlia DHT (server mode: answers queries and stores
    /// verified records).
    pub kad: bool,
    /// Rendezvous client (devices).
    pub rendezvous_client: bool,
    /// Gossipsub (devices).
    pub gossip: bool,
    /// AutoNAT v2 client and DCUtR hole punching (devices).
    pub nat_traversal: bool,
    /// Infrastructure node: rendezvous server, relay server and AutoNAT v2
    /// server.
    pub infrastructure: Option<InfraLimits>,
}

impl Default for Features {
    fn default() -> Self {
        Features {
            kad: true,
            rendezvous_client: true,
            gossip: true,
            nat_traversal: true,
            infrastructure: None,
        }
    }
}

/// Bounds of an infrastructure node, so that floods degrade nothing for
/// honest agents.
#[derive(Debug, Clone)]
pub struct InfraLimits {
    pub rendezvous_min_ttl_secs: u64,
    pub rendezvous_max_ttl_secs: u64,
    pub max_registrations_per_peer: usize,
    pub max_registrations_total: usize,
    pub max_relay_reservations: usize,
    pub max_relay_reservations_per_peer: usize,
    pub max_relay_circuits: usize,
    pub max_relay_circuits_per_peer: usize,
    /// How long one relayed circuit may live.
    pub max_circuit_duration: Duration,
    /// Bytes one relayed circuit may carry, both directions together.
    pub max_circuit_bytes: u64,
}

impl Default for InfraLimits {
    /// The relay carries signalling and small deltas between two devices of
    /// one agent until hole punching makes the link direct, and everything
    /// for the devices that cannot punch (symmetric NATs). Sized for that
    /// (see ARCHITECTURE.md, "Relay limits"): a circuit lives an hour, so an
    /// idle link is not cut every 2 minutes as with libp2p's defaults; it
    /// carries 16 MiB, twice the largest frame, so one frame always fits in
    /// a fresh circuit, while idle traffic (Hellos, heads rounds, pings)
    /// stays near 1 MiB an hour.
    fn default() -> Self {
        InfraLimits {
            rendezvous_min_ttl_secs: 60,
            rendezvous_max_ttl_secs: 72 * 3600,
            max_registrations_per_peer: 16,
            max_registrations_total: 100_000,
            max_relay_reservations: 1024,
            max_relay_reservations_per_peer: 4,
            max_relay_circuits: 1024,
            max_relay_circuits_per_peer: 8,
            max_circuit_duration: Duration::from_secs(3600),
            max_circuit_bytes: 16 * 1024 * 1024,
        }
    }
}

/// Caps on connections, checked by libp2p before a connection is used.
/// Connections over a cap are refused and counted
/// ([`NetCount::ConnectionsRefused`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnectionLimits {
    /// Inbound connections still in their handshake.
    pub max_pending_incoming: u32,
    /// Outbound dials still in their handshake.
    pub max_pending_outgoing: u32,
    pub max_established_incoming: u32,
    /// Inbound and outbound together.
    pub max_established_total: u32,
    /// Connections to one peer, both directions together.
    pub max_established_per_peer: u32,
}

impl ConnectionLimits {
    /// A device talks to the 2-20 devices of its agent plus a few
    /// introducers. Two connections to one peer are normal (both dialed at
    /// once, or a relayed one next to a direct one); more are a fault or a
    /// flood.
    pub fn device() -> Self {
        ConnectionLimits {
            max_pending_incoming: 32,
            max_pending_outgoing: 64,
            max_established_incoming: 128,
            max_established_total: 192,
            max_established_per_peer: 4,
        }
    }

    /// An infrastructure node serves many agents' devices: every relay
    /// reservation and DHT or rendezvous client holds a connection.
    pub fn infrastructure() -> Self {
        ConnectionLimits {
            max_pending_incoming: 512,
            max_pending_outgoing: 256,
            max_established_incoming: 4096,
            max_established_total: 4352,
            max_established_per_peer: 8,
        }
    }

    fn to_libp2p(self) -> connection_limits::ConnectionLimits {
        connection_limits::ConnectionLimits::default()
            .with_max_pending_incoming(Some(self.max_pending_incoming))
            .with_max_pending_outgoing(Some(self.max_pending_outgoing))
            .with_max_established_incoming(Some(self.max_established_incoming))
            .with_max_established(Some(self.max_established_total))
            .with_max_established_per_peer(Some(self.max_established_per_peer))
    }
}

/// Tunables of the network actor.
#[derive(Debug, Clone)]
pub struct NetConfig {
    pub listen: Vec<Multiaddr>,
    /// Largest frame accepted or sent.
    pub max_frame_bytes: usize,
    /// Frames queued per peer before new ones are dropped.
    pub max_queue_per_peer: usize,
    pub request_timeout: Duration,
    pub idle_connection_timeout: Duration,
    pub features: Features,
    /// `None`: [`ConnectionLimits::device`], or
    /// [`ConnectionLimits::infrastructure`] when `features.infrastructure`
    /// is set.
    pub connection_limits: Option<ConnectionLimits>,
    /// Scopes of listen addresses advertised without confirmation (see
    /// `reach`). `None`: [`reach::listen_scopes`] with no infrastructure,
    /// plus public addresses on an infrastructure node.
    pub advertise_listen: Option<Vec<Scope>>,
    /// Frames bigger than this wait for a direct connection while a peer is
    /// reachable only through a relay ...
    pub relay_defer_bytes: usize,
    /// ... for at most this long after the relayed connection came up
    /// (long enough for hole punching); then they go over the relay.
    pub relay_direct_grace: Duration,
}

impl Default for NetConfig {
    fn default() -> Self {
        NetConfig {
            listen: Vec::new(),
            max_frame_bytes: 8 * 1024 * 1024,
            max_queue_per_peer: 4096,
            request_timeout: Duration::from_secs(30),
            idle_connection_timeout: Duration::from_secs(120),
            features: Features::default(),
            connection_limits: None,
            advertise_listen: None,
            relay_defer_bytes: 64 * 1024,
            relay_direct_grace: Duration::from_secs(20),
        }
    }
}

impl NetConfig {
    /// The connection caps in force: the configured ones, else the role's.
    pub fn connection_limits(&self) -> ConnectionLimits {
        self.connection_limits
            .unwrap_or_else(|| match self.features.infrastructure {
                Some(_) => ConnectionLimits::infrastructure(),
                None => ConnectionLimits::device(),
            })
    }
}

/// A peer found at a rendezvous server (its signed peer record proved the
/// addresses belong to the PeerId; membership is the caller's check).
#[derive(Debug, Clone)]
pub struct Registration {
    pub peer: PeerId,
    pub addrs: Vec<Multiaddr>,
    pub namespace: String,
    pub ttl_secs: u64,
}

/// Opaque id of a gossip message, for reporting the validation verdict.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GossipId {
    id: gossipsub::MessageId,
    propagation_source: PeerId,
}

/// What the network reports.
#[derive(Debug)]
#[non_exhaustive]
pub enum NetEvent {
    Listening(Multiaddr),
    /// First connection to `peer` is up. `public` is the Ed25519 key behind
    /// its PeerId (None for non-Ed25519 identities, which callers reject).
    Connected {
        peer: PeerId,
        public: Option<[u8; 32]>,
        remote: Multiaddr,
    },
    /// Last connection to `peer` closed.
    Disconnected {
        peer: PeerId,
    },
    /// A frame arrived on `/nuwa/sync/1`.
    Frame {
        peer: PeerId,
        frame: Vec<u8>,
    },
    /// A frame to `peer` was not delivered.
    SendFailed {
        peer: PeerId,
        reason: String,
    },
    /// A peer sent something unreadable.
    InboundError {
        peer: PeerId,
        reason: String,
    },
    DialFailed {
        peer: Option<PeerId>,
        reason: String,
    },
    /// identify told us a peer's listen addresses (already fed to the DHT).
    Identified {
        peer: PeerId,
        listen_addrs: Vec<Multiaddr>,
    },
    /// A peer asks us to store a DHT record. It is stored only if the caller
    /// calls [`NetHandle::kad_store`] after verifying it.
    KadInboundRecord {
        from: PeerId,
        key: Vec<u8>,
        value: Vec<u8>,
    },
    /// A DHT record found by [`NetHandle::kad_get_record`].
    KadRecord {
        key: Vec<u8>,
        value: Vec<u8>,
    },
    /// Providers found by [`NetHandle::kad_get_providers`], with the
    /// addresses the routing table knows for them.
    KadProviders {
        key: Vec<u8>,
        providers: Vec<(PeerId, Vec<Multiaddr>)>,
    },
    /// A DHT bootstrap finished (or failed, with a reason).
    KadBootstrapped {
        ok: bool,
        reason: String,
    },
    RendezvousDiscovered {
        server: PeerId,
        registrations: Vec<Registration>,
    },
    RendezvousRegistered {
        server: PeerId,
        namespace: String,
        ttl_secs: u64,
    },
    RendezvousFailed {
        server: PeerId,
        reason: String,
    },
    /// A gossip message awaiting the caller's verdict
    /// ([`NetHandle::gossip_report`]). `author` is the verified signer.
    GossipMessage {
        id: GossipId,
        author: Option<PeerId>,
        topic: String,
        data: Vec<u8>,
    },
    /// A peer subscribed to a topic we are on.
    GossipSubscribed {
        peer: PeerId,
        topic: String,
    },
    /// The addresses we advertise (identify, rendezvous, the DHT) changed;
    /// this is the whole new set. Re-register and republish on it.
    ExternalAddrs(Vec<Multiaddr>),
    /// An AutoNAT v2 server tested whether `addr` is reachable from it.
    AutonatTested {
        server: PeerId,
        addr: Multiaddr,
        reachable: bool,
        reason: String,
    },
    /// A relay accepted (or renewed) our reservation: we are reachable
    /// through it.
    RelayReserved {
        relay: PeerId,
        renewal: bool,
    },
    /// Our reservation on `relay` ended (the relay refused it, or the
    /// connection to it closed). Reserve again to stay reachable.
    RelayClosed {
        relay: PeerId,
        reason: String,
    },
    /// The connection used for `peer` changed (a direct one replaced a
    /// relayed one, or the better one closed): `remote` is the one in use.
    PathChanged {
        peer: PeerId,
        remote: Multiaddr,
    },
    /// A ping to `peer` came back after `rtt`.
    Rtt {
        peer: PeerId,
        rtt: std::time::Duration,
    },
    /// A hole punch to `peer` (DCUtR) finished.
    HolePunch {
        peer: PeerId,
        ok: bool,
        reason: String,
    },
}

/// Why the network could not start or a command failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum NetError {
    #[error("invalid device key for the libp2p identity: {0}")]
    Key(String),
    #[error("could not build the transport: {0}")]
    Transport(String),
    #[error("could not listen on {addr}: {reason}")]
    Listen { addr: Multiaddr, reason: String },
    #[error("the network task has stopped")]
    Stopped,
    /// Data (a frame or a publish) was dropped because the network's
    /// command queue holds its share already; anti-entropy re-sends it.
    #[error(
        "the network is behind; the {0} was dropped (it is counted, and re-sent by anti-entropy)"
    )]
    Behind(&'static str),
}

impl Delivery for NetEvent {
    fn must_deliver(&self) -> bool {
        // What nothing repeats: the owner's picture of who is connected and
        // where we listen. identify reports again only when addresses change.
        matches!(
            self,
            NetEvent::Listening(_)
                | NetEvent::Connected { .. }
                | NetEvent::Disconnected { .. }
                | NetEvent::Identified { .. }
                | NetEvent::ExternalAddrs(_)
                | NetEvent::RelayClosed { .. }
                | NetEvent::PathChanged { .. }
        )
    }
}

/// The PeerId of an Ed25519 public key (a device key is its libp2p identity).
pub fn peer_id_from_public(public: &[u8; 32]) -> Result<PeerId, NetError> {
    let key = libp2p::identity::ed25519::PublicKey::try_from_bytes(public)
        .map_err(|e| NetError::Key(e.to_string()))?;
    Ok(libp2p::identity::PublicKey::from(key).to_peer_id())
}

/// The Ed25519 public key behind a PeerId, if it is an inlined Ed25519 key.
pub fn public_from_peer_id(peer: &PeerId) -> Option<[u8; 32]> {
    let mh: &libp2p::multihash::Multihash<64> = peer.as_ref();
    // Code 0 is the identity multihash: the digest is the encoded key itself.
    if mh.code() != 0 {
        return None;
    }
    let key = libp2p::identity::PublicKey::try_decode_protobuf(mh.digest()).ok()?;
    Some(key.try_into_ed25519().ok()?.to_bytes())
}

/// The PeerId in a multiaddr's `/p2p/` component, if any.
pub fn peer_of(addr: &Multiaddr) -> Option<PeerId> {
    addr.iter().find_map(|p| match p {
        Protocol::P2p(id) => Some(id),
        _ => None,
    })
}

/// How a connection to `addr` (its remote address) travels: the transport
/// it rides on and whether it goes through a relay circuit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Path {
    /// `tcp`, `quic`, `websocket`, or `other`.
    pub transport: &'static str,
    /// Through a `/p2p-circuit` relay.
    pub relayed: bool,
}

/// The [`Path`] of a connection from its remote address.
pub fn path_of(addr: &Multiaddr) -> Path {
    let mut transport = "other";
    let mut relayed = false;
    for p in addr.iter() {
        match p {
            Protocol::P2pCircuit => relayed = true,
            // The first transport is the one to the relay, if any.
            Protocol::Tcp(_) if transport == "other" => transport = "tcp",
            Protocol::Quic | Protocol::QuicV1 if transport == "other" => transport = "quic",
            Protocol::Ws(_) | Protocol::Wss(_) => transport = "websocket",
            _ => {}
        }
    }
    Path { transport, relayed }
}

#[derive(NetworkBehaviour)]
struct Behaviour {
    // First, so that a refused connection gets no handler from the others.
    limits: connection_limits::Behaviour,
    sync: request_response::Behaviour<FrameCodec>,
    identify: identify::Behaviour,
    ping: ping::Behaviour,
    kad: Toggle<kad::Behaviour<kad::store::MemoryStore>>,
    rendezvous: Toggle<rendezvous::client::Behaviour>,
    rendezvous_server: Toggle<rendezvous::server::Behaviour>,
    relay_server: Toggle<relay::Behaviour>,
    relay_client: relay::client::Behaviour,
    autonat_client: Toggle<autonat::v2::client::Behaviour>,
    autonat_server: Toggle<autonat::v2::server::Behaviour>,
    dcutr: Toggle<dcutr::Behaviour>,
    gossip: Toggle<gossipsub::Behaviour>,
}

enum Command {
    Dial {
        peer: Option<PeerId>,
        addrs: Vec<Multiaddr>,
        /// Dial from the listening port (see [`NetHandle::dial_infra`]).
        reuse_port: bool,
    },
    ReserveRelay {
        relay: PeerId,
        addr: Multiaddr,
    },
    ReleaseRelay {
        relay: PeerId,
    },
    Send {
        peer: PeerId,
        frame: Vec<u8>,
    },
    Disconnect {
        peer: PeerId,
    },
    AddAddress {
        peer: PeerId,
        addr: Multiaddr,
    },
    KadBootstrap,
    KadPut {
        key: Vec<u8>,
        value: Vec<u8>,
    },
    KadStore {
        key: Vec<u8>,
        value: Vec<u8>,
    },
    KadGet {
        key: Vec<u8>,
    },
    KadProvide {
        key: Vec<u8>,
    },
    KadGetProviders {
        key: Vec<u8>,
    },
    RendezvousRegister {
        server: PeerId,
        namespace: String,
        ttl_secs: u64,
    },
    RendezvousDiscover {
        server: PeerId,
        namespace: String,
    },
    GossipSubscribe {
        topic: String,
    },
    GossipPublish {
        topic: String,
        data: Vec<u8>,
    },
    GossipReport {
        id: GossipId,
        accept: bool,
    },
}

/// Handle to the network actor. Dropping every handle stops the actor.
#[derive(Clone)]
pub struct NetHandle {
    tx: mpsc::Sender<Command>,
    local_peer_id: PeerId,
    counters: Counters<NetCount>,
    /// Commands issued through any handle: not an operator's metric, but
    /// how a test sees whether its code drove the network at a given moment.
    commands: Arc<AtomicU64>,
}

impl NetHandle {
    pub fn local_peer_id(&self) -> PeerId {
        self.local_peer_id
    }

    /// The network's counters (see [`NetCount`]), live: the returned set
    /// shares its values with the actor.
    pub fn counters(&self) -> Counters<NetCount> {
        self.counters.clone()
    }

    /// Commands the owner issued through the handle (sends, dials, ...),
    /// counted as they are issued, before the actor sees them.
    pub fn commands_issued(&self) -> u64 {
        self.commands.load(Ordering::Relaxed)
    }

    /// A handle with no swarm behind it: commands are counted
    /// ([`NetHandle::commands_issued`]) and dropped. For tests of code that
    /// drives the network and must be observed doing so (or not) at a given
    /// moment. Needs a tokio runtime.
    pub fn detached(local_peer_id: PeerId) -> NetHandle {
        let (tx, mut rx) = mpsc::channel::<Command>(outbox::COMMAND_QUEUE);
        tokio::spawn(async move { while rx.recv().await.is_some() {} });
        NetHandle {
            tx,
            local_peer_id,
            counters: Counters::new(),
            commands: Arc::default(),
        }
    }

    /// A control command: never dropped, and queued behind everything sent
    /// before it. It waits only if the command queue is full of control
    /// commands (data fills at most `DATA_SHARE` of it), and that wait ends
    /// because the actor never waits on its owner (see `outbox`).
    async fn cmd(&self, c: Command) -> Result<(), NetError> {
        // Counted when issued, before the actor sees it.
        self.commands.fetch_add(1, Ordering::Relaxed);
        self.tx.send(c).await.map_err(|_| NetError::Stopped)
    }

    /// A data command (a frame, a publish): queued at once or dropped and
    /// counted in `dropped`, never waited for.
    fn data(&self, c: Command, what: &'static str, dropped: NetCount) -> Result<(), NetError> {
        self.commands.fetch_add(1, Ordering::Relaxed);
        let queued = self.tx.max_capacity() - self.tx.capacity();
        if queued >= outbox::DATA_SHARE {
            self.counters.inc(dropped);
            return Err(NetError::Behind(what));
        }
        match self.tx.try_send(c) {
            Ok(()) => Ok(()),
            Err(TrySendError::Full(_)) => {
                self.counters.inc(dropped);
                Err(NetError::Behind(what))
            }
            Err(TrySendError::Closed(_)) => Err(NetError::Stopped),
        }
    }

    /// Dials `addrs` (of `peer`, when known; a connected or dialing peer is
    /// not dialed again). Every command method is cancel safe: a cancelled
    /// call sends nothing.
    pub async fn dial(&self, peer: Option<PeerId>, addrs: Vec<Multiaddr>) -> Result<(), NetError> {
        self.cmd(Command::Dial {
            peer,
            addrs,
            reuse_port: false,
        })
        .await
    }

    /// Dials an infrastructure node from our listening port, so that the
    /// NAT mapping it observes (identify) is the one hole punching needs,
    /// and over every transport in `addrs` we are not connected on yet (a
    /// QUIC connection next to a TCP one gives a UDP mapping to punch
    /// with).
    pub async fn dial_infra(&self, peer: PeerId, addrs: Vec<Multiaddr>) -> Result<(), NetError> {
        self.cmd(Command::Dial {
            peer: Some(peer),
            addrs,
            reuse_port: true,
        })
        .await
    }

    /// Reserves a circuit on `relay` (reached at `addr`), so that peers that
    /// cannot dial us directly reach us through it. The circuit address is
    /// advertised once the relay accepts ([`NetEvent::RelayReserved`]).
    pub async fn reserve_relay(&self, relay: PeerId, addr: Multiaddr) -> Result<(), NetError> {
        self.cmd(Command::ReserveRelay { relay, addr }).await
    }

    /// Gives up our reservation on `relay`.
    pub async fn release_relay(&self, relay: PeerId) -> Result<(), NetError> {
        self.cmd(Command::ReleaseRelay { relay }).await
    }

    /// Queues `frame` for `peer` on `/nuwa/sync/1`; the same as
    /// [`NetHandle::try_send`], for callers that `.await` every command.
    /// Never waits.
    pub async fn send(&self, peer: PeerId, frame: Vec<u8>) -> Result<(), NetError> {
        self.try_send(peer, frame)
    }

    /// Queues `frame` for `peer` without waiting. When the network is behind
    /// (the command queue holds its share of data already) the frame is
    /// dropped, counted in [`NetCount::OutboundFramesDropped`], and
    /// [`NetError::Behind`] returned: frames carry state that anti-entropy
    /// re-sends, so dropping one is cheaper than stalling the caller.
    pub fn try_send(&self, peer: PeerId, frame: Vec<u8>) -> Result<(), NetError> {
        self.data(
            Command::Send { peer, frame },
            "frame",
            NetCount::OutboundFramesDropped,
        )
    }

    /// Closes every connection to `peer`.
    pub async fn disconnect(&self, peer: PeerId) -> Result<(), NetError> {
        self.cmd(Command::Disconnect { peer }).await
    }

    /// Tells the swarm and the DHT where `peer` can be reached.
    pub async fn add_address(&self, peer: PeerId, addr: Multiaddr) -> Result<(), NetError> {
        self.cmd(Command::AddAddress { peer, addr }).await
    }

    pub async fn kad_bootstrap(&self) -> Result<(), NetError> {
        self.cmd(Command::KadBootstrap).await
    }

    /// Stores a record locally and replicates it to the closest peers.
    pub async fn kad_put_record(&self, key: Vec<u8>, value: Vec<u8>) -> Result<(), NetError> {
        self.cmd(Command::KadPut { key, value }).await
    }

    /// Stores an inbound record the caller has verified.
    pub async fn kad_store(&self, key: Vec<u8>, value: Vec<u8>) -> Result<(), NetError> {
        self.cmd(Command::KadStore { key, value }).await
    }

    pub async fn kad_get_record(&self, key: Vec<u8>) -> Result<(), NetError> {
        self.cmd(Command::KadGet { key }).await
    }

    pub async fn kad_start_providing(&self, key: Vec<u8>) -> Result<(), NetError> {
        self.cmd(Command::KadProvide { key }).await
    }

    pub async fn kad_get_providers(&self, key: Vec<u8>) -> Result<(), NetError> {
        self.cmd(Command::KadGetProviders { key }).await
    }

    pub async fn rendezvous_register(
        &self,
        server: PeerId,
        namespace: String,
        ttl_secs: u64,
    ) -> Result<(), NetError> {
        self.cmd(Command::RendezvousRegister {
            server,
            namespace,
            ttl_secs,
        })
        .await
    }

    pub async fn rendezvous_discover(
        &self,
        server: PeerId,
        namespace: String,
    ) -> Result<(), NetError> {
        self.cmd(Command::RendezvousDiscover { server, namespace })
            .await
    }

    pub async fn gossip_subscribe(&self, topic: String) -> Result<(), NetError> {
        self.cmd(Command::GossipSubscribe { topic }).await
    }

    /// Publishes on `topic`. Before any peer has subscribed the message is
    /// held (bounded) and published when one does. Never waits: like
    /// [`NetHandle::try_send`], a publish is dropped when the network is
    /// behind, counted in [`NetCount::GossipPublishDropped`].
    pub async fn gossip_publish(&self, topic: String, data: Vec<u8>) -> Result<(), NetError> {
        self.data(
            Command::GossipPublish { topic, data },
            "gossip publish",
            NetCount::GossipPublishDropped,
        )
    }

    /// The verdict on a gossip message: accepted messages are forwarded,
    /// rejected ones are dropped and their sender penalised.
    pub async fn gossip_report(&self, id: GossipId, accept: bool) -> Result<(), NetError> {
        self.cmd(Command::GossipReport { id, accept }).await
    }
}

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
}

/// One open connection to a peer.
struct Conn {
    id: ConnectionId,
    remote: Multiaddr,
    relayed: bool,
    since: tokio::time::Instant,
}

struct Actor {
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
}

/// How long relayed connections stay open next to a new direct one at most:
/// frames already under way on them finish first.
const RELAYED_CLOSE_GRACE: Duration = Duration::from_secs(10);

fn gossip_config() -> Result<gossipsub::Config, NetError> {
    // Sized for the 2-20 devices of one agent: a small mesh, fast
    // heartbeats, and flood publishing so a fresh message reaches every
    // connected sibling at once.
    gossipsub::ConfigBuilder::default()
        .validation_mode(gossipsub::ValidationMode::Strict)
        .validate_messages()
        .mesh_n(4)
        .mesh_n_low(2)
        .mesh_n_high(8)
        .mesh_outbound_min(1)
        .gossip_lazy(3)
        .heartbeat_interval(Duration::from_millis(500))
        .max_transmit_size(MAX_GOSSIP_BYTES + 1024)
        .message_id_fn(|m: &gossipsub::Message| {
            // Content-addressed ids: the same envelope is one message, even
            // if published twice.
            use std::hash::{Hash, Hasher};
            let mut h = std::collections::hash_map::DefaultHasher::new();
            m.data.hash(&mut h);
            m.source.hash(&mut h);
            gossipsub::MessageId::from(h.finish().to_be_bytes().to_vec())
        })
        .build()
        .map_err(|e| NetError::Transport(format!("gossipsub config: {e}")))
}

/// Starts the network actor with the device's Ed25519 seed as identity.
pub async fn spawn(
    seed: Zeroizing<[u8; 32]>,
    config: NetConfig,
    cancel: CancellationToken,
) -> Result<(NetHandle, mpsc::Receiver<NetEvent>), NetError> {
    let mut seed_copy = *seed;
    // `ed25519_from_bytes` zeroizes the buffer it is given.
    let keypair = libp2p::identity::Keypair::ed25519_from_bytes(&mut seed_copy)
        .map_err(|e| NetError::Key(e.to_string()))?;
    let counters = Counters::<NetCount>::new();
    let codec = FrameCodec {
        max_frame_bytes: config.max_frame_bytes,
        counters: counters.clone(),
    };
    let rr_config = request_response::Config::default()
        .with_request_timeout(config.request_timeout)
        .with_max_concurrent_streams(256);
    let idle = config.idle_connection_timeout;
    let limits = config.connection_limits().to_libp2p();
    let features = config.features.clone();
    let gossip_cfg = if features.gossip {
        Some(gossip_config()?)
    } else {
        None
    };
    let mut swarm = libp2p::SwarmBuilder::with_existing_identity(keypair)
        .with_tokio()
        .with_tcp(
            tcp::Config::default().nodelay(true),
            noise::Config::new,
            yamux::Config::default,
        )
        .map_err(|e| NetError::Transport(e.to_string()))?
        .with_quic()
        .with_relay_client(noise::Config::new, yamux::Config::default)
        .map_err(|e| NetError::Transport(e.to_string()))?
        .with_behaviour(|key, relay_client| {
            let peer = key.public().to_peer_id();
            let kad = features.kad.then(|| {
                let mut cfg = kad::Config::new(StreamProtocol::new(KAD_PROTOCOL));
                cfg.set_record_filtering(kad::StoreInserts::FilterBoth);
                cfg.set_query_timeout(Duration::from_secs(10));
                cfg.set_periodic_bootstrap_interval(Some(Duration::from_secs(60)));
                let store_cfg = kad::store::MemoryStoreConfig {
                    max_records: 4096,
                    max_provided_keys: 1024,
                    max_providers_per_key: 64,
                    ..Default::default()
                };
                let store = kad::store::MemoryStore::with_config(peer, store_cfg);
                let mut k = kad::Behaviour::with_config(peer, store, cfg);
                // Client until we advertise a direct address (see
                // `Actor::on_external_change`): a device nobody can dial
                // must not enter others' routing tables. Infrastructure
                // nodes serve from the start.
                k.set_mode(Some(if features.infrastructure.is_some() {
                    kad::Mode::Server
                } else {
                    kad::Mode::Client
                }));
                k
            });
            let infra = features.infrastructure.clone();
            let rendezvous_server = infra.as_ref().map(|l| {
                rendezvous::server::Behaviour::new(
                    rendezvous::server::Config::default()
                        .with_min_ttl(l.rendezvous_min_ttl_secs)
                        .with_max_ttl(l.rendezvous_max_ttl_secs)
                        .with_max_registration_per_peer(l.max_registrations_per_peer)
                        .with_max_registration_total(l.max_registrations_total),
                )
            });
            let relay_server = infra.as_ref().map(|l| {
                relay::Behaviour::new(
                    peer,
                    relay::Config {
                        max_reservations: l.max_relay_reservations,
                        max_reservations_per_peer: l.max_relay_reservations_per_peer,
                        max_circuits: l.max_relay_circuits,
                        max_circuits_per_peer: l.max_relay_circuits_per_peer,
                        max_circuit_duration: l.max_circuit_duration,
                        max_circuit_bytes: l.max_circuit_bytes,
                        // Rate limits per peer and per IP: libp2p's defaults.
                        ..relay::Config::default()
                    },
                )
            });
            let autonat_server = infra
                .as_ref()
                .map(|_| autonat::v2::server::Behaviour::default());
            let traversal = features.nat_traversal && infra.is_none();
            // Tests a candidate every 5 s (libp2p's default).
            let autonat_client = traversal.then(autonat::v2::client::Behaviour::default);
            let dcutr = traversal.then(|| dcutr::Behaviour::new(peer));
            let gossip = match gossip_cfg {
                Some(cfg) => Some(gossipsub::Behaviour::new(
                    gossipsub::MessageAuthenticity::Signed(key.clone()),
                    cfg,
                )?),
                None => None,
            };
            Ok(Behaviour {
                limits: connection_limits::Behaviour::new(limits),
                sync: request_response::Behaviour::with_codec(
                    codec,
                    [(StreamProtocol::new(SYNC_PROTOCOL), ProtocolSupport::Full)],
                    rr_config,
                ),
                // Only the external addresses (see `reach`): listen
                // addresses include loopback and private ones nobody
                // elsewhere can use.
                identify: identify::Behaviour::new(
                    identify::Config::new(IDENTIFY_VERSION.to_owned(), key.public())
                        .with_cache_size(256)
                        .with_hide_listen_addrs(true),
                ),
                // Detect dead links within ~15 s so partitions are noticed and
                // healed by redialing, not hidden behind TCP retransmits.
                ping: ping::Behaviour::new(
                    ping::Config::new()
                        .with_interval(Duration::from_secs(5))
                        .with_timeout(Duration::from_secs(10)),
                ),
                kad: kad.into(),
                rendezvous: features
                    .rendezvous_client
                    .then(|| rendezvous::client::Behaviour::new(key.clone()))
                    .into(),
                rendezvous_server: rendezvous_server.into(),
                relay_server: relay_server.into(),
                relay_client,
                autonat_client: autonat_client.into(),
                autonat_server: autonat_server.into(),
                dcutr: dcutr.into(),
                gossip: gossip.into(),
            })
        })
        .map_err(|e| NetError::Transport(e.to_string()))?
        .with_swarm_config(|c| c.with_idle_connection_timeout(idle))
        .build();
    for addr in &config.listen {
        swarm
            .listen_on(addr.clone())
            .map_err(|e| NetError::Listen {
                addr: addr.clone(),
                reason: e.to_string(),
            })?;
    }
    let local_peer_id = *swarm.local_peer_id();
    let (cmd_tx, cmd_rx) = mpsc::channel(outbox::COMMAND_QUEUE);
    let (ev_tx, ev_rx) = mpsc::channel(outbox::EVENT_QUEUE);
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
    let actor = Actor {
        swarm,
        events: Outbox::new(ev_tx, outbox::MAX_BACKLOG),
        queues: BTreeMap::new(),
        config,
        counters: counters.clone(),
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
    };
    tokio::spawn(tracing::Instrument::instrument(
        actor.run(cmd_rx, cancel),
        tracing::info_span!("net", peer = %local_peer_id),
    ));
    Ok((
        NetHandle {
            tx: cmd_tx,
            local_peer_id,
            counters,
            commands: Arc::default(),
        },
        ev_rx,
    ))
}

impl Actor {
    async fn run(mut self, mut commands: mpsc::Receiver<Command>, cancel: CancellationToken) {
        // Frames held for a direct connection are looked at again each
        // second (their grace may have run out).
        let mut deferred = tokio::time::interval(Duration::from_secs(1));
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

    fn on_command(&mut self, cmd: Command) {
        match cmd {
            Command::Dial {
                peer,
                addrs,
                reuse_port,
            } => {
                if peer == Some(*self.swarm.local_peer_id()) {
                    self.counters.inc(NetCount::SelfDialsSkipped);
                    return;
                }
                // Never our own listeners: a peer advertising a loopback
                // address would make us dial ourselves.
                let before = addrs.len();
                let addrs: Vec<Multiaddr> = addrs
                    .into_iter()
                    .filter(|a| {
                        reach::socket_of(a).is_none_or(|s| !self.own_sockets.contains(&s))
                            && !reach::is_unspecified(a)
                            && peer_of(a) != Some(*self.swarm.local_peer_id())
                    })
                    .collect();
                if addrs.len() < before {
                    self.counters.inc(NetCount::SelfDialsSkipped);
                }
                if addrs.is_empty() {
                    return;
                }
                let opts = match peer {
                    // Infrastructure: from the listening port, and over any
                    // transport we have no connection on yet.
                    Some(peer) if reuse_port => {
                        let have: BTreeSet<&'static str> = self
                            .conns
                            .get(&peer)
                            .map(|cs| {
                                cs.iter()
                                    .filter(|c| !c.relayed)
                                    .map(|c| path_of(&c.remote).transport)
                                    .collect()
                            })
                            .unwrap_or_default();
                        let addrs: Vec<Multiaddr> = addrs
                            .into_iter()
                            .filter(|a| !have.contains(path_of(a).transport))
                            .collect();
                        if addrs.is_empty() {
                            return;
                        }
                        let condition = if have.is_empty() {
                            PeerCondition::DisconnectedAndNotDialing
                        } else {
                            PeerCondition::NotDialing
                        };
                        DialOpts::peer_id(peer)
                            .addresses(addrs)
                            .condition(condition)
                            .build()
                    }
                    // Devices: a fresh source port. Reusing the listening
                    // port lets two devices that dial each other at the
                    // same instant (both found by mDNS) end up in one TCP
                    // connection (simultaneous open) where both are the
                    // Noise initiator and both handshakes fail. Hole
                    // punching (DCUtR) dials from the listening port by
                    // itself.
                    Some(peer) => DialOpts::peer_id(peer)
                        .addresses(addrs)
                        .condition(PeerCondition::DisconnectedAndNotDialing)
                        .allocate_new_port()
                        .build(),
                    None => match addrs.into_iter().next() {
                        Some(addr) => DialOpts::unknown_peer_id()
                            .address(addr)
                            .allocate_new_port()
                            .build(),
                        None => return,
                    },
                };
                if let Err(e) = self.swarm.dial(opts) {
                    if let DialError::Denied { cause } = &e {
                        self.count_refused(cause);
                    }
                    // "already connected/dialing" is expected and harmless.
                    trace!(?peer, error = %e, "dial not started");
                }
            }
            Command::Send { peer, frame } => {
                let max = self.config.max_queue_per_peer;
                let q = self.queues.entry(peer).or_default();
                if q.queue.len() >= max {
                    // Counted; per frame this would flood the log.
                    debug!(%peer, max, "send queue full; frame dropped");
                    self.counters.inc(NetCount::OutboundFramesDropped);
                    self.emit(NetEvent::SendFailed {
                        peer,
                        reason: format!("send queue full ({max} frames)"),
                    });
                    return;
                }
                q.queue.push_back(frame);
                self.pump(peer);
            }
            Command::ReserveRelay { relay, addr } => {
                if self.relay_listeners.contains_key(&relay) {
                    return;
                }
                let mut circuit = addr;
                if peer_of(&circuit).is_none() {
                    circuit.push(Protocol::P2p(relay));
                }
                circuit.push(Protocol::P2pCircuit);
                match self.swarm.listen_on(circuit.clone()) {
                    Ok(id) => {
                        debug!(%relay, %circuit, "reserving a relay circuit");
                        self.relay_listeners.insert(relay, id);
                        self.listener_relays.insert(id, relay);
                    }
                    Err(e) => {
                        self.counters.inc(NetCount::RelayReservationsLost);
                        self.emit(NetEvent::RelayClosed {
                            relay,
                            reason: e.to_string(),
                        });
                    }
                }
            }
            Command::ReleaseRelay { relay } => {
                if let Some(id) = self.relay_listeners.remove(&relay) {
                    self.listener_relays.remove(&id);
                    self.swarm.remove_listener(id);
                }
            }
            Command::Disconnect { peer } => {
                self.queues.remove(&peer);
                let _ = self.swarm.disconnect_peer_id(peer);
            }
            Command::AddAddress { peer, addr } => {
                self.swarm.add_peer_address(peer, addr.clone());
                if let Some(k) = self.swarm.behaviour_mut().kad.as_mut() {
                    k.add_address(&peer, addr);
                }
            }
            Command::KadBootstrap => {
                if let Some(k) = self.swarm.behaviour_mut().kad.as_mut()
                    && let Err(e) = k.bootstrap()
                {
                    self.emit(NetEvent::KadBootstrapped {
                        ok: false,
                        reason: e.to_string(),
                    });
                }
            }
            Command::KadPut { key, value } => {
                if let Some(k) = self.swarm.behaviour_mut().kad.as_mut() {
                    let record = kad::Record::new(key, value);
                    if let Err(e) = k.put_record(record, kad::Quorum::One) {
                        debug!(error = %e, "dht put failed");
                    }
                }
            }
            Command::KadStore { key, value } => {
                if let Some(k) = self.swarm.behaviour_mut().kad.as_mut() {
                    use kad::store::RecordStore;
                    if let Err(e) = k.store_mut().put(kad::Record::new(key, value)) {
                        debug!(error = %e, "dht store refused a record");
                    }
                }
            }
            Command::KadGet { key } => {
                if let Some(k) = self.swarm.behaviour_mut().kad.as_mut() {
                    let id = k.get_record(kad::RecordKey::new(&key));
                    self.get_queries.insert(id, key);
                }
            }
            Command::KadProvide { key } => {
                if let Some(k) = self.swarm.behaviour_mut().kad.as_mut()
                    && let Err(e) = k.start_providing(kad::RecordKey::new(&key))
                {
                    debug!(error = %e, "dht start_providing failed");
                }
            }
            Command::KadGetProviders { key } => {
                if let Some(k) = self.swarm.behaviour_mut().kad.as_mut() {
                    let id = k.get_providers(kad::RecordKey::new(&key));
                    self.get_queries.insert(id, key);
                }
            }
            Command::RendezvousRegister {
                server,
                namespace,
                ttl_secs,
            } => {
                let Ok(ns) = rendezvous::Namespace::new(namespace) else {
                    return;
                };
                if let Some(r) = self.swarm.behaviour_mut().rendezvous.as_mut()
                    && let Err(e) = r.register(ns, server, Some(ttl_secs))
                {
                    self.emit(NetEvent::RendezvousFailed {
                        server,
                        reason: e.to_string(),
                    });
                }
            }
            Command::RendezvousDiscover { server, namespace } => {
                let Ok(ns) = rendezvous::Namespace::new(namespace) else {
                    return;
                };
                if let Some(r) = self.swarm.behaviour_mut().rendezvous.as_mut() {
                    r.discover(Some(ns), None, Some(256), server);
                }
            }
            Command::GossipSubscribe { topic } => {
                if let Some(g) = self.swarm.behaviour_mut().gossip.as_mut()
                    && let Err(e) = g.subscribe(&gossipsub::IdentTopic::new(topic))
                {
                    warn!(error = %e, "cannot subscribe");
                }
            }
            Command::GossipPublish { topic, data } => self.publish(topic, data),
            Command::GossipReport { id, accept } => {
                if let Some(g) = self.swarm.behaviour_mut().gossip.as_mut() {
                    let verdict = if accept {
                        gossipsub::MessageAcceptance::Accept
                    } else {
                        gossipsub::MessageAcceptance::Reject
                    };
                    g.report_message_validation_result(&id.id, &id.propagation_source, verdict);
                }
            }
        }
    }

    fn publish(&mut self, topic: String, data: Vec<u8>) {
        let Some(g) = self.swarm.behaviour_mut().gossip.as_mut() else {
            return;
        };
        match g.publish(gossipsub::IdentTopic::new(topic.clone()), data.clone()) {
            Ok(_) => {}
            Err(gossipsub::PublishError::NoPeersSubscribedToTopic) => {
                // Not lost: held until a peer subscribes (and anti-entropy
                // covers the rest).
                if self.pending_publishes.len() >= MAX_PENDING_PUBLISHES {
                    self.pending_publishes.pop_front();
                    self.counters.inc(NetCount::GossipPublishDropped);
                }
                self.pending_publishes.push_back((topic, data));
            }
            Err(gossipsub::PublishError::Duplicate) => {}
            Err(e) => {
                self.counters.inc(NetCount::GossipPublishDropped);
                debug!(error = %e, "gossip publish failed");
            }
        }
    }

    /// Whether every connection to `peer` is relayed, and since when the
    /// newest one is up.
    fn relayed_only(&self, peer: &PeerId) -> Option<tokio::time::Instant> {
        let cs = self.conns.get(peer)?;
        if cs.is_empty() || cs.iter().any(|c| !c.relayed) {
            return None;
        }
        cs.iter().map(|c| c.since).max()
    }

    /// Sends the next queued frame to `peer` if none is in flight. A frame
    /// too big for the relay waits while the peer is reachable only through
    /// one, for the grace that hole punching gets; then it goes anyway
    /// (behind a symmetric NAT the relay is all there is).
    fn pump(&mut self, peer: PeerId) {
        let relayed_since = self.relayed_only(&peer);
        let connected = self.swarm.is_connected(&peer);
        let Some(q) = self.queues.get_mut(&peer) else {
            return;
        };
        if q.in_flight.is_some() || !connected {
            return;
        }
        let Some(head) = q.queue.front() else {
            q.deferred = false;
            return;
        };
        if let Some(since) = relayed_since
            && head.len() > self.config.relay_defer_bytes
            && since.elapsed() < self.config.relay_direct_grace
        {
            if !q.deferred {
                q.deferred = true;
                self.counters.inc(NetCount::FramesDeferredForDirect);
            }
            return;
        }
        q.deferred = false;
        let Some(frame) = q.queue.pop_front() else {
            return;
        };
        let counter = if relayed_since.is_some() {
            NetCount::BytesSentRelayed
        } else {
            NetCount::BytesSentDirect
        };
        self.counters.add(counter, frame.len() as u64);
        // (frame, may it be sent again): not if this is already the retry.
        let is_retry = matches!(q.in_flight_frame.take(), Some((f, false)) if f == frame);
        q.in_flight_frame = Some((frame.clone(), !is_retry));
        q.in_flight = Some(self.swarm.behaviour_mut().sync.send_request(&peer, frame));
    }

    /// The connection in use for `peer`: the oldest direct one, else the
    /// oldest relayed one.
    fn best_remote(&self, peer: &PeerId) -> Option<Multiaddr> {
        let cs = self.conns.get(peer)?;
        cs.iter()
            .find(|c| !c.relayed)
            .or_else(|| cs.first())
            .map(|c| c.remote.clone())
    }

    /// Reports a change of the connection in use, and closes relayed
    /// connections once a direct one exists (request-response spreads
    /// requests over every connection, and the relay is for when there is
    /// no other way).
    fn on_paths_changed(&mut self, peer: PeerId) -> Vec<NetEvent> {
        let mut out = Vec::new();
        let Some(best) = self.best_remote(&peer) else {
            return out;
        };
        let has_relayed = self
            .conns
            .get(&peer)
            .is_some_and(|cs| cs.iter().any(|c| c.relayed));
        if !reach::is_relayed(&best) && has_relayed {
            self.relayed_to_close
                .entry(peer)
                .or_insert_with(|| tokio::time::Instant::now() + RELAYED_CLOSE_GRACE);
            self.close_relayed();
        }
        if self.reported_path.get(&peer) != Some(&best) {
            if self.reported_path.contains_key(&peer) {
                info!(%peer, remote = %best, "connection path changed");
                out.push(NetEvent::PathChanged {
                    peer,
                    remote: best.clone(),
                });
            }
            self.reported_path.insert(peer, best);
        }
        out
    }

    /// Closes relayed connections of peers that have a direct one, once no
    /// frame of ours is in flight to them (request-response may have put
    /// it on the relayed connection), or when the grace is over.
    fn close_relayed(&mut self) {
        let now = tokio::time::Instant::now();
        let peers: Vec<(PeerId, tokio::time::Instant)> = self
            .relayed_to_close
            .iter()
            .map(|(p, t)| (*p, *t))
            .collect();
        for (peer, deadline) in peers {
            let idle = self.queues.get(&peer).is_none_or(|q| q.in_flight.is_none());
            if !idle && now < deadline {
                continue;
            }
            self.relayed_to_close.remove(&peer);
            let relayed: Vec<ConnectionId> = self
                .conns
                .get(&peer)
                .map(|cs| cs.iter().filter(|c| c.relayed).map(|c| c.id).collect())
                .unwrap_or_default();
            for id in relayed {
                debug!(%peer, "direct connection up; closing the relayed one");
                self.swarm.close_connection(id);
            }
        }
    }

    /// Re-derives what we advertise after any swarm event: reports a
    /// changed set, and keeps Kademlia a server only while we advertise a
    /// direct address.
    fn on_external_change(&mut self) {
        let now: BTreeSet<Multiaddr> = self.swarm.external_addresses().cloned().collect();
        if now == self.reported_external {
            return;
        }
        info!(
            addrs = ?now.iter().map(|a| a.to_string()).collect::<Vec<_>>(),
            "advertised addresses changed"
        );
        if !self.infrastructure {
            let direct = now.iter().any(|a| !reach::is_relayed(a));
            if let Some(k) = self.swarm.behaviour_mut().kad.as_mut() {
                k.set_mode(Some(if direct {
                    kad::Mode::Server
                } else {
                    kad::Mode::Client
                }));
            }
        }
        self.reported_external = now.clone();
        self.emit(NetEvent::ExternalAddrs(now.into_iter().collect()));
    }

    fn on_swarm_event(&mut self, ev: SwarmEvent<BehaviourEvent>) -> Vec<NetEvent> {
        match ev {
            SwarmEvent::NewListenAddr {
                address,
                listener_id,
            } => {
                info!(%address, "listening");
                if let Some(s) = reach::socket_of(&address) {
                    self.own_sockets.insert(s);
                }
                // Advertise only what a peer elsewhere can use (`reach`):
                // a relay circuit we hold, every address of an
                // infrastructure node, and listen addresses of a scope the
                // owner vouched for. The rest waits for AutoNAT.
                // A circuit is as far-reaching as its relay's address (the
                // relay hands us all of its own, loopback included).
                let relayed = reach::is_relayed(&address);
                let advertise = !reach::is_unspecified(&address)
                    && ((relayed && reach::confirmed_is_advertisable(&address, &self.vouched))
                        || reach::scope_of(&address).is_some_and(|s| self.vouched.contains(&s)));
                if advertise {
                    self.swarm.add_external_address(address.clone());
                }
                if relayed && let Some(relay) = self.listener_relays.get(&listener_id) {
                    info!(%relay, %address, "reachable through a relay");
                }
                vec![NetEvent::Listening(address)]
            }
            SwarmEvent::ExpiredListenAddr { address, .. } => {
                self.swarm.remove_external_address(&address);
                vec![]
            }
            SwarmEvent::ListenerClosed {
                listener_id,
                addresses,
                reason,
            } => {
                for a in &addresses {
                    self.swarm.remove_external_address(a);
                }
                match self.listener_relays.remove(&listener_id) {
                    Some(relay) => {
                        self.relay_listeners.remove(&relay);
                        self.counters.inc(NetCount::RelayReservationsLost);
                        let reason = match reason {
                            Ok(()) => "closed".to_owned(),
                            Err(e) => e.to_string(),
                        };
                        info!(%relay, %reason, "relay reservation ended");
                        vec![NetEvent::RelayClosed { relay, reason }]
                    }
                    None => vec![],
                }
            }
            SwarmEvent::ExternalAddrConfirmed { address } => {
                if reach::confirmed_is_advertisable(&address, &self.vouched) {
                    info!(%address, "external address confirmed");
                } else {
                    debug!(%address, "confirmed address not advertised (loopback)");
                    self.swarm.remove_external_address(&address);
                }
                vec![]
            }
            SwarmEvent::ConnectionEstablished {
                peer_id,
                connection_id,
                endpoint,
                num_established,
                ..
            } => {
                let relayed = endpoint.is_relayed();
                let remote = match endpoint {
                    ConnectedPoint::Dialer { address, .. } => address,
                    // An inbound circuit's send-back address is only the
                    // peer's id; our circuit address names the relay and
                    // its transport.
                    ConnectedPoint::Listener { local_addr, .. } if relayed => local_addr,
                    ConnectedPoint::Listener { send_back_addr, .. } => send_back_addr,
                };
                self.conns.entry(peer_id).or_default().push(Conn {
                    id: connection_id,
                    remote: remote.clone(),
                    relayed,
                    since: tokio::time::Instant::now(),
                });
                if num_established.get() != 1 {
                    let out = self.on_paths_changed(peer_id);
                    self.pump(peer_id);
                    return out;
                }
                self.reported_path.insert(peer_id, remote.clone());
                self.pump(peer_id);
                vec![NetEvent::Connected {
                    peer: peer_id,
                    public: public_from_peer_id(&peer_id),
                    remote,
                }]
            }
            SwarmEvent::ConnectionClosed {
                peer_id,
                connection_id,
                num_established,
                ..
            } => {
                if let Some(cs) = self.conns.get_mut(&peer_id) {
                    cs.retain(|c| c.id != connection_id);
                }
                if num_established != 0 {
                    return self.on_paths_changed(peer_id);
                }
                self.conns.remove(&peer_id);
                self.reported_path.remove(&peer_id);
                self.relayed_to_close.remove(&peer_id);
                self.queues.remove(&peer_id);
                vec![NetEvent::Disconnected { peer: peer_id }]
            }
            SwarmEvent::OutgoingConnectionError { peer_id, error, .. } => {
                if let DialError::Denied { cause } = &error {
                    self.count_refused(cause);
                }
                vec![NetEvent::DialFailed {
                    peer: peer_id,
                    reason: error.to_string(),
                }]
            }
            SwarmEvent::IncomingConnectionError {
                error: ListenError::Denied { cause },
                send_back_addr,
                ..
            } => {
                if self.count_refused(&cause) {
                    debug!(remote = %send_back_addr, %cause, "inbound connection refused");
                }
                vec![]
            }
            SwarmEvent::Behaviour(ev) => self.on_behaviour_event(ev),
            _ => vec![],
        }
    }

    /// Counts a connection refused by [`ConnectionLimits`]; whether it was.
    fn count_refused(&self, cause: &ConnectionDenied) -> bool {
        let refused = cause
            .downcast_ref::<connection_limits::Exceeded>()
            .is_some();
        if refused {
            self.counters.inc(NetCount::ConnectionsRefused);
        }
        refused
    }

    fn on_behaviour_event(&mut self, ev: BehaviourEvent) -> Vec<NetEvent> {
        match ev {
            BehaviourEvent::Sync(ev) => self.on_sync_event(ev).into_iter().collect(),
            BehaviourEvent::Identify(identify::Event::Received { peer_id, info, .. }) => {
                let listen_addrs: Vec<Multiaddr> = info.listen_addrs.into_iter().take(32).collect();
                let speaks_kad = info.protocols.iter().any(|p| p.as_ref() == KAD_PROTOCOL);
                if speaks_kad && let Some(k) = self.swarm.behaviour_mut().kad.as_mut() {
                    for a in &listen_addrs {
                        k.add_address(&peer_id, a.clone());
                    }
                }
                for a in &listen_addrs {
                    self.swarm.add_peer_address(peer_id, a.clone());
                }
                vec![NetEvent::Identified {
                    peer: peer_id,
                    listen_addrs,
                }]
            }
            BehaviourEvent::Ping(ping::Event {
                peer,
                result: Ok(rtt),
                ..
            }) => vec![NetEvent::Rtt { peer, rtt }],
            BehaviourEvent::Ping(ping::Event {
                peer,
                connection,
                result: Err(e),
            }) => {
                // libp2p reports ping failures but leaves the connection
                // open; a dead link must close so that it can be redialed.
                debug!(%peer, error = %e, "ping failed; closing the connection");
                self.swarm.close_connection(connection);
                vec![]
            }
            BehaviourEvent::Kad(ev) => self.on_kad_event(ev),
            BehaviourEvent::Rendezvous(ev) => self.on_rendezvous_event(ev),
            BehaviourEvent::Gossip(ev) => self.on_gossip_event(ev),
            BehaviourEvent::RelayServer(ev) => {
                self.on_relay_server_event(ev);
                vec![]
            }
            BehaviourEvent::RelayClient(relay::client::Event::ReservationReqAccepted {
                relay_peer_id,
                renewal,
                ..
            }) => vec![NetEvent::RelayReserved {
                relay: relay_peer_id,
                renewal,
            }],
            BehaviourEvent::AutonatClient(autonat::v2::client::Event {
                tested_addr,
                server,
                result,
                ..
            }) => {
                let reachable = result.is_ok();
                self.counters.inc(if reachable {
                    NetCount::AutonatReachable
                } else {
                    NetCount::AutonatUnreachable
                });
                debug!(%server, addr = %tested_addr, reachable, "AutoNAT test");
                vec![NetEvent::AutonatTested {
                    server,
                    addr: tested_addr,
                    reachable,
                    reason: result.err().map(|e| e.to_string()).unwrap_or_default(),
                }]
            }
            BehaviourEvent::Dcutr(dcutr::Event {
                remote_peer_id,
                result,
            }) => {
                let ok = result.is_ok();
                self.counters.inc(if ok {
                    NetCount::HolePunchesOk
                } else {
                    NetCount::HolePunchesFailed
                });
                let reason = result.err().map(|e| e.to_string()).unwrap_or_default();
                info!(peer = %remote_peer_id, ok, %reason, "hole punch finished");
                vec![NetEvent::HolePunch {
                    peer: remote_peer_id,
                    ok,
                    reason,
                }]
            }
            _ => vec![],
        }
    }

    /// Counts what the relay server grants and refuses.
    fn on_relay_server_event(&mut self, ev: relay::Event) {
        let c = &self.counters;
        match ev {
            relay::Event::ReservationReqAccepted { .. } => {
                c.inc(NetCount::RelayReservationsAccepted)
            }
            relay::Event::ReservationReqDenied { src_peer_id, .. } => {
                debug!(peer = %src_peer_id, "relay reservation refused");
                c.inc(NetCount::RelayReservationsDenied)
            }
            relay::Event::CircuitReqAccepted { .. } => c.inc(NetCount::RelayCircuitsAccepted),
            relay::Event::CircuitReqDenied {
                src_peer_id,
                dst_peer_id,
                ..
            } => {
                debug!(src = %src_peer_id, dst = %dst_peer_id, "relay circuit refused");
                c.inc(NetCount::RelayCircuitsDenied)
            }
            relay::Event::CircuitClosed {
                src_peer_id,
                dst_peer_id,
                error: Some(e),
            } => {
                debug!(src = %src_peer_id, dst = %dst_peer_id, error = %e, "relay circuit cut");
                c.inc(NetCount::RelayCircuitsCut)
            }
            _ => {}
        }
    }

    fn on_kad_event(&mut self, ev: kad::Event) -> Vec<NetEvent> {
        match ev {
            kad::Event::InboundRequest { request } => match request {
                kad::InboundRequest::PutRecord {
                    source,
                    record: Some(record),
                    ..
                } => vec![NetEvent::KadInboundRecord {
                    from: source,
                    key: record.key.to_vec(),
                    value: record.value,
                }],
                kad::InboundRequest::AddProvider {
                    record: Some(provider),
                } => {
                    // The provider record names who provides; accept it only
                    // from that peer itself, so nobody can enlist others.
                    // Membership in an agent is checked by whoever dials.
                    if let Some(k) = self.swarm.behaviour_mut().kad.as_mut() {
                        use kad::store::RecordStore;
                        if let Err(e) = k.store_mut().add_provider(provider) {
                            debug!(error = %e, "provider not stored");
                        }
                    }
                    vec![]
                }
                _ => vec![],
            },
            kad::Event::OutboundQueryProgressed {
                id, result, step, ..
            } => {
                let key = if step.last {
                    self.get_queries.remove(&id)
                } else {
                    self.get_queries.get(&id).cloned()
                };
                match result {
                    kad::QueryResult::GetRecord(Ok(kad::GetRecordOk::FoundRecord(r))) => {
                        vec![NetEvent::KadRecord {
                            key: r.record.key.to_vec(),
                            value: r.record.value,
                        }]
                    }
                    kad::QueryResult::GetProviders(Ok(kad::GetProvidersOk::FoundProviders {
                        providers,
                        ..
                    })) => {
                        let key = key.unwrap_or_default();
                        let providers = providers
                            .into_iter()
                            .take(64)
                            .map(|p| {
                                let addrs = self.known_addrs(&p);
                                (p, addrs)
                            })
                            .collect();
                        vec![NetEvent::KadProviders { key, providers }]
                    }
                    kad::QueryResult::Bootstrap(r) => {
                        if step.last || r.is_err() {
                            vec![NetEvent::KadBootstrapped {
                                ok: r.is_ok(),
                                reason: r.err().map(|e| e.to_string()).unwrap_or_default(),
                            }]
                        } else {
                            vec![]
                        }
                    }
                    _ => vec![],
                }
            }
            _ => vec![],
        }
    }

    fn known_addrs(&mut self, peer: &PeerId) -> Vec<Multiaddr> {
        let Some(k) = self.swarm.behaviour_mut().kad.as_mut() else {
            return vec![];
        };
        let mut out = Vec::new();
        for bucket in k.kbuckets() {
            for entry in bucket.iter() {
                if entry.node.key.preimage() == peer {
                    out.extend(entry.node.value.iter().cloned());
                }
            }
        }
        out
    }

    fn on_rendezvous_event(&mut self, ev: rendezvous::client::Event) -> Vec<NetEvent> {
        match ev {
            rendezvous::client::Event::Discovered {
                rendezvous_node,
                registrations,
                ..
            } => vec![NetEvent::RendezvousDiscovered {
                server: rendezvous_node,
                registrations: registrations
                    .into_iter()
                    .take(256)
                    .map(|r| Registration {
                        peer: r.record.peer_id(),
                        addrs: r.record.addresses().iter().take(32).cloned().collect(),
                        namespace: r.namespace.to_string(),
                        ttl_secs: r.ttl,
                    })
                    .collect(),
            }],
            rendezvous::client::Event::Registered {
                rendezvous_node,
                ttl,
                namespace,
            } => vec![NetEvent::RendezvousRegistered {
                server: rendezvous_node,
                namespace: namespace.to_string(),
                ttl_secs: ttl,
            }],
            rendezvous::client::Event::RegisterFailed {
                rendezvous_node,
                error,
                ..
            }
            | rendezvous::client::Event::DiscoverFailed {
                rendezvous_node,
                error,
                ..
            } => vec![NetEvent::RendezvousFailed {
                server: rendezvous_node,
                reason: format!("{error:?}"),
            }],
            _ => vec![],
        }
    }

    fn on_gossip_event(&mut self, ev: gossipsub::Event) -> Vec<NetEvent> {
        match ev {
            gossipsub::Event::Message {
                propagation_source,
                message_id,
                message,
            } => {
                let dropped = self.emit(NetEvent::GossipMessage {
                    id: GossipId {
                        id: message_id,
                        propagation_source,
                    },
                    author: message.source,
                    topic: message.topic.to_string(),
                    data: message.data,
                });
                // Nobody will judge it: release it unforwarded and
                // unpunished (the sync stream carries the same state).
                if let Some(NetEvent::GossipMessage { id, .. }) = dropped
                    && let Some(g) = self.swarm.behaviour_mut().gossip.as_mut()
                {
                    g.report_message_validation_result(
                        &id.id,
                        &id.propagation_source,
                        gossipsub::MessageAcceptance::Ignore,
                    );
                }
                vec![]
            }
            gossipsub::Event::Subscribed { peer_id, topic } => {
                // Retry what was published before anyone listened.
                let pending = std::mem::take(&mut self.pending_publishes);
                for (t, data) in pending {
                    self.publish(t, data);
                }
                vec![NetEvent::GossipSubscribed {
                    peer: peer_id,
                    topic: topic.to_string(),
                }]
            }
            _ => vec![],
        }
    }

    fn on_sync_event(&mut self, ev: request_response::Event<Vec<u8>, Vec<u8>>) -> Option<NetEvent> {
        match ev {
            request_response::Event::Message { peer, message, .. } => match message {
                request_response::Message::Request {
                    request, channel, ..
                } => {
                    let dropped = self.emit(NetEvent::Frame {
                        peer,
                        frame: request,
                    });
                    if dropped.is_none() {
                        // The receipt is transport-level: the frame arrived
                        // whole and was handed on. An empty body encodes
                        // `Ack { code: OK }`.
                        let _ = self
                            .swarm
                            .behaviour_mut()
                            .sync
                            .send_response(channel, Vec::new());
                    }
                    // Else the channel drops here: the stream closes with no
                    // receipt, so the sender sees a failed send and moves on
                    // to its next frame instead of waiting for a timeout.
                    None
                }
                request_response::Message::Response { request_id, .. } => {
                    self.finish(peer, request_id);
                    None
                }
            },
            request_response::Event::OutboundFailure {
                peer,
                request_id,
                error: request_response::OutboundFailure::ConnectionClosed,
                ..
            } if self.retry_closed(peer, request_id) => None,
            request_response::Event::OutboundFailure {
                peer,
                request_id,
                error,
                ..
            } => {
                self.finish(peer, request_id);
                Some(NetEvent::SendFailed {
                    peer,
                    reason: error.to_string(),
                })
            }
            // Only a frame dropped above goes unanswered; it is counted.
            request_response::Event::InboundFailure {
                error: request_response::InboundFailure::ResponseOmission,
                ..
            } => None,
            request_response::Event::InboundFailure { peer, error, .. } => {
                Some(NetEvent::InboundError {
                    peer,
                    reason: error.to_string(),
                })
            }
            request_response::Event::ResponseSent { .. } => None,
        }
    }

    fn finish(&mut self, peer: PeerId, request_id: OutboundRequestId) {
        if let Some(q) = self.queues.get_mut(&peer)
            && q.in_flight == Some(request_id)
        {
            q.in_flight = None;
            q.in_flight_frame = None;
        }
        self.pump(peer);
    }

    /// The connection a frame went on closed under it. If the peer is still
    /// connected (another connection is up), the frame goes again, once;
    /// whether the frame is retried.
    fn retry_closed(&mut self, peer: PeerId, request_id: OutboundRequestId) -> bool {
        let connected = self.swarm.is_connected(&peer);
        let Some(q) = self.queues.get_mut(&peer) else {
            return false;
        };
        if q.in_flight != Some(request_id) {
            return false;
        }
        q.in_flight = None;
        match q.in_flight_frame.take() {
            Some((frame, true)) if connected => {
                debug!(%peer, "connection closed under a frame; sending it again");
                q.queue.push_front(frame.clone());
                // Marked as retried: a second failure reports it.
                q.in_flight_frame = Some((frame, false));
                self.pump(peer);
                true
            }
            _ => {
                self.pump(peer);
                false
            }
        }
    }
}

#[cfg(test)]
mod tests {

    // Goal: status can say whether a peer is reached directly or through a
    // relay, and over which transport, from the connection's address.
    #[test]
    fn paths_name_the_transport_and_the_relay() {
        let p = |a: &str| path_of(&a.parse().unwrap());
        assert_eq!(
            p("/ip4/127.0.0.1/tcp/4001"),
            Path {
                transport: "tcp",
                relayed: false
            }
        );
        assert_eq!(
            p("/ip4/192.0.2.1/udp/4001/quic-v1"),
            Path {
                transport: "quic",
                relayed: false
            }
        );
        assert_eq!(
            p(
                "/ip4/192.0.2.1/tcp/4001/p2p/12D3KooWRBy97UB99e3J6hiPesre1MZeuNQvfan4gBziswrRJsNK/p2p-circuit"
            ),
            Path {
                transport: "tcp",
                relayed: true
            }
        );
    }

    use super::*;

    fn loopback(max_frame_bytes: usize) -> NetConfig {
        NetConfig {
            listen: vec!["/ip4/127.0.0.1/tcp/0".parse().unwrap()],
            max_frame_bytes,
            ..NetConfig::default()
        }
    }

    async fn node(
        seed: u8,
        max_frame_bytes: usize,
    ) -> (NetHandle, mpsc::Receiver<NetEvent>, Multiaddr) {
        node_with(seed, loopback(max_frame_bytes)).await
    }

    async fn node_with(
        seed: u8,
        config: NetConfig,
    ) -> (NetHandle, mpsc::Receiver<NetEvent>, Multiaddr) {
        let (h, mut rx) = spawn(Zeroizing::new([seed; 32]), config, CancellationToken::new())
            .await
            .unwrap();
        let addr = loop {
            match rx.recv().await.unwrap() {
                NetEvent::Listening(a) => break a,
                _ => continue,
            }
        };
        (h, rx, addr)
    }

    async fn next_matching<T>(
        rx: &mut mpsc::Receiver<NetEvent>,
        mut f: impl FnMut(NetEvent) -> Option<T>,
    ) -> T {
        tokio::time::timeout(Duration::from_secs(10), async {
            loop {
                if let Some(v) = f(rx.recv().await.expect("network stopped")) {
                    return v;
                }
            }
        })
        .await
        .expect("event within 10 s")
    }

    /// Waits, up to 30 s, until `done` holds (polled every 20 ms).
    async fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
        let polled = tokio::time::timeout(Duration::from_secs(30), async {
            while !done() {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
        .await;
        assert!(polled.is_ok(), "{what} within 30 s");
    }

    /// Reads `rx` in a task of its own from now on, as a daemon that keeps
    /// up would, and passes on the events `keep` picks.
    fn watch(
        mut rx: mpsc::Receiver<NetEvent>,
        keep: impl Fn(&NetEvent) -> bool + Send + 'static,
    ) -> mpsc::Receiver<NetEvent> {
        let (tx, kept) = mpsc::channel(1024);
        tokio::spawn(async move {
            while let Some(ev) = rx.recv().await {
                if keep(&ev) {
                    let _ = tx.try_send(ev);
                }
            }
        });
        kept
    }

    /// Sends `frame` from one node to another until the receiver's owner
    /// gets it. The receiver is still working through the flood and may
    /// drop it; it then closes the frame's stream unanswered, the sender
    /// hears of it (`SendFailed`) and sends again, as anti-entropy would.
    /// The sender's queue may still be behind too: then it waits for room.
    async fn deliver(
        (from, from_seen): (&NetHandle, &mut mpsc::Receiver<NetEvent>),
        (to, to_seen): (&NetHandle, &mut mpsc::Receiver<NetEvent>),
        frame: &[u8],
    ) {
        let (from_id, to_id) = (from.local_peer_id(), to.local_peer_id());
        loop {
            wait_until("room for a frame", || {
                from.try_send(to_id, frame.to_vec()).is_ok()
            })
            .await;
            tokio::select! {
                got = next_matching(to_seen, |e| match e {
                    NetEvent::Frame { peer, frame } if peer == from_id => Some(frame),
                    _ => None,
                }) => {
                    assert_eq!(got, frame);
                    return;
                }
                () = next_matching(from_seen, |e| match e {
                    NetEvent::SendFailed { peer, .. } if peer == to_id => Some(()),
                    _ => None,
                }) => {}
            }
        }
    }

    fn infra_config() -> NetConfig {
        NetConfig {
            listen: vec!["/ip4/127.0.0.1/tcp/0".parse().unwrap()],
            features: Features {
                kad: false,
                rendezvous_client: false,
                gossip: false,
                nat_traversal: false,
                infrastructure: Some(InfraLimits::default()),
            },
            ..NetConfig::default()
        }
    }

    fn device_config(advertise: Vec<Scope>) -> NetConfig {
        NetConfig {
            listen: vec!["/ip4/127.0.0.1/tcp/0".parse().unwrap()],
            features: Features {
                kad: false,
                rendezvous_client: false,
                gossip: false,
                ..Features::default()
            },
            advertise_listen: Some(advertise),
            ..NetConfig::default()
        }
    }

    // Goal: a device is reached through its relay reservation; a big frame
    // waits for the direct connection instead of using up the circuit;
    // DCUtR makes the connection direct, the relayed one is closed, and the
    // change is reported. (What is advertised where: `reach`'s tests and
    // the NAT lab.)
    // Method: three swarms on loopback: an infrastructure node (relay and
    // AutoNAT server), device a that vouches for no scope and reserves a
    // circuit, and device b that dials a only through the circuit. b queues
    // a 100 KiB frame at once: it must be counted as deferred, then arrive
    // after a hole punch, sent over a direct connection.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn relayed_first_then_direct_by_hole_punch() {
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .with_test_writer()
            .try_init();
        let (infra, mut infra_rx, infra_addr) = node_with(30, infra_config()).await;
        let infra_id = infra.local_peer_id();
        let _infra_events = watch(std::mem::replace(&mut infra_rx, mpsc::channel(1).1), |_| {
            false
        });
        // Nothing vouched for: a advertises no direct address, so its
        // observed one is a hole-punching candidate (on loopback the circuit
        // itself is not advertised either; b is given it below).
        let (a, mut a_rx, _) = node_with(31, device_config(vec![])).await;
        let (b, mut b_rx, _) = node_with(32, device_config(vec![])).await;
        a.dial_infra(infra_id, vec![infra_addr.clone()])
            .await
            .unwrap();
        b.dial_infra(infra_id, vec![infra_addr.clone()])
            .await
            .unwrap();
        for rx in [&mut a_rx, &mut b_rx] {
            next_matching(rx, |e| match e {
                NetEvent::Connected { peer, .. } if peer == infra_id => Some(()),
                _ => None,
            })
            .await;
        }
        // Reserved over the connection just made (a reservation asked for
        // while the dial is underway is refused: libp2p's relay client
        // dials again and the swarm refuses a second dial).
        a.reserve_relay(infra_id, infra_addr.clone()).await.unwrap();
        next_matching(&mut a_rx, |e| match e {
            NetEvent::RelayReserved { relay, .. } if relay == infra_id => Some(()),
            _ => None,
        })
        .await;
        let circuit = infra_addr
            .clone()
            .with(Protocol::P2p(infra_id))
            .with(Protocol::P2pCircuit)
            .with(Protocol::P2p(a.local_peer_id()));
        b.dial(Some(a.local_peer_id()), vec![circuit])
            .await
            .unwrap();
        let remote = next_matching(&mut b_rx, |e| match e {
            NetEvent::Connected { peer, remote, .. } if peer == a.local_peer_id() => Some(remote),
            _ => None,
        })
        .await;
        assert!(path_of(&remote).relayed, "first over the relay: {remote}");
        let big = vec![7u8; 100 * 1024];
        b.try_send(a.local_peer_id(), big.clone()).unwrap();
        wait_until("the big frame is deferred", || {
            b.counters().get(NetCount::FramesDeferredForDirect) == 1
        })
        .await;
        assert_eq!(
            b.counters().get(NetCount::BytesSentRelayed),
            0,
            "nothing big over the relay"
        );
        let got = next_matching(&mut a_rx, |e| match e {
            NetEvent::Frame { frame, .. } => Some(frame),
            _ => None,
        });
        let got = tokio::time::timeout(Duration::from_secs(30), got).await;
        assert_eq!(got.expect("frame within 30 s").len(), big.len());
        let (sa, sb) = (a.counters(), b.counters());
        assert!(
            sa.get(NetCount::HolePunchesOk) + sb.get(NetCount::HolePunchesOk) >= 1,
            "a hole punch made the link direct: {sa:?} {sb:?}"
        );
        assert!(
            sb.get(NetCount::BytesSentDirect) >= big.len() as u64,
            "{sb:?}"
        );
        let path = next_matching(&mut b_rx, |e| match e {
            NetEvent::PathChanged { peer, remote } if peer == a.local_peer_id() => Some(remote),
            _ => None,
        })
        .await;
        assert!(!path_of(&path).relayed, "now direct: {path}");
        assert!(infra.counters().get(NetCount::RelayReservationsAccepted) >= 1);
        assert!(infra.counters().get(NetCount::RelayCircuitsAccepted) >= 1);
    }

    // Goal: never dial ourselves, by PeerId or through one of our own
    // listening sockets (a peer advertising a loopback address).
    #[tokio::test]
    async fn never_dials_itself() {
        let (a, _a_rx, a_addr) = node(33, 1024).await;
        a.dial(Some(a.local_peer_id()), vec![a_addr.clone()])
            .await
            .unwrap();
        let other = libp2p::identity::Keypair::generate_ed25519()
            .public()
            .to_peer_id();
        a.dial(Some(other), vec![a_addr.clone()]).await.unwrap();
        wait_until("both dials skipped", || {
            a.counters().get(NetCount::SelfDialsSkipped) == 2
        })
        .await;
    }

    // Goal: the net actor never waits on its owner and the owner never waits
    // on the actor for data, so a flood both ways while neither owner reads
    // its events stalls neither side, and what is dropped is counted. The
    // old hand-over (`events.send(..).await` against `net.send(..).await`)
    // deadlocked here: each actor waited on its unread event channel, and
    // each owner on the actor's full command queue.
    // Method: a and b connect. Reading no events any more, each sends the
    // other FLOOD frames, which must return within the deadline; both must
    // then count dropped inbound frames. Still unread, a third node c
    // connects to both and must get their identify answers (their swarms
    // still run). Then a and b read again: each must report c's connection
    // (lifecycle events wait, in order, rather than drop), and frames
    // between c and them, sent after the flood, must arrive (resent when a
    // receiver still busy with the flood drops one and says so).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn flood_both_ways_unread_stalls_nobody() {
        const FLOOD: usize = 20_000;
        let (a, mut a_rx, a_addr) = node(40, 1024).await;
        let (b, mut b_rx, b_addr) = node(41, 1024).await;
        let (c, mut c_rx, _) = node(42, 1024).await;
        let (a_id, b_id, c_id) = (a.local_peer_id(), b.local_peer_id(), c.local_peer_id());
        a.dial(Some(b_id), vec![b_addr.clone()]).await.unwrap();
        for rx in [&mut a_rx, &mut b_rx] {
            next_matching(rx, |e| {
                matches!(e, NetEvent::Connected { .. }).then_some(())
            })
            .await;
        }

        // The flood; a_rx and b_rx stay unread from here on.
        let flood = async {
            for i in 0..FLOOD {
                let frame = (i as u64).to_be_bytes().to_vec();
                let _ = a.send(b_id, frame.clone()).await;
                let _ = b.send(a_id, frame).await;
                if i % 64 == 0 {
                    // As a daemon loop would between turns.
                    tokio::task::yield_now().await;
                }
            }
        };
        tokio::time::timeout(Duration::from_secs(60), flood)
            .await
            .expect("the owners' sends returned within 60 s");
        wait_until("both sides dropping inbound frames", || {
            a.counters().get(NetCount::FramesDropped) > 0
                && b.counters().get(NetCount::FramesDropped) > 0
        })
        .await;

        // Still unread: a and b keep serving their swarms.
        c.dial(Some(a_id), vec![a_addr]).await.unwrap();
        c.dial(Some(b_id), vec![b_addr]).await.unwrap();
        let mut identified = BTreeMap::new();
        while identified.len() < 2 {
            let peer = next_matching(&mut c_rx, |e| match e {
                NetEvent::Identified { peer, .. } => Some(peer),
                _ => None,
            })
            .await;
            identified.insert(peer, ());
        }
        assert!(identified.contains_key(&a_id) && identified.contains_key(&b_id));

        // a and b read again. c's connection was held for them.
        let about_c = move |e: &NetEvent| match e {
            NetEvent::Connected { peer, .. }
            | NetEvent::Frame { peer, .. }
            | NetEvent::SendFailed { peer, .. } => *peer == c_id,
            _ => false,
        };
        let mut a_seen = watch(a_rx, about_c);
        let mut b_seen = watch(b_rx, about_c);
        let mut c_seen = watch(c_rx, |e| {
            matches!(e, NetEvent::Frame { .. } | NetEvent::SendFailed { .. })
        });
        for seen in [&mut a_seen, &mut b_seen] {
            next_matching(seen, |e| {
                matches!(e, NetEvent::Connected { .. }).then_some(())
            })
            .await;
        }
        // Frames sent after the flood arrive, both ways.
        deliver((&c, &mut c_seen), (&a, &mut a_seen), b"late to a").await;
        deliver((&c, &mut c_seen), (&b, &mut b_seen), b"late to b").await;
        deliver((&a, &mut a_seen), (&c, &mut c_seen), b"late from a").await;
        deliver((&b, &mut b_seen), (&c, &mut c_seen), b"late from b").await;
        for h in [&a, &b] {
            let s = h.counters();
            assert!(s.get(NetCount::FramesDropped) > 0, "{s:?}");
            assert_eq!(s.get(NetCount::ConnectionsRefused), 0, "{s:?}");
        }
    }

    // Goal: connections beyond the per-peer cap are refused and counted, and
    // the ones within it keep working. Method: b allows 2 connections per
    // peer; a dials b's address 4 times (no peer condition, so each dial is
    // a new connection); b must refuse exactly 2, and a frame from a must
    // still reach b.
    #[tokio::test]
    async fn connections_over_the_per_peer_cap_are_refused() {
        let (a, mut a_rx, _) = node(43, 1024).await;
        let (b, mut b_rx, b_addr) = node_with(
            44,
            NetConfig {
                connection_limits: Some(ConnectionLimits {
                    max_established_per_peer: 2,
                    ..ConnectionLimits::device()
                }),
                ..loopback(1024)
            },
        )
        .await;
        for _ in 0..4 {
            a.dial(None, vec![b_addr.clone()]).await.unwrap();
        }
        wait_until("b refusing a's extra connections", || {
            b.counters().get(NetCount::ConnectionsRefused) >= 2
        })
        .await;
        // A refused connection may still look open to a for a moment, and a
        // frame sent on it fails: resend until one lands, as the daemon's
        // anti-entropy would.
        let landed = tokio::time::timeout(Duration::from_secs(30), async {
            loop {
                a.try_send(b.local_peer_id(), vec![7; 8]).unwrap();
                let outcome = tokio::select! {
                    f = next_matching(&mut b_rx, |e| match e {
                        NetEvent::Frame { peer, frame } => Some((peer, frame)),
                        _ => None,
                    }) => Some(f),
                    _ = next_matching(&mut a_rx, |e| matches!(e, NetEvent::SendFailed { .. }).then_some(())) => None,
                };
                if let Some(f) = outcome {
                    return f;
                }
            }
        })
        .await
        .expect("a frame from a reaches b within 30 s");
        assert_eq!(landed, (a.local_peer_id(), vec![7; 8]));
        assert_eq!(b.counters().get(NetCount::ConnectionsRefused), 2);
        assert_eq!(a.counters().get(NetCount::ConnectionsRefused), 0);
    }

    // Goal: the role picks the connection caps unless they are configured.
    #[test]
    fn connection_limits_by_role() {
        let device = NetConfig::default();
        assert_eq!(device.connection_limits(), ConnectionLimits::device());
        let mut infra = NetConfig::default();
        infra.features.infrastructure = Some(InfraLimits::default());
        assert_eq!(
            infra.connection_limits(),
            ConnectionLimits::infrastructure()
        );
        let mine = ConnectionLimits {
            max_established_per_peer: 1,
            ..ConnectionLimits::device()
        };
        infra.connection_limits = Some(mine);
        assert_eq!(infra.connection_limits(), mine);
        let (d, i) = (
            ConnectionLimits::device(),
            ConnectionLimits::infrastructure(),
        );
        assert!(d.max_established_total >= d.max_established_incoming);
        assert!(i.max_established_total >= i.max_established_incoming);
        assert!(i.max_established_incoming > d.max_established_incoming);
    }

    // Goal: a dial leaves from a fresh port, never from the listening port.
    // With libp2p's default port reuse, two devices that discover each
    // other at the same instant and dial each other (mDNS makes that
    // common) can have their SYNs cross: TCP then makes one connection in
    // which both ends are the Noise initiator, and both handshakes fail
    // ("input error"); CI saw exactly that. Method: a dials b on loopback;
    // the address b sees the connection come from must not be a's listening
    // port; then, ten times, two fresh nodes dial each other at once and
    // both connect.
    #[tokio::test]
    async fn dials_leave_from_a_fresh_port() {
        let (a, _a_rx, a_addr) = node(3, 1024).await;
        let (b, mut b_rx, b_addr) = node(4, 1024).await;
        a.dial(Some(b.local_peer_id()), vec![b_addr.clone()])
            .await
            .unwrap();
        let from = next_matching(&mut b_rx, |e| match e {
            NetEvent::Connected { remote, .. } => Some(remote),
            _ => None,
        })
        .await;
        let port = |m: &Multiaddr| {
            m.iter().find_map(|p| match p {
                Protocol::Tcp(port) => Some(port),
                _ => None,
            })
        };
        assert_ne!(
            port(&from),
            port(&a_addr),
            "a dialed from its listening port"
        );
        for round in 0..10u8 {
            let (a, mut a_rx, a_addr) = node(10 + 2 * round, 1024).await;
            let (b, mut b_rx, b_addr) = node(11 + 2 * round, 1024).await;
            let (ra, rb) = tokio::join!(
                a.dial(Some(b.local_peer_id()), vec![b_addr]),
                b.dial(Some(a.local_peer_id()), vec![a_addr]),
            );
            ra.unwrap();
            rb.unwrap();
            for rx in [&mut a_rx, &mut b_rx] {
                let got = next_matching(rx, |e| match e {
                    NetEvent::Connected { .. } => Some(Ok(())),
                    NetEvent::DialFailed { reason, .. } => Some(Err(reason)),
                    _ => None,
                })
                .await;
                assert_eq!(got, Ok(()), "round {round}");
            }
        }
    }

    // Goal: over a real loopback connection, frames to one peer arrive in the
    // order sent, and a frame over the receiver's cap is refused by its codec
    // (an inbound error there, a send failure here) without stopping later
    // frames. Method: two swarms in one process; the receiver caps frames at
    // 1 KiB.
    #[tokio::test]
    async fn ordered_frames_and_oversize_refused() {
        let (a, mut a_rx, _) = node(1, 8 * 1024 * 1024).await;
        let (b, mut b_rx, b_addr) = node(2, 1024).await;
        a.dial(Some(b.local_peer_id()), vec![b_addr]).await.unwrap();
        let connected = next_matching(&mut a_rx, |e| match e {
            NetEvent::Connected { peer, public, .. } => Some((peer, public)),
            _ => None,
        })
        .await;
        assert_eq!(connected.0, b.local_peer_id());
        assert_eq!(
            connected.1,
            Some(public_from_peer_id(&b.local_peer_id()).unwrap())
        );

        for i in 0u8..20 {
            a.send(b.local_peer_id(), vec![i; 100]).await.unwrap();
        }
        a.send(b.local_peer_id(), vec![0xee; 4096]).await.unwrap();
        a.send(b.local_peer_id(), vec![0xff; 10]).await.unwrap();

        let mut got = Vec::new();

        while got.len() < 21 {
            if let NetEvent::Frame { frame, .. } = next_matching(&mut b_rx, Some).await {
                got.push(frame);
            }
        }
        let firsts: Vec<u8> = got.iter().map(|f| f[0]).collect();
        let mut want: Vec<u8> = (0u8..20).collect();
        want.push(0xff);
        assert_eq!(
            firsts, want,
            "frames out of order or the oversized one got through"
        );
        assert_eq!(b.counters().get(NetCount::OversizedFramesRefused), 1);
        assert_eq!(a.counters().get(NetCount::OversizedFramesRefused), 0);
        let failed = next_matching(&mut a_rx, |e| match e {
            NetEvent::SendFailed { peer, .. } => Some(peer),
            _ => None,
        })
        .await;
        assert_eq!(failed, b.local_peer_id());
    }

    // Goal: the codec refuses an oversized length prefix before reading the
    // body. Method: feed a prefix claiming cap+1 bytes.
    #[tokio::test]
    async fn codec_refuses_oversized_prefix() {
        let mut bytes = (1025u32).to_be_bytes().to_vec();
        bytes.extend([0u8; 16]);
        let err = codec::read_frame(&mut futures::io::Cursor::new(bytes), 1024)
            .await
            .unwrap_err();
        assert_eq!(err.kind(), std::io::ErrorKind::InvalidData);
        assert!(err.to_string().contains("exceeds the cap"), "{err}");
    }

    // Goal: a device key maps to a PeerId and back to the same key.
    #[test]
    fn peer_id_round_trip() {
        let seed = [7u8; 32];
        let mut s = seed;
        let kp = libp2p::identity::Keypair::ed25519_from_bytes(&mut s).unwrap();
        let public = kp.public().try_into_ed25519().unwrap().to_bytes();
        let peer = peer_id_from_public(&public).unwrap();
        assert_eq!(peer, kp.public().to_peer_id());
        assert_eq!(public_from_peer_id(&peer), Some(public));
    }
}
