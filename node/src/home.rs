//! The node's home directory: what lives where, and creating, provisioning
//! and loading it.
//!
//! ```text
//! HOME/
//!   device.key     0600  this device's Ed25519 seed (its libp2p identity)
//!   master.key     0600  the agent's master key (only on the device that ran `init`)
//!   sync.key       0600  the agent's sync keys, one per key epoch (a key ring)
//!   epoch-grant    0600  the signed grant that opened the current epoch (forwarded to peers)
//!   at-rest.key    0600  this device's key for encrypting the store
//!   did-log.json   0600  the agent's DID document as a signed, hash-chained log
//!   device.json    0600  this device's context id and name
//!   store/               sled database; every key and value encrypted
//!   api.json       0600  while the daemon runs: local API address and bearer token
//!   api.sock       0600  while the daemon runs (unix): the local API as a Unix socket, no token
//!   master-key-backup.json 0600  when and where `master-key backup` copied master.key
//! ```

use std::fs;
use std::io::Write;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use nuwa_agent::crypto::epoch::KeyRing;
use nuwa_agent::crypto::{AtRestKey, SyncKey};
use nuwa_agent::identity::chain::DidChain;
use nuwa_agent::identity::keys::{DeviceKey, context_id_for};
use serde::{Deserialize, Serialize};

pub const DEVICE_KEY: &str = "device.key";
pub const MASTER_KEY: &str = "master.key";
pub const SYNC_KEY: &str = "sync.key";
pub const EPOCH_GRANT: &str = "epoch-grant";
pub const AT_REST_KEY: &str = "at-rest.key";
pub const DID_LOG: &str = "did-log.json";
pub const DEVICE_INFO: &str = "device.json";
pub const STORE_DIR: &str = "store";
pub const API_FILE: &str = "api.json";
/// The local API's Unix socket (NIP-6 IPC discovery: apps find the daemon
/// by this name in its home).
pub const API_SOCKET: &str = "api.sock";
pub const LOCK_FILE: &str = "daemon.lock";
/// A rotated device key waiting to replace `device.key` (see `rotate_device`).
pub const NEXT_DEVICE_KEY: &str = "device.key.next";

/// The master key of `init`, if this home holds it.
pub fn read_master(dir: &Path) -> Result<Option<DeviceKey>> {
    let path = dir.join(MASTER_KEY);
    match fs::read(&path) {
        Ok(bytes) => DeviceKey::from_seed_file_bytes(&bytes)
            .map(Some)
            .with_context(|| format!("cannot read {}", path.display())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e).with_context(|| format!("cannot read {}", path.display())),
    }
}

/// This home's admin key (see [`nuwa_agent::lifecycle::admin_of`]): the
/// master key if `HOME/master.key` is still listed, else the device key if
/// an admin promoted it.
pub fn load_admin(
    dir: &Path,
    log: &DidChain,
    device: &DeviceKey,
    now_secs: i64,
) -> Result<nuwa_agent::lifecycle::Admin> {
    let master = read_master(dir)?;
    Ok(nuwa_agent::lifecycle::admin_of(
        log,
        device,
        master.as_ref(),
        now_secs,
    )?)
}

/// A DID change made on the home's files because no daemon runs (`lock`
/// is the home's, held until the change is written): `change` gets the
/// home, its admin key and the time, and writes what it changed. Peers
/// learn it when the daemon next starts.
pub fn change_offline<T>(
    dir: &Path,
    lock: HomeLock,
    change: impl FnOnce(&Home, &nuwa_agent::lifecycle::Admin, i64) -> Result<T>,
) -> Result<T> {
    let h = load(dir)?;
    let now = now_unix_secs();
    let admin = load_admin(dir, &h.log, &h.device, now)?;
    let out = change(&h, &admin, now)?;
    drop(lock);
    eprintln!("no daemon is running: changed in the home; peers learn it when it next runs");
    Ok(out)
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct DeviceInfo {
    pub context_id: String,
    pub name: String,
}

/// Everything the daemon needs from the home directory.
pub struct Home {
    pub dir: PathBuf,
    pub device: DeviceKey,
    pub info: DeviceInfo,
    pub keys: KeyRing,
    /// The encoded grant of the current epoch (None at epoch 0).
    pub grant: Option<Vec<u8>>,
    pub at_rest: AtRestKey,
    pub log: DidChain,
}

/// The default home: the platform's data directory.
pub fn default_home() -> Result<PathBuf> {
    let dirs = directories::ProjectDirs::from("org", "nuwa", "nuwa-node").context(
        "cannot determine the platform data directory; pass --home DIR or set NUWA_HOME",
    )?;
    Ok(dirs.data_dir().to_path_buf())
}

pub fn now_unix_secs() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0)
}

