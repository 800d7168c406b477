//! The watchdog's own pause (SPEC §11 "Interrupted calls"): a stopped process (SIGSTOP, a
//! hypervisor pause, `docker pause`, `gdb -p`) hears nothing while it is stopped, so on resume
//! its last contact looks old even though the director polled the whole time. A gap in the
//! watchdog's own ticks tells that pause from the director's silence.
//!
//! Owns: the monotonic time of the last tick, and until when silence is not judged.
//! Runs on: the `watchdog` thread, which calls [`PauseGuard::observe`] with the monotonic clock
//! at every tick and skips the window's tick while [`Observed::judge_silence`] is false.
//! Must never: read a clock (time comes in), or hold off judging for longer than one grace
//! after a gap: a real director outage that spans a pause still trips or holds, one grace later.
//!
//! The rule: a gap between two ticks longer than [`GAP_TICKS`] tick periods is a pause of this
//! process. Contact then gets `resume_grace_ms` (one `FEED_POLL_MS`: the director's next poll)
//! from the moment the pause is seen before silence is judged again.

/// A tick gap longer than this many tick periods is this process's own pause. The watchdog
/// waits one period between ticks; a loaded machine delays a tick by a fraction of one.
pub const GAP_TICKS: u64 = 3;

/// What one tick should do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Observed {
    /// A pause was just detected: the gap since the previous tick (log it once).
    pub pause_gap_ms: Option<u64>,
    /// False while contact still has time to resume after a pause: the window must not judge
    /// silence on this tick.
    pub judge_silence: bool,
}

/// See the module header.
#[derive(Debug, Clone)]
pub struct PauseGuard {
    tick_ms: u64,
    resume_grace_ms: u64,
    last_tick_ms: Option<u64>,
    /// Silence is not judged before this monotonic instant.
    judge_from_ms: u64,
}

impl PauseGuard {
    /// A guard for ticks every `tick_ms`, giving contact `resume_grace_ms` after a pause.
    pub fn new(tick_ms: u64, resume_grace_ms: u64) -> PauseGuard {
        PauseGuard {
            tick_ms: tick_ms.max(1),
            resume_grace_ms,
            last_tick_ms: None,
            judge_from_ms: 0,
        }
    }

    /// The longest tick gap that is not a pause.
    pub fn threshold_ms(&self) -> u64 {
        self.tick_ms.saturating_mul(GAP_TICKS)
    }

    /// One tick at `monotonic_ms` (a monotonic clock: it runs on while the process is stopped).
    pub fn observe(&mut self, monotonic_ms: u64) -> Observed {
        let gap_ms = self
            .last_tick_ms
            .map(|last| monotonic_ms.saturating_sub(last));
        self.last_tick_ms = Some(monotonic_ms.max(self.last_tick_ms.unwrap_or(0)));
        let pause_gap_ms = gap_ms.filter(|gap| *gap > self.threshold_ms());
        if pause_gap_ms.is_some() {
            self.judge_from_ms = monotonic_ms.saturating_add(self.resume_grace_ms);
        }
        Observed {
            pause_gap_ms,
            judge_silence: monotonic_ms >= self.judge_from_ms,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::{Clock, ManualClock};

    const TICK: u64 = 1_000;
    const GRACE: u64 = 1_000;

    /// Ticks every `TICK` on `clock` for `ticks` ticks; returns what each tick observed.
    fn run(guard: &mut PauseGuard, clock: &ManualClock, ticks: usize) -> Vec<Observed> {
        (0..ticks)
            .map(|_| {
                clock.advance(TICK);
                guard.observe(clock.monotonic_ms())
            })
            .collect()
    }

    #[test]
    fn regular_and_late_ticks_judge_silence_as_usual() {
        let clock = ManualClock::starting_at(5_000);
        let mut guard = PauseGuard::new(TICK, GRACE);
        assert_eq!(
            guard.observe(clock.monotonic_ms()),
            Observed {
                pause_gap_ms: None,
                judge_silence: true
            },
            "the first tick has nothing to compare with"
        );
        assert!(run(&mut guard, &clock, 10)
            .iter()
            .all(|o| o.pause_gap_ms.is_none() && o.judge_silence));
        // A tick delayed to exactly three periods (a loaded machine) is not a pause.
        clock.advance(3 * TICK);
        assert_eq!(
            guard.observe(clock.monotonic_ms()),
            Observed {
                pause_gap_ms: None,
                judge_silence: true
            }
        );
    }

    #[test]
    fn a_gap_over_three_ticks_is_a_pause_and_silence_waits_one_grace() {
        let clock = ManualClock::starting_at(0);
        let mut guard = PauseGuard::new(TICK, GRACE);
        run(&mut guard, &clock, 3);
        // Stopped for 15 s.
        clock.advance(15_000);
        assert_eq!(
            guard.observe(clock.monotonic_ms()),
            Observed {
                pause_gap_ms: Some(15_000),
                judge_silence: false
            }
        );
        // 400 ms later (a tick the thread happened to run early): still within the grace.
        clock.advance(400);
        assert_eq!(
            guard.observe(clock.monotonic_ms()),
            Observed {
                pause_gap_ms: None,
                judge_silence: false
            }
        );
        // The grace is up: silence is judged again, and the pause is reported only once.
        clock.advance(600);
        assert_eq!(
            guard.observe(clock.monotonic_ms()),
            Observed {
                pause_gap_ms: None,
                judge_silence: true
            }
        );
        assert!(run(&mut guard, &clock, 5).iter().all(|o| o.judge_silence));
    }

    #[test]
    fn back_to_back_pauses_each_restart_the_grace() {
        let clock = ManualClock::starting_at(0);
        let mut guard = PauseGuard::new(TICK, GRACE);
        guard.observe(clock.monotonic_ms());
        clock.advance(10_000);
        assert_eq!(
            guard.observe(clock.monotonic_ms()).pause_gap_ms,
            Some(10_000)
        );
        clock.advance(5_000);
        let second = guard.observe(clock.monotonic_ms());
        assert_eq!(second.pause_gap_ms, Some(5_000));
        assert!(!second.judge_silence, "a new grace from the second resume");
        clock.advance(GRACE);
        assert!(guard.observe(clock.monotonic_ms()).judge_silence);
    }

    #[test]
    fn the_threshold_scales_with_short_test_ticks() {
        let mut guard = PauseGuard::new(200, 200);
        assert_eq!(guard.threshold_ms(), 600);
        guard.observe(0);
        assert_eq!(guard.observe(601).pause_gap_ms, Some(601));
        assert!(!guard.observe(700).judge_silence);
        assert!(guard.observe(801).judge_silence);
    }
}
