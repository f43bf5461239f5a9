//! Pairing a new device with a short one-time code: SPAKE2 key agreement, key confirmation
//! and one sealed grant, as IO-free state machines.
//!
//! The new device (the [`Joiner`]) shows a [`PairingCode`]; the user types it on a device
//! that is already authorised (the [`Approver`]). Over one stream between the two:
//!
//! 1. Joiner → Approver: [`JoinRequest`] (its SPAKE2 message, its Ed25519 and X25519 public
//!    keys and a display name).
//! 2. Approver → Joiner: [`ApproverConfirm`] (its SPAKE2 message and a MAC over the
//!    transcript). A wrong code fails here on the joiner, closed.
//! 3. Joiner → Approver: [`JoinerConfirm`] (the joiner's MAC). Only now does the approver
//!    learn the joiner's keys as [`VerifiedJoiner`].
//! 4. Approver → Joiner: [`Grant`], the caller's opaque grant (the signed DID log update and
//!    the sync key) sealed with XChaCha20-Poly1305 under a key derived from the session.
//!
//! The SPAKE2 identities and the transcript both bind the two libp2p PeerIds, so a relay
//! cannot splice two sessions together, and the transcript binds the joiner's keys and name,
//! so the approver's confirmation also authenticates the keys it is about to register. A
//! passive observer learns nothing about the code; an active attacker gets one guess per
//! session, which [`AttemptLimiter`] bounds (three failures burn a code, and attempts per
//! minute are capped).
//!
//! Left to others: carrying the messages (the node, over a libp2p stream), checking that the
//! joiner's Ed25519 key is the key behind its PeerId, building and signing the DID update,
//! showing the code or a QR, and keeping an [`AttemptLimiter`] per process. Nothing here does
//! IO or reads a clock: time is passed in, and randomness comes only from `nuwa_entropy::fill`.
//!
//! Any error ends a session (fail closed); start a new [`Joiner`] or [`Approver`] to retry.
//! The `spake2` crate (0.5.0-pre.0) does not wipe its own copy of the password or its secret
//! scalar; every secret this module owns is wiped on drop.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::fmt;

use chacha20poly1305::XChaCha20Poly1305;
use chacha20poly1305::aead::{Aead, KeyInit, Payload};
use hkdf::Hkdf;
use hmac::{Hmac, Mac};
use sha2::{Digest, Sha256, Sha512};
use spake2::{Ed25519Group, Identity, Password, Spake2};
use zeroize::Zeroizing;

use crate::encode::update_field;

/// Version byte that opens every pairing message and is bound into the transcript.
pub const PROTOCOL_VERSION: u8 = 1;
/// Symbols in a pairing code: 8 Crockford base32 symbols carry 40 bits.
pub const CODE_SYMBOLS: usize = 8;
/// Symbols of the code that are published as its nameplate.
pub const NAMEPLATE_SYMBOLS: usize = 2;
/// How long a freshly generated code stays valid.
pub const DEFAULT_CODE_TTL_SECS: u64 = 10 * 60;
/// Longest device name a [`JoinRequest`] may carry, in UTF-8 bytes.
pub const MAX_NAME_BYTES: usize = 64;
/// Longest PeerId string accepted as a session identity, in bytes.
pub const MAX_PEER_ID_BYTES: usize = 128;
/// Length of a SPAKE2 message on Ed25519: one side byte and a compressed point.
pub const SPAKE_MSG_BYTES: usize = 33;
/// Length of a key-confirmation MAC (HMAC-SHA256).
pub const MAC_BYTES: usize = 32;
/// Length of the random XChaCha20-Poly1305 nonce of a [`Grant`].
pub const GRANT_NONCE_BYTES: usize = 24;
/// Largest grant plaintext (signed DID update plus sync key) the protocol carries.
pub const MAX_GRANT_PLAINTEXT_BYTES: usize = 4 * 1024 * 1024;
/// Largest encoded pairing message of any kind; a reader may refuse longer frames unread.
pub const MAX_MESSAGE_BYTES: usize = GRANT_MAX_BYTES;

/// Crockford base32: digits and upper-case letters without I, L, O and U.
const ALPHABET: &[u8; 32] = b"0123456789ABCDEFGHJKMNPQRSTVWXYZ";
/// Typed codes longer than this are refused before looking at them.
const MAX_CODE_INPUT_BYTES: usize = 64;
const TAG_BYTES: usize = 16;

const KIND_JOIN_REQUEST: u8 = 1;
const KIND_APPROVER_CONFIRM: u8 = 2;
const KIND_JOINER_CONFIRM: u8 = 3;
const KIND_GRANT: u8 = 4;
/// SPAKE2 side bytes: the approver plays side A, the joiner side B.
const SIDE_APPROVER: u8 = b'A';
const SIDE_JOINER: u8 = b'B';

const HEADER_BYTES: usize = 2;
const JOIN_REQUEST_MAX_BYTES: usize =
    HEADER_BYTES + SPAKE_MSG_BYTES + 32 + 32 + 1 + MAX_NAME_BYTES + 8;
const APPROVER_CONFIRM_BYTES: usize = HEADER_BYTES + SPAKE_MSG_BYTES + MAC_BYTES;
const JOINER_CONFIRM_BYTES: usize = HEADER_BYTES + MAC_BYTES;
const GRANT_MAX_BYTES: usize =
    HEADER_BYTES + GRANT_NONCE_BYTES + 4 + MAX_GRANT_PLAINTEXT_BYTES + TAG_BYTES;

const PASSWORD_DOMAIN: &[u8] = b"nuwa-pairing/v1 code ";
const APPROVER_IDENTITY_DOMAIN: &[u8] = b"nuwa-pairing/v1 approver ";
const JOINER_IDENTITY_DOMAIN: &[u8] = b"nuwa-pairing/v1 joiner ";
const TRANSCRIPT_DOMAIN: &[u8] = b"nuwa-pairing/v1 transcript";
const LABEL_CONFIRM_APPROVER: &[u8] = b"nuwa-pairing/v1 confirm approver";
const LABEL_CONFIRM_JOINER: &[u8] = b"nuwa-pairing/v1 confirm joiner";
const LABEL_GRANT_KEY: &[u8] = b"nuwa-pairing/v1 grant key";
const GRANT_AAD_DOMAIN: &[u8] = b"nuwa-pairing/v1 grant";
const RNG_DOMAIN: &[u8] = b"nuwa-pairing/v1 spake2 rng";

type HmacSha256 = Hmac<Sha256>;

