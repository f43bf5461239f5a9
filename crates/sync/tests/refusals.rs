//! Bad input from a peer gets a typed refusal, is reported, and is never
//! applied.
//!
//! Goal: a tampered, replayed or mislabelled `Hello` is refused with its
//! own `Rejection` label and the connection is dropped without the peer
//! being verified; an envelope of a verified peer whose bytes were altered
//! is refused with its own `EnvelopeRejected` label and changes nothing in
//! the container. Method: real sessions of one agent (devices 2, 3 and 4
//! listed in one DID chain, all with the same sync key), real Hellos and
//! sealed envelopes, each sent through `Frame::encode`/`decode` as on the
//! wire, altered one byte at a time.

use nuwa_crypto::epoch::KeyRing;
use nuwa_crypto::{Envelope, SyncKey};
use nuwa_identity::chain::DidChain;
use nuwa_identity::document::Relationship;
use nuwa_identity::keys::{DeviceKey, context_id_for};
use nuwa_identity::nip2::signing_hash;
use nuwa_proto::{Frame, Hello, SyncPayload};
use nuwa_sync::{
    Config, Door, Effect, Engine, Membership, Rejection, SecureChannel, Session, SessionConfig,
};
use serde_json::{Value, json};

const T0_S: i64 = 1_900_000_000;
const NOW_MS: u64 = (T0_S as u64 + 1_000) * 1000;
const RELS: &[Relationship] = &[Relationship::Authentication];
const SYNC_KEY: [u8; 32] = [7; 32];

fn key(n: u8) -> DeviceKey {
    DeviceKey::from_seed(&[n; 32])
}

fn ctx(n: u8) -> String {
    context_id_for(&key(n).public())
}

fn add(chain: &mut DidChain, dev: &DeviceKey, t: i64) {
    let master_id = chain.documents().next().unwrap().capability_delegation[0].clone();
    let mut doc = chain.current().clone();
    doc.add_key(&context_id_for(&dev.public()), &dev.public(), RELS, None)
        .unwrap();
    chain.append_document(&doc, &key(1), &master_id, t).unwrap();
}

/// Master key 1; devices 2, 3 and 4 listed for authentication.
fn chain() -> DidChain {
    let mut chain = DidChain::genesis(&key(1), T0_S).unwrap();
    for (i, dev) in [2, 3, 4].into_iter().enumerate() {
        add(&mut chain, &key(dev), T0_S + 1 + i as i64);
    }
    chain
}

fn session(chain: &DidChain, dev: u8) -> Session {
    let k = key(dev);
    let membership = Membership::new(chain.clone(), ctx(dev), format!("d{dev}"), key(dev));
    let secure = SecureChannel::new(
        chain.did().to_owned(),
        ctx(dev),
        KeyRing::new(SyncKey::from_bytes(0, SYNC_KEY)),
    );
    let engine = Engine::new(k.public().to_vec(), Config::default());
    Session::new(membership, secure, engine, SessionConfig::default())
}

fn hello_of(effects: &[Effect]) -> Hello {
    effects
        .iter()
        .find_map(|e| match e {
            Effect::SendHello { hello, .. } => Some((**hello).clone()),
            _ => None,
        })
        .expect("a Hello")
}

/// A Hello as the receiving side decodes it off the wire.
fn wire_hello(hello: &Hello) -> Hello {
    match Frame::decode(&Frame::Hello(hello.clone()).encode()) {
        Ok(Frame::Hello(h)) => h,
        other => panic!("hello round trip: {other:?}"),
    }
}

/// An envelope as the receiving side decodes it off the wire.
fn wire_envelope(env: &Envelope) -> Envelope {
    match Frame::decode(&Frame::Envelope(env.clone()).encode()) {
        Ok(Frame::Envelope(e)) => e,
        other => panic!("envelope round trip: {other:?}"),
    }
}

/// The one rejection among `effects` (none: `None`; several: a panic).
fn rejection(effects: &[Effect]) -> Option<&Rejection> {
    let all: Vec<&Rejection> = effects
        .iter()
        .filter_map(|e| match e {
            Effect::Rejected { rejection, .. } => Some(rejection),
            _ => None,
        })
        .collect();
    assert!(all.len() <= 1, "more than one rejection: {effects:?}");
    all.first().copied()
}

