//! The node's settings: listen addresses, static peers, discovery switches
//! and the local API address, declared once in [`Settings`] (serde for
//! `HOME/config.toml`, clap for the flags and their `NUWA_…` environment
//! variables), and layered: defaults, then the file, then each variable,
//! then each flag.
//!
//! [`load`] reads the file (a missing file means every default; errors name
//! the key, line and column), and [`resolve`] layers the command line over
//! it into validated [`Effective`] settings. Addresses are checked only
//! syntactically here, so that this module does not depend on libp2p:
//! parsing them as multiaddrs, and running discovery in NIP-6 order (known
//! peers, mDNS, DHT, rendezvous) with the sources that are switched on, is
//! left to the daemon.
//!
//! File format (every key is optional; an unknown key is an error that names
//! the key and the file):
//!
//! ```toml
//! [network]
//! listen = ["/ip4/0.0.0.0/tcp/0", "/ip4/0.0.0.0/udp/0/quic-v1"]   # multiaddrs to listen on
//! peers = []                        # static peers to dial (multiaddrs with /p2p/)
//! [discovery]
//! known_peers = true
//! mdns = true
//! mdns_interfaces = []              # empty = every non-loopback interface
//! dht = true
//! rendezvous = true
//! bootstrap = []                    # DHT bootstrap multiaddrs (with /p2p/)
//! rendezvous_servers = []           # rendezvous multiaddrs (with /p2p/)
//! keepers = []                      # keeper multiaddrs (with /p2p/)
//! [api]
//! listen = "127.0.0.1:0"            # loopback only
//! [memory]
//! budget_mb = 256                   # containers leave memory above this RSS
//! ```
//!
//! Command-line lists replace the file's lists when they are given, and the
//! `--no-…` switches turn a source off even when the file turns it on.

use std::fmt;
use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Write};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// Name of the config file inside the home directory.
pub const CONFIG_FILE: &str = "config.toml";
/// Most entries accepted in any one list (listen, peers, bootstrap, …).
pub const MAX_LIST_ENTRIES: usize = 64;
/// Longest multiaddr string accepted.
pub const MAX_ADDR_BYTES: usize = 512;
/// Longest mDNS interface name accepted.
pub const MAX_INTERFACE_NAME_BYTES: usize = 256;
/// Largest config file read; a real one is well under a kilobyte, so this
/// only stops an accidental read of a huge file.
pub const MAX_FILE_BYTES: u64 = 1024 * 1024;
/// Listen address used when neither the file nor the command line gives one.
pub const DEFAULT_LISTEN: &str = "/ip4/0.0.0.0/tcp/0";
/// QUIC next to TCP: UDP punches through more NATs (see docs/decisions.md).
pub const DEFAULT_LISTEN_QUIC: &str = "/ip4/0.0.0.0/udp/0/quic-v1";
/// Local API address used when neither the file nor the command line gives one.
pub const DEFAULT_API_LISTEN: &str = "127.0.0.1:0";

/// Longest input value quoted back in an error message.
const MAX_QUOTED_CHARS: usize = 80;

/// Every network, discovery and API setting, declared once: its key in
/// `config.toml` (the serde field, in its section), its command-line flag
/// and environment variable (clap, which layers the variable under the
/// flag), its help text and its default ([`Settings::default`]).
///
/// Read from the file, every key left out holds its default; parsed from
/// the command line, every option not given is `None`. [`resolve`] layers
/// the second over the first.
#[derive(clap::Args, Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Settings {
    #[command(flatten)]
    pub network: Network,
    #[command(flatten)]
    pub discovery: Discovery,
    #[command(flatten)]
    pub api: Api,
    #[command(flatten)]
    pub memory: Memory,
    /// The file these settings came from, so that [`resolve`] can name it in
    /// errors; `None` when no file exists (or for the command line).
    #[serde(skip)]
    #[arg(skip)]
    path: Option<PathBuf>,
}

/// `[network]`: where to listen and whom to dial.
#[derive(clap::Args, Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Network {
    /// Address to listen on for peers (repeatable). Default: /ip4/0.0.0.0/tcp/0 and /ip4/0.0.0.0/udp/0/quic-v1.
    #[arg(
        id = "network.listen",
        long = "listen",
        value_name = "MULTIADDR",
        env = "NUWA_LISTEN",
        value_delimiter = ','
    )]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub listen: Option<Vec<String>>,
    /// Peer address to dial, e.g. /ip4/10.0.0.2/tcp/4001/p2p/12D3... (repeatable).
    #[arg(
        id = "network.peers",
        long = "peer",
        value_name = "MULTIADDR",
        env = "NUWA_PEERS",
        value_delimiter = ','
    )]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub peers: Option<Vec<String>>,
}

/// `[discovery]`: which NIP-6 sources run, and their addresses.
#[derive(clap::Args, Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Discovery {
    /// Do not dial (or remember) peers that verified before.
    #[arg(id = "discovery.known_peers", long = "no-known-peers", env = "NUWA_NO_KNOWN_PEERS", num_args = 0, default_missing_value = "true", value_parser = off_switch)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub known_peers: Option<bool>,
    /// Do not discover or announce on the LAN via mDNS.
    #[arg(id = "discovery.mdns", long = "no-mdns", env = "NUWA_NO_MDNS", num_args = 0, default_missing_value = "true", value_parser = off_switch)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mdns: Option<bool>,
    /// Network interface for mDNS (repeatable), e.g. `lo` for tests on one
    /// machine. Default: every non-loopback interface.
    #[arg(
        id = "discovery.mdns_interfaces",
        long = "mdns-interface",
        value_name = "NAME",
        env = "NUWA_MDNS_INTERFACES",
        value_delimiter = ','
    )]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mdns_interfaces: Option<Vec<String>>,
    /// Do not use the DHT.
    #[arg(id = "discovery.dht", long = "no-dht", env = "NUWA_NO_DHT", num_args = 0, default_missing_value = "true", value_parser = off_switch)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dht: Option<bool>,
    /// Do not use rendezvous servers.
    #[arg(id = "discovery.rendezvous", long = "no-rendezvous", env = "NUWA_NO_RENDEZVOUS", num_args = 0, default_missing_value = "true", value_parser = off_switch)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rendezvous: Option<bool>,
    /// DHT bootstrap node address with /p2p/ (repeatable).
    #[arg(
        id = "discovery.bootstrap",
        long = "bootstrap",
        value_name = "MULTIADDR",
        env = "NUWA_BOOTSTRAP",
        value_delimiter = ','
    )]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bootstrap: Option<Vec<String>>,
    /// Rendezvous server address with /p2p/ (repeatable).
    #[arg(
        id = "discovery.rendezvous_servers",
        long = "rendezvous",
        value_name = "MULTIADDR",
        env = "NUWA_RENDEZVOUS",
        value_delimiter = ','
    )]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rendezvous_servers: Option<Vec<String>>,
    /// Keeper address with /p2p/ (repeatable): an infrastructure node run
    /// with `rendezvous --keeper`, which stores this agent's sealed changes
    /// for devices that are not online at the same time.
    #[arg(
        id = "discovery.keepers",
        long = "keeper",
        value_name = "MULTIADDR",
        env = "NUWA_KEEPERS",
        value_delimiter = ','
    )]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub keepers: Option<Vec<String>>,
}

