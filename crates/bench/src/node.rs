//! Real `nuwa-node` processes for the benchmark: homes (`init`, `device
//! provision`), daemons on loopback, a mesh of them, their memory use and
//! a clean stop.
//!
//! Every daemon runs with `--no-mdns --no-dht --no-rendezvous
//! --no-known-peers` and listens on 127.0.0.1 only: peers are given with
//! `--peer`, so nothing is sent beyond loopback. What is measured is up to
//! the workloads.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use tokio::process::{Child, Command};
use tokio::time::Instant;

use crate::api::{Api, ApiFile, Status, Watcher};

/// Flags that keep every daemon on loopback with discovery off.
const LOOPBACK_ONLY: &[&str] = &[
    "--listen",
    "/ip4/127.0.0.1/tcp/0",
    "--no-mdns",
    "--no-dht",
    "--no-rendezvous",
    "--no-known-peers",
    "--api-listen",
    "127.0.0.1:0",
];

/// The `nuwa-node` binary.
#[derive(Debug, Clone)]
pub struct NodeBin(pub PathBuf);

impl NodeBin {
    fn command(&self, home: &Path) -> Command {
        let mut c = Command::new(&self.0);
        c.arg("--home").arg(home);
        // Quiet logs: they go to a file and are only read on failure (or
        // kept with --keep; NUWA_BENCH_LOG sets their filter to diagnose).
        let filter = std::env::var("NUWA_BENCH_LOG").unwrap_or_else(|_| "warn".to_owned());
        c.env("RUST_LOG", filter);
        c.env_remove("NUWA_HOME");
        c
    }

