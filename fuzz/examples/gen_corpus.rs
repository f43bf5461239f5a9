//! Writes the seed corpora in `fuzz/corpus/<target>/`: a handful of small,
//! valid inputs per target, built with the workspace's own encoders and the
//! fixed keys of `nuwa_fuzz`, so that the fuzzer starts from inputs that get
//! past every decoder's first checks.
//!
//! Run from `fuzz/`: `cargo +nightly run --example gen_corpus`. It rewrites
//! the `seed-*` files and leaves other corpus files alone. Seeds that involve
//! randomness (envelope and pairing nonces, SPAKE2 scalars) differ from run
//! to run; any valid instance will do.

use std::fs;
use std::path::{Path, PathBuf};

use nuwa_agent::announce::Announcement;
use nuwa_crypto::epoch::{EpochGrant, x25519_public_key};
use nuwa_crypto::pairing::{Approver, Joiner, JoinerPublicKeys, PairingCode};
use nuwa_crypto::{Envelope, SyncKey, seal};
use nuwa_fuzz::pairing_selector::{APPROVER_CONFIRM, GRANT, JOIN_REQUEST, JOINER_CONFIRM};
use nuwa_fuzz::{
    APPROVER_PEER_ID, CAPS_APP2_SEED, JOINER_PEER_ID, NOW_UNIX_SECS, NOW_UNIX_SECS_U64,
    PAIRING_CODE, STATE_ACTOR, agent_did, caps_app, caps_capability, caps_request_input, device,
    device_context_id, genesis_log, log_with_device, master, populated_container, sync_key,
    txt_bytes,
};
use nuwa_identity::chain::DidChain;
use nuwa_identity::did_key::ed25519_public_multibase;
use nuwa_identity::document::Relationship;
use nuwa_identity::keys::DeviceKey;
use nuwa_identity::log::DidLog;
use nuwa_proto::{
    Ack, ContainerHeads, Frame, Hello, PairingStep, RangeBody, RangePart, SyncPayload,
    length_prefixed,
};
use nuwa_state::{Container, SyncState};
use serde_json::{Value, json};

/// libFuzzer's default `-max_len` is 4096; seeds far above it would be cut.
const MAX_SEED_BYTES: usize = 64 * 1024;

type Result<T> = std::result::Result<T, Box<dyn std::error::Error>>;

struct Corpus {
    root: PathBuf,
}

impl Corpus {
    fn write(&self, target: &str, name: &str, bytes: &[u8]) -> Result<()> {
        if bytes.len() > MAX_SEED_BYTES {
            return Err(format!("seed {target}/{name} is {} bytes", bytes.len()).into());
        }
        let dir = self.root.join(target);
        fs::create_dir_all(&dir)?;
        fs::write(dir.join(format!("seed-{name}")), bytes)?;
        Ok(())
    }
}

fn main() -> Result<()> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("corpus");
    let corpus = Corpus { root };
    frame(&corpus)?;
    envelope(&corpus)?;
    announcement(&corpus)?;
    did_document(&corpus)?;
    did_log(&corpus)?;
    did_chain(&corpus)?;
    did_entries(&corpus)?;
    epoch_grant(&corpus)?;
    pairing(&corpus)?;
    sync_message(&corpus)?;
    asm_schema(&corpus)?;
    caps(&corpus)?;
    println!("seeds written under {}", corpus.root.display());
    Ok(())
}

/// The envelope of `proto/src/tests.rs`'s golden-bytes test.
fn golden_envelope() -> Envelope {
    Envelope {
        sender: "d".into(),
        epoch: 3,
        timestamp_ms: 9,
        nonce: [4; 24],
        ciphertext: vec![5, 6],
        signature: [7; 64],
    }
}

