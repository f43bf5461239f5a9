//! What the engine does when Automerge panics on a peer's bytes.

use nuwa_proto::SyncPayload;
use nuwa_state::Container;
use nuwa_sync::{Action, Config, Engine};
use serde_json::json;

/// A change automerge 0.12 panics on while applying (seq 101 of an actor it
/// has never seen, no deps); found by the `sync_message` fuzz target.
const POISON: &str = "856f4a83f46f6d2a0135000e6e7577612d66757a7a2d720165706501000000000000003f42025602570570027f057469050000000000000068656c6c6f7f00";

fn hex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

// Goal: a delta that makes Automerge panic is an error naming the poisoned
// container, the engine drops that container (no half-applied document
// stays in use, nothing is persisted), and a container rebuilt from storage
// and inserted again works as before. Method: gossip the fuzzer's change to
// an engine holding one entry, then re-insert a container loaded from the
// saved bytes and apply an ordinary change.
#[test]
fn a_panicking_delta_drops_the_container_for_a_reload() {
    let mut engine = Engine::new(b"aaaa".to_vec(), Config::default());
    let mut c = Container::new(b"aaaa");
    c.put("k", &json!(1)).unwrap();
    let saved = c.save();
    engine.insert_container("c".into(), c);
    engine.peer_up("peer", 0);

    let err = engine
        .handle_gossip(SyncPayload::Delta {
            container: "c".into(),
            changes: vec![hex(POISON)],
        })
        .unwrap_err();
    assert_eq!(err.poisoned_container(), Some("c"), "{err}");
    assert!(engine.container("c").is_none());

    // The daemon reloads it from its store.
    engine.insert_container(
        "c".into(),
        Container::load(b"aaaa", Some(&saved), []).unwrap(),
    );
    let mut other = Container::new(b"bbbb");
    let change = other.put("x", &json!("y")).unwrap().unwrap();
    let actions = engine
        .handle_gossip(SyncPayload::Delta {
            container: "c".into(),
            changes: vec![change],
        })
        .unwrap();
    assert!(actions.iter().any(|a| matches!(a, Action::Persist { .. })));
    let c = engine.container("c").unwrap();
    assert_eq!(c.get("k"), Some(json!(1)));
    assert_eq!(c.get("x"), Some(json!("y")));

    // Ordinary errors are not poisoning.
    let err = engine
        .handle_gossip(SyncPayload::Delta {
            container: "c".into(),
            changes: vec![vec![1, 2, 3]],
        })
        .unwrap_err();
    assert_eq!(err.poisoned_container(), None);
    assert!(engine.container("c").is_some());
}
