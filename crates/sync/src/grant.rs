//! Checking an epoch grant that a peer forwarded: is it for this agent, was
//! it issued by a key that may open epochs, are the devices it revokes gone
//! from the DID document, and does it open for this device?
//!
//! Pure: the caller passes the key ring, the current document and the time.

use nuwa_crypto::SyncKey;
use nuwa_crypto::epoch::{EpochGrant, KeyRing};
use nuwa_identity::document::{DidDocument, KeyStatus, Relationship};
use nuwa_identity::keys::DeviceKey;

/// What a grant from a peer meant for this device.
pub enum GrantOutcome {
    /// Nothing new: an epoch this device already holds.
    Known,
    /// A new epoch key for this device.
    NewKey(SyncKey),
}

/// Checks a grant against the current DID document and opens this device's
/// key from it. The issuer must hold `capabilityDelegation` (the same
/// authority that signs the revocation), the revoked devices must no longer
/// be active, and the grant must be for this agent.
pub fn open_grant(
    bytes: &[u8],
    keys: &KeyRing,
    doc: &DidDocument,
    device: &DeviceKey,
    my_context: &str,
    now_secs: i64,
) -> Result<GrantOutcome, String> {
    let grant = EpochGrant::decode(bytes).map_err(|e| format!("malformed epoch grant: {e}"))?;
    if grant.agent_did != doc.id {
        return Err(format!("epoch grant for another agent {}", grant.agent_did));
    }
    if keys.get(grant.epoch).is_some() {
        return Ok(GrantOutcome::Known);
    }
    let issuer_id = format!("{}#{}", doc.id, grant.issuer_context_id);
    let issuer = doc
        .key_for(&issuer_id, Relationship::CapabilityDelegation, now_secs)
        .map_err(|e| format!("epoch grant issuer may not open epochs: {e}"))?;
    grant
        .verify(&issuer)
        .map_err(|e| format!("epoch grant does not verify: {e}"))?;
    for r in &grant.revoked {
        if doc.key_status(&format!("{}#{r}", doc.id), now_secs) == KeyStatus::Active {
            return Err(format!(
                "epoch grant revokes {r}, which the DID document still lists"
            ));
        }
    }
    let secret = device.x25519_secret();
    let key = grant
        .open_for(my_context, &secret)
        .map_err(|e| format!("cannot open the epoch grant: {e}"))?;
    if key.epoch() != grant.epoch {
        return Err("epoch grant key epoch mismatch".into());
    }
    Ok(GrantOutcome::NewKey(key))
}
