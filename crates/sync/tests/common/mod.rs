//! What the session tests of issue 24 share: one agent's chain with
//! devices listed for authentication and key agreement, a real session
//! of one device, and Hellos as the other side decodes them off the wire.

#![allow(dead_code)] // each test file uses part of it

use nuwa_crypto::SyncKey;
use nuwa_crypto::epoch::{KeyRing, x25519_public_key};
use nuwa_identity::chain::DidChain;
use nuwa_identity::document::Relationship;
use nuwa_identity::keys::{DeviceKey, context_id_for};
use nuwa_proto::{Frame, Hello};
use nuwa_sync::{Config, Effect, Engine, Membership, SecureChannel, Session, SessionConfig};

pub const T0_S: i64 = 1_900_000_000;
pub const NOW_MS: u64 = (T0_S as u64 + 1_000) * 1000;

pub fn key(n: u8) -> DeviceKey {
    DeviceKey::from_seed(&[n; 32])
}

pub fn ctx(n: u8) -> String {
    context_id_for(&key(n).public())
}

/// The agent of master key `master` with devices `devs` listed, one entry
/// each.
pub fn chain_of(master: u8, devs: &[u8]) -> DidChain {
    let mut chain = DidChain::genesis(&key(master), T0_S).unwrap();
    for (i, n) in devs.iter().enumerate() {
        add(&mut chain, master, *n, T0_S + 1 + i as i64);
    }
    chain
}

/// Lists device `n` (authentication and key agreement), signed by `master`.
pub fn add(chain: &mut DidChain, master: u8, n: u8, t: i64) {
    let master_id = chain.current().capability_delegation[0].clone();
    let mut doc = chain.current().clone();
    let dev = key(n);
    doc.add_key(
        &ctx(n),
        &dev.public(),
        &[Relationship::Authentication],
        None,
    )
    .unwrap();
    doc.add_key_agreement_key(
        &format!("{}-x25519", ctx(n)),
        &x25519_public_key(&dev.x25519_secret()),
        None,
    )
    .unwrap();
    chain
        .append_document(&doc, &key(master), &master_id, t)
        .unwrap();
}

/// Device `dev`'s session, writing under `epoch`, forwarding `forwarded`
/// as its grant when given.
pub fn session(chain: &DidChain, dev: u8, epoch: u64, forwarded: Option<Vec<u8>>) -> Session {
    let mut membership = Membership::new(chain.clone(), ctx(dev), format!("d{dev}"), key(dev));
    if let Some(grant) = forwarded {
        membership.set_epoch_grant(grant);
    }
    let secure = SecureChannel::new(
        chain.did().to_owned(),
        ctx(dev),
        KeyRing::new(SyncKey::from_bytes(epoch, [epoch as u8; 32])),
    );
    let engine = Engine::new(key(dev).public().to_vec(), Config::default());
    Session::new(membership, secure, engine, SessionConfig::default())
}

/// The Hellos among `effects`, as the other side decodes them.
pub fn hellos(effects: &[Effect]) -> Vec<Hello> {
    effects
        .iter()
        .filter_map(|e| match e {
            Effect::SendHello { hello, .. } => {
                match Frame::decode(&Frame::Hello((**hello).clone()).encode()) {
                    Ok(Frame::Hello(h)) => Some(h),
                    other => panic!("not a Hello: {other:?}"),
                }
            }
            _ => None,
        })
        .collect()
}
