//! What the caller tunes: which behaviours run, an infrastructure node's
//! bounds, connection caps and the actor's queues and timeouts. Plain data;
//! the swarm is built from it in `swarm`.

use std::time::Duration;

use libp2p::{Multiaddr, connection_limits};

use crate::reach::Scope;

/// Bytes a relay lets one circuit carry by default: twice the largest
/// frame, so any one frame fits in a fresh circuit (the shell asserts
/// that relation; the network does not know frames' sizes).
pub const RELAY_CIRCUIT_BYTES: u64 = 16 * 1024 * 1024;
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
    /// (see docs/decisions.md, "Relay limits"): a circuit lives an hour, so an
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
            max_circuit_bytes: RELAY_CIRCUIT_BYTES,
        }
    }
}

/// Caps on connections, checked by libp2p before a connection is used.
/// Connections over a cap are refused and counted
/// ([`NetCount::ConnectionsRefused`](crate::NetCount::ConnectionsRefused)).
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

    pub(crate) fn to_libp2p(self) -> connection_limits::ConnectionLimits {
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
    /// `reach`). `None`: [`reach::listen_scopes`](crate::reach::listen_scopes)
    /// with no infrastructure, plus public addresses on an infrastructure
    /// node.
    pub advertise_listen: Option<Vec<Scope>>,
    /// Frames bigger than this wait for a direct connection while a peer is
    /// reachable only through a relay ...
    pub relay_defer_bytes: usize,
    /// ... for at most this long after the relayed connection came up
    /// (hole punching takes a few round trips: within 0.1 s in the NAT
    /// lab), or until a hole punch to the peer fails; then they go over
    /// the relay. Behind symmetric NATs this grace is the whole wait:
    /// DCUtR reports no failure within seconds there (its TCP attempts
    /// wait on SYNs nobody answers), so 5 s made the first 1 MiB write
    /// take 4.8-5.1 s (NAT lab case 2).
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
            relay_direct_grace: Duration::from_millis(1500),
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
