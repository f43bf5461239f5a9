//! This device's standing in the agent, and the changes it signs while it
//! runs: revocation (with a new key epoch for the rest), provisioning,
//! promotion, demotion and the recovery key, and signing again what a lost
//! fork of the DID chain dropped. Whether this device was revoked gates
//! local writes. (Adopting grants that peers forward, and holding envelopes
//! of an epoch still on its way, are the session's: `nuwa_sync::session`.)

use std::collections::BTreeMap;

use nuwa_identity::chain::DidChain;
use nuwa_identity::document::DidDocument;
use nuwa_identity::keys::DeviceKey;
use nuwa_sync::{Membership, Session};
use tracing::{info, warn};

use crate::agent::{Agent, Out};
use crate::api::{
    AdminChange, AdminReply, ApiError, ErrorCode, ProvisionBody, ProvisionReply, RevokeBody,
    RevokeReply,
};
use crate::count::Count;
use crate::effect::{Effect, NewHome};
use crate::input::RequestId;
use crate::lifecycle::{self, Admin};
use crate::stranded::LocalWrites;

/// Who this device is to the agent beyond its device key.
pub(crate) struct Standing {
    /// The master key of `init`, on the home that holds it (read by the
    /// shell at start; the daemon signs with it while it is listed).
    master: Option<DeviceKey>,
    /// The DID chain as last saved: a new chain that does not extend it
    /// came from a fork this device lost.
    saved: DidChain,
    /// This device was listed in the DID chain and no longer is: it
    /// refuses local writes and redials with backoff.
    revoked: bool,
    /// When recent local changes were made, and once revoked, which of
    /// them never sync.
    pub(crate) writes: LocalWrites,
    /// This device's own entry expired (`--expires`): it stands as a
    /// revoked one, whether or not an admin pruned it yet.
    expired: bool,
}

impl Standing {
    pub(crate) fn new(
        master: Option<DeviceKey>,
        saved: &DidChain,
        meta: &BTreeMap<String, Vec<u8>>,
        now_ms: u64,
    ) -> Self {
        Standing {
            master,
            saved: saved.clone(),
            revoked: false,
            writes: LocalWrites::from_meta(meta, now_ms),
            expired: false,
        }
    }

    pub(crate) fn revoked(&self) -> bool {
        self.revoked
    }

    /// The public half of the master key, if this home holds it.
    pub(crate) fn master_public(&self) -> Option<[u8; 32]> {
        self.master.as_ref().map(|k| k.public())
    }

    /// Re-checks whether this device was revoked (at start and when the
    /// chain grows), says once what it means, and decides which local
    /// changes never sync.
    pub(crate) fn check_revoked(&mut self, m: &Membership, now_ms: u64) {
        let now = is_revoked(m) || self.expired;
        if now {
            self.writes
                .revoked(removed_at_ms(m.log(), m.context_id()), now_ms);
        }
        if now && !self.revoked && !self.expired && ran_out(m, now_ms) {
            // Pruned after its time ran out: not a revocation.
            self.say_expired(m);
        } else if now && !self.revoked && !self.expired {
            warn!(
                context_id = %m.context_id(),
                "this device was revoked from the agent: its peers refuse it, it receives \
                 nothing new and it refuses local writes (they would never sync). To use this \
                 machine again: export what you need (`nuwa-node state export`), stop the \
                 daemon, move this home aside and pair anew (`nuwa-node pair`)"
            );
        }
        self.revoked = now;
    }

    /// On tick: once this device's own entry expired (grace included),
    /// its peers refuse it; it says so once and refuses local writes.
    pub(crate) fn check_expired(&mut self, m: &Membership, now_ms: u64) {
        let doc = m.log().current();
        let status = doc.key_status(&doc.key_id(m.context_id()), secs(now_ms));
        if self.expired || status != nuwa_identity::document::KeyStatus::Expired {
            return;
        }
        self.say_expired(m);
    }

    fn say_expired(&mut self, m: &Membership) {
        warn!(
            context_id = %m.context_id(),
            "this device's time ran out (it was provisioned or paired with --expires): its \
             peers refuse it, it receives nothing new and it refuses local writes (they would \
             never sync). Export what you need (`nuwa-node state export`) and provision a new \
             device for the next job"
        );
        self.expired = true;
        self.revoked = true;
    }

