//! The local API on a Unix domain socket, `HOME/api.sock`: NIP-6's
//! inter-process discovery. An app on this device finds the daemon by that
//! path and talks to it with no token; the file system and the peer's uid
//! keep everyone else out.
//!
//! - **Private from the start.** The socket is bound under a temporary name
//!   in the home (itself 0700), set to mode 0600, then renamed to
//!   `api.sock`, so the path never names a socket any wider.
//! - **Stale sockets.** A socket file left by a daemon that died is
//!   replaced: nothing answers on it, and the home lock (`home::lock`)
//!   already says no other daemon runs on this home. A socket something
//!   answers on, or a path that is not a socket, is left alone, and the
//!   local socket stays off (TCP still serves everything).
//! - **Who may connect.** Every accepted connection's peer uid
//!   (`SO_PEERCRED`, `getpeereid` on BSDs) must be the daemon's effective
//!   uid; anyone else's connection is closed, counted
//!   (`api_socket_refused`) and logged at most once per uid per minute.
//! - **What it serves.** The same router as TCP, under the same connection
//!   guard ([`super::listener`]); its requests carry
//!   [`super::listener::LocalSocket`], which the token layer accepts.
//! - **Clean exit.** [`SocketFile`] removes the file when dropped, if the
//!   path still names the socket bound here.
//!
//! Unix only: on Windows a named pipe would play this part, and is not
//! built.

use std::collections::BTreeMap;
use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use tokio::net::{UnixListener, UnixStream};
use tracing::{debug, warn};

use super::listener::Accept;
use crate::metrics::{Event, Metrics};

/// A refused uid is logged at most this often.
const REFUSAL_LOG_EVERY: Duration = Duration::from_secs(60);
/// Uids whose refusals are remembered for the log's rate limit; past it,
/// a new uid's refusal is counted but not logged until old entries expire.
const REFUSAL_LOG_UIDS_MAX: usize = 64;
/// How long the check for a live daemon on an old socket may take.
const STALE_PROBE_TIMEOUT: Duration = Duration::from_secs(2);

/// Why the local socket could not be set up.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SocketError {
    #[error(
        "{path} exists and is not a socket; move it away and restart the daemon to serve the \
         local socket"
    )]
    NotASocket { path: PathBuf },
    #[error(
        "a process answers on {path} although this daemon holds the home's lock; stop it (or \
         remove the file) and restart the daemon to serve the local socket"
    )]
    InUse { path: PathBuf },
    #[error("cannot check the old socket {path}: {source}")]
    Probe {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "cannot create the socket {path}: {source} (a Unix socket path is limited to about 100 \
         bytes; a shorter --home helps if this one is long)"
    )]
    Bind {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// The socket file, removed when dropped if the path still names the
/// socket bound here (so a later daemon's socket is never removed).
#[derive(Debug)]
pub struct SocketFile {
    path: PathBuf,
    dev_ino: (u64, u64),
}

impl SocketFile {
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for SocketFile {
    fn drop(&mut self) {
        let ours =
            std::fs::symlink_metadata(&self.path).is_ok_and(|m| (m.dev(), m.ino()) == self.dev_ino);
        if ours {
            if let Err(e) = std::fs::remove_file(&self.path) {
                debug!(error = %e, path = %self.path.display(), "cannot remove the API socket");
            }
        }
    }
}

/// Binds the socket at `path` (see the module's notes).
pub(super) async fn bind(path: &Path) -> Result<(UnixListener, SocketFile), SocketError> {
    match std::fs::symlink_metadata(path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => {
            return Err(SocketError::Probe {
                path: path.to_path_buf(),
                source: e,
            });
        }
        Ok(m) if !m.file_type().is_socket() => {
            return Err(SocketError::NotASocket {
                path: path.to_path_buf(),
            });
        }
        Ok(_) => {
            let probe = tokio::time::timeout(STALE_PROBE_TIMEOUT, UnixStream::connect(path)).await;
            match probe {
                Ok(Err(e))
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::ConnectionRefused | std::io::ErrorKind::NotFound
                    ) =>
                {
                    // Bound by a daemon that is gone: replaced below.
                    debug!(path = %path.display(), "replacing a stale API socket");
                }
                Ok(Err(e)) => {
                    return Err(SocketError::Probe {
                        path: path.to_path_buf(),
                        source: e,
                    });
                }
                // Connected, or a listener too busy to answer: alive.
                Ok(Ok(_)) | Err(_) => {
                    return Err(SocketError::InUse {
                        path: path.to_path_buf(),
                    });
                }
            }
        }
    }
    let bind_err = |source| SocketError::Bind {
        path: path.to_path_buf(),
        source,
    };
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".new");
    let tmp = PathBuf::from(tmp);
    match std::fs::remove_file(&tmp) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(bind_err(e)),
        _ => {}
    }
    let listener = UnixListener::bind(&tmp).map_err(bind_err)?;
    let placed = std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o600))
        .and_then(|()| std::fs::rename(&tmp, path))
        .and_then(|()| std::fs::symlink_metadata(path));
    match placed {
        Ok(m) => Ok((
            listener,
            SocketFile {
                path: path.to_path_buf(),
                dev_ino: (m.dev(), m.ino()),
            },
        )),
        Err(e) => {
            let _ = std::fs::remove_file(&tmp);
            Err(bind_err(e))
        }
    }
}

