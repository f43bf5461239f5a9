//! Patches over plain JSON items: RFC 6902 JSON Patch (with RFC 6901 JSON
//! Pointers) and the `state.update` operator form
//! `{"$inc": {field: number}, "$push": {field: value}}`.
//!
//! Pure functions: no Automerge, no schema. The caller validates the
//! patched item against its schema and then stores it with `doc::update`.

use serde_json::{Map, Number, Value};

use super::{DocError, MAX_DEPTH, MAX_PATCH_COPY_NODES, MAX_PATCH_OPS};

/// Applies `patch` to `current` and returns the patched value; `current`
/// is never modified, and a patch that fails anywhere changes nothing.
///
/// `patch` is either a JSON Patch array (operations `add`, `remove`,
/// `replace`, `move`, `copy`, `test`) or an object with `"$inc"` (add a
/// number to a top-level field, which may be absent) and/or `"$push"`
/// (append to a top-level array field, which may be absent; push
/// `{"$each": [...]}` to append several). `$inc` runs before `$push`.
pub fn apply_patch(current: &Value, patch: &Value) -> Result<Value, DocError> {
    match patch {
        Value::Array(ops) => json_patch(current, ops),
        Value::Object(m) if !m.is_empty() && m.keys().all(|k| k == "$inc" || k == "$push") => {
            operators(current, m)
        }
        _ => Err(DocError::BadPatch {
            reason: "a patch is a json patch array or an object with \"$inc\" and/or \"$push\"",
        }),
    }
}

// ---------------------------------------------------------------------------
// RFC 6902

fn json_patch(current: &Value, ops: &[Value]) -> Result<Value, DocError> {
    if ops.len() > MAX_PATCH_OPS {
        return Err(DocError::TooManyPatchOps {
            count: ops.len(),
            max: MAX_PATCH_OPS,
        });
    }
    let mut doc = current.clone();
    let mut copied_nodes = 0usize;
    for (index, op) in ops.iter().enumerate() {
        let Value::Object(op) = op else {
            return Err(op_error(index, "an operation must be a json object"));
        };
        let name = member_str(index, op, "op")?;
        let path_str = member_str(index, op, "path")?;
        let path = parse_pointer(index, path_str)?;
        let at = |e: Nav| nav_error(index, path_str, e);
        match name {
            "add" => add(&mut doc, &path, member(index, op, "value")?.clone()).map_err(at)?,
            "remove" => {
                remove(&mut doc, &path).map_err(at)?;
            }
            "replace" => {
                let value = member(index, op, "value")?.clone();
                *lookup_mut(&mut doc, &path).map_err(at)? = value;
            }
            "move" => {
                let from_str = member_str(index, op, "from")?;
                let from = parse_pointer(index, from_str)?;
                if path.len() > from.len() && path.starts_with(&from) {
                    return Err(op_error(
                        index,
                        "cannot move a value into one of its children",
                    ));
                }
                if from != path {
                    let value =
                        remove(&mut doc, &from).map_err(|e| nav_error(index, from_str, e))?;
                    add(&mut doc, &path, value).map_err(at)?;
                }
            }
            "copy" => {
                let from_str = member_str(index, op, "from")?;
                let from = parse_pointer(index, from_str)?;
                let value = lookup(&doc, &from).map_err(|e| nav_error(index, from_str, e))?;
                let budget = MAX_PATCH_COPY_NODES - copied_nodes;
                copied_nodes += count_nodes(value, budget).ok_or(DocError::PatchTooLarge {
                    max: MAX_PATCH_COPY_NODES,
                })?;
                let value = value.clone();
                add(&mut doc, &path, value).map_err(at)?;
            }
            "test" => {
                let expected = member(index, op, "value")?;
                if !json_eq(lookup(&doc, &path).map_err(at)?, expected) {
                    return Err(DocError::PatchTestFailed {
                        index,
                        path: path_str.to_owned(),
                    });
                }
            }
            other => {
                return Err(DocError::PatchOp {
                    index,
                    reason: format!("unknown operation {other:?}"),
                });
            }
        }
    }
    Ok(doc)
}

fn op_error(index: usize, reason: &str) -> DocError {
    DocError::PatchOp {
        index,
        reason: reason.to_owned(),
    }
}

fn member<'a>(index: usize, op: &'a Map<String, Value>, key: &str) -> Result<&'a Value, DocError> {
    op.get(key).ok_or_else(|| DocError::PatchOp {
        index,
        reason: format!("missing member {key:?}"),
    })
}

fn member_str<'a>(
    index: usize,
    op: &'a Map<String, Value>,
    key: &str,
) -> Result<&'a str, DocError> {
    member(index, op, key)?
        .as_str()
        .ok_or_else(|| DocError::PatchOp {
            index,
            reason: format!("member {key:?} must be a string"),
        })
}

