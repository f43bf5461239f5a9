//! LAN discovery of an agent's sibling devices over mDNS / DNS-SD.
//!
//! Every device of one agent publishes the service [`SERVICE_TYPE`] with a
//! signed [`Announcement`] in its TXT record: NIP-6's
//! `(OperationalContextID, ConnectionInfo, Timestamp, Signature)` plus the agent
//! DID (or its hash) so that browsers can filter for their own agent. [`Mdns`]
//! publishes ours and reports everyone else's as [`DiscoveryEvent`]s.
//!
//! What this crate leaves to others:
//! - **Trust.** Discovery is only a hint. Events carry announcements that are
//!   parsed but *not* verified; the caller looks up the Ed25519 key of the
//!   announced `context_id` in the agent's DID document and calls
//!   [`Announcement::verify`]. Membership is checked again after Noise proves
//!   possession of the PeerId's key. This crate knows nothing of DID documents,
//!   libp2p, storage or Automerge.
//! - **Signing.** [`Announcement::new_signed`] takes a signing callback, so no
//!   secret key material ever enters this crate.
//! - **Time.** Timestamps are passed in; only the [`Mdns`] runtime reads the
//!   clock, and only for its refresh timer.
//! - **Dialling, caching known peers, retry policy.** Those live in `net` and
//!   `node`.

mod announce;
mod mdns;

pub use announce::{
    AgentRef, AnnounceError, Announcement, MAX_CONTEXT_ID_LEN, MAX_INLINE_DID_LEN, MAX_PEER_ID_LEN,
    MAX_TXT_ENTRIES,
};
pub use mdns::{
    DiscoveryError, DiscoveryEvent, EVENT_CHANNEL_CAPACITY, Mdns, MdnsConfig, watched_interfaces,
};

/// Re-exported so callers can name and `recv_async` the event receiver
/// without adding their own dependency.
pub use flume;

/// The DNS-SD service type every nuwa-sync device publishes and browses.
///
/// `_nuwa-agent-sync` is exactly 15 bytes, the DNS-SD service-name limit, so
/// it must never grow.
pub const SERVICE_TYPE: &str = "_nuwa-agent-sync._tcp.local.";

/// Version of the announcement format and of the sync protocol it advertises.
pub const PROTOCOL_VERSION: u32 = 1;
