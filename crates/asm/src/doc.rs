//! Typed ASM containers on Automerge: one container is one Automerge
//! document whose items (JSON objects keyed by a string id) are stored so
//! that each top-level field merges per its CRDT keyword
//! ([`Layout::field`]), and read back as JSON.
//!
//! This module is IO-free and reads no clock. It edits a transaction the
//! caller opened (anything implementing [`Transactable`]) and reads any
//! [`ReadDoc`]; the caller commits, ships the change bytes, validates JSON
//! against the schema (see `schema`) and runs queries (see `query`).
//!
//! # Document layout (version 1)
//!
//! ```text
//! ROOT
//! ├── "asm":   Map { "kind": "object" | "map" | "list" | "log", "v": 1 }
//! └── "items": object/map → Map  { <id>: ItemMap, ... }
//!              list/log   → List [ ItemMap, ... ]
//! ItemMap: Map { "id": <id>, "_deleted": true (tombstones only), <field>: ... }
//! ```
//!
//! Both roots are written by [`genesis_change`], which every replica of a
//! container builds byte for byte the same (fixed actor derived from the
//! container name, time 0, no message). Two devices that create the same
//! container offline therefore hold the same genesis change (same hash), and
//! after sync there is one `items` object, not two conflicting ones. Field
//! names starting with `_` are reserved for this layer.
//!
//! # Fields per CRDT keyword
//!
//! | keyword | storage | merge |
//! |---|---|---|
//! | `lww_register` (and `append_only` used on a field) | scalar, or a fresh Map/List tree | the winning put replaces the whole value |
//! | `mv_register` | as `lww_register` | every concurrent value is reported in [`ItemView::conflicts`] |
//! | `rga_text` | Text, edited with `update_text` | concurrent edits interleave |
//! | `grow_only_set` | Map canonical-JSON(element) → element | union; removals are refused |
//! | `or_map` | Map, diffed key by key, nested objects recursed | edits of different keys merge; a scalar put concurrent with a remove of its key survives (add wins) |
//! | `counter` | Counter, updates become increments | concurrent increments sum |
//! | `flag` | Map of tokens, `true` iff non-empty | a concurrent enable beats a disable |
//! | `log_rga` | List, updates may only append | concurrent appends are all kept, in one order |
//!
//! Only fields whose value changed are written, so concurrent edits of
//! different fields of one item always merge.
//!
//! # Errors and partial writes
//!
//! Every check (shape, reserved names, nesting depth, policy types, set
//! removals, log rewrites, counter ranges) runs before the first write, so
//! a refused call leaves the transaction as it was. Only a failure inside
//! Automerge itself can leave partial edits; roll the transaction back then.

mod patch;
#[cfg(test)]
mod tests;

pub use patch::apply_patch;

use std::collections::{BTreeMap, BTreeSet};

use automerge::transaction::{CommitOptions, Transactable};
use automerge::{
    ActorId, Automerge, AutomergeError, ObjId, ObjType, Prop, ROOT, ReadDoc, ScalarValue,
    Value as AmValue,
};
use base64::Engine as _;
use serde_json::{Map as JsonMap, Number, Value};
use sha2::{Digest, Sha256};

use crate::model::{ContainerKind, CrdtKind, Layout};

/// Deepest nesting accepted in item values, JSON pointers and documents
/// read back (an item's top-level field is depth 1).
pub const MAX_DEPTH: usize = 64;
/// Most operations one patch may carry.
pub const MAX_PATCH_OPS: usize = 1000;
/// Most JSON nodes one patch may duplicate with `copy`, so that a short
/// patch cannot double a document a thousand times.
pub const MAX_PATCH_COPY_NODES: usize = 1_000_000;

/// The layout version written under `asm.v`.
pub const LAYOUT_VERSION: i64 = 1;

const ASM_KEY: &str = "asm";
const KIND_KEY: &str = "kind";
const VERSION_KEY: &str = "v";
const ITEMS_KEY: &str = "items";
const ID_KEY: &str = "id";
const DELETED_KEY: &str = "_deleted";
const GENESIS_DOMAIN: &str = "nuwa-asm-genesis:";
const FLAG_TOKEN_DOMAIN: &[u8] = b"nuwa-asm-flag-token:";

