//! SledStore specifics: persistence across reopen, wrong keys, nothing readable on disk,
//! refusal of records moved or altered on disk, and each namespace in trees of its own.

use std::collections::BTreeMap;
use std::path::Path;

use nuwa_crypto::AtRestKey;
use nuwa_store::{SledStore, Storage, StoreError};

const KEY: [u8; 32] = [0x42; 32];

fn open(path: &Path) -> SledStore {
    SledStore::open(path, AtRestKey::from_bytes(KEY)).expect("open")
}

/// Opens the database with raw sled, as an attacker with the files would.
/// A `SledStore` just dropped releases sled's file lock only when sled's
/// background flusher lets go, so wait for it (bounded) rather than race.
fn raw_open(path: &Path) -> sled::Db {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        match sled::open(path) {
            Err(sled::Error::Io(e))
                if e.to_string().contains("could not acquire lock")
                    && std::time::Instant::now() < deadline =>
            {
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
            other => return other.expect("raw open"),
        }
    }
}

/// The sled tree of `kind` (`names`, `snapshots`, `log`, `quarantine`) of `namespace` in a
/// store under `KEY`: `ns/` and the first 16 bytes of the namespace's opaque id in hex.
fn namespace_tree(namespace: &str, kind: &str) -> String {
    let id = AtRestKey::from_bytes(KEY).opaque_id("namespace", namespace.as_bytes());
    let hex: String = id[..16].iter().map(|b| format!("{b:02x}")).collect();
    format!("ns/{hex}/{kind}")
}

/// Every tree of the database in `path` with every record, read with raw sled.
type Trees = BTreeMap<String, Vec<(Vec<u8>, Vec<u8>)>>;

fn all_trees(path: &Path) -> Trees {
    let db = raw_open(path);
    let mut out = BTreeMap::new();
    for name in db.tree_names() {
        let tree = db.open_tree(&name).expect("open tree");
        let records = tree
            .iter()
            .map(|r| r.map(|(k, v)| (k.to_vec(), v.to_vec())))
            .collect::<Result<_, _>>()
            .expect("read tree");
        out.insert(String::from_utf8_lossy(&name).into_owned(), records);
    }
    out
}

/// Every file under `dir` that contains `needle`, read byte for byte.
fn files_containing(dir: &Path, needle: &[u8]) -> Vec<String> {
    let mut found = Vec::new();
    let mut pending = vec![dir.to_owned()];
    while let Some(path) = pending.pop() {
        if path.is_dir() {
            for entry in std::fs::read_dir(&path).expect("read_dir") {
                pending.push(entry.expect("dir entry").path());
            }
        } else {
            let bytes = std::fs::read(&path).expect("read file");
            if bytes.windows(needle.len()).any(|w| w == needle) {
                found.push(path.display().to_string());
            }
        }
    }
    found
}

// Goal: everything written survives dropping and reopening the store; method: write data of
// every kind, drop, reopen twice and compare.
#[test]
fn reopen_keeps_everything() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("db");
    let before = {
        let s = open(&path);
        s.append_changes("memory", &[b"m1".to_vec(), b"m2".to_vec()])
            .expect("append");
        s.save_snapshot("memory", b"snap", 1).expect("snapshot");
        s.append_changes("memory", &[b"m3".to_vec()])
            .expect("append");
        s.append_changes("settings", &[b"s1".to_vec()])
            .expect("append");
        s.put_meta("peer-id", b"12D3Koo").expect("meta");
        (
            s.load_container("memory").expect("load"),
            s.load_container("settings").expect("load"),
        )
    };
    for _ in 0..2 {
        let s = open(&path);
        assert_eq!(s.list_containers().expect("list"), ["memory", "settings"]);
        assert_eq!(s.load_container("memory").expect("load"), before.0);
        assert_eq!(s.load_container("settings").expect("load"), before.1);
        assert_eq!(
            s.get_meta("peer-id").expect("meta").as_deref(),
            Some(&b"12D3Koo"[..])
        );
        // Sequence numbers carry on from disk after a restart.
        let memory = before.0.as_ref().expect("exists");
        let next = s.append_changes("memory", &[]).expect("empty append");
        assert_eq!(next, memory.last_seq);
    }
    let s = open(&path);
    assert_eq!(
        s.append_changes("memory", &[b"m4".to_vec()])
            .expect("append"),
        4
    );
}

