//! `status` answers "am I in sync?" on real daemons (issue 14): a device
//! that starts behind a peer holding many changes reports that peer by
//! name, the container as `behind` (by a count) or catching up while it
//! syncs, and `in_sync` with every container once it is done.

mod common;

use std::time::{Duration, Instant};

use common::*;
use serde_json::Value;

#[test]
fn a_lagging_device_says_what_it_lacks_then_in_sync() {
    isolated("a_lagging_device_says_what_it_lacks_then_in_sync", || {
        let mut c = Cluster::new();
        let a = c.init("laptop");
        let b = c.provision(&a, "phone");
        c.start(&a, &[]);
        // 100 transactions of 1,000 entries each, on a only (a batch of
        // 1,000 puts is about 5,000 JSON values, within one write's 6,000).
        let file = c.home("big.ndjson");
        let mut text = String::new();
        for i in 0..100_000 {
            text.push_str(&format!(
                "{{\"op\":\"put\",\"container\":\"big\",\"key\":\"k{i:06}\",\"value\":{i}}}\n"
            ));
        }
        std::fs::write(&file, text).unwrap();
        cli_ok(
            &a,
            &[
                "state",
                "import",
                file.to_str().unwrap(),
                "--batch-size",
                "1000",
            ],
        );

        c.start(&b, &[]);
        // Poll b's status until it says in sync; remember what it said on
        // the way.
        let started = Instant::now();
        let mut seen_lag: Vec<Value> = Vec::new();
        let last = wait_for("b to say in sync", Duration::from_secs(120), || {
            let st = status(&b).ok()?;
            for p in st["peers"].as_array().into_iter().flatten() {
                for s in p["sync"].as_array().into_iter().flatten() {
                    if s["container"] == "big"
                        && (s["state"] == "behind" || s["state"] == "syncing")
                    {
                        seen_lag.push(s.clone());
                    }
                }
            }
            for cu in st["catch_ups"].as_array().into_iter().flatten() {
                seen_lag.push(cu.clone());
            }
            (st["in_sync"] == Value::Bool(true)).then_some(st)
        });
        println!(
            "in sync after {:?}; lag reports seen: {}",
            started.elapsed(),
            seen_lag.len()
        );
        assert!(
            !seen_lag.is_empty(),
            "b never said it lacked anything while it synced 100 changes"
        );
        println!(
            "first: {}\nlast: {}",
            seen_lag[0],
            seen_lag[seen_lag.len() - 1]
        );
        // The peer said how many changes it holds, so b said how many it
        // lacked (the 100, or fewer later).
        assert!(
            seen_lag
                .iter()
                .any(|s| s["behind"].as_u64().is_some() || s["changes"].as_u64() > Some(0)),
            "b never said how many changes it lacked: {seen_lag:?}"
        );
        // Where a count was given, it is the 100 changes (or fewer, later).
        for s in &seen_lag {
            if let Some(n) = s["behind"].as_u64() {
                assert!((1..=100).contains(&n), "{s}");
            }
        }
        let peer = &last["peers"][0];
        assert_eq!(peer["name"], "laptop", "{peer}");
        assert!(
            peer["sync"]
                .as_array()
                .unwrap()
                .iter()
                .all(|s| s["state"] == "in_sync"),
            "{peer}"
        );
        let big = last["containers"]
            .as_array()
            .unwrap()
            .iter()
            .find(|x| x["name"] == "big")
            .cloned()
            .unwrap();
        assert_eq!(big["changes"], 100, "{big}");
        // The text form says the same.
        let text = cli_ok(&b, &["status"]);
        assert!(
            text.starts_with("sync       IN SYNC with 1 peer(s)"),
            "{text}"
        );
    });
}