    /// Runs a one-shot command to completion; fails with its stderr.
    pub async fn run_once(&self, home: &Path, args: &[&str]) -> Result<()> {
        let out = self
            .command(home)
            .args(args)
            .stdin(Stdio::null())
            .output()
            .await
            .with_context(|| format!("cannot run {}", self.0.display()))?;
        if !out.status.success() {
            bail!(
                "`nuwa-node --home {} {}` failed ({}): {}",
                home.display(),
                args.join(" "),
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        Ok(())
    }

    /// `init` in `dir`/`name`.
    pub async fn init(&self, dir: &Path, name: &str) -> Result<PathBuf> {
        let home = dir.join(name);
        self.run_once(&home, &["init", "--name", name, "--i-have-written-it-down"])
            .await?;
        Ok(home)
    }

    /// `device provision` from `master` into `dir`/`name`.
    pub async fn provision(&self, master: &Path, dir: &Path, name: &str) -> Result<PathBuf> {
        let out = dir.join(name);
        let out_s = out.to_string_lossy().into_owned();
        self.run_once(
            master,
            &["device", "provision", "--out", &out_s, "--name", name],
        )
        .await?;
        Ok(out)
    }

    /// `sync --once` like [`NodeBin::sync_once`], sampling the process's
    /// peak resident memory (`VmHWM`) every 50 ms; returns it in MB.
    pub async fn sync_once_peak(
        &self,
        home: &Path,
        peer: &str,
        timeout_secs: u64,
    ) -> Result<OnceFigures> {
        let timeout = format!("{timeout_secs}s");
        let mut args = vec!["sync", "--once", "--timeout", &timeout, "--peer", peer];
        args.extend_from_slice(LOOPBACK_ONLY);
        let mut child = self
            .command(home)
            .args(&args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .with_context(|| format!("cannot run {}", self.0.display()))?;
        let pid = child.id().context("the sync process has no pid")?;
        // Read stderr as it comes, so a chatty process never blocks on a
        // full pipe; its last line carries the longest loop turn.
        let mut stderr = child.stderr.take().context("no stderr pipe")?;
        let reader = tokio::spawn(async move {
            use tokio::io::AsyncReadExt as _;
            let mut text = String::new();
            let _ = stderr.read_to_string(&mut text).await;
            text
        });
        let mut peak_kb = 0u64;
        let status = loop {
            tokio::select! {
                st = child.wait() => break st?,
                () = tokio::time::sleep(std::time::Duration::from_millis(50)) => {
                    let hwm = std::fs::read_to_string(format!("/proc/{pid}/status"))
                        .ok()
                        .and_then(|t| {
                            t.lines()
                                .find_map(|l| l.strip_prefix("VmHWM:"))
                                .and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok())
                        });
                    if let Some(kb) = hwm {
                        peak_kb = peak_kb.max(kb);
                    }
                }
            }
        };
        let err = reader.await.unwrap_or_default();
        if !status.success() {
            bail!("`sync --once` failed ({status}): {}", err.trim());
        }
        // Its own peak (it may exit before the first sample); the samples
        // for a binary that does not print it.
        let sampled = peak_kb as f64 * 1024.0 / 1e6;
        Ok(OnceFigures {
            peak_rss_mb: reported_peak_mb(&err).unwrap_or(sampled).max(sampled),
            longest_turn_ms: longest_turn_ms(&err),
        })
    }

    /// `sync --once` of `home` against `peer` only; returns once it exited 0.
    pub async fn sync_once(&self, home: &Path, peer: &str, timeout_secs: u64) -> Result<()> {
        let timeout = format!("{timeout_secs}s");
        let mut args = vec!["sync", "--once", "--timeout", &timeout, "--peer", peer];
        args.extend_from_slice(LOOPBACK_ONLY);
        self.run_once(home, &args).await
    }
}

/// One running daemon.
pub struct Daemon {
    pub name: String,
    pub api: Api,
    pub pid: u32,
    pub peer_id: String,
    /// A loopback listen address with `/p2p/`.
    pub addr: String,
    child: Child,
    log: PathBuf,
}

impl std::fmt::Debug for Daemon {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Daemon")
            .field("name", &self.name)
            .field("pid", &self.pid)
            .field("addr", &self.addr)
            .finish()
    }
}

impl Daemon {
    /// Starts `run` in `home` dialing `peers`, and returns once its API
    /// answers.
    pub async fn start(bin: &NodeBin, home: &Path, name: &str, peers: &[String]) -> Result<Daemon> {
        let api_path = home.join("api.json");
        // A file left by an earlier run would point at a dead daemon.
        let _ = std::fs::remove_file(&api_path);
        let log = home.with_extension("log");
        let log_file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log)
            .with_context(|| format!("cannot open {}", log.display()))?;
        let mut cmd = bin.command(home);
        cmd.arg("run").args(LOOPBACK_ONLY);
        for p in peers {
            cmd.arg("--peer").arg(p);
        }
        let child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log_file)
            .kill_on_drop(true)
            .spawn()
            .with_context(|| format!("cannot start {}", bin.0.display()))?;
        let pid = child.id().context("the daemon exited at once")?;
        let mut child = child;

