//! The vocabulary of the Agent State Model (NIP-8) shared by the schema
//! parser, the Automerge document layer and the query engine: container
//! kinds, CRDT keywords, lifecycle and visibility annotations, and the
//! [`Layout`] a document needs to store items faithfully.
//!
//! Nothing here parses JSON Schema or touches Automerge; see `schema` and
//! `doc`.

use std::collections::BTreeMap;
use std::fmt;

/// `x-asm.container`: the top-level shape of a container.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ContainerKind {
    /// Structured records (one item per id), fields merged per their policy.
    Object,
    /// Key to value (the key is the item id); add-wins at key level.
    Map,
    /// An ordered sequence of items.
    List,
    /// An append-only event stream of items.
    Log,
}

impl ContainerKind {
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "object" => Self::Object,
            "map" => Self::Map,
            "list" => Self::List,
            "log" => Self::Log,
            _ => return None,
        })
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Object => "object",
            Self::Map => "map",
            Self::List => "list",
            Self::Log => "log",
        }
    }
}

impl fmt::Display for ContainerKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A CRDT keyword: the canonical `x-crdt` keywords of NIP-8, plus the
/// container-level `append_only` of `ConversationLog`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum CrdtKind {
    /// Last writer wins (Automerge's deterministic winner among concurrent
    /// puts: highest Lamport counter, then actor).
    LwwRegister,
    /// Multi-value register: concurrent values are all kept and exposed as
    /// conflicts until a later write supersedes them.
    MvRegister,
    /// Collaborative text (Automerge text): concurrent edits interleave.
    RgaText,
    /// A set that only grows: concurrent adds union, nothing is removed.
    GrowOnlySet,
    /// Observed-remove map: a key removed concurrently with a write to it
    /// survives (add wins).
    OrMap,
    /// A counter: concurrent increments sum.
    Counter,
    /// An enable-wins flag: concurrent enable and disable give `true`.
    Flag,
    /// A replicated growable array of entries: concurrent appends are all
    /// kept, in one order every replica agrees on.
    LogRga,
    /// Container-level: past entries can be neither edited nor deleted.
    AppendOnly,
}

impl CrdtKind {
    /// Every keyword, for tables and error messages.
    pub const ALL: [CrdtKind; 9] = [
        Self::LwwRegister,
        Self::MvRegister,
        Self::RgaText,
        Self::GrowOnlySet,
        Self::OrMap,
        Self::Counter,
        Self::Flag,
        Self::LogRga,
        Self::AppendOnly,
    ];

    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|k| k.as_str() == s)
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Self::LwwRegister => "lww_register",
            Self::MvRegister => "mv_register",
            Self::RgaText => "rga_text",
            Self::GrowOnlySet => "grow_only_set",
            Self::OrMap => "or_map",
            Self::Counter => "counter",
            Self::Flag => "flag",
            Self::LogRga => "log_rga",
            Self::AppendOnly => "append_only",
        }
    }
}

impl fmt::Display for CrdtKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// `x-compression` of stored snapshots.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Compression {
    Br,
    Zstd,
    Gzip,
}

impl Compression {
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "br" => Self::Br,
            "zstd" => Self::Zstd,
            "gzip" => Self::Gzip,
            _ => return None,
        })
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Br => "br",
            Self::Zstd => "zstd",
            Self::Gzip => "gzip",
        }
    }
}

/// `x-visibility`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Visibility {
    #[default]
    Private,
    Shared,
    Public,
}

impl Visibility {
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "private" => Self::Private,
            "shared" => Self::Shared,
            "public" => Self::Public,
            _ => return None,
        })
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Private => "private",
            Self::Shared => "shared",
            Self::Public => "public",
        }
    }
}

/// `x-retention.strategy`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RetentionStrategy {
    /// Items older than the window are evicted unless their `importance`
    /// is at least the keep threshold (see the lifecycle module).
    EvictLowImportance,
}

impl RetentionStrategy {
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "evict_low_importance" => Some(Self::EvictLowImportance),
            _ => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Self::EvictLowImportance => "evict_low_importance",
        }
    }
}

/// `x-retention`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Retention {
    pub window_secs: u64,
    pub strategy: RetentionStrategy,
}

/// How a container stores its items: what the Automerge layer needs to know
/// about a schema.
///
/// Every container holds items keyed by a string id. An item is a JSON
/// object; each of its top-level fields is stored per its [`CrdtKind`]
/// (`fields`, else `default_field`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layout {
    pub container: ContainerKind,
    /// Container-level policy (`append_only` for logs), if declared.
    pub container_crdt: Option<CrdtKind>,
    /// Policy per top-level field of an item.
    pub fields: BTreeMap<String, CrdtKind>,
    /// Policy of fields not listed in `fields`.
    pub default_field: CrdtKind,
}

impl Layout {
    /// The policy of field `name`.
    pub fn field(&self, name: &str) -> CrdtKind {
        self.fields.get(name).copied().unwrap_or(self.default_field)
    }

    /// Whether past items may be neither edited nor deleted.
    pub fn append_only(&self) -> bool {
        self.container_crdt == Some(CrdtKind::AppendOnly)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // Goal: every keyword and annotation value round-trips through its
    // string form, and unknown words are refused.
    #[test]
    fn keywords_round_trip() {
        for k in CrdtKind::ALL {
            assert_eq!(CrdtKind::parse(k.as_str()), Some(k));
        }
        assert_eq!(CrdtKind::parse("lww"), None);
        for k in [
            ContainerKind::Object,
            ContainerKind::Map,
            ContainerKind::List,
            ContainerKind::Log,
        ] {
            assert_eq!(ContainerKind::parse(k.as_str()), Some(k));
        }
        for c in [Compression::Br, Compression::Zstd, Compression::Gzip] {
            assert_eq!(Compression::parse(c.as_str()), Some(c));
        }
        for v in [Visibility::Private, Visibility::Shared, Visibility::Public] {
            assert_eq!(Visibility::parse(v.as_str()), Some(v));
        }
        assert_eq!(
            RetentionStrategy::parse("evict_low_importance"),
            Some(RetentionStrategy::EvictLowImportance)
        );
    }
}
