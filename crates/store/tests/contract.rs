//! The storage contract, checked case by case on both backends: sequence numbering, snapshot
//! and change ordering, bounds, metadata, object safety and concurrent appends.

use std::sync::Arc;

use nuwa_crypto::AtRestKey;
use nuwa_store::{
    ContainerRecord, MAX_CHANGE_BYTES, MAX_CONTAINER_NAME_BYTES, MAX_META_KEY_BYTES,
    MAX_META_VALUE_BYTES, MemStore, SledStore, Storage, StoreError,
};

/// Runs `check` against a fresh store of each backend.
fn each_backend(check: impl Fn(&str, Arc<dyn Storage>)) {
    check("mem", Arc::new(MemStore::new()));
    let dir = tempfile::tempdir().expect("tempdir");
    let key = AtRestKey::generate().expect("rng");
    let sled = SledStore::open(&dir.path().join("db"), key).expect("open");
    check("sled", Arc::new(sled));
}

fn blobs(range: std::ops::RangeInclusive<u32>) -> Vec<Vec<u8>> {
    range.map(|i| format!("change-{i}").into_bytes()).collect()
}

// Goal: load returns the snapshot and exactly the changes after it, in order; method: a
// scripted sequence of appends and snapshots with the expected record after each step.
#[test]
fn snapshot_and_changes_ordering() {
    each_backend(|backend, s| {
        assert_eq!(
            s.load_container("c").expect("load"),
            None,
            "{backend}: unknown container"
        );
        assert_eq!(
            s.append_changes("c", &[]).expect("empty append"),
            0,
            "{backend}"
        );
        assert_eq!(
            s.list_containers().expect("list"),
            Vec::<String>::new(),
            "{backend}"
        );

        assert_eq!(
            s.append_changes("c", &blobs(1..=3)).expect("append"),
            3,
            "{backend}"
        );
        assert_eq!(
            s.append_changes("c", &blobs(4..=5)).expect("append"),
            5,
            "{backend}"
        );
        let record = |snapshot: Option<&[u8]>, covers, changes, last_seq| ContainerRecord {
            snapshot: snapshot.map(<[u8]>::to_vec),
            snapshot_covers: covers,
            changes,
            last_seq,
        };
        assert_eq!(
            s.load_container("c").expect("load"),
            Some(record(None, 0, blobs(1..=5), 5))
        );

        s.save_snapshot("c", b"snap-3", 3).expect("snapshot");
        assert_eq!(
            s.append_changes("c", &blobs(6..=7)).expect("append"),
            7,
            "{backend}"
        );
        assert_eq!(
            s.load_container("c").expect("load"),
            Some(record(Some(b"snap-3"), 3, blobs(4..=7), 7)),
            "{backend}"
        );

        // Same coverage may be replaced; older coverage may not; coverage beyond the log may
        // not.
        s.save_snapshot("c", b"snap-3b", 3).expect("same coverage");
        assert!(matches!(
            s.save_snapshot("c", b"old", 2),
            Err(StoreError::SnapshotStale {
                covers: 2,
                current: 3,
                ..
            })
        ));
        assert!(matches!(
            s.save_snapshot("c", b"future", 8),
            Err(StoreError::SnapshotAhead {
                covers: 8,
                last_seq: 7,
                ..
            })
        ));

        s.save_snapshot("c", b"snap-7", 7)
            .expect("snapshot everything");
        assert_eq!(
            s.load_container("c").expect("load"),
            Some(record(Some(b"snap-7"), 7, vec![], 7)),
            "{backend}"
        );
        // Sequence numbers continue after a full compaction, never reused.
        assert_eq!(
            s.append_changes("c", &blobs(8..=8)).expect("append"),
            8,
            "{backend}"
        );
        assert_eq!(
            s.load_container("c").expect("load"),
            Some(record(Some(b"snap-7"), 7, blobs(8..=8), 8)),
            "{backend}"
        );

        // A container may start from a snapshot alone.
        s.save_snapshot("from-snapshot", b"base", 0)
            .expect("snapshot of a new container");
        assert_eq!(
            s.load_container("from-snapshot").expect("load"),
            Some(record(Some(b"base"), 0, vec![], 0)),
            "{backend}"
        );
        assert!(matches!(
            s.save_snapshot("never-written", b"x", 1),
            Err(StoreError::SnapshotAhead {
                covers: 1,
                last_seq: 0,
                ..
            })
        ));
        assert_eq!(
            s.list_containers().expect("list"),
            ["c", "from-snapshot"],
            "{backend}"
        );
    });
}

