//! Helpers shared by the store tests: a seeded RNG and seed selection.

#![allow(dead_code)]

/// A seeded generator (fastrand), so a failing seed replays exactly.
pub struct Rng(fastrand::Rng);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(fastrand::Rng::with_seed(seed))
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0.u64(..)
    }

    /// Uniform in `0..n` (`n > 0`).
    pub fn below(&mut self, n: u64) -> u64 {
        self.0.u64(..n)
    }

    pub fn index(&mut self, len: usize) -> usize {
        self.below(len as u64) as usize
    }

    pub fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }

    /// Random bytes of a random length in `0..max`.
    pub fn bytes_below(&mut self, max: usize) -> Vec<u8> {
        let len = self.index(max);
        self.bytes(len)
    }

    pub fn bytes(&mut self, len: usize) -> Vec<u8> {
        (0..len).map(|_| self.next_u64() as u8).collect()
    }
}

/// The seeds to run: just `SEED` when it is set (to replay a failure), else `0..count`.
pub fn seeds(count: u64) -> Vec<u64> {
    match std::env::var("SEED") {
        Ok(seed) => vec![seed.parse().expect("SEED must be a u64")],
        Err(_) => (0..count).collect(),
    }
}
