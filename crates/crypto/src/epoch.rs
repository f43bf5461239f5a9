//! Key epochs: the [`KeyRing`] of every sync key an agent has used, sealing one sync key to
//! one device's X25519 key ([`seal_key_to`], [`open_sealed_key`]), and the signed
//! [`EpochGrant`] that opens a new epoch after a device is revoked.
//!
//! Revoking a device opens a new epoch: the issuing device draws a fresh [`SyncKey`], seals it
//! to the X25519 key of each remaining device, and signs the whole grant with its Ed25519 key.
//! The revoked device is not a recipient, so it cannot learn the new key; old keys stay in
//! every remaining device's ring, so data written before the revocation stays readable.
//!
//! Sealing is an ECIES "sealed box": a fresh ephemeral X25519 key agrees a secret with the
//! recipient's public key; HKDF-SHA256 over `shared ‖ ephemeral public ‖ recipient public`,
//! with info binding the agent DID, the recipient's context id and the epoch, yields a
//! one-time XChaCha20-Poly1305 key; the associated data binds the same values. Exchanges with
//! low-order points (an all-zero shared secret) are refused on both sides.
//!
//! Left to others: finding the issuer's Ed25519 key and each device's X25519 key in the DID
//! document (this module takes raw keys), deciding whether the issuer may revoke and whether
//! the grant's epoch and timestamp are acceptable (above the current epoch, fresh enough),
//! storing key-ring files and X25519 secrets, and carrying grants over the wire.

use std::collections::BTreeMap;
use std::fmt;

use chacha20poly1305::XChaCha20Poly1305;
use chacha20poly1305::aead::{Aead, KeyInit, Payload};
use ed25519_dalek::{Signature, Signer, SigningKey, VerifyingKey};
use hkdf::Hkdf;
use sha2::{Digest, Sha256};
use x25519_dalek::{PublicKey, StaticSecret};
use zeroize::Zeroizing;

use crate::encode::{put_field, update_field};
use crate::{NONCE_BYTES, SIGNATURE_BYTES, SyncKey, TAG_BYTES, keyfile};

/// Most epochs a [`KeyRing`] holds; one per revocation, so far beyond any real agent.
pub const MAX_EPOCHS: usize = 1024;
/// Most recipients (remaining devices) in one [`EpochGrant`].
pub const MAX_RECIPIENTS: usize = 256;
/// Most revoked context ids in one [`EpochGrant`].
pub const MAX_REVOKED: usize = 256;
/// Longest agent DID an [`EpochGrant`] accepts, in bytes (the identity crate's limit too).
pub const MAX_DID_BYTES: usize = 256;
/// Longest context id an [`EpochGrant`] accepts, in bytes (a DID URL fragment).
pub const MAX_CONTEXT_ID_BYTES: usize = 128;
/// Length of a sealed sync key's ciphertext: the 32 key bytes plus the Poly1305 tag.
pub const SEALED_KEY_CIPHERTEXT_BYTES: usize = 32 + TAG_BYTES;
/// The only [`EpochGrant`] encoding version this build writes and reads.
pub const GRANT_VERSION: u8 = 1;

/// Encoded size of one sealed key inside a grant, without its context id:
/// ephemeral public key, nonce and ciphertext.
const SEALED_KEY_WIRE_BYTES: usize = 32 + NONCE_BYTES + SEALED_KEY_CIPHERTEXT_BYTES;

/// Largest valid encoded [`EpochGrant`]; [`EpochGrant::decode`] refuses anything longer before
/// reading it.
pub const MAX_GRANT_BYTES: usize = 1 // version
    + 2 + MAX_DID_BYTES
    + 8 // epoch
    + 2 + MAX_CONTEXT_ID_BYTES // issuer
    + 8 // timestamp
    + 2 + MAX_REVOKED * (2 + MAX_CONTEXT_ID_BYTES)
    + 2 + MAX_RECIPIENTS * (2 + MAX_CONTEXT_ID_BYTES + SEALED_KEY_WIRE_BYTES)
    + SIGNATURE_BYTES;

/// First line of the key-ring file format.
const RING_HEADER: &[u8] = b"nuwa-key-ring-v1";
/// HKDF info prefix for the key that wraps one sealed sync key.
const SEAL_KDF_DOMAIN: &[u8] = b"NUWA_EPOCH_KEY_V1:";
/// Domain separator of the associated data of one sealed sync key.
const SEAL_AAD_DOMAIN: &[u8] = b"NUWA_EPOCH_KEY_AAD_V1:";
/// Domain separator of the digest the grant's issuer signs.
const GRANT_SIGNATURE_DOMAIN: &[u8] = b"NUWA_EPOCH_GRANT_V1:";

