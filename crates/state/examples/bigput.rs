fn main() {
    for n in [10_000usize, 50_000, 100_000, 200_000] {
        let v =
            serde_json::Value::Array((0..n).map(|i| serde_json::json!(i as f64 * 0.5)).collect());
        let mut c = nuwa_state::Container::new(&[1; 16]);
        let t = std::time::Instant::now();
        let ch = c.put("k", &v).unwrap().unwrap();
        let put = t.elapsed();
        let t = std::time::Instant::now();
        let s = serde_json::to_vec(&v).unwrap();
        let _: serde_json::Value = serde_json::from_slice(&s).unwrap();
        println!(
            "n={n} put={put:?} change={} bytes json={} bytes parse={:?}",
            ch.len(),
            s.len(),
            t.elapsed()
        );
    }
}
