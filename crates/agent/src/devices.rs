//! `nuwa-node device list`: every device the agent's DID log has ever listed,
//! with its relationships, its status (active, expired, revoked) and when
//! this device last saw it verified.
//!
//! Status comes from the DID log alone: a key in the current document is
//! active (or expired past its `expires` plus grace); a device key that an
//! earlier version listed and the current one does not was revoked. Names
//! and last-seen times are local knowledge, learned from peers' Hellos and
//! kept encrypted in the store ([`SEEN_META`]): the daemon records a peer
//! when it is verified and when it leaves, every peer still connected at
//! most once a minute ([`SEEN_SAVE_EVERY_MS`]) and at shutdown. Without a
//! daemon, `device list` reads that record ([`Seen::from_bytes`]) and says when it
//! was written.

use std::collections::BTreeMap;

use nuwa_identity::chain::DidChain;
use nuwa_identity::document::{DidDocument, KeyStatus, Relationship};
use serde::{Deserialize, Serialize};

pub const SEEN_META: &str = "devices_seen";
/// Devices remembered (far above any real agent's device count); also the
/// most a recovery handover's device book carries.
pub(crate) const MAX_SEEN: usize = 1024;
/// How often the daemon records the peers it is connected to as seen.
pub const SEEN_SAVE_EVERY_MS: u64 = 60_000;

/// One row of `device list --json`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct DeviceEntry {
    pub context_id: String,
    pub name: String,
    pub relationships: Vec<String>,
    /// `active`, `expired` or `revoked` (an expired device pruned from the
    /// document stays `expired`).
    pub status: String,
    /// When the device expires or expired (RFC 3339), if it was listed
    /// with an expiry (`--expires`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expires: Option<String>,
    /// Unix ms this device last saw it verified; `null` if never.
    pub last_seen_unix_ms: Option<u64>,
    /// Whether this row is the device running the command.
    pub this_device: bool,
    /// Set when no daemon answered: names and last-seen times come from
    /// the record the daemon last wrote, at this Unix ms (`null` if it
    /// never wrote one).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stored_as_of_unix_ms: Option<u64>,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
struct SeenEntry {
    name: String,
    last_seen_ms: u64,
}

/// Names and last-seen times by context id, and when the daemon last
/// wrote them.
#[derive(Debug, Clone, Default)]
pub struct Seen {
    devices: BTreeMap<String, SeenEntry>,
    /// Unix ms of the stored record (0: never written).
    saved_ms: u64,
    /// When the connected peers were last recorded (not stored).
    refreshed_ms: u64,
}

/// The stored form (version 2 adds `saved_ms`; version 1 was the bare map).
#[derive(Serialize, Deserialize)]
struct SeenRecord {
    saved_ms: u64,
    devices: BTreeMap<String, SeenEntry>,
}

impl Seen {
    /// Records that `context_id` was seen at `now_ms`; an empty `name` keeps
    /// the known one.
    pub fn saw(&mut self, context_id: &str, name: &str, now_ms: u64) {
        if self.devices.len() >= MAX_SEEN && !self.devices.contains_key(context_id) {
            return;
        }
        let e = self.devices.entry(context_id.to_owned()).or_default();
        e.last_seen_ms = e.last_seen_ms.max(now_ms);
        if !name.is_empty() {
            e.name = name.to_owned();
        }
    }

    /// The name stored for `context_id`, if any.
    pub fn name_of(&self, context_id: &str) -> Option<&str> {
        self.devices
            .get(context_id)
            .map(|e| e.name.as_str())
            .filter(|n| !n.is_empty())
    }

    /// The name (empty if unknown) and last-seen Unix ms (0: never) stored
    /// for `context_id`.
    pub fn get(&self, context_id: &str) -> Option<(&str, u64)> {
        self.devices
            .get(context_id)
            .map(|e| (e.name.as_str(), e.last_seen_ms))
    }

    /// Whether nothing is known of any device.
    pub fn is_empty(&self) -> bool {
        self.devices.is_empty()
    }

