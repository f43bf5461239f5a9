//! The sled-backed [`Storage`], with nothing readable on disk and each NIP-8 namespace in
//! trees of its own.
//!
//! # Layout
//!
//! Every value is sealed with [`AtRestKey::seal`] and associated data
//! `lp(tree name) ‖ record key`, so a blob copied under another key, into another tree or
//! into another namespace's trees no longer opens. `cid` is
//! [`AtRestKey::opaque_id`]`("container", name)` and `nsid` is the first 16 bytes of
//! `opaque_id("namespace", namespace)` in lower-case hex, where `namespace` is
//! [`namespace_of`]`(name)` (whose docs give the rules, and where names that fit no NIP-8
//! form go): neither container nor namespace names reach the disk in the clear. `seq` is a
//! big-endian `u64`, so a container's log sorts by sequence number.
//!
//! | tree                   | key                      | sealed value                  |
//! |------------------------|--------------------------|-------------------------------|
//! | `meta`                 | `0x00`                   | key marker `nuwa-store-v2`    |
//! | `meta`                 | `opaque_id("meta", key)` | metadata value                |
//! | `ns/<nsid>/names`      | `cid`                    | `covers ‖ name`               |
//! | `ns/<nsid>/snapshots`  | `cid`                    | `covers ‖ snapshot`           |
//! | `ns/<nsid>/log`        | `cid ‖ seq`              | change                        |
//! | `ns/<nsid>/quarantine` | `move ‖ tag ‖ key`       | a record as it was (see below)|
//!
//! `covers` (big-endian `u64`) is the last sequence number the snapshot covers; it sits in
//! the names record too, so that finding a container's next sequence number never needs the
//! snapshot decrypted. While a v1 store is being migrated the marker reads
//! `nuwa-store-v1-migrating`.
//!
//! A namespace's four trees are created with its first write (never by a read) and found
//! again on open from sled's list of trees; they are opened once and kept, at most
//! [`MAX_NAMESPACES`](crate::MAX_NAMESPACES) of them. Compacting, quarantining or listing a
//! bad name in one namespace reads and writes that namespace's trees only (and `meta` never;
//! `tests/sled_store.rs::compacting_or_quarantining_one_namespace_leaves_the_others_untouched`);
//! a group commit ([`Storage::append_many_with_meta`]) is one transaction over the trees of
//! every namespace it writes, plus `meta` when it carries records.
//!
//! The quarantine keeps records moved aside because they could not be read: `move` is an
//! 8-byte id from [`sled::Db::generate_id`], `tag` is the tree the record came from (`n`,
//! `s`, `l` for this namespace's names, snapshots and log; `N`, `S`, `L` for the shared trees
//! of a v1 store, see below), and `key` its key there. The value is the blob as it was,
//! still sealed for the tree it came from.
//!
//! # Migration from v1
//!
//! A v1 store (marker `nuwa-store-v1`) kept every namespace in four shared trees, `names`,
//! `snapshots`, `log` and `quarantine`, with the same keys and values. `open` moves it to
//! this layout before it returns; see the `migrate` module for the procedure and why a
//! crash at any point loses nothing.
//!
//! # Crash safety
//!
//! An append is one sled transaction (name records of new containers, plus all log entries,
//! plus metadata records given with it) followed by one flush; a snapshot is one transaction
//! writing the snapshot and names records and removing the covered log entries, followed by
//! one flush; a quarantine is one transaction moving every record of the container. sled
//! writes each transaction to its log as one atomic unit, so after a crash each of these is
//! either wholly there or wholly absent, and everything acknowledged (flushed) is there;
//! `tests/crash.rs` checks this with `kill -9`. Loading also skips any log entry at or below
//! the snapshot's `covers`, so correctness does not rest on the removals alone, and reports a
//! gap in the log as [`StoreError::Corrupt`] rather than returning incomplete state.
//!
//! Writers take one lock while they assign sequence numbers and commit, and release it
//! before flushing, so concurrent appends share flushes. Loads take the same lock, so no
//! compaction runs between reading a snapshot and reading the log after it.

mod migrate;

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use nuwa_crypto::{AtRestKey, CryptoError};
use sled::transaction::{ConflictableTransactionError, TransactionError, Transactional};
use sled::{IVec, Tree};

