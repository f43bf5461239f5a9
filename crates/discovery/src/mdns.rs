//! The mDNS runtime: publish the TXT record we are given, browse for
//! everyone else's.
//!
//! [`Mdns`] is a handle to two threads: mdns-sd's own daemon thread, which owns
//! the sockets, and a small private event thread that turns mdns-sd's service
//! events into [`DiscoveryEvent`]s on a bounded channel. The event thread never
//! blocks on the caller: when the channel is full it drops the event and counts
//! it ([`Mdns::dropped_events`]); the periodic re-browse
//! ([`MdnsConfig::refresh_secs`]) re-reports every peer still present, which
//! heals such losses.
//!
//! This module does not know what a TXT record says: it checks only that ours
//! can be encoded as given (see [`MdnsConfig::txt`]) and bounds what it passes
//! on of others'. Parsing and verifying announcements (the format is
//! `nuwa_agent::announce`'s), checking that the SRV port is the announced
//! one, deciding which peers to dial and remembering peers across restarts
//! are the caller's.

use std::collections::BTreeSet;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use flume::{RecvError, Selector, TrySendError};
use mdns_sd::{DaemonEvent, IfKind, ResolvedService, ServiceDaemon, ServiceEvent, ServiceInfo};
use tracing::{debug, info, trace, warn};

use crate::SERVICE_TYPE;

/// Capacity of the [`DiscoveryEvent`] channel handed out by [`Mdns::start`].
pub const EVENT_CHANNEL_CAPACITY: usize = 256;
/// Most TXT entries we publish, and pass on of a record we see. Seven are
/// used today; the rest is room for the format to grow.
pub const MAX_TXT_ENTRIES: usize = 16;
/// Longest TXT entry, `key=value`, in bytes: DNS-SD prefixes each one with a
/// single length byte (RFC 6763 §6.1).
pub const MAX_TXT_ENTRY_LEN: usize = 255;

/// DNS label limit; the instance name is also the host label.
const MAX_INSTANCE_NAME_LEN: usize = 63;
/// How long shutdown waits for the daemon to confirm each step.
const DAEMON_REPLY_TIMEOUT: Duration = Duration::from_secs(2);
/// Retry delay when the daemon's command queue is momentarily full.
const BROWSE_RETRY_DELAY: Duration = Duration::from_secs(1);

/// How to publish and browse.
#[derive(Debug, Clone)]
pub struct MdnsConfig {
    /// DNS-SD instance label, at most 63 bytes of visible ASCII without `.`
    /// or `\`. Use the PeerId, so several daemons on one host never collide;
    /// the mDNS host name is derived from it too.
    pub instance_name: String,
    /// TCP port of the libp2p listener, published in our SRV record (not
    /// zero). A reader that also finds a port in the TXT record must check
    /// the two agree; this crate does not look.
    pub port: u16,
    /// Interface names to use (for example `["lo"]`, `["eth0", "wlan0"]`).
    /// Empty means every non-loopback interface. Loopback addresses of peers
    /// are reported only when a loopback interface is listed here.
    pub interfaces: Vec<String>,
    /// Our TXT record, published in this order: at most [`MAX_TXT_ENTRIES`]
    /// entries, each `key=value` at most [`MAX_TXT_ENTRY_LEN`] bytes, keys
    /// non-empty printable ASCII without `=` and distinct ignoring ASCII case
    /// (RFC 6763 §6.4). Anything else is refused by [`Mdns::start`], since
    /// peers would read back something other than what was given. Build it
    /// with `nuwa_agent::announce::Announcement::to_txt`.
    pub txt: Vec<(String, String)>,
    /// Every this many seconds, browse afresh: the query goes out again and
    /// every peer still present is reported again, healing dropped events.
    /// `0` disables it. Tens of seconds to a few minutes is sensible.
    pub refresh_secs: u64,
}

