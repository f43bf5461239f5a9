//! Cryptography for nuwa-sync: the agent-wide sync key and its epochs, the sealed and
//! signed [`Envelope`] that carries every state payload on the wire, and the per-device
//! [`AtRestKey`] that encrypts what the store writes to disk.
//!
//! This crate is pure computation. It knows nothing of libp2p, sled, tokio, files or
//! protobuf: key files are produced and parsed here as bytes, but reading and writing them
//! is the caller's job, and so is converting an [`Envelope`] to and from its wire message.
//! Randomness comes only from `nuwa_entropy::fill` (the operating system, unless a simulation
//! seeded the thread so that a run replays), and time is always passed in. Replay protection is left to the caller, who keeps a nonce store keyed on
//! [`Envelope::sender`], [`Envelope::nonce`] and [`Envelope::timestamp_ms`].
//!
//! Every secret lives in a [`zeroize::Zeroizing`] buffer and no `Debug` output shows one.

mod at_rest;
mod encode;
mod envelope;
pub mod epoch;
mod keyfile;
pub mod pairing;
mod sync_key;

pub use at_rest::{AT_REST_BLOB_VERSION, AT_REST_OVERHEAD_BYTES, AtRestKey};
pub use envelope::{
    ENVELOPE_HEADER_BYTES, ENVELOPE_OVERHEAD_BYTES, Envelope, EnvelopeError, NONCE_BYTES,
    SIGNATURE_BYTES, TAG_BYTES, open, seal, verify as verify_envelope,
};
pub use sync_key::SyncKey;

/// Errors from key handling and at-rest encryption.
///
/// Envelope verification has its own [`EnvelopeError`], because its callers must tell a
/// forged payload from one sealed under another epoch.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CryptoError {
    /// No random bytes could be had (see [`nuwa_entropy::fill`]); nothing was encrypted.
    #[error("cannot draw random bytes for a key or nonce")]
    Random(#[source] nuwa_entropy::Error),
    /// A key file did not have the expected `nuwa-…-v1:` text format.
    #[error("{kind} key file is malformed: {reason}")]
    MalformedKeyFile {
        /// Which key file: `sync` or `at-rest`.
        kind: &'static str,
        /// What was wrong with it.
        reason: &'static str,
    },
    /// The AEAD refused to encrypt; this only happens for inputs far beyond any real size.
    #[error("encryption failed: {len} plaintext bytes are more than the cipher accepts")]
    Encrypt {
        /// Length of the plaintext that was refused.
        len: usize,
    },
    /// An at-rest blob did not authenticate: wrong key, wrong associated data, or the bytes
    /// were changed.
    #[error(
        "at-rest blob failed authentication: wrong key, wrong associated data or tampered bytes"
    )]
    Decrypt,
    /// An at-rest blob is shorter than its fixed header and tag.
    #[error("at-rest blob is {len} bytes, shorter than the {min}-byte minimum")]
    BlobTooShort {
        /// Length of the blob that was given.
        len: usize,
        /// Smallest possible blob (version, nonce and tag).
        min: usize,
    },
    /// An at-rest blob starts with a format version this build does not know.
    #[error("at-rest blob has unknown format version {version}; upgrade nuwa-sync to read it")]
    UnsupportedBlobVersion {
        /// The version byte found.
        version: u8,
    },
}

/// Fills a fresh 32-byte secret from [`nuwa_entropy::fill`].
fn random_secret() -> Result<zeroize::Zeroizing<[u8; 32]>, CryptoError> {
    let mut secret = zeroize::Zeroizing::new([0u8; 32]);
    nuwa_entropy::fill(secret.as_mut_slice()).map_err(CryptoError::Random)?;
    Ok(secret)
}
