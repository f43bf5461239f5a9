//! The daemon's local HTTP+JSON API on a loopback address, guarded by a
//! bearer token kept in `HOME/api.json` (mode 0600), and on unix the same
//! API on the socket `HOME/api.sock` (no token: see `socket.rs`).
//!
//! Handlers do no state work: each request becomes an [`ApiRequest`] for
//! the daemon loop (writes, control) or the reader (reads, queries),
//! answered through a oneshot; this module holds only the two queues
//! ([`Lanes`]). Layers, outermost first: the connection guard
//! ([`listener`]), request latency, `Host`/`Origin`
//! ([`page::check_host_and_origin`]), the token or app check (before any
//! body is read), then the route, declared once in [`routes`] (a test
//! holds docs/api.md's table to it). Errors are JSON: `{"error": {"code",
//! "message"}}`.

use std::net::SocketAddr;
use std::sync::Arc;

use axum::extract::{DefaultBodyLimit, FromRequest, FromRequestParts, Request, State};
use axum::http::{StatusCode, header, request::Parts};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::Deserialize;
use serde::de::DeserializeOwned;
use serde_json::Value;
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;
use zeroize::Zeroizing;

mod apps;
mod listener;
mod page;
#[cfg(unix)]
mod socket;
mod wire;

pub use listener::Limits;
pub use page::{LoginLink, Web};
#[cfg(unix)]
pub use socket::{SocketError, SocketFile};
pub use wire::*;

use nuwa_agent::caps::Action;
use nuwa_agent::status::Status;

use apps::{Caller, Refusal};

/// The state every handler takes, and what it answers.
type S = State<AppState>;
type Reply<T> = Result<Json<T>, Failure>;

/// Largest body of `POST /v1/challenge` (a 64-hex-digit nonce in JSON).
const MAX_CHALLENGE_BYTES: usize = 1024;
/// Connections the kernel queues for the API before they are accepted.
const LISTEN_BACKLOG: u32 = 1024;
/// How long the challenge's body may take to arrive.
const CHALLENGE_READ_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

/// Where requests go: the daemon loop owns writes and control, the reader
/// answers reads and queries.
#[derive(Clone)]
pub struct Lanes {
    pub writes: mpsc::Sender<ApiRequest>,
    pub reads: mpsc::Sender<ApiRequest>,
}

/// Change events: an `Arc` makes each of the 1,024 slots 32 bytes, not 104.
pub type ChangeEvents = tokio::sync::broadcast::Sender<Arc<ChangeEvent>>;

/// What the daemon loop feeds the API: change events for
/// `state.events`, and the access view app requests are checked against.
#[derive(Clone)]
pub struct Feeds {
    pub events: ChangeEvents,
    pub access: tokio::sync::watch::Sender<Arc<nuwa_agent::apps::AccessView>>,
}

impl Feeds {
    pub fn new() -> Feeds {
        Feeds {
            events: tokio::sync::broadcast::channel(1024).0,
            access: tokio::sync::watch::channel(Arc::default()).0,
        }
    }
}

impl Default for Feeds {
    fn default() -> Self {
        Feeds::new()
    }
}

#[derive(Clone)]
struct AppState {
    token: Arc<Zeroizing<String>>,
    lanes: Lanes,
    events: ChangeEvents,
    metrics: Arc<crate::metrics::Metrics>,
    /// The status page's login codes and sessions.
    web: Arc<page::Web>,
    /// What app requests are checked against.
    gate: apps::AppGate,
}

impl From<Refusal> for Failure {
    fn from(r: Refusal) -> Self {
        Failure::Refused(r)
    }
}

/// An [`ApiError`] as an HTTP response: the status its code names, and the
/// error as JSON. (The error type is the agent's; this is how the shell
/// answers with it.)
pub(crate) enum Failure {
    Error(ApiError),
    /// An app's request refused: counted by its precise reason.
    Refused(Refusal),
}

impl From<ApiError> for Failure {
    fn from(e: ApiError) -> Self {
        Failure::Error(e)
    }
}

impl IntoResponse for Failure {
    fn into_response(self) -> Response {
        let error = match self {
            Failure::Error(e) => e,
            // Counted here by reason; the latency layer finds no code.
            Failure::Refused(r) => return r.into_response(),
        };
        let status =
            StatusCode::from_u16(error.status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let code = error.code;
        let mut response = (status, Json(serde_json::json!({ "error": error }))).into_response();
        // Seen by the latency layer, which counts errors by code.
        response.extensions_mut().insert(code);
        response
    }
}

/// A request body: read only after the token check, bounded by
/// [`MAX_BODY_BYTES`]; a failure is a JSON error, never a bare status.
struct Body(axum::body::Bytes);

impl<S: Send + Sync> FromRequest<S> for Body {
    type Rejection = Failure;

