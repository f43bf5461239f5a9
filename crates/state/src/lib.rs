//! Agent state containers backed by Automerge.
//!
//! One [`Container`] is one Automerge document and one unit of sync. It
//! offers the untyped `map` used by `state put`: JSON values under string
//! keys, merged key-wise with Automerge's deterministic last-writer-wins
//! between concurrent puts of the same key. Typed NIP-8 containers edit the
//! same documents through [`Container::transact`] (see `nuwa-asm`).
//! Nested JSON objects and arrays become Automerge maps and lists, so a later
//! schema layer can merge inside them.
//!
//! This crate knows nothing about the network, encryption or storage: it turns
//! edits into Automerge change bytes, applies remote change bytes, runs the
//! Automerge sync protocol against a caller-held [`SyncState`], and renders
//! JSON. Persisting the change bytes is the caller's job.

mod names;
pub use automerge;
pub use automerge::sync::State as SyncState;
use automerge::sync::SyncDoc;
use automerge::{
    ActorId, Automerge, Change, ChangeHash, ObjId, ObjType, ROOT, ReadDoc, ScalarValue,
    transaction::Transactable,
};
pub use names::{NameRuleError, check_key_rules, check_name_rules};
use serde_json::Value;
use std::collections::HashMap;

/// Longest key accepted in a map container.
pub const MAX_KEY_BYTES: usize = 1024;
/// Deepest JSON nesting accepted in a value (bounds recursion).
pub const MAX_JSON_DEPTH: usize = 64;

/// Longest container name, in UTF-8 bytes: the wire's limit, declared once
/// in `nuwa-proto` (storage enforces the same one).
pub use nuwa_proto::MAX_CONTAINER_NAME_BYTES;

/// Why a container name is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NameError {
    #[error("container name is empty; give the container a name")]
    Empty,
    #[error("container name is {0} bytes, over the {MAX_CONTAINER_NAME_BYTES}-byte limit")]
    TooLong(usize),
    #[error("container name holds a control character (U+{0:04X})")]
    ControlCharacter(u32),
}

/// Checks a container name: non-empty, at most
/// [`MAX_CONTAINER_NAME_BYTES`] bytes, no control characters (they would
/// corrupt logs and terminals that print it). Every door through which a
/// name arrives (the local API, a peer's delta) checks it before anything is
/// applied or stored.
pub fn check_container_name(name: &str) -> Result<(), NameError> {
    if name.is_empty() {
        return Err(NameError::Empty);
    }
    if name.len() > MAX_CONTAINER_NAME_BYTES {
        return Err(NameError::TooLong(name.len()));
    }
    if let Some(c) = name.chars().find(|c| c.is_control()) {
        return Err(NameError::ControlCharacter(c as u32));
    }
    Ok(())
}

/// What went wrong with a container operation.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StateError {
    #[error("invalid key {key:?}: {reason}")]
    InvalidKey { key: String, reason: &'static str },
    #[error("value nests deeper than {MAX_JSON_DEPTH} levels")]
    TooDeep,
    #[error("number {0} cannot be stored (not an i64, u64 or finite f64)")]
    BadNumber(String),
    #[error("malformed automerge change: {0}")]
    BadChange(String),
    #[error("malformed automerge document: {0}")]
    BadDocument(String),
    #[error("malformed automerge sync message: {0}")]
    BadSyncMessage(String),
    #[error("automerge rejected the operation: {0}")]
    Automerge(#[from] automerge::AutomergeError),
    /// Automerge panicked on peer input, or applied a change it should have
    /// refused. The document cannot be trusted, so the container dropped
    /// it: it is empty and
    /// [`Container::is_poisoned`] until the caller rebuilds it from storage.
    #[error("this input left the document untrustworthy ({0}); the container must be reloaded")]
    Poisoned(String),
}

/// Why [`Container::transact`] changed nothing.
#[derive(Debug, thiserror::Error)]
pub enum TransactError<E> {
    /// The caller's closure refused the edit (rolled back).
    #[error("{0}")]
    Rejected(E),
    #[error(transparent)]
    State(StateError),
}

/// Renders one Automerge value as JSON, exactly as [`automerge::AutoSerde`]
/// does (maps and tables as objects, text as a string, lists as arrays,
/// scalars through their serde form), but with an explicit stack: a peer can
/// build a document nested deeper than any call stack.
fn render(doc: &Automerge, value: automerge::Value<'_>, obj: ObjId) -> Value {
    enum Step<'a> {
        Leaf(Value),
        Open(Frame<'a>),
    }
    struct Frame<'a> {
        /// This object's key in its parent map (`None` in a list or at the top).
        key: Option<String>,
        out: Value,
        children: std::vec::IntoIter<(Option<String>, automerge::Value<'a>, ObjId)>,
    }
    fn step<'a>(
        doc: &'a Automerge,
        key: Option<String>,
        value: automerge::Value<'a>,
        obj: ObjId,
    ) -> Step<'a> {
        let (out, children): (Value, Vec<_>) = match value {
            automerge::Value::Scalar(s) => {
                return Step::Leaf(serde_json::to_value(s.as_ref()).unwrap_or(Value::Null));
            }
            automerge::Value::Object(ObjType::Text) => {
                return Step::Leaf(Value::String(doc.text(&obj).unwrap_or_default()));
            }
            automerge::Value::Object(ObjType::Map | ObjType::Table) => (
                Value::Object(serde_json::Map::new()),
                doc.keys(&obj)
                    .filter_map(|k| {
                        let (v, o) = doc.get(&obj, k.as_str()).ok().flatten()?;
                        Some((Some(k), v, o))
                    })
                    .collect(),
            ),
            automerge::Value::Object(ObjType::List) => (
                Value::Array(Vec::new()),
                (0..doc.length(&obj))
                    .filter_map(|i| {
                        let (v, o) = doc.get(&obj, i).ok().flatten()?;
                        Some((None, v, o))
                    })
                    .collect(),
            ),
        };
        Step::Open(Frame {
            key,
            out,
            children: children.into_iter(),
        })
    }
    fn attach(parent: &mut Value, key: Option<String>, child: Value) {
        match parent {
            Value::Object(map) => {
                map.insert(key.unwrap_or_default(), child);
            }
            Value::Array(items) => items.push(child),
            _ => {}
        }
    }

    let mut stack = match step(doc, None, value, obj) {
        Step::Leaf(v) => return v,
        Step::Open(frame) => vec![frame],
    };
    loop {
        let Some(top) = stack.last_mut() else {
            return Value::Null;
        };
        match top.children.next() {
            Some((key, value, obj)) => match step(doc, key.clone(), value, obj) {
                Step::Leaf(v) => attach(&mut top.out, key, v),
                Step::Open(frame) => stack.push(frame),
            },
            None => {
                let Some(done) = stack.pop() else {
                    return Value::Null;
                };
                match stack.last_mut() {
                    Some(parent) => attach(&mut parent.out, done.key, done.out),
                    None => return done.out,
                }
            }
        }
    }
}

/// A 32-byte Automerge change hash.
pub type Hash = [u8; 32];

/// One map container: an Automerge document whose root map holds the entries.
pub struct Container {
    doc: Automerge,
    /// Set when Automerge panicked on input; see [`Container::is_poisoned`].
    poisoned: bool,
    /// Changes in the document's history, kept as it grows: Automerge only
    /// counts them by collecting every change (O(history) per call).
    changes: usize,
}

impl std::fmt::Debug for Container {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Container")
            .field("heads", &self.doc.get_heads().len())
            .finish()
    }
}

/// Result of applying remote changes.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Applied {
    /// Raw bytes of every change integrated by this call, including queued
    /// changes it released (to be persisted by the caller). Changes still
    /// waiting for dependencies are not included.
    pub new_changes: Vec<Vec<u8>>,
    /// Whether some applied changes wait for dependencies not yet received.
    pub missing_deps: bool,
}

