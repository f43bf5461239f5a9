//! Reading a home with no daemon (`state get --offline`, `state export
//! --offline`) after `sync --once`, and a revoked device that lists the
//! writes that will never sync and still exports them: real processes.

mod common;

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use common::*;
use serde_json::{Value, json};

const NOTE: &str = "did:nuwa:state:note#v1";
const N1: &str = "11111111-1111-4111-8111-111111111111";
const N2: &str = "22222222-2222-4222-8222-222222222222";

/// `args` with `--json`, parsed.
fn json_of(home: &Path, args: &[&str]) -> Value {
    let mut with = args.to_vec();
    with.push("--json");
    serde_json::from_str(&cli_ok(home, &with)).unwrap()
}

/// The stderr of a command that must fail.
fn fails(home: &Path, args: &[&str]) -> String {
    let out = cli(home, args);
    assert!(!out.status.success(), "{args:?} succeeded");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// `state export CONTAINER --out FILE` (with `extra`), read back as an
/// Automerge document's JSON.
fn exported(home: &Path, container: &str, file: &Path, extra: &[&str]) -> Value {
    let mut args = vec![
        "state",
        "export",
        container,
        "--out",
        file.to_str().unwrap(),
    ];
    args.extend_from_slice(extra);
    cli_ok(home, &args);
    let bytes = std::fs::read(file).unwrap();
    nuwa_agent::state::Container::load(&[9; 16], Some(&bytes), Vec::new())
        .unwrap()
        .to_json()
}

// Goal: after `sync --once` on a provisioned CI home, `state get --offline`
// and `state export --offline` print what the daemon would (an untyped and
// a typed NIP-8 container) with no daemon running, write no plaintext into
// the home, and refuse clearly an unknown container, a home that is not
// one and a home another command holds; with a daemon running they go
// through it. Method: two homes, real processes.
#[test]
fn sync_once_then_read_the_home_without_a_daemon() {
    isolated("sync_once_then_read_the_home_without_a_daemon", || {
        let mut c = Cluster::new();
        let a = c.init("a");
        let ci = c.provision(&a, "ci");
        c.start(&a, &[]);
        let marker = unique_marker();
        cli_ok(
            &a,
            &["state", "put", "notes", "today", &json!(marker).to_string()],
        );
        cli_ok(&a, &["state", "schema", "add", &note_schema_file()]);
        let object = json!({"title": "t", "body": "b", "tags": ["x"],
            "createdAt": "2026-11-21T09:00:00Z", "updatedAt": "2026-11-21T09:00:00Z"});
        cli_ok(
            &a,
            &[
                "state",
                "create",
                "--schema",
                NOTE,
                "--object",
                &object.to_string(),
                "--id",
                N1,
            ],
        );
        let typed_on_a = json_of(&a, &["state", "get", NOTE]);
        assert_eq!(typed_on_a[N1]["title"], json!("t"), "{typed_on_a}");

        let out = Command::new(bin())
            .arg("--home")
            .arg(&ci)
            .args(["sync", "--once", "--timeout", "30s"])
            .args(["--listen", "/ip4/127.0.0.1/tcp/0", "--mdns-interface", "lo"])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );

        // No daemon on ci: the plain read fails and says so, --offline reads.
        assert!(fails(&ci, &["state", "get", "notes"]).contains("no nuwa-node daemon"));
        let notes = json_of(&ci, &["state", "get", "notes", "--offline"]);
        assert_eq!(notes, json!({"today": marker}));
        let today = json_of(&ci, &["state", "get", "notes", "today", "--offline"]);
        assert_eq!(today, json!(marker));
        let typed = json_of(&ci, &["state", "get", NOTE, "--offline"]);
        assert_eq!(
            typed, typed_on_a,
            "a typed container reads as through the daemon"
        );
        let raw = json_of(&ci, &["state", "get", NOTE, "--raw", "--offline"]);
        let file = c.home("notes.automerge");
        assert_eq!(exported(&ci, "notes", &file, &["--offline"]), notes);
        assert!(
            files_containing(&ci, marker.as_bytes()).is_empty(),
            "an offline read left plaintext in the home"
        );

        // Clear refusals.
        let err = fails(&ci, &["state", "get", "nosuch", "--offline"]);
        assert!(
            err.contains("\"nosuch\" does not exist on this device"),
            "{err}"
        );
        let err = fails(&ci, &["state", "get", NOTE, N2, "--offline"]);
        assert!(err.contains("no live object"), "{err}");
        let empty = c.home("empty");
        std::fs::create_dir(&empty).unwrap();
        let err = fails(&empty, &["state", "get", "notes", "--offline"]);
        assert!(err.contains("is not a nuwa-node home"), "{err}");
        // Another command holds the home's lock, and no daemon answers.
        let lock = std::fs::OpenOptions::new()
            .write(true)
            .open(ci.join("daemon.lock"))
            .unwrap();
        lock.try_lock().unwrap();
        let err = fails(&ci, &["state", "get", "notes", "--offline"]);
        assert!(err.contains("locked by another nuwa-node command"), "{err}");
        drop(lock);

        // With a daemon on the home, --offline reads through it: the same.
        c.start(&ci, &["--no-mdns", "--no-known-peers"]);
        assert_eq!(json_of(&ci, &["state", "get", "notes", "--offline"]), notes);
        assert_eq!(json_of(&ci, &["state", "get", "notes"]), notes);
        assert_eq!(json_of(&ci, &["state", "get", NOTE]), typed);
        assert_eq!(json_of(&ci, &["state", "get", NOTE, "--raw"]), raw);
        assert_eq!(json_of(&ci, &["state", "get", NOTE, "--offline"]), typed);
        let through = c.home("through.automerge");
        assert_eq!(exported(&ci, "notes", &through, &[]), notes);
    });
}

