//! The CLI side of the local API: the running daemon over its Unix socket
//! `HOME/api.sock` when that connects, else over TCP at the address in
//! `HOME/api.json`, with its token.
//!
//! `api.json` can outlive its daemon, and another process may since listen
//! on its port. So before the token leaves this process the client checks
//! that the file's `pid` is alive and that the process answering proves it
//! holds the token: an HMAC of a fresh nonce keyed by it (`POST
//! /v1/challenge`), and the pid. The socket sends no token: a dead
//! daemon's socket refuses connections (then TCP), only this user can bind
//! one in the home (0700, checked at every start), and the client checks
//! the socket file is this user's before it connects.

use std::path::Path;

use anyhow::{Context, Result, bail};

use crate::api::{
    ApiFile, ApproveBody, ApproveReply, ChallengeBody, ChallengeReply, PutBody, PutReply,
    RevokeReply, challenge_mac,
};
use crate::home;
use nuwa_agent::api::events::{SseParser, change_line};
use nuwa_agent::api::import::{ImportLines, ImportTally, batch_end};
use nuwa_agent::api::{ApiError, GetQuery};
use nuwa_agent::asm::REGISTRY_CONTAINER;
use nuwa_agent::asm_model::registry::Registry;
use nuwa_agent::devices::DeviceEntry;
use nuwa_agent::expiry;
use nuwa_agent::state::Container;
use nuwa_agent::status::Status;

fn no_daemon(home: &Path) -> anyhow::Error {
    anyhow::anyhow!(
        "no nuwa-node daemon is running for home {}; start one with `nuwa-node --home {} run`",
        home.display(),
        home.display()
    )
}

fn api_file(home: &Path) -> Result<ApiFile> {
    let path = home.join(home::API_FILE);
    let bytes = std::fs::read(&path).map_err(|_| no_daemon(home))?;
    serde_json::from_slice(&bytes).with_context(|| format!("cannot parse {}", path.display()))
}

/// Whether a process with this id exists.
#[cfg(unix)]
fn alive(pid: u32) -> bool {
    let Ok(pid) = libc::pid_t::try_from(pid) else {
        return false;
    };
    // SAFETY: signal 0 sends nothing; kill only checks that the process
    // exists and may be signalled.
    let r = unsafe { libc::kill(pid, 0) };
    r == 0 || std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM)
}

#[cfg(not(unix))]
fn alive(_pid: u32) -> bool {
    true
}

/// How the client reaches the daemon.
enum Via {
    /// The Unix socket: no token, no challenge (unix only).
    #[cfg_attr(not(unix), allow(dead_code))]
    Socket,
    /// Loopback TCP with the token, after the challenge.
    Tcp(ApiFile),
}

struct Client {
    /// The base of every request's URL.
    url: String,
    via: Via,
    http: reqwest::Client,
    home: std::path::PathBuf,
    /// Set once the daemon answered the challenge.
    verified: tokio::sync::OnceCell<()>,
}

/// The daemon's socket in `home`, if it is this user's socket and a
/// daemon accepts on it.
#[cfg(unix)]
fn live_socket(home: &Path) -> Option<std::path::PathBuf> {
    use std::os::unix::fs::{FileTypeExt as _, MetadataExt as _};
    let path = home.join(home::API_SOCKET);
    let meta = std::fs::symlink_metadata(&path).ok()?;
    // SAFETY: geteuid has no preconditions and cannot fail.
    let uid = unsafe { libc::geteuid() };
    if !meta.file_type().is_socket() || meta.uid() != uid {
        return None;
    }
    // A connection the daemon will close unused: it proves it listens.
    std::os::unix::net::UnixStream::connect(&path).ok()?;
    Some(path)
}

