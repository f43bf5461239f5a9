//! The CLI's one grammar, against real daemons: `--json` on every command
//! that prints data, `state events`, confirmation of destructive commands,
//! the user's view of typed containers, `device list` without a daemon, and
//! JSON errors for unknown routes.

mod common;

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::Duration;

use common::*;
use serde_json::{Value, json};

const NOTE: &str = "did:nuwa:state:note#v1";
const LIVE: &str = "11111111-1111-4111-8111-111111111111";
const GONE: &str = "22222222-2222-4222-8222-222222222222";

fn note(title: &str) -> String {
    json!({"title": title, "body": "b", "tags": ["x", "y"],
           "createdAt": "2026-11-21T09:00:00Z", "updatedAt": "2026-11-21T09:00:00Z"})
    .to_string()
}

/// Runs a command with `--json` and parses its stdout as one JSON value.
fn json_of(home: &std::path::Path, args: &[&str]) -> Value {
    let mut with = args.to_vec();
    with.push("--json");
    let out = cli_ok(home, &with);
    assert_eq!(
        out.trim_end().lines().count(),
        1,
        "{args:?} --json printed more than one line:\n{out}"
    );
    serde_json::from_str(&out).unwrap_or_else(|e| panic!("{args:?} --json: {e}\n{out}"))
}

