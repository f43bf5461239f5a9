//! End-to-end protection of state payloads: every [`SyncPayload`] leaves as a
//! sealed, signed [`Envelope`] and is accepted only after the signature
//! verifies for the claimed sender, the ciphertext opens under the sync key
//! of the envelope's epoch (sealing always uses the newest epoch), and the (sender, nonce, timestamp) triple passes the replay
//! window. IO-free: time comes in as `now_ms`.

use nuwa_crypto::epoch::KeyRing;
use nuwa_crypto::{Envelope, EnvelopeError, SyncKey};
use nuwa_identity::keys::DeviceKey;
use nuwa_identity::nip2::{NonceStore, ReplayError};
use nuwa_proto::{SyncPayload, WireError};

/// Domain under which envelope nonces are tracked in the replay store.
const ENVELOPE_DOMAIN: &str = "NUWA_SYNC_ENVELOPE_V1:";
/// Accepted clock difference between devices, either way.
pub const REPLAY_WINDOW_SECS: i64 = 300;
/// Nonces kept per sender inside the window.
pub const MAX_NONCES_PER_SENDER: usize = 1 << 17;
/// Senders tracked at once (bounded by the number of devices in practice).
pub const MAX_SENDERS: usize = 1024;

/// Why an incoming envelope was refused.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum OpenError {
    #[error("envelope claims sender {claimed:?} but the connection belongs to {actual:?}")]
    WrongSender { claimed: String, actual: String },
    #[error(transparent)]
    Envelope(#[from] EnvelopeError),
    #[error("replay check failed: {0}")]
    Replay(#[from] ReplayError),
    #[error("envelope plaintext: {0}")]
    Wire(#[from] WireError),
    /// Sealed under an epoch whose key this device does not hold: a newer
    /// epoch whose grant has not arrived yet, or one it was excluded from.
    #[error(
        "envelope sealed under key epoch {epoch}, which this device does not hold (it holds up to {newest})"
    )]
    UnknownEpoch { epoch: u64, newest: u64 },
}

impl OpenError {
    /// Short stable label for counters.
    pub fn label(&self) -> &'static str {
        match self {
            OpenError::WrongSender { .. } => "wrong_sender",
            OpenError::Envelope(EnvelopeError::WrongEpoch { .. }) => "wrong_epoch",
            OpenError::Envelope(EnvelopeError::BadSignature { .. }) => "bad_signature",
            OpenError::Envelope(EnvelopeError::Decrypt { .. }) => "decrypt_failed",
            OpenError::Envelope(_) => "bad_envelope",
            OpenError::Replay(_) => "replay",
            OpenError::Wire(_) => "malformed_payload",
            OpenError::UnknownEpoch { .. } => "unknown_epoch",
        }
    }
}

/// Seals outgoing and opens incoming payloads for one device.
pub struct SecureChannel {
    agent_did: String,
    context_id: String,
    keys: KeyRing,
    nonces: NonceStore,
}

impl SecureChannel {
    pub fn new(agent_did: String, context_id: String, keys: KeyRing) -> Self {
        SecureChannel {
            agent_did,
            context_id,
            keys,
            nonces: NonceStore::new(REPLAY_WINDOW_SECS, MAX_NONCES_PER_SENDER, MAX_SENDERS),
        }
    }

    /// Forgets nonces that fell out of the replay window (called from the
    /// runtime's periodic tick so memory stays proportional to traffic in
    /// the window).
    pub fn prune(&mut self, now_ms: u64) {
        self.nonces.prune((now_ms / 1000) as i64);
    }

    /// The epoch new payloads are sealed under.
    pub fn epoch(&self) -> u64 {
        self.keys.current().epoch()
    }

    /// Adds the key of a new epoch (from a verified grant); from then on new
    /// payloads are sealed under it. Envelopes of older epochs still open.
    pub fn install(&mut self, key: SyncKey) -> Result<(), nuwa_crypto::epoch::EpochError> {
        self.keys.insert(key)
    }

    pub fn keys(&self) -> &KeyRing {
        &self.keys
    }

    /// Seals `payload` under the newest epoch's sync key, signed by `device`.
    pub fn seal(
        &self,
        device: &DeviceKey,
        payload: &SyncPayload,
        now_ms: u64,
    ) -> Result<Envelope, nuwa_crypto::CryptoError> {
        let plaintext = zeroize::Zeroizing::new(payload.encode());
        nuwa_crypto::seal(
            self.keys.current(),
            device.signing_key(),
            &self.agent_did,
            &self.context_id,
            now_ms,
            &plaintext,
        )
    }

