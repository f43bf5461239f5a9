//! The agent's DID document as a self-certifying, hash-chained log of signed updates.
//!
//! The agent DID is the `did:key` of its master key, so the log's first entry
//! (the genesis) can be checked by anyone holding only the DID: it must carry
//! exactly the did:key document (with `controller` set to the DID), signed by
//! that key. Every later update carries the *whole* new document, the hash of
//! the previous update, and a signature by a key that holds, in the previous
//! document, the relationships NIP-1 requires for what changed:
//!
//! | change (previous vs new document)                           | required            |
//! |-------------------------------------------------------------|---------------------|
//! | `verificationMethod`, any relationship list, or `@context`  | capabilityDelegation |
//! | `service`                                                   | capabilityInvocation |
//! | `controller`                                                | authentication + capabilityDelegation |
//!
//! An update that changes nothing is rejected, as is one that leaves no
//! `capabilityDelegation` key (it would lock the document forever).
//!
//! Time: update timestamps must not decrease along the chain nor lie more than
//! [`MAX_CLOCK_SKEW_SECS`] in the verifier's future. A signer's key expiry is
//! judged at the update's own timestamp, so the log does not become invalid
//! once an old signer expires. Timestamps are claimed by the signer, so expiry
//! on delegation keys only bounds honest signers; to take a key's power away
//! for certain, remove it.
//!
//! This module does no IO: storing the log and fetching it from peers belong
//! to the node and sync crates.

use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::canonical::to_canonical_json;
use crate::did_key::{did_key_document, did_key_from_ed25519, ed25519_public_multibase};
use crate::document::{DidDocument, DidError, ED25519_KEY_TYPE, Relationship};
use crate::keys::{DeviceKey, KeyError, verify_ed25519};
use crate::nip2::signing_hash;

/// Most updates a log may hold; longer logs are rejected rather than processed.
pub const MAX_LOG_UPDATES: usize = 1024;
/// Domain separator of update signatures (NIP-2 style).
pub const DID_UPDATE_DOMAIN: &str = "NUWA_DID_UPDATE_V1:";
/// How far in the verifier's future an update timestamp may lie.
pub const MAX_CLOCK_SKEW_SECS: i64 = 300;

