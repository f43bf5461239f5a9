//! Scenario tests across modules: issuing, verifying, delegating on,
//! invoking over HTTP, and refusing every kind of bad input.

use std::collections::BTreeMap;

use ed25519_dalek::SigningKey;
use nuwa_identity::did_key::did_key_from_ed25519;
use serde_json::Value;

use crate::capability::verification_method_of;
use crate::invocation::{Unchecked, sign_unchecked, signature_base_of};
use crate::limits::{
    MAX_CAPABILITY_BYTES, MAX_CHAIN_DEPTH, MAX_SIGNATURE_INPUT_BYTES, MAX_TARGET_BYTES,
};
use crate::{
    Action, CapError, Capability, InvocationParams, NonceCache, RequestParts, SignedHeaders,
    Verified, delegate, proof, sign_request, verify, verify_invocation,
};

/// 2025-11-27T01:00:00Z.
const NOW: i64 = 1_764_205_200;
const DAY_SECS: i64 = 86_400;
const TARGET: &str = "did:nuwa:cap:weather:";

fn key(seed: u8) -> SigningKey {
    SigningKey::from_bytes(&[seed; 32])
}

fn did(key: &SigningKey) -> String {
    did_key_from_ed25519(&key.verifying_key().to_bytes())
}

fn uid(n: u32) -> String {
    format!("urn:uuid:{n:032x}")
}

struct World {
    admin: SigningKey,
    /// apps[i] is the invoker of the chain's level i + 1.
    apps: Vec<SigningKey>,
}

impl World {
    fn new() -> World {
        World {
            admin: key(1),
            apps: (10..16).map(key).collect(),
        }
    }

    fn is_admin(&self) -> impl Fn(&[u8; 32]) -> bool + '_ {
        move |k| *k == self.admin.verifying_key().to_bytes()
    }

    /// A first-level capability for apps[0]: read+write+query on TARGET for a day.
    fn first(&self) -> Capability {
        delegate(
            None,
            &self.admin,
            &did(&self.apps[0]),
            TARGET,
            &[Action::Write, Action::Read, Action::Query],
            NOW + DAY_SECS,
            NOW,
            uid(1),
        )
        .expect("admin delegates")
    }

    /// A chain of `depth` capabilities, each narrowing its parent a little:
    /// level k expires k hours earlier than a day, the target narrows to
    /// `…:state:` at level 2.
    fn chain(&self, depth: usize) -> Vec<Capability> {
        let mut chain = vec![self.first()];
        for level in 2..=depth {
            let parent = chain.last().expect("non-empty");
            let target = if level == 2 {
                "did:nuwa:cap:weather:state:"
            } else {
                parent.target()
            };
            let child = delegate(
                Some(parent),
                &self.apps[level - 2],
                &did(&self.apps[level - 1]),
                target,
                &[Action::Read, Action::Query],
                NOW + DAY_SECS - 3600 * level as i64,
                NOW,
                uid(level as u32),
            )
            .expect("app delegates on");
            chain.push(child);
        }
        chain
    }
}

fn never_revoked(_: &str) -> bool {
    false
}

fn verify_cap(world: &World, cap: &Capability, now: i64) -> Result<Verified, CapError> {
    verify(&cap.to_json(), now, world.is_admin(), never_revoked)
}

fn code(result: Result<impl std::fmt::Debug, CapError>) -> &'static str {
    match result {
        Ok(v) => panic!("accepted: {v:?}"),
        Err(e) => e.code(),
    }
}

// Goal: an admin's capability verifies to exactly what it grants, and its JSON round-trips through parsing.
#[test]
fn issue_and_verify() {
    let world = World::new();
    let cap = world.first();
    let verified = verify_cap(&world, &cap, NOW).expect("valid");
    assert_eq!(
        verified.invoker_public,
        world.apps[0].verifying_key().to_bytes()
    );
    assert_eq!(verified.invoker_did, did(&world.apps[0]));
    assert_eq!(verified.target, TARGET);
    assert_eq!(
        verified.actions.iter().copied().collect::<Vec<_>>(),
        vec![Action::Read, Action::Query, Action::Write]
    );
    assert_eq!(verified.expires_unix_secs, NOW + DAY_SECS);
    assert_eq!(
        verified.chain_ids,
        vec![
            "urn:zcap:root:did%3Anuwa%3Acap%3Aweather%3A".to_owned(),
            uid(1)
        ]
    );
    assert_eq!(cap.depth(), 1);
    let reparsed = Capability::from_json(&cap.to_json()).expect("parses");
    assert_eq!(reparsed, cap);
    // Pretty-printed with members in another order, it is the same capability.
    let value: Value = serde_json::from_slice(&cap.to_json()).expect("json");
    let pretty = serde_json::to_vec_pretty(&value).expect("json");
    assert_eq!(Capability::from_json(&pretty).expect("parses"), cap);
    verify(&pretty, NOW, world.is_admin(), never_revoked).expect("valid pretty");
}

// Goal: a capability's bytes are pinned (golden), so any change of format or canonicalization shows in review.
#[test]
fn golden_capability_bytes() {
    let world = World::new();
    let cap = world.first();
    let text = String::from_utf8(cap.to_json()).expect("utf-8");
    let expected = concat!(
        r#"{"@context":["https://w3id.org/zcap/v1","https://w3id.org/security/data-integrity/v2"],"#,
        r#""allowedAction":["read","query","write"],"#,
        r#""controller":"did:key:z6Mkj1MDZKcfx9AX5CeXHdysiGkRLzBbALyFuShD6wNeY1E3","#,
        r#""expires":"2025-11-28T01:00:00Z","#,
        r#""id":"urn:uuid:00000000000000000000000000000001","#,
        r#""invocationTarget":"did:nuwa:cap:weather:","#,
        r#""parentCapability":"urn:zcap:root:did%3Anuwa%3Acap%3Aweather%3A","#,
        r#""proof":{"@context":["https://w3id.org/zcap/v1","https://w3id.org/security/data-integrity/v2"],"#,
        r#""capabilityChain":["urn:zcap:root:did%3Anuwa%3Acap%3Aweather%3A"],"#,
        r#""created":"2025-11-27T01:00:00Z","#,
        r#""cryptosuite":"eddsa-jcs-2022","#,
        r#""proofPurpose":"capabilityDelegation","#,
        r#""proofValue":"z3jELGLzzhobA6yVyvpC6DSSnkGmr4HWC7vYHezbYwiKV2qg2HXzFZPcM8D4q91n1BLuCd17Q5qwLz8FpSdSK4ddP","#,
        r#""type":"DataIntegrityProof","#,
        r#""verificationMethod":"did:key:z6Mkon3Necd6NkkyfoGoHxid2znGc59LU3K7mubaRcFbLfLX#z6Mkon3Necd6NkkyfoGoHxid2znGc59LU3K7mubaRcFbLfLX"}}"#,
    );
    assert_eq!(text, expected);
}

