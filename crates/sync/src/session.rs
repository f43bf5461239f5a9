//! The node session: everything a device decides about its peers, free of
//! IO. It owns the sync [`Engine`], the [`Membership`] checks and the
//! [`SecureChannel`], and adds what lies between them:
//!
//! - peer states: connected → `Hello` verified → syncing, with a deadline
//!   for the `Hello`;
//! - `Hello` gating: nothing but a `Hello` is taken from an unverified peer;
//! - opening envelopes from verified peers and from gossip authors;
//! - key epochs: grants forwarded in `Hello`s are checked and adopted, and
//!   envelopes of an epoch whose grant is still on its way are held;
//! - re-checks when the DID log grows: peers that lost authorisation are
//!   dropped, the others get a fresh `Hello` carrying the longer log;
//! - clock skew: a genuine `Hello` from a clock beyond the replay window is
//!   reported with the measured offset.
//!
//! Inputs are method calls carrying `now_ms`; outputs are [`Effect`]s. The
//! runtime performs them in one order, whatever order they come in:
//! persist (changes, DID log, keys) → acknowledge → send, except that
//! changes may be sent before they are flushed (never a DID log or keys:
//! `nuwa_agent::Phases`), so nothing is acknowledged before it is durable
//! here. The session never reads a
//! clock, never does IO and draws randomness only for `Hello` nonces, so
//! the seeded simulator drives many sessions with loss, duplication,
//! reordering, revocations and late grants.

use std::collections::{BTreeMap, VecDeque};

use nuwa_crypto::Envelope;
use nuwa_crypto::epoch::EpochGrant;
use nuwa_proto::{Hello, SyncPayload};

use crate::engine::{Action, Engine, EngineError, PeerKey};
use crate::grant::{GrantOutcome, open_grant};
use crate::membership::{HelloCheck, Membership, Rejection, parse_entries};
use crate::secure::{OpenError, SecureChannel};

/// Tunables of the session.
#[derive(Debug, Clone)]
pub struct SessionConfig {
    /// A connected peer that sends no `Hello` for this long is dropped.
    pub hello_deadline_ms: u64,
    /// How long an envelope of an unknown (newer) epoch waits for its grant.
    pub held_for_ms: u64,
    /// A verified peer gets our `Hello` again at least this often, so that
    /// one lost on a live connection (a full queue drops frames) delays a
    /// newer DID chain or key epoch by this much at most, never for good.
    pub hello_refresh_ms: u64,
    /// Envelopes held at once; the oldest goes first.
    pub max_held: usize,
    /// A peer whose `Hello` has not come gets ours again this often until
    /// it does (or [`SessionConfig::hello_deadline_ms`] runs out): both
    /// first Hellos go out on the first connection, and when that one
    /// closes at once (a redial after a network change replaced it) both
    /// are lost, and both sides would otherwise wait out the deadline.
    pub hello_resend_ms: u64,
    /// A verified peer that sends its `Hello` again gets ours back, at most
    /// this often: it may be the one still waiting for ours (it resends
    /// while it waits).
    pub hello_answer_ms: u64,
}

impl Default for SessionConfig {
    fn default() -> Self {
        SessionConfig {
            hello_deadline_ms: 10_000,
            held_for_ms: 30_000,
            hello_refresh_ms: 300_000,
            max_held: 256,
            hello_resend_ms: 2_000,
            hello_answer_ms: 30_000,
        }
    }
}

/// Where a write came from. Every persisted change carries it, and the
/// runtime reports it with the change event.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Origin {
    /// This device's local API.
    Local,
    /// A peer (direct stream or gossip).
    Peer,
}

impl Origin {
    pub fn as_str(self) -> &'static str {
        match self {
            Origin::Local => "local",
            Origin::Peer => "peer",
        }
    }
}

/// Which door a rejected input came through (for counters and `status`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Door {
    Connection,
    Gossip,
    /// Envelopes pulled from a keeper.
    Keeper,
}

impl Door {
    pub fn as_str(self) -> &'static str {
        match self {
            Door::Connection => "connection",
            Door::Gossip => "gossip",
            Door::Keeper => "keeper",
        }
    }
}

/// Deferred deltas are applied once they hold this many bytes of changes,
/// whatever is still to come in the run: one envelope's worth (512 KiB, the
/// agent's `ENVELOPE_BYTES`). Automerge's apply of one batch holds about 12
/// times the changes' bytes of temporary memory (a 4 MiB keeper page in one
/// call: about 50 MB more at its peak), while batching more than this
/// saves little (the cost of an apply that grows with the document is paid
/// once per 512 KiB).
pub const APPLY_QUEUED_BYTES: usize = 512 * 1024;

/// What became of an envelope pulled from a keeper.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stored {
    /// Opened and applied (or ours, or nothing new).
    Applied,
    /// Sealed under an epoch newer than any key we hold: keep it for later
    /// (its grant comes with a peer's Hello).
    Later,
    /// Refused (counted); skip it.
    Refused,
}

nuwa_counters::table! {
    /// Plain events the runtime counts: each counter's stable name and help,
    /// declared once.
    pub enum Count {
        PeersVerified => "peers_verified", "Peers whose Hello verified";
        HelloRefreshed => "hello_refreshed", "Repeated Hellos of verified peers that verified";
        HelloRefreshSent => "hello_refresh_sent", "Hellos pushed after the DID log grew";
        HelloResent => "hello_resent", "Hellos sent again to a connected peer whose own Hello had not come (the first pair was lost with a connection)";
        HelloAnswered => "hello_answered", "Hellos sent back to a verified peer that sent its Hello again (it may still wait for ours)";
        FrameFromUnverifiedPeer => "frame_from_unverified_peer", "State frames from peers whose Hello has not verified (dropped)";
        PayloadRejected => "payload_rejected", "Opened payloads the sync engine refused";
        EnvelopesHeldForEpoch => "envelopes_held_for_epoch", "Envelopes held until their key epoch's grant arrives";
        EnvelopesHeldForHello => "envelopes_held_for_hello", "Envelopes kept, unopened, from a connected peer until its Hello verifies";
        HeldEnvelopesDropped => "held_envelopes_dropped", "Held envelopes dropped because the hold was full";
        HeldEnvelopesExpired => "held_envelopes_expired", "Held envelopes whose grant never came";
        EpochGrantMissed => "epoch_grant_missed", "Verified peers hung up on because their envelopes' epoch grant never came (the redial's Hellos bring it)";
        EpochGrantsAdopted => "epoch_grants_adopted", "Key epochs adopted from forwarded grants";
        EpochGrantRejected => "epoch_grant_rejected", "Forwarded epoch grants refused";
        GossipDeltasApplied => "gossip_deltas_applied", "Gossip deltas opened and applied";
        DidEntriesRequested => "did_entries_requested", "Pages of DID chain entries asked of a peer whose Hello proved a head this device did not hold";
        DidEntriesServed => "did_entries_served", "Pages of this device's DID chain entries sent to a peer that asked";
        DidEntriesMerged => "did_entries_merged", "Peers' DID chains fetched in full and merged with the fork rule";
        RemovalEvidenceMerged => "removal_evidence_merged", "Hellos whose lost DID branches removed a device this chain listed (strong removal) or won the fork rule";
        RemovalEvidenceRefused => "removal_evidence_refused", "Lost DID branches in Hellos that did not connect to this chain or did not verify";
        KeeperChainMerged => "keeper_chain_merged", "DID chains served by a keeper that changed this device's chain (merged with the fork rule)";
        KeeperChainRefused => "keeper_chain_refused", "DID chains served by a keeper that did not connect to this chain or did not verify";
    }
}

