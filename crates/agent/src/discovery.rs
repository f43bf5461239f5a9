//! Finding and reaching the agent's other devices, in NIP-6's order: known
//! peers (a cache of peers that verified before), mDNS (signed
//! announcements on the LAN), the private DHT, and rendezvous; plus the
//! agent's gossip topic and the wire checks of what arrives on it.
//!
//! Reachability across NATs (NIP-6's ladder, docs/decisions.md): infra nodes
//! are dialed from the listening port (TCP, and QUIC when they offer it)
//! so that the mapping they observe is the one hole punching needs; until
//! an AutoNAT server dialed one of our addresses back, a relay reservation
//! is held on each infrastructure node and its circuit advertised; every
//! change of what is advertised re-registers at rendezvous and republishes
//! the DHT records at once.
//!
//! Every source is only a hint. A peer found through the cache, mDNS, the
//! DHT, rendezvous or gossip is dialed only if the key behind its PeerId is
//! an active device of our DID document, and it still has to pass the
//! Hello checks before any state flows. A dead source never blocks the
//! others: each has its own timers, and failures are only counted.

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;

use nuwa_identity::keys::context_id_for;
use nuwa_sync::Rejection;
use nuwa_sync::pointer::{AgentPointer, dht_key, gossip_topic, rendezvous_namespace};
use serde::{Deserialize, Serialize};
use tracing::{debug, info, warn};

use crate::agent::{Agent, Boot, Config, Out};
use crate::announce::{AgentRef, Announcement};
use crate::constants::*;
use crate::count::Count;
use crate::effect::{Effect, KadOp};
use crate::input::{MdnsEvent, NetEvent};
use crate::peer::{self, Multiaddr, PeerId, Protocol};

/// The metadata record of the known-peers cache.
pub const KNOWN_PEERS_META: &str = "known_peers";

/// What AutoNAT found about this device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Nat {
    Unknown,
    /// An address was dialed back: peers can dial us directly.
    Public,
    /// Tests failed and none succeeded.
    Private,
}

