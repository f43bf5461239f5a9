//! Invoking a capability over HTTP: an app signs each request with RFC 9421
//! HTTP Message Signatures, covering the request line, the body's RFC 9530
//! `Content-Digest` and the `Capability-Invocation` header that carries the
//! capability, as ZCAP-LD over HTTP does.
//!
//! The four headers (the exact accepted forms are in the crate docs):
//!
//! ```text
//! Capability-Invocation: zcap capability="<base64url of the capability JSON>",action="write"
//! Content-Digest: sha-256=:<base64 of SHA-256(body)>:
//! Signature-Input: sig1=("@method" "@path" "@query" "content-digest" "capability-invocation");created=…;expires=…;nonce="…";keyid="did:key:z6Mk…#z6Mk…";alg="ed25519"
//! Signature: sig1=:<base64 of the Ed25519 signature of the signature base>:
//! ```
//!
//! Parsing is strict rather than general RFC 8941: one signature labelled
//! `sig1`, exactly these five components, exactly these five parameters,
//! no whitespace inside the structured values. What this module leaves to
//! the HTTP layer: reading the headers (lowercase names; a header sent
//! twice should be refused, or joined with `, ` as RFC 9110 does, which this
//! parser then refuses), bounding the body, and mapping errors to statuses.

use base64::Engine;
use base64::engine::general_purpose::{STANDARD, URL_SAFE_NO_PAD};
use ed25519_dalek::{Signature, Signer, SigningKey, VerifyingKey};
use sha2::{Digest, Sha256};

use crate::action::{self, Action};
use crate::capability::{Capability, parse_verification_method, shorten, verification_method_of};
use crate::error::CapError;
use crate::limits::{
    COVERED_COMPONENTS, MAX_CAPABILITY_HEADER_BYTES, MAX_CLOCK_SKEW_SECS, MAX_CONTENT_DIGEST_BYTES,
    MAX_KEYID_BYTES, MAX_METHOD_CHARS, MAX_REQUEST_FUTURE_SECS, MAX_SIGNATURE_HEADER_BYTES,
    MAX_SIGNATURE_INPUT_BYTES, MAX_SIGNATURE_TTL_SECS, MAX_TIMESTAMP_DIGITS, NONCE_MAX_CHARS,
    NONCE_MIN_CHARS,
};
use crate::nonce::NonceCache;
use crate::verify::{Verified, verify_capability};

/// The header carrying the capability and the action (lowercase, as looked up).
pub const HEADER_CAPABILITY_INVOCATION: &str = "capability-invocation";
/// The RFC 9530 body digest header.
pub const HEADER_CONTENT_DIGEST: &str = "content-digest";
/// The RFC 9421 signature parameters header.
pub const HEADER_SIGNATURE_INPUT: &str = "signature-input";
/// The RFC 9421 signature header.
pub const HEADER_SIGNATURE: &str = "signature";
/// The one signature label accepted.
pub const SIGNATURE_LABEL: &str = "sig1";
/// The one `alg` accepted.
pub const SIGNATURE_ALG: &str = "ed25519";

const PSEUDO_HEADER_REQUEST: &str = "request";

/// The parts of an HTTP request that a signature covers, without any HTTP
/// crate: the caller fills it from its framework's request.
pub struct RequestParts<'a, H>
where
    H: Fn(&str) -> Option<&'a str>,
{
    /// The method (`GET`, `POST`, …); it is signed uppercased.
    pub method: &'a str,
    /// The path as sent, still percent-encoded (`/v1/state/x%3Ay`); empty means `/`.
    pub path: &'a str,
    /// The query as sent, without the `?`; empty when there is none.
    pub query: &'a str,
    /// A header's value by its lowercase name, `None` when absent.
    pub header: H,
}

/// A request whose signature, capability and nonce all checked out.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Invocation {
    /// What the capability lets the app do.
    pub verified: Verified,
    /// The action this request invokes (one the capability allows).
    pub action: Action,
}

/// What an app signs a request with, beside the request itself.
#[derive(Debug, Clone, Copy)]
pub struct InvocationParams<'a> {
    /// The capability invoked; the signer must be its `controller`.
    pub capability: &'a Capability,
    /// The action invoked; the capability must allow it.
    pub action: Action,
    /// When the signature is made, in unix seconds.
    pub created_unix_secs: i64,
    /// When it stops being valid: after `created`, at most
    /// [`MAX_SIGNATURE_TTL_SECS`] later.
    pub expires_unix_secs: i64,
    /// A fresh random nonce of 16 to 64 characters of `[A-Za-z0-9_-]`.
    pub nonce: &'a str,
}

