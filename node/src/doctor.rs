//! `nuwa-node doctor`: checks a home and its running daemon, and explains.
//!
//! Every check ends as pass, warn, fail or skip, says what it found, and
//! for a warning or a failure gives the exact fix (a command or the flag to
//! use). The command exits 0 when no check failed. Checks that only the
//! running daemon can answer (clock, reachability, peers) are skipped when
//! it does not run; the others read the home and the host directly, so they
//! work offline too.
//!
//! Also here: `master-key backup`, which copies the master key out of the
//! home and records when, so that `doctor` can stop warning about it.
//!
//! This module only reads: it never takes the home's lock (a doctor holding
//! it for a moment could make a daemon that starts then refuse to run) and
//! writes nothing but the backup and its record.

use std::fs;
use std::io::Write as _;
use std::os::unix::fs::{MetadataExt as _, OpenOptionsExt as _, PermissionsExt as _};
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context as _, Result, bail};
use serde::{Deserialize, Serialize};

use crate::config;
use crate::home;
use nuwa_agent::diagnosis::{Check, Report, check_clock, check_peers, check_reachability};
use nuwa_agent::lifecycle::admin_of;
use nuwa_agent::status::Status;

/// The record `master-key backup` leaves in the home.
pub const MASTER_KEY_BACKUP: &str = "master-key-backup.json";

/// Free space on the home's file system below which `doctor` fails.
const DISK_FAIL_BYTES: u64 = 100 * 1024 * 1024;
/// Free space below which `doctor` warns.
const DISK_WARN_BYTES: u64 = 1024 * 1024 * 1024;
/// How long `doctor` waits for the daemon's status.
const STATUS_TIMEOUT: Duration = Duration::from_secs(10);

/// Runs every check on `home`, prints the report (text or JSON), and
/// returns whether no check failed. `net` are the settings flags given to
/// `doctor`, layered over HOME/config.toml as `run` would layer them.
pub fn run(home: &Path, net: config::Settings, json: bool) -> Result<bool> {
    let report = Report::new(checks(home, net));
    if json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", report.render(home));
    }
    Ok(report.ok)
}

fn checks(home: &Path, net: config::Settings) -> Vec<Check> {
    let h = home.display().to_string();
    let mut out = Vec::new();
    let home_check = check_home(home);
    let initialised = home.join(home::DEVICE_KEY).exists();
    out.push(home_check);
    if !initialised {
        for name in [
            "config",
            "daemon",
            "clock",
            "mdns",
            "reachability",
            "peers",
            "dht-pointer",
            "disk",
            "master-key",
        ] {
            out.push(Check::skip(name, "needs an initialised home"));
        }
        return out;
    }

    let settings = config::load(home).and_then(|file| config::resolve(file, net));
    let settings = match settings {
        Ok(s) => {
            out.push(Check::pass(
                "config",
                format!(
                    "{} and the flags given here are valid",
                    home.join(config::CONFIG_FILE).display()
                ),
            ));
            Some(s)
        }
        Err(e) => {
            out.push(Check::fail(
                "config",
                e.to_string(),
                format!(
                    "correct the setting named above in {} (or the flag); \
                     `nuwa-node run --help` lists every setting",
                    home.join(config::CONFIG_FILE).display()
                ),
            ));
            None
        }
    };

    let status = match daemon_status(home) {
        Ok(st) => {
            out.push(Check::pass(
                "daemon",
                format!(
                    "running and answering (version {}, API {})",
                    if st.version.is_empty() {
                        "unknown"
                    } else {
                        &st.version
                    },
                    st.api_url
                ),
            ));
            Some(st)
        }
        Err(why) => {
            out.push(Check::fail(
                "daemon",
                format!("not running: {why}"),
                format!(
                    "start it with `nuwa-node --home {h} run`, or keep it running as a \
                     service with `nuwa-node --home {h} service install --user`"
                ),
            ));
            None
        }
    };

    match &status {
        Some(st) => out.push(check_clock(st)),
        None => out.push(Check::skip("clock", "needs the running daemon")),
    }
    match &settings {
        Some(s) => out.push(check_mdns(home, s, status.as_ref())),
        None => out.push(Check::skip("mdns", "needs a valid config")),
    }
    match &status {
        Some(st) => {
            let rendezvous = settings.as_ref().map_or(0, |s| s.rendezvous_servers.len());
            let h = home.display().to_string();
            out.push(check_reachability(&h, st, rendezvous));
            out.push(check_peers(&h, st, other_active_devices(home)));
        }
        None => {
            out.push(Check::skip("reachability", "needs the running daemon"));
            out.push(Check::skip("peers", "needs the running daemon"));
        }
    }
    out.push(check_dht_pointer(home, settings.as_ref()));
    out.push(check_disk(home));
    out.push(check_master_key(home));
    out.push(check_recovery(home));
    out
}

