//! Signed device announcements: the format of the mDNS TXT record every
//! device of an agent publishes, and the checks a browser makes on one.
//!
//! An [`Announcement`] is NIP-6's `(OperationalContextID, ConnectionInfo,
//! Timestamp, Signature)` tuple plus the agent it belongs to. This module
//! builds, signs (through a caller-supplied callback), verifies and
//! encodes/decodes it.
//!
//! What it leaves to others:
//! - **Which key may announce for an agent.** The caller resolves
//!   `context_id` in the agent's DID document and hands the raw Ed25519
//!   public key to [`Announcement::verify`].
//! - **The SRV record's port.** The transport (`nuwa-discovery`) reports the
//!   TXT entries and the addresses with the SRV port as they came; the caller
//!   checks that the SRV port equals the signed [`Announcement::port`] (only
//!   the TXT record is signed).
//! - **Secret keys and clocks.** Signing goes through a callback, and `now`
//!   is a parameter.
//! - **mDNS itself.** Publishing and browsing are `nuwa-discovery`'s, which
//!   knows nothing of this format.
//!
//! TXT layout (keys are short because a TXT record should stay well under
//! 1300 bytes and each `key=value` entry under 255 bytes):
//!
//! | key    | value                                                        |
//! |--------|--------------------------------------------------------------|
//! | `v`    | protocol version, canonical decimal                          |
//! | `did`  | agent DID, at most [`MAX_INLINE_DID_LEN`] bytes, or …        |
//! | `didh` | … base64url (no padding) SHA-256 of the agent DID            |
//! | `ctx`  | `OperationalContextID` (DID URL fragment of the device key) |
//! | `peer` | base58 libp2p PeerId, opaque here                            |
//! | `port` | TCP port, canonical decimal, non-zero                        |
//! | `ts`   | Unix seconds, canonical non-negative decimal                 |
//! | `sig`  | base64url (no padding) Ed25519 signature over [`Announcement::signing_bytes`] |

use std::fmt;

use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use ed25519_dalek::{Signature, VerifyingKey};
use sha2::{Digest as _, Sha256};

/// Version of the announcement format and of the sync protocol it advertises.
pub const PROTOCOL_VERSION: u32 = 1;

/// DIDs up to this many bytes travel inline (`did=`); longer ones travel as
/// their SHA-256 (`didh=`), so the `did=` entry always fits in 255 bytes.
pub const MAX_INLINE_DID_LEN: usize = 200;
/// Upper bound on the `OperationalContextID` (a DID URL fragment).
pub const MAX_CONTEXT_ID_LEN: usize = 128;
/// Upper bound on the PeerId text. Ed25519 PeerIds are 52 characters; the
/// slack admits other key types without letting a record grow unbounded.
pub const MAX_PEER_ID_LEN: usize = 128;
/// Upper bound on TXT entries considered, known or unknown.
pub const MAX_TXT_ENTRIES: usize = 16;

/// Domain separator, so that a signature over an announcement can never be
/// replayed as a signature over any other nuwa message (NIP-2 style).
const DOMAIN_SEPARATOR: &[u8] = b"NUWA_MDNS_ANNOUNCE_V1:";

/// DNS-SD limit for one `key=value` TXT string (RFC 6763 §6.1).
const MAX_TXT_ENTRY_LEN: usize = 255;
/// `u64::MAX` has 20 decimal digits; anything longer cannot be a valid number.
const MAX_DECIMAL_DIGITS: usize = 20;
/// Base64url without padding of 32 and 64 bytes.
const DID_HASH_B64_LEN: usize = 43;
const SIGNATURE_B64_LEN: usize = 86;

const KEY_VERSION: &str = "v";
const KEY_DID: &str = "did";
const KEY_DID_HASH: &str = "didh";
const KEY_CONTEXT: &str = "ctx";
const KEY_PEER: &str = "peer";
const KEY_PORT: &str = "port";
const KEY_TIMESTAMP: &str = "ts";
const KEY_SIGNATURE: &str = "sig";

/// Tags inside [`Announcement::signing_bytes`] that keep the two agent forms
/// from ever producing the same signed bytes.
const TAG_DID: u8 = 0x01;
const TAG_DID_HASH: u8 = 0x02;

/// Which agent an announcement belongs to.
#[derive(Clone, PartialEq, Eq, Hash)]
pub enum AgentRef {
    /// The agent DID itself, when it is at most [`MAX_INLINE_DID_LEN`] bytes.
    Did(String),
    /// SHA-256 of the agent DID's UTF-8 bytes, for longer DIDs.
    DidHash([u8; 32]),
}

