//! Fingerprints for anti-entropy over many containers.
//!
//! Each container contributes one item hash, SHA-256 over its name and its
//! sorted heads. A range of container names (lower inclusive, upper
//! exclusive) has the fingerprint of the XOR of its item hashes and their
//! count, so a set of any size is summarised in 16 bytes and a fingerprint
//! is updated in O(1) when one container's heads move.
//!
//! Reconciliation follows range-based set reconciliation (as in negentropy):
//! a range whose fingerprints differ is split into [`SPLIT`] parts by the
//! responder's own names, and a range holding at most [`ITEMS_BELOW`] of the
//! responder's containers is answered with the containers themselves. Each
//! reply narrows the ranges, so the exchange ends after about
//! log<sub>16</sub>(n) round trips, with only the differing containers
//! named.

use std::collections::BTreeMap;
use std::ops::Bound;

use nuwa_proto::{ContainerHeads, RangeBody, RangePart};
use nuwa_state::Hash;
use sha2::{Digest as _, Sha256};

/// Parts a differing range is split into.
pub const SPLIT: usize = 16;
/// A range holding at most this many of the responder's containers is
/// answered with the containers (name and heads) instead of a split.
pub const ITEMS_BELOW: usize = 16;
/// Most parts one reply carries; the rest is left to the next round.
pub const MAX_REPLY_PARTS: usize = 256;

/// A 16-byte fingerprint of a set of (container, heads) pairs.
pub type Fingerprint = [u8; 16];

/// The item hash of one container.
pub fn item_hash(name: &str, heads: &[Hash]) -> [u8; 32] {
    let mut sorted: Vec<&Hash> = heads.iter().collect();
    sorted.sort();
    let mut h = Sha256::new();
    h.update(b"nuwa-anti-entropy-v1");
    h.update((name.len() as u64).to_le_bytes());
    h.update(name.as_bytes());
    for head in sorted {
        h.update(head);
    }
    h.finalize().into()
}

fn finish(acc: &[u8; 32], count: usize) -> Fingerprint {
    let mut h = Sha256::new();
    h.update(acc);
    h.update((count as u64).to_le_bytes());
    let full: [u8; 32] = h.finalize().into();
    let mut out = [0; 16];
    out.copy_from_slice(&full[..16]);
    out
}

fn xor(acc: &mut [u8; 32], item: &[u8; 32]) {
    for (a, b) in acc.iter_mut().zip(item) {
        *a ^= b;
    }
}

/// The item hashes of one node's containers, by name.
#[derive(Default, Debug, Clone)]
pub struct FingerprintSet {
    items: BTreeMap<String, [u8; 32]>,
    all: [u8; 32],
}

impl FingerprintSet {
    pub fn len(&self) -> usize {
        self.items.len()
    }

    pub fn is_empty(&self) -> bool {
        self.items.is_empty()
    }

    /// Sets (or replaces) the item of `name`.
    pub fn set(&mut self, name: &str, item: [u8; 32]) {
        match self.items.get_mut(name) {
            Some(old) => {
                xor(&mut self.all, old);
                *old = item;
            }
            None => {
                self.items.insert(name.to_owned(), item);
            }
        }
        xor(&mut self.all, &item);
    }

    pub fn remove(&mut self, name: &str) {
        if let Some(old) = self.items.remove(name) {
            xor(&mut self.all, &old);
        }
    }

    /// The fingerprint of the whole set and its size.
    pub fn digest(&self) -> (Fingerprint, u32) {
        (finish(&self.all, self.items.len()), self.items.len() as u32)
    }