fn check_key(key: &str) -> Result<(), StateError> {
    let reason = if key.is_empty() {
        "empty"
    } else if key.len() > MAX_KEY_BYTES {
        "longer than 1024 bytes"
    } else {
        return Ok(());
    };
    Err(StateError::InvalidKey {
        key: key.chars().take(64).collect(),
        reason,
    })
}

fn depth(v: &Value) -> usize {
    // Iterative so that hostile nesting cannot overflow the stack.
    let mut max = 0;
    let mut stack = vec![(v, 1usize)];
    while let Some((v, d)) = stack.pop() {
        max = max.max(d);
        match v {
            Value::Array(a) => stack.extend(a.iter().map(|x| (x, d + 1))),
            Value::Object(o) => stack.extend(o.values().map(|x| (x, d + 1))),
            _ => {}
        }
    }
    max
}

fn scalar(v: &Value) -> Result<Option<ScalarValue>, StateError> {
    Ok(Some(match v {
        Value::Null => ScalarValue::Null,
        Value::Bool(b) => ScalarValue::Boolean(*b),
        Value::String(s) => ScalarValue::Str(s.as_str().into()),
        Value::Number(n) => {
            if let Some(i) = n.as_i64() {
                ScalarValue::Int(i)
            } else if let Some(u) = n.as_u64() {
                ScalarValue::Uint(u)
            } else {
                match n.as_f64() {
                    Some(f) if f.is_finite() => ScalarValue::F64(f),
                    _ => return Err(StateError::BadNumber(n.to_string())),
                }
            }
        }
        Value::Array(_) | Value::Object(_) => return Ok(None),
    }))
}

/// Above this many values, a nested value is written with one
/// `batch_create_object` (see `put_value`).
const BATCH_CREATE_MIN_VALUES: usize = 64;

/// Whether `v` holds more than [`BATCH_CREATE_MIN_VALUES`] values (itself
/// included); it stops counting as soon as it knows.
fn is_big(v: &Value) -> bool {
    fn over(v: &Value, budget: &mut usize) -> bool {
        if *budget == 0 {
            return true;
        }
        *budget -= 1;
        match v {
            Value::Array(items) => items.iter().any(|i| over(i, budget)),
            Value::Object(map) => map.values().any(|i| over(i, budget)),
            _ => false,
        }
    }
    let mut budget = BATCH_CREATE_MIN_VALUES;
    over(v, &mut budget)
}

/// `v` as Automerge's hydrated value (scalars as `scalar` makes them; they
/// were validated by `validate`).
fn hydrate_of(v: &Value) -> automerge::hydrate::Value {
    use automerge::hydrate;
    match v {
        Value::Array(items) => {
            hydrate::Value::from(items.iter().map(hydrate_of).collect::<Vec<_>>())
        }
        Value::Object(map) => {
            let m: std::collections::HashMap<String, hydrate::Value> = map
                .iter()
                .map(|(k, v)| (k.clone(), hydrate_of(v)))
                .collect();
            hydrate::Value::Map(m.into())
        }
        _ => hydrate::Value::from(scalar(v).ok().flatten().unwrap_or(ScalarValue::Null)),
    }
}

/// Writes `v` under `prop` of `obj`, creating nested objects as needed.
fn put_value<T: Transactable>(
    tx: &mut T,
    obj: &ObjId,
    prop: automerge::Prop,
    v: &Value,
    insert: bool,
) -> Result<(), automerge::AutomergeError> {
    let nested = match v {
        Value::Array(items) => Some((ObjType::List, Some(items), None)),
        Value::Object(map) => Some((ObjType::Map, None, Some(map))),
        _ => None,
    };
    match nested {
        None => {
            // Only scalars reach here and they were validated by `validate`.
            let s = scalar(v).ok().flatten().unwrap_or(ScalarValue::Null);
            match (insert, prop) {
                (true, automerge::Prop::Seq(i)) => tx.insert(obj, i, s)?,
                (_, p) => tx.put(obj, p, s)?,
            }
        }
        Some(_) if is_big(v) => {
            // A big tree goes in with two op-set splices instead of one
            // per node: about 9 times faster (6,000 map members: 5 ms
            // instead of 48). Its op order follows a hash map's, so the
            // change's bytes differ run to run (the document does not);
            // small values keep the deterministic path below, which is all
            // the simulator writes.
            tx.batch_create_object(obj, prop, &hydrate_of(v), insert)?;
        }
        Some((kind, items, map)) => {
            let child = match (insert, prop) {
                (true, automerge::Prop::Seq(i)) => tx.insert_object(obj, i, kind)?,
                (_, p) => tx.put_object(obj, p, kind)?,
            };
            if let Some(items) = items {
                // A run of scalars goes in as one splice: a tenth of the
                // time of one insert each (an embedding is thousands of
                // numbers).
                let mut i = 0;
                while i < items.len() {
                    let run = items[i..]
                        .iter()
                        .take_while(|v| !v.is_array() && !v.is_object())
                        .count();
                    if run > 1 {
                        let scalars = items[i..i + run]
                            .iter()
                            .map(|v| scalar(v).ok().flatten().unwrap_or(ScalarValue::Null));
                        tx.splice(&child, i, 0, scalars)?;
                        i += run;
                    } else {
                        put_value(tx, &child, automerge::Prop::Seq(i), &items[i], true)?;
                        i += 1;
                    }
                }
            }
            if let Some(map) = map {
                for (k, item) in map {
                    put_value(tx, &child, automerge::Prop::Map(k.clone()), item, false)?;
                }
            }
        }
    }
    Ok(())
}

fn validate(v: &Value) -> Result<(), StateError> {
    if depth(v) > MAX_JSON_DEPTH {
        return Err(StateError::TooDeep);
    }
    let mut stack = vec![v];
    while let Some(v) = stack.pop() {
        match v {
            Value::Array(a) => stack.extend(a.iter()),
            Value::Object(o) => stack.extend(o.values()),
            other => {
                scalar(other)?;
            }
        }
    }
    Ok(())
}

/// Refuses a change whose bytes are not the canonical encoding of its
/// operations. automerge 0.12 accepts such a change, but re-encodes it
/// under another hash when it later lists changes, then panics on the
/// dependency it can no longer find (found by the `sync_message` fuzz
/// target; reproducer in fuzz/regressions/). Changes made by Automerge
/// itself always pass.
///
/// Decoding itself can panic inside automerge 0.12 on a change that parsed
/// (an op referencing an actor index the change does not list; found by
/// fuzzing), so it runs under [`no_panic`]; the document is not touched.
fn check_canonical(change: &Change) -> Result<(), StateError> {
    let same = no_panic("decoding a change", || {
        let reencoded: Change = change.decode().into();
        reencoded.hash() == change.hash()
    })?;
    if !same {
        return Err(StateError::BadChange(
            "change is not canonically encoded".into(),
        ));
    }
    Ok(())
}

/// Checks every change that became part of `doc` since `before`: its first
/// op must come right after the last op of its dependencies, as in every
/// change Automerge makes (a change's ops are numbered on from the document
/// it was made on, whose heads become its deps). automerge 0.12 applies a
/// change that breaks this, then saves a document it cannot load again
/// ("missing ops"; found by fuzzing): after the next compaction the daemon
/// could not start. Such a change has already been applied, so the answer
/// is [`StateError::Poisoned`]: the caller drops the document and reloads.
fn check_op_numbering(doc: &Automerge, before: &[ChangeHash]) -> Result<(), StateError> {
    let new = doc.get_changes_meta(before);
    // Most dependencies are among the new changes themselves (a cold sync
    // brings them all); only the frontier is looked up in the document.
    let max_ops: HashMap<ChangeHash, u64> = new.iter().map(|c| (c.hash, c.max_op)).collect();
    for change in &new {
        let Some(expected) = expected_start_op(doc, &max_ops, &change.deps) else {
            return Err(StateError::Poisoned(format!(
                "change {} applied without its dependencies",
                change.hash
            )));
        };
        if change.start_op != expected {
            return Err(StateError::Poisoned(format!(
                "change {} starts at op {}, its dependencies end at op {}",
                change.hash,
                change.start_op,
                expected - 1
            )));
        }
    }
    Ok(())
}