/// What the runtime must do. [`Session`] returns them in the order they
/// arose; the runtime performs them by kind (see the module docs).
#[derive(Debug)]
pub enum Effect {
    /// Persist these changes of `container` durably (group commit).
    Persist {
        container: String,
        changes: Vec<Vec<u8>>,
        origin: Origin,
        /// When the envelope that brought them was sealed (the sender's
        /// clock), for propagation latency; `None` for local changes and
        /// for changes released by other means.
        sealed_at_ms: Option<u64>,
    },
    /// A whole document came into `container`, which held nothing (a cold
    /// sync): persist the container's document as one snapshot, durably
    /// (group commit). `changes` is how many it brought.
    PersistWhole {
        container: String,
        changes: usize,
    },
    /// The DID log grew: persist [`Session::log`] before any `Hello` that
    /// carries it goes out.
    PersistLog,
    /// A new key epoch was adopted: persist the key ring, and `grant` when
    /// the epoch is the newest (it is forwarded in every `Hello`).
    PersistKeys {
        grant: Option<Vec<u8>>,
    },
    /// Send this `Hello` (unsealed: it is what lets the peer trust us).
    SendHello {
        peer: PeerKey,
        hello: Box<Hello>,
    },
    /// Send this unsealed frame (DID chain entries and requests for them:
    /// public material).
    SendFrame {
        peer: PeerKey,
        frame: Box<nuwa_proto::Frame>,
    },
    /// Seal this payload under the current epoch and send it.
    Send {
        peer: PeerKey,
        payload: SyncPayload,
    },
    /// Seal this payload once and send it to every one of `peers` (a live
    /// delta: one gossip publish where it fits).
    Broadcast {
        peers: Vec<PeerKey>,
        payload: SyncPayload,
    },
    /// Close every connection to the peer.
    Disconnect {
        peer: PeerKey,
    },
    /// The peer is a verified device of this agent from now on.
    PeerVerified {
        peer: PeerKey,
        context_id: String,
        name: String,
    },
    /// A verified peer went away.
    PeerGone {
        peer: PeerKey,
        context_id: String,
    },
    /// An input was refused.
    Rejected {
        peer: PeerKey,
        door: Door,
        rejection: Rejection,
    },
    /// An envelope did not open (counted per reason).
    EnvelopeRejected {
        peer: PeerKey,
        label: &'static str,
        reason: String,
    },
    /// The DID log grew (this device may have lost its own authorisation:
    /// [`Session::self_authorised`]).
    LogExtended,
    /// A new key epoch was adopted.
    EpochAdopted {
        peer: PeerKey,
        epoch: u64,
    },
    /// A verified peer's Hello shows no grant of our current key epoch,
    /// and the grant we forward is not sealed to it: an admin may seal the
    /// key to it alone ([`Session::send_grant`]). Once per peer and epoch.
    PeerLacksEpoch {
        peer: PeerKey,
        context_id: String,
        epoch: u64,
    },
    /// A forwarded grant was refused.
    GrantRejected {
        peer: PeerKey,
        reason: String,
    },
    /// A container now has the same heads as the peer.
    Converged {
        peer: PeerKey,
        container: String,
    },
    /// Automerge panicked on peer input in `container`; the engine dropped
    /// it. Rebuild it from storage and give it back with
    /// [`Session::insert_container`].
    Poisoned {
        container: String,
        error: String,
    },
    /// The peer's clock is beyond the replay window (its `Hello` was
    /// refused; this carries the measured offset).
    ClockSkew {
        peer: PeerKey,
        offset_ms: i64,
    },
    Count(Count),
}

/// A connected peer as the session sees it.
#[derive(Debug, Clone)]
pub enum PeerState {
    /// Connected; `Hello` not yet verified. Nothing but a `Hello` is taken.
    Pending {
        public: [u8; 32],
        remote: String,
        since_ms: u64,
    },
    Verified {
        context_id: String,
        name: String,
        public: [u8; 32],
        remote: String,
        since_ms: u64,
        clock_offset_ms: i64,
    },
}

/// A peer's Hello waiting for the DID entries its proof's head needs.
struct Fetch {
    hello: Hello,
    /// Our chain spliced with the pages received so far.
    candidate: Option<nuwa_identity::chain::DidChain>,
    /// The seq the outstanding request asked from.
    asked_from: u64,
    /// Whether the request already went back to seq 1 (a deep fork).
    from_start: bool,
    /// Most entries the fetched chain may hold: the proven head's seq plus
    /// [`DID_ENTRIES_SLACK`] (the peer's chain may grow meanwhile), so a
    /// peer cannot make us hold pages its proof does not vouch for.
    max_len: usize,
}

/// Entries a fetched chain may hold beyond the head its `Hello` proved.
pub const DID_ENTRIES_SLACK: usize = 1024;

/// Largest page of DID entries this session serves in one frame.
pub const DID_ENTRIES_PAGE_BYTES: usize = 1024 * 1024;
/// Refused grants kept to try again when the chain grows (one per peer).
const MAX_GRANT_RETRIES: usize = 256;
/// Envelopes kept from peers whose Hello is being checked, per peer and in
/// all (see [`Session::hold_early`]): a digest and a little more.
const MAX_EARLY_PER_PEER: usize = 4;
const MAX_EARLY: usize = 64;
/// Largest envelope kept so (a digest seals to under 200 bytes; frames may
/// be 8 MiB, and anyone who connects is pending until its Hello): at most
/// 256 KiB in all.
const MAX_EARLY_BYTES: usize = 4096;

struct Held {
    at_ms: u64,
    peer: PeerKey,
    env: Envelope,
}

/// One device's session with its peers.
pub struct Session {
    membership: Membership,
    secure: SecureChannel,
    engine: Engine,
    config: SessionConfig,
    peers: BTreeMap<PeerKey, PeerState>,
    held: VecDeque<Held>,
    /// Envelopes from connected peers whose `Hello` is still being checked
    /// (see [`Session::hold_early`]).
    early: VecDeque<Held>,
    /// Last clock offset measured per peer that was refused for skew.
    skewed: BTreeMap<PeerKey, i64>,
    /// Peers told of as lacking our epoch ([`Effect::PeerLacksEpoch`]),
    /// with that epoch; bounded.
    lacking: BTreeMap<PeerKey, u64>,
    /// Grants of verified peers refused against our document as it was
    /// (an issuer it did not list as admin yet, a device it still listed),
    /// tried again when our chain grows: the chain that makes them valid
    /// may come after the Hello that carried them, from another peer.
    grant_retry: BTreeMap<PeerKey, Vec<u8>>,
    /// Queue gossiped deltas instead of applying them (see `defer_gossip`).
    defer_gossip: bool,
    /// Earliest seal time among the queued deltas.
    queued_sealed_at: Option<u64>,
    /// Peers whose Hello waits for their DID entries.
    fetching: BTreeMap<PeerKey, Fetch>,
    /// No unasked-for page of entries is looked at before this time.
    next_unasked_ms: u64,
    /// Refused peers that were sent entries: their connection closes at
    /// this time (closing at once could cut the page off).
    closing: BTreeMap<PeerKey, u64>,
    /// When each peer last got our `Hello`.
    hello_sent_ms: BTreeMap<PeerKey, u64>,
    /// When each verified peer last got our `Hello` back for one of its own.
    hello_answered_ms: BTreeMap<PeerKey, u64>,
}

/// How long a refused peer that was sent the entries past its head keeps
/// its connection, so the page reaches it before the close.
pub const CLOSE_AFTER_ENTRIES_MS: u64 = 2000;

/// At most one page of DID entries nobody asked for is looked at per this
/// many milliseconds, whoever sends it (each costs a verification).
pub const UNASKED_ENTRIES_EVERY_MS: u64 = 1000;

impl Session {
    pub fn new(
        membership: Membership,
        secure: SecureChannel,
        engine: Engine,
        config: SessionConfig,
    ) -> Self {
        Session {
            membership,
            secure,
            engine,
            config,
            peers: BTreeMap::new(),
            held: VecDeque::new(),
            early: VecDeque::new(),
            skewed: BTreeMap::new(),
            lacking: BTreeMap::new(),
            grant_retry: BTreeMap::new(),
            defer_gossip: false,
            queued_sealed_at: None,
            fetching: BTreeMap::new(),
            next_unasked_ms: 0,
            closing: BTreeMap::new(),
            hello_sent_ms: BTreeMap::new(),
            hello_answered_ms: BTreeMap::new(),
        }
    }

