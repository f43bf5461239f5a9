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
//! Pushes are all or nothing and durable (one sled batch, flushed) before
//! they are acknowledged. Quotas per agent (bytes and envelopes), a cap on
//! agents, and a retention time bound what one agent can take.
//!
//! What it learns: the agent's DID (as a SHA-256 key, with its DID proof,
//! which is public material published in the DHT anyway), which device
//! context ids push and pull, key epochs, sizes and times. Not container
//! names, not keys, not values.
//!
//! This crate does no IO beyond its sled files: the network and the
//! threads are the caller's.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::Path;
use std::time::Duration;

use nuwa_crypto::Envelope;
use nuwa_identity::chain::DidProof;
use nuwa_identity::document::{DidDocument, DidError, Relationship};
use nuwa_identity::keys::{DeviceKey, verify_ed25519};
use nuwa_identity::nip2::{NonceStore, ReplayError};
use nuwa_proto::keeper::{
    KeeperAuth, KeeperBody, KeeperRequest, KeeperResponse, MAX_BATCH_ENTRIES, MAX_DETAIL_BYTES,
    RefusalCode, envelope_bytes, envelope_from_bytes,
};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use sled::Transactional;
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

/// Why the keeper's store could not be opened or written.
#[derive(Debug, thiserror::Error)]
pub enum KeeperError {
    #[error("keeper store: {0}")]
    Store(#[from] sled::Error),
    #[error("keeper store holds an unreadable agent record: {0}")]
    Corrupt(String),
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
    pub agents: usize,
}

/// Per-agent record, persisted in the `agents` tree.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct AgentRecord {
    did: String,
    /// The newest DID document proven to the keeper; `None` for a record
    /// written before proofs (the next push must carry one).
    #[serde(default)]
    doc: Option<AgentDoc>,
    next_seq: u64,
    /// Newest signed timestamp of a push accepted from each device, kept
    /// while it is inside the clock window. Nonces live in memory only;
    /// after a restart a device's request is accepted only if signed later
    /// than its last push, so an acknowledged push cannot be replayed into
    /// a second copy.
    #[serde(default)]
    last_push_ms: BTreeMap<String, u64>,
}

struct Agent {
    record: AgentRecord,
    used_bytes: u64,
    used_envelopes: u64,
}

/// The keeper's store and checks. One per process; calls are serialised by
/// the caller (`&mut self`).
pub struct Keeper {
    db: sled::Db,
    entries: sled::Tree,
    agents_tree: sled::Tree,
    agents: HashMap<[u8; 32], Agent>,
    /// Nonces of requests whose signature verified, per (agent, device),
    /// in milliseconds. Evicted nonces turn into floors, so none is ever
    /// accepted twice while the process runs.
    nonces: NonceStore,
    /// Per (agent, device), the newest push signed before this process
    /// opened the store: requests signed no later are refused (the nonces
    /// that would tell a replay were lost with the last process).
    restart_floor: HashMap<([u8; 32], String), u64>,
    config: KeeperConfig,
    stats: KeeperStats,
}

/// SHA-256 of the agent DID: the key the keeper files an agent under.
pub fn agent_hash(did: &str) -> [u8; 32] {
    Sha256::digest(did.as_bytes()).into()
}

fn entry_key(agent: &[u8; 32], seq: u64) -> [u8; 40] {
    let mut k = [0u8; 40];
    k[..32].copy_from_slice(agent);
    k[32..].copy_from_slice(&seq.to_be_bytes());
    k
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
        }
        KeeperBody::Pull { since, max_bytes } => {
            m.push(2);
            m.extend_from_slice(&since.to_be_bytes());
            m.extend_from_slice(&max_bytes.to_be_bytes());
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
) -> Result<KeeperRequest, getrandom::Error> {
    let mut nonce = [0u8; 16];
    getrandom::fill(&mut nonce)?;
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

/// What the keeper knows of an agent's DID document: the newest [`DidProof`]
/// it verified (from the genesis key's authority chain alone, like a DHT
/// node). The keeper follows the proof with the highest head seq; a proof of
/// the same or a lower seq does not replace it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct AgentDoc {
    head_seq: u64,
    head_hash: String,
    document: DidDocument,
    /// Context ids of every key a proven document listed for the device
    /// relationship, so a revoked device is told it was revoked.
    ever_listed: BTreeSet<String>,
}