/// The agent's way back when every admin device is lost: a recovery key
/// in the DID document (agents created before recovery words had none),
/// and a second admin device so that one loss needs no words at all.
fn check_recovery(home: &Path) -> Check {
    const NAME: &str = "recovery";
    let h = home.display().to_string();
    let Ok((device, log)) = read_identity(home) else {
        return Check::skip(
            NAME,
            "the home's DID log cannot be read (see the home check)",
        );
    };
    let doc = log.current();
    let admins = doc
        .capability_delegation
        .iter()
        .filter(|id| !nuwa_agent::lifecycle::is_recovery_key(id))
        .count();
    if nuwa_agent::lifecycle::recovery_keys(doc).is_empty() {
        return Check::warn(
            NAME,
            "the agent has no recovery key: if every admin device is lost, no device can ever \
             be approved or revoked again",
            format!(
                "on an admin device: `nuwa-node --home {h} recovery create` (shows 12 words to \
                 write down and keep offline)"
            ),
        );
    }
    let me_admin = admin_of(&log, &device, None, home::now_unix_secs()).is_ok();
    if admins <= 1 {
        return Check::warn(
            NAME,
            format!(
                "recovery words are set, and {} the only admin key: losing it means recovering \
                 with the words",
                if me_admin || home.join(home::MASTER_KEY).exists() {
                    "this home holds"
                } else {
                    "one device holds"
                }
            ),
            "make a second device an admin: `nuwa-node device promote CONTEXT_ID` on an admin \
             device (`device list` shows the context ids)",
        );
    }
    Check::pass(
        NAME,
        format!("recovery words are set, and {admins} keys are admin keys"),
    )
}

/// The status report, or why the daemon is not running or not answering.
fn daemon_status(home: &Path) -> Result<Status, String> {
    if !home.join(home::API_FILE).exists() {
        return Err(format!(
            "{} is absent, so no daemon runs on this home",
            home.join(home::API_FILE).display()
        ));
    }
    crate::client::fetch_status(home, STATUS_TIMEOUT).map_err(|e| format!("{e:#}"))
}

// ---------------------------------------------------------------- home

/// The name of the home check.
const HOME_CHECK: &str = "home";

fn check_home(home: &Path) -> Check {
    let h = home.display().to_string();
    let meta = match home_dir_metadata(home, &h) {
        Ok(m) => m,
        Err(failed) => return failed,
    };
    let access = HomeAccess::audit(home, &h, &meta);
    if access.problems.is_empty() {
        return Check::pass(
            HOME_CHECK,
            format!("{h} is initialised; directory 700, key files 600, all owned by you"),
        );
    }
    access.into_check(&h)
}

/// The metadata of the home directory, or the failed check when there is
/// no initialised home at `home` to look into (`h` is its display form).
fn home_dir_metadata(home: &Path, h: &str) -> Result<fs::Metadata, Check> {
    let meta = match fs::metadata(home) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(Check::fail(
                HOME_CHECK,
                format!("{h} does not exist"),
                format!(
                    "create a new agent with `nuwa-node --home {h} init`, or join an existing \
                     one with `nuwa-node --home {h} pair`; or point --home (or NUWA_HOME) at \
                     the right directory"
                ),
            ));
        }
        Err(e) => {
            return Err(Check::fail(
                HOME_CHECK,
                format!("cannot read {h}: {e}"),
                "run doctor as the user who owns the home",
            ));
        }
    };
    if !meta.is_dir() {
        return Err(Check::fail(
            HOME_CHECK,
            format!("{h} is not a directory"),
            "point --home (or NUWA_HOME) at the home directory",
        ));
    }
    if !home.join(home::DEVICE_KEY).exists() {
        return Err(Check::fail(
            HOME_CHECK,
            format!("{h} is not a nuwa-node home (no {})", home::DEVICE_KEY),
            format!(
                "create a new agent with `nuwa-node --home {h} init`, or join an existing one \
                 with `nuwa-node --home {h} pair`"
            ),
        ));
    }
    Ok(meta)
}

