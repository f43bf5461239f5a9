//! `nuwa-bench`: measures real `nuwa-node` daemons on loopback against the
//! performance targets of the project brief, and writes the figures as a
//! Markdown table, JSON (schema in docs/performance.md) and PNG charts.
//!
//! The daemons are child processes in a temporary directory, all on
//! 127.0.0.1 with mDNS, the DHT and rendezvous off. The benchmark judges
//! nothing about correctness beyond checking that every run converged.

mod api;
mod batch;
mod check;
mod coldsync;
mod containers;
mod latency;
mod local;
mod node;
mod plot;
mod reads;
mod report;
mod stats;
mod throughput;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{Context, Result, bail};
use clap::Parser;
use serde_json::{Map, Value, json};

use crate::node::NodeBin;
use crate::report::stat_json;

const ABOUT: &str = "Benchmark nuwa-node: propagation latency, converged write throughput, \
cold sync, bytes on the wire and memory, against the project's performance targets.";

const AFTER_HELP: &str = "\
Every figure is the median and the min–max over --reps repetitions; ratios
are taken inside each repetition. Daemons run as child processes on
127.0.0.1 only (mDNS, DHT and rendezvous off) in a temporary directory.

Examples:
  nuwa-bench --quick                                   # seconds; a smoke run
  nuwa-bench --quick --check                           # the same, exit 1 on a jump
  nuwa-bench --node-bin target/release/nuwa-node       # the full benchmark
  nuwa-bench --results bench-out/results.json --compare scripts/bench/out/automerge-repo.json
  nuwa-bench --quick --automerge-repo                  # both tools, one table (needs Node.js)
  nuwa-bench --quick --samod                           # against samod (builds it with cargo)";

#[derive(Parser, Debug)]
#[command(name = "nuwa-bench", version, about = ABOUT, after_help = AFTER_HELP)]
struct Cli {
    /// The nuwa-node binary to benchmark. Default: `nuwa-node` next to this
    /// executable.
    #[arg(long, value_name = "PATH")]
    node_bin: Option<PathBuf>,
    /// Cluster sizes for the propagation latency (default 3,5,10).
    #[arg(long, value_name = "N,N,...", value_delimiter = ',')]
    sizes: Option<Vec<usize>>,
    /// Writes timed per cluster size and repetition (default 100).
    #[arg(long, value_name = "S")]
    samples: Option<usize>,
    /// Writes in the throughput run (default 5000).
    #[arg(long, value_name = "W")]
    writes: Option<usize>,
    /// Requests in flight during the throughput run.
    #[arg(long, value_name = "K", default_value_t = 32)]
    in_flight: usize,
    /// Entries in the log a fresh device syncs (default 100000).
    #[arg(long, value_name = "E")]
    log_entries: Option<usize>,
    /// Repetitions of every workload (default 3).
    #[arg(long, value_name = "R")]
    reps: Option<usize>,
    /// Shrink everything for a smoke run: N=3 only, 20 samples, 500 writes,
    /// 20000 log entries, 1 repetition (explicit options still win).
    #[arg(long)]
    quick: bool,
    /// After the run, hold a few figures to wide limits (a jump, not a
    /// target: cold sync against an empty log's, latency, the converged /
    /// local ratios, idle RSS, the longest loop turn, point reads) and exit
    /// with status 1 if one is broken. Meant with --quick; the limits and
    /// why are in crates/bench/src/check.rs and docs/performance.md.
    #[arg(long)]
    check: bool,
    /// Keys in the container of the `reads` workload (default 100000).
    #[arg(long, value_name = "K")]
    read_keys: Option<usize>,
    /// Point reads timed in the `reads` workload (default 2000).
    #[arg(long, value_name = "G")]
    gets: Option<usize>,
    /// Items written through `state.batch` in the `batch` workload, in
    /// batches of 100 (default 20000).
    #[arg(long, value_name = "I")]
    batch_items: Option<usize>,
    /// Entries of the log in the `big` workload, written through
    /// `state.batch` 1,000 at a time (default 1000000).
    #[arg(long, value_name = "E")]
    big_entries: Option<usize>,
    /// Container counts of the `containers` workload (default
    /// 10,1000,10000).
    #[arg(long, value_name = "N,N,...", value_delimiter = ',')]
    container_counts: Option<Vec<usize>>,
    /// Workloads to run: latency, throughput, cold-sync, reads, batch,
    /// containers, big (default: all).
    #[arg(long, value_name = "W,W,...", value_delimiter = ',')]
    only: Option<Vec<Workload>>,
    /// Directory for report.md, results.json and the PNG charts.
    #[arg(long, value_name = "DIR", default_value = "bench-out")]
    out: PathBuf,
    /// Also write the results JSON to FILE.
    #[arg(long, value_name = "FILE")]
    json_out: Option<PathBuf>,
    /// A results file of the same schema from another tool (e.g. the
    /// automerge-repo script in scripts/bench/): add a side-by-side table.
    #[arg(long, value_name = "FILE")]
    compare: Option<PathBuf>,
    /// After measuring nuwa-node, run the same workloads with the same
    /// parameters through the automerge-repo script (scripts/bench/run.sh;
    /// needs Node.js 20+ and, on first use, the npm registry) twice, at its
    /// defaults and with its sync debounce at 0, and add a table for each.
    /// Its JSON goes to OUT/automerge-repo.json and
    /// OUT/automerge-repo-debounce-0.json.
    #[arg(long, conflicts_with_all = ["compare", "results"])]
    automerge_repo: bool,
    /// The automerge-repo script to run with --automerge-repo.
    #[arg(long, value_name = "PATH", default_value = concat!(env!("CARGO_MANIFEST_DIR"), "/../../scripts/bench/run.sh"))]
    automerge_repo_script: PathBuf,
    /// After measuring nuwa-node (and automerge-repo, when both are given),
    /// run the same workloads with the same parameters on samod, the Rust
    /// automerge-repo (scripts/bench/samod/run.sh; builds it with cargo, so
    /// crates.io on first use), and add a table for it. Its JSON goes to
    /// OUT/samod.json.
    #[arg(long, conflicts_with_all = ["compare", "results"])]
    samod: bool,
    /// The samod script to run with --samod.
    #[arg(long, value_name = "PATH", default_value = concat!(env!("CARGO_MANIFEST_DIR"), "/../../scripts/bench/samod/run.sh"))]
    samod_script: PathBuf,
    /// Run nothing: render the report from an earlier results.json.
    #[arg(long, value_name = "FILE")]
    results: Option<PathBuf>,
    /// Where the daemons' temporary homes go (default: the system temp dir).
    #[arg(long, value_name = "DIR")]
    work_dir: Option<PathBuf>,
    /// Keep the daemons' homes and logs after the run (their path is printed).
    #[arg(long)]
    keep: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Workload {
    Latency,
    Throughput,
    ColdSync,
    Reads,
    Batch,
    Containers,
    Big,
}

/// The effective parameters after `--quick` and the explicit options.
#[derive(Debug, Clone)]
struct Params {
    sizes: Vec<usize>,
    samples: usize,
    writes: usize,
    in_flight: usize,
    log_entries: usize,
    read_keys: usize,
    gets: usize,
    batch_items: usize,
    container_counts: Vec<usize>,
    big_entries: usize,
    reps: usize,
    quick: bool,
    workloads: Vec<Workload>,
}

impl Params {
    fn from_cli(cli: &Cli) -> Result<Params> {
        let q = cli.quick;
        let p = Params {
            sizes: cli
                .sizes
                .clone()
                .unwrap_or_else(|| if q { vec![3] } else { vec![3, 5, 10] }),
            samples: cli.samples.unwrap_or(if q { 20 } else { 100 }),
            writes: cli.writes.unwrap_or(if q { 500 } else { 5000 }),
            in_flight: cli.in_flight,
            log_entries: cli.log_entries.unwrap_or(if q { 20_000 } else { 100_000 }),
            read_keys: cli.read_keys.unwrap_or(if q { 10_000 } else { 100_000 }),
            gets: cli.gets.unwrap_or(if q { 300 } else { 2000 }),
            batch_items: cli.batch_items.unwrap_or(if q { 2000 } else { 20_000 }),
            big_entries: cli
                .big_entries
                .unwrap_or(if q { 20_000 } else { 1_000_000 }),
            container_counts: cli.container_counts.clone().unwrap_or_else(|| {
                if q {
                    vec![10, 1000]
                } else {
                    vec![10, 1000, 10_000]
                }
            }),
            reps: cli.reps.unwrap_or(if q { 1 } else { 3 }),
            quick: q,
            workloads: cli.only.clone().unwrap_or_else(|| {
                vec![
                    Workload::Latency,
                    Workload::Throughput,
                    Workload::ColdSync,
                    Workload::Reads,
                    Workload::Batch,
                    Workload::Containers,
                    Workload::Big,
                ]
            }),
        };
        if p.sizes.iter().any(|&n| n < 2) {
            bail!("--sizes: every cluster needs at least 2 nodes");
        }
        if p.samples == 0 || p.writes == 0 || p.log_entries == 0 || p.reps == 0 || p.in_flight == 0
        {
            bail!("--samples, --writes, --log-entries, --reps and --in-flight must be at least 1");
        }
        Ok(p)
    }