pub fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// Writes `bytes` to `path` with mode 0600, atomically (temp file + rename)
/// and durably (fsync of file and directory).
pub fn write_private(path: &Path, bytes: &[u8]) -> Result<()> {
    let dir = path.parent().context("path has no parent directory")?;
    let tmp = path.with_extension("tmp");
    {
        let mut f = fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&tmp)
            .with_context(|| format!("cannot write {}", tmp.display()))?;
        f.set_permissions(fs::Permissions::from_mode(0o600))?;
        f.write_all(bytes)?;
        f.sync_all()?;
    }
    fs::rename(&tmp, path).with_context(|| format!("cannot write {}", path.display()))?;
    fs::File::open(dir)?.sync_all()?;
    Ok(())
}

fn read(path: &Path) -> Result<Vec<u8>> {
    fs::read(path).with_context(|| format!("cannot read {}", path.display()))
}

pub fn create_dir_private(dir: &Path) -> Result<()> {
    fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    fs::set_permissions(dir, fs::Permissions::from_mode(0o700))?;
    Ok(())
}

pub fn ensure_empty(dir: &Path) -> Result<()> {
    if dir.join(DEVICE_KEY).exists() || dir.join(DID_LOG).exists() {
        bail!(
            "{} already holds a nuwa-node home; choose another directory or remove it first",
            dir.display()
        );
    }
    Ok(())
}

fn write_log(dir: &Path, log: &DidChain) -> Result<()> {
    write_private(&dir.join(DID_LOG), &serde_json::to_vec_pretty(log)?)
}

/// Persists the key ring (after a new epoch).
pub fn save_keys(dir: &Path, keys: &KeyRing) -> Result<()> {
    write_private(&dir.join(SYNC_KEY), &keys.to_file_bytes())
}

/// Persists the grant of the current epoch.
pub fn save_grant(dir: &Path, grant: &[u8]) -> Result<()> {
    write_private(&dir.join(EPOCH_GRANT), grant)
}

/// Persists a new key epoch: the key ring and its grant first, then the DID
/// log that made it (a crash in between leaves a key the log does not use
/// yet, never a log without its key).
pub fn save_epoch(dir: &Path, log: &DidChain, keys: &KeyRing, grant: &[u8]) -> Result<()> {
    save_keys(dir, keys)?;
    save_grant(dir, grant)?;
    write_log(dir, log)
}

/// The DID log as last persisted in the home (unverified: it was checked
/// when it was written).
pub fn read_log(dir: &Path) -> Result<DidChain> {
    let path = dir.join(DID_LOG);
    let bytes = fs::read(&path).with_context(|| format!("cannot read {}", path.display()))?;
    DidChain::from_stored_json(&bytes)
        .map(|(log, _)| log)
        .with_context(|| format!("cannot parse {}", path.display()))
}

/// Persists a newer DID log learned from a peer.
pub fn save_log(dir: &Path, log: &DidChain) -> Result<()> {
    write_log(dir, log)
}

fn write_device(dir: &Path, device: &DeviceKey, name: &str, keys: &KeyRing) -> Result<DeviceInfo> {
    let info = DeviceInfo {
        context_id: context_id_for(&device.public()),
        name: name.to_owned(),
    };
    save_keys(dir, keys)?;
    let at_rest = AtRestKey::generate().context("cannot generate the at-rest key")?;
    write_private(&dir.join(AT_REST_KEY), &at_rest.to_file_bytes())?;
    write_private(&dir.join(DEVICE_INFO), &serde_json::to_vec_pretty(&info)?)?;
    // Last: a home counts as one once its device key exists.
    write_private(&dir.join(DEVICE_KEY), &device.to_seed_file_bytes())?;
    Ok(info)
}

