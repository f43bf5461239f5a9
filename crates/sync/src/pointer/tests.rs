//! Tests of the DHT agent pointer: encoding, full verification by a stranger,
//! verification by a member device, and hostile bytes.
//!
//! Most tests start from [`FIXTURE_LOG`], a fixed v1 DID log (master seed
//! `[1; 32]`, then the laptop `[3; 32]` and the phone `[2; 32]` added with
//! `authentication`) read as a DID chain ([`DidChain::from_v1`], hashes
//! unchanged), so that encodings and fuzz runs are reproducible. Its proof is
//! the genesis and the head update (the master signed every update and no
//! update changed who may sign) with the current document.

use super::*;
use nuwa_identity::chain::{DidEntry, DidEntryV2, diff, document_hash};
use nuwa_identity::document::Relationship;
use nuwa_identity::keys::context_id_for;
use nuwa_identity::log::DidLog;
use serde_json::json;

/// The fixture log's timestamps are T0, T0 + 1 and T0 + 2.
const T0: i64 = 1_750_000_000;
/// When the fixture pointers are signed.
const TS: i64 = T0 + 1_000;
const PEER: &str = "12D3KooWDpJ7As7BWAwRMfu1VU2WCqNjvq387JEYKDBj4kx6nXTN";
const NONCE: [u8; POINTER_NONCE_LEN] = [7; POINTER_NONCE_LEN];