/// Why a key ring, a sealed key or an epoch grant was refused.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum EpochError {
    /// No random bytes could be had (see [`nuwa_entropy::fill`]); nothing was sealed.
    #[error("cannot draw random bytes to seal a sync key")]
    Random(#[source] nuwa_entropy::Error),
    /// A different key is already in the ring for this epoch.
    #[error("key ring already holds a different sync key for epoch {epoch}")]
    Conflict {
        /// The epoch both keys claim.
        epoch: u64,
    },
    /// The ring (or a ring file) would hold more epochs than allowed.
    #[error("key ring is full: it holds at most {max} epochs")]
    TooManyEpochs {
        /// [`MAX_EPOCHS`].
        max: usize,
    },
    /// A key-ring file did not have the `nuwa-key-ring-v1` text format.
    #[error("key ring file is malformed at line {line}: {reason}")]
    MalformedKeyRing {
        /// 1-based line number of the offending line.
        line: usize,
        /// What was wrong with it.
        reason: &'static str,
    },
    /// An X25519 public key is a low-order point, so the exchange would give an all-zero
    /// shared secret that anyone can compute.
    #[error("{which} x25519 public key is a low-order point and gives no shared secret")]
    LowOrderPoint {
        /// Whose key: `recipient` or `ephemeral`.
        which: &'static str,
    },
    /// A sealed key did not authenticate: wrong recipient secret, or the key was sealed for
    /// another context id, DID or epoch, or its bytes were changed.
    #[error("sealed epoch {epoch} key for {context_id:?} failed to decrypt")]
    Decrypt {
        /// The recipient context id it was opened as.
        context_id: String,
        /// The epoch the sealed key claims.
        epoch: u64,
    },
    /// The sealing cipher refused to encrypt; cannot happen for a 32-byte key.
    #[error("sealing the epoch {epoch} key failed")]
    Encrypt {
        /// The epoch of the key being sealed.
        epoch: u64,
    },
    /// The grant holds no sealed key for this device: it was revoked, or is not a device of
    /// the agent the grant was made for.
    #[error("epoch grant has no sealed key for {context_id:?}")]
    NotARecipient {
        /// The context id that asked.
        context_id: String,
    },
    /// The issuer public key given to [`EpochGrant::verify`] is not a valid Ed25519 point.
    #[error("epoch grant issuer public key is not a valid ed25519 public key")]
    InvalidIssuerKey,
    /// The grant's signature does not verify under the issuer's key: it was forged or altered.
    #[error("epoch grant signature does not verify for issuer {issuer:?}")]
    BadSignature {
        /// The issuer the grant claims.
        issuer: String,
    },
    /// An encoded grant is longer than [`MAX_GRANT_BYTES`].
    #[error("epoch grant is {len} bytes, more than the {max}-byte maximum")]
    GrantTooLarge {
        /// Length given.
        len: usize,
        /// [`MAX_GRANT_BYTES`].
        max: usize,
    },
    /// An encoded grant ended in the middle of a field.
    #[error("epoch grant is truncated at byte {offset} while reading {field}")]
    Truncated {
        /// The field being read.
        field: &'static str,
        /// Byte offset where input ran out.
        offset: usize,
    },
    /// An encoded grant has bytes after its signature.
    #[error("epoch grant has {count} unexpected bytes after its signature")]
    TrailingBytes {
        /// How many bytes were left over.
        count: usize,
    },
    /// An encoded grant starts with a version this build does not know.
    #[error("epoch grant has unknown format version {version}; upgrade nuwa-sync to read it")]
    UnsupportedGrantVersion {
        /// The version byte found.
        version: u8,
    },
    /// A text field of a grant is not UTF-8.
    #[error("epoch grant field {field} is not valid utf-8")]
    NotUtf8 {
        /// Which field.
        field: &'static str,
    },
    /// A text field of a grant is empty.
    #[error("epoch grant field {field} is empty")]
    EmptyField {
        /// Which field.
        field: &'static str,
    },
    /// A text field of a grant is longer than allowed.
    #[error("epoch grant field {field} is {len} bytes, more than the {max}-byte maximum")]
    FieldTooLong {
        /// Which field.
        field: &'static str,
        /// Its length.
        len: usize,
        /// The maximum.
        max: usize,
    },
    /// A grant has no recipients, so nobody could open the new epoch.
    #[error("epoch grant has no recipients")]
    NoRecipients,
    /// A grant has more recipients than [`MAX_RECIPIENTS`].
    #[error("epoch grant has {count} recipients, more than the maximum of {max}")]
    TooManyRecipients {
        /// How many were given.
        count: usize,
        /// [`MAX_RECIPIENTS`].
        max: usize,
    },
    /// A grant revokes more devices than [`MAX_REVOKED`].
    #[error("epoch grant revokes {count} devices, more than the maximum of {max}")]
    TooManyRevoked {
        /// How many were given.
        count: usize,
        /// [`MAX_REVOKED`].
        max: usize,
    },
    /// The same context id appears twice in one list of a grant.
    #[error("epoch grant lists {id:?} twice in {field}")]
    DuplicateId {
        /// Which list: `recipients` or `revoked`.
        field: &'static str,
        /// The repeated id.
        id: String,
    },
    /// A list of a grant is not sorted; only the canonical, sorted encoding is accepted.
    #[error("epoch grant list {field} is not sorted")]
    NotSorted {
        /// Which list: `recipients` or `revoked`.
        field: &'static str,
    },
    /// A grant both revokes a device and seals the new key to it.
    #[error("epoch grant seals the new key to {context_id:?}, which it also revokes")]
    RevokedRecipient {
        /// The device in both lists.
        context_id: String,
    },
    /// A grant is issued by a device it revokes.
    #[error("epoch grant is issued by {context_id:?}, which it also revokes")]
    IssuerRevoked {
        /// The issuer.
        context_id: String,
    },
    /// A sealed key inside a grant names another epoch than the grant.
    #[error("epoch grant for epoch {grant} holds a key sealed for epoch {sealed}")]
    EpochMismatch {
        /// The grant's epoch.
        grant: u64,
        /// The sealed key's epoch.
        sealed: u64,
    },
}

// ---------------------------------------------------------------------------------------------
// Key ring

