//! Behaviour of device pairing through its public API: the happy path, wrong codes on either
//! side, tampering with every field of every message, replay, splicing, out-of-order calls,
//! code parsing, the attempt limiter, size caps, and a seeded random-input loop.

use nuwa_crypto::pairing::{
    Approver, ApproverConfirm, AttemptLimiter, DEFAULT_CODE_TTL_SECS, Grant, JoinRequest, Joiner,
    JoinerConfirm, JoinerOutcome, JoinerPublicKeys, LimiterConfig, MAX_GRANT_PLAINTEXT_BYTES,
    MAX_MESSAGE_BYTES, PairingCode, PairingError,
};

const NOW: u64 = 1_767_225_600;
const APPROVER: &str = "12D3KooWApproverAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA";
const JOINER: &str = "12D3KooWJoinerBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBB";
const OTHER: &str = "12D3KooWMalloryCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCC";
const NAME: &str = "laptop";
const PLAINTEXT: &[u8] = b"signed did log update || sync key";

fn keys() -> JoinerPublicKeys {
    JoinerPublicKeys {
        ed25519_public: [0xED; 32],
        x25519_public: [0x25; 32],
    }
}

fn code(text: &str) -> PairingCode {
    PairingCode::parse(text).expect("test code parses")
}

/// Who binds which identities and which codes, for one session.
struct Setup {
    joiner_code: PairingCode,
    approver_code: PairingCode,
    /// The joiner's own PeerId and the approver it sees on the connection.
    joiner_self: &'static str,
    joiner_sees: &'static str,
    /// The approver's own PeerId and the joiner it sees on the connection.
    approver_self: &'static str,
    approver_sees: &'static str,
}

impl Setup {
    fn honest() -> Self {
        Self::with_codes("ABCD-EFGH", "abcd efgh")
    }

    fn with_codes(joiner: &str, approver: &str) -> Self {
        Self {
            joiner_code: code(joiner),
            approver_code: code(approver),
            joiner_self: JOINER,
            joiner_sees: APPROVER,
            approver_self: APPROVER,
            approver_sees: JOINER,
        }
    }

    fn joiner(&self) -> Joiner {
        Joiner::new(self.joiner_code.clone(), self.joiner_self, keys(), NAME).expect("joiner")
    }

    fn approver(&self) -> Approver {
        Approver::new(
            self.approver_code.clone(),
            self.approver_self,
            self.approver_sees,
        )
        .expect("approver")
    }
}

/// How a session ended.
#[derive(Debug)]
enum End {
    Granted(Vec<u8>),
    JoinerFailed(PairingError),
    ApproverFailed(PairingError),
}

/// The four messages in order, by index into `mutate`.
const JOIN_REQUEST: usize = 0;
const APPROVER_CONFIRM: usize = 1;
const JOINER_CONFIRM: usize = 2;
const GRANT: usize = 3;

/// Runs one session through encoded bytes; `mutate` may alter message `i` in flight. Also
/// checks that the approver produces no grant once it has failed.
fn run(setup: &Setup, mut mutate: impl FnMut(usize, &mut Vec<u8>)) -> End {
    let mut joiner = setup.joiner();
    let mut approver = setup.approver();

    let mut bytes = joiner
        .start(setup.joiner_sees, NOW)
        .expect("start")
        .encode();
    mutate(JOIN_REQUEST, &mut bytes);
    let confirm =
        match JoinRequest::decode(&bytes).and_then(|req| approver.on_join_request(&req, NOW)) {
            Ok(confirm) => confirm,
            Err(e) => return approver_failed(&mut approver, e),
        };

    let mut bytes = confirm.encode();
    mutate(APPROVER_CONFIRM, &mut bytes);
    let reply =
        match ApproverConfirm::decode(&bytes).and_then(|c| joiner.on_approver_confirm(&c, NOW)) {
            Ok(reply) => reply,
            Err(e) => return End::JoinerFailed(e),
        };

    let mut bytes = reply.encode();
    mutate(JOINER_CONFIRM, &mut bytes);
    let verified =
        match JoinerConfirm::decode(&bytes).and_then(|c| approver.on_joiner_confirm(&c, NOW)) {
            Ok(verified) => verified,
            Err(e) => return approver_failed(&mut approver, e),
        };
    assert_eq!(verified.peer_id, JOINER);
    assert_eq!(verified.ed25519_public, keys().ed25519_public);
    assert_eq!(verified.x25519_public, keys().x25519_public);
    assert_eq!(verified.name, NAME);

    let mut bytes = approver.grant(PLAINTEXT).expect("grant").encode();
    mutate(GRANT, &mut bytes);
    match Grant::decode(&bytes).and_then(|g| joiner.on_grant(&g)) {
        Ok(JoinerOutcome::Granted(plaintext)) => End::Granted(plaintext.to_vec()),
        Ok(other) => panic!("unexpected outcome {other:?}"),
        Err(e) => End::JoinerFailed(e),
    }
}