/// What is wrong with the modes and owners in a home: the home holds this
/// device's keys, so only its owner may read it.
struct HomeAccess {
    problems: Vec<String>,
    /// The commands that make the home private again.
    chmod: Vec<String>,
    /// Whether something in the home belongs to another user.
    foreign: bool,
}

impl HomeAccess {
    /// Looks at the home directory (`meta`), its key files and its store.
    fn audit(home: &Path, h: &str, meta: &fs::Metadata) -> HomeAccess {
        // SAFETY: geteuid has no preconditions and cannot fail.
        let me = unsafe { libc::geteuid() };
        let mut access = HomeAccess {
            problems: Vec::new(),
            chmod: Vec::new(),
            foreign: false,
        };
        let dir_mode = meta.permissions().mode() & 0o777;
        if dir_mode & 0o077 != 0 || dir_mode & 0o700 != 0o700 {
            access
                .problems
                .push(format!("directory mode {dir_mode:03o} (want 700)"));
            access.chmod.push(format!("chmod 700 {h}"));
        }
        if meta.uid() != me {
            access.problems.push(format!(
                "directory owned by uid {} (you are {me})",
                meta.uid()
            ));
            access.foreign = true;
        }
        let loose_files = access.audit_files(home, me);
        let store = home.join(home::STORE_DIR);
        if let Ok(m) = fs::metadata(&store)
            && m.permissions().mode() & 0o077 != 0
        {
            access.problems.push(format!(
                "{} mode {:03o} (want 700)",
                home::STORE_DIR,
                m.permissions().mode() & 0o777
            ));
            access
                .chmod
                .push(format!("chmod -R go-rwx {}", store.display()));
        }
        if !loose_files.is_empty() {
            access
                .chmod
                .push(format!("chmod 600 {}", loose_files.join(" ")));
        }
        access
    }

    /// Checks the key files and records of the home that exist, and
    /// returns the paths of those others may read.
    fn audit_files(&mut self, home: &Path, me: u32) -> Vec<String> {
        let mut loose_files = Vec::new();
        for name in [
            home::DEVICE_KEY,
            home::MASTER_KEY,
            home::SYNC_KEY,
            home::EPOCH_GRANT,
            home::AT_REST_KEY,
            home::DID_LOG,
            home::DEVICE_INFO,
            home::API_FILE,
            MASTER_KEY_BACKUP,
        ] {
            let path = home.join(name);
            let Ok(m) = fs::symlink_metadata(&path) else {
                continue;
            };
            let mode = m.permissions().mode() & 0o777;
            if mode & 0o077 != 0 {
                self.problems
                    .push(format!("{name} mode {mode:03o} (want 600)"));
                loose_files.push(path.display().to_string());
            }
            if m.uid() != me {
                self.problems
                    .push(format!("{name} owned by uid {} (you are {me})", m.uid()));
                self.foreign = true;
            }
        }
        loose_files
    }

    /// The failed check, with a fix for the modes and one for the owners.
    fn into_check(self, h: &str) -> Check {
        let mut fix = Vec::new();
        if !self.chmod.is_empty() {
            fix.push(format!(
                "the home holds this device's keys; make it private: {}",
                self.chmod.join(" && ")
            ));
        }
        if self.foreign {
            fix.push(format!(
                "run nuwa-node as the user who owns the home, or give it to yourself: \
                 sudo chown -R $(id -un) {h}"
            ));
        }
        Check::fail(
            HOME_CHECK,
            format!("permissions are wrong: {}", self.problems.join("; ")),
            fix.join("\n"),
        )
    }
}

// ---------------------------------------------------------------- clock

// ---------------------------------------------------------------- mDNS

