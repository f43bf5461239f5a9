//! Everything the shell tells the agent: what the network, mDNS, the local
//! API, the clock and the shell's own workers brought. Each is one
//! [`Input`] handed to [`Agent::handle`](crate::Agent::handle) with the time.

use std::net::SocketAddr;

use nuwa_sync::CaughtUp;

use crate::api::Request;
use crate::peer::{Multiaddr, PeerId};

/// Names one API request, so that its reply finds its way back.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct RequestId(pub u64);

/// Something the shell learned.
#[derive(Debug)]
pub enum Input {
    /// Once, first: create the core models' containers, join the agent's
    /// topic and dial every configured source.
    Start,
    /// The clock ticked (every 200 ms or so). `rss_bytes` is the process's
    /// resident memory, when the platform tells it (the memory budget).
    Tick { rss_bytes: Option<u64> },
    /// A run of network events, handled as one turn: one group commit for
    /// all their changes, gossip applied together.
    Net(Vec<NetEvent>),
    /// mDNS saw something.
    Mdns(MdnsEvent),
    /// A batch of local API requests, applied together and acknowledged
    /// once durable.
    Api(Vec<(RequestId, Request)>),
    /// A catch-up ran on a worker.
    CaughtUp(Box<CaughtUp>),
    /// A container was read back from the store after a peer's input
    /// poisoned it (`None`: it was never persisted).
    Reloaded {
        container: String,
        loaded: Option<Box<nuwa_state::Container>>,
    },
    /// An evicted container read back from the store off the loop, for a
    /// peer's input that waited for it ([`Effect::Load`](crate::Effect::Load);
    /// `Ok(None)`: the store holds nothing of it, `Err`: it could not be
    /// read).
    Loaded {
        container: String,
        loaded: Result<Option<Box<nuwa_state::Container>>, String>,
    },
    /// The reader's lifecycle scan of `container` as it was at `heads`
    /// ([`Effect::ReaderScan`](crate::Effect::ReaderScan)): the items past
    /// their TTL or retention, and when the next one expires.
    Scanned {
        container: String,
        heads: Vec<[u8; 32]>,
        scan: crate::asm::Scan,
    },
}

/// What the network saw, in the core's terms.
#[derive(Debug)]
pub enum NetEvent {
    Listening(Multiaddr),
    /// The first connection to `peer` is up. `public` is the Ed25519 key
    /// behind its PeerId (None for other identities, which are refused).
    Connected {
        peer: PeerId,
        public: Option<[u8; 32]>,
        remote: Multiaddr,
    },
    /// The last connection to `peer` closed.
    Disconnected {
        peer: PeerId,
    },
    /// A frame arrived on the sync protocol.
    Frame {
        peer: PeerId,
        bytes: Vec<u8>,
    },
    SendFailed {
        peer: PeerId,
        reason: String,
    },
    InboundError {
        peer: PeerId,
        reason: String,
    },
    DialFailed {
        peer: Option<PeerId>,
        reason: String,
    },
    /// identify told us a peer's listen addresses.
    Identified {
        peer: PeerId,
        listen_addrs: Vec<Multiaddr>,
    },
    /// A peer asks us to store a DHT record (stored only if we say so).
    KadInboundRecord {
        from: PeerId,
        key: Vec<u8>,
        value: Vec<u8>,
    },
    /// A DHT record we looked up.
    KadRecord {
        key: Vec<u8>,
        value: Vec<u8>,
    },
    /// DHT providers we looked up, with the addresses known for them.
    KadProviders {
        key: Vec<u8>,
        providers: Vec<(PeerId, Vec<Multiaddr>)>,
    },
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
    /// A gossip message waiting for our verdict
    /// ([`Effect::GossipVerdict`](crate::Effect::GossipVerdict) with the
    /// same token). `author` is its verified signer.
    Gossip {
        token: u64,
        author: Option<PeerId>,
        topic: String,
        data: Vec<u8>,
    },
    /// A peer joined our gossip topic (nothing to do: publishes flood).
    Subscribed {
        peer: PeerId,
    },
    /// Something the shell's network reports that the agent has no use
    /// for (named by the shell, ignored here).
    Unknown(String),
    /// The addresses we advertise changed: the whole new set.
    ExternalAddrs(Vec<Multiaddr>),
    /// An AutoNAT server tested whether `addr` is reachable from it.
    AutonatTested {
        server: PeerId,
        addr: Multiaddr,
        reachable: bool,
        reason: String,
    },
    RelayReserved {
        relay: PeerId,
        renewal: bool,
    },
    RelayClosed {
        relay: PeerId,
        reason: String,
    },
    /// The connection in use for `peer` changed.
    PathChanged {
        peer: PeerId,
        remote: Multiaddr,
    },
    /// A ping came back after `rtt_ms`.
    Rtt {
        peer: PeerId,
        rtt_ms: u64,
    },
    HolePunch {
        peer: PeerId,
        ok: bool,
        reason: String,
    },
}

/// A rendezvous registration: who registered under which namespace, where.
#[derive(Debug, Clone)]
pub struct Registration {
    pub peer: PeerId,
    pub namespace: String,
    pub addrs: Vec<Multiaddr>,
}

/// What mDNS saw: a service of our type and its TXT record (unverified),
/// or one that went away.
#[derive(Debug, Clone)]
pub enum MdnsEvent {
    Resolved {
        /// The DNS-SD instance label (by convention the announcer's PeerId).
        instance: String,
        txt: Vec<(String, String)>,
        addrs: Vec<SocketAddr>,
    },
    Expired {
        instance: String,
    },
}
