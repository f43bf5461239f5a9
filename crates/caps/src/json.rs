//! Strict JSON for capabilities, and its RFC 8785 (JCS) serialization.
//!
//! Parsing refuses what could make two readers see different documents
//! behind one signature: duplicate object keys, and numbers that are not
//! integers in the range every JSON reader (including JavaScript's) keeps
//! exactly, ±(2^53 − 1). Capabilities hold no numbers at all today, so
//! refusing fractions and exponents costs nothing and spares us JCS's
//! ECMAScript number formatting.
//!
//! Serialization is JCS for that subset: no whitespace, object members
//! sorted by the UTF-16 code units of their keys, strings escaped as
//! ECMAScript's `JSON.stringify` does (`\"`, `\\`, `\b \t \n \f \r`, other
//! controls as `\u00xx`, everything else as UTF-8), integers in decimal.
//! Our own [`Json`] type (not `serde_json::Value`) holds values, so that
//! serde_json features another crate enables (`preserve_order`,
//! `arbitrary_precision`) cannot change what is signed.

use std::collections::BTreeMap;
use std::fmt;

use serde::de::{self, Deserialize, Deserializer, MapAccess, SeqAccess, Visitor};

/// The largest integer magnitude accepted: 2^53 − 1 (JavaScript's `Number.MAX_SAFE_INTEGER`).
pub(crate) const MAX_SAFE_INTEGER: u64 = (1 << 53) - 1;

/// A JSON value of the strict subset.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Json {
    Null,
    Bool(bool),
    Int(i64),
    Str(String),
    Arr(Vec<Json>),
    Obj(BTreeMap<String, Json>),
}

impl Json {
    pub(crate) fn str(s: impl Into<String>) -> Json {
        Json::Str(s.into())
    }

    /// The JSON type's name, for messages.
    pub(crate) fn kind(&self) -> &'static str {
        match self {
            Json::Null => "null",
            Json::Bool(_) => "a boolean",
            Json::Int(_) => "a number",
            Json::Str(_) => "a string",
            Json::Arr(_) => "an array",
            Json::Obj(_) => "an object",
        }
    }
}

/// Parses `bytes` as one strict JSON value (see the module docs); the error
/// is a reason for a message.
pub(crate) fn parse(bytes: &[u8]) -> Result<Json, String> {
    serde_json::from_slice(bytes).map_err(|e| e.to_string())
}

/// The JCS serialization of `value`.
pub(crate) fn canonical(value: &Json) -> Vec<u8> {
    let mut out = Vec::new();
    write(value, &mut out);
    out
}

fn write(value: &Json, out: &mut Vec<u8>) {
    match value {
        Json::Null => out.extend_from_slice(b"null"),
        Json::Bool(true) => out.extend_from_slice(b"true"),
        Json::Bool(false) => out.extend_from_slice(b"false"),
        Json::Int(n) => out.extend_from_slice(n.to_string().as_bytes()),
        Json::Str(s) => write_str(s, out),
        Json::Arr(items) => {
            out.push(b'[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                write(item, out);
            }
            out.push(b']');
        }
        Json::Obj(map) => {
            // JCS sorts by UTF-16 code units; the map's own order is by UTF-8
            // bytes, which differs for keys beyond the Basic Multilingual Plane.
            let mut members: Vec<(&String, &Json)> = map.iter().collect();
            members.sort_by(|a, b| a.0.encode_utf16().cmp(b.0.encode_utf16()));
            out.push(b'{');
            for (i, (key, item)) in members.into_iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                write_str(key, out);
                out.push(b':');
                write(item, out);
            }
            out.push(b'}');
        }
    }
}

fn write_str(s: &str, out: &mut Vec<u8>) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    out.push(b'"');
    for c in s.chars() {
        match c {
            '"' => out.extend_from_slice(b"\\\""),
            '\\' => out.extend_from_slice(b"\\\\"),
            '\u{8}' => out.extend_from_slice(b"\\b"),
            '\t' => out.extend_from_slice(b"\\t"),
            '\n' => out.extend_from_slice(b"\\n"),
            '\u{c}' => out.extend_from_slice(b"\\f"),
            '\r' => out.extend_from_slice(b"\\r"),
            c if (c as u32) < 0x20 => {
                let b = c as u8;
                out.extend_from_slice(b"\\u00");
                out.push(HEX[usize::from(b >> 4)]);
                out.push(HEX[usize::from(b & 0xf)]);
            }
            c => {
                let mut buf = [0u8; 4];
                out.extend_from_slice(c.encode_utf8(&mut buf).as_bytes());
            }
        }
    }
    out.push(b'"');
}

