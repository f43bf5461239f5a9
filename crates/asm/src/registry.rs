//! The schema registry: every [`AsmSchema`] a node knows, by full id, with
//! the NIP-8 registration rules (no silent redefinition, versions only go
//! up, core ids reserved for the bundled core schemas).
//!
//! The registry is an in-memory value; it persists as a JSON array of raw
//! schemas ([`Registry::to_json`] / [`Registry::from_json`]) that the caller
//! stores. It does not isolate storage per namespace: the container name of
//! a schema is its full id, and keeping containers apart is the caller's
//! job. Nor does it check schema signatures or fetch schemas.

use std::collections::BTreeMap;

use serde_json::Value;
use thiserror::Error;

use crate::schema::{self, AsmSchema, Namespace, SchemaError, SchemaId};

/// Most schemas one registry holds.
pub const MAX_SCHEMAS: usize = 1024;

/// What [`Registry::register`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Registered {
    /// The schema is new.
    Added,
    /// The same schema was already registered under this id.
    Unchanged,
}

/// Why a schema was not registered.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum RegistryError {
    #[error(transparent)]
    Schema(#[from] SchemaError),
    #[error(
        "schema {id} is already registered with different content; publish the change as a new version (#v<n+1>)"
    )]
    Duplicate { id: String },
    #[error(
        "schema {base}#v{given} is not a version bump: v{registered} is already registered; use #v{} or higher",
        .registered.saturating_add(1)
    )]
    VersionNotBumped {
        base: String,
        registered: u32,
        given: u32,
    },
    #[error(
        "schema {id} is in the reserved core namespace; only the bundled NIP-8 core schemas may use did:nuwa:core: ids, pick a cap, app, user or state id"
    )]
    ReservedCore { id: String },
    #[error("the registry is full ({max} schemas); remove unused schemas first")]
    Full { max: usize },
    #[error("persisted registry is not a JSON array of schemas")]
    NotArray,
    #[error("persisted registry entry {index} was refused")]
    Entry {
        index: usize,
        #[source]
        source: Box<RegistryError>,
    },
}

/// Every known schema, by full id.
#[derive(Debug, Clone, Default)]
pub struct Registry {
    schemas: BTreeMap<String, AsmSchema>,
}

impl Registry {
    /// An empty registry.
    pub fn new() -> Self {
        Self::default()
    }

    /// A registry holding the three NIP-8 core schemas.
    pub fn with_core() -> Self {
        let mut registry = Self::new();
        for raw in schema::core_schemas() {
            // The bundled core schemas parse (tested in this crate) and have
            // distinct ids, so registering them in an empty registry cannot
            // fail.
            registry
                .register(raw)
                .expect("bundled core schema registers");
        }
        registry
    }

    /// Registers a schema.
    ///
    /// The same id with identical content is [`Registered::Unchanged`]; the
    /// same id with other content is refused, and a new version of a known
    /// base must be higher than every registered version of it. Core ids
    /// (`did:nuwa:core:...`) are refused unless `raw` is exactly a bundled
    /// core schema.
    pub fn register(&mut self, raw: Value) -> Result<Registered, RegistryError> {
        let parsed = schema::parse(&raw)?;
        self.insert(parsed)
    }

    fn insert(&mut self, parsed: AsmSchema) -> Result<Registered, RegistryError> {
        let id = &parsed.id;
        if id.namespace == Namespace::Core && !schema::is_bundled_core(&parsed.raw) {
            return Err(RegistryError::ReservedCore {
                id: id.full.clone(),
            });
        }
        if let Some(existing) = self.schemas.get(&id.full) {
            return if existing.raw == parsed.raw {
                Ok(Registered::Unchanged)
            } else {
                Err(RegistryError::Duplicate {
                    id: id.full.clone(),
                })
            };
        }
        if let Some(registered) = self.highest_version(&id.base)
            && registered >= id.version
        {
            return Err(RegistryError::VersionNotBumped {
                base: id.base.clone(),
                registered,
                given: id.version,
            });
        }
        if self.schemas.len() >= MAX_SCHEMAS {
            return Err(RegistryError::Full { max: MAX_SCHEMAS });
        }
        self.schemas.insert(id.full.clone(), parsed);
        Ok(Registered::Added)
    }

