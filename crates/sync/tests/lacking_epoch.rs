//! A peer that lacks the epoch we write under is told of (so the daemon
//! seals that epoch to it), unless the grant we forward already holds it.
//!
//! Goal: the "covered" shortcut looks at the grant of our *current* epoch
//! only. Seed 688 of the agent simulator: an admin opened epoch E2 on a
//! branch that lost, then adopted the winner's lower epoch E1 and forwarded
//! E1's grant; E1's grant names the peers, so they counted as covered and
//! never got E2, and the devices ended on two epochs for good. Method: two
//! real sessions of one agent; device 2 writes under epoch 9, device 3
//! holds epoch 5; device 2's forwarded grant is of epoch 5 (sealed to
//! device 3) in one case and of epoch 9 (sealed to device 3) in the other.

mod common;

use common::{NOW_MS, T0_S, chain_of, ctx, hellos, key, session};
use nuwa_crypto::SyncKey;
use nuwa_crypto::epoch::{EpochGrant, x25519_public_key};
use nuwa_identity::chain::DidChain;
use nuwa_sync::Effect;

/// A grant of `epoch`, sealed to device 3, signed by the master key.
fn grant(chain: &DidChain, epoch: u64) -> Vec<u8> {
    let recipient = (ctx(3), x25519_public_key(&key(3).x25519_secret()));
    let master_ctx =
        nuwa_identity::document::DidDocument::fragment(&chain.current().capability_delegation[0])
            .to_owned();
    EpochGrant::create(
        &SyncKey::from_bytes(epoch, [epoch as u8; 32]),
        &[recipient],
        &[],
        &master_ctx,
        key(1).signing_key(),
        chain.did(),
        T0_S as u64,
    )
    .unwrap()
    .encode()
    .unwrap()
}

/// Device 2 (writing under epoch 9, forwarding `forwarded`) meets device
/// 3 (holding epoch 5 and its grant); whether device 2 says 3 lacks 9.
fn told_lacking(forwarded_epoch: u64) -> bool {
    let chain = chain_of(1, &[2, 3]);
    let mut a = session(&chain, 2, 9, Some(grant(&chain, forwarded_epoch)));
    let mut b = session(&chain, 3, 5, Some(grant(&chain, 5)));
    a.connected("b", Some(key(3).public()), "sim".into(), NOW_MS);
    let to_a = b.connected("a", Some(key(2).public()), "sim".into(), NOW_MS);
    let effects = a.on_hello("b", &hellos(&to_a)[0], NOW_MS);
    assert!(
        effects
            .iter()
            .any(|e| matches!(e, Effect::PeerVerified { .. })),
        "device 3 is verified: {effects:?}"
    );
    effects.iter().any(|e| {
        matches!(e, Effect::PeerLacksEpoch { context_id, epoch: 9, .. } if *context_id == ctx(3))
    })
}

#[test]
fn a_peer_named_only_by_an_older_epochs_grant_is_told_of_as_lacking_ours() {
    assert!(
        told_lacking(5),
        "the grant we forward is of epoch 5: it does not give device 3 epoch 9"
    );
    assert!(
        !told_lacking(9),
        "the grant we forward is of epoch 9 and sealed to device 3: it is covered"
    );
}
