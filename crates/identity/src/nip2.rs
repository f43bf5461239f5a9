//! NIP-2 signatures over JSON content, with replay protection.
//!
//! `hash = SHA-256(domainSeparator ‖ contentToSign)`, where for
//! [`sign_json`] / [`verify_json`] the content to sign is the canonical JSON of
//! `{"content": <content>, "nonce": <hex nonce>, "timestamp": <unix secs>}`.
//! The Ed25519 signature is over the 32-byte hash, and the proof names the
//! signer's DID and the exact `key_id` used.
//!
//! Verification follows NIP-2's steps in order: timestamp window and nonce
//! (cheap, no state change), content hash, key lookup, signature, relationship
//! and only then recording the nonce, so that forged messages cannot use up
//! nonces. Resolving the signer's DID document is the caller's job: pass the
//! document you trust (e.g. [`crate::log::DidLog::current`]).

use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::canonical::to_canonical_json;
use crate::document::{DidDocument, DidError, ED25519_KEY_TYPE, Relationship, shorten};
use crate::keys::{DeviceKey, KeyError, verify_ed25519};

pub use crate::replay::{MAX_NONCE_LEN, NonceStore, ReplayError};

/// Bytes of randomness in the nonces [`sign_json`] creates.
pub const NONCE_LEN: usize = 16;

/// `SHA-256(domain ‖ content)`: the digest every NIP-2 signature in this project is over.
pub fn signing_hash(domain: &str, content: &[u8]) -> [u8; 32] {
    let mut hasher = Sha256::new();
    hasher.update(domain.as_bytes());
    hasher.update(content);
    hasher.finalize().into()
}

/// The NIP-2 authentication data, with the timestamp and nonce the content carried.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Proof {
    /// DID of the signer.
    pub signer_did: String,
    /// Absolute id of the verification method used (`did#fragment`).
    pub key_id: String,
    /// Unix seconds at signing.
    pub timestamp: i64,
    /// Hex of [`NONCE_LEN`] random bytes.
    pub nonce: String,
    /// Base64url (no padding) Ed25519 signature over the signing hash.
    pub signature_value: String,
}

