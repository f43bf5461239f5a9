//! The agent's DID document as a compact, fork-aware chain of signed
//! operations: the v2 DID log.
//!
//! [`crate::log::DidLog`] puts the whole document in every update, so what a
//! stranger must fetch grows by a document per pairing or revocation. A
//! [`DidChain`] keeps today's updates as its opening entries
//! ([`DidEntry::V1`]; the genesis is always one) and continues with
//! [`DidEntryV2`] entries that carry only the [`DidOp`]s that changed the
//! document and the hash of the document they produce (`state`). An old log
//! converts losslessly, hashes unchanged ([`DidChain::from_v1`]).
//!
//! **Authority.** A document's [`Authority`] is its `controller` plus its
//! `capabilityDelegation` keys. Every v2 entry must be signed by a key of the
//! authority in force before it. An entry that changes the authority (an
//! *authority entry*; the genesis counts as one) carries the whole new
//! authority, and every v2 entry names the latest authority entry before it
//! (`auth_prev`). So the genesis, the authority entries and the head entry,
//! with the head's document, are enough to check the head: that is a
//! [`DidProof`], a few KiB however long the chain grows.
//!
//! **Rules.** [`DidChain::verify`] checks v1 entries with exactly the rules of
//! [`crate::log`], and v2 entries with the same rules plus: the signer holds
//! `capabilityDelegation`, `state`, `auth_prev` and `authority` are right, and
//! no recovery key (see [`signer_rank`]) is listed under `authentication`.
//!
//! **Forks.** Several devices may hold `capabilityDelegation`, so concurrent
//! updates fork the chain. [`compare_branches`] orders any two chains of one
//! DID totally and deterministically (longer prefix, then the highest signer
//! rank after the fork, then the lower hash at the fork), so every device that
//! has seen the same branches picks the same one; [`DidChain::merge`] adopts a
//! winning branch and hands back our lost entries for [`rebase_ops`]. Between
//! admin-only branches the lower hash wins, and a key holder can retry nonces
//! until its entry hashes lower, so an admin can undo a revocation of itself
//! that another admin signed by forking at it. Only a recovery signature after
//! the fork settles that: revoke a compromised admin with the recovery key.
//!
//! Like the rest of the crate this module does no IO and reads no clock;
//! storing chains and proofs and sending them to peers is the node's job.

use std::cmp::Ordering;
use std::collections::BTreeSet;

use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use serde::{Deserialize, Deserializer, Serialize, Serializer, de};
use sha2::{Digest, Sha256};

use crate::canonical::to_canonical_json;
use crate::document::{
    DidDocument, DidError, ED25519_KEY_TYPE, MAX_SERVICES, MAX_VERIFICATION_METHODS, Relationship,
    VerificationMethod, shorten,
};
use crate::keys::{DeviceKey, KeyError, verify_ed25519};
use crate::log::{
    self, DidLog, DidUpdate, LogError, MAX_CLOCK_SKEW_SECS, MAX_LOG_UPDATES, required_relationships,
};
use crate::nip2::signing_hash;

/// Most entries a chain may hold; longer chains are rejected rather than processed.
pub const MAX_CHAIN_ENTRIES: usize = 100_000;
/// Most ops one v2 entry may carry. [`diff`] never needs more than
/// 2 × [`MAX_VERIFICATION_METHODS`] + 5 × 16 + 3 = 595.
pub const MAX_OPS_PER_ENTRY: usize = 1024;
/// Largest encoded [`DidProof`] that [`DidProof::decode`] parses.
pub const MAX_PROOF_BYTES: usize = 64 * 1024;
/// Domain separator of v2 entry signatures (NIP-2 style).
pub const DID_UPDATE_V2_DOMAIN: &str = "NUWA_DID_UPDATE_V2:";
/// Rank of a signer that does not hold `capabilityDelegation`.
pub const RANK_NONE: u8 = 0;
/// Rank of an ordinary `capabilityDelegation` key (an admin device or the master key).
pub const RANK_ADMIN: u8 = 1;
/// Rank of a recovery key: its signature after a fork beats any admin-only branch.
pub const RANK_RECOVERY: u8 = 2;

/// Above this many grant/revoke ops for one relationship, [`diff`] sets the whole list instead.
const MAX_INCREMENTAL_OPS: usize = 16;

