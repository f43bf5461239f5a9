//! DID documents (W3C DID Core JSON) and the key rules of NIP-1.
//!
//! A document lists the agent's keys as `verificationMethod`s and says what
//! each key may do through the verification relationships. This module
//! answers "may key X do Y at time T?" ([`DidDocument::key_for`],
//! [`DidDocument::method_for_public`]) and checks a document's internal
//! consistency ([`DidDocument::validate`]). Who may *change* a document, and
//! how changes are chained and signed, is [`crate::log`]'s job.
//!
//! Serialization rejects unknown fields (`deny_unknown_fields`): documents are
//! hashed and signed after being re-serialized from these structs, so a field
//! we silently dropped would break signatures in confusing ways, and a field we
//! silently kept unverified would be worse. Relationship entries must be
//! absolute key ids (`did#fragment`) referring to listed methods; embedded
//! methods are not supported.

use std::fmt;

use serde::{Deserialize, Serialize};
use time::OffsetDateTime;
use time::format_description::well_known::Rfc3339;

use crate::did_key::{
    ed25519_public_multibase, parse_ed25519_public_multibase, parse_x25519_public_multibase,
    x25519_public_multibase,
};

/// How long after its `expires` instant a key is still accepted, to absorb clock skew between devices.
pub const EXPIRY_GRACE_SECS: i64 = 60;
/// Upper bound on `verificationMethod` entries; documents arrive from peers and must stay small.
pub const MAX_VERIFICATION_METHODS: usize = 256;
/// Upper bound on `service` entries.
pub const MAX_SERVICES: usize = 64;
/// Longest DID string accepted.
pub const MAX_DID_LEN: usize = 256;
/// Longest key-id fragment accepted.
pub const MAX_FRAGMENT_LEN: usize = 128;

/// The DID Core v1 JSON-LD context; always first in `@context`.
pub const CONTEXT_DID_V1: &str = "https://www.w3.org/ns/did/v1";
/// Context defining `Ed25519VerificationKey2020`.
pub const CONTEXT_ED25519_2020: &str = "https://w3id.org/security/suites/ed25519-2020/v1";
/// Context defining `X25519KeyAgreementKey2020`.
pub const CONTEXT_X25519_2020: &str = "https://w3id.org/security/suites/x25519-2020/v1";
/// Verification method type of signing keys.
pub const ED25519_KEY_TYPE: &str = "Ed25519VerificationKey2020";
/// Verification method type of key-agreement keys.
pub const X25519_KEY_TYPE: &str = "X25519KeyAgreementKey2020";

/// Errors about DIDs, keys and documents. Variants are distinct so callers can
/// count each kind of rejection separately.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DidError {
    /// The string is not a DID we accept.
    #[error("invalid did `{did}`: {reason}")]
    InvalidDid {
        /// The rejected input (shortened if long).
        did: String,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// The DID is well-formed but not an Ed25519 `did:key`.
    #[error("`{did}` is not an ed25519 did:key (expected `did:key:z6Mk...`)")]
    NotDidKey {
        /// The rejected input (shortened if long).
        did: String,
    },
    /// A `publicKeyMultibase` value is not base58btc multibase.
    #[error("invalid multibase key `{value}`: {reason}")]
    InvalidMultibase {
        /// The rejected input (shortened if long).
        value: String,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// A multibase key carries a different multicodec than expected.
    #[error("multibase key `{value}` has multicodec {found:#x}, expected {expected:#x}")]
    WrongMulticodec {
        /// The rejected input (shortened if long).
        value: String,
        /// The multicodec this position requires.
        expected: u64,
        /// The multicodec found.
        found: u64,
    },
    /// A multibase key has the right codec but not 32 key bytes.
    #[error("multibase key `{value}` holds {len} key bytes, expected 32")]
    WrongKeyLength {
        /// The rejected input (shortened if long).
        value: String,
        /// Number of key bytes after the multicodec header.
        len: usize,
    },
    /// The key bytes are not a valid public key of their type.
    #[error("public key `{value}` is not a valid ed25519 point")]
    InvalidPublicKey {
        /// The rejected key (multibase or hex).
        value: String,
    },
    /// A key-id fragment uses characters or a length we do not accept.
    #[error("invalid key fragment `{fragment}`: use 1-128 characters from A-Z a-z 0-9 . _ ~ -")]
    InvalidFragment {
        /// The rejected fragment (shortened if long).
        fragment: String,
    },
    /// A method's `expires` is not an RFC 3339 timestamp.
    #[error("key {key_id} has invalid expires `{value}` (expected RFC 3339)")]
    InvalidExpires {
        /// The method whose `expires` failed to parse.
        key_id: String,
        /// The rejected value (shortened if long).
        value: String,
        /// The parser's explanation.
        #[source]
        source: time::error::Parse,
    },
    /// No verification method with this id is listed in the document.
    #[error("key {key_id} is not listed in the did document")]
    KeyNotFound {
        /// The id (or public key) that was looked up.
        key_id: String,
    },
    /// The key is listed but does not hold the relationship the action needs.
    #[error("key {key_id} is not authorised for {rel}")]
    PermissionDenied {
        /// The key that was checked.
        key_id: String,
        /// The relationship it lacks.
        rel: Relationship,
    },
    /// The key's `expires` instant (plus the grace period) has passed.
    #[error("key {key_id} expired at {expires}")]
    Expired {
        /// The expired key.
        key_id: String,
        /// Its `expires` value.
        expires: String,
    },
    /// The method's type is not the one this use requires.
    #[error("key {key_id} has type {found}, expected {expected}")]
    BadKeyType {
        /// The key that was checked.
        key_id: String,
        /// Its `type`.
        found: String,
        /// The type this use requires.
        expected: &'static str,
    },
    /// A method with this id already exists.
    #[error("key id {key_id} is already listed")]
    DuplicateKeyId {
        /// The duplicated id.
        key_id: String,
    },
    /// The same public key is already listed under another id.
    #[error("public key of {key_id} is already listed as {existing}")]
    DuplicatePublicKey {
        /// The id being added.
        key_id: String,
        /// The id that already carries this key.
        existing: String,
    },
    /// A relationship refers to a key id that no method defines.
    #[error("{rel} refers to {key_id}, which is not a listed verification method")]
    DanglingReference {
        /// The relationship holding the reference.
        rel: Relationship,
        /// The missing id.
        key_id: String,
    },
    /// The document breaks a structural rule (see the reason).
    #[error("malformed did document: {reason}")]
    Malformed {
        /// What rule is broken, naming the offending value.
        reason: String,
    },
}

/// A DID Core verification relationship: the purpose a key may be used for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum Relationship {
    /// Proving to be the DID subject (login, sessions, device sync).
    Authentication,
    /// Issuing assertions such as credentials.
    AssertionMethod,
    /// Establishing encryption keys (X25519 keys only).
    KeyAgreement,
    /// Invoking capabilities, e.g. managing `service` entries.
    CapabilityInvocation,
    /// Delegating capabilities, e.g. adding and removing keys.
    CapabilityDelegation,
}