/// The daemon's effective uid.
pub(super) fn own_uid() -> u32 {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() }
}

/// The local socket as the connection guard's [`Accept`]: admits only the
/// daemon's own uid.
pub(super) struct UnixAccept {
    listener: UnixListener,
    uid: u32,
    /// Per refused uid (None: the peer's credentials could not be read):
    /// when it was last logged, and refusals since then.
    logged: BTreeMap<Option<u32>, (Instant, u64)>,
}

impl UnixAccept {
    pub(super) fn new(listener: UnixListener) -> Self {
        UnixAccept {
            listener,
            uid: own_uid(),
            logged: BTreeMap::new(),
        }
    }

    fn refuse(&mut self, uid: Option<u32>, metrics: &Metrics) {
        metrics.inc(Event::ApiSocketRefused);
        let now = Instant::now();
        if !self.logged.contains_key(&uid) && self.logged.len() >= REFUSAL_LOG_UIDS_MAX {
            self.logged
                .retain(|_, (at, _)| now.duration_since(*at) < REFUSAL_LOG_EVERY);
            if self.logged.len() >= REFUSAL_LOG_UIDS_MAX {
                return;
            }
        }
        let (at, suppressed) = self.logged.entry(uid).or_insert((now, 0));
        if *at != now && now.duration_since(*at) < REFUSAL_LOG_EVERY {
            *suppressed += 1;
            return;
        }
        let also = std::mem::take(suppressed);
        *at = now;
        match uid {
            Some(uid) => warn!(
                uid,
                daemon_uid = self.uid,
                refused_since_last_log = also,
                "refused a connection on the local API socket from another user; only the \
                 daemon's own user may use it (logged once a minute per uid)"
            ),
            None => warn!(
                refused_since_last_log = also,
                "refused a connection on the local API socket whose peer's user could not be \
                 read (logged once a minute)"
            ),
        }
    }
}

impl Accept for UnixAccept {
    type Io = UnixStream;
    const LOCAL_SOCKET: bool = true;

    async fn accept(&mut self, metrics: &Metrics) -> std::io::Result<Option<UnixStream>> {
        let (stream, _) = self.listener.accept().await?;
        match stream.peer_cred() {
            Ok(cred) if cred.uid() == self.uid => {
                metrics.inc(Event::ApiSocketConnections);
                Ok(Some(stream))
            }
            Ok(cred) => {
                self.refuse(Some(cred.uid()), metrics);
                Ok(None)
            }
            Err(e) => {
                debug!(error = %e, "cannot read the peer credentials of an API socket connection");
                self.refuse(None, metrics);
                Ok(None)
            }
        }
    }
}