    pub fn membership(&self) -> &Membership {
        &self.membership
    }

    pub fn secure(&self) -> &SecureChannel {
        &self.secure
    }

    pub fn engine(&self) -> &Engine {
        &self.engine
    }

    pub fn log(&self) -> &nuwa_identity::chain::DidChain {
        self.membership.log()
    }

    pub fn peers(&self) -> &BTreeMap<PeerKey, PeerState> {
        &self.peers
    }

    /// Verified peers: (peer, context id).
    pub fn verified(&self) -> impl Iterator<Item = (&PeerKey, &str)> {
        self.peers.iter().filter_map(|(p, s)| match s {
            PeerState::Verified { context_id, .. } => Some((p, context_id.as_str())),
            PeerState::Pending { .. } => None,
        })
    }

    /// Peers refused for clock skew, with the offset last measured.
    pub fn skewed(&self) -> &BTreeMap<PeerKey, i64> {
        &self.skewed
    }

    /// Envelopes waiting for their epoch's grant.
    pub fn held_len(&self) -> usize {
        self.held.len()
    }

    pub fn self_authorised(&self, now_ms: u64) -> Result<(), Rejection> {
        self.membership.self_authorised(now_ms)
    }

    /// Gives back a container restored from storage.
    pub fn insert_container(&mut self, name: String, container: nuwa_state::Container) {
        self.engine.insert_container(name, container);
    }

    /// Seals a payload under the current epoch, signed by this device.
    pub fn seal(
        &self,
        payload: &SyncPayload,
        now_ms: u64,
    ) -> Result<Envelope, nuwa_crypto::CryptoError> {
        self.secure.seal(self.membership.device(), payload, now_ms)
    }

    // ---- local writes -----------------------------------------------------

    /// A local put. The change (if any) must be persisted with
    /// [`Origin::Local`] before it is acknowledged; it reaches peers at the
    /// next [`Session::flush`].
    pub fn local_put(
        &mut self,
        container: &str,
        key: &str,
        value: &serde_json::Value,
    ) -> Result<Option<Vec<u8>>, EngineError> {
        self.engine.local_put(container, key, value)
    }

