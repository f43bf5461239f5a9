//! Tests of the v2 DID chain: ops and diffs, the entry rules, v1 migration,
//! proofs, the fork order, merging and rebasing, and the proof size after
//! 1,000 updates. Generated cases use a seeded generator; a failing run
//! prints its seed and replays with `SEED=<n>`.

use std::collections::VecDeque;
use std::time::Instant;

use super::*;
use crate::did_key::{did_key_from_ed25519, ed25519_public_multibase, x25519_public_from_ed25519};
use crate::document::Relationship::*;
use crate::document::{CONTEXT_DID_V1, CONTEXT_ED25519_2020, X25519_KEY_TYPE};
use crate::keys::context_id_for;

const T0: i64 = 1_750_000_000;
/// The verifier's clock in most tests: a little after the fixture's last entry.
const NOW: i64 = T0 + 100;
const DEVICE_RELS: [Relationship; 3] = [Authentication, AssertionMethod, CapabilityInvocation];

fn key(n: u8) -> DeviceKey {
    DeviceKey::from_seed(&[n; 32])
}

/// A distinct device key for every `n`.
fn device_key(n: u32) -> DeviceKey {
    let mut seed = [0xd5; 32];
    seed[..4].copy_from_slice(&n.to_le_bytes());
    DeviceKey::from_seed(&seed)
}

fn master_id(doc: &DidDocument, master: &DeviceKey) -> String {
    doc.key_id(&ed25519_public_multibase(&master.public()))
}

fn device_id(doc: &DidDocument, device: &DeviceKey) -> String {
    doc.key_id(&context_id_for(&device.public()))
}

/// `doc` with `device` paired as the node pairs devices: its Ed25519 key for
/// authentication, assertionMethod and capabilityInvocation (plus `extra`),
/// and its X25519 key for keyAgreement.
fn with_device(doc: &DidDocument, device: &DeviceKey, extra: &[Relationship]) -> DidDocument {
    let mut doc = doc.clone();
    let ctx = context_id_for(&device.public());
    let mut rels = DEVICE_RELS.to_vec();
    rels.extend_from_slice(extra);
    doc.add_key(&ctx, &device.public(), &rels, None)
        .expect("add device key");
    let x = x25519_public_from_ed25519(&device.public()).expect("ed25519 point");
    doc.add_key_agreement_key(&format!("{ctx}-x25519"), &x, None)
        .expect("add device x25519 key");
    doc
}

/// `doc` without `device`'s two keys (a revocation).
fn without_device(doc: &DidDocument, device: &DeviceKey) -> DidDocument {
    let mut doc = doc.clone();
    let ctx = context_id_for(&device.public());
    doc.remove_key(&ctx).expect("device listed");
    doc.remove_key(&format!("{ctx}-x25519"))
        .expect("device x25519 listed");
    doc
}

/// The standing fixture: the master's genesis, then (all signed by the
/// master) an admin device holding capabilityDelegation, a recovery key, and
/// a plain phone. The last entry is not an authority entry.
struct Agent {
    master: DeviceKey,
    admin: DeviceKey,
    recovery: DeviceKey,
    phone: DeviceKey,
    chain: DidChain,
}

impl Agent {
    fn new() -> Agent {
        let master = key(1);
        let admin = key(2);
        let recovery = key(3);
        let phone = key(4);
        let mut chain = DidChain::genesis(&master, T0).expect("genesis");
        let mid = master_id(chain.current(), &master);
        let doc = with_device(chain.current(), &admin, &[CapabilityDelegation]);
        chain
            .append_document(&doc, &master, &mid, T0 + 1)
            .expect("master adds the admin device");
        let mut doc = chain.current().clone();
        doc.add_key(
            "recovery-1",
            &recovery.public(),
            &[CapabilityDelegation],
            None,
        )
        .expect("add recovery key");
        chain
            .append_document(&doc, &master, &mid, T0 + 2)
            .expect("master adds the recovery key");
        let doc = with_device(chain.current(), &phone, &[]);
        chain
            .append_document(&doc, &master, &mid, T0 + 3)
            .expect("master adds the phone");
        Agent {
            master,
            admin,
            recovery,
            phone,
            chain,
        }
    }

    fn did(&self) -> String {
        self.chain.did().to_owned()
    }

    fn master_id(&self) -> String {
        master_id(self.chain.current(), &self.master)
    }

    fn admin_id(&self) -> String {
        device_id(self.chain.current(), &self.admin)
    }

    fn recovery_id(&self) -> String {
        self.chain.current().key_id("recovery-1")
    }

    fn phone_id(&self) -> String {
        device_id(self.chain.current(), &self.phone)
    }
}

/// `chain` plus one entry signed by `signer` that pairs `device`.
fn paired(
    chain: &DidChain,
    device: &DeviceKey,
    signer: &DeviceKey,
    key_id: &str,
    timestamp: i64,
) -> DidChain {
    let mut chain = chain.clone();
    let doc = with_device(chain.current(), device, &[]);
    chain
        .append_document(&doc, signer, key_id, timestamp)
        .expect("pairing is allowed");
    chain
}

/// Signs a v2 entry on top of `chain` whose fields are all computed honestly
/// from `ops`, except what `tweak` changes before signing (what a buggy or
/// hostile key holder can do), and returns the chain with it, unverified.
fn forge(
    chain: &DidChain,
    ops: Vec<DidOp>,
    signer: &DeviceKey,
    key_id: &str,
    timestamp: i64,
    tweak: impl FnOnce(&mut DidEntryV2),
) -> Result<DidChain, ChainError> {
    let after = apply(chain.current(), &ops).unwrap_or_else(|_| chain.current().clone());
    let authority = Authority::of(&after);
    let (prev, prev_hash) = chain.head();
    let mut entry = DidEntryV2 {
        v: 2,
        seq: prev.seq() + 1,
        prev: prev_hash.to_owned(),
        auth_prev: chain.auth_hash.clone(),
        ops,
        authority: (authority != chain.authority).then_some(authority),
        state: document_hash(&after).expect("hashable"),
        timestamp,
        nonce: String::new(),
        key_id: key_id.to_owned(),
        signature: String::new(),
    };
    tweak(&mut entry);
    let entry = DidEntryV2::sign(entry, signer).expect("signing works");
    let mut entries = chain.entries().to_vec();
    entries.push(DidEntry::V2(entry));
    DidChain::from_entries(entries)
}

/// Rebuilds a chain from edited JSON, as a peer could send it.
fn edit_json(
    chain: &DidChain,
    edit: impl FnOnce(&mut serde_json::Value),
) -> Result<DidChain, serde_json::Error> {
    let mut json = serde_json::to_value(chain).expect("serializable");
    edit(&mut json);
    serde_json::from_value(json)
}

/// SplitMix64: a tiny seeded generator, so that generated cases replay.
struct Rng(u64);

impl Rng {
    /// Seeded from `SEED` if set, else from `default`; prints the seed.
    fn from_env(default: u64) -> Rng {
        let seed = std::env::var("SEED")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(default);
        eprintln!("SEED={seed}");
        Rng(seed)
    }

    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (n > 0).
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    fn chance(&mut self, percent: u64) -> bool {
        self.next() % 100 < percent
    }

    fn shuffle<T>(&mut self, items: &mut [T]) {
        for i in (1..items.len()).rev() {
            let j = self.below(i + 1);
            items.swap(i, j);
        }
    }
}

/// A random document of one DID, not necessarily valid: methods drawn from a
/// pool of 8 ids (one in another DID) with random types, keys, controllers
/// and expiry, in random order; random relationship lists over the listed
/// ids in random order; random services, controller and contexts.
fn random_document(rng: &mut Rng) -> DidDocument {
    let did = "did:example:agent";
    let mut pool: Vec<usize> = (0..8).collect();
    rng.shuffle(&mut pool);
    let count = rng.below(pool.len() + 1);
    let verification_method: Vec<VerificationMethod> = pool[..count]
        .iter()
        .map(|&i| VerificationMethod {
            id: if i == 7 {
                "did:example:other#k7".to_owned()
            } else {
                format!("{did}#k{i}")
            },
            r#type: [ED25519_KEY_TYPE, X25519_KEY_TYPE][rng.below(2)].to_owned(),
            controller: [did, "did:example:other"][rng.below(2)].to_owned(),
            public_key_multibase: format!("z{i}{}", rng.below(2)),
            expires: rng.chance(20).then(|| "2030-01-01T00:00:00Z".to_owned()),
        })
        .collect();
    let ids: Vec<String> = verification_method.iter().map(|m| m.id.clone()).collect();
    let list = |rng: &mut Rng| {
        let mut l = ids.clone();
        rng.shuffle(&mut l);
        let n = rng.below(l.len() + 1);
        l.truncate(n);
        l
    };
    let services = [
        vec![],
        vec![serde_json::json!({"id": "#a", "type": "T", "serviceEndpoint": "x"})],
        vec![
            serde_json::json!({"id": "#a", "type": "T", "serviceEndpoint": "y"}),
            serde_json::json!({"id": "#b", "type": "U", "serviceEndpoint": {"n": 1}}),
        ],
    ];
    let contexts = [
        vec![CONTEXT_DID_V1.to_owned()],
        vec![CONTEXT_DID_V1.to_owned(), CONTEXT_ED25519_2020.to_owned()],
        vec![CONTEXT_ED25519_2020.to_owned(), CONTEXT_DID_V1.to_owned()],
    ];
    DidDocument {
        context: contexts[rng.below(contexts.len())].clone(),
        id: did.to_owned(),
        controller: [
            None,
            Some(did.to_owned()),
            Some("did:example:boss".to_owned()),
        ][rng.below(3)]
        .clone(),
        authentication: list(rng),
        assertion_method: list(rng),
        key_agreement: list(rng),
        capability_invocation: list(rng),
        capability_delegation: list(rng),
        service: services[rng.below(services.len())].clone(),
        verification_method,
    }
}

