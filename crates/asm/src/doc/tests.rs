//! Tests of the container layer: every field policy under concurrent edits
//! on two replicas, item lifecycle, genesis dedup and patches.

use automerge::transaction::Transaction;
use automerge::{ActorId, Automerge, ROOT, ReadDoc};
use serde_json::{Value, json};

use super::*;
use crate::model::{ContainerKind, CrdtKind, Layout};

const NAME: &str = "did:nuwa:state:note#v1";

fn layout(container: ContainerKind, fields: &[(&str, CrdtKind)]) -> Layout {
    Layout {
        container,
        container_crdt: None,
        fields: fields.iter().map(|(n, k)| (n.to_string(), *k)).collect(),
        default_field: CrdtKind::LwwRegister,
    }
}

fn replica(actor: u8, layout: &Layout) -> Automerge {
    let mut doc = Automerge::new().with_actor(ActorId::from(&[actor; 16][..]));
    apply_genesis(&mut doc, NAME, layout).expect("genesis applies");
    doc
}

/// Runs `f` in one transaction: committed on success, rolled back on error.
fn edit<T>(
    doc: &mut Automerge,
    f: impl FnOnce(&mut Transaction<'_>) -> Result<T, DocError>,
) -> Result<T, DocError> {
    let mut tx = doc.transaction();
    match f(&mut tx) {
        Ok(v) => {
            tx.commit();
            Ok(v)
        }
        Err(e) => {
            tx.rollback();
            Err(e)
        }
    }
}

fn sync(a: &mut Automerge, b: &mut Automerge) {
    a.merge(b).expect("merge b into a");
    b.merge(a).expect("merge a into b");
    assert_eq!(a.get_heads(), b.get_heads());
}

/// Two replicas holding item "n1" = `initial`, created on A and merged to B.
fn pair(layout: &Layout, initial: &Value) -> (Automerge, Automerge) {
    let mut a = replica(0xaa, layout);
    let mut b = replica(0xbb, layout);
    edit(&mut a, |tx| create(tx, layout, "n1", initial)).expect("create on a");
    sync(&mut a, &mut b);
    (a, b)
}

/// Applies each item of `steps` as an update of "n1" in its own transaction.
fn run(doc: &mut Automerge, layout: &Layout, steps: &[Value]) {
    for step in steps {
        edit(doc, |tx| update(tx, layout, "n1", step)).expect("update");
    }
}

/// Reads "n1" from both replicas, asserting they agree.
fn merged_view(a: &Automerge, b: &Automerge, layout: &Layout) -> ItemView {
    let va = get(a, layout, "n1").expect("read a").expect("n1 on a");
    let vb = get(b, layout, "n1").expect("read b").expect("n1 on b");
    assert_eq!(va, vb, "replicas disagree");
    va
}

struct Case {
    name: &'static str,
    policy: CrdtKind,
    initial: Value,
    /// Updates of field "f", applied in order on replica A.
    on_a: Vec<Value>,
    /// Updates of field "f", applied in order on replica B, concurrently.
    on_b: Vec<Value>,
    /// The merged value of "f" the policy promises (None: checked apart).
    expect: Option<Value>,
}

fn item(f: &Value) -> Value {
    json!({ "id": "n1", "title": "t", "f": f })
}

/// Runs a case: concurrent edits of field "f" on two replicas, then a
/// two-way merge; returns the merged view, same on both.
fn check(case: &Case) -> ItemView {
    let layout = layout(ContainerKind::Object, &[("f", case.policy)]);
    let (mut a, mut b) = pair(&layout, &item(&case.initial));
    let steps_a: Vec<Value> = case.on_a.iter().map(item).collect();
    let steps_b: Vec<Value> = case.on_b.iter().map(item).collect();
    run(&mut a, &layout, &steps_a);
    run(&mut b, &layout, &steps_b);
    sync(&mut a, &mut b);
    let view = merged_view(&a, &b, &layout);
    if let Some(expect) = &case.expect {
        assert_eq!(&view.value["f"], expect, "case {}", case.name);
    }
    assert_eq!(view.value["title"], json!("t"), "case {}", case.name);
    view
}

// Goal: each policy merges concurrent edits as NIP-8 promises. Method: edit
// field "f" concurrently on two replicas, merge both ways, compare.
#[test]
fn concurrent_edits_merge_per_policy() {
    use CrdtKind::*;
    let cases = [
        Case {
            name: "rga_text keeps both insertions",
            policy: RgaText,
            initial: json!("hello world"),
            on_a: vec![json!("hello big world")],
            on_b: vec![json!("hello world!")],
            expect: Some(json!("hello big world!")),
        },
        Case {
            name: "grow_only_set unions",
            policy: GrowOnlySet,
            initial: json!(["x"]),
            on_a: vec![json!(["x", "a"])],
            on_b: vec![json!(["b", "x"])],
            expect: Some(json!(["a", "b", "x"])),
        },
        Case {
            name: "grow_only_set of objects unions by canonical json",
            policy: GrowOnlySet,
            initial: json!([]),
            on_a: vec![json!([{"k": 1, "a": 2}])],
            on_b: vec![json!([{"a": 2, "k": 1}, {"z": 0}])],
            expect: Some(json!([{"a": 2, "k": 1}, {"z": 0}])),
        },
        Case {
            name: "or_map keeps edits of different keys",
            policy: OrMap,
            initial: json!({"k1": 1, "k2": 2, "deep": {"x": 1}}),
            on_a: vec![json!({"k1": 10, "k2": 2, "deep": {"x": 1, "y": 2}})],
            on_b: vec![json!({"k1": 1, "k2": 2, "k3": 3, "deep": {"x": 5}})],
            expect: Some(json!({"k1": 10, "k2": 2, "k3": 3, "deep": {"x": 5, "y": 2}})),
        },
        Case {
            name: "or_map: update beats concurrent remove",
            policy: OrMap,
            initial: json!({"k1": 1, "k2": 2}),
            on_a: vec![json!({"k1": 1})],
            on_b: vec![json!({"k1": 1, "k2": 20})],
            expect: Some(json!({"k1": 1, "k2": 20})),
        },
        Case {
            name: "counter sums increments",
            policy: Counter,
            initial: json!(10),
            on_a: vec![json!(11)],
            on_b: vec![json!(12)],
            expect: Some(json!(13)),
        },
        Case {
            name: "counter sums increments and decrements",
            policy: Counter,
            initial: json!(0),
            on_a: vec![json!(5), json!(3)],
            on_b: vec![json!(-4)],
            expect: Some(json!(-1)),
        },
        Case {
            // Both enables start from the same heads, so they even pick the
            // same token: B's disable must still not remove A's enable.
            name: "flag: enable beats concurrent disable",
            policy: Flag,
            initial: json!(false),
            on_a: vec![json!(true)],
            on_b: vec![json!(true), json!(false)],
            expect: Some(json!(true)),
        },
        Case {
            name: "flag: re-enable beats concurrent disable",
            policy: Flag,
            initial: json!(true),
            on_a: vec![json!(false), json!(true)],
            on_b: vec![json!(false)],
            expect: Some(json!(true)),
        },
        Case {
            name: "flag: disable alone wins",
            policy: Flag,
            initial: json!(true),
            on_a: vec![json!(false)],
            on_b: vec![],
            expect: Some(json!(false)),
        },
        Case {
            name: "lww_register: untouched field keeps its value",
            policy: LwwRegister,
            initial: json!({"nested": [1, 2]}),
            on_a: vec![],
            on_b: vec![json!({"nested": [1, 2, 3]})],
            expect: Some(json!({"nested": [1, 2, 3]})),
        },
    ];
    for case in &cases {
        check(case);
    }
}

// Goal: concurrent lww writes settle on one of the two values, the same on
// both replicas, with no conflicts reported.
#[test]
fn lww_register_picks_one_winner() {
    let view = check(&Case {
        name: "lww",
        policy: CrdtKind::LwwRegister,
        initial: json!("x"),
        on_a: vec![json!({"from": "a"})],
        on_b: vec![json!("b")],
        expect: None,
    });
    assert!(
        [json!({"from": "a"}), json!("b")].contains(&view.value["f"]),
        "{view:?}"
    );
    assert!(view.conflicts.is_empty());
}

// Goal: a multi-value register exposes every concurrent value until a later
// write supersedes them.
#[test]
fn mv_register_exposes_conflicts_until_rewritten() {
    let layout = layout(ContainerKind::Object, &[("f", CrdtKind::MvRegister)]);
    let (mut a, mut b) = pair(&layout, &item(&json!("x")));
    run(&mut a, &layout, &[item(&json!("b-from-a"))]);
    run(&mut b, &layout, &[item(&json!("a-from-b"))]);
    sync(&mut a, &mut b);
    let view = merged_view(&a, &b, &layout);
    assert_eq!(
        view.conflicts.get("f"),
        Some(&vec![json!("a-from-b"), json!("b-from-a")])
    );
    assert!(view.conflicts["f"].contains(&view.value["f"]));

    run(&mut a, &layout, &[item(&json!("settled"))]);
    sync(&mut a, &mut b);
    let view = merged_view(&a, &b, &layout);
    assert_eq!(view.value["f"], json!("settled"));
    assert!(view.conflicts.is_empty());
}

// Goal: a log_rga field keeps both replicas' concurrent appends in one
// agreed order and refuses rewrites.
#[test]
fn log_rga_keeps_concurrent_appends() {
    let view = check(&Case {
        name: "log_rga",
        policy: CrdtKind::LogRga,
        initial: json!([{"n": 0}]),
        on_a: vec![
            json!([{"n": 0}, {"n": "a1"}]),
            json!([{"n": 0}, {"n": "a1"}, {"n": "a2"}]),
        ],
        on_b: vec![json!([{"n": 0}, {"n": "b1"}])],
        expect: None,
    });
    let log = view.value["f"].as_array().expect("array");
    assert_eq!(log.len(), 4);
    assert_eq!(log[0], json!({"n": 0}));
    for e in [json!({"n": "a1"}), json!({"n": "a2"}), json!({"n": "b1"})] {
        assert!(log.contains(&e), "{e} missing from {log:?}");
    }
    let a1 = log.iter().position(|e| e["n"] == "a1");
    let a2 = log.iter().position(|e| e["n"] == "a2");
    assert!(a1 < a2, "a replica's own appends stay in order");

    let layout = layout(ContainerKind::Object, &[("f", CrdtKind::LogRga)]);
    let (mut a, _) = pair(&layout, &item(&json!([1, 2])));
    for rewrite in [json!([2, 1]), json!([1]), json!([1, 3, 4])] {
        let err = edit(&mut a, |tx| update(tx, &layout, "n1", &item(&rewrite)));
        assert!(
            matches!(err, Err(DocError::LogRewrite { ref field }) if field == "f"),
            "{rewrite}: {err:?}"
        );
    }
    let err = edit(&mut a, |tx| {
        update(tx, &layout, "n1", &json!({"id": "n1", "title": "t"}))
    });
    assert!(matches!(err, Err(DocError::LogRewrite { .. })), "{err:?}");
}

// Goal: a grow-only set refuses any update that drops an element, including
// dropping the whole field, and a refused update writes nothing.
#[test]
fn grow_only_set_refuses_removal() {
    let layout = layout(ContainerKind::Object, &[("f", CrdtKind::GrowOnlySet)]);
    let (mut a, _) = pair(&layout, &item(&json!(["x", "y"])));
    for bad in [
        item(&json!(["x"])),
        item(&json!([])),
        json!({"id": "n1", "title": "t"}),
    ] {
        let mut tx = a.transaction();
        let err = update(&mut tx, &layout, "n1", &bad);
        assert!(
            matches!(err, Err(DocError::GrowOnlySetRemoval { ref field }) if field == "f"),
            "{bad}: {err:?}"
        );
        assert_eq!(tx.pending_ops(), 0, "refused update wrote nothing");
        tx.rollback();
    }
    let view = get(&a, &layout, "n1").unwrap().unwrap();
    assert_eq!(view.value["f"], json!(["x", "y"]));
}

// Goal: a counter stays a counter through $inc patches and refuses
// non-integers and overflow.
#[test]
fn counter_via_inc_patch_and_bad_values() {
    let layout = layout(ContainerKind::Object, &[("f", CrdtKind::Counter)]);
    let (mut a, mut b) = pair(&layout, &item(&json!(1)));
    for doc in [&mut a, &mut b] {
        let current = get(doc, &layout, "n1").unwrap().unwrap().value;
        let patched = apply_patch(&current, &json!({"$inc": {"f": 2}})).unwrap();
        edit(doc, |tx| update(tx, &layout, "n1", &patched)).unwrap();
    }
    sync(&mut a, &mut b);
    assert_eq!(merged_view(&a, &b, &layout).value["f"], json!(5));

    for bad in [json!(1.5), json!("2"), json!(null)] {
        let err = edit(&mut a, |tx| update(tx, &layout, "n1", &item(&bad)));
        assert!(
            matches!(err, Err(DocError::NotAnInteger { .. })),
            "{bad}: {err:?}"
        );
    }
    let (mut c, _) = pair(&layout, &item(&json!(-5)));
    let err = edit(&mut c, |tx| {
        update(tx, &layout, "n1", &item(&json!(i64::MAX)))
    });
    assert!(
        matches!(err, Err(DocError::CounterOverflow { .. })),
        "{err:?}"
    );
}

// Goal: values of the wrong JSON type for a policy are refused with the
// field and policy named.
#[test]
fn wrong_types_are_refused() {
    use CrdtKind::*;
    let cases = [
        (RgaText, json!(1), "a string"),
        (GrowOnlySet, json!("x"), "an array"),
        (LogRga, json!({}), "an array"),
        (OrMap, json!([1]), "an object"),
        (Flag, json!(1), "a boolean"),
    ];
    for (policy, value, want) in cases {
        let layout = layout(ContainerKind::Map, &[("f", policy)]);
        let mut a = replica(1, &layout);
        let err = edit(&mut a, |tx| create(tx, &layout, "n1", &item(&value)));
        match err {
            Err(DocError::FieldType {
                field, expected, ..
            }) => {
                assert_eq!((field.as_str(), expected), ("f", want), "{policy}")
            }
            other => panic!("{policy}: {other:?}"),
        }
    }
}

// Goal: names starting with '_' are refused, as is an "id" that differs
// from the item id, a non-object item and over-deep nesting.
#[test]
fn reserved_and_malformed_items_are_refused() {
    let layout = layout(ContainerKind::Object, &[]);
    let mut a = replica(1, &layout);
    edit(&mut a, |tx| create(tx, &layout, "n1", &json!({"x": 1}))).unwrap();
    let err = edit(&mut a, |tx| {
        create(tx, &layout, "n2", &json!({"_deleted": false}))
    });
    assert!(matches!(err, Err(DocError::ReservedField { ref field }) if field == "_deleted"));
    let err = edit(&mut a, |tx| update(tx, &layout, "n1", &json!({"_x": 1})));
    assert!(matches!(err, Err(DocError::ReservedField { ref field }) if field == "_x"));
    let err = edit(&mut a, |tx| {
        create(tx, &layout, "n2", &json!({"id": "other"}))
    });
    assert!(matches!(err, Err(DocError::IdMismatch { .. })), "{err:?}");
    let err = edit(&mut a, |tx| create(tx, &layout, "n2", &json!([1])));
    assert!(matches!(err, Err(DocError::NotAnObject)), "{err:?}");

    let mut deep = json!(1);
    for _ in 0..MAX_DEPTH {
        deep = json!([deep]);
    }
    let err = edit(&mut a, |tx| create(tx, &layout, "n2", &json!({"d": deep})));
    assert!(matches!(err, Err(DocError::TooDeep { .. })), "{err:?}");
    assert_eq!(item_count(&a, &layout).unwrap(), 1);
}

// Goal: items round-trip, ids are unique among live items, and reads list
// map items in id order and list items in append order.
#[test]
fn create_get_items_round_trip() {
    for kind in [ContainerKind::Map, ContainerKind::List] {
        let layout = layout(kind, &[]);
        let mut a = replica(1, &layout);
        for id in ["b", "a", "c"] {
            let value = json!({"v": id, "nested": {"n": [1, {"x": null}]}, "f": 1.5, "t": true});
            edit(&mut a, |tx| create(tx, &layout, id, &value)).unwrap();
        }
        let err = edit(&mut a, |tx| create(tx, &layout, "a", &json!({})));
        assert!(
            matches!(err, Err(DocError::ItemExists { ref id }) if id == "a"),
            "{err:?}"
        );

        let ids: Vec<String> = items(&a, &layout)
            .unwrap()
            .into_iter()
            .map(|(id, _)| id)
            .collect();
        let want = if kind == ContainerKind::Map {
            ["a", "b", "c"]
        } else {
            ["b", "a", "c"]
        };
        assert_eq!(ids, want, "{kind}");
        let view = get(&a, &layout, "a").unwrap().unwrap();
        assert_eq!(
            view.value,
            json!({"id": "a", "v": "a", "nested": {"n": [1, {"x": null}]}, "f": 1.5, "t": true})
        );
        assert_eq!(get(&a, &layout, "zz").unwrap(), None);
        let err = edit(&mut a, |tx| update(tx, &layout, "zz", &json!({})));
        assert!(matches!(err, Err(DocError::NoSuchItem { .. })), "{err:?}");

        // A field absent from the update is deleted.
        edit(&mut a, |tx| update(tx, &layout, "a", &json!({"v": "a2"}))).unwrap();
        assert_eq!(
            get(&a, &layout, "a").unwrap().unwrap().value,
            json!({"id": "a", "v": "a2"})
        );
    }
}

// Goal: concurrent creates of different items on two replicas of a list
// both survive, in the same order on both.
#[test]
fn list_concurrent_creates_keep_both() {
    let layout = layout(ContainerKind::List, &[]);
    let (mut a, mut b) = pair(&layout, &json!({"v": 0}));
    edit(&mut a, |tx| create(tx, &layout, "from-a", &json!({"v": 1}))).unwrap();
    edit(&mut b, |tx| create(tx, &layout, "from-b", &json!({"v": 2}))).unwrap();
    sync(&mut a, &mut b);
    let on_a = items(&a, &layout).unwrap();
    assert_eq!(on_a, items(&b, &layout).unwrap());
    assert_eq!(on_a.len(), 3);
    assert_eq!(on_a[0].0, "n1");
}

// Goal: a tombstone made on one replica hides the item on both after
// merge, even against a concurrent update, and the id can be reused.
#[test]
fn tombstone_hides_item_on_both_replicas() {
    for kind in [ContainerKind::Object, ContainerKind::Log] {
        let layout = layout(kind, &[]);
        let (mut a, mut b) = pair(&layout, &json!({"v": 1}));
        edit(&mut a, |tx| delete(tx, &layout, "n1", false)).unwrap();
        edit(&mut b, |tx| update(tx, &layout, "n1", &json!({"v": 2}))).unwrap();
        sync(&mut a, &mut b);
        for doc in [&a, &b] {
            assert_eq!(get(doc, &layout, "n1").unwrap(), None, "{kind}");
            assert!(items(doc, &layout).unwrap().is_empty());
            assert_eq!(item_count(doc, &layout).unwrap(), 0);
            let tomb = get_with_tombstone(doc, &layout, "n1")
                .unwrap()
                .expect("tombstone");
            assert!(tomb.deleted);
            assert_eq!(tomb.value, json!({"id": "n1", "v": 2}));
        }
        let err = edit(&mut a, |tx| delete(tx, &layout, "n1", false));
        assert!(matches!(err, Err(DocError::NoSuchItem { .. })), "{err:?}");
        let err = edit(&mut a, |tx| update(tx, &layout, "n1", &json!({})));
        assert!(matches!(err, Err(DocError::NoSuchItem { .. })), "{err:?}");

        edit(&mut a, |tx| create(tx, &layout, "n1", &json!({"v": 3}))).unwrap();
        sync(&mut a, &mut b);
        let view = merged_view(&a, &b, &layout);
        assert_eq!(view.value, json!({"id": "n1", "v": 3}));
        assert!(!view.deleted);
    }
}

// Goal: a hard delete removes the item map itself on both replicas.
#[test]
fn hard_delete_removes_item() {
    for kind in [ContainerKind::Map, ContainerKind::List] {
        let layout = layout(kind, &[]);
        let (mut a, mut b) = pair(&layout, &json!({"v": 1}));
        edit(&mut b, |tx| create(tx, &layout, "n2", &json!({"v": 2}))).unwrap();
        sync(&mut a, &mut b);
        edit(&mut a, |tx| delete(tx, &layout, "n1", true)).unwrap();
        sync(&mut a, &mut b);
        for doc in [&a, &b] {
            assert_eq!(
                get_with_tombstone(doc, &layout, "n1").unwrap(),
                None,
                "{kind}"
            );
            assert_eq!(
                items(doc, &layout).unwrap(),
                vec![("n2".to_owned(), json!({"id": "n2", "v": 2}))]
            );
        }
    }
}

// Goal: an append_only container refuses edits and deletes but accepts
// concurrent appends and runtime removal (TTL/retention).
#[test]
fn append_only_refuses_edits_allows_removal() {
    let mut layout = layout(ContainerKind::Log, &[("entries", CrdtKind::LogRga)]);
    layout.container_crdt = Some(CrdtKind::AppendOnly);
    let (mut a, mut b) = pair(&layout, &json!({"role": "user", "content": "hi"}));
    let err = edit(&mut a, |tx| {
        update(tx, &layout, "n1", &json!({"content": "edited"}))
    });
    assert!(
        matches!(err, Err(DocError::AppendOnly { ref id }) if id == "n1"),
        "{err:?}"
    );
    for hard in [false, true] {
        let err = edit(&mut a, |tx| delete(tx, &layout, "n1", hard));
        assert!(matches!(err, Err(DocError::AppendOnly { .. })), "{err:?}");
    }
    edit(&mut a, |tx| {
        create(tx, &layout, "a1", &json!({"content": "from a"}))
    })
    .unwrap();
    edit(&mut b, |tx| {
        create(tx, &layout, "b1", &json!({"content": "from b"}))
    })
    .unwrap();
    // Eviction on B runs concurrently with A's append.
    let removed = edit(&mut b, |tx| {
        remove_items(tx, &layout, &["n1".to_owned(), "nope".to_owned()])
    })
    .unwrap();
    assert_eq!(removed, 1);
    sync(&mut a, &mut b);
    let on_a = items(&a, &layout).unwrap();
    assert_eq!(on_a, items(&b, &layout).unwrap());
    let mut ids: Vec<&str> = on_a.iter().map(|(id, _)| id.as_str()).collect();
    ids.sort_unstable();
    assert_eq!(ids, ["a1", "b1"]);
}

// Goal: remove_items also drops tombstones and works on map containers.
#[test]
fn remove_items_counts_maps_and_tombstones() {
    let layout = layout(ContainerKind::Map, &[]);
    let mut a = replica(1, &layout);
    for id in ["x", "y", "z"] {
        edit(&mut a, |tx| create(tx, &layout, id, &json!({}))).unwrap();
    }
    edit(&mut a, |tx| delete(tx, &layout, "y", false)).unwrap();
    let ids = ["x", "y", "missing"].map(str::to_owned);
    let removed = edit(&mut a, |tx| remove_items(tx, &layout, &ids)).unwrap();
    assert_eq!(removed, 2);
    assert_eq!(get_with_tombstone(&a, &layout, "y").unwrap(), None);
    assert_eq!(item_count(&a, &layout).unwrap(), 1);
}

// Goal: two devices that create the same container offline share one
// genesis change, so after merging there is one items object holding every
// item. Method: independent genesis on two actors, creates, merge.
#[test]
fn genesis_dedups_offline_creators() {
    for kind in [ContainerKind::Map, ContainerKind::Log] {
        let layout = layout(kind, &[]);
        assert_eq!(genesis_change(NAME, &layout), genesis_change(NAME, &layout));
        assert_ne!(
            genesis_change(NAME, &layout),
            genesis_change("other", &layout)
        );

        let mut a = replica(0xaa, &layout);
        let mut b = replica(0xbb, &layout);
        assert_eq!(a.get_heads(), b.get_heads(), "same genesis hash");
        edit(&mut a, |tx| create(tx, &layout, "from-a", &json!({"v": 1}))).unwrap();
        edit(&mut b, |tx| create(tx, &layout, "from-b", &json!({"v": 2}))).unwrap();
        sync(&mut a, &mut b);
        for doc in [&a, &b] {
            assert_eq!(doc.get_all(ROOT, "items").unwrap().len(), 1, "{kind}");
            assert_eq!(item_count(doc, &layout).unwrap(), 2);
        }
        // Re-applying genesis is a no-op.
        apply_genesis(&mut a, NAME, &layout).unwrap();
        assert_eq!(item_count(&a, &layout).unwrap(), 2);
    }
}

// Goal: reads and writes refuse documents without this container's
// genesis instead of guessing.
#[test]
fn missing_or_wrong_genesis_is_refused() {
    let map = layout(ContainerKind::Map, &[]);
    let list = layout(ContainerKind::List, &[]);
    let empty = Automerge::new();
    assert!(matches!(
        items(&empty, &map),
        Err(DocError::BadGenesis { .. })
    ));
    let a = replica(1, &map);
    assert!(matches!(
        get(&a, &list, "x"),
        Err(DocError::BadGenesis { .. })
    ));
    let mut empty = Automerge::new();
    let err = edit(&mut empty, |tx| create(tx, &map, "x", &json!({})));
    assert!(matches!(err, Err(DocError::BadGenesis { .. })));
}

// Goal: canonical json sorts keys at every level and is what grow-only sets
// key elements by.
#[test]
fn canonical_json_sorts_keys() {
    assert_eq!(
        canonical_json(&json!({"b": [{"d": 1, "c": "x\"y"}], "a": null})),
        r#"{"a":null,"b":[{"c":"x\"y","d":1}]}"#
    );
}

// Goal: apply_patch follows RFC 6902 and the $inc/$push form. Method: a
// table of (current, patch, expected result or error kind).
#[test]
fn apply_patch_table() {
    let base = json!({"id": "n1", "n": 1, "tags": ["a"], "o": {"k": "v", "a~b": 1, "c/d": 2}});
    let ok = |patch: Value, want: Value| (patch, Ok(want));
    let err = |patch: Value, kind: &'static str| (patch, Err(kind));
    let cases: Vec<(Value, Result<Value, &str>)> = vec![
        ok(
            json!({"$inc": {"n": 2}}),
            json!({"id": "n1", "n": 3, "tags": ["a"], "o": {"k": "v", "a~b": 1, "c/d": 2}}),
        ),
        ok(
            json!({"$inc": {"n": 0.5, "new": -1}}),
            json!({"id": "n1", "n": 1.5, "new": -1, "tags": ["a"], "o": {"k": "v", "a~b": 1, "c/d": 2}}),
        ),
        ok(
            json!({"$push": {"tags": "b", "more": {"$each": [1, 2]}}}),
            json!({"id": "n1", "n": 1, "tags": ["a", "b"], "more": [1, 2], "o": {"k": "v", "a~b": 1, "c/d": 2}}),
        ),
        ok(
            json!({"$inc": {"n": 1}, "$push": {"tags": {"x": 1}}}),
            json!({"id": "n1", "n": 2, "tags": ["a", {"x": 1}], "o": {"k": "v", "a~b": 1, "c/d": 2}}),
        ),
        err(json!({"$inc": {"tags": 1}}), "op"),
        err(json!({"$inc": {"n": "1"}}), "op"),
        err(json!({"$inc": {"n": i64::MAX}, "$push": {}}), "ok-big"),
        err(json!({"$push": {"n": 1}}), "op"),
        err(json!({"$set": {"n": 1}}), "bad"),
        err(json!("x"), "bad"),
        ok(
            json!([{"op": "add", "path": "/tags/-", "value": "b"}]),
            json!({"id": "n1", "n": 1, "tags": ["a", "b"], "o": {"k": "v", "a~b": 1, "c/d": 2}}),
        ),
        ok(
            json!([{"op": "add", "path": "/tags/0", "value": "z"}, {"op": "add", "path": "/o/new", "value": [1]}]),
            json!({"id": "n1", "n": 1, "tags": ["z", "a"], "o": {"k": "v", "a~b": 1, "c/d": 2, "new": [1]}}),
        ),
        ok(
            json!([{"op": "remove", "path": "/o/a~0b"}, {"op": "remove", "path": "/o/c~1d"}]),
            json!({"id": "n1", "n": 1, "tags": ["a"], "o": {"k": "v"}}),
        ),
        ok(
            json!([{"op": "replace", "path": "/n", "value": {"deep": true}}]),
            json!({"id": "n1", "n": {"deep": true}, "tags": ["a"], "o": {"k": "v", "a~b": 1, "c/d": 2}}),
        ),
        ok(
            json!([{"op": "move", "from": "/o/k", "path": "/k"}]),
            json!({"id": "n1", "n": 1, "k": "v", "tags": ["a"], "o": {"a~b": 1, "c/d": 2}}),
        ),
        ok(
            json!([{"op": "copy", "from": "/tags", "path": "/o/tags"}]),
            json!({"id": "n1", "n": 1, "tags": ["a"], "o": {"k": "v", "a~b": 1, "c/d": 2, "tags": ["a"]}}),
        ),
        ok(
            json!([{"op": "test", "path": "/n", "value": 1.0}, {"op": "test", "path": "/o", "value": {"c/d": 2, "a~b": 1, "k": "v"}}]),
            base.clone(),
        ),
        ok(
            json!([{"op": "replace", "path": "", "value": {"id": "n1"}}]),
            json!({"id": "n1"}),
        ),
        ok(json!([]), base.clone()),
        err(json!([{"op": "test", "path": "/n", "value": 2}]), "test"),
        err(
            json!([{"op": "add", "path": "/n", "value": 5}, {"op": "test", "path": "/n", "value": 1}]),
            "test",
        ),
        err(json!([{"op": "remove", "path": "/missing"}]), "op"),
        err(
            json!([{"op": "replace", "path": "/tags/1", "value": 0}]),
            "op",
        ),
        err(json!([{"op": "add", "path": "/tags/2", "value": 0}]), "op"),
        err(json!([{"op": "add", "path": "/a/b", "value": 0}]), "op"),
        err(json!([{"op": "add", "path": "n", "value": 0}]), "pointer"),
        err(
            json!([{"op": "add", "path": "/o/~2", "value": 0}]),
            "pointer",
        ),
        err(
            json!([{"op": "add", "path": "/tags/01", "value": 0}]),
            "pointer",
        ),
        err(json!([{"op": "remove", "path": "/tags/-1"}]), "pointer"),
        err(json!([{"op": "remove", "path": ""}]), "op"),
        err(
            json!([{"op": "move", "from": "/o", "path": "/o/inner"}]),
            "op",
        ),
        err(json!([{"op": "add", "path": "/x"}]), "op"),
        err(json!([{"op": "frobnicate", "path": "/x"}]), "op"),
        err(json!([{"path": "/x"}]), "op"),
        err(json!([1]), "op"),
    ];
    for (patch, want) in cases {
        let got = apply_patch(&base, &patch);
        match (want, got) {
            (Ok(want), Ok(got)) => assert_eq!(got, want, "{patch}"),
            (Err("op"), Err(DocError::PatchOp { .. }))
            | (Err("pointer"), Err(DocError::BadPointer { .. }))
            | (Err("test"), Err(DocError::PatchTestFailed { .. }))
            | (Err("bad"), Err(DocError::BadPatch { .. })) => {}
            (Err("ok-big"), Ok(got)) => assert_eq!(got["n"], json!(i64::MAX as u64 + 1), "{patch}"),
            (want, got) => panic!("{patch}: want {want:?}, got {got:?}"),
        }
    }
}

// Goal: patches are bounded: op count, pointer depth, and copy growth.
#[test]
fn apply_patch_limits() {
    let ops: Vec<Value> = (0..=MAX_PATCH_OPS)
        .map(|_| json!({"op": "test", "path": "", "value": {}}))
        .collect();
    let err = apply_patch(&json!({}), &Value::Array(ops));
    assert!(
        matches!(err, Err(DocError::TooManyPatchOps { .. })),
        "{err:?}"
    );

    let deep_path = "/a".repeat(MAX_DEPTH + 1);
    let err = apply_patch(
        &json!({}),
        &json!([{"op": "add", "path": deep_path, "value": 1}]),
    );
    assert!(matches!(err, Err(DocError::BadPointer { .. })), "{err:?}");

    // Each copy doubles the document; without a bound this would not end.
    let ops: Vec<Value> = (0..100)
        .map(|i| json!({"op": "copy", "from": "/a", "path": format!("/a/{i}")}))
        .collect();
    let err = apply_patch(&json!({"a": {"x": 1}}), &Value::Array(ops));
    assert!(
        matches!(err, Err(DocError::PatchTooLarge { .. })),
        "{err:?}"
    );
}