    /// A typed local edit as one transaction (see [`Engine::local_transact`]).
    pub fn local_transact<E>(
        &mut self,
        container: &str,
        f: impl FnOnce(&mut nuwa_state::automerge::transaction::Transaction<'_>) -> Result<(), E>,
    ) -> Result<Option<Vec<u8>>, crate::LocalEditError<E>> {
        self.engine.local_transact(container, f)
    }

    /// Local changes made outside the engine (see [`Engine::local_apply`]).
    pub fn local_apply(
        &mut self,
        container: &str,
        changes: Vec<Vec<u8>>,
    ) -> Result<Vec<Vec<u8>>, EngineError> {
        self.engine.local_apply(container, changes)
    }

    /// Pushes queued local changes to every verified peer. Call it only once
    /// those changes are durable.
    pub fn flush(&mut self) -> Vec<Effect> {
        let mut out = Vec::new();
        let actions = self.engine.flush();
        self.engine_actions(actions, &mut out);
        out
    }

    // ---- connections -----------------------------------------------------

    /// A connection came up. `public` is the Ed25519 key behind the peer's
    /// PeerId (`None`: not an Ed25519 identity, never one of our devices).
    pub fn connected(
        &mut self,
        peer: &str,
        public: Option<[u8; 32]>,
        remote: String,
        now_ms: u64,
    ) -> Vec<Effect> {
        let mut out = Vec::new();
        let Some(public) = public else {
            out.push(Effect::Rejected {
                peer: peer.to_owned(),
                door: Door::Connection,
                rejection: Rejection::UnknownKey,
            });
            out.push(Effect::Disconnect {
                peer: peer.to_owned(),
            });
            return out;
        };
        if matches!(self.peers.get(peer), Some(PeerState::Verified { .. })) {
            // Another connection to a verified peer: nothing changes.
            return out;
        }
        self.peers.insert(
            peer.to_owned(),
            PeerState::Pending {
                public,
                remote,
                since_ms: now_ms,
            },
        );
        self.push_hello(peer, now_ms, &mut out);
        out
    }

    /// Every connection to the peer closed.
    pub fn disconnected(&mut self, peer: &str) -> Vec<Effect> {
        let mut out = Vec::new();
        self.fetching.remove(peer);
        self.hello_sent_ms.remove(peer);
        self.hello_answered_ms.remove(peer);
        self.early.retain(|h| h.peer != peer);
        if let Some(PeerState::Verified { context_id, .. }) = self.peers.remove(peer) {
            out.push(Effect::PeerGone {
                peer: peer.to_owned(),
                context_id,
            });
        }
        self.engine.peer_down(peer);
        out
    }

    /// The runtime is done with a peer (a pairing that ended): forget it and
    /// close its connections.
    pub fn hang_up(&mut self, peer: &str) -> Vec<Effect> {
        let mut out = Vec::new();
        self.drop_peer(peer, &mut out);
        out
    }

    /// Forgets a peer and asks the runtime to close its connections.
    fn drop_peer(&mut self, peer: &str, out: &mut Vec<Effect>) {
        self.forget_peer(peer);
        out.push(Effect::Disconnect {
            peer: peer.to_owned(),
        });
    }

    /// Forgets a peer's state; nothing more is taken from it.
    fn forget_peer(&mut self, peer: &str) {
        self.peers.remove(peer);
        self.hello_sent_ms.remove(peer);
        self.hello_answered_ms.remove(peer);
        self.fetching.remove(peer);
        self.engine.peer_down(peer);
    }

    /// Keeps a pending peer's `Hello` deadline from running out while the
    /// runtime talks to it on another protocol (pairing).
    pub fn touch_pending(&mut self, peer: &str, now_ms: u64) {
        if let Some(PeerState::Pending { since_ms, .. }) = self.peers.get_mut(peer) {
            *since_ms = now_ms;
        }
    }

    fn push_hello(&mut self, peer: &str, now_ms: u64, out: &mut Vec<Effect>) {
        self.hello_sent_ms.insert(peer.to_owned(), now_ms);
        // `hello` fails only if the OS has no randomness or the log cannot
        // be serialised; the peer then times out and is redialed.
        if let Ok(hello) = self.membership.hello(now_ms) {
            out.push(Effect::SendHello {
                peer: peer.to_owned(),
                hello: Box::new(hello),
            });
        }
    }

    // ---- frames ------------------------------------------------------------

    /// A `Hello` arrived from `peer`.
    pub fn on_hello(&mut self, peer: &str, hello: &Hello, now_ms: u64) -> Vec<Effect> {
        let mut out = Vec::new();
        // A newer Hello replaces one that waited for entries.
        self.fetching.remove(peer);
        self.check_hello(peer, hello, now_ms, false, &mut out);
        out
    }

    fn check_hello(
        &mut self,
        peer: &str,
        hello: &Hello,
        now_ms: u64,
        entries_merged: bool,
        out: &mut Vec<Effect>,
    ) {
        let (public, remote, verified) = match self.peers.get(peer) {
            Some(PeerState::Pending { public, remote, .. }) => (*public, remote.clone(), false),
            Some(PeerState::Verified { public, remote, .. }) => (*public, remote.clone(), true),
            None => {
                out.push(Effect::Count(Count::FrameFromUnverifiedPeer));
                return;
            }
        };
        let v = match self
            .membership
            .verify_hello(&public, hello, now_ms, entries_merged)
        {
            Ok(HelloCheck::Verified(v)) => v,
            Ok(HelloCheck::NeedEntries { from_seq, head_seq }) => {
                self.touch_pending(peer, now_ms);
                let max_len = usize::try_from(head_seq)
                    .unwrap_or(usize::MAX)
                    .saturating_add(1 + DID_ENTRIES_SLACK);
                self.fetching.insert(
                    peer.to_owned(),
                    Fetch {
                        hello: hello.clone(),
                        candidate: None,
                        asked_from: from_seq,
                        from_start: from_seq <= 1,
                        max_len,
                    },
                );
                self.ask_entries(peer, from_seq, out);
                return;
            }
            Err(r) => {
                self.note_skew(peer, &r, out);
                self.take_refused_evidence(&r, hello, now_ms, out);
                // A device refused because our document no longer lists it
                // (revoked) cannot learn why from anyone else: send it the
                // entries past its head before hanging up. Only for a
                // genuine proof of this agent's chain that we hold.
                let owed = matches!(r, Rejection::UnknownKey | Rejection::KeyExpired)
                    .then(|| self.membership.entries_owed(&public, hello, now_ms))
                    .flatten();
                if let Some(from_seq) = owed {
                    self.send_entries(peer, from_seq, out);
                }
                out.push(Effect::Rejected {
                    peer: peer.to_owned(),
                    door: Door::Connection,
                    rejection: r,
                });
                if owed.is_some() && self.closing.len() < 1024 {
                    // Forget it now, hang up once the page had time to arrive.
                    self.forget_peer(peer);
                    self.closing
                        .insert(peer.to_owned(), now_ms + CLOSE_AFTER_ENTRIES_MS);
                } else {
                    self.drop_peer(peer, out);
                }
                return;
            }
        };
        self.skewed.remove(peer);
        self.check_peer_epoch(peer, &v.context_id, &v.epoch_grant, out);
        // The evidence may remove the sender itself.
        if self.take_evidence(hello, now_ms, out)
            && let Err(r) = self.membership.authorise_public(&public, now_ms)
        {
            out.push(Effect::Rejected {
                peer: peer.to_owned(),
                door: Door::Connection,
                rejection: r,
            });
            self.drop_peer(peer, out);
            return;
        }
        if verified {
            self.on_hello_again(peer, &v, now_ms, out);
            return;
        }
        out.push(Effect::Count(Count::PeersVerified));
        out.push(Effect::PeerVerified {
            peer: peer.to_owned(),
            context_id: v.context_id.clone(),
            name: v.name.clone(),
        });
        self.peers.insert(
            peer.to_owned(),
            PeerState::Verified {
                context_id: v.context_id,
                name: v.name,
                public,
                remote,
                since_ms: now_ms,
                clock_offset_ms: v.clock_offset_ms,
            },
        );
        self.on_grant(peer, &v.epoch_grant, now_ms, out);
        let actions = self.engine.peer_up(peer, now_ms);
        self.engine_actions(actions, out);
        self.replay_early(peer, now_ms, out);
    }

    /// A verified peer's Hello again: its DID log grew, or ours did not
    /// reach it (see [`SessionConfig::hello_answer_ms`]).
    fn on_hello_again(
        &mut self,
        peer: &str,
        v: &crate::membership::VerifiedPeer,
        now_ms: u64,
        out: &mut Vec<Effect>,
    ) {
        // A verified peer re-sends its Hello when its DID log grew, or
        // when ours did not reach it: answer, at most every
        // `hello_answer_ms`, so that a lost Hello of ours costs it
        // one resend instead of its whole deadline.
        out.push(Effect::Count(Count::HelloRefreshed));
        let answered = self.hello_answered_ms.get(peer).copied();
        if answered.is_none_or(|at| now_ms.saturating_sub(at) >= self.config.hello_answer_ms) {
            self.hello_answered_ms.insert(peer.to_owned(), now_ms);
            out.push(Effect::Count(Count::HelloAnswered));
            self.push_hello(peer, now_ms, out);
        }
        if let Some(PeerState::Verified {
            clock_offset_ms, ..
        }) = self.peers.get_mut(peer)
        {
            *clock_offset_ms = v.clock_offset_ms;
        }
        self.on_grant(peer, &v.epoch_grant, now_ms, out);
    }

    /// A page nobody asked for: what a peer that refuses us sends before it
    /// hangs up (we were revoked, and no peer will admit us to tell us
    /// otherwise), possibly after its disconnect was processed. Taken only
    /// when it continues our chain exactly at its head (so it can only
    /// extend it, and `merge` checks just the new entries), and at most one
    /// per [`UNASKED_ENTRIES_EVERY_MS`] from anyone; anything else is
    /// counted and dropped.
    fn unasked_entries(
        &mut self,
        peer: &str,
        from_seq: u64,
        entries_json: &[u8],
        now_ms: u64,
        out: &mut Vec<Effect>,
    ) {
        let ours = self.membership.log().len() as u64;
        if from_seq != ours || now_ms < self.next_unasked_ms {
            out.push(Effect::Count(Count::FrameFromUnverifiedPeer));
            return;
        }
        self.next_unasked_ms = now_ms.saturating_add(UNASKED_ENTRIES_EVERY_MS);
        let spliced = parse_entries(entries_json)
            .ok()
            .and_then(|entries| self.membership.log().splice(&entries).ok().flatten());
        let Some(chain) = spliced else {
            out.push(Effect::Count(Count::FrameFromUnverifiedPeer));
            return;
        };
        let was = self.membership.log().head_hash().to_owned();
        match self.membership.merge_log(&chain, now_ms) {
            Ok(outcome) if outcome.changed() => {
                out.push(Effect::Count(Count::DidEntriesMerged));
                self.after_log_extended(&was, now_ms, true, out);
            }
            Ok(_) => out.push(Effect::Count(Count::FrameFromUnverifiedPeer)),
            Err(rejection) => out.push(Effect::Rejected {
                peer: peer.to_owned(),
                door: Door::Connection,
                rejection,
            }),
        }
    }

    fn ask_entries(&mut self, peer: &str, from_seq: u64, out: &mut Vec<Effect>) {
        out.push(Effect::Count(Count::DidEntriesRequested));
        out.push(Effect::SendFrame {
            peer: peer.to_owned(),
            frame: Box::new(nuwa_proto::Frame::DidEntriesRequest { from_seq }),
        });
    }

    /// A peer asks for our DID chain's entries from `from_seq` on. The
    /// entries are public (what a DHT pointer or a keeper carries), but a
    /// page is up to 1 MiB for a few bytes asked: only a verified peer, or
    /// one whose own listed key made us fetch its entries (two branches,
    /// each side behind the other), is served.
    pub fn on_did_request(&mut self, peer: &str, from_seq: u64) -> Vec<Effect> {
        let mut out = Vec::new();
        let verified = matches!(self.peers.get(peer), Some(PeerState::Verified { .. }));
        if !verified && !self.fetching.contains_key(peer) {
            out.push(Effect::Count(Count::FrameFromUnverifiedPeer));
            return out;
        }
        self.send_entries(peer, from_seq, &mut out);
        out
    }

    /// One page of our chain's entries from `from_seq` on, to `peer`.
    fn send_entries(&self, peer: &str, from_seq: u64, out: &mut Vec<Effect>) {
        let (entries_json, more) = self
            .membership
            .entries_page(from_seq, DID_ENTRIES_PAGE_BYTES);
        out.push(Effect::Count(Count::DidEntriesServed));
        out.push(Effect::SendFrame {
            peer: peer.to_owned(),
            frame: Box::new(nuwa_proto::Frame::DidEntries {
                from_seq,
                entries_json,
                more,
            }),
        });
    }

    /// A page of DID entries we asked `peer` for. Splices it onto our chain
    /// (or the pages before it); once the last page is in, merges the result
    /// with the fork rule and checks the peer's waiting Hello again.
    pub fn on_did_entries(
        &mut self,
        peer: &str,
        from_seq: u64,
        entries_json: &[u8],
        more: bool,
        now_ms: u64,
    ) -> Vec<Effect> {
        let mut out = Vec::new();
        let Some(mut fetch) = self.fetching.remove(peer) else {
            self.unasked_entries(peer, from_seq, entries_json, now_ms, &mut out);
            return out;
        };
        let reject = |this: &mut Session, r: Rejection, out: &mut Vec<Effect>| {
            out.push(Effect::Rejected {
                peer: peer.to_owned(),
                door: Door::Connection,
                rejection: r,
            });
            this.drop_peer(peer, out);
        };
        if from_seq != fetch.asked_from {
            reject(
                self,
                Rejection::DidEntries(format!(
                    "answered from seq {from_seq}, asked from {}",
                    fetch.asked_from
                )),
                &mut out,
            );
            return out;
        }
        let entries = match parse_entries(entries_json) {
            Ok(e) => e,
            Err(r) => {
                reject(self, r, &mut out);
                return out;
            }
        };
        if entries.first().map(|e| e.seq()) != Some(from_seq) {
            reject(
                self,
                Rejection::DidEntries(format!("the page does not start at seq {from_seq}")),
                &mut out,
            );
            return out;
        }
        let base = fetch.candidate.as_ref().unwrap_or(self.membership.log());
        let after = base
            .len()
            .min(usize::try_from(from_seq).unwrap_or(usize::MAX));
        if after.saturating_add(entries.len()) > fetch.max_len {
            reject(
                self,
                Rejection::DidEntries(format!(
                    "more entries than the proven head (seq {}) accounts for",
                    fetch.max_len - 1 - DID_ENTRIES_SLACK
                )),
                &mut out,
            );
            return out;
        }
        let spliced = match base.splice(&entries) {
            Ok(Some(c)) => c,
            Ok(None) if fetch.candidate.is_none() && !fetch.from_start => {
                // Forked before `from_seq`: ask for the whole chain.
                fetch.asked_from = 1;
                fetch.from_start = true;
                self.touch_pending(peer, now_ms);
                self.fetching.insert(peer.to_owned(), fetch);
                self.ask_entries(peer, 1, &mut out);
                return out;
            }
            Ok(None) => {
                reject(
                    self,
                    Rejection::DidEntries("the page does not connect to the chain".into()),
                    &mut out,
                );
                return out;
            }
            Err(e) => {
                reject(self, Rejection::DidEntries(e.to_string()), &mut out);
                return out;
            }
        };
        if more {
            let next = spliced.len() as u64;
            fetch.candidate = Some(spliced);
            fetch.asked_from = next;
            self.touch_pending(peer, now_ms);
            self.fetching.insert(peer.to_owned(), fetch);
            self.ask_entries(peer, next, &mut out);
            return out;
        }
        let was = self.membership.log().head_hash().to_owned();
        match self.membership.merge_log(&spliced, now_ms) {
            Ok(outcome) => {
                out.push(Effect::Count(Count::DidEntriesMerged));
                if outcome.changed() {
                    self.after_log_extended(&was, now_ms, true, &mut out);
                }
            }
            Err(r) => {
                reject(self, r, &mut out);
                return out;
            }
        }
        // `after_log_extended` may have dropped the peer.
        if self.peers.contains_key(peer) {
            let hello = fetch.hello;
            self.check_hello(peer, &hello, now_ms, true, &mut out);
        }
        out
    }

    fn note_skew(&mut self, peer: &str, r: &Rejection, out: &mut Vec<Effect>) {
        if let Rejection::ClockSkew { offset_ms, .. } = r {
            self.skewed.insert(peer.to_owned(), *offset_ms);
            // Bounded by the peers that ever connected with a genuine
            // Hello; keep the most recent ones only.
            while self.skewed.len() > 256 {
                self.skewed.pop_first();
            }
            out.push(Effect::ClockSkew {
                peer: peer.to_owned(),
                offset_ms: *offset_ms,
            });
        }
    }

    /// A sealed envelope arrived from `peer` over the direct stream.
    pub fn on_envelope(&mut self, peer: &str, env: Envelope, now_ms: u64) -> Vec<Effect> {
        let mut out = Vec::new();
        self.open_and_handle(peer, env, now_ms, true, &mut out);
        out
    }

    fn open_and_handle(
        &mut self,
        peer: &str,
        env: Envelope,
        now_ms: u64,
        may_hold: bool,
        out: &mut Vec<Effect>,
    ) {
        let Some(PeerState::Verified {
            context_id, public, ..
        }) = self.peers.get(peer)
        else {
            // State from a peer that has not passed the Hello checks is
            // never opened; one whose Hello is being checked is kept.
            if may_hold && matches!(self.peers.get(peer), Some(PeerState::Pending { .. })) {
                self.hold_early(peer, env, now_ms, out);
            } else {
                out.push(Effect::Count(Count::FrameFromUnverifiedPeer));
            }
            return;
        };
        let sealed_at = env.timestamp_ms;
        match self.secure.open(&env, context_id, public, now_ms) {
            Ok(payload) => match self.engine.handle(peer, payload, now_ms) {
                Ok(actions) => self.engine_actions_sealed(actions, Some(sealed_at), out),
                Err(e) => self.engine_error(e, out),
            },
            Err(OpenError::UnknownEpoch { epoch, newest }) if may_hold && epoch > newest => {
                if self.held.len() >= self.config.max_held {
                    self.held.pop_front();
                    out.push(Effect::Count(Count::HeldEnvelopesDropped));
                }
                self.held.push_back(Held {
                    at_ms: now_ms,
                    peer: peer.to_owned(),
                    env,
                });
                out.push(Effect::Count(Count::EnvelopesHeldForEpoch));
            }
            Err(e) => out.push(Effect::EnvelopeRejected {
                peer: peer.to_owned(),
                label: e.label(),
                reason: e.to_string(),
            }),
        }
    }

    /// A gossip message whose (signed) author is `author`, with the
    /// Ed25519 key behind its PeerId. Membership is checked before the
    /// bytes are even decoded. Returns whether to accept (forward) it, plus
    /// what to do.
    pub fn on_gossip(
        &mut self,
        author: &str,
        author_public: Option<[u8; 32]>,
        data: &[u8],
        now_ms: u64,
    ) -> (bool, Vec<Effect>) {
        let mut out = Vec::new();
        let reject = |rejection: Rejection, out: &mut Vec<Effect>| {
            out.push(Effect::Rejected {
                peer: author.to_owned(),
                door: Door::Gossip,
                rejection,
            })
        };
        let Some(public) = author_public else {
            reject(Rejection::UnknownKey, &mut out);
            return (false, out);
        };
        let ctx = match self.membership.authorise_public(&public, now_ms) {
            Ok(ctx) => ctx,
            Err(r) => {
                reject(r, &mut out);
                return (false, out);
            }
        };
        let env = match nuwa_proto::Frame::decode(data) {
            Ok(nuwa_proto::Frame::Envelope(env)) => env,
            Ok(_) | Err(_) => {
                reject(Rejection::Malformed("not an envelope".into()), &mut out);
                return (false, out);
            }
        };
        let payload = match self.secure.open(&env, &ctx, &public, now_ms) {
            Ok(p) => p,
            Err(e) => {
                out.push(Effect::EnvelopeRejected {
                    peer: author.to_owned(),
                    label: e.label(),
                    reason: e.to_string(),
                });
                reject(Rejection::Malformed(e.to_string()), &mut out);
                return (false, out);
            }
        };
        // Authenticated and decoded: forwarded now, applied now or (in a
        // run) with the rest of the run by `apply_queued`.
        let taken = self.take_delta(payload, env.timestamp_ms, &mut out);
        if taken {
            out.push(Effect::Count(Count::GossipDeltasApplied));
        }
        (taken, out)
    }

    /// Takes an opened delta sealed at `sealed_ms`: queued for
    /// [`Session::apply_queued`] while gossip is deferred, applied now
    /// otherwise. False when the engine refused it.
    /// The queue is applied early once it holds [`APPLY_QUEUED_BYTES`].
    fn take_delta(&mut self, payload: SyncPayload, sealed_ms: u64, out: &mut Vec<Effect>) -> bool {
        if !self.defer_gossip {
            return match self.engine.handle_gossip(payload) {
                Ok(actions) => {
                    self.engine_actions_sealed(actions, Some(sealed_ms), out);
                    true
                }
                Err(e) => {
                    self.engine_error(e, out);
                    false
                }
            };
        }
        if let Err(e) = self.engine.queue_gossip(payload) {
            self.engine_error(e, out);
            return false;
        }
        self.queued_sealed_at = Some(
            self.queued_sealed_at
                .map_or(sealed_ms, |t| t.min(sealed_ms)),
        );
        if self.engine.queued_bytes() >= APPLY_QUEUED_BYTES {
            out.extend(self.apply_queued());
        }
        true
    }

    /// An envelope pulled from a keeper. The sender must be an active
    /// device of the current document, the envelope must open under a key
    /// we hold, and it must carry a delta; then it is taken like a gossiped
    /// one: queued while gossip is deferred (a page of a keeper's envelopes
    /// then costs one Automerge apply per container, at
    /// [`Session::apply_queued`]), applied at once otherwise.
    pub fn on_stored(&mut self, env: Envelope, now_ms: u64) -> (Stored, Vec<Effect>) {
        let mut out = Vec::new();
        if env.sender == self.membership.context_id() {
            return (Stored::Applied, out);
        }
        let who = format!("keeper:{}", env.sender);
        let public = match self.membership.key_of_context(&env.sender, now_ms) {
            Ok(p) => p,
            Err(rejection) => {
                out.push(Effect::Rejected {
                    peer: who,
                    door: Door::Keeper,
                    rejection,
                });
                return (Stored::Refused, out);
            }
        };
        let payload = match self.secure.open_stored(&env, &public) {
            Ok(p) => p,
            Err(OpenError::UnknownEpoch { epoch, newest }) if epoch > newest => {
                return (Stored::Later, out);
            }
            Err(e) => {
                out.push(Effect::EnvelopeRejected {
                    peer: who,
                    label: e.label(),
                    reason: e.to_string(),
                });
                return (Stored::Refused, out);
            }
        };
        if self.take_delta(payload, env.timestamp_ms, &mut out) {
            (Stored::Applied, out)
        } else {
            (Stored::Refused, out)
        }
    }

    // ---- the DID log and key epochs -----------------------------------------

    /// Adopts a DID log this device extended itself (a revocation or an
    /// approval it signed) and, with it, the key of a new epoch and its
    /// grant. The caller has already made both durable (it must not adopt
    /// what it could not persist). Returns the effects: re-check peers,
    /// push Hellos.
    pub fn adopt_own_update(
        &mut self,
        log: nuwa_identity::chain::DidChain,
        epoch: Option<(nuwa_crypto::SyncKey, Vec<u8>)>,
        now_ms: u64,
    ) -> Result<Vec<Effect>, Rejection> {
        let mut out = Vec::new();
        if let Some((key, grant)) = epoch {
            self.secure
                .install(key)
                .map_err(|e| Rejection::Malformed(format!("cannot install the epoch key: {e}")))?;
            self.membership.set_epoch_grant(grant);
        }
        let was = self.membership.log().head_hash().to_owned();
        self.membership.adopt_log(log, now_ms)?;
        self.after_log_extended(&was, now_ms, false, &mut out);
        Ok(out)
    }

    /// Our DID log grew from head `was`: persist it, re-check every
    /// verified peer against the new document, and send the others a fresh
    /// Hello carrying the log. A peer that lost authorisation (revoked) is
    /// sent the entries past `was` before we hang up, since no peer will
    /// admit it to tell it: it stops accepting writes that would never sync
    /// now, not at its next redial.
    fn after_log_extended(&mut self, was: &str, now_ms: u64, persist: bool, out: &mut Vec<Effect>) {
        if persist {
            out.push(Effect::PersistLog);
        }
        out.push(Effect::LogExtended);
        let verified: Vec<(PeerKey, [u8; 32])> = self
            .peers
            .iter()
            .filter_map(|(p, s)| match s {
                PeerState::Verified { public, .. } => Some((p.clone(), *public)),
                PeerState::Pending { .. } => None,
            })
            .collect();
        // A verified peer had our Hellos, so it held `was` (or learns
        // nothing from a page that does not continue its chain). None when
        // we switched to another branch.
        let owed_from = self
            .membership
            .log()
            .position_of(was)
            .map(|at| at as u64 + 1)
            .filter(|from| *from < self.membership.log().len() as u64);
        for (peer, public) in verified {
            if let Err(r) = self.membership.authorise_public(&public, now_ms) {
                out.push(Effect::Rejected {
                    peer: peer.clone(),
                    door: Door::Connection,
                    rejection: r,
                });
                match owed_from {
                    Some(from) if self.closing.len() < 1024 => {
                        self.send_entries(&peer, from, out);
                        self.forget_peer(&peer);
                        self.closing
                            .insert(peer.clone(), now_ms + CLOSE_AFTER_ENTRIES_MS);
                    }
                    _ => self.drop_peer(&peer, out),
                }
                continue;
            }
            out.push(Effect::Count(Count::HelloRefreshSent));
            self.push_hello(&peer, now_ms, out);
        }
        for (peer, grant) in std::mem::take(&mut self.grant_retry) {
            if matches!(self.peers.get(&peer), Some(PeerState::Verified { .. })) {
                self.on_grant(&peer, &grant, now_ms, out);
            }
        }
    }

    /// Merges the lost branches a Hello carries (strong removal); when our
    /// chain changed, persists it and re-checks every verified peer.
    /// Returns whether it changed.
    fn take_evidence(&mut self, hello: &Hello, now_ms: u64, out: &mut Vec<Effect>) -> bool {
        if hello.removal_evidence.is_empty() {
            return false;
        }
        let was = self.membership.log().head_hash().to_owned();
        let (changed, refused) = self.membership.merge_evidence(hello, now_ms);
        if refused > 0 {
            out.push(Effect::Count(Count::RemovalEvidenceRefused));
        }
        if changed {
            out.push(Effect::Count(Count::RemovalEvidenceMerged));
            self.after_log_extended(&was, now_ms, true, out);
        }
        changed
    }

    /// A device we refuse as not (or no longer) listed may still hold the
    /// only evidence of a removal (it heard of it, then was revoked
    /// itself): the entries verify on their own. At most one such Hello
    /// per [`UNASKED_ENTRIES_EVERY_MS`], from anyone.
    fn take_refused_evidence(
        &mut self,
        r: &Rejection,
        hello: &Hello,
        now_ms: u64,
        out: &mut Vec<Effect>,
    ) {
        if matches!(r, Rejection::UnknownKey | Rejection::KeyExpired)
            && !hello.removal_evidence.is_empty()
            && now_ms >= self.next_unasked_ms
        {
            self.next_unasked_ms = now_ms.saturating_add(UNASKED_ENTRIES_EVERY_MS);
            self.take_evidence(hello, now_ms, out);
        }
    }

    /// Whether `peer` (a device listed as `context_id`) can hold our
    /// current epoch: its Hello's grant is of an older one, and ours is not
    /// sealed to it. Said once per peer and epoch.
    fn check_peer_epoch(
        &mut self,
        peer: &str,
        context_id: &str,
        their_grant: &[u8],
        out: &mut Vec<Effect>,
    ) {
        let ours = self.secure.epoch();
        let theirs = if their_grant.is_empty() {
            0
        } else {
            match EpochGrant::decode(their_grant) {
                Ok(g) => g.epoch,
                Err(_) => return,
            }
        };
        if theirs >= ours || self.lacking.get(peer) == Some(&ours) {
            return;
        }
        // The grant we forward may be of an older epoch than the one we
        // write under (we adopted a lower epoch's grant from the winning
        // branch after opening our own): it covers the peer only when it
        // is of ours (seed 688 of the agent simulator).
        let covered = EpochGrant::decode(self.membership.epoch_grant())
            .map(|g| g.epoch == ours && g.sealed.iter().any(|(c, _)| c == context_id))
            .unwrap_or(false);
        if covered {
            return;
        }
        if self.lacking.len() >= 1024 {
            self.lacking.pop_first();
        }
        self.lacking.insert(peer.to_owned(), ours);
        out.push(Effect::PeerLacksEpoch {
            peer: peer.to_owned(),
            context_id: context_id.to_owned(),
            epoch: ours,
        });
    }

    /// Sends `peer` a Hello that carries `grant` (of our current epoch,
    /// sealed to it) instead of the grant we forward to everyone.
    pub fn send_grant(&mut self, peer: &str, grant: Vec<u8>, now_ms: u64) -> Vec<Effect> {
        let mut out = Vec::new();
        if let Ok(hello) = self.membership.hello_with_grant(now_ms, grant) {
            self.hello_sent_ms.insert(peer.to_owned(), now_ms);
            out.push(Effect::SendHello {
                peer: peer.to_owned(),
                hello: Box::new(hello),
            });
        }
        out
    }

    /// What a keeper served of the agent's membership, for a device that
    /// may meet nobody else: its DID chain, spliced and merged with the
    /// fork rule like a peer's entries, then its epoch grants, checked
    /// against the merged document like a peer's forwarded grant. The
    /// keeper is untrusted; all it can do is withhold.
    pub fn on_keeper_membership(
        &mut self,
        keeper: &str,
        did_entries: &[u8],
        grants: &[Vec<u8>],
        now_ms: u64,
    ) -> Vec<Effect> {
        let mut out = Vec::new();
        if !did_entries.is_empty() {
            let spliced = parse_entries(did_entries)
                .ok()
                .and_then(|entries| self.membership.log().splice(&entries).ok().flatten());
            let was = self.membership.log().head_hash().to_owned();
            match spliced.map(|chain| self.membership.merge_log(&chain, now_ms)) {
                Some(Ok(outcome)) if outcome.changed() => {
                    out.push(Effect::Count(Count::KeeperChainMerged));
                    self.after_log_extended(&was, now_ms, true, &mut out);
                }
                Some(Ok(_)) => {}
                None | Some(Err(_)) => out.push(Effect::Count(Count::KeeperChainRefused)),
            }
        }
        for grant in grants {
            self.on_grant(keeper, grant, now_ms, &mut out);
        }
        out
    }

    /// A verified peer forwarded the grant of its current epoch: adopt the
    /// key if it is new and meant for us, then open what was held for it.
    fn on_grant(&mut self, peer: &str, bytes: &[u8], now_ms: u64, out: &mut Vec<Effect>) {
        if bytes.is_empty() {
            return;
        }
        let outcome = open_grant(
            bytes,
            self.secure.keys(),
            self.membership.document(),
            self.membership.device(),
            self.membership.context_id(),
            (now_ms / 1000) as i64,
        );
        let key = match outcome {
            Ok(GrantOutcome::Known) => return,
            Ok(GrantOutcome::NewKey(k)) => k,
            Err(reason) => {
                out.push(Effect::Count(Count::EpochGrantRejected));
                out.push(Effect::GrantRejected {
                    peer: peer.to_owned(),
                    reason,
                });
                if self.grant_retry.len() < MAX_GRANT_RETRIES || self.grant_retry.contains_key(peer)
                {
                    self.grant_retry.insert(peer.to_owned(), bytes.to_vec());
                }
                return;
            }
        };
        let epoch = key.epoch();
        let newest = epoch > self.secure.epoch();
        if let Err(e) = self.secure.install(key) {
            out.push(Effect::Count(Count::EpochGrantRejected));
            out.push(Effect::GrantRejected {
                peer: peer.to_owned(),
                reason: format!("cannot install the epoch key: {e}"),
            });
            return;
        }
        if newest {
            self.membership.set_epoch_grant(bytes.to_vec());
        }
        out.push(Effect::PersistKeys {
            grant: newest.then(|| bytes.to_vec()),
        });
        out.push(Effect::Count(Count::EpochGrantsAdopted));
        out.push(Effect::EpochAdopted {
            peer: peer.to_owned(),
            epoch,
        });
        self.replay_held(now_ms, out);
    }

    /// Keeps, unopened, an envelope from a connected peer whose `Hello` is
    /// still being checked (the peer verified us first and sent its digest
    /// at once, or our DID log must grow before its Hello verifies): at
    /// most [`MAX_EARLY_PER_PEER`] per peer and [`MAX_EARLY`] in all, each
    /// at most [`MAX_EARLY_BYTES`], for `held_for_ms`. They are opened, as
    /// from a verified peer, when its Hello verifies, and dropped when it
    /// disconnects. Dropped, its first digest would wait for the next
    /// periodic one before this device says "in sync" (issue 26).
    fn hold_early(&mut self, peer: &str, env: Envelope, now_ms: u64, out: &mut Vec<Effect>) {
        let of_peer = self.early.iter().filter(|h| h.peer == peer).count();
        if of_peer >= MAX_EARLY_PER_PEER
            || env.ciphertext.len() + env.sender.len() > MAX_EARLY_BYTES
        {
            out.push(Effect::Count(Count::FrameFromUnverifiedPeer));
            return;
        }
        if self.early.len() >= MAX_EARLY {
            self.early.pop_front();
            out.push(Effect::Count(Count::HeldEnvelopesDropped));
        }
        self.early.push_back(Held {
            at_ms: now_ms,
            peer: peer.to_owned(),
            env,
        });
        out.push(Effect::Count(Count::EnvelopesHeldForHello));
    }

    /// Opens what `peer` sent before its Hello verified.
    fn replay_early(&mut self, peer: &str, now_ms: u64, out: &mut Vec<Effect>) {
        let (mine, rest): (VecDeque<Held>, VecDeque<Held>) = std::mem::take(&mut self.early)
            .into_iter()
            .partition(|h| h.peer == peer);
        self.early = rest;
        for h in mine {
            if now_ms.saturating_sub(h.at_ms) > self.config.held_for_ms {
                out.push(Effect::Count(Count::HeldEnvelopesExpired));
                continue;
            }
            self.open_and_handle(&h.peer, h.env, now_ms, true, out);
        }
    }

    fn replay_held(&mut self, now_ms: u64, out: &mut Vec<Effect>) {
        let held = std::mem::take(&mut self.held);
        for h in held {
            if now_ms.saturating_sub(h.at_ms) > self.config.held_for_ms {
                out.push(Effect::Count(Count::HeldEnvelopesExpired));
                continue;
            }
            self.open_and_handle(&h.peer, h.env, now_ms, false, out);
        }
    }

    // ---- time ----------------------------------------------------------------

    /// Periodic work: replay-window pruning, held envelopes that waited too
    /// long, peers that never sent a `Hello`, and the engine's anti-entropy.
    pub fn tick(&mut self, now_ms: u64) -> Vec<Effect> {
        let mut out = Vec::new();
        self.secure.prune(now_ms);
        let mut stale: Vec<PeerKey> = Vec::new();
        while let Some(h) = self.early.front() {
            if now_ms.saturating_sub(h.at_ms) <= self.config.held_for_ms {
                break;
            }
            self.early.pop_front();
            out.push(Effect::Count(Count::HeldEnvelopesExpired));
        }
        while let Some(h) = self.held.front() {
            if now_ms.saturating_sub(h.at_ms) <= self.config.held_for_ms {
                break;
            }
            if let Some(h) = self.held.pop_front() {
                if self.secure.keys().get(h.env.epoch).is_none() && !stale.contains(&h.peer) {
                    stale.push(h.peer);
                }
            }
            out.push(Effect::Count(Count::HeldEnvelopesExpired));
        }
        // A verified peer seals under an epoch whose grant never reached us
        // (the Hello that carried it was lost): hang up, so that the redial
        // exchanges Hellos again, and the grant comes with the peer's.
        for peer in stale {
            if matches!(self.peers.get(&peer), Some(PeerState::Verified { .. })) {
                out.push(Effect::Count(Count::EpochGrantMissed));
                self.drop_peer(&peer, &mut out);
            }
        }
        let due: Vec<PeerKey> = self
            .closing
            .iter()
            .filter(|(_, at)| now_ms >= **at)
            .map(|(p, _)| p.clone())
            .collect();
        for peer in due {
            self.closing.remove(&peer);
            // Unless it came back and was admitted meanwhile.
            if !self.peers.contains_key(&peer) {
                out.push(Effect::Disconnect { peer });
            }
        }
        let deadline = self.config.hello_deadline_ms;
        let late: Vec<PeerKey> = self
            .peers
            .iter()
            .filter_map(|(p, s)| match s {
                PeerState::Pending { since_ms, .. }
                    if now_ms.saturating_sub(*since_ms) > deadline =>
                {
                    Some(p.clone())
                }
                _ => None,
            })
            .collect();
        for peer in late {
            out.push(Effect::Rejected {
                peer: peer.clone(),
                door: Door::Connection,
                rejection: Rejection::HelloTimeout(deadline),
            });
            self.drop_peer(&peer, &mut out);
        }
        self.resend_hellos(now_ms, &mut out);
        let actions = self.engine.tick(now_ms);
        self.engine_actions(actions, &mut out);
        out
    }

    /// Our `Hello` again to every connected device of the agent whose own
    /// has not come and that has not had ours for
    /// [`SessionConfig::hello_resend_ms`]
    /// (one whose Hello waits for its DID entries has sent it), and to
    /// every verified peer that has not had it for
    /// [`SessionConfig::hello_refresh_ms`].
    fn resend_hellos(&mut self, now_ms: u64, out: &mut Vec<Effect>) {
        let due: Vec<(PeerKey, Count)> = self
            .peers
            .iter()
            .filter_map(|(p, s)| match s {
                // Only to a key of the agent: anyone may connect, and a
                // resend to a stranger would send our DID proof five
                // times per connection instead of once.
                PeerState::Pending { public, .. }
                    if !self.fetching.contains_key(p)
                        && self.membership.authorise_public(public, now_ms).is_ok() =>
                {
                    Some((p, self.config.hello_resend_ms, Count::HelloResent))
                }
                PeerState::Verified { .. } => {
                    Some((p, self.config.hello_refresh_ms, Count::HelloRefreshSent))
                }
                PeerState::Pending { .. } => None,
            })
            .filter(|(p, every, _)| {
                let last = self.hello_sent_ms.get(*p).copied().unwrap_or(0);
                now_ms.saturating_sub(last) >= *every
            })
            .map(|(p, _, count)| (p.clone(), count))
            .collect();
        for (peer, count) in due {
            out.push(Effect::Count(count));
            self.push_hello(&peer, now_ms, out);
        }
    }

    // ---- engine glue -----------------------------------------------------------

    fn engine_actions(&mut self, actions: Vec<Action>, out: &mut Vec<Effect>) {
        self.engine_actions_sealed(actions, None, out);
    }

    fn engine_actions_sealed(
        &mut self,
        actions: Vec<Action>,
        sealed_at_ms: Option<u64>,
        out: &mut Vec<Effect>,
    ) {
        for a in actions {
            out.push(match a {
                Action::Send { peer, payload } => Effect::Send { peer, payload },
                Action::Broadcast { peers, payload } => Effect::Broadcast { peers, payload },
                Action::Persist { container, changes } => Effect::Persist {
                    container,
                    changes,
                    origin: Origin::Peer,
                    sealed_at_ms,
                },
                Action::PersistWhole { container, changes } => {
                    Effect::PersistWhole { container, changes }
                }
                Action::Converged { peer, container } => Effect::Converged { peer, container },
            });
        }
    }

    fn engine_error(&mut self, e: EngineError, out: &mut Vec<Effect>) {
        out.push(Effect::Count(Count::PayloadRejected));
        if let Some(container) = e.poisoned_container() {
            out.push(Effect::Poisoned {
                container: container.to_owned(),
                error: e.to_string(),
            });
        }
    }

    /// The context id of a verified peer.
    pub fn context_of(&self, peer: &str) -> Option<&str> {
        match self.peers.get(peer) {
            Some(PeerState::Verified { context_id, .. }) => Some(context_id),
            _ => None,
        }
    }

    /// Brings an evicted container back into memory (see
    /// [`Engine::ensure_loaded`]).
    pub fn ensure_loaded(&mut self, name: &str) -> Result<bool, EngineError> {
        self.engine.ensure_loaded(name)
    }

    /// Evicts idle containers (see [`Engine::evict_idle`]).
    pub fn evict_idle(&mut self, idle_ms: u64, max_loaded: usize, keep: &[&str]) -> usize {
        self.engine.evict_idle(idle_ms, max_loaded, keep)
    }

    /// Sets how evicted containers load again (see [`Engine::set_loader`]).
    pub fn set_loader(&mut self, loader: crate::engine::Loader) {
        self.engine.set_loader(loader);
    }

    /// While on, gossiped deltas are verified and queued, not applied, until
    /// [`Session::apply_queued`]: the runtime turns it on for a run of
    /// network events it handles as one turn.
    pub fn defer_gossip(&mut self, on: bool) {
        self.defer_gossip = on;
    }

    /// Applies the gossiped deltas queued while deferring, one Automerge call
    /// per container.
    pub fn apply_queued(&mut self) -> Vec<Effect> {
        let mut out = Vec::new();
        let (actions, errors) = self.engine.apply_queued();
        let sealed_at = self.queued_sealed_at.take();
        self.engine_actions_sealed(actions, sealed_at, &mut out);
        for e in errors {
            self.engine_error(e, &mut out);
        }
        out
    }

    /// Catch-ups to run off the loop (see [`Engine::take_catch_ups`]).
    pub fn take_catch_ups(&mut self) -> Vec<crate::engine::CatchUp> {
        self.engine.take_catch_ups()
    }

    /// Takes a finished catch-up back (see [`Engine::finish_catch_up`]);
    /// what it adds is persisted like any change from a peer.
    pub fn finish_catch_up(&mut self, done: crate::engine::CaughtUp, now_ms: u64) -> Vec<Effect> {
        let done = self.engine.finish_catch_up(done, now_ms);
        self.engine_done(done)
    }

    /// The effects of work the engine took back: its actions, then its
    /// errors.
    fn engine_done(&mut self, (actions, errors): (Vec<Action>, Vec<EngineError>)) -> Vec<Effect> {
        let mut out = Vec::new();
        self.engine_actions(actions, &mut out);
        for e in errors {
            self.engine_error(e, &mut out);
        }
        out
    }

    /// Evicted containers to load off the loop (see
    /// [`Engine::take_loads`]).
    pub fn take_loads(&mut self) -> Vec<String> {
        self.engine.take_loads()
    }

    /// An off-loop load is back (see [`Engine::finish_load`]); what waited
    /// for it is handled like any peer input.
    pub fn finish_load(
        &mut self,
        name: &str,
        loaded: Result<Option<nuwa_state::Container>, String>,
        now_ms: u64,
    ) -> Vec<Effect> {
        let done = self.engine.finish_load(name, loaded, now_ms);
        self.engine_done(done)
    }

    /// Whether we hold exactly what a verified peer holds.
    pub fn in_sync_with(&mut self, peer: &str) -> bool {
        self.engine.in_sync_with(peer)
    }

    /// Every container's sync state against a peer (for status).
    pub fn sync_report(&mut self, peer: &str) -> Vec<crate::engine::PeerSync> {
        self.engine.sync_report(peer)
    }
}
