//! Model-based tests: random operation sequences run against each backend and against a
//! `BTreeMap` model, comparing every observable result. Replay a failure with `SEED=<n>`.

mod common;

use std::collections::BTreeMap;
use std::path::PathBuf;

use common::{Rng, seeds};
use nuwa_crypto::AtRestKey;
use nuwa_store::{ContainerRecord, MemStore, SledStore, Storage, StoreError};

/// The reference model of the storage contract.
#[derive(Default)]
struct Model {
    containers: BTreeMap<String, ModelContainer>,
    meta: BTreeMap<String, Vec<u8>>,
}

#[derive(Default)]
struct ModelContainer {
    snapshot: Option<Vec<u8>>,
    covers: u64,
    changes: BTreeMap<u64, Vec<u8>>,
    last_seq: u64,
}

impl ModelContainer {
    fn record(&self) -> ContainerRecord {
        ContainerRecord {
            snapshot: self.snapshot.clone(),
            snapshot_covers: self.covers,
            changes: self.changes.values().cloned().collect(),
            last_seq: self.last_seq,
        }
    }
}

impl Model {
    /// Appends `changes` to `name` as the contract says; returns the last sequence number.
    fn append(&mut self, name: &str, changes: Vec<Vec<u8>>) -> u64 {
        if changes.is_empty() {
            return self.containers.get(name).map_or(0, |c| c.last_seq);
        }
        let c = self.containers.entry(name.to_owned()).or_default();
        for change in changes {
            c.last_seq += 1;
            c.changes.insert(c.last_seq, change);
        }
        c.last_seq
    }
}

/// Up to four changes, now and then a large one.
fn random_changes(rng: &mut Rng) -> Vec<Vec<u8>> {
    let count = rng.index(5);
    (0..count)
        .map(|_| {
            let len = if rng.chance(10) {
                rng.index(8192)
            } else {
                rng.index(48)
            };
            rng.bytes(len)
        })
        .collect()
}

/// A backend under test, able to simulate a restart.
trait Harness {
    fn store(&self) -> &dyn Storage;
    fn reopen(&mut self);
}

struct MemHarness(MemStore);

impl Harness for MemHarness {
    fn store(&self) -> &dyn Storage {
        &self.0
    }
    fn reopen(&mut self) {
        // Memory does not survive a restart; the contract under test here is the rest.
    }
}

struct SledHarness {
    _dir: tempfile::TempDir,
    path: PathBuf,
    key: [u8; 32],
    store: Option<SledStore>,
}

impl SledHarness {
    fn new(seed: u64) -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("db");
        let mut rng = Rng::new(seed ^ 0x5eed);
        let key: [u8; 32] = rng.bytes(32).try_into().expect("32 bytes");
        let store = SledStore::open(&path, AtRestKey::from_bytes(key)).expect("open");
        SledHarness {
            _dir: dir,
            path,
            key,
            store: Some(store),
        }
    }
}

impl Harness for SledHarness {
    fn store(&self) -> &dyn Storage {
        self.store
            .as_ref()
            .expect("store is open between operations")
    }
    fn reopen(&mut self) {
        drop(self.store.take());
        self.store =
            Some(SledStore::open(&self.path, AtRestKey::from_bytes(self.key)).expect("reopen"));
    }
}

/// Names in several NIP-8 namespaces (default, core, two capabilities, the daemon's), so
/// that group commits span namespaces and each namespace's trees fill and empty.
const NAMES: [&str; 8] = [
    "a",
    "memory",
    "ünïcode/ctx-☃",
    "agent.conversation.history",
    "did:nuwa:core:MemoryStore#v1",
    "did:nuwa:cap:note@1.0.0:state:Note#v2",
    "did:nuwa:cap:todo:state:Item#v1",
    "nuwa:schemas",
];
const META_KEYS: [&str; 3] = ["peer-id", "did-log-head", ""];

fn long_name() -> String {
    "n".repeat(256)
}