/// The label of the one `Rejected` effect, checking it names `peer` and
/// came through the connection door.
fn rejected(effects: &[Effect], peer: &str) -> Option<&'static str> {
    let r = rejection(effects)?;
    assert!(
        effects.iter().any(|e| matches!(
            e,
            Effect::Rejected { peer: p, door: Door::Connection, .. } if p == peer
        )),
        "the refusal names {peer} and the connection door: {effects:?}"
    );
    Some(r.label())
}

fn disconnected(effects: &[Effect], peer: &str) -> bool {
    effects
        .iter()
        .any(|e| matches!(e, Effect::Disconnect { peer: p } if p == peer))
}

fn verified(effects: &[Effect]) -> bool {
    effects
        .iter()
        .any(|e| matches!(e, Effect::PeerVerified { .. }))
}

fn is_verified(s: &Session, peer: &str) -> bool {
    s.verified().any(|(p, _)| p == peer)
}

/// `a` (device `x`, peer key "a" at `b`) and `b` (device `y`, peer key "b"
/// at `a`) connect; returns both sessions and the Hello `a` sent to `b`,
/// not yet delivered.
fn connect(chain: &DidChain, x: u8, y: u8) -> (Session, Session, Hello) {
    let mut a = session(chain, x);
    let mut b = session(chain, y);
    let to_b = a.connected("b", Some(key(y).public()), "sim".into(), NOW_MS);
    b.connected("a", Some(key(x).public()), "sim".into(), NOW_MS);
    (a, b, hello_of(&to_b))
}

/// Devices 2 ("a") and 3 ("b") connect and verify each other.
fn meet(chain: &DidChain) -> (Session, Session) {
    let mut a = session(chain, 2);
    let mut b = session(chain, 3);
    let to_b = a.connected("b", Some(key(3).public()), "sim".into(), NOW_MS);
    let to_a = b.connected("a", Some(key(2).public()), "sim".into(), NOW_MS);
    assert!(verified(&a.on_hello(
        "b",
        &wire_hello(&hello_of(&to_a)),
        NOW_MS
    )));
    assert!(verified(&b.on_hello(
        "a",
        &wire_hello(&hello_of(&to_b)),
        NOW_MS
    )));
    (a, b)
}

// Goal: a Hello whose signature was altered in one byte is refused as
// `bad_signature`, the connection is dropped (`Disconnect`) and the peer
// is not verified; the refusal burns nothing, so the untouched Hello on a
// new connection is admitted (what the refusal hinged on was the byte).
#[test]
fn a_hello_with_a_flipped_signature_byte_is_refused_as_bad_signature() {
    let chain = chain();
    for at in [0, 31, 63] {
        let (_, mut b, hello) = connect(&chain, 2, 3);
        let mut tampered = hello.clone();
        tampered.signature[at] ^= 0x01;
        let out = b.on_hello("a", &wire_hello(&tampered), NOW_MS);
        assert_eq!(
            rejected(&out, "a"),
            Some("bad_signature"),
            "byte {at}: {out:?}"
        );
        assert_eq!(rejection(&out), Some(&Rejection::BadSignature));
        assert!(disconnected(&out, "a"), "byte {at}: dropped: {out:?}");
        assert!(!verified(&out), "byte {at}");
        assert!(!is_verified(&b, "a"), "byte {at}");
        assert!(b.peers().is_empty(), "byte {at}: b forgot the peer");

        b.connected("a", Some(key(2).public()), "sim".into(), NOW_MS);
        let out = b.on_hello("a", &wire_hello(&hello), NOW_MS);
        assert!(verified(&out), "byte {at}: the genuine Hello: {out:?}");
    }
}