/// What the browser saw on the network.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DiscoveryEvent {
    /// Another instance of our service type, with its TXT record as it came:
    /// **nothing in it is parsed or verified** (that is
    /// `nuwa_agent::announce::Announcement::from_txt` and `verify`, and the
    /// check that the announced port is the port in `addrs`). Repeats as
    /// addresses accumulate, on every re-browse, and when the peer
    /// re-announces.
    Discovered {
        /// The DNS-SD instance label (by convention the announcer's PeerId).
        instance: String,
        /// The TXT entries in the order received, bounded: at most
        /// [`MAX_TXT_ENTRIES`], the first ones; entries over
        /// [`MAX_TXT_ENTRY_LEN`] bytes are skipped. mdns-sd keeps only the
        /// first of entries whose keys differ in ASCII case only; an entry
        /// without `=` has an empty value; bytes that are not UTF-8 become
        /// U+FFFD.
        txt: Vec<(String, String)>,
        /// Usable addresses with the SRV record's port (never zero):
        /// link-local addresses are dropped, loopback ones too unless a
        /// loopback interface is selected. Sorted, without duplicates, never
        /// empty.
        addrs: Vec<SocketAddr>,
    },
    /// A device said goodbye or its records expired.
    Expired {
        /// The DNS-SD instance label (by convention the announcer's PeerId).
        instance: String,
    },
}

/// Why mDNS could not be started, updated or stopped cleanly.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DiscoveryError {
    /// The configured instance name cannot be used as a DNS-SD label.
    #[error("invalid mdns instance name {name:?}: {reason}; use the device's PeerId")]
    InvalidInstanceName {
        /// The rejected name.
        name: String,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// The TXT record to publish breaks DNS-SD's rules or our bounds, so
    /// peers would not read back what was given.
    #[error(
        "txt record for mdns instance {instance:?} cannot be published: {reason}; \
         publish at most {MAX_TXT_ENTRIES} entries of at most {MAX_TXT_ENTRY_LEN} bytes \
         (`key=value`) with distinct printable-ascii keys"
    )]
    InvalidTxt {
        /// Our instance name.
        instance: String,
        /// Which entry is wrong and how.
        reason: String,
    },
    /// Port zero cannot be dialled, so it is never published.
    #[error(
        "mdns instance {instance:?} would publish tcp port 0; start the listener first and publish the port it got"
    )]
    ZeroPort {
        /// Our instance name.
        instance: String,
    },
    /// The mdns-sd daemon refused a command.
    #[error("mdns daemon failed to {action}")]
    Daemon {
        /// What we asked for.
        action: &'static str,
        /// The daemon's error.
        #[source]
        source: mdns_sd::Error,
    },
    /// The mdns-sd daemon did not answer in time.
    #[error("mdns daemon did not confirm {action} within {DAEMON_REPLY_TIMEOUT:?}")]
    Timeout {
        /// What we waited for.
        action: &'static str,
    },
    /// The event thread could not be started.
    #[error("failed to spawn the mdns event thread")]
    Spawn {
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
}

/// Handle to a running mDNS publisher and browser. Dropping it does what
/// [`Mdns::shutdown`] does, ignoring errors.
pub struct Mdns {
    daemon: ServiceDaemon,
    instance_name: String,
    host_name: String,
    fullname: String,
    port: u16,
    interfaces: Vec<String>,
    dropped: Arc<AtomicU64>,
    /// Dropping this tells the event thread to exit.
    stop: Option<flume::Sender<()>>,
    worker: Option<JoinHandle<()>>,
    closed: bool,
}

impl std::fmt::Debug for Mdns {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Mdns")
            .field("fullname", &self.fullname)
            .field("port", &self.port)
            .field("interfaces", &self.interfaces)
            .field("dropped_events", &self.dropped_events())
            .finish_non_exhaustive()
    }
}

