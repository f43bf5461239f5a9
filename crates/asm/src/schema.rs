//! NIP-8 schemas: a JSON Schema 2020-12 document with `x-asm` annotations,
//! parsed into an [`AsmSchema`] that knows its [`SchemaId`], the [`Layout`]
//! of its container, its lifecycle annotations and a compiled validator for
//! one stored item.
//!
//! This module checks a schema once, when it is registered: the id form, the
//! size and nesting bounds, that the document is valid JSON Schema, that
//! every `x-asm` key and `x-crdt` keyword is known and fits the declared
//! type. It does not store anything, resolve remote `$ref`s (compilation is
//! offline), check signatures, or enforce visibility; the registry keeps
//! schemas, the document layer applies the layout, and the node decides who
//! may read what.
//!
//! NIP-8 ids carry a version fragment (`#v1`), which 2020-12 forbids in
//! `$id`; the meta-schema check and the item validator therefore see the
//! schema without its top-level `$id`, and local references
//! (`#/definitions/...`, `#/$defs/...`) resolve against the schema body.

use std::collections::BTreeMap;
use std::fmt;
use std::io;
use std::sync::{Arc, LazyLock};

use serde_json::{Map, Value, json};
use thiserror::Error;

use crate::duration::{DurationError, parse_iso8601_duration};
use crate::model::{
    Compression, ContainerKind, CrdtKind, Layout, Retention, RetentionStrategy, Visibility,
};

/// Largest accepted schema, serialized as compact JSON.
pub const MAX_SCHEMA_BYTES: usize = 256 * 1024;
/// Deepest accepted nesting of objects and arrays (the root object is 1).
pub const MAX_SCHEMA_DEPTH: usize = 64;
/// Longest accepted schema id.
pub const MAX_ID_BYTES: usize = 256;
/// Most errors [`AsmSchema::validate_item`] reports for one item.
pub const MAX_VALIDATION_ERRORS: usize = 32;

/// Longest name segment of a schema id.
const MAX_SEGMENT_BYTES: usize = 64;
/// The only `$schema` dialect accepted.
const DRAFT_2020_12: &str = "https://json-schema.org/draft/2020-12/schema";
/// How many `$ref` hops are followed when looking for an item's properties.
const MAX_REF_HOPS: usize = 16;
/// Longest message kept from the JSON Schema library (it may quote the
/// offending instance, which can be large).
const MAX_MESSAGE_CHARS: usize = 300;
/// Meta-schema errors quoted in [`SchemaError::NotJsonSchema`].
const MAX_META_ERRORS: usize = 3;

/// The accepted id forms, quoted by [`SchemaError::BadId`].
const ID_FORMS: &str = "did:nuwa:core:<Model>#v<n>, did:nuwa:cap:<cap_id>:state:<Name>#v<n>, \
    did:nuwa:app:<app_name>:state:<Name>#v<n>, did:nuwa:user:<did_suffix>:state:<Name>#v<n> \
    or did:nuwa:state:<Name>#v<n>, where each name is 1 to 64 characters from A-Z a-z 0-9 . _ @ - \
    and n is a positive integer without leading zeros, 256 bytes at most in all";

/// The keys `x-asm` may hold.
const ASM_KEYS: [&str; 8] = [
    "container",
    "crdt",
    "keyType",
    "valueRef",
    "x-ttl",
    "x-retention",
    "x-compression",
    "x-visibility",
];

/// The NIP-8 namespace a schema id belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Namespace {
    /// `did:nuwa:core:<Model>#<ver>`: built into the platform.
    Core,
    /// `did:nuwa:cap:<cap_id>:state:<Name>#<ver>`: one capability's data.
    Cap,
    /// `did:nuwa:app:<app_name>:state:<Name>#<ver>`: a multi-capability app.
    App,
    /// `did:nuwa:user:<did_suffix>:state:<Name>#<ver>`: ad-hoc user data.
    User,
    /// `did:nuwa:state:<Name>#<ver>`: the short form NIP-7 packages use.
    State,
}

impl Namespace {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Core => "core",
            Self::Cap => "cap",
            Self::App => "app",
            Self::User => "user",
            Self::State => "state",
        }
    }
}

impl fmt::Display for Namespace {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A parsed schema id such as `did:nuwa:core:ConversationLog#v1`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct SchemaId {
    /// The id as written.
    pub full: String,
    pub namespace: Namespace,
    /// The id without its version fragment: versions of one schema share it.
    pub base: String,
    /// The number after `#v`, at least 1.
    pub version: u32,
}

impl SchemaId {
    /// Parses an id of one of the NIP-8 namespace forms (or NIP-7's
    /// `did:nuwa:state:<Name>#v<n>`).
    pub fn parse(s: &str) -> Result<SchemaId, SchemaError> {
        let bad = |reason| SchemaError::BadId {
            id: truncate_chars(s, MAX_ID_BYTES),
            reason,
        };
        if s.len() > MAX_ID_BYTES {
            return Err(bad("it is longer than 256 bytes"));
        }
        let Some((base, fragment)) = s.split_once('#') else {
            return Err(bad("it has no #v<n> version"));
        };
        let version = parse_version(fragment).ok_or_else(|| bad("its version is not v<n>"))?;
        let parts: Vec<&str> = base.split(':').collect();
        let namespace = match parts.as_slice() {
            ["did", "nuwa", "core", _] => Namespace::Core,
            ["did", "nuwa", "state", _] => Namespace::State,
            ["did", "nuwa", "cap", _, "state", _] => Namespace::Cap,
            ["did", "nuwa", "app", _, "state", _] => Namespace::App,
            ["did", "nuwa", "user", _, "state", _] => Namespace::User,
            ["did", "nuwa", ..] => return Err(bad("its segments do not match any form")),
            _ => return Err(bad("it does not start with did:nuwa:")),
        };
        // The owner and name segments (and the literal `state`, which passes).
        if !parts
            .get(3..)
            .unwrap_or(&[])
            .iter()
            .all(|name| valid_segment(name))
        {
            return Err(bad(
                "a name segment is empty, longer than 64 bytes or has a character outside A-Z a-z 0-9 . _ @ -",
            ));
        }
        Ok(SchemaId {
            full: s.to_owned(),
            namespace,
            base: base.to_owned(),
            version,
        })
    }
}

impl fmt::Display for SchemaId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.full)
    }
}

/// `v` followed by a positive integer without leading zeros.
fn parse_version(fragment: &str) -> Option<u32> {
    let digits = fragment.strip_prefix('v')?;
    if digits.is_empty() || digits.starts_with('0') || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse::<u32>().ok()
}

fn valid_segment(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= MAX_SEGMENT_BYTES
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'@' | b'-'))
}

/// Why a schema was refused.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum SchemaError {
    #[error("bad schema id {id:?}: {reason}; accepted forms are {ID_FORMS}")]
    BadId { id: String, reason: &'static str },
    #[error(
        "schema is not a JSON object; an ASM schema is a JSON Schema object with \"type\": \"object\" and a \"$id\""
    )]
    NotObject,
    #[error("schema is larger than {max_bytes} bytes serialized; split it or shorten it")]
    TooLarge { max_bytes: usize },
    #[error("schema nests objects and arrays deeper than {max_depth} levels; flatten it")]
    TooDeep { max_depth: usize },
    #[error(
        "schema has no string \"$id\"; give it one such as did:nuwa:user:<did_suffix>:state:<Name>#v1"
    )]
    MissingId,
    #[error(
        "schema {id}: \"$schema\" is {given}, but only {DRAFT_2020_12} is accepted (or leave it out)"
    )]
    UnsupportedDialect { id: String, given: String },
    #[error("schema {id} is not valid JSON Schema 2020-12: {message}")]
    NotJsonSchema { id: String, message: String },
    #[error("schema {id}: the top-level \"type\" must be \"object\"")]
    NotTypeObject { id: String },
    #[error(
        "schema {id}: unknown x-asm key {key:?}; accepted keys are container, crdt, keyType, valueRef, x-ttl, x-retention, x-compression and x-visibility"
    )]
    UnknownAsmKey { id: String, key: String },
    #[error("schema {id}: \"x-asm\" must be an object of ASM annotations")]
    AsmNotObject { id: String },
    #[error("schema {id}: bad x-asm {key}: {reason}")]
    BadAsmValue {
        id: String,
        key: &'static str,
        reason: String,
    },
    #[error(
        "schema {id}: bad x-asm {key}: not a whole-number ISO-8601 duration such as P14D or PT1H30M"
    )]
    BadDuration {
        id: String,
        key: &'static str,
        #[source]
        source: DurationError,
    },
    #[error("schema {id}: cannot find the item schema of this {container} container: {reason}")]
    NoItemSchema {
        id: String,
        container: ContainerKind,
        reason: String,
    },
    #[error("schema {id}: field {field:?}: {reason}")]
    BadField {
        id: String,
        field: String,
        reason: String,
    },
    #[error("schema {id}: cannot compile the item schema: {message}")]
    Compile { id: String, message: String },
}

