//! A device's first words replay under a seeded entropy stream: the DID chain it proves, its
//! `Hello` (nonce and signature) and its DHT pointer all draw from `nuwa_entropy::fill`, which
//! a seeded simulator of whole agents needs to replay a failing seed.

use nuwa_entropy::with_deterministic_for_simulation;
use nuwa_identity::chain::DidChain;
use nuwa_identity::document::Relationship;
use nuwa_identity::keys::{DeviceKey, context_id_for};
use nuwa_proto::Hello;
use nuwa_sync::Membership;
use nuwa_sync::pointer::AgentPointer;

const T0_S: i64 = 1_900_000_000;
const NOW_MS: u64 = (T0_S as u64 + 10) * 1000;

/// A chain where the master (seed 1) adds a phone (seed 2), then the phone's Hello and its
/// signed pointer. Only randomness differs between runs.
fn first_words() -> (Hello, AgentPointer) {
    let master = DeviceKey::from_seed(&[1; 32]);
    let phone = DeviceKey::from_seed(&[2; 32]);
    let mut chain = DidChain::genesis(&master, T0_S).expect("genesis");
    let master_id = chain.current().capability_delegation[0].clone();
    let ctx = context_id_for(&phone.public());
    let mut doc = chain.current().clone();
    doc.add_key(&ctx, &phone.public(), &[Relationship::Authentication], None)
        .expect("add the phone");
    chain
        .append_document(&doc, &master, &master_id, T0_S + 1)
        .expect("master adds the phone");
    let pointer =
        AgentPointer::new_signed(&chain, &ctx, "12D3KooWPhone", &phone, T0_S + 2).expect("pointer");
    let membership = Membership::new(chain, ctx, "phone".to_owned(), phone);
    let hello = membership.hello(NOW_MS).expect("hello");
    (hello, pointer)
}

// Goal: one seed, one Hello and one pointer, byte for byte; method: build twice under seed 42,
// once under 43, and twice without a seed.
#[test]
fn hello_and_pointer_replay_under_a_seed() {
    let a = with_deterministic_for_simulation(42, first_words);
    let b = with_deterministic_for_simulation(42, first_words);
    assert_eq!(a, b);
    let c = with_deterministic_for_simulation(43, first_words);
    assert_ne!(a.0.nonce, c.0.nonce);
    assert_ne!(
        a.0.did_proof, c.0.did_proof,
        "entry nonces differ, so hashes do"
    );
    assert_ne!(a.1, c.1);
    let (d, e) = (first_words(), first_words());
    assert_ne!(d.0, e.0);
    assert_ne!(d.1, e.1);
}