impl Mdns {
    /// Starts the mdns-sd daemon on the selected interfaces, publishes
    /// `config.txt` and `config.port` under [`SERVICE_TYPE`], and browses for
    /// other instances of it.
    ///
    /// When `config.interfaces` is non-empty, every interface is disabled
    /// before the named ones are enabled, and both commands are queued before
    /// the registration and the browse, so no mDNS packet leaves on an
    /// unselected interface. (mdns-sd does join the mDNS multicast group on
    /// every interface while its daemon starts, and leaves it again when the
    /// selection arrives, so the kernel may send a membership report there.)
    pub fn start(
        config: MdnsConfig,
    ) -> Result<(Mdns, flume::Receiver<DiscoveryEvent>), DiscoveryError> {
        let MdnsConfig {
            instance_name,
            port,
            interfaces,
            txt,
            refresh_secs,
        } = config;
        check_instance_name(&instance_name)?;
        if port == 0 {
            return Err(DiscoveryError::ZeroPort {
                instance: instance_name,
            });
        }
        check_txt(&instance_name, &txt)?;
        let keep_loopback = selects_loopback(&interfaces);

        let daemon = ServiceDaemon::new().map_err(daemon_error("start"))?;
        let mut mdns = Mdns {
            daemon,
            host_name: format!("{}.local.", host_label(&instance_name)),
            fullname: format!("{instance_name}.{SERVICE_TYPE}"),
            instance_name,
            port,
            interfaces,
            dropped: Arc::new(AtomicU64::new(0)),
            stop: None,
            worker: None,
            closed: false,
        };
        // From here on, an early return drops `mdns`, which stops the daemon.
        if mdns.interfaces.is_empty() {
            mdns.daemon
                .disable_interface(vec![IfKind::LoopbackV4, IfKind::LoopbackV6])
                .map_err(daemon_error("disable loopback interfaces"))?;
        } else {
            mdns.daemon
                .disable_interface(IfKind::All)
                .map_err(daemon_error("disable all interfaces"))?;
            mdns.daemon
                .enable_interface(mdns.interface_kinds())
                .map_err(daemon_error("enable the configured interfaces"))?;
        }
        let monitor = mdns.daemon.monitor().map_err(daemon_error("monitor"))?;
        let service = mdns.service_info(&txt)?;
        mdns.fullname = service.get_fullname().to_owned();
        mdns.daemon
            .register(service)
            .map_err(daemon_error("register our service"))?;
        let browse = mdns
            .daemon
            .browse(SERVICE_TYPE)
            .map_err(daemon_error("browse"))?;

        let (events_tx, events_rx) = flume::bounded(EVENT_CHANNEL_CAPACITY);
        let (stop_tx, stop_rx) = flume::bounded(1);
        let worker = Worker {
            daemon: mdns.daemon.clone(),
            browse: Some(browse),
            monitor: Some(monitor),
            stop: stop_rx,
            sink: EventSink {
                events: events_tx,
                dropped: Arc::clone(&mdns.dropped),
            },
            own_fullname: mdns.fullname.clone(),
            own_instance: mdns.instance_name.clone(),
            keep_loopback,
            refresh: (refresh_secs > 0).then(|| Duration::from_secs(refresh_secs)),
        };
        let span = tracing::info_span!("mdns", instance = %mdns.instance_name);
        let handle = std::thread::Builder::new()
            .name("nuwa-mdns-events".into())
            .spawn(move || span.in_scope(|| worker.run()))
            .map_err(|source| DiscoveryError::Spawn { source })?;
        mdns.stop = Some(stop_tx);
        mdns.worker = Some(handle);
        let watched = watched_interfaces(&mdns.interfaces);
        info!(
            instance = %mdns.instance_name,
            port = mdns.port,
            configured = ?mdns.interfaces,
            watching = ?watched,
            "mdns discovery started"
        );
        if watched.is_empty() {
            warn!(
                "mDNS watches no network interface (this host has only loopback, or none of \
                 the configured ones), so it finds no device; devices on this host: \
                 --mdns-interface lo; other hosts: --peer MULTIADDR or --rendezvous MULTIADDR \
                 (`nuwa-node doctor` checks this)"
            );
        }
        Ok((mdns, events_rx))
    }

    /// Publishes `txt` in place of our current TXT record (the caller
    /// re-signs its announcement periodically, since verifiers reject old
    /// timestamps), under the same rules as [`MdnsConfig::txt`]; a refused
    /// record leaves the current one published. Peers see it as a fresh
    /// [`DiscoveryEvent::Discovered`].
    pub fn update_txt(&self, txt: Vec<(String, String)>) -> Result<(), DiscoveryError> {
        check_txt(&self.instance_name, &txt)?;
        let service = self.service_info(&txt)?;
        // mdns-sd re-announces a registered name when it is registered again.
        self.daemon
            .register(service)
            .map_err(daemon_error("re-register our service"))?;
        debug!(entries = txt.len(), "mdns txt record updated");
        Ok(())
    }

    /// How many events were dropped because the event channel was full (or
    /// its receiver gone).
    pub fn dropped_events(&self) -> u64 {
        self.dropped.load(Ordering::Relaxed)
    }

    /// Our full DNS-SD service name, `<instance>._nuwa-agent-sync._tcp.local.`.
    pub fn fullname(&self) -> &str {
        &self.fullname
    }

    /// Unregisters our service (peers get a goodbye packet), stops the event
    /// thread and the daemon. Blocks for at most a few seconds while the
    /// daemon confirms; the event receiver disconnects once drained.
    pub fn shutdown(mut self) -> Result<(), DiscoveryError> {
        self.close()
    }