/// Canonical JSON of the fixture log (see the module doc).
const FIXTURE_LOG: &str = r#"{"updates":[{"document":{"@context":["https://www.w3.org/ns/did/v1","https://w3id.org/security/suites/ed25519-2020/v1","https://w3id.org/security/suites/x25519-2020/v1"],"assertionMethod":["did:key:z6Mkon3Necd6NkkyfoGoHxid2znGc59LU3K7mubaRcFbLfLX#z6Mkon3Necd6NkkyfoGoHxid2znGc59LU3K7mubaRcFbLfLX"],"authentication":["did:key:z6Mkon3Necd6NkkyfoGoHxid2znGc59LU3K7mubaRcFbLfLX#z6Mkon3Necd6NkkyfoGoHxid2znGc59LU3K7mubaRcFbLfLX"],"capabilityDelegation":["did:key:z6Mkon3Necd6NkkyfoGoHxid2znGc59LU3K7mubaRcFbLfLX#z6Mkon3Necd6NkkyfoGoHxid2znGc59LU3K7mubaRcFbLfLX"],"capabilityInvocation":["did:key:z6Mkon3Necd6NkkyfoGoHxid2znGc59LU3K7mubaRcFbLfLX#z6Mkon3Necd6NkkyfoGoHxid2znGc59LU3K7mubaRcFbLfLX"],"controller":"did:key:z6Mkon3Necd6NkkyfoGoHxid2znGc59LU3K7mubaRcFbLfLX","id":"did:key:z6Mkon3Necd6NkkyfoGoHxid2znGc59LU3K7mubaRcFbLfLX","keyAgreement":["did:key:z6Mkon3Necd6NkkyfoGoHxid2znGc59LU3K7mubaRcFbLfLX#z6LSdVzMmB67tKXYmkjiKRAQgbxgjnjdfiajqUvx7C9fxTNv"],"verificationMethod":[{"controller":"did:key:z6Mkon3Necd6NkkyfoGoHxid2znGc59LU3K7mubaRcFbLfLX","id":"did:key:z6Mkon3Necd6NkkyfoGoHxid2znGc59LU3K7mubaRcFbLfLX#z6Mkon3Necd6NkkyfoGoHxid2znGc59LU3K7mubaRcFbLfLX","publicKeyMultibase":"z6Mkon3Necd6NkkyfoGoHxid2znGc59LU3K7mubaRcFbLfLX","type":"Ed25519VerificationKey2020"},{"controller":"did:key:z6Mkon3Necd6NkkyfoGoHxid2znGc59LU3K7mubaRcFbLfLX","id":"did:key:z6Mkon3Necd6NkkyfoGoHxid2znGc59LU3K7mubaRcFbLfLX#z6LSdVzMmB67tKXYmkjiKRAQgbxgjnjdfiajqUvx7C9fxTNv","publicKeyMultibase":"z6LSdVzMmB67tKXYmkjiKRAQgbxgjnjdfiajqUvx7C9fxTNv","type":"X25519KeyAgreementKey2020"}]},"key_id":"did:key:z6Mkon3Necd6NkkyfoGoHxid2znGc59LU3K7mubaRcFbLfLX#z6Mkon3Necd6NkkyfoGoHxid2znGc59LU3K7mubaRcFbLfLX","nonce":"8e1a4322679f288dc93412128f6ef5f7","prev":"","seq":0,"signature":"UOSOWsqkzbU9UGrBArHXJb6QCnq6KmODrBQS5J8NWXvS2hDu8xBQXav9s_jUG3mIH9vTdptmKpgmGIXjA79iCQ","timestamp":1750000000},{"document":{"@context":["https://www.w3.org/ns/did/v1","https://w3id.org/security/suites/ed25519-2020/v1","https://w3id.org/security/suites/x25519-2020/v1"],"assertionMethod":["did:key:z6Mkon3Necd6NkkyfoGoHxid2znGc59LU3K7mubaRcFbLfLX#z6Mkon3Necd6NkkyfoGoHxid2znGc59LU3K7mubaRcFbLfLX"],"authentication":["did:key:z6Mkon3Necd6NkkyfoGoHxid2znGc59LU3K7mubaRcFbLfLX#z6Mkon3Necd6NkkyfoGoHxid2znGc59LU3K7mubaRcFbLfLX","did:key:z6Mkon3Necd6NkkyfoGoHxid2znGc59LU3K7mubaRcFbLfLX#device-b62e867fa2f3"],"capabilityDelegation":["did:key:z6Mkon3Necd6NkkyfoGoHxid2znGc59LU3K7mubaRcFbLfLX#z6Mkon3Necd6NkkyfoGoHxid2znGc59LU3K7mubaRcFbLfLX"],"capabilityInvocation":["did:key:z6Mkon3Necd6NkkyfoGoHxid2znGc59LU3K7mubaRcFbLfLX#z6Mkon3Necd6NkkyfoGoHxid2znGc59LU3K7mubaRcFbLfLX"],"controller":"did:key:z6Mkon3Necd6NkkyfoGoHxid2znGc59LU3K7mubaRcFbLfLX","id":"did:key:z6Mkon3Necd6NkkyfoGoHxid2znGc59LU3K7mubaRcFbLfLX","keyAgreement":["did:key:z6Mkon3Necd6NkkyfoGoHxid2znGc59LU3K7mubaRcFbLfLX#z6LSdVzMmB67tKXYmkjiKRAQgbxgjnjdfiajqUvx7C9fxTNv"],"verificationMethod":[{"controller":"did:key:z6Mkon3Necd6NkkyfoGoHxid2znGc59LU3K7mubaRcFbLfLX","id":"did:key:z6Mkon3Necd6NkkyfoGoHxid2znGc59LU3K7mubaRcFbLfLX#z6Mkon3Necd6NkkyfoGoHxid2znGc59LU3K7mubaRcFbLfLX","publicKeyMultibase":"z6Mkon3Necd6NkkyfoGoHxid2znGc59LU3K7mubaRcFbLfLX","type":"Ed25519VerificationKey2020"},{"controller":"did:key:z6Mkon3Necd6NkkyfoGoHxid2znGc59LU3K7mubaRcFbLfLX","id":"did:key:z6Mkon3Necd6NkkyfoGoHxid2znGc59LU3K7mubaRcFbLfLX#z6LSdVzMmB67tKXYmkjiKRAQgbxgjnjdfiajqUvx7C9fxTNv","publicKeyMultibase":"z6LSdVzMmB67tKXYmkjiKRAQgbxgjnjdfiajqUvx7C9fxTNv","type":"X25519KeyAgreementKey2020"},{"controller":"did:key:z6Mkon3Necd6NkkyfoGoHxid2znGc59LU3K7mubaRcFbLfLX","id":"did:key:z6Mkon3Necd6NkkyfoGoHxid2znGc59LU3K7mubaRcFbLfLX#device-b62e867fa2f3","publicKeyMultibase":"z6MkvRXNYcE7MMduynWTgeKbDaT1iijDSC8pZqXZc8rHPrf2","type":"Ed25519VerificationKey2020"}]},"key_id":"did:key:z6Mkon3Necd6NkkyfoGoHxid2znGc59LU3K7mubaRcFbLfLX#z6Mkon3Necd6NkkyfoGoHxid2znGc59LU3K7mubaRcFbLfLX","nonce":"8aa881b10fb99aa5bffcfc1104c52151","prev":"fa7d7394fc5ad9157fc58a90404f75a418b2c70c51fb0697240f4a002becaca2","seq":1,"signature":"2McxTZb99jg8iq-T2UPTUVCCwOBmccrp03RNFpkbSmvoI3s9tcRSw_Pqu0dOCnsbrDDNXV_BLdR7EsVixNHcCg","timestamp":1750000001},{"document":{"@context":["https://www.w3.org/ns/did/v1","https://w3id.org/security/suites/ed25519-2020/v1","https://w3id.org/security/suites/x25519-2020/v1"],"assertionMethod":["did:key:z6Mkon3Necd6NkkyfoGoHxid2znGc59LU3K7mubaRcFbLfLX#z6Mkon3Necd6NkkyfoGoHxid2znGc59LU3K7mubaRcFbLfLX"],"authentication":["did:key:z6Mkon3Necd6NkkyfoGoHxid2znGc59LU3K7mubaRcFbLfLX#z6Mkon3Necd6NkkyfoGoHxid2znGc59LU3K7mubaRcFbLfLX","did:key:z6Mkon3Necd6NkkyfoGoHxid2znGc59LU3K7mubaRcFbLfLX#device-b62e867fa2f3","did:key:z6Mkon3Necd6NkkyfoGoHxid2znGc59LU3K7mubaRcFbLfLX#device-6a3803d5f059"],"capabilityDelegation":["did:key:z6Mkon3Necd6NkkyfoGoHxid2znGc59LU3K7mubaRcFbLfLX#z6Mkon3Necd6NkkyfoGoHxid2znGc59LU3K7mubaRcFbLfLX"],"capabilityInvocation":["did:key:z6Mkon3Necd6NkkyfoGoHxid2znGc59LU3K7mubaRcFbLfLX#z6Mkon3Necd6NkkyfoGoHxid2znGc59LU3K7mubaRcFbLfLX"],"controller":"did:key:z6Mkon3Necd6NkkyfoGoHxid2znGc59LU3K7mubaRcFbLfLX","id":"did:key:z6Mkon3Necd6NkkyfoGoHxid2znGc59LU3K7mubaRcFbLfLX","keyAgreement":["did:key:z6Mkon3Necd6NkkyfoGoHxid2znGc59LU3K7mubaRcFbLfLX#z6LSdVzMmB67tKXYmkjiKRAQgbxgjnjdfiajqUvx7C9fxTNv"],"verificationMethod":[{"controller":"did:key:z6Mkon3Necd6NkkyfoGoHxid2znGc59LU3K7mubaRcFbLfLX","id":"did:key:z6Mkon3Necd6NkkyfoGoHxid2znGc59LU3K7mubaRcFbLfLX#z6Mkon3Necd6NkkyfoGoHxid2znGc59LU3K7mubaRcFbLfLX","publicKeyMultibase":"z6Mkon3Necd6NkkyfoGoHxid2znGc59LU3K7mubaRcFbLfLX","type":"Ed25519VerificationKey2020"},{"controller":"did:key:z6Mkon3Necd6NkkyfoGoHxid2znGc59LU3K7mubaRcFbLfLX","id":"did:key:z6Mkon3Necd6NkkyfoGoHxid2znGc59LU3K7mubaRcFbLfLX#z6LSdVzMmB67tKXYmkjiKRAQgbxgjnjdfiajqUvx7C9fxTNv","publicKeyMultibase":"z6LSdVzMmB67tKXYmkjiKRAQgbxgjnjdfiajqUvx7C9fxTNv","type":"X25519KeyAgreementKey2020"},{"controller":"did:key:z6Mkon3Necd6NkkyfoGoHxid2znGc59LU3K7mubaRcFbLfLX","id":"did:key:z6Mkon3Necd6NkkyfoGoHxid2znGc59LU3K7mubaRcFbLfLX#device-b62e867fa2f3","publicKeyMultibase":"z6MkvRXNYcE7MMduynWTgeKbDaT1iijDSC8pZqXZc8rHPrf2","type":"Ed25519VerificationKey2020"},{"controller":"did:key:z6Mkon3Necd6NkkyfoGoHxid2znGc59LU3K7mubaRcFbLfLX","id":"did:key:z6Mkon3Necd6NkkyfoGoHxid2znGc59LU3K7mubaRcFbLfLX#device-6a3803d5f059","publicKeyMultibase":"z6Mko9hTggMwjSTEaJaPUfE6tqcy2xvU6BnNq3e3o8qVBiyH","type":"Ed25519VerificationKey2020"}]},"key_id":"did:key:z6Mkon3Necd6NkkyfoGoHxid2znGc59LU3K7mubaRcFbLfLX#z6Mkon3Necd6NkkyfoGoHxid2znGc59LU3K7mubaRcFbLfLX","nonce":"fdad4c84c296843b3c6d7f3e5fb75e00","prev":"d29707515789c453cf9165413fea1c2d418816ae812e2541f32750cecbce2b5b","seq":2,"signature":"HTGTBcC5fMkohG_yu6qC8v7X7dB91xCQjQ9mALeLrN6WyyDnlZwCBMxJOApjPeotyRB7LUzbpVTaVFvATwsXBA","timestamp":1750000002}]}"#;

fn key(n: u8) -> DeviceKey {
    DeviceKey::from_seed(&[n; 32])
}

fn master() -> DeviceKey {
    key(1)
}

fn phone() -> DeviceKey {
    key(2)
}

fn laptop() -> DeviceKey {
    key(3)
}

fn ctx(dev: &DeviceKey) -> String {
    context_id_for(&dev.public())
}

fn fixture_log() -> DidChain {
    let v1 = DidLog::decode_verified(FIXTURE_LOG.as_bytes(), None, TS).expect("fixture verifies");
    let log = DidChain::from_v1(&v1).expect("a v1 log converts");
    log.verify(None, TS).expect("the chain verifies");
    assert_eq!(log.did(), did_key_of(&master()));
    log
}

fn did_key_of(dev: &DeviceKey) -> String {
    nuwa_identity::did_key::did_key_from_ed25519(&dev.public())
}

/// The phone's pointer over the fixture log, signed at [`TS`] with [`NONCE`].
fn fixture_pointer() -> AgentPointer {
    AgentPointer::new_signed_with_nonce(&fixture_log(), &ctx(&phone()), PEER, &phone(), TS, NONCE)
        .expect("the phone may sign")
}

