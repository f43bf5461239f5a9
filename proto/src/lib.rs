//! Wire format of nuwa-sync: the protobuf messages of `nuwa/sync.proto`, their
//! conversion into validated domain types, and length-prefixed framing with a
//! hard size cap.
//!
//! The prost-generated structs stay private to this crate: other crates see
//! only [`Frame`], [`Hello`], [`SyncPayload`] and [`Ack`], which are produced
//! by decode-validate-convert (`TryFrom`) and can therefore be trusted to be
//! within every bound listed below. This crate does no IO and knows nothing
//! about libp2p, sled or Automerge semantics (Automerge messages and changes
//! are opaque bytes here).

use nuwa_crypto::Envelope;
use prost::Message as _;

pub mod keeper;

mod pb {
    #![allow(clippy::all, missing_docs)]
    include!(concat!(env!("OUT_DIR"), "/nuwa.sync.v1.rs"));
}

/// The protocol version this build speaks in [`Hello::protocol_version`].
pub const PROTOCOL_VERSION: u32 = 2;
/// Hard cap of one frame's body on the wire; larger frames are refused before
/// they are read into memory.
pub const MAX_FRAME_BYTES: usize = 8 * 1024 * 1024;
/// Length of the big-endian length prefix in front of every frame.
pub const LENGTH_PREFIX_BYTES: usize = 4;
/// Longest container name accepted.
pub const MAX_CONTAINER_NAME_BYTES: usize = 256;
/// Most changes in one [`SyncPayload::Delta`].
pub const MAX_CHANGES_PER_DELTA: usize = 16 * 1024;
/// Most containers in one [`SyncPayload::Heads`].
pub const MAX_CONTAINERS_PER_SUMMARY: usize = 4096;
/// Most parts in one [`SyncPayload::Reconcile`].
pub const MAX_RANGE_PARTS: usize = 1024;
/// Most heads listed for one container.
pub const MAX_HEADS_PER_CONTAINER: usize = 256;
/// Largest DID proof carried in a [`Hello`] or a keeper push
/// (`nuwa_identity::chain::MAX_PROOF_BYTES`).
pub const MAX_DID_PROOF_BYTES: usize = 64 * 1024;
/// Largest page of DID chain entries in one [`Frame::DidEntries`].
pub const MAX_DID_ENTRIES_BYTES: usize = 2 * 1024 * 1024;
/// Longest DID or context id string accepted.
pub const MAX_ID_BYTES: usize = 512;
/// Longest device name in a [`Hello`].
pub const MAX_DEVICE_NAME_BYTES: usize = 64;
/// Largest epoch grant carried in a [`Hello`].
pub const MAX_EPOCH_GRANT_BYTES: usize = 64 * 1024;
/// Largest removal evidence carried in a [`Hello`].
pub const MAX_REMOVAL_EVIDENCE_BYTES: usize = 64 * 1024;
/// Largest body of a [`Frame::Pairing`] step (a grant carries the DID log).
pub const MAX_PAIRING_BODY_BYTES: usize = 5 * 1024 * 1024;
/// Longest reason string in an [`Ack`].
pub const MAX_REASON_BYTES: usize = 512;

/// Why bytes from the wire were refused.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum WireError {
    #[error("frame of {len} bytes exceeds the cap of {max} bytes")]
    TooLarge { len: usize, max: usize },
    #[error("malformed protobuf in {what}: {source}")]
    Decode {
        what: &'static str,
        #[source]
        source: prost::DecodeError,
    },
    #[error("invalid {what}: {reason}")]
    Invalid { what: &'static str, reason: String },
}

fn invalid(what: &'static str, reason: impl Into<String>) -> WireError {
    WireError::Invalid {
        what,
        reason: reason.into(),
    }
}

/// The unencrypted first message of a connection (see `sync.proto`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hello {
    pub protocol_version: u32,
    pub agent_did: String,
    pub context_id: String,
    /// Human-readable device name (may be empty).
    pub device_name: String,
    /// Canonical JSON of the sender's `DidProof`.
    pub did_proof: Vec<u8>,
    /// Encoded epoch grant of the sender's current epoch; empty at epoch 0.
    pub epoch_grant: Vec<u8>,
    /// Entries of lost DID branches that remove a device the sender's
    /// chain lists (strong removal); almost always empty.
    pub removal_evidence: Vec<u8>,
    pub timestamp_ms: u64,
    pub nonce: [u8; 16],
    pub signature: [u8; 64],
}