use crate::{
    ContainerRecord, MAX_NAMESPACES, Quarantined, Storage, StoreError, check_changes,
    check_container_name, check_meta, check_snapshot_seq, check_snapshot_size, namespace_of,
};

const META_TREE: &str = "meta";
/// The kinds of tree every namespace has; the last part of their tree names, and the `tree`
/// of the errors about their records.
const NAMES: &str = "names";
const SNAPSHOTS: &str = "snapshots";
const LOG: &str = "log";
const QUARANTINE: &str = "quarantine";
/// Start of every namespace's tree names: `ns/<nsid>/<kind>`.
const SPACE_TREE_PREFIX: &str = "ns/";
/// Bytes of a namespace's opaque id in its tree names (as twice as many hex digits): 128
/// bits, so two namespaces of one store never share trees by chance.
const SPACE_ID_BYTES: usize = 16;

/// Key of the marker record; user metadata keys are 32-byte ids and never collide with it.
const MARKER_KEY: &[u8] = &[0];
/// Plaintext of the marker record of the shared-tree layout, migrated on open.
const MARKER_V1: &[u8] = b"nuwa-store-v1";
/// Plaintext of the marker record while a v1 store is being migrated: not v1 any more, so
/// that a binary from before the migration refuses a half-moved store.
const MARKER_MIGRATING: &[u8] = b"nuwa-store-v1-migrating";
/// Plaintext of the marker record of this layout; also the on-disk format version.
const MARKER_V2: &[u8] = b"nuwa-store-v2";

const CONTAINER_ID_DOMAIN: &str = "container";
const META_ID_DOMAIN: &str = "meta";
const NAMESPACE_ID_DOMAIN: &str = "namespace";

type ContainerId = [u8; 32];

/// Storage in a sled database, encrypted at rest under an [`AtRestKey`].
pub struct SledStore {
    path: PathBuf,
    key: AtRestKey,
    db: sled::Db,
    meta: Place,
    /// Serialises writers so that sequence numbers are assigned once; also caches each
    /// written container's position so appends need no reads, and the namespaces' trees.
    writer: Mutex<Writer>,
}

/// What the writer lock guards.
struct Writer {
    positions: BTreeMap<ContainerId, Position>,
    spaces: Spaces,
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

impl Position {
    /// A container that was never written.
    const NEW: Position = Position {
        exists: false,
        covers: 0,
        last_seq: 0,
    };
}

/// A sled tree with the name its records are sealed under.
#[derive(Clone)]
struct Place {
    /// The tree's name in sled, bound into each record's associated data.
    name: String,
    /// The kind of tree, for errors: `names`, `log`, `meta`, …
    kind: &'static str,
    tree: Tree,
}

impl Place {
    fn open(db: &sled::Db, name: String, kind: &'static str) -> Result<Place, sled::Error> {
        let tree = db.open_tree(&name)?;
        Ok(Place { name, kind, tree })
    }

    fn seal(&self, key: &AtRestKey, record: &[u8], plaintext: &[u8]) -> Result<IVec, StoreError> {
        key.seal(&aad(&self.name, record), plaintext)
            .map(IVec::from)
            .map_err(|source| StoreError::Encrypt {
                tree: self.kind,
                source,
            })
    }

    fn open_record(
        &self,
        key: &AtRestKey,
        record: &[u8],
        blob: &[u8],
    ) -> Result<Vec<u8>, StoreError> {
        // Decrypted records are state, not key material, and leave the store as plain bytes;
        // taking the buffer out of its `Zeroizing` wrapper moves it without a copy.
        key.open(&aad(&self.name, record), blob)
            .map(|mut plain| std::mem::take(&mut *plain))
            .map_err(|source| StoreError::Decrypt {
                tree: self.kind,
                source,
            })
    }
}

/// The trees of one namespace.
struct Space {
    names: Place,
    snapshots: Place,
    log: Place,
    quarantine: Place,
}

impl Space {
    /// Opens (creating if needed) the trees of the namespace whose id is `nsid` (hex).
    fn open(db: &sled::Db, nsid: &str) -> Result<Space, sled::Error> {
        let place = |kind| Place::open(db, format!("{SPACE_TREE_PREFIX}{nsid}/{kind}"), kind);
        Ok(Space {
            names: place(NAMES)?,
            snapshots: place(SNAPSHOTS)?,
            log: place(LOG)?,
            quarantine: place(QUARANTINE)?,
        })
    }
}

/// The namespaces' trees, each opened once: every namespace on disk by id, and the ones met
/// by name since open (so that finding a namespace's trees needs no keyed hash after the
/// first time).
struct Spaces {
    by_id: BTreeMap<String, Arc<Space>>,
    by_namespace: BTreeMap<String, Arc<Space>>,
}

impl Spaces {
    /// Opens every namespace that has trees in `db`.
    fn on_disk(db: &sled::Db) -> Result<Spaces, sled::Error> {
        let mut by_id = BTreeMap::new();
        for name in db.tree_names() {
            if let Some(nsid) = space_id_of_tree(&name)
                && !by_id.contains_key(nsid)
            {
                by_id.insert(nsid.to_owned(), Arc::new(Space::open(db, nsid)?));
            }
        }
        Ok(Spaces {
            by_id,
            by_namespace: BTreeMap::new(),
        })
    }