impl Relationship {
    /// Every relationship, in document order.
    pub const ALL: [Relationship; 5] = [
        Relationship::Authentication,
        Relationship::AssertionMethod,
        Relationship::KeyAgreement,
        Relationship::CapabilityInvocation,
        Relationship::CapabilityDelegation,
    ];

    /// The JSON property name (`"capabilityDelegation"`, ...).
    pub fn as_str(self) -> &'static str {
        match self {
            Relationship::Authentication => "authentication",
            Relationship::AssertionMethod => "assertionMethod",
            Relationship::KeyAgreement => "keyAgreement",
            Relationship::CapabilityInvocation => "capabilityInvocation",
            Relationship::CapabilityDelegation => "capabilityDelegation",
        }
    }

    /// The method type keys in this relationship must have.
    pub fn required_key_type(self) -> &'static str {
        match self {
            Relationship::KeyAgreement => X25519_KEY_TYPE,
            _ => ED25519_KEY_TYPE,
        }
    }
}

impl fmt::Display for Relationship {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Where a key stands at a given instant.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyStatus {
    /// Listed and not expired (grace included).
    Active,
    /// Listed but past `expires` plus [`EXPIRY_GRACE_SECS`] (or `expires` is unreadable).
    Expired,
    /// Not in `verificationMethod` (never added, or revoked).
    NotListed,
}

/// One `verificationMethod` entry.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct VerificationMethod {
    /// Absolute key id, `did#fragment`.
    pub id: String,
    /// `Ed25519VerificationKey2020` or `X25519KeyAgreementKey2020`.
    pub r#type: String,
    /// The DID that controls this key (normally the document's own DID).
    pub controller: String,
    /// `z` + base58btc(multicodec ‖ key).
    pub public_key_multibase: String,
    /// RFC 3339 instant after which the key is no longer accepted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expires: Option<String>,
}

impl VerificationMethod {
    /// The raw Ed25519 key, if this is an Ed25519 method.
    pub fn ed25519_public(&self) -> Result<[u8; 32], DidError> {
        self.expect_type(ED25519_KEY_TYPE)?;
        parse_ed25519_public_multibase(&self.public_key_multibase)
    }

    /// The raw X25519 key, if this is a key-agreement method.
    pub fn x25519_public(&self) -> Result<[u8; 32], DidError> {
        self.expect_type(X25519_KEY_TYPE)?;
        parse_x25519_public_multibase(&self.public_key_multibase)
    }

    /// `expires` as Unix seconds, `None` when the key does not expire.
    pub fn expires_unix_secs(&self) -> Result<Option<i64>, DidError> {
        let Some(expires) = &self.expires else {
            return Ok(None);
        };
        let at = OffsetDateTime::parse(expires, &Rfc3339).map_err(|source| {
            DidError::InvalidExpires {
                key_id: self.id.clone(),
                value: shorten(expires),
                source,
            }
        })?;
        Ok(Some(at.unix_timestamp()))
    }

    /// Fails with [`DidError::Expired`] once `now` is past `expires` + [`EXPIRY_GRACE_SECS`].
    pub fn check_not_expired(&self, now_unix_secs: i64) -> Result<(), DidError> {
        if let Some(expires_secs) = self.expires_unix_secs()?
            && now_unix_secs > expires_secs.saturating_add(EXPIRY_GRACE_SECS)
        {
            return Err(DidError::Expired {
                key_id: self.id.clone(),
                expires: self.expires.clone().unwrap_or_default(),
            });
        }
        Ok(())
    }

    fn expect_type(&self, expected: &'static str) -> Result<(), DidError> {
        if self.r#type == expected {
            Ok(())
        } else {
            Err(DidError::BadKeyType {
                key_id: self.id.clone(),
                found: shorten(&self.r#type),
                expected,
            })
        }
    }

