//! Who may sync: the agent's DID log, this device's identity, and the checks
//! that turn a connected peer into a verified device of this agent.
//!
//! A peer is verified when (1) its [`Hello`] names our agent DID, (2) the DID
//! proof it carries verifies against the DID, and this device holds the
//! proof's head entry (otherwise the caller first fetches the peer's entries
//! and merges them with the fork rule, see [`HelloCheck::NeedEntries`]),
//! (3) the public key behind its libp2p PeerId is an active
//! `verificationMethod` of the current document with the `authentication`
//! relationship, listed under the context id it claims, and (4) the Hello's
//! NIP-2 style signature verifies with that key and its nonce is fresh.
//! IO-free: time comes in as `now_ms`.

use nuwa_identity::chain::{
    DidChain, DidEntry, DidProof, MAX_LOST_BRANCHES, MAX_SPLICE_ENTRIES, MergeOutcome,
};
use nuwa_identity::document::{DidDocument, Relationship};
use nuwa_identity::keys::{DeviceKey, verify_ed25519};
use nuwa_identity::nip2::{NonceStore, signing_hash};
use nuwa_proto::{Hello, PROTOCOL_VERSION};

/// Relationship a device key must hold to take part in sync.
pub const SYNC_RELATIONSHIP: Relationship = Relationship::Authentication;
/// Accepted clock difference for Hellos, either way (the same as for
/// envelopes: a peer outside it could not get a single envelope accepted).
pub const HELLO_REPLAY_WINDOW_SECS: i64 = crate::secure::REPLAY_WINDOW_SECS;

/// Why a peer or an announcement was not accepted. The `Display` text is
/// shown to operators in logs and `status`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Rejection {
    #[error("belongs to a different agent ({0})")]
    DifferentAgent(String),
    #[error("key is not in the agent's DID document")]
    UnknownKey,
    #[error("key has expired")]
    KeyExpired,
    #[error("key lacks the {0} relationship")]
    NotAuthorised(&'static str),
    #[error("claimed context id {claimed:?} does not match its key ({actual:?})")]
    ContextMismatch { claimed: String, actual: String },
    #[error("signature does not verify")]
    BadSignature,
    #[error("DID log does not verify: {0}")]
    BadDidLog(String),
    #[error("DID chain entries refused: {0}")]
    DidEntries(String),
    #[error(
        "speaks sync protocol version {0}, this build speaks {v}: upgrade the older of the two devices",
        v = nuwa_proto::PROTOCOL_VERSION
    )]
    ProtocolVersion(u32),
    #[error("replayed or stale: {0}")]
    Replay(String),
    #[error("malformed: {0}")]
    Malformed(String),
    /// The peer's signed Hello is genuine but its clock differs from ours
    /// by more than the replay window; nothing it seals would pass either.
    #[error(
        "clock skew: the peer's clock is {offset_ms} ms off ours (beyond the ±{window_secs} s window); \
         fix the clock of the device that is wrong (NTP)"
    )]
    ClockSkew { offset_ms: i64, window_secs: i64 },
    /// Connected, but no Hello arrived within the deadline.
    #[error("no Hello within {0} ms of connecting")]
    HelloTimeout(u64),
}

impl Rejection {
    /// Short stable label for counters.
    pub fn label(&self) -> &'static str {
        match self {
            Rejection::DifferentAgent(_) => "different_agent",
            Rejection::UnknownKey => "unknown_key",
            Rejection::KeyExpired => "key_expired",
            Rejection::NotAuthorised(_) => "not_authorised",
            Rejection::ContextMismatch { .. } => "context_mismatch",
            Rejection::BadSignature => "bad_signature",
            Rejection::BadDidLog(_) => "bad_did_log",
            Rejection::DidEntries(_) => "did_entries",
            Rejection::ProtocolVersion(_) => "protocol_version",
            Rejection::Replay(_) => "replay",
            Rejection::Malformed(_) => "malformed",
            Rejection::ClockSkew { .. } => "clock_skew",
            Rejection::HelloTimeout(_) => "hello_timeout",
        }
    }
}

