//! Tests of NIP-2 signing and verification: NIP-1 test cases 3, 4, 5, 6, 8 and 9
//! against a document built through the DID log, plus wrong keys and malformed proofs.

use super::*;
use crate::document::EXPIRY_GRACE_SECS;
use crate::keys::context_id_for;
use crate::log::DidLog;

const T0: i64 = 1_750_000_000;
const DOMAIN: &str = "NUWA_TEST_V1:";
const WINDOW: i64 = 300;

fn key(n: u8) -> DeviceKey {
    DeviceKey::from_seed(&[n; 32])
}

#[derive(Serialize)]
struct Message {
    op: &'static str,
    count: u32,
}

const MSG: Message = Message {
    op: "state.update",
    count: 3,
};

/// An agent whose document lists: phone (authentication), invoker (capabilityInvocation only),
/// session (authentication, expires at T0 + 100, i.e. 2025-06-15T15:08:20Z).
struct Fixture {
    doc: DidDocument,
    phone: DeviceKey,
    invoker: DeviceKey,
    session: DeviceKey,
}

impl Fixture {
    fn new() -> Fixture {
        let master = key(1);
        let (phone, invoker, session) = (key(2), key(3), key(4));
        let mut log = DidLog::genesis(&master, T0).expect("genesis");
        let mut doc = log.current().clone();
        doc.add_key(
            &context_id_for(&phone.public()),
            &phone.public(),
            &[Relationship::Authentication],
            None,
        )
        .expect("add phone");
        doc.add_key(
            "invoker",
            &invoker.public(),
            &[Relationship::CapabilityInvocation],
            None,
        )
        .expect("add invoker");
        doc.add_key(
            "session",
            &session.public(),
            &[Relationship::Authentication],
            Some("2025-06-15T15:08:20Z".to_owned()),
        )
        .expect("add session");
        let master_id = log
            .current()
            .key_id(&crate::did_key::ed25519_public_multibase(&master.public()));
        log.append(doc, &master, &master_id, T0)
            .expect("register keys");
        Fixture {
            doc: log.current().clone(),
            phone,
            invoker,
            session,
        }
    }

    fn sign(&self, key: &DeviceKey, fragment: &str, now: i64) -> Proof {
        sign_json(
            key,
            &self.doc.id,
            &self.doc.key_id(fragment),
            DOMAIN,
            &MSG,
            now,
        )
        .expect("sign")
    }

    fn phone_frag(&self) -> String {
        context_id_for(&self.phone.public())
    }
}

fn store() -> NonceStore {
    NonceStore::new(WINDOW, 1024, 64)
}

// Goal: NIP-1 test cases 3 and 4: an operational key with `authentication` signs and the
// signature verifies against the document, returning that key.
#[test]
fn tc3_tc4_operational_key_authenticates() {
    let f = Fixture::new();
    let proof = f.sign(&f.phone, &f.phone_frag(), T0);
    assert_eq!(proof.signer_did, f.doc.id);
    assert_eq!(proof.nonce.len(), 2 * NONCE_LEN);
    let mut nonces = store();
    let public = verify_json(
        &f.doc,
        DOMAIN,
        &MSG,
        &proof,
        Relationship::Authentication,
        T0,
        &mut nonces,
    )
    .expect("valid proof");
    assert_eq!(public, f.phone.public());
    assert_eq!(nonces.len(), 1);
}

// Goal: NIP-1 test case 5: a capabilityInvocation-only key is denied for authentication and
// accepted for capabilityInvocation; the denied attempt does not use up the nonce.
#[test]
fn tc5_invocation_but_not_authentication() {
    let f = Fixture::new();
    let proof = f.sign(&f.invoker, "invoker", T0);
    let mut nonces = store();
    let err = verify_json(
        &f.doc,
        DOMAIN,
        &MSG,
        &proof,
        Relationship::Authentication,
        T0,
        &mut nonces,
    )
    .expect_err("not an authentication key");
    assert!(
        matches!(
            err,
            VerifyError::Did(DidError::PermissionDenied {
                rel: Relationship::Authentication,
                ..
            })
        ),
        "{err:?}"
    );
    assert_eq!(nonces.len(), 0);
    verify_json(
        &f.doc,
        DOMAIN,
        &MSG,
        &proof,
        Relationship::CapabilityInvocation,
        T0,
        &mut nonces,
    )
    .expect("allowed for capabilityInvocation");
}

