//! The coordinator's side of a node: one child process (this binary with
//! `--child`), commands over its stdin, replies and events from its stdout.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context, Result, anyhow, bail};
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::process::{Child, ChildStdin};
use tokio::sync::oneshot;

use crate::now_ms;

/// Default bound on one command's answer.
pub const CALL_TIMEOUT_MS: u64 = 120_000;

type Pending = Arc<Mutex<HashMap<u64, oneshot::Sender<Result<Value, String>>>>>;
type Seen = Arc<Mutex<HashMap<String, oneshot::Sender<f64>>>>;

pub struct Node {
    pub name: String,
    pub forked_at_ms: f64,
    child: tokio::sync::Mutex<Child>,
    stdin: tokio::sync::Mutex<ChildStdin>,
    next_id: AtomicU64,
    pending: Pending,
    seen: Seen,
    exited: Arc<Mutex<Option<String>>>,
}

impl Node {
    /// Starts the process and waits for its `up` line.
    pub async fn spawn(name: &str) -> Result<Node> {
        let exe = std::env::current_exe().context("cannot find this program's path")?;
        let forked_at_ms = now_ms();
        let mut child = tokio::process::Command::new(exe)
            .arg("--child")
            .arg(name)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(true)
            .spawn()
            .with_context(|| format!("{name}: cannot start the node process"))?;
        let stdin = child.stdin.take().context("no stdin")?;
        let stdout = child.stdout.take().context("no stdout")?;
        let pending: Pending = Arc::default();
        let seen: Seen = Arc::default();
        let exited: Arc<Mutex<Option<String>>> = Arc::default();
        let (up_tx, up_rx) = oneshot::channel::<()>();
        {
            let (pending, seen, exited) = (pending.clone(), seen.clone(), exited.clone());
            let name = name.to_owned();
            tokio::spawn(async move {
                let mut up = Some(up_tx);
                let mut lines = BufReader::new(stdout).lines();
                while let Ok(Some(line)) = lines.next_line().await {
                    let Ok(msg) = serde_json::from_str::<Value>(&line) else {
                        eprintln!("{name}: {line}");
                        continue;
                    };
                    match msg["event"].as_str() {
                        Some("up") => {
                            if let Some(tx) = up.take() {
                                let _ = tx.send(());
                            }
                        }
                        Some("seen") => {
                            let key = msg["key"].as_str().unwrap_or_default();
                            if let Some(tx) = seen.lock().unwrap().remove(key) {
                                let _ = tx.send(msg["t_ms"].as_f64().unwrap_or(f64::NAN));
                            }
                        }
                        _ => {
                            let Some(id) = msg["id"].as_u64() else {
                                continue;
                            };
                            let Some(tx) = pending.lock().unwrap().remove(&id) else {
                                continue;
                            };
                            let r = if msg["ok"].as_bool() == Some(true) {
                                Ok(msg["result"].clone())
                            } else {
                                Err(msg["error"].as_str().unwrap_or("unknown error").to_owned())
                            };
                            let _ = tx.send(r);
                        }
                    }
                }
                *exited.lock().unwrap() = Some(format!("{name} exited"));
                // Dropping the senders fails every waiting call.
                pending.lock().unwrap().clear();
                seen.lock().unwrap().clear();
            });
        }
        let node = Node {
            name: name.to_owned(),
            forked_at_ms,
            child: tokio::sync::Mutex::new(child),
            stdin: tokio::sync::Mutex::new(stdin),
            next_id: AtomicU64::new(1),
            pending,
            seen,
            exited,
        };
        match tokio::time::timeout(Duration::from_secs(30), up_rx).await {
            Ok(Ok(())) => Ok(node),
            Ok(Err(_)) => bail!("{name} exited before it was up"),
            Err(_) => bail!("{name} was not up within 30 s"),
        }
    }

