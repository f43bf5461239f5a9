//! The Agent State Model on a device: the replicated schema registry, the
//! core models, the `state.*` tools and the control plane (describe,
//! compact, reset), and the lifecycle task (TTL and retention).
//!
//! Each schema's container is named by its `$id` and is one Automerge
//! document, created by `nuwa_asm::doc::genesis_change` so that devices
//! that create it independently hold the same one. Registered schemas live
//! in the replicated map container [`REGISTRY_CONTAINER`] (`$id` → schema
//! JSON), so every device validates and queries with the same schemas.

use std::collections::BTreeMap;

use nuwa_asm::model::RetentionStrategy;
use nuwa_asm::registry::{Registered, Registry};
use nuwa_asm::schema::AsmSchema;
use nuwa_asm::{doc, query};
use serde_json::{Value, json};
use tracing::{info, warn};

use crate::agent::{Agent, Out};
use crate::api::{ApiError, BatchOp, DeleteMode, ErrorCode, Tool};
use crate::constants::*;
use crate::count::Count;
use crate::effect::Effect;

/// The replicated map container holding registered schemas.
pub const REGISTRY_CONTAINER: &str = "nuwa:schemas";

/// The schema registry that the registry container `c` holds (the core
/// models alone without it), and each replicated schema that does not
/// register. The daemon rebuilds it when the container changes;
/// `state get --offline` builds it from the store.
///
/// A registered schema is immutable, on every device: only the first value
/// put under an `$id` counts (a put with no predecessor; of concurrent
/// first puts, the one with the greatest operation id, as Automerge picks).
/// A later put under that key (an overwrite a peer made with an untyped
/// write, which `POST /v1/schemas` would refuse) is refused here, on merge,
/// and reported; so is an entry whose key is not its schema's `$id`.
pub fn registry_of(c: Option<&nuwa_state::Container>) -> (Registry, Vec<String>) {
    let mut reg = Registry::with_core();
    let mut refused = Vec::new();
    let Some(c) = c else {
        return (reg, refused);
    };
    let (firsts, overwrites) = first_puts(c.doc());
    for key in overwrites {
        refused.push(format!(
            "an overwrite of schema {key} (a registered schema never changes; publish a new version)"
        ));
    }
    // Register lower versions first so version bumps apply in order.
    let mut raws: Vec<Value> = Vec::new();
    for (key, text) in firsts {
        match serde_json::from_str::<Value>(&text) {
            Ok(raw) if raw["$id"].as_str() == Some(key.as_str()) => raws.push(raw),
            _ => refused.push(format!(
                "the registry entry {key} is not a schema with that $id"
            )),
        }
    }
    raws.sort_by_key(|v| {
        nuwa_asm::schema::SchemaId::parse(v["$id"].as_str().unwrap_or(""))
            .map(|i| (i.base, i.version))
            .unwrap_or_default()
    });
    for raw in raws {
        if let Err(e) = reg.register(raw) {
            refused.push(e.to_string());
        }
    }
    (reg, refused)
}

/// Each root key's first string value in the registry document's history
/// (see [`registry_of`]), and the keys that a later put tried to change.
fn first_puts(
    doc: &nuwa_state::automerge::Automerge,
) -> (
    std::collections::BTreeMap<String, String>,
    std::collections::BTreeSet<String>,
) {
    use nuwa_state::automerge::ScalarValue;
    use nuwa_state::automerge::legacy::{Key, ObjectId, OpType};
    use std::collections::{BTreeMap, BTreeSet};
    // key -> ((op counter, actor bytes), text) of the winning first put.
    let mut firsts: BTreeMap<String, ((u64, Vec<u8>), String)> = BTreeMap::new();
    let mut later: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for change in doc.get_changes(&[]) {
        let expanded = change.decode();
        let actor = expanded.actor_id.to_bytes().to_vec();
        for (i, op) in expanded.operations.iter().enumerate() {
            let (ObjectId::Root, Key::Map(key), OpType::Put(ScalarValue::Str(text))) =
                (&op.obj, &op.key, &op.action)
            else {
                continue;
            };
            let (key, text) = (key.to_string(), text.to_string());
            if !op.pred.is_empty() {
                later.entry(key).or_default().push(text);
                continue;
            }
            let id = (expanded.start_op.get() + i as u64, actor.clone());
            if firsts.get(&key).is_none_or(|(best, _)| id > *best) {
                firsts.insert(key, (id, text));
            }
        }
    }
    // A later put of the same text (a device registering again what it
    // already held) changes nothing and is no overwrite.
    let overwrites: BTreeSet<String> = later
        .into_iter()
        .filter(|(k, texts)| {
            firsts
                .get(k)
                .is_none_or(|(_, first)| texts.iter().any(|t| t != first))
        })
        .map(|(k, _)| k)
        .collect();
    let firsts = firsts.into_iter().map(|(k, (_, t))| (k, t)).collect();
    (firsts, overwrites)
}

