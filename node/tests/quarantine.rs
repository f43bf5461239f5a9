//! Fault 4 of issue 11: one corrupt record used to stop the whole device
//! (the daemon refused to start, with no hint). Now a container whose
//! records fail to decrypt or decode is moved aside, counted, listed in
//! `status`, and resynced from peers, and the daemon starts.

mod common;

use std::time::Duration;

use common::*;

/// Flips one byte in the middle of the value of the last record of a
/// change log (as bit rot under sled's checksums would), with the daemon
/// stopped. Each NIP-8 namespace has its own log tree, `ns/<id>/log`; the
/// last one that holds records is taken.
fn flip_a_log_record(home: &std::path::Path) {
    let db = sled::open(home.join("store")).expect("open the stopped daemon's store");
    let log = db
        .tree_names()
        .into_iter()
        .filter(|name| name.starts_with(b"ns/") && name.ends_with(b"/log"))
        .map(|name| db.open_tree(name).unwrap())
        .rfind(|tree| !tree.is_empty())
        .expect("a namespace's log holds records");
    let (key, value) = log.last().unwrap().expect("the log holds records");
    let mut bad = value.to_vec();
    let i = bad.len() / 2;
    bad[i] ^= 0x40;
    log.insert(key, bad).unwrap();
    db.flush().unwrap();
}

// Goal: with a flipped byte in one live record, the device still starts,
// reports the container as quarantined (status, counter), and gets it back
// from its peer; the other containers are untouched.
#[test]
fn a_corrupt_container_is_quarantined_and_resynced() {
    isolated("a_corrupt_container_is_quarantined_and_resynced", || {
        let mut c = Cluster::new();
        let a = c.init("a");
        let b = c.provision(&a, "b");
        c.start(&a, &["--no-mdns"]);
        let a_addr = listen_addr(&a);
        let bd = c.start(&b, &["--no-mdns", "--peer", &a_addr]);
        cli_ok(&a, &["state", "put", "notes", "k", "\"v\""]);
        cli_ok(&a, &["state", "put", "other", "x", "1"]);
        wait_for("b has both containers", Duration::from_secs(30), || {
            (get_json(&b, "notes").is_some_and(|v| v["k"] == "v")
                && get_json(&b, "other").is_some_and(|v| v["x"] == 1))
            .then_some(())
        });
        c.stop(bd);
        flip_a_log_record(&b);
        c.start(&b, &["--no-mdns", "--peer", &a_addr]);
        let st = status(&b).unwrap();
        let q = st["quarantined"].as_array().unwrap();
        assert_eq!(q.len(), 1, "{st}");
        assert!(q[0]["records"].as_u64().unwrap() >= 1, "{st}");
        assert_eq!(st["counters"]["containers_quarantined"], 1, "{st}");
        assert!(cli_ok(&b, &["status"]).contains("QUARANTINED"));
        wait_for("b resynced everything", Duration::from_secs(30), || {
            (get_json(&b, "notes").is_some_and(|v| v["k"] == "v")
                && get_json(&b, "other").is_some_and(|v| v["x"] == 1))
            .then_some(())
        });
        // New writes land on top of the resynced container.
        cli_ok(&b, &["state", "put", "notes", "after", "true"]);
        wait_for("a gets b's new write", Duration::from_secs(30), || {
            get_json(&a, "notes").filter(|v| v["after"] == true)
        });
    });
}
