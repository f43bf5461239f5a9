//! The access decision: may a verified capability do an action to a
//! container of a given visibility (NIP-8 `x-visibility`)?
//!
//! * `private`: only a capability whose target covers the container's whole
//!   namespace (`did:nuwa:cap:weather:` for `did:nuwa:cap:weather:state:…`);
//! * `shared`: that, or a capability naming exactly this container;
//! * `public`: any valid capability may `read`, `query` and `events`; other
//!   actions follow the private rule.
//!
//! In every case the action must be one the capability allows. A target
//! narrower than a namespace but wider than one container (for example
//! `did:nuwa:cap:weather:state:`) therefore opens shared containers only by
//! their exact name, and private ones not at all. Which visibility a
//! container has is the caller's knowledge (its schema's `x-visibility`).

use std::fmt;

use crate::action::{self, Action};
use crate::error::Forbidden;
use crate::verify::Verified;

/// The namespaces owned by one capability, app or user: the prefix, then one
/// name segment, then `:`.
const OWNED_NAMESPACES: [&str; 3] = ["did:nuwa:cap:", "did:nuwa:app:", "did:nuwa:user:"];
/// The platform's own namespace.
const CORE_NAMESPACE: &str = "did:nuwa:core:";

/// A container's `x-visibility` (NIP-8).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Visibility {
    /// Only the namespace's own capability.
    Private,
    /// Also capabilities naming the container.
    Shared,
    /// Anyone with a valid capability may read.
    Public,
}

impl Visibility {
    /// The name `x-visibility` uses.
    pub fn as_str(self) -> &'static str {
        match self {
            Visibility::Private => "private",
            Visibility::Shared => "shared",
            Visibility::Public => "public",
        }
    }
}