// Goal: a genuine Hello delivered a second time is refused as `replay`
// (its nonce was recorded when it verified), whether it comes on a new
// connection of the same peer or again on the live connection; in both
// cases the code drops the connection (`Disconnect`) and forgets the
// peer, verified or not. A fresh Hello of the same device is admitted
// afterwards. The nonce store is per receiving device: device 4, which
// never saw these bytes, admits them from device 2's key (only the
// holder of that key can present it, the PeerId being authenticated).
#[test]
fn a_replayed_hello_is_refused_as_replay() {
    let chain = chain();
    let (mut a, mut b, hello) = connect(&chain, 2, 3);
    let out = b.on_hello("a", &wire_hello(&hello), NOW_MS);
    assert!(verified(&out), "first delivery: {out:?}");

    // A new connection of the same peer, the same bytes a second later.
    b.disconnected("a");
    b.connected("a", Some(key(2).public()), "sim".into(), NOW_MS + 1_000);
    let out = b.on_hello("a", &wire_hello(&hello), NOW_MS + 1_000);
    assert_eq!(rejected(&out, "a"), Some("replay"), "{out:?}");
    assert!(disconnected(&out, "a"), "{out:?}");
    assert!(!verified(&out));
    assert!(!is_verified(&b, "a"));
    assert!(b.peers().is_empty());

    // A fresh Hello (new nonce) of the same device is admitted.
    a.disconnected("b");
    let fresh = hello_of(&a.connected("b", Some(key(3).public()), "sim".into(), NOW_MS + 2_000));
    assert_ne!(fresh.nonce, hello.nonce);
    b.connected("a", Some(key(2).public()), "sim".into(), NOW_MS + 2_000);
    let out = b.on_hello("a", &wire_hello(&fresh), NOW_MS + 2_000);
    assert!(verified(&out), "{out:?}");

    // Either Hello again on the live, verified connection: refused, and
    // the verified peer is dropped.
    for (name, old) in [("first", &hello), ("fresh", &fresh)] {
        let out = b.on_hello("a", &wire_hello(old), NOW_MS + 3_000);
        assert_eq!(rejected(&out, "a"), Some("replay"), "{name}: {out:?}");
        assert!(disconnected(&out, "a"), "{name}: {out:?}");
        assert!(!is_verified(&b, "a"), "{name}");
        b.connected("a", Some(key(2).public()), "sim".into(), NOW_MS + 3_000);
    }

    // Another device keeps its own nonces.
    let mut c = session(&chain, 4);
    c.connected("a", Some(key(2).public()), "sim".into(), NOW_MS + 1_000);
    let out = c.on_hello("a", &wire_hello(&hello), NOW_MS + 1_000);
    assert!(verified(&out), "{out:?}");
}

/// `hello`, claiming `context_id` instead, signed again by `signer`.
fn relabelled(hello: &Hello, context_id: String, signer: &DeviceKey) -> Hello {
    let mut h = hello.clone();
    h.context_id = context_id;
    h.signature = signer.sign(&signing_hash(Hello::DOMAIN, &h.signing_content()));
    h
}

// Goal: a peer cannot pass for another listed device. Device 3's genuine
// Hello on a connection whose PeerId key is device 4's is refused as
// `bad_signature` (the signature is checked against the connection's key
// before anything else); a Hello that device 4 signed itself but that
// claims device 3's context id is refused as `context_mismatch` with both
// ids, whether the receiver holds the proof's head or not (then it fetches
// nothing for it). Every time the connection is dropped and nobody is
// verified.
#[test]
fn a_hello_claiming_another_devices_context_is_refused() {
    let chain = chain();

    // Device 3's Hello (to device 2) arrives on device 4's connection.
    let (_, mut a, hello3) = connect(&chain, 3, 2);
    a.disconnected("a");
    a.connected("c", Some(key(4).public()), "sim".into(), NOW_MS);
    let out = a.on_hello("c", &wire_hello(&hello3), NOW_MS);
    assert_eq!(rejected(&out, "c"), Some("bad_signature"), "{out:?}");
    assert!(disconnected(&out, "c"));
    assert!(!verified(&out));

    // Device 4 signs a Hello claiming device 3's context id.
    let mut ahead = chain.clone();
    add(&mut ahead, &key(9), T0_S + 10);
    for (name, theirs) in [("same chain", &chain), ("proof ahead of ours", &ahead)] {
        let mut c = session(theirs, 4);
        let mut a = session(&chain, 2);
        let hello4 = hello_of(&c.connected("a", Some(key(2).public()), "sim".into(), NOW_MS));
        a.connected("c", Some(key(4).public()), "sim".into(), NOW_MS);
        let forged = relabelled(&hello4, ctx(3), &key(4));
        let out = a.on_hello("c", &wire_hello(&forged), NOW_MS);
        assert_eq!(
            rejected(&out, "c"),
            Some("context_mismatch"),
            "{name}: {out:?}"
        );
        assert_eq!(
            rejection(&out),
            Some(&Rejection::ContextMismatch {
                claimed: ctx(3),
                actual: ctx(4),
            }),
            "{name}"
        );
        assert!(disconnected(&out, "c"), "{name}: {out:?}");
        assert!(!verified(&out), "{name}");
        assert!(a.verified().next().is_none(), "{name}");
        assert!(
            !out.iter().any(|e| matches!(e, Effect::SendFrame { .. })),
            "{name}: no entries asked of or sent to it: {out:?}"
        );
        assert_eq!(a.log(), &chain, "{name}");

        // The genuine Hello, on a new connection: admitted at once, or (its
        // proof ahead of ours) the entries are asked for: the refusal above
        // was the relabelling's doing, on the path each case names.
        a.connected("c", Some(key(4).public()), "sim".into(), NOW_MS);
        let out = a.on_hello("c", &wire_hello(&hello4), NOW_MS);
        assert_eq!(rejection(&out), None, "{name}: {out:?}");
        let asked = out.iter().any(|e| {
            matches!(e, Effect::SendFrame { frame, .. }
                if matches!(**frame, Frame::DidEntriesRequest { .. }))
        });
        assert_eq!(verified(&out), !asked, "{name}: {out:?}");
        assert_eq!(asked, name == "proof ahead of ours", "{name}: {out:?}");
    }
}