// Goal: an app may delegate on a narrower capability, down to the depth limit, and the verifier reports the leaf's grant and the whole chain.
#[test]
fn delegation_with_attenuation() {
    let world = World::new();
    let chain = world.chain(MAX_CHAIN_DEPTH);
    for (i, cap) in chain.iter().enumerate() {
        assert_eq!(cap.depth(), i + 1);
        let verified = verify_cap(&world, cap, NOW).expect("valid");
        assert_eq!(
            verified.invoker_public,
            world.apps[i].verifying_key().to_bytes()
        );
        assert_eq!(verified.chain_ids.len(), i + 2);
        assert_eq!(verified.expires_unix_secs, cap.expires_unix_secs());
    }
    let leaf = verify_cap(&world, &chain[3], NOW).expect("valid");
    assert_eq!(leaf.target, "did:nuwa:cap:weather:state:");
    assert_eq!(
        leaf.actions.iter().copied().collect::<Vec<_>>(),
        vec![Action::Read, Action::Query]
    );
    assert_eq!(
        leaf.chain_ids[1..],
        [uid(1), uid(2), uid(3), uid(4)],
        "chain ids from the first level down"
    );
    // The capabilityChain of level 4 lists the root, levels 1 and 2, then embeds level 3.
    let value: Value = serde_json::from_slice(&chain[3].to_json()).expect("json");
    let entries = value["proof"]["capabilityChain"].as_array().expect("array");
    assert_eq!(entries.len(), 4);
    assert_eq!(entries[1], uid(1).as_str());
    assert_eq!(entries[2], uid(2).as_str());
    assert_eq!(entries[3]["id"], uid(3).as_str());
}

// Goal: delegate refuses to widen (target, actions, expiry) or to sign for someone else's capability, and a verifier refuses a widening child that was signed anyway.
#[test]
fn widening_refused() {
    let world = World::new();
    let parent = &world.chain(2)[1]; // read+query on …:state:, apps[1]
    let signer = &world.apps[1];
    let invoker = did(&world.apps[2]);
    let expires = parent.expires_unix_secs();
    let cases: [(&str, &str, &[Action], i64, &str); 5] = [
        (
            "wider target",
            "did:nuwa:cap:weather:",
            &[Action::Read],
            expires,
            "attenuation",
        ),
        (
            "sibling target",
            "did:nuwa:cap:weather:other:",
            &[Action::Read],
            expires,
            "attenuation",
        ),
        (
            "prefix without ':'",
            "did:nuwa:cap:weather:stat",
            &[Action::Read],
            expires,
            "attenuation",
        ),
        (
            "extra action",
            "did:nuwa:cap:weather:state:",
            &[Action::Read, Action::Write],
            expires,
            "attenuation",
        ),
        (
            "later expiry",
            "did:nuwa:cap:weather:state:",
            &[Action::Read],
            expires + 1,
            "attenuation",
        ),
    ];
    for (name, target, actions, expires, want) in cases {
        let got = delegate(
            Some(parent),
            signer,
            &invoker,
            target,
            actions,
            expires,
            NOW,
            uid(9),
        );
        assert_eq!(code(got), want, "case {name}");
    }
    // Only the parent's controller may delegate from it.
    let got = delegate(
        Some(parent),
        &world.admin,
        &invoker,
        "did:nuwa:cap:weather:state:",
        &[Action::Read],
        expires,
        NOW,
        uid(9),
    );
    assert_eq!(code(got), "wrong_invoker");

    // Forge: a correctly signed child that adds `write`.
    let mut child = delegate(
        Some(parent),
        signer,
        &invoker,
        "did:nuwa:cap:weather:state:",
        &[Action::Read],
        expires,
        NOW,
        uid(9),
    )
    .expect("narrow child");
    child.actions.push(Action::Write);
    proof::sign(&mut child, signer);
    let err = verify_cap(&world, &child, NOW).expect_err("widening");
    assert_eq!(err.code(), "attenuation");
    assert!(err.to_string().contains("write"), "{err}");

    // Forge: a first-level capability whose target is wider than its root's.
    let mut first = world.first();
    first.target = "did:nuwa:".to_owned();
    proof::sign(&mut first, &world.admin);
    assert_eq!(code(verify_cap(&world, &first, NOW)), "attenuation");
}

// Goal: expiry is checked at every level: with each level expiring earlier than its parent, each `now` reports the outermost expired level.
#[test]
fn expired_each_level() {
    let world = World::new();
    let chain = world.chain(3); // expires: day, day-2h, day-3h
    let leaf = &chain[2];
    for (level, cap) in chain.iter().enumerate().rev() {
        let err = verify_cap(&world, leaf, cap.expires_unix_secs()).expect_err("expired");
        assert_eq!(
            err,
            CapError::CapabilityExpired {
                id: cap.id().to_owned(),
                expires: crate::timestamp::display(cap.expires_unix_secs()),
            },
            "level {}",
            level + 1
        );
    }
    verify_cap(&world, leaf, leaf.expires_unix_secs() - 1).expect("valid a second before");
    // A delegation dated beyond the allowed clock skew is not yet valid.
    let err = verify_cap(&world, leaf, NOW - 301).expect_err("future proof");
    assert_eq!(err.code(), "capability_not_yet_valid");
    verify_cap(&world, leaf, NOW - 300).expect("within the skew");
}

