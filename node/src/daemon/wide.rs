//! Discovery and delivery beyond the LAN, in NIP-6's order: known peers
//! (a persisted cache of peers that verified before), mDNS (in the parent
//! module), the private DHT, and rendezvous. Also live deltas over the
//! agent's gossipsub topic, and the `sync --once` progress check.
//!
//! Reachability across NATs (NIP-6's ladder, ARCHITECTURE.md): we dial
//! infrastructure nodes from our listening port (TCP, and QUIC when they
//! offer it) so that the mapping they observe is the one hole punching
//! needs; until an AutoNAT server dialed one of our addresses back, we hold
//! a relay reservation on each infrastructure node and advertise its
//! circuit; every change of what we advertise re-registers at rendezvous
//! and republishes the DHT records at once.
//!
//! Every source here is only a hint. A peer found through the cache, the
//! DHT, rendezvous or gossip is dialed only if the key behind its PeerId is
//! an active device of our DID document, and it still has to pass the Hello
//! checks before any state flows. Gossip messages are forwarded only after
//! their author is a member and their envelope opens. A dead source never
//! blocks the others: each has its own timers and failures are only counted.

use crate::metrics::Event;
use std::collections::{BTreeMap, BTreeSet};
use std::io::{IsTerminal, Write as _};

use nuwa_net::{Multiaddr, NetEvent, PeerId, peer_of, public_from_peer_id};
use nuwa_sync::Rejection;
use nuwa_sync::pointer::{AgentPointer, dht_key, gossip_topic, rendezvous_namespace};
use serde::{Deserialize, Serialize};
use tracing::{debug, info, warn};

use super::{Daemon, PeerState, RunOptions};
use crate::home;

// Registration TTL requested from rendezvous servers; we re-register at
// half of whatever the server grants.
use super::RENDEZVOUS_TTL_SECS;
/// Known peers kept in the cache.
const MAX_KNOWN_PEERS: usize = 64;
const KNOWN_PEERS_META: &str = "known_peers";
/// Redial known and static peers that are not connected this often.
const REDIAL_MS: u64 = 5_000;
/// Longest pause between redials of a revoked device.
const REVOKED_REDIAL_MAX_MS: u64 = 15 * 60_000;
/// DHT and rendezvous lookups: fast while starting, then slower.
const LOOKUP_FAST_MS: u64 = 2_000;
const LOOKUP_SLOW_MS: u64 = 30_000;
const FAST_PHASE_MS: u64 = 60_000;
/// Re-publish our DHT pointer and provider record this often.
const POINTER_REPUT_MS: u64 = 10 * 60_000;
/// Retry a relay reservation that ended or was refused after this long.
const RELAY_RETRY_MS: u64 = 5_000;

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

pub struct Wide {
    dht_key: [u8; 32],
    pub(super) topic: String,
    namespace: String,
    dht: bool,
    rendezvous: bool,
    use_known: bool,
    bootstrap: Vec<(PeerId, Multiaddr)>,
    rv_servers: Vec<(PeerId, Multiaddr)>,
    /// Keepers (also infrastructure: dialed, no Hello, relays).
    keepers: Vec<(PeerId, Multiaddr)>,
    infra: BTreeSet<PeerId>,
    static_peers: Vec<(Option<PeerId>, Multiaddr)>,
    known: BTreeMap<PeerId, Vec<Multiaddr>>,
    /// Addresses of member devices from their latest verified mDNS
    /// announcement, redialed like known peers until they connect or their
    /// announcement expires: one dial at discovery is not enough when two
    /// devices find each other at the same instant and dial each other
    /// (both handshakes can fail), and mDNS reports a present peer again
    /// only every two minutes.
    pub(super) mdns_hints: BTreeMap<PeerId, Vec<Multiaddr>>,
    identified: BTreeMap<PeerId, Vec<Multiaddr>>,
    connected_infra: BTreeSet<PeerId>,
    rv_register_due: BTreeMap<PeerId, u64>,
    pub(super) nat: Nat,
    /// What we advertise (the network's last report).
    pub(super) advertised: Vec<Multiaddr>,
    /// Relays holding a reservation for us.
    pub(super) relays: BTreeSet<PeerId>,
    /// Relays asked, or to ask again at the given time.
    relay_next_ms: BTreeMap<PeerId, u64>,
    /// The connection in use per peer, when it changed after connecting.
    pub(super) paths: BTreeMap<PeerId, Multiaddr>,
    /// We listen on QUIC, so infrastructure nodes are dialed over it too.
    quic: bool,
    started_ms: u64,
    next_redial_ms: u64,
    next_lookup_ms: u64,
    pub(super) next_pointer_ms: u64,
    /// Size of the DHT pointer last published.
    pub(super) pointer_bytes: Option<u64>,
    /// Current pause between redials (grows while this device is revoked).
    pub(super) redial_backoff_ms: u64,
}

