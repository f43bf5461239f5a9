//! The local changes of a revoked device that will never sync.
//!
//! A device takes writes until it learns it was revoked (a peer tells it,
//! or the chain it loads at start says so); the peers that know refuse it,
//! so what it wrote from the revocation on reaches no one. The agent keeps
//! a bounded record of when it made each local change and in which
//! container ([`LocalWrites`], stored under [`LOCAL_WRITES_META`]). When
//! it finds itself revoked, the changes made at or after the time of the
//! DID entry that removed it are the ones that never sync: `status` lists
//! them ([`NeverSyncs`]), and `state export` still reads them.
//!
//! What it cannot know: the revoking entry's time is the admin's clock and
//! the changes' times this device's (peers refuse clocks more than 300 s
//! apart); a peer that had not heard of the revocation yet may have taken
//! a few of them; the record holds the newest [`MAX_LOCAL_WRITES_KEPT`]
//! changes, as last saved (at most [`SAVE_EVERY_MS`] old after a crash).
//! `complete` says whether it reaches back to the revocation.

use std::collections::{BTreeMap, VecDeque};

use serde::{Deserialize, Serialize};

pub use crate::status::NeverSyncs;

/// The metadata record of [`LocalWrites`].
pub const LOCAL_WRITES_META: &str = "local_writes";
/// Local changes the record keeps (the newest).
pub const MAX_LOCAL_WRITES_KEPT: usize = 4096;
/// How often a changed record is saved while the daemon runs.
pub const SAVE_EVERY_MS: u64 = 60_000;

/// When this device made its recent local changes, and once it is revoked,
/// which of them never sync.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub(crate) struct LocalWrites {
    /// When this record began (the first run that kept it), Unix ms.
    since_ms: u64,
    /// The newest local changes, oldest first: (Unix ms, container).
    recent: VecDeque<(u64, String)>,
    /// Older changes were dropped to keep [`MAX_LOCAL_WRITES_KEPT`].
    dropped: bool,
    /// Once this device knows it was revoked.
    never_syncs: Option<NeverSyncs>,
    #[serde(skip)]
    unsaved: bool,
    #[serde(skip)]
    next_save_ms: u64,
}

impl LocalWrites {
    /// The record as stored in `meta` (a new one, begun now, if there is
    /// none or it does not read).
    pub(crate) fn from_meta(meta: &BTreeMap<String, Vec<u8>>, now_ms: u64) -> Self {
        meta.get(LOCAL_WRITES_META)
            .and_then(|b| serde_json::from_slice::<LocalWrites>(b).ok())
            .unwrap_or(LocalWrites {
                since_ms: now_ms,
                ..LocalWrites::default()
            })
    }

    /// A local change of `container` was made durable at `now_ms`.
    pub(crate) fn wrote(&mut self, container: &str, now_ms: u64) {
        self.unsaved = true;
        if let Some(n) = &mut self.never_syncs {
            // Made after this device knew (the lifecycle of typed items
            // still writes): it never syncs either.
            n.changes += 1;
            *n.containers.entry(container.to_owned()).or_default() += 1;
            return;
        }
        if self.recent.len() >= MAX_LOCAL_WRITES_KEPT {
            self.recent.pop_front();
            self.dropped = true;
        }
        self.recent.push_back((now_ms, container.to_owned()));
    }

    /// This device is revoked, by the chain entry of `revoked_at_ms` (`None`
    /// when no entry of its chain removed it: a removal on a branch that
    /// lost). The first time, decides which local changes never sync.
    pub(crate) fn revoked(&mut self, revoked_at_ms: Option<u64>, now_ms: u64) {
        if self.never_syncs.is_some() {
            return;
        }
        let from = revoked_at_ms.unwrap_or(u64::MAX);
        let mut containers: BTreeMap<String, u64> = BTreeMap::new();
        for (_, c) in self.recent.iter().filter(|(t, _)| *t >= from) {
            *containers.entry(c.clone()).or_default() += 1;
        }
        let oldest = self.recent.front().map_or(self.since_ms, |(t, _)| *t);
        let complete =
            revoked_at_ms.is_some() && self.since_ms <= from && (!self.dropped || oldest <= from);
        self.never_syncs = Some(NeverSyncs {
            revoked_at_unix_ms: revoked_at_ms,
            learned_at_unix_ms: now_ms,
            changes: containers.values().sum(),
            containers,
            complete,
        });
        // What came before no longer matters; save at once.
        self.recent.clear();
        self.unsaved = true;
        self.next_save_ms = 0;
    }