    /// The error for a write on a revoked device.
    pub(crate) fn revoked_error(&self, session: &Session) -> ApiError {
        if self.expired {
            return ApiError::new(
                ErrorCode::DeviceRevoked,
                format!(
                    "this device ({}) expired (it was provisioned or paired with --expires), so \
                     nothing written here would reach another device; the write was refused. \
                     Export what you need (`nuwa-node state export`) and provision a new device",
                    session.membership().context_id()
                ),
            );
        }
        ApiError::new(
            ErrorCode::DeviceRevoked,
            format!(
                "this device ({}) was revoked from the agent, so nothing written here would \
                 reach another device; the write was refused. To use this machine again: \
                 export what you need (`nuwa-node state export`), stop the daemon, move this \
                 home aside and pair anew (`nuwa-node pair`, approved on the device holding \
                 the master key)",
                session.membership().context_id()
            ),
        )
    }

    /// This home's admin key (see [`lifecycle::admin_of`]), or the API
    /// error that says why there is none.
    pub(crate) fn admin(&self, session: &Session, now_secs: i64) -> Result<Admin, ApiError> {
        lifecycle::admin_of(
            session.log(),
            session.membership().device(),
            self.master.as_ref(),
            now_secs,
        )
        .map_err(|e| ApiError::new(ErrorCode::NotKeyManager, crate::explain(&e)))
    }
}

/// Whether this device was revoked: its key was listed by an earlier
/// version of the DID document and the current one lacks it (an expired
/// key is not revoked: renewing it brings it back).
fn is_revoked(m: &Membership) -> bool {
    let ctx = m.context_id();
    let listed_before = m.log().documents().any(|d| lists(&d, ctx));
    listed_before && !lists(m.log().current(), ctx)
}

fn lists(d: &DidDocument, context_id: &str) -> bool {
    d.verification_method
        .iter()
        .any(|vm| DidDocument::fragment(&vm.id) == context_id)
}

/// When the chain last removed `context_id`: the time (Unix ms) of the
/// latest entry after which its document no longer lists a device the one
/// before listed. `None` when no entry of the chain did (a removal on a
/// branch that lost, which `DidChain::current` still honours).
fn removed_at_ms(log: &DidChain, context_id: &str) -> Option<u64> {
    let mut listed = false;
    let mut removed_at = None;
    for (doc, entry) in log.documents().zip(log.entries()) {
        let now = lists(&doc, context_id);
        if listed && !now {
            removed_at = Some(
                u64::try_from(entry.timestamp())
                    .unwrap_or(0)
                    .saturating_mul(1000),
            );
        }
        listed = now;
    }
    removed_at
}

/// Whether this device's last listing in the chain had expired by now
/// (an admin pruned it after its time ran out).
fn ran_out(m: &Membership, now_ms: u64) -> bool {
    let ctx = m.context_id();
    m.log()
        .documents()
        .filter_map(|d| d.find_method(ctx).cloned())
        .last()
        .is_some_and(|vm| vm.check_not_expired(secs(now_ms)).is_err())
}

fn secs(now_ms: u64) -> i64 {
    (now_ms / 1000) as i64
}

impl Agent {
    /// A DID update this device signed with no new epoch: saved first (the
    /// executor's persist phase), then adopted by the session, whose
    /// effects push it to every peer.
    pub(crate) fn commit_own_chain(
        &mut self,
        log: &DidChain,
        now_ms: u64,
        out: &mut Out,
    ) -> Result<(), ApiError> {
        let effects = self
            .session
            .adopt_own_update(log.clone(), None, now_ms)
            .map_err(|e| ApiError::new(ErrorCode::Internal, e.to_string()))?;
        self.standing.saved = log.clone();
        out.push(Effect::SaveLog(Box::new(log.clone())));
        self.absorb(effects, now_ms, out);
        Ok(())
    }

    /// `device revoke`: sign the DID update removing the device, open a new
    /// key epoch for the rest, and hand both to the session, whose effects
    /// push them to every peer (which also drops the revoked device's
    /// connections). Keys are saved before the chain: a crash never leaves
    /// a chain whose epoch key is lost.
    pub(crate) fn on_revoke(
        &mut self,
        body: RevokeBody,
        now_ms: u64,
        out: &mut Out,
    ) -> Result<RevokeReply, ApiError> {
        let admin = self.standing.admin(&self.session, secs(now_ms))?;
        let r = lifecycle::revoke(
            self.session.log(),
            self.session.secure().keys(),
            &admin,
            body.context_id.trim(),
            self.session.membership().context_id(),
            secs(now_ms),
        )
        .map_err(|e| ApiError::new(ErrorCode::CannotRevoke, crate::explain(&e)))?;
        drop(admin);
        let key = r
            .keys
            .get(r.epoch)
            .cloned()
            .ok_or_else(|| ApiError::new(ErrorCode::Internal, "new epoch key missing"))?;
        let effects = self
            .session
            .adopt_own_update(r.log.clone(), Some((key, r.grant.clone())), now_ms)
            .map_err(|e| ApiError::new(ErrorCode::Internal, e.to_string()))?;
        out.push(Effect::SaveKeys {
            keys: Box::new(r.keys.clone()),
            grant: Some(r.grant.clone()),
        });
        self.standing.saved = r.log.clone();
        out.push(Effect::SaveLog(Box::new(r.log.clone())));
        self.absorb(effects, now_ms, out);
        out.count(Count::DevicesRevoked);
        info!(revoked = %body.context_id, epoch = r.epoch, "device revoked; new key epoch opened");
        Ok(RevokeReply {
            revoked: body.context_id.trim().to_owned(),
            epoch: r.epoch,
            did_log_len: r.log.len(),
            remaining: r.remaining,
        })
    }

