//! `nuwa-node doctor`: checks a home and its running daemon, and explains.
//!
//! Every check ends as pass, warn, fail or skip, says what it found, and
//! for a warning or a failure gives the exact fix (a command or the flag to
//! use). The command exits 0 when no check failed. Checks that only the
//! running daemon can answer (clock, reachability, peers) are skipped when
//! it does not run; the others read the home and the host directly, so they
//! work offline too.
//!
//! This module gathers the facts (files, modes and owners, interfaces, free
//! space, the daemon's status); every verdict over them, and its wording,
//! is `nuwa_agent::diagnosis`'s.
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

use crate::config;
use crate::home;
use nuwa_agent::diagnosis::{self, Check, Report, check_clock, check_peers, check_reachability};
use nuwa_agent::identity::chain::DidChain;
use nuwa_agent::identity::keys::DeviceKey;
use nuwa_agent::status::Status;

/// The record `master-key backup` leaves in the home.
pub const MASTER_KEY_BACKUP: &str = "master-key-backup.json";

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
    let home_check = diagnosis::check_home(&h, home_found(home));
    if !home.join(home::DEVICE_KEY).exists() {
        return diagnosis::uninitialised(home_check);
    }
    let mut out = vec![home_check];
    let settings = config::load(home).and_then(|file| config::resolve(file, net));
    let config_file = home.join(config::CONFIG_FILE).display().to_string();
    out.push(diagnosis::check_config(
        &config_file,
        settings.as_ref().err().map(ToString::to_string),
    ));
    let settings = settings.ok();
    let status = daemon_status(home);
    out.push(diagnosis::check_daemon(
        &h,
        status.as_ref().map_err(String::as_str),
    ));
    let status = status.ok();
    // Read once: the checks below judge the same identity.
    let identity = read_identity(home);
    let id = identity.as_ref().ok().map(|(d, log)| (d, log));
    let now_secs = home::now_unix_secs();

    match &status {
        Some(st) => out.push(check_clock(st)),
        None => out.push(Check::skip("clock", "needs the running daemon")),
    }
    match &settings {
        Some(s) => out.push(check_mdns(&h, s, status.as_ref())),
        None => out.push(Check::skip("mdns", "needs a valid config")),
    }
    match &status {
        Some(st) => {
            let rendezvous = settings.as_ref().map_or(0, |s| s.rendezvous_servers.len());
            let others = id.map(|(d, log)| diagnosis::other_active_devices(log, d, home::now_ms()));
            out.push(check_reachability(&h, st, rendezvous));
            out.push(check_peers(&h, st, others));
        }
        None => {
            out.push(Check::skip("reachability", "needs the running daemon"));
            out.push(Check::skip("peers", "needs the running daemon"));
        }
    }
    let pointer = match &identity {
        Ok((d, log)) => diagnosis::pointer_bytes(d, log, now_secs),
        Err(e) => Err(format!("{e:#}")),
    };
    let dht_off = settings.as_ref().is_some_and(|s| !s.dht);
    out.push(diagnosis::check_dht_pointer(pointer, dht_off));
    let free = free_bytes(home).map_err(|e| e.to_string());
    out.push(diagnosis::check_disk(&h, free));
    out.push(check_master_key(home, id, now_secs));
    let holds_master_key = home.join(home::MASTER_KEY).exists();
    out.push(diagnosis::check_recovery(
        &h,
        id,
        holds_master_key,
        now_secs,
    ));
    out
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

