use super::*;
use nuwa_crypto::SyncKey;
use nuwa_identity::chain::DidChain;
use nuwa_identity::keys::context_id_for;

const NOW_S: i64 = 1_750_000_100;
const NOW: u64 = NOW_S as u64 * 1000;

fn key(n: u8) -> DeviceKey {
    DeviceKey::from_seed(&[n; 32])
}

fn ctx(dev: &DeviceKey) -> String {
    context_id_for(&dev.public())
}

/// An agent (master `m`) with the devices `devs` listed, then the devices
/// `revoked` removed again.
fn agent(m: u8, devs: &[u8], revoked: &[u8]) -> DidChain {
    let master = key(m);
    let mut log = DidChain::genesis(&master, NOW_S - 100).unwrap();
    let mut t = NOW_S - 99;
    for d in devs {
        let mut doc = log.current().clone();
        doc.add_key(
            &ctx(&key(*d)),
            &key(*d).public(),
            &[Relationship::Authentication],
            None,
        )
        .unwrap();
        let id = log.current().capability_delegation[0].clone();
        log.append_document(&doc, &master, &id, t).unwrap();
        t += 1;
    }
    for d in revoked {
        let mut doc = log.current().clone();
        doc.remove_key(&ctx(&key(*d))).unwrap();
        let id = log.current().capability_delegation[0].clone();
        log.append_document(&doc, &master, &id, t).unwrap();
        t += 1;
    }
    log
}

fn sealed(log: &DidChain, dev: u8, marker: &[u8]) -> Envelope {
    let k = SyncKey::generate(0).unwrap();
    nuwa_crypto::seal(
        &k,
        key(dev).signing_key(),
        log.did(),
        &ctx(&key(dev)),
        NOW,
        marker,
    )
    .unwrap()
}

fn push(log: &DidChain, dev: u8, with_log: bool, envs: Vec<Envelope>) -> KeeperRequest {
    let body = KeeperBody::Push {
        did_proof: if with_log {
            log.proof().encode().unwrap()
        } else {
            Vec::new()
        },
        envelopes: envs,
        replaces_through: 0,
        membership: Default::default(),
    };
    sign_request(&key(dev), &ctx(&key(dev)), log.did(), 7, body, NOW).unwrap()
}

fn pull(log: &DidChain, dev: u8, since: u64, max_bytes: u32) -> KeeperRequest {
    sign_request(
        &key(dev),
        &ctx(&key(dev)),
        log.did(),
        8,
        KeeperBody::Pull {
            since,
            max_bytes,
            have_head: String::new(),
            have_epoch: 0,
        },
        NOW,
    )
    .unwrap()
}

/// A keeper with the default limits over an empty store in memory.
fn open() -> Keeper {
    Keeper::new(Box::new(MemKeeperStore::new()), KeeperConfig::default())
}

/// `k` restarted: a new keeper (no nonces, no counters) over its store.
fn restart(k: Keeper) -> Keeper {
    Keeper::new(k.into_store(), KeeperConfig::default())
}

fn code(r: &KeeperResponse) -> Option<RefusalCode> {
    match r {
        KeeperResponse::Refused { code, .. } => Some(*code),
        _ => None,
    }
}

fn batch(r: KeeperResponse) -> (Vec<(u64, Envelope)>, u64, bool) {
    match r {
        KeeperResponse::Batch {
            entries,
            next,
            more,
            ..
        } => (entries, next, more),
        other => panic!("expected a batch, got {other:?}"),
    }
}

