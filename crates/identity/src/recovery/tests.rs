//! Tests of recovery phrases: BIP-39 reference vectors, a frozen key vector,
//! every kind of mistyped phrase, membership in a DID document, and the
//! confirmation step.

use super::*;
use crate::did_key::did_key_from_ed25519;
use crate::document::{EXPIRY_GRACE_SECS, Relationship};

const NOW: i64 = 1_750_000_000;

/// BIP-39 reference vector (entropy 7f × 16) used as "the" phrase below.
const LEGAL: &str = "legal winner thank year wave sausage worth useful legal winner thank yellow";

/// What parsing `input` gives, as one comparable line.
fn parse_outcome(input: &str) -> String {
    match RecoveryPhrase::parse(input) {
        Ok(phrase) => format!("ok {}", hex::encode(*phrase.entropy)),
        Err(RecoveryError::WordCount { found, expected }) => {
            format!("word count {found}, expected {expected}")
        }
        Err(RecoveryError::UnknownWord {
            position,
            word,
            suggestion,
        }) => format!("unknown word {position} `{word}`, suggestion {suggestion:?}"),
        Err(RecoveryError::Checksum) => "checksum".to_owned(),
        Err(other) => format!("unexpected error: {other}"),
    }
}

/// Checks each `(input, expected outcome)` row through [`parse_outcome`].
fn check_parse(cases: &[(&str, &str)]) {
    for (input, want) in cases {
        assert_eq!(parse_outcome(input), *want, "input: {input:?}");
    }
}

/// `LEGAL` with the word at 1-based `position` replaced.
fn legal_with(position: usize, word: &str) -> String {
    let mut words: Vec<&str> = LEGAL.split(' ').collect();
    words[position - 1] = word;
    words.join(" ")
}

/// An agent document (master key from seed 1) with the recovery key of `phrase` as generation 1.
fn agent_with_recovery(phrase: &RecoveryPhrase) -> DidDocument {
    let master = DeviceKey::from_seed(&[1; 32]);
    let did = did_key_from_ed25519(&master.public());
    let mut doc = DidDocument::new_agent(&did, &master.public()).expect("valid agent");
    add_recovery_key(&mut doc, 1, &phrase.key().public()).expect("recovery key is new");
    doc.validate().expect("valid with recovery key");
    doc
}

// Goal: a generated phrase survives being shown and typed back; generate, print words, parse, compare keys.
#[test]
fn round_trip_generate_words_parse() {
    let phrase = RecoveryPhrase::generate().expect("os rng works in tests");
    let words = phrase.words();
    assert_eq!(words.split(' ').count(), WORD_COUNT);
    let back = RecoveryPhrase::parse(&words).expect("own words parse");
    assert_eq!(*back.entropy, *phrase.entropy);
    assert_eq!(back.key().public(), phrase.key().public());
    assert_eq!(*back.key().seed(), *phrase.key().seed());
    let other = RecoveryPhrase::generate().expect("os rng works in tests");
    assert_ne!(other.key().public(), phrase.key().public());
}

// Goal: the word mapping follows BIP-39 and the key derivation never changes silently;
// parse the reference phrases, compare their entropy with BIP-39's test vectors and
// their keys with public keys computed independently (Python `cryptography`:
// HKDF-SHA256 then Ed25519), frozen here.
#[test]
fn frozen_vectors() {
    let vectors = [
        (
            "abandon abandon abandon abandon abandon abandon abandon abandon abandon abandon abandon about",
            "00000000000000000000000000000000",
            "5d5d32af98a8bea942951dbd9828b89dcf01d148fb6cc71ad48e11da3940b25c",
        ),
        (
            LEGAL,
            "7f7f7f7f7f7f7f7f7f7f7f7f7f7f7f7f",
            "22ef9e49627a2a61a61bdf604c9c990711a798a6925827b04329bdbf5b18d068",
        ),
        (
            "letter advice cage absurd amount doctor acoustic avoid letter advice cage above",
            "80808080808080808080808080808080",
            "3e0fa9c45bdd128dfcfbaba7a39ccdbb8acb7fd7cca1a36a44f7e47d867c971c",
        ),
    ];
    for (words, entropy_hex, public_hex) in vectors {
        let phrase = RecoveryPhrase::parse(words).expect("reference phrase parses");
        assert_eq!(hex::encode(*phrase.entropy), entropy_hex, "{words}");
        assert_eq!(hex::encode(phrase.key().public()), public_hex, "{words}");
        assert_eq!(*phrase.words(), words, "words are shown as written");
    }
}

