//! `doctor`'s verdicts over the home itself: who may read it (modes and
//! owners), the master key and its recorded backup, the agent's way back
//! (recovery key, admins), the size of the DHT pointer, and how many other
//! devices there are to sync with.
//!
//! The shell reads the files, their modes and owners; these functions take
//! what it found and judge it. They hold the home's file names only as the
//! shell hands them in.

use serde::{Deserialize, Serialize};

use super::Check;
use crate::identity::chain::DidChain;
use crate::identity::keys::DeviceKey;
use crate::lifecycle::{admin_of, is_recovery_key, recovery_keys};

/// The name of the home check.
const HOME_CHECK: &str = "home";

/// A file's permission bits (as `stat` gives them; only the low nine
/// count) and its owner.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Mode {
    pub mode: u32,
    pub uid: u32,
}

/// One of the home's key files or records that exists.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HomeFile {
    /// Its name in the home (`device.key`).
    pub name: &'static str,
    /// Its path, as the fix names it.
    pub path: String,
    pub mode: Mode,
}

/// What the shell found where the home should be.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HomeFound {
    Missing,
    /// It cannot be looked at (the error says why).
    Unreadable(String),
    NotADirectory,
    /// A directory without the named device key file.
    NotAHome {
        device_key: &'static str,
    },
    /// An initialised home, with the modes and owners that decide who may
    /// read it.
    Present {
        /// The user running `doctor`.
        me: u32,
        dir: Mode,
        /// The key files and records that exist, in the order to report.
        files: Vec<HomeFile>,
        /// The store directory, when it exists: its name, path and mode.
        store: Option<(&'static str, String, u32)>,
    },
}