    pub(crate) fn never_syncs(&self) -> Option<&NeverSyncs> {
        self.never_syncs.as_ref()
    }

    /// The record to save now, if it changed and is due (or `force`).
    pub(crate) fn take_save(&mut self, now_ms: u64, force: bool) -> Option<Vec<u8>> {
        if !self.unsaved || (!force && now_ms < self.next_save_ms) {
            return None;
        }
        self.unsaved = false;
        self.next_save_ms = now_ms.saturating_add(SAVE_EVERY_MS);
        serde_json::to_vec(self).ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A record begun at `since` with one change per (time, container).
    fn record(since: u64, writes: &[(u64, &str)]) -> LocalWrites {
        let mut w = LocalWrites {
            since_ms: since,
            ..LocalWrites::default()
        };
        for (t, c) in writes {
            w.wrote(c, *t);
        }
        w
    }

    // Goal: the changes made at or after the revoking entry's time are the
    // ones that never sync, named by container, and the record says
    // whether it reaches back that far. Method: a table of records and
    // revocation times, checked through one helper.
    #[test]
    fn changes_from_the_revocation_on_never_sync() {
        #[allow(clippy::type_complexity)]
        let cases: &[(&str, u64, &[(u64, &str)], Option<u64>, &[(&str, u64)], bool)] = &[
            ("none after", 0, &[(5, "a"), (9, "b")], Some(10), &[], true),
            (
                "from the revocation on",
                0,
                &[(5, "a"), (10, "a"), (11, "b"), (12, "a")],
                Some(10),
                &[("a", 2), ("b", 1)],
                true,
            ),
            (
                "record began later",
                20,
                &[(25, "a")],
                Some(10),
                &[("a", 1)],
                false,
            ),
            (
                "removed on a lost branch",
                0,
                &[(25, "a")],
                None,
                &[],
                false,
            ),
        ];
        for (what, since, writes, at, expected, complete) in cases {
            let mut w = record(*since, writes);
            w.revoked(*at, 100);
            let n = w.never_syncs().expect("decided");
            let expected: BTreeMap<String, u64> =
                expected.iter().map(|(c, k)| (c.to_string(), *k)).collect();
            assert_eq!(n.containers, expected, "{what}");
            assert_eq!(n.changes, expected.values().sum::<u64>(), "{what}");
            assert_eq!(n.complete, *complete, "{what}");
            assert_eq!(n.learned_at_unix_ms, 100, "{what}");
        }
    }

    // Goal: the record is bounded, says when it no longer reaches back to
    // the revocation, survives a save and load, and changes made after the
    // device knew count too.
    #[test]
    fn the_record_is_bounded_saved_and_counts_later_changes() {
        let mut w = record(0, &[]);
        for t in 0..(MAX_LOCAL_WRITES_KEPT as u64 + 10) {
            w.wrote("a", 1_000 + t);
        }
        assert_eq!(w.recent.len(), MAX_LOCAL_WRITES_KEPT);
        let bytes = w.take_save(0, false).expect("unsaved and due");
        assert!(w.take_save(1, false).is_none(), "nothing changed since");
        let meta = BTreeMap::from([(LOCAL_WRITES_META.to_owned(), bytes)]);
        let mut loaded = LocalWrites::from_meta(&meta, 99_999);
        loaded.revoked(Some(1_000), 99_999);
        let n = loaded.never_syncs().unwrap().clone();
        assert_eq!(n.changes, MAX_LOCAL_WRITES_KEPT as u64);
        assert!(
            !n.complete,
            "the oldest changes after the revocation were dropped"
        );
        loaded.wrote("b", 100_000);
        loaded.revoked(Some(0), 100_001);
        let n = loaded.never_syncs().unwrap();
        assert_eq!(n.containers["b"], 1, "a change after it knew");
        assert_eq!(n.learned_at_unix_ms, 99_999, "decided once");
        assert!(loaded.take_save(100_002, false).is_some(), "saved at once");
    }
}