/// `[api]`: the local HTTP API.
#[derive(clap::Args, Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Api {
    /// Address of the local API (loopback only). Default: 127.0.0.1:0.
    // Kept as text so that `resolve` reports a bad value in its own words.
    #[arg(
        id = "api.listen",
        long = "api-listen",
        value_name = "ADDR",
        env = "NUWA_API_LISTEN"
    )]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub listen: Option<String>,
}

/// `[memory]`: how much memory the daemon may use for state.
#[derive(clap::Args, Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Memory {
    /// Resident memory (MB) above which containers leave memory at once,
    /// least recently used first (they load again when used). Containers
    /// unused for a minute leave memory anyway. Default: 256.
    #[arg(
        id = "memory.budget_mb",
        long = "memory-budget-mb",
        value_name = "MB",
        env = "NUWA_MEMORY_BUDGET_MB"
    )]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub budget_mb: Option<u64>,
}

/// The default of `memory.budget_mb`.
pub const DEFAULT_MEMORY_BUDGET_MB: u64 = 256;
/// The smallest `memory.budget_mb` accepted: below it the daemon's own
/// footprint (runtime, libp2p, sled) leaves nothing for state.
pub const MIN_MEMORY_BUDGET_MB: u64 = 32;

impl Default for Memory {
    fn default() -> Self {
        Memory {
            budget_mb: Some(DEFAULT_MEMORY_BUDGET_MB),
        }
    }
}

impl Default for Network {
    fn default() -> Self {
        Network {
            listen: Some(vec![
                DEFAULT_LISTEN.to_owned(),
                DEFAULT_LISTEN_QUIC.to_owned(),
            ]),
            peers: Some(Vec::new()),
        }
    }
}

impl Default for Discovery {
    fn default() -> Self {
        Discovery {
            known_peers: Some(true),
            mdns: Some(true),
            mdns_interfaces: Some(Vec::new()),
            dht: Some(true),
            rendezvous: Some(true),
            bootstrap: Some(Vec::new()),
            rendezvous_servers: Some(Vec::new()),
            keepers: Some(Vec::new()),
        }
    }
}

impl Default for Api {
    fn default() -> Self {
        Api {
            listen: Some(DEFAULT_API_LISTEN.to_owned()),
        }
    }
}

impl Settings {
    /// The file these settings were read from, or `None` if there was none
    /// and they are all defaults.
    // Not called yet: for the daemon to log which file it read.
    #[allow(dead_code)]
    pub fn path(&self) -> Option<&Path> {
        self.path.as_deref()
    }

    /// `self` with every setting `over` gives replaced by it (lists are
    /// replaced, not extended).
    fn overridden_by(&self, over: &Settings) -> Result<Settings, serde_json::Error> {
        fn layer(lower: &mut serde_json::Value, upper: serde_json::Value) {
            match (lower, upper) {
                (serde_json::Value::Object(l), serde_json::Value::Object(u)) => {
                    for (k, v) in u {
                        match l.get_mut(&k) {
                            Some(slot) => layer(slot, v),
                            None => {
                                l.insert(k, v);
                            }
                        }
                    }
                }
                (slot, v) => *slot = v,
            }
        }
        let mut merged = serde_json::to_value(self)?;
        layer(&mut merged, serde_json::to_value(over)?);
        let mut out: Settings = serde_json::from_value(merged)?;
        out.path = self.path.clone();
        Ok(out)
    }

    /// Whether `over` sets the dotted `key` (`discovery.mdns`).
    fn sets(&self, key: &str) -> bool {
        let Ok(v) = serde_json::to_value(self) else {
            return false;
        };
        key.split('.').try_fold(&v, |v, k| v.get(k)).is_some()
    }
}

/// The value of a `--no-…` switch (present: `true`; from its environment
/// variable: the variable's text) as the setting it switches: `true`, `1`,
/// `yes` or `on` turn the source off, `false`, `0`, `no` or `off` leave it
/// on.
fn off_switch(text: &str) -> Result<bool, String> {
    match text.trim().to_ascii_lowercase().as_str() {
        "true" | "1" | "yes" | "on" => Ok(false),
        "false" | "0" | "no" | "off" => Ok(true),
        other => Err(format!(
            "{other:?} is not a switch value; use true or false (1 or 0)"
        )),
    }
}

/// Every key the file accepts, by section, from the structs themselves (a
/// serialized [`Settings::default`] holds every key). [`check_keys`] uses it
/// to name an unknown key with its section.
fn known_keys() -> Vec<(String, Vec<String>)> {
    let v = serde_json::to_value(Settings::default()).unwrap_or_default();
    v.as_object()
        .map(|sections| {
            sections
                .iter()
                .map(|(name, keys)| {
                    let keys = keys
                        .as_object()
                        .map(|k| k.keys().cloned().collect())
                        .unwrap_or_default();
                    (name.clone(), keys)
                })
                .collect()
        })
        .unwrap_or_default()
}

/// The command-line flag (and environment variable) of the dotted `key`,
/// from clap's own declaration.
fn flag_of(key: &str) -> String {
    use clap::Args as _;
    let cmd = Settings::augment_args(clap::Command::new("nuwa-node"));
    cmd.get_arguments()
        .find(|a| a.get_id().as_str() == key)
        .map(|a| {
            let long = a.get_long().map(|l| format!("--{l}")).unwrap_or_default();
            match a.get_env() {
                Some(env) => format!("{long} (or {})", env.to_string_lossy()),
                None => long,
            }
        })
        .unwrap_or_else(|| key.to_owned())
}

/// The settings the daemon runs with: the file, overridden by the command
/// line, validated. Addresses are syntactically plausible multiaddrs; the
/// caller still parses them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Effective {
    pub listen: Vec<String>,
    pub peers: Vec<String>,
    pub known_peers: bool,
    pub mdns: bool,
    pub mdns_interfaces: Vec<String>,
    pub dht: bool,
    pub rendezvous: bool,
    pub bootstrap: Vec<String>,
    pub rendezvous_servers: Vec<String>,
    pub keepers: Vec<String>,
    pub api_listen: SocketAddr,
    pub memory_budget_mb: u64,
}

/// A place in the config file, both counted from 1; the column counts
/// characters, not bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Position {
    pub line: usize,
    pub column: usize,
}

impl fmt::Display for Position {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "line {}, column {}", self.line, self.column)
    }
}

