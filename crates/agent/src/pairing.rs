//! What both ends of pairing share: where a new device is published, and
//! the grant it receives.
//!
//! A device waiting to pair (`nuwa-node pair`) publishes only its code's
//! nameplate (the first two symbols, see `PairingCode::nameplate`):
//! - on the LAN as an mDNS announcement of the usual service whose agent
//!   field is the pseudo-DID `did:nuwapair:<nameplate>` (announcements carry
//!   DIDs), self-signed by its new device key;
//! - at rendezvous servers under a namespace derived from the nameplate.
//!
//! The approving device finds candidates there, dials them and runs the
//! SPAKE2 exchange of `nuwa_crypto::pairing` as `Frame::Pairing` steps on
//! the ordinary `/nuwa/sync/1` protocol. The grant it sends (sealed under the
//! PAKE session key) is a [`GrantPlaintext`].

use nuwa_crypto::epoch::KeyRing;
use nuwa_identity::chain::DidChain;
use nuwa_identity::document::Relationship;
use nuwa_identity::keys::context_id_for;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use zeroize::Zeroizing;

/// Why a grant or handover could not be made or opened. Nothing was
/// written in any case.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum GrantError {
    /// Refused; the message says why.
    #[error("{0}")]
    Refused(String),
    /// A part of it is malformed or does not open.
    #[error("{what}")]
    Invalid {
        what: String,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
}

type Result<T> = std::result::Result<T, GrantError>;

/// Returns a [`GrantError::Refused`] with a formatted message.
macro_rules! bail {
    ($($arg:tt)*) => {
        return Err(GrantError::Refused(format!($($arg)*)))
    };
}

/// Names what failed, keeping the cause as the source.
trait Because<T> {
    fn because(self, what: impl Into<String>) -> Result<T>;
}

impl<T, E: std::error::Error + Send + Sync + 'static> Because<T> for std::result::Result<T, E> {
    fn because(self, what: impl Into<String>) -> Result<T> {
        self.map_err(|e| GrantError::Invalid {
            what: what.into(),
            source: Box::new(e),
        })
    }
}

impl<T> Because<T> for Option<T> {
    fn because(self, what: impl Into<String>) -> Result<T> {
        self.ok_or_else(|| GrantError::Refused(what.into()))
    }
}

/// Prefix of the mDNS agent field of a device waiting to pair.
pub const PAIR_AGENT_PREFIX: &str = "did:nuwapair:";

/// The mDNS agent field for a nameplate.
pub fn mdns_agent(nameplate: &str) -> String {
    format!("{PAIR_AGENT_PREFIX}{nameplate}")
}

/// The rendezvous namespace for a nameplate.
pub fn rendezvous_namespace(nameplate: &str) -> String {
    let h = Sha256::digest(format!("nuwa-pair-v1:{nameplate}").as_bytes());
    format!("nuwa-pair/{}", hex::encode(&h[..12]))
}

/// What the approving device hands the new one, sealed under the PAKE key.
#[derive(Serialize, Deserialize)]
pub struct GrantPlaintext {
    pub agent_did: String,
    /// The DID log including the update that adds the new device.
    pub did_log: DidChain,
    /// The key ring file (`KeyRing::to_file_bytes`), hex.
    pub key_ring_hex: String,
    /// The grant of the current epoch, hex (empty at epoch 0).
    #[serde(default)]
    pub epoch_grant_hex: String,
    /// The name the new device was registered under.
    pub name: String,
    /// A recovery handover (`device approve --recovery`): every key of the
    /// key ring sealed to the agent's recovery key (its X25519 form), hex of
    /// `epoch (8, big-endian) ‖ ephemeral public (32) ‖ nonce (24) ‖
    /// ciphertext (48)`, so that only whoever holds the recovery words opens
    /// them. `key_ring_hex` is then empty, and the log does not list the new
    /// device: it lists itself, signing with the words (`recover`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub recovery_sealed_hex: Vec<String>,
    /// A recovery handover's device book: each device the chain lists, with
    /// its name and when the handing device last saw it, and the handing
    /// device itself, so that the person recovering can tell which device
    /// was lost (it never says hello again) and `device list` on the new
    /// home names them. Only a handover carries it: a plain grant makes a
    /// device that learns names from its peers' Hellos, and a plain
    /// grant's plaintext stays byte for byte what it was. Read it through
    /// [`GrantPlaintext::device_book`], which bounds and checks it.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub devices: Vec<KnownDevice>,
}

