//! When a device gives memory back (issue 26, idle memory): once startup
//! settled (every verified peer in sync, or ten seconds after start for a
//! device alone), then every five minutes, and when it settles again with
//! a peer that joined later. The shell drops the code pages
//! startup ran and the allocator's free pages then (node/src/daemon/
//! exec/resident.rs); an idle daemon's RSS is measured in docs/performance.md.

mod sim;

use sim::{Knobs, Sim};

/// `SETTLED_RELEASE_MS` and `RELEASE_EVERY_MS` in crates/agent/src/
/// constants.rs (crate-private there).
const SETTLED_MS: u64 = 10_000;
const EVERY_MS: u64 = 300_000;
/// `RELEASE_AFTER_PEERS_MS`.
const AFTER_PEERS_MS: u64 = 2_000;

fn seeds() -> std::ops::Range<u64> {
    0..8
}

/// Goal: two devices that meet and sync give memory back as soon as they
/// are in sync, well before the ten-second fallback, and then every five
/// minutes (an eviction gives memory back too). Method: the seeded simulator; both start on
/// one network, run for eleven minutes idle.
#[test]
fn devices_in_sync_give_memory_back_at_once_then_every_five_minutes() {
    for seed in seeds() {
        let mut s = Sim::new(seed, 2, Knobs::default());
        let t0 = s.now_ms;
        s.start(0);
        s.start(1);
        s.run_for(11 * 60_000);
        for (i, d) in s.devices.iter().enumerate() {
            let r = &d.released_ms;
            let first = *r.first().unwrap_or_else(|| {
                panic!(
                    "seed {seed}: d{i} never gave memory back\n{}",
                    s.trace_tail()
                )
            });
            assert!(
                first - t0 < SETTLED_MS,
                "seed {seed}: d{i} first gave memory back {} ms after start, though in sync",
                first - t0
            );
            for k in 1..=2 {
                let at = first + k * EVERY_MS;
                assert!(
                    r.iter().any(|&t| (at..at + 1_000).contains(&t)),
                    "seed {seed}: d{i}: no release {k}×5 min after the first: {r:?}"
                );
            }
            // Besides those, only the eviction of what startup loaded, a
            // minute later, gives memory back.
            assert!(r.len() <= 4, "seed {seed}: d{i}: {r:?}");
        }
    }
}

/// Goal: a device with nobody to sync with still gives memory back, ten
/// seconds after start. Method: one device started alone.
#[test]
fn a_device_alone_gives_memory_back_ten_seconds_after_start() {
    for seed in seeds() {
        let mut s = Sim::new(seed, 2, Knobs::default());
        let t0 = s.now_ms;
        s.start(0);
        s.run_for(SETTLED_MS - 1_000);
        let early: Vec<u64> = s.devices[0].released_ms.clone();
        assert!(
            early.iter().all(|&t| t - t0 < 1_000),
            "seed {seed}: released before settling: {early:?}"
        );
        s.run_for(2_000);
        let r = &s.devices[0].released_ms[early.len()..];
        assert_eq!(r.len(), 1, "seed {seed}: {r:?}");
        assert!(
            (SETTLED_MS..SETTLED_MS + 1_000).contains(&(r[0] - t0)),
            "seed {seed}: released {} ms after start",
            r[0] - t0
        );
    }
}

/// Goal: a device that settled and gave memory back gives it back again
/// once a peer that joined later is in sync (the join's burst ran code idle
/// does not use), no sooner than two seconds after the last release, and
/// not again while the peers stay the same. Method: d0 and d1 meet and
/// settle; d2 starts 30 s later; the two earlier devices must release
/// again within ten seconds of d2's start, then not before five minutes.
#[test]
fn a_device_gives_memory_back_again_once_a_peer_that_joined_is_in_sync() {
    for seed in seeds() {
        let mut s = Sim::new(seed, 3, Knobs::default());
        let t0 = s.now_ms;
        s.start(0);
        s.start(1);
        s.run_for(30_000);
        let before: Vec<usize> = (0..2).map(|i| s.devices[i].released_ms.len()).collect();
        for (i, n) in before.iter().enumerate() {
            assert!(
                *n >= 1,
                "seed {seed}: d{i} never settled\n{}",
                s.trace_tail()
            );
        }
        let joined = s.now_ms;
        s.start(2);
        s.run_for(60_000);
        for (i, &n) in before.iter().enumerate() {
            let r = &s.devices[i].released_ms;
            let again = &r[n..];
            assert!(
                again.iter().any(|&t| t >= joined && t - joined < 10_000),
                "seed {seed}: d{i} gave no memory back after d2 joined at {}: {r:?}",
                joined - t0
            );
            // The peers stayed the same since: no more until the next
            // five-minute release (or an eviction of what startup loaded).
            assert!(again.len() <= 2, "seed {seed}: d{i}: {r:?}");
            let prev = r[n - 1];
            assert!(
                again[0] >= prev + AFTER_PEERS_MS,
                "seed {seed}: d{i} gave memory back again {} ms after the last time: {r:?}",
                again[0] - prev
            );
        }
    }
}

