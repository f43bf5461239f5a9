//! Opening what the home's store holds: every container (loaded, or cold
//! with only its heads when there are many), unreadable ones moved aside,
//! and the loader that brings an evicted container back on first use.

use std::sync::Arc;

use anyhow::{Context, Result};
use nuwa_agent::state::Container;
use nuwa_agent::status::QuarantineStatus;
use nuwa_agent::storage::{Logged, heads};
use nuwa_agent::sync::Engine;
use nuwa_store::Storage;
use tracing::{debug, info, warn};

use super::ledger::Ledger;
use crate::home::Home;
use crate::metrics::{Event, Metrics};

/// Up to this many containers stay in memory at start; with more, all but
/// the schema registry start evicted.
const LOADED_AT_START: usize = 256;

/// The engine over what the store holds, and the store's bookkeeping.
pub(super) struct Opened {
    pub engine: Engine,
    pub quarantined: Vec<QuarantineStatus>,
    pub ledger: Ledger,
}

/// A container as the store holds it: decrypted, decompressed, loaded.
pub(crate) struct LoadedContainer {
    pub container: Container,
    /// Sequence number of the last logged change.
    pub last_seq: u64,
    /// What was logged after the snapshot.
    pub logged: Logged,
    /// The snapshot's stored size (0: none).
    pub snapshot_bytes: u64,
}

pub(crate) fn load_container(
    store: &dyn Storage,
    actor: &[u8],
    name: &str,
) -> Result<Option<LoadedContainer>> {
    let Some(rec) = store.load_container(name)? else {
        return Ok(None);
    };
    let logged = Logged::of(&rec.changes);
    let snapshot_bytes = rec.snapshot.as_ref().map_or(0, |s| s.len() as u64);
    let snapshot = match rec.snapshot.as_deref() {
        Some(s) => Some(
            nuwa_agent::asm_model::snapshot::decompress(s)
                .with_context(|| format!("cannot read the snapshot of container {name:?}"))?,
        ),
        None => None,
    };
    let container = Container::load(actor, snapshot.as_deref(), rec.changes)
        .with_context(|| format!("cannot load container {name:?}"))?;
    Ok(Some(LoadedContainer {
        container,
        last_seq: rec.last_seq,
        logged,
        snapshot_bytes,
    }))
}

/// A container kept out of memory at start: its heads (in the flat buffer
/// of all of them), change count and ledger entries (bytes logged: 0).
struct Cold {
    name: String,
    heads: usize,
    changes: usize,
    last_seq: u64,
    logged: Logged,
}

