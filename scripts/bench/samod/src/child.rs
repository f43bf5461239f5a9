//! One node: a process holding one samod `Repo` with file-system storage,
//! driven by the coordinator over stdin/stdout, one JSON object per line.
//!
//! Requests are `{"id": n, "cmd": "...", "args": {...}}`; every request gets
//! one reply `{"id": n, "ok": true, "result": {...}}` or `{"id": n, "ok":
//! false, "error": "..."}`. Unsolicited lines are events: `{"event": "up"}`
//! once at start, and `{"event": "seen", "key": K, "t_ms": T}` when a watched
//! key first appears in the document.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context as TaskContext, Poll};
use std::time::Duration;

use anyhow::{Context, Result, anyhow, bail};
use automerge::transaction::Transactable;
use automerge::{Automerge, ROOT, ReadDoc, ScalarValue};
use futures::StreamExt;
use samod::storage::TokioFilesystemStorage;
use samod::{BackoffConfig, DialerHandle, DocHandle, DocumentId, PeerId, Repo};
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, AsyncRead, AsyncWrite, BufReader, ReadBuf};

use crate::{now_ms, value_for};

/// Counts the bytes that pass through a stream: node 0 wraps every accepted
/// TCP connection in one before handing it to samod, so the counters hold
/// the TCP payload (samod's 4-byte length prefix plus each message).
struct Counted<S> {
    inner: S,
    sent: Arc<AtomicU64>,
    recv: Arc<AtomicU64>,
}

impl<S: AsyncRead + Unpin> AsyncRead for Counted<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut TaskContext<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let r = Pin::new(&mut self.inner).poll_read(cx, buf);
        if let Poll::Ready(Ok(())) = r {
            let n = buf.filled().len() - before;
            self.recv.fetch_add(n as u64, Ordering::Relaxed);
        }
        r
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Counted<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut TaskContext<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        let r = Pin::new(&mut self.inner).poll_write(cx, buf);
        if let Poll::Ready(Ok(n)) = r {
            self.sent.fetch_add(n as u64, Ordering::Relaxed);
        }
        r
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut TaskContext<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(
        mut self: Pin<&mut Self>,
        cx: &mut TaskContext<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// The heads the document had after the last change event, and when.
struct Heads {
    current: Vec<String>,
    changed_ms: f64,
    waiters: Vec<(Vec<String>, tokio::sync::oneshot::Sender<f64>)>,
}

#[derive(Default)]
struct State {
    repo: Mutex<Option<Repo>>,
    dialer: Mutex<Option<DialerHandle>>,
    handle: Mutex<Option<DocHandle>>,
    dir: Mutex<Option<PathBuf>>,
    sent: Arc<AtomicU64>,
    recv: Arc<AtomicU64>,
    heads: Arc<Mutex<Option<Heads>>>,
    watched: Arc<Mutex<HashSet<String>>>,
}

fn emit(v: &Value) {
    // Stdout is line-buffered, and one `println!` holds its lock for the
    // whole line, so concurrent replies never interleave.
    println!("{v}");
}

fn sorted_hex(heads: &[automerge::ChangeHash]) -> Vec<String> {
    let mut v: Vec<String> = heads.iter().map(ToString::to_string).collect();
    v.sort();
    v
}

fn heads_arg(args: &Value) -> Result<Vec<String>> {
    let mut v: Vec<String> = serde_json::from_value(args["heads"].clone())
        .context("argument heads must be a list of hashes")?;
    v.sort();
    Ok(v)
}

fn str_arg<'a>(args: &'a Value, name: &str) -> Result<&'a str> {
    args[name]
        .as_str()
        .ok_or_else(|| anyhow!("argument {name} must be a string"))
}

fn u64_arg(args: &Value, name: &str) -> Result<u64> {
    args[name]
        .as_u64()
        .ok_or_else(|| anyhow!("argument {name} must be a non-negative integer"))
}

fn rss_bytes() -> Result<u64> {
    let statm =
        std::fs::read_to_string("/proc/self/statm").context("cannot read /proc/self/statm")?;
    let pages: u64 = statm
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| anyhow!("unexpected /proc/self/statm: {statm}"))?;
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    Ok(pages * u64::try_from(page).unwrap_or(4096))
}

/// Total size and number of files under `dir`.
fn dir_usage(dir: &Path) -> (u64, u64) {
    let mut bytes = 0;
    let mut files = 0;
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(rd) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in rd.flatten() {
            match e.metadata() {
                Ok(m) if m.is_dir() => stack.push(e.path()),
                Ok(m) => {
                    bytes += m.len();
                    files += 1;
                }
                Err(_) => {}
            }
        }
    }
    (bytes, files)
}

