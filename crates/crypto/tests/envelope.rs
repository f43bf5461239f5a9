//! Behaviour of sealed envelopes: round trips, and the exact error for every kind of
//! tampering, wrong key, wrong sender and wrong epoch.

use ed25519_dalek::{Signer, SigningKey, VerifyingKey};
use nuwa_crypto::{
    ENVELOPE_OVERHEAD_BYTES, Envelope, EnvelopeError, SyncKey, TAG_BYTES, open, seal,
};
use sha2::{Digest, Sha256};

const DID: &str = "did:key:z6MkhaXgBZDvotDkL5257faiztiGiC2QtKLGpbnnEGta2doK";
const SENDER: &str = "ctx-laptop-01";
const NOW_MS: u64 = 1_767_225_600_000;

struct Fixture {
    key: SyncKey,
    signer: SigningKey,
    public: [u8; 32],
}

fn fixture(epoch: u64) -> Fixture {
    let key = SyncKey::generate(epoch).expect("rng works");
    let mut seed = [0u8; 32];
    getrandom::fill(&mut seed).expect("rng works");
    let signer = SigningKey::from_bytes(&seed);
    let public = signer.verifying_key().to_bytes();
    Fixture {
        key,
        signer,
        public,
    }
}

fn sealed(f: &Fixture, plaintext: &[u8]) -> Envelope {
    seal(&f.key, &f.signer, DID, SENDER, NOW_MS, plaintext).expect("seal")
}

/// Re-signs an altered envelope the way a legitimate device would, following the digest
/// layout documented on `seal`; written independently of the crate's own code.
fn resign(env: &mut Envelope, signer: &SigningKey, agent_did: &str) {
    let lp = |b: &[u8]| [&(b.len() as u64).to_be_bytes()[..], b].concat();
    let mut h = Sha256::new();
    h.update(b"NUWA_SYNC_ENVELOPE_V1:");
    h.update(lp(agent_did.as_bytes()));
    h.update(lp(env.sender.as_bytes()));
    h.update(env.epoch.to_be_bytes());
    h.update(env.timestamp_ms.to_be_bytes());
    h.update(env.nonce);
    h.update(lp(&env.ciphertext));
    let digest: [u8; 32] = h.finalize().into();
    env.signature = signer.sign(&digest).to_bytes();
}

fn flip(bytes: &mut [u8], bit: usize) {
    bytes[bit / 8] ^= 1 << (bit % 8);
}

// Goal: whatever is sealed opens to the same bytes; method: a table of plaintext sizes and
// of agent/sender strings, including empty and non-ASCII ones.
#[test]
fn seal_open_round_trip() {
    let f = fixture(4);
    let sizes = [0usize, 1, 15, 16, 17, 255, 4096, 65_537];
    let names = [(DID, SENDER), ("", ""), ("did:example:äöü", "ctx-🦀")];
    for size in sizes {
        let plaintext: Vec<u8> = (0..size).map(|i| (i * 31 % 251) as u8).collect();
        for (did, sender) in names {
            let env = seal(&f.key, &f.signer, did, sender, NOW_MS, &plaintext).expect("seal");
            assert_eq!(env.sender, sender);
            assert_eq!(env.epoch, 4);
            assert_eq!(env.timestamp_ms, NOW_MS);
            assert_eq!(env.ciphertext.len(), size + TAG_BYTES);
            let opened = open(&env, &f.key, &f.public, did).expect("open");
            assert_eq!(
                opened.as_slice(),
                plaintext.as_slice(),
                "size {size}, did {did:?}"
            );
        }
    }
}

// Goal: every envelope gets a fresh nonce, so two seals of the same input differ; method:
// seal the same bytes twice.
#[test]
fn nonces_are_fresh() {
    let f = fixture(1);
    let a = sealed(&f, b"same");
    let b = sealed(&f, b"same");
    assert_ne!(a.nonce, b.nonce);
    assert_ne!(a.ciphertext, b.ciphertext);
}

// Goal: the documented overhead is the fixed 120 bytes; method: compare the constant with
// the size of its parts.
#[test]
fn overhead_constant_matches_parts() {
    assert_eq!(ENVELOPE_OVERHEAD_BYTES, 24 + 16 + 64 + 8 + 8);
    const {
        assert!(
            ENVELOPE_OVERHEAD_BYTES <= 120,
            "the brief allows at most 120 fixed bytes"
        )
    };
}

