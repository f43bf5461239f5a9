//! `doctor`'s verdicts, decided here and printed by the shell: one
//! [`Check`] per concern (pass, warn, fail or skip, with what to do), the
//! [`Report`] that says whether anything stops sync, and every check's
//! judgement: here those over the daemon's [`Status`] (clock,
//! reachability, peers) and whether it answers; in `home` those over the
//! home's files and identity; in `host` those over the host's interfaces
//! and disk. The shell gathers what it must read (files, their modes,
//! interfaces, free space, the daemon's status) and hands it in.

use std::path::Path;

use serde::Serialize;

use crate::status::Status;

mod home;
mod host;

pub use home::{
    BackupRecord, HomeFile, HomeFound, MasterKeyFound, Mode, check_dht_pointer, check_home,
    check_master_key, check_recovery, is_admin, key_fingerprint, other_active_devices,
    pointer_bytes,
};
pub use host::{DISK_FAIL_BYTES, DISK_WARN_BYTES, MdnsFacts, check_disk, check_mdns, human_bytes};

/// A peer's clock offset above which `doctor` warns (sync still works up to
/// the replay window, but a drifting clock gets there).
pub const CLOCK_WARN_MS: i64 = 5_000;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Level {
    Pass,
    Warn,
    Fail,
    /// Not run: it needs something an earlier check found missing.
    Skip,
}

impl Level {
    pub fn label(self) -> &'static str {
        match self {
            Level::Pass => "PASS",
            Level::Warn => "WARN",
            Level::Fail => "FAIL",
            Level::Skip => "SKIP",
        }
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct Check {
    pub name: &'static str,
    pub status: Level,
    pub detail: String,
    /// What to do about a warning or a failure.
    pub fix: Option<String>,
}

impl Check {
    pub fn pass(name: &'static str, detail: impl Into<String>) -> Check {
        Check {
            name,
            status: Level::Pass,
            detail: detail.into(),
            fix: None,
        }
    }
    pub fn warn(name: &'static str, detail: impl Into<String>, fix: impl Into<String>) -> Check {
        Check {
            name,
            status: Level::Warn,
            detail: detail.into(),
            fix: Some(fix.into()),
        }
    }
    pub fn fail(name: &'static str, detail: impl Into<String>, fix: impl Into<String>) -> Check {
        Check {
            name,
            status: Level::Fail,
            detail: detail.into(),
            fix: Some(fix.into()),
        }
    }
    pub fn skip(name: &'static str, detail: impl Into<String>) -> Check {
        Check {
            name,
            status: Level::Skip,
            detail: detail.into(),
            fix: None,
        }
    }
}

#[derive(Debug, Serialize)]
pub struct Report {
    pub ok: bool,
    pub checks: Vec<Check>,
}

impl Report {
    pub fn new(checks: Vec<Check>) -> Report {
        Report {
            ok: checks.iter().all(|c| c.status != Level::Fail),
            checks,
        }
    }

