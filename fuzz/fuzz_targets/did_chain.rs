//! Fuzzes the v2 DID chain's decoders. The same input goes to
//! `DidProof::decode`, then `verify` against the fixed agent's DID, and to
//! `serde_json::from_slice::<DidChain>`, then `verify`, `proof`, and
//! `compare_branches` and `merge` in both directions against two valid
//! chains of the fixed agent (its genesis, and the genesis plus one device
//! as a v2 entry).
//!
//! Checks that decoding, verifying, comparing and merging hostile input
//! never panic, that the branch order is antisymmetric, that a merge which
//! fails leaves our chain unchanged, and that a decoded proof and a parsed
//! chain survive encode → decode unchanged.
#![no_main]

use std::sync::LazyLock;

use libfuzzer_sys::fuzz_target;
use nuwa_fuzz::{NOW_UNIX_SECS, agent_did, device, device_context_id, genesis_log, master};
use nuwa_identity::chain::{DidChain, DidProof, compare_branches};
use nuwa_identity::did_key::ed25519_public_multibase;
use nuwa_identity::document::Relationship;

struct Fixture {
    did: String,
    chains: [DidChain; 2],
}

static FIXTURE: LazyLock<Fixture> = LazyLock::new(|| {
    // Constant inputs: a failure here is a harness bug, not a finding.
    let genesis = DidChain::from_v1(&genesis_log()).expect("the genesis log converts");
    let mut with_device = genesis.clone();
    let mut doc = with_device.current().clone();
    doc.add_key(
        &device_context_id(),
        &device().public(),
        &[Relationship::Authentication],
        None,
    )
    .expect("add a fixed key to a fixed document");
    let master = master();
    let master_id = ed25519_public_multibase(&master.public());
    with_device
        .append_document(&doc, &master, &master_id, NOW_UNIX_SECS + 1)
        .expect("master signs a fixed entry");
    Fixture {
        did: agent_did(),
        chains: [genesis, with_device],
    }
});

fuzz_target!(|data: &[u8]| {
    let f = &*FIXTURE;

    if let Ok(proof) = DidProof::decode(data) {
        let _ = proof.verify(&f.did, NOW_UNIX_SECS);
        if let Ok(bytes) = proof.encode() {
            let again = DidProof::decode(&bytes);
            assert_eq!(again.ok().as_ref(), Some(&proof), "proof round trip");
        }
    }

    let Ok(chain) = serde_json::from_slice::<DidChain>(data) else {
        return;
    };
    let _ = chain.verify(None, NOW_UNIX_SECS);
    let _ = chain.verify(Some(&f.did), NOW_UNIX_SECS);
    let _ = chain.proof().verify(&f.did, NOW_UNIX_SECS);
    let _ = (
        chain.current(),
        chain.did(),
        chain.head_hash(),
        chain.len(),
        chain.authority(),
    );

    for ours in &f.chains {
        if let (Ok(a), Ok(b)) = (
            compare_branches(ours, &chain),
            compare_branches(&chain, ours),
        ) {
            assert_eq!(a, b.reverse(), "branch order is antisymmetric");
        }
        let mut mine = ours.clone();
        if mine.merge(&chain, NOW_UNIX_SECS).is_err() {
            assert_eq!(&mine, ours, "a failed merge changed our chain");
        }
        let mut theirs = chain.clone();
        if theirs.merge(ours, NOW_UNIX_SECS).is_err() {
            assert_eq!(theirs, chain, "a failed merge changed the fuzzed chain");
        }
    }

    if let Ok(json) = serde_json::to_vec(&chain) {
        let again = serde_json::from_slice::<DidChain>(&json);
        assert_eq!(again.ok().as_ref(), Some(&chain), "json round trip");
    }
});