    fn decode_key(&self) -> Result<[u8; 32], DidError> {
        match self.r#type.as_str() {
            ED25519_KEY_TYPE => self.ed25519_public(),
            X25519_KEY_TYPE => self.x25519_public(),
            other => Err(DidError::BadKeyType {
                key_id: self.id.clone(),
                found: shorten(other),
                expected: ED25519_KEY_TYPE,
            }),
        }
    }
}

/// A DID document in W3C DID Core JSON (camelCase).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct DidDocument {
    /// JSON-LD contexts; the first is always [`CONTEXT_DID_V1`].
    #[serde(rename = "@context")]
    pub context: Vec<String>,
    /// The DID this document describes.
    pub id: String,
    /// The DID allowed to change this document.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub controller: Option<String>,
    /// Every key of the agent.
    #[serde(default)]
    pub verification_method: Vec<VerificationMethod>,
    /// Key ids allowed to authenticate as the agent.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub authentication: Vec<String>,
    /// Key ids allowed to make assertions.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub assertion_method: Vec<String>,
    /// Key ids (X25519) for key agreement.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub key_agreement: Vec<String>,
    /// Key ids allowed to invoke capabilities (and manage services).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub capability_invocation: Vec<String>,
    /// Key ids allowed to delegate (and manage keys).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub capability_delegation: Vec<String>,
    /// Service entries, kept as JSON objects with at least `id`, `type`, `serviceEndpoint`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub service: Vec<serde_json::Value>,
}

impl DidDocument {
    /// A document for `did` whose only key is `master_public`, listed under the
    /// fragment `z6Mk...` (as did:key does) with every signing relationship, and
    /// with the DID as its own controller.
    pub fn new_agent(did: &str, master_public: &[u8; 32]) -> Result<DidDocument, DidError> {
        validate_did(did)?;
        let mut doc = DidDocument {
            context: vec![CONTEXT_DID_V1.to_owned(), CONTEXT_ED25519_2020.to_owned()],
            id: did.to_owned(),
            controller: Some(did.to_owned()),
            verification_method: Vec::new(),
            authentication: Vec::new(),
            assertion_method: Vec::new(),
            key_agreement: Vec::new(),
            capability_invocation: Vec::new(),
            capability_delegation: Vec::new(),
            service: Vec::new(),
        };
        let fragment = ed25519_public_multibase(master_public);
        doc.add_key(
            &fragment,
            master_public,
            &[
                Relationship::Authentication,
                Relationship::AssertionMethod,
                Relationship::CapabilityInvocation,
                Relationship::CapabilityDelegation,
            ],
            None,
        )?;
        Ok(doc)
    }

    /// The fragment of a key id (`did#frag` -> `frag`); input without `#` is returned whole.
    pub fn fragment(key_id: &str) -> &str {
        match key_id.split_once('#') {
            Some((_, fragment)) => fragment,
            None => key_id,
        }
    }

    /// The absolute key id for a fragment (`frag` or `#frag` -> `did#frag`).
    /// An input that already is an absolute id (`did:...#frag`) is returned unchanged.
    pub fn key_id(&self, fragment: &str) -> String {
        if let Some(local) = fragment.strip_prefix('#') {
            return format!("{}#{local}", self.id);
        }
        if fragment.contains('#') {
            return fragment.to_owned();
        }
        format!("{}#{fragment}", self.id)
    }

    /// The key ids holding `rel`.
    pub fn relationship(&self, rel: Relationship) -> &[String] {
        match rel {
            Relationship::Authentication => &self.authentication,
            Relationship::AssertionMethod => &self.assertion_method,
            Relationship::KeyAgreement => &self.key_agreement,
            Relationship::CapabilityInvocation => &self.capability_invocation,
            Relationship::CapabilityDelegation => &self.capability_delegation,
        }
    }

    pub(crate) fn relationship_mut(&mut self, rel: Relationship) -> &mut Vec<String> {
        match rel {
            Relationship::Authentication => &mut self.authentication,
            Relationship::AssertionMethod => &mut self.assertion_method,
            Relationship::KeyAgreement => &mut self.key_agreement,
            Relationship::CapabilityInvocation => &mut self.capability_invocation,
            Relationship::CapabilityDelegation => &mut self.capability_delegation,
        }
    }

    /// Lists an Ed25519 key under `fragment` with the given relationships.
    ///
    /// Fails on an invalid fragment, a duplicate id, a public key that is
    /// already listed, `KeyAgreement` (which needs an X25519 key, see
    /// [`DidDocument::add_key_agreement_key`]) or an unparsable `expires`.
    pub fn add_key(
        &mut self,
        fragment: &str,
        public: &[u8; 32],
        relationships: &[Relationship],
        expires: Option<String>,
    ) -> Result<(), DidError> {
        let key_id = self.key_id(fragment);
        if let Some(rel) = relationships
            .iter()
            .find(|rel| rel.required_key_type() != ED25519_KEY_TYPE)
        {
            return Err(DidError::BadKeyType {
                key_id,
                found: ED25519_KEY_TYPE.to_owned(),
                expected: rel.required_key_type(),
            });
        }
        let multibase = ed25519_public_multibase(public);
        // Parsing back also proves the bytes are a curve point.
        parse_ed25519_public_multibase(&multibase)?;
        self.insert_method(
            fragment,
            ED25519_KEY_TYPE,
            multibase,
            relationships,
            expires,
        )?;
        if !self.context.iter().any(|c| c == CONTEXT_ED25519_2020) {
            self.context.push(CONTEXT_ED25519_2020.to_owned());
        }
        Ok(())
    }

