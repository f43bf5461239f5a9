//! Tests of the DID log: NIP-1 test cases 1, 2, 6, 7 and 8 at log level,
//! the change-permission table, tampering, forks and size bounds.

use super::*;
use crate::document::{DidDocument, DidError, EXPIRY_GRACE_SECS, Relationship};
use crate::keys::{DeviceKey, context_id_for};

const T0: i64 = 1_750_000_000;

fn key(n: u8) -> DeviceKey {
    DeviceKey::from_seed(&[n; 32])
}

fn master_id(log: &DidLog, master: &DeviceKey) -> String {
    log.current()
        .key_id(&ed25519_public_multibase(&master.public()))
}

/// A log with the master key and a phone (authentication only).
fn agent_with_phone() -> (DeviceKey, DeviceKey, DidLog) {
    let master = key(1);
    let phone = key(2);
    let mut log = DidLog::genesis(&master, T0).expect("genesis");
    let mut doc = log.current().clone();
    doc.add_key(
        &context_id_for(&phone.public()),
        &phone.public(),
        &[Relationship::Authentication],
        None,
    )
    .expect("add phone");
    let mid = master_id(&log, &master);
    log.append(doc, &master, &mid, T0 + 1)
        .expect("master adds phone");
    (master, phone, log)
}

/// Chains an update onto `log` without any check (what an attacker can do), returning the new log.
fn forge(
    log: &DidLog,
    doc: DidDocument,
    signer: &DeviceKey,
    key_id: &str,
    timestamp: i64,
) -> DidLog {
    let (last, last_hash) = log.head();
    let update = DidUpdate::sign(
        last.seq + 1,
        last_hash.to_owned(),
        doc,
        timestamp,
        signer,
        key_id.to_owned(),
    )
    .expect("signing works");
    let mut updates = log.updates().to_vec();
    updates.push(update);
    DidLog::from_updates(updates).expect("shape is fine")
}

/// Rebuilds a log from edited JSON, as a peer could send it.
fn edit_json(log: &DidLog, edit: impl FnOnce(&mut serde_json::Value)) -> DidLog {
    let mut json = serde_json::to_value(log).expect("serializable");
    edit(&mut json);
    serde_json::from_value(json).expect("still a well-shaped log")
}

// Goal: NIP-1 test case 1: the genesis certifies the did:key agent and the master registers
// the first operational key; the log verifies and the new key authenticates.
#[test]
fn tc1_genesis_and_first_operational_key() {
    let (master, phone, log) = agent_with_phone();
    assert_eq!(log.did(), did_key_from_ed25519(&master.public()));
    assert_eq!(log.len(), 2);
    assert_eq!(
        log.updates()[0].document,
        genesis_document(log.did()).expect("did:key")
    );
    log.verify(Some(log.did()), T0 + 2).expect("valid log");
    let phone_id = log.current().key_id(&context_id_for(&phone.public()));
    assert_eq!(
        log.current()
            .key_for(&phone_id, Relationship::Authentication, T0 + 2)
            .expect("phone authenticates"),
        phone.public()
    );
    // Another agent's DID is refused.
    assert!(matches!(
        log.verify(Some(&did_key_from_ed25519(&key(9).public())), T0 + 2),
        Err(LogError::WrongDid { .. })
    ));
}

// Goal: NIP-1 test case 2: a key the master delegated to can register a further key.
#[test]
fn tc2_delegated_key_registers_another() {
    let (master, _phone, mut log) = agent_with_phone();
    let laptop = key(3);
    let tablet = key(4);
    let mut doc = log.current().clone();
    doc.add_key(
        "laptop",
        &laptop.public(),
        &[
            Relationship::Authentication,
            Relationship::CapabilityDelegation,
        ],
        None,
    )
    .expect("add laptop");
    let mid = master_id(&log, &master);
    log.append(doc, &master, &mid, T0 + 2)
        .expect("master adds laptop");

    let mut doc = log.current().clone();
    doc.add_key(
        "tablet",
        &tablet.public(),
        &[Relationship::Authentication],
        None,
    )
    .expect("add tablet");
    log.append(doc, &laptop, "laptop", T0 + 3)
        .expect("laptop holds capabilityDelegation");
    log.verify(None, T0 + 3).expect("valid");
    assert!(log.current().find_method("tablet").is_some());
    assert_eq!(log.updates()[3].key_id, log.current().key_id("laptop"));
}