impl Nat {
    pub fn as_str(self) -> &'static str {
        match self {
            Nat::Unknown => "unknown",
            Nat::Public => "public",
            Nat::Private => "private",
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct KnownPeer {
    peer_id: String,
    addrs: Vec<String>,
}

/// The infrastructure nodes configured, by role.
struct Infra {
    bootstrap: Vec<(PeerId, Multiaddr)>,
    rendezvous: Vec<(PeerId, Multiaddr)>,
    keepers: Vec<(PeerId, Multiaddr)>,
    connected: BTreeSet<PeerId>,
}

impl Infra {
    fn all(&self) -> impl Iterator<Item = &(PeerId, Multiaddr)> {
        self.bootstrap
            .iter()
            .chain(self.rendezvous.iter())
            .chain(self.keepers.iter())
    }

    fn contains(&self, peer: &PeerId) -> bool {
        self.all().any(|(p, _)| p == peer)
    }

    fn addr_of(&self, peer: &PeerId) -> Option<Multiaddr> {
        self.all().find(|(p, _)| p == peer).map(|(_, a)| a.clone())
    }
}

/// Where the agent's timers stand.
struct Timers {
    started_ms: u64,
    next_redial_ms: u64,
    next_lookup_ms: u64,
    next_pointer_ms: u64,
    next_announce_ms: u64,
    /// Current pause between redials (grows while this device is revoked).
    redial_backoff_ms: u64,
}

/// Discovery and reachability state.
pub(crate) struct Discovery {
    dht_key: [u8; 32],
    topic: String,
    namespace: String,
    infra: Infra,
    static_peers: Vec<(Option<PeerId>, Multiaddr)>,
    known: BTreeMap<PeerId, Vec<Multiaddr>>,
    /// Addresses of member devices from their latest verified mDNS
    /// announcement, redialed like known peers until they connect or their
    /// announcement expires: one dial at discovery is not enough when two
    /// devices find each other at the same instant and dial each other
    /// (both handshakes can fail), and mDNS reports a present peer again
    /// only every two minutes.
    mdns_hints: BTreeMap<PeerId, Vec<Multiaddr>>,
    /// Announcements of our agent whose key we do not know yet.
    unknown: BTreeMap<String, (Announcement, Vec<SocketAddr>)>,
    identified: BTreeMap<PeerId, Vec<Multiaddr>>,
    rv_register_due: BTreeMap<PeerId, u64>,
    pub(crate) nat: Nat,
    /// What we advertise (the network's last report).
    pub(crate) advertised: Vec<Multiaddr>,
    /// Relays holding a reservation for us.
    pub(crate) relays: BTreeSet<PeerId>,
    /// Relays asked, or to ask again at the given time.
    relay_next_ms: BTreeMap<PeerId, u64>,
    /// Per relay, when a reservation whose connection was replaced may be
    /// asked for again at once (see `NetEvent::RelayClosed`).
    relay_quick_ms: BTreeMap<PeerId, u64>,
    /// The connection in use per peer, when it changed after connecting.
    pub(crate) paths: BTreeMap<PeerId, Multiaddr>,
    /// We listen on QUIC, so infrastructure nodes are dialed over it too.
    quic: bool,
    /// The TCP port our announcements name (0: none; mDNS then stays quiet).
    port: u16,
    timers: Timers,
    /// Size of the DHT pointer last published.
    pub(crate) pointer_bytes: Option<u64>,
    config_flags: Flags,
}

#[derive(Clone, Copy)]
struct Flags {
    dht: bool,
    rendezvous: bool,
    known_peers: bool,
    mdns: bool,
}

impl Discovery {
    pub(crate) fn new(config: &Config, boot: &Boot, now_ms: u64) -> Self {
        let did = boot.log.did();
        let bootstrap = if config.dht {
            config.bootstrap.clone()
        } else {
            Vec::new()
        };
        let rendezvous = if config.rendezvous {
            config.rendezvous_servers.clone()
        } else {
            Vec::new()
        };
        let known = if config.known_peers {
            boot.meta
                .get(KNOWN_PEERS_META)
                .map(|b| parse_known(b))
                .unwrap_or_default()
        } else {
            BTreeMap::new()
        };
        if !known.is_empty() {
            info!(peers = known.len(), "known peers loaded");
        }
        Discovery {
            dht_key: dht_key(did),
            topic: gossip_topic(did),
            namespace: rendezvous_namespace(did),
            infra: Infra {
                bootstrap,
                rendezvous,
                keepers: config.keepers.clone(),
                connected: BTreeSet::new(),
            },
            static_peers: config.static_peers.clone(),
            known,
            mdns_hints: BTreeMap::new(),
            unknown: BTreeMap::new(),
            identified: BTreeMap::new(),
            rv_register_due: BTreeMap::new(),
            nat: Nat::Unknown,
            advertised: Vec::new(),
            relays: BTreeSet::new(),
            relay_next_ms: BTreeMap::new(),
            relay_quick_ms: BTreeMap::new(),
            paths: BTreeMap::new(),
            quic: boot
                .listen_addrs
                .iter()
                .any(|a| peer::path_of(a).transport == "quic"),
            port: crate::listen::mdns_port(&boot.listen_addrs, &boot.listen_addrs).unwrap_or(0),
            timers: Timers {
                started_ms: now_ms,
                next_redial_ms: 0,
                next_lookup_ms: 0,
                next_pointer_ms: 0,
                next_announce_ms: 0,
                redial_backoff_ms: REDIAL_MS,
            },
            pointer_bytes: None,
            config_flags: Flags {
                dht: config.dht,
                rendezvous: config.rendezvous,
                known_peers: config.known_peers,
                mdns: config.mdns,
            },
        }
    }

    pub(crate) fn topic(&self) -> &str {
        &self.topic
    }

    pub(crate) fn is_infra(&self, peer: &PeerId) -> bool {
        self.infra.contains(peer)
    }

    /// The rendezvous servers configured (with their PeerIds).
    pub(crate) fn rendezvous_servers(&self) -> &[(PeerId, Multiaddr)] {
        &self.infra.rendezvous
    }

    pub(crate) fn mdns_on(&self) -> bool {
        self.config_flags.mdns
    }

    /// Each configured rendezvous server and whether it is connected.
    pub(crate) fn rendezvous_status(&self) -> Vec<crate::status::InfraPeerStatus> {
        self.infra
            .rendezvous
            .iter()
            .map(|(p, a)| crate::status::InfraPeerStatus {
                address: a.to_string(),
                connected: self.infra.connected.contains(p),
            })
            .collect()
    }

    pub(crate) fn on_disconnected(&mut self, peer: &PeerId) {
        self.infra.connected.remove(peer);
        self.paths.remove(peer);
    }

    /// The chain grew: the pointer carries the proof of the current
    /// document, so publish the new one at the next tick.
    pub(crate) fn republish_pointer(&mut self) {
        self.timers.next_pointer_ms = 0;
    }

    /// mDNS says a device went away.
    fn forget_hint(&mut self, peer: &PeerId) {
        self.mdns_hints.remove(peer);
    }
}

fn parse_known(bytes: &[u8]) -> BTreeMap<PeerId, Vec<Multiaddr>> {
    let list: Vec<KnownPeer> = serde_json::from_slice(bytes).unwrap_or_default();
    list.into_iter()
        .take(MAX_KNOWN_PEERS)
        .filter_map(|k| {
            let p = k.peer_id.parse::<PeerId>().ok()?;
            Some((p, k.addrs.iter().filter_map(|a| a.parse().ok()).collect()))
        })
        .collect()
}

/// A socket address as a dialable TCP multiaddr.
fn tcp_addr(sa: &SocketAddr) -> Multiaddr {
    let ip = match sa.ip() {
        std::net::IpAddr::V4(v4) => Protocol::Ip4(v4),
        std::net::IpAddr::V6(v6) => Protocol::Ip6(v6),
    };
    Multiaddr::empty().with(ip).with(Protocol::Tcp(sa.port()))
}

impl Agent {
    /// Joins the agent's topic, announces us, and dials every configured
    /// source.
    pub(crate) fn discovery_start(&mut self, now_ms: u64, out: &mut Out) {
        out.push(Effect::Subscribe(self.discovery.topic.clone()));
        for (peer, addr) in self.discovery.infra.all() {
            out.push(Effect::AddAddress {
                peer: *peer,
                addr: addr.clone(),
            });
            out.push(Effect::DialInfra {
                peer: *peer,
                addrs: vec![addr.clone()],
            });
        }
        self.announce(now_ms, out);
        self.redial(now_ms, out);
    }

    /// Our signed mDNS announcement, re-signed every two minutes (peers
    /// refuse old ones).
    fn announce(&mut self, now_ms: u64, out: &mut Out) {
        if !self.discovery.config_flags.mdns || self.discovery.port == 0 {
            return;
        }
        self.discovery.timers.next_announce_ms = now_ms + ANNOUNCE_REFRESH_MS;
        let m = self.session.membership();
        let ann = Announcement::new_signed(
            m.did(),
            m.context_id(),
            self.book.peer_id.to_string(),
            self.discovery.port,
            (now_ms / 1000) as i64,
            |bytes| m.device().sign(bytes),
        );
        out.push(Effect::Announce(ann.to_txt()));
    }

    /// Whether `peer` is an active device of our document now.
    fn is_active(&self, peer: &PeerId, now_ms: u64) -> bool {
        peer::public_of(peer).is_some_and(|public| {
            self.session
                .membership()
                .authorise_public(&public, now_ms)
                .is_ok()
        })
    }

    fn redial(&mut self, now_ms: u64, out: &mut Out) {
        let connected: BTreeSet<PeerId> = self
            .session
            .peers()
            .keys()
            .filter_map(|p| p.parse().ok())
            .collect();
        let d = &self.discovery;
        // Every address of one peer goes out in one dial: the network
        // refuses a second dial of a peer it is dialing, so a stale cached
        // address dialed first would hold up the right one until it
        // failed, every round, for good (seen: a restarted peer on a new
        // port never reached through its `--peer`). Libp2p tries a dial's
        // addresses together and keeps the first that answers. Order: what
        // the person gave (`--peer`, dialed whatever the chain says), a
        // fresh mDNS address, then the cache; a device revoked since is
        // not dialed again from mDNS or the cache.
        let mut member_addrs: BTreeMap<PeerId, Vec<Multiaddr>> = BTreeMap::new();
        let mut add = |peer: PeerId, addrs: &[Multiaddr]| {
            let entry = member_addrs.entry(peer).or_default();
            for a in addrs {
                if !entry.contains(a) {
                    entry.push(a.clone());
                }
            }
        };
        for (peer, addr) in &d.static_peers {
            match peer {
                Some(p) => add(*p, std::slice::from_ref(addr)),
                None => out.push(Effect::Dial {
                    peer: None,
                    addrs: vec![addr.clone()],
                }),
            }
        }
        for (peer, addrs) in d.mdns_hints.iter().chain(&d.known) {
            if self.is_active(peer, now_ms) {
                add(*peer, addrs);
            }
        }
        for (peer, addrs) in member_addrs {
            if !connected.contains(&peer) && !addrs.is_empty() {
                out.push(Effect::Dial {
                    peer: Some(peer),
                    addrs,
                });
            }
        }
        for (peer, addr) in d.infra.all() {
            if !d.infra.connected.contains(peer) {
                out.push(Effect::DialInfra {
                    peer: *peer,
                    addrs: vec![addr.clone()],
                });
            }
        }
    }

    /// A bootstrap, rendezvous or keeper node connected: join the DHT,
    /// register, pull and push, and hold a relay reservation on it.
    pub(crate) fn on_infra_connected(&mut self, peer: PeerId, now_ms: u64, out: &mut Out) {
        let d = &mut self.discovery;
        d.infra.connected.insert(peer);
        info!(%peer, "infrastructure node connected");
        if d.infra.bootstrap.iter().any(|(p, _)| *p == peer) {
            out.push(Effect::Kad(KadOp::Bootstrap));
            d.timers.next_pointer_ms = 0;
            d.timers.next_lookup_ms = 0;
        }
        if d.infra.rendezvous.iter().any(|(p, _)| *p == peer) {
            d.rv_register_due.insert(peer, 0);
            d.timers.next_lookup_ms = 0;
        }
        // Reachable through it at once, until AutoNAT says we need not be.
        d.relay_next_ms.insert(peer, 0);
        if self.keepers.is_keeper(&peer) {
            self.keepers.connected(peer);
        }
        self.relay_tick(now_ms, out);
    }

    /// Holds a relay reservation on every connected infrastructure node
    /// while AutoNAT has not found us public, and gives them up once it
    /// has. A reservation is asked for on a connection that is up (asked
    /// during the dial, libp2p's relay client would dial again and be
    /// refused).
    fn relay_tick(&mut self, now_ms: u64, out: &mut Out) {
        let d = &mut self.discovery;
        if d.nat == Nat::Public {
            for relay in std::mem::take(&mut d.relays) {
                info!(%relay, "reachable directly; giving up the relay reservation");
                out.push(Effect::ReleaseRelay(relay));
            }
            d.relay_next_ms.clear();
            return;
        }
        let due: Vec<PeerId> = d
            .relay_next_ms
            .iter()
            .filter(|(p, t)| **t <= now_ms && d.infra.connected.contains(p))
            .map(|(p, _)| *p)
            .collect();
        for relay in due {
            let Some(addr) = d.infra.addr_of(&relay) else {
                continue;
            };
            // Asked; `RelayClosed` schedules the next try.
            d.relay_next_ms.insert(relay, u64::MAX);
            out.push(Effect::ReserveRelay { relay, addr });
        }
    }

    /// A peer passed the Hello checks: remember it in the known-peers
    /// cache. (Gossip needs no explicit link: flood publishing reaches
    /// every connected sibling subscribed to the topic.)
    pub(crate) fn on_verified(&mut self, peer: PeerId, out: &mut Out) {
        if !self.discovery.config_flags.known_peers {
            return;
        }
        let d = &self.discovery;
        let mut addrs = d.identified.get(&peer).cloned().unwrap_or_default();
        if let Some(
            nuwa_sync::PeerState::Pending { remote, .. }
            | nuwa_sync::PeerState::Verified { remote, .. },
        ) = self.session.peers().get(&peer.to_string())
            && let Ok(remote) = remote.parse::<Multiaddr>()
            && peer::peer_in(&remote).is_some()
        {
            // We dialed it: the remote address is a listen address.
            addrs.push(remote);
        }
        addrs.sort();
        addrs.dedup();
        if addrs.is_empty()
            || (d.known.len() >= MAX_KNOWN_PEERS && !d.known.contains_key(&peer))
            || d.known.get(&peer) == Some(&addrs)
        {
            return;
        }
        self.discovery.known.insert(peer, addrs);
        let list: Vec<KnownPeer> = self
            .discovery
            .known
            .iter()
            .map(|(p, a)| KnownPeer {
                peer_id: p.to_string(),
                addrs: a.iter().map(|x| x.to_string()).collect(),
            })
            .collect();
        if let Ok(bytes) = serde_json::to_vec(&list) {
            out.push(Effect::SaveMeta {
                key: KNOWN_PEERS_META.to_owned(),
                bytes,
            });
        }
    }

    pub(crate) fn discovery_tick(&mut self, now_ms: u64, out: &mut Out) {
        self.relay_tick(now_ms, out);
        if now_ms >= self.discovery.timers.next_announce_ms {
            self.announce(now_ms, out);
        }
        if now_ms >= self.discovery.timers.next_redial_ms {
            // A revoked device is refused by every peer: it backs off
            // (doubling up to REVOKED_REDIAL_MAX_MS) instead of redialing
            // every few seconds.
            let t = &mut self.discovery.timers;
            t.redial_backoff_ms = if self.standing.revoked() {
                (t.redial_backoff_ms.max(REDIAL_MS / 2) * 2).min(REVOKED_REDIAL_MAX_MS)
            } else {
                REDIAL_MS
            };
            t.next_redial_ms = now_ms + t.redial_backoff_ms;
            self.redial(now_ms, out);
        }
        self.lookups(now_ms, out);
        self.rendezvous_registrations(now_ms, out);
    }

    fn lookups(&mut self, now_ms: u64, out: &mut Out) {
        let verified = self.session.verified().count();
        let d = &mut self.discovery;
        let fast = now_ms.saturating_sub(d.timers.started_ms) < FAST_PHASE_MS || verified == 0;
        let dht = d.config_flags.dht && !d.infra.connected.is_empty();
        if dht && now_ms >= d.timers.next_pointer_ms {
            d.timers.next_pointer_ms = now_ms + POINTER_REPUT_MS;
            self.publish_pointer(now_ms, out);
        }
        let d = &mut self.discovery;
        if now_ms < d.timers.next_lookup_ms {
            return;
        }
        d.timers.next_lookup_ms = now_ms + if fast { LOOKUP_FAST_MS } else { LOOKUP_SLOW_MS };
        if dht {
            out.push(Effect::Kad(KadOp::GetProviders(d.dht_key.to_vec())));
            out.push(Effect::Kad(KadOp::GetRecord(d.dht_key.to_vec())));
        }
        if d.config_flags.rendezvous {
            for (server, _) in &d.infra.rendezvous {
                if d.infra.connected.contains(server) {
                    out.push(Effect::RendezvousDiscover {
                        server: *server,
                        namespace: d.namespace.clone(),
                    });
                }
            }
        }
    }

    fn rendezvous_registrations(&mut self, now_ms: u64, out: &mut Out) {
        let d = &mut self.discovery;
        let due: Vec<PeerId> = d
            .rv_register_due
            .iter()
            .filter(|(p, t)| **t <= now_ms && d.infra.connected.contains(p))
            .map(|(p, _)| *p)
            .collect();
        for server in due {
            if d.advertised.is_empty() {
                // Nothing to register yet; `ExternalAddrs` brings us back.
                break;
            }
            // Retry in a minute unless the server confirms (which schedules
            // the TTL/2 refresh).
            d.rv_register_due.insert(server, now_ms + 60_000);
            out.push(Effect::RendezvousRegister {
                server,
                namespace: d.namespace.clone(),
                ttl_secs: RENDEZVOUS_TTL_SECS,
            });
        }
    }

    fn publish_pointer(&mut self, now_ms: u64, out: &mut Out) {
        let m = self.session.membership();
        match AgentPointer::new_signed(
            m.log(),
            m.context_id(),
            &self.book.peer_id.to_string(),
            m.device(),
            (now_ms / 1000) as i64,
        )
        .and_then(|p| p.encode())
        {
            Ok(bytes) => {
                self.discovery.pointer_bytes = Some(bytes.len() as u64);
                let key = self.discovery.dht_key.to_vec();
                out.push(Effect::Kad(KadOp::Store {
                    key: key.clone(),
                    value: bytes.clone(),
                }));
                out.push(Effect::Kad(KadOp::PutRecord {
                    key: key.clone(),
                    value: bytes,
                }));
                out.push(Effect::Kad(KadOp::StartProviding(key)));
                debug!("published the DHT pointer and provider record");
            }
            Err(e) => warn!(error = %e, "cannot build the DHT pointer"),
        }
    }

    /// Dials a peer that a wide-area source proposed, if it is an active
    /// device of our agent; otherwise records the rejection.
    fn consider(
        &mut self,
        source: &'static str,
        peer: PeerId,
        addrs: Vec<Multiaddr>,
        now_ms: u64,
        out: &mut Out,
    ) {
        if peer == self.book.peer_id || self.is_verified(&peer) {
            return;
        }
        let verdict = match peer::public_of(&peer) {
            Some(public) => self.session.membership().authorise_public(&public, now_ms),
            None => Err(Rejection::UnknownKey),
        };
        match verdict {
            Ok(_) if self.is_connected(&peer) => {}
            Ok(ctx) => {
                out.count(match source {
                    "dht" => Count::DhtPeersFound,
                    _ => Count::RendezvousPeersFound,
                });
                debug!(%peer, context_id = %ctx, source, "dialing a device found remotely");
                for a in &addrs {
                    out.push(Effect::AddAddress {
                        peer,
                        addr: a.clone(),
                    });
                }
                out.push(Effect::Dial {
                    peer: Some(peer),
                    addrs,
                });
            }
            Err(r) => self.reject(source, peer.to_string(), &r, now_ms, out),
        }
    }

    pub(crate) fn on_wide_event(&mut self, ev: NetEvent, now_ms: u64, out: &mut Out) {
        match ev {
            NetEvent::Identified { peer, listen_addrs } => {
                self.on_identified(peer, listen_addrs, out)
            }
            NetEvent::KadInboundRecord { from, key, value } => {
                // Any DHT node must be able to verify a record alone: the
                // pointer carries the agent's DID proof.
                match AgentPointer::decode(&value)
                    .and_then(|p| p.verify(&key, (now_ms / 1000) as i64).map(|_| p))
                {
                    Ok(_) => {
                        out.count(Count::DhtRecordsStored);
                        out.push(Effect::Kad(KadOp::Store { key, value }));
                    }
                    Err(e) => {
                        info!(peer = %from, reason = %e, "forged or invalid DHT record refused");
                        let r = Rejection::Malformed(format!("DHT record: {e}"));
                        self.reject("dht", from.to_string(), &r, now_ms, out);
                    }
                }
            }
            NetEvent::KadRecord { key, value } => {
                match AgentPointer::decode(&value).and_then(|p| {
                    p.verify_for_agent(&key, self.session.log(), (now_ms / 1000) as i64)
                        .map(|_| p)
                }) {
                    Ok(p) => {
                        out.count(Count::DhtPointersVerified);
                        if p.topic != self.discovery.topic {
                            out.count(Count::DhtPointerTopicMismatch);
                        }
                    }
                    Err(e) => {
                        let r = Rejection::Malformed(format!("DHT pointer: {e}"));
                        self.reject("dht", "record".to_owned(), &r, now_ms, out);
                    }
                }
            }
            NetEvent::KadProviders { key, providers } => {
                if key != self.discovery.dht_key {
                    return;
                }
                for (peer, addrs) in providers {
                    let addrs = if addrs.is_empty() {
                        self.discovery
                            .identified
                            .get(&peer)
                            .cloned()
                            .unwrap_or_default()
                    } else {
                        addrs
                    };
                    self.consider("dht", peer, addrs, now_ms, out);
                }
            }
            NetEvent::KadBootstrapped { ok, reason } => {
                if ok {
                    debug!("DHT bootstrap done");
                } else {
                    out.count(Count::DhtBootstrapFailed);
                    debug!(%reason, "DHT bootstrap failed");
                }
            }
            NetEvent::RendezvousDiscovered {
                server,
                registrations,
            } => {
                for r in registrations {
                    if r.namespace != self.discovery.namespace {
                        self.on_pairing_registration(r.peer, &r.namespace, r.addrs, now_ms);
                        continue;
                    }
                    debug!(%server, peer = %r.peer, "rendezvous registration");
                    self.consider("rendezvous", r.peer, r.addrs, now_ms, out);
                }
            }
            NetEvent::RendezvousRegistered {
                server,
                ttl_secs,
                namespace,
            } => {
                info!(%server, ttl_secs, namespace, "registered at rendezvous");
                // The client does not refresh by itself: re-register at TTL/2.
                self.discovery
                    .rv_register_due
                    .insert(server, now_ms + ttl_secs * 500);
            }
            NetEvent::RendezvousFailed { server, reason } => {
                out.count(Count::RendezvousFailed);
                debug!(%server, %reason, "rendezvous request failed");
            }
            NetEvent::Gossip {
                token,
                author,
                topic,
                data,
            } => {
                let accept = self.on_gossip(author, &topic, &data, now_ms, out);
                out.push(Effect::GossipVerdict { token, accept });
            }
            other => self.on_reachability(other, now_ms),
        }
    }

    fn on_identified(&mut self, peer: PeerId, listen_addrs: Vec<Multiaddr>, out: &mut Out) {
        let d = &mut self.discovery;
        if d.infra.contains(&peer) && d.quic {
            // A QUIC connection next to the TCP one, from our listening
            // socket: the UDP mapping hole punching uses.
            let quic: Vec<Multiaddr> = listen_addrs
                .iter()
                .filter(|a| {
                    let path = peer::path_of(a);
                    path.transport == "quic" && !path.relayed
                })
                .cloned()
                .collect();
            if !quic.is_empty() {
                out.push(Effect::DialInfra { peer, addrs: quic });
            }
        }
        if d.identified.len() < MAX_IDENTIFIED || d.identified.contains_key(&peer) {
            d.identified.insert(peer, listen_addrs);
        }
        // Identify often reports a peer's listen addresses just after its
        // Hello verified: remember them too.
        if self.is_verified(&peer) {
            self.on_verified(peer, out);
        }
    }

    /// What the network found about how we are reached.
    fn on_reachability(&mut self, ev: NetEvent, now_ms: u64) {
        let d = &mut self.discovery;
        match ev {
            NetEvent::ExternalAddrs(addrs) => {
                d.advertised = addrs;
                if d.advertised.is_empty() {
                    return;
                }
                // Tell rendezvous and the DHT at once: a reservation made
                // after the last registration is otherwise never published.
                for (server, _) in &d.infra.rendezvous {
                    if d.infra.connected.contains(server) {
                        d.rv_register_due.insert(*server, 0);
                    }
                }
                d.timers.next_pointer_ms = 0;
            }
            NetEvent::AutonatTested {
                server,
                addr,
                reachable,
                reason,
            } => {
                if peer::path_of(&addr).relayed {
                    return;
                }
                let before = d.nat;
                if reachable {
                    d.nat = Nat::Public;
                } else if before == Nat::Unknown {
                    d.nat = Nat::Private;
                }
                if d.nat != before {
                    info!(%server, %addr, %reason, nat = d.nat.as_str(), "reachability found by AutoNAT");
                }
            }
            NetEvent::RelayReserved { relay, renewal } => {
                if !renewal {
                    info!(%relay, "relay reservation accepted");
                }
                d.relays.insert(relay);
            }
            NetEvent::RelayClosed { relay, reason } => {
                d.relays.remove(&relay);
                if d.nat != Nat::Public {
                    // The connection that held it closed while another one
                    // to the relay is up (a dead path replaced after a
                    // network change): ask again at once, once per retry
                    // period, so peers reach us through it within seconds.
                    let replaced = reason == "closed"
                        && d.infra.connected.contains(&relay)
                        && d.relay_quick_ms.get(&relay).is_none_or(|t| now_ms >= *t);
                    let next = if replaced {
                        d.relay_quick_ms.insert(relay, now_ms + RELAY_RETRY_MS);
                        now_ms
                    } else {
                        now_ms + RELAY_RETRY_MS
                    };
                    debug!(%relay, %reason, replaced, "relay reservation ended; asking again");
                    d.relay_next_ms.insert(relay, next);
                }
            }
            NetEvent::PathChanged { peer, remote } => {
                d.paths.insert(peer, remote);
            }
            NetEvent::HolePunch { peer, ok, reason } => {
                if ok {
                    info!(%peer, "hole punch made the connection direct");
                } else {
                    debug!(%peer, %reason, "hole punch failed; the relay carries the link");
                }
            }
            _ => {}
        }
    }

    /// Validates a gossip message before it is forwarded: the author must
    /// be an active device, the envelope must open as that device's, and
    /// it must carry a delta (the session decides; this checks the wire).
    fn on_gossip(
        &mut self,
        author: Option<PeerId>,
        topic: &str,
        data: &[u8],
        now_ms: u64,
        out: &mut Out,
    ) -> bool {
        let who = author
            .map(|p| p.to_string())
            .unwrap_or_else(|| "anonymous".into());
        if topic != self.discovery.topic {
            let r = Rejection::Malformed("unknown topic".into());
            self.reject("gossip", who, &r, now_ms, out);
            return false;
        }
        let Some(author) = author else {
            self.reject("gossip", who, &Rejection::BadSignature, now_ms, out);
            return false;
        };
        if author == self.book.peer_id {
            return false;
        }
        let (accept, effects) =
            self.session
                .on_gossip(&who, peer::public_of(&author), data, now_ms);
        self.absorb(effects, now_ms, out);
        accept
    }

    // ---- mDNS ------------------------------------------------------------

    pub(crate) fn on_mdns(&mut self, ev: MdnsEvent, now_ms: u64, out: &mut Out) {
        match ev {
            MdnsEvent::Resolved {
                instance,
                txt,
                addrs,
            } => match Announcement::from_txt(txt) {
                Ok(ann) => self.on_announcement(ann, addrs, now_ms, out),
                Err(e) => {
                    debug!(%instance, error = %e, "malformed mdns announcement");
                    self.reject(
                        "mdns",
                        instance,
                        &Rejection::Malformed(e.to_string()),
                        now_ms,
                        out,
                    );
                }
            },
            MdnsEvent::Expired { instance } => {
                if let Ok(peer) = instance.parse::<PeerId>() {
                    self.discovery.forget_hint(&peer);
                    self.pairing_candidate_gone(&peer);
                }
            }
        }
    }

    /// An announcement leads to a dial only if it names our DID, its
    /// context id is an active device of our document, its signature
    /// verifies with that key within 600 s, and its PeerId is that key's.
    fn on_announcement(
        &mut self,
        ann: Announcement,
        addrs: Vec<SocketAddr>,
        now_ms: u64,
        out: &mut Out,
    ) {
        let who = ann.peer_id.clone();
        if who == self.book.peer_id.to_string() {
            return;
        }
        if matches!(&ann.agent, AgentRef::Did(d) if d.starts_with(crate::pairing::PAIR_AGENT_PREFIX))
        {
            self.on_pairing_announcement(&ann, &addrs, now_ms, out);
            return;
        }
        if let Some(bad) = addrs.iter().find(|a| a.port() != ann.port) {
            let reason = format!(
                "srv port {} differs from the announced port {}",
                bad.port(),
                ann.port
            );
            self.reject("mdns", who, &Rejection::Malformed(reason), now_ms, out);
            return;
        }
        if !ann.matches_agent(self.session.membership().did()) {
            let theirs = match &ann.agent {
                AgentRef::Did(d) => d.clone(),
                AgentRef::DidHash(h) => format!("did hash {}", hex::encode(h)),
            };
            self.reject("mdns", who, &Rejection::DifferentAgent(theirs), now_ms, out);
            return;
        }
        let key = match self
            .session
            .membership()
            .key_of_context(&ann.context_id, now_ms)
        {
            Ok(k) => k,
            Err(r) => {
                if matches!(r, Rejection::UnknownKey)
                    && self.discovery.unknown.len() < MAX_UNKNOWN_ANNOUNCEMENTS
                {
                    // Maybe a device newer than our DID chain: retried when
                    // the chain grows.
                    self.discovery
                        .unknown
                        .insert(who.clone(), (ann.clone(), addrs.clone()));
                }
                self.reject("mdns", who, &r, now_ms, out);
                return;
            }
        };
        if let Err(e) = ann.verify(&key, (now_ms / 1000) as i64, ANNOUNCE_MAX_AGE_SECS) {
            self.reject(
                "mdns",
                who,
                &Rejection::Malformed(e.to_string()),
                now_ms,
                out,
            );
            return;
        }
        let Some(peer) = peer::id_of(&key) else {
            return;
        };
        if peer.to_string() != ann.peer_id {
            // The context id is listed and signed, but the PeerId to dial
            // is another key's: name that key's context id (or the PeerId
            // when it carries no Ed25519 key).
            let named = ann.peer_id.parse().ok().and_then(|p| peer::public_of(&p));
            let r = Rejection::ContextMismatch {
                claimed: ann.context_id.clone(),
                actual: named.map_or_else(|| ann.peer_id.clone(), |k| context_id_for(&k)),
            };
            self.reject("mdns", who, &r, now_ms, out);
            return;
        }
        out.count(Count::MdnsAnnouncementsVerified);
        if self.is_connected(&peer) || addrs.is_empty() {
            return;
        }
        debug!(%peer, context_id = %ann.context_id, "dialing peer found by mDNS");
        let addrs: Vec<Multiaddr> = addrs.iter().map(tcp_addr).collect();
        // Only verified announcements of active devices get here, so the
        // map is bounded by the DID document.
        self.discovery.mdns_hints.insert(peer, addrs.clone());
        if self.standing.revoked() {
            // Refused anyway: the backed-off redial uses the hint when its
            // time comes.
            return;
        }
        out.push(Effect::Dial {
            peer: Some(peer),
            addrs,
        });
    }

    /// Announcements whose key was unknown are checked again (the chain
    /// grew).
    pub(crate) fn retry_unknown_announcements(&mut self, now_ms: u64, out: &mut Out) {
        let pending = std::mem::take(&mut self.discovery.unknown);
        for (_, (ann, addrs)) in pending {
            self.on_announcement(ann, addrs, now_ms, out);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::net::{IpAddr, Ipv4Addr};

    use nuwa_crypto::SyncKey;
    use nuwa_crypto::epoch::KeyRing;
    use nuwa_identity::chain::DidChain;
    use nuwa_identity::keys::{DeviceKey, context_id_for};
    use nuwa_sync::Engine;

    use super::*;
    use crate::input::Input;

    const NOW_MS: u64 = 1_800_000_000_000;
    const NOW_SECS: i64 = (NOW_MS / 1000) as i64;

    fn key(n: u64) -> DeviceKey {
        let mut seed = [0u8; 32];
        seed[..8].copy_from_slice(&n.to_le_bytes());
        seed[8] = 0xd2;
        DeviceKey::from_seed(&seed)
    }

    fn peer_of(k: &DeviceKey) -> PeerId {
        peer::id_of(&k.public()).expect("an ed25519 key")
    }

    fn addr(n: u64) -> Multiaddr {
        format!("/ip4/10.1.{}.{}/tcp/4001", n / 250, n % 250 + 1)
            .parse()
            .unwrap()
    }

    /// A device of a one-device agent, booted with `meta`.
    fn agent(meta: BTreeMap<String, Vec<u8>>) -> Agent {
        let master = key(1);
        let me = key(3);
        let mut log = DidChain::genesis(&master, NOW_SECS).expect("genesis");
        crate::lifecycle::first_update(&mut log, &master, &me, &key(2).public(), NOW_SECS)
            .expect("first update");
        let boot = Boot {
            device: DeviceKey::from_seed(&me.seed()),
            master: None,
            name: "me".to_owned(),
            log,
            keys: KeyRing::new(SyncKey::generate(0).expect("entropy")),
            grant: None,
            engine: Engine::new(me.public().to_vec(), nuwa_sync::Config::default()),
            quarantined: Vec::new(),
            meta,
            listen_addrs: vec!["/ip4/10.0.0.1/tcp/4001".parse().unwrap()],
            peer_id: peer_of(&me),
            mdns_watching: Vec::new(),
        };
        Agent::new(Config::default(), boot, NOW_MS)
    }

    fn saved_known(effects: &[Effect]) -> Vec<Vec<KnownPeer>> {
        effects
            .iter()
            .filter_map(|e| match e {
                Effect::SaveMeta { key, bytes } if key == KNOWN_PEERS_META => {
                    Some(serde_json::from_slice(bytes).expect("a known-peers list"))
                }
                _ => None,
            })
            .collect()
    }

    #[test]
    fn known_peers_loaded_at_boot_are_capped() {
        // Goal: a saved known-peers record longer than MAX_KNOWN_PEERS (64)
        // loads only its first MAX_KNOWN_PEERS entries.
        let peers: Vec<PeerId> = (0..MAX_KNOWN_PEERS as u64 + 36)
            .map(|i| peer_of(&key(100 + i)))
            .collect();
        let list: Vec<KnownPeer> = peers
            .iter()
            .enumerate()
            .map(|(i, p)| KnownPeer {
                peer_id: p.to_string(),
                addrs: vec![addr(i as u64).to_string()],
            })
            .collect();
        let meta = BTreeMap::from([(
            KNOWN_PEERS_META.to_owned(),
            serde_json::to_vec(&list).unwrap(),
        )]);
        let a = agent(meta);
        assert_eq!(a.discovery.known.len(), MAX_KNOWN_PEERS);
        let loaded: BTreeSet<PeerId> = a.discovery.known.keys().copied().collect();
        let first: BTreeSet<PeerId> = peers[..MAX_KNOWN_PEERS].iter().copied().collect();
        assert_eq!(loaded, first);
    }

    #[test]
    fn known_peers_cache_holds_at_most_max_known_peers() {
        // Goal: verified peers enter the known-peers cache, saved whole as
        // Effect::SaveMeta under KNOWN_PEERS_META, until it holds
        // MAX_KNOWN_PEERS (64); past that a new peer is neither kept nor
        // saved, while a kept peer's new addresses still are.
        let mut a = agent(BTreeMap::new());
        let extra = 8;
        let peers: Vec<PeerId> = (0..(MAX_KNOWN_PEERS + extra) as u64)
            .map(|i| peer_of(&key(100 + i)))
            .collect();
        for (i, p) in peers.iter().enumerate() {
            // Identify reports its listen address (not verified yet, so
            // nothing is remembered).
            let effects = a.handle(
                Input::Net(vec![NetEvent::Identified {
                    peer: *p,
                    listen_addrs: vec![addr(i as u64)],
                }]),
                NOW_MS,
            );
            assert!(saved_known(&effects).is_empty());
            let mut out = Out::default();
            a.on_verified(*p, &mut out);
            let saved = saved_known(&out.effects);
            if i < MAX_KNOWN_PEERS {
                assert_eq!(saved.len(), 1, "peer {i}");
                assert_eq!(saved[0].len(), i + 1);
            } else {
                assert!(saved.is_empty(), "peer {i} saved: {saved:?}");
            }
            assert_eq!(a.discovery.known.len(), (i + 1).min(MAX_KNOWN_PEERS));
        }
        assert!(
            peers[MAX_KNOWN_PEERS..]
                .iter()
                .all(|p| !a.discovery.known.contains_key(p))
        );

        // A kept peer moved: updated in place, still MAX_KNOWN_PEERS saved.
        let moved = peers[0];
        a.handle(
            Input::Net(vec![NetEvent::Identified {
                peer: moved,
                listen_addrs: vec![addr(999)],
            }]),
            NOW_MS,
        );
        let mut out = Out::default();
        a.on_verified(moved, &mut out);
        let saved = saved_known(&out.effects);
        assert_eq!(saved.len(), 1);
        assert_eq!(saved[0].len(), MAX_KNOWN_PEERS);
        assert_eq!(a.discovery.known[&moved], vec![addr(999)]);
    }

    #[test]
    fn pending_unknown_announcements_are_capped() {
        // Goal: announcements of our agent by keys our DID document does not
        // list are each refused as (mdns, unknown_key), and at most
        // MAX_UNKNOWN_ANNOUNCEMENTS (64) of them wait for the chain to grow:
        // the first ones to arrive; later ones are not kept.
        let mut a = agent(BTreeMap::new());
        let did = a.session.membership().did().to_owned();
        let total = MAX_UNKNOWN_ANNOUNCEMENTS + 6;
        let keys: Vec<DeviceKey> = (0..total as u64).map(|i| key(500 + i)).collect();
        for (i, k) in keys.iter().enumerate() {
            let p = peer_of(k);
            let ann = Announcement::new_signed(
                &did,
                context_id_for(&k.public()),
                p.to_string(),
                4001,
                NOW_SECS,
                |b| k.sign(b),
            );
            let effects = a.handle(
                Input::Mdns(MdnsEvent::Resolved {
                    instance: p.to_string(),
                    txt: ann.to_txt(),
                    addrs: vec![SocketAddr::new(
                        IpAddr::V4(Ipv4Addr::new(10, 2, 0, (i % 250 + 1) as u8)),
                        4001,
                    )],
                }),
                NOW_MS,
            );
            // The first handle also hands the shell its first access view.
            let effects: Vec<Effect> = effects
                .into_iter()
                .filter(|e| !matches!(e, Effect::Access(_)))
                .collect();
            assert_eq!(effects.len(), 1, "{effects:?}");
            assert!(matches!(
                effects[0],
                Effect::CountRejection {
                    source: "mdns",
                    reason: "unknown_key"
                }
            ));
            assert_eq!(
                a.discovery.unknown.len(),
                (i + 1).min(MAX_UNKNOWN_ANNOUNCEMENTS)
            );
        }
        let kept: BTreeSet<String> = a.discovery.unknown.keys().cloned().collect();
        let first: BTreeSet<String> = keys[..MAX_UNKNOWN_ANNOUNCEMENTS]
            .iter()
            .map(|k| peer_of(k).to_string())
            .collect();
        assert_eq!(kept, first);
    }
}
