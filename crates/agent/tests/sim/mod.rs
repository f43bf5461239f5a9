//! A seeded world of whole agents: several devices run the real
//! [`Agent`], over an in-memory network (delay, loss, partitions), with
//! in-memory homes (the store, the DID chain, keys, metadata), a virtual
//! clock, crashes and restarts, mDNS-like announcements, pairing, and a
//! real keeper over its in-memory store.
//!
//! The harness performs the agent's effects the way the daemon's executor
//! does (persist, acknowledge, send, the rest), so what it checks is what
//! the daemon would do. Every random choice comes from the seed, and so
//! does every key, nonce and signature (`nuwa_entropy`'s deterministic
//! mode), so a seed replays exactly.

#![allow(dead_code)]

use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::{Arc, Mutex};

use nuwa_agent::api::{ApproveBody, PutBody, Reply, Request, RevokeBody};
use nuwa_agent::join::{JoinFlow, JoinStep, RecoveryJoin};
use nuwa_agent::peer::{self, Multiaddr, PeerId};
use nuwa_agent::{Agent, Boot, Config, Effect, Input, MdnsEvent, NetEvent, RequestId};
use nuwa_crypto::SyncKey;
use nuwa_crypto::epoch::KeyRing;
use nuwa_identity::chain::DidChain;
use nuwa_identity::keys::{DeviceKey, context_id_for};
use nuwa_proto::Frame;
use nuwa_state::Container;
use nuwa_sync::Engine;

/// Where virtual time starts (Unix ms): late 2026.
pub const EPOCH_MS: u64 = 1_800_000_000_000;
/// One step of the world.
pub const STEP_MS: u64 = 20;
/// Devices tick this often (as the daemon does).
pub const TICK_MS: u64 = 200;

/// What a device's home holds on disk.
#[derive(Clone)]
pub struct Disk {
    pub device_seed: [u8; 32],
    pub master_seed: Option<[u8; 32]>,
    pub name: String,
    pub log: DidChain,
    pub keys: KeyRing,
    pub grant: Option<Vec<u8>>,
    /// Every persisted change, per container (the store's log).
    pub containers: Arc<Mutex<BTreeMap<String, Vec<Vec<u8>>>>>,
    pub meta: BTreeMap<String, Vec<u8>>,
}

impl Disk {
    /// Every container as the store holds it.
    pub fn load_all(&self) -> BTreeMap<String, Container> {
        let names: Vec<String> = self.containers.lock().unwrap().keys().cloned().collect();
        names
            .into_iter()
            .filter_map(|name| Some((name.clone(), self.load(&name)?)))
            .collect()
    }

    /// One container as the store holds it (`None`: nothing of it).
    pub fn load(&self, name: &str) -> Option<Container> {
        let changes = self.containers.lock().unwrap().get(name).cloned()?;
        let actor = DeviceKey::from_seed(&self.device_seed).public().to_vec();
        Some(Container::load(&actor, None, changes).expect("stored changes load"))
    }

    /// A copy that shares nothing with this one (a backup of the home).
    pub fn deep_copy(&self) -> Disk {
        let containers = self.containers.lock().unwrap().clone();
        Disk {
            containers: Arc::new(Mutex::new(containers)),
            ..self.clone()
        }
    }

    /// The engine a run of the daemon opens: the store's containers, and
    /// a fresh Automerge actor for this run (as the daemon's executor).
    fn engine(&self) -> Engine {
        let public = DeviceKey::from_seed(&self.device_seed).public();
        let actor = nuwa_sync::run_actor(&public).expect("entropy");
        // As the daemon's: a peer's input for an evicted container waits for
        // a load off the loop.
        let config = nuwa_sync::Config {
            load_off_loop: true,
            ..nuwa_sync::Config::default()
        };
        let mut engine = Engine::new(actor.clone(), config);
        let stored = self.containers.lock().unwrap().clone();
        for (name, changes) in stored {
            let c = Container::load(&actor, None, changes).expect("stored changes load");
            engine.insert_container(name, c);
        }
        let disk = self.containers.clone();
        engine.set_loader(Box::new(move |name: &str| {
            let changes = disk.lock().unwrap().get(name).cloned();
            match changes {
                None => Ok(None),
                Some(changes) => Container::load(&actor, None, changes)
                    .map(Some)
                    .map_err(|e| e.to_string()),
            }
        }));
        engine
    }
}

/// A write the agent acknowledged durable.
#[derive(Debug, Clone)]
pub struct Acked {
    pub device: usize,
    pub container: String,
    pub key: String,
    pub value: serde_json::Value,
    pub at_ms: u64,
    /// Its place among all acknowledgements (time alone does not order
    /// two in the same millisecond).
    pub nth: usize,
}

/// One device of the agent (or one waiting to pair).
pub struct Device {
    pub name: String,
    pub disk: Option<Disk>,
    pub agent: Option<Agent>,
    pub key: DeviceKey,
    pub peer: PeerId,
    /// Which network it is on (devices meet only on the same one).
    pub lan: usize,
    /// Lost for good (an admin whose device is gone), or revoked.
    pub gone: bool,
    /// Its last mDNS record.
    announce: Option<Vec<(String, String)>>,
    /// A device waiting to pair, and how it pairs.
    pub joining: Option<JoinFlow>,
    next_tick_ms: u64,
    /// Context ids this device's chain ever removed (revoked stays revoked).
    pub removed_seen: BTreeSet<String>,
    /// Requests waiting for their reply, by id, with what they were.
    waiting: BTreeMap<RequestId, Request2>,
    /// Replies of lifecycle requests, for the scenario to read.
    pub replies: Vec<(RequestId, Result<String, String>)>,
    /// When the agent asked to give memory back (`Effect::ReleaseMemory`).
    pub released_ms: Vec<u64>,
    /// Each container the reader scanned for the lifecycle task, and when.
    pub scanned: Vec<(u64, String)>,
    /// `sync --once` ended: when, converged or not, and the kind of input
    /// whose handle ended it.
    pub finished: Option<(u64, bool, &'static str)>,
    /// The most `Persist` effects one handle gave for one container.
    pub most_persists_in_a_handle: usize,
}

/// What a request was, to make sense of its reply.
#[derive(Debug, Clone)]
enum Request2 {
    Put {
        container: String,
        key: String,
        value: serde_json::Value,
    },
    Other(&'static str),
}

impl Device {
    pub fn context_id(&self) -> String {
        context_id_for(&self.key.public())
    }

