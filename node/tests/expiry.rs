//! Short-lived devices with real daemons (`device provision --expires`):
//! a CI device syncs while its time runs, then its peers refuse it with no
//! revocation, count it as expired and send it nothing new, and the admin's
//! daemon prunes it from the DID document. Each test runs in its own
//! network namespace (see `common::isolated`).

mod common;

use std::path::Path;
use std::time::Duration;

use common::*;
use serde_json::{Value, json};

/// `device list --json` on `home`: the row of `context_id`.
fn device_row(home: &Path, context_id: &str) -> Option<Value> {
    let out = cli(home, &["device", "list", "--json"]);
    let rows: Value = serde_json::from_slice(&out.stdout).ok()?;
    rows.as_array()?
        .iter()
        .find(|r| r["context_id"] == json!(context_id))
        .cloned()
}

// Goal: a device provisioned with `--expires 4s` syncs while its time (and
// the grace for clock skew) runs, then is refused by its peers (counted as
// expired), gets nothing written after, and the admin's daemon prunes it
// from the DID document. Method: three daemons (admin a, b, and the CI
// device provisioned through a's daemon); writes both ways before the
// expiry; then waits on a's counters and `device list`, and on b holding a
// later write that the CI device never gets.
#[test]
fn a_short_lived_device_syncs_then_is_refused_and_pruned() {
    isolated(
        "a_short_lived_device_syncs_then_is_refused_and_pruned",
        || {
            let mut c = Cluster::new();
            let a = c.init("a");
            let b = c.provision(&a, "b");
            c.start(&a, &[]);
            c.start(&b, &[]);
            let ci = c.home("ci");
            let bad = cli(
                &a,
                &[
                    "device",
                    "provision",
                    "--out",
                    ci.to_str().unwrap(),
                    "--expires",
                    "0s",
                ],
            );
            assert!(!bad.status.success(), "--expires 0s is refused");
            let text = String::from_utf8_lossy(&bad.stderr);
            assert!(text.contains("is zero"), "{text}");
            let out = cli_ok(
                &a,
                &[
                    "device",
                    "provision",
                    "--out",
                    ci.to_str().unwrap(),
                    "--name",
                    "ci",
                    "--expires",
                    "4s",
                ],
            );
            assert!(out.contains("it expires at"), "{out}");
            let cci = context_id(&ci);
            let row = device_row(&a, &cci).expect("listed");
            assert_eq!(row["status"], json!("active"), "{row}");
            assert!(row["expires"].is_string(), "{row}");
            c.start(&ci, &[]);

            // While its time runs (grace included) it syncs both ways.
            cli_ok(&ci, &["state", "put", "ci", "result", "\"green\""]);
            cli_ok(&a, &["state", "put", "notes", "before", "1"]);
            wait_for("the CI device syncs", Duration::from_secs(30), || {
                let up = get_json(&a, "ci").is_some_and(|v| v["result"] == json!("green"));
                let down = get_json(&ci, "notes").is_some_and(|v| v["before"] == json!(1));
                (up && down).then_some(())
            });

            // Then its peers refuse it and count it as expired, and the
            // admin's daemon prunes it from the document.
            wait_for(
                "the admin refuses and prunes it",
                Duration::from_secs(90),
                || {
                    let refused = metric(&a, "nuwa_peers_refused_expired_total") >= 1.0;
                    let pruned = metric(&a, "nuwa_expired_devices_pruned_total") >= 1.0;
                    (refused && pruned).then_some(())
                },
            );
            let row = device_row(&a, &cci).expect("still in the history");
            assert_eq!(row["status"], json!("expired"), "{row}");
            assert_eq!(
                row["relationships"],
                json!([]),
                "no longer in the document: {row}"
            );
            let listed = cli_ok(&a, &["device", "list"]);
            assert!(listed.contains("expired"), "{listed}");
            wait_for("b drops it too", Duration::from_secs(30), || {
                let st = status(&b).ok()?;
                (!verified(&st).contains(&cci)).then_some(())
            });

            // It knows, and refuses local writes (they would never sync).
            wait_for("the CI device knows", Duration::from_secs(30), || {
                (status(&ci).ok()?["device"]["revoked"] == json!(true)).then_some(())
            });
            let refused = cli(&ci, &["state", "put", "ci", "late", "1"]);
            assert!(
                !refused.status.success(),
                "a write on an expired device is refused"
            );
            let text = String::from_utf8_lossy(&refused.stderr);
            assert!(text.contains("expired"), "{text}");

            // Nothing written after reaches it.
            cli_ok(&a, &["state", "put", "notes", "after", "2"]);
            wait_for("b holds the later write", Duration::from_secs(30), || {
                get_json(&b, "notes")
                    .is_some_and(|v| v["after"] == json!(2))
                    .then_some(())
            });
            let on_ci = get_json(&ci, "notes").unwrap_or(Value::Null);
            assert!(
                on_ci.get("after").is_none(),
                "the expired device got {on_ci}"
            );
            assert!(verified(&status(&a).unwrap()).iter().all(|p| *p != cci));
        },
    );
}