// Goal: a phrase is accepted however it is spaced and capitalised; parse variants of LEGAL.
#[test]
fn whitespace_and_case_are_normalised() {
    let legal = "ok 7f7f7f7f7f7f7f7f7f7f7f7f7f7f7f7f";
    check_parse(&[
        (LEGAL, legal),
        (&LEGAL.to_uppercase(), legal),
        (
            "  Legal   WINNER\tthank\nyear wave sausage worth useful legal winner thank yellow \n",
            legal,
        ),
        (
            "legal\u{a0}winner thank year wave sausage worth useful legal winner thank yellow",
            legal,
        ),
    ]);
}

// Goal: a phrase of the wrong length is refused by its count alone; parse 0, 11, 13, 23 and 24 words.
#[test]
fn wrong_word_count() {
    let words: Vec<&str> = LEGAL.split(' ').collect();
    let eleven = words[..11].join(" ");
    let thirteen = format!("{LEGAL} legal");
    let twenty_three = format!("{LEGAL} {eleven}");
    // A 24-word phrase from a wallet is valid BIP-39, but not a recovery phrase.
    let twenty_four = "letter advice cage absurd amount doctor acoustic avoid letter advice cage absurd \
                       amount doctor acoustic avoid letter advice cage absurd amount doctor acoustic bless";
    check_parse(&[
        ("", "word count 0, expected 12"),
        ("   \n", "word count 0, expected 12"),
        (&eleven, "word count 11, expected 12"),
        (&thirteen, "word count 13, expected 12"),
        (&twenty_three, "word count 23, expected 12"),
        (twenty_four, "word count 24, expected 12"),
    ]);
}

// Goal: a word outside the list is named by position, with the closest word when one is
// clearly closest; parse LEGAL with one word mistyped per row.
#[test]
fn unknown_word_with_suggestion() {
    check_parse(&[
        // Same first four letters as a list word: that word.
        (
            &legal_with(2, "winnr"),
            "unknown word 2 `winnr`, suggestion Some(\"winner\")",
        ),
        (
            &legal_with(6, "sausgae"),
            "unknown word 6 `sausgae`, suggestion Some(\"sausage\")",
        ),
        (
            &legal_with(12, "YELLO"),
            "unknown word 12 `yello`, suggestion Some(\"yellow\")",
        ),
        // One edit away from exactly one word.
        (
            &legal_with(1, "lgal"),
            "unknown word 1 `lgal`, suggestion Some(\"legal\")",
        ),
        (
            &legal_with(7, "wrth"),
            "unknown word 7 `wrth`, suggestion Some(\"worth\")",
        ),
        // One edit away from several words: no guess.
        (
            &legal_with(2, "wnner"),
            "unknown word 2 `wnner`, suggestion None",
        ),
        // Nothing close.
        (
            &legal_with(3, "qqqqqq"),
            "unknown word 3 `qqqqqq`, suggestion None",
        ),
        (
            &legal_with(3, "thankyouverymuch"),
            "unknown word 3 `thankyouverymuch`, suggestion Some(\"thank\")",
        ),
        // One edit from two words ("year", "deer"): no guess.
        (
            &legal_with(4, "yeer"),
            "unknown word 4 `yeer`, suggestion None",
        ),
        // The first unknown word is reported.
        (
            &legal_with(4, "yaer").replace("wave", "wavv"),
            "unknown word 4 `yaer`, suggestion Some(\"year\")",
        ),
    ]);
    let error = RecoveryPhrase::parse(&legal_with(2, "winnr")).expect_err("unknown word");
    assert_eq!(
        error.to_string(),
        "word 2 `winnr` is not a recovery word (did you mean `winner`?): check it against your written copy"
    );
}

