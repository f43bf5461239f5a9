//! Durable, encrypted persistence for nuwa-sync: per-container change logs with compacted
//! snapshots, and a small key/value area for node metadata, behind the object-safe
//! [`Storage`] trait.
//!
//! [`SledStore`] is the real backend; [`MemStore`] keeps the same contract in memory for
//! simulations and tests. Blobs are opaque here: this crate knows nothing of Automerge,
//! protobuf, libp2p or the network, and decides neither when to compact nor what a snapshot
//! contains.
//!
//! This crate is the only one in the workspace that imports sled, so it also holds
//! [`SledKeeperStore`], the keeper's storage behind `nuwa_keeper::KeeperStore` (the keeper
//! decides; this stores).
//!
//! # The contract
//!
//! - Each container has a change log. [`Storage::append_changes`] gives every change the next
//!   sequence number (1, 2, 3, … per container, never reused) and returns the last one.
//! - [`Storage::save_snapshot`] stores a snapshot that covers changes `1..=covers_changes`
//!   and drops exactly those log entries, atomically. Snapshots only move forward.
//! - [`Storage::load_container`] returns the snapshot plus the changes after it, in order.
//! - Every write is durable when it returns `Ok`; a crash at any instant loses nothing that
//!   was acknowledged, because appends and compactions are single atomic commits.
//! - Storage is table-isolated per NIP-8 namespace ([`namespace_of`]): in [`SledStore`] each
//!   namespace has its own trees, and compacting or quarantining a container touches only
//!   its namespace's trees.

mod keeper_store;
mod mem_store;
mod namespace;
mod sled_store;

use std::path::PathBuf;

pub use keeper_store::SledKeeperStore;
pub use mem_store::MemStore;
pub use namespace::{DEFAULT_NAMESPACE, RESERVED_NAMESPACE, namespace_of};
use nuwa_crypto::CryptoError;
pub use sled_store::SledStore;

/// Largest change blob accepted by [`Storage::append_changes`]: 64 MiB.
pub const MAX_CHANGE_BYTES: usize = 64 << 20;
/// Largest total of change bytes in one [`Storage::append_changes`] call: 256 MiB.
pub const MAX_BATCH_BYTES: usize = 256 << 20;
/// Largest snapshot accepted by [`Storage::save_snapshot`]: 256 MiB.
pub const MAX_SNAPSHOT_BYTES: usize = 256 << 20;
/// Longest container name, in UTF-8 bytes: the wire's limit, declared once
/// in `nuwa-proto`.
pub use nuwa_proto::MAX_CONTAINER_NAME_BYTES;
/// Longest metadata key, in UTF-8 bytes.
pub const MAX_META_KEY_BYTES: usize = 256;
/// Largest metadata value: 1 MiB. Metadata is for small node records, not state.
pub const MAX_META_VALUE_BYTES: usize = 1 << 20;
/// Most namespaces ([`namespace_of`]) a [`SledStore`] creates. Each has four sled trees,
/// kept open for the life of the store; NIP-8 expects a handful (core, the daemon's, one per
/// capability, app and user), so a store near this limit is being filled with junk names.
pub const MAX_NAMESPACES: usize = 4096;

