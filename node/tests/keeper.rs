//! Devices that are never online together, through a keeper: real
//! `nuwa-node rendezvous --keeper` and real daemons on loopback, in a
//! network namespace of their own. The NAT lab (`testnet/nat-suite.sh`,
//! case 3) runs the same across home routers and a kill -9 of the keeper.

mod common;

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use common::*;

struct Keeper {
    child: Child,
    addr: String,
}

impl Drop for Keeper {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start_keeper(c: &Cluster, quota_envelopes: &str) -> Keeper {
    let mut child = Command::new(bin())
        .arg("--home")
        .arg(c.home("keeper"))
        .args([
            "rendezvous",
            "--keeper",
            "--keeper-quota-envelopes",
            quota_envelopes,
            "--listen",
            "/ip4/127.0.0.1/tcp/0",
        ])
        .env("RUST_LOG", "info")
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(c.dir.path().join("keeper.log")).unwrap())
        .spawn()
        .expect("spawn nuwa-node rendezvous --keeper");
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let addr = line.trim().to_owned();
    assert!(addr.contains("/p2p/"), "{addr:?}");
    Keeper { child, addr }
}

fn keeper_field(home: &std::path::Path, field: &str) -> Option<serde_json::Value> {
    status(home).ok()?["keepers"].get(0)?.get(field).cloned()
}

// Goal: A writes, the keeper acknowledges, A stops; B, never online with A,
// gets everything from the keeper alone. Under a quota far smaller than the
// history, A compacts (a snapshot replaces what the keeper held) instead of
// being refused for good. Method: a 20-envelope quota; A writes 300 keys in
// 30 bursts (so it pushes many small batches); A must report everything
// pushed, the keeper must have dropped compacted entries, and B must hold
// all 300 keys.
#[test]
fn not_online_together_through_a_keeper_that_compacts() {
    isolated("not_online_together_through_a_keeper_that_compacts", || {
        let mut c = Cluster::new();
        let keeper = start_keeper(&c, "20");
        let a = c.init("a");
        let b = c.provision(&a, "b");
        let only_keeper = [
            "--no-mdns",
            "--no-dht",
            "--no-rendezvous",
            "--no-known-peers",
            "--keeper",
            keeper.addr.as_str(),
        ];
        let ia = c.start(&a, &only_keeper);
        for burst in 0..30 {
            put_many(&a, "notes", &format!("b{burst}-"), 10);
            std::thread::sleep(Duration::from_millis(250));
        }
        // Compaction is tried at most once a minute; the deadline covers
        // one retry.
        wait_for("A: everything pushed", Duration::from_secs(90), || {
            (keeper_field(&a, "pushed_all")? == serde_json::json!(true)).then_some(())
        });
        let a_log = c.logs();
        c.stop(ia);
        assert!(
            a_log.contains("pushing a compacted snapshot"),
            "A compacted under the 20-envelope quota"
        );
        let ib = c.start(&b, &only_keeper);
        wait_for("B: all 300 keys", Duration::from_secs(10), || {
            let n = get_json(&b, "notes")?.as_object()?.len();
            (n == 300).then_some(())
        });
        c.stop(ib);
        // SIGTERM, so the keeper logs its counters as it exits.
        let mut keeper = keeper;
        let _ = Command::new("kill")
            .args(["-TERM", &keeper.child.id().to_string()])
            .status();
        let _ = keeper.child.wait();
        let keeper_log = std::fs::read_to_string(c.dir.path().join("keeper.log")).unwrap();
        let exit = keeper_log
            .lines()
            .find(|l| l.contains("keeper counters at exit"))
            .unwrap_or_else(|| panic!("the keeper logged its counters at exit:\n{keeper_log}"));
        let compacted: u64 = exit
            .split("compacted=")
            .nth(1)
            .and_then(|s| s.split_whitespace().next())
            .and_then(|s| s.parse().ok())
            .unwrap_or(0);
        assert!(
            compacted > 0,
            "the keeper dropped entries a snapshot covered: {exit}"
        );
    });
}