/// One reason an item does not match its schema.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ValidationError {
    /// JSON pointer of the failing location in the item; `""` for the item
    /// itself.
    pub path: String,
    /// The JSON Schema keyword that failed: `required`, `type`, `enum`,
    /// `format`, ...
    pub rule: String,
    /// A human-readable explanation.
    pub message: String,
}

impl fmt::Display for ValidationError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let path = if self.path.is_empty() {
            "/"
        } else {
            &self.path
        };
        write!(f, "{path}: {} ({})", self.message, self.rule)
    }
}

/// A parsed, checked NIP-8 schema.
#[derive(Clone)]
pub struct AsmSchema {
    pub id: SchemaId,
    pub layout: Layout,
    /// The JSON Schema one stored item is validated against: for `object`
    /// containers the schema itself, for `map` the value schema, for `list`
    /// and `log` the array's `items`; without `$id`, and with the schema's
    /// `definitions`/`$defs` beside it so local references resolve.
    pub item_schema: Value,
    /// `x-asm.x-ttl` in seconds.
    pub ttl_secs: Option<u64>,
    pub retention: Option<Retention>,
    pub compression: Option<Compression>,
    /// `x-asm.x-visibility`, private when absent.
    pub visibility: Visibility,
    /// `x-asm.keyType` (maps only; always `"string"` when set).
    pub key_type: Option<String>,
    /// `x-asm.valueRef` (maps only): a local JSON pointer such as
    /// `#/definitions/MemoryItem`.
    pub value_ref: Option<String>,
    /// The schema exactly as registered.
    pub raw: Value,
    /// Compiled once at parse time; shared because validators cannot be
    /// cloned.
    validator: Arc<jsonschema::Validator>,
}

impl fmt::Debug for AsmSchema {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AsmSchema")
            .field("id", &self.id)
            .field("layout", &self.layout)
            .field("ttl_secs", &self.ttl_secs)
            .field("retention", &self.retention)
            .field("compression", &self.compression)
            .field("visibility", &self.visibility)
            .field("key_type", &self.key_type)
            .field("value_ref", &self.value_ref)
            .finish_non_exhaustive()
    }
}

impl AsmSchema {
    /// Validates one item against the item schema, with format assertions
    /// (`uuid`, `date-time`, `uri`, ...) on. Returns every error, at most
    /// [`MAX_VALIDATION_ERRORS`].
    pub fn validate_item(&self, item: &Value) -> Result<(), Vec<ValidationError>> {
        let errors: Vec<ValidationError> = self
            .validator
            .iter_errors(item)
            .take(MAX_VALIDATION_ERRORS)
            .map(|e| ValidationError {
                path: e.instance_path().as_str().to_owned(),
                rule: e.kind().keyword().to_owned(),
                message: truncate_chars(&e.to_string(), MAX_MESSAGE_CHARS),
            })
            .collect();
        if errors.is_empty() {
            Ok(())
        } else {
            Err(errors)
        }
    }

    /// A small JSON summary for tool descriptions and status output: id,
    /// namespace, container, container CRDT, the policy of each field,
    /// required fields and lifecycle annotations.
    pub fn describe(&self) -> Value {
        let fields: Map<String, Value> = self
            .layout
            .fields
            .iter()
            .map(|(name, kind)| (name.clone(), Value::from(kind.as_str())))
            .collect();
        let required = self
            .item_schema
            .get("required")
            .cloned()
            .unwrap_or_else(|| json!([]));
        json!({
            "id": self.id.full,
            "namespace": self.id.namespace.as_str(),
            "container": self.layout.container.as_str(),
            "crdt": self.layout.container_crdt.map(CrdtKind::as_str),
            "fields": fields,
            "required": required,
            "ttl_secs": self.ttl_secs,
            "retention": self.retention.map(|r| json!({
                "window_secs": r.window_secs,
                "strategy": r.strategy.as_str(),
            })),
            "compression": self.compression.map(Compression::as_str),
            "visibility": self.visibility.as_str(),
        })
    }
}

/// The three core schemas of NIP-8, verbatim from the specification.
static CORE_SCHEMAS: LazyLock<Vec<Value>> = LazyLock::new(|| {
    [
        include_str!("../schemas/core/ConversationLog.json"),
        include_str!("../schemas/core/MemoryStore.json"),
        include_str!("../schemas/core/AgentSettings.json"),
    ]
    .into_iter()
    // The files are part of this crate and checked by its tests; a parse
    // failure is a build defect, not an input error.
    .map(|text| serde_json::from_str(text).expect("bundled core schema is valid JSON"))
    .collect()
});

/// The NIP-8 core schemas (`ConversationLog`, `MemoryStore`,
/// `AgentSettings`, all `#v1`) as raw JSON, in that order.
pub fn core_schemas() -> Vec<Value> {
    CORE_SCHEMAS.clone()
}

/// Whether `raw` is exactly one of the bundled core schemas.
pub fn is_bundled_core(raw: &Value) -> bool {
    CORE_SCHEMAS.iter().any(|core| core == raw)
}

/// The note schema of NIP-7's minimal capability package
/// (`did:nuwa:state:note#v1`), for examples and tests.
pub fn example_note_schema() -> Value {
    // Bundled with the crate and checked by its tests, as above.
    serde_json::from_str(include_str!("../schemas/examples/note.json"))
        .expect("bundled note schema is valid JSON")
}

/// The `x-asm` annotations, checked.
struct Annotations {
    container: ContainerKind,
    crdt: Option<CrdtKind>,
    key_type: Option<String>,
    value_ref: Option<String>,
    ttl_secs: Option<u64>,
    retention: Option<Retention>,
    compression: Option<Compression>,
    visibility: Visibility,
}

/// Parses and checks a NIP-8 schema: id, bounds, JSON Schema validity,
/// `x-asm` annotations, item schema and field policies; compiles the item
/// validator.
pub fn parse(raw: &Value) -> Result<AsmSchema, SchemaError> {
    let obj = raw.as_object().ok_or(SchemaError::NotObject)?;
    check_depth(raw)?;
    check_size(raw)?;
    let id_text = obj
        .get("$id")
        .and_then(Value::as_str)
        .ok_or(SchemaError::MissingId)?;
    let id = SchemaId::parse(id_text)?;
    let id_str = || id.full.clone();

    if let Some(dialect) = obj.get("$schema") {
        if dialect.as_str() != Some(DRAFT_2020_12) {
            return Err(SchemaError::UnsupportedDialect {
                id: id_str(),
                given: truncate_chars(&dialect.to_string(), 80),
            });
        }
    }

    // The meta-schema forbids a fragment in `$id`, which every NIP-8 id has;
    // the rest of the document must be valid 2020-12.
    let mut body = obj.clone();
    body.remove("$id");
    let body = Value::Object(body);
    let meta = jsonschema::draft202012::meta::validator();
    let meta_errors: Vec<String> = meta
        .iter_errors(&body)
        .take(MAX_META_ERRORS)
        .map(|e| {
            let at = e.instance_path().as_str();
            let at = if at.is_empty() { "/" } else { at };
            format!(
                "at {at}: {}",
                truncate_chars(&e.to_string(), MAX_MESSAGE_CHARS)
            )
        })
        .collect();
    if !meta_errors.is_empty() {
        return Err(SchemaError::NotJsonSchema {
            id: id_str(),
            message: meta_errors.join("; "),
        });
    }

    if obj.get("type").and_then(Value::as_str) != Some("object") {
        return Err(SchemaError::NotTypeObject { id: id_str() });
    }

    let ann = parse_annotations(&id.full, obj.get("x-asm"))?;
    let (item_schema, fields) = item_schema_and_fields(&id.full, raw, obj, &ann)?;

    let validator = jsonschema::options()
        .with_draft(jsonschema::Draft::Draft202012)
        .should_validate_formats(true)
        .offline()
        .build(&item_schema)
        .map_err(|e| SchemaError::Compile {
            id: id_str(),
            message: truncate_chars(&e.to_string(), MAX_MESSAGE_CHARS),
        })?;

    Ok(AsmSchema {
        layout: Layout {
            container: ann.container,
            container_crdt: ann.crdt,
            fields,
            default_field: CrdtKind::LwwRegister,
        },
        item_schema,
        ttl_secs: ann.ttl_secs,
        retention: ann.retention,
        compression: ann.compression,
        visibility: ann.visibility,
        key_type: ann.key_type,
        value_ref: ann.value_ref,
        raw: raw.clone(),
        validator: Arc::new(validator),
        id,
    })
}