// Goal: apply(old, diff(old, new)) == new for any two documents, diff(d, d) is empty, the ops
// stay under the per-entry bound and survive their JSON wire form. Method: 3,000 seeded pairs.
#[test]
fn diff_apply_round_trip() {
    let mut rng = Rng::from_env(15);
    for case in 0..3000 {
        let old = random_document(&mut rng);
        let new = random_document(&mut rng);
        let ops = diff(&old, &new);
        assert!(ops.len() <= MAX_OPS_PER_ENTRY, "case {case}");
        let got = apply(&old, &ops).unwrap_or_else(|e| panic!("case {case}: {e:?}\n{ops:#?}"));
        assert_eq!(got, new, "case {case}: ops {ops:#?}");
        let wire = to_canonical_json(&ops).expect("encodable");
        let back: Vec<DidOp> = serde_json::from_slice(&wire).expect("decodable");
        assert_eq!(back, ops, "case {case}");
        assert!(diff(&old, &old).is_empty(), "case {case}");
    }
}

// Goal: diff stays within MAX_OPS_PER_ENTRY in the worst case: every one of 256 methods replaced
// and every relationship rewritten.
#[test]
fn diff_worst_case_fits_one_entry() {
    let agent = Agent::new();
    let base = agent.chain.current().clone();
    let fill = |seed_offset: u32| {
        let mut doc = base.clone();
        doc.verification_method.clear();
        for rel in Relationship::ALL {
            doc.relationship_mut(rel).clear();
        }
        for n in 0..MAX_VERIFICATION_METHODS as u32 {
            let k = device_key(seed_offset + n);
            doc.add_key(
                &format!("k{}", seed_offset + n),
                &k.public(),
                &[
                    Authentication,
                    AssertionMethod,
                    CapabilityInvocation,
                    CapabilityDelegation,
                ],
                None,
            )
            .expect("add");
        }
        doc
    };
    let (old, new) = (fill(0), fill(10_000));
    let ops = diff(&old, &new);
    assert!(
        ops.len() <= 2 * MAX_VERIFICATION_METHODS + 5 * 16 + 3,
        "{}",
        ops.len()
    );
    assert_eq!(apply(&old, &ops).expect("applies"), new);
}

// Goal: apply refuses every op that does not apply, with the typed reason and the op's index;
// one row per kind of mistake.
#[test]
fn apply_rejects_ops_that_do_not_apply() {
    let agent = Agent::new();
    let doc = agent.chain.current().clone();
    let phone = format!("#{}", context_id_for(&agent.phone.public()));
    let existing = doc.verification_method[0].clone();
    type Check = fn(&OpError) -> bool;
    let cases: Vec<(&str, Vec<DidOp>, Check)> = vec![
        (
            "add an id that exists",
            vec![DidOp::AddMethod { method: existing }],
            |e| matches!(e, OpError::MethodExists { .. }),
        ),
        (
            "remove an id that does not exist",
            vec![DidOp::RemoveMethod {
                id: "#ghost".into(),
            }],
            |e| matches!(e, OpError::MethodNotFound { .. }),
        ),
        (
            "grant an unknown id",
            vec![DidOp::Grant {
                rel: Authentication,
                id: "#ghost".into(),
            }],
            |e| matches!(e, OpError::MethodNotFound { .. }),
        ),
        (
            "grant twice",
            vec![DidOp::Grant {
                rel: Authentication,
                id: phone.clone(),
            }],
            |e| {
                matches!(
                    e,
                    OpError::AlreadyGranted {
                        rel: Authentication,
                        ..
                    }
                )
            },
        ),
        (
            "revoke what is not granted",
            vec![DidOp::Revoke {
                rel: CapabilityDelegation,
                id: phone.clone(),
            }],
            |e| {
                matches!(
                    e,
                    OpError::NotGranted {
                        rel: CapabilityDelegation,
                        ..
                    }
                )
            },
        ),
        (
            "remove then grant the removed id",
            vec![
                DidOp::RemoveMethod { id: phone.clone() },
                DidOp::Grant {
                    rel: Authentication,
                    id: phone.clone(),
                },
            ],
            |e| matches!(e, OpError::MethodNotFound { .. }),
        ),
        (
            "set a relationship with a duplicate",
            vec![DidOp::SetRelationship {
                rel: Authentication,
                ids: vec![phone.clone(), phone.clone()],
            }],
            |e| matches!(e, OpError::DuplicateId { .. }),
        ),
        (
            "set a relationship with an unknown id",
            vec![DidOp::SetRelationship {
                rel: Authentication,
                ids: vec!["#ghost".into()],
            }],
            |e| matches!(e, OpError::MethodNotFound { .. }),
        ),
        (
            "set a relationship to what it is",
            vec![DidOp::SetRelationship {
                rel: CapabilityDelegation,
                ids: doc.capability_delegation.clone(),
            }],
            |e| {
                matches!(
                    e,
                    OpError::Unchanged {
                        field: "capabilityDelegation"
                    }
                )
            },
        ),
        (
            "set the services to what they are",
            vec![DidOp::SetService { service: vec![] }],
            |e| matches!(e, OpError::Unchanged { field: "service" }),
        ),
        (
            "set the controller to what it is",
            vec![DidOp::SetController {
                controller: doc.controller.clone(),
            }],
            |e| {
                matches!(
                    e,
                    OpError::Unchanged {
                        field: "controller"
                    }
                )
            },
        ),
        (
            "set the context to what it is",
            vec![DidOp::SetContext {
                context: doc.context.clone(),
            }],
            |e| matches!(e, OpError::Unchanged { field: "@context" }),
        ),
    ];
    for (name, ops, check) in cases {
        let last = ops.len() - 1;
        match apply(&doc, &ops) {
            Err(ChainError::Op { index, source }) => {
                assert_eq!(index, last, "{name}");
                assert!(check(&source), "{name}: unexpected {source}");
            }
            other => panic!("{name}: {other:?}"),
        }
    }
}

// Goal: ops have a small, stable wire form (golden JSON), ids of the DID travel relative, and
// unknown ops or fields are refused.
#[test]
fn op_wire_form() {
    let ops = vec![
        DidOp::RemoveMethod {
            id: "#phone".into(),
        },
        DidOp::Grant {
            rel: CapabilityDelegation,
            id: "#phone".into(),
        },
        DidOp::Revoke {
            rel: KeyAgreement,
            id: "#x".into(),
        },
        DidOp::SetRelationship {
            rel: Authentication,
            ids: vec!["#a".into(), "#b".into()],
        },
        DidOp::SetController { controller: None },
        DidOp::SetContext {
            context: vec![CONTEXT_DID_V1.into()],
        },
    ];
    let text = String::from_utf8(to_canonical_json(&ops).expect("ok")).expect("utf8");
    assert_eq!(
        text,
        concat!(
            r##"[{"id":"#phone","op":"remove_method"},"##,
            r##"{"id":"#phone","op":"grant","rel":"capabilityDelegation"},"##,
            r##"{"id":"#x","op":"revoke","rel":"keyAgreement"},"##,
            r##"{"ids":["#a","#b"],"op":"set_relationship","rel":"authentication"},"##,
            r##"{"controller":null,"op":"set_controller"},"##,
            r##"{"context":["https://www.w3.org/ns/did/v1"],"op":"set_context"}]"##,
        )
    );
    let agent = Agent::new();
    let doc = with_device(agent.chain.current(), &key(9), &[]);
    let ops = diff(agent.chain.current(), &doc);
    let did = agent.did();
    let ctx = context_id_for(&key(9).public());
    assert!(matches!(&ops[0], DidOp::AddMethod { method } if method.id == format!("{did}#{ctx}")));
    assert!(ops.contains(&DidOp::Grant {
        rel: Authentication,
        id: format!("#{ctx}")
    }));

    for bad in [
        r##"{"op":"rename","id":"#a"}"##,
        r##"{"op":"grant","rel":"authentication","id":"#a","extra":1}"##,
        r##"{"op":"grant","rel":"owner","id":"#a"}"##,
        r##"{"rel":"authentication","id":"#a"}"##,
    ] {
        assert!(
            serde_json::from_str::<DidOp>(bad).is_err(),
            "{bad} accepted"
        );
    }
}

