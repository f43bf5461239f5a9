//! The sled-backed [`Storage`], with nothing readable on disk.
//!
//! # Layout
//!
//! Four trees, every value sealed with [`AtRestKey::seal`] and associated data
//! `lp(tree name) ‖ record key`, so a blob copied under another key or tree no longer opens.
//! `cid` is [`AtRestKey::opaque_id`]`("container", name)`, so names never reach the disk in
//! the clear; `seq` is a big-endian `u64`, so a container's log sorts by sequence number.
//!
//! | tree        | key            | sealed value                   |
//! |-------------|----------------|--------------------------------|
//! | `meta`      | `0x00`         | key marker `nuwa-store-v1`     |
//! | `meta`      | `opaque_id("meta", key)` | metadata value       |
//! | `names`     | `cid`          | `covers ‖ name`                |
//! | `snapshots` | `cid`          | `covers ‖ snapshot`            |
//! | `log`       | `cid ‖ seq`    | change                         |
//!
//! `covers` (big-endian `u64`) is the last sequence number the snapshot covers; it sits in
//! the names record too, so that finding a container's next sequence number never needs the
//! snapshot decrypted.
//!
//! # Crash safety
//!
//! An append is one sled transaction (name record if new, plus all log entries) followed by
//! one flush; a snapshot is one transaction writing the snapshot and names records and
//! removing the covered log entries, followed by one flush. sled writes each transaction to
//! its log as one atomic unit, so after a crash a batch or a compaction is either wholly there
//! or wholly absent, and everything acknowledged (flushed) is there; `tests/crash.rs` checks
//! this with `kill -9`. Loading also skips any log entry at or below the snapshot's `covers`,
//! so correctness does not rest on the removals alone, and reports a gap in the log as
//! [`StoreError::Corrupt`] rather than returning incomplete state.
//!
//! Writers take one lock while they assign sequence numbers and commit, and release it
//! before flushing, so concurrent appends share flushes. Loads take the same lock, so no
//! compaction runs between reading a snapshot and reading the log after it.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use nuwa_crypto::{AtRestKey, CryptoError};
use sled::transaction::{ConflictableTransactionError, TransactionError, Transactional};
use sled::{IVec, Tree};

use crate::{
    ContainerRecord, Quarantined, Storage, StoreError, check_changes, check_container_name,
    check_meta, check_snapshot_seq, check_snapshot_size,
};

const META_TREE: &str = "meta";
const NAMES_TREE: &str = "names";
const SNAPSHOTS_TREE: &str = "snapshots";
const LOG_TREE: &str = "log";
/// Records moved aside because they could not be read: key = 8-byte move id, one byte for
/// the tree they came from, their key; value = the record as it was (still encrypted).
const QUARANTINE_TREE: &str = "quarantine";

/// Key of the marker record; user metadata keys are 32-byte ids and never collide with it.
const MARKER_KEY: &[u8] = &[0];
/// Plaintext of the marker record; also the on-disk format version.
const MARKER_PLAINTEXT: &[u8] = b"nuwa-store-v1";

const CONTAINER_ID_DOMAIN: &str = "container";
const META_ID_DOMAIN: &str = "meta";

type ContainerId = [u8; 32];

/// Storage in a sled database, encrypted at rest under an [`AtRestKey`].
pub struct SledStore {
    path: PathBuf,
    key: AtRestKey,
    db: sled::Db,
    meta: Tree,
    names: Tree,
    snapshots: Tree,
    log: Tree,
    /// Serialises writers so that sequence numbers are assigned once; also caches each
    /// written container's position so appends need no reads.
    writer: Mutex<BTreeMap<ContainerId, Position>>,
}

/// Where a container's log stands.
#[derive(Clone, Copy, Debug)]
struct Position {
    /// Whether the names record exists on disk.
    exists: bool,
    /// Last sequence number the snapshot covers.
    covers: u64,
    /// Last sequence number appended.
    last_seq: u64,
}

/// How long `open` waits for a lock that a just-dropped store in this
/// process still holds.
const LOCK_WAIT: Duration = Duration::from_secs(5);

