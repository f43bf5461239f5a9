//! Keeper push and pull throughput, for docs/performance.md:
//! `cargo run --release -p nuwa-keeper --example throughput [ENVELOPES] [BYTES] [PER_PUSH]`.
//!
//! One agent with one device; envelopes of BYTES sealed bytes each, pushed
//! PER_PUSH at a time (each push verified and flushed to disk before it is
//! acknowledged, as in service: the keeper over `nuwa_store::SledKeeperStore`),
//! then pulled back in 4 MiB pages. Prints
//! envelopes/s and MB/s for both, timed around `Keeper::handle` alone (no
//! network).
//!
//! Then a quota flood: agent A, over its quota, sends 2,000 pushes (each
//! refused) interleaved with agent B's push-and-pull; B's latency per
//! request is printed against a run without the flood.

use std::time::{Duration, Instant};

use nuwa_crypto::SyncKey;
use nuwa_identity::chain::DidChain;
use nuwa_identity::document::Relationship;
use nuwa_identity::keys::{DeviceKey, context_id_for};
use nuwa_keeper::{Keeper, KeeperConfig, sign_request};
use nuwa_proto::keeper::{KeeperBody, KeeperResponse};
use nuwa_store::SledKeeperStore;

fn main() {
    let args: Vec<u64> = std::env::args()
        .skip(1)
        .map(|a| a.parse().expect("numbers"))
        .collect();
    let total = *args.first().unwrap_or(&20_000) as usize;
    let size = *args.get(1).unwrap_or(&1024) as usize;
    let per_push = *args.get(2).unwrap_or(&256) as usize;

    let now_s = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64;
    let now = now_s as u64 * 1000;
    let Agent { dev, ctx, log, key } = agent(now_s);
    let did = log.did().to_owned();
    let plaintext = vec![0x5a; size.saturating_sub(120)];
    let envelopes: Vec<_> = (0..total)
        .map(|_| nuwa_crypto::seal(&key, dev.signing_key(), &did, &ctx, now, &plaintext).unwrap())
        .collect();

    let dir = tempfile::tempdir().unwrap();
    let mut keeper = Keeper::new(
        Box::new(SledKeeperStore::open(dir.path()).unwrap()),
        KeeperConfig {
            max_bytes_per_agent: u64::MAX,
            max_envelopes_per_agent: u64::MAX,
            ..KeeperConfig::default()
        },
    );
    let mut bytes = 0usize;
    let t = Instant::now();
    for (i, chunk) in envelopes.chunks(per_push).enumerate() {
        bytes += chunk
            .iter()
            .map(|e| e.ciphertext.len() + 120)
            .sum::<usize>();
        let body = KeeperBody::Push {
            did_proof: if i == 0 {
                log.proof().encode().unwrap()
            } else {
                Vec::new()
            },
            envelopes: chunk.to_vec(),
            replaces_through: 0,
            membership: Default::default(),
        };
        let req = sign_request(&dev, &ctx, &did, i as u64, body, now).unwrap();
        let r = keeper.handle(req, now);
        assert!(matches!(r, KeeperResponse::Pushed { .. }), "{r:?}");
    }
    let push = t.elapsed().as_secs_f64();
    let t = Instant::now();
    let (mut cursor, mut got) = (0u64, 0usize);
    loop {
        let req = sign_request(
            &dev,
            &ctx,
            &did,
            0,
            KeeperBody::Pull {
                since: cursor,
                max_bytes: 4 * 1024 * 1024,
                have_head: String::new(),
                have_epoch: 0,
            },
            now,
        )
        .unwrap();
        match keeper.handle(req, now) {
            KeeperResponse::Batch {
                entries,
                next,
                more,
                ..
            } => {
                got += entries.len();
                cursor = next;
                if !more {
                    break;
                }
            }
            other => panic!("{other:?}"),
        }
    }
    let pull = t.elapsed().as_secs_f64();
    assert_eq!(got, total);
    flood(now, now_s);
    let mb = bytes as f64 / 1e6;
    println!("keeper: {total} envelopes of {size} B, {per_push} per push (verified, flushed)");
    println!(
        "push: {:.0} envelopes/s, {:.1} MB/s ({:.2} s)",
        total as f64 / push,
        mb / push,
        push
    );
    println!(
        "pull: {:.0} envelopes/s, {:.1} MB/s ({:.2} s)",
        total as f64 / pull,
        mb / pull,
        pull
    );
}

struct Agent {
    dev: DeviceKey,
    ctx: String,
    log: DidChain,
    key: SyncKey,
}