    fn range<'a>(
        &'a self,
        lower: &'a str,
        upper: Option<&'a str>,
    ) -> impl Iterator<Item = (&'a String, &'a [u8; 32])> + 'a {
        let hi = match upper {
            Some(u) => Bound::Excluded(u),
            None => Bound::Unbounded,
        };
        self.items.range::<str, _>((Bound::Included(lower), hi))
    }

    /// The fingerprint of the items in `[lower, upper)` and their count.
    pub fn range_fingerprint(&self, lower: &str, upper: Option<&str>) -> (Fingerprint, u32) {
        if lower.is_empty() && upper.is_none() {
            return self.digest();
        }
        let mut acc = [0; 32];
        let mut n = 0;
        for (_, item) in self.range(lower, upper) {
            xor(&mut acc, item);
            n += 1;
        }
        (finish(&acc, n), n as u32)
    }

    /// The names in `[lower, upper)`.
    pub fn names_in<'a>(
        &'a self,
        lower: &'a str,
        upper: Option<&'a str>,
    ) -> impl Iterator<Item = &'a String> + 'a {
        self.range(lower, upper).map(|(name, _)| name)
    }

    /// What this side answers for a range whose fingerprints differ: its
    /// containers, when it holds few there, else the range split into
    /// [`SPLIT`] parts of about equal size with a fingerprint each. `heads`
    /// gives a container's heads.
    pub fn answer(
        &self,
        lower: &str,
        upper: Option<&str>,
        heads: impl Fn(&str) -> (Vec<Hash>, u64),
    ) -> Vec<RangePart> {
        let names: Vec<&String> = self.names_in(lower, upper).collect();
        if names.len() <= ITEMS_BELOW {
            let items = names
                .iter()
                .map(|n| {
                    let (heads, changes) = heads(n);
                    ContainerHeads {
                        container: (*n).clone(),
                        heads,
                        changes,
                    }
                })
                .collect();
            return vec![RangePart {
                lower: lower.to_owned(),
                upper: upper.map(str::to_owned),
                body: RangeBody::Items(items),
            }];
        }
        // Boundaries at our own names: part i starts at names[i * step].
        let step = names.len().div_ceil(SPLIT);
        let mut bounds: Vec<&str> = vec![lower];
        bounds.extend(names.iter().skip(step).step_by(step).map(|n| n.as_str()));
        let mut parts = Vec::with_capacity(bounds.len());
        for (i, lo) in bounds.iter().enumerate() {
            let hi = bounds.get(i + 1).copied().or(upper);
            let (fingerprint, count) = self.range_fingerprint(lo, hi);
            parts.push(RangePart {
                lower: (*lo).to_owned(),
                upper: hi.map(str::to_owned),
                body: RangeBody::Fingerprint { fingerprint, count },
            });
        }
        parts
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set_of(items: &[(&str, u8)]) -> FingerprintSet {
        let mut s = FingerprintSet::default();
        for (name, v) in items {
            s.set(name, item_hash(name, &[[*v; 32]]));
        }
        s
    }

    // Goal: the digest depends on exactly the set: order of insertion and
    // replaced values do not matter, any difference in names or heads does.
    #[test]
    fn digest_is_a_function_of_the_set() {
        let a = set_of(&[("a", 1), ("b", 2), ("c", 3)]);
        let mut b = set_of(&[("c", 3), ("a", 9), ("b", 2)]);
        assert_ne!(a.digest(), b.digest());
        b.set("a", item_hash("a", &[[1; 32]]));
        assert_eq!(a.digest(), b.digest());
        b.remove("c");
        assert_ne!(a.digest(), b.digest());
        assert_eq!(b.digest(), set_of(&[("b", 2), ("a", 1)]).digest());
        assert_ne!(
            FingerprintSet::default().digest(),
            set_of(&[("a", 0)]).digest()
        );
        // Heads order is irrelevant to the item hash.
        assert_eq!(
            item_hash("x", &[[1; 32], [2; 32]]),
            item_hash("x", &[[2; 32], [1; 32]])
        );
        assert_ne!(item_hash("x", &[[1; 32]]), item_hash("y", &[[1; 32]]));
    }

    /// Plays the protocol between two sets until nothing is left to send and
    /// returns the names either side learnt differ, and the round trips.
    fn reconcile(a: &FingerprintSet, b: &FingerprintSet) -> (Vec<String>, usize) {
        let heads_a = |_: &str| (vec![[0; 32]], 0);
        let heads_b = |_: &str| (vec![[0; 32]], 0);
        if a.digest() == b.digest() {
            return (Vec::new(), 0);
        }
        let mut differ = std::collections::BTreeSet::new();
        let mut msg = b.answer("", None, heads_b);
        let mut sides = [a, b];
        let mut trips = 1;
        while !msg.is_empty() {
            trips += 1;
            assert!(trips < 32, "reconciliation did not end");
            let me = sides[0];
            let mut reply = Vec::new();
            for part in msg {
                let up = part.upper.as_deref();
                match part.body {
                    RangeBody::Fingerprint { fingerprint, count } => {
                        if me.range_fingerprint(&part.lower, up) != (fingerprint, count) {
                            reply.extend(me.answer(
                                &part.lower,
                                up,
                                if trips % 2 == 0 { heads_a } else { heads_b },
                            ));
                        }
                    }
                    RangeBody::Items(items) => {
                        let theirs: std::collections::BTreeSet<&str> =
                            items.iter().map(|c| c.container.as_str()).collect();
                        for name in theirs.iter() {
                            if !me.items.contains_key(*name) {
                                differ.insert(name.to_string());
                            }
                        }
                        for name in me.names_in(&part.lower, up) {
                            if !theirs.contains(name.as_str()) {
                                differ.insert(name.clone());
                            }
                        }
                        // Items carry heads; a differing value shows in the
                        // item hash, which the caller compares per name.
                        for name in theirs {
                            let other = sides[1];
                            if let (Some(x), Some(y)) = (me.items.get(name), other.items.get(name))
                            {
                                if x != y {
                                    differ.insert(name.to_owned());
                                }
                            }
                        }
                    }
                }
            }
            msg = reply;
            sides.swap(0, 1);
        }
        (differ.into_iter().collect(), trips)
    }

    // Goal: with 10,000 containers and one changed, reconciliation names
    // exactly that one, in a handful of round trips with small messages.
    #[test]
    fn one_change_among_ten_thousand_is_found() {
        let mut a = FingerprintSet::default();
        for i in 0..10_000 {
            let name = format!("container-{i:05}");
            a.set(&name, item_hash(&name, &[[1; 32]]));
        }
        let mut b = a.clone();
        b.set("container-04242", item_hash("container-04242", &[[2; 32]]));
        let (differ, trips) = reconcile(&a, &b);
        assert_eq!(differ, vec!["container-04242".to_string()]);
        assert!(trips <= 5, "{trips} round trips");
    }

    // Goal: random pairs of sets (missing on either side, differing heads)
    // always reconcile to exactly their symmetric difference.
    #[test]
    fn random_sets_reconcile_to_their_difference() {
        for seed in 0..200u64 {
            let mut rng = fastrand::Rng::with_seed(seed);
            let n = rng.usize(0..600);
            let (mut a, mut b) = (FingerprintSet::default(), FingerprintSet::default());
            let mut want = std::collections::BTreeSet::new();
            for i in 0..n {
                let name = format!("c{:04}", rng.usize(0..5000) * 10 + i % 10);
                let v = rng.u8(..);
                match rng.u8(0..10) {
                    0 => {
                        a.set(&name, item_hash(&name, &[[v; 32]]));
                        want.insert(name);
                    }
                    1 => {
                        b.set(&name, item_hash(&name, &[[v; 32]]));
                        want.insert(name);
                    }
                    2 => {
                        a.set(&name, item_hash(&name, &[[v; 32]]));
                        b.set(&name, item_hash(&name, &[[v.wrapping_add(1); 32]]));
                        want.insert(name);
                    }
                    _ => {
                        a.set(&name, item_hash(&name, &[[v; 32]]));
                        b.set(&name, item_hash(&name, &[[v; 32]]));
                    }
                }
            }
            // A name drawn twice may have ended up equal on both sides.
            want.retain(|name| a.items.get(name) != b.items.get(name));
            let (differ, _) = reconcile(&a, &b);
            assert_eq!(differ, want.into_iter().collect::<Vec<_>>(), "seed {seed}");
        }
    }
}
