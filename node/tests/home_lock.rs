//! Fault 2 of issue 11: `device provision` while the home's daemon runs
//! used to write `did-log.json` behind the daemon's back; a later `device
//! revoke` through the daemon signed from its own copy, the logs forked,
//! and the provisioned device was refused for good while it kept syncing
//! with the revoked one. Now every change to a home's files holds the home
//! lock, and goes through the daemon when one runs.

mod common;

use std::time::Duration;

use common::*;

// Goal: provision a device against a home whose daemon runs, revoke another
// device through that daemon, then start both: the new device is admitted
// and syncs, the revoked one is refused.
#[test]
fn provision_while_the_daemon_runs_then_revoke_keeps_one_log() {
    isolated(
        "provision_while_the_daemon_runs_then_revoke_keeps_one_log",
        || {
            let mut c = Cluster::new();
            let a = c.init("a");
            let old = c.provision(&a, "old");
            c.start(&a, &["--no-mdns"]);
            let a_addr = listen_addr(&a);
            // Through the running daemon.
            let new = c.provision(&a, "new");
            let log_len = |home: &std::path::Path| {
                let log: serde_json::Value =
                    serde_json::from_slice(&std::fs::read(home.join("did-log.json")).unwrap())
                        .unwrap();
                log.as_array()
                    .or_else(|| log["entries"].as_array())
                    .map(Vec::len)
            };
            assert_eq!(log_len(&new), log_len(&a), "one log, on both homes");
            cli_ok(&a, &["device", "revoke", "--yes", &context_id(&old)]);
            cli_ok(&a, &["state", "put", "notes", "after", "\"revocation\""]);
            c.start(&new, &["--no-mdns", "--peer", &a_addr]);
            c.start(&old, &["--no-mdns", "--peer", &a_addr]);
            wait_for("the new device syncs", Duration::from_secs(30), || {
                get_json(&new, "notes").filter(|v| v["after"] == "revocation")
            });
            let new_id = context_id(&new);
            let old_id = context_id(&old);
            let st = wait_for(
                "the revoked device is refused",
                Duration::from_secs(30),
                || {
                    status(&a).ok().filter(|st| {
                        st["counters"]
                            .as_object()
                            .is_some_and(|m| m.keys().any(|k| k.starts_with("rejected_connection")))
                    })
                },
            );
            let peers = verified(&st);
            assert!(peers.contains(&new_id), "{peers:?}");
            // Status says how the peer is reached: directly, over TCP.
            let new_peer = st["peers"]
                .as_array()
                .unwrap()
                .iter()
                .find(|p| p["context_id"] == new_id.as_str())
                .unwrap();
            assert_eq!(
                (&new_peer["transport"], &new_peer["relayed"]),
                (&serde_json::json!("tcp"), &serde_json::json!(false)),
                "{new_peer}"
            );
            assert!(cli_ok(&a, &["status"]).contains("(direct tcp"));
            assert!(!peers.contains(&old_id), "{peers:?}");
            let new_status = status(&new).unwrap();
            assert!(
                !new_status.to_string().contains("did_log_fork"),
                "{new_status}"
            );
            assert!(get_json(&old, "notes").is_none_or(|v| v.get("after").is_none()));
        },
    );
}

// Goal: two home-changing commands never run at once on one home: with
// the lock held (as a running `pair` or `provision` holds it), `init` into
// the same directory is refused with a clear message.
#[test]
fn a_locked_home_is_not_initialised_twice() {
    let dir = tempfile::tempdir().unwrap();
    let home = dir.path().join("h");
    std::fs::create_dir(&home).unwrap();
    let lock = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(home.join("daemon.lock"))
        .unwrap();
    lock.try_lock().unwrap();
    let out = cli(&home, &["init", "--name", "x", "--i-have-written-it-down"]);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("already running with home"), "{stderr}");
    assert!(!home.join("device.key").exists());
}
