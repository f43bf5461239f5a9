//! The test vector of docs/api.md ("Test vector"), checked against the
//! code: the capabilities its seeds and times delegate, the signature base
//! built by the rules the docs state, and the headers and signature
//! `sign_request` makes, which the verifier accepts. A third party checks
//! its client against the same text.
//!
//! With `NUWA_PRINT_VECTOR=1` the test prints the blocks it computed (to
//! write the docs when the format changes on purpose).

use std::collections::BTreeMap;

use base64::Engine;
use base64::engine::general_purpose::STANDARD;
use ed25519_dalek::{Signature, SigningKey, VerifyingKey};
use nuwa_caps::{
    Action, Capability, InvocationParams, NonceCache, RequestParts, delegate, sign_request,
    verify_invocation,
};
use nuwa_identity::did_key::did_key_from_ed25519;
use serde_json::Value;

const DOCS: &str = include_str!("../../../docs/api.md");

/// The body of the fenced block whose info string is `info`.
fn block(info: &str) -> String {
    let open = format!("```{info}\n");
    let start = DOCS
        .find(&open)
        .unwrap_or_else(|| panic!("docs/api.md has no ```{info} block"))
        + open.len();
    let len = DOCS[start..].find("\n```").expect("the block is closed");
    DOCS[start..start + len].to_owned()
}

/// The `name: value` lines of the vector's inputs.
fn inputs() -> BTreeMap<String, String> {
    block("text vector-inputs")
        .lines()
        .filter_map(|l| l.split_once(": "))
        .map(|(k, v)| (k.trim().to_owned(), v.trim().to_owned()))
        .collect()
}

fn seed(hex_text: &str) -> SigningKey {
    let bytes: [u8; 32] = hex::decode(hex_text)
        .expect("a seed is hex")
        .try_into()
        .expect("a seed is 32 bytes");
    SigningKey::from_bytes(&bytes)
}

fn actions(text: &str) -> Vec<Action> {
    text.split(' ')
        .map(|a| Action::parse(a).expect("an action"))
        .collect()
}

fn int(v: &BTreeMap<String, String>, key: &str) -> i64 {
    v[key]
        .parse()
        .unwrap_or_else(|_| panic!("{key} is an integer"))
}

/// The signature base by the rules docs/api.md states, from the headers.
fn base_by_the_rules(method: &str, path: &str, query: &str, headers: &[(&str, &str)]) -> String {
    let get = |name: &str| headers.iter().find(|(n, _)| *n == name).unwrap().1;
    let params = get("signature-input").strip_prefix("sig1=").unwrap();
    [
        format!("\"@method\": {}", method.to_ascii_uppercase()),
        format!("\"@path\": {path}"),
        format!("\"@query\": ?{query}"),
        format!("\"content-digest\": {}", get("content-digest")),
        format!(
            "\"capability-invocation\": {}",
            get("capability-invocation")
        ),
        format!("\"@signature-params\": {params}"),
    ]
    .join("\n")
}

