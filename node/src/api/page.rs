//! The status page at `/` and what keeps it safe in a browser: one-time
//! login links, session cookies, and the Host and Origin checks.
//!
//! The page itself is static HTML, CSS and JavaScript compiled into the
//! binary (`node/assets/`); it reads `GET /v1/status` and `GET /v1/devices`
//! and listens to `GET /v1/state.events` like any other client. A browser
//! cannot send the bearer token, so `nuwa-node open` asks the daemon (with
//! the token) for a login link (`POST /v1/login-link`): a random code,
//! single use, valid [`LOGIN_CODE_TTL`]. `GET /login?code=` trades it for a
//! session cookie (HttpOnly, SameSite=Strict) and redirects to `/`.
//!
//! What a session may do is narrow: it authorises only the `GET`s the page
//! needs ([`session_may_read`]); anything that changes state still needs
//! the token. Every request, with or without credentials, must name this
//! daemon in its `Host` (against DNS rebinding: a hostile site whose name
//! resolves to 127.0.0.1 sends its own name) and, if it carries an
//! `Origin`, come from this daemon's own origin (against cross-site
//! requests). Sessions and codes live in memory only, bounded in number;
//! a restart logs everyone out.
//!
//! Codes and sessions are stored as their SHA-256, so a lookup's timing
//! says nothing about the secret itself.

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use axum::extract::Request;
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, header};
use axum::response::{IntoResponse, Response};
use sha2::{Digest, Sha256};

use super::{ApiError, ErrorCode};

/// How long a login link stays valid.
pub const LOGIN_CODE_TTL: Duration = Duration::from_secs(60);
/// How long a session lasts after its login.
pub const SESSION_TTL: Duration = Duration::from_secs(12 * 3600);
/// Login codes not yet used; a new one beyond this drops the oldest.
const MAX_PENDING_CODES: usize = 16;
/// Live sessions; a new one beyond this ends the oldest.
const MAX_SESSIONS: usize = 32;

/// The routes a session cookie authorises, all for `GET` only: the page's
/// own reads. Everything else needs the bearer token.
const SESSION_ROUTES: &[&str] = &["/v1/status", "/v1/devices", "/v1/state.events"];

const PAGE_HTML: &str = include_str!("../../assets/status.html");
const LOGIN_HTML: &str = include_str!("../../assets/login.html");
const USED_LINK_HTML: &str = include_str!("../../assets/login-used.html");
const PAGE_JS: &str = include_str!("../../assets/status.js");
const PAGE_CSS: &str = include_str!("../../assets/status.css");

/// The page's login state and the daemon's own address (for the Host and
/// Origin checks).
pub struct Web {
    local: SocketAddr,
    inner: Mutex<Secrets>,
}

#[derive(Default)]
struct Secrets {
    /// SHA-256 of a login code → when it expires.
    codes: BTreeMap<[u8; 32], Instant>,
    /// SHA-256 of a session id → when it expires.
    sessions: BTreeMap<[u8; 32], Instant>,
}

fn digest(secret: &str) -> [u8; 32] {
    Sha256::digest(secret.as_bytes()).into()
}

fn random_hex() -> Result<String, ApiError> {
    let mut b = [0u8; 32];
    getrandom::fill(&mut b)
        .map_err(|e| ApiError::new(ErrorCode::Internal, format!("no randomness: {e}")))?;
    Ok(hex::encode(b))
}

/// Drops expired entries, then the soonest to expire until one more fits.
fn make_room(map: &mut BTreeMap<[u8; 32], Instant>, cap: usize, now: Instant) {
    map.retain(|_, exp| *exp > now);
    while map.len() >= cap {
        let Some(oldest) = map.iter().min_by_key(|(_, exp)| **exp).map(|(k, _)| *k) else {
            break;
        };
        map.remove(&oldest);
    }
}

impl Web {
    /// `local` is the address the API is bound to.
    pub fn new(local: SocketAddr) -> Self {
        Web {
            local,
            inner: Mutex::new(Secrets::default()),
        }
    }

    fn secrets(&self) -> std::sync::MutexGuard<'_, Secrets> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The cookie's name. It carries the port: browsers keep cookies per
    /// host, not per port, so two daemons on 127.0.0.1 would otherwise
    /// overwrite each other's session.
    pub fn cookie_name(&self) -> String {
        format!("nuwa_session_{}", self.local.port())
    }

    /// Where a browser should go: this daemon's own origin (a loopback
    /// name when the API listens on every address).
    pub fn origin(&self) -> String {
        let ip = match self.local.ip() {
            IpAddr::V4(v4) if v4.is_unspecified() => IpAddr::from([127, 0, 0, 1]),
            IpAddr::V6(v6) if v6.is_unspecified() => IpAddr::V6(std::net::Ipv6Addr::LOCALHOST),
            ip => ip,
        };
        format!("http://{}", SocketAddr::new(ip, self.local.port()))
    }

