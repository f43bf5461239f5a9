//! The session's effects, turned into the agent's: what to persist, what
//! to seal and send and how (one gossip publish per live delta, else the
//! direct stream), and the bookkeeping of verified, refused and departed
//! peers, adopted chains and epochs, and poisoned containers.

use nuwa_proto::{Frame, SyncPayload};
use nuwa_sync::{Door, Effect as SessionEffect};
use tracing::{debug, info, warn};

use crate::agent::{Agent, Out};
use crate::count::Count;
use crate::effect::Effect;
use crate::peer::PeerId;

impl Agent {
    /// Turns the session's effects into the agent's.
    pub(crate) fn absorb(&mut self, effects: Vec<SessionEffect>, now_ms: u64, out: &mut Out) {
        for e in effects {
            match e {
                SessionEffect::Persist {
                    container,
                    changes,
                    origin,
                    sealed_at_ms,
                } => out.push(Effect::Persist {
                    container,
                    changes,
                    origin,
                    sealed_at_ms,
                }),
                SessionEffect::PersistWhole { container, changes } => {
                    out.push(Effect::PersistWhole { container, changes })
                }
                SessionEffect::PersistLog => self.save_chain(now_ms, out),
                SessionEffect::PersistKeys { grant } => out.push(Effect::SaveKeys {
                    keys: Box::new(self.session.secure().keys().clone()),
                    grant,
                }),
                SessionEffect::Send { peer, payload } => {
                    self.send_payload(&peer, payload, now_ms, out)
                }
                SessionEffect::Broadcast { peers, payload } => {
                    self.broadcast(peers, payload, now_ms, out)
                }
                SessionEffect::SendHello { peer, hello } => {
                    if let Ok(p) = peer.parse::<PeerId>() {
                        out.send(p, &Frame::Hello(*hello));
                    }
                }
                SessionEffect::SendFrame { peer, frame } => {
                    if let Ok(p) = peer.parse::<PeerId>() {
                        out.send(p, &frame);
                    }
                }
                SessionEffect::Disconnect { peer } => {
                    if let Ok(p) = peer.parse::<PeerId>() {
                        out.push(Effect::Disconnect(p));
                    }
                }
                SessionEffect::Count(c) => out.push(Effect::CountSync(c)),
                other => self.bookkeep(other, now_ms, out),
            }
        }
    }

    /// Seals a payload for one peer and sends it over the direct stream.
    fn send_payload(&mut self, peer: &str, payload: SyncPayload, now_ms: u64, out: &mut Out) {
        let Ok(peer) = peer.parse::<PeerId>() else {
            return;
        };
        if let Some(bytes) = self.sealed(&payload, now_ms, out) {
            out.count(Count::FramesSent);
            out.count_by(Count::BytesSent, bytes.len() as u64);
            out.push(Effect::Send { peer, frame: bytes });
        }
    }

    /// Seals a live delta once for all its peers: one gossip publish where
    /// it fits (it reaches every device), else the same sealed frame over
    /// each peer's direct stream.
    fn broadcast(&mut self, peers: Vec<String>, payload: SyncPayload, now_ms: u64, out: &mut Out) {
        let Some(bytes) = self.sealed(&payload, now_ms, out) else {
            return;
        };
        if bytes.len() <= crate::constants::MAX_GOSSIP_BYTES {
            out.count(Count::GossipDeltasPublished);
            // Sealed bytes handed to gossip (each mesh peer gets a copy).
            out.count_by(Count::BytesSent, bytes.len() as u64);
            out.push(Effect::Publish {
                topic: self.discovery.topic().to_owned(),
                bytes,
            });
            return;
        }
        out.count(Count::DeltasOverStream);
        for peer in peers.iter().filter_map(|p| p.parse::<PeerId>().ok()) {
            out.count(Count::FramesSent);
            out.count_by(Count::BytesSent, bytes.len() as u64);
            out.push(Effect::Send {
                peer,
                frame: bytes.clone(),
            });
        }
    }

    /// The payload sealed under the current epoch as a frame, if it fits
    /// one (a bigger one is left to the sync protocol, which chunks).
    fn sealed(&self, payload: &SyncPayload, now_ms: u64, out: &mut Out) -> Option<Vec<u8>> {
        let bytes = match self.session.seal(payload, now_ms) {
            Ok(env) => Frame::Envelope(env).encode(),
            Err(e) => {
                warn!(error = %e, "cannot seal a payload");
                return None;
            }
        };
        if bytes.len() > nuwa_proto::MAX_FRAME_BYTES {
            out.count(Count::FrameTooLarge);
            warn!(
                len = bytes.len(),
                "payload exceeds the frame cap; relying on the sync protocol"
            );
            return None;
        }
        Some(bytes)
    }