/// Persistent storage for container change logs, snapshots and node metadata.
///
/// Implementations are internally synchronised and may be shared across threads
/// (`Arc<dyn Storage>`). Every method that writes is durable when it returns `Ok`.
pub trait Storage: Send + Sync + 'static {
    /// Appends `changes` to the log of `container`, creating the container if needed, as one
    /// group commit with one flush. Returns the sequence number of the last change now in the
    /// log (for an empty batch: the current last one, without creating the container).
    ///
    /// # Errors
    /// A bad name or oversized change is refused before anything is written; storage and
    /// encryption failures are reported as such and nothing of the batch is acknowledged.
    fn append_changes(&self, container: &str, changes: &[Vec<u8>]) -> Result<u64, StoreError>;

    /// [`Storage::append_changes`] for several containers with **one** flush
    /// for all of them, durable on return. Returns each container's last
    /// sequence number, in order. On an error, none of the batches may be
    /// acknowledged (some may be on disk).
    ///
    /// # Errors
    /// As [`Storage::append_changes`]; every name and change is checked
    /// before anything is written.
    /// [`Storage::append_many`], then the `meta` records ([`Storage::put_meta`])
    /// written after the changes and made durable by the same flush. A crash
    /// can lose the records with or without the changes, never keep a
    /// record and lose the changes written before it.
    ///
    /// # Errors
    /// As [`Storage::append_many`] and [`Storage::put_meta`].
    fn append_many_with_meta(
        &self,
        batches: &[(&str, &[Vec<u8>])],
        meta: &[(String, Vec<u8>)],
    ) -> Result<Vec<u64>, StoreError> {
        for (key, value) in meta {
            check_meta(key, Some(value))?;
        }
        let seqs = self.append_many(batches)?;
        for (key, value) in meta {
            self.put_meta(key, value)?;
        }
        Ok(seqs)
    }

    fn append_many(&self, batches: &[(&str, &[Vec<u8>])]) -> Result<Vec<u64>, StoreError> {
        for (container, changes) in batches {
            check_changes(container, changes)?;
        }
        batches
            .iter()
            .map(|(container, changes)| self.append_changes(container, changes))
            .collect()
    }

    /// Stores `snapshot` as covering changes `1..=covers_changes` of `container` and drops
    /// those changes from the log, atomically and durably. Replacing a snapshot with another
    /// that covers the same changes is allowed.
    ///
    /// # Errors
    /// [`StoreError::SnapshotAhead`] if `covers_changes` is beyond the last change, and
    /// [`StoreError::SnapshotStale`] if it is behind the stored snapshot (whose changes are
    /// already gone from the log, so accepting it would lose them).
    fn save_snapshot(
        &self,
        container: &str,
        snapshot: &[u8],
        covers_changes: u64,
    ) -> Result<(), StoreError>;

    /// Loads the snapshot and the changes after it, or `None` for a container that was never
    /// written.
    ///
    /// # Errors
    /// Decryption failures and inconsistent records (such as a gap in the log) are reported,
    /// never returned as data.
    fn load_container(&self, container: &str) -> Result<Option<ContainerRecord>, StoreError>;

    /// Names of all containers, sorted.
    ///
    /// # Errors
    /// Storage or decryption failures.
    fn list_containers(&self) -> Result<Vec<String>, StoreError>;

    /// Stores a small metadata value under `key`, replacing any previous one; durable on
    /// return.
    ///
    /// # Errors
    /// Oversized keys or values, storage and encryption failures.
    fn put_meta(&self, key: &str, value: &[u8]) -> Result<(), StoreError>;

    /// Reads the metadata value under `key`.
    ///
    /// # Errors
    /// Oversized keys, storage and decryption failures.
    fn get_meta(&self, key: &str) -> Result<Option<Vec<u8>>, StoreError>;

    /// Moves every record of `container` aside, still encrypted and never deleted, so that
    /// the name is free and empty again (the caller resyncs it from peers). Returns how
    /// many records were moved. For a container whose records cannot be read.
    ///
    /// # Errors
    /// Storage failures. The default refuses: a backend without a place to move records
    /// to must not pretend.
    fn quarantine_container(&self, container: &str) -> Result<u64, StoreError> {
        let _ = container;
        Err(StoreError::Unsupported("quarantine"))
    }

    /// Like [`Storage::list_containers`], but a name record that cannot be read is moved
    /// aside with every record under its id (see [`Storage::quarantine_container`]) and
    /// reported, instead of failing the whole listing.
    ///
    /// # Errors
    /// Storage failures.
    fn list_containers_quarantining(&self) -> Result<(Vec<String>, Vec<Quarantined>), StoreError> {
        Ok((self.list_containers()?, Vec::new()))
    }

    /// Makes every write so far durable. Writes through this trait already are; this exists
    /// for shutdown paths.
    ///
    /// # Errors
    /// Storage failures.
    fn flush(&self) -> Result<(), StoreError>;
}