/// Why pairing failed. Every variant ends the session it came from.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PairingError {
    /// The typed code is not 8 Crockford base32 symbols.
    #[error(
        "the pairing code {reason}; type the 8 characters shown on the new device, like ABCD-EFGH"
    )]
    BadCode {
        /// What is wrong with the input.
        reason: &'static str,
    },
    /// Key confirmation failed: the two devices used different codes, or a message was
    /// altered on the way. Counts as one failed attempt ([`PairingError::counts_as_failed_attempt`]).
    #[error(
        "the pairing code does not match; check the code shown on the new device and try again"
    )]
    WrongCode,
    /// The code's time to live has passed.
    #[error("the pairing code has expired; show a new code on the new device and try again")]
    Expired,
    /// The code was already used, or failed too many times.
    #[error(
        "the pairing code can no longer be used; show a new code on the new device and try again"
    )]
    CodeBurned,
    /// Too many pairing attempts in the last window.
    #[error("too many pairing attempts; wait {retry_after_secs} s and try again")]
    RateLimited {
        /// Seconds until an attempt is allowed again.
        retry_after_secs: u64,
    },
    /// A step was called out of order, or after the session ended.
    #[error("pairing step `{step}` came while the session was {state}; start pairing again")]
    UnexpectedMessage {
        /// The step that was called.
        step: &'static str,
        /// The state the session was in.
        state: &'static str,
    },
    /// A message or input is longer than the protocol allows.
    #[error("pairing {what} is {len} bytes, more than the {max}-byte limit; start pairing again")]
    Oversized {
        /// Which message or input.
        what: &'static str,
        /// Its length.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// A message could not be decoded.
    #[error("pairing {what} is malformed: {reason}; start pairing again")]
    Malformed {
        /// Which message.
        what: &'static str,
        /// What was wrong with it.
        reason: &'static str,
    },
    /// A message uses a protocol version this build does not speak.
    #[error(
        "pairing {what} uses protocol version {version}, this build speaks version 1; update nuwa-sync on both devices"
    )]
    UnsupportedVersion {
        /// Which message.
        what: &'static str,
        /// The version byte found.
        version: u8,
    },
    /// A local argument (PeerId, device name) is not acceptable.
    #[error("pairing {what} is not valid: it {reason}")]
    InvalidInput {
        /// Which argument.
        what: &'static str,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// The grant did not authenticate under this session's key.
    #[error(
        "the grant from the approving device did not decrypt; it was altered on the way, start pairing again"
    )]
    GrantRejected,
    /// No random bytes could be had (see [`nuwa_entropy::fill`]).
    #[error("cannot draw random bytes for pairing")]
    Random(#[source] nuwa_entropy::Error),
    /// The AEAD refused to encrypt the grant.
    #[error("encrypting the {len}-byte grant failed")]
    Encrypt {
        /// Length of the plaintext.
        len: usize,
    },
}

impl PairingError {
    /// Whether this error used up one guess at the code, so the caller should report it to
    /// [`AttemptLimiter::record_failure`]. Malformed or out-of-order messages reveal nothing
    /// about the code and do not count.
    #[must_use]
    pub fn counts_as_failed_attempt(&self) -> bool {
        matches!(self, Self::WrongCode)
    }
}

// ---------------------------------------------------------------------------------------------
// The code

/// A short one-time pairing code: 8 Crockford base32 symbols (40 bits), shown as `ABCD-EFGH`.
///
/// `Display` shows the code, because showing it is its purpose; `Debug` does not. The symbols
/// are wiped on drop.
#[derive(Clone)]
pub struct PairingCode {
    symbols: Zeroizing<[u8; CODE_SYMBOLS]>,
    expires_at_unix_secs: u64,
}

impl PairingCode {
    /// Draws a fresh code valid for [`DEFAULT_CODE_TTL_SECS`] from `now_unix_secs`.
    ///
    /// # Errors
    /// [`PairingError::Random`] if the operating system's random number generator fails.
    pub fn generate(now_unix_secs: u64) -> Result<Self, PairingError> {
        Self::generate_with_ttl(now_unix_secs, DEFAULT_CODE_TTL_SECS)
    }

    /// Draws a fresh code valid for `ttl_secs` from `now_unix_secs`.
    ///
    /// # Errors
    /// [`PairingError::Random`] if the operating system's random number generator fails.
    pub fn generate_with_ttl(now_unix_secs: u64, ttl_secs: u64) -> Result<Self, PairingError> {
        let mut random = Zeroizing::new([0u8; 5]);
        nuwa_entropy::fill(random.as_mut_slice()).map_err(PairingError::Random)?;
        Ok(Self::from_random(
            &random,
            now_unix_secs.saturating_add(ttl_secs),
        ))
    }

    /// Maps 40 random bits to 8 symbols, most significant first.
    fn from_random(random: &[u8; 5], expires_at_unix_secs: u64) -> Self {
        let mut value = Zeroizing::new(0u64);
        for byte in random {
            *value = (*value << 8) | u64::from(*byte);
        }
        let mut symbols = Zeroizing::new([0u8; CODE_SYMBOLS]);
        for (i, symbol) in symbols.iter_mut().enumerate() {
            let shift = 5 * (CODE_SYMBOLS - 1 - i);
            // The mask keeps the index below 32, the alphabet's length.
            *symbol = ALPHABET[((*value >> shift) & 0x1f) as usize];
        }
        Self {
            symbols,
            expires_at_unix_secs,
        }
    }

    /// Parses a code the user typed: case-insensitive, dashes and whitespace ignored, and
    /// `O`, `I` and `L` read as `0`, `1` and `1` as Crockford base32 prescribes.
    ///
    /// A typed code does not know when it expires, so it never does until
    /// [`PairingCode::with_expiry`] sets a time; the device that generated it enforces its TTL.
    ///
    /// # Errors
    /// [`PairingError::BadCode`] saying what is wrong.
    pub fn parse(input: &str) -> Result<Self, PairingError> {
        if input.len() > MAX_CODE_INPUT_BYTES {
            return Err(PairingError::BadCode {
                reason: "is too long",
            });
        }
        let mut symbols = Zeroizing::new([0u8; CODE_SYMBOLS]);
        let mut count = 0usize;
        for c in input.chars() {
            if c == '-' || c.is_whitespace() {
                continue;
            }
            let symbol = match c.to_ascii_uppercase() {
                'O' => b'0',
                'I' | 'L' => b'1',
                'U' => {
                    return Err(PairingError::BadCode {
                        reason: "contains U, which pairing codes never use",
                    });
                }
                other if other.is_ascii() && ALPHABET.contains(&(other as u8)) => other as u8,
                _ => {
                    return Err(PairingError::BadCode {
                        reason: "contains a character that pairing codes never use",
                    });
                }
            };
            if count == CODE_SYMBOLS {
                return Err(PairingError::BadCode {
                    reason: "has more than 8 characters",
                });
            }
            symbols[count] = symbol;
            count += 1;
        }
        if count < CODE_SYMBOLS {
            return Err(PairingError::BadCode {
                reason: "has fewer than 8 characters",
            });
        }
        Ok(Self {
            symbols,
            expires_at_unix_secs: u64::MAX,
        })
    }

    /// Sets when the code stops being valid.
    #[must_use]
    pub fn with_expiry(mut self, expires_at_unix_secs: u64) -> Self {
        self.expires_at_unix_secs = expires_at_unix_secs;
        self
    }

    /// When the code stops being valid, in seconds since the Unix epoch (`u64::MAX`: never).
    #[must_use]
    pub fn expires_at_unix_secs(&self) -> u64 {
        self.expires_at_unix_secs
    }

