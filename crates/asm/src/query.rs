//! ASM-QL, the query language of NIP-8: a JSON AST (`select`, `from`,
//! `where`, `order`, `limit`, `cursor`) parsed into a typed [`Query`] and
//! evaluated in memory over `(id, item)` pairs by [`execute`].
//!
//! The evaluator interprets the AST; it never builds code (SQL or otherwise)
//! from its input, so there is nothing to inject into. Every dimension of a
//! query is capped (see the `MAX_*` constants) and a scan is bounded by a
//! [`Budget`] whose clock the caller owns.
//!
//! This module does not pick the container: `from` is checked to be a
//! non-empty string and handed back; the caller resolves the schema URI and
//! passes that container's items. It keeps no index either: every call scans
//! the items it is given and keeps only the page it returns.
//!
//! Semantics in brief (the NIP leaves them open, so they are fixed here):
//! - A field path addresses object members only (`a.b.c`); `id` is always
//!   the id passed with the item, whatever the item's own `id` member says.
//! - Equality is JSON equality with numbers compared by value (`1 == 1.0`).
//!   `$gt`/`$gte`/`$lt`/`$lte` compare number with number or string with
//!   string (by Unicode scalar, so ISO-8601 timestamps sort by time); any
//!   other pair is false. A missing field fails every operator except `$ne`
//!   and `$exists: false`.
//! - In a condition, an object whose keys start with `$` is a set of
//!   operators; any other value (including an object without `$` keys) is
//!   matched by equality. Wrap a literal with `$` keys in `$eq`.
//! - Sorting is total and deterministic: missing values sort last in both
//!   directions, mixed types sort `null < bool < number < string < array <
//!   object`, and ties fall back to the id, ascending.
//! - A cursor is opaque: base64url of a SHA-256 that binds it to `from`,
//!   `where` and `order`, followed by the sort values and id of the last
//!   item returned. `select` and `limit` may change between pages.

use std::borrow::Cow;
use std::cmp::Ordering;
use std::error::Error as StdError;
use std::fmt;

use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use serde::Deserialize;
use serde_json::{Map, Number, Value};
use sha2::{Digest, Sha256};
use thiserror::Error;

/// The largest page a query may ask for; larger limits are refused rather
/// than clamped so that a client never silently gets less than it asked for.
pub const MAX_LIMIT: usize = 1000;
/// The page size when a query gives no `limit`.
pub const DEFAULT_LIMIT: usize = 50;
/// The most segments a field path may have.
pub const MAX_PATH_SEGMENTS: usize = 16;
/// The longest a field path segment may be, in bytes.
pub const MAX_SEGMENT_LEN: usize = 64;
/// The deepest `$and`/`$or` nesting of `where` objects (the top one is 1).
pub const MAX_WHERE_DEPTH: usize = 32;
/// The most nodes (where objects, keys and operators) in a `where` clause.
pub const MAX_WHERE_NODES: usize = 1000;
/// The most values an `$in` list may hold.
pub const MAX_IN_VALUES: usize = 1000;
/// The deepest nesting of arrays and objects in an operand value.
pub const MAX_VALUE_DEPTH: usize = 32;
/// The most field paths in `select`.
pub const MAX_SELECT_FIELDS: usize = 256;
/// The most sort keys in `order`.
pub const MAX_ORDER_KEYS: usize = 16;
/// The longest `from` may be, in bytes.
pub const MAX_FROM_LEN: usize = 1024;
/// The longest a cursor may be, in bytes of its base64url text.
pub const MAX_CURSOR_LEN: usize = 16 * 1024;
/// [`Budget::expired`] is polled before the first item and then once every
/// this many items, so a cheap clock read is amortised over the scan.
pub const EXPIRY_POLL_INTERVAL: usize = 256;

/// Sorting compares arrays and objects element by element down to this
/// depth and treats anything deeper as equal (the id then breaks the tie);
/// this bounds recursion on items the caller hands in.
const CMP_DEPTH_MAX: usize = 64;
/// A filter built by hand (not by [`parse`]) is held to the structure a
/// parsed one can have: each `where` level may add an `And` for its keys and
/// one for `$and`/`$or`.
const FILTER_TREE_DEPTH_MAX: usize = 2 * MAX_WHERE_DEPTH;
/// Domain separation for the cursor digest; bump the version when the
/// cursor layout or the binding changes so old cursors are refused.
const CURSOR_DOMAIN: &[u8] = b"nuwa-asm/asm-ql/cursor/v1\0";
const DIGEST_LEN: usize = 32;

const QUERY_KEYS: &str = "select, from, where, order, limit, cursor";
const ORDER_KEYS: &str = "field, direction";
const FIELD_OPERATORS: &str = "$eq, $ne, $gt, $gte, $lt, $lte, $in, $contains, $exists";
const WHERE_OPERATORS: &str = "$and, $or or a field path";

/// Why a query was refused or stopped.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum QueryError {
    /// A part of the query has the wrong JSON type.
    #[error("{at}: expected {expected}, got {got}")]
    WrongType {
        at: String,
        expected: &'static str,
        got: &'static str,
    },
    /// An object of the query has a key this version does not know.
    #[error("{at}: unknown key {key:?}; use one of {expected}")]
    UnknownKey {
        at: String,
        key: String,
        expected: &'static str,
    },
    /// A required key is absent.
    #[error("{at}: missing the required key {key:?}; {hint}")]
    MissingKey {
        at: String,
        key: &'static str,
        hint: &'static str,
    },
    /// A value has the right type but is not acceptable.
    #[error("{at}: {problem}")]
    Invalid { at: String, problem: String },
    /// A field path does not follow the path grammar.
    #[error(
        "{at}: bad field path {path:?}: {reason}; write dot-separated segments of A-Z a-z 0-9 _ @ $ - (1 to {seg} bytes, not starting with $, at most {n} segments)",
        seg = MAX_SEGMENT_LEN,
        n = MAX_PATH_SEGMENTS
    )]
    BadPath {
        at: String,
        path: String,
        reason: &'static str,
    },
    /// A `$` key that is not an operator of its place.
    #[error("{at}: unknown operator {op}; use one of {expected}")]
    UnknownOperator {
        at: String,
        op: String,
        expected: &'static str,
    },
    /// `limit` is not an integer from 1 to [`MAX_LIMIT`].
    #[error("limit: {got} is not allowed; use an integer from 1 to {max}", max = MAX_LIMIT)]
    BadLimit { got: String },
    /// `$and`/`$or` nest deeper than [`MAX_WHERE_DEPTH`].
    #[error("{at}: conditions nest deeper than {max} levels; flatten the $and/$or tree", max = MAX_WHERE_DEPTH)]
    TooDeep { at: String },
    /// `where` has more than [`MAX_WHERE_NODES`] nodes.
    #[error("where: more than {max} objects, keys and operators; split the query", max = MAX_WHERE_NODES)]
    TooManyNodes,
    /// The cursor does not decode, was altered, or belongs to a query with
    /// another `from`, `where` or `order`.
    #[error("cursor: {reason}; drop the cursor and start again from the first page")]
    BadCursor {
        reason: &'static str,
        #[source]
        source: Option<Box<dyn StdError + Send + Sync + 'static>>,
    },
    /// The sort values of the last item on the page are too large to carry
    /// in a cursor.
    #[error(
        "order: the sort values of item {id:?} make a cursor of {len_bytes} bytes, above the {max} byte cap; order by smaller fields",
        max = MAX_CURSOR_LEN
    )]
    CursorTooLong { id: String, len_bytes: usize },
    /// The scan hit the caller's [`Budget`].
    #[error(
        "query stopped after scanning {scanned} items: {exceeded}; query a smaller container, simplify the where clause or raise the budget"
    )]
    TooExpensive { exceeded: Exceeded, scanned: usize },
}

/// Which part of the [`Budget`] a query ran out of.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Exceeded {
    /// More items than [`Budget::max_scanned`] were offered.
    ScanBudget { max_scanned: usize },
    /// [`Budget::expired`] returned true.
    Deadline,
}

impl fmt::Display for Exceeded {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::ScanBudget { max_scanned } => {
                write!(f, "the container holds more than {max_scanned} items")
            }
            Self::Deadline => f.write_str("its time ran out"),
        }
    }
}

/// A dotted path to a member of an item, e.g. `meta.author.name`.
///
/// Segments match `[A-Za-z0-9_@$-]{1,64}` and do not start with `$` (which
/// marks operators); there are at most [`MAX_PATH_SEGMENTS`] of them.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct FieldPath {
    segments: Vec<String>,
}

impl FieldPath {
    /// Parses a dotted path.
    pub fn parse(s: &str) -> Result<Self, QueryError> {
        Self::parse_at(s, "field path")
    }

    fn parse_at(s: &str, at: &str) -> Result<Self, QueryError> {
        let bad = |reason| QueryError::BadPath {
            at: at.to_owned(),
            path: shorten(s),
            reason,
        };
        if s.is_empty() {
            return Err(bad("it is empty"));
        }
        let mut segments = Vec::new();
        for segment in s.split('.') {
            if segments.len() == MAX_PATH_SEGMENTS {
                return Err(bad("it has too many segments"));
            }
            if segment.is_empty() {
                return Err(bad("it has an empty segment"));
            }
            if segment.len() > MAX_SEGMENT_LEN {
                return Err(bad("a segment is too long"));
            }
            if segment.starts_with('$') {
                return Err(bad("a segment starts with $"));
            }
            let allowed =
                |b: u8| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'@' | b'$' | b'-');
            if !segment.bytes().all(allowed) {
                return Err(bad("a segment has a character outside the allowed set"));
            }
            segments.push(segment.to_owned());
        }
        Ok(Self { segments })
    }

    /// The segments, outermost first; never empty.
    pub fn segments(&self) -> &[String] {
        &self.segments
    }

    /// Whether this is the item id (`id`), which comes from the caller.
    pub fn is_id(&self) -> bool {
        matches!(self.segments.as_slice(), [only] if only == "id")
    }
}

impl fmt::Display for FieldPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.segments.join("."))
    }
}

/// A parsed `where` clause.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum Filter {
    /// All must hold; an empty list always holds.
    And(Vec<Filter>),
    /// At least one must hold; an empty list never holds.
    Or(Vec<Filter>),
    /// One operator applied to one field.
    Field { path: FieldPath, op: Op },
}

