//! `nuwa-node`: the nuwa-sync daemon and its command-line client.
//!
//! This crate is the only one that knows about processes, the CLI, the home
//! directory's files and the local HTTP API. The protocol logic lives in the
//! library crates; see ARCHITECTURE.md.

mod api;
mod client;
mod config;
mod constants;
mod daemon;
mod doctor;
mod home;
mod infra;
mod logging;
mod metrics;
mod pair;
mod panic_hook;
mod recovery;
mod service;

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use nuwa_agent::api::GetQuery;
use nuwa_net::Multiaddr;

const ABOUT: &str = "nuwa-node keeps one AI agent's state identical across all of its devices: \
private (end-to-end encrypted), offline-first, peer to peer.";

const AFTER_HELP: &str = "\
Quick start (three devices of one agent on this machine):
  nuwa-node --home /tmp/a init --name laptop
  nuwa-node --home /tmp/a device provision --out /tmp/b --name phone
  nuwa-node --home /tmp/a run &      # likewise for /tmp/b
  nuwa-node --home /tmp/a state put notes today '\"buy milk\"'
  nuwa-node --home /tmp/b state get notes

Add a device by code: `nuwa-node --home /tmp/c pair` on it prints a code;
`nuwa-node --home /tmp/a device approve CODE` approves it (/tmp/a is an
admin: `init` ran there; `device promote` makes more). Remove one with
`nuwa-node --home /tmp/a device revoke NAME` (or its context id).

Output: text for people by default; with --json (before or after the
command), one JSON document on stdout for scripts (a stream prints one per
line). Errors go to stderr with a non-zero exit status.

Logs go to stderr (or to files with `run --log-file DIR`); set RUST_LOG
(e.g. RUST_LOG=debug) for more detail. To run the daemon at login or boot:
`nuwa-node service install --user`.";

#[derive(Parser, Debug)]
#[command(name = "nuwa-node", version, about = ABOUT, after_help = AFTER_HELP)]
struct Cli {
    /// Home directory holding this device's keys, the agent's DID log and the
    /// encrypted store. Default: the platform's data directory.
    #[arg(long, global = true, env = "NUWA_HOME", value_name = "DIR")]
    home: Option<PathBuf>,