    /// Whether the code is no longer valid at `now_unix_secs`.
    #[must_use]
    pub fn is_expired(&self, now_unix_secs: u64) -> bool {
        now_unix_secs >= self.expires_at_unix_secs
    }

    /// The code's first [`NAMEPLATE_SYMBOLS`] symbols, published (in mDNS and
    /// rendezvous) so that the approving device can find the new one. They
    /// are public: the PAKE's secret is the remaining 30 bits, and with three
    /// guesses per code an attacker succeeds with probability 3 / 2^30.
    #[must_use]
    pub fn nameplate(&self) -> String {
        self.symbols[..NAMEPLATE_SYMBOLS]
            .iter()
            .map(|&b| b as char)
            .collect()
    }

    /// The SPAKE2 password: a domain separator and the 8 canonical symbols.
    fn password(&self) -> Zeroizing<Vec<u8>> {
        let mut out = Zeroizing::new(Vec::with_capacity(PASSWORD_DOMAIN.len() + CODE_SYMBOLS));
        out.extend_from_slice(PASSWORD_DOMAIN);
        out.extend_from_slice(self.symbols.as_slice());
        out
    }

    /// Compares symbols in constant time, so a limiter lookup leaks nothing through timing.
    fn same_symbols(&self, other: &[u8; CODE_SYMBOLS]) -> bool {
        use subtle::ConstantTimeEq as _;
        self.symbols[..].ct_eq(&other[..]).into()
    }
}

impl fmt::Display for PairingCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        use fmt::Write;
        for (i, symbol) in self.symbols.iter().enumerate() {
            if i == CODE_SYMBOLS / 2 {
                f.write_char('-')?;
            }
            f.write_char(char::from(*symbol))?;
        }
        Ok(())
    }
}

impl fmt::Debug for PairingCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PairingCode")
            .field("symbols", &"<redacted>")
            .field("expires_at_unix_secs", &self.expires_at_unix_secs)
            .finish()
    }
}

// ---------------------------------------------------------------------------------------------
// Messages

/// Message 1, joiner → approver: the joiner's SPAKE2 message, its keys and its name.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct JoinRequest {
    spake_msg: [u8; SPAKE_MSG_BYTES],
    joiner_ed25519_public: [u8; 32],
    joiner_x25519_public: [u8; 32],
    name: String,
    /// The joiner asks to expire this many seconds after it is added
    /// (`pair --expires`); absent, it asks for nothing.
    expires_secs: Option<u64>,
}

/// Message 2, approver → joiner: the approver's SPAKE2 message and its confirmation MAC.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ApproverConfirm {
    spake_msg: [u8; SPAKE_MSG_BYTES],
    mac: [u8; MAC_BYTES],
}

/// Message 3, joiner → approver: the joiner's confirmation MAC.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct JoinerConfirm {
    mac: [u8; MAC_BYTES],
}

/// Message 4, approver → joiner: the caller's grant sealed under the session's grant key.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Grant {
    nonce: [u8; GRANT_NONCE_BYTES],
    ciphertext: Vec<u8>,
}

impl JoinRequest {
    /// The joiner's Ed25519 public key as it claims it; trust it only via [`VerifiedJoiner`].
    #[must_use]
    pub fn joiner_ed25519_public(&self) -> &[u8; 32] {
        &self.joiner_ed25519_public
    }

    /// The joiner's X25519 public key as it claims it; trust it only via [`VerifiedJoiner`].
    #[must_use]
    pub fn joiner_x25519_public(&self) -> &[u8; 32] {
        &self.joiner_x25519_public
    }

    /// The joiner's display name as it claims it.
    #[must_use]
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The expiry the joiner asks for, in seconds after it is added.
    #[must_use]
    pub fn expires_secs(&self) -> Option<u64> {
        self.expires_secs
    }

    /// Encodes as `version ‖ 1 ‖ spake_msg[33] ‖ ed25519[32] ‖ x25519[32] ‖ name_len u8 ‖ name`,
    /// then `expires_secs u64 BE` only when the joiner asks for an expiry (so a request
    /// without one is byte for byte what it always was).
    #[must_use]
    pub fn encode(&self) -> Vec<u8> {
        let mut out = header(KIND_JOIN_REQUEST, JOIN_REQUEST_MAX_BYTES);
        out.extend_from_slice(&self.spake_msg);
        out.extend_from_slice(&self.joiner_ed25519_public);
        out.extend_from_slice(&self.joiner_x25519_public);
        // Construction and decoding both cap the name at MAX_NAME_BYTES (64), so it fits a u8.
        out.push(self.name.len() as u8);
        out.extend_from_slice(self.name.as_bytes());
        if let Some(secs) = self.expires_secs {
            out.extend_from_slice(&secs.to_be_bytes());
        }
        out
    }

    /// Decodes and validates a join request.
    ///
    /// # Errors
    /// [`PairingError::Oversized`], [`PairingError::UnsupportedVersion`] or
    /// [`PairingError::Malformed`].
    pub fn decode(bytes: &[u8]) -> Result<Self, PairingError> {
        const WHAT: &str = "join request";
        let mut r = Reader::open(bytes, WHAT, KIND_JOIN_REQUEST, JOIN_REQUEST_MAX_BYTES)?;
        let spake_msg = r.array::<SPAKE_MSG_BYTES>()?;
        check_side(&spake_msg, SIDE_JOINER, WHAT)?;
        let joiner_ed25519_public = r.array::<32>()?;
        let joiner_x25519_public = r.array::<32>()?;
        let [name_len] = r.array::<1>()?;
        let name_bytes = r.take(usize::from(name_len))?;
        let expires_secs = if r.rest.is_empty() {
            None
        } else {
            Some(u64::from_be_bytes(r.array::<8>()?))
        };
        r.finish()?;
        let name = std::str::from_utf8(name_bytes)
            .map_err(|_| PairingError::Malformed {
                what: WHAT,
                reason: "the device name is not UTF-8",
            })?
            .to_owned();
        check_name(&name).map_err(|reason| PairingError::Malformed { what: WHAT, reason })?;
        Ok(Self {
            spake_msg,
            joiner_ed25519_public,
            joiner_x25519_public,
            name,
            expires_secs,
        })
    }
}

impl ApproverConfirm {
    /// Encodes as `version ‖ 2 ‖ spake_msg[33] ‖ mac[32]`.
    #[must_use]
    pub fn encode(&self) -> Vec<u8> {
        let mut out = header(KIND_APPROVER_CONFIRM, APPROVER_CONFIRM_BYTES);
        out.extend_from_slice(&self.spake_msg);
        out.extend_from_slice(&self.mac);
        out
    }

    /// Decodes an approver confirmation.
    ///
    /// # Errors
    /// [`PairingError::Oversized`], [`PairingError::UnsupportedVersion`] or
    /// [`PairingError::Malformed`].
    pub fn decode(bytes: &[u8]) -> Result<Self, PairingError> {
        const WHAT: &str = "approver confirmation";
        let mut r = Reader::open(bytes, WHAT, KIND_APPROVER_CONFIRM, APPROVER_CONFIRM_BYTES)?;
        let spake_msg = r.array::<SPAKE_MSG_BYTES>()?;
        check_side(&spake_msg, SIDE_APPROVER, WHAT)?;
        let mac = r.array::<MAC_BYTES>()?;
        r.finish()?;
        Ok(Self { spake_msg, mac })
    }
}