// Goal: a wrong at-rest key is refused clearly at open, and the right one still works;
// method: create with one key, reopen with another, then with the first.
#[test]
fn wrong_key_fails_clearly() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("db");
    open(&path)
        .append_changes("c", &[b"x".to_vec()])
        .expect("append");
    let wrong = SledStore::open(&path, AtRestKey::from_bytes([0x43; 32]));
    match wrong {
        Err(StoreError::WrongKey { path: p }) => assert_eq!(p, path),
        other => panic!("expected WrongKey, got {other:?}"),
    }
    let message = SledStore::open(&path, AtRestKey::from_bytes([0; 32]))
        .expect_err("wrong key")
        .to_string();
    assert!(
        message.contains("at-rest key") && message.contains("use the key"),
        "{message}"
    );
    assert_eq!(
        open(&path)
            .load_container("c")
            .expect("load")
            .expect("exists")
            .changes,
        [b"x"]
    );
}

// Goal: no plaintext reaches the disk; method: use one unique marker as container name,
// change, snapshot, meta key and meta value, then search every byte of every file.
#[test]
fn nothing_in_plaintext_on_disk() {
    const MARKER: &str = "NUWA-CANARY-b7e1c0d9f3a2";
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("db");
    {
        let s = open(&path);
        let blob = format!("change {MARKER} change").into_bytes();
        s.append_changes(MARKER, &[blob.clone(), blob.clone()])
            .expect("append");
        s.save_snapshot(MARKER, format!("snapshot {MARKER}").as_bytes(), 1)
            .expect("snapshot");
        // The namespace `did:nuwa:cap:<MARKER>:` names trees: by its opaque id only.
        let in_namespace = format!("did:nuwa:cap:{MARKER}:state:X#v1");
        let one = [blob];
        s.append_many(&[(MARKER, &one), (&in_namespace, &one)])
            .expect("append");
        s.put_meta(MARKER, MARKER.as_bytes()).expect("meta");
        s.flush().expect("flush");
    }
    // Reopen too, so that recovery rewrites are covered.
    drop(open(&path));
    assert_eq!(
        files_containing(&path, MARKER.as_bytes()),
        Vec::<String>::new()
    );
    // A shorter piece of the marker, and the store's own marker plaintext, must not show up
    // either.
    assert_eq!(
        files_containing(&path, b"CANARY-b7e1"),
        Vec::<String>::new()
    );
    for marker in [&b"nuwa-store-v1"[..], b"nuwa-store-v2", b"did:nuwa:cap:"] {
        assert_eq!(files_containing(&path, marker), Vec::<String>::new());
    }

    // Control: the same search finds the marker when sled stores it unencrypted, so the
    // absence above is due to encryption and not to data missing from the files.
    let control = dir.path().join("control");
    {
        let db = raw_open(&control);
        db.insert(b"k", format!("xx{MARKER}yy").as_bytes())
            .expect("insert");
        db.flush().expect("flush");
    }
    assert!(!files_containing(&control, MARKER.as_bytes()).is_empty());
}

// Goal: a blob moved to another record key does not open, so records cannot be swapped on
// disk; method: swap two log values with raw sled, then load.
#[test]
fn swapped_records_are_refused() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("db");
    open(&path)
        .append_changes("c", &[b"first".to_vec(), b"second".to_vec()])
        .expect("append");
    {
        let db = raw_open(&path);
        let log = db
            .open_tree(namespace_tree("default", "log"))
            .expect("log tree");
        let entries: Vec<_> = log.iter().collect::<Result<_, _>>().expect("scan");
        assert_eq!(entries.len(), 2);
        log.insert(&entries[0].0, entries[1].1.clone())
            .expect("swap");
        log.insert(&entries[1].0, entries[0].1.clone())
            .expect("swap");
        db.flush().expect("flush");
    }
    let s = open(&path);
    assert!(
        matches!(
            s.load_container("c"),
            Err(StoreError::Decrypt { tree: "log", .. })
        ),
        "swapped blobs must not decrypt"
    );
}