/// The engine over what the store holds. One unreadable container must not
/// stop the device: its records are moved aside (kept) and peers resync
/// it, since to them it is simply missing here.
pub(super) fn open_engine(
    home: &Home,
    shared: &Arc<dyn Storage>,
    metrics: &Arc<Metrics>,
) -> Result<Opened> {
    let store = shared.as_ref();
    // A fresh actor per run: see `run_actor` (a restored home must not clash).
    let actor = nuwa_agent::sync::run_actor(&home.device.public())
        .context("cannot draw the run's actor id")?;
    // A peer's input for an evicted container never waits on the loop for
    // the load (a million entries take seconds).
    let config = nuwa_agent::sync::Config {
        load_off_loop: true,
        ..nuwa_agent::sync::Config::default()
    };
    let mut engine = Engine::new(actor.clone(), config);
    let mut ledger = Ledger::default();
    let (names, unnamed) = store.list_containers_quarantining()?;
    let mut quarantined: Vec<QuarantineStatus> = unnamed
        .into_iter()
        .map(|q| QuarantineStatus {
            container: None,
            reason: format!("name record {}: {}", q.id, q.reason),
            records: q.records,
        })
        .collect();
    let cold_at_start = names.len() > LOADED_AT_START;
    debug!(
        containers = names.len(),
        rss_mb = rss_bytes().unwrap_or(0) / 1_000_000,
        "loading containers"
    );
    let mut cold: Vec<Cold> = Vec::new();
    let mut cold_heads: Vec<nuwa_agent::state::Hash> = Vec::new();
    if cold_at_start {
        cold.reserve_exact(names.len());
    }
    for name in names {
        let registry = name == nuwa_agent::asm::REGISTRY_CONTAINER;
        if cold_at_start && !registry {
            // The heads record spares reading the container at all.
            if let Some(r) = heads_record_of(store, &name) {
                cold_heads.extend_from_slice(&r.heads);
                cold.push(Cold {
                    name,
                    heads: r.heads.len(),
                    changes: r.changes as usize,
                    last_seq: r.last_seq,
                    logged: Logged {
                        changes: r.logged,
                        bytes: 0,
                    },
                });
                continue;
            }
        }
        let loaded = match load_container(store, &actor, &name) {
            Ok(Some(loaded)) => loaded,
            Ok(None) => continue,
            Err(e) => {
                quarantined.push(quarantine(store, name, e)?);
                continue;
            }
        };
        if cold_at_start && !registry {
            // More containers than memory should hold: keep what digests
            // and status need; the document loads again on first use.
            // Heads go to one flat buffer and the maps are built after the
            // loop, so that no small allocation that lives on lands
            // between the documents freed here (the heap pages holding it
            // could not go back to the system).
            let heads = loaded.container.heads();
            cold_heads.extend_from_slice(&heads);
            cold.push(Cold {
                name,
                heads: heads.len(),
                changes: loaded.container.change_count(),
                last_seq: loaded.last_seq,
                logged: loaded.logged,
            });
        } else {
            ledger.reloaded(&name, &loaded);
            engine.insert_container(name, loaded.container);
        }
    }
    // Loading every container allocated and freed a lot: give it back
    // before the long-lived maps are built.
    super::release_free_memory();
    let mut at = 0;
    for c in cold {
        let heads = cold_heads[at..at + c.heads].to_vec();
        at += c.heads;
        ledger.last_seq.insert(c.name.clone(), c.last_seq);
        ledger.logged.insert(c.name.clone(), c.logged);
        engine.insert_cold(c.name, heads, c.changes);
    }
    info!(
        containers = engine.container_count(),
        in_memory = engine.loaded_count(),
        rss_mb = rss_bytes().unwrap_or(0) / 1_000_000,
        "store opened"
    );
    engine.set_loader(loader(shared.clone(), actor, metrics.clone()));
    Ok(Opened {
        engine,
        quarantined,
        ledger,
    })
}

fn heads_record_of(store: &dyn Storage, name: &str) -> Option<heads::HeadsRecord> {
    store
        .get_meta(&heads::key(name))
        .ok()
        .flatten()
        .and_then(|b| heads::HeadsRecord::decode(&b))
}

/// Moves an unreadable container aside.
fn quarantine(store: &dyn Storage, name: String, e: anyhow::Error) -> Result<QuarantineStatus> {
    let reason = format!("{e:#}");
    let records = store
        .quarantine_container(&name)
        .with_context(|| format!("cannot move unreadable container {name:?} aside"))?;
    warn!(container = %name, %reason, records, "container unreadable: quarantined; peers will resync it");
    Ok(QuarantineStatus {
        container: Some(name),
        reason,
        records,
    })
}

/// How the engine loads an evicted container again: from the store, on
/// the loop (issue 26 moves this off it).
fn loader(
    store: Arc<dyn Storage>,
    actor: Vec<u8>,
    metrics: Arc<Metrics>,
) -> nuwa_agent::sync::Loader {
    Box::new(move |name: &str| {
        metrics.add(Event::ContainersLoaded, 1);
        load_container(store.as_ref(), &actor, name)
            .map(|l| l.map(|l| l.container))
            .map_err(|e| format!("{e:#}"))
    })
}

/// This process's peak resident memory (`VmHWM`) in bytes (Linux; `None`
/// elsewhere): `sync --once` reports it as it ends.
pub(in crate::daemon) fn peak_rss_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()?;
    Some(kb * 1024)
}

/// This process's resident memory in bytes (Linux; `None` elsewhere).
pub(in crate::daemon) fn rss_bytes() -> Option<u64> {
    let statm = std::fs::read_to_string("/proc/self/statm").ok()?;
    let pages: u64 = statm.split_whitespace().nth(1)?.parse().ok()?;
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    Some(pages * u64::try_from(page).ok()?)
}