/// Appends an update in which `master` lists `dev` under its derived context id with `rels`.
fn add_device(
    log: &mut DidChain,
    dev: &DeviceKey,
    rels: &[Relationship],
    expires: Option<&str>,
    now: i64,
) {
    let mut doc = log.current().clone();
    doc.add_key(&ctx(dev), &dev.public(), rels, expires.map(str::to_owned))
        .expect("key can be added");
    let master_id = log.current().capability_delegation[0].clone();
    log.append_document(&doc, &master(), &master_id, now)
        .expect("master may add keys");
}

/// Appends an update in which `master` removes the key under `context_id`.
fn remove_device(log: &mut DidChain, context_id: &str, now: i64) {
    let mut doc = log.current().clone();
    doc.remove_key(context_id).expect("key is listed");
    let master_id = log.current().capability_delegation[0].clone();
    log.append_document(&doc, &master(), &master_id, now)
        .expect("master may remove keys");
}

/// A fresh agent (master `[1; 32]`) with the phone listed, built with random update nonces.
fn agent_with_phone() -> DidChain {
    let mut log = DidChain::genesis(&master(), T0).expect("genesis");
    add_device(
        &mut log,
        &phone(),
        &[Relationship::Authentication],
        None,
        T0 + 1,
    );
    log
}

/// Rebuilds a proof from its edited wire JSON (`entries`, and `document` with
/// the DID factored out of key ids) without verifying it: what an attacker can send.
fn edit_proof(proof: &DidProof, edit: impl FnOnce(&mut Map<String, Value>)) -> DidProof {
    let mut json = serde_json::to_value(proof).expect("serializable");
    edit(json.as_object_mut().expect("a proof is an object"));
    serde_json::from_value(json).expect("still a well-shaped proof")
}

/// The entries of a proof's wire JSON.
fn entries_of(proof: &mut Map<String, Value>) -> &mut Vec<Value> {
    proof["entries"].as_array_mut().expect("entries array")
}

/// The chain made of the first `len` entries of `log` (an earlier state of it).
fn prefix(log: &DidChain, len: usize) -> DidChain {
    let entries = serde_json::to_value(&log.entries()[..len]).expect("serializable");
    serde_json::from_value(json!({ "entries": entries })).expect("a prefix is a chain")
}

/// A v2 entry after the head of `log` (a chain whose authority never changed
/// after its genesis, like the fixture's) that turns its document into `doc`,
/// signed by `signer` under `key_id` whether or not that key may sign.
fn forged_entry(log: &DidChain, doc: &DidDocument, signer: &DeviceKey, key_id: String) -> Value {
    let mut entry = DidEntryV2 {
        v: 2,
        seq: log.len() as u64,
        prev: log.head_hash().to_owned(),
        auth_prev: log.hash_at(0).expect("genesis").to_owned(),
        ops: diff(log.current(), doc),
        authority: None,
        state: document_hash(doc).expect("hash"),
        timestamp: T0 + 3,
        nonce: "00".repeat(16),
        key_id,
        signature: String::new(),
    };
    let digest = entry.signing_digest().expect("digest");
    entry.signature = base64url(&signer.sign(&digest));
    serde_json::to_value(DidEntry::V2(entry)).expect("value")
}

/// The label of `result`'s error, or "ok".
fn outcome<T>(result: Result<T, PointerError>) -> &'static str {
    match result {
        Ok(_) => "ok",
        Err(e) => e.label(),
    }
}

/// The fixture pointer's canonical JSON as a value, for building bad inputs.
fn fixture_value() -> Value {
    let bytes = fixture_pointer().encode().expect("encodes");
    serde_json::from_slice(&bytes).expect("json")
}

fn canonical(value: &Value) -> Vec<u8> {
    to_canonical_json(value).expect("encodable")
}

// Goal: the DHT key and the topic are the NIP-6 hashes, pinned to values computed
// independently (FIPS 180-2 "abc", and `sha256sum` of the strings).
#[test]
fn dht_key_and_topic_vectors() {
    assert_eq!(
        hex::encode(dht_key("abc")),
        "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
    );
    let did = "did:key:z6Mkon3Necd6NkkyfoGoHxid2znGc59LU3K7mubaRcFbLfLX";
    assert_eq!(did, did_key_of(&master()));
    assert_eq!(
        hex::encode(dht_key(did)),
        "256caa6764a528a224a869c3a262233af195e32586a9267c8cd123f91f6a69b8"
    );
    assert_eq!(
        gossip_topic(did),
        "c858d6cc5c2af2011d5e1a8e28237b496a9507352ea2bd0bdc426ca4e912fc35"
    );
}

// Goal: a freshly signed pointer survives encode/decode unchanged and verifies, both for a
// stranger and for a device holding the same log; new_signed draws a fresh nonce each time.
#[test]
fn round_trip_and_verify() {
    let log = fixture_log();
    let pointer = fixture_pointer();
    assert_eq!(pointer.did, log.did());
    assert_eq!(pointer.topic, gossip_topic(log.did()));
    let bytes = pointer.encode().expect("encodes");
    let back = AgentPointer::decode(&bytes).expect("decodes");
    assert_eq!(back, pointer);
    let key = dht_key(log.did());
    back.verify(&key, TS).expect("verifies for anyone");
    back.verify_for_agent(&key, &log, TS)
        .expect("verifies for the agent");
    assert_eq!(back.signer_public(TS).expect("listed"), phone().public());

    let a = AgentPointer::new_signed(&log, &ctx(&phone()), PEER, &phone(), TS).expect("signs");
    let b = AgentPointer::new_signed(&log, &ctx(&phone()), PEER, &phone(), TS).expect("signs");
    assert_ne!(a.nonce, b.nonce);
    a.verify(&key, TS).expect("verifies");
}

// Goal: pin the wire format and the signing rule. The signature is over
// SHA-256(domain ‖ canonical JSON of every field but `signature`), recomputed here by hand,
// and the encoding of the fixture pointer is fixed byte for byte (Ed25519 is deterministic).
// The embedded proof is built by hand too: the fixture log's genesis and head updates,
// unchanged, and the current document with the DID factored out of key ids.
#[test]
fn golden_encoding_and_signing_rule() {
    let pointer = fixture_pointer();
    let log_value: Value = serde_json::from_str(FIXTURE_LOG).expect("json");
    let updates = log_value["updates"].as_array().expect("updates");
    let document: Value = serde_json::from_str(FIXTURE_PROOF_DOCUMENT).expect("json");
    let proof_value = json!({
        "document": document,
        "entries": [updates[0], updates[2]],
    });
    let content = json!({
        "context_id": "device-6a3803d5f059",
        "did": "did:key:z6Mkon3Necd6NkkyfoGoHxid2znGc59LU3K7mubaRcFbLfLX",
        "did_proof": proof_value,
        "nonce": "07070707070707070707070707070707",
        "peer_id": PEER,
        "timestamp": TS,
        "topic": "c858d6cc5c2af2011d5e1a8e28237b496a9507352ea2bd0bdc426ca4e912fc35",
    });
    assert_eq!(ctx(&phone()), "device-6a3803d5f059");
    let mut preimage = b"NUWA_DHT_POINTER_V2:".to_vec();
    preimage.extend_from_slice(&canonical(&content));
    let digest = dht_key_of_bytes(&preimage);
    assert_eq!(pointer.signing_digest().expect("digest"), digest);
    verify_ed25519(&phone().public(), &digest, &pointer.signature).expect("phone signed it");

    let expected = format!(
        concat!(
            r#"{{"context_id":"device-6a3803d5f059","#,
            r#""did":"did:key:z6Mkon3Necd6NkkyfoGoHxid2znGc59LU3K7mubaRcFbLfLX","#,
            r#""did_proof":{proof},"nonce":"07070707070707070707070707070707","#,
            r#""peer_id":"{peer}","signature":"{sig}","timestamp":1750001000,"#,
            r#""topic":"c858d6cc5c2af2011d5e1a8e28237b496a9507352ea2bd0bdc426ca4e912fc35"}}"#
        ),
        proof = String::from_utf8(canonical(&proof_value)).expect("utf8"),
        peer = PEER,
        sig = GOLDEN_SIGNATURE,
    );
    let bytes = pointer.encode().expect("encodes");
    assert_eq!(String::from_utf8(bytes).expect("utf8"), expected);
}

