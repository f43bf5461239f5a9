//! Behaviour of at-rest encryption and opaque ids: round trips, tampering, wrong keys,
//! associated-data mismatches and the key file format.

use nuwa_crypto::{AT_REST_BLOB_VERSION, AT_REST_OVERHEAD_BYTES, AtRestKey, CryptoError};

fn key() -> AtRestKey {
    AtRestKey::generate().expect("rng works")
}

// Goal: sealed blobs open to the same bytes and have the documented layout; method: a table
// of plaintext sizes and associated data.
#[test]
fn round_trip_and_layout() {
    let k = key();
    for size in [0usize, 1, 16, 1000, 1 << 18] {
        for aad in [&b""[..], b"log", b"\x00\x01binary"] {
            let plaintext: Vec<u8> = (0..size).map(|i| (i % 253) as u8).collect();
            let blob = k.seal(aad, &plaintext).expect("seal");
            assert_eq!(blob.len(), size + AT_REST_OVERHEAD_BYTES);
            assert_eq!(blob[0], AT_REST_BLOB_VERSION);
            let opened = k.open(aad, &blob).expect("open");
            assert_eq!(opened.as_slice(), plaintext.as_slice(), "size {size}");
        }
    }
    let a = k.seal(b"", b"same").expect("seal");
    let b = k.seal(b"", b"same").expect("seal");
    assert_ne!(a, b, "each blob has a fresh nonce");
}

// Goal: any change to a blob is detected; method: flip every bit, then truncate to every
// length, and check the error for each.
#[test]
fn every_bit_flip_and_truncation_is_refused() {
    let k = key();
    let blob = k.seal(b"tree/key", b"secret record").expect("seal");
    for bit in 0..blob.len() * 8 {
        let mut bad = blob.clone();
        bad[bit / 8] ^= 1 << (bit % 8);
        match (bit / 8, k.open(b"tree/key", &bad)) {
            (0, Err(CryptoError::UnsupportedBlobVersion { version })) => {
                assert_eq!(version, bad[0]);
            }
            (1.., Err(CryptoError::Decrypt)) => {}
            (byte, got) => panic!("bit {bit} (byte {byte}): unexpected {got:?}"),
        }
    }
    for len in 0..blob.len() {
        match k.open(b"tree/key", &blob[..len]) {
            Err(CryptoError::BlobTooShort { len: l, min }) => {
                assert_eq!((l, min), (len, AT_REST_OVERHEAD_BYTES));
                assert!(len < AT_REST_OVERHEAD_BYTES);
            }
            Err(CryptoError::Decrypt) => assert!(len >= AT_REST_OVERHEAD_BYTES),
            got => panic!("truncated to {len}: unexpected {got:?}"),
        }
    }
}

// Goal: a blob opens only with its own key and its own associated data; method: a table of
// wrong keys and AAD variants.
#[test]
fn wrong_key_or_aad_fails() {
    let k = key();
    let blob = k.seal(b"log\x00abc", b"value").expect("seal");
    for aad in [
        &b""[..],
        b"log",
        b"log\x00ab",
        b"log\x00abcd",
        b"LOG\x00abc",
        b"snap\x00abc",
    ] {
        assert!(
            matches!(k.open(aad, &blob), Err(CryptoError::Decrypt)),
            "aad {aad:?}"
        );
    }
    assert!(matches!(
        key().open(b"log\x00abc", &blob),
        Err(CryptoError::Decrypt)
    ));
    let same = AtRestKey::from_file_bytes(&k.to_file_bytes()).expect("parse");
    assert_eq!(
        same.open(b"log\x00abc", &blob).expect("open").as_slice(),
        b"value"
    );
}

// Goal: opaque ids are stable for one key and reveal nothing across keys, domains or names;
// method: compare ids over a table of inputs, including a domain/name boundary shift.
#[test]
fn opaque_id_is_stable_and_keyed() {
    let k = AtRestKey::from_bytes([7; 32]);
    let again = AtRestKey::from_bytes([7; 32]);
    let other = AtRestKey::from_bytes([8; 32]);
    let id = k.opaque_id("container", b"memory");
    assert_eq!(id, again.opaque_id("container", b"memory"));
    assert_eq!(id, k.opaque_id("container", b"memory"));
    let different = [
        other.opaque_id("container", b"memory"),
        k.opaque_id("container", b"memorz"),
        k.opaque_id("meta", b"memory"),
        k.opaque_id("containerm", b"emory"),
        k.opaque_id("", b"containermemory"),
    ];
    for (i, d) in different.iter().enumerate() {
        assert_ne!(&id, d, "case {i}");
    }
    // The id must not just be a keyless hash of the name.
    assert_ne!(id.as_slice(), sha256(b"memory").as_slice());
}

fn sha256(bytes: &[u8]) -> [u8; 32] {
    use sha2::Digest;
    sha2::Sha256::digest(bytes).into()
}

// Goal: the key file format round-trips and malformed files are refused; method: a table.
#[test]
fn key_file_format() {
    let k = AtRestKey::from_bytes([0xc3; 32]);
    let text = k.to_file_bytes();
    assert_eq!(
        text.as_slice(),
        format!("nuwa-at-rest-key-v1:{}\n", "c3".repeat(32)).as_bytes()
    );
    let hex = "c3".repeat(32);
    let cases = [
        (format!("nuwa-at-rest-key-v1:{hex}\n"), true),
        (format!("nuwa-at-rest-key-v1:{hex}"), true),
        (format!("nuwa-at-rest-key-v1:{hex}\r\n"), true),
        (format!("nuwa-at-rest-key-v2:{hex}\n"), false),
        (format!("nuwa-sync-key-v1:1:{hex}\n"), false),
        (format!("nuwa-at-rest-key-v1:{}\n", &hex[..62]), false),
        (format!("nuwa-at-rest-key-v1: {hex}\n"), false),
        (format!("nuwa-at-rest-key-v1:{}g\n", &hex[..63]), false),
    ];
    for (input, ok) in cases {
        match AtRestKey::from_file_bytes(input.as_bytes()) {
            Ok(parsed) => {
                assert!(ok, "{input:?} parsed");
                assert_eq!(parsed.opaque_id("d", b"n"), k.opaque_id("d", b"n"));
            }
            Err(CryptoError::MalformedKeyFile {
                kind: "at-rest", ..
            }) => assert!(!ok, "{input:?}"),
            Err(other) => panic!("{input:?}: unexpected {other}"),
        }
    }
}

// Goal: Debug shows nothing of the key; method: format a key with a recognisable pattern.
#[test]
fn debug_redacts() {
    let shown = format!("{:?}", AtRestKey::from_bytes([0x5a; 32]));
    assert_eq!(shown, "AtRestKey(<redacted>)");
}
