//! The process's own pauses, seen process-wide (SPEC §13 "Liveness"): a process that was
//! stopped (SIGSTOP, a VM paused for migration, `docker pause`, a debugger) heard nothing
//! while it was stopped, and sent nothing either: its pings to desktops and splice legs stopped
//! with it. On resume every peer looks silent since before the stop. A process's own pause is
//! never blamed on a peer: whoever judges a peer's silence asks this clock first, and a peer
//! whose silence spans a pause is judged only once it has had a fresh ping and its answer time
//! ([`silent_in`]).
//!
//! Owns: the monotonic time of the `pause-clock` thread's last tick and of the end of the last
//! pause seen. Runs on: the `pause-clock` thread ticks every [`TICK`]; any thread may look
//! ([`PauseClock::ended_ago_ms`]). Never blocks, never takes a lock.
//!
//! A pause is seen two ways, whichever comes first on resume: the ticker finds a gap longer
//! than [`GAP_MS`] since its previous tick, or a thread that looks finds the ticker silent for
//! longer than that (the first thread the kernel runs after SIGCONT is often one whose deadline
//! passed during the stop, before the ticker has run). Either records "a pause ended now". A
//! ticker that a loaded machine delays past the gap counts as a pause too: its cost is one
//! resume grace, never a closed connection.
//!
//! The dead-man's watchdog keeps its own guard on its own ticks (`dead_man/pause.rs`): it is the
//! only judge of its silence and ticks anyway.

use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::clock::SharedClock;

/// How often the `pause-clock` thread ticks.
pub const TICK: Duration = Duration::from_millis(250);

/// A tick gap (or a ticker silent) longer than this is a pause of the process: four ticks, so a
/// tick that a busy machine delays by a few hundred milliseconds is not one. A shorter pause
/// needs no guard: a peer that answers every ping is silent at most one ping period plus its
/// round trip, far inside its window.
pub const GAP_MS: u64 = 1_000;

/// See the module header. Shared as an `Arc`; cheap to ask.
pub struct PauseClock {
    clock: SharedClock,
    /// The ticker's last tick (monotonic ms, plus one so that 0 means "no ticker runs": then no
    /// pause is ever seen, as in tests that run parts of a process in-process).
    last_tick: AtomicU64,
    /// When the last pause seen ended (monotonic ms, plus one; 0: none yet).
    last_end: AtomicU64,
}

impl PauseClock {
    pub fn new(clock: SharedClock) -> Arc<PauseClock> {
        Arc::new(PauseClock {
            clock,
            last_tick: AtomicU64::new(0),
            last_end: AtomicU64::new(0),
        })
    }

    /// Starts the `pause-clock` thread, which ticks for the rest of the process's life.
    pub fn start(self: &Arc<Self>) -> io::Result<()> {
        let this = self.clone();
        this.last_tick
            .store(this.clock.monotonic_ms() + 1, Ordering::Release);
        crate::threads::spawn("pause-clock", move || loop {
            crate::clock::sleep(TICK);
            this.tick();
        })
        .map(|_| ())
    }

    /// One tick of the ticker: a gap since the previous one is a pause, logged once.
    pub(crate) fn tick(&self) {
        let now = self.clock.monotonic_ms();
        let previous = self.last_tick.swap(now + 1, Ordering::AcqRel);
        let gap = now.saturating_sub(previous.saturating_sub(1));
        if previous != 0 && gap > GAP_MS {
            self.last_end.fetch_max(now + 1, Ordering::AcqRel);
            log::warn!(
                "orca_relay_process_pause_detected gap_ms={gap} note=peers_judged_after_a_fresh_ping"
            );
        }
    }

    /// How long ago (ms) the last pause of this process ended, if one was seen; a ticker silent
    /// past [`GAP_MS`] means the process is just resuming from one (or is starved), which ends
    /// now.
    pub fn ended_ago_ms(&self) -> Option<u64> {
        let now = self.clock.monotonic_ms();
        let last_tick = self.last_tick.load(Ordering::Acquire);
        if last_tick != 0 && now.saturating_sub(last_tick - 1) > GAP_MS {
            self.last_end.fetch_max(now + 1, Ordering::AcqRel);
        }
        match self.last_end.load(Ordering::Acquire) {
            0 => None,
            end => Some(now.saturating_sub(end - 1)),
        }
    }

    /// When (monotonic ms) the last pause of this process ended, if one was seen
    /// ([`PauseClock::ended_ago_ms`] on this clock's time line).
    pub fn ended_at_ms(&self) -> Option<u64> {
        self.ended_ago_ms()
            .map(|ago| self.clock.monotonic_ms().saturating_sub(ago))
    }
}

