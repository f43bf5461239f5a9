//! The local API under hostile clients (issue 11, faults 1, 3 and 6): bad
//! container names are refused at the door and the daemon keeps running;
//! the token is checked before any body is read; idle connections beyond
//! the cap cannot lock out a client; unknown routes and methods answer with
//! the JSON error shape; and the CLI never hands its token to a process
//! that is not this home's daemon.
//!
//! Every test runs real daemons (see `common`) and talks raw TCP where the
//! point is what happens on the socket.

mod common;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::Path;
use std::time::{Duration, Instant};

use common::*;
use serde_json::{Value, json};

fn api(home: &Path) -> (SocketAddr, String) {
    let file: Value =
        serde_json::from_slice(&std::fs::read(home.join("api.json")).unwrap()).unwrap();
    let url = file["url"].as_str().unwrap();
    let addr = url.strip_prefix("http://").unwrap().parse().unwrap();
    (addr, file["token"].as_str().unwrap().to_owned())
}

/// One HTTP/1.1 request on a fresh connection; returns (status, body).
fn request(addr: SocketAddr, head: &str, body: &[u8]) -> (u16, String) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s.write_all(head.as_bytes()).unwrap();
    s.write_all(body).unwrap();
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    let text = String::from_utf8_lossy(&out).into_owned();
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let body = text.split("\r\n\r\n").nth(1).unwrap_or("").to_owned();
    (status, body)
}