/// sled's page cache. Its default (1 GiB) let a daemon that read 100 MB of
/// containers at start keep them all resident; documents live in the
/// engine's memory (or are evicted on purpose), so the store's cache only
/// needs the hot pages of the log.
const CACHE_BYTES: u64 = 16 * 1024 * 1024;

/// Opens the sled database, waiting (bounded) for its file lock. Dropping a
/// sled `Db` releases the lock only once sled's background flusher thread
/// lets go of it, so an immediate reopen in the same process can find it
/// still taken; another process holding it is refused once the wait ends.
/// `cache_bytes` caps sled's page cache (`None`: sled's default).
pub(crate) fn open_db(dir: &Path, cache_bytes: Option<u64>) -> Result<sled::Db, sled::Error> {
    let deadline = Instant::now() + LOCK_WAIT;
    loop {
        let mut config = sled::Config::new().path(dir);
        if let Some(bytes) = cache_bytes {
            config = config.cache_capacity(bytes);
        }
        match config.open() {
            Err(sled::Error::Io(e))
                if e.to_string().contains("could not acquire lock")
                    && Instant::now() < deadline =>
            {
                std::thread::sleep(Duration::from_millis(10));
            }
            other => return other,
        }
    }
}

impl SledStore {
    /// Appends `changes` to the log of `container` without flushing: the
    /// caller flushes before anything is acknowledged.
    fn append_unflushed(&self, container: &str, changes: &[Vec<u8>]) -> Result<u64, StoreError> {
        check_changes(container, changes)?;
        let cid = self.container_id(container);
        let mut cache = self.lock_writer();
        let position = self.position(&mut cache, &cid, container)?;
        if changes.is_empty() {
            return Ok(position.last_seq);
        }
        // Seal outside the transaction: its closure may run more than once and must not
        // draw fresh nonces or do other work with effects.
        let name_record = if position.exists {
            None
        } else {
            Some(self.name_record(&cid, position.covers, container)?)
        };
        let mut entries = Vec::with_capacity(changes.len());
        let mut seq = position.last_seq;
        for change in changes {
            seq += 1;
            let key = log_key(&cid, seq);
            let value = self.seal(LOG_TREE, &key, change)?;
            entries.push((key, value));
        }
        (&self.names, &self.log)
            .transaction(|(names, log)| {
                if let Some(record) = &name_record {
                    names.insert(&cid[..], record.clone())?;
                }
                for (key, value) in &entries {
                    log.insert(&key[..], value.clone())?;
                }
                Ok::<_, ConflictableTransactionError<Infallible>>(())
            })
            .map_err(tx_err("appending changes"))?;
        cache.insert(
            cid,
            Position {
                exists: true,
                covers: position.covers,
                last_seq: seq,
            },
        );
        // Flush (the caller's) after releasing the lock so that concurrent
        // appends share flushes.
        drop(cache);
        Ok(seq)
    }

    /// Opens (or creates) the store in `dir` with `key`.
    ///
    /// A new store gets a sealed key marker; an existing one must have a marker that opens
    /// under `key`.
    ///
    /// # Errors
    /// [`StoreError::Open`] if sled cannot open `dir`, [`StoreError::WrongKey`] if `key` is
    /// not the store's key, [`StoreError::MissingMarker`] if `dir` holds data but no marker.
    pub fn open(dir: &Path, key: AtRestKey) -> Result<SledStore, StoreError> {
        let open_err = |source: sled::Error| StoreError::Open {
            path: dir.to_owned(),
            hint: crate::open_hint(dir, &source),
            source,
        };
        let db = open_db(dir, Some(CACHE_BYTES)).map_err(open_err)?;
        let meta = db.open_tree(META_TREE).map_err(open_err)?;
        let names = db.open_tree(NAMES_TREE).map_err(open_err)?;
        let snapshots = db.open_tree(SNAPSHOTS_TREE).map_err(open_err)?;
        let log = db.open_tree(LOG_TREE).map_err(open_err)?;
        let store = SledStore {
            path: dir.to_owned(),
            key,
            db,
            meta,
            names,
            snapshots,
            log,
            writer: Mutex::new(BTreeMap::new()),
        };
        store.check_marker()?;
        Ok(store)
    }

