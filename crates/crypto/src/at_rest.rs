//! Per-device encryption at rest, and keyed ids that hide names on disk.
//!
//! The [`AtRestKey`] never leaves its device. Two independent subkeys are derived from it
//! with HMAC-SHA256, one for XChaCha20-Poly1305 sealing and one for [`AtRestKey::opaque_id`],
//! so that ids can never be confused with ciphertext keys. Storing blobs, and choosing the
//! associated data that pins each blob to its place, is the store's job.

use std::fmt;

use chacha20poly1305::XChaCha20Poly1305;
use chacha20poly1305::aead::{Aead, KeyInit, Payload};
use hmac::{Hmac, Mac};
use sha2::Sha256;
use zeroize::Zeroizing;

use crate::encode::update_field;
use crate::envelope::{NONCE_BYTES, TAG_BYTES};
use crate::{CryptoError, keyfile};

/// First byte of every blob [`AtRestKey::seal`] produces.
pub const AT_REST_BLOB_VERSION: u8 = 1;
/// Bytes a sealed blob adds to its plaintext: version 1 + nonce 24 + tag 16.
pub const AT_REST_OVERHEAD_BYTES: usize = 1 + NONCE_BYTES + TAG_BYTES;

/// Prefix of the key file format `nuwa-at-rest-key-v1:<64 hex digits>\n`.
const FILE_PREFIX: &[u8] = b"nuwa-at-rest-key-v1:";
const FILE_KIND: &str = "at-rest";
/// Labels of the two subkeys; changing either makes every existing store unreadable.
const SEAL_SUBKEY_LABEL: &[u8] = b"nuwa-at-rest-v1/seal";
const ID_SUBKEY_LABEL: &[u8] = b"nuwa-at-rest-v1/opaque-id";

type HmacSha256 = Hmac<Sha256>;

/// A device's key for encryption at rest.
///
/// `Debug` shows nothing of the key; all key material is wiped when the value is dropped.
#[derive(Clone)]
pub struct AtRestKey {
    master: Zeroizing<[u8; 32]>,
    seal_key: Zeroizing<[u8; 32]>,
    id_key: Zeroizing<[u8; 32]>,
}

impl AtRestKey {
    /// Generates a fresh random key.
    ///
    /// # Errors
    /// [`CryptoError::Random`] if the operating system's random number generator fails.
    pub fn generate() -> Result<Self, CryptoError> {
        Ok(Self::from_secret(crate::random_secret()?))
    }

    /// Wraps existing key bytes. The caller's copy of `key` is not wiped by this call.
    #[must_use]
    pub fn from_bytes(key: [u8; 32]) -> Self {
        Self::from_secret(Zeroizing::new(key))
    }

    fn from_secret(master: Zeroizing<[u8; 32]>) -> Self {
        let seal_key = derive_subkey(&master, SEAL_SUBKEY_LABEL);
        let id_key = derive_subkey(&master, ID_SUBKEY_LABEL);
        Self {
            master,
            seal_key,
            id_key,
        }
    }

    /// Encodes the key as the text file `nuwa-at-rest-key-v1:<64 hex digits>\n`.
    #[must_use]
    pub fn to_file_bytes(&self) -> Zeroizing<Vec<u8>> {
        let mut out = Zeroizing::new(Vec::with_capacity(FILE_PREFIX.len() + 64 + 1));
        out.extend_from_slice(FILE_PREFIX);
        keyfile::push_hex(&mut out, self.master.as_slice());
        out.push(b'\n');
        out
    }

