//! Keeper requests and responses (see `sync.proto`): typed, and bounded on
//! decode like every other wire message. What they mean, and how requests
//! are signed and checked, is `nuwa-keeper`'s business.

use nuwa_crypto::Envelope;

use crate::{WireError, check_id, envelope_from_pb, envelope_to_pb, fixed, invalid, pb};

/// Envelopes in one push.
pub const MAX_PUSH_ENVELOPES: usize = 1024;
/// Entries in one batch.
pub const MAX_BATCH_ENTRIES: usize = 4096;
/// Longest refusal detail.
pub const MAX_DETAIL_BYTES: usize = 512;
/// Most bytes of DID chain entries a keeper takes and serves.
pub const MAX_KEEPER_CHAIN_BYTES: usize = 1024 * 1024;
/// Longest chain head hash a pull names.
const MAX_HEAD_BYTES: usize = 128;
/// Most epoch grants in one [`Membership`].
pub const MAX_KEEPER_GRANTS: usize = 4;

/// An agent's membership as a keeper takes and serves it (see
/// `KeeperMembership` in `sync.proto`): public material that a device
/// checks like the same material from a peer. Empty: nothing to carry.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Membership {
    /// DID chain entries from seq 1 on (JSON), at most
    /// [`MAX_KEEPER_CHAIN_BYTES`].
    pub did_entries: Vec<u8>,
    /// Signed epoch grants, each at most [`crate::MAX_EPOCH_GRANT_BYTES`],
    /// at most [`MAX_KEEPER_GRANTS`].
    pub epoch_grants: Vec<Vec<u8>>,
}

impl Membership {
    pub fn is_empty(&self) -> bool {
        self.did_entries.is_empty() && self.epoch_grants.is_empty()
    }

    fn to_pb(&self) -> Option<pb::KeeperMembership> {
        (!self.is_empty()).then(|| pb::KeeperMembership {
            did_entries: self.did_entries.clone(),
            epoch_grants: self.epoch_grants.clone(),
        })
    }

    fn from_pb(m: Option<pb::KeeperMembership>) -> Result<Membership, WireError> {
        let Some(m) = m else {
            return Ok(Membership::default());
        };
        if m.did_entries.len() > MAX_KEEPER_CHAIN_BYTES {
            return Err(invalid(
                "keeper DID entries",
                format!(
                    "{} bytes, max {MAX_KEEPER_CHAIN_BYTES}",
                    m.did_entries.len()
                ),
            ));
        }
        if m.epoch_grants.len() > MAX_KEEPER_GRANTS {
            return Err(invalid(
                "keeper epoch grants",
                format!("{}, max {MAX_KEEPER_GRANTS}", m.epoch_grants.len()),
            ));
        }
        if let Some(g) = m
            .epoch_grants
            .iter()
            .find(|g| g.is_empty() || g.len() > crate::MAX_EPOCH_GRANT_BYTES)
        {
            return Err(invalid(
                "keeper epoch grant",
                format!("{} bytes, 1 to {}", g.len(), crate::MAX_EPOCH_GRANT_BYTES),
            ));
        }
        Ok(Membership {
            did_entries: m.did_entries,
            epoch_grants: m.epoch_grants,
        })
    }
}

/// A device's signature on a keeper request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeeperAuth {
    pub context_id: String,
    pub timestamp_ms: u64,
    pub nonce: [u8; 16],
    pub signature: [u8; 64],
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeeperBody {
    /// Store these envelopes, all or nothing. `did_proof` is the proof of
    /// the agent's current DID document when the keeper may not hold it
    /// (else empty).
    Push {
        did_proof: Vec<u8>,
        envelopes: Vec<Envelope>,
        /// A compacted snapshot: 0, or the sequence number up to which the
        /// keeper may drop the agent's entries in the same write.
        replaces_through: u64,
        /// The pusher's chain (when the keeper may not hold it) and its
        /// current epoch grant (when the keeper may not hold that).
        membership: Membership,
    },
    /// Everything stored after `since`, up to about `max_bytes`.
    /// `have_head` and `have_epoch` (the puller's chain head hash and key
    /// epoch; empty and 0 from older devices) say what membership the
    /// batch should carry.
    Pull {
        since: u64,
        max_bytes: u32,
        have_head: String,
        have_epoch: u64,
    },
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeeperRequest {
    pub request_id: u64,
    pub agent_did: String,
    pub auth: KeeperAuth,
    pub body: KeeperBody,
}

/// Why a keeper refused a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum RefusalCode {
    Malformed,
    Oversized,
    /// The keeper knows no DID log for the agent and none came with it.
    UnknownAgent,
    BadLog,
    BadAuth,
    Replayed,
    /// The request's timestamp is outside the keeper's window.
    Stale,
    UnknownKey,
    RevokedKey,
    BadEnvelopeSignature,
    /// A log or an envelope of another agent.
    ForeignAgent,
    QuotaExceeded,
    Internal,
}