/// The interfaces mDNS watches under `configured` (the `mdns_interfaces`
/// setting), the same rule as `nuwa_discovery::Mdns::start`: an empty list
/// means every interface except loopback; a list means exactly those
/// interfaces. Of those, mdns-sd uses the ones that hold an address, are
/// running and are not point-to-point (a VPN tunnel, for one): the filter
/// of its `my_ip_interfaces`. Returns (watched, configured names this host
/// lacks or mdns-sd would not use).
fn mdns_interfaces(configured: &[String]) -> std::io::Result<(Vec<String>, Vec<String>)> {
    // Fails here if the host's interfaces cannot be listed at all.
    if_addrs::get_if_addrs()?;
    // The daemon's own choice (the same function it reports in status).
    let watched = nuwa_discovery::watched_interfaces(configured);
    let missing = configured
        .iter()
        .filter(|c| !watched.contains(c))
        .cloned()
        .collect();
    Ok((watched, missing))
}

/// Every interface name of this host, for the report.
fn host_interfaces() -> String {
    let mut names: Vec<String> = if_addrs::get_if_addrs()
        .map(|v| v.into_iter().map(|i| i.name).collect())
        .unwrap_or_default();
    names.sort();
    names.dedup();
    if names.is_empty() {
        "none".to_owned()
    } else {
        names.join(", ")
    }
}

fn check_mdns(home: &Path, s: &config::Effective, st: Option<&Status>) -> Check {
    const NAME: &str = "mdns";
    let h = home.display().to_string();
    // A running daemon reports whether mDNS is on and what it watches;
    // trust it. Without one, the settings decide (HOME/config.toml and the
    // flags given to doctor).
    if st.is_some_and(|st| !st.mdns.enabled) {
        return Check::pass(
            NAME,
            "off in the running daemon (--no-mdns or `mdns = false`): devices on this LAN are \
             found only through --peer, known peers, the DHT or rendezvous",
        );
    }
    let reported = st.filter(|st| st.mdns.enabled);
    if reported.is_none() && !s.mdns {
        return Check::pass(
            NAME,
            "off by configuration (--no-mdns or `mdns = false`): devices on this LAN are \
             found only through --peer, known peers, the DHT or rendezvous",
        );
    }
    let (watched, missing) = match reported {
        Some(st) => (st.mdns.interfaces.clone(), Vec::new()),
        None => match mdns_interfaces(&s.mdns_interfaces) {
            Ok(w) => w,
            Err(e) => {
                return Check::warn(
                    NAME,
                    format!("cannot list this host's network interfaces: {e}"),
                    "check `ip link` (or `ifconfig`) by hand",
                );
            }
        },
    };
    let other_sources = !s.peers.is_empty()
        || !s.rendezvous_servers.is_empty()
        || !s.bootstrap.is_empty()
        || !s.keepers.is_empty();
    let selection = if s.mdns_interfaces.is_empty() {
        "no interface but loopback is usable".to_owned()
    } else {
        format!(
            "none of --mdns-interface {} is up and usable",
            s.mdns_interfaces.join(",")
        )
    };
    if watched.is_empty() {
        let detail = format!(
            "mDNS is on but watches nothing: {selection} (this host has: {}), so no device on the LAN can be found or find this one",
            host_interfaces()
        );
        let fix = format!(
            "pick one, then restart the daemon:\n\
             devices on this same host: --mdns-interface lo (or mdns_interfaces = [\"lo\"] \
             under [discovery] in {h}/config.toml)\n\
             devices on a LAN: --mdns-interface NAME with an interface that is up (`ip link`)\n\
             devices elsewhere: name them with --peer MULTIADDR, or a server with --rendezvous \
             MULTIADDR or --bootstrap MULTIADDR\n\
             no LAN discovery wanted: --no-mdns"
        );
        return if other_sources {
            Check::warn(NAME, detail, fix)
        } else {
            Check::fail(NAME, detail, fix)
        };
    }
    if !missing.is_empty() {
        return Check::warn(
            NAME,
            format!(
                "watching {}; configured interface(s) {} are absent, down or point-to-point \
                 on this host",
                watched.join(", "),
                missing.join(", ")
            ),
            format!(
                "correct --mdns-interface (or mdns_interfaces in {h}/config.toml); this host \
                 has: {}",
                host_interfaces()
            ),
        );
    }
    Check::pass(NAME, format!("on, watching {}", watched.join(", ")))
}

// ---------------------------------------------------------------- reachability

// ---------------------------------------------------------------- DHT pointer

