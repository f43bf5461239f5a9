//! Catch-up off the loop (issue 13): a sync message carrying a big document
//! is not applied by `handle`; the engine hands out a `CatchUp` to run on
//! another thread, keeps serving the container meanwhile, and swaps the
//! caught-up document in (or runs another round over what moved) when the
//! result comes back.

use std::collections::VecDeque;

use nuwa_proto::SyncPayload;
use nuwa_sync::{Action, Config, Engine};
use serde_json::json;

const ENTRIES: usize = 3_000;

fn config() -> Config {
    Config {
        catch_up_inline_bytes: 4 * 1024,
        ..Config::default()
    }
}

/// Sends between two engines until both are quiet; catch-ups that `b` sets
/// aside are handed to `on_catch_up`, which returns them finished (or keeps
/// them: then they come back only when the caller finishes them).
fn exchange(
    a: &mut Engine,
    b: &mut Engine,
    (first, first_to_b): (Vec<Action>, bool),
    now: u64,
    mut on_catch_up: impl FnMut(&mut Engine, nuwa_sync::CatchUp),
) -> Vec<Action> {
    let mut seen_by_b = Vec::new();
    let mut wire: VecDeque<(bool, SyncPayload)> = VecDeque::new();
    let push = |wire: &mut VecDeque<(bool, SyncPayload)>, to_b: bool, actions: &[Action]| {
        for x in actions {
            if let Action::Send { payload, .. } = x {
                wire.push_back((to_b, payload.clone()));
            }
        }
    };
    push(&mut wire, first_to_b, &first);
    let mut steps = 0;
    while let Some((to_b, payload)) = wire.pop_front() {
        steps += 1;
        assert!(steps < 10_000, "the exchange never ends");
        if to_b {
            let out = b.handle("a", payload, now).expect("b accepts a's payload");
            push(&mut wire, false, &out);
            seen_by_b.extend(out);
            for job in b.take_catch_ups() {
                on_catch_up(b, job);
            }
        } else {
            let out = a.handle("b", payload, now).expect("a accepts b's payload");
            push(&mut wire, true, &out);
        }
    }
    seen_by_b
}

/// Changes the actions ask to persist.
fn persisted(actions: &[Action]) -> usize {
    actions
        .iter()
        .map(|x| match x {
            Action::Persist { changes, .. } => changes.len(),
            Action::PersistWhole { changes, .. } => *changes,
            _ => 0,
        })
        .sum()
}

fn filled() -> Engine {
    let mut a = Engine::new(b"actor-a".to_vec(), config());
    for i in 0..ENTRIES {
        a.local_put("log", &format!("k{i:05}"), &json!(i))
            .unwrap()
            .unwrap();
    }
    let _ = a.flush();
    a
}

/// `a` holds the log, `b` nothing; they connect and exchange until `b`
/// has set the big message aside. Returns both, the catch-ups `b` handed
/// out, and what `b` did meanwhile.
fn connect() -> (Engine, Engine, Vec<nuwa_sync::CatchUp>, Vec<Action>) {
    let mut a = filled();
    let mut b = Engine::new(b"actor-b".to_vec(), config());
    let first = a.peer_up("b", 0);
    let _ = b.peer_up("a", 0);
    let mut jobs = Vec::new();
    let during = exchange(&mut a, &mut b, (first, true), 1, |_, job| jobs.push(job));
    (a, b, jobs, during)
}