    fn json(&self) -> Value {
        json!({
            "reps": self.reps,
            "samples": self.samples,
            "writes": self.writes,
            "in_flight": self.in_flight,
            "log_entries": self.log_entries,
            "read_keys": self.read_keys,
            "gets": self.gets,
            "batch_items": self.batch_items,
            "big_entries": self.big_entries,
            "container_counts": self.container_counts,
            "sizes": self.sizes,
            "quick": self.quick,
        })
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match rt.block_on(real_main(cli)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

async fn real_main(cli: Cli) -> Result<()> {
    let (doc, params) = match &cli.results {
        Some(file) => (read_json(file)?, None),
        None => {
            let params = Params::from_cli(&cli)?;
            let bin = node_bin(cli.node_bin.as_deref())?;
            (measure_all(&cli, &params, &bin).await?, Some(params))
        }
    };
    let others: Vec<Value> = match &params {
        Some(p) if cli.automerge_repo || cli.samod => {
            // Keep nuwa-node's figures even if a comparison fails.
            std::fs::create_dir_all(&cli.out)
                .with_context(|| format!("cannot create {}", cli.out.display()))?;
            std::fs::write(
                cli.out.join("results.json"),
                serde_json::to_string_pretty(&doc)?,
            )
            .context("cannot write results.json")?;
            let mut others = Vec::new();
            if cli.automerge_repo {
                // Twice: at the library's defaults, and with its 100 ms sync
                // debounce at 0 (which dominates its latency row).
                others.push(run_script(&cli, p, &Side::AutomergeRepo { debounce_ms: None }).await?);
                others.push(
                    run_script(
                        &cli,
                        p,
                        &Side::AutomergeRepo {
                            debounce_ms: Some(0),
                        },
                    )
                    .await?,
                );
            }
            if cli.samod {
                others.push(run_script(&cli, p, &Side::Samod).await?);
            }
            others
        }
        _ => cli
            .compare
            .as_deref()
            .map(read_json)
            .transpose()?
            .into_iter()
            .collect(),
    };
    write_outputs(&cli, &doc, &others)?;
    if cli.check {
        let (table, ok) = check::check(&doc);
        println!("\nbenchmark guard (--check):\n\n{table}");
        if !ok {
            anyhow::bail!("a figure broke its guard (see the table above)");
        }
    }
    Ok(())
}

/// A comparison run by a script of scripts/bench/.
enum Side {
    /// scripts/bench/run.sh (Node.js), optionally with its sync debounce set.
    AutomergeRepo { debounce_ms: Option<u32> },
    /// scripts/bench/samod/run.sh (a Rust program built by the script).
    Samod,
}

impl Side {
    fn name(&self) -> &'static str {
        match self {
            Side::AutomergeRepo { .. } => "automerge-repo",
            Side::Samod => "samod",
        }
    }

    fn script<'a>(&self, cli: &'a Cli) -> (&'a Path, &'static str) {
        match self {
            Side::AutomergeRepo { .. } => (&cli.automerge_repo_script, "--automerge-repo-script"),
            Side::Samod => (&cli.samod_script, "--samod-script"),
        }
    }

    fn json_file(&self) -> String {
        match self {
            Side::AutomergeRepo { debounce_ms: None } => "automerge-repo.json".to_owned(),
            Side::AutomergeRepo {
                debounce_ms: Some(ms),
            } => format!("automerge-repo-debounce-{ms}.json"),
            Side::Samod => "samod.json".to_owned(),
        }
    }

    /// What the script needs to start, for the error when it cannot.
    fn needs(&self) -> &'static str {
        match self {
            Side::AutomergeRepo { .. } => "is Node.js 20+ installed?",
            Side::Samod => "is cargo on the PATH?",
        }
    }