    /// The trees of `namespace`: `None` if it has none and `create` is false.
    ///
    /// # Errors
    /// [`StoreError::TooManyNamespaces`] when creating one more would pass
    /// [`MAX_NAMESPACES`]; sled failures while creating the trees.
    fn get(
        &mut self,
        db: &sled::Db,
        key: &AtRestKey,
        namespace: &str,
        create: bool,
    ) -> Result<Option<Arc<Space>>, StoreError> {
        if let Some(space) = self.by_namespace.get(namespace) {
            return Ok(Some(Arc::clone(space)));
        }
        let nsid = space_id(key, namespace);
        let space = match self.by_id.get(&nsid) {
            Some(space) => Arc::clone(space),
            None if !create => return Ok(None),
            None => {
                if self.by_id.len() >= MAX_NAMESPACES {
                    return Err(StoreError::TooManyNamespaces {
                        namespace: namespace.to_owned(),
                        max: MAX_NAMESPACES,
                    });
                }
                let space = Arc::new(
                    Space::open(db, &nsid).map_err(sled_err("creating a namespace's trees"))?,
                );
                self.by_id.insert(nsid, Arc::clone(&space));
                space
            }
        };
        // Only namespaces that exist are remembered by name, so this map is no larger than
        // `by_id`.
        self.by_namespace
            .insert(namespace.to_owned(), Arc::clone(&space));
        Ok(Some(space))
    }

    /// Every namespace's trees, in id order.
    fn all(&self) -> Vec<Arc<Space>> {
        self.by_id.values().cloned().collect()
    }
}

/// The id of `namespace` as it appears in its tree names.
fn space_id(key: &AtRestKey, namespace: &str) -> String {
    hex_id(&key.opaque_id(NAMESPACE_ID_DOMAIN, namespace.as_bytes())[..SPACE_ID_BYTES])
}

/// The namespace id in a tree name `ns/<nsid>/<kind>`, if it is one.
fn space_id_of_tree(name: &[u8]) -> Option<&str> {
    let (nsid, kind) = std::str::from_utf8(name)
        .ok()?
        .strip_prefix(SPACE_TREE_PREFIX)?
        .split_once('/')?;
    let is_id = nsid.len() == 2 * SPACE_ID_BYTES
        && nsid
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b));
    (is_id && [NAMES, SNAPSHOTS, LOG, QUARANTINE].contains(&kind)).then_some(nsid)
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

/// What the key marker says.
enum Marker {
    /// No marker: a new store, or not a store at all.
    Missing,
    /// The shared-tree layout, to migrate.
    V1,
    /// A migration from v1 began and did not finish.
    Migrating,
    /// This layout.
    V2,
}

/// Reads the key marker of the store in `dir`.
fn read_marker(meta: &Place, key: &AtRestKey, dir: &Path) -> Result<Marker, StoreError> {
    let Some(blob) = meta
        .tree
        .get(MARKER_KEY)
        .map_err(sled_err("reading the key marker"))?
    else {
        return Ok(Marker::Missing);
    };
    match key.open(&aad(&meta.name, MARKER_KEY), &blob) {
        Ok(plain) if plain.as_slice() == MARKER_V2 => Ok(Marker::V2),
        Ok(plain) if plain.as_slice() == MARKER_V1 => Ok(Marker::V1),
        Ok(plain) if plain.as_slice() == MARKER_MIGRATING => Ok(Marker::Migrating),
        Ok(_) => Err(StoreError::Corrupt {
            tree: META_TREE,
            reason: "the key marker names an unknown store format".to_owned(),
        }),
        Err(CryptoError::Decrypt) => Err(StoreError::WrongKey {
            path: dir.to_owned(),
        }),
        Err(source) => Err(StoreError::Decrypt {
            tree: META_TREE,
            source,
        }),
    }
}