/// Why the configuration could not be read, written or accepted.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    #[error(
        "cannot read config file {}; check that it is a readable file, or remove it to use the defaults",
        path.display()
    )]
    Read {
        path: PathBuf,
        #[source]
        source: io::Error,
    },

    #[error(
        "config file {} is {size_bytes} bytes, more than the {MAX_FILE_BYTES}-byte limit; \
         check that it is the right file, or remove it to use the defaults",
        path.display()
    )]
    TooLarge { path: PathBuf, size_bytes: u64 },

    /// Not valid TOML, or a value of the wrong type. The TOML parser's error
    /// is not kept as a source: its message, position and key are copied
    /// here, and chaining it would print the same problem twice.
    #[error(
        "config file {}{}{}: {problem}; fix it there, or remove the file to use the defaults",
        path.display(),
        at_position(position),
        at_key(key)
    )]
    Malformed {
        path: PathBuf,
        position: Option<Position>,
        /// Dotted key (`discovery.mdns`) whose value is wrong, when known.
        key: Option<String>,
        problem: String,
    },

    #[error(
        "config file {}{}: unknown key `{key}`; remove it or use one of: {known}",
        path.display(),
        at_position(position)
    )]
    UnknownKey {
        path: PathBuf,
        position: Option<Position>,
        /// Dotted key as written, e.g. `discovery.mnds`.
        key: String,
        /// The keys accepted at that place, comma-separated.
        known: String,
    },

    #[error("{setting} has invalid value {value:?}: {reason}")]
    InvalidValue {
        /// Which setting, e.g. "`discovery.bootstrap` in HOME/config.toml"
        /// or "command-line option --bootstrap".
        setting: String,
        /// The value, shortened if long.
        value: String,
        reason: String,
    },

    #[error("{setting} has {count} entries, more than the {max} allowed; remove some")]
    TooManyEntries {
        setting: String,
        count: usize,
        max: usize,
    },

    #[error(
        "{setting} is empty, so the node would not listen for peers; give at least one \
         address such as {DEFAULT_LISTEN}, or remove the key to use that default"
    )]
    NoListenAddress { setting: String },

    #[error(
        "{setting} is {addr}, which is not a loopback address; the local api must listen on \
         127.0.0.1 or [::1] so that other machines cannot reach it"
    )]
    ApiNotLoopback { setting: String, addr: SocketAddr },

    #[error(
        "cannot write default config file {}; check that the home directory exists and is writable",
        path.display()
    )]
    Write {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
}

fn at_position(position: &Option<Position>) -> String {
    position.map_or_else(String::new, |p| format!(" at {p}"))
}

fn at_key(key: &Option<String>) -> String {
    key.as_ref()
        .map_or_else(String::new, |k| format!(", key `{k}`"))
}

/// Reads `HOME/config.toml`. A missing file gives every default; a file that
/// is not valid TOML, has an unknown key or a value of the wrong type is an
/// error naming the file, the position and the problem. Values are checked
/// by [`resolve`], once the command line is known.
pub fn load(home: &Path) -> Result<Settings, ConfigError> {
    let path = home.join(CONFIG_FILE);
    let bytes = match read_limited(&path) {
        Ok(bytes) => bytes,
        Err(ReadError::Io(e)) if e.kind() == io::ErrorKind::NotFound => {
            return Ok(Settings::default());
        }
        Err(ReadError::Io(source)) => return Err(ConfigError::Read { path, source }),
        Err(ReadError::TooLarge(size_bytes)) => {
            return Err(ConfigError::TooLarge { path, size_bytes });
        }
    };
    let text = match String::from_utf8(bytes) {
        Ok(text) => text,
        Err(e) => {
            let valid = e.utf8_error().valid_up_to();
            // The prefix up to `valid_up_to` is valid UTF-8 by definition.
            let prefix = String::from_utf8_lossy(&e.as_bytes()[..valid]);
            return Err(ConfigError::Malformed {
                position: Some(position_of(&prefix, valid)),
                path,
                key: None,
                problem: "the file is not valid utf-8 text".to_owned(),
            });
        }
    };
    let doc = toml::de::DeTable::parse(&text).map_err(|e| malformed(&path, &text, None, &e))?;
    check_keys(&path, &text, doc.get_ref())?;
    let mut config: Settings =
        toml::from_str(&text).map_err(|e| malformed(&path, &text, Some(doc.get_ref()), &e))?;
    config.path = Some(path);
    Ok(config)
}

enum ReadError {
    Io(io::Error),
    TooLarge(u64),
}