/// Every sync key of an agent, by epoch; the highest epoch is the current one.
///
/// Never empty. Keys are boxed so that rebalancing the map moves pointers, not key bytes,
/// and every key is wiped when the ring is dropped. `Debug` shows the epochs only.
#[derive(Clone)]
pub struct KeyRing {
    current: Box<SyncKey>,
    older: BTreeMap<u64, Box<SyncKey>>,
}

impl KeyRing {
    /// A ring holding only `initial`.
    #[must_use]
    pub fn new(initial: SyncKey) -> Self {
        Self {
            current: Box::new(initial),
            older: BTreeMap::new(),
        }
    }

    /// Adds `key` under its epoch. Adding the key the ring already holds for that epoch is a
    /// no-op, so a grant can be applied twice. A key above the current epoch becomes current.
    ///
    /// # Errors
    /// [`EpochError::Conflict`] if a different key is held for that epoch;
    /// [`EpochError::TooManyEpochs`] if the ring already holds [`MAX_EPOCHS`] epochs.
    pub fn insert(&mut self, key: SyncKey) -> Result<(), EpochError> {
        if let Some(held) = self.get(key.epoch()) {
            return if same_key(held, &key) {
                Ok(())
            } else {
                Err(EpochError::Conflict { epoch: key.epoch() })
            };
        }
        if self.epoch_count() >= MAX_EPOCHS {
            return Err(EpochError::TooManyEpochs { max: MAX_EPOCHS });
        }
        let key = Box::new(key);
        if key.epoch() > self.current.epoch() {
            let previous = std::mem::replace(&mut self.current, key);
            self.older.insert(previous.epoch(), previous);
        } else {
            self.older.insert(key.epoch(), key);
        }
        Ok(())
    }

    /// The key of the highest epoch: the one to seal new payloads with.
    #[must_use]
    pub fn current(&self) -> &SyncKey {
        &self.current
    }

    /// The key for `epoch`, if the ring holds it.
    #[must_use]
    pub fn get(&self, epoch: u64) -> Option<&SyncKey> {
        if epoch == self.current.epoch() {
            Some(&self.current)
        } else {
            self.older.get(&epoch).map(|key| &**key)
        }
    }

    /// The epochs held, in ascending order; the last one is [`KeyRing::current`]'s.
    pub fn epochs(&self) -> impl Iterator<Item = u64> + '_ {
        self.older
            .keys()
            .copied()
            .chain(std::iter::once(self.current.epoch()))
    }

    /// How many epochs the ring holds; at least one.
    #[must_use]
    pub fn epoch_count(&self) -> usize {
        self.older.len() + 1
    }

    /// Encodes the ring as text: the line `nuwa-key-ring-v1`, then one line
    /// `<epoch>:<64 hex digits>` per epoch in ascending order, each ending in `\n`.
    #[must_use]
    pub fn to_file_bytes(&self) -> Zeroizing<Vec<u8>> {
        let mut out = Zeroizing::new(Vec::with_capacity(
            RING_HEADER.len() + 1 + self.epoch_count() * (20 + 1 + 64 + 1),
        ));
        out.extend_from_slice(RING_HEADER);
        out.push(b'\n');
        let keys = self
            .older
            .values()
            .map(|key| &**key)
            .chain(std::iter::once(&*self.current));
        for key in keys {
            out.extend_from_slice(key.epoch().to_string().as_bytes());
            out.push(b':');
            keyfile::push_hex(&mut out, key.expose_secret());
            out.push(b'\n');
        }
        out
    }

    /// Parses a ring file written by [`KeyRing::to_file_bytes`]. `\r\n` line endings and a
    /// missing final newline are accepted; epochs must be strictly ascending.
    ///
    /// # Errors
    /// [`EpochError::MalformedKeyRing`] naming the line and what is wrong with it;
    /// [`EpochError::TooManyEpochs`] for more than [`MAX_EPOCHS`] key lines.
    pub fn from_file_bytes(contents: &[u8]) -> Result<Self, EpochError> {
        let body = contents.strip_suffix(b"\n").unwrap_or(contents);
        let mut lines = body
            .split(|&b| b == b'\n')
            .map(|line| line.strip_suffix(b"\r").unwrap_or(line));
        if lines.next() != Some(RING_HEADER) {
            return Err(EpochError::MalformedKeyRing {
                line: 1,
                reason: "it does not start with the line nuwa-key-ring-v1",
            });
        }
        let mut ring: Option<Self> = None;
        for (index, line) in lines.enumerate() {
            // Line 1 is the header, so key lines are numbered from 2.
            let line_no = index + 2;
            let malformed = |reason| EpochError::MalformedKeyRing {
                line: line_no,
                reason,
            };
            let key = parse_ring_line(line).map_err(malformed)?;
            match &mut ring {
                None => ring = Some(Self::new(key)),
                Some(ring) => {
                    if key.epoch() <= ring.current.epoch() {
                        return Err(malformed("epochs are not in strictly ascending order"));
                    }
                    ring.insert(key)?;
                }
            }
        }
        ring.ok_or(EpochError::MalformedKeyRing {
            line: 2,
            reason: "the ring holds no keys",
        })
    }
}

fn parse_ring_line(line: &[u8]) -> Result<SyncKey, &'static str> {
    let mut fields = line.splitn(2, |&b| b == b':');
    let (Some(epoch_text), Some(key_text)) = (fields.next(), fields.next()) else {
        return Err("it has no ':' between epoch and key");
    };
    let epoch = parse_decimal_u64(epoch_text).ok_or("the epoch is not a decimal u64")?;
    let key = keyfile::parse_key_hex(key_text).ok_or("the key is not exactly 64 hex digits")?;
    Ok(SyncKey::from_bytes(epoch, *key))
}