// Goal: revoking any id of the chain, the root's included, refuses the leaf and names that id.
#[test]
fn revoked_each_level() {
    let world = World::new();
    let leaf = &world.chain(3)[2];
    let ids = verify_cap(&world, leaf, NOW).expect("valid").chain_ids;
    assert_eq!(ids.len(), 4);
    for id in &ids {
        let err = verify(&leaf.to_json(), NOW, world.is_admin(), |x| x == id).expect_err("revoked");
        assert_eq!(err, CapError::CapabilityRevoked { id: id.clone() });
    }
}

// Goal: a chain rooted in another agent's admin is refused, and so is a link signed by an admin instead of the parent's controller.
#[test]
fn foreign_agent_refused() {
    let world = World::new();
    let leaf = &world.chain(2)[1];
    let other_agent = |k: &[u8; 32]| *k == key(99).verifying_key().to_bytes();
    let err = verify(&leaf.to_json(), NOW, other_agent, never_revoked).expect_err("foreign");
    assert_eq!(err.code(), "not_an_admin");
    assert!(err.to_string().contains(&did(&world.admin)), "{err}");

    // The admin signs a level-2 link: valid signature, wrong delegator.
    let parent = &world.chain(1)[0];
    let mut child = delegate(
        Some(parent),
        &world.apps[0],
        &did(&world.apps[1]),
        TARGET,
        &[Action::Read],
        NOW + 3600,
        NOW,
        uid(7),
    )
    .expect("child");
    child.proof.delegator_public = world.admin.verifying_key().to_bytes();
    child.proof.verification_method = verification_method_of(&child.proof.delegator_public);
    proof::sign(&mut child, &world.admin);
    let err = verify_cap(&world, &child, NOW).expect_err("wrong delegator");
    assert_eq!(err.code(), "bad_proof");
}

// Goal: changing any field of a capability or of its embedded parent is refused, as bad_proof when the change keeps the shape valid.
#[test]
fn tampered_cap_any_field() {
    let world = World::new();
    let leaf = &world.chain(2)[1];
    let original: Value = serde_json::from_slice(&leaf.to_json()).expect("json");
    let other_did = did(&key(50));
    let admin_vm = verification_method_of(&world.admin.verifying_key().to_bytes());
    // (pointer, new value, expected code)
    let cases: Vec<(&str, Value, &str)> = vec![
        ("/id", uid(77).into(), "bad_proof"),
        ("/controller", other_did.clone().into(), "bad_proof"),
        (
            "/invocationTarget",
            "did:nuwa:cap:weather:state:X#v1".into(),
            "bad_proof",
        ),
        (
            "/invocationTarget",
            "did:nuwa:cap:weather:".into(),
            "bad_proof",
        ),
        ("/allowedAction", serde_json::json!(["read"]), "bad_proof"),
        (
            "/allowedAction",
            serde_json::json!(["query", "read"]),
            "bad_proof",
        ),
        ("/expires", "2025-11-27T02:00:00Z".into(), "bad_proof"),
        ("/proof/created", "2025-11-27T00:59:59Z".into(), "bad_proof"),
        (
            "/proof/verificationMethod",
            admin_vm.clone().into(),
            "bad_proof",
        ),
        (
            "/parentCapability",
            uid(1).replace('1', "2").into(),
            "malformed_capability",
        ),
        (
            "/proof/capabilityChain/1/expires",
            "2025-11-27T23:00:00Z".into(),
            "bad_proof",
        ),
        (
            "/proof/capabilityChain/1/allowedAction",
            serde_json::json!(["read", "query", "write", "delete"]),
            "bad_proof",
        ),
        (
            "/proof/capabilityChain/1/controller",
            other_did.into(),
            "bad_proof",
        ),
        (
            "/proof/capabilityChain/1/proof/created",
            "2025-11-27T00:00:00Z".into(),
            "bad_proof",
        ),
        (
            "/@context",
            serde_json::json!(["https://w3id.org/zcap/v1"]),
            "malformed_capability",
        ),
        (
            "/proof/@context",
            serde_json::json!([]),
            "malformed_capability",
        ),
        (
            "/proof/type",
            "Ed25519Signature2020".into(),
            "malformed_capability",
        ),
        (
            "/proof/cryptosuite",
            "eddsa-rdfc-2022".into(),
            "malformed_capability",
        ),
        (
            "/proof/proofPurpose",
            "capabilityInvocation".into(),
            "malformed_capability",
        ),
        (
            "/expires",
            "2025-11-27T02:00:00.000Z".into(),
            "malformed_capability",
        ),
        ("/expires", 1_764_212_400.into(), "malformed_capability"),
        (
            "/allowedAction",
            serde_json::json!(["read", "admin"]),
            "malformed_capability",
        ),
        (
            "/allowedAction",
            serde_json::json!([]),
            "malformed_capability",
        ),
        (
            "/proof/capabilityChain/0",
            "urn:zcap:root:did%3Anuwa%3A".into(),
            "malformed_capability",
        ),
    ];
    for (pointer, new, want) in cases {
        let mut value = original.clone();
        *value
            .pointer_mut(pointer)
            .unwrap_or_else(|| panic!("{pointer} exists")) = new.clone();
        let bytes = serde_json::to_vec(&value).expect("json");
        let got = verify(&bytes, NOW, world.is_admin(), never_revoked);
        assert_eq!(code(got), want, "{pointer} = {new}");
    }
    // Every character of the signature matters.
    let proof_value = original["proof"]["proofValue"]
        .as_str()
        .expect("string")
        .to_owned();
    for i in 1..proof_value.len() {
        let mut bytes = proof_value.clone().into_bytes();
        bytes[i] = if bytes[i] == b'2' { b'3' } else { b'2' };
        let mut value = original.clone();
        value["proof"]["proofValue"] = String::from_utf8(bytes).expect("ascii").into();
        let got = verify(
            &serde_json::to_vec(&value).expect("json"),
            NOW,
            world.is_admin(),
            never_revoked,
        );
        assert!(
            matches!(code(got), "bad_proof" | "malformed_capability"),
            "proofValue character {i}"
        );
    }
    // Extra members anywhere are refused.
    for pointer in [
        "",
        "/proof",
        "/proof/capabilityChain/1",
        "/proof/capabilityChain/1/proof",
    ] {
        let mut value = original.clone();
        value
            .pointer_mut(pointer)
            .and_then(Value::as_object_mut)
            .expect("object")
            .insert("note".to_owned(), "hi".into());
        let got = verify(
            &serde_json::to_vec(&value).expect("json"),
            NOW,
            world.is_admin(),
            never_revoked,
        );
        assert_eq!(
            code(got),
            "malformed_capability",
            "extra member at {pointer:?}"
        );
    }
    // Duplicate keys and fractional numbers are refused before the shape is looked at.
    let text = String::from_utf8(leaf.to_json()).expect("utf-8");
    let duplicated = text.replacen(
        "{\"@context\"",
        &format!("{{\"id\":\"{}\",\"@context\"", uid(5)),
        1,
    );
    assert_eq!(
        code(verify(
            duplicated.as_bytes(),
            NOW,
            world.is_admin(),
            never_revoked
        )),
        "malformed_capability"
    );
    let fraction = text.replacen("{\"@context\"", "{\"n\":1.5,\"@context\"", 1);
    let err =
        verify(fraction.as_bytes(), NOW, world.is_admin(), never_revoked).expect_err("fraction");
    assert!(err.to_string().contains("not an integer"), "{err}");
}

