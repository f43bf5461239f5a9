//! Writes as transactions: `POST /v1/state.batch`, and the single
//! `state.create`, `state.update` and `state.delete` calls, which are
//! batches of one.
//!
//! A batch is grouped by container, keeping request order within each. The
//! operations on one container are checked and applied as **one** Automerge
//! transaction: every failing operation is named, and if any fails the
//! transaction is rolled back, so the container's heads do not move; the
//! others get `batch_aborted`. Containers are independent: one failing does
//! not stop another. All changes of the batch then go through one group
//! commit per container and one delta per container and peer, and the
//! reply is sent only once they are durable.
//!
//! A typed container that does not exist yet is created by its
//! deterministic genesis change (see `asm.rs`). So that a failing batch
//! leaves no trace there either, the batch first runs on a scratch copy of
//! the genesis, and the genesis is applied only if that run succeeds.

use std::collections::BTreeMap;

use nuwa_asm::doc;
use nuwa_asm::schema::AsmSchema;
use nuwa_state::Container;
use nuwa_state::automerge::transaction::Transaction;
use serde_json::Value;

use crate::agent::{Agent, Out};
use crate::api::{
    ApiError, BatchBody, BatchContainer, BatchOp, BatchOpResult, BatchReply, DeleteMode, ErrorCode,
};
use crate::asm::{
    check_object_size, doc_error, new_uuid, schema_has_id, validation_error, without_id,
};

/// An operation after the checks that need no document.
enum Step<'a> {
    Put { key: &'a str, value: &'a Value },
    Create { id: String, object: Value },
    Update { id: &'a str, patch: &'a Value },
    Delete { id: &'a str, hard: bool },
}

/// Per operation (by position in the container's list): its error, if any.
type Failures = Vec<(usize, ApiError)>;

fn all_fail(n: usize, e: ApiError) -> Failures {
    (0..n).map(|i| (i, e.clone())).collect()
}

/// The checks of `state.create` that need no document; fixes the id (a
/// fresh UUID when neither the object nor the call gives one).
fn prepare_create(
    schema: &AsmSchema,
    object: &Value,
    id: Option<&str>,
) -> Result<(String, Value), ApiError> {
    if !object.is_object() {
        return Err(ApiError::new(
            ErrorCode::InvalidObject,
            "the object must be a JSON object",
        ));
    }
    check_object_size(object)?;
    let own = object.get("id").and_then(Value::as_str);
    let id = match (own, id) {
        (Some(a), Some(b)) if a != b => {
            return Err(ApiError::new(
                ErrorCode::InvalidObject,
                format!("the object's id {a:?} differs from the id parameter {b:?}"),
            ));
        }
        (Some(a), _) | (None, Some(a)) => a.to_owned(),
        (None, None) => new_uuid(),
    };
    if id.is_empty() || id.len() > 1024 {
        return Err(ApiError::new(
            ErrorCode::InvalidObject,
            "an id must be 1 to 1024 bytes",
        ));
    }
    nuwa_state::check_key_rules(&id)
        .map_err(|e| ApiError::new(ErrorCode::InvalidObject, format!("the id {id:?}: {e}")))?;
    let mut object = object.clone();
    if schema_has_id(schema) {
        if let Some(o) = object.as_object_mut() {
            o.entry("id").or_insert_with(|| Value::String(id.clone()));
        }
    }
    schema
        .validate_item(&without_id(schema, &object))
        .map_err(validation_error)?;
    Ok((id, object))
}

/// Applies one checked step inside the container's transaction. Updates
/// read the object through the transaction, so they see earlier steps of
/// the same batch.
fn apply_step(
    tx: &mut Transaction<'_>,
    schema: Option<&AsmSchema>,
    step: &Step,
) -> Result<(), ApiError> {
    if let Step::Put { key, value } = step {
        return Container::put_in(tx, key, value)
            .map_err(|e| ApiError::new(ErrorCode::InvalidWrite, e.to_string()));
    }
    let schema = schema.ok_or_else(internal)?;
    let layout = &schema.layout;
    match step {
        Step::Put { .. } => Err(internal()),
        Step::Create { id, object } => doc::create(tx, layout, id, object).map_err(doc_error),
        Step::Update { id, patch } => {
            let current = doc::get(&*tx, layout, id)
                .map_err(doc_error)?
                .ok_or_else(|| {
                    ApiError::new(
                        ErrorCode::NoSuchObject,
                        format!("no object {id:?} in {}", schema.id.full),
                    )
                })?;
            let new = doc::apply_patch(&current.value, patch).map_err(doc_error)?;
            if new.get("id").and_then(Value::as_str) != Some(*id) {
                return Err(ApiError::new(
                    ErrorCode::InvalidEdit,
                    "a patch may not change the object's id",
                ));
            }
            check_object_size(&new)?;
            schema
                .validate_item(&without_id(schema, &new))
                .map_err(validation_error)?;
            doc::update(tx, layout, id, &new).map_err(doc_error)
        }
        Step::Delete { id, hard } => doc::delete(tx, layout, id, *hard).map_err(doc_error),
    }
}

