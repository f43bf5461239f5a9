//! What the local API carries into the agent and back: request and reply
//! bodies, the `state.*` tools, and the error codes every refusal names.
//! The shell's HTTP server parses bodies into these types and answers with
//! the agent's replies; the CLI's client sends and reads the same types.
//! [`events`] and [`import`] hold what the CLI makes of the event stream
//! and of an import file.

pub mod events;
pub mod import;

use serde::{Deserialize, Serialize};
use serde_json::Value;

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PutBody {
    pub container: String,
    pub key: String,
    pub value: serde_json::Value,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PutReply {
    pub container: String,
    pub key: String,
    /// Hex change hashes of the container after the write.
    pub heads: Vec<String>,
    pub durable: bool,
}

#[derive(Debug, Deserialize)]
pub struct GetQuery {
    pub container: String,
    pub key: Option<String>,
    /// Typed containers: the stored document (tombstones, CRDT encodings)
    /// instead of the user's view.
    #[serde(default)]
    pub raw: bool,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RevokeBody {
    pub context_id: String,
}

/// `POST /v1/devices/promote` and `/v1/devices/demote`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeviceBody {
    pub context_id: String,
}

/// `POST /v1/did/recovery-key`: make this the agent's recovery key. The
/// words stay with the client: only the public key travels.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RecoveryKeyBody {
    /// Hex of the recovery key's 32-byte Ed25519 public key.
    pub public_key_hex: String,
}

/// A DID document change an admin device signs.
#[derive(Debug, Clone)]
pub enum AdminChange {
    Promote(DeviceBody),
    Demote(DeviceBody),
    RecoveryKey(RecoveryKeyBody),
}

/// The reply to an [`AdminChange`].
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct AdminReply {
    /// `promoted`, `demoted` or `recovery_key`.
    pub change: String,
    /// The device, or the new recovery key's id.
    pub subject: String,
    pub did_log_len: usize,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RevokeReply {
    pub revoked: String,
    /// The key epoch new writes are sealed under from now on.
    pub epoch: u64,
    pub did_log_len: usize,
    /// Context ids of the devices the new sync key was sealed to.
    pub remaining: Vec<String>,
}

/// `POST /v1/devices/provision`: a new device home written by the daemon,
/// so that its DID log and the daemon's never fork.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProvisionBody {
    /// The new home: an absolute path, absent or empty.
    pub out: String,
    pub name: String,
    /// The device expires this many seconds from now (`--expires`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expires_secs: Option<u64>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ProvisionReply {
    pub context_id: String,
    pub name: String,
    pub out: String,
    pub did_log_len: usize,
    /// When the device expires (RFC 3339), if it does.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expires: Option<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ApproveBody {
    pub code: String,
    #[serde(default)]
    pub name: Option<String>,
    /// Give up after this many seconds (default 60, at most 600).
    #[serde(default)]
    pub timeout_secs: Option<u64>,
    /// A recovery handover instead of an approval (`nuwa-node recover` on
    /// a fresh home shows the code): any device may do it; the keys it
    /// hands over open only with the recovery words.
    #[serde(default)]
    pub recovery: bool,
    /// The device expires this many seconds after it is added
    /// (`--expires`); the shorter of this and what the device asks wins.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expires_secs: Option<u64>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ApproveReply {
    pub context_id: String,
    pub name: String,
    pub peer_id: String,
    pub did_log_len: usize,
    /// When the device expires (RFC 3339), if it does.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expires: Option<String>,
    /// A recovery handover (`--recovery`): nothing was added; the device
    /// lists itself with the recovery words.
    #[serde(default)]
    pub handover: bool,
}

impl std::fmt::Display for ApproveReply {
    /// What `device approve` prints.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (ctx, name, peer) = (&self.context_id, &self.name, &self.peer_id);
        if self.handover {
            return write!(
                f,
                "handed over: device {ctx} (\"{name}\", peer {peer}) received the DID log and \
                 the keys sealed to the recovery key; it lists itself as admin with the recovery \
                 words and its peers learn it when it syncs"
            );
        }
        write!(
            f,
            "approved: device {ctx} (\"{name}\", peer {peer}) added; DID log now has {} updates",
            self.did_log_len
        )?;
        write_expiry(f, self.expires.as_deref())
    }
}

