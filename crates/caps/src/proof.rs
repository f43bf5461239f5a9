//! The `eddsa-jcs-2022` delegation proof (W3C Data Integrity EdDSA
//! Cryptosuites v1.0, §3.3): what is hashed, signing, and checking.
//!
//! `hashData = SHA-256(JCS(proofConfig)) ‖ SHA-256(JCS(document))`, where
//! the document is the capability without `proof` and `proofConfig` is the
//! proof without `proofValue` (it carries the document's `@context`, as the
//! cryptosuite's Create Proof algorithm puts it there). The signature is
//! Ed25519 over the 64 bytes of `hashData`, checked strictly (no small-order
//! keys, canonical `S`).

use ed25519_dalek::{Signature, Signer, SigningKey, VerifyingKey};
use sha2::{Digest, Sha256};

use crate::capability::Capability;
use crate::json;

/// The bytes a delegation proof signs.
pub(crate) fn hash_data(cap: &Capability) -> [u8; 64] {
    let config = Sha256::digest(json::canonical(&cap.proof_config_value()));
    let document = Sha256::digest(json::canonical(&cap.document_value()));
    let mut out = [0u8; 64];
    out[..32].copy_from_slice(&config);
    out[32..].copy_from_slice(&document);
    out
}

/// Signs `cap`'s proof with `signer`, filling `proofValue`.
pub(crate) fn sign(cap: &mut Capability, signer: &SigningKey) {
    let signature = signer.sign(&hash_data(cap));
    cap.proof.proof_value = signature.to_bytes();
}

/// Whether `cap`'s proof verifies with the key its `verificationMethod` names.
pub(crate) fn verifies(cap: &Capability) -> bool {
    let Ok(key) = VerifyingKey::from_bytes(&cap.proof.delegator_public) else {
        return false;
    };
    key.verify_strict(
        &hash_data(cap),
        &Signature::from_bytes(&cap.proof.proof_value),
    )
    .is_ok()
}
