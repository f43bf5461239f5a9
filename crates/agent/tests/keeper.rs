//! Pulling from a keeper (issue 26): a page of envelopes is applied together;
//! a keeper rolled back to an older copy of its store is noticed (issue 41).

mod sim;

use sim::{Knobs, Sim};

/// Goal: a device that meets only the keeper applies a page of the keeper's
/// envelopes in one Automerge call per container, and persists them once
/// in that handle, not once per envelope (each apply costs in proportion to
/// the document, and a page holds up to 4 MiB of envelopes). Method: d1 writes to one
/// container, a few writes per keeper push, while d2 is down; d1 stops; d2
/// starts with only the keeper. It must hold every write, and no handle of
/// d2 may persist the container more than once.
#[test]
fn a_keeper_page_is_applied_once_per_container() {
    for seed in 0..6 {
        let _entropy = nuwa_entropy::deterministic_for_simulation(seed);
        let knobs = Knobs {
            loss_per_mille: 0,
            keeper: true,
            ..Knobs::default()
        };
        let mut s = Sim::new(seed, 3, knobs);
        let (a, b) = (1, 2);
        s.start(0);
        s.start(a);
        s.run_for(2_000);
        for _ in 0..12 {
            for _ in 0..3 {
                s.write(a, "notes");
            }
            s.run_for(1_500);
        }
        s.run_for(4_000);
        s.crash(0);
        s.crash(a);
        let writes = s.acked.clone();
        assert!(
            writes.len() >= 30,
            "seed {seed}: {} writes acknowledged",
            writes.len()
        );
        s.start(b);
        s.run_for(10_000);
        let lacking = s.first_lacking(b, &writes);
        assert!(
            lacking.is_none(),
            "seed {seed}: d{b}, meeting only the keeper, lacks {:?}\n{}",
            lacking.map(|w| &w.key),
            s.trace_tail()
        );
        assert_eq!(
            s.devices[b].most_persists_in_a_handle,
            1,
            "seed {seed}: a handle of d{b} persisted the container more than once\n{}",
            s.trace_tail()
        );
    }
}

/// Goal: a keeper whose store was rolled back to an older copy is noticed
/// by a device that had seen more of it, reported in its status, and given
/// everything again, so no acknowledged write is lost (issue 41: a rolled
/// back keeper went unnoticed, and a device meeting only the keeper lacked
/// a third of the writes). Method: d1 writes, the keeper's store is copied,
/// d1 writes more, then the keeper restarts on the copy; d1 must report the
/// rollback, and d2, started afterwards with only the keeper, must hold
/// every acknowledged write.
#[test]
fn a_rolled_back_keeper_is_noticed_and_refilled() {
    for seed in 0..6 {
        let _entropy = nuwa_entropy::deterministic_for_simulation(seed);
        let knobs = Knobs {
            loss_per_mille: 0,
            keeper: true,
            ..Knobs::default()
        };
        let mut s = Sim::new(seed, 3, knobs);
        let (a, b) = (1, 2);
        s.start(0);
        s.start(a);
        s.run_for(2_000);
        s.crash(0);
        let write_some = |s: &mut Sim| {
            for _ in 0..5 {
                s.write(a, "notes");
                s.run_for(1_000);
            }
            s.run_for(4_000);
        };
        write_some(&mut s);
        let backup = s.keeper_backup();
        write_some(&mut s);
        let held_before = s.status(a).keepers[0].cursor;
        assert!(s.status(a).keepers[0].rollback.is_none(), "seed {seed}");
        s.keeper_roll_back(backup);
        s.run_for(10_000);
        let k = s.status(a).keepers[0].clone();
        let r = k.rollback.clone().unwrap_or_else(|| {
            panic!(
                "seed {seed}: d{a} did not notice the rollback: {k:?}\n{}",
                s.trace_tail()
            )
        });
        assert!(
            r.served_seq < r.held_seq && r.held_seq >= held_before,
            "seed {seed}: {r:?} (cursor was {held_before})"
        );
        assert!(
            k.pushed_all,
            "seed {seed}: d{a} did not push everything again: {k:?}\n{}",
            s.trace_tail()
        );
        s.crash(a);
        let writes = s.acked.clone();
        assert!(writes.len() >= 10, "seed {seed}: {} writes", writes.len());
        s.start(b);
        s.run_for(10_000);
        let lacking = s.first_lacking(b, &writes);
        assert!(
            lacking.is_none(),
            "seed {seed}: d{b}, meeting only the rolled-back keeper, lacks {:?}\n{}",
            lacking.map(|w| &w.key),
            s.trace_tail()
        );
    }
}
