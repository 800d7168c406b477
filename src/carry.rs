//! Time carried across a live handover: timers travel as the time left, past moments as their
//! age, both measured when the running process took its snapshot, so the next process resumes
//! each timer where it was instead of starting it again at its full length.
//!
//! [`Snapshot`] is the sending side (its clock at the snapshot); [`Carry`] the receiving side
//! (its clock when it rebuilds, and how long the state travelled). Pure arithmetic over times
//! given by the caller, so both ends are tested without a clock.

use std::time::{Duration, Instant};

/// The moment a running process took its handover snapshot.
#[derive(Debug, Clone, Copy)]
pub struct Snapshot {
    /// Milliseconds since the Unix epoch (the process's `Clock`).
    pub now_ms: u64,
    /// The monotonic instant of the same moment.
    pub now: Instant,
}

impl Snapshot {
    /// The time left until `deadline_ms` (0 once passed).
    pub fn left_ms(&self, deadline_ms: u64) -> u64 {
        deadline_ms.saturating_sub(self.now_ms)
    }

    /// The time left until a monotonic `deadline` (0 once passed).
    pub fn left_of(&self, deadline: Instant) -> u64 {
        deadline.saturating_duration_since(self.now).as_millis() as u64
    }

    /// How long ago `at_ms` was (0 for a moment not yet come).
    pub fn age_ms(&self, at_ms: u64) -> u64 {
        self.now_ms.saturating_sub(at_ms)
    }
}

/// The receiving side: its clock when it rebuilds the state and how long the state travelled.
#[derive(Debug, Clone, Copy)]
pub struct Carry {
    pub now_ms: u64,
    pub now: Instant,
    /// Time between the snapshot and now, taken off every timer (at most the handover's limit).
    pub elapsed_ms: u64,
}

/// The longest a state may have travelled: the handover's own time limit.
pub const MAX_TRAVEL_MS: u64 = 10_000;

impl Carry {
    /// `snapshot_ms` is when the sender took the snapshot, by its clock; the difference with
    /// `now_ms` (both wall clocks of one machine) is the travel time, bounded to
    /// [0, [`MAX_TRAVEL_MS`]] so a stepped clock cannot expire or stretch every timer.
    pub fn new(now_ms: u64, now: Instant, snapshot_ms: u64) -> Carry {
        Carry {
            now_ms,
            now,
            elapsed_ms: now_ms.saturating_sub(snapshot_ms).min(MAX_TRAVEL_MS),
        }
    }

    /// The deadline (ms since the epoch) of a timer that had `left_ms` to run.
    pub fn deadline_ms(&self, left_ms: u64) -> u64 {
        self.now_ms + left_ms.saturating_sub(self.elapsed_ms)
    }

    /// The monotonic deadline of a timer that had `left_ms` to run.
    pub fn deadline(&self, left_ms: u64) -> Instant {
        self.now + Duration::from_millis(left_ms.saturating_sub(self.elapsed_ms))
    }

    /// The moment (ms since the epoch) that was `age_ms` old at the snapshot.
    pub fn moment_ms(&self, age_ms: u64) -> u64 {
        self.now_ms
            .saturating_sub(age_ms.saturating_add(self.elapsed_ms))
    }

    /// The monotonic instant that was `age_ms` old at the snapshot (now, if the process has
    /// not been up that long).
    pub fn instant_ago(&self, age_ms: u64) -> Instant {
        self.now
            .checked_sub(Duration::from_millis(
                age_ms.saturating_add(self.elapsed_ms),
            ))
            .unwrap_or(self.now)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timers_resume_with_the_time_left_less_the_travel() {
        let sent = Snapshot {
            now_ms: 1_000_000,
            now: crate::clock::instant(),
        };
        assert_eq!(sent.left_ms(1_004_000), 4_000);
        assert_eq!(sent.left_ms(999_000), 0);
        assert_eq!(sent.age_ms(990_000), 10_000);
        let carry = Carry::new(2_000_250, crate::clock::instant(), 2_000_000);
        assert_eq!(carry.elapsed_ms, 250);
        assert_eq!(carry.deadline_ms(4_000), 2_004_000);
        assert_eq!(
            carry.deadline_ms(100),
            2_000_250,
            "expired on the way: due now"
        );
        assert_eq!(carry.moment_ms(10_000), 1_990_000);
    }

    #[test]
    fn a_stepped_clock_is_bounded() {
        let backwards = Carry::new(1_000, crate::clock::instant(), 5_000);
        assert_eq!(backwards.elapsed_ms, 0);
        let far = Carry::new(1_000_000, crate::clock::instant(), 0);
        assert_eq!(far.elapsed_ms, MAX_TRAVEL_MS);
    }
}