    /// Machine-readable output: a command that prints data prints one
    /// compact JSON document on stdout instead of text (`state events`: one
    /// per line).
    #[arg(long, global = true)]
    json: bool,

    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Create a new agent (DID document, master key, sync key, recovery
    /// key) with this device as its first device. This home then holds the
    /// agent's master key (an admin key: it approves, provisions, promotes
    /// and revokes devices). The recovery key is shown once as 12 words:
    /// write them down; a few are asked back. They are the way back when
    /// every admin device is lost (`nuwa-node recover`).
    Init {
        /// A name for this device, shown in status and `device list`
        /// (default: none).
        #[arg(long, default_value = "")]
        name: String,
        /// Skip asking recovery words back (for scripts, which must keep
        /// the words printed; with --json they are in `recovery_words`).
        #[arg(long)]
        i_have_written_it_down: bool,
    },
    /// Become the agent's admin again with the recovery words, when every
    /// admin device is lost. It signs, with the words' key, the DID update
    /// that makes this device an admin, removes the master key of `init`
    /// and every --lost device, and replaces the recovery words (the new
    /// ones are shown once). It opens a new key epoch for the devices that
    /// remain, so a lost device reads nothing written after. On a device
    /// that is still one of the agent's, run it with the daemon stopped,
    /// then start the daemon: peers adopt the update as they connect. On a
    /// fresh home it shows a pairing code: on any device of the agent that
    /// still runs, `device approve --recovery CODE` hands over the DID log,
    /// the keys sealed to the recovery key and the devices' names; with no
    /// --lost, on a terminal, it lists the devices (name, last seen) and
    /// asks which were lost; then it syncs. The words are read from the
    /// terminal, from --words-file, or from stdin.
    Recover(Box<RecoverArgs>),
    /// The agent's recovery words.
    Recovery {
        #[command(subcommand)]
        command: RecoveryCommand,
    },
    /// Join an agent as a new device: on a fresh home, print a one-time
    /// pairing code (and its QR) and wait until an admin device of the
    /// agent (the home where `init` ran, or a promoted device; its daemon
    /// running) runs `nuwa-node --home THAT_HOME device approve CODE`. Then write the
    /// home and run the initial sync. A wrong code is refused on both sides;
    /// three wrong attempts burn the code; the code expires (default 10
    /// minutes).
    Pair {
        /// A name for this device [default: the host name].
        #[arg(long)]
        name: Option<String>,
        /// How long the code stays valid, e.g. 10m.
        #[arg(long, value_name = "DURATION", default_value = "10m", value_parser = parse_duration)]
        ttl: std::time::Duration,
        /// Stop after pairing, without the initial sync.
        #[arg(long)]
        no_sync: bool,
        /// Give the initial sync this long.
        #[arg(long, value_name = "DURATION", default_value = "60s", value_parser = parse_duration)]
        sync_timeout: std::time::Duration,
        /// Ask to be a short-lived device (a CI job): peers refuse it once
        /// DURATION (e.g. 10m, 2h, 30d) has passed since it was approved, and an admin
        /// prunes it, with no revocation. The approver's --expires, if shorter, wins.
        #[arg(long, value_name = "DURATION", value_parser = parse_expires)]
        expires: Option<u64>,
        /// Network, discovery and API settings; each overrides its key in
        /// HOME/config.toml, and each can come from its NUWA_ variable.
        #[command(flatten)]
        net: config::Settings,
    },
    /// Manage the agent's devices.
    Device {
        #[command(subcommand)]
        command: DeviceCommand,
    },
    /// Apps of the agent (a runtime, a capability package, a notes app):
    /// each holds its own Ed25519 key and reads and writes state through
    /// the daemon's API with a capability (ZCAP-LD) for part of it, signing
    /// every request (docs/api.md, "Apps"). The owner's token and the local
    /// socket keep full access.
    App {
        #[command(subcommand)]
        command: AppCommand,
    },
    /// Run the daemon in the foreground until SIGINT or SIGTERM.
    Run {
        /// How often the lifecycle task applies x-ttl and x-retention.
        #[arg(long, value_name = "DURATION", default_value = "30s", value_parser = parse_duration)]
        lifecycle_every: std::time::Duration,
        /// Network, discovery and API settings; each overrides its key in
        /// HOME/config.toml, and each can come from its NUWA_ variable.
        #[command(flatten)]
        net: config::Settings,
        /// Where logs go.
        #[command(flatten)]
        log: logging::LogArgs,
    },
    /// Sync headlessly (for CI): start, discover, sync every container with
    /// every reachable verified peer, and exit once converged with at least
    /// one peer (or a keeper), or at the timeout. Progress goes to stderr
    /// while it waits, at least every 5 s. Exit status: 0 converged; 2 a
    /// usage or configuration error (a bad flag, config.toml or home); 3 no
    /// verified peer reached before the timeout (an outage, or discovery
    /// that finds nobody); 4 peers reached but not all in sync at the
    /// timeout; 1 any other failure. With --json: one JSON result on stdout
    /// either way: {"converged", "outcome" ("converged", "no_peer" or
    /// "timeout"), "through" ("peers", "keeper" or null), "peers_verified",
    /// "peers_in_sync", "containers", "message", "longest_loop_turn_ms"}.
    /// Then `state get --offline` and `state export --offline` read what it
    /// pulled, with no daemon.
    Sync {
        /// Exit after one convergence (required; the only mode so far).
        #[arg(long)]
        once: bool,
        /// Give up after this long, e.g. 30s, 2m, 500ms.
        #[arg(long, value_name = "DURATION", default_value = "60s", value_parser = parse_duration)]
        timeout: std::time::Duration,
        /// Network, discovery and API settings; each overrides its key in
        /// HOME/config.toml, and each can come from its NUWA_ variable.
        #[command(flatten)]
        net: config::Settings,
    },
    /// Run an infrastructure node: libp2p rendezvous server, DHT server and
    /// bootstrap node, relay and AutoNAT server, and with --keeper a keeper.
    /// It is untrusted: it sees no state, verifies DHT records and keeper
    /// pushes before storing them, and bounds what each peer and agent may
    /// take. Prints each listen address with its /p2p/ id on start.
    Rendezvous(Box<InfraArgs>),
    /// Show this device, the agent DID, verified peers, rejections and
    /// containers (asks the running daemon).
    Status,
    /// Open the status page of the running daemon in a browser: asks the
    /// daemon for a one-time login link (valid 60 s, works once), prints it
    /// and opens it with xdg-open (Linux) or open (macOS). The link logs the
    /// browser in with a session cookie; the page then shows devices, peers,
    /// sync state and containers, live.
    Open {
        /// Only print the link and start no browser (to paste it into a
        /// browser yourself, or for scripts).
        #[arg(long)]
        print: bool,
    },
    /// Read and write state through the running daemon (`get` and `export`
    /// also read the home with none: --offline).
    State {
        #[command(subcommand)]
        command: StateCommand,
    },
    /// Run the daemon as a service that starts at login (--user) or at boot:
    /// a systemd unit on Linux, a launchd agent or daemon on macOS.
    Service {
        #[command(subcommand)]
        command: service::ServiceCommand,
    },
    /// Check this home and its daemon, and explain: home permissions, the
    /// daemon, clock offset against peers, mDNS interfaces, reachability
    /// (AutoNAT, relays, keepers, rendezvous), verified peers, the DHT
    /// pointer's size, disk space, and whether the master key is backed up.
    /// Each check prints PASS, WARN, FAIL or SKIP with what it found and,
    /// for a warning or failure, the fix. Exits 0 when nothing failed
    /// (warnings allowed), 1 otherwise.
    ///
    /// Settings flags (e.g. --mdns-interface, --no-mdns, --rendezvous) are
    /// read as `run` reads them, over HOME/config.toml: give the same flags
    /// the daemon was started with.
    ///
    /// With --json: {"ok": bool, "checks": [{"name", "status", "detail", "fix"}]}.
    Doctor {
        /// The daemon's settings, when given as flags rather than in
        /// HOME/config.toml.
        #[command(flatten)]
        net: config::Settings,
    },
    /// The agent's master key (HOME/master.key, only where `init` ran): an
    /// admin key, which approves, promotes and revokes devices.
    MasterKey {
        #[command(subcommand)]
        command: MasterKeyCommand,
    },
}

/// `recover`'s options.
#[derive(clap::Args, Debug)]
struct RecoverArgs {
    /// A lost device to remove (its context id, see `device list`;
    /// repeatable). On a fresh home without it, a terminal is asked.
    #[arg(long, value_name = "CONTEXT_ID")]
    lost: Vec<String>,
    /// On a fresh home: a name for this device (a terminal is asked;
    /// without one, the host name).
    #[arg(long)]
    name: Option<String>,
    /// Read the recovery words from this file instead of the terminal.
    #[arg(long, value_name = "FILE")]
    words_file: Option<PathBuf>,
    /// Skip asking the new words back (scripts; with --json they are in
    /// `recovery_words`).
    #[arg(long)]
    i_have_written_it_down: bool,
    /// On a fresh home: how long the code stays valid, e.g. 10m.
    #[arg(long, value_name = "DURATION", default_value = "10m", value_parser = parse_duration)]
    ttl: std::time::Duration,
    /// On a fresh home: give the initial sync this long.
    #[arg(long, value_name = "DURATION", default_value = "60s", value_parser = parse_duration)]
    sync_timeout: std::time::Duration,
    /// Network, discovery and API settings (a fresh home pairs to get
    /// the log and keys); each overrides its key in HOME/config.toml.
    #[command(flatten)]
    net: config::Settings,
}

/// `rendezvous`'s options.
#[derive(clap::Args, Debug)]
struct InfraArgs {
    /// Address to listen on (repeatable).
    #[arg(
        long,
        value_name = "MULTIADDR",
        default_values = ["/ip4/0.0.0.0/tcp/4001", "/ip4/0.0.0.0/udp/4001/quic-v1"]
    )]
    listen: Vec<Multiaddr>,
    /// Most registrations one peer may hold.
    #[arg(long, default_value_t = 16)]
    max_registrations_per_peer: usize,
    /// Most registrations in total.
    #[arg(long, default_value_t = 100_000)]
    max_registrations: usize,
    /// Also be a keeper: store the sealed changes that agents' devices
    /// push (in HOME/keeper), for devices that are never online
    /// together. It never holds a key; it checks every push against the
    /// agent's DID log and serves only the agent's active devices.
    #[arg(long)]
    keeper: bool,
    /// Keeper quota per agent, in MiB.
    #[arg(long, value_name = "MIB", default_value_t = 64)]
    keeper_quota_mib: u64,
    /// Keeper quota per agent, in envelopes.
    #[arg(long, value_name = "N", default_value_t = 100_000)]
    keeper_quota_envelopes: u64,
    /// How long a keeper keeps an envelope, in days.
    #[arg(long, value_name = "DAYS", default_value_t = 30)]
    keeper_retention_days: u64,
    /// Where logs go.
    #[command(flatten)]
    log: logging::LogArgs,
}