/// How far `their_ms` is ahead of `our_ms` (negative: behind), saturating.
pub fn clock_offset_ms(their_ms: u64, our_ms: u64) -> i64 {
    let d = i128::from(their_ms) - i128::from(our_ms);
    d.clamp(i128::from(i64::MIN), i128::from(i64::MAX)) as i64
}

/// A peer that passed every check.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VerifiedPeer {
    pub context_id: String,
    pub name: String,
    pub public: [u8; 32],
    /// The epoch grant the peer forwarded (empty if none); unverified.
    pub epoch_grant: Vec<u8>,
    /// The peer's clock minus ours, as its Hello's timestamp showed.
    pub clock_offset_ms: i64,
}

/// What checking a [`Hello`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HelloCheck {
    /// The peer passed every check.
    Verified(VerifiedPeer),
    /// The Hello is genuine and its proof verifies, but we do not hold the
    /// proof's head: fetch the peer's entries from `from_seq` on, merge
    /// them, then check the same Hello again. `head_seq` is the proven
    /// head's: the peer's answer may not run much past it.
    NeedEntries { from_seq: u64, head_seq: u64 },
}

/// The entries of a [`nuwa_proto::Frame::DidEntries`] page, bounded.
pub fn parse_entries(json: &[u8]) -> Result<Vec<DidEntry>, Rejection> {
    let entries: Vec<DidEntry> =
        serde_json::from_slice(json).map_err(|e| Rejection::DidEntries(e.to_string()))?;
    if entries.len() > MAX_SPLICE_ENTRIES {
        return Err(Rejection::DidEntries(format!(
            "{} entries in one page, max {MAX_SPLICE_ENTRIES}",
            entries.len()
        )));
    }
    Ok(entries)
}

/// This device's view of the agent.
pub struct Membership {
    log: DidChain,
    context_id: String,
    name: String,
    device: DeviceKey,
    nonces: NonceStore,
    epoch_grant: Vec<u8>,
}

fn map_doc_error(e: nuwa_identity::document::DidError) -> Rejection {
    use nuwa_identity::document::DidError as E;
    match e {
        E::KeyNotFound { .. } => Rejection::UnknownKey,
        E::Expired { .. } => Rejection::KeyExpired,
        E::PermissionDenied { rel, .. } => Rejection::NotAuthorised(rel.as_str()),
        other => Rejection::Malformed(other.to_string()),
    }
}

impl Membership {
    pub fn new(log: DidChain, context_id: String, name: String, device: DeviceKey) -> Self {
        let mut name = name;
        while name.len() > nuwa_proto::MAX_DEVICE_NAME_BYTES {
            name.pop();
        }
        Membership {
            log,
            context_id,
            name,
            device,
            nonces: NonceStore::new(HELLO_REPLAY_WINDOW_SECS, 4096, 1024),
            epoch_grant: Vec::new(),
        }
    }

    /// The grant of our current key epoch, forwarded in every Hello.
    pub fn set_epoch_grant(&mut self, grant: Vec<u8>) {
        self.epoch_grant = grant;
    }

    /// The grant of our current key epoch (empty at epoch 0).
    pub fn epoch_grant(&self) -> &[u8] {
        &self.epoch_grant
    }

    /// Adopts a log this device extended itself (a signed update it made).
    /// Refuses a log that does not verifiably extend ours or win the fork rule.
    pub fn adopt_log(&mut self, log: DidChain, now_ms: u64) -> Result<bool, Rejection> {
        Ok(self.merge_log(&log, now_ms)?.changed())
    }

