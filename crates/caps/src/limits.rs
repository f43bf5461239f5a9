//! Every limit of the crate, in one place, with the relations between them
//! asserted at compile time.
//!
//! Each limit bounds memory or work that a stranger's request can cause
//! before (or without) proving who it is.

/// Largest capability accepted, serialized, in bytes. Parents are embedded,
/// so this bounds the whole chain; it is checked before any parsing.
pub const MAX_CAPABILITY_BYTES: usize = 16 * 1024;

/// Most delegations in one chain, counting the first one (an admin of the
/// agent to an app). A chain of four capabilities is accepted, five are not.
pub const MAX_CHAIN_DEPTH: usize = 4;

/// Longest invocation target, in bytes: container names are at most 256
/// bytes (nuwa-asm's schema ids), and a prefix is shorter than a name.
pub const MAX_TARGET_BYTES: usize = 256;

/// Largest `Capability-Invocation` header value, in bytes.
pub const MAX_CAPABILITY_HEADER_BYTES: usize = 24 * 1024;

/// Largest `Signature-Input` header value, in bytes.
pub const MAX_SIGNATURE_INPUT_BYTES: usize = 1024;

/// Largest `Signature` header value, in bytes (a valid one is 95).
pub const MAX_SIGNATURE_HEADER_BYTES: usize = 128;

/// Largest `Content-Digest` header value, in bytes (a valid one is 54).
pub const MAX_CONTENT_DIGEST_BYTES: usize = 128;

/// Shortest request nonce, in characters of `[A-Za-z0-9_-]` (16 random
/// base64url characters carry 96 bits).
pub const NONCE_MIN_CHARS: usize = 16;

/// Longest request nonce, in characters.
pub const NONCE_MAX_CHARS: usize = 64;

/// Longest `keyid`: a did:key of an Ed25519 key with its `#z6Mk…` fragment is
/// 105 bytes; anything much longer is not one.
pub const MAX_KEYID_BYTES: usize = 128;

/// How far a delegation proof's `created` may lie ahead of the verifier's
/// clock (delegations come from other devices), and a request
/// signature's `created` behind it.
pub const MAX_CLOCK_SKEW_SECS: i64 = 300;

/// How far a request signature's `created` may lie ahead of the daemon's
/// clock. Apps run on the daemon's machine and read its clock, so this
/// only absorbs rounding; it is what keeps a signature from outliving a
/// restart of the daemon, which keeps nonces in memory only: a daemon
/// refuses requests created up to this long after its start (see
/// `nuwa_agent::apps::check_head`).
pub const MAX_REQUEST_FUTURE_SECS: i64 = 1;

/// Longest lifetime of one request signature (`expires - created`).
pub const MAX_SIGNATURE_TTL_SECS: i64 = 300;

/// Nonces remembered at once by a [`crate::NonceCache`]. Each entry lives
/// until its signature expires, at most `MAX_REQUEST_FUTURE_SECS +
/// MAX_SIGNATURE_TTL_SECS` (301 s) after it was seen, so this allows about
/// 217 signed requests a second, sustained, across all apps. An entry costs
/// about 100 bytes, so a full cache holds about 6.5 MB.
pub const NONCE_CACHE_CAPACITY: usize = 65_536;

/// Longest HTTP method accepted, in letters (`OPTIONS` has 7).
pub(crate) const MAX_METHOD_CHARS: usize = 16;

/// Most characters of untrusted input quoted in an error message.
pub(crate) const MAX_QUOTED_CHARS: usize = 80;

/// Most decimal digits of `created` and `expires` (RFC 8941 integers have at
/// most 15).
pub(crate) const MAX_TIMESTAMP_DIGITS: usize = 15;

/// Longest `proofValue`: `z` and the base58btc of 64 bytes (at most 88
/// characters). Checked before decoding, since base58 decoding is quadratic.
pub(crate) const MAX_PROOF_VALUE_CHARS: usize = 100;

/// The covered components, exactly as `Signature-Input` lists them.
pub(crate) const COVERED_COMPONENTS: &str =
    r#"("@method" "@path" "@query" "content-digest" "capability-invocation")"#;

/// The longest action name (`events`, `delete`, `schema`).
const LONGEST_ACTION_CHARS: usize = 6;

/// Length of the unpadded base64url encoding of `n` bytes.
const fn base64url_len(n: usize) -> usize {
    (n * 4).div_ceil(3)
}

// The largest capability fits its header, with the text around it.
const _: () = assert!(
    base64url_len(MAX_CAPABILITY_BYTES)
        + r#"zcap capability="",action="""#.len()
        + LONGEST_ACTION_CHARS
        <= MAX_CAPABILITY_HEADER_BYTES
);

// The longest valid `Signature-Input` value fits its bound.
const _: () = assert!(
    "sig1=".len()
        + COVERED_COMPONENTS.len()
        + ";created=".len()
        + MAX_TIMESTAMP_DIGITS
        + ";expires=".len()
        + MAX_TIMESTAMP_DIGITS
        + r#";nonce="""#.len()
        + NONCE_MAX_CHARS
        + r#";keyid="""#.len()
        + MAX_KEYID_BYTES
        + r#";alg="ed25519""#.len()
        <= MAX_SIGNATURE_INPUT_BYTES
);

// A valid `Signature` (`sig1=:` + 88 base64 characters + `:`) and
// `Content-Digest` (`sha-256=:` + 44 + `:`) fit their bounds.
const _: () = assert!("sig1=::".len() + 88 <= MAX_SIGNATURE_HEADER_BYTES);
const _: () = assert!("sha-256=::".len() + 44 <= MAX_CONTENT_DIGEST_BYTES);

// A request nonce is at least 96 bits of base64url and fits the cache key.
const _: () = assert!(NONCE_MIN_CHARS * 6 >= 96 && NONCE_MIN_CHARS <= NONCE_MAX_CHARS);

// A did:key keyid (`did:key:` + 48 + `#` + 48) fits.
const _: () = assert!("did:key:#".len() + 48 + 48 <= MAX_KEYID_BYTES);

// A chain of MAX_CHAIN_DEPTH capabilities with the longest targets fits
// (each level is under 3 KiB; see the test `longest_valid_chain_fits`).
const _: () = assert!(MAX_CHAIN_DEPTH * 3 * 1024 <= MAX_CAPABILITY_BYTES);

// Clock checks: `created <= now + future` and `expires <= created + TTL`, so
// an accepted signature expires at most future + TTL after `now`; the nonce
// cache sizing in NONCE_CACHE_CAPACITY's docs quotes that sum.
const _: () = assert!(MAX_REQUEST_FUTURE_SECS + MAX_SIGNATURE_TTL_SECS == 301);
// The future bound is the short one: it is the daemon's blind spot at start.
const _: () = assert!(MAX_REQUEST_FUTURE_SECS >= 1 && MAX_REQUEST_FUTURE_SECS <= 30);