impl JoinerConfirm {
    /// Encodes as `version ‖ 3 ‖ mac[32]`.
    #[must_use]
    pub fn encode(&self) -> Vec<u8> {
        let mut out = header(KIND_JOINER_CONFIRM, JOINER_CONFIRM_BYTES);
        out.extend_from_slice(&self.mac);
        out
    }

    /// Decodes a joiner confirmation.
    ///
    /// # Errors
    /// [`PairingError::Oversized`], [`PairingError::UnsupportedVersion`] or
    /// [`PairingError::Malformed`].
    pub fn decode(bytes: &[u8]) -> Result<Self, PairingError> {
        let mut r = Reader::open(
            bytes,
            "joiner confirmation",
            KIND_JOINER_CONFIRM,
            JOINER_CONFIRM_BYTES,
        )?;
        let mac = r.array::<MAC_BYTES>()?;
        r.finish()?;
        Ok(Self { mac })
    }
}

impl Grant {
    /// Encodes as `version ‖ 4 ‖ nonce[24] ‖ ciphertext_len u32 BE ‖ ciphertext`.
    #[must_use]
    pub fn encode(&self) -> Vec<u8> {
        let mut out = header(KIND_GRANT, GRANT_MAX_BYTES);
        out.extend_from_slice(&self.nonce);
        // `Approver::grant` caps the plaintext at 4 MiB and `decode` caps the ciphertext, so
        // the length fits a u32.
        out.extend_from_slice(&(self.ciphertext.len() as u32).to_be_bytes());
        out.extend_from_slice(&self.ciphertext);
        out
    }

    /// Decodes a grant; whether it opens is checked by [`Joiner::on_grant`].
    ///
    /// # Errors
    /// [`PairingError::Oversized`], [`PairingError::UnsupportedVersion`] or
    /// [`PairingError::Malformed`].
    pub fn decode(bytes: &[u8]) -> Result<Self, PairingError> {
        const WHAT: &str = "grant";
        let mut r = Reader::open(bytes, WHAT, KIND_GRANT, GRANT_MAX_BYTES)?;
        let nonce = r.array::<GRANT_NONCE_BYTES>()?;
        let len = u32::from_be_bytes(r.array::<4>()?);
        let len = usize::try_from(len).map_err(|_| PairingError::Malformed {
            what: WHAT,
            reason: "the ciphertext length does not fit this platform",
        })?;
        if len < TAG_BYTES {
            return Err(PairingError::Malformed {
                what: WHAT,
                reason: "the ciphertext is shorter than its authentication tag",
            });
        }
        let ciphertext = r.take(len)?.to_vec();
        r.finish()?;
        Ok(Self { nonce, ciphertext })
    }
}

fn header(kind: u8, capacity: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(capacity);
    out.push(PROTOCOL_VERSION);
    out.push(kind);
    out
}

fn check_side(
    spake_msg: &[u8; SPAKE_MSG_BYTES],
    side: u8,
    what: &'static str,
) -> Result<(), PairingError> {
    if spake_msg[0] == side {
        Ok(())
    } else {
        Err(PairingError::Malformed {
            what,
            reason: "the spake2 message is for the wrong role",
        })
    }
}

/// A bounds-checked cursor over one encoded message.
struct Reader<'a> {
    rest: &'a [u8],
    what: &'static str,
}

impl<'a> Reader<'a> {
    /// Checks the size cap first, then the version and message kind.
    fn open(
        bytes: &'a [u8],
        what: &'static str,
        kind: u8,
        max: usize,
    ) -> Result<Self, PairingError> {
        if bytes.len() > max {
            return Err(PairingError::Oversized {
                what,
                len: bytes.len(),
                max,
            });
        }
        let mut reader = Self { rest: bytes, what };
        let [version, found_kind] = reader.array::<2>()?;
        if version != PROTOCOL_VERSION {
            return Err(PairingError::UnsupportedVersion { what, version });
        }
        if found_kind != kind {
            return Err(PairingError::Malformed {
                what,
                reason: "it is a different kind of pairing message",
            });
        }
        Ok(reader)
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], PairingError> {
        if self.rest.len() < n {
            return Err(PairingError::Malformed {
                what: self.what,
                reason: "it ends early",
            });
        }
        let (head, tail) = self.rest.split_at(n);
        self.rest = tail;
        Ok(head)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], PairingError> {
        let what = self.what;
        let bytes = self.take(N)?;
        bytes.try_into().map_err(|_| PairingError::Malformed {
            what,
            reason: "it ends early",
        })
    }

    fn finish(self) -> Result<(), PairingError> {
        if self.rest.is_empty() {
            Ok(())
        } else {
            Err(PairingError::Malformed {
                what: self.what,
                reason: "it has trailing bytes",
            })
        }
    }
}

fn check_name(name: &str) -> Result<(), &'static str> {
    if name.is_empty() {
        return Err("is empty");
    }
    if name.len() > MAX_NAME_BYTES {
        return Err("is longer than 64 bytes");
    }
    // The approving device shows the name to the user, so terminal escapes are refused.
    if name.chars().any(char::is_control) {
        return Err("contains control characters");
    }
    Ok(())
}

fn check_peer_id(what: &'static str, peer_id: &str) -> Result<(), PairingError> {
    let reason = if peer_id.is_empty() {
        "is empty"
    } else if peer_id.len() > MAX_PEER_ID_BYTES {
        "is longer than 128 bytes"
    } else if !peer_id.bytes().all(|b| b.is_ascii_alphanumeric()) {
        "is not a base58 or base32 PeerId string"
    } else {
        return Ok(());
    };
    Err(PairingError::InvalidInput { what, reason })
}

// ---------------------------------------------------------------------------------------------
// Key schedule

/// The values both sides hash into the transcript, in one place so they cannot drift apart.
struct TranscriptInput<'a> {
    approver_peer_id: &'a str,
    joiner_peer_id: &'a str,
    approver_spake_msg: &'a [u8; SPAKE_MSG_BYTES],
    request: &'a JoinRequest,
}

impl TranscriptInput<'_> {
    /// SHA-256 over the protocol version, both PeerIds, both SPAKE2 messages, the joiner's
    /// keys and name, each length-prefixed.
    fn hash(&self) -> [u8; 32] {
        let mut h = Sha256::new();
        update_field(&mut h, TRANSCRIPT_DOMAIN);
        update_field(&mut h, &[PROTOCOL_VERSION]);
        update_field(&mut h, self.approver_peer_id.as_bytes());
        update_field(&mut h, self.joiner_peer_id.as_bytes());
        update_field(&mut h, self.approver_spake_msg);
        update_field(&mut h, &self.request.spake_msg);
        update_field(&mut h, &self.request.joiner_ed25519_public);
        update_field(&mut h, &self.request.joiner_x25519_public);
        update_field(&mut h, self.request.name.as_bytes());
        // Bound only when asked for, so a transcript without one is unchanged.
        if let Some(secs) = self.request.expires_secs {
            update_field(&mut h, &secs.to_be_bytes());
        }
        h.finalize().into()
    }
}

