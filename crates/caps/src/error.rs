//! Why a capability, a delegation or a signed request was refused.
//!
//! Every refusal is a [`CapError`] with a stable snake_case [`CapError::code`]
//! that the HTTP layer uses as its error code and counter label; the
//! message is for the developer of the app and says what to do next.

use crate::action::Action;

/// Why a capability, a delegation or a signed request was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum CapError {
    /// The capability is not JSON of the capability shape.
    #[error(
        "malformed capability: {reason}; build capabilities with nuwa-caps or nuwa_app.mjs, which write the expected shape"
    )]
    MalformedCapability {
        /// What is wrong, naming the field.
        reason: String,
    },
    /// The serialized capability is larger than the limit.
    #[error(
        "capability of {len} bytes is larger than the {max} bytes accepted; delegate from a shorter chain"
    )]
    CapabilityTooLarge {
        /// Its size in bytes (or a lower bound, when only that is known).
        len: usize,
        /// The limit.
        max: usize,
    },
    /// The chain has more delegations than the limit.
    #[error(
        "capability chain is deeper than {max} delegations; ask someone nearer the agent's admin to delegate"
    )]
    ChainTooDeep {
        /// The limit.
        max: usize,
    },
    /// A delegation proof does not verify, or is signed by the wrong key.
    #[error(
        "the delegation proof of capability {id} does not verify: {reason}; the capability was altered or not signed by its delegator, ask the delegator for a new one"
    )]
    BadProof {
        /// The capability whose proof failed.
        id: String,
        /// Why.
        reason: &'static str,
    },
    /// A first-level capability was delegated by a key that is not an admin of the agent.
    #[error(
        "capability {id} was delegated by {delegator}, which is not an admin key of this agent; ask one of the agent's admin devices to delegate it"
    )]
    NotAnAdmin {
        /// The first-level capability.
        id: String,
        /// The did:key of the key that signed it.
        delegator: String,
    },
    /// A capability grants more than its parent (or root) does.
    #[error(
        "capability {id} grants more than its parent: {reason}; a delegated capability may only narrow its parent's target, actions and expiry"
    )]
    Attenuation {
        /// The capability that widens.
        id: String,
        /// What it widens.
        reason: String,
    },
    /// A capability in the chain has expired.
    #[error("capability {id} expired at {expires}; ask its delegator for a new one")]
    CapabilityExpired {
        /// The expired capability.
        id: String,
        /// Its `expires`, RFC 3339.
        expires: String,
    },
    /// A capability's delegation proof is dated too far in the future.
    #[error(
        "capability {id} was delegated at {created}, which is in the future; check the delegating device's clock"
    )]
    CapabilityNotYetValid {
        /// The capability.
        id: String,
        /// Its proof's `created`, RFC 3339.
        created: String,
    },
    /// A capability in the chain (or the chain's root) is revoked.
    #[error("capability {id} is revoked; ask an admin of the agent for a new capability")]
    CapabilityRevoked {
        /// The revoked id.
        id: String,
    },
    /// A header of the signed request is missing or not of the expected form.
    #[error(
        "malformed {header} header: {reason}; sign requests with nuwa-caps' sign_request or nuwa_app.mjs' signedFetch"
    )]
    MalformedInvocation {
        /// The header's name (lowercase), or `request` for the request line.
        header: &'static str,
        /// What is wrong.
        reason: String,
    },
    /// A header of the signed request is larger than its limit.
    #[error("{header} header of {len} bytes is larger than the {max} bytes accepted")]
    HeaderTooLarge {
        /// The header's name (lowercase).
        header: &'static str,
        /// Its size in bytes.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// The request signature does not verify with the key in `keyid`.
    #[error(
        "the request signature does not verify with {keyid}; sign the exact method, path, query and headers that are sent"
    )]
    BadSignature {
        /// The `keyid` of the signature.
        keyid: String,
    },
    /// The request's nonce was already used by this key.
    #[error(
        "nonce {nonce:?} was already used by {keyid}; use a fresh random nonce for every request"
    )]
    Replayed {
        /// The signature's `keyid`.
        keyid: String,
        /// The reused nonce.
        nonce: String,
    },
    /// The request signature is outside its time window.
    #[error(
        "request signature created at {created} and expiring at {expires} is not valid at {now} (unix seconds): {reason}; the daemon allows created from {skew} s before its clock to {future} s after it, and signatures living at most {ttl} s, so sign each request just before sending it",
        skew = crate::limits::MAX_CLOCK_SKEW_SECS,
        future = crate::limits::MAX_REQUEST_FUTURE_SECS,
        ttl = crate::limits::MAX_SIGNATURE_TTL_SECS
    )]
    StaleSignature {
        /// The signature's `created`.
        created: i64,
        /// The signature's `expires`.
        expires: i64,
        /// The verifier's clock.
        now: i64,
        /// Which bound was missed.
        reason: &'static str,
    },
    /// The body does not hash to the `Content-Digest` the request signed.
    #[error(
        "the body does not match its content-digest header; compute the digest over the exact body bytes sent"
    )]
    DigestMismatch,
    /// The request is signed by a key other than the capability's invoker.
    #[error(
        "the request is signed by {keyid}, but the capability is for {controller}; sign with the key the capability was delegated to"
    )]
    WrongInvoker {
        /// The signature's `keyid` (or the signing key's did:key when issuing).
        keyid: String,
        /// The capability's `controller`.
        controller: String,
    },
    /// The requested action is not in the capability.
    #[error(
        "action {action} is not allowed by the capability (it allows {allowed}); ask for a capability with that action"
    )]
    ActionNotAllowed {
        /// The action asked for.
        action: Action,
        /// The actions allowed, comma-separated.
        allowed: String,
    },
    /// The nonce cache is full of unexpired entries.
    #[error(
        "too many signed requests in the last minutes ({capacity} remembered nonces); retry in a few seconds"
    )]
    NonceCacheFull {
        /// The cache's capacity.
        capacity: usize,
    },
    /// A caller of `delegate` or `sign_request` passed an unusable argument.
    #[error("invalid {what}: {reason}")]
    InvalidInput {
        /// The argument.
        what: &'static str,
        /// Why it cannot be used.
        reason: String,
    },
}

