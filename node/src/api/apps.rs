//! Who is calling: the owner (the bearer token, the local socket, or for
//! the page's reads its session) or an app of the agent, which signs each
//! request with its key under a capability (docs/api.md, "Apps"). The
//! decisions are the core's (`nuwa_agent::apps`: the checks, the rules,
//! and the [`AccessView`] the daemon loop sends whenever it changes); this
//! module runs them on the HTTP request: the head before a byte of the
//! body is read, then the body, and marks the request with its [`Caller`].

use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::Request;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use nuwa_agent::apps::{AccessView, AppRefusal};
use nuwa_agent::caps::{Action, Invocation, NonceCache, RequestParts};
use tokio::sync::broadcast::{self, error::RecvError};
use tokio::sync::mpsc;

use super::{ApiError, ChangeEvent, ErrorCode, MAX_BODY_BYTES};

/// The request header that marks an app's invocation.
pub(super) const SIGNATURE_INPUT: &str = "signature-input";

/// Who is calling; every guarded request carries one (an extension).
#[derive(Clone)]
pub(crate) enum Caller {
    Owner,
    App(Arc<AppCall>),
}

/// An app's verified invocation, and where the current view comes from.
pub(crate) struct AppCall {
    pub(crate) invocation: Invocation,
    access: tokio::sync::watch::Receiver<Arc<AccessView>>,
}

/// What the app checks need, shared by every request.
#[derive(Clone)]
pub(crate) struct AppGate {
    access: tokio::sync::watch::Receiver<Arc<AccessView>>,
    nonces: Arc<Mutex<NonceCache>>,
    started_unix_secs: i64,
}

impl AppGate {
    pub(crate) fn new(access: tokio::sync::watch::Receiver<Arc<AccessView>>) -> AppGate {
        AppGate {
            access,
            nonces: Arc::new(Mutex::new(NonceCache::new())),
            started_unix_secs: now_unix_secs(),
        }
    }
}

fn now_unix_secs() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0)
}

/// A refusal of an app's request, as a response.
pub(crate) struct Refusal(AppRefusal);

