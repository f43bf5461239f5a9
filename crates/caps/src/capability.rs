//! The capability document: its wire shape, parsing it strictly into a
//! [`Capability`], and writing it back.
//!
//! Parsing checks shape only (fields, types, formats, how the chain is laid
//! out); it does not check signatures, admins, attenuation, expiry or
//! revocation, which [`crate::verify()`] does. The shape is closed: an unknown
//! field anywhere makes a capability malformed, so the document we verify is
//! exactly the one we act on.

use std::collections::BTreeMap;

use nuwa_identity::did_key::{ed25519_from_did_key, ed25519_public_multibase};

use crate::action::Action;
use crate::error::CapError;
use crate::json::{self, Json};
use crate::limits::{
    MAX_CAPABILITY_BYTES, MAX_CHAIN_DEPTH, MAX_PROOF_VALUE_CHARS, MAX_QUOTED_CHARS,
    MAX_TARGET_BYTES,
};
use crate::timestamp;

/// The first `@context` entry of every capability.
pub const ZCAP_CONTEXT_V1: &str = "https://w3id.org/zcap/v1";
/// The second `@context` entry: the Data Integrity vocabulary of the proof.
pub const DATA_INTEGRITY_CONTEXT_V2: &str = "https://w3id.org/security/data-integrity/v2";
/// The prefix of a root capability's id; the percent-encoded target follows.
pub const ROOT_ID_PREFIX: &str = "urn:zcap:root:";
/// The prefix of every delegated capability's id.
pub const ID_PREFIX: &str = "urn:uuid:";
/// The proof's `type`.
pub const PROOF_TYPE: &str = "DataIntegrityProof";
/// The proof's `cryptosuite`.
pub const CRYPTOSUITE: &str = "eddsa-jcs-2022";
/// The proof's `proofPurpose`.
pub const PROOF_PURPOSE: &str = "capabilityDelegation";

const CONTEXT: [&str; 2] = [ZCAP_CONTEXT_V1, DATA_INTEGRITY_CONTEXT_V2];
const CAPABILITY_KEYS: [&str; 8] = [
    "@context",
    "allowedAction",
    "controller",
    "expires",
    "id",
    "invocationTarget",
    "parentCapability",
    "proof",
];
const PROOF_KEYS: [&str; 8] = [
    "@context",
    "capabilityChain",
    "created",
    "cryptosuite",
    "proofPurpose",
    "proofValue",
    "type",
    "verificationMethod",
];

/// A capability delegated to an app's key, parsed and shape-checked (not
/// verified: see [`crate::verify()`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Capability {
    pub(crate) id: String,
    pub(crate) controller: String,
    pub(crate) controller_public: [u8; 32],
    pub(crate) target: String,
    /// As written: non-empty and without repeats.
    pub(crate) actions: Vec<Action>,
    pub(crate) expires_unix_secs: i64,
    pub(crate) parent_capability: String,
    pub(crate) proof: Proof,
}

/// The delegation proof of a [`Capability`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Proof {
    pub(crate) created_unix_secs: i64,
    pub(crate) verification_method: String,
    pub(crate) delegator_public: [u8; 32],
    /// The string entries of `capabilityChain`: the root id, then the ids of
    /// the ancestors between the root and the parent.
    pub(crate) chain_ids: Vec<String>,
    /// The parent, embedded as the last `capabilityChain` entry; `None` for
    /// a first-level capability (delegated by an admin from the root).
    pub(crate) parent: Option<Box<Capability>>,
    pub(crate) proof_value: [u8; 64],
}

impl Capability {
    /// Parses a capability's JSON bytes and checks its shape (not its
    /// proofs). Refuses more than [`MAX_CAPABILITY_BYTES`] before parsing.
    pub fn from_json(bytes: &[u8]) -> Result<Capability, CapError> {
        if bytes.len() > MAX_CAPABILITY_BYTES {
            return Err(CapError::CapabilityTooLarge {
                len: bytes.len(),
                max: MAX_CAPABILITY_BYTES,
            });
        }
        let value = json::parse(bytes)
            .map_err(|reason| CapError::malformed(format!("not strict JSON: {reason}")))?;
        from_value(value, 1)
    }

