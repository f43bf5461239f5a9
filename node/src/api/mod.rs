//! The daemon's local HTTP+JSON API on a loopback address, guarded by a
//! bearer token kept in `HOME/api.json` (mode 0600).
//!
//! Handlers do no state work themselves: each request becomes an
//! [`ApiRequest`] for the daemon loop, answered through a oneshot channel, so
//! the loop stays the single owner of the engine and the store.
//!
//! Routes:
//! - `GET  /v1/status`
//! - `GET  /v1/devices`
//! - `POST /v1/devices/revoke`  body `{"context_id": C}`
//! - `POST /v1/devices/approve` body `{"code": "ABCD-EFGH", "name": N}` (waits
//!   until the new device is paired or the attempt failed)
//! - `POST /v1/state/put`     body `{"container": C, "key": K, "value": JSON}`
//! - `GET  /v1/state/get?container=C[&key=K]`
//! - `GET  /v1/state/export?container=C`  (Automerge binary)
//!
//! - `GET  /v1/schemas`, `POST /v1/schemas` (body: a JSON Schema with `x-asm`)
//! - `POST /v1/state.create`  `{"schema_uri": S, "object": O, "id": optional}`
//! - `POST /v1/state.update`  `{"schema_uri": S, "id": I, "patch": JSON Patch | {"$inc"|"$push": ...}}`
//! - `POST /v1/state.query`   `{"query": ASM-QL}`
//! - `POST /v1/state.delete`  `{"schema_uri": S, "id": I, "mode": "tombstone" | "hard"}`
//! - `POST /v1/state.describe|state.compact|state.reset` `{"container": S}`
//! - `GET  /v1/state.events[?container=S]`  server-sent events, one `change`
//!   event per durable change batch (local or from peers)
//!
//! Errors are JSON: `{"error": {"code": "...", "message": "..."}}`. See
//! docs/api.md.

use std::net::SocketAddr;
use std::sync::Arc;

