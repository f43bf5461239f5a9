//! `doctor`'s verdicts, decided here and printed by the shell: one
//! [`Check`] per concern (pass, warn, fail or skip, with what to do), the
//! [`Report`] that says whether anything stops sync, and the checks that
//! are a judgement over the daemon's [`Status`] alone. The shell gathers
//! what it must read from the host (files, interfaces, disk) and builds the
//! other checks with the same type.

use std::path::Path;

use serde::Serialize;

use crate::status::Status;

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