// Goal: known words that break the checksum are refused as such; replace LEGAL's last word
// with another list word, and swap two words, each failing the 4-bit checksum.
#[test]
fn checksum_error() {
    check_parse(&[
        (&legal_with(12, "zoo"), "checksum"),
        (&legal_with(12, "winner"), "checksum"),
        // Words 6 and 7 swapped.
        (
            "legal winner thank year wave worth sausage useful legal winner thank yellow",
            "checksum",
        ),
    ]);
    // The checksum is 4 bits, so one last word in 16 passes; the test must use failing ones.
    let passing = Language::English
        .word_list()
        .iter()
        .filter(|word| RecoveryPhrase::parse(&legal_with(12, word)).is_ok())
        .count();
    assert_eq!(passing, 128, "2^7 last words carry a valid checksum");
    let error = RecoveryPhrase::parse(&legal_with(12, "zoo")).expect_err("bad checksum");
    assert!(
        error
            .to_string()
            .contains("a word is wrong or two are swapped")
    );
}

// Goal: only the words of this agent's current recovery key pass check_belongs; build a
// document with a recovery key, then try other words, a retired key and an expired key.
#[test]
fn check_belongs_table() {
    let ours = RecoveryPhrase::parse(LEGAL).expect("valid");
    let theirs = RecoveryPhrase::parse(
        "letter advice cage absurd amount doctor acoustic avoid letter advice cage above",
    )
    .expect("valid");
    let doc = agent_with_recovery(&ours);
    let key_id = doc.key_id("recovery-1");

    assert_eq!(
        check_belongs(&doc, &ours.key(), NOW).expect("our words"),
        key_id
    );

    // Words of another agent (its own document lists them; ours does not).
    let their_doc = agent_with_recovery(&theirs);
    assert!(check_belongs(&their_doc, &theirs.key(), NOW).is_ok());
    let before = doc.clone();
    match check_belongs(&doc, &theirs.key(), NOW) {
        Err(RecoveryError::NotThisAgent { did }) => assert_eq!(did, doc.id),
        other => panic!("another agent's words: {other:?}"),
    }
    assert_eq!(doc, before, "a refused check changes nothing");

    // Our key listed, but not as a recovery key (a device fragment).
    let mut as_device = before.clone();
    as_device.remove_key(&key_id).expect("listed");
    as_device
        .add_key(
            "device-1",
            &ours.key().public(),
            &[Relationship::CapabilityDelegation],
            None,
        )
        .expect("add");
    assert!(matches!(
        check_belongs(&as_device, &ours.key(), NOW),
        Err(RecoveryError::NotThisAgent { .. })
    ));

    // Still listed, but capabilityDelegation taken away.
    let mut retired = before.clone();
    retired.revoke(&key_id, Relationship::CapabilityDelegation);
    match check_belongs(&retired, &ours.key(), NOW) {
        Err(RecoveryError::Retired { key_id: got }) => assert_eq!(got, key_id),
        other => panic!("retired key: {other:?}"),
    }

    // Listed with an expiry (2025-06-15T15:06:40Z is NOW): fine until the grace runs out.
    let mut expiring = before.clone();
    expiring.remove_key(&key_id).expect("listed");
    expiring
        .add_key(
            &recovery_fragment(2),
            &ours.key().public(),
            &[Relationship::CapabilityDelegation],
            Some("2025-06-15T15:06:40Z".to_owned()),
        )
        .expect("add");
    assert!(check_belongs(&expiring, &ours.key(), NOW + EXPIRY_GRACE_SECS).is_ok());
    assert!(matches!(
        check_belongs(&expiring, &ours.key(), NOW + EXPIRY_GRACE_SECS + 1),
        Err(RecoveryError::Expired { .. })
    ));
}

