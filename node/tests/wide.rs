//! Real-process tests of discovery beyond the LAN on loopback, in a private
//! network namespace: a `nuwa-node rendezvous` infrastructure node, devices
//! that find each other through it, a dead bootstrap address, headless
//! `sync --once`, and an in-process attacker swarm that forges DHT records,
//! rendezvous registrations and gossip.

mod common;

use std::process::Command;
use std::time::{Duration, Instant};

use common::*;
use nuwa_agent::identity::chain::DidChain;
use nuwa_agent::identity::keys::DeviceKey;
use nuwa_agent::sync::pointer::{AgentPointer, dht_key, gossip_topic, rendezvous_namespace};
use nuwa_net::{Features, NetConfig, NetEvent, PeerId};
use serde_json::{Value, json};
use zeroize::Zeroizing;

/// A swarm with a fresh key that belongs to no agent, listening on loopback
/// with every device feature on (DHT, rendezvous client, gossip).
async fn spawn_attacker() -> (
    nuwa_net::NetHandle,
    tokio::sync::mpsc::Receiver<NetEvent>,
    tokio_util::sync::CancellationToken,
) {
    let key = DeviceKey::generate().unwrap();
    let cancel = tokio_util::sync::CancellationToken::new();
    let (net, events) = nuwa_net::spawn(
        Zeroizing::new(*key.seed()),
        NetConfig {
            listen: vec!["/ip4/127.0.0.1/tcp/0".parse().unwrap()],
            features: Features::default(),
            ..NetConfig::default()
        },
        cancel.clone(),
    )
    .await
    .unwrap();
    (net, events, cancel)
}

fn counter(st: &Value, name: &str) -> u64 {
    st["counters"][name].as_u64().unwrap_or(0)
}

fn did_of(home: &std::path::Path) -> String {
    let log: DidChain =
        serde_json::from_slice(&std::fs::read(home.join("did-log.json")).unwrap()).unwrap();
    log.did().to_owned()
}

// Goal: two devices with mDNS off find each other through rendezvous alone,
// and again through the DHT alone, on loopback. Method: one infrastructure
// node; start the devices with only one source switched on each time.
#[test]
fn rendezvous_only_and_dht_only() {
    isolated("rendezvous_only_and_dht_only", || {
        let mut c = Cluster::new();
        let infra = start_infra(&c);
        let a = c.init("a");
        let b = c.provision(&a, "b");
        for (label, args) in [
            (
                "rendezvous",
                vec![
                    "--no-mdns",
                    "--no-dht",
                    "--no-known-peers",
                    "--rendezvous",
                    infra.addr.as_str(),
                ],
            ),
            (
                "dht",
                vec![
                    "--no-mdns",
                    "--no-rendezvous",
                    "--no-known-peers",
                    "--bootstrap",
                    infra.addr.as_str(),
                ],
            ),
        ] {
            let t0 = Instant::now();
            let ia = c.start(&a, &args);
            let ib = c.start(&b, &args);
            wait_for(
                &format!("{label}: both verified"),
                Duration::from_secs(10),
                || {
                    (verified(&status(&a).ok()?).len() == 1
                        && verified(&status(&b).ok()?).len() == 1)
                        .then_some(())
                },
            );
            println!("{label} only: verified {:?} after start", t0.elapsed());
            let key = format!("via-{label}");
            cli_ok(&a, &["state", "put", "notes", &key, "true"]);
            wait_for(
                &format!("{label}: put reaches b"),
                Duration::from_secs(10),
                || (get_json(&b, "notes")?[&key] == json!(true)).then_some(()),
            );
            c.stop(ia);
            c.stop(ib);
        }
    });
}

// Goal: a configured DHT bootstrap address that is dead does not stop two
// devices on one LAN from syncing through mDNS. Method: give both a
// bootstrap address nobody listens on.
#[test]
fn dead_bootstrap_does_not_block_mdns() {
    isolated("dead_bootstrap_does_not_block_mdns", || {
        let mut c = Cluster::new();
        let a = c.init("a");
        let b = c.provision(&a, "b");
        let nobody = DeviceKey::generate().unwrap();
        let dead = format!(
            "/ip4/127.0.0.1/tcp/9/p2p/{}",
            nuwa_net::id_of(&nobody.public()).unwrap()
        );
        let dead_rv = format!(
            "/ip4/127.0.0.1/tcp/7/p2p/{}",
            nuwa_net::id_of(&nobody.public()).unwrap()
        );
        let t0 = Instant::now();
        c.start(&a, &["--bootstrap", &dead, "--rendezvous", &dead_rv]);
        c.start(&b, &["--bootstrap", &dead, "--rendezvous", &dead_rv]);
        wait_for("verified through mDNS", Duration::from_secs(5), || {
            (verified(&status(&a).ok()?).len() == 1).then_some(())
        });
        println!(
            "verified {:?} after start despite dead sources",
            t0.elapsed()
        );
        cli_ok(&a, &["state", "put", "notes", "k", "1"]);
        wait_for("sync through mDNS", Duration::from_secs(10), || {
            (get_json(&b, "notes")? == json!({"k": 1})).then_some(())
        });
        assert!(counter(&status(&a).unwrap(), "dial_failed") >= 1);
    });
}