const LOG: &str = "did:nuwa:core:ConversationLog#v1";

/// The ids of the entries of the conversation log device `i` holds.
fn log_ids(s: &Sim, i: usize) -> Vec<String> {
    let disk = s.devices[i].disk.as_ref().expect("a home");
    let reg = nuwa_agent::asm_model::registry::Registry::with_core();
    let layout = &reg.get(LOG).expect("a core model").layout;
    let log = disk.load(LOG).expect("the log is stored");
    nuwa_agent::asm_model::doc::items(log.doc(), layout)
        .expect("the log renders")
        .into_iter()
        .map(|(id, _)| id)
        .collect()
}

/// When device `i`'s reader scanned the conversation log in `[from, to)`.
fn log_scans(s: &Sim, i: usize, from: u64, to: u64) -> Vec<u64> {
    s.devices[i]
        .scanned
        .iter()
        .filter(|(t, c)| c == LOG && (from..to).contains(t))
        .map(|(t, _)| *t)
        .collect()
}

/// Goal: the lifecycle task does not make an idle device's reader load
/// its containers every 30 s (each load took back memory the device had
/// given back); it scans a container again only once the container changed
/// or its next item is due, and still removes an item on every device when
/// its time comes. Method: the seeded simulator, whose reader scans the
/// disk with the node's rules; two devices idle for five minutes, then a
/// log entry 90 s short of its 14-day TTL, then five quiet minutes.
#[test]
fn the_lifecycle_scans_a_container_again_only_once_it_changed_or_an_item_is_due() {
    for seed in seeds() {
        let mut s = Sim::new(seed, 2, Knobs::default());
        s.start(0);
        s.start(1);
        s.run_for(60_000);
        let idle = s.now_ms;
        s.run_for(5 * 60_000);
        for (i, d) in s.devices.iter().enumerate() {
            assert!(
                d.scanned.iter().any(|(t, c)| c == LOG && *t < idle),
                "seed {seed}: d{i} never scanned the log: {:?}",
                d.scanned
            );
            let again: Vec<_> = d.scanned.iter().filter(|(t, _)| *t >= idle).collect();
            assert!(
                again.is_empty(),
                "seed {seed}: d{i} scanned while idle: {again:?}"
            );
        }

        let created = s.now_ms;
        let ttl_secs = 14 * 86_400;
        let stamp = (created / 1000) as i64 - ttl_secs + 90;
        let timestamp = time::OffsetDateTime::from_unix_timestamp(stamp)
            .unwrap()
            .format(&time::format_description::well_known::Rfc3339)
            .unwrap();
        let id = "00000000-0000-4000-8000-000000000001";
        let entry =
            serde_json::json!({"id": id, "role": "user", "content": "hi", "timestamp": timestamp});
        s.create(0, LOG, entry);
        // The first second at which the TTL removes it.
        let due_ms = ((stamp + ttl_secs + 1) * 1000) as u64;
        s.run_for(60_000);
        for i in 0..2 {
            assert_eq!(log_ids(&s, i), vec![id.to_owned()], "seed {seed}: d{i}");
            assert!(
                !log_scans(&s, i, created, created + 60_000).is_empty(),
                "seed {seed}: d{i} did not scan the log once it changed"
            );
        }
        let before_due = s.now_ms;
        s.run_for(due_ms - before_due - 1_000);
        for i in 0..2 {
            let early = log_scans(&s, i, before_due, due_ms);
            assert!(
                early.is_empty(),
                "seed {seed}: d{i} scanned before the entry was due: {early:?}"
            );
        }
        // Due: removed at the next tick of the task, on both devices.
        s.run_for(31_000);
        for i in 0..2 {
            assert!(
                log_ids(&s, i).is_empty(),
                "seed {seed}: d{i} kept the expired entry\n{}",
                s.trace_tail()
            );
        }
        // Both removals synced, each device scanned what it then held;
        // then quiet again.
        s.run_for(2 * 60_000);
        let quiet = s.now_ms;
        s.run_for(5 * 60_000);
        for (i, d) in s.devices.iter().enumerate() {
            let again: Vec<_> = d.scanned.iter().filter(|(t, _)| *t >= quiet).collect();
            assert!(
                again.is_empty(),
                "seed {seed}: d{i} scanned while idle: {again:?}"
            );
        }
        s.check_converged();
    }
}