/// Errors from building, verifying or merging a DID log.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LogError {
    /// The log has no genesis.
    #[error("did log is empty")]
    Empty,
    /// The log exceeds [`MAX_LOG_UPDATES`].
    #[error("did log has {len} updates, more than the limit of {max}")]
    TooLong {
        /// Number of updates (or the number it would reach).
        len: usize,
        /// The limit.
        max: usize,
    },
    /// The log is for a different agent.
    #[error("did log is for {found}, expected {expected}")]
    WrongDid {
        /// The DID the caller expected.
        expected: String,
        /// The DID in the log's genesis.
        found: String,
    },
    /// The genesis DID is not an Ed25519 did:key, so the log cannot certify itself.
    #[error("did log genesis is not for an ed25519 did:key")]
    Genesis(#[source] DidError),
    /// The genesis document is not the did:key document of its DID.
    #[error("did log genesis for {did} does not carry its did:key document")]
    GenesisMismatch {
        /// The genesis DID.
        did: String,
    },
    /// An update's `seq` is not its position in the log.
    #[error("did update at position {index} has seq {seq}")]
    BadSeq {
        /// Position in the log.
        index: usize,
        /// The seq it claims.
        seq: u64,
    },
    /// An update's `prev` is not the hash of the update before it.
    #[error("did update {seq} does not chain to the previous update (prev hash mismatch)")]
    BadPrev {
        /// The update's seq.
        seq: u64,
    },
    /// An update changes the document's `id`.
    #[error("did update {seq} changes the document id to {found}")]
    DidChanged {
        /// The update's seq.
        seq: u64,
        /// The new id it tries to set.
        found: String,
    },
    /// The new document fails [`DidDocument::validate`].
    #[error("did update {seq} carries an invalid document")]
    InvalidDocument {
        /// The update's seq.
        seq: u64,
        /// Why the document is invalid.
        #[source]
        source: DidError,
    },
    /// The new document leaves no key able to change it again.
    #[error("did update {seq} leaves no capabilityDelegation key")]
    NoDelegationKey {
        /// The update's seq.
        seq: u64,
    },
    /// The update does not change the document.
    #[error("did update {seq} does not change the document")]
    EmptyUpdate {
        /// The update's seq.
        seq: u64,
    },
    /// The update's timestamp is earlier than its predecessor's.
    #[error("did update {seq} has timestamp {timestamp}, before the previous update's {previous}")]
    TimestampRegression {
        /// The update's seq.
        seq: u64,
        /// Its timestamp.
        timestamp: i64,
        /// The previous update's timestamp.
        previous: i64,
    },
    /// The update's timestamp lies too far in the future.
    #[error(
        "did update {seq} has timestamp {timestamp}, too far after now ({now}); check the clocks"
    )]
    FromFuture {
        /// The update's seq.
        seq: u64,
        /// Its timestamp.
        timestamp: i64,
        /// The verifier's time.
        now: i64,
    },
    /// A field of the update has the wrong format.
    #[error("did update {seq} is malformed: {reason}")]
    MalformedUpdate {
        /// The update's seq.
        seq: u64,
        /// Which field and what is wrong.
        reason: &'static str,
    },
    /// The signer may not make this change (unknown, expired, wrong type or missing relationship).
    #[error("did update {seq} signer {key_id} is not authorised")]
    Unauthorized {
        /// The update's seq.
        seq: u64,
        /// The signing key id it names.
        key_id: String,
        /// The precise reason ([`DidError::PermissionDenied`], [`DidError::KeyNotFound`], ...).
        #[source]
        source: DidError,
    },
    /// [`DidLog::append`] was given a key that is not the one listed under the key id.
    #[error("the signing key given does not match {key_id} in the did document")]
    WrongSigningKey {
        /// The key id named by the caller.
        key_id: String,
    },
    /// The update's signature does not verify under the named key.
    #[error("did update {seq} signature does not verify under {key_id}")]
    BadSignature {
        /// The update's seq.
        seq: u64,
        /// The key id it names.
        key_id: String,
    },
    /// Both logs are valid but neither extends the other.
    #[error("did logs fork at update {seq}; they need manual reconciliation")]
    Fork {
        /// First seq at which the logs differ.
        seq: u64,
    },
    /// Canonical JSON encoding failed.
    #[error("cannot encode did update as canonical json")]
    Encode(#[source] serde_json::Error),
    /// Drawing a random nonce failed.
    #[error("cannot create did update")]
    Key(#[source] KeyError),
}

/// One signed step of the log: the full document after the step.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DidUpdate {
    /// Position in the log, 0 for the genesis.
    pub seq: u64,
    /// Hex SHA-256 of the previous update's canonical JSON; empty for the genesis.
    pub prev: String,
    /// The whole document after this update.
    pub document: DidDocument,
    /// Unix seconds when the update was signed (claimed by the signer).
    pub timestamp: i64,
    /// Hex of 16 random bytes, so two otherwise equal updates differ.
    pub nonce: String,
    /// Absolute id of the signing key in the *previous* document (the genesis: its own key).
    pub key_id: String,
    /// Base64url (no padding) Ed25519 signature over
    /// SHA-256(`NUWA_DID_UPDATE_V1:` ‖ canonical JSON of this update without `signature`).
    pub signature: String,
}

/// The fields the signature covers: everything but the signature.
#[derive(Serialize)]
struct UnsignedUpdate<'a> {
    seq: u64,
    prev: &'a str,
    document: &'a DidDocument,
    timestamp: i64,
    nonce: &'a str,
    key_id: &'a str,
}

impl DidUpdate {
    /// The 32-byte digest the signature is over.
    pub fn signing_digest(&self) -> Result<[u8; 32], LogError> {
        let unsigned = UnsignedUpdate {
            seq: self.seq,
            prev: &self.prev,
            document: &self.document,
            timestamp: self.timestamp,
            nonce: &self.nonce,
            key_id: &self.key_id,
        };
        let content = to_canonical_json(&unsigned).map_err(LogError::Encode)?;
        Ok(signing_hash(DID_UPDATE_DOMAIN, &content))
    }

    /// Hex SHA-256 of this update's canonical JSON (signature included): what the next `prev` holds.
    pub fn hash(&self) -> Result<String, LogError> {
        let bytes = to_canonical_json(self).map_err(LogError::Encode)?;
        Ok(hex::encode(Sha256::digest(&bytes)))
    }

