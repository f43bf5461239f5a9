//! Building the swarm: its transports (TCP and QUIC, Noise, Yamux, relay
//! circuits) and one behaviour per protocol, each configured here and
//! nowhere else. Which behaviours run follows [`Features`](crate::Features);
//! what the actor
//! does with their events is in `actor`.

use std::time::Duration;

use libp2p::Transport as _;
use libp2p::core::muxing::StreamMuxerBox;
use libp2p::core::transport::Boxed;
use libp2p::core::upgrade::Version;
use libp2p::identity::Keypair;
use libp2p::request_response::{self, ProtocolSupport};
use libp2p::swarm::NetworkBehaviour;
use libp2p::swarm::behaviour::toggle::Toggle;
use libp2p::{
    PeerId, StreamProtocol, Swarm, autonat, connection_limits, dcutr, gossipsub, identify, kad,
    noise, ping, relay, rendezvous, tcp, yamux,
};
use nuwa_counters::Counters;

use crate::codec::FrameCodec;
use crate::{
    IDENTIFY_VERSION, InfraLimits, KAD_PROTOCOL, MAX_GOSSIP_BYTES, NetConfig, NetCount, NetError,
    SYNC_PROTOCOL,
};

/// Every behaviour of the swarm; the optional ones are toggled off where
/// [`Features`](crate::Features) leaves them out.
#[derive(NetworkBehaviour)]
pub(crate) struct Behaviour {
    // First, so that a refused connection gets no handler from the others.
    pub(crate) limits: connection_limits::Behaviour,
    pub(crate) sync: request_response::Behaviour<FrameCodec>,
    pub(crate) identify: identify::Behaviour,
    pub(crate) ping: ping::Behaviour,
    pub(crate) kad: Toggle<kad::Behaviour<kad::store::MemoryStore>>,
    pub(crate) rendezvous: Toggle<rendezvous::client::Behaviour>,
    pub(crate) rendezvous_server: Toggle<rendezvous::server::Behaviour>,
    pub(crate) relay_server: Toggle<relay::Behaviour>,
    pub(crate) relay_client: relay::client::Behaviour,
    pub(crate) autonat_client: Toggle<autonat::v2::client::Behaviour>,
    pub(crate) autonat_server: Toggle<autonat::v2::server::Behaviour>,
    pub(crate) dcutr: Toggle<dcutr::Behaviour>,
    pub(crate) gossip: Toggle<gossipsub::Behaviour>,
}

/// libp2p's TCP transport (port reuse, no Nagle), with noise and yamux:
/// what `with_tcp` builds, added after QUIC (see [`build`]).
fn tcp_transport(
    key: &Keypair,
) -> Result<Boxed<(PeerId, StreamMuxerBox)>, Box<dyn std::error::Error + Send + Sync>> {
    Ok(
        tcp::tokio::Transport::new(tcp::Config::default().nodelay(true))
            .upgrade(Version::V1Lazy)
            .authenticate(noise::Config::new(key)?)
            .multiplex(yamux::Config::default())
            .map(|(peer, muxer), _| (peer, StreamMuxerBox::new(muxer)))
            .boxed(),
    )
}

/// The swarm of `keypair`, listening on `config.listen`; inbound frames
/// refused for size are counted in `counters`.
pub(crate) fn build(
    keypair: Keypair,
    config: &NetConfig,
    counters: Counters<NetCount>,
) -> Result<Swarm<Behaviour>, NetError> {
    let gossip_cfg = if config.features.gossip {
        Some(gossip_config()?)
    } else {
        None
    };
    // QUIC before TCP. Listen addresses, and so what identify tells and
    // what redials try, come QUIC first: devices reach the infrastructure
    // node and each other over QUIC first and learn their public QUIC
    // address. A direct connection that dies with an address change is
    // then a QUIC one, which leaves nothing in the kernel; a dead TCP one
    // stays there (FIN-WAIT-1, for minutes) holding the four-tuple a new
    // punch from the listening port needs, libp2p dials from another
    // port, where the peer does not aim, and the pair stayed relayed
    // (NAT lab case 5; with TCP only, it still does).
    let mut swarm = libp2p::SwarmBuilder::with_existing_identity(keypair)
        .with_tokio()
        .with_quic()
        .with_other_transport(tcp_transport)
        .map_err(|e| NetError::Transport(e.to_string()))?
        .with_relay_client(noise::Config::new, yamux::Config::default)
        .map_err(|e| NetError::Transport(e.to_string()))?
        .with_behaviour(|key, relay_client| {
            Behaviour::new(key, relay_client, config, counters, gossip_cfg)
        })
        .map_err(|e| NetError::Transport(e.to_string()))?
        .with_swarm_config(|c| c.with_idle_connection_timeout(config.idle_connection_timeout))
        .build();
    for addr in &config.listen {
        swarm
            .listen_on(addr.clone())
            .map_err(|e| NetError::Listen {
                addr: addr.clone(),
                reason: e.to_string(),
            })?;
    }
    Ok(swarm)
}