/// This device's key and the agent's DID log, read straight from the home's
/// files (not through `home::load`, which refuses a home with loose
/// permissions: the home check reports those).
fn read_identity(
    home: &Path,
) -> Result<(
    nuwa_agent::identity::keys::DeviceKey,
    nuwa_agent::identity::chain::DidChain,
)> {
    let seed = zeroize::Zeroizing::new(
        fs::read(home.join(home::DEVICE_KEY))
            .with_context(|| format!("cannot read {}", home::DEVICE_KEY))?,
    );
    let device = nuwa_agent::identity::keys::DeviceKey::from_seed_file_bytes(&seed)
        .with_context(|| format!("cannot read {}", home::DEVICE_KEY))?;
    let log = serde_json::from_slice(
        &fs::read(home.join(home::DID_LOG))
            .with_context(|| format!("cannot read {}", home::DID_LOG))?,
    )
    .with_context(|| format!("cannot parse {}", home::DID_LOG))?;
    Ok((device, log))
}

/// Other active devices of the agent, by the home's DID log (None when it
/// cannot be read).
fn other_active_devices(home: &Path) -> Option<usize> {
    let (device, log) = read_identity(home).ok()?;
    let me = nuwa_agent::identity::keys::context_id_for(&device.public());
    let list = nuwa_agent::devices::list(
        &log,
        &nuwa_agent::devices::Seen::default(),
        &me,
        home::now_ms(),
    );
    Some(
        list.iter()
            .filter(|d| {
                !d.this_device
                    && d.status == "active"
                    && d.relationships.iter().any(|r| r == "authentication")
            })
            .count(),
    )
}

/// The size of the pointer the daemon publishes in the DHT: the proof of
/// this agent's DID document signed by this device (`AgentPointer`, built as
/// `daemon/wide.rs`'s `publish_pointer` builds it), from the home's files.
fn pointer_bytes(home: &Path) -> Result<usize> {
    use nuwa_agent::sync::pointer::{AgentPointer, PointerError};
    let (device, log) = read_identity(home)?;
    let context_id = nuwa_agent::identity::keys::context_id_for(&device.public());
    let peer_id = nuwa_net::id_of(&device.public()).context("cannot derive the peer id")?;
    let pointer = AgentPointer::new_signed(
        &log,
        &context_id,
        &peer_id.to_string(),
        &device,
        home::now_unix_secs(),
    )
    .map_err(|e| anyhow::anyhow!("cannot build the pointer: {e}"))?;
    match pointer.encode() {
        Ok(bytes) => Ok(bytes.len()),
        Err(PointerError::TooLarge { len, .. }) => Ok(len),
        Err(e) => bail!("cannot encode the pointer: {e}"),
    }
}

fn check_dht_pointer(home: &Path, s: Option<&config::Effective>) -> Check {
    const NAME: &str = "dht-pointer";
    let limit = nuwa_agent::sync::pointer::MAX_POINTER_BYTES;
    let bytes = match pointer_bytes(home) {
        Ok(b) => b,
        Err(e) => {
            return Check::warn(
                NAME,
                format!("cannot size the DHT pointer: {e:#}"),
                "run the home check's fix first; a device that is no longer a member (see \
                 `nuwa-node device list`) publishes no pointer",
            );
        }
    };
    let pct = bytes as f64 * 100.0 / limit as f64;
    let off = if s.is_some_and(|s| !s.dht) {
        " (the DHT is off here, --no-dht, so it is not published)"
    } else {
        ""
    };
    let detail = format!(
        "{bytes} of {limit} bytes ({pct:.0} %): the proof of the DID document, signed by this device{off}"
    );
    let fix = "the proof grows with every change of the agent's admins (promote, demote, \
               recovery create, rotating an admin's key), not with pairings; the daemon refuses \
               such a change before the proof outgrows the pointer. Meanwhile rendezvous servers \
               (--rendezvous MULTIADDR) or --peer reach devices outside the LAN";
    if bytes > limit {
        Check::fail(NAME, detail, fix)
    } else if bytes * 4 > limit * 3 {
        Check::warn(NAME, detail, fix)
    } else {
        Check::pass(NAME, detail)
    }
}

// ---------------------------------------------------------------- disk

