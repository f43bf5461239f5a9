//! Fuzzes the pairing messages of `nuwa_crypto::pairing` and the code parser.
//!
//! The first input byte selects the decoder for the rest (see
//! `nuwa_fuzz::pairing_selector`): `JoinRequest`, `ApproverConfirm`,
//! `JoinerConfirm` or `Grant`. A message that decodes must encode back to the
//! same bytes, and is then fed to the state machine that receives it in a
//! real session (an approver gets the join request, a joiner that has started
//! gets the approver's confirmation), which runs SPAKE2 on the attacker's
//! group element. Independently, the whole input is parsed as a typed
//! `PairingCode` when it is UTF-8.
#![no_main]

use libfuzzer_sys::fuzz_target;
use nuwa_crypto::pairing::{
    Approver, ApproverConfirm, Grant, JoinRequest, Joiner, JoinerConfirm, JoinerPublicKeys,
    PairingCode,
};
use nuwa_fuzz::pairing_selector::{APPROVER_CONFIRM, GRANT, JOIN_REQUEST, JOINER_CONFIRM};
use nuwa_fuzz::{APPROVER_PEER_ID, JOINER_PEER_ID, NOW_UNIX_SECS_U64, PAIRING_CODE, device};

fn fixed_code() -> Option<PairingCode> {
    PairingCode::parse(PAIRING_CODE).ok()
}

fuzz_target!(|data: &[u8]| {
    if let Ok(text) = std::str::from_utf8(data) {
        if let Ok(code) = PairingCode::parse(text) {
            let shown = code.to_string();
            let again = PairingCode::parse(&shown).map(|c| c.to_string());
            assert_eq!(
                again.ok().as_deref(),
                Some(shown.as_str()),
                "code round trip"
            );
            let _ = code.nameplate();
        }
    }

    let Some((&selector, body)) = data.split_first() else {
        return;
    };
    match selector {
        JOIN_REQUEST => {
            let Ok(request) = JoinRequest::decode(body) else {
                return;
            };
            assert_eq!(request.encode(), body, "join request round trip");
            let Some(code) = fixed_code() else { return };
            if let Ok(mut approver) = Approver::new(code, APPROVER_PEER_ID, JOINER_PEER_ID) {
                let _ = approver.on_join_request(&request, NOW_UNIX_SECS_U64);
            }
        }
        APPROVER_CONFIRM => {
            let Ok(confirm) = ApproverConfirm::decode(body) else {
                return;
            };
            assert_eq!(confirm.encode(), body, "approver confirmation round trip");
            let Some(code) = fixed_code() else { return };
            let public = device().public();
            let keys = JoinerPublicKeys {
                ed25519_public: public,
                x25519_public: public,
            };
            if let Ok(mut joiner) = Joiner::new(code, JOINER_PEER_ID, keys, "fuzz") {
                if joiner.start(APPROVER_PEER_ID, NOW_UNIX_SECS_U64).is_ok() {
                    let _ = joiner.on_approver_confirm(&confirm, NOW_UNIX_SECS_U64);
                }
            }
        }
        JOINER_CONFIRM => {
            if let Ok(confirm) = JoinerConfirm::decode(body) {
                assert_eq!(confirm.encode(), body, "joiner confirmation round trip");
            }
        }
        GRANT => {
            if let Ok(grant) = Grant::decode(body) {
                assert_eq!(grant.encode(), body, "grant round trip");
            }
        }
        _ => {}
    }
});
