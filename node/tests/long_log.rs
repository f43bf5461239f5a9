//! Issue 15, the DID chain on real daemons: 1,000 DID updates scripted
//! through the admin's API keep the `Hello` and the DHT pointer small, and a
//! sibling that missed all of them finds the admin through the DHT alone,
//! fetches the entries it lacks and syncs; homes written before chains
//! migrate on first start.
//!
//! The number of updates is `NUWA_LONG_LOG_UPDATES` (default 1,000).

mod common;

use std::time::{Duration, Instant};

use common::*;
use nuwa_agent::identity::chain::DidChain;
use nuwa_agent::identity::keys::DeviceKey;
use nuwa_agent::identity::log::DidLog;
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

/// Rewrites `homes`' `did-log.json` as a log of before issue 15 (every
/// update a whole document, `{"updates": …}`): the same document history,
/// signed again as v1 updates by the master key of `admin`.
fn write_v1_log(admin: &std::path::Path, homes: &[&std::path::Path]) -> usize {
    let chain: DidChain =
        serde_json::from_slice(&std::fs::read(admin.join("did-log.json")).unwrap()).unwrap();
    let master =
        DeviceKey::from_seed_file_bytes(&std::fs::read(admin.join("master.key")).unwrap()).unwrap();
    let genesis = serde_json::to_value(&chain.entries()[0]).unwrap();
    let mut v1: DidLog = serde_json::from_value(json!({ "updates": [genesis] })).unwrap();
    let master_id = v1.current().capability_delegation[0].clone();
    let t = v1.updates()[0].timestamp;
    for doc in chain.documents().skip(1) {
        v1.append(doc, &master, &master_id, t).unwrap();
    }
    let bytes = serde_json::to_vec_pretty(&v1).unwrap();
    for home in homes {
        std::fs::write(home.join("did-log.json"), &bytes).unwrap();
    }
    v1.len()
}

// Goal: homes whose did-log.json was written before DID chains (a v1 log)
// start, convert the file once (same entries, same hashes), admit each
// other and sync; the next update is a v2 entry that the other side
// accepts, so a device provisioned after the upgrade joins. Method: two
// homes rewritten with the same history as a v1 log, then started.
#[test]
fn homes_written_before_chains_migrate_on_first_start() {
    isolated("homes_written_before_chains_migrate_on_first_start", || {
        let mut c = Cluster::new();
        let a = c.init("a");
        let b = c.provision(&a, "b");
        let len = write_v1_log(&a, &[&a, &b]);
        let head_before = DidChain::from_v1(
            &serde_json::from_slice::<DidLog>(&std::fs::read(a.join("did-log.json")).unwrap())
                .unwrap(),
        )
        .unwrap()
        .head_hash()
        .to_owned();

        let ia = c.start(&a, &["--mdns-interface", "lo"]);
        let ib = c.start(&b, &["--mdns-interface", "lo"]);
        for home in [&a, &b] {
            let file: serde_json::Value =
                serde_json::from_slice(&std::fs::read(home.join("did-log.json")).unwrap()).unwrap();
            assert!(file.get("updates").is_none(), "converted: {file}");
            let chain: DidChain = serde_json::from_value(file).unwrap();
            assert_eq!(chain.len(), len, "every update kept");
            assert_eq!(chain.head_hash(), head_before, "same hashes");
        }
        assert!(c.logs().contains("to the DID chain format"));
        wait_for("a and b verify each other", Duration::from_secs(20), || {
            (verified(&status(&a).ok()?).len() == 1 && verified(&status(&b).ok()?).len() == 1)
                .then_some(())
        });
        cli_ok(&a, &["state", "put", "notes", "migrated", "true"]);
        wait_for("a's write reaches b", Duration::from_secs(20), || {
            (get_json(&b, "notes")?["migrated"] == json!(true)).then_some(())
        });

        // A v2 entry on the migrated chain: a new device joins.
        let n = c.provision(&a, "n");
        let i_n = c.start(&n, &["--mdns-interface", "lo"]);
        wait_for("n syncs the note", Duration::from_secs(30), || {
            (get_json(&n, "notes")?["migrated"] == json!(true)).then_some(())
        });
        wait_for("b learns the new entry", Duration::from_secs(20), || {
            (status(&b).ok()?["device"]["did_log_len"].as_u64()? == len as u64 + 1).then_some(())
        });
        for i in [i_n, ib, ia] {
            c.stop(i);
        }
    });
}