// Goal: `sync --once` in a fresh home provisioned for the agent pulls the
// full state and exits 0; with no peer reachable it exits non-zero within its
// timeout and says why; with `--json` it prints one JSON result either way.
// Method: run it against a running device, then alone.
#[test]
fn sync_once_pulls_state_or_explains() {
    isolated("sync_once_pulls_state_or_explains", || {
        let mut c = Cluster::new();
        let a = c.init("a");
        let fresh = c.provision(&a, "fresh");
        let lonely = c.provision(&a, "lonely");
        c.start(&a, &[]);
        // More changes than one compaction (2048): the fresh device stores
        // them as one snapshot rather than a log entry each.
        put_many(&a, "big", "k", 3000);
        cli_ok(&a, &["state", "put", "small", "x", "\"y\""]);

        let t0 = Instant::now();
        let out = Command::new(bin())
            .arg("--home")
            .arg(&fresh)
            .args([
                "sync",
                "--once",
                "--timeout",
                "30s",
                "--listen",
                "/ip4/127.0.0.1/tcp/0",
                "--mdns-interface",
                "lo",
            ])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "sync --once failed: {err}");
        assert!(err.contains("converged with 1 peer"), "{err}");
        println!("sync --once converged in {:?}", t0.elapsed());
        // What it pulled is in its store: read it back alone.
        let alone = c.start(&fresh, &["--no-mdns", "--no-known-peers"]);
        let big = get_json(&fresh, "big").unwrap();
        assert_eq!(big, get_json(&a, "big").unwrap());
        assert_eq!(big.as_object().unwrap().len(), 3000);
        assert_eq!(get_json(&fresh, "small").unwrap(), json!({"x": "y"}));
        // A write after the snapshot survives kill -9 along with it.
        cli_ok(&fresh, &["state", "put", "big", "after", "1"]);
        c.kill9(alone);
        c.start(&fresh, &["--no-mdns", "--no-known-peers"]);
        let big = get_json(&fresh, "big").unwrap();
        assert_eq!(big.as_object().unwrap().len(), 3001);
        assert_eq!(big["k2999"], json!(2999));

        // With --json: one JSON document on stdout, converged or not.
        let sync_json = |extra: &[&str]| {
            let out = Command::new(bin())
                .arg("--home")
                .arg(&lonely)
                .args([
                    "--json",
                    "sync",
                    "--once",
                    "--listen",
                    "/ip4/127.0.0.1/tcp/0",
                ])
                .args(extra)
                .output()
                .unwrap();
            let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
            assert_eq!(stdout.lines().count(), 1, "one JSON document: {stdout:?}");
            let v: serde_json::Value = serde_json::from_str(&stdout).unwrap();
            (out, v)
        };
        let (out, v) = sync_json(&["--timeout", "30s", "--mdns-interface", "lo"]);
        assert!(out.status.success(), "{v}");
        assert_eq!(v["converged"], true, "{v}");
        assert_eq!(v["through"], "peers", "{v}");
        assert_eq!(v["peers_verified"], 1, "{v}");
        assert_eq!(v["peers_in_sync"], 1, "{v}");
        assert!(v["containers"].as_u64().unwrap() >= 2, "{v}");
        assert!(v["longest_loop_turn_ms"].is_number(), "{v}");

        let t0 = Instant::now();
        let (out, v) = sync_json(&["--timeout", "3s", "--no-mdns", "--no-known-peers"]);
        let took = t0.elapsed();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success(),
            "sync --once must fail with no peer: {err}"
        );
        assert!(err.contains("no peer reachable"), "{err}");
        assert_eq!(v["converged"], false, "{v}");
        assert!(v["through"].is_null(), "{v}");
        assert!(
            v["message"].as_str().unwrap().contains("no peer reachable"),
            "{v}"
        );
        assert!(took < Duration::from_secs(10), "took {took:?}");
    });
}

