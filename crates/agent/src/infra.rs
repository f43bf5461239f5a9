//! The infrastructure node's decisions (`nuwa-node rendezvous`): which
//! inbound DHT records it stores, which frames reach its keeper and how many
//! of one peer's requests may wait for it, and when the keeper prunes and
//! reports. The shell (`node/src/infra.rs`) runs the network, the keeper's
//! thread and its store, and does what [`Infra::handle`] says.
//!
//! The node is an untrusted introducer: it holds no agent keys and sees no
//! state. It still stores only DHT records that verify on their own (the
//! pointer carries the agent's self-certifying DID log), and it bounds
//! what one peer may queue, so that a flood from one peer degrades nothing
//! for every other agent's devices.

use std::collections::HashMap;

use nuwa_counters::Counters;
use nuwa_keeper::{Keeper, KeeperStats};
use nuwa_proto::Frame;
use nuwa_proto::keeper::KeeperRequest;
use nuwa_sync::pointer::AgentPointer;
use tracing::{debug, info, warn};

use crate::peer::PeerId;

nuwa_counters::table! {
    /// A counted event of the infrastructure node.
    pub enum InfraCount {
        DhtRecordsStored => "dht_records_stored", "Inbound DHT records stored after they verified on their own";
        DhtRecordsRefused => "dht_records_refused", "Inbound DHT records refused (forged, expired or malformed)";
        KeeperRequestsDroppedBusy => "keeper_requests_dropped_busy", "Keeper requests dropped because their peer had too many waiting or the queue was full (the device asks again)";
        MalformedFrames => "malformed_frames", "Frames that did not decode";
        SyncFramesIgnored => "sync_frames_ignored", "Frames other than keeper requests (an infrastructure node does not sync)";
    }
}

/// Requests of one peer that may wait for the keeper: a device has at most
/// a push and a pull under way, so a peer past this is flooding.
pub const MAX_QUEUED_PER_PEER: usize = 8;
/// How often the keeper drops what its retention rules let go.
pub const KEEPER_PRUNE_EVERY_MS: u64 = 3_600_000;
/// How often the keeper's counters are logged.
pub const KEEPER_REPORT_EVERY_MS: u64 = 60_000;

/// What reaches the infrastructure node.
#[derive(Debug)]
pub enum InfraInput {
    /// A peer asks this node to store a DHT record.
    Record {
        from: PeerId,
        key: Vec<u8>,
        value: Vec<u8>,
    },
    /// A frame over a direct stream.
    Frame { peer: PeerId, frame: Vec<u8> },
    /// The keeper answered one of `peer`'s requests.
    Answered { peer: PeerId },
    /// A [`InfraEffect::Keep`] found the keeper's queue full.
    NotQueued { peer: PeerId },
}

/// What the shell does for the infrastructure node.
#[derive(Debug, PartialEq)]
pub enum InfraEffect {
    /// Store the record in the DHT.
    Store { key: Vec<u8>, value: Vec<u8> },
    /// Queue the request for the keeper; answer [`InfraInput::NotQueued`]
    /// if the queue is full, and [`InfraInput::Answered`] once answered.
    Keep {
        peer: PeerId,
        request: Box<KeeperRequest>,
    },
}

/// The infrastructure node's state: its counters and each peer's requests
/// waiting for the keeper.
#[derive(Debug)]
pub struct Infra {
    keeper: bool,
    queued: HashMap<PeerId, usize>,
    counters: Counters<InfraCount>,
}

impl Infra {
    /// `keeper`: whether this node runs a keeper (otherwise keeper requests
    /// are ignored like any other frame).
    pub fn new(keeper: bool) -> Self {
        Infra {
            keeper,
            queued: HashMap::new(),
            counters: Counters::new(),
        }
    }

    /// The node's counters (clones share the values).
    pub fn counters(&self) -> &Counters<InfraCount> {
        &self.counters
    }