/// The fixture log's current document as its proof carries it (canonical JSON).
const FIXTURE_PROOF_DOCUMENT: &str = r##"{"@context":["https://www.w3.org/ns/did/v1","https://w3id.org/security/suites/ed25519-2020/v1","https://w3id.org/security/suites/x25519-2020/v1"],"assertionMethod":["#z6Mkon3Necd6NkkyfoGoHxid2znGc59LU3K7mubaRcFbLfLX"],"authentication":["#z6Mkon3Necd6NkkyfoGoHxid2znGc59LU3K7mubaRcFbLfLX","#device-b62e867fa2f3","#device-6a3803d5f059"],"capabilityDelegation":["#z6Mkon3Necd6NkkyfoGoHxid2znGc59LU3K7mubaRcFbLfLX"],"capabilityInvocation":["#z6Mkon3Necd6NkkyfoGoHxid2znGc59LU3K7mubaRcFbLfLX"],"controller":"did:key:z6Mkon3Necd6NkkyfoGoHxid2znGc59LU3K7mubaRcFbLfLX","id":"did:key:z6Mkon3Necd6NkkyfoGoHxid2znGc59LU3K7mubaRcFbLfLX","keyAgreement":["#z6LSdVzMmB67tKXYmkjiKRAQgbxgjnjdfiajqUvx7C9fxTNv"],"verificationMethod":[{"id":"#z6Mkon3Necd6NkkyfoGoHxid2znGc59LU3K7mubaRcFbLfLX","publicKeyMultibase":"z6Mkon3Necd6NkkyfoGoHxid2znGc59LU3K7mubaRcFbLfLX","type":"Ed25519VerificationKey2020"},{"id":"#z6LSdVzMmB67tKXYmkjiKRAQgbxgjnjdfiajqUvx7C9fxTNv","publicKeyMultibase":"z6LSdVzMmB67tKXYmkjiKRAQgbxgjnjdfiajqUvx7C9fxTNv","type":"X25519KeyAgreementKey2020"},{"id":"#device-b62e867fa2f3","publicKeyMultibase":"z6MkvRXNYcE7MMduynWTgeKbDaT1iijDSC8pZqXZc8rHPrf2","type":"Ed25519VerificationKey2020"},{"id":"#device-6a3803d5f059","publicKeyMultibase":"z6Mko9hTggMwjSTEaJaPUfE6tqcy2xvU6BnNq3e3o8qVBiyH","type":"Ed25519VerificationKey2020"}]}"##;

const GOLDEN_SIGNATURE: &str = "de7ae402ebee185b06129a606082a23191a49b256f52a6c42dafddeb4bf49cc796fcc0f421516059d61c06794f585e7ee04918cb8623758f64e441e3e1bcdd09";

/// Plain SHA-256, through the same primitive with an empty domain.
fn dht_key_of_bytes(bytes: &[u8]) -> [u8; 32] {
    signing_hash("", bytes)
}

/// One tampering case: what to change, which key re-signs afterwards (an
/// attacker holding that device key), and the expected error label.
struct Tamper {
    name: &'static str,
    edit: Box<dyn Fn(&mut AgentPointer)>,
    resign: Option<DeviceKey>,
    expect: &'static str,
}

fn tamper(
    name: &'static str,
    edit: impl Fn(&mut AgentPointer) + 'static,
    resign: Option<DeviceKey>,
    expect: &'static str,
) -> Tamper {
    Tamper {
        name,
        edit: Box::new(edit),
        resign,
        expect,
    }
}

