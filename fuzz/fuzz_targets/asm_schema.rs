//! Fuzzes the JSON inputs of `nuwa-asm`: the input is parsed as JSON (other
//! input is skipped) and the value is given to all three consumers of
//! client-supplied JSON:
//! - `schema::parse` (and, for a schema that parses, `describe` and
//!   `validate_item` on a few fixed items);
//! - `query::parse`, then `query::execute` over fixed items, following the
//!   returned cursor for one more page;
//! - `doc::apply_patch` on a fixed current object.
//!
//! Checks that none of them panics, and that a parsed query survives
//! `to_json` → `parse` unchanged, as `Query::to_json` promises.
#![no_main]

use std::sync::LazyLock;

use libfuzzer_sys::fuzz_target;
use nuwa_asm::query::{self, Budget};
use nuwa_asm::{doc, schema};
use nuwa_fuzz::{patch_base, query_items};
use serde_json::Value;

/// Items a query may scan per page; the fixed item list is far smaller.
const MAX_SCANNED: usize = 1_000;

struct Fixture {
    items: Vec<(String, Value)>,
    patch_base: Value,
}

static FIXTURE: LazyLock<Fixture> = LazyLock::new(|| Fixture {
    items: query_items(),
    patch_base: patch_base(),
});

fuzz_target!(|data: &[u8]| {
    let Ok(value) = serde_json::from_slice::<Value>(data) else {
        return;
    };
    let f = &*FIXTURE;

    if let Ok(parsed) = schema::parse(&value) {
        let _ = parsed.describe();
        for (_, item) in &f.items {
            let _ = parsed.validate_item(item);
        }
        let _ = parsed.validate_item(&value);
    }

    if let Ok(mut q) = query::parse(&value) {
        let again = query::parse(&q.to_json());
        assert_eq!(again.ok().as_ref(), Some(&q), "query round trip");
        let items = || f.items.iter().map(|(id, item)| (id.as_str(), item));
        let budget = Budget::scan_only(MAX_SCANNED);
        if let Ok(page) = query::execute(&q, items(), &budget) {
            if let Some(cursor) = page.next_cursor {
                q.cursor = Some(cursor);
                let _ = query::execute(&q, items(), &budget);
            }
        }
    }

    let _ = doc::apply_patch(&f.patch_base, &value);
});
