//! The actions a capability may allow (`allowedAction`) and a request may
//! invoke (`action=` of `Capability-Invocation`).
//!
//! The set is closed: an unknown action name makes a capability malformed,
//! so that an old daemon never silently ignores a right it does not know.

use std::fmt;

/// One thing an app may do to a container through the local HTTP API.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Action {
    /// Read documents.
    Read,
    /// Run queries.
    Query,
    /// Subscribe to change events.
    Events,
    /// Write documents.
    Write,
    /// Delete documents.
    Delete,
    /// Reset a container.
    Reset,
    /// Register or change schemas.
    Schema,
}

impl Action {
    /// Every action, in the canonical order `allowedAction` is written in.
    pub const ALL: [Action; 7] = [
        Action::Read,
        Action::Query,
        Action::Events,
        Action::Write,
        Action::Delete,
        Action::Reset,
        Action::Schema,
    ];

    /// The name on the wire.
    pub fn as_str(self) -> &'static str {
        match self {
            Action::Read => "read",
            Action::Query => "query",
            Action::Events => "events",
            Action::Write => "write",
            Action::Delete => "delete",
            Action::Reset => "reset",
            Action::Schema => "schema",
        }
    }

    /// The action with this wire name, if any (case-sensitive).
    pub fn parse(name: &str) -> Option<Action> {
        Action::ALL.into_iter().find(|a| a.as_str() == name)
    }

    /// Whether the action only reads: what any valid capability may do to a
    /// public container.
    pub fn is_read_only(self) -> bool {
        matches!(self, Action::Read | Action::Query | Action::Events)
    }
}

impl fmt::Display for Action {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// `read, write`: actions joined for messages.
pub(crate) fn join<'a>(actions: impl IntoIterator<Item = &'a Action>) -> String {
    let names: Vec<&str> = actions.into_iter().map(|a| a.as_str()).collect();
    names.join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    // Goal: every action's wire name parses back to it, and nothing else parses.
    #[test]
    fn names_round_trip() {
        for action in Action::ALL {
            assert_eq!(Action::parse(action.as_str()), Some(action));
        }
        for bad in ["", "READ", "read ", "admin", "*"] {
            assert_eq!(Action::parse(bad), None, "{bad:?} parsed");
        }
        // ALL is in Ord order, so a BTreeSet iterates in the canonical order.
        assert!(Action::ALL.windows(2).all(|w| w[0] < w[1]));
    }
}