    /// Sends one command and waits at most `timeout_ms` for its reply.
    pub async fn call_t(&self, cmd: &str, args: Value, timeout_ms: u64) -> Result<Value> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        self.pending.lock().unwrap().insert(id, tx);
        let line = format!("{}\n", json!({ "id": id, "cmd": cmd, "args": args }));
        {
            let mut stdin = self.stdin.lock().await;
            if let Err(e) = stdin.write_all(line.as_bytes()).await {
                self.pending.lock().unwrap().remove(&id);
                bail!("{}: cannot send {cmd}: {e}", self.name);
            }
            let _ = stdin.flush().await;
        }
        match tokio::time::timeout(Duration::from_millis(timeout_ms), rx).await {
            Ok(Ok(Ok(v))) => Ok(v),
            Ok(Ok(Err(e))) => bail!("{}: {cmd}: {e}", self.name),
            Ok(Err(_)) => {
                let why = self.exited.lock().unwrap().clone();
                bail!(
                    "{}: {cmd}: {}",
                    self.name,
                    why.unwrap_or_else(|| "no answer".into())
                )
            }
            Err(_) => {
                self.pending.lock().unwrap().remove(&id);
                bail!("{}: {cmd} got no answer within {timeout_ms} ms", self.name)
            }
        }
    }

    pub async fn call(&self, cmd: &str, args: Value) -> Result<Value> {
        self.call_t(cmd, args, CALL_TIMEOUT_MS).await
    }

    /// Registers interest in `key`; the receiver gets the time the child saw it.
    pub async fn watch(&self, key: &str) -> Result<oneshot::Receiver<f64>> {
        let (tx, rx) = oneshot::channel();
        self.seen.lock().unwrap().insert(key.to_owned(), tx);
        self.call("watch", json!({ "key": key })).await?;
        Ok(rx)
    }

    pub async fn stop(&self) {
        let _ = self.call_t("stop", json!({}), 15_000).await;
        let mut child = self.child.lock().await;
        if tokio::time::timeout(Duration::from_secs(5), child.wait())
            .await
            .is_err()
        {
            let _ = child.kill().await;
        }
    }
}

/// A star of `n` nodes around node 0, all holding one new document.
pub struct Cluster {
    pub nodes: Vec<Node>,
}

pub fn node_dir(base: &Path, name: &str) -> PathBuf {
    base.join(name)
}

pub fn as_f64(v: &Value, key: &str) -> Result<f64> {
    v[key]
        .as_f64()
        .ok_or_else(|| anyhow!("reply without number {key}: {v}"))
}

impl Cluster {
    pub async fn start(n: usize, base: &Path, label: &str, timeout_ms: u64) -> Result<Cluster> {
        let spawned = futures::future::join_all((0..n).map(|i| Node::spawn_named(label, i))).await;
        let mut nodes = Vec::with_capacity(n);
        for s in spawned {
            nodes.push(s?);
        }
        let c = Cluster { nodes };
        let r = c.connect(base, timeout_ms).await;
        if let Err(e) = r {
            c.stop().await;
            return Err(e);
        }
        Ok(c)
    }

    async fn connect(&self, base: &Path, timeout_ms: u64) -> Result<()> {
        let n0 = &self.nodes[0];
        let started = n0
            .call(
                "start",
                json!({
                    "role": "server",
                    "dir": node_dir(base, &n0.name),
                    "peer_id": n0.name,
                }),
            )
            .await?;
        let port = started["port"]
            .as_u64()
            .ok_or_else(|| anyhow!("{}: start gave no port", n0.name))?;
        let created = n0.call("create", json!({})).await?;
        let doc_id = created["doc_id"].clone();
        let joins = self.nodes[1..].iter().map(|node| {
            let doc_id = doc_id.clone();
            async move {
                node.call(
                    "start",
                    json!({
                        "role": "client",
                        "dir": node_dir(base, &node.name),
                        "peer_id": node.name,
                        "port": port,
                    }),
                )
                .await?;
                node.call_t(
                    "find",
                    json!({ "doc_id": doc_id, "timeout_ms": timeout_ms }),
                    timeout_ms + 5_000,
                )
                .await
            }
        });
        for r in futures::future::join_all(joins).await {
            r?;
        }
        Ok(())
    }

    pub async fn stop(&self) {
        futures::future::join_all(self.nodes.iter().map(Node::stop)).await;
    }
}

impl Node {
    async fn spawn_named(label: &str, i: usize) -> Result<Node> {
        Node::spawn(&format!("{label}-node{i}")).await
    }
}
