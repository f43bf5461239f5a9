//! The keeper: an untrusted, always-on store-and-forward of an agent's
//! sealed envelopes, for devices that are never online at the same time.
//!
//! A device pushes the envelopes it sealed (XChaCha20-Poly1305 under the
//! agent's sync key, signed by the device); another device pulls everything
//! after its cursor and opens what its key ring opens. The keeper never
//! holds a sync key and never sees plaintext. What it checks, as a stranger
//! to the agent:
//! - the agent's DID document, from a compact proof verified against the
//!   genesis key's authority chain alone (like a DHT node), learned from the
//!   first push that carries one and replaced when a push carries a proof
//!   with a higher head seq;
//! - every request's NIP-2 style signature (device key, timestamp within a
//!   window, nonce never seen before), by a device active in the current
//!   document: a revoked device can neither push nor pull;
//! - every pushed envelope's signature, by an active device of that agent.
//!
//! Pushes are all or nothing and durable before they are acknowledged.
//! Quotas per agent (bytes and envelopes), a cap on agents, and a retention
//! time bound what one agent can take.
//!
//! What it learns: the agent's DID (as a SHA-256 key, with its DID proof,
//! which is public material published in the DHT anyway), which device
//! context ids push and pull, key epochs, sizes and times. Not container
//! names, not keys, not values.
//!
//! This crate does no IO. [`Keeper`] decides; what it keeps lives behind
//! [`KeeperStore`] ([`MemKeeperStore`] here, `nuwa_store::SledKeeperStore`
//! on disk), and the network and the threads are the caller's.

mod mem_store;
mod store;

pub use mem_store::MemKeeperStore;
pub use store::{
    AgentDoc, AgentHash, AgentRecord, AgentState, ENTRY_HEADER_BYTES, Entry, KeeperStore,
    KeeperStoreError, Page, Pushed, StoredGrant, Usage,
};

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use nuwa_crypto::Envelope;
use nuwa_identity::chain::DidProof;
use nuwa_identity::document::{DidDocument, DidError, Relationship};
use nuwa_identity::keys::{DeviceKey, verify_ed25519};
use nuwa_identity::nip2::{NonceStore, ReplayError};
use nuwa_proto::keeper::{
    KeeperAuth, KeeperBody, KeeperRequest, KeeperResponse, MAX_BATCH_ENTRIES, MAX_DETAIL_BYTES,
    MAX_KEEPER_GRANTS, Membership, RefusalCode, envelope_bytes, envelope_from_bytes,
};
use sha2::{Digest, Sha256};
use tracing::{debug, warn};

/// Domain separator of the digest a device signs for a request.
const REQUEST_DOMAIN: &[u8] = b"NUWA_KEEPER_REQUEST_V1:";
/// The relationship a device key needs to use the keeper: the one device
/// sync uses.
const RELATIONSHIP: Relationship = Relationship::Authentication;

/// Limits of a keeper.
#[derive(Debug, Clone)]
pub struct KeeperConfig {
    /// Bytes stored per agent (envelopes as encoded).
    pub max_bytes_per_agent: u64,
    /// Envelopes stored per agent.
    pub max_envelopes_per_agent: u64,
    /// Agents stored in all.
    pub max_agents: usize,
    /// Envelopes older than this (by when the keeper received them) are
    /// dropped by [`Keeper::prune`].
    pub retention: Duration,
    /// Most bytes one pull returns.
    pub max_pull_bytes: u32,
    /// A request's timestamp may be this far from the keeper's clock.
    pub clock_window: Duration,
    /// Nonces remembered per signing device (within the window).
    pub max_nonces_per_signer: usize,
    /// Signing devices whose nonces are remembered; the least recently
    /// used one is forgotten beyond this (see `NonceStore`), which makes
    /// every device's older requests stale, so size it well above the
    /// devices of all agents.
    pub max_signers: usize,
}

