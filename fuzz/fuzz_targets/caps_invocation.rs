//! Fuzzes signed-request verification (`nuwa-caps`): the input holds the
//! values of the four headers in `nuwa_fuzz::CAPS_HEADERS` order, separated
//! by `0x00`, then the body; `verify_invocation` checks them as a POST to
//! `CAPS_PATH` at the fixed clock, with the fixed master key as the only
//! admin. The seeds are valid requests, so mutations reach every check.
//!
//! Checks that verification never panics, that an accepted request is
//! refused as a replay the second time, and that the nonce cache only
//! grows by accepted requests.
#![no_main]

use std::sync::LazyLock;

use libfuzzer_sys::fuzz_target;
use nuwa_caps::{NonceCache, RequestParts, verify_invocation};
use nuwa_fuzz::{CAPS_HEADERS, CAPS_PATH, NOW_UNIX_SECS, master};

static ADMIN: LazyLock<[u8; 32]> = LazyLock::new(|| master().public());

fuzz_target!(|data: &[u8]| {
    let mut parts = data.splitn(CAPS_HEADERS.len() + 1, |b| *b == 0);
    let values: Vec<String> = CAPS_HEADERS
        .iter()
        .map(|_| String::from_utf8_lossy(parts.next().unwrap_or_default()).into_owned())
        .collect();
    let body = parts.next().unwrap_or_default();
    let req = RequestParts {
        method: "POST",
        path: CAPS_PATH,
        query: "",
        header: |name: &str| {
            CAPS_HEADERS
                .iter()
                .position(|h| *h == name)
                .map(|i| values[i].as_str())
        },
    };
    let is_admin = |k: &[u8; 32]| *k == *ADMIN;
    let mut nonces = NonceCache::with_capacity(4);
    let first = verify_invocation(&req, body, NOW_UNIX_SECS, is_admin, |_| false, &mut nonces);
    assert_eq!(nonces.len(), usize::from(first.is_ok()));
    if first.is_ok() {
        let again = verify_invocation(&req, body, NOW_UNIX_SECS, is_admin, |_| false, &mut nonces);
        assert_eq!(again.map_err(|e| e.code()).err(), Some("replayed_nonce"));
    }
});