// Goal: a device that has nothing receives the whole document off the loop:
// `handle` applies nothing, the catch-up does, and once it is back the
// device holds every entry, persists every change once, and converges.
// Into an empty container the changes are counted, not rebuilt one by one:
// one `PersistWhole` (a snapshot of the document), no `Persist`.
#[test]
fn a_whole_document_is_applied_off_the_loop() {
    let (mut a, mut b, mut jobs, during) = connect();
    assert_eq!(jobs.len(), 1, "one catch-up for the big message");
    assert!(b.catching_up("log"));
    assert!(
        !during.iter().any(|x| matches!(x, Action::Persist { .. })),
        "nothing was applied on the loop"
    );
    assert!(!b.evict("log"), "a container being caught up stays");

    let done = jobs.pop().unwrap().run();
    assert_eq!(done.new_changes(), ENTRIES);
    let (actions, errors) = b.finish_catch_up(done, 2);
    assert!(errors.is_empty(), "{errors:?}");
    assert!(!b.catching_up("log"));
    let persisted = persisted(&actions);
    assert_eq!(persisted, ENTRIES, "every change persisted once");
    assert!(
        actions.iter().any(|x| matches!(
            x,
            Action::PersistWhole { container, changes } if container == "log" && *changes == ENTRIES
        )) && !actions.iter().any(|x| matches!(x, Action::Persist { .. })),
        "one snapshot of the whole document: {actions:?}"
    );
    // The rest of the protocol runs inline and finishes the exchange.
    let _ = exchange(&mut a, &mut b, (actions, false), 3, |_, _| {
        panic!("no second catch-up")
    });
    assert_eq!(b.heads_of("log"), a.heads_of("log"));
    assert_eq!(
        b.container("log").unwrap().to_json(),
        a.container("log").unwrap().to_json()
    );
    assert!(b.converged_with("a", "log"));
}

// Goal: writes made while the catch-up runs are neither lost nor block it:
// the result comes back to a container that moved, so the engine runs a
// second round over the new write, and the final document has both.
#[test]
fn a_write_during_the_catch_up_is_kept() {
    let (mut a, mut b, mut jobs, _) = connect();
    let job = jobs.pop().expect("a catch-up");

    // The container serves local writes meanwhile.
    b.local_put("log", "mine", &json!("written during the catch-up"))
        .unwrap()
        .unwrap();

    let (actions, errors) = b.finish_catch_up(job.run(), 2);
    assert!(errors.is_empty(), "{errors:?}");
    assert!(actions.is_empty(), "nothing swapped in yet: {actions:?}");
    let mut second = b.take_catch_ups();
    assert_eq!(second.len(), 1, "a second round over the write");
    assert!(b.catching_up("log"));

    let (actions, errors) = b.finish_catch_up(second.pop().unwrap().run(), 3);
    assert!(errors.is_empty(), "{errors:?}");
    let persisted = persisted(&actions);
    assert_eq!(
        persisted, ENTRIES,
        "the peer's changes, once (the write was ours)"
    );
    let doc = b.container("log").unwrap().to_json();
    assert_eq!(doc["mine"], json!("written during the catch-up"));
    assert_eq!(doc["k02999"], json!(2999));
    assert_eq!(b.change_count_of("log"), Some(ENTRIES + 1));
    // Both sides end with the union.
    let mut out = actions;
    out.extend(b.flush());
    let _ = exchange(&mut a, &mut b, (out, false), 4, |_, _| {
        panic!("no further catch-up")
    });
    assert_eq!(a.heads_of("log"), b.heads_of("log"));
    assert_eq!(
        a.container("log").unwrap().to_json()["mine"],
        json!("written during the catch-up")
    );
}

// Goal: a catch-up whose input turns out bad (a whole document that does not
// load) is refused with an error and leaves the live container untouched.
#[test]
fn a_bad_document_in_a_catch_up_changes_nothing() {
    let mut a = filled();
    let mut b = Engine::new(b"actor-b".to_vec(), config());
    let _ = b.peer_up("a", 0);
    let mut wire: VecDeque<SyncPayload> = a
        .peer_up("b", 0)
        .into_iter()
        .filter_map(|x| match x {
            Action::Send { payload, .. } => Some(payload),
            _ => None,
        })
        .collect();
    let mut job = None;
    let mut steps = 0;
    while let Some(payload) = wire.pop_front() {
        steps += 1;
        assert!(steps < 1_000, "the exchange never ends");
        let payload = match payload {
            SyncPayload::Sync {
                container,
                mut message,
            } if message.len() > 4 * 1024 => {
                // Flip a byte inside the document the message carries (its
                // checksum no longer matches).
                let mid = message.len() / 2;
                message[mid] ^= 0xff;
                SyncPayload::Sync { container, message }
            }
            p => p,
        };
        for x in b.handle("a", payload, 1).expect("decodes") {
            if let Action::Send { payload, .. } = x {
                for y in a.handle("b", payload, 1).unwrap() {
                    if let Action::Send { payload, .. } = y {
                        wire.push_back(payload);
                    }
                }
            }
        }
        if let Some(j) = b.take_catch_ups().pop() {
            job = Some(j);
            break;
        }
    }
    let job = job.expect("the big message became a catch-up");
    let (actions, errors) = b.finish_catch_up(job.run(), 2);
    assert_eq!(errors.len(), 1, "the bad document is refused: {actions:?}");
    assert!(
        errors[0].poisoned_container().is_none(),
        "the live container is intact"
    );
    assert!(!actions.iter().any(|x| matches!(x, Action::Persist { .. })));
    assert_eq!(b.change_count_of("log").unwrap_or(0), 0);
    assert!(!b.catching_up("log"));
}

