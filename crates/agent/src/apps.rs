//! The agent's apps (NIP-8 `x-visibility`, "enforced via capability
//! tokens (ZCAP-LD)"): the capabilities this device issues, their
//! revocations, and the access view the shell checks every app request
//! against.
//!
//! - **Grant.** `app grant` asks the agent for a capability for an app's
//!   key (a did:key): the target (a namespace prefix such as
//!   `did:nuwa:cap:weather:` or one container), the actions and an
//!   expiry. Only an admin signs one ([`nuwa_caps::delegate`] with the
//!   admin key); the capability is recorded in [`APPS_CONTAINER`] so that
//!   `app list` shows it on every device.
//! - **Revoke.** `app revoke ID` records the id as revoked in the same
//!   container, which syncs like any state: an app revoked on the laptop
//!   is refused on the phone once the change arrives. Any device of the
//!   agent may revoke (it only takes rights away), and any id may be
//!   revoked, also one an app delegated on (which no device issued).
//!   Revoking a capability refuses every capability below it in a chain.
//! - **The access view.** What the shell needs to verify an invocation
//!   and decide a request ([`AccessView`]): the admin keys of the current
//!   DID document (a chain must start at one), the revoked ids, and each
//!   registered schema's visibility. The agent hands a new view to the
//!   shell ([`crate::Effect::Access`]) whenever one of the three changes.
//!
//! [`APPS_CONTAINER`] is a reserved `nuwa:` container: untyped writes
//! never reach it (see [`crate::asm::check_untyped_write`]).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use nuwa_caps::{Action, Capability, Visibility};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};
use tracing::info;

use crate::agent::{Agent, Out};
use crate::api::{ApiError, ErrorCode};
use crate::effect::Effect;

/// The replicated map of capabilities issued (`grant:<id>`, the
/// capability's JSON) and revoked (`revoked:<id>`).
pub const APPS_CONTAINER: &str = "nuwa:apps";

const GRANT_PREFIX: &str = "grant:";
const REVOKED_PREFIX: &str = "revoked:";

/// The default life of a capability `app grant` issues: 30 days.
pub const DEFAULT_GRANT_SECS: u64 = 30 * 86_400;
/// The longest: a year. An app that runs longer gets a new one.
pub const MAX_GRANT_SECS: u64 = 366 * 86_400;

/// `POST /v1/apps/grant`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GrantBody {
    /// The app's key, as a did:key.
    pub to: String,
    /// A namespace prefix ending in `:`, or one container's name.
    pub target: String,
    /// Some of read, query, events, write, delete, reset, schema.
    pub actions: Vec<String>,
    /// Seconds from now; [`DEFAULT_GRANT_SECS`] when absent.
    #[serde(default)]
    pub expires_secs: Option<u64>,
}

/// `POST /v1/apps/revoke`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RevokeAppBody {
    pub id: String,
}

/// What `app list` shows of one capability.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct AppEntry {
    pub id: String,
    /// The app's did:key.
    pub to: String,
    pub target: String,
    pub actions: Vec<String>,
    /// RFC 3339.
    pub expires: String,
    pub revoked: bool,
}

/// What the shell checks app requests against (see the module docs).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AccessView {
    admins: BTreeSet<[u8; 32]>,
    revoked: BTreeSet<String>,
    visibility: BTreeMap<String, Visibility>,
    /// The apps container could not be read: every app is refused.
    pub unavailable: bool,
}

impl AccessView {
    /// Whether `key` is an admin key of the agent now (a chain of
    /// capabilities must start at one).
    pub fn is_admin(&self, key: &[u8; 32]) -> bool {
        self.admins.contains(key)
    }

    pub fn is_revoked(&self, id: &str) -> bool {
        self.revoked.contains(id)
    }

    /// A container's visibility: its schema's `x-visibility`; an untyped
    /// container (no schema) is private.
    pub fn visibility_of(&self, container: &str) -> Visibility {
        self.visibility
            .get(container)
            .copied()
            .unwrap_or(Visibility::Private)
    }

    /// Every revoked id (for `app list`).
    pub fn revoked(&self) -> &BTreeSet<String> {
        &self.revoked
    }
}

