//! The API's connection guard: HTTP/1.1 over hyper with a cap on open
//! connections, a header-read timeout and an idle timeout.
//!
//! It serves any [`Accept`]: the loopback TCP listener, and on unix the
//! local socket (`api/socket.rs`), whose connections are admitted by the
//! peer's uid and whose requests carry [`LocalSocket`]. Each listener has
//! its own table and cap, so a flood on one cannot close the other's
//! connections.
//!
//! - **Cap.** At most [`Limits::max_connections`] are open. A new
//!   connection at the cap closes the connection that has been idle the
//!   longest (no authorised request in flight, no response streaming), so
//!   idle sockets can never lock out a client with work to do. Only the
//!   token, the socket or an app's verified signature make work, so a
//!   stranger cannot pin a connection. When every open connection is
//!   busy, the new one is refused (closed at once) and counted.
//! - **Header-read timeout.** A client must send a request's headers within
//!   [`Limits::header_read_timeout`] of the request's first byte
//!   (slow-loris). The clock starts at that byte, not when the connection
//!   starts waiting: hyper's own header timeout starts on an idle
//!   keep-alive connection too, and closed it after 10 s where the idle
//!   timeout promises 60 (issue 25), so the guard keeps this clock itself.
//! - **Idle timeout.** A connection with no request in flight for
//!   [`Limits::idle_timeout`] is closed.
//!
//! The bearer token is checked by a layer of the router before any body is
//! read, so an unauthenticated client can hold at most one small buffer of
//! headers per connection.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use crate::metrics::{Event, Metrics};

/// Whether a request is work the guard must not interrupt (the caller
/// says: an authorised one, by its bearer token or [`LocalSocket`] mark).
/// Other requests keep their connection evictable, so a client without
/// the token cannot pin connections.
pub(super) type IsWork =
    Arc<dyn Fn(&axum::http::HeaderMap, &axum::http::Extensions) -> bool + Send + Sync>;

/// On a response: its request was work (an app's, admitted by its
/// signature after [`IsWork`] was asked), so its body keeps the connection.
#[derive(Debug, Clone, Copy)]
pub(super) struct Work;

/// Marks a request that arrived on the local Unix socket, whose peer runs
/// as the daemon's own user (checked when the connection was accepted).
/// Only [`run`] inserts it, and only for an [`Accept`] whose `LOCAL_SOCKET`
/// is true: a request extension is not on the wire, so no TCP client can
/// set it.
#[derive(Debug, Clone, Copy)]
pub(super) struct LocalSocket;

/// A listener the guard serves.
pub(super) trait Accept: Send + 'static {
    type Io: AsyncRead + AsyncWrite + Unpin + Send + 'static;
    /// Whether this is the local socket (its requests get [`LocalSocket`]).
    const LOCAL_SOCKET: bool;
    /// The next connection to serve; `Ok(None)` when one was accepted and
    /// refused (the implementation counts and logs it).
    ///
    /// Cancel safety: cancel safe (it awaits only the listener's own
    /// `accept`, which is cancel safe).
    fn accept(
        &mut self,
        metrics: &Metrics,
    ) -> impl Future<Output = std::io::Result<Option<Self::Io>>> + Send;
}

impl Accept for TcpListener {
    type Io = tokio::net::TcpStream;
    const LOCAL_SOCKET: bool = false;

    async fn accept(&mut self, _: &Metrics) -> std::io::Result<Option<Self::Io>> {
        let (stream, _) = TcpListener::accept(self).await?;
        // Small replies and event-stream chunks must not wait for the
        // client's delayed ACK (Nagle's algorithm held a change event for
        // about 40 ms after an idle spell).
        if let Err(e) = stream.set_nodelay(true) {
            debug!(error = %e, "cannot set TCP_NODELAY on an API connection");
        }
        Ok(Some(stream))
    }
}

/// Connection limits of the local API.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub max_connections: usize,
    pub header_read_timeout: Duration,
    pub idle_timeout: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_connections: 256,
            header_read_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(60),
        }
    }
}

/// Largest buffer for a request's headers.
const MAX_HEADER_BYTES: usize = 64 * 1024;
/// How long a connection may take to finish its response once asked to
/// close (at shutdown or eviction) before it is dropped.
const CLOSE_GRACE: Duration = Duration::from_secs(2);

