//! Text for people of the local API's replies that the CLI prints (`app
//! list`, `app revoke`, `state schema add`, `state create`, `state
//! query`); with `--json` the CLI prints the reply itself instead.
//!
//! Each function takes the reply as JSON, as it came over the API, and
//! prints what it lacks as `?`: a newer daemon's reply still renders.

use serde_json::Value;

use crate::apps::AppEntry;

fn str_of<'a>(v: &'a Value, key: &str) -> &'a str {
    v[key].as_str().unwrap_or("?")
}

/// The text of a typed-state tool's reply (`body` POSTed to `path`), for
/// the tools that have one; `None`: the CLI prints the JSON, indented.
pub fn tool_reply(path: &str, body: &Value, reply: &Value) -> Option<String> {
    match path {
        "/v1/schemas" => Some(schema_added(reply)),
        "/v1/state.create" => Some(created(str_of(body, "schema_uri"), reply)),
        "/v1/state.query" => Some(query(reply)),
        _ => None,
    }
}

/// `app list`: one line per capability, newest state first as the daemon
/// lists them, and how to revoke one.
pub fn app_list(entries: &[AppEntry]) -> String {
    if entries.is_empty() {
        return "no capabilities issued yet; give an app one with `nuwa-node app grant`\n"
            .to_owned();
    }
    let mut out = String::new();
    for e in entries {
        let state = if e.revoked { "revoked" } else { "active" };
        out.push_str(&format!(
            "{}  {state}\n  app {}\n  on {}  may {}  until {}\n",
            e.id,
            e.to,
            e.target,
            e.actions.join(","),
            e.expires
        ));
    }
    out.push_str(&format!(
        "{} capabilit{}; revoke one with `nuwa-node app revoke ID`\n",
        entries.len(),
        if entries.len() == 1 { "y" } else { "ies" }
    ));
    out
}

/// `app revoke`: what revoking did.
pub fn app_revoked(reply: &Value) -> String {
    format!(
        "revoked capability {}: every device refuses it, and every capability delegated from \
         it, once the revocation reaches it\n",
        str_of(reply, "id")
    )
}

/// `state schema add`: what was registered, with its container and fields.
pub fn schema_added(reply: &Value) -> String {
    let fields = reply["fields"]
        .as_object()
        .map(|f| {
            f.iter()
                .map(|(name, kind)| format!("{name} ({})", kind.as_str().unwrap_or("?")))
                .collect::<Vec<_>>()
                .join(", ")
        })
        .unwrap_or_default();
    let what = if reply["registered"] == Value::Bool(false) {
        "already registered (same content)"
    } else {
        "registered on every device"
    };
    format!(
        "schema {} {what}\n  container {}, {} visibility\n  fields: {}\n",
        str_of(reply, "id"),
        str_of(reply, "container"),
        str_of(reply, "visibility"),
        if fields.is_empty() { "none" } else { &fields }
    )
}

/// `state create`: the new object's id, and how to read it back.
pub fn created(schema_uri: &str, reply: &Value) -> String {
    let id = str_of(reply, "id");
    format!("created {id} in {schema_uri}\n  read it: nuwa-node state get '{schema_uri}' {id}\n")
}

/// `state query`: each item on a line of its own (compact JSON), a count,
/// and how to get the next page.
pub fn query(reply: &Value) -> String {
    let items = reply["items"].as_array().map(Vec::as_slice).unwrap_or(&[]);
    let mut out = String::new();
    for item in items {
        out.push_str(&item.to_string());
        out.push('\n');
    }
    out.push_str(&format!(
        "{} item{}",
        items.len(),
        if items.len() == 1 { "" } else { "s" }
    ));
    match reply["next_cursor"].as_str() {
        Some(c) => out.push_str(&format!(
            "; more: add \"cursor\": \"{c}\" to the query for the next page\n"
        )),
        None => out.push('\n'),
    }
    out
}

/// `init`: the new agent, and what to do next.
pub fn initialised(did: &str, context_id: &str, home: &str) -> String {
    format!(
        "agent did:   {did}\ncontext id:  {context_id}\nhome:        {home}\n\
         this home holds the agent's master key, an admin key: it approves, provisions, \
         promotes and revokes devices. Make a second device an admin too (`device promote`), \
         so losing this one does not need the recovery words.\n\
         back the master key up, offline (a USB stick, a password manager): nuwa-node --home \
         {home} master-key backup --out /path/to/usb/nuwa-master.key\n\
         next: nuwa-node --home {home} run\n"
    )
}