/// The agent's record of the last view handed to the shell, and of what
/// it was made from (so that a handle in which nothing it depends on
/// changed costs one comparison).
#[derive(Default)]
pub(crate) struct Apps {
    last: Option<Arc<AccessView>>,
    made_from: Option<Inputs>,
}

/// What a view depends on: the DID chain's head, the apps container's
/// heads, the registry's, and the time in steps of [`ADMIN_EXPIRY_STEP_MS`]
/// (an admin key may expire).
#[derive(PartialEq, Eq)]
struct Inputs {
    chain_head: String,
    apps_heads: Vec<[u8; 32]>,
    registry_heads: Vec<[u8; 32]>,
    time_step: u64,
}

/// How often a view is made again with nothing else changed (an admin
/// key's expiry takes effect within this).
const ADMIN_EXPIRY_STEP_MS: u64 = 10_000;

fn visibility_of(v: nuwa_asm::model::Visibility) -> Visibility {
    match v {
        nuwa_asm::model::Visibility::Private => Visibility::Private,
        nuwa_asm::model::Visibility::Shared => Visibility::Shared,
        nuwa_asm::model::Visibility::Public => Visibility::Public,
    }
}

fn rfc3339(secs: i64) -> String {
    time::OffsetDateTime::from_unix_timestamp(secs)
        .ok()
        .and_then(|t| {
            t.format(&time::format_description::well_known::Rfc3339)
                .ok()
        })
        .unwrap_or_default()
}

/// A capability id as `app revoke` takes it.
fn check_id(id: &str) -> Result<(), ApiError> {
    let ok = id.len() <= 64
        && id.strip_prefix("urn:uuid:").is_some_and(|u| {
            !u.is_empty() && u.bytes().all(|b| b.is_ascii_hexdigit() || b == b'-')
        });
    if ok {
        Ok(())
    } else {
        Err(ApiError::new(
            ErrorCode::BadRequest,
            format!("{id:?} is not a capability id (urn:uuid:…); see `nuwa-node app list`"),
        ))
    }
}

impl Agent {
    /// The access view as the state is now.
    pub(crate) fn access_view(&self, now_ms: u64) -> AccessView {
        let now_secs = (now_ms / 1000) as i64;
        let doc = self.session.log().current();
        let admins = doc
            .verification_method
            .iter()
            .filter(|m| {
                doc.has_relationship(
                    &m.id,
                    nuwa_identity::document::Relationship::CapabilityDelegation,
                ) && doc.key_status(&m.id, now_secs) == nuwa_identity::document::KeyStatus::Active
            })
            .filter_map(|m| m.ed25519_public().ok())
            .collect();
        let revoked = match self.session.engine().container(APPS_CONTAINER) {
            Some(c) => match c.to_json() {
                Value::Object(m) => m
                    .keys()
                    .filter_map(|k| k.strip_prefix(REVOKED_PREFIX))
                    .map(str::to_owned)
                    .collect(),
                _ => BTreeSet::new(),
            },
            None => BTreeSet::new(),
        };
        let visibility = self
            .asm
            .registry
            .list()
            .map(|s| (s.id.full.clone(), visibility_of(s.visibility)))
            .collect();
        AccessView {
            admins,
            revoked,
            visibility,
            unavailable: false,
        }
    }

    /// Hands the shell a new access view when it changed (at the end of
    /// every handle). The apps container stays in memory (see
    /// `report.rs`); one that cannot load makes a view that refuses every
    /// app (`unavailable`), never one that forgot its revocations.
    pub(crate) fn refresh_access(&mut self, now_ms: u64, out: &mut Out) {
        let loaded = self.session.ensure_loaded(APPS_CONTAINER);
        let inputs = Inputs {
            chain_head: self.session.log().head_hash().to_owned(),
            apps_heads: self
                .session
                .engine()
                .heads_of(APPS_CONTAINER)
                .unwrap_or_default(),
            registry_heads: self.asm.registry_heads.clone(),
            time_step: now_ms / ADMIN_EXPIRY_STEP_MS,
        };
        if loaded.is_ok() && self.apps.made_from.as_ref() == Some(&inputs) {
            return;
        }
        let mut view = self.access_view(now_ms);
        if let Err(e) = loaded {
            tracing::warn!(error = %e, "cannot load the apps container; refusing every app until it loads");
            view.unavailable = true;
        }
        self.apps.made_from = Some(inputs);
        if self.apps.last.as_deref() == Some(&view) {
            return;
        }
        let view = Arc::new(view);
        self.apps.last = Some(view.clone());
        out.push(Effect::Access(view));
    }

