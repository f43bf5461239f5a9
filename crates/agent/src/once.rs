//! How `sync --once` ended, as an outcome a script can tell apart, and the
//! waiting time its progress line shows.
//!
//! The agent decides the outcome ([`Outcome::of`]); the shell maps each
//! one to an exit status and prints it. What counts as converged is
//! decided in `report` (every verified peer in sync, or a keeper pulled to
//! its end with no other device online); this module only names the
//! ways it can end.

use serde::Serialize;

/// How often, at most, the progress line changes only to show the time
/// left (a person watching a long wait sees it move; a log gets a line).
pub const PROGRESS_EVERY_MS: u64 = 5_000;

/// How `sync --once` ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum Outcome {
    /// Converged with every verified peer, or through a keeper.
    Converged,
    /// No verified peer was reached before the timeout (none found, or
    /// every one found was refused): an outage, or discovery settings
    /// that find nobody.
    NoPeer,
    /// Peers were reached, but not all of them were in sync at the
    /// timeout: a slow or partial sync.
    Timeout,
    /// It could not start: a bad flag or setting, or a home that is
    /// missing or not usable. The agent never decides this one; the shell
    /// does, before there is an agent.
    Config,
}

impl Outcome {
    /// The outcome of a run that ended `converged` (or not) with
    /// `verified` peers verified at the end.
    pub fn of(converged: bool, verified: usize) -> Outcome {
        match (converged, verified) {
            (true, _) => Outcome::Converged,
            (false, 0) => Outcome::NoPeer,
            (false, _) => Outcome::Timeout,
        }
    }

    /// Its name in `--json` output and in the exit status table.
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Converged => "converged",
            Outcome::NoPeer => "no_peer",
            Outcome::Timeout => "timeout",
            Outcome::Config => "config",
        }
    }
}

/// A `sync --once` that did not converge: its outcome and what to tell
/// the person.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct Failed {
    pub outcome: Outcome,
    pub message: String,
}

impl crate::effect::OnceResult {
    /// `Ok` when converged, else the outcome and the message, for the
    /// shell to exit with.
    pub fn into_result(self) -> Result<(), Failed> {
        if self.converged {
            return Ok(());
        }
        Err(Failed {
            outcome: self.outcome,
            message: self.message,
        })
    }
}

/// `line` with the time left before `deadline_ms`, rounded up to whole
/// steps of [`PROGRESS_EVERY_MS`] (so "up to" stays true), so that an
/// unchanged state is said again every few seconds and not at every tick.
pub fn with_time_left(mut line: String, now_ms: u64, deadline_ms: u64) -> String {
    let left_ms = deadline_ms.saturating_sub(now_ms);
    let step_ms = left_ms.div_ceil(PROGRESS_EVERY_MS) * PROGRESS_EVERY_MS;
    line.push_str(&format!("  (waiting, up to {} s left)", step_ms / 1000));
    line
}

#[cfg(test)]
mod tests {
    use super::*;

    // Goal: each way `sync --once` ends has its own outcome: converged,
    // no verified peer at all, or peers but not all in sync. Method: one
    // table over (converged, verified peers).
    #[test]
    fn outcomes() {
        let check = |converged, verified, want: Outcome| {
            assert_eq!(
                Outcome::of(converged, verified),
                want,
                "{converged} {verified}"
            );
        };
        check(true, 2, Outcome::Converged);
        // Through a keeper, with no other device online.
        check(true, 0, Outcome::Converged);
        check(false, 0, Outcome::NoPeer);
        check(false, 1, Outcome::Timeout);
        check(false, 3, Outcome::Timeout);
        assert_eq!(Outcome::NoPeer.as_str(), "no_peer");
        assert_eq!(
            serde_json::to_value(Outcome::Timeout).unwrap(),
            serde_json::json!("timeout")
        );
    }

    // Goal: the time left moves in steps of PROGRESS_EVERY_MS, so the line
    // (said when it changes) is said again every few seconds of a wait,
    // not at every tick. Method: the line at points through a 60 s wait.
    #[test]
    fn time_left_moves_every_few_seconds() {
        let at = |now| with_time_left("peers verified: 0".to_owned(), now, 60_000);
        assert_eq!(at(0), "peers verified: 0  (waiting, up to 60 s left)");
        assert_eq!(at(1), "peers verified: 0  (waiting, up to 60 s left)");
        assert_eq!(at(4_999), at(1));
        assert_eq!(at(5_001), "peers verified: 0  (waiting, up to 55 s left)");
        assert_eq!(at(59_999), "peers verified: 0  (waiting, up to 5 s left)");
        assert_eq!(at(70_000), "peers verified: 0  (waiting, up to 0 s left)");
        let lines: std::collections::BTreeSet<String> = (0..60_000).step_by(200).map(at).collect();
        assert_eq!(lines.len(), 12, "one line per 5 s of a 60 s wait");
        // A timeout that is no multiple of 5 s: never less than is left.
        let short = |now| with_time_left(String::new(), now, 6_500);
        assert_eq!(short(0), "  (waiting, up to 10 s left)");
        assert_eq!(short(1_499), "  (waiting, up to 10 s left)");
        assert_eq!(short(1_500), "  (waiting, up to 5 s left)");
    }
}
