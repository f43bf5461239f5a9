//! What the agent reports: the `status` report, `device list`, the
//! progress and result of `sync --once`, and keeping memory within its
//! budget (containers leave memory when idle or over it).

use std::collections::BTreeMap;

use nuwa_proto::Frame;
use nuwa_sync::{PeerState, PeerSyncState};
use tracing::debug;

use crate::agent::{Agent, Out};
use crate::constants::*;
use crate::count::Count;
use crate::devices::DeviceEntry;
use crate::effect::{Effect, OnceResult};
use crate::peer::{self, PeerId};
use crate::status::{
    CatchUpStatus, ClockSkewStatus, ContainerStatus, DeviceStatus, DhtPointerStatus, MdnsStatus,
    PeerStatus, PeerSyncStatus, ReachabilityStatus, RejectionStatus, Status,
};

/// `sync --once`: the deadline and what was last said.
pub(crate) struct Once {
    deadline_ms: u64,
    last_line: String,
}

impl Once {
    pub(crate) fn new(deadline_ms: u64) -> Self {
        Once {
            deadline_ms,
            last_line: String::new(),
        }
    }
}

impl Agent {
    /// Every device the chain ever listed, with what this device knows of
    /// it (names and last-seen times).
    pub(crate) fn devices(&self, now_ms: u64) -> Vec<DeviceEntry> {
        let mut seen = self.book.seen.clone();
        let m = self.session.membership();
        seen.saw(m.context_id(), &self.book.name, now_ms);
        for (_, ctx) in self.session.verified() {
            seen.saw(ctx, "", now_ms);
        }
        crate::devices::list(m.log(), &seen, m.context_id(), now_ms)
    }

    /// Gives memory back (the reader's idle replicas, the allocator's free
    /// pages, the code pages startup ran) once startup has settled, then
    /// every [`RELEASE_EVERY_MS`], and whenever the device settles with
    /// another set of peers than at the last release (at most every
    /// [`RELEASE_AFTER_PEERS_MS`]). Settled: every verified peer in sync
    /// with no catch-up running, or [`SETTLED_RELEASE_MS`] after start for
    /// the first release, whichever comes first.
    pub(crate) fn release_tick(&mut self, now_ms: u64, out: &mut Out) {
        // Cheapest first: this runs every tick of an idle device.
        let due = match self.book.released_ms {
            Some(at) => {
                now_ms >= at.saturating_add(RELEASE_EVERY_MS)
                    || (now_ms >= at.saturating_add(RELEASE_AFTER_PEERS_MS)
                        && !self
                            .session
                            .verified()
                            .map(|(p, _)| p)
                            .eq(self.book.released_peers.iter())
                        && self.settled())
            }
            None => {
                self.settled() || now_ms >= self.book.started_ms.saturating_add(SETTLED_RELEASE_MS)
            }
        };
        if due {
            self.book.released_ms = Some(now_ms);
            self.book.released_peers = self.session.verified().map(|(p, _)| p.clone()).collect();
            // An eviction of this tick may have asked already.
            if !out
                .effects
                .iter()
                .any(|e| matches!(e, Effect::ReleaseMemory))
            {
                out.push(Effect::ReleaseMemory);
            }
        }
    }

    /// Every verified peer (at least one) in sync, with no catch-up running.
    fn settled(&mut self) -> bool {
        let peers: Vec<String> = self.session.verified().map(|(p, _)| p.clone()).collect();
        !peers.is_empty()
            && self.book.catch_up_started.is_empty()
            && peers.iter().all(|p| self.session.in_sync_with(p))
    }

