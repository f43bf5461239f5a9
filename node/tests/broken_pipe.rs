//! Issue 14: under `nuwa-node run 2>&1 | tee log`, a Ctrl-C kills `tee` with
//! the daemon; the daemon's next log line hit the closed pipe, the write
//! error was reported with `eprintln!`, which panicked, the panic hook logged
//! through the same broken writer, panicked again, and the process aborted
//! (exit 134) leaving a stale `api.json`. A broken stdout or stderr must
//! cost log lines, never the daemon's clean shutdown.

mod common;

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use common::*;

/// Starts `run` on `home` with stdout and stderr to one pipe, debug logs (so
/// that every turn writes), loopback only and no multicast.
fn start(home: &Path) -> (Child, std::io::PipeReader) {
    let (reader, writer) = std::io::pipe().expect("pipe");
    let child = Command::new(bin())
        .arg("--home")
        .arg(home)
        .args([
            "run",
            "--listen",
            "/ip4/127.0.0.1/tcp/0",
            "--no-mdns",
            "--no-dht",
            "--no-rendezvous",
        ])
        .env("RUST_LOG", "debug")
        .stdin(Stdio::null())
        .stdout(writer.try_clone().expect("clone the pipe"))
        .stderr(writer)
        .spawn()
        .expect("spawn nuwa-node run");
    (child, reader)
}

fn sigint(child: &Child) {
    let ok = Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .expect("run kill");
    assert!(ok.success(), "kill -INT failed");
}

fn wait_exit(child: &mut Child) -> std::process::ExitStatus {
    wait_for("daemon exit after SIGINT", Duration::from_secs(30), || {
        child.try_wait().expect("wait for the daemon")
    })
}

// Goal: the `tee` case. Method: read the daemon's output until it says it
// runs, close the reading end (as `tee` dies on Ctrl-C), then SIGINT: the
// shutdown's log lines meet EPIPE, and the daemon still exits 0 and removes
// api.json.
#[test]
fn reader_gone_before_sigint_still_shuts_down_cleanly() {
    let c = Cluster::new();
    let home = c.init("a");
    let (mut child, reader) = start(&home);
    let mut lines = BufReader::new(reader);
    let mut seen = String::new();
    wait_for(
        "`daemon running` in the output",
        Duration::from_secs(30),
        || {
            let mut line = String::new();
            match lines.read_line(&mut line) {
                Ok(0) => panic!("the daemon closed its output early:\n{seen}"),
                Ok(_) => {
                    seen.push_str(&line);
                    line.contains("daemon running").then_some(())
                }
                Err(e) => panic!("cannot read the daemon's output: {e}"),
            }
        },
    );
    assert!(home.join("api.json").exists(), "no api.json while running");
    drop(lines);
    sigint(&child);
    let st = wait_exit(&mut child);
    assert_eq!(
        st.code(),
        Some(0),
        "the daemon did not exit cleanly with its output closed ({st})"
    );
    assert!(
        !home.join("api.json").exists(),
        "api.json left behind after a clean exit"
    );
}

// Goal: a daemon whose output is closed from the very start serves its API
// and shuts down cleanly. Method: close the pipe's reading end before the
// daemon writes anything, wait for its API (every log line so far failed
// with EPIPE), SIGINT, check exit 0 and api.json gone.
#[test]
fn output_closed_from_the_start_does_not_abort() {
    let c = Cluster::new();
    let home = c.init("a");
    let (mut child, reader) = start(&home);
    drop(reader);
    wait_for("the daemon's API", Duration::from_secs(30), || {
        if let Some(st) = child.try_wait().expect("wait for the daemon") {
            panic!("the daemon exited with its output closed ({st})");
        }
        status(&home).ok()
    });
    sigint(&child);
    let st = wait_exit(&mut child);
    assert_eq!(st.code(), Some(0), "exit status {st}");
    assert!(!home.join("api.json").exists(), "api.json left behind");
}
