//! SledStore specifics: persistence across reopen, wrong keys, nothing readable on disk, and
//! refusal of records moved or altered on disk.

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
        s.append_changes(MARKER, &[blob]).expect("append");
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
    assert_eq!(
        files_containing(&path, b"nuwa-store-v1"),
        Vec::<String>::new()
    );

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
        let log = db.open_tree("log").expect("log tree");
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
        let log = db.open_tree("log").expect("log tree");
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
