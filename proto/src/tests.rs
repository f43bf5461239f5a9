//! Round trips, golden bytes and rejection of malformed or oversized input.

use super::*;

fn sample_hello() -> Hello {
    Hello {
        protocol_version: 1,
        agent_did: "did:key:z6Mk".into(),
        context_id: "device-abc".into(),
        device_name: "laptop".into(),
        did_proof: b"{}".to_vec(),
        epoch_grant: Vec::new(),
        removal_evidence: Vec::new(),
        timestamp_ms: 7,
        nonce: [1; 16],
        signature: [2; 64],
    }
}

fn sample_envelope() -> Envelope {
    Envelope {
        sender: "d".into(),
        epoch: 3,
        timestamp_ms: 9,
        nonce: [4; 24],
        ciphertext: vec![5, 6],
        signature: [7; 64],
    }
}

// Goal: each message kind survives encode → decode unchanged.
#[test]
fn round_trips() {
    for frame in [
        Frame::Hello(sample_hello()),
        Frame::Envelope(sample_envelope()),
    ] {
        assert_eq!(Frame::decode(&frame.encode()).unwrap(), frame);
    }
    for payload in [
        SyncPayload::Sync {
            container: "c".into(),
            message: vec![1, 2, 3],
        },
        SyncPayload::Delta {
            container: "c".into(),
            changes: vec![vec![1], vec![2, 3]],
        },
        SyncPayload::Heads(vec![ContainerHeads {
            container: "c".into(),
            heads: vec![[9; 32]],
            changes: 7,
        }]),
        SyncPayload::Digest {
            fingerprint: [3; 16],
            count: 10_000,
        },
        SyncPayload::Deltas(vec![
            ("a".into(), vec![vec![1], vec![2]]),
            ("b".into(), vec![vec![3]]),
        ]),
        SyncPayload::Reconcile(vec![
            RangePart {
                lower: String::new(),
                upper: Some("m".into()),
                body: RangeBody::Fingerprint {
                    fingerprint: [1; 16],
                    count: 600,
                },
            },
            RangePart {
                lower: "m".into(),
                upper: None,
                body: RangeBody::Items(vec![ContainerHeads {
                    container: "notes".into(),
                    heads: vec![[2; 32], [4; 32]],
                    changes: 0,
                }]),
            },
        ]),
    ] {
        assert_eq!(SyncPayload::decode(&payload.encode()).unwrap(), payload);
    }
    for ack in [Ack::ok(), Ack::rejected("no")] {
        assert_eq!(Ack::decode(&ack.encode()).unwrap(), ack);
    }
}

// Goal: the wire encoding is stable; a change to field numbers or types breaks
// this test on purpose (golden bytes, written by hand from sync.proto).
#[test]
fn golden_bytes() {
    let env = Frame::Envelope(Envelope {
        sender: "d".into(),
        epoch: 3,
        timestamp_ms: 9,
        nonce: [4; 24],
        ciphertext: vec![5, 6],
        signature: [7; 64],
    });
    let mut want = vec![0x12, 0x67]; // field 2 (envelope), length 103
    want.extend([0x0a, 0x01, b'd']); // sender
    want.extend([0x10, 0x03]); // epoch
    want.extend([0x18, 0x09]); // timestamp_ms
    want.extend([0x22, 24]);
    want.extend([4; 24]);
    want.extend([0x2a, 2, 5, 6]);
    want.extend([0x32, 64]);
    want.extend([7; 64]);
    assert_eq!(env.encode(), want);

    let delta = SyncPayload::Delta {
        container: "c".into(),
        changes: vec![vec![1]],
    };
    assert_eq!(
        delta.encode(),
        vec![0x12, 0x06, 0x0a, 0x01, b'c', 0x12, 0x01, 0x01]
    );
    assert_eq!(
        Ack::rejected("x").encode(),
        vec![0x08, 0x01, 0x12, 0x01, b'x']
    );
    assert_eq!(Ack::ok().encode(), Vec::<u8>::new());
}

fn expect_err<T: std::fmt::Debug>(r: Result<T, WireError>, needle: &str) {
    match r {
        Ok(v) => panic!("expected an error containing {needle:?}, got {v:?}"),
        Err(e) => assert!(
            e.to_string().contains(needle),
            "error {e:?} does not mention {needle:?}"
        ),
    }
}

