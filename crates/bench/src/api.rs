//! A small client for the daemon's local HTTP API (see docs/api.md): puts,
//! the status report, and the server-sent change events.
//!
//! It only speaks to loopback addresses read from `HOME/api.json`; starting
//! and stopping daemons is `node.rs`'s job.

use std::collections::BTreeMap;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use serde::Deserialize;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio::time::Instant as TokioInstant;

/// Change events buffered per watcher before the reader waits for us. Large
/// enough for one event per write of the biggest run; the daemon batches,
/// so real runs stay far below.
const EVENT_BUFFER: usize = 1 << 16;

/// Contents of `HOME/api.json` while a daemon runs.
#[derive(Debug, Clone, Deserialize)]
pub struct ApiFile {
    pub url: String,
    pub token: String,
    pub pid: u32,
}

/// The parts of `GET /v1/status` the benchmark reads.
#[derive(Debug, Clone, Deserialize)]
pub struct Status {
    pub device: Device,
    pub listen_addrs: Vec<String>,
    pub peers: Vec<Peer>,
    #[serde(default)]
    pub counters: BTreeMap<String, u64>,
    #[serde(default)]
    pub containers: Vec<ContainerStatus>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct Device {
    pub peer_id: String,
}

#[derive(Debug, Clone, Deserialize)]
pub struct Peer {
    pub peer_id: String,
}

#[derive(Debug, Clone, Deserialize)]
pub struct ContainerStatus {
    pub name: String,
    pub heads: Vec<String>,
    pub changes: usize,
}

impl Status {
    /// Sorted heads of `container`, empty if this node does not have it.
    pub fn heads(&self, container: &str) -> Vec<String> {
        let mut h = self
            .containers
            .iter()
            .find(|c| c.name == container)
            .map(|c| c.heads.clone())
            .unwrap_or_default();
        h.sort();
        h
    }

    pub fn changes(&self, container: &str) -> usize {
        self.containers
            .iter()
            .find(|c| c.name == container)
            .map_or(0, |c| c.changes)
    }

    pub fn bytes_sent(&self) -> u64 {
        self.counters.get("bytes_sent").copied().unwrap_or(0)
    }
}

#[derive(Deserialize)]
struct PutReply {
    heads: Vec<String>,
}

#[derive(Deserialize)]
struct ChangeData {
    heads: Vec<String>,
}

/// One daemon's API.
#[derive(Clone)]
pub struct Api {
    http: reqwest::Client,
    url: String,
    token: String,
}

impl std::fmt::Debug for Api {
    // The bearer token is a secret: never print it.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Api").field("url", &self.url).finish()
    }
}

impl Api {
    pub fn new(file: &ApiFile) -> Result<Api> {
        Ok(Api {
            // No proxy: every request goes to the daemon on loopback.
            http: reqwest::Client::builder()
                .no_proxy()
                .build()
                .context("cannot build the HTTP client")?,
            url: file.url.clone(),
            token: file.token.clone(),
        })
    }

    async fn check(resp: reqwest::Response, what: &str) -> Result<reqwest::Response> {
        if resp.status().is_success() {
            return Ok(resp);
        }
        let status = resp.status();
        let body = resp.text().await.unwrap_or_default();
        bail!("{what} failed with {status}: {body}")
    }

    /// `POST /v1/state/put`; returns the container's heads once durable.
    pub async fn put(
        &self,
        container: &str,
        key: &str,
        value: serde_json::Value,
    ) -> Result<Vec<String>> {
        let resp = self
            .http
            .post(format!("{}/v1/state/put", self.url))
            .bearer_auth(&self.token)
            .json(&serde_json::json!({"container": container, "key": key, "value": value}))
            .send()
            .await
            .with_context(|| format!("put to {} failed", self.url))?;
        let reply: PutReply = Self::check(resp, "put")
            .await?
            .json()
            .await
            .context("malformed put reply")?;
        Ok(reply.heads)
    }