/// Parses plain ASCII decimal digits; `u64::from_str` alone would also accept a leading `+`.
fn parse_decimal_u64(text: &[u8]) -> Option<u64> {
    if text.is_empty() || !text.iter().all(u8::is_ascii_digit) {
        return None;
    }
    std::str::from_utf8(text).ok()?.parse().ok()
}

/// Compares two keys without an early exit, so timing does not reveal where they differ.
fn same_key(a: &SyncKey, b: &SyncKey) -> bool {
    use subtle::ConstantTimeEq as _;
    let equal: bool = a.expose_secret()[..].ct_eq(&b.expose_secret()[..]).into();
    a.epoch() == b.epoch() && equal
}

impl fmt::Debug for KeyRing {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KeyRing")
            .field("epochs", &self.epochs().collect::<Vec<_>>())
            .finish_non_exhaustive()
    }
}

// ---------------------------------------------------------------------------------------------
// Sealing one sync key to one device

/// One sync key sealed to one device's X25519 public key. Nothing in it is secret.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SealedKey {
    /// Epoch of the sealed key; bound into the key derivation and the associated data.
    pub epoch: u64,
    /// The sender's one-time X25519 public key.
    pub ephemeral_public: [u8; 32],
    /// Random XChaCha20-Poly1305 nonce.
    pub nonce: [u8; NONCE_BYTES],
    /// The 32 key bytes encrypted, followed by the Poly1305 tag.
    pub ciphertext: [u8; SEALED_KEY_CIPHERTEXT_BYTES],
}

/// The X25519 public key of `secret` (after the usual clamping), for publishing a device's
/// key-agreement key.
#[must_use]
pub fn x25519_public_key(secret: &[u8; 32]) -> [u8; 32] {
    PublicKey::from(&StaticSecret::from(*secret)).to_bytes()
}

/// Seals `key` to the device `recipient_context_id` of agent `agent_did`, whose X25519 public
/// key is `recipient_x25519_public`.
///
/// Draws an ephemeral X25519 key and a nonce; derives the wrapping key as
/// `HKDF-SHA256(salt = none, ikm = shared ‖ ephemeral public ‖ recipient public,
/// info = "NUWA_EPOCH_KEY_V1:" ‖ lp(agent_did) ‖ lp(recipient_context_id) ‖ epoch)` and
/// encrypts with XChaCha20-Poly1305 under associated data `"NUWA_EPOCH_KEY_AAD_V1:" ‖
/// lp(agent_did) ‖ lp(recipient_context_id) ‖ epoch ‖ ephemeral public ‖ recipient public`.
/// Here `lp(x)` is `x` preceded by its length as a big-endian `u64`, and `epoch` is a
/// big-endian `u64`.
///
/// # Errors
/// [`EpochError::LowOrderPoint`] if the recipient key is a low-order point;
/// [`EpochError::Random`] if the operating system's random number generator fails.
pub fn seal_key_to(
    recipient_x25519_public: &[u8; 32],
    recipient_context_id: &str,
    agent_did: &str,
    key: &SyncKey,
) -> Result<SealedKey, EpochError> {
    seal_key_with(
        &mut nuwa_entropy::fill,
        recipient_x25519_public,
        recipient_context_id,
        agent_did,
        key,
    )
}

/// A source of random bytes: [`nuwa_entropy::fill`] in production (the operating system, or a
/// simulation's seeded stream), a fixed stream in the golden-vector tests.
type Entropy<'a> = dyn FnMut(&mut [u8]) -> Result<(), nuwa_entropy::Error> + 'a;

fn seal_key_with(
    entropy: &mut Entropy<'_>,
    recipient_x25519_public: &[u8; 32],
    recipient_context_id: &str,
    agent_did: &str,
    key: &SyncKey,
) -> Result<SealedKey, EpochError> {
    let mut ephemeral_bytes = Zeroizing::new([0u8; 32]);
    entropy(ephemeral_bytes.as_mut_slice()).map_err(EpochError::Random)?;
    let mut nonce = [0u8; NONCE_BYTES];
    entropy(&mut nonce).map_err(EpochError::Random)?;

    let ephemeral = StaticSecret::from(*ephemeral_bytes);
    let ephemeral_public = PublicKey::from(&ephemeral).to_bytes();
    let shared = ephemeral.diffie_hellman(&PublicKey::from(*recipient_x25519_public));
    if !shared.was_contributory() {
        return Err(EpochError::LowOrderPoint { which: "recipient" });
    }
    let binding = Binding {
        agent_did,
        context_id: recipient_context_id,
        epoch: key.epoch(),
        ephemeral_public: &ephemeral_public,
        recipient_public: recipient_x25519_public,
    };
    let wrap_key = binding.wrap_key(shared.as_bytes());
    let cipher = XChaCha20Poly1305::new((&*wrap_key).into());
    let sealed = cipher
        .encrypt(
            (&nonce).into(),
            Payload {
                msg: key.expose_secret(),
                aad: &binding.associated_data(),
            },
        )
        .map_err(|_| EpochError::Encrypt { epoch: key.epoch() })?;
    let ciphertext = <[u8; SEALED_KEY_CIPHERTEXT_BYTES]>::try_from(sealed.as_slice())
        .map_err(|_| EpochError::Encrypt { epoch: key.epoch() })?;
    Ok(SealedKey {
        epoch: key.epoch(),
        ephemeral_public,
        nonce,
        ciphertext,
    })
}

