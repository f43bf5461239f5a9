//! What the agent keeps only to report it: refused peers and inputs (for
//! `status` and the log), clock warnings already given, names and
//! last-seen times of devices, round trips, running catch-ups, and the
//! facts of this process the shell told it at start.

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use nuwa_sync::Rejection;

use crate::agent::{Agent, Boot, Out};
use crate::constants::*;
use crate::devices::Seen;
use crate::effect::Effect;
use crate::peer::{Multiaddr, PeerId};
use crate::status::QuarantineStatus;

#[derive(Debug, Clone)]
pub(crate) struct RejectionRecord {
    pub(crate) label: &'static str,
    pub(crate) reason: String,
    pub(crate) count: u64,
    pub(crate) last_ms: u64,
}

/// The agent's records for reporting.
pub(crate) struct Book {
    pub(crate) peer_id: PeerId,
    /// This device's name (its Hellos carry it).
    pub(crate) name: String,
    /// When memory is next checked.
    pub(crate) next_evict_ms: u64,
    /// When memory was last given back on the clock (`None` until startup
    /// settled): see [`Agent::release_tick`](crate::Agent).
    pub(crate) released_ms: Option<u64>,
    /// The verified peers when memory was last given back: a device that
    /// settles with other peers gives it back again.
    pub(crate) released_peers: BTreeSet<String>,
    pub(crate) listen_addrs: Vec<Multiaddr>,
    pub(crate) started_ms: u64,
    pub(crate) quarantined: Vec<QuarantineStatus>,
    pub(crate) mdns_watching: Vec<String>,
    /// Refusals by (source, who), oldest first in `rejection_order`.
    pub(crate) rejections: BTreeMap<(String, String), RejectionRecord>,
    pub(crate) rejection_order: VecDeque<(String, String)>,
    /// Clock offsets already warned about, per peer (so redials do not
    /// repeat the warning every few seconds).
    skew_warned: BTreeMap<String, i64>,
    /// Name and last time each device was seen verified, by context id
    /// (stored, for `device list`).
    pub(crate) seen: Seen,
    /// Last ping round trip per peer, in milliseconds.
    pub(crate) rtt_ms: BTreeMap<PeerId, u64>,
    /// When each running catch-up started, by container.
    pub(crate) catch_up_started: BTreeMap<String, u64>,
}

impl Book {
    pub(crate) fn new(boot: &Boot, now_ms: u64) -> Self {
        Book {
            peer_id: boot.peer_id,
            name: boot.name.clone(),
            next_evict_ms: 0,
            released_ms: None,
            released_peers: BTreeSet::new(),
            listen_addrs: boot.listen_addrs.clone(),
            started_ms: now_ms,
            quarantined: boot.quarantined.clone(),
            mdns_watching: boot.mdns_watching.clone(),
            rejections: BTreeMap::new(),
            rejection_order: VecDeque::new(),
            skew_warned: BTreeMap::new(),
            seen: boot
                .meta
                .get(crate::devices::SEEN_META)
                .map(|b| Seen::from_bytes(b))
                .unwrap_or_default(),
            rtt_ms: BTreeMap::new(),
            catch_up_started: BTreeMap::new(),
        }
    }

    pub(crate) fn listening(&mut self, a: Multiaddr) {
        if !self.listen_addrs.contains(&a) {
            self.listen_addrs.push(a);
        }
    }

    pub(crate) fn rtt(&mut self, peer: PeerId, rtt_ms: u64) {
        self.rtt_ms.insert(peer, rtt_ms);
    }

    pub(crate) fn forget_rtt(&mut self, peer: &PeerId) {
        self.rtt_ms.remove(peer);
    }

    pub(crate) fn catch_up_started(&mut self, container: &str, now_ms: u64) {
        self.catch_up_started.insert(container.to_owned(), now_ms);
    }

    pub(crate) fn catch_up_finished(&mut self, container: &str) {
        self.catch_up_started.remove(container);
    }

    /// Whether `who` was already refused at `source` for this reason.
    pub(crate) fn is_repeat(&self, source: &str, who: &str, label: &str) -> bool {
        self.rejections
            .get(&(source.to_owned(), who.to_owned()))
            .is_some_and(|r| r.label == label)
    }

    /// Whether a clock offset of `peer` is worth a warning: the first one,
    /// or one that moved by more than 10 s.
    pub(crate) fn skew_is_news(&mut self, peer: &str, offset_ms: i64) -> bool {
        let last = self.skew_warned.insert(peer.to_owned(), offset_ms);
        last.is_none_or(|l| (l - offset_ms).abs() > 10_000)
    }