impl AgentRef {
    /// The form an announcement for `did` uses: inline when it fits, hashed
    /// otherwise.
    pub fn for_did(did: &str) -> AgentRef {
        if did.len() <= MAX_INLINE_DID_LEN {
            AgentRef::Did(did.to_owned())
        } else {
            AgentRef::DidHash(did_hash(did))
        }
    }

    /// Whether this reference denotes `did`.
    pub fn matches(&self, did: &str) -> bool {
        match self {
            AgentRef::Did(own) => own == did,
            AgentRef::DidHash(hash) => *hash == did_hash(did),
        }
    }
}

impl fmt::Display for AgentRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AgentRef::Did(did) => f.write_str(did),
            AgentRef::DidHash(hash) => write!(f, "sha256:{}", hex::encode(hash)),
        }
    }
}

impl fmt::Debug for AgentRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AgentRef::Did(did) => f.debug_tuple("Did").field(did).finish(),
            AgentRef::DidHash(hash) => f.debug_tuple("DidHash").field(&hex::encode(hash)).finish(),
        }
    }
}

/// A device's signed statement "I, `context_id` of `agent`, am reachable as
/// `peer_id` on `port`", as carried in its mDNS TXT record.
///
/// Parsing one (see [`Announcement::from_txt`]) proves nothing; call
/// [`Announcement::verify`] with the key the agent's DID document lists for
/// `context_id`.
#[derive(Clone, PartialEq, Eq)]
pub struct Announcement {
    /// The agent this device belongs to.
    pub agent: AgentRef,
    /// `OperationalContextID`: the DID URL fragment of the device key.
    pub context_id: String,
    /// Base58 libp2p PeerId. Opaque here; `net` checks it against the key.
    pub peer_id: String,
    /// TCP port the device's libp2p listener accepts on.
    pub port: u16,
    /// Announcement format / sync protocol version.
    pub protocol_version: u32,
    /// When the announcement was signed, in Unix seconds.
    pub timestamp_unix_secs: i64,
    /// Ed25519 signature over [`Announcement::signing_bytes`].
    pub signature: [u8; 64],
}

impl fmt::Debug for Announcement {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // A signature is public, but 128 hex digits drown every log line.
        let sig = hex::encode(&self.signature[..8]);
        f.debug_struct("Announcement")
            .field("agent", &self.agent)
            .field("context_id", &self.context_id)
            .field("peer_id", &self.peer_id)
            .field("port", &self.port)
            .field("protocol_version", &self.protocol_version)
            .field("timestamp_unix_secs", &self.timestamp_unix_secs)
            .field("signature", &format_args!("{sig}…"))
            .finish()
    }
}

/// Why an announcement was rejected.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum AnnounceError {
    /// The TXT record does not decode into an announcement.
    #[error("malformed announcement txt record: {reason}")]
    Malformed {
        /// Which field was wrong and how.
        reason: String,
    },
    /// The announcement speaks a protocol version this build does not.
    #[error(
        "unsupported announcement protocol version {version} (this build speaks {PROTOCOL_VERSION})"
    )]
    UnsupportedVersion {
        /// The version the announcement claims.
        version: u32,
    },
    /// The timestamp is further than `max_age_secs` from `now`, in either direction.
    #[error(
        "announcement timestamp {timestamp_unix_secs} is more than {max_age_secs} s away from now ({now_unix_secs}); \
         the announcer must re-sign, or the clocks disagree"
    )]
    Stale {
        /// The announced timestamp.
        timestamp_unix_secs: i64,
        /// The verifier's clock.
        now_unix_secs: i64,
        /// The accepted distance.
        max_age_secs: i64,
    },
    /// The public key handed to [`Announcement::verify`] is not a valid Ed25519 point.
    #[error("public key for announcement verification is not a valid ed25519 key")]
    InvalidPublicKey {
        /// The underlying decoding failure.
        #[source]
        source: ed25519_dalek::SignatureError,
    },
    /// The signature does not verify under the given key.
    #[error("announcement signature does not verify under the given public key")]
    BadSignature {
        /// The underlying verification failure.
        #[source]
        source: ed25519_dalek::SignatureError,
    },
}

fn malformed(reason: impl Into<String>) -> AnnounceError {
    AnnounceError::Malformed {
        reason: reason.into(),
    }
}

