//! Runs the nuwa-bench workloads against samod (the Rust automerge-repo), so
//! that `nuwa-bench --compare` can set both side by side (docs/performance.md,
//! "JSON schema", defines the output). The procedure mirrors
//! scripts/bench/bench.mjs, the automerge-repo side, step by step.
//!
//! One binary plays two parts. Started normally it is the coordinator: it
//! starts one process per node (this binary with `--child NAME`), drives the
//! workloads over the children's stdin/stdout (one JSON object per line), and
//! writes the JSON and a table. Each child holds one samod `Repo` with
//! samod's file-system storage in its own temporary directory; node 0 accepts
//! TCP connections on 127.0.0.1 and every other node dials it with samod's
//! own TCP dialer, so the topology is a star around node 0.
//!
//! Times are taken inside the children with CLOCK_MONOTONIC, which is
//! system-wide, so a write time on node 0 and a receive time on node k can be
//! subtracted without any pipe delay in between. samod is not tuned: every
//! Repo, storage and connector setting is the library default.

mod child;
mod coord;

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{Context, Result, anyhow, bail};
use automerge::transaction::Transactable;
use automerge::{Automerge, ROOT, ScalarValue};
use serde_json::{Map, Value, json};

use coord::{Cluster, Node, as_f64, node_dir};

/// The versions pinned exactly in Cargo.toml.
const SAMOD_VERSION: &str = "0.16.0";
const AUTOMERGE_VERSION: &str = "0.12.0";
const WARMUP_WRITES: usize = 5;
/// Nodes of the batch run, and puts per change (nuwa-bench's `batch`).
const BATCH_NODES: usize = 3;
const PER_BATCH: usize = 100;

/// Milliseconds on the system-wide monotonic clock (comparable across processes).
pub fn now_ms() -> f64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid timespec; CLOCK_MONOTONIC always exists on Linux.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as f64 * 1e3 + ts.tv_nsec as f64 / 1e6
}

/// The value written by every put: small, and the same shape as bench.mjs's.
pub fn value_for(i: u64) -> String {
    format!("value-{i:010}")
}

const HELP: &str = "Usage: samod-bench [options]   (or ./run.sh [options])