/// The prefix of the containers the daemon owns (the schema registry,
/// and any it adds later): no untyped write reaches them.
pub const RESERVED_PREFIX: &str = "nuwa:";

/// Refuses an untyped write (`state/put`, a batch `put`, `import`) into a
/// container that only the typed routes may change: a registered schema's
/// container, any `did:nuwa:` name (the ASM namespaces, registered or not
/// yet: a raw key there would break the layout its schema gives it later),
/// and the daemon's own `nuwa:` containers. Such a raw write once replaced
/// a registered schema and left `ConversationLog` unreadable everywhere.
pub fn check_untyped_write(registry: &Registry, container: &str) -> Result<(), ApiError> {
    let why = if container.starts_with(RESERVED_PREFIX) {
        "is reserved for the daemon; register schemas with POST /v1/schemas"
    } else if registry.get(container).is_some() || container.starts_with("did:nuwa:") {
        "is a typed container; write it with state.create, state.update and state.delete"
    } else {
        return Ok(());
    };
    Err(ApiError::new(
        ErrorCode::TypedContainer,
        format!("{container} {why}, not with an untyped put"),
    ))
}

/// A container name an untyped write creates or extends: the rules of
/// [`nuwa_state::check_name_rules`] (NFC, nothing invisible, no mixed-script
/// word).
pub(crate) fn check_new_name(container: &str) -> Result<(), ApiError> {
    nuwa_state::check_name_rules(container).map_err(|e| {
        ApiError::new(
            ErrorCode::InvalidContainerName,
            format!("container name {container:?}: {e}"),
        )
    })
}

/// A key an untyped write puts: NFC and nothing invisible.
pub(crate) fn check_new_key(key: &str) -> Result<(), ApiError> {
    nuwa_state::check_key_rules(key)
        .map_err(|e| ApiError::new(ErrorCode::InvalidWrite, format!("key {key:?}: {e}")))
}

/// Refuses an object over [`MAX_OBJECT_BYTES`].
pub(crate) fn check_object_size(v: &Value) -> Result<(), ApiError> {
    let n = serde_json::to_vec(v).map(|b| b.len()).unwrap_or(usize::MAX);
    if n > MAX_OBJECT_BYTES {
        return Err(ApiError::new(
            ErrorCode::ObjectTooLarge,
            format!("the object is {n} bytes; the limit is {MAX_OBJECT_BYTES} bytes (32 MiB)"),
        ));
    }
    Ok(())
}

/// The agent's typed-state state.
pub(crate) struct Asm {
    pub(crate) registry: Registry,
    /// Registry container heads the registry was last built from.
    pub(crate) registry_heads: Vec<[u8; 32]>,
    next_lifecycle_ms: u64,
    lifecycle_every_ms: u64,
    /// What the last lifecycle scan of each container found nothing to
    /// remove at: its heads, and when its next item expires. A container
    /// whose heads are the same and whose time has not come is not
    /// scanned again (the reader would load it, on an idle device too).
    scanned: BTreeMap<String, ScanMark>,
}

/// See [`Asm::scanned`].
struct ScanMark {
    heads: Vec<[u8; 32]>,
    due_secs: Option<i64>,
}

impl Asm {
    pub(crate) fn new(lifecycle_every_ms: u64) -> Self {
        Asm {
            registry: Registry::with_core(),
            registry_heads: Vec::new(),
            next_lifecycle_ms: 0,
            lifecycle_every_ms,
            scanned: BTreeMap::new(),
        }
    }
}

pub(crate) fn validation_error(errors: Vec<nuwa_asm::schema::ValidationError>) -> ApiError {
    let list: Vec<String> = errors
        .iter()
        .map(|e| {
            let path = if e.path.is_empty() { "/" } else { &e.path };
            format!("{path}: {} ({})", e.message, e.rule)
        })
        .collect();
    ApiError::new(
        ErrorCode::InvalidObject,
        format!("the object does not match the schema: {}", list.join("; ")),
    )
}

