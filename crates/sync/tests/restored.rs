//! A device restored from a copy of its store (finding 2 of issue 24):
//! what it writes after the restore must merge with what it wrote after the
//! copy and forgot, which its peers hold. `run_actor` gives every run of a
//! device an Automerge actor of its own; this shows why that is needed and
//! that it is enough.

use nuwa_state::Container;
use nuwa_sync::{RUN_ACTOR_BYTES, run_actor};
use serde_json::{Value, json};

const DEVICE: [u8; 32] = [7; 32];

/// A device writes `a`; its store is copied; it writes `b` (its peer gets
/// both); the copy is restored under `restored_actor` and writes `c`. Returns
/// the peer's container and the restored one after each took the other's
/// changes, or the error of the first that refused.
fn restore_with(
    first_actor: &[u8],
    restored_actor: &[u8],
) -> Result<(Container, Container), String> {
    let mut device = Container::new(first_actor);
    let a = device.put("a", &json!(1)).unwrap().unwrap();
    let copy = vec![a.clone()];
    let b = device.put("b", &json!(2)).unwrap().unwrap();
    let mut peer = Container::new(&[9; RUN_ACTOR_BYTES]);
    peer.apply_changes(vec![a, b.clone()]).unwrap();

    let mut restored = Container::load(restored_actor, None, copy).unwrap();
    let c = restored.put("c", &json!(3)).unwrap().unwrap();
    peer.apply_changes(vec![c])
        .map_err(|e| format!("peer: {e}"))?;
    restored
        .apply_changes(vec![b])
        .map_err(|e| format!("restored: {e}"))?;
    Ok((peer, restored))
}

// Goal: a run's actor names its device and is never an earlier run's.
#[test]
fn every_run_of_a_device_has_an_actor_of_its_own() {
    let one = run_actor(&DEVICE).unwrap();
    let two = run_actor(&DEVICE).unwrap();
    assert_eq!(one.len(), RUN_ACTOR_BYTES);
    assert_eq!(one[..8], DEVICE[..8], "the actor names its device");
    assert_eq!(two[..8], DEVICE[..8]);
    assert_ne!(one, two, "two runs share an actor");
}

// Goal: with a fresh actor, the restored device and its peer end with every
// write, both ways. Method: the same history under one actor for both runs
// (as before the fix) is refused, which is the failure the fix removes.
#[test]
fn a_restored_store_writing_under_a_new_actor_merges_with_its_lost_future() {
    let first = run_actor(&DEVICE).unwrap();
    let (peer, restored) = restore_with(&first, &run_actor(&DEVICE).unwrap()).unwrap();
    for c in [&peer, &restored] {
        assert_eq!(c.get("a"), Some(Value::from(1)));
        assert_eq!(c.get("b"), Some(Value::from(2)));
        assert_eq!(c.get("c"), Some(Value::from(3)));
    }
    assert_eq!(peer.heads(), restored.heads());

    let reused = restore_with(&first, &first);
    assert!(
        reused.is_err(),
        "reusing the actor of the copied run was expected to clash"
    );
}