/// Keys derived from the SPAKE2 key with the transcript hash as HKDF salt.
struct SessionKeys {
    confirm_approver: Zeroizing<[u8; 32]>,
    confirm_joiner: Zeroizing<[u8; 32]>,
    grant: Zeroizing<[u8; 32]>,
}

impl SessionKeys {
    fn derive(spake_key: &[u8], transcript: &[u8; 32]) -> Self {
        let hkdf = Hkdf::<Sha256>::new(Some(transcript), spake_key);
        let expand = |label: &[u8]| {
            let mut out = Zeroizing::new([0u8; 32]);
            // Invariant: HKDF-SHA256 can expand up to 255 * 32 bytes; 32 always succeeds.
            #[allow(clippy::expect_used)]
            hkdf.expand(label, out.as_mut_slice())
                .expect("32 bytes is within HKDF-SHA256's output limit");
            out
        };
        Self {
            confirm_approver: expand(LABEL_CONFIRM_APPROVER),
            confirm_joiner: expand(LABEL_CONFIRM_JOINER),
            grant: expand(LABEL_GRANT_KEY),
        }
    }
}

fn keyed_mac(key: &[u8; 32]) -> HmacSha256 {
    // Invariant: HMAC accepts keys of any length, so `new_from_slice` cannot fail here.
    #[allow(clippy::expect_used)]
    <HmacSha256 as KeyInit>::new_from_slice(key).expect("hmac accepts keys of any length")
}

fn confirmation_mac(key: &[u8; 32], transcript: &[u8; 32]) -> [u8; MAC_BYTES] {
    let mut mac = keyed_mac(key);
    mac.update(transcript);
    mac.finalize().into_bytes().into()
}

/// Checks a confirmation MAC in constant time.
fn mac_matches(key: &[u8; 32], transcript: &[u8; 32], tag: &[u8; MAC_BYTES]) -> bool {
    let mut mac = keyed_mac(key);
    mac.update(transcript);
    mac.verify_slice(tag).is_ok()
}

fn grant_aad(transcript: &[u8; 32]) -> Vec<u8> {
    let mut aad = Vec::with_capacity(GRANT_AAD_DOMAIN.len() + 32);
    aad.extend_from_slice(GRANT_AAD_DOMAIN);
    aad.extend_from_slice(transcript);
    aad
}

fn spake_identities(approver_peer_id: &str, joiner_peer_id: &str) -> (Identity, Identity) {
    let id = |domain: &[u8], peer: &str| Identity::new(&[domain, peer.as_bytes()].concat());
    (
        id(APPROVER_IDENTITY_DOMAIN, approver_peer_id),
        id(JOINER_IDENTITY_DOMAIN, joiner_peer_id),
    )
}

fn spake_msg_array(msg: &[u8], what: &'static str) -> Result<[u8; SPAKE_MSG_BYTES], PairingError> {
    msg.try_into().map_err(|_| PairingError::Malformed {
        what,
        reason: "the spake2 message has the wrong length",
    })
}

fn spake_finish(
    spake: Spake2<Ed25519Group>,
    peer_msg: &[u8; SPAKE_MSG_BYTES],
    what: &'static str,
) -> Result<Zeroizing<Vec<u8>>, PairingError> {
    spake
        .finish(peer_msg)
        .map(Zeroizing::new)
        .map_err(|_| PairingError::Malformed {
            what,
            reason: "the spake2 message is not a valid curve point",
        })
}

/// A hash-based generator seeded once from [`nuwa_entropy::fill`] (the operating system, or a
/// simulation's seeded stream), because `spake2` asks for an infallible RNG while the OS can
/// fail: the failure is reported before SPAKE2 starts.
struct SeededRng {
    seed: Zeroizing<[u8; 32]>,
    counter: u64,
    block: Zeroizing<[u8; 64]>,
    used: usize,
}

impl SeededRng {
    /// Seeds from [`nuwa_entropy::fill`]: the OS in normal operation.
    fn from_os() -> Result<Self, PairingError> {
        let mut seed = Zeroizing::new([0u8; 32]);
        nuwa_entropy::fill(seed.as_mut_slice()).map_err(PairingError::Random)?;
        Ok(Self {
            seed,
            counter: 0,
            block: Zeroizing::new([0u8; 64]),
            used: 64,
        })
    }

    fn refill(&mut self) {
        let mut h = Sha512::new();
        h.update(RNG_DOMAIN);
        h.update(self.seed.as_slice());
        h.update(self.counter.to_be_bytes());
        self.block.copy_from_slice(&h.finalize());
        self.counter = self.counter.wrapping_add(1);
        self.used = 0;
    }
}

impl spake2::rand_core::TryRng for SeededRng {
    type Error = Infallible;

    fn try_next_u32(&mut self) -> Result<u32, Infallible> {
        let mut b = [0u8; 4];
        self.try_fill_bytes(&mut b)?;
        Ok(u32::from_le_bytes(b))
    }

    fn try_next_u64(&mut self) -> Result<u64, Infallible> {
        let mut b = [0u8; 8];
        self.try_fill_bytes(&mut b)?;
        Ok(u64::from_le_bytes(b))
    }

    fn try_fill_bytes(&mut self, dst: &mut [u8]) -> Result<(), Infallible> {
        let mut filled = 0;
        while filled < dst.len() {
            if self.used == self.block.len() {
                self.refill();
            }
            let n = (dst.len() - filled).min(self.block.len() - self.used);
            dst[filled..filled + n].copy_from_slice(&self.block[self.used..self.used + n]);
            self.used += n;
            filled += n;
        }
        Ok(())
    }
}

impl spake2::rand_core::TryCryptoRng for SeededRng {}

// ---------------------------------------------------------------------------------------------
// Joiner

/// The new device's public keys, sent in the [`JoinRequest`] for the approver to register.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct JoinerPublicKeys {
    /// The device's Ed25519 key, which is also its libp2p identity.
    pub ed25519_public: [u8; 32],
    /// The device's X25519 key-agreement key, to which later sync keys are sealed.
    pub x25519_public: [u8; 32],
}

/// What the joiner ends with.
#[non_exhaustive]
pub enum JoinerOutcome {
    /// The approver's grant plaintext (signed DID update and sync key), wiped on drop.
    Granted(Zeroizing<Vec<u8>>),
}

impl fmt::Debug for JoinerOutcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Granted(plaintext) => write!(f, "Granted(<{} bytes redacted>)", plaintext.len()),
        }
    }
}

enum JoinerState {
    Ready,
    AwaitingConfirm {
        spake: Box<Spake2<Ed25519Group>>,
        approver_peer_id: String,
        request: JoinRequest,
    },
    AwaitingGrant {
        grant_key: Zeroizing<[u8; 32]>,
        transcript: [u8; 32],
    },
    Finished,
    Failed,
}