// Goal: a log entry lost on disk is reported, not silently skipped; method: delete the
// middle entry with raw sled, then load.
#[test]
fn gap_in_log_is_reported() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("db");
    open(&path)
        .append_changes("c", &[b"1".to_vec(), b"2".to_vec(), b"3".to_vec()])
        .expect("append");
    {
        let db = raw_open(&path);
        let log = db
            .open_tree(namespace_tree("default", "log"))
            .expect("log tree");
        let middle = log.iter().nth(1).expect("three entries").expect("read").0;
        log.remove(middle).expect("remove");
        db.flush().expect("flush");
    }
    let got = open(&path).load_container("c");
    assert!(
        matches!(got, Err(StoreError::Corrupt { tree: "log", .. })),
        "{got:?}"
    );
}

// Goal: a database with data but no key marker is refused, not adopted; method: write a
// record with raw sled, then open it as a store.
#[test]
fn foreign_database_is_refused() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("db");
    {
        let db = raw_open(&path);
        db.open_tree("log")
            .expect("tree")
            .insert(b"k", b"v")
            .expect("insert");
        db.flush().expect("flush");
    }
    let got = SledStore::open(&path, AtRestKey::from_bytes(KEY));
    assert!(
        matches!(got, Err(StoreError::MissingMarker { .. })),
        "{got:?}"
    );
}

/// Containers of namespace A (one capability) and of five others.
const NS_A: &str = "did:nuwa:cap:a:";
const IN_A: [&str; 2] = ["did:nuwa:cap:a:state:X#v1", "did:nuwa:cap:a:state:Y#v1"];
const NOT_IN_A: [&str; 5] = [
    "did:nuwa:core:MemoryStore#v1",
    "did:nuwa:cap:b:state:X#v1",
    "did:nuwa:cap:ab:state:X#v1",
    "notes",
    "nuwa:schemas",
];

/// Asserts that between `before` and `after` only trees of namespace A changed, and that
/// some did.
fn only_a_changed(before: &Trees, after: &Trees, what: &str) {
    let a_prefix = namespace_tree(NS_A, "");
    let changed: Vec<&String> = before
        .keys()
        .chain(after.keys())
        .filter(|name| before.get(*name) != after.get(*name))
        .collect();
    assert!(!changed.is_empty(), "{what}: nothing changed on disk");
    for name in changed {
        assert!(
            name.starts_with(&a_prefix),
            "{what} in namespace A changed tree {name}, which is not A's"
        );
    }
}

