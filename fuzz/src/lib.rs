//! Fixed keys, identities and documents shared by the fuzz targets in
//! `fuzz_targets/` and by the seed-corpus generator in `examples/`.
//!
//! Everything here is derived from constants, so every run of a target sees
//! the same world and a crash input replays exactly. The targets decide what
//! to feed to which decoder; this crate only builds the valid counterparts
//! (a key the grant is sealed to, a log the fuzzed log is merged with, ...)
//! and the byte layouts that turn one fuzz input into structured input.
//!
//! The builders panic if a fixture cannot be built: their inputs are
//! constants, so a failure is a bug in this harness (or a changed API), not
//! something a fuzz input can cause.

use nuwa_crypto::SyncKey;
use nuwa_identity::did_key::did_key_from_ed25519;
use nuwa_identity::document::Relationship;
use nuwa_identity::keys::{DeviceKey, context_id_for};
use nuwa_identity::log::DidLog;
use nuwa_state::Container;
use serde_json::{Value, json};

/// The clock every target passes in, in Unix seconds (June 2025).
pub const NOW_UNIX_SECS: i64 = 1_750_000_000;
/// [`NOW_UNIX_SECS`] for the APIs that take an unsigned clock.
pub const NOW_UNIX_SECS_U64: u64 = 1_750_000_000;
/// Seed of the agent's master key (it signs the DID log and epoch grants).
pub const MASTER_SEED: [u8; 32] = [1; 32];
/// Seed of the one operational device (it sends envelopes, receives grants).
pub const DEVICE_SEED: [u8; 32] = [2; 32];
/// The sync key of epoch 0, as the brief fixes it.
pub const SYNC_KEY_BYTES: [u8; 32] = [7; 32];
/// Actor id of every Automerge container the targets build.
pub const STATE_ACTOR: &[u8] = b"nuwa-fuzz-actor";
/// PeerIds used on both sides of pairing (any ASCII alphanumerics pass).
pub const APPROVER_PEER_ID: &str = "12D3KooWApprover";
/// See [`APPROVER_PEER_ID`].
pub const JOINER_PEER_ID: &str = "12D3KooWJoiner";
/// The pairing code both sides of the seed exchange typed.
pub const PAIRING_CODE: &str = "ABCD-EFGH";

/// The agent's master key.
pub fn master() -> DeviceKey {
    DeviceKey::from_seed(&MASTER_SEED)
}

/// The operational device's key.
pub fn device() -> DeviceKey {
    DeviceKey::from_seed(&DEVICE_SEED)
}

/// The agent DID: the did:key of [`master`].
pub fn agent_did() -> String {
    did_key_from_ed25519(&master().public())
}

/// The device's context id (DID URL fragment), as the node derives it.
pub fn device_context_id() -> String {
    context_id_for(&device().public())
}

/// The sync key of epoch 0.
pub fn sync_key() -> SyncKey {
    SyncKey::from_bytes(0, SYNC_KEY_BYTES)
}

/// A valid one-update DID log: the genesis of [`master`].
pub fn genesis_log() -> DidLog {
    // Constant inputs: a failure here is a harness bug, not a finding.
    DidLog::genesis(&master(), NOW_UNIX_SECS).expect("genesis of a fixed key")
}

/// A valid two-update DID log: [`genesis_log`] plus [`device`] added for
/// authentication, signed by the master key.
pub fn log_with_device() -> DidLog {
    let master = master();
    let device = device();
    let mut log = genesis_log();
    let mut doc = log.current().clone();
    doc.add_key(
        &device_context_id(),
        &device.public(),
        &[Relationship::Authentication],
        None,
    )
    .expect("add a fixed key to a fixed document");
    let master_id = nuwa_identity::did_key::ed25519_public_multibase(&master.public());
    log.append(doc, &master, &master_id, NOW_UNIX_SECS + 1)
        .expect("master signs a fixed update");
    log
}

/// A small container with a few entries of different JSON shapes, so that
/// fuzzed sync messages and changes meet existing history.
pub fn populated_container() -> Container {
    let mut c = Container::new(STATE_ACTOR);
    for (key, value) in [
        ("name", json!("fuzz")),
        ("count", json!(3)),
        ("tags", json!(["a", "b"])),
        ("nested", json!({"k": {"deep": true}, "n": null})),
    ] {
        c.put(key, &value)
            .expect("put fixed json into a fixed container");
    }
    c
}

/// The items the `asm_schema` target runs queries over: mixed types,
/// missing fields and nested objects (after `nuwa-asm`'s own query tests).
pub fn query_items() -> Vec<(String, Value)> {
    vec![
        (
            "a".into(),
            json!({"n": 1, "s": "apple", "tags": ["x", "meeting"], "meta": {"k": 1}, "flag": true,
                   "when": "2024-01-02T00:00:00Z", "nul": null}),
        ),
        (
            "b".into(),
            json!({"n": 2.0, "s": "banana", "tags": ["y"], "meta": {"k": 2}, "flag": false,
                   "when": "2024-01-10T00:00:00Z"}),
        ),
        (
            "c".into(),
            json!({"n": "3", "s": "cherry", "tags": [], "meta": {"k": [1, 2]}}),
        ),
        (
            "d".into(),
            json!({"n": 1.5, "s": ["apple"], "meta": {"k": {"z": 1}}}),
        ),
        ("e".into(), json!({})),
        ("f".into(), json!({"id": "zzz", "n": -1, "s": "apple pie"})),
    ]
}

