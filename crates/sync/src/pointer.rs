//! The NIP-6 DHT "agent pointer": the record stored under SHA-256(agent DID)
//! that points the agent's devices to their meeting place (a gossip topic).
//!
//! A record is self-contained so that *any* DHT node, including untrusted
//! infrastructure that has never heard of the agent, can check it before
//! storing it: it carries the compact proof of the agent's current DID
//! document ([`DidProof`]: the genesis, which certifies itself since it is
//! the did:key document of the DID, the entries that changed who may sign,
//! and the head; a few KiB however long the chain grows) and is signed by a
//! device key that holds `authentication` in that proven document.
//!
//! Wire form: canonical JSON ([`nuwa_identity::canonical::to_canonical_json`])
//! of one object, keys sorted:
//!
//! ```text
//! {"context_id":"device-…","did":"did:key:…","did_proof":{"document":…,"entries":[…]},
//!  "nonce":"<32 hex>","peer_id":"12D3KooW…","signature":"<128 hex>",
//!  "timestamp":<unix secs>,"topic":"<64 hex>"}
//! ```
//!
//! The signature is Ed25519 over
//! SHA-256([`POINTER_DOMAIN`] ‖ canonical JSON of the same object without
//! `signature`), so it covers the embedded proof too. Decoding accepts only the
//! canonical bytes of a well-formed record, so one pointer has exactly one
//! encoding and nothing unsigned can ride along.
//!
//! What this module leaves to others: talking to the DHT (the net crate's
//! Kademlia behaviour calls [`AgentPointer::decode`] and
//! [`AgentPointer::verify`] before storing a record), re-publishing before
//! [`POINTER_MAX_AGE_SECS`] runs out, and checking that `peer_id` is the
//! PeerId of the signer's key (the PeerId ↔ key mapping belongs to the net
//! crate; [`AgentPointer::signer_public`] gives the key to compare). A pointer
//! is only a hint: membership is still checked on connection. IO-free: time
//! comes in as `now_unix_secs`.

use nuwa_identity::canonical::to_canonical_json;
use nuwa_identity::chain::{ChainError, DidChain, DidProof};
use nuwa_identity::document::{DidDocument, DidError, MAX_DID_LEN, MAX_FRAGMENT_LEN, shorten};
use nuwa_identity::keys::{DeviceKey, KeyError, verify_ed25519};
use nuwa_identity::nip2::signing_hash;
use serde_json::{Map, Value};

use crate::membership::SYNC_RELATIONSHIP;

/// Domain separator of pointer signatures (NIP-2 style).
pub const POINTER_DOMAIN: &str = "NUWA_DHT_POINTER_V2:";
/// Largest encoded record; stays under libp2p-kad's 65 KiB record limit.
pub const MAX_POINTER_BYTES: usize = 60 * 1024;
/// How old a record may be: libp2p-kad's default record TTL, so a pointer
/// that a node still holds is one it may still serve.
pub const POINTER_MAX_AGE_SECS: i64 = 36 * 3600;
/// How far in the verifier's future a record's timestamp may lie (clock skew).
pub const POINTER_MAX_SKEW_SECS: i64 = 300;
/// Bytes of randomness in a pointer's nonce.
pub const POINTER_NONCE_LEN: usize = 16;
/// Longest `peer_id` accepted (a base58 Ed25519 PeerId is 52 characters).
pub const MAX_PEER_ID_LEN: usize = 128;

/// Prefix of the gossip topic name, from NIP-6: `hash("nuwa-sync-" + AgentDID)`.
const TOPIC_PREFIX: &str = "nuwa-sync-";
/// Longest `topic` accepted before comparing it (a hex SHA-256 is 64).
const MAX_TOPIC_LEN: usize = 64;
/// The fields of a record, in canonical (sorted) order.
const FIELDS: [&str; 8] = [
    "context_id",
    "did",
    "did_proof",
    "nonce",
    "peer_id",
    "signature",
    "timestamp",
    "topic",
];

/// The DHT key of an agent: SHA-256 of its DID.
pub fn dht_key(did: &str) -> [u8; 32] {
    // SHA-256 with an empty domain is plain SHA-256(did).
    signing_hash("", did.as_bytes())
}