    /// Opens an envelope that arrived on a connection verified as device
    /// `sender_context` with public key `sender_public`.
    pub fn open(
        &mut self,
        env: &Envelope,
        sender_context: &str,
        sender_public: &[u8; 32],
        now_ms: u64,
    ) -> Result<SyncPayload, OpenError> {
        if env.sender != sender_context {
            return Err(OpenError::WrongSender {
                claimed: env.sender.clone(),
                actual: sender_context.to_owned(),
            });
        }
        let ts_secs = (env.timestamp_ms / 1000) as i64;
        let now_secs = (now_ms / 1000) as i64;
        // Cheap replay pre-check first; the nonce is recorded only after the
        // signature verified, so forgeries cannot burn nonces.
        self.nonces.check(
            sender_context,
            ENVELOPE_DOMAIN,
            &env.nonce,
            ts_secs,
            now_secs,
        )?;
        let key = self.keys.get(env.epoch).ok_or(OpenError::UnknownEpoch {
            epoch: env.epoch,
            newest: self.keys.current().epoch(),
        })?;
        let plaintext = nuwa_crypto::open(env, key, sender_public, &self.agent_did)?;
        self.nonces.record(
            sender_context,
            ENVELOPE_DOMAIN,
            &env.nonce,
            ts_secs,
            now_secs,
        )?;
        Ok(SyncPayload::decode(&plaintext)?)
    }
}

impl SecureChannel {
    /// Opens an envelope that came from storage (a keeper) rather than
    /// from its sender: the signature and the epoch are checked as usual,
    /// but not the replay window, which stored envelopes outlive by design.
    /// Replaying one is harmless: it carries CRDT changes, applied once.
    pub fn open_stored(
        &self,
        env: &Envelope,
        sender_public: &[u8; 32],
    ) -> Result<SyncPayload, OpenError> {
        let key = self.keys.get(env.epoch).ok_or(OpenError::UnknownEpoch {
            epoch: env.epoch,
            newest: self.keys.current().epoch(),
        })?;
        let plaintext = nuwa_crypto::open(env, key, sender_public, &self.agent_did)?;
        Ok(SyncPayload::decode(&plaintext)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const DID: &str = "did:key:z6MkhaXgBZDvotDkL5257faiztiGiC2QtKLGpbnnEGta2doK";

    fn payload() -> SyncPayload {
        SyncPayload::Delta {
            container: "notes".into(),
            changes: vec![b"change".to_vec()],
        }
    }

    // Goal: after a new epoch, sealing moves to it, old envelopes still
    // open, and a ring without the new key refuses new envelopes with a
    // typed error. Method: two channels sharing epoch 0; only one installs
    // epoch 1.
    #[test]
    fn epochs_seal_newest_and_open_by_epoch() {
        let sender = DeviceKey::generate().unwrap();
        let k0 = SyncKey::generate(0).unwrap();
        let k1 = SyncKey::generate(1).unwrap();
        let mut alice = SecureChannel::new(DID.into(), "device-a".into(), KeyRing::new(k0.clone()));
        let mut stale = SecureChannel::new(DID.into(), "device-b".into(), KeyRing::new(k0.clone()));
        let mut current = SecureChannel::new(DID.into(), "device-c".into(), KeyRing::new(k0));
        current.install(k1.clone()).unwrap();

        let old = alice.seal(&sender, &payload(), 1_000_000).unwrap();
        assert_eq!(old.epoch, 0);
        alice.install(k1).unwrap();
        assert_eq!(alice.epoch(), 1);
        let new = alice.seal(&sender, &payload(), 1_000_000).unwrap();
        assert_eq!(new.epoch, 1);

        // Data sealed before the new epoch stays readable to current devices.
        assert_eq!(
            current
                .open(&old, "device-a", &sender.public(), 1_000_000)
                .unwrap(),
            payload()
        );
        assert_eq!(
            current
                .open(&new, "device-a", &sender.public(), 1_000_000)
                .unwrap(),
            payload()
        );
        // A device without the new key cannot open what is sealed under it.
        let err = stale
            .open(&new, "device-a", &sender.public(), 1_000_000)
            .unwrap_err();
        assert!(
            matches!(
                err,
                OpenError::UnknownEpoch {
                    epoch: 1,
                    newest: 0
                }
            ),
            "{err}"
        );
        assert_eq!(err.label(), "unknown_epoch");
    }
}