    /// `app grant`: a capability for an app's key, signed by this device's
    /// admin key and recorded for `app list`.
    pub(crate) fn on_app_grant(
        &mut self,
        body: GrantBody,
        now_ms: u64,
        out: &mut Out,
    ) -> Result<Value, ApiError> {
        let now_secs = (now_ms / 1000) as i64;
        let secs = body.expires_secs.unwrap_or(DEFAULT_GRANT_SECS);
        if secs == 0 || secs > MAX_GRANT_SECS {
            return Err(ApiError::new(
                ErrorCode::BadRequest,
                format!("a capability lasts 1 s to {MAX_GRANT_SECS} s (366 days); asked {secs} s"),
            ));
        }
        let mut actions = Vec::with_capacity(body.actions.len());
        for a in &body.actions {
            actions.push(Action::parse(a).ok_or_else(|| {
                ApiError::new(
                    ErrorCode::BadRequest,
                    format!(
                        "unknown action {a:?}; the actions are read, query, events, write, \
                         delete, reset and schema"
                    ),
                )
            })?);
        }
        let admin = self.standing.admin(&self.session, now_secs)?;
        let id = format!("urn:uuid:{}", crate::asm::new_uuid());
        let cap = nuwa_caps::delegate(
            None,
            admin.key.signing_key(),
            &body.to,
            &body.target,
            &actions,
            now_secs + secs as i64,
            now_secs,
            id.clone(),
        )
        .map_err(|e| ApiError::new(ErrorCode::BadRequest, e.to_string()))?;
        let text = String::from_utf8_lossy(&cap.to_json()).into_owned();
        self.app_record(&format!("{GRANT_PREFIX}{id}"), &Value::String(text), out)?;
        info!(id = %id, to = %body.to, target = %body.target, "granted an app capability");
        let cap_json: Value = serde_json::from_slice(&cap.to_json())
            .map_err(|e| ApiError::new(ErrorCode::Internal, e.to_string()))?;
        Ok(json!({ "id": id, "capability": cap_json }))
    }

    /// `app revoke`: records the id as revoked (syncs to every device).
    pub(crate) fn on_app_revoke(
        &mut self,
        body: RevokeAppBody,
        now_ms: u64,
        out: &mut Out,
    ) -> Result<Value, ApiError> {
        check_id(&body.id)?;
        let by = self.session.membership().context_id().to_owned();
        let record = json!({ "at_ms": now_ms, "by": by });
        self.app_record(&format!("{REVOKED_PREFIX}{}", body.id), &record, out)?;
        info!(id = %body.id, "revoked an app capability");
        Ok(json!({ "id": body.id, "revoked": true }))
    }

    /// The access view as the state is now (what the shell was last sent,
    /// or will be at the end of the next handle).
    pub fn access(&self, now_ms: u64) -> AccessView {
        self.access_view(now_ms)
    }

    /// `app list`: every capability issued on any device, and whether it
    /// was revoked.
    pub fn app_list(&self) -> Vec<AppEntry> {
        let Some(c) = self.session.engine().container(APPS_CONTAINER) else {
            return Vec::new();
        };
        let Value::Object(m) = c.to_json() else {
            return Vec::new();
        };
        m.iter()
            .filter_map(|(k, v)| {
                let id = k.strip_prefix(GRANT_PREFIX)?;
                let cap = Capability::from_json(v.as_str()?.as_bytes()).ok()?;
                Some(AppEntry {
                    id: id.to_owned(),
                    to: cap.controller().to_owned(),
                    target: cap.target().to_owned(),
                    actions: cap
                        .actions()
                        .iter()
                        .map(|a| a.as_str().to_owned())
                        .collect(),
                    expires: rfc3339(cap.expires_unix_secs()),
                    revoked: m.contains_key(&format!("{REVOKED_PREFIX}{id}")),
                })
            })
            .collect()
    }

