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
//!
//! Code map: `config` (what the caller tunes), `handle` (the owner's side,
//! [`NetHandle`], and the commands it sends), `swarm` (transports and one
//! behaviour per protocol), `actor` (the task that owns the swarm, its
//! handlers grouped by what they handle), `outbox` (backpressure towards
//! the owner), `codec` (frames on the wire), `counts` ([`NetCount`]) and
//! `reach` (which addresses are advertised).

mod actor;
mod codec;
mod config;
mod counts;
mod handle;
mod outbox;
pub mod reach;
mod swarm;
#[cfg(test)]
mod tests;

use libp2p::gossipsub;
use nuwa_counters::Counters;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use zeroize::Zeroizing;

pub use libp2p::multiaddr::Protocol;
pub use libp2p::{Multiaddr, PeerId};
/// Peer facts (a device key is its libp2p identity; addresses' peers and
/// paths), shared with the core.
pub use nuwa_identity::peer::{Path, id_of, path_of, peer_in, public_of};

pub use config::{ConnectionLimits, Features, InfraLimits, NetConfig, RELAY_CIRCUIT_BYTES};
pub use counts::NetCount;
pub use handle::NetHandle;
pub use reach::Scope;

use actor::Actor;
use outbox::Delivery;

/// The sync protocol id.
pub const SYNC_PROTOCOL: &str = "/nuwa/sync/1";
/// The private DHT's protocol id.
pub const KAD_PROTOCOL: &str = "/nuwa/kad/1.0.0";
/// identify's protocol version string.
pub const IDENTIFY_VERSION: &str = "/nuwa/id/1.0.0";
/// Largest gossip message; bigger deltas go over the sync stream.
pub const MAX_GOSSIP_BYTES: usize = 64 * 1024;

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
    let swarm = swarm::build(keypair, &config, counters.clone())?;
    let local_peer_id = *swarm.local_peer_id();
    let (cmd_tx, cmd_rx) = mpsc::channel(outbox::COMMAND_QUEUE);
    let (ev_tx, ev_rx) = mpsc::channel(outbox::EVENT_QUEUE);
    let actor = Actor::new(swarm, ev_tx, config, counters.clone());
    tokio::spawn(tracing::Instrument::instrument(
        actor.run(cmd_rx, cancel),
        tracing::info_span!("net", peer = %local_peer_id),
    ));
    Ok((NetHandle::new(cmd_tx, local_peer_id, counters), ev_rx))
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