// Goal: containers are independent and listed sorted; method: interleave appends to several
// containers and compare each log and the listing.
#[test]
fn containers_are_independent_and_sorted() {
    each_backend(|backend, s| {
        for (i, name) in ["zeta", "alpha", "Mid", "ä"].iter().enumerate() {
            for round in 0..3u32 {
                let seq = s
                    .append_changes(name, &[vec![i as u8, round as u8]])
                    .expect("append");
                assert_eq!(seq, u64::from(round) + 1, "{backend} {name}");
            }
        }
        assert_eq!(
            s.list_containers().expect("list"),
            ["Mid", "alpha", "zeta", "ä"],
            "{backend}"
        );
        let alpha = s.load_container("alpha").expect("load").expect("exists");
        assert_eq!(
            alpha.changes,
            vec![vec![1, 0], vec![1, 1], vec![1, 2]],
            "{backend}"
        );
    });
}

// Goal: every bound is enforced with its typed error and nothing is written; method: a
// table of inputs just over each limit, plus inputs exactly at it.
#[test]
fn bounds_are_enforced() {
    each_backend(|backend, s| {
        let at_limit = "n".repeat(MAX_CONTAINER_NAME_BYTES);
        let over = "n".repeat(MAX_CONTAINER_NAME_BYTES + 1);
        s.append_changes(&at_limit, &[b"ok".to_vec()])
            .expect("name at the limit");
        assert!(matches!(
            s.append_changes(&over, &[b"x".to_vec()]),
            Err(StoreError::ContainerNameTooLong { len: 257, max: 256 })
        ));
        assert!(matches!(
            s.append_changes("", &[b"x".to_vec()]),
            Err(StoreError::EmptyContainerName)
        ));
        assert!(matches!(
            s.load_container(&over),
            Err(StoreError::ContainerNameTooLong { .. })
        ));

        let huge = vec![0u8; MAX_CHANGE_BYTES + 1];
        let batch = vec![b"fine".to_vec(), huge];
        assert!(matches!(
            s.append_changes("big", &batch),
            Err(StoreError::ChangeTooLarge { index: 1, len, max, .. })
                if len == MAX_CHANGE_BYTES + 1 && max == MAX_CHANGE_BYTES
        ));
        assert_eq!(
            s.load_container("big").expect("load"),
            None,
            "{backend}: nothing written"
        );

        let key_over = "k".repeat(MAX_META_KEY_BYTES + 1);
        assert!(matches!(
            s.put_meta(&key_over, b"v"),
            Err(StoreError::MetaKeyTooLong { .. })
        ));
        assert!(matches!(
            s.put_meta("k", &vec![0; MAX_META_VALUE_BYTES + 1]),
            Err(StoreError::MetaValueTooLarge { .. })
        ));
        s.put_meta("k", &vec![7; MAX_META_VALUE_BYTES])
            .expect("value at the limit");
        assert_eq!(s.list_containers().expect("list"), [at_limit], "{backend}");
    });
}

// Goal: metadata is a plain key/value map; method: put, overwrite and read keys.
#[test]
fn meta_round_trip() {
    each_backend(|backend, s| {
        assert_eq!(s.get_meta("peer").expect("get"), None, "{backend}");
        s.put_meta("peer", b"one").expect("put");
        s.put_meta("peer", b"two").expect("overwrite");
        s.put_meta("", b"empty key").expect("empty key is a key");
        assert_eq!(
            s.get_meta("peer").expect("get").as_deref(),
            Some(&b"two"[..]),
            "{backend}"
        );
        assert_eq!(
            s.get_meta("").expect("get").as_deref(),
            Some(&b"empty key"[..]),
            "{backend}"
        );
        assert_eq!(
            s.list_containers().expect("list"),
            Vec::<String>::new(),
            "{backend}"
        );
    });
}

