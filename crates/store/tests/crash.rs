//! Crash safety under `kill -9`: a child process appends, group-commits across three NIP-8
//! namespaces and compacts as fast as it can, printing each acknowledged write; the parent kills it at a random point, reopens the store
//! and checks that every acknowledged write is there, intact and in order.
//!
//! The child is this same test binary, re-run with `CHILD_DIR_ENV` set and filtered to
//! this test, which then takes the writer's part (`crash_child_writer`).
//! `NUWA_CRASH_RUNS=<n>` changes the number of crashes (default 10); `SEED=<n>` replays one
//! run.

mod common;

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use common::Rng;
use nuwa_crypto::AtRestKey;
use nuwa_store::{SledStore, Storage};

const CHILD_DIR_ENV: &str = "NUWA_STORE_CRASH_CHILD_DIR";
const CHILD_SEED_ENV: &str = "NUWA_STORE_CRASH_CHILD_SEED";
/// Three NIP-8 namespaces (default, core, a capability), so that group commits span the
/// trees of several.
const CONTAINERS: [&str; 3] = [
    "memory",
    "did:nuwa:core:AgentSettings#v1",
    "did:nuwa:cap:h:state:History#v1",
];
/// Upper bound on one run, so a hung child fails the test instead of hanging it.
const RUN_DEADLINE: Duration = Duration::from_secs(30);

/// The content of change `seq` of `container`; derived, so the parent can check every byte.
fn change_bytes(container: &str, seq: u64) -> Vec<u8> {
    let mut bytes = format!("{container}#{seq}#").into_bytes();
    // Every seventh change is large, so batches cross sled's page and segment boundaries.
    let pad = if seq.is_multiple_of(7) {
        20_000
    } else {
        (seq % 50) as usize
    };
    bytes.extend(std::iter::repeat_n(b'.', pad));
    bytes
}

/// The content of a snapshot covering `1..=covers` of `container`.
fn snapshot_bytes(container: &str, covers: u64) -> Vec<u8> {
    format!("snapshot of {container} through {covers}").into_bytes()
}

/// The body of the child process (started by `kill_nine_loses_no_acknowledged_write` with
/// `CHILD_DIR_ENV` set). It writes forever and is only ever stopped by SIGKILL.
fn crash_child_writer(dir: &std::ffi::OsStr) {
    let dir = Path::new(dir);
    let seed: u64 = std::env::var(CHILD_SEED_ENV)
        .expect("seed")
        .parse()
        .expect("seed is u64");
    let key_file = std::fs::read(dir.join("at-rest.key")).expect("key file");
    let key = AtRestKey::from_file_bytes(&key_file).expect("key parses");
    let store = SledStore::open(&dir.join("db"), key).expect("child open");
    let mut rng = Rng::new(seed);
    let mut last = BTreeMap::new();
    println!("READY");
    loop {
        let container = CONTAINERS[rng.index(CONTAINERS.len())];
        if rng.chance(8) {
            let covers = last.get(container).copied().unwrap_or(0);
            store
                .save_snapshot(container, &snapshot_bytes(container, covers), covers)
                .expect("snapshot");
            println!("SNAP {container} {covers}");
        } else if rng.chance(25) {
            // One group commit over every container, so over three namespaces.
            let batches: Vec<(&str, Vec<Vec<u8>>)> = CONTAINERS
                .iter()
                .map(|c| {
                    let from = last.get(c).copied().unwrap_or(0);
                    let count = 1 + rng.below(3);
                    (*c, (1..=count).map(|i| change_bytes(c, from + i)).collect())
                })
                .collect();
            let refs: Vec<(&str, &[Vec<u8>])> = batches.iter().map(|(c, b)| (*c, &b[..])).collect();
            let seqs = store.append_many(&refs).expect("append_many");
            for ((c, batch), seq) in batches.iter().zip(seqs) {
                let last_seq = last.entry(*c).or_default();
                assert_eq!(
                    seq,
                    *last_seq + batch.len() as u64,
                    "child group sequence numbers"
                );
                *last_seq = seq;
                println!("ACK {c} {seq}");
            }
        } else {
            let last_seq: &mut u64 = last.entry(container).or_default();
            let count = 1 + rng.below(6);
            let batch: Vec<Vec<u8>> = (1..=count)
                .map(|i| change_bytes(container, *last_seq + i))
                .collect();
            let seq = store.append_changes(container, &batch).expect("append");
            assert_eq!(seq, *last_seq + count, "child sequence numbers");
            *last_seq = seq;
            println!("ACK {container} {seq}");
        }
    }
}

/// What the child acknowledged before it died.
#[derive(Default)]
struct Acked {
    seq: BTreeMap<String, u64>,
    snapshot: BTreeMap<String, u64>,
}