/// A field operator of ASM-QL.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum Op {
    Eq(Value),
    Ne(Value),
    /// Operand is a number or a string.
    Gt(Value),
    Gte(Value),
    Lt(Value),
    Lte(Value),
    /// At most [`MAX_IN_VALUES`] values.
    In(Vec<Value>),
    Contains(Value),
    Exists(bool),
}

impl Op {
    /// The operator's name as written in a query, e.g. `$gte`.
    pub fn name(&self) -> &'static str {
        match self {
            Self::Eq(_) => "$eq",
            Self::Ne(_) => "$ne",
            Self::Gt(_) => "$gt",
            Self::Gte(_) => "$gte",
            Self::Lt(_) => "$lt",
            Self::Lte(_) => "$lte",
            Self::In(_) => "$in",
            Self::Contains(_) => "$contains",
            Self::Exists(_) => "$exists",
        }
    }

    fn operand_json(&self) -> Value {
        match self {
            Self::Eq(v)
            | Self::Ne(v)
            | Self::Gt(v)
            | Self::Gte(v)
            | Self::Lt(v)
            | Self::Lte(v)
            | Self::Contains(v) => v.clone(),
            Self::In(vs) => Value::Array(vs.clone()),
            Self::Exists(b) => Value::Bool(*b),
        }
    }
}

impl Filter {
    /// The filter as an ASM-QL `where` object that [`parse`] reads back to
    /// the same filter (an empty `And` becomes `{}`).
    pub fn to_json(&self) -> Value {
        match self {
            Self::And(fs) if fs.is_empty() => Value::Object(Map::new()),
            Self::And(fs) => single("$and", Value::Array(fs.iter().map(Self::to_json).collect())),
            Self::Or(fs) => single("$or", Value::Array(fs.iter().map(Self::to_json).collect())),
            Self::Field { path, op } => {
                single(&path.to_string(), single(op.name(), op.operand_json()))
            }
        }
    }
}

fn single(key: &str, value: Value) -> Value {
    let mut m = Map::new();
    m.insert(key.to_owned(), value);
    Value::Object(m)
}

/// Sort direction of one `order` key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Direction {
    #[default]
    Asc,
    Desc,
}

impl Direction {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Asc => "asc",
            Self::Desc => "desc",
        }
    }
}

/// One `order` key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OrderBy {
    pub field: FieldPath,
    pub direction: Direction,
}

/// A parsed ASM-QL query.
#[derive(Debug, Clone, PartialEq)]
pub struct Query {
    /// Paths to project; `None` returns whole items. `id` is always added.
    pub select: Option<Vec<FieldPath>>,
    /// The schema URI; the caller maps it to a container.
    pub from: String,
    /// `None` matches every item.
    pub filter: Option<Filter>,
    /// Sort keys, most significant first; the id breaks ties.
    pub order: Vec<OrderBy>,
    /// Page size, 1 to [`MAX_LIMIT`].
    pub limit: usize,
    /// Where the previous page ended, as returned in
    /// [`QueryResult::next_cursor`].
    pub cursor: Option<String>,
}

impl Query {
    /// The query as ASM-QL JSON that [`parse`] reads back to an equal query.
    pub fn to_json(&self) -> Value {
        let mut m = Map::new();
        if let Some(select) = &self.select {
            let paths = select
                .iter()
                .map(|p| Value::String(p.to_string()))
                .collect();
            m.insert("select".to_owned(), Value::Array(paths));
        }
        m.insert("from".to_owned(), Value::String(self.from.clone()));
        if let Some(filter) = &self.filter {
            m.insert("where".to_owned(), filter.to_json());
        }
        if !self.order.is_empty() {
            let keys = self
                .order
                .iter()
                .map(|o| {
                    let mut k = Map::new();
                    k.insert("field".to_owned(), Value::String(o.field.to_string()));
                    k.insert(
                        "direction".to_owned(),
                        Value::String(o.direction.as_str().to_owned()),
                    );
                    Value::Object(k)
                })
                .collect();
            m.insert("order".to_owned(), Value::Array(keys));
        }
        m.insert(
            "limit".to_owned(),
            Value::Number(Number::from(self.limit as u64)),
        );
        if let Some(cursor) = &self.cursor {
            m.insert("cursor".to_owned(), Value::String(cursor.clone()));
        }
        Value::Object(m)
    }
}

/// Parses an ASM-QL query.
///
/// Optional keys given as `null` count as absent, so a client may pass a
/// `next_cursor` of `null` straight back. The cursor is only checked for
/// type and length here; [`execute`] decodes it against the query.
pub fn parse(q: &Value) -> Result<Query, QueryError> {
    let obj = q
        .as_object()
        .ok_or_else(|| wrong_type("query", "an object", q))?;
    let mut select = None;
    let mut from = None;
    let mut filter = None;
    let mut order = Vec::new();
    let mut limit = DEFAULT_LIMIT;
    let mut cursor = None;
    for (key, value) in obj {
        let known = matches!(
            key.as_str(),
            "select" | "from" | "where" | "order" | "limit" | "cursor"
        );
        if !known {
            return Err(QueryError::UnknownKey {
                at: "query".to_owned(),
                key: shorten(key),
                expected: QUERY_KEYS,
            });
        }
        if value.is_null() && key != "from" {
            continue;
        }
        match key.as_str() {
            "select" => select = Some(parse_select(value)?),
            "from" => from = Some(parse_from(value)?),
            "where" => filter = parse_where(value)?,
            "order" => order = parse_order(value)?,
            "limit" => limit = parse_limit(value)?,
            _ => cursor = Some(parse_cursor_text(value)?),
        }
    }
    let from = from.ok_or(QueryError::MissingKey {
        at: "query".to_owned(),
        key: "from",
        hint: "give the schema URI of the container to query, e.g. did:nuwa:state:note#v1",
    })?;
    Ok(Query {
        select,
        from,
        filter,
        order,
        limit,
        cursor,
    })
}

fn parse_select(v: &Value) -> Result<Vec<FieldPath>, QueryError> {
    let arr = v
        .as_array()
        .ok_or_else(|| wrong_type("select", "an array of field paths", v))?;
    if arr.len() > MAX_SELECT_FIELDS {
        return Err(invalid(
            "select",
            format!("more than {MAX_SELECT_FIELDS} fields; select fewer"),
        ));
    }
    arr.iter()
        .enumerate()
        .map(|(i, p)| {
            let at = format!("select[{i}]");
            let s = p
                .as_str()
                .ok_or_else(|| wrong_type(&at, "a field path string", p))?;
            FieldPath::parse_at(s, &at)
        })
        .collect()
}

fn parse_from(v: &Value) -> Result<String, QueryError> {
    let s = v
        .as_str()
        .ok_or_else(|| wrong_type("from", "a schema URI string", v))?;
    if s.is_empty() {
        return Err(invalid(
            "from",
            "is empty; give the schema URI of the container to query".to_owned(),
        ));
    }
    if s.len() > MAX_FROM_LEN {
        return Err(invalid(
            "from",
            format!("is longer than {MAX_FROM_LEN} bytes"),
        ));
    }
    Ok(s.to_owned())
}

fn parse_order(v: &Value) -> Result<Vec<OrderBy>, QueryError> {
    let arr = v
        .as_array()
        .ok_or_else(|| wrong_type("order", "an array of {field, direction} objects", v))?;
    if arr.len() > MAX_ORDER_KEYS {
        return Err(invalid(
            "order",
            format!("more than {MAX_ORDER_KEYS} sort keys"),
        ));
    }
    let mut keys = Vec::with_capacity(arr.len());
    for (i, key) in arr.iter().enumerate() {
        let at = format!("order[{i}]");
        let obj = key
            .as_object()
            .ok_or_else(|| wrong_type(&at, "an object {field, direction}", key))?;
        let mut field = None;
        let mut direction = Direction::Asc;
        for (k, v) in obj {
            match k.as_str() {
                "field" => {
                    let at = format!("{at}.field");
                    let s = v
                        .as_str()
                        .ok_or_else(|| wrong_type(&at, "a field path string", v))?;
                    field = Some(FieldPath::parse_at(s, &at)?);
                }
                "direction" => {
                    direction = match v.as_str() {
                        Some("asc") => Direction::Asc,
                        Some("desc") => Direction::Desc,
                        _ => {
                            return Err(invalid(
                                &format!("{at}.direction"),
                                format!(
                                    "{} is not a direction; use \"asc\" or \"desc\"",
                                    shorten(&v.to_string())
                                ),
                            ));
                        }
                    }
                }
                _ => {
                    return Err(QueryError::UnknownKey {
                        at,
                        key: shorten(k),
                        expected: ORDER_KEYS,
                    });
                }
            }
        }
        let field = field.ok_or(QueryError::MissingKey {
            at,
            key: "field",
            hint: "name the field path to sort by",
        })?;
        keys.push(OrderBy { field, direction });
    }
    Ok(keys)
}

fn parse_limit(v: &Value) -> Result<usize, QueryError> {
    let bad = || QueryError::BadLimit {
        got: shorten(&v.to_string()),
    };
    let n = v.as_u64().ok_or_else(bad)?;
    match usize::try_from(n) {
        Ok(n) if (1..=MAX_LIMIT).contains(&n) => Ok(n),
        _ => Err(bad()),
    }
}

fn parse_cursor_text(v: &Value) -> Result<String, QueryError> {
    let s = v
        .as_str()
        .ok_or_else(|| wrong_type("cursor", "a string", v))?;
    if s.len() > MAX_CURSOR_LEN {
        return Err(bad_cursor(
            "it is longer than any cursor this runtime hands out",
        ));
    }
    Ok(s.to_owned())
}

fn parse_where(v: &Value) -> Result<Option<Filter>, QueryError> {
    let mut parser = WhereParser { nodes: 0 };
    match parser.object(v, "where", 1)? {
        Filter::And(fs) if fs.is_empty() => Ok(None),
        f => Ok(Some(f)),
    }
}

/// Walks a `where` tree, counting nodes and depth as it goes so that a
/// hostile query is refused before it costs more than the caps allow.
struct WhereParser {
    nodes: usize,
}

impl WhereParser {
    fn bump(&mut self) -> Result<(), QueryError> {
        self.nodes += 1;
        if self.nodes > MAX_WHERE_NODES {
            return Err(QueryError::TooManyNodes);
        }
        Ok(())
    }

