//! How the cost of applying one small remote change grows with the size of
//! the document (Automerge 1.0's columnar op set).
//!
//!   cargo run --release -p nuwa-state --example apply_cost

use std::time::Instant;

use nuwa_state::Container;
use serde_json::json;

fn main() {
    for n in [1_000usize, 10_000, 40_000, 100_000] {
        let mut writer = Container::new(&[1; 32]);
        let mut changes = Vec::new();
        for i in 0..n {
            changes.push(writer.put(&format!("k{i}"), &json!(i)).unwrap().unwrap());
        }
        let mut reader = Container::new(&[2; 32]);
        reader.apply_changes(changes).unwrap();
        let rounds = 200;
        let mut tail = Vec::new();
        for i in 0..rounds {
            tail.push(writer.put(&format!("new{i}"), &json!(i)).unwrap().unwrap());
        }
        let t = Instant::now();
        for c in tail.clone() {
            reader.apply_changes(vec![c]).unwrap();
        }
        let one = t.elapsed().as_secs_f64() * 1e6 / rounds as f64;
        let mut reader2 = Container::new(&[3; 32]);
        let mut all = Vec::new();
        let w2 = Container::load(&[4; 32], Some(&writer.save()), []).unwrap();
        drop(w2);
        all.extend(writer.changes_since(&[]));
        let (base, tail2) = all.split_at(all.len() - rounds);
        reader2.apply_changes(base.to_vec()).unwrap();
        let t = Instant::now();
        reader2.apply_changes(tail2.to_vec()).unwrap();
        let batched = t.elapsed().as_secs_f64() * 1e6 / rounds as f64;
        let t = Instant::now();
        for i in 0..rounds {
            writer.put(&format!("local{i}"), &json!(i)).unwrap();
        }
        let local = t.elapsed().as_secs_f64() * 1e6 / rounds as f64;
        println!(
            "{n:>7} keys: apply one change {one:>8.1} µs; in one batch of {rounds} {batched:>6.1} µs each; local put {local:>6.1} µs"
        );
    }
}
