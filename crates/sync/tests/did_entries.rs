//! The DID entries exchange of protocol 2, between two real sessions.
//!
//! Goal: a device whose chain is behind a peer's (the peer's `Hello` proves
//! a head it does not hold) fetches the missing entries, merges them and
//! only then admits the peer; a forged, tampered, unasked-for, misnumbered
//! or unparsable page is refused and counted, and leaves the chain as it
//! was; a page that does not connect (a fork deeper than our head) makes
//! the device ask again from the start. Method: two `Session`s of one agent
//! (`a` one hundred updates ahead of `b`); frames go through
//! `Frame::encode`/`decode` as on the wire.

use nuwa_crypto::SyncKey;
use nuwa_crypto::epoch::KeyRing;
use nuwa_identity::chain::{DidChain, DidEntry};
use nuwa_identity::document::Relationship;
use nuwa_identity::keys::{DeviceKey, context_id_for};
use nuwa_proto::{Frame, Hello};
use nuwa_sync::{Config, Count, Effect, Engine, Membership, SecureChannel, Session, SessionConfig};

const T0_S: i64 = 1_900_000_000;
const NOW_MS: u64 = (T0_S as u64 + 1_000) * 1000;
const RELS: &[Relationship] = &[Relationship::Authentication];

fn key(n: u8) -> DeviceKey {
    DeviceKey::from_seed(&[n; 32])
}

fn add(chain: &mut DidChain, dev: &DeviceKey, t: i64) {
    let master_id = chain.documents().next().unwrap().capability_delegation[0].clone();
    let mut doc = chain.current().clone();
    doc.add_key(&context_id_for(&dev.public()), &dev.public(), RELS, None)
        .unwrap();
    chain.append_document(&doc, &key(1), &master_id, t).unwrap();
}

fn remove(chain: &mut DidChain, dev: &DeviceKey, t: i64) {
    let master_id = chain.documents().next().unwrap().capability_delegation[0].clone();
    let mut doc = chain.current().clone();
    doc.remove_key(&context_id_for(&dev.public())).unwrap();
    chain.append_document(&doc, &key(1), &master_id, t).unwrap();
}

/// `b`'s chain lists a (2) and b (3); `a`'s adds and removes device 9 fifty
/// times on top.
fn chains() -> (DidChain, DidChain) {
    let mut base = DidChain::genesis(&key(1), T0_S).unwrap();
    add(&mut base, &key(2), T0_S + 1);
    add(&mut base, &key(3), T0_S + 2);
    let mut ahead = base.clone();
    for i in 0..50 {
        add(&mut ahead, &key(9), T0_S + 3 + i);
        remove(&mut ahead, &key(9), T0_S + 3 + i);
    }
    (ahead, base)
}