// Goal: signer_rank tells recovery keys, admins and others apart, judged in the given document.
#[test]
fn signer_rank_table() {
    let agent = Agent::new();
    let doc = agent.chain.current();
    let cases = [
        (agent.master_id(), RANK_ADMIN),
        (agent.admin_id(), RANK_ADMIN),
        (agent.recovery_id(), RANK_RECOVERY),
        ("recovery-1".to_owned(), RANK_RECOVERY),
        (agent.phone_id(), RANK_NONE),
        (doc.key_id("recovery-9"), RANK_NONE),
        ("did:example:other#recovery-1".to_owned(), RANK_NONE),
    ];
    for (key_id, rank) in cases {
        assert_eq!(signer_rank(doc, &key_id), rank, "{key_id}");
        if key_id.contains('#') {
            assert_eq!(
                agent.chain.authority().rank(&agent.did(), &key_id),
                rank,
                "{key_id}"
            );
        }
    }
}

// Goal: the fixture chain verifies, every v2 entry is signed by an admin, and the authority
// entries (and only they) carry the authority.
#[test]
fn honest_chain_verifies() {
    let agent = Agent::new();
    let chain = &agent.chain;
    chain.verify(Some(&agent.did()), NOW).expect("valid");
    assert_eq!(chain.len(), 4);
    let carries: Vec<bool> = chain
        .entries()
        .iter()
        .map(|e| matches!(e, DidEntry::V2(v2) if v2.authority.is_some()))
        .collect();
    assert_eq!(carries, [false, true, true, false]);
    assert_eq!(chain.authority(), &Authority::of(chain.current()));
    assert_eq!(chain.authority().keys.len(), 3);
    // A recovery key may administer: it signs a pairing.
    let mut chain = chain.clone();
    let doc = with_device(chain.current(), &key(9), &[]);
    chain
        .append_document(&doc, &agent.recovery, &agent.recovery_id(), T0 + 4)
        .expect("recovery key adds a device");
    chain.verify(None, NOW).expect("valid");
    // Another agent's DID is refused.
    assert!(matches!(
        chain.verify(Some(&did_key_from_ed25519(&key(40).public())), NOW),
        Err(ChainError::WrongDid { .. })
    ));
}

// Goal: every v2 rule rejects an entry that breaks it even when the entry is properly signed
// (the signer is buggy or hostile); one forged entry per row, with the exact error expected.
#[test]
fn entry_rules_table() {
    let agent = Agent::new();
    let base = &agent.chain;
    let did = agent.did();
    let (mid, aid, rid, pid) = (
        agent.master_id(),
        agent.admin_id(),
        agent.recovery_id(),
        agent.phone_id(),
    );
    let new_device = |n: u8| diff(base.current(), &with_device(base.current(), &key(n), &[]));
    let promote_phone = vec![DidOp::Grant {
        rel: CapabilityDelegation,
        id: relative_id(&did, &pid),
    }];
    let t = T0 + 10;
    let removed_admin = {
        let mut chain = base.clone();
        let doc = without_device(chain.current(), &agent.admin);
        chain
            .append_document(&doc, &agent.master, &mid, t)
            .expect("master removes the admin");
        chain
    };
    let v2_then_v1 = {
        let mut entries = base.entries().to_vec();
        let mut log = DidLog::genesis(&agent.master, T0).expect("genesis");
        let doc = with_device(log.current(), &key(9), &[]);
        log.append(doc, &agent.master, &mid, T0 + 1)
            .expect("v1 append");
        entries.push(DidEntry::V1(log.updates()[1].clone()));
        DidChain::from_entries(entries)
    };

    type Check = fn(&ChainError) -> bool;
    let cases: Vec<(&str, Result<DidChain, ChainError>, Check)> = vec![
        (
            "signed by another key than key_id names",
            forge(base, new_device(9), &key(9), &mid, t, |_| {}),
            |e| matches!(e, ChainError::BadSignature { seq: 4, .. }),
        ),
        (
            "signed under an unknown key id",
            forge(
                base,
                new_device(9),
                &key(9),
                &format!("{did}#stranger"),
                t,
                |_| {},
            ),
            |e| {
                matches!(
                    e,
                    ChainError::Unauthorized {
                        seq: 4,
                        source: DidError::KeyNotFound { .. },
                        ..
                    }
                )
            },
        ),
        (
            "the same entry appended twice",
            {
                let mut entries = base.entries().to_vec();
                entries.push(entries[3].clone());
                DidChain::from_entries(entries)
            },
            |e| matches!(e, ChainError::BadSeq { index: 4, seq: 3 }),
        ),
        (
            "seq reused",
            forge(base, new_device(9), &agent.master, &mid, t, |e| e.seq = 3),
            |e| matches!(e, ChainError::BadSeq { index: 4, seq: 3 }),
        ),
        (
            "prev names another entry",
            forge(base, new_device(9), &agent.master, &mid, t, |e| {
                e.prev = e.auth_prev.clone()
            }),
            |e| matches!(e, ChainError::BadPrev { seq: 4 }),
        ),
        (
            "state tampered",
            forge(base, new_device(9), &agent.master, &mid, t, |e| {
                e.state = "00".repeat(32)
            }),
            |e| matches!(e, ChainError::BadState { seq: 4 }),
        ),
        (
            "authority tampered",
            forge(base, promote_phone.clone(), &agent.master, &mid, t, |e| {
                if let Some(a) = &mut e.authority {
                    a.keys.pop();
                }
            }),
            |e| matches!(e, ChainError::WrongAuthority { seq: 4 }),
        ),
        (
            "authority left out of an authority entry",
            forge(base, promote_phone.clone(), &agent.master, &mid, t, |e| {
                e.authority = None
            }),
            |e| matches!(e, ChainError::MissingAuthority { seq: 4 }),
        ),
        (
            "authority on an entry that does not change it",
            forge(base, new_device(9), &agent.master, &mid, t, |e| {
                e.authority = Some(Authority::of(base.current()))
            }),
            |e| matches!(e, ChainError::UnexpectedAuthority { seq: 4 }),
        ),
        (
            "auth_prev names a non-authority entry",
            forge(base, new_device(9), &agent.master, &mid, t, |e| {
                e.auth_prev = e.prev.clone()
            }),
            |e| matches!(e, ChainError::BadAuthPrev { seq: 4 }),
        ),
        (
            "signer without capabilityDelegation (a service change v1 would allow)",
            forge(
                base,
                vec![DidOp::SetService {
                    service: vec![
                        serde_json::json!({"id": "#s", "type": "T", "serviceEndpoint": "e"}),
                    ],
                }],
                &agent.phone,
                &pid,
                t,
                |_| {},
            ),
            |e| {
                matches!(
                    e,
                    ChainError::Unauthorized {
                        seq: 4,
                        source: DidError::PermissionDenied {
                            rel: CapabilityDelegation,
                            ..
                        },
                        ..
                    }
                )
            },
        ),
        (
            "a removed admin signs after its removal",
            forge(&removed_admin, new_device(9), &agent.admin, &aid, t, |_| {}),
            |e| {
                matches!(
                    e,
                    ChainError::Unauthorized {
                        seq: 5,
                        source: DidError::KeyNotFound { .. },
                        ..
                    }
                )
            },
        ),
        (
            "from the future",
            forge(
                base,
                new_device(9),
                &agent.master,
                &mid,
                NOW + MAX_CLOCK_SKEW_SECS + 1,
                |_| {},
            ),
            |e| matches!(e, ChainError::FromFuture { seq: 4, .. }),
        ),
        (
            "timestamp before the previous entry's",
            forge(base, new_device(9), &agent.master, &mid, T0, |_| {}),
            |e| matches!(e, ChainError::TimestampRegression { seq: 4, .. }),
        ),
        (
            "no ops",
            forge(base, vec![], &agent.master, &mid, t, |_| {}),
            |e| matches!(e, ChainError::EmptyUpdate { seq: 4 }),
        ),
        (
            "ops that cancel out",
            forge(
                base,
                vec![
                    DidOp::Revoke {
                        rel: Authentication,
                        id: relative_id(&did, &pid),
                    },
                    DidOp::Grant {
                        rel: Authentication,
                        id: relative_id(&did, &pid),
                    },
                ],
                &agent.master,
                &mid,
                t,
                |_| {},
            ),
            |e| matches!(e, ChainError::EmptyUpdate { seq: 4 }),
        ),
        (
            "an op that does not apply",
            forge(
                base,
                vec![DidOp::RemoveMethod {
                    id: "#ghost".into(),
                }],
                &agent.master,
                &mid,
                t,
                |_| {},
            ),
            |e| {
                matches!(
                    e,
                    ChainError::EntryOp {
                        seq: 4,
                        index: 0,
                        source: OpError::MethodNotFound { .. }
                    }
                )
            },
        ),
        (
            "too many ops",
            forge(
                base,
                vec![
                    DidOp::RemoveMethod {
                        id: "#ghost".into()
                    };
                    MAX_OPS_PER_ENTRY + 1
                ],
                &agent.master,
                &mid,
                t,
                |_| {},
            ),
            |e| matches!(e, ChainError::TooManyOps { seq: 4, .. }),
        ),
        (
            "recovery key put in authentication",
            forge(
                base,
                vec![DidOp::Grant {
                    rel: Authentication,
                    id: "#recovery-1".into(),
                }],
                &agent.master,
                &mid,
                t,
                |_| {},
            ),
            |e| matches!(e, ChainError::RecoveryKeyAuthenticates { seq: 4, .. }),
        ),
        (
            "no capabilityDelegation key left",
            forge(
                base,
                vec![DidOp::SetRelationship {
                    rel: CapabilityDelegation,
                    ids: vec![],
                }],
                &agent.master,
                &mid,
                t,
                |_| {},
            ),
            |e| matches!(e, ChainError::NoDelegationKey { seq: 4 }),
        ),
        (
            "invalid document (ed25519 key used for keyAgreement)",
            forge(
                base,
                vec![DidOp::Grant {
                    rel: KeyAgreement,
                    id: relative_id(&did, &pid),
                }],
                &agent.master,
                &mid,
                t,
                |_| {},
            ),
            |e| matches!(e, ChainError::InvalidDocument { seq: 4, .. }),
        ),
        (
            "key id not absolute",
            forge(base, new_device(9), &agent.master, &mid, t, |e| {
                e.key_id = relative_id(&did, &e.key_id)
            }),
            |e| matches!(e, ChainError::Malformed { seq: 4, .. }),
        ),
        (
            "version other than 2",
            forge(base, new_device(9), &agent.master, &mid, t, |e| e.v = 3),
            |e| matches!(e, ChainError::BadVersion { seq: 4, version: 3 }),
        ),
        ("v1 entry after a v2 entry", v2_then_v1, |e| {
            matches!(e, ChainError::V1AfterV2 { seq: 4 })
        }),
    ];
    for (name, built, check) in cases {
        let result = built.and_then(|chain| chain.verify(Some(&did), NOW));
        match result {
            Err(e) => assert!(check(&e), "{name}: unexpected {e:?}"),
            Ok(()) => panic!("{name}: accepted"),
        }
    }
    // The honest version of the recovery entry is fine.
    forge(base, new_device(9), &agent.recovery, &rid, t, |_| {})
        .and_then(|c| c.verify(Some(&did), NOW))
        .expect("an untampered entry verifies");
}