Runs the nuwa-bench workloads against samod on 127.0.0.1 and writes the
figures as JSON (schema: docs/performance.md, \"JSON schema\") and a table.

Options:
  --quick               N=3 only, 20 samples, 500 writes, 2000 entries,
                        2000 batch items, 1 rep
  --reps N              repetitions of every workload (default 3)
  --samples S           propagation samples per cluster size (default 100)
  --sizes LIST          cluster sizes for propagation latency (default 3,5,10)
  --writes W            writes in the throughput run (default 5000)
  --in-flight K         writes per yield in the throughput run (default 32)
  --log-entries E       entries for the cold sync (default 100000)
  --batch-items I       items of the batch run, 100 per change (default 20000;
                        0 skips it)
  --json-out FILE       where to write the JSON (default scripts/bench/out/samod.json)
  -h, --help            show this text
";

#[derive(Debug, Clone)]
struct Opts {
    quick: bool,
    reps: usize,
    samples: usize,
    sizes: Vec<usize>,
    writes: usize,
    in_flight: usize,
    log_entries: usize,
    batch_items: usize,
    json_out: PathBuf,
}

enum Parsed {
    Run(Opts),
    Help,
}

fn parse_cli(args: &[String]) -> Result<Parsed> {
    let mut quick = false;
    let mut raw: Vec<(&str, String)> = Vec::new();
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let (name, inline) = match a.split_once('=') {
            Some((n, v)) if n.starts_with("--") => (n, Some(v.to_owned())),
            _ => (a.as_str(), None),
        };
        match name {
            "-h" | "--help" => return Ok(Parsed::Help),
            "--quick" => {
                if inline.is_some() {
                    bail!("--quick takes no value");
                }
                quick = true;
            }
            "--reps" | "--samples" | "--sizes" | "--writes" | "--in-flight" | "--log-entries"
            | "--batch-items" | "--json-out" => {
                let v = match inline {
                    Some(v) => v,
                    None => it
                        .next()
                        .cloned()
                        .ok_or_else(|| anyhow!("{name} needs a value"))?,
                };
                raw.push((name, v));
            }
            other => bail!("unknown option {other}"),
        }
    }
    let get = |name: &str| {
        raw.iter()
            .rev()
            .find(|(n, _)| *n == name)
            .map(|(_, v)| v.clone())
    };
    let int = |name: &str, fallback: usize, min: usize| -> Result<usize> {
        match get(name) {
            None => Ok(fallback),
            Some(v) => match v.trim().parse::<usize>() {
                Ok(n) if n >= min => Ok(n),
                _ => bail!("{name} must be an integer >= {min}, got \"{v}\""),
            },
        }
    };
    let q = quick;
    let sizes = match get("--sizes") {
        None if q => vec![3],
        None => vec![3, 5, 10],
        Some(list) => list
            .split(',')
            .map(|s| match s.trim().parse::<usize>() {
                Ok(n) if n >= 2 => Ok(n),
                _ => bail!("--sizes takes cluster sizes >= 2, got \"{s}\""),
            })
            .collect::<Result<Vec<_>>>()?,
    };
    let json_out = get("--json-out").map(PathBuf::from).unwrap_or_else(|| {
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("..")
            .join("out")
            .join("samod.json")
    });
    Ok(Parsed::Run(Opts {
        quick: q,
        reps: int("--reps", if q { 1 } else { 3 }, 1)?,
        samples: int("--samples", if q { 20 } else { 100 }, 1)?,
        sizes,
        writes: int("--writes", if q { 500 } else { 5000 }, 1)?,
        in_flight: int("--in-flight", 32, 1)?,
        log_entries: int("--log-entries", if q { 2000 } else { 100_000 }, 1)?,
        batch_items: int("--batch-items", if q { 2000 } else { 20_000 }, 0)?,
        json_out,
    }))
}

// ---- statistics ----

fn round3(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}

fn stat(values: &[f64]) -> Value {
    if values.is_empty() {
        return Value::Null;
    }
    let mut s = values.to_vec();
    s.sort_by(f64::total_cmp);
    let n = s.len();
    let median = if n % 2 == 1 {
        s[n / 2]
    } else {
        (s[n / 2 - 1] + s[n / 2]) / 2.0
    };
    json!({ "median": round3(median), "min": round3(s[0]), "max": round3(s[n - 1]) })
}

/// Nearest-rank percentile.
fn percentile(values: &[f64], p: f64) -> f64 {
    let mut s = values.to_vec();
    s.sort_by(f64::total_cmp);
    let rank = ((p / 100.0) * s.len() as f64).ceil().max(1.0) as usize;
    s[rank.min(s.len()) - 1]
}

fn fmt(x: f64) -> String {
    if x >= 100.0 {
        format!("{x:.0}")
    } else if x >= 10.0 {
        format!("{x:.1}")
    } else if x >= 0.1 || x == 0.0 {
        format!("{x:.2}")
    } else {
        format!("{x:.4}")
    }
}

fn log(msg: &str) {
    eprintln!("[samod-bench] {msg}");
}

// ---- workloads ----

/// S sequential writes on node 0, each timed until every other node saw it.
async fn measure_latency(cluster: &Cluster, samples: usize, tag: &str) -> Result<Vec<f64>> {
    let (writer, followers) = cluster.nodes.split_first().context("empty cluster")?;
    let mut out = Vec::with_capacity(samples);
    for i in 0..samples {
        let key = format!("lat_{tag}_{i}");
        let mut seen = Vec::new();
        for f in followers {
            seen.push(f.watch(&key).await?);
        }
        let w = writer
            .call("write", json!({ "key": key, "value": value_for(i as u64) }))
            .await?;
        let t0 = as_f64(&w, "t_ms")?;
        let mut last = t0;
        for (rx, f) in seen.into_iter().zip(followers) {
            let t = tokio::time::timeout(std::time::Duration::from_secs(30), rx)
                .await
                .map_err(|_| anyhow!("{} did not see {key} within 30 s", f.name))?
                .map_err(|_| anyhow!("{} exited before it saw {key}", f.name))?;
            last = last.max(t);
        }
        out.push(last - t0);
    }
    Ok(out)
}