    fn close(&mut self) -> Result<(), DiscoveryError> {
        if self.closed {
            return Ok(());
        }
        self.closed = true;
        // Goodbye first, while the daemon still runs. On a failed start this
        // finds nothing to unregister, which is fine.
        let unregistered = self
            .daemon
            .unregister(&self.fullname)
            .map_err(daemon_error("unregister our service"))
            .and_then(|reply| {
                reply
                    .recv_timeout(DAEMON_REPLY_TIMEOUT)
                    .map(drop)
                    .map_err(|_| DiscoveryError::Timeout {
                        action: "unregistering",
                    })
            });
        drop(self.stop.take());
        if let Some(worker) = self.worker.take()
            && worker.join().is_err()
        {
            warn!(instance = %self.instance_name, "mdns event thread panicked");
        }
        let stopped = self
            .daemon
            .shutdown()
            .map_err(daemon_error("shut down"))
            .and_then(|reply| {
                reply
                    .recv_timeout(DAEMON_REPLY_TIMEOUT)
                    .map(drop)
                    .map_err(|_| DiscoveryError::Timeout { action: "shutdown" })
            });
        info!(instance = %self.instance_name, "mdns discovery stopped");
        unregistered.and(stopped)
    }

    fn interface_kinds(&self) -> Vec<IfKind> {
        self.interfaces
            .iter()
            .map(|name| IfKind::Name(name.clone()))
            .collect()
    }

    fn service_info(&self, txt: &[(String, String)]) -> Result<ServiceInfo, DiscoveryError> {
        let mut service = ServiceInfo::new(
            SERVICE_TYPE,
            &self.instance_name,
            &self.host_name,
            (),
            self.port,
            txt,
        )
        .map_err(daemon_error("build our service record"))?
        // Addresses follow the enabled interfaces, including later changes.
        .enable_addr_auto();
        if !self.interfaces.is_empty() {
            service.set_interfaces(self.interface_kinds());
        }
        Ok(service)
    }
}

impl Drop for Mdns {
    fn drop(&mut self) {
        if let Err(e) = self.close() {
            debug!(instance = %self.instance_name, error = %e, "mdns shutdown on drop was incomplete");
        }
    }
}

fn daemon_error(action: &'static str) -> impl FnOnce(mdns_sd::Error) -> DiscoveryError {
    move |source| DiscoveryError::Daemon { action, source }
}

fn check_instance_name(name: &str) -> Result<(), DiscoveryError> {
    let reason = if name.is_empty() {
        Some("it is empty")
    } else if name.len() > MAX_INSTANCE_NAME_LEN {
        Some("it is longer than 63 bytes")
    } else if !name
        .bytes()
        .all(|b| b.is_ascii_graphic() && b != b'.' && b != b'\\')
    {
        Some("it may only contain visible ascii other than '.' and '\\'")
    } else {
        None
    };
    match reason {
        Some(reason) => Err(DiscoveryError::InvalidInstanceName {
            name: name.to_owned(),
            reason,
        }),
        None => Ok(()),
    }
}

/// Refuses a TXT record peers would not read back as given, so a bad entry
/// shows up as an error here instead of silence on the network (mdns-sd
/// would drop a duplicate key without a word).
fn check_txt(instance: &str, txt: &[(String, String)]) -> Result<(), DiscoveryError> {
    match txt_problem(txt) {
        Some(reason) => Err(DiscoveryError::InvalidTxt {
            instance: instance.to_owned(),
            reason,
        }),
        None => Ok(()),
    }
}

fn txt_problem(txt: &[(String, String)]) -> Option<String> {
    if txt.len() > MAX_TXT_ENTRIES {
        return Some(format!(
            "it has {} entries, at most {MAX_TXT_ENTRIES} allowed",
            txt.len()
        ));
    }
    for (index, (key, value)) in txt.iter().enumerate() {
        // A key can be as long as the entry; name it briefly in errors.
        let name = if key.len() <= 32 {
            format!("`{}`", key.escape_debug())
        } else {
            format!("number {index}")
        };
        if key.is_empty() {
            return Some(format!("entry number {index} has an empty key"));
        }
        if !key.bytes().all(|b| (0x20..=0x7e).contains(&b) && b != b'=') {
            return Some(format!(
                "key {name} has characters other than printable ascii, or '='"
            ));
        }
        let len = key.len() + 1 + value.len();
        if len > MAX_TXT_ENTRY_LEN {
            return Some(format!(
                "entry {name} is {len} bytes, at most {MAX_TXT_ENTRY_LEN} allowed"
            ));
        }
        if txt[..index]
            .iter()
            .any(|(k, _)| k.eq_ignore_ascii_case(key))
        {
            return Some(format!("key {name} appears twice (ignoring ascii case)"));
        }
    }
    None
}

