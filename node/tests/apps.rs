//! Apps of the agent with their own rights (issue 25, done-when 1): a test
//! app written in JavaScript (`tests/apps/app.mjs`, which uses only
//! `scripts/app-client/nuwa_app.mjs`, the format docs/api.md documents)
//! against two real daemons of one agent.

mod common;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::*;
use serde_json::{Value, json};

const WEATHER: &str = "did:nuwa:cap:weather:state:Item#v1";
const NEWS: &str = "did:nuwa:cap:news:state:Item#v1";

fn script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/apps/app.mjs")
}

/// Runs the test app; its one line of JSON.
fn app(args: &[&str]) -> Value {
    let out = Command::new("node")
        .arg(script())
        .args(args)
        .output()
        .expect("node is needed for this test (.ci/run installs it)");
    assert!(
        out.status.success(),
        "app {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "app {args:?} printed no JSON ({e}): {}",
            String::from_utf8_lossy(&out.stdout)
        )
    })
}

fn url(home: &Path) -> String {
    let api: Value =
        serde_json::from_slice(&std::fs::read(home.join("api.json")).unwrap()).unwrap();
    api["url"].as_str().unwrap().to_owned()
}

/// One signed call of the app: (status, body).
fn call(
    home: &Path,
    cap: &Path,
    seed: &str,
    method: &str,
    path: &str,
    body: Option<Value>,
    action: &str,
) -> (u16, Value) {
    let body = body.map(|b| b.to_string()).unwrap_or_else(|| "-".into());
    let r = app(&[
        "call",
        &url(home),
        cap.to_str().unwrap(),
        seed,
        method,
        path,
        &body,
        action,
    ]);
    (r["status"].as_u64().unwrap() as u16, r["body"].clone())
}

fn get_path(container: &str) -> String {
    format!(
        "/v1/state/get?container={}",
        container.replace(':', "%3A").replace('#', "%23")
    )
}

fn code(body: &Value) -> &str {
    body["error"]["code"].as_str().unwrap_or("")
}

fn schema(ns: &str) -> Value {
    json!({
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": format!("did:nuwa:cap:{ns}:state:Item#v1"),
        "type": "object",
        "properties": {"id": {"type": "string"}, "text": {"type": "string"}},
        "required": ["id", "text"],
    })
}

