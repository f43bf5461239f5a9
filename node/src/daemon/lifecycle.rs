//! The daemon's side of revocation: signing the DID update and the epoch
//! grant with the master key, persisting them, and handing them to the
//! session. (Adopting grants that peers forward, and holding envelopes of
//! an epoch still on its way, are the session's: `nuwa_sync::session`.)

use crate::metrics::Event;
use nuwa_sync::Effect;
use tracing::info;

use super::Daemon;
use crate::api::{
    AdminChange, AdminReply, ApiError, ErrorCode, ProvisionBody, ProvisionReply, RevokeBody,
    RevokeReply,
};
use crate::home;
use nuwa_agent::lifecycle;

impl Daemon {
    /// This home's admin key (see `lifecycle::load_admin`), or the API error
    /// that says why there is none.
    pub(super) fn admin_key(&self, now_secs: i64) -> Result<lifecycle::Admin, ApiError> {
        crate::home::load_admin(
            &self.home_dir,
            self.session.log(),
            self.session.membership().device(),
            now_secs,
        )
        .map_err(|e| ApiError::new(ErrorCode::NotKeyManager, format!("{e:#}")))
    }

    /// A DID update this daemon signed (no new epoch): durable first, then
    /// handed to the session, whose effects push it to every peer.
    pub(super) fn commit_own_log(
        &mut self,
        log: &nuwa_identity::chain::DidChain,
    ) -> Result<Vec<Effect>, ApiError> {
        home::save_log(&self.home_dir, log)
            .map_err(|e| ApiError::new(ErrorCode::StorageFailed, format!("{e:#}")))?;
        self.session
            .adopt_own_update(log.clone(), None, home::now_ms())
            .map_err(|e| ApiError::new(ErrorCode::Internal, e.to_string()))
    }

