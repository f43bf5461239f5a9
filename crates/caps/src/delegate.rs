//! Issuing a capability: an admin delegating from the root, or an app
//! delegating (a narrower part of) its own capability to another key.
//!
//! Delegation is deterministic: the id and the time are arguments, and
//! Ed25519 signatures are deterministic, so the same inputs give the same
//! bytes. It refuses what a verifier would refuse, so a capability it
//! returns verifies, provided that the parent does and that the signer of a
//! first-level capability is an admin (which only the verifier knows).

use ed25519_dalek::SigningKey;
use nuwa_identity::did_key::{did_key_from_ed25519, ed25519_from_did_key};

use crate::action::Action;
use crate::capability::{
    Capability, Proof, check_id, check_target, root_id, verification_method_of,
};
use crate::error::CapError;
use crate::limits::{MAX_CAPABILITY_BYTES, MAX_CHAIN_DEPTH};
use crate::proof;
use crate::timestamp;
use crate::verify::attenuation_reason;

/// Delegates `actions` on `target` to `invoker_did` until `expires_unix_secs`,
/// signed by `signer` at `now_unix_secs`, with the id `id`
/// (`urn:uuid:<uuid>`, which the caller draws at random).
///
/// Without `parent` the capability hangs from the root of `target` and
/// `signer` must be an admin of the agent. With `parent`, `signer` must be
/// the key the parent was delegated to, and the new capability may only
/// narrow it ([`CapError::Attenuation`] otherwise). `actions` are written in
/// canonical order without repeats.
#[expect(
    clippy::too_many_arguments,
    reason = "the signature the app API was specified with; every argument is a plain value the caller has"
)]
pub fn delegate(
    parent: Option<&Capability>,
    signer: &SigningKey,
    invoker_did: &str,
    target: &str,
    actions: &[Action],
    expires_unix_secs: i64,
    now_unix_secs: i64,
    id: String,
) -> Result<Capability, CapError> {
    check_id(&id).map_err(|reason| CapError::input("id", reason))?;
    let controller_public = ed25519_from_did_key(invoker_did)
        .map_err(|e| CapError::input("invoker did", e.to_string()))?;
    check_target(target).map_err(|reason| CapError::input("target", reason))?;
    let actions = canonical_actions(actions)?;
    check_times(now_unix_secs, expires_unix_secs)?;
    let signer_public = signer.verifying_key().to_bytes();

    if let Some(parent) = parent {
        check_parent(parent, &signer_public, now_unix_secs)?;
        attenuation_reason(
            parent.target(),
            Some((parent.actions(), parent.expires_unix_secs())),
            target,
            &actions,
            expires_unix_secs,
        )
        .map_err(|reason| CapError::Attenuation {
            id: id.clone(),
            reason,
        })?;
    }
    let (parent_capability, chain_ids) = ancestor_ids(parent, target);
    if id == parent_capability || chain_ids.contains(&id) {
        return Err(CapError::input(
            "id",
            "it repeats an ancestor's id; draw a fresh one",
        ));
    }

    let mut cap = Capability {
        id,
        // Respelled from the key, so the capability holds the one canonical did:key.
        controller: did_key_from_ed25519(&controller_public),
        controller_public,
        target: target.to_owned(),
        actions,
        expires_unix_secs,
        parent_capability,
        proof: Proof {
            created_unix_secs: now_unix_secs,
            verification_method: verification_method_of(&signer_public),
            delegator_public: signer_public,
            chain_ids,
            parent: parent.map(|p| Box::new(p.clone())),
            proof_value: [0; 64],
        },
    };
    proof::sign(&mut cap, signer);
    let len = cap.to_json().len();
    if len > MAX_CAPABILITY_BYTES {
        return Err(CapError::CapabilityTooLarge {
            len,
            max: MAX_CAPABILITY_BYTES,
        });
    }
    Ok(cap)
}

/// `actions` in canonical order without repeats, as a capability writes
/// them; refuses none at all.
fn canonical_actions(actions: &[Action]) -> Result<Vec<Action>, CapError> {
    let actions: Vec<Action> = Action::ALL
        .into_iter()
        .filter(|a| actions.contains(a))
        .collect();
    if actions.is_empty() {
        return Err(CapError::input(
            "actions",
            "a capability allows at least one action",
        ));
    }
    Ok(actions)
}

/// Refuses times a capability cannot write (outside the years 0000 to 9999)
/// and a capability that would be born expired.
fn check_times(now_unix_secs: i64, expires_unix_secs: i64) -> Result<(), CapError> {
    if timestamp::format(now_unix_secs).is_none() || timestamp::format(expires_unix_secs).is_none()
    {
        return Err(CapError::input(
            "time",
            "now and expires must lie between the years 0000 and 9999",
        ));
    }
    if expires_unix_secs <= now_unix_secs {
        return Err(CapError::input(
            "expires",
            format!(
                "{} is not after now ({})",
                timestamp::display(expires_unix_secs),
                timestamp::display(now_unix_secs)
            ),
        ));
    }
    Ok(())
}

/// Refuses a parent that `signer_public` may not delegate from at
/// `now_unix_secs`, as a verifier would: a chain already at its deepest, a
/// parent delegated to another key, or an expired parent. Whether the child
/// narrows the parent is checked apart, by [`attenuation_reason`].
fn check_parent(
    parent: &Capability,
    signer_public: &[u8; 32],
    now_unix_secs: i64,
) -> Result<(), CapError> {
    if parent.depth() >= MAX_CHAIN_DEPTH {
        return Err(CapError::ChainTooDeep {
            max: MAX_CHAIN_DEPTH,
        });
    }
    if signer_public != parent.controller_public() {
        return Err(CapError::WrongInvoker {
            keyid: did_key_from_ed25519(signer_public),
            controller: parent.controller().to_owned(),
        });
    }
    if parent.expires_unix_secs() <= now_unix_secs {
        return Err(CapError::CapabilityExpired {
            id: parent.id().to_owned(),
            expires: timestamp::display(parent.expires_unix_secs()),
        });
    }
    Ok(())
}

/// The new capability's `parentCapability` and the string ids of its
/// `capabilityChain`: the root of `target` for an admin's capability;
/// otherwise the parent's id, and the parent's chain ids followed by the
/// grandparent's id when the parent was itself delegated.
fn ancestor_ids(parent: Option<&Capability>, target: &str) -> (String, Vec<String>) {
    match parent {
        None => {
            let root = root_id(target);
            (root.clone(), vec![root])
        }
        Some(parent) => {
            let mut chain_ids = parent.proof.chain_ids.clone();
            if let Some(grandparent) = parent.parent() {
                chain_ids.push(grandparent.id().to_owned());
            }
            (parent.id().to_owned(), chain_ids)
        }
    }
}