// Goal: every field is covered: changing any of them (with or without re-signing by a key
// the attacker holds) gives the specific error. The embedded proof is attacked as well:
// entries dropped, the document or an entry changed, another agent's proof, an older proof,
// entries forged by keys that may not change the document. Method: table of edits on the
// fixture pointer, each sent through encode/decode before `verify`.
#[test]
fn tampering_is_rejected() {
    let stranger_did = did_key_of(&key(9));
    let stranger_log = {
        let mut log = DidChain::genesis(&key(9), T0).expect("genesis");
        let mut doc = log.current().clone();
        doc.add_key(
            &ctx(&phone()),
            &phone().public(),
            &[Relationship::Authentication],
            None,
        )
        .expect("add");
        let id = log.current().capability_delegation[0].clone();
        log.append_document(&doc, &key(9), &id, T0 + 1)
            .expect("append");
        log
    };
    // The fixture's first state: the genesis alone, before the laptop and the phone.
    let before_phone = prefix(&fixture_log(), 1);
    assert!(before_phone.current().find_method(&ctx(&phone())).is_none());
    // What the master really signs when it lists the attacker key 8: the
    // document a forger must present to make key 8 a signer.
    let master_lists_attacker = {
        let mut log = fixture_log();
        add_device(
            &mut log,
            &key(8),
            &[Relationship::Authentication],
            None,
            T0 + 3,
        );
        log
    };
    let attacker_doc = master_lists_attacker.current().clone();
    // A proof ending in an entry forged by `signer` under `key_id` that lists
    // key 8, carrying the document that entry claims.
    let forged = |signer: DeviceKey, key_id: String| {
        let log = fixture_log();
        let entry = forged_entry(&log, &attacker_doc, &signer, key_id);
        let document =
            serde_json::to_value(master_lists_attacker.proof()).expect("value")["document"].clone();
        edit_proof(&log.proof(), move |p| {
            entries_of(p).push(entry);
            p.insert("document".into(), document);
        })
    };
    let fixture_did = fixture_log().did().to_owned();
    // The phone (authentication only) forges an entry listing the attacker key.
    let phone_forged = forged(phone(), format!("{fixture_did}#{}", ctx(&phone())));
    // The attacker key, listed nowhere yet, signs an entry listing itself.
    let self_listed = forged(key(8), format!("{fixture_did}#{}", ctx(&key(8))));
    // Key 4 becomes an admin (an authority entry), then lists key 8: its proof
    // is the genesis, that authority entry and the head.
    let with_admin = {
        let mut log = fixture_log();
        add_device(
            &mut log,
            &key(4),
            &[Relationship::CapabilityDelegation],
            None,
            T0 + 3,
        );
        let mut doc = log.current().clone();
        doc.add_key(
            &ctx(&key(8)),
            &key(8).public(),
            &[Relationship::Authentication],
            None,
        )
        .expect("add");
        log.append_document(&doc, &key(4), &ctx(&key(4)), T0 + 4)
            .expect("an admin may add keys");
        log
    };
    assert_eq!(with_admin.proof().entries().len(), 3);
    let admin_proof = with_admin.proof();

    let cases = vec![
        tamper(
            "did",
            move |p| p.did = stranger_did.clone(),
            None,
            "wrong_key",
        ),
        tamper(
            "topic",
            |p| p.topic = gossip_topic("did:key:z6MkElsewhere"),
            None,
            "wrong_topic",
        ),
        tamper("empty topic", |p| p.topic.clear(), None, "wrong_topic"),
        tamper(
            "context id not listed",
            |p| p.context_id = "device-000000000000".into(),
            None,
            "unknown_signer",
        ),
        tamper(
            "context id of another device",
            |p| p.context_id = ctx(&laptop()),
            None,
            "bad_signature",
        ),
        tamper(
            "master's context id",
            |p| p.context_id = nuwa_identity::did_key::ed25519_public_multibase(&master().public()),
            None,
            "bad_signature",
        ),
        tamper(
            "peer id",
            |p| p.peer_id = "12D3KooWother".into(),
            None,
            "bad_signature",
        ),
        tamper(
            "timestamp",
            |p| p.timestamp_unix_secs += 1,
            None,
            "bad_signature",
        ),
        tamper("nonce", |p| p.nonce[0] ^= 1, None, "bad_signature"),
        tamper(
            "signature bit",
            |p| p.signature[63] ^= 0x80,
            None,
            "bad_signature",
        ),
        tamper(
            "signature zero",
            |p| p.signature = [0; 64],
            None,
            "bad_signature",
        ),
        tamper(
            "proof: an older proof, from before the signer was listed",
            move |p| p.did_proof = before_phone.proof(),
            None,
            "unknown_signer",
        ),
        tamper(
            "proof: drop the head entry",
            |p| p.did_proof = edit_proof(&p.did_proof, |j| drop(entries_of(j).pop())),
            None,
            "bad_signature",
        ),
        tamper(
            "proof: drop the head entry, re-signed",
            |p| p.did_proof = edit_proof(&p.did_proof, |j| drop(entries_of(j).pop())),
            Some(phone()),
            "bad_did_log",
        ),
        tamper(
            "proof: drop the genesis, re-signed",
            |p| p.did_proof = edit_proof(&p.did_proof, |j| drop(entries_of(j).remove(0))),
            Some(phone()),
            "bad_did_log",
        ),
        tamper(
            "proof: no entries, re-signed",
            |p| p.did_proof = edit_proof(&p.did_proof, |j| entries_of(j).clear()),
            Some(phone()),
            "bad_did_log",
        ),
        tamper(
            "proof: change the document",
            |p| p.did_proof = edit_proof(&p.did_proof, grant_phone_assertion),
            None,
            "bad_signature",
        ),
        tamper(
            "proof: change the document, re-signed",
            |p| p.did_proof = edit_proof(&p.did_proof, grant_phone_assertion),
            Some(phone()),
            "bad_did_log",
        ),
        tamper(
            "proof: change the head entry and the document alike, re-signed",
            |p| {
                p.did_proof = edit_proof(&p.did_proof, |j| {
                    grant_phone_assertion(j);
                    let head = entries_of(j).last_mut().expect("head");
                    let doc = &mut head["document"];
                    let phone_id = format!("{}#{}", doc["id"].as_str().expect("id"), ctx(&phone()));
                    doc["assertionMethod"]
                        .as_array_mut()
                        .expect("list")
                        .push(Value::from(phone_id));
                })
            },
            Some(phone()),
            "bad_did_log",
        ),
        tamper(
            "proof: another agent's proof listing the phone, re-signed",
            move |p| p.did_proof = stranger_log.proof(),
            Some(phone()),
            "bad_did_log",
        ),
        tamper(
            "proof: the phone lists an attacker key itself, attacker signs",
            move |p| {
                p.did_proof = phone_forged.clone();
                p.context_id = ctx(&key(8));
            },
            Some(key(8)),
            "bad_did_log",
        ),
        tamper(
            "proof: an attacker key lists itself, attacker signs",
            move |p| {
                p.did_proof = self_listed.clone();
                p.context_id = ctx(&key(8));
            },
            Some(key(8)),
            "bad_did_log",
        ),
        tamper(
            "proof: the master lists the attacker key (not a forgery), attacker signs",
            {
                let proof = master_lists_attacker.proof();
                move |p| {
                    p.did_proof = proof.clone();
                    p.context_id = ctx(&key(8));
                }
            },
            Some(key(8)),
            "ok",
        ),
        tamper(
            "proof: with an authority entry, re-signed",
            {
                let proof = admin_proof.clone();
                move |p| p.did_proof = proof.clone()
            },
            Some(phone()),
            "ok",
        ),
        tamper(
            "proof: leave out the authority entry",
            {
                let proof = admin_proof.clone();
                move |p| p.did_proof = edit_proof(&proof, |j| drop(entries_of(j).remove(1)))
            },
            None,
            "bad_signature",
        ),
        tamper(
            "proof: leave out the authority entry, re-signed",
            move |p| p.did_proof = edit_proof(&admin_proof, |j| drop(entries_of(j).remove(1))),
            Some(phone()),
            "bad_did_log",
        ),
    ];
    let did_key = dht_key(fixture_log().did());
    for case in cases {
        let mut pointer = fixture_pointer();
        (case.edit)(&mut pointer);
        if let Some(dev) = &case.resign {
            pointer.sign(dev).expect("signs");
        }
        let bytes = pointer.encode().expect(case.name);
        let back = AgentPointer::decode(&bytes).expect(case.name);
        assert_eq!(back, pointer, "{}: round trip", case.name);
        let got = outcome(back.verify(&did_key, TS));
        assert_eq!(got, case.expect, "case {}", case.name);
    }

    // The DHT key the record was found under is checked first.
    let pointer = fixture_pointer();
    for (name, key) in [
        (
            "another did's key",
            dht_key("did:key:z6MkElsewhere").to_vec(),
        ),
        ("31 bytes", did_key[..31].to_vec()),
        ("empty", Vec::new()),
        ("33 bytes", [&did_key[..], &[0]].concat()),
    ] {
        assert_eq!(outcome(pointer.verify(&key, TS)), "wrong_key", "{name}");
    }
}

/// Lists the phone under `assertionMethod` in a proof's document (wire form:
/// key ids relative to the DID).
fn grant_phone_assertion(proof: &mut Map<String, Value>) {
    proof["document"]["assertionMethod"]
        .as_array_mut()
        .expect("list")
        .push(Value::from(format!("#{}", ctx(&phone()))));
}

fn base64url(bytes: &[u8]) -> String {
    // Only the test needs base64 (for a hand-forged DID update), so encode it here.
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
    let mut out = String::new();
    for chunk in bytes.chunks(3) {
        let n = chunk
            .iter()
            .enumerate()
            .fold(0u32, |acc, (i, b)| acc | (u32::from(*b) << (16 - 8 * i)));
        let chars = chunk.len() + 1;
        for i in 0..chars {
            out.push(char::from(ALPHABET[((n >> (18 - 6 * i)) & 63) as usize]));
        }
    }
    out
}