/// One device of a handover's device book, as the handing device knows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KnownDevice {
    pub context_id: String,
    /// Empty when the handing device never learned it.
    #[serde(default)]
    pub name: String,
    /// Unix ms the handing device last saw it verified (0: never).
    #[serde(default)]
    pub last_seen_ms: u64,
}

/// Most devices a handover's device book keeps (the `Seen` book's own
/// bound; what is over it is dropped on receipt).
const MAX_HANDOVER_DEVICES: usize = crate::devices::MAX_SEEN;

/// The context id a recovery handover seals to (bound into each sealed key).
const HANDOVER_CONTEXT: &str = "nuwa-recovery-handover";

/// Most keys a handover may carry (the key ring's own bound).
const MAX_HANDOVER_KEYS: usize = 1024;

impl Drop for GrantPlaintext {
    fn drop(&mut self) {
        zeroize::Zeroize::zeroize(&mut self.key_ring_hex);
    }
}

impl GrantPlaintext {
    pub fn new(log: &DidChain, keys: &KeyRing, grant: &[u8], name: &str) -> Self {
        GrantPlaintext {
            agent_did: log.did().to_owned(),
            did_log: log.clone(),
            key_ring_hex: hex::encode(keys.to_file_bytes().as_slice()),
            epoch_grant_hex: hex::encode(grant),
            name: name.to_owned(),
            recovery_sealed_hex: Vec::new(),
            devices: Vec::new(),
        }
    }

    /// A recovery handover: the log as it is and every epoch key sealed to
    /// the agent's recovery key, which the current document must list.
    pub fn handover(log: &DidChain, keys: &KeyRing, grant: &[u8], name: &str) -> Result<Self> {
        let doc = log.current();
        let recovery = doc
            .verification_method
            .iter()
            .find(|m| {
                nuwa_identity::recovery::is_recovery_fragment(&m.id)
                    && doc.has_relationship(&m.id, Relationship::CapabilityDelegation)
            })
            .because(
                "this agent has no recovery key, so nothing can be handed over for recovery \
                 (an admin device adds one with `nuwa-node recovery create`)",
            )?;
        let ed = recovery
            .ed25519_public()
            .because("the recovery key is not an Ed25519 key")?;
        let x = nuwa_identity::did_key::x25519_public_from_ed25519(&ed)
            .because("cannot derive the recovery key's key-agreement form")?;
        let mut sealed = Vec::new();
        for epoch in keys.epochs() {
            let key = keys.get(epoch).because("key ring epoch vanished")?;
            let s = nuwa_crypto::epoch::seal_key_to(&x, HANDOVER_CONTEXT, log.did(), key)
                .because("cannot seal a key for the handover")?;
            let mut bytes = Vec::with_capacity(8 + 32 + 24 + 48);
            bytes.extend_from_slice(&s.epoch.to_be_bytes());
            bytes.extend_from_slice(&s.ephemeral_public);
            bytes.extend_from_slice(&s.nonce);
            bytes.extend_from_slice(&s.ciphertext);
            sealed.push(hex::encode(bytes));
        }
        Ok(GrantPlaintext {
            agent_did: log.did().to_owned(),
            did_log: log.clone(),
            key_ring_hex: String::new(),
            epoch_grant_hex: hex::encode(grant),
            name: name.to_owned(),
            recovery_sealed_hex: sealed,
            devices: Vec::new(),
        })
    }

    /// Adds the handing device's device book to a handover: each device the
    /// current document lists, with what `seen` holds of it, and the
    /// handing device `me` as `my_name`, seen `now_ms`. At most
    /// [`MAX_HANDOVER_DEVICES`], names as [`crate::devices::Seen`] keeps them.
    pub fn with_device_book(
        mut self,
        seen: &crate::devices::Seen,
        me: &str,
        my_name: &str,
        now_ms: u64,
    ) -> Self {
        self.devices = crate::devices::listed_devices(self.did_log.current())
            .into_iter()
            .take(MAX_HANDOVER_DEVICES)
            .map(|ctx| {
                let (name, last_seen_ms) = if ctx == me {
                    (my_name, now_ms)
                } else {
                    seen.get(&ctx).unwrap_or(("", 0))
                };
                KnownDevice {
                    name: name.to_owned(),
                    last_seen_ms,
                    context_id: ctx,
                }
            })
            .collect();
        self
    }