/// What we pass on of a TXT record we see: the first [`MAX_TXT_ENTRIES`]
/// entries no longer than [`MAX_TXT_ENTRY_LEN`] bytes, and how many others
/// were left out. mdns-sd has already split the entries and dropped repeated
/// keys.
fn bounded_txt<'a>(
    props: impl IntoIterator<Item = (&'a str, &'a [u8])>,
) -> (Vec<(String, String)>, usize) {
    let mut kept = Vec::new();
    let mut skipped = 0;
    for (key, value) in props {
        // A wire entry is at most 255 bytes, but lossy decoding can grow it
        // (one bad byte becomes three); bound what we hand on.
        let value = String::from_utf8_lossy(value);
        if kept.len() >= MAX_TXT_ENTRIES || key.len() + 1 + value.len() > MAX_TXT_ENTRY_LEN {
            skipped += 1;
            continue;
        }
        kept.push((key.to_owned(), value.into_owned()));
    }
    (kept, skipped)
}

/// Host names allow only letters, digits and `-`.
fn host_label(instance: &str) -> String {
    instance
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' {
                c
            } else {
                '-'
            }
        })
        .collect()
}

/// The interfaces mDNS watches for a configured list: the configured
/// ones the host has, or (an empty list) every non-loopback interface the
/// host has an address on. Empty means mDNS sees nothing: a host (or
/// network namespace) with only loopback, unless `lo` is configured.
pub fn watched_interfaces(configured: &[String]) -> Vec<String> {
    let host = if_addrs::get_if_addrs().unwrap_or_default();
    let mut names: Vec<String> = host
        .iter()
        // mdns-sd's own filter: the link is up and not point-to-point (a
        // VPN tunnel is no LAN).
        .filter(|i| i.is_oper_up() && !i.is_p2p())
        .filter(|i| {
            if configured.is_empty() {
                !i.is_loopback()
            } else {
                configured.contains(&i.name)
            }
        })
        .map(|i| i.name.clone())
        .collect();
    names.sort();
    names.dedup();
    names
}

fn selects_loopback(interfaces: &[String]) -> bool {
    if interfaces.is_empty() {
        return false;
    }
    let host = match if_addrs::get_if_addrs() {
        Ok(host) => host,
        Err(e) => {
            warn!(error = %e, "cannot list network interfaces; peers' loopback addresses will be dropped");
            return false;
        }
    };
    for name in interfaces {
        if !host.iter().any(|i| i.name == *name) {
            warn!(interface = %name, "configured mdns interface has no address yet");
        }
    }
    host.iter()
        .any(|i| i.is_loopback() && interfaces.contains(&i.name))
}

fn usable_addr(ip: IpAddr, keep_loopback: bool) -> bool {
    if ip.is_unspecified() || ip.is_multicast() {
        return false;
    }
    if ip.is_loopback() {
        return keep_loopback;
    }
    match ip {
        IpAddr::V4(v4) => !v4.is_link_local() && !v4.is_broadcast(),
        // fe80::/10; `is_unicast_link_local` is not stable on every toolchain we target.
        IpAddr::V6(v6) => v6.segments()[0] & 0xffc0 != 0xfe80,
    }
}

/// The instance label of a full service name of our type.
fn instance_label(fullname: &str) -> String {
    let suffix_len = SERVICE_TYPE.len() + 1;
    let split = fullname.len().checked_sub(suffix_len);
    match split {
        Some(at)
            if fullname.is_char_boundary(at)
                && fullname[at..].eq_ignore_ascii_case(&format!(".{SERVICE_TYPE}")) =>
        {
            fullname[..at].to_owned()
        }
        _ => fullname.to_owned(),
    }
}

/// Whether a record seen is ours: our full name, or another record under
/// our instance label (a name conflict, or ourselves under a renamed full
/// name, never a peer). DNS names compare ignoring ASCII case.
fn is_own_record(own_fullname: &str, own_instance: &str, fullname: &str, instance: &str) -> bool {
    fullname.eq_ignore_ascii_case(own_fullname) || instance.eq_ignore_ascii_case(own_instance)
}

/// What woke the event thread.
enum Wake {
    Stop,
    Browse(Result<ServiceEvent, RecvError>),
    Monitor(Result<DaemonEvent, RecvError>),
    Rebrowse,
}

