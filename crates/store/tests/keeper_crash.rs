//! The keeper's pushes under `kill -9`: a child process pushes to a `SledKeeperStore` as
//! fast as it can (entries, sometimes replacing older ones), printing each acknowledged
//! push; the parent kills it at a random point, reopens the store and checks that it holds
//! exactly the state after some whole push, no earlier than the last one acknowledged:
//! every push is all or nothing (its entries, what it replaced and its record together)
//! and durable when acknowledged.
//!
//! The child is this same test binary, re-run with `CHILD_DIR_ENV` set and filtered to
//! this test. Both sides draw the same pushes from the seed (`Plan`), so the parent knows
//! every state the store may be in. `NUWA_CRASH_RUNS=<n>` changes the number of crashes
//! (default 5); `SEED=<n>` replays one run.

mod common;

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use common::Rng;
use nuwa_keeper::{AgentHash, AgentRecord, Entry, KeeperStore, Usage};
use nuwa_store::SledKeeperStore;

const CHILD_DIR_ENV: &str = "NUWA_KEEPER_CRASH_CHILD_DIR";
const CHILD_SEED_ENV: &str = "NUWA_KEEPER_CRASH_CHILD_SEED";
const AGENT: AgentHash = [7; 32];
/// Upper bound on one run, so a hung child fails the test instead of hanging it.
const RUN_DEADLINE: Duration = Duration::from_secs(30);

/// The pushes of one run, drawn from its seed; push `k` (from 1) is the same on both sides.
struct Plan {
    rng: Rng,
    pushes: u64,
    next_seq: u64,
}

/// One push: its record, entries and `replaces_through`.
type Push = (AgentRecord, Vec<Entry>, u64);

impl Plan {
    fn new(seed: u64) -> Plan {
        Plan {
            rng: Rng::new(seed),
            pushes: 0,
            next_seq: 1,
        }
    }

    fn next(&mut self) -> Push {
        self.pushes += 1;
        let k = self.pushes;
        let count = 1 + self.rng.below(6);
        let entries: Vec<Entry> = (0..count)
            .map(|i| {
                // Some entries are large, so a push crosses sled's pages and segments.
                let pad = if self.rng.chance(10) {
                    20_000
                } else {
                    self.rng.index(200)
                };
                let mut envelope = format!("push {k} entry {i} ").into_bytes();
                envelope.resize(envelope.len() + pad, b'.');
                Entry {
                    received_ms: k,
                    envelope,
                }
            })
            .collect();
        let newest = self.next_seq - 1;
        let through = if newest > 0 && self.rng.chance(20) {
            newest - self.rng.below(newest.min(8))
        } else {
            0
        };
        self.next_seq += count;
        let record = AgentRecord {
            did: "did:example:crash".into(),
            doc: None,
            last_push_ms: BTreeMap::from([("pushes".to_owned(), k)]),
        };
        (record, entries, through)
    }
}

/// The body of the child process: pushes until it is killed.
fn crash_child_pusher(dir: &std::ffi::OsStr) {
    let seed: u64 = std::env::var(CHILD_SEED_ENV)
        .expect("seed")
        .parse()
        .expect("seed is u64");
    let mut store = SledKeeperStore::open(Path::new(dir)).expect("child open");
    let mut plan = Plan::new(seed);
    println!("READY");
    loop {
        let (record, entries, through) = plan.next();
        store
            .push(&AGENT, &record, &entries, through)
            .expect("push");
        println!("ACK {}", plan.pushes);
    }
}