// Goal: concurrent appends to one container get distinct, gap-free sequence numbers and all
// land; method: four threads append batches, then the log is checked change by change.
#[test]
fn concurrent_appends_are_serialised() {
    each_backend(|backend, s| {
        let threads: Vec<_> = (0..4u8)
            .map(|t| {
                let s = Arc::clone(&s);
                std::thread::spawn(move || {
                    let mut acked = Vec::new();
                    for i in 0..25u8 {
                        let seq = s
                            .append_changes("shared", &[vec![t, i], vec![t, i, 0]])
                            .expect("append");
                        acked.push((seq, t, i));
                    }
                    acked
                })
            })
            .collect();
        let acked: Vec<_> = threads
            .into_iter()
            .flat_map(|h| h.join().expect("thread"))
            .collect();
        let record = s.load_container("shared").expect("load").expect("exists");
        assert_eq!(record.last_seq, 200, "{backend}");
        for (seq, t, i) in acked {
            // `seq` is the second change of the batch; the first is just before it.
            let idx = usize::try_from(seq).expect("small") - 1;
            assert_eq!(record.changes[idx - 1], vec![t, i], "{backend}");
            assert_eq!(record.changes[idx], vec![t, i, 0], "{backend}");
        }
    });
}

// Goal: `append_many` appends to several containers as `append_changes`
// would (sequence numbers continue per container), and checks every name
// and change before writing anything. Method: appends across three
// containers, then a call whose last batch has a bad name.
#[test]
fn append_many_is_append_changes_per_container_checked_first() {
    each_backend(|backend, s| {
        s.append_changes("a", &blobs(1..=2)).expect("append");
        let seqs = s
            .append_many(&[("a", &blobs(3..=4)), ("b", &blobs(1..=1)), ("c", &[])])
            .expect("append_many");
        assert_eq!(seqs, vec![4, 1, 0], "{backend}");
        assert_eq!(
            s.load_container("a").expect("load").expect("a").changes,
            blobs(1..=4),
            "{backend}"
        );
        assert_eq!(
            s.list_containers().expect("list"),
            vec!["a".to_owned(), "b".to_owned()],
            "{backend}: an empty batch creates nothing"
        );
        let err = s
            .append_many(&[("d", &blobs(1..=1)), ("", &blobs(1..=1))])
            .expect_err("a bad name");
        assert!(
            matches!(err, StoreError::EmptyContainerName),
            "{backend}: {err:?}"
        );
        assert_eq!(
            s.load_container("d").expect("load"),
            None,
            "{backend}: nothing written when one batch is refused"
        );
    });
}

// Goal: `append_many_with_meta` makes the records readable with the
// changes, and refuses a bad record before writing anything.
#[test]
fn append_many_with_meta_writes_records_with_the_changes() {
    each_backend(|backend, s| {
        let seqs = s
            .append_many_with_meta(
                &[("a", &blobs(1..=2))],
                &[("heads/a".into(), b"h2".to_vec())],
            )
            .expect("append with meta");
        assert_eq!(seqs, vec![2], "{backend}");
        assert_eq!(
            s.get_meta("heads/a").unwrap(),
            Some(b"h2".to_vec()),
            "{backend}"
        );
        let long = "k".repeat(MAX_META_KEY_BYTES + 1);
        assert!(
            s.append_many_with_meta(&[("b", &blobs(1..=1))], &[(long, Vec::new())])
                .is_err(),
            "{backend}"
        );
        assert_eq!(
            s.load_container("b").unwrap(),
            None,
            "{backend}: nothing written"
        );
    });
}