impl Wide {
    /// The rendezvous servers configured (with their PeerIds).
    pub fn rv_servers(&self) -> &[(PeerId, Multiaddr)] {
        &self.rv_servers
    }

    /// Each configured rendezvous server and whether it is connected.
    pub fn rendezvous_status(&self) -> Vec<nuwa_agent::status::InfraPeerStatus> {
        self.rv_servers
            .iter()
            .map(|(p, a)| nuwa_agent::status::InfraPeerStatus {
                address: a.to_string(),
                connected: self.connected_infra.contains(p),
            })
            .collect()
    }

    pub fn new(did: &str, opts: &RunOptions) -> Self {
        let with_peer = |addrs: &[Multiaddr]| -> Vec<(PeerId, Multiaddr)> {
            addrs
                .iter()
                .filter_map(|a| peer_of(a).map(|p| (p, a.clone())))
                .collect()
        };
        let bootstrap = if opts.dht {
            with_peer(&opts.bootstrap)
        } else {
            Vec::new()
        };
        let rv_servers = if opts.rendezvous {
            with_peer(&opts.rendezvous_servers)
        } else {
            Vec::new()
        };
        let keepers = with_peer(&opts.keepers);
        let infra = bootstrap
            .iter()
            .chain(rv_servers.iter())
            .chain(keepers.iter())
            .map(|(p, _)| *p)
            .collect();
        Wide {
            dht_key: dht_key(did),
            topic: gossip_topic(did),
            namespace: rendezvous_namespace(did),
            dht: opts.dht,
            rendezvous: opts.rendezvous,
            use_known: opts.known_peers,
            bootstrap,
            rv_servers,
            keepers,
            infra,
            static_peers: opts.peers.iter().map(|a| (peer_of(a), a.clone())).collect(),
            known: BTreeMap::new(),
            mdns_hints: BTreeMap::new(),
            identified: BTreeMap::new(),
            connected_infra: BTreeSet::new(),
            rv_register_due: BTreeMap::new(),
            nat: Nat::Unknown,
            advertised: Vec::new(),
            relays: BTreeSet::new(),
            relay_next_ms: BTreeMap::new(),
            paths: BTreeMap::new(),
            quic: opts
                .listen
                .iter()
                .any(|a| nuwa_net::path_of(a).transport == "quic"),
            started_ms: home::now_ms(),
            next_redial_ms: 0,
            next_lookup_ms: 0,
            next_pointer_ms: 0,
            pointer_bytes: None,
            redial_backoff_ms: REDIAL_MS,
        }
    }

    pub fn is_infra(&self, peer: &PeerId) -> bool {
        self.infra.contains(peer)
    }

    pub fn on_disconnected(&mut self, peer: &PeerId) {
        self.connected_infra.remove(peer);
        self.paths.remove(peer);
    }

