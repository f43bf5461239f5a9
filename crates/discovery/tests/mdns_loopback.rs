//! Real mDNS packets between `Mdns` instances, on the loopback interface only.
//!
//! Each networked test re-runs itself inside a private network namespace
//! (`unshare --net`) when the host allows it. That namespace holds `lo` and a
//! veth pair leading nowhere, so "other interfaces" exist for the interface
//! selection to exclude. mdns-sd joins its multicast group on every interface
//! as its daemon starts, before our selection reaches it; the namespace keeps
//! even that membership report off real interfaces, and leaves the host's `lo`
//! flags alone. Without `unshare` (or with `NUWA_DISCOVERY_TEST_HOST_LO=1`)
//! the tests use the host's `lo`, turning its MULTICAST flag on first if
//! needed, and skip the one test that needs non-loopback interfaces. Either
//! way every instance is confined to `lo` by `MdnsConfig::interfaces`, except
//! in that namespace-only test.
//!
//! Discovery only carries TXT records; the records here are real signed
//! announcements (`nuwa_agent::announce`), and the tests check what a caller
//! would: that what arrives parses, verifies and names the SRV port.

use std::io::{BufRead as _, BufReader, Read as _};
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use ed25519_dalek::{Signer as _, SigningKey};
use nuwa_agent::announce::Announcement;
use nuwa_discovery::{
    DiscoveryError, DiscoveryEvent, MAX_TXT_ENTRIES, MAX_TXT_ENTRY_LEN, Mdns, MdnsConfig, flume,
};

/// Set in the re-run inside the private namespace.
const IN_NETNS_ENV: &str = "NUWA_DISCOVERY_TEST_IN_NETNS";
/// Set by a developer to skip the private namespace and use the host's `lo`.
const HOST_LO_ENV: &str = "NUWA_DISCOVERY_TEST_HOST_LO";
/// Set for the helper child process; holds the PeerId it must discover.
const CHILD_ENV: &str = "NUWA_DISCOVERY_TEST_CHILD_EXPECTS";
/// Generous: probing and the first queries take about a second.
const DEADLINE: Duration = Duration::from_secs(20);
const MAX_AGE_SECS: i64 = 600;
const AGENT_DID: &str = "did:key:z6MkhaXgBZDvotDkL5257faiztiGiC2QtKLGpbnnEGta2doK";
/// A record discovery lets a device publish is never refused by a peer's
/// agent for its number of entries.
const _: () = assert!(MAX_TXT_ENTRIES <= nuwa_agent::announce::MAX_TXT_ENTRIES);
/// IFF_MULTICAST in `/sys/class/net/*/flags`.
const IFF_MULTICAST: u32 = 0x1000;
const IFF_UP: u32 = 0x1;

/// One device per row: signing-key seed, PeerId (52-char base58, unique per
/// test so parallel tests on the host's `lo` ignore each other), port.
const DEVICES: [(u8, &str, u16); 6] = [
    (
        1,
        "12D3KooWAgvKBtKXVG2bN1FQSXeoJJRsTaWtfAtAifC5YkzeAYwK",
        41001,
    ),
    (
        2,
        "12D3KooWBkkTyCvLTzrJx6iRPFTWNpWTPu5uFGRuPxbWvNVCgvfb",
        41002,
    ),
    (
        3,
        "12D3KooWCjrhcS2V8Hk1YNbuScwTQ8hPP9XHoHn4ELSdMZ8L4ztd",
        41003,
    ),
    (
        4,
        "12D3KooWDb1GgEbEqV4jCFuJfcQ5kd7C8C5eKVXe7vzd5PURjR2F",
        41004,
    ),
    (
        5,
        "12D3KooWEfcQ8sRqkvyP6XLhJ8Fy2T7GJzCrBDcHCRgNKkxdtm3a",
        41005,
    ),
    (
        6,
        "12D3KooWFPzNmNWZMRgYEm8X3oXPTXvbk9y9qhVupnmo3ZdcKAr4",
        41006,
    ),
];

fn now_unix_secs() -> i64 {
    let since_epoch = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("clock after 1970");
    i64::try_from(since_epoch.as_secs()).expect("clock before year 292277026596")
}