#[derive(Subcommand, Debug)]
enum RecoveryCommand {
    /// Make new recovery words and list their key in the DID document as the
    /// agent's recovery key, replacing any earlier one (its words stop
    /// working). For agents created before recovery words existed, or to
    /// replace words that may be known. Needs an admin device; works
    /// through its running daemon or on its home.
    Create {
        /// Skip asking the words back (scripts; with --json they are in
        /// `recovery_words`).
        #[arg(long)]
        i_have_written_it_down: bool,
    },
}

#[derive(Subcommand, Debug)]
enum MasterKeyCommand {
    /// Copy the master key to FILE (mode 0600, synced to disk) and record
    /// the backup in the home, so that `doctor` stops warning. Refuses to
    /// overwrite FILE and refuses a FILE inside the home. Keep the copy
    /// offline (a USB stick, a password manager): whoever holds it can
    /// add and remove this agent's devices.
    Backup {
        /// Where to write the copy; must not exist yet.
        #[arg(long, value_name = "FILE")]
        out: PathBuf,
    },
}

/// `30s`, `2m`, `500ms`, `1h30m` (humantime's syntax); a bare number is
/// seconds. Overflow is an error, never a wrapped value.
fn parse_duration(s: &str) -> Result<std::time::Duration, String> {
    let s = s.trim();
    let with_unit = if !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()) {
        format!("{s}s")
    } else {
        s.to_owned()
    };
    humantime::parse_duration(&with_unit)
        .map_err(|e| format!("{s:?} is not a duration ({e}); use e.g. 30s, 2m, 500ms or 1h"))
}

fn parse_expires(s: &str) -> Result<u64, String> {
    nuwa_agent::expiry::parse_expires(s, home::now_unix_secs()).map_err(|e| e.to_string())
}

fn parse_json(what: &str, text: &str) -> Result<serde_json::Value> {
    serde_json::from_str(text).with_context(|| format!("{what} is not valid JSON: {text:?}"))
}

fn parse_addrs(what: &str, list: &[String]) -> Result<Vec<Multiaddr>> {
    list.iter()
        .map(|a| {
            a.parse::<Multiaddr>()
                .with_context(|| format!("{what} {a:?} is not a valid multiaddr"))
        })
        .collect()
}

/// Addresses that must name their peer (`/p2p/...`): infrastructure nodes.
fn with_peers(what: &str, list: &[String]) -> Result<Vec<(nuwa_net::PeerId, Multiaddr)>> {
    parse_addrs(what, list)?
        .into_iter()
        .map(|a| {
            nuwa_net::peer_in(&a)
                .map(|p| (p, a.clone()))
                .with_context(|| format!("{what} {a} names no peer (/p2p/PEER_ID)"))
        })
        .collect()
}

fn run_options(
    home: &std::path::Path,
    net: config::Settings,
    once: Option<std::time::Duration>,
) -> Result<daemon::RunOptions> {
    let eff = config::resolve(config::load(home)?, net)?;
    let peers = parse_addrs("--peer", &eff.peers)?;
    let agent = nuwa_agent::Config {
        known_peers: eff.known_peers,
        mdns: eff.mdns,
        dht: eff.dht,
        bootstrap: if eff.dht {
            with_peers("--bootstrap", &eff.bootstrap)?
        } else {
            Vec::new()
        },
        rendezvous: eff.rendezvous,
        rendezvous_servers: if eff.rendezvous {
            with_peers("--rendezvous", &eff.rendezvous_servers)?
        } else {
            Vec::new()
        },
        keepers: with_peers("--keeper", &eff.keepers)?,
        static_peers: peers
            .into_iter()
            .map(|a| (nuwa_net::peer_in(&a), a))
            .collect(),
        memory_budget_bytes: eff.memory_budget_mb.saturating_mul(1_000_000),
        once_ms: once.map(|t| t.as_millis() as u64),
        once_tty: once.is_some() && daemon::stderr_is_tty(),
        ..nuwa_agent::Config::default()
    };
    Ok(daemon::RunOptions {
        listen: parse_addrs("--listen", &eff.listen)?,
        api_listen: eff.api_listen,
        mdns_interfaces: eff.mdns_interfaces,
        agent,
        once_json: false,
    })
}

