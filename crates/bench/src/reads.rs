//! Workload `reads`: reads never stall the daemon (issue 11).
//!
//! On a 3-node cluster, node 0 fills container `bench-reads` with K keys
//! (many puts in flight), and the cluster converges on it. Then:
//! - **Point reads.** G sequential `GET /v1/state/get?container=…&key=…` of
//!   random existing keys on node 0, each timed by the client from request
//!   to parsed answer (and checked). Target: p99 ≤ 2 ms at 100,000 keys.
//! - **Propagation under a read loop.** Writes on node 1 of one small key
//!   each, timed until node 2's event stream shows their heads: first with
//!   nothing else running, then while one client reads the whole 100,000-key
//!   container back to back (each read renders it to JSON) on the
//!   *receiving* node 2, then on the *sending* node 1. Target: p99 with the
//!   loop within 2× of idle.

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use futures::StreamExt as _;
use serde_json::{Value, json};

use crate::node::{Cluster, NodeBin};
use crate::stats::percentile;

const CONTAINER: &str = "bench-reads";
const LAT_CONTAINER: &str = "bench-reads-latency";
const SAMPLE_TIMEOUT: Duration = Duration::from_secs(30);
const WARM_UP: usize = 3;

/// One repetition.
#[derive(Debug, Clone)]
pub struct ReadsRun {
    pub keys: usize,
    pub fill_secs: f64,
    pub get_p50_ms: f64,
    pub get_p99_ms: f64,
    pub get_max_ms: f64,
    pub idle_p50_ms: f64,
    pub idle_p99_ms: f64,
    /// Query loop on the receiving device.
    pub loaded_receiver_p50_ms: f64,
    pub loaded_receiver_p99_ms: f64,
    /// Query loop on the sending device.
    pub loaded_sender_p50_ms: f64,
    pub loaded_sender_p99_ms: f64,
    /// Whole-container reads the loop completed (both phases).
    pub loop_reads: u64,
    pub loop_read_mean_ms: f64,
}

impl ReadsRun {
    pub fn receiver_ratio(&self) -> f64 {
        self.loaded_receiver_p99_ms / self.idle_p99_ms
    }
    pub fn sender_ratio(&self) -> f64 {
        self.loaded_sender_p99_ms / self.idle_p99_ms
    }
}

/// The key of entry `i`.
pub fn key(i: usize) -> String {
    format!("k{i:07}")
}

fn value(i: usize) -> Value {
    json!({"n": i, "text": format!("entry {i}")})
}

pub async fn run(
    bin: &NodeBin,
    dir: &Path,
    keys: usize,
    gets: usize,
    samples: usize,
    in_flight: usize,
) -> Result<ReadsRun> {
    let cluster = Cluster::start(bin, dir, 3).await?;
    let result = measure(&cluster, keys, gets, samples, in_flight).await;
    let stopped = cluster.stop().await;
    let run = result?;
    stopped?;
    Ok(run)
}

async fn measure(
    c: &Cluster,
    keys: usize,
    gets: usize,
    samples: usize,
    in_flight: usize,
) -> Result<ReadsRun> {
    // Fill.
    let started = Instant::now();
    let writer = &c.nodes[0].api;
    let mut done = 0usize;
    let mut puts = futures::stream::iter(0..keys)
        .map(|i| async move { writer.put(CONTAINER, &key(i), value(i)).await })
        .buffer_unordered(in_flight.max(1));
    while let Some(r) = puts.next().await {
        r?;
        done += 1;
        if done.is_multiple_of((keys / 10).max(1)) {
            eprintln!("reads: filled {done}/{keys} keys");
        }
    }
    drop(puts);
    wait_converged(c, Duration::from_secs(600)).await?;
    let fill_secs = started.elapsed().as_secs_f64();

    // Point reads.
    let mut rng = fastrand::Rng::with_seed(keys as u64);
    let mut get_ms = Vec::with_capacity(gets);
    for _ in 0..gets {
        let i = rng.usize(..keys);
        let t0 = Instant::now();
        let got = writer.get(CONTAINER, Some(&key(i))).await?;
        get_ms.push(t0.elapsed().as_secs_f64() * 1e3);
        if got != value(i) {
            bail!("get of {} answered {got}", key(i));
        }
    }

    // Propagation: idle, then with the loop on the receiver, then on the
    // sender.
    let mut watcher = c.nodes[2].api.watch(LAT_CONTAINER).await?;
    let mut next = 0usize;
    let idle = propagation(c, &mut watcher, &mut next, samples).await?;
    let reads = Arc::new(AtomicU64::new(0));
    let read_time_us = Arc::new(AtomicU64::new(0));
    let receiver = with_loop(c, 2, &reads, &read_time_us, async {
        propagation(c, &mut watcher, &mut next, samples).await
    })
    .await?;
    let sender = with_loop(c, 1, &reads, &read_time_us, async {
        propagation(c, &mut watcher, &mut next, samples).await
    })
    .await?;
    let n_reads = reads.load(Ordering::Relaxed);
    Ok(ReadsRun {
        keys,
        fill_secs,
        get_p50_ms: percentile(&get_ms, 50.0),
        get_p99_ms: percentile(&get_ms, 99.0),
        get_max_ms: get_ms.iter().copied().fold(0.0, f64::max),
        idle_p50_ms: percentile(&idle, 50.0),
        idle_p99_ms: percentile(&idle, 99.0),
        loaded_receiver_p50_ms: percentile(&receiver, 50.0),
        loaded_receiver_p99_ms: percentile(&receiver, 99.0),
        loaded_sender_p50_ms: percentile(&sender, 50.0),
        loaded_sender_p99_ms: percentile(&sender, 99.0),
        loop_reads: n_reads,
        loop_read_mean_ms: read_time_us.load(Ordering::Relaxed) as f64
            / 1e3
            / n_reads.max(1) as f64,
    })
}