impl<'de> Deserialize<'de> for Json {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Json, D::Error> {
        deserializer.deserialize_any(JsonVisitor)
    }
}

struct JsonVisitor;

impl<'de> Visitor<'de> for JsonVisitor {
    type Value = Json;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON value without fractions, exponents or duplicate keys")
    }

    fn visit_unit<E: de::Error>(self) -> Result<Json, E> {
        Ok(Json::Null)
    }

    fn visit_bool<E: de::Error>(self, v: bool) -> Result<Json, E> {
        Ok(Json::Bool(v))
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<Json, E> {
        if v.unsigned_abs() > MAX_SAFE_INTEGER {
            return Err(E::custom(format_args!(
                "integer {v} is beyond ±(2^53 - 1), which not every reader keeps exactly"
            )));
        }
        Ok(Json::Int(v))
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Json, E> {
        if v > MAX_SAFE_INTEGER {
            return Err(E::custom(format_args!(
                "integer {v} is beyond ±(2^53 - 1), which not every reader keeps exactly"
            )));
        }
        // In range, so it fits an i64.
        Ok(Json::Int(v as i64))
    }

    fn visit_f64<E: de::Error>(self, v: f64) -> Result<Json, E> {
        Err(E::custom(format_args!(
            "number {v} is not an integer; capabilities hold integers only"
        )))
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Json, E> {
        Ok(Json::Str(v.to_owned()))
    }

    fn visit_string<E: de::Error>(self, v: String) -> Result<Json, E> {
        Ok(Json::Str(v))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Json, A::Error> {
        let mut items = Vec::new();
        while let Some(item) = seq.next_element()? {
            items.push(item);
        }
        Ok(Json::Arr(items))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Json, A::Error> {
        let mut members = BTreeMap::new();
        while let Some(key) = map.next_key::<String>()? {
            if members.contains_key(&key) {
                return Err(de::Error::custom(format_args!("duplicate key {key:?}")));
            }
            let value = map.next_value()?;
            members.insert(key, value);
        }
        Ok(Json::Obj(members))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn jcs(text: &str) -> String {
        let value = parse(text.as_bytes()).expect("test input parses");
        String::from_utf8(canonical(&value)).expect("utf-8")
    }

    // Goal: canonical output matches RFC 8785's rules on hand-checked inputs (sorting, escaping, whitespace).
    #[test]
    fn canonical_forms() {
        let cases = [
            (
                r#" { "b" : 1 , "a" : [ true , false , null ] } "#,
                r#"{"a":[true,false,null],"b":1}"#,
            ),
            (r#"{"a":{"d":-7,"c":0}}"#, r#"{"a":{"c":0,"d":-7}}"#),
            // Escapes: the two-character forms, \u00xx for other controls, DEL and
            // non-ASCII as themselves, `/` unescaped.
            (
                r#""\u0008\t\n\f\r\u0001\u001f\"\\\/\u007f\u00e9\u20ac""#,
                "\"\\b\\t\\n\\f\\r\\u0001\\u001f\\\"\\\\/\u{7f}é€\"",
            ),
            // RFC 8785 §3.2.3's sorting example: UTF-16 order puts U+1F600 (a
            // surrogate pair, D83D) before U+FB33 although its UTF-8 sorts after.
            (
                "{\"\u{fb33}\":1,\"\u{1f600}\":2,\"\\r\":3,\"1\":4,\"\u{80}\":5,\"\u{f6}\":6}",
                "{\"\\r\":3,\"1\":4,\"\u{80}\":5,\"\u{f6}\":6,\"\u{1f600}\":2,\"\u{fb33}\":1}",
            ),
            ("9007199254740991", "9007199254740991"),
            ("-9007199254740991", "-9007199254740991"),
        ];
        for (input, want) in cases {
            assert_eq!(jcs(input), want, "input {input}");
        }
    }

    // Goal: inputs that could let two readers disagree are refused: fractions, exponents, unsafe integers, duplicate keys, lone surrogates.
    #[test]
    fn refuses_ambiguous_inputs() {
        let cases = [
            "1.0",
            "1e2",
            "-0.5",
            "9007199254740992",
            "-9007199254740992",
            "18446744073709551616",
            r#"{"a":1,"a":1}"#,
            r#"{"x":{"a":1,"a":2}}"#,
            r#""\ud800""#,
            "[1,]",
            "{} {}",
            "\"\u{0}\"",
        ];
        for input in cases {
            assert!(parse(input.as_bytes()).is_err(), "{input:?} accepted");
        }
        assert!(parse(b"\xff").is_err(), "invalid utf-8 accepted");
    }
}