/// The four headers of a signed request, their values ready to send.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SignedHeaders {
    /// `Capability-Invocation`.
    pub capability_invocation: String,
    /// `Content-Digest`.
    pub content_digest: String,
    /// `Signature-Input`.
    pub signature_input: String,
    /// `Signature`.
    pub signature: String,
}

impl SignedHeaders {
    /// (lowercase name, value) of each header.
    pub fn pairs(&self) -> [(&'static str, &str); 4] {
        [
            (HEADER_CAPABILITY_INVOCATION, &self.capability_invocation),
            (HEADER_CONTENT_DIGEST, &self.content_digest),
            (HEADER_SIGNATURE_INPUT, &self.signature_input),
            (HEADER_SIGNATURE, &self.signature),
        ]
    }
}

/// The covered components, in the one set accepted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Component {
    Method,
    Path,
    Query,
    ContentDigest,
    CapabilityInvocation,
}

impl Component {
    const ALL: [Component; 5] = [
        Component::Method,
        Component::Path,
        Component::Query,
        Component::ContentDigest,
        Component::CapabilityInvocation,
    ];

    fn name(self) -> &'static str {
        match self {
            Component::Method => "@method",
            Component::Path => "@path",
            Component::Query => "@query",
            Component::ContentDigest => HEADER_CONTENT_DIGEST,
            Component::CapabilityInvocation => HEADER_CAPABILITY_INVOCATION,
        }
    }
}

/// The values the signature base is built from.
struct Covered<'a> {
    method: String,
    path: &'a str,
    query: &'a str,
    content_digest: &'a str,
    capability_invocation: &'a str,
}

impl Covered<'_> {
    fn value(&self, component: Component) -> String {
        match component {
            Component::Method => self.method.clone(),
            Component::Path if self.path.is_empty() => "/".to_owned(),
            Component::Path => self.path.to_owned(),
            Component::Query => format!("?{}", self.query),
            Component::ContentDigest => self.content_digest.to_owned(),
            Component::CapabilityInvocation => self.capability_invocation.to_owned(),
        }
    }
}

/// The RFC 9421 §2.5 signature base: one `"<name>": <value>` line per
/// component in the listed order, then the `@signature-params` line, joined
/// by `\n` without a trailing newline.
fn signature_base(components: &[Component], covered: &Covered<'_>, params: &str) -> String {
    let mut base = String::new();
    for component in components {
        base.push('"');
        base.push_str(component.name());
        base.push_str("\": ");
        base.push_str(&covered.value(*component));
        base.push('\n');
    }
    base.push_str("\"@signature-params\": ");
    base.push_str(params);
    base
}

/// Builds the four headers that invoke `params.capability` on a request.
///
/// Deterministic: the time and the nonce are arguments. Refuses a signer
/// that is not the capability's controller, an action it does not allow, a
/// malformed nonce and a lifetime the verifier would refuse.
pub fn sign_request(
    signer: &SigningKey,
    method: &str,
    path: &str,
    query: &str,
    body: &[u8],
    params: &InvocationParams<'_>,
) -> Result<SignedHeaders, CapError> {
    let cap = params.capability;
    let signer_public = signer.verifying_key().to_bytes();
    if signer_public != *cap.controller_public() {
        return Err(CapError::WrongInvoker {
            keyid: verification_method_of(&signer_public),
            controller: cap.controller().to_owned(),
        });
    }
    if !cap.actions().contains(&params.action) {
        return Err(CapError::ActionNotAllowed {
            action: params.action,
            allowed: action::join(cap.actions()),
        });
    }
    check_nonce(params.nonce).map_err(|reason| CapError::input("nonce", reason))?;
    let (created, expires) = (params.created_unix_secs, params.expires_unix_secs);
    if !(timestamp_fits(created) && timestamp_fits(expires)) {
        return Err(CapError::input(
            "time",
            "created and expires must be non-negative and at most 15 digits",
        ));
    }
    if let Some(reason) = lifetime_problem(created, expires) {
        return Err(CapError::input("expires", reason));
    }
    let method = check_request_line(method, path, query)
        .map_err(|reason| CapError::input("request", reason))?;
    let cap_json = cap.to_json();
    let headers = sign_unchecked(
        signer,
        &method,
        path,
        query,
        body,
        &Unchecked {
            keyid: &verification_method_of(&signer_public),
            cap_json: &cap_json,
            action: params.action.as_str(),
            created,
            expires,
            nonce: params.nonce,
        },
    );
    if headers.capability_invocation.len() > MAX_CAPABILITY_HEADER_BYTES {
        return Err(CapError::CapabilityTooLarge {
            len: cap_json.len(),
            max: crate::limits::MAX_CAPABILITY_BYTES,
        });
    }
    Ok(headers)
}