/// What the guard knows of one open connection.
struct Conn {
    /// Requests in flight, including responses still streaming.
    busy: Arc<AtomicUsize>,
    /// Milliseconds since `epoch` of the last activity.
    last_active: Arc<AtomicU64>,
    close: watch::Sender<bool>,
}

#[derive(Default)]
struct Table {
    next_id: u64,
    open: BTreeMap<u64, Conn>,
}

fn ms_since(epoch: Instant) -> u64 {
    epoch.elapsed().as_millis() as u64
}

/// Accepts and serves connections until `cancel`.
pub(super) async fn run<L: Accept>(
    mut listener: L,
    app: Router,
    limits: Limits,
    is_work: IsWork,
    metrics: Arc<Metrics>,
    cancel: CancellationToken,
) {
    let epoch = Instant::now();
    let table = Arc::new(Mutex::new(Table::default()));
    loop {
        let accepted = tokio::select! {
            _ = cancel.cancelled() => break,
            a = listener.accept(&metrics) => a,
        };
        let stream = match accepted {
            Ok(Some(stream)) => stream,
            Ok(None) => continue,
            Err(e) => {
                // Out of file handles, most likely: wait a little rather
                // than spin, and let idle timeouts free some.
                warn!(error = %e, "API accept failed");
                tokio::select! {
                    _ = cancel.cancelled() => break,
                    _ = tokio::time::sleep(Duration::from_millis(100)) => {}
                }
                continue;
            }
        };
        let (id, conn) = {
            let mut t = table.lock().unwrap_or_else(|p| p.into_inner());
            if t.open.len() >= limits.max_connections {
                let idlest = t
                    .open
                    .iter()
                    .filter(|(_, c)| c.busy.load(Ordering::Acquire) == 0)
                    .min_by_key(|(_, c)| c.last_active.load(Ordering::Acquire))
                    .map(|(id, _)| *id);
                match idlest.and_then(|id| t.open.remove(&id)) {
                    Some(old) => {
                        let _ = old.close.send(true);
                        metrics.inc(Event::ApiConnectionsEvicted);
                    }
                    None => {
                        metrics.inc(Event::ApiConnectionsRefused);
                        debug!("API connection refused: every open connection is busy");
                        continue; // drops `stream`
                    }
                }
            }
            let id = t.next_id;
            t.next_id += 1;
            let (close, _) = watch::channel(false);
            let conn = Conn {
                busy: Arc::new(AtomicUsize::new(0)),
                last_active: Arc::new(AtomicU64::new(ms_since(epoch))),
                close,
            };
            let handle = (
                conn.busy.clone(),
                conn.last_active.clone(),
                conn.close.subscribe(),
            );
            t.open.insert(id, conn);
            (id, handle)
        };
        let app = app.clone();
        let is_work = is_work.clone();
        let table = table.clone();
        let metrics = metrics.clone();
        let cancel = cancel.clone();
        tokio::spawn(async move {
            serve_one(
                stream,
                L::LOCAL_SOCKET,
                app,
                limits,
                is_work,
                conn,
                epoch,
                &metrics,
                cancel,
            )
            .await;
            table
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .open
                .remove(&id);
        });
    }
}

