//! What a catch-up costs on the thread that runs it, by document size:
//! cloning a document (the base an off-loop catch-up starts from), saving
//! it (what a peer sends a device that has nothing), and loading that into
//! an empty document (what the device then runs).
//!
//!   cargo run --release -p nuwa-state --example catchup_cost [ENTRIES,...]

use std::time::Instant;

use nuwa_state::Container;
use serde_json::json;

fn ms(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e3
}

fn main() {
    let sizes: Vec<usize> = std::env::args()
        .nth(1)
        .map(|a| a.split(',').filter_map(|s| s.parse().ok()).collect())
        .unwrap_or_else(|| vec![1_000, 10_000, 100_000]);
    for n in sizes {
        let mut writer = Container::new(&[1; 32]);
        // One change per entry, as a log written entry by entry has.
        for i in 0..n {
            writer.put(&format!("k{i:07}"), &json!(i)).unwrap();
        }
        let t = Instant::now();
        let copy = writer.fork();
        let clone_ms = ms(t);
        drop(copy);
        let t = Instant::now();
        let saved = writer.save();
        let save_ms = ms(t);
        let t = Instant::now();
        let loaded = Container::load(&[2; 32], Some(&saved), []).unwrap();
        let load_ms = ms(t);
        assert_eq!(loaded.change_count(), n);
        println!(
            "{n:>8} entries, {:>9} B saved: clone {clone_ms:>8.1} ms, save {save_ms:>8.1} ms, load {load_ms:>8.1} ms",
            saved.len()
        );
    }
}