/// Runs Automerge's save, load and sync paths once on a small in-memory
/// document, as bench.mjs does before its headline cold sync. Native code
/// has no JIT to warm; this only keeps the two procedures alike.
fn warm_up_automerge() -> Result<()> {
    use automerge::sync::{State as SyncState, SyncDoc};
    let mut doc = Automerge::new();
    for i in 0..2000 {
        doc.transact::<_, _, automerge::AutomergeError>(|tx| {
            tx.put(ROOT, format!("w_{i}"), value_for(i))?;
            Ok(())
        })
        .map_err(|f| anyhow!("warm-up put: {}", f.error))?;
    }
    let mut source = Automerge::load(&doc.save())?;
    let mut target = Automerge::new();
    let mut ss = SyncState::new();
    let mut ts = SyncState::new();
    for _ in 0..10 {
        let to_source = target.generate_sync_message(&mut ts);
        if let Some(m) = to_source.clone() {
            source.receive_sync_message(&mut ss, m)?;
        }
        let to_target = source.generate_sync_message(&mut ss);
        if let Some(m) = to_target.clone() {
            target.receive_sync_message(&mut ts, m)?;
        }
        if to_source.is_none() && to_target.is_none() {
            break;
        }
    }
    Ok(())
}

impl State {
    fn repo(&self) -> Result<Repo> {
        self.repo
            .lock()
            .unwrap()
            .clone()
            .ok_or_else(|| anyhow!("the repo is not started"))
    }

    fn handle(&self) -> Result<DocHandle> {
        self.handle
            .lock()
            .unwrap()
            .clone()
            .ok_or_else(|| anyhow!("no document is open"))
    }

    async fn load_repo(&self, dir: &str, peer_id: &str) -> Result<Repo> {
        std::fs::create_dir_all(dir).with_context(|| format!("cannot create {dir}"))?;
        let repo = Repo::build_tokio()
            .with_storage(TokioFilesystemStorage::new(dir))
            .with_peer_id(PeerId::from(peer_id))
            .load()
            .await;
        *self.repo.lock().unwrap() = Some(repo.clone());
        *self.dir.lock().unwrap() = Some(PathBuf::from(dir));
        Ok(repo)
    }

    /// Node 0: a TCP listener on 127.0.0.1 whose connections go to samod's
    /// acceptor through the byte counter.
    async fn start_server(&self, dir: &str, peer_id: &str) -> Result<Value> {
        let repo = self.load_repo(dir, peer_id).await?;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .context("cannot listen on 127.0.0.1")?;
        let port = listener.local_addr()?.port();
        let url = samod::Url::parse(&format!("tcp://127.0.0.1:{port}"))?;
        let acceptor = repo
            .make_acceptor(url)
            .map_err(|_| anyhow!("the repo stopped before listening"))?;
        let (sent, recv) = (self.sent.clone(), self.recv.clone());
        tokio::spawn(async move {
            while let Ok((io, _)) = listener.accept().await {
                let io = Counted {
                    inner: io,
                    sent: sent.clone(),
                    recv: recv.clone(),
                };
                if acceptor.accept_tokio_io(io).is_err() {
                    break;
                }
            }
        });
        Ok(json!({ "port": port }))
    }

    /// Every other node: samod's own TCP dialer to node 0.
    async fn start_client(&self, dir: &str, peer_id: &str, port: u64) -> Result<()> {
        let repo = self.load_repo(dir, peer_id).await?;
        let url = samod::Url::parse(&format!("tcp://127.0.0.1:{port}"))?;
        let dialer = repo
            .dial_tcp(url, BackoffConfig::default())
            .map_err(|e| anyhow!("cannot dial node 0: {e}"))?;
        *self.dialer.lock().unwrap() = Some(dialer);
        Ok(())
    }