    /// A new login link, valid once for [`LOGIN_CODE_TTL`].
    pub fn login_link(&self) -> Result<LoginLink, ApiError> {
        let code = random_hex()?;
        let now = Instant::now();
        let mut s = self.secrets();
        make_room(&mut s.codes, MAX_PENDING_CODES, now);
        s.codes.insert(digest(&code), now + LOGIN_CODE_TTL);
        Ok(LoginLink {
            url: format!("{}/login?code={code}", self.origin()),
            expires_in_s: LOGIN_CODE_TTL.as_secs(),
        })
    }

    /// Spends `code`; on success, a new session id.
    fn redeem(&self, code: &str) -> Result<Option<String>, ApiError> {
        let now = Instant::now();
        let mut s = self.secrets();
        // Removed whatever happens next: a code is tried once.
        match s.codes.remove(&digest(code)) {
            Some(exp) if exp > now => {}
            _ => return Ok(None),
        }
        let session = random_hex()?;
        make_room(&mut s.sessions, MAX_SESSIONS, now);
        s.sessions.insert(digest(&session), now + SESSION_TTL);
        Ok(Some(session))
    }

    /// Whether the request carries a live session cookie.
    pub fn has_session(&self, headers: &HeaderMap) -> bool {
        let name = self.cookie_name();
        let now = Instant::now();
        let s = self.secrets();
        cookies(headers, &name).any(|v| s.sessions.get(&digest(v)).is_some_and(|exp| *exp > now))
    }

    /// Whether `Host` names this daemon: `127.0.0.1`, `localhost`, `[::1]`
    /// or the address the API is bound to, with this port or none.
    fn host_allowed(&self, headers: &HeaderMap) -> bool {
        let Some(host) = headers.get(header::HOST).and_then(|v| v.to_str().ok()) else {
            return false;
        };
        let (name, port) = split_host(host);
        if port.is_some_and(|p| p != self.local.port()) {
            return false;
        }
        self.name_allowed(name)
    }

    fn name_allowed(&self, name: &str) -> bool {
        let name = name.to_ascii_lowercase();
        if matches!(name.as_str(), "127.0.0.1" | "localhost" | "[::1]") {
            return true;
        }
        let ip = self.local.ip();
        if ip.is_unspecified() {
            return false;
        }
        let own = match ip {
            IpAddr::V4(v4) => v4.to_string(),
            IpAddr::V6(v6) => format!("[{v6}]"),
        };
        name == own
    }

    /// Whether an `Origin`, if any, is this daemon's own: `http://` with an
    /// allowed name and this port. `null` (sandboxed frames, some
    /// redirects) is refused.
    fn origin_allowed(&self, headers: &HeaderMap) -> bool {
        let Some(origin) = headers.get(header::ORIGIN) else {
            return true;
        };
        let Some(rest) = origin.to_str().ok().and_then(|o| o.strip_prefix("http://")) else {
            return false;
        };
        let (name, port) = split_host(rest);
        port == Some(self.local.port()) && self.name_allowed(name)
    }
}

/// `POST /v1/login-link`'s reply.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct LoginLink {
    pub url: String,
    pub expires_in_s: u64,
}

/// Splits `host[:port]` (`[v6]:port` too). A port that is not a number
/// counts as a wrong port (0).
fn split_host(host: &str) -> (&str, Option<u16>) {
    let (name, port) = if host.starts_with('[') {
        match host.find(']') {
            Some(end) => {
                let (name, rest) = host.split_at(end + 1);
                (name, rest.strip_prefix(':'))
            }
            None => (host, None),
        }
    } else {
        match host.rsplit_once(':') {
            Some((n, p)) => (n, Some(p)),
            None => (host, None),
        }
    };
    (name, port.map(|p| p.parse().unwrap_or(0)))
}

/// Values of the cookie `name` in the request's `Cookie` headers.
fn cookies<'a>(headers: &'a HeaderMap, name: &'a str) -> impl Iterator<Item = &'a str> + 'a {
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(move |pair| {
            let (k, v) = pair.trim().split_once('=')?;
            (k == name).then_some(v)
        })
}

/// Whether a session cookie may stand in for the token on this request:
/// a `GET` (or `HEAD`) of one of the page's reads, with a live session.
/// State-changing requests never accept the cookie.
pub fn session_may_read(web: &Web, req: &Request) -> bool {
    (req.method() == Method::GET || req.method() == Method::HEAD)
        && SESSION_ROUTES.contains(&req.uri().path())
        && web.has_session(req.headers())
}