/// `recover` on a device's home: what was removed, who holds the new
/// epoch, and what to do next (`named_lost`: whether `--lost` named any).
pub fn recovered(r: &crate::lifecycle::Recovery, named_lost: bool, home: &str) -> String {
    let removed: Vec<String> = r
        .removed
        .iter()
        .map(|f| crate::lifecycle::describe_removed(f))
        .collect();
    let mut out = format!(
        "removed from the DID document: {}\nnew key epoch {} sealed to {} device(s): {}\n",
        if removed.is_empty() {
            "nothing".to_owned()
        } else {
            removed.join(", ")
        },
        r.epoch,
        r.remaining.len(),
        r.remaining.join(", ")
    );
    if !named_lost {
        out.push_str(
            "note: no --lost device was named, so every device of the DID document stays a \
             member; revoke a lost one with `nuwa-node device revoke NAME`\n",
        );
    }
    out.push_str(&format!(
        "next: start the daemon (`nuwa-node --home {home} run`); its peers adopt the update and \
         the new epoch as they connect\n"
    ));
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    // Goal: each reply prints as text for people, with what a reply lacks
    // as `?`. Method: one table of (rendering, expected text).
    #[test]
    fn replies_as_text() {
        let entry = AppEntry {
            id: "urn:uuid:1".into(),
            to: "did:key:z6Mk".into(),
            target: "did:nuwa:cap:weather:".into(),
            actions: vec!["read".into(), "write".into()],
            expires: "2026-12-31T00:00:00Z".into(),
            revoked: true,
        };
        let cases: [(String, &str); 8] = [
            (
                app_list(&[entry]),
                "urn:uuid:1  revoked\n  app did:key:z6Mk\n  on did:nuwa:cap:weather:  may \
                 read,write  until 2026-12-31T00:00:00Z\n1 capability; revoke one with \
                 `nuwa-node app revoke ID`\n",
            ),
            (
                app_list(&[]),
                "no capabilities issued yet; give an app one with `nuwa-node app grant`\n",
            ),
            (
                app_revoked(&json!({"id": "urn:uuid:1", "revoked": true})),
                "revoked capability urn:uuid:1: every device refuses it, and every capability \
                 delegated from it, once the revocation reaches it\n",
            ),
            (
                schema_added(&json!({"id": "did:nuwa:state:note#v1", "container": "note",
                    "visibility": "private", "fields": {"title": "lww", "tags": "set"},
                    "registered": true})),
                "schema did:nuwa:state:note#v1 registered on every device\n  container note, \
                 private visibility\n  fields: tags (set), title (lww)\n",
            ),
            (
                schema_added(&json!({"registered": false})),
                "schema ? already registered (same content)\n  container ?, ? visibility\n  \
                 fields: none\n",
            ),
            (
                created("did:nuwa:state:note#v1", &json!({"id": "n1", "heads": []})),
                "created n1 in did:nuwa:state:note#v1\n  read it: nuwa-node state get \
                 'did:nuwa:state:note#v1' n1\n",
            ),
            (
                query(&json!({"items": [{"id": "n1"}, {"id": "n2"}], "next_cursor": "c2"})),
                "{\"id\":\"n1\"}\n{\"id\":\"n2\"}\n2 items; more: add \"cursor\": \"c2\" to \
                 the query for the next page\n",
            ),
            (
                query(&json!({"items": [{"id": "n1"}], "next_cursor": null})),
                "{\"id\":\"n1\"}\n1 item\n",
            ),
        ];
        for (got, want) in cases {
            assert_eq!(got, want);
        }
        let body = json!({"schema_uri": "did:nuwa:state:note#v1"});
        let reply = json!({"id": "n1"});
        assert_eq!(
            tool_reply("/v1/state.create", &body, &reply),
            Some(created("did:nuwa:state:note#v1", &reply))
        );
        assert_eq!(tool_reply("/v1/state.update", &body, &reply), None);
    }
}