impl JoinerState {
    fn name(&self) -> &'static str {
        match self {
            Self::Ready => "ready to start",
            Self::AwaitingConfirm { .. } => "awaiting the approver's confirmation",
            Self::AwaitingGrant { .. } => "awaiting the grant",
            Self::Finished => "finished",
            Self::Failed => "failed",
        }
    }
}

/// The new device's side of one pairing session.
///
/// Drive it with [`Joiner::start`], [`Joiner::on_approver_confirm`] and [`Joiner::on_grant`]
/// in that order. Any error ends the session.
pub struct Joiner {
    code: PairingCode,
    joiner_peer_id: String,
    keys: JoinerPublicKeys,
    name: String,
    expires_secs: Option<u64>,
    state: JoinerState,
}

impl fmt::Debug for Joiner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Joiner")
            .field("joiner_peer_id", &self.joiner_peer_id)
            .field("name", &self.name)
            .field("state", &self.state.name())
            .finish_non_exhaustive()
    }
}

impl Joiner {
    /// A session for the code this device shows, its own PeerId, its public keys and the name
    /// the approving device will show.
    ///
    /// # Errors
    /// [`PairingError::InvalidInput`] for an unusable PeerId or name (1 to 64 bytes, no
    /// control characters).
    pub fn new(
        code: PairingCode,
        joiner_peer_id: &str,
        keys: JoinerPublicKeys,
        name: &str,
    ) -> Result<Self, PairingError> {
        check_peer_id("joiner peer id", joiner_peer_id)?;
        check_name(name).map_err(|reason| PairingError::InvalidInput {
            what: "device name",
            reason,
        })?;
        Ok(Self {
            code,
            joiner_peer_id: joiner_peer_id.to_owned(),
            keys,
            name: name.to_owned(),
            expires_secs: None,
            state: JoinerState::Ready,
        })
    }

    /// Asks the approver to list this device as expiring `secs` after it
    /// is added (`pair --expires`); the approver may make it shorter.
    #[must_use]
    pub fn with_expiry(mut self, secs: Option<u64>) -> Self {
        self.expires_secs = secs;
        self
    }

    /// Binds the approver, whose PeerId the joiner learns from the authenticated connection
    /// the pairing stream runs on, and produces the first message.
    ///
    /// # Errors
    /// [`PairingError::Expired`], [`PairingError::InvalidInput`], [`PairingError::Random`],
    /// or [`PairingError::UnexpectedMessage`] if the session already started.
    pub fn start(
        &mut self,
        approver_peer_id: &str,
        now_unix_secs: u64,
    ) -> Result<JoinRequest, PairingError> {
        match std::mem::replace(&mut self.state, JoinerState::Failed) {
            JoinerState::Ready => {}
            other => return Err(unexpected("start", &other)),
        }
        check_peer_id("approver peer id", approver_peer_id)?;
        if self.code.is_expired(now_unix_secs) {
            return Err(PairingError::Expired);
        }
        let mut rng = SeededRng::from_os()?;
        let (id_a, id_b) = spake_identities(approver_peer_id, &self.joiner_peer_id);
        let password = Password::new(self.code.password().as_slice());
        let (spake, msg) =
            Spake2::<Ed25519Group>::start_b_with_rng(&password, &id_a, &id_b, &mut rng);
        let request = JoinRequest {
            spake_msg: spake_msg_array(&msg, "join request")?,
            joiner_ed25519_public: self.keys.ed25519_public,
            joiner_x25519_public: self.keys.x25519_public,
            name: self.name.clone(),
            expires_secs: self.expires_secs,
        };
        self.state = JoinerState::AwaitingConfirm {
            spake: Box::new(spake),
            approver_peer_id: approver_peer_id.to_owned(),
            request: request.clone(),
        };
        Ok(request)
    }

    /// Checks the approver's confirmation and answers with the joiner's.
    ///
    /// # Errors
    /// [`PairingError::WrongCode`] if the codes differ or anything in the exchange was
    /// altered; [`PairingError::Expired`]; [`PairingError::Malformed`] for an invalid SPAKE2
    /// message; [`PairingError::UnexpectedMessage`] out of order.
    pub fn on_approver_confirm(
        &mut self,
        msg: &ApproverConfirm,
        now_unix_secs: u64,
    ) -> Result<JoinerConfirm, PairingError> {
        let (spake, approver_peer_id, request) =
            match std::mem::replace(&mut self.state, JoinerState::Failed) {
                JoinerState::AwaitingConfirm {
                    spake,
                    approver_peer_id,
                    request,
                } => (spake, approver_peer_id, request),
                other => return Err(unexpected("approver confirmation", &other)),
            };
        if self.code.is_expired(now_unix_secs) {
            return Err(PairingError::Expired);
        }
        let spake_key = spake_finish(*spake, &msg.spake_msg, "approver confirmation")?;
        let transcript = TranscriptInput {
            approver_peer_id: &approver_peer_id,
            joiner_peer_id: &self.joiner_peer_id,
            approver_spake_msg: &msg.spake_msg,
            request: &request,
        }
        .hash();
        let keys = SessionKeys::derive(&spake_key, &transcript);
        if !mac_matches(&keys.confirm_approver, &transcript, &msg.mac) {
            return Err(PairingError::WrongCode);
        }
        let reply = JoinerConfirm {
            mac: confirmation_mac(&keys.confirm_joiner, &transcript),
        };
        self.state = JoinerState::AwaitingGrant {
            grant_key: keys.grant.clone(),
            transcript,
        };
        Ok(reply)
    }

    /// Opens the approver's grant and ends the session.
    ///
    /// # Errors
    /// [`PairingError::GrantRejected`] if it does not authenticate under this session's key;
    /// [`PairingError::UnexpectedMessage`] out of order.
    pub fn on_grant(&mut self, msg: &Grant) -> Result<JoinerOutcome, PairingError> {
        let (grant_key, transcript) = match std::mem::replace(&mut self.state, JoinerState::Failed)
        {
            JoinerState::AwaitingGrant {
                grant_key,
                transcript,
            } => (grant_key, transcript),
            other => return Err(unexpected("grant", &other)),
        };
        let cipher = XChaCha20Poly1305::new((&*grant_key).into());
        let plaintext = cipher
            .decrypt(
                (&msg.nonce).into(),
                Payload {
                    msg: &msg.ciphertext,
                    aad: &grant_aad(&transcript),
                },
            )
            .map(Zeroizing::new)
            .map_err(|_| PairingError::GrantRejected)?;
        self.state = JoinerState::Finished;
        Ok(JoinerOutcome::Granted(plaintext))
    }
}

fn unexpected(step: &'static str, state: &JoinerState) -> PairingError {
    PairingError::UnexpectedMessage {
        step,
        state: state.name(),
    }
}

// ---------------------------------------------------------------------------------------------
// Approver