impl std::fmt::Display for ProvisionReply {
    /// What `device provision` prints.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "provisioned device {} in {}", self.context_id, self.out)?;
        write_expiry(f, self.expires.as_deref())?;
        write!(f, "\nnext: nuwa-node --home {} run", self.out)
    }
}

impl std::fmt::Display for RevokeReply {
    /// What `device revoke` prints.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "revoked {}: new writes are sealed under key epoch {}, shared with {} device(s): {}",
            self.revoked,
            self.epoch,
            self.remaining.len(),
            self.remaining.join(", ")
        )
    }
}

impl std::fmt::Display for AdminReply {
    /// What `device promote` and `device demote` print.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.change.as_str() {
            "promoted" => write!(
                f,
                "{} is an admin now: it can approve, provision, promote, demote and revoke devices",
                self.subject
            ),
            "demoted" => write!(f, "{} is no longer an admin", self.subject),
            other => write!(f, "{}: {other}", self.subject),
        }
    }
}

fn write_expiry(f: &mut std::fmt::Formatter<'_>, expires: Option<&str>) -> std::fmt::Result {
    match expires {
        Some(at) => write!(
            f,
            "\nit expires at {at}: then its peers and keepers refuse it, with no revocation, \
             and an admin's running daemon removes it from the DID document"
        ),
        None => Ok(()),
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CreateBody {
    pub schema_uri: String,
    pub object: serde_json::Value,
    #[serde(default)]
    pub id: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UpdateBody {
    pub schema_uri: String,
    pub id: String,
    pub patch: serde_json::Value,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct QueryBody {
    pub query: serde_json::Value,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeleteBody {
    pub schema_uri: String,
    pub id: String,
    #[serde(default)]
    pub mode: DeleteMode,
}

/// Most operations in one `POST /v1/state.batch`.
pub const MAX_BATCH_OPS: usize = 100_000;

/// Most JSON values (each scalar, array and object, as [`json_values`]
/// counts them) in the body of one writing request: `state/put`,
/// `state.batch`, `state.create`, `state.update`. Each becomes Automerge
/// operations on the daemon loop, at about 6.5 µs per map member (a run
/// of scalars in an array goes in as one splice, about 0.75 µs each), so
/// this keeps one write's hold on the loop under 50 ms; and the body is refused before
/// it is parsed, so a huge array never becomes a huge tree in memory
/// (issue 25: one 4,000,000-number put took 915 MB and held the loop
/// 28 s). Store a big numeric array as a string (base64 of its bytes), or
/// across keys.
pub const MAX_WRITE_VALUES: usize = 6_000;

/// How many JSON values `body` holds, counted without parsing it: each
/// `[`, `{` and `,` outside strings (an array of n scalars counts n, an
/// object of k members k). Linear, no allocation; a malformed body gets a
/// count all the same and fails when parsed.
pub fn json_values(body: &[u8]) -> usize {
    let (mut n, mut in_string, mut escaped) = (0usize, false, false);
    for &b in body {
        if in_string {
            match b {
                _ if escaped => escaped = false,
                b'\\' => escaped = true,
                b'"' => in_string = false,
                _ => {}
            }
        } else {
            match b {
                b'"' => in_string = true,
                b'[' | b'{' | b',' => n += 1,
                _ => {}
            }
        }
    }
    n
}

/// Refuses a writing request's body over [`MAX_WRITE_VALUES`].
pub fn check_write_values(body: &[u8]) -> Result<(), ApiError> {
    let n = json_values(body);
    if n > MAX_WRITE_VALUES {
        return Err(ApiError::new(
            ErrorCode::ValueTooLarge,
            format!(
                "the request holds about {n} JSON values; one write takes at most \
                 {MAX_WRITE_VALUES}. Split it across keys or batches, or store a big numeric \
                 array as one string (base64 of its bytes)"
            ),
        ));
    }
    Ok(())
}

/// `POST /v1/state.batch`: operations applied as one transaction per
/// container, all or nothing per container.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BatchBody {
    pub ops: Vec<BatchOp>,
}

/// One operation of a batch: a raw put, or a `state.*` write.
#[derive(Debug, Clone, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case", deny_unknown_fields)]
pub enum BatchOp {
    Put {
        container: String,
        key: String,
        value: serde_json::Value,
    },
    Create {
        schema_uri: String,
        object: serde_json::Value,
        #[serde(default)]
        id: Option<String>,
    },
    Update {
        schema_uri: String,
        id: String,
        patch: serde_json::Value,
    },
    Delete {
        schema_uri: String,
        id: String,
        #[serde(default)]
        mode: DeleteMode,
    },
}

impl BatchOp {
    /// The container the operation writes.
    pub fn container(&self) -> &str {
        match self {
            BatchOp::Put { container, .. } => container,
            BatchOp::Create { schema_uri, .. }
            | BatchOp::Update { schema_uri, .. }
            | BatchOp::Delete { schema_uri, .. } => schema_uri,
        }
    }
}

/// The outcome of one operation of a batch.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct BatchOpResult {
    pub ok: bool,
    /// The object's id, for `create`, `update` and `delete`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<ApiError>,
}

/// What a batch did to one container.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct BatchContainer {
    pub container: String,
    pub ops: usize,
    /// Every operation on it applied (one change), or none.
    pub ok: bool,
    /// Hex heads after the batch (unchanged when `ok` is false).
    pub heads: Vec<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct BatchReply {
    /// Every operation applied.
    pub ok: bool,
    pub applied: usize,
    pub failed: usize,
    pub containers: Vec<BatchContainer>,
    /// One per operation, in request order.
    pub results: Vec<BatchOpResult>,
    /// The applied changes were on disk before this reply was sent.
    pub durable: bool,
}

#[derive(Debug, Default, Deserialize, Clone, Copy, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum DeleteMode {
    #[default]
    Tombstone,
    Hard,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ContainerBody {
    pub container: String,
}

/// Every error code the API answers with. The wire form is the snake_case
/// name; the HTTP status follows from the code.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum ErrorCode {
    /// 400: the body is not the JSON this endpoint takes.
    BadRequest,
    /// 401: missing or wrong bearer token.
    Unauthorised,
    /// 401: an app's signed request whose capability or signature does
    /// not hold (the message names the precise reason).
    CapabilityRefused,
    /// 403: an app's capability does not reach this container or route.
    Forbidden,
    /// 421: the Host header does not name this daemon (DNS rebinding).
    BadHost,
    /// 403: a cross-origin request (its Origin is not this daemon's).
    BadOrigin,
    /// 403: a login link that was used, expired or never made.
    BadLoginLink,
    /// 404: no such endpoint.
    NotFound,
    /// 405: the endpoint exists but not for this HTTP method.
    MethodNotAllowed,
    /// 400: an empty container name, one over 256 bytes, or one with a control character.
    InvalidContainerName,
    /// 404: no container of that name on this device.
    NoSuchContainer,
    /// 404: the container has no such key.
    NoSuchKey,
    /// 404: no schema with that `$id` is registered.
    UnknownSchema,
    /// 404: no live object with that id.
    NoSuchObject,
    /// 409: `state.create` with an id already in use.
    ObjectExists,
    /// 409: the edit breaks the field's CRDT policy.
    CrdtPolicy,
    /// 422: the object fails its schema.
    InvalidObject,
    /// 400: a malformed ASM-QL query.
    InvalidQuery,
    /// 400: a schema that is not valid JSON Schema 2020-12 with `x-asm`, or breaks the registry rules.
    InvalidSchema,
    /// 400: a malformed patch, or one that changes the id.
    InvalidEdit,
    /// 400: a value the container cannot store (bad key, too deep, bad number).
    InvalidWrite,
    /// 409: an untyped write (put, batch put, import) into a typed or a
    /// reserved container.
    TypedContainer,
    /// 413: an object over 32 MiB.
    ObjectTooLarge,
    /// 413: a write of more JSON values than one write takes
    /// ([`MAX_WRITE_VALUES`]).
    ValueTooLarge,
    /// 413: a request body over the API limit.
    BodyTooLarge,
    /// 422: the query scanned too much or ran over its budget.
    QueryTooExpensive,
    /// 409: the container holds another kind of state.
    ContainerConflict,
    /// 409: in a batch, not applied because another operation on the same container failed.
    BatchAborted,
    /// 400: this device cannot be revoked (it is this one, or unknown).
    CannotRevoke,
    /// 400: a promotion, demotion or recovery-key change that does not apply.
    CannotChangeDevices,
    /// 403: only an admin device (one holding a `capabilityDelegation` key) can do this.
    NotKeyManager,
    /// 403: this device was revoked: it writes nothing that would sync.
    DeviceRevoked,
    /// 400: a device name that is empty or too long.
    BadName,
    /// 409: pairing needs mDNS, which is off.
    NoDiscovery,
    /// 409: another pairing is in progress.
    Busy,
    /// 409: the pairing did not complete.
    PairingFailed,
    /// 409: the pairing code does not match.
    WrongCode,
    /// 409: the pairing code expired.
    CodeExpired,
    /// 409: the pairing code was used up by failed attempts.
    CodeBurned,
    /// 429: too many pairing attempts; wait.
    RateLimited,
    /// 400: a pairing code that is not of the form ABCD-EFGH.
    BadCode,
    /// 408: the operation did not finish in time.
    Timeout,
    /// 500: a bug or an unexpected failure; the message says which.
    Internal,
    /// 500: the write could not be made durable (the daemon stops).
    StorageFailed,
    /// 503: the daemon is shutting down.
    ShuttingDown,
}

impl ErrorCode {
    /// Every code, in the order docs/api.md lists them.
    #[cfg_attr(not(test), allow(dead_code))]
    pub const ALL: &'static [ErrorCode] = &[
        ErrorCode::BadRequest,
        ErrorCode::Unauthorised,
        ErrorCode::CapabilityRefused,
        ErrorCode::Forbidden,
        ErrorCode::BadHost,
        ErrorCode::BadOrigin,
        ErrorCode::BadLoginLink,
        ErrorCode::NotFound,
        ErrorCode::MethodNotAllowed,
        ErrorCode::InvalidContainerName,
        ErrorCode::NoSuchContainer,
        ErrorCode::NoSuchKey,
        ErrorCode::UnknownSchema,
        ErrorCode::NoSuchObject,
        ErrorCode::ObjectExists,
        ErrorCode::CrdtPolicy,
        ErrorCode::InvalidObject,
        ErrorCode::InvalidQuery,
        ErrorCode::InvalidSchema,
        ErrorCode::InvalidEdit,
        ErrorCode::InvalidWrite,
        ErrorCode::TypedContainer,
        ErrorCode::ObjectTooLarge,
        ErrorCode::ValueTooLarge,
        ErrorCode::BodyTooLarge,
        ErrorCode::QueryTooExpensive,
        ErrorCode::ContainerConflict,
        ErrorCode::BatchAborted,
        ErrorCode::CannotRevoke,
        ErrorCode::CannotChangeDevices,
        ErrorCode::NotKeyManager,
        ErrorCode::DeviceRevoked,
        ErrorCode::BadName,
        ErrorCode::NoDiscovery,
        ErrorCode::Busy,
        ErrorCode::PairingFailed,
        ErrorCode::WrongCode,
        ErrorCode::CodeExpired,
        ErrorCode::CodeBurned,
        ErrorCode::RateLimited,
        ErrorCode::BadCode,
        ErrorCode::Timeout,
        ErrorCode::Internal,
        ErrorCode::StorageFailed,
        ErrorCode::ShuttingDown,
    ];

    /// The HTTP status this code is answered with.
    pub fn status(self) -> u16 {
        match self {
            ErrorCode::BadRequest => 400,
            ErrorCode::Unauthorised => 401,
            ErrorCode::CapabilityRefused => 401,
            ErrorCode::Forbidden => 403,
            ErrorCode::BadHost => 421,
            ErrorCode::BadOrigin => 403,
            ErrorCode::BadLoginLink => 403,
            ErrorCode::NotFound => 404,
            ErrorCode::MethodNotAllowed => 405,
            ErrorCode::InvalidContainerName => 400,
            ErrorCode::NoSuchContainer => 404,
            ErrorCode::NoSuchKey => 404,
            ErrorCode::UnknownSchema => 404,
            ErrorCode::NoSuchObject => 404,
            ErrorCode::ObjectExists => 409,
            ErrorCode::CrdtPolicy => 409,
            ErrorCode::InvalidObject => 422,
            ErrorCode::InvalidQuery => 400,
            ErrorCode::InvalidSchema => 400,
            ErrorCode::InvalidEdit => 400,
            ErrorCode::InvalidWrite => 400,
            ErrorCode::TypedContainer => 409,
            ErrorCode::ObjectTooLarge => 413,
            ErrorCode::ValueTooLarge => 413,
            ErrorCode::BodyTooLarge => 413,
            ErrorCode::QueryTooExpensive => 422,
            ErrorCode::ContainerConflict => 409,
            ErrorCode::BatchAborted => 409,
            ErrorCode::CannotRevoke => 400,
            ErrorCode::CannotChangeDevices => 400,
            ErrorCode::NotKeyManager => 403,
            ErrorCode::DeviceRevoked => 403,
            ErrorCode::BadName => 400,
            ErrorCode::NoDiscovery => 409,
            ErrorCode::Busy => 409,
            ErrorCode::PairingFailed => 409,
            ErrorCode::WrongCode => 409,
            ErrorCode::CodeExpired => 409,
            ErrorCode::CodeBurned => 409,
            ErrorCode::RateLimited => 429,
            ErrorCode::BadCode => 400,
            ErrorCode::Timeout => 408,
            ErrorCode::Internal => 500,
            ErrorCode::StorageFailed => 500,
            ErrorCode::ShuttingDown => 503,
        }
    }

    /// The wire name (`"no_such_key"`).
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorCode::BadRequest => "bad_request",
            ErrorCode::Unauthorised => "unauthorised",
            ErrorCode::CapabilityRefused => "capability_refused",
            ErrorCode::Forbidden => "forbidden",
            ErrorCode::BadHost => "bad_host",
            ErrorCode::BadOrigin => "bad_origin",
            ErrorCode::BadLoginLink => "bad_login_link",
            ErrorCode::NotFound => "not_found",
            ErrorCode::MethodNotAllowed => "method_not_allowed",
            ErrorCode::InvalidContainerName => "invalid_container_name",
            ErrorCode::NoSuchContainer => "no_such_container",
            ErrorCode::NoSuchKey => "no_such_key",
            ErrorCode::UnknownSchema => "unknown_schema",
            ErrorCode::NoSuchObject => "no_such_object",
            ErrorCode::ObjectExists => "object_exists",
            ErrorCode::CrdtPolicy => "crdt_policy",
            ErrorCode::InvalidObject => "invalid_object",
            ErrorCode::InvalidQuery => "invalid_query",
            ErrorCode::InvalidSchema => "invalid_schema",
            ErrorCode::InvalidEdit => "invalid_edit",
            ErrorCode::InvalidWrite => "invalid_write",
            ErrorCode::TypedContainer => "typed_container",
            ErrorCode::ObjectTooLarge => "object_too_large",
            ErrorCode::ValueTooLarge => "value_too_large",
            ErrorCode::BodyTooLarge => "body_too_large",
            ErrorCode::QueryTooExpensive => "query_too_expensive",
            ErrorCode::ContainerConflict => "container_conflict",
            ErrorCode::BatchAborted => "batch_aborted",
            ErrorCode::CannotRevoke => "cannot_revoke",
            ErrorCode::CannotChangeDevices => "cannot_change_devices",
            ErrorCode::NotKeyManager => "not_key_manager",
            ErrorCode::DeviceRevoked => "device_revoked",
            ErrorCode::BadName => "bad_name",
            ErrorCode::NoDiscovery => "no_discovery",
            ErrorCode::Busy => "busy",
            ErrorCode::PairingFailed => "pairing_failed",
            ErrorCode::WrongCode => "wrong_code",
            ErrorCode::CodeExpired => "code_expired",
            ErrorCode::CodeBurned => "code_burned",
            ErrorCode::RateLimited => "rate_limited",
            ErrorCode::BadCode => "bad_code",
            ErrorCode::Timeout => "timeout",
            ErrorCode::Internal => "internal",
            ErrorCode::StorageFailed => "storage_failed",
            ErrorCode::ShuttingDown => "shutting_down",
        }
    }
}