        let deadline = Instant::now() + Duration::from_secs(60);
        let file: ApiFile = loop {
            if let Ok(bytes) = std::fs::read(&api_path) {
                if let Ok(f) = serde_json::from_slice::<ApiFile>(&bytes) {
                    if f.pid == pid {
                        break f;
                    }
                }
            }
            if let Ok(Some(status)) = child.try_wait() {
                bail!(
                    "daemon {name} exited during start-up ({status}); log:\n{}",
                    tail(&log)
                );
            }
            if Instant::now() >= deadline {
                bail!(
                    "daemon {name} wrote no api.json within 60 s; log:\n{}",
                    tail(&log)
                );
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        let api = Api::new(&file)?;
        let status = loop {
            match api.status().await {
                Ok(s) => break s,
                Err(e) if Instant::now() >= deadline => {
                    return Err(e.context(format!(
                        "daemon {name} does not answer; log:\n{}",
                        tail(&log)
                    )));
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(20)).await,
            }
        };
        let addr = status
            .listen_addrs
            .iter()
            .find(|a| a.starts_with("/ip4/127.0.0.1/"))
            .or(status.listen_addrs.first())
            .cloned()
            .with_context(|| format!("daemon {name} reports no listen address"))?;
        Ok(Daemon {
            name: name.to_owned(),
            api,
            pid,
            peer_id: status.device.peer_id,
            addr,
            child,
            log,
        })
    }

    /// Resident memory of the process, in MB (10^6 bytes), from
    /// `/proc/PID/status`.
    pub fn rss_mb(&self) -> Result<f64> {
        rss_mb(self.pid)
    }

    /// Stops the daemon with SIGTERM (a clean shutdown that flushes the
    /// store) and waits for it to exit.
    pub async fn stop(mut self) -> Result<()> {
        let status = std::process::Command::new("kill")
            .arg("-TERM")
            .arg(self.pid.to_string())
            .status()
            .context("cannot run kill")?;
        if !status.success() {
            bail!("cannot signal daemon {} (pid {})", self.name, self.pid);
        }
        match tokio::time::timeout(Duration::from_secs(60), self.child.wait()).await {
            Ok(Ok(s)) if s.success() => Ok(()),
            Ok(Ok(s)) => bail!(
                "daemon {} exited with {s} on SIGTERM; log:\n{}",
                self.name,
                tail(&self.log)
            ),
            Ok(Err(e)) => Err(e).context("cannot wait for the daemon"),
            Err(_) => bail!("daemon {} did not stop within 60 s of SIGTERM", self.name),
        }
    }

    /// The last lines of this daemon's log, for error messages.
    pub fn log_tail(&self) -> String {
        tail(&self.log)
    }
}

/// Resident memory of process `pid` in MB (10^6 bytes).
pub fn rss_mb(pid: u32) -> Result<f64> {
    let path = format!("/proc/{pid}/status");
    let text = std::fs::read_to_string(&path).with_context(|| format!("cannot read {path}"))?;
    let kib: f64 = text
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .with_context(|| format!("no VmRSS in {path}"))?;
    Ok(kib * 1024.0 / 1e6)
}

fn tail(log: &Path) -> String {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(20)..].join("\n")
}

/// N daemons of one agent in a mesh: node i dials node 0 and node i-1.
pub struct Cluster {
    pub nodes: Vec<Daemon>,
}

impl Cluster {
    /// Creates N homes under `dir`, starts them and waits until every node
    /// has verified the peers it dialed or was dialed by.
    pub async fn start(bin: &NodeBin, dir: &Path, n: usize) -> Result<Cluster> {
        if n == 0 {
            bail!("a cluster needs at least one node");
        }
        let master = bin.init(dir, "n0").await?;
        let mut homes = vec![master.clone()];
        for i in 1..n {
            homes.push(bin.provision(&master, dir, &format!("n{i}")).await?);
        }
        let mut nodes: Vec<Daemon> = Vec::with_capacity(n);
        for (i, home) in homes.iter().enumerate() {
            let mut peers = BTreeSet::new();
            if i > 0 {
                peers.insert(nodes[0].addr.clone());
                peers.insert(nodes[i - 1].addr.clone());
            }
            let peers: Vec<String> = peers.into_iter().collect();
            nodes.push(Daemon::start(bin, home, &format!("n{i}"), &peers).await?);
        }
        let c = Cluster { nodes };
        c.wait_mesh(Duration::from_secs(120)).await?;
        Ok(c)
    }

    /// Peers node `i` must have verified: the ones it dialed and the ones
    /// that dialed it.
    fn expected_peers(&self, i: usize) -> BTreeSet<String> {
        let n = self.nodes.len();
        let mut want = BTreeSet::new();
        let mut link = |a: usize, b: usize| {
            if a == i && b != i {
                want.insert(self.nodes[b].peer_id.clone());
            }
            if b == i && a != i {
                want.insert(self.nodes[a].peer_id.clone());
            }
        };
        for j in 1..n {
            link(j, 0);
            link(j, j - 1);
        }
        want
    }