// Goal: what one device pushes, another pulls, in order, by cursor and in
// pages; and it is still there after the keeper restarts over its store.
#[test]
fn push_then_pull_by_cursor_survives_restart() {
    let log = agent(1, &[2, 3], &[]);
    let k = {
        let mut k = open();
        let envs: Vec<Envelope> = (0..10u8).map(|i| sealed(&log, 2, &[i; 100])).collect();
        let r = k.handle(push(&log, 2, true, envs.clone()), NOW);
        assert!(
            matches!(
                r,
                KeeperResponse::Pushed {
                    first_seq: 1,
                    last_seq: 10,
                    used_envelopes: 10,
                    ..
                }
            ),
            "{r:?}"
        );
        let (got, next, more) = batch(k.handle(pull(&log, 3, 0, u32::MAX), NOW));
        assert_eq!(got.len(), 10);
        assert_eq!((next, more), (10, false));
        assert_eq!(got.iter().map(|(_, e)| e.clone()).collect::<Vec<_>>(), envs);
        k
    };
    let mut k = restart(k);
    assert_eq!(k.usage(log.did()).map(|u| u.1), Some(10));
    // Paging: each envelope is ~250 bytes; 600 bytes give two per page.
    let (page, next, more) = batch(k.handle(pull(&log, 3, 4, 600), NOW));
    assert_eq!(page.iter().map(|(s, _)| *s).collect::<Vec<_>>(), vec![5, 6]);
    assert_eq!((next, more), (6, true));
    // A later push continues the sequence, with the log already known.
    let r = k.handle(push(&log, 3, false, vec![sealed(&log, 3, b"x")]), NOW);
    assert!(
        matches!(r, KeeperResponse::Pushed { first_seq: 11, .. }),
        "{r:?}"
    );
}

// Goal: nothing unauthorised is stored or served; each refusal has its own
// code and is counted. Method: one bad request per kind.
#[test]
fn forged_replayed_stale_unknown_and_foreign_are_refused() {
    let mut k = open();
    let log = agent(1, &[2, 3], &[]);
    // Unknown agent without its DID proof.
    let r = k.handle(push(&log, 2, false, vec![sealed(&log, 2, b"a")]), NOW);
    assert_eq!(code(&r), Some(RefusalCode::UnknownAgent));
    // A DID proof that does not verify: its head entry left out.
    let mut proof: serde_json::Value =
        serde_json::from_slice(&log.proof().encode().unwrap()).unwrap();
    proof["entries"].as_array_mut().unwrap().pop();
    let body = KeeperBody::Push {
        did_proof: serde_json::to_vec(&proof).unwrap(),
        envelopes: vec![sealed(&log, 2, b"a")],
        replaces_through: 0,
        membership: Default::default(),
    };
    let req = sign_request(&key(2), &ctx(&key(2)), log.did(), 10, body, NOW).unwrap();
    assert_eq!(code(&k.handle(req, NOW)), Some(RefusalCode::BadLog));
    assert_eq!(k.usage(log.did()), None, "nothing stored");
    // A forged envelope: the signature is over other bytes.
    let mut forged = sealed(&log, 2, b"b");
    forged.ciphertext[0] ^= 1;
    let r = k.handle(
        push(&log, 2, true, vec![sealed(&log, 2, b"ok"), forged]),
        NOW,
    );
    assert_eq!(code(&r), Some(RefusalCode::BadEnvelopeSignature));
    assert_eq!(k.usage(log.did()), None, "all or nothing: nothing stored");
    // A forged request signature.
    let mut req = push(&log, 2, true, vec![sealed(&log, 2, b"c")]);
    req.auth.signature[0] ^= 1;
    assert_eq!(code(&k.handle(req, NOW)), Some(RefusalCode::BadAuth));
    // A good push, then the same request again.
    let req = push(&log, 2, true, vec![sealed(&log, 2, b"d")]);
    assert!(matches!(
        k.handle(req.clone(), NOW),
        KeeperResponse::Pushed { .. }
    ));
    assert_eq!(code(&k.handle(req, NOW)), Some(RefusalCode::Replayed));
    // Stale: signed 11 minutes ago.
    let old = sign_request(
        &key(2),
        &ctx(&key(2)),
        log.did(),
        9,
        KeeperBody::Pull {
            since: 0,
            max_bytes: 1000,
            have_head: String::new(),
            have_epoch: 0,
        },
        NOW - 11 * 60_000,
    )
    .unwrap();
    assert_eq!(code(&k.handle(old, NOW)), Some(RefusalCode::Stale));
    // A key the document does not list.
    assert_eq!(
        code(&k.handle(pull(&log, 5, 0, 1000), NOW)),
        Some(RefusalCode::UnknownKey)
    );
    // An envelope sealed by a device of another agent.
    let other = agent(4, &[6], &[]);
    let r = k.handle(push(&log, 2, false, vec![sealed(&other, 6, b"e")]), NOW);
    assert_eq!(code(&r), Some(RefusalCode::UnknownKey));
    // Another agent's proof under our DID.
    let mut req = push(&other, 6, true, vec![]);
    req.agent_did = log.did().to_owned();
    req.auth.signature = key(6).sign(&request_digest(&req));
    assert_eq!(code(&k.handle(req, NOW)), Some(RefusalCode::ForeignAgent));
    assert_eq!(k.usage(log.did()).map(|u| u.1), Some(1));
    let s = k.stats();
    for c in [
        "unknown_agent",
        "bad_log",
        "bad_envelope_signature",
        "bad_auth",
        "replayed",
        "stale",
        "unknown_key",
        "foreign_agent",
    ] {
        assert!(
            s.refused.get(c).copied().unwrap_or(0) >= 1,
            "{c} counted: {s:?}"
        );
    }
}

