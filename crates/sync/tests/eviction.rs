//! Containers out of memory (issue 13): an evicted container keeps its
//! place in digests and status, loads back on first use, and is never
//! evicted while something of it is not durable or an exchange needs it.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use nuwa_state::Container;
use nuwa_sync::{Action, Config, Engine, EngineError};
use serde_json::json;

type Disk = Arc<Mutex<BTreeMap<String, Vec<Vec<u8>>>>>;

fn engine(actor: &[u8], disk: &Disk) -> Engine {
    let mut e = Engine::new(actor.to_vec(), Config::default());
    let (actor, disk) = (actor.to_vec(), disk.clone());
    e.set_loader(Box::new(move |name: &str| {
        let log = disk.lock().unwrap().get(name).cloned();
        log.map(|changes| Container::load(&actor, None, changes).map_err(|e| e.to_string()))
            .transpose()
    }));
    e
}

fn put(e: &mut Engine, disk: &Disk, container: &str, key: &str, v: serde_json::Value) {
    let change = e.local_put(container, key, &v).unwrap().unwrap();
    disk.lock()
        .unwrap()
        .entry(container.to_owned())
        .or_default()
        .push(change);
}

// Goal: eviction frees the document but not the container: digest, heads,
// counts and names are unchanged, and a write to it loads it back first.
#[test]
fn an_evicted_container_keeps_its_place_and_loads_on_use() {
    let disk = Disk::default();
    let mut e = engine(b"actor-a", &disk);
    for i in 0..10 {
        put(&mut e, &disk, &format!("c{i}"), "k", json!(i));
    }
    let _ = e.flush();
    let digest = e.digest();
    let heads = e.heads_of("c3");
    assert_eq!(e.evict_idle(u64::MAX, 2, &["c9"]), 8);
    assert_eq!((e.loaded_count(), e.container_count()), (2, 10));
    assert!(e.container("c3").is_none() && e.contains("c3"));
    assert_eq!(e.heads_of("c3"), heads);
    assert_eq!(e.change_count_of("c3"), Some(1));
    assert_eq!(e.digest(), digest);
    assert_eq!(e.container_names().len(), 10);
    put(&mut e, &disk, "c3", "k2", json!("after"));
    let c3 = e.container("c3").expect("loaded back by the write");
    assert_eq!(c3.to_json(), json!({"k": 3, "k2": "after"}));
    assert_ne!(e.digest(), digest);
}

// Goal: containers loaded at open, before the engine's clock started, stay
// in memory for the idle minute from the first tick; they used to count as
// idle since the epoch and left at the first tick, so the open's load was
// wasted and the first use loaded them again on the loop. Method: insert
// before any tick, tick at a real time, evict with a minute's idleness.
#[test]
fn containers_loaded_at_open_stay_for_the_idle_minute() {
    let disk = Disk::default();
    let mut e = engine(b"actor-a", &disk);
    let mut c = Container::new(b"actor-b");
    c.put("k", &json!(1)).unwrap();
    e.insert_container("opened".into(), c);
    let t0 = 1_800_000_000_000;
    let _ = e.tick(t0);
    assert_eq!(e.evict_idle(60_000, usize::MAX, &[]), 0);
    assert!(e.container("opened").is_some());
    let _ = e.tick(t0 + 60_000);
    assert_eq!(e.evict_idle(60_000, usize::MAX, &[]), 1);
}