/// Errors from building, verifying, comparing or merging DID chains and proofs.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ChainError {
    /// The chain or proof has no entries.
    #[error("did chain is empty")]
    Empty,
    /// The chain exceeds [`MAX_CHAIN_ENTRIES`].
    #[error("did chain has {len} entries, more than the limit of {max}")]
    TooLong {
        /// Number of entries (or the number it would reach).
        len: usize,
        /// The limit.
        max: usize,
    },
    /// The chain opens with more v1 entries than a v1 log may hold.
    #[error("did chain opens with {len} v1 entries, more than the v1 limit of {max}")]
    V1PrefixTooLong {
        /// Number of v1 entries.
        len: usize,
        /// [`MAX_LOG_UPDATES`].
        max: usize,
    },
    /// The chain or proof is for a different agent.
    #[error("did chain is for {found}, expected {expected}")]
    WrongDid {
        /// The DID the caller expected.
        expected: String,
        /// The DID found (shortened if long).
        found: String,
    },
    /// The genesis DID is not an Ed25519 did:key, so the chain cannot certify itself.
    #[error("did chain genesis is not for an ed25519 did:key")]
    Genesis(#[source] DidError),
    /// The genesis document is not the did:key document of its DID.
    #[error("did chain genesis for {did} does not carry its did:key document")]
    GenesisMismatch {
        /// The genesis DID.
        did: String,
    },
    /// The first entry is a v2 entry; chains open with today's (v1) genesis.
    #[error("did chain does not open with a v1 genesis entry")]
    GenesisNotV1,
    /// A v1 entry follows a v2 entry; v1 entries may only open a chain.
    #[error("did entry {seq} is a v1 entry after a v2 entry; v1 entries may only open a chain")]
    V1AfterV2 {
        /// The entry's position.
        seq: u64,
    },
    /// An entry's `seq` is not its position in the chain.
    #[error("did entry at position {index} has seq {seq}")]
    BadSeq {
        /// Position in the chain.
        index: usize,
        /// The seq it claims.
        seq: u64,
    },
    /// An entry's `prev` is not the hash of the entry before it.
    #[error("did entry {seq} does not chain to the previous entry (prev hash mismatch)")]
    BadPrev {
        /// The entry's seq.
        seq: u64,
    },
    /// A v2 entry claims a version other than 2.
    #[error("did entry {seq} has version {version}, expected 2")]
    BadVersion {
        /// The entry's seq.
        seq: u64,
        /// The version it claims.
        version: u8,
    },
    /// An entry changes the document's `id`.
    #[error("did entry {seq} changes the document id to {found}")]
    DidChanged {
        /// The entry's seq.
        seq: u64,
        /// The new id (shortened if long).
        found: String,
    },
    /// The document after the entry fails [`DidDocument::validate`] or a size bound.
    #[error("did entry {seq} yields an invalid document")]
    InvalidDocument {
        /// The entry's seq.
        seq: u64,
        /// Why the document is invalid.
        #[source]
        source: DidError,
    },
    /// The document after the entry has no key able to change it again.
    #[error("did entry {seq} leaves no capabilityDelegation key")]
    NoDelegationKey {
        /// The entry's seq.
        seq: u64,
    },
    /// A v2 entry lists a recovery key under `authentication`.
    #[error(
        "did entry {seq} lists recovery key {key_id} in authentication; recovery keys may only administer"
    )]
    RecoveryKeyAuthenticates {
        /// The entry's seq.
        seq: u64,
        /// The recovery key id.
        key_id: String,
    },
    /// The entry does not change the document (or a v2 entry has no ops).
    #[error("did entry {seq} does not change the document")]
    EmptyUpdate {
        /// The entry's seq.
        seq: u64,
    },
    /// A v2 entry carries more than [`MAX_OPS_PER_ENTRY`] ops.
    #[error("did entry {seq} carries {count} ops, more than the limit of {max}")]
    TooManyOps {
        /// The entry's seq.
        seq: u64,
        /// How many ops it carries.
        count: usize,
        /// The limit.
        max: usize,
    },
    /// The entry's timestamp is earlier than its predecessor's.
    #[error("did entry {seq} has timestamp {timestamp}, before the previous entry's {previous}")]
    TimestampRegression {
        /// The entry's seq.
        seq: u64,
        /// Its timestamp.
        timestamp: i64,
        /// The previous entry's timestamp.
        previous: i64,
    },
    /// The entry's timestamp lies more than [`MAX_CLOCK_SKEW_SECS`] in the future.
    #[error(
        "did entry {seq} has timestamp {timestamp}, too far after now ({now}); check the clocks"
    )]
    FromFuture {
        /// The entry's seq.
        seq: u64,
        /// Its timestamp.
        timestamp: i64,
        /// The verifier's time.
        now: i64,
    },
    /// A field of the entry has the wrong format.
    #[error("did entry {seq} is malformed: {reason}")]
    Malformed {
        /// The entry's seq.
        seq: u64,
        /// Which field and what is wrong.
        reason: &'static str,
    },
    /// The signer may not make this entry (unknown, expired, wrong type or missing relationship).
    #[error("did entry {seq} signer {key_id} is not authorised")]
    Unauthorized {
        /// The entry's seq.
        seq: u64,
        /// The signing key id it names (shortened if long).
        key_id: String,
        /// The precise reason ([`DidError::PermissionDenied`], [`DidError::KeyNotFound`], ...).
        #[source]
        source: DidError,
    },
    /// An append was given a key that is not the one listed under the key id.
    #[error("the signing key given does not match {key_id} in the did document")]
    WrongSigningKey {
        /// The key id named by the caller.
        key_id: String,
    },
    /// The entry's signature does not verify under the named key.
    #[error("did entry {seq} signature does not verify under {key_id}")]
    BadSignature {
        /// The entry's seq.
        seq: u64,
        /// The key id it names (shortened if long).
        key_id: String,
    },
    /// [`apply`]: an op does not apply to the document.
    #[error("did op {index} does not apply")]
    Op {
        /// Position of the op in the list.
        index: usize,
        /// What is wrong.
        #[source]
        source: OpError,
    },
    /// An op of an entry does not apply to the document before it.
    #[error("did entry {seq} op {index} does not apply")]
    EntryOp {
        /// The entry's seq.
        seq: u64,
        /// Position of the op in the entry.
        index: usize,
        /// What is wrong.
        #[source]
        source: OpError,
    },
    /// A v2 entry's `state` is not the hash of the document its ops produce.
    #[error("did entry {seq} state hash does not match the document its ops produce")]
    BadState {
        /// The entry's seq.
        seq: u64,
    },
    /// A v2 entry's `auth_prev` does not name the latest authority entry before it.
    #[error("did entry {seq} auth_prev does not name the latest authority entry before it")]
    BadAuthPrev {
        /// The entry's seq.
        seq: u64,
    },
    /// A v2 entry changes the authority without carrying the new authority.
    #[error("did entry {seq} changes the authority but does not carry the new authority")]
    MissingAuthority {
        /// The entry's seq.
        seq: u64,
    },
    /// A v2 entry carries an authority although it does not change it.
    #[error("did entry {seq} carries an authority but does not change the authority")]
    UnexpectedAuthority {
        /// The entry's seq.
        seq: u64,
    },
    /// A v2 entry carries an authority other than the one its document has.
    #[error("did entry {seq} carries an authority that differs from its document's")]
    WrongAuthority {
        /// The entry's seq.
        seq: u64,
    },
    /// A proof's entries are not in strictly increasing seq order.
    #[error("did proof entry {seq} does not come after entry {previous}")]
    ProofOrder {
        /// The entry's seq.
        seq: u64,
        /// The seq of the entry before it in the proof.
        previous: u64,
    },
    /// A proof's document is not the one its head entry commits to.
    #[error("did proof document does not match head entry {seq}")]
    ProofHeadMismatch {
        /// The head entry's seq.
        seq: u64,
    },
    /// A proof's document has another authority than the one in force after its head.
    #[error("did proof document's authority differs from the one in force after entry {seq}")]
    ProofHeadAuthority {
        /// The head entry's seq.
        seq: u64,
    },
    /// An encoded proof exceeds [`MAX_PROOF_BYTES`].
    #[error("did proof is {len} bytes, more than the limit of {max}")]
    ProofTooLarge {
        /// Size of the input.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// The proof bytes are not a proof in JSON.
    #[error("cannot decode did proof json")]
    Decode(#[source] serde_json::Error),
    /// Canonical JSON encoding failed.
    #[error("cannot encode did entry as canonical json")]
    Encode(#[source] serde_json::Error),
    /// Drawing a random nonce failed.
    #[error("cannot create did entry")]
    Key(#[source] KeyError),
    /// A v1 rule failed in a way that has no chain counterpart.
    #[error("did chain v1 entry is invalid")]
    Log(#[source] LogError),
}

impl From<LogError> for ChainError {
    fn from(e: LogError) -> ChainError {
        match e {
            LogError::Empty => ChainError::Empty,
            LogError::TooLong { len, max } => ChainError::V1PrefixTooLong { len, max },
            LogError::WrongDid { expected, found } => ChainError::WrongDid { expected, found },
            LogError::Genesis(source) => ChainError::Genesis(source),
            LogError::GenesisMismatch { did } => ChainError::GenesisMismatch { did },
            LogError::BadSeq { index, seq } => ChainError::BadSeq { index, seq },
            LogError::BadPrev { seq } => ChainError::BadPrev { seq },
            LogError::DidChanged { seq, found } => ChainError::DidChanged { seq, found },
            LogError::InvalidDocument { seq, source } => {
                ChainError::InvalidDocument { seq, source }
            }
            LogError::NoDelegationKey { seq } => ChainError::NoDelegationKey { seq },
            LogError::EmptyUpdate { seq } => ChainError::EmptyUpdate { seq },
            LogError::TimestampRegression {
                seq,
                timestamp,
                previous,
            } => ChainError::TimestampRegression {
                seq,
                timestamp,
                previous,
            },
            LogError::FromFuture {
                seq,
                timestamp,
                now,
            } => ChainError::FromFuture {
                seq,
                timestamp,
                now,
            },
            LogError::MalformedUpdate { seq, reason } => ChainError::Malformed { seq, reason },
            LogError::Unauthorized {
                seq,
                key_id,
                source,
            } => ChainError::Unauthorized {
                seq,
                key_id,
                source,
            },
            LogError::WrongSigningKey { key_id } => ChainError::WrongSigningKey { key_id },
            LogError::BadSignature { seq, key_id } => ChainError::BadSignature { seq, key_id },
            LogError::Encode(source) => ChainError::Encode(source),
            LogError::Key(source) => ChainError::Key(source),
            other @ LogError::Fork { .. } => ChainError::Log(other),
        }
    }
}

/// Why one [`DidOp`] does not apply to a document.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum OpError {
    /// `add_method` of an id that is already listed.
    #[error("verification method {id} is already listed")]
    MethodExists {
        /// The id (shortened if long).
        id: String,
    },
    /// `remove_method`, `grant` or `set_relationship` of an id that is not listed.
    #[error("verification method {id} is not listed")]
    MethodNotFound {
        /// The id (shortened if long).
        id: String,
    },
    /// `grant` of an id the relationship already lists.
    #[error("{rel} already lists {id}")]
    AlreadyGranted {
        /// The relationship.
        rel: Relationship,
        /// The id (shortened if long).
        id: String,
    },
    /// `revoke` of an id the relationship does not list.
    #[error("{rel} does not list {id}")]
    NotGranted {
        /// The relationship.
        rel: Relationship,
        /// The id (shortened if long).
        id: String,
    },
    /// `set_relationship` names an id twice.
    #[error("{rel} would list {id} twice")]
    DuplicateId {
        /// The relationship.
        rel: Relationship,
        /// The id (shortened if long).
        id: String,
    },
    /// A `set_*` op sets a field to the value it already has.
    #[error("{field} already has the value the op sets")]
    Unchanged {
        /// The field (`service`, `controller`, `@context` or a relationship).
        field: &'static str,
    },
}

/// One change to a DID document, as carried by a v2 entry.
///
/// Key ids inside ops are written relative to the document's DID (`#frag`)
/// when they belong to it, which is always the case in a valid document, and
/// absolute otherwise; [`apply`] resolves `#frag` against the document's id.
/// `add_method` carries the method exactly as the document lists it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case", deny_unknown_fields)]
pub enum DidOp {
    /// Appends `method` to `verificationMethod`.
    AddMethod {
        /// The method to list.
        method: VerificationMethod,
    },
    /// Removes the method `id` and removes `id` from every relationship list.
    RemoveMethod {
        /// The method's id.
        id: String,
    },
    /// Appends `id` to the `rel` list.
    Grant {
        /// The relationship.
        rel: Relationship,
        /// The listed method's id.
        id: String,
    },
    /// Removes `id` from the `rel` list.
    Revoke {
        /// The relationship.
        rel: Relationship,
        /// The id to remove.
        id: String,
    },
    /// Replaces the `rel` list (for changes grants and revokes cannot express, such as reordering).
    SetRelationship {
        /// The relationship.
        rel: Relationship,
        /// The whole new list.
        ids: Vec<String>,
    },
    /// Replaces the `service` list.
    SetService {
        /// The whole new list.
        service: Vec<serde_json::Value>,
    },
    /// Replaces (or with `null`, removes) the `controller`.
    SetController {
        /// The new controller.
        controller: Option<String>,
    },
    /// Replaces the `@context` list.
    SetContext {
        /// The whole new list.
        context: Vec<String>,
    },
}

/// `did#frag` -> `#frag` for ids of this DID; other ids unchanged.
fn relative_id(did: &str, id: &str) -> String {
    match id.strip_prefix(did) {
        Some(rest) if rest.starts_with('#') => rest.to_owned(),
        _ => id.to_owned(),
    }
}

/// `#frag` -> `did#frag`; other ids unchanged. Inverse of [`relative_id`]
/// for every id that does not itself start with `#` (valid documents never do).
fn absolute_id(did: &str, id: &str) -> String {
    if id.starts_with('#') {
        format!("{did}{id}")
    } else {
        id.to_owned()
    }
}

/// Applies `ops` in order to a copy of `doc`. Fails with [`ChainError::Op`]
/// on the first op that does not apply ([`OpError`] says why). The result is
/// not validated: that is the verifier's job.
pub fn apply(doc: &DidDocument, ops: &[DidOp]) -> Result<DidDocument, ChainError> {
    let mut out = doc.clone();
    for (index, op) in ops.iter().enumerate() {
        apply_op(&mut out, op).map_err(|source| ChainError::Op { index, source })?;
    }
    Ok(out)
}

fn apply_op(doc: &mut DidDocument, op: &DidOp) -> Result<(), OpError> {
    let listed = |doc: &DidDocument, id: &str| doc.verification_method.iter().any(|m| m.id == id);
    match op {
        DidOp::AddMethod { method } => {
            if listed(doc, &method.id) {
                return Err(OpError::MethodExists {
                    id: shorten(&method.id),
                });
            }
            doc.verification_method.push(method.clone());
        }
        DidOp::RemoveMethod { id } => {
            let id = absolute_id(&doc.id, id);
            let index = doc
                .verification_method
                .iter()
                .position(|m| m.id == id)
                .ok_or_else(|| OpError::MethodNotFound { id: shorten(&id) })?;
            doc.verification_method.remove(index);
            for rel in Relationship::ALL {
                doc.relationship_mut(rel).retain(|listed| *listed != id);
            }
        }
        DidOp::Grant { rel, id } => {
            let id = absolute_id(&doc.id, id);
            if !listed(doc, &id) {
                return Err(OpError::MethodNotFound { id: shorten(&id) });
            }
            let list = doc.relationship_mut(*rel);
            if list.contains(&id) {
                return Err(OpError::AlreadyGranted {
                    rel: *rel,
                    id: shorten(&id),
                });
            }
            list.push(id);
        }
        DidOp::Revoke { rel, id } => {
            let id = absolute_id(&doc.id, id);
            let list = doc.relationship_mut(*rel);
            let before = list.len();
            list.retain(|listed| *listed != id);
            if list.len() == before {
                return Err(OpError::NotGranted {
                    rel: *rel,
                    id: shorten(&id),
                });
            }
        }
        DidOp::SetRelationship { rel, ids } => {
            let methods: BTreeSet<&str> = doc
                .verification_method
                .iter()
                .map(|m| m.id.as_str())
                .collect();
            let mut seen = BTreeSet::new();
            let mut list = Vec::with_capacity(ids.len().min(methods.len()));
            for id in ids {
                let id = absolute_id(&doc.id, id);
                if !methods.contains(id.as_str()) {
                    return Err(OpError::MethodNotFound { id: shorten(&id) });
                }
                if !seen.insert(id.clone()) {
                    return Err(OpError::DuplicateId {
                        rel: *rel,
                        id: shorten(&id),
                    });
                }
                list.push(id);
            }
            let current = doc.relationship_mut(*rel);
            if *current == list {
                return Err(OpError::Unchanged {
                    field: rel.as_str(),
                });
            }
            *current = list;
        }
        DidOp::SetService { service } => {
            if doc.service == *service {
                return Err(OpError::Unchanged { field: "service" });
            }
            doc.service = service.clone();
        }
        DidOp::SetController { controller } => {
            if doc.controller == *controller {
                return Err(OpError::Unchanged {
                    field: "controller",
                });
            }
            doc.controller = controller.clone();
        }
        DidOp::SetContext { context } => {
            if doc.context == *context {
                return Err(OpError::Unchanged { field: "@context" });
            }
            doc.context = context.clone();
        }
    }
    Ok(())
}

/// The ops that turn `old` into `new`: `apply(old, &diff(old, new)) == new`.
///
/// This holds for every pair of documents with the same `id` in which method
/// ids are unique, every relationship entry names a listed method once, and
/// no id starts with `#` (every valid document qualifies). Methods that `new`
/// keeps unchanged, in the same order and ahead of its new methods, stay;
/// every other method of `old` is removed and the rest of `new`'s appended.
/// A relationship list is edited with revokes and grants when that yields it
/// in at most 16 ops, and set whole otherwise. Equal documents give no ops.
pub fn diff(old: &DidDocument, new: &DidDocument) -> Vec<DidOp> {
    let did = old.id.as_str();
    let mut ops = Vec::new();

    // The longest prefix of new's methods that old lists unchanged, in order.
    let mut kept_positions = BTreeSet::new();
    let mut last: Option<usize> = None;
    for method in &new.verification_method {
        let Some(position) = old.verification_method.iter().position(|m| m == method) else {
            break;
        };
        if last.is_some_and(|l| position <= l) {
            break;
        }
        kept_positions.insert(position);
        last = Some(position);
    }
    let mut removed = BTreeSet::new();
    for (position, method) in old.verification_method.iter().enumerate() {
        if !kept_positions.contains(&position) {
            ops.push(DidOp::RemoveMethod {
                id: relative_id(did, &method.id),
            });
            removed.insert(method.id.as_str());
        }
    }
    for method in &new.verification_method[kept_positions.len()..] {
        ops.push(DidOp::AddMethod {
            method: method.clone(),
        });
    }

    for rel in Relationship::ALL {
        // What the list holds once the removals above have been applied.
        let current: Vec<&str> = old
            .relationship(rel)
            .iter()
            .map(String::as_str)
            .filter(|id| !removed.contains(id))
            .collect();
        let target = new.relationship(rel);
        if current
            .iter()
            .copied()
            .eq(target.iter().map(String::as_str))
        {
            continue;
        }
        match incremental_ops(did, rel, &current, target) {
            Some(mut steps) if steps.len() <= MAX_INCREMENTAL_OPS => ops.append(&mut steps),
            _ => ops.push(DidOp::SetRelationship {
                rel,
                ids: target.iter().map(|id| relative_id(did, id)).collect(),
            }),
        }
    }

    if old.service != new.service {
        ops.push(DidOp::SetService {
            service: new.service.clone(),
        });
    }
    if old.controller != new.controller {
        ops.push(DidOp::SetController {
            controller: new.controller.clone(),
        });
    }
    if old.context != new.context {
        ops.push(DidOp::SetContext {
            context: new.context.clone(),
        });
    }
    ops
}

/// Revokes then grants that turn `current` into `target`, if they can: what
/// survives the revokes must be the start of `target` (grants append).
fn incremental_ops(
    did: &str,
    rel: Relationship,
    current: &[&str],
    target: &[String],
) -> Option<Vec<DidOp>> {
    let wanted: BTreeSet<&str> = target.iter().map(String::as_str).collect();
    let mut ops = Vec::new();
    let mut survivors = Vec::new();
    for id in current {
        if wanted.contains(id) {
            survivors.push(*id);
        } else {
            ops.push(DidOp::Revoke {
                rel,
                id: relative_id(did, id),
            });
        }
    }
    let is_prefix = survivors.len() <= target.len()
        && survivors
            .iter()
            .zip(target)
            .all(|(survivor, wanted)| *survivor == wanted);
    if !is_prefix {
        return None;
    }
    let mut listed: BTreeSet<&str> = survivors.iter().copied().collect();
    for id in &target[survivors.len()..] {
        if !listed.insert(id.as_str()) {
            return None;
        }
        ops.push(DidOp::Grant {
            rel,
            id: relative_id(did, id),
        });
    }
    Some(ops)
}

/// One `capabilityDelegation` key as an [`Authority`] lists it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct AuthorityKey {
    /// The method's id, relative (`#frag`) when it belongs to the DID.
    pub id: String,
    /// The method's type (always `Ed25519VerificationKey2020` in a valid document).
    pub r#type: String,
    /// The method's `publicKeyMultibase`.
    pub public_key_multibase: String,
    /// The method's `expires`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expires: Option<String>,
}

/// Who may change a document: its `controller` and its `capabilityDelegation`
/// keys, in `verificationMethod` order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Authority {
    /// The document's `controller`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub controller: Option<String>,
    /// The methods listed under `capabilityDelegation`.
    pub keys: Vec<AuthorityKey>,
}

impl Authority {
    /// The authority of `doc`.
    pub fn of(doc: &DidDocument) -> Authority {
        let keys = doc
            .verification_method
            .iter()
            .filter(|m| doc.capability_delegation.contains(&m.id))
            .map(|m| AuthorityKey {
                id: relative_id(&doc.id, &m.id),
                r#type: m.r#type.clone(),
                public_key_multibase: m.public_key_multibase.clone(),
                expires: m.expires.clone(),
            })
            .collect();
        Authority {
            controller: doc.controller.clone(),
            keys,
        }
    }

    /// [`RANK_RECOVERY`], [`RANK_ADMIN`] or [`RANK_NONE`] for the key `key_id` of `did`.
    pub fn rank(&self, did: &str, key_id: &str) -> u8 {
        let relative = relative_id(did, key_id);
        match self.keys.iter().find(|k| k.id == relative) {
            None => RANK_NONE,
            Some(_) if is_recovery_id(key_id) => RANK_RECOVERY,
            Some(_) => RANK_ADMIN,
        }
    }

    /// The Ed25519 key of `key_id` if it belongs to this authority and is unexpired at `at_unix_secs`.
    fn signer_public(
        &self,
        did: &str,
        key_id: &str,
        at_unix_secs: i64,
    ) -> Result<[u8; 32], DidError> {
        let relative = relative_id(did, key_id);
        let key = self.keys.iter().find(|k| k.id == relative).ok_or_else(|| {
            DidError::PermissionDenied {
                key_id: shorten(key_id),
                rel: Relationship::CapabilityDelegation,
            }
        })?;
        let method = VerificationMethod {
            id: absolute_id(did, &key.id),
            r#type: key.r#type.clone(),
            controller: did.to_owned(),
            public_key_multibase: key.public_key_multibase.clone(),
            expires: key.expires.clone(),
        };
        let public = method.ed25519_public()?;
        method.check_not_expired(at_unix_secs)?;
        Ok(public)
    }
}

/// One notion of "recovery key" for the chain, the v1 log's fork rule and
/// the node: a `recovery-<n>` fragment ([`crate::recovery::is_recovery_fragment`]).
fn is_recovery_id(key_id: &str) -> bool {
    crate::recovery::is_recovery_fragment(key_id)
}

/// How much a signature by `key_id` weighs when branches fork, judged in the
/// document before the entry: [`RANK_RECOVERY`] for a `capabilityDelegation`
/// key whose fragment starts with `recovery`, [`RANK_ADMIN`] for any other
/// `capabilityDelegation` key, [`RANK_NONE`] otherwise.
pub fn signer_rank(doc_before: &DidDocument, key_id: &str) -> u8 {
    let key_id = doc_before.key_id(key_id);
    if !doc_before.has_relationship(&key_id, Relationship::CapabilityDelegation) {
        RANK_NONE
    } else if is_recovery_id(&key_id) {
        RANK_RECOVERY
    } else {
        RANK_ADMIN
    }
}

/// A v2 entry: the ops of one signed change, and what they lead to.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DidEntryV2 {
    /// Always 2.
    pub v: u8,
    /// Position in the chain.
    pub seq: u64,
    /// Hex SHA-256 of the previous entry's canonical JSON (any version).
    pub prev: String,
    /// Hex hash of the latest authority entry before this one (the genesis at least).
    pub auth_prev: String,
    /// The changes, applied in order to the previous document (at least one).
    pub ops: Vec<DidOp>,
    /// The whole authority after this entry; present exactly when the entry changes it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub authority: Option<Authority>,
    /// Hex SHA-256 of the canonical JSON of the whole document after this entry.
    pub state: String,
    /// Unix seconds when the entry was signed (claimed by the signer).
    pub timestamp: i64,
    /// Hex of 16 random bytes, so two otherwise equal entries differ.
    pub nonce: String,
    /// Absolute id of the signing key, a `capabilityDelegation` key of the previous document.
    pub key_id: String,
    /// Base64url (no padding) Ed25519 signature over
    /// SHA-256(`NUWA_DID_UPDATE_V2:` ‖ canonical JSON of this entry without `signature`).
    pub signature: String,
}

