//! `state.batch` and `state import` on real daemons (issue 13): a batch is
//! all or nothing per container, names every failing operation, and what
//! it applies is durable and reaches the other device.

mod common;

use std::path::Path;
use std::time::Duration;

use common::*;
use serde_json::{Value, json};

const NOTE: &str = "did:nuwa:state:note#v1";

fn note(i: u32, title: Value) -> Value {
    json!({
        "id": format!("00000000-0000-0000-0000-{i:012}"),
        "title": title,
        "body": "b",
        "createdAt": "2026-11-24T00:00:00Z",
        "updatedAt": "2026-11-24T00:00:00Z",
    })
}

fn heads_of(home: &Path, container: &str) -> Vec<Value> {
    let st = status(home).unwrap();
    st["containers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == json!(container))
        .map(|c| c["heads"].as_array().unwrap().clone())
        .unwrap_or_default()
}

fn two_devices(c: &mut Cluster) -> (std::path::PathBuf, std::path::PathBuf) {
    let a = c.init("a");
    let b = c.provision(&a, "b");
    c.start(&a, &[]);
    c.start(&b, &[]);
    let want = vec![context_id(&a)];
    wait_for("b verifies a", Duration::from_secs(10), || {
        status(&b)
            .map(|st| verified(&st) == want)
            .unwrap_or(false)
            .then_some(())
    });
    (a, b)
}

// Goal: Done-when 2 of issue 13. One invalid item in a batch leaves its
// container's heads unchanged and is named, with every other failing item;
// the container's valid items are reported `batch_aborted`; another
// container of the same batch is applied, durable, and reaches the peer.
#[test]
fn a_batch_is_all_or_nothing_per_container() {
    isolated("a_batch_is_all_or_nothing_per_container", || {
        let mut c = Cluster::new();
        let (a, b) = two_devices(&mut c);
        cli_ok(
            &a,
            &[
                "state",
                "schema",
                "add",
                concat!(
                    env!("CARGO_MANIFEST_DIR"),
                    "/../crates/asm/schemas/examples/note.json"
                ),
            ],
        );
        // A first batch: creates, an update of an object created earlier in
        // the same batch, and raw puts elsewhere.
        let (code, r) = api_post(
            &a,
            "/v1/state.batch",
            &json!({"ops": [
                {"op": "create", "schema_uri": NOTE, "object": note(1, json!("one"))},
                {"op": "update", "schema_uri": NOTE, "id": "00000000-0000-0000-0000-000000000001",
                 "patch": [{"op": "replace", "path": "/title", "value": "ONE"}]},
                {"op": "create", "schema_uri": NOTE, "object": note(2, json!("two"))},
                {"op": "put", "container": "plain", "key": "a", "value": 1},
            ]}),
        );
        assert_eq!(code, 200, "{r}");
        assert_eq!(r["ok"], json!(true), "{r}");
        assert_eq!(r["applied"], json!(4));
        assert_eq!(r["durable"], json!(true));
        let notes_heads = heads_of(&a, NOTE);
        assert_eq!(
            r["containers"][0]["heads"].as_array().unwrap(),
            &notes_heads,
            "the reply's heads are the container's"
        );
        let changes_before = status(&a).unwrap()["containers"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["name"] == json!(NOTE))
            .unwrap()["changes"]
            .clone();

        // The failing batch: a valid create, an invalid one (title not a
        // string), an update of a missing object, then puts to another
        // container, one of which has an empty key, and one good container.
        let (code, r) = api_post(
            &a,
            "/v1/state.batch",
            &json!({"ops": [
                {"op": "create", "schema_uri": NOTE, "object": note(3, json!("three"))},
                {"op": "create", "schema_uri": NOTE, "object": note(4, json!(5))},
                {"op": "update", "schema_uri": NOTE, "id": "00000000-0000-0000-0000-000000000099",
                 "patch": [{"op": "replace", "path": "/title", "value": "x"}]},
                {"op": "put", "container": "plain", "key": "b", "value": 2},
                {"op": "put", "container": "plain", "key": "", "value": 3},
                {"op": "put", "container": "other", "key": "k", "value": "v"},
            ]}),
        );
        assert_eq!(code, 200, "{r}");
        assert_eq!(r["ok"], json!(false));
        assert_eq!(
            (r["applied"].clone(), r["failed"].clone()),
            (json!(1), json!(5)),
            "{r}"
        );
        let results = r["results"].as_array().unwrap();
        let code_of = |i: usize| {
            results[i]["error"]["code"]
                .as_str()
                .unwrap_or("")
                .to_owned()
        };
        assert_eq!(code_of(0), "batch_aborted");
        assert!(
            results[0]["error"]["message"]
                .as_str()
                .unwrap()
                .contains("operation 1")
        );
        assert_eq!(code_of(1), "invalid_object");
        assert!(
            results[1]["error"]["message"]
                .as_str()
                .unwrap()
                .contains("/title")
        );
        assert_eq!(code_of(2), "no_such_object");
        assert_eq!(code_of(3), "batch_aborted");
        assert_eq!(code_of(4), "invalid_write");
        assert_eq!(results[5]["ok"], json!(true));
        // Heads of both failing containers did not move; nothing of them
        // was written.
        assert_eq!(heads_of(&a, NOTE), notes_heads);
        let st = status(&a).unwrap();
        let changes_after = st["containers"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["name"] == json!(NOTE))
            .unwrap()["changes"]
            .clone();
        assert_eq!(changes_after, changes_before);
        assert_eq!(get_json(&a, "plain").unwrap(), json!({"a": 1}));
        let q: Value = serde_json::from_str(&cli_ok(
            &a,
            &[
                "--json",
                "state",
                "query",
                &json!({"from": NOTE}).to_string(),
            ],
        ))
        .unwrap();
        let titles: Vec<&str> = q["items"]
            .as_array()
            .unwrap()
            .iter()
            .map(|i| i["title"].as_str().unwrap())
            .collect();
        assert_eq!(titles, vec!["ONE", "two"]);

        // What was applied reaches the other device; what was not, never.
        wait_for(
            "b has the applied containers",
            Duration::from_secs(20),
            || {
                (get_json(&b, "other") == Some(json!({"k": "v"}))
                    && get_json(&b, "plain") == Some(json!({"a": 1}))
                    && heads_of(&b, NOTE) == notes_heads)
                    .then_some(())
            },
        );

        // A batch against a typed container that does not exist yet (its
        // schema registered, no item) that fails leaves no container.
        let (_, r) = api_post(
            &a,
            "/v1/state.batch",
            &json!({"ops": [
                {"op": "create", "schema_uri": "did:nuwa:state:none#v1", "object": {}},
                {"op": "put", "container": "", "key": "k", "value": 1},
            ]}),
        );
        assert_eq!(
            results_codes(&r),
            vec!["unknown_schema", "invalid_container_name"],
            "{r}"
        );
        // Bad requests are refused whole.
        let (code, r) = api_post(&a, "/v1/state.batch", &json!({"ops": []}));
        assert_eq!(
            (code, r["error"]["code"].clone()),
            (400, json!("bad_request"))
        );
        let (code, r) = api_post(&a, "/v1/state.batch", &json!({"ops": [{"op": "drop"}]}));
        assert_eq!(
            (code, r["error"]["code"].clone()),
            (400, json!("bad_request")),
            "{r}"
        );
    });
}

fn results_codes(r: &Value) -> Vec<String> {
    r["results"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x["error"]["code"].as_str().unwrap_or("ok").to_owned())
        .collect()
}

// Goal: `state import` checks every line before sending anything, then
// sends batches; the count is printed and every item reaches the peer.
#[test]
fn import_checks_every_line_then_sends_in_batches() {
    isolated("import_checks_every_line_then_sends_in_batches", || {
        let mut c = Cluster::new();
        let (a, b) = two_devices(&mut c);
        let dir = c.dir.path().to_path_buf();
        let bad = dir.join("bad.ndjson");
        std::fs::write(
            &bad,
            "{\"op\":\"put\",\"container\":\"log\",\"key\":\"k\",\"value\":1}\n\nnot json\n{\"op\":\"put\"}\n",
        )
        .unwrap();
        let out = cli(&a, &["state", "import", bad.to_str().unwrap()]);
        assert!(!out.status.success());
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains("line 3") && err.contains("line 4") && err.contains("nothing was sent"),
            "{err}"
        );
        assert_eq!(get_json(&a, "log"), None, "nothing was sent");

        let good = dir.join("good.ndjson");
        let mut text = String::new();
        for i in 0..5_000 {
            text.push_str(&json!({"op": "put", "container": format!("log{}", i % 3), "key": format!("k{i}"), "value": i}).to_string());
            text.push('\n');
        }
        std::fs::write(&good, text).unwrap();
        let out = cli_ok(
            &a,
            &[
                "state",
                "import",
                good.to_str().unwrap(),
                "--batch-size",
                "700",
            ],
        );
        assert!(out.contains("imported 5000 of 5000 operations"), "{out}");
        assert!(out.contains("0 failed"), "{out}");
        wait_for("b has every imported item", Duration::from_secs(30), || {
            (0..3)
                .all(|j| {
                    get_json(&b, &format!("log{j}")).and_then(|v| v.as_object().map(|o| o.len()))
                        == Some((0..5_000).filter(|i| i % 3 == j).count())
                })
                .then_some(())
        });
    });
}

