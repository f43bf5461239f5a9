//! Everything the agent asks the shell to do. The shell's executor performs
//! one handle's effects in four phases, whatever their order in the list
//! ([`Phases::of`] sorts them):
//!
//! 1. **persist**: changes (one group commit per container and origin),
//!    then the key ring and grant, then the DID chain, then new homes and
//!    compactions; metadata records go to an ordered writer off the loop;
//! 2. **acknowledge**: [`Effect::Reply`]s, which the agent emits only for
//!    requests whose writes are in phase 1 of the same list;
//! 3. **send**: frames and gossip, sealed by the agent;
//! 4. **the rest**: dials, lookups, registrations, workers, counters.
//!
//! Nothing is acknowledged before it is durable. Sends go **before** the
//! persist phase when it holds nothing but Automerge changes and metadata
//! ([`Phases::send_before_persist`]): a peer then holds a change while this device
//! flushes it. If this device crashes in between, the peer holds a change
//! the device lost, which is harmless: a run never reuses an earlier
//! run's Automerge actor (`nuwa_sync::run_actor`), so no later change can
//! be numbered like the lost one, and the lost change comes back from
//! the peer. A handle that saves keys, a grant, the DID chain, a new home
//! or a compaction sends only after they are durable: a grant for an
//! epoch key this device then lost, or a chain it then forgot, is not
//! harmless. A failure in phase 1 stops the shell: nothing after it runs.

use nuwa_crypto::epoch::KeyRing;
use nuwa_identity::chain::DidChain;
use nuwa_identity::keys::DeviceKey;
use nuwa_sync::{CatchUp, Origin};

use crate::api::{ApiError, Reply};
use crate::count::Count;
use crate::input::RequestId;
use crate::peer::{Multiaddr, PeerId};

/// A phase of the executor (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Phase {
    Persist,
    Acknowledge,
    Send,
    Rest,
}

/// One thing for the shell to do.
#[derive(Debug)]
pub enum Effect {
    // ---- phase 1: persist ----------------------------------------------
    /// Make these changes of `container` durable.
    Persist {
        container: String,
        changes: Vec<Vec<u8>>,
        origin: Origin,
        /// When the envelope that brought them was sealed (the sender's
        /// clock), for propagation latency.
        sealed_at_ms: Option<u64>,
    },
    /// A whole document came from a peer into `container`, which held
    /// nothing (a cold sync): make the container's document durable as one
    /// snapshot. `changes` is how many changes it brought (their bytes
    /// were never rebuilt).
    PersistWhole {
        container: String,
        changes: usize,
    },
    /// Save the key ring, and `grant` as the current epoch's grant.
    SaveKeys {
        keys: Box<KeyRing>,
        grant: Option<Vec<u8>>,
    },
    /// Save the DID chain.
    SaveLog(Box<DidChain>),
    /// Write a provisioned device's home (`device provision` through the
    /// daemon), after the chain that lists it is saved.
    WriteHome {
        request: RequestId,
        home: Box<NewHome>,
    },
    /// Save `container` as one snapshot (the `compact` tool).
    Compact {
        container: String,
    },
    /// Store a metadata record (known peers, names and last-seen times,
    /// keeper cursors), in order, off the loop.
    SaveMeta {
        key: String,
        bytes: Vec<u8>,
    },

    // ---- phase 2: acknowledge -------------------------------------------
    Reply {
        id: RequestId,
        result: Result<Reply, ApiError>,
    },

    // ---- phase 3: send ---------------------------------------------------
    /// Send a frame (sealed by the agent where it carries state).
    Send {
        peer: PeerId,
        frame: Vec<u8>,
    },
    /// Send a frame only if the network has room at once (keeper requests:
    /// a lost one is made again).
    TrySend {
        peer: PeerId,
        frame: Vec<u8>,
    },
    /// Publish on the gossip topic.
    Publish {
        topic: String,
        bytes: Vec<u8>,
    },
    /// The verdict on a gossip message ([`NetEvent::Gossip`](crate::NetEvent::Gossip)).
    GossipVerdict {
        token: u64,
        accept: bool,
    },