// Goal: NIP-1 test case 6: after the master removes a key through the log, lookups of it fail.
#[test]
fn tc6_revocation_through_log() {
    let (master, phone, mut log) = agent_with_phone();
    let frag = context_id_for(&phone.public());
    let mut doc = log.current().clone();
    doc.remove_key(&frag).expect("listed");
    let mid = master_id(&log, &master);
    log.append(doc, &master, &mid, T0 + 5)
        .expect("master revokes phone");
    log.verify(None, T0 + 5).expect("valid");
    assert!(matches!(
        log.current()
            .key_for(&frag, Relationship::Authentication, T0 + 5),
        Err(DidError::KeyNotFound { .. })
    ));
    assert!(matches!(
        log.current()
            .method_for_public(&phone.public(), Relationship::Authentication, T0 + 5),
        Err(DidError::KeyNotFound { .. })
    ));
    // The revoked key cannot sign updates any more either.
    let mut doc = log.current().clone();
    doc.add_key(
        "evil",
        &key(7).public(),
        &[Relationship::CapabilityDelegation],
        None,
    )
    .expect("add");
    let phone_id = log.current().key_id(&frag);
    assert!(matches!(
        forge(&log, doc, &phone, &phone_id, T0 + 6).verify(None, T0 + 6),
        Err(LogError::Unauthorized {
            source: DidError::KeyNotFound { .. },
            ..
        })
    ));
}

// Goal: NIP-1 test case 7: an update adding a key signed by a key without capabilityDelegation
// is refused, whether built locally (append) or received (forged log).
#[test]
fn tc7_registration_without_delegation_is_refused() {
    let (_master, phone, mut log) = agent_with_phone();
    let frag = context_id_for(&phone.public());
    let mut doc = log.current().clone();
    doc.add_key(
        "intruder",
        &key(7).public(),
        &[Relationship::Authentication],
        None,
    )
    .expect("add");
    let before = log.clone();
    let err = log
        .append(doc.clone(), &phone, &frag, T0 + 2)
        .expect_err("phone lacks capabilityDelegation");
    assert!(
        matches!(
            err,
            LogError::Unauthorized {
                source: DidError::PermissionDenied {
                    rel: Relationship::CapabilityDelegation,
                    ..
                },
                ..
            }
        ),
        "got {err}"
    );
    assert_eq!(log, before, "failed append leaves the log unchanged");

    let phone_id = log.current().key_id(&frag);
    let forged = forge(&log, doc.clone(), &phone, &phone_id, T0 + 2);
    assert!(matches!(
        forged.verify(None, T0 + 2),
        Err(LogError::Unauthorized {
            source: DidError::PermissionDenied { .. },
            ..
        })
    ));
    // A stranger's key, not listed at all.
    let stranger = key(8);
    let forged = forge(
        &log,
        doc,
        &stranger,
        &log.current().key_id("stranger"),
        T0 + 2,
    );
    assert!(matches!(
        forged.verify(None, T0 + 2),
        Err(LogError::Unauthorized {
            source: DidError::KeyNotFound { .. },
            ..
        })
    ));
    // And merging such a log is refused without touching ours.
    let mut mine = log.clone();
    assert!(mine.merge_from(&forged, T0 + 2).is_err());
    assert_eq!(mine, log);
}