// Goal: a container whose log grows heavy in bytes (far fewer than 2,048
// changes) is compacted while the daemon runs, and nothing written is
// lost: not across a SIGKILL right after writes that set compactions off,
// not across a clean restart. Method: one daemon; batches of 20 entries
// of 2 kB of incompressible text (Automerge's deflate cannot shrink them)
// until the compaction counter rises; more batches, then SIGKILL; every
// entry is read back after each restart.
#[test]
fn a_heavy_log_is_compacted_and_loses_nothing() {
    isolated("a_heavy_log_is_compacted_and_loses_nothing", || {
        let mut c = Cluster::new();
        let a = c.init("a");
        let value = |i: usize| {
            let mut rng = fastrand::Rng::with_seed(i as u64);
            json!((0..2_000).map(|_| rng.alphanumeric()).collect::<String>())
        };
        let batch = |a: &Path, first: usize| {
            let ops: Vec<Value> = (first..first + 20)
                .map(|i| json!({"op": "put", "container": "heavy", "key": format!("k{i}"), "value": value(i)}))
                .collect();
            let (code, body) = api_post(a, "/v1/state.batch", &json!({ "ops": ops }));
            assert_eq!((code, &body["ok"]), (200, &json!(true)), "{body}");
        };
        let i0 = c.start(&a, &[]);
        let mut written = 0;
        while metric(&a, "nuwa_compactions_off_loop_total") < 1.0 {
            assert!(written < 2_000, "no compaction after {written} entries");
            batch(&a, written);
            written += 20;
        }
        // About a megabyte in about 30 changes.
        assert!(written <= 1_000, "compacted only after {written} entries");
        let first = written;
        while metric(&a, "nuwa_compactions_off_loop_total") < 2.0 {
            assert!(written < first + 2_000, "no second compaction");
            batch(&a, written);
            written += 20;
        }
        batch(&a, written);
        written += 20;
        c.kill9(i0);
        let all_there = |a: &Path| {
            let got = get_json(a, "heavy").expect("the container is there");
            let missing: Vec<usize> = (0..written)
                .filter(|i| got[format!("k{i}")] != value(*i))
                .collect();
            assert!(
                missing.is_empty(),
                "{} entries lost: {missing:?}",
                missing.len()
            );
        };
        let i1 = c.start(&a, &[]);
        all_there(&a);
        c.stop(i1);
        let i2 = c.start(&a, &[]);
        all_there(&a);
        c.stop(i2);
    });
}