#[derive(Subcommand, Debug)]
enum AppCommand {
    /// Issue a capability to an app's key, signed by this device's admin
    /// key, and print it (or write it to --out, mode 0600) for the app to
    /// load. Example: app grant --to did:key:z6Mk... --target
    /// did:nuwa:cap:weather: --actions read,query,events,write
    Grant {
        /// The app's key, as a did:key (its public Ed25519 key).
        #[arg(long)]
        to: String,
        /// What it reaches: a namespace prefix ending in ':' (every
        /// container under it, private ones included) or one container's
        /// name (a shared or public one).
        #[arg(long)]
        target: String,
        /// Comma-separated: read, query, events, write, delete, reset,
        /// schema.
        #[arg(long, value_delimiter = ',', required = true)]
        actions: Vec<String>,
        /// When it ends: a duration (30d, 12h) or an RFC 3339 time; at most
        /// 366 days [default: 30d].
        #[arg(long, value_name = "DURATION", value_parser = parse_expires)]
        expires: Option<u64>,
        /// Write the capability to this file (0600) instead of stdout.
        #[arg(long)]
        out: Option<PathBuf>,
    },
    /// Every capability issued on any device of the agent, and whether it
    /// was revoked.
    List,
    /// Revoke a capability (its id, see `app list`): every device refuses
    /// it, and every capability an app delegated from it, once the
    /// revocation reaches it (seconds, when they are connected).
    Revoke { id: String },
}

#[derive(Subcommand, Debug)]
enum DeviceCommand {
    /// Every device of the agent: context id, name, relationships, status
    /// (active, expired, revoked) and when this device last saw it. Asks the
    /// running daemon; without one, reads the home: the DID log, and the
    /// names and last-seen times the daemon stored (as of when it last ran).
    List,
    /// Approve a new device that shows CODE (from `nuwa-node pair`): find it
    /// on the LAN (mDNS) or through the configured rendezvous servers, check
    /// the code with SPAKE2, add its keys to the DID document and hand it
    /// the sync keys. Needs the running daemon of an admin device (where
    /// `init` ran, or one promoted or recovered since). A code whose first
    /// letters no device shows (a typo) is answered within 10 s.
    Approve {
        /// The code shown on the new device, e.g. ABCD-EFGH.
        code: String,
        /// Name to register the device under (default: the name it gives).
        #[arg(long)]
        name: Option<String>,
        /// Give up after this long (at most 10m).
        #[arg(long, value_name = "DURATION", default_value = "60s", value_parser = parse_duration)]
        timeout: std::time::Duration,
        /// The code is shown by `nuwa-node recover` on a new machine: hand
        /// it the DID log and the sync keys sealed to the agent's recovery
        /// key (only the recovery words open them) instead of adding it.
        /// Any device of the agent can do this, admin or not.
        #[arg(long)]
        recovery: bool,
        /// List the device as short-lived: it expires DURATION (e.g. 10m, 2h) after it
        /// is added (the shorter of this and the device's own `pair --expires` wins).
        #[arg(long, value_name = "DURATION", value_parser = parse_expires)]
        expires: Option<u64>,
    },
    /// Revoke a device (by its context id or name, see `device list`): remove its
    /// keys from the DID document and open a new key epoch, so it receives
    /// and can decrypt nothing written from now on and its writes are
    /// refused. Data written before stays readable to the other devices.
    /// Works through the running daemon, or offline on the home if none
    /// runs (peers learn it when the daemon next starts). Needs an admin
    /// device (where `init` ran, or one promoted or recovered since). The
    /// last admin device cannot be revoked. Asks for confirmation on
    /// a terminal; without one, pass --yes.
    Revoke {
        /// The device's context id (e.g. device-0123456789ab) or its name.
        device: String,
        /// Do not ask for confirmation (needed when stdin is not a terminal).
        #[arg(long, short = 'y')]
        yes: bool,
    },
    /// Rename this device (the name `status` and every `device list` show,
    /// which commands take in place of its context id). It is written in
    /// the home; peers learn it from the daemon's Hellos once it (re)starts.
    /// Another device's name is what that device announces: rename it on
    /// that device.
    Rename {
        /// The new name: 1 to 64 bytes, not another device's name.
        name: String,
    },
    /// Replace this device's key (its PeerId and context id change) with
    /// no loss of state and no pairing: one DID update, signed by this
    /// device's admin key (a non-admin device is promoted first), and a new
    /// key epoch, so the old key reads nothing written after. Run it with
    /// the daemon stopped; peers accept the new key from the log.
    Rotate,
    /// Make a device an admin: give its key capabilityDelegation, so it can
    /// approve, provision, promote, demote and revoke devices too (and keep
    /// the agent manageable if this one is lost). Needs an admin device.
    Promote {
        /// The device's context id (e.g. device-0123456789ab) or its name.
        device: String,
    },
    /// Take admin rights from a device. The last admin device cannot be
    /// demoted. Asks for confirmation on a terminal; without one, pass --yes.
    Demote {
        /// The device's context id (e.g. device-0123456789ab) or its name.
        device: String,
        /// Do not ask for confirmation (needed when stdin is not a terminal).
        #[arg(long, short = 'y')]
        yes: bool,
    },
    /// Create another device of this agent offline (for testnets and CI): a
    /// home directory holding its key, the updated DID document and the sync
    /// key. Run it in the home where `init` ran.
    Provision {
        /// New home directory to create for the device.
        #[arg(long, value_name = "DIR")]
        out: PathBuf,
        /// A name for the new device (default: none).
        #[arg(long, default_value = "")]
        name: String,
        /// A short-lived device (a CI job): it expires after DURATION (e.g. 5s, 10m, 2h,
        /// 30d) or at an RFC 3339 instant, written in its DID entry; then peers and keepers
        /// refuse it, and an admin's running daemon prunes it, with no revocation.
        #[arg(long, value_name = "DURATION", value_parser = parse_expires)]
        expires: Option<u64>,
    },
}