    /// Builds and signs an update without checking it; callers verify afterwards.
    fn sign(
        seq: u64,
        prev: String,
        document: DidDocument,
        timestamp: i64,
        signer: &DeviceKey,
        key_id: String,
    ) -> Result<DidUpdate, LogError> {
        let mut nonce = [0u8; 16];
        nuwa_entropy::fill(&mut nonce).map_err(|e| LogError::Key(KeyError::Random(e)))?;
        let mut update = DidUpdate {
            seq,
            prev,
            document,
            timestamp,
            nonce: hex::encode(nonce),
            key_id,
            signature: String::new(),
        };
        let digest = update.signing_digest()?;
        update.signature = URL_SAFE_NO_PAD.encode(signer.sign(&digest));
        Ok(update)
    }

    pub(crate) fn check_signature(&self, public: &[u8; 32]) -> Result<(), LogError> {
        let malformed = LogError::MalformedUpdate {
            seq: self.seq,
            reason: "signature must be 64 bytes of base64url without padding",
        };
        // 64 bytes are 86 base64 characters; refuse to decode anything longer.
        if self.signature.len() != 86 {
            return Err(malformed);
        }
        let bytes = URL_SAFE_NO_PAD
            .decode(&self.signature)
            .map_err(|_| malformed)?;
        let sig: [u8; 64] = bytes.try_into().map_err(|_| LogError::MalformedUpdate {
            seq: self.seq,
            reason: "signature must be 64 bytes of base64url without padding",
        })?;
        let digest = self.signing_digest()?;
        verify_ed25519(public, &digest, &sig).map_err(|_| LogError::BadSignature {
            seq: self.seq,
            key_id: self.key_id.clone(),
        })
    }

    pub(crate) fn check_nonce(&self) -> Result<(), LogError> {
        let ok = self.nonce.len() == 32 && self.nonce.bytes().all(|b| b.is_ascii_hexdigit());
        if ok {
            Ok(())
        } else {
            Err(LogError::MalformedUpdate {
                seq: self.seq,
                reason: "nonce must be 32 hex characters",
            })
        }
    }
}

/// What [`DidLog::merge_from`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MergeOutcome {
    /// The other log held nothing new (it equals ours or is a prefix of it).
    Unchanged,
    /// Our log now equals the other, longer log; lengths before and after.
    Extended {
        /// Our length before the merge.
        from: usize,
        /// Our length after the merge.
        to: usize,
    },
    /// The logs forked at position `at` and the other branch won the fork
    /// rule ([`fork_order`]): our log is now the other one, and `dropped`
    /// holds our updates from `at` on, so that whoever signed them can
    /// apply their changes again on top of the winner.
    Replaced {
        /// First position at which the logs differ.
        at: usize,
        /// Our updates that are no longer in the log.
        dropped: Vec<DidUpdate>,
    },
    /// The logs forked at position `at` and our branch won: nothing changed.
    KeptOurs {
        /// First position at which the logs differ.
        at: usize,
    },
}

impl MergeOutcome {
    /// Whether the merge changed our log (extended or replaced it).
    pub fn changed(&self) -> bool {
        matches!(
            self,
            MergeOutcome::Extended { .. } | MergeOutcome::Replaced { .. }
        )
    }
}

/// The rank of an update's signer in the fork rule: a recovery key
/// (`#recovery-…`) outranks every other key.
fn signer_rank(update: &DidUpdate) -> u8 {
    if crate::recovery::is_recovery_fragment(&update.key_id) {
        2
    } else {
        1
    }
}

/// The fork rule: which of two valid logs of one agent that diverge at
/// position `at` wins (`Greater`: `a`). The branch whose updates from `at`
/// on include a signature by a higher-ranked key wins (a recovery key
/// beats any admin, so the words can always undo what a stolen admin
/// signed); between equals, the branch whose update at `at` has the lower
/// hash. Deterministic, and a total order over the branches of one tree,
/// so every device that has seen the same branches picks the same log.
pub fn fork_order(a: &DidLog, b: &DidLog, at: usize) -> std::cmp::Ordering {
    let rank = |l: &DidLog| l.updates[at..].iter().map(signer_rank).max().unwrap_or(0);
    rank(a)
        .cmp(&rank(b))
        .then_with(|| b.hashes[at].cmp(&a.hashes[at]))
}