    /// The options only this script takes.
    fn extra_args(&self, p: &Params) -> Vec<String> {
        match self {
            Side::AutomergeRepo { debounce_ms } => debounce_ms
                .map(|ms| vec!["--sync-debounce-ms".to_owned(), ms.to_string()])
                .unwrap_or_default(),
            Side::Samod => {
                // Its batch run follows nuwa-bench's `batch` workload.
                let items = if p.workloads.contains(&Workload::Batch) {
                    p.batch_items
                } else {
                    0
                };
                vec!["--batch-items".to_owned(), items.to_string()]
            }
        }
    }
}

/// The options every comparison script shares (the CLI of
/// scripts/bench/bench.mjs), with the parameters nuwa-node was measured with.
fn script_args(p: &Params, json_out: &Path) -> Vec<std::ffi::OsString> {
    let sizes: Vec<String> = p.sizes.iter().map(ToString::to_string).collect();
    let mut args: Vec<std::ffi::OsString> = Vec::new();
    if p.quick {
        args.push("--quick".into());
    }
    for (name, value) in [
        ("--reps", p.reps.to_string()),
        ("--samples", p.samples.to_string()),
        ("--sizes", sizes.join(",")),
        ("--writes", p.writes.to_string()),
        ("--in-flight", p.in_flight.to_string()),
        ("--log-entries", p.log_entries.to_string()),
    ] {
        args.push(name.into());
        args.push(value.into());
    }
    args.push("--json-out".into());
    args.push(json_out.as_os_str().to_owned());
    args
}

/// Runs a comparison script with the parameters nuwa-node was measured
/// with, right after it (the daemons are gone, so the two do not compete
/// for the cores), and reads its JSON.
async fn run_script(cli: &Cli, p: &Params, side: &Side) -> Result<Value> {
    let name = side.name();
    let (script, option) = side.script(cli);
    if !script.is_file() {
        bail!(
            "the {name} script is not at {}; pass {option} PATH",
            script.display()
        );
    }
    std::fs::create_dir_all(&cli.out)
        .with_context(|| format!("cannot create {}", cli.out.display()))?;
    let json_out = std::path::absolute(cli.out.join(side.json_file()))
        .context("cannot resolve the output directory")?;
    let mut cmd = tokio::process::Command::new(script);
    cmd.args(script_args(p, &json_out))
        .args(side.extra_args(p))
        // Its table goes to our stderr, so our stdout stays one report.
        .stdout(std::process::Stdio::from(std::io::stderr()));
    eprintln!("{name}: running {}", script.display());
    let status = cmd
        .status()
        .await
        .with_context(|| format!("cannot run {} ({})", script.display(), side.needs()))?;
    if !status.success() {
        bail!(
            "the {name} script failed ({status}); nuwa-node's figures are in {}",
            cli.out.display()
        );
    }
    read_json(&json_out)
}

fn read_json(file: &Path) -> Result<Value> {
    let text =
        std::fs::read_to_string(file).with_context(|| format!("cannot read {}", file.display()))?;
    serde_json::from_str(&text).with_context(|| format!("{} is not JSON", file.display()))
}

fn node_bin(given: Option<&Path>) -> Result<NodeBin> {
    let path = match given {
        Some(p) => p.to_owned(),
        None => std::env::current_exe()
            .context("cannot find this executable's path; pass --node-bin")?
            .parent()
            .map(|d| d.join("nuwa-node"))
            .context("this executable has no parent directory; pass --node-bin")?,
    };
    if !path.is_file() {
        bail!(
            "nuwa-node not found at {}; build it (`cargo build --release -p nuwa-node`) or pass --node-bin PATH",
            path.display()
        );
    }
    Ok(NodeBin(path))
}

/// A fresh directory for one repetition, removed afterwards unless --keep.
struct RepDir {
    path: PathBuf,
    keep: bool,
}

impl RepDir {
    fn new(root: &Path, name: &str, keep: bool) -> Result<RepDir> {
        let path = root.join(name);
        std::fs::create_dir_all(&path)
            .with_context(|| format!("cannot create {}", path.display()))?;
        Ok(RepDir { path, keep })
    }
}

impl Drop for RepDir {
    fn drop(&mut self) {
        // Long logs take disk space; each repetition frees its own.
        if !self.keep {
            let _ = std::fs::remove_dir_all(&self.path);
        }
    }
}

/// The directory the repetitions make theirs in: a fresh temporary one,
/// under --work-dir when given.
struct WorkRoot {
    path: PathBuf,
    /// With --keep the directory outlives the run; otherwise dropping this
    /// guard removes it (each repetition already removed its own).
    _guard: Option<tempfile::TempDir>,
}

impl WorkRoot {
    fn create(cli: &Cli) -> Result<WorkRoot> {
        let mut builder = tempfile::Builder::new();
        builder.prefix("nuwa-bench-");
        let root = match &cli.work_dir {
            Some(d) => {
                std::fs::create_dir_all(d)
                    .with_context(|| format!("cannot create {}", d.display()))?;
                builder.tempdir_in(d)
            }
            None => builder.tempdir(),
        }
        .context("cannot create a temporary directory")?;
        if cli.keep {
            let kept = root.keep();
            eprintln!("homes and logs are kept in {}", kept.display());
            Ok(WorkRoot {
                path: kept,
                _guard: None,
            })
        } else {
            Ok(WorkRoot {
                path: root.path().to_owned(),
                _guard: Some(root),
            })
        }
    }
}

/// The runs of every workload, in the order they ran; a workload that was
/// not asked for leaves its field empty.
#[derive(Default)]
struct Runs {
    latency: BTreeMap<usize, Vec<latency::LatencyRun>>,
    throughput: Vec<throughput::ThroughputRun>,
    cold_sync: Vec<coldsync::ColdSyncRun>,
    reads: Vec<reads::ReadsRun>,
    batch: Vec<batch::BatchRun>,
    containers: BTreeMap<usize, Vec<containers::ContainersRun>>,
    big: Vec<coldsync::ColdSyncRun>,
}

/// What every repetition of every workload shares: the daemon binary, the
/// parameters, and where its directory goes.
struct Bench<'a> {
    bin: &'a NodeBin,
    p: &'a Params,
    root: &'a Path,
    keep: bool,
}

