//! The agent's limits and periods in one place, with the relations between
//! them asserted at compile time. (Limits another crate also holds are
//! tied to it where both are visible: in the shell, `nuwa-node`.)

/// Largest sealed frame published on gossip; a bigger delta goes over the
/// direct stream. The network's gossip transmit limit must be at least this.
pub const MAX_GOSSIP_BYTES: usize = 64 * 1024;

const _: () = assert!(MAX_GOSSIP_BYTES <= nuwa_proto::MAX_FRAME_BYTES);

/// Largest DID proof an admin change may leave (see
/// `lifecycle::MAX_PROOF_AFTER_CHANGE`): it must fit the proof cap of the
/// chain and, with the pointer's own fields (about 600 bytes, 4 KiB
/// allowed), the DHT pointer.
const _: () =
    assert!(crate::constants::MAX_PROOF_AFTER_CHANGE <= nuwa_identity::chain::MAX_PROOF_BYTES);
const _: () = assert!(
    crate::constants::MAX_PROOF_AFTER_CHANGE + 4 * 1024 <= nuwa_sync::pointer::MAX_POINTER_BYTES
);
/// The proof a `Hello` or a keeper push carries is the chain's proof.
const _: () = assert!(nuwa_proto::MAX_DID_PROOF_BYTES == nuwa_identity::chain::MAX_PROOF_BYTES);

// ---- Discovery ---------------------------------------------------------

/// How long a rendezvous registration lasts (devices and pairing codes);
/// refreshed at half of it.
pub const RENDEZVOUS_TTL_SECS: u64 = 2 * 3600;
/// Oldest mDNS announcement accepted, and how often ours is re-signed.
pub const ANNOUNCE_MAX_AGE_SECS: i64 = 600;
pub const ANNOUNCE_REFRESH_MS: u64 = 120_000;
/// Known peers kept in the cache.
pub(crate) const MAX_KNOWN_PEERS: usize = 64;
/// Redial known and static peers that are not connected this often.
pub(crate) const REDIAL_MS: u64 = 5_000;
/// Longest pause between redials of a revoked device.
pub(crate) const REVOKED_REDIAL_MAX_MS: u64 = 15 * 60_000;
/// DHT and rendezvous lookups: fast while starting, then slower.
pub(crate) const LOOKUP_FAST_MS: u64 = 2_000;
pub(crate) const LOOKUP_SLOW_MS: u64 = 30_000;
pub(crate) const FAST_PHASE_MS: u64 = 60_000;
/// Re-publish our DHT pointer and provider record this often.
pub(crate) const POINTER_REPUT_MS: u64 = 10 * 60_000;
/// Retry a relay reservation that ended or was refused after this long.
pub(crate) const RELAY_RETRY_MS: u64 = 5_000;
/// Announcements of our agent whose key we do not know yet, kept for a
/// retry when the DID chain grows.
pub(crate) const MAX_UNKNOWN_ANNOUNCEMENTS: usize = 64;
/// Peers whose identify report is remembered.
pub(crate) const MAX_IDENTIFIED: usize = 1024;

// ---- The keeper client -------------------------------------------------

/// Bytes of sealed changes per push (the frame cap is 8 MiB).
pub(crate) const PUSH_BYTES: usize = 2 * 1024 * 1024;
/// Changes per envelope, and bytes of changes per envelope.
pub(crate) const ENVELOPE_CHANGES: usize = 1024;
pub(crate) const ENVELOPE_BYTES: usize = 512 * 1024;
/// At most one snapshot per keeper this often.
pub(crate) const COMPACT_EVERY_MS: u64 = 60_000;
/// How soon a compaction that found nothing pulled yet is tried again.
pub(crate) const COMPACT_RETRY_MS: u64 = 1_000;
/// Largest snapshot push (the frame cap is 8 MiB).
pub(crate) const SNAPSHOT_BYTES: usize = 6 * 1024 * 1024;
/// Bytes asked for per pull.
pub(crate) const PULL_BYTES: u32 = 4 * 1024 * 1024;
pub(crate) const PULL_IDLE_MS: u64 = 2_000;
pub(crate) const PULL_BUSY_MS: u64 = 30_000;
/// A request unanswered this long is given up (and made again).
pub(crate) const REQUEST_TIMEOUT_MS: u64 = 30_000;
/// After a refusal, wait this long before asking again.
pub(crate) const REFUSED_BACKOFF_MS: u64 = 30_000;

// ---- Approvals ---------------------------------------------------------

