//! Fuzzes a page of DID chain entries as a peer answers a
//! `DidEntriesRequest` (protocol 2): `nuwa_sync::membership::parse_entries`,
//! then `DidChain::splice` onto two valid chains of the fixed agent (its
//! genesis, and the genesis plus one device as a v2 entry), then `merge` of
//! the spliced chain into the chain it was spliced onto.
//!
//! Checks that none of it panics, that a page is never longer than its
//! bound, that a merge which fails (or keeps ours) leaves our chain
//! unchanged, and that a chain a merge adopted verifies in full.
#![no_main]

use std::sync::LazyLock;

use libfuzzer_sys::fuzz_target;
use nuwa_fuzz::{NOW_UNIX_SECS, agent_did, chain_with_device, genesis_log};
use nuwa_identity::chain::{DidChain, MAX_SPLICE_ENTRIES};
use nuwa_sync::membership::parse_entries;

static CHAINS: LazyLock<[DidChain; 2]> = LazyLock::new(|| {
    // Constant inputs: a failure here is a harness bug, not a finding.
    [
        DidChain::from_v1(&genesis_log()).expect("the genesis log converts"),
        chain_with_device(),
    ]
});

fuzz_target!(|data: &[u8]| {
    let Ok(entries) = parse_entries(data) else {
        return;
    };
    assert!(entries.len() <= MAX_SPLICE_ENTRIES, "page bound");
    for ours in CHAINS.iter() {
        let Ok(Some(candidate)) = ours.splice(&entries) else {
            continue;
        };
        let mut merged = ours.clone();
        match merged.merge(&candidate, NOW_UNIX_SECS) {
            Ok(outcome) if outcome.changed() => {
                assert_eq!(&merged, &candidate, "adopted what was spliced");
                merged
                    .verify(Some(&agent_did()), NOW_UNIX_SECS)
                    .expect("an adopted chain verifies");
            }
            Ok(_) | Err(_) => assert_eq!(&merged, ours, "our chain is unchanged"),
        }
    }
});