// Goal: NIP-1 test case 8 at log level: an expiring delegate can sign within its lifetime
// plus grace, not after; and the log stays valid after the delegate has expired.
#[test]
fn tc8_expiring_delegate() {
    let (master, _phone, mut log) = agent_with_phone();
    let delegate = key(5);
    let mut doc = log.current().clone();
    // Expires at T0 + 100 (2025-06-15T15:08:20Z).
    doc.add_key(
        "delegate",
        &delegate.public(),
        &[Relationship::CapabilityDelegation],
        Some("2025-06-15T15:08:20Z".to_owned()),
    )
    .expect("add");
    let mid = master_id(&log, &master);
    log.append(doc, &master, &mid, T0 + 2)
        .expect("add delegate");

    let add = |log: &DidLog, frag: &str, n: u8| {
        let mut doc = log.current().clone();
        doc.add_key(frag, &key(n).public(), &[], None).expect("add");
        doc
    };
    // Inside the grace period.
    let mut ok = log.clone();
    ok.append(
        add(&log, "k1", 11),
        &delegate,
        "delegate",
        T0 + 100 + EXPIRY_GRACE_SECS,
    )
    .expect("within grace");
    // After the grace period.
    let mut late = log.clone();
    assert!(matches!(
        late.append(
            add(&log, "k2", 12),
            &delegate,
            "delegate",
            T0 + 101 + EXPIRY_GRACE_SECS
        ),
        Err(LogError::Unauthorized {
            source: DidError::Expired { .. },
            ..
        })
    ));
    // The accepted update stays valid long after the delegate expired.
    ok.verify(None, T0 + 1_000_000)
        .expect("history stays valid");
}

// Goal: each kind of change requires the NIP-1 relationship of the table in the module docs;
// table rows: (what changes, signer's relationships, accepted?).
#[test]
fn change_permission_table() {
    type Mutate = fn(&mut DidDocument);
    let add_key: Mutate = |d| {
        d.add_key("new", &key(20).public(), &[], None).expect("add");
    };
    let add_service: Mutate = |d| {
        let id = format!("{}#svc", d.id);
        d.service
            .push(serde_json::json!({"id": id, "type": "NuwaSync", "serviceEndpoint": "p2p"}));
    };
    let both: Mutate = |d| {
        let id = format!("{}#svc", d.id);
        d.service
            .push(serde_json::json!({"id": id, "type": "NuwaSync", "serviceEndpoint": "p2p"}));
        d.add_key("new", &key(20).public(), &[], None).expect("add");
    };
    let grant_auth: Mutate = |d| {
        d.grant("signer", Relationship::AssertionMethod)
            .expect("listed");
    };
    let controller: Mutate = |d| d.controller = Some("did:example:new-controller".to_owned());
    let add_x25519: Mutate = |d| {
        d.add_key_agreement_key("x", &[9; 32], None).expect("add");
    };

    use Relationship::*;
    let cases: Vec<(&str, Mutate, Vec<Relationship>, bool)> = vec![
        (
            "key by delegation",
            add_key,
            vec![CapabilityDelegation],
            true,
        ),
        (
            "key by invocation",
            add_key,
            vec![CapabilityInvocation],
            false,
        ),
        (
            "key by authentication",
            add_key,
            vec![Authentication],
            false,
        ),
        (
            "relationship by delegation",
            grant_auth,
            vec![CapabilityDelegation],
            true,
        ),
        (
            "relationship by invocation",
            grant_auth,
            vec![CapabilityInvocation],
            false,
        ),
        (
            "x25519 key by delegation",
            add_x25519,
            vec![CapabilityDelegation],
            true,
        ),
        (
            "service by invocation",
            add_service,
            vec![CapabilityInvocation],
            true,
        ),
        (
            "service by delegation only",
            add_service,
            vec![CapabilityDelegation],
            false,
        ),
        (
            "service by authentication",
            add_service,
            vec![Authentication],
            false,
        ),
        (
            "service+key by invocation",
            both,
            vec![CapabilityInvocation],
            false,
        ),
        (
            "service+key by both",
            both,
            vec![CapabilityInvocation, CapabilityDelegation],
            true,
        ),
        (
            "controller by delegation only",
            controller,
            vec![CapabilityDelegation],
            false,
        ),
        (
            "controller by authentication only",
            controller,
            vec![Authentication],
            false,
        ),
        (
            "controller by auth+delegation",
            controller,
            vec![Authentication, CapabilityDelegation],
            true,
        ),
    ];
    for (name, mutate, rels, accepted) in cases {
        let master = key(1);
        let signer = key(2);
        let mut log = DidLog::genesis(&master, T0).expect("genesis");
        let mut doc = log.current().clone();
        doc.add_key("signer", &signer.public(), &rels, None)
            .expect("add signer");
        let mid = master_id(&log, &master);
        log.append(doc, &master, &mid, T0).expect("setup");

        let mut doc = log.current().clone();
        mutate(&mut doc);
        let result = log.append(doc, &signer, "signer", T0 + 1);
        assert_eq!(result.is_ok(), accepted, "{name}: {result:?}");
        if !accepted {
            assert!(
                matches!(
                    result,
                    Err(LogError::Unauthorized {
                        source: DidError::PermissionDenied { .. },
                        ..
                    })
                ),
                "{name}: {result:?}"
            );
        }
        log.verify(None, T0 + 1).expect("log stays valid");
    }
}