// Goal: forged DHT records, forged rendezvous registrations and gossip from
// a non-member are rejected, counted, and change nothing. Method: two real
// devices meet through a real rendezvous/DHT node; an attacker swarm in this
// process stores a tampered pointer record under the agent's DHT key,
// registers its own key under the agent's rendezvous namespace, and
// publishes on the agent's gossip topic.
#[test]
fn forgeries_are_rejected_and_counted() {
    isolated("forgeries_are_rejected_and_counted", || {
        let mut c = Cluster::new();
        let infra = start_infra(&c);
        let a = c.init("a");
        let b = c.provision(&a, "b");
        let args = [
            "--no-mdns",
            "--rendezvous",
            infra.addr.as_str(),
            "--bootstrap",
            infra.addr.as_str(),
        ];
        c.start(&a, &args);
        c.start(&b, &args);
        wait_for("a and b verified", Duration::from_secs(10), || {
            (verified(&status(&a).ok()?).len() == 1).then_some(())
        });
        cli_ok(&a, &["state", "put", "notes", "k", "\"honest\""]);
        wait_for("b has a's write", Duration::from_secs(10), || {
            get_json(&b, "notes")
        });

        let did = did_of(&a);
        let log: DidChain =
            serde_json::from_slice(&std::fs::read(a.join("did-log.json")).unwrap()).unwrap();
        let a_status = status(&a).unwrap();
        let a_addr = a_status["listen_addrs"][0].as_str().unwrap().to_owned();
        // A real pointer signed by device b, then tampered with.
        let b_key =
            DeviceKey::from_seed_file_bytes(&std::fs::read(b.join("device.key")).unwrap()).unwrap();
        let b_ctx = context_id(&b);

        let rt = tokio::runtime::Runtime::new().unwrap();
        rt.block_on(async {
            let (net, mut events, cancel) = spawn_attacker().await;
            let me = net.local_peer_id();
            let now = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_secs() as i64;
            let mut forged = AgentPointer::new_signed(&log, &b_ctx, &me.to_string(), &b_key, now).unwrap();
            forged.peer_id = me.to_string(); // still valid: b signed it
            forged.timestamp_unix_secs += 1; // now the signature no longer covers it
            let forged_bytes = forged.encode().unwrap();

            let infra_addr: nuwa_net::Multiaddr = infra.addr.parse().unwrap();
            let infra_peer: PeerId = nuwa_net::peer_in(&infra_addr).unwrap();
            let a_addr: nuwa_net::Multiaddr = a_addr.parse().unwrap();
            let a_peer = nuwa_net::peer_in(&a_addr).unwrap();
            net.add_address(infra_peer, infra_addr.clone()).await.unwrap();
            net.add_address(a_peer, a_addr.clone()).await.unwrap();
            net.dial(Some(infra_peer), vec![infra_addr]).await.unwrap();
            net.dial(Some(a_peer), vec![a_addr.clone()]).await.unwrap();
            net.gossip_subscribe(gossip_topic(&did)).await.unwrap();
            let deadline = tokio::time::Instant::now() + Duration::from_secs(45);
            let mut registered = false;
            let mut attempts = tokio::time::interval(Duration::from_millis(500));
            loop {
                tokio::select! {
                    _ = tokio::time::sleep_until(deadline) => break,
                    ev = events.recv() => match ev {
                        Some(NetEvent::RendezvousRegistered { .. }) => registered = true,
                        // a drops a peer that never says Hello (10 s): come
                        // back, so a loaded machine that was slow to form
                        // the gossip mesh gets another window.
                        Some(NetEvent::Disconnected { peer }) if peer == a_peer => {
                            let _ = net.dial(Some(a_peer), vec![a_addr.clone()]).await;
                        }
                        _ => {}
                    },
                    _ = attempts.tick() => {
                        net.kad_put_record(dht_key(&did).to_vec(), forged_bytes.clone()).await.unwrap();
                        if !registered {
                            net.rendezvous_register(infra_peer, rendezvous_namespace(&did), 3600).await.unwrap();
                        }
                        net.gossip_publish(gossip_topic(&did), b"not an envelope from a member".to_vec()).await.unwrap();
                        let st = status(&a).unwrap();
                        if counter(&st, "rejected_dht_malformed") >= 1
                            && counter(&st, "rejected_rendezvous_unknown_key") >= 1
                            && counter(&st, "rejected_gossip_unknown_key") >= 1
                        {
                            break;
                        }
                    }
                }
            }
            assert!(registered, "the stock rendezvous server accepts anyone's registration");
            cancel.cancel();
        });
        let st = status(&a).unwrap();
        eprintln!("a's counters: {}", st["counters"]);
        assert!(
            counter(&st, "rejected_dht_malformed") >= 1,
            "forged DHT record not counted"
        );
        assert!(
            counter(&st, "rejected_rendezvous_unknown_key") >= 1,
            "forged registration not counted"
        );
        assert!(
            counter(&st, "rejected_gossip_unknown_key") >= 1,
            "non-member gossip not counted"
        );
        assert_eq!(verified(&st), vec![context_id(&b)]);
        for h in [&a, &b] {
            assert_eq!(get_json(h, "notes").unwrap(), json!({"k": "honest"}));
        }
    });
}

