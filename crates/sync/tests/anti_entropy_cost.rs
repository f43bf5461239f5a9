//! The cost of one anti-entropy round when nothing changed: the heads
//! summary a node sends each peer, sealed and framed as it goes on the wire.

use nuwa_crypto::SyncKey;
use nuwa_identity::keys::DeviceKey;
use nuwa_proto::{Frame, SyncPayload};
use nuwa_sync::{Action, Config, Engine, SecureChannel};
use serde_json::json;

// Goal: with a handful of quiet containers, one round costs a few hundred
// bytes per peer. Method: fill an engine with N containers (one head each),
// tick past the interval, seal the summary it emits and measure the frame.
#[test]
fn idle_round_costs_a_few_hundred_bytes_per_peer() {
    let device = DeviceKey::generate().unwrap();
    let did = "did:key:z6MkhaXgBZDvotDkL5257faiztiGiC2QtKLGpbnnEGta2doK";
    let secure = SecureChannel::new(
        did.into(),
        "device-0123456789ab".into(),
        nuwa_crypto::epoch::KeyRing::new(SyncKey::generate(0).unwrap()),
    );
    for (containers, max_bytes) in [(1usize, 300usize), (3, 400), (10, 900)] {
        let mut engine = Engine::new(device.public().to_vec(), Config::default());
        for i in 0..containers {
            engine.insert_container(format!("container-{i}"), {
                let mut c = nuwa_state::Container::new(&device.public());
                c.put("k", &json!(i)).unwrap();
                c
            });
        }
        engine.peer_up("peer", 0);
        let actions = engine.tick(Config::default().anti_entropy_ms);
        let summaries: Vec<&SyncPayload> = actions
            .iter()
            .filter_map(|a| match a {
                Action::Send { payload, .. } => Some(payload),
                _ => None,
            })
            .collect();
        assert_eq!(summaries.len(), 1, "one summary per peer per round");
        let env = secure.seal(&device, summaries[0], 1_000).unwrap();
        let frame = nuwa_proto::length_prefixed(&Frame::Envelope(env).encode()).unwrap();
        println!(
            "{containers} quiet container(s): {} bytes per peer per round",
            frame.len()
        );
        assert!(
            frame.len() <= max_bytes,
            "{containers} containers cost {} bytes, over {max_bytes}",
            frame.len()
        );
    }
}