// Goal: structural rules on updates: no-op, lockout, id change, invalid document, future and
// regressing timestamps, wrong signing key; table of (update maker, expected error).
#[test]
fn update_rules_table() {
    let (master, phone, log) = agent_with_phone();
    let mid = master_id(&log, &master);
    type Check = fn(&LogError) -> bool;
    type Make = Box<dyn Fn(&DidLog) -> DidLog>;
    let mk = |f: fn(&mut DidDocument), ts: i64, signer: u8| -> Make {
        let mid = mid.clone();
        Box::new(move |log: &DidLog| {
            let mut doc = log.current().clone();
            f(&mut doc);
            forge(log, doc, &key(signer), &mid, ts)
        })
    };
    let cases: Vec<(&str, Make, Check)> = vec![
        ("no change", mk(|_| {}, T0 + 2, 1), |e| {
            matches!(e, LogError::EmptyUpdate { .. })
        }),
        (
            "no delegation left",
            mk(|d| d.capability_delegation.clear(), T0 + 2, 1),
            |e| matches!(e, LogError::NoDelegationKey { .. }),
        ),
        (
            "id changed",
            mk(|d| d.id = "did:example:other".into(), T0 + 2, 1),
            |e| matches!(e, LogError::DidChanged { .. }),
        ),
        (
            "dangling reference",
            mk(
                |d| {
                    let ghost = format!("{}#ghost", d.id);
                    d.authentication.push(ghost);
                },
                T0 + 2,
                1,
            ),
            |e| {
                matches!(
                    e,
                    LogError::InvalidDocument {
                        source: DidError::DanglingReference { .. },
                        ..
                    }
                )
            },
        ),
        (
            "timestamp regression",
            mk(
                |d| d.add_key("k", &key(30).public(), &[], None).expect("add"),
                T0,
                1,
            ),
            |e| matches!(e, LogError::TimestampRegression { .. }),
        ),
        (
            "from the future",
            mk(
                |d| d.add_key("k", &key(30).public(), &[], None).expect("add"),
                T0 + 10_000,
                1,
            ),
            |e| matches!(e, LogError::FromFuture { .. }),
        ),
        (
            "signed by the wrong key",
            mk(
                |d| d.add_key("k", &key(30).public(), &[], None).expect("add"),
                T0 + 2,
                9,
            ),
            |e| matches!(e, LogError::BadSignature { .. }),
        ),
    ];
    for (name, make, check) in cases {
        let bad = make(&log);
        match bad.verify(None, T0 + 2) {
            Err(e) => assert!(check(&e), "{name}: unexpected {e}"),
            Ok(()) => panic!("{name}: accepted"),
        }
    }

    // append refuses a key that does not match the named key id, before signing anything.
    let mut doc = log.current().clone();
    doc.add_key("k", &key(30).public(), &[], None).expect("add");
    let mut copy = log.clone();
    assert!(matches!(
        copy.append(doc, &phone, &mid, T0 + 2),
        Err(LogError::WrongSigningKey { .. })
    ));
}