pub(crate) fn doc_error(e: doc::DocError) -> ApiError {
    use doc::DocError as E;
    match e {
        E::NoSuchItem { .. } => ApiError::new(ErrorCode::NoSuchObject, e.to_string()),
        E::ItemExists { .. } => ApiError::new(ErrorCode::ObjectExists, e.to_string()),
        E::AppendOnly { .. }
        | E::GrowOnlySetRemoval { .. }
        | E::LogRewrite { .. }
        | E::NotAnInteger { .. } => ApiError::new(ErrorCode::CrdtPolicy, e.to_string()),
        E::Automerge(_) => ApiError::new(ErrorCode::Internal, e.to_string()),
        _ => ApiError::new(ErrorCode::InvalidEdit, e.to_string()),
    }
}

/// A fresh random UUID (version 4) for objects created without an id.
pub(crate) fn new_uuid() -> String {
    let mut bytes = [0u8; 16];
    // Without randomness the id is still the object's key, unique within
    // its container in practice; the write goes on.
    let _ = nuwa_entropy::fill(&mut bytes);
    uuid::Builder::from_random_bytes(bytes)
        .into_uuid()
        .to_string()
}

/// Whether the item schema declares an `id` property (then `id` is part of
/// the validated object; otherwise it is only the item's key).
pub(crate) fn schema_has_id(schema: &AsmSchema) -> bool {
    schema.item_schema["properties"].get("id").is_some()
}

pub(crate) fn without_id(schema: &AsmSchema, v: &Value) -> Value {
    let mut v = v.clone();
    if !schema_has_id(schema) {
        if let Some(o) = v.as_object_mut() {
            o.remove("id");
        }
    }
    v
}

/// The RFC 3339 time of an item (its `timestamp`, else `createdAt`), in
/// Unix seconds.
fn item_time(item: &Value) -> Option<i64> {
    ["timestamp", "createdAt"].iter().find_map(|k| {
        let s = item.get(*k)?.as_str()?;
        time::OffsetDateTime::parse(s, &time::format_description::well_known::Rfc3339)
            .ok()
            .map(|t| t.unix_timestamp())
    })
}

/// The first second at which the lifecycle rules of `schema` remove
/// `item` (`None`: never, as it is). TTL: older than `ttl` seconds;
/// retention: older than the window and of low importance. Items without
/// a time are never removed.
fn expiry_of(schema: &AsmSchema, item: &Value) -> Option<i64> {
    let t = item_time(item)?;
    let after = |secs: u64| {
        t.saturating_add(i64::try_from(secs).unwrap_or(i64::MAX))
            .saturating_add(1)
    };
    let ttl = schema.ttl_secs.map(after);
    let retention = schema.retention.and_then(|r| match r.strategy {
        RetentionStrategy::EvictLowImportance => {
            let importance = item
                .get("importance")
                .and_then(Value::as_f64)
                .unwrap_or(0.0);
            (importance < KEEP_IMPORTANCE).then(|| after(r.window_secs))
        }
    });
    match (ttl, retention) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// What the lifecycle scan of one container found at `now_secs`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Scan {
    /// Ids the rules remove now.
    pub expired: Vec<String>,
    /// When the next of the others expires (`None`: none ever does, as
    /// they are). Until then, and while the container does not change,
    /// scanning it again finds nothing.
    pub due_secs: Option<i64>,
}

/// The lifecycle rules of `schema` over `items` at `now_secs`. Pure and
/// deterministic: every device computes the same set from the same items.
pub fn scan(schema: &AsmSchema, items: &[(String, Value)], now_secs: i64) -> Scan {
    let mut expired = Vec::new();
    let mut due_secs: Option<i64> = None;
    for (id, item) in items {
        match expiry_of(schema, item) {
            Some(at) if at <= now_secs => expired.push(id.clone()),
            Some(at) => due_secs = Some(due_secs.map_or(at, |d| d.min(at))),
            None => {}
        }
    }
    Scan { expired, due_secs }
}

impl Agent {
    /// At start: the core models' containers (deterministic genesis, so one
    /// instance per agent however many devices start at once) and the
    /// registry from the replicated registry container.
    pub(crate) fn asm_start(&mut self, out: &mut Out) {
        let core: Vec<(String, nuwa_asm::model::Layout)> = self
            .asm
            .registry
            .list()
            .map(|s| (s.id.full.clone(), s.layout.clone()))
            .collect();
        for (name, layout) in core {
            if let Err(e) = self.ensure_container(&name, &layout, out) {
                warn!(container = %name, error = %e.message, "cannot create a core model container");
            }
        }
        self.refresh_registry(out);
    }