/// The reason an app's request was refused, on its response: the latency
/// layer counts it (not the error's code: the reason says more).
#[derive(Clone, Copy)]
pub(crate) struct RefusalReason(pub(crate) &'static str);

impl IntoResponse for Refusal {
    fn into_response(self) -> Response {
        let AppRefusal { error, reason } = self.0;
        let status =
            StatusCode::from_u16(error.status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let mut response =
            (status, axum::Json(serde_json::json!({ "error": error }))).into_response();
        response.extensions_mut().insert(RefusalReason(reason));
        response
    }
}

/// Checks an app's invocation and returns the request, with its body read
/// and the caller attached.
pub(crate) async fn admit_app(gate: &AppGate, req: Request) -> Result<Request, Refusal> {
    let view = gate.access.borrow().clone();
    let now = now_unix_secs();
    let (parts, body) = req.into_parts();
    let head = {
        let header = |name: &str| parts.headers.get(name).and_then(|v| v.to_str().ok());
        let request = RequestParts {
            method: parts.method.as_str(),
            path: parts.uri.path(),
            query: parts.uri.query().unwrap_or(""),
            header,
        };
        let count = |name: &str| parts.headers.get_all(name).iter().count();
        nuwa_agent::apps::check_head(&view, &request, count, now, gate.started_unix_secs)
            .map_err(Refusal)?
    };
    let bytes = axum::body::to_bytes(body, MAX_BODY_BYTES)
        .await
        .map_err(|e| {
            Refusal(AppRefusal {
                error: ApiError::new(ErrorCode::BadRequest, format!("cannot read the body: {e}")),
                reason: "bad_request",
            })
        })?;
    let invocation = {
        let mut nonces = gate.nonces.lock().unwrap_or_else(|p| p.into_inner());
        nuwa_agent::apps::finish(head, &bytes, now, &mut nonces).map_err(Refusal)?
    };
    let mut req = Request::from_parts(parts, axum::body::Body::from(bytes));
    req.extensions_mut().insert(Caller::App(Arc::new(AppCall {
        invocation,
        access: gate.access.clone(),
    })));
    Ok(req)
}

impl Caller {
    /// The owner may do anything; an app as `nuwa_agent::apps::may` says.
    pub(crate) fn may(&self, action: Action, container: &str) -> Result<(), Refusal> {
        self.may_all(&[(action, container)])
    }

    /// Every (action, container) at once: a batch's operations.
    pub(crate) fn may_all(&self, needs: &[(Action, &str)]) -> Result<(), Refusal> {
        match self {
            Caller::Owner => Ok(()),
            Caller::App(call) => {
                let view = call.access.borrow().clone();
                nuwa_agent::apps::may_all(&call.invocation, &view, needs).map_err(Refusal)
            }
        }
    }

    /// For the owner's routes.
    pub(crate) fn owner_only(&self) -> Result<(), Refusal> {
        match self {
            Caller::Owner => Ok(()),
            Caller::App(_) => Err(Refusal(AppRefusal::owner_only())),
        }
    }

    pub(crate) fn app(&self) -> Option<&Arc<AppCall>> {
        match self {
            Caller::App(call) => Some(call),
            Caller::Owner => None,
        }
    }
}

impl AppCall {
    /// Whether the app may see `container`'s events now.
    pub(crate) fn sees(&self, container: &str) -> bool {
        nuwa_agent::apps::sees(
            &self.invocation,
            &self.access.borrow(),
            container,
            now_unix_secs(),
        )
    }

    /// Whether its capability still stands (for a long stream).
    fn still_valid(&self) -> bool {
        nuwa_agent::apps::still_valid(&self.invocation, &self.access.borrow(), now_unix_secs())
    }

    /// Resolves once the capability no longer stands: at a new view that
    /// revokes it, or at its expiry. Cancel safe.
    async fn ended(&self) {
        let mut access = self.access.clone();
        loop {
            access.borrow_and_update();
            if !self.still_valid() {
                return;
            }
            let left = self.invocation.verified.expires_unix_secs - now_unix_secs();
            tokio::select! {
                changed = access.changed() => if changed.is_err() { return },
                () = tokio::time::sleep(Duration::from_secs(left.max(0) as u64)) => {}
            }
        }
    }
}

/// An app's change or how many it missed, as `broadcast` says either.
type AppEvent = Result<Arc<ChangeEvent>, RecvError>;

/// Changes queued for an app's stream that it has not read yet.
const APP_EVENTS_QUEUE: usize = 256;

/// An app's event stream, filtered by a task of its own: it passes on
/// only what the app may see, so that a `lagged` count (its queue full, as
/// it reads slowly) counts only those, and it ends the stream at once when
/// the capability is revoked or expires. If the daemon overran the filter,
/// what was missed is unknown: the stream ends rather than tell of it.
pub(crate) fn app_events(
    app: Arc<AppCall>,
    mut rx: broadcast::Receiver<Arc<ChangeEvent>>,
    filter: Option<String>,
) -> mpsc::Receiver<AppEvent> {
    let (tx, out) = mpsc::channel(APP_EVENTS_QUEUE);
    tokio::spawn(async move {
        let mut missed = 0;
        loop {
            let ev = tokio::select! {
                r = rx.recv() => r,
                () = app.ended() => return,
                () = tx.closed() => return,
            };
            let Ok(ev) = ev else { return };
            if filter.as_ref().is_some_and(|c| *c != ev.container) || !app.sees(&ev.container) {
                continue;
            }
            if missed > 0 && tx.try_send(Err(RecvError::Lagged(missed))).is_ok() {
                missed = 0;
            }
            if missed > 0 || tx.try_send(Ok(ev)).is_err() {
                missed += 1;
            }
        }
    });
    out
}
