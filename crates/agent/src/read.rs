//! Reads of one container, as `GET /v1/state/get` and `GET
//! /v1/state/export` answer them: the daemon's reader thread runs them on
//! its replicas, and `state get --offline` / `state export --offline` on a
//! container loaded from the home's store with no daemon, so both print the
//! same bytes. Loading the container and the registry is the caller's.

use nuwa_asm::doc::DocError;
use nuwa_asm::model::ContainerKind;
use nuwa_asm::registry::Registry;
use nuwa_asm::schema::AsmSchema;
use nuwa_state::Container;
use serde_json::Value;

use crate::api::{ApiError, ErrorCode, GetQuery};

/// The refusal for a container this device does not hold.
pub fn no_such_container(name: &str) -> ApiError {
    ApiError::new(
        ErrorCode::NoSuchContainer,
        format!("container {name:?} does not exist on this device"),
    )
}

/// `state get`: the container `c` (`None`: this device does not hold it),
/// or one key or object of it, as JSON bytes. A typed container (its name
/// is a registered schema's `$id`) shows its user's view unless `q.raw`.
pub fn get(c: Option<&Container>, registry: &Registry, q: &GetQuery) -> Result<Vec<u8>, ApiError> {
    let c = c.ok_or_else(|| no_such_container(&q.container))?;
    let typed = registry.get(&q.container).filter(|_| !q.raw);
    let value = match (typed, &q.key) {
        (Some(schema), key) => user_view(c, schema, &q.container, key.as_deref())?,
        (None, None) => c.to_json(),
        (None, Some(k)) => c.get(k).ok_or_else(|| {
            ApiError::new(
                ErrorCode::NoSuchKey,
                format!("key {k:?} is not set in container {:?}", q.container),
            )
        })?,
    };
    serde_json::to_vec(&value).map_err(|e| ApiError::new(ErrorCode::Internal, e.to_string()))
}

/// `state export`: the container's Automerge document in the standard
/// binary format.
pub fn export(c: Option<&Container>, name: &str) -> Result<Vec<u8>, ApiError> {
    c.map(Container::save)
        .ok_or_else(|| no_such_container(name))
}

/// A typed container as its user sees it, as `state.query` renders items:
/// live objects only, each field as plain JSON (a set as an array). An
/// object or map container is `{id: object}`, a list or log `[object]`;
/// with `id`, that one object.
fn user_view(
    c: &Container,
    schema: &AsmSchema,
    name: &str,
    id: Option<&str>,
) -> Result<Value, ApiError> {
    let failed = |e: DocError| {
        ApiError::new(
            ErrorCode::Internal,
            format!("cannot read typed container {name:?}: {e}"),
        )
    };
    if let Some(id) = id {
        return nuwa_asm::doc::get(c.doc(), &schema.layout, id)
            .map_err(failed)?
            .map(|view| view.value)
            .ok_or_else(|| {
                ApiError::new(
                    ErrorCode::NoSuchObject,
                    format!("no live object with id {id:?} in {name:?}"),
                )
            });
    }
    let items = nuwa_asm::doc::items(c.doc(), &schema.layout).map_err(failed)?;
    Ok(match schema.layout.container {
        ContainerKind::List | ContainerKind::Log => {
            Value::Array(items.into_iter().map(|(_, v)| v).collect())
        }
        _ => Value::Object(items.into_iter().collect()),
    })
}