    async fn from_request(req: Request, state: &S) -> Result<Self, Failure> {
        match axum::body::Bytes::from_request(req, state).await {
            Ok(b) => Ok(Body(b)),
            Err(e) if e.status() == StatusCode::PAYLOAD_TOO_LARGE => {
                Err(Failure::Error(ApiError::new(
                    ErrorCode::BodyTooLarge,
                    format!("the body is over the {MAX_BODY_BYTES}-byte limit"),
                )))
            }
            Err(e) => Err(Failure::Error(ApiError::new(
                ErrorCode::BadRequest,
                format!("cannot read the body: {e}"),
            ))),
        }
    }
}

/// A query string, with JSON errors.
struct Q<T>(T);

impl<T: DeserializeOwned, S: Send + Sync> FromRequestParts<S> for Q<T> {
    type Rejection = Failure;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Failure> {
        axum::extract::Query::<T>::from_request_parts(parts, state)
            .await
            .map(|q| Q(q.0))
            .map_err(|e| Failure::Error(ApiError::new(ErrorCode::BadRequest, e.body_text())))
    }
}

/// Who is calling, as the token layer marked it.
struct Who(Caller);

impl<S: Send + Sync> FromRequestParts<S> for Who {
    type Rejection = Failure;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, Failure> {
        // Every guarded route runs behind the layer that sets it; a route
        // without it is a bug, refused rather than served as the owner.
        parts
            .extensions
            .get::<Caller>()
            .cloned()
            .map(Who)
            .ok_or_else(|| {
                Failure::Error(ApiError::new(
                    ErrorCode::Internal,
                    "the request reached a route without its caller; this is a bug",
                ))
            })
    }
}

fn json_body<T: DeserializeOwned>(body: &[u8], what: &str) -> Result<T, ApiError> {
    serde_json::from_slice(body)
        .map_err(|e| ApiError::new(ErrorCode::BadRequest, format!("invalid {what} body: {e}")))
}

/// Container names are checked here, at the door, so nothing invalid
/// reaches the loop or the store.
fn container_name(name: &str) -> Result<(), ApiError> {
    nuwa_agent::state::check_container_name(name)
        .map_err(|e| ApiError::new(ErrorCode::InvalidContainerName, e.to_string()))
}

/// The bearer-token check, as a layer in front of every route but the
/// challenge and the page's own: it answers before any body is read, and
/// marks who is calling ([`Caller`]): the owner, or an app whose signed
/// invocation checked out (see [`apps`]). A
/// request from the local socket needs no token (its peer's uid was
/// checked on accept). A status-page session (cookie) stands in for the
/// token on the few `GET`s the page makes, never on a request that
/// changes anything.
async fn require_token(
    State(s): State<AppState>,
    mut req: Request,
    next: axum::middleware::Next,
) -> Response {
    if authorised(req.headers(), req.extensions(), &s.token) || page::session_may_read(&s.web, &req)
    {
        req.extensions_mut().insert(Caller::Owner);
        next.run(req).await
    } else if req.headers().contains_key(apps::SIGNATURE_INPUT) {
        // An app of the agent (see `apps`): checked before its body is read.
        match apps::admit_app(&s.gate, req).await {
            Ok(req) => {
                let mut response = next.run(req).await;
                response.extensions_mut().insert(listener::Work);
                response
            }
            Err(refusal) => refusal.into_response(),
        }
    } else {
        Failure::Error(ApiError::new(
            ErrorCode::Unauthorised,
            "missing or wrong bearer token; use the token in HOME/api.json",
        ))
        .into_response()
    }
}

/// Whether a request may reach the guarded routes: it came over the local
/// socket (marked by the listener; no header can set the mark), or it
/// carries the token.
fn authorised(
    headers: &axum::http::HeaderMap,
    extensions: &axum::http::Extensions,
    token: &str,
) -> bool {
    extensions.get::<listener::LocalSocket>().is_some() || token_matches(bearer(headers), token)
}

/// The bearer token a request carries, or "".
fn bearer(headers: &axum::http::HeaderMap) -> &str {
    headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .unwrap_or("")
}

fn token_matches(given: &str, token: &str) -> bool {
    use subtle::ConstantTimeEq as _;
    // `ct_eq` on slices of different lengths is false (the length is not
    // secret: every token is 64 hex characters).
    bool::from(given.as_bytes().ct_eq(token.as_bytes()))
}

/// Records every request's latency under its route (the matched pattern,
/// so ids in paths do not make new series), and counts errors by code.
async fn request_latency(
    State(s): State<AppState>,
    req: Request,
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
    if let Some(code) = response.extensions().get::<ErrorCode>() {
        s.metrics.api_error(code.as_str());
    } else if let Some(r) = response.extensions().get::<apps::RefusalReason>() {
        s.metrics.api_error(r.0);
    }
    response
}

fn shutting_down() -> ApiError {
    ApiError::new(ErrorCode::ShuttingDown, "the daemon is shutting down")
}

async fn ask<T>(
    lane: &mpsc::Sender<ApiRequest>,
    make: impl FnOnce(oneshot::Sender<T>) -> ApiRequest,
) -> Result<T, Failure> {
    let (tx, rx) = oneshot::channel();
    lane.send(make(tx)).await.map_err(|_| shutting_down())?;
    Ok(rx.await.map_err(|_| shutting_down())?)
}

/// To the daemon loop.
async fn call<T>(
    s: &AppState,
    make: impl FnOnce(oneshot::Sender<T>) -> ApiRequest,
) -> Result<T, Failure> {
    ask(&s.lanes.writes, make).await
}

/// To the reader.
async fn read<T>(
    s: &AppState,
    make: impl FnOnce(oneshot::Sender<T>) -> ApiRequest,
) -> Result<T, Failure> {
    ask(&s.lanes.reads, make).await
}

async fn challenge(State(s): S, req: Request) -> Reply<ChallengeReply> {
    // No token here, so the body is tiny and must come at once: refused by
    // its declared length before a byte is read, and read against a clock.
    let too_large = || {
        ApiError::new(
            ErrorCode::BodyTooLarge,
            format!("a challenge is at most {MAX_CHALLENGE_BYTES} bytes"),
        )
    };
    let declared = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > MAX_CHALLENGE_BYTES as u64) {
        return Err(too_large().into());
    }
    let read = axum::body::to_bytes(req.into_body(), MAX_CHALLENGE_BYTES);
    let body = match tokio::time::timeout(CHALLENGE_READ_TIMEOUT, read).await {
        Ok(Ok(b)) => b,
        Ok(Err(_)) => return Err(too_large().into()),
        Err(_) => {
            return Err(ApiError::new(
                ErrorCode::BadRequest,
                "the challenge body did not arrive in time",
            )
            .into());
        }
    };
    let b: ChallengeBody = json_body(&body, "challenge")?;
    let nonce = hex::decode(&b.nonce)
        .ok()
        .filter(|n| n.len() == 32)
        .ok_or_else(|| ApiError::new(ErrorCode::BadRequest, "nonce must be 32 bytes of hex"))?;
    Ok(Json(ChallengeReply {
        pid: std::process::id(),
        mac: hex::encode(challenge_mac(&s.token, &nonce)),
    }))
}