/// The fields the signature covers: everything but the signature.
#[derive(Serialize)]
struct UnsignedEntryV2<'a> {
    v: u8,
    seq: u64,
    prev: &'a str,
    auth_prev: &'a str,
    ops: &'a [DidOp],
    #[serde(skip_serializing_if = "Option::is_none")]
    authority: Option<&'a Authority>,
    state: &'a str,
    timestamp: i64,
    nonce: &'a str,
    key_id: &'a str,
}

impl DidEntryV2 {
    /// The 32-byte digest the signature is over.
    pub fn signing_digest(&self) -> Result<[u8; 32], ChainError> {
        let unsigned = UnsignedEntryV2 {
            v: self.v,
            seq: self.seq,
            prev: &self.prev,
            auth_prev: &self.auth_prev,
            ops: &self.ops,
            authority: self.authority.as_ref(),
            state: &self.state,
            timestamp: self.timestamp,
            nonce: &self.nonce,
            key_id: &self.key_id,
        };
        let content = to_canonical_json(&unsigned).map_err(ChainError::Encode)?;
        Ok(signing_hash(DID_UPDATE_V2_DOMAIN, &content))
    }

    /// Fills in a fresh nonce and signs; `entry.signature` is overwritten. Nothing is checked.
    fn sign(mut entry: DidEntryV2, signer: &DeviceKey) -> Result<DidEntryV2, ChainError> {
        let mut nonce = [0u8; 16];
        nuwa_entropy::fill(&mut nonce).map_err(|e| ChainError::Key(KeyError::Random(e)))?;
        entry.nonce = hex::encode(nonce);
        let digest = entry.signing_digest()?;
        entry.signature = URL_SAFE_NO_PAD.encode(signer.sign(&digest));
        Ok(entry)
    }

