//! How a device keeps its containers on disk, decided here and performed
//! by the shell: when a container's log is folded into a new snapshot
//! ([`compaction_due`]), and the per-container record that lets start-up
//! skip loading documents ([`heads`]).
//!
//! A container is stored as its last snapshot plus the changes logged
//! after it. Loading applies those changes one by one, which costs far
//! more per operation than loading a snapshot, so the log must not grow
//! large next to the snapshot. Saving a snapshot costs about what loading
//! it does, so it must not happen for every few changes of a big
//! document either. The rule below keeps the log within half the
//! snapshot's weight: snapshots of a growing container are saved at
//! sizes that grow geometrically, so all of them together cost about
//! three times the last one.

pub mod heads;

/// Changes logged after a snapshot before a small container is compacted.
pub const COMPACT_AFTER_CHANGES: u64 = 2048;
/// What one logged change costs to load beyond its bytes, counted in
/// bytes of snapshot: Automerge applies each change on its own (about
/// 20 µs for a small one here), so many small changes weigh more than
/// their size.
const CHANGE_WEIGHT_BYTES: u64 = 512;
/// A log lighter than this is never compacted (1 MiB: 2,048 small
/// changes, or one large write).
const COMPACT_FLOOR: u64 = COMPACT_AFTER_CHANGES * CHANGE_WEIGHT_BYTES;

/// What a container's log holds after its snapshot.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Logged {
    /// Changes logged after the snapshot.
    pub changes: u64,
    /// Their bytes, as Automerge encodes them.
    pub bytes: u64,
}

impl Logged {
    /// What logging `changes` adds.
    pub fn of<C: AsRef<[u8]>>(changes: &[C]) -> Logged {
        Logged {
            changes: changes.len() as u64,
            bytes: changes.iter().map(|c| c.as_ref().len() as u64).sum(),
        }
    }

    /// `more` was logged.
    pub fn add(&mut self, more: Logged) {
        self.changes = self.changes.saturating_add(more.changes);
        self.bytes = self.bytes.saturating_add(more.bytes);
    }

    fn weight(self) -> u64 {
        self.changes
            .saturating_mul(CHANGE_WEIGHT_BYTES)
            .saturating_add(self.bytes)
    }
}

/// Whether a container whose log holds `logged` after a snapshot of
/// `snapshot_bytes` (as stored; 0 when it has none, or its size is not
/// known since start) is due to be compacted: when the log weighs at
/// least half the snapshot, and at least [`COMPACT_FLOOR`].
pub fn compaction_due(logged: Logged, snapshot_bytes: u64) -> bool {
    logged.weight() >= COMPACT_FLOOR.max(snapshot_bytes / 2)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn logged(changes: u64, bytes: u64) -> Logged {
        Logged { changes, bytes }
    }

    // Goal: a small container is compacted after 2,048 small changes or
    // one megabyte of changes, as before the rule weighed bytes.
    #[test]
    fn small_containers_compact_after_2048_changes_or_a_megabyte() {
        assert!(!compaction_due(logged(2047, 0), 0));
        assert!(compaction_due(logged(2048, 0), 0));
        assert!(compaction_due(logged(2048, 0), 100_000));
        assert!(!compaction_due(logged(1, 1_000_000), 0));
        assert!(compaction_due(logged(1, 1 << 20), 0));
        // 100 changes of 10 kB each: a megabyte, where counting changes
        // alone would have waited for 2,048 of them (the `big` workload's
        // batches of 1,000 entries were never compacted).
        assert!(compaction_due(logged(100, 1_000_000), 0));
    }

    // Goal: next to a big snapshot, the log grows to half its size before
    // it is folded in, so that a growing container is saved at sizes that
    // grow geometrically (all saves together cost about three times the
    // last one), never every 2,048 changes of a million-entry document.
    #[test]
    fn big_containers_compact_when_the_log_weighs_half_the_snapshot() {
        let snapshot = 40 << 20;
        assert!(!compaction_due(logged(2048, 0), snapshot));
        assert!(!compaction_due(logged(1000, 19 << 20), snapshot));
        assert!(compaction_due(logged(1000, 20 << 20), snapshot));
        assert!(compaction_due(logged(40_960, 0), snapshot));
        // Saves of a container that only grows: each at 1.5 times the last
        // (the log weighs half the snapshot, and the snapshot holds it all).
        let (mut saved, mut total, mut stored) = (0u64, 0u64, 0u64);
        let mut log = Logged::default();
        for _ in 0..2_000 {
            log.add(Logged {
                changes: 1,
                bytes: 100_000,
            });
            if compaction_due(log, stored) {
                stored += log.bytes;
                total += stored;
                saved += 1;
                log = Logged::default();
            }
        }
        assert!((10..=14).contains(&saved), "{saved} saves");
        assert!(total <= 3 * stored, "{total} bytes saved for {stored}");
        assert!(log.weight() < stored / 2 + COMPACT_FLOOR);
    }

    // Goal: a log's weight counts every change and every byte it adds.
    #[test]
    fn logging_adds_its_changes_and_their_bytes() {
        let mut log = Logged::of(&[vec![0u8; 3], vec![0u8; 5]]);
        assert_eq!(
            log,
            Logged {
                changes: 2,
                bytes: 8
            }
        );
        log.add(Logged::of(&[b"abcd"]));
        assert_eq!(
            log,
            Logged {
                changes: 3,
                bytes: 12
            }
        );
        assert_eq!(Logged::of::<Vec<u8>>(&[]), Logged::default());
    }

    // Goal: counters that overflow saturate and still compact.
    #[test]
    fn saturated_counts_still_compact() {
        let mut l = logged(u64::MAX - 1, u64::MAX - 1);
        l.add(Logged {
            changes: 10,
            bytes: 10,
        });
        assert_eq!(l, logged(u64::MAX, u64::MAX));
        assert!(compaction_due(l, u64::MAX));
    }
}