/// A request signed by apps[0] with its first-level capability.
struct Signed {
    cap: Capability,
    headers: SignedHeaders,
    body: Vec<u8>,
}

const PATH: &str = "/v1/state/did%3Anuwa%3Acap%3Aweather%3Astate%3AItem%23v1";
const QUERY: &str = "limit=10";
const NONCE: &str = "AAAAAAAAAAAAAAAAAAAAAA";

fn signed(world: &World, action: Action, created: i64, nonce: &str) -> Signed {
    let cap = world.first();
    let body = br#"{"temp":21}"#.to_vec();
    let headers = sign_request(
        &world.apps[0],
        "post",
        PATH,
        QUERY,
        &body,
        &InvocationParams {
            capability: &cap,
            action,
            created_unix_secs: created,
            expires_unix_secs: created + 60,
            nonce,
        },
    )
    .expect("signs");
    Signed { cap, headers, body }
}

fn header_map(headers: &SignedHeaders) -> BTreeMap<String, String> {
    headers
        .pairs()
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect()
}

/// Verifies a request with the given headers, method POST, PATH and QUERY.
fn check_request(
    world: &World,
    headers: &BTreeMap<String, String>,
    body: &[u8],
    now: i64,
    nonces: &mut NonceCache,
) -> Result<crate::Invocation, CapError> {
    let req = RequestParts {
        method: "POST",
        path: PATH,
        query: QUERY,
        header: |name: &str| headers.get(name).map(String::as_str),
    };
    verify_invocation(&req, body, now, world.is_admin(), never_revoked, nonces)
}

// Goal: a request signed with sign_request verifies to the capability's grant and the invoked action.
#[test]
fn signed_request_verifies() {
    let world = World::new();
    let s = signed(&world, Action::Write, NOW, NONCE);
    let mut nonces = NonceCache::new();
    let inv = check_request(
        &world,
        &header_map(&s.headers),
        &s.body,
        NOW + 5,
        &mut nonces,
    )
    .expect("valid request");
    assert_eq!(inv.action, Action::Write);
    assert_eq!(
        inv.verified,
        verify_cap(&world, &s.cap, NOW).expect("valid")
    );
    assert_eq!(nonces.len(), 1);
    // The same request with an empty body and no query verifies too.
    let cap = world.first();
    let headers = sign_request(
        &world.apps[0],
        "GET",
        "",
        "",
        b"",
        &InvocationParams {
            capability: &cap,
            action: Action::Read,
            created_unix_secs: NOW,
            expires_unix_secs: NOW + 300,
            nonce: "BBBBBBBBBBBBBBBBBBBBBB",
        },
    )
    .expect("signs");
    assert_eq!(
        headers.content_digest,
        "sha-256=:47DEQpj8HBSa+/TImW+5JCeuQeRkm5NMpJWZG3hSuFU=:"
    );
    let map = header_map(&headers);
    let req = RequestParts {
        method: "GET",
        path: "/",
        query: "",
        header: |name: &str| map.get(name).map(String::as_str),
    };
    verify_invocation(&req, b"", NOW, world.is_admin(), never_revoked, &mut nonces)
        .expect("empty body, root path");
}

// Goal: the header values and the signature base are pinned (golden) for one request.
#[test]
fn golden_request_headers() {
    let world = World::new();
    let s = signed(&world, Action::Write, NOW, NONCE);
    assert_eq!(
        s.headers.signature_input,
        format!(
            r#"sig1=("@method" "@path" "@query" "content-digest" "capability-invocation");created=1764205200;expires=1764205260;nonce="{NONCE}";keyid="{}";alg="ed25519""#,
            verification_method_of(&world.apps[0].verifying_key().to_bytes())
        )
    );
    // printf '{"temp":21}' | openssl dgst -sha256 -binary | base64
    assert_eq!(
        s.headers.content_digest,
        "sha-256=:H53IT25g+tXs9pQ+xwZINqys1vfb5/k0jzJRmu2rSXI=:"
    );
    assert!(
        s.headers
            .capability_invocation
            .starts_with("zcap capability=\"eyJAY29udGV4dCI6")
    );
    assert!(
        s.headers
            .capability_invocation
            .ends_with("\",action=\"write\"")
    );
    let base = signature_base_of("post", PATH, QUERY, &s.headers);
    let expected = format!(
        "\"@method\": POST\n\"@path\": {PATH}\n\"@query\": ?{QUERY}\n\"content-digest\": {}\n\"capability-invocation\": {}\n\"@signature-params\": {}",
        s.headers.content_digest,
        s.headers.capability_invocation,
        &s.headers.signature_input["sig1=".len()..]
    );
    assert_eq!(base, expected);
    assert_eq!(
        s.headers.signature,
        "sig1=:ZUXyY0Z+MW3rXqbGRkaowwNgIIrgMS+hn6VJucHB2m+D+YLlM2SNHYdXFa74zKiINgOSLCfvjIOJDI1bS0XjBw==:"
    );
}