struct Device {
    key: SigningKey,
    peer_id: &'static str,
    port: u16,
}

impl Device {
    fn new(row: usize) -> Device {
        let (seed, peer_id, port) = DEVICES[row];
        Device {
            key: SigningKey::from_bytes(&[seed; 32]),
            peer_id,
            port,
        }
    }

    fn public(&self) -> [u8; 32] {
        self.key.verifying_key().to_bytes()
    }

    fn announcement(&self, ts: i64) -> Announcement {
        Announcement::new_signed(AGENT_DID, "key-1", self.peer_id, self.port, ts, |m| {
            self.key.sign(m).to_bytes()
        })
    }

    fn config(&self, ts: i64) -> MdnsConfig {
        MdnsConfig {
            instance_name: self.peer_id.to_owned(),
            port: self.port,
            interfaces: vec!["lo".to_owned()],
            txt: self.announcement(ts).to_txt(),
            refresh_secs: 0,
        }
    }

    fn start(&self, ts: i64) -> (Mdns, flume::Receiver<DiscoveryEvent>) {
        Mdns::start(self.config(ts)).unwrap_or_else(|e| panic!("start {}: {e}", self.peer_id))
    }
}

/// Receives until `pick` returns `Some`, or panics at the deadline listing
/// what did arrive.
fn wait_for<T>(
    rx: &flume::Receiver<DiscoveryEvent>,
    what: &str,
    mut pick: impl FnMut(&DiscoveryEvent) -> Option<T>,
) -> T {
    let deadline = Instant::now() + DEADLINE;
    let mut seen = Vec::new();
    loop {
        match rx.recv_deadline(deadline) {
            Ok(event) => {
                if let Some(found) = pick(&event) {
                    return found;
                }
                seen.push(event);
            }
            Err(e) => panic!("no {what} within {DEADLINE:?} ({e}); saw {seen:#?}"),
        }
    }
}

/// Which addresses a discovered peer must be reported with.
#[derive(Clone, Copy)]
enum Net {
    /// `interfaces: ["lo"]`: loopback only.
    Loopback,
    /// `interfaces: []` in the private namespace: the veth pair only.
    Veth,
}

impl Net {
    fn expected(self, port: u16) -> SocketAddr {
        let ip = match self {
            Net::Loopback => Ipv4Addr::LOCALHOST,
            Net::Veth => Ipv4Addr::new(10, 99, 0, 1),
        };
        SocketAddr::new(IpAddr::V4(ip), port)
    }

    fn allows(self, addr: &SocketAddr) -> bool {
        match (self, addr.ip()) {
            (Net::Loopback, ip) => ip.is_loopback(),
            (Net::Veth, IpAddr::V4(v4)) => v4.octets()[..3] == [10, 99, 0],
            (Net::Veth, IpAddr::V6(_)) => false,
        }
    }
}

/// What a caller makes of a [`DiscoveryEvent::Discovered`].
struct Found {
    announcement: Announcement,
    txt: Vec<(String, String)>,
    addrs: Vec<SocketAddr>,
}

/// Waits for `from`'s announcement (optionally with timestamp `ts`), checks
/// that every record on the way parses, that `from`'s verifies, and that it
/// carries exactly the addresses `net` allows, with the announced port.
fn wait_discovered(
    rx: &flume::Receiver<DiscoveryEvent>,
    own: &Device,
    from: &Device,
    ts: Option<i64>,
    net: Net,
) -> Found {
    let found = wait_for(
        rx,
        &format!("Discovered({}) at {}", from.peer_id, own.peer_id),
        |event| {
            let DiscoveryEvent::Discovered {
                instance,
                txt,
                addrs,
            } = event
            else {
                return None;
            };
            assert_ne!(instance, own.peer_id, "an instance reported itself");
            let announcement = Announcement::from_txt(txt.clone())
                .unwrap_or_else(|e| panic!("malformed announcement from {instance}: {e}"));
            assert_eq!(
                &announcement.peer_id, instance,
                "the instance label is the announced PeerId"
            );
            let wanted = announcement.peer_id == from.peer_id
                && ts.is_none_or(|ts| announcement.timestamp_unix_secs == ts)
                && addrs.contains(&net.expected(from.port));
            wanted.then(|| Found {
                announcement,
                txt: txt.clone(),
                addrs: addrs.clone(),
            })
        },
    );
    let Found {
        announcement,
        addrs,
        ..
    } = &found;
    announcement
        .verify(&from.public(), now_unix_secs(), MAX_AGE_SECS)
        .unwrap_or_else(|e| panic!("announcement of {} does not verify: {e}", from.peer_id));
    assert!(announcement.matches_agent(AGENT_DID));
    assert_eq!(announcement.port, from.port);
    // The SRV port travels outside the signature; it must be the signed one.
    assert!(
        addrs
            .iter()
            .all(|a| net.allows(a) && a.port() == announcement.port),
        "unexpected address in {addrs:?}"
    );
    found
}

