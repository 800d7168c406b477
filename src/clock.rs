//! The injected clock. The only module that reads the system clock or sleeps.
//!
//! Every timing decision in the relay (dead-man windows, grace windows, handshake deadlines,
//! booking TTLs, seat memory) takes its time from a [`Clock`], so tests drive them with a
//! [`ManualClock`] instead of waiting. Time is milliseconds since the Unix epoch; the system
//! clock is anchored once at start and then advanced by a monotonic `Instant`, so it never goes
//! backwards when the wall clock is stepped.

use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// A source of "now" in milliseconds since the Unix epoch, never decreasing.
pub trait Clock: Send + Sync + 'static {
    fn now_ms(&self) -> u64;

    /// Milliseconds on a monotonic clock with an arbitrary origin: for measuring this process's
    /// own gaps (the watchdog's tick gap after a pause), never for comparing with other
    /// machines or the database. It keeps running while the process is stopped.
    fn monotonic_ms(&self) -> u64;
}

/// A cheap-to-clone handle to a clock.
pub type SharedClock = Arc<dyn Clock>;

/// The real clock: wall time read once, then advanced monotonically.
pub struct SystemClock {
    anchor_wall_ms: u64,
    anchor: Instant,
    /// The test knob's offset ([`offset_system_clock`]): settable until the wall time is
    /// first read, fixed after.
    offset_ms: AtomicI64,
    read: AtomicBool,
}

impl SystemClock {
    pub fn new() -> Self {
        SystemClock::with_offset_ms(0)
    }

    /// The system clock moved by `offset_ms` (negative: behind). Only the test knob
    /// `ORCA_RELAY_TEST_CLOCK_OFFSET_MS` asks for one (see [`offset_system_clock`]).
    #[allow(clippy::disallowed_methods)] // the one place that reads the wall clock
    pub fn with_offset_ms(offset_ms: i64) -> Self {
        let wall_ms = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_millis() as u64)
            .unwrap_or(0);
        SystemClock {
            anchor_wall_ms: wall_ms,
            anchor: Instant::now(),
            offset_ms: AtomicI64::new(offset_ms),
            read: AtomicBool::new(false),
        }
    }
}

impl Default for SystemClock {
    fn default() -> Self {
        Self::new()
    }
}

impl Clock for SystemClock {
    #[allow(clippy::disallowed_methods)]
    fn now_ms(&self) -> u64 {
        self.read.store(true, Ordering::Relaxed);
        let offset_ms = self.offset_ms.load(Ordering::Relaxed);
        self.anchor_wall_ms.saturating_add_signed(offset_ms) + self.monotonic_ms()
    }

    /// `CLOCK_MONOTONIC` since the clock was made: it advances while the process is stopped
    /// (SIGSTOP), which is what lets the watchdog see its own pause.
    #[allow(clippy::disallowed_methods)]
    fn monotonic_ms(&self) -> u64 {
        self.anchor.elapsed().as_millis() as u64
    }
}

static SYSTEM: std::sync::OnceLock<Arc<SystemClock>> = std::sync::OnceLock::new();

/// The process-wide system clock.
pub fn system() -> SharedClock {
    SYSTEM.get_or_init(|| Arc::new(SystemClock::new())).clone()
}

/// Moves this process's wall clock by `offset_ms` for the rest of its life, as if the machine's
/// clock had been stepped before it started (the process anchors wall time once, so a step
/// during its life never reaches it). A test knob only (`ORCA_RELAY_TEST_CLOCK_OFFSET_MS`,
/// read by the role's start): the fault-injection test runs a process whose clock disagrees
/// with the database's and its peers'. Must run before anything reads the time of [`system`]
/// (taking the handle is fine: the configuration's service tokens do); an error when the time
/// was already read with another offset.
pub fn offset_system_clock(offset_ms: i64) -> Result<(), String> {
    let clock = SYSTEM.get_or_init(|| Arc::new(SystemClock::new()));
    if clock.read.load(Ordering::Relaxed) && clock.offset_ms.load(Ordering::Relaxed) != offset_ms {
        return Err(format!(
            "the system clock was read before its offset of {offset_ms} ms could be applied"
        ));
    }
    clock.offset_ms.store(offset_ms, Ordering::Relaxed);
    Ok(())
}