// Goal: once the agent's DID document revokes a device, the keeper serves
// it nothing and stores nothing from it. Method: device 3 pulls fine; a push
// carrying the proof that revokes it arrives; its next pull and push are
// refused. A proof carries the current document only, not the history, so
// the keeper tells "revoked" from "unknown" by the proofs it has seen: it
// answers RevokedKey here because the first push carried a proof listing
// device 3, and UnknownKey on a keeper that first met the agent after the
// revocation (checked at the end).
#[test]
fn a_revoked_device_can_neither_pull_nor_push() {
    let mut k = open();
    let before = agent(1, &[2, 3], &[]);
    // The keeper sees a proof that lists device 3 (before the revocation).
    assert!(matches!(
        k.handle(push(&before, 2, true, vec![sealed(&before, 2, b"a")]), NOW),
        KeeperResponse::Pushed { .. }
    ));
    assert!(matches!(
        k.handle(pull(&before, 3, 0, 1000), NOW),
        KeeperResponse::Batch { .. }
    ));
    let mut after = before.clone();
    {
        let master = key(1);
        let mut doc = after.current().clone();
        doc.remove_key(&ctx(&key(3))).unwrap();
        let id = after.current().capability_delegation[0].clone();
        after
            .append_document(&doc, &master, &id, NOW_S - 10)
            .unwrap();
    }
    let r = k.handle(
        push(&after, 2, true, vec![sealed(&after, 2, b"sealed after")]),
        NOW,
    );
    assert!(matches!(r, KeeperResponse::Pushed { .. }), "{r:?}");
    assert_eq!(
        code(&k.handle(pull(&before, 3, 0, 1000), NOW)),
        Some(RefusalCode::RevokedKey)
    );
    let r = k.handle(push(&before, 3, false, vec![sealed(&before, 3, b"b")]), NOW);
    assert_eq!(code(&r), Some(RefusalCode::RevokedKey));
    // Its old proof (a lower head seq) cannot roll the keeper's back either.
    let r = k.handle(push(&before, 3, true, vec![]), NOW);
    assert_eq!(code(&r), Some(RefusalCode::RevokedKey));
    assert!(matches!(
        k.handle(pull(&after, 2, 0, 1000), NOW),
        KeeperResponse::Batch { .. }
    ));

    // A keeper whose first proof of the agent is `after` never saw device 3
    // listed: the same requests are refused, as from an unknown key.
    let mut fresh = open();
    let r = fresh.handle(push(&after, 2, true, vec![]), NOW);
    assert!(matches!(r, KeeperResponse::Pushed { .. }), "{r:?}");
    assert_eq!(
        code(&fresh.handle(pull(&before, 3, 0, 1000), NOW)),
        Some(RefusalCode::UnknownKey)
    );
    // Its old proof, which lists it, is older than the keeper's: not followed.
    let r = fresh.handle(push(&before, 3, true, vec![]), NOW);
    assert_eq!(code(&r), Some(RefusalCode::UnknownKey));
}

