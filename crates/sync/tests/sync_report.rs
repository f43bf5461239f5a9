//! `Engine::sync_report` (status: "am I in sync?"): a device that lacks a
//! peer's changes reports the container `behind` by the number of changes
//! the peer said it holds, and `in_sync` once the exchange ends.

use std::collections::VecDeque;

use nuwa_proto::SyncPayload;
use nuwa_sync::{Action, Config, Engine, PeerSyncState};
use serde_json::json;

fn put(e: &mut Engine, range: std::ops::Range<usize>) {
    for i in range {
        e.local_put("notes", &format!("k{i:03}"), &json!(i))
            .unwrap()
            .unwrap();
    }
    let _ = e.flush();
}

/// Delivers every message until both are quiet, calling `watch` on `b`
/// after each message it handles.
fn pump(
    a: &mut Engine,
    b: &mut Engine,
    first: Vec<(bool, Vec<Action>)>,
    now: u64,
    mut watch: impl FnMut(&mut Engine),
) {
    let mut wire: VecDeque<(bool, SyncPayload)> = VecDeque::new();
    let push = |wire: &mut VecDeque<(bool, SyncPayload)>, to_b: bool, actions: &[Action]| {
        for x in actions {
            if let Action::Send { payload, .. } = x {
                wire.push_back((to_b, payload.clone()));
            }
        }
    };
    for (to_b, actions) in first {
        push(&mut wire, to_b, &actions);
    }
    let mut steps = 0;
    while let Some((to_b, payload)) = wire.pop_front() {
        steps += 1;
        assert!(steps < 10_000, "the exchange never ends");
        if to_b {
            let out = b.handle("a", payload, now).expect("b accepts");
            push(&mut wire, false, &out);
            watch(b);
        } else {
            let out = a.handle("b", payload, now).expect("a accepts");
            push(&mut wire, true, &out);
        }
    }
}

#[test]
fn a_lagging_device_reports_how_far_behind_then_in_sync() {
    let config = Config::default();
    let mut a = Engine::new(b"actor-a".to_vec(), config.clone());
    let mut b = Engine::new(b"actor-b".to_vec(), config.clone());
    put(&mut a, 0..10);
    let first = vec![(false, b.peer_up("a", 0)), (true, a.peer_up("b", 0))];
    pump(&mut a, &mut b, first, 0, |_| {});
    assert_eq!(b.change_count_of("notes"), Some(10));
    let report = b.sync_report("a");
    assert_eq!(report.len(), 1, "{report:?}");
    assert_eq!(report[0].state, PeerSyncState::InSync, "{report:?}");

    // a writes 40 more while b hears nothing (no live delta reaches it).
    put(&mut a, 10..50);
    let mut seen = Vec::new();
    let now = 10 * 60_000;
    let first = vec![(true, a.tick(now)), (false, b.tick(now))];
    pump(&mut a, &mut b, first, now, |b| {
        seen.extend(b.sync_report("a"));
    });
    assert!(
        seen.iter()
            .any(|r| r.state == PeerSyncState::Behind && r.behind == Some(40)),
        "b never reported being 40 changes behind: {seen:?}"
    );
    assert_eq!(b.change_count_of("notes"), Some(50));
    let report = b.sync_report("a");
    assert_eq!(report[0].state, PeerSyncState::InSync, "{report:?}");
    assert_eq!(report[0].behind, Some(0));
    // An unknown peer has no report.
    assert!(b.sync_report("nobody").is_empty());
}

// Goal: a peer's summary that was dropped (it came before we knew the
// peer) does not keep us from saying "in sync" until its next periodic
// summary: its full-range answer to our digest is a summary too. Method:
// a's summary at peer_up is lost; b comes up, syncs a's changes, and is in
// sync with a when the exchange ends, with no tick (issue 26's cold sync
// waited 5 s here).
#[test]
fn a_dropped_summary_does_not_delay_in_sync() {
    let config = Config::default();
    let mut a = Engine::new(b"actor-a".to_vec(), config.clone());
    let mut b = Engine::new(b"actor-b".to_vec(), config.clone());
    put(&mut a, 0..10);
    let _lost = a.peer_up("b", 0);
    let up = b.peer_up("a", 100);
    pump(&mut a, &mut b, vec![(false, up)], 100, |_| {});
    assert_eq!(b.change_count_of("notes"), Some(10), "b has a's changes");
    assert!(
        b.in_sync_with("a"),
        "b is in sync with a when the exchange ends"
    );
}