/// `GET /`: the status page.
async fn index(State(s): State<AppState>, headers: axum::http::HeaderMap) -> Response {
    let has_token = token_matches(bearer(&headers), &s.token);
    page::index(&s.web, has_token, &headers)
}

/// `GET /login?code=`: a login link, spent.
async fn login(
    State(s): State<AppState>,
    Q(q): Q<page::LoginQuery>,
    h: axum::http::HeaderMap,
) -> Result<Response, Failure> {
    Ok(page::login(&s.web, &q, &h)?)
}

/// `POST /v1/login-link` (token only).
async fn login_link(State(s): S, c: Who) -> Reply<LoginLink> {
    c.0.owner_only()?;
    Ok(Json(s.web.login_link()?))
}

async fn status(State(s): S, c: Who) -> Reply<Status> {
    c.0.owner_only()?;
    Ok(Json(call(&s, ApiRequest::Status).await?))
}

async fn devices(State(s): S, c: Who) -> Reply<Vec<nuwa_agent::devices::DeviceEntry>> {
    c.0.owner_only()?;
    Ok(Json(call(&s, ApiRequest::Devices).await?))
}

async fn put(State(s): S, c: Who, Body(body): Body) -> Reply<PutReply> {
    tracing::trace!(target: "nuwa_path", "put in");
    check_write_values(&body)?;
    let body: PutBody = json_body(&body, "put")?;
    container_name(&body.container)?;
    c.0.may(Action::Write, &body.container)?;
    Ok(Json(call(&s, |tx| ApiRequest::Put(body, tx)).await??))
}

