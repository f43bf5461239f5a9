//! Fuzzes DID documents from JSON: `serde_json::from_slice::<DidDocument>`,
//! then, for a document that parses, `validate` and every lookup a peer's
//! claim leads to (`key_for`, `method_for_public`, `key_status`, ...) on the
//! document's own key ids, on fragments and on ids of other DIDs, at the
//! fixed clock and at the ends of the `i64` range.
//!
//! Checks that no document, however inconsistent, makes a lookup panic, and
//! that a parsed document survives serialize → parse unchanged.
#![no_main]

use std::sync::LazyLock;

use libfuzzer_sys::fuzz_target;
use nuwa_fuzz::{NOW_UNIX_SECS, agent_did, device, device_context_id, master};
use nuwa_identity::document::{DidDocument, Relationship};

/// Methods of one document looked up per input; the document's size is
/// bounded only by the input, and each lookup is linear in it.
const MAX_METHODS_LOOKED_UP: usize = 8;

struct Fixture {
    publics: [[u8; 32]; 3],
    fixed_ids: Vec<String>,
}

static FIXTURE: LazyLock<Fixture> = LazyLock::new(|| {
    let master_mb = nuwa_identity::did_key::ed25519_public_multibase(&master().public());
    Fixture {
        // Two real keys and one that is not a curve point.
        publics: [master().public(), device().public(), [0xff; 32]],
        fixed_ids: vec![
            String::new(),
            "#".into(),
            device_context_id(),
            format!("#{}", device_context_id()),
            master_mb.clone(),
            format!("{}#{master_mb}", agent_did()),
            "did:example:other#key-1".into(),
            "#\u{0}\u{ffff}".into(),
        ],
    }
});

fuzz_target!(|data: &[u8]| {
    let Ok(doc) = serde_json::from_slice::<DidDocument>(data) else {
        return;
    };
    let f = &*FIXTURE;
    let _ = doc.validate();

    let own_ids = doc
        .verification_method
        .iter()
        .take(MAX_METHODS_LOOKED_UP)
        .map(|m| m.id.clone());
    let ids: Vec<String> = f.fixed_ids.iter().cloned().chain(own_ids).collect();
    for now in [NOW_UNIX_SECS, i64::MIN, i64::MAX] {
        for id in &ids {
            let _ = doc.key_status(id, now);
            let _ = doc.find_method(id);
            let _ = doc.key_id(id);
            for rel in Relationship::ALL {
                let _ = doc.key_for(id, rel, now);
                let _ = doc.has_relationship(id, rel);
            }
        }
        for public in &f.publics {
            for rel in Relationship::ALL {
                let _ = doc.method_for_public(public, rel, now);
            }
        }
    }
    for method in doc.verification_method.iter().take(MAX_METHODS_LOOKED_UP) {
        let _ = method.ed25519_public();
        let _ = method.x25519_public();
        let _ = method.expires_unix_secs();
    }

    // Serialization cannot fail for these plain types; if it ever does, the
    // round trip below has nothing to check.
    if let Ok(json) = serde_json::to_vec(&doc) {
        let again = serde_json::from_slice::<DidDocument>(&json);
        assert_eq!(again.ok().as_ref(), Some(&doc), "json round trip");
    }
});