/// A container whose name record could not be read, moved aside by
/// [`Storage::list_containers_quarantining`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Quarantined {
    /// The opaque id of the container (its name is what could not be read), hex.
    pub id: String,
    /// Why its name record was refused.
    pub reason: String,
    /// Records moved aside.
    pub records: u64,
}

/// One container as loaded: its snapshot, if any, and the changes after it.
///
/// The changes are exactly those with sequence numbers `snapshot_covers + 1 ..= last_seq`, in
/// order, so `changes[i]` has sequence number `snapshot_covers + 1 + i`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ContainerRecord {
    /// The latest compacted snapshot.
    pub snapshot: Option<Vec<u8>>,
    /// Highest change sequence number the snapshot covers; 0 without a snapshot.
    pub snapshot_covers: u64,
    /// Changes after the snapshot, oldest first.
    pub changes: Vec<Vec<u8>>,
    /// Sequence number of the last change ever appended to this container.
    pub last_seq: u64,
}

/// Errors from a [`Storage`] backend.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// The sled database could not be opened.
    #[error("failed to open the sled database in {path}: {hint}")]
    Open {
        /// The store directory.
        path: PathBuf,
        /// What to do about it, matched to the cause (see [`open_hint`]).
        hint: String,
        /// What sled reported.
        #[source]
        source: sled::Error,
    },
    /// sled failed during an operation.
    #[error("sled failed while {op}")]
    Sled {
        /// The operation, for example `appending changes`.
        op: &'static str,
        /// What sled reported.
        #[source]
        source: sled::Error,
    },
    /// The at-rest key is not the one the store was created with.
    #[error(
        "the at-rest key does not open the store in {path}; use the key this store was created with"
    )]
    WrongKey {
        /// The store directory.
        path: PathBuf,
    },
    /// The database holds data but no key marker.
    #[error(
        "the database in {path} holds data but no nuwa-store key marker; it is not a nuwa store or it is damaged"
    )]
    MissingMarker {
        /// The store directory.
        path: PathBuf,
    },
    /// A record did not decrypt although the key is right: the store was damaged or altered.
    #[error(
        "a record in tree {tree} failed to decrypt; the store is damaged or was altered on disk"
    )]
    Decrypt {
        /// The sled tree holding the record.
        tree: &'static str,
        /// What the cipher reported.
        #[source]
        source: CryptoError,
    },
    /// A record could not be encrypted.
    #[error("failed to encrypt a record for tree {tree}")]
    Encrypt {
        /// The sled tree the record was for.
        tree: &'static str,
        /// What the cipher reported.
        #[source]
        source: CryptoError,
    },
    /// A record decrypted but is inconsistent with the rest of the store.
    #[error("a record in tree {tree} is inconsistent: {reason}")]
    Corrupt {
        /// The sled tree holding the record.
        tree: &'static str,
        /// What is inconsistent.
        reason: String,
    },
    /// This backend does not support the operation.
    #[error("this store does not support {0}")]
    Unsupported(&'static str),
    /// A write would create a namespace beyond [`MAX_NAMESPACES`].
    #[error(
        "writing to namespace {namespace:?} would create a namespace beyond the store's limit of {max}; use fewer distinct cap, app and user ids in container names"
    )]
    TooManyNamespaces {
        /// The namespace that would be created.
        namespace: String,
        /// The limit, [`MAX_NAMESPACES`].
        max: usize,
    },
    /// A container name is empty.
    #[error("container name is empty; give the container a name")]
    EmptyContainerName,
    /// A container name is too long.
    #[error("container name is {len} bytes, over the {max}-byte limit")]
    ContainerNameTooLong {
        /// Its length in bytes.
        len: usize,
        /// The limit, [`MAX_CONTAINER_NAME_BYTES`].
        max: usize,
    },
    /// A change blob is too large.
    #[error(
        "change {index} for container {container:?} is {len} bytes, over the {max}-byte limit; split it"
    )]
    ChangeTooLarge {
        /// The container.
        container: String,
        /// Position of the change in the batch.
        index: usize,
        /// Its length in bytes.
        len: usize,
        /// The limit, [`MAX_CHANGE_BYTES`].
        max: usize,
    },
    /// A batch of changes is too large in total.
    #[error(
        "batch for container {container:?} holds {len} bytes, over the {max}-byte limit; append it in parts"
    )]
    BatchTooLarge {
        /// The container.
        container: String,
        /// Total bytes in the batch.
        len: usize,
        /// The limit, [`MAX_BATCH_BYTES`].
        max: usize,
    },
    /// A snapshot is too large.
    #[error("snapshot for container {container:?} is {len} bytes, over the {max}-byte limit")]
    SnapshotTooLarge {
        /// The container.
        container: String,
        /// Its length in bytes.
        len: usize,
        /// The limit, [`MAX_SNAPSHOT_BYTES`].
        max: usize,
    },
    /// A snapshot claims to cover changes that were never appended.
    #[error(
        "snapshot for container {container:?} claims to cover change {covers}, but the last change is {last_seq}"
    )]
    SnapshotAhead {
        /// The container.
        container: String,
        /// The `covers_changes` given.
        covers: u64,
        /// The last change appended.
        last_seq: u64,
    },
    /// A snapshot covers fewer changes than the stored one.
    #[error(
        "snapshot for container {container:?} covers changes up to {covers}, behind the stored snapshot at {current}; load the container again and rebuild the snapshot"
    )]
    SnapshotStale {
        /// The container.
        container: String,
        /// The `covers_changes` given.
        covers: u64,
        /// What the stored snapshot covers.
        current: u64,
    },
    /// A metadata key is too long.
    #[error("meta key is {len} bytes, over the {max}-byte limit")]
    MetaKeyTooLong {
        /// Its length in bytes.
        len: usize,
        /// The limit, [`MAX_META_KEY_BYTES`].
        max: usize,
    },
    /// A metadata value is too large.
    #[error("meta value for key {key:?} is {len} bytes, over the {max}-byte limit")]
    MetaValueTooLarge {
        /// The key.
        key: String,
        /// Its length in bytes.
        len: usize,
        /// The limit, [`MAX_META_VALUE_BYTES`].
        max: usize,
    },
}