// Goal: the keeper follows the proof with the highest head seq, and what it
// learns survives a restart: a newer proof listing a new device lets that
// device in; an older proof carried later changes nothing.
#[test]
fn the_keeper_follows_the_newest_proof() {
    let old = agent(1, &[2], &[]);
    let new = agent_extended(&old, 3);
    let k = {
        let mut k = open();
        let r = k.handle(push(&old, 2, true, vec![sealed(&old, 2, b"a")]), NOW);
        assert!(matches!(r, KeeperResponse::Pushed { .. }), "{r:?}");
        // Device 3 is not in the proof the keeper holds.
        assert_eq!(
            code(&k.handle(pull(&new, 3, 0, 1000), NOW)),
            Some(RefusalCode::UnknownKey)
        );
        let r = k.handle(push(&new, 2, true, vec![]), NOW);
        assert!(matches!(r, KeeperResponse::Pushed { .. }), "{r:?}");
        k
    };
    let mut k = restart(k);
    // An older proof carried afterwards does not replace the newer one.
    let r = k.handle(push_at(&old, 2, true, vec![], NOW + 1), NOW);
    assert!(matches!(r, KeeperResponse::Pushed { .. }), "{r:?}");
    let (got, _, _) = batch(k.handle(pull(&new, 3, 0, 1000), NOW));
    assert_eq!(got.len(), 1);
}

/// `log` with device `dev` listed by its master (seed 1), one update later.
fn agent_extended(log: &DidChain, dev: u8) -> DidChain {
    let mut out = log.clone();
    let mut doc = out.current().clone();
    doc.add_key(
        &ctx(&key(dev)),
        &key(dev).public(),
        &[Relationship::Authentication],
        None,
    )
    .unwrap();
    let id = out.current().capability_delegation[0].clone();
    out.append_document(&doc, &key(1), &id, NOW_S - 5).unwrap();
    out
}

// Goal: one agent's flood cannot take another's room. Method: a small
// quota; agent A fills it and is refused; agent B pushes and pulls as usual.
#[test]
fn a_quota_flood_of_one_agent_leaves_others_alone() {
    let mut k = Keeper::new(
        Box::new(MemKeeperStore::new()),
        KeeperConfig {
            max_envelopes_per_agent: 20,
            ..KeeperConfig::default()
        },
    );
    let a = agent(1, &[2], &[]);
    let b = agent(4, &[5], &[]);
    let mut last = None;
    for i in 0..30u8 {
        last = Some(k.handle(push(&a, 2, i == 0, vec![sealed(&a, 2, &[i])]), NOW));
        if let Some(KeeperResponse::Pushed {
            used_envelopes: 17,
            quota_near,
            ..
        }) = &last
        {
            assert!(quota_near, "over 80 %");
        }
    }
    assert_eq!(
        code(last.as_ref().unwrap()),
        Some(RefusalCode::QuotaExceeded)
    );
    assert_eq!(k.usage(a.did()).map(|u| u.1), Some(20));
    assert!(matches!(
        k.handle(push(&b, 5, true, vec![sealed(&b, 5, b"b")]), NOW),
        KeeperResponse::Pushed { .. }
    ));
    let (got, _, _) = batch(k.handle(pull(&b, 5, 0, 10_000), NOW));
    assert_eq!(got.len(), 1);
}

// Goal: retention drops old envelopes and frees their quota.
#[test]
fn retention_prunes_old_envelopes() {
    let mut k = open();
    let log = agent(1, &[2], &[]);
    assert!(matches!(
        k.handle(push(&log, 2, true, vec![sealed(&log, 2, b"a")]), NOW),
        KeeperResponse::Pushed { .. }
    ));
    assert_eq!(k.prune(NOW + 1000).unwrap(), 0);
    let later = NOW + KeeperConfig::default().retention.as_millis() as u64 + 1;
    assert_eq!(k.prune(later).unwrap(), 1);
    assert_eq!(k.usage(log.did()), Some((0, 0)));
}

