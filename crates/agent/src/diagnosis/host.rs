//! `doctor`'s verdicts over the host the home lives on: whether mDNS can
//! find devices on the LAN with the interfaces this host has, and whether
//! the home's file system has room to grow.
//!
//! The shell lists the interfaces (by the daemon's own rule) and reads the
//! free space; these functions take what it found and judge it.

use super::Check;
use crate::status::Status;

/// Free space on the home's file system below which `doctor` fails.
pub const DISK_FAIL_BYTES: u64 = 100 * 1024 * 1024;
/// Free space below which `doctor` warns.
pub const DISK_WARN_BYTES: u64 = 1024 * 1024 * 1024;
const _: () = assert!(DISK_FAIL_BYTES < DISK_WARN_BYTES);

/// What the shell knows about mDNS on this host when no running daemon
/// reports it.
pub struct MdnsFacts<'a> {
    /// Whether the settings switch mDNS on.
    pub on: bool,
    /// The `mdns_interfaces` setting (empty: every interface but loopback).
    pub configured: &'a [String],
    /// How many peers, rendezvous servers, bootstrap nodes and keepers the
    /// settings name: the other ways to find devices.
    pub other_sources: usize,
    /// The interfaces mDNS would watch under `configured` on this host and
    /// the configured ones it would not, or why the host's interfaces
    /// cannot be listed.
    pub watch: Result<(Vec<String>, Vec<String>), String>,
    /// Every interface name of this host, for the report.
    pub host_interfaces: String,
}