// Goal: each single-bit flip of any field is refused with the error for that field; method:
// flip every bit of ciphertext, nonce, sender, epoch, timestamp and signature in turn.
#[test]
fn every_single_bit_flip_is_refused() {
    let f = fixture(9);
    let original = sealed(&f, b"a small state delta of thirty-two");
    let bad_sig = |env: &Envelope| EnvelopeError::BadSignature {
        sender: env.sender.clone(),
    };
    let mut checked = 0usize;

    let check = |env: Envelope, want: EnvelopeError, what: &str| {
        let got = open(&env, &f.key, &f.public, DID).expect_err(what);
        assert_eq!(got, want, "{what}");
    };

    for bit in 0..original.ciphertext.len() * 8 {
        let mut env = original.clone();
        flip(&mut env.ciphertext, bit);
        check(env.clone(), bad_sig(&env), &format!("ciphertext bit {bit}"));
        checked += 1;
    }
    for bit in 0..original.nonce.len() * 8 {
        let mut env = original.clone();
        flip(&mut env.nonce, bit);
        check(env.clone(), bad_sig(&env), &format!("nonce bit {bit}"));
        checked += 1;
    }
    for bit in 0..original.signature.len() * 8 {
        let mut env = original.clone();
        flip(&mut env.signature, bit);
        check(env.clone(), bad_sig(&env), &format!("signature bit {bit}"));
        checked += 1;
    }
    for bit in 0..64 {
        let mut env = original.clone();
        env.timestamp_ms ^= 1 << bit;
        check(env.clone(), bad_sig(&env), &format!("timestamp bit {bit}"));
        checked += 1;
    }
    for bit in 0..64 {
        let mut env = original.clone();
        env.epoch ^= 1 << bit;
        let want = EnvelopeError::WrongEpoch {
            got: env.epoch,
            want: 9,
        };
        check(env, want, &format!("epoch bit {bit}"));
        checked += 1;
    }
    for bit in 0..original.sender.len() * 8 {
        let mut bytes = original.sender.clone().into_bytes();
        flip(&mut bytes, bit);
        // A flip that breaks UTF-8 cannot be represented in an `Envelope`; the wire decoder
        // rejects it before this layer.
        let Ok(sender) = String::from_utf8(bytes) else {
            continue;
        };
        let env = Envelope {
            sender,
            ..original.clone()
        };
        check(env.clone(), bad_sig(&env), &format!("sender bit {bit}"));
        checked += 1;
    }
    assert!(checked > 1000, "only {checked} flips checked");
    // The untouched envelope still opens, so the refusals above are due to the flips.
    assert!(open(&original, &f.key, &f.public, DID).is_ok());
}

// Goal: the wrong key of each kind gives its own error; method: a table of (change, error).
#[test]
fn wrong_keys_epochs_and_agents() {
    let f = fixture(5);
    let env = sealed(&f, b"payload");
    let other = fixture(5);
    let next_epoch = SyncKey::from_bytes(6, *f.key.expose_secret());
    let sender = SENDER.to_owned();

    type Case<'a> = (
        &'a str,
        &'a SyncKey,
        &'a [u8; 32],
        &'a str,
        Result<(), EnvelopeError>,
    );
    let cases: [Case; 5] = [
        ("right everything", &f.key, &f.public, DID, Ok(())),
        (
            "other sync key, same epoch",
            &other.key,
            &f.public,
            DID,
            Err(EnvelopeError::Decrypt {
                sender: sender.clone(),
                epoch: 5,
            }),
        ),
        (
            "other sender key",
            &f.key,
            &other.public,
            DID,
            Err(EnvelopeError::BadSignature {
                sender: sender.clone(),
            }),
        ),
        (
            "key of the next epoch",
            &next_epoch,
            &f.public,
            DID,
            Err(EnvelopeError::WrongEpoch { got: 5, want: 6 }),
        ),
        (
            "other agent did",
            &f.key,
            &f.public,
            "did:key:zSomeoneElse",
            Err(EnvelopeError::BadSignature {
                sender: sender.clone(),
            }),
        ),
    ];
    for (what, key, public, did, want) in cases {
        assert_eq!(open(&env, key, public, did).map(|_| ()), want, "{what}");
    }
}

// Goal: the AEAD binds the DID, sender and header even when the signer is legitimate;
// method: alter a field, re-sign it with the real device key, and expect `Decrypt`.
#[test]
fn resigned_tampering_fails_decryption() {
    let f = fixture(3);
    let original = sealed(&f, b"bound to its header");
    type Alter = fn(&mut Envelope);
    let alterations: [(&str, Alter); 4] = [
        ("ciphertext", |e| e.ciphertext[0] ^= 1),
        ("timestamp", |e| e.timestamp_ms += 1),
        ("nonce", |e| e.nonce[23] ^= 0x80),
        ("sender", |e| e.sender.push('x')),
    ];
    for (what, alter) in alterations {
        let mut env = original.clone();
        alter(&mut env);
        resign(&mut env, &f.signer, DID);
        let want = EnvelopeError::Decrypt {
            sender: env.sender.clone(),
            epoch: 3,
        };
        assert_eq!(
            open(&env, &f.key, &f.public, DID).map(|_| ()),
            Err(want),
            "{what}"
        );
    }
    // The AAD binds the agent DID too: a device of another agent sharing the key cannot
    // move an envelope across agents by re-signing it.
    let mut env = original.clone();
    resign(&mut env, &f.signer, "did:key:zOther");
    let want = EnvelopeError::Decrypt {
        sender: env.sender.clone(),
        epoch: 3,
    };
    assert_eq!(
        open(&env, &f.key, &f.public, "did:key:zOther").map(|_| ()),
        Err(want)
    );
    // Sanity: re-signing an unaltered envelope keeps it valid, so `resign` matches `seal`.
    let mut env = original.clone();
    resign(&mut env, &f.signer, DID);
    assert_eq!(
        env.signature, original.signature,
        "ed25519 signatures are deterministic"
    );
}

// Goal: a sender key that is not a curve point is reported as such, not as a forgery;
// method: find 32 bytes that do not decompress and offer them as the sender key.
#[test]
fn invalid_sender_key_is_reported() {
    let f = fixture(1);
    let env = sealed(&f, b"x");
    let not_a_point = (0u8..=255)
        .map(|b| [b; 32])
        .find(|bytes| VerifyingKey::from_bytes(bytes).is_err())
        .expect("some repeated byte is not a valid point");
    assert_eq!(
        open(&env, &f.key, &not_a_point, DID).map(|_| ()),
        Err(EnvelopeError::InvalidSenderKey)
    );
}