fn approver_failed(approver: &mut Approver, e: PairingError) -> End {
    assert!(
        matches!(
            approver.grant(PLAINTEXT),
            Err(PairingError::UnexpectedMessage { .. })
        ),
        "a failed approver must not grant"
    );
    End::ApproverFailed(e)
}

/// Goal: an honest session delivers the grant plaintext unchanged; method: run it through
/// encoded bytes with no interference, with a small and a maximal plaintext.
#[test]
fn happy_path_round_trips_the_grant() {
    match run(&Setup::honest(), |_, _| {}) {
        End::Granted(plaintext) => assert_eq!(plaintext, PLAINTEXT),
        other => panic!("expected a grant, got {other:?}"),
    }

    // The largest grant also fits the message cap.
    let setup = Setup::honest();
    let mut joiner = setup.joiner();
    let mut approver = setup.approver();
    let req = joiner.start(APPROVER, NOW).expect("start");
    let confirm = approver.on_join_request(&req, NOW).expect("confirm");
    let reply = joiner.on_approver_confirm(&confirm, NOW).expect("reply");
    approver.on_joiner_confirm(&reply, NOW).expect("verified");
    let big = vec![0xABu8; MAX_GRANT_PLAINTEXT_BYTES];
    let bytes = approver.grant(&big).expect("grant").encode();
    assert_eq!(bytes.len(), MAX_MESSAGE_BYTES);
    match joiner
        .on_grant(&Grant::decode(&bytes).expect("decode"))
        .expect("opens")
    {
        JoinerOutcome::Granted(p) => assert_eq!(*p, big),
        other => panic!("unexpected outcome {other:?}"),
    }
}

/// Goal: a wrong code fails closed on both sides; method: the joiner rejects the approver's
/// confirmation, and an approver given a forged joiner MAC rejects it and will not grant.
#[test]
fn wrong_code_fails_on_both_sides() {
    let setup = Setup::with_codes("ABCD-EFGH", "ABCD-EFGJ");
    match run(&setup, |_, _| {}) {
        End::JoinerFailed(e) => {
            assert!(matches!(e, PairingError::WrongCode), "{e:?}");
            assert!(e.counts_as_failed_attempt());
            assert!(
                e.to_string()
                    .contains("check the code shown on the new device")
            );
        }
        other => panic!("expected the joiner to reject, got {other:?}"),
    }

    // A joiner that does not know the code can only guess the MAC.
    let mut joiner = setup.joiner();
    let mut approver = setup.approver();
    let req = joiner.start(APPROVER, NOW).expect("start");
    approver.on_join_request(&req, NOW).expect("confirm");
    let mut forged = vec![1u8, 3];
    forged.extend_from_slice(&[0x5A; 32]);
    let forged = JoinerConfirm::decode(&forged).expect("well-formed");
    assert!(matches!(
        approver.on_joiner_confirm(&forged, NOW),
        Err(PairingError::WrongCode)
    ));
    assert!(matches!(
        approver.grant(PLAINTEXT),
        Err(PairingError::UnexpectedMessage { .. })
    ));
}

fn is_malformed(end: &End) -> bool {
    matches!(
        end,
        End::ApproverFailed(PairingError::Malformed { .. })
            | End::JoinerFailed(PairingError::Malformed { .. })
    )
}