/// Refuses documents nested deeper than [`MAX_SCHEMA_DEPTH`], without
/// recursion so a hostile value cannot exhaust the stack here.
fn check_depth(raw: &Value) -> Result<(), SchemaError> {
    let mut stack: Vec<(&Value, usize)> = vec![(raw, 1)];
    while let Some((value, depth)) = stack.pop() {
        let children: Box<dyn Iterator<Item = &Value>> = match value {
            Value::Object(map) => Box::new(map.values()),
            Value::Array(items) => Box::new(items.iter()),
            _ => continue,
        };
        if depth > MAX_SCHEMA_DEPTH {
            return Err(SchemaError::TooDeep {
                max_depth: MAX_SCHEMA_DEPTH,
            });
        }
        stack.extend(children.map(|child| (child, depth + 1)));
    }
    Ok(())
}

/// Refuses documents larger than [`MAX_SCHEMA_BYTES`] serialized, stopping
/// the serialization as soon as the bound is passed.
fn check_size(raw: &Value) -> Result<(), SchemaError> {
    struct Budget(usize);
    impl io::Write for Budget {
        fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
            self.0 = self
                .0
                .checked_sub(buf.len())
                .ok_or_else(|| io::Error::other("schema too large"))?;
            Ok(buf.len())
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }
    serde_json::to_writer(Budget(MAX_SCHEMA_BYTES), raw).map_err(|_| SchemaError::TooLarge {
        max_bytes: MAX_SCHEMA_BYTES,
    })
}

/// Reads and checks the `x-asm` object, one key after the other; an absent
/// `x-asm` gives the defaults.
fn parse_annotations(id: &str, asm: Option<&Value>) -> Result<Annotations, SchemaError> {
    let mut ann = Annotations {
        container: ContainerKind::Object,
        crdt: None,
        key_type: None,
        value_ref: None,
        ttl_secs: None,
        retention: None,
        compression: None,
        visibility: Visibility::Private,
    };
    let Some(asm) = asm else {
        return Ok(ann);
    };
    let Some(map) = asm.as_object() else {
        return Err(SchemaError::AsmNotObject { id: id.to_owned() });
    };
    if let Some(key) = map.keys().find(|k| !ASM_KEYS.contains(&k.as_str())) {
        return Err(SchemaError::UnknownAsmKey {
            id: id.to_owned(),
            key: truncate_chars(key, 64),
        });
    }
    let asm = AsmObject { id, map };

    if let Some(s) = asm.text("container")? {
        ann.container = ContainerKind::parse(s).ok_or_else(|| {
            asm.bad(
                "container",
                format!("{s:?} is not one of object, map, list, log"),
            )
        })?;
    }
    // The keys below are checked against the container, so they come after.
    if let Some(s) = asm.text("crdt")? {
        ann.crdt = Some(asm.crdt(ann.container, s)?);
    }
    if let Some(s) = asm.text("keyType")? {
        ann.key_type = Some(asm.key_type(ann.container, s)?);
    }
    if let Some(s) = asm.text("valueRef")? {
        ann.value_ref = Some(asm.value_ref(ann.container, s)?);
    }
    if let Some(s) = asm.text("x-ttl")? {
        ann.ttl_secs =
            Some(
                parse_iso8601_duration(s).map_err(|source| SchemaError::BadDuration {
                    id: id.to_owned(),
                    key: "x-ttl",
                    source,
                })?,
            );
    }
    if let Some(v) = map.get("x-retention") {
        ann.retention = Some(parse_retention(id, v)?);
    }
    if let Some(s) = asm.text("x-compression")? {
        ann.compression = Some(Compression::parse(s).ok_or_else(|| {
            asm.bad(
                "x-compression",
                format!("{s:?} is not one of br, zstd, gzip"),
            )
        })?);
    }
    if let Some(s) = asm.text("x-visibility")? {
        ann.visibility = Visibility::parse(s).ok_or_else(|| {
            asm.bad(
                "x-visibility",
                format!("{s:?} is not one of private, shared, public"),
            )
        })?;
    }
    Ok(ann)
}

/// The `x-asm` object of one schema, with the schema's id for the errors.
struct AsmObject<'a> {
    id: &'a str,
    map: &'a Map<String, Value>,
}

impl<'a> AsmObject<'a> {
    fn bad(&self, key: &'static str, reason: String) -> SchemaError {
        SchemaError::BadAsmValue {
            id: self.id.to_owned(),
            key,
            reason,
        }
    }

    /// The string at `key`, if there is one; any other value is an error.
    fn text(&self, key: &'static str) -> Result<Option<&'a str>, SchemaError> {
        match self.map.get(key) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.as_str())),
            Some(other) => Err(self.bad(key, format!("{} is not a string", short(other)))),
        }
    }

    /// `crdt`: the container's own CRDT, among those its kind accepts.
    fn crdt(&self, container: ContainerKind, s: &str) -> Result<CrdtKind, SchemaError> {
        let accepted: &[CrdtKind] = match container {
            ContainerKind::Object | ContainerKind::Map => &[CrdtKind::OrMap],
            ContainerKind::List | ContainerKind::Log => &[CrdtKind::AppendOnly, CrdtKind::LogRga],
        };
        CrdtKind::parse(s)
            .filter(|k| accepted.contains(k))
            .ok_or_else(|| {
                self.bad(
                    "crdt",
                    format!(
                        "{s:?} is not accepted for a {container} container; accepted: {}",
                        join_kinds(accepted)
                    ),
                )
            })
    }

    /// `keyType`: for map containers only.
    fn key_type(&self, container: ContainerKind, s: &str) -> Result<String, SchemaError> {
        if container != ContainerKind::Map {
            return Err(self.bad("keyType", "it applies to map containers only".to_owned()));
        }
        // Items are keyed by string ids in every container.
        if s != "string" {
            return Err(self.bad(
                "keyType",
                format!("{s:?} is not accepted; accepted: string"),
            ));
        }
        Ok(s.to_owned())
    }

    /// `valueRef`: for map containers only, and a local JSON pointer.
    fn value_ref(&self, container: ContainerKind, s: &str) -> Result<String, SchemaError> {
        if container != ContainerKind::Map {
            return Err(self.bad("valueRef", "it applies to map containers only".to_owned()));
        }
        if !s.starts_with("#/") {
            return Err(self.bad(
                "valueRef",
                format!(
                    "{:?} is not a local JSON pointer such as #/definitions/Item",
                    truncate_chars(s, 64)
                ),
            ));
        }
        Ok(s.to_owned())
    }
}