impl Default for KeeperConfig {
    fn default() -> Self {
        KeeperConfig {
            max_bytes_per_agent: 64 * 1024 * 1024,
            max_envelopes_per_agent: 100_000,
            max_agents: 10_000,
            retention: Duration::from_secs(30 * 24 * 3600),
            max_pull_bytes: 4 * 1024 * 1024,
            clock_window: Duration::from_secs(600),
            max_nonces_per_signer: 4096,
            max_signers: 65_536,
        }
    }
}

/// Why the keeper could not do its own work (a refused request is an
/// answer, not an error).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum KeeperError {
    /// The store failed.
    #[error(transparent)]
    Store(#[from] KeeperStoreError),
}

/// What the keeper has done, for logs and metrics.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct KeeperStats {
    pub pushes: u64,
    pub pulls: u64,
    pub envelopes_stored: u64,
    pub envelopes_served: u64,
    pub envelopes_pruned: u64,
    /// Entries dropped because a compacted snapshot replaced them.
    pub envelopes_compacted: u64,
    /// Refused requests by code.
    pub refused: BTreeMap<&'static str, u64>,
    /// Membership a push carried that was left out (entries that did not
    /// end at the proven head, grants that did not verify).
    pub membership_ignored: u64,
    pub agents: usize,
}

/// The keeper's checks and decisions, over its store. One per store; calls
/// are serialised by the caller (`&mut self`).
pub struct Keeper {
    /// Records and envelope logs; the only way to them.
    store: Box<dyn KeeperStore>,
    /// Nonces of requests whose signature verified, per (agent, device),
    /// in milliseconds. Evicted nonces turn into floors, so none is ever
    /// accepted twice while the process runs.
    nonces: NonceStore,
    /// Per (agent, device), the newest push signed before this process
    /// got its store: requests signed no later are refused (the nonces
    /// that would tell a replay were lost with the last process).
    restart_floor: HashMap<(AgentHash, String), u64>,
    config: KeeperConfig,
    stats: KeeperStats,
}

/// SHA-256 of the agent DID: the key the keeper files an agent under.
pub fn agent_hash(did: &str) -> AgentHash {
    Sha256::digest(did.as_bytes()).into()
}

fn put_field(out: &mut Vec<u8>, bytes: &[u8]) {
    out.extend_from_slice(&(bytes.len() as u64).to_be_bytes());
    out.extend_from_slice(bytes);
}

/// The digest a device signs for `req` (every field but the signature, in
/// a fixed length-prefixed order; never protobuf bytes, whose encoding is
/// not unique).
pub fn request_digest(req: &KeeperRequest) -> [u8; 32] {
    let mut m = Vec::with_capacity(256);
    m.extend_from_slice(REQUEST_DOMAIN);
    put_field(&mut m, req.agent_did.as_bytes());
    m.extend_from_slice(&req.request_id.to_be_bytes());
    put_field(&mut m, req.auth.context_id.as_bytes());
    m.extend_from_slice(&req.auth.timestamp_ms.to_be_bytes());
    m.extend_from_slice(&req.auth.nonce);
    match &req.body {
        KeeperBody::Push {
            did_proof,
            envelopes,
            replaces_through,
            membership,
        } => {
            m.push(1);
            m.extend_from_slice(&replaces_through.to_be_bytes());
            put_field(&mut m, did_proof);
            m.extend_from_slice(&(envelopes.len() as u64).to_be_bytes());
            let mut h = Sha256::new();
            for e in envelopes {
                let b = envelope_bytes(e);
                h.update((b.len() as u64).to_be_bytes());
                h.update(&b);
            }
            m.extend_from_slice(&h.finalize());
            // Signed only when present, so a request of an older device
            // keeps its digest.
            if !membership.is_empty() {
                put_field(&mut m, &membership.did_entries);
                m.extend_from_slice(&(membership.epoch_grants.len() as u64).to_be_bytes());
                for g in &membership.epoch_grants {
                    put_field(&mut m, g);
                }
            }
        }
        KeeperBody::Pull {
            since,
            max_bytes,
            have_head,
            have_epoch,
        } => {
            m.push(2);
            m.extend_from_slice(&since.to_be_bytes());
            m.extend_from_slice(&max_bytes.to_be_bytes());
            if !have_head.is_empty() {
                put_field(&mut m, have_head.as_bytes());
                m.extend_from_slice(&have_epoch.to_be_bytes());
            }
        }
    }
    Sha256::digest(&m).into()
}

