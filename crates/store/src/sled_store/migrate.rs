//! Moving a v1 store, whose namespaces share the trees `names`, `snapshots`, `log` and
//! `quarantine`, into the per-namespace layout; run by [`SledStore::open`] before it
//! returns, so nothing else writes meanwhile.
//!
//! # Procedure
//!
//! 1. The marker becomes `nuwa-store-v1-migrating` and is flushed, so a binary from before
//!    the migration refuses the store from now on instead of writing into a half-moved one.
//! 2. Containers, one step each, while the v1 `names` tree holds a record: the record is
//!    opened to learn the container's name and so its namespace ([`namespace_of`]); then its
//!    name record, its snapshot and every log entry are each opened under their v1 tree and
//!    sealed again for the namespace's tree under the same key, inserted there and removed
//!    from the v1 tree, **in one transaction**.
//! 3. Orphans, one step per container id: log entries and snapshots left without a name
//!    record (v1's quarantine removed the name first, so a crash there could leave them;
//!    v1 never read them) go to the default namespace's quarantine, as they were.
//! 4. Quarantined records, one step per quarantine (per move id): they go to the quarantine
//!    of the namespace their name record gives, or the default one when it does not open,
//!    **as they were**, not sealed again (they are kept as evidence, and many of them do not
//!    open), under an upper-case tag (`N`, `S`, `L`) that says they are still sealed for
//!    the v1 tree.
//! 5. Everything is flushed, then the marker becomes `nuwa-store-v2` and is flushed, then the
//!    empty v1 trees are dropped.
//!
//! A record that does not open under its v1 tree is carried over byte for byte, so it does
//! not open in its new tree either and the store reports it exactly as before: a container
//! with such a log entry fails to load, and one whose name record does not open (its
//! namespace unknown) lands in the default namespace, where
//! [`Storage::list_containers_quarantining`](crate::Storage::list_containers_quarantining)
//! moves it aside and reports it, as it did in v1.
//!
//! # Why a crash loses nothing
//!
//! Each step is one sled transaction that writes records to their new trees and removes
//! them from the v1 trees, and sled recovers a transaction wholly or not at all. So after a
//! crash at any instant, every record is in exactly one place, its v1 tree or its new one,
//! with its plaintext unchanged. The marker cannot say `nuwa-store-v2` before every step is
//! flushed, so the next open sees `nuwa-store-v1` or `nuwa-store-v1-migrating` and runs the
//! procedure again on whatever the v1 trees still hold. Every step derives its destination
//! from the records it moves (never from a cursor or a count kept elsewhere), so the result
//! does not depend on where the crash fell. Namespace trees created by a step that did not
//! commit stay empty, which every reader treats as "no containers". A step holds one
//! container (or one quarantine) in memory, as loading it would.

use std::convert::Infallible;
use std::sync::Arc;

use nuwa_crypto::AtRestKey;
use sled::IVec;
use sled::transaction::{ConflictableTransactionError, Transactional};

use super::{
    LOG, MARKER_MIGRATING, MARKER_V2, NAMES, Place, QUARANTINE, SNAPSHOTS, Space, Spaces, sled_err,
    split_covers, tx_err, write_marker,
};
use crate::{DEFAULT_NAMESPACE, StoreError, namespace_of};

/// Bytes of a quarantine's move id at the start of its keys.
const MOVE_ID_BYTES: usize = 8;
/// Bytes of a container id at the start of its keys.
const CID_BYTES: usize = 32;

/// The shared trees of a v1 store, whose names are also what their records are sealed
/// under.
struct V1 {
    names: Place,
    snapshots: Place,
    log: Place,
    quarantine: Place,
}

/// What one step of the migration moves.
enum Step {
    /// A container: its name record's key and value.
    Container(IVec, IVec),
    /// Records without a name record, under this container id.
    Orphans(Vec<u8>),
    /// A v1 quarantine: its move id.
    Quarantine(Vec<u8>),
}