/// Waits until every node holds the same heads of the filled container.
async fn wait_converged(c: &Cluster, limit: Duration) -> Result<()> {
    let deadline = Instant::now() + limit;
    loop {
        let st = c.statuses().await?;
        let heads: Vec<Vec<String>> = st.iter().map(|s| s.heads(CONTAINER)).collect();
        if !heads[0].is_empty() && heads.iter().all(|h| *h == heads[0]) {
            return Ok(());
        }
        if Instant::now() >= deadline {
            bail!("the cluster did not converge on {CONTAINER} within {limit:?}");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// `samples` writes on node 1, each timed until node 2 reports its heads.
async fn propagation(
    c: &Cluster,
    watcher: &mut crate::api::Watcher,
    next: &mut usize,
    samples: usize,
) -> Result<Vec<f64>> {
    let mut out = Vec::with_capacity(samples);
    for s in 0..WARM_UP + samples {
        let i = *next;
        *next += 1;
        let t0 = Instant::now();
        let heads = c.nodes[1].api.put(LAT_CONTAINER, &key(i), json!(i)).await?;
        let deadline = tokio::time::Instant::now() + SAMPLE_TIMEOUT;
        let at = watcher
            .wait_heads(&heads, deadline)
            .await
            .with_context(|| format!("write {i} did not reach n2 within {SAMPLE_TIMEOUT:?}"))?;
        if s >= WARM_UP {
            out.push(at.duration_since(t0).as_secs_f64() * 1e3);
        }
    }
    Ok(out)
}

/// Runs `work` while one client reads the whole filled container on node
/// `node`, back to back.
async fn with_loop<T>(
    c: &Cluster,
    node: usize,
    reads: &Arc<AtomicU64>,
    read_time_us: &Arc<AtomicU64>,
    work: impl std::future::Future<Output = Result<T>>,
) -> Result<T> {
    let stop = Arc::new(AtomicBool::new(false));
    let api = &c.nodes[node].api;
    let looping = async {
        let mut first_err = None;
        while !stop.load(Ordering::Acquire) {
            let t0 = Instant::now();
            match api.get_raw(CONTAINER, None).await {
                // Received in full; parsing 100k keys here would only
                // measure this client, on the same two cores.
                Ok(v) if v.starts_with(b"{") && v.len() > 2 => {
                    reads.fetch_add(1, Ordering::Relaxed);
                    read_time_us.fetch_add(t0.elapsed().as_micros() as u64, Ordering::Relaxed);
                }
                Ok(v) => {
                    let v = String::from_utf8_lossy(&v[..v.len().min(200)]).into_owned();
                    first_err = Some(anyhow::anyhow!("whole-container read answered {v}"));
                    break;
                }
                Err(e) => {
                    first_err = Some(e);
                    break;
                }
            }
        }
        first_err
    };
    let work = async {
        // Let the loop get going before the first sample.
        tokio::time::sleep(Duration::from_millis(200)).await;
        let r = work.await;
        stop.store(true, Ordering::Release);
        r
    };
    let (err, r) = tokio::join!(looping, work);
    if let Some(e) = err {
        return Err(e.context("the read loop failed"));
    }
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    // Goal: keys sort in insertion order and stay distinct at the sizes the
    // workload uses.
    #[test]
    fn keys_are_fixed_width_and_distinct() {
        assert_eq!(key(7), "k0000007");
        assert!(key(99_999) < key(100_000));
        assert_eq!(key(1_000_000).len(), 8);
    }
}