    /// The directory this store lives in.
    #[must_use]
    pub fn path(&self) -> &Path {
        &self.path
    }

    fn check_marker(&self) -> Result<(), StoreError> {
        let marker = self
            .meta
            .get(MARKER_KEY)
            .map_err(sled_err("reading the key marker"))?;
        match marker {
            Some(blob) => match self.key.open(&aad(META_TREE, MARKER_KEY), &blob) {
                Ok(plain) if plain.as_slice() == MARKER_PLAINTEXT => Ok(()),
                Ok(_) => Err(StoreError::Corrupt {
                    tree: META_TREE,
                    reason: "the key marker names an unknown store format".to_owned(),
                }),
                Err(CryptoError::Decrypt) => Err(StoreError::WrongKey {
                    path: self.path.clone(),
                }),
                Err(source) => Err(StoreError::Decrypt {
                    tree: META_TREE,
                    source,
                }),
            },
            None => {
                let empty = [&self.meta, &self.names, &self.snapshots, &self.log]
                    .iter()
                    .all(|tree| tree.is_empty());
                if !empty {
                    return Err(StoreError::MissingMarker {
                        path: self.path.clone(),
                    });
                }
                let blob = self.seal(META_TREE, MARKER_KEY, MARKER_PLAINTEXT)?;
                self.meta
                    .insert(MARKER_KEY, blob)
                    .map_err(sled_err("writing the key marker"))?;
                self.flush()?;
                tracing::info!(path = %self.path.display(), "created a new store");
                Ok(())
            }
        }
    }

    /// Moves the name record, the snapshot and every log entry under `cid` into the
    /// quarantine tree, then forgets the container's position. Copies first and removes
    /// after, flushing in between: a crash midway leaves duplicates in the quarantine,
    /// never a lost record.
    fn quarantine_id(&self, cid: &[u8]) -> Result<u64, StoreError> {
        let quarantine = self
            .db
            .open_tree(QUARANTINE_TREE)
            .map_err(sled_err("opening the quarantine"))?;
        let move_id = self
            .db
            .generate_id()
            .map_err(sled_err("numbering a quarantine"))?
            .to_be_bytes();
        let mut cache = self.lock_writer();
        let mut moved: Vec<(&sled::Tree, IVec)> = Vec::new();
        let sources: [(&sled::Tree, u8); 3] = [
            (&self.log, b'l'),
            (&self.snapshots, b's'),
            (&self.names, b'n'),
        ];
        for (tree, tag) in sources {
            for entry in tree.scan_prefix(cid) {
                let (key, blob) = entry.map_err(sled_err("reading a quarantined record"))?;
                let mut qkey = move_id.to_vec();
                qkey.push(tag);
                qkey.extend_from_slice(&key);
                quarantine
                    .insert(qkey, blob)
                    .map_err(sled_err("moving a record to the quarantine"))?;
                moved.push((tree, key));
            }
        }
        self.flush()?;
        // The name record goes last: until it is gone, the container still lists.
        for (tree, key) in moved.iter().rev() {
            tree.remove(key)
                .map_err(sled_err("removing a quarantined record"))?;
        }
        self.flush()?;
        if let Ok(id) = ContainerId::try_from(cid) {
            cache.remove(&id);
        }
        tracing::warn!(container_id = %hex_id(cid), records = moved.len(), "records moved to the quarantine");
        Ok(moved.len() as u64)
    }

    fn container_id(&self, name: &str) -> ContainerId {
        self.key.opaque_id(CONTAINER_ID_DOMAIN, name.as_bytes())
    }

    fn seal(&self, tree: &'static str, key: &[u8], plaintext: &[u8]) -> Result<IVec, StoreError> {
        self.key
            .seal(&aad(tree, key), plaintext)
            .map(IVec::from)
            .map_err(|source| StoreError::Encrypt { tree, source })
    }

    fn open_record(
        &self,
        tree: &'static str,
        key: &[u8],
        blob: &[u8],
    ) -> Result<Vec<u8>, StoreError> {
        // Decrypted records are state, not key material, and leave the store as plain bytes;
        // taking the buffer out of its `Zeroizing` wrapper moves it without a copy.
        self.key
            .open(&aad(tree, key), blob)
            .map(|mut plain| std::mem::take(&mut *plain))
            .map_err(|source| StoreError::Decrypt { tree, source })
    }