/// What `s` holds of container "notes": its heads and the value of "x".
fn notes(s: &Session) -> (Vec<nuwa_state::Hash>, Option<Value>) {
    let c = s.engine().container("notes").expect("b holds notes");
    (c.heads(), c.get("x"))
}

/// `a` writes x = `n` in "notes"; the Delta carrying the change, sealed.
fn delta(a: &mut Session, n: u64, now_ms: u64) -> Envelope {
    let change = a
        .local_put("notes", "x", &json!(n))
        .unwrap()
        .expect("a change");
    let payload = SyncPayload::Delta {
        container: "notes".into(),
        changes: vec![change],
    };
    a.seal(&payload, now_ms).unwrap()
}

fn persisted(effects: &[Effect]) -> bool {
    effects
        .iter()
        .any(|e| matches!(e, Effect::Persist { .. } | Effect::PersistLog))
}

/// The label of the one `EnvelopeRejected` effect, checking it names `peer`.
fn envelope_rejected(effects: &[Effect], peer: &str) -> Option<&'static str> {
    let labels: Vec<&'static str> = effects
        .iter()
        .filter_map(|e| match e {
            Effect::EnvelopeRejected { peer: p, label, .. } if p == peer => Some(*label),
            _ => None,
        })
        .collect();
    assert!(labels.len() <= 1, "{effects:?}");
    labels.first().copied()
}

