//! The NIP-8 namespace of a container name, which decides the storage it lives in: NIP-8
//! requires storage to be table-isolated per namespace, so [`crate::SledStore`] gives each
//! namespace its own trees.
//!
//! The rules, the first that fits wins:
//!
//! | container name                             | namespace                      |
//! |--------------------------------------------|--------------------------------|
//! | `did:nuwa:core:…`                          | `did:nuwa:core:`               |
//! | `did:nuwa:cap:<cap_id>:…`                  | `did:nuwa:cap:<cap_id>:`       |
//! | `did:nuwa:app:<app_name>:…`                | `did:nuwa:app:<app_name>:`     |
//! | `did:nuwa:user:<did_suffix>:…`             | `did:nuwa:user:<did_suffix>:`  |
//! | `nuwa:…` (the daemon's reserved containers, such as `nuwa:schemas`) | `nuwa:` |
//! | anything else                              | `default`                      |
//!
//! An owner segment (`<cap_id>`, `<app_name>`, `<did_suffix>`) must be non-empty and end
//! at a `:`; a name without one (`did:nuwa:cap:x`, `did:nuwa:cap::state:N#v1`) does not fit
//! its rule and falls through to `default`. So does NIP-7's short form
//! `did:nuwa:state:<Name>#v<n>`, which names no owner, and every free-form name such as
//! `notes`. Nothing here checks that a name is a valid schema id: that is `nuwa-asm`'s
//! business, and storage must place every name it is given.

/// The namespace of containers that fit no NIP-8 form and are not reserved.
pub const DEFAULT_NAMESPACE: &str = "default";
/// The namespace of the daemon's reserved containers (names starting `nuwa:`).
pub const RESERVED_NAMESPACE: &str = "nuwa:";

const CORE_PREFIX: &str = "did:nuwa:core:";
/// The NIP-8 forms whose namespace is one owner's: the prefix, then the owner, then `:`.
const OWNED_PREFIXES: [&str; 3] = ["did:nuwa:cap:", "did:nuwa:app:", "did:nuwa:user:"];

/// The NIP-8 namespace `container` belongs to (see the module docs for the rules).
///
/// Total: every string, valid name or not, has exactly one namespace, and this never
/// panics. The result is [`DEFAULT_NAMESPACE`] or a prefix of `container`.
#[must_use]
pub fn namespace_of(container: &str) -> &str {
    if container.starts_with(CORE_PREFIX) {
        return CORE_PREFIX;
    }
    for prefix in OWNED_PREFIXES {
        if let Some(rest) = container.strip_prefix(prefix) {
            return match rest.find(':') {
                // `prefix` is ASCII and `:` one byte, so both ends are char boundaries.
                Some(owner_len) if owner_len > 0 => &container[..prefix.len() + owner_len + 1],
                _ => DEFAULT_NAMESPACE,
            };
        }
    }
    if container.starts_with(RESERVED_NAMESPACE) {
        return RESERVED_NAMESPACE;
    }
    DEFAULT_NAMESPACE
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(container: &str, expected: &str) {
        assert_eq!(
            namespace_of(container),
            expected,
            "namespace of {container:?}"
        );
    }

    // Goal: every NIP-8 form, the reserved names and the malformed cases land in the
    // namespace the module docs promise; method: a table through one `check` helper.
    #[test]
    fn names_map_to_their_namespaces() {
        check("did:nuwa:core:MemoryStore#v1", "did:nuwa:core:");
        check("did:nuwa:core:", "did:nuwa:core:");
        check(
            "did:nuwa:cap:note@1.0.0:state:Note#v2",
            "did:nuwa:cap:note@1.0.0:",
        );
        check("did:nuwa:cap:todo:state:Item#v1", "did:nuwa:cap:todo:");
        check("did:nuwa:cap:x:", "did:nuwa:cap:x:");
        check(
            "did:nuwa:app:my-app:state:Board_1#v10",
            "did:nuwa:app:my-app:",
        );
        check(
            "did:nuwa:user:z6MkAbc:state:Todo#v4",
            "did:nuwa:user:z6MkAbc:",
        );
        check("nuwa:schemas", "nuwa:");
        check("nuwa:", "nuwa:");
        // Malformed or owner-less names fall through to the default namespace.
        check("did:nuwa:cap:broken", "default");
        check("did:nuwa:cap:", "default");
        check("did:nuwa:cap::state:N#v1", "default");
        check("did:nuwa:user:", "default");
        check("did:nuwa:state:note#v1", "default");
        check("did:nuwa:other:x:y", "default");
        check("notes", "default");
        check("default", "default");
        check("", "default");
        check("did:nuwa:app:é:state:X#v1", "did:nuwa:app:é:");
        check("did:nuwa:app:é", "default");
    }

    // Goal: namespace_of is total and returns a prefix of its input or a fixed name;
    // method: every string over a small alphabet of the tricky pieces, up to four pieces.
    #[test]
    fn namespace_of_is_total() {
        let pieces = [
            "did:nuwa:",
            "cap:",
            "core:",
            "user:",
            ":",
            "x",
            "é",
            "nuwa:",
            "",
        ];
        let mut names = vec![String::new()];
        for _ in 0..4 {
            let mut next = Vec::new();
            for name in &names {
                for piece in pieces {
                    next.push(format!("{name}{piece}"));
                }
            }
            names = next;
        }
        for name in &names {
            let ns = namespace_of(name);
            assert!(
                ns == DEFAULT_NAMESPACE || name.starts_with(ns),
                "{name:?} -> {ns:?}"
            );
        }
    }
}
