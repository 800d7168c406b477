//! Logging to stderr for journald: one line per event, `LEVEL event key=value…`, and the
//! throttle that keeps a repeated failure to a few lines.
//!
//! Under systemd, when stderr is the journal stream (`JOURNAL_STREAM` names stderr's device
//! and inode, as systemd sets it), every line starts with its syslog priority `<N>` (error 3,
//! warn 4, info 6, debug and trace 7). journald strips the prefix and files the line at that
//! priority, so `journalctl -p warning` shows warnings and errors only. Elsewhere (a terminal,
//! a pipe, a test harness) there is no prefix.
//!
//! No timestamps by default when running under systemd (journald stamps every line); set
//! `ORCA_RELAY_LOG_TIMESTAMPS=1` to add them elsewhere.
//!
//! The filter is `RUST_LOG`, and `info` when it is unset **or empty** (SPEC §4: `''` is unset).
//! The packaged env files ship `RUST_LOG=`, which systemd passes on as `''`; `env_logger` reads
//! an empty filter as "errors only", so it never sees that value: [`log_filter`] decides.
//!
//! A line that ends the process (a refused configuration, a start that failed) is not a log
//! record: `main` and `cli` print it with [`print_fatal`], which under journald puts `<3>` in
//! front, so `journalctl -p err` shows why a unit failed to start.
//!
//! [`FailureThrottle`]: a failure that repeats (a director that does not answer heartbeats, a
//! cell whose feed cannot be polled, SQL that keeps failing) is logged on its first
//! occurrence, then at most once per [`REPEAT_LOG_INTERVAL_MS`] with the number of failures
//! since the last line (`repeats=N`), and once when it recovers. Time comes in as `now_ms`
//! from the caller's injected clock, so the throttle is tested without waiting.

use std::collections::HashMap;
use std::fmt;
use std::io::Write;
use std::sync::Mutex;

/// A repeated failure is logged at most this often after its first line (one minute).
pub const REPEAT_LOG_INTERVAL_MS: u64 = 60_000;

/// The syslog priority journald files a line of this level under (`sd-daemon.h`).
pub fn priority(level: log::Level) -> u8 {
    match level {
        log::Level::Error => 3,
        log::Level::Warn => 4,
        log::Level::Info => 6,
        log::Level::Debug | log::Level::Trace => 7,
    }
}

/// Whether `journal_stream` (the value of `JOURNAL_STREAM`, `<device>:<inode>`) names the
/// file stderr is open on, `stderr` being its `(device, inode)`. systemd passes the variable
/// on to children whose stderr may point elsewhere; only the journal itself gets prefixes.
pub fn is_journal_stream(journal_stream: &str, stderr: (u64, u64)) -> bool {
    let Some((device, inode)) = journal_stream.trim().split_once(':') else {
        return false;
    };
    matches!(
        (device.parse::<u64>(), inode.parse::<u64>()),
        (Ok(device), Ok(inode)) if (device, inode) == stderr
    )
}

/// `(device, inode)` of this process's stderr.
fn stderr_identity() -> Option<(u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    let metadata = std::fs::metadata("/proc/self/fd/2").ok()?;
    Some((metadata.dev(), metadata.ino()))
}

/// Whether this process logs to the journal (see the module header).
fn logs_to_journal() -> bool {
    match (set_variable("JOURNAL_STREAM"), stderr_identity()) {
        (Some(stream), Some(stderr)) => is_journal_stream(&stream, stderr),
        _ => false,
    }
}

/// The value of an environment variable the logging reads, `None` when it is unset or empty
/// (SPEC §4: `''` is unset, as for every variable `config.rs` reads).
fn set_variable(name: &str) -> Option<String> {
    std::env::var(name)
        .ok()
        .filter(|value| !value.trim().is_empty())
}

/// The filter when `RUST_LOG` is unset or empty.
pub const DEFAULT_FILTER: &str = "info";

/// The log filter for a `RUST_LOG` value: the value itself, or [`DEFAULT_FILTER`] when it is
/// unset, empty or blank.
pub fn log_filter(rust_log: Option<&str>) -> &str {
    match rust_log.map(str::trim) {
        Some(filter) if !filter.is_empty() => filter,
        _ => DEFAULT_FILTER,
    }
}