/// Opens a key sealed by [`seal_key_to`] with the recipient's X25519 secret. The context id
/// and agent DID must be the ones it was sealed for.
///
/// # Errors
/// [`EpochError::LowOrderPoint`] if the ephemeral key is a low-order point;
/// [`EpochError::Decrypt`] if the secret, context id, DID or any sealed byte is wrong.
pub fn open_sealed_key(
    recipient_x25519_secret: &[u8; 32],
    recipient_context_id: &str,
    agent_did: &str,
    sealed: &SealedKey,
) -> Result<SyncKey, EpochError> {
    let secret = StaticSecret::from(*recipient_x25519_secret);
    let recipient_public = PublicKey::from(&secret).to_bytes();
    let shared = secret.diffie_hellman(&PublicKey::from(sealed.ephemeral_public));
    if !shared.was_contributory() {
        return Err(EpochError::LowOrderPoint { which: "ephemeral" });
    }
    let binding = Binding {
        agent_did,
        context_id: recipient_context_id,
        epoch: sealed.epoch,
        ephemeral_public: &sealed.ephemeral_public,
        recipient_public: &recipient_public,
    };
    let wrap_key = binding.wrap_key(shared.as_bytes());
    let cipher = XChaCha20Poly1305::new((&*wrap_key).into());
    let decrypt_error = || EpochError::Decrypt {
        context_id: recipient_context_id.to_owned(),
        epoch: sealed.epoch,
    };
    let plain = Zeroizing::new(
        cipher
            .decrypt(
                (&sealed.nonce).into(),
                Payload {
                    msg: &sealed.ciphertext,
                    aad: &binding.associated_data(),
                },
            )
            .map_err(|_| decrypt_error())?,
    );
    let mut key = Zeroizing::new([0u8; 32]);
    // The ciphertext is 48 bytes and the tag 16, so an authentic plaintext is 32 bytes; the
    // length check stays anyway so that no input can make this panic.
    if plain.len() != key.len() {
        return Err(decrypt_error());
    }
    key.copy_from_slice(&plain);
    Ok(SyncKey::from_bytes(sealed.epoch, *key))
}

/// Everything one sealed key is bound to.
struct Binding<'a> {
    agent_did: &'a str,
    context_id: &'a str,
    epoch: u64,
    ephemeral_public: &'a [u8; 32],
    recipient_public: &'a [u8; 32],
}

impl Binding<'_> {
    fn wrap_key(&self, shared: &[u8; 32]) -> Zeroizing<[u8; 32]> {
        let mut ikm = Zeroizing::new([0u8; 96]);
        ikm[..32].copy_from_slice(shared);
        ikm[32..64].copy_from_slice(self.ephemeral_public);
        ikm[64..].copy_from_slice(self.recipient_public);
        let mut info = Vec::with_capacity(
            SEAL_KDF_DOMAIN.len() + 24 + self.agent_did.len() + self.context_id.len(),
        );
        info.extend_from_slice(SEAL_KDF_DOMAIN);
        put_field(&mut info, self.agent_did.as_bytes());
        put_field(&mut info, self.context_id.as_bytes());
        info.extend_from_slice(&self.epoch.to_be_bytes());
        let mut okm = Zeroizing::new([0u8; 32]);
        Hkdf::<Sha256>::new(None, ikm.as_slice())
            .expand(&info, okm.as_mut_slice())
            // HKDF-SHA256 refuses only outputs over 255 × 32 bytes; this one is 32.
            .expect("32 bytes is a valid HKDF-SHA256 output length");
        okm
    }

    fn associated_data(&self) -> Vec<u8> {
        let mut aad = Vec::with_capacity(
            SEAL_AAD_DOMAIN.len() + 88 + self.agent_did.len() + self.context_id.len(),
        );
        aad.extend_from_slice(SEAL_AAD_DOMAIN);
        put_field(&mut aad, self.agent_did.as_bytes());
        put_field(&mut aad, self.context_id.as_bytes());
        aad.extend_from_slice(&self.epoch.to_be_bytes());
        aad.extend_from_slice(self.ephemeral_public);
        aad.extend_from_slice(self.recipient_public);
        aad
    }
}

// ---------------------------------------------------------------------------------------------
// Epoch grant

/// The signed message that opens a new key epoch, normally after a device is revoked: the
/// new sync key sealed to each remaining device.
///
/// Lists are kept sorted by context id with no duplicates, so each grant has one encoding.
/// Check it with [`EpochGrant::verify`] before [`EpochGrant::open_for`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EpochGrant {
    /// The agent whose sync key this is.
    pub agent_did: String,
    /// The epoch the grant opens.
    pub epoch: u64,
    /// Context ids of the devices revoked by this epoch, sorted.
    pub revoked: Vec<String>,
    /// The new key sealed to each remaining device, by context id, sorted.
    pub sealed: Vec<(String, SealedKey)>,
    /// Context id of the device that issued and signed the grant.
    pub issuer_context_id: String,
    /// Issuer's clock when creating the grant, in seconds since the Unix epoch.
    pub timestamp_unix_secs: u64,
    /// Ed25519 signature by the issuer (see [`EpochGrant::create`]).
    pub signature: [u8; SIGNATURE_BYTES],
}