// Goal: a body other than the signed one is refused as digest_mismatch, and a digest header other than the signed one as bad_signature.
#[test]
fn tampered_body_refused() {
    let world = World::new();
    let s = signed(&world, Action::Write, NOW, NONCE);
    let mut nonces = NonceCache::new();
    let map = header_map(&s.headers);
    for body in [&br#"{"temp":22}"#[..], b"", b"{\"temp\":21} "] {
        let got = check_request(&world, &map, body, NOW, &mut nonces);
        assert_eq!(code(got), "digest_mismatch");
    }
    let mut forged = map.clone();
    let digest = crate::content_digest_of(b"other");
    forged.insert("content-digest".into(), digest);
    assert_eq!(
        code(check_request(&world, &forged, b"other", NOW, &mut nonces)),
        "bad_signature"
    );
    // The request line is signed too.
    let req = RequestParts {
        method: "PUT",
        path: PATH,
        query: QUERY,
        header: |name: &str| map.get(name).map(String::as_str),
    };
    let got = verify_invocation(
        &req,
        &s.body,
        NOW,
        world.is_admin(),
        never_revoked,
        &mut nonces,
    );
    assert_eq!(code(got), "bad_signature");
    for (path, query) in [("/v1/state/other", QUERY), (PATH, "limit=11"), (PATH, "")] {
        let req = RequestParts {
            method: "POST",
            path,
            query,
            header: |name: &str| map.get(name).map(String::as_str),
        };
        let got = verify_invocation(
            &req,
            &s.body,
            NOW,
            world.is_admin(),
            never_revoked,
            &mut nonces,
        );
        assert_eq!(code(got), "bad_signature", "{path}?{query}");
    }
    assert!(nonces.is_empty(), "refused requests leave no nonce");
}

// Goal: a verified request cannot be replayed while its signature lives, and is stale after.
#[test]
fn replayed_nonce_refused() {
    let world = World::new();
    let s = signed(&world, Action::Write, NOW, NONCE);
    let map = header_map(&s.headers);
    let mut nonces = NonceCache::new();
    check_request(&world, &map, &s.body, NOW, &mut nonces).expect("first");
    let got = check_request(&world, &map, &s.body, NOW + 59, &mut nonces);
    assert_eq!(code(got), "replayed_nonce");
    let got = check_request(&world, &map, &s.body, NOW + 60, &mut nonces);
    assert_eq!(code(got), "stale_signature");
    // Another nonce is fine.
    let s2 = signed(&world, Action::Write, NOW, "CCCCCCCCCCCCCCCCCCCCCC");
    check_request(
        &world,
        &header_map(&s2.headers),
        &s2.body,
        NOW + 1,
        &mut nonces,
    )
    .expect("fresh nonce");
    // A full cache refuses rather than forgets.
    let mut tiny = NonceCache::with_capacity(1);
    check_request(&world, &map, &s.body, NOW, &mut tiny).expect("room");
    let got = check_request(&world, &header_map(&s2.headers), &s2.body, NOW, &mut tiny);
    assert_eq!(code(got), "nonce_cache_full");
}

// Goal: signatures created too long ago, too far ahead, expired, or living too long are refused as stale, table-driven.
#[test]
fn stale_signatures_refused() {
    let world = World::new();
    let mut nonces = NonceCache::new();
    // (created, expires, now)
    let cases = [
        (NOW - 301, NOW + 10, NOW),
        (NOW + 301, NOW + 400, NOW),
        // Ahead of the clock beyond the one second of rounding allowed: a
        // signature dated ahead would outlive a restart (issue 41).
        (NOW + 2, NOW + 60, NOW),
        (NOW + 60, NOW + 120, NOW),
        (NOW - 100, NOW, NOW),
        (NOW, NOW + 301, NOW),
        (NOW, NOW, NOW),
        (NOW, NOW - 1, NOW),
    ];
    let cap = world.first();
    for (created, expires, now) in cases {
        let headers = sign_unchecked(
            &world.apps[0],
            "POST",
            PATH,
            QUERY,
            b"",
            &Unchecked {
                keyid: &verification_method_of(&world.apps[0].verifying_key().to_bytes()),
                cap_json: &cap.to_json(),
                action: "write",
                created,
                expires,
                nonce: NONCE,
            },
        );
        let got = check_request(&world, &header_map(&headers), b"", now, &mut nonces);
        assert_eq!(
            code(got),
            "stale_signature",
            "created {created}, expires {expires}"
        );
    }
    // The edges are accepted: created 1 s ahead, or as far back as a
    // 300-second lifetime still reaches now.
    for (i, (created, expires)) in [(NOW + 1, NOW + 301), (NOW - 299, NOW + 1)]
        .into_iter()
        .enumerate()
    {
        let nonce = format!("edge{i}edge{i}edge{i}edge{i}");
        let headers = sign_request(
            &world.apps[0],
            "POST",
            PATH,
            QUERY,
            b"",
            &InvocationParams {
                capability: &cap,
                action: Action::Write,
                created_unix_secs: created,
                expires_unix_secs: expires,
                nonce: &nonce,
            },
        )
        .expect("signs");
        check_request(&world, &header_map(&headers), b"", NOW, &mut nonces).expect("at the limits");
    }
}