// Goal: an oversized push never reaches the keeper: the wire decoder
// refuses more envelopes than a push may carry, and the frame cap bounds
// the bytes. Method: encode a request with one envelope too many and decode
// it as a frame.
#[test]
fn an_oversized_push_is_refused_by_the_decoder() {
    use nuwa_proto::Frame;
    use nuwa_proto::keeper::MAX_PUSH_ENVELOPES;
    let log = agent(1, &[2], &[]);
    let env = sealed(&log, 2, b"x");
    let req = push(&log, 2, true, vec![env; MAX_PUSH_ENVELOPES + 1]);
    let bytes = Frame::KeeperRequest(Box::new(req)).encode();
    let err = Frame::decode(&bytes).unwrap_err().to_string();
    assert!(err.contains("envelopes"), "{err}");
    let ok = push(
        &log,
        2,
        true,
        vec![sealed(&log, 2, b"x"); MAX_PUSH_ENVELOPES],
    );
    assert!(Frame::decode(&Frame::KeeperRequest(Box::new(ok)).encode()).is_ok());
    // Membership is bounded too: too many grants, an oversized or empty
    // grant, or oversized entries.
    let over = |m: Membership| {
        let req = push_membership(&log, 2, m);
        Frame::decode(&Frame::KeeperRequest(Box::new(req)).encode())
            .unwrap_err()
            .to_string()
    };
    let g = grant(&log, 1, 5, &[2]);
    let err = over(Membership {
        did_entries: Vec::new(),
        epoch_grants: vec![g.clone(); MAX_KEEPER_GRANTS + 1],
    });
    assert!(err.contains("grants"), "{err}");
    let err = over(Membership {
        did_entries: Vec::new(),
        epoch_grants: vec![vec![0; nuwa_proto::MAX_EPOCH_GRANT_BYTES + 1]],
    });
    assert!(err.contains("grant"), "{err}");
    let err = over(Membership {
        did_entries: vec![b' '; nuwa_proto::keeper::MAX_KEEPER_CHAIN_BYTES + 1],
        epoch_grants: Vec::new(),
    });
    assert!(err.contains("entries"), "{err}");
    let fine = push_membership(
        &log,
        2,
        Membership {
            did_entries: b"[]".to_vec(),
            epoch_grants: vec![g; MAX_KEEPER_GRANTS],
        },
    );
    assert!(Frame::decode(&Frame::KeeperRequest(Box::new(fine)).encode()).is_ok());
}

// Goal: a compacted snapshot drops what it covers in the same write, frees
// the quota, and cannot claim entries that do not exist yet. Method: ten
// envelopes, then a two-envelope snapshot replacing them; a third device
// pulling from the start gets the snapshot only.
#[test]
fn a_snapshot_replaces_what_it_covers() {
    let mut k = open();
    let log = agent(1, &[2, 3], &[]);
    let envs: Vec<Envelope> = (0..10u8).map(|i| sealed(&log, 2, &[i; 50])).collect();
    assert!(matches!(
        k.handle(push(&log, 2, true, envs), NOW),
        KeeperResponse::Pushed { last_seq: 10, .. }
    ));
    let snapshot = |through: u64| {
        let body = KeeperBody::Push {
            did_proof: Vec::new(),
            envelopes: vec![sealed(&log, 3, b"all of it"), sealed(&log, 3, b"and more")],
            replaces_through: through,
            membership: Default::default(),
        };
        sign_request(&key(3), &ctx(&key(3)), log.did(), 9, body, NOW).unwrap()
    };
    assert_eq!(
        code(&k.handle(snapshot(11), NOW)),
        Some(RefusalCode::Malformed)
    );
    let r = k.handle(snapshot(10), NOW);
    assert!(
        matches!(
            r,
            KeeperResponse::Pushed {
                first_seq: 11,
                last_seq: 12,
                used_envelopes: 2,
                ..
            }
        ),
        "{r:?}"
    );
    let (got, next, more) = batch(k.handle(pull(&log, 2, 0, u32::MAX), NOW));
    assert_eq!(
        got.iter().map(|(s, _)| *s).collect::<Vec<_>>(),
        vec![11, 12]
    );
    assert_eq!((next, more), (12, false));
    assert_eq!(k.stats().envelopes_compacted, 10);
    assert_eq!(
        restart(k).usage(log.did()).map(|u| u.1),
        Some(2),
        "after a restart too"
    );
}

