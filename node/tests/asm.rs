//! The Agent State Model with real daemons: core models, a registered
//! schema, concurrent typed edits on two devices, queries, deletes, error
//! paths, and TTL trimming on every device. Each test runs in its own
//! network namespace (see `common::isolated`).

mod common;

use std::path::Path;
use std::time::Duration;

use common::*;
use serde_json::{Value, json};

const NOTE: &str = "did:nuwa:state:note#v1";
const LOG: &str = "did:nuwa:core:ConversationLog#v1";
const CORE: [&str; 3] = [
    "did:nuwa:core:ConversationLog#v1",
    "did:nuwa:core:MemoryStore#v1",
    "did:nuwa:core:AgentSettings#v1",
];

fn json_out(home: &Path, args: &[&str]) -> Value {
    let args = [args, &["--json"]].concat();
    serde_json::from_str(&cli_ok(home, &args)).unwrap()
}

/// Runs a CLI call that must fail; returns its stderr.
fn fails(home: &Path, args: &[&str]) -> String {
    let out = cli(home, args);
    assert!(!out.status.success(), "{args:?} should fail");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

fn query(home: &Path, q: Value) -> Value {
    json_out(home, &["state", "query", &q.to_string()])
}

/// A query that may fail (e.g. before the schema reached this device).
fn try_query(home: &Path, q: &Value) -> Option<Value> {
    let out = cli(home, &["--json", "state", "query", &q.to_string()]);
    if !out.status.success() {
        return None;
    }
    serde_json::from_slice(&out.stdout).ok()
}

/// `state update` of a note.
fn update_note(home: &Path, id: &str, patch: Value) {
    cli_ok(
        home,
        &[
            "state",
            "update",
            "--schema",
            NOTE,
            "--id",
            id,
            "--patch",
            &patch.to_string(),
        ],
    );
}

fn heads(home: &Path, container: &str) -> Value {
    json_out(home, &["state", "describe", container])["heads"].clone()
}

fn rfc3339(secs_ago: i64) -> String {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64;
    time::OffsetDateTime::from_unix_timestamp(now - secs_ago)
        .unwrap()
        .format(&time::format_description::well_known::Rfc3339)
        .unwrap()
}

/// POSTs raw bytes to the daemon's API (for bodies too big for argv).
fn post_raw(home: &Path, path: &str, body: Vec<u8>) -> (u16, Value) {
    let api: Value =
        serde_json::from_slice(&std::fs::read(home.join("api.json")).unwrap()).unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let r = reqwest::Client::builder()
            .no_proxy()
            .build()
            .unwrap()
            .post(format!("{}{path}", api["url"].as_str().unwrap()))
            .bearer_auth(api["token"].as_str().unwrap())
            .header("content-type", "application/json")
            .body(body)
            .send()
            .await
            .unwrap();
        let status = r.status().as_u16();
        (status, r.json().await.unwrap_or(Value::Null))
    })
}