    pub fn render(&self, home: &Path) -> String {
        let mut out = format!("nuwa-node doctor: home {}\n\n", home.display());
        for c in &self.checks {
            out.push_str(&format!(
                "{}  {:<12} {}\n",
                c.status.label(),
                c.name,
                c.detail
            ));
            if let Some(fix) = &c.fix {
                for (i, line) in fix.lines().enumerate() {
                    let lead = if i == 0 { "fix:" } else { "    " };
                    out.push_str(&format!("      {:<12} {lead} {line}\n", ""));
                }
            }
        }
        let count = |l: Level| self.checks.iter().filter(|c| c.status == l).count();
        out.push_str(&format!(
            "\n{} passed, {} warning(s), {} failed, {} skipped: {}\n",
            count(Level::Pass),
            count(Level::Warn),
            count(Level::Fail),
            count(Level::Skip),
            if self.ok {
                "no problem that stops sync"
            } else {
                "fix the failures above"
            }
        ));
        out
    }
}

/// The checks of a home that is not initialised: the home check, and every
/// other one skipped.
pub fn uninitialised(home: Check) -> Vec<Check> {
    let mut out = vec![home];
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
    out
}

/// Whether the settings (the file `config_file` under the flags given to
/// `doctor`) are valid: `problem` is the error that names the bad one.
pub fn check_config(config_file: &str, problem: Option<String>) -> Check {
    match problem {
        None => Check::pass(
            "config",
            format!("{config_file} and the flags given here are valid"),
        ),
        Some(e) => Check::fail(
            "config",
            e,
            format!(
                "correct the setting named above in {config_file} (or the flag); \
                 `nuwa-node run --help` lists every setting"
            ),
        ),
    }
}

/// Whether the daemon of home `h` runs and answers: its status, or why
/// not.
pub fn check_daemon(h: &str, status: Result<&Status, &str>) -> Check {
    match status {
        Ok(st) => Check::pass(
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
        ),
        Err(why) => Check::fail(
            "daemon",
            format!("not running: {why}"),
            format!(
                "start it with `nuwa-node --home {h} run`, or keep it running as a \
                 service with `nuwa-node --home {h} service install --user`"
            ),
        ),
    }
}

/// Whether peers' clocks agree with ours: a failure when sync is refused
/// for skew, a warning past [`CLOCK_WARN_MS`].
pub fn check_clock(st: &Status) -> Check {
    const NAME: &str = "clock";
    const NTP: &str = "enable NTP on the device whose clock is wrong (Linux: `timedatectl \
                       set-ntp true`; macOS: System Settings > General > Date & Time > Set \
                       automatically); compare `date -u` on both devices";
    if !st.clock_skew.is_empty() {
        let list: Vec<String> = st
            .clock_skew
            .iter()
            .map(|c| {
                format!(
                    "{} is {:+.1} s off (at most ±{} s is accepted)",
                    c.peer_id,
                    c.offset_ms as f64 / 1000.0,
                    c.window_ms / 1000
                )
            })
            .collect();
        return Check::fail(
            NAME,
            format!(
                "sync is refused with {} peer(s) for clock skew: {}",
                list.len(),
                list.join("; ")
            ),
            NTP,
        );
    }
    let Some(worst) = st
        .peers
        .iter()
        .max_by_key(|p| p.clock_offset_ms.unsigned_abs())
    else {
        return Check::pass(NAME, "no connected peer to compare clocks with");
    };
    let off = worst.clock_offset_ms;
    let who = peer_label(&worst.name, &worst.context_id);
    if off.unsigned_abs() > CLOCK_WARN_MS.unsigned_abs() {
        return Check::warn(
            NAME,
            format!(
                "{who}'s clock is {:+.1} s off this device's; sync stops beyond ±{} s",
                off as f64 / 1000.0,
                nuwa_sync::secure::REPLAY_WINDOW_SECS
            ),
            NTP,
        );
    }
    Check::pass(
        NAME,
        format!(
            "{} peer(s); largest offset {off:+} ms ({who})",
            st.peers.len()
        ),
    )
}

/// Whether anything outside this LAN can reach the device: keepers and
/// rendezvous servers connected, NAT, relays. `home` names the home in the
/// advice; `rendezvous_configured` is how many servers the settings name.
pub fn check_reachability(home: &str, st: &Status, rendezvous_configured: usize) -> Check {
    const NAME: &str = "reachability";
    let h = home;
    let down_keepers: Vec<&str> = st
        .keepers
        .iter()
        .filter(|k| !k.connected)
        .map(|k| k.peer_id.as_str())
        .collect();
    let down_rendezvous: Vec<&str> = st
        .rendezvous
        .iter()
        .filter(|r| !r.connected)
        .map(|r| r.address.as_str())
        .collect();
    if !down_keepers.is_empty() || !down_rendezvous.is_empty() {
        let mut what = Vec::new();
        if !down_keepers.is_empty() {
            what.push(format!(
                "keeper(s) not connected: {}",
                down_keepers.join(", ")
            ));
        }
        if !down_rendezvous.is_empty() {
            what.push(format!(
                "rendezvous server(s) not connected: {}",
                down_rendezvous.join(", ")
            ));
        }
        return Check::fail(
            NAME,
            what.join("; "),
            format!(
                "check that each runs (`nuwa-node rendezvous`, with --keeper for a keeper), \
                 that its address in --keeper / --rendezvous (or keepers / rendezvous_servers \
                 in {h}/config.toml) is right and ends in its /p2p/ id, and that this device \
                 can reach it (firewall, VPN); if the daemon started seconds ago, run doctor \
                 again"
            ),
        );
    }
    let nat = if st.reachability.nat.is_empty() {
        "unknown"
    } else {
        st.reachability.nat.as_str()
    };
    let mut ways = Vec::new();
    if nat == "public" {
        ways.push("reachable directly (AutoNAT)".to_owned());
    }
    if !st.reachability.relays.is_empty() {
        ways.push(format!(
            "{} relay reservation(s)",
            st.reachability.relays.len()
        ));
    }
    let keepers = st.keepers.iter().filter(|k| k.connected).count();
    if keepers > 0 {
        let pushed = st.keepers.iter().all(|k| k.pushed_all);
        ways.push(format!(
            "{keepers} keeper(s) connected{}",
            if pushed { ", everything pushed" } else { "" }
        ));
    }
    let rendezvous = st.rendezvous.iter().filter(|r| r.connected).count();
    let mut notes = Vec::new();
    if rendezvous > 0 {
        notes.push(format!("{rendezvous} rendezvous server(s) connected"));
    } else if rendezvous_configured > 0 && st.rendezvous.is_empty() {
        notes.push(format!(
            "{rendezvous_configured} rendezvous server(s) configured (this daemon does not \
             report whether it reached them)"
        ));
    }
    let advertised = if st.reachability.advertised.is_empty() {
        "nothing advertised".to_owned()
    } else {
        format!("advertises {}", st.reachability.advertised.join(", "))
    };
    notes.push(advertised);
    if ways.is_empty() {
        return Check::warn(
            NAME,
            format!(
                "nothing outside this LAN can reach this device: NAT {nat}, no relay \
                 reservation, no keeper ({})",
                notes.join("; ")
            ),
            format!(
                "fine when every device shares a LAN. Otherwise run an infrastructure node \
                 everyone can reach (`nuwa-node rendezvous --keeper` on a public host) and give \
                 its address to every device with --rendezvous MULTIADDR and --keeper \
                 MULTIADDR (or rendezvous_servers / keepers in {h}/config.toml)"
            ),
        );
    }
    Check::pass(
        NAME,
        format!("NAT {nat}; {}; {}", ways.join(", "), notes.join("; ")),
    )
}

/// Whether this device is a member and has verified peers.
/// `other_active_devices` is how many other active devices the DID
/// document lists, when the home could be read.
pub fn check_peers(home: &str, st: &Status, other_active_devices: Option<usize>) -> Check {
    const NAME: &str = "peers";
    let h = home;
    if !st.device.authorised {
        return Check::fail(
            NAME,
            format!(
                "this device ({}) is not an active member of the agent's DID document \
                 (revoked, or its pairing never finished); peers refuse it",
                st.device.context_id
            ),
            "if it was revoked, pair it again: a fresh home with `nuwa-node --home NEWDIR \
             pair`, approved on the device holding the master key",
        );
    }
    if st.peers.is_empty() && other_active_devices == Some(0) {
        return Check::warn(
            NAME,
            "no verified peer: this is the agent's only device, so there is nothing to sync \
             with yet",
            format!(
                "add a device: on it run `nuwa-node pair`, then here (or wherever the master \
                 key is) `nuwa-node --home {h} device approve CODE`"
            ),
        );
    }
    if st.peers.is_empty() {
        return Check::warn(
            NAME,
            "no verified peer: no other device of this agent is running, or discovery has not \
             found one yet",
            format!(
                "start the daemon on another device (`nuwa-node --home {h} device list` lists \
                 them); on one LAN, mDNS finds it (see the mdns check); elsewhere give its \
                 address with --peer MULTIADDR or a shared server with --rendezvous / \
                 --bootstrap"
            ),
        );
    }
    let names: Vec<String> = st
        .peers
        .iter()
        .map(|p| {
            format!(
                "{} ({}{})",
                peer_label(&p.name, &p.context_id),
                if p.relayed { "relayed " } else { "" },
                if p.transport.is_empty() {
                    "direct"
                } else {
                    &p.transport
                }
            )
        })
        .collect();
    Check::pass(
        NAME,
        format!("{} verified: {}", st.peers.len(), names.join(", ")),
    )
}

/// A peer as a person reads it: its name and context id, or the id.
pub fn peer_label(name: &str, context_id: &str) -> String {
    if name.is_empty() {
        context_id.to_owned()
    } else {
        format!("{name} ({context_id})")
    }
}

#[cfg(test)]
mod tests {
    //! The report's verdict and rendering.
    use super::*;

    #[test]
    fn verdict_is_no_failure() {
        let cases: &[(&[Level], bool)] = &[
            (&[Level::Pass, Level::Warn, Level::Skip], true),
            (&[Level::Pass, Level::Fail], false),
            (&[], true),
        ];
        for (levels, ok) in cases {
            let r = Report::new(
                levels
                    .iter()
                    .map(|l| Check {
                        name: "x",
                        status: *l,
                        detail: String::new(),
                        fix: None,
                    })
                    .collect(),
            );
            assert_eq!(r.ok, *ok, "{levels:?}");
        }
    }

    #[test]
    fn fix_lines_are_indented_under_their_check() {
        let r = Report::new(vec![Check::fail("mdns", "watches nothing", "a\nb")]);
        let text = r.render(Path::new("/h"));
        assert!(
            text.contains("FAIL  mdns         watches nothing\n"),
            "{text}"
        );
        assert!(text.contains(" fix: a\n"), "{text}");
        assert!(text.contains("      b\n"), "{text}");
    }
}
