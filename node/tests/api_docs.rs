//! Runs every example of docs/api.md against a real daemon: each `sh` block
//! (after the `sh setup` block) runs in bash, and its output must match the
//! `json` block that follows it (every key shown present with that value;
//! `"<any>"` matches anything). The `sh events` block is run in the
//! background and must report a write as a `change` event.

mod common;

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::Duration;

use common::*;
use serde_json::Value;

struct Block {
    info: String,
    body: String,
}

fn blocks(md: &str) -> Vec<Block> {
    let mut out = Vec::new();
    let mut current: Option<Block> = None;
    for line in md.lines() {
        match (&mut current, line.strip_prefix("```")) {
            (None, Some(info)) => {
                current = Some(Block {
                    info: info.trim().to_owned(),
                    body: String::new(),
                })
            }
            (Some(_), Some(_)) => out.push(current.take().unwrap()),
            (Some(b), None) => {
                b.body.push_str(line);
                b.body.push('\n');
            }
            (None, None) => {}
        }
    }
    out
}

/// Every key of `want` is in `got` with a matching value.
fn matches(want: &Value, got: &Value) -> bool {
    match (want, got) {
        (Value::String(s), _) if s == "<any>" => true,
        (Value::Object(w), Value::Object(g)) => w
            .iter()
            .all(|(k, v)| g.get(k).is_some_and(|gv| matches(v, gv))),
        (Value::Array(w), Value::Array(g)) => {
            w.len() == g.len() && w.iter().zip(g).all(|(a, b)| matches(a, b))
        }
        (Value::Number(a), Value::Number(b)) => a.as_f64() == b.as_f64(),
        (a, b) => a == b,
    }
}

fn bash(home: &std::path::Path, script: &str) -> Command {
    let mut cmd = Command::new("bash");
    cmd.args(["-euo", "pipefail", "-c", script])
        .env("NUWA_HOME", home)
        // The examples call `nuwa-node` as a reader would, from PATH.
        .env("PATH", path_with_the_binary())
        .env(
            "NUWA_APP_CLIENT",
            concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/../scripts/app-client/nuwa_app.mjs"
            ),
        )
        .env_remove("http_proxy")
        .env_remove("HTTP_PROXY")
        .env_remove("all_proxy")
        .env_remove("ALL_PROXY");
    cmd
}

/// PATH with this build's `nuwa-node` first.
fn path_with_the_binary() -> std::ffi::OsString {
    let dir = std::path::Path::new(bin()).parent().unwrap().to_path_buf();
    let rest = std::env::var_os("PATH").unwrap_or_default();
    std::env::join_paths(std::iter::once(dir).chain(std::env::split_paths(&rest))).unwrap()
}

// Goal: done-when 5. Every curl example in docs/api.md works as written
// against a real daemon and prints what the document says.
#[test]
fn api_doc_examples_run() {
    isolated("api_doc_examples_run", || {
        let md = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/api.md"))
            .expect("docs/api.md");
        let all = blocks(&md);
        // A fence left open swallows the rest of the page, whose examples
        // then never run (issue 41: the apps example had not run since).
        for b in &all {
            assert!(
                !b.body.lines().any(|l| l.starts_with("## ")),
                "a code block ```{} holds a heading: a fence is missing before it",
                b.info
            );
        }
        let setup = all
            .iter()
            .find(|b| b.info == "sh setup")
            .expect("a `sh setup` block")
            .body
            .clone();
        let mut c = Cluster::new();
        let a = c.init("a");
        c.start(&a, &[]);
        let mut checked = 0;
        let mut events_checked = false;
        for (i, b) in all.iter().enumerate() {
            match b.info.as_str() {
                "sh" => {
                    let out = bash(&a, &format!("{setup}\n{}", b.body)).output().unwrap();
                    let stdout = String::from_utf8_lossy(&out.stdout);
                    assert!(
                        out.status.success(),
                        "example failed:\n{}\n{stdout}\n{}",
                        b.body,
                        String::from_utf8_lossy(&out.stderr)
                    );
                    let Some(want) = all.get(i + 1).filter(|n| n.info == "json") else {
                        continue;
                    };
                    let want: Value = serde_json::from_str(&want.body)
                        .unwrap_or_else(|e| panic!("bad expected JSON after:\n{}\n{e}", b.body));
                    let got: Value = serde_json::from_str(&stdout).unwrap_or_else(|e| {
                        panic!("example printed no JSON:\n{}\n{stdout}\n{e}", b.body)
                    });
                    assert!(
                        matches(&want, &got),
                        "example:\n{}\nwant (subset): {want}\ngot: {got}",
                        b.body
                    );
                    checked += 1;
                }
                "sh events" => {
                    let mut child = bash(&a, &format!("{setup}\n{}", b.body))
                        .stdout(Stdio::piped())
                        .spawn()
                        .unwrap();
                    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
                    // Subscribed: `ready` comes first.
                    while let Some(Ok(l)) = lines.next() {
                        if l == "event: ready" {
                            break;
                        }
                    }
                    cli_ok(
                        &a,
                        &[
                            "state",
                            "create",
                            "--schema",
                            "did:nuwa:core:AgentSettings#v1",
                            "--id",
                            "default",
                            "--object",
                            r#"{"language": "en", "theme": "dark"}"#,
                        ],
                    );
                    let (tx, rx) = std::sync::mpsc::channel();
                    std::thread::spawn(move || {
                        while let Some(Ok(l)) = lines.next() {
                            if l == "event: change" {
                                let _ = tx.send(lines.next().and_then(Result::ok));
                                return;
                            }
                        }
                    });
                    let data = rx
                        .recv_timeout(Duration::from_secs(10))
                        .expect("a change event within 10 s")
                        .expect("a data line");
                    let ev: Value =
                        serde_json::from_str(data.strip_prefix("data: ").unwrap()).unwrap();
                    assert_eq!(ev["container"], "did:nuwa:core:AgentSettings#v1");
                    assert_eq!(ev["origin"], "local");
                    let _ = child.kill();
                    let _ = child.wait();
                    events_checked = true;
                }
                _ => {}
            }
        }
        assert!(checked >= 25, "only {checked} examples were checked");
        assert!(events_checked, "the events example ran");
        println!("{checked} examples matched; events stream checked");
    });
}

// Goal: one `note#v1` everywhere. docs/api.md registers the note schema
// that README registers from crates/asm/schemas/examples/note.json; if they
// differed, following both would fail with "already registered with
// different content". Method: compare the two as JSON.
#[test]
fn the_docs_note_schema_is_the_example_file() {
    let md = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/api.md"))
        .expect("docs/api.md");
    let start = md
        .find("--data @- <<'EOF'\n")
        .expect("the schema registration example");
    let body = &md[start + "--data @- <<'EOF'\n".len()..];
    let body = &body[..body.find("\nEOF\n").expect("the heredoc's end")];
    let in_docs: Value = serde_json::from_str(body).expect("the docs' schema is JSON");
    let file: Value = serde_json::from_str(
        &std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../crates/asm/schemas/examples/note.json"
        ))
        .expect("note.json"),
    )
    .expect("note.json is JSON");
    assert_eq!(
        in_docs, file,
        "docs/api.md and note.json must be one schema"
    );
    let readme = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../README.md"))
        .expect("README.md");
    assert!(
        readme.contains("state schema add crates/asm/schemas/examples/note.json"),
        "README registers note#v1 from the example file"
    );
}