impl EpochGrant {
    /// Seals `new_key` to every `(context id, X25519 public key)` in `recipients` and signs
    /// the grant as device `issuer_context_id` with `signer`.
    ///
    /// The signature is over `SHA-256("NUWA_EPOCH_GRANT_V1:" ‖ lp(agent_did) ‖ epoch ‖
    /// lp(issuer_context_id) ‖ timestamp_unix_secs ‖ n(revoked) ‖ lp(each revoked) ‖
    /// n(sealed) ‖ for each: lp(context id) ‖ epoch ‖ ephemeral public ‖ nonce ‖ ciphertext)`,
    /// where `lp(x)` is `x` preceded by its length and `n` is a count, both as big-endian
    /// `u64`, as are `epoch` and the timestamp.
    ///
    /// # Errors
    /// [`EpochError::NoRecipients`], [`EpochError::TooManyRecipients`],
    /// [`EpochError::TooManyRevoked`], [`EpochError::DuplicateId`],
    /// [`EpochError::EmptyField`], [`EpochError::FieldTooLong`],
    /// [`EpochError::RevokedRecipient`], [`EpochError::IssuerRevoked`] for inconsistent
    /// input; [`EpochError::LowOrderPoint`] for a recipient key that is a low-order point;
    /// [`EpochError::Random`] if the random number generator fails.
    pub fn create(
        new_key: &SyncKey,
        recipients: &[(String, [u8; 32])],
        revoked: &[String],
        issuer_context_id: &str,
        signer: &SigningKey,
        agent_did: &str,
        now_unix_secs: u64,
    ) -> Result<Self, EpochError> {
        Self::create_with(
            &mut nuwa_entropy::fill,
            new_key,
            recipients,
            revoked,
            issuer_context_id,
            signer,
            agent_did,
            now_unix_secs,
        )
    }

    #[allow(clippy::too_many_arguments)] // `create`'s arguments plus the entropy source.
    fn create_with(
        entropy: &mut Entropy<'_>,
        new_key: &SyncKey,
        recipients: &[(String, [u8; 32])],
        revoked: &[String],
        issuer_context_id: &str,
        signer: &SigningKey,
        agent_did: &str,
        now_unix_secs: u64,
    ) -> Result<Self, EpochError> {
        // Counts first, so that oversized input is refused before any sealing work.
        check_counts(recipients.len(), revoked.len())?;
        let mut revoked = revoked.to_vec();
        revoked.sort_unstable();
        let mut recipients: Vec<&(String, [u8; 32])> = recipients.iter().collect();
        recipients.sort_unstable_by(|a, b| a.0.cmp(&b.0));
        let mut grant = Self {
            agent_did: agent_did.to_owned(),
            epoch: new_key.epoch(),
            revoked,
            sealed: Vec::with_capacity(recipients.len()),
            issuer_context_id: issuer_context_id.to_owned(),
            timestamp_unix_secs: now_unix_secs,
            signature: [0; SIGNATURE_BYTES],
        };
        // Validate names and lists with placeholder sealed keys, still before sealing.
        let placeholder = SealedKey {
            epoch: new_key.epoch(),
            ephemeral_public: [0; 32],
            nonce: [0; NONCE_BYTES],
            ciphertext: [0; SEALED_KEY_CIPHERTEXT_BYTES],
        };
        grant.sealed = recipients
            .iter()
            .map(|(ctx, _)| (ctx.clone(), placeholder.clone()))
            .collect();
        grant.validate()?;
        for ((ctx, public), (_, slot)) in recipients.iter().zip(grant.sealed.iter_mut()) {
            *slot = seal_key_with(entropy, public, ctx, agent_did, new_key)?;
        }
        grant.signature = signer.sign(&grant.signing_digest()).to_bytes();
        Ok(grant)
    }

    /// Checks that the grant is well formed and that its signature verifies (strict Ed25519)
    /// under `issuer_public`, which the caller has matched to `issuer_context_id` in the
    /// agent's DID document.
    ///
    /// # Errors
    /// A structural error (see [`EpochGrant::create`]), then
    /// [`EpochError::InvalidIssuerKey`] or [`EpochError::BadSignature`].
    pub fn verify(&self, issuer_public: &[u8; 32]) -> Result<(), EpochError> {
        self.validate()?;
        let verifying_key =
            VerifyingKey::from_bytes(issuer_public).map_err(|_| EpochError::InvalidIssuerKey)?;
        verifying_key
            .verify_strict(
                &self.signing_digest(),
                &Signature::from_bytes(&self.signature),
            )
            .map_err(|_| EpochError::BadSignature {
                issuer: self.issuer_context_id.clone(),
            })
    }

    /// Opens the new sync key as device `my_context_id` with its X25519 secret. Call
    /// [`EpochGrant::verify`] first; this does not check the signature.
    ///
    /// # Errors
    /// [`EpochError::NotARecipient`] if the grant holds no key for `my_context_id` (a revoked
    /// device, for one); a structural error; or an error of [`open_sealed_key`].
    pub fn open_for(
        &self,
        my_context_id: &str,
        my_x25519_secret: &[u8; 32],
    ) -> Result<SyncKey, EpochError> {
        self.validate()?;
        let index = self
            .sealed
            .binary_search_by(|(ctx, _)| ctx.as_str().cmp(my_context_id))
            .map_err(|_| EpochError::NotARecipient {
                context_id: my_context_id.to_owned(),
            })?;
        let (ctx, sealed) = &self.sealed[index];
        open_sealed_key(my_x25519_secret, ctx, &self.agent_did, sealed)
    }

