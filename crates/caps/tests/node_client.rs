//! The JavaScript client `scripts/app-client/nuwa_app.mjs` against the Rust
//! verifier: Node signs requests and delegates capabilities with its own
//! `crypto` and its own JCS, and nuwa-caps must accept exactly those, byte
//! for byte where the inputs are the same.
//!
//! These tests need `node` (Node.js 18 or later) on PATH and fail without it.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::Command;

use ed25519_dalek::SigningKey;
use nuwa_caps::{
    Action, CapError, Capability, InvocationParams, NonceCache, RequestParts, delegate,
    sign_request, verify, verify_invocation,
};
use nuwa_identity::did_key::did_key_from_ed25519;
use serde_json::{Value, json};

/// 2025-11-27T01:00:00Z.
const NOW: i64 = 1_764_205_200;
const TARGET: &str = "did:nuwa:cap:weather:";
const NARROW_TARGET: &str = "did:nuwa:cap:weather:state:Forecast#v1";
const PATH: &str = "/v1/state/did%3Anuwa%3Acap%3Aweather%3Astate%3AForecast%23v1";
const QUERY: &str = "limit=10&from=a%20b";
const BODY: &str = r#"{"city":"Zürich","temp":21}"#;
const NONCE: &str = "n0nce-from-node_0001";
const NONCE2: &str = "n0nce-from-node_0002";
const CHILD_ID: &str = "urn:uuid:5f0c6a1e-9b7d-4c2a-8e3f-1a2b3c4d5e6f";

/// The script Node runs: it signs a write with the admin's capability,
/// delegates a read-only capability on to a second app key, signs a read
/// with that, and reports what it refused; all as one JSON object.
const SCRIPT: &str = r#"
const { pathToFileURL } = await import('node:url');
const app = await import(pathToFileURL(process.env.NUWA_APP_MJS).href);
const input = JSON.parse(process.env.NUWA_TEST_INPUT);
const seed = (hex) => Buffer.from(hex, 'hex');
const appKey = app.keyFromSeed(seed(input.app_seed));
const app2Key = app.keyFromSeed(seed(input.app2_seed));

const headers = app.signRequest(input.cap, appKey.privateKey, 'post', input.path, input.query,
  input.body, 'write', { createdUnixSecs: input.now, ttlSecs: 60, nonce: input.nonce });

const readOnly = app.delegate(input.cap, appKey.privateKey, {
  invokerDid: app2Key.did, target: input.narrow_target, actions: ['read'],
  expiresUnixSecs: input.now + 3600, nowUnixSecs: input.now, id: input.child_id });
const readHeaders = app.signRequest(readOnly, app2Key.privateKey, 'GET', input.path, '', null,
  'read', { createdUnixSecs: input.now, ttlSecs: 300, nonce: input.nonce2 });

const refusals = {};
const attempt = (name, f) => { try { f(); refusals[name] = null; } catch (e) { refusals[name] = e.message; } };
attempt('widen_actions', () => app.delegate(readOnly, app2Key.privateKey, {
  invokerDid: appKey.did, target: input.narrow_target, actions: ['read', 'write'],
  expiresUnixSecs: input.now + 60, nowUnixSecs: input.now }));
attempt('widen_target', () => app.delegate(readOnly, app2Key.privateKey, {
  invokerDid: appKey.did, target: 'did:nuwa:cap:weather:', actions: ['read'],
  expiresUnixSecs: input.now + 60, nowUnixSecs: input.now }));
attempt('not_the_controller', () => app.delegate(readOnly, appKey.privateKey, {
  invokerDid: appKey.did, target: input.narrow_target, actions: ['read'],
  expiresUnixSecs: input.now + 60, nowUnixSecs: input.now }));
attempt('fraction', () => app.canonicalize({ n: 1.5 }));

process.stdout.write(JSON.stringify({
  app_did: appKey.did,
  headers,
  read_only_jcs: app.canonicalize(readOnly),
  read_headers: readHeaders,
  refusals,
}));
"#;

fn key(seed: u8) -> SigningKey {
    SigningKey::from_bytes(&[seed; 32])
}

fn did(key: &SigningKey) -> String {
    did_key_from_ed25519(&key.verifying_key().to_bytes())
}

fn module_path() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../scripts/app-client/nuwa_app.mjs")
}

/// Runs SCRIPT under Node with `input`, returning its JSON output.
fn run_node(input: &Value) -> Value {
    let output = Command::new("node")
        .args(["--input-type=module", "-e", SCRIPT])
        .env("NUWA_APP_MJS", module_path())
        .env("NUWA_TEST_INPUT", input.to_string())
        .output()
        .unwrap_or_else(|e| {
            panic!(
                "could not run `node` ({e}): these tests check scripts/app-client/nuwa_app.mjs \
                 against the Rust verifier and need Node.js 18 or later on PATH; install it \
                 (for example `apt-get install nodejs`) and rerun"
            )
        });
    assert!(
        output.status.success(),
        "node failed ({}):\n{}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    serde_json::from_slice(&output.stdout).unwrap_or_else(|e| {
        panic!(
            "node printed no JSON ({e}):\n{}",
            String::from_utf8_lossy(&output.stdout)
        )
    })
}

struct Setup {
    admin: SigningKey,
    app: SigningKey,
    app2: SigningKey,
    cap: Capability,
    out: Value,
}