// Goal: done-when 1, 2 (end to end) and 3. From a fresh agent the three core
// models exist exactly once, also when two devices start apart; the NIP-7
// note schema registers; objects are created, edited concurrently on two
// devices (while apart), queried and deleted, and both devices end with
// the same results; bad input gets clear errors and changes nothing.
#[test]
fn typed_state_converges_on_two_devices() {
    isolated("typed_state_converges_on_two_devices", || {
        let mut c = Cluster::new();
        let a = c.init("a");
        let b = c.provision(&a, "b");
        // Apart: each device creates the core models on its own...
        let apart = [
            "--no-mdns",
            "--no-known-peers",
            "--no-dht",
            "--no-rendezvous",
        ];
        let ia = c.start(&a, &apart);
        let ib = c.start(&b, &apart);
        for name in CORE {
            let da = json_out(&a, &["state", "describe", name]);
            let db = json_out(&b, &["state", "describe", name]);
            assert_eq!(da["items"], json!(0), "{da}");
            // ...and they are the same container: same single genesis change.
            assert_eq!(da["heads"], db["heads"], "{name}");
            assert_eq!(da["changes"], json!(1));
        }
        let schemas = json_out(&a, &["state", "schema", "list"]);
        let ids: Vec<&str> = schemas
            .as_array()
            .unwrap()
            .iter()
            .map(|s| s["id"].as_str().unwrap())
            .collect();
        for name in CORE {
            assert!(ids.contains(&name), "{ids:?}");
        }
        c.stop(ia);
        c.stop(ib);

        // Together: register the note schema and create two notes on a.
        let ja = c.start(&a, &[]);
        let jb = c.start(&b, &[]);
        let reg = json_out(&a, &["state", "schema", "add", &note_schema_file()]);
        assert_eq!(reg["registered"], json!(true), "{reg}");
        assert_eq!(reg["fields"]["body"], json!("rga_text"));
        let t0 = rfc3339(60);
        let n1 = json!({"id": "0b4f1d0e-0a7e-4c39-9b1e-1d1c7b0a4a01", "title": "plan", "body": "hello world",
                        "tags": ["work"], "createdAt": t0, "updatedAt": t0});
        let n2 = json!({"title": "shopping", "body": "milk", "tags": ["home"], "createdAt": t0, "updatedAt": t0});
        let id1 = json_out(
            &a,
            &[
                "state",
                "create",
                "--schema",
                NOTE,
                "--object",
                &n1.to_string(),
            ],
        )["id"]
            .as_str()
            .unwrap()
            .to_owned();
        let id2 = json_out(
            &a,
            &[
                "state",
                "create",
                "--schema",
                NOTE,
                "--object",
                &n2.to_string(),
            ],
        )["id"]
            .as_str()
            .unwrap()
            .to_owned();
        let all = json!({"from": NOTE, "order": [{"field": "title"}]});
        wait_for("both notes on b", Duration::from_secs(15), || {
            let r = try_query(&b, &all)?;
            (r["items"].as_array()?.len() == 2).then_some(())
        });

        // Apart again: concurrent edits of the same note.
        c.stop(ja);
        c.stop(jb);
        let ia = c.start(&a, &apart);
        let ib = c.start(&b, &apart);
        update_note(
            &a,
            &id1,
            json!([{"op": "replace", "path": "/title", "value": "plan A"},
                    {"op": "add", "path": "/tags/-", "value": "urgent"}]),
        );
        update_note(
            &b,
            &id1,
            json!([{"op": "replace", "path": "/body", "value": "hello brave world"},
                    {"op": "add", "path": "/tags/-", "value": "q4"}]),
        );
        update_note(&b, &id1, json!({"$push": {"tags": "shared"}}));
        c.stop(ia);
        c.stop(ib);
        c.start(&a, &[]);
        c.start(&b, &[]);
        let one = json!({"from": NOTE, "where": {"id": id1}});
        let merged = wait_for(
            "the concurrent edits to merge",
            Duration::from_secs(15),
            || {
                let qa = try_query(&a, &one)?;
                let qb = try_query(&b, &one)?;
                let item = qa["items"][0].clone();
                (qa == qb
                    && item["title"] == json!("plan A")
                    && item["tags"].as_array()?.len() == 4)
                    .then_some(item)
            },
        );
        assert_eq!(merged["body"], json!("hello brave world"), "{merged}");
        let mut tags: Vec<&str> = merged["tags"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_str().unwrap())
            .collect();
        tags.sort();
        assert_eq!(
            tags,
            vec!["q4", "shared", "urgent", "work"],
            "grow_only_set keeps every add"
        );

        // Queries agree; a tombstone on b hides the note everywhere.
        let tagged =
            json!({"from": NOTE, "where": {"tags": {"$contains": "urgent"}}, "select": ["title"]});
        assert_eq!(
            query(&a, tagged.clone())["items"],
            json!([{"id": id1, "title": "plan A"}])
        );
        cli_ok(&b, &["state", "delete", "--schema", NOTE, "--id", &id2]);
        wait_for("the delete everywhere", Duration::from_secs(15), || {
            let qa = try_query(&a, &all)?;
            let qb = try_query(&b, &all)?;
            (qa == qb && qa["items"].as_array()?.len() == 1).then_some(())
        });

        // Bad input: clear errors, nothing changes.
        let before = heads(&a, NOTE);
        let err = fails(
            &a,
            &[
                "state",
                "create",
                "--schema",
                NOTE,
                "--object",
                r#"{"title": 5}"#,
            ],
        );
        assert!(
            err.contains("invalid_object") && err.contains("/title") && err.contains("(type)"),
            "{err}"
        );
        let err = fails(
            &a,
            &[
                "state",
                "create",
                "--schema",
                "did:nuwa:state:nope#v1",
                "--object",
                "{}",
            ],
        );
        assert!(err.contains("unknown_schema"), "{err}");
        let err = fails(
            &a,
            &[
                "state",
                "query",
                r#"{"from": "did:nuwa:state:note#v1", "where": {"tags": {"$containz": "x"}}}"#,
            ],
        );
        assert!(
            err.contains("invalid_query") && err.contains("$containz"),
            "{err}"
        );
        let err = fails(&a, &["state", "query", "{not json"]);
        assert!(err.contains("not valid JSON"), "{err}");
        let err = fails(
            &a,
            &[
                "state",
                "update",
                "--schema",
                NOTE,
                "--id",
                &id1,
                "--patch",
                &json!([{"op": "remove", "path": "/tags/0"}]).to_string(),
            ],
        );
        assert!(
            err.contains("crdt_policy"),
            "a grow-only set refuses removals: {err}"
        );
        let err = fails(
            &a,
            &[
                "state",
                "update",
                "--schema",
                NOTE,
                "--id",
                "no-such-id",
                "--patch",
                "[]",
            ],
        );
        assert!(err.contains("no_such_object"), "{err}");
        let big = "x".repeat(33 * 1024 * 1024);
        let body = json!({"schema_uri": NOTE, "object": {"id": "0b4f1d0e-0a7e-4c39-9b1e-1d1c7b0a4a09", "title": "big",
            "body": big, "createdAt": t0, "updatedAt": t0}});
        let (status, reply) = post_raw(&a, "/v1/state.create", serde_json::to_vec(&body).unwrap());
        assert_eq!(status, 413, "{reply}");
        assert_eq!(reply["error"]["code"], json!("object_too_large"));
        let bad_schema = fails(&a, &["state", "schema", "add", "/dev/null"]);
        assert!(bad_schema.contains("not JSON"), "{bad_schema}");
        assert_eq!(heads(&a, NOTE), before, "refused writes changed nothing");
        // A schema that is not valid JSON Schema is refused with the reason.
        let dir = c.dir.path().join("bad.json");
        std::fs::write(&dir, r#"{"$id": "did:nuwa:state:bad#v1", "type": "object", "properties": {"a": {"type": 5}}}"#).unwrap();
        let err = fails(&a, &["state", "schema", "add", dir.to_str().unwrap()]);
        assert!(err.contains("invalid_schema"), "{err}");
    });
}

// Goal: done-when 4. ConversationLog entries older than the TTL (14 days)
// are trimmed on every device and all devices agree on what remains.
// Method: two daemons with a 1 s lifecycle interval; old and recent entries
// appended on both; wait until both hold only the recent ones.
#[test]
fn conversation_log_ttl_trims_on_every_device() {
    isolated("conversation_log_ttl_trims_on_every_device", || {
        let mut c = Cluster::new();
        let a = c.init("a");
        let b = c.provision(&a, "b");
        let ia = c.start(&a, &["--lifecycle-every", "1s"]);
        c.start(&b, &["--lifecycle-every", "1s"]);
        let entry = |n: u32, secs_ago: i64| {
            json!({"id": format!("00000000-0000-4000-8000-{n:012}"), "role": "user",
                   "content": format!("message {n}"), "timestamp": rfc3339(secs_ago)})
        };
        let day = 86_400;
        for (home, n, age) in [
            (&a, 1, 20 * day),
            (&a, 2, 60),
            (&b, 3, 15 * day),
            (&b, 4, 30),
            (&a, 5, 30 * day),
        ] {
            cli_ok(
                home,
                &[
                    "state",
                    "create",
                    "--schema",
                    LOG,
                    "--object",
                    &entry(n, age).to_string(),
                ],
            );
        }
        // Past entries of an append-only log cannot be edited or deleted.
        let err = fails(
            &a,
            &[
                "state",
                "delete",
                "--schema",
                LOG,
                "--id",
                "00000000-0000-4000-8000-000000000002",
            ],
        );
        assert!(err.contains("crdt_policy"), "{err}");
        let q = json!({"from": LOG, "order": [{"field": "id"}], "select": ["content"]});
        let want = json!([
            {"id": "00000000-0000-4000-8000-000000000002", "content": "message 2"},
            {"id": "00000000-0000-4000-8000-000000000004", "content": "message 4"},
        ]);
        wait_for(
            "both devices to keep only the recent entries",
            Duration::from_secs(20),
            || {
                (try_query(&a, &q)?["items"] == want && try_query(&b, &q)?["items"] == want)
                    .then_some(())
            },
        );
        let st = status(&a).unwrap();
        let removed = st["counters"]["lifecycle_items_removed"]
            .as_u64()
            .unwrap_or(0)
            + status(&b).unwrap()["counters"]["lifecycle_items_removed"]
                .as_u64()
                .unwrap_or(0);
        assert!(removed >= 1, "the lifecycle task did the trimming");
        assert_eq!(heads(&a, LOG), heads(&b, LOG), "same document on both");

        // x-compression: br. A compacted (compressed) snapshot reloads.
        let d = json_out(&a, &["state", "compact", LOG]);
        assert_eq!(d["compression"], json!("br"), "{d}");
        c.stop(ia);
        c.start(&a, &["--no-mdns", "--no-known-peers"]);
        assert_eq!(try_query(&a, &q).unwrap()["items"], want);
    });
}

// Goal: issue 25 fault 1: the three untyped writes that broke typed state
// (a MemoryStore's items replaced by {}, a ConversationLog's by a string,
// a registered schema replaced through nuwa:schemas) are refused with
// `typed_container`, through `state put` and a batch put alike, and the
// typed state stays as it was; untyped maps still take puts, and a reset
// of an intact container repairs nothing. Method: one real daemon, the
// CLI and the HTTP API.
#[test]
fn untyped_writes_cannot_touch_typed_or_reserved_state() {
    isolated(
        "untyped_writes_cannot_touch_typed_or_reserved_state",
        || {
            let mut c = Cluster::new();
            let a = c.init("a");
            c.start(&a, &["--no-mdns", "--no-known-peers"]);
            let memory = "did:nuwa:core:MemoryStore#v1";
            let memo = json!({"value": "the user likes tea", "importance": 0.9,
                          "createdAt": rfc3339(0)});
            cli_ok(
                &a,
                &[
                    "state",
                    "create",
                    "--schema",
                    memory,
                    "--object",
                    &memo.to_string(),
                ],
            );
            cli_ok(&a, &["state", "schema", "add", &note_schema_file()]);
            let schema_text = std::fs::read_to_string(note_schema_file()).unwrap();
            let overwrite =
                serde_json::to_string(&schema_text.replace("\"string\"", "\"number\"")).unwrap();
            for (container, key, value) in [
                (memory, "items", "{}"),
                (LOG, "items", "\"gone\""),
                ("nuwa:schemas", NOTE, overwrite.as_str()),
            ] {
                let err = fails(&a, &["state", "put", container, key, value]);
                assert!(err.contains("typed_container"), "{container}: {err}");
                let (status, reply) = api_post(
                    &a,
                    "/v1/state.batch",
                    &json!({"ops": [{"op": "put", "container": container, "key": key,
                                 "value": serde_json::from_str::<Value>(value).unwrap()}]}),
                );
                assert_eq!(status, 200, "{reply}");
                assert_eq!(
                    reply["results"][0]["error"]["code"], "typed_container",
                    "{container}: {reply}"
                );
            }
            // Nothing changed: the memory is there, the schema still wants a
            // string title, and the log still reads.
            let items = query(&a, json!({"from": memory}))["items"].clone();
            assert_eq!(items[0]["value"], "the user likes tea", "{items}");
            let bad = json!({"id": "00000000-0000-4000-8000-000000000009", "title": 42,
                         "body": "b", "createdAt": rfc3339(0), "updatedAt": rfc3339(0)});
            let err = fails(
                &a,
                &[
                    "state",
                    "create",
                    "--schema",
                    NOTE,
                    "--object",
                    &bad.to_string(),
                ],
            );
            assert!(err.contains("invalid_object"), "{err}");
            query(&a, json!({"from": LOG}));
            // Untyped maps still take puts; a reset of an intact container
            // repairs nothing.
            cli_ok(&a, &["state", "put", "notes", "k", "1"]);
            let reset = json_out(&a, &["state", "reset", LOG, "--yes"]);
            assert_eq!(reset["repaired"], json!(false), "{reset}");
            assert!(metric(&a, "nuwa_api_errors_total{code=\"typed_container\"}") >= 3.0);
        },
    );
}

/// The daemon's peak resident memory (VmHWM), in MB.
fn peak_rss_mb(home: &Path) -> f64 {
    let api: Value =
        serde_json::from_slice(&std::fs::read(home.join("api.json")).unwrap()).unwrap();
    let pid = api["pid"].as_u64().expect("pid in api.json");
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kb: f64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap();
    kb / 1024.0
}

// Goal: issue 25 fault 3: a 12 MB JSON array (4,000,000 numbers) in one
// put is refused with `value_too_large` before it is parsed: the daemon's
// peak memory stays within 150 MB of where it was, and it answers status
// meanwhile. A put at the limit is taken. Method: one real daemon, the raw
// body over HTTP, VmHWM from /proc.
#[test]
fn a_huge_array_is_refused_before_it_costs_memory() {
    isolated("a_huge_array_is_refused_before_it_costs_memory", || {
        let mut c = Cluster::new();
        let a = c.init("a");
        c.start(&a, &["--no-mdns", "--no-known-peers"]);
        cli_ok(&a, &["state", "put", "warm", "k", "1"]);
        let before = peak_rss_mb(&a);
        let mut body = Vec::with_capacity(13 << 20);
        body.extend_from_slice(br#"{"container":"embeddings","key":"m","value":["#);
        for i in 0..4_000_000u32 {
            if i > 0 {
                body.push(b',');
            }
            body.extend_from_slice(format!("{}", i % 1000).as_bytes());
        }
        body.extend_from_slice(b"]}");
        println!("body: {:.1} MB", body.len() as f64 / 1e6);
        let started = std::time::Instant::now();
        let (status, reply) = post_raw(&a, "/v1/state/put", body);
        let took = started.elapsed();
        assert_eq!(status, 413, "{reply}");
        assert_eq!(reply["error"]["code"], "value_too_large", "{reply}");
        let after = peak_rss_mb(&a);
        println!(
            "refused in {took:?}; peak RSS {before:.1} MB before, {after:.1} MB after (+{:.1})",
            after - before
        );
        assert!(after - before < 150.0, "peak RSS +{:.1} MB", after - before);
        // At the limit: taken.
        let n = nuwa_agent::api::MAX_WRITE_VALUES - 3;
        let items: Vec<String> = (0..n).map(|i| i.to_string()).collect();
        let ok = format!(
            r#"{{"container":"embeddings","key":"m","value":[{}]}}"#,
            items.join(",")
        );
        let (status, reply) = post_raw(&a, "/v1/state/put", ok.into_bytes());
        assert_eq!(status, 200, "{reply}");
        assert!(status_ok(&a));
    });
}

fn status_ok(home: &Path) -> bool {
    status(home).is_ok()
}