async fn revoke(State(s): S, c: Who, Body(body): Body) -> Reply<RevokeReply> {
    c.0.owner_only()?;
    let body: RevokeBody = json_body(&body, "revoke")?;
    Ok(Json(call(&s, |tx| ApiRequest::Revoke(body, tx)).await??))
}

/// `POST /v1/apps/grant` (the owner's): a capability for an app's key.
async fn app_grant(State(s): S, c: Who, Body(b): Body) -> Reply<Value> {
    c.0.owner_only()?;
    let body: nuwa_agent::apps::GrantBody = json_body(&b, "apps/grant")?;
    Ok(Json(
        call(&s, |tx| ApiRequest::App(AppRequest::Grant(body), tx)).await??,
    ))
}

/// `POST /v1/apps/revoke` (the owner's).
async fn app_revoke(State(s): S, c: Who, Body(b): Body) -> Reply<Value> {
    c.0.owner_only()?;
    let body: nuwa_agent::apps::RevokeAppBody = json_body(&b, "apps/revoke")?;
    Ok(Json(
        call(&s, |tx| ApiRequest::App(AppRequest::Revoke(body), tx)).await??,
    ))
}

/// `GET /v1/apps` (the owner's).
async fn app_list(State(s): S, c: Who) -> Reply<Value> {
    c.0.owner_only()?;
    Ok(Json(
        call(&s, |tx| ApiRequest::App(AppRequest::List, tx)).await??,
    ))
}

/// A DID change of an admin: the body as `B`, made into its change.
async fn admin<B: DeserializeOwned>(
    s: AppState,
    c: Who,
    body: &[u8],
    what: &str,
    change: fn(B) -> AdminChange,
) -> Reply<serde_json::Value> {
    c.0.owner_only()?;
    let change = change(json_body(body, what)?);
    Ok(Json(call(&s, |tx| ApiRequest::Admin(change, tx)).await??))
}

async fn promote(State(s): S, c: Who, Body(b): Body) -> Reply<Value> {
    admin(s, c, &b, "promote", AdminChange::Promote).await
}

async fn demote(State(s): S, c: Who, Body(b): Body) -> Reply<Value> {
    admin(s, c, &b, "demote", AdminChange::Demote).await
}

async fn recovery_key(State(s): S, c: Who, Body(b): Body) -> Reply<Value> {
    admin(s, c, &b, "recovery-key", AdminChange::RecoveryKey).await
}

async fn approve(State(s): S, c: Who, Body(body): Body) -> Reply<ApproveReply> {
    c.0.owner_only()?;
    let body: ApproveBody = json_body(&body, "approve")?;
    Ok(Json(call(&s, |tx| ApiRequest::Approve(body, tx)).await??))
}

async fn provision(State(s): S, c: Who, Body(body): Body) -> Reply<Value> {
    c.0.owner_only()?;
    let body: ProvisionBody = json_body(&body, "provision")?;
    Ok(Json(call(&s, |tx| ApiRequest::Provision(body, tx)).await??))
}

async fn tool(s: &AppState, c: &Caller, t: Tool) -> Result<Json<serde_json::Value>, Failure> {
    if let Tool::Describe(c) | Tool::Compact(c) | Tool::Reset(c) = &t {
        container_name(c)?;
    }
    if let Some((action, container)) = nuwa_agent::apps::tool_access(&t) {
        c.may(action, container)?;
    }
    // An app sees only the schemas it may read.
    if let (Tool::SchemaList, Some(_)) = (&t, c.app()) {
        let Value::Array(list) = call(s, |tx| ApiRequest::Tool(t, tx)).await?? else {
            return Ok(Json(Value::Array(Vec::new())));
        };
        let visible = list
            .into_iter()
            .filter(|v| {
                v["id"]
                    .as_str()
                    .is_some_and(|id| c.may(Action::Read, id).is_ok())
            })
            .collect();
        return Ok(Json(Value::Array(visible)));
    }
    // Reading tools run on the reader; writing ones on the daemon loop.
    if matches!(t, Tool::Query(_) | Tool::Describe(_)) {
        return Ok(Json(read(s, |tx| ApiRequest::Tool(t, tx)).await??));
    }
    Ok(Json(call(s, |tx| ApiRequest::Tool(t, tx)).await??))
}

