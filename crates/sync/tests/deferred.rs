//! Deltas taken while gossip is deferred (a run of network events, a page
//! pulled from a keeper) are applied together, and in bounded batches.
//!
//! Goal: the queue is one Automerge apply per container when the run is
//! small, and is applied early once it holds `APPLY_QUEUED_BYTES` (the
//! temporary memory of one apply grows with its batch: about 12 times the
//! changes' bytes). Method: real sessions of one agent; device 2 seals
//! deltas; device 3 takes them from a keeper (`on_stored`) with gossip
//! deferred, and the test watches when `Persist` effects come out.

mod common;

use common::{NOW_MS, chain_of, session};
use nuwa_crypto::Envelope;
use nuwa_proto::SyncPayload;
use nuwa_sync::{APPLY_QUEUED_BYTES, Effect, Session, Stored};
use serde_json::json;

/// `a` writes `value` under `key` in "notes"; the Delta carrying the
/// change, sealed, and the change's size.
fn delta(a: &mut Session, key: &str, value: &str) -> (Envelope, usize) {
    let change = a
        .local_put("notes", key, &json!(value))
        .unwrap()
        .expect("a change");
    let len = change.len();
    let payload = SyncPayload::Delta {
        container: "notes".into(),
        changes: vec![change],
    };
    (a.seal(&payload, NOW_MS).unwrap(), len)
}

/// The changes persisted among `effects`.
fn persisted(effects: &[Effect]) -> usize {
    effects
        .iter()
        .map(|e| match e {
            Effect::Persist { changes, .. } => changes.len(),
            _ => 0,
        })
        .sum()
}

#[test]
fn small_deltas_are_applied_together_when_the_run_ends() {
    let chain = chain_of(1, &[2, 3]);
    let mut a = session(&chain, 2, 0, None);
    let mut b = session(&chain, 3, 0, None);
    b.defer_gossip(true);
    for i in 0..20 {
        let (env, _) = delta(&mut a, &format!("k{i}"), "small");
        let (stored, out) = b.on_stored(env, NOW_MS + 1);
        assert_eq!(stored, Stored::Applied, "{out:?}");
        assert_eq!(persisted(&out), 0, "delta {i} applied before the run ended");
    }
    b.defer_gossip(false);
    let out = b.apply_queued();
    let persists: Vec<usize> = out
        .iter()
        .filter_map(|e| match e {
            Effect::Persist { changes, .. } => Some(changes.len()),
            _ => None,
        })
        .collect();
    assert_eq!(persists, vec![20], "one apply, one persist of all 20");
    let notes = b.engine().container("notes").expect("notes");
    assert_eq!(notes.get("k19"), Some(json!("small")));
}

#[test]
fn a_queue_is_applied_early_once_it_holds_its_bound() {
    let chain = chain_of(1, &[2, 3]);
    let mut a = session(&chain, 2, 0, None);
    let mut b = session(&chain, 3, 0, None);
    b.defer_gossip(true);
    let big = "x".repeat(100 * 1024);
    let (mut queued, mut early, mut total) = (0usize, 0usize, 0usize);
    for i in 0..12 {
        let (env, len) = delta(&mut a, &format!("k{i}"), &big);
        total += 1;
        let (stored, out) = b.on_stored(env, NOW_MS + 1);
        assert_eq!(stored, Stored::Applied);
        queued += len;
        let n = persisted(&out);
        if queued >= APPLY_QUEUED_BYTES {
            assert_eq!(
                n,
                total - early,
                "delta {i}: the full queue is applied at once"
            );
            early = total;
            queued = 0;
        } else {
            assert_eq!(n, 0, "delta {i}: applied below the bound ({queued} bytes)");
        }
    }
    assert!(early >= 5, "the bound was reached: {early} applied early");
    let n = persisted(&b.apply_queued());
    assert_eq!(early + n, 12, "every delta is applied once");
    let notes = b.engine().container("notes").expect("notes");
    assert_eq!(notes.get("k11"), Some(json!(big)));
}
