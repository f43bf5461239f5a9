//! The agent core: every decision one device of an agent makes, free of IO.
//!
//! One entry point, [`Agent::handle`]: an [`Input`] (what the network,
//! mDNS, the local API, the clock or a worker brought) and the time in,
//! [`Effect`]s out, which the shell performs in phases (persist,
//! acknowledge, send, the rest; see [`effect`]). On top of the IO-free
//! sync session (`nuwa_sync::Session`: admission, envelopes, key epochs,
//! the sync engine) it decides:
//!
//! - [`lifecycle`]: the signed DID updates that add, remove, promote, demote
//!   and rotate devices, recovery, and the epoch grants they issue; and,
//!   while the agent runs, revocation, provisioning and admin changes, the
//!   rebase of a lost fork and the revoked-write gate;
//! - [`expiry`]: time-limited devices (`--expires`), and pruning them
//!   from the DID chain once their time ran out;
//! - [`pairing`]: what both ends of pairing share, and the approving side;
//!   [`join`]: the new device's side (`pair`, and a fresh home's `recover`);
//! - discovery: which peers to dial (known peers, mDNS announcements, DHT
//!   and rendezvous hints, all checked against the DID document first),
//!   relay reservations, registrations and the DHT pointer;
//! - the keeper client: what to push, pull and compact;
//! - typed state ([`asm`]): the schema registry, the `state.*` tools,
//!   batches, the lifecycle of items;
//! - what `status`, `device list` and `sync --once` report, and which of a
//!   revoked device's local changes will never sync ([`stranded`]);
//! - [`read`]: what `state get` and `state export` answer, through the
//!   daemon or on the home's store with none running;
//! - [`storage`]: when a container's log is folded into a snapshot, and
//!   the record that lets start-up skip loading documents;
//! - [`infra`]: the infrastructure node's own decisions (which DHT records
//!   it stores, what may wait for its keeper, when the keeper prunes).
//!
//! [`api`] holds the local API's requests, replies and errors; [`peer`]
//! the peer and address types; [`status`] and [`devices`] the reports;
//! [`announce`] the signed mDNS announcement, its TXT format and checks.
//!
//! Nothing here knows tokio, libp2p's network stack, sled, files or
//! clocks: time comes in as a parameter, randomness from `nuwa-entropy`
//! (seeded in simulations), and the shell (`nuwa-node`) performs what the
//! core decides.

mod agent;
pub mod announce;
pub mod api;
mod approve;
pub mod apps;
pub mod asm;
mod batch;
mod book;
pub mod constants;
pub mod count;
pub mod devices;
pub mod diagnosis;
mod discovery;
pub mod effect;
pub mod expiry;
mod glue;
pub mod infra;
pub mod input;
pub mod join;
mod keeper;
pub mod lifecycle;
pub mod listen;
pub mod once;
pub mod pairing;
pub mod peer;
pub mod read;
mod report;
mod standing;
pub mod status;
pub mod storage;
pub mod stranded;
pub mod text;

pub use agent::{Agent, Boot, Config};

// The data crates of the core, whole: a shell (the daemon, a browser
// runtime) handles their types (keys, chains, containers, frames) when it
// loads, persists and shows them, and depends on the core through this
// crate alone.
pub use constants::{ANNOUNCE_MAX_AGE_SECS, ANNOUNCE_REFRESH_MS, RENDEZVOUS_TTL_SECS};
pub use count::Count;
pub use discovery::{KNOWN_PEERS_META, Nat};
pub use effect::{Effect, KadOp, NewHome, OnceResult, Phase, Phases};
pub use input::{Input, MdnsEvent, NetEvent, Registration, RequestId};
pub use keeper::meta_key as keeper_meta_key;
pub use nuwa_asm as asm_model;
pub use nuwa_caps as caps;
pub use nuwa_crypto as crypto;
pub use nuwa_identity as identity;
pub use nuwa_proto as proto;
pub use nuwa_state as state;
pub use nuwa_sync as sync;

/// An error and every source below it, joined with ": " (what a person
/// reads in a reply or a log line).
pub fn explain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut out = e.to_string();
    let mut next = e.source();
    while let Some(s) = next {
        let text = s.to_string();
        if !out.ends_with(&text) {
            out.push_str(": ");
            out.push_str(&text);
        }
        next = s.source();
    }
    out
}