/// Migrates the v1 store in `db` (see the module docs), or goes on with a migration that
/// stopped. Does at most `max_steps` steps; returns whether it finished (only tests stop
/// early, to stand for a crash).
pub(super) fn run(
    db: &sled::Db,
    key: &AtRestKey,
    meta: &Place,
    spaces: &mut Spaces,
    max_steps: usize,
) -> Result<bool, StoreError> {
    write_marker(meta, key, MARKER_MIGRATING)?;
    db.flush().map_err(sled_err("flushing to disk"))?;
    let open = |name: &'static str| {
        Place::open(db, name.to_owned(), name).map_err(sled_err("opening a v1 tree"))
    };
    let v1 = V1 {
        names: open(NAMES)?,
        snapshots: open(SNAPSHOTS)?,
        log: open(LOG)?,
        quarantine: open(QUARANTINE)?,
    };
    let first = |place: &Place| place.tree.first().map_err(sled_err("reading a v1 tree"));
    // Each step removes at least the record that chose it, so the loop ends.
    for step in 0.. {
        let next = if let Some((cid, blob)) = first(&v1.names)? {
            Step::Container(cid, blob)
        } else if let Some((record, _)) = first(&v1.log)? {
            Step::Orphans(prefix(&record, CID_BYTES))
        } else if let Some((record, _)) = first(&v1.snapshots)? {
            Step::Orphans(prefix(&record, CID_BYTES))
        } else if let Some((record, _)) = first(&v1.quarantine)? {
            Step::Quarantine(prefix(&record, MOVE_ID_BYTES))
        } else {
            break;
        };
        if step == max_steps {
            return Ok(false);
        }
        match next {
            Step::Container(cid, blob) => move_container(db, key, spaces, &v1, &cid, &blob)?,
            Step::Orphans(cid) => move_orphans(db, key, spaces, &v1, cid)?,
            Step::Quarantine(move_id) => move_quarantine(db, key, spaces, &v1, move_id)?,
        }
    }
    db.flush().map_err(sled_err("flushing to disk"))?;
    write_marker(meta, key, MARKER_V2)?;
    db.flush().map_err(sled_err("flushing to disk"))?;
    drop(v1);
    drop_empty_v1_trees(db)?;
    Ok(true)
}

/// Drops the v1 trees once they are empty (a crash can leave them between the marker and
/// the drop). One that still holds records is left alone and reported: nothing here
/// deletes data.
pub(super) fn drop_empty_v1_trees(db: &sled::Db) -> Result<(), StoreError> {
    let present = db.tree_names();
    for name in [NAMES, SNAPSHOTS, LOG, QUARANTINE] {
        if !present.iter().any(|p| p.as_ref() == name.as_bytes()) {
            continue;
        }
        let tree = db.open_tree(name).map_err(sled_err("opening a v1 tree"))?;
        if tree.is_empty() {
            drop(tree);
            db.drop_tree(name).map_err(sled_err("dropping a v1 tree"))?;
        } else {
            tracing::warn!(
                tree = name,
                records = tree.len(),
                "a tree of the v1 layout still holds records after the migration; left as it is"
            );
        }
    }
    Ok(())
}

/// The first `len` bytes of `key`, or all of it when shorter (only a damaged key is).
fn prefix(key: &[u8], len: usize) -> Vec<u8> {
    key[..key.len().min(len)].to_vec()
}

/// The trees of `namespace`, created if needed.
fn space(
    db: &sled::Db,
    key: &AtRestKey,
    spaces: &mut Spaces,
    namespace: &str,
) -> Result<Arc<Space>, StoreError> {
    spaces.get(db, key, namespace, true)?.ok_or_else(|| {
        super::corrupt(
            NAMES,
            "a namespace created during the migration has no trees",
        )
    })
}

/// The container name in a v1 name record, if it opens and holds one.
fn v1_name(key: &AtRestKey, v1: &V1, cid: &[u8], blob: &[u8]) -> Option<String> {
    let plain = v1.names.open_record(key, cid, blob).ok()?;
    let (_, name) = split_covers(NAMES, &plain).ok()?;
    String::from_utf8(name.to_vec()).ok()
}

/// `blob`, found under `record` in `from`, as it must be stored under the same key in `to`:
/// sealed again if it opens, as it is if it does not.
fn carry(
    key: &AtRestKey,
    from: &Place,
    to: &Place,
    record: &[u8],
    blob: &IVec,
) -> Result<IVec, StoreError> {
    match from.open_record(key, record, blob) {
        Ok(plain) => to.seal(key, record, &plain),
        Err(_) => Ok(blob.clone()),
    }
}