impl Hello {
    /// Domain separator of the Hello signature (NIP-2 style).
    pub const DOMAIN: &'static str = "NUWA_SYNC_HELLO_V1:";

    /// The bytes the sender signs: every field but the signature, each
    /// length-prefixed so that no two field tuples share an encoding.
    pub fn signing_content(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(64 + self.did_proof.len());
        out.extend_from_slice(&self.protocol_version.to_be_bytes());
        for field in [
            self.agent_did.as_bytes(),
            self.context_id.as_bytes(),
            self.device_name.as_bytes(),
            &self.did_proof,
            &self.epoch_grant,
        ] {
            out.extend_from_slice(&(field.len() as u64).to_be_bytes());
            out.extend_from_slice(field);
        }
        out.extend_from_slice(&self.timestamp_ms.to_be_bytes());
        out.extend_from_slice(&self.nonce);
        if !self.removal_evidence.is_empty() {
            // Only when present: a Hello without evidence signs exactly as
            // before, so older peers check it.
            out.extend_from_slice(&(self.removal_evidence.len() as u64).to_be_bytes());
            out.extend_from_slice(&self.removal_evidence);
        }
        out
    }
}

/// One request on `/nuwa/sync/1`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Frame {
    Hello(Hello),
    Envelope(Envelope),
    /// A device's request to a keeper (see [`keeper`]).
    KeeperRequest(Box<keeper::KeeperRequest>),
    /// A keeper's answer.
    KeeperResponse(Box<keeper::KeeperResponse>),
    /// Asks for the DID chain's entries from `from_seq` on.
    DidEntriesRequest {
        from_seq: u64,
    },
    /// A page of DID chain entries (a JSON array), from `from_seq` on.
    DidEntries {
        from_seq: u64,
        entries_json: Vec<u8>,
        more: bool,
    },
    /// A step of pairing a new device; see `sync.proto`.
    Pairing {
        step: PairingStep,
        body: Vec<u8>,
    },
}

/// The steps of [`Frame::Pairing`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PairingStep {
    Offer,
    JoinRequest,
    ApproverConfirm,
    JoinerConfirm,
    Grant,
    Done,
    Abort,
}

impl PairingStep {
    fn to_pb(self) -> pb::pairing::Step {
        use pb::pairing::Step;
        match self {
            PairingStep::Offer => Step::Offer,
            PairingStep::JoinRequest => Step::JoinRequest,
            PairingStep::ApproverConfirm => Step::ApproverConfirm,
            PairingStep::JoinerConfirm => Step::JoinerConfirm,
            PairingStep::Grant => Step::Grant,
            PairingStep::Done => Step::Done,
            PairingStep::Abort => Step::Abort,
        }
    }

    fn from_pb(step: i32) -> Result<Self, WireError> {
        use pb::pairing::Step;
        Ok(match Step::try_from(step) {
            Ok(Step::Offer) => PairingStep::Offer,
            Ok(Step::JoinRequest) => PairingStep::JoinRequest,
            Ok(Step::ApproverConfirm) => PairingStep::ApproverConfirm,
            Ok(Step::JoinerConfirm) => PairingStep::JoinerConfirm,
            Ok(Step::Grant) => PairingStep::Grant,
            Ok(Step::Done) => PairingStep::Done,
            Ok(Step::Abort) => PairingStep::Abort,
            Ok(Step::Unspecified) | Err(_) => {
                return Err(invalid("pairing step", format!("unknown step {step}")));
            }
        })
    }
}