// Goal: any edit to a received chain's signed fields is caught; one JSON edit per row, no
// re-signing.
#[test]
fn tampered_json_is_rejected() {
    let agent = Agent::new();
    let chain = &agent.chain;
    let admin_id = agent.admin_id();
    type Edit = Box<dyn Fn(&mut serde_json::Value)>;
    type Check = fn(&ChainError) -> bool;
    let cases: Vec<(&str, Edit, Check)> = vec![
        (
            "state",
            Box::new(|j| j["entries"][3]["state"] = serde_json::json!("ab".repeat(32))),
            |e| matches!(e, ChainError::BadSignature { seq: 3, .. }),
        ),
        (
            "authority",
            Box::new(|j| {
                j["entries"][2]["authority"]["keys"]
                    .as_array_mut()
                    .expect("array")
                    .pop();
            }),
            |e| matches!(e, ChainError::BadSignature { seq: 2, .. }),
        ),
        (
            "auth_prev",
            Box::new(|j| j["entries"][3]["auth_prev"] = serde_json::json!("cd".repeat(32))),
            |e| matches!(e, ChainError::BadAuthPrev { seq: 3 }),
        ),
        (
            "timestamp",
            Box::new(|j| j["entries"][3]["timestamp"] = serde_json::json!(T0 + 50)),
            |e| matches!(e, ChainError::BadSignature { seq: 3, .. }),
        ),
        (
            "signer named as another admin",
            Box::new(move |j| j["entries"][3]["key_id"] = serde_json::json!(admin_id)),
            |e| matches!(e, ChainError::BadSignature { seq: 3, .. }),
        ),
        (
            "nonce not hex",
            Box::new(|j| j["entries"][3]["nonce"] = serde_json::json!("zz".repeat(16))),
            |e| matches!(e, ChainError::Malformed { seq: 3, .. }),
        ),
        (
            "signature not base64",
            Box::new(|j| j["entries"][3]["signature"] = serde_json::json!("!".repeat(86))),
            |e| matches!(e, ChainError::Malformed { seq: 3, .. }),
        ),
        (
            "genesis document",
            Box::new(|j| {
                j["entries"][0]["document"]["capabilityInvocation"] = serde_json::json!([])
            }),
            |e| matches!(e, ChainError::GenesisMismatch { .. }),
        ),
    ];
    for (name, edit, check) in cases {
        let edited = edit_json(chain, edit).unwrap_or_else(|e| panic!("{name}: {e}"));
        match edited.verify(None, NOW) {
            Err(e) => assert!(check(&e), "{name}: unexpected {e:?}"),
            Ok(()) => panic!("{name}: accepted"),
        }
    }
}

// Goal: a failed append leaves the chain unchanged, and append refuses a key that does not match
// the named key id before signing anything.
#[test]
fn failed_append_changes_nothing() {
    let agent = Agent::new();
    let mut chain = agent.chain.clone();
    let doc = with_device(chain.current(), &key(9), &[]);
    let cases: Vec<(&str, Result<(), ChainError>)> = vec![
        (
            "phone lacks delegation",
            chain
                .clone()
                .append_document(&doc, &agent.phone, &agent.phone_id(), NOW),
        ),
        (
            "wrong key for id",
            chain
                .clone()
                .append_document(&doc, &agent.admin, &agent.master_id(), NOW),
        ),
        (
            "no change",
            chain
                .clone()
                .append_document(chain.current(), &agent.master, &agent.master_id(), NOW),
        ),
        ("other did", {
            let mut other = doc.clone();
            other.id = "did:example:other".into();
            chain
                .clone()
                .append_document(&other, &agent.master, &agent.master_id(), NOW)
        }),
    ];
    for (name, result) in cases {
        assert!(result.is_err(), "{name}: accepted");
    }
    let before = chain.clone();
    assert!(matches!(
        chain.append_document(&doc, &agent.admin, &agent.master_id(), NOW),
        Err(ChainError::WrongSigningKey { .. })
    ));
    assert!(matches!(
        chain.append_ops(vec![], &agent.master, &agent.master_id(), NOW),
        Err(ChainError::EmptyUpdate { seq: 4 })
    ));
    assert_eq!(chain, before);
    assert_eq!(chain.current(), before.current());
    assert_eq!(chain.authority(), before.authority());
    chain.verify(None, NOW).expect("still valid");
}

/// Today's log format, frozen: a log written by `DidLog` (genesis by the
/// `[1; 32]` master, a phone with an X25519 key, then a `laptop` admin key) as
/// the node stores it (`serde_json::to_vec_pretty`).
const V1_LOG_FIXTURE: &str = include_str!("v1_log_fixture.json");
/// Head hash of [`V1_LOG_FIXTURE`]: v1 hashes must never change.
const V1_LOG_FIXTURE_HEAD: &str =
    "af42836678288459b4f8b7a3d3b8b953edf5bef0351123dab515be531858c4a7";

// Goal: a stored log reads in either form, saying which: the frozen v1 fixture as a
// converted chain (flagged, same head), a chain as itself (not flagged), and anything else
// as a decode error.
#[test]
fn stored_logs_read_in_either_form() {
    let (v1, migrated) = DidChain::from_stored_json(V1_LOG_FIXTURE.as_bytes()).expect("v1 reads");
    assert!(migrated);
    assert_eq!(v1.head_hash(), V1_LOG_FIXTURE_HEAD);
    let json = serde_json::to_vec(&v1).expect("serializable");
    let (chain, migrated) = DidChain::from_stored_json(&json).expect("chain reads");
    assert!(!migrated);
    assert_eq!(chain.head_hash(), v1.head_hash());
    assert!(matches!(
        DidChain::from_stored_json(b"{\"neither\": 1}"),
        Err(ChainError::Decode(_))
    ));
}