/// Runs one seeded sequence of `ops` operations against `harness`.
fn run(seed: u64, ops: usize, harness: &mut dyn Harness) {
    let mut rng = Rng::new(seed);
    let mut model = Model::default();
    let mut names: Vec<String> = NAMES.iter().map(|s| s.to_string()).collect();
    names.push(long_name());
    let ctx = |step: usize, what: &str| format!("SEED={seed} step {step}: {what}");

    for step in 0..ops {
        let roll = rng.below(100);
        let name = names[rng.index(names.len())].clone();
        match roll {
            0..=24 => {
                let changes = random_changes(&mut rng);
                let got = harness.store().append_changes(&name, &changes);
                let want = model.append(&name, changes);
                assert_eq!(
                    got.unwrap_or_else(|e| panic!("{}: {e}", ctx(step, "append"))),
                    want,
                    "{}",
                    ctx(step, "append seq")
                );
            }
            25..=34 => {
                // A group commit over up to three containers, perhaps one twice.
                let batches: Vec<(String, Vec<Vec<u8>>)> = (0..1 + rng.index(3))
                    .map(|_| {
                        let name = names[rng.index(names.len())].clone();
                        (name, random_changes(&mut rng))
                    })
                    .collect();
                let refs: Vec<(&str, &[Vec<u8>])> =
                    batches.iter().map(|(n, c)| (n.as_str(), &c[..])).collect();
                let got = harness.store().append_many(&refs);
                let want: Vec<u64> = batches
                    .iter()
                    .map(|(name, changes)| model.append(name, changes.clone()))
                    .collect();
                assert_eq!(
                    got.unwrap_or_else(|e| panic!("{}: {e}", ctx(step, "append_many"))),
                    want,
                    "{}",
                    ctx(step, "append_many seqs")
                );
            }
            35..=49 => {
                let (covers_now, last) = model
                    .containers
                    .get(&name)
                    .map_or((0, 0), |c| (c.covers, c.last_seq));
                let covers = match rng.below(10) {
                    0..=5 => last,
                    6..=7 => covers_now + rng.below(last - covers_now + 1),
                    8 => covers_now.saturating_sub(1),
                    _ => last + 1,
                };
                let snapshot = rng.bytes_below(256);
                let got = harness.store().save_snapshot(&name, &snapshot, covers);
                if covers > last {
                    assert!(
                        matches!(got, Err(StoreError::SnapshotAhead { covers: c, last_seq: l, .. }) if c == covers && l == last),
                        "{}: {got:?}",
                        ctx(step, "snapshot ahead")
                    );
                } else if covers < covers_now {
                    assert!(
                        matches!(got, Err(StoreError::SnapshotStale { current, .. }) if current == covers_now),
                        "{}: {got:?}",
                        ctx(step, "stale snapshot")
                    );
                } else {
                    got.unwrap_or_else(|e| panic!("{}: {e}", ctx(step, "snapshot")));
                    let c = model.containers.entry(name.clone()).or_default();
                    c.snapshot = Some(snapshot);
                    c.covers = covers;
                    c.changes = c.changes.split_off(&(covers + 1));
                }
            }
            50..=64 => {
                let got = harness
                    .store()
                    .load_container(&name)
                    .unwrap_or_else(|e| panic!("{}: {e}", ctx(step, "load")));
                let want = model.containers.get(&name).map(ModelContainer::record);
                assert_eq!(got, want, "{}", ctx(step, &format!("load {name:?}")));
            }
            65..=69 => {
                let got = harness
                    .store()
                    .list_containers()
                    .unwrap_or_else(|e| panic!("{}: {e}", ctx(step, "list")));
                let want: Vec<String> = model.containers.keys().cloned().collect();
                assert_eq!(got, want, "{}", ctx(step, "list"));
            }
            70..=79 => {
                let key = META_KEYS[rng.index(META_KEYS.len())];
                let value = rng.bytes_below(100);
                harness
                    .store()
                    .put_meta(key, &value)
                    .unwrap_or_else(|e| panic!("{}: {e}", ctx(step, "put_meta")));
                model.meta.insert(key.to_owned(), value);
            }
            80..=84 => {
                let key = META_KEYS[rng.index(META_KEYS.len())];
                let got = harness
                    .store()
                    .get_meta(key)
                    .unwrap_or_else(|e| panic!("{}: {e}", ctx(step, "get_meta")));
                assert_eq!(
                    got.as_ref(),
                    model.meta.get(key),
                    "{}",
                    ctx(step, "get_meta")
                );
            }
            85..=89 => harness.reopen(),
            90..=94 => {
                let bad = if rng.chance(50) {
                    String::new()
                } else {
                    "x".repeat(257)
                };
                let s = harness.store();
                let results = [
                    s.append_changes(&bad, &[b"x".to_vec()]).map(drop),
                    s.save_snapshot(&bad, b"s", 0),
                    s.load_container(&bad).map(drop),
                ];
                for got in results {
                    assert!(
                        matches!(
                            got,
                            Err(StoreError::EmptyContainerName
                                | StoreError::ContainerNameTooLong { len: 257, max: 256 })
                        ),
                        "{}: {got:?}",
                        ctx(step, "bad name")
                    );
                }
            }
            _ => harness
                .store()
                .flush()
                .unwrap_or_else(|e| panic!("{}: {e}", ctx(step, "flush"))),
        }
    }

    // Final check of everything, before and after a restart.
    for pass in ["end", "end after reopen"] {
        let store = harness.store();
        let listed = store
            .list_containers()
            .unwrap_or_else(|e| panic!("{}: {e}", ctx(ops, "final list")));
        assert_eq!(
            listed,
            model.containers.keys().cloned().collect::<Vec<_>>(),
            "{}",
            ctx(ops, pass)
        );
        for (name, c) in &model.containers {
            let got = store
                .load_container(name)
                .unwrap_or_else(|e| panic!("{}: {e}", ctx(ops, "final load")));
            assert_eq!(
                got,
                Some(c.record()),
                "{}",
                ctx(ops, &format!("{pass}: {name:?}"))
            );
        }
        for (key, value) in &model.meta {
            assert_eq!(
                store.get_meta(key).expect("get_meta").as_ref(),
                Some(value),
                "{}",
                ctx(ops, pass)
            );
        }
        harness.reopen();
    }
}

// Goal: MemStore keeps the storage contract; method: 300 seeded random sequences compared
// with the model after every operation.
#[test]
fn mem_store_matches_model() {
    for seed in seeds(300) {
        run(seed, 150, &mut MemHarness(MemStore::new()));
    }
}

// Goal: SledStore keeps the storage contract across restarts; method: seeded random
// sequences, with reopens mixed in, compared with the model after every operation.
#[test]
fn sled_store_matches_model() {
    for seed in seeds(16) {
        run(seed, 120, &mut SledHarness::new(seed));
    }
}