    /// Decides what one input does; `now_ms` is Unix time in ms.
    pub fn handle(&mut self, input: InfraInput, now_ms: u64) -> Option<InfraEffect> {
        match input {
            InfraInput::Record { from, key, value } => {
                let now = (now_ms / 1000) as i64;
                match AgentPointer::decode(&value).and_then(|p| p.verify(&key, now)) {
                    Ok(()) => {
                        self.counters.inc(InfraCount::DhtRecordsStored);
                        return Some(InfraEffect::Store { key, value });
                    }
                    Err(e) => {
                        self.counters.inc(InfraCount::DhtRecordsRefused);
                        info!(peer = %from, reason = %e, "forged or invalid DHT record refused");
                    }
                }
            }
            InfraInput::Frame { peer, frame } => match Frame::decode(&frame) {
                Ok(Frame::KeeperRequest(request)) if self.keeper => {
                    let n = self.queued.entry(peer).or_default();
                    if *n < MAX_QUEUED_PER_PEER {
                        *n += 1;
                        return Some(InfraEffect::Keep { peer, request });
                    }
                    self.counters.inc(InfraCount::KeeperRequestsDroppedBusy);
                }
                Ok(_) => {
                    self.counters.inc(InfraCount::SyncFramesIgnored);
                    debug!(%peer, "frame sent to an infrastructure node ignored");
                }
                Err(e) => {
                    self.counters.inc(InfraCount::MalformedFrames);
                    debug!(%peer, error = %e, "malformed frame");
                }
            },
            InfraInput::NotQueued { peer } => {
                self.counters.inc(InfraCount::KeeperRequestsDroppedBusy);
                self.done(peer);
            }
            InfraInput::Answered { peer } => self.done(peer),
        }
        None
    }

    fn done(&mut self, peer: PeerId) {
        if let Some(n) = self.queued.get_mut(&peer) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                self.queued.remove(&peer);
            }
        }
    }
}

/// The keeper with its schedule: it answers requests, prunes once an hour
/// and reports once a minute. The shell runs it on a thread of its own (so
/// that store writes never hold the network loop) and sends its answers.
pub struct KeeperHost {
    keeper: Keeper,
    last_prune_ms: u64,
    last_report_ms: u64,
}

impl KeeperHost {
    /// A host that prunes at its first request (a restarted keeper catches
    /// up on retention at once).
    pub fn new(keeper: Keeper, now_ms: u64) -> Self {
        KeeperHost {
            keeper,
            last_prune_ms: 0,
            last_report_ms: now_ms,
        }
    }

    /// The encoded frame that answers `request`; prunes first when due.
    pub fn serve(&mut self, request: KeeperRequest, now_ms: u64) -> Vec<u8> {
        let response = self.keeper.handle(request, now_ms);
        if now_ms.saturating_sub(self.last_prune_ms) > KEEPER_PRUNE_EVERY_MS {
            self.last_prune_ms = now_ms;
            if let Err(e) = self.keeper.prune(now_ms) {
                warn!(error = %e, "keeper retention pass failed");
            }
        }
        Frame::KeeperResponse(Box::new(response)).encode()
    }

    /// The keeper's counters, when a report is due.
    pub fn report_due(&mut self, now_ms: u64) -> Option<KeeperStats> {
        if now_ms.saturating_sub(self.last_report_ms) <= KEEPER_REPORT_EVERY_MS {
            return None;
        }
        self.last_report_ms = now_ms;
        Some(self.keeper.stats())
    }