    /// Reads the record stored under [`SEEN_META`]; an unreadable one
    /// starts empty (names come back with the next Hellos).
    pub fn from_bytes(bytes: &[u8]) -> Seen {
        let (devices, saved_ms) = match serde_json::from_slice::<SeenRecord>(bytes) {
            Ok(r) => (r.devices, r.saved_ms),
            Err(_) => (serde_json::from_slice(bytes).unwrap_or_default(), 0),
        };
        Seen {
            devices,
            saved_ms,
            refreshed_ms: saved_ms,
        }
    }

    /// The record to store under [`SEEN_META`], stamped `now_ms`.
    pub fn to_bytes(&self, now_ms: u64) -> Vec<u8> {
        serde_json::to_vec(&SeenRecord {
            saved_ms: now_ms,
            devices: self.devices.clone(),
        })
        .unwrap_or_default()
    }

    /// When the stored record was written (Unix ms), if ever.
    pub fn saved_ms(&self) -> Option<u64> {
        (self.saved_ms > 0).then_some(self.saved_ms)
    }

    /// Whether the connected peers are due to be recorded again; true at
    /// most once per [`SEEN_SAVE_EVERY_MS`].
    pub fn refresh_due(&mut self, now_ms: u64) -> bool {
        if now_ms < self.refreshed_ms.saturating_add(SEEN_SAVE_EVERY_MS) {
            return false;
        }
        self.refreshed_ms = now_ms;
        true
    }
}

fn relationships_of(doc: &DidDocument, key_id: &str) -> Vec<String> {
    [
        Relationship::Authentication,
        Relationship::AssertionMethod,
        Relationship::KeyAgreement,
        Relationship::CapabilityInvocation,
        Relationship::CapabilityDelegation,
    ]
    .into_iter()
    .filter(|r| doc.relationship(*r).iter().any(|k| k == key_id))
    .map(|r| r.as_str().to_owned())
    .collect()
}