    /// Makes `handle` the node's document and follows its change events.
    fn attach(&self, handle: DocHandle) {
        // Listen first, then read the heads: every later change has an event.
        let mut changes = handle.changes();
        let current = handle.with_document(|d| sorted_hex(&d.get_heads()));
        *self.heads.lock().unwrap() = Some(Heads {
            current,
            changed_ms: now_ms(),
            waiters: Vec::new(),
        });
        *self.handle.lock().unwrap() = Some(handle.clone());
        let heads = self.heads.clone();
        let watched = self.watched.clone();
        tokio::spawn(async move {
            while let Some(ev) = changes.next().await {
                let t = now_ms();
                let now = sorted_hex(&ev.new_heads);
                {
                    let mut g = heads.lock().unwrap();
                    if let Some(h) = g.as_mut() {
                        h.current = now;
                        h.changed_ms = t;
                        let waiters = std::mem::take(&mut h.waiters);
                        for (want, tx) in waiters {
                            if want == h.current {
                                let _ = tx.send(t);
                            } else {
                                h.waiters.push((want, tx));
                            }
                        }
                    }
                }
                let keys: Vec<String> = watched.lock().unwrap().iter().cloned().collect();
                if keys.is_empty() {
                    continue;
                }
                let found: Vec<String> = handle.with_document(|d| {
                    keys.into_iter()
                        .filter(|k| matches!(d.get(ROOT, k.as_str()), Ok(Some(_))))
                        .collect()
                });
                for k in found {
                    watched.lock().unwrap().remove(&k);
                    emit(&json!({ "event": "seen", "key": k, "t_ms": t }));
                }
            }
        });
    }

    async fn find(&self, doc_id: &str, timeout_ms: u64) -> Result<()> {
        let deadline = Duration::from_millis(timeout_ms);
        let id: DocumentId = doc_id
            .parse()
            .map_err(|e| anyhow!("bad document id {doc_id}: {e:?}"))?;
        let dialer = self.dialer.lock().unwrap().clone();
        let repo = self.repo()?;
        let found = tokio::time::timeout(deadline, async {
            if let Some(d) = dialer {
                d.established()
                    .await
                    .map_err(|e| anyhow!("cannot connect to node 0: {e:?}"))?;
            }
            repo.find(id)
                .await
                .map_err(|_| anyhow!("the repo stopped during find"))
        })
        .await
        .map_err(|_| anyhow!("no document from node 0 within {timeout_ms} ms"))??;
        let handle = found.ok_or_else(|| anyhow!("node 0 does not have document {doc_id}"))?;
        self.attach(handle);
        Ok(())
    }

    async fn wait_heads(&self, want: Vec<String>, timeout_ms: u64) -> Result<f64> {
        let rx = {
            let mut g = self.heads.lock().unwrap();
            let h = g.as_mut().ok_or_else(|| anyhow!("no document is open"))?;
            if h.current == want {
                return Ok(h.changed_ms);
            }
            let (tx, rx) = tokio::sync::oneshot::channel();
            h.waiters.push((want, tx));
            rx
        };
        match tokio::time::timeout(Duration::from_millis(timeout_ms), rx).await {
            Ok(Ok(t)) => Ok(t),
            Ok(Err(_)) => bail!("the heads watcher stopped"),
            Err(_) => {
                let have = self
                    .heads
                    .lock()
                    .unwrap()
                    .as_ref()
                    .map(|h| h.current.len())
                    .unwrap_or(0);
                bail!(
                    "heads did not converge within {timeout_ms} ms ({have} head(s) differ from the wanted ones)"
                )
            }
        }
    }

    /// Waits until the storage directory has not changed for 300 ms: samod
    /// has no flush, and writes its files from background tasks.
    async fn flush(&self, timeout_ms: u64) -> Result<()> {
        let dir = self
            .dir
            .lock()
            .unwrap()
            .clone()
            .ok_or_else(|| anyhow!("the repo is not started"))?;
        let start = now_ms();
        let mut last = dir_usage(&dir);
        let mut stable_since = now_ms();
        loop {
            tokio::time::sleep(Duration::from_millis(50)).await;
            let u = dir_usage(&dir);
            if u != last {
                last = u;
                stable_since = now_ms();
            } else if now_ms() - stable_since >= 300.0 {
                return Ok(());
            }
            if now_ms() - start > timeout_ms as f64 {
                bail!(
                    "storage in {} still changing after {timeout_ms} ms",
                    dir.display()
                );
            }
        }
    }

    /// `start`: node 0 listens (role `server`), every other node dials it.
    async fn start(&self, args: &Value) -> Result<Value> {
        let dir = str_arg(args, "dir")?;
        let peer = str_arg(args, "peer_id")?;
        if str_arg(args, "role")? == "server" {
            self.start_server(dir, peer).await
        } else {
            self.start_client(dir, peer, u64_arg(args, "port")?).await?;
            Ok(json!({}))
        }
    }

    /// `create`: a new empty document, made the node's own.
    async fn create(&self) -> Result<Value> {
        let handle = self
            .repo()?
            .create(Automerge::new())
            .await
            .map_err(|_| anyhow!("the repo stopped during create"))?;
        let id = handle.document_id().to_string();
        self.attach(handle);
        Ok(json!({ "doc_id": id }))
    }