impl fmt::Display for Visibility {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The NIP-8 namespace of a container name: `did:nuwa:core:`,
/// `did:nuwa:cap:<cap_id>:`, `did:nuwa:app:<app_name>:` or
/// `did:nuwa:user:<did_suffix>:`; any other name is its own namespace.
pub fn namespace_of(container: &str) -> &str {
    if container.starts_with(CORE_NAMESPACE) {
        return &container[..CORE_NAMESPACE.len()];
    }
    for prefix in OWNED_NAMESPACES {
        if let Some(rest) = container.strip_prefix(prefix) {
            return match rest.find(':') {
                Some(end) if end > 0 => &container[..prefix.len() + end + 1],
                _ => container,
            };
        }
    }
    container
}

/// Whether a capability target reaches `container`: it names it, or it is a
/// prefix of it ending in `:`.
pub fn covers(target: &str, container: &str) -> bool {
    target == container || (target.ends_with(':') && container.starts_with(target))
}

/// May the capability `inv` do `action` to `container`, whose visibility is
/// `visibility`? See the module docs for the rule.
pub fn may(
    inv: &Verified,
    action: Action,
    container: &str,
    visibility: Visibility,
) -> Result<(), Forbidden> {
    if !inv.actions.contains(&action) {
        return Err(Forbidden::ActionNotGranted {
            target: inv.target.clone(),
            action,
            allowed: action::join(&inv.actions),
        });
    }
    if visibility == Visibility::Public && action.is_read_only() {
        return Ok(());
    }
    let namespace = namespace_of(container);
    if covers(&inv.target, namespace) {
        return Ok(());
    }
    if visibility == Visibility::Shared && inv.target == container {
        return Ok(());
    }
    // Nothing in the refusal depends on the visibility (issue 41).
    Err(Forbidden::NotCovered {
        target: inv.target.clone(),
        container: container.to_owned(),
        action,
        namespace: namespace.to_owned(),
    })
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use super::*;

    fn check_namespace(container: &str, want: &str) {
        assert_eq!(namespace_of(container), want, "namespace of {container}");
    }

    // Goal: each NIP-8 namespace form maps to its prefix and anything else to itself, table-driven.
    #[test]
    fn namespaces() {
        check_namespace("did:nuwa:core:MemoryStore#v1", "did:nuwa:core:");
        check_namespace(
            "did:nuwa:cap:weather:state:Item#v1",
            "did:nuwa:cap:weather:",
        );
        check_namespace("did:nuwa:app:notes:state:Note#v2", "did:nuwa:app:notes:");
        check_namespace("did:nuwa:user:z6Mk:state:Todo#v1", "did:nuwa:user:z6Mk:");
        check_namespace("did:nuwa:cap:weather:", "did:nuwa:cap:weather:");
        // No owner segment, or none closed by ':': the whole name.
        check_namespace("did:nuwa:cap:weather", "did:nuwa:cap:weather");
        check_namespace("did:nuwa:cap::state:X#v1", "did:nuwa:cap::state:X#v1");
        check_namespace("did:nuwa:state:note#v1", "did:nuwa:state:note#v1");
        check_namespace("plain", "plain");
        check_namespace("", "");
    }

    // Goal: a target covers a container only by equality or by a ':'-ended prefix.
    #[test]
    fn coverage() {
        assert!(covers(
            "did:nuwa:cap:weather:",
            "did:nuwa:cap:weather:state:X#v1"
        ));
        assert!(covers(
            "did:nuwa:cap:weather:state:X#v1",
            "did:nuwa:cap:weather:state:X#v1"
        ));
        assert!(covers("did:nuwa:", "did:nuwa:cap:weather:"));
        assert!(!covers(
            "did:nuwa:cap:weather",
            "did:nuwa:cap:weathervane:state:X#v1"
        ));
        assert!(!covers("did:nuwa:cap:weather:", "did:nuwa:cap:weathe"));
        assert!(!covers(
            "did:nuwa:cap:weather:state:X#v1",
            "did:nuwa:cap:weather:state:X#v12"
        ));
    }

    fn inv(target: &str, actions: &[Action]) -> Verified {
        Verified {
            invoker_public: [0; 32],
            invoker_did: "did:key:z6Mk".to_owned(),
            target: target.to_owned(),
            actions: actions.iter().copied().collect::<BTreeSet<_>>(),
            expires_unix_secs: 0,
            chain_ids: Vec::new(),
        }
    }

    // Goal: the visibility rule of the module docs holds case by case, and refusals name what is missing.
    #[test]
    fn decisions() {
        use Action::{Query, Read, Write};
        use Visibility::{Private, Public, Shared};
        let item = "did:nuwa:cap:news:state:Item#v1";
        let ns = inv("did:nuwa:cap:news:", &[Read, Write]);
        let exact = inv(item, &[Read, Write]);
        let sub = inv("did:nuwa:cap:news:state:", &[Read, Write]);
        let other = inv("did:nuwa:cap:weather:", &[Read, Query, Write]);
        // (capability, action, visibility, allowed?)
        let cases = [
            (&ns, Read, Private, true),
            (&ns, Write, Private, true),
            (&ns, Query, Private, false), // action not granted
            (&exact, Read, Private, false),
            (&exact, Read, Shared, true),
            (&exact, Write, Shared, true),
            (&sub, Read, Shared, false),
            (&sub, Read, Private, false),
            (&sub, Read, Public, true),
            (&other, Read, Private, false),
            (&other, Read, Shared, false),
            (&other, Read, Public, true),
            (&other, Query, Public, true),
            (&other, Write, Public, false),
            (&ns, Write, Public, true),
        ];
        for (i, (cap, action, visibility, allowed)) in cases.into_iter().enumerate() {
            let got = may(cap, action, item, visibility);
            assert_eq!(got.is_ok(), allowed, "case {i}: {got:?}");
        }
        let refusal = may(&other, Read, item, Private).expect_err("refused");
        assert_eq!(
            refusal.to_string(),
            "the capability for did:nuwa:cap:weather: does not reach did:nuwa:cap:news:state:Item#v1; read there needs a capability for did:nuwa:cap:news:, or for did:nuwa:cap:news:state:Item#v1 itself if its schema makes it shared"
        );
        assert_eq!(refusal.code(), "container_not_covered");
        // A shared container is refused in the very same words (issue 41:
        // the message told a guessed name's visibility).
        for vis in [Shared, Public] {
            assert_eq!(
                may(&other, Write, item, vis),
                may(&other, Write, item, Private)
            );
        }
        let refusal = may(&ns, Query, item, Private).expect_err("refused");
        assert_eq!(refusal.code(), "action_not_granted");
        assert!(
            refusal.to_string().contains("allows read, write"),
            "{refusal}"
        );
    }
}