/// A request signed by `device` (known in the agent's DID document as
/// `context_id`), for the client side.
pub fn sign_request(
    device: &DeviceKey,
    context_id: &str,
    agent_did: &str,
    request_id: u64,
    body: KeeperBody,
    now_ms: u64,
) -> Result<KeeperRequest, nuwa_entropy::Error> {
    let mut nonce = [0u8; 16];
    nuwa_entropy::fill(&mut nonce)?;
    let mut req = KeeperRequest {
        request_id,
        agent_did: agent_did.to_owned(),
        auth: KeeperAuth {
            context_id: context_id.to_owned(),
            timestamp_ms: now_ms,
            nonce,
            signature: [0u8; 64],
        },
        body,
    };
    req.auth.signature = device.sign(&request_digest(&req));
    Ok(req)
}

struct Refusal(RefusalCode, String);

fn refuse(code: RefusalCode, detail: impl Into<String>) -> Refusal {
    let mut d: String = detail.into();
    if d.len() > MAX_DETAIL_BYTES {
        let mut cut = MAX_DETAIL_BYTES;
        while !d.is_char_boundary(cut) {
            cut -= 1;
        }
        d.truncate(cut);
    }
    Refusal(code, d)
}

/// Most context ids [`AgentDoc::ever_listed`] remembers.
const MAX_EVER_LISTED: usize = 4096;

/// The doc a verified proof establishes, remembering what `before` listed.
/// The keeper follows the proof with the highest head seq; a proof of the
/// same or a lower seq does not replace it (the caller's check).
fn doc_from_proof(
    proof: nuwa_identity::chain::VerifiedProof,
    before: Option<&AgentDoc>,
) -> AgentDoc {
    let mut ever_listed = before.map(|b| b.ever_listed.clone()).unwrap_or_default();
    let document = proof.document().clone();
    for id in document.relationship(RELATIONSHIP) {
        if ever_listed.len() >= MAX_EVER_LISTED {
            break;
        }
        ever_listed.insert(DidDocument::fragment(id).to_owned());
    }
    let (chain, chain_head, grants) = before
        .map(|b| (b.chain.clone(), b.chain_head.clone(), b.grants.clone()))
        .unwrap_or_default();
    AgentDoc {
        head_seq: proof.head_seq(),
        head_hash: proof.head_hash().to_owned(),
        document,
        ever_listed,
        chain,
        chain_head,
        grants,
    }
}

/// Takes what a push carries of the agent's membership into `log`:
/// entries whose head is the proof `log` follows, and grants signed by a
/// key that may open epochs in `log`'s document, keeping the newest
/// [`MAX_KEEPER_GRANTS`]. What does not fit is left out, not refused (a
/// device behind another's proof still pushes its envelopes); devices
/// check everything again when they take it. Returns what was left out.
fn take_membership(log: &mut AgentDoc, m: &Membership, did: &str, now_secs: i64) -> u64 {
    let mut ignored = 0;
    if !m.did_entries.is_empty() {
        let head = serde_json::from_slice::<Vec<nuwa_identity::chain::DidEntry>>(&m.did_entries)
            .ok()
            .filter(|e| e.first().is_some_and(|f| f.seq() == 1))
            .and_then(|e| e.last().and_then(|l| l.hash().ok()));
        match (head, std::str::from_utf8(&m.did_entries)) {
            (Some(head), Ok(text)) if head == log.head_hash => {
                log.chain = text.to_owned();
                log.chain_head = head;
            }
            _ => ignored += 1,
        }
    }
    for bytes in &m.epoch_grants {
        let Some(epoch) = checked_grant_epoch(&log.document, bytes, did, now_secs) else {
            ignored += 1;
            continue;
        };
        if log.grants.iter().any(|g| g.bytes == *bytes) {
            continue;
        }
        log.grants.push(StoredGrant {
            epoch,
            bytes: bytes.clone(),
        });
        log.grants.sort_by_key(|g| g.epoch);
        while log.grants.len() > MAX_KEEPER_GRANTS {
            log.grants.remove(0);
        }
    }
    ignored
}