    /// `device provision` while the daemon runs: the shell made the new
    /// home's directory and device key; the agent lists the key, and the
    /// shell saves the chain and then writes the new home, so the chain on
    /// disk, the daemon's and the new device's are one. A crash between
    /// the two leaves only a listed key nobody holds (revocable), never a
    /// home the agent does not know.
    pub(crate) fn on_provision(
        &mut self,
        id: RequestId,
        body: ProvisionBody,
        device: DeviceKey,
        now_ms: u64,
        out: &mut Out,
    ) -> Result<serde_json::Value, ApiError> {
        // No name is allowed, as `device provision` offline allows it
        // (`--help`: "default: none"); the device is listed by its id.
        let name = body.name.trim();
        if name.len() > nuwa_proto::MAX_DEVICE_NAME_BYTES {
            return Err(ApiError::new(
                ErrorCode::BadName,
                "a device name is at most 64 bytes",
            ));
        }
        let expires = body
            .expires_secs
            .map(|s| {
                crate::expiry::check_secs(s).map(|s| crate::expiry::expires_at(secs(now_ms), s))
            })
            .transpose()
            .map_err(|e| ApiError::new(ErrorCode::BadRequest, e.to_string()))?;
        let admin = self.standing.admin(&self.session, secs(now_ms))?;
        // Room first: devices whose time ran out leave before one is added.
        self.prune_expired(now_ms, out);
        let mut log = self.session.log().clone();
        let x25519 = nuwa_identity::did_key::x25519_public_from_ed25519(&device.public())
            .map_err(|e| ApiError::new(ErrorCode::Internal, e.to_string()))?;
        let keys = (&device.public(), &x25519);
        let context_id =
            lifecycle::add_device_until(&mut log, &admin, keys, expires.clone(), secs(now_ms))
                .map_err(|e| ApiError::new(ErrorCode::CannotChangeDevices, crate::explain(&e)))?;
        drop(admin);
        self.commit_own_chain(&log, now_ms, out)?;
        let grant =
            Some(self.session.membership().epoch_grant().to_vec()).filter(|g| !g.is_empty());
        out.push(Effect::WriteHome {
            request: id,
            home: Box::new(NewHome {
                out: body.out.clone(),
                device,
                name: name.to_owned(),
                log: log.clone(),
                keys: self.session.secure().keys().clone(),
                grant,
            }),
        });
        info!(device = %context_id, out = %body.out, expires = ?expires, "device provisioned");
        let reply = ProvisionReply {
            context_id,
            name: name.to_owned(),
            out: body.out,
            did_log_len: log.len(),
            expires,
        };
        serde_json::to_value(reply).map_err(|e| ApiError::new(ErrorCode::Internal, e.to_string()))
    }