use axum::extract::{DefaultBodyLimit, Query, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::{Deserialize, Serialize};
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;

use crate::status::Status;

/// Largest request body accepted.
/// (Above the 32 MiB object limit, so that an oversized object gets the
/// typed `object_too_large` error rather than a bare 413.)
pub const MAX_BODY_BYTES: usize = 40 * 1024 * 1024;

/// Contents of `HOME/api.json`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ApiFile {
    pub url: String,
    pub token: String,
    pub pid: u32,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PutBody {
    pub container: String,
    pub key: String,
    pub value: serde_json::Value,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PutReply {
    pub container: String,
    pub key: String,
    /// Hex change hashes of the container after the write.
    pub heads: Vec<String>,
    pub durable: bool,
}

#[derive(Debug, Deserialize)]
pub struct GetQuery {
    pub container: String,
    pub key: Option<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RevokeBody {
    pub context_id: String,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RevokeReply {
    pub revoked: String,
    /// The key epoch new writes are sealed under from now on.
    pub epoch: u64,
    pub did_log_len: usize,
    /// Context ids of the devices the new sync key was sealed to.
    pub remaining: Vec<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ApproveBody {
    pub code: String,
    #[serde(default)]
    pub name: Option<String>,
    /// Give up after this many seconds (default 60, at most 600).
    #[serde(default)]
    pub timeout_secs: Option<u64>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ApproveReply {
    pub context_id: String,
    pub name: String,
    pub peer_id: String,
    pub did_log_len: usize,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CreateBody {
    pub schema_uri: String,
    pub object: serde_json::Value,
    #[serde(default)]
    pub id: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UpdateBody {
    pub schema_uri: String,
    pub id: String,
    pub patch: serde_json::Value,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct QueryBody {
    pub query: serde_json::Value,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeleteBody {
    pub schema_uri: String,
    pub id: String,
    #[serde(default)]
    pub mode: DeleteMode,
}

#[derive(Debug, Default, Deserialize, Clone, Copy, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum DeleteMode {
    #[default]
    Tombstone,
    Hard,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ContainerBody {
    pub container: String,
}

/// An API error with a stable code.
#[derive(Debug, Clone, Serialize)]
pub struct ApiError {
    #[serde(skip)]
    pub status: u16,
    pub code: &'static str,
    pub message: String,
}

impl ApiError {
    pub fn new(status: u16, code: &'static str, message: impl Into<String>) -> Self {
        ApiError {
            status,
            code,
            message: message.into(),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = StatusCode::from_u16(self.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        (status, Json(serde_json::json!({ "error": self }))).into_response()
    }
}

/// Work for the daemon loop.
pub enum ApiRequest {
    Status(oneshot::Sender<Status>),
    Devices(oneshot::Sender<Vec<crate::devices::DeviceEntry>>),
    Put(PutBody, oneshot::Sender<Result<PutReply, ApiError>>),
    Revoke(RevokeBody, oneshot::Sender<Result<RevokeReply, ApiError>>),
    Approve(ApproveBody, oneshot::Sender<Result<ApproveReply, ApiError>>),
    Tool(
        crate::daemon::Tool,
        oneshot::Sender<Result<serde_json::Value, ApiError>>,
    ),
    Get(
        GetQuery,
        oneshot::Sender<Result<serde_json::Value, ApiError>>,
    ),
    Export(String, oneshot::Sender<Result<Vec<u8>, ApiError>>),
}

#[derive(Clone)]
struct AppState {
    token: Arc<String>,
    tx: mpsc::Sender<ApiRequest>,
    events: tokio::sync::broadcast::Sender<ChangeEvent>,
    metrics: Arc<crate::metrics::Metrics>,
    /// Reads and queries go to the reader, never through the daemon loop.
    reads: crate::daemon::reader::ReaderHandle,
}

/// One durable change batch of a container, for `/v1/state.events`.
#[derive(Debug, Clone, Serialize)]
pub struct ChangeEvent {
    pub container: String,
    /// Changes in the batch.
    pub changes: usize,
    /// Hex heads after the batch.
    pub heads: Vec<String>,
    /// `local` (this device's API) or `peer` (synced in).
    pub origin: &'static str,
    pub at_unix_ms: u64,
}

#[derive(Deserialize)]
struct EventsQuery {
    container: Option<String>,
}

async fn events(
    State(s): State<AppState>,
    headers: HeaderMap,
    Query(q): Query<EventsQuery>,
) -> Result<Response, ApiError> {
    use axum::response::sse::{Event, KeepAlive, Sse};
    authorised(&headers, &s.token)?;
    let rx = s.events.subscribe();
    // `ready` first: a client knows from then on that it misses nothing.
    let ready = futures::stream::once(async {
        Ok::<Event, std::convert::Infallible>(Event::default().event("ready").data("{}"))
    });
    let stream = futures::stream::unfold((rx, q.container), |(mut rx, filter)| async move {
        loop {
            match rx.recv().await {
                Ok(ev) => {
                    if filter.as_ref().is_some_and(|c| *c != ev.container) {
                        continue;
                    }
                    let data = serde_json::to_string(&ev).unwrap_or_default();
                    let item: Result<Event, std::convert::Infallible> =
                        Ok(Event::default().event("change").data(data));
                    return Some((item, (rx, filter)));
                }
                // A slow reader missed events: say so, keep streaming.
                Err(tokio::sync::broadcast::error::RecvError::Lagged(n)) => {
                    let item = Ok(Event::default().event("lagged").data(n.to_string()));
                    return Some((item, (rx, filter)));
                }
                Err(tokio::sync::broadcast::error::RecvError::Closed) => return None,
            }
        }
    });
    use futures::StreamExt as _;
    Ok(Sse::new(ready.chain(stream))
        .keep_alive(KeepAlive::default())
        .into_response())
}

/// `GET /metrics`: the registry as OpenMetrics text.
async fn metrics_text(State(s): State<AppState>, headers: HeaderMap) -> Result<Response, ApiError> {
    authorised(&headers, &s.token)?;
    Ok((
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        s.metrics.encode(),
    )
        .into_response())
}

/// Records every request's latency under its route (the matched pattern,
/// so ids in paths do not make new series).
async fn request_latency(
    State(s): State<AppState>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let route = req
        .extensions()
        .get::<axum::extract::MatchedPath>()
        .map(|p| p.as_str().to_owned())
        .unwrap_or_else(|| "unmatched".to_owned());
    let started = std::time::Instant::now();
    let response = next.run(req).await;
    s.metrics.observe_api_request(&route, started.elapsed());
    response
}

fn authorised(headers: &HeaderMap, token: &str) -> Result<(), ApiError> {
    let given = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .unwrap_or("");
    // Constant-time comparison: the token is a secret.
    let equal = given.len() == token.len()
        && given
            .bytes()
            .zip(token.bytes())
            .fold(0u8, |acc, (a, b)| acc | (a ^ b))
            == 0;
    if equal {
        Ok(())
    } else {
        Err(ApiError::new(
            401,
            "unauthorised",
            "missing or wrong bearer token; use the token in HOME/api.json",
        ))
    }
}

/// Sends a read to the reader and waits for its answer.
async fn read<T>(
    state: &AppState,
    make: impl FnOnce(oneshot::Sender<T>) -> ApiRequest,
) -> Result<T, ApiError> {
    let (tx, rx) = oneshot::channel();
    state.reads.read(make(tx)).await?;
    rx.await
        .map_err(|_| ApiError::new(503, "shutting_down", "the daemon is shutting down"))
}

async fn call<T>(
    state: &AppState,
    make: impl FnOnce(oneshot::Sender<T>) -> ApiRequest,
) -> Result<T, ApiError> {
    let (tx, rx) = oneshot::channel();
    state
        .tx
        .send(make(tx))
        .await
        .map_err(|_| ApiError::new(503, "shutting_down", "the daemon is shutting down"))?;
    rx.await
        .map_err(|_| ApiError::new(503, "shutting_down", "the daemon is shutting down"))
}

async fn status(State(s): State<AppState>, headers: HeaderMap) -> Result<Json<Status>, ApiError> {
    authorised(&headers, &s.token)?;
    Ok(Json(call(&s, ApiRequest::Status).await?))
}

async fn devices(
    State(s): State<AppState>,
    headers: HeaderMap,
) -> Result<Json<Vec<crate::devices::DeviceEntry>>, ApiError> {
    authorised(&headers, &s.token)?;
    Ok(Json(call(&s, ApiRequest::Devices).await?))
}

async fn put(
    State(s): State<AppState>,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> Result<Json<PutReply>, ApiError> {
    authorised(&headers, &s.token)?;
    let body: PutBody = serde_json::from_slice(&body)
        .map_err(|e| ApiError::new(400, "bad_request", format!("invalid put body: {e}")))?;
    Ok(Json(call(&s, |tx| ApiRequest::Put(body, tx)).await??))
}

async fn revoke(
    State(s): State<AppState>,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> Result<Json<RevokeReply>, ApiError> {
    authorised(&headers, &s.token)?;
    let body: RevokeBody = serde_json::from_slice(&body)
        .map_err(|e| ApiError::new(400, "bad_request", format!("invalid revoke body: {e}")))?;
    Ok(Json(call(&s, |tx| ApiRequest::Revoke(body, tx)).await??))
}

async fn approve(
    State(s): State<AppState>,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> Result<Json<ApproveReply>, ApiError> {
    authorised(&headers, &s.token)?;
    let body: ApproveBody = serde_json::from_slice(&body)
        .map_err(|e| ApiError::new(400, "bad_request", format!("invalid approve body: {e}")))?;
    Ok(Json(call(&s, |tx| ApiRequest::Approve(body, tx)).await??))
}

fn json_body<T: serde::de::DeserializeOwned>(body: &[u8], what: &str) -> Result<T, ApiError> {
    serde_json::from_slice(body)
        .map_err(|e| ApiError::new(400, "bad_request", format!("invalid {what} body: {e}")))
}

async fn tool(
    s: &AppState,
    headers: &HeaderMap,
    make: impl FnOnce() -> Result<crate::daemon::Tool, ApiError>,
) -> Result<Json<serde_json::Value>, ApiError> {
    authorised(headers, &s.token)?;
    let t = make()?;
    // Reading tools run on the reader; writing ones on the daemon loop.
    if matches!(
        t,
        crate::daemon::Tool::Query(_) | crate::daemon::Tool::Describe(_)
    ) {
        return Ok(Json(read(s, |tx| ApiRequest::Tool(t, tx)).await??));
    }
    Ok(Json(call(s, |tx| ApiRequest::Tool(t, tx)).await??))
}

async fn schemas_list(
    State(s): State<AppState>,
    headers: HeaderMap,
) -> Result<Json<serde_json::Value>, ApiError> {
    tool(&s, &headers, || Ok(crate::daemon::Tool::SchemaList)).await
}

async fn schemas_add(
    State(s): State<AppState>,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> Result<Json<serde_json::Value>, ApiError> {
    tool(&s, &headers, || {
        Ok(crate::daemon::Tool::SchemaAdd(json_body(&body, "schema")?))
    })
    .await
}

async fn state_create(
    State(s): State<AppState>,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> Result<Json<serde_json::Value>, ApiError> {
    tool(&s, &headers, || {
        let b: CreateBody = json_body(&body, "state.create")?;
        Ok(crate::daemon::Tool::Create {
            schema_uri: b.schema_uri,
            object: b.object,
            id: b.id,
        })
    })
    .await
}

async fn state_update(
    State(s): State<AppState>,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> Result<Json<serde_json::Value>, ApiError> {
    tool(&s, &headers, || {
        let b: UpdateBody = json_body(&body, "state.update")?;
        Ok(crate::daemon::Tool::Update {
            schema_uri: b.schema_uri,
            id: b.id,
            patch: b.patch,
        })
    })
    .await
}

async fn state_query(
    State(s): State<AppState>,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> Result<Json<serde_json::Value>, ApiError> {
    tool(&s, &headers, || {
        let b: QueryBody = json_body(&body, "state.query")?;
        Ok(crate::daemon::Tool::Query(b.query))
    })
    .await
}

async fn state_delete(
    State(s): State<AppState>,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> Result<Json<serde_json::Value>, ApiError> {
    tool(&s, &headers, || {
        let b: DeleteBody = json_body(&body, "state.delete")?;
        Ok(crate::daemon::Tool::Delete {
            schema_uri: b.schema_uri,
            id: b.id,
            hard: b.mode == DeleteMode::Hard,
        })
    })
    .await
}

async fn state_control(
    State(s): State<AppState>,
    headers: HeaderMap,
    axum::extract::Path(op): axum::extract::Path<String>,
    body: axum::body::Bytes,
) -> Result<Json<serde_json::Value>, ApiError> {
    tool(&s, &headers, || {
        let b: ContainerBody = json_body(&body, &op)?;
        match op.as_str() {
            "state.describe" => Ok(crate::daemon::Tool::Describe(b.container)),
            "state.compact" => Ok(crate::daemon::Tool::Compact(b.container)),
            "state.reset" => Ok(crate::daemon::Tool::Reset(b.container)),
            _ => Err(ApiError::new(
                404,
                "not_found",
                "no such endpoint; see docs/api.md",
            )),
        }
    })
    .await
}

async fn get_state(
    State(s): State<AppState>,
    headers: HeaderMap,
    Query(q): Query<GetQuery>,
) -> Result<Json<serde_json::Value>, ApiError> {
    authorised(&headers, &s.token)?;
    Ok(Json(read(&s, |tx| ApiRequest::Get(q, tx)).await??))
}

#[derive(Deserialize)]
struct ExportQuery {
    container: String,
}

async fn export(
    State(s): State<AppState>,
    headers: HeaderMap,
    Query(q): Query<ExportQuery>,
) -> Result<Response, ApiError> {
    authorised(&headers, &s.token)?;
    let bytes = read(&s, |tx| ApiRequest::Export(q.container, tx)).await??;
    Ok(([(header::CONTENT_TYPE, "application/octet-stream")], bytes).into_response())
}

async fn not_found() -> ApiError {
    ApiError::new(404, "not_found", "no such endpoint; see `nuwa-node --help`")
}

/// Binds the API on `addr` and serves until `cancel`. Returns the bound
/// address.
pub async fn serve(
    addr: SocketAddr,
    token: String,
    tx: mpsc::Sender<ApiRequest>,
    reads: crate::daemon::reader::ReaderHandle,
    events_tx: tokio::sync::broadcast::Sender<ChangeEvent>,
    metrics: Arc<crate::metrics::Metrics>,
    cancel: CancellationToken,
) -> anyhow::Result<SocketAddr> {
    let state = AppState {
        token: Arc::new(token),
        tx,
        events: events_tx,
        metrics,
        reads,
    };
    let app = Router::new()
        .route("/v1/status", get(status))
        .route("/v1/devices", get(devices))
        .route("/v1/devices/revoke", post(revoke))
        .route("/v1/devices/approve", post(approve))
        .route("/v1/state/put", post(put))
        .route("/v1/state/get", get(get_state))
        .route("/v1/state/export", get(export))
        .route("/v1/schemas", get(schemas_list).post(schemas_add))
        .route("/v1/state.create", post(state_create))
        .route("/v1/state.update", post(state_update))
        .route("/v1/state.query", post(state_query))
        .route("/v1/state.delete", post(state_delete))
        .route("/v1/state.events", get(events))
        .route("/v1/{op}", post(state_control))
        .route("/metrics", get(metrics_text))
        .fallback(not_found)
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .layer(axum::middleware::from_fn_with_state(
            state.clone(),
            request_latency,
        ))
        .with_state(state);
    let listener = tokio::net::TcpListener::bind(addr).await?;
    let local = listener.local_addr()?;
    tokio::spawn(async move {
        let _ = axum::serve(listener, app)
            .with_graceful_shutdown(cancel.cancelled_owned())
            .await;
    });
    Ok(local)
}