/// What [`sign_unchecked`] writes into the headers, as given.
pub(crate) struct Unchecked<'a> {
    pub(crate) keyid: &'a str,
    pub(crate) cap_json: &'a [u8],
    pub(crate) action: &'a str,
    pub(crate) created: i64,
    pub(crate) expires: i64,
    pub(crate) nonce: &'a str,
}

/// Signs a request with whatever it is given: [`sign_request`] after its
/// checks, and tests forging requests that `sign_request` refuses to make.
pub(crate) fn sign_unchecked(
    signer: &SigningKey,
    method: &str,
    path: &str,
    query: &str,
    body: &[u8],
    u: &Unchecked<'_>,
) -> SignedHeaders {
    let capability_invocation = format!(
        "zcap capability=\"{}\",action=\"{}\"",
        URL_SAFE_NO_PAD.encode(u.cap_json),
        u.action
    );
    let content_digest = content_digest_of(body);
    let params_value = format!(
        "{COVERED_COMPONENTS};created={};expires={};nonce=\"{}\";keyid=\"{}\";alg=\"{SIGNATURE_ALG}\"",
        u.created, u.expires, u.nonce, u.keyid
    );
    let covered = Covered {
        method: method.to_ascii_uppercase(),
        path,
        query,
        content_digest: &content_digest,
        capability_invocation: &capability_invocation,
    };
    let base = signature_base(&Component::ALL, &covered, &params_value);
    let signature = signer.sign(base.as_bytes()).to_bytes();
    SignedHeaders {
        capability_invocation,
        content_digest,
        signature_input: format!("{SIGNATURE_LABEL}={params_value}"),
        signature: format!("{SIGNATURE_LABEL}=:{}:", STANDARD.encode(signature)),
    }
}

/// The signature base `sign_request` signs, for golden tests.
#[cfg(test)]
pub(crate) fn signature_base_of(
    method: &str,
    path: &str,
    query: &str,
    headers: &SignedHeaders,
) -> String {
    let params = headers
        .signature_input
        .strip_prefix("sig1=")
        .unwrap_or_default();
    let covered = Covered {
        method: method.to_ascii_uppercase(),
        path,
        query,
        content_digest: &headers.content_digest,
        capability_invocation: &headers.capability_invocation,
    };
    signature_base(&Component::ALL, &covered, params)
}

/// `sha-256=:<base64>:` of `body`.
pub fn content_digest_of(body: &[u8]) -> String {
    format!("sha-256=:{}:", STANDARD.encode(Sha256::digest(body)))
}

/// Verifies a signed request at `now_unix_secs`: its headers' form, the
/// signature's time window, the body digest, the signature (with the key
/// in `keyid`), the capability chain ([`verify_capability`]), that `keyid`
/// is the capability's controller, that the action is allowed, and last
/// that the nonce is new, which records it in `nonces`.
///
/// Nothing enters `nonces` unless every other check passed, so requests
/// without a valid capability cannot fill it.
pub fn verify_invocation<'a, H>(
    req: &RequestParts<'a, H>,
    body: &[u8],
    now_unix_secs: i64,
    is_admin: impl Fn(&[u8; 32]) -> bool,
    is_revoked: impl Fn(&str) -> bool,
    nonces: &mut NonceCache,
) -> Result<Invocation, CapError>
where
    H: Fn(&str) -> Option<&'a str>,
{
    verify_invocation_head(req, now_unix_secs, is_admin, is_revoked)?.finish(
        body,
        now_unix_secs,
        nonces,
    )
}

/// An invocation whose headers verified (signature, capability chain,
/// invoker, action; see [`verify_invocation_head`]), waiting for its body.
#[derive(Debug, Clone)]
pub struct VerifiedHead {
    invocation: Invocation,
    content_digest: String,
    keyid: String,
    nonce: String,
    created: i64,
    expires: i64,
}

