//! What a long DID chain costs: sizes and verification times after N
//! updates of the kind users make (pair a device, revoke it), plus the cost
//! of one authority change. Prints figures; run it in release:
//!
//! ```text
//! cargo run --release -p nuwa-identity --example chain_cost -- 1000
//! ```

use std::time::Instant;

use nuwa_identity::chain::{DidChain, DidProof};
use nuwa_identity::document::Relationship;
use nuwa_identity::keys::{DeviceKey, context_id_for};

const RELS: &[Relationship] = &[
    Relationship::Authentication,
    Relationship::AssertionMethod,
    Relationship::CapabilityInvocation,
];

fn main() {
    let n: usize = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(1000);
    let t0: i64 = 1_750_000_000;
    let master = DeviceKey::from_seed(&[1; 32]);
    let mut chain = DidChain::genesis(&master, t0).expect("genesis");
    let master_id = chain.current().capability_delegation[0].clone();
    let keep = DeviceKey::from_seed(&[2; 32]);
    let mut doc = chain.current().clone();
    doc.add_key(&context_id_for(&keep.public()), &keep.public(), RELS, None)
        .expect("add");
    chain
        .append_document(&doc, &master, &master_id, t0)
        .expect("first device");

    let started = Instant::now();
    for i in 0..n {
        let dev = DeviceKey::from_seed(&[(i / 2 % 200) as u8 + 10; 32]);
        let ctx = context_id_for(&dev.public());
        let mut doc = chain.current().clone();
        if i % 2 == 0 {
            doc.add_key(&ctx, &dev.public(), RELS, None).expect("add");
        } else {
            doc.remove_key(&ctx).expect("remove");
        }
        chain
            .append_document(&doc, &master, &master_id, t0 + 1 + i as i64)
            .expect("append");
    }
    let build = started.elapsed();
    let now = t0 + n as i64 + 10;
    let did = chain.did().to_owned();

    let json = serde_json::to_vec(&chain).expect("json");
    let t = Instant::now();
    chain.verify(Some(&did), now).expect("verifies");
    let full = t.elapsed();
    let t = Instant::now();
    let parsed: DidChain = serde_json::from_slice(&json).expect("parse");
    let parse = t.elapsed();

    let proof = chain.proof().encode().expect("proof");
    let t = Instant::now();
    let verified = DidProof::decode(&proof)
        .expect("decode")
        .verify(&did, now)
        .expect("proof verifies");
    let proof_time = t.elapsed();
    assert_eq!(verified.head_hash(), chain.head_hash());

    // One more entry, merged into the chain without it: what a device that
    // is one update behind pays.
    let mut behind = parsed.clone();
    let mut ahead = chain.clone();
    let mut doc = ahead.current().clone();
    let extra = DeviceKey::from_seed(&[250; 32]);
    doc.add_key(
        &context_id_for(&extra.public()),
        &extra.public(),
        RELS,
        None,
    )
    .expect("add");
    ahead
        .append_document(&doc, &master, &master_id, now)
        .expect("append");
    let t = Instant::now();
    behind.merge(&ahead, now).expect("merge");
    let merge_one = t.elapsed();

    // A device that holds only the first entries merges everything.
    let genesis_only = serde_json::json!({ "entries": [&chain.entries()[0]] });
    let mut fresh: DidChain = serde_json::from_value(genesis_only).expect("genesis");
    let t = Instant::now();
    fresh.merge(&ahead, now).expect("merge all");
    let merge_all = t.elapsed();

    // An authority change: promote the kept device.
    let before = ahead.proof().encode().expect("proof").len();
    let mut doc = ahead.current().clone();
    doc.capability_delegation
        .push(doc.key_id(&context_id_for(&keep.public())));
    ahead
        .append_document(&doc, &master, &master_id, now)
        .expect("promote");
    // Then an ordinary entry again, so both proofs end on one.
    let mut doc = ahead.current().clone();
    doc.remove_key(&context_id_for(&extra.public()))
        .expect("remove");
    ahead
        .append_document(&doc, &master, &master_id, now)
        .expect("append");
    let after = ahead.proof().encode().expect("proof").len();

    println!("updates (pair/revoke)           {n}");
    println!("chain entries                   {}", chain.len());
    println!("chain JSON                      {} bytes", json.len());
    println!("proof (Hello, DHT pointer)      {} bytes", proof.len());
    println!("build {n} updates                {build:?}");
    println!("parse chain JSON                {parse:?}");
    println!("verify whole chain              {full:?}");
    println!("verify proof                    {proof_time:?}");
    println!("merge one new entry             {merge_one:?}");
    println!("merge whole chain into genesis  {merge_all:?}");
    println!(
        "one authority change adds       {} bytes to the proof",
        after - before
    );
}