// Goal: an old log migrates losslessly: the frozen fixture and a log written now with today's
// API both verify as chains with the same current document and the same hashes, the v1 entries
// parse in chain JSON unchanged, and the chain continues with v2 entries.
#[test]
fn v1_log_migrates_to_a_chain() {
    let master = key(1);
    let now_log = {
        let mut log = DidLog::genesis(&master, T0).expect("genesis");
        let mid = master_id(log.current(), &master);
        let doc = with_device(log.current(), &key(2), &[]);
        log.append(doc, &master, &mid, T0 + 1).expect("append");
        let mut doc = log.current().clone();
        doc.service
            .push(serde_json::json!({"id": "#sync", "type": "NuwaSync", "serviceEndpoint": "p2p"}));
        log.append(doc, &master, &mid, T0 + 2).expect("append");
        serde_json::to_vec_pretty(&log).expect("serializable")
    };
    for (name, json) in [
        ("frozen", V1_LOG_FIXTURE.as_bytes()),
        ("written now", &now_log[..]),
    ] {
        let log: DidLog = serde_json::from_slice(json).expect("today's parser reads it");
        log.verify(None, NOW).expect("valid v1 log");
        let chain = DidChain::from_v1(&log).expect("converts");
        chain
            .verify(Some(log.did()), NOW)
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(chain.current(), log.current(), "{name}");
        assert_eq!(chain.head_hash(), log.head_hash(), "{name}");
        for (entry, update) in chain.entries().iter().zip(log.updates()) {
            assert_eq!(
                entry.hash().expect("hash"),
                update.hash().expect("hash"),
                "{name}"
            );
        }
        // The updates array is a valid entries array as is.
        let value: serde_json::Value = serde_json::from_slice(json).expect("json");
        let as_chain: DidChain =
            serde_json::from_value(serde_json::json!({"entries": value["updates"]}))
                .expect("chain json");
        assert_eq!(as_chain, chain, "{name}");
        // The proof of a v1-only chain verifies too.
        let verified = chain.proof().verify(log.did(), NOW).expect("proof");
        assert_eq!(verified.document(), log.current(), "{name}");
        // And the chain goes on with v2 entries.
        let mut chain = chain;
        let doc = with_device(chain.current(), &key(9), &[]);
        let mid = master_id(chain.current(), &master);
        chain
            .append_document(&doc, &master, &mid, T0 + 30)
            .expect("v2 append");
        chain
            .verify(Some(log.did()), NOW)
            .expect("valid after migration");
        assert_eq!(chain.entries().last().map(DidEntry::version), Some(2));
    }
    let log: DidLog = serde_json::from_str(V1_LOG_FIXTURE).expect("parses");
    assert_eq!(log.head_hash(), V1_LOG_FIXTURE_HEAD, "v1 hashing changed");
    assert_eq!(log.len(), 3);
}

// Goal: the proof of a chain verifies from the DID alone and tells the right head; its wire form
// round-trips and factors the DID out of the document.
#[test]
fn proof_verifies_from_the_did_alone() {
    let agent = Agent::new();
    let chain = &agent.chain;
    let proof = chain.proof();
    // Genesis, the two authority entries and the head.
    assert_eq!(proof.entries().len(), 4);
    let verified = proof.verify(&agent.did(), NOW).expect("valid proof");
    assert_eq!(verified.did(), agent.did());
    assert_eq!(verified.head_seq(), 3);
    assert_eq!(verified.head_hash(), chain.head_hash());
    assert_eq!(verified.document(), chain.current());

    let bytes = proof.encode().expect("encodes");
    let back = DidProof::decode(&bytes).expect("decodes");
    assert_eq!(back, proof);
    let wire: serde_json::Value = serde_json::from_slice(&bytes).expect("json");
    let methods = wire["document"]["verificationMethod"]
        .as_array()
        .expect("array");
    assert!(
        methods.iter().all(|m| m.get("controller").is_none()
            && m["id"].as_str().is_some_and(|id| id.starts_with('#')))
    );
    let master_fragment = ed25519_public_multibase(&agent.master.public());
    assert_eq!(
        wire["document"]["authentication"][0],
        format!("#{master_fragment}")
    );

    // A chain of only the genesis has a proof too.
    let genesis = DidChain::genesis(&agent.master, T0).expect("genesis");
    genesis
        .proof()
        .verify(&agent.did(), NOW)
        .expect("genesis proof");

    // A v1 chain whose head was signed by a capabilityInvocation key: the proof carries the v1
    // entries from the last admin-signed one, checked with v1's rules.
    let master = key(1);
    let service_key = key(6);
    let mut log = DidLog::genesis(&master, T0).expect("genesis");
    let mid = master_id(log.current(), &master);
    let mut doc = log.current().clone();
    doc.add_key("svc", &service_key.public(), &[CapabilityInvocation], None)
        .expect("add");
    log.append(doc, &master, &mid, T0 + 1).expect("append");
    let doc = with_device(log.current(), &key(7), &[]);
    log.append(doc, &master, &mid, T0 + 2).expect("append");
    let mut doc = log.current().clone();
    doc.service
        .push(serde_json::json!({"id": "#s", "type": "T", "serviceEndpoint": "e"}));
    log.append(doc, &service_key, "svc", T0 + 3)
        .expect("invocation key edits services");
    let chain = DidChain::from_v1(&log).expect("converts");
    let proof = chain.proof();
    assert_eq!(
        proof
            .entries()
            .iter()
            .map(DidEntry::seq)
            .collect::<Vec<_>>(),
        [0, 2, 3]
    );
    let verified = proof.verify(log.did(), NOW).expect("v1 tail verifies");
    assert_eq!(verified.document(), log.current());
}

// Goal: a proof is refused when it leaves out an authority entry, when its document is not the
// head's, when an entry lies about the authority, when it is out of order, for another DID, and
// when its bytes exceed the bound; one doctored proof per row.
#[test]
fn doctored_proofs_are_rejected() {
    let agent = Agent::new();
    let did = agent.did();
    // An entry signed by the admin after the promotion that made it one, so leaving out
    // authority entries matters for the signature too.
    let mut chain = agent.chain.clone();
    let doc = with_device(chain.current(), &key(9), &[]);
    chain
        .append_document(&doc, &agent.admin, &agent.admin_id(), T0 + 5)
        .expect("admin pairs a device");
    let good = chain.proof();
    good.verify(&did, NOW).expect("valid");
    assert_eq!(good.entries().len(), 4);
    let lying = forge(
        &agent.chain,
        vec![DidOp::Grant {
            rel: CapabilityDelegation,
            id: relative_id(&did, &agent.phone_id()),
        }],
        &agent.master,
        &agent.master_id(),
        T0 + 5,
        |e| e.authority = None,
    )
    .expect("shape is fine");

    type Doctor = Box<dyn Fn(&mut DidProof)>;
    type Check = fn(&ChainError) -> bool;
    let cases: Vec<(&str, Doctor, Check)> = vec![
        (
            "the last authority entry left out",
            Box::new(|p| {
                p.entries.remove(2);
            }),
            |e| matches!(e, ChainError::BadAuthPrev { seq: 4 }),
        ),
        (
            "the first authority entry left out",
            Box::new(|p| {
                p.entries.remove(1);
            }),
            |e| matches!(e, ChainError::BadAuthPrev { seq: 2 }),
        ),
        (
            "document does not match the head's state",
            Box::new(|p| {
                p.document
                    .service
                    .push(serde_json::json!({"id": "#s", "type": "T", "serviceEndpoint": "e"}))
            }),
            |e| matches!(e, ChainError::ProofHeadMismatch { seq: 4 }),
        ),
        (
            "head state tampered",
            Box::new(|p| {
                if let Some(DidEntry::V2(e)) = p.entries.last_mut() {
                    e.state = "00".repeat(32);
                }
            }),
            |e| matches!(e, ChainError::BadSignature { seq: 4, .. }),
        ),
        (
            "an entry repeated",
            Box::new(|p| {
                let again = p.entries[1].clone();
                p.entries.insert(2, again);
            }),
            |e| {
                matches!(
                    e,
                    ChainError::ProofOrder {
                        seq: 1,
                        previous: 1
                    }
                )
            },
        ),
        ("no entries", Box::new(|p| p.entries.clear()), |e| {
            matches!(e, ChainError::Empty)
        }),
        (
            "genesis left out",
            Box::new(|p| {
                p.entries.remove(0);
            }),
            |e| matches!(e, ChainError::GenesisNotV1),
        ),
        (
            "head authority differs from the authority in force",
            Box::new(move |p| *p = lying.proof()),
            |e| matches!(e, ChainError::ProofHeadAuthority { seq: 4 }),
        ),
    ];
    for (name, doctor, check) in cases {
        let mut proof = good.clone();
        doctor(&mut proof);
        match proof.verify(&did, NOW) {
            Err(e) => assert!(check(&e), "{name}: unexpected {e:?}"),
            Ok(_) => panic!("{name}: accepted"),
        }
        // The same holds after the wire.
        if let Ok(bytes) = proof.encode() {
            let decoded = DidProof::decode(&bytes).expect("decodes");
            assert!(
                decoded.verify(&did, NOW).is_err(),
                "{name}: accepted after decoding"
            );
        }
    }

    let other = did_key_from_ed25519(&key(40).public());
    assert!(matches!(
        good.verify(&other, NOW),
        Err(ChainError::WrongDid { .. })
    ));
    assert!(matches!(
        good.verify(&did, T0 - 1000),
        Err(ChainError::FromFuture { .. })
    ));

    let oversize = vec![b' '; MAX_PROOF_BYTES + 1];
    assert!(matches!(
        DidProof::decode(&oversize),
        Err(ChainError::ProofTooLarge { len, max: MAX_PROOF_BYTES }) if len == MAX_PROOF_BYTES + 1
    ));
    for bad in [
        &b"{}"[..],
        b"[]",
        b"{\"entries\":[],\"document\":{},\"x\":1}",
        b"\xff",
    ] {
        assert!(matches!(DidProof::decode(bad), Err(ChainError::Decode(_))));
    }
    let mut extra: serde_json::Value =
        serde_json::from_slice(&good.encode().expect("ok")).expect("json");
    extra["document"]["verificationMethod"][0]["extra"] = serde_json::json!(1);
    assert!(DidProof::decode(&serde_json::to_vec(&extra).expect("ok")).is_err());
}

