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

use anyhow::{Context, Result, bail};
use nuwa_crypto::epoch::KeyRing;
use nuwa_identity::document::Relationship;
use nuwa_identity::keys::context_id_for;
use nuwa_identity::log::DidLog;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use zeroize::Zeroizing;

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
    pub did_log: DidLog,
    /// The key ring file (`KeyRing::to_file_bytes`), hex.
    pub key_ring_hex: String,
    /// The grant of the current epoch, hex (empty at epoch 0).
    #[serde(default)]
    pub epoch_grant_hex: String,
    /// The name the new device was registered under.
    pub name: String,
}

impl Drop for GrantPlaintext {
    fn drop(&mut self) {
        zeroize::Zeroize::zeroize(&mut self.key_ring_hex);
    }
}

impl GrantPlaintext {
    pub fn new(log: &DidLog, keys: &KeyRing, grant: &[u8], name: &str) -> Self {
        GrantPlaintext {
            agent_did: log.did().to_owned(),
            did_log: log.clone(),
            key_ring_hex: hex::encode(keys.to_file_bytes().as_slice()),
            epoch_grant_hex: hex::encode(grant),
            name: name.to_owned(),
        }
    }

    pub fn to_bytes(&self) -> Result<Zeroizing<Vec<u8>>> {
        Ok(Zeroizing::new(serde_json::to_vec(self)?))
    }

    /// Parses and checks a grant for the device with `ed25519` public key:
    /// the log verifies, is this agent's, and lists the device as active.
    pub fn open(bytes: &[u8], ed25519: &[u8; 32], now_secs: i64) -> Result<(Self, KeyRing)> {
        let g: GrantPlaintext = serde_json::from_slice(bytes)
            .context("the grant from the approving device is malformed")?;
        if g.did_log.did() != g.agent_did {
            bail!(
                "the grant's DID log is for {}, not {}",
                g.did_log.did(),
                g.agent_did
            );
        }
        g.did_log
            .verify(None, now_secs)
            .context("the grant's DID log does not verify")?;
        let ctx = context_id_for(ed25519);
        g.did_log
            .current()
            .key_for(
                &format!("{}#{ctx}", g.agent_did),
                Relationship::Authentication,
                now_secs,
            )
            .context("the grant's DID document does not list this device")?;
        let ring_bytes = Zeroizing::new(
            hex::decode(g.key_ring_hex.as_bytes()).context("the grant's key ring is malformed")?,
        );
        let ring =
            KeyRing::from_file_bytes(&ring_bytes).context("the grant's key ring is malformed")?;
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
        let mut log = DidLog::genesis(&master, 1_000).unwrap();
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
}
