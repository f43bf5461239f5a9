//! The same question on bare Automerge: one `apply_changes` call per
//! change, against `load_incremental`, as the document grows.
//!
//!   cargo run --release -p nuwa-state --example apply_raw

use std::time::Instant;

use automerge::transaction::Transactable as _;
use automerge::{ActorId, Automerge, ROOT};

fn main() {
    for n in [1_000usize, 10_000, 100_000] {
        let mut w = Automerge::new().with_actor(ActorId::from(&[1u8; 32][..]));
        for i in 0..n {
            w.transact(|tx| tx.put(ROOT, format!("k{i}"), i as i64).map(|_| ()))
                .unwrap();
        }
        let mut r = Automerge::load(&w.save()).unwrap();
        let mut r2 = r.clone();
        let before = w.get_heads();
        let rounds = 100;
        for i in 0..rounds {
            w.transact(|tx| tx.put(ROOT, format!("n{i}"), i as i64).map(|_| ()))
                .unwrap();
        }
        let changes: Vec<automerge::Change> = w.get_changes(&before);
        let t = Instant::now();
        for c in changes.clone() {
            r.apply_changes(vec![c]).unwrap();
        }
        let each = t.elapsed().as_secs_f64() * 1e6 / rounds as f64;
        let t = Instant::now();
        for c in &changes {
            r2.load_incremental(c.raw_bytes()).unwrap();
        }
        let incr = t.elapsed().as_secs_f64() * 1e6 / rounds as f64;
        println!(
            "{n:>7} keys: apply_changes {each:>8.1} µs/change; load_incremental {incr:>8.1} µs/change"
        );
    }
}