fn add_device(
    log: &mut DidChain,
    admin: &nuwa_agent::lifecycle::Admin,
    device: &DeviceKey,
    expires: Option<String>,
) -> Result<String> {
    // The device's X25519 key (the Montgomery form of its Ed25519 key) goes
    // under `keyAgreement`: new sync-key epochs are sealed to it.
    let x25519 = nuwa_agent::identity::did_key::x25519_public_from_ed25519(&device.public())
        .context("cannot derive the device's key-agreement key")?;
    let (keys, now) = ((&device.public(), &x25519), now_unix_secs());
    Ok(nuwa_agent::lifecycle::add_device_until(
        log, admin, keys, expires, now,
    )?)
}

/// `init`: a new agent with this device as its first device, and
/// `recovery_public` (the key of the recovery words) as its recovery key.
pub fn init(dir: &Path, name: &str, recovery_public: &[u8; 32]) -> Result<Home> {
    create_dir_private(dir)?;
    let _lock = lock(dir)?;
    ensure_empty(dir)?;
    let master = DeviceKey::generate().context("cannot generate the master key")?;
    let device = DeviceKey::generate().context("cannot generate the device key")?;
    let keys = KeyRing::new(SyncKey::generate(0).context("cannot generate the sync key")?);
    let mut log = DidChain::genesis(&master, now_unix_secs()).context("cannot create the DID")?;
    nuwa_agent::lifecycle::first_update(
        &mut log,
        &master,
        &device,
        recovery_public,
        now_unix_secs(),
    )?;
    write_private(&dir.join(MASTER_KEY), &master.to_seed_file_bytes())?;
    write_log(dir, &log)?;
    write_device(dir, &device, name, &keys)?;
    crate::config::write_default(dir)?;
    load(dir)
}

/// `device provision` with no daemon running: a new device home in `out`,
/// created offline from a home that holds the master key. Holds both
/// homes' locks while it writes. (With a daemon running, the daemon does
/// it: see `daemon::provision`.)
pub fn provision(dir: &Path, out: &Path, name: &str, exp: Option<String>) -> Result<DeviceInfo> {
    let _lock = lock(dir)?;
    let home = load(dir)?;
    let admin = crate::home::load_admin(dir, &home.log, &home.device, now_unix_secs())?;
    let (_out_lock, device) = prepare_new_home(out)?;
    let mut log = home.log.clone();
    add_device(&mut log, &admin, &device, exp)?;
    drop(admin);
    // The provisioning home learns the new device at once; other devices
    // learn it from the newer log in the new device's Hello.
    write_log(dir, &log)?;
    write_new_home(out, &device, name, &log, &home.keys, home.grant.as_deref())
}

/// Creates `out` (0700), checks it holds no home, locks it, and makes the
/// new device's key.
pub fn prepare_new_home(out: &Path) -> Result<(HomeLock, DeviceKey)> {
    create_dir_private(out)?;
    let lock = lock(out)?;
    ensure_empty(out)?;
    let device = DeviceKey::generate().context("cannot generate the device key")?;
    Ok((lock, device))
}

/// Writes a provisioned device's home: the DID log that lists it, the sync
/// keys, the current epoch's grant and a default config.
pub fn write_new_home(
    out: &Path,
    device: &DeviceKey,
    name: &str,
    log: &DidChain,
    keys: &KeyRing,
    grant: Option<&[u8]>,
) -> Result<DeviceInfo> {
    write_log(out, log)?;
    if let Some(g) = grant {
        save_grant(out, g)?;
    }
    crate::config::write_default(out)?;
    write_device(out, device, name, keys)
}