    pub fn running(&self) -> bool {
        self.agent.is_some()
    }
}

/// A message on its way.
struct InFlight {
    at_ms: u64,
    seq: u64,
    to: usize,
    what: Delivery,
}

enum Delivery {
    Net(NetEvent),
    Mdns(MdnsEvent),
    /// A pairing step for a device waiting to pair.
    Pairing {
        from: PeerId,
        frame: Frame,
    },
    CaughtUp(Box<nuwa_sync::CaughtUp>),
    /// An evicted container to read from the disk as it is then (a worker
    /// reading the store).
    Load(String),
    /// The reader's lifecycle scan of these containers, from the disk as
    /// it is then.
    Scan {
        schemas: Vec<nuwa_agent::asm_model::schema::AsmSchema>,
        now_secs: i64,
    },
    KeeperRequest {
        from: usize,
        frame: Vec<u8>,
    },
    /// Close the connection to this device.
    Unlink(usize),
}

/// The knobs of one run.
#[derive(Debug, Clone)]
pub struct Knobs {
    /// Chance that a frame or gossip message is lost, per thousand.
    pub loss_per_mille: u32,
    /// Largest delivery delay.
    pub max_delay_ms: u64,
    pub keeper: bool,
}

impl Default for Knobs {
    fn default() -> Self {
        Knobs {
            loss_per_mille: 20,
            max_delay_ms: 40,
            keeper: false,
        }
    }
}

/// The keeper's in-memory store, shared with the sim so that a test can
/// copy it and roll the keeper back to the copy.
#[derive(Clone, Default)]
struct SharedStore(Arc<Mutex<nuwa_keeper::MemKeeperStore>>);

impl SharedStore {
    fn get(&self) -> std::sync::MutexGuard<'_, nuwa_keeper::MemKeeperStore> {
        self.0.lock().expect("keeper store lock")
    }
}

type KeeperResult<T> = Result<T, nuwa_keeper::KeeperStoreError>;

impl nuwa_keeper::KeeperStore for SharedStore {
    fn agent_count(&self) -> usize {
        self.get().agent_count()
    }
    fn agent_hashes(&self) -> Vec<nuwa_keeper::AgentHash> {
        self.get().agent_hashes()
    }
    fn agent(&self, agent: &nuwa_keeper::AgentHash) -> Option<nuwa_keeper::AgentState> {
        self.get().agent(agent)
    }
    fn usage_through(
        &self,
        agent: &nuwa_keeper::AgentHash,
        through: u64,
    ) -> KeeperResult<nuwa_keeper::Usage> {
        self.get().usage_through(agent, through)
    }
    fn push(
        &mut self,
        agent: &nuwa_keeper::AgentHash,
        record: &nuwa_keeper::AgentRecord,
        entries: &[nuwa_keeper::Entry],
        replaces_through: u64,
    ) -> KeeperResult<nuwa_keeper::Pushed> {
        self.get().push(agent, record, entries, replaces_through)
    }
    fn pull(
        &self,
        agent: &nuwa_keeper::AgentHash,
        since: u64,
        max_bytes: u64,
        max_entries: usize,
    ) -> KeeperResult<nuwa_keeper::Page> {
        self.get().pull(agent, since, max_bytes, max_entries)
    }
    fn prune(&mut self, received_before_ms: u64) -> KeeperResult<u64> {
        self.get().prune(received_before_ms)
    }
}

/// The keeper node: the real keeper logic over its in-memory store.
struct KeeperNode {
    keeper: nuwa_keeper::Keeper,
    store: SharedStore,
    peer: PeerId,
    /// Devices connected to it.
    linked: BTreeSet<usize>,
}

/// The world.
pub struct Sim {
    pub seed: u64,
    pub rng: fastrand::Rng,
    pub now_ms: u64,
    pub devices: Vec<Device>,
    pub knobs: Knobs,
    /// Open connections between devices (a < b).
    links: BTreeSet<(usize, usize)>,
    flight: Vec<InFlight>,
    seq: u64,
    keeper: Option<KeeperNode>,
    gossip_token: u64,
    next_request: u64,
    pub acked: Vec<Acked>,
    /// Revoked devices and the epoch their revocation opened.
    pub revoked: BTreeMap<String, u64>,
    /// Each key epoch seen, and the revoked devices its opener's chain had
    /// removed when it opened it (the first device seen holding an epoch
    /// is its opener: adopting one takes a delivery, a step of its own).
    pub epoch_knew: BTreeMap<u64, BTreeSet<String>>,
    /// Per device revoked before a stale handover, the devices that had
    /// heard of the revocation when the admin was lost.
    pub witnesses: BTreeMap<String, Vec<usize>>,
    /// The agent's recovery words' key.
    pub recovery: DeviceKey,
    /// What happened, for a failing seed's report.
    pub trace: Vec<String>,
    /// What the run exercised, counted (the seeds' coverage).
    pub tally: BTreeMap<&'static str, u64>,
    pub did: String,
    /// Copies of homes taken while their devices ran, when, and how many
    /// writes had been acknowledged then.
    pub backups: BTreeMap<usize, (Disk, u64, usize)>,
    /// Writes acknowledged so far.
    pub acks: usize,
    /// Short-lived devices (`--expires`) and the virtual ms after which
    /// every peer must refuse them (expiry plus grace): from then on they
    /// count as revoked for the invariants (see `check_device`).
    pub expiring: BTreeMap<String, u64>,
    /// Devices that refused a peer because its device expired.
    pub refused_expired: BTreeSet<usize>,
    /// Short-lived devices whose time ran out.
    pub expired: BTreeSet<String>,
    /// Devices started as `sync --once` (one minute's deadline).
    pub once: BTreeSet<usize>,
    /// Devices that crash inside their next handle that sends changes
    /// before it persists them (see [`Sim::tear`]).
    pub torn: BTreeSet<usize>,
}

fn addr_of(i: usize) -> (Multiaddr, SocketAddr) {
    let ip = Ipv4Addr::new(10, 0, (i / 250) as u8, (i % 250 + 1) as u8);
    let sa = SocketAddr::new(IpAddr::V4(ip), 4001);
    let ma: Multiaddr = format!("/ip4/{ip}/tcp/4001").parse().expect("valid");
    (ma, sa)
}

impl Sim {
    /// A new agent of `devices` devices (the first holds the master key),
    /// none running yet.
    pub fn new(seed: u64, devices: usize, knobs: Knobs) -> Sim {
        let mut rng = fastrand::Rng::with_seed(seed);
        let now_ms = EPOCH_MS + rng.u64(0..3_600_000);
        let now_secs = (now_ms / 1000) as i64;
        let master = DeviceKey::generate().expect("entropy");
        let recovery = DeviceKey::generate().expect("entropy");
        let keys = KeyRing::new(SyncKey::generate(0).expect("entropy"));
        let mut log = DidChain::genesis(&master, now_secs).expect("genesis");
        let first = DeviceKey::generate().expect("entropy");
        nuwa_agent::lifecycle::first_update(
            &mut log,
            &master,
            &first,
            &recovery.public(),
            now_secs,
        )
        .expect("first update");
        let admin =
            nuwa_agent::lifecycle::admin_of(&log, &first, Some(&master), now_secs).expect("admin");
        let mut keys_of = vec![first];
        for _ in 1..devices {
            let d = DeviceKey::generate().expect("entropy");
            let x = nuwa_identity::did_key::x25519_public_from_ed25519(&d.public()).unwrap();
            nuwa_agent::lifecycle::add_device(&mut log, &admin, &d.public(), &x, now_secs)
                .expect("provision");
            keys_of.push(d);
        }
        let did = log.did().to_owned();
        let mut sim = Sim {
            seed,
            rng,
            now_ms,
            devices: Vec::new(),
            knobs: knobs.clone(),
            links: BTreeSet::new(),
            flight: Vec::new(),
            seq: 0,
            keeper: None,
            gossip_token: 0,
            next_request: 0,
            acked: Vec::new(),
            revoked: BTreeMap::new(),
            expiring: BTreeMap::new(),
            refused_expired: BTreeSet::new(),
            expired: BTreeSet::new(),
            once: BTreeSet::new(),
            torn: BTreeSet::new(),
            epoch_knew: BTreeMap::new(),
            witnesses: BTreeMap::new(),
            recovery,
            trace: Vec::new(),
            tally: BTreeMap::new(),
            did,
            backups: BTreeMap::new(),
            acks: 0,
        };
        for (i, key) in keys_of.into_iter().enumerate() {
            let disk = Disk {
                device_seed: *key.seed(),
                master_seed: (i == 0).then(|| *master.seed()),
                name: format!("d{i}"),
                log: log.clone(),
                keys: keys.clone(),
                grant: None,
                containers: Arc::new(Mutex::new(BTreeMap::new())),
                meta: BTreeMap::new(),
            };
            sim.add_device(format!("d{i}"), key, Some(disk));
        }
        if knobs.keeper {
            let key = DeviceKey::generate().expect("entropy");
            let store = SharedStore::default();
            sim.keeper = Some(KeeperNode {
                keeper: nuwa_keeper::Keeper::new(
                    Box::new(store.clone()),
                    nuwa_keeper::KeeperConfig::default(),
                ),
                store,
                peer: peer::id_of(&key.public()).expect("valid key"),
                linked: BTreeSet::new(),
            });
        }
        sim
    }