fn frame(c: &Corpus) -> Result<()> {
    let hello = Frame::Hello(Hello {
        protocol_version: 1,
        agent_did: agent_did(),
        context_id: device_context_id(),
        device_name: "laptop".into(),
        did_proof: DidChain::from_v1(&genesis_log())?.proof().encode()?,
        epoch_grant: Vec::new(),
        removal_evidence: Vec::new(),
        timestamp_ms: 7,
        nonce: [1; 16],
        signature: [2; 64],
    });
    let envelope = Frame::Envelope(golden_envelope());
    let pairing = Frame::Pairing {
        step: PairingStep::Abort,
        body: b"wrong_code".to_vec(),
    };
    c.write("frame", "hello", &hello.encode())?;
    c.write("frame", "envelope-golden", &envelope.encode())?;
    c.write("frame", "pairing-abort", &pairing.encode())?;

    let payloads = [
        (
            "payload-sync",
            SyncPayload::Sync {
                container: "c".into(),
                message: vec![1, 2, 3],
            },
        ),
        (
            "payload-delta-golden",
            SyncPayload::Delta {
                container: "c".into(),
                changes: vec![vec![1]],
            },
        ),
        (
            "payload-heads",
            SyncPayload::Heads(vec![ContainerHeads {
                container: "notes".into(),
                heads: vec![[9; 32], [8; 32]],
                changes: 12,
            }]),
        ),
        (
            "payload-digest",
            SyncPayload::Digest {
                fingerprint: [5; 16],
                count: 10_000,
            },
        ),
        (
            "payload-reconcile",
            SyncPayload::Reconcile(vec![
                RangePart {
                    lower: String::new(),
                    upper: Some("m".into()),
                    body: RangeBody::Fingerprint {
                        fingerprint: [6; 16],
                        count: 600,
                    },
                },
                RangePart {
                    lower: "m".into(),
                    upper: None,
                    body: RangeBody::Items(vec![ContainerHeads {
                        container: "notes".into(),
                        heads: vec![[9; 32]],
                        changes: 3,
                    }]),
                },
            ]),
        ),
    ];
    for (name, payload) in payloads {
        c.write("frame", name, &payload.encode())?;
    }
    c.write("frame", "ack-rejected", &Ack::rejected("x").encode())?;

    // A stream of two length-prefixed frames and the start of a third.
    let mut stream = length_prefixed(&envelope.encode())?;
    stream.extend(length_prefixed(&pairing.encode())?);
    stream.extend([0, 0, 0, 9, 0x12]);
    c.write("frame", "stream", &stream)?;
    Ok(())
}

fn envelope(c: &Corpus) -> Result<()> {
    let device = device();
    let did = agent_did();
    let ctx = device_context_id();
    let delta = SyncPayload::Delta {
        container: "notes".into(),
        changes: vec![vec![0x85, 0x6f, 0x4a, 0x83]],
    };
    let cases = [
        ("sealed-delta", sync_key(), delta.encode()),
        (
            "sealed-heads",
            sync_key(),
            SyncPayload::Heads(Vec::new()).encode(),
        ),
        ("sealed-empty", sync_key(), Vec::new()),
        (
            "sealed-epoch-1",
            SyncKey::from_bytes(1, [8; 32]),
            delta.encode(),
        ),
    ];
    for (name, key, plaintext) in cases {
        let env = seal(
            &key,
            device.signing_key(),
            &did,
            &ctx,
            1_750_000_000_000,
            &plaintext,
        )?;
        c.write("envelope", name, &Frame::Envelope(env).encode())?;
    }
    c.write(
        "envelope",
        "golden",
        &Frame::Envelope(golden_envelope()).encode(),
    )?;
    Ok(())
}

fn announcement(c: &Corpus) -> Result<()> {
    let device = device();
    let sign = |msg: &[u8]| device.sign(msg);
    let inline = Announcement::new_signed(
        &agent_did(),
        device_context_id(),
        "12D3KooWDevice",
        4001,
        NOW_UNIX_SECS,
        sign,
    );
    c.write("announcement", "inline-did", &txt_bytes(&inline.to_txt()))?;

    // A DID over 200 bytes is announced by its hash (`didh`).
    let long_did = format!("did:web:{}", "a".repeat(240));
    let hashed = Announcement::new_signed(
        &long_did,
        "key-1",
        "12D3KooWDevice",
        65535,
        0,
        |msg: &[u8]| device.sign(msg),
    );
    c.write("announcement", "did-hash", &txt_bytes(&hashed.to_txt()))?;

    // Upper-case keys and an unknown entry, which the parser must tolerate.
    let mut odd: Vec<(String, String)> = inline
        .to_txt()
        .into_iter()
        .map(|(k, v)| (k.to_uppercase(), v))
        .collect();
    odd.push(("x-extra".into(), "ignored".into()));
    c.write("announcement", "upper-and-extra", &txt_bytes(&odd))?;
    Ok(())
}