/// Writes the key marker with `plaintext`, without flushing.
fn write_marker(meta: &Place, key: &AtRestKey, plaintext: &[u8]) -> Result<(), StoreError> {
    let blob = meta.seal(key, MARKER_KEY, plaintext)?;
    meta.tree
        .insert(MARKER_KEY, blob)
        .map_err(sled_err("writing the key marker"))?;
    Ok(())
}

/// One container's part of a group commit, sealed and ready.
struct Staged {
    /// Index of its namespace in the group's list of namespaces.
    space: usize,
    cid: ContainerId,
    /// The names record, for a container the group creates.
    name_record: Option<IVec>,
    entries: Vec<([u8; 40], IVec)>,
}

impl SledStore {
    /// Opens (or creates) the store in `dir` with `key`.
    ///
    /// A new store gets a sealed key marker; an existing one must have a marker that opens
    /// under `key`. A v1 store (every namespace in shared trees) is migrated to the
    /// per-namespace layout before this returns, which takes time in proportion to its size;
    /// a crash during the migration loses nothing and the next open finishes it.
    ///
    /// # Errors
    /// [`StoreError::Open`] if sled cannot open `dir`, [`StoreError::WrongKey`] if `key` is
    /// not the store's key, [`StoreError::MissingMarker`] if `dir` holds data but no marker;
    /// storage and encryption failures during a migration.
    pub fn open(dir: &Path, key: AtRestKey) -> Result<SledStore, StoreError> {
        let open_err = |source: sled::Error| StoreError::Open {
            path: dir.to_owned(),
            hint: crate::open_hint(dir, &source),
            source,
        };
        let db = open_db(dir, Some(CACHE_BYTES)).map_err(open_err)?;
        let meta = Place::open(&db, META_TREE.to_owned(), META_TREE).map_err(open_err)?;
        let mut spaces = Spaces::on_disk(&db).map_err(open_err)?;
        match read_marker(&meta, &key, dir)? {
            Marker::V2 => migrate::drop_empty_v1_trees(&db)?,
            Marker::V1 | Marker::Migrating => {
                // Without a step limit the migration always finishes.
                let _finished = migrate::run(&db, &key, &meta, &mut spaces, usize::MAX)?;
                tracing::info!(path = %dir.display(), "moved every namespace of the store into trees of its own");
            }
            Marker::Missing => {
                for name in db.tree_names() {
                    let tree = db.open_tree(&name).map_err(open_err)?;
                    if !tree.is_empty() {
                        return Err(StoreError::MissingMarker {
                            path: dir.to_owned(),
                        });
                    }
                }
                write_marker(&meta, &key, MARKER_V2)?;
                db.flush().map_err(sled_err("flushing to disk"))?;
                tracing::info!(path = %dir.display(), "created a new store");
            }
        }
        Ok(SledStore {
            path: dir.to_owned(),
            key,
            db,
            meta,
            writer: Mutex::new(Writer {
                positions: BTreeMap::new(),
                spaces,
            }),
        })
    }