/// `{"window": <ISO-8601 duration>, "strategy": "evict_low_importance"}`,
/// both required and nothing else.
fn parse_retention(id: &str, v: &Value) -> Result<Retention, SchemaError> {
    let bad = |reason: String| SchemaError::BadAsmValue {
        id: id.to_owned(),
        key: "x-retention",
        reason,
    };
    let shape =
        "it must be {\"window\": <ISO-8601 duration>, \"strategy\": \"evict_low_importance\"}";
    let obj = v.as_object().ok_or_else(|| bad(shape.to_owned()))?;
    if let Some(key) = obj.keys().find(|k| *k != "window" && *k != "strategy") {
        return Err(bad(format!(
            "unknown key {:?}; {shape}",
            truncate_chars(key, 64)
        )));
    }
    let window = obj
        .get("window")
        .and_then(Value::as_str)
        .ok_or_else(|| bad(format!("\"window\" is missing or not a string; {shape}")))?;
    let window_secs =
        parse_iso8601_duration(window).map_err(|source| SchemaError::BadDuration {
            id: id.to_owned(),
            key: "x-retention.window",
            source,
        })?;
    let strategy = obj
        .get("strategy")
        .and_then(Value::as_str)
        .ok_or_else(|| bad(format!("\"strategy\" is missing or not a string; {shape}")))?;
    let strategy = RetentionStrategy::parse(strategy).ok_or_else(|| {
        bad(format!(
            "strategy {:?} is not accepted; accepted: evict_low_importance",
            truncate_chars(strategy, 64)
        ))
    })?;
    Ok(Retention {
        window_secs,
        strategy,
    })
}

/// Finds the schema of one stored item and the policy of each of its
/// top-level fields, per container kind.
fn item_schema_and_fields(
    id: &str,
    raw: &Value,
    obj: &Map<String, Value>,
    ann: &Annotations,
) -> Result<(Value, BTreeMap<String, CrdtKind>), SchemaError> {
    let no_item = |reason: String| SchemaError::NoItemSchema {
        id: id.to_owned(),
        container: ann.container,
        reason,
    };
    let empty = Map::new();
    let properties = match obj.get("properties") {
        None => &empty,
        Some(Value::Object(p)) => p,
        // The meta-schema check has already refused a non-object.
        Some(_) => &empty,
    };

    match ann.container {
        ContainerKind::Object => {
            let mut item = obj.clone();
            for key in ["$id", "$schema", "x-asm"] {
                item.remove(key);
            }
            let fields = field_policies(id, raw, properties)?;
            Ok((Value::Object(item), fields))
        }
        ContainerKind::Map => {
            let (pointer, target) = if let Some(pointer) = &ann.value_ref {
                let target =
                    resolve_pointer(raw, pointer).ok_or_else(|| SchemaError::BadAsmValue {
                        id: id.to_owned(),
                        key: "valueRef",
                        reason: format!(
                            "{:?} does not resolve to a schema in this document",
                            truncate_chars(pointer, 64)
                        ),
                    })?;
                (Some(pointer.as_str()), target)
            } else {
                let candidates: Vec<(&String, &Value)> = properties
                    .iter()
                    .filter(|(_, p)| type_names(p) == ["object"])
                    .filter_map(|(name, p)| match p.get("additionalProperties") {
                        Some(ap @ Value::Object(_)) => Some((name, ap)),
                        _ => None,
                    })
                    .collect();
                match candidates.as_slice() {
                    [(name, ap)] => {
                        check_container_property(id, name, properties, &[CrdtKind::OrMap])?;
                        (None, *ap)
                    }
                    [] => {
                        return Err(no_item(
                            "set x-asm valueRef to the value schema (e.g. #/definitions/Item), or give an object-typed property an \"additionalProperties\" schema".to_owned(),
                        ));
                    }
                    many => {
                        return Err(no_item(format!(
                            "several object-typed properties ({}) have an \"additionalProperties\" schema; set x-asm valueRef to choose",
                            many.iter()
                                .map(|(n, _)| n.as_str())
                                .collect::<Vec<_>>()
                                .join(", ")
                        )));
                    }
                }
            };
            item_from(id, raw, obj, target, pointer, &no_item)
        }
        ContainerKind::List | ContainerKind::Log => {
            let arrays: Vec<(&String, &Value)> = properties
                .iter()
                .filter(|(_, p)| type_names(p) == ["array"])
                .filter_map(|(name, p)| match p.get("items") {
                    Some(items @ Value::Object(_)) => Some((name, items)),
                    _ => None,
                })
                .collect();
            // Several arrays are disambiguated by the one marked log_rga.
            let marked: Vec<(&String, &Value)> = arrays
                .iter()
                .filter(|(name, _)| {
                    properties
                        .get(name.as_str())
                        .and_then(|p| p.get("x-crdt"))
                        .and_then(Value::as_str)
                        == Some(CrdtKind::LogRga.as_str())
                })
                .copied()
                .collect();
            let chosen = match (arrays.as_slice(), marked.as_slice()) {
                ([one], _) | (_, [one]) => *one,
                ([], _) => {
                    return Err(no_item(
                        "give the schema an array-typed property whose \"items\" schema describes one entry".to_owned(),
                    ));
                }
                (many, _) => {
                    return Err(no_item(format!(
                        "several array-typed properties ({}) have an \"items\" schema; mark the one holding the entries with \"x-crdt\": \"log_rga\"",
                        many.iter()
                            .map(|(n, _)| n.as_str())
                            .collect::<Vec<_>>()
                            .join(", ")
                    )));
                }
            };
            let (name, items) = chosen;
            check_container_property(id, name, properties, &[CrdtKind::LogRga])?;
            item_from(id, raw, obj, items, None, &no_item)
        }
    }
}

/// The property holding a map's or list's items may restate the container
/// policy in `x-crdt`, but nothing else.
fn check_container_property(
    id: &str,
    name: &str,
    properties: &Map<String, Value>,
    accepted: &[CrdtKind],
) -> Result<(), SchemaError> {
    let Some(keyword) = properties.get(name).and_then(|p| p.get("x-crdt")) else {
        return Ok(());
    };
    match keyword.as_str().and_then(CrdtKind::parse) {
        Some(k) if accepted.contains(&k) => Ok(()),
        _ => Err(SchemaError::BadField {
            id: id.to_owned(),
            field: name.to_owned(),
            reason: format!(
                "x-crdt {} is not accepted on the property holding the container's items; accepted: {}",
                short(keyword),
                join_kinds(accepted)
            ),
        }),
    }
}

/// Builds the item schema of a map or list from the schema `target` found
/// inside `raw`, and reads its field policies.
fn item_from(
    id: &str,
    raw: &Value,
    obj: &Map<String, Value>,
    target: &Value,
    pointer: Option<&str>,
    no_item: &dyn Fn(String) -> SchemaError,
) -> Result<(Value, BTreeMap<String, CrdtKind>), SchemaError> {
    let resolved = resolve_refs(raw, target).map_err(no_item)?;
    if type_names(resolved) != ["object"] {
        return Err(no_item(
            "its items must be JSON objects: give the item schema \"type\": \"object\"".to_owned(),
        ));
    }
    let properties = match resolved.get("properties") {
        Some(Value::Object(p)) => p.clone(),
        _ => Map::new(),
    };
    let fields = field_policies(id, raw, &properties)?;
    Ok((attach_defs(target, obj, pointer), fields))
}

/// The item schema `target` with the schema's `definitions` and `$defs`
/// beside it, so `#/definitions/...` references inside it still resolve
/// once it is compiled on its own. If the target has definitions of its
/// own, it is referenced by `pointer` (or wrapped in `allOf`) instead of
/// merged, so neither set shadows the other.
fn attach_defs(target: &Value, obj: &Map<String, Value>, pointer: Option<&str>) -> Value {
    let defs: Vec<(&str, &Value)> = ["definitions", "$defs"]
        .into_iter()
        .filter_map(|key| obj.get(key).map(|v| (key, v)))
        .collect();
    if defs.is_empty() {
        return target.clone();
    }
    match target.as_object() {
        Some(t) if defs.iter().all(|(key, _)| !t.contains_key(*key)) => {
            let mut item = t.clone();
            for (key, value) in defs {
                item.insert(key.to_owned(), value.clone());
            }
            Value::Object(item)
        }
        _ => {
            let mut wrapper = Map::new();
            match pointer {
                Some(p) => {
                    wrapper.insert("$ref".to_owned(), Value::from(p));
                }
                None => {
                    wrapper.insert("allOf".to_owned(), json!([target]));
                }
            }
            for (key, value) in defs {
                wrapper.insert(key.to_owned(), value.clone());
            }
            Value::Object(wrapper)
        }
    }
}