fn counter_sum(v: &Value) -> Result<f64> {
    Ok(as_f64(v, "sent_bytes")? + as_f64(v, "recv_bytes")?)
}

/// Polls node 0's byte counters until they have not moved for 300 ms, so
/// trailing sync replies are counted (at most 10 s).
async fn quiescent_bytes(server: &Node) -> Result<f64> {
    let deadline = now_ms() + 10_000.0;
    let mut last = counter_sum(&server.call("counters", json!({})).await?)?;
    let mut stable_since = now_ms();
    while now_ms() < deadline {
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        let c = counter_sum(&server.call("counters", json!({})).await?)?;
        if c != last {
            last = c;
            stable_since = now_ms();
        } else if now_ms() - stable_since >= 300.0 {
            break;
        }
    }
    Ok(last)
}

struct Append {
    rate_per_sec: f64,
    raw_change_bytes: f64,
}

/// The same W one-key transactions (`tp_{i}` = value_for(i)) on a plain
/// in-process Automerge document; sizes from a second, untimed pass.
fn local_append(writes: usize) -> Result<Append> {
    let put = |doc: &mut Automerge, i: usize| -> Result<()> {
        doc.transact::<_, _, automerge::AutomergeError>(|tx| {
            tx.put(ROOT, format!("tp_{i}"), value_for(i as u64))?;
            Ok(())
        })
        .map(|_| ())
        .map_err(|f| anyhow!("local put {i}: {}", f.error))
    };
    let mut doc = Automerge::new();
    let t0 = now_ms();
    for i in 0..writes {
        put(&mut doc, i)?;
    }
    let elapsed = now_ms() - t0;
    let mut sized = Automerge::new();
    let mut total = 0usize;
    for i in 0..writes {
        put(&mut sized, i)?;
        total += sized
            .get_last_local_change()
            .map_or(0, |c| c.raw_bytes().len());
    }
    Ok(Append {
        rate_per_sec: writes as f64 / (elapsed / 1000.0),
        raw_change_bytes: total as f64 / writes as f64,
    })
}

/// The batch run's baseline: the items as one-key transactions
/// (`k{i}` = i), as nuwa-bench's `local::append`.
fn local_append_items(items: usize) -> Result<f64> {
    let mut doc = Automerge::new();
    let t0 = now_ms();
    for i in 0..items {
        doc.transact::<_, _, automerge::AutomergeError>(|tx| {
            tx.put(ROOT, format!("k{i}"), ScalarValue::Int(i as i64))?;
            Ok(())
        })
        .map_err(|f| anyhow!("local put {i}: {}", f.error))?;
    }
    Ok(items as f64 / ((now_ms() - t0) / 1000.0))
}

struct Throughput {
    idle_rss: Vec<f64>,
    elapsed_ms: f64,
    write_ms: f64,
    wire_per_change: f64,
}

async fn measure_throughput(base: &Path, rep: usize, o: &Opts) -> Result<Throughput> {
    let cluster = Cluster::start(3, base, &format!("tp{rep}"), 60_000).await?;
    let r = throughput_on(&cluster, o).await;
    cluster.stop().await;
    r
}