    fn lock_writer(&self) -> MutexGuard<'_, BTreeMap<ContainerId, Position>> {
        // Nothing panics while the lock is held, so a poisoned lock still guards a consistent
        // cache; recover it rather than spreading the panic.
        self.writer.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Reads a container's names record and returns its `covers`, or `None` if the
    /// container does not exist. Checks that the record is really `expected`'s.
    fn read_name_record(
        &self,
        cid: &ContainerId,
        expected: &str,
    ) -> Result<Option<u64>, StoreError> {
        let Some(blob) = self
            .names
            .get(cid)
            .map_err(sled_err("reading a container name"))?
        else {
            return Ok(None);
        };
        let plain = self.open_record(NAMES_TREE, cid, &blob)?;
        let (covers, name) = split_covers(NAMES_TREE, &plain)?;
        if name != expected.as_bytes() {
            return Err(corrupt(
                NAMES_TREE,
                "the name record belongs to another container",
            ));
        }
        Ok(Some(covers))
    }

    /// The container's position, from the cache or, on first use, from disk.
    fn position(
        &self,
        cache: &mut BTreeMap<ContainerId, Position>,
        cid: &ContainerId,
        name: &str,
    ) -> Result<Position, StoreError> {
        if let Some(position) = cache.get(cid) {
            return Ok(*position);
        }
        let position = match self.read_name_record(cid, name)? {
            None => Position {
                exists: false,
                covers: 0,
                last_seq: 0,
            },
            Some(covers) => {
                let last_logged = self
                    .log
                    .scan_prefix(cid)
                    .keys()
                    .next_back()
                    .transpose()
                    .map_err(sled_err("reading the change log"))?
                    .map(|key| log_seq(&key))
                    .transpose()?
                    .unwrap_or(0);
                Position {
                    exists: true,
                    covers,
                    last_seq: covers.max(last_logged),
                }
            }
        };
        cache.insert(*cid, position);
        Ok(position)
    }

    fn name_record(&self, cid: &ContainerId, covers: u64, name: &str) -> Result<IVec, StoreError> {
        let mut plain = Vec::with_capacity(8 + name.len());
        plain.extend_from_slice(&covers.to_be_bytes());
        plain.extend_from_slice(name.as_bytes());
        self.seal(NAMES_TREE, cid, &plain)
    }
}

impl Storage for SledStore {
    fn append_changes(&self, container: &str, changes: &[Vec<u8>]) -> Result<u64, StoreError> {
        let seq = self.append_unflushed(container, changes)?;
        if !changes.is_empty() {
            self.flush()?;
        }
        Ok(seq)
    }

    fn append_many(&self, batches: &[(&str, &[Vec<u8>])]) -> Result<Vec<u64>, StoreError> {
        self.append_many_with_meta(batches, &[])
    }

    fn append_many_with_meta(
        &self,
        batches: &[(&str, &[Vec<u8>])],
        meta: &[(String, Vec<u8>)],
    ) -> Result<Vec<u64>, StoreError> {
        for (container, changes) in batches {
            check_changes(container, changes)?;
        }
        for (key, value) in meta {
            check_meta(key, Some(value))?;
        }
        let mut out = Vec::with_capacity(batches.len());
        for (container, changes) in batches {
            out.push(self.append_unflushed(container, changes)?);
        }
        // After the changes in sled's log, so a record never outlives
        // the changes it describes.
        for (key, value) in meta {
            let id = self.key.opaque_id(META_ID_DOMAIN, key.as_bytes());
            let blob = self.seal(META_TREE, &id, value)?;
            self.meta
                .insert(id, blob)
                .map_err(sled_err("writing metadata"))?;
        }
        if batches.iter().any(|(_, c)| !c.is_empty()) || !meta.is_empty() {
            self.flush()?;
        }
        Ok(out)
    }