fn did_document(c: &Corpus) -> Result<()> {
    let genesis = genesis_log();
    c.write(
        "did_document",
        "genesis",
        &serde_json::to_vec(genesis.current())?,
    )?;
    let with_device = log_with_device();
    c.write(
        "did_document",
        "with-device",
        &serde_json::to_vec_pretty(with_device.current())?,
    )?;

    // Every relationship, an expiring key, an X25519 key and a service.
    let mut doc = with_device.current().clone();
    let third = DeviceKey::from_seed(&[3; 32]);
    doc.add_key(
        "device-expiring",
        &third.public(),
        &[Relationship::Authentication, Relationship::AssertionMethod],
        Some("2030-01-01T00:00:00Z".into()),
    )?;
    doc.add_key_agreement_key(
        &format!("{}-x25519", device_context_id()),
        &x25519_public_key(&device().x25519_secret()),
        None,
    )?;
    doc.service.push(json!({
        "id": format!("{}#sync", agent_did()),
        "type": "NuwaSync",
        "serviceEndpoint": "nuwa:agent-sync"
    }));
    c.write("did_document", "full", &serde_json::to_vec(&doc)?)?;
    Ok(())
}

fn did_log(c: &Corpus) -> Result<()> {
    c.write("did_log", "genesis", &serde_json::to_vec(&genesis_log())?)?;
    let with_device = log_with_device();
    c.write("did_log", "with-device", &serde_json::to_vec(&with_device)?)?;

    // Three updates: the device is then given key agreement by the master.
    let mut longer = with_device.clone();
    let mut doc = longer.current().clone();
    doc.add_key_agreement_key(
        &format!("{}-x25519", device_context_id()),
        &x25519_public_key(&device().x25519_secret()),
        None,
    )?;
    let master_id = ed25519_public_multibase(&master().public());
    longer.append(doc, &master(), &master_id, NOW_UNIX_SECS + 2)?;
    c.write("did_log", "three-updates", &serde_json::to_vec(&longer)?)?;

    // Another agent's genesis, which every merge must refuse.
    let other = DidLog::genesis(&DeviceKey::from_seed(&[9; 32]), NOW_UNIX_SECS)?;
    c.write("did_log", "other-agent", &serde_json::to_vec(&other)?)?;
    Ok(())
}

fn did_chain(c: &Corpus) -> Result<()> {
    // Each chain goes in twice: as chain JSON and as the proof of its head.
    let genesis = DidChain::from_v1(&genesis_log())?;
    c.write("did_chain", "genesis", &serde_json::to_vec(&genesis)?)?;
    c.write("did_chain", "genesis-proof", &genesis.proof().encode()?)?;

    // The migrated two-update log, then a v2 entry: the master makes a
    // second device an admin (an authority entry, so the proof carries it).
    let mut chain = DidChain::from_v1(&log_with_device())?;
    let mut doc = chain.current().clone();
    doc.add_key(
        "admin",
        &DeviceKey::from_seed(&[3; 32]).public(),
        &[
            Relationship::Authentication,
            Relationship::CapabilityDelegation,
        ],
        None,
    )?;
    let master_id = ed25519_public_multibase(&master().public());
    chain.append_document(&doc, &master(), &master_id, NOW_UNIX_SECS + 2)?;
    c.write("did_chain", "v2-entry", &serde_json::to_vec(&chain)?)?;
    c.write("did_chain", "v2-entry-proof", &chain.proof().encode()?)?;
    // The same v2 entry as the page a peer serves to a device that holds
    // the first two entries.
    c.write(
        "did_entries",
        "v2-entry-page",
        &serde_json::to_vec(&chain.entries()[2..])?,
    )?;
    Ok(())
}