/// Splits an RFC 6901 pointer into unescaped reference tokens.
fn parse_pointer(index: usize, pointer: &str) -> Result<Vec<String>, DocError> {
    let bad = |reason| DocError::BadPointer {
        index,
        pointer: pointer.to_owned(),
        reason,
    };
    if pointer.is_empty() {
        return Ok(Vec::new());
    }
    let Some(rest) = pointer.strip_prefix('/') else {
        return Err(bad("a pointer is empty or starts with '/'"));
    };
    let mut tokens = Vec::new();
    for raw in rest.split('/') {
        if tokens.len() == MAX_DEPTH {
            return Err(bad("more than 64 reference tokens"));
        }
        let mut token = String::with_capacity(raw.len());
        let mut chars = raw.chars();
        while let Some(c) = chars.next() {
            if c != '~' {
                token.push(c);
                continue;
            }
            match chars.next() {
                Some('0') => token.push('~'),
                Some('1') => token.push('/'),
                _ => return Err(bad("'~' must be followed by '0' or '1'")),
            }
        }
        tokens.push(token);
    }
    Ok(tokens)
}

/// Why a pointer did not lead to a value.
enum Nav {
    /// No value at the pointer (or its parent).
    Missing,
    /// An array index that is not `0` or a number without leading zeros.
    BadIndex,
    /// An array index past the end.
    OutOfBounds,
    /// The document root cannot be removed.
    RemoveRoot,
}

fn nav_error(index: usize, pointer: &str, e: Nav) -> DocError {
    let reason = match e {
        Nav::Missing => format!("no value at {pointer:?}"),
        Nav::OutOfBounds => format!("array index out of bounds in {pointer:?}"),
        Nav::RemoveRoot => "cannot remove the whole document".to_owned(),
        Nav::BadIndex => {
            return DocError::BadPointer {
                index,
                pointer: pointer.to_owned(),
                reason: "an array index is '0' or digits without a leading zero",
            };
        }
    };
    DocError::PatchOp { index, reason }
}

fn array_index(token: &str) -> Result<usize, Nav> {
    let digits_only = !token.is_empty() && token.bytes().all(|b| b.is_ascii_digit());
    if !digits_only || (token.len() > 1 && token.starts_with('0')) {
        return Err(Nav::BadIndex);
    }
    // Too many digits for usize cannot name an existing element.
    token.parse().map_err(|_| Nav::OutOfBounds)
}

fn lookup<'a>(doc: &'a Value, tokens: &[String]) -> Result<&'a Value, Nav> {
    let mut at = doc;
    for token in tokens {
        at = match at {
            Value::Object(m) => m.get(token).ok_or(Nav::Missing)?,
            Value::Array(_) if token == "-" => return Err(Nav::OutOfBounds),
            Value::Array(a) => a.get(array_index(token)?).ok_or(Nav::OutOfBounds)?,
            _ => return Err(Nav::Missing),
        };
    }
    Ok(at)
}

fn lookup_mut<'a>(doc: &'a mut Value, tokens: &[String]) -> Result<&'a mut Value, Nav> {
    let mut at = doc;
    for token in tokens {
        at = match at {
            Value::Object(m) => m.get_mut(token).ok_or(Nav::Missing)?,
            Value::Array(_) if token == "-" => return Err(Nav::OutOfBounds),
            Value::Array(a) => a.get_mut(array_index(token)?).ok_or(Nav::OutOfBounds)?,
            _ => return Err(Nav::Missing),
        };
    }
    Ok(at)
}

fn add(doc: &mut Value, tokens: &[String], value: Value) -> Result<(), Nav> {
    let Some((last, parent)) = tokens.split_last() else {
        *doc = value;
        return Ok(());
    };
    match lookup_mut(doc, parent)? {
        Value::Object(m) => {
            m.insert(last.clone(), value);
        }
        Value::Array(a) if last == "-" => a.push(value),
        Value::Array(a) => {
            let i = array_index(last)?;
            if i > a.len() {
                return Err(Nav::OutOfBounds);
            }
            a.insert(i, value);
        }
        _ => return Err(Nav::Missing),
    }
    Ok(())
}

fn remove(doc: &mut Value, tokens: &[String]) -> Result<Value, Nav> {
    let Some((last, parent)) = tokens.split_last() else {
        return Err(Nav::RemoveRoot);
    };
    match lookup_mut(doc, parent)? {
        Value::Object(m) => m.remove(last).ok_or(Nav::Missing),
        Value::Array(_) if last == "-" => Err(Nav::OutOfBounds),
        Value::Array(a) => {
            let i = array_index(last)?;
            if i >= a.len() {
                return Err(Nav::OutOfBounds);
            }
            Ok(a.remove(i))
        }
        _ => Err(Nav::Missing),
    }
}

