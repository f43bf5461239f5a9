//! Compression of stored container snapshots (NIP-8's `x-compression`).
//!
//! A compressed snapshot is `"NZ1"` ‖ algorithm byte ‖ compressed Automerge
//! bytes. Plain Automerge documents start with Automerge's own magic bytes
//! (`85 6f 4a 83`), so both forms are told apart on load and snapshots
//! written before compression existed still load. Compression happens
//! before the store encrypts the bytes (ciphertext does not compress).

use std::borrow::Cow;
use std::io::{Read, Write};

use crate::model::Compression;

const MAGIC: &[u8; 3] = b"NZ1";
/// Largest decompressed snapshot accepted (bounds a corrupt or hostile
/// stream).
pub const MAX_SNAPSHOT_BYTES: u64 = 4 * 1024 * 1024 * 1024;

/// Why a snapshot did not compress or decompress.
#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    #[error("{0} compression failed: {1}")]
    Compress(&'static str, std::io::Error),
    #[error("truncated compressed snapshot")]
    Truncated,
    #[error("snapshot compressed with unknown algorithm {0}")]
    UnknownAlgorithm(u8),
    #[error("corrupt compressed snapshot: {0}")]
    Corrupt(String),
    #[error("snapshot decompresses to more than {MAX_SNAPSHOT_BYTES} bytes")]
    TooLarge,
}

fn tag(c: Compression) -> u8 {
    match c {
        Compression::Br => 1,
        Compression::Zstd => 2,
        Compression::Gzip => 3,
    }
}

/// Compresses `doc` (Automerge bytes) with `c`.
pub fn compress(doc: &[u8], c: Compression) -> Result<Vec<u8>, SnapshotError> {
    let mut out = Vec::with_capacity(doc.len() / 2 + 8);
    out.extend_from_slice(MAGIC);
    out.push(tag(c));
    match c {
        Compression::Br => {
            let mut w = brotli::CompressorWriter::new(&mut out, 64 * 1024, 9, 22);
            w.write_all(doc)
                .and_then(|()| w.flush())
                .map_err(|e| SnapshotError::Compress("brotli", e))?;
        }
        Compression::Zstd => {
            let z =
                ruzstd::encoding::compress_to_vec(doc, ruzstd::encoding::CompressionLevel::Fastest);
            out.extend_from_slice(&z);
        }
        Compression::Gzip => {
            let mut w = flate2::write::GzEncoder::new(&mut out, flate2::Compression::default());
            w.write_all(doc)
                .and_then(|()| w.finish().map(drop))
                .map_err(|e| SnapshotError::Compress("gzip", e))?;
        }
    }
    Ok(out)
}

/// The Automerge bytes of a stored snapshot, compressed or not.
pub fn decompress(stored: &[u8]) -> Result<Cow<'_, [u8]>, SnapshotError> {
    let Some(rest) = stored.strip_prefix(MAGIC) else {
        return Ok(Cow::Borrowed(stored));
    };
    let (&alg, body) = rest.split_first().ok_or(SnapshotError::Truncated)?;
    let mut out = Vec::new();
    let read = match alg {
        1 => brotli::Decompressor::new(body, 64 * 1024)
            .take(MAX_SNAPSHOT_BYTES + 1)
            .read_to_end(&mut out),
        2 => ruzstd::decoding::StreamingDecoder::new(body)
            .map_err(|e| SnapshotError::Corrupt(e.to_string()))?
            .take(MAX_SNAPSHOT_BYTES + 1)
            .read_to_end(&mut out),
        3 => flate2::read::GzDecoder::new(body)
            .take(MAX_SNAPSHOT_BYTES + 1)
            .read_to_end(&mut out),
        other => return Err(SnapshotError::UnknownAlgorithm(other)),
    };
    read.map_err(|e| SnapshotError::Corrupt(e.to_string()))?;
    if out.len() as u64 > MAX_SNAPSHOT_BYTES {
        return Err(SnapshotError::TooLarge);
    }
    Ok(Cow::Owned(out))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn doc() -> Vec<u8> {
        let mut d = automerge::AutoCommit::new();
        use automerge::transaction::Transactable;
        for i in 0..200 {
            d.put(automerge::ROOT, format!("k{i}"), "the same text again")
                .unwrap();
        }
        d.save()
    }

    // Goal: each algorithm gives back the bytes it was given, and a plain
    // Automerge document loads as it is.
    #[test]
    fn every_algorithm_round_trips_and_plain_documents_load() {
        let d = doc();
        for c in [Compression::Br, Compression::Zstd, Compression::Gzip] {
            let z = compress(&d, c).unwrap();
            assert_eq!(decompress(&z).unwrap().as_ref(), &d[..], "{c:?}");
        }
        assert!(matches!(decompress(&d).unwrap(), Cow::Borrowed(_)));
    }

    // Goal: a damaged snapshot is a typed error, never a panic or a
    // silently empty document.
    #[test]
    fn damaged_snapshots_are_typed_errors() {
        assert!(matches!(decompress(b"NZ1"), Err(SnapshotError::Truncated)));
        assert!(matches!(
            decompress(b"NZ1\x09abc"),
            Err(SnapshotError::UnknownAlgorithm(9))
        ));
        for c in [Compression::Br, Compression::Zstd, Compression::Gzip] {
            let mut z = compress(&doc(), c).unwrap();
            z.truncate(z.len() / 2);
            let got = decompress(&z);
            assert!(
                matches!(got, Err(SnapshotError::Corrupt(_))),
                "{c:?}: {got:?}"
            );
        }
    }
}
