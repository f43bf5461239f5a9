//! Fuzzes the keeper (`nuwa-keeper`) behind its decoder: what a device, or
//! an attacker posing as one, can send it.
//!
//! - The whole input as a `Frame`; a decoded `KeeperRequest` goes to a
//!   keeper that already knows the fixed agent (so requests get past the
//!   "unknown agent" check into signatures, nonces and envelopes).
//! - The input as the body of a request *validly signed* by the fixed
//!   device: the first byte picks push or pull; for a push the rest is split
//!   into a DID log (JSON) and envelopes (each decoded from its protobuf
//!   bytes), so fuzzed logs and envelopes reach the log merge and the
//!   envelope signature check.
//!
//! The keeper must answer every request (a refusal is an answer) and never
//! panic. Its store is in memory (`MemKeeperStore`) for the whole run: what
//! is fuzzed is the keeper's checks, not sled.
#![no_main]

use std::sync::{Mutex, OnceLock};

use libfuzzer_sys::fuzz_target;
use nuwa_fuzz::{NOW_UNIX_SECS_U64, agent_did, chain_with_device, device, device_context_id};
use nuwa_keeper::{Keeper, KeeperConfig, MemKeeperStore, sign_request};
use nuwa_proto::Frame;
use nuwa_proto::keeper::{KeeperBody, KeeperResponse, envelope_from_bytes};

const NOW_MS: u64 = NOW_UNIX_SECS_U64 * 1000;

fn keeper() -> &'static Mutex<Keeper> {
    static K: OnceLock<Mutex<Keeper>> = OnceLock::new();
    K.get_or_init(|| {
        let mut k = Keeper::new(Box::new(MemKeeperStore::new()), KeeperConfig::default());
        // Teach it the fixed agent, as a first push would.
        let body = KeeperBody::Push {
            did_proof: chain_with_device().proof().encode().expect("proof json"),
            envelopes: Vec::new(),
            replaces_through: 0,
            membership: Default::default(),
        };
        let req = sign_request(
            &device(),
            &device_context_id(),
            &agent_did(),
            1,
            body,
            NOW_MS,
        )
        .expect("randomness");
        let r = k.handle(req, NOW_MS);
        assert!(matches!(r, KeeperResponse::Pushed { .. }), "{r:?}");
        Mutex::new(k)
    })
}

fuzz_target!(|data: &[u8]| {
    let mut k = keeper().lock().unwrap_or_else(|e| e.into_inner());
    if let Ok(Frame::KeeperRequest(req)) = Frame::decode(data) {
        let _ = k.handle(*req, NOW_MS);
    }
    let Some((&kind, rest)) = data.split_first() else {
        return;
    };
    let body = if kind & 1 == 0 {
        let since = rest
            .get(..8)
            .map(|b| u64::from_be_bytes(b.try_into().unwrap_or([0; 8])))
            .unwrap_or(0);
        let max = rest
            .get(8..12)
            .map(|b| u32::from_be_bytes(b.try_into().unwrap_or([0; 4])))
            .unwrap_or(0);
        KeeperBody::Pull {
            since,
            max_bytes: max,
            have_head: String::new(),
            have_epoch: 0,
        }
    } else {
        // `log ‖ 0xff ‖ envelope ‖ 0xff ‖ envelope ...`
        let mut parts = rest.split(|b| *b == 0xff);
        let did_proof = parts.next().unwrap_or_default().to_vec();
        let envelopes = parts
            .take(16)
            .filter_map(|p| envelope_from_bytes(p).ok())
            .collect();
        KeeperBody::Push {
            did_proof,
            envelopes,
            replaces_through: rest.len() as u64 % 4,
            membership: Default::default(),
        }
    };
    if let Ok(req) = sign_request(
        &device(),
        &device_context_id(),
        &agent_did(),
        2,
        body,
        NOW_MS,
    ) {
        let _ = k.handle(req, NOW_MS);
    }
});