    /// Evicts containers unused for a minute, and, while resident memory is
    /// over the budget, the least recently used ones; memory is given back
    /// after an eviction.
    pub(crate) fn memory_tick(&mut self, now_ms: u64, rss_bytes: Option<u64>, out: &mut Out) {
        if now_ms < self.book.next_evict_ms {
            return;
        }
        self.book.next_evict_ms = now_ms + EVICT_EVERY_MS;
        let keep = [crate::asm::REGISTRY_CONTAINER, crate::apps::APPS_CONTAINER];
        let mut evicted = self.session.evict_idle(IDLE_EVICT_MS, usize::MAX, &keep);
        let over = rss_bytes.is_some_and(|rss| rss > self.config().memory_budget_bytes);
        if over {
            let loaded = self.session.engine().loaded_count();
            evicted += self.session.evict_idle(IDLE_EVICT_MS, loaded / 2, &keep);
        }
        if evicted > 0 {
            out.count_by(Count::ContainersEvicted, evicted as u64);
            out.push(Effect::ReleaseMemory);
            debug!(
                evicted,
                in_memory = self.session.engine().loaded_count(),
                over_budget = over,
                "containers left memory"
            );
        }
    }

    /// Whether this device (or the home's master key) is an admin.
    fn is_admin(&self, now_secs: i64) -> bool {
        let doc = self.session.log().current();
        [
            Some(self.session.membership().device().public()),
            self.standing.master_public(),
        ]
        .into_iter()
        .flatten()
        .any(|p| {
            doc.method_for_public(
                &p,
                nuwa_identity::document::Relationship::CapabilityDelegation,
                now_secs,
            )
            .is_ok()
        })
    }

    /// The sync state of every container with every verified peer.
    fn peer_sync(&mut self) -> BTreeMap<String, Vec<PeerSyncStatus>> {
        let verified: Vec<String> = self.session.verified().map(|(p, _)| p.clone()).collect();
        verified
            .into_iter()
            .map(|p| {
                let report = self.session.sync_report(&p);
                let rows = report
                    .into_iter()
                    .map(|r| PeerSyncStatus {
                        container: r.container,
                        state: r.state.as_str().to_owned(),
                        behind: r.behind,
                    })
                    .collect();
                (p, rows)
            })
            .collect()
    }

    fn peer_rows(&self, sync: &BTreeMap<String, Vec<PeerSyncStatus>>) -> Vec<PeerStatus> {
        self.session
            .peers()
            .iter()
            .filter_map(|(p, s)| match s {
                PeerState::Verified {
                    context_id,
                    remote,
                    since_ms,
                    clock_offset_ms,
                    ..
                } => {
                    let id = p.parse::<PeerId>().ok();
                    // The connection in use now, if it changed since (a
                    // hole punch replaced the relayed one).
                    let remote = id
                        .and_then(|id| self.discovery.paths.get(&id))
                        .map(|a| a.to_string())
                        .unwrap_or_else(|| remote.clone());
                    let path = remote
                        .parse()
                        .map(|a| peer::path_of(&a))
                        .unwrap_or(peer::Path {
                            transport: "other",
                            relayed: false,
                        });
                    Some(PeerStatus {
                        peer_id: p.clone(),
                        context_id: context_id.clone(),
                        address: remote,
                        verified_at_unix_ms: *since_ms,
                        clock_offset_ms: *clock_offset_ms,
                        transport: path.transport.to_owned(),
                        relayed: path.relayed,
                        name: self
                            .book
                            .seen
                            .name_of(context_id)
                            .unwrap_or_default()
                            .to_owned(),
                        rtt_ms: id.and_then(|id| self.book.rtt_ms.get(&id).copied()),
                        sync: sync.get(p).cloned().unwrap_or_default(),
                    })
                }
                PeerState::Pending { .. } => None,
            })
            .collect()
    }

    fn catch_up_rows(&self, now_ms: u64) -> Vec<CatchUpStatus> {
        self.session
            .engine()
            .catch_up_progress()
            .into_iter()
            .map(|c| CatchUpStatus {
                started_unix_ms: self
                    .book
                    .catch_up_started
                    .get(&c.container)
                    .copied()
                    .unwrap_or(now_ms),
                container: c.container,
                peer_id: c.peer,
                changes: c.changes,
                bytes: c.bytes,
            })
            .collect()
    }