/// The op a change with these dependencies must start at: one past the
/// last op of any of them, looked up in `batch` (changes not yet, or just,
/// applied) and then in `doc`. `None` if a dependency is in neither.
fn expected_start_op(
    doc: &Automerge,
    batch: &HashMap<ChangeHash, u64>,
    deps: &[ChangeHash],
) -> Option<u64> {
    let mut expected = 1;
    for dep in deps {
        let max_op = match batch.get(dep) {
            Some(&m) => m,
            None => doc.get_change_meta_by_hash(dep)?.max_op,
        };
        expected = expected.max(max_op + 1);
    }
    Some(expected)
}

/// Reads one unsigned LEB128 number (at most 64 bits) off the front of
/// `bytes`; `None` if it is truncated or too long.
fn read_leb128(bytes: &mut &[u8]) -> Option<u64> {
    leb128::read::unsigned(bytes).ok()
}

/// Runs Automerge code that touches no document on peer bytes, turning a
/// panic into [`StateError::BadChange`].
fn no_panic<T>(what: &str, f: impl FnOnce() -> T) -> Result<T, StateError> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).map_err(|payload| {
        StateError::BadChange(format!(
            "automerge panicked {what}: {}",
            panic_message(&*payload)
        ))
    })
}

fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic".into())
}

/// Most Bloom-filter probes accepted in a sync message (Automerge uses 7).
pub const MAX_BLOOM_PROBES: u64 = 64;

/// Refuses `have` Bloom filters that automerge 0.12 would trip over when it
/// answers: zero bits per entry makes `generate_sync_message` divide by
/// zero, and a huge probe count makes it allocate gigabytes (both found by
/// the `sync_message` fuzz target; reproducers in fuzz/regressions/).
fn check_blooms(msg: &automerge::sync::Message) -> Result<(), StateError> {
    for have in &msg.have {
        let bytes = have.bloom.to_bytes();
        let mut rest = bytes.as_slice();
        if rest.is_empty() {
            continue; // an empty filter: no entries
        }
        let (Some(entries), Some(bits_per_entry), Some(probes)) = (
            read_leb128(&mut rest),
            read_leb128(&mut rest),
            read_leb128(&mut rest),
        ) else {
            return Err(StateError::BadSyncMessage("truncated bloom filter".into()));
        };
        if entries > 0 && (bits_per_entry == 0 || rest.is_empty()) {
            return Err(StateError::BadSyncMessage(
                "bloom filter with entries but no bits".into(),
            ));
        }
        if probes > MAX_BLOOM_PROBES {
            return Err(StateError::BadSyncMessage(format!(
                "bloom filter with {probes} probes (at most {MAX_BLOOM_PROBES})"
            )));
        }
    }
    Ok(())
}

/// The first bytes of every Automerge storage chunk.
const CHUNK_MAGIC: [u8; 4] = [0x85, 0x6f, 0x4a, 0x83];

/// The document a sync message carries for a device that has nothing,
/// when it is one: its chunks concatenated, the first a document chunk
/// (Automerge's answer to a peer with no heads). [`Container::catch_up_whole`]
/// loads exactly these bytes as a snapshot loads at open. `None` for loose
/// changes.
pub fn whole_document(inbound: &SyncInbound) -> Option<Vec<u8>> {
    let bytes = inbound.msg.changes.iter().collect::<Vec<_>>().concat();
    starts_with_document(&bytes).then_some(bytes)
}

/// Whether `bytes` start with a document chunk (magic, checksum, type 0).
fn starts_with_document(bytes: &[u8]) -> bool {
    bytes.len() > 8 && bytes[..4] == CHUNK_MAGIC && bytes[8] == 0
}

/// Checks the change chunks a sync message carries the way
/// [`Container::apply_changes`] checks loose changes: automerge 0.12 would
/// load a non-canonically encoded change from a sync message just as it
/// does from `apply_changes`, and panic later. Each element of the chunk
/// list may hold several concatenated storage chunks (magic, checksum,
/// type, LEB128 length, body); every change chunk must parse as exactly
/// one change and be canonical. Document chunks (a peer sending its whole
/// document) are verified by Automerge itself against their heads.
fn check_sync_changes(msg: &automerge::sync::Message) -> Result<(), StateError> {
    const HEADER: usize = 9; // magic (4) + checksum (4) + chunk type (1)
    for element in msg.changes.iter() {
        let mut rest = element;
        while !rest.is_empty() {
            let bad = |why: &str| StateError::BadSyncMessage(format!("change chunk: {why}"));
            if rest.len() < HEADER || rest[..4] != CHUNK_MAGIC {
                return Err(bad("missing chunk header"));
            }
            let kind = rest[8];
            let mut body = &rest[HEADER..];
            let len = read_leb128(&mut body).ok_or_else(|| bad("truncated length"))?;
            let start = rest.len() - body.len();
            let end = usize::try_from(len)
                .ok()
                .and_then(|len| start.checked_add(len))
                .filter(|&end| end <= rest.len())
                .ok_or_else(|| bad("length past the end of the message"))?;
            let (chunk, tail) = rest.split_at(end);
            match kind {
                0 => {} // a whole document: Automerge checks its heads
                1 | 2 => {
                    let change = no_panic("parsing a change", || Change::try_from(chunk))
                        .map_err(|e| bad(&e.to_string()))?
                        .map_err(|e| bad(&e.to_string()))?;
                    check_canonical(&change)?;
                }
                other => return Err(bad(&format!("unknown chunk type {other}"))),
            }
            rest = tail;
        }
    }
    Ok(())
}

/// A sync-protocol message, decoded and its Bloom filters checked (cheap:
/// the changes it carries are only copied, not read). Their checks run
/// where they are applied.
pub struct SyncInbound {
    msg: automerge::sync::Message,
}

impl std::fmt::Debug for SyncInbound {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SyncInbound")
            .field("heads", &self.msg.heads.len())
            .field("change_bytes", &self.change_bytes())
            .finish()
    }
}

impl SyncInbound {
    /// Decodes an encoded sync-protocol message.
    pub fn decode(message: &[u8]) -> Result<Self, StateError> {
        let msg = no_panic("decoding a sync message", || {
            automerge::sync::Message::decode(message)
        })
        .map_err(|e| StateError::BadSyncMessage(e.to_string()))?
        .map_err(|e| StateError::BadSyncMessage(e.to_string()))?;
        check_blooms(&msg)?;
        Ok(SyncInbound { msg })
    }

    /// Bytes of changes (or of a whole document) the message carries: what
    /// receiving it costs grows with this.
    pub fn change_bytes(&self) -> usize {
        self.msg.changes.iter().map(|c| c.len()).sum()
    }

    /// Whether `doc` already holds every head this message names (then
    /// receiving it applies nothing).
    pub fn known_to(&self, doc: &Container) -> bool {
        holds_all(&doc.doc, &self.msg.heads)
    }
}

fn holds_all(doc: &Automerge, heads: &[ChangeHash]) -> bool {
    heads
        .iter()
        .all(|h| doc.get_change_meta_by_hash(h).is_some())
}

impl Container {
    /// An empty container whose local edits are attributed to `actor`.
    pub fn new(actor: &[u8]) -> Self {
        Container {
            doc: Automerge::new().with_actor(ActorId::from(actor)),
            poisoned: false,
            changes: 0,
        }
    }

    /// Whether Automerge panicked on input given to this container. A
    /// poisoned container holds an empty document and refuses further
    /// input; rebuild it from storage ([`Container::load`]).
    pub fn is_poisoned(&self) -> bool {
        self.poisoned
    }

