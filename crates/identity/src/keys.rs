//! Device keys: Ed25519 signing keys that are both a device's libp2p identity
//! and its `verificationMethod` in the agent's DID document.
//!
//! This module holds secret key material in memory, zeroizes it on drop and
//! never prints it. It defines the text format of a seed file but leaves
//! reading and writing files (and their permissions) to the node crate.

use std::fmt;

use ed25519_dalek::{Signature, Signer, SigningKey, VerifyingKey};
use sha2::{Digest, Sha256};
use zeroize::Zeroizing;

/// Prefix of the seed-file text format; the version number lets the format change later.
pub const SEED_FILE_PREFIX: &str = "nuwa-ed25519-seed-v1:";

/// Errors from creating, loading or using keys.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum KeyError {
    /// No random bytes could be had (see [`nuwa_entropy::fill`]).
    #[error("cannot read random bytes for a key or nonce")]
    Random(#[source] nuwa_entropy::Error),
    /// The bytes of a key file are not in the seed-file format.
    #[error(
        "key file is not a valid nuwa seed file ({reason}); expected `{SEED_FILE_PREFIX}<64 hex chars>`"
    )]
    SeedFile {
        /// What exactly is wrong, without echoing any secret bytes.
        reason: &'static str,
    },
    /// The 32 bytes are not a valid Ed25519 public key (not a curve point).
    #[error("public key {public_hex} is not a valid ed25519 point")]
    InvalidPublicKey {
        /// The rejected key, hex encoded.
        public_hex: String,
    },
    /// The signature does not verify under the public key.
    #[error("ed25519 signature does not verify under public key {public_hex}")]
    BadSignature {
        /// The key the signature was checked against, hex encoded.
        public_hex: String,
    },
}

/// A device's Ed25519 signing key.
///
/// The wrapped `SigningKey` zeroizes itself on drop (ed25519-dalek's `zeroize`
/// feature), so this wrapper does too. It is deliberately not `Clone`: a copy
/// of a secret should be an explicit `from_seed(&key.seed())`.
pub struct DeviceKey {
    signing: SigningKey,
}

impl DeviceKey {
    /// Creates a fresh key from [`nuwa_entropy::fill`]: the operating system's random number
    /// generator (or a simulation's seeded stream, so that PeerIds replay).
    pub fn generate() -> Result<DeviceKey, KeyError> {
        let mut seed = Zeroizing::new([0u8; 32]);
        nuwa_entropy::fill(seed.as_mut_slice()).map_err(KeyError::Random)?;
        Ok(DeviceKey::from_seed(&seed))
    }

    /// Rebuilds a key from its 32-byte RFC 8032 seed.
    pub fn from_seed(seed: &[u8; 32]) -> DeviceKey {
        DeviceKey {
            signing: SigningKey::from_bytes(seed),
        }
    }

    /// The 32-byte seed, for handing to libp2p or writing a key file.
    pub fn seed(&self) -> Zeroizing<[u8; 32]> {
        Zeroizing::new(self.signing.to_bytes())
    }

    /// The raw 32-byte Ed25519 public key.
    pub fn public(&self) -> [u8; 32] {
        self.signing.verifying_key().to_bytes()
    }

    /// Signs `msg` (callers sign a domain-separated hash, see [`crate::nip2`]).
    pub fn sign(&self, msg: &[u8]) -> [u8; 64] {
        self.signing.sign(msg).to_bytes()
    }

    /// The underlying dalek key, for crates that need the type itself.
    pub fn signing_key(&self) -> &SigningKey {
        &self.signing
    }

    /// The X25519 secret that pairs with [`crate::did_key::x25519_public_from_ed25519`]
    /// of this key's public key (the first half of SHA-512(seed), RFC 8032 / RFC 7748).
    pub fn x25519_secret(&self) -> Zeroizing<[u8; 32]> {
        Zeroizing::new(self.signing.to_scalar_bytes())
    }