    /// `write`: one put of `key` = `value`, in one change.
    fn write(&self, args: &Value) -> Result<Value> {
        let key = str_arg(args, "key")?.to_owned();
        let value = str_arg(args, "value")?.to_owned();
        let handle = self.handle()?;
        let t = now_ms();
        handle
            .with_document(|d| {
                d.transact::<_, _, automerge::AutomergeError>(|tx| {
                    tx.put(ROOT, key.as_str(), value.as_str())?;
                    Ok(())
                })
                .map(|_| ())
                .map_err(|f| f.error.to_string())
            })
            .map_err(|e| anyhow!("put {key}: {e}"))?;
        Ok(json!({ "t_ms": t }))
    }

    /// `write_many`: `count` one-put changes, `per_turn` of them between yields.
    async fn write_many(&self, args: &Value) -> Result<Value> {
        let prefix = str_arg(args, "prefix")?.to_owned();
        let count = u64_arg(args, "count")?;
        let per_turn = u64_arg(args, "per_turn")?.max(1);
        let handle = self.handle()?;
        let t0 = now_ms();
        for i in 0..count {
            let key = format!("{prefix}{i}");
            handle
                .with_document(|d| {
                    d.transact::<_, _, automerge::AutomergeError>(|tx| {
                        tx.put(ROOT, key.as_str(), value_for(i))?;
                        Ok(())
                    })
                    .map(|_| ())
                    .map_err(|f| f.error.to_string())
                })
                .map_err(|e| anyhow!("put {key}: {e}"))?;
            if (i + 1) % per_turn == 0 {
                // Lets samod's connection tasks run between turns.
                tokio::task::yield_now().await;
            }
        }
        let t1 = now_ms();
        let heads = handle.with_document(|d| sorted_hex(&d.get_heads()));
        Ok(json!({ "t_start_ms": t0, "t_end_ms": t1, "heads": heads }))
    }

    /// `write_batches`: `count` items k{i} = i, `per_batch` puts per change.
    async fn write_batches(&self, args: &Value) -> Result<Value> {
        let count = u64_arg(args, "count")?;
        let per_batch = u64_arg(args, "per_batch")?.max(1);
        let handle = self.handle()?;
        let t0 = now_ms();
        let mut start = 0;
        while start < count {
            let end = (start + per_batch).min(count);
            handle
                .with_document(|d| {
                    d.transact::<_, _, automerge::AutomergeError>(|tx| {
                        for i in start..end {
                            tx.put(ROOT, format!("k{i}"), ScalarValue::Int(i as i64))?;
                        }
                        Ok(())
                    })
                    .map(|_| ())
                    .map_err(|f| f.error.to_string())
                })
                .map_err(|e| anyhow!("batch from k{start}: {e}"))?;
            start = end;
            tokio::task::yield_now().await;
        }
        let t1 = now_ms();
        let heads = handle.with_document(|d| sorted_hex(&d.get_heads()));
        Ok(json!({ "t_start_ms": t0, "t_end_ms": t1, "heads": heads }))
    }

    /// `fill`: `count` one-put changes built on a plain document, handed to
    /// the repo with `Repo::create` (samod's import).
    async fn fill(&self, args: &Value) -> Result<Value> {
        let prefix = str_arg(args, "prefix")?.to_owned();
        let count = u64_arg(args, "count")?;
        let t0 = now_ms();
        let doc = tokio::task::spawn_blocking(move || -> Result<Automerge> {
            let mut doc = Automerge::new();
            for i in 0..count {
                doc.transact::<_, _, automerge::AutomergeError>(|tx| {
                    tx.put(ROOT, format!("{prefix}{i}"), value_for(i))?;
                    Ok(())
                })
                .map_err(|f| anyhow!("fill put {i}: {}", f.error))?;
            }
            Ok(doc)
        })
        .await??;
        let handle = self
            .repo()?
            .create(doc)
            .await
            .map_err(|_| anyhow!("the repo stopped during create"))?;
        let id = handle.document_id().to_string();
        let heads = handle.with_document(|d| sorted_hex(&d.get_heads()));
        self.attach(handle);
        let t1 = now_ms();
        Ok(json!({ "doc_id": id, "heads": heads, "t_start_ms": t0, "t_end_ms": t1 }))
    }

