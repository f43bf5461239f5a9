//! Crash harness for a real `nuwa-node` daemon: SIGKILL it in the middle of
//! bursts of local writes, restart it on the same home, and check that every
//! write it acknowledged as durable is still there.
//!
//! The harness only drives the process from outside (HTTP API, signals, the
//! CLI); how the store makes writes durable is left to the daemon. The
//! number of rounds comes from `NUWA_DAEMON_CRASH_RUNS` (default 3) and the
//! kill delays from a seeded xorshift; `SEED=…` replays a run.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use common::*;
use serde_json::{Value, json};

/// Rounds when `NUWA_DAEMON_CRASH_RUNS` is unset; small so the default suite
/// stays fast, CI sets more.
const DEFAULT_RUNS: u64 = 3;
/// Requests the writer keeps in flight, so that the daemon's group commit
/// sees batches of several puts rather than one at a time.
const WRITERS_IN_FLIGHT: usize = 4;
/// A put that takes longer than this is a hang, not a slow disk.
const REQUEST_TIMEOUT_SECS: u64 = 10;
const KILL_DELAY_MS_MIN: u64 = 50;
const KILL_DELAY_MS_MAX: u64 = 500;
const CONTAINER: &str = "crash";

/// Kill timing from a seeded generator, so a failing round replays from its
/// printed seed.
struct Schedule(fastrand::Rng);

impl Schedule {
    fn new(seed: u64) -> Self {
        Schedule(fastrand::Rng::with_seed(seed))
    }

    fn between(&mut self, lo: u64, hi: u64) -> u64 {
        self.0.u64(lo..=hi)
    }
}

fn env_u64(name: &str) -> Option<u64> {
    let raw = std::env::var(name).ok()?;
    Some(
        raw.trim()
            .parse()
            .unwrap_or_else(|e| panic!("{name}={raw:?} is not a whole number: {e}")),
    )
}

fn seed() -> u64 {
    env_u64("SEED").unwrap_or_else(|| {
        // A fresh seed per run; it is printed so that a failure replays.
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(1)
    })
}

/// A thread issuing puts of `r{round}-{n}` = `n` to the daemon of one home
/// until told to stop; it returns the `n`s the daemon acknowledged as
/// durable.
struct Writer {
    stop: Arc<AtomicBool>,
    thread: JoinHandle<Vec<u64>>,
}

impl Writer {
    fn start(home: &Path, round: u64) -> Writer {
        let api: Value = serde_json::from_slice(
            &std::fs::read(home.join("api.json")).expect("api.json of the running daemon"),
        )
        .expect("api.json is JSON");
        let url = format!(
            "{}/v1/state/put",
            api["url"].as_str().expect("api.json has a url")
        );
        let token = api["token"]
            .as_str()
            .expect("api.json has a token")
            .to_owned();
        let stop = Arc::new(AtomicBool::new(false));
        let stop_w = stop.clone();
        let thread = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("tokio runtime for the writer");
            rt.block_on(write_until_stopped(url, token, round, stop_w))
        });
        Writer { stop, thread }
    }

    fn stop(self) -> Vec<u64> {
        self.stop.store(true, Ordering::SeqCst);
        let mut acked = self.thread.join().expect("writer thread panicked");
        acked.sort_unstable();
        acked
    }
}

async fn write_until_stopped(
    url: String,
    token: String,
    round: u64,
    stop: Arc<AtomicBool>,
) -> Vec<u64> {
    let http = reqwest::Client::builder()
        .no_proxy()
        .timeout(Duration::from_secs(REQUEST_TIMEOUT_SECS))
        .build()
        .expect("HTTP client");
    let next = Arc::new(AtomicU64::new(0));
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..WRITERS_IN_FLIGHT {
        let (http, url, token, next, stop) = (
            http.clone(),
            url.clone(),
            token.clone(),
            next.clone(),
            stop.clone(),
        );
        tasks.spawn(async move {
            let mut acked = Vec::new();
            while !stop.load(Ordering::SeqCst) {
                let n = next.fetch_add(1, Ordering::SeqCst);
                let body =
                    json!({"container": CONTAINER, "key": format!("r{round}-{n}"), "value": n});
                let Ok(resp) = http.post(&url).bearer_auth(&token).json(&body).send().await else {
                    // Refused or reset: the daemon is dead, nothing acknowledged.
                    continue;
                };
                if resp.status() != reqwest::StatusCode::OK {
                    continue;
                }
                // A reply cut off by the kill is not an acknowledgement.
                let Ok(reply) = resp.json::<Value>().await else {
                    continue;
                };
                if reply["durable"] == json!(true) {
                    acked.push(n);
                }
            }
            acked
        });
    }
    let mut acked = Vec::new();
    while let Some(done) = tasks.join_next().await {
        acked.extend(done.expect("writer task panicked"));
    }
    acked
}

