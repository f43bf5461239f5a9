//! Fuzzes epoch grants: `EpochGrant::decode`, then `verify` against the
//! master key and `open_for` as the fixed device (and as every listed
//! recipient) with the device's X25519 secret.
//!
//! Checks that none of them panics, and that the encoding is canonical: a
//! grant that decodes encodes back to exactly the input bytes, as the crate
//! promises one encoding per grant.
#![no_main]

use std::sync::LazyLock;

use libfuzzer_sys::fuzz_target;
use nuwa_crypto::epoch::EpochGrant;
use nuwa_fuzz::{device, device_context_id, master};

/// Recipients opened per input beyond the fixed device; each costs an X25519
/// exchange.
const MAX_RECIPIENTS_OPENED: usize = 4;

struct Fixture {
    issuer_public: [u8; 32],
    context_id: String,
    x25519_secret: [u8; 32],
}

static FIXTURE: LazyLock<Fixture> = LazyLock::new(|| Fixture {
    issuer_public: master().public(),
    context_id: device_context_id(),
    // A fixed test key, so keeping it in a plain array is fine here.
    x25519_secret: *device().x25519_secret(),
});

fuzz_target!(|data: &[u8]| {
    let Ok(grant) = EpochGrant::decode(data) else {
        return;
    };
    let f = &*FIXTURE;
    let _ = grant.verify(&f.issuer_public);
    let _ = grant.open_for(&f.context_id, &f.x25519_secret);
    for ctx in grant.recipients().take(MAX_RECIPIENTS_OPENED) {
        let _ = grant.open_for(ctx, &f.x25519_secret);
    }
    let encoded = grant.encode();
    assert_eq!(
        encoded.ok().as_deref(),
        Some(data),
        "a decoded grant must encode back to its input"
    );
});