impl VerifiedHead {
    /// The verified invocation, before the body and nonce are checked.
    pub fn invocation(&self) -> &Invocation {
        &self.invocation
    }

    /// When the request says it was signed (unix seconds).
    pub fn created_unix_secs(&self) -> i64 {
        self.created
    }

    /// Checks that `body` is what `Content-Digest` (which the signature
    /// covers) says, then that the nonce is new (recording it).
    pub fn finish(
        self,
        body: &[u8],
        now_unix_secs: i64,
        nonces: &mut NonceCache,
    ) -> Result<Invocation, CapError> {
        if self.content_digest != content_digest_of(body) {
            return Err(CapError::DigestMismatch);
        }
        nonces.remember(
            &self.keyid,
            &self.nonce,
            self.created,
            self.expires,
            now_unix_secs,
        )?;
        Ok(self.invocation)
    }
}

/// Every check of [`verify_invocation`] that needs no body: a server runs
/// it before it reads the body, so that a request without a valid
/// capability never makes it read one. The signature covers the
/// `Content-Digest` header, so [`VerifiedHead::finish`] only has to
/// compare the body with it.
pub fn verify_invocation_head<'a, H>(
    req: &RequestParts<'a, H>,
    now_unix_secs: i64,
    is_admin: impl Fn(&[u8; 32]) -> bool,
    is_revoked: impl Fn(&str) -> bool,
) -> Result<VerifiedHead, CapError>
where
    H: Fn(&str) -> Option<&'a str>,
{
    let capability_invocation = header(
        req,
        HEADER_CAPABILITY_INVOCATION,
        MAX_CAPABILITY_HEADER_BYTES,
    )?;
    let content_digest = header(req, HEADER_CONTENT_DIGEST, MAX_CONTENT_DIGEST_BYTES)?;
    let signature_input = header(req, HEADER_SIGNATURE_INPUT, MAX_SIGNATURE_INPUT_BYTES)?;
    let signature = header(req, HEADER_SIGNATURE, MAX_SIGNATURE_HEADER_BYTES)?;

    let input = parse_signature_input(signature_input)?;
    check_window(&input, now_unix_secs)?;
    let signer = parse_verification_method(input.keyid).ok_or_else(|| {
        CapError::invocation(
            HEADER_SIGNATURE_INPUT,
            format!(
                "keyid {:?} is not did:key:z6Mk…#z6Mk… of one Ed25519 key",
                shorten(input.keyid)
            ),
        )
    })?;
    let signature = parse_signature(signature)?;
    let (cap_bytes, action) = parse_capability_invocation(capability_invocation)?;

    parse_content_digest(content_digest)?;

    let method = check_request_line(req.method, req.path, req.query)
        .map_err(|reason| CapError::invocation(PSEUDO_HEADER_REQUEST, reason))?;
    let covered = Covered {
        method,
        path: req.path,
        query: req.query,
        content_digest,
        capability_invocation,
    };
    let base = signature_base(&input.components, &covered, input.params);
    let verifies = VerifyingKey::from_bytes(&signer).is_ok_and(|key| {
        key.verify_strict(base.as_bytes(), &Signature::from_bytes(&signature))
            .is_ok()
    });
    if !verifies {
        return Err(CapError::BadSignature {
            keyid: shorten(input.keyid),
        });
    }

    let cap = Capability::from_json(&cap_bytes)?;
    let verified = verify_capability(&cap, now_unix_secs, is_admin, is_revoked)?;
    if signer != verified.invoker_public {
        return Err(CapError::WrongInvoker {
            keyid: shorten(input.keyid),
            controller: verified.invoker_did,
        });
    }
    if !verified.actions.contains(&action) {
        return Err(CapError::ActionNotAllowed {
            action,
            allowed: action::join(&verified.actions),
        });
    }
    // Keyed by the key's one canonical spelling, so no respelling of a
    // keyid could ever make a used nonce look new.
    Ok(VerifiedHead {
        invocation: Invocation { verified, action },
        content_digest: content_digest.to_owned(),
        keyid: verification_method_of(&signer),
        nonce: input.nonce.to_owned(),
        created: input.created,
        expires: input.expires,
    })
}