// Goal: a device revoked while it was off takes writes until it learns it
// (durable=true), then `status` (text and --json) counts the local changes
// made after the revocation, per container, and `state export` (daemon and
// --offline) still reads them. Method: revoke r while it is stopped; start
// it alone, write; start the admin, which tells r; read r.
#[test]
fn a_revoked_device_lists_what_never_syncs_and_exports_it() {
    isolated(
        "a_revoked_device_lists_what_never_syncs_and_exports_it",
        || {
            let mut c = Cluster::new();
            let a = c.init("a");
            let r = c.provision(&a, "r");
            let (ia, ir) = (c.start(&a, &[]), c.start(&r, &[]));
            cli_ok(&a, &["state", "put", "notes", "before", "1"]);
            wait_for("r to hold the first write", Duration::from_secs(15), || {
                (get_json(&r, "notes")? == json!({"before": 1})).then_some(())
            });
            c.stop(ir);
            // A DID entry's time has whole seconds: the revocation must
            // fall in a later second than r's last change before it (its
            // start writes the core containers' genesis), or those would
            // count as made at or after it. This run is fast enough for
            // both to share a second.
            let stopped_s = unix_ms() / 1000;
            wait_for("the next second", Duration::from_secs(3), || {
                (unix_ms() / 1000 > stopped_s).then_some(())
            });
            cli_ok(&a, &["device", "revoke", "--yes", &context_id(&r)]);
            c.stop(ia);

            // r alone does not know: it takes writes, durably.
            let ir = c.start(&r, &[]);
            for k in ["x1", "x2", "x3"] {
                let out = cli_ok(&r, &["state", "put", "notes", k, "\"lost\""]);
                assert!(out.contains("durable=true"), "{out}");
            }
            cli_ok(&r, &["state", "put", "todo", "y", "1"]);
            assert_eq!(status(&r).unwrap()["device"]["revoked"], json!(false));

            // The admin comes back and tells it.
            c.start(&a, &[]);
            let st = wait_for("r to know it was revoked", Duration::from_secs(45), || {
                let st = status(&r).ok()?;
                (st["device"]["revoked"] == json!(true)).then_some(st)
            });
            let n = &st["device"]["never_syncs"];
            assert_eq!(n["containers"], json!({"notes": 3, "todo": 1}), "{n}");
            assert_eq!(n["changes"], json!(4), "{n}");
            assert_eq!(n["complete"], json!(true), "{n}");
            assert!(
                n["revoked_at_unix_ms"].as_u64().unwrap()
                    <= n["learned_at_unix_ms"].as_u64().unwrap()
            );
            let text = cli_ok(&r, &["status"]);
            assert!(text.lines().next().unwrap().contains("REVOKED"), "{text}");
            assert!(
                text.contains("4 local change(s) made after this device was revoked are refused by every device that knows of the revocation: notes (3), todo (1)"),
                "{text}"
            );
            let expected = json!({"before": 1, "x1": "lost", "x2": "lost", "x3": "lost"});
            let file = c.home("r-notes.automerge");
            assert_eq!(exported(&r, "notes", &file, &[]), expected);
            assert!(get_json(&a, "notes").is_some_and(|v| v.get("x1").is_none()));

            // Stopped, the record stays and the home still reads.
            c.stop(ir);
            assert_eq!(exported(&r, "notes", &file, &["--offline"]), expected);
            assert_eq!(
                json_of(&r, &["state", "get", "todo", "--offline"]),
                json!({"y": 1})
            );
            c.start(&r, &["--no-mdns", "--no-known-peers"]);
            assert_eq!(status(&r).unwrap()["device"]["never_syncs"], *n);
        },
    );
}

fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}