// Goal: from a verified peer, a Delta envelope with one ciphertext byte
// flipped, or one signature byte flipped, is refused as `EnvelopeRejected`
// with label `bad_signature` (the signature covers the ciphertext and is
// checked before decryption), and one properly signed by the peer but
// sealed under another sync key of the same epoch is refused as
// `decrypt_failed`. Nothing is persisted and the container's heads and
// value stay as they were. The code keeps the peer: no `Disconnect`, no
// `Rejected`, it stays verified. The refusals burn no nonce: the genuine
// envelope, delivered last, is applied.
#[test]
fn an_altered_envelope_from_a_verified_peer_is_refused_and_not_applied() {
    let chain = chain();
    let (mut a, mut b) = meet(&chain);
    // A first write reaches b, so there is state to keep unchanged.
    let first = delta(&mut a, 1, NOW_MS);
    let out = b.on_envelope("a", wire_envelope(&first), NOW_MS);
    assert!(persisted(&out), "{out:?}");
    let before = notes(&b);
    assert_eq!(before.1, Some(json!(1)));

    let env = delta(&mut a, 2, NOW_MS + 1);
    let other_key = {
        // A Delta, signed by device 2, under a key b lacks.
        let change = a.local_put("notes", "x", &json!(3)).unwrap().unwrap();
        let plaintext = SyncPayload::Delta {
            container: "notes".into(),
            changes: vec![change],
        }
        .encode();
        nuwa_crypto::seal(
            &SyncKey::from_bytes(0, [8; 32]),
            key(2).signing_key(),
            chain.did(),
            &ctx(2),
            NOW_MS + 2,
            &plaintext,
        )
        .unwrap()
    };
    type Edit = fn(&mut Envelope);
    let cases: [(&str, Edit, &str); 4] = [
        (
            "first ciphertext byte",
            |e| e.ciphertext[0] ^= 0x01,
            "bad_signature",
        ),
        (
            "last ciphertext byte (the tag)",
            |e| {
                let last = e.ciphertext.len() - 1;
                e.ciphertext[last] ^= 0x80;
            },
            "bad_signature",
        ),
        (
            "a signature byte",
            |e| e.signature[10] ^= 0x01,
            "bad_signature",
        ),
        ("another sync key", |_| {}, "decrypt_failed"),
    ];
    for (name, edit, label) in cases {
        let mut bad = if label == "decrypt_failed" {
            other_key.clone()
        } else {
            env.clone()
        };
        edit(&mut bad);
        let out = b.on_envelope("a", wire_envelope(&bad), NOW_MS + 5);
        assert_eq!(envelope_rejected(&out, "a"), Some(label), "{name}: {out:?}");
        assert!(!persisted(&out), "{name}: nothing persisted: {out:?}");
        assert_eq!(notes(&b), before, "{name}: the container is unchanged");
        // What the code does with the peer: keeps it.
        assert!(!disconnected(&out, "a"), "{name}: {out:?}");
        assert_eq!(rejection(&out), None, "{name}: {out:?}");
        assert!(is_verified(&b, "a"), "{name}: the peer stays verified");
    }

    let out = b.on_envelope("a", wire_envelope(&env), NOW_MS + 6);
    assert_eq!(envelope_rejected(&out, "a"), None, "{out:?}");
    assert!(persisted(&out), "{out:?}");
    assert_eq!(notes(&b).1, Some(json!(2)), "the genuine envelope applies");
}

// Goal: the author a gossip message claims is proved by the envelope, not
// by the gossip layer (which carries no signature of its own since issue
// 26: the envelope's Ed25519 signature is the one that counts). Method:
// device 4 seals a Delta; b gets it over gossip once claiming device 2
// ("a", verified, listed) as its author, then with its true author. The
// forged claim is refused (`wrong_sender`: the envelope names its sealer),
// and so is the envelope relabelled to name device 2 (`bad_signature`);
// nothing is persisted and the container is unchanged. The true claim is
// accepted and applied.
#[test]
fn a_gossip_message_is_refused_unless_its_claimed_author_sealed_it() {
    let chain = chain();
    let (_a, mut b) = meet(&chain);
    let mut c = session(&chain, 4);
    let env = delta(&mut c, 9, NOW_MS);
    let data = Frame::Envelope(env.clone()).encode();

    let (accept, out) = b.on_gossip("a", Some(key(2).public()), &data, NOW_MS + 1);
    assert!(!accept, "a forged author is not forwarded: {out:?}");
    assert_eq!(
        envelope_rejected(&out, "a"),
        Some("wrong_sender"),
        "{out:?}"
    );
    assert!(!persisted(&out), "{out:?}");
    let mut relabelled = env.clone();
    relabelled.sender = ctx(2);
    let forged = Frame::Envelope(relabelled).encode();
    let (accept, out) = b.on_gossip("a", Some(key(2).public()), &forged, NOW_MS + 1);
    assert!(!accept, "{out:?}");
    assert_eq!(
        envelope_rejected(&out, "a"),
        Some("bad_signature"),
        "{out:?}"
    );
    assert!(!persisted(&out), "{out:?}");
    assert!(b.engine().container("notes").is_none(), "nothing applied");

    let (accept, out) = b.on_gossip("c", Some(key(4).public()), &data, NOW_MS + 2);
    assert!(accept, "{out:?}");
    assert!(persisted(&out), "{out:?}");
    assert_eq!(
        notes(&b).1,
        Some(json!(9)),
        "the genuine author's change applies"
    );
}