/// Goal: altering any field of any message ends the session with a typed error and no
/// grant; method: flip one bit at the first and last byte of every field in flight, plus
/// truncation and an extra byte, and check the side and kind of error against a table.
#[test]
fn tampering_with_any_field_fails() {
    type Check = fn(&End) -> bool;
    let unsupported_at_approver: Check = |e| {
        matches!(
            e,
            End::ApproverFailed(PairingError::UnsupportedVersion { version: 0, .. })
        )
    };
    let unsupported_at_joiner: Check = |e| {
        matches!(
            e,
            End::JoinerFailed(PairingError::UnsupportedVersion { version: 0, .. })
        )
    };
    let malformed_at_approver: Check =
        |e| matches!(e, End::ApproverFailed(PairingError::Malformed { .. }));
    let malformed_at_joiner: Check =
        |e| matches!(e, End::JoinerFailed(PairingError::Malformed { .. }));
    let wrong_code_at_joiner: Check = |e| matches!(e, End::JoinerFailed(PairingError::WrongCode));
    let wrong_code_at_approver: Check =
        |e| matches!(e, End::ApproverFailed(PairingError::WrongCode));
    // A flipped point byte either leaves no valid point (refused on decode of the curve point)
    // or gives another point, and so another key, which the joiner's MAC check catches.
    let point: Check =
        |e| is_malformed(e) || matches!(e, End::JoinerFailed(PairingError::WrongCode));
    let grant_rejected: Check = |e| matches!(e, End::JoinerFailed(PairingError::GrantRejected));

    // (message, field, byte offsets, expected)
    let name_at = 2 + 33 + 32 + 32;
    let cases: &[(usize, &str, &[usize], Check)] = &[
        (JOIN_REQUEST, "version", &[0], unsupported_at_approver),
        (JOIN_REQUEST, "kind", &[1], malformed_at_approver),
        (JOIN_REQUEST, "spake side", &[2], malformed_at_approver),
        (JOIN_REQUEST, "spake point", &[3, 34], point),
        (JOIN_REQUEST, "ed25519 key", &[35, 66], wrong_code_at_joiner),
        (JOIN_REQUEST, "x25519 key", &[67, 98], wrong_code_at_joiner),
        (
            JOIN_REQUEST,
            "name length",
            &[name_at],
            malformed_at_approver,
        ),
        (
            JOIN_REQUEST,
            "name",
            &[name_at + 1, name_at + NAME.len()],
            wrong_code_at_joiner,
        ),
        (APPROVER_CONFIRM, "version", &[0], unsupported_at_joiner),
        (APPROVER_CONFIRM, "kind", &[1], malformed_at_joiner),
        (APPROVER_CONFIRM, "spake side", &[2], malformed_at_joiner),
        (APPROVER_CONFIRM, "spake point", &[3, 34], point),
        (APPROVER_CONFIRM, "mac", &[35, 66], wrong_code_at_joiner),
        (JOINER_CONFIRM, "version", &[0], unsupported_at_approver),
        (JOINER_CONFIRM, "kind", &[1], malformed_at_approver),
        (JOINER_CONFIRM, "mac", &[2, 33], wrong_code_at_approver),
        (GRANT, "version", &[0], unsupported_at_joiner),
        (GRANT, "kind", &[1], malformed_at_joiner),
        (GRANT, "nonce", &[2, 25], grant_rejected),
        (GRANT, "length", &[26, 29], malformed_at_joiner),
        (GRANT, "ciphertext", &[30], grant_rejected),
        (GRANT, "tag (last byte)", &[usize::MAX], grant_rejected),
    ];
    for &(message, field, offsets, expected) in cases {
        for &offset in offsets {
            let end = run(&Setup::honest(), |i, bytes| {
                if i == message {
                    let at = offset.min(bytes.len() - 1);
                    bytes[at] ^= 0x01;
                }
            });
            assert!(
                expected(&end),
                "message {message} field {field} offset {offset}: got {end:?}"
            );
        }
    }

    for message in [JOIN_REQUEST, APPROVER_CONFIRM, JOINER_CONFIRM, GRANT] {
        let truncated = run(&Setup::honest(), |i, bytes| {
            if i == message {
                bytes.pop();
            }
        });
        assert!(
            is_malformed(&truncated),
            "message {message} truncated: {truncated:?}"
        );
        let extended = run(&Setup::honest(), |i, bytes| {
            if i == message {
                bytes.push(0);
            }
        });
        // The fixed-size confirmations are over their cap with one byte more.
        let refused = is_malformed(&extended)
            || matches!(
                extended,
                End::ApproverFailed(PairingError::Oversized { .. })
                    | End::JoinerFailed(PairingError::Oversized { .. })
            );
        assert!(refused, "message {message} extended: {extended:?}");
    }
}

/// Goal: messages from an earlier session are useless in a later one; method: record a full
/// session, then feed its approver confirmation, joiner confirmation and grant to fresh
/// sessions between the same devices with the same code.
#[test]
fn replayed_messages_fail_in_a_new_session() {
    let setup = Setup::honest();
    let mut old: Vec<Vec<u8>> = Vec::new();
    assert!(matches!(
        run(&setup, |_, bytes| old.push(bytes.clone())),
        End::Granted(_)
    ));

    // Old approver confirmation to a new joiner.
    let mut joiner = setup.joiner();
    joiner.start(APPROVER, NOW).expect("start");
    let replay = ApproverConfirm::decode(&old[APPROVER_CONFIRM]).expect("decode");
    assert!(matches!(
        joiner.on_approver_confirm(&replay, NOW),
        Err(PairingError::WrongCode)
    ));

    // Old join request and joiner confirmation to a new approver.
    let mut approver = setup.approver();
    let replay_req = JoinRequest::decode(&old[JOIN_REQUEST]).expect("decode");
    approver.on_join_request(&replay_req, NOW).expect("confirm");
    let replay = JoinerConfirm::decode(&old[JOINER_CONFIRM]).expect("decode");
    assert!(matches!(
        approver.on_joiner_confirm(&replay, NOW),
        Err(PairingError::WrongCode)
    ));

    // Old grant to a new joiner that reached the grant step honestly.
    let mut joiner = setup.joiner();
    let mut approver = setup.approver();
    let req = joiner.start(APPROVER, NOW).expect("start");
    let confirm = approver.on_join_request(&req, NOW).expect("confirm");
    joiner.on_approver_confirm(&confirm, NOW).expect("reply");
    let replay = Grant::decode(&old[GRANT]).expect("decode");
    assert!(matches!(
        joiner.on_grant(&replay),
        Err(PairingError::GrantRejected)
    ));
}