    fn add_device(&mut self, name: String, key: DeviceKey, disk: Option<Disk>) -> usize {
        let peer = peer::id_of(&key.public()).expect("valid key");
        self.devices.push(Device {
            name,
            disk,
            agent: None,
            key,
            peer,
            lan: 0,
            gone: false,
            announce: None,
            joining: None,
            next_tick_ms: 0,
            removed_seen: BTreeSet::new(),
            waiting: BTreeMap::new(),
            replies: Vec::new(),
            released_ms: Vec::new(),
            scanned: Vec::new(),
            finished: None,
            most_persists_in_a_handle: 0,
        });
        self.devices.len() - 1
    }

    pub fn has_keeper(&self) -> bool {
        self.keeper.is_some()
    }

    pub fn count(&mut self, what: &'static str) {
        *self.tally.entry(what).or_default() += 1;
    }

    pub fn note(&mut self, what: impl Into<String>) {
        let t = self.now_ms - EPOCH_MS;
        self.trace.push(format!("{t:>10} {}", what.into()));
    }

    fn config(&self) -> Config {
        let mut c = Config {
            mdns: true,
            ..Config::default()
        };
        // The daemon refreshes Hellos every 5 minutes; the world settles in
        // 90 s, so a lost Hello must be healed sooner here.
        c.session.hello_refresh_ms = 20_000;
        if let Some(k) = &self.keeper {
            let (addr, _) = addr_of(9_999);
            c.keepers = vec![(k.peer, addr.with(peer::Protocol::P2p(k.peer)))];
        }
        c
    }

    /// Starts (or restarts) device `i` from its home.
    pub fn start(&mut self, i: usize) {
        let mut config = self.config();
        if self.once.contains(&i) {
            config.once_ms = Some(60_000);
        }
        let now = self.now_ms;
        let d = &mut self.devices[i];
        if d.running() || d.gone {
            return;
        }
        let Some(disk) = &d.disk else { return };
        let meta: BTreeMap<String, Vec<u8>> = Agent::meta_keys(&config)
            .into_iter()
            .filter_map(|k| disk.meta.get(&k).map(|v| (k, v.clone())))
            .collect();
        let boot = Boot {
            device: DeviceKey::from_seed(&disk.device_seed),
            master: disk.master_seed.map(|s| DeviceKey::from_seed(&s)),
            name: disk.name.clone(),
            log: disk.log.clone(),
            keys: disk.keys.clone(),
            grant: disk.grant.clone(),
            engine: disk.engine(),
            quarantined: Vec::new(),
            meta,
            listen_addrs: vec![addr_of(i).0],
            peer_id: d.peer,
            mdns_watching: vec!["sim0".to_owned()],
        };
        d.agent = Some(Agent::new(config, boot, now));
        d.next_tick_ms = now + TICK_MS;
        self.note(format!("start d{i}"));
        self.handle(i, Input::Start);
        self.browse(i);
    }

    /// mDNS query and answers: device `i` hears the latest record of every
    /// device up on its network (a browse when it starts or moves), and
    /// they hear its record.
    fn browse(&mut self, i: usize) {
        let lan = self.devices[i].lan;
        let others: Vec<usize> = (0..self.devices.len())
            .filter(|&j| j != i && self.devices[j].lan == lan && self.devices[j].running())
            .collect();
        let (_, sa_i) = addr_of(i);
        for j in others {
            if let Some(txt) = self.devices[j].announce.clone() {
                let ev = MdnsEvent::Resolved {
                    instance: self.devices[j].peer.to_string(),
                    txt,
                    addrs: vec![addr_of(j).1],
                };
                self.send_later(i, Delivery::Mdns(ev));
            }
            if let Some(txt) = self.devices[i].announce.clone() {
                let ev = MdnsEvent::Resolved {
                    instance: self.devices[i].peer.to_string(),
                    txt,
                    addrs: vec![sa_i],
                };
                self.send_later(j, Delivery::Mdns(ev));
            }
        }
    }

    /// Stops device `i` at once (a crash): what it persisted stays, its
    /// connections drop, messages to it are lost.
    pub fn crash(&mut self, i: usize) {
        if self.devices[i].agent.take().is_none() {
            return;
        }
        self.count("crashes");
        self.torn.remove(&i);
        self.devices[i].waiting.clear();
        self.note(format!("crash d{i}"));
        self.drop_links(i);
        self.flight.retain(|m| m.to != i);
    }

    /// Device `i` crashes inside its next handle whose sends go before its
    /// persist phase (the core's `Phases::send_before_persist`) and which persists
    /// changes: its frames leave, its changes never reach its disk and
    /// nobody hears back. Its peers then hold changes it lost.
    pub fn tear(&mut self, i: usize) {
        if self.devices[i].running() {
            self.torn.insert(i);
        }
    }

    /// Copies device `i`'s home as it is now (its daemon may be running:
    /// what is persisted is what a copy gets).
    pub fn back_up(&mut self, i: usize) {
        if let Some(disk) = &self.devices[i].disk {
            let copy = disk.deep_copy();
            self.backups.insert(i, (copy, self.now_ms, self.acks));
            self.count("backups");
            self.note(format!("d{i}'s home copied"));
        }
    }

    /// Device `i` stops and its home is replaced by its backup (same key,
    /// older store, chain, keys and metadata). What it acknowledged after
    /// the copy and no other device holds is gone with the rolled-back
    /// home (the person chose that); everything a peer holds must come
    /// back, and what it writes from now on must reach everyone. Returns
    /// whether it restored.
    pub fn restore(&mut self, i: usize) -> bool {
        let Some((backup, at_ms, acks)) = self.backups.remove(&i) else {
            return false;
        };
        let same_key = self.devices[i]
            .disk
            .as_ref()
            .is_some_and(|d| d.device_seed == backup.device_seed);
        if !same_key || self.devices[i].gone {
            return false;
        }
        // A witness of a revocation rolled back to a copy may have
        // forgotten it: it no longer counts as one.
        for w in self.witnesses.values_mut() {
            w.retain(|&x| x != i);
        }
        self.crash(i);
        let others: Vec<BTreeMap<String, Container>> = (0..self.devices.len())
            .filter(|&j| j != i && !self.devices[j].gone)
            .filter_map(|j| self.devices[j].disk.as_ref().map(Disk::load_all))
            .collect();
        let before = self.acked.len();
        self.acked.retain(|w| {
            w.device != i
                || w.nth <= acks
                || others.iter().any(|c| {
                    c.get(&w.container).and_then(|c| c.get(&w.key)).as_ref() == Some(&w.value)
                })
        });
        let forgotten = (before - self.acked.len()) as u64;
        *self
            .tally
            .entry("writes lost with a rolled-back home")
            .or_default() += forgotten;
        self.devices[i].disk = Some(backup);
        // Its chain is the backup's now: what it removed is what that one removed.
        self.devices[i].removed_seen.clear();
        self.count("restores");
        self.note(format!(
            "d{i} restored from the copy of {} ms ({forgotten} write(s) no peer held are gone)",
            at_ms - EPOCH_MS
        ));
        true
    }

    /// Device `i` moves to network `lan` (a partition, or its healing).
    pub fn move_to(&mut self, i: usize, lan: usize) {
        if self.devices[i].lan == lan {
            return;
        }
        self.devices[i].lan = lan;
        self.count("partition moves");
        self.note(format!("d{i} to lan {lan}"));
        if self.devices[i].running() {
            self.browse(i);
        }
        let cut: Vec<(usize, usize)> = self
            .links
            .iter()
            .filter(|(a, b)| (*a == i || *b == i) && self.devices[*a].lan != self.devices[*b].lan)
            .copied()
            .collect();
        for (a, b) in cut {
            self.unlink(a, b);
        }
    }