    /// The recipients' context ids, sorted.
    pub fn recipients(&self) -> impl Iterator<Item = &str> {
        self.sealed.iter().map(|(ctx, _)| ctx.as_str())
    }

    /// Encodes the grant: `version (1) ‖ s(agent_did) ‖ epoch ‖ s(issuer_context_id) ‖
    /// timestamp_unix_secs ‖ c(revoked) ‖ s(each) ‖ c(sealed) ‖ for each: s(context id) ‖
    /// ephemeral public (32) ‖ nonce (24) ‖ ciphertext (48) ‖ signature (64)`, where `s(x)` is
    /// `x` preceded by its length and `c` is a count, both as big-endian `u16`, and integers
    /// are big-endian `u64`.
    ///
    /// # Errors
    /// A structural error if the grant's fields were changed into an invalid grant.
    pub fn encode(&self) -> Result<Vec<u8>, EpochError> {
        self.validate()?;
        let mut out = Vec::with_capacity(self.encoded_len_estimate());
        out.push(GRANT_VERSION);
        put_short(&mut out, self.agent_did.as_bytes());
        out.extend_from_slice(&self.epoch.to_be_bytes());
        put_short(&mut out, self.issuer_context_id.as_bytes());
        out.extend_from_slice(&self.timestamp_unix_secs.to_be_bytes());
        put_count(&mut out, self.revoked.len());
        for ctx in &self.revoked {
            put_short(&mut out, ctx.as_bytes());
        }
        put_count(&mut out, self.sealed.len());
        for (ctx, sealed) in &self.sealed {
            put_short(&mut out, ctx.as_bytes());
            out.extend_from_slice(&sealed.ephemeral_public);
            out.extend_from_slice(&sealed.nonce);
            out.extend_from_slice(&sealed.ciphertext);
        }
        out.extend_from_slice(&self.signature);
        Ok(out)
    }

    /// Decodes and validates a grant written by [`EpochGrant::encode`]. Does not check the
    /// signature; call [`EpochGrant::verify`].
    ///
    /// # Errors
    /// [`EpochError::GrantTooLarge`], [`EpochError::UnsupportedGrantVersion`],
    /// [`EpochError::Truncated`], [`EpochError::TrailingBytes`], [`EpochError::NotUtf8`], or a
    /// structural error (see [`EpochGrant::create`]).
    pub fn decode(bytes: &[u8]) -> Result<Self, EpochError> {
        if bytes.len() > MAX_GRANT_BYTES {
            return Err(EpochError::GrantTooLarge {
                len: bytes.len(),
                max: MAX_GRANT_BYTES,
            });
        }
        let mut r = Reader { bytes, pos: 0 };
        let [version] = r.array::<1>("version")?;
        if version != GRANT_VERSION {
            return Err(EpochError::UnsupportedGrantVersion { version });
        }
        let agent_did = r.string("agent_did", MAX_DID_BYTES)?;
        let epoch = u64::from_be_bytes(r.array("epoch")?);
        let issuer_context_id = r.string("issuer_context_id", MAX_CONTEXT_ID_BYTES)?;
        let timestamp_unix_secs = u64::from_be_bytes(r.array("timestamp_unix_secs")?);
        let revoked_count = r.count("revoked count")?;
        if revoked_count > MAX_REVOKED {
            return Err(EpochError::TooManyRevoked {
                count: revoked_count,
                max: MAX_REVOKED,
            });
        }
        let mut revoked = Vec::with_capacity(revoked_count);
        for _ in 0..revoked_count {
            revoked.push(r.string("revoked", MAX_CONTEXT_ID_BYTES)?);
        }
        let sealed_count = r.count("recipient count")?;
        if sealed_count > MAX_RECIPIENTS {
            return Err(EpochError::TooManyRecipients {
                count: sealed_count,
                max: MAX_RECIPIENTS,
            });
        }
        let mut sealed = Vec::with_capacity(sealed_count);
        for _ in 0..sealed_count {
            let ctx = r.string("recipient", MAX_CONTEXT_ID_BYTES)?;
            let key = SealedKey {
                epoch,
                ephemeral_public: r.array("ephemeral_public")?,
                nonce: r.array("nonce")?,
                ciphertext: r.array("ciphertext")?,
            };
            sealed.push((ctx, key));
        }
        let signature = r.array("signature")?;
        let rest = bytes.len() - r.pos;
        if rest != 0 {
            return Err(EpochError::TrailingBytes { count: rest });
        }
        let grant = Self {
            agent_did,
            epoch,
            revoked,
            sealed,
            issuer_context_id,
            timestamp_unix_secs,
            signature,
        };
        grant.validate()?;
        Ok(grant)
    }

    /// Checks every structural rule: lengths, counts, sorted unique lists, no recipient or
    /// issuer revoked, every sealed key for this epoch.
    fn validate(&self) -> Result<(), EpochError> {
        check_counts(self.sealed.len(), self.revoked.len())?;
        check_id("agent_did", &self.agent_did, MAX_DID_BYTES)?;
        check_id(
            "issuer_context_id",
            &self.issuer_context_id,
            MAX_CONTEXT_ID_BYTES,
        )?;
        check_sorted_ids("revoked", self.revoked.iter().map(String::as_str))?;
        check_sorted_ids("recipients", self.recipients())?;
        for (ctx, sealed) in &self.sealed {
            if sealed.epoch != self.epoch {
                return Err(EpochError::EpochMismatch {
                    grant: self.epoch,
                    sealed: sealed.epoch,
                });
            }
            if self.revoked.binary_search(ctx).is_ok() {
                return Err(EpochError::RevokedRecipient {
                    context_id: ctx.clone(),
                });
            }
        }
        if self.revoked.binary_search(&self.issuer_context_id).is_ok() {
            return Err(EpochError::IssuerRevoked {
                context_id: self.issuer_context_id.clone(),
            });
        }
        Ok(())
    }

