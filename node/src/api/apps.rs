//! Who is calling: the owner (the bearer token, the local socket, or for
//! the page's reads its session) or an app of the agent, which signs each
//! request with its key under a capability (see `nuwa_caps` for the format
//! and docs/api.md "Apps" for how to call). This module checks an app's
//! invocation and lets each route ask whether the caller may do an action
//! to a container; the rules are `nuwa_caps::may` and the agent's
//! [`AccessView`] (admin keys, revoked capabilities, visibilities), which
//! the daemon loop sends whenever it changes. It decides nothing itself.
//!
//! An app's request is checked in two steps: everything but the body
//! (signature over the headers, the capability chain to an admin of the
//! agent, nothing revoked or expired, the invoker, the action) before a
//! byte of the body is read, so that a request without a valid capability
//! never makes the daemon read one; then the body against the signed
//! `Content-Digest`, and the nonce. Refusals are `capability_refused`
//! (401) or `forbidden` (403), counted by their precise reason in
//! `nuwa_api_errors_total{code=...}`.

use std::sync::{Arc, Mutex};

use axum::extract::Request;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use nuwa_agent::apps::AccessView;
use nuwa_caps::{Action, Invocation, NonceCache, RequestParts};

use super::{ApiError, ErrorCode, MAX_BODY_BYTES};

/// The request headers that mark an app's invocation.
pub(super) const SIGNATURE_INPUT: &str = "signature-input";

/// Who is calling; every guarded request carries one (an extension).
#[derive(Clone)]
pub(crate) enum Caller {
    Owner,
    App(Arc<AppCall>),
}

/// An app's verified invocation, and the view it was checked against.
pub(crate) struct AppCall {
    pub(crate) invocation: Invocation,
    access: tokio::sync::watch::Receiver<Arc<AccessView>>,
}

/// What the app checks need, shared by every request.
#[derive(Clone)]
pub(crate) struct AppGate {
    pub(crate) access: tokio::sync::watch::Receiver<Arc<AccessView>>,
    nonces: Arc<Mutex<NonceCache>>,
    /// The nonces are kept in memory only: a request signed before this
    /// daemon started could be one it already served before a restart,
    /// so it is refused (the app signs again, as it does for every
    /// request).
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

/// The headers of an invocation, each of which must come once.
const INVOCATION_HEADERS: [&str; 4] = [
    "capability-invocation",
    "content-digest",
    SIGNATURE_INPUT,
    "signature",
];

fn now_unix_secs() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0)
}

/// A refusal of an app's request: its error, and the precise reason it is
/// counted under.
pub(crate) struct Refusal {
    error: ApiError,
    reason: &'static str,
}

impl Refusal {
    fn capability(e: nuwa_caps::CapError) -> Refusal {
        Refusal {
            error: ApiError::new(
                ErrorCode::CapabilityRefused,
                format!("{} ({})", e, e.code()),
            ),
            reason: e.code(),
        }
    }

    fn forbidden(message: String, reason: &'static str) -> Refusal {
        Refusal {
            error: ApiError::new(ErrorCode::Forbidden, message),
            reason,
        }
    }
}