/// Step 2: one container's records into its namespace's trees.
fn move_container(
    db: &sled::Db,
    key: &AtRestKey,
    spaces: &mut Spaces,
    v1: &V1,
    cid: &IVec,
    name_blob: &IVec,
) -> Result<(), StoreError> {
    let name = v1_name(key, v1, cid, name_blob);
    let namespace = name.as_deref().map_or(DEFAULT_NAMESPACE, namespace_of);
    let space = space(db, key, spaces, namespace)?;
    let read = sled_err("reading a v1 tree");
    // (tree index as in the transaction below, key, new value)
    let mut moves: Vec<(usize, IVec, IVec)> = Vec::new();
    moves.push((
        0,
        cid.clone(),
        carry(key, &v1.names, &space.names, cid, name_blob)?,
    ));
    if let Some(blob) = v1.snapshots.tree.get(cid).map_err(&read)? {
        let value = carry(key, &v1.snapshots, &space.snapshots, cid, &blob)?;
        moves.push((1, cid.clone(), value));
    }
    // Only a 32-byte id owns log entries (`cid ‖ seq`); a damaged shorter key must not
    // sweep up the entries of every container it is a prefix of.
    if cid.len() == CID_BYTES {
        for entry in v1.log.tree.scan_prefix(cid) {
            let (record, blob) = entry.map_err(&read)?;
            let value = carry(key, &v1.log, &space.log, &record, &blob)?;
            moves.push((2, record, value));
        }
    }
    [
        &v1.names.tree,
        &v1.snapshots.tree,
        &v1.log.tree,
        &space.names.tree,
        &space.snapshots.tree,
        &space.log.tree,
    ]
    .transaction(|tx| {
        for (index, record, value) in &moves {
            tx[3 + index].insert(record.clone(), value.clone())?;
            tx[*index].remove(record.clone())?;
        }
        Ok::<_, ConflictableTransactionError<Infallible>>(())
    })
    .map_err(tx_err("migrating a container"))?;
    tracing::debug!(
        records = moves.len(),
        known_name = name.is_some(),
        "migrated a container"
    );
    Ok(())
}

/// Step 3: log entries and snapshots under `cid` with no name record, into the default
/// namespace's quarantine as they were.
fn move_orphans(
    db: &sled::Db,
    key: &AtRestKey,
    spaces: &mut Spaces,
    v1: &V1,
    cid: Vec<u8>,
) -> Result<(), StoreError> {
    let space = space(db, key, spaces, DEFAULT_NAMESPACE)?;
    let move_id = db
        .generate_id()
        .map_err(sled_err("numbering a quarantine"))?
        .to_be_bytes();
    let read = sled_err("reading a v1 tree");
    // (tree index as in the transaction below, key, value)
    let mut moves: Vec<(usize, IVec, IVec)> = Vec::new();
    for (index, place) in [(0, &v1.snapshots), (1, &v1.log)] {
        for entry in place.tree.scan_prefix(&cid) {
            let (record, blob) = entry.map_err(&read)?;
            moves.push((index, record, blob));
        }
    }
    let tags = [b'S', b'L'];
    [&v1.snapshots.tree, &v1.log.tree, &space.quarantine.tree]
        .transaction(|tx| {
            for (index, record, blob) in &moves {
                let mut qkey = move_id.to_vec();
                qkey.push(tags[*index]);
                qkey.extend_from_slice(record);
                tx[2].insert(qkey, blob.clone())?;
                tx[*index].remove(record.clone())?;
            }
            Ok::<_, ConflictableTransactionError<Infallible>>(())
        })
        .map_err(tx_err("migrating records without a name"))?;
    tracing::warn!(
        records = moves.len(),
        "v1 records without a name record moved to the quarantine"
    );
    Ok(())
}

