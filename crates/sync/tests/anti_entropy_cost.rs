//! The cost of anti-entropy: what one idle round sends each peer, sealed and
//! framed as it goes on the wire, and what finding one changed container
//! among thousands costs.

use nuwa_crypto::SyncKey;
use nuwa_identity::keys::DeviceKey;
use nuwa_proto::{Frame, SyncPayload};
use nuwa_state::Container;
use nuwa_sync::{Action, Config, Engine, SecureChannel};
use serde_json::json;

fn channel() -> SecureChannel {
    SecureChannel::new(
        "did:key:z6MkhaXgBZDvotDkL5257faiztiGiC2QtKLGpbnnEGta2doK".into(),
        "device-0123456789ab".into(),
        nuwa_crypto::epoch::KeyRing::new(SyncKey::generate(0).unwrap()),
    )
}

/// The bytes `payload` takes on the wire: sealed, signed and framed.
fn wire_bytes(secure: &SecureChannel, device: &DeviceKey, payload: &SyncPayload) -> usize {
    let env = secure.seal(device, payload, 1_000).unwrap();
    nuwa_proto::length_prefixed(&Frame::Envelope(env).encode())
        .unwrap()
        .len()
}

fn sends(actions: Vec<Action>) -> Vec<(String, SyncPayload)> {
    actions
        .into_iter()
        .filter_map(|a| match a {
            Action::Send { peer, payload } => Some((peer, payload)),
            _ => None,
        })
        .collect()
}

/// `n` containers with one change each, written by `author`.
fn containers(author: &DeviceKey, n: usize) -> Vec<(String, Container)> {
    (0..n)
        .map(|i| {
            let mut c = Container::new(&author.public());
            c.put("k", &json!(i)).unwrap();
            (format!("container-{i:05}"), c)
        })
        .collect()
}

// Goal: an idle round costs the same few hundred bytes per peer whatever
// the number of containers (issue 13: at most 1 KB with 10,000). Method:
// fill an engine with N containers, tick past the interval, seal the one
// payload it emits and measure the frame.
#[test]
fn idle_round_cost_does_not_grow_with_containers() {
    let device = DeviceKey::generate().unwrap();
    let secure = channel();
    let mut sizes = Vec::new();
    for n in [1usize, 10, 1_000, 10_000] {
        let mut engine = Engine::new(device.public().to_vec(), Config::default());
        for (name, c) in containers(&device, n) {
            engine.insert_container(name, c);
        }
        engine.peer_up("peer", 0);
        let out = sends(engine.tick(Config::default().anti_entropy_ms));
        assert_eq!(out.len(), 1, "one payload per peer per round");
        assert!(matches!(out[0].1, SyncPayload::Digest { .. }));
        let bytes = wire_bytes(&secure, &device, &out[0].1);
        println!("{n} quiet container(s): {bytes} bytes per peer per round");
        assert!(
            bytes <= 1024,
            "{n} containers cost {bytes} bytes, over 1 KB"
        );
        sizes.push(bytes);
    }
    assert!(
        sizes.iter().max().unwrap() - sizes.iter().min().unwrap() <= 4,
        "the idle cost moved with the number of containers: {sizes:?}"
    );
}

// Goal: with 10,000 containers on two nodes and one of them changed on one
// side only (its delta lost), the next anti-entropy round finds it and both
// converge within that round, naming only a few containers on the way.
// Method: two engines with the same 10,000 containers; a put on A whose
// delta is dropped; tick both once and relay every message until quiet.
#[test]
fn one_change_among_ten_thousand_converges_in_one_round() {
    let device_a = DeviceKey::generate().unwrap();
    let device_b = DeviceKey::generate().unwrap();
    let secure = channel();
    let mut a = Engine::new(device_a.public().to_vec(), Config::default());
    let mut b = Engine::new(device_b.public().to_vec(), Config::default());
    for (name, c) in containers(&device_a, 10_000) {
        let copy = Container::load(&device_b.public(), Some(&c.save()), []).unwrap();
        a.insert_container(name.clone(), c);
        b.insert_container(name, copy);
    }
    let mut queue: Vec<(usize, SyncPayload)> = Vec::new();
    for (peer, payload) in sends(a.peer_up("b", 0)) {
        assert_eq!(peer, "b");
        queue.push((1, payload));
    }
    for (_, payload) in sends(b.peer_up("a", 0)) {
        queue.push((0, payload));
    }
    // Equal digests: nothing follows the first exchange.
    let mut engines = [a, b];
    let names = ["a", "b"];
    let relay = |engines: &mut [Engine; 2], mut queue: Vec<(usize, SyncPayload)>, now: u64| {
        let (mut messages, mut bytes, mut reconcile_items) = (0usize, 0usize, 0usize);
        while let Some((to, payload)) = queue.pop() {
            messages += 1;
            assert!(messages < 200, "the exchange did not end");
            bytes += wire_bytes(&secure, &device_a, &payload);
            if let SyncPayload::Reconcile(parts) = &payload {
                for p in parts {
                    if let nuwa_proto::RangeBody::Items(items) = &p.body {
                        reconcile_items += items.len();
                    }
                }
            }
            let from = names[1 - to];
            for (_, reply) in sends(engines[to].handle(from, payload, now).unwrap()) {
                queue.insert(0, (1 - to, reply));
            }
        }
        (messages, bytes, reconcile_items)
    };
    let (messages, _, _) = relay(&mut engines, queue, 1);
    assert_eq!(messages, 2, "equal digests end the exchange at once");
    assert!(engines[0].in_sync_with("b") && engines[1].in_sync_with("a"));

    // One change on A whose delta never reaches B.
    engines[0]
        .local_put("container-04242", "k", &json!("changed"))
        .unwrap();
    let _lost = engines[0].flush();
    assert!(!engines[0].in_sync_with("b"));
    let round = Config::default().anti_entropy_ms;
    let mut queue = Vec::new();
    for (_, payload) in sends(engines[0].tick(round)) {
        queue.push((1, payload));
    }
    let (messages, bytes, items) = relay(&mut engines, queue, round);
    println!(
        "one change among 10,000 containers: {messages} messages, {bytes} bytes, \
         {items} containers named"
    );
    assert_eq!(
        engines[1].container("container-04242").unwrap().to_json()["k"],
        json!("changed")
    );
    assert_eq!(engines[0].digest(), engines[1].digest());
    assert!(
        items <= 2 * nuwa_sync::reconcile::ITEMS_BELOW,
        "{items} named"
    );
    assert!(bytes < 64 * 1024, "{bytes} bytes to find one container");
    // Both learn they are in sync from the early digests that follow.
    let mut queue = Vec::new();
    for (i, e) in engines.iter_mut().enumerate() {
        for (_, payload) in sends(e.tick(round + 1_500)) {
            queue.push((1 - i, payload));
        }
    }
    relay(&mut engines, queue, round + 1_500);
    assert!(engines[0].in_sync_with("b") && engines[1].in_sync_with("a"));
}
