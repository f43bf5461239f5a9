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
use crate::json::{self, Json};

/// The bytes a delegation proof signs.
pub(crate) fn hash_data(cap: &Capability) -> [u8; 64] {
    combined_hash(&cap.proof_config_value(), &cap.document_value())
}

/// `SHA-256(JCS(proof_config)) ‖ SHA-256(JCS(document))`, for any document.
fn combined_hash(proof_config: &Json, document: &Json) -> [u8; 64] {
    let config = Sha256::digest(json::canonical(proof_config));
    let document = Sha256::digest(json::canonical(document));
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

#[cfg(test)]
mod tests {
    use super::*;
    use nuwa_identity::did_key::parse_ed25519_public_multibase;

    /// Source: w3c/vc-di-eddsa, `TestVectors/eddsa-jcs-2022/signedJCS.json` (verbatim),
    /// signed by the key of `TestVectors/keyPair.json`.
    const W3C_SIGNED: &str = r#"{
      "@context": ["https://www.w3.org/ns/credentials/v2", "https://www.w3.org/ns/credentials/examples/v2"],
      "id": "urn:uuid:58172aac-d8ba-11ed-83dd-0b3aef56cc33",
      "type": ["VerifiableCredential", "AlumniCredential"],
      "name": "Alumni Credential",
      "description": "A minimum viable example of an Alumni Credential.",
      "issuer": "https://vc.example/issuers/5678",
      "validFrom": "2023-01-01T00:00:00Z",
      "credentialSubject": {"id": "did:example:abcdefgh", "alumniOf": "The School of Examples"},
      "proof": {
        "type": "DataIntegrityProof",
        "cryptosuite": "eddsa-jcs-2022",
        "created": "2023-02-24T23:36:38Z",
        "verificationMethod": "https://vc.example/issuers/5678#z6MkrJVnaZkeFzdQyMZu1cgjg7k1pZZ6pvBQ7XJPt4swbTQ2",
        "proofPurpose": "assertionMethod",
        "@context": ["https://www.w3.org/ns/credentials/v2", "https://www.w3.org/ns/credentials/examples/v2"],
        "proofValue": "z63t83Y53KfzJ5ZosfKTnqfMcKB2dmTrfjSaQjeNNjAD5srBowQfmWqeRb8rRjmeEuCBEsddF9LsVogtuTsijJKh4"
      }
    }"#;
    const W3C_PUBLIC_MULTIBASE: &str = "z6MkrJVnaZkeFzdQyMZu1cgjg7k1pZZ6pvBQ7XJPt4swbTQ2";

    // Goal: our JCS and hash layout reproduce the W3C eddsa-jcs-2022 test vector, so the proof (with its @context) is the cryptosuite's.
    #[test]
    fn w3c_eddsa_jcs_2022_vector_verifies() {
        let Ok(Json::Obj(mut document)) = json::parse(W3C_SIGNED.as_bytes()) else {
            panic!("vector parses as an object");
        };
        let Some(Json::Obj(mut config)) = document.remove("proof") else {
            panic!("vector has a proof object");
        };
        let Some(Json::Str(proof_value)) = config.remove("proofValue") else {
            panic!("vector has a proofValue");
        };
        let signature = bs58::decode(&proof_value[1..]).into_vec().expect("base58");
        let signature = Signature::from_slice(&signature).expect("64 bytes");
        let public = parse_ed25519_public_multibase(W3C_PUBLIC_MULTIBASE).expect("key");
        let key = VerifyingKey::from_bytes(&public).expect("point");
        let data = combined_hash(&Json::Obj(config.clone()), &Json::Obj(document.clone()));
        key.verify_strict(&data, &signature)
            .expect("the W3C vector verifies");
        // Without the proof's @context the hash differs: it is part of what is signed.
        config.remove("@context");
        let data = combined_hash(&Json::Obj(config), &Json::Obj(document));
        assert!(key.verify_strict(&data, &signature).is_err());
    }
}
