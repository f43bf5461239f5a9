//! Issue 15, "a long log", on real daemons: 1,000 DID updates scripted
//! through the admin's API keep the `Hello` and the DHT pointer small, and a
//! sibling that missed all of them finds the admin through the DHT alone,
//! fetches the entries it lacks and syncs.
//!
//! The number of updates is `NUWA_LONG_LOG_UPDATES` (default 1,000).

mod common;

use std::time::{Duration, Instant};

use common::*;
use serde_json::json;

/// Target of the issue: a `Hello` of at most 32 KiB after 1,000 updates.
const MAX_HELLO_BYTES: u64 = 32 * 1024;
/// Target of the issue: a DHT pointer of at most 16 KiB after 1,000 updates.
const MAX_POINTER_BYTES: u64 = 16 * 1024;

fn updates() -> usize {
    std::env::var("NUWA_LONG_LOG_UPDATES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1000)
}

// Goal: after 1,000 updates the Hello is ≤ 32 KiB and the pointer ≤ 16 KiB;
// the DHT carries the pointer and a device that missed every update finds
// its sibling through the DHT alone, catches up on the chain and syncs.
// Method: a rendezvous/DHT node on loopback; through its API, a provisions
// a device and revokes it 500 times (1,000 updates) while b is offline;
// then both start with only the DHT for discovery.
#[test]
fn a_thousand_did_updates_stay_small_and_travel() {
    isolated("a_thousand_did_updates_stay_small_and_travel", || {
        let mut c = Cluster::new();
        let infra = start_infra(&c);
        let a = c.init("a");
        let b = c.provision(&a, "b");
        let dht_only = [
            "--no-mdns",
            "--no-rendezvous",
            "--no-known-peers",
            "--bootstrap",
            infra.addr.as_str(),
        ];

        let ia = c.start(&a, &dht_only);
        let before = status(&a).unwrap()["device"]["did_log_len"]
            .as_u64()
            .unwrap();
        let n = updates();
        let t0 = Instant::now();
        // The updates a user makes: pair a device, retire it (a revocation
        // also opens a key epoch), again and again.
        for i in 0..n / 2 {
            let out = c.home(&format!("p{i}"));
            let (code, body) = api_post(
                &a,
                "/v1/devices/provision",
                &json!({ "out": out.to_str().unwrap(), "name": format!("p{i}") }),
            );
            assert_eq!(code, 200, "provision {i}: {body}");
            let ctx = body["context_id"].as_str().unwrap().to_owned();
            let (code, body) = api_post(&a, "/v1/devices/revoke", &json!({ "context_id": ctx }));
            assert_eq!(code, 200, "revoke {i}: {body}");
            let _ = std::fs::remove_dir_all(&out);
        }
        let n = n / 2 * 2;
        println!("{n} DID updates through the API in {:?}", t0.elapsed());
        let st = status(&a).unwrap();
        let len = st["device"]["did_log_len"].as_u64().unwrap();
        assert_eq!(len, before + n as u64, "every update is in a's chain");
        c.stop(ia);

        // Restarted, a publishes its pointer with the long chain's proof.
        let ia = c.start(&a, &dht_only);
        let pointer = wait_for(
            "a publishes its DHT pointer",
            Duration::from_secs(30),
            || status(&a).ok()?["dht_pointer"]["bytes"].as_u64(),
        );
        let hello = status(&a).unwrap()["device"]["hello_bytes"]
            .as_u64()
            .unwrap();
        println!(
            "after {n} updates ({len} entries): Hello {hello} bytes, DHT pointer {pointer} bytes"
        );
        assert!(
            hello > 0 && hello <= MAX_HELLO_BYTES,
            "Hello is {hello} bytes"
        );
        assert!(pointer <= MAX_POINTER_BYTES, "pointer is {pointer} bytes");

        // b missed every update and knows no address: only the DHT.
        let t1 = Instant::now();
        let ib = c.start(&b, &dht_only);
        wait_for("a and b verify each other", Duration::from_secs(60), || {
            (verified(&status(&a).ok()?).len() == 1 && verified(&status(&b).ok()?).len() == 1)
                .then_some(())
        });
        println!(
            "b found a through the DHT and caught up in {:?}",
            t1.elapsed()
        );
        let sb = status(&b).unwrap();
        assert_eq!(
            sb["device"]["did_log_len"].as_u64(),
            Some(len),
            "b holds a's whole chain"
        );
        assert!(metric(&b, "nuwa_did_entries_merged_total") >= 1.0);
        assert!(metric(&a, "nuwa_did_entries_served_total") >= 1.0);
        // The DHT carries the pointer: b's periodic lookup finds a's record
        // and verifies it (its proof is ahead of b's chain at first).
        wait_for(
            "b finds and verifies a's pointer in the DHT",
            Duration::from_secs(90),
            || (metric(&b, "nuwa_dht_pointers_verified_total") >= 1.0).then_some(()),
        );

        cli_ok(&a, &["state", "put", "notes", "after-1000", "true"]);
        wait_for("a's write reaches b", Duration::from_secs(20), || {
            (get_json(&b, "notes")?["after-1000"] == json!(true)).then_some(())
        });
        c.stop(ib);
        c.stop(ia);
    });
}