/// `txt` grown to [`MAX_TXT_ENTRIES`] entries with unknown keys, one of them
/// exactly [`MAX_TXT_ENTRY_LEN`] bytes: the largest record we publish.
fn fill_to_bounds(mut txt: Vec<(String, String)>) -> Vec<(String, String)> {
    let long_value = "n".repeat(MAX_TXT_ENTRY_LEN - "note=".len());
    txt.push(("note".to_owned(), long_value));
    while txt.len() < MAX_TXT_ENTRIES {
        txt.push((format!("x{}", txt.len()), "1".to_owned()));
    }
    txt
}

fn wait_expired(rx: &flume::Receiver<DiscoveryEvent>, gone: &Device) {
    wait_for(
        rx,
        &format!("Expired({})", gone.peer_id),
        |event| match event {
            DiscoveryEvent::Expired { instance } if instance == gone.peer_id => Some(()),
            _ => None,
        },
    )
}

#[test]
fn two_instances_discover_each_other_on_lo() {
    // Goal: two in-process instances find, re-find after an update, and lose
    // each other over real mDNS on lo; method: wait on each event channel with
    // a deadline and verify what arrives.
    isolated("two_instances_discover_each_other_on_lo", |_| {
        let (a, b) = (Device::new(0), Device::new(1));
        let ts = now_unix_secs();
        let (mdns_a, rx_a) = a.start(ts);
        let (mdns_b, rx_b) = b.start(ts);

        wait_discovered(&rx_a, &a, &b, Some(ts), Net::Loopback);
        wait_discovered(&rx_b, &b, &a, Some(ts), Net::Loopback);

        // A re-signed announcement reaches the peer as a fresh event, and a
        // record at every bound arrives whole: each entry, in order.
        let later = ts + 5;
        let published = fill_to_bounds(b.announcement(later).to_txt());
        mdns_b
            .update_txt(published.clone())
            .expect("update txt record");
        let found = wait_discovered(&rx_a, &a, &b, Some(later), Net::Loopback);
        assert_eq!(found.txt, published);

        // A record over the bounds is refused, and the last one stays.
        let mut crowded = published.clone();
        crowded.push(("one-more".to_owned(), "1".to_owned()));
        let refused = mdns_b.update_txt(crowded);
        assert!(
            matches!(refused, Err(DiscoveryError::InvalidTxt { .. })),
            "{refused:?}"
        );

        // Goodbye: a's browser learns b left, and b's event channel closes.
        mdns_b.shutdown().expect("clean shutdown");
        wait_expired(&rx_a, &b);
        let deadline = Instant::now() + DEADLINE;
        while rx_b.recv_deadline(deadline).is_ok() {}
        assert!(
            rx_b.is_disconnected(),
            "b's events did not close after shutdown"
        );

        assert_eq!(mdns_a.dropped_events(), 0);
        mdns_a.shutdown().expect("clean shutdown");
    });
}