    fn save_snapshot(
        &self,
        container: &str,
        snapshot: &[u8],
        covers_changes: u64,
    ) -> Result<(), StoreError> {
        check_snapshot_size(container, snapshot)?;
        let cid = self.container_id(container);
        let mut cache = self.lock_writer();
        let position = self.position(&mut cache, &cid, container)?;
        check_snapshot_seq(
            container,
            covers_changes,
            position.covers,
            position.last_seq,
        )?;
        let covered: Vec<IVec> = self
            .log
            .range(log_key(&cid, 0)..=log_key(&cid, covers_changes))
            .keys()
            .collect::<Result<_, _>>()
            .map_err(sled_err("reading the change log"))?;
        let name_record = self.name_record(&cid, covers_changes, container)?;
        let mut plain = Vec::with_capacity(8 + snapshot.len());
        plain.extend_from_slice(&covers_changes.to_be_bytes());
        plain.extend_from_slice(snapshot);
        let snapshot_record = self.seal(SNAPSHOTS_TREE, &cid, &plain)?;
        drop(plain);
        (&self.names, &self.snapshots, &self.log)
            .transaction(|(names, snapshots, log)| {
                names.insert(&cid[..], name_record.clone())?;
                snapshots.insert(&cid[..], snapshot_record.clone())?;
                for key in &covered {
                    log.remove(key.clone())?;
                }
                Ok::<_, ConflictableTransactionError<Infallible>>(())
            })
            .map_err(tx_err("saving a snapshot"))?;
        cache.insert(
            cid,
            Position {
                exists: true,
                covers: covers_changes,
                last_seq: position.last_seq,
            },
        );
        drop(cache);
        self.flush()
    }

    fn load_container(&self, container: &str) -> Result<Option<ContainerRecord>, StoreError> {
        check_container_name(container)?;
        let cid = self.container_id(container);
        // Hold the writer lock so that no compaction runs between reading the snapshot and
        // reading the log.
        let _cache = self.lock_writer();
        let Some(covers) = self.read_name_record(&cid, container)? else {
            return Ok(None);
        };
        let snapshot = match self
            .snapshots
            .get(cid)
            .map_err(sled_err("reading a snapshot"))?
        {
            None if covers == 0 => None,
            None => return Err(corrupt(NAMES_TREE, "a snapshot is recorded but missing")),
            Some(blob) => {
                let mut plain = self.open_record(SNAPSHOTS_TREE, &cid, &blob)?;
                let (snapshot_covers, _) = split_covers(SNAPSHOTS_TREE, &plain)?;
                if snapshot_covers != covers {
                    return Err(corrupt(SNAPSHOTS_TREE, "snapshot and name record disagree"));
                }
                plain.drain(..8);
                Some(plain)
            }
        };
        let mut changes = Vec::new();
        let mut last_seq = covers;
        for entry in self.log.scan_prefix(cid) {
            let (key, blob) = entry.map_err(sled_err("reading the change log"))?;
            let seq = log_seq(&key)?;
            if seq <= covers {
                // Covered by the snapshot; compaction removes these, but never rely on it.
                continue;
            }
            if seq != last_seq + 1 {
                return Err(StoreError::Corrupt {
                    tree: LOG_TREE,
                    reason: format!(
                        "the change log of {container:?} jumps from {last_seq} to {seq}"
                    ),
                });
            }
            let plain = self.open_record(LOG_TREE, &key, &blob)?;
            changes.push(plain);
            last_seq = seq;
        }
        Ok(Some(ContainerRecord {
            snapshot,
            snapshot_covers: covers,
            changes,
            last_seq,
        }))
    }

    fn quarantine_container(&self, container: &str) -> Result<u64, StoreError> {
        check_container_name(container)?;
        let cid = self.container_id(container);
        self.quarantine_id(&cid)
    }

    fn list_containers_quarantining(&self) -> Result<(Vec<String>, Vec<Quarantined>), StoreError> {
        let mut names = Vec::new();
        let mut bad = Vec::new();
        let mut moved = Vec::new();
        for entry in self.names.iter() {
            let (key, blob) = entry.map_err(sled_err("listing containers"))?;
            let name = self.open_record(NAMES_TREE, &key, &blob).and_then(|plain| {
                let (_, name) = split_covers(NAMES_TREE, &plain)?;
                String::from_utf8(name.to_vec())
                    .map_err(|_| corrupt(NAMES_TREE, "a container name is not UTF-8"))
            });
            match name {
                Ok(n) => names.push(n),
                Err(e) => bad.push((key.to_vec(), e.to_string())),
            }
        }
        for (id, reason) in bad {
            let records = self.quarantine_id(&id)?;
            moved.push(Quarantined {
                id: hex_id(&id),
                reason,
                records,
            });
        }
        names.sort();
        Ok((names, moved))
    }