/// Waits until every follower has `heads`; returns the latest time one of
/// them got there.
async fn followers_reach(cluster: &Cluster, heads: &Value, step: &str) -> Result<f64> {
    let waits = cluster.nodes[1..].iter().map(|n| async move {
        n.call_t(
            "wait_heads",
            json!({ "heads": heads, "timeout_ms": 600_000 }),
            610_000,
        )
        .await
        .with_context(|| format!("{}: {step}", n.name))
        .and_then(|v| as_f64(&v, "t_ms"))
    });
    let mut last = f64::MIN;
    for r in futures::future::join_all(waits).await {
        last = last.max(r?);
    }
    Ok(last)
}

/// How long the nodes sit idle, once meshed, before their RSS is read: the
/// same wait as nuwa-bench's (crates/bench/src/throughput.rs).
const IDLE_SETTLE: std::time::Duration = std::time::Duration::from_secs(2);

async fn throughput_on(cluster: &Cluster, o: &Opts) -> Result<Throughput> {
    tokio::time::sleep(IDLE_SETTLE).await;
    let mut idle_rss = Vec::new();
    for n in &cluster.nodes {
        idle_rss.push(as_f64(&n.call("rss", json!({})).await?, "rss_bytes")? / 1e6);
    }
    measure_latency(cluster, WARMUP_WRITES, "w").await?;
    let server = &cluster.nodes[0];
    let before = quiescent_bytes(server).await?;
    let w = server
        .call_t(
            "write_many",
            json!({ "prefix": "tp_", "count": o.writes, "per_turn": o.in_flight }),
            600_000,
        )
        .await?;
    let done = followers_reach(
        cluster,
        &w["heads"],
        "throughput: waiting for node 0's heads",
    )
    .await?;
    let t_start = as_f64(&w, "t_start_ms")?;
    let elapsed_ms = as_f64(&w, "t_end_ms")?.max(done) - t_start;
    let after = quiescent_bytes(server).await?;
    Ok(Throughput {
        idle_rss,
        elapsed_ms,
        write_ms: as_f64(&w, "t_end_ms")? - t_start,
        wire_per_change: (after - before) / o.writes as f64,
    })
}

struct Batch {
    elapsed_ms: f64,
    wire_per_item: f64,
}

async fn measure_batch(base: &Path, rep: usize, items: usize) -> Result<Batch> {
    let cluster = Cluster::start(BATCH_NODES, base, &format!("batch{rep}"), 60_000).await?;
    let r = async {
        measure_latency(&cluster, WARMUP_WRITES, "w").await?;
        let server = &cluster.nodes[0];
        let before = quiescent_bytes(server).await?;
        let w = server
            .call_t(
                "write_batches",
                json!({ "count": items, "per_batch": PER_BATCH }),
                600_000,
            )
            .await?;
        let done =
            followers_reach(&cluster, &w["heads"], "batch: waiting for node 0's heads").await?;
        let elapsed_ms = as_f64(&w, "t_end_ms")?.max(done) - as_f64(&w, "t_start_ms")?;
        let after = quiescent_bytes(server).await?;
        Ok(Batch {
            elapsed_ms,
            wire_per_item: (after - before) / items as f64,
        })
    }
    .await;
    cluster.stop().await;
    r
}

struct Fresh {
    sync_ms: f64,
    incl_start_ms: f64,
    rss_mb: f64,
}

/// Starts a fresh node with empty storage, syncs the document from node 0,
/// and checks it.
async fn sync_fresh_node(
    name: &str,
    base: &Path,
    port: u64,
    fill: &Value,
    o: &Opts,
    warm_up: bool,
) -> Result<Fresh> {
    let fresh = Node::spawn(name).await?;
    let r = async {
        let r = fresh
            .call_t(
                "cold_sync",
                json!({
                    "dir": node_dir(base, name),
                    "peer_id": name,
                    "port": port,
                    "doc_id": fill["doc_id"],
                    "heads": fill["heads"],
                    "timeout_ms": 1_200_000,
                    "warm_up": warm_up,
                }),
                1_210_000,
            )
            .await?;
        let keys = fresh.call("count_keys", json!({})).await?["keys"]
            .as_u64()
            .unwrap_or(0);
        if keys as usize != o.log_entries {
            bail!(
                "{name} has {keys} entries after sync, expected {}",
                o.log_entries
            );
        }
        // Like a device that keeps running after the sync: storage written, then RSS.
        fresh
            .call_t("flush", json!({ "timeout_ms": 600_000 }), 610_000)
            .await?;
        let rss = as_f64(&fresh.call("rss", json!({})).await?, "rss_bytes")?;
        let done = as_f64(&r, "t_done_ms")?;
        Ok(Fresh {
            sync_ms: done - as_f64(&r, "t_start_ms")?,
            incl_start_ms: done - fresh.forked_at_ms,
            rss_mb: rss / 1e6,
        })
    }
    .await;
    fresh.stop().await;
    r
}

