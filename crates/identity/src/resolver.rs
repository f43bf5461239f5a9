//! Resolving an agent DID to its current document: local cache, then peers,
//! then pluggable resolvers (decision 2 of the brief).
//!
//! Every source hands back a [`DidChain`], which is self-certifying: whatever
//! a source says is verified here, and a source can only *extend* what the
//! sources before it established, or replace it with a branch that wins
//! the fork rule ([`crate::log::fork_order`]). A source whose log does not
//! verify or is for another DID is skipped and reported, never trusted.
//! The first source that yields a verified log fixes the genesis; later
//! sources may add updates on top of it.
//!
//! Sources here are synchronous and do no IO of their own choosing; a
//! network-backed resolver (a chain-anchored DID method, say) implements
//! [`DidResolver`] over its own client.

use crate::chain::{ChainError, DidChain};

/// One place a DID log can come from.
pub trait DidResolver: Send + Sync {
    /// A short name for reports ("local cache", "peers", ...).
    fn name(&self) -> &str;
    /// The newest log this source holds for `did`, unverified; `Ok(None)`
    /// when it knows nothing about it.
    fn fetch(&self, did: &str) -> Result<Option<DidChain>, ResolveError>;
}

/// Why resolution failed, or why a source was skipped.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ResolveError {
    /// The source could not be asked (IO, network, ...).
    #[error("resolver {source_name} failed: {reason}")]
    Source { source_name: String, reason: String },
    /// The source answered with a log that does not verify or fork ours.
    #[error("resolver {source_name} returned an unusable log: {error}")]
    BadLog {
        source_name: String,
        #[source]
        error: Box<ChainError>,
    },
    /// No source knew the DID (or, when some answered unusably, the first
    /// such refusal is returned instead).
    #[error("no resolver knows {did}")]
    NotFound { did: String },
}

/// The result of a resolution.
#[derive(Debug)]
pub struct Resolution {
    /// The longest verified log over all sources.
    pub log: DidChain,
    /// Names of the sources that contributed (fixed the genesis or extended).
    pub contributed: Vec<String>,
    /// Sources that were skipped, and why.
    pub skipped: Vec<ResolveError>,
}

/// Asks each source in order and keeps the longest verified chain.
#[derive(Default)]
pub struct ChainResolver {
    sources: Vec<Box<dyn DidResolver>>,
}

impl ChainResolver {
    pub fn new() -> Self {
        Self::default()
    }

    /// Appends a source; sources are asked in the order added.
    #[must_use]
    pub fn with(mut self, source: Box<dyn DidResolver>) -> Self {
        self.sources.push(source);
        self
    }

    pub fn resolve(&self, did: &str, now_unix_secs: i64) -> Result<Resolution, ResolveError> {
        let mut best: Option<DidChain> = None;
        let mut contributed = Vec::new();
        let mut skipped = Vec::new();
        for source in &self.sources {
            let name = source.name().to_owned();
            let log = match source.fetch(did) {
                Ok(Some(log)) => log,
                Ok(None) => continue,
                Err(e) => {
                    skipped.push(e);
                    continue;
                }
            };
            let bad = |error| ResolveError::BadLog {
                source_name: name.clone(),
                error: Box::new(error),
            };
            match &mut best {
                None => match log.verify(Some(did), now_unix_secs) {
                    Ok(()) => {
                        best = Some(log);
                        contributed.push(name);
                    }
                    Err(e) => skipped.push(bad(e)),
                },
                Some(ours) => match ours.merge(&log, now_unix_secs) {
                    Ok(o) if o.changed() => contributed.push(name),
                    Ok(_) => {}
                    Err(e) => skipped.push(bad(e)),
                },
            }
        }
        match best {
            Some(log) => Ok(Resolution {
                log,
                contributed,
                skipped,
            }),
            // Nothing usable: the first refusal says most about why.
            None => Err(skipped
                .into_iter()
                .next()
                .unwrap_or_else(|| ResolveError::NotFound {
                    did: did.to_owned(),
                })),
        }
    }
}

/// A fixed log: the local cache (the home's `did-log.json`), a log a peer
/// sent, or a test.
pub struct StaticLog {
    name: String,
    log: Option<DidChain>,
}