// Goal: NIP-8's table isolation: compacting, quarantining, or listing away a damaged record
// in namespace A leaves every tree of every other namespace (and `meta`) byte for byte as
// it was; method: fill six namespaces through one group commit, then compare every record
// of every tree with raw sled before and after each operation on A.
#[test]
fn compacting_or_quarantining_one_namespace_leaves_the_others_untouched() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("db");
    {
        let s = open(&path);
        let batches: Vec<(&str, Vec<Vec<u8>>)> = IN_A
            .iter()
            .chain(&NOT_IN_A)
            .map(|c| (*c, vec![format!("{c} 1").into_bytes(), b"2".to_vec()]))
            .collect();
        let refs: Vec<(&str, &[Vec<u8>])> = batches.iter().map(|(c, v)| (*c, &v[..])).collect();
        assert_eq!(s.append_many(&refs).expect("append_many"), [2; 7]);
        s.save_snapshot(NOT_IN_A[0], b"core snapshot", 1)
            .expect("snapshot");
        s.put_meta("peer-id", b"12D3Koo").expect("meta");
    }
    // The namespaces' trees are where the layout says, one set per namespace.
    let trees = all_trees(&path);
    for ns in [
        NS_A,
        "did:nuwa:core:",
        "did:nuwa:cap:b:",
        "default",
        "nuwa:",
    ] {
        assert_eq!(
            trees[&namespace_tree(ns, "names")].len(),
            ns_count(ns),
            "{ns}"
        );
    }

    let before = all_trees(&path);
    open(&path)
        .save_snapshot(IN_A[0], b"a snapshot", 2)
        .expect("compact A");
    let after = all_trees(&path);
    only_a_changed(&before, &after, "a compaction");

    let before = after;
    assert_eq!(
        open(&path)
            .quarantine_container(IN_A[1])
            .expect("quarantine"),
        3
    );
    let after = all_trees(&path);
    only_a_changed(&before, &after, "a quarantine");
    assert_eq!(after[&namespace_tree(NS_A, "quarantine")].len(), 3);

    // Damage A's remaining name record; the quarantining listing moves it, and only it.
    {
        let db = raw_open(&path);
        let names = db.open_tree(namespace_tree(NS_A, "names")).expect("tree");
        let (key, value) = names.first().expect("read").expect("one name left");
        let mut bad = value.to_vec();
        bad[20] ^= 1;
        names.insert(key, bad).expect("damage");
        db.flush().expect("flush");
    }
    let before = all_trees(&path);
    let (names, moved) = open(&path)
        .list_containers_quarantining()
        .expect("list quarantining");
    let mut want = NOT_IN_A.map(str::to_owned).to_vec();
    want.sort();
    assert_eq!(names, want);
    assert_eq!(moved.len(), 1, "{moved:?}");
    let after = all_trees(&path);
    only_a_changed(&before, &after, "listing away a damaged name");

    // And the other namespaces still load in full.
    let s = open(&path);
    for c in NOT_IN_A {
        let record = s.load_container(c).expect("load").expect("exists");
        assert_eq!(record.last_seq, 2, "{c}");
    }
}

/// How many of the test's containers are in `namespace`.
fn ns_count(namespace: &str) -> usize {
    IN_A.iter()
        .chain(&NOT_IN_A)
        .filter(|c| nuwa_store::namespace_of(c) == namespace)
        .count()
}

// Goal: a record's seal names its namespace's tree, so a blob copied into another
// namespace's tree under the same key does not open there; method: copy a container's name
// record from one namespace's names tree to another's with raw sled, then list.
#[test]
fn a_record_copied_into_another_namespace_does_not_open() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("db");
    {
        let s = open(&path);
        s.append_changes("did:nuwa:cap:a:state:X#v1", &[b"x".to_vec()])
            .expect("append");
        s.append_changes("did:nuwa:cap:b:state:X#v1", &[b"y".to_vec()])
            .expect("append");
    }
    {
        let db = raw_open(&path);
        let from = db.open_tree(namespace_tree(NS_A, "names")).expect("tree");
        let to = db
            .open_tree(namespace_tree("did:nuwa:cap:b:", "names"))
            .expect("tree");
        let (key, value) = from.first().expect("read").expect("a name");
        to.insert(key, value).expect("copy");
        db.flush().expect("flush");
    }
    let got = open(&path).list_containers();
    assert!(
        matches!(got, Err(StoreError::Decrypt { tree: "names", .. })),
        "{got:?}"
    );
}

// Goal: reads never create a namespace's trees, and a namespace gets its trees with its
// first write only; method: load, quarantine and empty-append in a fresh namespace, list
// the trees with raw sled, then write and list again.
#[test]
fn only_a_write_creates_a_namespace() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("db");
    let c = "did:nuwa:app:fresh:state:X#v1";
    {
        let s = open(&path);
        assert_eq!(s.load_container(c).expect("load"), None);
        assert_eq!(s.quarantine_container(c).expect("quarantine"), 0);
        assert_eq!(s.append_changes(c, &[]).expect("empty append"), 0);
    }
    let names = namespace_tree("did:nuwa:app:fresh:", "names");
    assert!(!all_trees(&path).contains_key(&names));
    open(&path)
        .append_changes(c, &[b"x".to_vec()])
        .expect("append");
    assert_eq!(all_trees(&path)[&names].len(), 1);
}