impl Bench<'_> {
    /// A fresh directory for one repetition, named after it.
    fn rep_dir(&self, name: &str) -> Result<RepDir> {
        RepDir::new(self.root, name, self.keep)
    }

    /// Runs the workloads asked for, one after the other, so no two compete
    /// for the cores.
    async fn run_workloads(&self) -> Result<Runs> {
        let wants = |w: Workload| self.p.workloads.contains(&w);
        let mut runs = Runs::default();
        if wants(Workload::Latency) {
            runs.latency = self.latency().await?;
        }
        if wants(Workload::Throughput) {
            runs.throughput = self.throughput().await?;
        }
        if wants(Workload::ColdSync) {
            runs.cold_sync = self.cold_sync().await?;
        }
        if wants(Workload::Reads) {
            runs.reads = self.reads().await?;
        }
        if wants(Workload::Batch) {
            runs.batch = self.batch().await?;
        }
        if wants(Workload::Containers) {
            runs.containers = self.containers().await?;
        }
        if wants(Workload::Big) {
            runs.big = self.big().await?;
        }
        Ok(runs)
    }

    async fn latency(&self) -> Result<BTreeMap<usize, Vec<latency::LatencyRun>>> {
        let p = self.p;
        let mut lat: BTreeMap<usize, Vec<latency::LatencyRun>> = BTreeMap::new();
        for &n in &p.sizes {
            for rep in 0..p.reps {
                let dir = self.rep_dir(&format!("latency-n{n}-r{rep}"))?;
                let r = latency::run(self.bin, &dir.path, n, p.samples)
                    .await
                    .with_context(|| format!("latency run N={n}, repetition {}", rep + 1))?;
                eprintln!(
                    "latency N={n} rep {}/{}: p50 {} ms, p99 {} ms",
                    rep + 1,
                    p.reps,
                    report::num(r.p50_ms),
                    report::num(r.p99_ms)
                );
                lat.entry(n).or_default().push(r);
            }
        }
        Ok(lat)
    }

    async fn throughput(&self) -> Result<Vec<throughput::ThroughputRun>> {
        let p = self.p;
        let mut thr = Vec::new();
        for rep in 0..p.reps {
            let dir = self.rep_dir(&format!("throughput-r{rep}"))?;
            let r = throughput::run(self.bin, &dir.path, p.writes, p.in_flight)
                .await
                .with_context(|| format!("throughput run, repetition {}", rep + 1))?;
            eprintln!(
                "throughput rep {}/{}: {} writes/s converged, local append {} /s (ratio {}); \
                 wire {} B/change vs raw {} B",
                rep + 1,
                p.reps,
                report::num(r.rate_per_sec),
                report::num(r.local_append_rate_per_sec),
                report::num(r.ratio),
                report::num(r.wire_bytes_per_change),
                report::num(r.raw_change_bytes)
            );
            thr.push(r);
        }
        Ok(thr)
    }

    async fn cold_sync(&self) -> Result<Vec<coldsync::ColdSyncRun>> {
        let p = self.p;
        let mut cold = Vec::new();
        for rep in 0..p.reps {
            let dir = self.rep_dir(&format!("cold-sync-r{rep}"))?;
            let r = coldsync::run(self.bin, &dir.path, p.log_entries, coldsync::Fill::Puts)
                .await
                .with_context(|| format!("cold sync run, repetition {}", rep + 1))?;
            eprintln!(
                "cold sync rep {}/{}: sync {} ms, local load {} ms (ratio {}); RSS after {} MB",
                rep + 1,
                p.reps,
                report::num(r.sync_ms),
                report::num(r.local_load_ms),
                report::num(r.ratio),
                report::num(r.rss_after_sync_mb)
            );
            cold.push(r);
        }
        Ok(cold)
    }

    async fn reads(&self) -> Result<Vec<reads::ReadsRun>> {
        let p = self.p;
        let mut rd = Vec::new();
        for rep in 0..p.reps {
            let dir = self.rep_dir(&format!("reads-r{rep}"))?;
            let r = reads::run(
                self.bin,
                &dir.path,
                p.read_keys,
                p.gets,
                p.samples,
                p.in_flight,
            )
            .await
            .with_context(|| format!("reads run, repetition {}", rep + 1))?;
            eprintln!(
                "reads rep {}/{}: {} keys (filled in {} s); point read p50 {} ms, p99 {} ms, max {} ms; \
                 propagation p99 idle {} ms, with a read loop on the receiver {} ms ({}×), on the \
                 sender {} ms ({}×); the loop read the whole container {} times, {} ms each",
                rep + 1,
                p.reps,
                r.keys,
                report::num(r.fill_secs),
                report::num(r.get_p50_ms),
                report::num(r.get_p99_ms),
                report::num(r.get_max_ms),
                report::num(r.idle_p99_ms),
                report::num(r.loaded_receiver_p99_ms),
                report::num(r.receiver_ratio()),
                report::num(r.loaded_sender_p99_ms),
                report::num(r.sender_ratio()),
                r.loop_reads,
                report::num(r.loop_read_mean_ms),
            );
            rd.push(r);
        }
        Ok(rd)
    }

    async fn batch(&self) -> Result<Vec<batch::BatchRun>> {
        let p = self.p;
        let mut bt = Vec::new();
        for rep in 0..p.reps {
            let dir = self.rep_dir(&format!("batch-r{rep}"))?;
            let r = batch::run(self.bin, &dir.path, p.batch_items)
                .await
                .with_context(|| format!("batch run, repetition {}", rep + 1))?;
            eprintln!(
                "batch rep {}/{}: {} items/s converged through state.batch ({} per batch), \
                 local append {} /s (ratio {}); wire {} B/item",
                rep + 1,
                p.reps,
                report::num(r.rate_per_sec),
                batch::BATCH,
                report::num(r.local_append_rate_per_sec),
                report::num(r.ratio),
                report::num(r.wire_bytes_per_item),
            );
            bt.push(r);
        }
        Ok(bt)
    }

    async fn containers(&self) -> Result<BTreeMap<usize, Vec<containers::ContainersRun>>> {
        let p = self.p;
        let mut ct: BTreeMap<usize, Vec<containers::ContainersRun>> = BTreeMap::new();
        for &n in &p.container_counts {
            for rep in 0..p.reps {
                let dir = self.rep_dir(&format!("containers-{n}-r{rep}"))?;
                let r = containers::run(self.bin, &dir.path, n)
                    .await
                    .with_context(|| format!("containers run, {n}, repetition {}", rep + 1))?;
                eprintln!(
                    "containers {n} rep {}/{}: idle {} B per peer per round; one change in {} ms; \
                     filled and synced in {} ms; idle RSS {:?} MB",
                    rep + 1,
                    p.reps,
                    report::num(r.idle_bytes_per_peer_round),
                    report::num(r.one_change_ms),
                    report::num(r.fill_and_sync_ms),
                    r.idle_rss_mb,
                );
                ct.entry(n).or_default().push(r);
            }
        }
        Ok(ct)
    }

    async fn big(&self) -> Result<Vec<coldsync::ColdSyncRun>> {
        let p = self.p;
        let mut big = Vec::new();
        for rep in 0..p.reps {
            let dir = self.rep_dir(&format!("big-r{rep}"))?;
            let fill = coldsync::Fill::Batches(1000);
            let r = coldsync::run(self.bin, &dir.path, p.big_entries, fill)
                .await
                .with_context(|| format!("big run, repetition {}", rep + 1))?;
            eprintln!(
                "big rep {}/{}: cold sync of {} entries {} ms, local load {} ms (ratio {}); \
                 peak RSS of the syncing device {} MB, its longest loop turn {} ms; \
                 the serving device's (restarted first) {} ms, the writing device's during the \
                 fill {} ms",
                rep + 1,
                p.reps,
                p.big_entries,
                report::num(r.sync_ms),
                report::num(r.local_load_ms),
                report::num(r.ratio),
                report::num(r.sync_peak_rss_mb),
                report::num(r.sync_longest_turn_ms),
                report::num(r.serve_longest_turn_ms),
                report::num(r.fill_longest_turn_ms),
            );
            big.push(r);
        }
        Ok(big)
    }
}

