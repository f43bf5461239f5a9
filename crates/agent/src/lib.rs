//! The agent core: every decision one device of an agent makes, free of IO.
//!
//! - [`lifecycle`]: the signed DID updates that add, remove, promote, demote
//!   and rotate devices, recovery, and the epoch grants they issue.
//! - [`pairing`]: what both ends of pairing share (where a waiting device is
//!   published, the grant and the recovery handover it receives).
//! - [`api`]: the requests and replies of the local API, and its errors.
//! - [`status`]: the `status` report; [`devices`]: `device list`.
//! - [`announce`]: the signed mDNS announcement, its TXT format and checks.
//!
//! Nothing here knows tokio, libp2p's network stack, sled, files or
//! clocks: time comes in as a parameter, and the shell (`nuwa-node`)
//! performs what the core decides.

pub mod announce;
pub mod api;
pub mod devices;
pub mod lifecycle;
pub mod pairing;
pub mod peer;
pub mod status;

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