    fn drop_links(&mut self, i: usize) {
        let mine: Vec<(usize, usize)> = self
            .links
            .iter()
            .filter(|(a, b)| *a == i || *b == i)
            .copied()
            .collect();
        for (a, b) in mine {
            self.unlink(a, b);
        }
        if let Some(k) = &mut self.keeper {
            k.linked.remove(&i);
        }
    }

    fn unlink(&mut self, a: usize, b: usize) {
        if !self.links.remove(&(a.min(b), a.max(b))) {
            return;
        }
        // In-flight messages on the connection are lost with it.
        self.flight.retain(|m| {
            !((m.to == a || m.to == b)
                && matches!(m.what, Delivery::Net(_) | Delivery::Pairing { .. }))
        });
        for (x, y) in [(a, b), (b, a)] {
            let peer = self.devices[y].peer;
            if self.devices[x].running() {
                self.handle(x, Input::Net(vec![NetEvent::Disconnected { peer }]));
            }
        }
    }

    fn index_of(&self, peer: &PeerId) -> Option<usize> {
        self.devices.iter().position(|d| d.peer == *peer)
    }

    fn send_later(&mut self, to: usize, what: Delivery) {
        let delay = 1 + self.rng.u64(0..self.knobs.max_delay_ms.max(1));
        self.seq += 1;
        self.flight.push(InFlight {
            at_ms: self.now_ms + delay,
            seq: self.seq,
            to,
            what,
        });
    }

    fn send_later_at(&mut self, to: usize, after_ms: u64, what: Delivery) {
        self.seq += 1;
        self.flight.push(InFlight {
            at_ms: self.now_ms + after_ms,
            seq: self.seq,
            to,
            what,
        });
    }

    fn lost(&mut self) -> bool {
        self.rng.u32(0..1000) < self.knobs.loss_per_mille
    }

    // ---- the agent's effects --------------------------------------------

    /// Hands `input` to device `i` and performs its effects.
    pub fn handle(&mut self, i: usize, input: Input) {
        let now = self.now_ms;
        let Some(agent) = self.devices[i].agent.as_mut() else {
            return;
        };
        let span = tracing::info_span!("", d = i, t = now - EPOCH_MS);
        let kind = match &input {
            Input::Tick { .. } => "tick",
            Input::Net(_) => "net",
            _ => "other",
        };
        let effects = span.in_scope(|| agent.handle(input, now));
        let mut persists: BTreeMap<&str, usize> = BTreeMap::new();
        for e in &effects {
            match e {
                Effect::Finished(r) => self.devices[i].finished = Some((now, r.converged, kind)),
                Effect::Persist { container, .. } => *persists.entry(container).or_default() += 1,
                _ => {}
            }
        }
        let most = persists.into_values().max().unwrap_or(0);
        let d = &mut self.devices[i];
        d.most_persists_in_a_handle = d.most_persists_in_a_handle.max(most);
        self.perform(i, effects);
        self.check_device(i);
    }

    fn perform(&mut self, i: usize, effects: Vec<Effect>) {
        // The executor's phases, in the core's order.
        let nuwa_agent::Phases {
            send_before_persist,
            persist,
            acknowledge,
            send,
            rest,
        } = nuwa_agent::Phases::of(effects);
        let torn = !send_before_persist.is_empty()
            && persist.iter().any(|e| matches!(e, Effect::Persist { .. }));
        for e in send_before_persist {
            self.send(i, e);
        }
        if torn && self.torn.remove(&i) {
            self.count("torn handles");
            self.note(format!("d{i} crashed after sending, before persisting"));
            self.crash(i);
            return;
        }
        for e in persist {
            self.persist(i, e);
        }
        for e in acknowledge {
            if let Effect::Reply { id, result } = e {
                self.reply(i, id, result);
            }
        }
        for e in send {
            self.send(i, e);
        }
        for e in rest {
            if matches!(
                e,
                Effect::Count(nuwa_agent::count::Count::PeersRefusedExpired)
            ) {
                self.count("expired refusals");
                self.refused_expired.insert(i);
            }
            self.rest(i, e);
        }
    }

    fn persist(&mut self, i: usize, e: Effect) {
        // A whole document is stored as all of its changes (what a
        // snapshot of it holds).
        let whole = match &e {
            Effect::PersistWhole { container, .. } => self.devices[i]
                .agent
                .as_ref()
                .and_then(|a| a.session().engine().container(container))
                .map(|c| c.changes_since(&[])),
            _ => None,
        };
        let Some(disk) = self.devices[i].disk.as_mut() else {
            return;
        };
        match e {
            Effect::PersistWhole { container, .. } => {
                if let Some(whole) = whole {
                    disk.containers.lock().unwrap().insert(container, whole);
                }
            }
            Effect::Persist {
                container, changes, ..
            } => disk
                .containers
                .lock()
                .unwrap()
                .entry(container)
                .or_default()
                .extend(changes),
            Effect::SaveKeys { keys, grant } => {
                disk.keys = *keys;
                if grant.is_some() {
                    disk.grant = grant;
                }
            }
            Effect::SaveLog(log) => disk.log = *log,
            Effect::SaveMeta { key, bytes } => {
                disk.meta.insert(key, bytes);
            }
            Effect::WriteHome { home, .. } => {
                let key = DeviceKey::from_seed(&home.device.seed());
                let disk = Disk {
                    device_seed: *key.seed(),
                    master_seed: None,
                    name: home.name.clone(),
                    log: home.log.clone(),
                    keys: home.keys.clone(),
                    grant: home.grant.clone(),
                    containers: Arc::new(Mutex::new(BTreeMap::new())),
                    meta: BTreeMap::new(),
                };
                let n = self.devices.len();
                let j = self.add_device(format!("d{n}"), key, Some(disk));
                self.devices[j].lan = self.devices[i].lan;
                self.note(format!("d{i} provisioned d{j}"));
            }
            _ => {}
        }
    }

    fn reply(&mut self, i: usize, id: RequestId, result: Result<Reply, nuwa_agent::api::ApiError>) {
        let Some(req) = self.devices[i].waiting.remove(&id) else {
            return;
        };
        match (req, result) {
            (
                Request2::Put {
                    container,
                    key,
                    value,
                },
                Ok(Reply::Put(p)),
            ) => {
                assert!(p.durable, "a put acknowledged as not durable");
                let at_ms = self.now_ms;
                self.count("writes acknowledged");
                self.acks += 1;
                self.acked.push(Acked {
                    device: i,
                    container,
                    key,
                    value,
                    at_ms,
                    nth: self.acks,
                });
            }
            (Request2::Put { .. }, Err(e)) => self.note(format!("d{i} put refused: {e}")),
            (Request2::Other(what), r) => {
                if r.is_ok() {
                    self.count(what);
                }
                let r = r
                    .map(|r| format!("{what}: {r:?}"))
                    .map_err(|e| format!("{what}: {e}"));
                self.note(format!("d{i} {r:?}"));
                self.devices[i].replies.push((id, r));
            }
            (Request2::Put { .. }, Ok(other)) => panic!("a put answered with {other:?}"),
        }
    }

    fn send(&mut self, i: usize, e: Effect) {
        match e {
            Effect::Send { peer, frame } | Effect::TrySend { peer, frame } => {
                self.deliver_frame(i, peer, frame)
            }
            Effect::Publish { bytes, topic } => {
                let peers: Vec<usize> = self
                    .links
                    .iter()
                    .filter_map(|(a, b)| match (*a == i, *b == i) {
                        (true, _) => Some(*b),
                        (_, true) => Some(*a),
                        _ => None,
                    })
                    .collect();
                for to in peers {
                    if self.devices[to].joining.is_some() {
                        continue;
                    }
                    if self.lost() {
                        self.count("messages lost");
                        continue;
                    }
                    self.gossip_token += 1;
                    let ev = NetEvent::Gossip {
                        token: self.gossip_token,
                        author: Some(self.devices[i].peer),
                        topic: topic.clone(),
                        data: bytes.clone(),
                    };
                    self.send_later(to, Delivery::Net(ev));
                }
            }
            _ => {}
        }
    }