/// Advice for a sled error met while opening the store in `path`, matched to its cause.
#[must_use]
pub fn open_hint(path: &std::path::Path, e: &sled::Error) -> String {
    let p = path.display();
    match e {
        sled::Error::Io(io) if io.to_string().contains("could not acquire lock") => {
            "another process holds the store's lock; is a second nuwa-node running on this home?"
                .to_owned()
        }
        sled::Error::Io(io) if io.kind() == std::io::ErrorKind::PermissionDenied => {
            "permission denied; the store must belong to the user running nuwa-node".to_owned()
        }
        sled::Error::Io(io) if io.raw_os_error() == Some(28) => {
            "the disk is full; free some space and start again".to_owned()
        }
        sled::Error::Corruption { .. } | sled::Error::Io(_) => format!(
            "sled found damaged files. Nothing written to it can be trusted; move the store \
             aside (`mv {p} {p}.damaged`) and start again: this device then resyncs every \
             container from its peers. Changes made here and never synced are only in the \
             moved copy"
        ),
        _ => "sled refused to open it".to_owned(),
    }
}

/// Checks a container name against the limits shared by every backend.
fn check_container_name(name: &str) -> Result<(), StoreError> {
    if name.is_empty() {
        return Err(StoreError::EmptyContainerName);
    }
    if name.len() > MAX_CONTAINER_NAME_BYTES {
        return Err(StoreError::ContainerNameTooLong {
            len: name.len(),
            max: MAX_CONTAINER_NAME_BYTES,
        });
    }
    Ok(())
}

