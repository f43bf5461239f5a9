//! nuwa-caps: app capabilities (ZCAP-LD), their invocation over HTTP
//! (RFC 9421), and the access decision NIP-8's `x-visibility` asks for.
//!
//! An app of the agent holds its own Ed25519 key, named by a `did:key`. It
//! may read or write the agent's state through the daemon's local HTTP API
//! only with a capability that an admin of the agent delegated to that key
//! (or that such an app delegated on, narrower). This crate is the pure
//! logic of that: it issues and verifies capabilities, signs and verifies
//! requests, and decides whether a verified capability reaches a container.
//!
//! It does no IO and reads no clock (`now_unix_secs` is a parameter), draws
//! no randomness (ids and nonces are arguments), and knows no HTTP
//! framework, tokio, sled, libp2p or the daemon. Which keys are admins,
//! which ids are revoked, what visibility a container has, and keeping the
//! [`NonceCache`] are the caller's.
//!
//! # Capability
//!
//! A capability is a JSON object of exactly these members (JCS-serialized
//! when this crate writes it; any member order and whitespace when read):
//!
//! ```json
//! {
//!   "@context": ["https://w3id.org/zcap/v1", "https://w3id.org/security/data-integrity/v2"],
//!   "id": "urn:uuid:2c7b0f1e-5b1a-4f7e-9c3d-8a6b4e2d1f00",
//!   "controller": "did:key:z6Mk…",
//!   "invocationTarget": "did:nuwa:cap:weather:",
//!   "allowedAction": ["read", "write"],
//!   "expires": "2026-12-01T00:00:00Z",
//!   "parentCapability": "urn:zcap:root:did%3Anuwa%3Acap%3Aweather%3A",
//!   "proof": {
//!     "@context": ["https://w3id.org/zcap/v1", "https://w3id.org/security/data-integrity/v2"],
//!     "type": "DataIntegrityProof",
//!     "cryptosuite": "eddsa-jcs-2022",
//!     "created": "2026-11-27T01:00:00Z",
//!     "verificationMethod": "did:key:z6Mk…#z6Mk…",
//!     "proofPurpose": "capabilityDelegation",
//!     "capabilityChain": ["urn:zcap:root:did%3Anuwa%3Acap%3Aweather%3A"],
//!     "proofValue": "z<base58btc of the 64-byte Ed25519 signature>"
//!   }
//! }
//! ```
//!
//! * `id`: `urn:uuid:` and a lowercase UUID (8-4-4-4-12) or 32 lowercase hex
//!   digits, drawn at random by the issuer.
//! * `controller`: the did:key of the app that may invoke it.
//! * `invocationTarget`: a container name (`did:nuwa:cap:news:state:Item#v1`)
//!   or a prefix ending in `:` (`did:nuwa:cap:weather:`), 1 to 256 bytes of
//!   `A-Z a-z 0-9 . _ @ - : #`.
//! * `allowedAction`: a non-empty subset of `read`, `query`, `events`,
//!   `write`, `delete`, `reset`, `schema`, without repeats.
//! * `expires` and `proof.created`: RFC 3339 UTC in whole seconds, exactly
//!   `YYYY-MM-DDTHH:MM:SSZ`.
//! * `parentCapability`: for a capability an admin delegated, the root id of
//!   its target, `urn:zcap:root:` + the target percent-encoded as
//!   JavaScript's `encodeURIComponent` does; otherwise the parent's `id`.
//! * `proof.capabilityChain`: `[root id]` for an admin's capability;
//!   otherwise `[root id, …ids of the ancestors between…, parent object]`,
//!   the parent embedded whole (with its own proof).
//! * `proof.@context`: the document's `@context`, as the cryptosuite's
//!   Create Proof algorithm copies it into the proof; so `proofConfig` (the
//!   proof without `proofValue`) carries it, and generic Data Integrity
//!   verifiers compute the same hashes.
//! * `proof.proofValue`: Ed25519 over `SHA-256(JCS(proofConfig)) ‖
//!   SHA-256(JCS(document without proof))` (eddsa-jcs-2022), by the key of
//!   `verificationMethod` (`did:key:X#X`). That key must be an admin of the
//!   agent for a capability delegated from the root, and the parent's
//!   `controller` for any other.
//!
//! Every member is required and no other is accepted, at any level. JSON
//! numbers other than integers within ±(2^53 − 1) and duplicate keys are
//! refused anywhere in the document. A child may only narrow its parent:
//! the same target or one inside it (the parent's target ends in `:` and
//! starts the child's), a subset of its actions, and an expiry no later.
//! See [`verify()`] for the checks and their order, and [`limits`] for the
//! bounds (16 KiB per capability, 4 delegations per chain).
//!
//! # Invocation
//!
//! Each request carries four headers (see [`invocation`]):
//!
//! ```text
//! Capability-Invocation: zcap capability="<base64url, unpadded, of the capability JSON>",action="write"
//! Content-Digest: sha-256=:<base64 of SHA-256(body)>:
//! Signature-Input: sig1=("@method" "@path" "@query" "content-digest" "capability-invocation");created=1764205200;expires=1764205260;nonce="<16-64 of A-Za-z0-9_->";keyid="did:key:z6Mk…#z6Mk…";alg="ed25519"
//! Signature: sig1=:<base64 of the 64-byte Ed25519 signature>:
//! ```
//!
//! The signature covers the RFC 9421 §2.5 signature base, one line per
//! covered component in the order `Signature-Input` lists them, then the
//! parameters line, joined by `\n` with no trailing newline:
//!
//! ```text
//! "@method": POST
//! "@path": /v1/state/did%3Anuwa%3Acap%3Aweather%3Astate%3AItem%23v1
//! "@query": ?limit=10
//! "content-digest": sha-256=:…:
//! "capability-invocation": zcap capability="…",action="write"
//! "@signature-params": ("@method" "@path" "@query" "content-digest" "capability-invocation");created=…;expires=…;nonce="…";keyid="…";alg="ed25519"
//! ```
//!
//! `@method` is uppercased, `@path` is the path as sent (`/` when empty),
//! `@query` is `?` and the query as sent (`?` alone when there is none).
//! The five components may be listed in any order but must all be there;
//! the five parameters are required and no other is accepted. The daemon
//! requires `created` from 300 s before its clock to 1 s after, `created < expires ≤
//! created + 300`, `expires` after its clock, `keyid` = the capability's
//! `controller` with its `#<multibase>` fragment, `Content-Digest` matching
//! the body (also when empty), the action among `allowedAction`, and a
//! nonce this key has not used in an unexpired signature.
//!
//! # Access
//!
//! [`may`] decides whether a verified capability reaches a container of a
//! given [`Visibility`]; see [`access`].
//!
//! # Errors
//!
//! Every refusal is a [`CapError`] whose [`CapError::code`] is a stable
//! snake_case string for HTTP error bodies and counters. No input panics.
//!
//! A dependency-free JavaScript client (Node.js) that writes the same format
//! is `scripts/app-client/nuwa_app.mjs`; `tests/node_client.rs` holds the
//! two to each other.

pub mod access;
pub mod action;
pub mod capability;
mod delegate;
pub mod error;
pub mod invocation;
mod json;
pub mod limits;
pub mod nonce;
mod proof;
mod timestamp;
pub mod verify;

#[cfg(test)]
mod tests;

pub use access::{Visibility, covers, may, namespace_of};
pub use action::Action;
pub use capability::{Capability, root_id, verification_method_of};
pub use delegate::delegate;
pub use error::{CapError, Forbidden};
pub use invocation::{
    Invocation, InvocationParams, RequestParts, SignedHeaders, VerifiedHead, content_digest_of,
    sign_request, verify_invocation, verify_invocation_head,
};
pub use nonce::NonceCache;
pub use verify::{Verified, verify, verify_capability};