// Goal: the proof's document form is lossless: documents with foreign controllers and ids, and
// the fixture's, come back equal.
#[test]
fn compact_document_round_trip() {
    let agent = Agent::new();
    let mut odd = agent.chain.current().clone();
    odd.verification_method[1].controller = "did:example:boss".into();
    odd.authentication.push("did:example:other#k".into());
    odd.controller = None;
    for doc in [agent.chain.current().clone(), odd] {
        let back = CompactDocument::from_document(&doc).expand();
        assert_eq!(back, doc);
    }
}

// Goal: chain JSON round-trips with equal hashes and refuses bad shapes at parse time: unknown
// fields, an unsupported version, no entries, a v2 genesis, and more than MAX_CHAIN_ENTRIES.
#[test]
fn chain_serde_shape() {
    let agent = Agent::new();
    let json = serde_json::to_vec(&agent.chain).expect("serializable");
    let back: DidChain = serde_json::from_slice(&json).expect("parses");
    assert_eq!(back, agent.chain);
    assert_eq!(back.current(), agent.chain.current());
    assert_eq!(back.authority(), agent.chain.authority());
    back.verify(None, NOW).expect("valid");

    let value: serde_json::Value = serde_json::from_slice(&json).expect("json");
    type Edit = fn(&mut serde_json::Value);
    let edits: Vec<(&str, Edit)> = vec![
        ("unknown top-level field", |j| {
            j["extra"] = serde_json::json!(1)
        }),
        ("unknown v2 field", |j| {
            j["entries"][3]["extra"] = serde_json::json!(1)
        }),
        ("unknown v1 field", |j| {
            j["entries"][0]["extra"] = serde_json::json!(1)
        }),
        ("unknown authority field", |j| {
            j["entries"][1]["authority"]["extra"] = serde_json::json!(1)
        }),
        ("version 3", |j| j["entries"][3]["v"] = serde_json::json!(3)),
        ("version as string", |j| {
            j["entries"][3]["v"] = serde_json::json!("2")
        }),
        ("no entries", |j| j["entries"] = serde_json::json!([])),
        ("v2 genesis", |j| {
            let entries = j["entries"].as_array_mut().expect("array");
            entries.remove(0);
        }),
    ];
    for (name, edit) in edits {
        let mut v = value.clone();
        edit(&mut v);
        assert!(
            serde_json::from_value::<DidChain>(v).is_err(),
            "{name}: accepted"
        );
    }

    let DidEntry::V2(mut small) = agent.chain.entries()[3].clone() else {
        panic!("entry 3 is a v2 entry");
    };
    small.ops.clear();
    let mut entries = vec![agent.chain.entries()[0].clone()];
    entries.resize(MAX_CHAIN_ENTRIES + 1, DidEntry::V2(small));
    assert!(matches!(
        DidChain::from_entries(entries),
        Err(ChainError::TooLong {
            max: MAX_CHAIN_ENTRIES,
            ..
        })
    ));
}

// Goal: issue 15's target: after 1,000 pairings and revocations (about 10 live devices, three
// promotions and demotions, one recovery-key rotation, several admins signing), the proof is at
// most 16 KiB (DHT pointer, so also the 32 KiB Hello) and verifies. Method: build the chain with
// the public API, then time full verification and proof verification (printed with --nocapture).
#[test]
fn proof_stays_small_after_1000_updates() {
    let master = key(1);
    let recovery1 = key(3);
    let recovery2 = key(5);
    let mut chain = DidChain::genesis(&master, T0).expect("genesis");
    let did = chain.did().to_owned();
    let mid = master_id(chain.current(), &master);
    let mut now = T0;
    let mut doc = chain.current().clone();
    doc.add_key(
        "recovery-1",
        &recovery1.public(),
        &[CapabilityDelegation],
        None,
    )
    .expect("add");
    chain
        .append_document(&doc, &master, &mid, now)
        .expect("add recovery key");

    let mut live: VecDeque<u32> = VecDeque::new();
    let mut next_device = 0u32;
    let mut first_admin: Option<u32> = None;
    let mut second_admin: Option<u32> = None;
    let mut largest_proof = 0;
    let started = Instant::now();
    while chain.len() <= 1000 {
        let update = chain.len();
        now += 60;
        let id_of = |chain: &DidChain, n: u32| device_id(chain.current(), &device_key(n));
        let admin = |n: Option<u32>| n.map(|n| (device_key(n), n));
        // Who signs an ordinary pairing or revocation: the master or one of the admin devices.
        let (signer, signer_id) = match (update % 3, admin(first_admin), admin(second_admin)) {
            (1, Some((k, n)), _) | (2, _, Some((k, n))) => {
                let id = id_of(&chain, n);
                (k, id)
            }
            _ => (key(1), mid.clone()),
        };
        let current = chain.current().clone();
        let (doc, signer, signer_id) = match update {
            300 | 500 => {
                let newest = *live.back().expect("devices are live");
                let rel = relative_id(&did, &id_of(&chain, newest));
                if update == 300 {
                    first_admin = Some(newest);
                } else {
                    second_admin = Some(newest);
                }
                let ops = vec![DidOp::Grant {
                    rel: CapabilityDelegation,
                    id: rel,
                }];
                (apply(&current, &ops).expect("promote"), key(1), mid.clone())
            }
            700 => {
                let demoted = first_admin.take().expect("first admin");
                let mut doc = current.clone();
                doc.revoke(&id_of(&chain, demoted), CapabilityDelegation);
                let promoted = second_admin.expect("second admin");
                (doc, device_key(promoted), id_of(&chain, promoted))
            }
            900 => {
                let mut doc = current.clone();
                doc.add_key(
                    "recovery-2",
                    &recovery2.public(),
                    &[CapabilityDelegation],
                    None,
                )
                .expect("add");
                doc.remove_key("recovery-1").expect("listed");
                (doc, key(3), chain.current().key_id("recovery-1"))
            }
            _ if live.len() < 10 => {
                next_device += 1;
                live.push_back(next_device);
                (
                    with_device(&current, &device_key(next_device), &[]),
                    signer,
                    signer_id,
                )
            }
            _ => {
                let admins = [first_admin, second_admin];
                let position = live
                    .iter()
                    .position(|n| !admins.contains(&Some(*n)))
                    .expect("a plain device");
                let gone = live.remove(position).expect("in range");
                (
                    without_device(&current, &device_key(gone)),
                    signer,
                    signer_id,
                )
            }
        };
        chain
            .append_document(&doc, &signer, &signer_id, now)
            .unwrap_or_else(|e| panic!("update {update}: {e}"));
        // The proof a stranger fetches after each of the last 100 updates, not just the last.
        if update > 900 {
            let size = chain.proof().encode().expect("encodes").len();
            largest_proof = largest_proof.max(size);
        }
    }
    let build_ms = started.elapsed().as_millis();
    let now = now + 1;
    assert_eq!(chain.len(), 1001);
    assert!(
        (9..=11).contains(&live.len()),
        "{} live devices",
        live.len()
    );

    let started = Instant::now();
    chain.verify(Some(&did), now).expect("full chain verifies");
    let chain_verify_ms = started.elapsed().as_secs_f64() * 1000.0;
    let chain_bytes = serde_json::to_vec(&chain).expect("ok").len();

    let proof = chain.proof();
    let bytes = proof.encode().expect("encodes");
    let started = Instant::now();
    let decoded = DidProof::decode(&bytes).expect("decodes");
    let verified = decoded.verify(&did, now).expect("proof verifies");
    let proof_verify_ms = started.elapsed().as_secs_f64() * 1000.0;
    assert_eq!(verified.document(), chain.current());
    assert_eq!(verified.head_hash(), chain.head_hash());
    assert_eq!(verified.head_seq(), 1000);
    // Genesis, recovery key, two promotions, one demotion, the rotation (also the recovery
    // key's entry) and the head.
    let seqs: Vec<u64> = proof.entries().iter().map(DidEntry::seq).collect();
    assert_eq!(seqs, [0, 1, 300, 500, 700, 900, 1000]);
    let entry_bytes: Vec<usize> = proof
        .entries()
        .iter()
        .map(|e| to_canonical_json(e).expect("ok").len())
        .collect();
    let compact_doc_bytes = bytes.len() - entry_bytes.iter().sum::<usize>();
    let doc_bytes = to_canonical_json(chain.current()).expect("ok").len();
    println!(
        "1000 updates, {} live devices at the end: proof {} bytes, at most {largest_proof} bytes \
         after updates 901-1000; entries {entry_bytes:?} bytes, document about {compact_doc_bytes} \
         bytes ({doc_bytes} in full JSON, which would make the proof {} bytes); full chain JSON {chain_bytes} bytes; build {build_ms} ms, \
         verify chain {chain_verify_ms:.1} ms, decode+verify proof {proof_verify_ms:.1} ms",
        live.len(),
        bytes.len(),
        bytes.len() - compact_doc_bytes + doc_bytes,
    );
    assert!(
        largest_proof <= 16 * 1024,
        "a proof of {largest_proof} bytes"
    );
    assert!(bytes.len() <= 16 * 1024, "proof is {} bytes", bytes.len());
}