/// How long from now until a peer is judged silent: last heard `heard_ago_ms` ago, with a
/// window of `silence_ms`, when this process's last pause ended `pause_ended_ago_ms` ago. A
/// silence that spans the pause (the pause ended after the peer was last heard) is judged only
/// `resume_grace_ms` after the pause ended (a fresh ping and its answer time), and never
/// sooner than the window itself would; any other silence is judged by the window alone. 0:
/// silent now.
pub fn silent_in(
    heard_ago_ms: u64,
    silence_ms: u64,
    pause_ended_ago_ms: Option<u64>,
    resume_grace_ms: u64,
) -> u64 {
    let left = silence_ms.saturating_sub(heard_ago_ms);
    match pause_ended_ago_ms {
        Some(ago) if ago <= heard_ago_ms => left.max(resume_grace_ms.saturating_sub(ago)),
        _ => left,
    }
}

/// A control's resume grace: the pinger's next ping (at once after a pause longer than its
/// period, whose due time passed during it; at most one period later otherwise) and one period
/// for its answer, never more than the silence window itself.
pub fn control_resume_grace_ms(ping_ms: u64, silence_ms: u64) -> u64 {
    ping_ms.saturating_mul(2).min(silence_ms)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::{Clock, ManualClock};

    #[test]
    fn a_silence_within_the_running_time_is_judged_by_the_window() {
        // No pause: the window alone.
        assert_eq!(silent_in(0, 1_000, None, 500), 1_000);
        assert_eq!(silent_in(400, 1_000, None, 500), 600);
        assert_eq!(silent_in(1_000, 1_000, None, 500), 0);
        assert_eq!(silent_in(5_000, 1_000, None, 500), 0);
        // A pause that ended before the peer was last heard changes nothing.
        assert_eq!(silent_in(400, 1_000, Some(401), 500), 600);
        assert_eq!(silent_in(5_000, 1_000, Some(9_000), 500), 0);
    }

    #[test]
    fn a_silence_that_spans_a_pause_waits_for_a_fresh_ping_and_its_answer() {
        // Stopped 20 s: last heard 20.1 s ago, the pause ended just now.
        assert_eq!(silent_in(20_100, 1_000, Some(0), 500), 500);
        // 300 ms into the grace: 200 ms left.
        assert_eq!(silent_in(20_400, 1_000, Some(300), 500), 200);
        // The grace is up: silent now, as a peer that really went away must be.
        assert_eq!(silent_in(20_600, 1_000, Some(500), 500), 0);
        assert_eq!(silent_in(30_000, 1_000, Some(9_900), 500), 0);
        // A short pause early in the window: the window is longer than the grace.
        assert_eq!(silent_in(300, 75_000, Some(100), 30_000), 74_700);
    }

    #[test]
    fn the_control_grace_is_two_ping_periods_at_most_the_window() {
        assert_eq!(control_resume_grace_ms(15_000, 75_000), 30_000);
        assert_eq!(control_resume_grace_ms(250, 1_000), 500);
        assert_eq!(control_resume_grace_ms(1_000, 1_500), 1_500);
    }

    #[test]
    fn a_gap_in_the_ticks_or_a_silent_ticker_is_a_pause_ending_now() {
        let clock = ManualClock::starting_at(10_000);
        let pauses = PauseClock::new(clock.clone());
        // No ticker: no pause is ever seen.
        clock.advance(60_000);
        assert_eq!(pauses.ended_ago_ms(), None);
        pauses
            .last_tick
            .store(clock.monotonic_ms() + 1, Ordering::Release);
        for _ in 0..8 {
            clock.advance(250);
            pauses.tick();
        }
        assert_eq!(pauses.ended_ago_ms(), None, "regular ticks");
        // A tick late by exactly the gap is not a pause.
        clock.advance(GAP_MS);
        pauses.tick();
        assert_eq!(pauses.ended_ago_ms(), None);
        // Stopped 8 s; a thread looks before the ticker runs: the pause ends now.
        clock.advance(8_000);
        assert_eq!(pauses.ended_ago_ms(), Some(0));
        let seen_at = clock.monotonic_ms();
        clock.advance(5);
        pauses.tick();
        assert_eq!(
            pauses.ended_ago_ms(),
            Some(0),
            "the ticker's own view, 5 ms later"
        );
        clock.advance(300);
        pauses.tick();
        assert_eq!(pauses.ended_ago_ms(), Some(300));
        assert_eq!(pauses.ended_at_ms(), Some(seen_at + 5));
    }
}