    /// The highest registered version of `base`, if any.
    fn highest_version(&self, base: &str) -> Option<u32> {
        self.schemas
            .values()
            .filter(|s| s.id.base == base)
            .map(|s| s.id.version)
            .max()
    }

    /// The schema registered under the full id `id` (with its `#v<n>`).
    pub fn get(&self, id: &str) -> Option<&AsmSchema> {
        self.schemas.get(id)
    }

    /// Every schema, ordered by full id.
    pub fn list(&self) -> impl Iterator<Item = &AsmSchema> {
        self.schemas.values()
    }

    /// How many schemas are registered.
    pub fn len(&self) -> usize {
        self.schemas.len()
    }

    pub fn is_empty(&self) -> bool {
        self.schemas.is_empty()
    }

    /// The registered schemas as a JSON array of raw schemas, for
    /// persistence; core schemas included.
    pub fn to_json(&self) -> Value {
        Value::Array(self.schemas.values().map(|s| s.raw.clone()).collect())
    }

    /// Rebuilds a registry from [`Registry::to_json`] output, re-checking
    /// every schema. Entries may come in any order: versions of one base are
    /// registered lowest first.
    pub fn from_json(v: &Value) -> Result<Self, RegistryError> {
        let entries = v.as_array().ok_or(RegistryError::NotArray)?;
        if entries.len() > MAX_SCHEMAS {
            return Err(RegistryError::Full { max: MAX_SCHEMAS });
        }
        let mut parsed = Vec::with_capacity(entries.len());
        for (index, raw) in entries.iter().enumerate() {
            let schema = schema::parse(raw).map_err(|e| RegistryError::Entry {
                index,
                source: Box::new(e.into()),
            })?;
            parsed.push((index, schema));
        }
        // Full ids sort `#v10` before `#v2`; order by version so the bump
        // rule sees versions as they were registered.
        parsed.sort_by(|(_, a), (_, b)| version_order(&a.id, &b.id));
        let mut registry = Self::new();
        for (index, schema) in parsed {
            registry.insert(schema).map_err(|e| RegistryError::Entry {
                index,
                source: Box::new(e),
            })?;
        }
        Ok(registry)
    }
}