    /// The capability's JSON: the JCS (RFC 8785) serialization, so equal
    /// capabilities have equal bytes.
    pub fn to_json(&self) -> Vec<u8> {
        json::canonical(&self.to_value())
    }

    /// `id`: `urn:uuid:…`.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// `controller`: the did:key of the app that may invoke it.
    pub fn controller(&self) -> &str {
        &self.controller
    }

    /// The Ed25519 public key of [`Capability::controller`].
    pub fn controller_public(&self) -> &[u8; 32] {
        &self.controller_public
    }

    /// `invocationTarget`: a container name, or a prefix ending in `:`.
    pub fn target(&self) -> &str {
        &self.target
    }

    /// `allowedAction`, as written.
    pub fn actions(&self) -> &[Action] {
        &self.actions
    }

    /// `expires`, in unix seconds.
    pub fn expires_unix_secs(&self) -> i64 {
        self.expires_unix_secs
    }

    /// `parentCapability`: the root id or the parent's id.
    pub fn parent_capability(&self) -> &str {
        &self.parent_capability
    }

    /// The embedded parent, for a capability delegated from another.
    pub fn parent(&self) -> Option<&Capability> {
        self.proof.parent.as_deref()
    }

    /// The root id this chain starts from (`urn:zcap:root:…`).
    pub fn root_id(&self) -> &str {
        // Parsing guarantees at least the root id.
        self.proof.chain_ids.first().map_or("", String::as_str)
    }

    /// The Ed25519 public key that signed the delegation proof.
    pub fn delegator_public(&self) -> &[u8; 32] {
        &self.proof.delegator_public
    }

    /// The proof's `created`, in unix seconds.
    pub fn created_unix_secs(&self) -> i64 {
        self.proof.created_unix_secs
    }

    /// How many delegations lead to this capability: 1 when an admin delegated it.
    pub fn depth(&self) -> usize {
        1 + self.parent().map_or(0, Capability::depth)
    }

    /// The chain from the first-level capability down to this one.
    pub(crate) fn lineage(&self) -> Vec<&Capability> {
        let mut chain = vec![self];
        while let Some(parent) = chain.last().and_then(|c| c.parent()) {
            chain.push(parent);
        }
        chain.reverse();
        chain
    }

    /// The document without `proof`: what the proof's second hash covers.
    pub(crate) fn document_value(&self) -> Json {
        Json::Obj(self.document_members())
    }

    /// The proof without `proofValue`: what the proof's first hash covers.
    pub(crate) fn proof_config_value(&self) -> Json {
        Json::Obj(self.proof_config_members())
    }

    pub(crate) fn to_value(&self) -> Json {
        let mut proof = self.proof_config_members();
        proof.insert(
            "proofValue".to_owned(),
            Json::Str(proof_value_string(&self.proof.proof_value)),
        );
        let mut doc = self.document_members();
        doc.insert("proof".to_owned(), Json::Obj(proof));
        Json::Obj(doc)
    }

    fn document_members(&self) -> BTreeMap<String, Json> {
        let mut doc = BTreeMap::new();
        doc.insert("@context".to_owned(), context_value());
        doc.insert("id".to_owned(), Json::str(&self.id));
        doc.insert("controller".to_owned(), Json::str(&self.controller));
        doc.insert("invocationTarget".to_owned(), Json::str(&self.target));
        doc.insert(
            "allowedAction".to_owned(),
            Json::Arr(self.actions.iter().map(|a| Json::str(a.as_str())).collect()),
        );
        doc.insert(
            "expires".to_owned(),
            Json::str(timestamp::display(self.expires_unix_secs)),
        );
        doc.insert(
            "parentCapability".to_owned(),
            Json::str(&self.parent_capability),
        );
        doc
    }

    fn proof_config_members(&self) -> BTreeMap<String, Json> {
        let proof = &self.proof;
        let mut chain: Vec<Json> = proof.chain_ids.iter().map(Json::str).collect();
        if let Some(parent) = &proof.parent {
            chain.push(parent.to_value());
        }
        let mut config = BTreeMap::new();
        config.insert("@context".to_owned(), context_value());
        config.insert("type".to_owned(), Json::str(PROOF_TYPE));
        config.insert("cryptosuite".to_owned(), Json::str(CRYPTOSUITE));
        config.insert(
            "created".to_owned(),
            Json::str(timestamp::display(proof.created_unix_secs)),
        );
        config.insert(
            "verificationMethod".to_owned(),
            Json::str(&proof.verification_method),
        );
        config.insert("proofPurpose".to_owned(), Json::str(PROOF_PURPOSE));
        config.insert("capabilityChain".to_owned(), Json::Arr(chain));
        config
    }
}

