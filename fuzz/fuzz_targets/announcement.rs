//! Fuzzes the mDNS announcement parser: the input is split into TXT entries
//! (entries on `0x00`, key and value on the first `=`, see
//! `nuwa_fuzz::txt_pairs`), parsed with `Announcement::from_txt` and, if it
//! parses, verified against the fixed device key.
//!
//! Checks that parsing and verifying never panic, and that a parsed
//! announcement is canonical: `to_txt` then `from_txt` gives it back.
#![no_main]

use std::sync::LazyLock;

use libfuzzer_sys::fuzz_target;
use nuwa_agent::announce::Announcement;
use nuwa_fuzz::{NOW_UNIX_SECS, agent_did, device, txt_pairs};

static PUBLIC: LazyLock<[u8; 32]> = LazyLock::new(|| device().public());
static DID: LazyLock<String> = LazyLock::new(agent_did);

fuzz_target!(|data: &[u8]| {
    let Ok(ann) = Announcement::from_txt(txt_pairs(data)) else {
        return;
    };
    // At the announcement's own time (so the signature check is reached),
    // at the fixed clock, and with the extreme windows a caller might pass.
    let _ = ann.verify(&PUBLIC, ann.timestamp_unix_secs, 120);
    let _ = ann.verify(&PUBLIC, NOW_UNIX_SECS, 120);
    let _ = ann.verify(&PUBLIC, i64::MIN, i64::MAX);
    let _ = ann.verify(&PUBLIC, i64::MAX, -1);
    let _ = ann.matches_agent(&DID);
    let _ = format!("{ann:?}");

    let again = Announcement::from_txt(ann.to_txt());
    assert_eq!(again.ok().as_ref(), Some(&ann), "txt round trip");
});
