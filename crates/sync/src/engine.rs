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
//!   [`SyncPayload::Heads`] summary of all its containers.
//! - A summary whose heads differ from ours starts (or, if stalled, restarts)
//!   the Automerge sync protocol for that container; the protocol's messages
//!   ping-pong until neither side has anything to send.
//! - Local edits are queued and pushed as one [`SyncPayload::Delta`] per
//!   container and peer at each [`Engine::flush`], so that many writes
//!   travel together. A delta whose changes lack dependencies starts the sync
//!   protocol, which fetches whatever is missing.

use std::collections::BTreeMap;

use nuwa_proto::{ContainerHeads, SyncPayload};
use nuwa_state::{Container, Hash, StateError, SyncState};

/// Opaque peer identifier (the runtime uses the libp2p PeerId string).
pub type PeerKey = String;

/// Tunables of the engine.
#[derive(Debug, Clone)]
pub struct Config {
    /// How often each peer gets a heads summary.
    pub anti_entropy_ms: u64,
    /// A sync exchange without progress for this long is restarted.
    pub sync_stall_ms: u64,
    /// Most containers a node holds; summaries naming more are truncated.
    pub max_containers: usize,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            anti_entropy_ms: 5_000,
            sync_stall_ms: 10_000,
            max_containers: 4096,
        }
    }
}

/// What the runtime must do, in this order.
#[derive(Debug, Clone, PartialEq)]
pub enum Action {
    Send {
        peer: PeerKey,
        payload: SyncPayload,
    },
    /// Remote changes newly integrated into `container`; persist them.
    Persist {
        container: String,
        changes: Vec<Vec<u8>>,
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
}

struct Peer {
    containers: BTreeMap<String, PeerContainer>,
    next_summary_ms: u64,
    /// Whether a heads summary from this peer has arrived (so we know every
    /// container it holds).
    summary_seen: bool,
}

/// The engine of one node.
pub struct Engine {
    actor: Vec<u8>,
    config: Config,
    containers: BTreeMap<String, Container>,
    peers: BTreeMap<PeerKey, Peer>,
    pending_local: BTreeMap<String, Vec<Vec<u8>>>,
}

impl Engine {
    /// A new engine whose local edits carry the Automerge actor id `actor`.
    pub fn new(actor: Vec<u8>, config: Config) -> Self {
        Engine {
            actor,
            config,
            containers: BTreeMap::new(),
            peers: BTreeMap::new(),
            pending_local: BTreeMap::new(),
        }
    }

    /// Adds a container restored from storage.
    pub fn insert_container(&mut self, name: String, container: Container) {
        self.containers.insert(name, container);
    }

    pub fn container(&self, name: &str) -> Option<&Container> {
        self.containers.get(name)
    }

    pub fn containers(&self) -> impl Iterator<Item = (&String, &Container)> {
        self.containers.iter()
    }

    pub fn peers(&self) -> impl Iterator<Item = &PeerKey> {
        self.peers.keys()
    }

    /// Whether `container` has the same heads as every connected peer has
    /// last reported.
    pub fn converged_with(&self, peer: &str, container: &str) -> bool {
        self.peers
            .get(peer)
            .and_then(|p| p.containers.get(container))
            .is_some_and(|pc| pc.converged)
    }

    /// Whether we hold exactly what `peer` holds: its summary arrived and
    /// every container we have (a superset of its containers once the
    /// summary was handled) has equal heads on both sides.
    pub fn in_sync_with(&self, peer: &str) -> bool {
        let Some(p) = self.peers.get(peer) else {
            return false;
        };
        p.summary_seen
            && self
                .containers
                .keys()
                .all(|name| p.containers.get(name).is_some_and(|pc| pc.converged))
    }