// Goal: the signer must be the capability's controller: another app's key, a keyid naming another key, or a malformed keyid are refused.
#[test]
fn wrong_keyid_refused() {
    let world = World::new();
    let cap = world.first(); // for apps[0]
    let intruder = &world.apps[1];
    let forge = |signer: &SigningKey, keyid: &str, action: &str| {
        let headers = sign_unchecked(
            signer,
            "POST",
            PATH,
            QUERY,
            b"",
            &Unchecked {
                keyid,
                cap_json: &cap.to_json(),
                action,
                created: NOW,
                expires: NOW + 60,
                nonce: NONCE,
            },
        );
        header_map(&headers)
    };
    let mut nonces = NonceCache::new();
    let intruder_vm = verification_method_of(&intruder.verifying_key().to_bytes());
    let owner_vm = verification_method_of(&world.apps[0].verifying_key().to_bytes());
    // The intruder signs as itself with the owner's capability.
    let got = check_request(
        &world,
        &forge(intruder, &intruder_vm, "write"),
        b"",
        NOW,
        &mut nonces,
    );
    assert_eq!(code(got), "wrong_invoker");
    // The intruder claims the owner's keyid.
    let got = check_request(
        &world,
        &forge(intruder, &owner_vm, "write"),
        b"",
        NOW,
        &mut nonces,
    );
    assert_eq!(code(got), "bad_signature");
    // A keyid whose fragment names another key, or no fragment.
    let mixed = format!(
        "{}#{}",
        did(&world.apps[0]),
        &intruder_vm[intruder_vm.len() - 48..]
    );
    for keyid in [
        mixed.as_str(),
        &did(&world.apps[0]),
        "did:web:example.com#key-1",
    ] {
        let got = check_request(
            &world,
            &forge(&world.apps[0], keyid, "write"),
            b"",
            NOW,
            &mut nonces,
        );
        assert_eq!(code(got), "malformed_invocation", "keyid {keyid}");
    }
    // The owner invoking an action the capability does not allow.
    let got = check_request(
        &world,
        &forge(&world.apps[0], &owner_vm, "delete"),
        b"",
        NOW,
        &mut nonces,
    );
    assert_eq!(code(got), "action_not_allowed");
    // sign_request refuses to make either mistake.
    let params = InvocationParams {
        capability: &cap,
        action: Action::Write,
        created_unix_secs: NOW,
        expires_unix_secs: NOW + 60,
        nonce: NONCE,
    };
    assert_eq!(
        code(sign_request(intruder, "POST", PATH, QUERY, b"", &params)),
        "wrong_invoker"
    );
    let params = InvocationParams {
        action: Action::Delete,
        ..params
    };
    assert_eq!(
        code(sign_request(
            &world.apps[0],
            "POST",
            PATH,
            QUERY,
            b"",
            &params
        )),
        "action_not_allowed"
    );
    assert!(nonces.is_empty());
}

// Goal: malformed headers are refused with malformed_invocation and never reach the nonce cache, table-driven over edits of a valid request.
#[test]
fn malformed_headers_refused() {
    let world = World::new();
    let s = signed(&world, Action::Write, NOW, NONCE);
    let map = header_map(&s.headers);
    let si = map["signature-input"].clone();
    let ci = map["capability-invocation"].clone();
    let cases: Vec<(&str, Option<String>)> = vec![
        ("signature-input", None),
        ("signature", None),
        ("content-digest", None),
        ("capability-invocation", None),
        ("signature-input", Some(si.replacen("sig1=", "sig2=", 1))),
        ("signature-input", Some(si.replacen(" \"@query\"", "", 1))),
        (
            "signature-input",
            Some(si.replacen("\"@query\"", "\"@query\" \"@query\"", 1)),
        ),
        (
            "signature-input",
            Some(si.replacen("\"@query\"", "\"@authority\"", 1)),
        ),
        (
            "signature-input",
            Some(si.replacen("alg=\"ed25519\"", "alg=\"rsa-pss-sha512\"", 1)),
        ),
        ("signature-input", Some(format!("{si};tag=\"x\""))),
        ("signature-input", Some(format!("{si};alg=\"ed25519\""))),
        (
            "signature-input",
            Some(si.replacen(";alg=\"ed25519\"", "", 1)),
        ),
        (
            "signature-input",
            Some(si.replacen("created=", "created=-", 1)),
        ),
        (
            "signature-input",
            Some(si.replacen("created=1764205200", "created=\"1764205200\"", 1)),
        ),
        ("signature-input", Some(si.replacen(NONCE, "short", 1))),
        (
            "signature-input",
            Some(si.replacen(NONCE, "AAAAAAAAAAAAAAAA+AAAAA", 1)),
        ),
        ("signature-input", Some(format!("{si}, sig2=()"))),
        ("signature-input", Some(si.replacen("(", "( ", 1))),
        (
            "signature",
            Some(map["signature"].replacen("sig1", "sig2", 1)),
        ),
        ("signature", Some("sig1=:AAAA:".into())),
        ("content-digest", Some("sha-512=:AAAA:".into())),
        (
            "content-digest",
            Some(format!("{}, sha-512=:AAAA:", map["content-digest"])),
        ),
        (
            "capability-invocation",
            Some(ci.replacen("action=\"write\"", "action=\"fly\"", 1)),
        ),
        (
            "capability-invocation",
            Some(ci.replacen("zcap ", "zcap2 ", 1)),
        ),
        (
            "capability-invocation",
            Some(ci.replacen(",action=\"write\"", "", 1)),
        ),
        ("capability-invocation", Some(format!("{ci},id=\"x\""))),
        (
            "capability-invocation",
            Some(ci.replacen("capability=\"", "capability=\"=", 1)),
        ),
        (
            "capability-invocation",
            Some(format!("{ci}\n\"@method\": GET")),
        ),
    ];
    let mut nonces = NonceCache::new();
    for (name, value) in cases {
        let mut headers = map.clone();
        match &value {
            Some(v) => headers.insert(name.to_owned(), v.clone()),
            None => headers.remove(name),
        };
        let got = check_request(&world, &headers, &s.body, NOW, &mut nonces);
        assert_eq!(code(got), "malformed_invocation", "{name}: {value:?}");
    }
    assert!(nonces.is_empty());
    // Components listed in another order are fine (RFC 9421 signs them in the listed order).
    let headers = signed_reordered(&world);
    check_request(&world, &headers, b"", NOW, &mut nonces).expect("any component order");
}

/// A valid request whose Signature-Input lists the components in reverse.
fn signed_reordered(world: &World) -> BTreeMap<String, String> {
    use base64::Engine;
    use base64::engine::general_purpose::{STANDARD, URL_SAFE_NO_PAD};
    use ed25519_dalek::Signer;
    let cap = world.first();
    let ci = format!(
        "zcap capability=\"{}\",action=\"write\"",
        URL_SAFE_NO_PAD.encode(cap.to_json())
    );
    let cd = crate::content_digest_of(b"");
    let params = format!(
        "(\"capability-invocation\" \"content-digest\" \"@query\" \"@path\" \"@method\");created={NOW};expires={};nonce=\"{NONCE}\";keyid=\"{}\";alg=\"ed25519\"",
        NOW + 60,
        verification_method_of(&world.apps[0].verifying_key().to_bytes())
    );
    let base = format!(
        "\"capability-invocation\": {ci}\n\"content-digest\": {cd}\n\"@query\": ?{QUERY}\n\"@path\": {PATH}\n\"@method\": POST\n\"@signature-params\": {params}"
    );
    let sig = world.apps[0].sign(base.as_bytes()).to_bytes();
    [
        ("capability-invocation", ci),
        ("content-digest", cd),
        ("signature-input", format!("sig1={params}")),
        ("signature", format!("sig1=:{}:", STANDARD.encode(sig))),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v))
    .collect()
}

