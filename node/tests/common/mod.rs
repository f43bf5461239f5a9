//! Harness for real-process tests: `nuwa-node` daemons started as child
//! processes, talking over real TCP and real mDNS packets, inside a private
//! network namespace that holds only `lo`.
//!
//! Each test calls [`isolated`], which re-runs that one test under
//! `unshare --net` so that mDNS multicast never reaches a real interface.
//! Every wait polls a condition against a deadline; nothing sleeps and hopes.

#![allow(dead_code)]

use std::fs;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

const IN_NETNS_ENV: &str = "NUWA_NODE_TEST_IN_NETNS";

pub fn bin() -> &'static str {
    env!("CARGO_BIN_EXE_nuwa-node")
}

/// Runs `body` inside a fresh network namespace (re-executing this test
/// binary for just `test_name`).
pub fn isolated(test_name: &str, body: impl FnOnce()) {
    if std::env::var_os(IN_NETNS_ENV).is_some() {
        let status = Command::new("ip")
            .args(["link", "set", "dev", "lo", "up", "multicast", "on"])
            .status()
            .expect("run ip");
        assert!(status.success(), "cannot bring lo up in the test namespace");
        body();
        return;
    }
    let flavours: [&[&str]; 2] = [&["--net"], &["--net", "--map-root-user"]];
    let args = flavours
        .into_iter()
        .find(|a| {
            Command::new("unshare")
                .args(*a)
                .args(["--", "true"])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .is_ok_and(|s| s.success())
        })
        .expect(
            "these tests need a private network namespace (`unshare --net`, as root or with \
             user namespaces) so that mDNS stays off real networks",
        );
    let exe = std::env::current_exe().expect("test binary path");
    let out = Command::new("unshare")
        .args(args)
        .arg("--")
        .arg(exe)
        .args([test_name, "--exact", "--nocapture", "--test-threads=1"])
        .env(IN_NETNS_ENV, "1")
        .output()
        .expect("re-run the test under unshare");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && stdout.contains("1 passed"),
        "{test_name} failed in its network namespace ({}):\n--- stdout\n{stdout}\n--- stderr\n{stderr}",
        out.status
    );
    // Show what the inner run printed (timings etc.).
    println!("{stdout}");
}