// Goal: any edit to a received log is detected: document, prev, seq, signature, nonce, key id
// and genesis edits; one JSON edit per row.
#[test]
fn tampered_logs_are_rejected() {
    let (master, _phone, mut log) = agent_with_phone();
    let mut doc = log.current().clone();
    doc.add_key(
        "laptop",
        &key(3).public(),
        &[Relationship::Authentication],
        None,
    )
    .expect("add");
    let mid = master_id(&log, &master);
    log.append(doc, &master, &mid, T0 + 2)
        .expect("third update");
    log.verify(None, T0 + 3).expect("valid before tampering");

    type Edit = fn(&mut serde_json::Value);
    type Check = fn(&LogError) -> bool;
    let cases: Vec<(&str, Edit, Check)> = vec![
        (
            "document of update 1 changed",
            |j| j["updates"][1]["document"]["authentication"] = serde_json::json!([]),
            |e| matches!(e, LogError::BadSignature { seq: 1, .. }),
        ),
        (
            "prev of update 2 broken",
            |j| j["updates"][2]["prev"] = serde_json::json!("00".repeat(32)),
            |e| matches!(e, LogError::BadPrev { seq: 2 }),
        ),
        (
            "seq of update 2 changed",
            |j| j["updates"][2]["seq"] = serde_json::json!(5),
            |e| matches!(e, LogError::BadSeq { seq: 5, .. }),
        ),
        (
            "updates reordered",
            |j| {
                let updates = j["updates"].as_array_mut().expect("array");
                updates.swap(1, 2);
            },
            |e| matches!(e, LogError::BadSeq { .. }),
        ),
        (
            "update 1 dropped",
            |j| {
                j["updates"].as_array_mut().expect("array").remove(1);
            },
            |e| matches!(e, LogError::BadSeq { .. }),
        ),
        (
            "timestamp of update 1 changed",
            |j| j["updates"][1]["timestamp"] = serde_json::json!(T0 + 100),
            |e| matches!(e, LogError::BadSignature { seq: 1, .. }),
        ),
        (
            "nonce of update 1 changed",
            |j| j["updates"][1]["nonce"] = serde_json::json!("ab".repeat(16)),
            |e| matches!(e, LogError::BadSignature { seq: 1, .. }),
        ),
        (
            "nonce not hex",
            |j| j["updates"][1]["nonce"] = serde_json::json!("zz".repeat(16)),
            |e| matches!(e, LogError::MalformedUpdate { seq: 1, .. }),
        ),
        (
            "signature flipped",
            |j| {
                let sig = j["updates"][2]["signature"]
                    .as_str()
                    .expect("string")
                    .to_owned();
                let flipped = if sig.starts_with('A') { "B" } else { "A" };
                j["updates"][2]["signature"] = serde_json::json!(format!("{flipped}{}", &sig[1..]));
            },
            |e| matches!(e, LogError::BadSignature { seq: 2, .. }),
        ),
        (
            "signature not base64",
            |j| j["updates"][2]["signature"] = serde_json::json!("!".repeat(86)),
            |e| matches!(e, LogError::MalformedUpdate { seq: 2, .. }),
        ),
        (
            "key id relative",
            |j| {
                let id = j["updates"][2]["key_id"]
                    .as_str()
                    .expect("string")
                    .to_owned();
                j["updates"][2]["key_id"] =
                    serde_json::json!(format!("#{}", DidDocument::fragment(&id)));
            },
            |e| matches!(e, LogError::MalformedUpdate { seq: 2, .. }),
        ),
        (
            "genesis document changed",
            |j| j["updates"][0]["document"]["capabilityInvocation"] = serde_json::json!([]),
            |e| matches!(e, LogError::GenesisMismatch { .. }),
        ),
        (
            "genesis with prev",
            |j| j["updates"][0]["prev"] = serde_json::json!("ab"),
            |e| matches!(e, LogError::BadPrev { seq: 0 }),
        ),
        (
            "genesis not a did:key",
            |j| j["updates"][0]["document"]["id"] = serde_json::json!("did:web:example.com"),
            |e| matches!(e, LogError::Genesis(_)),
        ),
    ];
    for (name, edit, check) in cases {
        let bad = edit_json(&log, edit);
        match bad.verify(None, T0 + 3) {
            Err(e) => assert!(check(&e), "{name}: unexpected {e:?}"),
            Ok(()) => panic!("{name}: accepted"),
        }
    }
}