/// Why a container edit or read failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DocError {
    #[error("no live item with id {id:?}")]
    NoSuchItem { id: String },
    #[error("an item with id {id:?} already exists; update it or delete it first")]
    ItemExists { id: String },
    #[error(
        "item {id:?} is in an append-only container: past items can be neither edited nor deleted"
    )]
    AppendOnly { id: String },
    #[error("field {field:?} is a grow-only set: the update would remove elements")]
    GrowOnlySetRemoval { field: String },
    #[error("field {field:?} is an append-only log: the update may only append entries")]
    LogRewrite { field: String },
    #[error("field {field:?} is a counter and needs an integer")]
    NotAnInteger { field: String },
    #[error("counter field {field:?} would leave the 64-bit integer range")]
    CounterOverflow { field: String },
    #[error("field {field:?} must be {expected} for its {policy} policy")]
    FieldType {
        field: String,
        expected: &'static str,
        policy: CrdtKind,
    },
    #[error("an item must be a json object")]
    NotAnObject,
    #[error("field name {field:?} is reserved: names starting with '_' belong to the container")]
    ReservedField { field: String },
    #[error("item field \"id\" is {found} but the item id is {id:?}")]
    IdMismatch { id: String, found: Value },
    #[error("value is nested deeper than {max} levels")]
    TooDeep { max: usize },
    #[error(
        "document is not an asm container of this kind ({reason}); apply genesis_change for it first"
    )]
    BadGenesis { reason: &'static str },
    #[error("invalid patch: {reason}")]
    BadPatch { reason: &'static str },
    #[error("patch has {count} operations, more than the limit of {max}")]
    TooManyPatchOps { count: usize, max: usize },
    #[error("patch operation {index}: {reason}")]
    PatchOp { index: usize, reason: String },
    #[error("patch operation {index}: bad json pointer {pointer:?}: {reason}")]
    BadPointer {
        index: usize,
        pointer: String,
        reason: &'static str,
    },
    #[error("patch operation {index}: test failed at {path:?}")]
    PatchTestFailed { index: usize, path: String },
    #[error("patch copies more than {max} json nodes")]
    PatchTooLarge { max: usize },
    #[error("automerge operation failed")]
    Automerge(#[from] AutomergeError),
}

/// One item as read back from a container.
#[derive(Debug, Clone, PartialEq)]
pub struct ItemView {
    pub id: String,
    /// The item as a JSON object, including `"id"`. For `mv_register`
    /// fields this holds Automerge's winning value.
    pub value: Value,
    /// Per `mv_register` field with concurrent values: every distinct
    /// value (at least two), sorted by canonical JSON.
    pub conflicts: BTreeMap<String, Vec<Value>>,
    /// Whether the item is tombstoned (only [`get_with_tombstone`] returns
    /// such items).
    pub deleted: bool,
}

// ---------------------------------------------------------------------------
// Genesis

/// The actor of a container's genesis change: the first 16 bytes of
/// SHA-256(`"nuwa-asm-genesis:" + container_name`).
pub fn genesis_actor(container_name: &str) -> ActorId {
    let digest = Sha256::digest(format!("{GENESIS_DOMAIN}{container_name}").as_bytes());
    ActorId::from(&digest[..16])
}

/// The change that creates a container's root structure (see the module
/// docs for the layout). It depends only on `container_name` and the
/// container kind, so every replica builds the same bytes and hash.
pub fn genesis_change(container_name: &str, layout: &Layout) -> Vec<u8> {
    let mut doc = Automerge::new().with_actor(genesis_actor(container_name));
    let mut tx = doc.transaction();
    // These edits target ROOT of a fresh document with objects this very
    // transaction created, which Automerge cannot refuse.
    write_genesis(&mut tx, layout.container).expect("genesis edits on a fresh document");
    tx.commit_with(CommitOptions::default().with_time(0));
    // The transaction above made operations, so it committed a local change.
    doc.get_last_local_change()
        .expect("genesis transaction committed a change")
        .raw_bytes()
        .to_vec()
}

fn write_genesis<T: Transactable>(tx: &mut T, kind: ContainerKind) -> Result<(), AutomergeError> {
    let asm = tx.put_object(ROOT, ASM_KEY, ObjType::Map)?;
    tx.put(&asm, KIND_KEY, kind.as_str())?;
    tx.put(&asm, VERSION_KEY, LAYOUT_VERSION)?;
    let items_type = match kind {
        ContainerKind::Object | ContainerKind::Map => ObjType::Map,
        ContainerKind::List | ContainerKind::Log => ObjType::List,
    };
    tx.put_object(ROOT, ITEMS_KEY, items_type)?;
    Ok(())
}

/// Whether `doc` holds `layout`'s structure and nothing else at its root
/// (see [`repair_layout`]).
pub fn layout_is_intact<R: ReadDoc>(doc: &R, layout: &Layout) -> bool {
    check_genesis(doc, layout).is_ok() && doc.keys(ROOT).all(|k| k == ASM_KEY || k == ITEMS_KEY)
}

/// Puts `layout`'s structure back over whatever untyped writes left in a
/// container: the `asm` map (kind and version) and an empty `items` object
/// where they are missing or of the wrong kind, and no other root key.
/// Returns whether anything changed. Items under a replaced `items` are
/// gone from the current state (they stay in the history).
///
/// Before typed containers refused untyped writes, a raw put of `items`
/// left a container that neither `get`, `create` nor `reset` could use;
/// `state.reset` calls this to make it usable again.
pub fn repair_layout<T: Transactable + ReadDoc>(
    tx: &mut T,
    layout: &Layout,
) -> Result<bool, DocError> {
    if layout_is_intact(tx, layout) {
        return Ok(false);
    }
    let strays: Vec<String> = tx
        .keys(ROOT)
        .filter(|k| k != ASM_KEY && k != ITEMS_KEY)
        .collect();
    for key in strays {
        tx.delete(ROOT, key.as_str())?;
    }
    let asm_ok = matches!(
        tx.get(ROOT, ASM_KEY)?,
        Some((AmValue::Object(ObjType::Map), _))
    );
    let items_ok = items_obj(tx, layout).is_ok()
        || matches!(
            (tx.get(ROOT, ITEMS_KEY)?, layout.container),
            (
                Some((AmValue::Object(ObjType::Map), _)),
                ContainerKind::Object | ContainerKind::Map
            ) | (
                Some((AmValue::Object(ObjType::List), _)),
                ContainerKind::List | ContainerKind::Log
            )
        );
    let asm = if asm_ok {
        match tx.get(ROOT, ASM_KEY)? {
            Some((_, id)) => id,
            None => tx.put_object(ROOT, ASM_KEY, ObjType::Map)?,
        }
    } else {
        tx.put_object(ROOT, ASM_KEY, ObjType::Map)?
    };
    tx.put(&asm, KIND_KEY, layout.container.as_str())?;
    tx.put(&asm, VERSION_KEY, LAYOUT_VERSION)?;
    if !items_ok {
        let items_type = match layout.container {
            ContainerKind::Object | ContainerKind::Map => ObjType::Map,
            ContainerKind::List | ContainerKind::Log => ObjType::List,
        };
        tx.put_object(ROOT, ITEMS_KEY, items_type)?;
    }
    Ok(true)
}

/// Applies the genesis change of `container_name` to `doc` (a no-op if it
/// is already there) and checks the result.
pub fn apply_genesis(
    doc: &mut Automerge,
    container_name: &str,
    layout: &Layout,
) -> Result<(), DocError> {
    doc.load_incremental(&genesis_change(container_name, layout))?;
    check_genesis(doc, layout)
}

/// Checks that `doc` holds a version-1 container of `layout`'s kind.
pub fn check_genesis<R: ReadDoc>(doc: &R, layout: &Layout) -> Result<(), DocError> {
    items_obj(doc, layout).map(|_| ())
}

fn items_obj<R: ReadDoc>(doc: &R, layout: &Layout) -> Result<ObjId, DocError> {
    let asm = match doc.get(ROOT, ASM_KEY)? {
        Some((AmValue::Object(ObjType::Map), id)) => id,
        _ => {
            return Err(DocError::BadGenesis {
                reason: "no \"asm\" map",
            });
        }
    };
    match doc.get(&asm, KIND_KEY)? {
        Some((AmValue::Scalar(s), _)) if s.as_str() == Some(layout.container.as_str()) => {}
        _ => {
            return Err(DocError::BadGenesis {
                reason: "\"asm.kind\" is not the layout's container kind",
            });
        }
    }
    match doc.get(&asm, VERSION_KEY)? {
        Some((AmValue::Scalar(s), _)) if s.as_i64() == Some(LAYOUT_VERSION) => {}
        _ => {
            return Err(DocError::BadGenesis {
                reason: "\"asm.v\" is not 1",
            });
        }
    }
    let want = match layout.container {
        ContainerKind::Object | ContainerKind::Map => ObjType::Map,
        ContainerKind::List | ContainerKind::Log => ObjType::List,
    };
    match doc.get(ROOT, ITEMS_KEY)? {
        Some((AmValue::Object(t), id)) if t == want => Ok(id),
        _ => Err(DocError::BadGenesis {
            reason: "\"items\" is missing or of the wrong type",
        }),
    }
}

// ---------------------------------------------------------------------------
// Locating items

/// One stored item map.
struct Entry {
    /// Where the item map sits in `items` (key or index).
    prop: Prop,
    obj: ObjId,
    id: String,
    deleted: bool,
}

fn is_list(layout: &Layout) -> bool {
    matches!(layout.container, ContainerKind::List | ContainerKind::Log)
}

fn is_deleted<R: ReadDoc>(doc: &R, item: &ObjId) -> Result<bool, DocError> {
    Ok(matches!(
        doc.get(item, DELETED_KEY)?,
        Some((AmValue::Scalar(s), _)) if matches!(s.as_ref(), ScalarValue::Boolean(true))
    ))
}

fn list_entry_id<R: ReadDoc>(doc: &R, item: &ObjId) -> Result<Option<String>, DocError> {
    Ok(match doc.get(item, ID_KEY)? {
        Some((AmValue::Scalar(s), _)) => s.as_str().map(str::to_owned),
        _ => None,
    })
}

/// Every stored item map of the container, live or tombstoned, in id order
/// (object/map) or list order (list/log). List entries without a string id
/// are not items and are skipped.
fn entries<R: ReadDoc>(doc: &R, layout: &Layout, items: &ObjId) -> Result<Vec<Entry>, DocError> {
    let mut out = Vec::new();
    if is_list(layout) {
        for index in 0..doc.length(items) {
            if let Some((AmValue::Object(ObjType::Map), obj)) = doc.get(items, index)? {
                if let Some(id) = list_entry_id(doc, &obj)? {
                    let deleted = is_deleted(doc, &obj)?;
                    out.push(Entry {
                        prop: Prop::Seq(index),
                        obj,
                        id,
                        deleted,
                    });
                }
            }
        }
    } else {
        let keys: BTreeSet<String> = doc.keys(items).collect();
        for id in keys {
            if let Some((AmValue::Object(ObjType::Map), obj)) = doc.get(items, id.as_str())? {
                let deleted = is_deleted(doc, &obj)?;
                out.push(Entry {
                    prop: Prop::Map(id.clone()),
                    obj,
                    id,
                    deleted,
                });
            }
        }
    }
    Ok(out)
}

/// The stored item maps with this id (at most one for object/map; a list
/// may hold several, e.g. after two replicas appended the same id).
fn entries_with_id<R: ReadDoc>(
    doc: &R,
    layout: &Layout,
    items: &ObjId,
    id: &str,
) -> Result<Vec<Entry>, DocError> {
    if is_list(layout) {
        let mut all = entries(doc, layout, items)?;
        all.retain(|e| e.id == id);
        Ok(all)
    } else {
        match doc.get(items, id)? {
            Some((AmValue::Object(ObjType::Map), obj)) => {
                let deleted = is_deleted(doc, &obj)?;
                Ok(vec![Entry {
                    prop: Prop::Map(id.to_owned()),
                    obj,
                    id: id.to_owned(),
                    deleted,
                }])
            }
            _ => Ok(Vec::new()),
        }
    }
}

fn first_live<R: ReadDoc>(
    doc: &R,
    layout: &Layout,
    items: &ObjId,
    id: &str,
) -> Result<Option<Entry>, DocError> {
    Ok(entries_with_id(doc, layout, items, id)?
        .into_iter()
        .find(|e| !e.deleted))
}

// ---------------------------------------------------------------------------
// Public API

/// Creates item `id` from the JSON object `item` (its `"id"`, if present,
/// must equal `id`). Object/map containers put it under its id (replacing a
/// tombstoned item of that id); list/log containers append it.
pub fn create<T: Transactable + ReadDoc>(
    tx: &mut T,
    layout: &Layout,
    id: &str,
    item: &Value,
) -> Result<(), DocError> {
    let fields = check_item(layout, id, item)?;
    let items = items_obj(tx, layout)?;
    if first_live(tx, layout, &items, id)?.is_some() {
        return Err(DocError::ItemExists { id: id.to_owned() });
    }
    let obj = if is_list(layout) {
        let end = tx.length(&items);
        tx.insert_object(&items, end, ObjType::Map)?
    } else {
        tx.put_object(&items, id, ObjType::Map)?
    };
    tx.put(&obj, ID_KEY, id)?;
    for (name, value) in fields {
        write_new_field(tx, &obj, name, layout.field(name), value)?;
    }
    Ok(())
}

/// Replaces live item `id` by `new_item`, writing only what changed and
/// each changed field per its policy. Fields absent from `new_item` are
/// deleted, except a non-empty `grow_only_set` or `log_rga`, which is
/// refused. In a list holding the id twice, the first live entry is edited.
pub fn update<T: Transactable + ReadDoc>(
    tx: &mut T,
    layout: &Layout,
    id: &str,
    new_item: &Value,
) -> Result<(), DocError> {
    if layout.append_only() {
        return Err(DocError::AppendOnly { id: id.to_owned() });
    }
    let fields = check_item(layout, id, new_item)?;
    let items = items_obj(tx, layout)?;
    let entry = first_live(tx, layout, &items, id)?
        .ok_or_else(|| DocError::NoSuchItem { id: id.to_owned() })?;
    let obj = entry.obj;

    // Plan every field first so that a refusal leaves the transaction clean.
    let stored: BTreeSet<String> = tx
        .keys(&obj)
        .filter(|k| k != ID_KEY && !k.starts_with('_'))
        .collect();
    let mut plan: Vec<(&str, CrdtKind, Option<Value>, Option<&Value>)> = Vec::new();
    for name in stored.iter().map(String::as_str) {
        if !fields.contains_key(name) {
            let policy = layout.field(name);
            let old = read_field(tx, &obj, name, policy, 1)?;
            plan.push((name, policy, old, None));
        }
    }
    for (&name, &new) in &fields {
        let policy = layout.field(name);
        let old = read_field(tx, &obj, name, policy, 1)?;
        plan.push((name, policy, old, Some(new)));
    }
    for (name, policy, old, new) in &plan {
        check_transition(name, *policy, old.as_ref(), *new)?;
    }
    for (name, policy, old, new) in plan {
        match new {
            None => {
                if old.is_some() {
                    tx.delete(&obj, name)?;
                }
            }
            Some(new) => update_field(tx, &obj, name, policy, old.as_ref(), new)?,
        }
    }
    Ok(())
}

/// Deletes live item `id`: a tombstone (`"_deleted": true`, hidden from
/// reads) unless `hard`, which removes the item map. In a list every live
/// entry with the id is deleted.
pub fn delete<T: Transactable + ReadDoc>(
    tx: &mut T,
    layout: &Layout,
    id: &str,
    hard: bool,
) -> Result<(), DocError> {
    if layout.append_only() {
        return Err(DocError::AppendOnly { id: id.to_owned() });
    }
    let items = items_obj(tx, layout)?;
    let live: Vec<Entry> = entries_with_id(tx, layout, &items, id)?
        .into_iter()
        .filter(|e| !e.deleted)
        .collect();
    if live.is_empty() {
        return Err(DocError::NoSuchItem { id: id.to_owned() });
    }
    // Delete from the end so that earlier list indices stay valid.
    for entry in live.into_iter().rev() {
        if hard {
            tx.delete(&items, entry.prop)?;
        } else {
            tx.put(&entry.obj, DELETED_KEY, true)?;
        }
    }
    Ok(())
}

/// Removes every stored item (live or tombstoned) whose id is in `ids`:
/// the runtime's TTL and retention eviction, allowed even in append-only
/// containers. Returns how many item maps were removed.
pub fn remove_items<T: Transactable + ReadDoc>(
    tx: &mut T,
    layout: &Layout,
    ids: &[String],
) -> Result<usize, DocError> {
    let items = items_obj(tx, layout)?;
    let wanted: BTreeSet<&str> = ids.iter().map(String::as_str).collect();
    let doomed: Vec<Entry> = if is_list(layout) {
        entries(tx, layout, &items)?
            .into_iter()
            .filter(|e| wanted.contains(e.id.as_str()))
            .collect()
    } else {
        let mut out = Vec::new();
        for id in &wanted {
            out.extend(entries_with_id(tx, layout, &items, id)?);
        }
        out
    };
    let count = doomed.len();
    // Delete from the end so that earlier list indices stay valid.
    for entry in doomed.into_iter().rev() {
        tx.delete(&items, entry.prop)?;
    }
    Ok(count)
}

/// The live item `id`, or `None` if it is absent or tombstoned.
pub fn get<R: ReadDoc>(doc: &R, layout: &Layout, id: &str) -> Result<Option<ItemView>, DocError> {
    let items = items_obj(doc, layout)?;
    match first_live(doc, layout, &items, id)? {
        Some(entry) => read_item(doc, layout, &entry).map(Some),
        None => Ok(None),
    }
}

/// Item `id` even if tombstoned (then `deleted` is true); a live entry is
/// preferred over a tombstone.
pub fn get_with_tombstone<R: ReadDoc>(
    doc: &R,
    layout: &Layout,
    id: &str,
) -> Result<Option<ItemView>, DocError> {
    let items = items_obj(doc, layout)?;
    let all = entries_with_id(doc, layout, &items, id)?;
    let pick = all.iter().find(|e| !e.deleted).or_else(|| all.first());
    match pick {
        Some(entry) => read_item(doc, layout, entry).map(Some),
        None => Ok(None),
    }
}

/// Live items with their JSON values: object/map in id order, list/log in
/// list order.
pub fn items<R: ReadDoc>(doc: &R, layout: &Layout) -> Result<Vec<(String, Value)>, DocError> {
    let items = items_obj(doc, layout)?;
    let mut out = Vec::new();
    for entry in entries(doc, layout, &items)? {
        if !entry.deleted {
            let view = read_item(doc, layout, &entry)?;
            out.push((view.id, view.value));
        }
    }
    Ok(out)
}

/// How many live items the container holds.
pub fn item_count<R: ReadDoc>(doc: &R, layout: &Layout) -> Result<usize, DocError> {
    let items = items_obj(doc, layout)?;
    Ok(entries(doc, layout, &items)?
        .iter()
        .filter(|e| !e.deleted)
        .count())
}

// ---------------------------------------------------------------------------
// Checks (no writes)

/// Checks an item's shape and returns its fields other than `"id"`.
fn check_item<'a>(
    layout: &Layout,
    id: &str,
    item: &'a Value,
) -> Result<BTreeMap<&'a str, &'a Value>, DocError> {
    let Value::Object(map) = item else {
        return Err(DocError::NotAnObject);
    };
    let mut fields = BTreeMap::new();
    for (name, value) in map {
        if name.starts_with('_') {
            return Err(DocError::ReservedField {
                field: name.clone(),
            });
        }
        if name == ID_KEY {
            if value.as_str() != Some(id) {
                return Err(DocError::IdMismatch {
                    id: id.to_owned(),
                    found: value.clone(),
                });
            }
            continue;
        }
        check_depth(value, 1)?;
        check_type(name, layout.field(name), value)?;
        fields.insert(name.as_str(), value);
    }
    Ok(fields)
}

fn check_depth(value: &Value, depth: usize) -> Result<(), DocError> {
    if depth > MAX_DEPTH {
        return Err(DocError::TooDeep { max: MAX_DEPTH });
    }
    match value {
        Value::Array(a) => a.iter().try_for_each(|v| check_depth(v, depth + 1)),
        Value::Object(m) => m.values().try_for_each(|v| check_depth(v, depth + 1)),
        _ => Ok(()),
    }
}

fn check_type(name: &str, policy: CrdtKind, value: &Value) -> Result<(), DocError> {
    let expected = match policy {
        CrdtKind::RgaText if !value.is_string() => "a string",
        CrdtKind::GrowOnlySet | CrdtKind::LogRga if !value.is_array() => "an array",
        CrdtKind::OrMap if !value.is_object() => "an object",
        CrdtKind::Flag if !value.is_boolean() => "a boolean",
        CrdtKind::Counter if value.as_i64().is_none() => {
            return Err(DocError::NotAnInteger {
                field: name.to_owned(),
            });
        }
        _ => return Ok(()),
    };
    Err(DocError::FieldType {
        field: name.to_owned(),
        expected,
        policy,
    })
}

/// Checks that a field may go from `old` to `new` under its policy.
fn check_transition(
    name: &str,
    policy: CrdtKind,
    old: Option<&Value>,
    new: Option<&Value>,
) -> Result<(), DocError> {
    match policy {
        CrdtKind::GrowOnlySet => {
            let Some(Value::Array(old)) = old else {
                return Ok(());
            };
            let new_keys: BTreeSet<String> = match new {
                Some(Value::Array(new)) => new.iter().map(canonical_json).collect(),
                _ => BTreeSet::new(),
            };
            if old.iter().any(|v| !new_keys.contains(&canonical_json(v))) {
                return Err(DocError::GrowOnlySetRemoval {
                    field: name.to_owned(),
                });
            }
        }
        CrdtKind::LogRga => {
            let Some(Value::Array(old)) = old else {
                return Ok(());
            };
            let is_append = match new {
                Some(Value::Array(new)) => {
                    new.len() >= old.len() && old.iter().zip(new).all(|(a, b)| a == b)
                }
                _ => old.is_empty(),
            };
            if !is_append {
                return Err(DocError::LogRewrite {
                    field: name.to_owned(),
                });
            }
        }
        CrdtKind::Counter => {
            if let (Some(old), Some(new)) =
                (old.and_then(Value::as_i64), new.and_then(Value::as_i64))
                && new.checked_sub(old).is_none()
            {
                return Err(DocError::CounterOverflow {
                    field: name.to_owned(),
                });
            }
        }
        _ => {}
    }
    Ok(())
}

// ---------------------------------------------------------------------------
// Writes

/// Writes a field that the item map does not hold yet (or replaces it
/// wholesale).
fn write_new_field<T: Transactable>(
    tx: &mut T,
    obj: &ObjId,
    name: &str,
    policy: CrdtKind,
    value: &Value,
) -> Result<(), DocError> {
    match (policy, value) {
        (CrdtKind::RgaText, Value::String(s)) => {
            let text = tx.put_object(obj, name, ObjType::Text)?;
            tx.splice_text(&text, 0, 0, s)?;
        }
        (CrdtKind::GrowOnlySet, Value::Array(elems)) => {
            let set = tx.put_object(obj, name, ObjType::Map)?;
            for elem in elems {
                put_json(tx, &set, &canonical_json(elem), elem)?;
            }
        }
        (CrdtKind::Counter, v) => {
            // check_type proved the value is an i64.
            let n = v.as_i64().unwrap_or_default();
            tx.put(obj, name, ScalarValue::counter(n))?;
        }
        (CrdtKind::Flag, Value::Bool(on)) => {
            let flag = tx.put_object(obj, name, ObjType::Map)?;
            if *on {
                add_flag_token(tx, &flag)?;
            }
        }
        _ => put_json(tx, obj, name, value)?,
    }
    Ok(())
}

fn update_field<T: Transactable>(
    tx: &mut T,
    obj: &ObjId,
    name: &str,
    policy: CrdtKind,
    old: Option<&Value>,
    new: &Value,
) -> Result<(), DocError> {
    if old == Some(new) {
        return Ok(());
    }
    let current = match tx.get(obj, name)? {
        Some((AmValue::Object(t), id)) => Some((Some(t), id)),
        Some((AmValue::Scalar(_), id)) => Some((None, id)),
        None => None,
    };
    let Some((obj_type, current_id)) = current else {
        return write_new_field(tx, obj, name, policy, new);
    };
    match (policy, obj_type, new) {
        (CrdtKind::RgaText, Some(ObjType::Text), Value::String(s)) => {
            tx.update_text(&current_id, s)?;
        }
        (CrdtKind::GrowOnlySet, Some(ObjType::Map), Value::Array(elems)) => {
            for elem in elems {
                let key = canonical_json(elem);
                if tx.get(&current_id, key.as_str())?.is_none() {
                    put_json(tx, &current_id, &key, elem)?;
                }
            }
        }
        (CrdtKind::OrMap, Some(ObjType::Map), Value::Object(m)) => {
            diff_map(tx, &current_id, m)?;
        }
        (CrdtKind::Counter, None, v) => {
            let is_counter = matches!(
                tx.get(obj, name)?,
                Some((AmValue::Scalar(s), _)) if s.is_counter()
            );
            // check_type and check_transition proved both ends are i64 and
            // their difference fits.
            let new_n = v.as_i64().unwrap_or_default();
            match old.and_then(Value::as_i64) {
                Some(old_n) if is_counter => {
                    let delta = new_n.checked_sub(old_n).unwrap_or_default();
                    tx.increment(obj, name, delta)?;
                }
                _ => tx.put(obj, name, ScalarValue::counter(new_n))?,
            }
        }
        (CrdtKind::Flag, Some(ObjType::Map), Value::Bool(on)) => {
            let tokens: Vec<String> = tx.keys(&current_id).collect();
            if *on && tokens.is_empty() {
                add_flag_token(tx, &current_id)?;
            } else if !*on {
                for token in tokens {
                    tx.delete(&current_id, token.as_str())?;
                }
            }
        }
        (CrdtKind::LogRga, Some(ObjType::List), Value::Array(elems)) => {
            let len = tx.length(&current_id);
            for (index, elem) in elems.iter().enumerate().skip(len) {
                insert_json(tx, &current_id, index, elem)?;
            }
        }
        // Registers, and any field whose stored shape does not match its
        // policy (written by an older schema): replace the value.
        _ => write_new_field(tx, obj, name, policy, new)?,
    }
    Ok(())
}

/// Adds a fresh token to a flag map. The token is unique per write within
/// this document state: it hashes the transaction's base heads and its
/// pending operation count. Two writers on different actors may pick the
/// same token from the same heads; that is harmless, because Automerge
/// keeps both puts at the key and a delete only removes the puts its
/// writer had seen, so the flag stays enable-wins.
fn add_flag_token<T: Transactable>(tx: &mut T, flag: &ObjId) -> Result<(), DocError> {
    let mut heads = tx.base_heads();
    heads.sort();
    let mut hasher = Sha256::new();
    hasher.update(FLAG_TOKEN_DOMAIN);
    for head in &heads {
        hasher.update(head.as_ref());
    }
    hasher.update((tx.pending_ops() as u64).to_be_bytes());
    hasher.update(flag.to_bytes());
    let token = hex::encode(&hasher.finalize()[..16]);
    tx.put(flag, token.as_str(), true)?;
    Ok(())
}

/// Edits map `obj` into `new` key by key: removed keys deleted, changed
/// scalars and arrays put, nested maps recursed.
fn diff_map<T: Transactable>(
    tx: &mut T,
    obj: &ObjId,
    new: &JsonMap<String, Value>,
) -> Result<(), DocError> {
    let stored: Vec<String> = tx.keys(obj).collect();
    for key in stored {
        if !new.contains_key(&key) {
            tx.delete(obj, key.as_str())?;
        }
    }
    for (key, value) in new {
        let current = match tx.get(obj, key.as_str())? {
            Some((AmValue::Object(ObjType::Map), child)) if value.is_object() => {
                Current::Map(child)
            }
            Some((v, id)) => Current::Value(read_value(tx, v, &id, 1)?),
            None => Current::Absent,
        };
        match (current, value) {
            (Current::Map(child), Value::Object(m)) => diff_map(tx, &child, m)?,
            (Current::Value(cur), _) if &cur == value => {}
            _ => put_json(tx, obj, key, value)?,
        }
    }
    Ok(())
}

/// What an `or_map` key holds before a diff.
enum Current {
    Map(ObjId),
    Value(Value),
    Absent,
}

fn json_scalar(value: &Value) -> Option<ScalarValue> {
    Some(match value {
        Value::Null => ScalarValue::Null,
        Value::Bool(b) => ScalarValue::Boolean(*b),
        Value::Number(n) => {
            if let Some(i) = n.as_i64() {
                ScalarValue::Int(i)
            } else if let Some(u) = n.as_u64() {
                ScalarValue::Uint(u)
            } else {
                n.as_f64().map_or(ScalarValue::Null, ScalarValue::F64)
            }
        }
        Value::String(s) => ScalarValue::Str(s.as_str().into()),
        Value::Array(_) | Value::Object(_) => return None,
    })
}

/// Puts `value` at map key `key` (a fresh object tree for arrays and
/// objects). Depth was checked before any write.
fn put_json<T: Transactable>(
    tx: &mut T,
    obj: &ObjId,
    key: &str,
    value: &Value,
) -> Result<(), DocError> {
    match value {
        Value::Object(m) => {
            let child = tx.put_object(obj, key, ObjType::Map)?;
            fill_map(tx, &child, m)
        }
        Value::Array(a) => {
            let child = tx.put_object(obj, key, ObjType::List)?;
            fill_list(tx, &child, a)
        }
        scalar => {
            if let Some(s) = json_scalar(scalar) {
                tx.put(obj, key, s)?;
            }
            Ok(())
        }
    }
}

fn insert_json<T: Transactable>(
    tx: &mut T,
    list: &ObjId,
    index: usize,
    value: &Value,
) -> Result<(), DocError> {
    match value {
        Value::Object(m) => {
            let child = tx.insert_object(list, index, ObjType::Map)?;
            fill_map(tx, &child, m)
        }
        Value::Array(a) => {
            let child = tx.insert_object(list, index, ObjType::List)?;
            fill_list(tx, &child, a)
        }
        scalar => {
            if let Some(s) = json_scalar(scalar) {
                tx.insert(list, index, s)?;
            }
            Ok(())
        }
    }
}

fn fill_map<T: Transactable>(
    tx: &mut T,
    obj: &ObjId,
    m: &JsonMap<String, Value>,
) -> Result<(), DocError> {
    for (k, v) in m {
        put_json(tx, obj, k, v)?;
    }
    Ok(())
}

fn fill_list<T: Transactable>(tx: &mut T, obj: &ObjId, a: &[Value]) -> Result<(), DocError> {
    for (i, v) in a.iter().enumerate() {
        insert_json(tx, obj, i, v)?;
    }
    Ok(())
}

// ---------------------------------------------------------------------------
// Reads

fn read_item<R: ReadDoc>(doc: &R, layout: &Layout, entry: &Entry) -> Result<ItemView, DocError> {
    let mut value = JsonMap::new();
    let mut conflicts = BTreeMap::new();
    let names: BTreeSet<String> = doc
        .keys(&entry.obj)
        .filter(|k| k != ID_KEY && !k.starts_with('_'))
        .collect();
    for name in names {
        let policy = layout.field(&name);
        if let Some(v) = read_field(doc, &entry.obj, &name, policy, 1)? {
            value.insert(name.clone(), v);
        }
        if policy == CrdtKind::MvRegister {
            let all = read_all(doc, &entry.obj, &name)?;
            if all.len() >= 2 {
                conflicts.insert(name, all);
            }
        }
    }
    value.insert(ID_KEY.to_owned(), Value::String(entry.id.clone()));
    Ok(ItemView {
        id: entry.id.clone(),
        value: Value::Object(value),
        conflicts,
        deleted: entry.deleted,
    })
}

/// Every distinct concurrent value of a register, sorted by canonical JSON.
fn read_all<R: ReadDoc>(doc: &R, obj: &ObjId, name: &str) -> Result<Vec<Value>, DocError> {
    let mut by_key = BTreeMap::new();
    for (v, id) in doc.get_all(obj, name)? {
        let json = read_value(doc, v, &id, 1)?;
        by_key.insert(canonical_json(&json), json);
    }
    Ok(by_key.into_values().collect())
}

/// Reads a top-level field per its policy: grow-only sets become sorted
/// arrays and flags booleans; everything else reads as stored.
fn read_field<R: ReadDoc>(
    doc: &R,
    obj: &ObjId,
    name: &str,
    policy: CrdtKind,
    depth: usize,
) -> Result<Option<Value>, DocError> {
    let Some((v, id)) = doc.get(obj, name)? else {
        return Ok(None);
    };
    let value = match (policy, v) {
        (CrdtKind::GrowOnlySet, AmValue::Object(ObjType::Map)) => {
            let keys: BTreeSet<String> = doc.keys(&id).collect();
            let mut elems = Vec::with_capacity(keys.len());
            for key in keys {
                if let Some((v, elem_id)) = doc.get(&id, key.as_str())? {
                    elems.push(read_value(doc, v, &elem_id, depth + 1)?);
                }
            }
            Value::Array(elems)
        }
        (CrdtKind::Flag, AmValue::Object(ObjType::Map)) => {
            Value::Bool(doc.keys(&id).next().is_some())
        }
        (_, v) => read_value(doc, v, &id, depth)?,
    };
    Ok(Some(value))
}

/// Converts a stored value (at nesting `depth`) to JSON.
fn read_value<R: ReadDoc>(
    doc: &R,
    value: AmValue<'_>,
    id: &ObjId,
    depth: usize,
) -> Result<Value, DocError> {
    let obj_type = match value {
        AmValue::Scalar(s) => return Ok(scalar_json(&s)),
        AmValue::Object(t) => t,
    };
    if depth > MAX_DEPTH {
        return Err(DocError::TooDeep { max: MAX_DEPTH });
    }
    Ok(match obj_type {
        ObjType::Map | ObjType::Table => {
            let mut m = JsonMap::new();
            let keys: Vec<String> = doc.keys(id).collect();
            for key in keys {
                if let Some((v, child)) = doc.get(id, key.as_str())? {
                    m.insert(key, read_value(doc, v, &child, depth + 1)?);
                }
            }
            Value::Object(m)
        }
        ObjType::List => {
            let len = doc.length(id);
            let mut a = Vec::with_capacity(len);
            for index in 0..len {
                if let Some((v, child)) = doc.get(id, index)? {
                    a.push(read_value(doc, v, &child, depth + 1)?);
                }
            }
            Value::Array(a)
        }
        ObjType::Text => Value::String(doc.text(id)?),
    })
}

fn scalar_json(s: &ScalarValue) -> Value {
    match s {
        ScalarValue::Bytes(b) => Value::String(base64::engine::general_purpose::STANDARD.encode(b)),
        ScalarValue::Str(s) => Value::String(s.to_string()),
        ScalarValue::Int(i) | ScalarValue::Timestamp(i) => Value::from(*i),
        ScalarValue::Uint(u) => Value::from(*u),
        ScalarValue::F64(f) => Number::from_f64(*f).map_or(Value::Null, Value::Number),
        ScalarValue::Counter(c) => Value::from(i64::from(c)),
        ScalarValue::Boolean(b) => Value::Bool(*b),
        ScalarValue::Null | ScalarValue::Unknown { .. } => Value::Null,
    }
}

/// JSON text with object keys sorted at every level, whatever the
/// `serde_json` map order: the key of a grow-only set element and the sort
/// key of register conflicts.
pub fn canonical_json(value: &Value) -> String {
    let mut out = String::new();
    write_canonical(value, &mut out);
    out
}

fn write_canonical(value: &Value, out: &mut String) {
    match value {
        Value::Object(m) => {
            let sorted: BTreeMap<&String, &Value> = m.iter().collect();
            out.push('{');
            for (i, (k, v)) in sorted.into_iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                out.push_str(&Value::String(k.clone()).to_string());
                out.push(':');
                write_canonical(v, out);
            }
            out.push('}');
        }
        Value::Array(a) => {
            out.push('[');
            for (i, v) in a.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                write_canonical(v, out);
            }
            out.push(']');
        }
        scalar => out.push_str(&scalar.to_string()),
    }
}