impl Client {
    fn new(home: &Path) -> Result<Self> {
        #[cfg(unix)]
        if let Some(path) = live_socket(home) {
            return Ok(Client {
                // The host is only the Host header: the socket is the
                // address.
                url: "http://localhost".to_owned(),
                via: Via::Socket,
                http: reqwest::Client::builder()
                    .unix_socket(path)
                    .build()
                    .context("cannot build the HTTP client")?,
                home: home.to_path_buf(),
                verified: tokio::sync::OnceCell::new(),
            });
        }
        let api = api_file(home)?;
        if !alive(api.pid) {
            return Err(anyhow::anyhow!(
                "{} names process {}, which is not running (the daemon was killed?); {}",
                home.join(home::API_FILE).display(),
                api.pid,
                no_daemon(home)
            ));
        }
        Ok(Client {
            url: api.url.clone(),
            via: Via::Tcp(api),
            http: reqwest::Client::builder()
                .no_proxy()
                .build()
                .context("cannot build the HTTP client")?,
            home: home.to_path_buf(),
            verified: tokio::sync::OnceCell::new(),
        })
    }

    /// Checks that the API at `api.json`'s address is this home's daemon,
    /// without sending the token.
    async fn verify(&self, api: &ApiFile) -> Result<()> {
        let mut nonce = [0u8; 32];
        getrandom::fill(&mut nonce).map_err(|e| anyhow::anyhow!("no randomness: {e}"))?;
        let not_ours = |why: &str| {
            anyhow::anyhow!(
                "the process answering on {} is not the daemon of home {} ({why}); the token was \
                 not sent. The daemon probably died and left a stale {}; start it again with \
                 `nuwa-node --home {} run`",
                api.url,
                self.home.display(),
                home::API_FILE,
                self.home.display()
            )
        };
        let resp = self
            .http
            .post(format!("{}/v1/challenge", api.url))
            .json(&ChallengeBody {
                nonce: hex::encode(nonce),
            })
            .timeout(std::time::Duration::from_secs(10))
            .send()
            .await
            .map_err(|e| {
                if e.is_connect() {
                    no_daemon(&self.home)
                } else {
                    not_ours(&format!("no answer to the challenge: {e}"))
                }
            })?;
        if !resp.status().is_success() {
            return Err(not_ours(&format!("challenge answered {}", resp.status())));
        }
        let reply: ChallengeReply = resp
            .json()
            .await
            .map_err(|e| not_ours(&format!("malformed challenge reply: {e}")))?;
        let expected = challenge_mac(&api.token, &nonce);
        let given = hex::decode(&reply.mac).unwrap_or_default();
        use subtle::ConstantTimeEq as _;
        if !bool::from(given.as_slice().ct_eq(&expected)) {
            return Err(not_ours("it cannot prove it holds the token"));
        }
        if reply.pid != api.pid {
            return Err(not_ours(&format!(
                "its pid is {}, api.json says {}",
                reply.pid, api.pid
            )));
        }
        Ok(())
    }

    async fn send(&self, req: reqwest::RequestBuilder) -> Result<reqwest::Response> {
        let req = match &self.via {
            Via::Socket => req,
            Via::Tcp(api) => {
                self.verified.get_or_try_init(|| self.verify(api)).await?;
                req.bearer_auth(&api.token)
            }
        };
        let resp = req.send().await.map_err(|e| {
            if e.is_connect() {
                no_daemon(&self.home)
            } else {
                anyhow::anyhow!("request to the daemon failed: {e}")
            }
        })?;
        if resp.status().is_success() {
            return Ok(resp);
        }
        let status = resp.status();
        let body: serde_json::Value = resp.json().await.unwrap_or_default();
        let msg = body["error"]["message"].as_str().unwrap_or("no details");
        let code = body["error"]["code"].as_str().unwrap_or("error");
        bail!("daemon refused the request ({status}, {code}): {msg}")
    }

    /// The request builder for `path` (`/v1/...`) with `method`.
    fn to(&self, method: reqwest::Method, path: &str) -> reqwest::RequestBuilder {
        self.http.request(method, format!("{}{path}", self.url))
    }

    /// Sends `req` on `rt` and decodes the JSON reply.
    fn call_on<R: serde::de::DeserializeOwned>(
        &self,
        rt: &tokio::runtime::Runtime,
        req: reqwest::RequestBuilder,
    ) -> Result<R> {
        rt.block_on(async {
            let r = self.send(req).await?;
            r.json().await.context("malformed reply from the daemon")
        })
    }