    fn deliver_frame(&mut self, i: usize, peer: PeerId, frame: Vec<u8>) {
        if self.keeper.as_ref().is_some_and(|k| k.peer == peer) {
            if self.keeper.as_ref().is_some_and(|k| k.linked.contains(&i)) {
                self.send_later(i, Delivery::KeeperRequest { from: i, frame });
            }
            return;
        }
        let Some(to) = self.index_of(&peer) else {
            return;
        };
        if !self.links.contains(&(i.min(to), i.max(to))) {
            return;
        }
        if self.lost() {
            self.count("messages lost");
            return;
        }
        let from = self.devices[i].peer;
        if self.devices[to].joining.is_some() {
            if let Ok(frame) = Frame::decode(&frame) {
                self.send_later(to, Delivery::Pairing { from, frame });
            }
            return;
        }
        let ev = NetEvent::Frame {
            peer: from,
            bytes: frame,
        };
        self.send_later(to, Delivery::Net(ev));
    }

    fn rest(&mut self, i: usize, e: Effect) {
        match e {
            Effect::Disconnect(peer) => {
                if let Some(j) = self.index_of(&peer) {
                    self.unlink(i, j);
                }
            }
            Effect::Dial { peer: Some(p), .. } => {
                if let Some(j) = self.index_of(&p) {
                    self.connect(i, j);
                }
            }
            Effect::DialInfra { peer, .. } => self.connect_keeper(i, peer),
            Effect::Announce(txt) => {
                self.devices[i].announce = Some(txt.clone());
                self.announce_to_lan(i, txt);
            }
            Effect::RunCatchUp(job) => {
                self.count("catch-ups");
                // A worker thread: the result comes back a little later.
                let done = job.run();
                self.send_later(i, Delivery::CaughtUp(Box::new(done)));
            }
            Effect::ReleaseMemory => self.devices[i].released_ms.push(self.now_ms),
            Effect::ReaderScan { schemas, now_secs } => {
                self.send_later(i, Delivery::Scan { schemas, now_secs });
            }
            Effect::Load(container) => {
                self.count("loads off the loop");
                self.send_later(i, Delivery::Load(container));
            }
            Effect::Reload(container) => {
                let disk = self.devices[i].disk.clone();
                let loaded = disk.and_then(|d| {
                    let changes = d.containers.lock().unwrap().get(&container).cloned()?;
                    let actor = DeviceKey::from_seed(&d.device_seed).public().to_vec();
                    Container::load(&actor, None, changes).ok()
                });
                self.handle(
                    i,
                    Input::Reloaded {
                        container,
                        loaded: loaded.map(Box::new),
                    },
                );
            }
            _ => {}
        }
    }

    fn announce_to_lan(&mut self, i: usize, txt: Vec<(String, String)>) {
        let lan = self.devices[i].lan;
        let (_, sa) = addr_of(i);
        let instance = self.devices[i].peer.to_string();
        let to: Vec<usize> = (0..self.devices.len())
            .filter(|&j| j != i && self.devices[j].lan == lan && self.devices[j].running())
            .collect();
        for j in to {
            let ev = MdnsEvent::Resolved {
                instance: instance.clone(),
                txt: txt.clone(),
                addrs: vec![sa],
            };
            self.send_later(j, Delivery::Mdns(ev));
        }
    }

    /// The reader's lifecycle scan on device `i`: each container as the
    /// disk holds it, through the rules the node's reader applies.
    fn scan(
        &mut self,
        i: usize,
        schemas: Vec<nuwa_agent::asm_model::schema::AsmSchema>,
        now_secs: i64,
    ) {
        let Some(disk) = self.devices[i].disk.clone() else {
            return;
        };
        for schema in schemas {
            let container = schema.id.full.clone();
            let Some(c) = disk.load(&container) else {
                continue;
            };
            let items = nuwa_agent::asm_model::doc::items(c.doc(), &schema.layout)
                .expect("a core container renders");
            let scan = nuwa_agent::asm::scan(&schema, &items, now_secs);
            self.devices[i]
                .scanned
                .push((self.now_ms, container.clone()));
            let heads = c.heads();
            self.handle(
                i,
                Input::Scanned {
                    container,
                    heads,
                    scan,
                },
            );
        }
    }

    /// A dial from `i` to `j` succeeds when both are up on one network.
    fn connect(&mut self, i: usize, j: usize) {
        let (a, b) = (i.min(j), i.max(j));
        if i == j || self.links.contains(&(a, b)) {
            return;
        }
        let up = |d: &Device| d.running() || d.joining.is_some();
        if !up(&self.devices[i])
            || !up(&self.devices[j])
            || self.devices[i].lan != self.devices[j].lan
        {
            return;
        }
        self.links.insert((a, b));
        for (x, y) in [(i, j), (j, i)] {
            let peer = self.devices[y].peer;
            let connected = NetEvent::Connected {
                peer,
                public: Some(self.devices[y].key.public()),
                remote: addr_of(y).0,
            };
            // identify follows: the peer's listen address.
            let identified = NetEvent::Identified {
                peer,
                listen_addrs: vec![addr_of(y).0.with(peer::Protocol::P2p(peer))],
            };
            if self.devices[x].running() {
                self.handle(x, Input::Net(vec![connected]));
                self.send_later(x, Delivery::Net(identified));
            }
        }
    }

    /// Device `i`'s `status`, as its API would answer now.
    pub fn status(&mut self, i: usize) -> nuwa_agent::status::Status {
        let now = self.now_ms;
        let agent = self.devices[i].agent.as_mut().expect("a running device");
        let effects = agent.handle(
            Input::Api(vec![(RequestId(u64::MAX), Request::Status)]),
            now,
        );
        effects
            .into_iter()
            .find_map(|e| match e {
                Effect::Reply {
                    result: Ok(nuwa_agent::api::Reply::Status(s)),
                    ..
                } => Some(*s),
                _ => None,
            })
            .expect("a status reply")
    }

    /// A copy of the keeper's store as it is now.
    pub fn keeper_backup(&self) -> nuwa_keeper::MemKeeperStore {
        let k = self.keeper.as_ref().expect("a sim with a keeper");
        k.store.get().clone()
    }

    /// The keeper restarts on `backup`, an older copy of its store: its
    /// connections drop, and what it stored since the copy is gone.
    pub fn keeper_roll_back(&mut self, backup: nuwa_keeper::MemKeeperStore) {
        let Some(k) = &mut self.keeper else { return };
        *k.store.get() = backup;
        k.keeper = nuwa_keeper::Keeper::new(
            Box::new(k.store.clone()),
            nuwa_keeper::KeeperConfig::default(),
        );
        let peer = k.peer;
        let linked: Vec<usize> = std::mem::take(&mut k.linked).into_iter().collect();
        self.flight
            .retain(|m| !matches!(m.what, Delivery::KeeperRequest { .. }));
        self.note("keeper rolled back".to_owned());
        for i in linked {
            if self.devices[i].running() {
                self.handle(i, Input::Net(vec![NetEvent::Disconnected { peer }]));
            }
        }
    }

    fn connect_keeper(&mut self, i: usize, peer: PeerId) {
        let Some(k) = &mut self.keeper else { return };
        if k.peer != peer || !k.linked.insert(i) {
            return;
        }
        let ev = NetEvent::Connected {
            peer,
            public: None,
            remote: addr_of(9_999).0,
        };
        self.handle(i, Input::Net(vec![ev]));
    }

    // ---- time ------------------------------------------------------------