/// The plaintext carried inside an [`Envelope`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SyncPayload {
    /// One Automerge sync-protocol message for `container`.
    Sync { container: String, message: Vec<u8> },
    /// Raw Automerge changes for `container`, pushed live.
    Delta {
        container: String,
        changes: Vec<Vec<u8>>,
    },
    /// The sender's heads per container (the anti-entropy summary of
    /// earlier versions; still understood, no longer sent).
    Heads(Vec<ContainerHeads>),
    /// Raw changes of several containers, pushed live (a flush that
    /// touched many containers).
    Deltas(Vec<(String, Vec<Vec<u8>>)>),
    /// Anti-entropy: one fingerprint over all (container, heads) pairs.
    Digest { fingerprint: [u8; 16], count: u32 },
    /// Range-based set reconciliation, when digests differ.
    Reconcile(Vec<RangePart>),
}

/// One range of container names in a [`SyncPayload::Reconcile`]:
/// `lower` inclusive (`""` is the start), `upper` exclusive (`None` is the
/// end).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RangePart {
    pub lower: String,
    pub upper: Option<String>,
    pub body: RangeBody,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RangeBody {
    /// The fingerprint of the sender's (container, heads) pairs in range.
    Fingerprint { fingerprint: [u8; 16], count: u32 },
    /// Every container the sender holds in range, with its heads.
    Items(Vec<ContainerHeads>),
}

/// Heads of one container.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ContainerHeads {
    pub container: String,
    pub heads: Vec<[u8; 32]>,
    /// How many changes the sender holds (0: not said).
    pub changes: u64,
}

/// The response to every frame: a receipt with a status code.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ack {
    pub code: AckCode,
    pub reason: String,
}

/// Status of an [`Ack`]. Unknown codes from newer peers decode as `Rejected`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AckCode {
    Ok,
    Rejected,
}

impl Ack {
    pub fn ok() -> Self {
        Ack {
            code: AckCode::Ok,
            reason: String::new(),
        }
    }

    pub fn rejected(reason: impl Into<String>) -> Self {
        let mut reason = reason.into();
        truncate_utf8(&mut reason, MAX_REASON_BYTES);
        Ack {
            code: AckCode::Rejected,
            reason,
        }
    }
}

fn truncate_utf8(s: &mut String, max: usize) {
    if s.len() > max {
        let mut cut = max;
        while !s.is_char_boundary(cut) {
            cut -= 1;
        }
        s.truncate(cut);
    }
}

fn check_id(what: &'static str, s: &str) -> Result<(), WireError> {
    if s.is_empty() {
        return Err(invalid(what, "empty"));
    }
    if s.len() > MAX_ID_BYTES {
        return Err(invalid(
            what,
            format!("{} bytes, max {MAX_ID_BYTES}", s.len()),
        ));
    }
    Ok(())
}

fn check_container(name: &str) -> Result<(), WireError> {
    if name.is_empty() {
        return Err(invalid("container name", "empty"));
    }
    if name.len() > MAX_CONTAINER_NAME_BYTES {
        return Err(invalid(
            "container name",
            format!("{} bytes, max {MAX_CONTAINER_NAME_BYTES}", name.len()),
        ));
    }
    Ok(())
}

fn fixed<const N: usize>(what: &'static str, bytes: &[u8]) -> Result<[u8; N], WireError> {
    bytes
        .try_into()
        .map_err(|_| invalid(what, format!("{} bytes, expected {N}", bytes.len())))
}

/// Checks a frame length read from the prefix before its body is read.
pub fn check_frame_len(len: usize) -> Result<(), WireError> {
    if len > MAX_FRAME_BYTES {
        return Err(WireError::TooLarge {
            len,
            max: MAX_FRAME_BYTES,
        });
    }
    Ok(())
}

/// Prefixes `body` with its big-endian u32 length.
pub fn length_prefixed(body: &[u8]) -> Result<Vec<u8>, WireError> {
    check_frame_len(body.len())?;
    let mut out = Vec::with_capacity(LENGTH_PREFIX_BYTES + body.len());
    out.extend_from_slice(&(body.len() as u32).to_be_bytes());
    out.extend_from_slice(body);
    Ok(out)
}

/// One frame body and the bytes after it.
pub type Split<'a> = (&'a [u8], &'a [u8]);