fn did_hash(did: &str) -> [u8; 32] {
    Sha256::digest(did.as_bytes()).into()
}

/// Feeds `bytes` with a length prefix, so adjacent variable-length fields can
/// never be re-split into a different, equally valid tuple.
fn update_len_prefixed(hasher: &mut Sha256, bytes: &[u8]) {
    // usize → u64 is lossless on every platform Rust supports.
    hasher.update((bytes.len() as u64).to_be_bytes());
    hasher.update(bytes);
}

impl Announcement {
    /// Builds an announcement for the current [`PROTOCOL_VERSION`] and signs it
    /// with `sign`, which receives [`Announcement::signing_bytes`] and returns an
    /// Ed25519 signature over them.
    ///
    /// The agent is carried inline when `agent_did` is at most
    /// [`MAX_INLINE_DID_LEN`] bytes, and as its SHA-256 otherwise.
    pub fn new_signed(
        agent_did: &str,
        context_id: impl Into<String>,
        peer_id: impl Into<String>,
        port: u16,
        timestamp_unix_secs: i64,
        sign: impl FnOnce(&[u8]) -> [u8; 64],
    ) -> Announcement {
        let mut announcement = Announcement {
            agent: AgentRef::for_did(agent_did),
            context_id: context_id.into(),
            peer_id: peer_id.into(),
            port,
            protocol_version: PROTOCOL_VERSION,
            timestamp_unix_secs,
            signature: [0; 64],
        };
        announcement.signature = sign(&announcement.signing_bytes());
        announcement
    }

    /// The 32 bytes that get signed: SHA-256 of the domain separator
    /// `NUWA_MDNS_ANNOUNCE_V1:` followed by an unambiguous encoding of every
    /// field except the signature.
    ///
    /// Encoding: agent tag byte (`0x01` DID, `0x02` DID hash) and the
    /// u64-big-endian-length-prefixed agent bytes; then the length-prefixed
    /// `context_id` and `peer_id`; then `port` (u16 BE), `protocol_version`
    /// (u32 BE) and `timestamp_unix_secs` (i64 BE).
    pub fn signing_bytes(&self) -> Vec<u8> {
        let mut hasher = Sha256::new();
        hasher.update(DOMAIN_SEPARATOR);
        match &self.agent {
            AgentRef::Did(did) => {
                hasher.update([TAG_DID]);
                update_len_prefixed(&mut hasher, did.as_bytes());
            }
            AgentRef::DidHash(hash) => {
                hasher.update([TAG_DID_HASH]);
                update_len_prefixed(&mut hasher, hash);
            }
        }
        update_len_prefixed(&mut hasher, self.context_id.as_bytes());
        update_len_prefixed(&mut hasher, self.peer_id.as_bytes());
        hasher.update(self.port.to_be_bytes());
        hasher.update(self.protocol_version.to_be_bytes());
        hasher.update(self.timestamp_unix_secs.to_be_bytes());
        hasher.finalize().to_vec()
    }

    /// Checks that this announcement speaks our protocol version, is at most
    /// `max_age_secs` old (or early), and carries a valid strict Ed25519
    /// signature by `public`.
    ///
    /// `public` must be the key the agent's DID document lists for
    /// `context_id`; looking it up, and checking that it is active, is the
    /// caller's job. Freshness is checked before the signature so that a flood
    /// of replayed old announcements costs no curve arithmetic.
    pub fn verify(
        &self,
        public: &[u8; 32],
        now_unix_secs: i64,
        max_age_secs: i64,
    ) -> Result<(), AnnounceError> {
        if self.protocol_version != PROTOCOL_VERSION {
            return Err(AnnounceError::UnsupportedVersion {
                version: self.protocol_version,
            });
        }
        // i128 so that no pair of i64 timestamps can overflow the subtraction.
        let distance = (i128::from(now_unix_secs) - i128::from(self.timestamp_unix_secs)).abs();
        // A negative window accepts nothing.
        if distance > i128::from(max_age_secs) {
            return Err(AnnounceError::Stale {
                timestamp_unix_secs: self.timestamp_unix_secs,
                now_unix_secs,
                max_age_secs,
            });
        }
        let key = VerifyingKey::from_bytes(public)
            .map_err(|source| AnnounceError::InvalidPublicKey { source })?;
        let signature = Signature::from_bytes(&self.signature);
        key.verify_strict(&self.signing_bytes(), &signature)
            .map_err(|source| AnnounceError::BadSignature { source })
    }