    /// The directory this store lives in.
    #[must_use]
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Appends each batch to its container's log, and writes the `meta` records, as one
    /// transaction without flushing: the caller flushes before anything is acknowledged.
    /// Returns each container's last sequence number, in order, and whether anything was
    /// written.
    fn append_unflushed(
        &self,
        batches: &[(&str, &[Vec<u8>])],
        meta: &[(String, Vec<u8>)],
    ) -> Result<(Vec<u64>, bool), StoreError> {
        for (container, changes) in batches {
            check_changes(container, changes)?;
        }
        for (key, value) in meta {
            check_meta(key, Some(value))?;
        }
        let mut guard = self.lock_writer();
        let writer = &mut *guard;
        // Positions as they will be once the group commits: a container may appear twice.
        let mut after: BTreeMap<ContainerId, Position> = BTreeMap::new();
        let mut spaces: Vec<Arc<Space>> = Vec::new();
        let mut staged: Vec<Staged> = Vec::new();
        let mut out = Vec::with_capacity(batches.len());
        for (container, changes) in batches {
            let cid = self.container_id(container);
            let space = writer.spaces.get(
                &self.db,
                &self.key,
                namespace_of(container),
                !changes.is_empty(),
            )?;
            let position = match after.get(&cid) {
                Some(position) => *position,
                None => self.position(&mut writer.positions, space.as_deref(), &cid, container)?,
            };
            let Some(space) = space.filter(|_| !changes.is_empty()) else {
                out.push(position.last_seq);
                continue;
            };
            let index = match spaces.iter().position(|s| Arc::ptr_eq(s, &space)) {
                Some(index) => index,
                None => {
                    spaces.push(Arc::clone(&space));
                    spaces.len() - 1
                }
            };
            // Seal outside the transaction: its closure may run more than once and must not
            // draw fresh nonces or do other work with effects.
            let name_record = if position.exists {
                None
            } else {
                Some(self.name_record(&space, &cid, position.covers, container)?)
            };
            let mut entries = Vec::with_capacity(changes.len());
            let mut seq = position.last_seq;
            for change in *changes {
                seq += 1;
                let key = log_key(&cid, seq);
                let value = space.log.seal(&self.key, &key, change)?;
                entries.push((key, value));
            }
            after.insert(
                cid,
                Position {
                    exists: true,
                    covers: position.covers,
                    last_seq: seq,
                },
            );
            staged.push(Staged {
                space: index,
                cid,
                name_record,
                entries,
            });
            out.push(seq);
        }
        let mut meta_records = Vec::with_capacity(meta.len());
        for (key, value) in meta {
            let id = self.key.opaque_id(META_ID_DOMAIN, key.as_bytes());
            meta_records.push((id, self.meta.seal(&self.key, &id, value)?));
        }
        if staged.is_empty() && meta_records.is_empty() {
            return Ok((out, false));
        }
        // One transaction over `meta` (index 0) and the names and log trees of every
        // namespace the group writes (indices 1 + 2i and 2 + 2i), so the group commits whole
        // or not at all, and the meta records never without the changes.
        let mut trees: Vec<&Tree> = Vec::with_capacity(1 + 2 * spaces.len());
        trees.push(&self.meta.tree);
        for space in &spaces {
            trees.push(&space.names.tree);
            trees.push(&space.log.tree);
        }
        trees[..]
            .transaction(|tx| {
                for part in &staged {
                    let (names, log) = (&tx[1 + 2 * part.space], &tx[2 + 2 * part.space]);
                    if let Some(record) = &part.name_record {
                        names.insert(&part.cid[..], record.clone())?;
                    }
                    for (key, value) in &part.entries {
                        log.insert(&key[..], value.clone())?;
                    }
                }
                for (id, blob) in &meta_records {
                    tx[0].insert(&id[..], blob.clone())?;
                }
                Ok::<_, ConflictableTransactionError<Infallible>>(())
            })
            .map_err(tx_err("appending changes"))?;
        writer.positions.extend(after);
        Ok((out, true))
    }

    /// Moves the name record, the snapshot and every log entry under `cid` in `space` into
    /// its quarantine tree, in one transaction, then forgets the container's position.
    fn quarantine_id(
        &self,
        writer: &mut Writer,
        space: &Space,
        cid: &[u8],
    ) -> Result<u64, StoreError> {
        let move_id = self
            .db
            .generate_id()
            .map_err(sled_err("numbering a quarantine"))?
            .to_be_bytes();
        let mut moved: Vec<(usize, IVec, IVec)> = Vec::new();
        let read = sled_err("reading a quarantined record");
        // Tree indices as in the transaction below.
        if cid.len() == 32 {
            for entry in space.log.tree.scan_prefix(cid) {
                let (key, blob) = entry.map_err(&read)?;
                moved.push((2, key, blob));
            }
        }
        for (index, place) in [(1, &space.snapshots), (0, &space.names)] {
            if let Some(blob) = place.tree.get(cid).map_err(&read)? {
                moved.push((index, IVec::from(cid), blob));
            }
        }
        if moved.is_empty() {
            return Ok(0);
        }
        let tags = [b'n', b's', b'l'];
        [
            &space.names.tree,
            &space.snapshots.tree,
            &space.log.tree,
            &space.quarantine.tree,
        ]
        .transaction(|tx| {
            for (index, key, blob) in &moved {
                let mut qkey = move_id.to_vec();
                qkey.push(tags[*index]);
                qkey.extend_from_slice(key);
                tx[3].insert(qkey, blob.clone())?;
                tx[*index].remove(key.clone())?;
            }
            Ok::<_, ConflictableTransactionError<Infallible>>(())
        })
        .map_err(tx_err("moving records to the quarantine"))?;
        self.flush()?;
        if let Ok(id) = ContainerId::try_from(cid) {
            writer.positions.remove(&id);
        }
        tracing::warn!(container_id = %hex_id(cid), records = moved.len(), "records moved to the quarantine");
        Ok(moved.len() as u64)
    }