    /// `local_load`: how long loading the document's saved bytes takes here.
    async fn local_load(&self) -> Result<Value> {
        let handle = self.handle()?;
        tokio::task::spawn_blocking(move || -> Result<Value> {
            let bytes = handle.with_document(|d| d.save());
            let t0 = now_ms();
            let doc = Automerge::load(&bytes)?;
            let t1 = now_ms();
            Ok(json!({
                "ms": t1 - t0,
                "saved_bytes": bytes.len(),
                "keys": doc.keys(ROOT).count(),
            }))
        })
        .await?
    }

    /// `cold_sync`: starts as a client, finds the document and waits for its heads.
    async fn cold_sync(&self, args: &Value) -> Result<Value> {
        let timeout_ms = u64_arg(args, "timeout_ms")?;
        let want = heads_arg(args)?;
        if args["warm_up"].as_bool().unwrap_or(false) {
            tokio::task::spawn_blocking(warm_up_automerge).await??;
        }
        let t0 = now_ms();
        self.start_client(
            str_arg(args, "dir")?,
            str_arg(args, "peer_id")?,
            u64_arg(args, "port")?,
        )
        .await?;
        self.find(str_arg(args, "doc_id")?, timeout_ms).await?;
        let left = (timeout_ms as f64 - (now_ms() - t0)).max(1.0) as u64;
        let t1 = self.wait_heads(want, left).await?;
        Ok(json!({ "t_start_ms": t0, "t_done_ms": t1 }))
    }

    /// `stop`: stops the repo, giving it 10 s.
    async fn stop(&self) -> Result<Value> {
        let repo = self.repo.lock().unwrap().take();
        if let Some(repo) = repo {
            let _ = tokio::time::timeout(Duration::from_secs(10), repo.stop()).await;
        }
        Ok(json!({}))
    }

    /// Runs one request of the coordinator and gives its result.
    async fn run(self: &Arc<Self>, cmd: &str, args: &Value) -> Result<Value> {
        match cmd {
            "start" => self.start(args).await,
            "create" => self.create().await,
            "find" => {
                self.find(str_arg(args, "doc_id")?, u64_arg(args, "timeout_ms")?)
                    .await?;
                Ok(json!({}))
            }
            "watch" => {
                self.watched
                    .lock()
                    .unwrap()
                    .insert(str_arg(args, "key")?.to_owned());
                Ok(json!({}))
            }
            "write" => self.write(args),
            "write_many" => self.write_many(args).await,
            "write_batches" => self.write_batches(args).await,
            "fill" => self.fill(args).await,
            "wait_heads" => {
                let t = self
                    .wait_heads(heads_arg(args)?, u64_arg(args, "timeout_ms")?)
                    .await?;
                Ok(json!({ "t_ms": t }))
            }
            "count_keys" => {
                let n = self.handle()?.with_document(|d| d.keys(ROOT).count());
                Ok(json!({ "keys": n }))
            }
            "rss" => Ok(json!({ "rss_bytes": rss_bytes()? })),
            "counters" => Ok(json!({
                "sent_bytes": self.sent.load(Ordering::Relaxed),
                "recv_bytes": self.recv.load(Ordering::Relaxed),
            })),
            "local_load" => self.local_load().await,
            "cold_sync" => self.cold_sync(args).await,
            "flush" => {
                self.flush(u64_arg(args, "timeout_ms")?).await?;
                Ok(json!({}))
            }
            "stop" => self.stop().await,
            other => bail!("unknown command {other}"),
        }
    }
}

pub async fn run() -> Result<()> {
    let state = Arc::new(State::default());
    emit(&json!({ "event": "up", "t_ms": now_ms() }));
    let mut lines = BufReader::new(tokio::io::stdin()).lines();
    while let Some(line) = lines.next_line().await? {
        let msg: Value = match serde_json::from_str(&line) {
            Ok(v) => v,
            Err(e) => {
                eprintln!("child: bad request line ({e}): {line}");
                continue;
            }
        };
        let state = state.clone();
        tokio::spawn(async move {
            let id = msg["id"].clone();
            let cmd = msg["cmd"].as_str().unwrap_or("").to_owned();
            let args = msg.get("args").cloned().unwrap_or(Value::Null);
            match state.run(&cmd, &args).await {
                Ok(result) => emit(&json!({ "id": id, "ok": true, "result": result })),
                Err(e) => emit(&json!({ "id": id, "ok": false, "error": format!("{e:#}") })),
            }
            if cmd == "stop" {
                std::process::exit(0);
            }
        });
    }
    // The coordinator went away: nothing left to do.
    Ok(())
}