// Goal: what a revoked device could capture from a keeper (its disk, or the
// wire to another device) is of no use to it: after a revocation the
// devices seal under a new epoch, whose key the revoked device never got.
// Method: device 2 pushes one envelope under epoch 0 and one under epoch 1
// (the epoch opened by revoking device 3); device 3 still holds epoch 0's
// key. Everything the keeper serves is fetched as device 2 would get it;
// device 3 opens the epoch-0 envelope (written before its revocation) and
// nothing of epoch 1.
#[test]
fn captured_bytes_sealed_after_a_revocation_do_not_open_for_the_revoked() {
    let mut k = open();
    let log = agent(1, &[2, 3], &[3]);
    let (k0, k1) = (SyncKey::generate(0).unwrap(), SyncKey::generate(1).unwrap());
    let seal = |sk: &SyncKey, text: &[u8]| {
        nuwa_crypto::seal(
            sk,
            key(2).signing_key(),
            log.did(),
            &ctx(&key(2)),
            NOW,
            text,
        )
        .unwrap()
    };
    let before = seal(&k0, b"written before the revocation");
    let after = seal(&k1, b"SECRET written after the revocation");
    assert!(matches!(
        k.handle(push(&log, 2, true, vec![before, after]), NOW),
        KeeperResponse::Pushed { .. }
    ));
    let (got, _, _) = batch(k.handle(pull(&log, 2, 0, u32::MAX), NOW));
    assert_eq!(got.len(), 2);
    let revoked_ring = [&k0];
    let mut opened = Vec::new();
    for (_, env) in &got {
        for ring_key in revoked_ring {
            if let Ok(p) = nuwa_crypto::open(env, ring_key, &key(2).public(), log.did()) {
                opened.push(p.to_vec());
            }
        }
    }
    assert_eq!(opened, vec![b"written before the revocation".to_vec()]);
}

fn push_at(log: &DidChain, dev: u8, with_log: bool, envs: Vec<Envelope>, at: u64) -> KeeperRequest {
    let mut req = push(log, dev, with_log, envs);
    req.auth.timestamp_ms = at;
    req.auth.signature = key(dev).sign(&request_digest(&req));
    req
}

// Goal: a request is never accepted twice, even once the per-device nonce
// cap has pushed its nonce out. Method: a cap of two nonces; one push, two
// pulls, then the first push again.
#[test]
fn a_replay_is_refused_after_its_nonce_was_evicted() {
    let mut k = Keeper::new(
        Box::new(MemKeeperStore::new()),
        KeeperConfig {
            max_nonces_per_signer: 2,
            ..KeeperConfig::default()
        },
    );
    let log = agent(1, &[2], &[]);
    let first = push(&log, 2, true, vec![sealed(&log, 2, b"a")]);
    assert!(matches!(
        k.handle(first.clone(), NOW),
        KeeperResponse::Pushed { .. }
    ));
    for _ in 0..2 {
        let r = k.handle(pull(&log, 2, 0, 1000), NOW);
        assert!(matches!(r, KeeperResponse::Batch { .. }), "{r:?}");
    }
    let r = k.handle(first, NOW + 1000);
    assert_eq!(code(&r), Some(RefusalCode::Replayed), "{r:?}");
    assert_eq!(k.usage(log.did()).map(|u| u.1), Some(1), "no second copy");
}