fn agent(now_s: i64) -> Agent {
    let master = DeviceKey::generate().unwrap();
    let dev = DeviceKey::generate().unwrap();
    let ctx = context_id_for(&dev.public());
    let mut log = DidChain::genesis(&master, now_s - 10).unwrap();
    let mut doc = log.current().clone();
    doc.add_key(&ctx, &dev.public(), &[Relationship::Authentication], None)
        .unwrap();
    let id = log.current().capability_delegation[0].clone();
    log.append_document(&doc, &master, &id, now_s - 9).unwrap();
    Agent {
        dev,
        ctx,
        log,
        key: SyncKey::generate(0).unwrap(),
    }
}

fn push_req(a: &Agent, now: u64, with_log: bool, n: usize) -> nuwa_proto::keeper::KeeperRequest {
    let envelopes = (0..n)
        .map(|_| {
            nuwa_crypto::seal(
                &a.key,
                a.dev.signing_key(),
                a.log.did(),
                &a.ctx,
                now,
                &[1u8; 900],
            )
            .unwrap()
        })
        .collect();
    let body = KeeperBody::Push {
        did_proof: if with_log {
            a.log.proof().encode().unwrap()
        } else {
            Vec::new()
        },
        envelopes,
        replaces_through: 0,
        membership: Default::default(),
    };
    sign_request(&a.dev, &a.ctx, a.log.did(), 0, body, now).unwrap()
}

fn pull_req(a: &Agent, now: u64) -> nuwa_proto::keeper::KeeperRequest {
    let body = KeeperBody::Pull {
        since: 0,
        max_bytes: 64 * 1024,
        have_head: String::new(),
        have_epoch: 0,
    };
    sign_request(&a.dev, &a.ctx, a.log.did(), 0, body, now).unwrap()
}

/// B's push-then-pull latencies, with A's refused flood in between or not.
fn b_latencies(keeper: &mut Keeper, a: &Agent, b: &Agent, now: u64, flood: bool) -> Vec<Duration> {
    let mut out = Vec::new();
    let mut refused = 0;
    for i in 0..200 {
        if flood {
            for _ in 0..10 {
                if let KeeperResponse::Refused { .. } =
                    keeper.handle(push_req(a, now, false, 4), now)
                {
                    refused += 1;
                }
            }
        }
        let t = Instant::now();
        let r = keeper.handle(push_req(b, now, i == 0, 1), now);
        assert!(
            matches!(r, KeeperResponse::Pushed { .. }),
            "B's push: {r:?}"
        );
        let r = keeper.handle(pull_req(b, now), now);
        assert!(matches!(r, KeeperResponse::Batch { .. }), "B's pull: {r:?}");
        out.push(t.elapsed());
    }
    if flood {
        assert_eq!(refused, 2000, "every flood push is refused");
    }
    out.sort();
    out
}

fn flood(now: u64, now_s: i64) {
    let dir = tempfile::tempdir().unwrap();
    let mut keeper = Keeper::new(
        Box::new(SledKeeperStore::open(dir.path()).unwrap()),
        KeeperConfig {
            max_envelopes_per_agent: 1000,
            ..KeeperConfig::default()
        },
    );
    let a = agent(now_s);
    // A fills its quota (B's 400 pushes stay well inside its own).
    for i in 0..10 {
        let r = keeper.handle(push_req(&a, now, i == 0, 100), now);
        assert!(matches!(r, KeeperResponse::Pushed { .. }), "{r:?}");
    }
    // A fresh agent B for each phase, so both see the same store sizes.
    // Flooded first, then quiet: a later phase meets a bigger store, so
    // this order can only flatter the quiet one.
    let loud = b_latencies(&mut keeper, &a, &agent(now_s), now, true);
    let quiet = b_latencies(&mut keeper, &a, &agent(now_s), now, false);
    let ms = |v: &[Duration], q: f64| v[((v.len() - 1) as f64 * q) as usize].as_secs_f64() * 1e3;
    println!(
        "quota flood: agent A over quota sends 2,000 pushes (all refused, counted: {:?}) between agent B's 200 push+pull pairs",
        keeper.stats().refused
    );
    println!(
        "B push+pull latency without the flood: p50 {:.2} ms, p99 {:.2} ms; with it: p50 {:.2} ms, p99 {:.2} ms",
        ms(&quiet, 0.5),
        ms(&quiet, 0.99),
        ms(&loud, 0.5),
        ms(&loud, 0.99)
    );
}