// Goal: a recovery key can change keys but never act as a device; add one and ask the
// document what it may do.
#[test]
fn recovery_key_is_delegation_only() {
    let phrase = RecoveryPhrase::parse(LEGAL).expect("valid");
    let mut doc = agent_with_recovery(&phrase);
    let public = phrase.key().public();
    assert!(
        doc.method_for_public(&public, Relationship::CapabilityDelegation, NOW)
            .is_ok()
    );
    for rel in [
        Relationship::Authentication,
        Relationship::AssertionMethod,
        Relationship::CapabilityInvocation,
    ] {
        assert!(
            matches!(
                doc.method_for_public(&public, rel, NOW),
                Err(DidError::PermissionDenied { .. })
            ),
            "{rel}"
        );
    }
    assert_eq!(recovery_fragment(1), "recovery-1");
    assert_eq!(recovery_fragment(2), "recovery-2");
    // The same generation twice is refused and leaves the document as it was.
    let before = doc.clone();
    let next = RecoveryPhrase::generate().expect("os rng works in tests");
    assert!(add_recovery_key(&mut doc, 1, &next.key().public()).is_err());
    assert_eq!(doc, before);
    let id = add_recovery_key(&mut doc, 2, &next.key().public()).expect("new generation");
    assert_eq!(id, doc.key_id("recovery-2"));
}

// Goal: Debug never shows the words or the entropy; format a known phrase and search the output.
#[test]
fn debug_does_not_leak_words() {
    let phrase = RecoveryPhrase::parse(LEGAL).expect("valid");
    let shown = format!("{phrase:?}");
    assert_eq!(shown, "RecoveryPhrase(..)");
    let pretty = format!("{phrase:#?}");
    for word in LEGAL.split(' ') {
        assert!(!shown.contains(word) && !pretty.contains(word), "{word}");
    }
    assert!(!pretty.contains("7f") && !pretty.contains("127"));
}

// Goal: confirmation asks distinct valid positions and accepts only the right words;
// fixed seeds for the positions, then a table of answers.
#[test]
fn confirmation() {
    for seed in 0..200u64 {
        let positions = confirmation_positions(WORD_COUNT, CONFIRM_WORDS, seed);
        assert_eq!(positions.len(), CONFIRM_WORDS, "seed {seed}");
        assert!(positions.windows(2).all(|w| w[0] < w[1]), "seed {seed}");
        assert!(
            positions.iter().all(|p| (1..=WORD_COUNT).contains(p)),
            "seed {seed}"
        );
        assert_eq!(
            positions,
            confirmation_positions(WORD_COUNT, CONFIRM_WORDS, seed)
        );
    }
    // Different seeds ask different words, and every position gets asked.
    let mut asked = std::collections::BTreeSet::new();
    for seed in 0..200u64 {
        asked.extend(confirmation_positions(WORD_COUNT, CONFIRM_WORDS, seed));
    }
    assert_eq!(asked.len(), WORD_COUNT);
    assert_eq!(
        confirmation_positions(WORD_COUNT, 99, 7),
        (1..=WORD_COUNT).collect::<Vec<_>>()
    );
    assert!(confirmation_positions(WORD_COUNT, 0, 7).is_empty());
    assert!(confirmation_positions(0, 3, 7).is_empty());
    let random = random_confirmation_positions(WORD_COUNT, CONFIRM_WORDS).expect("os rng");
    assert_eq!(random.len(), CONFIRM_WORDS);

    let phrase = RecoveryPhrase::parse(LEGAL).expect("valid");
    let answer = |pairs: &[(usize, &str)]| -> Result<(), RecoveryError> {
        let owned: Vec<(usize, String)> = pairs
            .iter()
            .map(|(position, word)| (*position, (*word).to_owned()))
            .collect();
        check_confirmation(&phrase, &owned)
    };
    assert!(answer(&[(1, "legal"), (6, "sausage"), (12, "yellow")]).is_ok());
    assert!(answer(&[(2, " Winner "), (12, "YELLOW")]).is_ok());
    assert!(matches!(
        answer(&[(1, "legal"), (6, "worth"), (12, "yellow")]),
        Err(RecoveryError::Mismatch { position: 6 })
    ));
    assert!(matches!(
        answer(&[(12, "yello")]),
        Err(RecoveryError::Mismatch { position: 12 })
    ));
    assert!(matches!(
        answer(&[(0, "legal")]),
        Err(RecoveryError::PositionOutOfRange {
            position: 0,
            n_words: 12
        })
    ));
    assert!(matches!(
        answer(&[(13, "legal")]),
        Err(RecoveryError::PositionOutOfRange { position: 13, .. })
    ));
    assert!(matches!(answer(&[]), Err(RecoveryError::NothingConfirmed)));
}