    /// Lists an X25519 key under `fragment` in `keyAgreement`.
    pub fn add_key_agreement_key(
        &mut self,
        fragment: &str,
        x25519_public: &[u8; 32],
        expires: Option<String>,
    ) -> Result<(), DidError> {
        let multibase = x25519_public_multibase(x25519_public);
        self.insert_method(
            fragment,
            X25519_KEY_TYPE,
            multibase,
            &[Relationship::KeyAgreement],
            expires,
        )?;
        if !self.context.iter().any(|c| c == CONTEXT_X25519_2020) {
            self.context.push(CONTEXT_X25519_2020.to_owned());
        }
        Ok(())
    }

    fn insert_method(
        &mut self,
        fragment: &str,
        key_type: &str,
        public_key_multibase: String,
        relationships: &[Relationship],
        expires: Option<String>,
    ) -> Result<(), DidError> {
        let local = fragment.strip_prefix('#').unwrap_or(fragment);
        validate_fragment(local)?;
        let key_id = self.key_id(local);
        if self.verification_method.len() >= MAX_VERIFICATION_METHODS {
            return Err(DidError::Malformed {
                reason: format!(
                    "cannot add {key_id}: document already lists {MAX_VERIFICATION_METHODS} keys"
                ),
            });
        }
        if self.verification_method.iter().any(|m| m.id == key_id) {
            return Err(DidError::DuplicateKeyId { key_id });
        }
        if let Some(existing) = self
            .verification_method
            .iter()
            .find(|m| m.public_key_multibase == public_key_multibase)
        {
            return Err(DidError::DuplicatePublicKey {
                key_id,
                existing: existing.id.clone(),
            });
        }
        let method = VerificationMethod {
            id: key_id.clone(),
            r#type: key_type.to_owned(),
            controller: self.id.clone(),
            public_key_multibase,
            expires,
        };
        method.expires_unix_secs()?;
        self.verification_method.push(method);
        for rel in relationships {
            let list = self.relationship_mut(*rel);
            if !list.contains(&key_id) {
                list.push(key_id.clone());
            }
        }
        Ok(())
    }

    /// Removes a key and every relationship entry that refers to it (revocation).
    pub fn remove_key(&mut self, key_id_or_fragment: &str) -> Result<VerificationMethod, DidError> {
        let key_id = self.key_id(key_id_or_fragment);
        let index = self
            .verification_method
            .iter()
            .position(|m| m.id == key_id)
            .ok_or_else(|| DidError::KeyNotFound {
                key_id: key_id.clone(),
            })?;
        let removed = self.verification_method.remove(index);
        for rel in Relationship::ALL {
            self.relationship_mut(rel).retain(|id| *id != key_id);
        }
        Ok(removed)
    }

    /// Adds `rel` to a listed key (no-op if it already holds it).
    pub fn grant(&mut self, key_id_or_fragment: &str, rel: Relationship) -> Result<(), DidError> {
        let method = self
            .find_method(key_id_or_fragment)
            .ok_or_else(|| DidError::KeyNotFound {
                key_id: self.key_id(key_id_or_fragment),
            })?;
        method.expect_type(rel.required_key_type())?;
        let key_id = method.id.clone();
        let list = self.relationship_mut(rel);
        if !list.contains(&key_id) {
            list.push(key_id);
        }
        Ok(())
    }

    /// Takes `rel` away from a key, leaving the key listed (no-op if it did not hold it).
    pub fn revoke(&mut self, key_id_or_fragment: &str, rel: Relationship) {
        let key_id = self.key_id(key_id_or_fragment);
        self.relationship_mut(rel).retain(|id| *id != key_id);
    }

    /// The method with this absolute id, or with this fragment (`frag` or `#frag`) in this DID.
    pub fn find_method(&self, key_id_or_fragment: &str) -> Option<&VerificationMethod> {
        let key_id = self.key_id(key_id_or_fragment);
        self.verification_method.iter().find(|m| m.id == key_id)
    }

    /// Whether the key (absolute id or fragment) is listed under `rel`.
    pub fn has_relationship(&self, key_id_or_fragment: &str, rel: Relationship) -> bool {
        let key_id = self.key_id(key_id_or_fragment);
        self.relationship(rel).contains(&key_id)
    }

    /// Whether a key is listed and unexpired at `now_unix_secs` (relationships not considered).
    pub fn key_status(&self, key_id: &str, now_unix_secs: i64) -> KeyStatus {
        match self.find_method(key_id) {
            None => KeyStatus::NotListed,
            Some(method) => match method.check_not_expired(now_unix_secs) {
                Ok(()) => KeyStatus::Active,
                Err(_) => KeyStatus::Expired,
            },
        }
    }

    /// The raw public key of `key_id` if it may be used for `rel` at `now_unix_secs`.
    ///
    /// Checks, in order: listed ([`DidError::KeyNotFound`]), of the type `rel`
    /// needs ([`DidError::BadKeyType`]), not expired with
    /// [`EXPIRY_GRACE_SECS`] of grace ([`DidError::Expired`]), holding `rel`
    /// ([`DidError::PermissionDenied`]). `key_id` must belong to this DID: an
    /// absolute id of another DID is never found here.
    pub fn key_for(
        &self,
        key_id: &str,
        rel: Relationship,
        now_unix_secs: i64,
    ) -> Result<[u8; 32], DidError> {
        let method = self.usable_method(key_id, rel.required_key_type(), now_unix_secs)?;
        let public = method.decode_key()?;
        self.require_relationship(&method.id, rel)?;
        Ok(public)
    }

