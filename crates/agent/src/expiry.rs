//! Time-limited devices (`--expires` of `device provision`, `pair` and
//! `device approve`): reading the duration a user gives, the instant it
//! puts in the device's DID entry, and pruning.
//!
//! A device that expires is listed with an `expires` instant on both its
//! Ed25519 and its X25519 method; once that instant and
//! [`EXPIRY_GRACE_SECS`] have passed, every peer and keeper refuses it (the
//! DID document says so; no revocation is needed) and no epoch grant is
//! sealed to it. What is left is its entry, which every `Hello` and DHT
//! pointer carries in the proof: an admin's agent prunes expired devices
//! from the chain, all of them in one signed update with a new key epoch
//! for the rest, as revocation does. It does so at most once per
//! [`PRUNE_EXPIRED_EVERY_MS`], or at once when the proof nears what a
//! `Hello` and a pointer carry. Only the document's first admin prunes
//! at that pace; another admin waits [`PRUNE_FALLBACK_SECS`] longer, so
//! two admins do not fork the chain over the same prune.
//!
//! The pure part (parsing, which devices, the signed update) is free
//! functions; the decision of when is the agent's, on its tick.

use nuwa_crypto::epoch::KeyRing;
use nuwa_identity::chain::DidChain;
use nuwa_identity::document::{DidDocument, EXPIRY_GRACE_SECS, KeyStatus};
use time::OffsetDateTime;
use time::format_description::well_known::Rfc3339;
use tracing::{info, warn};

use crate::agent::{Agent, Out};
use crate::constants::{
    MAX_EXPIRES_SECS, PRUNE_AT_METHODS, PRUNE_AT_PROOF_BYTES, PRUNE_EXPIRED_EVERY_MS,
    PRUNE_FALLBACK_SECS,
};
use crate::count::Count;
use crate::lifecycle::{self, Admin, LifecycleError, Revocation, X25519_SUFFIX};

/// Why an `--expires` value was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ExpiresError {
    #[error(
        "--expires {0:?} is neither a duration nor an RFC 3339 instant; give e.g. 30s, 10m, 2h, \
         30d or 2030-01-31T12:00:00Z"
    )]
    Unreadable(String),
    #[error(
        "--expires {0:?} is zero: the device would expire before it could sync; give a \
         duration such as 10m"
    )]
    Zero(String),
    #[error(
        "--expires {given:?} is {ago_secs} s in the past; give a future instant or a duration \
         such as 10m"
    )]
    InThePast { given: String, ago_secs: i64 },
    #[error(
        "--expires {0:?} is more than ten years away; leave --expires out for a device that \
         stays, and revoke it when it is done (`nuwa-node device revoke`)"
    )]
    TooLong(String),
}

/// Reads an `--expires` value: a duration (`30s`, `10m`, `2h`, `30d`; a
/// bare number is seconds) or an RFC 3339 instant. Returns the seconds
/// from `now_secs` until the device expires.
pub fn parse_expires(text: &str, now_secs: i64) -> Result<u64, ExpiresError> {
    let t = text.trim();
    let secs = if let Ok(at) = OffsetDateTime::parse(t, &Rfc3339) {
        let left = at.unix_timestamp() - now_secs;
        if left <= 0 {
            return Err(ExpiresError::InThePast {
                given: t.to_owned(),
                ago_secs: -left,
            });
        }
        left as u64
    } else {
        let with_unit = if !t.is_empty() && t.bytes().all(|b| b.is_ascii_digit()) {
            format!("{t}s")
        } else {
            t.to_owned()
        };
        let d = humantime::parse_duration(&with_unit)
            .map_err(|_| ExpiresError::Unreadable(t.to_owned()))?;
        // Below a second rounds up: `500ms` is a device of one second.
        d.as_secs() + u64::from(d.subsec_nanos() > 0)
    };
    match secs {
        0 => Err(ExpiresError::Zero(t.to_owned())),
        s if s > MAX_EXPIRES_SECS => Err(ExpiresError::TooLong(t.to_owned())),
        s => Ok(s),
    }
}

/// Checks an expiry that came as seconds over the API (the CLI parsed it
/// with [`parse_expires`]; a pairing peer sent it).
pub fn check_secs(secs: u64) -> Result<u64, ExpiresError> {
    match secs {
        0 => Err(ExpiresError::Zero("0s".to_owned())),
        s if s > MAX_EXPIRES_SECS => Err(ExpiresError::TooLong(format!("{s}s"))),
        s => Ok(s),
    }
}