fn post(addr: SocketAddr, token: &str, path: &str, body: &Value) -> (u16, Value) {
    let body = body.to_string();
    let head = format!(
        "POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {token}\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    let (status, text) = request(addr, &head, body.as_bytes());
    (status, serde_json::from_str(&text).unwrap_or(Value::Null))
}

fn get(addr: SocketAddr, token: &str, path: &str) -> (u16, Value) {
    let head = format!(
        "GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {token}\r\nConnection: close\r\n\r\n"
    );
    let (status, text) = request(addr, &head, b"");
    (status, serde_json::from_str(&text).unwrap_or(Value::Null))
}

// Goal: fault 1. An empty container name, a 257-byte one and one with a
// control character get 400 `invalid_container_name` on every route that
// takes a name, the daemon keeps running and still takes good writes.
// Unknown routes and wrong methods answer with the JSON error shape.
#[test]
fn bad_names_are_refused_at_the_door_and_the_daemon_keeps_running() {
    isolated(
        "bad_names_are_refused_at_the_door_and_the_daemon_keeps_running",
        || {
            let mut c = Cluster::new();
            let a = c.init("a");
            c.start(&a, &["--no-mdns"]);
            let (addr, token) = api(&a);
            let long = "x".repeat(257);
            for name in ["", long.as_str(), "bad\nname"] {
                let (st, reply) = post(
                    addr,
                    &token,
                    "/v1/state/put",
                    &json!({"container": name, "key": "k", "value": "v"}),
                );
                assert_eq!(st, 400, "{reply}");
                assert_eq!(reply["error"]["code"], "invalid_container_name", "{reply}");
                let (st, reply) = post(
                    addr,
                    &token,
                    "/v1/state.reset",
                    &json!({ "container": name }),
                );
                assert_eq!(
                    (st, &reply["error"]["code"]),
                    (400, &json!("invalid_container_name"))
                );
            }
            let (st, reply) = get(addr, &token, "/v1/state/get?container=&key=k");
            assert_eq!(
                (st, &reply["error"]["code"]),
                (400, &json!("invalid_container_name"))
            );
            // The CLI path of the hostile repro.
            let out = cli(&a, &["state", "put", "", "k", "\"v\""]);
            assert!(!out.status.success());
            assert!(
                String::from_utf8_lossy(&out.stderr).contains("invalid_container_name"),
                "{}",
                String::from_utf8_lossy(&out.stderr)
            );
            // Still running, still writing.
            cli_ok(&a, &["state", "put", "notes", "k", "\"v\""]);
            assert_eq!(get_json(&a, "notes").unwrap()["k"], "v");
            // The JSON error shape for unknown routes and methods.
            let (st, reply) = get(addr, &token, "/v1/nope");
            assert_eq!((st, &reply["error"]["code"]), (404, &json!("not_found")));
            let (st, reply) = post(addr, &token, "/v1/state.craete", &json!({}));
            assert_eq!((st, &reply["error"]["code"]), (404, &json!("not_found")));
            let (st, reply) = get(addr, &token, "/v1/state/put");
            assert_eq!(
                (st, &reply["error"]["code"]),
                (405, &json!("method_not_allowed"))
            );
            let (_, metrics) = {
                let head = format!(
                    "GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {token}\r\nConnection: close\r\n\r\n"
                );
                request(addr, &head, b"")
            };
            assert!(
                metrics.contains("nuwa_api_errors_total{code=\"invalid_container_name\"}"),
                "bad input is counted:\n{metrics}"
            );
        },
    );
}

// Goal: fault 3, first half. A request without the token that announces a
// 40 MB body is refused with 401 at once, before the daemon reads (or
// buffers) a byte of the body.
#[test]
fn the_token_is_checked_before_the_body_is_read() {
    isolated("the_token_is_checked_before_the_body_is_read", || {
        let mut c = Cluster::new();
        let a = c.init("a");
        c.start(&a, &["--no-mdns"]);
        let (addr, _) = api(&a);
        let mut s = TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        s.write_all(
            b"POST /v1/state/put HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n\
              Content-Length: 40000000\r\n\r\n{\"container\":",
        )
        .unwrap();
        let started = Instant::now();
        let mut buf = [0u8; 512];
        let n = s.read(&mut buf).expect("an answer before the body is sent");
        let text = String::from_utf8_lossy(&buf[..n]);
        assert!(text.starts_with("HTTP/1.1 401"), "{text}");
        assert!(started.elapsed() < Duration::from_secs(5));
        // The one route without the token takes only a small body.
        let mut s = TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        s.write_all(
            b"POST /v1/challenge HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n\
              Content-Length: 40000000\r\n\r\n{\"nonce\":",
        )
        .unwrap();
        let n = s.read(&mut buf).expect("an answer before the body is sent");
        let text = String::from_utf8_lossy(&buf[..n]);
        assert!(text.starts_with("HTTP/1.1 413"), "{text}");
        assert!(text.contains("body_too_large"), "{text}");
    });
}

// Goal: fault 3, second half. More idle connections than the cap (256),
// and more unauthenticated requests whose body never comes, neither lock
// out an authorised client nor stay open: the guard closes the longest-idle
// ones to make room, and counts them.
#[test]
fn idle_connections_beyond_the_cap_do_not_lock_out_a_client() {
    isolated(
        "idle_connections_beyond_the_cap_do_not_lock_out_a_client",
        || {
            let mut c = Cluster::new();
            let a = c.init("a");
            c.start(&a, &["--no-mdns"]);
            let (addr, token) = api(&a);
            // 300 idle, then 300 in the middle of a challenge whose body
            // never comes (no token: such requests never pin a connection,
            // or these would fill the table and lock everyone out). An
            // authorised request every 20 connections must be answered
            // (and gives the daemon time to read the challenges' headers).
            let mut idle: Vec<TcpStream> = (0..300)
                .map(|_| TcpStream::connect(addr).expect("connect"))
                .collect();
            for i in 0..300 {
                let mut s = TcpStream::connect(addr).expect("connect");
                s.write_all(
                    b"POST /v1/challenge HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 100\r\n\r\n{",
                )
                .unwrap();
                idle.push(s);
                if i % 20 == 19 {
                    let (st, reply) = get(addr, &token, "/v1/devices");
                    assert_eq!(st, 200, "after {} slow challenges: {reply}", i + 1);
                }
            }
            // Authorised requests on new connections keep being answered
            // while the daemon reads the challenges' headers (for 2 s, well
            // inside the challenge's 5 s body timeout).
            let until = Instant::now() + Duration::from_secs(2);
            let mut answered = 0;
            while Instant::now() < until {
                // Keep the pressure on: one more unanswered challenge each
                // time (bounded, to stay under this process's file limit).
                if idle.len() < 900 {
                    let mut s = TcpStream::connect(addr).expect("connect");
                    s.write_all(
                        b"POST /v1/challenge HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 100\r\n\r\n{",
                    )
                    .unwrap();
                    idle.push(s);
                }
                let (st, reply) = get(addr, &token, "/v1/status");
                assert_eq!(st, 200, "after {answered} answers: {reply}");
                answered += 1;
            }
            // At least 300 + 1 - 256 of the idle ones were closed by the
            // daemon (a read sees end of file).
            let closed = wait_for("idle connections evicted", Duration::from_secs(20), || {
                let n = idle
                    .iter()
                    .filter(|s| {
                        s.set_nonblocking(true).unwrap();
                        let mut b = [0u8; 1];
                        matches!((&**s).read(&mut b), Ok(0))
                    })
                    .count();
                (n >= 345).then_some(n)
            });
            let (_, st) = get(addr, &token, "/v1/status");
            let evicted = st["counters"]["api_connections_evicted"]
                .as_u64()
                .unwrap_or(0);
            assert!(evicted >= 345, "evicted {evicted}, closed {closed}: {st}");
            // Nothing was refused: every connection without the token
            // stayed evictable.
            assert_eq!(st["counters"].get("api_connections_refused"), None, "{st}");
        },
    );
}

// Goal: fault 6. After the daemon died and another process took its API
// port, the CLI refuses to talk to it: the stranger receives no token and
// the CLI reports no success. With the daemon's pid dead, the CLI says so.
#[test]
fn the_cli_never_sends_its_token_to_a_stranger_on_the_api_port() {
    isolated(
        "the_cli_never_sends_its_token_to_a_stranger_on_the_api_port",
        || {
            let mut c = Cluster::new();
            let a = c.init("a");
            let d = c.start(&a, &["--no-mdns"]);
            let (addr, token) = api(&a);
            let file = std::fs::read(a.join("api.json")).unwrap();
            c.kill9(d);
            // kill -9 leaves api.json; make sure it is the daemon's.
            std::fs::write(a.join("api.json"), &file).unwrap();
            let stranger = TcpListener::bind(addr).expect("take over the API port");
            // A live pid (this test's own) so that only the challenge can
            // tell.
            let mut api: Value = serde_json::from_slice(&file).unwrap();
            api["pid"] = json!(std::process::id());
            std::fs::write(a.join("api.json"), api.to_string()).unwrap();
            let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
            let seen = std::thread::spawn({
                let done = done.clone();
                move || {
                    let mut all = Vec::new();
                    stranger.set_nonblocking(true).unwrap();
                    let deadline = Instant::now() + Duration::from_secs(30);
                    while !done.load(std::sync::atomic::Ordering::Acquire)
                        && Instant::now() < deadline
                    {
                        let Ok((mut s, _)) = stranger.accept() else {
                            std::thread::sleep(Duration::from_millis(20));
                            continue;
                        };
                        s.set_nonblocking(false).unwrap();
                        s.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
                        let mut buf = vec![0u8; 65536];
                        let n = s.read(&mut buf).unwrap_or(0);
                        all.extend_from_slice(&buf[..n]);
                        // Answer like the daemon would, with a made-up MAC.
                        let body = format!(
                            "{{\"pid\":{},\"mac\":\"{}\"}}",
                            std::process::id(),
                            "00".repeat(32)
                        );
                        let _ = s.write_all(
                            format!(
                                "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n\
                                 Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
                                body.len()
                            )
                            .as_bytes(),
                        );
                    }
                    all
                }
            });
            let out = cli(&a, &["state", "put", "notes", "k", "\"secret-value\""]);
            let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
            assert!(!out.status.success(), "{stderr}");
            assert!(stderr.contains("not the daemon of home"), "{stderr}");
            done.store(true, std::sync::atomic::Ordering::Release);
            let received = seen.join().unwrap();
            let received = String::from_utf8_lossy(&received);
            assert!(
                !received.contains(&token),
                "the stranger got the token:\n{received}"
            );
            assert!(!received.contains("secret-value"), "{received}");
            assert!(received.contains("POST /v1/challenge"), "{received}");
            // A dead pid is reported as such, before any connection.
            api["pid"] = json!(dead_pid());
            std::fs::write(a.join("api.json"), api.to_string()).unwrap();
            let out = cli(&a, &["state", "put", "notes", "k", "\"v\""]);
            let stderr = String::from_utf8_lossy(&out.stderr);
            assert!(!out.status.success());
            assert!(stderr.contains("which is not running"), "{stderr}");
        },
    );
}

/// The pid of a process that has exited.
fn dead_pid() -> u32 {
    let mut child = std::process::Command::new("true").spawn().unwrap();
    let pid = child.id();
    child.wait().unwrap();
    pid
}

/// The API's body cap, `MAX_BODY_BYTES` in node/src/api/wire.rs (the 413
/// message names it, which ties this copy to the daemon's).
const MAX_BODY_BYTES: usize = 40 * 1024 * 1024;

// Goal: the 40 MiB body cap. An authorised `POST /v1/state/put` whose body
// is one byte over the cap is answered 413 `body_too_large` (naming the
// cap), writes nothing, and the daemon keeps answering and writing.
// Method: the whole body is sent, on a thread of its own, while the answer
// is read, so that neither side waits on the other.
#[test]
fn a_body_over_the_cap_is_refused_and_the_daemon_keeps_running() {
    isolated(
        "a_body_over_the_cap_is_refused_and_the_daemon_keeps_running",
        || {
            let mut c = Cluster::new();
            let a = c.init("a");
            c.start(&a, &["--no-mdns"]);
            let (addr, token) = api(&a);
            // A well-formed put, padded to exactly one byte over the cap.
            let (open, close) = (r#"{"container":"notes","key":"big","value":""#, r#""}"#);
            let len = MAX_BODY_BYTES + 1;
            let mut body = Vec::with_capacity(len);
            body.extend_from_slice(open.as_bytes());
            body.resize(len - close.len(), b'x');
            body.extend_from_slice(close.as_bytes());
            assert_eq!(body.len(), len);
            let head = format!(
                "POST /v1/state/put HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {token}\r\n\
                 Content-Type: application/json\r\nContent-Length: {len}\r\nConnection: close\r\n\r\n"
            );
            let s = TcpStream::connect(addr).unwrap();
            s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
            let mut w = s.try_clone().unwrap();
            // The daemon may answer and close before it has read it all:
            // a failed write is no failure here, the answer is.
            let sender = std::thread::spawn(move || {
                let _ = w.write_all(head.as_bytes());
                let _ = w.write_all(&body);
            });
            let mut out = Vec::new();
            let _ = (&s).read_to_end(&mut out);
            sender.join().unwrap();
            let text = String::from_utf8_lossy(&out);
            let status = text.split_whitespace().nth(1).unwrap_or("");
            assert_eq!(status, "413", "{text}");
            let reply: Value =
                serde_json::from_str(text.split("\r\n\r\n").nth(1).unwrap_or("")).unwrap();
            assert_eq!(reply["error"]["code"], "body_too_large", "{reply}");
            assert!(
                reply["error"]["message"]
                    .as_str()
                    .is_some_and(|m| m.contains(&format!("{MAX_BODY_BYTES}-byte"))),
                "the refusal names the cap this test assumes: {reply}"
            );
            // Still answering, and nothing of the refused put was written.
            let (st, status) = get(addr, &token, "/v1/status");
            assert_eq!(st, 200, "{status}");
            assert!(status["device"].is_object(), "{status}");
            let (st, reply) = post(
                addr,
                &token,
                "/v1/state/put",
                &json!({"container": "notes", "key": "k", "value": "v"}),
            );
            assert_eq!(st, 200, "{reply}");
            assert_eq!(get_json(&a, "notes").unwrap(), json!({"k": "v"}));
        },
    );
}

// Goal: issue 25 finding 4: a keep-alive connection idle past the old
// ~10 s limit still takes its next request (docs/api.md promises 60 s),
// while a request whose headers stop half-way is still closed by the
// header-read timeout (10 s after its first byte). Method: two raw
// connections held side by side for 12 s.
#[test]
fn keep_alive_outlasts_the_header_timeout_and_slow_headers_do_not() {
    isolated(
        "keep_alive_outlasts_the_header_timeout_and_slow_headers_do_not",
        || {
            let mut c = Cluster::new();
            let a = c.init("a");
            c.start(&a, &["--no-mdns"]);
            let (addr, token) = api(&a);
            let head = format!(
                "GET /v1/devices HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {token}\r\n\r\n"
            );
            // Reads one response (headers and a Content-Length body).
            let read_response = |s: &mut TcpStream| -> u16 {
                s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
                let mut buf = Vec::new();
                let mut b = [0u8; 4096];
                loop {
                    let n = s.read(&mut b).unwrap_or(0);
                    if n == 0 {
                        return 0;
                    }
                    buf.extend_from_slice(&b[..n]);
                    let text = String::from_utf8_lossy(&buf).into_owned();
                    if let Some((h, body)) = text.split_once("\r\n\r\n") {
                        let len: usize = h
                            .lines()
                            .find_map(|l| {
                                let (k, v) = l.split_once(':')?;
                                k.eq_ignore_ascii_case("content-length")
                                    .then(|| v.trim().parse().ok())?
                            })
                            .unwrap_or(0);
                        if body.len() >= len {
                            return h.split_whitespace().nth(1).unwrap().parse().unwrap();
                        }
                    }
                }
            };
            let mut kept = TcpStream::connect(addr).unwrap();
            kept.write_all(head.as_bytes()).unwrap();
            assert_eq!(read_response(&mut kept), 200);
            let mut slow = TcpStream::connect(addr).unwrap();
            slow.write_all(b"GET /v1/status HTTP/1.1\r\nHost: 127.0.0.1\r\n")
                .unwrap();
            let started = Instant::now();
            // The slow one is closed by the header timeout...
            slow.set_read_timeout(Some(Duration::from_secs(20)))
                .unwrap();
            let mut b = [0u8; 1];
            let n = slow.read(&mut b).unwrap_or(0);
            let closed_after = started.elapsed();
            assert_eq!(n, 0, "the half-sent request got an answer");
            assert!(
                closed_after >= Duration::from_secs(9) && closed_after < Duration::from_secs(15),
                "closed after {closed_after:?}"
            );
            // ...and the idle one, past 12 s, still takes a request.
            while started.elapsed() < Duration::from_secs(12) {
                std::thread::sleep(Duration::from_millis(200));
            }
            kept.write_all(head.as_bytes()).unwrap();
            assert_eq!(
                read_response(&mut kept),
                200,
                "the idle keep-alive connection was closed"
            );
            println!(
                "slow headers closed after {closed_after:?}; keep-alive answered after 12 s idle"
            );
            assert!(metric(&a, "nuwa_api_header_timeouts_total") >= 1.0);
        },
    );
}

// Goal: an app's request is refused on its headers, before a byte of its
// body is read: a request that claims a 10 MB body and a signature that
// does not hold gets its 401 at once (the body never comes). Method: a raw
// connection sends only the head.
#[test]
fn an_app_request_is_refused_before_its_body_is_read() {
    isolated("an_app_request_is_refused_before_its_body_is_read", || {
        let mut c = Cluster::new();
        let a = c.init("a");
        c.start(&a, &["--no-mdns"]);
        let (addr, _) = api(&a);
        let mut s = TcpStream::connect(addr).unwrap();
        s.write_all(
            b"POST /v1/state/put HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 10000000\r\n\
              Capability-Invocation: zcap capability=\"e30\",action=\"write\"\r\n\
              Content-Digest: sha-256=:47DEQpj8HBSa+/TImW+5JCeuQeRkm5NMpJWZG3hSuFU=:\r\n\
              Signature-Input: sig1=(\"@method\" \"@path\" \"@query\" \"content-digest\" \"capability-invocation\");created=1;expires=2;nonce=\"abcdefghijklmnop\";keyid=\"did:key:z6Mk#z6Mk\";alg=\"ed25519\"\r\n\
              Signature: sig1=:AAAA:\r\n\r\n",
        )
        .unwrap();
        s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut buf = [0u8; 4096];
        let n = s.read(&mut buf).expect("an answer without the body");
        let text = String::from_utf8_lossy(&buf[..n]);
        assert!(text.starts_with("HTTP/1.1 401"), "{text}");
        assert!(text.contains("capability_refused"), "{text}");
    });
}

// Goal: issue 41: the API's listen backlog is sized for bursts (1024, or
// the kernel's somaxconn if lower; 128 made a burst of 200 local
// connections delay `status` past 1 s), and `status` answers within 2 s
// while 200 connections arrive at once. Method: a real daemon; the
// backlog read from `ss -ltn` (a listening socket's Send-Q), then a burst
// from 200 threads with `status` timed in its middle.
#[test]
fn the_listen_backlog_is_sized_for_a_burst_of_local_connections() {
    isolated(
        "the_listen_backlog_is_sized_for_a_burst_of_local_connections",
        || {
            let mut c = Cluster::new();
            let home = c.init("a");
            c.start(&home, &[]);
            let (addr, token) = api(&home);
            let out = std::process::Command::new("ss")
                .args(["-ltnH", &format!("sport = :{}", addr.port())])
                .output()
                .expect("ss (iproute2) is needed for this test");
            let text = String::from_utf8_lossy(&out.stdout);
            let backlog: u64 = text
                .split_whitespace()
                .nth(2)
                .and_then(|n| n.parse().ok())
                .unwrap_or_else(|| panic!("no listening socket in `ss -ltn`: {text}"));
            let somaxconn: u64 = std::fs::read_to_string("/proc/sys/net/core/somaxconn")
                .ok()
                .and_then(|s| s.trim().parse().ok())
                .unwrap_or(4096);
            assert_eq!(backlog, somaxconn.min(1024), "{text}");

            let start = std::sync::Arc::new(std::sync::Barrier::new(201));
            let burst: Vec<_> = (0..200)
                .map(|_| {
                    let start = start.clone();
                    std::thread::spawn(move || {
                        start.wait();
                        TcpStream::connect_timeout(&addr, Duration::from_secs(5)).ok()
                    })
                })
                .collect();
            start.wait();
            let asked = Instant::now();
            let (st, body) = get(addr, &token, "/v1/status");
            let took = asked.elapsed();
            assert_eq!(st, 200, "{body}");
            let held = burst.into_iter().filter_map(|t| t.join().unwrap()).count();
            println!("status answered in {took:?} during a burst of {held} connections");
            assert!(took < Duration::from_secs(2), "status took {took:?}");
        },
    );
}