async fn schemas_list(State(s): S, c: Who) -> Reply<Value> {
    tool(&s, &c.0, Tool::SchemaList).await
}

async fn schemas_add(State(s): S, c: Who, Body(body): Body) -> Reply<Value> {
    tool(&s, &c.0, Tool::SchemaAdd(json_body(&body, "schema")?)).await
}

async fn state_create(State(s): S, c: Who, Body(body): Body) -> Reply<Value> {
    check_write_values(&body)?;
    let b: CreateBody = json_body(&body, "state.create")?;
    tool(
        &s,
        &c.0,
        Tool::Create {
            schema_uri: b.schema_uri,
            object: b.object,
            id: b.id,
        },
    )
    .await
}

async fn state_update(State(s): S, c: Who, Body(body): Body) -> Reply<Value> {
    check_write_values(&body)?;
    let b: UpdateBody = json_body(&body, "state.update")?;
    tool(
        &s,
        &c.0,
        Tool::Update {
            schema_uri: b.schema_uri,
            id: b.id,
            patch: b.patch,
        },
    )
    .await
}

async fn state_query(State(s): S, c: Who, Body(body): Body) -> Reply<Value> {
    let b: QueryBody = json_body(&body, "state.query")?;
    tool(&s, &c.0, Tool::Query(b.query)).await
}

async fn state_delete(State(s): S, c: Who, Body(body): Body) -> Reply<Value> {
    let b: DeleteBody = json_body(&body, "state.delete")?;
    tool(
        &s,
        &c.0,
        Tool::Delete {
            schema_uri: b.schema_uri,
            id: b.id,
            hard: b.mode == DeleteMode::Hard,
        },
    )
    .await
}

async fn state_describe(State(s): S, c: Who, Body(body): Body) -> Reply<Value> {
    let b: ContainerBody = json_body(&body, "state.describe")?;
    tool(&s, &c.0, Tool::Describe(b.container)).await
}

async fn state_compact(State(s): S, c: Who, Body(body): Body) -> Reply<Value> {
    let b: ContainerBody = json_body(&body, "state.compact")?;
    tool(&s, &c.0, Tool::Compact(b.container)).await
}

async fn state_reset(State(s): S, c: Who, Body(body): Body) -> Reply<Value> {
    let b: ContainerBody = json_body(&body, "state.reset")?;
    tool(&s, &c.0, Tool::Reset(b.container)).await
}

async fn state_batch(State(s): S, c: Who, Body(body): Body) -> Reply<BatchReply> {
    check_write_values(&body)?;
    let b: BatchBody = json_body(&body, "state.batch")?;
    if b.ops.is_empty() {
        return Err(ApiError::new(ErrorCode::BadRequest, "ops is empty").into());
    }
    if b.ops.len() > MAX_BATCH_OPS {
        return Err(ApiError::new(
            ErrorCode::BadRequest,
            format!(
                "{} operations; a batch takes at most {MAX_BATCH_OPS}",
                b.ops.len()
            ),
        )
        .into());
    }
    // An app may do every operation of the batch, or none is tried.
    let needs: Vec<_> = b
        .ops
        .iter()
        .map(nuwa_agent::apps::batch_op_access)
        .collect();
    c.0.may_all(&needs)?;
    Ok(Json(call(&s, |tx| ApiRequest::Batch(b, tx)).await??))
}

async fn get_state(
    State(s): State<AppState>,
    c: Who,
    Q(q): Q<GetQuery>,
) -> Result<Response, Failure> {
    container_name(&q.container)?;
    c.0.may(Action::Read, &q.container)?;
    let json = read(&s, |tx| ApiRequest::Get(q, tx)).await??;
    Ok(([(header::CONTENT_TYPE, "application/json")], json).into_response())
}

#[derive(Deserialize)]
struct ExportQuery {
    container: String,
}

async fn export(
    State(s): State<AppState>,
    c: Who,
    Q(q): Q<ExportQuery>,
) -> Result<Response, Failure> {
    container_name(&q.container)?;
    c.0.may(Action::Read, &q.container)?;
    let bytes = read(&s, |tx| ApiRequest::Export(q.container, tx)).await??;
    Ok(([(header::CONTENT_TYPE, "application/octet-stream")], bytes).into_response())
}

#[derive(Deserialize)]
struct EventsQuery {
    container: Option<String>,
}