/// A clock that moves only when a test moves it.
#[derive(Debug, Default)]
pub struct ManualClock {
    ms: AtomicU64,
}

impl ManualClock {
    pub fn starting_at(ms: u64) -> Arc<Self> {
        Arc::new(ManualClock {
            ms: AtomicU64::new(ms),
        })
    }

    pub fn advance(&self, ms: u64) {
        self.ms.fetch_add(ms, Ordering::SeqCst);
    }

    pub fn set(&self, ms: u64) {
        self.ms.store(ms, Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now_ms(&self) -> u64 {
        self.ms.load(Ordering::SeqCst)
    }

    /// The same counter as [`ManualClock::now_ms`]: a test that advances the clock by a minute
    /// in one step looks to the watchdog like a one-minute pause.
    fn monotonic_ms(&self) -> u64 {
        self.ms.load(Ordering::SeqCst)
    }
}

/// Blocks the calling thread. Role threads wait on channels with timeouts instead wherever
/// something can wake them; this is for the few loops with nothing to wait on.
#[allow(clippy::disallowed_methods)]
pub fn sleep(duration: Duration) {
    std::thread::sleep(duration)
}

/// Milliseconds on the machine's monotonic clock (`CLOCK_MONOTONIC`, the clock [`instant`]
/// reads): one origin for every process of the machine, and a step of the wall clock (a time
/// sync, a suspended machine resumed) does not move it. For a time measured between two
/// processes of one machine (a live handover's travel); never compared across machines.
/// `None` if the kernel will not say (it always does on Linux).
pub fn machine_ms() -> Option<u64> {
    let mut now = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes only the timespec it is given, which lives for the call.
    let result = unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut now) };
    if result != 0 {
        return None;
    }
    let seconds = u64::try_from(now.tv_sec).ok()?;
    let nanos = u64::try_from(now.tv_nsec).ok()?;
    Some(
        seconds
            .saturating_mul(1_000)
            .saturating_add(nanos / 1_000_000),
    )
}

/// A monotonic instant for measuring short elapsed times (benchmarks, I/O deadlines).
#[allow(clippy::disallowed_methods)]
pub fn instant() -> Instant {
    Instant::now()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn manual_clock_moves_only_when_told() {
        let clock = ManualClock::starting_at(1_000);
        assert_eq!(clock.now_ms(), 1_000);
        clock.advance(250);
        assert_eq!(clock.now_ms(), 1_250);
        clock.set(5);
        assert_eq!(clock.now_ms(), 5);
    }

    #[test]
    fn an_offset_clock_runs_ahead_or_behind_by_its_offset() {
        let plain = SystemClock::new();
        let ahead = SystemClock::with_offset_ms(300_000);
        let behind = SystemClock::with_offset_ms(-300_000);
        let (p, a, b) = (
            plain.now_ms() as i64,
            ahead.now_ms() as i64,
            behind.now_ms() as i64,
        );
        assert!((a - p - 300_000).abs() < 1_000, "ahead by {}", a - p);
        assert!((p - b - 300_000).abs() < 1_000, "behind by {}", p - b);
    }

    #[test]
    fn the_machine_clock_is_the_monotonic_clock_of_instant() {
        let before = instant();
        let a = machine_ms().expect("CLOCK_MONOTONIC");
        sleep(Duration::from_millis(20));
        let b = machine_ms().expect("CLOCK_MONOTONIC");
        let took = before.elapsed().as_millis() as u64;
        assert!(b >= a + 19, "{a} then {b}");
        assert!(
            b - a <= took + 1,
            "{} ms on the machine clock, {took} ms on Instant",
            b - a
        );
    }

    #[test]
    fn system_clock_does_not_go_backwards() {
        let clock = system();
        let a = clock.now_ms();
        let b = clock.now_ms();
        assert!(b >= a);
        assert!(a > 1_600_000_000_000, "anchored to the wall clock");
    }
}
