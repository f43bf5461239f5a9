//! `sync --once` (issue 26): it ends as soon as it converged.

mod sim;

use sim::{Knobs, Sim};

fn seeds() -> std::ops::Range<u64> {
    0..8
}

/// Goal: `sync --once` ends in the handle that made it converge, not at the
/// next tick (up to 200 ms later: issue 26's cold sync paid it, and its
/// empty-log baseline too). Method: d0 runs; d1 starts as `sync --once`;
/// the input whose handle emitted `Finished` is recorded.
#[test]
fn sync_once_ends_when_it_converges_not_at_the_next_tick() {
    for seed in seeds() {
        let mut s = Sim::new(seed, 2, Knobs::default());
        s.once.insert(1);
        s.start(0);
        s.run_for(2_000);
        s.start(1);
        s.run_for(30_000);
        let (_, converged, by) = s.devices[1]
            .finished
            .unwrap_or_else(|| panic!("seed {seed}: sync --once never ended\n{}", s.trace_tail()));
        assert!(converged, "seed {seed}");
        assert_eq!(by, "net", "seed {seed}: ended by a {by} input");
    }
}