/// An exclusive lock on a home: the daemon holds it for its whole life, and
/// `init`, `device provision`, `device revoke` and `pair` hold it while
/// they change the home's files. (An advisory `flock` on `daemon.lock`; it
/// is released when the process ends, however it ends.)
pub struct HomeLock(#[allow(dead_code)] fs::File);

/// Takes the home's lock, or says that a daemon (or another command)
/// holds it.
pub fn lock(dir: &Path) -> Result<HomeLock> {
    try_lock(dir)?.ok_or_else(|| {
        anyhow::anyhow!(
            "another nuwa-node daemon is already running with home {} (or a command is \
             changing its files); stop it first or use another --home",
            dir.display()
        )
    })
}

/// Takes the home's lock if no other process holds it.
pub fn try_lock(dir: &Path) -> Result<Option<HomeLock>> {
    let path = dir.join(LOCK_FILE);
    let f = fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .mode(0o600)
        .open(&path)
        .with_context(|| format!("cannot open {}", path.display()))?;
    match f.try_lock() {
        Ok(()) => Ok(Some(HomeLock(f))),
        Err(fs::TryLockError::WouldBlock) => Ok(None),
        Err(fs::TryLockError::Error(e)) => {
            Err(e).with_context(|| format!("cannot lock {}", path.display()))
        }
    }
}

/// `pair`: the home of a device that was just paired. The device key is
/// written last, so a crash midway leaves no home that looks complete.
pub fn write_paired(
    dir: &Path,
    device: &DeviceKey,
    name: &str,
    keys: &KeyRing,
    grant: Option<&[u8]>,
    log: &DidChain,
) -> Result<DeviceInfo> {
    write_log(dir, log)?;
    if let Some(g) = grant {
        save_grant(dir, g)?;
    }
    crate::config::write_default(dir)?;
    write_device(dir, device, name, keys)
}

/// Refuses a home directory that other users can read, write or enter:
/// everything below it relies on it being private.
pub fn check_private(dir: &Path) -> Result<()> {
    let meta = fs::metadata(dir).with_context(|| format!("cannot read {}", dir.display()))?;
    let mode = meta.permissions().mode() & 0o777;
    if mode & 0o077 != 0 {
        bail!(
            "home {} is open to other users (mode {mode:03o}); it holds this device's keys. Make \
             it private with `chmod -R go-rwx {}` and start again",
            dir.display(),
            dir.display()
        );
    }
    Ok(())
}

/// `device rotate`'s files. The new key is written aside first, then the
/// log, keys and grant that list it, then it replaces `device.key`: a crash
/// before that last step is finished by the next [`load`], which takes the
/// key aside when the log lists it and not the old one.
pub fn rotate_device(
    dir: &Path,
    new: &DeviceKey,
    name: &str,
    log: &DidChain,
    keys: &KeyRing,
    grant: &[u8],
) -> Result<DeviceInfo> {
    write_private(&dir.join(NEXT_DEVICE_KEY), &new.to_seed_file_bytes())?;
    save_epoch(dir, log, keys, grant)?;
    finish_rotation(dir)?;
    let info = DeviceInfo {
        context_id: context_id_for(&new.public()),
        name: name.to_owned(),
    };
    write_private(&dir.join(DEVICE_INFO), &serde_json::to_vec_pretty(&info)?)?;
    Ok(info)
}

/// `device rename`: this device's new name in `device.json` (the daemon
/// reads it at start and sends it in every Hello).
pub fn rename(dir: &Path, info: &DeviceInfo, name: &str) -> Result<()> {
    let info = DeviceInfo {
        name: name.to_owned(),
        ..info.clone()
    };
    write_private(&dir.join(DEVICE_INFO), &serde_json::to_vec_pretty(&info)?)
}

/// Completes an interrupted rotation: moves `device.key.next` over
/// `device.key` if the home's log lists the next key's context id (and
/// drops it otherwise, since the update never became durable).
fn finish_rotation(dir: &Path) -> Result<()> {
    let next = dir.join(NEXT_DEVICE_KEY);
    let Ok(bytes) = fs::read(&next) else {
        return Ok(());
    };
    let key = DeviceKey::from_seed_file_bytes(&bytes)
        .with_context(|| format!("cannot read {}", next.display()))?;
    let log = read_log(dir)?;
    let ctx = context_id_for(&key.public());
    if nuwa_agent::lifecycle::lists(&log, &key.public()) {
        fs::rename(&next, dir.join(DEVICE_KEY))
            .with_context(|| format!("cannot move {} into place", next.display()))?;
        let info_path = dir.join(DEVICE_INFO);
        if let Ok(mut info) = fs::read(&info_path)
            .map_err(anyhow::Error::from)
            .and_then(|b| Ok(serde_json::from_slice::<DeviceInfo>(&b)?))
        {
            if info.context_id != ctx {
                info.context_id = ctx;
                write_private(&info_path, &serde_json::to_vec_pretty(&info)?)?;
            }
        }
    } else {
        fs::remove_file(&next).with_context(|| format!("cannot remove {}", next.display()))?;
    }
    Ok(())
}

/// Loads an existing home.
pub fn load(dir: &Path) -> Result<Home> {
    finish_rotation(dir)?;
    if !dir.join(DEVICE_KEY).exists() {
        bail!(
            "{} is not a nuwa-node home (no {DEVICE_KEY}); create one with `nuwa-node --home {} init`",
            dir.display(),
            dir.display()
        );
    }
    check_private(dir)?;
    for name in [DEVICE_KEY, SYNC_KEY, AT_REST_KEY, MASTER_KEY] {
        let p = dir.join(name);
        if let Ok(meta) = fs::metadata(&p) {
            if meta.permissions().mode() & 0o077 != 0 {
                bail!(
                    "{} is readable by other users; run `chmod 600 {}`",
                    p.display(),
                    p.display()
                );
            }
        }
    }
    let device = DeviceKey::from_seed_file_bytes(&read(&dir.join(DEVICE_KEY))?)
        .with_context(|| format!("cannot read {}", dir.join(DEVICE_KEY).display()))?;
    let keys = read_keys(&dir.join(SYNC_KEY))?;
    let grant = match fs::read(dir.join(EPOCH_GRANT)) {
        Ok(g) => Some(g),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
        Err(e) => {
            return Err(e)
                .with_context(|| format!("cannot read {}", dir.join(EPOCH_GRANT).display()));
        }
    };
    let at_rest = AtRestKey::from_file_bytes(&read(&dir.join(AT_REST_KEY))?)
        .with_context(|| format!("cannot read {}", dir.join(AT_REST_KEY).display()))?;
    let (log, migrated) = DidChain::from_stored_json(&read(&dir.join(DID_LOG))?)
        .with_context(|| format!("cannot parse {}", dir.join(DID_LOG).display()))?;
    let log = nuwa_agent::lifecycle::resolve_stored(log, now_unix_secs())
        .with_context(|| format!("{}", dir.join(DID_LOG).display()))?;
    if migrated {
        // Once, on the first start after the upgrade: same entries, same
        // hashes, new file form; new updates are v2 entries from now on.
        write_log(dir, &log)?;
        tracing::info!(
            entries = log.len(),
            "converted {} to the DID chain format",
            dir.join(DID_LOG).display()
        );
    }
    let info: DeviceInfo = match fs::read(dir.join(DEVICE_INFO)) {
        Ok(bytes) => serde_json::from_slice(&bytes)
            .with_context(|| format!("cannot parse {}", dir.join(DEVICE_INFO).display()))?,
        Err(_) => DeviceInfo {
            context_id: context_id_for(&device.public()),
            name: String::new(),
        },
    };
    Ok(Home {
        dir: dir.to_path_buf(),
        device,
        info,
        keys,
        grant,
        at_rest,
        log,
    })
}

/// Reads the key ring; a home written before key epochs existed holds a
/// single sync key, which becomes a ring of one.
fn read_keys(path: &Path) -> Result<KeyRing> {
    let bytes = zeroize::Zeroizing::new(read(path)?);
    match KeyRing::from_file_bytes(&bytes) {
        Ok(ring) => Ok(ring),
        Err(ring_err) => match SyncKey::from_file_bytes(&bytes) {
            Ok(key) => Ok(KeyRing::new(key)),
            Err(_) => Err(ring_err).with_context(|| format!("cannot read {}", path.display())),
        },
    }
}