/// A DID log. Always holds at least the genesis and at most [`MAX_LOG_UPDATES`]
/// updates; deserializing checks only that shape, so call [`DidLog::verify`]
/// (or use [`DidLog::decode_verified`] / [`DidLog::merge_from`]) before trusting one.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(try_from = "RawDidLog")]
pub struct DidLog {
    updates: Vec<DidUpdate>,
    /// `hashes[i]` = `updates[i].hash()`, computed whenever updates enter the log.
    #[serde(skip)]
    hashes: Vec<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawDidLog {
    updates: Vec<DidUpdate>,
}

impl TryFrom<RawDidLog> for DidLog {
    type Error = LogError;

    fn try_from(raw: RawDidLog) -> Result<DidLog, LogError> {
        DidLog::from_updates(raw.updates)
    }
}

impl PartialEq for DidLog {
    fn eq(&self, other: &DidLog) -> bool {
        self.hashes == other.hashes
    }
}

impl Eq for DidLog {}

/// The genesis document for a did:key agent: its did:key document, controlled by itself.
pub fn genesis_document(did: &str) -> Result<DidDocument, DidError> {
    let mut doc = did_key_document(did)?;
    doc.controller = Some(did.to_owned());
    Ok(doc)
}

/// The relationships a signer needs (in the previous document) to turn `old` into `new`.
pub fn required_relationships(old: &DidDocument, new: &DidDocument) -> Vec<Relationship> {
    let mut required = std::collections::BTreeSet::new();
    let keys_changed = old.context != new.context
        || old.verification_method != new.verification_method
        || Relationship::ALL
            .iter()
            .any(|rel| old.relationship(*rel) != new.relationship(*rel));
    if keys_changed {
        required.insert(Relationship::CapabilityDelegation);
    }
    if old.service != new.service {
        required.insert(Relationship::CapabilityInvocation);
    }
    if old.controller != new.controller {
        required.insert(Relationship::Authentication);
        required.insert(Relationship::CapabilityDelegation);
    }
    required.into_iter().collect()
}

impl DidLog {
    fn from_updates(updates: Vec<DidUpdate>) -> Result<DidLog, LogError> {
        if updates.is_empty() {
            return Err(LogError::Empty);
        }
        if updates.len() > MAX_LOG_UPDATES {
            return Err(LogError::TooLong {
                len: updates.len(),
                max: MAX_LOG_UPDATES,
            });
        }
        let hashes = updates
            .iter()
            .map(DidUpdate::hash)
            .collect::<Result<Vec<_>, _>>()?;
        Ok(DidLog { updates, hashes })
    }

    /// Starts a log for the agent whose master key is `master`: the DID is its
    /// did:key and the genesis document is [`genesis_document`].
    pub fn genesis(master: &DeviceKey, now_unix_secs: i64) -> Result<DidLog, LogError> {
        let public = master.public();
        let did = did_key_from_ed25519(&public);
        let document = genesis_document(&did).map_err(LogError::Genesis)?;
        let key_id = format!("{did}#{}", ed25519_public_multibase(&public));
        let update = DidUpdate::sign(0, String::new(), document, now_unix_secs, master, key_id)?;
        verify_genesis(&update, now_unix_secs)?;
        DidLog::from_updates(vec![update])
    }

    /// Parses a log from JSON and verifies it (see [`DidLog::verify`]).
    pub fn decode_verified(
        json: &[u8],
        expected_did: Option<&str>,
        now_unix_secs: i64,
    ) -> Result<DidLog, serde_json::Error> {
        let log: DidLog = serde_json::from_slice(json)?;
        log.verify(expected_did, now_unix_secs)
            .map_err(serde::de::Error::custom)?;
        Ok(log)
    }