// Goal: NIP-1 test case 6: once the key is removed from the document, its signatures fail with KeyNotFound.
#[test]
fn tc6_revoked_key_fails() {
    let f = Fixture::new();
    let proof = f.sign(&f.phone, &f.phone_frag(), T0);
    let mut revoked = f.doc.clone();
    revoked.remove_key(&f.phone_frag()).expect("listed");
    let err = verify_json(
        &revoked,
        DOMAIN,
        &MSG,
        &proof,
        Relationship::Authentication,
        T0,
        &mut store(),
    )
    .expect_err("revoked");
    assert!(
        matches!(err, VerifyError::Did(DidError::KeyNotFound { .. })),
        "{err:?}"
    );
}

// Goal: NIP-1 test case 8: an expiring session key verifies before expiry and within the grace,
// and fails with Expired after it.
#[test]
fn tc8_expired_session_key() {
    let f = Fixture::new();
    let expires = T0 + 100;
    for (now, ok) in [
        (expires, true),
        (expires + EXPIRY_GRACE_SECS, true),
        (expires + EXPIRY_GRACE_SECS + 1, false),
        (expires + 86_400, false),
    ] {
        let proof = f.sign(&f.session, "session", now);
        let result = verify_json(
            &f.doc,
            DOMAIN,
            &MSG,
            &proof,
            Relationship::Authentication,
            now,
            &mut store(),
        );
        match result {
            Ok(_) => assert!(ok, "accepted at {now}"),
            Err(VerifyError::Did(DidError::Expired { .. })) => assert!(!ok, "refused at {now}"),
            Err(other) => panic!("at {now}: unexpected {other:?}"),
        }
    }
}

// Goal: NIP-1 test case 9: a replayed proof, a stale timestamp and a future timestamp are refused.
#[test]
fn tc9_replay_and_timestamps() {
    let f = Fixture::new();
    let mut nonces = store();
    let proof = f.sign(&f.phone, &f.phone_frag(), T0);
    verify_json(
        &f.doc,
        DOMAIN,
        &MSG,
        &proof,
        Relationship::Authentication,
        T0,
        &mut nonces,
    )
    .expect("first time");
    let replay = verify_json(
        &f.doc,
        DOMAIN,
        &MSG,
        &proof,
        Relationship::Authentication,
        T0 + 1,
        &mut nonces,
    );
    assert!(
        matches!(replay, Err(VerifyError::Replay(ReplayError::Replayed))),
        "{replay:?}"
    );

    let stale = f.sign(&f.phone, &f.phone_frag(), T0 - WINDOW - 1);
    let result = verify_json(
        &f.doc,
        DOMAIN,
        &MSG,
        &stale,
        Relationship::Authentication,
        T0,
        &mut nonces,
    );
    assert!(
        matches!(result, Err(VerifyError::Replay(ReplayError::Stale { .. }))),
        "{result:?}"
    );

    let future = f.sign(&f.phone, &f.phone_frag(), T0 + WINDOW + 1);
    let result = verify_json(
        &f.doc,
        DOMAIN,
        &MSG,
        &future,
        Relationship::Authentication,
        T0,
        &mut nonces,
    );
    assert!(
        matches!(
            result,
            Err(VerifyError::Replay(ReplayError::FromFuture { .. }))
        ),
        "{result:?}"
    );

    // The same message in another domain is a different signature context, not a replay.
    let other = sign_json(
        &f.phone,
        &f.doc.id,
        &f.doc.key_id(&f.phone_frag()),
        "OTHER_V1:",
        &MSG,
        T0,
    )
    .expect("sign");
    verify_json(
        &f.doc,
        "OTHER_V1:",
        &MSG,
        &other,
        Relationship::Authentication,
        T0,
        &mut nonces,
    )
    .expect("other domain");
}