/// The admin delegates read+write on TARGET to the app in Rust; Node does the rest.
fn setup() -> Setup {
    let (admin, app, app2) = (key(1), key(10), key(11));
    let cap = delegate(
        None,
        &admin,
        &did(&app),
        TARGET,
        &[Action::Read, Action::Write],
        NOW + 86_400,
        NOW,
        "urn:uuid:00000000000000000000000000000001".to_owned(),
    )
    .expect("admin delegates");
    let cap_value: Value = serde_json::from_slice(&cap.to_json()).expect("json");
    let out = run_node(&json!({
        "cap": cap_value,
        "app_seed": hex::encode(app.to_bytes()),
        "app2_seed": hex::encode(app2.to_bytes()),
        "now": NOW,
        "nonce": NONCE,
        "nonce2": NONCE2,
        "path": PATH,
        "query": QUERY,
        "body": BODY,
        "narrow_target": NARROW_TARGET,
        "child_id": CHILD_ID,
    }));
    Setup {
        admin,
        app,
        app2,
        cap,
        out,
    }
}

/// Lowercase header name to value, from Node's header object.
fn headers_of(value: &Value) -> BTreeMap<String, String> {
    value
        .as_object()
        .expect("headers object")
        .iter()
        .map(|(k, v)| {
            (
                k.to_ascii_lowercase(),
                v.as_str().expect("string value").to_owned(),
            )
        })
        .collect()
}

fn check(
    s: &Setup,
    method: &str,
    query: &str,
    headers: &BTreeMap<String, String>,
    body: &[u8],
    nonces: &mut NonceCache,
) -> Result<nuwa_caps::Invocation, CapError> {
    let admin = s.admin.verifying_key().to_bytes();
    let req = RequestParts {
        method,
        path: PATH,
        query,
        header: |name: &str| headers.get(name).map(String::as_str),
    };
    verify_invocation(&req, body, NOW + 1, |k| *k == admin, |_| false, nonces)
}

// Goal: a request Node signs is byte-identical to Rust's for the same inputs, verifies, and is refused with another body.
#[test]
fn node_signed_request_verifies() {
    let s = setup();
    assert_eq!(
        s.out["app_did"],
        did(&s.app),
        "didKeyOf agrees with did:key"
    );
    let node = headers_of(&s.out["headers"]);

    let rust = sign_request(
        &s.app,
        "POST",
        PATH,
        QUERY,
        BODY.as_bytes(),
        &InvocationParams {
            capability: &s.cap,
            action: Action::Write,
            created_unix_secs: NOW,
            expires_unix_secs: NOW + 60,
            nonce: NONCE,
        },
    )
    .expect("rust signs");
    for (name, value) in rust.pairs() {
        assert_eq!(node[name], value, "header {name}: Node and Rust differ");
    }

    let mut nonces = NonceCache::new();
    let inv = check(&s, "POST", QUERY, &node, BODY.as_bytes(), &mut nonces).expect("accepted");
    assert_eq!(inv.action, Action::Write);
    assert_eq!(inv.verified.invoker_did, did(&s.app));

    let tampered = BODY.replace("21", "31");
    let err = check(&s, "POST", QUERY, &node, tampered.as_bytes(), &mut nonces)
        .expect_err("tampered body");
    assert_eq!(err, CapError::DigestMismatch);
}

// Goal: a read-only capability Node delegates on from the app's key verifies in Rust (same JCS bytes), its holder's signed read is accepted, and widening is refused by the client.
#[test]
fn node_delegated_read_only_cap_verifies() {
    let s = setup();
    let admin = s.admin.verifying_key().to_bytes();
    let jcs = s.out["read_only_jcs"].as_str().expect("jcs string");

    let verified = verify(jcs.as_bytes(), NOW + 1, |k| *k == admin, |_| false)
        .expect("Node's delegation verifies");
    assert_eq!(verified.invoker_public, s.app2.verifying_key().to_bytes());
    assert_eq!(verified.target, NARROW_TARGET);
    assert_eq!(
        verified.actions.iter().copied().collect::<Vec<_>>(),
        [Action::Read]
    );
    assert_eq!(verified.expires_unix_secs, NOW + 3600);
    assert_eq!(verified.chain_ids.len(), 3);
    assert_eq!(verified.chain_ids[2], CHILD_ID);
    let parsed = Capability::from_json(jcs.as_bytes()).expect("parses");
    assert_eq!(parsed.to_json(), jcs.as_bytes(), "Node's JCS equals Rust's");
    assert_eq!(parsed.parent(), Some(&s.cap));

    // Revoking the admin's capability revokes Node's child too.
    let parent_id = s.cap.id().to_owned();
    let err = verify(
        jcs.as_bytes(),
        NOW + 1,
        |k| *k == admin,
        |id| id == parent_id,
    )
    .expect_err("parent revoked");
    assert_eq!(err.code(), "capability_revoked");

    let read = headers_of(&s.out["read_headers"]);
    let mut nonces = NonceCache::new();
    let inv = check(&s, "GET", "", &read, b"", &mut nonces).expect("app2's read is accepted");
    assert_eq!(inv.action, Action::Read);
    assert_eq!(inv.verified.invoker_did, did(&s.app2));
    let err = check(&s, "GET", "", &read, b"x", &mut NonceCache::new()).expect_err("body");
    assert_eq!(err, CapError::DigestMismatch);
    let err = check(&s, "GET", "", &read, b"", &mut nonces).expect_err("replay");
    assert_eq!(err.code(), "replayed_nonce");

    let refusals = s.out["refusals"].as_object().expect("object");
    for name in [
        "widen_actions",
        "widen_target",
        "not_the_controller",
        "fraction",
    ] {
        assert!(
            refusals[name].is_string(),
            "nuwa_app.mjs did not refuse {name}: {refusals:?}"
        );
    }
}