// Goal: flooding the rendezvous node with registrations degrades nothing for
// honest agents. Method: an attacker peer tries 100 registrations (more than
// the per-peer bound of 16); then two devices that use only rendezvous still
// register, find and verify each other.
#[test]
fn rendezvous_flood_degrades_nothing() {
    isolated("rendezvous_flood_degrades_nothing", || {
        let mut c = Cluster::new();
        let infra = start_infra(&c);
        let infra_addr: nuwa_net::Multiaddr = infra.addr.parse().unwrap();
        let infra_peer: PeerId = nuwa_net::peer_in(&infra_addr).unwrap();
        let rt = tokio::runtime::Runtime::new().unwrap();
        let (accepted, refused) = rt.block_on(async {
            let (net, mut events, cancel) = spawn_attacker().await;
            net.dial(Some(infra_peer), vec![infra_addr.clone()])
                .await
                .unwrap();
            loop {
                if let Some(NetEvent::Listening(_)) = events.recv().await {
                    break;
                }
            }
            let (mut accepted, mut refused) = (0, 0);
            let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
            let mut sent = 0;
            while accepted + refused < 100 {
                if sent < 100 && sent <= accepted + refused + 8 {
                    net.rendezvous_register(infra_peer, format!("flood-{sent}"), 3600)
                        .await
                        .unwrap();
                    sent += 1;
                }
                let ev = tokio::time::timeout_at(deadline, events.recv())
                    .await
                    .expect("registration answers within 20 s");
                match ev {
                    Some(NetEvent::RendezvousRegistered { .. }) => accepted += 1,
                    Some(NetEvent::RendezvousFailed { .. }) => refused += 1,
                    _ => {}
                }
            }
            cancel.cancel();
            (accepted, refused)
        });
        println!("flood: {accepted} registrations accepted, {refused} refused");
        assert!(
            accepted <= 16,
            "the per-peer bound holds: {accepted} accepted"
        );
        assert!(refused >= 84);

        let a = c.init("a");
        let b = c.provision(&a, "b");
        let args = [
            "--no-mdns",
            "--no-dht",
            "--no-known-peers",
            "--rendezvous",
            infra.addr.as_str(),
        ];
        c.start(&a, &args);
        c.start(&b, &args);
        wait_for(
            "honest devices meet through the flooded node",
            Duration::from_secs(10),
            || {
                (verified(&status(&a).ok()?).len() == 1 && verified(&status(&b).ok()?).len() == 1)
                    .then_some(())
            },
        );
    });
}

// Goal: pairing finds the new device through a rendezvous server when mDNS
// cannot (both sides have it off). Method: one infrastructure node; the
// approver daemon and `pair` both get only its address.
#[test]
fn pairing_through_rendezvous() {
    isolated("pairing_through_rendezvous", || {
        let mut c = Cluster::new();
        let infra = start_infra(&c);
        let a = c.init("a");
        c.start(&a, &["--no-mdns", "--no-dht", "--rendezvous", &infra.addr]);
        cli_ok(&a, &["state", "put", "notes", "k", "\"v\""]);
        let j = c.home("j");
        let mut p = Pairing::start(&j, &["--no-mdns", "--no-dht", "--rendezvous", &infra.addr]);
        let started = Instant::now();
        let res = cli(&a, &["device", "approve", &p.code]);
        let res_err = String::from_utf8_lossy(&res.stderr).into_owned();
        let st = p.wait_exit(Duration::from_secs(60));
        let pair_err = p.stderr();
        assert!(
            res.status.success(),
            "approve failed: {res_err}\npair: {pair_err}"
        );
        println!("paired through rendezvous in {:?}", started.elapsed());
        assert!(st.success(), "pair failed: {pair_err}");
        c.start(&j, &["--no-mdns", "--no-dht", "--rendezvous", &infra.addr]);
        wait_for(
            "the new device to hold the state",
            Duration::from_secs(20),
            || (get_json(&j, "notes") == Some(json!({"k": "v"}))).then_some(()),
        );
    });
}