/// Polls `cond` every 50 ms until it returns `Some` or `timeout` passes.
pub fn wait_for<T>(what: &str, timeout: Duration, mut cond: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = cond() {
            return v;
        }
        assert!(
            Instant::now() < deadline,
            "timed out after {timeout:?} waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A scratch directory with homes and daemon logs (logs live outside the
/// homes so that home-directory scans see only what the node wrote).
pub struct Cluster {
    pub dir: tempfile::TempDir,
    daemons: Vec<Daemon>,
}

pub struct Daemon {
    pub home: PathBuf,
    pub child: Child,
    pub log: PathBuf,
}

impl Cluster {
    pub fn new() -> Self {
        Cluster {
            dir: tempfile::tempdir().expect("tempdir"),
            daemons: Vec::new(),
        }
    }

    pub fn home(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// `init` a new agent in home `name`.
    pub fn init(&self, name: &str) -> PathBuf {
        let home = self.home(name);
        cli_ok(&home, &["init", "--name", name, "--i-have-written-it-down"]);
        home
    }

    /// `device provision` a new device `name` from home `from`.
    pub fn provision(&self, from: &Path, name: &str) -> PathBuf {
        let home = self.home(name);
        cli_ok(
            from,
            &[
                "device",
                "provision",
                "--out",
                home.to_str().unwrap(),
                "--name",
                name,
            ],
        );
        home
    }

    /// Starts a daemon for `home` with extra `run` args; waits for its API.
    pub fn start(&mut self, home: &Path, extra: &[&str]) -> usize {
        self.start_under(&[], home, extra)
    }

    /// Like [`Cluster::start`], with the daemon run under `wrapper` (a
    /// program and its arguments, such as `faketime -f +600s`).
    pub fn start_under(&mut self, wrapper: &[&str], home: &Path, extra: &[&str]) -> usize {
        let name = home.file_name().unwrap().to_string_lossy().into_owned();
        let logs = self.dir.path().join("logs");
        fs::create_dir_all(&logs).unwrap();
        let n = self.daemons.len();
        let log = logs.join(format!("{name}-{n}.log"));
        let _ = fs::remove_file(home.join("api.json"));
        let mut command = match wrapper.split_first() {
            Some((program, args)) => {
                let mut c = Command::new(program);
                c.args(args).arg(bin());
                c
            }
            None => Command::new(bin()),
        };
        // Its own process group, so that killing the group also kills a
        // daemon a wrapper (such as `faketime`) runs as its child.
        use std::os::unix::process::CommandExt as _;
        let child = command
            .process_group(0)
            .arg("--home")
            .arg(home)
            .args([
                "run",
                "--listen",
                "/ip4/127.0.0.1/tcp/0",
                "--mdns-interface",
                "lo",
            ])
            .args(extra)
            .env("RUST_LOG", "info,nuwa_node=debug")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(fs::File::create(&log).unwrap())
            .spawn()
            .expect("spawn nuwa-node run");
        self.daemons.push(Daemon {
            home: home.to_path_buf(),
            child,
            log: log.clone(),
        });
        wait_for(
            &format!("daemon {name} API"),
            Duration::from_secs(20),
            || {
                if let Ok(Some(st)) = self.daemons[n].child.try_wait() {
                    panic!(
                        "daemon {name} exited early ({st}):\n{}",
                        fs::read_to_string(&log).unwrap_or_default()
                    );
                }
                status(home).ok()
            },
        );
        n
    }

    /// SIGKILL, no chance to clean up.
    pub fn kill9(&mut self, idx: usize) {
        let d = &mut self.daemons[idx];
        kill_group(&d.child, "-KILL");
        d.child.wait().unwrap();
    }

    /// SIGTERM and wait for a clean exit.
    pub fn stop(&mut self, idx: usize) {
        let d = &mut self.daemons[idx];
        kill_group(&d.child, "-TERM");
        let st = wait_for("daemon exit", Duration::from_secs(20), || {
            d.child.try_wait().ok().flatten()
        });
        assert!(
            st.success(),
            "daemon did not shut down cleanly ({st}):\n{}",
            fs::read_to_string(&d.log).unwrap_or_default()
        );
    }

    pub fn logs(&self) -> String {
        self.daemons
            .iter()
            .map(|d| {
                format!(
                    "=== {}\n{}",
                    d.log.display(),
                    fs::read_to_string(&d.log).unwrap_or_default()
                )
            })
            .collect()
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for d in &mut self.daemons {
            kill_group(&d.child, "-KILL");
            let _ = d.child.wait();
        }
        if std::thread::panicking() {
            eprintln!("{}", self.logs());
        }
    }
}

/// Signals the process group a daemon was started in (see `start_under`).
fn kill_group(child: &Child, signal: &str) {
    let group = format!("-{}", child.id());
    let _ = Command::new("kill")
        .args([signal, "--", &group])
        .stderr(Stdio::null())
        .status();
}

pub fn cli(home: &Path, args: &[&str]) -> Output {
    Command::new(bin())
        .arg("--home")
        .arg(home)
        .args(args)
        .output()
        .expect("run nuwa-node")
}

pub fn cli_ok(home: &Path, args: &[&str]) -> String {
    let out = cli(home, args);
    assert!(
        out.status.success(),
        "nuwa-node {args:?} failed: {}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// Puts `{key_prefix}{i}` = i for i in 0..n into `container` through the
/// running daemon's HTTP API, 16 requests in flight, and panics unless every
/// put is acknowledged as durable. Far faster than one CLI process per put.
pub fn put_many(home: &Path, container: &str, key_prefix: &str, n: usize) {
    let (url, token) = api_of(home, "/v1/state/put");
    block_on(async {
        let http = reqwest::Client::builder().no_proxy().build().unwrap();
        let mut tasks = tokio::task::JoinSet::new();
        for lane in 0..16 {
            let (http, url, token) = (http.clone(), url.clone(), token.clone());
            let (container, prefix) = (container.to_owned(), key_prefix.to_owned());
            tasks.spawn(async move {
                for i in (lane..n).step_by(16) {
                    let body = serde_json::json!(
                        {"container": container, "key": format!("{prefix}{i}"), "value": i}
                    );
                    let resp = http.post(&url).bearer_auth(&token).json(&body).send().await;
                    let reply: Value = resp.expect("put request").json().await.expect("put reply");
                    assert_eq!(reply["durable"], Value::Bool(true), "put {i}: {reply}");
                }
            });
        }
        while let Some(done) = tasks.join_next().await {
            done.expect("put task panicked");
        }
    });
}

/// An in-process libp2p node with identity `seed`, subscribed to the gossip
/// topic of agent `did` and dialing `dial` (a daemon's listen address). It
/// proves nothing to the daemon (no `Hello`); it is a gossip participant,
/// like any connected peer. Events go to the returned receiver.
pub fn gossip_node(
    rt: &tokio::runtime::Runtime,
    seed: zeroize::Zeroizing<[u8; 32]>,
    did: &str,
    dial: &str,
    cancel: tokio_util::sync::CancellationToken,
) -> (
    nuwa_net::NetHandle,
    tokio::sync::mpsc::Receiver<nuwa_net::NetEvent>,
) {
    rt.block_on(async {
        let (net, events) = nuwa_net::spawn(
            seed,
            nuwa_net::NetConfig {
                listen: vec!["/ip4/127.0.0.1/tcp/0".parse().unwrap()],
                features: nuwa_net::Features {
                    gossip: true,
                    ..nuwa_net::Features::default()
                },
                ..nuwa_net::NetConfig::default()
            },
            cancel,
        )
        .await
        .unwrap();
        net.gossip_subscribe(nuwa_agent::sync::pointer::gossip_topic(did))
            .await
            .unwrap();
        net.dial(None, vec![dial.parse().unwrap()]).await.unwrap();
        (net, events)
    })
}

pub fn status(home: &Path) -> Result<Value, String> {
    let out = cli(home, &["status", "--json"]);
    if !out.status.success() {
        return Err(String::from_utf8_lossy(&out.stderr).into_owned());
    }
    serde_json::from_slice(&out.stdout).map_err(|e| e.to_string())
}

/// The first peer address a running daemon of `home` listens on (with
/// its `/p2p/` id), for other daemons' `--peer`.
pub fn listen_addr(home: &Path) -> String {
    status(home).unwrap()["listen_addrs"][0]
        .as_str()
        .unwrap()
        .to_owned()
}

/// Context ids of the verified peers in a status report, sorted.
pub fn verified(st: &Value) -> Vec<String> {
    let mut v: Vec<String> = st["peers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["context_id"].as_str().unwrap().to_owned())
        .collect();
    v.sort();
    v
}

pub fn context_id(home: &Path) -> String {
    let info: Value = serde_json::from_slice(&fs::read(home.join("device.json")).unwrap()).unwrap();
    info["context_id"].as_str().unwrap().to_owned()
}

/// `state get CONTAINER --json`, or None when the container is absent.
pub fn get_json(home: &Path, container: &str) -> Option<Value> {
    let out = cli(home, &["state", "get", container, "--json"]);
    if !out.status.success() {
        return None;
    }
    Some(serde_json::from_slice(&out.stdout).unwrap())
}

/// Every file under `dir` whose bytes contain `needle`.
pub fn files_containing(dir: &Path, needle: &[u8]) -> Vec<PathBuf> {
    let mut hits = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for entry in fs::read_dir(&d).unwrap() {
            let p = entry.unwrap().path();
            if p.is_dir() {
                stack.push(p);
            } else if let Ok(bytes) = fs::read(&p) {
                if bytes.windows(needle.len()).any(|w| w == needle) {
                    hits.push(p);
                }
            }
        }
    }
    hits
}

/// The example note schema (`did:nuwa:state:note#v1`), for `state schema add`.
pub fn note_schema_file() -> String {
    concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../crates/asm/schemas/examples/note.json"
    )
    .to_owned()
}

/// `cp -a`: the copy a person makes of a home (modes kept).
pub fn copy_home(from: &Path, to: &Path) {
    let st = Command::new("cp")
        .arg("-a")
        .arg(from)
        .arg(to)
        .status()
        .expect("cp");
    assert!(st.success(), "cp -a {} {}", from.display(), to.display());
}

pub fn unique_marker() -> String {
    // The kernel hands out a fresh random UUID on every read.
    let uuid = fs::read_to_string("/proc/sys/kernel/random/uuid").unwrap();
    format!("nuwa-marker-{}", uuid.trim().replace('-', ""))
}

/// A `nuwa-node pair` process and the code it printed.
pub struct Pairing {
    pub child: Child,
    pub code: String,
    stderr: PathBuf,
}

impl Drop for Pairing {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Pairing {
    pub fn start(home: &Path, extra: &[&str]) -> Pairing {
        Pairing::start_command(home, &["pair", "--name", "phone"], extra)
    }

    /// Runs `command` (`pair ...`, or `recover ...` on a fresh home), which
    /// prints a code and waits for a device to approve it.
    pub fn start_command(home: &Path, command: &[&str], extra: &[&str]) -> Pairing {
        let stderr = home.with_extension("pair.err");
        let mut child = Command::new(bin())
            .arg("--home")
            .arg(home)
            .args(command)
            .args(["--listen", "/ip4/127.0.0.1/tcp/0", "--sync-timeout", "30s"])
            .args(extra)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&stderr).unwrap())
            .spawn()
            .expect("spawn nuwa-node pair");
        let mut out = BufReader::new(child.stdout.take().unwrap());
        let mut code = None;
        let mut line = String::new();
        while out.read_line(&mut line).unwrap() > 0 {
            if let Some(c) = line.trim().strip_prefix("pairing code: ") {
                code = Some(c.to_owned());
                break;
            }
            line.clear();
        }
        // Keep draining stdout so the child never blocks on a full pipe.
        std::thread::spawn(move || {
            let mut sink = String::new();
            while out.read_line(&mut sink).unwrap_or(0) > 0 {
                print!("pair> {sink}");
                sink.clear();
            }
        });
        let code = code.unwrap_or_else(|| {
            panic!(
                "pair printed no code:\n{}",
                std::fs::read_to_string(&stderr).unwrap_or_default()
            )
        });
        Pairing {
            child,
            code,
            stderr,
        }
    }

    pub fn stderr(&self) -> String {
        std::fs::read_to_string(&self.stderr).unwrap_or_default()
    }

    pub fn wait_exit(&mut self, timeout: Duration) -> std::process::ExitStatus {
        wait_for("pair to exit", timeout, || self.child.try_wait().unwrap())
    }
}

/// The URL of `path` on the running daemon of `home`, and its token.
fn api_of(home: &Path, path: &str) -> (String, String) {
    let api: Value =
        serde_json::from_slice(&fs::read(home.join("api.json")).expect("api.json")).unwrap();
    let url = format!("{}{path}", api["url"].as_str().unwrap());
    (url, api["token"].as_str().unwrap().to_owned())
}

/// Runs `f` to completion on a fresh single-threaded runtime.
fn block_on<T>(f: impl std::future::Future<Output = T>) -> T {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(f)
}

/// POSTs `body` to `path` on the running daemon of `home`; returns the HTTP
/// status and the JSON reply.
pub fn api_post(home: &Path, path: &str, body: &Value) -> (u16, Value) {
    let (url, token) = api_of(home, path);
    block_on(async {
        let http = reqwest::Client::builder().no_proxy().build().unwrap();
        let resp = http
            .post(&url)
            .bearer_auth(&token)
            .json(body)
            .send()
            .await
            .expect("request");
        let status = resp.status().as_u16();
        (status, resp.json().await.unwrap_or(Value::Null))
    })
}

/// A counter of the daemon's `/metrics` (0 when absent).
pub fn metric(home: &Path, name: &str) -> f64 {
    let (url, token) = api_of(home, "/metrics");
    let text = block_on(async {
        let http = reqwest::Client::builder().no_proxy().build().unwrap();
        http.get(&url)
            .bearer_auth(&token)
            .send()
            .await
            .expect("metrics request")
            .text()
            .await
            .expect("metrics body")
    });
    text.lines()
        .find_map(|l| {
            let (k, v) = l.split_once(' ')?;
            (k == name).then(|| v.trim().parse().ok()).flatten()
        })
        .unwrap_or(0.0)
}

/// A running `nuwa-node rendezvous` and its first listen address.
pub struct Infra {
    pub child: Child,
    pub addr: String,
}

impl Drop for Infra {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub fn start_infra(c: &Cluster) -> Infra {
    let mut child = Command::new(bin())
        .arg("--home")
        .arg(c.home("infra"))
        .args(["rendezvous", "--listen", "/ip4/127.0.0.1/tcp/0"])
        .env("RUST_LOG", "info")
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(c.dir.path().join("infra.log")).unwrap())
        .spawn()
        .expect("spawn nuwa-node rendezvous");
    let stdout = child.stdout.take().unwrap();
    let mut line = String::new();
    BufReader::new(stdout).read_line(&mut line).unwrap();
    let addr = line.trim().to_owned();
    assert!(
        addr.starts_with("/ip4/127.0.0.1/tcp/") && addr.contains("/p2p/"),
        "the rendezvous node prints its address with /p2p/: {addr:?}"
    );
    Infra { child, addr }
}