// Goal: merge_from adopts verified extensions, ignores prefixes, and reports forks; ours never
// changes on error.
#[test]
fn merge_from_outcomes() {
    let (master, _phone, base) = agent_with_phone();
    let mid = master_id(&base, &master);
    let extend = |log: &DidLog, frag: &str, n: u8| {
        let mut log = log.clone();
        let mut doc = log.current().clone();
        doc.add_key(frag, &key(n).public(), &[], None).expect("add");
        log.append(doc, &master, &mid, T0 + 3).expect("append");
        log
    };
    let longer = extend(&base, "a", 21);
    let longest = extend(&longer, "b", 22);
    let sibling = extend(&base, "c", 23);

    // Equal and prefix: unchanged.
    let mut mine = longer.clone();
    assert_eq!(
        mine.merge_from(&longer, T0 + 4).expect("ok"),
        MergeOutcome::Unchanged
    );
    assert_eq!(
        mine.merge_from(&base, T0 + 4).expect("ok"),
        MergeOutcome::Unchanged
    );
    assert_eq!(mine, longer);

    // Extension: adopted.
    let mut mine = base.clone();
    assert_eq!(
        mine.merge_from(&longest, T0 + 4).expect("ok"),
        MergeOutcome::Extended { from: 2, to: 4 }
    );
    assert_eq!(mine.head_hash(), longest.head_hash());
    assert_eq!(mine.current(), longest.current());

    // Diverging at seq 2, every signer an admin: the branch whose update
    // at seq 2 has the lower hash wins, whatever the lengths, and the
    // outcome is the same from both sides.
    let (winner, loser) = if sibling.hashes[2] < longest.hashes[2] {
        (&sibling, &longest)
    } else {
        (&longest, &sibling)
    };
    let mut mine = loser.clone();
    match mine.merge_from(winner, T0 + 4).expect("ok") {
        MergeOutcome::Replaced { at: 2, dropped } => {
            assert_eq!(dropped, loser.updates()[2..].to_vec())
        }
        other => panic!("the winner was not adopted: {other:?}"),
    }
    assert_eq!(&mine, winner);
    let mut mine = winner.clone();
    assert_eq!(
        mine.merge_from(loser, T0 + 4).expect("ok"),
        MergeOutcome::KeptOurs { at: 2 }
    );
    assert_eq!(&mine, winner);
    assert_eq!(
        fork_order(winner, loser, 2),
        std::cmp::Ordering::Greater,
        "fork_order agrees with merge_from"
    );

    // A branch holding a recovery-key signature beats an admin-only one,
    // even a longer one with a lower hash.
    let recovery = key(30);
    let mut with_recovery = base.clone();
    let mut doc = with_recovery.current().clone();
    doc.add_key(
        "recovery-1",
        &recovery.public(),
        &[Relationship::CapabilityDelegation],
        None,
    )
    .expect("add recovery");
    with_recovery
        .append(doc, &master, &mid, T0 + 3)
        .expect("append");
    let rid = format!("{}#recovery-1", base.did());
    let mut admin_branch = with_recovery.clone();
    for n in 0..3 {
        let mut doc = admin_branch.current().clone();
        doc.add_key(&format!("x{n}"), &key(50 + n).public(), &[], None)
            .expect("add");
        admin_branch
            .append(doc, &master, &mid, T0 + 3)
            .expect("append");
    }
    let mut recovered = with_recovery.clone();
    let mut doc = recovered.current().clone();
    doc.add_key("r", &key(60).public(), &[], None).expect("add");
    recovered
        .append(doc, &recovery, &rid, T0 + 3)
        .expect("recovery signs");
    let at = with_recovery.len();
    assert_eq!(
        fork_order(&recovered, &admin_branch, at),
        std::cmp::Ordering::Greater
    );
    let mut mine = admin_branch.clone();
    assert!(matches!(
        mine.merge_from(&recovered, T0 + 4).expect("ok"),
        MergeOutcome::Replaced { .. }
    ));
    assert_eq!(mine, recovered);
    let mut mine = recovered.clone();
    assert!(matches!(
        mine.merge_from(&admin_branch, T0 + 4).expect("ok"),
        MergeOutcome::KeptOurs { .. }
    ));

    // A forged branch is refused before the rule is applied; ours stays.
    let forged = edit_json(&sibling, |j| {
        j["updates"][2]["nonce"] = serde_json::json!("00".repeat(16))
    });
    let mut mine = longest.clone();
    assert!(mine.merge_from(&forged, T0 + 4).is_err());
    assert_eq!(mine, longest);

    // Another agent: refused.
    let stranger = DidLog::genesis(&key(40), T0).expect("genesis");
    let mut mine = base.clone();
    assert!(matches!(
        mine.merge_from(&stranger, T0 + 4),
        Err(LogError::WrongDid { .. })
    ));
    // A tampered extension: refused as invalid, not as a fork.
    let tampered = edit_json(&longest, |j| {
        j["updates"][3]["document"]["authentication"] = serde_json::json!([])
    });
    assert!(matches!(
        mine.merge_from(&tampered, T0 + 4),
        Err(LogError::BadSignature { seq: 3, .. })
    ));
    assert_eq!(mine, base);
}