/// Splits one length-prefixed frame off the front of `buf`. Returns
/// `Ok(None)` when `buf` does not yet hold a whole frame.
pub fn split_frame(buf: &[u8]) -> Result<Option<Split<'_>>, WireError> {
    let Some(prefix) = buf.get(..LENGTH_PREFIX_BYTES) else {
        return Ok(None);
    };
    let len = u32::from_be_bytes(fixed::<4>("length prefix", prefix)?) as usize;
    check_frame_len(len)?;
    let rest = &buf[LENGTH_PREFIX_BYTES..];
    if rest.len() < len {
        return Ok(None);
    }
    Ok(Some(rest.split_at(len)))
}

impl Frame {
    /// Encodes the frame body (without the length prefix).
    pub fn encode(&self) -> Vec<u8> {
        let kind = match self {
            Frame::Hello(h) => pb::frame::Kind::Hello(pb::Hello {
                protocol_version: h.protocol_version,
                agent_did: h.agent_did.clone(),
                context_id: h.context_id.clone(),
                device_name: h.device_name.clone(),
                did_proof: h.did_proof.clone(),
                epoch_grant: h.epoch_grant.clone(),
                removal_evidence: h.removal_evidence.clone(),
                timestamp_ms: h.timestamp_ms,
                nonce: h.nonce.to_vec(),
                signature: h.signature.to_vec(),
            }),
            Frame::Envelope(e) => pb::frame::Kind::Envelope(envelope_to_pb(e)),
            Frame::KeeperRequest(r) => pb::frame::Kind::KeeperRequest(keeper::request_to_pb(r)),
            Frame::KeeperResponse(r) => pb::frame::Kind::KeeperResponse(keeper::response_to_pb(r)),
            Frame::DidEntriesRequest { from_seq } => {
                pb::frame::Kind::DidEntriesRequest(pb::DidEntriesRequest {
                    from_seq: *from_seq,
                })
            }
            Frame::DidEntries {
                from_seq,
                entries_json,
                more,
            } => pb::frame::Kind::DidEntries(pb::DidEntries {
                from_seq: *from_seq,
                entries_json: entries_json.clone(),
                more: *more,
            }),
            Frame::Pairing { step, body } => pb::frame::Kind::Pairing(pb::Pairing {
                step: step.to_pb() as i32,
                body: body.clone(),
            }),
        };
        pb::Frame { kind: Some(kind) }.encode_to_vec()
    }

    /// Decodes and validates a frame body.
    pub fn decode(body: &[u8]) -> Result<Frame, WireError> {
        check_frame_len(body.len())?;
        let frame = pb::Frame::decode(body).map_err(|source| WireError::Decode {
            what: "frame",
            source,
        })?;
        match frame.kind {
            None => Err(invalid("frame", "no message kind")),
            Some(pb::frame::Kind::Hello(h)) => Ok(Frame::Hello(h.try_into()?)),
            Some(pb::frame::Kind::Envelope(e)) => Ok(Frame::Envelope(envelope_from_pb(e)?)),
            Some(pb::frame::Kind::KeeperRequest(r)) => {
                Ok(Frame::KeeperRequest(Box::new(keeper::request_from_pb(r)?)))
            }
            Some(pb::frame::Kind::KeeperResponse(r)) => Ok(Frame::KeeperResponse(Box::new(
                keeper::response_from_pb(r)?,
            ))),
            Some(pb::frame::Kind::DidEntriesRequest(r)) => Ok(Frame::DidEntriesRequest {
                from_seq: r.from_seq,
            }),
            Some(pb::frame::Kind::DidEntries(d)) => {
                if d.entries_json.len() > MAX_DID_ENTRIES_BYTES {
                    return Err(invalid(
                        "did entries",
                        format!(
                            "{} bytes, max {MAX_DID_ENTRIES_BYTES}",
                            d.entries_json.len()
                        ),
                    ));
                }
                Ok(Frame::DidEntries {
                    from_seq: d.from_seq,
                    entries_json: d.entries_json,
                    more: d.more,
                })
            }
            Some(pb::frame::Kind::Pairing(p)) => {
                if p.body.len() > MAX_PAIRING_BODY_BYTES {
                    return Err(invalid(
                        "pairing body",
                        format!("{} bytes, max {MAX_PAIRING_BODY_BYTES}", p.body.len()),
                    ));
                }
                Ok(Frame::Pairing {
                    step: PairingStep::from_pb(p.step)?,
                    body: p.body,
                })
            }
        }
    }
}