    fn bookkeep(&mut self, e: SessionEffect, now_ms: u64, out: &mut Out) {
        match e {
            SessionEffect::PeerVerified {
                peer,
                context_id,
                name,
            } => {
                info!(%peer, context_id = %context_id, "peer verified");
                self.book.seen.saw(&context_id, &name, now_ms);
                self.save_seen(now_ms, out);
                if let Ok(p) = peer.parse::<PeerId>() {
                    self.on_verified(p, out);
                }
            }
            SessionEffect::PeerGone { peer, context_id } => {
                info!(%peer, context_id = %context_id, "peer disconnected");
                self.book.seen.saw(&context_id, "", now_ms);
                self.save_seen(now_ms, out);
            }
            SessionEffect::Rejected {
                peer,
                door,
                rejection,
            } => {
                // The first rejection of a peer for a reason is logged; the
                // rest are counted (`status`, metrics), or a revoked device
                // that redials would fill the log.
                let repeat = self.book.is_repeat(door.as_str(), &peer, rejection.label());
                match door {
                    Door::Connection if repeat => {
                        debug!(%peer, reason = %rejection, "peer rejected again")
                    }
                    Door::Connection => info!(
                        %peer,
                        reason = %rejection,
                        "peer rejected (repeats are counted in `nuwa-node status`, not logged)"
                    ),
                    Door::Gossip => debug!(%peer, reason = %rejection, "gossip rejected"),
                    Door::Keeper => {
                        debug!(%peer, reason = %rejection, "envelope from the keeper rejected")
                    }
                }
                if rejection == nuwa_sync::membership::Rejection::KeyExpired {
                    out.count(Count::PeersRefusedExpired);
                }
                self.reject(door.as_str(), peer, &rejection, now_ms, out);
            }
            SessionEffect::EnvelopeRejected {
                peer,
                label,
                reason,
            } => {
                out.push(Effect::CountEnvelopeRejected(label));
                debug!(%peer, %reason, "envelope rejected");
            }
            SessionEffect::LogExtended => self.on_log_extended(now_ms, out),
            SessionEffect::EpochAdopted { peer, epoch } => {
                info!(%peer, epoch, "adopted a new key epoch");
            }
            SessionEffect::PeerLacksEpoch {
                peer,
                context_id,
                epoch,
            } => self.grant_to(&peer, &context_id, epoch, now_ms, out),
            SessionEffect::GrantRejected { peer, reason } => {
                if self.standing.revoked() {
                    // Expected: a revoked device gets no grant (said once).
                    debug!(%peer, %reason, "epoch grant rejected");
                } else {
                    warn!(%peer, %reason, "epoch grant rejected");
                }
            }
            SessionEffect::Converged { peer, container } => {
                let ctx = self.session.context_of(&peer).unwrap_or_default();
                info!(container = %container, peer_context = %ctx, "container converged with peer");
            }
            SessionEffect::Poisoned { container, error } => {
                out.count(Count::ContainersPoisoned);
                warn!(container = %container, %error, "peer input left the container untrustworthy; reloading it from the store");
                out.push(Effect::Reload(container));
            }
            SessionEffect::ClockSkew { peer, offset_ms } => {
                out.count(Count::ClockSkewDetected);
                // Redials repeat this every few seconds: warn when the
                // offset first appears or moves, not on every Hello.
                if self.book.skew_is_news(&peer, offset_ms) {
                    warn!(
                        %peer,
                        offset_ms,
                        window_ms = nuwa_sync::secure::REPLAY_WINDOW_SECS * 1000,
                        "clock_skew: a device of this agent has a clock beyond the replay window; \
                         nothing syncs with it until the wrong clock is fixed (enable NTP)"
                    );
                }
            }
            SessionEffect::Persist { .. }
            | SessionEffect::PersistWhole { .. }
            | SessionEffect::PersistLog
            | SessionEffect::PersistKeys { .. }
            | SessionEffect::Send { .. }
            | SessionEffect::Broadcast { .. }
            | SessionEffect::SendHello { .. }
            | SessionEffect::SendFrame { .. }
            | SessionEffect::Disconnect { .. }
            | SessionEffect::Count(_) => {
                // Turned into the agent's effects by `absorb`.
            }
        }
    }

    /// The DID chain grew: this device may have been revoked, waiting
    /// announcements may now verify, and the DHT pointer carries the new
    /// proof.
    fn on_log_extended(&mut self, now_ms: u64, out: &mut Out) {
        info!(len = self.session.log().len(), "adopted a newer DID log");
        self.standing
            .check_revoked(self.session.membership(), now_ms);
        // A revoked device was told what it means by check_revoked.
        if !self.standing.revoked() {
            if let Err(r) = self.session.self_authorised(now_ms) {
                warn!(
                    reason = %r,
                    "this device is no longer an active device of the agent (revoked?); \
                     its peers will refuse it and it receives nothing new"
                );
            }
        }
        self.retry_unknown_announcements(now_ms, out);
        self.discovery.republish_pointer();
    }

    /// A member peer holds no grant of our current epoch (it was paired on
    /// a branch that met this epoch's only after it was opened): an admin
    /// seals the key to it alone and sends it in a Hello.
    fn grant_to(&mut self, peer: &str, context_id: &str, epoch: u64, now_ms: u64, out: &mut Out) {
        let now_secs = (now_ms / 1000) as i64;
        let Ok(admin) = self.standing.admin(&self.session, now_secs) else {
            return;
        };
        match crate::lifecycle::grant_current_to(
            self.session.log(),
            self.session.secure().keys(),
            &admin,
            context_id,
            now_secs,
        ) {
            Ok(grant) => {
                drop(admin);
                info!(%peer, context_id, epoch, "sealed the current key epoch to a device that lacked it");
                out.count(Count::EpochGrantsResealed);
                let effects = self.session.send_grant(peer, grant, now_ms);
                self.absorb(effects, now_ms, out);
            }
            Err(e) => {
                debug!(%peer, error = %crate::explain(&e), "cannot seal the current epoch to a peer")
            }
        }
    }
}