/// The reason an app's request was refused, on its response: the latency
/// layer counts it (not the error's code: the reason says more).
#[derive(Clone, Copy)]
pub(crate) struct RefusalReason(pub(crate) &'static str);

impl IntoResponse for Refusal {
    fn into_response(self) -> Response {
        let status =
            StatusCode::from_u16(self.error.status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let mut response = (
            status,
            axum::Json(serde_json::json!({ "error": self.error })),
        )
            .into_response();
        response.extensions_mut().insert(RefusalReason(self.reason));
        response
    }
}

/// Checks an app's invocation (see the module docs) and returns the
/// request, with its body read and the caller attached.
pub(crate) async fn admit_app(gate: &AppGate, req: Request) -> Result<Request, Refusal> {
    let view = gate.access.borrow().clone();
    if view.unavailable {
        return Err(Refusal::forbidden(
            "the daemon cannot read the agent's app capabilities now; try again later".into(),
            "apps_unavailable",
        ));
    }
    let now = now_unix_secs();
    if let Some(h) = INVOCATION_HEADERS
        .iter()
        .find(|h| req.headers().get_all(**h).iter().count() > 1)
    {
        return Err(Refusal {
            error: ApiError::new(
                ErrorCode::CapabilityRefused,
                format!("the {h} header came more than once; send it once (malformed_invocation)"),
            ),
            reason: "malformed_invocation",
        });
    }
    let (parts, body) = req.into_parts();
    let head = {
        let header = |name: &str| parts.headers.get(name).and_then(|v| v.to_str().ok());
        let request = RequestParts {
            method: parts.method.as_str(),
            path: parts.uri.path(),
            query: parts.uri.query().unwrap_or(""),
            header,
        };
        nuwa_caps::verify_invocation_head(
            &request,
            now,
            |k| view.is_admin(k),
            |id| view.is_revoked(id),
        )
        .map_err(Refusal::capability)?
    };
    if head.created_unix_secs() < gate.started_unix_secs {
        return Err(Refusal {
            error: ApiError::new(
                ErrorCode::CapabilityRefused,
                "the request was signed before the daemon started (it keeps no nonces across a \
                 restart); sign it again (signed_before_start)",
            ),
            reason: "signed_before_start",
        });
    }
    let bytes = axum::body::to_bytes(body, MAX_BODY_BYTES)
        .await
        .map_err(|e| Refusal {
            error: ApiError::new(ErrorCode::BadRequest, format!("cannot read the body: {e}")),
            reason: "bad_request",
        })?;
    let invocation = {
        let mut nonces = gate.nonces.lock().unwrap_or_else(|p| p.into_inner());
        head.finish(&bytes, now, &mut nonces)
            .map_err(Refusal::capability)?
    };
    let mut req = Request::from_parts(parts, axum::body::Body::from(bytes));
    req.extensions_mut().insert(Caller::App(Arc::new(AppCall {
        invocation,
        access: gate.access.clone(),
    })));
    Ok(req)
}

impl Caller {
    /// Whether the caller may do `action` to `container`: the owner may do
    /// anything; an app needs its request signed for that action, and its
    /// capability to reach the container as its visibility requires.
    pub(crate) fn may(&self, action: Action, container: &str) -> Result<(), Refusal> {
        let Caller::App(call) = self else {
            return Ok(());
        };
        call.may(action, container)
    }

    /// For the owner's routes (devices, status, apps, metrics ...).
    pub(crate) fn owner_only(&self) -> Result<(), Refusal> {
        match self {
            Caller::Owner => Ok(()),
            Caller::App(_) => Err(Refusal::forbidden(
                "this route is the owner's (the token or the local socket); an app's capability \
                 reaches state routes only"
                    .into(),
                "owner_only",
            )),
        }
    }

    /// The app's call, if an app is calling.
    pub(crate) fn app(&self) -> Option<&Arc<AppCall>> {
        match self {
            Caller::App(call) => Some(call),
            Caller::Owner => None,
        }
    }
}

impl AppCall {
    pub(crate) fn may(&self, action: Action, container: &str) -> Result<(), Refusal> {
        let signed = self.invocation.action;
        if signed != action {
            return Err(Refusal::forbidden(
                format!(
                    "the request was signed for {signed}, and this needs {action}: sign it with \
                     action=\"{action}\""
                ),
                "wrong_action",
            ));
        }
        let view = self.access.borrow().clone();
        nuwa_caps::may(
            &self.invocation.verified,
            action,
            container,
            view.visibility_of(container),
        )
        .map_err(|f| Refusal::forbidden(f.to_string(), f.code()))
    }

    /// Whether the app may see `container`'s events now: its capability
    /// still stands (nothing in its chain revoked since, not expired), and
    /// reaches the container.
    pub(crate) fn sees(&self, container: &str) -> bool {
        self.still_valid()
            && nuwa_caps::may(
                &self.invocation.verified,
                Action::Events,
                container,
                self.access.borrow().visibility_of(container),
            )
            .is_ok()
    }

    /// Whether the capability still stands (for a long stream).
    pub(crate) fn still_valid(&self) -> bool {
        let v = &self.invocation.verified;
        let view = self.access.borrow();
        now_unix_secs() < v.expires_unix_secs
            && !view.unavailable
            && !v.chain_ids.iter().any(|id| view.is_revoked(id))
    }
}