    /// Appends `new_doc` as the next update, signed by `signer` under
    /// `signer_key_id` (absolute id or fragment). The update is checked with
    /// exactly the rules a receiver applies, and nothing changes on error.
    pub fn append(
        &mut self,
        new_doc: DidDocument,
        signer: &DeviceKey,
        signer_key_id: &str,
        now_unix_secs: i64,
    ) -> Result<(), LogError> {
        if self.updates.len() >= MAX_LOG_UPDATES {
            return Err(LogError::TooLong {
                len: self.updates.len() + 1,
                max: MAX_LOG_UPDATES,
            });
        }
        let (last, last_hash) = self.head();
        let key_id = last.document.key_id(signer_key_id);
        if let Some(method) = last.document.find_method(&key_id)
            && method.ed25519_public().ok() != Some(signer.public())
        {
            return Err(LogError::WrongSigningKey { key_id });
        }
        // Never go backwards in time along the chain, even if this clock did.
        let timestamp = now_unix_secs.max(last.timestamp);
        let update = DidUpdate::sign(
            last.seq.saturating_add(1),
            last_hash.to_owned(),
            new_doc,
            timestamp,
            signer,
            key_id,
        )?;
        verify_step(last, last_hash, &update, now_unix_secs)?;
        let hash = update.hash()?;
        self.updates.push(update);
        self.hashes.push(hash);
        Ok(())
    }

    /// Verifies the whole log: the genesis certifies the DID (and equals
    /// `expected_did` when given), and every update chains, is signed by an
    /// authorised key of the previous document and carries a valid document.
    pub fn verify(&self, expected_did: Option<&str>, now_unix_secs: i64) -> Result<(), LogError> {
        let Some(genesis) = self.updates.first() else {
            return Err(LogError::Empty);
        };
        if self.updates.len() > MAX_LOG_UPDATES {
            return Err(LogError::TooLong {
                len: self.updates.len(),
                max: MAX_LOG_UPDATES,
            });
        }
        if let Some(expected) = expected_did
            && genesis.document.id != expected
        {
            return Err(LogError::WrongDid {
                expected: expected.to_owned(),
                found: genesis.document.id.clone(),
            });
        }
        verify_genesis(genesis, now_unix_secs)?;
        for (index, pair) in self.updates.windows(2).enumerate() {
            verify_step(&pair[0], &self.hashes[index], &pair[1], now_unix_secs)?;
        }
        Ok(())
    }

    /// The document as of the latest update.
    pub fn current(&self) -> &DidDocument {
        &self.head().0.document
    }

    /// The agent DID (the genesis document's id).
    pub fn did(&self) -> &str {
        &self.first().document.id
    }

    /// Hex hash of the latest update; two logs with the same head hash are identical.
    pub fn head_hash(&self) -> String {
        self.head().1.to_owned()
    }

    /// Number of updates, genesis included (at least 1).
    pub fn len(&self) -> usize {
        self.updates.len()
    }

    /// Always false: a log holds at least its genesis. Present for API symmetry with `len`.
    pub fn is_empty(&self) -> bool {
        self.updates.is_empty()
    }

    /// All updates, genesis first.
    pub fn updates(&self) -> &[DidUpdate] {
        &self.updates
    }

    /// Adopts `other` if it verifiably extends this log, or if it diverges
    /// from it and wins the fork rule ([`fork_order`]).
    ///
    /// Returns `Unchanged` when `other` equals this log or is a prefix of it
    /// (nothing to learn; `other` is not even verified), `Extended` when this
    /// log is a prefix of `other` and `other` verifies, and, when both
    /// diverge and `other` verifies, `Replaced` (it won) or `KeptOurs`. Any
    /// error means `other` is invalid or for another agent. This log is
    /// unchanged on every error.
    pub fn merge_from(
        &mut self,
        other: &DidLog,
        now_unix_secs: i64,
    ) -> Result<MergeOutcome, LogError> {
        if other.did() != self.did() {
            return Err(LogError::WrongDid {
                expected: self.did().to_owned(),
                found: other.did().to_owned(),
            });
        }
        let common = self.hashes.len().min(other.hashes.len());
        let diverge_at = (0..common).find(|&i| self.hashes[i] != other.hashes[i]);
        if diverge_at.is_none() && other.len() <= self.len() {
            return Ok(MergeOutcome::Unchanged);
        }
        other.verify(Some(self.did()), now_unix_secs)?;
        if let Some(at) = diverge_at {
            if fork_order(other, self, at) != std::cmp::Ordering::Greater {
                return Ok(MergeOutcome::KeptOurs { at });
            }
            let dropped = self.updates[at..].to_vec();
            *self = other.clone();
            return Ok(MergeOutcome::Replaced { at, dropped });
        }
        let from = self.len();
        *self = other.clone();
        Ok(MergeOutcome::Extended {
            from,
            to: self.len(),
        })
    }