#[derive(Default)]
struct Cold {
    sync: Vec<f64>,
    unwarmed: Vec<f64>,
    incl_start: Vec<f64>,
    load: Vec<f64>,
    ratio: Vec<f64>,
    rss_after: Vec<f64>,
    saved_bytes: u64,
}

async fn measure_cold_sync(base: &Path, o: &Opts) -> Result<Cold> {
    let source = Node::spawn("cold-node0").await?;
    let r = cold_sync_from(&source, base, o).await;
    source.stop().await;
    r
}

async fn cold_sync_from(source: &Node, base: &Path, o: &Opts) -> Result<Cold> {
    let started = source
        .call(
            "start",
            json!({ "role": "server", "dir": node_dir(base, &source.name), "peer_id": source.name }),
        )
        .await?;
    let port = started["port"]
        .as_u64()
        .ok_or_else(|| anyhow!("cold-node0: start gave no port"))?;
    log(&format!(
        "cold sync: filling node 0 with {} entries (one change each)",
        o.log_entries
    ));
    let fill = source
        .call_t(
            "fill",
            json!({ "prefix": "e_", "count": o.log_entries }),
            1_800_000,
        )
        .await?;
    source
        .call_t("flush", json!({ "timeout_ms": 600_000 }), 610_000)
        .await?;
    log(&format!(
        "cold sync: filled in {} ms",
        fmt(as_f64(&fill, "t_end_ms")? - as_f64(&fill, "t_start_ms")?)
    ));
    // One untimed load first, as bench.mjs does.
    source.call_t("local_load", json!({}), 600_000).await?;
    let mut out = Cold::default();
    for rep in 0..o.reps {
        let plain =
            sync_fresh_node(&format!("cold-plain{rep}"), base, port, &fill, o, false).await?;
        let warm = sync_fresh_node(&format!("cold-warm{rep}"), base, port, &fill, o, true).await?;
        let local = source.call_t("local_load", json!({}), 600_000).await?;
        let keys = local["keys"].as_u64().unwrap_or(0);
        if keys as usize != o.log_entries {
            bail!(
                "cold-node0: local load gave {keys} entries, expected {}",
                o.log_entries
            );
        }
        let load_ms = as_f64(&local, "ms")?;
        out.sync.push(warm.sync_ms);
        out.unwarmed.push(plain.sync_ms);
        out.incl_start.push(plain.incl_start_ms);
        out.load.push(load_ms);
        out.ratio.push(warm.sync_ms / load_ms);
        out.rss_after.push(plain.rss_mb);
        out.saved_bytes = local["saved_bytes"].as_u64().unwrap_or(0);
        log(&format!(
            "cold sync rep {}: sync {} ms warmed up, {} ms not ({} ms from process start), local load {} ms",
            rep + 1,
            fmt(warm.sync_ms),
            fmt(plain.sync_ms),
            fmt(plain.incl_start_ms),
            fmt(load_ms)
        ));
    }
    Ok(out)
}

// ---- output ----