async fn events(
    State(s): State<AppState>,
    c: Who,
    Q(q): Q<EventsQuery>,
) -> Result<Response, Failure> {
    use axum::response::sse::{Event, KeepAlive, Sse};
    use tokio::sync::broadcast::error::RecvError;
    if let Some(name) = &q.container {
        container_name(name)?;
        c.0.may(Action::Events, name)?;
    }
    let rx = s.events.subscribe();
    // `ready` first: a client knows from then on that it misses nothing.
    let ready = futures::stream::once(async {
        Ok::<Event, std::convert::Infallible>(Event::default().event("ready").data("{}"))
    });
    // An app's stream comes through its own filter (`apps::app_events`).
    let source = match c.0.app().cloned() {
        Some(a) => {
            // Signed for `events`, under a capability that allows it.
            c.0.may(Action::Events, &a.invocation.verified.target)?;
            Err(apps::app_events(a, rx, q.container.clone()))
        }
        None => Ok(rx),
    };
    let stream = futures::stream::unfold((source, q.container), |(mut source, filter)| {
        async move {
            let sse = |kind: &str, data: String| Ok(Event::default().event(kind).data(data));
            loop {
                let item = match source.as_mut() {
                    Ok(rx) => rx.recv().await,
                    Err(app) => app.recv().await?,
                };
                let item = match item {
                    Ok(ev) if filter.as_ref().is_some_and(|c| *c != ev.container) => continue,
                    Ok(ev) => sse("change", serde_json::to_string(&*ev).unwrap_or_default()),
                    // A slow reader missed events: say so, keep streaming.
                    Err(RecvError::Lagged(n)) => sse("lagged", n.to_string()),
                    Err(RecvError::Closed) => return None,
                };
                tracing::trace!(target: "nuwa_path", "event out");
                return Some((item, (source, filter)));
            }
        }
    });
    use futures::StreamExt as _;
    Ok(Sse::new(ready.chain(stream))
        .keep_alive(KeepAlive::default())
        .into_response())
}

/// `GET /metrics`: the registry as OpenMetrics text.
async fn metrics_text(State(s): State<AppState>, c: Who) -> Response {
    if let Err(r) = c.0.owner_only() {
        return r.into_response();
    }
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        s.metrics.encode(),
    )
        .into_response()
}

/// Every route the API serves, for the suggestion of an unknown one.
/// Who may call a route.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Access {
    /// The bearer token (or the socket; a page session for the page's reads).
    Token,
    /// Anyone who can reach the address (no state behind it).
    Open,
}

impl Access {
    /// As docs/api.md's route table names it.
    #[cfg_attr(not(test), allow(dead_code))]
    fn as_str(self) -> &'static str {
        match self {
            Access::Token => "token",
            Access::Open => "none",
        }
    }
}

/// One route of the API.
struct Route {
    methods: &'static str,
    path: &'static str,
    access: Access,
    handler: axum::routing::MethodRouter<AppState>,
}

fn route(
    methods: &'static str,
    path: &'static str,
    access: Access,
    handler: axum::routing::MethodRouter<AppState>,
) -> Route {
    Route {
        methods,
        path,
        access,
        handler,
    }
}

/// Every route, declared once: the router, the suggestions for a
/// mistyped path and docs/api.md's route table come from it (a test holds
/// the docs to it).
fn routes() -> Vec<Route> {
    use Access::{Open, Token};
    vec![
        route("GET", "/v1/status", Token, get(status)),
        route("GET", "/v1/devices", Token, get(devices)),
        route("POST", "/v1/devices/revoke", Token, post(revoke)),
        route("POST", "/v1/devices/approve", Token, post(approve)),
        route("POST", "/v1/devices/provision", Token, post(provision)),
        route("POST", "/v1/devices/promote", Token, post(promote)),
        route("POST", "/v1/devices/demote", Token, post(demote)),
        route("POST", "/v1/did/recovery-key", Token, post(recovery_key)),
        route("GET", "/v1/apps", Token, get(app_list)),
        route("POST", "/v1/apps/grant", Token, post(app_grant)),
        route("POST", "/v1/apps/revoke", Token, post(app_revoke)),
        route("POST", "/v1/state/put", Token, post(put)),
        route("GET", "/v1/state/get", Token, get(get_state)),
        route("GET", "/v1/state/export", Token, get(export)),
        route(
            "GET, POST",
            "/v1/schemas",
            Token,
            get(schemas_list).post(schemas_add),
        ),
        route("POST", "/v1/state.create", Token, post(state_create)),
        route("POST", "/v1/state.update", Token, post(state_update)),
        route("POST", "/v1/state.query", Token, post(state_query)),
        route("POST", "/v1/state.delete", Token, post(state_delete)),
        route("POST", "/v1/state.describe", Token, post(state_describe)),
        route("POST", "/v1/state.compact", Token, post(state_compact)),
        route("POST", "/v1/state.reset", Token, post(state_reset)),
        route("POST", "/v1/state.batch", Token, post(state_batch)),
        route("GET", "/v1/state.events", Token, get(events)),
        route("GET", "/metrics", Token, get(metrics_text)),
        route("POST", "/v1/login-link", Token, post(login_link)),
        route("POST", "/v1/challenge", Open, post(challenge)),
        route("GET", "/", Open, get(index)),
        route("GET", "/login", Open, get(login)),
        route("GET", "/assets/status.js", Open, get(page::script)),
        route("GET", "/assets/status.css", Open, get(page::style)),
    ]
}