/// The shorter of two requested expiries (the joining device's and the
/// approver's): a device expires when the first of them says so.
pub fn shorter(a: Option<u64>, b: Option<u64>) -> Option<u64> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// The `expires` value (RFC 3339, UTC, whole seconds) of a device that
/// expires `in_secs` after `now_secs`.
pub fn expires_at(now_secs: i64, in_secs: u64) -> String {
    let at = now_secs.saturating_add(in_secs.min(MAX_EXPIRES_SECS) as i64);
    OffsetDateTime::from_unix_timestamp(at)
        .ok()
        .and_then(|t| t.format(&Rfc3339).ok())
        .unwrap_or_else(|| "9999-12-31T23:59:59Z".to_owned())
}

/// The devices of `doc` whose key expired (grace included) by `now_secs`,
/// with the instant each expired (Unix seconds), oldest first. Recovery
/// keys never expire this way and are left out.
pub fn expired_devices(doc: &DidDocument, now_secs: i64) -> Vec<(String, i64)> {
    let mut out: Vec<(String, i64)> = doc
        .verification_method
        .iter()
        .filter(|m| {
            let f = DidDocument::fragment(&m.id);
            !f.ends_with(X25519_SUFFIX) && !lifecycle::is_recovery_key(f)
        })
        .filter(|m| doc.key_status(&m.id, now_secs) == KeyStatus::Expired)
        .map(|m| {
            let at = m.expires_unix_secs().ok().flatten().unwrap_or(i64::MIN);
            (DidDocument::fragment(&m.id).to_owned(), at)
        })
        .collect();
    out.sort_by_key(|(f, at)| (*at, f.clone()));
    out
}

/// The signed update that removes `devices` (context ids, with their
/// X25519 keys) from `log`'s current document, and a new key epoch sealed
/// to every device left, as [`lifecycle::revoke`] does for one.
pub fn prune(
    log: &DidChain,
    keys: &KeyRing,
    admin: &Admin,
    devices: &[String],
    now_secs: i64,
) -> Result<Revocation, LifecycleError> {
    let mut next = log.current().clone();
    for d in devices {
        for id in [d.clone(), format!("{d}{X25519_SUFFIX}")] {
            if next.find_method(&id).is_some() {
                next.remove_key(&id)
                    .map_err(|source| LifecycleError::Document {
                        what: format!("remove {id}"),
                        source,
                    })?;
            }
        }
    }
    if lifecycle::no_admin_device(&next) {
        return Err(LifecycleError::Refused(
            "pruning the expired devices would leave no admin device; promote a device that \
             does not expire (`nuwa-node device promote ID`)"
                .to_owned(),
        ));
    }
    lifecycle::sign_removal(log, keys, admin, &next, devices, 0, now_secs)
}

/// Whether the proof of `log` is near what a `Hello` and a DHT pointer
/// carry: then expired devices are pruned at once, whatever the rate.
pub fn near_limit(log: &DidChain) -> bool {
    log.current().verification_method.len() >= PRUNE_AT_METHODS
        || log
            .proof()
            .encode()
            .map_or(true, |b| b.len() > PRUNE_AT_PROOF_BYTES)
}

/// What the agent remembers about pruning between ticks.
#[derive(Debug, Default)]
pub(crate) struct Pruning {
    /// When this device last pruned.
    last_ms: Option<u64>,
    /// The chain head whose proof was last found near the limit or not
    /// (encoding a proof each tick would cost for nothing).
    checked: Option<(String, bool)>,
}

impl Agent {
    /// On tick: a verified peer whose device expired since its Hello is
    /// hung up on and refused like one whose Hello came after (its later
    /// Hellos are refused by the session as `key_expired`); and this
    /// device, once its own entry expired, stands as revoked.
    pub(crate) fn drop_expired_peers(&mut self, now_ms: u64, out: &mut Out) {
        self.standing
            .check_expired(self.session.membership(), now_ms);
        let now_secs = (now_ms / 1000) as i64;
        let doc = self.session.log().current();
        let expired: Vec<String> = self
            .session
            .verified()
            .filter(|(_, ctx)| doc.key_status(&doc.key_id(ctx), now_secs) == KeyStatus::Expired)
            .map(|(peer, _)| peer.clone())
            .collect();
        for peer in expired {
            info!(%peer, "peer's device expired (--expires): hanging up, it is refused from now on");
            let effects = self.session.hang_up(&peer);
            self.absorb(effects, now_ms, out);
            out.count(Count::PeersRefusedExpired);
            let expired = nuwa_sync::Rejection::KeyExpired;
            self.reject("connection", peer, &expired, now_ms, out);
        }
    }