/// Whether the home at `h` (its display form) is initialised and private
/// to its owner: the home holds this device's keys.
pub fn check_home(h: &str, found: HomeFound) -> Check {
    let (me, dir, files, store) = match found {
        HomeFound::Missing => {
            return Check::fail(
                HOME_CHECK,
                format!("{h} does not exist"),
                format!(
                    "create a new agent with `nuwa-node --home {h} init`, or join an existing \
                     one with `nuwa-node --home {h} pair`; or point --home (or NUWA_HOME) at \
                     the right directory"
                ),
            );
        }
        HomeFound::Unreadable(e) => {
            return Check::fail(
                HOME_CHECK,
                format!("cannot read {h}: {e}"),
                "run doctor as the user who owns the home",
            );
        }
        HomeFound::NotADirectory => {
            return Check::fail(
                HOME_CHECK,
                format!("{h} is not a directory"),
                "point --home (or NUWA_HOME) at the home directory",
            );
        }
        HomeFound::NotAHome { device_key } => {
            return Check::fail(
                HOME_CHECK,
                format!("{h} is not a nuwa-node home (no {device_key})"),
                format!(
                    "create a new agent with `nuwa-node --home {h} init`, or join an existing one \
                     with `nuwa-node --home {h} pair`"
                ),
            );
        }
        HomeFound::Present {
            me,
            dir,
            files,
            store,
        } => (me, dir, files, store),
    };
    let access = HomeAccess::audit(h, me, dir, &files, store);
    if access.problems.is_empty() {
        return Check::pass(
            HOME_CHECK,
            format!("{h} is initialised; directory 700, key files 600, all owned by you"),
        );
    }
    access.into_check(h)
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
    /// Looks at the home directory, its key files and its store.
    fn audit(
        h: &str,
        me: u32,
        dir: Mode,
        files: &[HomeFile],
        store: Option<(&'static str, String, u32)>,
    ) -> HomeAccess {
        let mut access = HomeAccess {
            problems: Vec::new(),
            chmod: Vec::new(),
            foreign: false,
        };
        let dir_mode = dir.mode & 0o777;
        if dir_mode & 0o077 != 0 || dir_mode & 0o700 != 0o700 {
            access
                .problems
                .push(format!("directory mode {dir_mode:03o} (want 700)"));
            access.chmod.push(format!("chmod 700 {h}"));
        }
        if dir.uid != me {
            access
                .problems
                .push(format!("directory owned by uid {} (you are {me})", dir.uid));
            access.foreign = true;
        }
        let loose_files = access.audit_files(files, me);
        if let Some((name, path, mode)) = store
            && mode & 0o077 != 0
        {
            access
                .problems
                .push(format!("{name} mode {:03o} (want 700)", mode & 0o777));
            access.chmod.push(format!("chmod -R go-rwx {path}"));
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
    fn audit_files(&mut self, files: &[HomeFile], me: u32) -> Vec<String> {
        let mut loose_files = Vec::new();
        for f in files {
            let mode = f.mode.mode & 0o777;
            if mode & 0o077 != 0 {
                self.problems
                    .push(format!("{} mode {mode:03o} (want 600)", f.name));
                loose_files.push(f.path.clone());
            }
            if f.mode.uid != me {
                self.problems.push(format!(
                    "{} owned by uid {} (you are {me})",
                    f.name, f.mode.uid
                ));
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

/// The agent's way back when every admin device is lost: a recovery key
/// in the DID document (agents created before recovery words had none),
/// and a second admin device so that one loss needs no words at all.
/// `identity` is this device's key and the home's DID log, when they could
/// be read; `holds_master_key` whether the home holds the master key.
pub fn check_recovery(
    h: &str,
    identity: Option<(&DeviceKey, &DidChain)>,
    holds_master_key: bool,
    now_secs: i64,
) -> Check {
    const NAME: &str = "recovery";
    let Some((device, log)) = identity else {
        return Check::skip(
            NAME,
            "the home's DID log cannot be read (see the home check)",
        );
    };
    let doc = log.current();
    let admins = doc
        .capability_delegation
        .iter()
        .filter(|id| !is_recovery_key(id))
        .count();
    if recovery_keys(doc).is_empty() {
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
    let me_admin = is_admin(Some((device, log)), now_secs);
    if admins <= 1 {
        return Check::warn(
            NAME,
            format!(
                "recovery words are set, and {} the only admin key: losing it means recovering \
                 with the words",
                if me_admin || holds_master_key {
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

/// Whether this device's own key (`identity`: its key and the DID log,
/// when they could be read) is an admin key of the agent.
pub fn is_admin(identity: Option<(&DeviceKey, &DidChain)>, now_secs: i64) -> bool {
    identity.is_some_and(|(device, log)| admin_of(log, device, None, now_secs).is_ok())
}

/// Other active devices of the agent by `log`, seen from `device`: the
/// devices there are to sync with.
pub fn other_active_devices(log: &DidChain, device: &DeviceKey, now_ms: u64) -> usize {
    let me = crate::identity::keys::context_id_for(&device.public());
    let list = crate::devices::list(log, &crate::devices::Seen::default(), &me, now_ms);
    list.iter()
        .filter(|d| {
            !d.this_device
                && d.status == "active"
                && d.relationships.iter().any(|r| r == "authentication")
        })
        .count()
}

/// The size of the pointer the daemon publishes in the DHT: the proof of
/// this agent's DID document signed by this device (`AgentPointer`, built
/// as the agent's discovery publishes it). A pointer too large to publish
/// still has its size; the error says what else went wrong.
pub fn pointer_bytes(device: &DeviceKey, log: &DidChain, now_secs: i64) -> Result<usize, String> {
    use crate::sync::pointer::{AgentPointer, PointerError};
    let context_id = crate::identity::keys::context_id_for(&device.public());
    let peer_id = crate::identity::peer::id_of(&device.public())
        .ok_or_else(|| "cannot derive the peer id".to_owned())?;
    let pointer =
        AgentPointer::new_signed(log, &context_id, &peer_id.to_string(), device, now_secs)
            .map_err(|e| format!("cannot build the pointer: {e}"))?;
    match pointer.encode() {
        Ok(bytes) => Ok(bytes.len()),
        Err(PointerError::TooLarge { len, .. }) => Ok(len),
        Err(e) => Err(format!("cannot encode the pointer: {e}")),
    }
}

/// Whether the DHT pointer fits: `bytes` is its size ([`pointer_bytes`])
/// or why it cannot be sized; `dht_off` whether the settings switch the
/// DHT off.
pub fn check_dht_pointer(bytes: Result<usize, String>, dht_off: bool) -> Check {
    const NAME: &str = "dht-pointer";
    let limit = crate::sync::pointer::MAX_POINTER_BYTES;
    let bytes = match bytes {
        Ok(b) => b,
        Err(e) => {
            return Check::warn(
                NAME,
                format!("cannot size the DHT pointer: {e}"),
                "run the home check's fix first; a device that is no longer a member (see \
                 `nuwa-node device list`) publishes no pointer",
            );
        }
    };
    let pct = bytes as f64 * 100.0 / limit as f64;
    let off = if dht_off {
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

/// What `master-key backup` records in the home, so that `doctor` can stop
/// warning about the master key.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BackupRecord {
    pub backed_up_unix_ms: u64,
    /// Where the copy was written (it may have moved since).
    pub to: String,
    /// Names the key that was copied without revealing it, so that a
    /// record left from another key does not count ([`key_fingerprint`]).
    pub key_fingerprint: String,
}

/// A name for the master key's bytes that does not reveal them: the first
/// 8 bytes of a domain-separated SHA-256, in hex.
pub fn key_fingerprint(key: &[u8]) -> String {
    use sha2::{Digest as _, Sha256};
    let mut h = Sha256::new();
    h.update(b"nuwa-master-key-backup-v1:");
    h.update(key);
    hex::encode(&h.finalize()[..8])
}

/// What the shell found of the master key in the home.
pub enum MasterKeyFound<'a> {
    /// No master key file; `admin` is whether this device's own key is an
    /// admin key ([`is_admin`]).
    Absent { admin: bool },
    /// The file is there but cannot be read.
    Unreadable { path: String, error: String },
    /// The key's bytes, and the backup record if one parses.
    Present {
        key: &'a [u8],
        record: Option<BackupRecord>,
    },
}

/// Whether the master key, if this home holds one, has a copy off the
/// device. `h` is the home's display form.
pub fn check_master_key(h: &str, found: MasterKeyFound<'_>) -> Check {
    const NAME: &str = "master-key";
    let (key, record) = match found {
        // More than one key may be admin (promotion, recovery): say which this is.
        MasterKeyFound::Absent { admin } => {
            let said = if admin {
                "not on this device, and none is needed: this device's own key is an admin key \
                 (it approves, promotes and revokes devices)"
            } else {
                "not on this device, and this device is not an admin: approve and revoke \
                 devices on an admin device (`device list` shows which are admins)"
            };
            return Check::pass(NAME, said);
        }
        MasterKeyFound::Unreadable { path, error } => {
            return Check::fail(
                NAME,
                format!("cannot read {path}: {error}"),
                "run doctor as the user who owns the home; see the home check",
            );
        }
        MasterKeyFound::Present { key, record } => (key, record),
    };
    let fix = format!(
        "copy it somewhere safe off this device: `nuwa-node --home {h} master-key backup \
         --out /media/usb/nuwa-master.key` (then keep that copy offline). Without a copy, a \
         second admin device (`device promote`) or the recovery words, losing this device \
         means no device can ever be approved or revoked again"
    );
    match record {
        None => Check::warn(
            NAME,
            "present and never backed up: it is an admin key (it approves, promotes and \
             revokes devices)",
            fix,
        ),
        Some(r) if r.key_fingerprint != key_fingerprint(key) => Check::warn(
            NAME,
            format!(
                "present; the backup recorded ({} to {}) is of another key",
                crate::devices::format_unix_ms(r.backed_up_unix_ms),
                r.to
            ),
            fix,
        ),
        Some(r) => Check::pass(
            NAME,
            format!(
                "present, backed up on {} to {}",
                crate::devices::format_unix_ms(r.backed_up_unix_ms),
                r.to
            ),
        ),
    }
}

#[cfg(test)]
mod tests {
    //! The home's verdicts: who may read it, the agent's way back, the
    //! DHT pointer's size and the master key's backup record.
    use super::*;
    use crate::diagnosis::Level;

    fn key(n: u8) -> DeviceKey {
        DeviceKey::from_seed(&[n; 32])
    }

    /// A one-device agent: master key 1, device 3, recovery key 2 (unless
    /// `recovery` is false: then the genesis alone, with no device).
    fn agent(recovery: bool) -> DidChain {
        let mut log = DidChain::genesis(&key(1), 1_000).expect("genesis");
        if recovery {
            crate::lifecycle::first_update(&mut log, &key(1), &key(3), &key(2).public(), 1_000)
                .expect("first update");
        }
        log
    }

    fn present(dir: u32, files: &[(&'static str, u32, u32)], store: Option<u32>) -> HomeFound {
        HomeFound::Present {
            me: 1000,
            dir: Mode {
                mode: dir,
                uid: 1000,
            },
            files: files
                .iter()
                .map(|&(name, mode, uid)| HomeFile {
                    name,
                    path: format!("/h/{name}"),
                    mode: Mode { mode, uid },
                })
                .collect(),
            store: store.map(|m| ("store", "/h/store".to_owned(), m)),
        }
    }

    // Goal: the home check names every mode and owner that lets others in,
    // with the commands that fix them, and says what is missing otherwise.
    // Method: a table of what the shell found.
    #[test]
    fn home_verdicts() {
        let cases: Vec<(HomeFound, Level, &str, &str)> = vec![
            (
                HomeFound::Missing,
                Level::Fail,
                "/h does not exist",
                "--home /h init",
            ),
            (
                HomeFound::Unreadable("denied".into()),
                Level::Fail,
                "cannot read /h: denied",
                "as the user",
            ),
            (
                HomeFound::NotADirectory,
                Level::Fail,
                "/h is not a directory",
                "at the home directory",
            ),
            (
                HomeFound::NotAHome {
                    device_key: "device.key",
                },
                Level::Fail,
                "not a nuwa-node home (no device.key)",
                "--home /h pair",
            ),
            (
                present(0o40700, &[("device.key", 0o100600, 1000)], Some(0o40700)),
                Level::Pass,
                "/h is initialised; directory 700",
                "",
            ),
            (
                present(
                    0o40755,
                    &[("device.key", 0o100644, 1000), ("sync.key", 0o100600, 7)],
                    Some(0o40750),
                ),
                Level::Fail,
                "directory mode 755 (want 700); device.key mode 644 (want 600); sync.key owned by \
                 uid 7 (you are 1000); store mode 750 (want 700)",
                "make it private: chmod 700 /h && chmod -R go-rwx /h/store && chmod 600 \
                 /h/device.key\nrun nuwa-node as the user who owns the home, or give it to \
                 yourself: sudo chown -R $(id -un) /h",
            ),
        ];
        for (found, level, detail, fix) in cases {
            let c = check_home("/h", found);
            assert_eq!(c.status, level, "{c:?}");
            assert!(c.detail.contains(detail), "{c:?}");
            assert!(c.fix.as_deref().unwrap_or("").contains(fix), "{c:?}");
        }
    }

    // Goal: the recovery check warns without a recovery key and with one
    // admin key, saying whether this home holds it. Method: agents with
    // and without recovery words, with and without the master key here.
    #[test]
    fn recovery_verdicts() {
        let with = agent(true);
        let without = agent(false);
        let me = key(3);
        let skip = check_recovery("/h", None, false, 1_000);
        assert_eq!(skip.status, Level::Skip);
        let none = check_recovery("/h", Some((&me, &without)), false, 1_000);
        assert_eq!(none.status, Level::Warn);
        assert!(none.detail.contains("no recovery key"), "{none:?}");
        let here = check_recovery("/h", Some((&me, &with)), true, 1_000);
        assert!(here.detail.contains("this home holds the only"), "{here:?}");
        let elsewhere = check_recovery("/h", Some((&me, &with)), false, 1_000);
        assert!(
            elsewhere.detail.contains("one device holds"),
            "{elsewhere:?}"
        );
        assert!(!is_admin(Some((&me, &with)), 1_000));
        assert!(is_admin(Some((&key(1), &with)), 1_000));
        assert_eq!(other_active_devices(&with, &me, 1_000_000), 0);
    }

    // Goal: the pointer is sized as the agent publishes it, and judged
    // against the limit. Method: a real agent's pointer, then sizes around
    // three quarters of the limit and beyond it.
    #[test]
    fn dht_pointer_verdicts() {
        let bytes = pointer_bytes(&key(3), &agent(true), 1_000).expect("a pointer");
        let c = check_dht_pointer(Ok(bytes), false);
        assert_eq!(c.status, Level::Pass, "{c:?}");
        let limit = crate::sync::pointer::MAX_POINTER_BYTES;
        let cases = [
            (Ok(limit * 3 / 4), false, Level::Pass),
            (Ok(limit * 3 / 4 + 1), false, Level::Warn),
            (Ok(limit + 1), true, Level::Fail),
            (Err("cannot read device.key".to_owned()), false, Level::Warn),
        ];
        for (bytes, off, level) in cases {
            let c = check_dht_pointer(bytes, off);
            assert_eq!(c.status, level, "{c:?}");
            assert_eq!(c.detail.contains("the DHT is off here"), off, "{c:?}");
        }
    }

    // Goal: the fingerprint in a backup record does not drift (records on
    // disk name keys by it), and only a record of this key counts.
    // Method: a fixed key, its record, another key's record, none.
    #[test]
    fn master_key_backup_record() {
        let key: Vec<u8> = (0..32).collect();
        assert_eq!(key_fingerprint(&key), "b0f4634d173933fb");
        let record = |fp: &str| BackupRecord {
            backed_up_unix_ms: 0,
            to: "/media/usb/k".to_owned(),
            key_fingerprint: fp.to_owned(),
        };
        let found = |record| MasterKeyFound::Present { key: &key, record };
        let ok = check_master_key("/h", found(Some(record("b0f4634d173933fb"))));
        assert_eq!(ok.status, Level::Pass, "{ok:?}");
        assert!(ok.detail.contains("backed up on 1970-01-01"), "{ok:?}");
        let other = check_master_key("/h", found(Some(record("00"))));
        assert!(other.detail.contains("is of another key"), "{other:?}");
        assert_eq!(check_master_key("/h", found(None)).status, Level::Warn);
        let absent = check_master_key("/h", MasterKeyFound::Absent { admin: true });
        assert!(absent.detail.contains("none is needed"), "{absent:?}");
        let unreadable = MasterKeyFound::Unreadable {
            path: "/h/master.key".to_owned(),
            error: "denied".to_owned(),
        };
        assert_eq!(check_master_key("/h", unreadable).status, Level::Fail);
    }
}
