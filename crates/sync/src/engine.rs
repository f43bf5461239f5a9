//! The synchronisation engine: an IO-free state machine over decrypted
//! payloads.
//!
//! Inputs are method calls carrying `now_ms`; outputs are [`Action`]s that the
//! runtime performs in order (send a payload to a peer, persist remote
//! changes, report convergence). The engine never reads a clock, never does IO
//! and never spawns anything, so a simulator can drive many engines with
//! loss, duplication and reordering from one seed.
//!
//! Protocol, per (peer, container):
//! - On connect, and every `anti_entropy_ms` after, each side sends a
//!   [`SyncPayload::Digest`]: one 16-byte fingerprint over every
//!   (container, heads) pair it holds, so an idle round costs the same for
//!   one container or ten thousand. A digest that differs from ours starts
//!   range-based set reconciliation ([`crate::reconcile`],
//!   [`SyncPayload::Reconcile`]), which narrows down to the containers that
//!   differ and exchanges their heads.
//! - Heads that differ from ours start (or, if stalled, restart) the
//!   Automerge sync protocol for that container; the protocol's messages
//!   ping-pong until neither side has anything to send. When a container
//!   converges and no exchange with that peer is left running, the next
//!   digest goes out at once (at most once a second), so both sides learn
//!   they are in sync without waiting for the next round.
//! - Local edits are queued and pushed as one [`SyncPayload::Delta`] per
//!   container and peer at each [`Engine::flush`], so that many writes
//!   travel together. A delta whose changes lack dependencies starts the sync
//!   protocol, which fetches whatever is missing.
//!
//! Catch-up off the loop: a sync message that carries more than
//! [`Config::catch_up_inline_bytes`] of changes (a whole document, for a
//! device that had nothing) is not applied by [`Engine::handle`]. The engine
//! forks the container and hands the runtime a [`CatchUp`]
//! ([`Engine::take_catch_ups`]) to run on any thread; the result comes back
//! through [`Engine::finish_catch_up`], which swaps the caught-up document
//! in if nothing touched the container meanwhile, or else runs another,
//! smaller round over what did. Until then the container serves local
//! writes and gossip as usual, and further sync messages for it wait.

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use nuwa_proto::{ContainerHeads, RangeBody, RangePart, SyncPayload};
use nuwa_state::{Container, Hash, StateError, SyncInbound, SyncState};

use crate::reconcile::{self, Fingerprint, FingerprintSet};

/// Largest packed [`SyncPayload::Deltas`] (changes plus names), so that a
/// pack still fits a gossip message once sealed.
pub const PACK_BYTES: usize = 48 * 1024;
/// Most containers in one packed [`SyncPayload::Deltas`].
pub const PACK_CONTAINERS: usize = 1024;

/// Least time between two digests to one peer when the early digest (after
/// an exchange ends) is due.
const EARLY_DIGEST_MIN_MS: u64 = 1_000;

/// Opaque peer identifier (the runtime uses the libp2p PeerId string).
pub type PeerKey = String;

/// Loads an evicted container from the runtime's storage: `Ok(None)` if the
/// storage has nothing of it. Set with [`Engine::set_loader`].
pub type Loader = Box<dyn FnMut(&str) -> Result<Option<Container>, String> + Send>;

/// What the engine keeps of an evicted ("cold") container: enough for
/// digests, reconciliation and status without the document.
#[derive(Debug, Clone)]
struct Cold {
    heads: Vec<Hash>,
    changes: usize,
}

/// Tunables of the engine.
#[derive(Debug, Clone)]
pub struct Config {
    /// How often each peer gets a heads summary.
    pub anti_entropy_ms: u64,
    /// A sync exchange without progress for this long is restarted.
    pub sync_stall_ms: u64,
    /// Most containers a node holds; a peer's container beyond it is
    /// refused (`TooManyContainers`).
    pub max_containers: usize,
    /// A sync message carrying more change bytes than this is applied off
    /// the loop ([`CatchUp`]); `usize::MAX` applies everything inline.
    pub catch_up_inline_bytes: usize,
    /// A whole document for a peer that holds nothing is saved on the
    /// loop only below this many operations; above, a copy of the document
    /// makes the reply on a worker ([`CatchUp`]): Automerge's save of
    /// 1,000,000 entries takes about 150 ms, its copy about 8.
    pub serve_inline_ops: u64,
    /// Largest document (in operations) forked for an off-loop catch-up:
    /// the copy is made on the loop (about 50 ns per operation), so a
    /// bigger one is caught up inline.
    pub catch_up_fork_max_ops: u64,
    /// Most catch-ups under way at once (each holds a copy of its
    /// container and its message); beyond it, messages are applied inline.
    pub catch_up_max_running: usize,
    /// An evicted container a peer's message or gossip needs is loaded off
    /// the loop: the engine hands its name out ([`Engine::take_loads`]),
    /// holds what came for it, and goes on when the runtime gives the
    /// loaded document back ([`Engine::finish_load`]). Off, it is loaded
    /// through the loader at once. Local writes always load at once.
    pub load_off_loop: bool,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            anti_entropy_ms: 5_000,
            sync_stall_ms: 10_000,
            max_containers: 16_384,
            // Loading a whole document runs at roughly 10 MB/s of saved
            // bytes at one change per entry (crates/state/examples/
            // catchup_cost.rs), so 64 KiB is a few milliseconds.
            catch_up_inline_bytes: 64 * 1024,
            serve_inline_ops: 100_000,
            catch_up_fork_max_ops: 500_000,
            catch_up_max_running: 4,
            load_off_loop: false,
        }
    }
}

/// Most sync messages held for a container while its catch-up runs (the
/// protocol sends one at a time per peer; more is a misbehaving peer).
const CATCH_UP_HELD_MAX: usize = 64;
/// Most inputs held for an evicted container while it loads off the loop
/// (a sync message per peer at a time, gossip deltas, exchanges to start),
/// and most bytes of them.
const LOAD_HELD_MAX: usize = 256;
const LOAD_HELD_MAX_BYTES: usize = 32 * 1024 * 1024;
/// Loads handed out at once: each brings a whole document into memory, so
/// a peer whose every container differs does not load them all together.
const LOADS_MAX_RUNNING: usize = 4;
/// Rounds of an off-loop catch-up before the last one is applied inline
/// (each round covers what local writes and gossip added meanwhile).
const CATCH_UP_ROUNDS_MAX: u32 = 3;

/// Work the engine hands the runtime: apply a big sync message (or, in a
/// later round, the changes made meanwhile) to a fork of a container, on
/// any thread. Run it with [`CatchUp::run`] and give the result to
/// [`Engine::finish_catch_up`].
pub struct CatchUp {
    id: u64,
    container: String,
    base: Container,
    work: Work,
    /// Changes (count, bytes) earlier rounds of this catch-up added.
    carried: (usize, usize),
}

enum Work {
    Message(SyncInbound),
    Changes(Vec<Vec<u8>>),
    /// Make the sync reply to `peer`, which holds nothing: the whole
    /// document (see [`Config::serve_inline_ops`]).
    Serve {
        peer: PeerKey,
        state: SyncState,
    },
}

impl std::fmt::Debug for CatchUp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CatchUp")
            .field("id", &self.id)
            .field("container", &self.container)
            .finish()
    }
}

impl CatchUp {
    /// The container being caught up.
    pub fn container(&self) -> &str {
        &self.container
    }

    /// Does the work: the expensive part, meant for a worker thread.
    pub fn run(self) -> CaughtUp {
        let CatchUp {
            id,
            container,
            mut base,
            work,
            carried,
        } = self;
        let mut whole = 0;
        let (result, message) = match work {
            // Into nothing (a cold sync): counted, not rebuilt change by
            // change; persisted as a snapshot of the whole document.
            Work::Message(inbound) if base.change_count() == 0 => {
                let result = base.catch_up_whole(&inbound).map(|n| {
                    whole = n;
                    Vec::new()
                });
                (result, Some(inbound))
            }
            Work::Message(inbound) => (base.catch_up(&inbound), Some(inbound)),
            Work::Changes(changes) => (applied_beyond(&mut base, changes), None),
            Work::Serve { peer, mut state } => {
                let reply = base.generate_sync_message(&mut state);
                return CaughtUp {
                    id,
                    container,
                    doc: base,
                    result: Ok(Vec::new()),
                    message: None,
                    carried,
                    served: Some(Served { peer, state, reply }),
                    whole: 0,
                };
            }
        };
        CaughtUp {
            id,
            container,
            doc: base,
            result,
            message,
            carried,
            served: None,
            whole,
        }
    }
}

/// Applies `changes` (which the live container already holds and has
/// persisted) and returns what else became part of the document: changes
/// of the catch-up that waited for them.
fn applied_beyond(doc: &mut Container, changes: Vec<Vec<u8>>) -> Result<Vec<Vec<u8>>, StateError> {
    let given: BTreeSet<Vec<u8>> = changes.iter().cloned().collect();
    let applied = doc.apply_changes(changes)?;
    Ok(applied
        .new_changes
        .into_iter()
        .filter(|c| !given.contains(c))
        .collect())
}