    /// Whether this announcement claims to belong to the agent `did`,
    /// comparing the DID itself or its SHA-256, whichever was announced.
    pub fn matches_agent(&self, did: &str) -> bool {
        self.agent.matches(did)
    }

    /// The TXT record entries for this announcement, in a fixed order.
    ///
    /// Use [`Announcement::from_txt`] on the result to check that an
    /// announcement built from outside input is publishable: peers decode it
    /// with the same function.
    pub fn to_txt(&self) -> Vec<(String, String)> {
        let agent = match &self.agent {
            AgentRef::Did(did) => (KEY_DID.to_owned(), did.clone()),
            AgentRef::DidHash(hash) => (KEY_DID_HASH.to_owned(), URL_SAFE_NO_PAD.encode(hash)),
        };
        vec![
            (KEY_VERSION.to_owned(), self.protocol_version.to_string()),
            agent,
            (KEY_CONTEXT.to_owned(), self.context_id.clone()),
            (KEY_PEER.to_owned(), self.peer_id.clone()),
            (KEY_PORT.to_owned(), self.port.to_string()),
            (
                KEY_TIMESTAMP.to_owned(),
                self.timestamp_unix_secs.to_string(),
            ),
            (
                KEY_SIGNATURE.to_owned(),
                URL_SAFE_NO_PAD.encode(self.signature),
            ),
        ]
    }

    /// Parses TXT record entries strictly: every known field is required
    /// exactly once (exactly one of `did`/`didh`), bounded in length, canonical
    /// in form; keys compare case-insensitively as DNS-SD requires; unknown keys
    /// are ignored, but at most [`MAX_TXT_ENTRIES`] entries of at most 255 bytes
    /// each are accepted.
    ///
    /// A `v` other than [`PROTOCOL_VERSION`] yields
    /// [`AnnounceError::UnsupportedVersion`] before anything else is looked at,
    /// so future formats are reported as such rather than as garbage. The result
    /// is parsed, not verified.
    pub fn from_txt<K, V>(
        props: impl IntoIterator<Item = (K, V)>,
    ) -> Result<Announcement, AnnounceError>
    where
        K: AsRef<str>,
        V: AsRef<[u8]>,
    {
        let fields = TxtFields::collect(props)?;

        let version_text = fields.required(KEY_VERSION)?;
        let version = parse_decimal(KEY_VERSION, version_text)
            .and_then(|v| u32::try_from(v).map_err(|_| malformed("`v` is out of range")))?;
        if version != PROTOCOL_VERSION {
            return Err(AnnounceError::UnsupportedVersion { version });
        }

        let agent = match (fields.get(KEY_DID), fields.get(KEY_DID_HASH)) {
            (Some(_), Some(_)) => return Err(malformed("both `did` and `didh` are present")),
            (None, None) => return Err(malformed("missing `did` or `didh`")),
            (Some(did), None) => {
                check_text(KEY_DID, did, MAX_INLINE_DID_LEN)?;
                if !did.starts_with("did:") {
                    return Err(malformed("`did` does not start with \"did:\""));
                }
                AgentRef::Did(did.to_owned())
            }
            (None, Some(hash)) => {
                AgentRef::DidHash(decode_fixed::<32>(KEY_DID_HASH, hash, DID_HASH_B64_LEN)?)
            }
        };

        let context_id = fields.required(KEY_CONTEXT)?;
        check_text(KEY_CONTEXT, context_id, MAX_CONTEXT_ID_LEN)?;
        let peer_id = fields.required(KEY_PEER)?;
        check_text(KEY_PEER, peer_id, MAX_PEER_ID_LEN)?;

        let port = parse_decimal(KEY_PORT, fields.required(KEY_PORT)?)?;
        let port = u16::try_from(port)
            .ok()
            .filter(|p| *p != 0)
            .ok_or_else(|| malformed(format!("`port` {port} is not a tcp port in 1..=65535")))?;

        let timestamp = parse_decimal(KEY_TIMESTAMP, fields.required(KEY_TIMESTAMP)?)?;
        let timestamp_unix_secs = i64::try_from(timestamp)
            .map_err(|_| malformed(format!("`ts` {timestamp} is out of range")))?;

        let signature = decode_fixed::<64>(
            KEY_SIGNATURE,
            fields.required(KEY_SIGNATURE)?,
            SIGNATURE_B64_LEN,
        )?;

        Ok(Announcement {
            agent,
            context_id: context_id.to_owned(),
            peer_id: peer_id.to_owned(),
            port,
            protocol_version: version,
            timestamp_unix_secs,
            signature,
        })
    }
}