/// Goal: a relay cannot splice sessions between different devices; method: run sessions in
/// which the approver binds another joiner PeerId, or the joiner another approver PeerId,
/// than the peer actually at the other end, with the right code.
#[test]
fn splicing_peer_ids_fails() {
    let mut approver_bound_elsewhere = Setup::honest();
    approver_bound_elsewhere.approver_sees = OTHER;
    let mut joiner_bound_elsewhere = Setup::honest();
    joiner_bound_elsewhere.joiner_sees = OTHER;
    let mut roles_swapped = Setup::honest();
    roles_swapped.joiner_sees = JOINER;
    roles_swapped.joiner_self = APPROVER;
    for (label, setup) in [
        ("approver bound to another joiner", approver_bound_elsewhere),
        ("joiner bound to another approver", joiner_bound_elsewhere),
        ("identities swapped", roles_swapped),
    ] {
        match run(&setup, |_, _| {}) {
            End::JoinerFailed(PairingError::WrongCode) => {}
            other => panic!("{label}: expected the joiner to reject, got {other:?}"),
        }
    }
}

/// Goal: every step called out of order is refused and ends the session; method: call each
/// step of both state machines in each wrong state.
#[test]
fn out_of_order_calls_are_refused() {
    let setup = Setup::honest();
    let unexpected = |r: Result<(), PairingError>| {
        assert!(
            matches!(r, Err(PairingError::UnexpectedMessage { .. })),
            "{r:?}"
        );
    };

    // Collect one genuine message of each kind to feed at the wrong time.
    let mut msgs: Vec<Vec<u8>> = Vec::new();
    assert!(matches!(
        run(&setup, |_, b| msgs.push(b.clone())),
        End::Granted(_)
    ));
    let req = JoinRequest::decode(&msgs[JOIN_REQUEST]).expect("decode");
    let confirm = ApproverConfirm::decode(&msgs[APPROVER_CONFIRM]).expect("decode");
    let reply = JoinerConfirm::decode(&msgs[JOINER_CONFIRM]).expect("decode");
    let grant = Grant::decode(&msgs[GRANT]).expect("decode");

    // Joiner before start.
    let mut j = setup.joiner();
    unexpected(j.on_approver_confirm(&confirm, NOW).map(drop));
    let mut j = setup.joiner();
    unexpected(j.on_grant(&grant).map(drop));
    // Joiner started twice, or given a grant before confirming.
    let mut j = setup.joiner();
    j.start(APPROVER, NOW).expect("start");
    unexpected(j.start(APPROVER, NOW).map(drop));
    unexpected(j.on_approver_confirm(&confirm, NOW).map(drop)); // session already failed
    let mut j = setup.joiner();
    j.start(APPROVER, NOW).expect("start");
    unexpected(j.on_grant(&grant).map(drop));

    // Approver before the join request.
    let mut a = setup.approver();
    unexpected(a.on_joiner_confirm(&reply, NOW).map(drop));
    let mut a = setup.approver();
    unexpected(a.grant(PLAINTEXT).map(drop));
    // Approver given two join requests, or asked to grant before the joiner confirmed.
    let mut a = setup.approver();
    a.on_join_request(&req, NOW).expect("confirm");
    unexpected(a.on_join_request(&req, NOW).map(drop));
    let mut a = setup.approver();
    a.on_join_request(&req, NOW).expect("confirm");
    unexpected(a.grant(PLAINTEXT).map(drop));

    // Both sides after finishing.
    let mut j = setup.joiner();
    let mut a = setup.approver();
    let r = j.start(APPROVER, NOW).expect("start");
    let c = a.on_join_request(&r, NOW).expect("confirm");
    let rc = j.on_approver_confirm(&c, NOW).expect("reply");
    a.on_joiner_confirm(&rc, NOW).expect("verified");
    let g = a.grant(PLAINTEXT).expect("grant");
    j.on_grant(&g).expect("granted");
    unexpected(a.grant(PLAINTEXT).map(drop));
    unexpected(a.on_joiner_confirm(&rc, NOW).map(drop));
    unexpected(j.on_grant(&g).map(drop));
    unexpected(j.start(APPROVER, NOW).map(drop));
}