/// A line that ends the process, as printed: with the error priority `<3>` first when stderr
/// is the journal.
pub fn fatal_line(line: &str, journal: bool) -> String {
    if journal {
        format!("<{}>{line}", priority(log::Level::Error))
    } else {
        line.to_string()
    }
}

/// Prints a line that ends the process on stderr (see the module header). Works before
/// [`init`], for `main`'s own refusals.
pub fn print_fatal(line: &str) {
    eprintln!("{}", fatal_line(line, logs_to_journal()));
}

/// One log line without its newline: `[<N>][timestamp ]LEVEL message`.
pub fn format_line(
    level: log::Level,
    message: &fmt::Arguments<'_>,
    journal: bool,
    timestamp: Option<&dyn fmt::Display>,
) -> String {
    let mut line = String::new();
    if journal {
        line.push_str(&format!("<{}>", priority(level)));
    }
    if let Some(timestamp) = timestamp {
        line.push_str(&format!("{timestamp} "));
    }
    line.push_str(&format!("{level} {message}"));
    line
}

pub fn init() {
    let journal = logs_to_journal();
    let timestamps = set_variable("INVOCATION_ID").is_none()
        || set_variable("ORCA_RELAY_LOG_TIMESTAMPS").is_some_and(|v| v.trim() == "1");
    let mut builder = env_logger::Builder::new();
    builder.parse_filters(log_filter(set_variable("RUST_LOG").as_deref()));
    builder.format(move |buf, record| {
        let line = if timestamps {
            let ts = buf.timestamp_millis();
            format_line(record.level(), record.args(), journal, Some(&ts))
        } else {
            format_line(record.level(), record.args(), journal, None)
        };
        writeln!(buf, "{line}")
    });
    let _ = builder.try_init();
    crate::threads::install_panic_logger();
}

/// The once-a-minute limiter of one kind of repeated failure. See the module header.
///
/// Call [`FailureThrottle::failure`] on every failure and log only when it answers `Some`,
/// appending the answer to the line (empty on the first failure, ` repeats=N` after); call
/// [`FailureThrottle::success`] on every success and log the recovery line when it answers
/// `Some` (` failures=N`: how many failures the run had).
#[derive(Debug, Clone)]
pub struct FailureThrottle {
    interval_ms: u64,
    run: Option<FailureRun>,
}

#[derive(Debug, Clone, Copy)]
struct FailureRun {
    /// When the last line of this run was logged.
    logged_at_ms: u64,
    /// Failures since that line.
    unlogged: u64,
    /// Failures in the whole run.
    total: u64,
}

/// What to append to a failure line the throttle let through.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailureNote {
    /// The first failure of a run: nothing to add.
    First,
    /// A later line: `repeats` failures happened since the previous line (this one included).
    Repeated { repeats: u64 },
}

impl fmt::Display for FailureNote {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FailureNote::First => Ok(()),
            FailureNote::Repeated { repeats } => write!(f, " repeats={repeats}"),
        }
    }
}

/// What to append to the recovery line: the length of the run that ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecoveryNote {
    pub failures: u64,
}

impl fmt::Display for RecoveryNote {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, " failures={}", self.failures)
    }
}

impl Default for FailureThrottle {
    fn default() -> Self {
        FailureThrottle::new()
    }
}

impl FailureThrottle {
    /// A throttle with the production interval, [`REPEAT_LOG_INTERVAL_MS`].
    pub fn new() -> Self {
        FailureThrottle::with_interval(REPEAT_LOG_INTERVAL_MS)
    }

    pub fn with_interval(interval_ms: u64) -> Self {
        FailureThrottle {
            interval_ms,
            run: None,
        }
    }

    /// Whether the last call was a failure (a run is in progress).
    pub fn is_failing(&self) -> bool {
        self.run.is_some()
    }

