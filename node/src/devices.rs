//! `nuwa-node device list`: every device the agent's DID log has ever listed,
//! with its relationships, its status (active, expired, revoked) and when
//! this device last saw it verified.
//!
//! Status comes from the DID log alone: a key in the current document is
//! active (or expired past its `expires` plus grace); a device key that an
//! earlier version listed and the current one does not was revoked. Names
//! and last-seen times are local knowledge, learned from peers' Hellos and
//! kept encrypted in the store.

use std::collections::BTreeMap;

use nuwa_identity::document::{DidDocument, KeyStatus, Relationship};
use nuwa_identity::log::DidLog;
use nuwa_store::Storage;
use serde::{Deserialize, Serialize};

pub(crate) const SEEN_META: &str = "devices_seen";
/// Devices remembered (far above any real agent's device count).
const MAX_SEEN: usize = 1024;

/// One row of `device list --json`.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct DeviceEntry {
    pub context_id: String,
    pub name: String,
    pub relationships: Vec<String>,
    /// `active`, `expired` or `revoked`.
    pub status: String,
    /// Unix ms this device last saw it verified; `null` if never.
    pub last_seen_unix_ms: Option<u64>,
    /// Whether this row is the device running the command.
    pub this_device: bool,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
struct SeenEntry {
    name: String,
    last_seen_ms: u64,
}

/// Names and last-seen times by context id.
#[derive(Debug, Clone, Default)]
pub struct Seen(BTreeMap<String, SeenEntry>);

impl Seen {
    /// Records that `context_id` was seen at `now_ms`; an empty `name` keeps
    /// the known one.
    pub fn saw(&mut self, context_id: &str, name: &str, now_ms: u64) {
        if self.0.len() >= MAX_SEEN && !self.0.contains_key(context_id) {
            return;
        }
        let e = self.0.entry(context_id.to_owned()).or_default();
        e.last_seen_ms = e.last_seen_ms.max(now_ms);
        if !name.is_empty() {
            e.name = name.to_owned();
        }
    }

    /// The name stored for `context_id`, if any.
    pub fn name_of(&self, context_id: &str) -> Option<&str> {
        self.0
            .get(context_id)
            .map(|e| e.name.as_str())
            .filter(|n| !n.is_empty())
    }

    pub fn load(store: &dyn Storage) -> Seen {
        match store.get_meta(SEEN_META) {
            Ok(Some(bytes)) => Seen(serde_json::from_slice(&bytes).unwrap_or_default()),
            _ => Seen::default(),
        }
    }

    /// The record to store under [`SEEN_META`].
    pub fn to_bytes(&self) -> Vec<u8> {
        serde_json::to_vec(&self.0).unwrap_or_default()
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

/// Every device key (Ed25519 methods named `device-…`) the log ever listed.
pub fn list(log: &DidLog, seen: &Seen, me: &str, now_ms: u64) -> Vec<DeviceEntry> {
    let current = log.current();
    let now_secs = (now_ms / 1000) as i64;
    let mut ever: BTreeMap<String, String> = BTreeMap::new();
    for update in log.updates() {
        for m in &update.document.verification_method {
            let frag = DidDocument::fragment(&m.id);
            if m.r#type == nuwa_identity::document::ED25519_KEY_TYPE && frag.starts_with("device-")
            {
                ever.entry(frag.to_owned()).or_insert_with(|| m.id.clone());
            }
        }
    }
    ever.into_iter()
        .map(|(ctx, key_id)| {
            let status = match current.key_status(&key_id, now_secs) {
                KeyStatus::Active => "active",
                KeyStatus::Expired => "expired",
                KeyStatus::NotListed => "revoked",
            };
            let s = seen.0.get(&ctx);
            DeviceEntry {
                name: s.map(|s| s.name.clone()).unwrap_or_default(),
                relationships: relationships_of(current, &key_id),
                status: status.to_owned(),
                last_seen_unix_ms: s.map(|s| s.last_seen_ms).filter(|t| *t > 0),
                this_device: ctx == me,
                context_id: ctx,
            }
        })
        .collect()
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
            Some(t) => {
                let ago = now_ms.saturating_sub(t) / 1000;
                if ago < 5 {
                    "now".to_owned()
                } else if ago < 3600 {
                    format!("{}m{}s ago", ago / 60, ago % 60)
                } else {
                    format!("{}h ago", ago / 3600)
                }
            }
        };
        out.push_str(&format!(
            "{:<22} {:<12} {:<8} {:<14} {}\n",
            e.context_id,
            if e.name.is_empty() { "-" } else { &e.name },
            e.status,
            seen,
            e.relationships.join(",")
        ));
    }
    out
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
        let mut log = DidLog::genesis(&master, 1_000).unwrap();
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
            log.append(doc, &master, &master_id, 1_001).unwrap();
        }
        let mut doc = log.current().clone();
        doc.remove_key(&context_id_for(&b.public())).unwrap();
        log.append(doc, &master, &master_id, 1_002).unwrap();

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
}