    /// The address of an infrastructure node, as configured.
    fn infra_addr(&self, peer: &PeerId) -> Option<Multiaddr> {
        self.bootstrap
            .iter()
            .chain(self.rv_servers.iter())
            .chain(self.keepers.iter())
            .find(|(p, _)| p == peer)
            .map(|(_, a)| a.clone())
    }
}

/// The scope of the nearest infrastructure node configured, which decides
/// which listen addresses are advertised before any confirmation (see
/// `nuwa_net::reach`).
pub(super) fn infra_scope(opts: &RunOptions) -> Option<nuwa_net::Scope> {
    let mut addrs: Vec<&Multiaddr> = opts.keepers.iter().collect();
    if opts.dht {
        addrs.extend(opts.bootstrap.iter());
    }
    if opts.rendezvous {
        addrs.extend(opts.rendezvous_servers.iter());
    }
    addrs
        .into_iter()
        .filter_map(nuwa_net::reach::scope_of)
        .min()
}

impl Daemon {
    /// Loads the known-peers cache, subscribes to the agent's topic and
    /// dials every configured source.
    pub(super) async fn start_wide(&mut self) {
        if self.wide.use_known {
            match self.store.get_meta(KNOWN_PEERS_META) {
                Ok(Some(bytes)) => {
                    let list: Vec<KnownPeer> = serde_json::from_slice(&bytes).unwrap_or_default();
                    for k in list.into_iter().take(MAX_KNOWN_PEERS) {
                        let (Ok(p), addrs) = (
                            k.peer_id.parse::<PeerId>(),
                            k.addrs.iter().filter_map(|a| a.parse().ok()).collect(),
                        ) else {
                            continue;
                        };
                        self.wide.known.insert(p, addrs);
                    }
                    info!(peers = self.wide.known.len(), "known peers loaded");
                }
                Ok(None) => {}
                Err(e) => warn!(error = %e, "cannot read the known-peers cache"),
            }
        }
        let _ = self.net.gossip_subscribe(self.wide.topic.clone()).await;
        for (peer, addr) in self
            .wide
            .bootstrap
            .clone()
            .into_iter()
            .chain(self.wide.rv_servers.clone())
            .chain(self.wide.keepers.clone())
        {
            let _ = self.net.add_address(peer, addr.clone()).await;
            let _ = self.net.dial_infra(peer, vec![addr]).await;
        }
        self.redial().await;
    }

    async fn redial(&mut self) {
        let connected: BTreeSet<PeerId> = self
            .session
            .peers()
            .keys()
            .filter_map(|p| p.parse().ok())
            .collect();
        let mut targets: Vec<(Option<PeerId>, Vec<Multiaddr>)> = Vec::new();
        let now = home::now_ms();
        // A fresh mDNS address first, then what the cache remembers.
        let mut member_addrs: BTreeMap<PeerId, Vec<Multiaddr>> = BTreeMap::new();
        for (peer, addrs) in &self.wide.mdns_hints {
            // A device revoked since its announcement is not dialed again.
            let active = public_from_peer_id(peer).is_some_and(|public| {
                self.session
                    .membership()
                    .authorise_public(&public, now)
                    .is_ok()
            });
            if active {
                member_addrs.insert(*peer, addrs.clone());
            }
        }
        for (peer, addrs) in &self.wide.known {
            // Nor is a remembered device that was revoked since.
            let active = public_from_peer_id(peer).is_some_and(|public| {
                self.session
                    .membership()
                    .authorise_public(&public, now)
                    .is_ok()
            });
            if !active {
                continue;
            }
            let entry = member_addrs.entry(*peer).or_default();
            for a in addrs {
                if !entry.contains(a) {
                    entry.push(a.clone());
                }
            }
        }
        for (peer, addrs) in member_addrs {
            if !connected.contains(&peer) && !addrs.is_empty() {
                targets.push((Some(peer), addrs));
            }
        }
        for (peer, addr) in &self.wide.static_peers {
            if peer.is_none_or(|p| !connected.contains(&p)) {
                targets.push((*peer, vec![addr.clone()]));
            }
        }
        let mut infra: Vec<(PeerId, Multiaddr)> = Vec::new();
        for (peer, addr) in self
            .wide
            .bootstrap
            .iter()
            .chain(self.wide.rv_servers.iter())
            .chain(self.wide.keepers.iter())
        {
            if !self.wide.connected_infra.contains(peer) {
                infra.push((*peer, addr.clone()));
            }
        }
        for (peer, addrs) in targets {
            let _ = self.net.dial(peer, addrs).await;
        }
        for (peer, addr) in infra {
            let _ = self.net.dial_infra(peer, vec![addr]).await;
        }
    }