#[allow(clippy::too_many_arguments)]
async fn serve_one(
    stream: impl AsyncRead + AsyncWrite + Unpin + Send + 'static,
    local_socket: bool,
    app: Router,
    limits: Limits,
    is_work: IsWork,
    (busy, last_active, mut close): (Arc<AtomicUsize>, Arc<AtomicU64>, watch::Receiver<bool>),
    epoch: Instant,
    metrics: &Metrics,
    cancel: CancellationToken,
) {
    // Milliseconds since `epoch` (+1, so that 0 means none) at which the
    // first byte of a request whose headers have not all come arrived.
    let head_started = Arc::new(AtomicU64::new(0));
    let service = {
        let busy = busy.clone();
        let last_active = last_active.clone();
        let head_started = head_started.clone();
        hyper::service::service_fn(move |mut req: hyper::Request<hyper::body::Incoming>| {
            head_started.store(0, Ordering::Release);
            last_active.store(ms_since(epoch), Ordering::Release);
            if local_socket {
                req.extensions_mut().insert(LocalSocket);
            }
            let guard = is_work(req.headers(), req.extensions())
                .then(|| BusyGuard::new(busy.clone(), last_active.clone(), epoch));
            let (mut app, busy, last_active) = (app.clone(), busy.clone(), last_active.clone());
            async move {
                use tower::Service as _;
                let response = app.call(req.map(axum::body::Body::new)).await?;
                // An app's request is work once its signature checked out (a
                // mark on its response): its event stream lives while read.
                let guard = guard.or_else(|| {
                    let work = response.extensions().get::<Work>();
                    work.map(|_| BusyGuard::new(busy, last_active, epoch))
                });
                // Busy until the whole body is sent (a streamed response
                // such as state.events keeps the connection busy).
                Ok::<_, std::convert::Infallible>(response.map(|b| {
                    axum::body::Body::new(Guarded {
                        inner: b,
                        _guard: guard,
                    })
                }))
            }
        })
    };
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(None)
        .max_buf_size(MAX_HEADER_BYTES);
    let head_begun = Arc::new(tokio::sync::Notify::new());
    let stream = FirstByte {
        inner: stream,
        head_started: head_started.clone(),
        head_begun: head_begun.clone(),
        epoch,
    };
    let conn = builder.serve_connection(TokioIo::new(stream), service);
    tokio::pin!(conn);
    let idle = limits.idle_timeout;
    let head_limit = limits.header_read_timeout.as_millis() as u64;
    loop {
        let now = ms_since(epoch);
        let idle_for =
            Duration::from_millis(now.saturating_sub(last_active.load(Ordering::Acquire)));
        let mut wait = idle.saturating_sub(idle_for);
        let started = head_started.load(Ordering::Acquire);
        if started != 0 {
            let head_for = now.saturating_sub(started - 1);
            if head_for >= head_limit {
                metrics.inc(Event::ApiHeaderTimeouts);
                debug!("API connection closed: a request's headers took too long");
                return;
            }
            wait = wait.min(Duration::from_millis(head_limit - head_for));
        }
        tokio::select! {
            r = conn.as_mut() => {
                if let Err(e) = r {
                    debug!(error = %e, "API connection ended");
                }
                return;
            }
            _ = close.changed() => break,
            _ = cancel.cancelled() => break,
            // A request's first byte started the header clock: wait again,
            // with its deadline.
            _ = head_begun.notified() => {}
            _ = tokio::time::sleep(wait) => {
                let idle_for = ms_since(epoch).saturating_sub(last_active.load(Ordering::Acquire));
                if busy.load(Ordering::Acquire) == 0 && idle_for >= idle.as_millis() as u64 {
                    metrics.inc(Event::ApiConnectionsIdleClosed);
                    break;
                }
            }
        }
    }
    conn.as_mut().graceful_shutdown();
    let _ = tokio::time::timeout(CLOSE_GRACE, conn).await;
}

/// Marks a connection busy from a request's arrival until its response
/// body is dropped.
struct BusyGuard {
    busy: Arc<AtomicUsize>,
    last_active: Arc<AtomicU64>,
    epoch: Instant,
}

impl BusyGuard {
    fn new(busy: Arc<AtomicUsize>, last_active: Arc<AtomicU64>, epoch: Instant) -> Self {
        busy.fetch_add(1, Ordering::AcqRel);
        last_active.store(ms_since(epoch), Ordering::Release);
        BusyGuard {
            busy,
            last_active,
            epoch,
        }
    }
}

impl Drop for BusyGuard {
    fn drop(&mut self) {
        self.last_active
            .store(ms_since(self.epoch), Ordering::Release);
        self.busy.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A response body that holds a [`BusyGuard`] (for work) until it is done.
struct Guarded {
    inner: axum::body::Body,
    _guard: Option<BusyGuard>,
}

impl http_body::Body for Guarded {
    type Data = axum::body::Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        std::pin::Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

/// The connection's stream, noting when the first byte of a request
/// arrives (see the header-read timeout in the module docs). Every read
/// that brings bytes while no request head is pending starts the clock;
/// the service stops it when the head is complete.
struct FirstByte<S> {
    inner: S,
    head_started: Arc<AtomicU64>,
    head_begun: Arc<tokio::sync::Notify>,
    epoch: Instant,
}

impl<S: AsyncRead + Unpin> AsyncRead for FirstByte<S> {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let polled = std::pin::Pin::new(&mut self.inner).poll_read(cx, buf);
        if buf.filled().len() > before {
            let now = ms_since(self.epoch) + 1;
            if self
                .head_started
                .compare_exchange(0, now, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
            {
                self.head_begun.notify_one();
            }
        }
        polled
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for FirstByte<S> {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        std::pin::Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}