    /// Applies the container's genesis if it is not there yet.
    pub(crate) fn ensure_container(
        &mut self,
        name: &str,
        layout: &nuwa_asm::model::Layout,
        out: &mut Out,
    ) -> Result<(), ApiError> {
        if self.has_genesis(name, layout) {
            return Ok(());
        }
        let genesis = doc::genesis_change(name, layout);
        let new = self
            .session
            .local_apply(name, vec![genesis])
            .map_err(|e| ApiError::new(ErrorCode::Internal, e.to_string()))?;
        for change in new {
            self.stage(name, Some(change), out);
        }
        if let Some(c) = self.session.engine().container(name) {
            doc::check_genesis(c.doc(), layout).map_err(|e| {
                ApiError::new(
                    ErrorCode::ContainerConflict,
                    format!("container {name:?} exists with another layout: {e}"),
                )
            })?;
        }
        Ok(())
    }

    /// Whether the container exists with this layout's genesis.
    pub(crate) fn has_genesis(&mut self, name: &str, layout: &nuwa_asm::model::Layout) -> bool {
        // An evicted container loads first; one that fails to load counts
        // as absent here, and the write that follows reports the error.
        let _ = self.session.ensure_loaded(name);
        self.session
            .engine()
            .container(name)
            .is_some_and(|c| doc::check_genesis(c.doc(), layout).is_ok())
    }

    /// Rebuilds the registry when the registry container changed.
    pub(crate) fn refresh_registry(&mut self, out: &mut Out) {
        let Some(c) = self.session.engine().container(REGISTRY_CONTAINER) else {
            return;
        };
        let heads = c.heads();
        if heads == self.asm.registry_heads {
            return;
        }
        let (reg, refused) = registry_of(Some(c));
        for e in refused {
            out.count(Count::SchemasRefusedFromPeers);
            warn!(error = %e, "a replicated schema does not register");
        }
        out.push(Effect::ReaderRegistry(Box::new(reg.clone())));
        self.asm.registry = reg;
        self.asm.registry_heads = heads;
        // A schema's rules may have changed: scan everything again.
        self.asm.scanned.clear();
    }

    pub(crate) fn on_tool(
        &mut self,
        tool: Tool,
        _now_ms: u64,
        out: &mut Out,
    ) -> Result<Value, ApiError> {
        self.refresh_registry(out);
        if let Tool::Describe(c) | Tool::Compact(c) | Tool::Reset(c) = &tool {
            self.session
                .ensure_loaded(c)
                .map_err(|e| ApiError::new(ErrorCode::StorageFailed, e.to_string()))?;
        }
        match tool {
            Tool::SchemaAdd(raw) => self.schema_add(raw, out),
            Tool::SchemaList => Ok(Value::Array(
                self.asm.registry.list().map(|s| s.describe()).collect(),
            )),
            Tool::Create {
                schema_uri,
                object,
                id,
            } => self.tool_write(
                BatchOp::Create {
                    schema_uri,
                    object,
                    id,
                },
                out,
            ),
            Tool::Update {
                schema_uri,
                id,
                patch,
            } => self.tool_write(
                BatchOp::Update {
                    schema_uri,
                    id,
                    patch,
                },
                out,
            ),
            // Reads run on the reader, off this loop; these arms serve a
            // request that reached the loop anyway.
            // Reads run on the shell's reader, with its clock; one that
            // reached the agent gets the scan budget alone.
            Tool::Query(q) => query(&self.asm.registry, self.session.engine(), &q, &|| false),
            Tool::Delete {
                schema_uri,
                id,
                hard,
            } => {
                let mode = if hard {
                    DeleteMode::Hard
                } else {
                    DeleteMode::Tombstone
                };
                self.tool_write(
                    BatchOp::Delete {
                        schema_uri,
                        id,
                        mode,
                    },
                    out,
                )
            }
            Tool::Describe(c) => describe(&self.asm.registry, self.session.engine(), &c),
            Tool::Compact(c) => {
                self.schema(&c)?;
                // Saved as one snapshot before the reply goes out.
                out.push(Effect::Compact {
                    container: c.clone(),
                });
                describe(&self.asm.registry, self.session.engine(), &c)
            }
            Tool::Reset(c) => self.reset(&c, out),
        }
    }