    /// `POST /v1/state.batch`: applies `ops`; fails unless every one
    /// applied. Returns once they are durable on this node.
    pub async fn batch(&self, ops: &[serde_json::Value]) -> Result<()> {
        let resp = self
            .http
            .post(format!("{}/v1/state.batch", self.url))
            .bearer_auth(&self.token)
            .json(&serde_json::json!({ "ops": ops }))
            .send()
            .await
            .with_context(|| format!("batch to {} failed", self.url))?;
        let reply: serde_json::Value = Self::check(resp, "batch")
            .await?
            .json()
            .await
            .context("malformed batch reply")?;
        if reply["ok"] != serde_json::json!(true) {
            anyhow::bail!("the batch did not apply whole: {reply}");
        }
        Ok(())
    }

    /// `GET /v1/state/get?container=C[&key=K]`: the value under `key`, or
    /// the whole container rendered as JSON.
    pub async fn get(&self, container: &str, key: Option<&str>) -> Result<serde_json::Value> {
        let bytes = self.get_raw(container, key).await?;
        serde_json::from_slice(&bytes).context("malformed get reply")
    }

    /// Like [`Api::get`], the answer's bytes unparsed.
    pub async fn get_raw(&self, container: &str, key: Option<&str>) -> Result<Vec<u8>> {
        let mut q = vec![("container", container)];
        if let Some(k) = key {
            q.push(("key", k));
        }
        let resp = self
            .http
            .get(format!("{}/v1/state/get", self.url))
            .query(&q)
            .bearer_auth(&self.token)
            .send()
            .await
            .with_context(|| format!("get from {} failed", self.url))?;
        Self::check(resp, "get")
            .await?
            .bytes()
            .await
            .map(|b| b.to_vec())
            .context("get reply cut short")
    }

    /// `GET /v1/status`.
    pub async fn status(&self) -> Result<Status> {
        let resp = self
            .http
            .get(format!("{}/v1/status", self.url))
            .bearer_auth(&self.token)
            .send()
            .await
            .with_context(|| format!("status from {} failed", self.url))?;
        Self::check(resp, "status")
            .await?
            .json()
            .await
            .context("malformed status reply")
    }

    /// The longest turn of the daemon's loop since it started, in ms, from
    /// `GET /metrics` (`nuwa_loop_turn_longest_us`).
    pub async fn longest_turn_ms(&self) -> Result<f64> {
        let resp = self
            .http
            .get(format!("{}/metrics", self.url))
            .bearer_auth(&self.token)
            .send()
            .await
            .with_context(|| format!("metrics from {} failed", self.url))?;
        let text = Self::check(resp, "metrics").await?.text().await?;
        longest_turn_us(&text)
            .map(|us| us / 1e3)
            .context("no nuwa_loop_turn_longest_us in /metrics")
    }

    /// Subscribes to `GET /v1/state.events?container=C` and returns once the
    /// daemon said `ready`, so no later change is missed.
    pub async fn watch(&self, container: &str) -> Result<Watcher> {
        let resp = self
            .http
            .get(format!("{}/v1/state.events", self.url))
            .query(&[("container", container)])
            .bearer_auth(&self.token)
            .send()
            .await
            .with_context(|| format!("events from {} failed", self.url))?;
        let mut resp = Self::check(resp, "events").await?;
        let (tx, mut rx) = mpsc::channel(EVENT_BUFFER);
        let task = tokio::spawn(async move {
            let mut parser = SseParser::default();
            while let Ok(Some(chunk)) = resp.chunk().await {
                // Stamp arrival before parsing: that is when the change reached us.
                let at = Instant::now();
                for (kind, data) in parser.feed(&chunk) {
                    if tx.send(Event { kind, data, at }).await.is_err() {
                        return;
                    }
                }
            }
        });
        let mut w = Watcher { rx: None, task };
        let deadline = TokioInstant::now() + std::time::Duration::from_secs(10);
        loop {
            match tokio::time::timeout_at(deadline, rx.recv()).await {
                Ok(Some(ev)) if ev.kind == "ready" => break,
                Ok(Some(_)) => {}
                Ok(None) => bail!("the event stream of {} closed before `ready`", self.url),
                Err(_) => bail!("no `ready` event from {} within 10 s", self.url),
            }
        }
        w.rx = Some(rx);
        Ok(w)
    }
}

/// One server-sent event, stamped when its bytes arrived.
#[derive(Debug, Clone)]
pub struct Event {
    pub kind: String,
    pub data: String,
    pub at: Instant,
}