/// The context ids of the device keys (Ed25519 methods named `device-…`)
/// `doc` lists, in the document's order.
pub fn listed_devices(doc: &DidDocument) -> Vec<String> {
    doc.verification_method
        .iter()
        .filter(|m| m.r#type == nuwa_identity::document::ED25519_KEY_TYPE)
        .map(|m| DidDocument::fragment(&m.id))
        .filter(|f| f.starts_with("device-"))
        .map(str::to_owned)
        .collect()
}

/// Every device key (Ed25519 methods named `device-…`) the log ever listed.
pub fn list(log: &DidChain, seen: &Seen, me: &str, now_ms: u64) -> Vec<DeviceEntry> {
    let current = log.current();
    let now_secs = (now_ms / 1000) as i64;
    // The last method each device was listed with: its expiry tells an
    // expired device that was pruned from one that was revoked.
    let mut ever: BTreeMap<String, nuwa_identity::document::VerificationMethod> = BTreeMap::new();
    for doc in log.documents() {
        for m in &doc.verification_method {
            let frag = DidDocument::fragment(&m.id);
            if m.r#type == nuwa_identity::document::ED25519_KEY_TYPE && frag.starts_with("device-")
            {
                ever.insert(frag.to_owned(), m.clone());
            }
        }
    }
    ever.into_iter()
        .map(|(ctx, method)| {
            let key_id = method.id.clone();
            let ran_out = method.check_not_expired(now_secs).is_err();
            let status = match current.key_status(&key_id, now_secs) {
                KeyStatus::Active => "active",
                KeyStatus::Expired => "expired",
                KeyStatus::NotListed if ran_out => "expired",
                KeyStatus::NotListed => "revoked",
            };
            let s = seen.devices.get(&ctx);
            DeviceEntry {
                name: s.map(|s| s.name.clone()).unwrap_or_default(),
                relationships: relationships_of(current, &key_id),
                status: status.to_owned(),
                last_seen_unix_ms: s.map(|s| s.last_seen_ms).filter(|t| *t > 0),
                this_device: ctx == me,
                context_id: ctx,
                stored_as_of_unix_ms: None,
                expires: method.expires,
            }
        })
        .collect()
}

/// A Unix time in ms as RFC 3339 UTC, e.g. 2026-11-25T05:10:00.123Z (for
/// `device list`, `state events`, `doctor` and `status`).
pub fn format_unix_ms(ms: u64) -> String {
    time::OffsetDateTime::from_unix_timestamp_nanos(i128::from(ms) * 1_000_000)
        .ok()
        .and_then(|t| {
            t.format(&time::format_description::well_known::Rfc3339)
                .ok()
        })
        .unwrap_or_else(|| format!("{ms} ms after the Unix epoch"))
}

/// `device list` with no daemon running: the rows of [`list`] over the
/// record the daemon stored (`seen`; `None` when the home was busy and the
/// store could not be opened), this device named `my_name` when the record
/// has no name for it, each row saying when the record was written; and a
/// line saying where the names and last-seen times came from.
pub fn list_offline(
    log: &DidChain,
    seen: Option<&Seen>,
    (me, my_name): (&str, &str),
    now_ms: u64,
) -> (Vec<DeviceEntry>, String) {
    let mut rows = list(log, seen.unwrap_or(&Seen::default()), me, now_ms);
    let as_of = seen.and_then(|s| s.saved_ms());
    for r in &mut rows {
        // This device's name is the home's: a rename shows before the
        // daemon records it.
        if r.this_device && !my_name.is_empty() {
            r.name = my_name.to_owned();
        }
        r.stored_as_of_unix_ms = as_of;
    }
    let note = match (seen, as_of) {
        (None, _) => "no daemon is running and the home is busy (another nuwa-node command \
                      holds its lock): names and last-seen times are not shown"
            .to_owned(),
        (Some(_), None) => "no daemon is running, and none has recorded names or last-seen \
                            times in this home yet"
            .to_owned(),
        (Some(_), Some(t)) => format!(
            "no daemon is running: names and last-seen times as stored by the daemon at {} ({})",
            format_unix_ms(t),
            ago(now_ms, t)
        ),
    };
    (rows, note)
}

/// "5m3s ago" and the like.
pub fn ago(now_ms: u64, t_ms: u64) -> String {
    let ago = now_ms.saturating_sub(t_ms) / 1000;
    if ago < 5 {
        "now".to_owned()
    } else if ago < 3600 {
        format!("{}m{}s ago", ago / 60, ago % 60)
    } else if ago < 48 * 3600 {
        format!("{}h{}m ago", ago / 3600, ago % 3600 / 60)
    } else {
        format!("{}d ago", ago / 86_400)
    }
}

/// Text rendering for `device list`.
pub fn render(entries: &[DeviceEntry], now_ms: u64) -> String {
    let mut out = format!(
        "{:<22} {:<12} {:<8} {:<14} relationships\n",
        "context id", "name", "status", "last seen"
    );
    for e in entries {
        let seen = match e.last_seen_unix_ms {
            _ if e.this_device => "this device".to_owned(),
            None => "never".to_owned(),
            Some(t) => ago(now_ms, t),
        };
        let expires = match &e.expires {
            Some(at) if e.status == "active" => format!(" (expires {at})"),
            Some(at) => format!(" (expired {at})"),
            None => String::new(),
        };
        out.push_str(&format!(
            "{:<22} {:<12} {:<8} {:<14} {}{expires}\n",
            e.context_id,
            if e.name.is_empty() { "-" } else { &e.name },
            e.status,
            seen,
            e.relationships.join(",")
        ));
    }
    out
}

/// Why a device given on the command line (by context id or by name) is
/// not one device of the agent.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ResolveError {
    #[error(
        "no device given; name one by its context id or its name (see `nuwa-node device list`)"
    )]
    Empty,
    #[error("no device of this agent has the context id or name {given:?}; it has: {known}")]
    Unknown { given: String, known: String },
    #[error(
        "{n} devices are named {given:?}: {ids}; give the context id of the one you mean, or \
         rename one (`nuwa-node device rename`)",
        n = .ids.len(),
        ids = .ids.join(", ")
    )]
    Ambiguous { given: String, ids: Vec<String> },
}

/// Most devices an [`ResolveError::Unknown`] lists.
const MAX_LISTED: usize = 16;