    fn check_signature(&self, public: &[u8; 32]) -> Result<(), ChainError> {
        let malformed = || ChainError::Malformed {
            seq: self.seq,
            reason: "signature must be 64 bytes of base64url without padding",
        };
        // 64 bytes are 86 base64 characters; refuse to decode anything longer.
        if self.signature.len() != 86 {
            return Err(malformed());
        }
        let bytes = URL_SAFE_NO_PAD
            .decode(&self.signature)
            .map_err(|_| malformed())?;
        let sig: [u8; 64] = bytes.try_into().map_err(|_| malformed())?;
        let digest = self.signing_digest()?;
        verify_ed25519(public, &digest, &sig).map_err(|_| ChainError::BadSignature {
            seq: self.seq,
            key_id: shorten(&self.key_id),
        })
    }
}

/// One entry of a chain: today's full-document update, or a v2 op entry.
///
/// On the wire a v1 entry is exactly a [`DidUpdate`] (no `v` field), so its
/// hash is unchanged; a v2 entry has `"v": 2`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DidEntry {
    /// A [`crate::log`] update, carrying the whole document.
    V1(DidUpdate),
    /// An op entry.
    V2(DidEntryV2),
}

impl DidEntry {
    /// 1 or 2.
    pub fn version(&self) -> u8 {
        match self {
            DidEntry::V1(_) => 1,
            DidEntry::V2(_) => 2,
        }
    }

    /// The seq the entry claims.
    pub fn seq(&self) -> u64 {
        match self {
            DidEntry::V1(u) => u.seq,
            DidEntry::V2(e) => e.seq,
        }
    }

    /// The timestamp the entry claims.
    pub fn timestamp(&self) -> i64 {
        match self {
            DidEntry::V1(u) => u.timestamp,
            DidEntry::V2(e) => e.timestamp,
        }
    }

    /// The signing key id the entry names.
    pub fn key_id(&self) -> &str {
        match self {
            DidEntry::V1(u) => &u.key_id,
            DidEntry::V2(e) => &e.key_id,
        }
    }

    /// Hex SHA-256 of the entry's canonical JSON (signature included): what the next `prev` holds.
    pub fn hash(&self) -> Result<String, ChainError> {
        let bytes = to_canonical_json(self).map_err(ChainError::Encode)?;
        Ok(hex::encode(Sha256::digest(&bytes)))
    }
}

impl Serialize for DidEntry {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        match self {
            DidEntry::V1(u) => u.serialize(serializer),
            DidEntry::V2(e) => e.serialize(serializer),
        }
    }
}

impl<'de> Deserialize<'de> for DidEntry {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<DidEntry, D::Error> {
        let value = serde_json::Value::deserialize(deserializer)?;
        match value.get("v") {
            None => serde_json::from_value(value)
                .map(DidEntry::V1)
                .map_err(de::Error::custom),
            Some(v) if v.as_u64() == Some(2) => serde_json::from_value(value)
                .map(DidEntry::V2)
                .map_err(de::Error::custom),
            Some(v) => Err(de::Error::custom(format!(
                "did entry version {} is not supported (expected no `v` or 2)",
                shorten(&v.to_string())
            ))),
        }
    }
}

/// What the chain knows about each entry once it has replayed the ops.
#[derive(Debug, Clone)]
struct EntryMeta {
    /// [`DidEntry::hash`].
    hash: String,
    /// [`signer_rank`] of the signer in the document before the entry.
    rank: u8,
    /// Whether the entry changes the authority (the genesis does).
    authority: bool,
}

/// What [`DidChain::merge`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MergeOutcome {
    /// The other chain held nothing new (it equals ours or is a prefix of it).
    Unchanged,
    /// Our chain now equals the other, longer chain; lengths before and after.
    Extended {
        /// Our length before the merge.
        from: usize,
        /// Our length after the merge.
        to: usize,
    },
    /// The chains fork and ours wins; nothing changed.
    KeptOurs {
        /// First seq at which the chains differ.
        fork_seq: u64,
    },
    /// Ours wins (or is equal), but the other chain or the lost branches
    /// it carries remove a device ours lists: kept as evidence, so
    /// [`DidChain::current`] changed ([strong removal](removal)).
    NotedRemovals {
        /// First seq at which the chains differ, if they do.
        fork_seq: Option<u64>,
    },
    /// The chains fork and the other wins: our chain now equals it. `lost`
    /// holds our entries from the fork on, so the ops our own key signed can
    /// be re-signed on top of the winner ([`rebase_ops`]).
    SwitchedFork {
        /// First seq at which the chains differed.
        fork_seq: u64,
        /// Our entries from `fork_seq` on, which the winner does not hold.
        lost: Vec<DidEntry>,
    },
}

/// A DID chain: at least the genesis, at most [`MAX_CHAIN_ENTRIES`] entries,
/// v1 entries only at the start. Deserializing checks that shape and that
/// every op applies (to know the current document); call
/// [`DidChain::verify`] (or use [`DidChain::merge`]) before trusting one.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(try_from = "RawDidChain")]
pub struct DidChain {
    entries: Vec<DidEntry>,
    #[serde(skip)]
    meta: Vec<EntryMeta>,
    /// The document after the last entry.
    #[serde(skip)]
    current: DidDocument,
    /// `Authority::of(&current)`.
    #[serde(skip)]
    authority: Authority,
    /// Hash of the latest authority entry.
    #[serde(skip)]
    auth_hash: String,
    /// Branches that lost the fork rule and remove a device `current`
    /// lists ([strong removal](removal)).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    lost: Vec<DidChain>,
    /// `current` without the devices `lost` removed; `None` when equal.
    #[serde(skip)]
    effective: Option<DidDocument>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawDidChain {
    entries: Vec<DidEntry>,
    #[serde(default)]
    lost: Vec<DidChain>,
}

impl TryFrom<RawDidChain> for DidChain {
    type Error = ChainError;