/// A required header, bounded, trimmed, and free of control characters
/// (which could forge lines of the signature base).
fn header<'a, H>(
    req: &RequestParts<'a, H>,
    name: &'static str,
    max: usize,
) -> Result<&'a str, CapError>
where
    H: Fn(&str) -> Option<&'a str>,
{
    let value =
        (req.header)(name).ok_or_else(|| CapError::invocation(name, "the header is missing"))?;
    if value.len() > max {
        return Err(CapError::HeaderTooLarge {
            header: name,
            len: value.len(),
            max,
        });
    }
    let value = value.trim_matches([' ', '\t']);
    if !value.bytes().all(|b| (0x20..0x7f).contains(&b)) {
        return Err(CapError::invocation(
            name,
            "the value has a control or non-ASCII character",
        ));
    }
    Ok(value)
}

/// The uppercased method, if method, path and query can be signed: a method
/// of letters, and a path and query of visible ASCII (still percent-encoded).
fn check_request_line(method: &str, path: &str, query: &str) -> Result<String, String> {
    if method.is_empty()
        || method.len() > MAX_METHOD_CHARS
        || !method.bytes().all(|b| b.is_ascii_alphabetic())
    {
        return Err(format!(
            "method {:?} is not 1 to {MAX_METHOD_CHARS} letters",
            shorten(method)
        ));
    }
    if !path.is_empty() && !path.starts_with('/') {
        return Err(format!("path {:?} does not start with /", shorten(path)));
    }
    if !path
        .bytes()
        .chain(query.bytes())
        .all(|b| (0x21..0x7f).contains(&b))
    {
        return Err(
            "path and query must be visible ASCII, as sent on the wire (percent-encoded)"
                .to_owned(),
        );
    }
    Ok(method.to_ascii_uppercase())
}

fn check_nonce(nonce: &str) -> Result<(), String> {
    let ok = (NONCE_MIN_CHARS..=NONCE_MAX_CHARS).contains(&nonce.len())
        && nonce
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
    if ok {
        Ok(())
    } else {
        Err(format!(
            "nonce {:?} is not {NONCE_MIN_CHARS} to {NONCE_MAX_CHARS} characters of A-Z a-z 0-9 - _",
            shorten(nonce)
        ))
    }
}

fn timestamp_fits(unix_secs: i64) -> bool {
    unix_secs >= 0 && unix_secs.to_string().len() <= MAX_TIMESTAMP_DIGITS
}

/// Why (`created`, `expires`) is not an acceptable lifetime, if it is not.
fn lifetime_problem(created: i64, expires: i64) -> Option<&'static str> {
    if expires <= created {
        Some("expires is not after created")
    } else if expires - created > MAX_SIGNATURE_TTL_SECS {
        Some(
            "the signature lives longer than the daemon allows; sign each request just before sending it",
        )
    } else {
        None
    }
}

/// The parsed `Signature-Input` of label `sig1`.
#[derive(Debug)]
struct SignatureInput<'h> {
    components: Vec<Component>,
    /// Everything after `sig1=`: the `@signature-params` value.
    params: &'h str,
    created: i64,
    expires: i64,
    nonce: &'h str,
    keyid: &'h str,
}

fn parse_signature_input(value: &str) -> Result<SignatureInput<'_>, CapError> {
    let bad = |reason: String| CapError::invocation(HEADER_SIGNATURE_INPUT, reason);
    let params = value
        .strip_prefix(SIGNATURE_LABEL)
        .and_then(|rest| rest.strip_prefix('='))
        .ok_or_else(|| {
            bad(format!(
                "it must hold one signature labelled {SIGNATURE_LABEL}"
            ))
        })?;
    let (components, mut rest) = parse_components(params).map_err(bad)?;

    let mut slots = ParamSlots::default();
    while !rest.is_empty() {
        let (name, param, after) = parse_param(rest).map_err(bad)?;
        slots.fill(name, param).map_err(bad)?;
        rest = after;
    }
    let missing = |name: &str| bad(format!("parameter {name} is missing"));
    let created = slots.created.ok_or_else(|| missing("created"))?;
    let expires = slots.expires.ok_or_else(|| missing("expires"))?;
    let nonce = slots.nonce.ok_or_else(|| missing("nonce"))?;
    let keyid = slots.keyid.ok_or_else(|| missing("keyid"))?;
    let alg = slots.alg.ok_or_else(|| missing("alg"))?;
    if alg != SIGNATURE_ALG {
        return Err(bad(format!(
            "alg {:?} is not accepted; sign with {SIGNATURE_ALG}",
            shorten(alg)
        )));
    }
    check_nonce(nonce).map_err(bad)?;
    if keyid.len() > MAX_KEYID_BYTES {
        return Err(bad(format!("keyid is longer than {MAX_KEYID_BYTES} bytes")));
    }
    Ok(SignatureInput {
        components,
        params,
        created,
        expires,
        nonce,
        keyid,
    })
}

