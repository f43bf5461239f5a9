//! Paths that died under us. A network change (a new public address, a
//! phone moving between networks) leaves connections that look open and
//! carry nothing: libp2p's ping notices after two failures, up to 30 s.
//! A small frame that gets no receipt within [`STALL_AFTER`] is the first
//! sign. Gossip has no receipts, so a gossip message makes every peer with
//! nothing in flight get an empty frame (a probe, answered by its network
//! actor and never handed to its owner), at most once per
//! [`PROBE_EVERY`]: a dead path shows within seconds of a write. Every connected peer is then dialed again (relay circuits and
//! fresh NAT mappings included), and once a new connection to a peer is up
//! its connections older than the suspicion close: the frame in flight
//! goes again on the new one (`retry_closed`), relay reservations are made
//! again over a live connection, and a new relayed connection gets a new
//! hole punch. Infrastructure nodes are dialed again over QUIC too, so
//! that identify tells us our new public QUIC address; a relayed
//! connection that replaced a direct one and is not direct 5 s later is
//! replaced by a fresh one, whose hole punch uses the addresses known now.
//! Large frames are not watched: on a slow link they take long for good
//! reasons.

use libp2p::multiaddr::Protocol;
use libp2p::swarm::ConnectionId;
use libp2p::swarm::dial_opts::{DialOpts, PeerCondition};
use libp2p::{Multiaddr, PeerId};
use tokio::time::{Duration, Instant};
use tracing::{debug, info};

use super::Actor;
use crate::{NetCount, reach};

/// Whether `addr` is a direct QUIC address.
fn is_quic(addr: &Multiaddr) -> bool {
    !reach::is_relayed(addr) && addr.iter().any(|p| matches!(p, Protocol::QuicV1))
}

/// Frames up to this size are watched for a receipt.
const STALL_WATCH_BYTES: usize = 16 * 1024;
/// A watched frame without a receipt for this long means a dead path.
const STALL_AFTER: Duration = Duration::from_millis(1500);
/// Every connected peer is dialed again at most this often.
const REFRESH_EVERY: Duration = Duration::from_secs(10);
/// A peer dialed again stays suspect this long (the dial may fail).
const SUSPECT_FOR: Duration = Duration::from_secs(30);
/// A suspect peer is dialed again this often while no new connection
/// came up (its relay reservation may be on its way back).
const REDIAL_EVERY: Duration = Duration::from_secs(1);
/// A peer gets a probe at most this often.
const PROBE_EVERY: Duration = Duration::from_secs(1);
/// A relayed connection that replaced a lost direct path and is not direct
/// this long after is replaced by a fresh one (see `repunch_stale`): a
/// punch takes a few round trips (under 0.1 s in the NAT lab), and DCUtR's
/// QUIC attempt gives up after 5 s.
const REPUNCH_AFTER: Duration = Duration::from_secs(5);
/// Fresh relayed connections per lost direct path at most.
const REPUNCHES: u8 = 2;

impl Actor {
    /// Called four times a second: dials every connected peer again when a watched
    /// frame stalled.
    pub(super) fn watch_stalls(&mut self) {
        let now = Instant::now();
        self.suspect
            .retain(|_, (at, _)| now.duration_since(*at) < SUSPECT_FOR);
        let redial: Vec<PeerId> = self
            .suspect
            .iter()
            .filter(|(_, (_, dialed))| now.duration_since(*dialed) >= REDIAL_EVERY)
            .map(|(p, _)| *p)
            .collect();
        for p in redial {
            self.dial_again(p, now);
        }
        let stalled = self.queues.iter().find(|(p, q)| {
            q.in_flight.is_some()
                && !self.suspect.contains_key(p)
                && q.sent.is_some_and(|(at, len)| {
                    len <= STALL_WATCH_BYTES && now.duration_since(at) > STALL_AFTER
                })
        });
        let Some((&stalled, _)) = stalled else {
            return;
        };
        if self
            .last_refresh
            .is_some_and(|t| now.duration_since(t) < REFRESH_EVERY)
        {
            return;
        }
        self.last_refresh = Some(now);
        self.counters.inc(NetCount::PathsRefreshed);
        let peers: Vec<PeerId> = self.conns.keys().copied().collect();
        info!(
            peer = %stalled,
            peers = peers.len(),
            "a frame got no receipt in 1.5 s: dialing every connected peer again (the network may have changed)"
        );
        for p in peers {
            self.suspect.insert(p, (now, now));
            self.dial_again(p, now);
        }
    }