    /// The keeper's counters now.
    pub fn stats(&self) -> KeeperStats {
        self.keeper.stats()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use nuwa_keeper::{KeeperConfig, MemKeeperStore};
    use nuwa_proto::keeper::{KeeperAuth, KeeperBody, KeeperRequest};

    fn unsigned_pull() -> KeeperRequest {
        KeeperRequest {
            request_id: 1,
            agent_did: "did:key:z6Mknobody".to_owned(),
            auth: KeeperAuth {
                context_id: "device".to_owned(),
                timestamp_ms: 0,
                nonce: [0; 16],
                signature: [0; 64],
            },
            body: KeeperBody::Pull {
                since: 0,
                max_bytes: 1024,
                have_head: String::new(),
                have_epoch: 0,
            },
        }
    }

    fn peer() -> PeerId {
        let key = nuwa_identity::keys::DeviceKey::generate().unwrap();
        crate::peer::id_of(&key.public()).unwrap()
    }

    fn request() -> Vec<u8> {
        Frame::KeeperRequest(Box::new(unsigned_pull())).encode()
    }

    // Goal: one peer gets at most MAX_QUEUED_PER_PEER requests waiting for
    // the keeper; answers (and full-queue refusals) free its slots, and
    // another peer is never held up by it.
    #[test]
    fn a_flooding_peer_is_bounded_and_others_are_not() {
        let mut infra = Infra::new(true);
        let (flood, other) = (peer(), peer());
        let kept = |infra: &mut Infra, p: PeerId| {
            matches!(
                infra.handle(
                    InfraInput::Frame {
                        peer: p,
                        frame: request()
                    },
                    0
                ),
                Some(InfraEffect::Keep { .. })
            )
        };
        for _ in 0..MAX_QUEUED_PER_PEER {
            assert!(kept(&mut infra, flood));
        }
        assert!(!kept(&mut infra, flood));
        assert_eq!(
            infra.counters().get(InfraCount::KeeperRequestsDroppedBusy),
            1
        );
        assert!(kept(&mut infra, other));
        infra.handle(InfraInput::Answered { peer: flood }, 0);
        assert!(kept(&mut infra, flood));
        infra.handle(InfraInput::NotQueued { peer: flood }, 0);
        assert_eq!(
            infra.counters().get(InfraCount::KeeperRequestsDroppedBusy),
            2
        );
        assert!(kept(&mut infra, flood));
        assert!(!kept(&mut infra, flood));
    }

    // Goal: without a keeper, keeper requests are ignored like sync
    // frames; garbage is counted as malformed; a forged DHT record is
    // refused and never stored.
    #[test]
    fn frames_and_records_that_do_not_belong_are_refused() {
        let mut infra = Infra::new(false);
        let p = peer();
        assert_eq!(
            infra.handle(
                InfraInput::Frame {
                    peer: p,
                    frame: request()
                },
                0
            ),
            None
        );
        assert_eq!(infra.counters().get(InfraCount::SyncFramesIgnored), 1);
        let garbage = InfraInput::Frame {
            peer: p,
            frame: vec![0xff; 9],
        };
        assert_eq!(infra.handle(garbage, 0), None);
        assert_eq!(infra.counters().get(InfraCount::MalformedFrames), 1);
        let forged = InfraInput::Record {
            from: p,
            key: b"/nuwa/x".to_vec(),
            value: vec![1, 2, 3],
        };
        assert_eq!(infra.handle(forged, 1_000), None);
        assert_eq!(infra.counters().get(InfraCount::DhtRecordsRefused), 1);
        assert_eq!(infra.counters().get(InfraCount::DhtRecordsStored), 0);
    }

    // Goal: the keeper reports at most once a minute, and answers every
    // request with a keeper response frame.
    #[test]
    fn the_keeper_answers_and_reports_on_schedule() {
        let keeper = Keeper::new(Box::new(MemKeeperStore::new()), KeeperConfig::default());
        let mut host = KeeperHost::new(keeper, 1_000);
        let answer = host.serve(unsigned_pull(), 2_000);
        assert!(matches!(
            Frame::decode(&answer),
            Ok(Frame::KeeperResponse(_))
        ));
        assert!(host.report_due(1_000 + KEEPER_REPORT_EVERY_MS).is_none());
        assert!(host.report_due(2_000 + KEEPER_REPORT_EVERY_MS).is_some());
        assert!(host.report_due(3_000 + KEEPER_REPORT_EVERY_MS).is_none());
    }
}