// Goal: JSON round trip keeps the log byte-for-byte (hashes equal), decode_verified checks it,
// and malformed shapes (empty, unknown fields) are refused at parse time.
#[test]
fn serde_round_trip_and_shape() {
    let (_master, _phone, log) = agent_with_phone();
    let json = serde_json::to_vec(&log).expect("serializable");
    let back: DidLog = serde_json::from_slice(&json).expect("parses");
    assert_eq!(back.head_hash(), log.head_hash());
    assert_eq!(back.updates(), log.updates());
    let verified = DidLog::decode_verified(&json, Some(log.did()), T0 + 2).expect("valid");
    assert_eq!(verified, log);
    assert!(
        DidLog::decode_verified(
            &json,
            Some("did:key:z6MkiTBz1ymuepAQ4HEHYSF1H8quG5GLVVQR3djdX3mDooWp"),
            T0 + 2
        )
        .is_err()
    );

    assert!(serde_json::from_str::<DidLog>(r#"{"updates":[]}"#).is_err());
    assert!(serde_json::from_str::<DidLog>(r#"{}"#).is_err());
    let mut extra = serde_json::to_value(&log).expect("value");
    extra["extra"] = serde_json::json!(1);
    assert!(serde_json::from_value::<DidLog>(extra).is_err());
    let mut extra = serde_json::to_value(&log).expect("value");
    extra["updates"][0]["extra"] = serde_json::json!(1);
    assert!(serde_json::from_value::<DidLog>(extra).is_err());

    // The update hash is over canonical JSON: key order in the received text does not matter.
    let canonical = to_canonical_json(&log.updates()[1]).expect("ok");
    let text = String::from_utf8(canonical).expect("utf8");
    assert!(text.starts_with(r#"{"document":{"@context":"#), "{text}");
    let keys: Vec<&str> = [
        "\"document\"",
        "\"key_id\"",
        "\"nonce\"",
        "\"prev\"",
        "\"seq\"",
        "\"signature\"",
        "\"timestamp\"",
    ]
    .to_vec();
    let positions: Vec<usize> = keys
        .iter()
        .map(|k| text.rfind(k).expect("key present"))
        .collect();
    assert!(
        positions.windows(2).all(|w| w[0] < w[1]),
        "top-level keys sorted: {text}"
    );
}

// Goal: the log holds at most MAX_LOG_UPDATES updates: append stops there and longer inputs are
// refused at parse time. Method: toggle a service entry to build a full-length log cheaply.
#[test]
fn size_bound() {
    let master = key(1);
    let mut log = DidLog::genesis(&master, T0).expect("genesis");
    let mid = master_id(&log, &master);
    let service_id = format!("{}#svc", log.did());
    while log.len() < MAX_LOG_UPDATES {
        let mut doc = log.current().clone();
        if doc.service.is_empty() {
            doc.service
                .push(serde_json::json!({"id": service_id, "type": "T", "serviceEndpoint": "e"}));
        } else {
            doc.service.clear();
        }
        log.append(doc, &master, &mid, T0 + 1)
            .expect("below the bound");
    }
    log.verify(None, T0 + 1).expect("full log is valid");
    let mut doc = log.current().clone();
    doc.service.clear();
    doc.service
        .push(serde_json::json!({"id": service_id, "type": "U", "serviceEndpoint": "e"}));
    assert!(matches!(
        log.append(doc, &master, &mid, T0 + 1),
        Err(LogError::TooLong { .. })
    ));

    let mut json = serde_json::to_value(&log).expect("value");
    let first = json["updates"][0].clone();
    json["updates"].as_array_mut().expect("array").push(first);
    let err = serde_json::from_value::<DidLog>(json).expect_err("too long");
    assert!(err.to_string().contains("more than the limit"), "{err}");
}