fn epoch_grant(c: &Corpus) -> Result<()> {
    let master = master();
    let did = agent_did();
    let device_x = x25519_public_key(&device().x25519_secret());
    let other_x = x25519_public_key(&DeviceKey::from_seed(&[4; 32]).x25519_secret());
    let issuer = ed25519_public_multibase(&master.public());

    let one = EpochGrant::create(
        &SyncKey::from_bytes(1, [11; 32]),
        &[(device_context_id(), device_x)],
        &["device-revoked".to_owned()],
        &issuer,
        master.signing_key(),
        &did,
        NOW_UNIX_SECS_U64,
    )?;
    c.write("epoch_grant", "one-recipient", &one.encode()?)?;

    let two = EpochGrant::create(
        &SyncKey::from_bytes(2, [12; 32]),
        &[
            ("device-other".to_owned(), other_x),
            (device_context_id(), device_x),
        ],
        &[],
        &issuer,
        master.signing_key(),
        &did,
        NOW_UNIX_SECS_U64,
    )?;
    c.write("epoch_grant", "two-recipients", &two.encode()?)?;
    Ok(())
}

fn pairing(c: &Corpus) -> Result<()> {
    let device = device();
    let keys = JoinerPublicKeys {
        ed25519_public: device.public(),
        x25519_public: x25519_public_key(&device.x25519_secret()),
    };
    let mut joiner = Joiner::new(
        PairingCode::parse(PAIRING_CODE)?,
        JOINER_PEER_ID,
        keys,
        "laptop",
    )?;
    let mut approver = Approver::new(
        PairingCode::parse(PAIRING_CODE)?,
        APPROVER_PEER_ID,
        JOINER_PEER_ID,
    )?;
    let request = joiner.start(APPROVER_PEER_ID, NOW_UNIX_SECS_U64)?;
    let approver_confirm = approver.on_join_request(&request, NOW_UNIX_SECS_U64)?;
    let joiner_confirm = joiner.on_approver_confirm(&approver_confirm, NOW_UNIX_SECS_U64)?;
    approver.on_joiner_confirm(&joiner_confirm, NOW_UNIX_SECS_U64)?;
    let grant = approver.grant(b"{\"grant\":\"plaintext\"}")?;

    let messages = [
        ("join-request", JOIN_REQUEST, request.encode()),
        (
            "approver-confirm",
            APPROVER_CONFIRM,
            approver_confirm.encode(),
        ),
        ("joiner-confirm", JOINER_CONFIRM, joiner_confirm.encode()),
        ("grant", GRANT, grant.encode()),
    ];
    for (name, selector, body) in messages {
        let mut bytes = vec![selector];
        bytes.extend(body);
        c.write("pairing", name, &bytes)?;
    }
    for (name, text) in [
        ("code", PAIRING_CODE),
        ("code-lower-spaced", "abcd efgh"),
        ("code-crockford-aliases", "O1IL-0000"),
    ] {
        c.write("pairing", name, text.as_bytes())?;
    }
    Ok(())
}

fn sync_message(c: &Corpus) -> Result<()> {
    // Changes as a peer would push them in a delta.
    let mut source = Container::new(b"nuwa-fuzz-peer");
    let first = source.put("title", &json!("hello"))?;
    let second = source.put("list", &json!([1, {"a": null}]))?;
    for (name, change) in [("change-title", first), ("change-list", second)] {
        if let Some(bytes) = change {
            c.write("sync_message", name, &bytes)?;
        }
    }

    // The messages of one whole sync session between a populated container
    // and an empty one, both ways.
    let mut a = populated_container();
    let mut b = Container::new(STATE_ACTOR);
    let (mut sa, mut sb) = (SyncState::new(), SyncState::new());
    let mut written = 0;
    for round in 0..8 {
        let mut progressed = false;
        if let Some(msg) = a.generate_sync_message(&mut sa) {
            c.write("sync_message", &format!("sync-{round}-a"), &msg)?;
            b.receive_sync_message(&mut sb, &msg)?;
            progressed = true;
            written += 1;
        }
        if let Some(msg) = b.generate_sync_message(&mut sb) {
            c.write("sync_message", &format!("sync-{round}-b"), &msg)?;
            a.receive_sync_message(&mut sa, &msg)?;
            progressed = true;
            written += 1;
        }
        if !progressed {
            break;
        }
    }
    if written == 0 {
        return Err("the sync session produced no messages".into());
    }
    Ok(())
}

