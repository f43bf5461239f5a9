//! Lost first Hellos cost a resend, not the whole Hello deadline.
//!
//! Goal: when both first Hellos are lost (they went out on a connection
//! that closed at once, as after a network change or on a recovered
//! home's first run), each side sends its Hello again after
//! `hello_resend_ms` and both verify long before `hello_deadline_ms`; and
//! when only one side's Hello was lost, the side that verified answers the
//! other's resend, at most once per `hello_answer_ms`. Method: two real
//! sessions of one agent, Hellos carried through `Frame::encode`/`decode`
//! or dropped, time moved by `tick`.

use nuwa_crypto::SyncKey;
use nuwa_crypto::epoch::KeyRing;
use nuwa_identity::chain::DidChain;
use nuwa_identity::document::Relationship;
use nuwa_identity::keys::{DeviceKey, context_id_for};
use nuwa_proto::{Frame, Hello};
use nuwa_sync::{Config, Effect, Engine, Membership, SecureChannel, Session, SessionConfig};

const T0_S: i64 = 1_900_000_000;
const NOW_MS: u64 = (T0_S as u64 + 1_000) * 1000;

fn key(n: u8) -> DeviceKey {
    DeviceKey::from_seed(&[n; 32])
}

fn ctx(n: u8) -> String {
    context_id_for(&key(n).public())
}

/// Master key 1; devices 2 and 3 listed for authentication.
fn chain() -> DidChain {
    let mut chain = DidChain::genesis(&key(1), T0_S).unwrap();
    let master_id = chain.current().capability_delegation[0].clone();
    for (i, n) in [2u8, 3].into_iter().enumerate() {
        let mut doc = chain.current().clone();
        doc.add_key(
            &ctx(n),
            &key(n).public(),
            &[Relationship::Authentication],
            None,
        )
        .unwrap();
        chain
            .append_document(&doc, &key(1), &master_id, T0_S + 1 + i as i64)
            .unwrap();
    }
    chain
}

fn session(chain: &DidChain, dev: u8) -> Session {
    let membership = Membership::new(chain.clone(), ctx(dev), format!("d{dev}"), key(dev));
    let secure = SecureChannel::new(
        chain.did().to_owned(),
        ctx(dev),
        KeyRing::new(SyncKey::from_bytes(0, [7; 32])),
    );
    let engine = Engine::new(key(dev).public().to_vec(), Config::default());
    Session::new(membership, secure, engine, SessionConfig::default())
}

/// The Hellos among `effects`, as the other side decodes them.
fn hellos(effects: &[Effect]) -> Vec<Hello> {
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

fn verified(effects: &[Effect]) -> bool {
    effects
        .iter()
        .any(|e| matches!(e, Effect::PeerVerified { .. }))
}

fn is_verified(s: &Session, peer: &str) -> bool {
    s.verified().any(|(p, _)| p == peer)
}

#[test]
fn both_first_hellos_lost_cost_one_resend() {
    let chain = chain();
    let mut a = session(&chain, 2);
    let mut b = session(&chain, 3);
    // Both first Hellos go out and are lost with their connection.
    assert_eq!(
        hellos(&a.connected("b", Some(key(3).public()), "sim".into(), NOW_MS)).len(),
        1
    );
    assert_eq!(
        hellos(&b.connected("a", Some(key(2).public()), "sim".into(), NOW_MS)).len(),
        1
    );
    // Before the resend time nothing goes out again.
    assert!(hellos(&a.tick(NOW_MS + 1_000)).is_empty());
    let resend = SessionConfig::default().hello_resend_ms;
    let deadline = SessionConfig::default().hello_deadline_ms;
    assert!(resend * 2 < deadline);
    let t = NOW_MS + resend;
    let from_a = hellos(&a.tick(t));
    let from_b = hellos(&b.tick(t));
    assert_eq!((from_a.len(), from_b.len()), (1, 1), "each side resends");
    assert!(verified(&b.on_hello("a", &from_a[0], t)));
    assert!(verified(&a.on_hello("b", &from_b[0], t)));
    assert!(is_verified(&a, "b") && is_verified(&b, "a"));
    // Verified peers are not sent resends.
    assert!(hellos(&a.tick(t + resend)).is_empty());
}

#[test]
fn a_verified_peer_answers_a_resent_hello_at_most_every_answer_interval() {
    let chain = chain();
    let mut a = session(&chain, 2);
    let mut b = session(&chain, 3);
    let to_b = hellos(&a.connected("b", Some(key(3).public()), "sim".into(), NOW_MS));
    // b's first Hello is lost; a's arrives, so b verifies a.
    b.connected("a", Some(key(2).public()), "sim".into(), NOW_MS);
    assert!(verified(&b.on_hello("a", &to_b[0], NOW_MS)));
    // a still waits, and resends; b answers with its Hello.
    let resend = SessionConfig::default().hello_resend_ms;
    let t = NOW_MS + resend;
    let again = hellos(&a.tick(t));
    assert_eq!(again.len(), 1);
    let answer = hellos(&b.on_hello("a", &again[0], t));
    assert_eq!(answer.len(), 1, "b answers a's resent Hello");
    assert!(verified(&a.on_hello("b", &answer[0], t)));
    // Later, b's periodic refresh reaches a: however the answers go, two
    // verified peers stop bouncing Hellos within a few hops (each answers
    // at most once per `hello_answer_ms`).
    let refresh_ms = SessionConfig::default().hello_refresh_ms;
    let t2 = t + refresh_ms;
    let refresh = hellos(&b.tick(t2));
    assert_eq!(refresh.len(), 1, "the periodic refresh goes out");
    let mut hops = 0;
    let mut pending = refresh;
    let mut to_a = true;
    while let Some(h) = pending.pop() {
        hops += 1;
        assert!(hops <= 3, "Hellos bounce between verified peers");
        pending = if to_a {
            hellos(&a.on_hello("b", &h, t2))
        } else {
            hellos(&b.on_hello("a", &h, t2))
        };
        to_a = !to_a;
    }
    assert!(is_verified(&a, "b") && is_verified(&b, "a"));
    // Past the interval, a verified peer's Hello is answered again.
    let t3 = t2 + 1_000;
    let again = hellos(&b.tick(t3 + refresh_ms));
    assert_eq!(again.len(), 1);
    let answered = hellos(&a.on_hello("b", &again[0], t3 + refresh_ms)).len();
    assert_eq!(answered, 1, "past the interval a Hello is answered again");
}