impl std::fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// An API error: a stable code and a message for people; for an app's
/// refused request also the precise reason (docs/api.md, "Apps").
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ApiError {
    pub code: ErrorCode,
    pub message: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

impl ApiError {
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        ApiError {
            code,
            message: message.into(),
            reason: None,
        }
    }

    pub fn status(&self) -> u16 {
        self.code.status()
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.code, self.message)
    }
}

impl std::error::Error for ApiError {}

/// A `state.*` tool call or control-plane operation.
#[derive(Debug)]
pub enum Tool {
    SchemaAdd(Value),
    SchemaList,
    Create {
        schema_uri: String,
        object: Value,
        id: Option<String>,
    },
    Update {
        schema_uri: String,
        id: String,
        patch: Value,
    },
    Query(Value),
    Delete {
        schema_uri: String,
        id: String,
        hard: bool,
    },
    Describe(String),
    Compact(String),
    Reset(String),
}

impl Tool {
    /// Whether the tool writes state that syncs (refused on a revoked
    /// device).
    pub fn writes(&self) -> bool {
        match self {
            Tool::SchemaAdd(_)
            | Tool::Create { .. }
            | Tool::Update { .. }
            | Tool::Delete { .. }
            | Tool::Reset(_) => true,
            Tool::SchemaList | Tool::Query(_) | Tool::Describe(_) | Tool::Compact(_) => false,
        }
    }
}

