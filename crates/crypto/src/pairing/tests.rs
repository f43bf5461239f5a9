//! Unit tests of the pairing internals that the public API cannot reach: the bit-to-symbol
//! mapping of codes, the seeded generator behind SPAKE2, and golden bytes of every message.

use super::*;

/// Goal: 40 random bits map to symbols most significant first; method: a table of fixed
/// inputs against their expected display form.
#[test]
fn random_bits_map_to_symbols_in_order() {
    let cases: &[([u8; 5], &str)] = &[
        ([0x00; 5], "0000-0000"),
        ([0xff; 5], "ZZZZ-ZZZZ"),
        // 0x0000000001 is the last symbol 1; 0x8000000000 puts 16 ('G') in the first.
        ([0x00, 0x00, 0x00, 0x00, 0x01], "0000-0001"),
        ([0x80, 0x00, 0x00, 0x00, 0x00], "G000-0000"),
        // 0x0842108421 = symbols 1,1,1,1,1,1,1,1 (five-bit groups 00001).
        ([0x08, 0x42, 0x10, 0x84, 0x21], "1111-1111"),
    ];
    for (bits, expected) in cases {
        let code = PairingCode::from_random(bits, 0);
        assert_eq!(code.to_string(), *expected, "bits {bits:02x?}");
        let reparsed = PairingCode::parse(expected).expect("display form parses");
        assert!(reparsed.same_symbols(&code.symbols));
    }
}

/// Goal: the SPAKE2 generator gives a fresh stream per seed and never repeats a block;
/// method: draw 200 bytes across block boundaries in odd chunk sizes from two generators.
#[test]
fn seeded_rng_streams_differ_and_cross_blocks() {
    use spake2::rand_core::Rng;
    let mut a = SeededRng::from_os().expect("rng works");
    let mut b = SeededRng::from_os().expect("rng works");
    let mut out_a = vec![0u8; 200];
    let mut filled = 0;
    for chunk in [1usize, 7, 63, 64, 65] {
        a.fill_bytes(&mut out_a[filled..filled + chunk]);
        filled += chunk;
    }
    let mut out_b = vec![0u8; 200];
    b.fill_bytes(&mut out_b);
    assert_ne!(out_a, out_b);
    assert_ne!(out_a[..64], out_a[64..128], "consecutive blocks repeat");
    assert_ne!(a.next_u64(), a.next_u64());
}

/// Goal: the byte layout of every message is stable; method: encode fixed field values and
/// compare with hand-written golden bytes, then decode them back.
#[test]
fn golden_bytes() {
    let mut spake_b = [0x11u8; SPAKE_MSG_BYTES];
    spake_b[0] = b'B';
    let mut spake_a = [0x22u8; SPAKE_MSG_BYTES];
    spake_a[0] = b'A';

    let request = JoinRequest {
        spake_msg: spake_b,
        joiner_ed25519_public: [0x33; 32],
        joiner_x25519_public: [0x44; 32],
        name: "pc".to_owned(),
        expires_secs: None,
    };
    let mut golden = vec![1u8, 1];
    golden.extend_from_slice(&spake_b);
    golden.extend_from_slice(&[0x33; 32]);
    golden.extend_from_slice(&[0x44; 32]);
    golden.extend_from_slice(&[2, b'p', b'c']);
    assert_eq!(request.encode(), golden);
    assert_eq!(JoinRequest::decode(&golden).expect("decodes"), request);
    // `pair --expires 10m`: the seconds follow, big-endian.
    let expiring = JoinRequest {
        expires_secs: Some(600),
        ..request.clone()
    };
    golden.extend_from_slice(&600u64.to_be_bytes());
    assert_eq!(expiring.encode(), golden);
    assert_eq!(JoinRequest::decode(&golden).expect("decodes"), expiring);
    for cut in [1, 7] {
        assert!(JoinRequest::decode(&golden[..golden.len() - cut]).is_err());
    }

    let confirm = ApproverConfirm {
        spake_msg: spake_a,
        mac: [0x55; 32],
    };
    let mut golden = vec![1u8, 2];
    golden.extend_from_slice(&spake_a);
    golden.extend_from_slice(&[0x55; 32]);
    assert_eq!(confirm.encode(), golden);
    assert_eq!(ApproverConfirm::decode(&golden).expect("decodes"), confirm);

    let joiner_confirm = JoinerConfirm { mac: [0x66; 32] };
    let mut golden = vec![1u8, 3];
    golden.extend_from_slice(&[0x66; 32]);
    assert_eq!(joiner_confirm.encode(), golden);
    assert_eq!(
        JoinerConfirm::decode(&golden).expect("decodes"),
        joiner_confirm
    );

    let grant = Grant {
        nonce: [0x77; 24],
        ciphertext: vec![0x88; 17],
    };
    let mut golden = vec![1u8, 4];
    golden.extend_from_slice(&[0x77; 24]);
    golden.extend_from_slice(&[0, 0, 0, 17]);
    golden.extend_from_slice(&[0x88; 17]);
    assert_eq!(grant.encode(), golden);
    assert_eq!(Grant::decode(&golden).expect("decodes"), grant);
}

/// Goal: the transcript changes when any bound field changes; method: hash a base input,
/// then hash it again with each field altered in turn.
#[test]
fn transcript_binds_every_field() {
    let mut spake_a = [0x22u8; SPAKE_MSG_BYTES];
    spake_a[0] = b'A';
    let request = JoinRequest {
        spake_msg: [0x11; SPAKE_MSG_BYTES],
        joiner_ed25519_public: [0x33; 32],
        joiner_x25519_public: [0x44; 32],
        name: "pc".to_owned(),
        expires_secs: None,
    };
    let base = TranscriptInput {
        approver_peer_id: "A",
        joiner_peer_id: "B",
        approver_spake_msg: &spake_a,
        request: &request,
    }
    .hash();
    let mut other_spake_a = spake_a;
    other_spake_a[5] ^= 1;
    let mut variants: Vec<JoinRequest> = Vec::new();
    for i in 0..6 {
        let mut r = request.clone();
        match i {
            0 => r.spake_msg[7] ^= 1,
            1 => r.joiner_ed25519_public[0] ^= 1,
            2 => r.joiner_x25519_public[31] ^= 1,
            3 => r.expires_secs = Some(600),
            4 => r.expires_secs = Some(601),
            _ => r.name.push('x'),
        }
        variants.push(r);
    }
    let mut hashes = vec![
        TranscriptInput {
            approver_peer_id: "AB",
            joiner_peer_id: "",
            approver_spake_msg: &spake_a,
            request: &request,
        }
        .hash(),
        TranscriptInput {
            approver_peer_id: "A",
            joiner_peer_id: "C",
            approver_spake_msg: &spake_a,
            request: &request,
        }
        .hash(),
        TranscriptInput {
            approver_peer_id: "A",
            joiner_peer_id: "B",
            approver_spake_msg: &other_spake_a,
            request: &request,
        }
        .hash(),
    ];
    for r in &variants {
        hashes.push(
            TranscriptInput {
                approver_peer_id: "A",
                joiner_peer_id: "B",
                approver_spake_msg: &spake_a,
                request: r,
            }
            .hash(),
        );
    }
    for (i, h) in hashes.iter().enumerate() {
        assert_ne!(*h, base, "variant {i} did not change the transcript");
    }
}