// Goal: only a listed, unexpired key holding `authentication` may sign, and only with the key
// listed under the context id it names. Method: table of (log, context id, signing key).
#[test]
fn signer_must_be_an_authenticated_device() {
    let stranger = DeviceKey::generate().expect("os rng");
    let mut assertion_only = fixture_log();
    add_device(
        &mut assertion_only,
        &key(4),
        &[Relationship::AssertionMethod],
        None,
        T0 + 3,
    );
    let mut expiring = fixture_log();
    // Expires at T0 + 100; with the 60 s grace it is unusable at TS.
    add_device(
        &mut expiring,
        &key(5),
        &[Relationship::Authentication],
        Some("2025-06-15T15:08:20Z"),
        T0 + 3,
    );
    let cases: Vec<(&str, DidChain, String, DeviceKey, &str)> = vec![
        ("phone", fixture_log(), ctx(&phone()), phone(), "ok"),
        (
            "master",
            fixture_log(),
            nuwa_identity::did_key::ed25519_public_multibase(&master().public()),
            master(),
            "ok",
        ),
        (
            "key not in the log",
            fixture_log(),
            ctx(&stranger),
            DeviceKey::from_seed(&stranger.seed()),
            "unknown_signer",
        ),
        (
            "assertionMethod only",
            assertion_only,
            ctx(&key(4)),
            key(4),
            "unknown_signer",
        ),
        (
            "expired key",
            expiring.clone(),
            ctx(&key(5)),
            key(5),
            "unknown_signer",
        ),
        (
            "phone's id, laptop's key",
            fixture_log(),
            ctx(&phone()),
            laptop(),
            "bad_signature",
        ),
    ];
    for (name, log, context_id, dev, expect) in cases {
        let got = outcome(AgentPointer::new_signed(&log, &context_id, PEER, &dev, TS));
        assert_eq!(got, expect, "case {name}");
    }
    // The expiring key works before its expiry.
    let early = AgentPointer::new_signed(&expiring, &ctx(&key(5)), PEER, &key(5), T0 + 50);
    assert_eq!(outcome(early), "ok");
}

// Goal: the timestamp window is [now - POINTER_MAX_AGE_SECS, now + 300], inclusive, and
// extreme values neither overflow nor pass. Method: table of (record time, verifier time).
#[test]
fn time_window() {
    let key = dht_key(fixture_log().did());
    let cases: Vec<(i64, i64, &str)> = vec![
        (TS, TS, "ok"),
        (TS, TS + POINTER_MAX_AGE_SECS, "ok"),
        (TS, TS + POINTER_MAX_AGE_SECS + 1, "stale"),
        (TS, TS - POINTER_MAX_SKEW_SECS, "ok"),
        (TS, TS - POINTER_MAX_SKEW_SECS - 1, "from_future"),
        (TS, i64::MAX, "stale"),
        (TS, i64::MIN, "from_future"),
        (i64::MIN, TS, "stale"),
        (i64::MAX, TS, "from_future"),
    ];
    for (timestamp, now, expect) in cases {
        let mut pointer = fixture_pointer();
        pointer.timestamp_unix_secs = timestamp;
        pointer.sign(&phone()).expect("signs");
        let back = AgentPointer::decode(&pointer.encode().expect("encodes")).expect("decodes");
        let got = outcome(back.verify(&key, now));
        assert_eq!(got, expect, "timestamp {timestamp} at {now}");
        assert_eq!(
            outcome(back.verify_for_agent(&key, &fixture_log(), now)),
            expect,
            "for the agent: timestamp {timestamp} at {now}"
        );
    }
}

// Goal: records over MAX_POINTER_BYTES are refused by size alone, before any parsing, and a
// proof too long to fit makes `encode` fail rather than produce an unstorable record. A
// proof grows only with the entries that change who may sign, so the test makes many: an
// admin device is listed with `capabilityDelegation` and removed again, over and over.
#[test]
fn oversize_is_refused_before_parsing() {
    let too_big = vec![b'{'; MAX_POINTER_BYTES + 1];
    match AgentPointer::decode(&too_big) {
        Err(PointerError::TooLarge { len, max }) => {
            assert_eq!((len, max), (MAX_POINTER_BYTES + 1, MAX_POINTER_BYTES));
        }
        other => panic!("expected TooLarge, got {other:?}"),
    }
    // Exactly at the limit the bytes are parsed (and here refused as garbage).
    let at_limit = vec![b' '; MAX_POINTER_BYTES];
    assert_eq!(outcome(AgentPointer::decode(&at_limit)), "malformed");

    let mut log = fixture_log();
    let mut seed = 10u8;
    while log.proof().encode().expect("json").len() <= MAX_POINTER_BYTES {
        add_device(
            &mut log,
            &key(seed),
            &[Relationship::CapabilityDelegation],
            None,
            T0 + 3,
        );
        remove_device(&mut log, &ctx(&key(seed)), T0 + 3);
        seed = seed
            .checked_add(1)
            .expect("fewer than 246 admins fill a record");
    }
    let pointer = AgentPointer::new_signed(&log, &ctx(&phone()), PEER, &phone(), TS)
        .expect("signing does not depend on size");
    match pointer.encode() {
        Err(PointerError::TooLarge { len, max }) => {
            assert!(len > max && max == MAX_POINTER_BYTES, "{len} > {max}");
        }
        other => panic!("expected TooLarge, got {other:?}"),
    }
}

// Goal: decode accepts only the canonical encoding of a complete, well-shaped record. Method:
// table of inputs, each with one defect, all expected to be Malformed.
#[test]
fn malformed_inputs() {
    let good = String::from_utf8(fixture_pointer().encode().expect("encodes")).expect("utf8");
    let with = |edit: &dyn Fn(&mut Map<String, Value>)| -> Vec<u8> {
        let mut value = fixture_value();
        edit(value.as_object_mut().expect("object"));
        canonical(&value)
    };
    let set =
        |field: &'static str, v: Value| with(&move |m| drop(m.insert(field.into(), v.clone())));
    let nonce_hex = hex::encode(NONCE);
    let cases: Vec<(&str, Vec<u8>)> = vec![
        ("empty", Vec::new()),
        ("null", b"null".to_vec()),
        ("array", b"[]".to_vec()),
        ("string", b"\"x\"".to_vec()),
        ("empty object", b"{}".to_vec()),
        ("missing peer_id", with(&|m| drop(m.remove("peer_id")))),
        ("missing did_proof", with(&|m| drop(m.remove("did_proof")))),
        ("extra field", set("extra", json!(1))),
        ("timestamp as string", set("timestamp", json!("1750001000"))),
        ("timestamp as float", set("timestamp", json!(1.5))),
        ("timestamp beyond i64", set("timestamp", json!(u64::MAX))),
        ("nonce as number", set("nonce", json!(5))),
        (
            "nonce uppercase",
            set("nonce", json!(nonce_hex.to_uppercase().replace('7', "A"))),
        ),
        ("nonce short", set("nonce", json!(&nonce_hex[..30]))),
        ("nonce long", set("nonce", json!(format!("{nonce_hex}00")))),
        ("signature short", set("signature", json!("ab".repeat(63)))),
        (
            "signature not hex",
            set("signature", json!("zz".repeat(64))),
        ),
        ("context id with #", set("context_id", json!("device#x"))),
        ("context id empty", set("context_id", json!(""))),
        (
            "context id too long",
            set("context_id", json!("a".repeat(MAX_FRAGMENT_LEN + 1))),
        ),
        ("peer id empty", set("peer_id", json!(""))),
        ("peer id with /", set("peer_id", json!("12D3/ip4"))),
        (
            "peer id too long",
            set("peer_id", json!("a".repeat(MAX_PEER_ID_LEN + 1))),
        ),
        ("did empty", set("did", json!(""))),
        (
            "did too long",
            set("did", json!("d".repeat(MAX_DID_LEN + 1))),
        ),
        ("topic too long", set("topic", json!("a".repeat(65)))),
        ("did_proof not an object", set("did_proof", json!("x"))),
        ("did_proof empty object", set("did_proof", json!({}))),
        // (A proof with no entries is well-shaped; it fails verification, see
        // `tampering_is_rejected`.)
        (
            "did_proof without document",
            with(&|m| {
                drop(
                    m["did_proof"]
                        .as_object_mut()
                        .expect("o")
                        .remove("document"),
                )
            }),
        ),
        (
            "did_proof without entries",
            with(&|m| drop(m["did_proof"].as_object_mut().expect("o").remove("entries"))),
        ),
        (
            "did_proof unknown field",
            with(&|m| {
                drop(
                    m["did_proof"]
                        .as_object_mut()
                        .expect("o")
                        .insert("x".into(), json!(1)),
                )
            }),
        ),
        (
            "did_proof document unknown field",
            with(&|m| {
                drop(
                    m["did_proof"]["document"]
                        .as_object_mut()
                        .expect("o")
                        .insert("x".into(), json!(1)),
                )
            }),
        ),
        (
            "did_proof entry of an unknown version",
            with(&|m| {
                drop(
                    m["did_proof"]["entries"][1]
                        .as_object_mut()
                        .expect("o")
                        .insert("v".into(), json!(3)),
                )
            }),
        ),
        (
            "did_proof entries not a list",
            with(&|m| {
                drop(
                    m["did_proof"]
                        .as_object_mut()
                        .expect("o")
                        .insert("entries".into(), json!({})),
                )
            }),
        ),
        ("whitespace", good.replacen('{', "{ ", 1).into_bytes()),
        ("trailing newline", format!("{good}\n").into_bytes()),
        ("trailing garbage", format!("{good}x").into_bytes()),
        (
            "pretty printed",
            serde_json::to_vec_pretty(&fixture_value()).expect("json"),
        ),
        (
            "escaped key",
            good.replacen("\"did\":", "\"\\u0064id\":", 1).into_bytes(),
        ),
        (
            "duplicate key",
            good.replacen('{', "{\"did\":\"did:key:x\",", 1)
                .into_bytes(),
        ),
        ("keys out of order", {
            let topic = format!(",\"topic\":\"{}\"", fixture_pointer().topic);
            let body = good.replacen(&topic, "", 1);
            format!("{{\"topic\":\"{}\",{}", fixture_pointer().topic, &body[1..]).into_bytes()
        }),
        (
            "invalid utf-8",
            good.replacen(PEER, "\u{fffd}", 1)
                .into_bytes()
                .into_iter()
                .map(|b| if b == 0xef { 0xff } else { b })
                .collect(),
        ),
        ("deep nesting", "[".repeat(10_000).into_bytes()),
        (
            "deep nesting in did_proof",
            format!(
                "{}{}",
                &good[..good.find("\"did_proof\":").expect("field") + 12],
                "[".repeat(50_000)
            )
            .into_bytes(),
        ),
    ];
    assert!(
        AgentPointer::decode(good.as_bytes()).is_ok(),
        "the unedited record decodes"
    );
    for (name, bytes) in cases {
        let got = AgentPointer::decode(&bytes);
        assert_eq!(outcome(got), "malformed", "case {name}");
    }
}

