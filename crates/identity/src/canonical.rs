//! Canonical JSON: the exact bytes that get hashed and signed.
//!
//! Output is compact JSON (no whitespace) with every object's keys sorted by
//! their UTF-8 bytes, at every depth. Sorting is done here explicitly rather
//! than relying on `serde_json::Map` being a `BTreeMap`: Cargo unifies
//! features across the workspace, so any other crate enabling serde_json's
//! `preserve_order` would otherwise silently change what we sign.
//!
//! This is not RFC 8785 (JCS): keys sort by UTF-8 rather than UTF-16 code
//! units and numbers use serde_json's formatting. Both sides of every
//! signature in this project use this function, which is what matters.

use serde::Serialize;
use serde_json::Value;

/// Serializes `value` to canonical JSON bytes (see the module docs).
pub fn to_canonical_json<T: Serialize + ?Sized>(value: &T) -> Result<Vec<u8>, serde_json::Error> {
    let value = serde_json::to_value(value)?;
    let mut out = Vec::new();
    write_value(&value, &mut out)?;
    Ok(out)
}

fn write_value(value: &Value, out: &mut Vec<u8>) -> Result<(), serde_json::Error> {
    match value {
        Value::Object(map) => {
            let mut entries: Vec<(&String, &Value)> = map.iter().collect();
            entries.sort_by(|a, b| a.0.as_bytes().cmp(b.0.as_bytes()));
            out.push(b'{');
            for (i, (key, item)) in entries.into_iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                serde_json::to_writer(&mut *out, key)?;
                out.push(b':');
                write_value(item, out)?;
            }
            out.push(b'}');
        }
        Value::Array(items) => {
            out.push(b'[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                write_value(item, out)?;
            }
            out.push(b']');
        }
        // Leaves have exactly one compact rendering in serde_json.
        leaf => serde_json::to_writer(&mut *out, leaf)?,
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    // Goal: keys come out sorted at every depth and without whitespace, whatever the input order.
    #[test]
    fn keys_are_sorted_and_compact() {
        #[derive(Serialize)]
        struct Unsorted {
            zeta: u8,
            alpha: Inner,
            #[serde(rename = "Beta")]
            beta: Vec<Inner>,
        }
        #[derive(Serialize)]
        struct Inner {
            y: &'static str,
            x: bool,
        }
        let v = Unsorted {
            zeta: 1,
            alpha: Inner { y: "a\"b", x: true },
            beta: vec![Inner { y: "é", x: false }],
        };
        let got = String::from_utf8(to_canonical_json(&v).expect("serializable")).expect("utf8");
        assert_eq!(
            got,
            r#"{"Beta":[{"x":false,"y":"é"}],"alpha":{"x":true,"y":"a\"b"},"zeta":1}"#
        );
    }

    // Goal: the same logical value built in two key orders gives identical bytes.
    #[test]
    fn insertion_order_does_not_matter() {
        let a = json!({"b": 1, "a": {"d": [1, 2], "c": null}});
        let mut m = serde_json::Map::new();
        m.insert("a".into(), json!({"c": null, "d": [1, 2]}));
        m.insert("b".into(), json!(1));
        let b = Value::Object(m);
        assert_eq!(
            to_canonical_json(&a).expect("ok"),
            to_canonical_json(&b).expect("ok")
        );
        assert_eq!(
            to_canonical_json(&a).expect("ok"),
            br#"{"a":{"c":null,"d":[1,2]},"b":1}"#.to_vec()
        );
    }
}
