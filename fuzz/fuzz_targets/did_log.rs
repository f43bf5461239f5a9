//! Fuzzes DID logs from JSON: `serde_json::from_slice::<DidLog>`, then
//! `verify`, and `merge_from` in both directions against two valid logs of
//! the fixed agent (its genesis, and the genesis plus one device).
//!
//! Checks that verifying and merging a hostile log never panic, that a merge
//! which fails leaves our log unchanged, and that a parsed log survives
//! serialize → parse unchanged.
#![no_main]

use std::sync::LazyLock;

use libfuzzer_sys::fuzz_target;
use nuwa_fuzz::{NOW_UNIX_SECS, agent_did, genesis_log, log_with_device};
use nuwa_identity::log::DidLog;

struct Fixture {
    did: String,
    logs: [DidLog; 2],
}

static FIXTURE: LazyLock<Fixture> = LazyLock::new(|| Fixture {
    did: agent_did(),
    logs: [genesis_log(), log_with_device()],
});

fuzz_target!(|data: &[u8]| {
    let Ok(log) = serde_json::from_slice::<DidLog>(data) else {
        return;
    };
    let f = &*FIXTURE;
    let _ = log.verify(None, NOW_UNIX_SECS);
    let _ = log.verify(Some(&f.did), NOW_UNIX_SECS);
    let _ = (log.current(), log.did(), log.head_hash(), log.len());

    for ours in &f.logs {
        let mut mine = ours.clone();
        if mine.merge_from(&log, NOW_UNIX_SECS).is_err() {
            assert_eq!(&mine, ours, "a failed merge changed our log");
        }
        let mut theirs = log.clone();
        if theirs.merge_from(ours, NOW_UNIX_SECS).is_err() {
            assert_eq!(theirs, log, "a failed merge changed the fuzzed log");
        }
    }

    if let Ok(json) = serde_json::to_vec(&log) {
        let again = serde_json::from_slice::<DidLog>(&json);
        assert_eq!(again.ok().as_ref(), Some(&log), "json round trip");
    }
});