/// A fork fixture: `base` is the agent chain; every branch forks after it.
fn fork_pair(agent: &Agent) -> (DidChain, DidChain) {
    let by_master = paired(
        &agent.chain,
        &key(20),
        &agent.master,
        &agent.master_id(),
        T0 + 10,
    );
    let by_admin = paired(
        &agent.chain,
        &key(21),
        &agent.admin,
        &agent.admin_id(),
        T0 + 10,
    );
    (by_master, by_admin)
}

fn hash_at(chain: &DidChain, index: usize) -> &str {
    &chain.meta[index].hash
}

// Goal: the fork rule's three cases on hand-built branches: two admins are ordered by the lower
// hash at the fork, a recovery signature beats a longer admin-only branch, and a prefix loses to
// its extension.
#[test]
fn fork_rule_cases() {
    let agent = Agent::new();
    let (a, b) = fork_pair(&agent);
    let want = hash_at(&b, 4).cmp(hash_at(&a, 4));
    assert_eq!(compare_branches(&a, &b).expect("same did"), want);
    assert_eq!(compare_branches(&b, &a).expect("same did"), want.reverse());
    assert_ne!(want, Ordering::Equal);

    // The admin branch is three entries longer; the recovery branch has one entry.
    let mut long = a.clone();
    for n in 22..24 {
        long = paired(&long, &key(n), &agent.admin, &agent.admin_id(), T0 + 11);
    }
    let recovered = paired(
        &agent.chain,
        &key(30),
        &agent.recovery,
        &agent.recovery_id(),
        T0 + 10,
    );
    assert_eq!(
        compare_branches(&recovered, &long).expect("ok"),
        Ordering::Greater
    );
    assert_eq!(
        compare_branches(&long, &recovered).expect("ok"),
        Ordering::Less
    );

    // Prefix rule, and equality.
    assert_eq!(compare_branches(&long, &a).expect("ok"), Ordering::Greater);
    assert_eq!(
        compare_branches(&agent.chain, &a).expect("ok"),
        Ordering::Less
    );
    assert_eq!(
        compare_branches(&a, &a.clone()).expect("ok"),
        Ordering::Equal
    );

    let stranger = DidChain::genesis(&key(40), T0).expect("genesis");
    assert!(matches!(
        compare_branches(&a, &stranger),
        Err(ChainError::WrongDid { .. })
    ));
}

// Goal: compare_branches is a total order, so all devices converge: on random trees of branches
// (forks at different points, signers of every rank) it is antisymmetric, Equal only for equal
// chains, transitive on every triple, and every order of discovery elects the same winner.
#[test]
fn fork_order_is_total() {
    let agent = Agent::new();
    let mut rng = Rng::from_env(1500);
    let signers = [
        (&agent.master, agent.master_id()),
        (&agent.admin, agent.admin_id()),
        (&agent.recovery, agent.recovery_id()),
    ];
    let mut device = 100u32;
    for round in 0..4 {
        let mut branches = vec![agent.chain.clone()];
        for _ in 0..9 {
            let parent = branches[rng.below(branches.len())].clone();
            let cut = agent.chain.len() + rng.below(parent.len() - agent.chain.len() + 1);
            let mut child =
                DidChain::from_entries(parent.entries()[..cut].to_vec()).expect("prefix");
            for _ in 0..1 + rng.below(3) {
                // Recovery signatures are rare, as they would be.
                let (signer, id) = &signers[if rng.chance(15) { 2 } else { rng.below(2) }];
                device += 1;
                let doc = with_device(child.current(), &device_key(device), &[]);
                child
                    .append_document(&doc, signer, id, T0 + 10)
                    .expect("admin pairs");
            }
            branches.push(child);
        }
        let cmp = |a: &DidChain, b: &DidChain| compare_branches(a, b).expect("same did");
        for a in &branches {
            for b in &branches {
                assert_eq!(
                    cmp(a, b),
                    cmp(b, a).reverse(),
                    "round {round}: antisymmetry"
                );
                assert_eq!(
                    cmp(a, b) == Ordering::Equal,
                    a == b,
                    "round {round}: equality"
                );
                for c in &branches {
                    if cmp(a, b) == Ordering::Greater && cmp(b, c) == Ordering::Greater {
                        assert_eq!(cmp(a, c), Ordering::Greater, "round {round}: transitivity");
                    }
                }
            }
        }
        let mut winners = BTreeSet::new();
        for _ in 0..10 {
            let mut order = branches.clone();
            rng.shuffle(&mut order);
            // Each device adopts whatever beats what it holds, in the order it hears of it.
            let mut held = order[0].clone();
            for other in &order[1..] {
                held.merge(other, NOW).expect("valid branches merge");
            }
            winners.insert(held.head_hash().to_owned());
        }
        assert_eq!(
            winners.len(),
            1,
            "round {round}: every order elects one winner"
        );
    }
}

// Goal: merge's outcomes: prefixes change nothing, extensions are adopted, a losing fork keeps
// ours, a winning fork replaces ours and returns our lost entries, and an invalid or foreign
// chain is refused without touching ours.
#[test]
fn merge_outcomes() {
    let agent = Agent::new();
    let (a, b) = fork_pair(&agent);
    let (winner, loser) = if compare_branches(&a, &b).expect("ok") == Ordering::Greater {
        (a, b)
    } else {
        (b, a)
    };

    let mut mine = winner.clone();
    assert_eq!(
        mine.merge(&agent.chain, NOW).expect("ok"),
        MergeOutcome::Unchanged
    );
    assert_eq!(
        mine.merge(&winner, NOW).expect("ok"),
        MergeOutcome::Unchanged
    );
    assert_eq!(
        mine.merge(&loser, NOW).expect("ok"),
        MergeOutcome::KeptOurs { fork_seq: 4 }
    );
    assert_eq!(mine, winner);

    let mut mine = agent.chain.clone();
    assert_eq!(
        mine.merge(&winner, NOW).expect("ok"),
        MergeOutcome::Extended { from: 4, to: 5 }
    );
    assert_eq!(mine, winner);
    assert_eq!(mine.current(), winner.current());

    let mut mine = loser.clone();
    assert_eq!(
        mine.merge(&winner, NOW).expect("ok"),
        MergeOutcome::SwitchedFork {
            fork_seq: 4,
            lost: loser.entries()[4..].to_vec()
        }
    );
    assert_eq!(mine, winner);

    // A winning but invalid branch (an entry's state tampered after signing) is refused.
    let tampered = edit_json(&winner, |j| {
        j["entries"][4]["state"] = serde_json::json!("00".repeat(32))
    })
    .expect("shape is fine");
    let mut mine = agent.chain.clone();
    assert!(matches!(
        mine.merge(&tampered, NOW),
        Err(ChainError::BadSignature { seq: 4, .. })
    ));
    assert_eq!(mine, agent.chain);
    let stranger = DidChain::genesis(&key(40), T0).expect("genesis");
    assert!(matches!(
        mine.merge(&stranger, NOW),
        Err(ChainError::WrongDid { .. })
    ));
    assert_eq!(mine, agent.chain);
}

// Goal: after two admins approve different devices concurrently, the loser of the fork rebases
// its approval onto the winner, so both devices end up listed and both admins converge; ops the
// winner already made are dropped.
#[test]
fn rebase_keeps_a_concurrently_approved_device() {
    let agent = Agent::new();
    let (x, y) = (key(20), key(21));
    let (by_master, by_admin) = fork_pair(&agent);
    let master_wins = compare_branches(&by_master, &by_admin).expect("ok") == Ordering::Greater;
    let (winner, mut loser, loser_key, loser_id) = if master_wins {
        (by_master, by_admin, &agent.admin, agent.admin_id())
    } else {
        (by_admin, by_master, &agent.master, agent.master_id())
    };
    let MergeOutcome::SwitchedFork { lost, .. } = loser.merge(&winner, NOW).expect("merge") else {
        panic!("the loser switches to the winner");
    };
    let mine: Vec<DidEntry> = lost
        .into_iter()
        .filter(|e| e.key_id() == loser_id)
        .collect();
    assert_eq!(mine.len(), 1);
    let ops = rebase_ops(&mine, loser.current());
    assert!(!ops.is_empty());
    loser
        .append_ops(ops, loser_key, &loser_id, T0 + 20)
        .expect("rebased approval");
    loser.verify(Some(&agent.did()), NOW).expect("valid");
    for device in [&x, &y] {
        let id = device_id(loser.current(), device);
        assert!(
            loser.current().has_relationship(&id, Authentication),
            "{id} listed"
        );
    }
    let mut other = winner.clone();
    assert!(matches!(
        other.merge(&loser, NOW).expect("ok"),
        MergeOutcome::Extended { .. }
    ));
    assert_eq!(other.head_hash(), loser.head_hash());

    // Both admins approved the same device: nothing is left to rebase.
    let same_a = paired(&agent.chain, &x, &agent.master, &agent.master_id(), T0 + 10);
    let same_b = paired(&agent.chain, &x, &agent.admin, &agent.admin_id(), T0 + 10);
    assert!(rebase_ops(&same_b.entries()[4..], same_a.current()).is_empty());
    assert!(
        rebase_ops(&same_a.entries()[..1], same_b.current()).is_empty(),
        "v1 entries are skipped"
    );
}

