//! Real-process tests of the walking skeleton: several `nuwa-node` daemons on
//! loopback in a private network namespace, discovering each other by real
//! mDNS packets and syncing over real libp2p connections and sled stores.

mod common;

use std::time::{Duration, Instant};

use common::*;
use serde_json::json;

// Goal: three devices of one agent (init + two provisions) verify each other
// within 5 s, concurrent puts on two of them converge to the same JSON on all
// three, and a unique written string appears in no file under any home.
// Method: start three daemons, poll `status --json`, then run puts from two
// threads at once and poll `state get --json` until all three agree.
#[test]
fn three_devices_verify_and_converge() {
    isolated("three_devices_verify_and_converge", || {
        let mut c = Cluster::new();
        let a = c.init("a");
        let b = c.provision(&a, "b");
        let d = c.provision(&a, "d");
        let started = Instant::now();
        for h in [&a, &b, &d] {
            c.start(h, &[]);
        }
        let all = [&a, &b, &d];
        let ids: Vec<String> = all.iter().map(|h| context_id(h)).collect();
        wait_for("all three verified", Duration::from_secs(5), || {
            all.iter()
                .enumerate()
                .all(|(i, h)| {
                    let mut want: Vec<String> = ids
                        .iter()
                        .enumerate()
                        .filter(|(j, _)| *j != i)
                        .map(|(_, s)| s.clone())
                        .collect();
                    want.sort();
                    status(h).map(|st| verified(&st) == want).unwrap_or(false)
                })
                .then_some(())
        });
        println!(
            "all verified {:?} after the daemons started",
            started.elapsed()
        );

        // device list: every device, active, with names learned from Hellos.
        let list: serde_json::Value =
            serde_json::from_str(&cli_ok(&a, &["device", "list", "--json"])).unwrap();
        let rows = list.as_array().unwrap();
        assert_eq!(rows.len(), 3, "{list}");
        for r in rows {
            assert_eq!(r["status"], json!("active"), "{r}");
            assert!(
                r["relationships"]
                    .as_array()
                    .unwrap()
                    .contains(&json!("authentication"))
            );
            assert!(r["last_seen_unix_ms"].as_u64().is_some(), "{r}");
        }
        let mut names: Vec<&str> = rows.iter().map(|r| r["name"].as_str().unwrap()).collect();
        names.sort();
        assert_eq!(names, vec!["a", "b", "d"]);
        // The key-agreement key each device publishes is in the document.
        let doc = std::fs::read_to_string(a.join("did-log.json")).unwrap();
        assert!(
            doc.contains(&format!("{}-x25519", ids[1])),
            "no keyAgreement key"
        );

        let marker = unique_marker();
        let (a2, b2, m2) = (a.clone(), b.clone(), marker.clone());
        let ta = std::thread::spawn(move || {
            for i in 0..5 {
                cli_ok(
                    &a2,
                    &[
                        "state",
                        "put",
                        "notes",
                        &format!("a{i}"),
                        &format!("\"{m2}-a{i}\""),
                    ],
                );
                cli_ok(&a2, &["state", "put", "notes", "shared", "\"from a\""]);
            }
        });
        let tb = std::thread::spawn(move || {
            for i in 0..5 {
                cli_ok(
                    &b2,
                    &["state", "put", "notes", &format!("b{i}"), "{\"n\": [1, 2]}"],
                );
                cli_ok(&b2, &["state", "put", "notes", "shared", "\"from b\""]);
            }
        });
        ta.join().unwrap();
        tb.join().unwrap();

        let converged = wait_for(
            "converged JSON on all three",
            Duration::from_secs(15),
            || {
                let docs: Vec<_> = all.iter().map(|h| get_json(h, "notes")).collect();
                let first = docs[0].clone()?;
                (first.as_object().map(|o| o.len()) == Some(11)
                    && docs.iter().all(|d| d.as_ref() == Some(&first)))
                .then_some(first)
            },
        );
        assert_eq!(converged["a4"], json!(format!("{marker}-a4")));
        assert_eq!(converged["b0"], json!({"n": [1, 2]}));
        assert!(converged["shared"] == json!("from a") || converged["shared"] == json!("from b"));
        // The CLI's --json output is byte-identical too.
        let outs: Vec<String> = all
            .iter()
            .map(|h| cli_ok(h, &["state", "get", "notes", "--json"]))
            .collect();
        assert!(outs.iter().all(|o| o == &outs[0]), "{outs:?}");

        // Nothing written reaches any file under a home in plaintext. A
        // one-value container is the positive control: its exported
        // Automerge document holds the marker literally (larger documents
        // deflate their columns), so the scan would find it if the store
        // kept plaintext.
        cli_ok(
            &a,
            &["state", "put", "probe", &marker, &format!("\"{marker}\"")],
        );
        wait_for("probe reaches d", Duration::from_secs(10), || {
            get_json(&d, "probe")
        });
        for h in all {
            let hits = files_containing(h, marker.as_bytes());
            assert!(hits.is_empty(), "plaintext state found in {hits:?}");
        }
        let export = c.dir.path().join("probe.automerge");
        cli_ok(
            &a,
            &[
                "state",
                "export",
                "probe",
                "--out",
                export.to_str().unwrap(),
            ],
        );
        assert_eq!(
            files_containing(c.dir.path(), marker.as_bytes()),
            vec![export]
        );
    });
}