fn read_limited(path: &Path) -> Result<Vec<u8>, ReadError> {
    let file = File::open(path).map_err(ReadError::Io)?;
    let size_bytes = file.metadata().map_err(ReadError::Io)?.len();
    if size_bytes > MAX_FILE_BYTES {
        return Err(ReadError::TooLarge(size_bytes));
    }
    // The file may grow between the metadata call and the read; the `take`
    // keeps the limit anyway.
    let mut bytes = Vec::new();
    file.take(MAX_FILE_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(ReadError::Io)?;
    if bytes.len() as u64 > MAX_FILE_BYTES {
        return Err(ReadError::TooLarge(bytes.len() as u64));
    }
    Ok(bytes)
}

/// Rejects the first unknown key in file order, naming it with its section
/// (serde's own message would give neither the section nor a position).
/// Values of the wrong shape are left to the typed parse.
fn check_keys(path: &Path, text: &str, doc: &toml::de::DeTable<'_>) -> Result<(), ConfigError> {
    let mut first: Option<(usize, String, String)> = None;
    let mut note = |start: usize, key: String, known: String| {
        if first.as_ref().is_none_or(|(s, _, _)| start < *s) {
            first = Some((start, key, known));
        }
    };
    let known_keys = known_keys();
    for (section, value) in doc.iter() {
        let name: &str = section.get_ref();
        let Some((_, keys)) = known_keys.iter().find(|(s, _)| s == name) else {
            let known = known_keys
                .iter()
                .map(|(s, _)| format!("[{s}]"))
                .collect::<Vec<_>>()
                .join(", ");
            note(section.span().start, name.to_owned(), known);
            continue;
        };
        let Some(table) = value.get_ref().as_table() else {
            continue;
        };
        for (key, _) in table.iter() {
            let key_name: &str = key.get_ref();
            if !keys.iter().any(|k| k == key_name) {
                note(
                    key.span().start,
                    format!("{name}.{key_name}"),
                    keys.join(", "),
                );
            }
        }
    }
    match first {
        None => Ok(()),
        Some((start, key, known)) => Err(ConfigError::UnknownKey {
            path: path.to_owned(),
            position: Some(position_of(text, start)),
            key,
            known,
        }),
    }
}

fn malformed(
    path: &Path,
    text: &str,
    doc: Option<&toml::de::DeTable<'_>>,
    e: &toml::de::Error,
) -> ConfigError {
    let start = e.span().map(|s| s.start);
    ConfigError::Malformed {
        path: path.to_owned(),
        position: start.map(|s| position_of(text, s)),
        key: doc.zip(start).and_then(|(doc, s)| key_at(doc, s)),
        problem: plain_problem(e.message()),
    }
}

/// The parser's message on one line, with Rust type names (serde says
/// "expected struct Network") put in the file's terms.
fn plain_problem(message: &str) -> String {
    let mut problem = message.trim().replace('\n', "; ");
    for name in ["Network", "Discovery", "Api", "Settings"] {
        problem = problem.replace(&format!("struct {name}"), "a table");
    }
    problem
}

/// The dotted key (at most two levels, as deep as the format goes) whose
/// value covers byte `offset`, so that a type error can name its key.
fn key_at(doc: &toml::de::DeTable<'_>, offset: usize) -> Option<String> {
    // A `[section]` table's own span need not cover its entries, so look at
    // every entry before the sections themselves.
    for (section, value) in doc.iter() {
        let Some(table) = value.get_ref().as_table() else {
            continue;
        };
        for (key, inner) in table.iter() {
            if inner.span().contains(&offset) {
                let (section, key): (&str, &str) = (section.get_ref(), key.get_ref());
                return Some(format!("{section}.{key}"));
            }
        }
    }
    doc.iter()
        .find(|(_, value)| value.span().contains(&offset))
        .map(|(section, _)| section.get_ref().to_string())
}

/// Line and column of byte `offset` in `text`, both from 1.
fn position_of(text: &str, offset: usize) -> Position {
    let mut end = offset.min(text.len());
    // Spans from the parser fall on character boundaries; this only guards
    // the slice below if one ever does not.
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    let before = &text[..end];
    let line = before.matches('\n').count() + 1;
    let column = before.rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
    Position { line, column }
}

/// Layers the command line (and its environment variables) over the file
/// and validates the result.
///
/// Command-line lists replace the file's lists when given; `--no-…`
/// switches win over the file. Checks: the API address is a loopback
/// `IP:PORT`; at least one listen address; every list has at most
/// [`MAX_LIST_ENTRIES`] entries; every address starts with `/`, has no
/// whitespace and is at most [`MAX_ADDR_BYTES`] bytes; peer, bootstrap and
/// rendezvous addresses include `/p2p/<peer id>`. An error names where the
/// bad value came from: the file's key, or the flag.
pub fn resolve(file: Settings, cli: Settings) -> Result<Effective, ConfigError> {
    let path = file.path.clone();
    let merged = file
        .overridden_by(&cli)
        .map_err(|e| ConfigError::InvalidValue {
            setting: "the configuration".to_owned(),
            value: String::new(),
            reason: e.to_string(),
        })?;
    let setting = |key: &str| {
        if cli.sets(key) {
            cli_setting(&flag_of(key))
        } else {
            file_setting(path.as_deref(), key)
        }
    };
    let defaults = Settings::default();
    let Network { listen, peers } = merged.network;
    let Discovery {
        known_peers,
        mdns,
        mdns_interfaces,
        dht,
        rendezvous,
        bootstrap,
        rendezvous_servers,
        keepers,
    } = merged.discovery;
    // Every field is set: the file's defaults fill what it leaves out.
    let or_default = |v: Option<bool>| v.unwrap_or(true);
    let list = |v: Option<Vec<String>>| v.unwrap_or_default();

    let listen = listen.or(defaults.network.listen).unwrap_or_default();
    if listen.is_empty() {
        return Err(ConfigError::NoListenAddress {
            setting: setting("network.listen"),
        });
    }
    check_addrs(&listen, &setting("network.listen"), false)?;
    let peers = list(peers);
    check_addrs(&peers, &setting("network.peers"), true)?;
    let mdns_interfaces = list(mdns_interfaces);
    check_interfaces(&mdns_interfaces, &setting("discovery.mdns_interfaces"))?;
    let bootstrap = list(bootstrap);
    check_addrs(&bootstrap, &setting("discovery.bootstrap"), true)?;
    let rendezvous_servers = list(rendezvous_servers);
    check_addrs(
        &rendezvous_servers,
        &setting("discovery.rendezvous_servers"),
        true,
    )?;
    let keepers = list(keepers);
    check_addrs(&keepers, &setting("discovery.keepers"), true)?;
    let api_text = merged
        .api
        .listen
        .or(defaults.api.listen)
        .unwrap_or_default();
    let api_listen = parse_api_listen(&api_text, setting("api.listen"))?;
    let memory_budget_mb = merged
        .memory
        .budget_mb
        .or(defaults.memory.budget_mb)
        .unwrap_or(DEFAULT_MEMORY_BUDGET_MB);
    if memory_budget_mb < MIN_MEMORY_BUDGET_MB {
        return Err(ConfigError::InvalidValue {
            setting: setting("memory.budget_mb"),
            value: memory_budget_mb.to_string(),
            reason: format!("the budget must be at least {MIN_MEMORY_BUDGET_MB} MB"),
        });
    }

    Ok(Effective {
        listen,
        peers,
        known_peers: or_default(known_peers),
        mdns: or_default(mdns),
        mdns_interfaces,
        dht: or_default(dht),
        rendezvous: or_default(rendezvous),
        bootstrap,
        rendezvous_servers,
        keepers,
        api_listen,
        memory_budget_mb,
    })
}

fn file_setting(path: Option<&Path>, key: &str) -> String {
    match path {
        Some(path) => format!("`{key}` in {}", path.display()),
        None => format!("`{key}` in the configuration"),
    }
}

fn cli_setting(flag: &str) -> String {
    format!("command-line option {flag}")
}

fn check_count(list: &[String], setting: &str) -> Result<(), ConfigError> {
    if list.len() > MAX_LIST_ENTRIES {
        return Err(ConfigError::TooManyEntries {
            setting: setting.to_owned(),
            count: list.len(),
            max: MAX_LIST_ENTRIES,
        });
    }
    Ok(())
}

fn check_addrs(list: &[String], setting: &str, need_peer_id: bool) -> Result<(), ConfigError> {
    check_count(list, setting)?;
    for addr in list {
        if let Err(reason) = check_addr(addr, need_peer_id) {
            return Err(ConfigError::InvalidValue {
                setting: setting.to_owned(),
                value: quote(addr),
                reason,
            });
        }
    }
    Ok(())
}

/// A light syntactic check of one multiaddr; the daemon parses it for real.
fn check_addr(addr: &str, need_peer_id: bool) -> Result<(), String> {
    if addr.len() > MAX_ADDR_BYTES {
        return Err(format!(
            "it is {} bytes, more than the {MAX_ADDR_BYTES}-byte limit for a multiaddr",
            addr.len()
        ));
    }
    if !addr.starts_with('/') {
        return Err(
            "a multiaddr starts with '/', e.g. /ip4/192.0.2.1/tcp/4001 (not host:port)".to_owned(),
        );
    }
    if addr.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return Err("a multiaddr has no spaces or control characters; remove them".to_owned());
    }
    if need_peer_id && !has_peer_id(addr) {
        return Err(
            "this address must name the peer: append /p2p/<peer id>, e.g. \
             /ip4/192.0.2.1/tcp/4001/p2p/12D3KooW…"
                .to_owned(),
        );
    }
    Ok(())
}

/// Whether `addr` holds a `/p2p/` component followed by something.
fn has_peer_id(addr: &str) -> bool {
    addr.match_indices("/p2p/")
        .any(|(i, m)| addr[i + m.len()..].chars().next().is_some_and(|c| c != '/'))
}

fn check_interfaces(list: &[String], setting: &str) -> Result<(), ConfigError> {
    check_count(list, setting)?;
    for name in list {
        // Only obvious mistakes are caught: interface names differ by
        // platform (Windows ones may hold spaces), and the mDNS layer reports
        // a name that matches no interface.
        let reason = if name.is_empty() {
            Some("an interface name cannot be empty".to_owned())
        } else if name.len() > MAX_INTERFACE_NAME_BYTES {
            Some(format!(
                "an interface name is at most {MAX_INTERFACE_NAME_BYTES} bytes"
            ))
        } else if name.chars().any(char::is_control) {
            Some("an interface name has no control characters".to_owned())
        } else {
            None
        };
        if let Some(reason) = reason {
            return Err(ConfigError::InvalidValue {
                setting: setting.to_owned(),
                value: quote(name),
                reason,
            });
        }
    }
    Ok(())
}