fn asm_schema(c: &Corpus) -> Result<()> {
    for (i, raw) in nuwa_asm::schema::core_schemas().iter().enumerate() {
        c.write(
            "asm_schema",
            &format!("core-schema-{i}"),
            &serde_json::to_vec(raw)?,
        )?;
    }
    c.write(
        "asm_schema",
        "example-note-schema",
        &serde_json::to_vec(&nuwa_asm::schema::example_note_schema())?,
    )?;
    let queries: [(&str, Value); 4] = [
        ("query-all", json!({"from": "s"})),
        (
            "query-filter-order",
            json!({"from": "did:nuwa:state:t#v1", "where": {"n": {"$gt": 1}},
                   "order": [{"field": "n", "direction": "desc"}], "limit": 2}),
        ),
        (
            "query-logic",
            json!({"from": "s", "select": ["s", "meta.k"],
                   "where": {"$or": [{"tags": {"$contains": "meeting"}}, {"s": {"$in": ["banana"]}}]},
                   "limit": 1}),
        ),
        (
            "query-cursor-null",
            json!({"from": "s", "where": {"when": {"$gte": "2024-01-01T00:00:00Z"}}, "cursor": null}),
        ),
    ];
    for (name, q) in queries {
        c.write("asm_schema", name, &serde_json::to_vec(&q)?)?;
    }
    let patches: [(&str, Value); 3] = [
        (
            "patch-operators",
            json!({"$inc": {"n": 0.5}, "$push": {"tags": {"$each": ["b", "c"]}}}),
        ),
        (
            "patch-rfc6902",
            json!([{"op": "add", "path": "/tags/-", "value": "b"},
                   {"op": "remove", "path": "/o/a~0b"},
                   {"op": "move", "from": "/o/k", "path": "/k"},
                   {"op": "copy", "from": "/tags", "path": "/o/tags"},
                   {"op": "test", "path": "/n", "value": 1}]),
        ),
        (
            "patch-replace-root",
            json!([{"op": "replace", "path": "", "value": {"id": "n1"}}]),
        ),
    ];
    for (name, p) in patches {
        c.write("asm_schema", name, &serde_json::to_vec(&p)?)?;
    }
    Ok(())
}

fn did_entries(c: &Corpus) -> Result<()> {
    // Pages as a peer serves them: the entry after a genesis-only chain,
    // and the genesis itself (which never splices: seq 0).
    let with_device = nuwa_fuzz::chain_with_device();
    let entries = with_device.entries();
    c.write(
        "did_entries",
        "one-entry",
        &serde_json::to_vec(&entries[1..])?,
    )?;
    c.write("did_entries", "from-genesis", &serde_json::to_vec(entries)?)?;
    c.write("did_entries", "empty", b"[]")?;
    Ok(())
}

/// A capability of each depth the verifier accepts, and signed requests
/// with and without a body.
fn caps(c: &Corpus) -> Result<()> {
    let first = caps_capability();
    let app2 = DeviceKey::from_seed(&CAPS_APP2_SEED);
    let second = nuwa_caps::delegate(
        Some(&first),
        caps_app().signing_key(),
        &nuwa_identity::did_key::did_key_from_ed25519(&app2.public()),
        "did:nuwa:cap:fuzz:state:Item#v1",
        &[nuwa_caps::Action::Read],
        NOW_UNIX_SECS + 3_600,
        NOW_UNIX_SECS - 60,
        "urn:uuid:00000000000000000000000000000002".to_owned(),
    )?;
    c.write("caps_capability", "first-level", &first.to_json())?;
    c.write("caps_capability", "delegated-on", &second.to_json())?;
    c.write(
        "caps_invocation",
        "write-with-body",
        &caps_request_input(&first, br#"{"n":1}"#),
    )?;
    c.write(
        "caps_invocation",
        "write-empty-body",
        &caps_request_input(&first, b""),
    )?;
    Ok(())
}