fn free_bytes(dir: &Path) -> std::io::Result<u64> {
    use std::os::unix::ffi::OsStrExt as _;
    let path = std::ffi::CString::new(dir.as_os_str().as_bytes())
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
    // SAFETY: statvfs writes only into `st`, which is a plain C struct that
    // zeroes are valid for; `path` is a NUL-terminated string that outlives
    // the call.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    let r = unsafe { libc::statvfs(path.as_ptr(), &mut st) };
    if r != 0 {
        return Err(std::io::Error::last_os_error());
    }
    #[allow(clippy::unnecessary_cast)] // the field types differ between platforms
    Ok((st.f_bavail as u64).saturating_mul(st.f_frsize as u64))
}

fn human_bytes(n: u64) -> String {
    const GIB: u64 = 1024 * 1024 * 1024;
    const MIB: u64 = 1024 * 1024;
    if n >= GIB {
        format!("{:.1} GiB", n as f64 / GIB as f64)
    } else {
        format!("{:.0} MiB", n as f64 / MIB as f64)
    }
}

fn check_disk(home: &Path) -> Check {
    const NAME: &str = "disk";
    let free = match free_bytes(home) {
        Ok(f) => f,
        Err(e) => {
            return Check::warn(
                NAME,
                format!("cannot read the free space of {}: {e}", home.display()),
                format!("check by hand with `df -h {}`", home.display()),
            );
        }
    };
    let detail = format!(
        "{} free on the file system of {}",
        human_bytes(free),
        home.display()
    );
    let fix = format!(
        "free space on that file system (`df -h {}` shows it); below 100 MiB writes may fail \
         and the store cannot grow",
        home.display()
    );
    if free < DISK_FAIL_BYTES {
        Check::fail(NAME, detail, fix)
    } else if free < DISK_WARN_BYTES {
        Check::warn(NAME, detail, fix)
    } else {
        Check::pass(NAME, detail)
    }
}

// ---------------------------------------------------------------- master key

/// What `master-key backup` records in the home.
#[derive(Debug, Serialize, Deserialize)]
struct BackupRecord {
    backed_up_unix_ms: u64,
    /// Where the copy was written (it may have moved since).
    to: String,
    /// Names the key that was copied without revealing it, so that a
    /// record left from another key does not count.
    key_fingerprint: String,
}

fn key_fingerprint(key: &[u8]) -> String {
    use sha2::{Digest as _, Sha256};
    let mut h = Sha256::new();
    h.update(b"nuwa-master-key-backup-v1:");
    h.update(key);
    hex::encode(&h.finalize()[..8])
}

fn check_master_key(home: &Path) -> Check {
    const NAME: &str = "master-key";
    let h = home.display().to_string();
    let key = match fs::read(home.join(home::MASTER_KEY)) {
        Ok(k) => zeroize::Zeroizing::new(k),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            // More than one key may be admin (promotion, recovery): say which this is.
            let now = home::now_unix_secs();
            let admin =
                read_identity(home).is_ok_and(|(d, log)| admin_of(&log, &d, None, now).is_ok());
            let said = if admin {
                "not on this device, and none is needed: this device's own key is an admin key \
                 (it approves, promotes and revokes devices)"
            } else {
                "not on this device, and this device is not an admin: approve and revoke \
                 devices on an admin device (`device list` shows which are admins)"
            };
            return Check::pass(NAME, said);
        }
        Err(e) => {
            return Check::fail(
                NAME,
                format!("cannot read {}: {e}", home.join(home::MASTER_KEY).display()),
                "run doctor as the user who owns the home; see the home check",
            );
        }
    };
    let fix = format!(
        "copy it somewhere safe off this device: `nuwa-node --home {h} master-key backup \
         --out /media/usb/nuwa-master.key` (then keep that copy offline). Without a copy, a \
         second admin device (`device promote`) or the recovery words, losing this device \
         means no device can ever be approved or revoked again"
    );
    let record: Option<BackupRecord> = fs::read(home.join(MASTER_KEY_BACKUP))
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok());
    match record {
        None => Check::warn(
            NAME,
            "present and never backed up: it is an admin key (it approves, promotes and \
             revokes devices)",
            fix,
        ),
        Some(r) if r.key_fingerprint != key_fingerprint(&key) => Check::warn(
            NAME,
            format!(
                "present; the backup recorded ({} to {}) is of another key",
                nuwa_agent::devices::format_unix_ms(r.backed_up_unix_ms),
                r.to
            ),
            fix,
        ),
        Some(r) => Check::pass(
            NAME,
            format!(
                "present, backed up on {} to {}",
                nuwa_agent::devices::format_unix_ms(r.backed_up_unix_ms),
                r.to
            ),
        ),
    }
}