    fn rejection_rows(&self) -> Vec<RejectionStatus> {
        self.book
            .rejection_order
            .iter()
            .filter_map(|k| {
                self.book.rejections.get(k).map(|r| RejectionStatus {
                    source: k.0.clone(),
                    peer: k.1.clone(),
                    label: r.label.to_owned(),
                    reason: r.reason.clone(),
                    count: r.count,
                    last_unix_ms: r.last_ms,
                })
            })
            .collect()
    }

    fn container_rows(&self) -> Vec<ContainerStatus> {
        let e = self.session.engine();
        e.container_names()
            .into_iter()
            .map(|name| ContainerStatus {
                name: name.clone(),
                heads: e
                    .heads_of(name)
                    .unwrap_or_default()
                    .iter()
                    .map(hex::encode)
                    .collect(),
                changes: e.change_count_of(name).unwrap_or(0),
            })
            .collect()
    }

    /// The `status` report. The shell adds its counters.
    pub(crate) fn status(&mut self, now_ms: u64) -> Status {
        let sync = self.peer_sync();
        let in_sync = !sync.is_empty()
            && sync
                .values()
                .all(|v| v.iter().all(|c| c.state == "in_sync" || c.state == "ahead"));
        let m = self.session.membership();
        let peer_id = self.book.peer_id.to_string();
        Status {
            agent_did: m.did().to_owned(),
            device: DeviceStatus {
                context_id: m.context_id().to_owned(),
                peer_id: peer_id.clone(),
                name: self.book.name.clone(),
                authorised: m.self_authorised(now_ms).is_ok(),
                revoked: self.standing.revoked(),
                never_syncs: self.standing.writes.never_syncs().cloned(),
                did_log_len: m.log().len(),
                hello_bytes: m
                    .hello(now_ms)
                    .map(|h| Frame::Hello(h).encode().len())
                    .unwrap_or(0),
            },
            listen_addrs: self
                .book
                .listen_addrs
                .iter()
                .map(|a| format!("{a}/p2p/{peer_id}"))
                .collect(),
            api_url: self.config().api_url.clone(),
            peers: self.peer_rows(&sync),
            clock_skew: self
                .session
                .skewed()
                .iter()
                .map(|(peer, offset_ms)| ClockSkewStatus {
                    peer_id: peer.clone(),
                    offset_ms: *offset_ms,
                    window_ms: nuwa_sync::secure::REPLAY_WINDOW_SECS * 1000,
                })
                .collect(),
            quarantined: self.book.quarantined.clone(),
            rejections: self.rejection_rows(),
            counters: BTreeMap::new(),
            containers: self.container_rows(),
            reachability: ReachabilityStatus {
                nat: self.discovery.nat.as_str().to_owned(),
                advertised: self
                    .discovery
                    .advertised
                    .iter()
                    .map(|a| a.to_string())
                    .collect(),
                relays: self
                    .discovery
                    .relays
                    .iter()
                    .map(|r| r.to_string())
                    .collect(),
            },
            keepers: self.keeper_status(),
            version: env!("CARGO_PKG_VERSION").to_owned(),
            uptime_s: now_ms.saturating_sub(self.book.started_ms) / 1000,
            key_epoch: self.session.secure().epoch(),
            in_sync,
            catch_ups: self.catch_up_rows(now_ms),
            mdns: MdnsStatus {
                enabled: self.discovery.mdns_on(),
                interfaces: self.book.mdns_watching.clone(),
                error: self.config().mdns_failed.clone(),
            },
            rendezvous: self.discovery.rendezvous_status(),
            dht_pointer: self.discovery.pointer_bytes.map(|bytes| DhtPointerStatus {
                bytes,
                limit: nuwa_sync::pointer::MAX_POINTER_BYTES as u64,
            }),
            master_key: self.standing.master_public().is_some(),
            admin: self.is_admin((now_ms / 1000) as i64),
            recovery_key: !crate::lifecycle::recovery_keys(self.session.log().current()).is_empty(),
        }
    }

