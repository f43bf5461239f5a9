//! Anti-entropy with many containers on real daemons (issue 13, Done-when
//! 3): with 2,000 containers on two devices, an idle round costs each peer
//! a few hundred bytes (it was about 130 KB with per-container heads
//! summaries), and a change made while the other device was down is found
//! among them as soon as it is back.

mod common;

use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, Instant};

use common::*;
use serde_json::{Value, json};

const CONTAINERS: usize = 2_000;
/// The engine's anti-entropy interval.
const ROUND: Duration = Duration::from_secs(5);

fn heads_by_container(home: &Path) -> BTreeMap<String, Value> {
    status(home).unwrap()["containers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| (c["name"].as_str().unwrap().to_owned(), c["heads"].clone()))
        .collect()
}

#[test]
fn two_thousand_idle_containers_cost_little_and_one_change_converges() {
    isolated(
        "two_thousand_idle_containers_cost_little_and_one_change_converges",
        || {
            let mut c = Cluster::new();
            let a = c.init("a");
            let b = c.provision(&a, "b");
            c.start(&a, &[]);
            let ib = c.start(&b, &[]);
            let ops: Vec<Value> = (0..CONTAINERS)
                .map(|i| json!({"op": "put", "container": format!("c-{i:04}"), "key": "k", "value": i}))
                .collect();
            let (code, r) = api_post(&a, "/v1/state.batch", &json!({ "ops": ops }));
            assert_eq!(
                (code, r["applied"].clone()),
                (200, json!(CONTAINERS)),
                "{r}"
            );
            let started = Instant::now();
            wait_for(
                "b holds all 2,000 containers as a does",
                Duration::from_secs(60),
                || {
                    let (ha, hb) = (heads_by_container(&a), heads_by_container(&b));
                    (ha.len() >= CONTAINERS && ha == hb).then_some(())
                },
            );
            println!("2,000 containers converged in {:?}", started.elapsed());

            // Idle: let the early digests that follow convergence pass, then
            // count what each side sends over four rounds.
            std::thread::sleep(ROUND);
            let rounds = 4;
            let before = (
                metric(&a, "nuwa_bytes_sent_total"),
                metric(&b, "nuwa_bytes_sent_total"),
            );
            std::thread::sleep(ROUND * rounds);
            let after = (
                metric(&a, "nuwa_bytes_sent_total"),
                metric(&b, "nuwa_bytes_sent_total"),
            );
            let per_round = (
                (after.0 - before.0) / rounds as f64,
                (after.1 - before.1) / rounds as f64,
            );
            println!(
                "idle with {CONTAINERS} containers: a sends {:.0} B, b sends {:.0} B per peer per round",
                per_round.0, per_round.1
            );
            assert!(
                per_round.0 > 0.0 && per_round.1 > 0.0,
                "no anti-entropy at all"
            );
            assert!(
                per_round.0 <= 1024.0 && per_round.1 <= 1024.0,
                "idle anti-entropy over 1 KB per peer per round: {per_round:?}"
            );

            // One change among them while b is down: found when b is back.
            c.stop(ib);
            cli_ok(
                &a,
                &[
                    "state",
                    "put",
                    "c-1234",
                    "k",
                    "\"changed while b was down\"",
                ],
            );
            let restarted = Instant::now();
            c.start(&b, &[]);
            wait_for("b has the one change", Duration::from_secs(30), || {
                (get_json(&b, "c-1234") == Some(json!({"k": "changed while b was down"})))
                    .then_some(())
            });
            let took = restarted.elapsed();
            println!("one change among {CONTAINERS} converged {took:?} after b restarted");
            wait_for(
                "a and b hold the same heads",
                Duration::from_secs(30),
                || (heads_by_container(&a) == heads_by_container(&b)).then_some(()),
            );
        },
    );
}
