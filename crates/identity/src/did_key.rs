//! The `did:key` method for Ed25519 keys, per the W3C CCG did-method-key spec.
//!
//! A did:key is `did:key:` followed by the multibase (base58btc, prefix `z`)
//! encoding of the multicodec `ed25519-pub` (0xed, varint bytes `ed 01`)
//! followed by the 32 raw key bytes. Its document is derived, never fetched.
//! The X25519 key-agreement key is derived from the Ed25519 key by the
//! birational map to Montgomery form (spec: "Derive Encryption Key").
//!
//! Only Ed25519 did:keys are supported; other key types are rejected with
//! [`DidError::WrongMulticodec`]. Updatable documents live in [`crate::log`].

use ed25519_dalek::VerifyingKey;

use crate::document::{
    CONTEXT_DID_V1, CONTEXT_ED25519_2020, CONTEXT_X25519_2020, DidDocument, DidError,
    ED25519_KEY_TYPE, VerificationMethod, X25519_KEY_TYPE, shorten,
};

/// Multicodec code of `ed25519-pub`.
pub const MULTICODEC_ED25519_PUB: u64 = 0xed;
/// Multicodec code of `x25519-pub`.
pub const MULTICODEC_X25519_PUB: u64 = 0xec;
/// The did:key prefix (method version 1 in its implicit, three-part form).
pub const DID_KEY_PREFIX: &str = "did:key:";

/// Longest multibase string we try to decode. An Ed25519 or X25519 value is
/// 48 characters; the cap keeps base58 decoding (quadratic) cheap on hostile input.
const MAX_MULTIBASE_LEN: usize = 128;

/// `z` + base58btc(`ed 01` ‖ public): the `publicKeyMultibase` of an Ed25519 key ("z6Mk...").
pub fn ed25519_public_multibase(public: &[u8; 32]) -> String {
    encode_multibase(MULTICODEC_ED25519_PUB, public)
}

/// `z` + base58btc(`ec 01` ‖ public): the `publicKeyMultibase` of an X25519 key ("z6LS...").
pub fn x25519_public_multibase(public: &[u8; 32]) -> String {
    encode_multibase(MULTICODEC_X25519_PUB, public)
}

/// Decodes an Ed25519 `publicKeyMultibase`, checking prefix, multicodec,
/// length and that the bytes are a point on the curve.
pub fn parse_ed25519_public_multibase(s: &str) -> Result<[u8; 32], DidError> {
    let key = decode_multibase(s, MULTICODEC_ED25519_PUB)?;
    if VerifyingKey::from_bytes(&key).is_err() {
        return Err(DidError::InvalidPublicKey { value: shorten(s) });
    }
    Ok(key)
}

/// Decodes an X25519 `publicKeyMultibase`, checking prefix, multicodec and length.
/// Every 32-byte string is a valid X25519 public key, so there is no point check.
pub fn parse_x25519_public_multibase(s: &str) -> Result<[u8; 32], DidError> {
    decode_multibase(s, MULTICODEC_X25519_PUB)
}

/// The X25519 public key derived from an Ed25519 public key (Edwards to Montgomery map).
pub fn x25519_public_from_ed25519(public: &[u8; 32]) -> Result<[u8; 32], DidError> {
    let key = VerifyingKey::from_bytes(public).map_err(|_| DidError::InvalidPublicKey {
        value: hex::encode(public),
    })?;
    Ok(key.to_montgomery().to_bytes())
}

/// `did:key:z6Mk...` for an Ed25519 public key.
pub fn did_key_from_ed25519(public: &[u8; 32]) -> String {
    let mut did = String::from(DID_KEY_PREFIX);
    did.push_str(&ed25519_public_multibase(public));
    did
}