/// The context id of the device `given` names, among `entries` (what
/// `device list` shows). A context id names its device. Otherwise `given`
/// is a name: the devices with exactly that name, else with that name in
/// any case; of those, the ones not revoked when there are any (a device
/// paired again keeps its old row as revoked). One match is the answer;
/// several are refused with their ids, none with what exists, except a
/// word shaped like a context id (`device-…`), which is passed on as it
/// is: this device's log may not list that device yet, and the command
/// itself then says what is wrong (not an admin, not listed).
pub fn resolve(entries: &[DeviceEntry], given: &str) -> Result<String, ResolveError> {
    let given = given.trim();
    if given.is_empty() {
        return Err(ResolveError::Empty);
    }
    if let Some(e) = entries.iter().find(|e| e.context_id == given) {
        return Ok(e.context_id.clone());
    }
    let exact: Vec<&DeviceEntry> = entries.iter().filter(|e| e.name == given).collect();
    let mut named = if exact.is_empty() {
        let folded = given.to_lowercase();
        entries
            .iter()
            .filter(|e| !e.name.is_empty() && e.name.to_lowercase() == folded)
            .collect()
    } else {
        exact
    };
    if named.iter().any(|e| e.status != "revoked") {
        named.retain(|e| e.status != "revoked");
    }
    match named.as_slice() {
        [one] => Ok(one.context_id.clone()),
        [] if given.starts_with("device-") => Ok(given.to_owned()),
        [] => {
            let mut known: Vec<String> = entries
                .iter()
                .take(MAX_LISTED)
                .map(|e| {
                    let name = if e.name.is_empty() {
                        "no name"
                    } else {
                        &e.name
                    };
                    format!("{} ({name}, {})", e.context_id, e.status)
                })
                .collect();
            if entries.len() > MAX_LISTED {
                known.push(format!("and {} more", entries.len() - MAX_LISTED));
            }
            if known.is_empty() {
                known.push("no devices".to_owned());
            }
            Err(ResolveError::Unknown {
                given: given.to_owned(),
                known: known.join(", "),
            })
        }
        many => Err(ResolveError::Ambiguous {
            given: given.to_owned(),
            ids: many
                .iter()
                .map(|e| format!("{} ({})", e.context_id, e.status))
                .collect(),
        }),
    }
}

/// Why a name cannot be a device's name.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum NameError {
    #[error("a device name must be 1 to {max} bytes, without control characters; {given:?} is not", max = nuwa_proto::MAX_DEVICE_NAME_BYTES)]
    Invalid { given: String },
    #[error(
        "device {other} is already named {given:?}; pick another name, so that commands can \
         take it in place of a context id"
    )]
    Taken { given: String, other: String },
    #[error("{given:?} is a context id; a name that looks like one would shadow that device")]
    LooksLikeId { given: String },
}