impl TryFrom<pb::Hello> for Hello {
    type Error = WireError;

    fn try_from(h: pb::Hello) -> Result<Self, WireError> {
        check_id("hello agent did", &h.agent_did)?;
        check_id("hello context id", &h.context_id)?;
        if h.device_name.len() > MAX_DEVICE_NAME_BYTES {
            return Err(invalid(
                "hello device name",
                format!("{} bytes, max {MAX_DEVICE_NAME_BYTES}", h.device_name.len()),
            ));
        }
        if h.did_proof.len() > MAX_DID_PROOF_BYTES {
            return Err(invalid(
                "hello did proof",
                format!("{} bytes, max {MAX_DID_PROOF_BYTES}", h.did_proof.len()),
            ));
        }
        if h.epoch_grant.len() > MAX_EPOCH_GRANT_BYTES {
            return Err(invalid(
                "hello epoch grant",
                format!("{} bytes, max {MAX_EPOCH_GRANT_BYTES}", h.epoch_grant.len()),
            ));
        }
        if h.removal_evidence.len() > MAX_REMOVAL_EVIDENCE_BYTES {
            return Err(invalid(
                "hello removal evidence",
                format!(
                    "{} bytes, max {MAX_REMOVAL_EVIDENCE_BYTES}",
                    h.removal_evidence.len()
                ),
            ));
        }
        Ok(Hello {
            protocol_version: h.protocol_version,
            agent_did: h.agent_did,
            context_id: h.context_id,
            device_name: h.device_name,
            did_proof: h.did_proof,
            epoch_grant: h.epoch_grant,
            removal_evidence: h.removal_evidence,
            timestamp_ms: h.timestamp_ms,
            nonce: fixed("hello nonce", &h.nonce)?,
            signature: fixed("hello signature", &h.signature)?,
        })
    }
}

fn envelope_to_pb(e: &Envelope) -> pb::Envelope {
    pb::Envelope {
        sender: e.sender.clone(),
        epoch: e.epoch,
        timestamp_ms: e.timestamp_ms,
        nonce: e.nonce.to_vec(),
        ciphertext: e.ciphertext.clone(),
        signature: e.signature.to_vec(),
    }
}

fn envelope_from_pb(e: pb::Envelope) -> Result<Envelope, WireError> {
    check_id("envelope sender", &e.sender)?;
    Ok(Envelope {
        sender: e.sender,
        epoch: e.epoch,
        timestamp_ms: e.timestamp_ms,
        nonce: fixed("envelope nonce", &e.nonce)?,
        ciphertext: e.ciphertext,
        signature: fixed("envelope signature", &e.signature)?,
    })
}

impl SyncPayload {
    pub fn encode(&self) -> Vec<u8> {
        let kind = match self {
            SyncPayload::Sync { container, message } => {
                pb::sync_payload::Kind::Sync(pb::AutomergeSync {
                    container: container.clone(),
                    message: message.clone(),
                })
            }
            SyncPayload::Delta { container, changes } => pb::sync_payload::Kind::Delta(pb::Delta {
                container: container.clone(),
                changes: changes.clone(),
            }),
            SyncPayload::Heads(containers) => pb::sync_payload::Kind::Heads(pb::HeadsSummary {
                containers: containers.iter().map(encode_heads).collect(),
            }),
            SyncPayload::Digest { fingerprint, count } => {
                pb::sync_payload::Kind::Digest(pb::Digest {
                    fingerprint: fingerprint.to_vec(),
                    count: *count,
                })
            }
            SyncPayload::Deltas(list) => pb::sync_payload::Kind::Deltas(pb::Deltas {
                deltas: list
                    .iter()
                    .map(|(container, changes)| pb::Delta {
                        container: container.clone(),
                        changes: changes.clone(),
                    })
                    .collect(),
            }),
            SyncPayload::Reconcile(parts) => pb::sync_payload::Kind::Reconcile(pb::Reconcile {
                parts: parts.iter().map(encode_part).collect(),
            }),
        };
        pb::SyncPayload { kind: Some(kind) }.encode_to_vec()
    }

