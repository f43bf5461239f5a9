//! The in-process baselines the daemon figures are compared against: the
//! local Automerge append rate (with the raw size of each change), and
//! decrypting and loading a daemon's stored containers from a copy of its
//! store.
//!
//! No processes and no network here.

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use automerge::transaction::Transactable;
use automerge::{ActorId, Automerge, ROOT, ScalarValue};
use nuwa_crypto::AtRestKey;
use nuwa_state::Container;
use nuwa_store::{SledStore, Storage};

/// Actor id length of the daemon (`nuwa_sync::RUN_ACTOR_BYTES`: 8 bytes of
/// the device key and 8 random ones per run; 32, the whole key, before issue
/// 24). The actor id is inside every change, so it must match for sizes to
/// compare.
const ACTOR_BYTES: usize = 16;

/// The in-process append of `writes` one-key transactions.
#[derive(Debug, Clone, Copy)]
pub struct Append {
    pub rate_per_sec: f64,
    /// Mean length of one change in Automerge's binary change format.
    pub raw_change_bytes: f64,
}

/// Commits `writes` transactions that each put one key (`k{i}` = `i`, the
/// same puts the benchmark sends to the daemon) to one in-process document.
pub fn append(writes: usize) -> Result<Append> {
    if writes == 0 {
        bail!("append needs at least one write");
    }
    let mut doc = Automerge::new().with_actor(ActorId::from(&[7u8; ACTOR_BYTES][..]));
    let start = Instant::now();
    for i in 0..writes {
        doc.transact(|tx| {
            tx.put(ROOT, format!("k{i}"), ScalarValue::Int(i as i64))
                .map(|_| ())
        })
        .map_err(|f| anyhow::anyhow!("automerge refused put {i}: {}", f.error))?;
    }
    let elapsed = start.elapsed();
    // Sizes are read after the timed loop: the rate is Automerge's alone.
    let changes = doc.get_changes(&[]);
    let total: usize = changes.iter().map(|c| c.raw_bytes().len()).sum();
    Ok(Append {
        rate_per_sec: writes as f64 / elapsed.as_secs_f64(),
        raw_change_bytes: total as f64 / changes.len().max(1) as f64,
    })
}

/// What [`load_store`] found.
#[derive(Debug, Clone, Copy)]
pub struct Loaded {
    pub elapsed: Duration,
    pub changes: usize,
}

/// Opens the sled store in `store_dir` with the at-rest key in
/// `at_rest_key_file` and loads every container the way the daemon does at
/// start: decrypt the snapshot and the change log, then build the document.
/// Times all of it.
pub fn load_store(store_dir: &Path, at_rest_key_file: &Path) -> Result<Loaded> {
    let key_bytes = std::fs::read(at_rest_key_file)
        .with_context(|| format!("cannot read {}", at_rest_key_file.display()))?;
    let start = Instant::now();
    let key = AtRestKey::from_file_bytes(&key_bytes)
        .with_context(|| format!("cannot parse {}", at_rest_key_file.display()))?;
    let store = SledStore::open(store_dir, key)
        .with_context(|| format!("cannot open the store copy in {}", store_dir.display()))?;
    let actor = [7u8; ACTOR_BYTES];
    let mut changes = 0;
    for name in store.list_containers()? {
        let Some(rec) = store.load_container(&name)? else {
            continue;
        };
        if rec
            .snapshot
            .as_deref()
            .is_some_and(|s| s.starts_with(b"NZ1"))
        {
            // Only typed containers with x-compression are stored
            // compressed; the benchmark writes untyped maps only.
            bail!("container {name:?} has a compressed snapshot, which nuwa-bench does not read");
        }
        let c = Container::load(&actor, rec.snapshot.as_deref(), rec.changes)
            .with_context(|| format!("cannot load container {name:?}"))?;
        changes += c.change_count();
    }
    let elapsed = start.elapsed();
    Ok(Loaded { elapsed, changes })
}

/// Copies the directory tree `from` to `to` (regular files and
/// directories only).
pub fn copy_dir(from: &Path, to: &Path) -> Result<()> {
    std::fs::create_dir_all(to).with_context(|| format!("cannot create {}", to.display()))?;
    for entry in
        std::fs::read_dir(from).with_context(|| format!("cannot read {}", from.display()))?
    {
        let entry = entry?;
        let target = to.join(entry.file_name());
        let kind = entry.file_type()?;
        if kind.is_dir() {
            copy_dir(&entry.path(), &target)?;
        } else if kind.is_file() {
            std::fs::copy(entry.path(), &target)
                .with_context(|| format!("cannot copy {}", entry.path().display()))?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    // Goal: the in-process append commits one change per write and reports a
    // plausible change size; method: a small run, checked against the doc.
    #[test]
    fn append_counts_every_write() {
        let a = append(50).unwrap();
        assert!(a.rate_per_sec > 0.0);
        // A one-key change with a 32-byte actor is tens of bytes, not kilobytes.
        assert!(
            (40.0..400.0).contains(&a.raw_change_bytes),
            "{}",
            a.raw_change_bytes
        );
    }
}