/// Goal: codes expire on both sides; method: generate a code at NOW, then drive each step
/// at or after its expiry.
#[test]
fn expired_codes_are_refused() {
    let fresh = PairingCode::generate(NOW).expect("generate");
    assert_eq!(fresh.expires_at_unix_secs(), NOW + DEFAULT_CODE_TTL_SECS);
    let expiry = NOW + DEFAULT_CODE_TTL_SECS;

    let mut joiner = Joiner::new(fresh.clone(), JOINER, keys(), NAME).expect("joiner");
    assert!(matches!(
        joiner.start(APPROVER, expiry),
        Err(PairingError::Expired)
    ));

    // Started in time, confirmed too late.
    let typed = code(&fresh.to_string()).with_expiry(expiry);
    let mut joiner = Joiner::new(fresh.clone(), JOINER, keys(), NAME).expect("joiner");
    let mut approver = Approver::new(typed.clone(), APPROVER, JOINER).expect("approver");
    let req = joiner.start(APPROVER, expiry - 1).expect("start");
    let confirm = approver.on_join_request(&req, expiry - 1).expect("confirm");
    assert!(matches!(
        joiner.on_approver_confirm(&confirm, expiry),
        Err(PairingError::Expired)
    ));

    let mut approver = Approver::new(typed.clone(), APPROVER, JOINER).expect("approver");
    assert!(matches!(
        approver.on_join_request(&req, expiry + 1),
        Err(PairingError::Expired)
    ));

    // A typed code never expires unless told to.
    let typed_forever = code(&fresh.to_string());
    assert_eq!(typed_forever.expires_at_unix_secs(), u64::MAX);
    assert!(!typed_forever.is_expired(u64::MAX - 1));
}

/// Goal: parsing is lenient about case and separators and strict about everything else, and
/// display is `XXXX-XXXX`; method: a table of inputs with their expected result.
#[test]
fn code_parse_and_format_table() {
    let long = "A".repeat(100);
    let cases: &[(&str, Result<&str, &str>)] = &[
        ("ABCD-EFGH", Ok("ABCD-EFGH")),
        ("abcd-efgh", Ok("ABCD-EFGH")),
        ("ABCDEFGH", Ok("ABCD-EFGH")),
        ("  ab cd\tef-gh ", Ok("ABCD-EFGH")),
        ("a-b-c-d-e-f-g-h", Ok("ABCD-EFGH")),
        ("0123-4567", Ok("0123-4567")),
        ("89YZ-XWVT", Ok("89YZ-XWVT")),
        // Crockford aliases: O reads as 0, I and L as 1.
        ("oIlO-0000", Ok("0110-0000")),
        ("", Err("fewer than 8")),
        ("ABCD-EFG", Err("fewer than 8")),
        ("----", Err("fewer than 8")),
        ("ABCD-EFGHJ", Err("more than 8")),
        ("ABCD-EFGU", Err("contains U")),
        ("ABCD-EF*H", Err("character that pairing codes never use")),
        ("ABCD_EFGH", Err("character that pairing codes never use")),
        ("ÄBCD-EFGH", Err("character that pairing codes never use")),
        (&long, Err("too long")),
    ];
    for (input, expected) in cases {
        match (PairingCode::parse(input), expected) {
            (Ok(code), Ok(display)) => assert_eq!(code.to_string(), *display, "input {input:?}"),
            (Err(e @ PairingError::BadCode { .. }), Err(fragment)) => {
                let message = e.to_string();
                assert!(message.contains(fragment), "input {input:?}: {message}");
                assert!(message.contains("like ABCD-EFGH"), "{message}");
            }
            (got, _) => panic!("input {input:?}: expected {expected:?}, got {got:?}"),
        }
    }

    // Generated codes use only the alphabet, display as XXXX-XXXX, and parse back.
    for _ in 0..200 {
        let code = PairingCode::generate(NOW).expect("generate");
        let shown = code.to_string();
        assert_eq!(shown.len(), 9);
        assert_eq!(&shown[4..5], "-");
        assert!(
            shown
                .chars()
                .filter(|c| *c != '-')
                .all(|c| "0123456789ABCDEFGHJKMNPQRSTVWXYZ".contains(c)),
            "{shown}"
        );
        assert_eq!(
            PairingCode::parse(&shown).expect("parses").to_string(),
            shown
        );
    }
}

/// Goal: no Debug output shows a secret; method: format every type that holds one.
#[test]
fn debug_redacts_secrets() {
    let setup = Setup::honest();
    let shown = format!("{:?}", setup.joiner_code);
    assert!(
        !shown.contains("ABCD") && shown.contains("redacted"),
        "{shown}"
    );
    let mut joiner = setup.joiner();
    let mut approver = setup.approver();
    let req = joiner.start(APPROVER, NOW).expect("start");
    let confirm = approver.on_join_request(&req, NOW).expect("confirm");
    let reply = joiner.on_approver_confirm(&confirm, NOW).expect("reply");
    approver.on_joiner_confirm(&reply, NOW).expect("verified");
    for shown in [format!("{joiner:?}"), format!("{approver:?}")] {
        assert!(!shown.contains("ABCD"), "{shown}");
    }
    let grant = approver.grant(b"TOP-SECRET").expect("grant");
    let outcome = joiner.on_grant(&grant).expect("granted");
    let shown = format!("{outcome:?}");
    assert!(
        !shown.contains("TOP-SECRET") && shown.contains("redacted"),
        "{shown}"
    );
}