fn print_table(result: &Value) {
    let mut rows: Vec<[String; 4]> = Vec::new();
    let mut add = |name: String, s: &Value, unit: &str| {
        if let (Some(m), Some(lo), Some(hi)) =
            (s["median"].as_f64(), s["min"].as_f64(), s["max"].as_f64())
        {
            rows.push([
                name,
                fmt(m),
                format!("{}–{}", fmt(lo), fmt(hi)),
                unit.into(),
            ]);
        }
    };
    if let Some(m) = result["propagation_latency"].as_object() {
        let mut sizes: Vec<(&String, &Value)> = m.iter().collect();
        sizes.sort_by_key(|(k, _)| k.parse::<usize>().unwrap_or(0));
        for (n, v) in sizes {
            add(format!("propagation p50, N={n}"), &v["p50_ms"], "ms");
            add(format!("propagation p99, N={n}"), &v["p99_ms"], "ms");
        }
    }
    let t = &result["throughput"];
    add("throughput, 3 nodes".into(), &t["rate_per_sec"], "writes/s");
    add("throughput elapsed".into(), &t["elapsed_ms"], "ms");
    add(
        "throughput, writing alone".into(),
        &result["extra"]["throughput_write_ms"],
        "ms",
    );
    add(
        "local append (Automerge)".into(),
        &t["local_append_rate_per_sec"],
        "writes/s",
    );
    add("throughput ratio".into(), &t["ratio"], "×");
    let c = &result["cold_sync"];
    add(
        format!("cold sync, {} entries", c["entries"]),
        &c["sync_ms"],
        "ms",
    );
    let x = &result["extra"];
    add(
        "cold sync, not warmed up".into(),
        &x["cold_sync_not_warmed_up_ms"],
        "ms",
    );
    add(
        "cold sync incl. process start".into(),
        &x["cold_sync_incl_process_start_ms"],
        "ms",
    );
    add("local Automerge::load".into(), &c["local_load_ms"], "ms");
    add("cold sync ratio".into(), &c["ratio"], "×");
    let b = &result["bytes_per_change"];
    add(
        "wire bytes per change".into(),
        &b["wire_bytes_per_change"],
        "B",
    );
    add("raw change bytes".into(), &b["raw_change_bytes"], "B");
    add("bytes ratio".into(), &b["ratio"], "×");
    add("RSS idle".into(), &result["rss_mb"]["idle"], "MB");
    add(
        "RSS after cold sync".into(),
        &result["rss_mb"]["after_sync"],
        "MB",
    );
    let bt = &result["batch"];
    add(
        format!("batch, {} items, 100 per change", bt["items"]),
        &bt["rate_per_sec"],
        "items/s",
    );
    add("batch elapsed".into(), &bt["elapsed_ms"], "ms");
    add(
        "batch local append".into(),
        &bt["local_append_rate_per_sec"],
        "items/s",
    );
    add("batch ratio".into(), &bt["ratio"], "×");
    add(
        "batch wire bytes per item".into(),
        &bt["wire_bytes_per_item"],
        "B",
    );

    let head = ["figure", "median", "min–max", "unit"];
    let width = |i: usize| {
        rows.iter()
            .map(|r| r[i].chars().count())
            .chain([head[i].chars().count()])
            .max()
            .unwrap_or(0)
    };
    let widths: Vec<usize> = (0..4).map(width).collect();
    let line = |cells: &[String]| {
        let cells: Vec<String> = cells
            .iter()
            .zip(&widths)
            .map(|(c, w)| format!("{c}{}", " ".repeat(w - c.chars().count())))
            .collect();
        format!("| {} |", cells.join(" | "))
    };
    println!("{}", line(&head.map(String::from)));
    let sep: Vec<String> = widths.iter().map(|w| "-".repeat(w + 2)).collect();
    println!("|{}|", sep.join("|"));
    for r in &rows {
        println!("{}", line(r));
    }
}

fn machine() -> Value {
    json!({
        "os": std::env::consts::OS,
        "arch": std::env::consts::ARCH,
        "cpus": std::thread::available_parallelism().map_or(0, |n| n.get()),
    })
}

