//! The process's panic hook. Automerge can panic on peer input; the state
//! layer catches those panics and poisons the container, but Rust's default
//! hook would still print the panic's message, which a peer controls, to
//! stderr, unbounded and as often as the peer likes. This hook writes one
//! line per panic through `tracing`: the message clipped to
//! [`MAX_MESSAGE_BYTES`] with control characters escaped, and at most
//! [`BURST`] lines per [`WINDOW`]; the rest are counted and reported in the
//! next line that is written. Nothing here may panic: a panic inside the
//! hook aborts the process.

use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Longest panic message written, in bytes.
pub const MAX_MESSAGE_BYTES: usize = 200;
/// Lines written per window.
pub const BURST: u32 = 5;
/// The rate-limit window.
pub const WINDOW: Duration = Duration::from_secs(60);

/// Installs the hook. Call once, early in `main`.
pub fn install() {
    let limiter = Mutex::new(Limiter::new(BURST, WINDOW));
    std::panic::set_hook(Box::new(move |info| {
        let message = info
            .payload()
            .downcast_ref::<&str>()
            .map(|s| (*s).to_owned())
            .or_else(|| info.payload().downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "(no message)".to_owned());
        let location = info
            .location()
            .map(|l| format!("{}:{}", l.file(), l.line()))
            .unwrap_or_default();
        let verdict = limiter
            .lock()
            .map(|mut l| l.admit(Instant::now()))
            .unwrap_or(Some(0));
        let Some(suppressed) = verdict else {
            return;
        };
        let line = clip(&message);
        let thread = std::thread::current();
        let thread = thread.name().unwrap_or("unnamed");
        if tracing::dispatcher::has_been_set() {
            tracing::error!(%location, thread, suppressed, message = %line, "panic");
        } else {
            // Not `eprintln!`: it panics when stderr is a closed pipe, and a
            // panic inside the panic hook aborts the process.
            crate::logging::stderr_line(format_args!(
                "panic at {location} (thread {thread}): {line}"
            ));
        }
    }));
}

/// The message with control characters escaped, clipped to
/// [`MAX_MESSAGE_BYTES`] on a character boundary.
pub fn clip(message: &str) -> String {
    let mut out = String::new();
    for c in message.chars() {
        let piece: String = if c.is_control() {
            c.escape_default().collect()
        } else {
            c.to_string()
        };
        if out.len() + piece.len() > MAX_MESSAGE_BYTES {
            out.push('…');
            break;
        }
        out.push_str(&piece);
    }
    out
}

/// At most `burst` admissions per `window`; counts what it refuses.
pub struct Limiter {
    burst: u32,
    window: Duration,
    started: Option<Instant>,
    admitted: u32,
    suppressed: u64,
}

impl Limiter {
    pub fn new(burst: u32, window: Duration) -> Self {
        Limiter {
            burst,
            window,
            started: None,
            admitted: 0,
            suppressed: 0,
        }
    }

    /// `Some(n)`: write a line, and say that `n` were suppressed since the
    /// last one. `None`: stay quiet.
    pub fn admit(&mut self, now: Instant) -> Option<u64> {
        if self
            .started
            .is_none_or(|s| now.duration_since(s) >= self.window)
        {
            self.started = Some(now);
            self.admitted = 0;
        }
        if self.admitted >= self.burst {
            self.suppressed += 1;
            return None;
        }
        self.admitted += 1;
        Some(std::mem::take(&mut self.suppressed))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // Goal: a peer-controlled panic message is written as one bounded line:
    // newlines and escape sequences cannot forge log lines or drive a
    // terminal, and a megabyte message becomes a couple of hundred bytes.
    #[test]
    fn messages_are_escaped_and_clipped() {
        let hostile = format!("boom\n\x1b[31mFAKE LOG LINE{}", "x".repeat(1 << 20));
        let line = clip(&hostile);
        assert!(!line.contains('\n') && !line.contains('\x1b'), "{line}");
        assert!(line.starts_with("boom\\n\\u{1b}[31mFAKE"), "{line}");
        assert!(line.len() <= MAX_MESSAGE_BYTES + '…'.len_utf8());
        assert_eq!(clip("short"), "short");
        // Clipping never splits a character.
        let wide = "é".repeat(300);
        assert!(clip(&wide).is_char_boundary(clip(&wide).len()));
    }

    // Goal: at most BURST lines per window; what was held back is counted
    // and reported with the next line once the window has passed.
    #[test]
    fn panics_are_rate_limited_and_the_rest_counted() {
        let t0 = Instant::now();
        let mut l = Limiter::new(3, Duration::from_secs(60));
        let written: Vec<Option<u64>> = (0..10).map(|_| l.admit(t0)).collect();
        assert_eq!(written.iter().filter(|w| w.is_some()).count(), 3);
        assert_eq!(l.admit(t0 + Duration::from_secs(59)), None);
        assert_eq!(l.admit(t0 + Duration::from_secs(61)), Some(8));
        assert_eq!(l.admit(t0 + Duration::from_secs(62)), Some(0));
    }
}
