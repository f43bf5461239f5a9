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
    start_keeper_on(c, quota_envelopes, "/ip4/127.0.0.1/tcp/0")
}

fn start_keeper_on(c: &Cluster, quota_envelopes: &str, listen: &str) -> Keeper {
    let mut child = Command::new(bin())
        .arg("--home")
        .arg(c.home("keeper"))
        .args([
            "rendezvous",
            "--keeper",
            "--keeper-quota-envelopes",
            quota_envelopes,
            "--listen",
            listen,
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

// Goal: a keeper restarted on an older copy of its store (a restored
// backup) is noticed by a device that had seen more of it, and loses no
// acknowledged write (issue 41: it went unnoticed, and a device meeting
// only the keeper then lacked the writes made after the copy). Method: a
// real keeper on a fixed port; A writes 20 keys, the keeper's home is
// copied while it is stopped, A writes 10 more; the keeper restarts on
// the copy. A's status must report the rollback and push everything
// again; B, never online with A, must then get all 30 from the keeper.
#[test]
fn a_keeper_rolled_back_to_a_copy_is_noticed_and_refilled() {
    isolated(
        "a_keeper_rolled_back_to_a_copy_is_noticed_and_refilled",
        || {
            let mut c = Cluster::new();
            let port = std::net::TcpListener::bind("127.0.0.1:0")
                .and_then(|l| l.local_addr())
                .expect("a free port")
                .port();
            let listen = format!("/ip4/127.0.0.1/tcp/{port}");
            let stop = |mut k: Keeper| {
                let _ = Command::new("kill")
                    .args(["-TERM", &k.child.id().to_string()])
                    .status();
                let _ = k.child.wait();
            };
            let keeper = start_keeper_on(&c, "100000", &listen);
            let addr = keeper.addr.clone();
            let a = c.init("a");
            let b = c.provision(&a, "b");
            let only_keeper = [
                "--no-mdns",
                "--no-dht",
                "--no-rendezvous",
                "--no-known-peers",
                "--keeper",
                addr.as_str(),
            ];
            let pushed = |what: &str| {
                wait_for(what, Duration::from_secs(30), || {
                    (keeper_field(&a, "pushed_all")? == serde_json::json!(true)).then_some(())
                })
            };
            let ia = c.start(&a, &only_keeper);
            put_many(&a, "notes", "before-", 20);
            pushed("A: the first 20 pushed");
            stop(keeper);
            let backup = c.dir.path().join("keeper-backup");
            copy_home(&c.home("keeper"), &backup);
            let keeper = start_keeper_on(&c, "100000", &listen);
            put_many(&a, "notes", "after-", 10);
            wait_for("A: the keeper again", Duration::from_secs(30), || {
                (keeper_field(&a, "connected")? == serde_json::json!(true)).then_some(())
            });
            pushed("A: all 30 pushed");
            assert!(keeper_field(&a, "rollback").is_some_and(|r| r.is_null()));
            stop(keeper);
            std::fs::remove_dir_all(c.home("keeper")).unwrap();
            copy_home(&backup, &c.home("keeper"));
            let keeper = start_keeper_on(&c, "100000", &listen);
            let rollback = wait_for("A: the rollback reported", Duration::from_secs(30), || {
                keeper_field(&a, "rollback").filter(|r| !r.is_null())
            });
            let (held, served) = (
                rollback["held_seq"].as_u64(),
                rollback["served_seq"].as_u64(),
            );
            assert!(held > served, "{rollback}");
            let text = cli_ok(&a, &["status"]);
            assert!(text.contains("ROLLED BACK"), "{text}");
            assert!(metric(&a, "nuwa_keeper_rollbacks_total") >= 1.0);
            pushed("A: everything pushed again");
            c.stop(ia);
            let ib = c.start(&b, &only_keeper);
            wait_for(
                "B: all 30 keys from the keeper",
                Duration::from_secs(20),
                || {
                    let n = get_json(&b, "notes")?.as_object()?.len();
                    (n == 30).then_some(())
                },
            );
            c.stop(ib);
            drop(keeper);
        },
    );
}

// Goal: grants travel through the keeper (issue 24, done-when 4 on
// loopback). A revokes V while B is away and writes a secret under the new
// epoch; A stops. B, which meets nobody but the keeper and still holds the
// chain from before the revocation, reads the secret (the keeper served
// the chain and the grant), and lists V as revoked. V, back with only the
// keeper, is refused by it and reads nothing new. Method: a real keeper
// and three real daemons with every discovery off but the keeper.
#[test]
fn a_keeper_only_device_reads_what_was_written_after_a_revocation() {
    isolated(
        "a_keeper_only_device_reads_what_was_written_after_a_revocation",
        || {
            let mut c = Cluster::new();
            let keeper = start_keeper(&c, "100000");
            let a = c.init("a");
            let b = c.provision(&a, "b");
            let v = c.provision(&a, "v");
            let only_keeper = [
                "--no-mdns",
                "--no-dht",
                "--no-rendezvous",
                "--no-known-peers",
                "--keeper",
                keeper.addr.as_str(),
            ];
            let ia = c.start(&a, &only_keeper);
            cli_ok(&a, &["state", "put", "notes", "before", "1"]);
            wait_for("A: the first write pushed", Duration::from_secs(20), || {
                (keeper_field(&a, "pushed_all")? == serde_json::json!(true)).then_some(())
            });
            let cv = context_id(&v);
            cli_ok(&a, &["device", "revoke", "--yes", &cv]);
            let secret = unique_marker();
            cli_ok(
                &a,
                &["state", "put", "notes", "secret", &format!("\"{secret}\"")],
            );
            wait_for(
                "A: the secret pushed (with the grant)",
                Duration::from_secs(20),
                || {
                    let s = status(&a).ok()?;
                    let pushed = s["keepers"][0]["pushed_all"] == serde_json::json!(true);
                    let grants_in = s["counters"]["keeper_pushes"].as_u64()? >= 2;
                    (pushed && grants_in).then_some(())
                },
            );
            c.stop(ia);

            let ib = c.start(&b, &only_keeper);
            wait_for(
                "B reads the secret through the keeper alone",
                Duration::from_secs(20),
                || {
                    get_json(&b, "notes")
                        .is_some_and(|n| {
                            n["before"] == serde_json::json!(1)
                                && n["secret"] == serde_json::json!(secret)
                        })
                        .then_some(())
                },
            );
            let st = status(&b).unwrap();
            assert!(
                st["counters"]["keeper_chain_merged"].as_u64() >= Some(1),
                "{st}"
            );
            assert!(
                st["counters"]["epoch_grants_adopted"].as_u64() >= Some(1),
                "{st}"
            );
            let list: serde_json::Value =
                serde_json::from_str(&cli_ok(&b, &["device", "list", "--json"])).unwrap();
            let row = list
                .as_array()
                .unwrap()
                .iter()
                .find(|d| d["context_id"] == serde_json::json!(cv))
                .cloned()
                .unwrap();
            assert_eq!(row["status"], serde_json::json!("revoked"), "{list}");
            c.stop(ib);

            let iv = c.start(&v, &only_keeper);
            wait_for("the keeper refuses V", Duration::from_secs(20), || {
                (status(&v).ok()?["counters"]["keeper_refusals"].as_u64()? >= 1).then_some(())
            });
            let nv = get_json(&v, "notes");
            assert!(
                nv.as_ref().is_none_or(|n| n.get("secret").is_none()),
                "the revoked device read the secret: {nv:?}"
            );
            c.stop(iv);
        },
    );
}