/// A finished [`CatchUp`].
pub struct CaughtUp {
    id: u64,
    container: String,
    doc: Container,
    result: Result<Vec<Vec<u8>>, StateError>,
    message: Option<SyncInbound>,
    carried: (usize, usize),
    /// A reply made off the loop ([`Work::Serve`]).
    served: Option<Served>,
    /// Changes a whole document brought into an empty container, counted
    /// but not rebuilt (`result` then holds none of them).
    whole: usize,
}

/// A sync reply made on a worker, and the sync state after it.
struct Served {
    peer: PeerKey,
    state: SyncState,
    reply: Option<Vec<u8>>,
}

/// A reply being made off the loop for one peer and container: the
/// peer's messages for the container wait for it.
struct Serving {
    id: u64,
    held: Vec<Vec<u8>>,
}

impl std::fmt::Debug for CaughtUp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CaughtUp")
            .field("id", &self.id)
            .field("container", &self.container)
            .field("error", &self.result.as_ref().err())
            .finish()
    }
}

impl CaughtUp {
    /// The container caught up.
    pub fn container(&self) -> &str {
        &self.container
    }

    /// The caught-up document (for a runtime that saves a snapshot of it
    /// off the loop before handing it back).
    pub fn doc(&self) -> &Container {
        &self.doc
    }

    /// Changes this catch-up added to the document, over all its rounds
    /// so far: what its swap will persist.
    pub fn new_changes(&self) -> usize {
        self.carried.0 + self.whole + self.result.as_ref().map_or(0, Vec::len)
    }

    /// Whether a whole document came into an empty container: it is
    /// persisted as a snapshot ([`Action::PersistWhole`]), whatever its
    /// size.
    pub fn is_whole(&self) -> bool {
        self.whole > 0
    }

    /// The whole document that came into the empty container, as it came
    /// (`None` unless [`CaughtUp::is_whole`] and it came as a document, not
    /// as loose changes): the caught-up document is exactly what these
    /// bytes load to, so they can be stored as its snapshot without saving
    /// it again (see [`Container::catch_up_whole`]).
    pub fn whole_document(&self) -> Option<Vec<u8>> {
        if self.whole == 0 {
            return None;
        }
        self.message.as_ref().and_then(nuwa_state::whole_document)
    }

    /// Bytes of those changes.
    pub fn new_change_bytes(&self) -> usize {
        self.carried.1
            + self
                .result
                .as_ref()
                .map_or(0, |c| c.iter().map(Vec::len).sum())
    }
}

/// A catch-up under way for one container.
struct Running {
    id: u64,
    /// Heads of the live container when the running round forked it.
    base_heads: Vec<Hash>,
    /// The peer whose message started it, and that message once applied.
    peer: PeerKey,
    message: Option<SyncInbound>,
    /// Changes the catch-up added that the live container lacks (later
    /// rounds re-apply what the live container added meanwhile, which may
    /// release more of the catch-up's own).
    new_changes: Vec<Vec<u8>>,
    /// Sync messages for the container that arrived meanwhile.
    held: Vec<(PeerKey, Vec<u8>)>,
    rounds: u32,
    /// Changes of a whole document that came into the empty container,
    /// counted and not rebuilt: the container is then persisted as one
    /// snapshot.
    whole: usize,
    /// Bytes of changes the message that started it carries (status).
    bytes: u64,
}

/// One container's sync state against one peer ([`Engine::sync_report`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PeerSyncState {
    /// Both hold the same heads.
    InSync,
    /// The peer holds changes we lack.
    Behind,
    /// We hold changes the peer has not reported holding.
    Ahead,
    /// A whole-document catch-up of the container is running.
    Syncing,
    /// No heads exchanged yet.
    Unknown,
}

impl PeerSyncState {
    pub fn as_str(self) -> &'static str {
        match self {
            PeerSyncState::InSync => "in_sync",
            PeerSyncState::Behind => "behind",
            PeerSyncState::Ahead => "ahead",
            PeerSyncState::Syncing => "syncing",
            PeerSyncState::Unknown => "unknown",
        }
    }
}

/// See [`Engine::sync_report`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerSync {
    pub container: String,
    pub state: PeerSyncState,
    /// Changes we still lack, when the peer said how many it holds.
    pub behind: Option<u64>,
}

/// See [`Engine::catch_up_progress`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CatchUpProgress {
    pub container: String,
    pub peer: PeerKey,
    pub changes: u64,
    pub bytes: u64,
    pub rounds: u32,
}

/// What the runtime must do, in this order.
#[derive(Debug, Clone, PartialEq)]
pub enum Action {
    Send {
        peer: PeerKey,
        payload: SyncPayload,
    },
    /// The same payload for every one of `peers` (live deltas): sealed
    /// once, published once where it fits gossip.
    Broadcast {
        peers: Vec<PeerKey>,
        payload: SyncPayload,
    },
    /// Remote changes newly integrated into `container`; persist them.
    Persist {
        container: String,
        changes: Vec<Vec<u8>>,
    },
    /// A whole document came into `container`, which held nothing (a cold
    /// sync): persist the document as one snapshot. `changes` is how many
    /// it brought; their bytes were never rebuilt.
    PersistWhole {
        container: String,
        changes: usize,
    },
    /// This container now has the same heads as `peer` (reported once per
    /// transition).
    Converged {
        peer: PeerKey,
        container: String,
    },
}

/// Why a payload from a peer was refused.
/// Why [`Engine::local_transact`] made no change.
#[derive(Debug, thiserror::Error)]
pub enum LocalEditError<E> {
    /// The edit itself refused (rolled back).
    #[error("{0}")]
    Rejected(E),
    #[error(transparent)]
    Engine(EngineError),
}

#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum EngineError {
    #[error("payload from unknown peer {0}")]
    UnknownPeer(PeerKey),
    #[error("container {container:?}: {source}")]
    State {
        container: String,
        // Boxed: Automerge's error type is large and this path is cold.
        #[source]
        source: Box<StateError>,
    },
    #[error("container limit of {0} reached")]
    TooManyContainers(usize),
    #[error("invalid container name: {0}")]
    InvalidName(#[from] nuwa_state::NameError),
    #[error("only deltas travel by gossip")]
    NotGossip,
    #[error("container {container:?} cannot be loaded back from storage: {reason}")]
    Load { container: String, reason: String },
}

impl EngineError {
    /// The container Automerge panicked in, if that is what this error is.
    /// The engine has dropped that container; rebuild it from storage and
    /// give it back with [`Engine::insert_container`].
    pub fn poisoned_container(&self) -> Option<&str> {
        match self {
            EngineError::State { container, source }
                if matches!(**source, StateError::Poisoned(_)) =>
            {
                Some(container)
            }
            _ => None,
        }
    }
}

#[derive(Default)]
struct PeerContainer {
    state: SyncState,
    /// When the last sync message for this container went out or came in;
    /// `None` when no exchange is running.
    active_since_ms: Option<u64>,
    /// When either side's heads last moved during the exchange. An exchange
    /// can keep messages flowing without progress (a change sent in a lost
    /// message stays in Automerge's `sent_hashes` and is never resent), so
    /// stalls are judged by progress, not by traffic.
    last_progress_ms: u64,
    progress_mark: (Vec<Hash>, Option<Vec<Hash>>),
    their_heads: Option<Vec<Hash>>,
    converged: bool,
    /// Our heads when our whole document last went to this peer, which
    /// then held nothing (see `receive`); cleared once it holds something.
    doc_sent_at: Option<Vec<Hash>>,
    /// How many changes the peer said it holds, in its last reconcile
    /// items (0 or absent: not said). For status only.
    their_changes: Option<u64>,
}

impl PeerContainer {
    /// Starts the Automerge sync state afresh (a lost message, a stall, an
    /// evicted document): nothing we sent before counts as sent.
    fn fresh_state(&mut self) {
        self.state = SyncState::new();
        self.doc_sent_at = None;
    }
}

struct Peer {
    containers: BTreeMap<String, PeerContainer>,
    next_summary_ms: u64,
    /// When the last digest went to this peer.
    last_digest_ms: u64,
    /// An exchange ended: send the next digest early.
    digest_due: bool,
    /// Whether a summary or digest from this peer has arrived.
    summary_seen: bool,
    /// Our digest at the moment this peer's last digest equalled it.
    digest_equal: Option<Fingerprint>,
}

impl Peer {
    fn new(now_ms: u64, anti_entropy_ms: u64) -> Self {
        Peer {
            containers: BTreeMap::new(),
            next_summary_ms: now_ms + anti_entropy_ms,
            last_digest_ms: now_ms,
            digest_due: false,
            summary_seen: false,
            digest_equal: None,
        }
    }