    pub(crate) fn schema(&self, uri: &str) -> Result<AsmSchema, ApiError> {
        schema_in(&self.asm.registry, uri)
    }

    fn schema_add(&mut self, raw: Value, out: &mut Out) -> Result<Value, ApiError> {
        let mut trial = self.asm.registry.clone();
        let outcome = trial
            .register(raw.clone())
            .map_err(|e| ApiError::new(ErrorCode::InvalidSchema, e.to_string()))?;
        let id = raw["$id"].as_str().unwrap_or_default().to_owned();
        let schema = self.schema_from(&trial, &id)?;
        if outcome == Registered::Added && !nuwa_asm::schema::is_bundled_core(&raw) {
            let text = serde_json::to_string(&raw)
                .map_err(|e| ApiError::new(ErrorCode::InvalidSchema, e.to_string()))?;
            let change = self
                .session
                .local_put(REGISTRY_CONTAINER, &id, &Value::String(text))
                .map_err(|e| ApiError::new(ErrorCode::Internal, e.to_string()))?;
            self.stage(REGISTRY_CONTAINER, change, out);
            out.push(Effect::ReaderRegistry(Box::new(trial.clone())));
            self.asm.registry = trial;
            if let Some(c) = self.session.engine().container(REGISTRY_CONTAINER) {
                self.asm.registry_heads = c.heads();
            }
            self.ensure_container(&id, &schema.layout, out)?;
            info!(schema = %id, "schema registered");
        }
        let mut d = schema.describe();
        d["registered"] = json!(outcome == Registered::Added);
        Ok(d)
    }

    fn schema_from(&self, reg: &Registry, id: &str) -> Result<AsmSchema, ApiError> {
        reg.get(id)
            .cloned()
            .ok_or_else(|| ApiError::new(ErrorCode::Internal, "registered schema not found"))
    }

    /// `reset`: removes every item, on every device (a replicated clear);
    /// the schema and the container stay.
    /// `state.reset`: removes every item. A container whose layout an
    /// untyped write broke (before such writes were refused) gets its
    /// layout back first (`"repaired": true`): reset is the repair.
    fn reset(&mut self, name: &str, out: &mut Out) -> Result<Value, ApiError> {
        let schema = self.schema(name)?;
        let broken = self
            .session
            .engine()
            .container(name)
            .is_some_and(|c| !doc::layout_is_intact(c.doc(), &schema.layout));
        let ids: Vec<String> = match self.session.engine().container(name) {
            Some(c) if !broken => doc::items(c.doc(), &schema.layout)
                .map_err(doc_error)?
                .into_iter()
                .map(|(id, _)| id)
                .collect(),
            _ => Vec::new(),
        };
        let layout = schema.layout.clone();
        let change = self
            .session
            .local_transact(name, |tx| {
                if broken {
                    doc::repair_layout(tx, &layout)?;
                }
                doc::remove_items(tx, &layout, &ids).map(|_| ())
            })
            .map_err(edit_error)?;
        self.stage(name, change, out);
        if broken {
            out.count(Count::ContainersRepaired);
            warn!(container = %name, "reset repaired a container whose layout an untyped write had broken");
        }
        Ok(json!({
            "container": name,
            "removed": ids.len(),
            "repaired": broken,
            "heads": self.heads_hex(name),
        }))
    }

    /// The lifecycle task: TTL and retention, on every device.
    pub(crate) fn asm_lifecycle(&mut self, now_ms: u64, out: &mut Out) {
        if now_ms < self.asm.next_lifecycle_ms {
            return;
        }
        self.asm.next_lifecycle_ms = now_ms + self.asm.lifecycle_every_ms;
        self.refresh_registry(out);
        let now_secs = (now_ms / 1000) as i64;
        let engine = self.session.engine();
        let scanned = &self.asm.scanned;
        let schemas: Vec<AsmSchema> = self
            .asm
            .registry
            .list()
            .filter(|s| s.ttl_secs.is_some() || s.retention.is_some())
            .filter(|s| {
                let Some(heads) = engine.heads_of(&s.id.full) else {
                    return false;
                };
                scanned.get(&s.id.full).is_none_or(|m| {
                    m.heads != heads || m.due_secs.is_some_and(|due| due <= now_secs)
                })
            })
            .cloned()
            .collect();
        // The scan renders every item: the reader does it, off this loop,
        // and answers with the expired ids (`on_scanned`).
        if !schemas.is_empty() {
            out.push(Effect::ReaderScan { schemas, now_secs });
        }
    }