/// Goal: three failures burn a code, a success burns it too, and other codes are unaffected;
/// method: drive the limiter directly.
#[test]
fn limiter_burns_a_code_after_three_failures() {
    let mut limiter = AttemptLimiter::default();
    let a = code("AAAA-AAAA");
    let b = code("BBBB-BBBB");
    for expected_left in [2, 1, 0] {
        limiter.begin_attempt(&a, NOW).expect("admitted");
        assert_eq!(limiter.record_failure(&a), expected_left);
    }
    assert_eq!(limiter.remaining_attempts(&a), 0);
    assert!(matches!(
        limiter.begin_attempt(&a, NOW),
        Err(PairingError::CodeBurned)
    ));
    // The same code typed differently is the same code.
    assert!(matches!(
        limiter.begin_attempt(&code("aaaa aaaa"), NOW),
        Err(PairingError::CodeBurned)
    ));
    limiter
        .begin_attempt(&b, NOW)
        .expect("another code is fine");
    limiter.record_success(&b);
    assert!(matches!(
        limiter.begin_attempt(&b, NOW),
        Err(PairingError::CodeBurned)
    ));
    assert_eq!(limiter.remaining_attempts(&b), 0);
}

/// Goal: attempts over all codes are capped per window, and the cap lifts as the window
/// slides; method: 10 attempts at one instant, then probe just before and at the window end.
#[test]
fn limiter_rate_limits_attempts_per_window() {
    let mut limiter = AttemptLimiter::new(LimiterConfig {
        max_attempts_per_window: 10,
        window_secs: 60,
        ..LimiterConfig::default()
    });
    let codes: Vec<PairingCode> = (0..12)
        .map(|i| PairingCode::parse(&format!("0000-00{i:02}")).expect("parses"))
        .collect();
    for c in &codes[..10] {
        limiter.begin_attempt(c, NOW).expect("admitted");
    }
    match limiter.begin_attempt(&codes[10], NOW) {
        Err(
            e @ PairingError::RateLimited {
                retry_after_secs: 60,
            },
        ) => {
            assert!(e.to_string().contains("wait 60 s"), "{e}");
        }
        other => panic!("expected a rate limit, got {other:?}"),
    }
    // A clock that steps backwards does not panic, and the cap still holds.
    assert!(matches!(
        limiter.begin_attempt(&codes[11], NOW - 1_000),
        Err(PairingError::RateLimited {
            retry_after_secs: 1_060
        })
    ));
    assert!(matches!(
        limiter.begin_attempt(&codes[10], NOW + 59),
        Err(PairingError::RateLimited {
            retry_after_secs: 1
        })
    ));
    limiter
        .begin_attempt(&codes[10], NOW + 60)
        .expect("window slid");
}

/// Goal: expiry is checked first, and the table of remembered codes stays bounded; method:
/// probe an expired burned code, then fail more codes than the table holds.
#[test]
fn limiter_expiry_and_bounded_memory() {
    let mut limiter = AttemptLimiter::new(LimiterConfig {
        max_tracked_codes: 2,
        ..LimiterConfig::default()
    });
    let a = code("AAAA-AAAA").with_expiry(NOW + 10);
    for _ in 0..3 {
        limiter.record_failure(&a);
    }
    assert!(matches!(
        limiter.begin_attempt(&a, NOW + 10),
        Err(PairingError::Expired)
    ));
    assert!(matches!(
        limiter.begin_attempt(&a, NOW),
        Err(PairingError::CodeBurned)
    ));

    // Tracking two more codes forgets `a`, the one expiring soonest, and keeps the others.
    let b = code("BBBB-BBBB").with_expiry(NOW + 100);
    let c = code("CCCC-CCCC").with_expiry(NOW + 200);
    limiter.record_failure(&b);
    limiter.record_failure(&c);
    assert_eq!(limiter.remaining_attempts(&a), 3);
    assert_eq!(limiter.remaining_attempts(&b), 2);
    assert_eq!(limiter.remaining_attempts(&c), 2);
}

