//! Workloads 2, 4 and the idle half of 5, measured in one run on a 3-node
//! cluster: sustained writes until converged, bytes on the wire per change,
//! and idle memory; plus the in-process baselines of the same run.
//!
//! W puts go to node 0 with a fixed number in flight. The run ends when the
//! other nodes reported (by change event) the heads node 0 has after the
//! last acknowledgement, confirmed by every node's status.

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use futures::{StreamExt, TryStreamExt};

use crate::local;
use crate::node::{Cluster, NodeBin};

const CONTAINER: &str = "bench-throughput";
pub const NODES: usize = 3;

/// One repetition.
#[derive(Debug, Clone)]
pub struct ThroughputRun {
    pub elapsed_ms: f64,
    pub rate_per_sec: f64,
    pub local_append_rate_per_sec: f64,
    pub ratio: f64,
    pub wire_bytes_per_change: f64,
    pub raw_change_bytes: f64,
    pub bytes_ratio: f64,
    /// RSS of each node after start, before any write.
    pub idle_rss_mb: Vec<f64>,
    /// When each write was acknowledged, from the first request, in ms.
    pub acks_ms: Vec<f64>,
}

pub async fn run(
    bin: &NodeBin,
    dir: &Path,
    writes: usize,
    in_flight: usize,
) -> Result<ThroughputRun> {
    if writes == 0 || in_flight == 0 {
        bail!("the throughput run needs at least one write and one request in flight");
    }
    let cluster = Cluster::start(bin, dir, NODES).await?;
    let result = measure(&cluster, writes, in_flight).await;
    let stopped = cluster.stop().await;
    let mut run = result?;
    stopped?;
    // The baseline runs after the daemons are gone, so it gets the CPU the
    // daemons just had.
    let append = tokio::task::spawn_blocking(move || local::append(writes))
        .await
        .context("the append task panicked")??;
    run.local_append_rate_per_sec = append.rate_per_sec;
    run.ratio = run.rate_per_sec / append.rate_per_sec;
    run.raw_change_bytes = append.raw_change_bytes;
    run.bytes_ratio = run.wire_bytes_per_change / append.raw_change_bytes;
    Ok(run)
}

/// How long the daemons sit idle, once meshed, before their RSS is read:
/// "idle" is a daemon past its start-up syncs, not one still in them. The
/// samod harness waits the same (scripts/bench/samod/src/main.rs).
const IDLE_SETTLE: Duration = Duration::from_secs(2);

async fn measure(cluster: &Cluster, writes: usize, in_flight: usize) -> Result<ThroughputRun> {
    tokio::time::sleep(IDLE_SETTLE).await;
    let idle_rss_mb = cluster
        .nodes
        .iter()
        .map(|n| n.rss_mb())
        .collect::<Result<Vec<_>>>()?;
    let bytes_before = cluster.bytes_sent().await?;
    let mut watchers = cluster.watch_followers(CONTAINER).await?;

    let writer = cluster.nodes[0].api.clone();
    let start = Instant::now();
    let acks: Vec<Duration> = futures::stream::iter(0..writes)
        .map(|i| {
            let api = writer.clone();
            async move {
                api.put(CONTAINER, &format!("k{i}"), serde_json::json!(i))
                    .await
                    .map(|_| start.elapsed())
            }
        })
        .buffer_unordered(in_flight)
        .try_collect()
        .await?;
    let last_ack = acks.iter().copied().max().unwrap_or_default();

    let want = cluster.nodes[0].api.status().await?.heads(CONTAINER);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(300);
    let mut converged = start + last_ack;
    for (w, node) in watchers.iter_mut().zip(&cluster.nodes[1..]) {
        let at = w.wait_heads(&want, deadline).await.with_context(|| {
            format!("{} did not converge; log:\n{}", node.name, node.log_tail())
        })?;
        converged = converged.max(at);
    }
    let elapsed = converged.duration_since(start);

    // The status of every node must agree too (the event only says the
    // heads were reached, this says nothing moved past them).
    let statuses = cluster.statuses().await?;
    for (s, node) in statuses.iter().zip(&cluster.nodes) {
        if s.heads(CONTAINER) != want {
            bail!(
                "{} reports heads {:?}, node 0 {:?}",
                node.name,
                s.heads(CONTAINER),
                want
            );
        }
    }
    let bytes_after: u64 = statuses.iter().map(|s| s.bytes_sent()).sum();
    let rate_per_sec = writes as f64 / elapsed.as_secs_f64();
    Ok(ThroughputRun {
        elapsed_ms: elapsed.as_secs_f64() * 1e3,
        rate_per_sec,
        local_append_rate_per_sec: f64::NAN,
        ratio: f64::NAN,
        wire_bytes_per_change: bytes_after.saturating_sub(bytes_before) as f64 / writes as f64,
        raw_change_bytes: f64::NAN,
        bytes_ratio: f64::NAN,
        idle_rss_mb,
        acks_ms: acks.iter().map(|d| d.as_secs_f64() * 1e3).collect(),
    })
}