    /// A bootstrap or rendezvous node connected: join the DHT, register.
    pub(super) async fn on_infra_connected(&mut self, peer: PeerId) {
        self.wide.connected_infra.insert(peer);
        info!(%peer, "infrastructure node connected");
        if self.wide.bootstrap.iter().any(|(p, _)| *p == peer) {
            let _ = self.net.kad_bootstrap().await;
            self.wide.next_pointer_ms = 0;
            self.wide.next_lookup_ms = 0;
        }
        if self.wide.rv_servers.iter().any(|(p, _)| *p == peer) {
            self.wide.rv_register_due.insert(peer, 0);
            self.wide.next_lookup_ms = 0;
        }
        if self.keepers.is_keeper(&peer) {
            self.keeper_connected(peer);
        }
        // Reachable through it at once, until AutoNAT says we need not be.
        self.wide.relay_next_ms.insert(peer, 0);
        self.relay_tick(home::now_ms()).await;
    }

    /// Holds a relay reservation on every connected infrastructure node
    /// while AutoNAT has not found us public, and gives them up once it
    /// has. A reservation is asked for on a connection that is up (asked
    /// during the dial, libp2p's relay client would dial again and be
    /// refused).
    async fn relay_tick(&mut self, now: u64) {
        if self.wide.nat == Nat::Public {
            for relay in std::mem::take(&mut self.wide.relays) {
                info!(%relay, "reachable directly; giving up the relay reservation");
                let _ = self.net.release_relay(relay).await;
            }
            self.wide.relay_next_ms.clear();
            return;
        }
        let due: Vec<PeerId> = self
            .wide
            .relay_next_ms
            .iter()
            .filter(|(p, t)| **t <= now && self.wide.connected_infra.contains(p))
            .map(|(p, _)| *p)
            .collect();
        for relay in due {
            let Some(addr) = self.wide.infra_addr(&relay) else {
                continue;
            };
            // Asked; `RelayClosed` schedules the next try.
            self.wide.relay_next_ms.insert(relay, u64::MAX);
            let _ = self.net.reserve_relay(relay, addr).await;
        }
    }

    /// A peer passed the Hello checks: remember it in the known-peers cache.
    /// (Gossip needs no explicit link: flood publishing reaches every
    /// connected sibling subscribed to the topic.)
    pub(super) async fn on_verified(&mut self, peer: PeerId) {
        if !self.wide.use_known {
            return;
        }
        let mut addrs = self.wide.identified.get(&peer).cloned().unwrap_or_default();
        if let Some(PeerState::Pending { remote, .. } | PeerState::Verified { remote, .. }) =
            self.session.peers().get(&peer.to_string())
            && let Ok(remote) = remote.parse::<Multiaddr>()
            && peer_of(&remote).is_some()
        {
            // We dialed it: the remote address is a listen address.
            addrs.push(remote);
        }
        addrs.sort();
        addrs.dedup();
        if addrs.is_empty() {
            return;
        }
        if self.wide.known.len() >= MAX_KNOWN_PEERS && !self.wide.known.contains_key(&peer) {
            return;
        }
        if self.wide.known.get(&peer) == Some(&addrs) {
            return;
        }
        self.wide.known.insert(peer, addrs);
        self.save_known();
    }