impl CapError {
    /// A stable snake_case code: the HTTP error code and counter label.
    pub fn code(&self) -> &'static str {
        match self {
            CapError::MalformedCapability { .. } => "malformed_capability",
            CapError::CapabilityTooLarge { .. } => "capability_too_large",
            CapError::ChainTooDeep { .. } => "chain_too_deep",
            CapError::BadProof { .. } => "bad_proof",
            CapError::NotAnAdmin { .. } => "not_an_admin",
            CapError::Attenuation { .. } => "attenuation",
            CapError::CapabilityExpired { .. } => "capability_expired",
            CapError::CapabilityNotYetValid { .. } => "capability_not_yet_valid",
            CapError::CapabilityRevoked { .. } => "capability_revoked",
            CapError::MalformedInvocation { .. } => "malformed_invocation",
            CapError::HeaderTooLarge { .. } => "header_too_large",
            CapError::BadSignature { .. } => "bad_signature",
            CapError::Replayed { .. } => "replayed_nonce",
            CapError::StaleSignature { .. } => "stale_signature",
            CapError::DigestMismatch => "digest_mismatch",
            CapError::WrongInvoker { .. } => "wrong_invoker",
            CapError::ActionNotAllowed { .. } => "action_not_allowed",
            CapError::NonceCacheFull { .. } => "nonce_cache_full",
            CapError::InvalidInput { .. } => "invalid_input",
        }
    }

    /// Every code [`CapError::code`] can return, for registering counters up front.
    pub const CODES: &'static [&'static str] = &[
        "malformed_capability",
        "capability_too_large",
        "chain_too_deep",
        "bad_proof",
        "not_an_admin",
        "attenuation",
        "capability_expired",
        "capability_not_yet_valid",
        "capability_revoked",
        "malformed_invocation",
        "header_too_large",
        "bad_signature",
        "replayed_nonce",
        "stale_signature",
        "digest_mismatch",
        "wrong_invoker",
        "action_not_allowed",
        "nonce_cache_full",
        "invalid_input",
    ];

    pub(crate) fn malformed(reason: impl Into<String>) -> CapError {
        CapError::MalformedCapability {
            reason: reason.into(),
        }
    }

    pub(crate) fn invocation(header: &'static str, reason: impl Into<String>) -> CapError {
        CapError::MalformedInvocation {
            header,
            reason: reason.into(),
        }
    }

    pub(crate) fn input(what: &'static str, reason: impl Into<String>) -> CapError {
        CapError::InvalidInput {
            what,
            reason: reason.into(),
        }
    }
}

/// Why an otherwise valid invocation may not touch a container.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Forbidden {
    /// The capability does not list the action.
    #[error(
        "the capability for {target} does not allow {action} (it allows {allowed}); ask for a capability with {action}"
    )]
    ActionNotGranted {
        /// The capability's target.
        target: String,
        /// The action asked for.
        action: Action,
        /// The actions the capability allows, comma-separated.
        allowed: String,
    },
    /// The capability's target does not reach the container. The message
    /// is the same whatever the container's visibility, or whether it
    /// exists: an app learns nothing of a name it may not see.
    #[error(
        "the capability for {target} does not reach {container}; {action} there needs a capability for {namespace}, or for {container} itself if its schema makes it shared"
    )]
    NotCovered {
        /// The capability's target.
        target: String,
        /// The container asked for.
        container: String,
        /// The action asked for.
        action: Action,
        /// The container's namespace.
        namespace: String,
    },
}

impl Forbidden {
    /// A stable snake_case code, as [`CapError::code`].
    pub fn code(&self) -> &'static str {
        match self {
            Forbidden::ActionNotGranted { .. } => "action_not_granted",
            Forbidden::NotCovered { .. } => "container_not_covered",
        }
    }
}