/// The policy of each property: its `x-crdt`, else `or_map` for objects and
/// `lww_register` for everything else; keywords must fit the type.
fn field_policies(
    id: &str,
    raw: &Value,
    properties: &Map<String, Value>,
) -> Result<BTreeMap<String, CrdtKind>, SchemaError> {
    let mut fields = BTreeMap::new();
    for (name, prop) in properties {
        let bad = |reason: String| SchemaError::BadField {
            id: id.to_owned(),
            field: truncate_chars(name, 64),
            reason,
        };
        let resolved = resolve_refs(raw, prop).map_err(bad)?;
        let types = type_names(resolved);
        let keyword = prop.get("x-crdt").or_else(|| resolved.get("x-crdt"));
        let kind = match keyword {
            None if types == ["object"] => CrdtKind::OrMap,
            None => CrdtKind::LwwRegister,
            Some(k) => {
                let kind = k.as_str().and_then(CrdtKind::parse).ok_or_else(|| {
                    bad(format!(
                        "x-crdt {} is not one of lww_register, mv_register, rga_text, grow_only_set, or_map, counter, flag, log_rga",
                        short(k)
                    ))
                })?;
                if kind == CrdtKind::AppendOnly {
                    return Err(bad(
                        "x-crdt append_only is a container policy; set it in x-asm crdt instead"
                            .to_owned(),
                    ));
                }
                check_kind_type(kind, &types).map_err(bad)?;
                kind
            }
        };
        fields.insert(name.clone(), kind);
    }
    Ok(fields)
}

/// A keyword with a typed Automerge representation needs the matching JSON
/// type; registers hold any value.
fn check_kind_type(kind: CrdtKind, types: &[&str]) -> Result<(), String> {
    let accepted: &[&str] = match kind {
        CrdtKind::LwwRegister | CrdtKind::MvRegister => return Ok(()),
        CrdtKind::Counter => &["integer", "number"],
        CrdtKind::Flag => &["boolean"],
        CrdtKind::RgaText => &["string"],
        CrdtKind::GrowOnlySet | CrdtKind::LogRga => &["array"],
        CrdtKind::OrMap => &["object"],
        CrdtKind::AppendOnly => return Err("append_only is a container policy".to_owned()),
    };
    if !types.is_empty() && types.iter().all(|t| accepted.contains(t)) {
        Ok(())
    } else {
        Err(format!(
            "x-crdt {kind} needs \"type\": {}, but the type is {}",
            accepted
                .iter()
                .map(|t| format!("{t:?}"))
                .collect::<Vec<_>>()
                .join(" or "),
            if types.is_empty() {
                "not given".to_owned()
            } else {
                types.join(", ")
            }
        ))
    }
}

/// The `type` keyword as a list of names (empty when absent or malformed).
fn type_names(schema: &Value) -> Vec<&str> {
    match schema.get("type") {
        Some(Value::String(t)) => vec![t.as_str()],
        Some(Value::Array(ts)) => ts.iter().filter_map(Value::as_str).collect(),
        _ => Vec::new(),
    }
}

/// Follows a schema's local `$ref` chain (when it has no `properties` or
/// `type` of its own) to the schema that describes the value.
fn resolve_refs<'a>(raw: &'a Value, schema: &'a Value) -> Result<&'a Value, String> {
    let mut current = schema;
    for _ in 0..MAX_REF_HOPS {
        let Some(reference) = current.get("$ref").and_then(Value::as_str) else {
            return Ok(current);
        };
        if current.get("properties").is_some() || current.get("type").is_some() {
            return Ok(current);
        }
        current = resolve_pointer(raw, reference).ok_or_else(|| {
            format!(
                "$ref {:?} is not a local JSON pointer that resolves in this schema",
                truncate_chars(reference, 64)
            )
        })?;
    }
    Err(format!("$ref chain is longer than {MAX_REF_HOPS} hops"))
}

/// Resolves `#` or `#/json/pointer` against the schema document.
fn resolve_pointer<'a>(raw: &'a Value, reference: &str) -> Option<&'a Value> {
    let pointer = reference.strip_prefix('#')?;
    if pointer.is_empty() {
        return Some(raw);
    }
    if !pointer.starts_with('/') {
        return None;
    }
    raw.pointer(pointer)
        .filter(|v| v.is_object() || v.is_boolean())
}

fn join_kinds(kinds: &[CrdtKind]) -> String {
    kinds
        .iter()
        .map(|k| k.as_str())
        .collect::<Vec<_>>()
        .join(", ")
}

/// A JSON value shortened for an error message.
fn short(v: &Value) -> String {
    truncate_chars(&v.to_string(), 64)
}