/// Runs every step that passed the first checks (`None` did not), adding
/// each failure; any failure, earlier or here, rolls the whole transaction
/// back. Running the rest after a failure names every failing operation,
/// not only the first.
fn run_steps(
    tx: &mut Transaction<'_>,
    schema: Option<&AsmSchema>,
    steps: &[Option<Step>],
    failures: &mut Failures,
) -> Result<(), ()> {
    for (i, step) in steps.iter().enumerate() {
        if let Some(step) = step {
            if let Err(e) = apply_step(tx, schema, step) {
                failures.push((i, e));
            }
        }
    }
    if failures.is_empty() { Ok(()) } else { Err(()) }
}

fn step_id(step: &Step) -> Option<String> {
    match step {
        Step::Put { .. } => None,
        Step::Create { id, .. } => Some(id.clone()),
        Step::Update { id, .. } | Step::Delete { id, .. } => Some((*id).to_owned()),
    }
}

impl Agent {
    /// `POST /v1/state.batch`. Answered (by the executor) once every
    /// applied change is durable.
    pub(crate) fn on_batch(&mut self, body: BatchBody, out: &mut Out) -> BatchReply {
        self.refresh_registry(out);
        let mut groups: BTreeMap<&str, Vec<usize>> = BTreeMap::new();
        let mut order: Vec<&str> = Vec::new();
        for (i, op) in body.ops.iter().enumerate() {
            let c = op.container();
            let list = groups.entry(c).or_default();
            if list.is_empty() {
                order.push(c);
            }
            list.push(i);
        }
        let mut results: Vec<BatchOpResult> = vec![
            BatchOpResult {
                ok: true,
                id: None,
                error: None,
            };
            body.ops.len()
        ];
        let mut containers = Vec::with_capacity(order.len());
        for name in order {
            let idx = &groups[name];
            let ops: Vec<&BatchOp> = idx.iter().map(|&i| &body.ops[i]).collect();
            let outcome = self.transact_ops(name, &ops, out);
            let ok = outcome.is_ok();
            match outcome {
                Ok(ids) => {
                    for (&i, id) in idx.iter().zip(ids) {
                        results[i].id = id;
                    }
                }
                Err(failures) => {
                    let first = failures.first().map(|(pos, _)| idx[*pos]).unwrap_or(0);
                    for &i in idx {
                        results[i].ok = false;
                        results[i].error = Some(ApiError::new(
                            ErrorCode::BatchAborted,
                            format!(
                                "not applied: operation {first} on the same container \
                                 ({name}) failed"
                            ),
                        ));
                    }
                    for (pos, e) in failures {
                        results[idx[pos]].error = Some(e);
                    }
                }
            }
            containers.push(BatchContainer {
                container: name.to_owned(),
                ops: idx.len(),
                ok,
                heads: self.heads_hex(name),
            });
        }
        let failed = results.iter().filter(|r| !r.ok).count();
        BatchReply {
            ok: failed == 0,
            applied: results.len() - failed,
            failed,
            containers,
            results,
            durable: true,
        }
    }