    /// Sends `req` and decodes the JSON reply.
    fn call<R: serde::de::DeserializeOwned>(&self, req: reqwest::RequestBuilder) -> Result<R> {
        self.call_on(&runtime()?, req)
    }

    /// GETs `path` and decodes the JSON reply.
    fn get<R: serde::de::DeserializeOwned>(&self, path: &str) -> Result<R> {
        self.call(self.to(reqwest::Method::GET, path))
    }

    /// POSTs `body` as JSON to `path` and decodes the JSON reply.
    fn post<R: serde::de::DeserializeOwned>(
        &self,
        path: &str,
        body: &impl serde::Serialize,
    ) -> Result<R> {
        self.call(self.to(reqwest::Method::POST, path).json(body))
    }
}

/// Stdout was closed by its reader (e.g. `| head`): not a failure of the
/// command, so `main` exits 0 without a message.
#[derive(Debug, thiserror::Error)]
#[error("stdout is closed")]
pub struct StdoutClosed;

/// Writes `line` and a newline to stdout, and flushes.
fn write_line(line: &str) -> Result<()> {
    use std::io::Write as _;
    let mut out = std::io::stdout().lock();
    match writeln!(out, "{line}").and_then(|()| out.flush()) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Err(StdoutClosed.into()),
        Err(e) => Err(e).context("cannot write to stdout"),
    }
}

/// Prints `value` as one line of compact JSON on stdout (the `--json`
/// output of every command).
pub fn print_json<T: serde::Serialize + ?Sized>(value: &T) -> Result<()> {
    write_line(&serde_json::to_string(value)?)
}

/// Prints `value` indented, for people.
fn print_pretty<T: serde::Serialize + ?Sized>(value: &T) -> Result<()> {
    write_line(&serde_json::to_string_pretty(value)?)
}

/// Asks before a destructive command: shows `what`, then wants `answer`
/// typed back. Without a terminal on stdin there is nobody to ask, so it
/// refuses and names `--yes`.
pub fn confirm(what: &str, answer: &str) -> Result<()> {
    use std::io::{BufRead as _, IsTerminal as _, Write as _};
    if !std::io::stdin().is_terminal() {
        bail!(
            "{what} Refusing without confirmation: stdin is not a terminal. Pass --yes to do it \
             anyway"
        );
    }
    let mut err = std::io::stderr().lock();
    write!(err, "{what}\nType {answer} to confirm: ")?;
    err.flush()?;
    drop(err);
    let mut line = String::new();
    std::io::stdin()
        .lock()
        .read_line(&mut line)
        .context("cannot read the confirmation")?;
    if line.trim() != answer {
        bail!("not confirmed (expected {answer:?}); nothing was changed");
    }
    Ok(())
}

fn runtime() -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")
}

pub fn status(home: &Path, json: bool) -> Result<()> {
    let st: Status = Client::new(home)?.get("/v1/status")?;
    if json {
        print_json(&st)?;
    } else {
        print!("{}", st.render());
    }
    Ok(())
}

/// `nuwa-node open`: a one-time login link to the status page, printed and,
/// unless `print_only`, opened in the user's browser.
pub fn open(home: &Path, print_only: bool, json: bool) -> Result<()> {
    let c = Client::new(home)?;
    let link: crate::api::LoginLink = c.call(c.to(reqwest::Method::POST, "/v1/login-link"))?;
    if json {
        return print_json(&link);
    }
    if print_only {
        println!("{}", link.url);
        return Ok(());
    }
    println!(
        "status page login link (works once, within {} s):\n  {}",
        link.expires_in_s, link.url
    );
    // The link is a bearer secret until it is spent: it never goes on a
    // command line, where any local user reads it in /proc/*/cmdline.
    // The browser gets a 0600 page in the home that redirects to it (what
    // Jupyter does).
    let opened = redirect_page(home, &link.url).and_then(|page| open_in_browser(&page));
    match opened {
        Ok(()) => println!("opened in your browser"),
        Err(e) => eprintln!("cannot open a browser ({e:#}); open the link above yourself"),
    }
    Ok(())
}

