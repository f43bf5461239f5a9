//! Fuzzes opening envelopes: the input is decoded as a `Frame`, and an
//! `Envelope` is opened with `nuwa_crypto::open` under the fixed epoch-0 sync
//! key, the fixed device's public key and the fixed agent DID.
//!
//! A fuzzer cannot forge the signature, so nearly every input must end in an
//! error (wrong epoch, bad signature); what is checked is that no field,
//! however odd, makes `open` panic. The envelope is also opened under a
//! public key taken from the input, which reaches Ed25519's handling of
//! invalid and small-order keys. Whatever opens is decoded as a
//! `SyncPayload`, as the node does next.
#![no_main]

use std::sync::LazyLock;

use libfuzzer_sys::fuzz_target;
use nuwa_crypto::{SyncKey, open};
use nuwa_fuzz::{SYNC_KEY_BYTES, agent_did, device, sync_key};
use nuwa_proto::{Frame, SyncPayload};

struct Fixture {
    key: SyncKey,
    public: [u8; 32],
    did: String,
}

static FIXTURE: LazyLock<Fixture> = LazyLock::new(|| Fixture {
    key: sync_key(),
    public: device().public(),
    did: agent_did(),
});

fuzz_target!(|data: &[u8]| {
    let Ok(Frame::Envelope(env)) = Frame::decode(data) else {
        return;
    };
    let f = &*FIXTURE;
    if let Ok(plaintext) = open(&env, &f.key, &f.public, &f.did) {
        let _ = SyncPayload::decode(&plaintext);
    }
    // The same envelope under a key the input chose, at the envelope's own
    // epoch, so the signature check runs even for odd epochs.
    if let Some(public) = env
        .ciphertext
        .get(..32)
        .and_then(|b| <[u8; 32]>::try_from(b).ok())
    {
        let key = SyncKey::from_bytes(env.epoch, SYNC_KEY_BYTES);
        let _ = open(&env, &key, &public, &f.did);
    }
});