// Goal: a restart, which forgets nonces, does not let an acknowledged push
// be stored twice; the device's next request, signed later, goes through.
#[test]
fn a_replay_is_refused_after_a_restart() {
    let log = agent(1, &[2, 3], &[]);
    let first = push_at(&log, 2, true, vec![sealed(&log, 2, b"a")], NOW - 5_000);
    let pull_later = pull(&log, 2, 0, 1000);
    let mut k = open();
    assert!(matches!(
        k.handle(first.clone(), NOW - 5_000),
        KeeperResponse::Pushed { .. }
    ));
    let mut k = restart(k);
    let r = k.handle(first, NOW);
    assert_eq!(code(&r), Some(RefusalCode::Replayed), "{r:?}");
    assert_eq!(k.usage(log.did()).map(|u| u.1), Some(1), "no second copy");
    // Signed after the last push: accepted, from either device.
    let r = k.handle(pull_later, NOW);
    assert!(matches!(r, KeeperResponse::Batch { .. }), "{r:?}");
    let r = k.handle(push(&log, 3, false, vec![sealed(&log, 3, b"b")]), NOW);
    assert!(
        matches!(r, KeeperResponse::Pushed { first_seq: 2, .. }),
        "{r:?}"
    );
}

/// A grant of epoch `epoch` for devices `to`, signed by device `by` (1:
/// the master key, which may open epochs).
fn grant(log: &DidChain, by: u8, epoch: u64, to: &[u8]) -> Vec<u8> {
    let recipients: Vec<(String, [u8; 32])> = to
        .iter()
        .map(|d| {
            let public =
                nuwa_identity::did_key::x25519_public_from_ed25519(&key(*d).public()).unwrap();
            (ctx(&key(*d)), public)
        })
        .collect();
    let admin = &log.current().capability_delegation[0];
    let issuer = if by == 1 {
        DidDocument::fragment(admin).to_owned()
    } else {
        ctx(&key(by))
    };
    nuwa_crypto::epoch::EpochGrant::create(
        &SyncKey::generate(epoch).unwrap(),
        &recipients,
        &[],
        &issuer,
        key(by).signing_key(),
        log.did(),
        NOW_S as u64,
    )
    .unwrap()
    .encode()
    .unwrap()
}

fn push_membership(log: &DidChain, dev: u8, membership: Membership) -> KeeperRequest {
    let body = KeeperBody::Push {
        did_proof: log.proof().encode().unwrap(),
        envelopes: Vec::new(),
        replaces_through: 0,
        membership,
    };
    sign_request(&key(dev), &ctx(&key(dev)), log.did(), 9, body, tick()).unwrap()
}

fn pull_membership(log: &DidChain, dev: u8, head: &str, epoch: u64) -> Membership {
    let body = KeeperBody::Pull {
        since: 0,
        max_bytes: 1024,
        have_head: head.to_owned(),
        have_epoch: epoch,
    };
    let req = sign_request(&key(dev), &ctx(&key(dev)), log.did(), 10, body, tick()).unwrap();
    match open_keeper_answer(req) {
        KeeperResponse::Batch { membership, .. } => membership,
        other => panic!("expected a batch, got {other:?}"),
    }
}

thread_local! {
    static KEEPER: std::cell::RefCell<Option<Keeper>> = const { std::cell::RefCell::new(None) };
    static CLOCK: std::cell::Cell<u64> = const { std::cell::Cell::new(NOW) };
}

/// The test's clock, one ms later on every call.
fn tick() -> u64 {
    CLOCK.with(|c| {
        c.set(c.get() + 1);
        c.get()
    })
}

fn open_keeper_answer(req: KeeperRequest) -> KeeperResponse {
    let now = req.auth.timestamp_ms;
    KEEPER.with(|k| k.borrow_mut().as_mut().unwrap().handle(req, now))
}