    pub fn decode(bytes: &[u8]) -> Result<SyncPayload, WireError> {
        check_frame_len(bytes.len())?;
        let payload = pb::SyncPayload::decode(bytes).map_err(|source| WireError::Decode {
            what: "sync payload",
            source,
        })?;
        match payload.kind {
            None => Err(invalid("sync payload", "no message kind")),
            Some(pb::sync_payload::Kind::Sync(s)) => {
                check_container(&s.container)?;
                Ok(SyncPayload::Sync {
                    container: s.container,
                    message: s.message,
                })
            }
            Some(pb::sync_payload::Kind::Delta(d)) => {
                check_delta(&d, d.changes.len())?;
                Ok(SyncPayload::Delta {
                    container: d.container,
                    changes: d.changes,
                })
            }
            Some(pb::sync_payload::Kind::Deltas(list)) => {
                if list.deltas.len() > MAX_CONTAINERS_PER_SUMMARY {
                    return Err(invalid(
                        "deltas",
                        format!(
                            "{} containers, max {MAX_CONTAINERS_PER_SUMMARY}",
                            list.deltas.len()
                        ),
                    ));
                }
                let mut total = 0;
                for d in &list.deltas {
                    total += d.changes.len();
                    check_delta(d, total)?;
                }
                let mut seen = std::collections::BTreeSet::new();
                if !list
                    .deltas
                    .iter()
                    .all(|d| seen.insert(d.container.as_str()))
                {
                    return Err(invalid("deltas", "a container listed twice"));
                }
                Ok(SyncPayload::Deltas(
                    list.deltas
                        .into_iter()
                        .map(|d| (d.container, d.changes))
                        .collect(),
                ))
            }
            Some(pb::sync_payload::Kind::Heads(h)) => {
                Ok(SyncPayload::Heads(decode_heads_list(h.containers)?))
            }
            Some(pb::sync_payload::Kind::Digest(d)) => Ok(SyncPayload::Digest {
                fingerprint: fixed("digest fingerprint", &d.fingerprint)?,
                count: d.count,
            }),
            Some(pb::sync_payload::Kind::Reconcile(r)) => {
                if r.parts.len() > MAX_RANGE_PARTS {
                    return Err(invalid(
                        "reconcile",
                        format!("{} parts, max {MAX_RANGE_PARTS}", r.parts.len()),
                    ));
                }
                let mut items = 0usize;
                let mut parts = Vec::with_capacity(r.parts.len());
                for p in r.parts {
                    let part = decode_part(p)?;
                    if let RangeBody::Items(list) = &part.body {
                        items += list.len();
                        if items > MAX_CONTAINERS_PER_SUMMARY {
                            return Err(invalid(
                                "reconcile",
                                format!("over {MAX_CONTAINERS_PER_SUMMARY} items"),
                            ));
                        }
                    }
                    parts.push(part);
                }
                Ok(SyncPayload::Reconcile(parts))
            }
        }
    }
}

/// One delta's container and changes; `total` counts changes so far in the
/// message, which is capped like a single delta.
fn check_delta(d: &pb::Delta, total: usize) -> Result<(), WireError> {
    check_container(&d.container)?;
    if total > MAX_CHANGES_PER_DELTA {
        return Err(invalid(
            "delta",
            format!("{total} changes, max {MAX_CHANGES_PER_DELTA}"),
        ));
    }
    if d.changes.iter().any(|c| c.is_empty()) {
        return Err(invalid("delta", "empty change"));
    }
    Ok(())
}

fn encode_heads(c: &ContainerHeads) -> pb::ContainerHeads {
    pb::ContainerHeads {
        container: c.container.clone(),
        heads: c.heads.iter().map(|h| h.to_vec()).collect(),
        changes: c.changes,
    }
}

