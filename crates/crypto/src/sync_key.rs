//! The agent-wide symmetric sync key of one key epoch.
//!
//! Every device of an agent holds the same sync key for the current epoch; revoking a device
//! opens a new epoch with a fresh key. Distributing keys (sealing them to devices' X25519 keys,
//! pairing) and storing key files are left to other crates.

use std::fmt;

use zeroize::Zeroizing;

use crate::{CryptoError, keyfile};

/// Prefix of the sync key file format `nuwa-sync-key-v1:<epoch>:<64 hex digits>\n`.
const FILE_PREFIX: &[u8] = b"nuwa-sync-key-v1:";
const FILE_KIND: &str = "sync";

/// The agent-wide symmetric key for one key epoch.
///
/// `Debug` shows the epoch only; the key bytes are wiped when the value is dropped.
#[derive(Clone)]
pub struct SyncKey {
    epoch: u64,
    key: Zeroizing<[u8; 32]>,
}

impl SyncKey {
    /// Generates a fresh random key for `epoch`.
    ///
    /// # Errors
    /// [`CryptoError::Random`] if the operating system's random number generator fails.
    pub fn generate(epoch: u64) -> Result<Self, CryptoError> {
        Ok(Self {
            epoch,
            key: crate::random_secret()?,
        })
    }

    /// Wraps existing key bytes for `epoch`.
    ///
    /// The caller's copy of `key` is not wiped by this call; pass a value the caller no longer
    /// holds elsewhere, or zeroize the original.
    #[must_use]
    pub fn from_bytes(epoch: u64, key: [u8; 32]) -> Self {
        Self {
            epoch,
            key: Zeroizing::new(key),
        }
    }

    /// The key epoch this key belongs to.
    #[must_use]
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// The raw key bytes, for sealing the key to another device. Do not log or persist them in
    /// plaintext.
    #[must_use]
    pub fn expose_secret(&self) -> &[u8; 32] {
        &self.key
    }

    /// Encodes the key as the text file `nuwa-sync-key-v1:<epoch>:<64 hex digits>\n`.
    #[must_use]
    pub fn to_file_bytes(&self) -> Zeroizing<Vec<u8>> {
        let mut out = Zeroizing::new(Vec::with_capacity(FILE_PREFIX.len() + 20 + 1 + 64 + 1));
        out.extend_from_slice(FILE_PREFIX);
        out.extend_from_slice(self.epoch.to_string().as_bytes());
        out.push(b':');
        keyfile::push_hex(&mut out, self.key.as_slice());
        out.push(b'\n');
        out
    }

    /// Parses a key file written by [`SyncKey::to_file_bytes`]. A missing final newline or a
    /// `\r\n` ending is accepted.
    ///
    /// # Errors
    /// [`CryptoError::MalformedKeyFile`] naming the part that is wrong.
    pub fn from_file_bytes(contents: &[u8]) -> Result<Self, CryptoError> {
        let malformed = |reason| CryptoError::MalformedKeyFile {
            kind: FILE_KIND,
            reason,
        };
        let body = keyfile::strip_frame(contents, FILE_PREFIX)
            .ok_or(malformed("it does not start with nuwa-sync-key-v1:"))?;
        let mut fields = body.splitn(2, |&b| b == b':');
        let (Some(epoch_text), Some(key_text)) = (fields.next(), fields.next()) else {
            return Err(malformed("it has no ':' between epoch and key"));
        };
        let epoch = parse_epoch(epoch_text).ok_or(malformed("the epoch is not a decimal u64"))?;
        let key = keyfile::parse_key_hex(key_text)
            .ok_or(malformed("the key is not exactly 64 hex digits"))?;
        Ok(Self { epoch, key })
    }
}

/// Parses plain ASCII decimal digits; `u64::from_str` alone would also accept a leading `+`.
fn parse_epoch(text: &[u8]) -> Option<u64> {
    if text.is_empty() || !text.iter().all(u8::is_ascii_digit) {
        return None;
    }
    std::str::from_utf8(text).ok()?.parse().ok()
}

impl fmt::Debug for SyncKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SyncKey")
            .field("epoch", &self.epoch)
            .field("key", &"<redacted>")
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // Goal: the file format round-trips and rejects each malformed shape; method: a table of
    // inputs with the expected outcome.
    #[test]
    fn file_format_round_trip_and_rejects() {
        let key = SyncKey::from_bytes(7, [0xab; 32]);
        let text = key.to_file_bytes();
        assert_eq!(
            text.as_slice(),
            format!("nuwa-sync-key-v1:7:{}\n", "ab".repeat(32)).as_bytes()
        );
        let back = SyncKey::from_file_bytes(&text).expect("own output parses");
        assert_eq!(back.epoch(), 7);
        assert_eq!(back.expose_secret(), &[0xab; 32]);

        let hex = "ab".repeat(32);
        let cases: &[(String, Option<u64>)] = &[
            (format!("nuwa-sync-key-v1:0:{hex}"), Some(0)),
            (
                format!("nuwa-sync-key-v1:18446744073709551615:{hex}\r\n"),
                Some(u64::MAX),
            ),
            (format!("nuwa-sync-key-v1:1:{}\n", "AB".repeat(32)), Some(1)),
            (format!("nuwa-sync-key-v2:1:{hex}\n"), None),
            (format!("nuwa-sync-key-v1:+1:{hex}\n"), None),
            (format!("nuwa-sync-key-v1::{hex}\n"), None),
            (
                format!("nuwa-sync-key-v1:18446744073709551616:{hex}\n"),
                None,
            ),
            (format!("nuwa-sync-key-v1:1{hex}\n"), None),
            (format!("nuwa-sync-key-v1:1:{}\n", "ab".repeat(31)), None),
            (format!("nuwa-sync-key-v1:1:{hex}ab\n"), None),
            (format!("nuwa-sync-key-v1:1:{}zz\n", "ab".repeat(31)), None),
            (format!("nuwa-sync-key-v1:1:{hex}\n\n"), None),
            (String::new(), None),
        ];
        for (input, want_epoch) in cases {
            let got = SyncKey::from_file_bytes(input.as_bytes());
            match (want_epoch, got) {
                (Some(epoch), Ok(key)) => {
                    assert_eq!(key.epoch(), *epoch, "{input:?}");
                    assert_eq!(key.expose_secret(), &[0xab; 32], "{input:?}");
                }
                (None, Err(CryptoError::MalformedKeyFile { kind: "sync", .. })) => {}
                (want, got) => panic!("{input:?}: want epoch {want:?}, got {got:?}"),
            }
        }
    }

    // Goal: Debug never shows key bytes; method: format a key with a recognisable pattern.
    #[test]
    fn debug_redacts_key() {
        let key = SyncKey::from_bytes(3, [0x5a; 32]);
        let shown = format!("{key:?}");
        assert!(shown.contains("epoch: 3"), "{shown}");
        assert!(!shown.contains("90") && !shown.contains("5a"), "{shown}");
    }

    // Goal: generated keys are random; method: two generations differ.
    #[test]
    fn generate_is_random() {
        let a = SyncKey::generate(1).expect("rng works");
        let b = SyncKey::generate(1).expect("rng works");
        assert_ne!(a.expose_secret(), b.expose_secret());
        assert_eq!(a.epoch(), 1);
    }
}
