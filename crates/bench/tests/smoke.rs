//! Smoke test of the benchmark command against real daemons.

use std::path::PathBuf;
use std::process::Command;

use serde_json::Value;

/// The `nuwa-node` binary built next to this test's target directory
/// (`target/<profile>/nuwa-node`; the test itself runs from
/// `target/<profile>/deps/`).
fn nuwa_node() -> PathBuf {
    let exe = std::env::current_exe().expect("the test knows its own path");
    let profile_dir = exe
        .parent()
        .and_then(|deps| deps.parent())
        .expect("the test runs from target/<profile>/deps");
    let node = profile_dir.join("nuwa-node");
    assert!(
        node.is_file(),
        "nuwa-node is not built at {}: run `cargo build -p nuwa-node` first \
         (`cargo test --workspace` builds it)",
        node.display()
    );
    node
}

fn stat_at<'a>(doc: &'a Value, path: &[&str]) -> Option<&'a Value> {
    let v = path.iter().try_fold(doc, |v, k| v.get(k))?;
    let ok = ["median", "min", "max"]
        .iter()
        .all(|k| v.get(k).and_then(Value::as_f64).is_some_and(f64::is_finite));
    ok.then_some(v)
}

// Goal: `nuwa-bench --quick` runs every workload end to end against real
// nuwa-node daemons on loopback and reports every figure; method: run the
// built binaries, then check each row of the JSON, the charts, the report
// and the comparison table (fed a partial file, so missing rows say n/a).
#[test]
fn quick_run_reports_every_figure() {
    let node = nuwa_node();
    let dir = tempfile::tempdir().expect("temp dir");
    let out = dir.path().join("out");
    let json_out = dir.path().join("results-copy.json");
    let other = dir.path().join("other.json");
    std::fs::write(
        &other,
        r#"{"tool": "automerge-repo", "throughput": {"rate_per_sec": {"median": 1000, "min": 900, "max": 1100}}}"#,
    )
    .expect("write the comparison file");

    let run = Command::new(env!("CARGO_BIN_EXE_nuwa-bench"))
        .arg("--quick")
        .arg("--node-bin")
        .arg(&node)
        .arg("--out")
        .arg(&out)
        .arg("--json-out")
        .arg(&json_out)
        .arg("--compare")
        .arg(&other)
        .arg("--work-dir")
        .arg(dir.path().join("work"))
        .output()
        .expect("run nuwa-bench");
    let stdout = String::from_utf8_lossy(&run.stdout);
    assert!(
        run.status.success(),
        "nuwa-bench --quick failed: {}\nstdout:\n{stdout}\nstderr:\n{}",
        run.status,
        String::from_utf8_lossy(&run.stderr)
    );

    let doc: Value = serde_json::from_slice(&std::fs::read(&json_out).expect("--json-out written"))
        .expect("results are JSON");
    let rows: &[&[&str]] = &[
        &["propagation_latency", "3", "p50_ms"],
        &["propagation_latency", "3", "p99_ms"],
        &["propagation_latency", "3", "wire_bytes_per_change"],
        &["throughput", "elapsed_ms"],
        &["throughput", "rate_per_sec"],
        &["throughput", "local_append_rate_per_sec"],
        &["throughput", "ratio"],
        &["cold_sync", "sync_ms"],
        &["cold_sync", "local_load_ms"],
        &["cold_sync", "ratio"],
        &["cold_sync", "baseline_sync_ms"],
        &["bytes_per_change", "wire_bytes_per_change"],
        &["bytes_per_change", "raw_change_bytes"],
        &["bytes_per_change", "ratio"],
        &["rss_mb", "idle"],
        &["rss_mb", "after_sync"],
        &["reads", "get_p99_ms"],
        &["reads", "receiver_ratio"],
        &["reads", "sender_ratio"],
    ];
    for path in rows {
        assert!(
            stat_at(&doc, path).is_some(),
            "no finite stat at {} in\n{doc:#}",
            path.join(".")
        );
    }
    assert_eq!(doc["tool"], "nuwa-bench");
    assert_eq!(doc["params"]["quick"], true);
    assert_eq!(
        doc["propagation_latency"]["3"]["samples_ms"]
            .as_array()
            .map(Vec::len),
        Some(20),
        "20 latency samples in quick mode"
    );
    assert_eq!(doc["cold_sync"]["entries"], 20_000);
    assert_eq!(doc["reads"]["keys"], 10_000);

    for png in ["latency.png", "throughput.png"] {
        let bytes = std::fs::read(out.join(png)).unwrap_or_else(|_| panic!("{png} written"));
        assert!(bytes.starts_with(b"\x89PNG"), "{png} is a PNG");
    }
    let report = std::fs::read_to_string(out.join("report.md")).expect("report.md written");
    for want in [
        "| propagation latency N=3, p50 | ms |",
        "| cold sync / local load | × |",
        "(latency.png)",
        "(throughput.png)",
        "```json",
    ] {
        assert!(report.contains(want), "report.md lacks {want:?}:\n{report}");
    }
    // The comparison table comes last on stdout: a row both files have gets
    // a ratio; one the other file lacks shows n/a.
    let rate = stdout
        .lines()
        .rfind(|l| l.starts_with("| writes converged on 3 nodes |"))
        .expect("comparison row for the write rate");
    assert!(rate.contains("| 1000 |"), "{rate}");
    let cold = stdout
        .lines()
        .rfind(|l| l.starts_with("| cold sync |"))
        .expect("comparison row for the cold sync");
    assert!(cold.ends_with("| n/a | n/a | n/a |"), "{cold}");
}
