//! The daemon's side of revocation: signing the DID update and the epoch
//! grant with the master key, persisting them, and handing them to the
//! session. (Adopting grants that peers forward, and holding envelopes of
//! an epoch still on its way, are the session's: `nuwa_sync::session`.)

use crate::metrics::Event;
use nuwa_sync::Effect;
use tracing::info;

use super::Daemon;
use crate::api::{ApiError, RevokeBody, RevokeReply};
use crate::home;
use crate::lifecycle;

impl Daemon {
    /// `device revoke`: sign the DID update removing the device, open a new
    /// key epoch for the rest, persist both, then hand them to the session,
    /// whose effects push them to every peer (which also drops the revoked
    /// device's connections). The reply waits for those effects.
    pub(super) fn on_revoke(
        &mut self,
        body: RevokeBody,
    ) -> Result<(RevokeReply, Vec<Effect>), ApiError> {
        let now_secs = home::now_unix_secs();
        let master = lifecycle::load_master(&self.home_dir, self.session.log(), now_secs)
            .map_err(|e| ApiError::new(403, "not_key_manager", format!("{e:#}")))?;
        let r = lifecycle::revoke(
            self.session.log(),
            self.session.secure().keys(),
            &master,
            body.context_id.trim(),
            self.session.membership().context_id(),
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
        let effects = self
            .session
            .adopt_own_update(r.log.clone(), Some((key, r.grant.clone())), home::now_ms())
            .map_err(|e| ApiError::new(500, "internal", e.to_string()))?;
        self.count(Event::DevicesRevoked);
        info!(revoked = %body.context_id, epoch = r.epoch, "device revoked; new key epoch opened");
        let reply = RevokeReply {
            revoked: body.context_id.trim().to_owned(),
            epoch: r.epoch,
            did_log_len: r.log.len(),
            remaining: r.remaining,
        };
        Ok((reply, effects))
    }
}