// Goal: oversize capabilities and headers are refused by size, before parsing, and inputs past the other limits are refused.
#[test]
fn oversize_inputs_refused() {
    let world = World::new();
    let garbage = vec![b'{'; MAX_CAPABILITY_BYTES + 1];
    assert_eq!(
        code(verify(&garbage, NOW, world.is_admin(), never_revoked)),
        "capability_too_large"
    );
    // A valid capability padded with whitespace past the limit.
    let mut padded = world.first().to_json();
    padded.extend(std::iter::repeat_n(b' ', MAX_CAPABILITY_BYTES));
    assert_eq!(
        code(verify(&padded, NOW, world.is_admin(), never_revoked)),
        "capability_too_large"
    );

    let s = signed(&world, Action::Write, NOW, NONCE);
    let map = header_map(&s.headers);
    let big_cap = format!(
        "zcap capability=\"{}\",action=\"write\"",
        "A".repeat(crate::limits::MAX_CAPABILITY_HEADER_BYTES)
    );
    // A capability header under its limit whose capability is over its own.
    let over_cap = format!(
        "zcap capability=\"{}\",action=\"write\"",
        "A".repeat((MAX_CAPABILITY_BYTES + 3) * 4 / 3)
    );
    let cases = [
        ("capability-invocation", big_cap, "header_too_large"),
        (
            "signature-input",
            "x".repeat(MAX_SIGNATURE_INPUT_BYTES + 1),
            "header_too_large",
        ),
        ("signature", "x".repeat(200), "header_too_large"),
        ("content-digest", "x".repeat(200), "header_too_large"),
    ];
    let mut nonces = NonceCache::new();
    for (name, value, want) in cases {
        let mut headers = map.clone();
        headers.insert(name.to_owned(), value);
        assert_eq!(
            code(check_request(&world, &headers, &s.body, NOW, &mut nonces)),
            want,
            "{name}"
        );
    }
    // The oversized capability is refused by size once the signature over it checks out.
    let headers = sign_unchecked(
        &world.apps[0],
        "POST",
        PATH,
        QUERY,
        &s.body,
        &Unchecked {
            keyid: &verification_method_of(&world.apps[0].verifying_key().to_bytes()),
            cap_json: &vec![b' '; MAX_CAPABILITY_BYTES + 1],
            action: "write",
            created: NOW,
            expires: NOW + 60,
            nonce: NONCE,
        },
    );
    assert!(over_cap.len() < crate::limits::MAX_CAPABILITY_HEADER_BYTES);
    assert_eq!(
        code(check_request(
            &world,
            &header_map(&headers),
            &s.body,
            NOW,
            &mut nonces
        )),
        "capability_too_large"
    );
    // Delegation refuses a target past its limit.
    let long_target = format!("{}:", "a".repeat(MAX_TARGET_BYTES));
    let got = delegate(
        None,
        &world.admin,
        &did(&world.apps[0]),
        &long_target,
        &[Action::Read],
        NOW + 60,
        NOW,
        uid(1),
    );
    assert_eq!(code(got), "invalid_input");
}

// Goal: the deepest chain allowed with the longest targets stays under the size limit.
#[test]
fn longest_valid_chain_fits() {
    let world = World::new();
    let target = format!("{}:", "t".repeat(MAX_TARGET_BYTES - 1));
    let mut chain: Vec<Capability> = Vec::new();
    for level in 1..=MAX_CHAIN_DEPTH {
        let (signer, parent) = match chain.last() {
            None => (&world.admin, None),
            Some(p) => (&world.apps[level - 2], Some(p)),
        };
        let cap = delegate(
            parent,
            signer,
            &did(&world.apps[level - 1]),
            &target,
            &Action::ALL,
            NOW + DAY_SECS,
            NOW,
            format!("urn:uuid:{:08x}-0000-4000-8000-000000000000", level),
        )
        .expect("fits");
        chain.push(cap);
    }
    let leaf = chain.last().expect("non-empty");
    let len = leaf.to_json().len();
    assert!(len <= MAX_CAPABILITY_BYTES, "{len} bytes");
    assert!(
        len <= MAX_CHAIN_DEPTH * 3 * 1024,
        "{len} bytes break limits.rs' estimate"
    );
    verify_cap(&world, leaf, NOW).expect("valid");
}

// Goal: a fifth delegation is refused by delegate, and a forged five-deep chain by the verifier.
#[test]
fn chain_depth_five_refused() {
    let world = World::new();
    let chain = world.chain(MAX_CHAIN_DEPTH);
    let leaf = chain.last().expect("non-empty");
    let got = delegate(
        Some(leaf),
        &world.apps[MAX_CHAIN_DEPTH - 1],
        &did(&world.apps[MAX_CHAIN_DEPTH]),
        leaf.target(),
        &[Action::Read],
        leaf.expires_unix_secs(),
        NOW,
        uid(5),
    );
    assert_eq!(code(got), "chain_too_deep");

    // Forge the fifth link by hand.
    let mut fifth = leaf.clone();
    fifth.id = uid(5);
    fifth.controller = did(&world.apps[MAX_CHAIN_DEPTH]);
    fifth.controller_public = world.apps[MAX_CHAIN_DEPTH].verifying_key().to_bytes();
    fifth.parent_capability = leaf.id().to_owned();
    let signer = &world.apps[MAX_CHAIN_DEPTH - 1];
    fifth.proof.delegator_public = signer.verifying_key().to_bytes();
    fifth.proof.verification_method = verification_method_of(&fifth.proof.delegator_public);
    fifth
        .proof
        .chain_ids
        .push(leaf.parent().expect("parent").id().to_owned());
    fifth.proof.parent = Some(Box::new(leaf.clone()));
    proof::sign(&mut fifth, signer);
    assert_eq!(code(verify_cap(&world, &fifth, NOW)), "chain_too_deep");
}