// Goal: grants travel through the keeper (issue 24). What a push carries of
// the agent's membership is kept only when it checks out against the proof
// the keeper follows (entries ending at its head; grants signed by a key
// that may open epochs), is served to a puller whose head or epoch is
// behind, to nobody who names no head (older devices), and survives a
// restart. Method: a keeper over the memory store, pushes and pulls by
// devices of one agent.
#[test]
fn membership_is_kept_when_it_checks_out_and_served_to_devices_behind() {
    let log = agent(1, &[2, 3], &[]);
    let entries = serde_json::to_vec(&log.entries()[1..]).unwrap();
    let short = agent(1, &[2], &[]);
    let stale_entries = serde_json::to_vec(&short.entries()[1..]).unwrap();
    KEEPER.with(|k| *k.borrow_mut() = Some(open()));
    let good = grant(&log, 1, 5, &[2, 3]);
    let forged = grant(&log, 2, 6, &[2, 3]);
    let r = open_keeper_answer(push_membership(
        &log,
        2,
        Membership {
            did_entries: stale_entries,
            epoch_grants: vec![forged],
        },
    ));
    assert!(matches!(r, KeeperResponse::Pushed { .. }), "{r:?}");
    let r = open_keeper_answer(push_membership(
        &log,
        2,
        Membership {
            did_entries: entries.clone(),
            epoch_grants: vec![good.clone()],
        },
    ));
    assert!(matches!(r, KeeperResponse::Pushed { .. }), "{r:?}");
    KEEPER.with(|k| {
        assert_eq!(k.borrow().as_ref().unwrap().stats().membership_ignored, 2);
    });

    // A device behind gets the chain and the newer grant; the forged grant
    // and the stale entries were never kept.
    let m = pull_membership(&log, 3, "an older head", 0);
    assert_eq!(m.did_entries, entries);
    assert_eq!(m.epoch_grants, vec![good.clone()]);
    // Up to date: nothing. An older device (no head named): nothing.
    assert!(pull_membership(&log, 3, log.head_hash(), 5).is_empty());
    assert!(pull_membership(&log, 3, "", 0).is_empty());
    // Only newer grants; the chain only when the head differs.
    let m = pull_membership(&log, 3, log.head_hash(), 4);
    assert!(m.did_entries.is_empty());
    assert_eq!(m.epoch_grants, vec![good.clone()]);

    // Kept across a restart, and at most MAX_KEEPER_GRANTS, the newest.
    KEEPER.with(|k| {
        let old = k.borrow_mut().take().unwrap();
        *k.borrow_mut() = Some(restart(old));
    });
    let later: Vec<Vec<u8>> = (6..6 + MAX_KEEPER_GRANTS as u64)
        .map(|e| grant(&log, 1, e, &[3]))
        .collect();
    for g in &later {
        let r = open_keeper_answer(push_membership(
            &log,
            3,
            Membership {
                did_entries: Vec::new(),
                epoch_grants: vec![g.clone()],
            },
        ));
        assert!(matches!(r, KeeperResponse::Pushed { .. }), "{r:?}");
    }
    let m = pull_membership(&log, 2, "an older head", 0);
    assert_eq!(m.did_entries, entries, "the chain survived the restart");
    assert_eq!(m.epoch_grants, later, "the newest grants, oldest first");
}

// Goal: a device whose DID entry expired (`--expires`, grace included) is
// refused by the keeper with no revocation, while one whose time still
// runs is served. Method: device 4 listed with `expires` 140 s before
// NOW, device 5 with `expires` 600 s after; both pull and push at NOW.
#[test]
fn an_expired_device_can_neither_pull_nor_push() {
    let mut log = agent(1, &[2], &[]);
    let mut doc = log.current().clone();
    for (d, expires) in [(4u8, "2025-06-15T15:06:00Z"), (5, "2025-06-15T15:18:20Z")] {
        doc.add_key(
            &ctx(&key(d)),
            &key(d).public(),
            &[Relationship::Authentication],
            Some(expires.to_owned()),
        )
        .unwrap();
    }
    let id = log.current().capability_delegation[0].clone();
    log.append_document(&doc, &key(1), &id, NOW_S - 300)
        .unwrap();
    let mut k = open();
    let r = k.handle(push(&log, 2, true, vec![sealed(&log, 2, b"a")]), NOW);
    assert!(matches!(r, KeeperResponse::Pushed { .. }), "{r:?}");
    assert!(matches!(
        k.handle(pull(&log, 5, 0, 1000), NOW),
        KeeperResponse::Batch { .. }
    ));
    assert_eq!(
        code(&k.handle(pull(&log, 4, 0, 1000), NOW)),
        Some(RefusalCode::RevokedKey)
    );
    let r = k.handle(push(&log, 4, false, vec![sealed(&log, 4, b"b")]), NOW);
    assert_eq!(code(&r), Some(RefusalCode::RevokedKey));
}