    fn container_id(&self, name: &str) -> ContainerId {
        self.key.opaque_id(CONTAINER_ID_DOMAIN, name.as_bytes())
    }

    fn lock_writer(&self) -> MutexGuard<'_, Writer> {
        // Nothing panics while the lock is held, so a poisoned lock still guards a consistent
        // cache; recover it rather than spreading the panic.
        self.writer.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Reads a container's names record and returns its `covers`, or `None` if the
    /// container does not exist. Checks that the record is really `expected`'s.
    fn read_name_record(
        &self,
        space: &Space,
        cid: &ContainerId,
        expected: &str,
    ) -> Result<Option<u64>, StoreError> {
        let Some(blob) = space
            .names
            .tree
            .get(cid)
            .map_err(sled_err("reading a container name"))?
        else {
            return Ok(None);
        };
        let plain = space.names.open_record(&self.key, cid, &blob)?;
        let (covers, name) = split_covers(NAMES, &plain)?;
        if name != expected.as_bytes() {
            return Err(corrupt(
                NAMES,
                "the name record belongs to another container",
            ));
        }
        Ok(Some(covers))
    }

    /// The container's position, from the cache or, on first use, from disk. A container
    /// whose namespace has no trees (`space` is `None`) was never written.
    fn position(
        &self,
        cache: &mut BTreeMap<ContainerId, Position>,
        space: Option<&Space>,
        cid: &ContainerId,
        name: &str,
    ) -> Result<Position, StoreError> {
        if let Some(position) = cache.get(cid) {
            return Ok(*position);
        }
        let Some(space) = space else {
            return Ok(Position::NEW);
        };
        let position = match self.read_name_record(space, cid, name)? {
            None => Position::NEW,
            Some(covers) => {
                let last_logged = space
                    .log
                    .tree
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

    fn name_record(
        &self,
        space: &Space,
        cid: &ContainerId,
        covers: u64,
        name: &str,
    ) -> Result<IVec, StoreError> {
        let mut plain = Vec::with_capacity(8 + name.len());
        plain.extend_from_slice(&covers.to_be_bytes());
        plain.extend_from_slice(name.as_bytes());
        space.names.seal(&self.key, cid, &plain)
    }

    /// The names of the containers in `space`, each as read or as the reason it could not
    /// be, with its key.
    fn names_in(space: &Space, key: &AtRestKey) -> Result<Vec<NameEntry>, StoreError> {
        let mut out = Vec::new();
        for entry in space.names.tree.iter() {
            let (cid, blob) = entry.map_err(sled_err("listing containers"))?;
            let name = space.names.open_record(key, &cid, &blob).and_then(|plain| {
                let (_, name) = split_covers(NAMES, &plain)?;
                String::from_utf8(name.to_vec())
                    .map_err(|_| corrupt(NAMES, "a container name is not UTF-8"))
            });
            out.push((cid, name));
        }
        Ok(out)
    }
}

/// A names record's key and the container name it holds, or why it cannot be read.
type NameEntry = (IVec, Result<String, StoreError>);

impl Storage for SledStore {
    fn append_changes(&self, container: &str, changes: &[Vec<u8>]) -> Result<u64, StoreError> {
        let seqs = self.append_many_with_meta(&[(container, changes)], &[])?;
        seqs.first()
            .copied()
            .ok_or_else(|| corrupt(LOG, "a group commit of one batch returned no sequence"))
    }

    fn append_many(&self, batches: &[(&str, &[Vec<u8>])]) -> Result<Vec<u64>, StoreError> {
        self.append_many_with_meta(batches, &[])
    }

    fn append_many_with_meta(
        &self,
        batches: &[(&str, &[Vec<u8>])],
        meta: &[(String, Vec<u8>)],
    ) -> Result<Vec<u64>, StoreError> {
        let (seqs, wrote) = self.append_unflushed(batches, meta)?;
        // Flush after releasing the lock so that concurrent appends share flushes.
        if wrote {
            self.flush()?;
        }
        Ok(seqs)
    }

    fn save_snapshot(
        &self,
        container: &str,
        snapshot: &[u8],
        covers_changes: u64,
    ) -> Result<(), StoreError> {
        check_snapshot_size(container, snapshot)?;
        let cid = self.container_id(container);
        let mut guard = self.lock_writer();
        let writer = &mut *guard;
        let namespace = namespace_of(container);
        let space = writer.spaces.get(&self.db, &self.key, namespace, false)?;
        let position = self.position(&mut writer.positions, space.as_deref(), &cid, container)?;
        check_snapshot_seq(
            container,
            covers_changes,
            position.covers,
            position.last_seq,
        )?;
        // A snapshot covering nothing may create the container, and so its namespace.
        let space = match space {
            Some(space) => space,
            None => writer
                .spaces
                .get(&self.db, &self.key, namespace, true)?
                .ok_or_else(|| corrupt(NAMES, "a namespace created for a snapshot is missing"))?,
        };
        let covered: Vec<IVec> = space
            .log
            .tree
            .range(log_key(&cid, 0)..=log_key(&cid, covers_changes))
            .keys()
            .collect::<Result<_, _>>()
            .map_err(sled_err("reading the change log"))?;
        let name_record = self.name_record(&space, &cid, covers_changes, container)?;
        let mut plain = Vec::with_capacity(8 + snapshot.len());
        plain.extend_from_slice(&covers_changes.to_be_bytes());
        plain.extend_from_slice(snapshot);
        let snapshot_record = space.snapshots.seal(&self.key, &cid, &plain)?;
        drop(plain);
        (&space.names.tree, &space.snapshots.tree, &space.log.tree)
            .transaction(|(names, snapshots, log)| {
                names.insert(&cid[..], name_record.clone())?;
                snapshots.insert(&cid[..], snapshot_record.clone())?;
                for key in &covered {
                    log.remove(key.clone())?;
                }
                Ok::<_, ConflictableTransactionError<Infallible>>(())
            })
            .map_err(tx_err("saving a snapshot"))?;
        writer.positions.insert(
            cid,
            Position {
                exists: true,
                covers: covers_changes,
                last_seq: position.last_seq,
            },
        );
        drop(guard);
        self.flush()
    }

    fn load_container(&self, container: &str) -> Result<Option<ContainerRecord>, StoreError> {
        check_container_name(container)?;
        let cid = self.container_id(container);
        // Hold the writer lock so that no compaction runs between reading the snapshot and
        // reading the log.
        let mut writer = self.lock_writer();
        let Some(space) = writer
            .spaces
            .get(&self.db, &self.key, namespace_of(container), false)?
        else {
            return Ok(None);
        };
        let Some(covers) = self.read_name_record(&space, &cid, container)? else {
            return Ok(None);
        };
        let snapshot = match space
            .snapshots
            .tree
            .get(cid)
            .map_err(sled_err("reading a snapshot"))?
        {
            None if covers == 0 => None,
            None => return Err(corrupt(NAMES, "a snapshot is recorded but missing")),
            Some(blob) => {
                let mut plain = space.snapshots.open_record(&self.key, &cid, &blob)?;
                let (snapshot_covers, _) = split_covers(SNAPSHOTS, &plain)?;
                if snapshot_covers != covers {
                    return Err(corrupt(SNAPSHOTS, "snapshot and name record disagree"));
                }
                plain.drain(..8);
                Some(plain)
            }
        };
        let mut changes = Vec::new();
        let mut last_seq = covers;
        for entry in space.log.tree.scan_prefix(cid) {
            let (key, blob) = entry.map_err(sled_err("reading the change log"))?;
            let seq = log_seq(&key)?;
            if seq <= covers {
                // Covered by the snapshot; compaction removes these, but never rely on it.
                continue;
            }
            if seq != last_seq + 1 {
                return Err(StoreError::Corrupt {
                    tree: LOG,
                    reason: format!(
                        "the change log of {container:?} jumps from {last_seq} to {seq}"
                    ),
                });
            }
            changes.push(space.log.open_record(&self.key, &key, &blob)?);
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
        let mut guard = self.lock_writer();
        let writer = &mut *guard;
        let Some(space) = writer
            .spaces
            .get(&self.db, &self.key, namespace_of(container), false)?
        else {
            return Ok(0);
        };
        self.quarantine_id(writer, &space, &cid)
    }

    fn list_containers_quarantining(&self) -> Result<(Vec<String>, Vec<Quarantined>), StoreError> {
        let spaces = self.lock_writer().spaces.all();
        let mut names = Vec::new();
        let mut moved = Vec::new();
        for space in &spaces {
            let mut bad = Vec::new();
            for (cid, name) in Self::names_in(space, &self.key)? {
                match name {
                    Ok(name) => names.push(name),
                    Err(e) => bad.push((cid, e.to_string())),
                }
            }
            for (cid, reason) in bad {
                let records = self.quarantine_id(&mut self.lock_writer(), space, &cid)?;
                moved.push(Quarantined {
                    id: hex_id(&cid),
                    reason,
                    records,
                });
            }
        }
        names.sort();
        Ok((names, moved))
    }

    fn list_containers(&self) -> Result<Vec<String>, StoreError> {
        let spaces = self.lock_writer().spaces.all();
        let mut names = Vec::new();
        for space in &spaces {
            for (_, name) in Self::names_in(space, &self.key)? {
                names.push(name?);
            }
        }
        names.sort();
        Ok(names)
    }

    fn put_meta(&self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        check_meta(key, Some(value))?;
        let id = self.key.opaque_id(META_ID_DOMAIN, key.as_bytes());
        let blob = self.meta.seal(&self.key, &id, value)?;
        self.meta
            .tree
            .insert(id, blob)
            .map_err(sled_err("writing metadata"))?;
        self.flush()
    }

    fn get_meta(&self, key: &str) -> Result<Option<Vec<u8>>, StoreError> {
        check_meta(key, None)?;
        let id = self.key.opaque_id(META_ID_DOMAIN, key.as_bytes());
        let Some(blob) = self
            .meta
            .tree
            .get(id)
            .map_err(sled_err("reading metadata"))?
        else {
            return Ok(None);
        };
        Ok(Some(self.meta.open_record(&self.key, &id, &blob)?))
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
        .ok_or_else(|| corrupt(LOG, "a log key is not 40 bytes"))?;
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

#[cfg(test)]
mod tests {
    use super::*;

    // Goal: the cache of namespaces' trees is bounded: a write that would open namespace
    // MAX_NAMESPACES + 1 is refused with a typed error and writes nothing, while namespaces
    // that exist still take writes; method: fill the cache to the limit with stand-ins for
    // namespaces on disk (creating 16k sled trees would only be slower), then write.
    #[test]
    fn a_namespace_beyond_the_limit_is_refused() {
        let dir = tempfile::tempdir().expect("tempdir");
        let store = SledStore::open(dir.path(), AtRestKey::from_bytes([9; 32])).expect("open");
        store
            .append_changes("notes", &[b"1".to_vec()])
            .expect("first namespace");
        {
            let mut writer = store.lock_writer();
            let stand_in = writer.spaces.all().pop().expect("one namespace");
            for i in writer.spaces.by_id.len()..MAX_NAMESPACES {
                writer
                    .spaces
                    .by_id
                    .insert(format!("stand-in {i}"), Arc::clone(&stand_in));
            }
        }
        let trees_before = store.db.tree_names().len();
        let got = store.append_many(&[
            ("more-notes", &[b"2".to_vec()]),
            ("did:nuwa:cap:new:state:X#v1", &[b"x".to_vec()]),
        ]);
        assert!(
            matches!(
                &got,
                Err(StoreError::TooManyNamespaces { namespace, max: MAX_NAMESPACES })
                    if namespace == "did:nuwa:cap:new:"
            ),
            "{got:?}"
        );
        assert_eq!(store.db.tree_names().len(), trees_before);
        assert_eq!(store.load_container("more-notes").expect("load"), None);
        assert_eq!(
            store
                .append_changes("more-notes", &[b"2".to_vec()])
                .expect("an existing namespace"),
            1
        );
    }
}