    fn signing_digest(&self) -> [u8; 32] {
        let mut hasher = Sha256::new();
        Digest::update(&mut hasher, GRANT_SIGNATURE_DOMAIN);
        update_field(&mut hasher, self.agent_did.as_bytes());
        Digest::update(&mut hasher, self.epoch.to_be_bytes());
        update_field(&mut hasher, self.issuer_context_id.as_bytes());
        Digest::update(&mut hasher, self.timestamp_unix_secs.to_be_bytes());
        // Lists are preceded by their count, so that an id cannot move between lists.
        Digest::update(&mut hasher, (self.revoked.len() as u64).to_be_bytes());
        for ctx in &self.revoked {
            update_field(&mut hasher, ctx.as_bytes());
        }
        Digest::update(&mut hasher, (self.sealed.len() as u64).to_be_bytes());
        for (ctx, sealed) in &self.sealed {
            update_field(&mut hasher, ctx.as_bytes());
            Digest::update(&mut hasher, sealed.epoch.to_be_bytes());
            Digest::update(&mut hasher, sealed.ephemeral_public);
            Digest::update(&mut hasher, sealed.nonce);
            Digest::update(&mut hasher, sealed.ciphertext);
        }
        hasher.finalize().into()
    }

    fn encoded_len_estimate(&self) -> usize {
        let ids: usize = self.revoked.iter().map(|c| 2 + c.len()).sum::<usize>()
            + self
                .sealed
                .iter()
                .map(|(c, _)| 2 + c.len() + SEALED_KEY_WIRE_BYTES)
                .sum::<usize>();
        1 + 2 + self.agent_did.len() + 8 + 2 + self.issuer_context_id.len() + 8 + 4 + ids + 64
    }
}

fn check_counts(recipients: usize, revoked: usize) -> Result<(), EpochError> {
    if recipients == 0 {
        return Err(EpochError::NoRecipients);
    }
    if recipients > MAX_RECIPIENTS {
        return Err(EpochError::TooManyRecipients {
            count: recipients,
            max: MAX_RECIPIENTS,
        });
    }
    if revoked > MAX_REVOKED {
        return Err(EpochError::TooManyRevoked {
            count: revoked,
            max: MAX_REVOKED,
        });
    }
    Ok(())
}

fn check_id(field: &'static str, id: &str, max: usize) -> Result<(), EpochError> {
    if id.is_empty() {
        return Err(EpochError::EmptyField { field });
    }
    if id.len() > max {
        return Err(EpochError::FieldTooLong {
            field,
            len: id.len(),
            max,
        });
    }
    Ok(())
}

fn check_sorted_ids<'a>(
    field: &'static str,
    ids: impl Iterator<Item = &'a str>,
) -> Result<(), EpochError> {
    let mut previous: Option<&str> = None;
    for id in ids {
        check_id(field, id, MAX_CONTEXT_ID_BYTES)?;
        if let Some(previous) = previous {
            match previous.cmp(id) {
                std::cmp::Ordering::Less => {}
                std::cmp::Ordering::Equal => {
                    return Err(EpochError::DuplicateId {
                        field,
                        id: id.to_owned(),
                    });
                }
                std::cmp::Ordering::Greater => return Err(EpochError::NotSorted { field }),
            }
        }
        previous = Some(id);
    }
    Ok(())
}

/// Appends a string field preceded by its length as a big-endian `u16`; callers have checked
/// that every field is at most [`MAX_DID_BYTES`] long.
fn put_short(out: &mut Vec<u8>, field: &[u8]) {
    put_count(out, field.len());
    out.extend_from_slice(field);
}

/// Appends a length or count as a big-endian `u16`; callers have bounded it far below 65 536.
fn put_count(out: &mut Vec<u8>, n: usize) {
    let n = u16::try_from(n).unwrap_or(u16::MAX);
    out.extend_from_slice(&n.to_be_bytes());
}

/// A cursor over an encoded grant that reports where it ran out.
struct Reader<'a> {
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize, field: &'static str) -> Result<&'a [u8], EpochError> {
        let slice = self
            .pos
            .checked_add(n)
            .and_then(|end| self.bytes.get(self.pos..end))
            .ok_or(EpochError::Truncated {
                field,
                offset: self.bytes.len(),
            })?;
        self.pos += n;
        Ok(slice)
    }

    fn array<const N: usize>(&mut self, field: &'static str) -> Result<[u8; N], EpochError> {
        let slice = self.take(N, field)?;
        let mut out = [0u8; N];
        out.copy_from_slice(slice);
        Ok(out)
    }

    fn count(&mut self, field: &'static str) -> Result<usize, EpochError> {
        Ok(usize::from(u16::from_be_bytes(self.array(field)?)))
    }

    fn string(&mut self, field: &'static str, max: usize) -> Result<String, EpochError> {
        let len = self.count(field)?;
        // Checked before reading, so a huge length is refused without looking further.
        if len > max {
            return Err(EpochError::FieldTooLong { field, len, max });
        }
        let bytes = self.take(len, field)?;
        String::from_utf8(bytes.to_vec()).map_err(|_| EpochError::NotUtf8 { field })
    }
}

#[cfg(test)]
mod tests;