async fn measure_all(cli: &Cli, p: &Params, bin: &NodeBin) -> Result<Value> {
    let root = WorkRoot::create(cli)?;
    eprintln!("nuwa-node: {}", bin.0.display());
    let bench = Bench {
        bin,
        p,
        root: &root.path,
        keep: cli.keep,
    };
    let runs = bench.run_workloads().await?;
    let doc = results_json(p, &runs);
    if p.workloads.len() == 7 {
        let missing = report::missing(&doc, &report::required_paths(&p.sizes));
        if !missing.is_empty() {
            eprintln!(
                "warning: figures missing from the results: {}",
                missing.join(", ")
            );
        }
    }
    Ok(doc)
}

fn insert(map: &mut Map<String, Value>, key: &str, v: Option<Value>) {
    if let Some(v) = v {
        map.insert(key.to_owned(), v);
    }
}

fn machine() -> Value {
    let cpus = std::thread::available_parallelism().map_or(0, |n| n.get());
    let model = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|t| {
            t.lines()
                .find_map(|l| l.strip_prefix("model name"))
                .map(|v| v.trim_start_matches([' ', '\t', ':']).to_owned())
        })
        .unwrap_or_default();
    json!({
        "os": std::env::consts::OS,
        "arch": std::env::consts::ARCH,
        "cpus": cpus,
        "cpu_model": model,
    })
}

/// The results document (schema in docs/performance.md): what ran where,
/// then one section per workload that ran. A section is left out when its
/// workload did not run, and a stat when it has no values.
fn results_json(p: &Params, runs: &Runs) -> Value {
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    let mut doc = Map::new();
    doc.insert("schema_version".into(), json!(report::SCHEMA_VERSION));
    doc.insert("tool".into(), json!("nuwa-bench"));
    doc.insert("tool_version".into(), json!(env!("CARGO_PKG_VERSION")));
    doc.insert("generated_at_unix_ms".into(), json!(now_ms));
    doc.insert("machine".into(), machine());
    doc.insert("params".into(), p.json());
    insert(&mut doc, "propagation_latency", latency_json(&runs.latency));
    insert(&mut doc, "throughput", throughput_json(&runs.throughput));
    insert(
        &mut doc,
        "bytes_per_change",
        bytes_per_change_json(&runs.throughput),
    );
    insert(&mut doc, "reads", reads_json(p, &runs.reads));
    insert(&mut doc, "cold_sync", cold_sync_json(p, &runs.cold_sync));
    insert(&mut doc, "rss_mb", rss_json(runs));
    insert(&mut doc, "batch", batch_json(&runs.batch));
    insert(&mut doc, "containers", containers_json(&runs.containers));
    insert(&mut doc, "big", big_json(p, &runs.big));
    Value::Object(doc)
}

