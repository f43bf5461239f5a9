//! An admitted device that sends bytes Automerge cannot digest. Devices of
//! the agent trust each other's signatures, not each other's code: a buggy
//! or compromised sibling must not be able to take a daemon down.
//! Runs in its own network namespace (see `common::isolated`).

mod common;

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use common::*;
use nuwa_agent::crypto::epoch::KeyRing;
use nuwa_agent::identity::keys::DeviceKey;
use nuwa_agent::proto::{Frame, SyncPayload};
use nuwa_agent::sync::SecureChannel;
use serde_json::json;

/// A well-signed Automerge change that automerge 0.12 panics on while
/// applying it (seq 101 of an actor the document has never seen, no deps),
/// found by the `sync_message` fuzz target (fuzz/regressions/sync_message/).
const POISON: &str = "856f4a83f46f6d2a0135000e6e7577612d66757a7a2d720165706501000000000000003f42025602570570027f057469050000000000000068656c6c6f7f00";

// Goal: a change that makes Automerge panic, sent by gossip from a real
// member device (its own key, its own sync key, properly sealed), costs the
// receiving daemon one counted, logged container reload: the daemon keeps
// running and answering, the container holds exactly what it held before,
// and it takes and keeps new writes. Method: daemon a with entries; an
// in-process libp2p node with the identity and keys of provisioned member b
// publishes the sealed poison on the agent's gossip topic until a counts a
// poisoned container.
#[test]
fn a_member_sending_poison_does_not_take_the_daemon_down() {
    isolated(
        "a_member_sending_poison_does_not_take_the_daemon_down",
        || {
            let mut c = Cluster::new();
            let a = c.init("a");
            let b = c.provision(&a, "b");
            let ia = c.start(&a, &[]);
            for i in 0..5 {
                cli_ok(
                    &a,
                    &["state", "put", "notes", &format!("k{i}"), &i.to_string()],
                );
            }
            let before = get_json(&a, "notes").unwrap();
            let st = status(&a).unwrap();
            let did = st["agent_did"].as_str().unwrap().to_owned();
            let a_addr = st["listen_addrs"][0].as_str().unwrap().to_owned();

            let device =
                DeviceKey::from_seed_file_bytes(&std::fs::read(b.join("device.key")).unwrap())
                    .unwrap();
            let ring =
                KeyRing::from_file_bytes(&std::fs::read(b.join("sync.key")).unwrap()).unwrap();
            let secure = SecureChannel::new(did.clone(), context_id(&b), ring);
            let rt = tokio::runtime::Runtime::new().unwrap();
            let cancel = tokio_util::sync::CancellationToken::new();
            let (net, mut events) = gossip_node(&rt, device.seed(), &did, &a_addr, cancel.clone());
            rt.spawn(async move { while events.recv().await.is_some() {} });
            let topic = nuwa_agent::sync::pointer::gossip_topic(&did);
            wait_for(
                "a to count a poisoned container",
                Duration::from_secs(20),
                || {
                    let now = SystemTime::now()
                        .duration_since(UNIX_EPOCH)
                        .unwrap()
                        .as_millis() as u64;
                    let payload = SyncPayload::Delta {
                        container: "notes".into(),
                        changes: vec![hex::decode(POISON).unwrap()],
                    };
                    let env = secure.seal(&device, &payload, now).unwrap();
                    // Fails until the gossip mesh has formed; then the next poll
                    // sees the effect.
                    let _ = rt
                        .block_on(net.gossip_publish(topic.clone(), Frame::Envelope(env).encode()));
                    let st = status(&a).ok()?;
                    (st["counters"]["containers_poisoned"].as_u64().unwrap_or(0) >= 1).then_some(())
                },
            );
            cancel.cancel();

            // Still running, same content, still writable, and durable.
            assert_eq!(get_json(&a, "notes").unwrap(), before);
            cli_ok(&a, &["state", "put", "notes", "after", "1"]);
            c.stop(ia);
            assert!(
                c.logs()
                    .contains("peer input left the container untrustworthy"),
                "the reload is logged"
            );
            c.start(&a, &["--no-mdns", "--no-known-peers"]);
            let notes = get_json(&a, "notes").unwrap();
            assert_eq!(notes.as_object().unwrap().len(), 6, "{notes}");
            assert_eq!(notes["after"], json!(1));
        },
    );
}