/// The name of the page `open` hands to the browser, in the home.
pub const LOGIN_PAGE_FILE: &str = "status-login.html";

/// Writes `HOME/status-login.html` (mode 0600, written whole and then
/// renamed into place) that sends the browser on to `url`; returns the
/// page's `file://` URL, which holds no secret.
fn redirect_page(home: &Path, url: &str) -> Result<String> {
    // The login URL is ours (http://127.0.0.1:PORT/login?code=HEX), but
    // quote it for HTML and JavaScript all the same.
    let attr = url
        .replace('&', "&amp;")
        .replace('"', "&quot;")
        .replace('<', "&lt;");
    let js = serde_json::to_string(url)?.replace('<', "\\u003c");
    let html = format!(
        "<!doctype html>\n<html><head><meta charset=\"utf-8\">\n\
         <meta http-equiv=\"refresh\" content=\"0;url={attr}\">\n\
         <title>nuwa-node status</title></head>\n\
         <body><script>location.replace({js});</script>\n\
         <p><a href=\"{attr}\">Open the nuwa-node status page</a></p></body></html>\n"
    );
    let path = home.join(LOGIN_PAGE_FILE);
    crate::home::write_private(&path, html.as_bytes())
        .with_context(|| format!("cannot write {}", path.display()))?;
    let abs = std::fs::canonicalize(&path)?;
    reqwest::Url::from_file_path(&abs)
        .map(String::from)
        .map_err(|()| anyhow::anyhow!("{} is no absolute path", abs.display()))
}

/// Hands `url` to the desktop's opener: `open` on macOS, `xdg-open`
/// elsewhere.
fn open_in_browser(url: &str) -> Result<()> {
    let opener = if cfg!(target_os = "macos") {
        "open"
    } else {
        "xdg-open"
    };
    let status = std::process::Command::new(opener)
        .arg(url)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .with_context(|| format!("cannot run {opener}"))?;
    if !status.success() {
        bail!("{opener} failed ({status})");
    }
    Ok(())
}

/// The running daemon's status report, for `doctor`: the same checks as
/// every command (api.json's pid alive, the challenge answered) before the
/// token is sent, and at most `timeout` for the answer.
pub fn fetch_status(home: &Path, timeout: std::time::Duration) -> Result<Status> {
    let c = Client::new(home)?;
    c.call(c.to(reqwest::Method::GET, "/v1/status").timeout(timeout))
}

/// The rows of `device list`: the daemon's, else the home's with a note
/// saying where they came from.
fn device_rows(home: &Path, now: u64) -> Result<(Vec<DeviceEntry>, Option<String>)> {
    match Client::new(home) {
        Ok(c) => Ok((c.get("/v1/devices")?, None)),
        Err(_) => device_list_offline(home, now).map(|(rows, note)| (rows, Some(note))),
    }
}

/// The context id of the device `given` names: its context id, or its
/// name as `device list` shows it (the rule is the core's).
pub fn resolve_device(home: &Path, given: &str) -> Result<String> {
    let (rows, _) = device_rows(home, home::now_ms())?;
    Ok(nuwa_agent::devices::resolve(&rows, given)?)
}

/// `device rename`: this device's name, in its home.
pub fn rename(home: &Path, name: &str, json: bool) -> Result<()> {
    let (rows, _) = device_rows(home, home::now_ms())?;
    let h = home::load(home)?;
    nuwa_agent::devices::check_rename(&rows, &h.info.context_id, name)?;
    home::rename(home, &h.info, name)?;
    let running = Client::new(home).is_ok();
    if json {
        let id = &h.info.context_id;
        return print_json(
            &serde_json::json!({"context_id": id, "name": name, "daemon_running": running}),
        );
    }
    println!("this device ({}) is now named {name:?}", h.info.context_id);
    if running {
        println!("the running daemon announces it once restarted: stop it and start it again");
    } else {
        println!("peers learn it when the daemon next runs");
    }
    Ok(())
}