    /// The listed, unexpired method of type `expected_type` for `key_id`,
    /// without looking at relationships (NIP-2 checks those after the signature).
    pub fn usable_method(
        &self,
        key_id: &str,
        expected_type: &'static str,
        now_unix_secs: i64,
    ) -> Result<&VerificationMethod, DidError> {
        let method = self
            .find_method(key_id)
            .ok_or_else(|| DidError::KeyNotFound {
                key_id: shorten(&self.key_id(key_id)),
            })?;
        method.expect_type(expected_type)?;
        method.check_not_expired(now_unix_secs)?;
        Ok(method)
    }

    /// Fails with [`DidError::PermissionDenied`] unless `key_id` is listed under `rel`.
    pub fn require_relationship(&self, key_id: &str, rel: Relationship) -> Result<(), DidError> {
        if self.has_relationship(key_id, rel) {
            Ok(())
        } else {
            Err(DidError::PermissionDenied {
                key_id: self.key_id(key_id),
                rel,
            })
        }
    }

    /// The Ed25519 method carrying `public`, if it may be used for `rel` at
    /// `now_unix_secs`. This maps a libp2p peer's key to one of the agent's devices.
    pub fn method_for_public(
        &self,
        public: &[u8; 32],
        rel: Relationship,
        now_unix_secs: i64,
    ) -> Result<&VerificationMethod, DidError> {
        let multibase = ed25519_public_multibase(public);
        let method = self
            .verification_method
            .iter()
            .find(|m| m.r#type == ED25519_KEY_TYPE && m.public_key_multibase == multibase)
            .ok_or(DidError::KeyNotFound { key_id: multibase })?;
        method.check_not_expired(now_unix_secs)?;
        self.require_relationship(&method.id, rel)?;
        Ok(method)
    }

    /// Checks internal consistency: valid DIDs, the DID Core context first,
    /// method ids of the form `<this DID>#<fragment>` and unique, known key
    /// types whose multibase parses, readable `expires`, no public key listed
    /// twice, every relationship entry pointing at a listed method of the right
    /// type (no duplicates), services with unique `id`s, and the size bounds.
    pub fn validate(&self) -> Result<(), DidError> {
        validate_did(&self.id)?;
        if self.context.first().map(String::as_str) != Some(CONTEXT_DID_V1) {
            return Err(malformed(format!(
                "@context must start with {CONTEXT_DID_V1}"
            )));
        }
        if let Some(controller) = &self.controller {
            validate_did(controller)?;
        }
        if self.verification_method.len() > MAX_VERIFICATION_METHODS {
            return Err(malformed(format!(
                "{} verification methods, at most {MAX_VERIFICATION_METHODS} allowed",
                self.verification_method.len()
            )));
        }
        let prefix = format!("{}#", self.id);
        let mut seen_ids = std::collections::BTreeSet::new();
        let mut seen_keys = std::collections::BTreeMap::new();
        for method in &self.verification_method {
            let fragment = method.id.strip_prefix(&prefix).ok_or_else(|| {
                malformed(format!(
                    "verification method {} does not belong to {}",
                    shorten(&method.id),
                    self.id
                ))
            })?;
            validate_fragment(fragment)?;
            if !seen_ids.insert(method.id.as_str()) {
                return Err(DidError::DuplicateKeyId {
                    key_id: method.id.clone(),
                });
            }
            validate_did(&method.controller)?;
            let key = method.decode_key()?;
            if let Some(existing) = seen_keys.insert((method.r#type.as_str(), key), &method.id) {
                return Err(DidError::DuplicatePublicKey {
                    key_id: method.id.clone(),
                    existing: existing.clone(),
                });
            }
            method.expires_unix_secs()?;
        }
        for rel in Relationship::ALL {
            let list = self.relationship(rel);
            let mut seen = std::collections::BTreeSet::new();
            for key_id in list {
                let method = self
                    .verification_method
                    .iter()
                    .find(|m| m.id == *key_id)
                    .ok_or_else(|| DidError::DanglingReference {
                        rel,
                        key_id: shorten(key_id),
                    })?;
                method.expect_type(rel.required_key_type())?;
                if !seen.insert(key_id.as_str()) {
                    return Err(malformed(format!("{rel} lists {key_id} twice")));
                }
            }
        }
        if self.service.len() > MAX_SERVICES {
            return Err(malformed(format!(
                "{} services, at most {MAX_SERVICES} allowed",
                self.service.len()
            )));
        }
        let mut service_ids = std::collections::BTreeSet::new();
        for service in &self.service {
            let id = service
                .get("id")
                .and_then(serde_json::Value::as_str)
                .ok_or_else(|| malformed("service entry without a string `id`".to_owned()))?;
            if service.get("type").is_none() || service.get("serviceEndpoint").is_none() {
                return Err(malformed(format!(
                    "service {} needs `type` and `serviceEndpoint`",
                    shorten(id)
                )));
            }
            if !service_ids.insert(id) {
                return Err(malformed(format!(
                    "service id {} is used twice",
                    shorten(id)
                )));
            }
        }
        Ok(())
    }
}

fn malformed(reason: String) -> DidError {
    DidError::Malformed { reason }
}

/// Checks DID syntax (`did:<method>:<method-specific-id>`, W3C DID Core ABNF,
/// without path, query or fragment) and our length bound.
pub fn validate_did(did: &str) -> Result<(), DidError> {
    let invalid = |reason| DidError::InvalidDid {
        did: shorten(did),
        reason,
    };
    if did.len() > MAX_DID_LEN {
        return Err(invalid("longer than 256 bytes"));
    }
    let rest = did
        .strip_prefix("did:")
        .ok_or_else(|| invalid("must start with `did:`"))?;
    let (method, specific) = rest
        .split_once(':')
        .ok_or_else(|| invalid("must be `did:<method>:<id>`"))?;
    if method.is_empty()
        || !method
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit())
    {
        return Err(invalid("method name must be lowercase letters and digits"));
    }
    if specific.is_empty() || specific.ends_with(':') {
        return Err(invalid("method-specific id is empty"));
    }
    let allowed =
        |b: u8| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'-' | b'_' | b':' | b'%');
    if !specific.bytes().all(allowed) {
        return Err(invalid(
            "method-specific id may only use A-Z a-z 0-9 . - _ : and %-escapes",
        ));
    }
    Ok(())
}