/// A subscription to one daemon's change events.
pub struct Watcher {
    rx: Option<mpsc::Receiver<Event>>,
    task: JoinHandle<()>,
}

impl Drop for Watcher {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Watcher {
    /// Waits for the first change event whose heads include every one of
    /// `want`, and returns when it arrived. Earlier events are consumed.
    ///
    /// Cancel safety: cancelling loses at most the event being examined.
    pub async fn wait_heads(&mut self, want: &[String], deadline: TokioInstant) -> Result<Instant> {
        let Some(rx) = self.rx.as_mut() else {
            bail!("watcher is not subscribed");
        };
        loop {
            let ev = match tokio::time::timeout_at(deadline, rx.recv()).await {
                Ok(Some(ev)) => ev,
                Ok(None) => bail!("the event stream closed"),
                Err(_) => bail!("timed out waiting for heads {want:?}"),
            };
            match ev.kind.as_str() {
                "change" => {
                    let data: ChangeData = serde_json::from_str(&ev.data)
                        .with_context(|| format!("malformed change event {:?}", ev.data))?;
                    if want.iter().all(|h| data.heads.contains(h)) {
                        return Ok(ev.at);
                    }
                }
                "lagged" => bail!("the event stream lagged ({} events lost)", ev.data),
                _ => {}
            }
        }
    }
}

/// Incremental parser of the `text/event-stream` format: `event:` and
/// `data:` lines, a blank line ends an event. Comments (keep-alives) are
/// skipped.
#[derive(Default)]
struct SseParser {
    buf: Vec<u8>,
    kind: String,
    data: String,
}

impl SseParser {
    fn feed(&mut self, bytes: &[u8]) -> Vec<(String, String)> {
        self.buf.extend_from_slice(bytes);
        let mut out = Vec::new();
        while let Some(pos) = self.buf.iter().position(|&b| b == b'\n') {
            let line: Vec<u8> = self.buf.drain(..=pos).collect();
            let line = String::from_utf8_lossy(&line);
            let line = line.trim_end_matches(['\n', '\r']);
            if line.is_empty() {
                if !self.kind.is_empty() || !self.data.is_empty() {
                    let kind = if self.kind.is_empty() {
                        "message".to_owned()
                    } else {
                        std::mem::take(&mut self.kind)
                    };
                    out.push((kind, std::mem::take(&mut self.data)));
                }
            } else if let Some(v) = line.strip_prefix("event:") {
                self.kind = v.trim_start().to_owned();
            } else if let Some(v) = line.strip_prefix("data:") {
                if !self.data.is_empty() {
                    self.data.push('\n');
                }
                self.data.push_str(v.strip_prefix(' ').unwrap_or(v));
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // Goal: events split across chunks at any byte come out whole and in
    // order; keep-alive comments are ignored.
    #[test]
    fn sse_parser_reassembles_events() {
        let stream = b"event: ready\ndata: {}\n\n:keep-alive\n\nevent: change\r\ndata: {\"heads\":[\"ab\"]}\r\n\r\n";
        for split in 0..stream.len() {
            let mut p = SseParser::default();
            let mut got = p.feed(&stream[..split]);
            got.extend(p.feed(&stream[split..]));
            assert_eq!(
                got,
                vec![
                    ("ready".to_owned(), "{}".to_owned()),
                    ("change".to_owned(), "{\"heads\":[\"ab\"]}".to_owned()),
                ],
                "split at {split}"
            );
        }
    }
}

/// The value of `nuwa_loop_turn_longest_us` in OpenMetrics text.
fn longest_turn_us(text: &str) -> Option<f64> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .find_map(|l| l.strip_prefix("nuwa_loop_turn_longest_us"))
        .and_then(|rest| rest.split_whitespace().last())
        .and_then(|v| v.parse().ok())
}

#[cfg(test)]
mod metrics_tests {
    // Goal: the gauge is read from the metrics text, labels or not.
    #[test]
    fn the_longest_turn_is_read_from_metrics() {
        let text = "# HELP nuwa_loop_turn_longest_us x\n# TYPE nuwa_loop_turn_longest_us gauge\nnuwa_loop_turn_longest_us 51234\n";
        assert_eq!(super::longest_turn_us(text), Some(51234.0));
        assert_eq!(super::longest_turn_us("nuwa_other 1\n"), None);
    }
}
