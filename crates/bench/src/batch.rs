//! Workload `batch`: items converged on a 3-node cluster when a runtime
//! writes through `state.batch` (batches of 100 puts), against the local
//! Automerge append of the same items in the same run.
//!
//! The items go to node 0 with a few batches in flight. The run ends when
//! the other nodes reported (by change event) the heads node 0 has after
//! the last acknowledgement, confirmed by every node's status.

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use futures::{StreamExt, TryStreamExt};

use crate::local;
use crate::node::{Cluster, NodeBin};

const CONTAINER: &str = "bench-batch";
pub const NODES: usize = 3;
/// Items per `state.batch` request (issue 13's row).
pub const BATCH: usize = 100;
/// Batches in flight.
const IN_FLIGHT: usize = 4;

/// One repetition.
#[derive(Debug, Clone)]
pub struct BatchRun {
    pub items: usize,
    pub elapsed_ms: f64,
    pub rate_per_sec: f64,
    pub local_append_rate_per_sec: f64,
    pub ratio: f64,
    pub wire_bytes_per_item: f64,
}

pub async fn run(bin: &NodeBin, dir: &Path, items: usize) -> Result<BatchRun> {
    if items == 0 {
        bail!("the batch run needs at least one item");
    }
    let cluster = Cluster::start(bin, dir, NODES).await?;
    let result = measure(&cluster, items).await;
    let stopped = cluster.stop().await;
    let mut run = result?;
    stopped?;
    let append = tokio::task::spawn_blocking(move || local::append(items))
        .await
        .context("the append task panicked")??;
    run.local_append_rate_per_sec = append.rate_per_sec;
    run.ratio = run.rate_per_sec / append.rate_per_sec;
    Ok(run)
}

async fn measure(cluster: &Cluster, items: usize) -> Result<BatchRun> {
    let bytes_before = cluster.bytes_sent().await?;
    let mut watchers = cluster.watch_followers(CONTAINER).await?;
    let writer = cluster.nodes[0].api.clone();
    let batches: Vec<Vec<serde_json::Value>> = (0..items)
        .collect::<Vec<_>>()
        .chunks(BATCH)
        .map(|chunk| {
            chunk
                .iter()
                .map(|i| {
                    serde_json::json!({
                        "op": "put", "container": CONTAINER, "key": format!("k{i}"), "value": i
                    })
                })
                .collect()
        })
        .collect();
    let start = Instant::now();
    futures::stream::iter(batches)
        .map(|ops| {
            let api = writer.clone();
            async move { api.batch(&ops).await }
        })
        .buffer_unordered(IN_FLIGHT)
        .try_collect::<Vec<()>>()
        .await?;
    let acked = Instant::now();
    let want = cluster.nodes[0].api.status().await?.heads(CONTAINER);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(300);
    let mut converged = acked;
    for (w, node) in watchers.iter_mut().zip(&cluster.nodes[1..]) {
        let at = w.wait_heads(&want, deadline).await.with_context(|| {
            format!("{} did not converge; log:\n{}", node.name, node.log_tail())
        })?;
        converged = converged.max(at);
    }
    let elapsed = converged.duration_since(start);
    let statuses = cluster.statuses().await?;
    for (s, node) in statuses.iter().zip(&cluster.nodes) {
        if s.heads(CONTAINER) != want {
            bail!("{} did not end on node 0's heads", node.name);
        }
    }
    let bytes_after: u64 = statuses.iter().map(|s| s.bytes_sent()).sum();
    Ok(BatchRun {
        items,
        elapsed_ms: elapsed.as_secs_f64() * 1e3,
        rate_per_sec: items as f64 / elapsed.as_secs_f64(),
        local_append_rate_per_sec: f64::NAN,
        ratio: f64::NAN,
        wire_bytes_per_item: bytes_after.saturating_sub(bytes_before) as f64 / items as f64,
    })
}