    /// Merges a peer's chain with the fork rule: adopts it when it verifies
    /// and extends ours or wins the fork. Ours is unchanged on error.
    pub fn merge_log(&mut self, log: &DidChain, now_ms: u64) -> Result<MergeOutcome, Rejection> {
        let mut merged = self.log.clone();
        let outcome = merged
            .merge(log, (now_ms / 1000) as i64)
            .map_err(|e| Rejection::BadDidLog(e.to_string()))?;
        if outcome.changed() {
            self.log = merged;
        }
        Ok(outcome)
    }

    /// Our chain's entries from `from_seq` on, as one page for
    /// [`nuwa_proto::Frame::DidEntries`]: as many as fit in `max_bytes` (at
    /// least one, at most [`MAX_SPLICE_ENTRIES`]). Returns the JSON array
    /// and whether more entries follow. An empty page past our head.
    pub fn entries_page(&self, from_seq: u64, max_bytes: usize) -> (Vec<u8>, bool) {
        let entries = self.log.entries();
        let from = usize::try_from(from_seq)
            .unwrap_or(usize::MAX)
            .min(entries.len());
        let mut page = b"[".to_vec();
        let mut taken = 0;
        for entry in &entries[from..] {
            // Entries of a chain we hold always serialize; stop if one does not.
            let Ok(json) = serde_json::to_vec(entry) else {
                break;
            };
            if taken > 0 && (page.len() + json.len() + 2 > max_bytes || taken >= MAX_SPLICE_ENTRIES)
            {
                break;
            }
            if taken > 0 {
                page.push(b',');
            }
            page.extend_from_slice(&json);
            taken += 1;
        }
        page.push(b']');
        (page, from + taken < entries.len())
    }

    pub fn did(&self) -> &str {
        self.log.did()
    }

    pub fn context_id(&self) -> &str {
        &self.context_id
    }

    pub fn device(&self) -> &DeviceKey {
        &self.device
    }

    pub fn log(&self) -> &DidChain {
        &self.log
    }

    pub fn document(&self) -> &DidDocument {
        self.log.current()
    }

    /// Whether this device's own key is an active sync member right now.
    pub fn self_authorised(&self, now_ms: u64) -> Result<(), Rejection> {
        self.authorise_public(&self.device.public(), now_ms)
            .map(|_| ())
    }

    /// The context id of the active device whose key is `public`.
    pub fn authorise_public(&self, public: &[u8; 32], now_ms: u64) -> Result<String, Rejection> {
        let now_secs = (now_ms / 1000) as i64;
        let method = self
            .document()
            .method_for_public(public, SYNC_RELATIONSHIP, now_secs)
            .map_err(map_doc_error)?;
        Ok(DidDocument::fragment(&method.id).to_owned())
    }

    /// The public key of the active device `context_id` (for checking its
    /// announcements).
    pub fn key_of_context(&self, context_id: &str, now_ms: u64) -> Result<[u8; 32], Rejection> {
        let key_id = self.document().key_id(context_id);
        self.document()
            .key_for(&key_id, SYNC_RELATIONSHIP, (now_ms / 1000) as i64)
            .map_err(map_doc_error)
    }

    /// Where a peer whose `Hello` we refuse stands in our chain: the seq
    /// after its proven head when we hold that head and have entries past
    /// it. A revoked device learns its revocation only from entries (its own
    /// chain still lists it, and no peer admits it any more), so they are
    /// sent to it before the connection closes. `None` when its proof does
    /// not verify or does not list the key behind its PeerId (a stranger
    /// replaying a public proof gets nothing), or it is not behind us.
    pub fn entries_owed(&self, peer_public: &[u8; 32], hello: &Hello, now_ms: u64) -> Option<u64> {
        let now_secs = (now_ms / 1000) as i64;
        let proof = DidProof::decode(&hello.did_proof).ok()?;
        let theirs = proof.verify(self.did(), now_secs).ok()?;
        theirs
            .document()
            .method_for_public(peer_public, SYNC_RELATIONSHIP, now_secs)
            .ok()?;
        let at = self.log.position_of(theirs.head_hash())?;
        (at + 1 < self.log.len()).then_some(at as u64 + 1)
    }