/// How long one approval may take in total, unless the request says.
pub(crate) const APPROVE_TIMEOUT_MS: u64 = 60_000;
pub(crate) const MAX_APPROVE_TIMEOUT_MS: u64 = 10 * 60_000;
/// How long a dialed candidate has to start the exchange.
pub(crate) const CANDIDATE_TIMEOUT_MS: u64 = 10_000;
/// Rendezvous lookups while searching.
pub(crate) const RV_LOOKUP_MS: u64 = 2_000;
/// Pairing candidates remembered (mDNS and rendezvous), and for how long.
pub(crate) const MAX_CANDIDATES: usize = 64;
pub(crate) const CANDIDATE_TTL_MS: u64 = 15 * 60_000;
/// Longest abort reason accepted or sent.
pub(crate) const MAX_REASON_BYTES: usize = 256;
/// Longest nameplate taken from a candidate (codes have two symbols).
pub(crate) const MAX_NAMEPLATE_BYTES: usize = 8;
/// Addresses kept per candidate.
pub(crate) const MAX_CANDIDATE_ADDRS: usize = 16;

// ---- Memory ------------------------------------------------------------

/// How often memory is checked and idle containers evicted.
pub(crate) const EVICT_EVERY_MS: u64 = 5_000;
/// A container unused this long leaves memory.
pub(crate) const IDLE_EVICT_MS: u64 = 60_000;
/// Memory is given back once startup settled: when every verified peer is
/// in sync, or at the latest this long after start.
pub(crate) const SETTLED_RELEASE_MS: u64 = 10_000;
/// After that, memory is given back this often: the code pages a burst
/// ran stay mapped otherwise (docs/performance.md, "Idle memory").
pub(crate) const RELEASE_EVERY_MS: u64 = 300_000;
/// Memory is also given back when the device settles with another set of
/// peers than at the last release (a peer joined or left and the syncs it
/// started are done), at most this often: a sync's burst runs code and
/// fills buffers that idle does not use.
pub(crate) const RELEASE_AFTER_PEERS_MS: u64 = 2_000;

// ---- Reports -----------------------------------------------------------

/// Rejection records kept for `status`.
pub(crate) const MAX_REJECTIONS: usize = 256;

// ---- Typed state -------------------------------------------------------

/// Largest object accepted by `state.create` / `state.update` (NIP-8).
pub const MAX_OBJECT_BYTES: usize = 32 * 1024 * 1024;
/// Items a query may scan (its time budget is the shell's: the core reads no clock).
pub(crate) const QUERY_MAX_SCANNED: usize = 1_000_000;
/// How often the lifecycle task runs.
pub const LIFECYCLE_EVERY_MS: u64 = 30_000;
/// `evict_low_importance`: items outside the window whose `importance` is
/// below this are evicted; the rest are kept.
pub const KEEP_IMPORTANCE: f64 = 0.5;

// ---- Joining ----------------------------------------------------------

/// An exchange that stalls this long is abandoned (the code stays usable).
pub const SESSION_TIMEOUT_MS: u64 = 30_000;

// ---- Lifecycle ---------------------------------------------------------

/// Most bytes the proof of the DID document may take after an admin
/// change: the DHT pointer (60 KiB) carries it with about 600 bytes of its
/// own, and a `Hello` carries it whole.
pub const MAX_PROOF_AFTER_CHANGE: usize = 56 * 1024;

// ---- Time-limited devices ----------------------------------------------

/// The longest `--expires` accepted: beyond it a device is not short-lived
/// (leave `--expires` out and revoke it when done).
pub const MAX_EXPIRES_SECS: u64 = 10 * 365 * 86_400;
/// An admin prunes expired devices from the DID chain at most this often:
/// each prune is a DID update and a new key epoch that every device takes.
pub const PRUNE_EXPIRED_EVERY_MS: u64 = 10 * 60 * 1000;
/// An admin that is not the first admin of the document prunes only
/// devices expired (grace included) for this long, so the first admin,
/// when it runs, prunes alone and two admins do not fork the chain.
pub const PRUNE_FALLBACK_SECS: i64 = 3600;
/// A proof (the DID document Hellos and the DHT pointer carry) past this
/// size is pruned of its expired devices at once, whatever the rate.
pub const PRUNE_AT_PROOF_BYTES: usize = 32 * 1024;
/// A document listing this many methods is pruned at once as well (the
/// document holds at most `MAX_VERIFICATION_METHODS`; a device takes two).
pub const PRUNE_AT_METHODS: usize = nuwa_identity::document::MAX_VERIFICATION_METHODS * 3 / 4;
const _: () = assert!(PRUNE_AT_PROOF_BYTES < MAX_PROOF_AFTER_CHANGE);
const _: () = assert!(PRUNE_AT_METHODS < nuwa_identity::document::MAX_VERIFICATION_METHODS);