/// The inner list opening `params`, which must name each covered component
/// once, and what follows it (the parameters).
fn parse_components(params: &str) -> Result<(Vec<Component>, &str), String> {
    let inner = params
        .strip_prefix('(')
        .ok_or_else(|| "the covered components must be an inner list (\"@method\" …)".to_owned())?;
    let (list, rest) = inner
        .split_once(')')
        .ok_or_else(|| "the inner list of components is not closed".to_owned())?;
    let mut components = Vec::new();
    for item in list.split(' ') {
        let component = item
            .strip_prefix('"')
            .and_then(|s| s.strip_suffix('"'))
            .and_then(|name| Component::ALL.into_iter().find(|c| c.name() == name))
            .ok_or_else(|| {
                format!(
                    "component {:?} is not one of the covered components {COVERED_COMPONENTS}",
                    shorten(item)
                )
            })?;
        if components.contains(&component) {
            return Err(format!("component {} is listed twice", component.name()));
        }
        components.push(component);
    }
    if components.len() != Component::ALL.len() {
        return Err(format!(
            "the signature must cover exactly {COVERED_COMPONENTS}"
        ));
    }
    Ok((components, rest))
}

/// The `;name=value` parameter at the front of `rest`: its name, its value,
/// and what follows it. The value is a quoted string without escapes or a
/// small non-negative integer, the only two kinds the five parameters take.
fn parse_param(rest: &str) -> Result<(&str, Param<'_>, &str), String> {
    let after = rest
        .strip_prefix(';')
        .ok_or_else(|| "parameters must follow as ;name=value, with nothing else".to_owned())?;
    let (name, after) = after
        .split_once('=')
        .ok_or_else(|| "a parameter has no value".to_owned())?;
    if let Some(quoted) = after.strip_prefix('"') {
        let (s, after) = quoted
            .split_once('"')
            .ok_or_else(|| format!("parameter {name} has an unclosed string"))?;
        if s.contains('\\') {
            return Err(format!(
                "parameter {name} has an escape, which is not accepted"
            ));
        }
        Ok((name, Param::Str(s), after))
    } else {
        let end = after
            .find(|c: char| !c.is_ascii_digit())
            .unwrap_or(after.len());
        let digits = &after[..end];
        if digits.is_empty() || digits.len() > MAX_TIMESTAMP_DIGITS {
            return Err(format!(
                "parameter {name} is not a quoted string nor an integer of 1 to {MAX_TIMESTAMP_DIGITS} digits"
            ));
        }
        // At most 15 digits: fits an i64.
        Ok((
            name,
            Param::Int(digits.parse().unwrap_or(i64::MAX)),
            &after[end..],
        ))
    }
}

#[derive(Clone, Copy)]
enum Param<'h> {
    Int(i64),
    Str(&'h str),
}

/// The five parameters of a `Signature-Input`, each set at most once while
/// they are read; the caller refuses any still missing at the end.
#[derive(Default)]
struct ParamSlots<'h> {
    created: Option<i64>,
    expires: Option<i64>,
    nonce: Option<&'h str>,
    keyid: Option<&'h str>,
    alg: Option<&'h str>,
}

impl<'h> ParamSlots<'h> {
    /// Sets parameter `name`, refusing an unknown name, a value of the wrong
    /// kind, and a parameter given twice.
    fn fill(&mut self, name: &str, value: Param<'h>) -> Result<(), String> {
        let slot_taken = match (name, value) {
            ("created", Param::Int(n)) => self.created.replace(n).is_some(),
            ("expires", Param::Int(n)) => self.expires.replace(n).is_some(),
            ("nonce", Param::Str(s)) => self.nonce.replace(s).is_some(),
            ("keyid", Param::Str(s)) => self.keyid.replace(s).is_some(),
            ("alg", Param::Str(s)) => self.alg.replace(s).is_some(),
            ("created" | "expires", _) => {
                return Err(format!("parameter {name} must be an integer"));
            }
            ("nonce" | "keyid" | "alg", _) => {
                return Err(format!("parameter {name} must be a quoted string"));
            }
            _ => {
                return Err(format!(
                    "parameter {:?} is not accepted (only created, expires, nonce, keyid, alg)",
                    shorten(name)
                ));
            }
        };
        if slot_taken {
            return Err(format!("parameter {name} is given twice"));
        }
        Ok(())
    }
}

