//! What the keeper keeps, behind [`KeeperStore`]: per agent a record (its
//! proven DID document, the devices it ever listed, each device's newest
//! push) and a log of stored envelopes numbered 1, 2, 3, ….
//!
//! The store decides nothing: signatures, windows, nonces, quotas, the cap
//! on agents and what to store are [`crate::Keeper`]'s. A store keeps what
//! it is given, atomically and durably, and answers what it holds.
//! `MemKeeperStore` (this crate) keeps it in memory for tests and
//! simulations; `nuwa_store::SledKeeperStore` keeps it on disk.

use std::collections::{BTreeMap, BTreeSet};

use nuwa_identity::document::DidDocument;
use serde::{Deserialize, Serialize};

/// SHA-256 of an agent DID ([`crate::agent_hash`]): the key the keeper
/// files an agent under.
pub type AgentHash = [u8; 32];

/// Bytes the receipt time adds to every stored envelope (see [`Entry::size`]).
pub const ENTRY_HEADER_BYTES: u64 = 8;

/// One stored envelope.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    /// When the keeper received it, in ms since the Unix epoch: retention
    /// counts from here.
    pub received_ms: u64,
    /// The sealed envelope as `nuwa_proto::keeper::envelope_bytes` encodes
    /// it. The store never decodes it.
    pub envelope: Vec<u8>,
}

impl Entry {
    /// What the entry counts against the agent's byte quota and a pull's
    /// page: the envelope's bytes plus its receipt time, which is also what
    /// it takes as a stored value.
    #[must_use]
    pub fn size(&self) -> u64 {
        ENTRY_HEADER_BYTES + self.envelope.len() as u64
    }
}

/// What an agent's entries take.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    /// Sum of [`Entry::size`].
    pub bytes: u64,
    /// Number of entries.
    pub envelopes: u64,
}

/// The keeper's record of one agent, as it decides it. The store keeps it
/// as given; the log head and usage are the store's ([`AgentState`]).
#[derive(Debug, Clone, PartialEq)]
pub struct AgentRecord {
    /// The agent DID (the store files it under its [`AgentHash`]).
    pub did: String,
    /// The newest DID document proven to the keeper; `None` for a record
    /// written before proofs (the next push must carry one).
    pub doc: Option<AgentDoc>,
    /// Newest signed timestamp of a push accepted from each device (by
    /// context id), kept while it is inside the clock window. Nonces live in
    /// memory only; after a restart a device's request is accepted only if
    /// signed later than its last push, so an acknowledged push cannot be
    /// replayed into a second copy.
    pub last_push_ms: BTreeMap<String, u64>,
}

/// What the keeper knows of an agent's DID document: the newest proof it
/// verified (from the genesis key's authority chain alone, like a DHT node).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AgentDoc {
    /// Sequence number of the proof's head entry; a proof replaces this one
    /// only with a higher one.
    pub head_seq: u64,
    /// Hash of the proof's head entry.
    pub head_hash: String,
    /// The document the proof established.
    pub document: DidDocument,
    /// Context ids of every key a proven document listed for the device
    /// relationship, so a revoked device is told it was revoked. At most
    /// `MAX_EVER_LISTED`.
    pub ever_listed: BTreeSet<String>,
    /// DID chain entries from seq 1 (JSON) that a device pushed when their
    /// head was the proof the keeper followed: served to devices that only
    /// meet the keeper. Empty: none pushed yet.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub chain: String,
    /// Hash of `chain`'s head entry.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub chain_head: String,
    /// The newest epoch grants pushed (signature checked against
    /// `document`), by epoch, at most `nuwa_proto::keeper::MAX_KEEPER_GRANTS`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub grants: Vec<StoredGrant>,
}

/// An epoch grant as a keeper keeps it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoredGrant {
    pub epoch: u64,
    pub bytes: Vec<u8>,
}

/// One agent as a store holds it.
#[derive(Debug, Clone, PartialEq)]
pub struct AgentState {
    /// The keeper's record, as last written by [`KeeperStore::push`].
    pub record: AgentRecord,
    /// The sequence number the next stored entry gets: one past the newest
    /// entry ever stored, whether or not it was dropped since. Never reused.
    pub next_seq: u64,
    /// What the agent's entries take now.
    pub usage: Usage,
}

/// What a push stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pushed {
    /// Sequence number of the first entry pushed; when none was, the one
    /// the next entry gets.
    pub first_seq: u64,
    /// The agent's usage after the push.
    pub usage: Usage,
}