#[derive(Subcommand, Debug)]
enum StateCommand {
    /// Set KEY in the map container CONTAINER (created on first use) to the
    /// JSON value. Returns once the write is durable on this device.
    Put {
        /// Container name (1 to 256 bytes of UTF-8, no control characters).
        container: String,
        /// Key within the container.
        key: String,
        /// A JSON value, e.g. '"text"', '42' or '{"a":[1,2]}'.
        #[arg(value_name = "JSON")]
        value: String,
    },
    /// Apply many writes from an NDJSON file (`-` for stdin).
    ///
    /// One operation per line:
    ///   {"op":"put","container":"notes","key":"k","value":1}
    ///   {"op":"create","schema_uri":"did:nuwa:state:note#v1","object":{...},"id":"n1"}
    ///   {"op":"update","schema_uri":"...","id":"n1","patch":[...]}
    ///   {"op":"delete","schema_uri":"...","id":"n1","mode":"hard"}
    ///
    /// Every line is checked before anything is sent. Lines go in batches
    /// (state.batch): within a batch, the operations on one container are
    /// all applied or none is. Failed lines are listed with their number;
    /// the exit status is 1 if any failed.
    #[command(verbatim_doc_comment)]
    Import {
        /// The NDJSON file, or `-` for standard input.
        file: PathBuf,
        /// Operations per batch.
        #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u32).range(1..=100_000))]
        batch_size: u32,
    },
    /// Print a container (or one KEY of it) as JSON: indented, or with
    /// --json compact on one line (keys in a stable order). For a typed
    /// container (a schema's `$id`) KEY is an object id, and what prints is
    /// the user's view, as `state query` shows it: live objects only, each
    /// field as plain JSON (a set as an array).
    Get {
        /// Container name, or a schema's `$id` for a typed container.
        container: String,
        /// One key (untyped map) or object id (typed container) only.
        key: Option<String>,
        /// Typed containers: show the stored document instead (tombstoned
        /// objects with `_deleted`, sets as their CRDT encoding).
        #[arg(long)]
        raw: bool,
        /// Read the home's store with no daemon (e.g. after `sync --once`);
        /// if a daemon runs on the home, ask it. Same output either way.
        #[arg(long)]
        offline: bool,
    },
    /// Print every change to the state as it happens (this device's writes
    /// and changes synced in from peers) until Ctrl-C: one line per change,
    /// or with --json one JSON object per line (NDJSON).
    Events {
        /// Only changes to this container.
        #[arg(long)]
        container: Option<String>,
    },
    /// Write the container's Automerge document in the standard binary
    /// format to FILE (plaintext: choose where it goes with care).
    Export {
        /// Container name, or a schema's `$id` for a typed container.
        container: String,
        /// Where to write the document (overwritten if it exists).
        #[arg(long, value_name = "FILE")]
        out: PathBuf,
        /// Read the home's store with no daemon, as `state get --offline`.
        #[arg(long)]
        offline: bool,
    },
    /// Typed state schemas (NIP-8): register or list.
    Schema {
        #[command(subcommand)]
        command: SchemaCommand,
    },
    /// state.create: validate OBJECT against the schema and create it.
    /// Prints the new object's id.
    Create {
        /// Schema URI (`$id`), e.g. did:nuwa:state:note#v1.
        #[arg(long = "schema", value_name = "URI")]
        schema_uri: String,
        /// The object as JSON.
        #[arg(long, value_name = "JSON")]
        object: String,
        /// Id for the object (default: its `id` field, else a new UUID).
        #[arg(long)]
        id: Option<String>,
    },
    /// state.update: apply a JSON Patch (RFC 6902) or {"$inc": {...}} /
    /// {"$push": {...}} to an object; fields merge per their CRDT policy.
    Update {
        /// Schema URI (`$id`) of the object's container.
        #[arg(long = "schema", value_name = "URI")]
        schema_uri: String,
        /// Id of the object to change.
        #[arg(long)]
        id: String,
        /// The patch as JSON.
        #[arg(long, value_name = "JSON")]
        patch: String,
    },
    /// state.query: run an ASM-QL query (JSON) and print the result
    /// (`items` and the `next_cursor` of the next page).
    Query {
        /// The ASM-QL query as JSON (see docs/api.md), e.g.
        /// '{"from": "did:nuwa:state:note#v1", "where": {"tags": {"$contains": "work"}}}'
        query: String,
    },
    /// state.delete: tombstone an object (the default; hidden on every
    /// device) or remove it outright with --hard.
    Delete {
        /// Schema URI (`$id`) of the object's container.
        #[arg(long = "schema", value_name = "URI")]
        schema_uri: String,
        /// Id of the object to delete.
        #[arg(long)]
        id: String,
        /// Remove the object from the document instead of tombstoning it.
        #[arg(long)]
        hard: bool,
    },
    /// Show a typed container: schema, policies, item count, heads, size.
    Describe {
        /// The schema's `$id`, e.g. did:nuwa:core:MemoryStore#v1.
        container: String,
    },
    /// Write a snapshot of a typed container and drop its change log (on
    /// this device).
    Compact {
        /// The schema's `$id`, e.g. did:nuwa:core:ConversationLog#v1.
        container: String,
    },
    /// Remove every object of a typed container, on every device (the
    /// schema stays). Asks for confirmation on a terminal; without one,
    /// pass --yes.
    Reset {
        /// The schema's `$id`, e.g. did:nuwa:core:MemoryStore#v1.
        container: String,
        /// Do not ask for confirmation (needed when stdin is not a terminal).
        #[arg(long, short = 'y')]
        yes: bool,
    },
}

#[derive(Subcommand, Debug)]
enum SchemaCommand {
    /// Register the JSON Schema (2020-12, with x-asm annotations) in FILE,
    /// on every device. The same `$id` with other content is refused:
    /// publish a change as a new version (`#v2`).
    Add {
        /// The schema file, e.g. crates/asm/schemas/examples/note.json.
        file: PathBuf,
    },
    /// List registered schemas.
    List,
}

/// For `run` and `rendezvous`: info unless RUST_LOG says otherwise, to
/// stderr or to the files `log` names. Hold the guard until exit.
fn init_tracing(log: &logging::LogArgs) -> Result<logging::Guard> {
    logging::init(log, "info")
}