/// Goal: the limiter and the state machines together stop online guessing; method: three
/// impostor approvers with wrong codes each cost the joiner one attempt, then the code is
/// burned, and a fourth session with the right code is refused before it starts.
#[test]
fn guessing_approvers_burn_the_joiners_code() {
    let shown = code("ABCD-EFGH").with_expiry(NOW + DEFAULT_CODE_TTL_SECS);
    let mut limiter = AttemptLimiter::default();
    for (i, guess) in ["ZZZZ-ZZZZ", "ABCD-EFGJ", "0000-0000"].iter().enumerate() {
        limiter
            .begin_attempt(&shown, NOW + i as u64)
            .expect("admitted");
        let mut joiner = Joiner::new(shown.clone(), JOINER, keys(), NAME).expect("joiner");
        let mut impostor = Approver::new(code(guess), OTHER, JOINER).expect("approver");
        let req = joiner.start(OTHER, NOW).expect("start");
        let confirm = impostor.on_join_request(&req, NOW).expect("confirm");
        let err = joiner
            .on_approver_confirm(&confirm, NOW)
            .expect_err("wrong code");
        assert!(err.counts_as_failed_attempt());
        limiter.record_failure(&shown);
    }
    assert!(matches!(
        limiter.begin_attempt(&shown, NOW + 5),
        Err(PairingError::CodeBurned)
    ));
}

/// Goal: oversized or malformed inputs are refused with typed errors before any work;
/// method: one over the cap for each message, a too-short grant ciphertext, and bad local
/// arguments.
#[test]
fn oversized_and_malformed_inputs_are_refused() {
    let oversized = |r: Result<(), PairingError>, max: usize| {
        assert!(
            matches!(r, Err(PairingError::Oversized { max: m, .. }) if m == max),
            "{r:?}"
        );
    };
    // 164 bytes plus the optional expiry (8 bytes, `pair --expires`).
    oversized(JoinRequest::decode(&[1u8; 173]).map(drop), 172);
    oversized(ApproverConfirm::decode(&[1u8; 68]).map(drop), 67);
    oversized(JoinerConfirm::decode(&[1u8; 35]).map(drop), 34);
    oversized(
        Grant::decode(&vec![1u8; MAX_MESSAGE_BYTES + 1]).map(drop),
        MAX_MESSAGE_BYTES,
    );
    type Decode = fn(&[u8]) -> Result<(), PairingError>;
    let decoders: [Decode; 4] = [
        |b: &[u8]| JoinRequest::decode(b).map(drop),
        |b: &[u8]| ApproverConfirm::decode(b).map(drop),
        |b: &[u8]| JoinerConfirm::decode(b).map(drop),
        |b: &[u8]| Grant::decode(b).map(drop),
    ];
    for decode in decoders {
        assert!(matches!(decode(&[]), Err(PairingError::Malformed { .. })));
        assert!(matches!(decode(&[1]), Err(PairingError::Malformed { .. })));
        assert!(matches!(
            decode(&[9, 1]),
            Err(PairingError::UnsupportedVersion { version: 9, .. })
        ));
    }
    // A grant whose ciphertext cannot even hold its tag.
    let mut short = vec![1u8, 4];
    short.extend_from_slice(&[0; 24]);
    short.extend_from_slice(&15u32.to_be_bytes());
    short.extend_from_slice(&[0; 15]);
    assert!(matches!(
        Grant::decode(&short),
        Err(PairingError::Malformed { .. })
    ));
    // A length field that points past the end.
    let mut lying = vec![1u8, 4];
    lying.extend_from_slice(&[0; 24]);
    lying.extend_from_slice(&u32::MAX.to_be_bytes());
    lying.extend_from_slice(&[0; 16]);
    assert!(matches!(
        Grant::decode(&lying),
        Err(PairingError::Malformed { .. })
    ));

    // Join requests whose names the approver must never show.
    let valid = run_until_request();
    for (name, reason) in [
        (&b""[..], "empty"),
        (&b"\x1b[2Jpwned"[..], "control"),
        (&[0xff, 0xfe][..], "UTF-8"),
    ] {
        let mut bytes = valid[..valid.len() - 1 - NAME.len()].to_vec();
        bytes.push(name.len() as u8);
        bytes.extend_from_slice(name);
        match JoinRequest::decode(&bytes) {
            Err(e @ PairingError::Malformed { .. }) => {
                assert!(e.to_string().contains(reason), "{e}");
            }
            other => panic!("name {name:?}: {other:?}"),
        }
    }

    // Local arguments.
    let c = code("ABCD-EFGH");
    let long_name = "n".repeat(65);
    for (peer, name) in [
        ("", NAME),
        ("12D3Koo/evil", NAME),
        (JOINER, long_name.as_str()),
        (JOINER, "tab\there"),
        (JOINER, ""),
    ] {
        assert!(matches!(
            Joiner::new(c.clone(), peer, keys(), name),
            Err(PairingError::InvalidInput { .. })
        ));
    }
    assert!(matches!(
        Approver::new(c.clone(), APPROVER, &"x".repeat(129)),
        Err(PairingError::InvalidInput { .. })
    ));
    let mut joiner = Joiner::new(c.clone(), JOINER, keys(), NAME).expect("joiner");
    assert!(matches!(
        joiner.start("not a peer id", NOW),
        Err(PairingError::InvalidInput { .. })
    ));

    // A grant plaintext over the cap.
    let setup = Setup::honest();
    let mut joiner = setup.joiner();
    let mut approver = setup.approver();
    let req = joiner.start(APPROVER, NOW).expect("start");
    let confirm = approver.on_join_request(&req, NOW).expect("confirm");
    let reply = joiner.on_approver_confirm(&confirm, NOW).expect("reply");
    approver.on_joiner_confirm(&reply, NOW).expect("verified");
    assert!(matches!(
        approver.grant(&vec![0; MAX_GRANT_PLAINTEXT_BYTES + 1]),
        Err(PairingError::Oversized { .. })
    ));
}

