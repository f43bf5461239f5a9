//! What only the shell's HTTP layer and its client need: the body limit,
//! `api.json`, the liveness challenge, and the requests the server hands to
//! the daemon loop (with the channels their answers come back on). Request
//! and reply bodies are the agent's (`nuwa_agent::api`).

use serde::{Deserialize, Serialize};
use serde_json::Value;
use tokio::sync::oneshot;

pub use nuwa_agent::api::*;
use nuwa_agent::status::Status;

/// Largest request body accepted.
/// (Above the 32 MiB object limit, so that an oversized object gets the
/// typed `object_too_large` error rather than a bare 413.)
pub const MAX_BODY_BYTES: usize = 40 * 1024 * 1024;

/// Contents of `HOME/api.json`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ApiFile {
    pub url: String,
    pub token: String,
    pub pid: u32,
}

/// Work for the daemon loop.
pub enum ApiRequest {
    Status(oneshot::Sender<Status>),
    Devices(oneshot::Sender<Vec<nuwa_agent::devices::DeviceEntry>>),
    Put(PutBody, oneshot::Sender<Result<PutReply, ApiError>>),
    Revoke(RevokeBody, oneshot::Sender<Result<RevokeReply, ApiError>>),
    Admin(AdminChange, oneshot::Sender<Result<Value, ApiError>>),
    Approve(ApproveBody, oneshot::Sender<Result<ApproveReply, ApiError>>),
    Provision(ProvisionBody, oneshot::Sender<Result<Value, ApiError>>),
    Tool(Tool, oneshot::Sender<Result<serde_json::Value, ApiError>>),
    Batch(BatchBody, oneshot::Sender<Result<BatchReply, ApiError>>),
    /// `app grant|revoke|list`.
    App(AppRequest, oneshot::Sender<Result<Value, ApiError>>),
    /// Answered with the JSON already serialized (on the reader, so that
    /// the runtime's workers only copy bytes).
    Get(GetQuery, oneshot::Sender<Result<Vec<u8>, ApiError>>),
    Export(String, oneshot::Sender<Result<Vec<u8>, ApiError>>),
}

/// The owner's requests about app capabilities.
pub enum AppRequest {
    Grant(nuwa_agent::apps::GrantBody),
    Revoke(nuwa_agent::apps::RevokeAppBody),
    List,
}

/// `POST /v1/challenge`: proves, before the CLI sends its token, that the
/// process answering on `api.json`'s address is the daemon of this home.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ChallengeBody {
    /// 32 random bytes, hex.
    pub nonce: String,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ChallengeReply {
    /// The daemon's process id.
    pub pid: u32,
    /// Hex HMAC-SHA256 keyed with the API token over
    /// [`CHALLENGE_DOMAIN`] followed by the nonce bytes.
    pub mac: String,
}

/// Domain-separation prefix of the challenge MAC.
pub const CHALLENGE_DOMAIN: &[u8] = b"nuwa-api-challenge/1:";

/// The challenge MAC for `nonce` under `token`.
pub fn challenge_mac(token: &str, nonce: &[u8]) -> [u8; 32] {
    use hmac::Mac as _;
    use hmac::digest::KeyInit as _;
    // Invariant: HMAC takes keys of any length, so this cannot fail.
    #[allow(clippy::expect_used)]
    let mut mac = hmac::Hmac::<sha2::Sha256>::new_from_slice(token.as_bytes())
        .expect("HMAC takes keys of any length");
    mac.update(CHALLENGE_DOMAIN);
    mac.update(nonce);
    mac.finalize().into_bytes().into()
}