fn session(chain: &DidChain, dev: u8) -> Session {
    let k = key(dev);
    let ctx = context_id_for(&k.public());
    let membership = Membership::new(chain.clone(), ctx.clone(), format!("d{dev}"), key(dev));
    let secure = SecureChannel::new(
        chain.did().to_owned(),
        ctx,
        KeyRing::new(SyncKey::from_bytes(0, [7; 32])),
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

fn frames(effects: &[Effect]) -> Vec<Frame> {
    effects
        .iter()
        .filter_map(|e| match e {
            // Frames travel encoded, as on the wire.
            Effect::SendFrame { frame, .. } => Some(Frame::decode(&frame.encode()).unwrap()),
            _ => None,
        })
        .collect()
}

fn rejected(effects: &[Effect]) -> Option<&'static str> {
    effects.iter().find_map(|e| match e {
        Effect::Rejected { rejection, .. } => Some(rejection.label()),
        _ => None,
    })
}

fn counted(effects: &[Effect], c: Count) -> bool {
    effects
        .iter()
        .any(|e| matches!(e, Effect::Count(x) if *x == c))
}

fn verified(effects: &[Effect]) -> bool {
    effects
        .iter()
        .any(|e| matches!(e, Effect::PeerVerified { .. }))
}

/// Connects `a` (device 2) and `b` (device 3) and hands a's Hello to b.
/// Returns both sessions and b's effects.
fn meet(ahead: &DidChain, behind: &DidChain) -> (Session, Session, Vec<Effect>) {
    let mut a = session(ahead, 2);
    let mut b = session(behind, 3);
    let to_b = a.connected("b", Some(key(3).public()), "sim".into(), NOW_MS);
    let to_a = b.connected("a", Some(key(2).public()), "sim".into(), NOW_MS);
    // a holds b's head (or fetches b's branch): either way it serves b.
    a.on_hello("b", &hello_of(&to_a), NOW_MS);
    let hello = hello_of(&to_b);
    let out = b.on_hello("a", &hello, NOW_MS);
    (a, b, out)
}

/// The entries request b sent, answered by a, as b receives it.
fn answer(a: &mut Session, out: &[Effect]) -> (u64, Vec<u8>, bool) {
    let [Frame::DidEntriesRequest { from_seq }] = frames(out)[..] else {
        panic!("expected one entries request, got {:?}", frames(out));
    };
    let served = a.on_did_request("b", from_seq);
    assert!(counted(&served, Count::DidEntriesServed));
    match frames(&served).pop() {
        Some(Frame::DidEntries {
            from_seq,
            entries_json,
            more,
        }) => (from_seq, entries_json, more),
        other => panic!("expected a page, got {other:?}"),
    }
}

#[test]
fn a_device_behind_fetches_the_entries_then_admits_the_peer() {
    let (ahead, behind) = chains();
    let (mut a, mut b, out) = meet(&ahead, &behind);
    assert!(!verified(&out), "not admitted before the entries are in");
    assert!(counted(&out, Count::DidEntriesRequested));
    let (from, page, more) = answer(&mut a, &out);
    assert_eq!(from, behind.len() as u64, "asked from b's head on");
    assert!(!more);
    let out = b.on_did_entries("a", from, &page, more, NOW_MS);
    assert!(counted(&out, Count::DidEntriesMerged), "{out:?}");
    assert!(out.iter().any(|e| matches!(e, Effect::PersistLog)));
    assert!(verified(&out), "admitted once merged: {out:?}");
    assert_eq!(b.log(), &ahead);
}

#[test]
fn hostile_pages_are_refused_counted_and_change_nothing() {
    let (ahead, behind) = chains();

    // Each hostile answer: what it does to the honest page, and the label.
    type Edit = fn(u64, Vec<u8>) -> (u64, Vec<u8>);
    let cases: [(&str, Edit, &str); 5] = [
        (
            "tampered signature",
            |f, page| {
                let mut entries: Vec<serde_json::Value> = serde_json::from_slice(&page).unwrap();
                let last = entries.len() - 1;
                entries[last]["timestamp"] = serde_json::json!(T0_S + 999);
                (f, serde_json::to_vec(&entries).unwrap())
            },
            "bad_did_log",
        ),
        (
            "an entry signed by a device without delegation",
            |f, page| {
                // Device 2 (authentication only) claims the first entry.
                let mut entries: Vec<DidEntry> = serde_json::from_slice(&page).unwrap();
                entries.truncate(1);
                let DidEntry::V2(mut e) = entries[0].clone() else {
                    panic!("v2")
                };
                e.key_id = e.key_id.replace(
                    e.key_id.rsplit('#').next().unwrap(),
                    &context_id_for(&key(2).public()),
                );
                (f, serde_json::to_vec(&[DidEntry::V2(e)]).unwrap())
            },
            "bad_did_log",
        ),
        ("not json", |f, _| (f, b"{not json".to_vec()), "did_entries"),
        (
            "a page from another seq",
            |f, page| (f + 1, page),
            "did_entries",
        ),
        ("an empty page", |f, _| (f, b"[]".to_vec()), "did_entries"),
    ];
    for (name, edit, label) in cases {
        let (mut a, mut b, out) = meet(&ahead, &behind);
        let (from, page, more) = answer(&mut a, &out);
        let (from, page) = edit(from, page);
        let out = b.on_did_entries("a", from, &page, more, NOW_MS);
        assert_eq!(rejected(&out), Some(label), "{name}: {out:?}");
        assert!(
            out.iter().any(|e| matches!(e, Effect::Disconnect { .. })),
            "{name}: the peer is dropped"
        );
        assert!(!verified(&out), "{name}");
        assert_eq!(b.log(), &behind, "{name}: b's chain is unchanged");
        assert!(b.verified().next().is_none(), "{name}");
    }

    // A page nobody asked for (or a replay after the merge) is not applied.
    let (mut a, mut b, out) = meet(&ahead, &behind);
    let (from, page, more) = answer(&mut a, &out);
    let first = b.on_did_entries("a", from, &page, more, NOW_MS);
    assert!(verified(&first));
    let again = b.on_did_entries("a", from, &page, more, NOW_MS);
    assert!(counted(&again, Count::FrameFromUnverifiedPeer), "{again:?}");
    assert!(!counted(&again, Count::DidEntriesMerged));
}

#[test]
fn a_deeper_fork_is_fetched_from_the_start_and_settled_by_the_rule() {
    let (ahead, behind) = chains();
    // b's own branch: one entry of its own after the shared prefix, so
    // a's first page (from b's head) does not connect.
    let mut forked = behind.clone();
    add(&mut forked, &key(8), T0_S + 500);
    let (mut a, mut b, out) = meet(&ahead, &forked);
    let (from, page, more) = answer(&mut a, &out);
    let out = b.on_did_entries("a", from, &page, more, NOW_MS);
    let asked: Vec<Frame> = frames(&out);
    assert_eq!(
        asked,
        vec![Frame::DidEntriesRequest { from_seq: 1 }],
        "asks again from the start"
    );
    let (from, page, more) = answer(&mut a, &out);
    let out = b.on_did_entries("a", from, &page, more, NOW_MS);
    assert!(counted(&out, Count::DidEntriesMerged), "{out:?}");
    // Whichever branch the rule picks, b judged a by it and a is listed in both.
    assert!(verified(&out), "{out:?}");
    let winner = match nuwa_identity::chain::compare_branches(&ahead, &forked).unwrap() {
        std::cmp::Ordering::Greater => &ahead,
        _ => &forked,
    };
    assert_eq!(b.log(), winner);
}

// Goal: a proof is public (every DHT pointer carries one), so replaying a
// genuine proof must not make a device fetch anything for a stranger; and a
// peer cannot make a device hold far more entries than its proof vouches
// for. Method: a key no document lists sends a Hello with the agent's
// newest proof; a listed device proves one head, then answers with a page
// 1,100 entries longer.
#[test]
fn strangers_and_overlong_answers_fetch_nothing() {
    let (ahead, behind) = chains();

    let mut stranger = session(&ahead, 7);
    let mut b = session(&behind, 3);
    let hello = hello_of(&stranger.connected("b", Some(key(3).public()), "sim".into(), NOW_MS));
    b.connected("x", Some(key(7).public()), "sim".into(), NOW_MS);
    let out = b.on_hello("x", &hello, NOW_MS);
    assert_eq!(rejected(&out), Some("unknown_key"), "{out:?}");
    assert!(frames(&out).is_empty(), "no request for a stranger");

    let mut longer = ahead.clone();
    for i in 0..550 {
        add(&mut longer, &key(9), T0_S + 600 + i);
        remove(&mut longer, &key(9), T0_S + 600 + i);
    }
    let (_, mut b, out) = meet(&ahead, &behind);
    let mut liar = session(&longer, 2);
    liar.connected("b", Some(key(3).public()), "sim".into(), NOW_MS);
    let to_liar = session(&behind, 3).connected("a", Some(key(2).public()), "sim".into(), NOW_MS);
    liar.on_hello("b", &hello_of(&to_liar), NOW_MS);
    let (from, page, more) = answer(&mut liar, &out);
    let out = b.on_did_entries("a", from, &page, more, NOW_MS);
    assert_eq!(rejected(&out), Some("did_entries"), "{out:?}");
    assert_eq!(b.log(), &behind);
}

// Goal: a connected stranger cannot make a device send pages of its chain
// (a few bytes asked, up to 1 MiB answered). Method: ask before any Hello.
#[test]
fn entries_are_served_only_to_devices() {
    let (ahead, _) = chains();
    let mut a = session(&ahead, 2);
    a.connected("x", Some(key(7).public()), "sim".into(), NOW_MS);
    let out = a.on_did_request("x", 1);
    assert!(frames(&out).is_empty(), "{out:?}");
    assert!(counted(&out, Count::FrameFromUnverifiedPeer));
}

// Goal: a revoked device, which no peer admits any more, still learns its
// revocation: the peer that refuses it sends the entries past its head
// before hanging up; a stranger replaying the same public proof gets
// nothing. Method: a (device 2) holds a chain that removed device 3; r
// (device 3) and a stranger (key 7) come with the older chain's proof.
#[test]
fn a_revoked_device_is_told_why_and_a_stranger_is_not() {
    let (_, base) = chains();
    let mut revoked = base.clone();
    remove(&mut revoked, &key(3), T0_S + 700);

    let mut a = session(&revoked, 2);
    let mut r = session(&base, 3);
    let to_r = a.connected("r", Some(key(3).public()), "sim".into(), NOW_MS);
    let to_a = r.connected("a", Some(key(2).public()), "sim".into(), NOW_MS);
    let asked = r.on_hello("a", &hello_of(&to_r), NOW_MS);
    assert_eq!(
        frames(&asked),
        vec![Frame::DidEntriesRequest {
            from_seq: base.len() as u64
        }]
    );
    let refused = a.on_hello("r", &hello_of(&to_a), NOW_MS);
    assert_eq!(rejected(&refused), Some("unknown_key"), "{refused:?}");
    let Some(Frame::DidEntries {
        from_seq,
        entries_json,
        more,
    }) = frames(&refused).pop()
    else {
        panic!("the refused device gets the entries: {refused:?}");
    };
    let out = r.on_did_entries("a", from_seq, &entries_json, more, NOW_MS);
    assert!(counted(&out, Count::DidEntriesMerged), "{out:?}");
    assert_eq!(r.log(), &revoked);
    assert!(r.self_authorised(NOW_MS).is_err(), "r knows it was revoked");

    // The page may arrive after r dropped the connection (no fetch under
    // way): it still continues r's chain at its head, so it is taken; the
    // same page again (no longer at r's head) is not.
    let mut r = session(&base, 3);
    let out = r.on_did_entries("a", from_seq, &entries_json, more, NOW_MS);
    assert!(counted(&out, Count::DidEntriesMerged), "{out:?}");
    assert!(r.self_authorised(NOW_MS).is_err());
    let out = r.on_did_entries("a", from_seq, &entries_json, more, NOW_MS + 5_000);
    assert!(!counted(&out, Count::DidEntriesMerged));
    // A forged unasked-for page is refused and changes nothing; a second
    // one within the second is not even looked at.
    let mut r = session(&base, 3);
    let mut forged: Vec<serde_json::Value> = serde_json::from_slice(&entries_json).unwrap();
    forged[0]["timestamp"] = serde_json::json!(T0_S + 701);
    let forged = serde_json::to_vec(&forged).unwrap();
    let out = r.on_did_entries("a", from_seq, &forged, more, NOW_MS);
    assert_eq!(rejected(&out), Some("bad_did_log"), "{out:?}");
    let out = r.on_did_entries("a", from_seq, &entries_json, more, NOW_MS + 10);
    assert!(
        counted(&out, Count::FrameFromUnverifiedPeer) && !counted(&out, Count::DidEntriesMerged)
    );
    assert_eq!(r.log(), &base);

    // The same old proof from a key it never listed: nothing is sent.
    let mut stranger = session(&base, 7);
    let hello = hello_of(&stranger.connected("a", Some(key(2).public()), "sim".into(), NOW_MS));
    a.connected("x", Some(key(7).public()), "sim".into(), NOW_MS);
    let out = a.on_hello("x", &hello, NOW_MS);
    assert_eq!(rejected(&out), Some("unknown_key"));
    assert!(frames(&out).is_empty(), "{out:?}");
}

// Goal: a device revoked while connected learns it at once, not at its
// next redial: the peer that revoked it sends the entries past the head
// they shared, and hangs up only after the page had time to arrive
// (finding 8 of issue 24: a phone went on acknowledging writes for 3 s).
// Method: a (device 2) and b (device 3) verified on one chain; a adopts
// its own update removing b.
#[test]
fn a_peer_revoked_while_connected_is_told_before_the_hang_up() {
    let (_, base) = chains();
    let (mut a, mut b, out) = meet(&base, &base);
    assert!(verified(&out), "{out:?}");
    let mut revoked = base.clone();
    remove(&mut revoked, &key(3), T0_S + 700);

    let out = a.adopt_own_update(revoked.clone(), None, NOW_MS).unwrap();
    assert_eq!(rejected(&out), Some("unknown_key"), "{out:?}");
    assert!(
        !out.iter().any(|e| matches!(e, Effect::Disconnect { .. })),
        "hung up before the page: {out:?}"
    );
    let Some(Frame::DidEntries {
        from_seq,
        entries_json,
        more,
    }) = frames(&out).pop()
    else {
        panic!("the revoked peer gets the entries: {out:?}");
    };
    assert_eq!(from_seq, base.len() as u64);
    let got = b.on_did_entries("a", from_seq, &entries_json, more, NOW_MS + 5);
    assert!(counted(&got, Count::DidEntriesMerged), "{got:?}");
    assert_eq!(b.log(), &revoked);
    assert!(
        b.self_authorised(NOW_MS + 5).is_err(),
        "b knows it was revoked"
    );

    // a hangs up once the page had time to arrive.
    let early = a.tick(NOW_MS + 10);
    assert!(!early.iter().any(|e| matches!(e, Effect::Disconnect { .. })));
    let late = a.tick(NOW_MS + nuwa_sync::session::CLOSE_AFTER_ENTRIES_MS + 1);
    assert!(
        late.iter()
            .any(|e| matches!(e, Effect::Disconnect { peer } if peer == "b")),
        "{late:?}"
    );
}

// Goal: a chain longer than one page (1 MiB) arrives in several pages,
// each asked from where the last ended, and is merged once complete.
// Method: a is 1,500 entries ahead; answer every request until b admits a.
#[test]
fn a_long_chain_comes_in_pages() {
    let (_, behind) = chains();
    let mut ahead = behind.clone();
    for i in 0..750 {
        add(&mut ahead, &key(9), T0_S + 3 + i);
        remove(&mut ahead, &key(9), T0_S + 3 + i);
    }
    let (mut a, mut b, mut out) = meet(&ahead, &behind);
    let mut pages = 0;
    while !verified(&out) {
        let (from, page, more) = answer(&mut a, &out);
        assert!(
            page.len() <= nuwa_sync::session::DID_ENTRIES_PAGE_BYTES,
            "{}",
            page.len()
        );
        pages += 1;
        assert!(pages < 10, "too many pages");
        out = b.on_did_entries("a", from, &page, more, NOW_MS);
        assert_eq!(rejected(&out), None, "{out:?}");
    }
    assert!(pages >= 2, "{pages} page(s)");
    assert_eq!(b.log(), &ahead);
}

/// `hello` as device `dev` would sign it with `evidence` and a fresh nonce.
fn with_evidence(hello: &Hello, dev: u8, evidence: Vec<u8>, nonce: u8) -> Hello {
    let mut h = hello.clone();
    h.removal_evidence = evidence;
    h.nonce = [nonce; 16];
    let digest = nuwa_identity::nip2::signing_hash(Hello::DOMAIN, &h.signing_content());
    h.signature = key(dev).sign(&digest);
    h
}

// Goal: the removal evidence a Hello carries (strong removal) is taken
// only when its entries verify, from a listed sender, and never breaks the
// connection. Method: device 4 sends device 2 Hellos whose evidence is
// malformed JSON, a branch that does not connect, a forged entry, then a
// genuine branch removing device 3; and an oversized field on the wire.
#[test]
fn hostile_removal_evidence_changes_nothing_and_genuine_evidence_removes() {
    let (_, mut base) = chains();
    add(&mut base, &key(4), T0_S + 3);
    let mut removes = base.clone();
    remove(&mut removes, &key(3), T0_S + 4);
    let mut adds = base.clone();
    add(&mut adds, &key(5), T0_S + 4);
    // Whichever branch the fork rule picks, the receiver is on the other
    // one, unless `adds` wins: then the evidence is a losing branch.
    let mut rx = session(&adds, 2);
    let mut tx = session(&adds, 4);
    let to_rx = tx.connected("rx", Some(key(2).public()), "sim".into(), NOW_MS);
    rx.connected("tx", Some(key(4).public()), "sim".into(), NOW_MS);
    let hello = hello_of(&to_rx);
    let head = rx.membership().log().head_hash().to_owned();
    let listed = |s: &Session| {
        s.membership()
            .document()
            .find_method(&context_id_for(&key(3).public()))
            .is_some()
    };

    let out = rx.on_hello(
        "tx",
        &with_evidence(&hello, 4, b"not json".to_vec(), 1),
        NOW_MS,
    );
    assert!(verified(&out), "bad evidence does not cost the connection");
    assert!(counted(&out, Count::RemovalEvidenceRefused));
    let mut stranger = DidChain::genesis(&key(8), T0_S).unwrap();
    let mid = stranger.current().capability_delegation[0].clone();
    let mut doc = stranger.current().clone();
    doc.add_key(
        &context_id_for(&key(3).public()),
        &key(3).public(),
        RELS,
        None,
    )
    .unwrap();
    stranger
        .append_document(&doc, &key(8), &mid, T0_S + 1)
        .unwrap();
    let json = serde_json::to_vec(&vec![stranger.entries()[1..].to_vec()]).unwrap();
    let out = rx.on_hello("tx", &with_evidence(&hello, 4, json, 2), NOW_MS);
    assert!(
        counted(&out, Count::RemovalEvidenceRefused),
        "another chain's entries do not connect"
    );
    let mut forged: Vec<DidEntry> = removes.entries()[base.len()..].to_vec();
    if let DidEntry::V2(e) = &mut forged[0] {
        e.timestamp += 1;
    }
    let json = serde_json::to_vec(&vec![forged]).unwrap();
    let out = rx.on_hello("tx", &with_evidence(&hello, 4, json, 3), NOW_MS);
    assert!(!counted(&out, Count::RemovalEvidenceMerged));
    assert_eq!(rx.membership().log().head_hash(), head, "nothing changed");
    assert!(listed(&rx), "a forged removal removes nothing");

    let json = serde_json::to_vec(&vec![removes.entries()[base.len()..].to_vec()]).unwrap();
    let out = rx.on_hello("tx", &with_evidence(&hello, 4, json, 4), NOW_MS);
    assert!(counted(&out, Count::RemovalEvidenceMerged));
    assert!(!listed(&rx), "device 3 is out, whichever branch won");

    // On the wire: more than 64 KiB of evidence is refused at decode.
    let big = with_evidence(
        &hello,
        4,
        vec![b' '; nuwa_proto::MAX_REMOVAL_EVIDENCE_BYTES + 1],
        5,
    );
    assert!(Frame::decode(&Frame::Hello(big).encode()).is_err());
}

// Goal: what a peer sends while its Hello is still being checked here (the
// device behind fetches DID entries first) is kept and opened once the
// Hello verifies, so the device behind is in sync at once, not at the
// peer's next periodic digest (issue 26: the bench's idle daemons and a
// cold sync waited 5 s here). A stranger's envelopes are never opened, and
// a disconnect drops what was kept. Method: a (ahead) admits b and seals
// its digest; b receives it before merging the entries.
#[test]
fn a_digest_sent_before_the_hello_verified_is_taken_after() {
    let (ahead, behind) = chains();
    let mut a = session(&ahead, 2);
    let mut b = session(&behind, 3);
    let to_b = a.connected("b", Some(key(3).public()), "sim".into(), NOW_MS);
    let to_a = b.connected("a", Some(key(2).public()), "sim".into(), NOW_MS);
    let at_a = a.on_hello("b", &hello_of(&to_a), NOW_MS);
    assert!(verified(&at_a), "a admits b at once");
    let digest = at_a
        .iter()
        .find_map(|e| match e {
            Effect::Send { peer, payload } if peer == "b" => Some(payload.clone()),
            _ => None,
        })
        .expect("a sends its digest to b");
    let env = a.seal(&digest, NOW_MS).unwrap();
    let out = b.on_hello("a", &hello_of(&to_b), NOW_MS);
    assert!(!verified(&out), "b fetches entries first");
    let kept = b.on_envelope("a", env.clone(), NOW_MS);
    assert!(counted(&kept, Count::EnvelopesHeldForHello), "{kept:?}");
    let (from, page, more) = answer(&mut a, &out);
    let merged = b.on_did_entries("a", from, &page, more, NOW_MS + 5);
    assert!(verified(&merged));
    assert!(b.in_sync_with("a"), "the kept digest was taken: {merged:?}");

    // A big envelope from a pending peer is not kept (anyone who connects
    // is pending until its Hello: the hold is bounded in bytes).
    let mut d = session(&behind, 3);
    let _ = d.connected("a", Some(key(2).public()), "sim".into(), NOW_MS);
    let mut big = env.clone();
    big.ciphertext = vec![0; 64 * 1024];
    let refused = d.on_envelope("a", big, NOW_MS);
    assert!(
        counted(&refused, Count::FrameFromUnverifiedPeer),
        "{refused:?}"
    );
    assert!(!counted(&refused, Count::EnvelopesHeldForHello));

    // Many pending peers at once: at most 4 kept per peer and 64 in all,
    // the oldest dropped (and counted) first.
    let mut e = session(&behind, 3);
    let (mut kept, mut dropped, mut refused) = (0, 0, 0);
    for p in 0..20 {
        let name = format!("p{p}");
        let _ = e.connected(&name, Some(key(2).public()), "sim".into(), NOW_MS);
        for _ in 0..5 {
            let out = e.on_envelope(&name, env.clone(), NOW_MS);
            kept += usize::from(counted(&out, Count::EnvelopesHeldForHello));
            dropped += usize::from(counted(&out, Count::HeldEnvelopesDropped));
            refused += usize::from(counted(&out, Count::FrameFromUnverifiedPeer));
        }
    }
    assert_eq!((kept, refused), (80, 20), "4 per peer");
    assert_eq!(kept - dropped, 64, "64 in all");

    // A stranger (never sent a Hello) is not kept; a disconnect drops what
    // was kept for a pending peer.
    let mut c = session(&behind, 3);
    let stranger = c.on_envelope("x", env.clone(), NOW_MS);
    assert!(counted(&stranger, Count::FrameFromUnverifiedPeer));
    let to_a = c.connected("a", Some(key(2).public()), "sim".into(), NOW_MS);
    let _ = to_a;
    let kept = c.on_envelope("a", env, NOW_MS);
    assert!(counted(&kept, Count::EnvelopesHeldForHello));
    c.disconnected("a");
    let _ = c.connected("a", Some(key(2).public()), "sim".into(), NOW_MS);
    let out = c.on_hello("a", &hello_of(&to_b), NOW_MS);
    let (from, page, more) = answer(&mut a, &out);
    let merged = c.on_did_entries("a", from, &page, more, NOW_MS + 5);
    assert!(verified(&merged));
    assert!(
        !c.in_sync_with("a"),
        "what came before the disconnect was dropped"
    );
}