fn parse_api_listen(text: &str, setting: String) -> Result<SocketAddr, ConfigError> {
    let addr: SocketAddr = text.parse().map_err(|_| ConfigError::InvalidValue {
        setting: setting.clone(),
        value: quote(text),
        reason: "expected IP:PORT such as 127.0.0.1:0 or [::1]:8080 (port 0 picks a free port)"
            .to_owned(),
    })?;
    if !addr.ip().is_loopback() {
        return Err(ConfigError::ApiNotLoopback { setting, addr });
    }
    Ok(addr)
}

/// `value`, cut to [`MAX_QUOTED_CHARS`] characters so that an error message
/// stays readable.
fn quote(value: &str) -> String {
    if value.chars().count() <= MAX_QUOTED_CHARS {
        value.to_owned()
    } else {
        let mut short: String = value.chars().take(MAX_QUOTED_CHARS).collect();
        short.push('…');
        short
    }
}

/// The file [`write_default`] writes. Every setting is commented out at its
/// default, so that a later release's defaults still apply until the user
/// chooses a value; a test checks that uncommenting them changes nothing.
const DEFAULT_FILE: &str = r#"# nuwa-node configuration. Every key is optional; each commented-out line
# shows the default. Remove the leading '#' to change a setting.
#
# Command-line options override this file: a list given on the command line
# replaces the list here, and --no-known-peers, --no-mdns, --no-dht and
# --no-rendezvous switch a source off even when it is on here.

[network]
# Addresses to listen on for peers (multiaddrs).
#listen = ["/ip4/0.0.0.0/tcp/0", "/ip4/0.0.0.0/udp/0/quic-v1"]
# Peers to dial at start; each address includes /p2p/<peer id>,
# e.g. "/ip4/192.0.2.1/tcp/4001/p2p/12D3KooW...".
#peers = []

[discovery]
# Peers are looked for in this order (NIP-6): known peers, mDNS on the LAN,
# the DHT, rendezvous servers. Each source can be switched off.
#known_peers = true
#mdns = true
# Network interfaces for mDNS, e.g. ["eth0"]; empty means every
# non-loopback interface.
#mdns_interfaces = []
#dht = true
#rendezvous = true
# DHT bootstrap peers; each address includes /p2p/<peer id>.
#bootstrap = []
# Rendezvous servers; each address includes /p2p/<peer id>.
#rendezvous_servers = []
# Keepers (rendezvous --keeper nodes, with /p2p/) that hold this agent's
# sealed changes for devices that are never online together.
#keepers = []

[api]
# Address of the local HTTP API the CLI talks to. Loopback only
# (127.0.0.1 or [::1]); port 0 picks a free port.
#listen = "127.0.0.1:0"

[memory]
# Resident memory (MB) above which containers leave memory at once, least
# recently used first; they load again when used. Containers unused for a
# minute leave memory anyway.
#budget_mb = 256
"#;