/// The stat of one field over the repetitions of a workload.
fn stat_of<R>(runs: &[R], field: impl Fn(&R) -> f64) -> Option<Value> {
    stat_json(&runs.iter().map(field).collect::<Vec<_>>())
}

/// The `propagation_latency` section, one entry per cluster size, with
/// every sample pooled for the chart.
fn latency_json(lat: &BTreeMap<usize, Vec<latency::LatencyRun>>) -> Option<Value> {
    if lat.is_empty() {
        return None;
    }
    let mut m = Map::new();
    for (n, runs) in lat {
        let mut e = Map::new();
        insert(&mut e, "p50_ms", stat_of(runs, |r| r.p50_ms));
        insert(&mut e, "p99_ms", stat_of(runs, |r| r.p99_ms));
        insert(
            &mut e,
            "wire_bytes_per_change",
            stat_of(runs, |r| r.wire_bytes_per_change),
        );
        let pooled: Vec<f64> = runs
            .iter()
            .flat_map(|r| r.samples_ms.iter().map(|x| (x * 1000.0).round() / 1000.0))
            .collect();
        e.insert("samples_ms".into(), json!(pooled));
        m.insert(n.to_string(), Value::Object(e));
    }
    Some(Value::Object(m))
}

/// The `throughput` section, with the first repetition's timeline for the
/// chart.
fn throughput_json(thr: &[throughput::ThroughputRun]) -> Option<Value> {
    let first = thr.first()?;
    let mut t = Map::new();
    t.insert("nodes".into(), json!(throughput::NODES));
    insert(&mut t, "elapsed_ms", stat_of(thr, |r| r.elapsed_ms));
    insert(&mut t, "rate_per_sec", stat_of(thr, |r| r.rate_per_sec));
    insert(
        &mut t,
        "local_append_rate_per_sec",
        stat_of(thr, |r| r.local_append_rate_per_sec),
    );
    insert(&mut t, "ratio", stat_of(thr, |r| r.ratio));
    t.insert(
        "timeline".into(),
        json!({
            "acks_per_100ms": acks_per_100ms(&first.acks_ms, first.elapsed_ms),
            "converged_ms": first.elapsed_ms,
        }),
    );
    Some(Value::Object(t))
}

/// The `bytes_per_change` section, measured by the throughput workload.
fn bytes_per_change_json(thr: &[throughput::ThroughputRun]) -> Option<Value> {
    if thr.is_empty() {
        return None;
    }
    let mut b = Map::new();
    insert(
        &mut b,
        "wire_bytes_per_change",
        stat_of(thr, |r| r.wire_bytes_per_change),
    );
    insert(
        &mut b,
        "raw_change_bytes",
        stat_of(thr, |r| r.raw_change_bytes),
    );
    insert(&mut b, "ratio", stat_of(thr, |r| r.bytes_ratio));
    Some(Value::Object(b))
}

/// The `reads` section: point reads, and propagation with a read loop
/// running.
fn reads_json(p: &Params, rd: &[reads::ReadsRun]) -> Option<Value> {
    if rd.is_empty() {
        return None;
    }
    let mut r = Map::new();
    r.insert("keys".into(), json!(p.read_keys));
    insert(&mut r, "get_p50_ms", stat_of(rd, |r| r.get_p50_ms));
    insert(&mut r, "get_p99_ms", stat_of(rd, |r| r.get_p99_ms));
    insert(&mut r, "get_max_ms", stat_of(rd, |r| r.get_max_ms));
    insert(
        &mut r,
        "propagation_idle_p50_ms",
        stat_of(rd, |r| r.idle_p50_ms),
    );
    insert(
        &mut r,
        "propagation_loaded_receiver_p50_ms",
        stat_of(rd, |r| r.loaded_receiver_p50_ms),
    );
    insert(
        &mut r,
        "propagation_loaded_sender_p50_ms",
        stat_of(rd, |r| r.loaded_sender_p50_ms),
    );
    insert(
        &mut r,
        "propagation_idle_p99_ms",
        stat_of(rd, |r| r.idle_p99_ms),
    );
    insert(
        &mut r,
        "propagation_loaded_receiver_p99_ms",
        stat_of(rd, |r| r.loaded_receiver_p99_ms),
    );
    insert(
        &mut r,
        "propagation_loaded_sender_p99_ms",
        stat_of(rd, |r| r.loaded_sender_p99_ms),
    );
    insert(
        &mut r,
        "receiver_ratio",
        stat_of(rd, reads::ReadsRun::receiver_ratio),
    );
    insert(
        &mut r,
        "sender_ratio",
        stat_of(rd, reads::ReadsRun::sender_ratio),
    );
    insert(
        &mut r,
        "whole_read_ms",
        stat_of(rd, |r| r.loop_read_mean_ms),
    );
    Some(Value::Object(r))
}

/// The `cold_sync` section.
fn cold_sync_json(p: &Params, cold: &[coldsync::ColdSyncRun]) -> Option<Value> {
    if cold.is_empty() {
        return None;
    }
    let mut c = Map::new();
    c.insert("entries".into(), json!(p.log_entries));
    insert(&mut c, "sync_ms", stat_of(cold, |r| r.sync_ms));
    insert(&mut c, "local_load_ms", stat_of(cold, |r| r.local_load_ms));
    insert(&mut c, "ratio", stat_of(cold, |r| r.ratio));
    insert(&mut c, "fill_ms", stat_of(cold, |r| r.fill_ms));
    insert(
        &mut c,
        "baseline_sync_ms",
        stat_of(cold, |r| r.baseline_sync_ms),
    );
    Some(Value::Object(c))
}

/// The `rss_mb` section: daemons idle after the throughput run, and the
/// synced device after the cold sync.
fn rss_json(runs: &Runs) -> Option<Value> {
    let idle: Vec<f64> = runs
        .throughput
        .iter()
        .flat_map(|r| r.idle_rss_mb.iter().copied())
        .collect();
    let after: Vec<f64> = runs.cold_sync.iter().map(|r| r.rss_after_sync_mb).collect();
    if idle.is_empty() && after.is_empty() {
        return None;
    }
    let mut r = Map::new();
    insert(&mut r, "idle", stat_json(&idle));
    insert(&mut r, "after_sync", stat_json(&after));
    Some(Value::Object(r))
}