// Goal: proofs that do not match their content, domain or named key are refused with
// BadSignature, and such forgeries do not use up the genuine message's nonce.
#[test]
fn wrong_key_and_tampering() {
    let f = Fixture::new();
    let genuine = f.sign(&f.phone, &f.phone_frag(), T0);
    let mut nonces = store();

    // Signed by the invoker key while naming the phone's key id.
    let mut wrong_key = f.sign(&f.invoker, "invoker", T0);
    wrong_key.key_id = f.doc.key_id(&f.phone_frag());
    // Genuine signature, different content.
    let other_msg = Message {
        op: "state.delete",
        count: 3,
    };
    // Genuine signature, shifted timestamp (signed content differs).
    let mut shifted = genuine.clone();
    shifted.timestamp += 1;

    let attempts: Vec<(&str, &Proof, &Message, &str)> = vec![
        ("wrong key", &wrong_key, &MSG, DOMAIN),
        ("other content", &genuine, &other_msg, DOMAIN),
        ("other domain", &genuine, &MSG, "NUWA_OTHER_V1:"),
        ("shifted timestamp", &shifted, &MSG, DOMAIN),
    ];
    for (name, proof, msg, domain) in attempts {
        let result = verify_json(
            &f.doc,
            domain,
            msg,
            proof,
            Relationship::Authentication,
            T0,
            &mut nonces,
        );
        assert!(
            matches!(result, Err(VerifyError::BadSignature { .. })),
            "{name}: {result:?}"
        );
    }
    assert_eq!(nonces.len(), 0, "forgeries must not record nonces");
    verify_json(
        &f.doc,
        DOMAIN,
        &MSG,
        &genuine,
        Relationship::Authentication,
        T0,
        &mut nonces,
    )
    .expect("genuine message still accepted");
}

// Goal: malformed proofs are refused before any crypto with Malformed or SignerMismatch; one edit per row.
#[test]
fn malformed_proofs() {
    let f = Fixture::new();
    let genuine = f.sign(&f.phone, &f.phone_frag(), T0);
    type Edit = Box<dyn Fn(&mut Proof)>;
    let other_did = crate::did_key::did_key_from_ed25519(&key(9).public());
    let cases: Vec<(&str, Edit, bool)> = vec![
        (
            "other signer did",
            Box::new(move |p| p.signer_did = other_did.clone()),
            true,
        ),
        (
            "relative key id",
            Box::new(|p| p.key_id = format!("#{}", DidDocument::fragment(&p.key_id))),
            false,
        ),
        (
            "key id of another did",
            Box::new(|p| p.key_id = format!("did:example:x#{}", DidDocument::fragment(&p.key_id))),
            false,
        ),
        ("nonce not hex", Box::new(|p| p.nonce = "xyz".into()), false),
        (
            "nonce huge",
            Box::new(|p| p.nonce = "ab".repeat(1000)),
            false,
        ),
        (
            "signature padded",
            Box::new(|p| p.signature_value.push_str("==")),
            false,
        ),
        (
            "signature standard base64",
            Box::new(|p| p.signature_value = format!("+/{}", &p.signature_value[2..])),
            false,
        ),
        (
            "signature short",
            Box::new(|p| p.signature_value.truncate(40)),
            false,
        ),
    ];
    for (name, edit, mismatch) in cases {
        let mut proof = genuine.clone();
        edit(&mut proof);
        let result = verify_json(
            &f.doc,
            DOMAIN,
            &MSG,
            &proof,
            Relationship::Authentication,
            T0,
            &mut store(),
        );
        let ok = if mismatch {
            matches!(result, Err(VerifyError::SignerMismatch { .. }))
        } else {
            matches!(result, Err(VerifyError::Malformed { .. }))
        };
        assert!(ok, "{name}: {result:?}");
    }
}

// Goal: the signed bytes are the canonical JSON of {content, nonce, timestamp}, so a verifier
// holding the content in another representation (a JSON value with other key order) still verifies.
#[test]
fn canonical_content_and_hash() {
    assert_eq!(
        content_to_sign(&serde_json::json!({"b": 1, "a": "x"}), "00ff", 5).expect("ok"),
        br#"{"content":{"a":"x","b":1},"nonce":"00ff","timestamp":5}"#.to_vec()
    );
    // SHA-256("abc"): the domain separator is simply prepended.
    let expected = "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad";
    assert_eq!(hex::encode(signing_hash("", b"abc")), expected);
    assert_eq!(hex::encode(signing_hash("a", b"bc")), expected);

    let f = Fixture::new();
    let proof = f.sign(&f.phone, &f.phone_frag(), T0);
    let as_value: serde_json::Value =
        serde_json::from_str(r#"{"count":3,"op":"state.update"}"#).expect("json");
    verify_json(
        &f.doc,
        DOMAIN,
        &as_value,
        &proof,
        Relationship::Authentication,
        T0,
        &mut store(),
    )
    .expect("same content, other representation");

    // The proof's JSON uses NIP-2's field names.
    let json = serde_json::to_value(&proof).expect("serializable");
    for field in [
        "signer_did",
        "key_id",
        "timestamp",
        "nonce",
        "signature_value",
    ] {
        assert!(json.get(field).is_some(), "missing {field}");
    }
}