    /// Records a failure at `now_ms`; `Some` when this one is to be logged.
    pub fn failure(&mut self, now_ms: u64) -> Option<FailureNote> {
        match &mut self.run {
            None => {
                self.run = Some(FailureRun {
                    logged_at_ms: now_ms,
                    unlogged: 0,
                    total: 1,
                });
                Some(FailureNote::First)
            }
            Some(run) => {
                run.total += 1;
                run.unlogged += 1;
                if now_ms.saturating_sub(run.logged_at_ms) < self.interval_ms {
                    return None;
                }
                let repeats = run.unlogged;
                run.logged_at_ms = now_ms;
                run.unlogged = 0;
                Some(FailureNote::Repeated { repeats })
            }
        }
    }

    /// Records a success; `Some` when it ends a run of failures (log the recovery once).
    pub fn success(&mut self) -> Option<RecoveryNote> {
        self.run.take().map(|run| RecoveryNote {
            failures: run.total,
        })
    }
}

/// [`FailureThrottle`]s keyed by what failed (a cell id, a director URL), shareable between
/// threads. The lock is held for the decision only: log after the call returns.
#[derive(Debug, Default)]
pub struct KeyedThrottle {
    throttles: Mutex<HashMap<String, FailureThrottle>>,
}

impl KeyedThrottle {
    pub fn new() -> Self {
        KeyedThrottle::default()
    }

    pub fn failure(&self, key: &str, now_ms: u64) -> Option<FailureNote> {
        let mut throttles = self.throttles.lock().unwrap_or_else(|e| e.into_inner());
        match throttles.get_mut(key) {
            Some(throttle) => throttle.failure(now_ms),
            None => {
                let mut throttle = FailureThrottle::new();
                let note = throttle.failure(now_ms);
                throttles.insert(key.to_string(), throttle);
                note
            }
        }
    }

    /// A success of `key`; forgets the key (nothing is kept for what works).
    pub fn success(&self, key: &str) -> Option<RecoveryNote> {
        let mut throttles = self.throttles.lock().unwrap_or_else(|e| e.into_inner());
        throttles
            .remove(key)
            .and_then(|mut throttle| throttle.success())
    }
}

/// One [`FailureThrottle`] shared between threads (every relay thread's admission SQL).
#[derive(Debug, Default)]
pub struct SharedThrottle(Mutex<FailureThrottle>);

impl SharedThrottle {
    pub fn new() -> Self {
        SharedThrottle::default()
    }

    pub fn failure(&self, now_ms: u64) -> Option<FailureNote> {
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .failure(now_ms)
    }