    /// `device promote`, `device demote` and `recovery create` while the
    /// daemon runs: signed with this home's admin key, saved, then handed
    /// to the session, whose effects push it to every peer. No new key
    /// epoch: nobody loses access.
    pub(crate) fn on_admin_change(
        &mut self,
        change: AdminChange,
        now_ms: u64,
        out: &mut Out,
    ) -> Result<serde_json::Value, ApiError> {
        let now_secs = secs(now_ms);
        let admin = self.standing.admin(&self.session, now_secs)?;
        let refused = |e: lifecycle::LifecycleError| {
            ApiError::new(ErrorCode::CannotChangeDevices, crate::explain(&e))
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
        self.commit_own_chain(&log, now_ms, out)?;
        info!(change, subject = %subject, "DID document changed");
        let reply = AdminReply {
            change: change.to_owned(),
            subject,
            did_log_len: log.len(),
        };
        serde_json::to_value(reply).map_err(|e| ApiError::new(ErrorCode::Internal, e.to_string()))
    }

    /// The session adopted a peer's chain: save it. If it was not an
    /// extension of the one last saved but another branch that won the
    /// fork rule, the DID updates this home signed on the losing branch
    /// are gone: sign their changes again, as one update on top of the
    /// winner, and hand it to the session (its effects send it to every
    /// peer).
    pub(crate) fn save_chain(&mut self, now_ms: u64, out: &mut Out) {
        let new = self.session.log().clone();
        let old = std::mem::replace(&mut self.standing.saved, new.clone());
        out.push(Effect::SaveLog(Box::new(new.clone())));
        // Removals first, with their own key epoch; what this device
        // signed on a lost branch is signed again on top of them.
        self.sign_standing_removals(now_ms, out);
        if new.hash_at(old.len() - 1) != Some(old.head_hash()) {
            self.rebase_lost(&old, now_ms, out);
        }
    }

    /// Strong removal: a branch that lost the fork rule removed devices
    /// our chain still lists. Every device leaves them out already
    /// (`DidChain::current`); an admin also signs the removal on our
    /// chain and opens a new key epoch without them, so the chain itself
    /// says so and nothing written from now on is sealed to them.
    fn sign_standing_removals(&mut self, now_ms: u64, out: &mut Out) {
        let removed = self.session.log().standing_removals();
        if removed.is_empty() {
            return;
        }
        let Ok(admin) = self.standing.admin(&self.session, secs(now_ms)) else {
            info!(
                devices = removed.len(),
                "DID log: another branch removed devices this chain lists; they stay out, \
                 and an admin device signs their removal when it hears of it"
            );
            return;
        };
        let r = match lifecycle::sign_standing_removals(
            self.session.log(),
            self.session.secure().keys(),
            &admin,
            secs(now_ms),
        ) {
            Ok(Some(r)) => r,
            Ok(None) => return,
            Err(e) => {
                warn!(error = %crate::explain(&e), "DID log: cannot sign the removals another branch made");
                return;
            }
        };
        drop(admin);
        let epoch = r.epoch;
        if self.adopt_with_epoch(r, now_ms, out) {
            let devices = removed
                .iter()
                .filter(|id| !id.ends_with(lifecycle::X25519_SUFFIX))
                .count();
            out.count_by(Count::DevicesRevoked, devices as u64);
            info!(
                removed = ?removed,
                epoch,
                "DID log: signed the removal of devices another branch removed; new key epoch opened"
            );
        }
    }

    /// Hands a chain this device signed with a new key epoch to the
    /// session, keys saved before the chain (as `device revoke` does).
    pub(crate) fn adopt_with_epoch(
        &mut self,
        r: lifecycle::Revocation,
        now_ms: u64,
        out: &mut Out,
    ) -> bool {
        let Some(key) = r.keys.get(r.epoch).cloned() else {
            return false;
        };
        match self
            .session
            .adopt_own_update(r.log.clone(), Some((key, r.grant.clone())), now_ms)
        {
            Ok(effects) => {
                out.push(Effect::SaveKeys {
                    keys: Box::new(r.keys),
                    grant: Some(r.grant),
                });
                self.standing.saved = r.log.clone();
                out.push(Effect::SaveLog(Box::new(r.log)));
                self.absorb(effects, now_ms, out);
                true
            }
            Err(e) => {
                warn!(error = %e, "DID log: the signed update was refused");
                false
            }
        }
    }

    /// Our chain moved from `old` to another branch that won the fork rule.
    fn rebase_lost(&mut self, old: &DidChain, now_ms: u64, out: &mut Out) {
        let new = self.session.log().clone();
        out.count(Count::DidLogForksLost);
        let mut own = vec![self.session.membership().device().public()];
        own.extend(self.standing.master_public());
        let Some((doc, n)) = lifecycle::rebased_document(old, &new, &own) else {
            info!(
                "DID log fork: another branch won the fork rule; no update of this device was dropped"
            );
            return;
        };
        let admin = match self.standing.admin(&self.session, secs(now_ms)) {
            Ok(a) => a,
            Err(_) => {
                warn!(
                    updates = n,
                    "DID log fork: another branch won and it took this device's admin rights, \
                     so its {n} dropped update(s) cannot be signed again; if that branch is not \
                     yours, recover with the recovery words (`nuwa-node recover`)"
                );
                return;
            }
        };
        // A new key epoch too: the devices this update adds (a pairing
        // the winner did not hold) hold none of the winner's epochs, and
        // those it removes may hold them all.
        let r = match lifecycle::sign_with_epoch(
            &new,
            self.session.secure().keys(),
            &admin,
            &doc,
            secs(now_ms),
        ) {
            Ok(r) => r,
            Err(e) => {
                warn!(error = %crate::explain(&e), "DID log fork: cannot sign this device's dropped updates again");
                return;
            }
        };
        drop(admin);
        if self.adopt_with_epoch(r, now_ms, out) {
            out.count_by(Count::DidLogUpdatesRebased, n as u64);
            info!(
                updates = n,
                "DID log fork: another branch won the fork rule; this device's dropped \
                 updates were signed again on top of it, with a new key epoch"
            );
        }
    }
}