    fn save_known(&self) {
        let list: Vec<KnownPeer> = self
            .wide
            .known
            .iter()
            .map(|(p, a)| KnownPeer {
                peer_id: p.to_string(),
                addrs: a.iter().map(|x| x.to_string()).collect(),
            })
            .collect();
        if let Ok(bytes) = serde_json::to_vec(&list) {
            self.meta.put(KNOWN_PEERS_META, bytes);
        }
    }

    pub(super) async fn wide_tick(&mut self, now: u64) {
        self.relay_tick(now).await;
        if now >= self.wide.next_redial_ms {
            // A revoked device is refused by every peer: it backs off
            // (doubling up to REVOKED_REDIAL_MAX_MS) instead of redialing
            // every few seconds.
            self.wide.redial_backoff_ms = if self.revoked {
                (self.wide.redial_backoff_ms.max(REDIAL_MS / 2) * 2).min(REVOKED_REDIAL_MAX_MS)
            } else {
                REDIAL_MS
            };
            self.wide.next_redial_ms = now + self.wide.redial_backoff_ms;
            self.redial().await;
        }
        let fast =
            now.saturating_sub(self.wide.started_ms) < FAST_PHASE_MS || self.verified_count() == 0;
        if self.wide.dht
            && !self.wide.connected_infra.is_empty()
            && now >= self.wide.next_pointer_ms
        {
            self.wide.next_pointer_ms = now + POINTER_REPUT_MS;
            self.publish_pointer().await;
        }
        if now >= self.wide.next_lookup_ms {
            self.wide.next_lookup_ms = now + if fast { LOOKUP_FAST_MS } else { LOOKUP_SLOW_MS };
            if self.wide.dht && !self.wide.connected_infra.is_empty() {
                let _ = self.net.kad_get_providers(self.wide.dht_key.to_vec()).await;
                let _ = self.net.kad_get_record(self.wide.dht_key.to_vec()).await;
            }
            if self.wide.rendezvous {
                for (server, _) in self.wide.rv_servers.clone() {
                    if self.wide.connected_infra.contains(&server) {
                        let _ = self
                            .net
                            .rendezvous_discover(server, self.wide.namespace.clone())
                            .await;
                    }
                }
            }
        }
        let due: Vec<PeerId> = self
            .wide
            .rv_register_due
            .iter()
            .filter(|(p, t)| **t <= now && self.wide.connected_infra.contains(p))
            .map(|(p, _)| *p)
            .collect();
        for server in due {
            if self.wide.advertised.is_empty() {
                // Nothing to register yet; `ExternalAddrs` brings us back.
                break;
            }
            // Retry in a minute unless the server confirms (which schedules
            // the TTL/2 refresh).
            self.wide.rv_register_due.insert(server, now + 60_000);
            let _ = self
                .net
                .rendezvous_register(server, self.wide.namespace.clone(), RENDEZVOUS_TTL_SECS)
                .await;
        }
    }

    fn verified_count(&self) -> usize {
        self.session.verified().count()
    }

    async fn publish_pointer(&mut self) {
        let now = home::now_unix_secs();
        let m = self.session.membership();
        match AgentPointer::new_signed(
            m.log(),
            m.context_id(),
            &self.net.local_peer_id().to_string(),
            m.device(),
            now,
        )
        .and_then(|p| p.encode())
        {
            Ok(bytes) => {
                self.wide.pointer_bytes = Some(bytes.len() as u64);
                let key = self.wide.dht_key.to_vec();
                let _ = self.net.kad_store(key.clone(), bytes.clone()).await;
                let _ = self.net.kad_put_record(key.clone(), bytes).await;
                let _ = self.net.kad_start_providing(key).await;
                debug!("published the DHT pointer and provider record");
            }
            Err(e) => warn!(error = %e, "cannot build the DHT pointer"),
        }
    }