// Goal: every error message follows the house style (lowercase start, no trailing period,
// says what to do); render one of each.
#[test]
fn error_messages_are_actionable() {
    let errors = [
        RecoveryError::WordCount {
            found: 11,
            expected: 12,
        },
        RecoveryError::UnknownWord {
            position: 3,
            word: "qqq".into(),
            suggestion: None,
        },
        RecoveryError::Checksum,
        RecoveryError::NotThisAgent {
            did: "did:key:z6Mk".into(),
        },
        RecoveryError::Retired {
            key_id: "did:key:z6Mk#recovery-1".into(),
        },
        RecoveryError::Expired {
            key_id: "did:key:z6Mk#recovery-1".into(),
            expires: "2025-06-15T15:06:40Z".into(),
        },
        RecoveryError::Mismatch { position: 4 },
        RecoveryError::PositionOutOfRange {
            position: 13,
            n_words: 12,
        },
        RecoveryError::NothingConfirmed,
    ];
    for error in errors {
        let message = error.to_string();
        assert!(message.starts_with(|c: char| c.is_lowercase()), "{message}");
        assert!(!message.ends_with('.'), "{message}");
        assert!(message.contains(": "), "says what to do next: {message}");
    }
}

// Goal: the edit distance counts inserts, deletes, replacements and swaps; a few known pairs.
#[test]
fn edit_distance_cases() {
    let cases = [
        ("legal", "legal", 0),
        ("lgal", "legal", 1),
        ("legall", "legal", 1),
        ("lefal", "legal", 1),
        ("lgeal", "legal", 1),
        ("", "legal", 5),
        ("xyz", "legal", 5),
    ];
    for (typed, word, want) in cases {
        let typed: Vec<char> = typed.chars().collect();
        assert_eq!(edit_distance(&typed, word), want, "{typed:?} -> {word}");
    }
}

// Goal: a recovery key nobody could ever use (not a curve point, or of small
// order) is refused, and the document is left as it was.
#[test]
fn unusable_recovery_keys_are_refused() {
    let master = DeviceKey::generate().unwrap();
    let did = crate::did_key::did_key_from_ed25519(&master.public());
    let mut doc = crate::log::genesis_document(&did).unwrap();
    let before = doc.clone();
    // About half of all y coordinates have no point: take the first.
    let not_a_point = (2u8..=255)
        .map(|b| [b; 32])
        .find(|k| ed25519_dalek::VerifyingKey::from_bytes(k).is_err())
        .expect("some bytes are no curve point");
    for bad in [not_a_point, [0; 32], {
        let mut one = [0; 32];
        one[0] = 1; // the identity point: small order
        one
    }] {
        let err = add_recovery_key(&mut doc, 1, &bad).unwrap_err();
        assert!(err.to_string().contains("not a usable"), "{err}");
        assert_eq!(doc, before);
    }
    add_recovery_key(&mut doc, 1, &DeviceKey::generate().unwrap().public()).unwrap();
}