    fn object(&mut self, v: &Value, at: &str, depth: usize) -> Result<Filter, QueryError> {
        if depth > MAX_WHERE_DEPTH {
            return Err(QueryError::TooDeep { at: at.to_owned() });
        }
        self.bump()?;
        let obj = v
            .as_object()
            .ok_or_else(|| wrong_type(at, "an object of conditions", v))?;
        let mut parts = Vec::new();
        for (key, cond) in obj {
            self.bump()?;
            match key.as_str() {
                "$and" | "$or" => {
                    let at = format!("{at}.{key}");
                    let arr = cond.as_array().ok_or_else(|| {
                        wrong_type(&at, "a non-empty array of where objects", cond)
                    })?;
                    if arr.is_empty() {
                        return Err(invalid(
                            &at,
                            "is empty; give at least one where object".to_owned(),
                        ));
                    }
                    let mut subs = Vec::new();
                    for (i, sub) in arr.iter().enumerate() {
                        subs.push(self.object(sub, &format!("{at}[{i}]"), depth + 1)?);
                    }
                    parts.push(if key == "$and" {
                        Filter::And(subs)
                    } else {
                        Filter::Or(subs)
                    });
                }
                op if op.starts_with('$') => {
                    return Err(QueryError::UnknownOperator {
                        at: at.to_owned(),
                        op: shorten(op),
                        expected: WHERE_OPERATORS,
                    });
                }
                field => {
                    let path = FieldPath::parse_at(field, at)?;
                    let at = format!("{at}.{path}");
                    self.condition(&path, cond, &at, &mut parts)?;
                }
            }
        }
        Ok(match parts.len() {
            1 => parts.pop().unwrap_or(Filter::And(Vec::new())),
            _ => Filter::And(parts),
        })
    }

    fn condition(
        &mut self,
        path: &FieldPath,
        cond: &Value,
        at: &str,
        parts: &mut Vec<Filter>,
    ) -> Result<(), QueryError> {
        let ops = match cond {
            Value::Object(m) if m.keys().any(|k| k.starts_with('$')) => m,
            literal => {
                self.bump()?;
                check_operand_depth(literal, at)?;
                parts.push(Filter::Field {
                    path: path.clone(),
                    op: Op::Eq(literal.clone()),
                });
                return Ok(());
            }
        };
        for (name, arg) in ops {
            self.bump()?;
            let at_op = format!("{at}.{name}");
            let op = match name.as_str() {
                "$eq" => Op::Eq(operand(arg, &at_op)?),
                "$ne" => Op::Ne(operand(arg, &at_op)?),
                "$gt" => Op::Gt(ordered_operand(arg, &at_op)?),
                "$gte" => Op::Gte(ordered_operand(arg, &at_op)?),
                "$lt" => Op::Lt(ordered_operand(arg, &at_op)?),
                "$lte" => Op::Lte(ordered_operand(arg, &at_op)?),
                "$contains" => Op::Contains(operand(arg, &at_op)?),
                "$in" => {
                    let values = arg
                        .as_array()
                        .ok_or_else(|| wrong_type(&at_op, "an array of values", arg))?;
                    if values.len() > MAX_IN_VALUES {
                        return Err(invalid(
                            &at_op,
                            format!("has more than {MAX_IN_VALUES} values"),
                        ));
                    }
                    for v in values {
                        check_operand_depth(v, &at_op)?;
                    }
                    Op::In(values.clone())
                }
                "$exists" => Op::Exists(
                    arg.as_bool()
                        .ok_or_else(|| wrong_type(&at_op, "true or false", arg))?,
                ),
                other if other.starts_with('$') => {
                    return Err(QueryError::UnknownOperator {
                        at: at.to_owned(),
                        op: shorten(other),
                        expected: FIELD_OPERATORS,
                    });
                }
                plain => {
                    return Err(invalid(
                        at,
                        format!(
                            "mixes operators with the plain key {:?}; to match a literal object, put it under $eq",
                            shorten(plain)
                        ),
                    ));
                }
            };
            parts.push(Filter::Field {
                path: path.clone(),
                op,
            });
        }
        Ok(())
    }
}

fn operand(v: &Value, at: &str) -> Result<Value, QueryError> {
    check_operand_depth(v, at)?;
    Ok(v.clone())
}

fn ordered_operand(v: &Value, at: &str) -> Result<Value, QueryError> {
    match v {
        Value::Number(_) | Value::String(_) => Ok(v.clone()),
        other => Err(wrong_type(at, "a number or a string", other)),
    }
}

fn check_operand_depth(v: &Value, at: &str) -> Result<(), QueryError> {
    if depth_within(v, MAX_VALUE_DEPTH) {
        Ok(())
    } else {
        Err(invalid(
            at,
            format!("the value nests deeper than {MAX_VALUE_DEPTH} levels"),
        ))
    }
}

/// Whether `v` has at most `levels` nested arrays/objects; stops descending
/// once the answer is known, so its own recursion is bounded.
fn depth_within(v: &Value, levels: usize) -> bool {
    match v {
        Value::Array(a) => levels > 0 && a.iter().all(|e| depth_within(e, levels - 1)),
        Value::Object(m) => levels > 0 && m.values().all(|e| depth_within(e, levels - 1)),
        _ => true,
    }
}

/// Limits on one [`execute`] call; the caller decides what a scan may cost
/// and owns the clock.
pub struct Budget<'a> {
    /// Offering more items than this stops the query.
    pub max_scanned: usize,
    /// Polled before the first item and every [`EXPIRY_POLL_INTERVAL`]
    /// items; returning true stops the query.
    pub expired: &'a dyn Fn() -> bool,
}

fn never_expires() -> bool {
    false
}

impl Budget<'static> {
    /// A budget that only caps the number of items scanned.
    pub fn scan_only(max_scanned: usize) -> Self {
        Self {
            max_scanned,
            expired: &never_expires,
        }
    }
}

impl fmt::Debug for Budget<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Budget")
            .field("max_scanned", &self.max_scanned)
            .finish_non_exhaustive()
    }
}

/// One page of results.
#[derive(Debug, Clone, PartialEq)]
pub struct QueryResult {
    /// Projected items in order, each with its `id`.
    pub items: Vec<Value>,
    /// Present when more items match; pass it back as `cursor` for the next
    /// page of the same `from`, `where` and `order`.
    pub next_cursor: Option<String>,
    /// How many items were examined.
    pub scanned: usize,
}

/// Runs `q` over a container's items, given as `(id, item)` with distinct
/// ids, and returns one page.
///
/// Every item is scanned (there is no index), but only `limit + 1`
/// candidates are kept at a time, so memory follows the page size, not the
/// container size.
pub fn execute<'a>(
    q: &Query,
    items: impl IntoIterator<Item = (&'a str, &'a Value)>,
    budget: &Budget<'_>,
) -> Result<QueryResult, QueryError> {
    if !(1..=MAX_LIMIT).contains(&q.limit) {
        return Err(QueryError::BadLimit {
            got: q.limit.to_string(),
        });
    }
    if let Some(filter) = &q.filter {
        let mut nodes = 0;
        check_filter(filter, 1, &mut nodes)?;
    }
    let binding = cursor_binding(q);
    let after = match &q.cursor {
        Some(text) => Some(decode_cursor(text, &binding, q.order.len())?),
        None => None,
    };

    let keep = q.limit + 1;
    let mut rows: Vec<Row<'a>> = Vec::new();
    let mut scanned = 0;
    for (id, item) in items {
        if scanned % EXPIRY_POLL_INTERVAL == 0 && (budget.expired)() {
            return Err(QueryError::TooExpensive {
                exceeded: Exceeded::Deadline,
                scanned,
            });
        }
        if scanned >= budget.max_scanned {
            return Err(QueryError::TooExpensive {
                exceeded: Exceeded::ScanBudget {
                    max_scanned: budget.max_scanned,
                },
                scanned,
            });
        }
        scanned += 1;
        if let Some(filter) = &q.filter {
            if !filter_matches(filter, id, item) {
                continue;
            }
        }
        let keys: Vec<_> = q
            .order
            .iter()
            .map(|o| resolve(&o.field, id, item))
            .collect();
        if let Some(pos) = &after {
            if cmp_keys(&q.order, &keys, id, &pos.keys, &pos.id) != Ordering::Greater {
                continue;
            }
        }
        rows.push(Row { id, item, keys });
        // Prune to the best `keep` once the buffer doubles: amortised
        // linear time, and memory bounded by the page size.
        if rows.len() >= 2 * keep {
            keep_smallest(&mut rows, keep, &q.order);
        }
    }
    keep_smallest(&mut rows, keep, &q.order);
    rows.sort_by(|a, b| cmp_rows(&q.order, a, b));

    let has_more = rows.len() > q.limit;
    rows.truncate(q.limit);
    let next_cursor = match rows.last() {
        Some(last) if has_more => Some(encode_cursor(&binding, last)?),
        _ => None,
    };
    let items = rows
        .iter()
        .map(|r| project(q.select.as_deref(), r.id, r.item))
        .collect();
    Ok(QueryResult {
        items,
        next_cursor,
        scanned,
    })
}

/// Holds a hand-built filter to the caps a parsed one meets.
fn check_filter(f: &Filter, depth: usize, nodes: &mut usize) -> Result<(), QueryError> {
    *nodes += 1;
    if *nodes > MAX_WHERE_NODES {
        return Err(QueryError::TooManyNodes);
    }
    if depth > FILTER_TREE_DEPTH_MAX {
        return Err(QueryError::TooDeep {
            at: "where".to_owned(),
        });
    }
    match f {
        Filter::And(fs) | Filter::Or(fs) => fs
            .iter()
            .try_for_each(|f| check_filter(f, depth + 1, nodes)),
        Filter::Field { op: Op::In(vs), .. } => {
            if vs.len() > MAX_IN_VALUES {
                return Err(invalid(
                    "where",
                    format!("an $in list has more than {MAX_IN_VALUES} values"),
                ));
            }
            vs.iter().try_for_each(|v| check_operand_depth(v, "where"))
        }
        Filter::Field {
            op:
                Op::Eq(v)
                | Op::Ne(v)
                | Op::Gt(v)
                | Op::Gte(v)
                | Op::Lt(v)
                | Op::Lte(v)
                | Op::Contains(v),
            ..
        } => check_operand_depth(v, "where"),
        Filter::Field {
            op: Op::Exists(_), ..
        } => Ok(()),
    }
}

