//! A bounded memory of request nonces, so a signed request is accepted once.
//!
//! Entries are keyed by (`keyid`, `nonce`) and kept until their signature's
//! `expires`; after that the signature itself is refused as stale, so the
//! entry is no longer needed. The cache never grows past its capacity: when
//! it is full of unexpired entries it refuses new requests
//! ([`CapError::NonceCacheFull`]) rather than forget one that could then be
//! replayed.
//!
//! The cache keeps a floor, the latest `now` it has been given, and refuses
//! any signature expiring at or before it. So if the caller's clock steps
//! back, a nonce the cache already forgot still cannot be replayed.
//!
//! Only requests whose signature and capability verified reach the cache
//! (see [`crate::verify_invocation`]), so only holders of a valid
//! capability can fill it. Keys are SHA-256 of the pair, 32 bytes each
//! whatever the input.

use std::collections::{BTreeMap, BTreeSet};

use sha2::{Digest, Sha256};

use crate::error::CapError;
use crate::limits::NONCE_CACHE_CAPACITY;

type Key = [u8; 32];

/// The nonces of recently accepted requests. Not persisted: after a restart
/// a request signed before it could be replayed until it expires (at most
/// ten minutes); callers that care keep the daemon down that long.
#[derive(Debug)]
pub struct NonceCache {
    capacity: usize,
    expiry_by_key: BTreeMap<Key, i64>,
    by_expiry: BTreeSet<(i64, Key)>,
    floor_unix_secs: i64,
}

impl Default for NonceCache {
    fn default() -> Self {
        NonceCache::new()
    }
}

impl NonceCache {
    /// A cache of [`NONCE_CACHE_CAPACITY`] entries.
    pub fn new() -> NonceCache {
        NonceCache::with_capacity(NONCE_CACHE_CAPACITY)
    }

    /// A cache of `capacity` entries (at least one).
    pub fn with_capacity(capacity: usize) -> NonceCache {
        NonceCache {
            capacity: capacity.max(1),
            expiry_by_key: BTreeMap::new(),
            by_expiry: BTreeSet::new(),
            floor_unix_secs: i64::MIN,
        }
    }

    /// How many nonces are remembered (expired ones included until the next
    /// call that prunes).
    pub fn len(&self) -> usize {
        self.expiry_by_key.len()
    }

    /// Whether no nonce is remembered.
    pub fn is_empty(&self) -> bool {
        self.expiry_by_key.is_empty()
    }

    /// The most entries held at once.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Records (`keyid`, `nonce`) until `expires_unix_secs`, or refuses it
    /// as replayed, stale (expiring at or before the floor) or because the
    /// cache is full.
    pub(crate) fn remember(
        &mut self,
        keyid: &str,
        nonce: &str,
        created_unix_secs: i64,
        expires_unix_secs: i64,
        now_unix_secs: i64,
    ) -> Result<(), CapError> {
        self.floor_unix_secs = self.floor_unix_secs.max(now_unix_secs);
        self.prune();
        if expires_unix_secs <= self.floor_unix_secs {
            return Err(CapError::StaleSignature {
                created: created_unix_secs,
                expires: expires_unix_secs,
                now: now_unix_secs,
                reason: "it expired before a later time this daemon has already seen",
            });
        }
        let key = key_of(keyid, nonce);
        if self.expiry_by_key.contains_key(&key) {
            return Err(CapError::Replayed {
                keyid: keyid.to_owned(),
                nonce: nonce.to_owned(),
            });
        }
        if self.expiry_by_key.len() >= self.capacity {
            return Err(CapError::NonceCacheFull {
                capacity: self.capacity,
            });
        }
        self.expiry_by_key.insert(key, expires_unix_secs);
        self.by_expiry.insert((expires_unix_secs, key));
        Ok(())
    }

    /// Forgets every entry expiring at or before the floor.
    fn prune(&mut self) {
        while let Some(&(expires, key)) = self.by_expiry.first() {
            if expires > self.floor_unix_secs {
                break;
            }
            self.by_expiry.pop_first();
            self.expiry_by_key.remove(&key);
        }
    }
}

/// SHA-256 of the length-prefixed `keyid` and the `nonce`, so that no two
/// pairs share a key by moving characters between them.
fn key_of(keyid: &str, nonce: &str) -> Key {
    let mut hasher = Sha256::new();
    hasher.update((keyid.len() as u64).to_be_bytes());
    hasher.update(keyid.as_bytes());
    hasher.update(nonce.as_bytes());
    hasher.finalize().into()
}

#[cfg(test)]
mod tests {
    use super::*;

    // Goal: a nonce is refused while remembered, forgotten after expiry (then refused as stale), and per key.
    #[test]
    fn remembers_until_expiry() {
        let mut cache = NonceCache::with_capacity(8);
        cache.remember("k1", "n", 100, 160, 100).expect("fresh");
        let again = cache
            .remember("k1", "n", 100, 160, 150)
            .expect_err("replay");
        assert_eq!(again.code(), "replayed_nonce");
        cache
            .remember("k2", "n", 100, 160, 150)
            .expect("another key");
        // Past expiry the entry goes, and the old signature is stale.
        let stale = cache
            .remember("k1", "n", 100, 160, 160)
            .expect_err("expired");
        assert_eq!(stale.code(), "stale_signature");
        assert_eq!(cache.len(), 0);
        // The clock stepping back does not reopen the forgotten nonce.
        let stale = cache.remember("k1", "n", 100, 160, 120).expect_err("floor");
        assert_eq!(stale.code(), "stale_signature");
    }

    // Goal: a full cache refuses new nonces without growing, and accepts again once entries expire.
    #[test]
    fn full_cache_refuses_and_recovers() {
        let mut cache = NonceCache::with_capacity(3);
        for (i, expires) in [110, 120, 130].into_iter().enumerate() {
            cache
                .remember("k", &format!("n{i}"), 100, expires, 100)
                .expect("room");
        }
        let full = cache.remember("k", "n3", 100, 140, 100).expect_err("full");
        assert_eq!(full.code(), "nonce_cache_full");
        assert_eq!(cache.len(), 3);
        // At 110 the first entry expires and makes room.
        cache
            .remember("k", "n3", 100, 140, 110)
            .expect("room again");
        assert_eq!(cache.len(), 3);
    }

    // Goal: moving characters between keyid and nonce gives a different entry.
    #[test]
    fn pairs_do_not_collide() {
        let mut cache = NonceCache::with_capacity(4);
        cache.remember("ab", "c", 0, 10, 0).expect("fresh");
        cache
            .remember("a", "bc", 0, 10, 0)
            .expect("a different pair");
    }
}