/// For `sync --once` and `pair`: progress goes to stderr, so logs stay at
/// warn unless RUST_LOG says otherwise.
fn init_tracing_quiet() -> Result<logging::Guard> {
    logging::init(&logging::LogArgs::default(), "warn")
}

/// What `pair` (and `recover` on a fresh home) needs: the network flags,
/// the code's lifetime, the initial sync (`None`: skip it) and, for
/// recovery, the words' key.
fn pair_options(
    home_dir: &std::path::Path,
    name: String,
    ttl: std::time::Duration,
    net: config::Settings,
    sync_timeout: Option<std::time::Duration>,
    recovery: Option<pair::RecoveryJoin>,
) -> Result<pair::PairOptions> {
    let listen = parse_addrs(
        "--listen",
        net.network.listen.as_deref().unwrap_or_default(),
    )?;
    let rendezvous_servers = parse_addrs(
        "--rendezvous",
        net.discovery
            .rendezvous_servers
            .as_deref()
            .unwrap_or_default(),
    )?;
    let mdns = net.discovery.mdns.unwrap_or(true);
    let mdns_interfaces = net.discovery.mdns_interfaces.clone().unwrap_or_default();
    let sync = match sync_timeout {
        Some(t) => Some(run_options(home_dir, net, Some(t))?),
        None => None,
    };
    Ok(pair::PairOptions {
        name,
        listen,
        mdns,
        mdns_interfaces,
        rendezvous_servers,
        code_ttl: ttl,
        sync,
        recovery,
        expires_secs: None,
    })
}

fn main() -> ExitCode {
    // Files and directories this process creates are private whatever the
    // inherited umask (sled creates its files itself, with 0666 & ~umask).
    // SAFETY: umask only sets the process's file-mode creation mask.
    unsafe {
        libc::umask(0o077);
    }
    panic_hook::install();
    let cli = Cli::parse();
    match real_main(cli) {
        Ok(()) => ExitCode::SUCCESS,
        // The reader of stdout went away (`| head`): nothing went wrong.
        Err(e) if e.is::<client::StdoutClosed>() => ExitCode::SUCCESS,
        Err(e) => {
            // Not `eprintln!`: stderr may be a closed pipe by now.
            logging::stderr_line(format_args!("error: {e:#}"));
            // `sync --once`: each outcome its status (see its --help).
            use nuwa_agent::once::{Failed, Outcome};
            ExitCode::from(match e.downcast_ref::<Failed>().map(|f| f.outcome) {
                Some(Outcome::Config) => 2,
                Some(Outcome::NoPeer) => 3,
                Some(Outcome::Timeout) => 4,
                _ => 1,
            })
        }
    }
}

fn real_main(cli: Cli) -> Result<()> {
    let home_dir = match cli.home {
        Some(h) => h,
        None => home::default_home()?,
    };
    let json = cli.json;
    match cli.command {
        Command::Init {
            name,
            i_have_written_it_down,
        } => init(&home_dir, &name, i_have_written_it_down, json),
        Command::Recover(r) if !home_dir.join(home::DEVICE_KEY).exists() => {
            recover_fresh(&home_dir, *r, json)
        }
        Command::Recover(r) if r.name.is_some() => {
            anyhow::bail!("--name is for a fresh home; this home's device already has its name")
        }
        Command::Recover(r) => {
            let lost = r.lost.iter().map(|l| client::resolve_device(&home_dir, l));
            let (lost, file) = (lost.collect::<Result<Vec<_>>>()?, r.words_file.as_deref());
            recovery::recover(&home_dir, &lost, file, r.i_have_written_it_down, json)
        }
        Command::Recovery {
            command: RecoveryCommand::Create {
                i_have_written_it_down,
            },
        } => recovery::create(&home_dir, i_have_written_it_down, json),
        Command::Device { command } => device_command(&home_dir, command, json),
        Command::App { command } => app_command(&home_dir, command, json),
        Command::Pair {
            name,
            ttl,
            no_sync,
            sync_timeout,
            expires,
            net,
        } => {
            let _log = init_tracing_quiet()?;
            let mut opts = pair_options(
                &home_dir,
                name.unwrap_or_default(),
                ttl,
                net,
                (!no_sync).then_some(sync_timeout),
                None,
            )?;
            opts.expires_secs = expires;
            let rt = tokio::runtime::Runtime::new().context("cannot start the async runtime")?;
            rt.block_on(pair::run(&home_dir, opts))
        }
        Command::Run {
            net,
            lifecycle_every,
            log,
        } => run_daemon(&home_dir, net, lifecycle_every, &log),
        Command::Sync { once, timeout, net } => {
            let config = |e: anyhow::Error| nuwa_agent::once::Failed {
                outcome: nuwa_agent::once::Outcome::Config,
                message: format!("{e:#}"),
            };
            if !once {
                let e = anyhow::anyhow!("only `sync --once` exists so far; use `run`");
                return Err(config(e).into());
            }
            let _log = init_tracing_quiet()?;
            let mut opts = run_options(&home_dir, net, Some(timeout)).map_err(config)?;
            opts.once_json = json;
            let h = home::load(&home_dir).map_err(config)?;
            let rt = tokio::runtime::Runtime::new().context("cannot start the async runtime")?;
            rt.block_on(daemon::run(h, opts))
        }
        Command::Rendezvous(a) => run_infra(&home_dir, *a),
        Command::Status => client::status(&home_dir, json),
        Command::Service { command } => service::run(&home_dir, command, json),
        Command::Open { print } => client::open(&home_dir, print, json),
        Command::Doctor { net } => {
            if !doctor::run(&home_dir, net, json)? {
                use std::io::Write as _;
                let _ = std::io::stdout().flush();
                std::process::exit(1);
            }
            Ok(())
        }
        Command::MasterKey {
            command: MasterKeyCommand::Backup { out },
        } => backup_master_key(&home_dir, &out, json),
        Command::State { command } => state_command(&home_dir, command, json),
    }
}