/// The private event thread: translates mdns-sd events, never blocks on the
/// caller.
struct Worker {
    daemon: ServiceDaemon,
    /// `None` while a failed re-browse waits for its retry.
    browse: Option<flume::Receiver<ServiceEvent>>,
    monitor: Option<flume::Receiver<DaemonEvent>>,
    stop: flume::Receiver<()>,
    sink: EventSink,
    own_fullname: String,
    own_instance: String,
    keep_loopback: bool,
    refresh: Option<Duration>,
}

impl Worker {
    fn run(mut self) {
        let mut rebrowse_at = self.next_refresh();
        loop {
            let wake = {
                let mut selector = Selector::new().recv(&self.stop, |_| Wake::Stop);
                if let Some(browse) = &self.browse {
                    selector = selector.recv(browse, Wake::Browse);
                }
                if let Some(monitor) = &self.monitor {
                    selector = selector.recv(monitor, Wake::Monitor);
                }
                match rebrowse_at {
                    Some(at) => selector.wait_deadline(at).unwrap_or(Wake::Rebrowse),
                    None => selector.wait(),
                }
            };
            match wake {
                Wake::Stop => return,
                Wake::Browse(Ok(event)) => self.on_service_event(event),
                Wake::Monitor(Ok(event)) => on_daemon_event(event),
                Wake::Monitor(Err(RecvError::Disconnected)) => self.monitor = None,
                // mdns-sd ends a subscription whose channel overflowed.
                Wake::Browse(Err(RecvError::Disconnected)) | Wake::Rebrowse => {
                    match self.rebrowse() {
                        Ok(()) => rebrowse_at = self.next_refresh(),
                        Err(mdns_sd::Error::Again) => {
                            rebrowse_at = Some(Instant::now() + BROWSE_RETRY_DELAY)
                        }
                        Err(e) => {
                            warn!(error = %e, "mdns browsing stopped");
                            return;
                        }
                    }
                }
            }
        }
    }

    /// `None` when refresh is off, or so far away that it cannot be represented.
    fn next_refresh(&self) -> Option<Instant> {
        self.refresh.and_then(|r| Instant::now().checked_add(r))
    }

    /// Starts a fresh browse, which re-reports every cached peer and queries
    /// the network again, after handing on whatever the old one still held.
    fn rebrowse(&mut self) -> Result<(), mdns_sd::Error> {
        if let Some(old) = self.browse.take() {
            for event in old.drain() {
                self.on_service_event(event);
            }
        }
        self.browse = Some(self.daemon.browse(SERVICE_TYPE)?);
        trace!("mdns re-browse");
        Ok(())
    }

    fn on_service_event(&self, event: ServiceEvent) {
        match event {
            ServiceEvent::ServiceResolved(service) => self.on_resolved(&service),
            ServiceEvent::ServiceRemoved(_, fullname) => {
                let instance = instance_label(&fullname);
                if !self.is_own(&fullname, &instance) {
                    debug!(%fullname, "mdns peer expired");
                    self.emit(DiscoveryEvent::Expired { instance });
                }
            }
            other => trace!(event = ?other, "mdns browse event"),
        }
    }

    fn is_own(&self, fullname: &str, instance: &str) -> bool {
        is_own_record(&self.own_fullname, &self.own_instance, fullname, instance)
    }

    fn on_resolved(&self, service: &ResolvedService) {
        let fullname = service.get_fullname();
        let instance = instance_label(fullname);
        if self.is_own(fullname, &instance) {
            trace!(%fullname, "mdns record under our own name ignored");
            return;
        }
        let port = service.get_port();
        if port == 0 {
            debug!(%instance, "mdns peer publishes tcp port 0; ignored");
            return;
        }
        let addrs: BTreeSet<SocketAddr> = service
            .get_addresses()
            .iter()
            .map(|ip| ip.to_ip_addr())
            .filter(|ip| usable_addr(*ip, self.keep_loopback))
            .map(|ip| SocketAddr::new(ip, port))
            .collect();
        if addrs.is_empty() {
            trace!(%instance, "mdns peer has no usable address yet");
            return;
        }
        let (txt, skipped) = bounded_txt(
            service
                .get_properties()
                .iter()
                .map(|p| (p.key(), p.val().unwrap_or_default())),
        );
        if skipped > 0 {
            debug!(%instance, skipped, "mdns txt entries over our bounds left out");
        }
        debug!(%instance, ?addrs, entries = txt.len(), "mdns peer discovered");
        self.emit(DiscoveryEvent::Discovered {
            instance,
            txt,
            addrs: addrs.into_iter().collect(),
        });
    }