/// Checks `name` as the new name of device `me`, among `entries`: 1 to 64
/// bytes, no control characters, not shaped like a context id, and not
/// the name of another device that is not revoked (names stand in for
/// context ids, so two alike would make both unusable as names).
pub fn check_rename(entries: &[DeviceEntry], me: &str, name: &str) -> Result<(), NameError> {
    let given = name.to_owned();
    if name.is_empty()
        || name.len() > nuwa_proto::MAX_DEVICE_NAME_BYTES
        || name.trim() != name
        || name.chars().any(char::is_control)
    {
        return Err(NameError::Invalid { given });
    }
    if name.starts_with("device-") {
        return Err(NameError::LooksLikeId { given });
    }
    let folded = name.to_lowercase();
    match entries
        .iter()
        .find(|e| e.context_id != me && e.status != "revoked" && e.name.to_lowercase() == folded)
    {
        Some(e) => Err(NameError::Taken {
            given,
            other: e.context_id.clone(),
        }),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use nuwa_identity::keys::{DeviceKey, context_id_for};

    // Goal: statuses follow the log (active, revoked) and local knowledge
    // fills names and last-seen. Method: add two devices, remove one.
    #[test]
    fn statuses_follow_the_log() {
        let master = DeviceKey::generate().unwrap();
        let mut log = DidChain::genesis(&master, 1_000).unwrap();
        let master_id = log.current().capability_delegation[0].clone();
        let (a, b) = (
            DeviceKey::generate().unwrap(),
            DeviceKey::generate().unwrap(),
        );
        for d in [&a, &b] {
            let mut doc = log.current().clone();
            doc.add_key(
                &context_id_for(&d.public()),
                &d.public(),
                &[Relationship::Authentication],
                None,
            )
            .unwrap();
            log.append_document(&doc, &master, &master_id, 1_001)
                .unwrap();
        }
        let mut doc = log.current().clone();
        doc.remove_key(&context_id_for(&b.public())).unwrap();
        log.append_document(&doc, &master, &master_id, 1_002)
            .unwrap();

        let mut seen = Seen::default();
        seen.saw(&context_id_for(&b.public()), "phone", 5_000);
        let rows = list(&log, &seen, &context_id_for(&a.public()), 1_003_000);
        let by: BTreeMap<_, _> = rows.iter().map(|r| (r.context_id.clone(), r)).collect();
        let ra = by[&context_id_for(&a.public())];
        let rb = by[&context_id_for(&b.public())];
        assert_eq!((ra.status.as_str(), ra.this_device), ("active", true));
        assert_eq!(ra.relationships, vec!["authentication".to_owned()]);
        assert_eq!((rb.status.as_str(), rb.name.as_str()), ("revoked", "phone"));
        assert_eq!(rb.last_seen_unix_ms, Some(5_000));
        assert!(rb.relationships.is_empty());
        assert_eq!(rows.len(), 2, "the master key is not a device");
    }

    fn row(id: &str, name: &str, status: &str) -> DeviceEntry {
        DeviceEntry {
            context_id: id.to_owned(),
            name: name.to_owned(),
            relationships: Vec::new(),
            status: status.to_owned(),
            expires: None,
            last_seen_unix_ms: None,
            this_device: false,
            stored_as_of_unix_ms: None,
        }
    }

    // Goal: a device is named by its context id or its name as `device
    // list` shows it; an ambiguous name is refused with the candidates'
    // ids, an unknown one with what exists. Method: one table of given
    // words against one list, each with the id or the error's text.
    #[test]
    fn names_resolve_to_one_device_or_say_why_not() {
        let rows = [
            row("device-aaaa", "laptop", "active"),
            row("device-bbbb", "phone", "revoked"),
            row("device-cccc", "phone", "active"),
            row("device-dddd", "twin", "active"),
            row("device-eeee", "twin", "active"),
            row("device-ffff", "", "active"),
            row("device-gggg", "old", "revoked"),
            row("device-hhhh", "Desk", "active"),
        ];
        let check = |given: &str, want: Result<&str, &str>| {
            let got = resolve(&rows, given).map_err(|e| e.to_string());
            match (&got, want) {
                (Ok(id), Ok(w)) => assert_eq!(id, w, "{given:?}"),
                (Err(e), Err(w)) => assert!(e.contains(w), "{given:?}: {e}"),
                _ => panic!("{given:?}: got {got:?}, want {want:?}"),
            }
        };
        check("device-aaaa", Ok("device-aaaa"));
        check(" laptop ", Ok("device-aaaa"));
        // The revoked row of a device paired again under its old name.
        check("phone", Ok("device-cccc"));
        check("device-bbbb", Ok("device-bbbb"));
        check("old", Ok("device-gggg"));
        check("desk", Ok("device-hhhh"));
        check(
            "twin",
            Err("2 devices are named \"twin\": device-dddd (active), device-eeee (active)"),
        );
        check(
            "lapt0p",
            Err("no device of this agent has the context id or name \"lapt0p\""),
        );
        check("lapt0p", Err("device-aaaa (laptop, active)"));
        check("lapt0p", Err("device-ffff (no name, active)"));
        // An id this device's log may not list yet goes on as it is.
        check("device-zzzz", Ok("device-zzzz"));
        check("  ", Err("no device given"));
        assert!(
            resolve(&[], "x")
                .unwrap_err()
                .to_string()
                .ends_with("it has: no devices"),
            "an agent with no device rows says so"
        );
    }

    // Goal: a new name is 1 to 64 bytes of text, not shaped like a context
    // id, and not another live device's name (in any case). Method: one
    // table of names for device-aaaa.
    #[test]
    fn a_rename_keeps_names_usable_in_place_of_ids() {
        let rows = [
            row("device-aaaa", "laptop", "active"),
            row("device-bbbb", "phone", "active"),
            row("device-cccc", "gone", "revoked"),
        ];
        let check = |name: &str, want: Result<(), &str>| {
            let got = check_rename(&rows, "device-aaaa", name).map_err(|e| e.to_string());
            match (&got, want) {
                (Ok(()), Ok(())) => {}
                (Err(e), Err(w)) => assert!(e.contains(w), "{name:?}: {e}"),
                _ => panic!("{name:?}: got {got:?}, want {want:?}"),
            }
        };
        check("work laptop", Ok(()));
        check("laptop", Ok(()));
        check("gone", Ok(()));
        check(&"x".repeat(64), Ok(()));
        check(&"x".repeat(65), Err("1 to 64 bytes"));
        check("", Err("1 to 64 bytes"));
        check(" pad", Err("1 to 64 bytes"));
        check("a\nb", Err("1 to 64 bytes"));
        check(
            "Phone",
            Err("device device-bbbb is already named \"Phone\""),
        );
        check("device-1234", Err("is a context id"));
    }

    // Goal: the stored record keeps names, last-seen times and when it was
    // written, and a record in the first format (a bare map) still loads.
    #[test]
    fn the_record_round_trips_and_reads_the_old_format() {
        let mut seen = Seen::default();
        seen.saw("device-aa", "phone", 5_000);
        let bytes = seen.to_bytes(9_000);
        let mut back = Seen::from_bytes(&bytes);
        assert_eq!(back.saved_ms(), Some(9_000));
        assert_eq!(back.devices["device-aa"].name, "phone");
        assert_eq!(back.devices["device-aa"].last_seen_ms, 5_000);
        assert!(!back.refresh_due(9_000 + SEEN_SAVE_EVERY_MS - 1));
        assert!(back.refresh_due(9_000 + SEEN_SAVE_EVERY_MS));
        assert!(
            !back.refresh_due(9_000 + SEEN_SAVE_EVERY_MS + 1),
            "once a minute"
        );

        let old = br#"{"device-bb":{"name":"tablet","last_seen_ms":7000}}"#;
        let back = Seen::from_bytes(old);
        assert_eq!(back.saved_ms(), None);
        assert_eq!(back.devices["device-bb"].name, "tablet");
    }

    // Goal: with no daemon, this device keeps its own name, every row says
    // when the record was written, and the note says where names came
    // from. Method: a busy home, a record never written, a stored one.
    #[test]
    fn offline_rows_and_their_note() {
        let master = DeviceKey::from_seed(&[1; 32]);
        let me = DeviceKey::from_seed(&[3; 32]);
        let mut log = DidChain::genesis(&master, 1_000).unwrap();
        let recovery = DeviceKey::from_seed(&[2; 32]).public();
        crate::lifecycle::first_update(&mut log, &master, &me, &recovery, 1_000).unwrap();
        let id = context_id_for(&me.public());
        let now = 120_000;
        let (rows, busy) = list_offline(&log, None, (&id, "desk"), now);
        assert_eq!(
            (rows[0].name.as_str(), rows[0].stored_as_of_unix_ms),
            ("desk", None)
        );
        assert!(busy.contains("the home is busy"), "{busy}");
        let (_, never) = list_offline(&log, Some(&Seen::default()), (&id, "desk"), now);
        assert!(never.contains("none has recorded names"), "{never}");
        let stored = Seen::from_bytes(&Seen::default().to_bytes(60_000));
        let (rows, note) = list_offline(&log, Some(&stored), (&id, "desk"), now);
        assert_eq!(rows[0].stored_as_of_unix_ms, Some(60_000));
        assert!(
            note.ends_with("at 1970-01-01T00:01:00Z (1m0s ago)"),
            "{note}"
        );
    }
}
