//! Limits that depend on each other across crates, tied where all of them
//! are visible: here, at compile time. (Each crate keeps its own limits in
//! one place; these are the relations between them.)

use nuwa_agent::{constants as agent, proto, state};

/// One container-name limit: the wire's, which the state rule and the
/// store enforce, and every schema `$id` (a typed container's name) fits it.
const _: () = assert!(state::MAX_CONTAINER_NAME_BYTES == proto::MAX_CONTAINER_NAME_BYTES);
const _: () = assert!(nuwa_store::MAX_CONTAINER_NAME_BYTES == proto::MAX_CONTAINER_NAME_BYTES);
const _: () =
    assert!(nuwa_agent::asm_model::schema::MAX_ID_BYTES <= state::MAX_CONTAINER_NAME_BYTES);

/// Any one frame fits in a fresh relay circuit, twice over.
const _: () = assert!(2 * proto::MAX_FRAME_BYTES as u64 <= nuwa_net::RELAY_CIRCUIT_BYTES);

/// What the agent publishes on gossip, the network's gossip accepts.
const _: () = assert!(agent::MAX_GOSSIP_BYTES <= nuwa_net::MAX_GOSSIP_BYTES);
