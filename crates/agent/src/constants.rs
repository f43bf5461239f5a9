//! The agent's limits and periods in one place, with the relations between
//! them asserted at compile time. (Limits another crate also holds are
//! tied to it where both are visible: in the shell, `nuwa-node`.)

/// Largest sealed frame published on gossip; a bigger delta goes over the
/// direct stream. The network's gossip transmit limit must be at least this.
pub const MAX_GOSSIP_BYTES: usize = 64 * 1024;

const _: () = assert!(MAX_GOSSIP_BYTES <= nuwa_proto::MAX_FRAME_BYTES);