/// The Ed25519 public key inside `did:key:z6Mk...`.
///
/// Only the canonical three-part form is accepted (no explicit version, no
/// path, query or fragment), so that one key has exactly one DID string.
pub fn ed25519_from_did_key(did: &str) -> Result<[u8; 32], DidError> {
    let value = did
        .strip_prefix(DID_KEY_PREFIX)
        .ok_or(DidError::NotDidKey { did: shorten(did) })?;
    if value.contains([':', '#', '?', '/']) {
        return Err(DidError::InvalidDid {
            did: shorten(did),
            reason: "did:key must be `did:key:<multibase>` with nothing after the key",
        });
    }
    parse_ed25519_public_multibase(value)
}

/// The document the did:key spec resolves for an Ed25519 did:key, with
/// `publicKeyFormat` = `Ed25519VerificationKey2020` and encryption key
/// derivation enabled: the Ed25519 method (in authentication, assertionMethod,
/// capabilityInvocation and capabilityDelegation) followed by the derived
/// `X25519KeyAgreementKey2020` method (in keyAgreement). Its `controller` is unset.
pub fn did_key_document(did: &str) -> Result<DidDocument, DidError> {
    let public = ed25519_from_did_key(did)?;
    let ed_multibase = ed25519_public_multibase(&public);
    let x_multibase = x25519_public_multibase(&x25519_public_from_ed25519(&public)?);
    let ed_id = format!("{did}#{ed_multibase}");
    let x_id = format!("{did}#{x_multibase}");
    Ok(DidDocument {
        context: vec![
            CONTEXT_DID_V1.to_owned(),
            CONTEXT_ED25519_2020.to_owned(),
            CONTEXT_X25519_2020.to_owned(),
        ],
        id: did.to_owned(),
        controller: None,
        verification_method: vec![
            VerificationMethod {
                id: ed_id.clone(),
                r#type: ED25519_KEY_TYPE.to_owned(),
                controller: did.to_owned(),
                public_key_multibase: ed_multibase,
                expires: None,
            },
            VerificationMethod {
                id: x_id.clone(),
                r#type: X25519_KEY_TYPE.to_owned(),
                controller: did.to_owned(),
                public_key_multibase: x_multibase,
                expires: None,
            },
        ],
        authentication: vec![ed_id.clone()],
        assertion_method: vec![ed_id.clone()],
        key_agreement: vec![x_id],
        capability_invocation: vec![ed_id.clone()],
        capability_delegation: vec![ed_id],
        service: Vec::new(),
    })
}

fn encode_multibase(codec: u64, key: &[u8; 32]) -> String {
    let mut bytes = Vec::with_capacity(34);
    push_varint(codec, &mut bytes);
    bytes.extend_from_slice(key);
    let mut out = String::from("z");
    out.push_str(&bs58::encode(bytes).into_string());
    out
}

fn decode_multibase(s: &str, expected_codec: u64) -> Result<[u8; 32], DidError> {
    let invalid = |reason| DidError::InvalidMultibase {
        value: shorten(s),
        reason,
    };
    if s.len() > MAX_MULTIBASE_LEN {
        return Err(invalid("value is too long for a 32-byte key"));
    }
    let body = s
        .strip_prefix('z')
        .ok_or_else(|| invalid("not base58btc (multibase prefix must be `z`)"))?;
    let bytes = bs58::decode(body)
        .into_vec()
        .map_err(|_| invalid("not valid base58btc"))?;
    let (codec, header_len) =
        read_varint(&bytes).ok_or_else(|| invalid("multicodec header is not a valid varint"))?;
    let mut minimal = Vec::new();
    push_varint(codec, &mut minimal);
    if codec != expected_codec || minimal.len() != header_len {
        return Err(DidError::WrongMulticodec {
            value: shorten(s),
            expected: expected_codec,
            found: codec,
        });
    }
    let key: [u8; 32] = bytes[header_len..]
        .try_into()
        .map_err(|_| DidError::WrongKeyLength {
            value: shorten(s),
            len: bytes.len() - header_len,
        })?;
    Ok(key)
}