/// Whether mDNS can find this agent's devices on the LAN. A running
/// daemon (`st`) reports whether mDNS is on and what it watches, and is
/// trusted; without one, the settings and the host decide (`facts`). `h`
/// is the home's display form.
pub fn check_mdns(h: &str, st: Option<&Status>, facts: MdnsFacts<'_>) -> Check {
    const NAME: &str = "mdns";
    if let Some(reason) = st.and_then(|st| st.mdns.error.as_deref()) {
        return Check::fail(
            NAME,
            format!(
                "FAILED in the running daemon, which was not told to switch it off: {reason}; \
                 no device on the LAN can find this one or be found by it"
            ),
            format!(
                "fix what the reason names (the daemon's log says it too, at start-up), then \
                 restart the daemon. The default --listen has the TCP address mDNS announces; \
                 an interface must be up with MULTICAST (`ip link`). No LAN discovery wanted: \
                 --no-mdns (or mdns = false under [discovery] in {h}/config.toml)"
            ),
        );
    }
    if st.is_some_and(|st| !st.mdns.enabled) {
        return Check::pass(
            NAME,
            "off in the running daemon (--no-mdns or `mdns = false`): devices on this LAN are \
             found only through --peer, known peers, the DHT or rendezvous",
        );
    }
    let reported = st.filter(|st| st.mdns.enabled);
    if reported.is_none() && !facts.on {
        return Check::pass(
            NAME,
            "off by configuration (--no-mdns or `mdns = false`): devices on this LAN are \
             found only through --peer, known peers, the DHT or rendezvous",
        );
    }
    let (watched, missing) = match reported {
        Some(st) => (st.mdns.interfaces.clone(), Vec::new()),
        None => match facts.watch {
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
    let selection = if facts.configured.is_empty() {
        "no interface but loopback is usable".to_owned()
    } else {
        format!(
            "none of --mdns-interface {} is up and usable",
            facts.configured.join(",")
        )
    };
    if watched.is_empty() {
        let detail = format!(
            "mDNS is on but watches nothing: {selection} (this host has: {}), so no device on the LAN can be found or find this one",
            facts.host_interfaces
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
        return if facts.other_sources > 0 {
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
                facts.host_interfaces
            ),
        );
    }
    Check::pass(NAME, format!("on, watching {}", watched.join(", ")))
}

/// `n` bytes as a person reads them: GiB with one decimal, else whole MiB.
pub fn human_bytes(n: u64) -> String {
    const GIB: u64 = 1024 * 1024 * 1024;
    const MIB: u64 = 1024 * 1024;
    if n >= GIB {
        format!("{:.1} GiB", n as f64 / GIB as f64)
    } else {
        format!("{:.0} MiB", n as f64 / MIB as f64)
    }
}

/// Whether the file system of the home (`h`, its display form) has room:
/// `free` is its free space, or why it cannot be read.
pub fn check_disk(h: &str, free: Result<u64, String>) -> Check {
    const NAME: &str = "disk";
    let free = match free {
        Ok(f) => f,
        Err(e) => {
            return Check::warn(
                NAME,
                format!("cannot read the free space of {h}: {e}"),
                format!("check by hand with `df -h {h}`"),
            );
        }
    };
    let detail = format!("{} free on the file system of {h}", human_bytes(free));
    let fix = format!(
        "free space on that file system (`df -h {h}` shows it); below 100 MiB writes may fail \
         and the store cannot grow"
    );
    if free < DISK_FAIL_BYTES {
        Check::fail(NAME, detail, fix)
    } else if free < DISK_WARN_BYTES {
        Check::warn(NAME, detail, fix)
    } else {
        Check::pass(NAME, detail)
    }
}

#[cfg(test)]
mod tests {
    //! The mDNS verdict over what a daemon reports or the host offers, and
    //! the disk thresholds.
    use super::*;
    use crate::diagnosis::Level;

    /// A daemon's status whose mDNS is `enabled` and watches `interfaces`.
    fn running(enabled: bool, interfaces: &[&str]) -> Status {
        failed(enabled, interfaces, None)
    }

    /// The same, with mDNS failed for `error`.
    fn failed(enabled: bool, interfaces: &[&str], error: Option<&str>) -> Status {
        serde_json::from_value(serde_json::json!({
            "agent_did": "did:key:z", "listen_addrs": [], "api_url": "http://127.0.0.1:1",
            "peers": [], "rejections": [], "counters": {}, "containers": [],
            "device": {"context_id": "c", "peer_id": "p", "name": "", "authorised": true,
                       "did_log_len": 1},
            "mdns": {"enabled": enabled, "interfaces": interfaces, "error": error},
        }))
        .expect("a status")
    }

    fn facts<'a>(
        on: bool,
        configured: &'a [String],
        other_sources: usize,
        watch: Result<(&[&str], &[&str]), &str>,
    ) -> MdnsFacts<'a> {
        let names = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        MdnsFacts {
            on,
            configured,
            other_sources,
            watch: watch
                .map(|(w, m)| (names(w), names(m)))
                .map_err(str::to_owned),
            host_interfaces: "eth0, lo".to_owned(),
        }
    }

    // Goal: each situation mDNS can be in gets its level and says why.
    // Method: a table of daemon reports, settings and host interfaces.
    #[test]
    fn mdns_verdicts() {
        let none: &[String] = &[];
        let named = ["wlan9".to_owned()];
        let up = running(true, &["eth0"]);
        let off = running(false, &[]);
        let blind = running(true, &[]);
        let broken = failed(false, &[], Some("no TCP listener came up"));
        let cases: Vec<(Option<&Status>, MdnsFacts<'_>, Level, &str)> = vec![
            (
                Some(&off),
                facts(true, none, 0, Ok((&[], &[]))),
                Level::Pass,
                "off in the running daemon",
            ),
            // Off but not by configuration: a failure, whatever the
            // settings and the host say.
            (
                Some(&broken),
                facts(true, none, 0, Ok((&["eth0"], &[]))),
                Level::Fail,
                "FAILED in the running daemon, which was not told to switch it off: no TCP \
                 listener came up",
            ),
            (
                Some(&broken),
                facts(true, none, 3, Ok((&["eth0"], &[]))),
                Level::Fail,
                "no TCP listener came up",
            ),
            (
                None,
                facts(false, none, 0, Err("no")),
                Level::Pass,
                "off by configuration",
            ),
            (
                Some(&up),
                facts(true, none, 0, Err("no")),
                Level::Pass,
                "on, watching eth0",
            ),
            (
                None,
                facts(true, none, 0, Ok((&["eth0"], &[]))),
                Level::Pass,
                "on, watching eth0",
            ),
            (
                None,
                facts(true, none, 0, Err("denied")),
                Level::Warn,
                "cannot list this host's network interfaces: denied",
            ),
            (
                None,
                facts(true, none, 0, Ok((&[], &[]))),
                Level::Fail,
                "no interface but loopback is usable (this host has: eth0, lo)",
            ),
            (
                Some(&blind),
                facts(true, none, 0, Ok((&["eth0"], &[]))),
                Level::Fail,
                "watches nothing",
            ),
            (
                None,
                facts(true, &named, 1, Ok((&[], &["wlan9"]))),
                Level::Warn,
                "none of --mdns-interface wlan9 is up",
            ),
            (
                None,
                facts(true, &named, 0, Ok((&["eth0"], &["wlan9"]))),
                Level::Warn,
                "configured interface(s) wlan9 are absent",
            ),
        ];
        for (st, f, level, detail) in cases {
            let c = check_mdns("/h", st, f);
            assert_eq!(c.status, level, "{detail}: {c:?}");
            assert!(c.detail.contains(detail), "{detail}: {c:?}");
            assert_eq!(
                c.fix.is_some(),
                level == Level::Warn || level == Level::Fail
            );
        }
    }

    // Goal: a daemon whose mDNS failed is a FAIL whose fix says how to
    // mend it and how to switch it off instead. Method: one failed status.
    #[test]
    fn a_failed_mdns_is_a_failure_with_its_fix() {
        let st = failed(false, &[], Some("no TCP listener came up"));
        let c = check_mdns("/h", Some(&st), facts(true, &[], 0, Ok((&["eth0"], &[]))));
        assert_eq!(c.status, Level::Fail, "{c:?}");
        let fix = c.fix.expect("a fix");
        for part in [
            "restart the daemon",
            "--listen",
            "MULTICAST",
            "--no-mdns",
            "/h/config.toml",
        ] {
            assert!(fix.contains(part), "fix lacks {part}: {fix}");
        }
    }

    // Goal: free space is shown as a person reads it, and judged against
    // the two thresholds. Method: sizes around each threshold.
    #[test]
    fn disk_thresholds_and_sizes() {
        assert_eq!(human_bytes(5 * 1024 * 1024), "5 MiB");
        assert_eq!(human_bytes(3 * 1024 * 1024 * 1024 / 2), "1.5 GiB");
        let cases = [
            (Ok(DISK_FAIL_BYTES - 1), Level::Fail),
            (Ok(DISK_FAIL_BYTES), Level::Warn),
            (Ok(DISK_WARN_BYTES - 1), Level::Warn),
            (Ok(DISK_WARN_BYTES), Level::Pass),
            (Err("gone".to_owned()), Level::Warn),
        ];
        for (free, level) in cases {
            let c = check_disk("/h", free.clone());
            assert_eq!(c.status, level, "{free:?}: {c:?}");
        }
        let c = check_disk("/h", Ok(DISK_WARN_BYTES));
        assert_eq!(c.detail, "1.0 GiB free on the file system of /h");
    }
}