    fn try_from(raw: RawDidChain) -> Result<DidChain, ChainError> {
        if raw.lost.len() > removal::MAX_LOST_BRANCHES {
            return Err(ChainError::TooLong {
                len: raw.lost.len(),
                max: removal::MAX_LOST_BRANCHES,
            });
        }
        let mut chain = DidChain::from_entries(raw.entries)?;
        chain.keep_lost_of(&raw.lost);
        Ok(chain)
    }
}

impl PartialEq for DidChain {
    fn eq(&self, other: &DidChain) -> bool {
        self.meta
            .iter()
            .map(|m| &m.hash)
            .eq(other.meta.iter().map(|m| &m.hash))
    }
}

impl Eq for DidChain {}

/// `index` as a seq; chains never come near `u64::MAX` entries.
fn seq_at(index: usize) -> u64 {
    u64::try_from(index).unwrap_or(u64::MAX)
}

/// Turns [`ChainError::Op`] from [`apply`] into [`ChainError::EntryOp`] of entry `seq`.
fn in_entry(seq: u64) -> impl Fn(ChainError) -> ChainError {
    move |e| match e {
        ChainError::Op { index, source } => ChainError::EntryOp { seq, index, source },
        other => other,
    }
}

impl MergeOutcome {
    /// Whether the merge changed our chain (extended it or switched branch).
    pub fn changed(&self) -> bool {
        matches!(
            self,
            MergeOutcome::Extended { .. }
                | MergeOutcome::SwitchedFork { .. }
                | MergeOutcome::NotedRemovals { .. }
        )
    }
}

/// Most entries [`DidChain::splice`] takes in one call (one page of a peer's answer).
pub const MAX_SPLICE_ENTRIES: usize = 4096;

impl DidChain {
    fn from_entries(entries: Vec<DidEntry>) -> Result<DidChain, ChainError> {
        if entries.len() > MAX_CHAIN_ENTRIES {
            return Err(ChainError::TooLong {
                len: entries.len(),
                max: MAX_CHAIN_ENTRIES,
            });
        }
        let Some(first) = entries.first() else {
            return Err(ChainError::Empty);
        };
        let DidEntry::V1(genesis) = first else {
            return Err(ChainError::GenesisNotV1);
        };
        let mut doc = genesis.document.clone();
        let mut authority = Authority::of(&doc);
        let mut meta = Vec::with_capacity(entries.len());
        meta.push(EntryMeta {
            hash: first.hash()?,
            rank: signer_rank(&doc, &genesis.key_id),
            authority: true,
        });
        let mut auth_index = 0;
        let mut v1_len = 1;
        for (index, entry) in entries.iter().enumerate().skip(1) {
            let seq = seq_at(index);
            let rank = signer_rank(&doc, entry.key_id());
            if matches!(entry, DidEntry::V1(_)) && v1_len < index {
                return Err(ChainError::V1AfterV2 { seq });
            }
            // A replayed entry would otherwise fail as an op that does not apply.
            if entry.seq() != seq {
                return Err(ChainError::BadSeq {
                    index,
                    seq: entry.seq(),
                });
            }
            let next = match entry {
                DidEntry::V1(update) => {
                    v1_len += 1;
                    update.document.clone()
                }
                DidEntry::V2(e) => {
                    check_ops_count(seq, e.ops.len())?;
                    let next = apply(&doc, &e.ops).map_err(in_entry(seq))?;
                    check_size(seq, &next)?;
                    next
                }
            };
            let next_authority = Authority::of(&next);
            let changes_authority = next_authority != authority;
            if changes_authority {
                authority = next_authority;
                auth_index = index;
            }
            meta.push(EntryMeta {
                hash: entry.hash()?,
                rank,
                authority: changes_authority,
            });
            doc = next;
        }
        if v1_len > MAX_LOG_UPDATES {
            return Err(ChainError::V1PrefixTooLong {
                len: v1_len,
                max: MAX_LOG_UPDATES,
            });
        }
        let auth_hash = meta[auth_index].hash.clone();
        Ok(DidChain {
            entries,
            meta,
            current: doc,
            authority,
            auth_hash,
            lost: Vec::new(),
            effective: None,
        })
    }

    /// Starts a chain for the agent whose master key is `master`: today's
    /// genesis ([`DidLog::genesis`]).
    pub fn genesis(master: &DeviceKey, now_unix_secs: i64) -> Result<DidChain, ChainError> {
        DidChain::from_v1(&DidLog::genesis(master, now_unix_secs)?)
    }

    /// The chain holding exactly the updates of `log`, as v1 entries: same
    /// hashes, same current document. It verifies iff `log` does.
    pub fn from_v1(log: &DidLog) -> Result<DidChain, ChainError> {
        let entries = log.updates().iter().cloned().map(DidEntry::V1).collect();
        DidChain::from_entries(entries)
    }

    /// Reads a stored DID log (`did-log.json`): a chain (`{"entries": …}`),
    /// or a log written before chains (`{"updates": …}`), converted entry
    /// for entry with the same hashes ([`DidChain::from_v1`]). The flag says
    /// it was the old form (write it back as a chain). Not verified.
    pub fn from_stored_json(bytes: &[u8]) -> Result<(DidChain, bool), ChainError> {
        match serde_json::from_slice::<DidChain>(bytes) {
            Ok(chain) => Ok((chain, false)),
            Err(chain_err) => match serde_json::from_slice::<DidLog>(bytes) {
                Ok(v1) => Ok((DidChain::from_v1(&v1)?, true)),
                Err(_) => Err(ChainError::Decode(chain_err)),
            },
        }
    }

    /// Verifies the whole chain: the genesis certifies the DID (and equals
    /// `expected_did` when given), v1 entries follow [`crate::log`]'s rules and
    /// v2 entries the v2 rules (see the module docs).
    pub fn verify(&self, expected_did: Option<&str>, now_unix_secs: i64) -> Result<(), ChainError> {
        self.verify_from(1, expected_did, now_unix_secs)?;
        self.verify_lost(now_unix_secs)
    }

    /// [`DidChain::verify`] that trusts entries before `from` (a prefix this
    /// device verified already: its own chain's) and checks the rest, so
    /// adopting one new entry costs one entry's checks, not the chain's.
    /// The genesis is always checked.
    fn verify_from(
        &self,
        from: usize,
        expected_did: Option<&str>,
        now_unix_secs: i64,
    ) -> Result<(), ChainError> {
        if self.entries.len() > MAX_CHAIN_ENTRIES {
            return Err(ChainError::TooLong {
                len: self.entries.len(),
                max: MAX_CHAIN_ENTRIES,
            });
        }
        let Some(first) = self.entries.first() else {
            return Err(ChainError::Empty);
        };
        let DidEntry::V1(genesis) = first else {
            return Err(ChainError::GenesisNotV1);
        };
        if let Some(expected) = expected_did
            && genesis.document.id != expected
        {
            return Err(ChainError::WrongDid {
                expected: expected.to_owned(),
                found: shorten(&genesis.document.id),
            });
        }
        log::verify_genesis(genesis, now_unix_secs)?;
        let mut doc = genesis.document.clone();
        let mut authority = Authority::of(&doc);
        let mut auth_hash = self.meta[0].hash.as_str();
        let mut v1_len = 1;
        for index in 1..self.entries.len() {
            let prev = &self.entries[index - 1];
            let prev_hash = self.meta[index - 1].hash.as_str();
            if index < from {
                // Trusted prefix: replay it for the state the checks need.
                let next = match &self.entries[index] {
                    DidEntry::V1(u) => {
                        v1_len += 1;
                        u.document.clone()
                    }
                    DidEntry::V2(e) => apply(&doc, &e.ops).map_err(in_entry(seq_at(index)))?,
                };
                if self.meta[index].authority {
                    authority = Authority::of(&next);
                    auth_hash = self.meta[index].hash.as_str();
                }
                doc = next;
                continue;
            }
            let next = match (prev, &self.entries[index]) {
                (DidEntry::V1(p), DidEntry::V1(u)) => {
                    log::verify_step(p, prev_hash, u, now_unix_secs)?;
                    v1_len += 1;
                    u.document.clone()
                }
                (DidEntry::V2(_), DidEntry::V1(_)) => {
                    return Err(ChainError::V1AfterV2 { seq: seq_at(index) });
                }
                (_, DidEntry::V2(e)) => {
                    let step = Step {
                        index,
                        prev,
                        prev_hash,
                        doc: &doc,
                        authority: &authority,
                        auth_hash,
                        now_unix_secs,
                    };
                    verify_v2_step(&step, e)?
                }
            };
            let next_authority = Authority::of(&next);
            if next_authority != authority {
                authority = next_authority;
                auth_hash = self.meta[index].hash.as_str();
            }
            doc = next;
        }
        if v1_len > MAX_LOG_UPDATES {
            return Err(ChainError::V1PrefixTooLong {
                len: v1_len,
                max: MAX_LOG_UPDATES,
            });
        }
        Ok(())
    }

    /// Appends a v2 entry carrying `ops`, signed by `signer` under
    /// `signer_key_id` (absolute id or fragment; it must hold
    /// `capabilityDelegation`). The entry is checked with exactly the rules a
    /// receiver applies, and nothing changes on error.
    pub fn append_ops(
        &mut self,
        ops: Vec<DidOp>,
        signer: &DeviceKey,
        signer_key_id: &str,
        now_unix_secs: i64,
    ) -> Result<(), ChainError> {
        let index = self.entries.len();
        if index >= MAX_CHAIN_ENTRIES {
            return Err(ChainError::TooLong {
                len: index + 1,
                max: MAX_CHAIN_ENTRIES,
            });
        }
        let seq = seq_at(index);
        let key_id = self.current.key_id(signer_key_id);
        if let Some(method) = self.current.find_method(&key_id)
            && method.ed25519_public().ok() != Some(signer.public())
        {
            return Err(ChainError::WrongSigningKey { key_id });
        }
        let after = apply(&self.current, &ops).map_err(in_entry(seq))?;
        let after_authority = Authority::of(&after);
        let changes_authority = after_authority != self.authority;
        let (prev, prev_hash) = self.head();
        let unsigned = DidEntryV2 {
            v: 2,
            seq,
            prev: prev_hash.to_owned(),
            auth_prev: self.auth_hash.clone(),
            ops,
            authority: changes_authority.then(|| after_authority.clone()),
            state: document_hash(&after)?,
            // Never go backwards in time along the chain, even if this clock did.
            timestamp: now_unix_secs.max(prev.timestamp()),
            nonce: String::new(),
            key_id: key_id.clone(),
            signature: String::new(),
        };
        let entry = DidEntryV2::sign(unsigned, signer)?;
        let step = Step {
            index,
            prev,
            prev_hash,
            doc: &self.current,
            authority: &self.authority,
            auth_hash: &self.auth_hash,
            now_unix_secs,
        };
        let checked = verify_v2_step(&step, &entry)?;
        let rank = signer_rank(&self.current, &key_id);
        let entry = DidEntry::V2(entry);
        let hash = entry.hash()?;
        if changes_authority {
            self.authority = after_authority;
            self.auth_hash = hash.clone();
        }
        self.meta.push(EntryMeta {
            hash,
            rank,
            authority: changes_authority,
        });
        self.entries.push(entry);
        self.current = checked;
        self.apply_removals();
        Ok(())
    }