/// `master-key backup --out FILE`: copies HOME/master.key to `out` (mode
/// 0600, fsynced, never over an existing file, never inside the home) and
/// records the backup in the home.
pub fn backup_master_key(home: &Path, out: &Path) -> Result<PathBuf> {
    let src = home.join(home::MASTER_KEY);
    let key = zeroize::Zeroizing::new(fs::read(&src).map_err(|e| {
        if e.kind() == std::io::ErrorKind::NotFound {
            anyhow::anyhow!(
                "{} holds no master key ({} is missing); back it up on the device where \
                 `nuwa-node init` ran",
                home.display(),
                home::MASTER_KEY
            )
        } else {
            anyhow::anyhow!("cannot read {}: {e}", src.display())
        }
    })?);
    nuwa_agent::identity::keys::DeviceKey::from_seed_file_bytes(&key)
        .with_context(|| format!("{} is not a valid key file", src.display()))?;

    let file_name = out
        .file_name()
        .with_context(|| format!("--out {} names no file", out.display()))?;
    let parent = match out.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let parent = fs::canonicalize(&parent).with_context(|| {
        format!(
            "the directory of --out {} does not exist; create it first",
            out.display()
        )
    })?;
    let out = parent.join(file_name);
    let home_abs =
        fs::canonicalize(home).with_context(|| format!("cannot resolve {}", home.display()))?;
    if out.starts_with(&home_abs) {
        bail!(
            "{} is inside the home {}; a backup there is lost with the home. Choose a place \
             off this device, e.g. a USB stick",
            out.display(),
            home_abs.display()
        );
    }
    {
        let mut f = fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&out)
            .map_err(|e| {
                if e.kind() == std::io::ErrorKind::AlreadyExists {
                    anyhow::anyhow!(
                        "{} already exists; nothing was overwritten. Choose another file name",
                        out.display()
                    )
                } else {
                    anyhow::anyhow!("cannot create {}: {e}", out.display())
                }
            })?;
        f.set_permissions(fs::Permissions::from_mode(0o600))?;
        f.write_all(&key)
            .and_then(|()| f.sync_all())
            .with_context(|| format!("cannot write {}", out.display()))?;
    }
    fs::File::open(&parent)
        .and_then(|d| d.sync_all())
        .with_context(|| format!("cannot sync {}", parent.display()))?;
    let record = BackupRecord {
        backed_up_unix_ms: home::now_ms(),
        to: out.display().to_string(),
        key_fingerprint: key_fingerprint(&key),
    };
    home::write_private(
        &home.join(MASTER_KEY_BACKUP),
        &serde_json::to_vec_pretty(&record)?,
    )?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    //! The mDNS interface rule against this host, and the backup's
    //! refusals (the report's verdict and rendering are tested with it,
    //! in `nuwa_agent::diagnosis`).
    use super::*;

    #[test]
    fn a_named_interface_that_does_not_exist_is_missing() {
        let (watched, missing) =
            mdns_interfaces(&["no-such-if0".to_owned()]).expect("list interfaces");
        assert!(watched.is_empty());
        assert_eq!(missing, vec!["no-such-if0".to_owned()]);
    }

    #[test]
    fn backup_refuses_inside_the_home_and_over_a_file() {
        let dir = tempfile::tempdir().unwrap();
        let home = dir.path().join("home");
        fs::create_dir(&home).unwrap();
        let key = nuwa_agent::identity::keys::DeviceKey::generate().unwrap();
        fs::write(home.join(home::MASTER_KEY), key.to_seed_file_bytes()).unwrap();
        let inside = backup_master_key(&home, &home.join("copy.key")).unwrap_err();
        assert!(inside.to_string().contains("inside the home"), "{inside}");
        let out = dir.path().join("copy.key");
        fs::write(&out, b"keep me").unwrap();
        let over = backup_master_key(&home, &out).unwrap_err();
        assert!(over.to_string().contains("already exists"), "{over}");
        assert_eq!(fs::read(&out).unwrap(), b"keep me");
        assert!(!home.join(MASTER_KEY_BACKUP).exists());
    }
}