    /// The device book of a handover, as far as it can be believed: only
    /// devices the current document lists, each once, at most
    /// [`MAX_HANDOVER_DEVICES`]; a name over 64 bytes or with control
    /// characters is dropped (the device stays, unnamed). The book is a
    /// help for the person, never worth failing a recovery over: what is
    /// wrong in it is left out, not refused.
    pub fn device_book(&self) -> Vec<KnownDevice> {
        let listed: std::collections::BTreeSet<String> =
            crate::devices::listed_devices(self.did_log.current())
                .into_iter()
                .collect();
        let mut kept = std::collections::BTreeSet::new();
        let mut book = Vec::new();
        for d in &self.devices {
            if book.len() >= MAX_HANDOVER_DEVICES {
                break;
            }
            if !listed.contains(&d.context_id) || !kept.insert(d.context_id.as_str()) {
                continue;
            }
            let name_ok = d.name.len() <= nuwa_proto::MAX_DEVICE_NAME_BYTES
                && !d.name.chars().any(char::is_control);
            book.push(KnownDevice {
                context_id: d.context_id.clone(),
                name: if name_ok {
                    d.name.clone()
                } else {
                    String::new()
                },
                last_seen_ms: d.last_seen_ms,
            });
        }
        book
    }

    /// Whether this is a recovery handover rather than a grant.
    pub fn is_handover(&self) -> bool {
        !self.recovery_sealed_hex.is_empty()
    }

    /// Opens a recovery handover with the recovery key of the words: the
    /// log verifies and is this agent's, the words' key is its recovery
    /// key, and every sealed epoch key opens. Returns the log and the ring.
    pub fn open_handover(
        bytes: &[u8],
        recovery: &nuwa_identity::keys::DeviceKey,
        now_secs: i64,
    ) -> Result<(Self, KeyRing)> {
        let g: GrantPlaintext = serde_json::from_slice(bytes)
            .because("the handover from the approving device is malformed")?;
        if !g.is_handover() {
            bail!("the approving device sent a grant, not a recovery handover");
        }
        if g.recovery_sealed_hex.len() > MAX_HANDOVER_KEYS {
            bail!("the handover carries too many keys");
        }
        g.check_log("handover", now_secs)?;
        nuwa_identity::recovery::check_belongs(g.did_log.current(), recovery, now_secs)
            .because("the recovery words were not accepted; nothing was written")?;
        let secret = recovery.x25519_secret();
        let mut ring: Option<KeyRing> = None;
        for h in &g.recovery_sealed_hex {
            let b = hex::decode(h).because("a sealed key of the handover is malformed")?;
            if b.len() != 8 + 32 + 24 + 48 {
                bail!("a sealed key of the handover has the wrong length");
            }
            let sealed = nuwa_crypto::epoch::SealedKey {
                epoch: u64::from_be_bytes(b[..8].try_into().expect("8 bytes")),
                ephemeral_public: b[8..40].try_into().expect("32 bytes"),
                nonce: b[40..64].try_into().expect("24 bytes"),
                ciphertext: b[64..].try_into().expect("48 bytes"),
            };
            let key = nuwa_crypto::epoch::open_sealed_key(
                &secret,
                HANDOVER_CONTEXT,
                &g.agent_did,
                &sealed,
            )
            .because("a key of the handover does not open with these recovery words")?;
            match ring.as_mut() {
                None => ring = Some(KeyRing::new(key)),
                Some(r) => r.insert(key).because("the handover's keys conflict")?,
            }
        }
        let ring = ring.because("the handover carries no key")?;
        Ok((g, ring))
    }