// Goal: nothing leaves memory while it is needed: local changes not yet
// flushed to peers, queued gossip, or a running exchange with a peer.
#[test]
fn nothing_is_evicted_while_it_is_needed() {
    let disk = Disk::default();
    let mut a = engine(b"actor-a", &disk);
    put(&mut a, &disk, "pending", "k", json!(1));
    assert!(!a.evict("pending"), "a local change not yet flushed");
    let _ = a.flush();
    assert!(a.evict("pending"));

    // An exchange in flight with a peer keeps its container: b says (by
    // its reconciliation list) it holds nothing, so a starts the sync
    // protocol for "pending" with b.
    let _ = a.peer_up("b", 0);
    let empty = nuwa_proto::SyncPayload::Reconcile(vec![nuwa_proto::RangePart {
        lower: String::new(),
        upper: None,
        body: nuwa_proto::RangeBody::Items(Vec::new()),
    }]);
    let started = a.handle("b", empty, 1).unwrap().into_iter().any(|x| {
        matches!(
            x,
            Action::Send {
                payload: nuwa_proto::SyncPayload::Sync { .. },
                ..
            }
        )
    });
    assert!(started, "a offers b the container it lacks");
    assert!(!a.evict("pending"), "evicted during an exchange");
    // Once the exchange stalls out (no progress for the stall time), it
    // may go.
    let _ = a.tick(1 + Config::default().sync_stall_ms + 1);
    assert!(a.evict("pending"));
}

// Goal: a container whose storage lost what memory had is not loaded
// back silently; the error names it, and the container stays evicted.
#[test]
fn a_load_that_falls_short_is_an_error() {
    let disk = Disk::default();
    let mut e = engine(b"actor-a", &disk);
    put(&mut e, &disk, "c", "k", json!(1));
    put(&mut e, &disk, "c", "k", json!(2));
    let _ = e.flush();
    assert!(e.evict("c"));
    disk.lock().unwrap().get_mut("c").unwrap().pop();
    match e.ensure_loaded("c") {
        Err(EngineError::Load { container, reason }) => {
            assert_eq!(container, "c");
            assert!(reason.contains("less"), "{reason}");
        }
        other => panic!("expected a load error, got {other:?}"),
    }
    assert!(e.contains("c") && e.container("c").is_none());
    disk.lock().unwrap().remove("c");
    assert!(matches!(
        e.local_put("c", "k", &json!(3)),
        Err(EngineError::Load { .. })
    ));
    // Without a loader, nothing is evicted.
    let mut plain = Engine::new(b"actor-p".to_vec(), Config::default());
    plain.local_put("x", "k", &json!(1)).unwrap();
    let _ = plain.flush();
    assert!(!plain.evict("x"));
}

// Goal: a peer that holds the same heads costs no load: reconciliation
// compares an evicted container by the heads it kept.
#[test]
fn equal_heads_from_a_peer_load_nothing() {
    let disk = Disk::default();
    let mut a = engine(b"actor-a", &disk);
    for i in 0..20 {
        put(&mut a, &disk, &format!("c{i:02}"), "k", json!(i));
    }
    let _ = a.flush();
    assert_eq!(a.evict_idle(0, 0, &[]), 20);
    let _ = a.peer_up("b", 0);
    let items = a
        .container_names()
        .into_iter()
        .map(|n| nuwa_proto::ContainerHeads {
            container: n.clone(),
            heads: a.heads_of(n).unwrap(),
            changes: a.change_count_of(n).unwrap_or(0) as u64,
        })
        .collect();
    let same = nuwa_proto::SyncPayload::Reconcile(vec![nuwa_proto::RangePart {
        lower: String::new(),
        upper: None,
        body: nuwa_proto::RangeBody::Items(items),
    }]);
    let out = a.handle("b", same, 1).unwrap();
    assert_eq!(a.loaded_count(), 0, "nothing loaded for equal heads");
    assert!(
        !out.iter().any(|x| matches!(
            x,
            Action::Send {
                payload: nuwa_proto::SyncPayload::Sync { .. },
                ..
            }
        )),
        "no exchange started"
    );
    assert!(a.converged_with("b", "c07"));
}

/// The first message of a sync exchange of `e`'s `container`.
fn first_sync(e: &Engine, container: &str) -> nuwa_proto::SyncPayload {
    let message = e
        .container(container)
        .unwrap()
        .generate_sync_message(&mut nuwa_state::SyncState::new())
        .unwrap();
    nuwa_proto::SyncPayload::Sync {
        container: container.into(),
        message,
    }
}