    // ---- phase 4: the rest -------------------------------------------------
    Disconnect(PeerId),
    /// Dial a device (from a fresh port).
    Dial {
        peer: Option<PeerId>,
        addrs: Vec<Multiaddr>,
    },
    /// Dial an infrastructure node (from the listening port).
    DialInfra {
        peer: PeerId,
        addrs: Vec<Multiaddr>,
    },
    AddAddress {
        peer: PeerId,
        addr: Multiaddr,
    },
    Kad(KadOp),
    RendezvousRegister {
        server: PeerId,
        namespace: String,
        ttl_secs: u64,
    },
    RendezvousDiscover {
        server: PeerId,
        namespace: String,
    },
    ReserveRelay {
        relay: PeerId,
        addr: Multiaddr,
    },
    ReleaseRelay(PeerId),
    Subscribe(String),
    /// Publish this mDNS TXT record (our signed announcement).
    Announce(Vec<(String, String)>),
    /// Run a catch-up on a worker and hand it back as
    /// [`Input::CaughtUp`](crate::Input::CaughtUp).
    RunCatchUp(Box<CatchUp>),
    /// Read `container` back from the store and hand it back as
    /// [`Input::Reloaded`](crate::Input::Reloaded).
    Reload(String),
    /// Read the evicted `container` from the store on a worker, without
    /// holding the loop, and hand it back as
    /// [`Input::Loaded`](crate::Input::Loaded).
    Load(String),
    /// Tell the reader about the schema registry.
    ReaderRegistry(Box<nuwa_asm::registry::Registry>),
    /// What app requests are checked against now (admin keys, revoked
    /// capabilities, visibilities): see [`crate::apps`].
    Access(std::sync::Arc<crate::apps::AccessView>),
    /// Ask the reader to scan these containers ([`crate::asm::scan`]) and
    /// answer each with [`Input::Scanned`](crate::Input::Scanned). Only
    /// containers that changed since their last scan, or whose next item
    /// is due, are asked for.
    ReaderScan {
        schemas: Vec<nuwa_asm::schema::AsmSchema>,
        now_secs: i64,
    },
    /// Containers left memory, startup settled, or five minutes passed
    /// (see `Agent::release_tick`): the reader may drop idle replicas, the
    /// allocator may give pages back, and the process may drop the code
    /// pages it no longer runs from its page tables.
    ReleaseMemory,
    Count(Count),
    CountBy(Count, u64),
    /// A count of the sync session's table.
    CountSync(nuwa_sync::Count),
    /// An input refused at a door, by (source, reason).
    CountRejection {
        source: &'static str,
        reason: &'static str,
    },
    /// An envelope that did not open, by reason.
    CountEnvelopeRejected(&'static str),
    /// `sync --once`: a line of progress for the person watching.
    Progress(String),
    /// `sync --once` is over: converged, or not.
    Finished(OnceResult),
}

/// How `sync --once` ended: what `--json sync --once` prints, and what the
/// text output says.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct OnceResult {
    /// Converged with every verified peer, or pulled a keeper to its end
    /// with no other device online.
    pub converged: bool,
    /// How it ended: `converged`, `no_peer` or `timeout` (the shell's
    /// exit status follows it).
    pub outcome: crate::once::Outcome,
    /// `"peers"` or `"keeper"` when converged.
    pub through: Option<&'static str>,
    pub peers_verified: usize,
    pub peers_in_sync: usize,
    pub containers: usize,
    /// What to tell the person: how it converged, or why not.
    pub message: String,
}

/// A device home the daemon writes for `device provision`.
pub struct NewHome {
    pub out: String,
    pub device: DeviceKey,
    pub name: String,
    pub log: DidChain,
    pub keys: KeyRing,
    pub grant: Option<Vec<u8>>,
}

impl std::fmt::Debug for NewHome {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NewHome")
            .field("out", &self.out)
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

/// A DHT operation.
#[derive(Debug)]
pub enum KadOp {
    Bootstrap,
    /// Keep a verified record in our store (we serve it to others).
    Store {
        key: Vec<u8>,
        value: Vec<u8>,
    },
    PutRecord {
        key: Vec<u8>,
        value: Vec<u8>,
    },
    StartProviding(Vec<u8>),
    GetProviders(Vec<u8>),
    GetRecord(Vec<u8>),
}

/// One handle's effects sorted into the executor's phases. The shell
/// performs them in the order of the fields (see the module docs).
#[derive(Debug, Default)]
pub struct Phases {
    /// The sends, when the persist phase holds only changes and metadata
    /// records (or nothing); else empty.
    pub send_before_persist: Vec<Effect>,
    pub persist: Vec<Effect>,
    pub acknowledge: Vec<Effect>,
    /// The sends of a handle that saves more than changes.
    pub send: Vec<Effect>,
    pub rest: Vec<Effect>,
}

impl Phases {
    pub fn of(effects: Vec<Effect>) -> Phases {
        let mut p = Phases::default();
        for e in effects {
            match e.phase() {
                Phase::Persist => p.persist.push(e),
                Phase::Acknowledge => p.acknowledge.push(e),
                Phase::Send => p.send.push(e),
                Phase::Rest => p.rest.push(e),
            }
        }
        let only_changes = p.persist.iter().all(|e| {
            matches!(
                e,
                Effect::Persist { .. } | Effect::PersistWhole { .. } | Effect::SaveMeta { .. }
            )
        });
        if only_changes {
            p.send_before_persist = std::mem::take(&mut p.send);
        }
        p
    }
}

impl Effect {
    /// The executor phase this effect belongs to.
    pub fn phase(&self) -> Phase {
        match self {
            Effect::Persist { .. }
            | Effect::PersistWhole { .. }
            | Effect::SaveKeys { .. }
            | Effect::SaveLog(_)
            | Effect::WriteHome { .. }
            | Effect::Compact { .. }
            | Effect::SaveMeta { .. } => Phase::Persist,
            Effect::Reply { .. } => Phase::Acknowledge,
            Effect::Send { .. }
            | Effect::TrySend { .. }
            | Effect::Publish { .. }
            | Effect::GossipVerdict { .. } => Phase::Send,
            _ => Phase::Rest,
        }
    }
}