    fn first(&self) -> &DidUpdate {
        // Invariant: every constructor (`genesis`, `from_updates`, deserialization)
        // rejects an empty update list, and updates are never removed.
        &self.updates[0]
    }

    fn head(&self) -> (&DidUpdate, &str) {
        let last = self.updates.len() - 1; // non-empty, see `first`
        (&self.updates[last], &self.hashes[last])
    }
}

pub(crate) fn verify_genesis(update: &DidUpdate, now_unix_secs: i64) -> Result<(), LogError> {
    if update.seq != 0 {
        return Err(LogError::BadSeq {
            index: 0,
            seq: update.seq,
        });
    }
    if !update.prev.is_empty() {
        return Err(LogError::BadPrev { seq: 0 });
    }
    let did = &update.document.id;
    let expected = genesis_document(did).map_err(LogError::Genesis)?;
    if update.document != expected {
        return Err(LogError::GenesisMismatch { did: did.clone() });
    }
    check_time(update, None, now_unix_secs)?;
    update.check_nonce()?;
    let public = expected
        .key_for(
            &update.key_id,
            Relationship::CapabilityDelegation,
            update.timestamp,
        )
        .map_err(|source| LogError::Unauthorized {
            seq: 0,
            key_id: update.key_id.clone(),
            source,
        })?;
    update.check_signature(&public)
}

pub(crate) fn verify_step(
    prev: &DidUpdate,
    prev_hash: &str,
    update: &DidUpdate,
    now_unix_secs: i64,
) -> Result<(), LogError> {
    let seq = update.seq;
    // `prev.seq` was itself checked to be its position (< MAX_LOG_UPDATES), but
    // stay overflow-free regardless.
    let expected_seq = prev.seq.saturating_add(1);
    if seq != expected_seq {
        return Err(LogError::BadSeq {
            index: usize::try_from(expected_seq).unwrap_or(usize::MAX),
            seq,
        });
    }
    if update.prev != prev_hash {
        return Err(LogError::BadPrev { seq });
    }
    let old = &prev.document;
    let new = &update.document;
    if new.id != old.id {
        return Err(LogError::DidChanged {
            seq,
            found: new.id.clone(),
        });
    }
    new.validate()
        .map_err(|source| LogError::InvalidDocument { seq, source })?;
    if new.capability_delegation.is_empty() {
        return Err(LogError::NoDelegationKey { seq });
    }
    check_time(update, Some(prev.timestamp), now_unix_secs)?;
    update.check_nonce()?;
    let required = required_relationships(old, new);
    if required.is_empty() {
        return Err(LogError::EmptyUpdate { seq });
    }
    // One canonical spelling of the signer: an absolute id in this DID.
    if !update
        .key_id
        .strip_prefix(old.id.as_str())
        .is_some_and(|rest| rest.starts_with('#'))
    {
        return Err(LogError::MalformedUpdate {
            seq,
            reason: "key_id must be an absolute key id of this did",
        });
    }
    let unauthorized = |source| LogError::Unauthorized {
        seq,
        key_id: update.key_id.clone(),
        source,
    };
    let method = old
        .usable_method(&update.key_id, ED25519_KEY_TYPE, update.timestamp)
        .map_err(unauthorized)?;
    let public = method.ed25519_public().map_err(unauthorized)?;
    update.check_signature(&public)?;
    for rel in required {
        old.require_relationship(&update.key_id, rel)
            .map_err(unauthorized)?;
    }
    Ok(())
}

fn check_time(
    update: &DidUpdate,
    previous: Option<i64>,
    now_unix_secs: i64,
) -> Result<(), LogError> {
    if let Some(previous) = previous
        && update.timestamp < previous
    {
        return Err(LogError::TimestampRegression {
            seq: update.seq,
            timestamp: update.timestamp,
            previous,
        });
    }
    if update.timestamp > now_unix_secs.saturating_add(MAX_CLOCK_SKEW_SECS) {
        return Err(LogError::FromFuture {
            seq: update.seq,
            timestamp: update.timestamp,
            now: now_unix_secs,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests;