    fn record(&mut self, source: &str, who: String, rejection: &Rejection, now_ms: u64) {
        let key = (source.to_owned(), who);
        match self.rejections.get_mut(&key) {
            Some(r) => {
                r.count += 1;
                r.last_ms = now_ms;
                r.label = rejection.label();
                r.reason = rejection.to_string();
            }
            None => {
                if self.rejection_order.len() >= MAX_REJECTIONS {
                    if let Some(old) = self.rejection_order.pop_front() {
                        self.rejections.remove(&old);
                    }
                }
                self.rejection_order.push_back(key.clone());
                self.rejections.insert(
                    key,
                    RejectionRecord {
                        label: rejection.label(),
                        reason: rejection.to_string(),
                        count: 1,
                        last_ms: now_ms,
                    },
                );
            }
        }
    }
}

impl Agent {
    /// Records and counts a refused input.
    pub(crate) fn reject(
        &mut self,
        source: &'static str,
        who: String,
        rejection: &Rejection,
        now_ms: u64,
        out: &mut Out,
    ) {
        out.push(Effect::CountRejection {
            source,
            reason: rejection.label(),
        });
        self.book.record(source, who, rejection, now_ms);
    }

    /// Saves devices' names and last-seen times (off the loop).
    pub(crate) fn save_seen(&self, now_ms: u64, out: &mut Out) {
        out.push(Effect::SaveMeta {
            key: crate::devices::SEEN_META.to_owned(),
            bytes: self.book.seen.to_bytes(now_ms),
        });
    }

    /// Records every verified peer as seen now, at most once a minute (or
    /// at once when `force`, at shutdown), and saves the record.
    pub(crate) fn remember_seen(&mut self, now_ms: u64, force: bool, out: &mut Out) {
        if !force && !self.book.seen.refresh_due(now_ms) {
            return;
        }
        let me = self.session.membership().context_id().to_owned();
        let verified: Vec<String> = self
            .session
            .verified()
            .map(|(_, ctx)| ctx.to_owned())
            .collect();
        self.book.seen.saw(&me, &self.book.name, now_ms);
        for ctx in verified {
            self.book.seen.saw(&ctx, "", now_ms);
        }
        self.save_seen(now_ms, out);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn book() -> Book {
        let key = nuwa_identity::keys::DeviceKey::from_seed(&[7; 32]);
        Book {
            peer_id: crate::peer::id_of(&key.public()).unwrap(),
            name: "me".to_owned(),
            next_evict_ms: 0,
            released_ms: None,
            released_peers: BTreeSet::new(),
            listen_addrs: Vec::new(),
            started_ms: 0,
            quarantined: Vec::new(),
            mdns_watching: Vec::new(),
            rejections: BTreeMap::new(),
            rejection_order: VecDeque::new(),
            skew_warned: BTreeMap::new(),
            seen: Seen::default(),
            rtt_ms: BTreeMap::new(),
            catch_up_started: BTreeMap::new(),
        }
    }

    #[test]
    fn rejection_records_are_bounded_oldest_dropped_first() {
        // Goal: at most MAX_REJECTIONS records are kept, one per (source,
        // who); a new one beyond that drops the record first made (even if
        // it was refused again since), and a repeat updates its record in
        // place (count, time, latest label) without dropping any.
        let mut b = book();
        let total = MAX_REJECTIONS + 10;
        for i in 0..total {
            b.record("dht", format!("p{i}"), &Rejection::UnknownKey, i as u64);
            assert_eq!(b.rejections.len(), (i + 1).min(MAX_REJECTIONS));
            assert_eq!(b.rejection_order.len(), b.rejections.len());
        }
        let kept: Vec<String> = b.rejection_order.iter().map(|k| k.1.clone()).collect();
        let newest: Vec<String> = (total - MAX_REJECTIONS..total)
            .map(|i| format!("p{i}"))
            .collect();
        assert_eq!(kept, newest);

        // The oldest kept record, refused again for another reason.
        let oldest = format!("p{}", total - MAX_REJECTIONS);
        b.record("dht", oldest.clone(), &Rejection::BadSignature, 9_999);
        assert_eq!(b.rejections.len(), MAX_REJECTIONS);
        let r = &b.rejections[&("dht".to_owned(), oldest.clone())];
        assert_eq!((r.count, r.last_ms, r.label), (2, 9_999, "bad_signature"));
        assert!(b.is_repeat("dht", &oldest, "bad_signature"));

        // The same who at another source is another record: the oldest goes,
        // though it was refused last.
        b.record("mdns", "p0".to_owned(), &Rejection::UnknownKey, 10_000);
        assert_eq!(b.rejections.len(), MAX_REJECTIONS);
        assert!(!b.rejections.contains_key(&("dht".to_owned(), oldest)));
        assert_eq!(
            b.rejection_order.back(),
            Some(&("mdns".to_owned(), "p0".to_owned()))
        );
    }
}