/// The `batch` section: writes through `state.batch`.
fn batch_json(bt: &[batch::BatchRun]) -> Option<Value> {
    let first = bt.first()?;
    let mut b = Map::new();
    b.insert("nodes".into(), json!(batch::NODES));
    b.insert("items".into(), json!(first.items));
    b.insert("per_batch".into(), json!(batch::BATCH));
    insert(&mut b, "elapsed_ms", stat_of(bt, |r| r.elapsed_ms));
    insert(&mut b, "rate_per_sec", stat_of(bt, |r| r.rate_per_sec));
    insert(
        &mut b,
        "local_append_rate_per_sec",
        stat_of(bt, |r| r.local_append_rate_per_sec),
    );
    insert(&mut b, "ratio", stat_of(bt, |r| r.ratio));
    insert(
        &mut b,
        "wire_bytes_per_item",
        stat_of(bt, |r| r.wire_bytes_per_item),
    );
    Some(Value::Object(b))
}

/// The `containers` section, one entry per container count.
fn containers_json(ct: &BTreeMap<usize, Vec<containers::ContainersRun>>) -> Option<Value> {
    if ct.is_empty() {
        return None;
    }
    let mut m = Map::new();
    for (n, runs) in ct {
        let mut e = Map::new();
        insert(
            &mut e,
            "idle_bytes_per_peer_round",
            stat_of(runs, |r| r.idle_bytes_per_peer_round),
        );
        insert(&mut e, "one_change_ms", stat_of(runs, |r| r.one_change_ms));
        insert(
            &mut e,
            "fill_and_sync_ms",
            stat_of(runs, |r| r.fill_and_sync_ms),
        );
        let rss: Vec<f64> = runs.iter().flat_map(|r| r.idle_rss_mb.clone()).collect();
        insert(&mut e, "idle_rss_mb", stat_json(&rss));
        m.insert(n.to_string(), Value::Object(e));
    }
    Some(Value::Object(m))
}

/// The `big` section: the cold sync of a log filled through `state.batch`.
fn big_json(p: &Params, big: &[coldsync::ColdSyncRun]) -> Option<Value> {
    if big.is_empty() {
        return None;
    }
    let mut m = Map::new();
    m.insert("entries".into(), json!(p.big_entries));
    insert(&mut m, "sync_ms", stat_of(big, |r| r.sync_ms));
    insert(&mut m, "local_load_ms", stat_of(big, |r| r.local_load_ms));
    insert(&mut m, "ratio", stat_of(big, |r| r.ratio));
    insert(
        &mut m,
        "sync_peak_rss_mb",
        stat_of(big, |r| r.sync_peak_rss_mb),
    );
    insert(
        &mut m,
        "sync_longest_turn_ms",
        stat_of(big, |r| r.sync_longest_turn_ms),
    );
    insert(
        &mut m,
        "serve_longest_turn_ms",
        stat_of(big, |r| r.serve_longest_turn_ms),
    );
    insert(
        &mut m,
        "fill_longest_turn_ms",
        stat_of(big, |r| r.fill_longest_turn_ms),
    );
    insert(&mut m, "fill_ms", stat_of(big, |r| r.fill_ms));
    Some(Value::Object(m))
}

fn acks_per_100ms(acks_ms: &[f64], until_ms: f64) -> Vec<u32> {
    let last = acks_ms.iter().copied().fold(until_ms, f64::max);
    let mut counts = vec![0u32; (last / 100.0).floor() as usize + 1];
    for ms in acks_ms {
        let i = ((ms / 100.0).floor() as usize).min(counts.len() - 1);
        counts[i] += 1;
    }
    counts
}

/// `doc` without the long arrays (latency samples, timeline), for reading.
fn without_series(doc: &Value) -> Value {
    let mut d = doc.clone();
    if let Some(m) = d
        .get_mut("propagation_latency")
        .and_then(Value::as_object_mut)
    {
        for e in m.values_mut() {
            if let Some(e) = e.as_object_mut() {
                e.remove("samples_ms");
            }
        }
    }
    if let Some(t) = d.get_mut("throughput").and_then(Value::as_object_mut) {
        t.remove("timeline");
    }
    d
}

/// Writes the results, the charts and report.md to --out (and the results
/// to --json-out), and prints the tables.
fn write_outputs(cli: &Cli, doc: &Value, others: &[Value]) -> Result<()> {
    let out = &cli.out;
    std::fs::create_dir_all(out).with_context(|| format!("cannot create {}", out.display()))?;
    write_results(cli, doc)?;
    let charts = draw_charts(out, doc)?;

    let figures = report::figures_table(doc);
    let compares: Vec<String> = others
        .iter()
        .map(|o| report::compare_table(doc, o))
        .collect();
    println!("{figures}");
    for c in &compares {
        println!("{c}");
    }

    let md = report_markdown(doc, &figures, &compares, others, &charts)?;
    std::fs::write(out.join("report.md"), md)
        .with_context(|| format!("cannot write {}", out.join("report.md").display()))?;
    eprintln!("report: {}", out.join("report.md").display());
    Ok(())
}

/// The results document, in full, to results.json and to --json-out.
fn write_results(cli: &Cli, doc: &Value) -> Result<()> {
    let out = &cli.out;
    let pretty = serde_json::to_string_pretty(doc)?;
    std::fs::write(out.join("results.json"), &pretty)
        .with_context(|| format!("cannot write {}", out.join("results.json").display()))?;
    if let Some(f) = &cli.json_out {
        if let Some(dir) = f.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir)
                .with_context(|| format!("cannot create {}", dir.display()))?;
        }
        std::fs::write(f, &pretty).with_context(|| format!("cannot write {}", f.display()))?;
    }
    Ok(())
}

/// A chart in the report: its title and its file name in --out.
type Chart = (&'static str, &'static str);

