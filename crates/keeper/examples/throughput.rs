//! Keeper push and pull throughput, for docs/performance.md:
//! `cargo run --release -p nuwa-keeper --example throughput [ENVELOPES] [BYTES] [PER_PUSH]`.
//!
//! One agent with one device; envelopes of BYTES sealed bytes each, pushed
//! PER_PUSH at a time (each push verified and flushed to disk before it is
//! acknowledged, as in service), then pulled back in 4 MiB pages. Prints
//! envelopes/s and MB/s for both, timed around `Keeper::handle` alone (no
//! network).

use std::time::Instant;

use nuwa_crypto::SyncKey;
use nuwa_identity::document::Relationship;
use nuwa_identity::keys::{DeviceKey, context_id_for};
use nuwa_identity::log::DidLog;
use nuwa_keeper::{Keeper, KeeperConfig, sign_request};
use nuwa_proto::keeper::{KeeperBody, KeeperResponse};

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
    let master = DeviceKey::generate().unwrap();
    let dev = DeviceKey::generate().unwrap();
    let ctx = context_id_for(&dev.public());
    let mut log = DidLog::genesis(&master, now_s - 10).unwrap();
    let mut doc = log.current().clone();
    doc.add_key(&ctx, &dev.public(), &[Relationship::Authentication], None)
        .unwrap();
    let id = log.current().capability_delegation[0].clone();
    log.append(doc, &master, &id, now_s - 9).unwrap();
    let did = log.did().to_owned();
    let key = SyncKey::generate(0).unwrap();
    let plaintext = vec![0x5a; size.saturating_sub(120)];
    let envelopes: Vec<_> = (0..total)
        .map(|_| nuwa_crypto::seal(&key, dev.signing_key(), &did, &ctx, now, &plaintext).unwrap())
        .collect();

    let dir = tempfile::tempdir().unwrap();
    let mut keeper = Keeper::open(
        dir.path(),
        KeeperConfig {
            max_bytes_per_agent: u64::MAX,
            max_envelopes_per_agent: u64::MAX,
            ..KeeperConfig::default()
        },
    )
    .unwrap();
    let mut bytes = 0usize;
    let t = Instant::now();
    for (i, chunk) in envelopes.chunks(per_push).enumerate() {
        bytes += chunk
            .iter()
            .map(|e| e.ciphertext.len() + 120)
            .sum::<usize>();
        let body = KeeperBody::Push {
            did_log_json: if i == 0 {
                serde_json::to_vec(&log).unwrap()
            } else {
                Vec::new()
            },
            envelopes: chunk.to_vec(),
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