/// A seeded generator (fastrand), so a failing run replays with `SEED=<n>`.
struct Rng(fastrand::Rng);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0.u64(..)
    }

    fn below(&mut self, n: usize) -> usize {
        self.0.usize(..n.max(1))
    }
}

fn seed() -> u64 {
    match std::env::var("SEED") {
        Ok(s) => s.parse().expect("SEED must be a u64"),
        Err(_) => {
            let mut bytes = [0u8; 8];
            getrandom::fill(&mut bytes).expect("os rng");
            u64::from_le_bytes(bytes)
        }
    }
}

fn mutate(rng: &mut Rng, bytes: &mut Vec<u8>) {
    const INTERESTING: &[u8] = b"{}[]\",:0123456789abcdef-\\ \x00\xff";
    let at = rng.below(bytes.len() + 1);
    match rng.below(7) {
        0 if at < bytes.len() => bytes[at] ^= 1 << rng.below(8),
        1 if at < bytes.len() => bytes[at] = INTERESTING[rng.below(INTERESTING.len())],
        2 => {
            let len = rng.below(16).min(bytes.len() - at);
            bytes.drain(at..at + len);
        }
        3 => {
            let insert: Vec<u8> = (0..1 + rng.below(8))
                .map(|_| INTERESTING[rng.below(INTERESTING.len())])
                .collect();
            bytes.splice(at..at, insert);
        }
        4 => bytes.truncate(at),
        5 => {
            // Copy a span of the record elsewhere in it (duplicated keys, values, updates).
            let from = rng.below(bytes.len());
            let len = rng.below(64).min(bytes.len() - from);
            let span = bytes[from..from + len].to_vec();
            bytes.splice(at..at, span);
        }
        _ if at < bytes.len() => bytes[at] = rng.next() as u8,
        _ => bytes.push(rng.next() as u8),
    }
}

// Goal: hostile bytes never panic and never verify. Method: seeded random mutations of a valid
// record (bit flips, structural bytes, deletions, insertions, truncation, copied spans); every
// decode error is Malformed, and anything that still decodes differs from the original and
// fails verification. Replay a failure with `SEED=<n>`.
#[test]
fn random_mutations_never_panic_nor_verify() {
    const ITERATIONS: usize = 3_000;
    let seed = seed();
    eprintln!("pointer mutation test: SEED={seed}");
    let mut rng = Rng(fastrand::Rng::with_seed(seed));
    let good = fixture_pointer().encode().expect("encodes");
    let log = fixture_log();
    let key = dht_key(log.did());
    let mut decoded = 0usize;
    for iteration in 0..ITERATIONS {
        let mut bytes = good.clone();
        for _ in 0..1 + rng.below(4) {
            mutate(&mut rng, &mut bytes);
        }
        match AgentPointer::decode(&bytes) {
            Err(e) => assert_eq!(
                e.label(),
                "malformed",
                "SEED={seed} iteration {iteration}: {e}"
            ),
            Ok(pointer) if bytes == good => {
                pointer.verify(&key, TS).expect("the original verifies");
            }
            Ok(pointer) => {
                decoded += 1;
                assert!(
                    pointer.verify(&key, TS).is_err(),
                    "SEED={seed} iteration {iteration}: a mutated record verified"
                );
                assert!(
                    pointer.verify_for_agent(&key, &log, TS).is_err(),
                    "SEED={seed} iteration {iteration}: a mutated record verified for the agent"
                );
            }
        }
    }
    eprintln!("pointer mutation test: {decoded} of {ITERATIONS} mutants decoded, none verified");
}

