//! Outbound frames: one in flight per peer, held back while the peer is
//! reachable only through a relay and the frame is too big for it, sent
//! again once if its connection closed under it; and which of a peer's
//! connections carries them (a direct one replaces a relayed one).

use libp2p::request_response::OutboundRequestId;
use libp2p::swarm::ConnectionId;
use libp2p::{Multiaddr, PeerId};
use tracing::{debug, info};

use super::{Actor, RELAYED_CLOSE_GRACE};
use crate::{NetCount, NetEvent, reach};

impl Actor {
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
    /// one, for the grace that hole punching gets, unless a hole punch to
    /// the peer already failed; then it goes anyway (behind a symmetric NAT
    /// the relay is all there is).
    pub(super) fn pump(&mut self, peer: PeerId) {
        let relayed_since = self.relayed_only(&peer);
        let connected = self.swarm.is_connected(&peer);
        let punch_failed = self.punch_failed.contains(&peer);
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
            && !punch_failed
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
        q.sent = Some((tokio::time::Instant::now(), frame.len()));
        q.in_flight = Some(self.swarm.behaviour_mut().sync.send_request(&peer, frame));
    }

    pub(super) fn finish(&mut self, peer: PeerId, request_id: OutboundRequestId) {
        if let Some(q) = self.queues.get_mut(&peer)
            && q.in_flight == Some(request_id)
        {
            q.in_flight = None;
            q.in_flight_frame = None;
            q.sent = None;
        }
        self.pump(peer);
    }

    /// The connection a frame went on closed under it. If the peer is still
    /// connected (another connection is up), the frame goes again, once;
    /// whether the frame is retried.
    pub(super) fn retry_closed(&mut self, peer: PeerId, request_id: OutboundRequestId) -> bool {
        let connected = self.swarm.is_connected(&peer);
        let Some(q) = self.queues.get_mut(&peer) else {
            return false;
        };
        if q.in_flight != Some(request_id) {
            return false;
        }
        q.in_flight = None;
        q.sent = None;
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
    pub(super) fn on_paths_changed(&mut self, peer: PeerId) -> Vec<NetEvent> {
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
    pub(super) fn close_relayed(&mut self) {
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
            // The direct connection may have closed meanwhile (a dead path
            // replaced after a network change): the relay is all there is.
            let direct = self
                .conns
                .get(&peer)
                .is_some_and(|cs| cs.iter().any(|c| !c.relayed));
            if !direct {
                continue;
            }
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
}