/// `init`: a new agent, its recovery words shown once and confirmed.
fn init(home_dir: &std::path::Path, name: &str, written_down: bool, json: bool) -> Result<()> {
    recovery::check_can_confirm(written_down, json)?;
    if home_dir.exists() {
        home::ensure_empty(home_dir)?;
    }
    let phrase = nuwa_agent::identity::recovery::RecoveryPhrase::generate()
        .context("cannot generate the recovery words")?;
    if !json {
        recovery::show(&phrase, "this new agent");
    }
    recovery::confirm(&phrase, written_down)?;
    let h = home::init(home_dir, name, &phrase.key().public())?;
    if json {
        let mut v = serde_json::json!({
            "did": h.log.did(),
            "context_id": h.info.context_id,
            "name": h.info.name,
            "home": home_dir.display().to_string(),
        });
        if written_down {
            v["recovery_words"] = phrase.words().to_string().into();
        }
        return client::print_json(&v);
    }
    let home = home_dir.display().to_string();
    print!(
        "{}",
        nuwa_agent::text::initialised(h.log.did(), &h.info.context_id, &home)
    );
    Ok(())
}

/// `recover` on a fresh home: new words shown and confirmed, then pairing
/// takes the handover that only the old words open.
fn recover_fresh(home_dir: &std::path::Path, r: RecoverArgs, json: bool) -> Result<()> {
    let name = recovery::ask_name(r.name, json)?;
    let _log = init_tracing_quiet()?;
    recovery::check_can_confirm(r.i_have_written_it_down, json)?;
    if home_dir.exists() {
        home::ensure_empty(home_dir)?;
    }
    let words = recovery::read_words(r.words_file.as_deref())?;
    let next = nuwa_agent::identity::recovery::RecoveryPhrase::generate()
        .context("cannot generate new recovery words")?;
    if !json {
        recovery::show(
            &next,
            "the agent you recover: NEW ones, which replace the old ones once this recovery completes",
        );
    }
    recovery::confirm(&next, r.i_have_written_it_down)?;
    // With no --lost, a person at a terminal is shown the devices the
    // handover lists and asked which were lost; a script (stdin not a
    // terminal, or --json) removes none and is told how to revoke one.
    let ask = r.lost.is_empty() && !json && std::io::IsTerminal::is_terminal(&std::io::stdin());
    let opts = pair_options(
        home_dir,
        name,
        r.ttl,
        r.net,
        Some(r.sync_timeout),
        Some(pair::RecoveryJoin {
            key: words.key(),
            lost: (!ask).then_some(r.lost),
            next_public: next.key().public(),
        }),
    )?;
    let rt = tokio::runtime::Runtime::new().context("cannot start the async runtime")?;
    rt.block_on(pair::run(home_dir, opts))?;
    if json {
        let h = home::load(home_dir)?;
        let mut v = serde_json::json!({
            "did": h.log.did(),
            "admin": h.info.context_id,
            "epoch": h.keys.current().epoch(),
            "did_log_len": h.log.len(),
        });
        if r.i_have_written_it_down {
            v["recovery_words"] = next.words().to_string().into();
        }
        client::print_json(&v)?;
    }
    Ok(())
}

fn app_command(home: &std::path::Path, command: AppCommand, json: bool) -> Result<()> {
    use nuwa_agent::text;
    let (reply, people): (serde_json::Value, _) = match command {
        AppCommand::Grant {
            to,
            target,
            actions,
            expires,
            out,
        } => {
            let body = nuwa_agent::apps::GrantBody {
                to,
                target,
                actions,
                expires_secs: expires,
            };
            let reply: serde_json::Value = client::post_json(home, "/v1/apps/grant", &body)?;
            if let Some(out) = out {
                let cap = serde_json::to_vec_pretty(&reply["capability"])?;
                home::write_private(&std::path::absolute(&out)?, &cap)?;
                eprintln!("capability {} written to {}", reply["id"], out.display());
                return Ok(());
            }
            (reply["capability"].clone(), None)
        }
        AppCommand::List => {
            let v: serde_json::Value = client::get_json(home, "/v1/apps")?;
            let t = text::app_list(&serde_json::from_value::<Vec<_>>(v.clone())?);
            (v, Some(t))
        }
        AppCommand::Revoke { id } => {
            let body = nuwa_agent::apps::RevokeAppBody { id };
            let v: serde_json::Value = client::post_json(home, "/v1/apps/revoke", &body)?;
            (v.clone(), Some(text::app_revoked(&v)))
        }
    };
    client::print_reply(&reply, json, people)
}

fn device_command(home_dir: &std::path::Path, command: DeviceCommand, json: bool) -> Result<()> {
    match command {
        DeviceCommand::Promote { device } => {
            let context_id = client::resolve_device(home_dir, &device)?;
            client::admin_change(home_dir, true, &context_id, json)
        }
        DeviceCommand::Rotate => recovery::rotate(home_dir, json),
        DeviceCommand::Rename { name } => client::rename(home_dir, &name, json),
        DeviceCommand::Demote { device, yes } => {
            let context_id = &client::resolve_device(home_dir, &device)?;
            if !yes {
                client::confirm(
                    &format!(
                        "this takes admin rights from device {context_id}: it can no longer \
                         approve, provision, promote or revoke devices."
                    ),
                    context_id,
                )?;
            }
            client::admin_change(home_dir, false, context_id, json)
        }
        DeviceCommand::List => client::device_list(home_dir, json),
        DeviceCommand::Approve {
            code,
            name,
            timeout,
            recovery,
            expires,
        } => client::approve(home_dir, &code, name, timeout, (recovery, expires), json),
        DeviceCommand::Revoke { device, yes } => {
            let context_id = &client::resolve_device(home_dir, &device)?;
            if !yes {
                client::confirm(
                    &format!(
                        "this revokes device {context_id}: it is removed from the agent's DID \
                         document, gets nothing written from now on, and its writes are refused \
                         by every device. It cannot be undone (pair the device again instead)."
                    ),
                    context_id,
                )?;
            }
            client::revoke(home_dir, context_id, json)
        }
        DeviceCommand::Provision { out, name, expires } => {
            let info = client::provision(home_dir, &out, &name, expires)?;
            if json {
                return client::print_json(&info);
            }
            println!("{info}");
            Ok(())
        }
    }
}