    /// Dials a peer that a wide-area source proposed, if it is an active
    /// device of our agent; otherwise records the rejection.
    async fn consider(&mut self, source: &str, peer: PeerId, addrs: Vec<Multiaddr>) {
        if peer == self.net.local_peer_id() || self.is_verified(&peer) {
            return;
        }
        let now = home::now_ms();
        let verdict = match public_from_peer_id(&peer) {
            Some(public) => self.session.membership().authorise_public(&public, now),
            None => Err(Rejection::UnknownKey),
        };
        match verdict {
            Ok(_) if self.is_connected(&peer) => {}
            Ok(ctx) => {
                self.count(match source {
                    "dht" => Event::DhtPeersFound,
                    _ => Event::RendezvousPeersFound,
                });
                debug!(%peer, context_id = %ctx, source, "dialing a device found remotely");
                for a in &addrs {
                    let _ = self.net.add_address(peer, a.clone()).await;
                }
                let _ = self.net.dial(Some(peer), addrs).await;
            }
            Err(r) => self.reject(source, peer.to_string(), &r),
        }
    }

    pub(super) async fn on_wide_event(&mut self, ev: NetEvent) {
        match ev {
            NetEvent::Identified { peer, listen_addrs } => {
                if self.wide.is_infra(&peer) && self.wide.quic {
                    // A QUIC connection next to the TCP one, from our
                    // listening socket: the UDP mapping hole punching uses.
                    let quic: Vec<Multiaddr> = listen_addrs
                        .iter()
                        .filter(|a| nuwa_net::path_of(a).transport == "quic")
                        .filter(|a| !nuwa_net::reach::is_relayed(a))
                        .cloned()
                        .collect();
                    if !quic.is_empty() {
                        let _ = self.net.dial_infra(peer, quic).await;
                    }
                }
                if self.wide.identified.len() < 1024 || self.wide.identified.contains_key(&peer) {
                    self.wide.identified.insert(peer, listen_addrs);
                }
                // Identify often reports a peer's listen addresses just after
                // its Hello verified: remember them too.
                if self.is_verified(&peer) {
                    self.on_verified(peer).await;
                }
            }
            NetEvent::KadInboundRecord { from, key, value } => {
                // Any DHT node must be able to verify a record alone: the
                // pointer carries the agent's DID log.
                let now = home::now_unix_secs();
                match AgentPointer::decode(&value).and_then(|p| p.verify(&key, now).map(|_| p)) {
                    Ok(_) => {
                        self.count(Event::DhtRecordsStored);
                        let _ = self.net.kad_store(key, value).await;
                    }
                    Err(e) => {
                        info!(peer = %from, reason = %e, "forged or invalid DHT record refused");
                        self.reject(
                            "dht",
                            from.to_string(),
                            &Rejection::Malformed(format!("DHT record: {e}")),
                        );
                    }
                }
            }
            NetEvent::KadRecord { key, value } => {
                let now = home::now_unix_secs();
                match AgentPointer::decode(&value)
                    .and_then(|p| p.verify_for_agent(&key, self.session.log(), now).map(|_| p))
                {
                    Ok(p) => {
                        self.count(Event::DhtPointersVerified);
                        if p.topic != self.wide.topic {
                            self.count(Event::DhtPointerTopicMismatch);
                        }
                    }
                    Err(e) => {
                        self.reject(
                            "dht",
                            "record".to_owned(),
                            &Rejection::Malformed(format!("DHT pointer: {e}")),
                        );
                    }
                }
            }
            NetEvent::KadProviders { key, providers } => {
                if key != self.wide.dht_key {
                    return;
                }
                for (peer, addrs) in providers {
                    let addrs = if addrs.is_empty() {
                        self.wide.identified.get(&peer).cloned().unwrap_or_default()
                    } else {
                        addrs
                    };
                    self.consider("dht", peer, addrs).await;
                }
            }
            NetEvent::KadBootstrapped { ok, reason } => {
                if ok {
                    debug!("DHT bootstrap done");
                } else {
                    self.count(Event::DhtBootstrapFailed);
                    debug!(%reason, "DHT bootstrap failed");
                }
            }
            NetEvent::RendezvousDiscovered {
                server,
                registrations,
            } => {
                for r in registrations {
                    if r.namespace != self.wide.namespace {
                        self.on_pairing_registration(r.peer, &r.namespace, r.addrs);
                        continue;
                    }
                    debug!(%server, peer = %r.peer, "rendezvous registration");
                    self.consider("rendezvous", r.peer, r.addrs).await;
                }
            }
            NetEvent::RendezvousRegistered {
                server,
                ttl_secs,
                namespace,
            } => {
                info!(%server, ttl_secs, namespace, "registered at rendezvous");
                // The client does not refresh by itself: re-register at TTL/2.
                self.wide
                    .rv_register_due
                    .insert(server, home::now_ms() + ttl_secs * 500);
            }
            NetEvent::RendezvousFailed { server, reason } => {
                self.count(Event::RendezvousFailed);
                debug!(%server, %reason, "rendezvous request failed");
            }
            NetEvent::GossipMessage {
                id,
                author,
                topic,
                data,
            } => {
                let accept = self.on_gossip(author, &topic, &data).await;
                let _ = self.net.gossip_report(id, accept).await;
            }
            NetEvent::ExternalAddrs(addrs) => {
                self.wide.advertised = addrs;
                if self.wide.advertised.is_empty() {
                    return;
                }
                // Tell rendezvous and the DHT at once: a reservation made
                // after the last registration is otherwise never published.
                for (server, _) in self.wide.rv_servers.clone() {
                    if self.wide.connected_infra.contains(&server) {
                        self.wide.rv_register_due.insert(server, 0);
                    }
                }
                self.wide.next_pointer_ms = 0;
            }
            NetEvent::AutonatTested {
                server,
                addr,
                reachable,
                reason,
            } => {
                if nuwa_net::reach::is_relayed(&addr) {
                    return;
                }
                let before = self.wide.nat;
                if reachable {
                    self.wide.nat = Nat::Public;
                } else if before == Nat::Unknown {
                    self.wide.nat = Nat::Private;
                }
                if self.wide.nat != before {
                    info!(%server, %addr, %reason, nat = self.wide.nat.as_str(), "reachability found by AutoNAT");
                }
            }
            NetEvent::RelayReserved { relay, renewal } => {
                if !renewal {
                    info!(%relay, "relay reservation accepted");
                }
                self.wide.relays.insert(relay);
            }
            NetEvent::RelayClosed { relay, reason } => {
                self.wide.relays.remove(&relay);
                if self.wide.nat != Nat::Public {
                    debug!(%relay, %reason, "relay reservation ended; asking again soon");
                    self.wide
                        .relay_next_ms
                        .insert(relay, home::now_ms() + RELAY_RETRY_MS);
                }
            }
            NetEvent::PathChanged { peer, remote } => {
                self.wide.paths.insert(peer, remote);
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

    /// Validates a gossip message before it is forwarded: the author must be
    /// an active device, the envelope must open as that device's, and it
    /// must carry a delta (the session decides; this checks the wire).
    async fn on_gossip(&mut self, author: Option<PeerId>, topic: &str, data: &[u8]) -> bool {
        let who = author
            .map(|p| p.to_string())
            .unwrap_or_else(|| "anonymous".into());
        if topic != self.wide.topic {
            self.reject("gossip", who, &Rejection::Malformed("unknown topic".into()));
            return false;
        }
        let Some(author) = author else {
            self.reject("gossip", who, &Rejection::BadSignature);
            return false;
        };
        if author == self.net.local_peer_id() {
            return false;
        }
        let (accept, effects) =
            self.session
                .on_gossip(&who, public_from_peer_id(&author), data, home::now_ms());
        self.execute(effects, Vec::new()).await;
        accept
    }

    /// `sync --once`: `Some(Ok)` once converged with every verified peer,
    /// `Some(Err)` at the deadline, `None` while still working.
    /// How long the loop was held at most, for the last line of
    /// `sync --once` (a catch-up must not hold it for long).
    fn longest_turn(&self) -> String {
        let (us, what) = self.metrics.loop_turn_longest();
        format!("longest loop turn {:.1} ms ({what})", us as f64 / 1e3)
    }

    pub(super) fn once_progress(
        &mut self,
        now: u64,
        deadline: u64,
        last_line: &mut String,
    ) -> Option<Result<(), String>> {
        let verified: Vec<String> = self.session.verified().map(|(p, _)| p.clone()).collect();
        let mut in_sync = 0;
        for p in &verified {
            if self.session.in_sync_with(p) {
                in_sync += 1;
            }
        }
        let containers = self.session.engine().container_count();
        let tty = std::io::stderr().is_terminal();
        let mut line = format!(
            "peers verified: {}  in sync: {}  containers: {}",
            verified.len(),
            in_sync,
            containers
        );
        if tty {
            // On a terminal the line is redrawn in place, so it can also
            // show what is left: changes behind (peers say how many they
            // hold) and catch-ups under way.
            let mut behind = 0u64;
            let mut behind_containers = 0usize;
            for p in &verified {
                for r in self.session.sync_report(p) {
                    if r.state == nuwa_sync::PeerSyncState::Behind {
                        behind_containers += 1;
                        behind += r.behind.unwrap_or(0);
                    }
                }
            }
            if behind_containers > 0 {
                line.push_str(&format!(
                    "  behind: {behind_containers} container(s){}",
                    if behind > 0 {
                        format!(", {behind} change(s)")
                    } else {
                        String::new()
                    }
                ));
            }
            for c in self.session.engine().catch_up_progress() {
                line.push_str(&format!(
                    "  catching up {}: {} changes, {:.1} MiB",
                    c.container,
                    c.changes,
                    c.bytes as f64 / (1u64 << 20) as f64
                ));
            }
        }
        if line != *last_line {
            if tty {
                let mut err = std::io::stderr().lock();
                let _ = write!(err, "\r\x1b[2K{line}");
                let _ = err.flush();
            } else {
                crate::logging::stderr_line(format_args!("{line}"));
            }
            *last_line = line;
        }
        if verified.is_empty() && self.keepers.caught_up() {
            if tty {
                crate::logging::stderr_line(format_args!(""));
            }
            crate::logging::stderr_line(format_args!(
                "converged through the keeper (no other device online); {containers} container(s); {}",
                self.longest_turn()
            ));
            return Some(Ok(()));
        }
        if !verified.is_empty() && in_sync == verified.len() {
            if tty {
                crate::logging::stderr_line(format_args!(""));
            }
            crate::logging::stderr_line(format_args!(
                "converged with {} peer(s); {containers} container(s) in sync; {}",
                verified.len(),
                self.longest_turn()
            ));
            return Some(Ok(()));
        }
        if now >= deadline {
            if tty {
                crate::logging::stderr_line(format_args!(""));
            }
            let reason = if verified.is_empty() {
                let rejected = self.rejections.len();
                if rejected > 0 {
                    format!(
                        "no verified peer before the timeout ({rejected} rejected; see the log). \
                         Check that the other devices run and that this home belongs to the same agent"
                    )
                } else {
                    "no peer reachable before the timeout: no device of this agent was found by \
                     known peers, mDNS, the DHT, rendezvous or a keeper. Start another device, or pass \
                     --peer, --bootstrap, --rendezvous or --keeper"
                        .to_owned()
                }
            } else {
                format!(
                    "not converged before the timeout: {in_sync} of {} verified peer(s) in sync",
                    verified.len()
                )
            };
            return Some(Err(reason));
        }
        None
    }
}