pub fn device_list(home: &Path, json: bool) -> Result<()> {
    let now = home::now_ms();
    let (entries, offline) = device_rows(home, now)?;
    if json {
        print_json(&entries)?;
    } else {
        print!("{}", nuwa_agent::devices::render(&entries, now));
        if let Some(note) = offline {
            println!("{note}");
        }
    }
    Ok(())
}

/// `device list` without a daemon: statuses from the DID log, names and
/// last-seen times from the record the daemon keeps in the store. Returns
/// the rows and a line saying where they came from.
fn device_list_offline(home: &Path, now: u64) -> Result<(Vec<DeviceEntry>, String)> {
    let h = home::load(home)?;
    // The store is the daemon's: open it only while holding the home lock
    // (another command may be writing the home; then the log alone).
    let seen = match home::try_lock(home)? {
        Some(_lock) => Some(
            match nuwa_store::Storage::get_meta(&store_of(&h)?, nuwa_agent::devices::SEEN_META) {
                Ok(Some(bytes)) => nuwa_agent::devices::Seen::from_bytes(&bytes),
                _ => nuwa_agent::devices::Seen::default(),
            },
        ),
        None => None,
    };
    let me = (h.info.context_id.as_str(), h.info.name.as_str());
    Ok(nuwa_agent::devices::list_offline(
        &h.log,
        seen.as_ref(),
        me,
        now,
    ))
}

pub fn put(home: &Path, container: &str, key: &str, value: &str, json: bool) -> Result<()> {
    let value: serde_json::Value = serde_json::from_str(value)
        .with_context(|| format!("{value:?} is not valid JSON; quote strings, e.g. '\"text\"'"))?;
    let body = PutBody {
        container: container.to_owned(),
        key: key.to_owned(),
        value,
    };
    let reply: PutReply = Client::new(home)?.post("/v1/state/put", &body)?;
    if json {
        return print_json(&reply);
    }
    println!(
        "ok {} {} durable={}",
        reply.container, reply.key, reply.durable
    );
    Ok(())
}

/// Reads and checks every line of an NDJSON import: (line number, the
/// operation as sent).
fn read_import(file: &Path) -> Result<Vec<(usize, serde_json::Value)>> {
    use std::io::BufRead as _;
    let reader: Box<dyn std::io::BufRead> = if file == Path::new("-") {
        Box::new(std::io::BufReader::new(std::io::stdin()))
    } else {
        Box::new(std::io::BufReader::new(
            std::fs::File::open(file).with_context(|| format!("cannot open {}", file.display()))?,
        ))
    };
    let mut lines = ImportLines::default();
    for (i, line) in reader.lines().enumerate() {
        let n = i + 1;
        let line = line.with_context(|| format!("cannot read line {n} of {}", file.display()))?;
        lines.push(n, &line);
    }
    lines
        .finish(&file.display().to_string())
        .map_err(anyhow::Error::msg)
}

