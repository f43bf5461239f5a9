//! Compression of stored container snapshots (`x-compression` of NIP-8).
//!
//! A compressed snapshot is `"NZ1"` ‖ algorithm byte ‖ compressed Automerge
//! bytes. Plain Automerge documents start with Automerge's own magic bytes
//! (`85 6f 4a 83`), so both forms are told apart on load and snapshots
//! written before compression existed still load. Compression happens
//! before the store encrypts the bytes (ciphertext does not compress).

use std::io::{Read, Write};

use anyhow::{Context, Result, bail};
use nuwa_agent::asm_model::model::Compression;

const MAGIC: &[u8; 3] = b"NZ1";
/// Largest decompressed snapshot accepted (bounds a corrupt or hostile
/// stream).
pub const MAX_SNAPSHOT_BYTES: u64 = 4 * 1024 * 1024 * 1024;

fn tag(c: Compression) -> u8 {
    match c {
        Compression::Br => 1,
        Compression::Zstd => 2,
        Compression::Gzip => 3,
    }
}

/// Compresses `doc` (Automerge bytes) with `c`.
pub fn compress(doc: &[u8], c: Compression) -> Result<Vec<u8>> {
    let mut out = Vec::with_capacity(doc.len() / 2 + 8);
    out.extend_from_slice(MAGIC);
    out.push(tag(c));
    match c {
        Compression::Br => {
            let mut w = brotli::CompressorWriter::new(&mut out, 64 * 1024, 9, 22);
            w.write_all(doc).context("brotli compression")?;
            w.flush().context("brotli compression")?;
        }
        Compression::Zstd => {
            let z =
                ruzstd::encoding::compress_to_vec(doc, ruzstd::encoding::CompressionLevel::Fastest);
            out.extend_from_slice(&z);
        }
        Compression::Gzip => {
            let mut w = flate2::write::GzEncoder::new(&mut out, flate2::Compression::default());
            w.write_all(doc).context("gzip compression")?;
            w.finish().context("gzip compression")?;
        }
    }
    Ok(out)
}

/// The Automerge bytes of a stored snapshot, compressed or not.
pub fn decompress(stored: &[u8]) -> Result<std::borrow::Cow<'_, [u8]>> {
    let Some(rest) = stored.strip_prefix(MAGIC) else {
        return Ok(std::borrow::Cow::Borrowed(stored));
    };
    let Some((&alg, body)) = rest.split_first() else {
        bail!("truncated compressed snapshot");
    };
    let mut out = Vec::new();
    let read = match alg {
        1 => brotli::Decompressor::new(body, 64 * 1024)
            .take(MAX_SNAPSHOT_BYTES + 1)
            .read_to_end(&mut out),
        2 => {
            let dec = ruzstd::decoding::StreamingDecoder::new(body)
                .map_err(|e| anyhow::anyhow!("corrupt zstd snapshot: {e}"))?;
            dec.take(MAX_SNAPSHOT_BYTES + 1).read_to_end(&mut out)
        }
        3 => flate2::read::GzDecoder::new(body)
            .take(MAX_SNAPSHOT_BYTES + 1)
            .read_to_end(&mut out),
        other => bail!("snapshot compressed with unknown algorithm {other}"),
    };
    read.context("corrupt compressed snapshot")?;
    if out.len() as u64 > MAX_SNAPSHOT_BYTES {
        bail!("snapshot decompresses to more than {MAX_SNAPSHOT_BYTES} bytes");
    }
    Ok(std::borrow::Cow::Owned(out))
}

#[cfg(test)]
mod tests {
    use super::*;

    // Goal: each algorithm round-trips an Automerge document and shrinks a
    // repetitive one; plain snapshots pass through; corrupt input is an
    // error, never a panic.
    #[test]
    fn round_trip_each_algorithm() {
        let mut doc = nuwa_agent::state::automerge::AutoCommit::new();
        for i in 0..500 {
            nuwa_agent::state::automerge::transaction::Transactable::put(
                &mut doc,
                nuwa_agent::state::automerge::ROOT,
                format!("key{i}"),
                "the same value again and again",
            )
            .unwrap();
        }
        let plain = doc.save();
        assert_eq!(&*decompress(&plain).unwrap(), &plain[..]);
        for c in [Compression::Br, Compression::Zstd, Compression::Gzip] {
            let z = compress(&plain, c).unwrap();
            assert!(
                z.len() < plain.len(),
                "{c:?}: {} >= {}",
                z.len(),
                plain.len()
            );
            assert_eq!(&*decompress(&z).unwrap(), &plain[..], "{c:?}");
            let mut bad = z.clone();
            let n = bad.len();
            bad.truncate(n / 2);
            assert!(decompress(&bad).is_err() || *decompress(&bad).unwrap() != plain[..]);
        }
        assert!(decompress(b"NZ1").is_err());
        assert!(decompress(b"NZ1\x09abc").is_err());
    }
}