    /// Dials suspect `peer` once more, next to its connections.
    fn dial_again(&mut self, peer: PeerId, now: Instant) {
        if let Some((_, dialed)) = self.suspect.get_mut(&peer) {
            *dialed = now;
        }
        // Not where the connections that went quiet lead: a dial there
        // hangs until its timeout and holds back the others.
        let quiet: Vec<&Multiaddr> = self
            .conns
            .get(&peer)
            .map(|cs| cs.iter().map(|c| &c.remote).collect())
            .unwrap_or_default();
        let identified = self.identified.get(&peer).cloned().unwrap_or_default();
        let infrastructure = self.reuse_port_peers.contains(&peer);
        // An infrastructure node also gets a QUIC dial of its own, quiet
        // addresses included: it is where we learn our new public QUIC
        // address (identify), which the next hole punch needs. The TCP
        // punch from the listening port is blocked for minutes by the dead
        // direct TCP connection's four-tuple (see `swarm::build`), so
        // without a QUIC reconnection the pair stayed relayed (NAT lab
        // case 5). A QUIC dial to a live node from our one UDP socket is a
        // new connection, and on its own it holds back no other dial.
        let (quic, rest): (Vec<Multiaddr>, Vec<Multiaddr>) = identified
            .into_iter()
            .partition(|a| infrastructure && is_quic(a));
        let rest: Vec<Multiaddr> = rest.into_iter().filter(|a| !quiet.contains(&a)).collect();
        let mut dials = Vec::new();
        if !rest.is_empty() || quic.is_empty() {
            dials.push(rest);
        }
        if !quic.is_empty() {
            dials.push(quic);
        }
        for addrs in dials {
            let opts = DialOpts::peer_id(peer)
                .condition(PeerCondition::Always)
                .addresses(addrs);
            // Devices dial from a fresh port, infrastructure from the
            // listening one (as `dial` does).
            let opts = if infrastructure {
                opts.build()
            } else {
                opts.allocate_new_port().build()
            };
            if let Err(e) = self.swarm.dial(opts) {
                debug!(%peer, error = %e, "dial after a stall not started");
            }
        }
    }

    /// Called four times a second: a peer whose direct path a relayed
    /// connection replaced (see `replace_suspect`) and that is still not
    /// direct [`REPUNCH_AFTER`] later gets a fresh relayed connection, at
    /// most [`REPUNCHES`] times per lost path. DCUtR punches once per
    /// relayed connection, with the addresses each side knew when that
    /// connection opened: right after an address change those may be only
    /// the old ones (identify had not yet told the moved side its new
    /// address), and its attempts then fail or hang without an outcome.
    /// A new relayed connection is a new punch with what both sides know
    /// now; the old one closes once it is up (`replace_suspect`).
    pub(super) fn repunch_stale(&mut self) {
        let now = Instant::now();
        let due: Vec<(PeerId, u8)> = self
            .repunch
            .iter()
            .filter(|(_, (at, _))| now >= *at)
            .map(|(p, (_, left))| (*p, *left))
            .collect();
        for (peer, left) in due {
            self.repunch.remove(&peer);
            let direct = self
                .conns
                .get(&peer)
                .is_some_and(|cs| cs.iter().any(|c| !c.relayed));
            if direct || !self.swarm.is_connected(&peer) {
                continue;
            }
            if left > 1 {
                self.repunch.insert(peer, (now + REPUNCH_AFTER, left - 1));
            }
            info!(
                %peer,
                "still relayed 5 s after the direct path was lost: a fresh relayed connection for a new hole punch"
            );
            self.suspect.insert(peer, (now, now));
            self.dial_again(peer, now);
        }
    }

    /// A gossip message went out: every peer with nothing in flight gets a
    /// probe, at most once per [`PROBE_EVERY`].
    pub(super) fn probe_idle_peers(&mut self) {
        let now = Instant::now();
        let idle: Vec<PeerId> = self
            .queues
            .iter()
            .filter(|(p, q)| {
                q.in_flight.is_none()
                    && q.queue.is_empty()
                    && self
                        .probed
                        .get(p)
                        .is_none_or(|t| now.duration_since(*t) >= PROBE_EVERY)
            })
            .map(|(p, _)| *p)
            .filter(|p| self.swarm.is_connected(p))
            .collect();
        for p in idle {
            self.probed.insert(p, now);
            self.counters.inc(NetCount::ProbesSent);
            if let Some(q) = self.queues.get_mut(&p) {
                q.queue.push_back(Vec::new());
            }
            self.pump(p);
        }
    }

    /// A connection `new` to `peer` is up: if the peer was dialed again
    /// after a stall, its connections from before then close.
    pub(super) fn replace_suspect(&mut self, peer: PeerId, new: ConnectionId) {
        let Some((at, _)) = self.suspect.remove(&peer) else {
            return;
        };
        let cs: &[super::Conn] = self.conns.get(&peer).map_or(&[], |cs| cs);
        let old: Vec<ConnectionId> = cs
            .iter()
            .filter(|c| c.id != new && c.since < at)
            .map(|c| c.id)
            .collect();
        // A relayed connection replaces a direct path: watch that it
        // becomes direct again (`repunch_stale`).
        let lost_direct = cs.iter().any(|c| c.id != new && c.since < at && !c.relayed);
        let new_relayed = cs.iter().any(|c| c.id == new && c.relayed);
        if lost_direct && new_relayed {
            self.repunch
                .insert(peer, (Instant::now() + REPUNCH_AFTER, REPUNCHES));
        }
        if !old.is_empty() {
            info!(%peer, closed = old.len(), "a new connection replaces the ones from before the stall");
        }
        for id in old {
            self.swarm.close_connection(id);
        }
        // A new path (to a relay, say) may be what the others need: dial
        // them again now rather than at their next turn.
        let now = Instant::now();
        let others: Vec<PeerId> = self.suspect.keys().copied().collect();
        for p in others {
            self.dial_again(p, now);
        }
    }
}