    /// One record of [`APPS_CONTAINER`], durable before the reply.
    fn app_record(&mut self, key: &str, value: &Value, out: &mut Out) -> Result<(), ApiError> {
        let _ = self.session.ensure_loaded(APPS_CONTAINER);
        let change = self
            .session
            .local_put(APPS_CONTAINER, key, value)
            .map_err(|e| ApiError::new(ErrorCode::Internal, e.to_string()))?;
        self.stage(APPS_CONTAINER, change, out);
        Ok(())
    }
}

// ---- the decisions on an app's request ------------------------------------

/// Why an app's request was refused: the error it gets, and the precise
/// reason it is counted under (`nuwa_api_errors_total{code=REASON}`).
#[derive(Debug, Clone)]
pub struct AppRefusal {
    pub error: ApiError,
    pub reason: &'static str,
}

impl AppRefusal {
    /// The error carries its reason too: an honest app learns why, and the
    /// reason names only what the app itself sent or holds.
    fn new(code: ErrorCode, message: String, reason: &'static str) -> AppRefusal {
        let mut error = ApiError::new(code, message);
        error.reason = Some(reason.to_owned());
        AppRefusal { error, reason }
    }

    fn capability(e: nuwa_caps::CapError) -> AppRefusal {
        let message = format!("{} ({})", e, e.code());
        AppRefusal::new(ErrorCode::CapabilityRefused, message, e.code())
    }

    fn refused(message: String, reason: &'static str) -> AppRefusal {
        AppRefusal::new(ErrorCode::CapabilityRefused, message, reason)
    }

    fn forbidden(message: String, reason: &'static str) -> AppRefusal {
        AppRefusal::new(ErrorCode::Forbidden, message, reason)
    }

    /// For the owner's routes (devices, status, apps, metrics ...).
    pub fn owner_only() -> AppRefusal {
        AppRefusal::forbidden(
            "this route is the owner's (the token or the local socket); an app's capability \
             reaches state routes only"
                .into(),
            "owner_only",
        )
    }
}

/// The headers of an invocation, each of which must come once.
pub const INVOCATION_HEADERS: [&str; 4] = [
    "capability-invocation",
    "content-digest",
    "signature-input",
    "signature",
];

/// Every check of an app's request that needs no body (see
/// [`nuwa_caps::verify_invocation_head`]), against `view`; and, since the
/// shell keeps nonces in memory only, a request created before the daemon
/// started (`started_unix_secs`), or up to
/// [`nuwa_caps::limits::MAX_REQUEST_FUTURE_SECS`] after, is refused: a
/// daemon before a restart may have served it (it accepts `created` that
/// far ahead of its clock), so for that first second or two every app
/// request is refused, and signed again. `count` is how often each
/// invocation header came.
pub fn check_head<'a, H>(
    view: &AccessView,
    req: &nuwa_caps::RequestParts<'a, H>,
    count: impl Fn(&str) -> usize,
    now_unix_secs: i64,
    started_unix_secs: i64,
) -> Result<nuwa_caps::VerifiedHead, AppRefusal>
where
    H: Fn(&str) -> Option<&'a str>,
{
    if view.unavailable {
        return Err(AppRefusal::forbidden(
            "the daemon cannot read the agent's app capabilities now; try again later".into(),
            "apps_unavailable",
        ));
    }
    if let Some(h) = INVOCATION_HEADERS.iter().find(|h| count(h) > 1) {
        return Err(AppRefusal::refused(
            format!("the {h} header came more than once; send it once (malformed_invocation)"),
            "malformed_invocation",
        ));
    }
    let head = nuwa_caps::verify_invocation_head(
        req,
        now_unix_secs,
        |k| view.is_admin(k),
        |id| view.is_revoked(id),
    )
    .map_err(AppRefusal::capability)?;
    let served_before_restart = started_unix_secs + nuwa_caps::limits::MAX_REQUEST_FUTURE_SECS;
    if head.created_unix_secs() <= served_before_restart {
        return Err(AppRefusal::refused(
            "the request was signed before the daemon started, or in its first second (it keeps \
             no nonces across a restart); sign it again in a moment (signed_before_start)"
                .into(),
            "signed_before_start",
        ));
    }
    Ok(head)
}