impl Behaviour {
    fn new(
        key: &Keypair,
        relay_client: relay::client::Behaviour,
        config: &NetConfig,
        counters: Counters<NetCount>,
        gossip_cfg: Option<gossipsub::Config>,
    ) -> Result<Self, Box<dyn std::error::Error + Send + Sync>> {
        let peer = key.public().to_peer_id();
        let features = &config.features;
        let infra = features.infrastructure.as_ref();
        let traversal = features.nat_traversal && infra.is_none();
        let gossip = match gossip_cfg {
            // Unsigned at this layer: every message is a sealed envelope
            // whose own Ed25519 signature the agent checks against the
            // author's key before it judges the message (and its sender
            // must be that author), so a gossipsub signature was a second
            // sign and verify per message, about 50 µs of the propagation
            // path (issue 26). Signed messages (older devices) are still
            // taken, and checked (`ValidationMode::Permissive`).
            Some(cfg) => Some(gossipsub::Behaviour::new(
                gossipsub::MessageAuthenticity::Author(peer),
                cfg,
            )?),
            None => None,
        };
        Ok(Behaviour {
            limits: connection_limits::Behaviour::new(config.connection_limits().to_libp2p()),
            sync: sync_behaviour(config, counters),
            identify: identify_behaviour(key),
            // Detect dead links within ~15 s so partitions are noticed and
            // healed by redialing, not hidden behind TCP retransmits.
            ping: ping::Behaviour::new(
                ping::Config::new()
                    .with_interval(Duration::from_secs(5))
                    .with_timeout(Duration::from_secs(10)),
            ),
            kad: features
                .kad
                .then(|| kad_behaviour(peer, infra.is_some()))
                .into(),
            rendezvous: features
                .rendezvous_client
                .then(|| rendezvous::client::Behaviour::new(key.clone()))
                .into(),
            rendezvous_server: infra.map(rendezvous_server).into(),
            relay_server: infra.map(|l| relay_server(peer, l)).into(),
            relay_client,
            // Tests a candidate every 5 s (libp2p's default).
            autonat_client: traversal
                .then(autonat::v2::client::Behaviour::default)
                .into(),
            autonat_server: infra
                .map(|_| autonat::v2::server::Behaviour::default())
                .into(),
            dcutr: traversal.then(|| dcutr::Behaviour::new(peer)).into(),
            gossip: gossip.into(),
        })
    }
}

fn sync_behaviour(
    config: &NetConfig,
    counters: Counters<NetCount>,
) -> request_response::Behaviour<FrameCodec> {
    let codec = FrameCodec {
        max_frame_bytes: config.max_frame_bytes,
        counters,
    };
    let rr_config = request_response::Config::default()
        .with_request_timeout(config.request_timeout)
        .with_max_concurrent_streams(256);
    request_response::Behaviour::with_codec(
        codec,
        [(StreamProtocol::new(SYNC_PROTOCOL), ProtocolSupport::Full)],
        rr_config,
    )
}

fn identify_behaviour(key: &Keypair) -> identify::Behaviour {
    // Only the external addresses (see `reach`): listen addresses include
    // loopback and private ones nobody elsewhere can use.
    identify::Behaviour::new(
        identify::Config::new(IDENTIFY_VERSION.to_owned(), key.public())
            .with_cache_size(256)
            .with_hide_listen_addrs(true),
    )
}

fn kad_behaviour(peer: PeerId, infrastructure: bool) -> kad::Behaviour<kad::store::MemoryStore> {
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
    // `Actor::on_external_change`): a device nobody can dial must not enter
    // others' routing tables. Infrastructure nodes serve from the start.
    k.set_mode(Some(if infrastructure {
        kad::Mode::Server
    } else {
        kad::Mode::Client
    }));
    k
}

fn rendezvous_server(l: &InfraLimits) -> rendezvous::server::Behaviour {
    rendezvous::server::Behaviour::new(
        rendezvous::server::Config::default()
            .with_min_ttl(l.rendezvous_min_ttl_secs)
            .with_max_ttl(l.rendezvous_max_ttl_secs)
            .with_max_registration_per_peer(l.max_registrations_per_peer)
            .with_max_registration_total(l.max_registrations_total),
    )
}

fn relay_server(peer: PeerId, l: &InfraLimits) -> relay::Behaviour {
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
}

fn gossip_config() -> Result<gossipsub::Config, NetError> {
    // Sized for the 2-20 devices of one agent: a small mesh, fast
    // heartbeats, and flood publishing so a fresh message reaches every
    // connected sibling at once.
    gossipsub::ConfigBuilder::default()
        .validation_mode(gossipsub::ValidationMode::Permissive)
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