    /// The reader scanned `container` as it was at `heads`: remove what
    /// expired, or remember that nothing is due before `scan.due_secs`.
    pub(crate) fn on_scanned(
        &mut self,
        container: String,
        heads: Vec<[u8; 32]>,
        scan: Scan,
        out: &mut Out,
    ) {
        if scan.expired.is_empty() {
            let mark = ScanMark {
                heads,
                due_secs: scan.due_secs,
            };
            self.asm.scanned.insert(container, mark);
        } else {
            self.asm.scanned.remove(&container);
            self.on_expired(container, scan.expired, out);
        }
    }

    /// The reader found expired items: remove them (a pure function of the
    /// items and the time, so every device agrees; removing an item twice
    /// is a no-op).
    fn on_expired(&mut self, container: String, ids: Vec<String>, out: &mut Out) {
        let Ok(schema) = self.schema(&container) else {
            return;
        };
        let layout = schema.layout.clone();
        match self.session.local_transact(&container, |tx| {
            doc::remove_items(tx, &layout, &ids).map(|_| ())
        }) {
            Ok(change) => {
                let removed = change.is_some();
                self.stage(&container, change, out);
                if removed {
                    out.count(Count::LifecycleItemsRemoved);
                    info!(container = %container, removed = ids.len(), "lifecycle removed expired items");
                }
            }
            Err(e) => warn!(container = %container, error = %e, "lifecycle edit failed"),
        }
    }
}

/// The registered schema `uri`, or an error saying how to register it.
pub fn schema_in(registry: &Registry, uri: &str) -> Result<AsmSchema, ApiError> {
    registry.get(uri).cloned().ok_or_else(|| {
        ApiError::new(ErrorCode::UnknownSchema,
            format!(
                "no schema {uri:?} is registered; register it with `nuwa-node state schema add FILE` \
                 (POST /v1/schemas)"
            ),
        )
    })
}

/// Containers by name, wherever they are held (the loop's engine, or the
/// reader's replicas).
pub trait Containers {
    fn get_container(&self, name: &str) -> Option<&nuwa_state::Container>;
}

impl Containers for nuwa_sync::Engine {
    fn get_container(&self, name: &str) -> Option<&nuwa_state::Container> {
        self.container(name)
    }
}

/// `state.query`: ASM-QL over the items of one container, within the scan
/// budget and the caller's time budget (`expired` says when it is spent;
/// the core reads no clock).
pub fn query(
    registry: &Registry,
    containers: &dyn Containers,
    q: &Value,
    expired: &dyn Fn() -> bool,
) -> Result<Value, ApiError> {
    let parsed =
        query::parse(q).map_err(|e| ApiError::new(ErrorCode::InvalidQuery, e.to_string()))?;
    let schema = schema_in(registry, &parsed.from)?;
    let items = match containers.get_container(&parsed.from) {
        Some(c) => doc::items(c.doc(), &schema.layout).map_err(doc_error)?,
        None => Vec::new(),
    };
    let budget = query::Budget {
        max_scanned: QUERY_MAX_SCANNED,
        expired,
    };
    let r = query::execute(
        &parsed,
        items.iter().map(|(id, v)| (id.as_str(), v)),
        &budget,
    )
    .map_err(|e| match e {
        query::QueryError::TooExpensive { .. } => {
            ApiError::new(ErrorCode::QueryTooExpensive, e.to_string())
        }
        other => ApiError::new(ErrorCode::InvalidQuery, other.to_string()),
    })?;
    Ok(json!({ "items": r.items, "next_cursor": r.next_cursor, "scanned": r.scanned }))
}

/// `state.describe`: the schema's description plus the container's size.
pub fn describe(
    registry: &Registry,
    containers: &dyn Containers,
    name: &str,
) -> Result<Value, ApiError> {
    let schema = schema_in(registry, name)?;
    let mut d = schema.describe();
    let (count, heads, changes, bytes) = match containers.get_container(name) {
        Some(c) => (
            doc::item_count(c.doc(), &schema.layout).map_err(doc_error)?,
            c.heads().iter().map(hex::encode).collect::<Vec<_>>(),
            c.change_count(),
            c.save().len(),
        ),
        None => (0, Vec::new(), 0, 0),
    };
    d["container"] = json!(name);
    d["items"] = json!(count);
    d["heads"] = json!(heads);
    d["changes"] = json!(changes);
    d["snapshot_bytes"] = json!(bytes);
    Ok(d)
}