    /// What our Hello carries of the lost branches that remove a device
    /// our chain lists ([`DidChain::removal_evidence`]), within
    /// [`nuwa_proto::MAX_REMOVAL_EVIDENCE_BYTES`]: whole branches, the
    /// first ones kept, never a cut one.
    fn removal_evidence(&self) -> Vec<u8> {
        let mut branches = self.log.removal_evidence();
        while !branches.is_empty() {
            match serde_json::to_vec(&branches) {
                Ok(json) if json.len() <= nuwa_proto::MAX_REMOVAL_EVIDENCE_BYTES => return json,
                Ok(_) => {
                    branches.pop();
                }
                Err(_) => break,
            }
        }
        Vec::new()
    }

    /// The lost branches a peer's Hello carries, each spliced onto our
    /// chain where it forks and merged with the fork rule: a branch that
    /// removes a device we list is kept as evidence (strong removal); one
    /// that wins is adopted like any entries. Branches that do not connect
    /// to our chain or do not verify are skipped. Returns the outcomes
    /// that changed our chain, and how many branches were refused.
    pub fn merge_evidence(&mut self, hello: &Hello, now_ms: u64) -> (bool, usize) {
        if hello.removal_evidence.is_empty() {
            return (false, 0);
        }
        let Ok(branches) = serde_json::from_slice::<Vec<Vec<DidEntry>>>(&hello.removal_evidence)
        else {
            return (false, 1);
        };
        let mut changed = false;
        let mut refused = 0;
        for entries in branches.iter().take(MAX_LOST_BRANCHES) {
            let spliced = match self.log.splice(entries) {
                Ok(Some(chain)) => chain,
                _ => {
                    refused += 1;
                    continue;
                }
            };
            match self.merge_log(&spliced, now_ms) {
                Ok(outcome) => changed |= outcome.changed(),
                Err(_) => refused += 1,
            }
        }
        (changed, refused)
    }

    /// Our Hello for a new connection.
    pub fn hello(&self, now_ms: u64) -> Result<Hello, Rejection> {
        self.hello_with_grant(now_ms, self.epoch_grant.clone())
    }

    /// Our Hello carrying `epoch_grant` in place of our current epoch's
    /// grant (one sealed to the receiving peer alone).
    pub fn hello_with_grant(&self, now_ms: u64, epoch_grant: Vec<u8>) -> Result<Hello, Rejection> {
        let did_proof = self
            .log
            .proof()
            .encode()
            .map_err(|e| Rejection::Malformed(e.to_string()))?;
        let mut nonce = [0u8; 16];
        // `Rejection` is `Clone + PartialEq`, so the error travels as text.
        nuwa_entropy::fill(&mut nonce)
            .map_err(|e| Rejection::Malformed(format!("cannot draw a hello nonce: {e}")))?;
        let mut hello = Hello {
            protocol_version: PROTOCOL_VERSION,
            agent_did: self.did().to_owned(),
            context_id: self.context_id.clone(),
            device_name: self.name.clone(),
            did_proof,
            epoch_grant,
            removal_evidence: self.removal_evidence(),
            timestamp_ms: now_ms,
            nonce,
            signature: [0; 64],
        };
        let digest = signing_hash(Hello::DOMAIN, &hello.signing_content());
        hello.signature = self.device.sign(&digest);
        Ok(hello)
    }