/// The agent's meeting place: hex SHA-256(`"nuwa-sync-"` ‖ DID), the gossip topic NIP-6 recommends.
/// The rendezvous namespace of an agent: a hash of its DID (namespaces are
/// limited to 255 bytes, and a hash does not show the DID to the server).
pub fn rendezvous_namespace(did: &str) -> String {
    let h = signing_hash("", format!("nuwa-rendezvous-{did}").as_bytes());
    format!("nuwa-{}", hex::encode(&h[..16]))
}

pub fn gossip_topic(did: &str) -> String {
    hex::encode(signing_hash(TOPIC_PREFIX, did.as_bytes()))
}

/// Why a pointer record was not built, encoded, decoded or accepted.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PointerError {
    /// The encoded record is larger than [`MAX_POINTER_BYTES`].
    #[error("pointer record is {len} bytes, more than the limit of {max}")]
    TooLarge {
        /// Size of the record.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// The bytes are not the canonical encoding of a well-formed record.
    #[error("malformed pointer record: {0}")]
    Malformed(String),
    /// The record is not for the DHT key it was stored or found under.
    #[error("pointer record is not for this dht key (expected sha-256 of its did)")]
    WrongKey,
    /// The topic is not the agent's gossip topic.
    #[error("pointer record topic is not the gossip topic of its did")]
    WrongTopic,
    /// The embedded DID proof does not verify for the record's DID.
    #[error("pointer record carries a did proof that does not verify")]
    BadDidLog(#[source] ChainError),
    /// The signer is not an active device with `authentication` in the current document.
    #[error("pointer record signer {context_id} is not an active device of the agent")]
    UnknownSigner {
        /// The context id the record names (shortened if long).
        context_id: String,
        /// Why the key is not usable (not listed, expired, lacks the relationship).
        #[source]
        source: DidError,
    },
    /// The signature does not verify under the signer's key.
    #[error("pointer record signature does not verify")]
    BadSignature,
    /// The record is older than [`POINTER_MAX_AGE_SECS`].
    #[error("pointer record from {timestamp} is too old at {now}; the agent must re-publish it")]
    Stale {
        /// The record's timestamp (unix secs).
        timestamp: i64,
        /// The verifier's time (unix secs).
        now: i64,
    },
    /// The record's timestamp is more than [`POINTER_MAX_SKEW_SECS`] ahead of the verifier.
    #[error("pointer record timestamp {timestamp} is too far after now ({now}); check the clocks")]
    FromFuture {
        /// The record's timestamp (unix secs).
        timestamp: i64,
        /// The verifier's time (unix secs).
        now: i64,
    },
    /// Drawing the nonce failed.
    #[error("cannot create a pointer nonce")]
    Random(#[source] KeyError),
    /// Canonical JSON encoding failed.
    #[error("cannot encode pointer record as canonical json")]
    Encode(#[source] serde_json::Error),
}

impl PointerError {
    /// Short stable label for counters (`rejected_dht_<label>`).
    pub fn label(&self) -> &'static str {
        match self {
            PointerError::TooLarge { .. } => "too_large",
            PointerError::Malformed(_) => "malformed",
            PointerError::WrongKey => "wrong_key",
            PointerError::WrongTopic => "wrong_topic",
            PointerError::BadDidLog(_) => "bad_did_log",
            PointerError::UnknownSigner { .. } => "unknown_signer",
            PointerError::BadSignature => "bad_signature",
            PointerError::Stale { .. } => "stale",
            PointerError::FromFuture { .. } => "from_future",
            PointerError::Random(_) => "random",
            PointerError::Encode(_) => "encode",
        }
    }
}

/// A signed pointer from an agent's DHT key to its meeting place.
///
/// The fields are public so callers can read them; a pointer built or
/// changed by hand is worth nothing until [`AgentPointer::verify`] accepts it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AgentPointer {
    /// The agent DID.
    pub did: String,
    /// The meeting place: [`gossip_topic`] of `did`.
    pub topic: String,
    /// OperationalContextID (key fragment) of the signing device.
    pub context_id: String,
    /// libp2p PeerId of the signing device, as text (a dial hint).
    pub peer_id: String,
    /// Unix seconds at signing.
    pub timestamp_unix_secs: i64,
    /// Random bytes, so two records signed in the same second differ.
    pub nonce: [u8; POINTER_NONCE_LEN],
    /// The proof of the agent's current DID document, so the record can be
    /// checked by anyone.
    pub did_proof: DidProof,
    /// Ed25519 signature over [`AgentPointer::signing_digest`].
    pub signature: [u8; 64],
}

impl AgentPointer {
    /// Builds and signs the pointer for the agent of `log`, naming this device
    /// (`context_id`, `peer_id`). The result is verified before it is
    /// returned, so a device that a verifier would refuse (not listed, no
    /// `authentication`, a key other than the one listed under `context_id`)
    /// gets the verifier's error here.
    pub fn new_signed(
        log: &DidChain,
        context_id: &str,
        peer_id: &str,
        device: &DeviceKey,
        now_unix_secs: i64,
    ) -> Result<AgentPointer, PointerError> {
        let mut nonce = [0u8; POINTER_NONCE_LEN];
        nuwa_entropy::fill(&mut nonce).map_err(|e| PointerError::Random(KeyError::Random(e)))?;
        Self::new_signed_with_nonce(log, context_id, peer_id, device, now_unix_secs, nonce)
    }

    /// [`AgentPointer::new_signed`] with a caller-chosen nonce, for
    /// deterministic tests; production code should let `new_signed` draw it.
    pub fn new_signed_with_nonce(
        log: &DidChain,
        context_id: &str,
        peer_id: &str,
        device: &DeviceKey,
        now_unix_secs: i64,
        nonce: [u8; POINTER_NONCE_LEN],
    ) -> Result<AgentPointer, PointerError> {
        let did = log.did().to_owned();
        let mut pointer = AgentPointer {
            topic: gossip_topic(&did),
            did,
            context_id: context_id.to_owned(),
            peer_id: peer_id.to_owned(),
            timestamp_unix_secs: now_unix_secs,
            nonce,
            did_proof: log.proof(),
            signature: [0; 64],
        };
        pointer.check_shape()?;
        pointer.sign(device)?;
        pointer.verify(&dht_key(&pointer.did), now_unix_secs)?;
        Ok(pointer)
    }

    /// The 32-byte digest the signature is over: SHA-256([`POINTER_DOMAIN`] ‖
    /// canonical JSON of the record without `signature`).
    pub fn signing_digest(&self) -> Result<[u8; 32], PointerError> {
        let object = self.unsigned_object()?;
        let content = to_canonical_json(&Value::Object(object)).map_err(PointerError::Encode)?;
        Ok(signing_hash(POINTER_DOMAIN, &content))
    }

    /// The record's bytes: canonical JSON, signature included. Fails with
    /// [`PointerError::TooLarge`] when they exceed [`MAX_POINTER_BYTES`]
    /// (the agent's DID log has grown too long to travel in a DHT record),
    /// and with [`PointerError::Malformed`] when a field is out of shape.
    pub fn encode(&self) -> Result<Vec<u8>, PointerError> {
        self.check_shape()?;
        let bytes = self.encode_unchecked()?;
        if bytes.len() > MAX_POINTER_BYTES {
            return Err(PointerError::TooLarge {
                len: bytes.len(),
                max: MAX_POINTER_BYTES,
            });
        }
        Ok(bytes)
    }

    /// Parses a record. The size is checked before anything is parsed; the
    /// bytes must then be exactly the canonical encoding of a record with
    /// every field present and in shape, and no other field. This does not
    /// verify anything: call [`AgentPointer::verify`] before trusting it.
    pub fn decode(bytes: &[u8]) -> Result<AgentPointer, PointerError> {
        if bytes.len() > MAX_POINTER_BYTES {
            return Err(PointerError::TooLarge {
                len: bytes.len(),
                max: MAX_POINTER_BYTES,
            });
        }
        // serde_json bounds nesting depth (128), so hostile input cannot
        // exhaust the stack here.
        let value: Value = serde_json::from_slice(bytes)
            .map_err(|e| PointerError::Malformed(format!("not json: {e}")))?;
        let Value::Object(mut object) = value else {
            return Err(malformed("record must be a json object"));
        };
        if let Some(unknown) = object.keys().find(|k| !FIELDS.contains(&k.as_str())) {
            return Err(PointerError::Malformed(format!(
                "unknown field `{}`",
                shorten(unknown)
            )));
        }
        let mut take = |name: &'static str| {
            object
                .remove(name)
                .ok_or_else(|| PointerError::Malformed(format!("missing field `{name}`")))
        };
        let did = take_string(take("did")?, "did")?;
        let topic = take_string(take("topic")?, "topic")?;
        let context_id = take_string(take("context_id")?, "context_id")?;
        let peer_id = take_string(take("peer_id")?, "peer_id")?;
        let timestamp_unix_secs = take("timestamp")?
            .as_i64()
            .ok_or_else(|| malformed("timestamp must be an integer of unix seconds"))?;
        let nonce = decode_hex::<POINTER_NONCE_LEN>(&take_string(take("nonce")?, "nonce")?)
            .ok_or_else(|| malformed("nonce must be 32 lowercase hex characters"))?;
        let signature = decode_hex::<64>(&take_string(take("signature")?, "signature")?)
            .ok_or_else(|| malformed("signature must be 128 lowercase hex characters"))?;
        let did_proof: DidProof = serde_json::from_value(take("did_proof")?)
            .map_err(|e| PointerError::Malformed(format!("did_proof: {e}")))?;
        let pointer = AgentPointer {
            did,
            topic,
            context_id,
            peer_id,
            timestamp_unix_secs,
            nonce,
            did_proof,
            signature,
        };
        pointer.check_shape()?;
        // One pointer, one encoding: refuse whitespace, key order, escapes or
        // duplicate keys that a re-encoding would not reproduce.
        if pointer.encode_unchecked()? != bytes {
            return Err(malformed("record is not in canonical form"));
        }
        Ok(pointer)
    }

    /// Full verification, needing nothing but the record: it is stored under
    /// `dht_key` = SHA-256(did); `topic` is [`gossip_topic`] of the DID; its
    /// timestamp lies within [now − [`POINTER_MAX_AGE_SECS`], now +
    /// [`POINTER_MAX_SKEW_SECS`]]; `context_id` names an active key with
    /// `authentication` in the proven document; the signature verifies under
    /// that key; and the embedded proof verifies for the DID.
    ///
    /// The signature is checked before the proof, so a forged record costs
    /// one signature check rather than one per proof entry.
    pub fn verify(&self, dht_key: &[u8], now_unix_secs: i64) -> Result<(), PointerError> {
        if dht_key != self::dht_key(&self.did) {
            return Err(PointerError::WrongKey);
        }
        if self.topic != gossip_topic(&self.did) {
            return Err(PointerError::WrongTopic);
        }
        self.check_time(now_unix_secs)?;
        let public = self.signer_in(self.did_proof.document(), now_unix_secs)?;
        self.check_signature(&public)?;
        self.did_proof
            .verify(&self.did, now_unix_secs)
            .map(|_| ())
            .map_err(PointerError::BadDidLog)
    }

    /// [`AgentPointer::verify`] for a device of the agent that holds its own
    /// chain `ours` (possibly newer or older than the proof's head): the
    /// record must also be under our agent's DHT key, and the signer must be
    /// active in the newer document: ours when we hold the proof's head (so a
    /// device we know to be revoked cannot steer us with an old proof), the
    /// proof's otherwise (it is ahead of us, or on a branch we have not seen;
    /// the connection's Hello fetches and merges those entries with the fork
    /// rule before the device is accepted).
    pub fn verify_for_agent(
        &self,
        dht_key: &[u8],
        ours: &DidChain,
        now_unix_secs: i64,
    ) -> Result<(), PointerError> {
        self.verify(dht_key, now_unix_secs)?;
        if dht_key != self::dht_key(ours.did()) {
            return Err(PointerError::WrongKey);
        }
        let head = self
            .did_proof
            .entries()
            .last()
            .map(|e| e.hash())
            .transpose()
            .map_err(PointerError::BadDidLog)?;
        if head.is_some_and(|h| ours.position_of(&h).is_some()) {
            // Our document may list a different key under the same context
            // id, so check the signature again with the key it lists.
            let public = self.signer_in(ours.current(), now_unix_secs)?;
            self.check_signature(&public)?;
        }
        Ok(())
    }

    /// The public key listed under `context_id` in the embedded log's current
    /// document, if it may sign pointers at `now_unix_secs`. Only meaningful
    /// after [`AgentPointer::verify`]; callers compare it with `peer_id`.
    pub fn signer_public(&self, now_unix_secs: i64) -> Result<[u8; 32], PointerError> {
        self.signer_in(self.did_proof.document(), now_unix_secs)
    }

    fn signer_in(&self, doc: &DidDocument, now_unix_secs: i64) -> Result<[u8; 32], PointerError> {
        doc.key_for(&self.context_id, SYNC_RELATIONSHIP, now_unix_secs)
            .map_err(|source| PointerError::UnknownSigner {
                context_id: shorten(&self.context_id),
                source,
            })
    }

    fn check_signature(&self, public: &[u8; 32]) -> Result<(), PointerError> {
        let digest = self.signing_digest()?;
        verify_ed25519(public, &digest, &self.signature).map_err(|_| PointerError::BadSignature)
    }

    fn check_time(&self, now_unix_secs: i64) -> Result<(), PointerError> {
        let timestamp = self.timestamp_unix_secs;
        if timestamp < now_unix_secs.saturating_sub(POINTER_MAX_AGE_SECS) {
            return Err(PointerError::Stale {
                timestamp,
                now: now_unix_secs,
            });
        }
        if timestamp > now_unix_secs.saturating_add(POINTER_MAX_SKEW_SECS) {
            return Err(PointerError::FromFuture {
                timestamp,
                now: now_unix_secs,
            });
        }
        Ok(())
    }

    fn sign(&mut self, device: &DeviceKey) -> Result<(), PointerError> {
        let digest = self.signing_digest()?;
        self.signature = device.sign(&digest);
        Ok(())
    }

    /// Bounds on the text fields, so that what we encode is what decode accepts.
    fn check_shape(&self) -> Result<(), PointerError> {
        if self.did.is_empty() || self.did.len() > MAX_DID_LEN {
            return Err(PointerError::Malformed(format!(
                "did must be 1 to {MAX_DID_LEN} bytes"
            )));
        }
        if self.topic.len() > MAX_TOPIC_LEN {
            return Err(PointerError::Malformed(format!(
                "topic must be at most {MAX_TOPIC_LEN} bytes"
            )));
        }
        let fragment_ok = !self.context_id.is_empty()
            && self.context_id.len() <= MAX_FRAGMENT_LEN
            && self
                .context_id
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'~' | b'-'));
        if !fragment_ok {
            return Err(PointerError::Malformed(format!(
                "context_id `{}` must be a key fragment: 1 to {MAX_FRAGMENT_LEN} characters from A-Z a-z 0-9 . _ ~ -",
                shorten(&self.context_id)
            )));
        }
        let peer_ok = !self.peer_id.is_empty()
            && self.peer_id.len() <= MAX_PEER_ID_LEN
            && self.peer_id.bytes().all(|b| b.is_ascii_alphanumeric());
        if !peer_ok {
            return Err(PointerError::Malformed(format!(
                "peer_id `{}` must be 1 to {MAX_PEER_ID_LEN} ascii letters and digits",
                shorten(&self.peer_id)
            )));
        }
        Ok(())
    }

    /// Every field but the signature, as a JSON object.
    fn unsigned_object(&self) -> Result<Map<String, Value>, PointerError> {
        let mut object = Map::new();
        object.insert("context_id".into(), Value::from(self.context_id.as_str()));
        object.insert("did".into(), Value::from(self.did.as_str()));
        object.insert(
            "did_proof".into(),
            serde_json::to_value(&self.did_proof).map_err(PointerError::Encode)?,
        );
        object.insert("nonce".into(), Value::from(hex::encode(self.nonce)));
        object.insert("peer_id".into(), Value::from(self.peer_id.as_str()));
        object.insert("timestamp".into(), Value::from(self.timestamp_unix_secs));
        object.insert("topic".into(), Value::from(self.topic.as_str()));
        Ok(object)
    }

    fn encode_unchecked(&self) -> Result<Vec<u8>, PointerError> {
        let mut object = self.unsigned_object()?;
        object.insert("signature".into(), Value::from(hex::encode(self.signature)));
        to_canonical_json(&Value::Object(object)).map_err(PointerError::Encode)
    }
}

fn malformed(reason: &str) -> PointerError {
    PointerError::Malformed(reason.to_owned())
}

fn take_string(value: Value, name: &str) -> Result<String, PointerError> {
    match value {
        Value::String(s) => Ok(s),
        _ => Err(PointerError::Malformed(format!("{name} must be a string"))),
    }
}

/// Exactly `2 * N` lowercase hex digits, or `None` (lowercase only: the
/// encoding is canonical).
fn decode_hex<const N: usize>(s: &str) -> Option<[u8; N]> {
    if s.bytes().any(|c| c.is_ascii_uppercase()) {
        return None;
    }
    let mut out = [0u8; N];
    hex::decode_to_slice(s, &mut out).ok()?;
    Some(out)
}

#[cfg(test)]
mod tests;