fn context_value() -> Json {
    Json::Arr(CONTEXT.iter().map(|c| Json::str(*c)).collect())
}

/// `z` + base58btc of the signature.
pub(crate) fn proof_value_string(signature: &[u8; 64]) -> String {
    let mut out = String::from("z");
    out.push_str(&bs58::encode(signature).into_string());
    out
}

/// `did:key:z6Mk…#z6Mk…`: the verification method (and HTTP `keyid`) of a key.
pub fn verification_method_of(public: &[u8; 32]) -> String {
    let multibase = ed25519_public_multibase(public);
    format!("did:key:{multibase}#{multibase}")
}

/// The key behind a `did:key:X#X` verification method; `None` for any other form.
pub(crate) fn parse_verification_method(vm: &str) -> Option<[u8; 32]> {
    let (did, fragment) = vm.split_once('#')?;
    let public = ed25519_from_did_key(did).ok()?;
    (fragment == ed25519_public_multibase(&public)).then_some(public)
}

/// The root capability id of a target: `urn:zcap:root:` + the target
/// percent-encoded as JavaScript's `encodeURIComponent` does.
pub fn root_id(target: &str) -> String {
    let mut out = String::from(ROOT_ID_PREFIX);
    for byte in target.bytes() {
        if byte.is_ascii_alphanumeric() || b"-_.!~*'()".contains(&byte) {
            out.push(char::from(byte));
        } else {
            out.push_str(&format!("%{byte:02X}"));
        }
    }
    out
}

/// The target of a root id, if the id is one and is spelled as [`root_id`]
/// spells it.
pub(crate) fn root_target(id: &str) -> Option<String> {
    let encoded = id.strip_prefix(ROOT_ID_PREFIX)?;
    let bytes = encoded.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = std::str::from_utf8(bytes.get(i + 1..i + 3)?).ok()?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    let target = String::from_utf8(out).ok()?;
    (root_id(&target) == id).then_some(target)
}

/// Checks that `target` can be an `invocationTarget`: 1 to
/// [`MAX_TARGET_BYTES`] bytes of the characters container names use
/// (`A-Z a-z 0-9 . _ @ - : #`).
pub(crate) fn check_target(target: &str) -> Result<(), String> {
    if target.is_empty() || target.len() > MAX_TARGET_BYTES {
        return Err(format!(
            "invocationTarget must be 1 to {MAX_TARGET_BYTES} bytes, not {}",
            target.len()
        ));
    }
    if let Some(c) = target
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || ".-_@:#".contains(*c)))
    {
        return Err(format!(
            "invocationTarget {:?} has the character {c:?}; targets are container names or prefixes ending in ':' (A-Z a-z 0-9 . _ @ - : #)",
            shorten(target)
        ));
    }
    Ok(())
}

/// Checks a delegated capability's id: `urn:uuid:` and 32 lowercase hex
/// digits, bare or in the 8-4-4-4-12 UUID form.
pub(crate) fn check_id(id: &str) -> Result<(), String> {
    let ok = id.strip_prefix(ID_PREFIX).is_some_and(|rest| {
        let hex = |s: &str| {
            s.bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
        };
        let groups: Vec<&str> = rest.split('-').collect();
        match groups.as_slice() {
            [bare] => bare.len() == 32 && hex(bare),
            [a, b, c, d, e] => {
                [a.len(), b.len(), c.len(), d.len(), e.len()] == [8, 4, 4, 4, 12]
                    && groups.iter().all(|g| hex(g))
            }
            _ => false,
        }
    });
    if ok {
        Ok(())
    } else {
        Err(format!(
            "id {:?} is not urn:uuid: followed by a lowercase UUID or 32 lowercase hex digits",
            shorten(id)
        ))
    }
}

/// At most [`MAX_QUOTED_CHARS`] characters of untrusted text, for messages.
pub(crate) fn shorten(s: &str) -> String {
    if s.chars().count() <= MAX_QUOTED_CHARS {
        s.to_owned()
    } else {
        let mut out: String = s.chars().take(MAX_QUOTED_CHARS).collect();
        out.push('…');
        out
    }
}