    pub fn success(&self) -> Option<RecoveryNote> {
        let mut throttle = self.0.lock().unwrap_or_else(|e| e.into_inner());
        // The common case (nothing failing) stays a read of one field under the lock.
        if !throttle.is_failing() {
            return None;
        }
        throttle.success()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::{Clock, ManualClock};

    #[test]
    fn an_unset_empty_or_blank_rust_log_is_the_default_filter() {
        assert_eq!(log_filter(None), "info");
        assert_eq!(log_filter(Some("")), "info");
        assert_eq!(log_filter(Some("  ")), "info");
        assert_eq!(log_filter(Some("warn")), "warn");
        assert_eq!(
            log_filter(Some(" orca_relay=debug,warn ")),
            "orca_relay=debug,warn"
        );
    }

    #[test]
    fn a_fatal_line_carries_the_error_priority_only_in_the_journal() {
        assert_eq!(
            fatal_line("orca-relay: invalid X=\"5\"", true),
            "<3>orca-relay: invalid X=\"5\""
        );
        assert_eq!(fatal_line("orca-relay: no", false), "orca-relay: no");
    }

    #[test]
    fn priorities_follow_syslog() {
        assert_eq!(priority(log::Level::Error), 3);
        assert_eq!(priority(log::Level::Warn), 4);
        assert_eq!(priority(log::Level::Info), 6);
        assert_eq!(priority(log::Level::Debug), 7);
        assert_eq!(priority(log::Level::Trace), 7);
    }

    #[test]
    fn journal_lines_start_with_the_priority() {
        let line = format_line(
            log::Level::Warn,
            &format_args!("orca_relay_x a=1"),
            true,
            None,
        );
        assert_eq!(line, "<4>WARN orca_relay_x a=1");
        let line = format_line(
            log::Level::Info,
            &format_args!("orca_relay_x"),
            false,
            Some(&"T"),
        );
        assert_eq!(line, "T INFO orca_relay_x");
        let line = format_line(log::Level::Error, &format_args!("e"), true, Some(&"T"));
        assert_eq!(line, "<3>T ERROR e");
    }

    #[test]
    fn the_journal_stream_must_name_stderr() {
        assert!(is_journal_stream("8:12345", (8, 12345)));
        assert!(is_journal_stream(" 8:12345\n", (8, 12345)));
        assert!(!is_journal_stream("8:12346", (8, 12345)));
        assert!(!is_journal_stream("9:12345", (8, 12345)));
        assert!(!is_journal_stream("", (8, 12345)));
        assert!(!is_journal_stream("8", (8, 12345)));
        assert!(!is_journal_stream("a:b", (8, 12345)));
    }

    /// A failure every second for five minutes, then recovery: the first line, then one line a
    /// minute carrying the failures since the previous line, then one recovery line.
    #[test]
    fn a_failure_every_second_is_logged_once_a_minute_with_a_count() {
        let clock = ManualClock::starting_at(1_000_000);
        let mut throttle = FailureThrottle::new();
        let mut lines = Vec::new();
        for second in 0..300u64 {
            if let Some(note) = throttle.failure(clock.now_ms()) {
                lines.push((second, note));
            }
            clock.advance(1_000);
        }
        assert_eq!(
            lines,
            vec![
                (0, FailureNote::First),
                (60, FailureNote::Repeated { repeats: 60 }),
                (120, FailureNote::Repeated { repeats: 60 }),
                (180, FailureNote::Repeated { repeats: 60 }),
                (240, FailureNote::Repeated { repeats: 60 }),
            ]
        );
        assert_eq!(lines[1].1.to_string(), " repeats=60");
        assert_eq!(lines[0].1.to_string(), "");
        assert_eq!(throttle.success(), Some(RecoveryNote { failures: 300 }));
        assert_eq!(throttle.success(), None, "the recovery is logged once");
        // The next failure starts a new run and is logged at once.
        assert_eq!(throttle.failure(clock.now_ms()), Some(FailureNote::First));
    }

    #[test]
    fn sparse_failures_are_each_logged_and_counted() {
        let clock = ManualClock::starting_at(0);
        let mut throttle = FailureThrottle::new();
        assert_eq!(throttle.failure(clock.now_ms()), Some(FailureNote::First));
        clock.advance(59_999);
        assert_eq!(throttle.failure(clock.now_ms()), None);
        clock.advance(1);
        assert_eq!(
            throttle.failure(clock.now_ms()),
            Some(FailureNote::Repeated { repeats: 2 }),
            "the one held back and this one"
        );
        clock.advance(600_000);
        assert_eq!(
            throttle.failure(clock.now_ms()),
            Some(FailureNote::Repeated { repeats: 1 })
        );
        assert_eq!(throttle.success(), Some(RecoveryNote { failures: 4 }));
    }

    #[test]
    fn keyed_throttles_are_independent_and_forget_what_works() {
        let clock = ManualClock::starting_at(0);
        let throttles = KeyedThrottle::new();
        assert_eq!(
            throttles.failure("c1", clock.now_ms()),
            Some(FailureNote::First)
        );
        assert_eq!(
            throttles.failure("c2", clock.now_ms()),
            Some(FailureNote::First)
        );
        clock.advance(1_000);
        assert_eq!(throttles.failure("c1", clock.now_ms()), None);
        assert_eq!(throttles.success("c2"), Some(RecoveryNote { failures: 1 }));
        assert_eq!(throttles.success("c2"), None);
        assert_eq!(throttles.success("c3"), None);
        clock.advance(60_000);
        assert_eq!(
            throttles.failure("c1", clock.now_ms()),
            Some(FailureNote::Repeated { repeats: 2 })
        );
    }

    #[test]
    fn a_shared_throttle_is_quiet_while_everything_works() {
        let throttle = SharedThrottle::new();
        assert_eq!(throttle.success(), None);
        assert_eq!(throttle.failure(5), Some(FailureNote::First));
        assert_eq!(throttle.failure(6), None);
        assert_eq!(throttle.success(), Some(RecoveryNote { failures: 2 }));
    }
}