// Goal: no write the daemon acknowledged as durable is lost when it is
// SIGKILLed mid-burst, over many crash/restart cycles of one home. Method:
// per round, hammer `POST /v1/state/put` from a writer thread, SIGKILL the
// daemon after a seeded random 50–500 ms, restart it on the same home, and
// compare the container with every acknowledged key of every round so far.
#[test]
fn kill_9_during_write_bursts_loses_no_acknowledged_write() {
    isolated(
        "kill_9_during_write_bursts_loses_no_acknowledged_write",
        || {
            let runs = env_u64("NUWA_DAEMON_CRASH_RUNS").unwrap_or(DEFAULT_RUNS);
            let seed = seed();
            println!("crash harness: {runs} rounds, seed {seed} (replay with SEED={seed})");
            let mut rng = Schedule::new(seed);
            let started = Instant::now();

            let mut c = Cluster::new();
            let home = c.init("solo");
            let flags = [
                "--no-mdns",
                "--no-known-peers",
                "--no-dht",
                "--no-rendezvous",
            ];
            // `start` waits for the API and fails with the daemon log if the
            // process exits, e.g. because its store does not reopen.
            let mut daemon = c.start(&home, &flags);

            // Every acknowledged write so far: key -> value.
            let mut acked: BTreeMap<String, u64> = BTreeMap::new();
            let mut lost: BTreeSet<String> = BTreeSet::new();
            let mut kills = 0u64;
            for round in 0..runs {
                let delay_ms = rng.between(KILL_DELAY_MS_MIN, KILL_DELAY_MS_MAX);
                let writer = Writer::start(&home, round);
                // The one deliberate sleep: where in the burst the kill lands.
                std::thread::sleep(Duration::from_millis(delay_ms));
                c.kill9(daemon);
                kills += 1;
                let round_acked = writer.stop();
                for &n in &round_acked {
                    acked.insert(format!("r{round}-{n}"), n);
                }

                daemon = c.start(&home, &flags);
                let doc = match get_json(&home, CONTAINER) {
                    Some(doc) => doc,
                    // Nothing acknowledged yet, so nothing had to be written.
                    None if acked.is_empty() => json!({}),
                    None => panic!(
                        "container {CONTAINER} is gone after kill {kills} \
                         ({} acknowledged writes):\n{}",
                        acked.len(),
                        c.logs()
                    ),
                };
                let mut lost_now = 0;
                for (key, &n) in &acked {
                    if doc[key.as_str()] != json!(n) && lost.insert(key.clone()) {
                        lost_now += 1;
                        eprintln!(
                            "round {round}: acknowledged {key}={n} reads back as {}",
                            doc[key.as_str()]
                        );
                    }
                }
                println!(
                    "round {round}: killed after {delay_ms} ms, {} acknowledged \
                     ({} in total), {lost_now} newly lost",
                    round_acked.len(),
                    acked.len()
                );
            }
            println!("crash harness wall time: {:.1?}", started.elapsed());
            println!(
                "crash harness: {kills} kills, {} acknowledged writes, {} lost (seed {seed})",
                acked.len(),
                lost.len()
            );
            assert!(
                lost.is_empty(),
                "{} acknowledged writes lost (replay with SEED={seed}): {:?}",
                lost.len(),
                lost.iter().take(20).collect::<Vec<_>>()
            );
            assert!(
                !acked.is_empty(),
                "the writer got no acknowledged write in {runs} rounds, so nothing was tested"
            );
            // A clean shutdown after all those crashes is part of the contract.
            c.stop(daemon);
        },
    );
}
