//! Workload 3 and the loaded half of 5: cold sync of a fresh device to a
//! long log, against decrypting and loading the same bytes locally, and
//! the memory of the device that synced.
//!
//! First a provisioned device syncs node 0's empty log (the fixed cost of
//! a sync). Then node 0 alone gets `entries` puts, and another device
//! provisioned beforehand runs `nuwa-node sync --once` against node 0 only. Afterwards the synced
//! device runs as a daemon for a moment (to check it holds every entry and
//! to read its memory), node 0 stops cleanly and a copy of its store is
//! opened and loaded in this process.

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use futures::{StreamExt, TryStreamExt};

use crate::local;
use crate::node::{Daemon, NodeBin};

const CONTAINER: &str = "bench-log";
/// Puts in flight while filling (the daemon commits up to 512 per batch).
const FILL_IN_FLIGHT: usize = 64;
/// Longest a `sync --once` may take.
const SYNC_TIMEOUT_SECS: u64 = 1800;
/// How long the synced device runs before its memory is read.
const SETTLE: Duration = Duration::from_millis(500);

/// One repetition.
#[derive(Debug, Clone)]
pub struct ColdSyncRun {
    pub sync_ms: f64,
    pub local_load_ms: f64,
    pub ratio: f64,
    pub rss_after_sync_mb: f64,
    pub fill_ms: f64,
    /// `sync --once` of another fresh device before the fill: the fixed
    /// cost of starting, connecting, admission and the convergence check.
    pub baseline_sync_ms: f64,
    /// Peak resident memory of the syncing process (sampled `VmHWM`).
    pub sync_peak_rss_mb: f64,
    /// The longest turn of the syncing device's loop (a catch-up must not
    /// hold it for long).
    pub sync_longest_turn_ms: f64,
    /// The longest turn of the serving device's loop since it restarted
    /// (the `big` fill restarts it before the sync, as a device that was
    /// off; NaN for the other fill).
    pub serve_longest_turn_ms: f64,
    /// The longest turn of the writing device's loop during the fill (its
    /// compactions must not hold it).
    pub fill_longest_turn_ms: f64,
}

/// How node 0's log is filled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fill {
    /// One `state.put` per entry (one change each).
    Puts,
    /// `state.batch` of this many entries (one change per batch): how a
    /// runtime writes a big log.
    Batches(usize),
}

pub async fn run(bin: &NodeBin, dir: &Path, entries: usize, fill: Fill) -> Result<ColdSyncRun> {
    let master = bin.init(dir, "n0").await?;
    let fresh = bin.provision(&master, dir, "fresh").await?;
    let probe = bin.provision(&master, dir, "probe").await?;
    let n0 = Daemon::start(bin, &master, "n0", &[]).await?;

    let baseline_start = Instant::now();
    bin.sync_once(&probe, &n0.addr, SYNC_TIMEOUT_SECS)
        .await
        .context("sync of a fresh device to the empty log")?;
    let baseline_sync_ms = baseline_start.elapsed().as_secs_f64() * 1e3;

    let fill_start = Instant::now();
    let api = n0.api.clone();
    match fill {
        Fill::Puts => futures::stream::iter(0..entries)
            .map(|i| {
                let api = api.clone();
                async move {
                    api.put(CONTAINER, &format!("e{i}"), serde_json::json!(i))
                        .await
                }
            })
            .buffer_unordered(FILL_IN_FLIGHT)
            .try_for_each(|_| async { Ok(()) })
            .await
            .context("filling node 0")?,
        Fill::Batches(per) => {
            for first in (0..entries).step_by(per) {
                let ops: Vec<serde_json::Value> = (first..(first + per).min(entries))
                    .map(|i| {
                        serde_json::json!({"op": "put", "container": CONTAINER, "key": format!("e{i}"), "value": i})
                    })
                    .collect();
                api.batch(&ops).await.context("filling node 0")?;
            }
        }
    }
    let fill_ms = fill_start.elapsed().as_secs_f64() * 1e3;
    let fill_longest_turn_ms = n0.api.longest_turn_ms().await?;
    let want = n0.api.status().await?.changes(CONTAINER);
    let expected = match fill {
        Fill::Puts => entries,
        Fill::Batches(per) => entries.div_ceil(per),
    };
    if want < expected {
        bail!("node 0 holds {want} changes after filling {entries} entries");
    }

    // The big log is served by a device that restarted since writing it:
    // its loop turns are measured from the restart on.
    let n0 = match fill {
        Fill::Puts => n0,
        Fill::Batches(_) => {
            n0.stop().await?;
            Daemon::start(bin, &master, "n0", &[]).await?
        }
    };
    let sync_start = Instant::now();
    let once = bin
        .sync_once_peak(&fresh, &n0.addr, SYNC_TIMEOUT_SECS)
        .await
        .context("cold sync of the fresh device")?;
    let sync = sync_start.elapsed();
    let serve_longest_turn_ms = match fill {
        Fill::Puts => f64::NAN,
        Fill::Batches(_) => n0.api.longest_turn_ms().await?,
    };

    // Run the synced device alone: it loads what it stored, which both
    // proves the sync was complete and gives its memory with the log loaded.
    let synced = Daemon::start(bin, &fresh, "fresh", &[]).await?;
    let have = synced.api.status().await?.changes(CONTAINER);
    tokio::time::sleep(SETTLE).await;
    let rss_after_sync_mb = synced.rss_mb()?;
    synced.stop().await?;
    if have != want {
        bail!("the synced device holds {have} changes of {CONTAINER}, node 0 {want}");
    }

    n0.stop().await?;
    let copy = dir.join("store-copy");
    local::copy_dir(&master.join("store"), &copy)?;
    let key = master.join("at-rest.key");
    let loaded = tokio::task::spawn_blocking(move || local::load_store(&copy, &key))
        .await
        .context("the load task panicked")??;
    if loaded.changes < want {
        bail!(
            "the local load found {} changes, node 0 held {want}",
            loaded.changes
        );
    }
    let sync_ms = sync.as_secs_f64() * 1e3;
    let local_load_ms = loaded.elapsed.as_secs_f64() * 1e3;
    Ok(ColdSyncRun {
        sync_ms,
        local_load_ms,
        ratio: sync_ms / local_load_ms,
        rss_after_sync_mb,
        fill_ms,
        baseline_sync_ms,
        sync_peak_rss_mb: once.peak_rss_mb,
        sync_longest_turn_ms: once.longest_turn_ms,
        serve_longest_turn_ms,
        fill_longest_turn_ms,
    })
}