/// A request of the local API that the agent decides. (Reads and exports
/// go to the shell's reader, off the agent's loop.)
#[derive(Debug)]
pub enum Request {
    Status,
    Devices,
    Put(PutBody),
    Revoke(RevokeBody),
    Admin(AdminChange),
    Approve(ApproveBody),
    /// `device provision`: the shell made the new home's directory and its
    /// device key; the agent lists the key and asks the shell to write the
    /// home.
    Provision {
        body: ProvisionBody,
        device: nuwa_identity::keys::DeviceKey,
    },
    Tool(Tool),
    Batch(BatchBody),
    /// `app grant`: a capability for an app's key.
    AppGrant(crate::apps::GrantBody),
    /// `app revoke`.
    AppRevoke(crate::apps::RevokeAppBody),
    /// `app list`.
    AppList,
}

impl Request {
    /// Whether it writes state that syncs (refused on a revoked device).
    pub fn writes(&self) -> bool {
        match self {
            Request::Put(_) | Request::Batch(_) | Request::AppGrant(_) | Request::AppRevoke(_) => {
                true
            }
            Request::Tool(t) => t.writes(),
            _ => false,
        }
    }
}

/// The agent's answer to a [`Request`].
#[derive(Debug)]
pub enum Reply {
    Status(Box<crate::status::Status>),
    Devices(Vec<crate::devices::DeviceEntry>),
    Put(PutReply),
    Revoke(RevokeReply),
    Approve(ApproveReply),
    Value(Value),
    Batch(BatchReply),
}