#[test]
fn child_process_discovers_and_says_goodbye() {
    // Goal: discovery works across processes, both ways, and a child's
    // shutdown reaches us as Expired; method: run this same test as a child
    // process (it takes the child's part when CHILD_ENV is set) and exchange
    // progress over its stdout and stdin.
    if let Ok(expected_peer) = std::env::var(CHILD_ENV) {
        child_announcer(&expected_peer);
        return;
    }
    isolated("child_process_discovers_and_says_goodbye", |_| {
        let (parent, child_dev) = (Device::new(2), Device::new(3));
        let (mdns, rx) = parent.start(now_unix_secs());

        let exe = std::env::current_exe().expect("test binary path");
        let mut child = ChildGuard(
            Command::new(exe)
                .args([
                    "child_process_discovers_and_says_goodbye",
                    "--exact",
                    "--nocapture",
                    "--test-threads=1",
                ])
                .env(CHILD_ENV, parent.peer_id)
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .spawn()
                .expect("spawn child announcer"),
        );
        let lines = child.stdout_lines();

        wait_discovered(&rx, &parent, &child_dev, None, Net::Loopback);
        wait_line(&lines, &format!("CHILD_DISCOVERED {}", parent.peer_id));

        // Closing stdin tells the child to shut down, which sends a goodbye.
        drop(child.0.stdin.take());
        wait_expired(&rx, &child_dev);
        wait_line(&lines, "CHILD_DONE");
        let status = child.wait(DEADLINE);
        assert!(status.success(), "child announcer failed: {status}");

        assert_eq!(mdns.dropped_events(), 0);
        mdns.shutdown().expect("clean shutdown");
    });
}

#[test]
fn default_interfaces_skip_loopback() {
    // Goal: with no interfaces configured, mDNS uses every non-loopback
    // interface and reports no loopback address; method: two instances in the
    // private namespace, whose only other interfaces are a veth pair.
    isolated("default_interfaces_skip_loopback", |place| {
        if place == Place::HostLo {
            eprintln!(
                "skipped: without a private namespace this would multicast on real interfaces"
            );
            return;
        }
        let (a, b) = (Device::new(0), Device::new(1));
        let ts = now_unix_secs();
        let start = |d: &Device| {
            let mut config = d.config(ts);
            config.interfaces.clear();
            Mdns::start(config).unwrap_or_else(|e| panic!("start {}: {e}", d.peer_id))
        };
        let (mdns_a, rx_a) = start(&a);
        let (mdns_b, rx_b) = start(&b);
        wait_discovered(&rx_a, &a, &b, Some(ts), Net::Veth);
        wait_discovered(&rx_b, &b, &a, Some(ts), Net::Veth);
        mdns_a.shutdown().expect("clean shutdown");
        mdns_b.shutdown().expect("clean shutdown");
    });
}

#[test]
fn refresh_re_reports_present_peers() {
    // Goal: `refresh_secs` re-reports a peer that is still there, so events
    // lost to a full channel come back; method: with a 1 s refresh, wait for
    // more reports of an unchanged peer than mdns-sd alone produces.
    isolated("refresh_re_reports_present_peers", |_| {
        let (a, b) = (Device::new(4), Device::new(5));
        let ts = now_unix_secs();
        let mut config = a.config(ts);
        config.refresh_secs = 1;
        let (mdns_a, rx_a) = Mdns::start(config).expect("start a");
        let (mdns_b, _rx_b) = b.start(ts);
        // Measured here: without refresh mdns-sd reports an unchanged peer
        // once in 20 s; with a 1 s refresh, once per second.
        let wanted = 4;
        let mut reports = 0;
        wait_for(
            &rx_a,
            &format!("{wanted} reports of {}", b.peer_id),
            |event| {
                if let DiscoveryEvent::Discovered { instance, .. } = event
                    && instance == b.peer_id
                {
                    reports += 1;
                }
                (reports >= wanted).then_some(())
            },
        );
        mdns_a.shutdown().expect("clean shutdown");
        mdns_b.shutdown().expect("clean shutdown");
    });
}

