//! End-to-end protection of state payloads: every [`SyncPayload`] leaves as a
//! sealed, signed [`Envelope`] and is accepted only after the signature
//! verifies for the claimed sender, the ciphertext opens under the current
//! sync key, and the (sender, nonce, timestamp) triple passes the replay
//! window. IO-free: time comes in as `now_ms`.

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
        }
    }
}

/// Seals outgoing and opens incoming payloads for one device.
pub struct SecureChannel {
    agent_did: String,
    context_id: String,
    sync_key: SyncKey,
    nonces: NonceStore,
}

impl SecureChannel {
    pub fn new(agent_did: String, context_id: String, sync_key: SyncKey) -> Self {
        SecureChannel {
            agent_did,
            context_id,
            sync_key,
            nonces: NonceStore::new(REPLAY_WINDOW_SECS, MAX_NONCES_PER_SENDER, MAX_SENDERS),
        }
    }

    /// Forgets nonces that fell out of the replay window (called from the
    /// runtime's periodic tick so memory stays proportional to traffic in
    /// the window).
    pub fn prune(&mut self, now_ms: u64) {
        self.nonces.prune((now_ms / 1000) as i64);
    }

    pub fn epoch(&self) -> u64 {
        self.sync_key.epoch()
    }

    /// Seals `payload` under the current sync key, signed by `device`.
    pub fn seal(
        &self,
        device: &DeviceKey,
        payload: &SyncPayload,
        now_ms: u64,
    ) -> Result<Envelope, nuwa_crypto::CryptoError> {
        let plaintext = zeroize::Zeroizing::new(payload.encode());
        nuwa_crypto::seal(
            &self.sync_key,
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
        let plaintext = nuwa_crypto::open(env, &self.sync_key, sender_public, &self.agent_did)?;
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