/// `state import`: sends the operations of an NDJSON file in batches.
pub fn import(home: &Path, file: &Path, batch_size: usize, json: bool) -> Result<()> {
    let ops = read_import(file)?;
    if ops.is_empty() {
        if json {
            return print_json(&serde_json::json!({
                "operations": 0, "applied": 0, "failed": 0, "durable": true, "failures": [],
            }));
        }
        println!("nothing to import: {} has no operations", file.display());
        return Ok(());
    }
    let c = Client::new(home)?;
    // Drawn on stderr, and hidden when stderr is not a terminal.
    let bar = indicatif::ProgressBar::new(ops.len() as u64).with_style(
        indicatif::ProgressStyle::with_template(
            "{bar:40} {pos}/{len} operations  {per_sec}  eta {eta}",
        )
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    let started = std::time::Instant::now();
    let mut tally = ImportTally::default();
    let rt = runtime()?;
    let mut start = 0;
    while start < ops.len() {
        let chunk = &ops[start..batch_end(&ops, start, batch_size)];
        let body = serde_json::json!({
            "ops": chunk.iter().map(|(_, v)| v).collect::<Vec<_>>(),
        });
        let reply: crate::api::BatchReply = c.call_on(
            &rt,
            c.to(reqwest::Method::POST, "/v1/state.batch").json(&body),
        )?;
        tally.add(chunk, &reply);
        bar.inc(chunk.len() as u64);
        start += chunk.len();
    }
    bar.finish_and_clear();
    let secs = started.elapsed().as_secs_f64();
    if json {
        print_json(&tally.to_json(ops.len(), secs))?;
    } else {
        for line in tally.failure_lines() {
            eprintln!("{line}");
        }
        println!("{}", tally.summary(ops.len(), secs));
    }
    if let Some(e) = tally.error() {
        bail!(e);
    }
    Ok(())
}

/// The home's store, opened with its at-rest key (hold the home's lock).
fn store_of(h: &home::Home) -> Result<nuwa_store::SledStore> {
    nuwa_store::SledStore::open(&h.dir.join(home::STORE_DIR), h.at_rest.clone())
        .with_context(|| format!("cannot open the store in {}", h.dir.display()))
}

/// A read with `--offline` on the home itself, holding its lock: `None`
/// when a daemon runs on the home (it holds the store), so the read goes
/// through it and prints the same.
fn read_offline(
    home: &Path,
    name: &str,
    read: impl FnOnce(Option<&Container>, &Registry) -> Result<Vec<u8>, ApiError>,
) -> Result<Option<Vec<u8>>> {
    let h = home::load(home)?;
    let Some(_lock) = home::try_lock(home)? else {
        Client::new(home).map_err(|_| {
            anyhow::anyhow!(
                "home {} is locked by another nuwa-node command and no daemon answers on it; \
                 run this again once that command has finished",
                home.display()
            )
        })?;
        return Ok(None);
    };
    let store = store_of(&h)?;
    let actor = nuwa_agent::sync::run_actor(&h.device.public())?;
    let load = |n| crate::daemon::load_container(&store, &actor, n).map(|l| l.map(|l| l.container));
    let (registry, _) = nuwa_agent::asm::registry_of(load(REGISTRY_CONTAINER)?.as_ref());
    let bytes = read(load(name)?.as_ref(), &registry);
    Ok(Some(bytes.map_err(|e| {
        anyhow::anyhow!("{} ({})", e.message, e.code)
    })?))
}

pub fn get(home: &Path, q: GetQuery, offline: bool, json: bool) -> Result<()> {
    let name = q.container.clone();
    let value: serde_json::Value = match offline
        .then(|| read_offline(home, &name, |c, reg| nuwa_agent::read::get(c, reg, &q)))
        .transpose()?
        .flatten()
    {
        Some(bytes) => serde_json::from_slice(&bytes)?,
        None => {
            let c = Client::new(home)?;
            let mut query = vec![("container", q.container.as_str())];
            if let Some(k) = &q.key {
                query.push(("key", k));
            }
            if q.raw {
                query.push(("raw", "true"));
            }
            c.call(c.to(reqwest::Method::GET, "/v1/state/get").query(&query))?
        }
    };
    if json {
        print_json(&value)
    } else {
        print_pretty(&value)
    }
}

/// `state events`: prints the daemon's change events until interrupted.
/// A closed stdout (a reader such as `head` that has had enough) ends it
/// quietly.
pub fn events(home: &Path, container: Option<&str>, json: bool) -> Result<()> {
    let c = Client::new(home)?;
    let closed = runtime()?.block_on(async {
        let mut req = c.to(reqwest::Method::GET, "/v1/state.events");
        if let Some(name) = container {
            req = req.query(&[("container", name)]);
        }
        let mut resp = c.send(req).await?;
        let mut sse = SseParser::default();
        // A closed pipe shows only on the next write, which may be long in
        // coming: look for it meanwhile.
        let mut check = tokio::time::interval(std::time::Duration::from_millis(250));
        loop {
            let chunk = tokio::select! {
                chunk = resp.chunk() => chunk.context("the event stream from the daemon broke")?,
                _ = check.tick() => {
                    if stdout_closed() {
                        return Err(StdoutClosed.into());
                    }
                    continue;
                }
            };
            let Some(chunk) = chunk else { break };
            for (event, data) in sse.push(&chunk) {
                print_event(&event, &data, json)?;
            }
        }
        Ok::<(), anyhow::Error>(())
    });
    match closed {
        Ok(()) => bail!("the daemon ended the event stream (it is shutting down?)"),
        Err(e) if e.is::<StdoutClosed>() => Ok(()),
        Err(e) => Err(e),
    }
}

/// Whether stdout is a pipe or socket whose reader has gone.
#[cfg(unix)]
fn stdout_closed() -> bool {
    let mut fd = libc::pollfd {
        fd: libc::STDOUT_FILENO,
        events: 0,
        revents: 0,
    };
    // SAFETY: one valid pollfd, no waiting.
    let n = unsafe { libc::poll(&mut fd, 1, 0) };
    n > 0 && fd.revents & (libc::POLLERR | libc::POLLHUP) != 0
}

#[cfg(not(unix))]
fn stdout_closed() -> bool {
    false
}

/// Prints one server-sent event.
fn print_event(event: &str, data: &str, json: bool) -> Result<()> {
    let line = match event {
        "ready" => {
            if !json {
                eprintln!("watching for changes (Ctrl-C to stop)...");
            }
            return Ok(());
        }
        "lagged" => {
            eprintln!("warning: this reader fell behind and missed {data} event(s)");
            return Ok(());
        }
        "change" if json => data.to_owned(),
        "change" => change_line(data).context("malformed change event from the daemon")?,
        _ => return Ok(()),
    };
    write_line(&line)
}

pub fn export(home: &Path, container: &str, out: &Path, offline: bool, json: bool) -> Result<()> {
    let export = |c: Option<&Container>, _: &Registry| nuwa_agent::read::export(c, container);
    let bytes = match offline
        .then(|| read_offline(home, container, export))
        .transpose()?
        .flatten()
    {
        Some(bytes) => bytes,
        None => {
            let c = Client::new(home)?;
            let query = [("container", container)];
            let req = c.to(reqwest::Method::GET, "/v1/state/export").query(&query);
            let r = runtime()?.block_on(async {
                let r = c.send(req).await?;
                r.bytes()
                    .await
                    .context("reading the export from the daemon")
            });
            r?.to_vec()
        }
    };
    std::fs::write(out, &bytes).with_context(|| format!("cannot write {}", out.display()))?;
    if json {
        return print_json(&serde_json::json!({
            "container": container, "out": out.display().to_string(), "bytes": bytes.len(),
        }));
    }
    println!("wrote {} bytes to {}", bytes.len(), out.display());
    Ok(())
}

pub fn approve(
    home: &Path,
    code: &str,
    name: Option<String>,
    timeout: std::time::Duration,
    (recovery, expires_secs): (bool, Option<u64>),
    json: bool,
) -> Result<()> {
    let c = Client::new(home).map_err(|_| {
        anyhow::anyhow!(
            "no nuwa-node daemon is running for home {}; `device approve` runs inside it (it \
             searches the network for the new device). Start it with `nuwa-node --home {} run`",
            home.display(),
            home.display()
        )
    })?;
    eprintln!(
        "looking for the device showing {code} (up to {} s; 10 s if no device shows it)...",
        timeout.as_secs()
    );
    let body = ApproveBody {
        code: code.to_owned(),
        name,
        timeout_secs: Some(timeout.as_secs()),
        recovery,
        expires_secs,
    };
    let r: ApproveReply = c.call(
        c.to(reqwest::Method::POST, "/v1/devices/approve")
            .timeout(timeout + std::time::Duration::from_secs(30))
            .json(&body),
    )?;
    if json {
        return print_json(&r);
    }
    println!("{r}");
    Ok(())
}

pub fn revoke(home: &Path, id: &str, json: bool) -> Result<()> {
    device_change(home, "/v1/devices/revoke", id, json, |h, admin, now| {
        let me = &h.info.context_id;
        let r = nuwa_agent::lifecycle::revoke(&h.log, &h.keys, admin, id, me, now)?;
        home::save_epoch(home, &r.log, &r.keys, &r.grant)?;
        let (epoch, did_log_len, remaining) = (r.epoch, r.log.len(), r.remaining);
        let revoked = id.to_owned();
        Ok(RevokeReply {
            revoked,
            epoch,
            did_log_len,
            remaining,
        })
    })
}

/// A change to a device (`revoke`, `promote`, `demote`): on the home's
/// files with `offline` when no daemon holds the home (peers learn it
/// when the daemon next starts), else through the daemon at `path`.
fn device_change<R>(
    home: &Path,
    path: &str,
    context_id: &str,
    json: bool,
    offline: impl FnOnce(&home::Home, &nuwa_agent::lifecycle::Admin, i64) -> Result<R>,
) -> Result<()>
where
    R: serde::Serialize + serde::de::DeserializeOwned + std::fmt::Display,
{
    let r: R = match home::try_lock(home)? {
        Some(lock) => home::change_offline(home, lock, offline)?,
        None => Client::new(home)?.post(
            path,
            &crate::api::DeviceBody {
                context_id: context_id.to_owned(),
            },
        )?,
    };
    if json {
        return print_json(&r);
    }
    println!("{r}");
    Ok(())
}

/// `device provision`: through the daemon when one runs on this home (so
/// that its DID log and the files never fork), on the files otherwise.
pub fn provision(
    home: &Path,
    out: &Path,
    name: &str,
    expires_secs: Option<u64>,
) -> Result<crate::api::ProvisionReply> {
    if home::try_lock(home)?.is_some() {
        let expires = expires_secs.map(|s| expiry::expires_at(home::now_unix_secs(), s));
        let info = home::provision(home, out, name, expires.clone())?;
        return Ok(crate::api::ProvisionReply {
            context_id: info.context_id,
            name: info.name,
            out: out.display().to_string(),
            did_log_len: home::load(home)?.log.len(),
            expires,
        });
    }
    // The lock was held: a daemon runs (or another command is writing, in
    // which case the client finds no daemon and says so).
    let out =
        std::path::absolute(out).with_context(|| format!("cannot resolve {}", out.display()))?;
    Client::new(home)?.post(
        "/v1/devices/provision",
        &crate::api::ProvisionBody {
            out: out.display().to_string(),
            name: name.to_owned(),
            expires_secs,
        },
    )
}

/// Prints a reply: compact JSON with `json`, else `text` for people, else
/// the JSON indented.
pub fn print_reply(v: &serde_json::Value, json: bool, text: Option<String>) -> Result<()> {
    match text {
        _ if json => print_json(v),
        Some(t) => write_line(t.trim_end()),
        None => print_pretty(v),
    }
}

/// GETs `path` of the daemon and decodes its reply.
pub fn get_json<R: serde::de::DeserializeOwned>(home: &Path, path: &str) -> Result<R> {
    Client::new(home)?.get(path)
}

/// POSTs `body` as JSON to `path` of the daemon and decodes its reply.
pub fn post_json<B: serde::Serialize, R: serde::de::DeserializeOwned>(
    home: &Path,
    path: &str,
    body: &B,
) -> Result<R> {
    Client::new(home)?.post(path, body)
}

/// `device promote` / `device demote`.
pub fn admin_change(home: &Path, promote: bool, id: &str, json: bool) -> Result<()> {
    let (path, change) = match promote {
        true => ("/v1/devices/promote", "promoted"),
        false => ("/v1/devices/demote", "demoted"),
    };
    device_change(home, path, id, json, |h, admin, now| {
        let log = match promote {
            true => nuwa_agent::lifecycle::promote(&h.log, admin, id, now)?,
            false => nuwa_agent::lifecycle::demote(&h.log, admin, id, now)?,
        };
        home::save_log(home, &log)?;
        let (change, subject, did_log_len) = (change.to_owned(), id.to_owned(), log.len());
        Ok(crate::api::AdminReply {
            change,
            subject,
            did_log_len,
        })
    })
}