// Goal: document what the fork rule means for a revoked admin. Method: the admin forks at the
// position of its own revocation. Against a revocation the master signed, the fork wins whenever
// its entry hashes lower (the admin can retry nonces until it does); against a revocation the
// recovery key signed, it always loses, however long.
#[test]
fn revoked_admin_forks_lose_only_to_recovery() {
    let agent = Agent::new();
    let revoked_by = |signer: &DeviceKey, id: &str| {
        let mut chain = agent.chain.clone();
        let doc = without_device(chain.current(), &agent.admin);
        chain
            .append_document(&doc, signer, id, T0 + 10)
            .expect("revocation");
        chain
    };
    let by_master = revoked_by(&agent.master, &agent.master_id());
    let by_recovery = revoked_by(&agent.recovery, &agent.recovery_id());
    // The admin signs a fork at seq 4, retrying until its entry hashes below the master's.
    let mut fork = None;
    for n in 0..64u32 {
        let candidate = paired(
            &agent.chain,
            &device_key(500 + n),
            &agent.admin,
            &agent.admin_id(),
            T0 + 10,
        );
        if hash_at(&candidate, 4) < hash_at(&by_master, 4) {
            fork = Some(candidate);
            break;
        }
    }
    let mut fork = fork.expect("half of all hashes are lower; 64 tries suffice");
    fork = paired(&fork, &key(60), &agent.admin, &agent.admin_id(), T0 + 11);
    assert_eq!(
        compare_branches(&fork, &by_master).expect("ok"),
        Ordering::Greater
    );
    assert_eq!(
        compare_branches(&fork, &by_recovery).expect("ok"),
        Ordering::Less
    );
}

// Goal: the v2 wire format is frozen: a v2 entry built deterministically (fixed nonce) on top of
// the frozen v1 fixture, and the proof of that chain, hash to golden values. Method: build,
// verify, compare hashes; a deliberate format change must update them.
#[test]
fn v2_golden_bytes() {
    let log: DidLog = serde_json::from_str(V1_LOG_FIXTURE).expect("parses");
    let master = key(1);
    let chain = DidChain::from_v1(&log).expect("converts");
    let mid = master_id(chain.current(), &master);
    let doc = with_device(chain.current(), &key(9), &[]);
    let mut entry = DidEntryV2 {
        v: 2,
        seq: 3,
        prev: chain.head_hash().to_owned(),
        auth_prev: chain.auth_hash.clone(),
        ops: diff(chain.current(), &doc),
        authority: None,
        state: document_hash(&doc).expect("hashable"),
        timestamp: T0 + 30,
        nonce: "00".repeat(16),
        key_id: mid,
        signature: String::new(),
    };
    // Ed25519 signatures are deterministic, so the bytes are too.
    let digest = entry.signing_digest().expect("ok");
    entry.signature = URL_SAFE_NO_PAD.encode(master.sign(&digest));
    let mut entries = chain.entries().to_vec();
    entries.push(DidEntry::V2(entry));
    let chain = DidChain::from_entries(entries).expect("shape");
    chain.verify(Some(log.did()), NOW).expect("valid");
    let proof = chain.proof().encode().expect("encodes");
    assert_eq!(
        chain.head_hash(),
        GOLDEN_V2_ENTRY,
        "v2 entry format changed"
    );
    assert_eq!(
        hex::encode(Sha256::digest(&proof)),
        GOLDEN_V2_PROOF,
        "proof format changed"
    );
}

/// Hash of the v2 entry `v2_golden_bytes` builds.
const GOLDEN_V2_ENTRY: &str = "59b5739a8be7e03ba7e247bea9a792e9f098cc5652618350e08b44196f6989ad";
/// SHA-256 of the encoded proof of that chain.
const GOLDEN_V2_PROOF: &str = "00dddec79eebefa301c394f49442ea9b566e117f3dd5f370f03fab955dca5a36";

// Goal: strong removal. The attack of issue 24: the admin revokes the phone;
// a recovery branch forked before the revocation (the phone's stale chain
// handed to a recovering home) wins the fork rule. Whichever side merges
// which, the phone stays out of `current()`, the evidence travels in
// `removal_evidence`, an admin's next entry signs the removal on the
// winner, and only an explicit re-add after that brings the key back.
#[test]
fn a_removal_on_a_losing_branch_stands_on_the_winner() {
    let agent = Agent::new();
    let stale = agent.chain.clone();
    let phone_id = agent.phone_id();
    let phone_pk = agent.phone.public();
    let mut revoked = stale.clone();
    revoked
        .append_document(
            &without_device(stale.current(), &agent.phone),
            &agent.admin,
            &agent.admin_id(),
            T0 + 10,
        )
        .expect("admin revokes the phone");
    // The recovering home: the stale chain plus a recovery-signed entry
    // that lists a new admin device.
    let home = device_key(77);
    let recovered = paired(
        &stale,
        &home,
        &agent.recovery,
        &agent.recovery_id(),
        T0 + 20,
    );
    assert_eq!(
        compare_branches(&recovered, &revoked).expect("same did"),
        Ordering::Greater,
        "the recovery branch wins the fork rule"
    );
    let listed = |c: &DidChain| c.current().find_method(&phone_id).is_some();
    assert!(listed(&recovered), "before it meets the removal");

    // The revoking side adopts the winner and keeps its own branch as evidence.
    let mut a = revoked.clone();
    let outcome = a.merge(&recovered, NOW).expect("merge");
    assert!(matches!(outcome, MergeOutcome::SwitchedFork { .. }));
    assert_eq!(a.head_hash(), recovered.head_hash());
    assert!(
        !listed(&a),
        "the winner lists the phone, the merged view does not"
    );
    assert!(
        a.chain_document().find_method(&phone_id).is_some(),
        "the entries themselves are the winner's"
    );
    assert_eq!(a.standing_removals().len(), 2, "Ed25519 and X25519 keys");
    let evidence = a.removal_evidence();
    assert_eq!(evidence.len(), 1);

    // The winner learns it either by fetching the losing branch...
    let mut b = recovered.clone();
    let outcome = b.merge(&revoked, NOW).expect("merge");
    assert!(
        matches!(outcome, MergeOutcome::NotedRemovals { .. }),
        "{outcome:?}"
    );
    assert!(outcome.changed());
    assert!(!listed(&b));
    // ...or from the evidence of a device that switched already.
    let mut c = recovered.clone();
    let spliced = c
        .splice(&evidence[0])
        .expect("entries parse")
        .expect("connects at the fork");
    assert!(c.merge(&spliced, NOW).expect("merge").changed());
    assert!(!listed(&c));
    assert_eq!(c.current(), b.current());
    // Forged evidence is not evidence.
    let mut forged = evidence[0].clone();
    if let DidEntry::V2(e) = &mut forged[0] {
        e.timestamp += 1;
    }
    let mut d = recovered.clone();
    if let Ok(Some(s)) = d.splice(&forged) {
        let _ = d.merge(&s, NOW);
    }
    assert!(listed(&d), "a forged removal removes nothing");

    // Nothing lost on a round trip through storage; the evidence verifies.
    let json = serde_json::to_vec(&b).expect("encode");
    let back = DidChain::decode_verified(&json, Some(&agent.did()), NOW).expect("decode");
    assert_eq!(back.current(), b.current());
    assert_eq!(back.lost_branches().len(), 1);

    // An admin of the winner signs the removal: the evidence is absorbed.
    let mut signed = b.clone();
    let doc = signed.current().clone();
    signed
        .append_document(&doc, &home, &device_id(signed.chain_document(), &home), NOW)
        .or_else(|_| signed.append_document(&doc, &agent.recovery, &agent.recovery_id(), NOW))
        .expect("an admin signs the removal");
    assert!(signed.chain_document().find_method(&phone_id).is_none());
    assert!(signed.lost_branches().is_empty(), "absorbed");
    // A re-add signed after the removal is a knowing one and stands.
    let readded = paired(
        &signed,
        &agent.phone,
        &agent.recovery,
        &agent.recovery_id(),
        NOW + 1,
    );
    assert!(listed(&readded));
    let mut e = readded.clone();
    e.merge(&revoked, NOW + 2).expect("merge");
    assert!(
        listed(&e),
        "the old removal is absorbed by the one signed after the fork"
    );
    assert!(
        e.current()
            .method_for_public(&phone_pk, Authentication, NOW)
            .is_ok(),
        "and the phone authenticates again"
    );
}