/// The endpoint a mistyped path most likely meant: within two edits.
fn closest_endpoint(path: &str) -> Option<&'static str> {
    // Edit distance is quadratic; a path far longer than any route is no typo.
    if path.len() > 64 {
        return None;
    }
    routes()
        .iter()
        .filter(|r| r.path != "/")
        .map(|r| (strsim::levenshtein(path, r.path), r.path))
        .filter(|(d, _)| *d <= 2)
        .min()
        .map(|(_, e)| e)
}

async fn not_found(uri: axum::http::Uri) -> Failure {
    let message = match closest_endpoint(uri.path()) {
        Some(e) => format!("no such endpoint; did you mean {e}? see docs/api.md"),
        None => "no such endpoint; see docs/api.md".to_owned(),
    };
    Failure::Error(ApiError::new(ErrorCode::NotFound, message))
}

async fn method_not_allowed(uri: axum::http::Uri) -> Failure {
    let takes = routes()
        .into_iter()
        .find(|r| r.path == uri.path())
        .map(|r| format!(" (it takes {})", r.methods))
        .unwrap_or_default();
    Failure::Error(ApiError::new(
        ErrorCode::MethodNotAllowed,
        format!("this endpoint does not take that HTTP method{takes}; see docs/api.md"),
    ))
}

/// The router, with every layer but the connection guard.
fn router(state: AppState) -> Router {
    let (mut guarded, mut open) = (Router::new(), Router::new());
    for r in routes() {
        match r.access {
            Access::Token => guarded = guarded.route(r.path, r.handler),
            Access::Open => open = open.route(r.path, r.handler),
        }
    }
    let guarded = guarded.route_layer(axum::middleware::from_fn_with_state(
        state.clone(),
        require_token,
    ));
    open.merge(guarded)
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .layer(axum::middleware::from_fn_with_state(
            state.web.clone(),
            page::check_host_and_origin,
        ))
        .layer(axum::middleware::from_fn_with_state(
            state.clone(),
            request_latency,
        ))
        .with_state(state)
}

/// Binds the API on `addr` and serves until `cancel`. Returns the bound
/// address.
pub async fn serve(
    addr: SocketAddr,
    token: String,
    lanes: Lanes,
    feeds: Feeds,
    metrics: Arc<crate::metrics::Metrics>,
    limits: Limits,
    cancel: CancellationToken,
) -> anyhow::Result<(SocketAddr, Arc<Web>)> {
    let socket = match addr {
        SocketAddr::V4(_) => tokio::net::TcpSocket::new_v4()?,
        SocketAddr::V6(_) => tokio::net::TcpSocket::new_v6()?,
    };
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    // A burst of local clients must not wait on SYN retries: a backlog of
    // 128 (the default) delayed `status` past 1 s under 200 (issue 41).
    let listener = socket.listen(LISTEN_BACKLOG)?;
    let local = listener.local_addr()?;
    let web = Arc::new(page::Web::new(local));
    let (app, is_work) = app(token, lanes, feeds, metrics.clone(), web.clone());
    tokio::spawn(listener::run(
        listener, app, limits, is_work, metrics, cancel,
    ));
    Ok((local, web))
}