    /// Appends the v2 entry that turns the current document into `new_doc`
    /// (its ops are [`diff`]'s), like [`DidChain::append_ops`].
    pub fn append_document(
        &mut self,
        new_doc: &DidDocument,
        signer: &DeviceKey,
        signer_key_id: &str,
        now_unix_secs: i64,
    ) -> Result<(), ChainError> {
        let seq = seq_at(self.entries.len());
        // `diff` is exact for valid documents of the same DID; say so up front
        // rather than signing something other than what was asked for.
        if new_doc.id != self.current.id {
            return Err(ChainError::DidChanged {
                seq,
                found: shorten(&new_doc.id),
            });
        }
        new_doc
            .validate()
            .map_err(|source| ChainError::InvalidDocument { seq, source })?;
        let ops = diff(&self.current, new_doc);
        self.append_ops(ops, signer, signer_key_id, now_unix_secs)
    }

    /// Adopts `other` if it verifies and either extends this chain or wins
    /// the fork against it ([`compare_branches`]).
    ///
    /// `self` must be verified already (the shared prefix is not checked
    /// again). `other` is verified only when it would be adopted. This chain is
    /// unchanged on every error and when `other` loses.
    pub fn merge(
        &mut self,
        other: &DidChain,
        now_unix_secs: i64,
    ) -> Result<MergeOutcome, ChainError> {
        let order = compare_branches(self, other)?;
        let fork = self.fork_point(other);
        if order != Ordering::Less {
            let before = self.lost_heads();
            if let Some(index) = fork {
                // Checked only now: a losing branch is kept only as
                // evidence of the devices it removed.
                if other
                    .verify_from(index.max(1), Some(self.did()), now_unix_secs)
                    .is_ok()
                {
                    self.keep_lost(other);
                }
            }
            self.keep_lost_of(&other.lost);
            let noted = self.lost_heads() != before;
            return Ok(match fork {
                None if noted => MergeOutcome::NotedRemovals { fork_seq: None },
                None => MergeOutcome::Unchanged,
                Some(index) if noted => MergeOutcome::NotedRemovals {
                    fork_seq: Some(seq_at(index)),
                },
                Some(index) => MergeOutcome::KeptOurs {
                    fork_seq: seq_at(index),
                },
            });
        }
        // Our chain is verified (every way into it checks), so only what
        // `other` adds after the shared prefix needs checking.
        let shared = fork.unwrap_or(self.len());
        other.verify_from(shared.max(1), Some(self.did()), now_unix_secs)?;
        let outcome = match fork {
            None => MergeOutcome::Extended {
                from: self.len(),
                to: other.len(),
            },
            Some(index) => MergeOutcome::SwitchedFork {
                fork_seq: seq_at(index),
                lost: self.entries[index..].to_vec(),
            },
        };
        let old = std::mem::replace(self, other.clone());
        // Evidence carries over, and a branch we leave is evidence itself.
        self.keep_lost_of(&old.lost);
        if fork.is_some() {
            self.keep_lost(&old);
        }
        Ok(outcome)
    }

    /// The compact proof of the current document: the genesis, every
    /// authority entry, every entry signed by a recovery key, the head entry
    /// and the current document. When the head is a v1 entry, the v1 entries
    /// from the last one signed by a `capabilityDelegation` key up to the head
    /// are included too, so the head can be checked with v1's rules.
    pub fn proof(&self) -> DidProof {
        let head = self.entries.len() - 1; // non-empty, see `head`
        let mut picked = BTreeSet::from([0, head]);
        for (index, meta) in self.meta.iter().enumerate() {
            if meta.authority || meta.rank == RANK_RECOVERY {
                picked.insert(index);
            }
        }
        if let DidEntry::V1(_) = &self.entries[head] {
            let start = (0..=head)
                .rev()
                .find(|&i| self.meta[i].rank >= RANK_ADMIN)
                .unwrap_or(0);
            picked.extend(start..=head);
        }
        DidProof {
            entries: picked
                .into_iter()
                .map(|i| self.entries[i].clone())
                .collect(),
            document: self.current.clone(),
        }
    }

    /// The document after the latest entry, without the devices a branch
    /// that lost the fork rule removed ([strong removal](removal)): the
    /// document every authorisation checks.
    pub fn current(&self) -> &DidDocument {
        self.effective.as_ref().unwrap_or(&self.current)
    }

    /// The authority of the current document.
    pub fn authority(&self) -> &Authority {
        &self.authority
    }

    /// The agent DID (the genesis document's id).
    pub fn did(&self) -> &str {
        match &self.entries[0] {
            DidEntry::V1(genesis) => &genesis.document.id,
            // Unreachable: every constructor checks that the chain opens with a v1 genesis.
            DidEntry::V2(_) => &self.current.id,
        }
    }

    /// Hex hash of the latest entry; two chains with the same head hash are identical.
    pub fn head_hash(&self) -> &str {
        self.head().1
    }

    /// Number of entries, genesis included (at least 1).
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Always false: a chain holds at least its genesis. Present for API symmetry with `len`.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// All entries, genesis first.
    pub fn entries(&self) -> &[DidEntry] {
        &self.entries
    }

    /// The document after each entry, genesis first: a replay of the chain.
    /// Costs one document clone per entry; for the rare questions about the
    /// past (was this key ever listed, which recovery generations were used).
    pub fn documents(&self) -> impl Iterator<Item = DidDocument> + '_ {
        let mut doc: Option<DidDocument> = None;
        self.entries.iter().map_while(move |entry| {
            let next = match (entry, doc.as_ref()) {
                (DidEntry::V1(u), _) => u.document.clone(),
                // Construction applied every op, so this cannot fail; stop if it does.
                (DidEntry::V2(e), Some(before)) => apply(before, &e.ops).ok()?,
                (DidEntry::V2(_), None) => return None,
            };
            doc = Some(next.clone());
            Some(next)
        })
    }

    /// Position of the entry whose hash is `hash`, if this chain holds it.
    pub fn position_of(&self, hash: &str) -> Option<usize> {
        self.meta.iter().rposition(|m| m.hash == hash)
    }

    /// Hash of the entry at `index`, if any.
    pub fn hash_at(&self, index: usize) -> Option<&str> {
        self.meta.get(index).map(|m| m.hash.as_str())
    }

    /// The chain made of our entries before `entries[0]`'s seq followed by
    /// `entries` (a page of a peer's chain), or `None` when they do not
    /// connect: the first one's `prev` is not our entry before it. Checks only
    /// shape and that every op applies; verify it (or [`DidChain::merge`] it)
    /// before trusting it. More than [`MAX_SPLICE_ENTRIES`] entries are refused.
    pub fn splice(&self, entries: &[DidEntry]) -> Result<Option<DidChain>, ChainError> {
        if entries.len() > MAX_SPLICE_ENTRIES {
            return Err(ChainError::TooLong {
                len: entries.len(),
                max: MAX_SPLICE_ENTRIES,
            });
        }
        let Some(first) = entries.first() else {
            return Ok(None);
        };
        let Ok(at) = usize::try_from(first.seq()) else {
            return Ok(None);
        };
        if at == 0 || at > self.entries.len() {
            return Ok(None);
        }
        let prev = match first {
            DidEntry::V1(u) => u.prev.as_str(),
            DidEntry::V2(e) => e.prev.as_str(),
        };
        if self.meta[at - 1].hash != prev {
            return Ok(None);
        }
        let mut all = Vec::with_capacity(at + entries.len());
        all.extend_from_slice(&self.entries[..at]);
        all.extend_from_slice(entries);
        DidChain::from_entries(all).map(Some)
    }

    /// Parses a chain from JSON and verifies it (see [`DidChain::verify`]).
    pub fn decode_verified(
        json: &[u8],
        expected_did: Option<&str>,
        now_unix_secs: i64,
    ) -> Result<DidChain, ChainError> {
        let chain: DidChain = serde_json::from_slice(json).map_err(ChainError::Decode)?;
        chain.verify(expected_did, now_unix_secs)?;
        Ok(chain)
    }

    /// First position at which the chains hold different entries, if any.
    fn fork_point(&self, other: &DidChain) -> Option<usize> {
        self.meta
            .iter()
            .zip(&other.meta)
            .position(|(ours, theirs)| ours.hash != theirs.hash)
    }

    fn head(&self) -> (&DidEntry, &str) {
        // Invariant: every constructor rejects an empty entry list, and entries are never removed.
        let last = self.entries.len() - 1;
        (&self.entries[last], &self.meta[last].hash)
    }
}

/// Orders two chains of the same DID; `Greater` means `a` wins.
///
/// Let f be the first position where they differ. If there is none, one is
/// a prefix of the other and the longer wins. Otherwise the branch whose
/// entries from f on include the higher [`signer_rank`] wins (a recovery
/// signature beats any admin-only branch, however long), and on a tie the
/// branch whose entry at f has the lexicographically lower hash. Equal means
/// the chains are identical. The order is total, so every device that has
/// seen the same branches picks the same winner. Neither chain is verified.
pub fn compare_branches(a: &DidChain, b: &DidChain) -> Result<Ordering, ChainError> {
    if a.did() != b.did() {
        return Err(ChainError::WrongDid {
            expected: a.did().to_owned(),
            found: shorten(b.did()),
        });
    }
    let Some(f) = a.fork_point(b) else {
        return Ok(a.len().cmp(&b.len()));
    };
    let top_rank = |c: &DidChain| {
        c.meta[f..]
            .iter()
            .map(|m| m.rank)
            .max()
            .unwrap_or(RANK_NONE)
    };
    Ok(top_rank(a)
        .cmp(&top_rank(b))
        .then_with(|| b.meta[f].hash.cmp(&a.meta[f].hash)))
}

