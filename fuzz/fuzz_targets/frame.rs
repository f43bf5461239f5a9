//! Fuzzes the wire decoders of `nuwa-proto`: length-prefixed framing
//! (`split_frame`), `Frame::decode`, `SyncPayload::decode` and `Ack::decode`.
//!
//! Every decoder must return an error rather than panic, and whatever decodes
//! must survive encode → decode unchanged (the domain types are the validated
//! form, so re-encoding one can never produce something the decoder refuses).
#![no_main]

use libfuzzer_sys::fuzz_target;
use nuwa_proto::{Ack, Frame, SyncPayload, length_prefixed, split_frame};

/// Frames looked at per input; a stream of empty frames would otherwise make
/// one input loop for a long time without finding anything new.
const MAX_FRAMES_PER_INPUT: usize = 64;

fuzz_target!(|data: &[u8]| {
    // The whole input as one frame body, and as each kind of payload.
    if let Ok(frame) = Frame::decode(data) {
        let again = Frame::decode(&frame.encode());
        assert_eq!(again.ok().as_ref(), Some(&frame), "frame round trip");
    }
    if let Ok(payload) = SyncPayload::decode(data) {
        let again = SyncPayload::decode(&payload.encode());
        assert_eq!(
            again.ok().as_ref(),
            Some(&payload),
            "sync payload round trip"
        );
    }
    if let Ok(ack) = Ack::decode(data) {
        let again = Ack::decode(&ack.encode());
        assert_eq!(again.ok().as_ref(), Some(&ack), "ack round trip");
    }

    // The input as a byte stream of length-prefixed frames.
    let mut rest = data;
    for _ in 0..MAX_FRAMES_PER_INPUT {
        let Ok(Some((body, tail))) = split_frame(rest) else {
            break;
        };
        if let Ok(prefixed) = length_prefixed(body) {
            let resplit = split_frame(&prefixed);
            assert_eq!(
                resplit.ok().flatten(),
                Some((body, &[][..])),
                "length prefix round trip"
            );
        }
        let _ = Frame::decode(body);
        rest = tail;
    }
});
