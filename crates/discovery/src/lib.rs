//! LAN discovery of an agent's sibling devices over mDNS / DNS-SD: a
//! transport for TXT records.
//!
//! Every device publishes the service [`SERVICE_TYPE`] with a TXT record it
//! is handed ([`MdnsConfig::txt`], [`Mdns::update_txt`]). [`Mdns`] publishes
//! ours and reports everyone else's as [`DiscoveryEvent`]s: the instance
//! label, the TXT entries as they came (bounded by [`MAX_TXT_ENTRIES`] and
//! [`MAX_TXT_ENTRY_LEN`]) and the addresses with the SRV record's port.
//!
//! What this crate leaves to others:
//! - **The announcement format and every check on it.** What the TXT entries
//!   mean (agent, context id, PeerId, port, timestamp, signature), parsing
//!   them, verifying the signature against the agent's DID document, and
//!   checking that the SRV port is the signed one are `nuwa_agent::announce`'s
//!   and its caller's. Discovery is only a hint: nothing here is verified,
//!   and membership is checked again after Noise proves possession of the
//!   PeerId's key. This crate knows nothing of DIDs, keys, libp2p, storage or
//!   Automerge.
//! - **Time.** Only the [`Mdns`] runtime reads the clock, and only for its
//!   refresh timer; re-signing a record before it goes stale is the caller's.
//! - **Dialling, caching known peers, retry policy.** Those live in `net`,
//!   `agent` and `node`.

mod mdns;

pub use mdns::{
    DiscoveryError, DiscoveryEvent, EVENT_CHANNEL_CAPACITY, MAX_TXT_ENTRIES, MAX_TXT_ENTRY_LEN,
    Mdns, MdnsConfig, watched_interfaces,
};

/// Re-exported so callers can name and `recv_async` the event receiver
/// without adding their own dependency.
pub use flume;

/// The DNS-SD service type every nuwa-sync device publishes and browses.
///
/// `_nuwa-agent-sync` is exactly 15 bytes, the DNS-SD service-name limit, so
/// it must never grow.
pub const SERVICE_TYPE: &str = "_nuwa-agent-sync._tcp.local.";