    fn exchanging(&self) -> bool {
        self.containers
            .values()
            .any(|pc| pc.active_since_ms.is_some())
    }
}

/// Bytes of an Automerge actor id that [`run_actor`] makes: 8 of the
/// device's public key, then 8 random ones.
pub const RUN_ACTOR_BYTES: usize = 16;

/// The Automerge actor id of one run of a device: the first 8 bytes of its
/// public key (so a change still says which device wrote it) and 8 fresh
/// random bytes. A device never writes under the actor of an earlier run.
/// Automerge numbers an actor's changes 1, 2, 3, …; a home restored from a
/// backup (or copied while its daemon ran) has forgotten the changes it
/// made after the copy, while its peers hold them, so writing on under the
/// old actor would reuse their numbers and every peer would refuse the
/// document that holds both (`DuplicateSeqNumber`) for good. A fresh actor
/// per run cannot clash with anything the device wrote before, whatever
/// its store forgot; the cost is one actor entry (16 bytes) per run in each
/// container the run writes to.
pub fn run_actor(device_public: &[u8; 32]) -> Result<Vec<u8>, nuwa_entropy::Error> {
    let mut actor = [0u8; RUN_ACTOR_BYTES];
    actor[..8].copy_from_slice(&device_public[..8]);
    nuwa_entropy::fill(&mut actor[8..])?;
    Ok(actor.to_vec())
}

/// The engine of one node.
pub struct Engine {
    actor: Vec<u8>,
    config: Config,
    containers: BTreeMap<String, Container>,
    peers: BTreeMap<PeerKey, Peer>,
    pending_local: BTreeMap<String, Vec<Vec<u8>>>,
    /// Item hashes of every container, for digests and reconciliation.
    fingerprints: FingerprintSet,
    /// Containers whose heads may have moved since their item hash was
    /// computed.
    dirty: BTreeSet<String>,
    /// Gossiped changes waiting for [`Engine::apply_queued`], per container.
    queued: BTreeMap<String, Vec<Vec<u8>>>,
    /// The bytes of the changes in `queued`.
    queued_bytes: usize,
    /// Evicted containers: in storage, not in memory (see
    /// [`Engine::evict`]); loaded again through the loader on first use.
    cold: BTreeMap<String, Cold>,
    loader: Option<Loader>,
    /// Last use of each in-memory container, on the engine's clock (the
    /// latest `now_ms` any input carried).
    last_use: BTreeMap<String, u64>,
    now_ms: u64,
    /// Off-loop catch-ups under way, per container.
    running: BTreeMap<String, Running>,
    /// Replies made off the loop, by (peer, container).
    serving: BTreeMap<(PeerKey, String), Serving>,
    /// Catch-ups ready for [`Engine::take_catch_ups`].
    ready: Vec<CatchUp>,
    next_catch_up: u64,
    /// Evicted containers being loaded off the loop, with what came for
    /// them meanwhile (see [`Config::load_off_loop`]).
    loading: BTreeMap<String, Loading>,
    /// Loads waiting for [`Engine::take_loads`], oldest first.
    loads: VecDeque<String>,
    /// Loads handed out and not back yet.
    loads_running: usize,
}

/// What waits for a container loading off the loop, and its bytes.
#[derive(Debug, Default)]
struct Loading {
    held: Vec<HeldForLoad>,
    bytes: usize,
}

/// One input that waits for a container loading off the loop.
#[derive(Debug)]
enum HeldForLoad {
    /// A peer's sync message.
    Sync(PeerKey, Vec<u8>),
    /// An exchange with a peer whose heads differ.
    Start(PeerKey),
    /// Changes that came by gossip.
    Delta(Vec<Vec<u8>>),
}

impl Engine {
    /// The Automerge actor id of this engine's local edits.
    pub fn actor(&self) -> &[u8] {
        &self.actor
    }

    /// A new engine whose local edits carry the Automerge actor id `actor`
    /// (a device's is [`run_actor`]: never one of an earlier run).
    pub fn new(actor: Vec<u8>, config: Config) -> Self {
        Engine {
            actor,
            config,
            containers: BTreeMap::new(),
            peers: BTreeMap::new(),
            pending_local: BTreeMap::new(),
            fingerprints: FingerprintSet::default(),
            dirty: BTreeSet::new(),
            queued: BTreeMap::new(),
            queued_bytes: 0,
            cold: BTreeMap::new(),
            loader: None,
            last_use: BTreeMap::new(),
            now_ms: 0,
            running: BTreeMap::new(),
            serving: BTreeMap::new(),
            ready: Vec::new(),
            next_catch_up: 0,
            loading: BTreeMap::new(),
            loads: VecDeque::new(),
            loads_running: 0,
        }
    }

    /// Sets how evicted containers are loaded again. Without a loader
    /// nothing is evicted.
    pub fn set_loader(&mut self, loader: Loader) {
        self.loader = Some(loader);
    }

    /// Adds a container restored from storage as evicted: only its heads
    /// and change count stay in memory until it is used (start-up with
    /// more containers than memory should hold).
    pub fn insert_cold(&mut self, name: String, heads: Vec<Hash>, changes: usize) {
        self.containers.remove(&name);
        self.last_use.remove(&name);
        self.dirty.insert(name.clone());
        self.cold.insert(name, Cold { heads, changes });
    }

    /// Whether `name` exists, in memory or evicted.
    pub fn contains(&self, name: &str) -> bool {
        self.containers.contains_key(name) || self.cold.contains_key(name)
    }

    /// Containers held, in memory or evicted.
    pub fn container_count(&self) -> usize {
        self.containers.len() + self.cold.len()
    }

    /// Containers in memory.
    pub fn loaded_count(&self) -> usize {
        self.containers.len()
    }

    /// Every container name, in memory or evicted, sorted.
    pub fn container_names(&self) -> Vec<&String> {
        let mut names: Vec<&String> = self.containers.keys().chain(self.cold.keys()).collect();
        names.sort();
        names
    }

    /// The heads of a container, in memory or evicted.
    pub fn heads_of(&self, name: &str) -> Option<Vec<Hash>> {
        match self.containers.get(name) {
            Some(c) => Some(c.heads()),
            None => self.cold.get(name).map(|c| c.heads.clone()),
        }
    }

    /// The number of changes of a container, in memory or evicted.
    pub fn change_count_of(&self, name: &str) -> Option<usize> {
        match self.containers.get(name) {
            Some(c) => Some(c.change_count()),
            None => self.cold.get(name).map(|c| c.changes),
        }
    }

    /// Brings an evicted container back into memory. Returns whether the
    /// container exists (in memory now). A storage failure leaves it
    /// evicted and is an error.
    pub fn ensure_loaded(&mut self, name: &str) -> Result<bool, EngineError> {
        self.touch(name);
        if self.containers.contains_key(name) {
            return Ok(true);
        }
        let Some(cold) = self.cold.get(name) else {
            return Ok(false);
        };
        let want = cold.heads.clone();
        let loader = self.loader.as_mut().ok_or_else(|| EngineError::Load {
            container: name.to_owned(),
            reason: "no loader".into(),
        })?;
        let loaded = loader(name).map_err(|reason| EngineError::Load {
            container: name.to_owned(),
            reason,
        })?;
        self.adopt_loaded(name, want, loaded)?;
        Ok(true)
    }

    /// Puts a container read back from storage in place of its evicted
    /// entry, if storage holds at least what memory held (`want`).
    fn adopt_loaded(
        &mut self,
        name: &str,
        want: Vec<Hash>,
        loaded: Option<Container>,
    ) -> Result<(), EngineError> {
        let container = match loaded {
            Some(c) => c,
            // A container with no change yet (named by a peer, say) has
            // nothing in storage.
            None if want.is_empty() => Container::new(&self.actor),
            None => {
                return Err(EngineError::Load {
                    container: name.to_owned(),
                    reason: "storage holds nothing of it".into(),
                });
            }
        };
        if !container.has_all(&want) {
            return Err(EngineError::Load {
                container: name.to_owned(),
                reason: "storage holds less than memory did".into(),
            });
        }
        self.cold.remove(name);
        if container.heads() != want {
            self.dirty.insert(name.to_owned());
        }
        self.containers.insert(name.to_owned(), container);
        self.touch(name);
        Ok(())
    }

    /// Whether `what` must wait for `name` to load off the loop (it is
    /// evicted and [`Config::load_off_loop`] is on): then it is kept (up to
    /// a bound; beyond it the peer's exchange restarts after a stall, and
    /// anti-entropy brings gossip again) and the load is handed out once.
    fn held_for_load(&mut self, name: &str, what: HeldForLoad) -> bool {
        if !self.config.load_off_loop || !self.cold.contains_key(name) {
            return false;
        }
        let loading = self.loading.entry(name.to_owned()).or_insert_with(|| {
            self.loads.push_back(name.to_owned());
            Loading::default()
        });
        let bytes = match &what {
            HeldForLoad::Sync(_, message) => message.len(),
            HeldForLoad::Delta(changes) => changes.iter().map(Vec::len).sum(),
            HeldForLoad::Start(_) => 0,
        };
        if loading.held.len() < LOAD_HELD_MAX && loading.bytes + bytes <= LOAD_HELD_MAX_BYTES {
            loading.bytes += bytes;
            loading.held.push(what);
        }
        true
    }