/// The Host and Origin checks, as a layer in front of every route
/// (the challenge and unknown routes included).
pub async fn check_host_and_origin(
    axum::extract::State(web): axum::extract::State<std::sync::Arc<Web>>,
    req: Request,
    next: axum::middleware::Next,
) -> Response {
    // A browser cannot reach the local socket: neither DNS rebinding nor a
    // cross-site request applies there, and its clients name any host.
    if req
        .extensions()
        .get::<super::listener::LocalSocket>()
        .is_some()
    {
        return next.run(req).await;
    }
    if !web.host_allowed(req.headers()) {
        return super::Failure::Error(ApiError::new(
            ErrorCode::BadHost,
            format!(
                "the Host header must name this daemon (127.0.0.1, localhost or [::1], port {}); \
                 use the address in HOME/api.json",
                web.local.port()
            ),
        ))
        .into_response();
    }
    if !web.origin_allowed(req.headers()) {
        return super::Failure::Error(ApiError::new(
            ErrorCode::BadOrigin,
            format!(
                "cross-origin requests are refused; only pages served by this daemon ({}) may \
                 call it",
                web.origin()
            ),
        ))
        .into_response();
    }
    next.run(req).await
}

/// Headers every page response carries: no framing, no inline script, no
/// referrer (the login link's code must not leak), no caching.
fn page_headers(content_type: &'static str) -> [(header::HeaderName, HeaderValue); 6] {
    [
        (header::CONTENT_TYPE, HeaderValue::from_static(content_type)),
        (
            header::CONTENT_SECURITY_POLICY,
            HeaderValue::from_static(
                "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; \
                 img-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
            ),
        ),
        (header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY")),
        (
            header::X_CONTENT_TYPE_OPTIONS,
            HeaderValue::from_static("nosniff"),
        ),
        (
            header::REFERRER_POLICY,
            HeaderValue::from_static("no-referrer"),
        ),
        (header::CACHE_CONTROL, HeaderValue::from_static("no-store")),
    ]
}

/// `GET /`: the page for a browser with a session (or a client with the
/// token), else a page that says how to log in and shows no data.
pub fn index(web: &Web, has_token: bool, headers: &HeaderMap) -> Response {
    if has_token || web.has_session(headers) {
        (page_headers("text/html; charset=utf-8"), PAGE_HTML).into_response()
    } else {
        (
            StatusCode::UNAUTHORIZED,
            page_headers("text/html; charset=utf-8"),
            LOGIN_HTML,
        )
            .into_response()
    }
}

/// `GET /assets/status.js`, `GET /assets/status.css`: code, no data, so no
/// credentials needed.
pub async fn script() -> Response {
    (page_headers("text/javascript; charset=utf-8"), PAGE_JS).into_response()
}

pub async fn style() -> Response {
    (page_headers("text/css; charset=utf-8"), PAGE_CSS).into_response()
}

#[derive(serde::Deserialize)]
pub struct LoginQuery {
    #[serde(default)]
    code: String,
}

/// `GET /login?code=`: spends the code, sets the session cookie and sends
/// the browser to `/`. A spent, expired or unknown code gets a page that
/// says how to get a new link when the request accepts HTML (a browser),
/// and the JSON error otherwise (an API client).
pub fn login(web: &Web, q: &LoginQuery, headers: &HeaderMap) -> Result<Response, ApiError> {
    let Some(session) = web.redeem(&q.code)? else {
        let accept = headers.get(header::ACCEPT).and_then(|v| v.to_str().ok());
        if accept.is_some_and(|a| a.contains("text/html")) {
            let html = page_headers("text/html; charset=utf-8");
            return Ok((StatusCode::FORBIDDEN, html, USED_LINK_HTML).into_response());
        }
        return Err(ApiError::new(
            ErrorCode::BadLoginLink,
            "this login link was already used, has expired or is not one this daemon made; \
             run `nuwa-node open` for a new one",
        ));
    };
    let cookie = format!(
        "{}={session}; HttpOnly; SameSite=Strict; Path=/; Max-Age={}",
        web.cookie_name(),
        SESSION_TTL.as_secs()
    );
    let cookie = HeaderValue::from_str(&cookie)
        .map_err(|e| ApiError::new(ErrorCode::Internal, format!("bad cookie header: {e}")))?;
    Ok((
        StatusCode::SEE_OTHER,
        [
            (header::LOCATION, HeaderValue::from_static("/")),
            (header::SET_COOKIE, cookie),
            (header::CACHE_CONTROL, HeaderValue::from_static("no-store")),
            (
                header::REFERRER_POLICY,
                HeaderValue::from_static("no-referrer"),
            ),
        ],
    )
        .into_response())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(*k, HeaderValue::from_str(v).unwrap());
        }
        h
    }

    // Goal: the Host and Origin rules accept this daemon's names only.
    // Method: a table of headers against a daemon on 127.0.0.1:4100.
    #[test]
    fn host_and_origin_rules() {
        let web = Web::new("127.0.0.1:4100".parse().unwrap());
        let host = |h: &str| web.host_allowed(&headers(&[("host", h)]));
        for ok in [
            "127.0.0.1:4100",
            "127.0.0.1",
            "localhost:4100",
            "LOCALHOST",
            "[::1]:4100",
            "[::1]",
        ] {
            assert!(host(ok), "{ok} refused");
        }
        for bad in [
            "evil.example:4100",
            "127.0.0.1:4101",
            "127.0.0.1:x",
            "127.0.0.2:4100",
            "localhost.evil.example",
            "[::2]:4100",
            "",
        ] {
            assert!(!host(bad), "{bad} accepted");
        }
        assert!(!web.host_allowed(&HeaderMap::new()), "no Host accepted");

        let origin = |o: &str| web.origin_allowed(&headers(&[("origin", o)]));
        assert!(web.origin_allowed(&HeaderMap::new()));
        assert!(origin("http://127.0.0.1:4100"));
        assert!(origin("http://localhost:4100"));
        for bad in [
            "null",
            "http://evil.example",
            "http://127.0.0.1:4101",
            "http://127.0.0.1",
            "https://127.0.0.1:4100",
        ] {
            assert!(!origin(bad), "{bad} accepted");
        }

        // An explicit non-loopback address is allowed too; 0.0.0.0 is not.
        let lan = Web::new("192.168.7.2:80".parse().unwrap());
        assert!(lan.host_allowed(&headers(&[("host", "192.168.7.2")])));
        let any = Web::new("0.0.0.0:80".parse().unwrap());
        assert!(!any.host_allowed(&headers(&[("host", "0.0.0.0")])));
        assert_eq!(any.origin(), "http://127.0.0.1:80");
    }

    // Goal: a login code works once, within its time, and sessions are
    // bounded. Method: redeem codes against the in-memory table.
    #[test]
    fn codes_are_single_use_and_sessions_bounded() {
        let web = Web::new("127.0.0.1:4100".parse().unwrap());
        let link = web.login_link().unwrap();
        let code = link.url.split("code=").nth(1).unwrap().to_owned();
        assert_eq!(code.len(), 64);
        let session = web.redeem(&code).unwrap().expect("first use");
        assert!(web.redeem(&code).unwrap().is_none(), "second use");
        assert!(web.redeem("nope").unwrap().is_none());
        let cookie = format!("other=1; {}={session}", web.cookie_name());
        assert!(web.has_session(&headers(&[("cookie", &cookie)])));
        assert!(!web.has_session(&headers(&[("cookie", "nuwa_session_4100=x")])));

        // An expired code is refused.
        let link = web.login_link().unwrap();
        let code = link.url.split("code=").nth(1).unwrap().to_owned();
        for exp in web.secrets().codes.values_mut() {
            *exp = Instant::now() - Duration::from_secs(1);
        }
        assert!(web.redeem(&code).unwrap().is_none());

        for _ in 0..(2 * MAX_SESSIONS) {
            let link = web.login_link().unwrap();
            let code = link.url.split("code=").nth(1).unwrap().to_owned();
            web.redeem(&code).unwrap().unwrap();
        }
        assert!(web.secrets().sessions.len() <= MAX_SESSIONS);
        for _ in 0..(2 * MAX_PENDING_CODES) {
            web.login_link().unwrap();
        }
        assert!(web.secrets().codes.len() <= MAX_PENDING_CODES);
    }

    // Goal: a spent login link shows a browser a page saying so and how to
    // get a new link, and an API client the JSON error. Method: spend a
    // code, then ask again as a browser and as curl would.
    #[test]
    fn a_used_link_answers_a_browser_with_a_page() {
        let web = Web::new("127.0.0.1:4100".parse().unwrap());
        let link = web.login_link().unwrap();
        let code = link.url.split("code=").nth(1).unwrap().to_owned();
        let q = LoginQuery { code };
        let browser = headers(&[("accept", "text/html,application/xhtml+xml,*/*;q=0.8")]);
        assert_eq!(
            login(&web, &q, &browser).unwrap().status(),
            StatusCode::SEE_OTHER
        );
        let page = login(&web, &q, &browser).unwrap();
        assert_eq!(page.status(), StatusCode::FORBIDDEN);
        assert_eq!(
            page.headers()[header::CONTENT_TYPE],
            "text/html; charset=utf-8"
        );
        assert!(
            USED_LINK_HTML.contains("already used") && USED_LINK_HTML.contains("nuwa-node open")
        );
        let err = login(&web, &q, &headers(&[("accept", "*/*")])).unwrap_err();
        assert_eq!(err.code, ErrorCode::BadLoginLink);
        assert!(login(&web, &q, &headers(&[])).is_err());
    }
}
