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

/// Runs a command that must fail; returns (exit status, stderr).
fn fails(home: &std::path::Path, args: &[&str]) -> (Option<i32>, String) {
    let out = cli(home, args);
    assert!(!out.status.success(), "{args:?} should fail");
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

// Goal: issue 41 finding 7: a device's name (as `device list` shows it)
// stands in for its context id in device commands; a name two devices
// share is refused with both ids, an unknown one with what exists; and
// `device rename` renames this device (peers learn it from its Hellos once
// its daemon restarts). Method: three daemons, two devices named "phone".
#[test]
fn devices_by_name_and_rename() {
    isolated("devices_by_name_and_rename", || {
        let mut c = Cluster::new();
        let a = c.init("laptop");
        let b = c.provision(&a, "phone");
        let t = c.home("tablet");
        cli_ok(
            &a,
            &[
                "device",
                "provision",
                "--out",
                t.to_str().unwrap(),
                "--name",
                "phone",
            ],
        );
        let (ib, it) = (c.start(&b, &[]), c.start(&t, &[]));
        c.start(&a, &[]);
        let (idb, idt) = (context_id(&b), context_id(&t));
        let named = |home: &std::path::Path, id: &str, name: &str| {
            json_of(home, &["device", "list"])
                .as_array()
                .unwrap()
                .iter()
                .any(|d| d["context_id"] == id && d["name"] == name)
        };
        wait_for(
            "the laptop knows both phones by name",
            Duration::from_secs(30),
            || (named(&a, &idb, "phone") && named(&a, &idt, "phone")).then_some(()),
        );

        let (code, err) = fails(&a, &["device", "promote", "phone"]);
        assert_eq!(code, Some(1));
        assert!(
            err.contains("2 devices are named \"phone\"")
                && err.contains(&idb)
                && err.contains(&idt),
            "{err}"
        );
        let (_, err) = fails(&a, &["device", "revoke", "fone", "--yes"]);
        assert!(
            err.contains("no device of this agent has the context id or name \"fone\"")
                && err.contains(&format!("{idb} (phone, active)")),
            "{err}"
        );
        let (_, err) = fails(&a, &["device", "rename", "phone"]);
        assert!(err.contains("is already named \"phone\""), "{err}");

        // The tablet takes its own name; its daemon announces it once
        // restarted.
        let out = cli_ok(&t, &["device", "rename", "tablet"]);
        assert!(
            out.contains("is now named \"tablet\"") && out.contains("restart"),
            "{out}"
        );
        c.stop(it);
        c.start(&t, &[]);
        wait_for(
            "the laptop learns the new name",
            Duration::from_secs(30),
            || named(&a, &idt, "tablet").then_some(()),
        );
        let r = json_of(&a, &["device", "promote", "phone"]);
        assert_eq!(
            (r["change"].as_str(), r["subject"].as_str()),
            (Some("promoted"), Some(idb.as_str()))
        );
        let r = json_of(&a, &["device", "demote", "PHONE", "--yes"]);
        assert_eq!(r["subject"], idb.as_str());
        let r = json_of(&a, &["device", "revoke", "tablet", "--yes"]);
        assert_eq!(r["revoked"], idt.as_str(), "{r}");
        // With no daemon, from the home and the names its daemon stored.
        c.stop(ib);
        let a_daemon = 2;
        c.stop(a_daemon);
        let r = json_of(&a, &["device", "revoke", "phone", "--yes"]);
        assert_eq!(r["revoked"], idb.as_str(), "{r}");
    });
}

// Goal: `app list`, `app revoke`, `state schema add`, `state create` and
// `state query` print text for people without --json (and JSON with it,
// see json_everywhere_and_the_users_view). Method: one daemon; each
// command without --json; its output is no JSON and says what happened.
#[test]
fn text_for_people_unless_json() {
    isolated("text_for_people_unless_json", || {
        let mut c = Cluster::new();
        let a = c.init("a");
        c.start(&a, &[]);
        let not_json = |out: &str| serde_json::from_str::<Value>(out).is_err();
        let out = cli_ok(&a, &["state", "schema", "add", &note_schema_file()]);
        assert!(
            not_json(&out) && out.starts_with(&format!("schema {NOTE} registered")),
            "{out}"
        );
        let out = cli_ok(
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
        assert!(
            out.starts_with(&format!("created {LIVE} in {NOTE}")),
            "{out}"
        );
        let out = cli_ok(&a, &["state", "query", &json!({"from": NOTE}).to_string()]);
        let lines: Vec<&str> = out.lines().collect();
        assert_eq!(lines.len(), 2, "{out}");
        let item: Value = serde_json::from_str(lines[0]).unwrap();
        assert_eq!(
            (item["id"].as_str(), lines[1]),
            (Some(LIVE), "1 item"),
            "{out}"
        );

        let app_key = nuwa_agent::identity::keys::DeviceKey::from_seed(&[7; 32]);
        let did = nuwa_agent::identity::did_key::did_key_from_ed25519(&app_key.public());
        cli_ok(
            &a,
            &[
                "app",
                "grant",
                "--to",
                &did,
                "--target",
                "did:nuwa:cap:weather:",
                "--actions",
                "read",
            ],
        );
        let id = json_of(&a, &["app", "list"])[0]["id"]
            .as_str()
            .unwrap()
            .to_owned();
        let out = cli_ok(&a, &["app", "list"]);
        assert!(
            not_json(&out) && out.starts_with(&format!("{id}  active\n  app {did}\n")),
            "{out}"
        );
        assert!(out.contains("1 capability;"), "{out}");
        let out = cli_ok(&a, &["app", "revoke", &id]);
        assert!(
            out.starts_with(&format!("revoked capability {id}: every device refuses it")),
            "{out}"
        );
        let listed = json_of(&a, &["app", "list"]);
        assert_eq!(listed[0]["revoked"], true, "{listed}");
    });
}

// Goal: `sync --once` exits with a status a script can tell apart: 2 for
// a usage or configuration error, 3 when no peer was reached (saying so
// on stderr every few seconds while it waits), 0 once converged (with the
// outcome in --json). Method: a device alone, then with its peer running.
#[test]
fn sync_once_exit_codes() {
    isolated("sync_once_exit_codes", || {
        let mut c = Cluster::new();
        let a = c.init("a");
        let b = c.provision(&a, "b");
        let (code, err) = fails(&b, &["sync", "--once", "--peer", "not-an-address"]);
        assert_eq!(code, Some(2), "{err}");
        assert!(err.contains("\"not-an-address\""), "{err}");
        let config = b.join("config.toml");
        let kept = std::fs::read_to_string(&config).unwrap();
        std::fs::write(&config, "[network\n").unwrap();
        assert_eq!(
            fails(&b, &["sync", "--once"]).0,
            Some(2),
            "a broken config.toml"
        );
        std::fs::write(&config, kept).unwrap();
        assert_eq!(fails(&b, &["sync"]).0, Some(2));
        assert_eq!(
            fails(&b, &["sync", "--once", "--timeout", "soon"]).0,
            Some(2)
        );
        assert_eq!(fails(&c.home("none"), &["sync", "--once"]).0, Some(2));

        let started = std::time::Instant::now();
        let (code, err) = fails(&b, &["sync", "--once", "--timeout", "11s", "--no-mdns"]);
        assert_eq!(code, Some(3), "{err}");
        assert!(
            err.contains("no peer reachable before the timeout"),
            "{err}"
        );
        let progress: Vec<&str> = err.lines().filter(|l| l.contains("s left)")).collect();
        assert!(progress.len() >= 3, "progress every 5 s of 11 s:\n{err}");
        assert!(progress[0].starts_with("peers verified: 0"), "{err}");
        assert!(started.elapsed() < Duration::from_secs(30));

        c.start(&a, &[]);
        let out = Command::new(bin())
            .arg("--home")
            .arg(&b)
            .args(["--json", "sync", "--once", "--timeout", "30s", "--listen"])
            .args(["/ip4/127.0.0.1/tcp/0", "--mdns-interface", "lo"])
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert_eq!(
            out.status.code(),
            Some(0),
            "{stdout}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let r: Value = serde_json::from_str(&stdout).unwrap();
        assert_eq!(
            (r["converged"].as_bool(), r["outcome"].as_str()),
            (Some(true), Some("converged"))
        );
    });
}

// Goal: a used login link shows a browser a page that says so and how to
// get a new link, and an API client the JSON error. Method: spend a link
// of `open --print`, then ask for it again as a browser and as curl.
#[test]
fn a_used_login_link_shows_a_page() {
    isolated("a_used_login_link_shows_a_page", || {
        let mut c = Cluster::new();
        let a = c.init("a");
        c.start(&a, &[]);
        let link = cli_ok(&a, &["open", "--print"]).trim().to_owned();
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let http = reqwest::Client::builder()
            .no_proxy()
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .unwrap();
        let get = |accept: &str| {
            rt.block_on(async {
                let r = http
                    .get(&link)
                    .header("accept", accept)
                    .send()
                    .await
                    .unwrap();
                let ty = r.headers().get("content-type");
                let ty = ty
                    .map(|t| t.to_str().unwrap().to_owned())
                    .unwrap_or_default();
                (r.status().as_u16(), ty, r.text().await.unwrap())
            })
        };
        let browser = "text/html,application/xhtml+xml,*/*;q=0.8";
        assert_eq!(get(browser).0, 303, "the first use logs in");
        let (st, ty, body) = get(browser);
        assert_eq!(
            (st, ty.as_str()),
            (403, "text/html; charset=utf-8"),
            "{body}"
        );
        assert!(
            body.contains("already used") && body.contains("nuwa-node open"),
            "{body}"
        );
        let (st, ty, body) = get("*/*");
        assert_eq!(
            (st, ty.starts_with("application/json")),
            (403, true),
            "{body}"
        );
        assert!(body.contains("bad_login_link"), "{body}");
    });
}