    /// The carried DID log is this agent's and verifies.
    fn check_log(&self, what: &str, now_secs: i64) -> Result<()> {
        if self.did_log.did() != self.agent_did {
            bail!(
                "the {what}'s DID log is for {}, not {}",
                self.did_log.did(),
                self.agent_did
            );
        }
        self.did_log
            .verify(None, now_secs)
            .because(format!("the {what}'s DID log does not verify"))
    }

    pub fn to_bytes(&self) -> Result<Zeroizing<Vec<u8>>> {
        Ok(Zeroizing::new(
            serde_json::to_vec(self).because("cannot encode the grant")?,
        ))
    }

    /// Parses and checks a grant for the device with `ed25519` public key:
    /// the log verifies, is this agent's, and lists the device as active.
    pub fn open(bytes: &[u8], ed25519: &[u8; 32], now_secs: i64) -> Result<(Self, KeyRing)> {
        let g: GrantPlaintext = serde_json::from_slice(bytes)
            .because("the grant from the approving device is malformed")?;
        g.check_log("grant", now_secs)?;
        let ctx = context_id_for(ed25519);
        g.did_log
            .current()
            .key_for(
                &format!("{}#{ctx}", g.agent_did),
                Relationship::Authentication,
                now_secs,
            )
            .because("the grant's DID document does not list this device")?;
        let ring_bytes = Zeroizing::new(
            hex::decode(g.key_ring_hex.as_bytes()).because("the grant's key ring is malformed")?,
        );
        let ring =
            KeyRing::from_file_bytes(&ring_bytes).because("the grant's key ring is malformed")?;
        Ok((g, ring))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use nuwa_crypto::SyncKey;
    use nuwa_identity::keys::DeviceKey;

    // Goal: a grant opens only for the device its log lists; names are
    // stable and the namespace hides nothing but the public nameplate.
    #[test]
    fn grant_plaintext_round_trip_and_checks() {
        let master = DeviceKey::generate().unwrap();
        let joiner = DeviceKey::generate().unwrap();
        let other = DeviceKey::generate().unwrap();
        let mut log = DidChain::genesis(&master, 1_000).unwrap();
        let x = nuwa_crypto::epoch::x25519_public_key(&joiner.x25519_secret());
        let admin = crate::lifecycle::Admin {
            key_id: crate::lifecycle::master_key_id(&log).unwrap(),
            key: master,
        };
        crate::lifecycle::add_device(&mut log, &admin, &joiner.public(), &x, 1_000).unwrap();
        let keys = KeyRing::new(SyncKey::generate(0).unwrap());
        let bytes = GrantPlaintext::new(&log, &keys, &[], "phone")
            .to_bytes()
            .unwrap();
        let (g, ring) = GrantPlaintext::open(&bytes, &joiner.public(), 1_000).unwrap();
        assert_eq!(g.name, "phone");
        assert_eq!(
            ring.current().expose_secret(),
            keys.current().expose_secret()
        );
        let err = GrantPlaintext::open(&bytes, &other.public(), 1_000)
            .err()
            .unwrap();
        assert!(
            format!("{err:#}").contains("does not list this device"),
            "{err:#}"
        );
        assert!(GrantPlaintext::open(b"{}", &joiner.public(), 1_000).is_err());
        assert_eq!(rendezvous_namespace("AB"), rendezvous_namespace("AB"));
        assert_ne!(rendezvous_namespace("AB"), rendezvous_namespace("AC"));
        assert_eq!(mdns_agent("AB"), "did:nuwapair:AB");
    }

    // Goal: a plain pairing's grant carries no device book: its JSON has
    // exactly the fields it had before handovers carried one.
    #[test]
    fn a_plain_grant_carries_no_device_book() {
        let master = DeviceKey::generate().unwrap();
        let log = DidChain::genesis(&master, 1_000).unwrap();
        let keys = KeyRing::new(SyncKey::generate(0).unwrap());
        let bytes = GrantPlaintext::new(&log, &keys, &[1, 2], "phone")
            .to_bytes()
            .unwrap();
        let v: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
        let mut fields: Vec<&str> = v.as_object().unwrap().keys().map(String::as_str).collect();
        fields.sort();
        assert_eq!(
            fields,
            [
                "agent_did",
                "did_log",
                "epoch_grant_hex",
                "key_ring_hex",
                "name"
            ]
        );
    }
}
