//! Workload `containers`: what anti-entropy costs a pair of devices that
//! hold many containers and change nothing, and how fast one change among
//! them converges.
//!
//! For each count, two nodes; node 0 gets that many containers (one key
//! each, through `state.batch`), node 1 syncs them. Once both hold the same
//! heads and one round has passed, each node's `bytes_sent` counter is read
//! over [`ROUNDS`] anti-entropy rounds (each node has one peer, so bytes
//! per round is bytes per peer per round). Then one container gets a put on
//! node 0, timed until node 1 reports the new heads.

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

use crate::node::{Cluster, NodeBin};

/// The engine's anti-entropy interval.
const ROUND: Duration = Duration::from_secs(5);
/// Rounds the idle cost is averaged over.
const ROUNDS: u32 = 3;
/// Containers created per `state.batch`.
const PER_BATCH: usize = 1000;

/// One count.
#[derive(Debug, Clone)]
pub struct ContainersRun {
    /// Writing the containers on node 0 and syncing them to node 1.
    pub fill_and_sync_ms: f64,
    /// The larger of the two nodes' bytes per peer per round.
    pub idle_bytes_per_peer_round: f64,
    /// A put on node 0 until node 1 has it.
    pub one_change_ms: f64,
    /// Resident memory of each node, idle, holding every container.
    pub idle_rss_mb: Vec<f64>,
}

pub async fn run(bin: &NodeBin, dir: &Path, containers: usize) -> Result<ContainersRun> {
    let cluster = Cluster::start(bin, dir, 2).await?;
    let result = measure(&cluster, containers).await;
    let stopped = cluster.stop().await;
    let run = result?;
    stopped?;
    Ok(run)
}

fn name(i: usize) -> String {
    format!("c-{i:06}")
}

async fn measure(cluster: &Cluster, containers: usize) -> Result<ContainersRun> {
    let (n0, n1) = (&cluster.nodes[0], &cluster.nodes[1]);
    let start = Instant::now();
    for first in (0..containers).step_by(PER_BATCH) {
        let ops: Vec<serde_json::Value> = (first..(first + PER_BATCH).min(containers))
            .map(|i| serde_json::json!({"op": "put", "container": name(i), "key": "k", "value": i}))
            .collect();
        n0.api.batch(&ops).await?;
    }
    let deadline = Instant::now() + Duration::from_secs(600);
    loop {
        let (s0, s1) = (n0.api.status().await?, n1.api.status().await?);
        let same = s0.containers.len() == s1.containers.len()
            && s0.containers.len() >= containers
            && s0
                .containers
                .iter()
                .all(|c| s1.heads(&c.name) == s0.heads(&c.name));
        if same {
            break;
        }
        if Instant::now() > deadline {
            bail!(
                "node 1 holds {} containers, node 0 {}; log of n1:\n{}",
                s1.containers.len(),
                s0.containers.len(),
                n1.log_tail()
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let fill_and_sync_ms = start.elapsed().as_secs_f64() * 1e3;

    // The early digests that follow convergence pass within a round.
    tokio::time::sleep(ROUND + Duration::from_secs(1)).await;
    let before = (
        n0.api.status().await?.bytes_sent(),
        n1.api.status().await?.bytes_sent(),
    );
    tokio::time::sleep(ROUND * ROUNDS).await;
    let after = (
        n0.api.status().await?.bytes_sent(),
        n1.api.status().await?.bytes_sent(),
    );
    let per_round = |a: u64, b: u64| b.saturating_sub(a) as f64 / f64::from(ROUNDS);
    let idle_bytes_per_peer_round = per_round(before.0, after.0).max(per_round(before.1, after.1));
    let idle_rss_mb = vec![n0.rss_mb()?, n1.rss_mb()?];

    let target = name(containers / 2);
    let mut watcher = n1.api.watch(&target).await?;
    let t = Instant::now();
    let want = n0
        .api
        .put(&target, "k", serde_json::json!("changed"))
        .await?;
    let mut want = want;
    want.sort();
    let at = watcher
        .wait_heads(&want, tokio::time::Instant::now() + Duration::from_secs(60))
        .await
        .context("node 1 did not get the one change")?;
    Ok(ContainersRun {
        fill_and_sync_ms,
        idle_bytes_per_peer_round,
        one_change_ms: at.duration_since(t).as_secs_f64() * 1e3,
        idle_rss_mb,
    })
}