/// Writes a commented default `HOME/config.toml` unless one already exists
/// (an existing file is never touched), and returns its path.
pub fn write_default(home: &Path) -> Result<PathBuf, ConfigError> {
    let path = home.join(CONFIG_FILE);
    // `create_new` makes "only if none exists" atomic.
    let mut file = match OpenOptions::new().write(true).create_new(true).open(&path) {
        Ok(file) => file,
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => return Ok(path),
        Err(source) => return Err(ConfigError::Write { path, source }),
    };
    if let Err(source) = file
        .write_all(DEFAULT_FILE.as_bytes())
        .and_then(|()| file.sync_all())
    {
        drop(file);
        // A partial file would be read back as malformed; remove it so that
        // the next attempt starts clean. Best effort: the write error is the
        // one to report.
        let _ = fs::remove_file(&path);
        return Err(ConfigError::Write { path, source });
    }
    Ok(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    const PEER: &str = "/ip4/192.0.2.1/tcp/4001/p2p/12D3KooWExample";

    fn write_config(text: &str) -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        fs::write(dir.path().join(CONFIG_FILE), text).unwrap();
        dir
    }

    /// The settings `run` gets from these command-line arguments (clap
    /// parses them, as in the binary).
    fn flags(args: &[&str]) -> Settings {
        use clap::{Args as _, FromArgMatches as _};
        let cmd = Settings::augment_args(clap::Command::new("nuwa-node"));
        let matches = cmd
            .try_get_matches_from(std::iter::once("nuwa-node").chain(args.iter().copied()))
            .unwrap();
        Settings::from_arg_matches(&matches).unwrap()
    }

    fn strings(items: &[&str]) -> Vec<String> {
        items.iter().map(|s| (*s).to_owned()).collect()
    }

    fn default_effective() -> Effective {
        Effective {
            listen: strings(&[DEFAULT_LISTEN, DEFAULT_LISTEN_QUIC]),
            peers: Vec::new(),
            known_peers: true,
            mdns: true,
            mdns_interfaces: Vec::new(),
            dht: true,
            rendezvous: true,
            bootstrap: Vec::new(),
            rendezvous_servers: Vec::new(),
            keepers: Vec::new(),
            api_listen: "127.0.0.1:0".parse().unwrap(),
            memory_budget_mb: 256,
        }
    }

    #[test]
    fn defaults_without_a_file() {
        // Goal: no config file means every default. Method: load from an
        // empty home and resolve with no command-line options.
        let dir = tempfile::tempdir().unwrap();
        let file = load(dir.path()).unwrap();
        assert_eq!(file, Settings::default());
        assert_eq!(file.path(), None);
        assert_eq!(resolve(file, flags(&[])).unwrap(), default_effective());
    }

    #[test]
    fn a_full_file_parses() {
        // Goal: every key is read into its field. Method: set every key to a
        // non-default value and compare the loaded and resolved settings.
        let dir = write_config(&format!(
            r#"
[network]
listen = ["/ip4/127.0.0.1/tcp/4001", "/ip6/::1/tcp/4001"]
peers = ["{PEER}"]
[discovery]
known_peers = false
mdns = false
mdns_interfaces = ["lo", "eth0"]
dht = false
rendezvous = false
bootstrap = ["{PEER}", "/dnsaddr/bootstrap.example/p2p/12D3KooWOther"]
rendezvous_servers = ["{PEER}"]
keepers = ["{PEER}"]
[api]
listen = "[::1]:7000"
[memory]
budget_mb = 128
"#
        ));
        let file = load(dir.path()).unwrap();
        let path = dir.path().join(CONFIG_FILE);
        assert_eq!(
            file,
            Settings {
                network: Network {
                    listen: Some(strings(&["/ip4/127.0.0.1/tcp/4001", "/ip6/::1/tcp/4001"])),
                    peers: Some(strings(&[PEER])),
                },
                discovery: Discovery {
                    known_peers: Some(false),
                    mdns: Some(false),
                    mdns_interfaces: Some(strings(&["lo", "eth0"])),
                    dht: Some(false),
                    rendezvous: Some(false),
                    bootstrap: Some(strings(&[
                        PEER,
                        "/dnsaddr/bootstrap.example/p2p/12D3KooWOther"
                    ])),
                    rendezvous_servers: Some(strings(&[PEER])),
                    keepers: Some(strings(&[PEER])),
                },
                api: Api {
                    listen: Some("[::1]:7000".to_owned()),
                },
                memory: Memory {
                    budget_mb: Some(128),
                },
                path: Some(path),
            }
        );
        let eff = resolve(file, flags(&[])).unwrap();
        assert_eq!(
            eff,
            Effective {
                listen: strings(&["/ip4/127.0.0.1/tcp/4001", "/ip6/::1/tcp/4001"]),
                peers: strings(&[PEER]),
                known_peers: false,
                mdns: false,
                mdns_interfaces: strings(&["lo", "eth0"]),
                dht: false,
                rendezvous: false,
                bootstrap: strings(&[PEER, "/dnsaddr/bootstrap.example/p2p/12D3KooWOther"]),
                rendezvous_servers: strings(&[PEER]),
                keepers: strings(&[PEER]),
                api_listen: "[::1]:7000".parse().unwrap(),
                memory_budget_mb: 128,
            }
        );
    }

    #[test]
    fn a_partial_file_keeps_the_other_defaults() {
        // Goal: keys and sections left out keep their defaults. Method: set
        // one key and compare with the default config changed in that key.
        let dir = write_config("[discovery]\ndht = false\n");
        let file = load(dir.path()).unwrap();
        let mut want = Settings {
            path: Some(dir.path().join(CONFIG_FILE)),
            ..Settings::default()
        };
        want.discovery.dht = Some(false);
        assert_eq!(file, want);
    }

    // Goal: the `--no-…` switches and their variables mean "turn the
    // source off"; an option not given is not a setting at all.
    #[test]
    fn switches_turn_sources_off_and_absent_options_set_nothing() {
        let none = flags(&[]);
        assert_eq!(
            serde_json::to_value(&none).unwrap(),
            serde_json::json!({"network": {}, "discovery": {}, "api": {}, "memory": {}})
        );
        let off = flags(&["--no-mdns", "--no-dht"]);
        assert_eq!(
            (off.discovery.mdns, off.discovery.dht),
            (Some(false), Some(false))
        );
        assert_eq!(off.discovery.rendezvous, None);
        for (text, setting) in [
            ("1", false),
            ("true", false),
            ("ON", false),
            ("0", true),
            ("false", true),
        ] {
            assert_eq!(off_switch(text), Ok(setting), "{text}");
        }
        assert!(off_switch("maybe").is_err());
    }

    #[test]
    fn known_keys_match_the_structs() {
        // Goal: the keys the file accepts (derived from the structs) are
        // exactly the documented file format, so renaming a field cannot
        // silently change it. Method: compare with the format as written.
        let mut got = known_keys();
        for (_, keys) in &mut got {
            keys.sort();
        }
        got.sort();
        let want: Vec<(String, Vec<String>)> = vec![
            ("api".into(), strings(&["listen"])),
            (
                "discovery".into(),
                strings(&[
                    "bootstrap",
                    "dht",
                    "keepers",
                    "known_peers",
                    "mdns",
                    "mdns_interfaces",
                    "rendezvous",
                    "rendezvous_servers",
                ]),
            ),
            ("memory".into(), strings(&["budget_mb"])),
            ("network".into(), strings(&["listen", "peers"])),
        ];
        assert_eq!(got, want);
    }

    #[test]
    fn unknown_keys_are_named_with_file_and_position() {
        // Goal: an unknown key is rejected by its dotted name, with the file
        // and where it is. Method: one case per place a key can go wrong.
        let cases: &[(&str, &str, Position)] = &[
            ("colour = 1\n", "colour", Position { line: 1, column: 1 }),
            (
                "[discovery]\nmdns = true\nmnds = false\n",
                "discovery.mnds",
                Position { line: 3, column: 1 },
            ),
            (
                "network.lisen = []\n",
                "network.lisen",
                Position { line: 1, column: 9 },
            ),
            (
                "[api]\n  listen = \"127.0.0.1:0\"\n  port = 1\n[extra]\n",
                "api.port",
                Position { line: 3, column: 3 },
            ),
        ];
        for (text, want_key, want_pos) in cases {
            let dir = write_config(text);
            let err = load(dir.path()).unwrap_err();
            let msg = err.to_string();
            match &err {
                ConfigError::UnknownKey {
                    path,
                    key,
                    position,
                    ..
                } => {
                    assert_eq!(key, want_key, "{text:?}");
                    assert_eq!(*position, Some(*want_pos), "{text:?}");
                    assert_eq!(path, &dir.path().join(CONFIG_FILE));
                }
                other => panic!("{text:?}: expected UnknownKey, got {other:?}"),
            }
            assert!(msg.contains(&format!("`{want_key}`")), "{msg}");
            assert!(msg.contains(CONFIG_FILE), "{msg}");
            assert!(msg.contains("remove it"), "{msg}");
        }
    }

    #[test]
    fn malformed_files_are_reported_with_line_and_column() {
        // Goal: bad TOML or a wrong type gives file, position, problem and a
        // fix. Method: one case per kind of mistake.
        let cases: &[(&[u8], Position, Option<&str>)] = &[
            (b"[network\n", Position { line: 1, column: 9 }, None),
            (
                b"[network]\nlisten = [\"/ip4/0.0.0.0/tcp/0\"\n",
                Position {
                    line: 2,
                    column: 31,
                },
                None,
            ),
            (
                b"[discovery]\n\nmdns = \"yes\"\n",
                Position { line: 3, column: 8 },
                Some("discovery.mdns"),
            ),
            (
                b"[network]\npeers = [1]\n",
                Position {
                    line: 2,
                    column: 10,
                },
                Some("network.peers"),
            ),
            (
                b"network = 5\n",
                Position {
                    line: 1,
                    column: 11,
                },
                Some("network"),
            ),
            (b"[api]\n[api]\n", Position { line: 2, column: 2 }, None),
            (
                b"# caf\xc3\xa9\n\xff\n",
                Position { line: 2, column: 1 },
                None,
            ),
        ];
        for (text, want_pos, want_key) in cases {
            let dir = tempfile::tempdir().unwrap();
            fs::write(dir.path().join(CONFIG_FILE), text).unwrap();
            let err = load(dir.path()).unwrap_err();
            let msg = err.to_string();
            let shown = String::from_utf8_lossy(text);
            match &err {
                ConfigError::Malformed {
                    path,
                    position,
                    key,
                    problem,
                } => {
                    assert_eq!(path, &dir.path().join(CONFIG_FILE), "{shown:?}");
                    assert_eq!(*position, Some(*want_pos), "{shown:?}: {msg}");
                    assert_eq!(key.as_deref(), *want_key, "{shown:?}: {msg}");
                    assert!(!problem.is_empty());
                    assert!(!problem.contains('\n'), "{problem:?}");
                }
                other => panic!("{shown:?}: expected Malformed, got {other:?}"),
            }
            assert!(msg.contains(&format!("at {want_pos}")), "{msg}");
            assert!(msg.contains("fix it there"), "{msg}");
            assert!(!msg.contains("struct"), "{msg}");
        }
    }

    #[test]
    fn an_oversized_file_is_refused() {
        // Goal: a huge file is not read into memory. Method: write one byte
        // more than the limit.
        let dir = tempfile::tempdir().unwrap();
        let padding = vec![b'#'; MAX_FILE_BYTES as usize + 1];
        fs::write(dir.path().join(CONFIG_FILE), padding).unwrap();
        let err = load(dir.path()).unwrap_err();
        assert!(
            matches!(err, ConfigError::TooLarge { size_bytes, .. } if size_bytes == MAX_FILE_BYTES + 1),
            "{err:?}"
        );
    }

    #[test]
    fn an_unreadable_file_is_a_read_error() {
        // Goal: an I/O failure other than "missing" is reported, not taken
        // for defaults. Method: make config.toml a directory.
        let dir = tempfile::tempdir().unwrap();
        fs::create_dir(dir.path().join(CONFIG_FILE)).unwrap();
        let err = load(dir.path()).unwrap_err();
        assert!(matches!(err, ConfigError::Read { .. }), "{err:?}");
        assert!(std::error::Error::source(&err).is_some());
    }

    #[test]
    fn command_line_overrides_the_file() {
        // Goal: CLI lists replace file lists, absent CLI lists keep them, and
        // --no-X wins over `X = true`. Method: a file setting everything,
        // resolved against CLI options that set some of it.
        let text = format!(
            r#"
[network]
listen = ["/ip4/127.0.0.1/tcp/1"]
peers = ["{PEER}"]
[discovery]
mdns_interfaces = ["eth0"]
bootstrap = ["{PEER}"]
rendezvous_servers = ["{PEER}"]
[api]
listen = "127.0.0.1:9"
"#
        );
        let other = "/ip4/192.0.2.9/tcp/9/p2p/12D3KooWOther";
        let cases: Vec<(Settings, Effective)> = vec![
            (flags(&[]), {
                Effective {
                    listen: strings(&["/ip4/127.0.0.1/tcp/1"]),
                    peers: strings(&[PEER]),
                    mdns_interfaces: strings(&["eth0"]),
                    bootstrap: strings(&[PEER]),
                    rendezvous_servers: strings(&[PEER]),
                    api_listen: "127.0.0.1:9".parse().unwrap(),
                    memory_budget_mb: 256,
                    ..default_effective()
                }
            }),
            (
                flags(&[
                    "--listen",
                    "/ip4/127.0.0.1/tcp/2",
                    "--listen",
                    "/ip4/127.0.0.1/tcp/3",
                    "--peer",
                    other,
                    "--no-mdns",
                    "--mdns-interface",
                    "lo",
                    "--no-dht",
                    "--no-rendezvous",
                    "--no-known-peers",
                    "--bootstrap",
                    other,
                    "--rendezvous",
                    other,
                    "--rendezvous",
                    PEER,
                    "--api-listen",
                    "[::1]:0",
                ]),
                Effective {
                    listen: strings(&["/ip4/127.0.0.1/tcp/2", "/ip4/127.0.0.1/tcp/3"]),
                    peers: strings(&[other]),
                    known_peers: false,
                    mdns: false,
                    mdns_interfaces: strings(&["lo"]),
                    dht: false,
                    rendezvous: false,
                    bootstrap: strings(&[other]),
                    rendezvous_servers: strings(&[other, PEER]),
                    keepers: Vec::new(),
                    api_listen: "[::1]:0".parse().unwrap(),
                    memory_budget_mb: 256,
                },
            ),
            (
                flags(&["--no-dht", "--bootstrap", other]),
                Effective {
                    listen: strings(&["/ip4/127.0.0.1/tcp/1"]),
                    peers: strings(&[PEER]),
                    mdns_interfaces: strings(&["eth0"]),
                    dht: false,
                    bootstrap: strings(&[other]),
                    rendezvous_servers: strings(&[PEER]),
                    api_listen: "127.0.0.1:9".parse().unwrap(),
                    memory_budget_mb: 256,
                    ..default_effective()
                },
            ),
        ];
        let dir = write_config(&text);
        for (cli, want) in cases {
            let file = load(dir.path()).unwrap();
            assert_eq!(resolve(file, cli.clone()).unwrap(), want, "{cli:?}");
        }
    }

    #[test]
    fn a_switch_off_in_the_file_stays_off() {
        // Goal: the CLI can only switch sources off, not back on; with no
        // flags, `X = false` in the file holds. Method: resolve such a file.
        let dir = write_config("[discovery]\nmdns = false\nrendezvous = false\n");
        let eff = resolve(load(dir.path()).unwrap(), flags(&[])).unwrap();
        assert!(!eff.mdns && !eff.rendezvous && eff.dht && eff.known_peers);
    }

    /// Resolves `file_text` (as HOME/config.toml) with `cli`, expecting an
    /// error whose message contains every one of `needles`.
    fn check_err(
        file_text: &str,
        cli: Settings,
        is_expected: fn(&ConfigError) -> bool,
        needles: &[&str],
    ) {
        let dir = write_config(file_text);
        let file = load(dir.path()).unwrap();
        let err = resolve(file, cli).unwrap_err();
        assert!(is_expected(&err), "{file_text:?}: unexpected {err:?}");
        let msg = err.to_string();
        for needle in needles {
            assert!(msg.contains(needle), "{msg:?} lacks {needle:?}");
        }
        assert!(!msg.ends_with('.'), "{msg}");
    }

    #[test]
    fn a_memory_budget_too_small_is_refused() {
        // Goal: a budget below the daemon's own footprint is refused,
        // naming where it came from; an adequate one is taken.
        let invalid: fn(&ConfigError) -> bool = |e| matches!(e, ConfigError::InvalidValue { .. });
        check_err(
            "[memory]\nbudget_mb = 8\n",
            flags(&[]),
            invalid,
            &["`memory.budget_mb` in", CONFIG_FILE, "at least 32 MB"],
        );
        check_err(
            "",
            flags(&["--memory-budget-mb", "1"]),
            invalid,
            &["--memory-budget-mb", "at least"],
        );
        let dir = tempfile::tempdir().unwrap();
        let eff = resolve(
            load(dir.path()).unwrap(),
            flags(&["--memory-budget-mb", "64"]),
        )
        .unwrap();
        assert_eq!(eff.memory_budget_mb, 64);
        let eff = resolve(load(dir.path()).unwrap(), flags(&[])).unwrap();
        assert_eq!(eff.memory_budget_mb, DEFAULT_MEMORY_BUDGET_MB);
    }

    #[test]
    fn the_api_must_listen_on_loopback() {
        // Goal: a non-loopback or unparsable API address is refused, naming
        // where it came from. Method: file and CLI cases.
        let not_loopback: fn(&ConfigError) -> bool =
            |e| matches!(e, ConfigError::ApiNotLoopback { .. });
        let invalid: fn(&ConfigError) -> bool = |e| matches!(e, ConfigError::InvalidValue { .. });
        check_err(
            "[api]\nlisten = \"0.0.0.0:8080\"\n",
            flags(&[]),
            not_loopback,
            &["`api.listen` in", CONFIG_FILE, "0.0.0.0:8080", "loopback"],
        );
        check_err(
            "",
            flags(&["--api-listen", "192.0.2.1:1"]),
            not_loopback,
            &["--api-listen", "192.0.2.1:1"],
        );
        check_err(
            "",
            flags(&["--api-listen", "[::]:0"]),
            not_loopback,
            &["--api-listen"],
        );
        check_err(
            "[api]\nlisten = \"localhost:1\"\n",
            flags(&[]),
            invalid,
            &["`api.listen`", "\"localhost:1\"", "127.0.0.1:0"],
        );
    }

    #[test]
    fn peer_addresses_must_name_the_peer() {
        // Goal: bootstrap, rendezvous and static peer addresses without
        // /p2p/<id> are refused, naming the key or flag. Method: one case per
        // list, from the file and from the CLI.
        let invalid: fn(&ConfigError) -> bool = |e| matches!(e, ConfigError::InvalidValue { .. });
        let bare = "/ip4/192.0.2.1/tcp/4001";
        for (file_text, cli, needle) in [
            (
                format!("[discovery]\nbootstrap = [\"{PEER}\", \"{bare}\"]\n"),
                flags(&[]),
                "`discovery.bootstrap` in",
            ),
            (
                format!("[discovery]\nrendezvous_servers = [\"{bare}/p2p/\"]\n"),
                flags(&[]),
                "`discovery.rendezvous_servers` in",
            ),
            (
                format!("[network]\npeers = [\"{bare}\"]\n"),
                flags(&[]),
                "`network.peers` in",
            ),
            (
                String::new(),
                flags(&["--bootstrap", bare]),
                "command-line option --bootstrap",
            ),
            (
                String::new(),
                flags(&["--rendezvous", bare]),
                "command-line option --rendezvous",
            ),
            (
                String::new(),
                flags(&["--peer", bare]),
                "command-line option --peer",
            ),
        ] {
            check_err(&file_text, cli, invalid, &[needle, bare, "/p2p/<peer id>"]);
        }
    }

    #[test]
    fn multiaddrs_get_a_syntactic_check() {
        // Goal: strings that cannot be multiaddrs are refused with the
        // reason. Method: one case per rule, in the listen list.
        let invalid: fn(&ConfigError) -> bool = |e| matches!(e, ConfigError::InvalidValue { .. });
        let long = format!("/dns/{}/tcp/1", "a".repeat(MAX_ADDR_BYTES));
        for (addr, needle) in [
            ("127.0.0.1:4001", "starts with '/'"),
            ("/ip4/1.2.3.4/tcp/1 ", "no spaces"),
            ("/ip4/1.2.3.4/\ttcp/1", "no spaces"),
            (long.as_str(), "-byte limit"),
        ] {
            check_err(
                &format!("[network]\nlisten = [{}]\n", toml::Value::from(addr)),
                flags(&[]),
                invalid,
                &["`network.listen` in", needle],
            );
        }
        // The long value is quoted back shortened.
        let dir = write_config(&format!("[network]\nlisten = [\"{long}\"]\n"));
        let msg = resolve(load(dir.path()).unwrap(), flags(&[]))
            .unwrap_err()
            .to_string();
        assert!(msg.len() < 400 && msg.contains('…'), "{msg}");
    }

    #[test]
    fn listen_and_interface_values_are_checked() {
        // Goal: an empty listen list and empty interface names are refused.
        // Method: resolve files holding each.
        check_err(
            "[network]\nlisten = []\n",
            flags(&[]),
            |e| matches!(e, ConfigError::NoListenAddress { .. }),
            &["`network.listen` in", "/ip4/0.0.0.0/tcp/0"],
        );
        check_err(
            "[discovery]\nmdns_interfaces = [\"lo\", \"\"]\n",
            flags(&[]),
            |e| matches!(e, ConfigError::InvalidValue { .. }),
            &["`discovery.mdns_interfaces` in", "cannot be empty"],
        );
    }

    #[test]
    fn lists_hold_at_most_the_limit() {
        // Goal: every list accepts MAX_LIST_ENTRIES entries and refuses one
        // more. Method: fill each list in turn to the limit and past it.
        let keys: &[(&str, &str, &str)] = &[
            ("network", "listen", "/ip4/127.0.0.1/tcp/"),
            ("network", "peers", "/ip4/127.0.0.1/tcp/1/p2p/12D3KooW"),
            ("discovery", "mdns_interfaces", "eth"),
            (
                "discovery",
                "bootstrap",
                "/ip4/127.0.0.1/tcp/1/p2p/12D3KooW",
            ),
            (
                "discovery",
                "rendezvous_servers",
                "/ip4/127.0.0.1/tcp/1/p2p/12D3KooW",
            ),
        ];
        for (section, key, prefix) in keys {
            let list = |n: usize| {
                let items: Vec<String> = (0..n).map(|i| format!("\"{prefix}{i}\"")).collect();
                format!("[{section}]\n{key} = [{}]\n", items.join(", "))
            };
            let dir = write_config(&list(MAX_LIST_ENTRIES));
            let ok = resolve(load(dir.path()).unwrap(), flags(&[]));
            assert!(ok.is_ok(), "{section}.{key}: {ok:?}");
            check_err(
                &list(MAX_LIST_ENTRIES + 1),
                flags(&[]),
                |e| {
                    matches!(
                        e,
                        ConfigError::TooManyEntries {
                            count: 65,
                            max: 64,
                            ..
                        }
                    )
                },
                &[&format!("`{section}.{key}` in"), "65 entries", "64"],
            );
        }
        check_err(
            "",
            flags(&[["--bootstrap", PEER]; MAX_LIST_ENTRIES + 1].concat()),
            |e| matches!(e, ConfigError::TooManyEntries { .. }),
            &["command-line option --bootstrap"],
        );
    }

    #[test]
    fn write_default_round_trips_and_never_overwrites() {
        // Goal: the default file loads back as the defaults, and an existing
        // file is left alone. Method: write, load, write again over a
        // changed file, compare.
        let dir = tempfile::tempdir().unwrap();
        let path = write_default(dir.path()).unwrap();
        assert_eq!(path, dir.path().join(CONFIG_FILE));
        let file = load(dir.path()).unwrap();
        assert_eq!(
            file,
            Settings {
                path: Some(path.clone()),
                ..Settings::default()
            }
        );
        assert_eq!(resolve(file, flags(&[])).unwrap(), default_effective());

        let mine = "[discovery]\nmdns = false\n";
        fs::write(&path, mine).unwrap();
        assert_eq!(write_default(dir.path()).unwrap(), path);
        assert_eq!(fs::read_to_string(&path).unwrap(), mine);
    }

    #[test]
    fn the_default_file_documents_the_real_defaults() {
        // Goal: the values shown in the default file are the defaults.
        // Method: uncomment every setting line and load it.
        let uncommented: String = DEFAULT_FILE
            .lines()
            .map(|l| match l.strip_prefix('#') {
                Some(rest) if rest.chars().next().is_some_and(char::is_alphabetic) => rest,
                _ => l,
            })
            .map(|l| format!("{l}\n"))
            .collect();
        let settings = uncommented.lines().filter(|l| l.contains(" = ")).count();
        let all_keys: usize = known_keys().iter().map(|(_, keys)| keys.len()).sum();
        assert_eq!(settings, all_keys, "{uncommented}");
        let dir = write_config(&uncommented);
        let file = load(dir.path()).unwrap();
        assert_eq!(
            file,
            Settings {
                path: Some(dir.path().join(CONFIG_FILE)),
                ..Settings::default()
            }
        );
    }

    #[test]
    fn write_default_reports_a_missing_home() {
        // Goal: a write failure is an error naming the file. Method: write
        // into a home that does not exist.
        let dir = tempfile::tempdir().unwrap();
        let err = write_default(&dir.path().join("absent")).unwrap_err();
        assert!(matches!(err, ConfigError::Write { .. }), "{err:?}");
        assert!(err.to_string().contains("absent"), "{err}");
    }
}