// Goal: catch-ups under way at once are bounded (each holds a copy and its
// message): past the bound, a big message is applied inline, as before.
#[test]
fn catch_ups_at_once_are_bounded() {
    let mut a = Engine::new(b"actor-a".to_vec(), config());
    for c in ["one", "two"] {
        for i in 0..ENTRIES {
            a.local_put(c, &format!("k{i:05}"), &json!(i))
                .unwrap()
                .unwrap();
        }
    }
    let _ = a.flush();
    let mut b = Engine::new(
        b"actor-b".to_vec(),
        Config {
            catch_up_max_running: 1,
            ..config()
        },
    );
    let first = a.peer_up("b", 0);
    let _ = b.peer_up("a", 0);
    let mut jobs = Vec::new();
    let during = exchange(&mut a, &mut b, (first, true), 1, |_, job| jobs.push(job));
    assert_eq!(jobs.len(), 1, "one catch-up at a time");
    let inline: Vec<&str> = during
        .iter()
        .filter_map(|x| match x {
            Action::Persist { container, .. } => Some(container.as_str()),
            _ => None,
        })
        .collect();
    let off = jobs[0].container().to_owned();
    assert_eq!(inline.len(), 1, "the other container was applied inline");
    assert_ne!(inline[0], off);
    let (_, errors) = b.finish_catch_up(jobs.pop().unwrap().run(), 2);
    assert!(errors.is_empty(), "{errors:?}");
    assert_eq!(b.change_count_of("one"), Some(ENTRIES));
    assert_eq!(b.change_count_of("two"), Some(ENTRIES));
}

// Goal: a device that wrote to the container before the whole document
// arrived still converges (found on real daemons: it did not).
#[test]
fn a_write_before_the_document_arrives_converges() {
    let mut a = filled();
    let mut b = Engine::new(b"actor-b".to_vec(), config());
    let _ = b.peer_up("a", 0);
    let mut wire: VecDeque<(bool, SyncPayload)> = a
        .peer_up("b", 0)
        .into_iter()
        .filter_map(|x| match x {
            Action::Send { payload, .. } => Some((true, payload)),
            _ => None,
        })
        .collect();
    let mut wrote = false;
    let mut steps = 0;
    while let Some((to_b, payload)) = wire.pop_front() {
        steps += 1;
        assert!(steps < 1_000, "the exchange never ends");
        if to_b {
            if !wrote
                && matches!(&payload, SyncPayload::Sync { message, .. } if message.len() > 4 * 1024)
            {
                b.local_put("log", "mine", &json!(1)).unwrap().unwrap();
                wrote = true;
            }
            for x in b.handle("a", payload, 1).unwrap() {
                if let Action::Send { payload, .. } = x {
                    wire.push_back((false, payload));
                }
            }
            for job in b.take_catch_ups() {
                let (out, errors) = b.finish_catch_up(job.run(), 2);
                assert!(errors.is_empty(), "{errors:?}");
                for x in out {
                    if let Action::Send { payload, .. } = x {
                        wire.push_back((false, payload));
                    }
                }
            }
        } else {
            for x in a.handle("b", payload, 1).unwrap() {
                if let Action::Send { payload, .. } = x {
                    wire.push_back((true, payload));
                }
            }
        }
    }
    assert!(wrote);
    assert_eq!(b.change_count_of("log"), Some(ENTRIES + 1));
}

/// The payload's bytes if it is a sync message for `container`.
fn sync_bytes(payload: &SyncPayload, container: &str) -> Option<usize> {
    match payload {
        SyncPayload::Sync {
            container: c,
            message,
        } if c == container => Some(message.len()),
        _ => None,
    }
}