/// Errors from [`sign_json`].
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SignError {
    /// The content cannot be represented as JSON (e.g. a map with non-string keys).
    #[error("cannot encode content to sign as canonical json")]
    Encode(#[source] serde_json::Error),
    /// The random nonce could not be drawn.
    #[error("cannot create a nonce")]
    Random(#[source] KeyError),
}

/// Errors from [`verify_json`], one variant per NIP-2 error class.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum VerifyError {
    /// The proof's fields are not in the expected format (NIP-2 "Invalid Authentication Format").
    #[error("malformed proof: {reason}")]
    Malformed {
        /// Which field and what is wrong.
        reason: &'static str,
    },
    /// The proof names a different DID than the document given (NIP-2 "DID Resolution Failed").
    #[error("proof is signed by {signer_did}, but the document is for {document_did}")]
    SignerMismatch {
        /// The proof's `signer_did` (shortened if long).
        signer_did: String,
        /// The document's id.
        document_did: String,
    },
    /// Timestamp outside the window or nonce reused (NIP-2 "Replay Attack Detected").
    #[error("replay protection refused the proof")]
    Replay(#[from] ReplayError),
    /// Key not found, expired, of the wrong type, or lacking the relationship
    /// (NIP-2 "Key Not Found" / "Permission Denied"); match the inner error to tell which.
    #[error("signing key is not usable")]
    Did(#[from] DidError),
    /// The signature does not verify (NIP-2 "Invalid Signature").
    #[error("signature by {key_id} does not verify")]
    BadSignature {
        /// The key id the proof names.
        key_id: String,
    },
    /// The content cannot be represented as JSON.
    #[error("cannot encode content as canonical json")]
    Encode(#[source] serde_json::Error),
}

#[derive(Serialize)]
struct Signed<'a> {
    content: serde_json::Value,
    nonce: &'a str,
    timestamp: i64,
}

/// The canonical `contentToSign` bytes for `content` with this nonce and timestamp.
pub fn content_to_sign<T: Serialize + ?Sized>(
    content: &T,
    nonce: &str,
    timestamp: i64,
) -> Result<Vec<u8>, serde_json::Error> {
    to_canonical_json(&Signed {
        content: serde_json::to_value(content)?,
        nonce,
        timestamp,
    })
}

/// Signs `content` under `domain` with `key`, naming `signer_did` and `key_id`.
pub fn sign_json<T: Serialize + ?Sized>(
    key: &DeviceKey,
    signer_did: &str,
    key_id: &str,
    domain: &str,
    content: &T,
    now_unix_secs: i64,
) -> Result<Proof, SignError> {
    let mut nonce = [0u8; NONCE_LEN];
    nuwa_entropy::fill(&mut nonce).map_err(|e| SignError::Random(KeyError::Random(e)))?;
    let nonce = hex::encode(nonce);
    let bytes = content_to_sign(content, &nonce, now_unix_secs).map_err(SignError::Encode)?;
    let signature = key.sign(&signing_hash(domain, &bytes));
    Ok(Proof {
        signer_did: signer_did.to_owned(),
        key_id: key_id.to_owned(),
        timestamp: now_unix_secs,
        nonce,
        signature_value: URL_SAFE_NO_PAD.encode(signature),
    })
}

/// Verifies a NIP-2 proof over `content` against `doc`, requiring the signing
/// key to hold `required` at `now_unix_secs`, and records its nonce in `nonces`
/// (scope = the proof's key id). Returns the signer's raw public key.
pub fn verify_json<T: Serialize + ?Sized>(
    doc: &DidDocument,
    domain: &str,
    content: &T,
    proof: &Proof,
    required: Relationship,
    now_unix_secs: i64,
    nonces: &mut NonceStore,
) -> Result<[u8; 32], VerifyError> {
    // 8. Parse the authentication data.
    if proof.signer_did != doc.id {
        return Err(VerifyError::SignerMismatch {
            signer_did: shorten(&proof.signer_did),
            document_did: doc.id.clone(),
        });
    }
    let in_this_did = proof
        .key_id
        .strip_prefix(doc.id.as_str())
        .is_some_and(|rest| rest.starts_with('#'));
    if !in_this_did {
        return Err(VerifyError::Malformed {
            reason: "key_id must be an absolute key id of signer_did",
        });
    }
    if proof.nonce.len() > 2 * MAX_NONCE_LEN {
        return Err(VerifyError::Malformed {
            reason: "nonce is too long",
        });
    }
    let nonce = hex::decode(&proof.nonce).map_err(|_| VerifyError::Malformed {
        reason: "nonce must be hex",
    })?;
    // 64 bytes are 86 base64 characters; refuse to decode anything else.
    if proof.signature_value.len() != 86 {
        return Err(VerifyError::Malformed {
            reason: "signature_value must be 64 bytes of base64url without padding",
        });
    }
    let signature: [u8; 64] = URL_SAFE_NO_PAD
        .decode(&proof.signature_value)
        .ok()
        .and_then(|bytes| bytes.try_into().ok())
        .ok_or(VerifyError::Malformed {
            reason: "signature_value must be 64 bytes of base64url without padding",
        })?;

    // 9. Replay protection: timestamp window and nonce, without recording yet.
    nonces.check(
        &proof.key_id,
        domain,
        &nonce,
        proof.timestamp,
        now_unix_secs,
    )?;

    // 10. Recompute the hash.
    let bytes =
        content_to_sign(content, &proof.nonce, proof.timestamp).map_err(VerifyError::Encode)?;
    let digest = signing_hash(domain, &bytes);

    // 11. Find the key: listed, Ed25519, not expired.
    let method = doc.usable_method(&proof.key_id, ED25519_KEY_TYPE, now_unix_secs)?;
    let public = method.ed25519_public()?;

    // 12. Verify the signature.
    verify_ed25519(&public, &digest, &signature).map_err(|_| VerifyError::BadSignature {
        key_id: proof.key_id.clone(),
    })?;

    // 13. Check the relationship the action needs.
    doc.require_relationship(&proof.key_id, required)?;

    // Only a fully verified message may use up its nonce.
    nonces.record(
        &proof.key_id,
        domain,
        &nonce,
        proof.timestamp,
        now_unix_secs,
    )?;
    Ok(public)
}

#[cfg(test)]
mod tests;