// Goal: malformed, truncated and out-of-bounds input is refused with a typed
// error that names what was wrong, and never panics.
#[test]
fn rejects_bad_input() {
    expect_err(Frame::decode(&[0xff, 0xff]), "malformed protobuf");
    expect_err(Frame::decode(&[]), "no message kind");
    let mut h = sample_hello();
    let mut body = Frame::Hello(h.clone()).encode();
    body.truncate(body.len() - 3);
    expect_err(Frame::decode(&body), "malformed protobuf");
    // wrong nonce length
    let bad = pb::Frame {
        kind: Some(pb::frame::Kind::Envelope(pb::Envelope {
            sender: "d".into(),
            nonce: vec![0; 12],
            signature: vec![0; 64],
            ..Default::default()
        })),
    };
    expect_err(Frame::decode(&bad.encode_to_vec()), "envelope nonce");
    h.agent_did = String::new();
    expect_err(Frame::decode(&Frame::Hello(h).encode()), "hello agent did");
    let long = "x".repeat(MAX_CONTAINER_NAME_BYTES + 1);
    expect_err(
        SyncPayload::decode(
            &SyncPayload::Delta {
                container: long,
                changes: vec![vec![1]],
            }
            .encode(),
        ),
        "container name",
    );
    let bad_hash = pb::SyncPayload {
        kind: Some(pb::sync_payload::Kind::Heads(pb::HeadsSummary {
            containers: vec![pb::ContainerHeads {
                container: "c".into(),
                heads: vec![vec![0; 31]],
                changes: 0,
            }],
        })),
    };
    expect_err(
        SyncPayload::decode(&bad_hash.encode_to_vec()),
        "change hash",
    );
}

// Goal: a multi-container delta is bounded like a single one (changes
// counted across containers), names no container twice, and has no empty
// change or bad name.
#[test]
fn rejects_bad_deltas() {
    let of = |deltas: Vec<(&str, Vec<Vec<u8>>)>| {
        pb::SyncPayload {
            kind: Some(pb::sync_payload::Kind::Deltas(pb::Deltas {
                deltas: deltas
                    .into_iter()
                    .map(|(c, changes)| pb::Delta {
                        container: c.into(),
                        changes,
                    })
                    .collect(),
            })),
        }
        .encode_to_vec()
    };
    expect_err(
        SyncPayload::decode(&of(vec![("a", vec![vec![1]]), ("a", vec![vec![2]])])),
        "listed twice",
    );
    expect_err(
        SyncPayload::decode(&of(vec![("a", vec![vec![]])])),
        "empty change",
    );
    expect_err(
        SyncPayload::decode(&of(vec![("", vec![vec![1]])])),
        "container name",
    );
    let half = vec![vec![1u8]; MAX_CHANGES_PER_DELTA / 2 + 1];
    expect_err(
        SyncPayload::decode(&of(vec![("a", half.clone()), ("b", half)])),
        "changes, max",
    );
}

fn reconcile_of(parts: Vec<pb::RangePart>) -> Vec<u8> {
    pb::SyncPayload {
        kind: Some(pb::sync_payload::Kind::Reconcile(pb::Reconcile { parts })),
    }
    .encode_to_vec()
}

fn items_part(lower: &str, upper: &str, names: &[&str]) -> pb::RangePart {
    pb::RangePart {
        lower: lower.into(),
        upper: upper.into(),
        unbounded: upper.is_empty(),
        body: Some(pb::range_part::Body::Items(pb::RangeItems {
            items: names
                .iter()
                .map(|n| pb::ContainerHeads {
                    container: (*n).into(),
                    heads: vec![vec![0; 32]],
                    changes: 0,
                })
                .collect(),
        })),
    }
}

// Goal: a reconciliation message is bounded and self-consistent: digests
// and range fingerprints have their exact length, ranges are not empty or
// inverted, items lie inside their range, and parts and items are capped.
#[test]
fn rejects_bad_reconciliation() {
    let digest = pb::SyncPayload {
        kind: Some(pb::sync_payload::Kind::Digest(pb::Digest {
            fingerprint: vec![0; 32],
            count: 1,
        })),
    };
    expect_err(
        SyncPayload::decode(&digest.encode_to_vec()),
        "digest fingerprint",
    );
    expect_err(
        SyncPayload::decode(&reconcile_of(vec![items_part("b", "a", &[])])),
        "upper bound not above",
    );
    expect_err(
        SyncPayload::decode(&reconcile_of(vec![items_part("b", "b", &[])])),
        "upper bound not above",
    );
    expect_err(
        SyncPayload::decode(&reconcile_of(vec![items_part("b", "d", &["a"])])),
        "outside the range",
    );
    expect_err(
        SyncPayload::decode(&reconcile_of(vec![items_part("b", "d", &["d"])])),
        "outside the range",
    );
    // An unbounded range takes anything from its lower bound on.
    assert!(SyncPayload::decode(&reconcile_of(vec![items_part("b", "", &["zzz"])])).is_ok());
    let no_body = pb::RangePart {
        lower: String::new(),
        upper: String::new(),
        unbounded: true,
        body: None,
    };
    expect_err(SyncPayload::decode(&reconcile_of(vec![no_body])), "no body");
    let many = vec![items_part("", "", &[]); MAX_RANGE_PARTS + 1];
    expect_err(SyncPayload::decode(&reconcile_of(many)), "parts, max");
    // Items are capped across parts, not only per part.
    let names: Vec<String> = (0..MAX_CONTAINERS_PER_SUMMARY / 2 + 1)
        .map(|i| format!("c{i:05}"))
        .collect();
    let refs: Vec<&str> = names.iter().map(String::as_str).collect();
    let twice = vec![items_part("", "", &refs), items_part("", "", &refs)];
    expect_err(SyncPayload::decode(&reconcile_of(twice)), "items");
    let long = "x".repeat(MAX_CONTAINER_NAME_BYTES + 1);
    expect_err(
        SyncPayload::decode(&reconcile_of(vec![items_part(&long, "", &[])])),
        "range bound",
    );
}

