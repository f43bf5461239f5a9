//! An in-memory [`Storage`] with the same contract as [`crate::SledStore`], for simulations
//! and tests. Nothing survives the process and nothing is encrypted.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::{Mutex, MutexGuard, PoisonError};

use crate::{
    ContainerRecord, Storage, StoreError, check_changes, check_container_name, check_meta,
    check_snapshot_seq, check_snapshot_size,
};

/// In-memory storage backed by `BTreeMap`s.
#[derive(Default)]
pub struct MemStore {
    inner: Mutex<Inner>,
}

#[derive(Default)]
struct Inner {
    containers: BTreeMap<String, Container>,
    meta: BTreeMap<String, Vec<u8>>,
    /// Containers moved aside, kept.
    quarantine: Vec<(String, Container)>,
}

#[derive(Default)]
struct Container {
    snapshot: Option<Vec<u8>>,
    covers: u64,
    /// Changes after the snapshot, by sequence number.
    log: BTreeMap<u64, Vec<u8>>,
    last_seq: u64,
}

impl MemStore {
    /// An empty store.
    #[must_use]
    pub fn new() -> Self {
        Self::default()
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // No code below panics while holding the lock, so a poisoned lock still guards
        // consistent data; recover it rather than spreading the panic.
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl fmt::Debug for MemStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let inner = self.lock();
        f.debug_struct("MemStore")
            .field("containers", &inner.containers.len())
            .field("meta", &inner.meta.len())
            .finish()
    }
}

impl Storage for MemStore {
    fn append_changes(&self, container: &str, changes: &[Vec<u8>]) -> Result<u64, StoreError> {
        check_changes(container, changes)?;
        let mut inner = self.lock();
        if changes.is_empty() {
            return Ok(inner.containers.get(container).map_or(0, |c| c.last_seq));
        }
        let entry = inner.containers.entry(container.to_owned()).or_default();
        for change in changes {
            entry.last_seq += 1;
            entry.log.insert(entry.last_seq, change.clone());
        }
        Ok(entry.last_seq)
    }

    fn save_snapshot(
        &self,
        container: &str,
        snapshot: &[u8],
        covers_changes: u64,
    ) -> Result<(), StoreError> {
        check_snapshot_size(container, snapshot)?;
        let mut inner = self.lock();
        let (current, last_seq) = inner
            .containers
            .get(container)
            .map_or((0, 0), |c| (c.covers, c.last_seq));
        check_snapshot_seq(container, covers_changes, current, last_seq)?;
        let entry = inner.containers.entry(container.to_owned()).or_default();
        entry.snapshot = Some(snapshot.to_vec());
        entry.covers = covers_changes;
        entry.log = entry.log.split_off(&covers_changes.saturating_add(1));
        Ok(())
    }

    fn load_container(&self, container: &str) -> Result<Option<ContainerRecord>, StoreError> {
        check_container_name(container)?;
        let inner = self.lock();
        Ok(inner.containers.get(container).map(|c| ContainerRecord {
            snapshot: c.snapshot.clone(),
            snapshot_covers: c.covers,
            changes: c.log.values().cloned().collect(),
            last_seq: c.last_seq,
        }))
    }

    fn list_containers(&self) -> Result<Vec<String>, StoreError> {
        Ok(self.lock().containers.keys().cloned().collect())
    }

    fn put_meta(&self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        check_meta(key, Some(value))?;
        self.lock().meta.insert(key.to_owned(), value.to_vec());
        Ok(())
    }

    fn get_meta(&self, key: &str) -> Result<Option<Vec<u8>>, StoreError> {
        check_meta(key, None)?;
        Ok(self.lock().meta.get(key).cloned())
    }

    fn quarantine_container(&self, container: &str) -> Result<u64, StoreError> {
        check_container_name(container)?;
        let mut inner = self.lock();
        let Some(c) = inner.containers.remove(container) else {
            return Ok(0);
        };
        let records = 1 + u64::from(c.snapshot.is_some()) + c.log.len() as u64;
        inner.quarantine.push((container.to_owned(), c));
        Ok(records)
    }

    fn flush(&self) -> Result<(), StoreError> {
        Ok(())
    }
}