// Goal: delegate checks its arguments and is deterministic (same inputs, same bytes).
#[test]
fn delegate_checks_arguments() {
    let world = World::new();
    let app = did(&world.apps[0]);
    let cases: Vec<(&str, String, &str, Vec<Action>, i64)> = vec![
        (
            "bad id",
            "urn:uuid:xyz".into(),
            TARGET,
            vec![Action::Read],
            NOW + 60,
        ),
        ("bad did", uid(1), TARGET, vec![Action::Read], NOW + 60),
        (
            "bad target",
            uid(1),
            "did nuwa",
            vec![Action::Read],
            NOW + 60,
        ),
        ("no action", uid(1), TARGET, vec![], NOW + 60),
        ("expires now", uid(1), TARGET, vec![Action::Read], NOW),
        (
            "year 10000",
            uid(1),
            TARGET,
            vec![Action::Read],
            253_402_300_800,
        ),
    ];
    for (name, id, target, actions, expires) in cases {
        let invoker = if name == "bad did" {
            "did:key:zzz"
        } else {
            app.as_str()
        };
        let got = delegate(
            None,
            &world.admin,
            invoker,
            target,
            &actions,
            expires,
            NOW,
            id,
        );
        assert_eq!(code(got), "invalid_input", "case {name}");
    }
    assert_eq!(world.first().to_json(), world.first().to_json());
    // Repeated actions collapse into the canonical order.
    let cap = delegate(
        None,
        &world.admin,
        &app,
        TARGET,
        &[Action::Write, Action::Read, Action::Write],
        NOW + 60,
        NOW,
        uid(1),
    )
    .expect("valid");
    assert_eq!(cap.actions(), [Action::Read, Action::Write]);
}

/// Deterministic xorshift, for the mutation test.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

fn mutate(rng: &mut Rng, input: &[u8]) -> Vec<u8> {
    let mut out = input.to_vec();
    for _ in 0..=rng.below(3) {
        let at = rng.below(out.len() + 1);
        match rng.below(4) {
            0 if at < out.len() => out[at] ^= 1 << rng.below(8),
            1 if at < out.len() => {
                out.remove(at);
            }
            2 => out.insert(at, b"{}[]\",:\\0az-%#"[rng.below(14)]),
            _ => out.truncate(at),
        }
    }
    out
}

// Goal: random mutations of a valid capability and of valid headers never panic, and what parses round-trips (seeded; replay with SEED=…).
#[test]
fn mutations_never_panic() {
    let seed = std::env::var("SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0x5eed_cafe_u64);
    let mut rng = Rng(seed | 1);
    let world = World::new();
    let leaf = world.chain(3)[2].to_json();
    let s = signed(&world, Action::Write, NOW, NONCE);
    let map = header_map(&s.headers);
    let mut nonces = NonceCache::with_capacity(4);
    for _ in 0..2_000 {
        let bytes = mutate(&mut rng, &leaf);
        let _ = verify(&bytes, NOW, world.is_admin(), never_revoked);
        // Whatever parses is canonical: written back, it parses to itself.
        if let Ok(cap) = Capability::from_json(&bytes) {
            let json = cap.to_json();
            assert_eq!(Capability::from_json(&json).as_ref(), Ok(&cap));
        }
        let name = [
            "capability-invocation",
            "content-digest",
            "signature-input",
            "signature",
        ][rng.below(4)];
        let value = mutate(&mut rng, map[name].as_bytes());
        let mut headers = map.clone();
        headers.insert(
            name.to_owned(),
            String::from_utf8_lossy(&value).into_owned(),
        );
        let _ = check_request(&world, &headers, &s.body, NOW, &mut nonces);
    }
}

// Goal: every variant's code is listed in CapError::CODES, and the codes are snake_case and distinct.
#[test]
fn codes_are_stable_and_listed() {
    let mut seen = std::collections::BTreeSet::new();
    for code in CapError::CODES {
        assert!(
            code.bytes().all(|b| b.is_ascii_lowercase() || b == b'_'),
            "{code}"
        );
        assert!(seen.insert(*code), "{code} twice");
    }
    let s = String::new;
    let one_of_each = [
        CapError::malformed("x"),
        CapError::CapabilityTooLarge { len: 0, max: 0 },
        CapError::ChainTooDeep { max: 0 },
        CapError::BadProof {
            id: s(),
            reason: "x",
        },
        CapError::NotAnAdmin {
            id: s(),
            delegator: s(),
        },
        CapError::Attenuation {
            id: s(),
            reason: s(),
        },
        CapError::CapabilityExpired {
            id: s(),
            expires: s(),
        },
        CapError::CapabilityNotYetValid {
            id: s(),
            created: s(),
        },
        CapError::CapabilityRevoked { id: s() },
        CapError::invocation("x", "x"),
        CapError::HeaderTooLarge {
            header: "x",
            len: 0,
            max: 0,
        },
        CapError::BadSignature { keyid: s() },
        CapError::Replayed {
            keyid: s(),
            nonce: s(),
        },
        CapError::StaleSignature {
            created: 0,
            expires: 0,
            now: 0,
            reason: "x",
        },
        CapError::DigestMismatch,
        CapError::WrongInvoker {
            keyid: s(),
            controller: s(),
        },
        CapError::ActionNotAllowed {
            action: Action::Read,
            allowed: s(),
        },
        CapError::NonceCacheFull { capacity: 0 },
        CapError::input("x", "x"),
    ];
    let codes: std::collections::BTreeSet<&str> = one_of_each.iter().map(CapError::code).collect();
    assert_eq!(codes, seen, "CODES and the variants' codes differ");
    for err in &one_of_each {
        let message = err.to_string();
        assert!(!message.ends_with('.'), "{message}");
        assert!(
            !message.starts_with(|c: char| c.is_ascii_uppercase()),
            "{message}"
        );
    }
}