/// The epoch of a grant for `did` whose issuer may open epochs in `doc`
/// and whose signature verifies.
fn checked_grant_epoch(doc: &DidDocument, bytes: &[u8], did: &str, now_secs: i64) -> Option<u64> {
    let grant = nuwa_crypto::epoch::EpochGrant::decode(bytes).ok()?;
    if grant.agent_did != did {
        return None;
    }
    let issuer = doc
        .key_for(
            &doc.key_id(&grant.issuer_context_id),
            Relationship::CapabilityDelegation,
            now_secs,
        )
        .ok()?;
    grant.verify(&issuer).ok()?;
    Some(grant.epoch)
}

/// What a pull's batch carries of the agent's membership: the chain when
/// its head is not the puller's, and grants of epochs newer than the
/// puller's. Nothing for an older device, which names no head.
fn membership_for(log: &AgentDoc, have_head: &str, have_epoch: u64) -> Membership {
    if have_head.is_empty() {
        return Membership::default();
    }
    Membership {
        did_entries: if log.chain_head != have_head {
            log.chain.as_bytes().to_vec()
        } else {
            Vec::new()
        },
        epoch_grants: log
            .grants
            .iter()
            .filter(|g| g.epoch > have_epoch)
            .map(|g| g.bytes.clone())
            .collect(),
    }
}

/// The active key of `context_id` in the agent's current document, or why
/// there is none: a key an earlier version listed was revoked.
fn active_key(log: &AgentDoc, context_id: &str, now_secs: i64) -> Result<[u8; 32], Refusal> {
    let doc: &DidDocument = &log.document;
    match doc.key_for(&doc.key_id(context_id), RELATIONSHIP, now_secs) {
        Ok(k) => Ok(k),
        Err(DidError::KeyNotFound { .. }) => {
            let listed_before = log.ever_listed.contains(context_id);
            if listed_before {
                Err(refuse(
                    RefusalCode::RevokedKey,
                    format!("device {context_id} was revoked"),
                ))
            } else {
                Err(refuse(
                    RefusalCode::UnknownKey,
                    format!("device {context_id} is not in the agent's DID document"),
                ))
            }
        }
        Err(e) => Err(refuse(RefusalCode::RevokedKey, e.to_string())),
    }
}

impl Keeper {
    /// The keeper over `store`, which may hold agents already (a restart):
    /// each device's last push recorded there becomes the floor its next
    /// request must be signed after.
    pub fn new(store: Box<dyn KeeperStore>, config: KeeperConfig) -> Keeper {
        let mut restart_floor = HashMap::new();
        for hash in store.agent_hashes() {
            if let Some(state) = store.agent(&hash) {
                for (signer, ts) in state.record.last_push_ms {
                    restart_floor.insert((hash, signer), ts);
                }
            }
        }
        let stats = KeeperStats {
            agents: store.agent_count(),
            ..KeeperStats::default()
        };
        Keeper {
            nonces: NonceStore::new(
                config.clock_window.as_millis() as i64,
                config.max_nonces_per_signer,
                config.max_signers,
            ),
            store,
            restart_floor,
            config,
            stats,
        }
    }

    /// Gives the store back, forgetting the nonces and counters (a
    /// [`Keeper::new`] on it is a restart).
    pub fn into_store(self) -> Box<dyn KeeperStore> {
        self.store
    }

    pub fn stats(&self) -> KeeperStats {
        self.stats.clone()
    }

    /// Bytes and envelopes stored for the agent `did`.
    pub fn usage(&self, did: &str) -> Option<(u64, u64)> {
        self.store
            .agent(&agent_hash(did))
            .map(|a| (a.usage.bytes, a.usage.envelopes))
    }

    /// Answers one request. A refusal is an answer (typed, counted), never
    /// a panic; an acknowledged push is durable.
    pub fn handle(&mut self, req: KeeperRequest, now_ms: u64) -> KeeperResponse {
        let request_id = req.request_id;
        match self.handle_inner(req, now_ms) {
            Ok(r) => r,
            Err(Refusal(code, detail)) => {
                *self.stats.refused.entry(code.as_str()).or_default() += 1;
                debug!(code = code.as_str(), %detail, "keeper request refused");
                KeeperResponse::Refused {
                    request_id,
                    code,
                    detail,
                }
            }
        }
    }