fn edit_error(e: nuwa_sync::LocalEditError<doc::DocError>) -> ApiError {
    match e {
        nuwa_sync::LocalEditError::Rejected(e) => doc_error(e),
        nuwa_sync::LocalEditError::Engine(e) => ApiError::new(ErrorCode::Internal, e.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn note_schema(title_type: &str) -> Value {
        json!({
            "$schema": "https://json-schema.org/draft/2020-12/schema",
            "$id": "did:nuwa:app:notes:state:Note#v1",
            "type": "object",
            "properties": {"id": {"type": "string"}, "title": {"type": title_type}},
            "required": ["id"],
        })
    }

    // Goal: untyped writes reach neither typed containers (registered, or
    // any did:nuwa: name) nor the daemon's reserved ones, and untyped maps
    // still take them. Method: the check on each kind of name.
    #[test]
    fn untyped_writes_stay_out_of_typed_and_reserved_containers() {
        let reg = Registry::with_core();
        for name in [
            "did:nuwa:core:MemoryStore#v1",
            "did:nuwa:core:ConversationLog#v1",
            "did:nuwa:app:notes:state:Note#v1",
            "nuwa:schemas",
            "nuwa:anything",
        ] {
            let e = check_untyped_write(&reg, name).unwrap_err();
            assert_eq!(e.code, ErrorCode::TypedContainer, "{name}");
        }
        for name in ["notes", "did:web:example", "nuwa-notes"] {
            assert!(check_untyped_write(&reg, name).is_ok(), "{name}");
        }
    }

    // Goal: a registered schema never changes on merge. Method: a
    // registry document where a second device overwrote the schema with
    // an untyped put (as an old version could) and another put an entry
    // under a key that is not its $id; the registry keeps the first
    // content and reports both.
    #[test]
    fn a_peers_overwrite_of_a_schema_is_refused_on_merge() {
        let first = note_schema("string");
        let mut a = nuwa_state::Container::new(&[1; 16]);
        a.put(
            "did:nuwa:app:notes:state:Note#v1",
            &Value::String(first.to_string()),
        )
        .unwrap();
        let mut b = nuwa_state::Container::new(&[2; 16]);
        b.apply_changes(
            a.doc()
                .get_changes(&[])
                .into_iter()
                .map(|c| c.raw_bytes().to_vec()),
        )
        .unwrap();
        b.put(
            "did:nuwa:app:notes:state:Note#v1",
            &Value::String(note_schema("number").to_string()),
        )
        .unwrap();
        let mut stray = note_schema("boolean");
        stray["$id"] = json!("did:nuwa:app:notes:state:Other#v1");
        b.put("aaa", &Value::String(stray.to_string())).unwrap();
        // The overwrite is the document's current value...
        assert!(
            b.to_json()["did:nuwa:app:notes:state:Note#v1"]
                .as_str()
                .unwrap()
                .contains("number")
        );
        // ...and the registry still holds the first one.
        let (reg, refused) = registry_of(Some(&b));
        let schema = reg.get("did:nuwa:app:notes:state:Note#v1").unwrap();
        assert_eq!(schema.raw["properties"]["title"]["type"], "string");
        assert!(reg.get("did:nuwa:app:notes:state:Other#v1").is_none());
        assert_eq!(refused.len(), 2, "{refused:?}");
        assert!(
            refused.iter().any(|r| r.contains("overwrite")),
            "{refused:?}"
        );
        // Putting the same text again is no overwrite.
        let mut c = nuwa_state::Container::new(&[3; 16]);
        c.apply_changes(
            a.doc()
                .get_changes(&[])
                .into_iter()
                .map(|c| c.raw_bytes().to_vec()),
        )
        .unwrap();
        c.put(
            "did:nuwa:app:notes:state:Note#v1",
            &Value::String(first.to_string()),
        )
        .unwrap();
        assert!(registry_of(Some(&c)).1.is_empty());
    }

    // Goal: a typed container an untyped write broke gets its layout
    // back: the two faults seen (a MemoryStore's items replaced by {},
    // a ConversationLog's by a string) and a stray root key. Method:
    // repair_layout in a transaction, then the typed reads work.
    #[test]
    fn repair_puts_the_layout_back() {
        let reg = Registry::with_core();
        for (name, junk) in [
            ("did:nuwa:core:MemoryStore#v1", json!({})),
            ("did:nuwa:core:ConversationLog#v1", json!("gone")),
        ] {
            let layout = reg.get(name).unwrap().layout.clone();
            let mut c = nuwa_state::Container::new(&[4; 16]);
            c.apply_changes([doc::genesis_change(name, &layout)])
                .unwrap();
            assert!(doc::layout_is_intact(c.doc(), &layout));
            c.put("items", &junk).unwrap();
            c.put("stray", &json!(1)).unwrap();
            assert!(!doc::layout_is_intact(c.doc(), &layout), "{name}");
            c.transact(|tx| doc::repair_layout(tx, &layout).map(drop))
                .unwrap();
            assert!(doc::layout_is_intact(c.doc(), &layout), "{name}");
            assert_eq!(doc::items(c.doc(), &layout).unwrap().len(), 0);
            // Nothing left to repair.
            let change = c
                .transact(|tx| doc::repair_layout(tx, &layout).map(drop))
                .unwrap();
            assert!(change.is_none(), "{name}");
        }
    }

    // Goal: the lifecycle rule is a pure function of the items and the
    // time: TTL removes old log entries, retention removes only old items
    // of low importance, and items without a time are never touched; the
    // scan says when the next item expires, and nothing expires before.
    #[test]
    fn scans_follow_ttl_and_retention() {
        let expired_ids =
            |s: &AsmSchema, items: &[(String, Value)], now: i64| scan(s, items, now).expired;
        let reg = Registry::with_core();
        let log = reg.get("did:nuwa:core:ConversationLog#v1").unwrap();
        let now = 1_800_000_000i64;
        let at = |secs_ago: i64| {
            time::OffsetDateTime::from_unix_timestamp(now - secs_ago)
                .unwrap()
                .format(&time::format_description::well_known::Rfc3339)
                .unwrap()
        };
        let items = vec![
            ("old".to_owned(), json!({"timestamp": at(15 * 86_400)})),
            ("new".to_owned(), json!({"timestamp": at(86_400)})),
            ("none".to_owned(), json!({"content": "x"})),
        ];
        assert_eq!(expired_ids(log, &items, now), vec!["old".to_owned()]);
        // "new" is a day old: it goes 14 days after its time.
        let due = now - 86_400 + 14 * 86_400 + 1;
        assert_eq!(scan(log, &items, now).due_secs, Some(due));
        assert_eq!(expired_ids(log, &items, due - 1), vec!["old".to_owned()]);
        assert_eq!(
            expired_ids(log, &items, due),
            vec!["old".to_owned(), "new".to_owned()]
        );
        assert_eq!(scan(log, &items, due).due_secs, None);

        let mem = reg.get("did:nuwa:core:MemoryStore#v1").unwrap();
        let items = vec![
            (
                "old_low".to_owned(),
                json!({"createdAt": at(91 * 86_400), "importance": 0.1}),
            ),
            (
                "old_high".to_owned(),
                json!({"createdAt": at(91 * 86_400), "importance": 0.9}),
            ),
            (
                "new_low".to_owned(),
                json!({"createdAt": at(86_400), "importance": 0.1}),
            ),
        ];
        assert_eq!(expired_ids(mem, &items, now), vec!["old_low".to_owned()]);
        // Only "new_low" can expire later; important items never do.
        let due = now - 86_400 + 90 * 86_400 + 1;
        assert_eq!(scan(mem, &items, now).due_secs, Some(due));
        assert_eq!(
            expired_ids(mem, &items, due - 1),
            vec!["old_low".to_owned()]
        );
        assert_eq!(
            expired_ids(mem, &items, due),
            vec!["old_low".to_owned(), "new_low".to_owned()]
        );
        assert_eq!(scan(mem, &items, due).due_secs, None);
        let settings = reg.get("did:nuwa:core:AgentSettings#v1").unwrap();
        assert_eq!(
            scan(settings, &items, now),
            Scan {
                expired: vec![],
                due_secs: None
            }
        );
    }

    #[test]
    fn uuids_are_version_4() {
        let u = new_uuid();
        assert_eq!(u.len(), 36);
        assert_eq!(&u[14..15], "4");
        assert!(matches!(&u[19..20], "8" | "9" | "a" | "b"));
    }
}