// Goal: a frame whose declared length exceeds the cap is refused from its
// prefix alone, before any body is buffered.
#[test]
fn oversize_frame_is_refused() {
    let mut prefix = ((MAX_FRAME_BYTES + 1) as u32).to_be_bytes().to_vec();
    prefix.extend([0u8; 8]);
    expect_err(split_frame(&prefix), "exceeds the cap");
    expect_err(
        length_prefixed(&vec![0; MAX_FRAME_BYTES + 1]),
        "exceeds the cap",
    );
    expect_err(
        Frame::decode(&vec![0; MAX_FRAME_BYTES + 1]),
        "exceeds the cap",
    );
    let ok = length_prefixed(b"abc").unwrap();
    assert_eq!(split_frame(&ok).unwrap(), Some((&b"abc"[..], &[][..])));
    assert_eq!(split_frame(&ok[..5]).unwrap(), None);
}

// Goal: pairing steps and a Hello carrying an epoch grant round-trip, and
// oversized or unknown pairing input is refused with a typed error.
#[test]
fn pairing_frames_and_epoch_grants() {
    for step in [
        PairingStep::Offer,
        PairingStep::JoinRequest,
        PairingStep::ApproverConfirm,
        PairingStep::JoinerConfirm,
        PairingStep::Grant,
        PairingStep::Done,
        PairingStep::Abort,
    ] {
        let f = Frame::Pairing {
            step,
            body: vec![9; 40],
        };
        assert_eq!(Frame::decode(&f.encode()).unwrap(), f);
    }
    let mut h = sample_hello();
    h.epoch_grant = vec![3; 100];
    let f = Frame::Hello(h.clone());
    assert_eq!(Frame::decode(&f.encode()).unwrap(), f);
    // The grant is covered by the Hello signature.
    assert_ne!(h.signing_content(), sample_hello().signing_content());

    h.epoch_grant = vec![0; MAX_EPOCH_GRANT_BYTES + 1];
    let err = Frame::decode(&Frame::Hello(h).encode()).unwrap_err();
    assert!(err.to_string().contains("epoch grant"), "{err}");

    let big = Frame::Pairing {
        step: PairingStep::Grant,
        body: vec![0; MAX_PAIRING_BODY_BYTES + 1],
    };
    let err = Frame::decode(&big.encode()).unwrap_err();
    assert!(err.to_string().contains("pairing body"), "{err}");

    let unknown = pb::Frame {
        kind: Some(pb::frame::Kind::Pairing(pb::Pairing {
            step: 42,
            body: vec![],
        })),
    }
    .encode_to_vec();
    let err = Frame::decode(&unknown).unwrap_err();
    assert!(err.to_string().contains("unknown step 42"), "{err}");
}

// Goal: the DID entries request and page survive a round trip, and a page
// over its bound (or a Hello proof over its bound) is refused before use.
#[test]
fn did_entries_frames() {
    for frame in [
        Frame::DidEntriesRequest { from_seq: 17 },
        Frame::DidEntries {
            from_seq: 17,
            entries_json: b"[{}]".to_vec(),
            more: true,
        },
    ] {
        assert_eq!(Frame::decode(&frame.encode()).unwrap(), frame);
    }
    let big = Frame::DidEntries {
        from_seq: 1,
        entries_json: vec![b' '; MAX_DID_ENTRIES_BYTES + 1],
        more: false,
    };
    expect_err(Frame::decode(&big.encode()), "did entries");
    let mut hello = sample_hello();
    hello.did_proof = vec![b' '; MAX_DID_PROOF_BYTES + 1];
    expect_err(
        Frame::decode(&Frame::Hello(hello).encode()),
        "hello did proof",
    );
}