/// The body against the signed digest, then the nonce.
pub fn finish(
    head: nuwa_caps::VerifiedHead,
    body: &[u8],
    now_unix_secs: i64,
    nonces: &mut nuwa_caps::NonceCache,
) -> Result<nuwa_caps::Invocation, AppRefusal> {
    head.finish(body, now_unix_secs, nonces)
        .map_err(AppRefusal::capability)
}

/// Whether an app's verified invocation may do `action` to `container`:
/// the request must be signed for that very action, and the capability
/// must reach the container as its visibility requires
/// ([`nuwa_caps::may`]).
pub fn may(
    inv: &nuwa_caps::Invocation,
    view: &AccessView,
    action: Action,
    container: &str,
) -> Result<(), AppRefusal> {
    may_all(inv, view, &[(action, container)])
}

/// Whether an app's verified invocation may do every (action, container)
/// of `needs` (a batch: one per operation). A request is signed for one
/// action, and a batch needs one or several: it is signed for any one of
/// them, and then needs the capability to allow every one, on each
/// container as its visibility requires. So a capability holding `write`
/// and `delete` authorises a batch of puts and deletes, signed for either.
pub fn may_all(
    inv: &nuwa_caps::Invocation,
    view: &AccessView,
    needs: &[(Action, &str)],
) -> Result<(), AppRefusal> {
    let signed = inv.action;
    if !needs.iter().any(|(action, _)| *action == signed) {
        let names: BTreeSet<&str> = needs.iter().map(|(a, _)| a.as_str()).collect();
        let names = names.into_iter().collect::<Vec<_>>().join("\" or \"");
        return Err(AppRefusal::forbidden(
            format!(
                "the request was signed for {signed}, and this needs {names}: sign it with \
                 action=\"{names}\""
            ),
            "wrong_action",
        ));
    }
    for (action, container) in needs {
        nuwa_caps::may(
            &inv.verified,
            *action,
            container,
            view.visibility_of(container),
        )
        .map_err(|f| AppRefusal::forbidden(f.to_string(), f.code()))?;
    }
    Ok(())
}

/// Whether the capability still stands (for a long stream): not expired,
/// nothing in its chain revoked since.
pub fn still_valid(inv: &nuwa_caps::Invocation, view: &AccessView, now_unix_secs: i64) -> bool {
    let v = &inv.verified;
    now_unix_secs < v.expires_unix_secs
        && !view.unavailable
        && !v.chain_ids.iter().any(|id| view.is_revoked(id))
}

/// Whether an app may see `container`'s events now.
pub fn sees(
    inv: &nuwa_caps::Invocation,
    view: &AccessView,
    container: &str,
    now_unix_secs: i64,
) -> bool {
    still_valid(inv, view, now_unix_secs)
        && nuwa_caps::may(
            &inv.verified,
            Action::Events,
            container,
            view.visibility_of(container),
        )
        .is_ok()
}

/// What an app needs for a tool: the action, on which container (none for
/// the schema list, which is filtered instead).
pub fn tool_access(t: &crate::api::Tool) -> Option<(Action, &str)> {
    use crate::api::Tool;
    Some(match t {
        Tool::SchemaList => return None,
        Tool::SchemaAdd(raw) => (Action::Schema, raw["$id"].as_str().unwrap_or("")),
        Tool::Create { schema_uri, .. } | Tool::Update { schema_uri, .. } => {
            (Action::Write, schema_uri)
        }
        Tool::Delete { schema_uri, .. } => (Action::Delete, schema_uri),
        Tool::Query(q) => (Action::Query, q["from"].as_str().unwrap_or("")),
        Tool::Describe(c) => (Action::Read, c),
        Tool::Compact(c) => (Action::Write, c),
        Tool::Reset(c) => (Action::Reset, c),
    })
}

/// What an app needs for one operation of a batch.
pub fn batch_op_access(op: &crate::api::BatchOp) -> (Action, &str) {
    match op {
        crate::api::BatchOp::Delete { .. } => (Action::Delete, op.container()),
        _ => (Action::Write, op.container()),
    }
}
