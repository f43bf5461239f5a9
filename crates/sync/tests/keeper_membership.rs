//! A keeper is untrusted: what it serves of the agent's membership is
//! checked like a peer's, and all a hostile keeper can do is withhold.
//!
//! Goal: garbage, another agent's chain, a forged entry, an entry that
//! does not connect, and garbage or foreign grants served by a keeper
//! change neither the chain nor the key epoch of a device, and each is
//! counted (`keeper_chain_refused`, `epoch_grant_rejected`); a genuine
//! extension served the same way is merged. Method: a real session of
//! device 2 of an agent whose chain lists devices 2 and 3; the keeper's
//! batch is fed to `Session::on_keeper_membership` as the agent core
//! does after decoding a `KeeperBatch`.

mod common;

use common::{NOW_MS, T0_S, add, chain_of, ctx, key};
use nuwa_crypto::SyncKey;
use nuwa_crypto::epoch::{EpochGrant, x25519_public_key};
use nuwa_identity::chain::DidChain;
use nuwa_identity::keys::DeviceKey;
use nuwa_sync::{Count, Effect};

/// Entries `from..` of `chain`, as a keeper batch carries them.
fn entries(chain: &DidChain, from: usize) -> Vec<u8> {
    serde_json::to_vec(&chain.entries()[from..]).unwrap()
}

/// A grant of `epoch` sealed to device 2, signed by `signer` naming
/// `issuer` in agent `did`.
fn grant(did: &str, issuer: &str, signer: &DeviceKey, epoch: u64) -> Vec<u8> {
    let recipient = (ctx(2), x25519_public_key(&key(2).x25519_secret()));
    EpochGrant::create(
        &SyncKey::from_bytes(epoch, [9; 32]),
        &[recipient],
        &[],
        issuer,
        signer.signing_key(),
        did,
        T0_S as u64,
    )
    .unwrap()
    .encode()
    .unwrap()
}

fn counted(effects: &[Effect], c: Count) -> usize {
    effects
        .iter()
        .filter(|e| matches!(e, Effect::Count(x) if *x == c))
        .count()
}

#[test]
fn a_hostile_keeper_changes_no_chain_and_no_epoch_and_is_counted() {
    let chain = chain_of(1, &[2, 3]);
    let mut s = common::session(&chain, 2, 0, None);
    let head = chain.head_hash().to_owned();
    let master_ctx =
        nuwa_identity::document::DidDocument::fragment(&chain.current().capability_delegation[0])
            .to_owned();

    // A genuine extension the keeper could serve: device 4 added.
    let mut longer = chain.clone();
    add(&mut longer, 1, 4, T0_S + 10);
    // The same entry with its signature altered.
    let mut forged: serde_json::Value =
        serde_json::from_slice(&entries(&longer, chain.len())).unwrap();
    let sig = forged[0]["signature"].as_str().unwrap().to_owned();
    let flipped = if sig.ends_with('A') { "B" } else { "A" };
    forged[0]["signature"] = format!("{}{flipped}", &sig[..sig.len() - 1]).into();
    // Entries that skip one (they do not connect to our head).
    let mut two_more = longer.clone();
    add(&mut two_more, 1, 5, T0_S + 11);
    let hostile_chains: Vec<(&str, Vec<u8>)> = vec![
        ("garbage", b"\x00\xffnot json".to_vec()),
        ("an empty object", b"{}".to_vec()),
        ("another agent's chain", entries(&chain_of(9, &[2]), 1)),
        ("a forged entry", serde_json::to_vec(&forged).unwrap()),
        (
            "entries that do not connect",
            entries(&two_more, chain.len() + 1),
        ),
    ];
    for (what, bytes) in &hostile_chains {
        let effects = s.on_keeper_membership("keeper", bytes, &[], NOW_MS);
        assert_eq!(
            counted(&effects, Count::KeeperChainRefused),
            1,
            "{what}: counted as refused"
        );
        assert_eq!(s.log().head_hash(), head, "{what}: the chain did not move");
    }

    let foreign = chain_of(9, &[2]);
    let foreign_master =
        nuwa_identity::document::DidDocument::fragment(&foreign.current().capability_delegation[0])
            .to_owned();
    let hostile_grants: Vec<(&str, Vec<u8>)> = vec![
        ("garbage", vec![0x42; 300]),
        (
            "a grant signed by a key that is no admin",
            grant(chain.did(), &master_ctx, &key(3), 5),
        ),
        (
            "a grant of another agent",
            grant(foreign.did(), &foreign_master, &key(9), 5),
        ),
    ];
    for (what, bytes) in &hostile_grants {
        let effects = s.on_keeper_membership("keeper", &[], std::slice::from_ref(bytes), NOW_MS);
        assert_eq!(
            counted(&effects, Count::EpochGrantRejected),
            1,
            "{what}: counted as rejected"
        );
        assert_eq!(s.secure().epoch(), 0, "{what}: the epoch did not move");
    }

    // What a honest keeper serves is taken: the extension, then a grant
    // of the master key.
    let effects = s.on_keeper_membership("keeper", &entries(&longer, chain.len()), &[], NOW_MS);
    assert_eq!(counted(&effects, Count::KeeperChainMerged), 1);
    assert_eq!(s.log().head_hash(), longer.head_hash());
    s.on_keeper_membership(
        "keeper",
        &[],
        &[grant(chain.did(), &master_ctx, &key(1), 5)],
        NOW_MS,
    );
    assert_eq!(s.secure().epoch(), 5);
}