    /// `sync --once`: says where it stands when that changes, and ends it
    /// once converged with every verified peer (or pulled to the end of a
    /// keeper with no other device online), or at the deadline.
    pub(crate) fn once_tick(&mut self, now_ms: u64, out: &mut Out) {
        let Some(deadline) = self.once.as_ref().map(|o| o.deadline_ms) else {
            return;
        };
        let verified: Vec<String> = self.session.verified().map(|(p, _)| p.clone()).collect();
        let in_sync = verified
            .iter()
            .filter(|p| self.session.in_sync_with(p))
            .count();
        let containers = self.session.engine().container_count();
        let line = self.once_line(&verified, in_sync, containers);
        let line = crate::once::with_time_left(line, now_ms, deadline);
        if let Some(once) = &mut self.once
            && line != once.last_line
        {
            out.push(Effect::Progress(line.clone()));
            once.last_line = line;
        }
        let (through, message) = if verified.is_empty() && self.keepers.caught_up() {
            let said = format!(
                "converged only with what the keeper holds (no other device online, so a \
                 write the keeper never received is not here); {containers} container(s)"
            );
            (Some("keeper"), said)
        } else if !verified.is_empty() && in_sync == verified.len() {
            let said = format!(
                "converged with {} peer(s); {containers} container(s) in sync",
                verified.len()
            );
            (Some("peers"), said)
        } else if now_ms >= deadline {
            (None, self.once_failure(verified.len(), in_sync))
        } else {
            return;
        };
        self.once = None;
        out.push(Effect::Finished(OnceResult {
            converged: through.is_some(),
            outcome: crate::once::Outcome::of(through.is_some(), verified.len()),
            through,
            peers_verified: verified.len(),
            peers_in_sync: in_sync,
            containers,
            message,
        }));
    }

    /// The progress line. On a terminal (where it is redrawn in place) it
    /// also shows what is left: changes behind (peers say how many they
    /// hold) and catch-ups under way.
    fn once_line(&mut self, verified: &[String], in_sync: usize, containers: usize) -> String {
        let mut line = format!(
            "peers verified: {}  in sync: {}  containers: {}",
            verified.len(),
            in_sync,
            containers
        );
        if !self.config().once_tty {
            return line;
        }
        let mut behind = 0u64;
        let mut behind_containers = 0usize;
        for p in verified {
            for r in self.session.sync_report(p) {
                if r.state == PeerSyncState::Behind {
                    behind_containers += 1;
                    behind += r.behind.unwrap_or(0);
                }
            }
        }
        if behind_containers > 0 {
            line.push_str(&format!("  behind: {behind_containers} container(s)"));
            if behind > 0 {
                line.push_str(&format!(", {behind} change(s)"));
            }
        }
        for c in self.session.engine().catch_up_progress() {
            line.push_str(&format!(
                "  catching up {}: {} changes, {:.1} MiB",
                c.container,
                c.changes,
                c.bytes as f64 / (1u64 << 20) as f64
            ));
        }
        line
    }

    fn once_failure(&self, verified: usize, in_sync: usize) -> String {
        if let Some((peer, r)) = self.keepers.rolled_back().filter(|_| verified == 0) {
            return format!(
                "not converged: the keeper {peer} rolled back (it held entries up to #{}, now \
                 only up to #{}), so what it serves may lack acknowledged writes; this device \
                 pushed its copy to it again. Sync with another device, or check the keeper's store",
                r.held_seq, r.served_seq
            );
        }
        if verified > 0 {
            return format!(
                "not converged before the timeout: {in_sync} of {verified} verified peer(s) in sync"
            );
        }
        let rejected = self.book.rejections.len();
        if rejected > 0 {
            format!(
                "no verified peer before the timeout ({rejected} rejected; see the log). \
                 Check that the other devices run and that this home belongs to the same agent"
            )
        } else {
            "no peer reachable before the timeout: no device of this agent was found by \
             known peers, mDNS, the DHT, rendezvous or a keeper. Start another device, or pass \
             --peer, --bootstrap, --rendezvous or --keeper"
                .to_owned()
        }
    }
}