/// The known TXT fields of one record, each seen at most once.
struct TxtFields {
    /// Indexed like [`KNOWN_KEYS`].
    values: [Option<String>; KNOWN_KEYS.len()],
}

const KNOWN_KEYS: [&str; 8] = [
    KEY_VERSION,
    KEY_DID,
    KEY_DID_HASH,
    KEY_CONTEXT,
    KEY_PEER,
    KEY_PORT,
    KEY_TIMESTAMP,
    KEY_SIGNATURE,
];

impl TxtFields {
    fn collect<K, V>(props: impl IntoIterator<Item = (K, V)>) -> Result<TxtFields, AnnounceError>
    where
        K: AsRef<str>,
        V: AsRef<[u8]>,
    {
        let mut values: [Option<String>; KNOWN_KEYS.len()] = Default::default();
        for (count, (key, value)) in props.into_iter().enumerate() {
            if count >= MAX_TXT_ENTRIES {
                return Err(malformed(format!(
                    "more than {MAX_TXT_ENTRIES} txt entries"
                )));
            }
            let (key, value) = (key.as_ref(), value.as_ref());
            let entry_len = key.len() + 1 + value.len();
            if entry_len > MAX_TXT_ENTRY_LEN {
                return Err(malformed(format!(
                    "txt entry `{}` is {entry_len} bytes, at most {MAX_TXT_ENTRY_LEN} allowed",
                    key.escape_debug()
                )));
            }
            let Some(slot) = KNOWN_KEYS.iter().position(|k| key.eq_ignore_ascii_case(k)) else {
                continue;
            };
            if values[slot].is_some() {
                return Err(malformed(format!("duplicate `{}`", KNOWN_KEYS[slot])));
            }
            let value = std::str::from_utf8(value)
                .map_err(|_| malformed(format!("`{}` is not utf-8", KNOWN_KEYS[slot])))?;
            values[slot] = Some(value.to_owned());
        }
        Ok(TxtFields { values })
    }

    fn get(&self, key: &str) -> Option<&str> {
        let slot = KNOWN_KEYS.iter().position(|k| *k == key)?;
        self.values[slot].as_deref().filter(|v| !v.is_empty())
    }

    fn required(&self, key: &str) -> Result<&str, AnnounceError> {
        self.get(key)
            .ok_or_else(|| malformed(format!("missing `{key}`")))
    }
}

/// Identifiers must be non-empty visible ASCII: no spaces, controls or
/// non-ASCII look-alikes that could make two announcements print the same.
fn check_text(key: &str, value: &str, max_len: usize) -> Result<(), AnnounceError> {
    if value.len() > max_len {
        return Err(malformed(format!(
            "`{key}` is {} bytes, at most {max_len} allowed",
            value.len()
        )));
    }
    if !value.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(malformed(format!(
            "`{key}` contains characters other than visible ascii"
        )));
    }
    Ok(())
}

/// Accepts only canonical unsigned decimals (no sign, no leading zeros), so
/// every value has exactly one text form.
fn parse_decimal(key: &str, text: &str) -> Result<u64, AnnounceError> {
    let canonical = !text.is_empty()
        && text.len() <= MAX_DECIMAL_DIGITS
        && text.bytes().all(|b| b.is_ascii_digit())
        && (text == "0" || !text.starts_with('0'));
    if !canonical {
        return Err(malformed(format!(
            "`{key}` is not a canonical unsigned decimal"
        )));
    }
    text.parse::<u64>()
        .map_err(|_| malformed(format!("`{key}` is out of range")))
}

fn decode_fixed<const N: usize>(
    key: &str,
    text: &str,
    encoded_len: usize,
) -> Result<[u8; N], AnnounceError> {
    if text.len() != encoded_len {
        return Err(malformed(format!(
            "`{key}` is {} characters, expected {encoded_len}",
            text.len()
        )));
    }
    // The default engine rejects padding and non-zero trailing bits, so the
    // encoding is canonical too.
    let bytes = URL_SAFE_NO_PAD
        .decode(text)
        .map_err(|e| malformed(format!("`{key}` is not base64url: {e}")))?;
    <[u8; N]>::try_from(bytes.as_slice()).map_err(|_| {
        malformed(format!(
            "`{key}` decodes to {} bytes, expected {N}",
            bytes.len()
        ))
    })
}

#[cfg(test)]
mod tests;