    /// Parses a key file's content: `nuwa-ed25519-seed-v1:<64 hex chars>` with
    /// an optional single trailing newline.
    pub fn from_seed_file_bytes(bytes: &[u8]) -> Result<DeviceKey, KeyError> {
        let body = bytes
            .strip_prefix(SEED_FILE_PREFIX.as_bytes())
            .ok_or(KeyError::SeedFile {
                reason: "missing format prefix",
            })?;
        let body = body
            .strip_suffix(b"\r\n")
            .or_else(|| body.strip_suffix(b"\n"))
            .unwrap_or(body);
        if body.len() != 64 {
            return Err(KeyError::SeedFile {
                reason: "seed must be exactly 64 hex characters",
            });
        }
        let mut seed = Zeroizing::new([0u8; 32]);
        hex::decode_to_slice(body, seed.as_mut_slice()).map_err(|_| KeyError::SeedFile {
            reason: "seed contains a non-hex character",
        })?;
        Ok(DeviceKey::from_seed(&seed))
    }

    /// Renders the key file content for this key (see [`DeviceKey::from_seed_file_bytes`]).
    pub fn to_seed_file_bytes(&self) -> Zeroizing<Vec<u8>> {
        let seed = self.seed();
        const HEX_DIGITS: &[u8; 16] = b"0123456789abcdef";
        // Encoded by hand straight into the zeroizing buffer, so no intermediate
        // `String` copy of the secret is left behind in freed memory.
        let mut out = Zeroizing::new(Vec::with_capacity(SEED_FILE_PREFIX.len() + 65));
        out.extend_from_slice(SEED_FILE_PREFIX.as_bytes());
        for byte in seed.iter() {
            out.push(HEX_DIGITS[usize::from(byte >> 4)]);
            out.push(HEX_DIGITS[usize::from(byte & 0x0f)]);
        }
        out.push(b'\n');
        out
    }
}

// `SigningKey` wipes its secret in its own `Drop` (ed25519-dalek's `zeroize`
// feature); this assertion breaks the build if that feature is ever lost, and
// the marker impl below passes the guarantee on to `DeviceKey`.
const _: () = {
    const fn assert_zeroize_on_drop<T: zeroize::ZeroizeOnDrop>() {}
    assert_zeroize_on_drop::<SigningKey>();
};

impl zeroize::ZeroizeOnDrop for DeviceKey {}

impl fmt::Debug for DeviceKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Only public information: the secret must never reach logs.
        f.debug_struct("DeviceKey")
            .field("public", &hex::encode(self.public()))
            .field("secret", &"<redacted>")
            .finish()
    }
}

/// Verifies an Ed25519 signature with the strict rules (no small-order keys,
/// canonical `S`), so a signature cannot be malleated into a second valid one.
pub fn verify_ed25519(public: &[u8; 32], msg: &[u8], sig: &[u8; 64]) -> Result<(), KeyError> {
    let key = VerifyingKey::from_bytes(public).map_err(|_| KeyError::InvalidPublicKey {
        public_hex: hex::encode(public),
    })?;
    key.verify_strict(msg, &Signature::from_bytes(sig))
        .map_err(|_| KeyError::BadSignature {
            public_hex: hex::encode(public),
        })
}

/// The OperationalContextID (DID URL fragment) this project gives a device key:
/// `device-` followed by the first 12 hex characters of SHA-256(public key).
///
/// It is derived rather than chosen so that every device computes the same
/// fragment for a key, and it reveals nothing about the device itself.
pub fn context_id_for(public: &[u8; 32]) -> String {
    let digest: [u8; 32] = Sha256::digest(public).into();
    let mut id = String::from("device-");
    id.push_str(&hex::encode(&digest[..6]));
    id
}

#[cfg(test)]
mod tests {
    use super::*;

    // Goal: the RFC 8032 test vector 1 holds for our wrapper (seed -> public, signature over "").
    #[test]
    fn rfc8032_vector_1() {
        let seed: [u8; 32] =
            hex_array("9d61b19deffd5a60ba844af492ec2cc44449c5697b326919703bac031cae7f60");
        let key = DeviceKey::from_seed(&seed);
        assert_eq!(
            hex::encode(key.public()),
            "d75a980182b10ab7d54bfed3c964073a0ee172f3daa62325af021a68f707511a"
        );
        let sig = key.sign(b"");
        assert_eq!(
            hex::encode(sig),
            "e5564300c360ac729086e2cc806e828a84877f1eb8e5d974d873e06522490155\
             5fb8821590a33bacc61e39701cf9b46bd25bf5f0595bbe24655141438e7a100b"
        );
        assert!(verify_ed25519(&key.public(), b"", &sig).is_ok());
        assert_eq!(*key.seed(), seed);
    }

