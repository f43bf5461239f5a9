//! The Agent State Model of NIP-8 on Automerge, IO-free: schemas with their
//! `x-asm` annotations and a registry (`schema`, `registry`, `duration`),
//! typed containers whose fields merge per their declared CRDT policy
//! (`doc`), and the ASM-QL query language (`query`).
//!
//! It knows nothing of files, networks, clocks (time is a parameter) or the
//! sync protocol: the node persists and syncs the Automerge documents this
//! crate edits.

pub mod doc;
pub mod duration;
pub mod model;
pub mod query;
pub mod registry;
pub mod schema;
pub mod snapshot;
