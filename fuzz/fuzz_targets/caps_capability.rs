//! Fuzzes capability parsing and verification (`nuwa-caps`): the input is a
//! capability's JSON bytes, parsed with `Capability::from_json` and, if it
//! parses, verified with the fixed master key as the only admin, at the
//! fixed clock and just before the capability expires.
//!
//! Checks that neither panics, and that a parsed capability is canonical:
//! `to_json` then `from_json` gives it back, and `to_json` is a fixed point.
#![no_main]

use std::sync::LazyLock;

use libfuzzer_sys::fuzz_target;
use nuwa_caps::{Capability, verify_capability};
use nuwa_fuzz::{NOW_UNIX_SECS, master};

static ADMIN: LazyLock<[u8; 32]> = LazyLock::new(|| master().public());

fuzz_target!(|data: &[u8]| {
    let Ok(cap) = Capability::from_json(data) else {
        return;
    };
    let json = cap.to_json();
    let again = Capability::from_json(&json).expect("to_json output parses");
    assert_eq!(again, cap, "from_json(to_json(cap)) differs");
    assert_eq!(again.to_json(), json, "to_json is not a fixed point");
    let is_admin = |k: &[u8; 32]| *k == *ADMIN;
    let _ = verify_capability(&cap, NOW_UNIX_SECS, is_admin, |_| false);
    let _ = verify_capability(&cap, cap.expires_unix_secs() - 1, is_admin, |_| false);
    let _ = verify_capability(&cap, i64::MIN, |_| true, |_| true);
    let _ = verify_capability(&cap, i64::MAX, |_| true, |_| false);
});