    /// `device revoke`: sign the DID update removing the device, open a new
    /// key epoch for the rest, persist both, then hand them to the session,
    /// whose effects push them to every peer (which also drops the revoked
    /// device's connections). The reply waits for those effects.
    pub(super) fn on_revoke(
        &mut self,
        body: RevokeBody,
    ) -> Result<(RevokeReply, Vec<Effect>), ApiError> {
        let now_secs = home::now_unix_secs();
        let master = self.admin_key(now_secs)?;
        let r = lifecycle::revoke(
            self.session.log(),
            self.session.secure().keys(),
            &master,
            body.context_id.trim(),
            self.session.membership().context_id(),
            now_secs,
        )
        .map_err(|e| ApiError::new(ErrorCode::CannotRevoke, nuwa_agent::explain(&e)))?;
        drop(master);
        // Durable before anyone hears of it: keys first, so a crash never
        // leaves a log whose epoch key is lost.
        let persisted = home::save_keys(&self.home_dir, &r.keys)
            .and_then(|()| home::save_grant(&self.home_dir, &r.grant))
            .and_then(|()| home::save_log(&self.home_dir, &r.log));
        if let Err(e) = persisted {
            return Err(ApiError::new(ErrorCode::StorageFailed, format!("{e:#}")));
        }
        let key = r
            .keys
            .get(r.epoch)
            .cloned()
            .ok_or_else(|| ApiError::new(ErrorCode::Internal, "new epoch key missing"))?;
        let effects = self
            .session
            .adopt_own_update(r.log.clone(), Some((key, r.grant.clone())), home::now_ms())
            .map_err(|e| ApiError::new(ErrorCode::Internal, e.to_string()))?;
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

impl Daemon {
    /// `device provision` while this daemon runs: the daemon signs the DID
    /// update from its own log and writes the new home, so the log on disk,
    /// the daemon's and the new device's are one. The update reaches peers
    /// like any other (Hellos re-sent by the session's effects).
    pub(super) fn on_provision(
        &mut self,
        body: ProvisionBody,
    ) -> Result<(serde_json::Value, Vec<Effect>), ApiError> {
        let out = std::path::PathBuf::from(&body.out);
        if !out.is_absolute() {
            return Err(ApiError::new(
                ErrorCode::BadRequest,
                "`out` must be an absolute path",
            ));
        }
        let name = body.name.trim();
        if name.is_empty() || name.len() > 64 {
            return Err(ApiError::new(
                ErrorCode::BadName,
                "a device name is 1 to 64 bytes",
            ));
        }
        let now_secs = home::now_unix_secs();
        let master = self.admin_key(now_secs)?;
        let (_out_lock, device) = home::prepare_new_home(&out)
            .map_err(|e| ApiError::new(ErrorCode::BadRequest, format!("{e:#}")))?;
        let mut log = self.session.log().clone();
        let context_id = home::add_device_key(&mut log, &master, &device)
            .map_err(|e| ApiError::new(ErrorCode::Internal, format!("{e:#}")))?;
        drop(master);
        // Our own log first: once it is durable the device exists, and a
        // crash before the new home is complete leaves only a listed key
        // nobody holds (revocable), never a home the agent does not know.
        let effects = self.commit_own_log(&log)?;
        let info = home::write_new_home(
            &out,
            &device,
            name,
            &log,
            self.session.secure().keys(),
            Some(self.session.membership().epoch_grant()).filter(|g| !g.is_empty()),
        )
        .map_err(|e| ApiError::new(ErrorCode::StorageFailed, format!("{e:#}")))?;
        info!(device = %context_id, out = %out.display(), "device provisioned");
        let reply = ProvisionReply {
            context_id: info.context_id,
            name: info.name,
            out: out.display().to_string(),
            did_log_len: log.len(),
        };
        let reply = serde_json::to_value(reply)
            .map_err(|e| ApiError::new(ErrorCode::Internal, e.to_string()))?;
        Ok((reply, effects))
    }
}

impl Daemon {
    /// `device promote`, `device demote` and `recovery create` while this
    /// daemon runs: sign the DID update with this home's admin key, persist
    /// the log, then hand it to the session, whose effects push it to every
    /// peer. No new key epoch: nobody loses access.
    pub(super) fn on_admin_change(
        &mut self,
        change: AdminChange,
    ) -> Result<(serde_json::Value, Vec<Effect>), ApiError> {
        let now_secs = home::now_unix_secs();
        let admin = self.admin_key(now_secs)?;
        let refused = |e: lifecycle::LifecycleError| {
            ApiError::new(ErrorCode::CannotChangeDevices, nuwa_agent::explain(&e))
        };
        let log = self.session.log();
        let (log, change, subject) = match change {
            AdminChange::Promote(b) => (
                lifecycle::promote(log, &admin, &b.context_id, now_secs).map_err(refused)?,
                "promoted",
                b.context_id.trim().to_owned(),
            ),
            AdminChange::Demote(b) => (
                lifecycle::demote(log, &admin, &b.context_id, now_secs).map_err(refused)?,
                "demoted",
                b.context_id.trim().to_owned(),
            ),
            AdminChange::RecoveryKey(b) => {
                let public: [u8; 32] = hex::decode(b.public_key_hex.trim())
                    .ok()
                    .and_then(|v| v.try_into().ok())
                    .ok_or_else(|| {
                        ApiError::new(
                            ErrorCode::BadRequest,
                            "public_key_hex must be 64 hex digits (a 32-byte Ed25519 key)",
                        )
                    })?;
                let (log, key_id) =
                    lifecycle::set_recovery_key(log, &admin, &public, now_secs).map_err(refused)?;
                (log, "recovery_key", key_id)
            }
        };
        drop(admin);
        let effects = self.commit_own_log(&log)?;
        info!(change, subject = %subject, "DID document changed");
        let reply = AdminReply {
            change: change.to_owned(),
            subject,
            did_log_len: log.len(),
        };
        let reply = serde_json::to_value(reply)
            .map_err(|e| ApiError::new(ErrorCode::Internal, e.to_string()))?;
        Ok((reply, effects))
    }
}