/// What is at `home`: whether it is an initialised home, and the modes and
/// owners of the directory, its key files and its store.
fn home_found(home: &Path) -> diagnosis::HomeFound {
    use diagnosis::{HomeFile, HomeFound, Mode};
    let mode = |m: &fs::Metadata| Mode {
        mode: m.permissions().mode(),
        uid: m.uid(),
    };
    let meta = match fs::metadata(home) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return HomeFound::Missing,
        Err(e) => return HomeFound::Unreadable(e.to_string()),
    };
    if !meta.is_dir() {
        return HomeFound::NotADirectory;
    }
    if !home.join(home::DEVICE_KEY).exists() {
        return HomeFound::NotAHome {
            device_key: home::DEVICE_KEY,
        };
    }
    let files = [
        home::DEVICE_KEY,
        home::MASTER_KEY,
        home::SYNC_KEY,
        home::EPOCH_GRANT,
        home::AT_REST_KEY,
        home::DID_LOG,
        home::DEVICE_INFO,
        home::API_FILE,
        MASTER_KEY_BACKUP,
    ];
    let files = files.into_iter().filter_map(|name| {
        let path = home.join(name);
        let m = fs::symlink_metadata(&path).ok()?;
        let path = path.display().to_string();
        Some(HomeFile {
            name,
            path,
            mode: mode(&m),
        })
    });
    let store = home.join(home::STORE_DIR);
    HomeFound::Present {
        // SAFETY: geteuid has no preconditions and cannot fail.
        me: unsafe { libc::geteuid() },
        dir: mode(&meta),
        files: files.collect(),
        store: fs::metadata(&store).ok().map(|m| {
            (
                home::STORE_DIR,
                store.display().to_string(),
                m.permissions().mode(),
            )
        }),
    }
}

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

/// The mDNS check: what the running daemon reports, or what the settings
/// (HOME/config.toml and the flags given to doctor) would watch on this
/// host.
fn check_mdns(h: &str, s: &config::Effective, st: Option<&Status>) -> Check {
    let facts = diagnosis::MdnsFacts {
        on: s.mdns,
        configured: &s.mdns_interfaces,
        other_sources: s.peers.len()
            + s.rendezvous_servers.len()
            + s.bootstrap.len()
            + s.keepers.len(),
        watch: mdns_interfaces(&s.mdns_interfaces).map_err(|e| e.to_string()),
        host_interfaces: host_interfaces(),
    };
    diagnosis::check_mdns(h, st, facts)
}

// ---------------------------------------------------------------- identity

/// This device's key and the agent's DID log, read straight from the home's
/// files (not through `home::load`, which refuses a home with loose
/// permissions: the home check reports those).
fn read_identity(home: &Path) -> Result<(DeviceKey, DidChain)> {
    let seed = zeroize::Zeroizing::new(
        fs::read(home.join(home::DEVICE_KEY))
            .with_context(|| format!("cannot read {}", home::DEVICE_KEY))?,
    );
    let device = DeviceKey::from_seed_file_bytes(&seed)
        .with_context(|| format!("cannot read {}", home::DEVICE_KEY))?;
    let log = serde_json::from_slice(
        &fs::read(home.join(home::DID_LOG))
            .with_context(|| format!("cannot read {}", home::DID_LOG))?,
    )
    .with_context(|| format!("cannot parse {}", home::DID_LOG))?;
    Ok((device, log))
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

// ---------------------------------------------------------------- master key

/// The master-key check, over the key file and the backup record in the
/// home (`id`: this device's key and DID log, when they could be read).
fn check_master_key(home: &Path, id: Option<(&DeviceKey, &DidChain)>, now_secs: i64) -> Check {
    use diagnosis::MasterKeyFound;
    let h = home.display().to_string();
    let key = match fs::read(home.join(home::MASTER_KEY)) {
        Ok(k) => zeroize::Zeroizing::new(k),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let admin = diagnosis::is_admin(id, now_secs);
            return diagnosis::check_master_key(&h, MasterKeyFound::Absent { admin });
        }
        Err(e) => {
            let path = home.join(home::MASTER_KEY).display().to_string();
            let error = e.to_string();
            return diagnosis::check_master_key(&h, MasterKeyFound::Unreadable { path, error });
        }
    };
    let record = fs::read(home.join(MASTER_KEY_BACKUP))
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok());
    diagnosis::check_master_key(&h, MasterKeyFound::Present { key: &key, record })
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
    DeviceKey::from_seed_file_bytes(&key)
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
    let record = diagnosis::BackupRecord {
        backed_up_unix_ms: home::now_ms(),
        to: out.display().to_string(),
        key_fingerprint: diagnosis::key_fingerprint(&key),
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
