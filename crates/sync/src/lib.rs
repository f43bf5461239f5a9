//! The synchronisation core of nuwa-sync, free of IO.
//!
//! - [`engine`]: the per-container sync state machine (heads summaries, the
//!   Automerge sync protocol, batched live deltas).
//! - [`secure`]: sealing and opening of payload envelopes with replay checks.
//! - [`membership`]: who is a device of this agent (DID log, Hello checks).
//! - [`session`]: one device's session with its peers: admission, envelope
//!   opening, key epochs, held envelopes, DID-log re-checks; it owns the
//!   three above and emits effects for the runtime.
//! - [`grant`]: checking an epoch grant a peer forwarded.
//!
//! Nothing here knows libp2p, sled, tokio, files or clocks: inputs carry
//! `now_ms`, outputs are values for the runtime to act on. The node crate
//! wires these to the network and the store. Randomness (Hello and pointer
//! nonces, and through identity and crypto every key and nonce) comes from
//! `nuwa_entropy::fill`, which a seeded simulator makes deterministic.

pub mod engine;
pub mod grant;
pub mod membership;
pub mod pointer;
pub mod reconcile;
pub mod secure;
pub mod session;

pub use engine::{
    Action, CatchUp, CatchUpProgress, CaughtUp, Config, Engine, EngineError, Loader,
    LocalEditError, PeerKey, PeerSync, PeerSyncState, RUN_ACTOR_BYTES, run_actor,
};
pub use membership::{Membership, Rejection, VerifiedPeer};
pub use secure::{OpenError, SecureChannel};
pub use session::{
    APPLY_QUEUED_BYTES, Count, Door, Effect, Origin, PeerState, Session, SessionConfig, Stored,
};
