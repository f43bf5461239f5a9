//! `run --log-file DIR --log-keep N --log-format json`: the daemon logs to a
//! daily file in DIR, keeps at most N such files, writes one JSON object per
//! line, and flushes everything it queued before it exits.

mod common;

use std::process::{Command, Stdio};
use std::time::Duration;

use common::*;

// Goal: file logging works end to end. Method: put ten old log files in
// the directory, run with --log-keep 3 and JSON, wait for the API, SIGTERM;
// then at most three log files remain, today's among them, stderr stayed
// quiet, and today's file holds valid JSON lines from start ("daemon
// running") to the very end ("stopped cleanly", written just before exit,
// so it proves the non-blocking writer was flushed).
#[test]
fn json_logs_rotate_are_bounded_and_flushed_at_exit() {
    let c = Cluster::new();
    let home = c.init("a");
    let logs = c.home("logs");
    std::fs::create_dir_all(&logs).unwrap();
    for day in 1..=10 {
        std::fs::write(
            logs.join(format!("nuwa-node.2020-01-{day:02}.log")),
            "old\n",
        )
        .unwrap();
    }
    let stderr_file = c.home("stderr");
    let mut child = Command::new(bin())
        .arg("--home")
        .arg(&home)
        .args([
            "run",
            "--listen",
            "/ip4/127.0.0.1/tcp/0",
            "--no-mdns",
            "--no-dht",
            "--no-rendezvous",
            "--log-format",
            "json",
            "--log-keep",
            "3",
        ])
        .env("NUWA_LOG_FILE", &logs)
        .env("RUST_LOG", "info")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&stderr_file).unwrap())
        .spawn()
        .expect("spawn nuwa-node run");
    wait_for("the daemon's API", Duration::from_secs(30), || {
        if let Some(st) = child.try_wait().unwrap() {
            panic!(
                "the daemon exited early ({st}):\n{}",
                std::fs::read_to_string(&stderr_file).unwrap_or_default()
            );
        }
        status(&home).ok()
    });
    let ok = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(ok.success());
    let st = wait_for("daemon exit", Duration::from_secs(30), || {
        child.try_wait().unwrap()
    });
    assert!(st.success(), "exit status {st}");

    let mut files: Vec<String> = std::fs::read_dir(&logs)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("nuwa-node.") && n.ends_with(".log"))
        .collect();
    files.sort();
    assert!(files.len() <= 3, "--log-keep 3 kept {files:?}");
    let today = files
        .iter()
        .find(|n| !n.starts_with("nuwa-node.2020-"))
        .unwrap_or_else(|| panic!("no log file for today in {files:?}"));
    let text = std::fs::read_to_string(logs.join(today)).unwrap();
    let messages: Vec<String> = text
        .lines()
        .map(|l| {
            let v: serde_json::Value =
                serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}"));
            assert!(v["timestamp"].is_string() && v["level"].is_string(), "{l}");
            v["fields"]["message"]
                .as_str()
                .unwrap_or_default()
                .to_owned()
        })
        .collect();
    for want in ["daemon running", "stopped cleanly"] {
        assert!(
            messages.iter().any(|m| m == want),
            "{want:?} missing from the log file:\n{text}"
        );
    }
    let stderr = std::fs::read_to_string(&stderr_file).unwrap();
    assert!(
        stderr.trim().is_empty(),
        "with --log-file, logs should not go to stderr:\n{stderr}"
    );
}