/// An object's members, checked to be exactly `keys`.
fn members(value: Json, keys: &[&str], what: &str) -> Result<BTreeMap<String, Json>, CapError> {
    let map = match value {
        Json::Obj(map) => map,
        other => {
            return Err(CapError::malformed(format!(
                "{what} is {}, not an object",
                other.kind()
            )));
        }
    };
    if let Some(unknown) = map.keys().find(|k| !keys.contains(&k.as_str())) {
        return Err(CapError::malformed(format!(
            "{what} has the unknown field {:?}",
            shorten(unknown)
        )));
    }
    if let Some(missing) = keys.iter().find(|k| !map.contains_key(**k)) {
        return Err(CapError::malformed(format!("{what} has no {missing:?}")));
    }
    Ok(map)
}

fn take(map: &mut BTreeMap<String, Json>, key: &str) -> Json {
    // `members` checked every key is present.
    map.remove(key).unwrap_or(Json::Null)
}

fn string(value: Json, field: &str) -> Result<String, CapError> {
    match value {
        Json::Str(s) => Ok(s),
        other => Err(CapError::malformed(format!(
            "{field} is {}, not a string",
            other.kind()
        ))),
    }
}

fn time_field(value: Json, field: &str) -> Result<i64, CapError> {
    let text = string(value, field)?;
    timestamp::parse(&text).ok_or_else(|| {
        CapError::malformed(format!(
            "{field} {:?} is not an RFC 3339 UTC time in whole seconds (2026-12-01T00:00:00Z)",
            shorten(&text)
        ))
    })
}

fn check_context(value: Json, field: &str) -> Result<(), CapError> {
    let ok = matches!(&value, Json::Arr(items)
        if items.len() == CONTEXT.len()
            && items.iter().zip(CONTEXT).all(|(item, want)| matches!(item, Json::Str(s) if s == want)));
    if ok {
        Ok(())
    } else {
        Err(CapError::malformed(format!(
            "{field} must be [{:?}, {:?}]",
            CONTEXT[0], CONTEXT[1]
        )))
    }
}

fn check_constant(value: Json, field: &str, want: &str) -> Result<(), CapError> {
    match value {
        Json::Str(s) if s == want => Ok(()),
        _ => Err(CapError::malformed(format!("{field} must be {want:?}"))),
    }
}

/// Converts a parsed value into a capability at chain level `level` (1 for
/// the outermost), checking shape and chain layout.
fn from_value(value: Json, level: usize) -> Result<Capability, CapError> {
    if level > MAX_CHAIN_DEPTH {
        return Err(CapError::ChainTooDeep {
            max: MAX_CHAIN_DEPTH,
        });
    }
    let mut doc = members(value, &CAPABILITY_KEYS, "the capability")?;
    check_context(take(&mut doc, "@context"), "@context")?;

    let id = string(take(&mut doc, "id"), "id")?;
    check_id(&id).map_err(CapError::malformed)?;

    let controller = string(take(&mut doc, "controller"), "controller")?;
    let controller_public = ed25519_from_did_key(&controller)
        .map_err(|e| CapError::malformed(format!("controller is not an Ed25519 did:key: {e}")))?;

    let target = string(take(&mut doc, "invocationTarget"), "invocationTarget")?;
    check_target(&target).map_err(CapError::malformed)?;

    let actions = actions_from_value(take(&mut doc, "allowedAction"))?;
    let expires_unix_secs = time_field(take(&mut doc, "expires"), "expires")?;
    let parent_capability = string(take(&mut doc, "parentCapability"), "parentCapability")?;

    let proof = proof_from_value(take(&mut doc, "proof"), level, expires_unix_secs)?;
    check_chain_layout(
        &parent_capability,
        &proof.chain_ids,
        proof.parent.as_deref(),
    )?;
    if id == parent_capability || proof.chain_ids.contains(&id) {
        return Err(CapError::malformed(
            "id repeats the id of an ancestor in its own chain",
        ));
    }

    Ok(Capability {
        id,
        controller,
        controller_public,
        target,
        actions,
        expires_unix_secs,
        parent_capability,
        proof,
    })
}