    /// On tick (and before a provision): an admin prunes the devices that
    /// expired (grace included) from the chain, at most once per
    /// [`PRUNE_EXPIRED_EVERY_MS`] unless the proof nears its limit.
    pub(crate) fn prune_expired(&mut self, now_ms: u64, out: &mut Out) {
        let now_secs = (now_ms / 1000) as i64;
        let log = self.session.log();
        let expired = expired_devices(log.current(), now_secs);
        if expired.is_empty() || self.standing.revoked() {
            return;
        }
        let Ok(admin) = self.standing.admin(&self.session, now_secs) else {
            return;
        };
        let head = log.head_hash().to_owned();
        let near = match &self.pruning.checked {
            Some((h, near)) if *h == head => *near,
            _ => {
                let near = near_limit(log);
                self.pruning.checked = Some((head, near));
                near
            }
        };
        let rested = self
            .pruning
            .last_ms
            .is_none_or(|t| now_ms >= t.saturating_add(PRUNE_EXPIRED_EVERY_MS));
        let first = log
            .current()
            .capability_delegation
            .iter()
            .find(|id| !lifecycle::is_recovery_key(id))
            .is_some_and(|id| *id == admin.key_id);
        // The first admin prunes; another one only what the first has left
        // for an hour (it may be gone).
        let oldest = expired.first().map_or(i64::MAX, |(_, at)| *at);
        let long_ago = oldest.saturating_add(EXPIRY_GRACE_SECS + PRUNE_FALLBACK_SECS) < now_secs;
        if !(near || rested) || !(first || long_ago) {
            return;
        }
        let devices: Vec<String> = expired.into_iter().map(|(d, _)| d).collect();
        let r = match prune(
            log,
            self.session.secure().keys(),
            &admin,
            &devices,
            now_secs,
        ) {
            Ok(r) => r,
            Err(e) => {
                warn!(error = %crate::explain(&e), "cannot prune the expired devices from the DID log");
                self.pruning.last_ms = Some(now_ms);
                return;
            }
        };
        drop(admin);
        self.pruning.last_ms = Some(now_ms);
        let epoch = r.epoch;
        if self.adopt_with_epoch(r, now_ms, out) {
            out.count_by(Count::ExpiredDevicesPruned, devices.len() as u64);
            info!(
                pruned = ?devices,
                epoch,
                "DID log: removed the devices whose time ran out; new key epoch opened for the rest"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // Goal: every way of writing --expires gives the seconds it says, and
    // bad input a typed error that says what to do. Method: a table.
    #[test]
    fn expires_reads_durations_and_instants() {
        let now = 1_800_000_000; // 2027-01-15T08:00:00Z
        let cases: &[(&str, Result<u64, &str>)] = &[
            ("5s", Ok(5)),
            ("5", Ok(5)),
            ("10m", Ok(600)),
            ("2h", Ok(7200)),
            ("30d", Ok(30 * 86_400)),
            (" 1h 30m ", Ok(5400)),
            ("500ms", Ok(1)),
            ("2027-01-15T08:10:00Z", Ok(600)),
            ("0s", Err("zero")),
            ("0", Err("zero")),
            ("", Err("unreadable")),
            ("soon", Err("unreadable")),
            ("-5m", Err("unreadable")),
            ("2027-01-15T07:59:00Z", Err("past")),
            ("2027-01-15T08:00:00Z", Err("past")),
            ("11years", Err("long")),
        ];
        for (text, want) in cases {
            let got = parse_expires(text, now).map_err(|e| match e {
                ExpiresError::Unreadable(_) => "unreadable",
                ExpiresError::Zero(_) => "zero",
                ExpiresError::InThePast { .. } => "past",
                ExpiresError::TooLong(_) => "long",
            });
            assert_eq!(&got, want, "{text:?}");
        }
        let e = parse_expires("2027-01-15T07:59:00Z", now).unwrap_err();
        assert_eq!(
            e.to_string(),
            "--expires \"2027-01-15T07:59:00Z\" is 60 s in the past; give a future instant or a \
             duration such as 10m"
        );
        assert_eq!(expires_at(now, 600), "2027-01-15T08:10:00Z");
        assert_eq!(shorter(Some(60), Some(30)), Some(30));
        assert_eq!(shorter(None, Some(30)), Some(30));
        assert_eq!(shorter(Some(60), None), Some(60));
        assert_eq!(shorter(None, None), None);
        assert!(check_secs(0).is_err() && check_secs(MAX_EXPIRES_SECS + 1).is_err());
    }
}