// Goal: issue 41 finding 6: the docs' test vector is what the code makes
// and accepts. Method: rebuild the vector's two delegations and its signed
// request from the docs' inputs; compare with the docs' capability,
// signature base and headers; verify the docs' signature over the docs'
// base, and the docs' headers with the verifier.
#[test]
fn the_docs_test_vector_is_what_the_code_makes_and_accepts() {
    let v = inputs();
    let (admin, app, app2) = (
        seed(&v["admin seed"]),
        seed(&v["app seed"]),
        seed(&v["second app seed"]),
    );
    let did = |k: &SigningKey| did_key_from_ed25519(&k.verifying_key().to_bytes());
    let created = int(&v, "delegated at");
    let first = delegate(
        None,
        &admin,
        &did(&app),
        &v["first target"],
        &actions(&v["first actions"]),
        int(&v, "first expires"),
        created,
        v["first id"].clone(),
    )
    .expect("the admin delegates");
    let second = delegate(
        Some(&first),
        &app,
        &did(&app2),
        &v["second target"],
        &actions(&v["second actions"]),
        int(&v, "second expires"),
        created,
        v["second id"].clone(),
    )
    .expect("the app delegates on");
    let (method, path, body) = (&v["method"], &v["path"], v["body"].as_bytes());
    let query = v.get("query").map(String::as_str).unwrap_or("");
    let query = if query == "(none)" { "" } else { query };
    let headers = sign_request(
        &app2,
        method,
        path,
        query,
        body,
        &InvocationParams {
            capability: &second,
            action: Action::parse(&v["action"]).expect("an action"),
            created_unix_secs: int(&v, "created"),
            expires_unix_secs: int(&v, "expires"),
            nonce: &v["nonce"],
        },
    )
    .expect("the second app signs");
    let base = base_by_the_rules(method, path, query, &headers.pairs());
    let header_text: String = headers
        .pairs()
        .iter()
        .map(|(name, value)| format!("{}: {value}", display_name(name)))
        .collect::<Vec<_>>()
        .join("\n");
    let cap_pretty =
        serde_json::to_string_pretty(&serde_json::from_slice::<Value>(&second.to_json()).unwrap())
            .unwrap();
    if std::env::var_os("NUWA_PRINT_VECTOR").is_some() {
        println!(
            "```json vector-capability\n{cap_pretty}\n```\n\n```text vector-base\n{base}\n```\n\n```text vector-headers\n{header_text}\n```"
        );
    }

    // The capability: the same JSON, and its JCS form is what the header carries.
    let in_docs: Value = serde_json::from_str(&block("json vector-capability")).unwrap();
    let made: Value = serde_json::from_slice(&second.to_json()).unwrap();
    assert_eq!(in_docs, made, "the docs' delegated capability");
    let parsed = Capability::from_json(block("json vector-capability").as_bytes()).unwrap();
    assert_eq!(parsed.to_json(), second.to_json());
    assert_eq!(block("text vector-base"), base, "the docs' signature base");
    assert_eq!(
        block("text vector-headers"),
        header_text,
        "the docs' headers"
    );

    // The docs' signature verifies over the docs' base with the second app's key.
    let docs_headers: BTreeMap<String, String> = block("text vector-headers")
        .lines()
        .map(|l| {
            let (k, v) = l.split_once(": ").unwrap();
            (k.to_ascii_lowercase(), v.to_owned())
        })
        .collect();
    let sig = docs_headers["signature"]
        .strip_prefix("sig1=:")
        .and_then(|s| s.strip_suffix(':'))
        .unwrap();
    let sig: [u8; 64] = STANDARD.decode(sig).unwrap().try_into().unwrap();
    VerifyingKey::from_bytes(&app2.verifying_key().to_bytes())
        .unwrap()
        .verify_strict(
            block("text vector-base").as_bytes(),
            &Signature::from_bytes(&sig),
        )
        .expect("the docs' signature verifies over the docs' base");

    // And the verifier accepts the docs' request at its `created`.
    let admin_public = admin.verifying_key().to_bytes();
    let req = RequestParts {
        method,
        path,
        query,
        header: |name: &str| docs_headers.get(name).map(String::as_str),
    };
    let inv = verify_invocation(
        &req,
        body,
        int(&v, "created"),
        |k| *k == admin_public,
        |_| false,
        &mut NonceCache::new(),
    )
    .expect("the docs' request verifies");
    assert_eq!(inv.verified.chain_ids.len(), 3, "root, first, second");
}

fn display_name(lower: &str) -> &'static str {
    match lower {
        "capability-invocation" => "Capability-Invocation",
        "content-digest" => "Content-Digest",
        "signature-input" => "Signature-Input",
        "signature" => "Signature",
        _ => panic!("unexpected header {lower}"),
    }
}