struct Row<'a> {
    id: &'a str,
    item: &'a Value,
    keys: Vec<Option<Cow<'a, Value>>>,
}

fn keep_smallest(rows: &mut Vec<Row<'_>>, keep: usize, order: &[OrderBy]) {
    if rows.len() > keep {
        // `keep >= 1`, and `keep < len` here, so the index is in bounds.
        rows.select_nth_unstable_by(keep - 1, |a, b| cmp_rows(order, a, b));
        rows.truncate(keep);
    }
}

fn cmp_rows(order: &[OrderBy], a: &Row<'_>, b: &Row<'_>) -> Ordering {
    cmp_keys(order, &a.keys, a.id, &b.keys, b.id)
}

/// The page order: each key in turn (missing last whatever the direction),
/// then the id ascending. It is a total order, which `sort_by` needs.
fn cmp_keys(
    order: &[OrderBy],
    a_keys: &[Option<Cow<'_, Value>>],
    a_id: &str,
    b_keys: &[Option<Cow<'_, Value>>],
    b_id: &str,
) -> Ordering {
    for (o, (x, y)) in order.iter().zip(a_keys.iter().zip(b_keys)) {
        let ord = match (x, y) {
            (None, None) => Ordering::Equal,
            (None, Some(_)) => Ordering::Greater,
            (Some(_), None) => Ordering::Less,
            (Some(x), Some(y)) => {
                let ord = total_cmp(x, y, 0);
                match o.direction {
                    Direction::Asc => ord,
                    Direction::Desc => ord.reverse(),
                }
            }
        };
        if ord != Ordering::Equal {
            return ord;
        }
    }
    a_id.cmp(b_id)
}

/// The value at `path`, if present. `id` is the caller's id; any longer
/// path starting at `id` is missing, since that id is a string.
fn resolve<'v>(path: &FieldPath, id: &'v str, item: &'v Value) -> Option<Cow<'v, Value>> {
    let segments = path.segments();
    if segments.first().is_some_and(|s| s == "id") {
        return (segments.len() == 1).then(|| Cow::Owned(Value::String(id.to_owned())));
    }
    let mut cur = item;
    for seg in segments {
        cur = cur.as_object()?.get(seg)?;
    }
    Some(Cow::Borrowed(cur))
}

fn filter_matches(f: &Filter, id: &str, item: &Value) -> bool {
    match f {
        Filter::And(fs) => fs.iter().all(|f| filter_matches(f, id, item)),
        Filter::Or(fs) => fs.iter().any(|f| filter_matches(f, id, item)),
        Filter::Field { path, op } => op_matches(op, resolve(path, id, item).as_deref()),
    }
}

fn op_matches(op: &Op, v: Option<&Value>) -> bool {
    let Some(v) = v else {
        return matches!(op, Op::Ne(_) | Op::Exists(false));
    };
    match op {
        Op::Exists(want) => *want,
        Op::Eq(x) => json_eq(v, x, 0),
        Op::Ne(x) => !json_eq(v, x, 0),
        Op::Gt(x) => ordered_cmp(v, x) == Some(Ordering::Greater),
        Op::Gte(x) => matches!(ordered_cmp(v, x), Some(Ordering::Greater | Ordering::Equal)),
        Op::Lt(x) => ordered_cmp(v, x) == Some(Ordering::Less),
        Op::Lte(x) => matches!(ordered_cmp(v, x), Some(Ordering::Less | Ordering::Equal)),
        Op::In(xs) => {
            let hit = |e: &Value| xs.iter().any(|x| json_eq(e, x, 0));
            hit(v) || v.as_array().is_some_and(|a| a.iter().any(hit))
        }
        Op::Contains(x) => match v {
            Value::Array(a) => a.iter().any(|e| json_eq(e, x, 0)),
            Value::String(s) => x.as_str().is_some_and(|needle| s.contains(needle)),
            _ => false,
        },
    }
}

/// Range comparison: number with number, string with string, else none.
fn ordered_cmp(a: &Value, b: &Value) -> Option<Ordering> {
    match (a, b) {
        (Value::Number(a), Value::Number(b)) => Some(num_cmp(a, b)),
        (Value::String(a), Value::String(b)) => Some(a.cmp(b)),
        _ => None,
    }
}

/// JSON equality with numbers compared by value. Recursion only descends
/// where both sides nest, and stops (unequal) past [`CMP_DEPTH_MAX`].
fn json_eq(a: &Value, b: &Value, depth: usize) -> bool {
    match (a, b) {
        (Value::Number(a), Value::Number(b)) => num_cmp(a, b) == Ordering::Equal,
        (Value::Array(a), Value::Array(b)) => {
            depth < CMP_DEPTH_MAX
                && a.len() == b.len()
                && a.iter().zip(b).all(|(x, y)| json_eq(x, y, depth + 1))
        }
        (Value::Object(a), Value::Object(b)) => {
            depth < CMP_DEPTH_MAX
                && a.len() == b.len()
                && a.iter()
                    .all(|(k, x)| b.get(k).is_some_and(|y| json_eq(x, y, depth + 1)))
        }
        (a, b) => a == b,
    }
}

fn type_rank(v: &Value) -> u8 {
    match v {
        Value::Null => 0,
        Value::Bool(_) => 1,
        Value::Number(_) => 2,
        Value::String(_) => 3,
        Value::Array(_) => 4,
        Value::Object(_) => 5,
    }
}

/// A total order on JSON values for sorting: by type rank, then by value;
/// arrays element-wise, objects by their entries in key order.
fn total_cmp(a: &Value, b: &Value, depth: usize) -> Ordering {
    match (a, b) {
        (Value::Null, Value::Null) => Ordering::Equal,
        (Value::Bool(a), Value::Bool(b)) => a.cmp(b),
        (Value::Number(a), Value::Number(b)) => num_cmp(a, b),
        (Value::String(a), Value::String(b)) => a.cmp(b),
        (Value::Array(a), Value::Array(b)) => {
            if depth >= CMP_DEPTH_MAX {
                return Ordering::Equal;
            }
            for (x, y) in a.iter().zip(b) {
                let ord = total_cmp(x, y, depth + 1);
                if ord != Ordering::Equal {
                    return ord;
                }
            }
            a.len().cmp(&b.len())
        }
        (Value::Object(a), Value::Object(b)) => {
            if depth >= CMP_DEPTH_MAX {
                return Ordering::Equal;
            }
            // Sort the entries here: map iteration order depends on
            // serde_json's `preserve_order` feature, which another crate may
            // switch on.
            let mut ea: Vec<_> = a.iter().collect();
            let mut eb: Vec<_> = b.iter().collect();
            ea.sort_by(|x, y| x.0.cmp(y.0));
            eb.sort_by(|x, y| x.0.cmp(y.0));
            for ((ka, va), (kb, vb)) in ea.iter().zip(&eb) {
                let ord = ka.cmp(kb).then_with(|| total_cmp(va, vb, depth + 1));
                if ord != Ordering::Equal {
                    return ord;
                }
            }
            ea.len().cmp(&eb.len())
        }
        (a, b) => type_rank(a).cmp(&type_rank(b)),
    }
}

/// A JSON number as an exact integer where it is one, else a float.
enum Num {
    Int(i128),
    Float(f64),
}

fn num_of(n: &Number) -> Num {
    if let Some(i) = n.as_i64() {
        Num::Int(i128::from(i))
    } else if let Some(u) = n.as_u64() {
        Num::Int(i128::from(u))
    } else {
        // `as_f64` only fails for out-of-range arbitrary-precision numbers;
        // they sit beyond every finite value, on their sign's side.
        Num::Float(n.as_f64().unwrap_or_else(|| {
            if n.to_string().starts_with('-') {
                f64::NEG_INFINITY
            } else {
                f64::INFINITY
            }
        }))
    }
}

/// Exact numeric comparison across integer and float representations, so
/// that the order is transitive (converting everything to f64 would not be
/// above 2^53) and `sort_by` gets the total order it requires.
fn num_cmp(a: &Number, b: &Number) -> Ordering {
    match (num_of(a), num_of(b)) {
        (Num::Int(x), Num::Int(y)) => x.cmp(&y),
        // Neither side can be NaN, so `partial_cmp` always answers; -0.0 and
        // 0.0 compare equal, as they do against the integer 0.
        (Num::Float(x), Num::Float(y)) => x.partial_cmp(&y).unwrap_or(Ordering::Equal),
        (Num::Int(x), Num::Float(y)) => int_float_cmp(x, y),
        (Num::Float(x), Num::Int(y)) => int_float_cmp(y, x).reverse(),
    }
}

fn int_float_cmp(i: i128, f: f64) -> Ordering {
    // 2^127 is exactly representable; beyond it every i128 is on one side.
    const TWO_POW_127: f64 = 170_141_183_460_469_231_731_687_303_715_884_105_728.0;
    if f.is_nan() {
        return Ordering::Equal;
    }
    if f >= TWO_POW_127 {
        return Ordering::Less;
    }
    if f < -TWO_POW_127 {
        return Ordering::Greater;
    }
    let whole = f.trunc();
    // `whole` is an integer within the i128 range, so the cast is exact.
    let whole_int = whole as i128;
    match i.cmp(&whole_int) {
        Ordering::Equal if f > whole => Ordering::Less,
        Ordering::Equal if f < whole => Ordering::Greater,
        ord => ord,
    }
}

/// The output object for one item: the selected paths, nested as in the
/// item, plus `id`; or the whole item plus `id`. An item that is not an
/// object (a map container's scalar value) comes back as `{id, value}`.
fn project(select: Option<&[FieldPath]>, id: &str, item: &Value) -> Value {
    let mut out = match select {
        None => match item {
            Value::Object(m) => m.clone(),
            other => {
                let mut m = Map::new();
                m.insert("value".to_owned(), other.clone());
                m
            }
        },
        Some(paths) => {
            let mut m = Map::new();
            for path in paths {
                if let Some(v) = resolve(path, id, item) {
                    insert_path(&mut m, path.segments(), v.into_owned());
                }
            }
            m
        }
    };
    out.insert("id".to_owned(), Value::String(id.to_owned()));
    Value::Object(out)
}

fn insert_path(out: &mut Map<String, Value>, segments: &[String], value: Value) {
    let Some((last, parents)) = segments.split_last() else {
        return;
    };
    let mut cur = out;
    for seg in parents {
        let slot = cur
            .entry(seg.clone())
            .or_insert_with(|| Value::Object(Map::new()));
        if !slot.is_object() {
            *slot = Value::Object(Map::new());
        }
        cur = match slot {
            Value::Object(m) => m,
            // Made an object just above.
            _ => return,
        };
    }
    cur.insert(last.clone(), value);
}

/// The query's half of the cursor digest: `from`, `where` and `order`.
/// `select` and `limit` are left out on purpose, as they do not move the
/// position in the sequence.
fn cursor_binding(q: &Query) -> Sha256 {
    let mut h = Sha256::new();
    h.update(CURSOR_DOMAIN);
    feed_bytes(&mut h, q.from.as_bytes());
    match &q.filter {
        None => h.update([0]),
        Some(f) => {
            h.update([1]);
            feed_value(&mut h, &f.to_json());
        }
    }
    feed_len(&mut h, q.order.len());
    for o in &q.order {
        feed_bytes(&mut h, o.field.to_string().as_bytes());
        h.update([match o.direction {
            Direction::Asc => 0,
            Direction::Desc => 1,
        }]);
    }
    h
}

fn feed_len(h: &mut Sha256, len: usize) {
    h.update((len as u64).to_le_bytes());
}

fn feed_bytes(h: &mut Sha256, bytes: &[u8]) {
    feed_len(h, bytes.len());
    h.update(bytes);
}

/// An unambiguous encoding of a value into the digest, with object keys
/// sorted. Only fed filter JSON, whose depth `check_filter` has bounded.
fn feed_value(h: &mut Sha256, v: &Value) {
    match v {
        Value::Null => h.update([0]),
        Value::Bool(false) => h.update([1]),
        Value::Bool(true) => h.update([2]),
        Value::Number(n) => {
            h.update([3]);
            feed_bytes(h, n.to_string().as_bytes());
        }
        Value::String(s) => {
            h.update([4]);
            feed_bytes(h, s.as_bytes());
        }
        Value::Array(a) => {
            h.update([5]);
            feed_len(h, a.len());
            for e in a {
                feed_value(h, e);
            }
        }
        Value::Object(m) => {
            h.update([6]);
            feed_len(h, m.len());
            let mut entries: Vec<_> = m.iter().collect();
            entries.sort_by(|x, y| x.0.cmp(y.0));
            for (k, e) in entries {
                feed_bytes(h, k.as_bytes());
                feed_value(h, e);
            }
        }
    }
}

/// The position half of a cursor: each sort value (`[]` when missing,
/// `[v]` when present) and the id of the last item returned.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct PositionWire {
    k: Vec<Vec<Value>>,
    id: String,
}

struct Position {
    keys: Vec<Option<Cow<'static, Value>>>,
    id: String,
}

fn position_digest(binding: &Sha256, position_json: &[u8]) -> [u8; DIGEST_LEN] {
    let mut h = binding.clone();
    feed_bytes(&mut h, position_json);
    h.finalize().into()
}

/// Cursor bytes: SHA-256(binding, position) then the position JSON. The
/// digest covers the position too, so an altered cursor is refused.
fn encode_cursor(binding: &Sha256, last: &Row<'_>) -> Result<String, QueryError> {
    let keys: Vec<Value> = last
        .keys
        .iter()
        .map(|k| Value::Array(k.iter().map(|v| v.as_ref().clone()).collect()))
        .collect();
    let mut position = Map::new();
    position.insert("k".to_owned(), Value::Array(keys));
    position.insert("id".to_owned(), Value::String(last.id.to_owned()));
    let position_json = Value::Object(position).to_string().into_bytes();
    let mut bytes = position_digest(binding, &position_json).to_vec();
    bytes.extend_from_slice(&position_json);
    let text = URL_SAFE_NO_PAD.encode(&bytes);
    if text.len() > MAX_CURSOR_LEN {
        return Err(QueryError::CursorTooLong {
            id: shorten(last.id),
            len_bytes: text.len(),
        });
    }
    Ok(text)
}

fn decode_cursor(text: &str, binding: &Sha256, order_len: usize) -> Result<Position, QueryError> {
    if text.len() > MAX_CURSOR_LEN {
        return Err(bad_cursor(
            "it is longer than any cursor this runtime hands out",
        ));
    }
    let bytes = URL_SAFE_NO_PAD
        .decode(text)
        .map_err(|e| QueryError::BadCursor {
            reason: "it is not base64url text",
            source: Some(Box::new(e)),
        })?;
    let Some((digest, position_json)) = bytes.split_at_checked(DIGEST_LEN) else {
        return Err(bad_cursor("it is too short"));
    };
    if digest != position_digest(binding, position_json) {
        return Err(bad_cursor(
            "it belongs to a query with another from, where or order, or it was altered",
        ));
    }
    let wire: PositionWire =
        serde_json::from_slice(position_json).map_err(|e| QueryError::BadCursor {
            reason: "its position does not decode",
            source: Some(Box::new(e)),
        })?;
    if wire.k.len() != order_len {
        return Err(bad_cursor("its sort values do not match the order keys"));
    }
    let mut keys = Vec::with_capacity(order_len);
    for mut k in wire.k {
        if k.len() > 1 {
            return Err(bad_cursor("its sort values do not match the order keys"));
        }
        keys.push(k.pop().map(Cow::Owned));
    }
    Ok(Position { keys, id: wire.id })
}

fn bad_cursor(reason: &'static str) -> QueryError {
    QueryError::BadCursor {
        reason,
        source: None,
    }
}

fn wrong_type(at: &str, expected: &'static str, got: &Value) -> QueryError {
    QueryError::WrongType {
        at: at.to_owned(),
        expected,
        got: type_name(got),
    }
}

fn invalid(at: &str, problem: String) -> QueryError {
    QueryError::Invalid {
        at: at.to_owned(),
        problem,
    }
}

fn type_name(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// Caps user text echoed in an error message, so a huge key cannot make a
/// huge error.
fn shorten(s: &str) -> String {
    const MAX_CHARS: usize = 80;
    match s.char_indices().nth(MAX_CHARS) {
        Some((cut, _)) => format!("{}…", &s[..cut]),
        None => s.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use std::cell::Cell;

    use serde_json::json;

    use super::*;

    const ROOMY: usize = 1_000_000;

    fn items(pairs: &[(&str, Value)]) -> Vec<(String, Value)> {
        pairs
            .iter()
            .map(|(id, v)| ((*id).to_owned(), v.clone()))
            .collect()
    }

    fn run(q: &Query, items: &[(String, Value)]) -> Result<QueryResult, QueryError> {
        execute(
            q,
            items.iter().map(|(id, v)| (id.as_str(), v)),
            &Budget::scan_only(ROOMY),
        )
    }

    fn run_json(q: &Value, items: &[(String, Value)]) -> Result<QueryResult, QueryError> {
        run(&parse(q)?, items)
    }

    fn ids(r: &QueryResult) -> Vec<&str> {
        r.items
            .iter()
            .map(|i| i["id"].as_str().unwrap_or("<no id>"))
            .collect()
    }

    fn fixture() -> Vec<(String, Value)> {
        items(&[
            (
                "a",
                json!({"n": 1, "s": "apple", "tags": ["x", "meeting"], "meta": {"k": 1}, "flag": true,
                       "when": "2024-01-02T00:00:00Z", "nul": null}),
            ),
            (
                "b",
                json!({"n": 2.0, "s": "banana", "tags": ["y"], "meta": {"k": 2}, "flag": false,
                       "when": "2024-01-10T00:00:00Z"}),
            ),
            (
                "c",
                json!({"n": "3", "s": "cherry", "tags": [], "meta": {"k": [1, 2]}, "when": "2023-12-31T23:59:59Z"}),
            ),
            (
                "d",
                json!({"n": 1.5, "s": ["apple"], "meta": {"k": {"z": 1}}}),
            ),
            ("e", json!({})),
            (
                "f",
                json!({"id": "zzz", "n": -1, "s": "apple pie", "tags": "meeting notes"}),
            ),
        ])
    }

    #[test]
    fn operators_match_per_nip8_semantics() {
        // Goal: every operator, shorthand, missing field and type mismatch
        // selects exactly the expected ids; method: one table over a fixed
        // fixture, results in id order (no `order` given).
        let cases: &[(Value, &[&str])] = &[
            (json!({}), &["a", "b", "c", "d", "e", "f"]),
            (json!({"n": 1}), &["a"]),
            (json!({"n": {"$eq": 1.0}}), &["a"]),
            (json!({"n": 2}), &["b"]),
            (json!({"n": {"$ne": 1}}), &["b", "c", "d", "e", "f"]),
            (json!({"n": {"$gt": 1}}), &["b", "d"]),
            (json!({"n": {"$gte": 1}}), &["a", "b", "d"]),
            (json!({"n": {"$lt": 1.5}}), &["a", "f"]),
            (json!({"n": {"$lte": 1.5}}), &["a", "d", "f"]),
            (json!({"n": {"$gt": "2"}}), &["c"]),
            (json!({"s": {"$gt": "b"}}), &["b", "c"]),
            (json!({"s": {"$lt": "apple z"}}), &["a", "f"]),
            (
                json!({"when": {"$gte": "2024-01-01T00:00:00Z"}}),
                &["a", "b"],
            ),
            (
                json!({"when": {"$lt": "2024-01-05T00:00:00Z"}}),
                &["a", "c"],
            ),
            (json!({"n": {"$in": [1, "3"]}}), &["a", "c"]),
            (json!({"n": {"$in": [2, -1.0]}}), &["b", "f"]),
            (json!({"tags": {"$in": ["y", "q"]}}), &["b"]),
            (json!({"tags": {"$in": [[]]}}), &["c"]),
            (json!({"n": {"$in": []}}), &[]),
            (json!({"missing": {"$in": [null]}}), &[]),
            (json!({"tags": {"$contains": "meeting"}}), &["a", "f"]),
            (json!({"s": {"$contains": "apple"}}), &["a", "d", "f"]),
            (json!({"meta.k": {"$contains": 2.0}}), &["c"]),
            (json!({"n": {"$contains": 1}}), &[]),
            (json!({"s": {"$contains": 1}}), &[]),
            (json!({"nul": {"$exists": true}}), &["a"]),
            (json!({"nul": null}), &["a"]),
            (
                json!({"nul": {"$exists": false}}),
                &["b", "c", "d", "e", "f"],
            ),
            (json!({"missing": {"$eq": null}}), &[]),
            (
                json!({"missing": {"$ne": null}}),
                &["a", "b", "c", "d", "e", "f"],
            ),
            (json!({"missing": {"$gt": 0}}), &[]),
            (json!({"missing": {"$lte": "z"}}), &[]),
            (json!({"missing": {"$contains": "x"}}), &[]),
            (json!({"flag": false}), &["b"]),
            (json!({"flag": {"$gt": 0}}), &[]),
            (json!({"meta.k": {"z": 1}}), &["d"]),
            (json!({"meta.k": {"$eq": {"z": 1.0}}}), &["d"]),
            (json!({"meta.k": [1, 2.0]}), &["c"]),
            (json!({"meta": {"k": 1}}), &["a"]),
            (json!({"meta.k.z": 1}), &["d"]),
            (json!({"n.x": {"$exists": true}}), &[]),
            (json!({"id": "zzz"}), &[]),
            (json!({"id": "f"}), &["f"]),
            (json!({"id": {"$in": ["a", "c"]}}), &["a", "c"]),
            (json!({"id": {"$gte": "e"}}), &["e", "f"]),
            (
                json!({"id.x": {"$exists": false}}),
                &["a", "b", "c", "d", "e", "f"],
            ),
            (json!({"n": {"$gt": 0, "$lt": 2}}), &["a", "d"]),
            (json!({"n": 1, "s": "banana"}), &[]),
            (json!({"s": "banana", "flag": false}), &["b"]),
        ];
        let data = fixture();
        for (where_, want) in cases {
            let q = json!({"from": "did:nuwa:state:t#v1", "where": where_});
            let got = run_json(&q, &data).unwrap_or_else(|e| panic!("{where_}: {e}"));
            assert_eq!(ids(&got), *want, "where {where_}");
        }
    }

    #[test]
    fn and_or_nest() {
        // Goal: $and/$or combine and nest as boolean algebra; method: table
        // of nested clauses over the fixture.
        let cases: &[(Value, &[&str])] = &[
            (json!({"$or": [{"n": 1}, {"s": "banana"}]}), &["a", "b"]),
            (
                json!({"$and": [{"n": {"$gte": 1}}, {"n": {"$lt": 2}}]}),
                &["a", "d"],
            ),
            (
                json!({"$and": [{"tags": {"$exists": true}}, {"$or": [{"n": {"$lt": 0}}, {"flag": true}]}]}),
                &["a", "f"],
            ),
            (
                json!({"$or": [{"$and": [{"n": {"$gte": 1}}, {"n": {"$lte": 1}}]}, {"id": "e"}]}),
                &["a", "e"],
            ),
            (json!({"$or": [{"missing": 1}]}), &[]),
            (json!({"$and": [{}]}), &["a", "b", "c", "d", "e", "f"]),
            (json!({"$or": [{"n": 1}], "flag": false}), &[]),
            (json!({"$or": [{"n": 1}, {"n": 2}], "flag": false}), &["b"]),
        ];
        let data = fixture();
        for (where_, want) in cases {
            let q = json!({"from": "s", "where": where_});
            let got = run_json(&q, &data).unwrap_or_else(|e| panic!("{where_}: {e}"));
            assert_eq!(ids(&got), *want, "where {where_}");
        }
    }

    #[test]
    fn numbers_compare_exactly() {
        // Goal: integers and floats compare by exact value, also beyond
        // 2^53 where f64 rounding would merge neighbours; method: table of
        // single-item checks.
        let cases: &[(Value, Value, bool)] = &[
            (
                json!(9_007_199_254_740_993_u64),
                json!({"$gt": 9_007_199_254_740_992.0}),
                true,
            ),
            (
                json!(9_007_199_254_740_992_u64),
                json!({"$eq": 9_007_199_254_740_992.0}),
                true,
            ),
            (
                json!(9_007_199_254_740_993_u64),
                json!({"$eq": 9_007_199_254_740_992.0}),
                false,
            ),
            (json!(u64::MAX), json!({"$gt": i64::MAX}), true),
            (json!(-1), json!({"$lt": u64::MAX}), true),
            (json!(0), json!({"$eq": -0.0}), true),
            (json!(1), json!({"$lt": 1.000_000_1}), true),
            (json!(-2), json!({"$lt": -1.5}), true),
            (json!(1e300), json!({"$gt": u64::MAX}), true),
        ];
        for (v, cond, want) in cases {
            let data = items(&[("x", json!({ "v": v }))]);
            let got = run_json(&json!({"from": "s", "where": {"v": cond}}), &data)
                .unwrap_or_else(|e| panic!("{e}"));
            assert_eq!(got.items.len() == 1, *want, "{v} {cond}");
        }
    }

    #[test]
    fn order_is_total_with_missing_last_and_id_ties() {
        // Goal: sorting follows type rank, value, missing-last in both
        // directions and id tie-breaks; method: table of orders over mixed
        // values, some tied, some missing.
        let data = items(&[
            ("a", json!({"v": 2, "g": 1})),
            ("b", json!({"v": 1, "g": 2})),
            ("c", json!({"g": 1})),
            ("d", json!({"v": 1.0, "g": 1})),
            ("e", json!({"v": "x", "g": 2})),
            ("f", json!({"v": null})),
            ("g", json!({"v": true, "g": 2})),
            ("h", json!({"v": [1], "g": 1})),
            ("i", json!({"v": {"a": 1}})),
            ("j", json!({"v": 1.5, "g": 2})),
            ("k", json!({"v": false})),
            ("l", json!({"v": [0, 5]})),
            ("m", json!({"v": "W"})),
        ]);
        let cases: &[(Value, &[&str])] = &[
            (
                json!([]),
                &[
                    "a", "b", "c", "d", "e", "f", "g", "h", "i", "j", "k", "l", "m",
                ],
            ),
            (
                json!([{"field": "v"}]),
                &[
                    "f", "k", "g", "b", "d", "j", "a", "m", "e", "l", "h", "i", "c",
                ],
            ),
            (
                json!([{"field": "v", "direction": "desc"}]),
                &[
                    "i", "h", "l", "e", "m", "a", "j", "b", "d", "g", "k", "f", "c",
                ],
            ),
            (
                json!([{"field": "g", "direction": "asc"}, {"field": "v", "direction": "desc"}]),
                &[
                    "h", "a", "d", "c", "e", "j", "b", "g", "i", "l", "m", "k", "f",
                ],
            ),
            (
                json!([{"field": "g", "direction": "desc"}, {"field": "id", "direction": "desc"}]),
                &[
                    "j", "g", "e", "b", "h", "d", "c", "a", "m", "l", "k", "i", "f",
                ],
            ),
        ];
        for (order, want) in cases {
            let got = run_json(&json!({"from": "s", "order": order}), &data)
                .unwrap_or_else(|e| panic!("{e}"));
            assert_eq!(ids(&got), *want, "order {order}");
        }
    }

    fn paged_fixture() -> Vec<(String, Value)> {
        (0..25)
            .map(|i| {
                let mut item = json!({"kind": if i % 2 == 0 { "even" } else { "odd" }, "n": i});
                // Ties (score repeats every 7) and gaps (every 5th has none)
                // exercise the id tie-break and missing-last rules.
                if i % 5 != 0 {
                    item["score"] = json!(i % 7);
                }
                (format!("item-{i:02}"), item)
            })
            .collect()
    }

    /// Follows cursors to the end, returning each page's ids.
    fn all_pages(q: &Value, data: &[(String, Value)]) -> Vec<Vec<String>> {
        let mut query = parse(q).unwrap_or_else(|e| panic!("{e}"));
        let mut pages = Vec::new();
        loop {
            let page = run(&query, data).unwrap_or_else(|e| panic!("{e}"));
            pages.push(ids(&page).into_iter().map(str::to_owned).collect());
            match page.next_cursor {
                Some(c) => query.cursor = Some(c),
                None => return pages,
            }
            assert!(pages.len() <= data.len(), "pagination does not end");
        }
    }

    #[test]
    fn pagination_resumes_without_gaps_or_duplicates() {
        // Goal: following cursors yields exactly the unpaginated result;
        // method: page 25 items with limit 10 under several where/order
        // combinations and compare with one page of limit 1000.
        let data = paged_fixture();
        let cases: &[(Value, &[usize])] = &[
            (json!({"from": "s", "limit": 10}), &[10, 10, 5]),
            (
                json!({"from": "s", "limit": 10, "order": [{"field": "score", "direction": "desc"}]}),
                &[10, 10, 5],
            ),
            (
                json!({"from": "s", "limit": 10, "order": [{"field": "score"}, {"field": "kind", "direction": "desc"}]}),
                &[10, 10, 5],
            ),
            (
                json!({"from": "s", "limit": 10, "where": {"kind": "even"}, "order": [{"field": "score"}]}),
                &[10, 3],
            ),
            (
                json!({"from": "s", "limit": 5, "where": {"n": {"$lt": 10}}}),
                &[5, 5],
            ),
            (
                json!({"from": "s", "limit": 10, "where": {"n": {"$lt": 0}}}),
                &[0],
            ),
        ];
        for (q, sizes) in cases {
            let pages = all_pages(q, &data);
            let got_sizes: Vec<usize> = pages.iter().map(Vec::len).collect();
            assert_eq!(got_sizes, *sizes, "page sizes of {q}");
            let mut whole = q.clone();
            whole["limit"] = json!(MAX_LIMIT);
            let expected = run_json(&whole, &data).unwrap_or_else(|e| panic!("{e}"));
            assert_eq!(expected.next_cursor, None);
            let concatenated: Vec<String> = pages.concat();
            assert_eq!(concatenated, ids(&expected), "pages of {q}");
        }
    }

    #[test]
    fn cursor_survives_limit_and_select_changes() {
        // Goal: limit and select are not bound into the cursor; method: take
        // page 1 with limit 10, then resume with limit 20 and a select.
        let data = paged_fixture();
        let order = json!([{"field": "score", "direction": "desc"}]);
        let first = run_json(&json!({"from": "s", "limit": 10, "order": order}), &data)
            .unwrap_or_else(|e| panic!("{e}"));
        let cursor = first.next_cursor.clone().unwrap_or_default();
        let rest = run_json(
            &json!({"from": "s", "limit": 20, "order": order, "select": ["n"], "cursor": cursor}),
            &data,
        )
        .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(rest.items.len(), 15);
        assert_eq!(rest.next_cursor, None);
        let whole = run_json(&json!({"from": "s", "limit": 1000, "order": order}), &data)
            .unwrap_or_else(|e| panic!("{e}"));
        let mut joined = ids(&first);
        joined.extend(ids(&rest));
        assert_eq!(joined, ids(&whole));
        assert_eq!(
            rest.items[0].as_object().map(|m| m.len()),
            Some(2),
            "select applied"
        );
    }

    #[test]
    fn cursor_from_another_query_is_refused() {
        // Goal: a cursor only resumes the query it came from; method: take a
        // cursor and replay it with from, where or order changed.
        let data = paged_fixture();
        let base = json!({"from": "s", "limit": 10, "where": {"kind": "even"}, "order": [{"field": "score"}]});
        let cursor = run_json(&base, &data)
            .unwrap_or_else(|e| panic!("{e}"))
            .next_cursor;
        let cursor = cursor.unwrap_or_default();
        let variants = [
            json!({"from": "other", "where": {"kind": "even"}, "order": [{"field": "score"}]}),
            json!({"from": "s", "where": {"kind": "odd"}, "order": [{"field": "score"}]}),
            json!({"from": "s", "order": [{"field": "score"}]}),
            json!({"from": "s", "where": {"kind": "even"}, "order": [{"field": "score", "direction": "desc"}]}),
            json!({"from": "s", "where": {"kind": "even"}, "order": [{"field": "n"}]}),
            json!({"from": "s", "where": {"kind": "even"}}),
        ];
        for mut q in variants {
            q["cursor"] = json!(cursor);
            let err = run_json(&q, &data).err();
            assert!(
                matches!(err, Some(QueryError::BadCursor { .. })),
                "{q}: {err:?}"
            );
        }
        // The same query written differently (explicit asc, $eq) is the
        // same query and keeps its cursor.
        let same = json!({"from": "s", "where": {"kind": {"$eq": "even"}}, "order": [{"field": "score", "direction": "asc"}], "cursor": cursor});
        assert!(run_json(&same, &data).is_ok());
    }

    #[test]
    fn tampered_cursor_is_refused() {
        // Goal: any change to a cursor is detected; method: flip bytes in
        // its digest and in its position, truncate it, and feed garbage.
        let data = paged_fixture();
        let q = json!({"from": "s", "limit": 10, "order": [{"field": "score"}]});
        let cursor = run_json(&q, &data)
            .unwrap_or_else(|e| panic!("{e}"))
            .next_cursor
            .unwrap_or_default();
        let bytes = URL_SAFE_NO_PAD.decode(&cursor).unwrap_or_default();
        assert!(bytes.len() > DIGEST_LEN);
        let flip = |i: usize| {
            let mut b = bytes.clone();
            b[i] ^= 0x01;
            URL_SAFE_NO_PAD.encode(b)
        };
        let mut forged_position = bytes[..DIGEST_LEN].to_vec();
        forged_position.extend_from_slice(br#"{"k":[[0]],"id":"item-00"}"#);
        let bad = [
            flip(0),
            flip(DIGEST_LEN - 1),
            flip(DIGEST_LEN + 3),
            flip(bytes.len() - 2),
            URL_SAFE_NO_PAD.encode(&bytes[..bytes.len() - 1]),
            URL_SAFE_NO_PAD.encode(&bytes[..DIGEST_LEN]),
            URL_SAFE_NO_PAD.encode(&bytes[..10]),
            URL_SAFE_NO_PAD.encode(forged_position),
            format!("{cursor}="),
            "@@@".to_owned(),
            String::new(),
            "opaque-base64".to_owned(),
        ];
        for c in bad {
            let mut q = q.clone();
            q["cursor"] = json!(c);
            let err = run_json(&q, &data).err();
            assert!(
                matches!(err, Some(QueryError::BadCursor { .. })),
                "{c}: {err:?}"
            );
        }
        let too_long = "A".repeat(MAX_CURSOR_LEN + 1);
        let err = parse(&json!({"from": "s", "cursor": too_long})).err();
        assert!(matches!(err, Some(QueryError::BadCursor { .. })), "{err:?}");
    }

    #[test]
    fn bad_queries_are_refused_with_their_location() {
        // Goal: malformed queries fail with an error naming what and where;
        // method: table of (query, expected message start).
        let deep_path = vec!["a"; MAX_PATH_SEGMENTS + 1].join(".");
        let long_segment = "x".repeat(MAX_SEGMENT_LEN + 1);
        let many_in: Vec<u32> = (0..=MAX_IN_VALUES as u32).collect();
        let cases: Vec<(Value, &str)> = vec![
            (json!([]), "query: expected an object, got an array"),
            (json!({}), "query: missing the required key \"from\""),
            (
                json!({"from": null}),
                "from: expected a schema URI string, got null",
            ),
            (json!({"from": ""}), "from: is empty"),
            (
                json!({"from": 5}),
                "from: expected a schema URI string, got a number",
            ),
            (
                json!({"from": "s", "limt": 5}),
                "query: unknown key \"limt\"; use one of select, from",
            ),
            (
                json!({"from": "s", "limit": 0}),
                "limit: 0 is not allowed; use an integer from 1 to 1000",
            ),
            (
                json!({"from": "s", "limit": 1001}),
                "limit: 1001 is not allowed",
            ),
            (
                json!({"from": "s", "limit": -1}),
                "limit: -1 is not allowed",
            ),
            (
                json!({"from": "s", "limit": 1.5}),
                "limit: 1.5 is not allowed",
            ),
            (
                json!({"from": "s", "limit": "10"}),
                "limit: \"10\" is not allowed",
            ),
            (
                json!({"from": "s", "where": {"$or": [{"a": 1}, {"tags": {"$containz": "x"}}]}}),
                "where.$or[1].tags: unknown operator $containz; use one of $eq, $ne, $gt, $gte, $lt, $lte, $in, $contains, $exists",
            ),
            (
                json!({"from": "s", "where": {"$nor": [{"a": 1}]}}),
                "where: unknown operator $nor; use one of $and, $or",
            ),
            (
                json!({"from": "s", "where": {"a": {"$gt": true}}}),
                "where.a.$gt: expected a number or a string, got a boolean",
            ),
            (
                json!({"from": "s", "where": {"a": {"$lte": null}}}),
                "where.a.$lte: expected a number or a string",
            ),
            (
                json!({"from": "s", "where": {"a": {"$in": 5}}}),
                "where.a.$in: expected an array of values",
            ),
            (
                json!({"from": "s", "where": {"a": {"$in": many_in}}}),
                "where.a.$in: has more than 1000 values",
            ),
            (
                json!({"from": "s", "where": {"a": {"$exists": 1}}}),
                "where.a.$exists: expected true or false",
            ),
            (
                json!({"from": "s", "where": {"a": {"$eq": 1, "b": 2}}}),
                "where.a: mixes operators with the plain key \"b\"",
            ),
            (
                json!({"from": "s", "where": {"$or": []}}),
                "where.$or: is empty",
            ),
            (
                json!({"from": "s", "where": {"$and": {"a": 1}}}),
                "where.$and: expected a non-empty array",
            ),
            (
                json!({"from": "s", "where": {"$and": [{"a": 1}, 3]}}),
                "where.$and[1]: expected an object of conditions",
            ),
            (
                json!({"from": "s", "where": []}),
                "where: expected an object of conditions, got an array",
            ),
            (
                json!({"from": "s", "where": {"a..b": 1}}),
                "where: bad field path \"a..b\": it has an empty segment",
            ),
            (
                json!({"from": "s", "where": {"a.$b": 1}}),
                "where: bad field path \"a.$b\": a segment starts with $",
            ),
            (
                json!({"from": "s", "where": {"a b": 1}}),
                "where: bad field path \"a b\": a segment has a character",
            ),
            (
                json!({"from": "s", "where": {deep_path: 1}}),
                "where: bad field path",
            ),
            (
                json!({"from": "s", "where": {long_segment: 1}}),
                "where: bad field path",
            ),
            (
                json!({"from": "s", "select": ["ok", "bad path"]}),
                "select[1]: bad field path \"bad path\"",
            ),
            (
                json!({"from": "s", "select": ["ok", ""]}),
                "select[1]: bad field path \"\": it is empty",
            ),
            (
                json!({"from": "s", "select": "x"}),
                "select: expected an array of field paths, got a string",
            ),
            (
                json!({"from": "s", "order": [{"field": "a", "dir": "asc"}]}),
                "order[0]: unknown key \"dir\"; use one of field, direction",
            ),
            (
                json!({"from": "s", "order": [{"field": "a", "direction": "up"}]}),
                "order[0].direction: \"up\" is not a direction",
            ),
            (
                json!({"from": "s", "order": [{"field": "a"}, {"direction": "asc"}]}),
                "order[1]: missing the required key \"field\"",
            ),
            (
                json!({"from": "s", "order": {"field": "a"}}),
                "order: expected an array",
            ),
            (
                json!({"from": "s", "order": [{"field": "a.."}]}),
                "order[0].field: bad field path",
            ),
            (
                json!({"from": "s", "cursor": 5}),
                "cursor: expected a string, got a number",
            ),
        ];
        for (q, want) in cases {
            match parse(&q) {
                Ok(parsed) => panic!("{q} parsed to {parsed:?}; want an error starting {want:?}"),
                Err(e) => assert!(
                    e.to_string().starts_with(want),
                    "{q}:\n got  {e}\n want {want}"
                ),
            }
        }
        let ok_path = vec!["a"; MAX_PATH_SEGMENTS].join(".");
        let ok_segment = format!("x@$-_{}", "9".repeat(MAX_SEGMENT_LEN - 5));
        assert!(parse(&json!({"from": "s", "where": {ok_path: 1, ok_segment: 2}})).is_ok());
    }

    #[test]
    fn limit_bounds_and_defaults() {
        // Goal: limit accepts exactly 1..=1000 and defaults to 50; method:
        // table of limit values, including null as absent.
        let cases: &[(Value, Option<usize>)] = &[
            (json!(1), Some(1)),
            (json!(1000), Some(1000)),
            (json!(50), Some(50)),
            (Value::Null, Some(DEFAULT_LIMIT)),
            (json!(0), None),
            (json!(1001), None),
            (json!(u64::MAX), None),
        ];
        for (limit, want) in cases {
            let got = parse(&json!({"from": "s", "limit": limit}))
                .ok()
                .map(|q| q.limit);
            assert_eq!(got, *want, "limit {limit}");
        }
        assert_eq!(
            parse(&json!({"from": "s"})).ok().map(|q| q.limit),
            Some(DEFAULT_LIMIT)
        );
        let mut q = parse(&json!({"from": "s"})).unwrap_or_else(|e| panic!("{e}"));
        q.limit = 0;
        assert!(matches!(run(&q, &[]), Err(QueryError::BadLimit { .. })));
    }

    /// `{"a": 1}` wrapped in `$and` until it is `levels` where objects deep.
    fn nested_where(levels: usize) -> Value {
        let mut w = json!({"a": 1});
        for _ in 1..levels {
            w = json!({ "$and": [w] });
        }
        w
    }

    #[test]
    fn where_depth_and_node_caps() {
        // Goal: nesting and size caps hold exactly at their limits; method:
        // build clauses at and just over each cap.
        let parses = |w: Value| parse(&json!({"from": "s", "where": w}));
        assert!(parses(nested_where(MAX_WHERE_DEPTH)).is_ok());
        assert!(matches!(
            parses(nested_where(MAX_WHERE_DEPTH + 1)),
            Err(QueryError::TooDeep { .. })
        ));

        // One top object and its `$or` key, then 3 nodes per branch
        // (object, field key, operator).
        let or_of = |n: usize| json!({"$or": vec![json!({"f": 1}); n]});
        assert!(parses(or_of((MAX_WHERE_NODES - 2) / 3)).is_ok());
        assert!(matches!(
            parses(or_of((MAX_WHERE_NODES - 2) / 3 + 1)),
            Err(QueryError::TooManyNodes)
        ));

        let mut deep_value = json!(1);
        for _ in 0..=MAX_VALUE_DEPTH {
            deep_value = json!([deep_value]);
        }
        let err = parses(json!({"a": {"$eq": deep_value}})).err();
        assert!(matches!(err, Some(QueryError::Invalid { .. })), "{err:?}");

        // A parsed query at the depth cap still executes, even when every
        // level has several keys (the widest filter tree a parse can build).
        let data = items(&[("x", json!({"a": 1})), ("y", json!({"a": 2}))]);
        let mut wide = json!({"a": 1, "b": {"$exists": false}});
        for _ in 1..MAX_WHERE_DEPTH {
            wide = json!({"$and": [wide], "c": {"$ne": 3}});
        }
        for w in [nested_where(MAX_WHERE_DEPTH), wide] {
            let q = parses(w).unwrap_or_else(|e| panic!("{e}"));
            assert_eq!(
                ids(&run(&q, &data).unwrap_or_else(|e| panic!("{e}"))),
                ["x"]
            );
        }

        // A hand-built filter is held to the same caps at execution.
        let mut filter = Filter::Field {
            path: FieldPath::parse("a").unwrap_or_else(|e| panic!("{e}")),
            op: Op::Exists(true),
        };
        for _ in 0..=FILTER_TREE_DEPTH_MAX {
            filter = Filter::Or(vec![filter]);
        }
        let mut q = parse(&json!({"from": "s"})).unwrap_or_else(|e| panic!("{e}"));
        q.filter = Some(filter);
        assert!(matches!(run(&q, &data), Err(QueryError::TooDeep { .. })));
    }

    #[test]
    fn budget_stops_expensive_scans() {
        // Goal: the scan stops past max_scanned or when the caller's clock
        // says so, polling it every 256 items; method: count items and polls.
        let data: Vec<(String, Value)> = (0..300)
            .map(|i| (format!("{i:03}"), json!({"n": i})))
            .collect();
        let q = parse(&json!({"from": "s", "where": {"n": {"$lt": 0}}}))
            .unwrap_or_else(|e| panic!("{e}"));
        let scan = |max_scanned: usize, n: usize| {
            execute(
                &q,
                data[..n].iter().map(|(id, v)| (id.as_str(), v)),
                &Budget::scan_only(max_scanned),
            )
        };
        assert_eq!(scan(5, 5).map(|r| r.scanned).ok(), Some(5));
        assert!(matches!(
            scan(5, 6),
            Err(QueryError::TooExpensive {
                exceeded: Exceeded::ScanBudget { max_scanned: 5 },
                scanned: 5
            })
        ));
        assert!(matches!(
            scan(0, 1),
            Err(QueryError::TooExpensive { scanned: 0, .. })
        ));
        assert_eq!(scan(0, 0).map(|r| r.scanned).ok(), Some(0));

        let cases: &[(usize, usize, bool)] = &[
            // (items, polls until expired, expect stop)
            (300, 2, true),
            (256, 2, false),
            (300, 1, true),
            (300, 3, false),
        ];
        for &(n, expire_at_poll, stops) in cases {
            let polls = Cell::new(0);
            let expired = || {
                polls.set(polls.get() + 1);
                polls.get() >= expire_at_poll
            };
            let budget = Budget {
                max_scanned: ROOMY,
                expired: &expired,
            };
            let got = execute(
                &q,
                data[..n].iter().map(|(id, v)| (id.as_str(), v)),
                &budget,
            );
            let want_polls = n.div_ceil(EXPIRY_POLL_INTERVAL).min(expire_at_poll);
            assert_eq!(
                polls.get(),
                want_polls,
                "{n} items, expire at poll {expire_at_poll}"
            );
            match got {
                Err(QueryError::TooExpensive {
                    exceeded: Exceeded::Deadline,
                    scanned,
                }) => {
                    assert!(stops);
                    assert_eq!(scanned, (expire_at_poll - 1) * EXPIRY_POLL_INTERVAL);
                }
                Ok(r) => {
                    assert!(!stops);
                    assert_eq!(r.scanned, n);
                }
                Err(e) => panic!("{e}"),
            }
        }
    }

    #[test]
    fn select_projects_nested_paths_and_id() {
        // Goal: projection recreates nesting, always carries the passed id
        // and leaves out missing paths; method: table of selects over one item.
        let data = items(&[(
            "n1",
            json!({"id": "other", "title": "T", "meta": {"author": {"name": "Ann", "age": 3}, "x": 1}, "tags": ["a"]}),
        )]);
        let cases: &[(Option<Value>, Value)] = &[
            (
                None,
                json!({"id": "n1", "title": "T", "meta": {"author": {"name": "Ann", "age": 3}, "x": 1}, "tags": ["a"]}),
            ),
            (Some(json!([])), json!({"id": "n1"})),
            (
                Some(json!(["id", "title"])),
                json!({"id": "n1", "title": "T"}),
            ),
            (
                Some(json!(["meta.author.name", "missing", "title.x"])),
                json!({"id": "n1", "meta": {"author": {"name": "Ann"}}}),
            ),
            (
                Some(json!(["meta.author.name", "meta.x", "tags"])),
                json!({"id": "n1", "meta": {"author": {"name": "Ann"}, "x": 1}, "tags": ["a"]}),
            ),
            (
                Some(json!(["meta.author.name", "meta"])),
                json!({"id": "n1", "meta": {"author": {"name": "Ann", "age": 3}, "x": 1}}),
            ),
        ];
        for (select, want) in cases {
            let mut q = json!({"from": "s"});
            if let Some(select) = select {
                q["select"] = select.clone();
            }
            let got = run_json(&q, &data).unwrap_or_else(|e| panic!("{e}"));
            assert_eq!(got.items, vec![want.clone()], "select {select:?}");
        }
        let scalar = items(&[("k", json!(42))]);
        let got = run_json(&json!({"from": "s"}), &scalar).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(got.items, vec![json!({"id": "k", "value": 42})]);
    }

    #[test]
    fn nip8_example_parses() {
        // Goal: the example AST of NIP-8 parses to the expected query; its
        // placeholder cursor is then refused at execution.
        let example = json!({
          "select": ["id","title"],
          "from":   "did:nuwa:state:note#v1",
          "where":  {"tags":{"$contains":"meeting"}},
          "order":  [{"field":"updatedAt","direction":"desc"}],
          "limit":  20,
          "cursor": "opaque-base64"
        });
        let q = parse(&example).unwrap_or_else(|e| panic!("{e}"));
        let path = |s: &str| FieldPath::parse(s).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            q,
            Query {
                select: Some(vec![path("id"), path("title")]),
                from: "did:nuwa:state:note#v1".to_owned(),
                filter: Some(Filter::Field {
                    path: path("tags"),
                    op: Op::Contains(json!("meeting")),
                }),
                order: vec![OrderBy {
                    field: path("updatedAt"),
                    direction: Direction::Desc,
                }],
                limit: 20,
                cursor: Some("opaque-base64".to_owned()),
            }
        );
        assert!(matches!(run(&q, &[]), Err(QueryError::BadCursor { .. })));
    }

    #[test]
    fn to_json_round_trips() {
        // Goal: `Query::to_json` is read back by `parse` to an equal query;
        // method: round-trip a table of queries.
        let cases = [
            json!({"from": "s"}),
            json!({"from": "s", "select": ["a.b", "id"], "limit": 7, "cursor": "xyz"}),
            json!({"from": "s", "where": {"a": 1, "b": {"$gt": 2, "$in": [1, [2]]}, "$or": [{"c": {"$exists": false}}, {"$and": [{}]}]}}),
            json!({"from": "s", "where": {"m": {"k": {"$x": 1}}}, "order": [{"field": "a"}, {"field": "b", "direction": "desc"}]}),
        ];
        for q in cases {
            let parsed = parse(&q).unwrap_or_else(|e| panic!("{q}: {e}"));
            let again = parse(&parsed.to_json()).unwrap_or_else(|e| panic!("{q}: {e}"));
            assert_eq!(again, parsed, "{q}");
        }
    }
}