/// The ops of `lost` entries (those [`MergeOutcome::SwitchedFork`] returned,
/// typically filtered to the ones our own key signed) that still make sense on
/// top of the winner's current document: each op is kept only if it applies,
/// changes the document and leaves it valid, applied in order. So an
/// `add_method` of a key the winner already lists, a grant it already made or
/// a removal of something gone are dropped. v1 entries carry no ops and are
/// skipped. The result may be empty; append it with [`DidChain::append_ops`].
pub fn rebase_ops(lost: &[DidEntry], winner_current: &DidDocument) -> Vec<DidOp> {
    let mut doc = winner_current.clone();
    let mut kept = Vec::new();
    for entry in lost {
        let DidEntry::V2(e) = entry else {
            continue;
        };
        for op in &e.ops {
            let mut next = doc.clone();
            if apply_op(&mut next, op).is_ok() && next != doc && next.validate().is_ok() {
                doc = next;
                kept.push(op.clone());
            }
        }
    }
    kept
}

/// Hex SHA-256 of the document's canonical JSON: a v2 entry's `state`.
pub fn document_hash(doc: &DidDocument) -> Result<String, ChainError> {
    let bytes = to_canonical_json(doc).map_err(ChainError::Encode)?;
    Ok(hex::encode(Sha256::digest(&bytes)))
}

fn check_ops_count(seq: u64, count: usize) -> Result<(), ChainError> {
    if count == 0 {
        return Err(ChainError::EmptyUpdate { seq });
    }
    if count > MAX_OPS_PER_ENTRY {
        return Err(ChainError::TooManyOps {
            seq,
            count,
            max: MAX_OPS_PER_ENTRY,
        });
    }
    Ok(())
}

/// The size bounds of [`DidDocument::validate`], checked while replaying
/// unverified ops so that a hostile chain cannot grow the document without limit.
fn check_size(seq: u64, doc: &DidDocument) -> Result<(), ChainError> {
    let too_big = doc.verification_method.len() > MAX_VERIFICATION_METHODS
        || doc.service.len() > MAX_SERVICES;
    if too_big {
        return Err(ChainError::InvalidDocument {
            seq,
            source: DidError::Malformed {
                reason: format!(
                    "{} verification methods and {} services, at most {MAX_VERIFICATION_METHODS} \
                     and {MAX_SERVICES} allowed",
                    doc.verification_method.len(),
                    doc.service.len()
                ),
            },
        });
    }
    Ok(())
}

fn check_time(
    seq: u64,
    timestamp: i64,
    previous: i64,
    now_unix_secs: i64,
) -> Result<(), ChainError> {
    if timestamp < previous {
        return Err(ChainError::TimestampRegression {
            seq,
            timestamp,
            previous,
        });
    }
    if timestamp > now_unix_secs.saturating_add(MAX_CLOCK_SKEW_SECS) {
        return Err(ChainError::FromFuture {
            seq,
            timestamp,
            now: now_unix_secs,
        });
    }
    Ok(())
}

fn check_nonce(seq: u64, nonce: &str) -> Result<(), ChainError> {
    if nonce.len() == 32 && nonce.bytes().all(|b| b.is_ascii_hexdigit()) {
        Ok(())
    } else {
        Err(ChainError::Malformed {
            seq,
            reason: "nonce must be 32 hex characters",
        })
    }
}

/// One canonical spelling of the signer: an absolute id in this DID.
fn check_key_id(seq: u64, did: &str, key_id: &str) -> Result<(), ChainError> {
    if key_id
        .strip_prefix(did)
        .is_some_and(|rest| rest.starts_with('#'))
    {
        Ok(())
    } else {
        Err(ChainError::Malformed {
            seq,
            reason: "key_id must be an absolute key id of this did",
        })
    }
}

fn check_recovery_keys(seq: u64, doc: &DidDocument) -> Result<(), ChainError> {
    match doc
        .capability_delegation
        .iter()
        .find(|id| is_recovery_id(id) && doc.authentication.contains(id))
    {
        Some(id) => Err(ChainError::RecoveryKeyAuthenticates {
            seq,
            key_id: shorten(id),
        }),
        None => Ok(()),
    }
}

/// Everything a v2 entry is checked against.
struct Step<'a> {
    /// The entry's position.
    index: usize,
    prev: &'a DidEntry,
    prev_hash: &'a str,
    /// The document before the entry.
    doc: &'a DidDocument,
    /// `Authority::of(doc)`.
    authority: &'a Authority,
    /// Hash of the latest authority entry before the entry.
    auth_hash: &'a str,
    now_unix_secs: i64,
}

/// The v2 rules of full verification; returns the document after the entry.
fn verify_v2_step(step: &Step<'_>, entry: &DidEntryV2) -> Result<DidDocument, ChainError> {
    let seq = entry.seq;
    let old = step.doc;
    if seq != seq_at(step.index) {
        return Err(ChainError::BadSeq {
            index: step.index,
            seq,
        });
    }
    if entry.prev != step.prev_hash {
        return Err(ChainError::BadPrev { seq });
    }
    if entry.v != 2 {
        return Err(ChainError::BadVersion {
            seq,
            version: entry.v,
        });
    }
    check_ops_count(seq, entry.ops.len())?;
    check_time(
        seq,
        entry.timestamp,
        step.prev.timestamp(),
        step.now_unix_secs,
    )?;
    check_nonce(seq, &entry.nonce)?;
    check_key_id(seq, &old.id, &entry.key_id)?;
    if entry.auth_prev != step.auth_hash {
        return Err(ChainError::BadAuthPrev { seq });
    }
    let unauthorized = |source| ChainError::Unauthorized {
        seq,
        key_id: shorten(&entry.key_id),
        source,
    };
    let method = old
        .usable_method(&entry.key_id, ED25519_KEY_TYPE, entry.timestamp)
        .map_err(unauthorized)?;
    let public = method.ed25519_public().map_err(unauthorized)?;
    entry.check_signature(&public)?;

    let new = apply(old, &entry.ops).map_err(in_entry(seq))?;
    if new.id != old.id {
        return Err(ChainError::DidChanged {
            seq,
            found: shorten(&new.id),
        });
    }
    new.validate()
        .map_err(|source| ChainError::InvalidDocument { seq, source })?;
    if new.capability_delegation.is_empty() {
        return Err(ChainError::NoDelegationKey { seq });
    }
    check_recovery_keys(seq, &new)?;
    let required = required_relationships(old, &new);
    if required.is_empty() {
        return Err(ChainError::EmptyUpdate { seq });
    }
    // Every v2 signer holds capabilityDelegation, so a stranger can check any
    // entry against the authority alone.
    for rel in std::iter::once(Relationship::CapabilityDelegation).chain(required) {
        old.require_relationship(&entry.key_id, rel)
            .map_err(unauthorized)?;
    }
    if entry.state != document_hash(&new)? {
        return Err(ChainError::BadState { seq });
    }
    let after = Authority::of(&new);
    match (&entry.authority, after != *step.authority) {
        (None, true) => return Err(ChainError::MissingAuthority { seq }),
        (Some(_), false) => return Err(ChainError::UnexpectedAuthority { seq }),
        (Some(claimed), true) if *claimed != after => {
            return Err(ChainError::WrongAuthority { seq });
        }
        _ => {}
    }
    Ok(new)
}

/// The compact evidence for a chain's current document; see [`DidChain::proof`].
///
/// On the wire (`encode`, serde) the document travels with the DID factored
/// out of key ids (`#frag`) and of method controllers equal to the DID; this is
/// lossless, and the head's `state` hash is checked on the rebuilt document.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DidProof {
    entries: Vec<DidEntry>,
    document: DidDocument,
}

/// What a verified [`DidProof`] establishes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VerifiedProof {
    did: String,
    head_seq: u64,
    head_hash: String,
    document: DidDocument,
}

impl VerifiedProof {
    /// The agent DID.
    pub fn did(&self) -> &str {
        &self.did
    }

    /// Seq of the chain's head entry.
    pub fn head_seq(&self) -> u64 {
        self.head_seq
    }

    /// Hash of the chain's head entry.
    pub fn head_hash(&self) -> &str {
        &self.head_hash
    }

    /// The current document.
    pub fn document(&self) -> &DidDocument {
        &self.document
    }

    /// The current document, by value.
    pub fn into_document(self) -> DidDocument {
        self.document
    }
}

impl DidProof {
    /// The included entries, genesis first, head last.
    pub fn entries(&self) -> &[DidEntry] {
        &self.entries
    }

    /// The document the proof claims is current (unverified until [`DidProof::verify`]).
    pub fn document(&self) -> &DidDocument {
        &self.document
    }

    /// Canonical JSON bytes of the proof.
    pub fn encode(&self) -> Result<Vec<u8>, ChainError> {
        to_canonical_json(self).map_err(ChainError::Encode)
    }

    /// Parses [`DidProof::encode`]'s output, refusing more than [`MAX_PROOF_BYTES`]
    /// before parsing. Call [`DidProof::verify`] before trusting the result.
    pub fn decode(bytes: &[u8]) -> Result<DidProof, ChainError> {
        if bytes.len() > MAX_PROOF_BYTES {
            return Err(ChainError::ProofTooLarge {
                len: bytes.len(),
                max: MAX_PROOF_BYTES,
            });
        }
        serde_json::from_slice(bytes).map_err(ChainError::Decode)
    }

