//! nuwa-identity: who the agent is and which devices may act for it.
//!
//! The agent is one DID (the `did:key` of its master key) whose DID document
//! lists every device's Ed25519 key. This crate provides:
//!
//! * [`keys`]: device signing keys (zeroized, never printed), seed-file format,
//!   strict signature verification, the device context id;
//! * [`did_key`]: `did:key` encoding and resolution, exactly per the W3C CCG spec;
//! * [`document`]: DID Core documents and NIP-1's key rules (listed, type,
//!   expiry, relationship);
//! * [`log`]: the agent's document as a self-certifying hash chain of signed
//!   updates, with verification and fork-aware merging;
//! * [`chain`]: the v2 log, whose entries carry ops instead of whole
//!   documents, with compact proofs a stranger can check from the DID alone
//!   and a deterministic fork rule for several admin devices;
//! * [`nip2`]: NIP-2 signing and verification of JSON content, with a bounded
//!   replay store ([`nip2::NonceStore`]);
//! * [`canonical`]: the canonical JSON bytes that get hashed and signed;
//! * [`recovery`]: the recovery key as BIP-39 words, its derivation, its
//!   place in the document and the write-it-down confirmation.
//!
//! It is pure and deterministic: no IO, no network, no files, no async, and
//! no clock reads (time is always a `now_unix_secs` parameter); randomness is
//! used only to create keys and nonces and to pick which recovery words to
//! ask back, and all of it comes from `nuwa_entropy::fill`, which a simulation
//! may seed so that a run (entry hashes, keys, PeerIds) replays. Storing keys and logs, exchanging them with peers, talking to the
//! user, and mapping keys to libp2p PeerIds are left to other crates.

pub mod canonical;
pub mod chain;
pub mod did_key;
pub mod document;
pub mod keys;
pub mod log;
pub mod nip2;
pub mod peer;
pub mod recovery;
mod replay;
pub mod resolver;
