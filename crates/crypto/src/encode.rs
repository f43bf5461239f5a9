//! Unambiguous byte encodings for the data that AEADs and signatures bind.
//!
//! Each variable-length field is preceded by its length as a big-endian `u64`, so that no
//! two different field lists encode to the same bytes (`("ab", "c")` ≠ `("a", "bc")`).

use sha2::digest::Update;

/// Appends `field` to `out`, preceded by its length as a big-endian `u64`.
pub(crate) fn put_field(out: &mut Vec<u8>, field: &[u8]) {
    // usize is at most 64 bits on every target Rust supports, so this widening is lossless.
    out.extend_from_slice(&(field.len() as u64).to_be_bytes());
    out.extend_from_slice(field);
}

/// Feeds `field` to a hasher or MAC, preceded by its length as a big-endian `u64`.
pub(crate) fn update_field(state: &mut impl Update, field: &[u8]) {
    state.update(&(field.len() as u64).to_be_bytes());
    state.update(field);
}