/// The child half of `child_process_discovers_and_says_goodbye`, run in a
/// child process started by that test.
fn child_announcer(expected_peer: &str) {
    let me = Device::new(3);
    let parent = DEVICES
        .iter()
        .position(|(_, peer, _)| *peer == expected_peer)
        .map(Device::new)
        .expect("parent is one of DEVICES");
    let (mdns, rx) = me.start(now_unix_secs());
    wait_discovered(&rx, &me, &parent, None, Net::Loopback);
    println!("CHILD_DISCOVERED {expected_peer}");
    // Block until the parent closes our stdin (or dies).
    let mut sink = Vec::new();
    let _ = std::io::stdin().read_to_end(&mut sink);
    mdns.shutdown().expect("clean shutdown");
    println!("CHILD_DONE");
}

#[test]
fn start_rejects_bad_config() {
    // Goal: configuration errors, a TXT record peers would not read back as
    // given among them, surface before any socket opens; method: one broken
    // field per case (validation runs before the daemon starts).
    let device = Device::new(0);
    let ts = now_unix_secs();
    let with_txt = |edit: fn(&mut Vec<(String, String)>)| {
        let mut config = device.config(ts);
        edit(&mut config.txt);
        config
    };
    let mut dotted = device.config(ts);
    dotted.instance_name = "a.b".into();
    let mut zero_port = device.config(ts);
    zero_port.port = 0;
    let crowded = with_txt(|txt| {
        *txt = fill_to_bounds(std::mem::take(txt));
        txt.push(("one-more".into(), "1".into()));
    });
    let over_long = with_txt(|txt| {
        // `note=` plus 251 bytes: one byte over.
        txt.push(("note".into(), "n".repeat(MAX_TXT_ENTRY_LEN - 4)));
    });
    let duplicate = with_txt(|txt| txt.push(("PEER".into(), "12D3KooW".into())));
    let equals_in_key = with_txt(|txt| txt.push(("a=b".into(), "1".into())));

    type IsExpected = fn(&DiscoveryError) -> bool;
    let invalid_txt: IsExpected = |e| matches!(e, DiscoveryError::InvalidTxt { .. });
    let cases: [(&str, MdnsConfig, IsExpected); 6] = [
        ("dotted instance", dotted, |e| {
            matches!(e, DiscoveryError::InvalidInstanceName { .. })
        }),
        ("port zero", zero_port, |e| {
            matches!(e, DiscoveryError::ZeroPort { .. })
        }),
        ("17 txt entries", crowded, invalid_txt),
        ("256-byte txt entry", over_long, invalid_txt),
        ("duplicate key", duplicate, invalid_txt),
        ("'=' in a key", equals_in_key, invalid_txt),
    ];
    for (name, config, expected) in cases {
        match Mdns::start(config) {
            Ok(_) => panic!("{name}: started"),
            Err(e) => assert!(expected(&e), "{name}: {e:?}"),
        }
    }
}

/// Kills the child if the test fails half way.
struct ChildGuard(Child);

impl ChildGuard {
    fn stdout_lines(&mut self) -> mpsc::Receiver<String> {
        let stdout = self.0.stdout.take().expect("piped stdout");
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        rx
    }

