//! Workload 1: propagation latency of one small change to all of N nodes.
//!
//! Every node but the writer is subscribed to the change events; each
//! sample is one put on node 0, timed from just before the request until
//! the change event carrying its heads arrived from every other node.

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};

use crate::node::{Cluster, NodeBin};
use crate::stats::percentile;

const CONTAINER: &str = "bench-latency";
/// Writes before the samples, not recorded: the first write creates the
/// container and the gossip mesh may still be settling.
const WARM_UP: usize = 3;
const SAMPLE_TIMEOUT: Duration = Duration::from_secs(30);

/// One repetition for one cluster size.
#[derive(Debug, Clone)]
pub struct LatencyRun {
    pub p50_ms: f64,
    pub p99_ms: f64,
    pub samples_ms: Vec<f64>,
    /// Bytes sent by all nodes during the run per write: each write here
    /// travels alone, so this is the unbatched cost of one change.
    pub wire_bytes_per_change: f64,
}

pub async fn run(bin: &NodeBin, dir: &Path, n: usize, samples: usize) -> Result<LatencyRun> {
    let cluster = Cluster::start(bin, dir, n).await?;
    let result = measure(&cluster, samples).await;
    let stopped = cluster.stop().await;
    let run = result?;
    stopped?;
    Ok(run)
}

async fn measure(cluster: &Cluster, samples: usize) -> Result<LatencyRun> {
    let writer = &cluster.nodes[0];
    let mut watchers = cluster.watch_followers(CONTAINER).await?;
    let bytes_before = cluster.bytes_sent().await?;
    let mut samples_ms = Vec::with_capacity(samples);
    for i in 0..WARM_UP + samples {
        let t0 = Instant::now();
        let heads = writer
            .api
            .put(CONTAINER, &format!("k{i}"), serde_json::json!(i))
            .await?;
        let deadline = tokio::time::Instant::now() + SAMPLE_TIMEOUT;
        let mut last = t0;
        for (w, node) in watchers.iter_mut().zip(&cluster.nodes[1..]) {
            let at = w.wait_heads(&heads, deadline).await.with_context(|| {
                format!(
                    "write {i} did not reach {} within {SAMPLE_TIMEOUT:?}",
                    node.name
                )
            })?;
            last = last.max(at);
        }
        if i >= WARM_UP {
            samples_ms.push(last.duration_since(t0).as_secs_f64() * 1e3);
        }
    }
    let bytes_after = cluster.bytes_sent().await?;
    Ok(LatencyRun {
        wire_bytes_per_change: bytes_after.saturating_sub(bytes_before) as f64
            / (WARM_UP + samples) as f64,
        p50_ms: percentile(&samples_ms, 50.0),
        p99_ms: percentile(&samples_ms, 99.0),
        samples_ms,
    })
}