#[derive(Default)]
struct Tp {
    elapsed: Vec<f64>,
    write: Vec<f64>,
    rate: Vec<f64>,
    local: Vec<f64>,
    ratio: Vec<f64>,
    wire: Vec<f64>,
    raw: Vec<f64>,
    bytes_ratio: Vec<f64>,
    idle_rss: Vec<f64>,
}

#[derive(Default)]
struct Bt {
    elapsed: Vec<f64>,
    rate: Vec<f64>,
    local: Vec<f64>,
    ratio: Vec<f64>,
    wire: Vec<f64>,
}

type Latency = std::collections::BTreeMap<usize, (Vec<f64>, Vec<f64>)>;

async fn measure_all(base: &Path, o: &Opts) -> Result<(Latency, Tp, Bt, Cold)> {
    let mut latency = Latency::new();
    let mut tp = Tp::default();
    let mut bt = Bt::default();
    for rep in 0..o.reps {
        for &n in &o.sizes {
            let cluster = Cluster::start(n, base, &format!("lat{n}r{rep}"), 60_000).await?;
            let r = async {
                measure_latency(&cluster, WARMUP_WRITES, "w").await?;
                measure_latency(&cluster, o.samples, "b").await
            }
            .await;
            cluster.stop().await;
            let l = r?;
            let (p50, p99) = (percentile(&l, 50.0), percentile(&l, 99.0));
            let e = latency.entry(n).or_default();
            e.0.push(p50);
            e.1.push(p99);
            log(&format!(
                "latency N={n} rep {}: p50 {} ms, p99 {} ms",
                rep + 1,
                fmt(p50),
                fmt(p99)
            ));
        }

        let r = measure_throughput(base, rep, o).await?;
        let writes = o.writes;
        let local = tokio::task::spawn_blocking(move || local_append(writes)).await??;
        let rate = o.writes as f64 / (r.elapsed_ms / 1000.0);
        tp.elapsed.push(r.elapsed_ms);
        tp.write.push(r.write_ms);
        tp.rate.push(rate);
        tp.local.push(local.rate_per_sec);
        tp.ratio.push(rate / local.rate_per_sec);
        tp.wire.push(r.wire_per_change);
        tp.raw.push(local.raw_change_bytes);
        tp.bytes_ratio
            .push(r.wire_per_change / local.raw_change_bytes);
        tp.idle_rss.extend(&r.idle_rss);
        log(&format!(
            "throughput rep {}: {} writes/s converged ({} ms, {} ms of it writing), local {} writes/s, {} wire B/change",
            rep + 1,
            fmt(rate),
            fmt(r.elapsed_ms),
            fmt(r.write_ms),
            fmt(local.rate_per_sec),
            fmt(r.wire_per_change)
        ));

        if o.batch_items > 0 {
            let b = measure_batch(base, rep, o.batch_items).await?;
            let items = o.batch_items;
            let local = tokio::task::spawn_blocking(move || local_append_items(items)).await??;
            let rate = o.batch_items as f64 / (b.elapsed_ms / 1000.0);
            bt.elapsed.push(b.elapsed_ms);
            bt.rate.push(rate);
            bt.local.push(local);
            bt.ratio.push(rate / local);
            bt.wire.push(b.wire_per_item);
            log(&format!(
                "batch rep {}: {} items/s converged ({} ms), local {} items/s, {} wire B/item",
                rep + 1,
                fmt(rate),
                fmt(b.elapsed_ms),
                fmt(local),
                fmt(b.wire_per_item)
            ));
        }
    }
    let cold = measure_cold_sync(base, o).await?;
    Ok((latency, tp, bt, cold))
}