/// The `allowedAction` array: known actions, none repeated, at least one.
fn actions_from_value(value: Json) -> Result<Vec<Action>, CapError> {
    let Json::Arr(items) = value else {
        return Err(CapError::malformed("allowedAction is not an array"));
    };
    let mut actions = Vec::with_capacity(items.len());
    for item in items {
        let name = string(item, "an allowedAction entry")?;
        let action = Action::parse(&name).ok_or_else(|| {
            CapError::malformed(format!(
                "allowedAction has the unknown action {:?}; actions are {}",
                shorten(&name),
                crate::action::join(&Action::ALL)
            ))
        })?;
        if actions.contains(&action) {
            return Err(CapError::malformed(format!(
                "allowedAction lists {action} twice"
            )));
        }
        actions.push(action);
    }
    if actions.is_empty() {
        return Err(CapError::malformed("allowedAction is empty"));
    }
    Ok(actions)
}

/// The `proof` object of a capability at chain level `level` that expires at
/// `expires_unix_secs`, the embedded parent included. How its chain fits
/// the capability's `parentCapability` is left to [`check_chain_layout`].
fn proof_from_value(value: Json, level: usize, expires_unix_secs: i64) -> Result<Proof, CapError> {
    let mut proof = members(value, &PROOF_KEYS, "the proof")?;
    check_context(take(&mut proof, "@context"), "proof.@context")?;
    check_constant(take(&mut proof, "type"), "proof.type", PROOF_TYPE)?;
    check_constant(
        take(&mut proof, "cryptosuite"),
        "proof.cryptosuite",
        CRYPTOSUITE,
    )?;
    check_constant(
        take(&mut proof, "proofPurpose"),
        "proof.proofPurpose",
        PROOF_PURPOSE,
    )?;
    let created_unix_secs = time_field(take(&mut proof, "created"), "proof.created")?;
    if created_unix_secs > expires_unix_secs {
        return Err(CapError::malformed(
            "proof.created is after expires: the capability was born expired",
        ));
    }
    let verification_method = string(
        take(&mut proof, "verificationMethod"),
        "proof.verificationMethod",
    )?;
    let delegator_public = parse_verification_method(&verification_method).ok_or_else(|| {
        CapError::malformed(format!(
            "proof.verificationMethod {:?} is not did:key:z6Mk…#z6Mk… of one Ed25519 key",
            shorten(&verification_method)
        ))
    })?;
    let proof_value =
        parse_proof_value(string(take(&mut proof, "proofValue"), "proof.proofValue")?)?;
    let (chain_ids, parent) = chain_from_value(take(&mut proof, "capabilityChain"), level)?;

    Ok(Proof {
        created_unix_secs,
        verification_method,
        delegator_public,
        chain_ids,
        parent,
        proof_value,
    })
}

/// The `proof.capabilityChain` array of a capability at chain level
/// `level`: its leading string ids, and the parent when the last entry is
/// an object (parsed at the next level down).
fn chain_from_value(
    value: Json,
    level: usize,
) -> Result<(Vec<String>, Option<Box<Capability>>), CapError> {
    let Json::Arr(mut chain) = value else {
        return Err(CapError::malformed("proof.capabilityChain is not an array"));
    };
    let parent = match chain.last() {
        Some(Json::Obj(_)) => chain
            .pop()
            .map(|p| from_value(p, level + 1))
            .transpose()?
            .map(Box::new),
        _ => None,
    };
    let chain_ids = chain
        .into_iter()
        .map(|entry| string(entry, "a proof.capabilityChain entry before the last"))
        .collect::<Result<Vec<String>, CapError>>()?;
    Ok((chain_ids, parent))
}

fn parse_proof_value(text: String) -> Result<[u8; 64], CapError> {
    let bad =
        || CapError::malformed("proof.proofValue is not z + base58btc of a 64-byte signature");
    if text.len() > MAX_PROOF_VALUE_CHARS {
        return Err(bad());
    }
    let body = text.strip_prefix('z').ok_or_else(bad)?;
    let bytes = bs58::decode(body).into_vec().map_err(|_| bad())?;
    let signature: [u8; 64] = bytes.try_into().map_err(|_| bad())?;
    // One spelling per signature: base58 has none other, but leading-zero
    // handling differs between encoders, so compare.
    if proof_value_string(&signature) != text {
        return Err(bad());
    }
    Ok(signature)
}