fn encode_part(p: &RangePart) -> pb::RangePart {
    pb::RangePart {
        lower: p.lower.clone(),
        upper: p.upper.clone().unwrap_or_default(),
        unbounded: p.upper.is_none(),
        body: Some(match &p.body {
            RangeBody::Fingerprint { fingerprint, count } => {
                pb::range_part::Body::Fingerprint(pb::RangeFingerprint {
                    fingerprint: fingerprint.to_vec(),
                    count: *count,
                })
            }
            RangeBody::Items(items) => pb::range_part::Body::Items(pb::RangeItems {
                items: items.iter().map(encode_heads).collect(),
            }),
        }),
    }
}

/// A range bound: a container name, or `""` for the start of the space.
fn check_bound(name: &str) -> Result<(), WireError> {
    if name.len() > MAX_CONTAINER_NAME_BYTES {
        return Err(invalid(
            "range bound",
            format!("{} bytes, max {MAX_CONTAINER_NAME_BYTES}", name.len()),
        ));
    }
    Ok(())
}

fn decode_part(p: pb::RangePart) -> Result<RangePart, WireError> {
    check_bound(&p.lower)?;
    let upper = if p.unbounded {
        None
    } else {
        check_bound(&p.upper)?;
        if p.upper <= p.lower {
            return Err(invalid("range part", "upper bound not above the lower"));
        }
        Some(p.upper)
    };
    let body = match p.body {
        None => return Err(invalid("range part", "no body")),
        Some(pb::range_part::Body::Fingerprint(f)) => RangeBody::Fingerprint {
            fingerprint: fixed("range fingerprint", &f.fingerprint)?,
            count: f.count,
        },
        Some(pb::range_part::Body::Items(i)) => {
            if i.items.len() > MAX_CONTAINERS_PER_SUMMARY {
                return Err(invalid(
                    "range items",
                    format!("{} items, max {MAX_CONTAINERS_PER_SUMMARY}", i.items.len()),
                ));
            }
            let items = decode_heads_list(i.items)?;
            let outside = items.iter().any(|c| {
                c.container < p.lower || upper.as_ref().is_some_and(|u| &c.container >= u)
            });
            if outside {
                return Err(invalid("range items", "a container outside the range"));
            }
            RangeBody::Items(items)
        }
    };
    Ok(RangePart {
        lower: p.lower,
        upper,
        body,
    })
}

fn decode_heads_list(list: Vec<pb::ContainerHeads>) -> Result<Vec<ContainerHeads>, WireError> {
    if list.len() > MAX_CONTAINERS_PER_SUMMARY {
        return Err(invalid(
            "heads summary",
            format!(
                "{} containers, max {MAX_CONTAINERS_PER_SUMMARY}",
                list.len()
            ),
        ));
    }
    let mut out = Vec::with_capacity(list.len());
    for c in list {
        check_container(&c.container)?;
        if c.heads.len() > MAX_HEADS_PER_CONTAINER {
            return Err(invalid(
                "heads summary",
                format!("{} heads, max {MAX_HEADS_PER_CONTAINER}", c.heads.len()),
            ));
        }
        let heads = c
            .heads
            .iter()
            .map(|h| fixed::<32>("change hash", h))
            .collect::<Result<Vec<_>, _>>()?;
        out.push(ContainerHeads {
            container: c.container,
            heads,
            changes: c.changes,
        });
    }
    Ok(out)
}

impl Ack {
    pub fn encode(&self) -> Vec<u8> {
        pb::Ack {
            code: match self.code {
                AckCode::Ok => 0,
                AckCode::Rejected => 1,
            },
            reason: self.reason.clone(),
        }
        .encode_to_vec()
    }

    pub fn decode(bytes: &[u8]) -> Result<Ack, WireError> {
        if bytes.len() > MAX_REASON_BYTES + 64 {
            return Err(WireError::TooLarge {
                len: bytes.len(),
                max: MAX_REASON_BYTES + 64,
            });
        }
        let ack = pb::Ack::decode(bytes).map_err(|source| WireError::Decode {
            what: "ack",
            source,
        })?;
        let mut reason = ack.reason;
        truncate_utf8(&mut reason, MAX_REASON_BYTES);
        Ok(Ack {
            code: if ack.code == 0 {
                AckCode::Ok
            } else {
                AckCode::Rejected
            },
            reason,
        })
    }
}

#[cfg(test)]
mod tests;