    fn handle_inner(&mut self, req: KeeperRequest, now_ms: u64) -> Result<KeeperResponse, Refusal> {
        let now_secs = (now_ms / 1000) as i64;
        let hash = agent_hash(&req.agent_did);
        // The log to check against: the stored one, extended by the one
        // carried (verified from its genesis alone), or the carried one for
        // an agent we do not know yet. Nothing is stored before the request
        // passed every check.
        let carried = match &req.body {
            KeeperBody::Push { did_proof, .. } if !did_proof.is_empty() => {
                let proof = DidProof::decode(did_proof)
                    .map_err(|e| refuse(RefusalCode::BadLog, e.to_string()))?;
                if proof.document().id != req.agent_did {
                    return Err(refuse(
                        RefusalCode::ForeignAgent,
                        "the DID proof is another agent's",
                    ));
                }
                let verified = proof
                    .verify(&req.agent_did, now_secs)
                    .map_err(|e| refuse(RefusalCode::BadLog, e.to_string()))?;
                Some(verified)
            }
            _ => None,
        };
        let stored = self.store.agent(&hash);
        let known = stored.as_ref().and_then(|a| a.record.doc.clone());
        // Only a push carries a proof, and a push writes the record, so a
        // newer log is stored with the push that brought it.
        let log = match (known, carried) {
            (Some(ours), Some(theirs)) => {
                if theirs.head_seq() > ours.head_seq {
                    doc_from_proof(theirs, Some(&ours))
                } else {
                    ours
                }
            }
            (Some(ours), None) => ours,
            (None, Some(theirs)) if stored.is_some() => doc_from_proof(theirs, None),
            (None, Some(theirs)) => {
                if self.store.agent_count() >= self.config.max_agents {
                    return Err(refuse(
                        RefusalCode::QuotaExceeded,
                        format!(
                            "this keeper holds its maximum of {} agents",
                            self.config.max_agents
                        ),
                    ));
                }
                doc_from_proof(theirs, None)
            }
            (None, None) => {
                return Err(refuse(
                    RefusalCode::UnknownAgent,
                    "this keeper does not know the agent; push its DID proof first",
                ));
            }
        };

        // The signer: active now, fresh, signature, then the nonce.
        let auth = &req.auth;
        let signer = active_key(&log, &auth.context_id, now_secs)?;
        let window = self.config.clock_window.as_millis() as u64;
        if auth.timestamp_ms.abs_diff(now_ms) > window {
            return Err(refuse(
                RefusalCode::Stale,
                format!(
                    "request signed at {} ms, {} ms from the keeper's clock (window {window} ms)",
                    auth.timestamp_ms,
                    auth.timestamp_ms.abs_diff(now_ms)
                ),
            ));
        }
        verify_ed25519(&signer, &request_digest(&req), &auth.signature).map_err(|_| {
            refuse(
                RefusalCode::BadAuth,
                "the request signature does not verify",
            )
        })?;
        self.check_nonce(
            hash,
            &req.agent_did,
            &auth.context_id,
            auth.nonce,
            auth.timestamp_ms,
            now_ms,
        )?;

        self.answer(req, hash, stored, log, now_ms)
    }

    /// What a request that passed every check gets: a push stored (with
    /// what it carries of the agent's membership), or a page pulled.
    fn answer(
        &mut self,
        req: KeeperRequest,
        hash: AgentHash,
        stored: Option<AgentState>,
        log: AgentDoc,
        now_ms: u64,
    ) -> Result<KeeperResponse, Refusal> {
        let now_secs = (now_ms / 1000) as i64;
        match req.body {
            KeeperBody::Push {
                envelopes,
                replaces_through,
                membership,
                ..
            } => {
                let mut log = log;
                self.stats.membership_ignored +=
                    take_membership(&mut log, &membership, &req.agent_did, now_secs);
                self.push(
                    hash,
                    &req.agent_did,
                    stored,
                    log,
                    envelopes,
                    replaces_through,
                    now_ms,
                    (&req.auth.context_id, req.auth.timestamp_ms),
                    req.request_id,
                )
            }
            KeeperBody::Pull {
                since,
                max_bytes,
                have_head,
                have_epoch,
            } => {
                let membership = membership_for(&log, &have_head, have_epoch);
                self.pull(hash, since, max_bytes, membership, req.request_id)
            }
        }
    }