/// Checks how `parentCapability` and `capabilityChain` fit together (ZCAP-LD):
/// a first-level capability has the root id as parent and `[root id]` as
/// chain; a delegated one names its parent's id and has the parent's chain
/// ids, then (if the parent was itself delegated) the grandparent's id, then
/// the parent object.
fn check_chain_layout(
    parent_capability: &str,
    chain_ids: &[String],
    parent: Option<&Capability>,
) -> Result<(), CapError> {
    match parent {
        None => {
            if root_target(parent_capability).is_none() {
                return Err(CapError::malformed(format!(
                    "parentCapability {:?} is neither a root id (urn:zcap:root:<percent-encoded target>) nor followed by the parent capability embedded at the end of proof.capabilityChain",
                    shorten(parent_capability)
                )));
            }
            if chain_ids != [parent_capability] {
                return Err(CapError::malformed(
                    "proof.capabilityChain of a capability delegated from the root must be [parentCapability]",
                ));
            }
        }
        Some(parent) => {
            if parent_capability != parent.id {
                return Err(CapError::malformed(
                    "parentCapability is not the id of the capability embedded at the end of proof.capabilityChain",
                ));
            }
            let mut expected = parent.proof.chain_ids.clone();
            if let Some(grandparent) = parent.parent() {
                expected.push(grandparent.id.clone());
            }
            if chain_ids != expected {
                return Err(CapError::malformed(
                    "proof.capabilityChain must list the root id and every ancestor's id before the embedded parent",
                ));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    // Goal: root ids encode as encodeURIComponent does and decode only from that spelling.
    #[test]
    fn root_ids() {
        assert_eq!(
            root_id("did:nuwa:cap:weather:"),
            "urn:zcap:root:did%3Anuwa%3Acap%3Aweather%3A"
        );
        assert_eq!(
            root_id("did:nuwa:user:a@b:state:Item#v1"),
            "urn:zcap:root:did%3Anuwa%3Auser%3Aa%40b%3Astate%3AItem%23v1"
        );
        assert_eq!(root_id("a-_.!~*'()z"), "urn:zcap:root:a-_.!~*'()z");
        assert_eq!(
            root_target("urn:zcap:root:did%3Anuwa%3Acap%3Aweather%3A").as_deref(),
            Some("did:nuwa:cap:weather:")
        );
        for bad in [
            "urn:zcap:root:did%3anuwa%3A",
            "urn:zcap:root:did:nuwa:",
            "urn:zcap:root:%3",
            "urn:zcap:root:%ZZ",
            "urn:zcap:root:%FF",
            "urn:uuid:did%3A",
        ] {
            assert_eq!(root_target(bad), None, "{bad} decoded");
        }
    }

    // Goal: ids and targets are checked against their documented forms, table-driven.
    #[test]
    fn ids_and_targets() {
        for good in [
            "urn:uuid:0123456789abcdef0123456789abcdef",
            "urn:uuid:01234567-89ab-cdef-0123-456789abcdef",
        ] {
            assert!(check_id(good).is_ok(), "{good} refused");
        }
        for bad in [
            "urn:uuid:0123456789ABCDEF0123456789ABCDEF",
            "urn:uuid:0123456789abcdef0123456789abcde",
            "urn:uuid:01234567-89ab-cdef-0123-456789abcdeg",
            "urn:uuid:0123456789-ab-cdef-0123-456789abcdef",
            "uuid:0123456789abcdef0123456789abcdef",
            "urn:zcap:root:x",
            "",
        ] {
            assert!(check_id(bad).is_err(), "{bad} accepted");
        }
        for good in [
            "did:nuwa:cap:weather:",
            "did:nuwa:cap:news:state:Item#v1",
            "x",
        ] {
            assert!(check_target(good).is_ok(), "{good} refused");
        }
        let long = "a".repeat(MAX_TARGET_BYTES + 1);
        for bad in [
            "",
            "did:nuwa:cap:we ather:",
            "did:nuwa/x",
            "é",
            "a%3A",
            long.as_str(),
        ] {
            assert!(check_target(bad).is_err(), "{bad} accepted");
        }
    }
}
