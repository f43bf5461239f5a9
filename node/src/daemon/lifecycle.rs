//! The daemon's side of revocation and key epochs: revoking a device on
//! request, adopting epoch grants that peers forward, and holding envelopes
//! of an epoch whose key has not arrived yet.

use nuwa_crypto::Envelope;
use nuwa_net::PeerId;
use tracing::{info, warn};

use super::{Daemon, PeerState};
use crate::api::{ApiError, RevokeBody, RevokeReply};
use crate::home;
use crate::lifecycle::{self, GrantOutcome};

/// Envelopes of a not-yet-known epoch kept until its grant arrives.
pub(super) const MAX_HELD_ENVELOPES: usize = 256;
/// How long a held envelope waits for its grant.
const HELD_FOR_MS: u64 = 30_000;

impl Daemon {
    /// `device revoke`: sign the DID update removing the device, open a new
    /// key epoch for the rest, persist both, then push them to every peer
    /// (which also drops the revoked device's connections).
    pub(super) async fn on_revoke(&mut self, body: RevokeBody) -> Result<RevokeReply, ApiError> {
        let now_secs = home::now_unix_secs();
        let master = lifecycle::load_master(&self.home_dir, self.membership.log(), now_secs)
            .map_err(|e| ApiError::new(403, "not_key_manager", format!("{e:#}")))?;
        let r = lifecycle::revoke(
            self.membership.log(),
            self.secure.keys(),
            &master,
            body.context_id.trim(),
            self.membership.context_id(),
            now_secs,
        )
        .map_err(|e| ApiError::new(400, "cannot_revoke", format!("{e:#}")))?;
        drop(master);
        // Durable before anyone hears of it: keys first, so a crash never
        // leaves a log whose epoch key is lost.
        let persisted = home::save_keys(&self.home_dir, &r.keys)
            .and_then(|()| home::save_grant(&self.home_dir, &r.grant))
            .and_then(|()| home::save_log(&self.home_dir, &r.log));
        if let Err(e) = persisted {
            return Err(ApiError::new(500, "storage_failed", format!("{e:#}")));
        }
        let key = r
            .keys
            .get(r.epoch)
            .cloned()
            .ok_or_else(|| ApiError::new(500, "internal", "new epoch key missing"))?;
        if let Err(e) = self.secure.install(key) {
            return Err(ApiError::new(500, "internal", e.to_string()));
        }
        self.membership.set_epoch_grant(r.grant.clone());
        match self.membership.adopt_log(r.log.clone(), home::now_ms()) {
            Ok(_) => {}
            Err(e) => return Err(ApiError::new(500, "internal", e.to_string())),
        }
        self.count("devices_revoked");
        info!(revoked = %body.context_id, epoch = r.epoch, "device revoked; new key epoch opened");
        self.on_log_extended().await;
        Ok(RevokeReply {
            revoked: body.context_id.trim().to_owned(),
            epoch: r.epoch,
            did_log_len: r.log.len(),
            remaining: r.remaining,
        })
    }

    /// A verified peer forwarded the grant of its current epoch: adopt the
    /// key if it is new and meant for us.
    pub(super) async fn on_grant(&mut self, peer: PeerId, bytes: &[u8]) {
        if bytes.is_empty() {
            return;
        }
        let outcome = lifecycle::open_grant(
            bytes,
            self.secure.keys(),
            self.membership.document(),
            self.membership.device(),
            self.membership.context_id(),
            home::now_unix_secs(),
        );
        let key = match outcome {
            Ok(GrantOutcome::Known) => return,
            Ok(GrantOutcome::NewKey(k)) => k,
            Err(reason) => {
                self.count("epoch_grant_rejected");
                warn!(%peer, %reason, "epoch grant rejected");
                return;
            }
        };
        let epoch = key.epoch();
        let newest = epoch > self.secure.epoch();
        if let Err(e) = self.secure.install(key) {
            self.count("epoch_grant_rejected");
            warn!(%peer, error = %e, "cannot install the epoch key");
            return;
        }
        if let Err(e) = home::save_keys(&self.home_dir, self.secure.keys()) {
            warn!(error = %e, "cannot persist the key ring");
        }
        if newest {
            if let Err(e) = home::save_grant(&self.home_dir, bytes) {
                warn!(error = %e, "cannot persist the epoch grant");
            }
            self.membership.set_epoch_grant(bytes.to_vec());
        }
        self.count("epoch_grants_adopted");
        info!(%peer, epoch, "adopted a new key epoch");
        self.replay_held().await;
    }

    /// Keeps an envelope sealed under an epoch newer than ours (its grant
    /// is usually in a Hello still on its way).
    pub(super) fn hold(&mut self, peer: PeerId, env: Envelope) {
        if self.held.len() >= MAX_HELD_ENVELOPES {
            self.held.pop_front();
            self.count("held_envelopes_dropped");
        }
        self.held.push_back((home::now_ms(), peer, env));
        self.count("envelopes_held_for_epoch");
    }

    async fn replay_held(&mut self) {
        let now = home::now_ms();
        let held = std::mem::take(&mut self.held);
        for (at, peer, env) in held {
            if now.saturating_sub(at) > HELD_FOR_MS {
                continue;
            }
            let Some(PeerState::Verified {
                context_id, public, ..
            }) = self.peers.get(&peer).cloned()
            else {
                continue;
            };
            match self.secure.open(&env, &context_id, &public, now) {
                Ok(payload) => self.on_payload(peer, payload, now).await,
                Err(e) => self.count(&format!("envelope_rejected_{}", e.label())),
            }
        }
    }

    /// Drops held envelopes that waited too long.
    pub(super) fn expire_held(&mut self, now: u64) {
        while let Some((at, _, _)) = self.held.front() {
            if now.saturating_sub(*at) <= HELD_FOR_MS {
                break;
            }
            self.held.pop_front();
            self.count("held_envelopes_expired");
        }
    }
}