    /// Evicted containers to load off the loop now (at most
    /// [`LOADS_MAX_RUNNING`] out at once; the rest wait their turn): read
    /// each from storage (on any thread) and give it to
    /// [`Engine::finish_load`].
    pub fn take_loads(&mut self) -> Vec<String> {
        let n = LOADS_MAX_RUNNING
            .saturating_sub(self.loads_running)
            .min(self.loads.len());
        self.loads_running += n;
        self.loads.drain(..n).collect()
    }

    /// Whether `name` is being loaded off the loop.
    pub fn loading(&self, name: &str) -> bool {
        self.loading.contains_key(name)
    }

    /// An off-loop load is back (`Ok(None)`: storage holds nothing of it).
    /// The container takes its place in memory (unless a local write
    /// loaded it meanwhile), then what waited for it is handled. A failed
    /// load leaves it evicted and drops what waited (peers' exchanges
    /// restart; anti-entropy brings the rest again). Returns the actions
    /// and the errors.
    pub fn finish_load(
        &mut self,
        name: &str,
        loaded: Result<Option<Container>, String>,
        now_ms: u64,
    ) -> (Vec<Action>, Vec<EngineError>) {
        self.clock(now_ms);
        let (mut out, mut errors) = (Vec::new(), Vec::new());
        let Some(Loading { held, .. }) = self.loading.remove(name) else {
            return (out, errors);
        };
        match self.loads.iter().position(|n| n == name) {
            // Back before it was handed out (not the runtime's doing).
            Some(i) => drop(self.loads.remove(i)),
            None => self.loads_running = self.loads_running.saturating_sub(1),
        }
        if let Some(cold) = self.cold.get(name) {
            let want = cold.heads.clone();
            let adopted = loaded
                .map_err(|reason| EngineError::Load {
                    container: name.to_owned(),
                    reason,
                })
                .and_then(|c| self.adopt_loaded(name, want, c));
            if let Err(e) = adopted {
                errors.push(e);
                return (out, errors);
            }
        }
        for what in held {
            let r = match what {
                HeldForLoad::Sync(peer, message) if self.peers.contains_key(&peer) => {
                    self.on_sync(&peer, name, &message, now_ms, &mut out)
                }
                HeldForLoad::Start(peer) if self.peers.contains_key(&peer) => {
                    self.start_sync(&peer, name, now_ms, &mut out);
                    Ok(())
                }
                HeldForLoad::Delta(changes) => {
                    self.apply_delta(name, changes, &mut out).map(|_| ())
                }
                _ => Ok(()),
            };
            if let Err(e) = r {
                errors.push(e);
            }
        }
        (out, errors)
    }

    fn touch(&mut self, name: &str) {
        if let Some(t) = self.last_use.get_mut(name) {
            *t = self.now_ms;
        } else if self.containers.contains_key(name) || self.cold.contains_key(name) {
            self.last_use.insert(name.to_owned(), self.now_ms);
        }
    }

    fn clock(&mut self, now_ms: u64) {
        if self.now_ms == 0 && now_ms > 0 {
            // Containers put in before the clock started (loaded at open)
            // were used then, not at the epoch: a minute from now, not at
            // the first tick, may they leave memory.
            for t in self.last_use.values_mut() {
                *t = now_ms;
            }
        }
        self.now_ms = self.now_ms.max(now_ms);
    }

    /// Whether `name` may leave memory now: everything of it is durable
    /// (the runtime persists every change the turn it appears, and local
    /// changes before they are flushed) and no exchange needs the document.
    fn evictable(&self, name: &str) -> bool {
        self.loader.is_some()
            && self.containers.get(name).is_some_and(|c| !c.is_poisoned())
            && !self.pending_local.contains_key(name)
            && !self.queued.contains_key(name)
            && !self.running.contains_key(name)
            && !self.peers.values().any(|p| {
                p.containers
                    .get(name)
                    .is_some_and(|pc| pc.active_since_ms.is_some())
            })
    }

    /// Drops `name`'s document from memory, keeping its heads (it is loaded
    /// again on first use). Returns whether it was evicted. Call it only
    /// once everything the engine reported for it is durable.
    pub fn evict(&mut self, name: &str) -> bool {
        if !self.evictable(name) {
            return false;
        }
        let Some(c) = self.containers.remove(name) else {
            return false;
        };
        // Sync states built on the document restart from scratch.
        for p in self.peers.values_mut() {
            if let Some(pc) = p.containers.get_mut(name) {
                pc.fresh_state();
            }
        }
        self.cold.insert(
            name.to_owned(),
            Cold {
                heads: c.heads(),
                changes: c.change_count(),
            },
        );
        self.last_use.remove(name);
        true
    }

    /// Evicts the containers not used for `idle_ms`, and then the least
    /// recently used ones until at most `max_loaded` are in memory.
    /// Containers in `keep` stay. Returns how many were evicted.
    pub fn evict_idle(&mut self, idle_ms: u64, max_loaded: usize, keep: &[&str]) -> usize {
        let mut by_age: Vec<(u64, String)> = self
            .containers
            .keys()
            .filter(|n| !keep.contains(&n.as_str()))
            .map(|n| (self.last_use.get(n).copied().unwrap_or(0), n.clone()))
            .collect();
        by_age.sort();
        let mut evicted = 0;
        for (used, name) in by_age {
            let idle = self.now_ms.saturating_sub(used) >= idle_ms;
            if (idle || self.containers.len() > max_loaded) && self.evict(&name) {
                evicted += 1;
            }
        }
        evicted
    }

    /// Adds a container restored from storage.
    pub fn insert_container(&mut self, name: String, container: Container) {
        self.dirty.insert(name.clone());
        self.cold.remove(&name);
        self.last_use.insert(name.clone(), self.now_ms);
        self.containers.insert(name, container);
    }

    /// Brings the item hashes of containers that changed up to date.
    fn refresh_fingerprints(&mut self) {
        for name in std::mem::take(&mut self.dirty) {
            match self.heads_of(&name) {
                Some(heads) => self
                    .fingerprints
                    .set(&name, reconcile::item_hash(&name, &heads)),
                None => self.fingerprints.remove(&name),
            }
        }
    }

    /// The digest of every (container, heads) pair this node holds.
    pub fn digest(&mut self) -> (Fingerprint, u32) {
        self.refresh_fingerprints();
        self.fingerprints.digest()
    }

    /// A container in memory; `None` for one that is evicted (see
    /// [`Engine::ensure_loaded`]) or absent.
    pub fn container(&self, name: &str) -> Option<&Container> {
        self.containers.get(name)
    }

    /// The containers in memory (evicted ones: [`Engine::container_names`]).
    pub fn containers(&self) -> impl Iterator<Item = (&String, &Container)> {
        self.containers.iter()
    }

    pub fn peers(&self) -> impl Iterator<Item = &PeerKey> {
        self.peers.keys()
    }

    /// Whether `container` has the same heads as every connected peer has
    /// last reported.
    /// A digest equal to ours covers every container until one changes.
    pub fn converged_with(&self, peer: &str, container: &str) -> bool {
        let Some(p) = self.peers.get(peer) else {
            return false;
        };
        p.containers.get(container).is_some_and(|pc| pc.converged)
            || (self.contains(container)
                && self.dirty.is_empty()
                && p.digest_equal == Some(self.fingerprints.digest().0))
    }

    /// Whether we hold exactly what `peer` holds: its last digest equals
    /// ours as it is now, or (after a summary) every container we have has
    /// equal heads on both sides.
    pub fn in_sync_with(&mut self, peer: &str) -> bool {
        let (ours, _) = self.digest();
        let Some(p) = self.peers.get(peer) else {
            return false;
        };
        p.summary_seen
            && (p.digest_equal == Some(ours)
                || self
                    .containers
                    .keys()
                    .chain(self.cold.keys())
                    .all(|name| p.containers.get(name).is_some_and(|pc| pc.converged)))
    }