    /// Applies a delta that arrived by gossip (its author need not be a
    /// direct peer). Missing dependencies are left to anti-entropy.
    pub fn handle_gossip(&mut self, payload: SyncPayload) -> Result<Vec<Action>, EngineError> {
        let SyncPayload::Delta { container, changes } = payload else {
            return Err(EngineError::NotGossip);
        };
        let mut out = Vec::new();
        self.apply_delta(&container, changes, &mut out)?;
        Ok(out)
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
        if !self.containers.contains_key(name) {
            nuwa_state::check_container_name(name)?;
            if self.containers.len() >= self.config.max_containers {
                return Err(EngineError::TooManyContainers(self.config.max_containers));
            }
            self.containers
                .insert(name.to_owned(), Container::new(&self.actor));
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

    /// Pushes queued local changes to every peer, one delta per container.
    pub fn flush(&mut self) -> Vec<Action> {
        let pending = std::mem::take(&mut self.pending_local);
        let mut out = Vec::new();
        for (container, changes) in pending {
            for peer in self.peers.keys() {
                out.push(Action::Send {
                    peer: peer.clone(),
                    payload: SyncPayload::Delta {
                        container: container.clone(),
                        changes: changes.clone(),
                    },
                });
            }
        }
        out
    }

    fn summary(&self) -> SyncPayload {
        SyncPayload::Heads(
            self.containers
                .iter()
                .take(self.config.max_containers)
                .map(|(name, c)| ContainerHeads {
                    container: name.clone(),
                    heads: c.heads(),
                })
                .collect(),
        )
    }

    /// A verified peer connected: start with a heads summary.
    pub fn peer_up(&mut self, peer: &str, now_ms: u64) -> Vec<Action> {
        self.peers.insert(
            peer.to_owned(),
            Peer {
                containers: BTreeMap::new(),
                next_summary_ms: now_ms + self.config.anti_entropy_ms,
                summary_seen: false,
            },
        );
        vec![Action::Send {
            peer: peer.to_owned(),
            payload: self.summary(),
        }]
    }

    /// The peer went away; its sync sessions end.
    pub fn peer_down(&mut self, peer: &str) {
        self.peers.remove(peer);
    }

    /// Periodic work: heads summaries and restarts of stalled exchanges.
    pub fn tick(&mut self, now_ms: u64) -> Vec<Action> {
        let mut out = Vec::new();
        let summary = self.summary();
        let stall = self.config.sync_stall_ms;
        for (key, peer) in self.peers.iter_mut() {
            if now_ms >= peer.next_summary_ms {
                peer.next_summary_ms = now_ms + self.config.anti_entropy_ms;
                out.push(Action::Send {
                    peer: key.clone(),
                    payload: summary.clone(),
                });
            }
            for pc in peer.containers.values_mut() {
                if pc.active_since_ms.is_some()
                    && now_ms.saturating_sub(pc.last_progress_ms) > stall
                {
                    // A lost message leaves Automerge's state "in flight"
                    // forever; a fresh state re-announces our heads.
                    pc.state = SyncState::new();
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
        let mut out = Vec::new();
        match payload {
            SyncPayload::Heads(list) => {
                if let Some(p) = self.peers.get_mut(peer) {
                    p.summary_seen = true;
                }
                for ContainerHeads { container, heads } in list {
                    self.on_heads(peer, &container, heads, now_ms, &mut out)?;
                }
            }
            SyncPayload::Sync { container, message } => {
                self.on_sync(peer, &container, &message, now_ms, &mut out)?;
            }
            SyncPayload::Delta { container, changes } => {
                let missing_deps = self.apply_delta(&container, changes, &mut out)?;
                let running = self
                    .peers
                    .get(peer)
                    .and_then(|p| p.containers.get(&container))
                    .is_some_and(|pc| pc.active_since_ms.is_some());
                if missing_deps && !running {
                    self.start_sync(peer, &container, now_ms, &mut out);
                } else if !missing_deps {
                    self.check_converged(peer, &container, &mut out);
                }
            }
        }
        Ok(out)
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
        let ours = self.container_mut(container)?.heads();
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
                pc.state = SyncState::new();
                pc.active_since_ms = None;
            }
        }
        self.start_sync(peer, container, now_ms, out);
        Ok(())
    }

    fn start_sync(&mut self, peer: &str, container: &str, now_ms: u64, out: &mut Vec<Action>) {
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
            pc.state = SyncState::new();
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
        let new_changes = match doc.receive_sync_message(&mut pc.state, message) {
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
        match doc.generate_sync_message(&mut pc.state) {
            Some(reply) => {
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

    fn check_converged(&mut self, peer: &str, container: &str, out: &mut Vec<Action>) {
        let Some(ours) = self.containers.get(container).map(|c| c.heads()) else {
            return;
        };
        let Some(pc) = self.peer_container_opt(peer, container) else {
            return;
        };
        let equal = pc.their_heads.as_ref() == Some(&ours);
        if equal && !pc.converged {
            out.push(Action::Converged {
                peer: peer.to_owned(),
                container: container.to_owned(),
            });
        }
        pc.converged = equal;
    }
}