fn record_line(line: &str, acked: &mut Acked) {
    let mut parts = line.split(' ');
    let (Some(kind), Some(container), Some(n), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return;
    };
    let Ok(n) = n.parse::<u64>() else { return };
    let map = match kind {
        "ACK" => &mut acked.seq,
        "SNAP" => &mut acked.snapshot,
        _ => return,
    };
    let entry = map.entry(container.to_owned()).or_default();
    *entry = (*entry).max(n);
}

/// One crash: start the child, kill it after `kill_after` acknowledgements, verify the store.
fn crash_once(seed: u64) {
    let mut rng = Rng::new(seed);
    let kill_after = 1 + rng.below(150);
    let dir = tempfile::tempdir().expect("tempdir");
    let key = AtRestKey::generate().expect("rng");
    std::fs::write(
        dir.path().join("at-rest.key"),
        key.to_file_bytes().as_slice(),
    )
    .expect("key file");

    let exe = std::env::current_exe().expect("test binary path");
    let mut child = Command::new(exe)
        .args([
            "kill_nine_loses_no_acknowledged_write",
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

    let mut acked = Acked::default();
    let mut acks = 0;
    let deadline = Instant::now() + RUN_DEADLINE;
    while acks < kill_after {
        let left = deadline.saturating_duration_since(Instant::now());
        match lines.recv_timeout(left) {
            Ok(line) => {
                if line.starts_with("ACK ") || line.starts_with("SNAP ") {
                    acks += 1;
                }
                record_line(&line, &mut acked);
            }
            Err(_) => {
                let _ = child.kill();
                panic!(
                    "SEED={seed}: child gave {acks} acknowledgements before the deadline or exited"
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
        record_line(&line, &mut acked);
    }

    let key =
        AtRestKey::from_file_bytes(&std::fs::read(dir.path().join("at-rest.key")).expect("key"))
            .expect("key parses");
    let store = SledStore::open(&dir.path().join("db"), key)
        .unwrap_or_else(|e| panic!("SEED={seed}: store does not reopen after kill -9: {e}"));
    let listed = store.list_containers().expect("list");
    for (container, &acked_seq) in &acked.seq {
        assert!(
            listed.contains(container),
            "SEED={seed}: {container} missing from {listed:?}"
        );
        let record = store
            .load_container(container)
            .unwrap_or_else(|e| panic!("SEED={seed}: load {container}: {e}"))
            .unwrap_or_else(|| panic!("SEED={seed}: {container} lost"));
        assert!(
            record.last_seq >= acked_seq,
            "SEED={seed}: {container} acknowledged through {acked_seq} but holds {}",
            record.last_seq
        );
        let acked_snapshot = acked.snapshot.get(container).copied().unwrap_or(0);
        assert!(
            record.snapshot_covers >= acked_snapshot,
            "SEED={seed}: {container} snapshot went back from {acked_snapshot} to {}",
            record.snapshot_covers
        );
        if record.snapshot_covers > 0 {
            assert_eq!(
                record.snapshot.as_deref(),
                Some(snapshot_bytes(container, record.snapshot_covers).as_slice()),
                "SEED={seed}: {container} snapshot content"
            );
        }
        for (i, change) in record.changes.iter().enumerate() {
            let seq = record.snapshot_covers + 1 + i as u64;
            assert!(
                *change == change_bytes(container, seq),
                "SEED={seed}: {container} change {seq} is not the one written"
            );
        }
    }
    // A snapshot of a container with no acknowledged appends covers nothing; it may or may
    // not be there, but must not break loading.
    for container in acked.snapshot.keys() {
        store
            .load_container(container)
            .unwrap_or_else(|e| panic!("SEED={seed}: load {container}: {e}"));
    }
}

// Goal: no acknowledged write is lost and the store reopens after `kill -9` mid-burst;
// method: kill a writing child process at a seeded random point, repeatedly, and check every
// acknowledged change and snapshot after reopening.
#[test]
fn kill_nine_loses_no_acknowledged_write() {
    if let Some(dir) = std::env::var_os(CHILD_DIR_ENV) {
        // Re-run as the child: write until killed.
        crash_child_writer(&dir);
        return;
    }
    let runs: u64 = std::env::var("NUWA_CRASH_RUNS")
        .map_or(10, |n| n.parse().expect("NUWA_CRASH_RUNS is a number"));
    let seeds = match std::env::var("SEED") {
        Ok(seed) => vec![seed.parse().expect("SEED is a u64")],
        Err(_) => (0..runs).collect(),
    };
    for seed in seeds {
        crash_once(seed);
    }
}