impl RefusalCode {
    pub const ALL: [RefusalCode; 13] = [
        RefusalCode::Malformed,
        RefusalCode::Oversized,
        RefusalCode::UnknownAgent,
        RefusalCode::BadLog,
        RefusalCode::BadAuth,
        RefusalCode::Replayed,
        RefusalCode::Stale,
        RefusalCode::UnknownKey,
        RefusalCode::RevokedKey,
        RefusalCode::BadEnvelopeSignature,
        RefusalCode::ForeignAgent,
        RefusalCode::QuotaExceeded,
        RefusalCode::Internal,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            RefusalCode::Malformed => "malformed",
            RefusalCode::Oversized => "oversized",
            RefusalCode::UnknownAgent => "unknown_agent",
            RefusalCode::BadLog => "bad_log",
            RefusalCode::BadAuth => "bad_auth",
            RefusalCode::Replayed => "replayed",
            RefusalCode::Stale => "stale",
            RefusalCode::UnknownKey => "unknown_key",
            RefusalCode::RevokedKey => "revoked_key",
            RefusalCode::BadEnvelopeSignature => "bad_envelope_signature",
            RefusalCode::ForeignAgent => "foreign_agent",
            RefusalCode::QuotaExceeded => "quota_exceeded",
            RefusalCode::Internal => "internal",
        }
    }

    fn to_wire(self) -> u32 {
        Self::ALL.iter().position(|c| *c == self).unwrap_or(12) as u32 + 1
    }

    fn from_wire(v: u32) -> Result<Self, WireError> {
        (v as usize)
            .checked_sub(1)
            .and_then(|i| Self::ALL.get(i).copied())
            .ok_or_else(|| invalid("keeper refusal code", format!("unknown code {v}")))
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeeperResponse {
    Pushed {
        request_id: u64,
        first_seq: u64,
        last_seq: u64,
        used_bytes: u64,
        used_envelopes: u64,
        /// Usage is past 80 % of a quota.
        quota_near: bool,
    },
    Batch {
        request_id: u64,
        entries: Vec<(u64, Envelope)>,
        /// The cursor to ask from next.
        next: u64,
        more: bool,
        /// The newest sequence number the keeper holds for the agent (0:
        /// none); `None` from a keeper that does not say.
        newest: Option<u64>,
        /// The keeper's chain when its head is not the puller's, and the
        /// grants of epochs newer than the puller's.
        membership: Membership,
    },
    Refused {
        request_id: u64,
        code: RefusalCode,
        detail: String,
    },
}

impl KeeperResponse {
    pub fn request_id(&self) -> u64 {
        match self {
            KeeperResponse::Pushed { request_id, .. }
            | KeeperResponse::Batch { request_id, .. }
            | KeeperResponse::Refused { request_id, .. } => *request_id,
        }
    }
}

pub(crate) fn request_to_pb(r: &KeeperRequest) -> pb::KeeperRequest {
    let kind = match &r.body {
        KeeperBody::Push {
            did_proof,
            envelopes,
            replaces_through,
            membership,
        } => pb::keeper_request::Kind::Push(pb::KeeperPush {
            did_proof: did_proof.clone(),
            envelopes: envelopes.iter().map(envelope_to_pb).collect(),
            replaces_through: *replaces_through,
            membership: membership.to_pb(),
        }),
        KeeperBody::Pull {
            since,
            max_bytes,
            have_head,
            have_epoch,
        } => pb::keeper_request::Kind::Pull(pb::KeeperPull {
            since: *since,
            max_bytes: *max_bytes,
            have_head: have_head.clone(),
            have_epoch: *have_epoch,
        }),
    };
    pb::KeeperRequest {
        request_id: r.request_id,
        agent_did: r.agent_did.clone(),
        auth: Some(pb::KeeperAuth {
            context_id: r.auth.context_id.clone(),
            timestamp_ms: r.auth.timestamp_ms,
            nonce: r.auth.nonce.to_vec(),
            signature: r.auth.signature.to_vec(),
        }),
        kind: Some(kind),
    }
}

pub(crate) fn request_from_pb(r: pb::KeeperRequest) -> Result<KeeperRequest, WireError> {
    check_id("keeper agent did", &r.agent_did)?;
    let auth = r
        .auth
        .ok_or_else(|| invalid("keeper request", "no signature"))?;
    check_id("keeper signer", &auth.context_id)?;
    let body = match r.kind {
        None => return Err(invalid("keeper request", "no kind")),
        Some(pb::keeper_request::Kind::Push(p)) => {
            if p.envelopes.len() > MAX_PUSH_ENVELOPES {
                return Err(invalid(
                    "keeper push",
                    format!("{} envelopes, max {MAX_PUSH_ENVELOPES}", p.envelopes.len()),
                ));
            }
            if p.did_proof.len() > crate::MAX_DID_PROOF_BYTES {
                return Err(invalid(
                    "keeper push did proof",
                    format!(
                        "{} bytes, max {}",
                        p.did_proof.len(),
                        crate::MAX_DID_PROOF_BYTES
                    ),
                ));
            }
            KeeperBody::Push {
                did_proof: p.did_proof,
                envelopes: p
                    .envelopes
                    .into_iter()
                    .map(envelope_from_pb)
                    .collect::<Result<_, _>>()?,
                replaces_through: p.replaces_through,
                membership: Membership::from_pb(p.membership)?,
            }
        }
        Some(pb::keeper_request::Kind::Pull(p)) => {
            if p.have_head.len() > MAX_HEAD_BYTES {
                return Err(invalid(
                    "keeper pull head",
                    format!("{} bytes, max {MAX_HEAD_BYTES}", p.have_head.len()),
                ));
            }
            KeeperBody::Pull {
                since: p.since,
                max_bytes: p.max_bytes,
                have_head: p.have_head,
                have_epoch: p.have_epoch,
            }
        }
    };
    Ok(KeeperRequest {
        request_id: r.request_id,
        agent_did: r.agent_did,
        auth: KeeperAuth {
            context_id: auth.context_id,
            timestamp_ms: auth.timestamp_ms,
            nonce: fixed("keeper nonce", &auth.nonce)?,
            signature: fixed("keeper signature", &auth.signature)?,
        },
        body,
    })
}

pub(crate) fn response_to_pb(r: &KeeperResponse) -> pb::KeeperResponse {
    let kind = match r {
        KeeperResponse::Pushed {
            first_seq,
            last_seq,
            used_bytes,
            used_envelopes,
            quota_near,
            ..
        } => pb::keeper_response::Kind::Pushed(pb::KeeperPushed {
            first_seq: *first_seq,
            last_seq: *last_seq,
            used_bytes: *used_bytes,
            used_envelopes: *used_envelopes,
            quota_near: *quota_near,
        }),
        KeeperResponse::Batch {
            entries,
            next,
            more,
            newest,
            membership,
            ..
        } => pb::keeper_response::Kind::Batch(pb::KeeperBatch {
            newest: *newest,
            membership: membership.to_pb(),
            entries: entries
                .iter()
                .map(|(seq, e)| pb::KeeperEntry {
                    seq: *seq,
                    envelope: Some(envelope_to_pb(e)),
                })
                .collect(),
            next: *next,
            more: *more,
        }),
        KeeperResponse::Refused { code, detail, .. } => {
            pb::keeper_response::Kind::Refused(pb::KeeperRefused {
                code: code.to_wire(),
                detail: detail.clone(),
            })
        }
    };
    pb::KeeperResponse {
        request_id: r.request_id(),
        kind: Some(kind),
    }
}

pub(crate) fn response_from_pb(r: pb::KeeperResponse) -> Result<KeeperResponse, WireError> {
    let request_id = r.request_id;
    Ok(match r.kind {
        None => return Err(invalid("keeper response", "no kind")),
        Some(pb::keeper_response::Kind::Pushed(p)) => KeeperResponse::Pushed {
            request_id,
            first_seq: p.first_seq,
            last_seq: p.last_seq,
            used_bytes: p.used_bytes,
            used_envelopes: p.used_envelopes,
            quota_near: p.quota_near,
        },
        Some(pb::keeper_response::Kind::Batch(b)) => {
            if b.entries.len() > MAX_BATCH_ENTRIES {
                return Err(invalid(
                    "keeper batch",
                    format!("{} entries, max {MAX_BATCH_ENTRIES}", b.entries.len()),
                ));
            }
            let mut entries = Vec::with_capacity(b.entries.len());
            for e in b.entries {
                let env = e
                    .envelope
                    .ok_or_else(|| invalid("keeper entry", "no envelope"))?;
                entries.push((e.seq, envelope_from_pb(env)?));
            }
            KeeperResponse::Batch {
                request_id,
                entries,
                next: b.next,
                more: b.more,
                newest: b.newest,
                membership: Membership::from_pb(b.membership)?,
            }
        }
        Some(pb::keeper_response::Kind::Refused(r)) => {
            if r.detail.len() > MAX_DETAIL_BYTES {
                return Err(invalid(
                    "keeper refusal detail",
                    format!("{} bytes, max {MAX_DETAIL_BYTES}", r.detail.len()),
                ));
            }
            KeeperResponse::Refused {
                request_id,
                code: RefusalCode::from_wire(r.code)?,
                detail: r.detail,
            }
        }
    })
}

/// The protobuf encoding of one envelope, as it is stored and signed.
pub fn envelope_bytes(e: &Envelope) -> Vec<u8> {
    use prost::Message as _;
    envelope_to_pb(e).encode_to_vec()
}

/// Decodes what [`envelope_bytes`] wrote.
pub fn envelope_from_bytes(bytes: &[u8]) -> Result<Envelope, WireError> {
    use prost::Message as _;
    let e = pb::Envelope::decode(bytes).map_err(|source| WireError::Decode {
        what: "stored envelope",
        source,
    })?;
    envelope_from_pb(e)
}