/// The number of JSON nodes in `value`, or `None` if more than `budget`.
fn count_nodes(value: &Value, budget: usize) -> Option<usize> {
    let mut count = 0usize;
    let mut stack = vec![value];
    while let Some(v) = stack.pop() {
        count += 1;
        if count > budget {
            return None;
        }
        match v {
            Value::Array(a) => stack.extend(a),
            Value::Object(m) => stack.extend(m.values()),
            _ => {}
        }
    }
    Some(count)
}

/// JSON equality as RFC 6902 `test` defines it: numbers compare by value
/// (`1` equals `1.0`), objects ignore member order.
fn json_eq(a: &Value, b: &Value) -> bool {
    match (a, b) {
        (Value::Number(x), Value::Number(y)) => match (int_of(x), int_of(y)) {
            (Some(x), Some(y)) => x == y,
            _ => x.as_f64() == y.as_f64(),
        },
        (Value::Array(x), Value::Array(y)) => {
            x.len() == y.len() && x.iter().zip(y).all(|(x, y)| json_eq(x, y))
        }
        (Value::Object(x), Value::Object(y)) => {
            x.len() == y.len()
                && x.iter()
                    .all(|(k, v)| y.get(k).is_some_and(|w| json_eq(v, w)))
        }
        _ => a == b,
    }
}

fn int_of(n: &Number) -> Option<i128> {
    n.as_i64()
        .map(i128::from)
        .or_else(|| n.as_u64().map(i128::from))
}

// ---------------------------------------------------------------------------
// $inc / $push

fn operators(current: &Value, patch: &Map<String, Value>) -> Result<Value, DocError> {
    let Value::Object(item) = current else {
        return Err(DocError::NotAnObject);
    };
    let mut item = item.clone();
    let inc = match patch.get("$inc") {
        None => None,
        Some(Value::Object(m)) => Some(m),
        Some(_) => {
            return Err(DocError::BadPatch {
                reason: "\"$inc\" must be an object of field: number",
            });
        }
    };
    let push = match patch.get("$push") {
        None => None,
        Some(Value::Object(m)) => Some(m),
        Some(_) => {
            return Err(DocError::BadPatch {
                reason: "\"$push\" must be an object of field: value",
            });
        }
    };
    let count = inc.map_or(0, Map::len) + push.map_or(0, Map::len);
    if count > MAX_PATCH_OPS {
        return Err(DocError::TooManyPatchOps {
            count,
            max: MAX_PATCH_OPS,
        });
    }
    let mut index = 0usize;
    for (field, amount) in inc.into_iter().flatten() {
        let Value::Number(amount) = amount else {
            return Err(DocError::PatchOp {
                index,
                reason: format!("$inc of field {field:?} needs a number"),
            });
        };
        let sum = match item.get(field) {
            None => amount.clone(),
            Some(Value::Number(n)) => add_numbers(n, amount).ok_or_else(|| DocError::PatchOp {
                index,
                reason: format!("$inc of field {field:?} overflows"),
            })?,
            Some(_) => {
                return Err(DocError::PatchOp {
                    index,
                    reason: format!("$inc needs field {field:?} to be a number"),
                });
            }
        };
        item.insert(field.clone(), Value::Number(sum));
        index += 1;
    }
    for (field, value) in push.into_iter().flatten() {
        let values = match value {
            Value::Object(m) if m.len() == 1 && m.contains_key("$each") => match &m["$each"] {
                Value::Array(each) => each.clone(),
                _ => {
                    return Err(DocError::PatchOp {
                        index,
                        reason: format!("$push of field {field:?}: \"$each\" must be an array"),
                    });
                }
            },
            v => vec![v.clone()],
        };
        match item.get_mut(field) {
            None => {
                item.insert(field.clone(), Value::Array(values));
            }
            Some(Value::Array(a)) => a.extend(values),
            Some(_) => {
                return Err(DocError::PatchOp {
                    index,
                    reason: format!("$push needs field {field:?} to be an array"),
                });
            }
        }
        index += 1;
    }
    Ok(Value::Object(item))
}

/// Integer sum when both are integers and the sum fits i64 or u64, else
/// float sum; `None` on integer overflow or a non-finite float.
fn add_numbers(a: &Number, b: &Number) -> Option<Number> {
    if let (Some(x), Some(y)) = (int_of(a), int_of(b)) {
        // Two values each within i64..=u64 cannot overflow i128.
        let sum = x + y;
        return i64::try_from(sum)
            .map(Number::from)
            .or_else(|_| u64::try_from(sum).map(Number::from))
            .ok();
    }
    Number::from_f64(a.as_f64()? + b.as_f64()?)
}