/// A reply that waits for the rest of its batch, to carry the heads as
/// they are once every write of the batch is in.
pub(crate) enum Pending {
    Put { container: String, key: String },
    Batch(BatchReply),
    Ready(Reply),
}

impl Pending {
    pub(crate) fn finish(self, heads: impl Fn(&str) -> Vec<String>) -> Reply {
        match self {
            Pending::Put { container, key } => Reply::Put(PutReply {
                heads: heads(&container),
                container,
                key,
                durable: true,
            }),
            Pending::Batch(mut r) => {
                for c in &mut r.containers {
                    c.heads = heads(&c.container);
                }
                Reply::Batch(r)
            }
            Pending::Ready(r) => r,
        }
    }
}

impl ProvisionBody {
    /// The checks that need nothing but the body: the shell runs them
    /// before it makes the new home's directory.
    pub fn check(&self) -> Result<(), ApiError> {
        if !std::path::Path::new(&self.out).is_absolute() {
            return Err(ApiError::new(
                ErrorCode::BadRequest,
                "`out` must be an absolute path",
            ));
        }
        // No name is allowed, as offline (see `on_provision`).
        if self.name.trim().len() > nuwa_proto::MAX_DEVICE_NAME_BYTES {
            return Err(ApiError::new(
                ErrorCode::BadName,
                "a device name is at most 64 bytes",
            ));
        }
        Ok(())
    }
}