// Goal: a daemon killed with SIGKILL right after acknowledged puts keeps them
// all, and catches up on puts made elsewhere while it was down.
// Method: put on b, kill -9 b, put on a; restart b alone (no mDNS, no known
// peers) and read its own puts back; then restart it with only its
// known-peers cache and wait until it has a's puts.
#[test]
fn kill_9_keeps_acknowledged_writes_and_catches_up() {
    isolated("kill_9_keeps_acknowledged_writes_and_catches_up", || {
        let mut c = Cluster::new();
        let a = c.init("a");
        let b = c.provision(&a, "b");
        c.start(&a, &[]);
        let ib = c.start(&b, &[]);
        wait_for("b verifies a", Duration::from_secs(10), || {
            status(&b).ok().filter(|st| verified(st).len() == 1)
        });

        for i in 0..20 {
            cli_ok(
                &b,
                &["state", "put", "log", &format!("b{i:02}"), &i.to_string()],
            );
        }
        c.kill9(ib);
        assert!(
            !cli(&b, &["status"]).status.success(),
            "the killed daemon must not answer"
        );
        let msg = String::from_utf8(cli(&b, &["state", "get", "log"]).stderr).unwrap();
        assert!(msg.contains("no nuwa-node daemon is running"), "{msg}");
        for i in 0..10 {
            cli_ok(
                &a,
                &["state", "put", "log", &format!("a{i:02}"), &i.to_string()],
            );
        }

        // Alone: everything b acknowledged is in b's own store.
        let alone = c.start(&b, &["--no-mdns", "--no-known-peers"]);
        let doc = get_json(&b, "log").expect("container survives the crash");
        for i in 0..20 {
            assert_eq!(
                doc[format!("b{i:02}")],
                json!(i),
                "acknowledged put b{i:02} lost: {doc}"
            );
        }
        assert!(verified(&status(&b).unwrap()).is_empty());
        c.stop(alone);

        // With only the known-peers cache (no mDNS): b finds a again and
        // catches up on what a wrote meanwhile.
        c.start(&b, &["--no-mdns"]);
        wait_for("b catches up on a's puts", Duration::from_secs(15), || {
            let doc = get_json(&b, "log")?;
            (doc.as_object()?.len() == 30 && Some(&doc) == get_json(&a, "log").as_ref())
                .then_some(())
        });
    });
}