/// The joiner as the approver knows it after key confirmation: these keys and this name were
/// sent by a device that knows the code, over the connection to `peer_id`.
///
/// Before registering the keys the caller must still check that `ed25519_public` is the key
/// behind `peer_id`; this crate does not know libp2p's PeerId encoding.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VerifiedJoiner {
    /// The joiner's PeerId, as given to [`Approver::new`].
    pub peer_id: String,
    /// The joiner's Ed25519 public key.
    pub ed25519_public: [u8; 32],
    /// The joiner's X25519 public key.
    pub x25519_public: [u8; 32],
    /// The joiner's display name (1 to 64 bytes, no control characters).
    pub name: String,
    /// The expiry the joiner asked for (seconds after it is added), bound
    /// by the transcript like its keys and name.
    pub expires_secs: Option<u64>,
}

enum ApproverState {
    AwaitingJoinRequest,
    AwaitingJoinerConfirm {
        confirm_joiner: Zeroizing<[u8; 32]>,
        grant_key: Zeroizing<[u8; 32]>,
        transcript: [u8; 32],
        joiner: VerifiedJoiner,
    },
    ReadyToGrant {
        grant_key: Zeroizing<[u8; 32]>,
        transcript: [u8; 32],
    },
    Finished,
    Failed,
}

impl ApproverState {
    fn name(&self) -> &'static str {
        match self {
            Self::AwaitingJoinRequest => "awaiting the join request",
            Self::AwaitingJoinerConfirm { .. } => "awaiting the joiner's confirmation",
            Self::ReadyToGrant { .. } => "ready to grant",
            Self::Finished => "finished",
            Self::Failed => "failed",
        }
    }
}

/// The authorised device's side of one pairing session.
///
/// Drive it with [`Approver::on_join_request`], [`Approver::on_joiner_confirm`] and
/// [`Approver::grant`] in that order. Any error ends the session.
pub struct Approver {
    code: PairingCode,
    approver_peer_id: String,
    joiner_peer_id: String,
    state: ApproverState,
}

impl fmt::Debug for Approver {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Approver")
            .field("approver_peer_id", &self.approver_peer_id)
            .field("joiner_peer_id", &self.joiner_peer_id)
            .field("state", &self.state.name())
            .finish_non_exhaustive()
    }
}

impl Approver {
    /// A session for the code the user typed, this device's PeerId and the PeerId of the
    /// connection the join request arrives on.
    ///
    /// # Errors
    /// [`PairingError::InvalidInput`] for an unusable PeerId.
    pub fn new(
        code: PairingCode,
        approver_peer_id: &str,
        joiner_peer_id: &str,
    ) -> Result<Self, PairingError> {
        check_peer_id("approver peer id", approver_peer_id)?;
        check_peer_id("joiner peer id", joiner_peer_id)?;
        Ok(Self {
            code,
            approver_peer_id: approver_peer_id.to_owned(),
            joiner_peer_id: joiner_peer_id.to_owned(),
            state: ApproverState::AwaitingJoinRequest,
        })
    }

    /// Runs SPAKE2 against the join request and answers with the approver's confirmation.
    ///
    /// # Errors
    /// [`PairingError::Expired`], [`PairingError::Malformed`] for an invalid SPAKE2 message,
    /// [`PairingError::Random`], or [`PairingError::UnexpectedMessage`] out of order.
    pub fn on_join_request(
        &mut self,
        request: &JoinRequest,
        now_unix_secs: u64,
    ) -> Result<ApproverConfirm, PairingError> {
        match std::mem::replace(&mut self.state, ApproverState::Failed) {
            ApproverState::AwaitingJoinRequest => {}
            other => return Err(approver_unexpected("join request", &other)),
        }
        if self.code.is_expired(now_unix_secs) {
            return Err(PairingError::Expired);
        }
        let mut rng = SeededRng::from_os()?;
        let (id_a, id_b) = spake_identities(&self.approver_peer_id, &self.joiner_peer_id);
        let password = Password::new(self.code.password().as_slice());
        let (spake, msg) =
            Spake2::<Ed25519Group>::start_a_with_rng(&password, &id_a, &id_b, &mut rng);
        let approver_spake_msg = spake_msg_array(&msg, "approver confirmation")?;
        let spake_key = spake_finish(spake, &request.spake_msg, "join request")?;
        let transcript = TranscriptInput {
            approver_peer_id: &self.approver_peer_id,
            joiner_peer_id: &self.joiner_peer_id,
            approver_spake_msg: &approver_spake_msg,
            request,
        }
        .hash();
        let keys = SessionKeys::derive(&spake_key, &transcript);
        let reply = ApproverConfirm {
            spake_msg: approver_spake_msg,
            mac: confirmation_mac(&keys.confirm_approver, &transcript),
        };
        self.state = ApproverState::AwaitingJoinerConfirm {
            confirm_joiner: keys.confirm_joiner.clone(),
            grant_key: keys.grant.clone(),
            transcript,
            joiner: VerifiedJoiner {
                peer_id: self.joiner_peer_id.clone(),
                ed25519_public: request.joiner_ed25519_public,
                x25519_public: request.joiner_x25519_public,
                name: request.name.clone(),
                expires_secs: request.expires_secs,
            },
        };
        Ok(reply)
    }

    /// Checks the joiner's confirmation; on success the joiner's keys are authenticated.
    ///
    /// # Errors
    /// [`PairingError::WrongCode`] if the joiner does not hold the same session key (wrong
    /// code, or an altered exchange); [`PairingError::Expired`];
    /// [`PairingError::UnexpectedMessage`] out of order.
    pub fn on_joiner_confirm(
        &mut self,
        msg: &JoinerConfirm,
        now_unix_secs: u64,
    ) -> Result<VerifiedJoiner, PairingError> {
        let (confirm_joiner, grant_key, transcript, joiner) =
            match std::mem::replace(&mut self.state, ApproverState::Failed) {
                ApproverState::AwaitingJoinerConfirm {
                    confirm_joiner,
                    grant_key,
                    transcript,
                    joiner,
                } => (confirm_joiner, grant_key, transcript, joiner),
                other => return Err(approver_unexpected("joiner confirmation", &other)),
            };
        if self.code.is_expired(now_unix_secs) {
            return Err(PairingError::Expired);
        }
        if !mac_matches(&confirm_joiner, &transcript, &msg.mac) {
            return Err(PairingError::WrongCode);
        }
        self.state = ApproverState::ReadyToGrant {
            grant_key,
            transcript,
        };
        Ok(joiner)
    }