    /// Every container's sync state against `peer`, for status: compares
    /// our heads with the heads the peer last reported. Reads only: it
    /// loads nothing (an evicted container compares by its kept heads).
    pub fn sync_report(&mut self, peer: &str) -> Vec<PeerSync> {
        let (ours_digest, _) = self.digest();
        let Some(p) = self.peers.get(peer) else {
            return Vec::new();
        };
        let all_equal = p.digest_equal == Some(ours_digest);
        let mut names: Vec<&String> = self.containers.keys().chain(self.cold.keys()).collect();
        names.sort();
        names.dedup();
        names
            .into_iter()
            .map(|name| {
                let pc = p.containers.get(name);
                let ours = self.heads_of(name).unwrap_or_default();
                let our_changes = self.change_count_of(name).unwrap_or(0) as u64;
                let (state, behind) = if self.running.contains_key(name.as_str()) {
                    let count = pc
                        .and_then(|pc| pc.their_changes)
                        .map(|t| t.saturating_sub(our_changes))
                        .filter(|n| *n > 0);
                    (PeerSyncState::Syncing, count)
                } else if all_equal || pc.is_some_and(|pc| pc.converged) {
                    (PeerSyncState::InSync, Some(0))
                } else {
                    match pc.and_then(|pc| pc.their_heads.as_ref()) {
                        None => (PeerSyncState::Unknown, None),
                        Some(theirs) if *theirs == ours => (PeerSyncState::InSync, Some(0)),
                        Some(theirs) => {
                            // Heads of theirs we lack: we are behind. Ours
                            // missing from theirs: they are (at least).
                            let have_theirs = match self.containers.get(name) {
                                Some(c) => c.has_all(theirs),
                                None => theirs.iter().all(|h| ours.contains(h)),
                            };
                            // A count said before later changes arrived
                            // by gossip can be stale: 0 then means unknown.
                            let count = pc
                                .and_then(|pc| pc.their_changes)
                                .map(|t| t.saturating_sub(our_changes))
                                .filter(|n| *n > 0);
                            if have_theirs {
                                (PeerSyncState::Ahead, Some(0))
                            } else {
                                (PeerSyncState::Behind, count)
                            }
                        }
                    }
                };
                PeerSync {
                    container: name.clone(),
                    state,
                    behind,
                }
            })
            .collect()
    }

    /// Off-loop catch-ups under way: the container, the peer, the changes
    /// it brings (as the peer counted them; 0 if it did not say) and the
    /// bytes of changes being applied.
    pub fn catch_up_progress(&self) -> Vec<CatchUpProgress> {
        self.running
            .iter()
            .map(|(name, r)| CatchUpProgress {
                container: name.clone(),
                peer: r.peer.clone(),
                changes: self
                    .peers
                    .get(&r.peer)
                    .and_then(|p| p.containers.get(name))
                    .and_then(|pc| pc.their_changes)
                    .map_or(0, |t| {
                        t.saturating_sub(self.change_count_of(name).unwrap_or(0) as u64)
                    }),
                bytes: r
                    .bytes
                    .max(r.new_changes.iter().map(|c| c.len() as u64).sum::<u64>()),
                rounds: r.rounds,
            })
            .collect()
    }

    /// Applies a delta that arrived by gossip (its author need not be a
    /// direct peer). Missing dependencies are left to anti-entropy.
    pub fn handle_gossip(&mut self, payload: SyncPayload) -> Result<Vec<Action>, EngineError> {
        let list = match payload {
            SyncPayload::Delta { container, changes } => vec![(container, changes)],
            SyncPayload::Deltas(list) => list,
            _ => return Err(EngineError::NotGossip),
        };
        let mut out = Vec::new();
        for (container, changes) in list {
            self.apply_delta(&container, changes, &mut out)?;
        }
        Ok(out)
    }

    /// Queues a gossiped delta to be applied by [`Engine::apply_queued`],
    /// together with the others of the same container. Applying one small
    /// change costs Automerge time in proportion to the document (about
    /// 14 ms at 100,000 keys), so a run of deltas is applied in one call.
    pub fn queue_gossip(&mut self, payload: SyncPayload) -> Result<(), EngineError> {
        let list = match payload {
            SyncPayload::Delta { container, changes } => vec![(container, changes)],
            SyncPayload::Deltas(list) => list,
            _ => return Err(EngineError::NotGossip),
        };
        for (container, _) in &list {
            if !self.containers.contains_key(container) {
                nuwa_state::check_container_name(container)?;
            }
        }
        for (container, changes) in list {
            self.queued_bytes += changes.iter().map(Vec::len).sum::<usize>();
            self.queued.entry(container).or_default().extend(changes);
        }
        Ok(())
    }

    /// The bytes of the changes queued for [`Engine::apply_queued`].
    /// Automerge's apply of one batch holds temporary memory in proportion
    /// to it (about 12 times the changes' bytes), so the caller bounds it.
    pub fn queued_bytes(&self) -> usize {
        self.queued_bytes
    }

    /// Applies every queued delta, one Automerge call per container.
    /// Returns the actions and the errors of containers that refused
    /// theirs (the others are applied).
    pub fn apply_queued(&mut self) -> (Vec<Action>, Vec<EngineError>) {
        let mut out = Vec::new();
        let mut errors = Vec::new();
        self.queued_bytes = 0;
        for (container, changes) in std::mem::take(&mut self.queued) {
            if let Err(e) = self.apply_delta(&container, changes, &mut out) {
                errors.push(e);
            }
        }
        (out, errors)
    }

    /// Applies remote changes to `container`, queues their persistence, and
    /// marks the container as no longer converged with any peer when its
    /// heads moved. Returns whether some changes still wait for missing
    /// dependencies.
    fn apply_delta(
        &mut self,
        container: &str,
        changes: Vec<Vec<u8>>,
        out: &mut Vec<Action>,
    ) -> Result<bool, EngineError> {
        if self.config.load_off_loop && self.cold.contains_key(container) {
            // Applied once the container is back in memory.
            self.held_for_load(container, HeldForLoad::Delta(changes));
            return Ok(false);
        }
        let applied = self.apply_to(container, changes)?;
        if !applied.new_changes.is_empty() {
            for peer in self.peers.values_mut() {
                if let Some(pc) = peer.containers.get_mut(container) {
                    pc.converged = false;
                }
            }
            out.push(Action::Persist {
                container: container.to_owned(),
                changes: applied.new_changes,
            });
        }
        Ok(applied.missing_deps)
    }

    fn container_mut(&mut self, name: &str) -> Result<&mut Container, EngineError> {
        self.ensure_loaded(name)?;
        if !self.containers.contains_key(name) {
            nuwa_state::check_container_name(name)?;
            if self.container_count() >= self.config.max_containers {
                return Err(EngineError::TooManyContainers(self.config.max_containers));
            }
            self.containers
                .insert(name.to_owned(), Container::new(&self.actor));
            self.touch(name);
        }
        if !self.dirty.contains(name) {
            self.dirty.insert(name.to_owned());
        }
        // Inserted just above when absent.
        Ok(self.containers.get_mut(name).expect("container present"))
    }

    /// Applies a local put and returns the change bytes (`None` when the
    /// put changed nothing). The caller must persist them durably before
    /// acknowledging the write; they go to peers at the next
    /// [`Engine::flush`].
    pub fn local_put(
        &mut self,
        container: &str,
        key: &str,
        value: &serde_json::Value,
    ) -> Result<Option<Vec<u8>>, EngineError> {
        let Some(change) = self
            .container_mut(container)?
            .put(key, value)
            .map_err(|source| EngineError::State {
                container: container.to_owned(),
                source: Box::new(source),
            })?
        else {
            return Ok(None);
        };
        self.record_local(container, change.clone());
        Ok(Some(change))
    }