    async fn wait_mesh(&self, limit: Duration) -> Result<()> {
        let deadline = Instant::now() + limit;
        loop {
            let mut missing = Vec::new();
            for (i, node) in self.nodes.iter().enumerate() {
                let st = node.api.status().await?;
                let have: BTreeSet<String> = st.peers.iter().map(|p| p.peer_id.clone()).collect();
                let lacking = self.expected_peers(i).difference(&have).count();
                if lacking > 0 {
                    missing.push(format!("{} lacks {lacking}", node.name));
                }
            }
            if missing.is_empty() {
                return Ok(());
            }
            if Instant::now() >= deadline {
                bail!(
                    "peers did not verify each other within {} s ({}); log of n0:\n{}",
                    limit.as_secs(),
                    missing.join(", "),
                    self.nodes[0].log_tail()
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Statuses of every node, in order.
    pub async fn statuses(&self) -> Result<Vec<Status>> {
        let mut out = Vec::with_capacity(self.nodes.len());
        for n in &self.nodes {
            out.push(n.api.status().await?);
        }
        Ok(out)
    }

    /// The `bytes_sent` counters of all nodes, summed.
    pub async fn bytes_sent(&self) -> Result<u64> {
        Ok(self.statuses().await?.iter().map(Status::bytes_sent).sum())
    }

    /// An event stream of `container` on every node but node 0 (the writer).
    pub async fn watch_followers(&self, container: &str) -> Result<Vec<Watcher>> {
        let mut watchers = Vec::with_capacity(self.nodes.len().saturating_sub(1));
        for node in &self.nodes[1..] {
            watchers.push(node.api.watch(container).await?);
        }
        Ok(watchers)
    }

    /// Stops every daemon cleanly.
    pub async fn stop(self) -> Result<()> {
        let mut first_err = None;
        for n in self.nodes {
            if let Err(e) = n.stop().await {
                first_err.get_or_insert(e);
            }
        }
        first_err.map_or(Ok(()), Err)
    }
}

/// What a `sync --once` run reported about itself.
#[derive(Debug, Clone, Copy)]
pub struct OnceFigures {
    /// Peak resident memory (`VmHWM`, as the process reported it at exit,
    /// or sampled).
    pub peak_rss_mb: f64,
    /// The longest turn of its daemon loop, from its last line ("longest
    /// loop turn X ms"); NaN if the line is missing.
    pub longest_turn_ms: f64,
}

fn longest_turn_ms(stderr: &str) -> f64 {
    stderr
        .rsplit_once("longest loop turn ")
        .and_then(|(_, rest)| rest.split_whitespace().next()?.parse().ok())
        .unwrap_or(f64::NAN)
}

/// The peak RSS `sync --once` reported in its last line ("peak RSS X MB").
fn reported_peak_mb(stderr: &str) -> Option<f64> {
    stderr
        .rsplit_once("peak RSS ")
        .and_then(|(_, rest)| rest.split_whitespace().next()?.parse().ok())
}

#[cfg(test)]
mod once_tests {
    // Goal: the figure is read from the last line of `sync --once`, and a
    // run that printed none gives NaN rather than a made-up zero.
    #[test]
    fn longest_turn_is_read_from_the_last_line() {
        let text = "peers verified: 1  in sync: 0  containers: 1\nconverged with 1 peer(s); 1 container(s) in sync; longest loop turn 12.5 ms\n";
        assert_eq!(super::longest_turn_ms(text), 12.5);
        assert!(super::longest_turn_ms("converged with 1 peer(s)").is_nan());
        let text = "converged with 1 peer(s); longest loop turn 1.9 ms (net); peak RSS 35.2 MB\n";
        assert_eq!(super::longest_turn_ms(text), 1.9);
        assert_eq!(super::reported_peak_mb(text), Some(35.2));
        assert_eq!(super::reported_peak_mb("converged"), None);
    }
}