    fn emit(&self, event: DiscoveryEvent) {
        self.sink.emit(event);
    }
}

/// The sending end of the event channel, which never blocks.
struct EventSink {
    events: flume::Sender<DiscoveryEvent>,
    dropped: Arc<AtomicU64>,
}

impl EventSink {
    fn emit(&self, event: DiscoveryEvent) {
        match self.events.try_send(event) {
            Ok(()) => {}
            Err(TrySendError::Full(_)) => {
                self.dropped.fetch_add(1, Ordering::Relaxed);
                debug!("discovery event channel full; event dropped");
            }
            Err(TrySendError::Disconnected(_)) => {
                self.dropped.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
}

fn on_daemon_event(event: DaemonEvent) {
    match event {
        DaemonEvent::Error(e) => warn!(error = %e, "mdns daemon error"),
        DaemonEvent::NameChange(change) => warn!(
            original = %change.original,
            new_name = %change.new_name,
            "mdns name conflict; another host uses our name"
        ),
        DaemonEvent::IpAdd(ip) => debug!(%ip, "mdns interface address added"),
        DaemonEvent::IpDel(ip) => debug!(%ip, "mdns interface address removed"),
        other => trace!(event = ?other, "mdns daemon event"),
    }
}

#[cfg(test)]
mod tests {
    //! Pure helpers of the runtime; the runtime itself is exercised over real
    //! packets in `tests/mdns_loopback.rs`.

    use super::*;

    #[test]
    fn address_filter() {
        // Goal: only addresses a peer can be dialled on survive; method: a
        // table of address kinds with and without loopback selected.
        let cases: [(&str, bool, bool); 10] = [
            // (address, keep loopback, usable)
            ("192.168.1.7", false, true),
            ("10.0.0.1", true, true),
            ("2001:db8::1", false, true),
            ("127.0.0.1", false, false),
            ("127.0.0.1", true, true),
            ("::1", true, true),
            ("169.254.3.4", true, false),
            ("fe80::1", true, false),
            ("0.0.0.0", true, false),
            ("224.0.0.251", true, false),
        ];
        for (addr, keep_loopback, usable) in cases {
            let ip: IpAddr = addr.parse().expect("test addresses parse");
            assert_eq!(
                usable_addr(ip, keep_loopback),
                usable,
                "{addr} keep_loopback={keep_loopback}"
            );
        }
    }

    #[test]
    fn full_channel_drops_and_counts() {
        // Goal: a slow consumer never blocks the event thread and every loss is
        // counted; method: overfill a small channel, then drop the receiver.
        let (tx, rx) = flume::bounded(2);
        let sink = EventSink {
            events: tx,
            dropped: Arc::new(AtomicU64::new(0)),
        };
        let event = |i: usize| DiscoveryEvent::Expired {
            instance: format!("peer-{i}"),
        };
        for i in 0..5 {
            sink.emit(event(i));
        }
        assert_eq!(sink.dropped.load(Ordering::Relaxed), 3);
        assert_eq!(rx.drain().collect::<Vec<_>>(), vec![event(0), event(1)]);
        drop(rx);
        sink.emit(event(5));
        assert_eq!(sink.dropped.load(Ordering::Relaxed), 4);
    }

    #[test]
    fn instance_names() {
        // Goal: instance names become valid labels or are refused with a
        // reason; method: a table of names.
        let peer = "12D3KooWD3eckifWpRn9wQpMG9R9hX3sD158z7EqHWmweQAJU5SA";
        assert!(check_instance_name(peer).is_ok());
        for bad in ["", "a.b", "a\\b", "with space", &"x".repeat(64), "é"] {
            assert!(check_instance_name(bad).is_err(), "{bad:?}");
        }
        assert_eq!(host_label("peer_1+x"), "peer-1-x");
        assert_eq!(instance_label(&format!("{peer}.{SERVICE_TYPE}")), peer);
        assert_eq!(
            instance_label(&format!("{peer}._NUWA-agent-sync._tcp.local.")),
            peer
        );
        assert_eq!(
            instance_label("other._http._tcp.local."),
            "other._http._tcp.local."
        );
        assert_eq!(instance_label("x"), "x");

        let own = format!("{peer}.{SERVICE_TYPE}");
        let other = "12D3KooWAgvKBtKXVG2bN1FQSXeoJJRsTaWtfAtAifC5YkzeAYwK";
        let seen: [(&str, &str, bool); 4] = [
            (&own, peer, true),
            (&own.to_ascii_uppercase(), "renamed", true),
            (
                "x (2)._nuwa-agent-sync._tcp.local.",
                &peer.to_ascii_lowercase(),
                true,
            ),
            ("y._nuwa-agent-sync._tcp.local.", other, false),
        ];
        for (fullname, instance, ours) in seen {
            assert_eq!(
                is_own_record(&own, peer, fullname, instance),
                ours,
                "{fullname}"
            );
        }
    }

    type Txt = Vec<(String, String)>;

    fn entry(key: &str, value: &str) -> (String, String) {
        (key.to_owned(), value.to_owned())
    }

    #[test]
    fn txt_records_we_publish() {
        // Goal: a record is published only if peers read back exactly what
        // was given; method: a table of records, each broken in one way,
        // with the words the refusal must contain.
        let valid = vec![entry("v", "1"), entry("peer", "12D3KooW")];
        let at_limit = vec![entry("k", &"x".repeat(MAX_TXT_ENTRY_LEN - 2))];
        let over_limit = vec![entry("k", &"x".repeat(MAX_TXT_ENTRY_LEN - 1))];
        let full: Vec<_> = (0..MAX_TXT_ENTRIES)
            .map(|i| entry(&format!("k{i}"), "1"))
            .collect();
        let mut crowded = full.clone();
        crowded.push(entry("one-more", "1"));
        let long_key = vec![entry(&"k".repeat(MAX_TXT_ENTRY_LEN), "")];
        let cases: Vec<(&str, Txt, Option<&str>)> = vec![
            ("valid", valid, None),
            ("empty record", vec![], None),
            ("empty value", vec![entry("flag", "")], None),
            ("entry at 255 bytes", at_limit, None),
            ("16 entries", full, None),
            (
                "entry at 256 bytes",
                over_limit,
                Some("entry `k` is 256 bytes"),
            ),
            ("17 entries", crowded, Some("it has 17 entries")),
            ("long key", long_key, Some("entry number 0 is 256 bytes")),
            ("empty key", vec![entry("", "x")], Some("empty key")),
            ("key with =", vec![entry("a=b", "x")], Some("or '='")),
            (
                "key with control",
                vec![entry("a\tb", "x")],
                Some("printable"),
            ),
            ("non-ascii key", vec![entry("clé", "x")], Some("printable")),
            (
                "duplicate key in other case",
                vec![entry("peer", "a"), entry("PEER", "b")],
                Some("key `PEER` appears twice"),
            ),
        ];
        for (name, txt, refusal) in cases {
            match (check_txt("me", &txt), refusal) {
                (Ok(()), None) => {}
                (Err(DiscoveryError::InvalidTxt { instance, reason }), Some(needle)) => {
                    assert_eq!(instance, "me", "{name}");
                    assert!(
                        reason.contains(needle),
                        "{name}: {reason:?} lacks {needle:?}"
                    );
                }
                (got, _) => panic!("{name}: unexpected {got:?}"),
            }
        }
    }

    #[test]
    fn txt_records_we_pass_on() {
        // Goal: whatever a peer publishes, what we hand on is bounded and in
        // order; method: feed the bounding step records over each bound.
        let long = vec![b'x'; MAX_TXT_ENTRY_LEN];
        let bad_utf8 = [b'o', b'k', 0xff];
        let props: Vec<(String, Vec<u8>)> = [
            ("a", b"1".as_slice()),
            ("too-long", long.as_slice()),
            ("b", bad_utf8.as_slice()),
            ("flag", b"".as_slice()),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v.to_vec()))
        .chain((0..20).map(|i| (format!("x{i}"), b"1".to_vec())))
        .collect();
        let (txt, skipped) = bounded_txt(props.iter().map(|(k, v)| (k.as_str(), v.as_slice())));
        assert_eq!(txt.len(), MAX_TXT_ENTRIES);
        assert_eq!(skipped, props.len() - MAX_TXT_ENTRIES);
        assert_eq!(txt[0], entry("a", "1"));
        assert_eq!(txt[1], entry("b", "ok\u{fffd}"));
        assert_eq!(txt[2], entry("flag", ""));
        assert_eq!(txt[3], entry("x0", "1"));
        assert_eq!(txt[15], entry("x12", "1"));

        // An entry that fits on the wire but grows past the bound when
        // decoded is left out too.
        let grows = vec![0xffu8; 200];
        let (txt, skipped) = bounded_txt([("k", grows.as_slice())]);
        assert!(txt.is_empty() && skipped == 1, "{txt:?}");
    }
}