/// Step 4: the records of one v1 quarantine, into the quarantine of their namespace as
/// they were.
fn move_quarantine(
    db: &sled::Db,
    key: &AtRestKey,
    spaces: &mut Spaces,
    v1: &V1,
    move_id: Vec<u8>,
) -> Result<(), StoreError> {
    let group: Vec<(IVec, IVec)> = v1
        .quarantine
        .tree
        .scan_prefix(&move_id)
        .collect::<Result<_, _>>()
        .map_err(sled_err("reading a v1 tree"))?;
    let name = group.iter().find_map(|(qkey, blob)| {
        let rest = qkey.get(MOVE_ID_BYTES..)?;
        let (&tag, cid) = rest.split_first()?;
        (tag == b'n').then(|| v1_name(key, v1, cid, blob)).flatten()
    });
    let namespace = name.as_deref().map_or(DEFAULT_NAMESPACE, namespace_of);
    let space = space(db, key, spaces, namespace)?;
    let moves: Vec<(IVec, IVec, IVec)> = group
        .into_iter()
        .map(|(qkey, blob)| {
            let mut new_key = qkey.to_vec();
            if let Some(tag) = new_key.get_mut(MOVE_ID_BYTES) {
                *tag = tag.to_ascii_uppercase();
            }
            (qkey, IVec::from(new_key), blob)
        })
        .collect();
    [&v1.quarantine.tree, &space.quarantine.tree]
        .transaction(|tx| {
            for (old, new, blob) in &moves {
                tx[1].insert(new.clone(), blob.clone())?;
                tx[0].remove(old.clone())?;
            }
            Ok::<_, ConflictableTransactionError<Infallible>>(())
        })
        .map_err(tx_err("migrating the quarantine"))?;
    tracing::debug!(records = moves.len(), "migrated a quarantine");
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::path::{Path, PathBuf};

    use super::*;
    use crate::sled_store::{META_TREE, SledStore, open_db, space_id};
    use crate::{ContainerRecord, Storage};

    /// The fixture's key and content: see `tests/fixtures/store-v1/README.md`.
    const KEY: [u8; 32] = [0x42; 32];
    const CONTAINERS: [(&str, u64, u64); 11] = [
        ("did:nuwa:core:MemoryStore#v1", 5, 3),
        ("did:nuwa:core:ConversationLog#v1", 3, 0),
        ("did:nuwa:cap:note@1.0.0:state:Note#v2", 4, 4),
        ("did:nuwa:cap:todo:state:Item#v1", 2, 0),
        ("did:nuwa:app:my-app:state:Board_1#v10", 2, 1),
        ("did:nuwa:user:z6MkAbc:state:Todo#v4", 3, 1),
        ("did:nuwa:state:note#v1", 1, 0),
        ("did:nuwa:cap:broken", 1, 0),
        ("nuwa:schemas", 2, 0),
        ("notes", 4, 2),
        ("other", 1, 0),
    ];
    const QUARANTINED: &str = "quarantined-one";
    /// Steps to migrate the fixture: one per container, one for its one quarantine.
    const FIXTURE_STEPS: usize = CONTAINERS.len() + 2;

    fn change(container: &str, seq: u64) -> Vec<u8> {
        match (container, seq) {
            ("other", 1) => Vec::new(),
            ("notes", 2) => {
                let mut b = format!("{container} change {seq}").into_bytes();
                b.resize(20_000, b'.');
                b
            }
            _ => format!("{container} change {seq}").into_bytes(),
        }
    }

    /// What the fixture's containers hold, as `load_container` must return it.
    fn expected() -> BTreeMap<String, ContainerRecord> {
        let mut out: BTreeMap<String, ContainerRecord> = CONTAINERS
            .iter()
            .map(|&(c, last_seq, covers)| {
                let record = ContainerRecord {
                    snapshot: (covers > 0)
                        .then(|| format!("{c} snapshot through {covers}").into_bytes()),
                    snapshot_covers: covers,
                    changes: (covers + 1..=last_seq).map(|seq| change(c, seq)).collect(),
                    last_seq,
                };
                (c.to_owned(), record)
            })
            .collect();
        out.insert(
            QUARANTINED.to_owned(),
            ContainerRecord {
                snapshot: None,
                snapshot_covers: 0,
                changes: vec![b"resynced 1".to_vec()],
                last_seq: 1,
            },
        );
        out
    }

    /// A copy of the v1 fixture in a fresh directory; returns the directory and the store
    /// path in it.
    fn fixture() -> (tempfile::TempDir, PathBuf) {
        let from = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/store-v1");
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("store");
        std::fs::create_dir(&path).expect("mkdir");
        for file in ["conf", "db"] {
            std::fs::copy(from.join(file), path.join(file)).expect("copy the fixture");
        }
        (dir, path)
    }

    fn key() -> AtRestKey {
        AtRestKey::from_bytes(KEY)
    }

    /// Runs the migration on the store in `path` for at most `steps` steps, as `open`
    /// would, and closes the database as a crash would leave it: unfinished.
    fn migrate_partly(path: &Path, steps: usize) -> bool {
        let db = open_db(path, None).expect("open db");
        let meta = Place::open(&db, META_TREE.to_owned(), META_TREE).expect("meta");
        let mut spaces = Spaces::on_disk(&db).expect("spaces");
        run(&db, &key(), &meta, &mut spaces, steps).expect("migration steps")
    }

    /// Every record of every tree, by tree name, read with sled.
    fn trees(path: &Path) -> BTreeMap<String, Vec<(IVec, IVec)>> {
        let db = open_db(path, None).expect("open db");
        db.tree_names()
            .into_iter()
            .map(|name| {
                let tree = db.open_tree(&name).expect("tree");
                let records = tree.iter().collect::<Result<_, _>>().expect("read");
                (String::from_utf8_lossy(&name).into_owned(), records)
            })
            .collect()
    }

    fn tree_name(namespace: &str, kind: &str) -> String {
        format!("ns/{}/{kind}", space_id(&key(), namespace))
    }

    /// Opens the store in `path` and checks that it holds exactly the fixture's content,
    /// each container in its namespace's trees and nothing left in the v1 trees.
    fn check_migrated(path: &Path) {
        {
            let s = SledStore::open(path, key()).expect("open migrates");
            let want = expected();
            assert_eq!(
                s.list_containers().expect("list"),
                want.keys().cloned().collect::<Vec<_>>()
            );
            for (name, record) in &want {
                assert_eq!(
                    s.load_container(name).expect("load").as_ref(),
                    Some(record),
                    "{name}"
                );
            }
            assert_eq!(s.get_meta("peer-id").expect("meta").unwrap(), b"12D3Koo");
            assert_eq!(s.get_meta("cursor").expect("meta").unwrap(), b"c1");
        }
        let trees = trees(path);
        for v1 in [NAMES, SNAPSHOTS, LOG, QUARANTINE] {
            assert!(!trees.contains_key(v1), "v1 tree {v1} is still there");
        }
        for (name, ..) in CONTAINERS {
            let cid = key().opaque_id("container", name.as_bytes());
            let names = &trees[&tree_name(namespace_of(name), NAMES)];
            assert!(names.iter().any(|(k, _)| k == &cid[..]), "{name}");
        }
        // The one v1 quarantine (name, snapshot, changes 2 and 3 of `quarantined-one`) is in
        // the default namespace's quarantine, still sealed for the v1 trees.
        let quarantine = &trees[&tree_name(DEFAULT_NAMESPACE, QUARANTINE)];
        let tags: Vec<u8> = quarantine.iter().map(|(k, _)| k[MOVE_ID_BYTES]).collect();
        assert_eq!(tags, b"LLNS");
        let (qkey, blob) = &quarantine[2];
        let aad = crate::sled_store::aad(NAMES, &qkey[MOVE_ID_BYTES + 1..]);
        let plain = key()
            .open(&aad, blob)
            .expect("the quarantined v1 name record still opens as v1");
        assert_eq!(&plain[8..], QUARANTINED.as_bytes());
    }

    // Goal: a store written by the v1 code opens, and every container, snapshot, change,
    // metadata record and quarantined record is there after the migration, each in its
    // namespace's trees; method: open a copy of the fixture and compare with its README.
    #[test]
    fn a_v1_store_migrates_with_nothing_lost() {
        let (_dir, path) = fixture();
        check_migrated(&path);
        // A second open finds nothing to do and changes nothing.
        let before = trees(&path);
        check_migrated(&path);
        let after = trees(&path);
        assert_eq!(
            before.keys().collect::<Vec<_>>(),
            after.keys().collect::<Vec<_>>()
        );
        for (name, records) in &before {
            assert!(
                records == &after[name],
                "tree {name} changed on a second open"
            );
        }
        // Sequence numbers carry on.
        let s = SledStore::open(&path, key()).expect("open");
        assert_eq!(
            s.append_changes("notes", &[b"5".to_vec()]).expect("append"),
            5
        );
    }

    // Goal: a migration stopped after any number of steps (as by a crash) and reopened ends
    // with the same content as one run without stopping, and twice stopped too; method:
    // for every k, migrate a fresh copy of the fixture k steps, reopen, and compare every
    // container with the original and the quarantine with an unstopped run's.
    #[test]
    fn a_migration_stopped_at_any_step_finishes_the_same() {
        let (_dir, path) = fixture();
        check_migrated(&path);
        let unstopped = trees(&path);
        for k in 0..=FIXTURE_STEPS {
            for again in [None, Some(1)] {
                let (_dir, path) = fixture();
                let finished = migrate_partly(&path, k);
                assert_eq!(finished, k == FIXTURE_STEPS, "k={k}");
                if let Some(more) = again {
                    migrate_partly(&path, more);
                }
                check_migrated(&path);
                // Quarantined records are moved as they were, so they match byte for byte;
                // live records are sealed again with fresh nonces, so compare their keys.
                let got = trees(&path);
                assert_eq!(
                    got.keys().collect::<Vec<_>>(),
                    unstopped.keys().collect::<Vec<_>>(),
                    "k={k}"
                );
                for (name, records) in &unstopped {
                    let keys = |r: &Vec<(IVec, IVec)>| {
                        r.iter().map(|(k, _)| k.clone()).collect::<Vec<_>>()
                    };
                    assert_eq!(keys(&got[name]), keys(records), "k={k} tree {name}");
                    if name.ends_with(QUARANTINE) {
                        assert!(got[name] == *records, "k={k} tree {name}");
                    }
                }
            }
        }
    }

    // Goal: a v1 record that does not open is neither lost nor trusted after the migration:
    // a damaged change still fails its container's load, a damaged name record is listed
    // away and reported, and log entries without a name go to the quarantine; method: damage
    // a copy of the fixture with raw sled, migrate, and look.
    #[test]
    fn damaged_v1_records_fail_as_before() {
        let (_dir, path) = fixture();
        let memory = "did:nuwa:core:MemoryStore#v1";
        let memory_id = key().opaque_id("container", memory.as_bytes());
        let other_id = key().opaque_id("container", b"other");
        let orphan = [7u8; 40];
        {
            let db = open_db(&path, None).expect("open db");
            let flip = |tree: &str, record: &[u8]| {
                let tree = db.open_tree(tree).unwrap();
                let mut blob = tree.get(record).unwrap().expect("record").to_vec();
                blob[30] ^= 1;
                tree.insert(record, blob).unwrap();
            };
            let mut log_key = memory_id.to_vec();
            log_key.extend_from_slice(&5u64.to_be_bytes());
            flip(LOG, &log_key);
            flip(NAMES, &other_id);
            db.open_tree(LOG)
                .unwrap()
                .insert(orphan, &b"orphan"[..])
                .unwrap();
            db.flush().unwrap();
        }
        {
            let s = SledStore::open(&path, key()).expect("open migrates");
            let got = s.load_container(memory);
            assert!(
                matches!(got, Err(StoreError::Decrypt { tree: "log", .. })),
                "{got:?}"
            );
            let (names, moved) = s.list_containers_quarantining().expect("list");
            assert!(!names.iter().any(|n| n == "other"), "{names:?}");
            assert_eq!(names.len(), expected().len() - 1);
            assert_eq!(moved.len(), 1, "{moved:?}");
            assert_eq!(moved[0].id, crate::sled_store::hex_id(&other_id));
            assert_eq!(moved[0].records, 2, "other's name and its one change");
        }
        let trees = trees(&path);
        let quarantine = &trees[&tree_name(DEFAULT_NAMESPACE, QUARANTINE)];
        assert!(
            quarantine.iter().any(|(k, v)| k[MOVE_ID_BYTES] == b'L'
                && k[MOVE_ID_BYTES + 1..] == orphan[..]
                && v == b"orphan"),
            "the orphan is in the quarantine"
        );
    }
}
