//! The per-container record that lets start-up skip loading documents: a
//! container's heads, change count, last log sequence number and changes
//! logged since its snapshot, written to the store's metadata with every
//! group commit (after the changes, in the same flush).
//!
//! It can only lag the log (a crash loses it with or without the changes
//! before it, never keeps it without them), and a lagging record is safe:
//! the container's digest then differs from its peers', reconciliation
//! loads it, and the load brings the newer heads.

use nuwa_state::Hash;
use sha2::{Digest as _, Sha256};

const VERSION: u8 = 1;
/// More heads than this and the record is not written (the container is
/// loaded at start instead).
const MAX_HEADS: usize = 256;

/// The metadata key of `container`'s record (names can be 256 bytes, keys
/// at most 256, so the name is hashed).
pub fn key(container: &str) -> String {
    let digest = Sha256::digest(container.as_bytes());
    format!("heads/{}", hex::encode(&digest[..16]))
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeadsRecord {
    pub heads: Vec<Hash>,
    pub changes: u64,
    pub last_seq: u64,
    pub logged: u64,
}

impl HeadsRecord {
    pub fn encode(&self) -> Option<Vec<u8>> {
        if self.heads.len() > MAX_HEADS {
            return None;
        }
        let mut out = Vec::with_capacity(1 + 4 + 32 * self.heads.len() + 24);
        out.push(VERSION);
        out.extend((self.heads.len() as u32).to_le_bytes());
        for h in &self.heads {
            out.extend(h);
        }
        out.extend(self.changes.to_le_bytes());
        out.extend(self.last_seq.to_le_bytes());
        out.extend(self.logged.to_le_bytes());
        Some(out)
    }

    /// `None` for anything that is not a record of this version.
    pub fn decode(bytes: &[u8]) -> Option<HeadsRecord> {
        let (&version, rest) = bytes.split_first()?;
        if version != VERSION {
            return None;
        }
        let n = u32::from_le_bytes(rest.get(..4)?.try_into().ok()?) as usize;
        if n > MAX_HEADS || rest.len() != 4 + 32 * n + 24 {
            return None;
        }
        let heads = rest[4..4 + 32 * n]
            .chunks_exact(32)
            .map(|c| c.try_into().ok())
            .collect::<Option<Vec<Hash>>>()?;
        let tail = &rest[4 + 32 * n..];
        let u = |i: usize| -> Option<u64> {
            Some(u64::from_le_bytes(
                tail.get(i * 8..i * 8 + 8)?.try_into().ok()?,
            ))
        };
        Some(HeadsRecord {
            heads,
            changes: u(0)?,
            last_seq: u(1)?,
            logged: u(2)?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // Goal: a record round-trips, and anything else (another version, a
    // truncated or padded record, too many heads) is refused, never
    // misread.
    #[test]
    fn records_round_trip_and_bad_bytes_are_refused() {
        let r = HeadsRecord {
            heads: vec![[1; 32], [2; 32]],
            changes: 7,
            last_seq: 9,
            logged: 3,
        };
        let bytes = r.encode().unwrap();
        assert_eq!(HeadsRecord::decode(&bytes), Some(r.clone()));
        let empty = HeadsRecord {
            heads: Vec::new(),
            ..r.clone()
        };
        assert_eq!(HeadsRecord::decode(&empty.encode().unwrap()), Some(empty));
        assert_eq!(HeadsRecord::decode(&bytes[..bytes.len() - 1]), None);
        let mut padded = bytes.clone();
        padded.push(0);
        assert_eq!(HeadsRecord::decode(&padded), None);
        let mut other = bytes;
        other[0] = 2;
        assert_eq!(HeadsRecord::decode(&other), None);
        assert_eq!(HeadsRecord::decode(&[]), None);
        let many = HeadsRecord {
            heads: vec![[0; 32]; MAX_HEADS + 1],
            ..r
        };
        assert_eq!(many.encode(), None);
        assert!(
            key(&"x".repeat(256)).len() <= 256,
            "the store's longest metadata key"
        );
        assert_ne!(key("a"), key("b"));
    }
}