/// One durable change batch of a container, for `/v1/state.events`.
#[derive(Debug, Clone, Serialize)]
pub struct ChangeEvent {
    pub container: String,
    /// Changes in the batch.
    pub changes: usize,
    /// Hex heads after the batch.
    pub heads: Vec<String>,
    /// `local` (this device's API) or `peer` (synced in).
    pub origin: &'static str,
    pub at_unix_ms: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    // Goal: docs/api.md's error table lists every code with the status the
    // API answers it with, and nothing else: the enum and the docs cannot
    // drift apart.
    #[test]
    fn the_error_table_in_the_docs_matches_the_codes() {
        let doc = include_str!("../../../docs/api.md");
        let rows: Vec<(String, u16)> = doc
            .lines()
            .filter_map(|l| {
                let cells: Vec<&str> = l.split('|').map(str::trim).collect();
                let code = cells.get(1)?.strip_prefix('`')?.strip_suffix('`')?;
                let status = cells.get(2)?.parse().ok()?;
                Some((code.to_owned(), status))
            })
            .collect();
        let want: Vec<(String, u16)> = ErrorCode::ALL
            .iter()
            .map(|c| (c.as_str().to_owned(), c.status()))
            .collect();
        assert_eq!(rows, want);
        for c in ErrorCode::ALL {
            let wire = serde_json::to_value(c).unwrap();
            assert_eq!(wire, serde_json::json!(c.as_str()));
        }
    }
}

#[cfg(test)]
mod write_values_tests {
    use super::*;

    // Goal: the pre-parse count of JSON values matches what the body
    // holds, ignores brackets and commas inside strings (escaped quotes
    // too), and refuses past the limit. Method: bodies of known shape.
    #[test]
    fn json_values_counts_without_parsing() {
        let arr = |n: usize| {
            let items: Vec<String> = (0..n).map(|i| i.to_string()).collect();
            format!(
                "{{\"container\":\"c\",\"key\":\"k\",\"value\":[{}]}}",
                items.join(",")
            )
        };
        // The object (3 members) and the array of n.
        assert_eq!(json_values(arr(5).as_bytes()), 3 + 5);
        assert_eq!(json_values(br#"{"k":"a,[{b\",c"}"#), 1);
        assert_eq!(json_values(b"1"), 0);
        assert!(check_write_values(arr(MAX_WRITE_VALUES - 3).as_bytes()).is_ok());
        let e = check_write_values(arr(MAX_WRITE_VALUES).as_bytes()).unwrap_err();
        assert_eq!(e.code, ErrorCode::ValueTooLarge);
    }
}
