//! Finding 2 of issue 24: a home restored from a copy (a backup, or a
//! laptop cloned from the old one) and used before it met a peer wrote
//! under its device's Automerge actor again, with the change numbers its
//! peers already held from the copy's lost future. Every peer then refused
//! the documents holding both (`DuplicateSeqNumber`), and sync stopped for
//! good, both ways. Now every run of a daemon writes under an actor of its
//! own (`nuwa_sync::run_actor`), so nothing the restored home writes can
//! clash with what it wrote before and forgot.

mod common;

use std::path::Path;
use std::time::Duration;

use common::*;
use serde_json::Value;

/// Whether `home`'s container holds every key of `want` with its value.
fn holds(home: &Path, container: &str, want: &[(String, Value)]) -> bool {
    get_json(home, container).is_some_and(|got| want.iter().all(|(k, v)| got.get(k) == Some(v)))
}

fn put(home: &Path, container: &str, key: &str, value: &Value) {
    cli_ok(home, &["state", "put", container, key, &value.to_string()]);
}

// Goal: a home copied while its daemon runs, then restored after that
// daemon wrote more (which its peer received), and used with no peer
// reachable, converges with the peer once it returns: both devices end
// with every write, before the copy, after it on the lost future, and on
// the restored home; and new writes flow both ways after that.
#[test]
fn a_home_restored_from_a_copy_taken_while_it_ran_converges_both_ways() {
    isolated(
        "a_home_restored_from_a_copy_taken_while_it_ran_converges_both_ways",
        || {
            let mut c = Cluster::new();
            let a = c.init("a");
            let b = c.provision(&a, "b");
            let bd = c.start(&b, &["--no-mdns"]);
            let b_addr = listen_addr(&b);
            let ad = c.start(&a, &["--no-mdns", "--peer", &b_addr]);
            let mut every: Vec<(String, Value)> = Vec::new();
            for n in 0..3 {
                let (k, v) = (format!("before-{n}"), Value::from(n));
                put(&a, "notes", &k, &v);
                every.push((k, v));
            }
            wait_for("b has a's first writes", Duration::from_secs(30), || {
                holds(&b, "notes", &every).then_some(())
            });

            // The copy, taken while a's daemon runs.
            let copy = c.home("a-copy");
            copy_home(&a, &copy);

            // a writes on (the future the copy will not know); b gets it.
            for n in 0..5 {
                let (k, v) = (format!("lost-future-{n}"), Value::from(n));
                put(&a, "notes", &k, &v);
                every.push((k, v));
            }
            wait_for(
                "b has a's writes after the copy",
                Duration::from_secs(30),
                || holds(&b, "notes", &every).then_some(()),
            );
            c.stop(ad);
            c.stop(bd);

            // a's home is the copy again, and is used with no peer reachable.
            std::fs::remove_dir_all(&a).unwrap();
            copy_home(&copy, &a);
            let ad = c.start(&a, &["--no-mdns", "--no-known-peers"]);
            for n in 0..5 {
                let (k, v) = (format!("restored-{n}"), Value::from(n));
                put(&a, "notes", &k, &v);
                every.push((k, v));
            }
            let tasks = vec![("t".to_owned(), Value::from("on the restored home"))];
            put(&a, "tasks", "t", &tasks[0].1);
            assert!(
                !holds(&a, "notes", &every[3..8]),
                "the restored home cannot hold the lost future before it meets b"
            );

            // b returns.
            let bd = c.start(&b, &["--no-mdns", "--peer", &listen_addr(&a)]);
            wait_for(
                "both devices hold every write",
                Duration::from_secs(60),
                || {
                    (holds(&a, "notes", &every)
                        && holds(&b, "notes", &every)
                        && holds(&b, "tasks", &tasks))
                    .then_some(())
                },
            );

            // And sync goes on both ways, across a restart of the restored home.
            put(&b, "notes", "from-b", &Value::from(true));
            wait_for("a gets b's next write", Duration::from_secs(30), || {
                get_json(&a, "notes").filter(|v| v["from-b"] == true)
            });
            c.stop(ad);
            c.stop(bd);
            c.start(&b, &["--no-mdns"]);
            c.start(&a, &["--no-mdns", "--peer", &listen_addr(&b)]);
            put(&a, "notes", "after-restart", &Value::from(1));
            wait_for(
                "b gets a's write after its restart",
                Duration::from_secs(30),
                || get_json(&b, "notes").filter(|v| v["after-restart"] == 1),
            );
            let st = status(&b).unwrap();
            assert!(st["quarantined"].as_array().unwrap().is_empty(), "{st}");
        },
    );
}