/// One crash: start the child, kill it after `kill_after` acknowledgements, verify the store.
fn crash_once(seed: u64) {
    let mut rng = Rng::new(seed ^ 0x5eed);
    let kill_after = 1 + rng.below(150);
    let dir = tempfile::tempdir().expect("tempdir");
    let exe = std::env::current_exe().expect("test binary path");
    let mut child = Command::new(exe)
        .args([
            "kill_nine_keeps_every_push_whole",
            "--exact",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_DIR_ENV, dir.path())
        .env(CHILD_SEED_ENV, seed.to_string())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn child");
    let stdout = child.stdout.take().expect("piped stdout");
    let (lines_tx, lines) = mpsc::channel();
    let reader = std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if lines_tx.send(line).is_err() {
                break;
            }
        }
    });
    let acked_of = |line: &str| {
        line.strip_prefix("ACK ")
            .and_then(|n| n.parse::<u64>().ok())
    };
    let mut acked = 0;
    let deadline = Instant::now() + RUN_DEADLINE;
    while acked < kill_after {
        let left = deadline.saturating_duration_since(Instant::now());
        match lines.recv_timeout(left) {
            Ok(line) => acked = acked_of(&line).unwrap_or(acked).max(acked),
            Err(_) => {
                let _ = child.kill();
                panic!(
                    "SEED={seed}: child acknowledged {acked} pushes before the deadline or exited"
                );
            }
        }
    }
    child.kill().expect("SIGKILL the child");
    let status = child.wait().expect("reap the child");
    assert!(
        !status.success(),
        "SEED={seed}: the child must die by the signal"
    );
    // Lines the child completed before the kill are acknowledged too.
    reader.join().expect("reader thread");
    for line in lines.try_iter() {
        acked = acked_of(&line).unwrap_or(acked).max(acked);
    }

    let store = SledKeeperStore::open(dir.path())
        .unwrap_or_else(|e| panic!("SEED={seed}: store does not reopen after kill -9: {e}"));
    let state = store
        .agent(&AGENT)
        .unwrap_or_else(|| panic!("SEED={seed}: the agent is gone"));
    let held: BTreeMap<u64, Entry> = store
        .pull(&AGENT, 0, u64::MAX, usize::MAX)
        .expect("pull")
        .entries
        .into_iter()
        .collect();

    // Replay the plan to the push the store's log head says it holds.
    let mut plan = Plan::new(seed);
    let mut model: BTreeMap<u64, Entry> = BTreeMap::new();
    let mut record = None;
    while plan.next_seq < state.next_seq {
        let first = plan.next_seq;
        let (r, entries, through) = plan.next();
        model.retain(|seq, _| *seq > through);
        model.extend((first..).zip(entries));
        record = Some(r);
    }
    assert_eq!(
        plan.next_seq, state.next_seq,
        "SEED={seed}: the log head falls inside a push"
    );
    assert!(
        plan.pushes >= acked,
        "SEED={seed}: {acked} pushes acknowledged, the store holds {}",
        plan.pushes
    );
    assert_eq!(
        Some(&state.record),
        record.as_ref(),
        "SEED={seed}: the record of push {}",
        plan.pushes
    );
    assert!(
        held == model,
        "SEED={seed}: the entries are not those after push {} (held {:?}, expected {:?})",
        plan.pushes,
        held.keys().collect::<Vec<_>>(),
        model.keys().collect::<Vec<_>>()
    );
    let usage = Usage {
        bytes: model.values().map(Entry::size).sum(),
        envelopes: model.len() as u64,
    };
    assert_eq!(state.usage, usage, "SEED={seed}: usage recounted");
}

// Goal: after `kill -9` at any point, the keeper's store holds exactly the state after a
// whole push, at least the last one acknowledged. Method: kill a pushing child at seeded
// random points, reopen, and compare with the pushes replayed from the seed.
#[test]
fn kill_nine_keeps_every_push_whole() {
    if let Some(dir) = std::env::var_os(CHILD_DIR_ENV) {
        crash_child_pusher(&dir);
        return;
    }
    let runs: u64 = std::env::var("NUWA_CRASH_RUNS")
        .map_or(5, |n| n.parse().expect("NUWA_CRASH_RUNS is a number"));
    let seeds = match std::env::var("SEED") {
        Ok(seed) => vec![seed.parse().expect("SEED is a u64")],
        Err(_) => (0..runs).collect(),
    };
    for seed in seeds {
        crash_once(seed);
    }
}