fn run_until_request() -> Vec<u8> {
    Setup::honest()
        .joiner()
        .start(APPROVER, NOW)
        .expect("start")
        .encode()
}

/// A seeded generator (fastrand), so a failing seed replays exactly.
struct TestRng(fastrand::Rng);

impl TestRng {
    fn next(&mut self) -> u64 {
        self.0.u64(..)
    }

    fn below(&mut self, n: usize) -> usize {
        self.0.usize(..n)
    }
}

/// Goal: no input makes a decoder or a state machine panic, and nothing but an honest
/// exchange yields a grant; method: a seeded loop (replay with `SEED=<n>`) of random byte
/// strings and of genuine messages with random bytes changed, truncated or extended, each
/// decoded as every kind and fed to a state machine waiting for that kind.
#[test]
fn random_bytes_never_panic() {
    let seed = std::env::var("SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            let mut b = [0u8; 8];
            getrandom::fill(&mut b).expect("rng works");
            u64::from_le_bytes(b)
        });
    eprintln!("random_bytes_never_panic: SEED={seed}");
    let mut rng = TestRng(fastrand::Rng::with_seed(seed));

    let mut genuine: Vec<Vec<u8>> = Vec::new();
    assert!(matches!(
        run(&Setup::honest(), |_, b| genuine.push(b.clone())),
        End::Granted(_)
    ));

    for iteration in 0..3_000 {
        let mut bytes = if rng.below(2) == 0 {
            let len = rng.below(300);
            (0..len).map(|_| rng.next() as u8).collect::<Vec<u8>>()
        } else {
            let mut b = genuine[rng.below(genuine.len())].clone();
            for _ in 0..=rng.below(3) {
                match rng.below(4) {
                    0 if !b.is_empty() => {
                        let at = rng.below(b.len());
                        b[at] ^= 1 << rng.below(8);
                    }
                    1 if !b.is_empty() => {
                        let keep = rng.below(b.len());
                        b.truncate(keep);
                    }
                    2 => b.push(rng.next() as u8),
                    _ if b.len() > 2 => {
                        let at = 2 + rng.below(b.len() - 2);
                        b[at] = rng.next() as u8;
                    }
                    _ => {}
                }
            }
            b
        };
        if rng.below(50) == 0 {
            bytes.resize(MAX_MESSAGE_BYTES + rng.below(3), 0);
        }
        let ctx = format!("SEED={seed} iteration {iteration}");

        if let Ok(req) = JoinRequest::decode(&bytes) {
            let mut approver = Setup::honest().approver();
            let _ = approver.on_join_request(&req, NOW);
        }
        if let Ok(confirm) = ApproverConfirm::decode(&bytes) {
            let mut joiner = Setup::honest().joiner();
            joiner.start(APPROVER, NOW).expect("start");
            // Even the genuine confirmation is a replay in this new session.
            assert!(joiner.on_approver_confirm(&confirm, NOW).is_err(), "{ctx}");
        }
        if let Ok(reply) = JoinerConfirm::decode(&bytes) {
            let setup = Setup::honest();
            let mut approver = setup.approver();
            let req = setup.joiner().start(APPROVER, NOW).expect("start");
            approver.on_join_request(&req, NOW).expect("confirm");
            assert!(approver.on_joiner_confirm(&reply, NOW).is_err(), "{ctx}");
        }
        if let Ok(grant) = Grant::decode(&bytes) {
            let setup = Setup::honest();
            let mut joiner = setup.joiner();
            let mut approver = setup.approver();
            let req = joiner.start(APPROVER, NOW).expect("start");
            let confirm = approver.on_join_request(&req, NOW).expect("confirm");
            joiner.on_approver_confirm(&confirm, NOW).expect("reply");
            assert!(joiner.on_grant(&grant).is_err(), "{ctx}");
        }
        let _ = PairingCode::parse(&String::from_utf8_lossy(&bytes));
    }
}