    // Goal: signatures reject a changed message, a changed signature and a foreign key.
    #[test]
    fn verify_rejects_tampering() {
        let a = DeviceKey::from_seed(&[1; 32]);
        let b = DeviceKey::from_seed(&[2; 32]);
        let sig = a.sign(b"hello");
        assert!(verify_ed25519(&a.public(), b"hello", &sig).is_ok());
        assert!(matches!(
            verify_ed25519(&a.public(), b"hellO", &sig),
            Err(KeyError::BadSignature { .. })
        ));
        let mut bad = sig;
        bad[0] ^= 1;
        assert!(verify_ed25519(&a.public(), b"hello", &bad).is_err());
        assert!(verify_ed25519(&b.public(), b"hello", &sig).is_err());
    }

    // Goal: generated keys differ and round-trip through the seed-file format.
    #[test]
    fn generate_and_seed_file_round_trip() {
        let k1 = DeviceKey::generate().expect("os rng works in tests");
        let k2 = DeviceKey::generate().expect("os rng works in tests");
        assert_ne!(k1.public(), k2.public());
        let file = k1.to_seed_file_bytes();
        assert!(file.starts_with(SEED_FILE_PREFIX.as_bytes()));
        assert!(file.ends_with(b"\n"));
        let back = DeviceKey::from_seed_file_bytes(&file).expect("own output parses");
        assert_eq!(back.public(), k1.public());
        // Without the trailing newline, and with CRLF, it parses too.
        let trimmed = &file[..file.len() - 1];
        assert!(DeviceKey::from_seed_file_bytes(trimmed).is_ok());
        let mut crlf = trimmed.to_vec();
        crlf.extend_from_slice(b"\r\n");
        assert!(DeviceKey::from_seed_file_bytes(&crlf).is_ok());
    }

    // Goal: every malformed seed file is rejected with SeedFile; table of inputs.
    #[test]
    fn seed_file_rejects_garbage() {
        let good_hex = "00".repeat(32);
        let cases: Vec<(&str, Vec<u8>)> = vec![
            ("empty", b"".to_vec()),
            ("raw 32 bytes", vec![7u8; 32]),
            ("no prefix", good_hex.clone().into_bytes()),
            (
                "wrong version",
                format!("nuwa-ed25519-seed-v2:{good_hex}\n").into_bytes(),
            ),
            (
                "short",
                format!("{SEED_FILE_PREFIX}{}\n", "00".repeat(31)).into_bytes(),
            ),
            (
                "long",
                format!("{SEED_FILE_PREFIX}{}\n", "00".repeat(33)).into_bytes(),
            ),
            (
                "non-hex",
                format!("{SEED_FILE_PREFIX}{}zz\n", "00".repeat(31)).into_bytes(),
            ),
            (
                "two newlines",
                format!("{SEED_FILE_PREFIX}{good_hex}\n\n").into_bytes(),
            ),
            (
                "leading space",
                format!(" {SEED_FILE_PREFIX}{good_hex}\n").into_bytes(),
            ),
        ];
        for (name, input) in cases {
            assert!(
                matches!(
                    DeviceKey::from_seed_file_bytes(&input),
                    Err(KeyError::SeedFile { .. })
                ),
                "case {name} should be rejected"
            );
        }
    }

    // Goal: Debug output never contains the seed, in hex or in bytes.
    #[test]
    fn debug_redacts_secret() {
        let key = DeviceKey::from_seed(&[0xab; 32]);
        let shown = format!("{key:?}");
        assert!(shown.contains("redacted"));
        assert!(!shown.contains(&"ab".repeat(32)));
        assert!(!shown.contains("171"));
    }

    // Goal: context ids are "device-" plus 12 hex chars of SHA-256(public), checked on a known key.
    #[test]
    fn context_id_shape() {
        let public = [0u8; 32];
        // SHA-256 of 32 zero bytes starts with 66687aadf862.
        assert_eq!(context_id_for(&public), "device-66687aadf862");
    }

    // Goal: an all-zero "public key" that is a small-order point is refused by strict verification.
    #[test]
    fn strict_verification_rejects_small_order_key() {
        let mut identity_point = [0u8; 32];
        identity_point[0] = 1; // the Edwards identity, a small-order point
        let sig = [0u8; 64];
        assert!(verify_ed25519(&identity_point, b"x", &sig).is_err());
    }

    fn hex_array(s: &str) -> [u8; 32] {
        let mut out = [0u8; 32];
        hex::decode_to_slice(s, &mut out).expect("test constant is hex");
        out
    }
}