    /// Runs a typed edit on `container` (created empty if absent) as one
    /// transaction and queues its change for peers like a put. Returns the
    /// change bytes (`None` when nothing changed), to be persisted before
    /// the write is acknowledged.
    pub fn local_transact<E>(
        &mut self,
        container: &str,
        f: impl FnOnce(&mut nuwa_state::automerge::transaction::Transaction<'_>) -> Result<(), E>,
    ) -> Result<Option<Vec<u8>>, LocalEditError<E>> {
        let change = self
            .container_mut(container)
            .map_err(LocalEditError::Engine)?
            .transact(f)
            .map_err(|e| match e {
                nuwa_state::TransactError::Rejected(e) => LocalEditError::Rejected(e),
                nuwa_state::TransactError::State(source) => {
                    LocalEditError::Engine(EngineError::State {
                        container: container.to_owned(),
                        source: Box::new(source),
                    })
                }
            })?;
        if let Some(change) = &change {
            self.record_local(container, change.clone());
        }
        Ok(change)
    }

    /// Applies change bytes made outside the engine (a deterministic
    /// genesis, for one) as local changes: applied, queued for peers, and
    /// returned so the caller persists them. Changes already present are
    /// skipped.
    pub fn local_apply(
        &mut self,
        container: &str,
        changes: Vec<Vec<u8>>,
    ) -> Result<Vec<Vec<u8>>, EngineError> {
        let applied = self.apply_to(container, changes)?;
        for c in &applied.new_changes {
            self.record_local(container, c.clone());
        }
        Ok(applied.new_changes)
    }

    fn apply_to(
        &mut self,
        container: &str,
        changes: Vec<Vec<u8>>,
    ) -> Result<nuwa_state::Applied, EngineError> {
        let result = self.container_mut(container)?.apply_changes(changes);
        result.map_err(|source| self.state_error(container, source))
    }

    /// Wraps a container's error. A container that Automerge panicked in is
    /// poisoned (empty): it is dropped here, with every peer's sync state
    /// for it, so the caller can rebuild it from storage and insert it again
    /// ([`Engine::insert_container`]); until then it does not exist.
    fn state_error(&mut self, container: &str, source: StateError) -> EngineError {
        if self
            .containers
            .get(container)
            .is_some_and(Container::is_poisoned)
        {
            self.containers.remove(container);
            self.last_use.remove(container);
            self.dirty.insert(container.to_owned());
            for peer in self.peers.values_mut() {
                peer.containers.remove(container);
            }
        }
        EngineError::State {
            container: container.to_owned(),
            source: Box::new(source),
        }
    }

    fn record_local(&mut self, container: &str, change: Vec<u8>) {
        self.pending_local
            .entry(container.to_owned())
            .or_default()
            .push(change);
        for peer in self.peers.values_mut() {
            if let Some(pc) = peer.containers.get_mut(container) {
                pc.converged = false;
            }
        }
    }

    /// Pushes queued local changes to every peer: one delta per container,
    /// with the changes of several small containers packed into one
    /// [`SyncPayload::Deltas`] of up to [`PACK_BYTES`].
    pub fn flush(&mut self) -> Vec<Action> {
        let pending = std::mem::take(&mut self.pending_local);
        let mut payloads: Vec<SyncPayload> = Vec::new();
        let mut pack: Vec<(String, Vec<Vec<u8>>)> = Vec::new();
        let mut pack_bytes = 0;
        let close =
            |pack: &mut Vec<(String, Vec<Vec<u8>>)>, payloads: &mut Vec<SyncPayload>| match pack
                .len()
            {
                0 => {}
                1 => {
                    let (container, changes) = pack.remove(0);
                    payloads.push(SyncPayload::Delta { container, changes });
                }
                _ => payloads.push(SyncPayload::Deltas(std::mem::take(pack))),
            };
        for (container, changes) in pending {
            let bytes: usize = container.len() + changes.iter().map(|c| c.len() + 4).sum::<usize>();
            if bytes > PACK_BYTES {
                payloads.push(SyncPayload::Delta { container, changes });
                continue;
            }
            if pack_bytes + bytes > PACK_BYTES || pack.len() >= PACK_CONTAINERS {
                close(&mut pack, &mut payloads);
                pack_bytes = 0;
            }
            pack_bytes += bytes;
            pack.push((container, changes));
        }
        close(&mut pack, &mut payloads);
        if self.peers.is_empty() {
            return Vec::new();
        }
        let peers: Vec<PeerKey> = self.peers.keys().cloned().collect();
        payloads
            .into_iter()
            .map(|payload| Action::Broadcast {
                peers: peers.clone(),
                payload,
            })
            .collect()
    }

    fn digest_payload(&mut self) -> SyncPayload {
        let (fingerprint, count) = self.digest();
        SyncPayload::Digest { fingerprint, count }
    }

    /// A verified peer connected: start with a digest.
    pub fn peer_up(&mut self, peer: &str, now_ms: u64) -> Vec<Action> {
        self.clock(now_ms);
        self.peers.insert(
            peer.to_owned(),
            Peer::new(now_ms, self.config.anti_entropy_ms),
        );
        vec![Action::Send {
            peer: peer.to_owned(),
            payload: self.digest_payload(),
        }]
    }

    /// The peer went away; its sync sessions end.
    pub fn peer_down(&mut self, peer: &str) {
        self.peers.remove(peer);
        self.serving.retain(|(p, _), _| p != peer);
    }

    /// Periodic work: heads summaries and restarts of stalled exchanges.
    pub fn tick(&mut self, now_ms: u64) -> Vec<Action> {
        self.clock(now_ms);
        let mut out = Vec::new();
        let summary = self.digest_payload();
        let stall = self.config.sync_stall_ms;
        for (key, peer) in self.peers.iter_mut() {
            let early = peer.digest_due
                && now_ms >= peer.last_digest_ms + EARLY_DIGEST_MIN_MS
                && !peer.exchanging();
            if now_ms >= peer.next_summary_ms || early {
                peer.next_summary_ms = now_ms + self.config.anti_entropy_ms;
                peer.last_digest_ms = now_ms;
                peer.digest_due = false;
                out.push(Action::Send {
                    peer: key.clone(),
                    payload: summary.clone(),
                });
            }
            for (name, pc) in peer.containers.iter_mut() {
                if self.running.contains_key(name) {
                    // Waiting for our own catch-up, not for the peer.
                    pc.last_progress_ms = now_ms;
                    continue;
                }
                if pc.active_since_ms.is_some()
                    && now_ms.saturating_sub(pc.last_progress_ms) > stall
                {
                    // A lost message leaves Automerge's state "in flight"
                    // forever; a fresh state re-announces our heads.
                    pc.fresh_state();
                    pc.active_since_ms = None;
                }
            }
        }
        out
    }

    /// Handles one decrypted payload from a verified peer.
    pub fn handle(
        &mut self,
        peer: &str,
        payload: SyncPayload,
        now_ms: u64,
    ) -> Result<Vec<Action>, EngineError> {
        if !self.peers.contains_key(peer) {
            return Err(EngineError::UnknownPeer(peer.to_owned()));
        }
        self.clock(now_ms);
        let mut out = Vec::new();
        match payload {
            SyncPayload::Heads(list) => {
                if let Some(p) = self.peers.get_mut(peer) {
                    p.summary_seen = true;
                }
                for ContainerHeads {
                    container,
                    heads,
                    changes,
                } in list
                {
                    self.on_heads(peer, &container, heads, now_ms, &mut out)?;
                    self.note_their_changes(peer, &container, changes);
                }
            }
            SyncPayload::Digest { fingerprint, count } => {
                self.on_digest(peer, (fingerprint, count), &mut out);
            }
            SyncPayload::Reconcile(parts) => {
                self.on_reconcile(peer, parts, now_ms, &mut out)?;
            }
            SyncPayload::Sync { container, message } => {
                self.on_sync(peer, &container, &message, now_ms, &mut out)?;
            }
            SyncPayload::Delta { container, changes } => {
                self.on_delta(peer, &container, changes, now_ms, &mut out)?;
            }
            SyncPayload::Deltas(list) => {
                for (container, changes) in list {
                    self.on_delta(peer, &container, changes, now_ms, &mut out)?;
                }
            }
        }
        Ok(out)
    }

    fn on_delta(
        &mut self,
        peer: &str,
        container: &str,
        changes: Vec<Vec<u8>>,
        now_ms: u64,
        out: &mut Vec<Action>,
    ) -> Result<(), EngineError> {
        let missing_deps = self.apply_delta(container, changes, out)?;
        let running = self
            .peers
            .get(peer)
            .and_then(|p| p.containers.get(container))
            .is_some_and(|pc| pc.active_since_ms.is_some());
        if missing_deps && !running {
            self.start_sync(peer, container, now_ms, out);
        } else if !missing_deps {
            self.check_converged(peer, container, out);
        }
        Ok(())
    }

    fn on_digest(&mut self, peer: &str, theirs: (Fingerprint, u32), out: &mut Vec<Action>) {
        let ours = self.digest();
        let Some(p) = self.peers.get_mut(peer) else {
            return;
        };
        p.summary_seen = true;
        if theirs == ours {
            p.digest_equal = Some(ours.0);
            for (name, pc) in p.containers.iter_mut() {
                let heads = match self.containers.get(name) {
                    Some(c) => Some(c.heads()),
                    None => self.cold.get(name).map(|c| c.heads.clone()),
                };
                if heads.is_some() {
                    pc.their_heads = heads;
                }
            }
            let names: Vec<String> = p.containers.keys().cloned().collect();
            for name in names {
                self.check_converged(peer, &name, out);
            }
            return;
        }
        p.digest_equal = None;
        let parts = self.answer_range("", None);
        out.push(Action::Send {
            peer: peer.to_owned(),
            payload: SyncPayload::Reconcile(parts),
        });
    }

    fn answer_range(&self, lower: &str, upper: Option<&str>) -> Vec<RangePart> {
        self.fingerprints.answer(lower, upper, |name| {
            (
                self.heads_of(name).unwrap_or_default(),
                self.change_count_of(name).unwrap_or(0) as u64,
            )
        })
    }

    fn on_reconcile(
        &mut self,
        peer: &str,
        parts: Vec<RangePart>,
        now_ms: u64,
        out: &mut Vec<Action>,
    ) -> Result<(), EngineError> {
        self.refresh_fingerprints();
        // An answer that covers every name is the peer's summary too: the
        // one it sent when it verified us may have come before we knew it,
        // and been dropped; without this we said "in sync" only at its next
        // periodic summary (a `sync --once` that had everything waited 5 s).
        let whole = parts.first().is_some_and(|p| p.lower.is_empty())
            && parts.last().is_some_and(|p| p.upper.is_none());
        if whole && let Some(p) = self.peers.get_mut(peer) {
            p.summary_seen = true;
        }
        let mut reply: Vec<RangePart> = Vec::new();
        for part in parts {
            let upper = part.upper.as_deref();
            match part.body {
                RangeBody::Fingerprint { fingerprint, count } => {
                    if self.fingerprints.range_fingerprint(&part.lower, upper)
                        == (fingerprint, count)
                    {
                        continue;
                    }
                    if reply.len() < reconcile::MAX_REPLY_PARTS {
                        reply.extend(self.answer_range(&part.lower, upper));
                    }
                }
                RangeBody::Items(items) => {
                    // The peer's complete list for this range: compare each
                    // container, and offer it what it lacks.
                    let listed: BTreeSet<String> =
                        items.iter().map(|c| c.container.clone()).collect();
                    for ContainerHeads {
                        container,
                        heads,
                        changes,
                    } in items
                    {
                        self.on_heads(peer, &container, heads, now_ms, out)?;
                        self.note_their_changes(peer, &container, changes);
                    }
                    let missing: Vec<String> = self
                        .fingerprints
                        .names_in(&part.lower, upper)
                        .filter(|n| !listed.contains(*n))
                        .cloned()
                        .collect();
                    for name in missing {
                        self.peer_container(peer, &name).their_heads = Some(Vec::new());
                        self.start_sync(peer, &name, now_ms, out);
                    }
                }
            }
        }
        reply.truncate(reconcile::MAX_REPLY_PARTS);
        if !reply.is_empty() {
            out.push(Action::Send {
                peer: peer.to_owned(),
                payload: SyncPayload::Reconcile(reply),
            });
        }
        Ok(())
    }

    fn on_heads(
        &mut self,
        peer: &str,
        container: &str,
        heads: Vec<Hash>,
        now_ms: u64,
        out: &mut Vec<Action>,
    ) -> Result<(), EngineError> {
        let mut heads = heads;
        heads.sort();
        // An evicted container compares by its kept heads; it loads only
        // if they differ (the exchange that follows needs the document).
        let ours = match self.heads_of(container) {
            Some(h) => h,
            None => self.container_mut(container)?.heads(),
        };
        let pc = self.peer_container(peer, container);
        pc.their_heads = Some(heads.clone());
        if ours == heads {
            self.check_converged(peer, container, out);
            return Ok(());
        }
        let stall = self.config.sync_stall_ms;
        if let Some(pc) = self.peer_container_opt(peer, container) {
            pc.converged = false;
            if pc.active_since_ms.is_some() {
                if now_ms.saturating_sub(pc.last_progress_ms) <= stall {
                    // An exchange is running and moving; let it finish.
                    return Ok(());
                }
                // Still different after a stall: start afresh.
                pc.fresh_state();
                pc.active_since_ms = None;
            }
        }
        self.start_sync(peer, container, now_ms, out);
        Ok(())
    }

    fn start_sync(&mut self, peer: &str, container: &str, now_ms: u64, out: &mut Vec<Action>) {
        if self.held_for_load(container, HeldForLoad::Start(peer.to_owned())) {
            return;
        }
        // A container that fails to load is left to the next round.
        if !matches!(self.ensure_loaded(container), Ok(true)) {
            return;
        }
        let Some(doc) = self.containers.get(container) else {
            return;
        };
        let Some(peer_state) = self.peers.get_mut(peer) else {
            return;
        };
        let pc = peer_state
            .containers
            .entry(container.to_owned())
            .or_default();
        let mut msg = doc.generate_sync_message(&mut pc.state);
        if msg.is_none() {
            // The state believes a message is still in flight; a fresh state
            // always produces one.
            pc.fresh_state();
            msg = doc.generate_sync_message(&mut pc.state);
        }
        if let Some(message) = msg {
            pc.active_since_ms = Some(now_ms);
            pc.last_progress_ms = now_ms;
            out.push(Action::Send {
                peer: peer.to_owned(),
                payload: SyncPayload::Sync {
                    container: container.to_owned(),
                    message,
                },
            });
        }
    }

    fn on_sync(
        &mut self,
        peer: &str,
        container: &str,
        message: &[u8],
        now_ms: u64,
        out: &mut Vec<Action>,
    ) -> Result<(), EngineError> {
        if let Some(serving) = self
            .serving
            .get_mut(&(peer.to_owned(), container.to_owned()))
        {
            // Answered once our reply, made off the loop, is out.
            if serving.held.len() < CATCH_UP_HELD_MAX {
                serving.held.push(message.to_vec());
            }
            return Ok(());
        }
        if let Some(r) = self.running.get_mut(container) {
            // Answered once the catch-up is in; the protocol sends one
            // message at a time, so a longer queue is a misbehaving peer
            // (its exchange restarts when it stalls).
            if r.held.len() < CATCH_UP_HELD_MAX {
                r.held.push((peer.to_owned(), message.to_vec()));
            }
            return Ok(());
        }
        if self.held_for_load(
            container,
            HeldForLoad::Sync(peer.to_owned(), message.to_vec()),
        ) {
            return Ok(());
        }
        self.container_mut(container)?;
        let inbound = match SyncInbound::decode(message) {
            Ok(i) => i,
            Err(source) => return Err(self.state_error(container, source)),
        };
        let doc = self.containers.get(container).expect("created above");
        if inbound.change_bytes() > self.config.catch_up_inline_bytes
            && self.running.len() < self.config.catch_up_max_running
            && doc.op_count() <= self.config.catch_up_fork_max_ops
            && !inbound.known_to(doc)
        {
            let bytes = inbound.change_bytes() as u64;
            let base = doc.fork();
            let base_heads = doc.heads();
            let id = self.next_catch_up;
            self.next_catch_up += 1;
            self.running.insert(
                container.to_owned(),
                Running {
                    id,
                    base_heads,
                    peer: peer.to_owned(),
                    message: None,
                    new_changes: Vec::new(),
                    held: Vec::new(),
                    rounds: 1,
                    bytes,
                    whole: 0,
                },
            );
            let pc = self.peer_container(peer, container);
            pc.active_since_ms = Some(now_ms);
            pc.last_progress_ms = now_ms;
            self.ready.push(CatchUp {
                id,
                container: container.to_owned(),
                base,
                work: Work::Message(inbound),
                carried: (0, 0),
            });
            return Ok(());
        }
        self.receive(peer, container, inbound, now_ms, out)
    }

    /// Catch-ups that [`Engine::handle`] set aside since the last call: run
    /// each ([`CatchUp::run`], on any thread) and hand the result to
    /// [`Engine::finish_catch_up`].
    pub fn take_catch_ups(&mut self) -> Vec<CatchUp> {
        std::mem::take(&mut self.ready)
    }

    /// Whether an off-loop catch-up of `container` is under way.
    pub fn catching_up(&self, container: &str) -> bool {
        self.running.contains_key(container)
    }

    /// Takes a finished [`CatchUp`] back. If the container did not move
    /// meanwhile, the caught-up document replaces it (no Automerge work);
    /// otherwise another round applies what was added meanwhile to the
    /// caught-up document (a new [`CatchUp`] to take), or inline after
    /// three rounds. Then the message that started it and the ones held
    /// since are received. Returns the actions and the errors (a refused
    /// message leaves the container as it was).
    pub fn finish_catch_up(
        &mut self,
        mut done: CaughtUp,
        now_ms: u64,
    ) -> (Vec<Action>, Vec<EngineError>) {
        self.clock(now_ms);
        if let Some(served) = done.served.take() {
            let (mut out, mut errors) = (Vec::new(), Vec::new());
            self.finish_serve(
                &done.container,
                done.id,
                served,
                now_ms,
                &mut out,
                &mut errors,
            );
            return (out, errors);
        }
        self.finish_round(done, now_ms)
    }

    /// A round of a catch-up is back (see [`Engine::finish_catch_up`]).
    fn finish_round(&mut self, done: CaughtUp, now_ms: u64) -> (Vec<Action>, Vec<EngineError>) {
        let mut out = Vec::new();
        let mut errors = Vec::new();
        let CaughtUp {
            id,
            container,
            mut doc,
            result,
            message,
            carried: _,
            served: _,
            whole,
        } = done;
        let Some(mut run) = self.running.remove(&container) else {
            return (out, errors);
        };
        if run.id != id {
            // Not ours (cannot happen with one runtime); keep waiting.
            self.running.insert(container, run);
            return (out, errors);
        }
        match result {
            Err(source) => {
                // Only the fork saw the bad input; the live container is
                // intact (so a panic inside is not a poisoned container).
                let source = match source {
                    StateError::Poisoned(why) => StateError::BadSyncMessage(why),
                    other => other,
                };
                errors.push(self.state_error(&container, source));
                if let Some(pc) = self.peer_container_opt(&run.peer, &container) {
                    pc.active_since_ms = None;
                }
            }
            Ok(new_changes) => {
                run.new_changes.extend(new_changes);
                run.whole += whole;
                if run.rounds == 1 {
                    run.message = message;
                }
                let live_heads = self.heads_of(&container);
                let moved = live_heads.as_ref() != Some(&run.base_heads);
                if moved {
                    let extra = self
                        .containers
                        .get(&container)
                        .map(|c| c.changes_since(&run.base_heads))
                        .unwrap_or_default();
                    if run.rounds < CATCH_UP_ROUNDS_MAX {
                        let id = self.next_catch_up;
                        self.next_catch_up += 1;
                        run.id = id;
                        run.rounds += 1;
                        run.base_heads = live_heads.unwrap_or_default();
                        let carried = (
                            run.whole + run.new_changes.len(),
                            run.new_changes.iter().map(Vec::len).sum(),
                        );
                        self.ready.push(CatchUp {
                            id,
                            container: container.clone(),
                            base: doc,
                            work: Work::Changes(extra),
                            carried,
                        });
                        self.running.insert(container, run);
                        return (out, errors);
                    }
                    match applied_beyond(&mut doc, extra) {
                        Ok(released) => run.new_changes.extend(released),
                        Err(source) => {
                            errors.push(self.state_error(&container, source));
                            return (out, errors);
                        }
                    }
                }
                self.swap_in(&container, doc, &mut run, &mut out);
                if let Some(inbound) = run.message.take() {
                    if self.peers.contains_key(&run.peer) {
                        if let Err(e) =
                            self.receive(&run.peer, &container, inbound, now_ms, &mut out)
                        {
                            errors.push(e);
                        }
                    }
                }
            }
        }
        for (peer, message) in run.held {
            if !self.peers.contains_key(&peer) {
                continue;
            }
            if let Err(e) = self.on_sync(&peer, &container, &message, now_ms, &mut out) {
                errors.push(e);
            }
        }
        (out, errors)
    }

    /// The caught-up document takes the live container's place, and what
    /// it added is persisted: a whole document as one snapshot (which also
    /// covers what later rounds released), else its new changes.
    fn swap_in(
        &mut self,
        container: &str,
        doc: Container,
        run: &mut Running,
        out: &mut Vec<Action>,
    ) {
        self.containers.insert(container.to_owned(), doc);
        self.dirty.insert(container.to_owned());
        self.touch(container);
        if run.whole == 0 && run.new_changes.is_empty() {
            return;
        }
        for peer in self.peers.values_mut() {
            if let Some(pc) = peer.containers.get_mut(container) {
                pc.converged = false;
            }
        }
        out.push(if run.whole > 0 {
            Action::PersistWhole {
                container: container.to_owned(),
                changes: run.whole + run.new_changes.len(),
            }
        } else {
            Action::Persist {
                container: container.to_owned(),
                changes: std::mem::take(&mut run.new_changes),
            }
        });
    }

    /// A reply made off the loop is back: it goes to the peer with the
    /// sync state that made it, unless the peer left or its exchange was
    /// restarted meanwhile (a stall); then the messages the peer sent for
    /// the container meanwhile are received.
    fn finish_serve(
        &mut self,
        container: &str,
        id: u64,
        served: Served,
        now_ms: u64,
        out: &mut Vec<Action>,
        errors: &mut Vec<EngineError>,
    ) {
        let key = (served.peer.clone(), container.to_owned());
        let Some(serving) = self.serving.remove(&key) else {
            return;
        };
        if serving.id != id {
            self.serving.insert(key, serving);
            return;
        }
        let peer = served.peer;
        if let Some(pc) = self.peer_container_opt(&peer, container)
            && pc.active_since_ms.is_some()
        {
            pc.state = served.state;
            pc.last_progress_ms = now_ms;
            match served.reply {
                Some(message) => out.push(Action::Send {
                    peer: peer.clone(),
                    payload: SyncPayload::Sync {
                        container: container.to_owned(),
                        message,
                    },
                }),
                None => pc.active_since_ms = None,
            }
        }
        for message in serving.held {
            if let Err(e) = self.on_sync(&peer, container, &message, now_ms, out) {
                errors.push(e);
            }
        }
    }

    /// Receives a decoded sync message into the live container and answers.
    fn receive(
        &mut self,
        peer: &str,
        container: &str,
        inbound: SyncInbound,
        now_ms: u64,
        out: &mut Vec<Action>,
    ) -> Result<(), EngineError> {
        self.container_mut(container)?;
        let doc = self.containers.get_mut(container).expect("created above");
        let peer_state = self
            .peers
            .get_mut(peer)
            .ok_or_else(|| EngineError::UnknownPeer(peer.to_owned()))?;
        let pc = peer_state
            .containers
            .entry(container.to_owned())
            .or_default();
        let new_changes = match doc.receive_inbound(&mut pc.state, inbound) {
            Ok(new) => new,
            Err(source) => return Err(self.state_error(container, source)),
        };
        if !new_changes.is_empty() {
            out.push(Action::Persist {
                container: container.to_owned(),
                changes: new_changes,
            });
        }
        // What the peer says it still needs must be sendable again, even if
        // Automerge believes it already sent it (in a message that was lost).
        if let Some(need) = pc.state.their_need.clone() {
            for h in need {
                pc.state.sent_hashes.remove(&h);
            }
        }
        if let Some(theirs) = &pc.state.their_heads {
            let mut theirs: Vec<Hash> = theirs.iter().map(|h| h.0).collect();
            theirs.sort();
            pc.their_heads = Some(theirs);
        }
        let mark = (doc.heads(), pc.their_heads.clone());
        if mark != pc.progress_mark || pc.active_since_ms.is_none() {
            pc.progress_mark = mark;
            pc.last_progress_ms = now_ms;
        }
        // A peer that holds nothing is answered with the whole document.
        // When both sides opened the exchange, its second message still
        // says it holds nothing (it was sent before our document arrived),
        // and Automerge would save and send the whole document again.
        let theirs_empty = pc.their_heads.as_ref().is_some_and(Vec::is_empty);
        let ours = doc.heads();
        if !theirs_empty {
            pc.doc_sent_at = None;
        }
        if theirs_empty && !ours.is_empty() && pc.doc_sent_at.as_ref() == Some(&ours) {
            pc.active_since_ms = Some(now_ms);
        } else if theirs_empty && !ours.is_empty() && doc.op_count() > self.config.serve_inline_ops
        {
            // The reply is the whole document: Automerge saves it, which
            // takes long for a big one. A copy makes it on a worker; the
            // peer's messages for the container wait (see `finish_serve`).
            pc.doc_sent_at = Some(ours);
            pc.active_since_ms = Some(now_ms);
            let id = self.next_catch_up;
            self.next_catch_up += 1;
            self.serving.insert(
                (peer.to_owned(), container.to_owned()),
                Serving {
                    id,
                    held: Vec::new(),
                },
            );
            self.ready.push(CatchUp {
                id,
                container: container.to_owned(),
                base: doc.fork(),
                work: Work::Serve {
                    peer: peer.to_owned(),
                    state: pc.state.clone(),
                },
                carried: (0, 0),
            });
        } else {
            match doc.generate_sync_message(&mut pc.state) {
                Some(reply) => {
                    if theirs_empty && !ours.is_empty() {
                        pc.doc_sent_at = Some(ours);
                    }
                    pc.active_since_ms = Some(now_ms);
                    out.push(Action::Send {
                        peer: peer.to_owned(),
                        payload: SyncPayload::Sync {
                            container: container.to_owned(),
                            message: reply,
                        },
                    });
                }
                None => pc.active_since_ms = None,
            }
        }
        self.check_converged(peer, container, out);
        Ok(())
    }

    fn peer_container(&mut self, peer: &str, container: &str) -> &mut PeerContainer {
        self.peers
            .get_mut(peer)
            .expect("caller checked the peer")
            .containers
            .entry(container.to_owned())
            .or_default()
    }

    fn peer_container_opt(&mut self, peer: &str, container: &str) -> Option<&mut PeerContainer> {
        self.peers.get_mut(peer)?.containers.get_mut(container)
    }

    /// Records the change count a peer gave with its heads (only for a
    /// container it already has state for: `on_heads` made it).
    fn note_their_changes(&mut self, peer: &str, container: &str, changes: u64) {
        if let Some(pc) = self.peer_container_opt(peer, container) {
            pc.their_changes = (changes > 0).then_some(changes);
        }
    }

    fn check_converged(&mut self, peer: &str, container: &str, out: &mut Vec<Action>) {
        let Some(ours) = self.heads_of(container) else {
            return;
        };
        let Some(pc) = self.peer_container_opt(peer, container) else {
            return;
        };
        let equal = pc.their_heads.as_ref() == Some(&ours);
        let flipped = equal && !pc.converged;
        pc.converged = equal;
        if flipped {
            out.push(Action::Converged {
                peer: peer.to_owned(),
                container: container.to_owned(),
            });
            if let Some(p) = self.peers.get_mut(peer) {
                p.digest_due = true;
            }
        }
    }
}
