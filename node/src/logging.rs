//! Where the daemon's logs go: stderr (the default), or daily-rotated files
//! in a directory (`--log-file DIR`), as text or JSON lines.
//!
//! Logging must never take the daemon down. Under `run 2>&1 | tee log`, a
//! Ctrl-C kills `tee` with the daemon, so every later write to stderr fails
//! with EPIPE. tracing-subscriber reports a failed write with `eprintln!`,
//! which panics on that same broken stderr; the panic hook then logs the
//! panic through the same writer, panics again inside the hook, and Rust
//! aborts (exit 134, `api.json` left behind). So the stderr writer here
//! swallows write errors (there is nowhere left to report them), and
//! internal error reporting is off. File output goes through
//! `tracing-appender`'s non-blocking writer: a slow disk never holds the
//! daemon's loop, and the [`Guard`] flushes what is queued when it drops.

use std::io::{self, Write};
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use tracing_subscriber::Layer as _;
use tracing_subscriber::fmt::MakeWriter;
use tracing_subscriber::layer::SubscriberExt as _;
use tracing_subscriber::util::SubscriberInitExt as _;

/// Log files kept by default (one per day).
pub const DEFAULT_KEEP: usize = 7;
/// The name log files start with: `nuwa-node.YYYY-MM-DD.log`.
pub const FILE_PREFIX: &str = "nuwa-node";
/// The name log files end with.
pub const FILE_SUFFIX: &str = "log";

/// `--log-file`, `--log-keep`, `--log-format`.
#[derive(clap::Args, Debug, Clone, PartialEq, Eq)]
pub struct LogArgs {
    /// Write logs to daily-rotated files in DIR (created if missing) instead
    /// of stderr: DIR/nuwa-node.YYYY-MM-DD.log, the oldest deleted beyond
    /// --log-keep. `nuwa-node service install` uses HOME/logs.
    #[arg(long = "log-file", value_name = "DIR", env = "NUWA_LOG_FILE")]
    pub file: Option<PathBuf>,
    /// With --log-file: how many daily files to keep.
    #[arg(
        long = "log-keep",
        value_name = "N",
        env = "NUWA_LOG_KEEP",
        default_value_t = DEFAULT_KEEP,
        value_parser = parse_keep
    )]
    pub keep: usize,
    /// Log line format: `text` (human-readable) or `json` (one JSON object
    /// per line, for log collectors).
    #[arg(
        long = "log-format",
        value_name = "FORMAT",
        env = "NUWA_LOG_FORMAT",
        value_enum,
        default_value_t = Format::Text
    )]
    pub format: Format,
}

impl Default for LogArgs {
    /// Stderr, as text.
    fn default() -> Self {
        LogArgs {
            file: None,
            keep: DEFAULT_KEEP,
            format: Format::Text,
        }
    }
}

/// `--log-format`.
#[derive(clap::ValueEnum, Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Format {
    #[default]
    Text,
    Json,
}

fn parse_keep(s: &str) -> Result<usize, String> {
    match s.trim().parse::<usize>() {
        Ok(n) if (1..=1000).contains(&n) => Ok(n),
        _ => Err(format!(
            "{s:?} is not a number of log files to keep; use 1 to 1000"
        )),
    }
}

/// Keeps file logging alive: dropping it flushes what is still queued and
/// stops the writer thread. Hold it for the life of the daemon.
#[must_use = "dropping the guard stops file logging"]
pub struct Guard {
    _worker: Option<tracing_appender::non_blocking::WorkerGuard>,
}

/// Installs the global subscriber: `RUST_LOG` if set, else `default_level`;
/// output as `args` says. Call once.
pub fn init(args: &LogArgs, default_level: &str) -> Result<Guard> {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default_level));
    let (layer, worker) = match &args.file {
        Some(dir) => {
            let appender = file_appender(dir, args.keep)?;
            let (writer, worker) = tracing_appender::non_blocking(appender);
            (layer(args.format, writer, false), Some(worker))
        }
        None => {
            let ansi =
                args.format == Format::Text && std::io::IsTerminal::is_terminal(&std::io::stderr());
            (layer(args.format, QuietStderr, ansi), None)
        }
    };
    tracing_subscriber::registry()
        .with(layer.with_filter(filter))
        .try_init()
        .context("cannot install the logger (it was installed twice)")?;
    Ok(Guard { _worker: worker })
}

/// The daily-rotating appender over `dir`, which is created (mode 0700 under
/// the process's umask) if missing.
fn file_appender(
    dir: &Path,
    keep: usize,
) -> Result<tracing_appender::rolling::RollingFileAppender> {
    std::fs::create_dir_all(dir).with_context(|| {
        format!(
            "cannot create the log directory {}; choose another with --log-file DIR",
            dir.display()
        )
    })?;
    tracing_appender::rolling::Builder::new()
        .rotation(tracing_appender::rolling::Rotation::DAILY)
        .filename_prefix(FILE_PREFIX)
        .filename_suffix(FILE_SUFFIX)
        .max_log_files(keep)
        .build(dir)
        .with_context(|| {
            format!(
                "cannot open a log file in {}; check its permissions or choose another with --log-file DIR",
                dir.display()
            )
        })
}

type BoxedLayer = Box<dyn tracing_subscriber::Layer<tracing_subscriber::Registry> + Send + Sync>;

fn layer<W>(format: Format, writer: W, ansi: bool) -> BoxedLayer
where
    W: for<'w> MakeWriter<'w> + Send + Sync + 'static,
{
    // A failed write is reported with `eprintln!`, which panics when stderr
    // is the thing that failed: never report.
    let base = tracing_subscriber::fmt::layer()
        .with_writer(writer)
        .with_ansi(ansi)
        .log_internal_errors(false);
    match format {
        Format::Text => base.boxed(),
        Format::Json => base.json().boxed(),
    }
}

/// Stderr that drops what it cannot write: a closed pipe or a full disk
/// behind stderr loses log lines, never the daemon.
#[derive(Debug, Clone, Copy)]
pub struct QuietStderr;

impl Write for QuietStderr {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let _ = io::stderr().write_all(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        let _ = io::stderr().flush();
        Ok(())
    }
}

impl<'a> MakeWriter<'a> for QuietStderr {
    type Writer = QuietStderr;

    fn make_writer(&'a self) -> Self::Writer {
        QuietStderr
    }
}

/// `eprintln!` that cannot panic: for messages written while stderr may be
/// a closed pipe (errors at exit, the panic hook).
pub fn stderr_line(line: std::fmt::Arguments<'_>) {
    let mut err = io::stderr().lock();
    let _ = err.write_fmt(line);
    let _ = err.write_all(b"\n");
}

#[cfg(test)]
mod tests {
    use super::*;

    // Goal: --log-keep takes 1..=1000 and says what it wants otherwise.
    #[test]
    fn keep_is_bounded() {
        for (input, want) in [
            ("7", Ok(7)),
            ("1", Ok(1)),
            ("1000", Ok(1000)),
            ("0", Err(())),
            ("1001", Err(())),
            ("-1", Err(())),
            ("seven", Err(())),
        ] {
            let got = parse_keep(input).map_err(|e| {
                assert!(e.contains("1 to 1000"), "{e}");
            });
            assert_eq!(got, want, "{input}");
        }
    }
}
