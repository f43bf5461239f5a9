//! Real-process tests of the user flows with default flags, on two network
//! namespaces joined by a veth pair: each "machine" has loopback and one LAN
//! interface, as a laptop and a phone on one Wi-Fi do (issue 41, finding 2:
//! with default flags LAN discovery never started on such a machine, and
//! every other test passes a TCP-only `--listen` and `--mdns-interface lo`).
//!
//! The namespaces and their addresses (10.201.x.0/24) exist only for the
//! test and are removed when it ends, also on a panic. Without root they
//! cannot be made: the tests print why and skip.

mod common;

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{bin, wait_for};

/// How many times the pairing flow runs (`NUWA_LAN_RUNS`, default 2).
fn runs() -> usize {
    std::env::var("NUWA_LAN_RUNS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2)
}

/// Whether the test can make namespaces; prints why it skips when not.
fn can_make_namespaces(test: &str) -> bool {
    // SAFETY: geteuid has no preconditions and cannot fail.
    let root = unsafe { libc::geteuid() } == 0;
    let ip = Command::new("ip")
        .arg("-V")
        .output()
        .is_ok_and(|o| o.status.success());
    if !(root && ip) {
        println!(
            "SKIPPED {test}: needs root and iproute2 to create two network namespaces joined \
             by a veth (root: {root}, ip: {ip}); run the tests as root to check LAN discovery \
             with default flags"
        );
    }
    root && ip
}

fn ip(args: &[&str]) {
    let out = Command::new("ip").args(args).output().expect("run ip");
    assert!(
        out.status.success(),
        "ip {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Two namespaces `a` and `b`, each with `lo` and `eth0` (a veth to the
/// other) up with multicast: 10.201.N.1 and 10.201.N.2. Dropping it kills
/// every process inside and deletes both (the veth goes with them).
struct Lan {
    a: String,
    b: String,
}

impl Lan {
    fn new(run: usize) -> Lan {
        let id = std::process::id() % 100_000;
        let lan = Lan {
            a: format!("nuwa-lan-{id}-{run}-a"),
            b: format!("nuwa-lan-{id}-{run}-b"),
        };
        // Made before anything else, so that Drop removes whatever exists.
        ip(&["netns", "add", &lan.a]);
        ip(&["netns", "add", &lan.b]);
        let (va, vb) = (format!("nla{id}x{run}"), format!("nlb{id}x{run}"));
        ip(&[
            "link", "add", &va, "netns", &lan.a, "type", "veth", "peer", "name", &vb, "netns",
            &lan.b,
        ]);
        let subnet = 1 + run % 250;
        for (ns, dev, host) in [(&lan.a, &va, 1), (&lan.b, &vb, 2)] {
            let addr = format!("10.201.{subnet}.{host}/24");
            ip(&[
                "-n",
                ns,
                "link",
                "set",
                "dev",
                "lo",
                "up",
                "multicast",
                "on",
            ]);
            ip(&["-n", ns, "link", "set", "dev", dev, "name", "eth0"]);
            ip(&["-n", ns, "addr", "add", &addr, "dev", "eth0"]);
            ip(&[
                "-n",
                ns,
                "link",
                "set",
                "dev",
                "eth0",
                "multicast",
                "on",
                "up",
            ]);
        }
        lan
    }
}

impl Drop for Lan {
    fn drop(&mut self) {
        for ns in [&self.a, &self.b] {
            if let Ok(out) = Command::new("ip").args(["netns", "pids", ns]).output() {
                for pid in String::from_utf8_lossy(&out.stdout).split_whitespace() {
                    let _ = Command::new("kill").args(["-KILL", pid]).status();
                }
            }
            let _ = Command::new("ip").args(["netns", "del", ns]).status();
        }
    }
}

/// `nuwa-node` (with `args`, its home among them) inside namespace `ns`.
fn in_ns(ns: &str, args: &[&str]) -> Command {
    let mut c = Command::new("ip");
    // From the repository's root, where README's relative paths point.
    c.args(["netns", "exec", ns, bin()])
        .args(args)
        .current_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/.."));
    c
}

fn ok(what: &str, out: Output) -> String {
    assert!(
        out.status.success(),
        "{what} failed ({}):\n{}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A background `nuwa-node` whose stdout and stderr are kept, killed on drop.
struct Bg {
    child: Child,
    out: Arc<Mutex<String>>,
    what: String,
}

impl Bg {
    fn spawn(what: &str, mut c: Command) -> Bg {
        let mut child = c
            .env("RUST_LOG", "info")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {what}: {e}"));
        let out = Arc::new(Mutex::new(String::new()));
        for mut r in [
            Box::new(child.stdout.take().unwrap()) as Box<dyn Read + Send>,
            Box::new(child.stderr.take().unwrap()),
        ] {
            let out = out.clone();
            std::thread::spawn(move || {
                let mut buf = [0u8; 4096];
                while let Ok(n) = r.read(&mut buf) {
                    if n == 0 {
                        break;
                    }
                    out.lock()
                        .unwrap()
                        .push_str(&String::from_utf8_lossy(&buf[..n]));
                }
            });
        }
        Bg {
            child,
            out,
            what: what.to_owned(),
        }
    }

    fn output(&self) -> String {
        self.out.lock().unwrap().clone()
    }

    /// Waits until its output holds `needle`; fails if it exits first.
    fn wait_output(&mut self, needle: &str, timeout: Duration) -> String {
        let what = format!("{} to print {needle:?}", self.what);
        wait_for(&what, timeout, || {
            let out = self.output();
            if out.contains(needle) {
                return Some(out);
            }
            if let Ok(Some(st)) = self.child.try_wait() {
                panic!(
                    "{} exited ({st}) before printing {needle:?}:\n{out}",
                    self.what
                );
            }
            None
        })
    }
}

impl Drop for Bg {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if std::thread::panicking() {
            eprintln!("=== {}\n{}", self.what, self.output());
        }
    }
}

/// Starts `run` on `home` in `ns` with no flag but the home, and waits for
/// its API; its mDNS must be up (not failed, not off).
fn run_daemon(ns: &str, home: &Path, args: &[&str]) -> Bg {
    let h = home.to_str().unwrap();
    let mut all = vec!["--home", h];
    all.extend_from_slice(args);
    let mut d = Bg::spawn(&format!("daemon {h} in {ns}"), in_ns(ns, &all));
    d.wait_output("daemon running", Duration::from_secs(20));
    let st = ok(
        "status",
        in_ns(ns, &["--home", h, "status", "--json"])
            .output()
            .unwrap(),
    );
    let st: serde_json::Value = serde_json::from_str(&st).unwrap();
    assert_eq!(
        st["mdns"]["enabled"],
        serde_json::json!(true),
        "mDNS must run with default flags: {}\n{}",
        st["mdns"],
        d.output()
    );
    assert!(st["mdns"]["error"].is_null(), "{}", st["mdns"]);
    assert!(!d.output().contains("mDNS FAILED"), "{}", d.output());
    d
}

/// Waits until `state get CONTAINER` on `home` in `ns` prints `needle`.
fn wait_state(ns: &str, home: &Path, container: &str, needle: &str) {
    let h = home.to_str().unwrap();
    wait_for(
        &format!("{needle:?} in {container} on {h}"),
        Duration::from_secs(30),
        || {
            let out = in_ns(ns, &["--home", h, "state", "get", container])
                .output()
                .unwrap();
            String::from_utf8_lossy(&out.stdout)
                .contains(needle)
                .then_some(())
        },
    );
}

// Goal: the README's first hour works with default flags on machines that
// have a LAN interface besides loopback: `init`, `run`, `pair` + `device
// approve`, then a write read on the other side, NUWA_LAN_RUNS times.
// Method: fresh namespaces and homes per run; every command with only
// `--home` (and `init`'s scripted confirmation); waits on conditions.
#[test]
fn default_flags_pair_and_sync_across_a_lan() {
    if !can_make_namespaces("default_flags_pair_and_sync_across_a_lan") {
        return;
    }
    for run in 0..runs() {
        let lan = Lan::new(run);
        let dir = tempfile::tempdir().unwrap();
        let (laptop, phone) = (dir.path().join("laptop"), dir.path().join("phone"));
        let (l, p) = (laptop.to_str().unwrap(), phone.to_str().unwrap());
        ok(
            "init",
            in_ns(
                &lan.a,
                &[
                    "--home",
                    l,
                    "init",
                    "--name",
                    "laptop",
                    "--i-have-written-it-down",
                ],
            )
            .output()
            .unwrap(),
        );
        let _a = run_daemon(&lan.a, &laptop, &["run"]);
        let mut pair = Bg::spawn(
            "pair",
            in_ns(&lan.b, &["--home", p, "pair", "--name", "phone"]),
        );
        let out = pair.wait_output("pairing code: ", Duration::from_secs(20));
        let code = out
            .lines()
            .find_map(|l| l.trim().strip_prefix("pairing code: "))
            .unwrap()
            .trim()
            .to_owned();
        let approved = ok(
            "device approve",
            in_ns(&lan.a, &["--home", l, "device", "approve", &code])
                .output()
                .unwrap(),
        );
        assert!(approved.contains("approved: device "), "{approved}");
        let st = wait_for("pair to exit", Duration::from_secs(60), || {
            pair.child.try_wait().unwrap()
        });
        assert!(st.success(), "pair failed ({st}):\n{}", pair.output());
        let _b = run_daemon(&lan.b, &phone, &["run"]);
        let marker = format!("buy milk {run}");
        ok(
            "state put",
            in_ns(
                &lan.a,
                &[
                    "--home",
                    l,
                    "state",
                    "put",
                    "notes",
                    "today",
                    &format!("\"{marker}\""),
                ],
            )
            .output()
            .unwrap(),
        );
        wait_state(&lan.b, &phone, "notes", &marker);
        ok(
            "state put",
            in_ns(
                &lan.b,
                &[
                    "--home",
                    p,
                    "state",
                    "put",
                    "notes",
                    "back",
                    "\"from the phone\"",
                ],
            )
            .output()
            .unwrap(),
        );
        wait_state(&lan.a, &laptop, "notes", "from the phone");
        println!("run {}: paired and synced across the veth", run + 1);
    }
}

/// One shell line of the docs as words: single and double quotes, a
/// trailing `&` and `# comment` (returned apart).
fn words(line: &str) -> (Vec<String>, bool, String) {
    let (mut out, mut cur, mut quote, mut any) = (Vec::new(), String::new(), None, false);
    let mut chars = line.chars();
    let mut comment = String::new();
    while let Some(ch) = chars.next() {
        match (quote, ch) {
            (Some(q), c) if c == q => quote = None,
            (Some(_), c) => cur.push(c),
            (None, '\'' | '"') => (quote, any) = (Some(ch), true),
            (None, '#') if cur.is_empty() => {
                comment = chars.by_ref().collect();
                break;
            }
            (None, c) if c.is_whitespace() => {
                if !cur.is_empty() || any {
                    out.push(std::mem::take(&mut cur));
                }
                any = false;
            }
            (None, c) => cur.push(c),
        }
    }
    if !cur.is_empty() || any {
        out.push(cur);
    }
    let background = out.last().is_some_and(|w| w == "&");
    if background {
        out.pop();
    }
    (out, background, comment.trim().to_owned())
}

/// Runs `init` (as given, without `--i-have-written-it-down`) on a pseudo
/// terminal and types back the words it asks for, as a person would.
fn init_on_a_terminal(ns: &str, args: &[String]) {
    let mut c = Command::new("ip");
    c.args(["netns", "exec", ns, "python3", "-c"])
        .arg("import pty, sys; sys.exit(pty.spawn(sys.argv[1:]) >> 8)")
        .arg(bin())
        .args(args);
    let mut init = Bg::spawn("init on a terminal", c);
    let mut asked = 0;
    loop {
        let out = init.output();
        let prompts: Vec<usize> = out
            .match_indices("type word #")
            .filter_map(|(i, _)| out[i + 11..].split(':').next().and_then(|n| n.parse().ok()))
            .collect();
        if let Some(&n) = prompts.get(asked) {
            let word = out
                .split_whitespace()
                .skip_while(|w| *w != format!("{n}."))
                .nth(1)
                .unwrap_or_else(|| panic!("word #{n} not shown:\n{out}"))
                .to_owned();
            let stdin = init.child.stdin.as_mut().unwrap();
            stdin.write_all(format!("{word}\n").as_bytes()).unwrap();
            stdin.flush().unwrap();
            asked += 1;
            continue;
        }
        if let Some(st) = init.child.try_wait().unwrap() {
            assert!(
                st.success() && asked > 0,
                "init failed ({st}, {asked} asked):\n{out}"
            );
            return;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The docs' commands, run as written but for their paths: each home
/// (`/tmp/a`, `~/.nuwa-laptop`, ...) becomes a directory of `dir`. A
/// daemon (`run`, `&` or not) stays in the background; `pair` too, and
/// its code replaces `CODE`/`ABCD-EFGH`; a `state get`/`state query` is
/// retried until it shows `expect`.
struct Docs<'a> {
    dir: &'a Path,
    homes: Vec<(String, PathBuf)>,
    bg: Vec<Bg>,
    pair: Option<Bg>,
    code: Option<String>,
}

impl Docs<'_> {
    fn home(&mut self, given: &str) -> String {
        if let Some((_, p)) = self.homes.iter().find(|(g, _)| g == given) {
            return p.to_str().unwrap().to_owned();
        }
        let p = self.dir.join(format!("home{}", self.homes.len()));
        self.homes.push((given.to_owned(), p.clone()));
        p.to_str().unwrap().to_owned()
    }

    /// Runs one command line in `ns`.
    fn run(&mut self, ns: &str, line: &str, expect: Option<&str>) {
        let (mut w, background, _) = words(line);
        assert_eq!(w.first().map(String::as_str), Some("nuwa-node"), "{line}");
        w.remove(0);
        let at = w.iter().position(|x| x == "--home").expect("a --home") + 1;
        for word in w.iter_mut() {
            if word.starts_with("/tmp/") || word.starts_with("~/") {
                *word = self.home(word);
            }
            if word == "CODE" || word == "ABCD-EFGH" {
                *word = self
                    .code
                    .take()
                    .expect("a `pair` printed a code before it is used");
            }
        }
        let args: Vec<&str> = w.iter().map(String::as_str).collect();
        let command = args[at + 1..].join(" ");
        println!("{ns}$ nuwa-node {}", args.join(" "));
        if command.starts_with("init") && !command.contains("--i-have-written-it-down") {
            init_on_a_terminal(ns, &w);
        } else if command.starts_with("pair") {
            let mut p = Bg::spawn(line, in_ns(ns, &args));
            let out = p.wait_output("pairing code: ", Duration::from_secs(20));
            self.code = out
                .lines()
                .find_map(|l| l.trim().strip_prefix("pairing code: "))
                .map(|c| c.trim().to_owned());
            self.pair = Some(p);
        } else if command.starts_with("run") || background {
            self.finish_pair();
            let mut d = Bg::spawn(line, in_ns(ns, &args));
            d.wait_output("daemon running", Duration::from_secs(20));
            assert!(!d.output().contains("mDNS FAILED"), "{}", d.output());
            self.bg.push(d);
        } else if let Some(needle) = expect {
            wait_for(
                &format!("{needle:?} from {line}"),
                Duration::from_secs(30),
                || {
                    let out = in_ns(ns, &args).output().unwrap();
                    String::from_utf8_lossy(&out.stdout)
                        .contains(needle)
                        .then_some(())
                },
            );
        } else {
            ok(line, in_ns(ns, &args).output().unwrap());
        }
    }

    /// Waits for an approved `pair` to finish its first sync and exit.
    fn finish_pair(&mut self) {
        if let Some(mut p) = self.pair.take() {
            let st = wait_for("pair to exit", Duration::from_secs(60), || {
                p.child.try_wait().unwrap()
            });
            assert!(st.success(), "pair failed ({st}):\n{}", p.output());
        }
    }
}

/// The lines of `text` that are commands: `nuwa-node` at the start (after
/// indentation), or inside backquotes.
fn commands(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    for line in text.lines() {
        let t = line.trim_start();
        if t.starts_with("nuwa-node ") {
            out.push(t.to_owned());
        }
        for (i, part) in line.split('`').enumerate() {
            if i % 2 == 1 && part.starts_with("nuwa-node --home") {
                out.push(part.to_owned());
            }
        }
    }
    out
}

// Goal: the `--help` Quick start and README's pairing flow work as
// written, with default flags, on machines with a LAN interface. Method:
// their commands parsed from `nuwa-node --help` and README.md and run in
// two namespaces joined by a veth (only the homes' paths replaced): the
// Quick start's devices on one machine and the device it pairs by code on
// the other; README's laptop on one, its phone on the other.
#[test]
fn the_quick_start_and_the_readme_pairing_flow_run_as_written() {
    if !can_make_namespaces("the_quick_start_and_the_readme_pairing_flow_run_as_written") {
        return;
    }
    let lan = Lan::new(250);
    let help = ok(
        "--help",
        Command::new(bin()).arg("--help").output().unwrap(),
    );
    let quick = help
        .split("Quick start")
        .nth(1)
        .expect("--help has a Quick start")
        .split("\n\nOutput:")
        .next()
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let mut docs = Docs {
        dir: dir.path(),
        homes: Vec::new(),
        bg: Vec::new(),
        pair: None,
        code: None,
    };
    let mut ran = 0;
    for line in commands(quick) {
        let (w, _, comment) = words(&line);
        if w.iter().any(|x| x == "revoke") {
            continue; // Removing a device is not this flow.
        }
        // `pair` and the device it adds are the second machine's.
        let ns = if w.iter().any(|x| x == "pair") {
            &lan.b
        } else {
            &lan.a
        };
        let expect = w.contains(&"get".to_owned()).then_some("buy milk");
        docs.run(ns, &line, expect);
        ran += 1;
        if let Some(other) = comment.strip_prefix("likewise for ") {
            let home = w[w.iter().position(|x| x == "--home").unwrap() + 1].clone();
            docs.run(ns, &line.replacen(&home, other, 1), None);
            ran += 1;
        }
    }
    assert!(
        ran >= 7,
        "the Quick start ran only {ran} commands:\n{quick}"
    );
    // The device paired by code holds what the others wrote.
    let c = docs.home("/tmp/c");
    docs.finish_pair();
    let mut d = Bg::spawn("paired device", in_ns(&lan.b, &["--home", &c, "run"]));
    d.wait_output("daemon running", Duration::from_secs(20));
    wait_state(&lan.b, Path::new(&c), "notes", "buy milk");
    drop(d);
    drop(docs);

    // README: the block under "## Using it", up to the first write on the
    // phone's side, which must show the laptop's note.
    let readme = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../README.md"))
        .expect("README.md");
    let block = readme
        .split("## Using it")
        .nth(1)
        .expect("README has ## Using it")
        .split("```sh")
        .nth(1)
        .unwrap()
        .split("```")
        .next()
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let mut docs = Docs {
        dir: dir.path(),
        homes: Vec::new(),
        bg: Vec::new(),
        pair: None,
        code: None,
    };
    let mut phone = None;
    let mut checked = false;
    for line in commands(block) {
        let (w, _, _) = words(&line);
        let home = &w[w.iter().position(|x| x == "--home").unwrap() + 1];
        if w.iter()
            .any(|x| x == "provision" || x == "events" || x == "revoke")
        {
            continue; // Offline provisioning and the endless stream are not this flow.
        }
        if w.iter().any(|x| x == "pair") {
            phone = Some(home.clone());
        }
        let ns = if phone.as_ref() == Some(home) {
            &lan.b
        } else {
            &lan.a
        };
        let query = w.iter().any(|x| x == "query");
        // The note README creates, in whatever form `query` prints it.
        docs.run(ns, &line, query.then_some("2026-11-21T09:00:00Z"));
        checked |= query && ns == &lan.b;
        if checked {
            break;
        }
    }
    assert!(
        checked,
        "README's flow reached no read on the paired device:\n{block}"
    );
}