    /// Records the nonce of a request whose signature verified, or refuses
    /// it as a replay.
    fn check_nonce(
        &mut self,
        hash: AgentHash,
        did: &str,
        signer: &str,
        nonce: [u8; 16],
        ts: u64,
        now_ms: u64,
    ) -> Result<(), Refusal> {
        if let Some(floor) = self.restart_floor.get(&(hash, signer.to_owned()))
            && ts <= *floor
        {
            return Err(refuse(
                RefusalCode::Replayed,
                format!(
                    "request signed at {ts} ms, not after this device's last push ({floor} ms) before the keeper restarted; sign it again"
                ),
            ));
        }
        // The keeper's own window check came first, so a stale answer here
        // means a floor: a nonce that was forgotten, possibly this one.
        let ts_i = i64::try_from(ts).unwrap_or(i64::MAX);
        let now_i = i64::try_from(now_ms).unwrap_or(i64::MAX);
        self.nonces
            .record(did, signer, &nonce, ts_i, now_i)
            .map_err(|e| match e {
                ReplayError::Replayed | ReplayError::Stale { .. } => refuse(
                    RefusalCode::Replayed,
                    format!("this request may have been seen before ({e}); sign it again"),
                ),
                ReplayError::FromFuture { .. } => refuse(RefusalCode::Stale, e.to_string()),
                _ => refuse(RefusalCode::Malformed, e.to_string()),
            })
    }

    #[allow(clippy::too_many_arguments)]
    fn push(
        &mut self,
        hash: AgentHash,
        did: &str,
        stored: Option<AgentState>,
        log: AgentDoc,
        envelopes: Vec<Envelope>,
        replaces_through: u64,
        now_ms: u64,
        (signer, signed_ms): (&str, u64),
        request_id: u64,
    ) -> Result<KeeperResponse, Refusal> {
        let now_secs = (now_ms / 1000) as i64;
        let mut entries = Vec::with_capacity(envelopes.len());
        let mut bytes = 0u64;
        for e in &envelopes {
            let key = active_key(&log, &e.sender, now_secs)?;
            nuwa_crypto::verify_envelope(e, &key, did).map_err(|_| {
                refuse(
                    RefusalCode::BadEnvelopeSignature,
                    format!("an envelope from {} does not verify", e.sender),
                )
            })?;
            let entry = Entry {
                received_ms: now_ms,
                envelope: envelope_bytes(e),
            };
            bytes += entry.size();
            entries.push(entry);
        }
        let (used, next_seq, mut last_push_ms) = match stored {
            Some(a) => (a.usage, a.next_seq, a.record.last_push_ms),
            None => (Usage::default(), 1, BTreeMap::new()),
        };
        // A compacted snapshot drops what it covers in the same write.
        let mut freed = Usage::default();
        if replaces_through > 0 {
            if replaces_through >= next_seq {
                return Err(refuse(
                    RefusalCode::Malformed,
                    format!(
                        "a snapshot cannot replace entries up to {replaces_through}: the newest is {}",
                        next_seq.saturating_sub(1)
                    ),
                ));
            }
            freed = self
                .store
                .usage_through(&hash, replaces_through)
                .map_err(|e| {
                    warn!(error = %e, "keeper store read failed");
                    refuse(RefusalCode::Internal, e.to_string())
                })?;
        }
        let (new_bytes, new_count) = (
            (used.bytes + bytes).saturating_sub(freed.bytes),
            (used.envelopes + entries.len() as u64).saturating_sub(freed.envelopes),
        );
        if new_bytes > self.config.max_bytes_per_agent
            || new_count > self.config.max_envelopes_per_agent
        {
            return Err(refuse(
                RefusalCode::QuotaExceeded,
                format!(
                    "the agent's quota is {} bytes and {} envelopes; {} and {} are used, this push adds {bytes} and {}",
                    self.config.max_bytes_per_agent,
                    self.config.max_envelopes_per_agent,
                    used.bytes,
                    used.envelopes,
                    entries.len()
                ),
            ));
        }
        // What a restart must not forget: each device's newest push still
        // inside the window (older ones are refused as stale anyway).
        let window = self.config.clock_window.as_millis() as u64;
        last_push_ms.retain(|_, ts| ts.saturating_add(window) >= now_ms);
        let newest = last_push_ms.entry(signer.to_owned()).or_insert(signed_ms);
        *newest = (*newest).max(signed_ms);
        let record = AgentRecord {
            did: did.to_owned(),
            doc: Some(log),
            last_push_ms,
        };
        let pushed = self
            .store
            .push(&hash, &record, &entries, replaces_through)
            .map_err(|e| {
                warn!(error = %e, "keeper store write failed");
                match e {
                    KeeperStoreError::NotDurable { .. } => refuse(
                        RefusalCode::Internal,
                        "the keeper could not make the push durable",
                    ),
                    _ => refuse(RefusalCode::Internal, "the keeper could not store the push"),
                }
            })?;
        self.stats.agents = self.store.agent_count();
        self.stats.pushes += 1;
        self.stats.envelopes_stored += entries.len() as u64;
        self.stats.envelopes_compacted += freed.envelopes;
        let near = |used: u64, max: u64| used.saturating_mul(10) > max.saturating_mul(8);
        let usage = pushed.usage;
        Ok(KeeperResponse::Pushed {
            request_id,
            first_seq: pushed.first_seq,
            last_seq: (pushed.first_seq + entries.len() as u64).saturating_sub(1),
            used_bytes: usage.bytes,
            used_envelopes: usage.envelopes,
            quota_near: near(usage.bytes, self.config.max_bytes_per_agent)
                || near(usage.envelopes, self.config.max_envelopes_per_agent),
        })
    }