    /// One step: messages due are delivered, due devices tick.
    pub fn step(&mut self) {
        self.now_ms += STEP_MS;
        let now = self.now_ms;
        let mut due: Vec<InFlight> = Vec::new();
        let mut i = 0;
        while i < self.flight.len() {
            if self.flight[i].at_ms <= now {
                due.push(self.flight.swap_remove(i));
            } else {
                i += 1;
            }
        }
        due.sort_by_key(|m| (m.at_ms, m.seq));
        for m in due {
            self.deliver(m);
        }
        for i in 0..self.devices.len() {
            let d = &mut self.devices[i];
            if let Some(j) = d.joining.as_mut() {
                let steps = j.tick(now);
                self.join_steps(i, steps);
                continue;
            }
            if d.running() && now >= d.next_tick_ms {
                d.next_tick_ms = now + TICK_MS;
                self.handle(i, Input::Tick { rss_bytes: None });
            }
        }
    }

    fn deliver(&mut self, m: InFlight) {
        let to = m.to;
        match m.what {
            Delivery::Net(ev) => self.handle(to, Input::Net(vec![ev])),
            Delivery::Mdns(ev) => self.handle(to, Input::Mdns(ev)),
            Delivery::CaughtUp(done) => self.handle(to, Input::CaughtUp(done)),
            Delivery::Load(container) => {
                let Some(disk) = self.devices[to].disk.as_ref() else {
                    return;
                };
                let actor = self.devices[to]
                    .agent
                    .as_ref()
                    .map(|a| a.session().engine().actor().to_vec())
                    .unwrap_or_default();
                let changes = disk.containers.lock().unwrap().get(&container).cloned();
                let loaded = match changes {
                    None => Ok(None),
                    Some(changes) => Container::load(&actor, None, changes)
                        .map(|c| Some(Box::new(c)))
                        .map_err(|e| e.to_string()),
                };
                self.handle(to, Input::Loaded { container, loaded });
            }
            Delivery::Scan { schemas, now_secs } => self.scan(to, schemas, now_secs),
            Delivery::Pairing { from, frame } => {
                let now = self.now_ms;
                let Some(flow) = self.devices[to].joining.as_mut() else {
                    return;
                };
                if let Frame::Pairing { step, body } = frame {
                    let steps = flow.on_step(from, step, &body, now);
                    self.join_steps(to, steps);
                }
            }
            Delivery::KeeperRequest { from, frame } => self.keeper_request(from, frame),
            Delivery::Unlink(other) => self.unlink(to, other),
        }
    }

    fn keeper_request(&mut self, from: usize, frame: Vec<u8>) {
        let now = self.now_ms;
        let Some(k) = self.keeper.as_mut() else {
            return;
        };
        if !k.linked.contains(&from) {
            return;
        }
        let Ok(Frame::KeeperRequest(req)) = Frame::decode(&frame) else {
            return;
        };
        let resp = k.keeper.handle(*req, now);
        *self.tally.entry("keeper requests").or_default() += 1;
        let peer = k.peer;
        let ev = NetEvent::Frame {
            peer,
            bytes: Frame::KeeperResponse(Box::new(resp)).encode(),
        };
        self.send_later(from, Delivery::Net(ev));
    }