fn version_order(a: &SchemaId, b: &SchemaId) -> std::cmp::Ordering {
    (a.base.as_str(), a.version).cmp(&(b.base.as_str(), b.version))
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn user_schema(version: u32, title_type: &str) -> Value {
        json!({
            "$id": format!("did:nuwa:user:alice:state:Todo#v{version}"),
            "type": "object",
            "properties": {
                "title": {"type": title_type},
                "done": {"type": "boolean", "x-crdt": "flag"}
            }
        })
    }

    // Goal: the core registry holds exactly the three bundled schemas and
    // re-registering them is a no-op.
    #[test]
    fn core_registry() {
        let mut registry = Registry::with_core();
        let ids: Vec<&str> = registry.list().map(|s| s.id.full.as_str()).collect();
        assert_eq!(
            ids,
            [
                "did:nuwa:core:AgentSettings#v1",
                "did:nuwa:core:ConversationLog#v1",
                "did:nuwa:core:MemoryStore#v1",
            ]
        );
        for raw in schema::core_schemas() {
            assert_eq!(registry.register(raw).ok(), Some(Registered::Unchanged));
        }
        assert_eq!(registry.len(), 3);
    }

    // Goal: the registration rules hold; method: a scripted sequence of
    // registrations on one registry, each with its expected outcome.
    #[test]
    fn registration_rules() {
        #[derive(Debug)]
        enum Want {
            Added,
            Unchanged,
            Duplicate,
            NotBumped(u32, u32),
            Reserved,
        }
        let mut altered_core = schema::core_schemas()[2].clone();
        altered_core["properties"]["extra"] = json!({"type": "string"});
        let mut new_core_model = schema::core_schemas()[2].clone();
        new_core_model["$id"] = json!("did:nuwa:core:Evil#v1");
        let steps: Vec<(&str, Value, Want)> = vec![
            ("first version", user_schema(2, "string"), Want::Added),
            ("same again", user_schema(2, "string"), Want::Unchanged),
            (
                "same id, new content",
                user_schema(2, "integer"),
                Want::Duplicate,
            ),
            (
                "lower version",
                user_schema(1, "string"),
                Want::NotBumped(2, 1),
            ),
            ("bump", user_schema(3, "string"), Want::Added),
            (
                "old version again",
                user_schema(2, "string"),
                Want::Unchanged,
            ),
            ("skip ahead", user_schema(10, "string"), Want::Added),
            ("between", user_schema(5, "string"), Want::NotBumped(10, 5)),
            ("altered core", altered_core, Want::Reserved),
            ("new core model", new_core_model, Want::Reserved),
            (
                "bundled core",
                schema::core_schemas()[0].clone(),
                Want::Added,
            ),
        ];
        let mut registry = Registry::new();
        for (name, raw, want) in steps {
            let got = registry.register(raw);
            let ok = match (&want, &got) {
                (Want::Added, Ok(Registered::Added)) => true,
                (Want::Unchanged, Ok(Registered::Unchanged)) => true,
                (Want::Duplicate, Err(RegistryError::Duplicate { id })) => {
                    id == "did:nuwa:user:alice:state:Todo#v2"
                }
                (
                    Want::NotBumped(r, g),
                    Err(RegistryError::VersionNotBumped {
                        base,
                        registered,
                        given,
                    }),
                ) => base == "did:nuwa:user:alice:state:Todo" && registered == r && given == g,
                (Want::Reserved, Err(RegistryError::ReservedCore { .. })) => true,
                _ => false,
            };
            assert!(ok, "step {name:?}: want {want:?}, got {got:?}");
        }
        assert_eq!(registry.len(), 4);
        let err = registry
            .register(user_schema(4, "string"))
            .expect_err("v4 is below v10");
        assert!(err.to_string().contains("use #v11 or higher"), "{err}");
    }

    // Goal: a schema that does not parse is refused with the schema error.
    #[test]
    fn bad_schema_refused() {
        let mut registry = Registry::new();
        let err = registry
            .register(json!({"$id": "did:nuwa:bad", "type": "object"}))
            .expect_err("bad id");
        assert!(
            matches!(err, RegistryError::Schema(SchemaError::BadId { .. })),
            "{err}"
        );
        assert!(registry.is_empty());
    }

    // Goal: persistence round-trips, whatever the order of the persisted
    // array, including versions whose ids sort out of numeric order.
    #[test]
    fn json_round_trip() {
        let mut registry = Registry::with_core();
        for v in [1, 2, 10] {
            registry
                .register(user_schema(v, "string"))
                .expect("register");
        }
        let saved = registry.to_json();
        let restored = Registry::from_json(&saved).expect("restore");
        assert_eq!(restored.to_json(), saved);
        assert_eq!(restored.len(), 6);

        let mut reversed = saved.as_array().cloned().unwrap_or_default();
        reversed.reverse();
        let restored = Registry::from_json(&Value::Array(reversed)).expect("restore reversed");
        assert_eq!(restored.to_json(), saved);
        assert!(restored.get("did:nuwa:core:MemoryStore#v1").is_some());
    }

    // Goal: a corrupt persisted registry is refused naming the entry.
    #[test]
    fn from_json_refuses_bad_entries() {
        assert!(matches!(
            Registry::from_json(&json!({})),
            Err(RegistryError::NotArray)
        ));
        let err = Registry::from_json(&json!([user_schema(1, "string"), {"type": "object"}]))
            .expect_err("entry 1 has no $id");
        assert!(
            matches!(err, RegistryError::Entry { index: 1, .. }),
            "{err}"
        );
        let err = Registry::from_json(&json!([
            user_schema(1, "string"),
            user_schema(1, "integer")
        ]))
        .expect_err("duplicate");
        assert!(matches!(err, RegistryError::Entry { .. }), "{err}");
    }

    // Goal: the registry holds at most MAX_SCHEMAS schemas.
    #[test]
    fn registry_is_bounded() {
        let mut registry = Registry::new();
        for i in 0..MAX_SCHEMAS {
            let raw = json!({"$id": format!("did:nuwa:user:u:state:S{i}#v1"), "type": "object"});
            assert_eq!(
                registry.register(raw).ok(),
                Some(Registered::Added),
                "schema {i}"
            );
        }
        let raw = json!({"$id": "did:nuwa:user:u:state:Overflow#v1", "type": "object"});
        assert!(matches!(
            registry.register(raw),
            Err(RegistryError::Full { max: MAX_SCHEMAS })
        ));
    }
}