// Goal: done-when 1 of issue 25, end to end. An app holding a capability
// for did:nuwa:cap:weather: writes and reads its private container and is
// refused another app's private container, in reads, queries and
// state.events (whose stream carries nothing of it); it delegates a
// read-only capability to a second key, which reads and is refused
// writing; after `app revoke` on the laptop, both keys are refused on the
// phone within seconds; an expired capability, a replayed signature, a
// tampered body and a foreign agent's chain are each refused and counted;
// a public container is read (not written) by any app, a shared one only
// with a capability naming it. Method: two real daemons of one agent, the
// app in Node.js.
#[test]
fn an_app_with_its_own_rights_across_two_devices() {
    isolated("an_app_with_its_own_rights_across_two_devices", || {
        let mut c = Cluster::new();
        let laptop = c.init("laptop");
        let phone = c.provision(&laptop, "phone");
        c.start(&laptop, &[]);
        c.start(&phone, &[]);
        let phone_id = context_id(&phone);
        wait_for("laptop and phone verified", Duration::from_secs(20), || {
            (verified(&status(&laptop).ok()?) == vec![phone_id.clone()]).then_some(())
        });
        for ns in ["weather", "news"] {
            let f = c.dir.path().join(format!("{ns}.json"));
            std::fs::write(&f, schema(ns).to_string()).unwrap();
            cli_ok(&laptop, &["state", "schema", "add", f.to_str().unwrap()]);
        }
        let news_item = json!({"id": "n1", "text": "another app's secret"});
        cli_ok(
            &laptop,
            &[
                "state",
                "create",
                "--schema",
                NEWS,
                "--object",
                &news_item.to_string(),
            ],
        );

        // The app's key (seed byte 7) and its capability.
        let did = app(&["key", "7"]).as_str().unwrap().to_owned();
        let cap1 = c.dir.path().join("weather.cap.json");
        cli_ok(
            &laptop,
            &[
                "app",
                "grant",
                "--to",
                &did,
                "--target",
                "did:nuwa:cap:weather:",
                "--actions",
                "read,query,events,write",
                "--out",
                cap1.to_str().unwrap(),
            ],
        );
        let cap1_id =
            serde_json::from_slice::<Value>(&std::fs::read(&cap1).unwrap()).unwrap()["id"]
                .as_str()
                .unwrap()
                .to_owned();

        // state.events as the app, from before its writes.
        let mut events = Command::new("node")
            .arg(script())
            .args(["events", &url(&laptop), cap1.to_str().unwrap(), "7", "6000"])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let mut ready = String::new();
        BufReader::new(events.stderr.take().unwrap())
            .read_line(&mut ready)
            .unwrap();
        assert_eq!(
            ready.trim(),
            "ready",
            "the app's event stream did not start"
        );

        // Its own private container: write, read, query.
        let w1 = json!({"schema_uri": WEATHER, "object": {"id": "w1", "text": "sunny"}});
        let (st, body) = call(
            &laptop,
            &cap1,
            "7",
            "POST",
            "/v1/state.create",
            Some(w1),
            "write",
        );
        assert_eq!(st, 200, "{body}");
        // The owner writes the other app's container while the app listens.
        let n2 = json!({"id": "n2", "text": "more news"});
        cli_ok(
            &laptop,
            &[
                "state",
                "create",
                "--schema",
                NEWS,
                "--object",
                &n2.to_string(),
            ],
        );
        let (st, body) = call(&laptop, &cap1, "7", "GET", &get_path(WEATHER), None, "read");
        assert_eq!((st, &body["w1"]["text"]), (200, &json!("sunny")), "{body}");
        let q = |from: &str| json!({"query": {"from": from}});
        let (st, body) = call(
            &laptop,
            &cap1,
            "7",
            "POST",
            "/v1/state.query",
            Some(q(WEATHER)),
            "query",
        );
        assert_eq!(st, 200, "{body}");
        assert_eq!(body["items"][0]["id"], "w1", "{body}");

        // Another app's private container: refused everywhere.
        let (st, body) = call(&laptop, &cap1, "7", "GET", &get_path(NEWS), None, "read");
        assert_eq!((st, code(&body)), (403, "forbidden"), "{body}");
        let (st, body) = call(
            &laptop,
            &cap1,
            "7",
            "POST",
            "/v1/state.query",
            Some(q(NEWS)),
            "query",
        );
        assert_eq!((st, code(&body)), (403, "forbidden"), "{body}");
        let news_events = format!(
            "/v1/state.events?container={}",
            NEWS.replace(':', "%3A").replace('#', "%23")
        );
        let (st, body) = call(&laptop, &cap1, "7", "GET", &news_events, None, "events");
        assert_eq!((st, code(&body)), (403, "forbidden"), "{body}");
        let describe = json!({"container": NEWS});
        let (st, body) = call(
            &laptop,
            &cap1,
            "7",
            "POST",
            "/v1/state.describe",
            Some(describe),
            "read",
        );
        assert_eq!((st, code(&body)), (403, "forbidden"), "{body}");
        let (st, body) = call(&laptop, &cap1, "7", "GET", "/v1/status", None, "read");
        assert_eq!((st, code(&body)), (403, "forbidden"), "{body}");
        let (st, body) = call(&laptop, &cap1, "7", "GET", "/v1/schemas", None, "read");
        assert_eq!(st, 200, "{body}");
        assert!(
            !body.to_string().contains("news"),
            "the schema list names the other app: {body}"
        );

        let out = events.wait_with_output().unwrap();
        let seen: Value = serde_json::from_slice(&out.stdout).unwrap();
        let names: Vec<&str> = seen["events"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(Value::as_str)
            .collect();
        assert!(
            names.contains(&WEATHER),
            "the app saw its own write: {seen}"
        );
        assert!(
            !seen.to_string().contains("news"),
            "the app's stream named the other app: {seen}"
        );

        // A read-only capability delegated by the app to a second key.
        let did2 = app(&["key", "8"]).as_str().unwrap().to_owned();
        let cap2 = c.dir.path().join("reader.cap.json");
        app(&[
            "delegate",
            cap1.to_str().unwrap(),
            "7",
            &did2,
            "read,query",
            cap2.to_str().unwrap(),
        ]);
        let (st, body) = call(&laptop, &cap2, "8", "GET", &get_path(WEATHER), None, "read");
        assert_eq!(st, 200, "{body}");
        let w2 = json!({"schema_uri": WEATHER, "object": {"id": "w2", "text": "rain"}});
        let (st, body) = call(
            &laptop,
            &cap2,
            "8",
            "POST",
            "/v1/state.create",
            Some(w2),
            "read",
        );
        assert_eq!((st, code(&body)), (403, "forbidden"), "{body}");

        // Both keys work on the phone (the chain verifies there too) until
        // the laptop revokes the app.
        wait_for(
            "the app's write on the phone",
            Duration::from_secs(20),
            || {
                let (st, body) = call(&phone, &cap2, "8", "GET", &get_path(WEATHER), None, "read");
                (st == 200 && body["w1"]["text"] == "sunny").then_some(())
            },
        );
        cli_ok(&laptop, &["app", "revoke", &cap1_id]);
        let revoked_at = Instant::now();
        wait_for(
            "both keys refused on the phone",
            Duration::from_secs(20),
            || {
                let (s1, b1) = call(&phone, &cap1, "7", "GET", &get_path(WEATHER), None, "read");
                let (s2, b2) = call(&phone, &cap2, "8", "GET", &get_path(WEATHER), None, "read");
                (s1 == 401
                    && s2 == 401
                    && b1.to_string().contains("capability_revoked")
                    && b2.to_string().contains("capability_revoked"))
                .then_some(())
            },
        );
        println!(
            "revoked on the laptop, refused on the phone after {:?}",
            revoked_at.elapsed()
        );
        let listed = cli_ok(&laptop, &["--json", "app", "list"]);
        assert!(listed.contains("\"revoked\":true"), "{listed}");

        // An expired capability.
        let cap3 = c.dir.path().join("short.cap.json");
        cli_ok(
            &laptop,
            &[
                "app",
                "grant",
                "--to",
                &did,
                "--target",
                "did:nuwa:cap:weather:",
                "--actions",
                "read",
                "--expires",
                "2s",
                "--out",
                cap3.to_str().unwrap(),
            ],
        );
        let (st, body) = wait_for(
            "the short capability to expire",
            Duration::from_secs(15),
            || {
                let (st, body) = call(&laptop, &cap3, "7", "GET", &get_path(WEATHER), None, "read");
                (st != 200).then_some((st, body))
            },
        );
        assert_eq!(st, 401, "{body}");
        assert!(body.to_string().contains("capability_expired"), "{body}");

        // A replayed signature and a tampered body, under a live capability.
        let cap4 = c.dir.path().join("live.cap.json");
        cli_ok(
            &laptop,
            &[
                "app",
                "grant",
                "--to",
                &did,
                "--target",
                "did:nuwa:cap:weather:",
                "--actions",
                "read,write",
                "--out",
                cap4.to_str().unwrap(),
            ],
        );
        let nonce = "replayed-nonce-0123456789";
        let once = |n: &str| {
            app(&[
                "call",
                &url(&laptop),
                cap4.to_str().unwrap(),
                "7",
                "GET",
                &get_path(WEATHER),
                "-",
                "read",
                n,
            ])
        };
        assert_eq!(once(nonce)["status"], 200);
        let again = once(nonce);
        assert_eq!(again["status"], 401, "{again}");
        assert!(again.to_string().contains("replayed_nonce"), "{again}");
        let tampered = app(&["tampered", &url(&laptop), cap4.to_str().unwrap(), "7"]);
        assert_eq!(tampered["status"], 401, "{tampered}");
        assert!(
            tampered.to_string().contains("digest_mismatch"),
            "{tampered}"
        );

        // Another agent's chain: a root capability signed by a key that is
        // no admin of this agent.
        let forged = c.dir.path().join("forged.cap.json");
        app(&[
            "forge",
            "9",
            &did,
            "did:nuwa:cap:weather:",
            "read",
            forged.to_str().unwrap(),
        ]);
        let (st, body) = call(
            &laptop,
            &forged,
            "7",
            "GET",
            &get_path(WEATHER),
            None,
            "read",
        );
        assert_eq!(st, 401, "{body}");
        assert!(body.to_string().contains("not_an_admin"), "{body}");

        // Shared and public containers: a public board any app may read
        // (not write), a shared document only a capability naming it
        // exactly reaches.
        for (id, vis) in [
            ("did:nuwa:app:board:state:Post#v1", "public"),
            ("did:nuwa:app:team:state:Doc#v1", "shared"),
        ] {
            let mut sch = schema("x");
            sch["$id"] = json!(id);
            sch["x-asm"] = json!({"x-visibility": vis});
            let f = c.dir.path().join(format!("{vis}.json"));
            std::fs::write(&f, sch.to_string()).unwrap();
            cli_ok(&laptop, &["state", "schema", "add", f.to_str().unwrap()]);
            let obj = json!({"id": "o1", "text": vis});
            cli_ok(
                &laptop,
                &[
                    "state",
                    "create",
                    "--schema",
                    id,
                    "--object",
                    &obj.to_string(),
                ],
            );
        }
        let board = "did:nuwa:app:board:state:Post#v1";
        let team = "did:nuwa:app:team:state:Doc#v1";
        let (st, body) = call(&laptop, &cap4, "7", "GET", &get_path(board), None, "read");
        assert_eq!((st, &body["o1"]["text"]), (200, &json!("public")), "{body}");
        let post = json!({"schema_uri": board, "object": {"id": "o2", "text": "spam"}});
        let (st, body) = call(
            &laptop,
            &cap4,
            "7",
            "POST",
            "/v1/state.create",
            Some(post),
            "write",
        );
        assert_eq!((st, code(&body)), (403, "forbidden"), "{body}");
        let (st, body) = call(&laptop, &cap4, "7", "GET", &get_path(team), None, "read");
        assert_eq!((st, code(&body)), (403, "forbidden"), "{body}");
        let cap5 = c.dir.path().join("team.cap.json");
        cli_ok(
            &laptop,
            &[
                "app",
                "grant",
                "--to",
                &did,
                "--target",
                team,
                "--actions",
                "read",
                "--out",
                cap5.to_str().unwrap(),
            ],
        );
        let (st, body) = call(&laptop, &cap5, "7", "GET", &get_path(team), None, "read");
        assert_eq!((st, &body["o1"]["text"]), (200, &json!("shared")), "{body}");

        // Each refusal is counted by its reason.
        for reason in [
            "capability_expired",
            "replayed_nonce",
            "digest_mismatch",
            "not_an_admin",
            "container_not_covered",
            "wrong_action",
        ] {
            let n = metric(
                &laptop,
                &format!("nuwa_api_errors_total{{code=\"{reason}\"}}"),
            );
            assert!(n >= 1.0, "{reason} was not counted");
        }
        assert!(metric(&phone, "nuwa_api_errors_total{code=\"capability_revoked\"}") >= 2.0);
    });
}
