//! When a device gives memory back (issue 26, idle memory): once startup
//! settled (every verified peer in sync, or ten seconds after start for a
//! device alone), then every five minutes. The shell drops the code pages
//! startup ran and the allocator's free pages then (node/src/daemon/
//! exec/resident.rs); an idle daemon's RSS is measured in docs/performance.md.

mod sim;

use sim::{Knobs, Sim};

/// `SETTLED_RELEASE_MS` and `RELEASE_EVERY_MS` in crates/agent/src/
/// constants.rs (crate-private there).
const SETTLED_MS: u64 = 10_000;
const EVERY_MS: u64 = 300_000;

fn seeds() -> std::ops::Range<u64> {
    0..8
}

/// Goal: two devices that meet and sync give memory back as soon as they
/// are in sync, well before the ten-second fallback, and then every five
/// minutes (an eviction gives memory back too). Method: the seeded simulator; both start on
/// one network, run for eleven minutes idle.
#[test]
fn devices_in_sync_give_memory_back_at_once_then_every_five_minutes() {
    for seed in seeds() {
        let mut s = Sim::new(seed, 2, Knobs::default());
        let t0 = s.now_ms;
        s.start(0);
        s.start(1);
        s.run_for(11 * 60_000);
        for (i, d) in s.devices.iter().enumerate() {
            let r = &d.released_ms;
            let first = *r.first().unwrap_or_else(|| {
                panic!(
                    "seed {seed}: d{i} never gave memory back\n{}",
                    s.trace_tail()
                )
            });
            assert!(
                first - t0 < SETTLED_MS,
                "seed {seed}: d{i} first gave memory back {} ms after start, though in sync",
                first - t0
            );
            for k in 1..=2 {
                let at = first + k * EVERY_MS;
                assert!(
                    r.iter().any(|&t| (at..at + 1_000).contains(&t)),
                    "seed {seed}: d{i}: no release {k}×5 min after the first: {r:?}"
                );
            }
            // Besides those, only the eviction of what startup loaded, a
            // minute later, gives memory back.
            assert!(r.len() <= 4, "seed {seed}: d{i}: {r:?}");
        }
    }
}

/// Goal: a device with nobody to sync with still gives memory back, ten
/// seconds after start. Method: one device started alone.
#[test]
fn a_device_alone_gives_memory_back_ten_seconds_after_start() {
    for seed in seeds() {
        let mut s = Sim::new(seed, 2, Knobs::default());
        let t0 = s.now_ms;
        s.start(0);
        s.run_for(SETTLED_MS - 1_000);
        let early: Vec<u64> = s.devices[0].released_ms.clone();
        assert!(
            early.iter().all(|&t| t - t0 < 1_000),
            "seed {seed}: released before settling: {early:?}"
        );
        s.run_for(2_000);
        let r = &s.devices[0].released_ms[early.len()..];
        assert_eq!(r.len(), 1, "seed {seed}: {r:?}");
        assert!(
            (SETTLED_MS..SETTLED_MS + 1_000).contains(&(r[0] - t0)),
            "seed {seed}: released {} ms after start",
            r[0] - t0
        );
    }
}
