//! The mDNS runtime: publish our announcement, browse for everyone else's.
//!
//! [`Mdns`] is a handle to two threads: mdns-sd's own daemon thread, which owns
//! the sockets, and a small private event thread that turns mdns-sd's service
//! events into [`DiscoveryEvent`]s on a bounded channel. The event thread never
//! blocks on the caller: when the channel is full it drops the event and counts
//! it ([`Mdns::dropped_events`]); the periodic re-browse
//! ([`MdnsConfig::refresh_secs`]) re-reports every peer still present, which
//! heals such losses.
//!
//! This module does not verify announcements, decide which peers to dial, or
//! remember peers across restarts: events carry parsed, unverified
//! announcements and the caller does the rest.

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
use crate::announce::{AnnounceError, Announcement};

/// Capacity of the [`DiscoveryEvent`] channel handed out by [`Mdns::start`].
pub const EVENT_CHANNEL_CAPACITY: usize = 256;

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
    /// TCP port of the libp2p listener; must equal `announcement.port`.
    pub port: u16,
    /// Interface names to use (for example `["lo"]`, `["eth0", "wlan0"]`).
    /// Empty means every non-loopback interface. Loopback addresses of peers
    /// are reported only when a loopback interface is listed here.
    pub interfaces: Vec<String>,
    /// The signed announcement to publish in our TXT record.
    pub announcement: Announcement,
    /// Every this many seconds, browse afresh: the query goes out again and
    /// every peer still present is reported again, healing dropped events.
    /// `0` disables it. Tens of seconds to a few minutes is sensible.
    pub refresh_secs: u64,
}

/// What the browser saw on the network.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DiscoveryEvent {
    /// A device published a well-formed announcement. It is parsed but **not
    /// verified**: check [`Announcement::matches_agent`] and
    /// [`Announcement::verify`] before trusting it. Repeats as addresses
    /// accumulate, on every re-browse, and when the peer re-announces.
    Discovered {
        /// The announcement from the TXT record.
        announcement: Announcement,
        /// Usable addresses with the announced port: link-local addresses are
        /// dropped, loopback ones too unless a loopback interface is selected.
        /// Sorted, without duplicates, never empty.
        addrs: Vec<SocketAddr>,
    },
    /// A service of our type whose TXT record does not decode (count it; it
    /// may be a newer protocol version or someone misbehaving).
    Malformed {
        /// The DNS-SD instance label (by convention the announcer's PeerId).
        instance: String,
        /// Why it was rejected.
        reason: String,
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
    /// The announcement would not survive its own TXT encoding.
    #[error("announcement for mdns instance {instance:?} cannot be published")]
    InvalidAnnouncement {
        /// Our instance name.
        instance: String,
        /// What the TXT decoder rejected.
        #[source]
        source: AnnounceError,
    },
    /// The announcement advertises another port than the one configured.
    #[error(
        "announcement port {announced} differs from the configured mdns port {configured}; \
         sign the announcement for the port the node listens on"
    )]
    PortMismatch {
        /// Port inside the signed announcement.
        announced: u16,
        /// Port in [`MdnsConfig::port`].
        configured: u16,
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
    /// `config.announcement` under [`SERVICE_TYPE`], and browses for other
    /// instances of it.
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
            announcement,
            refresh_secs,
        } = config;
        check_instance_name(&instance_name)?;
        check_publishable(&instance_name, port, &announcement)?;
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
        let service = mdns.service_info(&announcement)?;
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
            own_peer_id: announcement.peer_id.clone(),
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

    /// Publishes `announcement` in place of the current one (the caller
    /// re-signs periodically, since verifiers reject old timestamps). Peers
    /// see it as a fresh [`DiscoveryEvent::Discovered`].
    pub fn update_announcement(&self, announcement: Announcement) -> Result<(), DiscoveryError> {
        check_publishable(&self.instance_name, self.port, &announcement)?;
        let service = self.service_info(&announcement)?;
        // mdns-sd re-announces a registered name when it is registered again.
        self.daemon
            .register(service)
            .map_err(daemon_error("re-register our service"))?;
        debug!(
            ts = announcement.timestamp_unix_secs,
            "mdns announcement updated"
        );
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

    fn service_info(&self, announcement: &Announcement) -> Result<ServiceInfo, DiscoveryError> {
        let txt = announcement.to_txt();
        let mut service = ServiceInfo::new(
            SERVICE_TYPE,
            &self.instance_name,
            &self.host_name,
            (),
            self.port,
            &txt[..],
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

/// Refuses announcements peers would reject as malformed, so a bad field
/// shows up as an error here instead of silence on the network.
fn check_publishable(
    instance: &str,
    port: u16,
    announcement: &Announcement,
) -> Result<(), DiscoveryError> {
    let invalid = |source| DiscoveryError::InvalidAnnouncement {
        instance: instance.to_owned(),
        source,
    };
    let decoded = Announcement::from_txt(announcement.to_txt()).map_err(invalid)?;
    if decoded != *announcement {
        return Err(invalid(AnnounceError::Malformed {
            reason: "announcement does not survive its txt encoding".into(),
        }));
    }
    if announcement.port != port {
        return Err(DiscoveryError::PortMismatch {
            announced: announcement.port,
            configured: port,
        });
    }
    Ok(())
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
    own_peer_id: String,
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
                if !fullname.eq_ignore_ascii_case(&self.own_fullname) {
                    debug!(%fullname, "mdns peer expired");
                    self.emit(DiscoveryEvent::Expired {
                        instance: instance_label(&fullname),
                    });
                }
            }
            other => trace!(event = ?other, "mdns browse event"),
        }
    }

    fn on_resolved(&self, service: &ResolvedService) {
        let fullname = service.get_fullname();
        if fullname.eq_ignore_ascii_case(&self.own_fullname) {
            return;
        }
        let instance = instance_label(fullname);
        let props = service
            .get_properties()
            .iter()
            .map(|p| (p.key(), p.val().unwrap_or_default()));
        let announcement = match Announcement::from_txt(props) {
            Ok(announcement) => announcement,
            Err(e) => {
                debug!(%instance, error = %e, "malformed mdns announcement");
                self.emit(DiscoveryEvent::Malformed {
                    instance,
                    reason: e.to_string(),
                });
                return;
            }
        };
        if announcement.peer_id == self.own_peer_id {
            trace!(%instance, "mdns announcement with our own peer id ignored");
            return;
        }
        if service.get_port() != announcement.port {
            let reason = format!(
                "srv port {} differs from the announced port {}",
                service.get_port(),
                announcement.port
            );
            debug!(%instance, %reason, "malformed mdns announcement");
            self.emit(DiscoveryEvent::Malformed { instance, reason });
            return;
        }
        let addrs: BTreeSet<SocketAddr> = service
            .get_addresses()
            .iter()
            .map(|ip| ip.to_ip_addr())
            .filter(|ip| usable_addr(*ip, self.keep_loopback))
            .map(|ip| SocketAddr::new(ip, announcement.port))
            .collect();
        if addrs.is_empty() {
            trace!(%instance, "mdns peer has no usable address yet");
            return;
        }
        debug!(%instance, peer = %announcement.peer_id, ?addrs, "mdns peer discovered");
        self.emit(DiscoveryEvent::Discovered {
            announcement,
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
    }
}