// Goal: the serving side of a cold sync does not save a big document on
// its loop (issue 26: 154 ms at 1,000,000 entries): the whole-document
// reply to a peer that holds nothing is made by a job on a copy; `handle`
// sends nothing big, the peer's messages for the container wait for the
// reply, and the peer ends with the same heads. A peer gone meanwhile
// drops the reply. Method: two engines, the server's reply jobs kept until
// the wire is quiet, then run and finished.
#[test]
fn a_whole_document_for_an_empty_peer_is_made_off_the_loop() {
    let cfg = Config {
        serve_inline_ops: 100,
        catch_up_inline_bytes: usize::MAX,
        ..Config::default()
    };
    let mut a = Engine::new(b"actor-a".to_vec(), cfg.clone());
    for i in 0..ENTRIES {
        a.local_put("log", &format!("k{i:05}"), &json!(i))
            .unwrap()
            .unwrap();
    }
    let _ = a.flush();
    let mut b = Engine::new(b"actor-b".to_vec(), cfg.clone());
    let mut wire: VecDeque<(bool, SyncPayload)> = VecDeque::new();
    let sends = |actions: Vec<Action>, to_b: bool, wire: &mut VecDeque<(bool, SyncPayload)>| {
        for x in actions {
            if let Action::Send { payload, .. } = x {
                wire.push_back((to_b, payload));
            }
        }
    };
    sends(a.peer_up("b", 0), true, &mut wire);
    sends(b.peer_up("a", 0), false, &mut wire);
    let (mut jobs, mut served, mut held_while_serving, mut biggest_inline) = (Vec::new(), 0, 0, 0);
    let mut steps = 0;
    loop {
        while let Some((to_b, payload)) = wire.pop_front() {
            steps += 1;
            assert!(steps < 10_000, "the exchange never ends");
            if to_b {
                let out = b.handle("a", payload, 1).expect("b accepts");
                sends(out, false, &mut wire);
            } else {
                let from_b_on_log = sync_bytes(&payload, "log").is_some();
                let out = a.handle("b", payload, 1).expect("a accepts");
                if from_b_on_log && !jobs.is_empty() {
                    assert!(out.is_empty(), "held while the reply is made: {out:?}");
                    held_while_serving += 1;
                }
                for x in &out {
                    if let Action::Send { payload, .. } = x {
                        biggest_inline =
                            biggest_inline.max(sync_bytes(payload, "log").unwrap_or(0));
                    }
                }
                sends(out, true, &mut wire);
                jobs.extend(a.take_catch_ups());
            }
        }
        if jobs.is_empty() {
            break;
        }
        for job in jobs.drain(..) {
            served += 1;
            let (out, errors) = a.finish_catch_up(job.run(), 2);
            assert!(errors.is_empty(), "{errors:?}");
            sends(out, true, &mut wire);
        }
    }
    assert!(served >= 1, "the whole document was made by a job");
    assert!(
        biggest_inline < 4 * 1024,
        "no big reply came out of handle: {biggest_inline} B"
    );
    assert_eq!(b.heads_of("log"), a.heads_of("log"));
    assert_eq!(b.change_count_of("log"), a.change_count_of("log"));
    // Both sides opened the exchange: b's second message came while the
    // reply was being made.
    assert!(held_while_serving >= 1, "nothing was held");

    // A peer gone while its reply is made: the reply is dropped.
    let mut c = Engine::new(b"actor-c".to_vec(), cfg);
    let mut wire: VecDeque<(bool, SyncPayload)> = VecDeque::new();
    sends(a.peer_up("c", 10), true, &mut wire);
    sends(c.peer_up("a", 10), false, &mut wire);
    let mut pending = Vec::new();
    while let Some((to_c, payload)) = wire.pop_front() {
        if to_c {
            sends(c.handle("a", payload, 10).unwrap(), false, &mut wire);
        } else {
            sends(a.handle("c", payload, 10).unwrap(), true, &mut wire);
            pending.extend(a.take_catch_ups());
        }
    }
    assert!(!pending.is_empty(), "a reply job for c");
    a.peer_down("c");
    for job in pending {
        let (out, errors) = a.finish_catch_up(job.run(), 11);
        assert!(out.is_empty() && errors.is_empty(), "{out:?} {errors:?}");
    }
}
