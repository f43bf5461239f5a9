//! Verifying a capability chain: what an app's capability lets it do right now.
//!
//! From the first-level capability down to the one presented, each link is
//! checked in this order: its proof verifies; its delegator has authority
//! (an admin of the agent for the first level, the parent's `controller`
//! below); it grants no more than its parent (or, at the first level, than
//! its root's target); its proof is not dated in the future; it has not
//! expired; it is not revoked. The root id is checked for revocation first,
//! so revoking `urn:zcap:root:<target>` revokes every capability from it.
//! The proof comes first so that a tampered field reports `bad_proof`, and
//! no unsigned claim is believed.
//!
//! Which keys are admins and which ids are revoked are the caller's
//! knowledge, passed as closures and asked at every verification, so that
//! removing an admin or revoking an id takes effect at once.

use std::collections::BTreeSet;

use nuwa_identity::did_key::did_key_from_ed25519;

use crate::access::covers;
use crate::action::{self, Action};
use crate::capability::{Capability, root_target, shorten};
use crate::error::CapError;
use crate::limits::MAX_CLOCK_SKEW_SECS;
use crate::proof;
use crate::timestamp;

/// What a verified capability lets its invoker do.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Verified {
    /// The Ed25519 key of the app that may invoke the capability.
    pub invoker_public: [u8; 32],
    /// Its did:key (the capability's `controller`).
    pub invoker_did: String,
    /// The capability's `invocationTarget`.
    pub target: String,
    /// The capability's `allowedAction`.
    pub actions: BTreeSet<Action>,
    /// The capability's `expires`, in unix seconds (no later than any ancestor's).
    pub expires_unix_secs: i64,
    /// The root id, then every capability's id from the first level down to
    /// the one presented.
    pub chain_ids: Vec<String>,
}

/// Parses and verifies a capability's JSON bytes at `now_unix_secs`.
///
/// `is_admin` says whether an Ed25519 key is an admin of this agent today;
/// `is_revoked` whether an id (capability or root) is revoked. See the
/// module docs for what is checked, in which order.
pub fn verify(
    cap_json: &[u8],
    now_unix_secs: i64,
    is_admin: impl Fn(&[u8; 32]) -> bool,
    is_revoked: impl Fn(&str) -> bool,
) -> Result<Verified, CapError> {
    let cap = Capability::from_json(cap_json)?;
    verify_capability(&cap, now_unix_secs, is_admin, is_revoked)
}

/// [`verify`] for a capability already parsed.
pub fn verify_capability(
    cap: &Capability,
    now_unix_secs: i64,
    is_admin: impl Fn(&[u8; 32]) -> bool,
    is_revoked: impl Fn(&str) -> bool,
) -> Result<Verified, CapError> {
    let root = cap.root_id();
    if is_revoked(root) {
        return Err(CapError::CapabilityRevoked {
            id: root.to_owned(),
        });
    }
    let root_target = root_target(root)
        .ok_or_else(|| CapError::malformed("the chain does not start with a root id"))?;
    let lineage = cap.lineage();
    let mut chain_ids = vec![root.to_owned()];
    for (level, link) in lineage.iter().enumerate() {
        if !proof::verifies(link) {
            return Err(CapError::BadProof {
                id: link.id.clone(),
                reason: "the signature does not match the capability and its proof options",
            });
        }
        let parent = level.checked_sub(1).and_then(|i| lineage.get(i));
        match parent {
            None => {
                if !is_admin(link.delegator_public()) {
                    return Err(CapError::NotAnAdmin {
                        id: link.id.clone(),
                        delegator: did_key_from_ed25519(link.delegator_public()),
                    });
                }
                check_attenuation(&root_target, None, link)?;
            }
            Some(parent) => {
                if link.delegator_public() != parent.controller_public() {
                    return Err(CapError::BadProof {
                        id: link.id.clone(),
                        reason: "it is not signed by the key its parent capability was delegated to",
                    });
                }
                check_attenuation(&parent.target, Some(parent), link)?;
            }
        }
        if link.created_unix_secs() > now_unix_secs.saturating_add(MAX_CLOCK_SKEW_SECS) {
            return Err(CapError::CapabilityNotYetValid {
                id: link.id.clone(),
                created: timestamp::display(link.created_unix_secs()),
            });
        }
        if link.expires_unix_secs <= now_unix_secs {
            return Err(CapError::CapabilityExpired {
                id: link.id.clone(),
                expires: timestamp::display(link.expires_unix_secs),
            });
        }
        if is_revoked(&link.id) {
            return Err(CapError::CapabilityRevoked {
                id: link.id.clone(),
            });
        }
        chain_ids.push(link.id.clone());
    }
    Ok(Verified {
        invoker_public: *cap.controller_public(),
        invoker_did: cap.controller.clone(),
        target: cap.target.clone(),
        actions: cap.actions.iter().copied().collect(),
        expires_unix_secs: cap.expires_unix_secs,
        chain_ids,
    })
}

/// Checks that `child` grants no more than `parent` (or, without a parent,
/// than the root's target allows): a target equal or narrower, actions a
/// subset, an expiry no later.
pub(crate) fn check_attenuation(
    parent_target: &str,
    parent: Option<&Capability>,
    child: &Capability,
) -> Result<(), CapError> {
    attenuation_reason(
        parent_target,
        parent.map(|p| (p.actions(), p.expires_unix_secs)),
        &child.target,
        &child.actions,
        child.expires_unix_secs,
    )
    .map_err(|reason| CapError::Attenuation {
        id: child.id.clone(),
        reason,
    })
}

/// Why a grant of (`target`, `actions`, `expires`) would widen its parent's,
/// if it would. `parent` is `None` for the root, which allows every action
/// and never expires.
pub(crate) fn attenuation_reason(
    parent_target: &str,
    parent: Option<(&[Action], i64)>,
    target: &str,
    actions: &[Action],
    expires_unix_secs: i64,
) -> Result<(), String> {
    if !covers(parent_target, target) {
        return Err(format!(
            "its target {} is not {parent_target} nor inside it",
            shorten(target)
        ));
    }
    if let Some((parent_actions, parent_expires)) = parent {
        let extra: Vec<&Action> = actions
            .iter()
            .filter(|a| !parent_actions.contains(a))
            .collect();
        if !extra.is_empty() {
            return Err(format!(
                "it allows {} that its parent (allowing {}) does not",
                action::join(extra),
                action::join(parent_actions)
            ));
        }
        if expires_unix_secs > parent_expires {
            return Err(format!(
                "it expires at {}, after its parent ({})",
                timestamp::display(expires_unix_secs),
                timestamp::display(parent_expires)
            ));
        }
    }
    Ok(())
}