    /// Checks the proof knowing only the agent DID.
    ///
    /// The genesis must certify `expected_did` as today. Each later entry
    /// must come after the one before it in the proof (seq strictly
    /// increasing, timestamps non-decreasing and not from the future) and be
    /// signed by an unexpired key of the authority in force: the authority of
    /// the genesis document, replaced by each authority entry's `authority`
    /// (v2) or document (v1). Every v2 entry must name the previous included
    /// authority entry as `auth_prev`, so leaving one out fails. A v1 entry
    /// that directly follows a v1 entry is checked with v1's full rules
    /// instead. Finally the document must be the head's (`state` for v2, the
    /// document itself for v1), be valid, and have the authority in force.
    pub fn verify(
        &self,
        expected_did: &str,
        now_unix_secs: i64,
    ) -> Result<VerifiedProof, ChainError> {
        if self.entries.len() > MAX_CHAIN_ENTRIES {
            return Err(ChainError::TooLong {
                len: self.entries.len(),
                max: MAX_CHAIN_ENTRIES,
            });
        }
        let Some(first) = self.entries.first() else {
            return Err(ChainError::Empty);
        };
        let DidEntry::V1(genesis) = first else {
            return Err(ChainError::GenesisNotV1);
        };
        if genesis.document.id != expected_did {
            return Err(ChainError::WrongDid {
                expected: expected_did.to_owned(),
                found: shorten(&genesis.document.id),
            });
        }
        log::verify_genesis(genesis, now_unix_secs)?;
        let did = expected_did;
        let mut authority = Authority::of(&genesis.document);
        let mut auth_hash = first.hash()?;
        let mut prev = first;
        let mut prev_hash = auth_hash.clone();
        let mut seen_v2 = false;
        for entry in &self.entries[1..] {
            let seq = entry.seq();
            if seq <= prev.seq() {
                return Err(ChainError::ProofOrder {
                    seq,
                    previous: prev.seq(),
                });
            }
            check_time(seq, entry.timestamp(), prev.timestamp(), now_unix_secs)?;
            let hash = entry.hash()?;
            match (prev, entry) {
                (_, DidEntry::V1(_)) if seen_v2 => return Err(ChainError::V1AfterV2 { seq }),
                (DidEntry::V1(p), DidEntry::V1(u)) if seq == p.seq.saturating_add(1) => {
                    log::verify_step(p, &prev_hash, u, now_unix_secs)?;
                }
                (_, DidEntry::V1(u)) => verify_v1_by_authority(did, &authority, u)?,
                (_, DidEntry::V2(e)) => {
                    seen_v2 = true;
                    verify_v2_by_authority(did, &authority, &auth_hash, e)?;
                }
            }
            let next_authority = match entry {
                DidEntry::V1(u) => Some(Authority::of(&u.document)),
                DidEntry::V2(e) => e.authority.clone(),
            };
            if let Some(next) = next_authority
                && next != authority
            {
                authority = next;
                auth_hash = hash.clone();
            }
            prev = entry;
            prev_hash = hash;
        }

        let seq = prev.seq();
        let document = &self.document;
        let matches = match prev {
            DidEntry::V1(u) => u.document == *document,
            DidEntry::V2(e) => e.state == document_hash(document)?,
        };
        if !matches {
            return Err(ChainError::ProofHeadMismatch { seq });
        }
        if document.id != did {
            return Err(ChainError::DidChanged {
                seq,
                found: shorten(&document.id),
            });
        }
        document
            .validate()
            .map_err(|source| ChainError::InvalidDocument { seq, source })?;
        if document.capability_delegation.is_empty() {
            return Err(ChainError::NoDelegationKey { seq });
        }
        if seen_v2 {
            check_recovery_keys(seq, document)?;
        }
        if Authority::of(document) != authority {
            return Err(ChainError::ProofHeadAuthority { seq });
        }
        Ok(VerifiedProof {
            did: did.to_owned(),
            head_seq: seq,
            head_hash: prev_hash,
            document: document.clone(),
        })
    }
}

/// A v1 entry of a proof that does not directly follow its predecessor: its
/// signer must belong to the authority in force, and its document must be a
/// valid document of this DID.
fn verify_v1_by_authority(
    did: &str,
    authority: &Authority,
    update: &DidUpdate,
) -> Result<(), ChainError> {
    let seq = update.seq;
    update.check_nonce()?;
    check_key_id(seq, did, &update.key_id)?;
    let public = authority
        .signer_public(did, &update.key_id, update.timestamp)
        .map_err(|source| ChainError::Unauthorized {
            seq,
            key_id: shorten(&update.key_id),
            source,
        })?;
    update.check_signature(&public)?;
    if update.document.id != did {
        return Err(ChainError::DidChanged {
            seq,
            found: shorten(&update.document.id),
        });
    }
    update
        .document
        .validate()
        .map_err(|source| ChainError::InvalidDocument { seq, source })?;
    if update.document.capability_delegation.is_empty() {
        return Err(ChainError::NoDelegationKey { seq });
    }
    Ok(())
}

/// A v2 entry of a proof: it names the previous authority entry and is signed
/// by a key of the authority in force.
fn verify_v2_by_authority(
    did: &str,
    authority: &Authority,
    auth_hash: &str,
    entry: &DidEntryV2,
) -> Result<(), ChainError> {
    let seq = entry.seq;
    if entry.v != 2 {
        return Err(ChainError::BadVersion {
            seq,
            version: entry.v,
        });
    }
    check_ops_count(seq, entry.ops.len())?;
    check_nonce(seq, &entry.nonce)?;
    check_key_id(seq, did, &entry.key_id)?;
    // Before the signature, so that a left-out authority entry is named as such.
    if entry.auth_prev != auth_hash {
        return Err(ChainError::BadAuthPrev { seq });
    }
    let public = authority
        .signer_public(did, &entry.key_id, entry.timestamp)
        .map_err(|source| ChainError::Unauthorized {
            seq,
            key_id: shorten(&entry.key_id),
            source,
        })?;
    entry.check_signature(&public)?;
    if let Some(next) = &entry.authority
        && next.keys.is_empty()
    {
        return Err(ChainError::NoDelegationKey { seq });
    }
    Ok(())
}

/// A verification method with the DID factored out (see [`DidProof`]).
#[derive(Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct CompactMethod {
    id: String,
    r#type: String,
    /// Absent when it is the DID itself.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    controller: Option<String>,
    public_key_multibase: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    expires: Option<String>,
}

/// A [`DidDocument`] with the DID factored out of key ids and method
/// controllers. Mirrors every field of [`DidDocument`].
#[derive(Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct CompactDocument {
    #[serde(rename = "@context")]
    context: Vec<String>,
    id: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    controller: Option<String>,
    #[serde(default)]
    verification_method: Vec<CompactMethod>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    authentication: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    assertion_method: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    key_agreement: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    capability_invocation: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    capability_delegation: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    service: Vec<serde_json::Value>,
}

impl CompactDocument {
    fn from_document(doc: &DidDocument) -> CompactDocument {
        let did = doc.id.as_str();
        let ids = |list: &[String]| list.iter().map(|id| relative_id(did, id)).collect();
        CompactDocument {
            context: doc.context.clone(),
            id: doc.id.clone(),
            controller: doc.controller.clone(),
            verification_method: doc
                .verification_method
                .iter()
                .map(|m| CompactMethod {
                    id: relative_id(did, &m.id),
                    r#type: m.r#type.clone(),
                    controller: (m.controller != did).then(|| m.controller.clone()),
                    public_key_multibase: m.public_key_multibase.clone(),
                    expires: m.expires.clone(),
                })
                .collect(),
            authentication: ids(&doc.authentication),
            assertion_method: ids(&doc.assertion_method),
            key_agreement: ids(&doc.key_agreement),
            capability_invocation: ids(&doc.capability_invocation),
            capability_delegation: ids(&doc.capability_delegation),
            service: doc.service.clone(),
        }
    }

    fn expand(self) -> DidDocument {
        let did = self.id;
        let ids = |list: Vec<String>| list.iter().map(|id| absolute_id(&did, id)).collect();
        DidDocument {
            context: self.context,
            controller: self.controller,
            verification_method: self
                .verification_method
                .into_iter()
                .map(|m| VerificationMethod {
                    id: absolute_id(&did, &m.id),
                    r#type: m.r#type,
                    controller: m.controller.unwrap_or_else(|| did.clone()),
                    public_key_multibase: m.public_key_multibase,
                    expires: m.expires,
                })
                .collect(),
            authentication: ids(self.authentication),
            assertion_method: ids(self.assertion_method),
            key_agreement: ids(self.key_agreement),
            capability_invocation: ids(self.capability_invocation),
            capability_delegation: ids(self.capability_delegation),
            service: self.service,
            id: did,
        }
    }
}

#[derive(Serialize)]
struct ProofWireRef<'a> {
    entries: &'a [DidEntry],
    document: CompactDocument,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ProofWire {
    entries: Vec<DidEntry>,
    document: CompactDocument,
}

impl Serialize for DidProof {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        ProofWireRef {
            entries: &self.entries,
            document: CompactDocument::from_document(&self.document),
        }
        .serialize(serializer)
    }
}

impl<'de> Deserialize<'de> for DidProof {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<DidProof, D::Error> {
        let wire = ProofWire::deserialize(deserializer)?;
        Ok(DidProof {
            entries: wire.entries,
            document: wire.document.expand(),
        })
    }
}

#[cfg(test)]
mod tests;

mod removal;
pub use removal::{MAX_EVIDENCE_ENTRIES, MAX_LOST_BRANCHES};