    fn pull(
        &mut self,
        hash: AgentHash,
        since: u64,
        max_bytes: u32,
        membership: Membership,
        request_id: u64,
    ) -> Result<KeeperResponse, Refusal> {
        let limit = max_bytes.clamp(1, self.config.max_pull_bytes);
        let page = self
            .store
            .pull(&hash, since, u64::from(limit), MAX_BATCH_ENTRIES)
            .map_err(|e| {
                warn!(error = %e, "keeper store read failed");
                refuse(RefusalCode::Internal, e.to_string())
            })?;
        let mut entries = Vec::with_capacity(page.entries.len());
        let mut next = since;
        for (seq, entry) in page.entries {
            let env = envelope_from_bytes(&entry.envelope)
                .map_err(|_| refuse(RefusalCode::Internal, format!("entry {seq} is unreadable")))?;
            next = seq;
            entries.push((seq, env));
        }
        // What it holds, so that a device that saw more detects a store
        // rolled back to an older copy (issue 41).
        let newest = self
            .store
            .agent(&hash)
            .map_or(0, |a| a.next_seq.saturating_sub(1));
        self.stats.pulls += 1;
        self.stats.envelopes_served += entries.len() as u64;
        Ok(KeeperResponse::Batch {
            request_id,
            entries,
            next,
            more: page.more,
            newest: Some(newest),
            membership,
        })
    }

    /// Drops envelopes received longer ago than the retention time, and
    /// nonces that fell out of the clock window; returns how many envelopes.
    pub fn prune(&mut self, now_ms: u64) -> Result<u64, KeeperError> {
        let cutoff = now_ms.saturating_sub(self.config.retention.as_millis() as u64);
        self.nonces.prune(i64::try_from(now_ms).unwrap_or(i64::MAX));
        let dropped = self.store.prune(cutoff)?;
        self.stats.envelopes_pruned += dropped;
        Ok(dropped)
    }
}

#[cfg(test)]
mod tests;