impl AgentDoc {
    /// The doc a verified proof establishes, remembering what `before` listed.
    fn from_proof(
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
        AgentDoc {
            head_seq: proof.head_seq(),
            head_hash: proof.head_hash().to_owned(),
            document,
            ever_listed,
        }
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
    /// Opens (or creates) the keeper's store in `path`.
    pub fn open(path: &Path, config: KeeperConfig) -> Result<Keeper, KeeperError> {
        let db = sled::Config::new().path(path).open()?;
        let entries = db.open_tree("entries")?;
        let agents_tree = db.open_tree("agents")?;
        let mut agents = HashMap::new();
        let mut restart_floor = HashMap::new();
        for item in agents_tree.iter() {
            let (k, v) = item?;
            let hash: [u8; 32] = k
                .as_ref()
                .try_into()
                .map_err(|_| KeeperError::Corrupt("agent key length".into()))?;
            let record: AgentRecord =
                serde_json::from_slice(&v).map_err(|e| KeeperError::Corrupt(e.to_string()))?;
            for (signer, ts) in &record.last_push_ms {
                restart_floor.insert((hash, signer.clone()), *ts);
            }
            let (mut used_bytes, mut used_envelopes) = (0u64, 0u64);
            for e in entries.scan_prefix(hash) {
                let (_, v) = e?;
                used_bytes += v.len() as u64;
                used_envelopes += 1;
            }
            agents.insert(
                hash,
                Agent {
                    record,
                    used_bytes,
                    used_envelopes,
                },
            );
        }
        let stats = KeeperStats {
            agents: agents.len(),
            ..KeeperStats::default()
        };
        Ok(Keeper {
            db,
            entries,
            agents_tree,
            agents,
            nonces: NonceStore::new(
                config.clock_window.as_millis() as i64,
                config.max_nonces_per_signer,
                config.max_signers,
            ),
            restart_floor,
            config,
            stats,
        })
    }

    pub fn stats(&self) -> KeeperStats {
        self.stats.clone()
    }

    /// Bytes and envelopes stored for the agent `did`.
    pub fn usage(&self, did: &str) -> Option<(u64, u64)> {
        self.agents
            .get(&agent_hash(did))
            .map(|a| (a.used_bytes, a.used_envelopes))
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
        let known = self.agents.get(&hash).and_then(|a| a.record.doc.clone());
        let (log, log_changed) = match (known, carried) {
            (Some(ours), Some(theirs)) => {
                if theirs.head_seq() > ours.head_seq {
                    (AgentDoc::from_proof(theirs, Some(&ours)), true)
                } else {
                    (ours, false)
                }
            }
            (Some(ours), None) => (ours, false),
            (None, Some(theirs)) if self.agents.contains_key(&hash) => {
                (AgentDoc::from_proof(theirs, None), true)
            }
            (None, Some(theirs)) => {
                if self.agents.len() >= self.config.max_agents {
                    return Err(refuse(
                        RefusalCode::QuotaExceeded,
                        format!(
                            "this keeper holds its maximum of {} agents",
                            self.config.max_agents
                        ),
                    ));
                }
                (AgentDoc::from_proof(theirs, None), true)
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

        match req.body {
            KeeperBody::Push {
                envelopes,
                replaces_through,
                ..
            } => self.push(
                hash,
                &req.agent_did,
                log,
                envelopes,
                replaces_through,
                now_ms,
                (&req.auth.context_id, req.auth.timestamp_ms),
                req.request_id,
            ),
            KeeperBody::Pull { since, max_bytes } => {
                if log_changed {
                    self.save_log(hash, &req.agent_did, log)?;
                }
                self.pull(hash, since, max_bytes, req.request_id)
            }
        }
    }

    /// Records the nonce of a request whose signature verified, or refuses
    /// it as a replay.
    fn check_nonce(
        &mut self,
        hash: [u8; 32],
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

    fn save_log(&mut self, hash: [u8; 32], did: &str, log: AgentDoc) -> Result<(), Refusal> {
        let (next_seq, last_push_ms) = self.agents.get(&hash).map_or((1, BTreeMap::new()), |a| {
            (a.record.next_seq, a.record.last_push_ms.clone())
        });
        let record = AgentRecord {
            did: did.to_owned(),
            doc: Some(log),
            next_seq,
            last_push_ms,
        };
        self.write_agent(hash, &record, &sled::Batch::default())?;
        let agent = self.agents.entry(hash).or_insert_with(|| Agent {
            record: record.clone(),
            used_bytes: 0,
            used_envelopes: 0,
        });
        agent.record = record;
        self.stats.agents = self.agents.len();
        Ok(())
    }

    /// Writes `batch` of entries and the agent record atomically, durably.
    fn write_agent(
        &self,
        hash: [u8; 32],
        record: &AgentRecord,
        batch: &sled::Batch,
    ) -> Result<(), Refusal> {
        let bytes =
            serde_json::to_vec(record).map_err(|e| refuse(RefusalCode::Internal, e.to_string()))?;
        let internal = |e: sled::transaction::TransactionError<()>| {
            warn!(error = ?e, "keeper store write failed");
            refuse(RefusalCode::Internal, "the keeper could not store the push")
        };
        (&self.entries, &self.agents_tree)
            .transaction(|(entries, agents)| {
                entries.apply_batch(batch)?;
                agents.insert(&hash[..], bytes.as_slice())?;
                Ok::<(), sled::transaction::ConflictableTransactionError<()>>(())
            })
            .map_err(internal)?;
        self.db.flush().map_err(|e| {
            warn!(error = %e, "keeper store flush failed");
            refuse(
                RefusalCode::Internal,
                "the keeper could not make the push durable",
            )
        })?;
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    fn push(
        &mut self,
        hash: [u8; 32],
        did: &str,
        log: AgentDoc,
        envelopes: Vec<Envelope>,
        replaces_through: u64,
        now_ms: u64,
        (signer, signed_ms): (&str, u64),
        request_id: u64,
    ) -> Result<KeeperResponse, Refusal> {
        let now_secs = (now_ms / 1000) as i64;
        let mut encoded = Vec::with_capacity(envelopes.len());
        let mut bytes = 0u64;
        for e in &envelopes {
            let key = active_key(&log, &e.sender, now_secs)?;
            nuwa_crypto::verify_envelope(e, &key, did).map_err(|_| {
                refuse(
                    RefusalCode::BadEnvelopeSignature,
                    format!("an envelope from {} does not verify", e.sender),
                )
            })?;
            let mut rec = Vec::with_capacity(8 + e.ciphertext.len() + 160);
            rec.extend_from_slice(&now_ms.to_be_bytes());
            rec.extend_from_slice(&envelope_bytes(e));
            bytes += rec.len() as u64;
            encoded.push(rec);
        }
        let (used_bytes, used_envelopes, next_seq) =
            self.agents.get(&hash).map_or((0, 0, 1), |a| {
                (a.used_bytes, a.used_envelopes, a.record.next_seq)
            });
        // A compacted snapshot drops what it covers in the same write.
        let mut batch = sled::Batch::default();
        let (mut freed_bytes, mut freed) = (0u64, 0u64);
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
            let end = entry_key(&hash, replaces_through);
            for item in self.entries.range(entry_key(&hash, 0)..=end) {
                let (k, v) = item.map_err(|e| refuse(RefusalCode::Internal, e.to_string()))?;
                freed_bytes += v.len() as u64;
                freed += 1;
                batch.remove(k);
            }
        }
        let (new_bytes, new_count) = (
            (used_bytes + bytes).saturating_sub(freed_bytes),
            (used_envelopes + encoded.len() as u64).saturating_sub(freed),
        );
        if new_bytes > self.config.max_bytes_per_agent
            || new_count > self.config.max_envelopes_per_agent
        {
            return Err(refuse(
                RefusalCode::QuotaExceeded,
                format!(
                    "the agent's quota is {} bytes and {} envelopes; {used_bytes} and {used_envelopes} are used, this push adds {bytes} and {}",
                    self.config.max_bytes_per_agent,
                    self.config.max_envelopes_per_agent,
                    encoded.len()
                ),
            ));
        }
        let first_seq = next_seq;
        for (i, rec) in encoded.iter().enumerate() {
            batch.insert(&entry_key(&hash, first_seq + i as u64)[..], rec.as_slice());
        }
        // What a restart must not forget: each device's newest push still
        // inside the window (older ones are refused as stale anyway).
        let window = self.config.clock_window.as_millis() as u64;
        let mut last_push_ms = self
            .agents
            .get(&hash)
            .map(|a| a.record.last_push_ms.clone())
            .unwrap_or_default();
        last_push_ms.retain(|_, ts| ts.saturating_add(window) >= now_ms);
        let newest = last_push_ms.entry(signer.to_owned()).or_insert(signed_ms);
        *newest = (*newest).max(signed_ms);
        let record = AgentRecord {
            did: did.to_owned(),
            doc: Some(log),
            next_seq: first_seq + encoded.len() as u64,
            last_push_ms,
        };
        self.write_agent(hash, &record, &batch)?;
        let agent = self.agents.entry(hash).or_insert_with(|| Agent {
            record: record.clone(),
            used_bytes: 0,
            used_envelopes: 0,
        });
        agent.record = record;
        agent.used_bytes = new_bytes;
        agent.used_envelopes = new_count;
        self.stats.agents = self.agents.len();
        self.stats.pushes += 1;
        self.stats.envelopes_stored += encoded.len() as u64;
        self.stats.envelopes_compacted += freed;
        let near = |used: u64, max: u64| used.saturating_mul(10) > max.saturating_mul(8);
        Ok(KeeperResponse::Pushed {
            request_id,
            first_seq,
            last_seq: (first_seq + encoded.len() as u64).saturating_sub(1),
            used_bytes: new_bytes,
            used_envelopes: new_count,
            quota_near: near(new_bytes, self.config.max_bytes_per_agent)
                || near(new_count, self.config.max_envelopes_per_agent),
        })
    }

    fn pull(
        &mut self,
        hash: [u8; 32],
        since: u64,
        max_bytes: u32,
        request_id: u64,
    ) -> Result<KeeperResponse, Refusal> {
        let limit = max_bytes.clamp(1, self.config.max_pull_bytes) as usize;
        let start = entry_key(&hash, since.saturating_add(1));
        let end = entry_key(&hash, u64::MAX);
        let mut entries = Vec::new();
        let mut size = 0usize;
        let mut next = since;
        let mut more = false;
        for item in self.entries.range(start..=end) {
            let (k, v) = item.map_err(|e| refuse(RefusalCode::Internal, e.to_string()))?;
            let full = !entries.is_empty()
                && (size + v.len() > limit || entries.len() >= MAX_BATCH_ENTRIES);
            if full {
                more = true;
                break;
            }
            let seq = u64::from_be_bytes(k[32..40].try_into().unwrap_or([0; 8]));
            let env = v
                .get(8..)
                .ok_or(())
                .and_then(|b| envelope_from_bytes(b).map_err(|_| ()))
                .map_err(|_| refuse(RefusalCode::Internal, format!("entry {seq} is unreadable")))?;
            size += v.len();
            next = seq;
            entries.push((seq, env));
        }
        self.stats.pulls += 1;
        self.stats.envelopes_served += entries.len() as u64;
        Ok(KeeperResponse::Batch {
            request_id,
            entries,
            next,
            more,
        })
    }

    /// Drops envelopes received longer ago than the retention time, and
    /// nonces that fell out of the clock window; returns how many envelopes.
    pub fn prune(&mut self, now_ms: u64) -> Result<u64, KeeperError> {
        let cutoff = now_ms.saturating_sub(self.config.retention.as_millis() as u64);
        let mut dropped = 0u64;
        for (hash, agent) in self.agents.iter_mut() {
            let mut batch = sled::Batch::default();
            let (mut bytes, mut count) = (0u64, 0u64);
            for item in self.entries.scan_prefix(hash) {
                let (k, v) = item?;
                let at = v
                    .get(..8)
                    .and_then(|b| b.try_into().ok())
                    .map(u64::from_be_bytes)
                    .unwrap_or(0);
                if at < cutoff {
                    batch.remove(k);
                    bytes += v.len() as u64;
                    count += 1;
                } else {
                    // Entries are in the order received.
                    break;
                }
            }
            if count > 0 {
                self.entries.apply_batch(batch)?;
                agent.used_bytes -= bytes.min(agent.used_bytes);
                agent.used_envelopes -= count.min(agent.used_envelopes);
                dropped += count;
            }
        }
        self.nonces.prune(i64::try_from(now_ms).unwrap_or(i64::MAX));
        if dropped > 0 {
            self.db.flush()?;
            self.stats.envelopes_pruned += dropped;
        }
        Ok(dropped)
    }
}

#[cfg(test)]
mod tests;