    /// Runs an Automerge call on bytes from a peer. automerge 0.12 has
    /// panics reachable from well-formed but inconsistent input (found by
    /// fuzzing); a panic must not take the daemon down, and the document it
    /// interrupted cannot be trusted, so it is dropped and the container is
    /// marked poisoned.
    fn guarded<T>(
        &mut self,
        f: impl FnOnce(&mut Automerge) -> Result<T, StateError>,
    ) -> Result<T, StateError> {
        if self.poisoned {
            return Err(StateError::Poisoned("an earlier input".into()));
        }
        let doc = &mut self.doc;
        let why = match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(doc))) {
            // The closure found the document holding what it must not.
            Ok(Err(StateError::Poisoned(why))) => why,
            Ok(result) => return result,
            Err(payload) => panic_message(&*payload),
        };
        let actor = self.doc.get_actor().clone();
        self.doc = Automerge::new().with_actor(actor);
        self.poisoned = true;
        self.changes = 0;
        Err(StateError::Poisoned(why))
    }

    /// Rebuilds a container from a saved snapshot (if any) plus change bytes
    /// logged after it.
    pub fn load(
        actor: &[u8],
        snapshot: Option<&[u8]>,
        changes: impl IntoIterator<Item = Vec<u8>>,
    ) -> Result<Self, StateError> {
        let doc = match snapshot {
            Some(bytes) => {
                Automerge::load(bytes).map_err(|e| StateError::BadDocument(e.to_string()))?
            }
            None => Automerge::new(),
        };
        let mut c = Container {
            doc: doc.with_actor(ActorId::from(actor)),
            poisoned: false,
            changes: 0,
        };
        c.changes = c.history_len();
        c.apply_changes(changes)?;
        Ok(c)
    }

    /// Sets `key` to the JSON `value`. Returns the raw bytes of the new
    /// Automerge change, to be persisted and sent to peers, or `None` when
    /// the key already holds exactly this scalar (nothing changes).
    pub fn put(&mut self, key: &str, value: &Value) -> Result<Option<Vec<u8>>, StateError> {
        check_key(key)?;
        validate(value)?;
        let key = key.to_owned();
        let success = self
            .doc
            .transact(|tx| put_value(tx, &ROOT, automerge::Prop::Map(key), value, false))
            .map_err(|f| StateError::Automerge(f.error))?;
        match success.hash {
            Some(hash) => {
                self.changes += 1;
                self.change_bytes(&hash).map(Some)
            }
            None => Ok(None),
        }
    }

    /// Checks a key and value as [`Container::put`] would, without writing.
    pub fn check_entry(key: &str, value: &Value) -> Result<(), StateError> {
        check_key(key)?;
        validate(value)
    }

    /// Sets `key` to `value` inside a transaction of [`Container::transact`]
    /// (a batch of puts as one change). Check the entry with
    /// [`Container::check_entry`] first.
    pub fn put_in<T: Transactable>(tx: &mut T, key: &str, value: &Value) -> Result<(), StateError> {
        Self::check_entry(key, value)?;
        put_value(
            tx,
            &ROOT,
            automerge::Prop::Map(key.to_owned()),
            value,
            false,
        )
        .map_err(StateError::Automerge)
    }

    /// Runs `f` as one Automerge transaction. Returns the change bytes, or
    /// `None` when `f` changed nothing. An error from `f` rolls everything
    /// back.
    pub fn transact<E>(
        &mut self,
        f: impl FnOnce(&mut automerge::transaction::Transaction<'_>) -> Result<(), E>,
    ) -> Result<Option<Vec<u8>>, TransactError<E>> {
        let success = self
            .doc
            .transact(f)
            .map_err(|failure| TransactError::Rejected(failure.error))?;
        match success.hash {
            Some(hash) => {
                self.changes += 1;
                self.change_bytes(&hash)
                    .map(Some)
                    .map_err(TransactError::State)
            }
            None => Ok(None),
        }
    }

    /// Read access to the Automerge document (typed layers read through it).
    pub fn doc(&self) -> &Automerge {
        &self.doc
    }

    fn change_bytes(&self, hash: &ChangeHash) -> Result<Vec<u8>, StateError> {
        self.doc
            .get_change_by_hash(hash)
            .map(|c| c.raw_bytes().to_vec())
            .ok_or_else(|| StateError::BadChange("committed change not found".into()))
    }

    /// Applies remote change bytes in one batch (much cheaper per change than
    /// one at a time). Changes already present are ignored; changes whose
    /// dependencies are missing are held by Automerge until they arrive.
    pub fn apply_changes(
        &mut self,
        changes: impl IntoIterator<Item = Vec<u8>>,
    ) -> Result<Applied, StateError> {
        if self.poisoned {
            return Err(StateError::Poisoned("an earlier input".into()));
        }
        let mut parsed = Vec::new();
        let mut batch_max_op = HashMap::new();
        for bytes in changes {
            let change = no_panic("parsing a change", || Change::from_bytes(bytes))?
                .map_err(|e| StateError::BadChange(e.to_string()))?;
            if self.doc.get_change_by_hash(&change.hash()).is_none() {
                check_canonical(&change)?;
                // Refused before it is applied when its dependencies are at
                // hand; otherwise check_op_numbering catches it after.
                if let Some(expected) = expected_start_op(&self.doc, &batch_max_op, change.deps()) {
                    if change.start_op().get() != expected {
                        return Err(StateError::BadChange(format!(
                            "change starts at op {}, its dependencies end at op {}",
                            change.start_op(),
                            expected - 1
                        )));
                    }
                }
                batch_max_op.insert(change.hash(), change.max_op());
                parsed.push(change);
            }
        }
        if parsed.is_empty() {
            return Ok(Applied::default());
        }
        let result = self.guarded(|doc| {
            let before = doc.get_heads();
            doc.apply_changes(parsed)?;
            check_op_numbering(doc, &before)?;
            // Report everything that became part of the document, including
            // changes that earlier messages left waiting for their
            // dependencies and that this batch released: all of them must be
            // persisted.
            let new_changes = doc
                .get_changes(&before)
                .into_iter()
                .map(|c| c.raw_bytes().to_vec())
                .collect();
            Ok(Applied {
                new_changes,
                missing_deps: !doc.get_missing_deps(&[]).is_empty(),
            })
        });
        self.recount(result.as_ref().map(|a| a.new_changes.len()));
        result
    }

    /// Keeps the change count after input from a peer: adds what was
    /// applied, or counts afresh when an error left the document unknown.
    fn recount<E>(&mut self, added: Result<usize, E>) {
        match added {
            Ok(n) => self.changes += n,
            Err(_) if self.poisoned => self.changes = 0,
            Err(_) => self.changes = self.history_len(),
        }
    }

    /// The number of changes in the document's history, from Automerge's
    /// change graph: constant time, where counting `get_changes` rebuilt
    /// every change (150 ms of a 330 ms load at 100,000 changes).
    fn history_len(&self) -> usize {
        usize::try_from(self.doc.stats().num_changes).unwrap_or(usize::MAX)
    }

    /// The JSON value under `key`, if any. Renders only that value: one
    /// O(log n) lookup in the root map, not the whole container.
    pub fn get(&self, key: &str) -> Option<Value> {
        let (value, obj) = self.doc.get(ROOT, key).ok().flatten()?;
        Some(render(&self.doc, value, obj))
    }

    /// The whole container as a JSON object (keys sorted).
    pub fn to_json(&self) -> Value {
        render(&self.doc, automerge::Value::map(), ROOT)
    }

    /// Current heads, sorted.
    pub fn heads(&self) -> Vec<Hash> {
        let mut h: Vec<Hash> = self.doc.get_heads().into_iter().map(|h| h.0).collect();
        h.sort();
        h
    }

    /// Number of changes in the document's history.
    pub fn change_count(&self) -> usize {
        self.changes
    }

    /// The document in Automerge's standard binary format.
    pub fn save(&self) -> Vec<u8> {
        self.doc.save()
    }

    /// The raw changes made after `heads` (all of them for no heads, or
    /// when some of `heads` are unknown here), in causal order: what a
    /// holder of `heads` lacks.
    pub fn changes_since(&self, heads: &[Hash]) -> Vec<Vec<u8>> {
        let have: Vec<ChangeHash> = if self.has_all(heads) {
            heads.iter().map(|h| ChangeHash(*h)).collect()
        } else {
            Vec::new()
        };
        self.doc
            .get_changes(&have)
            .iter()
            .map(|c| c.raw_bytes().to_vec())
            .collect()
    }

    /// Whether this document already contains every change in `heads`.
    pub fn has_all(&self, heads: &[Hash]) -> bool {
        heads
            .iter()
            .all(|h| self.doc.get_change_by_hash(&ChangeHash(*h)).is_some())
    }

    /// Applies only the changes a sync message carries, leaving every sync
    /// state alone, and returns the raw bytes of what became part of the
    /// document (to be persisted). This is the expensive half of receiving
    /// a big message, meant for a worker thread on a [`Container::fork`];
    /// [`Container::receive_inbound`] of the same message afterwards costs
    /// almost nothing.
    pub fn catch_up(&mut self, inbound: &SyncInbound) -> Result<Vec<Vec<u8>>, StateError> {
        check_sync_changes(&inbound.msg)?;
        if inbound.msg.changes.is_empty() {
            return Ok(Vec::new());
        }
        let bytes = inbound.msg.changes.iter().collect::<Vec<_>>().concat();
        self.integrate(|doc| doc.load_incremental(&bytes).map(drop))
    }

    /// [`Container::catch_up`] into a document that holds nothing yet (a
    /// cold sync): the same checks, but only the number of changes that
    /// came is returned, without rebuilding each of them (150 ms at
    /// 100,000 changes); the caller persists the whole document as one
    /// snapshot. A document ([`whole_document`]) into an empty document
    /// loads exactly as [`Container::load`] loads a snapshot (strictly),
    /// so that its bytes can be stored as that snapshot as they came,
    /// without saving the document again; loose changes load as before
    /// (those whose dependencies are missing wait in Automerge's queue).
    pub fn catch_up_whole(&mut self, inbound: &SyncInbound) -> Result<usize, StateError> {
        check_sync_changes(&inbound.msg)?;
        if inbound.msg.changes.is_empty() {
            return Ok(0);
        }
        let bytes = inbound.msg.changes.iter().collect::<Vec<_>>().concat();
        let had = self.changes;
        let result = self.guarded(|doc| {
            let before = doc.get_heads();
            if before.is_empty() && starts_with_document(&bytes) {
                let actor = doc.get_actor().clone();
                *doc = Automerge::load(&bytes)?.with_actor(actor);
            } else {
                doc.load_incremental(&bytes)?;
            }
            if doc.get_heads() == before {
                return Ok(0);
            }
            check_op_numbering(doc, &before)?;
            let now = usize::try_from(doc.stats().num_changes).unwrap_or(usize::MAX);
            Ok(now.saturating_sub(had))
        });
        self.recount(result.as_ref().copied());
        result
    }

    /// Runs `f` (which takes a peer's input into the document) guarded
    /// against panics, checks the operation numbering of what it added,
    /// keeps the change count, and returns the raw bytes of every change
    /// that became part of the document.
    fn integrate(
        &mut self,
        f: impl FnOnce(&mut Automerge) -> Result<(), automerge::AutomergeError>,
    ) -> Result<Vec<Vec<u8>>, StateError> {
        let result = self.guarded(|doc| {
            let before = doc.get_heads();
            f(doc)?;
            if doc.get_heads() == before {
                return Ok(Vec::new());
            }
            check_op_numbering(doc, &before)?;
            Ok(doc
                .get_changes(&before)
                .into_iter()
                .map(|c| c.raw_bytes().to_vec())
                .collect::<Vec<_>>())
        });
        self.recount(result.as_ref().map(Vec::len));
        result
    }

    /// Operations in the document: what copying it ([`Container::fork`])
    /// costs grows with this.
    pub fn op_count(&self) -> u64 {
        self.doc.stats().num_ops
    }

    /// A copy of this container (same actor, same history): the base of a
    /// catch-up run on another thread. Costs a copy of the document.
    pub fn fork(&self) -> Container {
        Container {
            doc: self.doc.clone(),
            poisoned: self.poisoned,
            changes: self.changes,
        }
    }

    /// Next Automerge sync-protocol message for a peer, if one is due.
    ///
    /// When the peer's last heads are this document's, both hold the same
    /// changes, and nothing is to be sent but what the peer asked for by
    /// hash. Automerge would still test every change since the peer's last
    /// sync against the peer's bloom filter: all of them after a device
    /// that had nothing took in a whole document (60 ms of the loop at
    /// 100,000 changes). The filter is set aside for that one call.
    pub fn generate_sync_message(&self, state: &mut SyncState) -> Option<Vec<u8>> {
        let heads = self.doc.get_heads();
        let same = !heads.is_empty() && state.their_heads.as_deref() == Some(heads.as_slice());
        let set_aside = match &mut state.their_have {
            Some(have) if same && !have.is_empty() => Some(std::mem::take(have)),
            _ => None,
        };
        let message = self.doc.generate_sync_message(state);
        if let Some(have) = set_aside {
            state.their_have = Some(have);
        }
        message.map(|m| m.encode())
    }

    /// Receives one Automerge sync-protocol message. Returns whether the
    /// document changed, and the new change bytes so the caller can persist
    /// them.
    pub fn receive_sync_message(
        &mut self,
        state: &mut SyncState,
        message: &[u8],
    ) -> Result<Vec<Vec<u8>>, StateError> {
        self.receive_inbound(state, SyncInbound::decode(message)?)
    }

    /// Receives a decoded sync-protocol message (see
    /// [`Container::receive_sync_message`]). When this document already
    /// holds every head the message names, the changes it carries are
    /// dropped unread: they are all ancestors of those heads, and reading
    /// a whole document again (the answer to a device that had nothing)
    /// would cost as much as loading it. This is how a catch-up applied by
    /// [`Container::catch_up`] on another thread is then received cheaply.
    pub fn receive_inbound(
        &mut self,
        state: &mut SyncState,
        inbound: SyncInbound,
    ) -> Result<Vec<Vec<u8>>, StateError> {
        let mut msg = inbound.msg;
        if !msg.changes.is_empty() && holds_all(&self.doc, &msg.heads) {
            msg.changes = automerge::sync::ChunkList::empty();
        }
        check_sync_changes(&msg)?;
        self.integrate(|doc| doc.receive_sync_message(state, msg))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // Goal: the kept change count always equals Automerge's own count,
    // whatever path the changes took: local puts and transactions,
    // applied batches (with duplicates), the sync protocol, and load.
    #[test]
    fn change_count_follows_the_history() {
        let truth = |c: &Container| c.doc().get_changes(&[]).len();
        let mut a = Container::new(&[1; 16]);
        let mut changes = Vec::new();
        for i in 0..5 {
            changes.push(
                a.put(&format!("k{i}"), &serde_json::json!(i))
                    .unwrap()
                    .unwrap(),
            );
        }
        a.transact(|tx| Container::put_in(tx, "t", &serde_json::json!(1)))
            .unwrap();
        assert_eq!(a.change_count(), 6);
        assert_eq!(a.change_count(), truth(&a));
        let mut b = Container::new(&[2; 16]);
        b.apply_changes(changes[..3].to_vec()).unwrap();
        b.apply_changes(changes.clone()).unwrap();
        assert_eq!((b.change_count(), truth(&b)), (5, 5));
        let mut c = Container::new(&[3; 16]);
        let (mut sa, mut sc) = (SyncState::new(), SyncState::new());
        for _ in 0..10 {
            if let Some(m) = a.generate_sync_message(&mut sa) {
                c.receive_sync_message(&mut sc, &m).unwrap();
            }
            if let Some(m) = c.generate_sync_message(&mut sc) {
                a.receive_sync_message(&mut sa, &m).unwrap();
            }
        }
        assert_eq!((c.change_count(), truth(&c)), (6, 6));
        let loaded = Container::load(&[4; 16], Some(&a.save()), changes).unwrap();
        assert_eq!((loaded.change_count(), truth(&loaded)), (6, 6));
    }
    use serde_json::json;

    // Goal: setting the peer's bloom filter aside when both hold the same
    // heads changes nothing Automerge would send: every message and sync
    // state equals Automerge's own, through a device that had nothing
    // taking in a whole document (the case it is for), and a write after
    // that still goes out.
    #[test]
    fn messages_between_devices_in_sync_are_automerge_own() {
        let mut set_aside = 0;
        let mut send = |from: &Container, state: &mut SyncState| {
            if !from.heads().is_empty()
                && state.their_heads.as_deref() == Some(from.doc.get_heads().as_slice())
                && state.their_have.as_ref().is_some_and(|h| !h.is_empty())
            {
                set_aside += 1;
            }
            let mut plain = state.clone();
            let want = from
                .doc
                .generate_sync_message(&mut plain)
                .map(|m| m.encode());
            let got = from.generate_sync_message(state);
            assert_eq!(got, want);
            assert_eq!(*state, plain);
            got
        };
        let mut a = Container::new(&[1; 16]);
        for i in 0..300 {
            a.put(&format!("k{i}"), &json!(i)).unwrap();
        }
        let mut b = Container::new(&[2; 16]);
        let (mut sa, mut sb) = (SyncState::new(), SyncState::new());
        let mut exchange =
            |a: &mut Container, b: &mut Container, sa: &mut SyncState, sb: &mut SyncState| {
                for _ in 0..10 {
                    let to_b = send(a, sa);
                    if let Some(m) = &to_b {
                        b.receive_sync_message(sb, m).unwrap();
                    }
                    let to_a = send(b, sb);
                    if let Some(m) = &to_a {
                        a.receive_sync_message(sa, m).unwrap();
                    }
                    if to_a.is_none() && to_b.is_none() {
                        return;
                    }
                }
                panic!("no convergence in 10 rounds");
            };
        exchange(&mut a, &mut b, &mut sa, &mut sb);
        assert_eq!(b.to_json(), a.to_json());
        b.put("late", &json!("after the whole document")).unwrap();
        exchange(&mut a, &mut b, &mut sa, &mut sb);
        assert_eq!(a.get("late"), Some(json!("after the whole document")));
        assert!(set_aside > 0, "the case never came up");
    }

    // Goal: a whole document that came into an empty container can be
    // stored as it came: those bytes load (as a snapshot at the next start)
    // to exactly the caught-up document; and bytes that would not load so
    // (a trailing partial chunk) are refused, not stored to fail at start.
    #[test]
    fn a_whole_document_is_stored_as_it_came() {
        let mut a = Container::new(&[1; 16]);
        for i in 0..50 {
            a.put(&format!("k{i}"), &json!(i)).unwrap();
        }
        // The exchange until `a` sends its whole document to a device that
        // has nothing (Automerge's message v2).
        let fresh = Container::new(&[2; 16]);
        let (mut sa, mut sb) = (SyncState::new(), SyncState::new());
        let mut whole = None;
        let mut b = fresh.fork();
        for _ in 0..5 {
            if let Some(m) = a.generate_sync_message(&mut sa) {
                let inbound = SyncInbound::decode(&m).unwrap();
                if inbound.change_bytes() > 0 {
                    whole = Some(m);
                    break;
                }
                b.receive_sync_message(&mut sb, &m).unwrap();
            }
            if let Some(m) = b.generate_sync_message(&mut sb) {
                a.receive_sync_message(&mut sa, &m).unwrap();
            }
        }
        let whole = whole.expect("a sent its document");
        let inbound = SyncInbound::decode(&whole).unwrap();
        let mut caught = fresh.fork();
        assert_eq!(caught.catch_up_whole(&inbound).unwrap(), 50);
        let bytes = whole_document(&inbound).expect("a document chunk");
        let stored = Container::load(&[2; 16], Some(&bytes), []).unwrap();
        assert_eq!(stored.heads(), a.heads());
        assert_eq!(stored.heads(), caught.heads());
        assert_eq!(stored.to_json(), caught.to_json());
        assert_eq!(stored.change_count(), 50);

        // The same document with half a chunk after it.
        let mut chunks: Vec<Vec<u8>> = inbound.msg.changes.iter().map(|c| c.to_vec()).collect();
        let extra = a.doc.get_last_local_change().unwrap().raw_bytes().to_vec();
        chunks.push(extra[..extra.len() / 2].to_vec());
        let mut msg = inbound.msg.clone();
        msg.changes = automerge::sync::ChunkList::from(chunks);
        let torn = SyncInbound { msg };
        let mut refused = fresh.fork();
        assert!(refused.catch_up_whole(&torn).is_err());
        assert!(refused.heads().is_empty());

        // A document with a flipped byte in its body is refused too.
        let mut chunks: Vec<Vec<u8>> = inbound.msg.changes.iter().map(|c| c.to_vec()).collect();
        let last = chunks[0].len() - 1;
        chunks[0][last] ^= 0xff;
        let mut msg = inbound.msg.clone();
        msg.changes = automerge::sync::ChunkList::from(chunks);
        let mut refused = fresh.fork();
        assert!(refused.catch_up_whole(&SyncInbound { msg }).is_err());
        assert!(refused.heads().is_empty());

        // Loose changes are no document: they load as before (one whose
        // dependency is missing waits in Automerge's queue), and are not
        // stored as a snapshot.
        let mut msg = inbound.msg.clone();
        msg.changes = automerge::sync::ChunkList::from(vec![extra]);
        let loose = SyncInbound { msg };
        assert_eq!(whole_document(&loose), None);
        let mut waiting = fresh.fork();
        assert_eq!(waiting.catch_up_whole(&loose).unwrap(), 0);
        assert!(waiting.heads().is_empty());
    }

    // Goal: the renderer behind `get` and `to_json` gives exactly what
    // Automerge's own serde rendering gives, for every kind of value
    // (nested maps and lists, text, counters, timestamps, bytes, null), and
    // `get` of one key equals that key of the whole rendering.
    #[test]
    fn rendering_matches_automerge_serde() {
        use automerge::AutoSerde;
        let mut c = Container::new(b"aaaa");
        c.put(
            "plain",
            &json!({"a": [1, "two", null, {"b": [true, 2.5]}], "c": {}}),
        )
        .unwrap();
        c.put("n", &json!(-3)).unwrap();
        c.transact::<automerge::AutomergeError>(|tx| {
            let text = tx.put_object(ROOT, "text", ObjType::Text)?;
            tx.splice_text(&text, 0, 0, "hello")?;
            tx.put(ROOT, "counter", ScalarValue::counter(7))?;
            tx.put(ROOT, "time", ScalarValue::Timestamp(1_700_000_000_000))?;
            tx.put(ROOT, "bytes", ScalarValue::Bytes(vec![1, 2, 3]))?;
            let list = tx.put_object(ROOT, "list", ObjType::List)?;
            let inner = tx.insert_object(&list, 0, ObjType::Map)?;
            tx.put(&inner, "deep", "x")?;
            Ok(())
        })
        .unwrap();
        let reference = serde_json::to_value(AutoSerde::from(c.doc())).unwrap();
        assert_eq!(c.to_json(), reference);
        for key in ["plain", "n", "text", "counter", "time", "bytes", "list"] {
            assert_eq!(c.get(key).as_ref(), reference.get(key), "{key}");
        }
        assert_eq!(c.get("missing"), None);
    }

    // Goal: a document nested far deeper than a call stack allows (a peer
    // can build one; `put` refuses such values locally) renders without
    // overflowing the stack.
    #[test]
    fn very_deep_documents_render_without_recursion() {
        let mut c = Container::new(b"aaaa");
        c.transact::<automerge::AutomergeError>(|tx| {
            let mut obj = tx.put_object(ROOT, "deep", ObjType::Map)?;
            for _ in 0..100_000 {
                obj = tx.put_object(&obj, "d", ObjType::Map)?;
            }
            Ok(())
        })
        .unwrap();
        let mut v = c.get("deep").unwrap();
        let mut levels = 0;
        while let Some(next) = v.get_mut("d").map(Value::take) {
            v = next;
            levels += 1;
        }
        assert_eq!(levels, 100_000);
        // Dropping a 100k-deep serde_json::Value recurses, so leak it.
        std::mem::forget(c.to_json());
    }

    // Goal: the two hostile sync messages the fuzzer found (a Bloom filter
    // with zero bits per entry, one with 2^32-1 probes) are refused with a
    // typed error, and the container still answers afterwards instead of
    // panicking or allocating gigabytes. Regression for
    // fuzz/regressions/sync_message/.
    #[test]
    fn hostile_bloom_filters_are_refused() {
        let crash = hex_bytes(
            "4201d8309c232f7d263dacf5c113802bcc439fb47115c670f12ebc35d7dc65db44ce00010008070000000000000000020284",
        );
        let oom = hex_bytes(
            "4201d8309c232f7d263dacf5c113802bcc439fb47115c670f12ebc35d7dc65db44ce000100080701ffffffff0f0000020284",
        );
        for (name, msg) in [("zero bits", crash), ("huge probes", oom)] {
            let mut c = Container::new(b"aaaa");
            c.put("k", &json!(1)).unwrap();
            let mut state = SyncState::new();
            let err = c.receive_sync_message(&mut state, &msg).unwrap_err();
            assert!(
                matches!(err, StateError::BadSyncMessage(_)),
                "{name}: {err}"
            );
            // The container still works and can answer a well-formed peer.
            assert!(c.generate_sync_message(&mut state).is_some(), "{name}");
        }
    }

    // Goal: a change whose bytes are not Automerge's canonical encoding
    // (found by fuzzing; Automerge would accept it and panic later when
    // listing changes) is refused, and the container stays usable.
    #[test]
    fn non_canonical_changes_are_refused() {
        let bad = hex_bytes(
            "856f4a83f46f6d2a0135000e6e7577612d66757a7a2d706565720101080000061507340142025602570570027f057469746c65017f017f5668656e65737400",
        );
        let mut c = Container::new(b"aaaa");
        c.put("k", &json!(1)).unwrap();
        let err = c.apply_changes([bad]).unwrap_err();
        assert!(err.to_string().contains("canonical"), "{err}");
        assert_eq!(c.get("k"), Some(json!(1)));
        assert_eq!(c.change_count(), 1);
        // Ordinary changes from another replica still apply.
        let mut other = Container::new(b"bbbb");
        let change = other.put("x", &json!("y")).unwrap().unwrap();
        assert_eq!(c.apply_changes([change]).unwrap().new_changes.len(), 1);
    }

    // Goal: the same non-canonical change carried inside a sync message
    // (alone, or concatenated after a valid change in one chunk-list
    // element) is refused before Automerge loads it; garbage and truncated
    // chunks are typed errors; the container is unchanged and a normal
    // sync message still applies.
    #[test]
    fn non_canonical_changes_in_sync_messages_are_refused() {
        use automerge::sync::{ChunkList, Message};
        let bad = hex_bytes(
            "856f4a83f46f6d2a0135000e6e7577612d66757a7a2d706565720101080000061507340142025602570570027f057469746c65017f017f5668656e65737400",
        );
        let mut other = Container::new(b"bbbb");
        let good = other.put("x", &json!("y")).unwrap().unwrap();
        let mut sender = SyncState::new();
        let template = other.generate_sync_message(&mut sender).unwrap();
        let with = |elements: Vec<Vec<u8>>| {
            let mut m = Message::decode(&template).unwrap();
            m.changes = ChunkList::from(elements);
            m.encode()
        };
        let mut c = Container::new(b"aaaa");
        c.put("k", &json!(1)).unwrap();
        let heads = c.heads();
        let cases = [
            ("alone", with(vec![bad.clone()]), "canonical"),
            (
                "after a good one",
                with(vec![[good.clone(), bad.clone()].concat()]),
                "canonical",
            ),
            ("garbage", with(vec![vec![1, 2, 3]]), "chunk header"),
            (
                "truncated",
                with(vec![good[..good.len() - 1].to_vec()]),
                "past the end",
            ),
        ];
        for (name, msg, why) in cases {
            let err = c
                .receive_sync_message(&mut SyncState::new(), &msg)
                .unwrap_err();
            assert!(
                matches!(
                    err,
                    StateError::BadSyncMessage(_) | StateError::BadChange(_)
                ),
                "{name}: {err}"
            );
            assert!(err.to_string().contains(why), "{name}: {err}");
            assert_eq!(c.heads(), heads, "{name}");
        }
        let new = c
            .receive_sync_message(&mut SyncState::new(), &with(vec![good]))
            .unwrap();
        assert_eq!(new.len(), 1);
        assert_eq!(c.get("x"), Some(json!("y")));
    }

    // Goal: a change that makes automerge 0.12 panic inside apply (seq 101
    // of an actor the document has never seen, no deps: Automerge looks the
    // actor up and unwraps; found by fuzzing, kept in fuzz/regressions/)
    // is a typed error, by apply_changes and inside a sync message, and the
    // container is marked poisoned (empty, refusing input) instead of
    // taking the process down.
    #[test]
    fn automerge_panics_poison_the_container() {
        use automerge::sync::{ChunkList, Message};
        let bad = hex_bytes(
            "856f4a83f46f6d2a0135000e6e7577612d66757a7a2d720165706501000000000000003f42025602570570027f057469050000000000000068656c6c6f7f00",
        );
        let mut c = Container::new(b"aaaa");
        c.put("k", &json!(1)).unwrap();
        let err = c.apply_changes([bad.clone()]).unwrap_err();
        assert!(matches!(err, StateError::Poisoned(_)), "{err}");
        assert!(c.is_poisoned());
        assert_eq!(c.change_count(), 0, "the interrupted document is dropped");
        let err = c.apply_changes([bad.clone()]).unwrap_err();
        assert!(matches!(err, StateError::Poisoned(_)), "{err}");

        // The fuzzer's bytes carry a wrong checksum, which the sync path
        // checks and apply_changes did not; with the checksum fixed, the
        // sync path reaches the same panic.
        let mut fixed = bad.clone();
        let hash = Change::from_bytes(bad).unwrap().hash();
        fixed[4..8].copy_from_slice(&hash.0[..4]);
        let mut other = Container::new(b"bbbb");
        other.put("x", &json!("y")).unwrap();
        let template = other.generate_sync_message(&mut SyncState::new()).unwrap();
        let mut m = Message::decode(&template).unwrap();
        m.changes = ChunkList::from(vec![fixed]);
        let mut c = Container::new(b"aaaa");
        let err = c
            .receive_sync_message(&mut SyncState::new(), &m.encode())
            .unwrap_err();
        assert!(matches!(err, StateError::Poisoned(_)), "{err}");
        assert!(c.is_poisoned());
        // A fresh container is not affected.
        let mut d = Container::new(b"aaaa");
        assert!(!d.is_poisoned());
        d.put("k", &json!(2)).unwrap();
    }

    // Goal: a change whose decoding panics inside automerge 0.12 (an op
    // refers to an actor index the change does not list; found by fuzzing,
    // kept in fuzz/regressions/) is refused as a malformed change, before
    // the document is touched: no poisoning, the container keeps its data.
    #[test]
    fn changes_automerge_cannot_decode_are_refused() {
        let bad = hex_bytes(
            "856f4a83cb7c6722017c01f46f6d2a44b7ffcdb09bfb3b6a15f7e37141e3fe4ef7ae07f94e31c2af1263010e6e7577612d66757a7a2d7065657202020000000a0104020611061307150b3403420556055701700200010321000102027f0400027f00000100017e000300017f046c69737400027f01610102017c020100017e00140200010400",
        );
        let mut c = Container::new(b"aaaa");
        c.put("k", &json!(1)).unwrap();
        let err = c.apply_changes([bad]).unwrap_err();
        assert!(matches!(err, StateError::BadChange(_)), "{err}");
        assert!(err.to_string().contains("panicked decoding"), "{err}");
        assert!(!c.is_poisoned());
        assert_eq!(c.get("k"), Some(json!(1)));
    }

    // Goal: a change whose first op does not follow its dependencies' last
    // op (seq 1, no deps, starting at op 2; found by fuzzing: automerge
    // 0.12 applied it, then saved a document it could not load, so the
    // daemon would not have started after its next compaction) is refused
    // before it is applied when it comes alone, and poisons the container
    // when it comes inside a sync message (Automerge applies those itself);
    // a legitimate chain of changes still applies both ways.
    #[test]
    fn changes_with_misnumbered_ops_are_refused() {
        use automerge::sync::{ChunkList, Message};
        let bad = hex_bytes(
            "856f4a83f46f6d2a0135000e6e7577612d66700200017f0000020102030400027f000000000302230b3403420b560b57746c8f1507d101420256026c6f27ac",
        );
        let mut c = Container::new(b"aaaa");
        c.put("k", &json!(1)).unwrap();
        let err = c.apply_changes([bad.clone()]).unwrap_err();
        assert!(matches!(err, StateError::BadChange(_)), "{err}");
        assert!(err.to_string().contains("starts at op 2"), "{err}");
        assert!(!c.is_poisoned());

        let mut fixed = bad.clone();
        let hash = Change::from_bytes(bad).unwrap().hash();
        fixed[4..8].copy_from_slice(&hash.0[..4]);
        let mut other = Container::new(b"bbbb");
        let first = other.put("x", &json!(1)).unwrap().unwrap();
        let second = other.put("y", &json!(2)).unwrap().unwrap();
        let template = other.generate_sync_message(&mut SyncState::new()).unwrap();
        let with = |elements: Vec<Vec<u8>>| {
            let mut m = Message::decode(&template).unwrap();
            m.changes = ChunkList::from(elements);
            m.encode()
        };
        let err = c
            .receive_sync_message(&mut SyncState::new(), &with(vec![fixed]))
            .unwrap_err();
        assert!(matches!(err, StateError::Poisoned(_)), "{err}");
        assert!(c.is_poisoned());

        let mut d = Container::new(b"aaaa");
        d.put("k", &json!(1)).unwrap();
        let new = d
            .receive_sync_message(&mut SyncState::new(), &with(vec![first, second]))
            .unwrap();
        assert_eq!(new.len(), 2);
        assert_eq!(d.get("y"), Some(json!(2)));
        let mut e = Container::new(b"cccc");
        assert_eq!(e.apply_changes(new).unwrap().new_changes.len(), 2);
        let saved = e.save();
        assert!(Container::load(b"cccc", Some(&saved), []).is_ok());
    }

    fn hex_bytes(s: &str) -> Vec<u8> {
        (0..s.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
            .collect()
    }

    // Goal: concurrent puts on two replicas converge to the same JSON once
    // each has the other's changes, whichever order they arrive in.
    #[test]
    fn concurrent_puts_converge() {
        let mut a = Container::new(b"aaaa");
        let mut b = Container::new(b"bbbb");
        let ca = a
            .put("k", &json!({"from": "a", "n": [1, 2]}))
            .unwrap()
            .unwrap();
        let cb = b.put("k", &json!("b")).unwrap().unwrap();
        let cb2 = b.put("other", &json!(3.5)).unwrap().unwrap();
        // Writing the same scalar again changes nothing and is not an error.
        assert_eq!(b.put("other", &json!(3.5)).unwrap(), None);
        a.apply_changes([cb2.clone(), cb.clone()]).unwrap();
        b.apply_changes([ca]).unwrap();
        assert_eq!(a.to_json(), b.to_json());
        assert_eq!(a.heads(), b.heads());
        assert_eq!(a.get("other"), Some(json!(3.5)));
    }

    // Goal: a snapshot plus later change bytes reloads to the same state.
    #[test]
    fn save_and_load() {
        let mut a = Container::new(b"aaaa");
        a.put("x", &json!([true, null, "s", -4, u64::MAX])).unwrap();
        let snap = a.save();
        let later = a.put("y", &json!({"z": 1})).unwrap().unwrap();
        let b = Container::load(b"aaaa", Some(&snap), [later]).unwrap();
        assert_eq!(a.to_json(), b.to_json());
        assert_eq!(
            b.to_json(),
            json!({"x": [true, null, "s", -4, u64::MAX], "y": {"z": 1}})
        );
    }

    // Goal: the sync protocol brings two diverged replicas to equal heads.
    #[test]
    fn sync_protocol_converges() {
        let mut a = Container::new(b"aaaa");
        let mut b = Container::new(b"bbbb");
        for i in 0..50 {
            a.put(&format!("a{i}"), &json!(i)).unwrap();
            b.put(&format!("b{i}"), &json!(i)).unwrap();
        }
        let (mut sa, mut sb) = (SyncState::new(), SyncState::new());
        for _ in 0..10 {
            if let Some(m) = a.generate_sync_message(&mut sa) {
                b.receive_sync_message(&mut sb, &m).unwrap();
            }
            if let Some(m) = b.generate_sync_message(&mut sb) {
                a.receive_sync_message(&mut sa, &m).unwrap();
            }
        }
        assert_eq!(a.heads(), b.heads());
        assert_eq!(a.to_json(), b.to_json());
    }

    // Goal: arrays whose runs of scalars go in as one splice read back
    // exactly, mixed with nested arrays and objects at any position, and
    // a peer applying the change reads the same. Method: one mixed value,
    // read on the writer and on a second container.
    #[test]
    fn spliced_arrays_read_back_exactly() {
        let v = json!([1, 2, {"a": [3, 4, "x", null, true]}, 5, [6], 7.5, "s", [], {}, -9]);
        let mut a = Container::new(b"aaaa");
        let change = a.put("k", &v).unwrap().unwrap();
        assert_eq!(a.to_json()["k"], v);
        let mut b = Container::new(b"bbbb");
        b.apply_changes([change]).unwrap();
        assert_eq!(b.to_json()["k"], v);
        let big: Value = (0..5_000).map(|i| json!(i)).collect();
        a.put("big", &big).unwrap();
        assert_eq!(a.to_json()["big"], big);
        // Big trees go in with one batch create: objects, arrays of
        // objects, nested both ways; a peer reads the same.
        let members: serde_json::Map<String, Value> =
            (0..2_000).map(|i| (format!("m{i}"), json!(i))).collect();
        let tree = json!({
            "members": members,
            "rows": (0..300).map(|i| json!({"i": i, "s": "x", "t": [i, {"u": null}]})).collect::<Vec<_>>(),
        });
        a.put("tree", &tree).unwrap().unwrap();
        assert_eq!(a.to_json()["tree"], tree);
        let all: Vec<Vec<u8>> = a
            .doc()
            .get_changes(&[])
            .into_iter()
            .map(|c| c.raw_bytes().to_vec())
            .collect();
        b.apply_changes(all).unwrap();
        assert_eq!(b.to_json()["tree"], tree);
        // Replaced by a small value, then by a big one again.
        a.put("tree", &json!({"small": 1})).unwrap();
        a.put("tree", &tree).unwrap();
        assert_eq!(a.to_json()["tree"], tree);
    }

    // Goal: bad input is refused with a typed error and changes nothing.
    #[test]
    fn rejects_bad_input() {
        let mut a = Container::new(b"aaaa");
        assert!(matches!(
            a.put("", &json!(1)),
            Err(StateError::InvalidKey { .. })
        ));
        let mut deep = json!(1);
        for _ in 0..100 {
            deep = json!([deep]);
        }
        assert!(matches!(a.put("k", &deep), Err(StateError::TooDeep)));
        assert!(matches!(
            a.apply_changes([vec![1, 2, 3]]),
            Err(StateError::BadChange(_))
        ));
        let mut st = SyncState::new();
        assert!(matches!(
            a.receive_sync_message(&mut st, &[0xff]),
            Err(StateError::BadSyncMessage(_))
        ));
        assert_eq!(a.to_json(), json!({}));
        assert!(a.heads().is_empty());
    }
}