/// GET or any method on the running daemon of `home`, with its token:
/// (status, body as JSON).
fn http(home: &std::path::Path, method: &str, path: &str) -> (u16, Value) {
    let api: Value =
        serde_json::from_slice(&std::fs::read(home.join("api.json")).unwrap()).unwrap();
    let url = format!("{}{path}", api["url"].as_str().unwrap());
    let token = api["token"].as_str().unwrap().to_owned();
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(async {
            let http = reqwest::Client::builder().no_proxy().build().unwrap();
            let resp = http
                .request(method.parse().unwrap(), &url)
                .bearer_auth(&token)
                .header("content-type", "application/json")
                .body(r#"{"schema_uri": "x", "object": {}}"#)
                .send()
                .await
                .unwrap();
            let status = resp.status().as_u16();
            let text = resp.text().await.unwrap();
            let body = serde_json::from_str(&text)
                .unwrap_or_else(|e| panic!("{method} {path}: body is not JSON ({e}): {text:?}"));
            (status, body)
        })
}

// Goal: every data command's --json output is one JSON document, the flag
// works before and after the command, and typed `get` shows the user's view
// (no tombstone, sets as arrays) while --raw shows the stored document.
// Method: one daemon; run each command with --json and parse it.
#[test]
fn json_everywhere_and_the_users_view() {
    isolated("json_everywhere_and_the_users_view", || {
        let mut c = Cluster::new();
        let a = c.home("a");
        let init = json_of(&a, &["init", "--name", "a", "--i-have-written-it-down"]);
        assert_eq!(init["name"], "a");
        assert!(init["did"].as_str().unwrap().starts_with("did:"));
        let prov = json_of(
            &a,
            &[
                "device",
                "provision",
                "--out",
                c.home("b").to_str().unwrap(),
                "--name",
                "b",
            ],
        );
        assert_eq!(prov["name"], "b");
        c.start(&a, &[]);
        // Without --name, through the daemon as offline (issue 25 finding 4:
        // it failed with bad_name while the daemon ran).
        let unnamed = c.home("unnamed");
        let prov = json_of(
            &a,
            &["device", "provision", "--out", unnamed.to_str().unwrap()],
        );
        assert_eq!(prov["name"], "", "{prov}");
        let listed = json_of(&a, &["device", "list"]);
        assert!(
            listed
                .to_string()
                .contains(prov["context_id"].as_str().unwrap()),
            "{listed}"
        );

        // The flag before the command, too.
        let out = cli_ok(&a, &["--json", "status"]);
        let st: Value = serde_json::from_str(&out).unwrap();
        assert_eq!(st["device"]["name"], "a");
        assert!(json_of(&a, &["device", "list"]).is_array());
        assert_eq!(
            json_of(&a, &["state", "put", "notes", "k", "1"])["durable"],
            true
        );
        assert_eq!(json_of(&a, &["state", "get", "notes"]), json!({"k": 1}));
        let reg = json_of(&a, &["state", "schema", "add", &note_schema_file()]);
        assert_eq!(reg["id"], NOTE);
        assert!(json_of(&a, &["state", "schema", "list"]).is_array());
        for id in [LIVE, GONE] {
            let r = json_of(
                &a,
                &[
                    "state",
                    "create",
                    "--schema",
                    NOTE,
                    "--id",
                    id,
                    "--object",
                    &note(id),
                ],
            );
            assert_eq!(r["id"], id);
        }
        let r = json_of(
            &a,
            &[
                "state",
                "update",
                "--schema",
                NOTE,
                "--id",
                LIVE,
                "--patch",
                r#"[{"op": "replace", "path": "/title", "value": "kept"}]"#,
            ],
        );
        assert_eq!(r["id"], LIVE);
        let r = json_of(&a, &["state", "delete", "--schema", NOTE, "--id", GONE]);
        assert_eq!(r["mode"], "tombstone");
        let q = json_of(&a, &["state", "query", &json!({"from": NOTE}).to_string()]);
        assert_eq!(q["items"].as_array().unwrap().len(), 1, "{q}");
        assert_eq!(json_of(&a, &["state", "describe", NOTE])["items"], 1);
        assert!(json_of(&a, &["state", "compact", NOTE]).is_object());
        let export = c.dir.path().join("notes.automerge");
        let e = json_of(
            &a,
            &[
                "state",
                "export",
                "notes",
                "--out",
                export.to_str().unwrap(),
            ],
        );
        assert!(e["bytes"].as_u64().unwrap() > 0);
        let ndjson = c.dir.path().join("ops.ndjson");
        std::fs::write(
            &ndjson,
            "{\"op\":\"put\",\"container\":\"steps\",\"key\":\"1\",\"value\":\"plan\"}\n",
        )
        .unwrap();
        let imp = json_of(&a, &["state", "import", ndjson.to_str().unwrap()]);
        assert_eq!(
            (imp["applied"].as_u64(), imp["failed"].as_u64()),
            (Some(1), Some(0))
        );

        // The user's view: the tombstoned note is gone, the set is an array.
        let view = json_of(&a, &["state", "get", NOTE]);
        assert_eq!(
            view,
            json!({LIVE: {"id": LIVE, "title": "kept", "body": "b", "tags": ["x", "y"],
                          "createdAt": "2026-11-21T09:00:00Z",
                          "updatedAt": "2026-11-21T09:00:00Z"}})
        );
        assert_eq!(json_of(&a, &["state", "get", NOTE, LIVE])["title"], "kept");
        let out = cli(&a, &["state", "get", NOTE, GONE]);
        assert!(!out.status.success());
        assert!(
            String::from_utf8_lossy(&out.stderr).contains("no_such_object"),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        // --raw: the stored document, tombstone and set encoding included.
        let raw = json_of(&a, &["state", "get", NOTE, "--raw"]);
        assert_eq!(raw["items"][GONE]["_deleted"], true, "{raw}");
        assert!(raw["items"][LIVE]["tags"].is_object(), "{raw}");
        // Default output is for people: indented JSON.
        assert!(cli_ok(&a, &["state", "get", NOTE]).lines().count() > 3);

        // Unknown routes and wrong methods answer JSON errors.
        let (status, body) = http(&a, "GET", "/v1/nope");
        assert_eq!(
            (status, body["error"]["code"].as_str()),
            (404, Some("not_found"))
        );
        let (status, body) = http(&a, "POST", "/v1/state.craete");
        assert_eq!(
            (status, body["error"]["code"].as_str()),
            (404, Some("not_found"))
        );
        let (status, body) = http(&a, "DELETE", "/v1/status");
        assert_eq!(
            (status, body["error"]["code"].as_str()),
            (405, Some("method_not_allowed"))
        );
    });
}

// Goal: `state reset` refuses without a terminal and without --yes (and
// changes nothing), and works with --yes; `device revoke` likewise refuses.
#[test]
fn destructive_commands_want_yes() {
    isolated("destructive_commands_want_yes", || {
        let mut c = Cluster::new();
        let a = c.init("a");
        let b = c.provision(&a, "b");
        c.start(&a, &[]);
        cli_ok(&a, &["state", "schema", "add", &note_schema_file()]);
        cli_ok(
            &a,
            &[
                "state",
                "create",
                "--schema",
                NOTE,
                "--id",
                LIVE,
                "--object",
                &note("t"),
            ],
        );
        let out = cli(&a, &["state", "reset", NOTE]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success());
        assert!(
            err.contains("--yes") && err.contains("every device"),
            "{err}"
        );
        assert_eq!(json_of(&a, &["state", "describe", NOTE])["items"], 1);

        let out = cli(&a, &["device", "revoke", &context_id(&b)]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success());
        assert!(err.contains("--yes"), "{err}");
        let list = json_of(&a, &["device", "list"]);
        assert!(
            list.as_array()
                .unwrap()
                .iter()
                .all(|d| d["status"] == "active"),
            "{list}"
        );

        let r = json_of(&a, &["state", "reset", NOTE, "--yes"]);
        assert_eq!(r["removed"], 1, "{r}");
        assert_eq!(json_of(&a, &["state", "describe", NOTE])["items"], 0);
    });
}

// Goal: `state events` prints a change another client makes (text and
// NDJSON), ends quietly with exit 0 when its stdout is closed, and `device
// list` after the daemons stopped shows the stored names and a last-seen
// time and says as of when.
// Method: two daemons that verify each other; events on b, writes on a.
#[test]
fn events_and_device_list_offline() {
    isolated("events_and_device_list_offline", || {
        let mut c = Cluster::new();
        let a = c.init("laptop");
        let b = c.provision(&a, "phone");
        let ia = c.start(&a, &[]);
        let ib = c.start(&b, &[]);
        wait_for("a and b verify each other", Duration::from_secs(20), || {
            (verified(&status(&a).ok()?).len() == 1 && verified(&status(&b).ok()?).len() == 1)
                .then_some(())
        });

        for json in [false, true] {
            let mut cmd = Command::new(bin());
            cmd.arg("--home").arg(&b).args(["state", "events"]);
            if json {
                cmd.arg("--json");
            }
            let mut child = cmd
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap();
            // Subscribed once it says so (text) or, for NDJSON, once the
            // daemon holds the subscription: write until a line arrives.
            let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
            let (tx, rx) = std::sync::mpsc::channel();
            std::thread::spawn(move || {
                if let Some(Ok(l)) = lines.next() {
                    let _ = tx.send(l);
                }
            });
            // A new value each time: putting the value a key holds changes
            // nothing and sends no event, so a first put that reached b
            // before the subscription did must not be the only one.
            let key = format!("k{json}");
            let mut n = 0;
            let line = wait_for("an event line", Duration::from_secs(20), || {
                n += 1;
                cli_ok(&a, &["state", "put", "events-test", &key, &n.to_string()]);
                rx.recv_timeout(Duration::from_millis(500)).ok()
            });
            if json {
                let ev: Value = serde_json::from_str(&line).unwrap();
                assert_eq!(ev["container"], "events-test", "{line}");
                assert_eq!(ev["origin"], "peer", "{line}");
            } else {
                assert!(
                    line.contains("events-test") && line.contains("from a peer"),
                    "{line}"
                );
            }
            // Its reader has gone (the thread dropped stdout): the next
            // check of stdout ends it, exit 0.
            let st = wait_for("events to end", Duration::from_secs(10), || {
                child.try_wait().unwrap()
            });
            assert!(st.success(), "events exited {st}");
        }

        c.stop(ib);
        c.stop(ia);
        let out = cli_ok(&a, &["device", "list"]);
        assert!(out.contains("phone") && out.contains("laptop"), "{out}");
        assert!(out.contains("as stored by the daemon at"), "{out}");
        let rows = json_of(&a, &["device", "list"]);
        let phone = rows
            .as_array()
            .unwrap()
            .iter()
            .find(|r| r["name"] == "phone")
            .unwrap_or_else(|| panic!("no stored name for phone: {rows}"));
        assert!(phone["last_seen_unix_ms"].as_u64().is_some(), "{rows}");
        assert!(phone["stored_as_of_unix_ms"].as_u64().is_some(), "{rows}");
    });
}
