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

mod common;

use common::{NOW_MS, chain_of, hellos, key};
use nuwa_sync::{Effect, Session, SessionConfig};

/// Devices 2 and 3 of one agent, both at epoch 0.
fn pair() -> (Session, Session) {
    let chain = chain_of(1, &[2, 3]);
    (
        common::session(&chain, 2, 0, None),
        common::session(&chain, 3, 0, None),
    )
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
    let (mut a, mut b) = pair();
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
    // A stranger (a key the agent does not list) connected too: it got
    // the first Hello, as anyone does, and no resend.
    assert_eq!(
        hellos(&a.connected("z", Some(key(9).public()), "sim".into(), NOW_MS)).len(),
        1
    );
    let t = NOW_MS + resend;
    let from_a: Vec<_> = a
        .tick(t)
        .into_iter()
        .filter(|e| matches!(e, Effect::SendHello { peer, .. } if peer == "b"))
        .collect();
    let from_a = hellos(&from_a);
    let from_b = hellos(&b.tick(t));
    assert_eq!((from_a.len(), from_b.len()), (1, 1), "each side resends");
    assert!(
        !a.tick(t + resend)
            .iter()
            .any(|e| matches!(e, Effect::SendHello { peer, .. } if peer == "z")),
        "no resend to a stranger"
    );
    assert!(verified(&b.on_hello("a", &from_a[0], t)));
    assert!(verified(&a.on_hello("b", &from_b[0], t)));
    assert!(is_verified(&a, "b") && is_verified(&b, "a"));
    // Verified peers are not sent resends.
    assert!(hellos(&a.tick(t + resend)).is_empty());
}

#[test]
fn a_verified_peer_answers_a_resent_hello_at_most_every_answer_interval() {
    let (mut a, mut b) = pair();
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