    /// The first of `writes` that device `i`'s disk does not hold (with its
    /// value), if any.
    pub fn first_lacking<'a>(&self, i: usize, writes: &'a [Acked]) -> Option<&'a Acked> {
        let held = self.devices[i]
            .disk
            .as_ref()
            .map(|d| d.load_all())
            .unwrap_or_default();
        writes
            .iter()
            .find(|w| held.get(&w.container).and_then(|c| c.get(&w.key)).as_ref() != Some(&w.value))
    }

    /// Runs for `ms` of virtual time.
    pub fn run_for(&mut self, ms: u64) {
        let until = self.now_ms + ms;
        while self.now_ms < until {
            self.step();
        }
    }

    // ---- requests ----------------------------------------------------------

    fn request(&mut self, i: usize, req: Request, what: Request2) -> RequestId {
        self.next_request += 1;
        let id = RequestId(self.next_request);
        self.devices[i].waiting.insert(id, what);
        self.handle(i, Input::Api(vec![(id, req)]));
        id
    }

    /// A local write of a fresh key on device `i`.
    pub fn write(&mut self, i: usize, container: &str) {
        if !self.devices[i].running() {
            return;
        }
        // Unique in the run (the request's id): two devices never write
        // the same key, so every acknowledged value must survive as is.
        let n = self.next_request + 1;
        let key = format!("w{n}");
        let value = serde_json::json!({ "by": i, "n": n });
        let req = Request::Put(PutBody {
            container: container.to_owned(),
            key: key.clone(),
            value: value.clone(),
        });
        let what = Request2::Put {
            container: container.to_owned(),
            key,
            value,
        };
        self.request(i, req, what);
    }

    /// `state.create` of `object` in the container of `schema_uri` on
    /// device `i`.
    pub fn create(&mut self, i: usize, schema_uri: &str, object: serde_json::Value) -> RequestId {
        self.note(format!("d{i} creates an item of {schema_uri}"));
        let req = Request::Tool(nuwa_agent::api::Tool::Create {
            schema_uri: schema_uri.to_owned(),
            object,
            id: None,
        });
        self.request(i, req, Request2::Other("create"))
    }

    /// `device revoke` of `target` on admin `admin`.
    pub fn revoke(&mut self, admin: usize, target: usize) -> RequestId {
        let ctx = self.devices[target].context_id();
        self.note(format!("d{admin} revokes d{target}"));
        let req = Request::Revoke(RevokeBody { context_id: ctx });
        self.request(admin, req, Request2::Other("revoke"))
    }

    /// `app grant` on `admin`: a capability for the app key `to_did` over
    /// `target`.
    pub fn app_grant(&mut self, admin: usize, to_did: &str, target: &str) -> RequestId {
        self.note(format!("d{admin} grants an app {target}"));
        let req = Request::AppGrant(nuwa_agent::apps::GrantBody {
            to: to_did.to_owned(),
            target: target.to_owned(),
            actions: vec!["read".into(), "write".into()],
            expires_secs: None,
        });
        self.request(admin, req, Request2::Other("app grant"))
    }

    /// `app revoke ID` on device `i`.
    pub fn app_revoke(&mut self, i: usize, id: &str) -> RequestId {
        self.note(format!("d{i} revokes app capability {id}"));
        let req = Request::AppRevoke(nuwa_agent::apps::RevokeAppBody { id: id.to_owned() });
        self.request(i, req, Request2::Other("app revoke"))
    }

    /// `device promote` of `target` on admin `admin`.
    pub fn promote(&mut self, admin: usize, target: usize) -> RequestId {
        let ctx = self.devices[target].context_id();
        self.note(format!("d{admin} promotes d{target}"));
        let req = Request::Admin(nuwa_agent::api::AdminChange::Promote(
            nuwa_agent::api::DeviceBody { context_id: ctx },
        ));
        self.request(admin, req, Request2::Other("promote"))
    }

    /// `device provision` on admin `admin`: a new home, written by the
    /// agent's effects; the new device starts later.
    pub fn provision(&mut self, admin: usize) -> RequestId {
        self.provision_expiring(admin, None)
    }

    /// `device provision --expires SECS` on admin `admin`.
    pub fn provision_expiring(&mut self, admin: usize, expires_secs: Option<u64>) -> RequestId {
        let device = DeviceKey::generate().expect("entropy");
        let body = nuwa_agent::api::ProvisionBody {
            out: format!("/sim/d{}", self.devices.len()),
            name: format!("d{}", self.devices.len()),
            expires_secs,
        };
        self.note(format!(
            "d{admin} provisions (expires in {expires_secs:?} s)"
        ));
        let req = Request::Provision { body, device };
        self.request(admin, req, Request2::Other("provision"))
    }

    /// A new device waits to pair with a fresh code (on `lan`), and
    /// `approver` approves it (`recovery`: a handover to recovery words).
    pub fn pair(&mut self, approver: usize, lan: usize, recovery: Option<RecoveryJoin>) -> usize {
        self.pair_expiring(approver, lan, recovery, (None, None))
    }

    /// [`Sim::pair`] with `pair --expires` on the new device and `device
    /// approve --expires` on the approver (seconds; `None`: not given).
    pub fn pair_expiring(
        &mut self,
        approver: usize,
        lan: usize,
        recovery: Option<RecoveryJoin>,
        (joiner_secs, approver_secs): (Option<u64>, Option<u64>),
    ) -> usize {
        let key = DeviceKey::generate().expect("entropy");
        let n = self.devices.len();
        let j = self.add_device(format!("d{n}"), DeviceKey::from_seed(&key.seed()), None);
        self.devices[j].lan = lan;
        let code = nuwa_crypto::pairing::PairingCode::generate_with_ttl(self.now_ms / 1000, 600)
            .expect("code");
        let is_recovery = recovery.is_some();
        let flow = JoinFlow::new(
            code.clone(),
            key,
            format!("d{j}"),
            self.devices[j].peer,
            recovery,
        )
        .expect("flow")
        .with_expiry(joiner_secs);
        self.devices[j].joining = Some(flow);
        // Its pairing announcement, on its network.
        let txt = nuwa_agent::announce::Announcement::new_signed(
            &nuwa_agent::pairing::mdns_agent(&code.nameplate()),
            self.devices[j].context_id(),
            self.devices[j].peer.to_string(),
            4001,
            (self.now_ms / 1000) as i64,
            |b| self.devices[j].key.sign(b),
        )
        .to_txt();
        self.announce_to_lan(j, txt);
        self.note(format!(
            "d{j} waits to pair ({}); d{approver} approves",
            if is_recovery { "recovery" } else { "grant" }
        ));
        let body = ApproveBody {
            code: code.to_string(),
            name: None,
            timeout_secs: Some(60),
            recovery: is_recovery,
            expires_secs: approver_secs,
        };
        self.request(approver, Request::Approve(body), Request2::Other("approve"));
        j
    }

    fn join_steps(&mut self, j: usize, steps: Vec<JoinStep>) {
        for step in steps {
            match step {
                JoinStep::Send { peer, frame } => {
                    let Some(to) = self.index_of(&peer) else {
                        continue;
                    };
                    if self.links.contains(&(j.min(to), j.max(to))) {
                        let ev = NetEvent::Frame {
                            peer: self.devices[j].peer,
                            bytes: frame.encode(),
                        };
                        self.send_later(to, Delivery::Net(ev));
                    }
                }
                JoinStep::Say(line) => self.note(format!("d{j}: {line}")),
                // The simulated network has no rendezvous servers or relays
                // on the pairing path: the approver meets the new device
                // on its LAN.
                JoinStep::Register { .. } | JoinStep::ReserveRelay { .. } => {}
                // The simulated recoveries name their lost devices up front.
                JoinStep::ChooseLost { .. } => panic!("d{j} asked which devices were lost"),
                JoinStep::Failed(reason) => {
                    self.note(format!("d{j} pairing failed: {reason}"));
                    self.devices[j].joining = None;
                    self.devices[j].gone = true;
                }
                JoinStep::Paired {
                    peer,
                    home,
                    confirm,
                    ..
                } => {
                    let d = &mut self.devices[j];
                    d.disk = Some(Disk {
                        device_seed: *d.key.seed(),
                        master_seed: None,
                        name: home.name.clone(),
                        log: home.log.clone(),
                        keys: home.keys.clone(),
                        grant: home.grant.clone(),
                        containers: Arc::new(Mutex::new(BTreeMap::new())),
                        meta: BTreeMap::new(),
                    });
                    if !home.seen.is_empty() {
                        let record = home.seen.to_bytes(self.now_ms);
                        if let Some(disk) = d.disk.as_mut() {
                            disk.meta
                                .insert(nuwa_agent::devices::SEEN_META.to_owned(), record);
                        }
                    }
                    d.joining = None;
                    let recovered = home.recovered.is_some();
                    self.count(if recovered { "recoveries" } else { "pairings" });
                    self.note(format!("d{j} paired"));
                    if let (Some(to), Some(confirm)) = (self.index_of(&peer), confirm) {
                        let ev = NetEvent::Frame {
                            peer: self.devices[j].peer,
                            bytes: confirm.encode(),
                        };
                        self.send_later(to, Delivery::Net(ev));
                    }
                    // The new device starts; the pairing connection ends once
                    // the confirmation had time to arrive (as `pair` lingers).
                    if let Some(to) = self.index_of(&peer) {
                        self.send_later_at(j, 1_000, Delivery::Unlink(to));
                    }
                    self.start(j);
                }
            }
        }
    }

    // ---- invariants ----------------------------------------------------

    /// Checked after every step of a device: a revoked device never holds
    /// the key of an epoch its revocation opened, and a device never lists
    /// again a device its chain removed.
    fn check_device(&mut self, i: usize) {
        self.note_expired();
        let Some(agent) = self.devices[i].agent.as_ref() else {
            return;
        };
        let ctx = self.devices[i].context_id();
        let newest = agent.session().secure().keys().current().epoch();
        if !self.epoch_knew.contains_key(&newest) {
            let doc = agent.session().log().current();
            let now_secs = (self.now_ms / 1000) as i64;
            // An expired device listed still is as good as removed: no
            // grant may be sealed to it.
            let knew = self
                .revoked
                .keys()
                .filter(|r| {
                    doc.find_method(r)
                        .is_none_or(|m| m.check_not_expired(now_secs).is_err())
                })
                .cloned()
                .collect();
            self.epoch_knew.insert(newest, knew);
        }
        if let Some(epoch) = self.revoked.get(&ctx) {
            // Strong removal cannot reach back: a home recovering on a
            // revoked device's stale chain, or an admin that has heard of
            // one lost branch's removals and not yet of another's, seals
            // to a device it still lists. What must hold: no device that
            // had heard of the revocation sealed a key to it.
            for held in agent.session().secure().keys().epochs() {
                let knew = self.epoch_knew.get(&held).is_some_and(|k| k.contains(&ctx));
                assert!(
                    held < *epoch || !knew,
                    "seed {}: revoked d{i} holds epoch {held} (its revocation opened {epoch}), \
                     opened by a device that knew of the revocation\n{}",
                    self.seed,
                    self.trace_tail()
                );
            }
        }
        let log = agent.session().log();
        let current: BTreeSet<String> = log
            .current()
            .verification_method
            .iter()
            .map(|m| nuwa_identity::document::DidDocument::fragment(&m.id).to_owned())
            .filter(|f| f.starts_with("device-"))
            .collect();
        let ever: BTreeSet<String> = log
            .documents()
            .flat_map(|d| {
                d.verification_method
                    .iter()
                    .map(|m| nuwa_identity::document::DidDocument::fragment(&m.id).to_owned())
                    .collect::<Vec<_>>()
            })
            .filter(|f| f.starts_with("device-"))
            .collect();
        // Refused by every peer: once its time ran out, an expired device
        // is nobody's verified peer.
        for (peer, ctx) in agent.session().verified() {
            assert!(
                !self.expired.contains(ctx),
                "seed {}: d{i} still syncs with expired {ctx} ({peer})\n{}",
                self.seed,
                self.trace_tail()
            );
        }
        if let Some(back) = current.intersection(&self.devices[i].removed_seen).next() {
            panic!(
                "seed {}: d{i} lists {back} again after its chain removed it\n{}",
                self.seed,
                self.trace_tail()
            );
        }
        self.devices[i]
            .removed_seen
            .extend(ever.difference(&current).cloned());
    }

    /// A short-lived device whose time (grace included) ran out counts as
    /// revoked from here on, as of an epoch past every epoch held now (any
    /// epoch opened later must not reach it).
    fn note_expired(&mut self) {
        let now = self.now_ms;
        let due: Vec<String> = self
            .expiring
            .iter()
            .filter(|(_, at)| **at <= now)
            .map(|(c, _)| c.clone())
            .collect();
        for ctx in due {
            self.expiring.remove(&ctx);
            let held = self
                .devices
                .iter()
                .filter_map(|d| d.agent.as_ref())
                .map(|a| a.session().secure().keys().current().epoch())
                .max()
                .unwrap_or(0);
            self.revoked.entry(ctx.clone()).or_insert(held + 1);
            self.expired.insert(ctx.clone());
            if let Some(d) = self.devices.iter_mut().find(|d| d.context_id() == ctx) {
                d.gone = true;
            }
            self.note(format!("{ctx} expired"));
        }
    }

    /// Records that `target` was revoked by `admin` once the admin's reply
    /// says which epoch it opened.
    pub fn note_revocation(&mut self, admin: usize, id: RequestId, target: usize) -> bool {
        let Some((_, r)) = self.devices[admin]
            .replies
            .iter()
            .find(|(rid, _)| *rid == id)
        else {
            return false;
        };
        let Ok(text) = r else { return false };
        let epoch = text
            .split("epoch: ")
            .nth(1)
            .and_then(|s| s.split(|c: char| !c.is_ascii_digit()).next())
            .and_then(|n| n.parse::<u64>().ok());
        if let Some(epoch) = epoch {
            let ctx = self.devices[target].context_id();
            self.revoked.insert(ctx, epoch);
            self.devices[target].gone = true;
        }
        true
    }

    /// At the end, after the world healed: every acknowledged write of a
    /// device never revoked (or lost) is on every running device never
    /// revoked, and all of them hold one chain head.
    pub fn check_converged(&self) {
        let live: Vec<usize> = (0..self.devices.len())
            .filter(|&i| !self.devices[i].gone && self.devices[i].running())
            .collect();
        assert!(
            !live.is_empty(),
            "seed {}: no device left running",
            self.seed
        );
        let heads: BTreeSet<String> = live
            .iter()
            .map(|&i| {
                let a = self.devices[i].agent.as_ref().unwrap();
                a.session().log().head_hash().to_owned()
            })
            .collect();
        assert_eq!(
            heads.len(),
            1,
            "seed {}: devices end on {} chain heads\n{}",
            self.seed,
            heads.len(),
            self.trace_tail()
        );
        // One key epoch at the end: concurrent revocations converge on one
        // epoch (n+1, or an n+2 that an admin opened when it re-signed a
        // removal), and every live device holds it.
        let epochs: BTreeSet<u64> = live
            .iter()
            .map(|&i| {
                let a = self.devices[i].agent.as_ref().unwrap();
                a.session().secure().keys().current().epoch()
            })
            .collect();
        assert_eq!(
            epochs.len(),
            1,
            "seed {}: devices end on key epochs {epochs:?}\n{}",
            self.seed,
            self.trace_tail()
        );
        // Strong removal: no revoked device is listed anywhere, and the
        // chain itself removed it (an admin signed what a lost branch did).
        // A revocation whose every witness was lost, revoked or rolled
        // back to a copy before it met the recovered chain died with them:
        // no device alive may have heard of it (the limit written in
        // ARCHITECTURE.md).
        let untold = |ctx: &String| {
            self.witnesses
                .get(ctx)
                .is_some_and(|w| w.iter().all(|&i| self.devices[i].gone))
        };
        for &i in &live {
            let log = self.devices[i].agent.as_ref().unwrap().session().log();
            let now_secs = (self.now_ms / 1000) as i64;
            for doc in [log.current(), log.chain_document()] {
                for ctx in self.revoked.keys().filter(|c| !untold(c)) {
                    // An expired device no admin pruned yet (the first
                    // admin was lost) is listed, but as expired.
                    let expired = self.expired.contains(ctx)
                        && doc
                            .find_method(ctx)
                            .is_some_and(|m| m.check_not_expired(now_secs).is_err());
                    assert!(
                        doc.find_method(ctx).is_none() || expired,
                        "seed {}: d{i} lists revoked {ctx} at the end\n{}",
                        self.seed,
                        self.trace_tail()
                    );
                }
            }
        }
        // What reached a device is what its store holds (the engine may
        // have evicted an idle container; the store has it all).
        let stored: Vec<(usize, BTreeMap<String, Container>)> = live
            .iter()
            .map(|&i| (i, self.devices[i].disk.as_ref().unwrap().load_all()))
            .collect();
        for w in &self.acked {
            if self.devices[w.device].gone {
                continue;
            }
            let holds = |containers: &BTreeMap<String, Container>| {
                containers
                    .get(&w.container)
                    .and_then(|c| c.get(&w.key))
                    .as_ref()
                    == Some(&w.value)
            };
            for (i, containers) in &stored {
                if !holds(containers) {
                    let holders: Vec<usize> = stored
                        .iter()
                        .filter(|(_, c)| holds(c))
                        .map(|(j, _)| *j)
                        .collect();
                    // What each live device stands on, for the replay.
                    for &k in &live {
                        let s = self.devices[k].agent.as_ref().unwrap().session();
                        let verified: Vec<&str> = s.verified().map(|(_, c)| c).collect();
                        let listed: Vec<&str> = s
                            .log()
                            .current()
                            .verification_method
                            .iter()
                            .map(|m| nuwa_identity::document::DidDocument::fragment(&m.id))
                            .collect();
                        eprintln!(
                            "d{k} ({}): chain length {}, epoch {}, verified {verified:?}, lists {listed:?}",
                            s.membership().context_id(),
                            s.log().len(),
                            s.secure().epoch(),
                        );
                    }
                    panic!(
                        "seed {}: d{}'s write {} in {} (acknowledged at {} ms) is missing on d{i} \
                         (held by {holders:?})\n{}",
                        self.seed,
                        w.device,
                        w.key,
                        w.container,
                        w.at_ms - EPOCH_MS,
                        self.trace_tail()
                    );
                }
            }
        }
        // Every live store holds the same state: a change that reached one
        // of them (one that a torn handle sent and its writer lost, say)
        // reached all, the writer included.
        let (first, first_stored) = &stored[0];
        for (i, containers) in &stored[1..] {
            let names: BTreeSet<&String> = containers.keys().chain(first_stored.keys()).collect();
            for name in names {
                let a = first_stored.get(name).map(|c| c.to_json());
                let b = containers.get(name).map(|c| c.to_json());
                assert!(
                    a == b,
                    "seed {}: {name} differs between d{first} and d{i} at the end:\n{a:?}\n{b:?}\n{}",
                    self.seed,
                    self.trace_tail()
                );
            }
        }
    }

    pub fn trace_tail(&self) -> String {
        let n = self.trace.len();
        self.trace[n.saturating_sub(60)..].join("\n")
    }

    /// Every device on one network, every device not gone running, and
    /// time to settle.
    pub fn heal(&mut self, settle_ms: u64) {
        self.knobs.loss_per_mille = 0;
        // Nobody crashes while the world heals (it would stay down).
        self.torn.clear();
        for i in 0..self.devices.len() {
            self.move_to(i, 0);
        }
        for i in 0..self.devices.len() {
            if !self.devices[i].gone && self.devices[i].joining.is_none() {
                self.start(i);
            }
        }
        self.run_for(settle_ms);
    }

    pub fn admin_of_record(&self) -> Option<usize> {
        (0..self.devices.len()).find(|&i| {
            let d = &self.devices[i];
            d.running()
                && !d.gone
                && d.disk
                    .as_ref()
                    .is_some_and(|disk| disk.master_seed.is_some())
        })
    }
}