    /// Seals `grant_plaintext` (the signed DID update and the sync key) for the joiner and
    /// ends the session.
    ///
    /// # Errors
    /// [`PairingError::Oversized`] over [`MAX_GRANT_PLAINTEXT_BYTES`], [`PairingError::Random`],
    /// [`PairingError::Encrypt`], or [`PairingError::UnexpectedMessage`] before the joiner
    /// confirmed.
    pub fn grant(&mut self, grant_plaintext: &[u8]) -> Result<Grant, PairingError> {
        let (grant_key, transcript) =
            match std::mem::replace(&mut self.state, ApproverState::Failed) {
                ApproverState::ReadyToGrant {
                    grant_key,
                    transcript,
                } => (grant_key, transcript),
                other => return Err(approver_unexpected("grant", &other)),
            };
        if grant_plaintext.len() > MAX_GRANT_PLAINTEXT_BYTES {
            return Err(PairingError::Oversized {
                what: "grant plaintext",
                len: grant_plaintext.len(),
                max: MAX_GRANT_PLAINTEXT_BYTES,
            });
        }
        let mut nonce = [0u8; GRANT_NONCE_BYTES];
        nuwa_entropy::fill(&mut nonce).map_err(PairingError::Random)?;
        let cipher = XChaCha20Poly1305::new((&*grant_key).into());
        let ciphertext = cipher
            .encrypt(
                (&nonce).into(),
                Payload {
                    msg: grant_plaintext,
                    aad: &grant_aad(&transcript),
                },
            )
            .map_err(|_| PairingError::Encrypt {
                len: grant_plaintext.len(),
            })?;
        self.state = ApproverState::Finished;
        Ok(Grant { nonce, ciphertext })
    }
}

fn approver_unexpected(step: &'static str, state: &ApproverState) -> PairingError {
    PairingError::UnexpectedMessage {
        step,
        state: state.name(),
    }
}

// ---------------------------------------------------------------------------------------------
// Attempt limiter

/// Limits for [`AttemptLimiter`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LimiterConfig {
    /// Failed attempts after which a code is burned.
    pub max_failures_per_code: u32,
    /// Attempts allowed in any window of `window_secs`, over all codes.
    pub max_attempts_per_window: u32,
    /// Length of the rate window.
    pub window_secs: u64,
    /// Codes remembered at once; the one expiring soonest is forgotten first.
    pub max_tracked_codes: usize,
}

impl Default for LimiterConfig {
    fn default() -> Self {
        Self {
            max_failures_per_code: 3,
            max_attempts_per_window: 10,
            window_secs: 60,
            max_tracked_codes: 64,
        }
    }
}

struct CodeRecord {
    symbols: Zeroizing<[u8; CODE_SYMBOLS]>,
    expires_at_unix_secs: u64,
    failures: u32,
    used: bool,
}

/// Counts pairing attempts, IO-free: at most `max_failures_per_code` failures per code (then
/// the code is burned), at most `max_attempts_per_window` attempts per window over all codes,
/// no attempt on an expired code, and no second use of a code that paired successfully.
///
/// Call [`AttemptLimiter::begin_attempt`] before starting a [`Joiner`] or [`Approver`]
/// session, then [`AttemptLimiter::record_failure`] when the session ends with an error that
/// [counts](PairingError::counts_as_failed_attempt), or [`AttemptLimiter::record_success`].
pub struct AttemptLimiter {
    config: LimiterConfig,
    codes: Vec<CodeRecord>,
    recent_attempts_unix_secs: VecDeque<u64>,
}

impl fmt::Debug for AttemptLimiter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AttemptLimiter")
            .field("config", &self.config)
            .field("tracked_codes", &self.codes.len())
            .field("recent_attempts", &self.recent_attempts_unix_secs.len())
            .finish()
    }
}

impl Default for AttemptLimiter {
    fn default() -> Self {
        Self::new(LimiterConfig::default())
    }
}

impl AttemptLimiter {
    /// A limiter with the given limits.
    #[must_use]
    pub fn new(config: LimiterConfig) -> Self {
        Self {
            config,
            codes: Vec::new(),
            recent_attempts_unix_secs: VecDeque::new(),
        }
    }

    /// Admits one attempt with `code` at `now_unix_secs`, or says why not. An admitted attempt
    /// counts against the rate window; a refused one does not.
    ///
    /// # Errors
    /// [`PairingError::Expired`], [`PairingError::CodeBurned`] or
    /// [`PairingError::RateLimited`], checked in that order.
    pub fn begin_attempt(
        &mut self,
        code: &PairingCode,
        now_unix_secs: u64,
    ) -> Result<(), PairingError> {
        if code.is_expired(now_unix_secs) {
            return Err(PairingError::Expired);
        }
        if let Some(record) = self.find(code) {
            if record.used || record.failures >= self.config.max_failures_per_code {
                return Err(PairingError::CodeBurned);
            }
        }
        let window = self.config.window_secs;
        while let Some(&oldest) = self.recent_attempts_unix_secs.front() {
            if oldest.saturating_add(window) <= now_unix_secs {
                self.recent_attempts_unix_secs.pop_front();
            } else {
                break;
            }
        }
        let max = usize::try_from(self.config.max_attempts_per_window).unwrap_or(usize::MAX);
        if self.recent_attempts_unix_secs.len() >= max {
            let oldest = self
                .recent_attempts_unix_secs
                .front()
                .copied()
                .unwrap_or(now_unix_secs);
            let retry_after_secs = oldest
                .saturating_add(window)
                .saturating_sub(now_unix_secs)
                .max(1);
            return Err(PairingError::RateLimited { retry_after_secs });
        }
        self.recent_attempts_unix_secs.push_back(now_unix_secs);
        Ok(())
    }

    /// Records a failed attempt with `code` and returns how many attempts it has left (0: the
    /// code is burned).
    pub fn record_failure(&mut self, code: &PairingCode) -> u32 {
        let max = self.config.max_failures_per_code;
        let record = self.record_for(code);
        record.failures = record.failures.saturating_add(1);
        if record.used {
            0
        } else {
            max.saturating_sub(record.failures)
        }
    }

    /// Records that `code` paired a device, so it cannot be used again.
    pub fn record_success(&mut self, code: &PairingCode) {
        self.record_for(code).used = true;
    }

    /// Attempts `code` has left before it is burned.
    #[must_use]
    pub fn remaining_attempts(&self, code: &PairingCode) -> u32 {
        match self.find(code) {
            Some(record) if record.used => 0,
            Some(record) => self
                .config
                .max_failures_per_code
                .saturating_sub(record.failures),
            None => self.config.max_failures_per_code,
        }
    }

    fn find(&self, code: &PairingCode) -> Option<&CodeRecord> {
        self.codes.iter().find(|r| code.same_symbols(&r.symbols))
    }

    fn record_for(&mut self, code: &PairingCode) -> &mut CodeRecord {
        let index = match self
            .codes
            .iter()
            .position(|r| code.same_symbols(&r.symbols))
        {
            Some(index) => index,
            None => {
                if self.codes.len() >= self.config.max_tracked_codes.max(1) {
                    // Forget the code that expires soonest: it is the least useful to guess.
                    if let Some(evict) = self
                        .codes
                        .iter()
                        .enumerate()
                        .min_by_key(|(_, r)| r.expires_at_unix_secs)
                        .map(|(i, _)| i)
                    {
                        self.codes.swap_remove(evict);
                    }
                }
                self.codes.push(CodeRecord {
                    symbols: code.symbols.clone(),
                    expires_at_unix_secs: code.expires_at_unix_secs,
                    failures: 0,
                    used: false,
                });
                self.codes.len() - 1
            }
        };
        &mut self.codes[index]
    }
}

#[cfg(test)]
mod tests;