/// Refuses a signature outside its time window at `now`.
fn check_window(input: &SignatureInput<'_>, now: i64) -> Result<(), CapError> {
    let stale = |reason| CapError::StaleSignature {
        created: input.created,
        expires: input.expires,
        now,
        reason,
    };
    if input.created > now.saturating_add(MAX_REQUEST_FUTURE_SECS) {
        return Err(stale(
            "created is in the future (an app shares the daemon's clock)",
        ));
    }
    if input.created < now.saturating_sub(MAX_CLOCK_SKEW_SECS) {
        return Err(stale(
            "created is further in the past than the clock skew allowed",
        ));
    }
    if let Some(reason) = lifetime_problem(input.created, input.expires) {
        return Err(stale(reason));
    }
    if input.expires <= now {
        return Err(stale("the signature has expired"));
    }
    Ok(())
}

fn parse_signature(value: &str) -> Result<[u8; 64], CapError> {
    let bad = || {
        CapError::invocation(
            HEADER_SIGNATURE,
            format!("it must be {SIGNATURE_LABEL}=:<base64 of a 64-byte Ed25519 signature>:"),
        )
    };
    let encoded = value
        .strip_prefix(SIGNATURE_LABEL)
        .and_then(|rest| rest.strip_prefix("=:"))
        .and_then(|rest| rest.strip_suffix(':'))
        .ok_or_else(bad)?;
    STANDARD
        .decode(encoded)
        .ok()
        .and_then(|bytes| <[u8; 64]>::try_from(bytes).ok())
        .ok_or_else(bad)
}

/// Checks the form of a `Content-Digest` (the value itself is compared
/// whole with the body's).
fn parse_content_digest(value: &str) -> Result<(), CapError> {
    let ok = value
        .strip_prefix("sha-256=:")
        .and_then(|rest| rest.strip_suffix(':'))
        .and_then(|encoded| STANDARD.decode(encoded).ok())
        .is_some_and(|digest| digest.len() == 32);
    if ok {
        Ok(())
    } else {
        Err(CapError::invocation(
            HEADER_CONTENT_DIGEST,
            "it must be sha-256=:<base64 of the SHA-256 of the body>: (only sha-256, even for an empty body)",
        ))
    }
}

/// The capability bytes and the action of a `Capability-Invocation` value.
fn parse_capability_invocation(value: &str) -> Result<(Vec<u8>, Action), CapError> {
    let bad = |reason: String| CapError::invocation(HEADER_CAPABILITY_INVOCATION, reason);
    let params = value.strip_prefix("zcap ").ok_or_else(|| {
        bad("it must be zcap capability=\"<base64url>\",action=\"<action>\"".into())
    })?;
    let (mut capability, mut action) = (None, None);
    for param in params.split(',') {
        let (name, quoted) = param
            .trim_matches(' ')
            .split_once('=')
            .ok_or_else(|| bad("a parameter has no value".into()))?;
        let value = quoted
            .strip_prefix('"')
            .and_then(|s| s.strip_suffix('"'))
            .filter(|s| !s.contains('"'))
            .ok_or_else(|| {
                bad(format!(
                    "parameter {:?} is not a quoted string",
                    shorten(name)
                ))
            })?;
        let taken = match name {
            "capability" => capability.replace(value).is_some(),
            "action" => action.replace(value).is_some(),
            _ => {
                return Err(bad(format!(
                    "parameter {:?} is not accepted (only capability and action)",
                    shorten(name)
                )));
            }
        };
        if taken {
            return Err(bad(format!("parameter {name} is given twice")));
        }
    }
    let capability = capability.ok_or_else(|| bad("parameter capability is missing".into()))?;
    let action = action.ok_or_else(|| bad("parameter action is missing".into()))?;
    let action = Action::parse(action).ok_or_else(|| {
        bad(format!(
            "action {:?} is not one of {}",
            shorten(action),
            action::join(&Action::ALL)
        ))
    })?;
    let bytes = URL_SAFE_NO_PAD
        .decode(capability)
        .map_err(|_| bad("capability is not unpadded base64url".into()))?;
    Ok((bytes, action))
}