// Goal: a daemon of another agent and a daemon claiming this agent with a key
// that is not in its DID document are seen (by mDNS, and by a direct dial)
// but never verified; they receive nothing, inject nothing, and `status`
// shows the rejections. Method: run a, b of agent A, f of agent F (dialing a
// directly) and r (agent A's DID log, unlisted key); write secrets on every
// side and check where they end up.
#[test]
fn strangers_are_seen_but_never_verified() {
    isolated("strangers_are_seen_but_never_verified", || {
        let mut c = Cluster::new();
        let a = c.init("a");
        let b = c.provision(&a, "b");
        let f = c.init("f");
        let r = c.init("r");
        // r claims agent A: it holds A's (valid) DID log but its own key.
        std::fs::copy(a.join("did-log.json"), r.join("did-log.json")).unwrap();

        c.start(&a, &[]);
        let st_a = status(&a).unwrap();
        let a_addr = st_a["listen_addrs"][0].as_str().unwrap().to_owned();
        c.start(&b, &[]);
        c.start(&f, &["--peer", &a_addr]);
        c.start(&r, &[]);
        let r_peer = status(&r).unwrap()["device"]["peer_id"]
            .as_str()
            .unwrap()
            .to_owned();
        let f_peer = status(&f).unwrap()["device"]["peer_id"]
            .as_str()
            .unwrap()
            .to_owned();
        assert_eq!(status(&r).unwrap()["device"]["authorised"], json!(false));

        cli_ok(&a, &["state", "put", "notes", "secret", "\"a-secret\""]);
        cli_ok(&r, &["state", "put", "notes", "rogue", "\"injected by r\""]);
        cli_ok(
            &f,
            &["state", "put", "notes", "foreign", "\"injected by f\""],
        );

        // The honest pair syncs.
        wait_for("b receives a's secret", Duration::from_secs(10), || {
            (get_json(&b, "notes")? == json!({"secret": "a-secret"})).then_some(())
        });
        // a records every kind of rejection.
        // mDNS re-queries back off exponentially, so a loaded machine may
        // take a few seconds to resolve every instance.
        let st = wait_for("a records the rejections", Duration::from_secs(20), || {
            let st = status(&a).ok()?;
            // Shown only if the test fails.
            eprintln!("a's rejections so far: {}", st["rejections"]);
            let rej = st["rejections"].as_array()?.clone();
            let has = |source: &str, peer: &str, label: &str| {
                rej.iter()
                    .any(|x| x["source"] == source && x["peer"] == peer && x["label"] == label)
            };
            (has("mdns", &r_peer, "unknown_key")
                && has("connection", &r_peer, "unknown_key")
                && has("mdns", &f_peer, "different_agent")
                && has("connection", &f_peer, "different_agent"))
            .then_some(st)
        });
        assert_eq!(verified(&st), vec![context_id(&b)]);
        let counters = &st["counters"];
        assert!(
            counters["rejected_connection_unknown_key"]
                .as_u64()
                .unwrap()
                >= 1,
            "{counters}"
        );
        assert!(
            counters["rejected_connection_different_agent"]
                .as_u64()
                .unwrap()
                >= 1,
            "{counters}"
        );

        // Give the strangers several anti-entropy rounds (5 s each) to leak
        // or inject something, then check nothing crossed.
        let until = Instant::now() + Duration::from_secs(6);
        wait_for("six seconds of exposure", Duration::from_secs(7), || {
            (Instant::now() >= until).then_some(())
        });
        for h in [&a, &b] {
            assert_eq!(
                get_json(h, "notes").unwrap(),
                json!({"secret": "a-secret"}),
                "{}",
                h.display()
            );
            assert_eq!(verified(&status(h).unwrap()), {
                let mut v = vec![context_id(&a), context_id(&b)];
                v.retain(|x| *x != context_id(h));
                v
            });
        }
        assert_eq!(
            get_json(&r, "notes").unwrap(),
            json!({"rogue": "injected by r"})
        );
        assert_eq!(
            get_json(&f, "notes").unwrap(),
            json!({"foreign": "injected by f"})
        );
        assert!(verified(&status(&f).unwrap()).is_empty());
    });
}

