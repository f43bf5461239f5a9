//! The text format shared by key files: `<prefix>:<fields>:<64 hex digits>\n`.
//!
//! Encoding and decoding go through [`Zeroizing`] buffers, so the hex text of a key is wiped
//! as soon as it is dropped. Reading and writing the files themselves is left to callers.

use zeroize::Zeroizing;

const HEX_DIGITS: &[u8; 16] = b"0123456789abcdef";

/// Appends the lowercase hex of `bytes` to `out`.
pub(crate) fn push_hex(out: &mut Zeroizing<Vec<u8>>, bytes: &[u8]) {
    for byte in bytes {
        // Both nibbles are below 16, so indexing the 16-digit table cannot fail.
        out.push(HEX_DIGITS[usize::from(byte >> 4)]);
        out.push(HEX_DIGITS[usize::from(byte & 0x0f)]);
    }
}

fn hex_value(digit: u8) -> Option<u8> {
    match digit {
        b'0'..=b'9' => Some(digit - b'0'),
        b'a'..=b'f' => Some(digit - b'a' + 10),
        b'A'..=b'F' => Some(digit - b'A' + 10),
        _ => None,
    }
}

/// Decodes exactly 64 hex digits into a 32-byte secret.
pub(crate) fn parse_key_hex(text: &[u8]) -> Option<Zeroizing<[u8; 32]>> {
    if text.len() != 64 {
        return None;
    }
    let mut key = Zeroizing::new([0u8; 32]);
    let (pairs, _) = text.as_chunks::<2>();
    for (byte, &[high, low]) in key.iter_mut().zip(pairs) {
        *byte = (hex_value(high)? << 4) | hex_value(low)?;
    }
    Some(key)
}

/// Strips `prefix` and one trailing line ending (`\n` or `\r\n`, also accepted missing, since
/// editors differ) from a key file's contents.
pub(crate) fn strip_frame<'a>(contents: &'a [u8], prefix: &[u8]) -> Option<&'a [u8]> {
    let body = contents.strip_prefix(prefix)?;
    let body = body.strip_suffix(b"\n").unwrap_or(body);
    Some(body.strip_suffix(b"\r").unwrap_or(body))
}