fn validate_fragment(fragment: &str) -> Result<(), DidError> {
    let ok = !fragment.is_empty()
        && fragment.len() <= MAX_FRAGMENT_LEN
        && fragment
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'~' | b'-'));
    if ok {
        Ok(())
    } else {
        Err(DidError::InvalidFragment {
            fragment: shorten(fragment),
        })
    }
}

/// Caps untrusted strings before they go into error messages and logs.
pub fn shorten(s: &str) -> String {
    const MAX: usize = 96;
    if s.len() <= MAX {
        return s.to_owned();
    }
    let mut end = MAX;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}...", &s[..end])
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::did_key::{did_key_document, did_key_from_ed25519};
    use crate::keys::{DeviceKey, context_id_for};

    const NOW: i64 = 1_750_000_000;

    fn agent() -> (DeviceKey, DidDocument) {
        let master = DeviceKey::from_seed(&[1; 32]);
        let did = did_key_from_ed25519(&master.public());
        let doc = DidDocument::new_agent(&did, &master.public()).expect("valid agent");
        (master, doc)
    }

    // Goal: a new agent document lists the master with all signing relationships and validates.
    #[test]
    fn new_agent_document() {
        let (master, doc) = agent();
        doc.validate().expect("valid");
        let master_id = doc.key_id(&ed25519_public_multibase(&master.public()));
        for rel in [
            Relationship::Authentication,
            Relationship::AssertionMethod,
            Relationship::CapabilityInvocation,
            Relationship::CapabilityDelegation,
        ] {
            assert_eq!(
                doc.key_for(&master_id, rel, NOW).expect("allowed"),
                master.public()
            );
        }
        assert!(matches!(
            doc.key_for(&master_id, Relationship::KeyAgreement, NOW),
            Err(DidError::BadKeyType { .. })
        ));
        assert_eq!(doc.controller.as_deref(), Some(doc.id.as_str()));
    }

    // Goal: key_for / method_for_public / key_status give the right answer for each NIP-1 situation;
    // one table row per (key, relationship, time) with the expected outcome.
    #[test]
    fn key_rules_table() {
        let (_master, mut doc) = agent();
        let phone = DeviceKey::from_seed(&[2; 32]);
        let invoker = DeviceKey::from_seed(&[3; 32]);
        let session = DeviceKey::from_seed(&[4; 32]);
        let phone_frag = context_id_for(&phone.public());
        doc.add_key(
            &phone_frag,
            &phone.public(),
            &[Relationship::Authentication],
            None,
        )
        .expect("add phone");
        doc.add_key(
            "invoker",
            &invoker.public(),
            &[Relationship::CapabilityInvocation],
            None,
        )
        .expect("add invoker");
        // Expires at NOW exactly.
        doc.add_key(
            "session",
            &session.public(),
            &[Relationship::Authentication],
            Some("2025-06-15T15:06:40Z".to_owned()),
        )
        .expect("add session");
        assert_eq!(
            OffsetDateTime::parse("2025-06-15T15:06:40Z", &Rfc3339)
                .expect("fixture parses")
                .unix_timestamp(),
            NOW
        );
        doc.validate().expect("valid");

        #[derive(Debug, PartialEq)]
        enum Want {
            Ok,
            NotFound,
            Denied,
            Expired,
            BadType,
        }
        use Relationship::*;
        let cases: Vec<(&str, Relationship, i64, Want)> = vec![
            (phone_frag.as_str(), Authentication, NOW, Want::Ok),
            (phone_frag.as_str(), CapabilityDelegation, NOW, Want::Denied),
            ("invoker", CapabilityInvocation, NOW, Want::Ok),
            // NIP-1 test case 5: invocation but not authentication.
            ("invoker", Authentication, NOW, Want::Denied),
            ("invoker", KeyAgreement, NOW, Want::BadType),
            ("session", Authentication, NOW, Want::Ok),
            ("session", Authentication, NOW + EXPIRY_GRACE_SECS, Want::Ok),
            (
                "session",
                Authentication,
                NOW + EXPIRY_GRACE_SECS + 1,
                Want::Expired,
            ),
            ("nobody", Authentication, NOW, Want::NotFound),
            (
                "did:key:z6MkiTBz1ymuepAQ4HEHYSF1H8quG5GLVVQR3djdX3mDooWp#invoker",
                CapabilityInvocation,
                NOW,
                Want::NotFound,
            ),
        ];
        for (key, rel, now, want) in cases {
            let got = match doc.key_for(key, rel, now) {
                Ok(_) => Want::Ok,
                Err(DidError::KeyNotFound { .. }) => Want::NotFound,
                Err(DidError::PermissionDenied { rel: r, .. }) => {
                    assert_eq!(r, rel);
                    Want::Denied
                }
                Err(DidError::Expired { .. }) => Want::Expired,
                Err(DidError::BadKeyType { .. }) => Want::BadType,
                Err(other) => panic!("{key} {rel}: unexpected {other}"),
            };
            assert_eq!(got, want, "{key} {rel} at {now}");
        }

        // The same rules through the public-key lookup used for libp2p peers.
        let method = doc
            .method_for_public(&phone.public(), Authentication, NOW)
            .expect("phone is a member");
        assert_eq!(DidDocument::fragment(&method.id), phone_frag);
        assert!(matches!(
            doc.method_for_public(&invoker.public(), Authentication, NOW),
            Err(DidError::PermissionDenied { .. })
        ));
        assert!(matches!(
            doc.method_for_public(&session.public(), Authentication, NOW + 3600),
            Err(DidError::Expired { .. })
        ));
        assert!(matches!(
            doc.method_for_public(&[9; 32], Authentication, NOW),
            Err(DidError::KeyNotFound { .. })
        ));
        assert_eq!(doc.key_status("session", NOW), KeyStatus::Active);
        assert_eq!(doc.key_status("session", NOW + 3600), KeyStatus::Expired);
        assert_eq!(doc.key_status("nobody", NOW), KeyStatus::NotListed);
    }

    // Goal: NIP-1 test case 6 at document level: removing a key drops it from every relationship.
    #[test]
    fn remove_key_revokes_everywhere() {
        let (_m, mut doc) = agent();
        let phone = DeviceKey::from_seed(&[2; 32]);
        doc.add_key(
            "phone",
            &phone.public(),
            &[
                Relationship::Authentication,
                Relationship::CapabilityInvocation,
            ],
            None,
        )
        .expect("add");
        doc.remove_key("phone").expect("listed");
        doc.validate().expect("still valid");
        assert!(!doc.authentication.iter().any(|id| id.ends_with("#phone")));
        assert!(matches!(
            doc.key_for("phone", Relationship::Authentication, NOW),
            Err(DidError::KeyNotFound { .. })
        ));
        assert!(matches!(
            doc.remove_key("phone"),
            Err(DidError::KeyNotFound { .. })
        ));
    }

    // Goal: add_key refuses duplicates, bad fragments, bad expiry and KeyAgreement on Ed25519 keys.
    #[test]
    fn add_key_rejections() {
        let (master, mut doc) = agent();
        let phone = DeviceKey::from_seed(&[2; 32]);
        doc.add_key("phone", &phone.public(), &[], None)
            .expect("add");
        let other = DeviceKey::from_seed(&[3; 32]).public();
        type Check = fn(&DidError) -> bool;
        type Case = (
            &'static str,
            [u8; 32],
            Vec<Relationship>,
            Option<String>,
            Check,
        );
        let cases: Vec<Case> = vec![
            ("phone", other, vec![], None, |e| {
                matches!(e, DidError::DuplicateKeyId { .. })
            }),
            ("laptop", phone.public(), vec![], None, |e| {
                matches!(e, DidError::DuplicatePublicKey { .. })
            }),
            ("laptop", master.public(), vec![], None, |e| {
                matches!(e, DidError::DuplicatePublicKey { .. })
            }),
            ("", other, vec![], None, |e| {
                matches!(e, DidError::InvalidFragment { .. })
            }),
            ("a b", other, vec![], None, |e| {
                matches!(e, DidError::InvalidFragment { .. })
            }),
            ("a#b", other, vec![], None, |e| {
                matches!(e, DidError::InvalidFragment { .. })
            }),
            ("laptop", other, vec![], Some("tomorrow".into()), |e| {
                matches!(e, DidError::InvalidExpires { .. })
            }),
            (
                "laptop",
                other,
                vec![Relationship::KeyAgreement],
                None,
                |e| matches!(e, DidError::BadKeyType { .. }),
            ),
        ];
        for (fragment, public, rels, expires, check) in cases {
            let before = doc.clone();
            match doc.add_key(fragment, &public, &rels, expires) {
                Err(e) => assert!(check(&e), "{fragment}: unexpected {e}"),
                Ok(()) => panic!("{fragment}: accepted"),
            }
            assert_eq!(
                doc, before,
                "{fragment}: failed add must not change the document"
            );
        }
    }

    // Goal: validate() catches each kind of inconsistency a peer could send; one mutation per row.
    #[test]
    fn validate_rejects_inconsistent_documents() {
        let (_m, mut base) = agent();
        base.add_key("phone", &DeviceKey::from_seed(&[2; 32]).public(), &[], None)
            .expect("add");
        base.add_key_agreement_key("phone-x", &[7; 32], None)
            .expect("add x25519");
        base.service.push(serde_json::json!({
            "id": format!("{}#sync", base.id), "type": "NuwaSync", "serviceEndpoint": "p2p"
        }));
        base.validate().expect("base is valid");

        let other_did = did_key_from_ed25519(&DeviceKey::from_seed(&[8; 32]).public());
        type Mutation = Box<dyn Fn(&mut DidDocument)>;
        let mutations: Vec<(&str, Mutation)> = vec![
            ("bad id", Box::new(|d| d.id = "not-a-did".into())),
            ("no context", Box::new(|d| d.context.clear())),
            ("context order", Box::new(|d| d.context.reverse())),
            (
                "bad controller",
                Box::new(|d| d.controller = Some("did:".into())),
            ),
            ("foreign method id", {
                let other = other_did.clone();
                Box::new(move |d| d.verification_method[1].id = format!("{other}#phone"))
            }),
            (
                "relative method id",
                Box::new(|d| d.verification_method[1].id = "#phone".into()),
            ),
            (
                "duplicate method",
                Box::new(|d| {
                    let m = d.verification_method[1].clone();
                    d.verification_method.push(m);
                }),
            ),
            (
                "duplicate key",
                Box::new(|d| {
                    let mut m = d.verification_method[1].clone();
                    m.id = format!("{}#copy", d.id);
                    d.verification_method.push(m);
                }),
            ),
            (
                "unknown type",
                Box::new(|d| d.verification_method[1].r#type = "RsaKey".into()),
            ),
            (
                "type/key mismatch",
                Box::new(|d| d.verification_method[1].r#type = X25519_KEY_TYPE.into()),
            ),
            (
                "bad multibase",
                Box::new(|d| d.verification_method[1].public_key_multibase = "zzz0".into()),
            ),
            (
                "bad expires",
                Box::new(|d| d.verification_method[1].expires = Some("soon".into())),
            ),
            (
                "dangling reference",
                Box::new(|d| {
                    let id = format!("{}#ghost", d.id);
                    d.authentication.push(id);
                }),
            ),
            (
                "duplicate reference",
                Box::new(|d| {
                    let id = d.authentication[0].clone();
                    d.authentication.push(id);
                }),
            ),
            (
                "x25519 used for authentication",
                Box::new(|d| {
                    let id = d.key_agreement[0].clone();
                    d.authentication.push(id);
                }),
            ),
            (
                "ed25519 used for key agreement",
                Box::new(|d| {
                    let id = d.authentication[0].clone();
                    d.key_agreement.push(id);
                }),
            ),
            (
                "service without id",
                Box::new(|d| {
                    d.service
                        .push(serde_json::json!({"type": "x", "serviceEndpoint": "y"}))
                }),
            ),
            (
                "service without endpoint",
                Box::new(|d| d.service.push(serde_json::json!({"id": "s2", "type": "x"}))),
            ),
            (
                "duplicate service",
                Box::new(|d| {
                    let s = d.service[0].clone();
                    d.service.push(s);
                }),
            ),
        ];
        for (name, mutate) in mutations {
            let mut doc = base.clone();
            mutate(&mut doc);
            assert!(doc.validate().is_err(), "{name}: accepted");
        }
    }

    // Goal: JSON round trip keeps the document, skips empty lists, and rejects unknown fields.
    #[test]
    fn serde_shape() {
        let (_m, doc) = agent();
        let json = serde_json::to_value(&doc).expect("serializable");
        assert!(json.get("@context").is_some());
        assert!(json.get("verificationMethod").is_some());
        assert!(
            json.get("keyAgreement").is_none(),
            "empty lists are skipped"
        );
        assert!(json.get("service").is_none());
        let back: DidDocument = serde_json::from_value(json.clone()).expect("round trip");
        assert_eq!(back, doc);

        let mut extra = json.clone();
        extra["alsoKnownAs"] = serde_json::json!(["x"]);
        assert!(serde_json::from_value::<DidDocument>(extra).is_err());
        let mut extra_vm = json;
        extra_vm["verificationMethod"][0]["publicKeyBase58"] = serde_json::json!("abc");
        assert!(serde_json::from_value::<DidDocument>(extra_vm).is_err());
    }

    // Goal: fragment/key_id helpers convert both ways, and did:key documents use the same rules.
    #[test]
    fn key_id_helpers_and_did_key_doc() {
        let (master, doc) = agent();
        assert_eq!(DidDocument::fragment("did:x:y#frag"), "frag");
        assert_eq!(DidDocument::fragment("frag"), "frag");
        assert_eq!(doc.key_id("frag"), format!("{}#frag", doc.id));
        assert_eq!(doc.key_id("#frag"), format!("{}#frag", doc.id));
        assert_eq!(doc.key_id("did:x:y#frag"), "did:x:y#frag");

        let dk = did_key_document(&doc.id).expect("did:key resolves");
        let x_id = dk.key_agreement[0].clone();
        let x = dk
            .key_for(&x_id, Relationship::KeyAgreement, NOW)
            .expect("x25519 key");
        assert_eq!(
            x,
            crate::did_key::x25519_public_from_ed25519(&master.public()).expect("point")
        );
    }

    // Goal: DID syntax validation accepts real DIDs and rejects the usual mistakes.
    #[test]
    fn did_syntax() {
        for ok in [
            "did:key:z6Mk",
            "did:web:example.com",
            "did:rooch:0x12ab",
            "did:example:a:b%20c",
        ] {
            validate_did(ok).unwrap_or_else(|e| panic!("{ok}: {e}"));
        }
        let long = format!("did:example:{}", "a".repeat(300));
        for bad in [
            "",
            "did",
            "did:",
            "did::x",
            "did:Key:x",
            "did:key:",
            "did:key:x:",
            "did:key:x#f",
            "did:key:x?q",
            "did:key:x/p",
            "did:key:x y",
            "key:x",
            long.as_str(),
        ] {
            assert!(validate_did(bad).is_err(), "{bad} accepted");
        }
    }
}