/// Delivers every `Send` of `out` from `from` to `to` and back until no
/// message is left (at most 50 rounds).
fn pump(a: &mut Engine, b: &mut Engine, first: Vec<Action>, now_ms: u64) {
    let mut queue: Vec<(bool, Action)> = first.into_iter().map(|x| (true, x)).collect();
    for _ in 0..50 {
        if queue.is_empty() {
            return;
        }
        let mut next = Vec::new();
        for (from_a, action) in queue {
            if let Action::Send { payload, .. } = action {
                let (to, peer) = if from_a {
                    (&mut *b, "a")
                } else {
                    (&mut *a, "b")
                };
                let out = to.handle(peer, payload, now_ms).unwrap();
                next.extend(out.into_iter().map(|x| (!from_a, x)));
            }
        }
        queue = next;
    }
    panic!("the exchange did not end");
}

// Goal: a peer's input for an evicted container never loads it on the
// loop: the engine hands the load out, holds the peer's sync message and a
// gossiped delta meanwhile, and handles them once the runtime gives the
// document back; the exchange then ends converged both ways. Method: a
// loader that panics if called; the load is done "off the loop" by the
// test, from the same disk.
#[test]
fn a_peer_input_for_an_evicted_container_waits_for_a_load_off_the_loop() {
    let disk = Disk::default();
    let mut a = loads_off_the_loop_only();
    for i in 0..3 {
        put(&mut a, &disk, "notes", &format!("a{i}"), json!(i));
    }
    let _ = a.flush();
    assert_eq!(a.evict_idle(0, 0, &[]), 1);
    let mut b = engine(b"actor-b", &Disk::default());
    b.local_put("notes", "b0", &json!("from b")).unwrap();
    let _ = b.flush();
    let _ = a.peer_up("b", 1);
    let _ = b.peer_up("a", 1);

    // b starts an exchange; c's change comes by gossip.
    let out = a.handle("b", first_sync(&b, "notes"), 2).unwrap();
    assert!(
        out.is_empty(),
        "nothing is answered before the load: {out:?}"
    );
    let mut c = engine(b"actor-c", &Disk::default());
    let change = c
        .local_put("notes", "c0", &json!("gossip"))
        .unwrap()
        .unwrap();
    let gossip = nuwa_proto::SyncPayload::Delta {
        container: "notes".into(),
        changes: vec![change],
    };
    let out = a.handle_gossip(gossip).unwrap();
    assert!(out.is_empty(), "the delta waits too: {out:?}");
    assert_eq!(
        a.take_loads(),
        vec!["notes".to_owned()],
        "one load handed out"
    );
    assert!(a.take_loads().is_empty());
    assert!(a.loading("notes") && a.container("notes").is_none());

    // The runtime loads it from the store and gives it back.
    let log = disk.lock().unwrap().get("notes").cloned().unwrap();
    let loaded = Container::load(b"actor-a", None, log).unwrap();
    let (out, errors) = a.finish_load("notes", Ok(Some(loaded)), 3);
    assert!(errors.is_empty(), "{errors:?}");
    assert!(!a.loading("notes"));
    assert!(
        out.iter().any(|x| matches!(x, Action::Persist { .. })),
        "the held delta is applied and persisted: {out:?}"
    );
    assert!(
        out.iter().any(|x| matches!(x, Action::Send { .. })),
        "the held message is answered: {out:?}"
    );
    pump(&mut a, &mut b, out, 4);
    let want = json!({"a0": 0, "a1": 1, "a2": 2, "b0": "from b", "c0": "gossip"});
    assert_eq!(a.container("notes").unwrap().to_json(), want);
    assert_eq!(b.container("notes").unwrap().to_json(), want);

    // A load that fails leaves the container evicted and drops what
    // waited: an error, never a panic or a half-loaded container.
    let _ = a.flush();
    assert!(a.evict("notes"));
    assert!(
        a.handle("b", first_sync(&b, "notes"), 5)
            .unwrap()
            .is_empty()
    );
    assert_eq!(a.take_loads(), vec!["notes".to_owned()]);
    let (out, errors) = a.finish_load("notes", Err("disk on fire".into()), 6);
    assert!(out.is_empty(), "{out:?}");
    assert!(
        matches!(&errors[..], [EngineError::Load { reason, .. }] if reason == "disk on fire"),
        "{errors:?}"
    );
    assert!(a.container("notes").is_none() && a.contains("notes"));
}