/// Keeps at most `max` characters, marking the cut.
fn truncate_chars(s: &str, max: usize) -> String {
    match s.char_indices().nth(max) {
        None => s.to_owned(),
        Some((cut, _)) => format!("{}…", &s[..cut]),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse_ok(raw: &Value) -> AsmSchema {
        match parse(raw) {
            Ok(s) => s,
            Err(e) => panic!("schema should parse: {e}"),
        }
    }

    fn fields(pairs: &[(&str, CrdtKind)]) -> BTreeMap<String, CrdtKind> {
        pairs.iter().map(|(n, k)| ((*n).to_owned(), *k)).collect()
    }

    /// A minimal schema with `x-asm` and `properties` patched in.
    fn with(asm: Option<Value>, properties: Value) -> Value {
        let mut raw = json!({
            "$id": "did:nuwa:user:alice:state:Thing#v1",
            "type": "object",
            "properties": properties,
        });
        if let Some(asm) = asm {
            raw["x-asm"] = asm;
        }
        raw
    }

    // Goal: the bundled files are the NIP-8 core schemas and parse to the
    // layouts and annotations the spec gives them.
    #[test]
    fn core_schemas_parse() {
        use CrdtKind::*;
        let core = core_schemas();
        assert_eq!(core.len(), 3);
        let log = parse_ok(&core[0]);
        assert_eq!(log.id.full, "did:nuwa:core:ConversationLog#v1");
        assert_eq!(log.id.namespace, Namespace::Core);
        assert_eq!(log.id.base, "did:nuwa:core:ConversationLog");
        assert_eq!(log.id.version, 1);
        assert_eq!(
            log.layout,
            Layout {
                container: ContainerKind::Log,
                container_crdt: Some(AppendOnly),
                fields: fields(&[
                    ("content", LwwRegister),
                    ("id", LwwRegister),
                    ("role", LwwRegister),
                    ("timestamp", LwwRegister),
                ]),
                default_field: LwwRegister,
            }
        );
        assert!(log.layout.append_only());
        assert_eq!(log.ttl_secs, Some(14 * 86_400));
        assert_eq!(log.compression, Some(Compression::Br));
        assert_eq!(log.visibility, Visibility::Private);
        assert_eq!(log.retention, None);

        let memory = parse_ok(&core[1]);
        assert_eq!(memory.id.full, "did:nuwa:core:MemoryStore#v1");
        assert_eq!(memory.layout.container, ContainerKind::Map);
        assert_eq!(memory.layout.container_crdt, None);
        assert_eq!(
            memory.layout.fields,
            fields(&[
                ("createdAt", LwwRegister),
                ("importance", LwwRegister),
                ("value", LwwRegister),
            ])
        );
        assert_eq!(
            memory.value_ref.as_deref(),
            Some("#/definitions/MemoryItem")
        );
        assert_eq!(memory.key_type.as_deref(), Some("string"));
        assert_eq!(
            memory.retention,
            Some(Retention {
                window_secs: 90 * 86_400,
                strategy: RetentionStrategy::EvictLowImportance,
            })
        );
        assert_eq!(memory.ttl_secs, None);

        let settings = parse_ok(&core[2]);
        assert_eq!(settings.id.full, "did:nuwa:core:AgentSettings#v1");
        assert_eq!(settings.layout.container, ContainerKind::Object);
        assert_eq!(
            settings.layout.fields,
            fields(&[
                ("language", LwwRegister),
                ("notifOpt", LwwRegister),
                ("theme", LwwRegister),
                ("tone", LwwRegister),
            ])
        );
        for s in [&log, &memory, &settings] {
            assert!(is_bundled_core(&s.raw));
            assert!(s.item_schema.get("$id").is_none());
            assert!(s.item_schema.get("x-asm").is_none());
        }
    }

    // Goal: the items of each core container validate as the spec intends,
    // including `$ref`s into `definitions` and format assertions.
    #[test]
    fn core_items_validate() {
        let core = core_schemas();
        // (core schema index, item, expected (path, rule) pairs sorted)
        type Case = (usize, Value, Vec<(&'static str, &'static str)>);
        let cases: Vec<Case> = vec![
            (
                0,
                json!({"id": "0b6a3c1e-8f4e-4c57-9a1d-2f0f6a9c7e11", "role": "user",
                       "content": "hi", "timestamp": "2025-05-18T10:00:00Z"}),
                vec![],
            ),
            (
                0,
                json!({"id": "nope", "role": "robot", "content": 1,
                       "timestamp": "yesterday"}),
                vec![
                    ("/content", "type"),
                    ("/id", "format"),
                    ("/role", "enum"),
                    ("/timestamp", "format"),
                ],
            ),
            (
                1,
                json!({"value": "likes tea", "importance": 0.7,
                       "createdAt": "2025-05-18T10:00:00Z"}),
                vec![],
            ),
            (
                1,
                json!({"value": "x", "importance": "high"}),
                vec![("", "required"), ("/importance", "type")],
            ),
            (2, json!({"language": "en", "notifOpt": true}), vec![]),
            (2, json!({"language": "fr"}), vec![("/language", "enum")]),
            (2, json!({}), vec![("", "required")]),
        ];
        for (schema_index, item, want) in cases {
            let schema = parse_ok(&core[schema_index]);
            let mut got: Vec<(String, String)> = match schema.validate_item(&item) {
                Ok(()) => Vec::new(),
                Err(errors) => errors.into_iter().map(|e| (e.path, e.rule)).collect(),
            };
            got.sort();
            let want: Vec<(String, String)> = want
                .iter()
                .map(|(p, r)| ((*p).to_owned(), (*r).to_owned()))
                .collect();
            assert_eq!(got, want, "schema {} item {item}", schema.id);
        }
    }

    // Goal: NIP-7's note schema parses with its declared field policies and
    // its items are validated with paths, keywords and format assertions.
    #[test]
    fn note_schema() {
        use CrdtKind::*;
        let note = parse_ok(&example_note_schema());
        assert_eq!(note.id.namespace, Namespace::State);
        assert_eq!(note.id.base, "did:nuwa:state:note");
        assert_eq!(note.layout.container, ContainerKind::Object);
        assert_eq!(note.layout.container_crdt, None);
        assert_eq!(
            note.layout.fields,
            fields(&[
                ("body", RgaText),
                ("createdAt", LwwRegister),
                ("id", LwwRegister),
                ("source_url", LwwRegister),
                ("tags", GrowOnlySet),
                ("title", LwwRegister),
                ("updatedAt", LwwRegister),
            ])
        );
        assert!(note.item_schema.get("$schema").is_none());

        let good = json!({
            "id": "0b6a3c1e-8f4e-4c57-9a1d-2f0f6a9c7e11",
            "title": "Meeting",
            "body": "notes",
            "source_url": "https://example.com/a",
            "tags": ["meeting"],
            "createdAt": "2025-05-18T10:00:00Z",
            "updatedAt": "2025-05-18T10:05:00+02:00",
        });
        assert_eq!(note.validate_item(&good), Ok(()));

        let patch = |key: &str, value: Option<Value>| {
            let mut item = good.clone();
            match (item.as_object_mut(), value) {
                (Some(obj), Some(v)) => {
                    obj.insert(key.to_owned(), v);
                }
                (Some(obj), None) => {
                    obj.remove(key);
                }
                (None, _) => {}
            }
            item
        };
        let cases: Vec<(&str, Value, &str, &str)> = vec![
            ("missing title", patch("title", None), "", "required"),
            (
                "title not a string",
                patch("title", Some(json!(5))),
                "/title",
                "type",
            ),
            (
                "bad date-time",
                patch("createdAt", Some(json!("2025-13-40"))),
                "/createdAt",
                "format",
            ),
            (
                "bad uuid",
                patch("id", Some(json!("not-a-uuid"))),
                "/id",
                "format",
            ),
            (
                "bad uri",
                patch("source_url", Some(json!("no scheme here"))),
                "/source_url",
                "format",
            ),
            (
                "tag not a string",
                patch("tags", Some(json!(["a", 2]))),
                "/tags/1",
                "type",
            ),
            ("not an object", json!("note"), "", "type"),
        ];
        for (name, item, path, rule) in cases {
            let errors = note.validate_item(&item).expect_err(name);
            assert_eq!(errors.len(), 1, "{name}: {errors:?}");
            assert_eq!(
                (errors[0].path.as_str(), errors[0].rule.as_str()),
                (path, rule),
                "{name}"
            );
            assert!(!errors[0].message.is_empty(), "{name}");
        }

        // Every error is reported, up to the bound.
        let errors = note.validate_item(&json!({})).expect_err("empty");
        let missing: Vec<(&str, &str)> = errors
            .iter()
            .map(|e| (e.path.as_str(), e.rule.as_str()))
            .collect();
        assert_eq!(
            missing,
            [("", "required"); 5],
            "one error per missing field"
        );
        let many: Map<String, Value> = (0..40)
            .map(|i| (format!("p{i}"), json!({"type": "string"})))
            .collect();
        let wide = parse_ok(&with(None, Value::Object(many)));
        let bad_item: Map<String, Value> = (0..40).map(|i| (format!("p{i}"), json!(i))).collect();
        let errors = wide
            .validate_item(&Value::Object(bad_item))
            .expect_err("40 bad fields");
        assert_eq!(errors.len(), MAX_VALIDATION_ERRORS);
    }

    // Goal: describe() gives the small summary tools show.
    #[test]
    fn describe_summary() {
        let log = parse_ok(&core_schemas()[0]);
        assert_eq!(
            log.describe(),
            json!({
                "id": "did:nuwa:core:ConversationLog#v1",
                "namespace": "core",
                "container": "log",
                "crdt": "append_only",
                "fields": {"content": "lww_register", "id": "lww_register",
                           "role": "lww_register", "timestamp": "lww_register"},
                "required": ["id", "role", "content", "timestamp"],
                "ttl_secs": 1_209_600,
                "retention": null,
                "compression": "br",
                "visibility": "private",
            })
        );
        let memory = parse_ok(&core_schemas()[1]);
        let d = memory.describe();
        assert_eq!(
            d["retention"],
            json!({"window_secs": 7_776_000, "strategy": "evict_low_importance"})
        );
        assert_eq!(d["crdt"], Value::Null);
    }

    // Goal: every id form of NIP-8 and NIP-7 parses to its parts.
    #[test]
    fn good_ids() {
        let cases: &[(&str, Namespace, &str, u32)] = &[
            (
                "did:nuwa:core:ConversationLog#v1",
                Namespace::Core,
                "did:nuwa:core:ConversationLog",
                1,
            ),
            (
                "did:nuwa:cap:note@1.0.0:state:Note#v2",
                Namespace::Cap,
                "did:nuwa:cap:note@1.0.0:state:Note",
                2,
            ),
            (
                "did:nuwa:app:my-app:state:Board_1#v10",
                Namespace::App,
                "did:nuwa:app:my-app:state:Board_1",
                10,
            ),
            (
                "did:nuwa:user:z6MkAbc:state:Todo#v4294967295",
                Namespace::User,
                "did:nuwa:user:z6MkAbc:state:Todo",
                u32::MAX,
            ),
            (
                "did:nuwa:state:note#v1",
                Namespace::State,
                "did:nuwa:state:note",
                1,
            ),
        ];
        for (text, namespace, base, version) in cases {
            let id = SchemaId::parse(text).unwrap_or_else(|e| panic!("{text}: {e}"));
            assert_eq!(
                (id.full.as_str(), id.namespace, id.base.as_str(), id.version),
                (*text, *namespace, *base, *version)
            );
            assert_eq!(id.to_string(), *text);
        }
    }

    // Goal: every malformed id is refused with BadId naming the input and
    // listing the accepted forms.
    #[test]
    fn bad_ids() {
        let long_name = "a".repeat(65);
        let too_long = format!(
            "did:nuwa:user:{}:state:{}#v1",
            "u".repeat(60),
            "n".repeat(64)
        )
        .repeat(2);
        let cases: Vec<String> = vec![
            "".into(),
            "did:nuwa:core:Model".into(),
            "did:nuwa:core:Model#1".into(),
            "did:nuwa:core:Model#v0".into(),
            "did:nuwa:core:Model#v01".into(),
            "did:nuwa:core:Model#v".into(),
            "did:nuwa:core:Model#v-1".into(),
            "did:nuwa:core:Model#v4294967296".into(),
            "did:nuwa:core:Model#v1#v2".into(),
            "did:nuwa:core:#v1".into(),
            "did:nuwa:core:Mo del#v1".into(),
            "did:nuwa:core:Mo/del#v1".into(),
            "did:nuwa:core:Modèl#v1".into(),
            format!("did:nuwa:core:{long_name}#v1"),
            "did:nuwa:core:a:b#v1".into(),
            "did:nuwa:cap:note@1.0.0:Note#v1".into(),
            "did:nuwa:cap:note@1.0.0:stat:Note#v1".into(),
            "did:nuwa:cap::state:Note#v1".into(),
            "did:nuwa:core:x:state:Note#v1".into(),
            "did:nuwa:team:x:state:Note#v1".into(),
            "did:nuwa:state:a:b#v1".into(),
            "did:other:core:Model#v1".into(),
            "DID:nuwa:core:Model#v1".into(),
            "did:nuwa:user:a:state:b:c#v1".into(),
            too_long,
        ];
        for text in &cases {
            let err = SchemaId::parse(text).expect_err(text);
            assert!(matches!(err, SchemaError::BadId { .. }), "{text}: {err}");
            let msg = err.to_string();
            assert!(
                msg.contains("did:nuwa:cap:<cap_id>:state:<Name>#v<n>"),
                "{msg}"
            );
            if text.len() <= MAX_ID_BYTES {
                assert!(msg.contains(&format!("{text:?}")), "{msg}");
            }
        }
    }

    // Goal: malformed schema documents are refused with the matching error;
    // method: a table of documents and the error each must give.
    #[test]
    fn bad_documents() {
        let deep = (0..70).fold(
            json!({"type": "string"}),
            |inner, _| json!({"items": inner}),
        );
        let mut deep_schema = with(None, json!({}));
        deep_schema["properties"]["deep"] = deep;
        let mut big_schema = with(None, json!({}));
        big_schema["description"] = json!("x".repeat(MAX_SCHEMA_BYTES));
        type Check = fn(&SchemaError) -> bool;
        let cases: Vec<(&str, Value, Check)> = vec![
            ("array", json!([]), |e| matches!(e, SchemaError::NotObject)),
            ("no $id", json!({"type": "object"}), |e| {
                matches!(e, SchemaError::MissingId)
            }),
            ("numeric $id", json!({"$id": 5, "type": "object"}), |e| {
                matches!(e, SchemaError::MissingId)
            }),
            (
                "bad $id",
                json!({"$id": "note#v1", "type": "object"}),
                |e| matches!(e, SchemaError::BadId { .. }),
            ),
            ("too deep", deep_schema, |e| {
                matches!(e, SchemaError::TooDeep { .. })
            }),
            ("too big", big_schema, |e| {
                matches!(e, SchemaError::TooLarge { .. })
            }),
            (
                "draft 7",
                json!({"$id": "did:nuwa:state:a#v1", "$schema": "http://json-schema.org/draft-07/schema#", "type": "object"}),
                |e| matches!(e, SchemaError::UnsupportedDialect { .. }),
            ),
            (
                "type 5",
                json!({"$id": "did:nuwa:state:a#v1", "type": 5}),
                |e| matches!(e, SchemaError::NotJsonSchema { .. }),
            ),
            (
                "bad nested keyword",
                with(None, json!({"n": {"type": "integer", "minimum": "zero"}})),
                |e| matches!(e, SchemaError::NotJsonSchema { .. }),
            ),
            (
                "required not a list",
                json!({"$id": "did:nuwa:state:a#v1", "type": "object", "required": "a"}),
                |e| matches!(e, SchemaError::NotJsonSchema { .. }),
            ),
            (
                "not type object",
                json!({"$id": "did:nuwa:state:a#v1", "type": "array"}),
                |e| matches!(e, SchemaError::NotTypeObject { .. }),
            ),
            ("no type", json!({"$id": "did:nuwa:state:a#v1"}), |e| {
                matches!(e, SchemaError::NotTypeObject { .. })
            }),
            (
                "unresolvable $ref",
                with(None, json!({"a": {"$ref": "#/definitions/Missing"}})),
                |e| matches!(e, SchemaError::BadField { .. }),
            ),
            (
                "remote $ref",
                with(
                    None,
                    json!({"a": {"$ref": "https://example.com/s.json", "type": "string"}}),
                ),
                |e| matches!(e, SchemaError::Compile { .. }),
            ),
        ];
        for (name, raw, check) in cases {
            match parse(&raw) {
                Ok(_) => panic!("{name}: should be refused"),
                Err(e) => assert!(check(&e), "{name}: unexpected error {e}"),
            }
        }
        let err = parse(&json!({"$id": "did:nuwa:state:a#v1", "type": 5})).expect_err("type 5");
        assert!(err.to_string().contains("did:nuwa:state:a#v1"), "{err}");
    }

    // Goal: x-asm is checked key by key; method: a table of x-asm objects
    // with the error kind and a fragment the message must contain.
    #[test]
    fn bad_annotations() {
        let obj_props = json!({"a": {"type": "string"}});
        let cases: Vec<(&str, Value, &str)> = vec![
            ("x-asm not object", json!("log"), "must be an object of ASM"),
            (
                "unknown key",
                json!({"container": "object", "ttl": "P1D"}),
                "unknown x-asm key \"ttl\"",
            ),
            ("typo", json!({"x-visiblity": "public"}), "\"x-visiblity\""),
            (
                "bad container",
                json!({"container": "table"}),
                "object, map, list, log",
            ),
            (
                "container not string",
                json!({"container": 1}),
                "not a string",
            ),
            ("bad ttl", json!({"x-ttl": "14 days"}), "bad x-asm x-ttl"),
            ("lowercase ttl", json!({"x-ttl": "p14d"}), "bad x-asm x-ttl"),
            (
                "bad compression",
                json!({"x-compression": "lz4"}),
                "br, zstd, gzip",
            ),
            (
                "bad visibility",
                json!({"x-visibility": "secret"}),
                "private, shared, public",
            ),
            (
                "crdt on object",
                json!({"crdt": "append_only"}),
                "accepted: or_map",
            ),
            ("unknown crdt", json!({"crdt": "lww"}), "accepted: or_map"),
            (
                "keyType on object",
                json!({"keyType": "string"}),
                "map containers only",
            ),
            (
                "valueRef on object",
                json!({"valueRef": "#/definitions/X"}),
                "map containers only",
            ),
            (
                "retention not object",
                json!({"x-retention": "P90D"}),
                "\"window\"",
            ),
            (
                "retention no strategy",
                json!({"x-retention": {"window": "P90D"}}),
                "\"strategy\" is missing",
            ),
            (
                "retention no window",
                json!({"x-retention": {"strategy": "evict_low_importance"}}),
                "\"window\" is missing",
            ),
            (
                "retention extra",
                json!({"x-retention": {"window": "P9D", "strategy": "evict_low_importance", "keep": 1}}),
                "unknown key \"keep\"",
            ),
            (
                "retention bad window",
                json!({"x-retention": {"window": "90D", "strategy": "evict_low_importance"}}),
                "x-retention.window",
            ),
            (
                "retention bad strategy",
                json!({"x-retention": {"window": "P9D", "strategy": "lru"}}),
                "accepted: evict_low_importance",
            ),
        ];
        for (name, asm, fragment) in cases {
            let err = parse(&with(Some(asm), obj_props.clone())).expect_err(name);
            let mut msg = err.to_string();
            if let Some(source) = std::error::Error::source(&err) {
                msg = format!("{msg}: {source}");
            }
            assert!(msg.contains(fragment), "{name}: {msg}");
            assert!(
                msg.contains("did:nuwa:user:alice:state:Thing#v1"),
                "{name}: {msg}"
            );
        }
        let err = parse(&with(Some(json!({"x-ttl": "P1.5D"})), obj_props)).expect_err("fraction");
        assert!(matches!(
            err,
            SchemaError::BadDuration {
                key: "x-ttl",
                source: DurationError::Malformed { .. },
                ..
            }
        ));
    }

    // Goal: container kinds find their item schema and field policies, and
    // refuse schemas where none can be found.
    #[test]
    fn containers() {
        use CrdtKind::*;
        let entry = json!({"type": "object", "properties": {
            "n": {"type": "integer", "x-crdt": "counter"},
            "meta": {"type": "object"},
            "text": {"type": "string", "x-crdt": "rga_text"}
        }});
        let entry_fields = fields(&[("meta", OrMap), ("n", Counter), ("text", RgaText)]);
        // A list container with the entries array marked among other arrays.
        let list = parse_ok(&with(
            Some(json!({"container": "list"})),
            json!({
                "other": {"type": "array", "items": {"type": "object"}},
                "entries": {"type": "array", "x-crdt": "log_rga", "items": entry.clone()}
            }),
        ));
        assert_eq!(list.layout.container, ContainerKind::List);
        assert_eq!(list.layout.fields, entry_fields);
        assert_eq!(list.layout.field("unknown"), LwwRegister);
        assert_eq!(list.validate_item(&json!({"n": 1, "text": "a"})), Ok(()));
        assert!(list.validate_item(&json!({"n": "1"})).is_err());

        // A map through additionalProperties with a $ref into $defs.
        let mut map_raw = with(
            Some(json!({"container": "map", "crdt": "or_map", "keyType": "string"})),
            json!({"items": {"type": "object", "x-crdt": "or_map",
                             "additionalProperties": {"$ref": "#/$defs/Entry"}}}),
        );
        map_raw["$defs"] = json!({"Entry": entry.clone()});
        let map = parse_ok(&map_raw);
        assert_eq!(map.layout.container_crdt, Some(OrMap));
        assert_eq!(map.layout.fields, entry_fields);
        assert_eq!(map.validate_item(&json!({"n": 2})), Ok(()));
        let errors = map
            .validate_item(&json!({"n": 2.5}))
            .expect_err("not integer");
        assert_eq!(errors[0].path, "/n");

        // A map through valueRef whose item has definitions of its own.
        let mut own_defs = with(
            Some(json!({"container": "map", "valueRef": "#/definitions/Item"})),
            json!({}),
        );
        own_defs["definitions"] = json!({
            "Item": {"type": "object", "properties": {"tag": {"$ref": "#/definitions/Tag"}},
                     "definitions": {"Unused": {}}},
            "Tag": {"type": "string", "maxLength": 3}
        });
        let map = parse_ok(&own_defs);
        assert_eq!(map.layout.fields, fields(&[("tag", LwwRegister)]));
        assert_eq!(map.validate_item(&json!({"tag": "abc"})), Ok(()));
        assert!(map.validate_item(&json!({"tag": "abcd"})).is_err());

        // A log whose entries array says something other than log_rga.
        let bad_log = with(
            Some(json!({"container": "log"})),
            json!({"entries": {"type": "array", "x-crdt": "grow_only_set", "items": entry.clone()}}),
        );
        let refused: Vec<(&str, Value)> = vec![
            ("log entries not log_rga", bad_log),
            (
                "list without arrays",
                with(
                    Some(json!({"container": "list"})),
                    json!({"a": {"type": "string"}}),
                ),
            ),
            (
                "list with two unmarked arrays",
                with(
                    Some(json!({"container": "list"})),
                    json!({
                        "a": {"type": "array", "items": entry.clone()},
                        "b": {"type": "array", "items": entry.clone()}
                    }),
                ),
            ),
            (
                "list of strings",
                with(
                    Some(json!({"container": "log"})),
                    json!({"a": {"type": "array", "items": {"type": "string"}}}),
                ),
            ),
            (
                "map without value schema",
                with(
                    Some(json!({"container": "map"})),
                    json!({"a": {"type": "object"}}),
                ),
            ),
            (
                "map valueRef missing",
                with(
                    Some(json!({"container": "map", "valueRef": "#/definitions/Nope"})),
                    json!({}),
                ),
            ),
            (
                "map valueRef not local",
                with(
                    Some(json!({"container": "map", "valueRef": "other.json#/X"})),
                    json!({}),
                ),
            ),
            (
                "log crdt or_map",
                with(
                    Some(json!({"container": "log", "crdt": "or_map"})),
                    json!({"e": {"type": "array", "items": entry.clone()}}),
                ),
            ),
        ];
        for (name, raw) in refused {
            let err = parse(&raw).expect_err(name);
            assert!(
                matches!(
                    err,
                    SchemaError::NoItemSchema { .. }
                        | SchemaError::BadField { .. }
                        | SchemaError::BadAsmValue { .. }
                ),
                "{name}: {err}"
            );
        }
    }

    // Goal: each x-crdt keyword is accepted on its matching type and refused
    // on others, naming the field; method: a table of property schemas.
    #[test]
    fn field_keywords() {
        use CrdtKind::*;
        let cases: Vec<(Value, Option<CrdtKind>)> = vec![
            (
                json!({"type": "integer", "x-crdt": "counter"}),
                Some(Counter),
            ),
            (
                json!({"type": "number", "x-crdt": "counter"}),
                Some(Counter),
            ),
            (json!({"type": "string", "x-crdt": "counter"}), None),
            (json!({"x-crdt": "counter"}), None),
            (
                json!({"type": ["integer", "null"], "x-crdt": "counter"}),
                None,
            ),
            (json!({"type": "boolean", "x-crdt": "flag"}), Some(Flag)),
            (json!({"type": "integer", "x-crdt": "flag"}), None),
            (
                json!({"type": "string", "x-crdt": "rga_text"}),
                Some(RgaText),
            ),
            (json!({"type": "array", "x-crdt": "rga_text"}), None),
            (
                json!({"type": "array", "x-crdt": "grow_only_set"}),
                Some(GrowOnlySet),
            ),
            (json!({"type": "string", "x-crdt": "grow_only_set"}), None),
            (json!({"type": "array", "x-crdt": "log_rga"}), Some(LogRga)),
            (json!({"type": "object", "x-crdt": "or_map"}), Some(OrMap)),
            (json!({"type": "string", "x-crdt": "or_map"}), None),
            (
                json!({"type": "object", "x-crdt": "lww_register"}),
                Some(LwwRegister),
            ),
            (json!({"x-crdt": "mv_register"}), Some(MvRegister)),
            (json!({"type": "array", "x-crdt": "append_only"}), None),
            (json!({"type": "string", "x-crdt": "lww"}), None),
            (json!({"type": "string", "x-crdt": 3}), None),
            (json!({"type": "object"}), Some(OrMap)),
            (json!({"type": "array"}), Some(LwwRegister)),
            (
                json!({"$ref": "#/$defs/Count", "x-crdt": "counter"}),
                Some(Counter),
            ),
        ];
        for (prop, want) in cases {
            let mut raw = with(None, json!({"f": prop.clone()}));
            raw["$defs"] = json!({"Count": {"type": "integer"}});
            match (parse(&raw), want) {
                (Ok(s), Some(kind)) => assert_eq!(s.layout.field("f"), kind, "{prop}"),
                (Err(SchemaError::BadField { field, .. }), None) => {
                    assert_eq!(field, "f", "{prop}")
                }
                (got, _) => panic!("{prop}: want {want:?}, got {got:?}"),
            }
        }
    }
}