impl StaticLog {
    pub fn new(name: &str, log: Option<DidChain>) -> Self {
        StaticLog {
            name: name.to_owned(),
            log,
        }
    }
}

impl DidResolver for StaticLog {
    fn name(&self) -> &str {
        &self.name
    }

    fn fetch(&self, did: &str) -> Result<Option<DidChain>, ResolveError> {
        Ok(self.log.as_ref().filter(|l| l.did() == did).cloned())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::keys::DeviceKey;

    fn extend(log: &DidChain, master: &DeviceKey, n: usize) -> DidChain {
        let mut out = log.clone();
        let key_id = out.documents().next().unwrap().capability_delegation[0].clone();
        for _ in 0..n {
            let d = DeviceKey::generate().unwrap();
            let mut doc = out.current().clone();
            let ctx = crate::keys::context_id_for(&d.public());
            doc.add_key(
                &ctx,
                &d.public(),
                &[crate::document::Relationship::Authentication],
                None,
            )
            .unwrap();
            out.append_document(&doc, master, &key_id, 1_000).unwrap();
        }
        out
    }

    struct Failing;
    impl DidResolver for Failing {
        fn name(&self) -> &str {
            "failing"
        }
        fn fetch(&self, _: &str) -> Result<Option<DidChain>, ResolveError> {
            Err(ResolveError::Source {
                source_name: "failing".into(),
                reason: "offline".into(),
            })
        }
    }

    // Goal: local cache, then peers, then a pluggable source: the longest
    // verified chain wins; a fork is settled by the fork rule; a foreign
    // DID and a failing source are skipped with a reason, never adopted.
    #[test]
    fn chain_keeps_the_longest_verified_log() {
        let master = DeviceKey::generate().unwrap();
        let genesis = DidChain::genesis(&master, 1_000).unwrap();
        let did = genesis.did().to_owned();
        let local = extend(&genesis, &master, 1);
        let newer = extend(&local, &master, 2);
        let fork = extend(&genesis, &master, 3);
        let stranger = DidChain::genesis(&DeviceKey::generate().unwrap(), 1_000).unwrap();

        let peers = || Box::new(StaticLog::new("peers", Some(newer.clone())));

        let r = ChainResolver::new()
            .with(Box::new(StaticLog::new("local cache", Some(local.clone()))))
            .with(Box::new(StaticLog::new("stranger", Some(stranger))))
            .with(peers())
            .with(Box::new(Failing))
            .with(Box::new(StaticLog::new("forked", Some(fork.clone()))))
            .resolve(&did, 1_000)
            .unwrap();
        // The forked source is judged by the fork rule, from either side.
        if crate::chain::compare_branches(&fork, &newer).unwrap() == std::cmp::Ordering::Greater {
            assert_eq!(r.log, fork);
            assert_eq!(r.contributed, vec!["local cache", "peers", "forked"]);
        } else {
            assert_eq!(r.log, newer);
            assert_eq!(r.contributed, vec!["local cache", "peers"]);
        }
        assert_eq!(r.skipped.len(), 1, "{:?}", r.skipped);
        assert!(r.skipped.iter().any(|e| e.to_string().contains("offline")));

        // Without a local cache the first verified source fixes the genesis.
        let r = ChainResolver::new()
            .with(Box::new(StaticLog::new("local cache", None)))
            .with(peers())
            .resolve(&did, 1_000)
            .unwrap();
        assert_eq!(r.log.len(), newer.len());

        // A tampered log never counts.
        let mut json: serde_json::Value = serde_json::to_value(&newer).unwrap();
        json["entries"][1]["timestamp"] = serde_json::json!(1_001);
        let tampered: DidChain = serde_json::from_value(json).unwrap();
        let err = ChainResolver::new()
            .with(Box::new(StaticLog::new("tampered", Some(tampered))))
            .resolve(&did, 1_000)
            .unwrap_err();
        assert!(matches!(err, ResolveError::BadLog { .. }), "{err}");
        assert!(err.to_string().contains("tampered"), "{err}");
        let err = ChainResolver::new().resolve(&did, 1_000).unwrap_err();
        assert!(matches!(err, ResolveError::NotFound { .. }));
    }
}