/// Unsigned LEB128 as used by multiformats (at most 9 bytes).
fn push_varint(mut n: u64, out: &mut Vec<u8>) {
    loop {
        let low = (n & 0x7f) as u8;
        n >>= 7;
        if n == 0 {
            out.push(low);
            return;
        }
        out.push(low | 0x80);
    }
}

fn read_varint(bytes: &[u8]) -> Option<(u64, usize)> {
    let mut n: u64 = 0;
    for (i, byte) in bytes.iter().enumerate().take(9) {
        n |= u64::from(byte & 0x7f) << (7 * i);
        if byte & 0x80 == 0 {
            return Some((n, i + 1));
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::keys::DeviceKey;

    /// Source: w3c-ccg/did-method-key, `test-vectors/ed25519-x25519.json`, copied
    /// verbatim except that only the fields we check are kept:
    /// (seed, did, verificationKeyPair.publicKeyBase58, keyAgreementKeyPair.id,
    /// keyAgreementKeyPair.publicKeyBase58, keyAgreementKeyPair.privateKeyBase58).
    const VECTORS: &[[&str; 6]] = &[
        [
            "0000000000000000000000000000000000000000000000000000000000000000",
            "did:key:z6MkiTBz1ymuepAQ4HEHYSF1H8quG5GLVVQR3djdX3mDooWp",
            "4zvwRjXUKGfvwnParsHAS3HuSVzV5cA4McphgmoCtajS",
            "#z6LShs9GGnqk85isEBzzshkuVWrVKsRp24GnDuHk8QWkARMW",
            "7By6kV2t2d188odEM4ExAve1UithKT6dLva4dwsDT3ak",
            "6QN8DfuN9hjgHgPvLXqgzqYE3jRRGRrmJQZkd5tL8paR",
        ],
        [
            "0000000000000000000000000000000000000000000000000000000000000001",
            "did:key:z6MkjchhfUsD6mmvni8mCdXHw216Xrm9bQe2mBH1P5RDjVJG",
            "6ASf5EcmmEHTgDJ4X4ZT5vT6iHVJBXPg5AN5YoTCpGWt",
            "#z6LSrHyXiPBhUbvPUtyUCdf32sniiMGPTAesgHrtEa4FePtr",
            "FcoNC5NqP9CePWbhfz95iHaEsCjGkZUioK9Ck7Qiw286",
            "HBTcN2MrXNRj9xF9oi8QqYyuEPv3JLLjQKuEgW9oxVKP",
        ],
        [
            "0000000000000000000000000000000000000000000000000000000000000002",
            "did:key:z6MknGc3ocHs3zdPiJbnaaqDi58NGb4pk1Sp9WxWufuXSdxf",
            "8pM1DN3RiT8vbom5u1sNryaNT1nyL8CTTW3b5PwWXRBH",
            "#z6LSkkqoZRC34AEpbkhZCqLDcHQVAxuLpQ7kC8XCXMVUfvjE",
            "A5fe37PAxhX5WNKngBpGHhC1KpNE7nwbK9oX2tqwxYxU",
            "ACa4PPJ1LnPNq1iwS33V3Akh7WtnC71WkKFZ9ccM6sX2",
        ],
        [
            "0000000000000000000000000000000000000000000000000000000000000003",
            "did:key:z6MkvqoYXQfDDJRv8L4wKzxYeuKyVZBfi9Qo6Ro8MiLH3kDQ",
            "HPYVwAQmskwT1qEEeRzhoomyfyupJGASQQtCXSNG8XS2",
            "#z6LSiUo6AEDat8Ze4nQzDo67SGuHLLwsUGkxndHGUjsywHow",
            "7ocvdvQinfqtyQ3Dh9aA7ggoVCQkmfaoueZazHETDv3B",
            "FZrzd1osCnbK6y6MJzMBW1RcVfL524sNKhSbqRwMuwHT",
        ],
        [
            "0000000000000000000000000000000000000000000000000000000000000004",
            "did:key:z6MkwW6aqMnjgrhJXFUko3NnZPGzVpkNzhYK7yEhnsibmLwL",
            "J3qYF7YJMKCqQke47UQwiHizgFUXapHxRxKmxbkar89x",
            "#z6LSrGb3qm4xMCEBjvwkLb2WEcXfTM94Tu1RyGCbT5wbg8i9",
            "FbQtKTG6FjWSeYZyowWYv2KBcCbwmHqH6HUuxdJ4xkwP",
            "8Zybi2bqQ8YB4uPm3iy2rkDCmbB4wkG2Y2ig5YAkgNdg",
        ],
    ];

    fn b58_32(s: &str) -> [u8; 32] {
        let v = bs58::decode(s).into_vec().expect("vector is base58");
        v.try_into().expect("vector key is 32 bytes")
    }

    // Goal: every published seed -> did:key vector encodes and decodes exactly, including the derived X25519 keys.
    #[test]
    fn published_ed25519_x25519_vectors() {
        for [seed_hex, did, ed_b58, x_frag, x_pub_b58, x_priv_b58] in VECTORS {
            let mut seed = [0u8; 32];
            hex::decode_to_slice(seed_hex, &mut seed).expect("vector seed is hex");
            let key = DeviceKey::from_seed(&seed);
            let public = key.public();
            assert_eq!(public, b58_32(ed_b58), "public key of {did}");
            // Encode.
            assert_eq!(did_key_from_ed25519(&public), *did);
            // Decode.
            assert_eq!(ed25519_from_did_key(did).expect("vector parses"), public);
            // X25519: public derived from the Ed25519 public, and its multibase id.
            let x_pub = x25519_public_from_ed25519(&public).expect("valid point");
            assert_eq!(x_pub, b58_32(x_pub_b58), "x25519 public of {did}");
            assert_eq!(format!("#{}", x25519_public_multibase(&x_pub)), *x_frag);
            assert_eq!(
                parse_x25519_public_multibase(&x_frag[1..]).expect("parses"),
                x_pub
            );
            // X25519 private: the vectors store the RFC 7748 clamped scalar.
            let mut x_priv = *key.x25519_secret();
            x_priv[0] &= 248;
            x_priv[31] &= 127;
            x_priv[31] |= 64;
            assert_eq!(x_priv, b58_32(x_priv_b58), "x25519 private of {did}");
        }
    }

    // Goal: the resolved document matches the vector file's document for seed 0 in shape,
    // with the 2020 key types the current spec uses (Multicodec example, spec section "Ed25519 / X25519").
    #[test]
    fn document_matches_spec_multicodec_example() {
        // Source: w3c-ccg/did-method-key index.html, "Multicodec Example" (verbatim).
        let expected_methods = serde_json::json!([
            {
              "id": "did:key:z6MkiTBz1ymuepAQ4HEHYSF1H8quG5GLVVQR3djdX3mDooWp#z6MkiTBz1ymuepAQ4HEHYSF1H8quG5GLVVQR3djdX3mDooWp",
              "type": "Ed25519VerificationKey2020",
              "controller": "did:key:z6MkiTBz1ymuepAQ4HEHYSF1H8quG5GLVVQR3djdX3mDooWp",
              "publicKeyMultibase": "z6MkiTBz1ymuepAQ4HEHYSF1H8quG5GLVVQR3djdX3mDooWp"
            },
            {
              "id": "did:key:z6MkiTBz1ymuepAQ4HEHYSF1H8quG5GLVVQR3djdX3mDooWp#z6LShs9GGnqk85isEBzzshkuVWrVKsRp24GnDuHk8QWkARMW",
              "type": "X25519KeyAgreementKey2020",
              "controller": "did:key:z6MkiTBz1ymuepAQ4HEHYSF1H8quG5GLVVQR3djdX3mDooWp",
              "publicKeyMultibase": "z6LShs9GGnqk85isEBzzshkuVWrVKsRp24GnDuHk8QWkARMW"
            }
        ]);
        let did = "did:key:z6MkiTBz1ymuepAQ4HEHYSF1H8quG5GLVVQR3djdX3mDooWp";
        let doc = did_key_document(did).expect("valid did:key");
        assert_eq!(
            serde_json::to_value(&doc.verification_method).expect("serializable"),
            expected_methods
        );
        doc.validate().expect("resolved document is valid");
    }

    // Goal: the full example document of the spec's "Document Creation" section resolves identically,
    // given that we list the key-agreement method in verificationMethod and reference it by id
    // (the creation algorithm's form) where the example embeds it.
    #[test]
    fn document_matches_spec_example_document() {
        // Source: w3c-ccg/did-method-key index.html, "An example of a did:key DID Document" (verbatim).
        let spec = serde_json::json!({
          "@context": [
            "https://www.w3.org/ns/did/v1",
            "https://w3id.org/security/suites/ed25519-2020/v1",
            "https://w3id.org/security/suites/x25519-2020/v1"
          ],
          "id": "did:key:z6MkhaXgBZDvotDkL5257faiztiGiC2QtKLGpbnnEGta2doK",
          "verificationMethod": [{
            "id": "did:key:z6MkhaXgBZDvotDkL5257faiztiGiC2QtKLGpbnnEGta2doK#z6MkhaXgBZDvotDkL5257faiztiGiC2QtKLGpbnnEGta2doK",
            "type": "Ed25519VerificationKey2020",
            "controller": "did:key:z6MkhaXgBZDvotDkL5257faiztiGiC2QtKLGpbnnEGta2doK",
            "publicKeyMultibase": "z6MkhaXgBZDvotDkL5257faiztiGiC2QtKLGpbnnEGta2doK"
          }],
          "authentication": [
            "did:key:z6MkhaXgBZDvotDkL5257faiztiGiC2QtKLGpbnnEGta2doK#z6MkhaXgBZDvotDkL5257faiztiGiC2QtKLGpbnnEGta2doK"
          ],
          "assertionMethod": [
            "did:key:z6MkhaXgBZDvotDkL5257faiztiGiC2QtKLGpbnnEGta2doK#z6MkhaXgBZDvotDkL5257faiztiGiC2QtKLGpbnnEGta2doK"
          ],
          "capabilityDelegation": [
            "did:key:z6MkhaXgBZDvotDkL5257faiztiGiC2QtKLGpbnnEGta2doK#z6MkhaXgBZDvotDkL5257faiztiGiC2QtKLGpbnnEGta2doK"
          ],
          "capabilityInvocation": [
            "did:key:z6MkhaXgBZDvotDkL5257faiztiGiC2QtKLGpbnnEGta2doK#z6MkhaXgBZDvotDkL5257faiztiGiC2QtKLGpbnnEGta2doK"
          ],
          "keyAgreement": [{
            "id": "did:key:z6MkhaXgBZDvotDkL5257faiztiGiC2QtKLGpbnnEGta2doK#z6LSj72tK8brWgZja8NLRwPigth2T9QRiG1uH9oKZuKjdh9p",
            "type": "X25519KeyAgreementKey2020",
            "controller": "did:key:z6MkhaXgBZDvotDkL5257faiztiGiC2QtKLGpbnnEGta2doK",
            "publicKeyMultibase": "z6LSj72tK8brWgZja8NLRwPigth2T9QRiG1uH9oKZuKjdh9p"
          }]
        });
        // Move the embedded key-agreement method into verificationMethod, leaving its id behind.
        let mut expected = spec.clone();
        let embedded = spec["keyAgreement"][0].clone();
        expected["keyAgreement"] = serde_json::json!([embedded["id"].clone()]);
        expected["verificationMethod"]
            .as_array_mut()
            .expect("array")
            .push(embedded);

        let did = spec["id"].as_str().expect("string");
        let doc = did_key_document(did).expect("valid did:key");
        assert_eq!(serde_json::to_value(&doc).expect("serializable"), expected);
    }

    // Goal: malformed multibase / did:key inputs are rejected with the specific error; table-driven.
    #[test]
    fn rejects_bad_inputs() {
        let good = ed25519_public_multibase(&DeviceKey::from_seed(&[9; 32]).public());
        let x_key = x25519_public_multibase(&[5; 32]);
        let mut short = vec![0xed, 0x01];
        short.extend_from_slice(&[1; 31]);
        let short = format!("z{}", bs58::encode(short).into_string());
        let mut long = vec![0xed, 0x01];
        long.extend_from_slice(&[1; 33]);
        let long = format!("z{}", bs58::encode(long).into_string());
        // Non-minimal varint for 0xed: ed 81 00.
        let mut non_minimal = vec![0xed, 0x81, 0x00];
        non_minimal.extend_from_slice(&DeviceKey::from_seed(&[9; 32]).public());
        let non_minimal = format!("z{}", bs58::encode(non_minimal).into_string());
        // A y-coordinate that does not decompress to a curve point.
        let not_a_point = {
            let mut bytes = [0u8; 32];
            bytes[0] = 2;
            let candidate = ed25519_public_multibase(&bytes);
            assert!(
                VerifyingKey::from_bytes(&bytes).is_err(),
                "fixture must be off-curve"
            );
            candidate
        };
        let hex_prefixed = format!("f{}", hex::encode([0xed, 0x01]));

        type Check = fn(&DidError) -> bool;
        let invalid_mb: Check = |e| matches!(e, DidError::InvalidMultibase { .. });
        let wrong_codec: Check = |e| matches!(e, DidError::WrongMulticodec { .. });
        let wrong_len: Check = |e| matches!(e, DidError::WrongKeyLength { .. });
        let bad_point: Check = |e| matches!(e, DidError::InvalidPublicKey { .. });
        let cases: Vec<(&str, String, Check)> = vec![
            ("empty", String::new(), invalid_mb),
            ("no prefix", good[1..].to_owned(), invalid_mb),
            ("base64 prefix", format!("m{}", &good[1..]), invalid_mb),
            ("hex multibase", hex_prefixed, invalid_mb),
            ("base58 with 0", format!("{good}0"), invalid_mb),
            ("base58 with l", format!("z6Mkl{}", &good[5..]), invalid_mb),
            ("x25519 codec", x_key, wrong_codec),
            ("non-minimal varint", non_minimal, wrong_codec),
            ("31 bytes", short, wrong_len),
            ("33 bytes", long, wrong_len),
            ("off-curve", not_a_point, bad_point),
            ("huge", format!("z{}", "1".repeat(10_000)), invalid_mb),
        ];
        for (name, input, check) in cases {
            match parse_ed25519_public_multibase(&input) {
                Err(e) => assert!(check(&e), "case {name}: unexpected error {e}"),
                Ok(_) => panic!("case {name}: accepted"),
            }
        }
        assert!(parse_ed25519_public_multibase(&good).is_ok());

        let bad_dids = [
            "did:web:example.com",
            "did:key:",
            "did:key:1:z6MkiTBz1ymuepAQ4HEHYSF1H8quG5GLVVQR3djdX3mDooWp",
            "did:key:z6MkiTBz1ymuepAQ4HEHYSF1H8quG5GLVVQR3djdX3mDooWp#frag",
            "did:key:z6MkiTBz1ymuepAQ4HEHYSF1H8quG5GLVVQR3djdX3mDooWp/path",
            "DID:key:z6MkiTBz1ymuepAQ4HEHYSF1H8quG5GLVVQR3djdX3mDooWp",
            "did:key:z6LShs9GGnqk85isEBzzshkuVWrVKsRp24GnDuHk8QWkARMW",
        ];
        for did in bad_dids {
            assert!(ed25519_from_did_key(did).is_err(), "{did} accepted");
            assert!(did_key_document(did).is_err(), "{did} resolved");
        }
    }
}