// Goal: a member device accepts a pointer whose proof's head it holds (equal, or a prefix of
// its chain) when the signer is active in its own current document, and a pointer whose
// proof's head it does not hold (ahead of it, or on another branch) when the signer is
// active in the proof's document; it refuses a signer it knows to be revoked or re-keyed,
// and another agent's record. Method: table of (our chain, the pointer's chain, signer).
#[test]
fn verify_for_agent_cases() {
    let base = agent_with_phone();
    let mut with_laptop = base.clone();
    add_device(
        &mut with_laptop,
        &laptop(),
        &[Relationship::Authentication],
        None,
        T0 + 2,
    );
    let mut with_tablet = base.clone();
    add_device(
        &mut with_tablet,
        &key(6),
        &[Relationship::Authentication],
        None,
        T0 + 2,
    );
    let mut phone_revoked = base.clone();
    remove_device(&mut phone_revoked, &ctx(&phone()), T0 + 2);
    // The same context id now lists a different key.
    let mut phone_rekeyed = base.clone();
    {
        let mut doc = phone_rekeyed.current().clone();
        doc.remove_key(&ctx(&phone())).expect("listed");
        doc.add_key(
            &ctx(&phone()),
            &key(7).public(),
            &[Relationship::Authentication],
            None,
        )
        .expect("add");
        let id = doc.capability_delegation[0].clone();
        phone_rekeyed
            .append_document(&doc, &master(), &id, T0 + 2)
            .expect("append");
    }
    let other_agent = DidChain::genesis(&key(9), T0).expect("genesis");

    let cases: Vec<(&str, &DidChain, &DidChain, DeviceKey, &str)> = vec![
        ("equal", &base, &base, phone(), "ok"),
        (
            "theirs is a prefix of ours",
            &with_laptop,
            &base,
            phone(),
            "ok",
        ),
        ("theirs extends ours", &base, &with_laptop, phone(), "ok"),
        (
            "signer only in the extension",
            &base,
            &with_laptop,
            laptop(),
            "ok",
        ),
        // A branch we have not seen is judged by its own document: a pointer
        // is only a hint, and the connection's Hello merges the branches with
        // the fork rule before the device is accepted as a member.
        ("fork", &with_laptop, &with_tablet, phone(), "ok"),
        (
            "fork, signer only on their branch",
            &with_laptop,
            &with_tablet,
            key(6),
            "ok",
        ),
        (
            "fork, signer revoked on our branch only",
            &phone_revoked,
            &with_laptop,
            phone(),
            "ok",
        ),
        (
            "signer revoked in ours",
            &phone_revoked,
            &base,
            phone(),
            "unknown_signer",
        ),
        (
            "signer re-keyed in ours",
            &phone_rekeyed,
            &base,
            phone(),
            "bad_signature",
        ),
        ("another agent", &other_agent, &base, phone(), "wrong_key"),
    ];
    for (name, ours, theirs, signer, expect) in cases {
        let pointer = AgentPointer::new_signed(theirs, &ctx(&signer), PEER, &signer, TS)
            .expect("valid on its own");
        let bytes = pointer.encode().expect("encodes");
        let back = AgentPointer::decode(&bytes).expect("decodes");
        back.verify(&dht_key(theirs.did()), TS)
            .expect("verifies for a stranger");
        let got = outcome(back.verify_for_agent(&dht_key(theirs.did()), ours, TS));
        assert_eq!(got, expect, "case {name}");
    }
    // The DHT key we looked up must be our agent's, even for a record valid under its own key.
    let pointer =
        AgentPointer::new_signed(&base, &ctx(&phone()), PEER, &phone(), TS).expect("signs");
    let got = outcome(pointer.verify_for_agent(&dht_key(base.did()), &other_agent, TS));
    assert_eq!(got, "wrong_key");
}

// Goal: a revocation we hold beats an older proof. A pointer signed by a device that our
// current document no longer lists, carrying a proof whose head is in our chain, is refused
// with `unknown_signer` (a stranger, who cannot know better, accepts it). A pointer whose
// proof is ahead of our chain is judged by the proof's document and accepted, even for a
// device our own document does not list (yet).
#[test]
fn a_revocation_we_hold_beats_an_older_proof() {
    let base = agent_with_phone();
    let key = dht_key(base.did());
    let head_of = |p: &AgentPointer| {
        p.did_proof
            .entries()
            .last()
            .expect("head")
            .hash()
            .expect("hash")
    };
    let old = AgentPointer::new_signed(&base, &ctx(&phone()), PEER, &phone(), TS).expect("signs");

    let mut revoked = base.clone();
    remove_device(&mut revoked, &ctx(&phone()), T0 + 2);
    assert!(
        revoked.position_of(&head_of(&old)).is_some(),
        "we hold its head"
    );
    assert!(
        revoked.current().find_method(&ctx(&phone())).is_none(),
        "and revoked the phone after it"
    );
    assert_eq!(
        outcome(old.verify(&key, TS)),
        "ok",
        "a stranger cannot know"
    );
    assert_eq!(
        outcome(old.verify_for_agent(&key, &revoked, TS)),
        "unknown_signer"
    );
    // Later updates of ours do not change that.
    let mut later = revoked.clone();
    add_device(
        &mut later,
        &laptop(),
        &[Relationship::Authentication],
        None,
        T0 + 3,
    );
    assert_eq!(
        outcome(old.verify_for_agent(&key, &later, TS)),
        "unknown_signer"
    );

    // Ahead of us: a device listed after our head signs.
    let mut ahead = base.clone();
    add_device(
        &mut ahead,
        &laptop(),
        &[Relationship::Authentication],
        None,
        T0 + 2,
    );
    let pointer =
        AgentPointer::new_signed(&ahead, &ctx(&laptop()), PEER, &laptop(), TS).expect("signs");
    assert!(base.position_of(&head_of(&pointer)).is_none());
    assert!(base.current().find_method(&ctx(&laptop())).is_none());
    assert_eq!(outcome(pointer.verify_for_agent(&key, &base, TS)), "ok");

    // Ahead of our revocation: the phone was listed again after it.
    let mut relisted = revoked.clone();
    add_device(
        &mut relisted,
        &phone(),
        &[Relationship::Authentication],
        None,
        T0 + 3,
    );
    let pointer =
        AgentPointer::new_signed(&relisted, &ctx(&phone()), PEER, &phone(), TS).expect("signs");
    assert!(revoked.position_of(&head_of(&pointer)).is_none());
    assert_eq!(outcome(pointer.verify_for_agent(&key, &revoked, TS)), "ok");
    // Once we hold that head too, our document (which lists the phone again) decides.
    assert_eq!(outcome(pointer.verify_for_agent(&key, &relisted, TS)), "ok");
}

// Goal: a pointer stays small however long the chain grows: after 1,000 DID updates (a
// device listed and removed again, 500 times) the encoded record is at most 16 KiB, and it
// still verifies for a stranger and for the agent. Prints the size.
#[test]
fn a_pointer_after_1000_updates_stays_small() {
    const UPDATES: usize = 1_000;
    let mut log = agent_with_phone();
    let start = log.len();
    for i in 0..UPDATES / 2 {
        let now = T0 + 2 + i as i64;
        add_device(
            &mut log,
            &laptop(),
            &[Relationship::Authentication],
            None,
            now,
        );
        remove_device(&mut log, &ctx(&laptop()), now);
    }
    assert_eq!(log.len(), start + UPDATES);
    let pointer = AgentPointer::new_signed(&log, &ctx(&phone()), PEER, &phone(), TS)
        .expect("the phone may sign");
    let bytes = pointer.encode().expect("encodes");
    println!(
        "pointer after {UPDATES} DID updates ({} chain entries): {} bytes, {} proof entries",
        log.len(),
        bytes.len(),
        pointer.did_proof.entries().len()
    );
    assert!(
        bytes.len() <= 16 * 1024,
        "pointer is {} bytes, more than 16 KiB",
        bytes.len()
    );
    let back = AgentPointer::decode(&bytes).expect("decodes");
    let key = dht_key(log.did());
    back.verify(&key, TS).expect("verifies for anyone");
    back.verify_for_agent(&key, &log, TS)
        .expect("verifies for the agent");
}

// Goal: counter labels are distinct, so no two rejection kinds share a counter.
#[test]
fn labels_are_distinct() {
    let source = || DidError::KeyNotFound { key_id: "x".into() };
    let errors = [
        PointerError::TooLarge { len: 1, max: 0 },
        PointerError::Malformed(String::new()),
        PointerError::WrongKey,
        PointerError::WrongTopic,
        PointerError::BadDidLog(ChainError::Empty),
        PointerError::UnknownSigner {
            context_id: String::new(),
            source: source(),
        },
        PointerError::BadSignature,
        PointerError::Stale {
            timestamp: 0,
            now: 0,
        },
        PointerError::FromFuture {
            timestamp: 0,
            now: 0,
        },
        PointerError::Encode(serde_json::from_str::<Value>("x").expect_err("not json")),
    ];
    let labels: std::collections::BTreeSet<_> = errors.iter().map(PointerError::label).collect();
    assert_eq!(labels.len(), errors.len());
}