    /// Applies `ops`, all on `container`, as one transaction: all or
    /// nothing. Returns each operation's object id (none for puts), or
    /// every failure by position in `ops`.
    pub(crate) fn transact_ops(
        &mut self,
        container: &str,
        ops: &[&BatchOp],
        out: &mut Out,
    ) -> Result<Vec<Option<String>>, Failures> {
        if let Err(e) = nuwa_state::check_container_name(container) {
            return Err(all_fail(
                ops.len(),
                ApiError::new(ErrorCode::InvalidContainerName, e.to_string()),
            ));
        }
        let typed = ops.iter().any(|op| !matches!(op, BatchOp::Put { .. }));
        if !typed {
            crate::asm::check_untyped_write(&self.asm.registry, container)
                .and_then(|()| crate::asm::check_new_name(container))
                .map_err(|e| all_fail(ops.len(), e))?;
        }
        // Raw puts and typed writes do not mix: a raw key in a typed
        // container would break its layout.
        let schema = if typed {
            Some(self.schema(container).map_err(|e| all_fail(ops.len(), e))?)
        } else {
            None
        };
        let mut failures = Failures::new();
        let mut steps = Vec::with_capacity(ops.len());
        for (i, op) in ops.iter().enumerate() {
            let step = match op {
                BatchOp::Put { key, value, .. } if !typed => {
                    crate::asm::check_new_key(key).map(|()| Step::Put { key, value })
                }
                BatchOp::Put { .. } => Err(ApiError::new(
                    ErrorCode::InvalidWrite,
                    format!(
                        "{container} is a typed container; write it with create, update \
                         and delete, not put"
                    ),
                )),
                BatchOp::Create { object, id, .. } => schema
                    .as_ref()
                    .ok_or_else(internal)
                    .and_then(|schema| prepare_create(schema, object, id.as_deref()))
                    .map(|(id, object)| Step::Create { id, object }),
                BatchOp::Update { id, patch, .. } => Ok(Step::Update { id, patch }),
                BatchOp::Delete { id, mode, .. } => Ok(Step::Delete {
                    id,
                    hard: *mode == DeleteMode::Hard,
                }),
            };
            match step {
                Ok(s) => steps.push(Some(s)),
                Err(e) => {
                    failures.push((i, e));
                    steps.push(None);
                }
            }
        }
        let ids: Vec<Option<String>> = steps.iter().map(|s| s.as_ref().and_then(step_id)).collect();
        let schema = schema.as_ref();
        let fresh = match schema {
            Some(s) => !self.has_genesis(container, &s.layout),
            None => false,
        };
        if let Some(schema) = schema.filter(|_| fresh) {
            // A dry run on a scratch genesis, so that a failing batch does
            // not leave the container created.
            let mut scratch = Container::new(&[0; 16]);
            scratch
                .apply_changes(vec![doc::genesis_change(container, &schema.layout)])
                .map_err(|e| {
                    all_fail(ops.len(), ApiError::new(ErrorCode::Internal, e.to_string()))
                })?;
            let _ = scratch.transact(|tx| run_steps(tx, Some(schema), &steps, &mut failures));
            if !failures.is_empty() {
                failures.sort_by_key(|(i, _)| *i);
                return Err(failures);
            }
            self.ensure_container(container, &schema.layout, out)
                .map_err(|e| all_fail(ops.len(), e))?;
        }
        // Raw puts into a container that does not exist create it (a map).
        match self
            .session
            .local_transact(container, |tx| run_steps(tx, schema, &steps, &mut failures))
        {
            Ok(change) => {
                self.stage(container, change, out);
                Ok(ids)
            }
            Err(nuwa_sync::LocalEditError::Rejected(())) => {
                failures.sort_by_key(|(i, _)| *i);
                Err(failures)
            }
            Err(nuwa_sync::LocalEditError::Engine(e)) => Err(all_fail(ops.len(), engine_error(e))),
        }
    }

    /// One `state.create`, `state.update` or `state.delete`: a batch of one,
    /// answered with the object's id and the container's heads.
    pub(crate) fn tool_write(&mut self, op: BatchOp, out: &mut Out) -> Result<Value, ApiError> {
        let container = op.container().to_owned();
        let mode = match &op {
            BatchOp::Delete { mode, .. } => Some(*mode),
            _ => None,
        };
        match self.transact_ops(&container, &[&op], out) {
            Ok(ids) => {
                let mut reply = serde_json::json!({
                    "id": ids.into_iter().next().flatten(),
                    "heads": self.heads_hex(&container),
                });
                if let Some(mode) = mode {
                    reply["mode"] = Value::from(if mode == DeleteMode::Hard {
                        "hard"
                    } else {
                        "tombstone"
                    });
                }
                Ok(reply)
            }
            Err(failures) => Err(failures
                .into_iter()
                .next()
                .map(|(_, e)| e)
                .unwrap_or_else(internal)),
        }
    }
}

fn internal() -> ApiError {
    ApiError::new(ErrorCode::Internal, "a typed write without its schema")
}

fn engine_error(e: nuwa_sync::EngineError) -> ApiError {
    match e {
        nuwa_sync::EngineError::TooManyContainers(_) => {
            ApiError::new(ErrorCode::InvalidWrite, e.to_string())
        }
        nuwa_sync::EngineError::InvalidName(_) => {
            ApiError::new(ErrorCode::InvalidContainerName, e.to_string())
        }
        _ => ApiError::new(ErrorCode::Internal, e.to_string()),
    }
}