/// Draws into `out` each chart that `doc` has the data for.
fn draw_charts(out: &Path, doc: &Value) -> Result<Vec<Chart>> {
    let mut charts = Vec::new();
    let series = latency_series(doc);
    if !series.is_empty() {
        plot::latency_cdf(&out.join("latency.png"), &series)?;
        charts.push(("Propagation latency (CDF)", "latency.png"));
    }
    if let Some(t) = doc.get("throughput").and_then(|t| t.get("timeline")) {
        let counts: Vec<u32> =
            serde_json::from_value(t.get("acks_per_100ms").cloned().unwrap_or_default())
                .unwrap_or_default();
        let conv = t.get("converged_ms").and_then(Value::as_f64).unwrap_or(0.0);
        if !counts.is_empty() {
            plot::throughput(&out.join("throughput.png"), &counts, conv)?;
            charts.push((
                "Acknowledged writes per 100 ms (first repetition)",
                "throughput.png",
            ));
        }
    }
    let idle = idle_bytes_series(doc);
    if !idle.is_empty() {
        plot::containers(
            &out.join("containers.png"),
            &[("nuwa-node".to_owned(), idle)],
        )?;
        charts.push((
            "Idle anti-entropy bytes per peer per round against containers (log scale)",
            "containers.png",
        ));
    }
    Ok(charts)
}

/// The pooled latency samples of each cluster size, by size.
fn latency_series(doc: &Value) -> Vec<(usize, Vec<f64>)> {
    doc.get("propagation_latency")
        .and_then(Value::as_object)
        .map(|m| {
            let mut v: Vec<(usize, Vec<f64>)> = m
                .iter()
                .filter_map(|(k, e)| {
                    let n = k.parse().ok()?;
                    let s: Vec<f64> = serde_json::from_value(e.get("samples_ms")?.clone()).ok()?;
                    Some((n, s))
                })
                .collect();
            v.sort_by_key(|(n, _)| *n);
            v
        })
        .unwrap_or_default()
}

/// The median idle anti-entropy bytes per peer per round against the
/// container count, by count. The chart's log scale needs at least 1 byte.
fn idle_bytes_series(doc: &Value) -> Vec<(f64, f64)> {
    doc.get("containers")
        .and_then(Value::as_object)
        .map(|m| {
            let mut v: Vec<(f64, f64)> = m
                .iter()
                .filter_map(|(k, e)| {
                    let n: f64 = k.parse().ok()?;
                    let b = e
                        .get("idle_bytes_per_peer_round")?
                        .get("median")?
                        .as_f64()?;
                    Some((n, b.max(1.0)))
                })
                .collect();
            v.sort_by(|a, b| a.0.total_cmp(&b.0));
            v
        })
        .unwrap_or_default()
}

/// report.md: how the run was made, the tables, the charts, and the
/// results without their long series.
fn report_markdown(
    doc: &Value,
    figures: &str,
    compares: &[String],
    others: &[Value],
    charts: &[Chart],
) -> Result<String> {
    let mut md = String::from("# nuwa-node benchmark\n\n");
    md.push_str(&format!(
        "Command: `{}`\n\n",
        std::env::args().collect::<Vec<_>>().join(" ")
    ));
    if let Some(m) = doc.get("machine") {
        md.push_str(&format!("Machine: `{m}`\n\n"));
    }
    if let Some(p) = doc.get("params") {
        md.push_str(&format!("Parameters: `{p}`\n\n"));
    }
    md.push_str("Each figure is the median and min–max over the repetitions; ratios are taken inside each repetition.\n\n");
    md.push_str(figures);
    for (c, o) in compares.iter().zip(others) {
        let name = o.get("tool").and_then(Value::as_str).unwrap_or("other");
        md.push_str(&format!("\n## Compared with {name}\n\n"));
        md.push_str(c);
    }
    if !charts.is_empty() {
        md.push_str("\n## Charts\n\n");
        for (title, file) in charts {
            md.push_str(&format!("![{title}]({file})\n\n"));
        }
    }
    md.push_str(
        "\n## JSON\n\nThe full file, with every latency sample and the timeline, is `results.json`.\n\n```json\n",
    );
    md.push_str(&serde_json::to_string_pretty(&without_series(doc))?);
    md.push_str("\n```\n");
    Ok(md)
}

#[cfg(test)]
mod tests {
    use super::*;

    // Goal: both comparison scripts get the parameters nuwa-node ran with,
    // from one list, plus only their own options; method: build the
    // arguments for a --quick run limited to two workloads.
    #[test]
    fn scripts_share_the_parameter_list() {
        let cli = Cli::parse_from([
            "nuwa-bench",
            "--quick",
            "--automerge-repo",
            "--samod",
            "--only",
            "latency,throughput",
        ]);
        let p = Params::from_cli(&cli).expect("valid parameters");
        let text = |v: Vec<std::ffi::OsString>| -> Vec<String> {
            v.into_iter()
                .map(|s| s.to_string_lossy().into_owned())
                .collect()
        };
        let common = text(script_args(&p, Path::new("/o/x.json")));
        assert_eq!(
            common,
            [
                "--quick",
                "--reps",
                "1",
                "--samples",
                "20",
                "--sizes",
                "3",
                "--writes",
                "500",
                "--in-flight",
                "32",
                "--log-entries",
                "20000",
                "--json-out",
                "/o/x.json"
            ]
        );
        // No batch workload asked for: samod skips its batch run.
        assert_eq!(Side::Samod.extra_args(&p), ["--batch-items", "0"]);
        assert_eq!(Side::Samod.json_file(), "samod.json");
        let am = Side::AutomergeRepo {
            debounce_ms: Some(0),
        };
        assert_eq!(am.extra_args(&p), ["--sync-debounce-ms", "0"]);
        assert_eq!(am.json_file(), "automerge-repo-debounce-0.json");
        assert!(
            Side::AutomergeRepo { debounce_ms: None }
                .extra_args(&p)
                .is_empty()
        );
        assert!(cli.samod_script.ends_with("scripts/bench/samod/run.sh"));
    }
}