    /// Checks the Hello of a peer whose libp2p identity key is `peer_public`.
    ///
    /// When the proof's head entry is not in our chain the peer is ahead of
    /// us or on another branch: the answer is [`HelloCheck::NeedEntries`]
    /// (nothing is recorded, so the same Hello can be checked again once the
    /// entries are merged). With `entries_merged` (the peer's entries were
    /// fetched and merged, or lost the fork rule) the peer is judged by our
    /// chain whatever its proof says.
    pub fn verify_hello(
        &mut self,
        peer_public: &[u8; 32],
        hello: &Hello,
        now_ms: u64,
        entries_merged: bool,
    ) -> Result<HelloCheck, Rejection> {
        if hello.protocol_version != PROTOCOL_VERSION {
            return Err(Rejection::ProtocolVersion(hello.protocol_version));
        }
        if hello.agent_did != self.did() {
            return Err(Rejection::DifferentAgent(hello.agent_did.clone()));
        }
        // The signature proves the holder of the PeerId key sent this Hello.
        let digest = signing_hash(Hello::DOMAIN, &hello.signing_content());
        verify_ed25519(peer_public, &digest, &hello.signature)
            .map_err(|_| Rejection::BadSignature)?;
        // The signature is genuine, so the timestamp is the peer's clock:
        // report a skew beyond the window as such, not as a replay.
        let offset_ms = clock_offset_ms(hello.timestamp_ms, now_ms);
        if offset_ms.unsigned_abs() > HELLO_REPLAY_WINDOW_SECS as u64 * 1000 {
            return Err(Rejection::ClockSkew {
                offset_ms,
                window_secs: HELLO_REPLAY_WINDOW_SECS,
            });
        }
        let now_secs = (now_ms / 1000) as i64;
        let ts_secs = (hello.timestamp_ms / 1000) as i64;
        let scope = hex::encode(peer_public);
        self.nonces
            .check(&scope, Hello::DOMAIN, &hello.nonce, ts_secs, now_secs)
            .map_err(|e| Rejection::Replay(e.to_string()))?;

        let proof =
            DidProof::decode(&hello.did_proof).map_err(|e| Rejection::BadDidLog(e.to_string()))?;
        let theirs = proof
            .verify(self.did(), now_secs)
            .map_err(|e| Rejection::BadDidLog(e.to_string()))?;
        if !entries_merged && self.log.position_of(theirs.head_hash()).is_none() {
            // A proof is public (every DHT pointer carries one): only a key
            // that the proven document or ours lists may make us fetch.
            let listed = |doc: &DidDocument| {
                doc.method_for_public(peer_public, SYNC_RELATIONSHIP, now_secs)
                    .map(|m| DidDocument::fragment(&m.id).to_owned())
            };
            let actual = listed(theirs.document())
                .or_else(|_| listed(self.log.current()))
                .map_err(map_doc_error)?;
            if actual != hello.context_id {
                return Err(Rejection::ContextMismatch {
                    claimed: hello.context_id.clone(),
                    actual,
                });
            }
            // Ahead of us (the usual case: ask from our head on) or on a
            // branch that forked before its head (ask from there).
            let ours = self.log.len() as u64;
            return Ok(HelloCheck::NeedEntries {
                from_seq: ours.min(theirs.head_seq()).max(1),
                head_seq: theirs.head_seq(),
            });
        }
        let merged = &self.log;
        let method = merged
            .current()
            .method_for_public(peer_public, SYNC_RELATIONSHIP, now_secs)
            .map_err(map_doc_error)?;
        let actual = DidDocument::fragment(&method.id).to_owned();
        if actual != hello.context_id {
            return Err(Rejection::ContextMismatch {
                claimed: hello.context_id.clone(),
                actual,
            });
        }
        self.nonces
            .record(&scope, Hello::DOMAIN, &hello.nonce, ts_secs, now_secs)
            .map_err(|e| Rejection::Replay(e.to_string()))?;
        Ok(HelloCheck::Verified(VerifiedPeer {
            context_id: actual,
            name: hello.device_name.clone(),
            public: *peer_public,
            epoch_grant: hello.epoch_grant.clone(),
            clock_offset_ms: offset_ms,
        }))
    }
}