/// Serves the same API on the Unix socket at `path` (`HOME/api.sock`)
/// until `cancel`: no token, only the daemon's own uid (see `socket.rs`).
/// The returned file removes the socket when dropped; hold it for the
/// daemon's life and drop it before the home lock.
#[cfg(unix)]
pub async fn serve_socket(
    path: &std::path::Path,
    token: String,
    lanes: Lanes,
    feeds: Feeds,
    metrics: Arc<crate::metrics::Metrics>,
    web: Arc<Web>,
    cancel: CancellationToken,
) -> Result<SocketFile, SocketError> {
    // The same limits as TCP, counted apart (see `listener`).
    let limits = Limits::default();
    let (listener, file) = socket::bind(path).await?;
    let (app, is_work) = app(token, lanes, feeds, metrics.clone(), web);
    tokio::spawn(listener::run(
        socket::UnixAccept::new(listener),
        app,
        limits,
        is_work,
        metrics,
        cancel,
    ));
    Ok(file)
}

/// The router for one listener, and what its connection guard counts as
/// work.
fn app(
    token: String,
    lanes: Lanes,
    feeds: Feeds,
    metrics: Arc<crate::metrics::Metrics>,
    web: Arc<Web>,
) -> (Router, listener::IsWork) {
    let state = AppState {
        token: Arc::new(Zeroizing::new(token)),
        web,
        lanes,
        events: feeds.events,
        metrics,
        gate: apps::AppGate::new(feeds.access.subscribe()),
    };
    let token_for_guard = state.token.clone();
    // Only an authorised request counts as work the connection guard must
    // not interrupt; anyone else's connection stays evictable.
    let is_work: listener::IsWork =
        Arc::new(move |headers, extensions| authorised(headers, extensions, &token_for_guard));
    (router(state), is_work)
}

#[cfg(test)]
mod tests {
    use super::*;

    // Goal: docs/api.md's route table is the router's: the same methods,
    // paths and access, in the same order, and nothing else.
    #[test]
    fn the_route_table_in_the_docs_is_the_routers() {
        let doc = include_str!("../../../docs/api.md");
        let rows: Vec<(String, String, String)> = doc
            .lines()
            .filter_map(|l| {
                let cells: Vec<&str> = l.split('|').map(str::trim).collect();
                let path = cells.get(2)?.strip_prefix('`')?.strip_suffix('`')?;
                let access = *cells.get(3)?;
                (cells.len() == 5 && matches!(access, "token" | "none"))
                    .then(|| (cells[1].to_owned(), path.to_owned(), access.to_owned()))
            })
            .collect();
        let want: Vec<(String, String, String)> = routes()
            .iter()
            .map(|r| {
                let access = r.access.as_str().to_owned();
                (r.methods.to_owned(), r.path.to_owned(), access)
            })
            .collect();
        assert_eq!(rows, want);
    }

    // Goal: a mistyped route gets the one it most likely meant, and nothing
    // is suggested for paths far from every route (or absurdly long ones).
    #[test]
    fn unknown_routes_suggest_the_closest_endpoint() {
        let cases = [
            ("/v1/state.craete", Some("/v1/state.create")),
            ("/v1/stauts", Some("/v1/status")),
            ("/v1/device", Some("/v1/devices")),
            ("/v1/state/events", Some("/v1/state.events")),
            ("/v1/nope", None),
            ("/", None),
        ];
        for (path, want) in cases {
            assert_eq!(closest_endpoint(path), want, "{path}");
        }
        assert_eq!(closest_endpoint(&"/v1/status".repeat(100)), None);
    }

    // Goal: only the listener's mark or the right token opens the guarded
    // routes; no header (an Authorization without the token, or one naming
    // the mark) stands in for the mark, which lives outside the wire.
    #[test]
    fn only_the_local_socket_mark_or_the_token_authorises() {
        let token = "ab".repeat(32);
        let check = |headers: &[(&str, String)], marked: bool| {
            let mut h = axum::http::HeaderMap::new();
            for (k, v) in headers {
                h.insert(
                    axum::http::HeaderName::from_bytes(k.as_bytes()).unwrap(),
                    v.parse().unwrap(),
                );
            }
            let mut e = axum::http::Extensions::new();
            if marked {
                e.insert(listener::LocalSocket);
            }
            authorised(&h, &e, &token)
        };
        let bearer = |t: &str| ("authorization", format!("Bearer {t}"));
        assert!(!check(&[], false));
        assert!(!check(&[bearer("wrong")], false));
        assert!(!check(
            &[
                ("x-local-socket", "1".into()),
                ("local-socket", "true".into())
            ],
            false
        ));
        assert!(check(&[bearer(&token)], false));
        assert!(check(&[], true));
        assert!(check(&[bearer("wrong")], true));
    }
}