/// `run`: the daemon, with its logs held until it returns (so that queued
/// file logs are flushed).
fn run_daemon(
    home_dir: &std::path::Path,
    net: config::Settings,
    lifecycle_every: std::time::Duration,
    log: &logging::LogArgs,
) -> Result<()> {
    let _log = init_tracing(log)?;
    let mut opts = run_options(home_dir, net, None)?;
    opts.agent.lifecycle_every_ms = lifecycle_every
        .max(std::time::Duration::from_millis(100))
        .as_millis() as u64;
    let h = home::load(home_dir)?;
    let rt = tokio::runtime::Runtime::new().context("cannot start the async runtime")?;
    let ran = rt.block_on(daemon::run(h, opts));
    // Also in the log: with --log-file, stderr may be read by no one.
    if let Err(e) = &ran {
        tracing::error!(error = %format!("{e:#}"), "the daemon stopped on an error");
    }
    ran
}

/// `rendezvous`: an infrastructure node (rendezvous server, DHT
/// bootstrap, relay, and a keeper with `--keeper`).
fn run_infra(home_dir: &std::path::Path, a: InfraArgs) -> Result<()> {
    let keeper = a.keeper.then(|| nuwa_keeper::KeeperConfig {
        max_bytes_per_agent: a.keeper_quota_mib.saturating_mul(1024 * 1024),
        max_envelopes_per_agent: a.keeper_quota_envelopes,
        retention: std::time::Duration::from_secs(a.keeper_retention_days.saturating_mul(86_400)),
        ..nuwa_keeper::KeeperConfig::default()
    });
    let _log = init_tracing(&a.log)?;
    let rt = tokio::runtime::Runtime::new().context("cannot start the async runtime")?;
    let (per_peer, max) = (a.max_registrations_per_peer, a.max_registrations);
    rt.block_on(infra::run(home_dir, a.listen, per_peer, max, keeper))
}

fn backup_master_key(home_dir: &std::path::Path, out: &std::path::Path, json: bool) -> Result<()> {
    let out = doctor::backup_master_key(home_dir, out)?;
    if json {
        client::print_json(&serde_json::json!({ "out": out }))?;
    } else {
        println!("master key copied to {} (mode 0600)", out.display());
        println!("keep it offline: whoever holds it can add and remove this agent's devices");
    }
    Ok(())
}

fn state_command(home_dir: &std::path::Path, command: StateCommand, json: bool) -> Result<()> {
    let home_dir = home_dir.to_path_buf();
    // A typed-state tool: POST `body` to `path`, print the reply (as text
    // where the core has one for it).
    let tool = |path: &str, body: serde_json::Value| {
        let v = client::post_json(&home_dir, path, &body)?;
        client::print_reply(&v, json, nuwa_agent::text::tool_reply(path, &body, &v))
    };
    match command {
        StateCommand::Put {
            container,
            key,
            value,
        } => client::put(&home_dir, &container, &key, &value, json),
        StateCommand::Get {
            container,
            key,
            raw,
            offline,
        } => client::get(
            &home_dir,
            GetQuery {
                container,
                key,
                raw,
            },
            offline,
            json,
        ),
        StateCommand::Events { container } => client::events(&home_dir, container.as_deref(), json),
        StateCommand::Export {
            container,
            out,
            offline,
        } => client::export(&home_dir, &container, &out, offline, json),
        StateCommand::Import { file, batch_size } => {
            client::import(&home_dir, &file, batch_size as usize, json)
        }
        StateCommand::Schema {
            command: SchemaCommand::Add { file },
        } => {
            let text = std::fs::read_to_string(&file)
                .with_context(|| format!("cannot read {}", file.display()))?;
            let schema: serde_json::Value = serde_json::from_str(&text)
                .with_context(|| format!("{} is not JSON", file.display()))?;
            tool("/v1/schemas", schema)
        }
        StateCommand::Schema {
            command: SchemaCommand::List,
        } => client::print_reply(&client::get_json(&home_dir, "/v1/schemas")?, json, None),
        StateCommand::Create {
            schema_uri,
            object,
            id,
        } => tool(
            "/v1/state.create",
            serde_json::json!({
                "schema_uri": schema_uri,
                "object": parse_json("--object", &object)?,
                "id": id,
            }),
        ),
        StateCommand::Update {
            schema_uri,
            id,
            patch,
        } => tool(
            "/v1/state.update",
            serde_json::json!({
                "schema_uri": schema_uri,
                "id": id,
                "patch": parse_json("--patch", &patch)?,
            }),
        ),
        StateCommand::Query { query } => tool(
            "/v1/state.query",
            serde_json::json!({ "query": parse_json("QUERY", &query)? }),
        ),
        StateCommand::Delete {
            schema_uri,
            id,
            hard,
        } => tool(
            "/v1/state.delete",
            serde_json::json!({
                "schema_uri": schema_uri,
                "id": id,
                "mode": if hard { "hard" } else { "tombstone" },
            }),
        ),
        StateCommand::Describe { container } => tool(
            "/v1/state.describe",
            serde_json::json!({ "container": container }),
        ),
        StateCommand::Compact { container } => tool(
            "/v1/state.compact",
            serde_json::json!({ "container": container }),
        ),
        StateCommand::Reset { container, yes } => {
            if !yes {
                client::confirm(
                    &format!(
                        "this removes every object of {container} on every device of the \
                             agent (the schema stays); it cannot be undone."
                    ),
                    &container,
                )?;
            }
            tool(
                "/v1/state.reset",
                serde_json::json!({ "container": container }),
            )
        }
    }
}