fn result_json(o: &Opts, latency: &Latency, tp: &Tp, bt: &Bt, cold: &Cold) -> Value {
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    let mut lat = Map::new();
    for (n, (p50, p99)) in latency {
        lat.insert(
            n.to_string(),
            json!({ "p50_ms": stat(p50), "p99_ms": stat(p99) }),
        );
    }
    let mut doc = json!({
        "schema_version": 1,
        "tool": "samod",
        "tool_version": SAMOD_VERSION,
        "generated_at_unix_ms": now_ms,
        "machine": machine(),
        "params": {
            "reps": o.reps,
            "samples": o.samples,
            "writes": o.writes,
            "in_flight": o.in_flight,
            "log_entries": o.log_entries,
            "batch_items": o.batch_items,
            "sizes": o.sizes,
            "quick": o.quick,
        },
        "propagation_latency": lat,
        "throughput": {
            "nodes": 3,
            "elapsed_ms": stat(&tp.elapsed),
            "rate_per_sec": stat(&tp.rate),
            "local_append_rate_per_sec": stat(&tp.local),
            "ratio": stat(&tp.ratio),
        },
        "cold_sync": {
            "entries": o.log_entries,
            "sync_ms": stat(&cold.sync),
            "local_load_ms": stat(&cold.load),
            "ratio": stat(&cold.ratio),
        },
        "bytes_per_change": {
            "wire_bytes_per_change": stat(&tp.wire),
            "raw_change_bytes": stat(&tp.raw),
            "ratio": stat(&tp.bytes_ratio),
        },
        "rss_mb": {
            "idle": stat(&tp.idle_rss),
            "after_sync": stat(&cold.rss_after),
        },
        // Figures with no counterpart in nuwa-bench; `--compare` ignores them.
        "extra": {
            "versions": { "samod": SAMOD_VERSION, "automerge": AUTOMERGE_VERSION },
            "connector": "samod::tokio_io (TCP, 4-byte length-delimited frames)",
            "storage": "samod::storage::TokioFilesystemStorage",
            "wire_bytes_counted": "TCP payload on node 0's accepted connections, both directions (frames included)",
            "throughput_write_ms": stat(&tp.write),
            "cold_sync_not_warmed_up_ms": stat(&cold.unwarmed),
            "cold_sync_incl_process_start_ms": stat(&cold.incl_start),
            "cold_sync_saved_doc_bytes": cold.saved_bytes,
        },
    });
    if !bt.rate.is_empty() {
        doc["batch"] = json!({
            "nodes": BATCH_NODES,
            "items": o.batch_items,
            "per_batch": PER_BATCH,
            "elapsed_ms": stat(&bt.elapsed),
            "rate_per_sec": stat(&bt.rate),
            "local_append_rate_per_sec": stat(&bt.local),
            "ratio": stat(&bt.ratio),
            "wire_bytes_per_item": stat(&bt.wire),
        });
    }
    doc
}

async fn coordinator(o: Opts) -> Result<()> {
    let base = std::env::temp_dir().join(format!("samod-bench-{}", std::process::id()));
    std::fs::create_dir_all(&base).with_context(|| format!("cannot create {}", base.display()))?;
    log(&format!(
        "nodes keep their storage under {}",
        base.display()
    ));
    let measured = measure_all(&base, &o).await;
    let _ = std::fs::remove_dir_all(&base);
    let (latency, tp, bt, cold) = measured?;
    let result = result_json(&o, &latency, &tp, &bt, &cold);
    if let Some(dir) = o.json_out.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    }
    std::fs::write(
        &o.json_out,
        format!("{}\n", serde_json::to_string_pretty(&result)?),
    )
    .with_context(|| format!("cannot write {}", o.json_out.display()))?;
    print_table(&result);
    log(&format!("wrote {}", o.json_out.display()));
    Ok(())
}

#[tokio::main]
async fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().map(String::as_str) == Some("--child") {
        return match child::run().await {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("child {}: {e:#}", args.get(1).map_or("?", String::as_str));
                ExitCode::FAILURE
            }
        };
    }
    let opts = match parse_cli(&args) {
        Ok(Parsed::Run(o)) => o,
        Ok(Parsed::Help) => {
            print!("{HELP}");
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            eprintln!("error: {e}\n\n{HELP}");
            return ExitCode::from(2);
        }
    };
    match coordinator(opts).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