// Goal: loads off the loop are bounded. A peer whose every container
// differs gets at most 4 loads out at once (the next goes out as one comes
// back), and what waits for one container is bounded in bytes (32 MiB):
// what is beyond it is dropped, not kept. Method: 6 evicted containers
// with a sync message each; then 40 messages of 1 MiB for a seventh. Each
// kept message is handled (and refused: it is no sync message) once the
// load is back, so the errors count what was kept.
#[test]
fn loads_off_the_loop_are_bounded_in_number_and_bytes() {
    let disk = Disk::default();
    let mut a = loads_off_the_loop_only();
    for i in 0..6 {
        put(&mut a, &disk, &format!("c{i}"), "k", json!(i));
    }
    put(&mut a, &disk, "z", "k", json!("z"));
    let _ = a.flush();
    assert_eq!(a.evict_idle(0, 0, &[]), 7);
    let mut b = engine(b"actor-b", &Disk::default());
    for i in 0..6 {
        b.local_put(&format!("c{i}"), "b", &json!(i)).unwrap();
    }
    let _ = b.flush();
    let _ = a.peer_up("b", 1);
    for i in 0..6 {
        assert!(
            a.handle("b", first_sync(&b, &format!("c{i}")), 2)
                .unwrap()
                .is_empty()
        );
    }
    let first = a.take_loads();
    assert_eq!(first.len(), 4, "{first:?}");
    assert!(a.take_loads().is_empty(), "no fifth while four are out");
    let load = |name: &str| {
        let log = disk.lock().unwrap().get(name).cloned().unwrap();
        Ok(Some(Container::load(b"actor-a", None, log).unwrap()))
    };
    let (_, errors) = a.finish_load(&first[0], load(&first[0]), 3);
    assert!(errors.is_empty(), "{errors:?}");
    let fifth = a.take_loads();
    assert_eq!(fifth.len(), 1, "one back, one more out");
    for name in first[1..].iter().chain(&fifth) {
        let _ = a.finish_load(name, load(name), 4);
    }
    let last = a.take_loads();
    assert_eq!(last.len(), 1, "{last:?}");
    let _ = a.finish_load(&last[0], load(&last[0]), 5);
    assert!((0..6).all(|i| !a.loading(&format!("c{i}"))));

    // 40 MiB for one evicted container: 32 are kept.
    for _ in 0..40 {
        let junk = nuwa_proto::SyncPayload::Sync {
            container: "z".into(),
            message: vec![0xff; 1024 * 1024],
        };
        assert!(a.handle("b", junk, 6).unwrap().is_empty());
    }
    assert_eq!(a.take_loads(), vec!["z".to_owned()]);
    let (_, errors) = a.finish_load("z", load("z"), 7);
    assert_eq!(
        errors.len(),
        32,
        "the kept messages, each refused when handled"
    );
}

/// An engine that hands loads out (`load_off_loop`) and panics if it ever
/// loads a container on the loop.
fn loads_off_the_loop_only() -> Engine {
    let config = Config {
        load_off_loop: true,
        ..Config::default()
    };
    let mut e = Engine::new(b"actor-a".to_vec(), config);
    e.set_loader(Box::new(|name: &str| {
        panic!("{name} was loaded on the loop")
    }));
    e
}