    fn wait(&mut self, limit: Duration) -> std::process::ExitStatus {
        let deadline = Instant::now() + limit;
        loop {
            if let Some(status) = self.0.try_wait().expect("poll child") {
                return status;
            }
            assert!(
                Instant::now() < deadline,
                "child did not exit within {limit:?}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for ChildGuard {
    fn drop(&mut self) {
        if let Ok(None) = self.0.try_wait() {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
}

fn wait_line(lines: &mpsc::Receiver<String>, expected: &str) {
    let deadline = Instant::now() + DEADLINE;
    let mut seen = Vec::new();
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match lines.recv_timeout(left) {
            // libtest may print "test child_process_... " on the same line.
            Ok(line) if line.ends_with(expected) => return,
            Ok(line) => seen.push(line),
            Err(e) => panic!("child never printed {expected:?} ({e}); it printed {seen:#?}"),
        }
    }
}

/// Where a networked test body runs.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Place {
    /// A private network namespace holding `lo` and the veth pair
    /// `nuwa0`/`nuwa1`, which leads nowhere outside it.
    Netns,
    /// The host's network namespace; only `lo` may be used.
    HostLo,
}

/// Runs `body` with mDNS confined to `lo` (or to a private namespace): in a
/// private network namespace when the host allows one and
/// `NUWA_DISCOVERY_TEST_HOST_LO` is unset, else on the host's `lo`.
fn isolated(test_name: &str, body: impl FnOnce(Place)) {
    if std::env::var_os(IN_NETNS_ENV).is_some() {
        set_up_netns();
        body(Place::Netns);
        return;
    }
    let forced_host = std::env::var_os(HOST_LO_ENV).is_some();
    let flavour = if forced_host { None } else { unshare_flavour() };
    let Some(unshare_args) = flavour else {
        eprintln!("note: {test_name} runs on the host's lo (no private network namespace)");
        ensure_host_lo_multicast();
        body(Place::HostLo);
        return;
    };
    let exe = std::env::current_exe().expect("test binary path");
    let out = Command::new("unshare")
        .args(unshare_args)
        .arg("--")
        .arg(exe)
        .args([test_name, "--exact", "--nocapture", "--test-threads=1"])
        .env(IN_NETNS_ENV, "1")
        .output()
        .expect("run the test again under unshare");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "{test_name} failed in its network namespace ({}):\n{stdout}\n{stderr}",
        out.status
    );
    assert!(
        stdout.contains("1 passed"),
        "{test_name} did not run in its namespace:\n{stdout}"
    );
}

/// Which `unshare` arguments give us a network namespace: plain as root,
/// with a user namespace otherwise.
fn unshare_flavour() -> Option<&'static [&'static str]> {
    let flavours: [&'static [&'static str]; 2] = [&["--net"], &["--net", "--map-root-user"]];
    flavours.into_iter().find(|args| {
        Command::new("unshare")
            .args(*args)
            .args(["--", "ip", "link", "show", "lo"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    })
}

/// A fresh namespace's `lo` is down; bring it up with MULTICAST, and add a
/// veth pair so that "other interfaces" exist without leaving the namespace.
/// `/sys/class/net` still shows the host's namespace here (sysfs is not
/// remounted), so ask `ip` instead.
fn set_up_netns() {
    run_ip(&["link", "set", "dev", "lo", "up", "multicast", "on"]);
    let out = Command::new("ip")
        .args(["-o", "link", "show", "dev", "lo"])
        .output()
        .expect("run ip");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("MULTICAST") && text.contains(",UP"),
        "lo in the test namespace is not up with MULTICAST: {text}"
    );
    run_ip(&[
        "link", "add", "nuwa0", "type", "veth", "peer", "name", "nuwa1",
    ]);
    run_ip(&["addr", "add", "10.99.0.1/24", "dev", "nuwa0"]);
    run_ip(&["addr", "add", "10.99.0.2/24", "dev", "nuwa1"]);
    for dev in ["nuwa0", "nuwa1"] {
        run_ip(&["link", "set", "dev", dev, "up", "multicast", "on"]);
    }
}

fn lo_flags() -> u32 {
    let text =
        std::fs::read_to_string("/sys/class/net/lo/flags").expect("read /sys/class/net/lo/flags");
    let hex = text.trim().trim_start_matches("0x");
    u32::from_str_radix(hex, 16).unwrap_or_else(|e| panic!("lo flags {text:?}: {e}"))
}

fn ensure_host_lo_multicast() {
    let wanted = IFF_MULTICAST | IFF_UP;
    if lo_flags() & wanted == wanted {
        return;
    }
    run_ip(&["link", "set", "dev", "lo", "up", "multicast", "on"]);
    assert!(
        lo_flags() & wanted == wanted,
        "mDNS over loopback needs lo up with the MULTICAST flag, and setting it failed; \
         run `ip link set dev lo multicast on` as root, then rerun the tests"
    );
}

fn run_ip(args: &[&str]) {
    let status = Command::new("ip").args(args).status();
    assert!(
        status.as_ref().is_ok_and(|s| s.success()),
        "`ip {}` failed ({status:?}); mDNS over loopback needs lo up with MULTICAST \
         (run the tests as root, or set it yourself)",
        args.join(" ")
    );
}