/// One page of an agent's log.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Page {
    /// Entries after the cursor, oldest first, with their sequence numbers.
    pub entries: Vec<(u64, Entry)>,
    /// Whether more entries follow the page.
    pub more: bool,
}

/// Why a store could not do what it was asked. Whatever a write reports,
/// nothing of it is acknowledged.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum KeeperStoreError {
    /// The backend failed (the disk, the database).
    #[error("keeper store failed while {op}")]
    Backend {
        /// What the store was doing, for example `committing a push`.
        op: &'static str,
        /// What the backend reported.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// A write was committed but could not be made durable: the keeper
    /// must not acknowledge it (the store may still hold it afterwards, as
    /// a retried push would).
    #[error("keeper store could not make a write durable")]
    NotDurable {
        /// What the backend reported.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// Something the store holds cannot be read.
    #[error("keeper store holds an unreadable {what}: {reason}")]
    Corrupt {
        /// Which record, for example `agent record`.
        what: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A push asked to drop entries that do not exist yet (the keeper
    /// refuses such a push before it reaches the store).
    #[error("a push cannot replace entries up to {replaces_through}: the newest is {newest}")]
    ReplacesAhead {
        /// The `replaces_through` asked for.
        replaces_through: u64,
        /// The newest sequence number stored.
        newest: u64,
    },
    /// The agent's sequence numbers ran out (2^64 entries).
    #[error("the agent's log has used every sequence number")]
    SeqExhausted,
}

/// Storage for the keeper: per-agent records and envelope logs.
///
/// The keeper checks every quota, window and signature before it calls a
/// write, and calls are serialised by its `&mut self`; a store checks only
/// what keeps its own contents consistent. Reads of an agent's record and
/// usage are answered from memory: the keeper asks them on every request
/// (both stores keep every agent's record, bounded by the keeper's cap on
/// agents, and read only entries from their backend).
pub trait KeeperStore: Send {
    /// How many agents the store holds (for the keeper's cap on agents).
    fn agent_count(&self) -> usize;

    /// Every agent held, in hash order.
    fn agent_hashes(&self) -> Vec<AgentHash>;

    /// The agent's record, log head and usage; `None` for an agent never
    /// pushed to.
    fn agent(&self, agent: &AgentHash) -> Option<AgentState>;

    /// What the agent's entries numbered `1..=through` take: what a push
    /// with `replaces_through = through` would free.
    ///
    /// # Errors
    /// Backend failures.
    fn usage_through(&self, agent: &AgentHash, through: u64) -> Result<Usage, KeeperStoreError>;

    /// Stores `entries` as the agent's next entries (numbered from its
    /// `next_seq`, or 1 for a new agent), drops its entries numbered
    /// `1..=replaces_through` (none for 0) and writes `record`, all in one
    /// atomic commit, durable when this returns `Ok`. On an error nothing
    /// of it may be visible; a crash at any point keeps all of it or none.
    ///
    /// # Errors
    /// [`KeeperStoreError::ReplacesAhead`] if `replaces_through` is not
    /// below `next_seq` (nothing is written); backend failures, and
    /// [`KeeperStoreError::NotDurable`] for a commit that could not be
    /// flushed.
    fn push(
        &mut self,
        agent: &AgentHash,
        record: &AgentRecord,
        entries: &[Entry],
        replaces_through: u64,
    ) -> Result<Pushed, KeeperStoreError>;

    /// The agent's entries after `since`, oldest first, until the next one
    /// would take the page past `max_bytes` (by [`Entry::size`]) or past
    /// `max_entries`. The first entry is returned even if it alone is
    /// bigger, so a cursor always moves. An unknown agent has no entries.
    ///
    /// # Errors
    /// Backend failures and entries that cannot be read.
    fn pull(
        &self,
        agent: &AgentHash,
        since: u64,
        max_bytes: u64,
        max_entries: usize,
    ) -> Result<Page, KeeperStoreError>;

    /// Drops every agent's entries received before `received_before_ms`,
    /// from the oldest up to the first that is not (entries are stored in
    /// the order received); durable when this returns `Ok`. Returns how
    /// many were dropped. Records stay.
    ///
    /// # Errors
    /// Backend failures; entries dropped before one are not restored.
    fn prune(&mut self, received_before_ms: u64) -> Result<u64, KeeperStoreError>;
}