    /// Parses a key file written by [`AtRestKey::to_file_bytes`]. A missing final newline or a
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
            .ok_or(malformed("it does not start with nuwa-at-rest-key-v1:"))?;
        let master = keyfile::parse_key_hex(body)
            .ok_or(malformed("the key is not exactly 64 hex digits"))?;
        Ok(Self::from_secret(master))
    }

    /// Encrypts `plaintext` bound to `aad`, returning `version ‖ nonce ‖ ciphertext ‖ tag`.
    ///
    /// `aad` should name where the blob is stored (tree and record key), so that a blob moved
    /// to another place no longer opens. The version byte is authenticated as well.
    ///
    /// # Errors
    /// [`CryptoError::Random`] if no nonce can be drawn; [`CryptoError::Encrypt`] only for a
    /// plaintext beyond the cipher's limit.
    pub fn seal(&self, aad: &[u8], plaintext: &[u8]) -> Result<Vec<u8>, CryptoError> {
        let mut nonce = [0u8; NONCE_BYTES];
        nuwa_entropy::fill(&mut nonce).map_err(CryptoError::Random)?;
        let full_aad = blob_aad(AT_REST_BLOB_VERSION, aad);
        let cipher = XChaCha20Poly1305::new((&*self.seal_key).into());
        let ciphertext = cipher
            .encrypt(
                (&nonce).into(),
                Payload {
                    msg: plaintext,
                    aad: &full_aad,
                },
            )
            .map_err(|_| CryptoError::Encrypt {
                len: plaintext.len(),
            })?;
        let mut blob = Vec::with_capacity(1 + NONCE_BYTES + ciphertext.len());
        blob.push(AT_REST_BLOB_VERSION);
        blob.extend_from_slice(&nonce);
        blob.extend_from_slice(&ciphertext);
        Ok(blob)
    }

    /// Decrypts a blob made by [`AtRestKey::seal`] with the same `aad`.
    ///
    /// # Errors
    /// [`CryptoError::BlobTooShort`], [`CryptoError::UnsupportedBlobVersion`], or
    /// [`CryptoError::Decrypt`] for a wrong key, wrong `aad` or altered bytes.
    pub fn open(&self, aad: &[u8], blob: &[u8]) -> Result<Zeroizing<Vec<u8>>, CryptoError> {
        if blob.len() < AT_REST_OVERHEAD_BYTES {
            return Err(CryptoError::BlobTooShort {
                len: blob.len(),
                min: AT_REST_OVERHEAD_BYTES,
            });
        }
        let Some((&version, rest)) = blob.split_first() else {
            return Err(CryptoError::BlobTooShort {
                len: blob.len(),
                min: AT_REST_OVERHEAD_BYTES,
            });
        };
        if version != AT_REST_BLOB_VERSION {
            return Err(CryptoError::UnsupportedBlobVersion { version });
        }
        let Some((nonce, ciphertext)) = rest.split_first_chunk::<NONCE_BYTES>() else {
            return Err(CryptoError::BlobTooShort {
                len: blob.len(),
                min: AT_REST_OVERHEAD_BYTES,
            });
        };
        let full_aad = blob_aad(version, aad);
        let cipher = XChaCha20Poly1305::new((&*self.seal_key).into());
        cipher
            .decrypt(
                nonce.into(),
                Payload {
                    msg: ciphertext,
                    aad: &full_aad,
                },
            )
            .map(Zeroizing::new)
            .map_err(|_| CryptoError::Decrypt)
    }

    /// A keyed 32-byte id for `name` within `domain`: HMAC-SHA256 under a subkey of this key
    /// over `lp(domain) ‖ name`.
    ///
    /// The same key, domain and name always give the same id; without the key the id reveals
    /// nothing about the name, so it can serve as a storage key on disk.
    #[must_use]
    pub fn opaque_id(&self, domain: &str, name: &[u8]) -> [u8; 32] {
        let mut mac = keyed_mac(&self.id_key);
        update_field(&mut mac, domain.as_bytes());
        Mac::update(&mut mac, name);
        mac.finalize().into_bytes().into()
    }
}

impl fmt::Debug for AtRestKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("AtRestKey(<redacted>)")
    }
}

fn keyed_mac(key: &[u8; 32]) -> HmacSha256 {
    // Invariant: HMAC accepts keys of any length (short ones are zero-padded to the block),
    // so `new_from_slice` cannot fail here.
    #[allow(clippy::expect_used)]
    <HmacSha256 as KeyInit>::new_from_slice(key).expect("hmac accepts keys of any length")
}

fn derive_subkey(master: &[u8; 32], label: &[u8]) -> Zeroizing<[u8; 32]> {
    let mut mac = keyed_mac(master);
    Mac::update(&mut mac, label);
    Zeroizing::new(mac.finalize().into_bytes().into())
}

fn blob_aad(version: u8, aad: &[u8]) -> Vec<u8> {
    let mut full = Vec::with_capacity(1 + aad.len());
    full.push(version);
    full.extend_from_slice(aad);
    full
}