/// The current object every fuzzed patch is applied to.
pub fn patch_base() -> Value {
    json!({"id": "n1", "n": 1, "tags": ["a"], "o": {"k": "v", "a~b": 1, "c/d": 2}, "l": [[1], {"x": []}]})
}

/// Splits a fuzz input into TXT record entries: entries are separated by
/// `0x00`, and each entry's key is what comes before its first `=` (read as
/// lossy UTF-8, since DNS-SD keys are text) and its value the raw bytes after
/// it. An entry without `=` is a key with an empty value.
pub fn txt_pairs(data: &[u8]) -> Vec<(String, Vec<u8>)> {
    data.split(|b| *b == 0)
        .map(|entry| match entry.iter().position(|b| *b == b'=') {
            Some(eq) => (
                String::from_utf8_lossy(&entry[..eq]).into_owned(),
                entry[eq + 1..].to_vec(),
            ),
            None => (String::from_utf8_lossy(entry).into_owned(), Vec::new()),
        })
        .collect()
}

/// The inverse of [`txt_pairs`], for writing seeds.
pub fn txt_bytes(pairs: &[(String, String)]) -> Vec<u8> {
    let mut out = Vec::new();
    for (i, (key, value)) in pairs.iter().enumerate() {
        if i > 0 {
            out.push(0);
        }
        out.extend_from_slice(key.as_bytes());
        out.push(b'=');
        out.extend_from_slice(value.as_bytes());
    }
    out
}

/// The first byte of a `pairing` input selects the message decoder; the rest
/// is the message. These are the selector values, in protocol order.
pub mod pairing_selector {
    pub const JOIN_REQUEST: u8 = 0;
    pub const APPROVER_CONFIRM: u8 = 1;
    pub const JOINER_CONFIRM: u8 = 2;
    pub const GRANT: u8 = 3;
}

/// [`log_with_device`] as the DID chain a node holds (same entries and hashes).
pub fn chain_with_device() -> nuwa_identity::chain::DidChain {
    nuwa_identity::chain::DidChain::from_v1(&log_with_device()).expect("a valid v1 log converts")
}

/// Seed of the app key that holds the capability of the `caps_*` targets
/// ([`master`] is the agent's admin that delegated it).
pub const CAPS_APP_SEED: [u8; 32] = [3; 32];
/// Seed of a second app key, to which the app delegates on.
pub const CAPS_APP2_SEED: [u8; 32] = [4; 32];
/// The request path the `caps_invocation` target verifies against.
pub const CAPS_PATH: &str = "/v1/state/did%3Anuwa%3Acap%3Afuzz%3Astate%3AItem%23v1";
/// The nonce of the seed request.
pub const CAPS_NONCE: &str = "fuzz-nonce-000000000000";
/// The request headers the `caps_invocation` input holds, in order, separated by `0x00`
/// (the body follows the last one).
pub const CAPS_HEADERS: [&str; 4] = [
    "capability-invocation",
    "content-digest",
    "signature-input",
    "signature",
];

/// The app key of the `caps_*` targets.
pub fn caps_app() -> DeviceKey {
    DeviceKey::from_seed(&CAPS_APP_SEED)
}

/// A capability [`master`] delegated to [`caps_app`]: read and write on
/// `did:nuwa:cap:fuzz:`, valid from an hour before [`NOW_UNIX_SECS`] for a day.
pub fn caps_capability() -> nuwa_caps::Capability {
    nuwa_caps::delegate(
        None,
        master().signing_key(),
        &did_key_from_ed25519(&caps_app().public()),
        "did:nuwa:cap:fuzz:",
        &[nuwa_caps::Action::Read, nuwa_caps::Action::Write],
        NOW_UNIX_SECS + 86_400,
        NOW_UNIX_SECS - 3_600,
        "urn:uuid:00000000000000000000000000000001".to_owned(),
    )
    .expect("fixture capability")
}

/// A `caps_invocation` input: the headers of a write by [`caps_app`],
/// signed at [`NOW_UNIX_SECS`], in [`CAPS_HEADERS`] order, then `body`.
pub fn caps_request_input(cap: &nuwa_caps::Capability, body: &[u8]) -> Vec<u8> {
    let headers = nuwa_caps::sign_request(
        caps_app().signing_key(),
        "POST",
        CAPS_PATH,
        "",
        body,
        &nuwa_caps::InvocationParams {
            capability: cap,
            action: nuwa_caps::Action::Write,
            created_unix_secs: NOW_UNIX_SECS,
            expires_unix_secs: NOW_UNIX_SECS + 60,
            nonce: CAPS_NONCE,
        },
    )
    .expect("fixture request");
    let mut out = Vec::new();
    for (_, value) in headers.pairs() {
        out.extend_from_slice(value.as_bytes());
        out.push(0);
    }
    out.extend_from_slice(body);
    out
}