/// Checks a batch of changes before anything of it is written.
fn check_changes(container: &str, changes: &[Vec<u8>]) -> Result<(), StoreError> {
    check_container_name(container)?;
    let mut total = 0usize;
    for (index, change) in changes.iter().enumerate() {
        if change.len() > MAX_CHANGE_BYTES {
            return Err(StoreError::ChangeTooLarge {
                container: container.to_owned(),
                index,
                len: change.len(),
                max: MAX_CHANGE_BYTES,
            });
        }
        total = total.saturating_add(change.len());
    }
    if total > MAX_BATCH_BYTES {
        return Err(StoreError::BatchTooLarge {
            container: container.to_owned(),
            len: total,
            max: MAX_BATCH_BYTES,
        });
    }
    Ok(())
}

/// Checks a snapshot's size before anything is written.
fn check_snapshot_size(container: &str, snapshot: &[u8]) -> Result<(), StoreError> {
    check_container_name(container)?;
    if snapshot.len() > MAX_SNAPSHOT_BYTES {
        return Err(StoreError::SnapshotTooLarge {
            container: container.to_owned(),
            len: snapshot.len(),
            max: MAX_SNAPSHOT_BYTES,
        });
    }
    Ok(())
}

/// Checks that a snapshot covering `covers` may replace one covering `current` in a log
/// whose last change is `last_seq`.
fn check_snapshot_seq(
    container: &str,
    covers: u64,
    current: u64,
    last_seq: u64,
) -> Result<(), StoreError> {
    if covers > last_seq {
        return Err(StoreError::SnapshotAhead {
            container: container.to_owned(),
            covers,
            last_seq,
        });
    }
    if covers < current {
        return Err(StoreError::SnapshotStale {
            container: container.to_owned(),
            covers,
            current,
        });
    }
    Ok(())
}

/// Checks a metadata key, and the value when writing.
fn check_meta(key: &str, value: Option<&[u8]>) -> Result<(), StoreError> {
    if key.len() > MAX_META_KEY_BYTES {
        return Err(StoreError::MetaKeyTooLong {
            len: key.len(),
            max: MAX_META_KEY_BYTES,
        });
    }
    if let Some(value) = value
        && value.len() > MAX_META_VALUE_BYTES
    {
        return Err(StoreError::MetaValueTooLarge {
            key: key.to_owned(),
            len: value.len(),
            max: MAX_META_VALUE_BYTES,
        });
    }
    Ok(())
}

#[cfg(test)]
mod hint_tests {
    use super::*;

    // Goal: each cause of a failed open gets advice about that cause, and
    // damaged files (a bad `snap.*` among them) never get the lock or
    // permission advice they used to.
    #[test]
    fn open_hints_match_their_cause() {
        let p = std::path::Path::new("/h/store");
        let io = |kind, msg: &str| sled::Error::Io(std::io::Error::new(kind, msg.to_owned()));
        let lock = open_hint(
            p,
            &io(
                std::io::ErrorKind::Other,
                "could not acquire lock on \"/h/store/db\"",
            ),
        );
        assert!(lock.contains("second nuwa-node"), "{lock}");
        let perm = open_hint(p, &io(std::io::ErrorKind::PermissionDenied, "denied"));
        assert!(perm.contains("must belong to the user"), "{perm}");
        let full = open_hint(p, &sled::Error::Io(std::io::Error::from_raw_os_error(28)));
        assert!(full.contains("disk is full"), "{full}");
        let bad = open_hint(p, &sled::Error::Corruption { at: None, bt: () });
        assert!(
            bad.contains("mv /h/store /h/store.damaged") && !bad.contains("lock"),
            "{bad}"
        );
    }
}