// Goal: the CLI explains what to do when no daemon runs, and refuses bad
// input without touching state. Method: run CLI commands against a home with
// no daemon and with a daemon.
#[test]
fn cli_errors_are_clear() {
    isolated("cli_errors_are_clear", || {
        let mut c = Cluster::new();
        let a = c.init("a");
        let out = cli(&a, &["status"]);
        assert!(!out.status.success());
        let err = String::from_utf8(out.stderr).unwrap();
        assert!(
            err.contains("no nuwa-node daemon is running") && err.contains("run"),
            "{err}"
        );
        let again = cli(&a, &["init", "--i-have-written-it-down"]);
        assert!(!again.status.success());
        assert!(
            String::from_utf8(again.stderr)
                .unwrap()
                .contains("already holds")
        );
        let missing = c.home("nowhere");
        let err = String::from_utf8(cli(&missing, &["run"]).stderr).unwrap();
        assert!(
            err.contains("is not a nuwa-node home") && err.contains("init"),
            "{err}"
        );

        c.start(&a, &[]);
        let bad = cli(&a, &["state", "put", "c", "k", "not json"]);
        assert!(!bad.status.success());
        assert!(
            String::from_utf8(bad.stderr)
                .unwrap()
                .contains("not valid JSON")
        );
        let none = cli(&a, &["state", "get", "c"]);
        assert!(
            String::from_utf8(none.stderr)
                .unwrap()
                .contains("does not exist")
        );
        let second = cli(
            &a,
            &["run", "--listen", "/ip4/127.0.0.1/tcp/0", "--no-mdns"],
        );
        assert!(
            String::from_utf8(second.stderr)
                .unwrap()
                .contains("already running")
        );
    });
}

// Goal: a DID log extension learned by one device reaches devices that never
// met the new one. Method: a and b run (mDNS off, b dials a); c is
// provisioned afterwards and dials only a; b must learn c's key from a's
// refreshed Hello.
#[test]
fn did_log_updates_propagate_to_connected_peers() {
    isolated("did_log_updates_propagate_to_connected_peers", || {
        let mut c = Cluster::new();
        let a = c.init("a");
        let b = c.provision(&a, "b");
        c.start(&a, &["--no-mdns"]);
        let a_addr = listen_addr(&a);
        c.start(&b, &["--no-mdns", "--peer", &a_addr]);
        wait_for("a and b verified", Duration::from_secs(10), || {
            (verified(&status(&b).ok()?).len() == 1).then_some(())
        });
        let late = c.provision(&a, "late");
        let late_ctx = context_id(&late);
        let b_log_before = std::fs::read_to_string(b.join("did-log.json")).unwrap();
        assert!(!b_log_before.contains(&late_ctx));
        c.start(&late, &["--no-mdns", "--no-known-peers", "--peer", &a_addr]);
        wait_for(
            "b learns the new device from a",
            Duration::from_secs(10),
            || {
                let list: serde_json::Value =
                    serde_json::from_str(&cli_ok(&b, &["device", "list", "--json"])).ok()?;
                list.as_array()?
                    .iter()
                    .any(|r| r["context_id"] == json!(late_ctx) && r["status"] == json!("active"))
                    .then_some(())
            },
        );
        assert!(
            std::fs::read_to_string(b.join("did-log.json"))
                .unwrap()
                .contains(&late_ctx)
        );
        assert!(
            !verified(&status(&b).unwrap()).contains(&late_ctx),
            "b never connected to the new device"
        );
        // Writes from the new device reach b through a.
        cli_ok(&late, &["state", "put", "notes", "from-late", "1"]);
        wait_for(
            "late's write reaches b via a",
            Duration::from_secs(15),
            || (get_json(&b, "notes")?["from-late"] == json!(1)).then_some(()),
        );
    });
}