    fn list_containers(&self) -> Result<Vec<String>, StoreError> {
        let mut names = Vec::new();
        for entry in self.names.iter() {
            let (key, blob) = entry.map_err(sled_err("listing containers"))?;
            let plain = self.open_record(NAMES_TREE, &key, &blob)?;
            let (_, name) = split_covers(NAMES_TREE, &plain)?;
            let name = String::from_utf8(name.to_vec())
                .map_err(|_| corrupt(NAMES_TREE, "a container name is not UTF-8"))?;
            names.push(name);
        }
        names.sort();
        Ok(names)
    }

    fn put_meta(&self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        check_meta(key, Some(value))?;
        let id = self.key.opaque_id(META_ID_DOMAIN, key.as_bytes());
        let blob = self.seal(META_TREE, &id, value)?;
        self.meta
            .insert(id, blob)
            .map_err(sled_err("writing metadata"))?;
        self.flush()
    }

    fn get_meta(&self, key: &str) -> Result<Option<Vec<u8>>, StoreError> {
        check_meta(key, None)?;
        let id = self.key.opaque_id(META_ID_DOMAIN, key.as_bytes());
        let Some(blob) = self.meta.get(id).map_err(sled_err("reading metadata"))? else {
            return Ok(None);
        };
        Ok(Some(self.open_record(META_TREE, &id, &blob)?))
    }

    fn flush(&self) -> Result<(), StoreError> {
        self.db
            .flush()
            .map(drop)
            .map_err(sled_err("flushing to disk"))
    }
}

impl fmt::Debug for SledStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SledStore")
            .field("path", &self.path)
            .finish_non_exhaustive()
    }
}

/// Associated data for a record: `lp(tree) ‖ key`.
fn aad(tree: &str, key: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(8 + tree.len() + key.len());
    // usize is at most 64 bits on every target Rust supports, so this widening is lossless.
    out.extend_from_slice(&(tree.len() as u64).to_be_bytes());
    out.extend_from_slice(tree.as_bytes());
    out.extend_from_slice(key);
    out
}

fn log_key(cid: &ContainerId, seq: u64) -> [u8; 40] {
    let mut key = [0u8; 40];
    key[..32].copy_from_slice(cid);
    key[32..].copy_from_slice(&seq.to_be_bytes());
    key
}

fn log_seq(key: &[u8]) -> Result<u64, StoreError> {
    let seq: [u8; 8] = key
        .get(32..)
        .and_then(|tail| tail.try_into().ok())
        .ok_or_else(|| corrupt(LOG_TREE, "a log key is not 40 bytes"))?;
    Ok(u64::from_be_bytes(seq))
}

/// Splits a `covers ‖ rest` record.
fn split_covers<'a>(tree: &'static str, plain: &'a [u8]) -> Result<(u64, &'a [u8]), StoreError> {
    let (covers, rest) = plain
        .split_first_chunk::<8>()
        .ok_or_else(|| corrupt(tree, "a record is shorter than its 8-byte header"))?;
    Ok((u64::from_be_bytes(*covers), rest))
}

fn corrupt(tree: &'static str, reason: &str) -> StoreError {
    StoreError::Corrupt {
        tree,
        reason: reason.to_owned(),
    }
}

fn sled_err(op: &'static str) -> impl Fn(sled::Error) -> StoreError {
    move |source| StoreError::Sled { op, source }
}

fn tx_err(op: &'static str) -> impl Fn(TransactionError<Infallible>) -> StoreError {
    move |error| match error {
        TransactionError::Storage(source) => StoreError::Sled { op, source },
        TransactionError::Abort(never) => match never {},
    }
}

fn hex_id(id: &[u8]) -> String {
    id.iter().map(|b| format!("{b:02x}")).collect()
}
