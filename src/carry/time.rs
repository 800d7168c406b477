//! Time carried across a live handover: timers travel as the time left, past moments as their
//! age, both measured when the running process took its snapshot, so the next process resumes
//! each timer where it was instead of starting it again at its full length.
//!
//! [`Snapshot`] is the sending side (its clock at the snapshot); [`Carry`] the receiving side
//! (its clock when it rebuilds, and how long the state travelled). Pure arithmetic over times
//! given by the caller, so both ends are tested without a clock.
//!
//! Ages and times left are each measured on one process's clock, so they mean the same in the
//! next one. Only the travel compares the two processes, and their `Clock`s may disagree: each
//! anchored the wall clock when it started, so a step of the wall clock between the two starts
//! (a time sync, a machine suspended and resumed) is a difference between them. The travel is
//! therefore measured on the machine's monotonic clock, which both read ([`Stamp::since`]).

use std::time::{Duration, Instant};

/// The farthest a carried monotonic deadline is put (a longer time left, which no timer of the
/// relay has, is read as this).
const FAR: Duration = Duration::from_secs(365 * 24 * 3600);

/// The moment a running process took its handover snapshot.
#[derive(Debug, Clone, Copy)]
pub struct Snapshot {
    /// Milliseconds since the Unix epoch (the process's `Clock`).
    pub now_ms: u64,
    /// The monotonic instant of the same moment.
    pub now: Instant,
    /// The machine's monotonic clock at the same moment ([`crate::clock::machine_ms`]).
    pub machine_ms: Option<u64>,
}

/// A moment as two processes of one machine can compare it; the document carries the
/// snapshot's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stamp {
    /// Milliseconds since the Unix epoch, by the process's `Clock`.
    pub wall_ms: u64,
    /// The machine's monotonic clock ([`crate::clock::machine_ms`]); `None` when not known (a
    /// giver that did not send it).
    pub machine_ms: Option<u64>,
}

impl Stamp {
    /// How long after `earlier` this moment is: on the machine's monotonic clock when both
    /// have it (the same clock in both processes, which a wall-clock step does not move), else
    /// the difference of the two processes' wall clocks (0 if it is negative).
    pub fn since(&self, earlier: &Stamp) -> u64 {
        match (self.machine_ms, earlier.machine_ms) {
            (Some(now), Some(then)) => now.saturating_sub(then),
            _ => self.wall_ms.saturating_sub(earlier.wall_ms),
        }
    }
}

impl Snapshot {
    /// The snapshot's moment, for the document.
    pub fn stamp(&self) -> Stamp {
        Stamp {
            wall_ms: self.now_ms,
            machine_ms: self.machine_ms,
        }
    }

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
    /// `here` is this process's moment (`now` its instant), `sent` the snapshot's: the travel
    /// time is `here.since(sent)`, bounded to [0, [`MAX_TRAVEL_MS`]] so that even a travel
    /// measured on two wall clocks (a giver that sent no machine reading) cannot expire or
    /// stretch every timer by more than the handover's limit.
    pub fn new(now: Instant, here: Stamp, sent: Stamp) -> Carry {
        Carry {
            now_ms: here.wall_ms,
            now,
            elapsed_ms: here.since(&sent).min(MAX_TRAVEL_MS),
        }
    }

    /// The deadline (ms since the epoch) of a timer that had `left_ms` to run.
    pub fn deadline_ms(&self, left_ms: u64) -> u64 {
        self.now_ms
            .saturating_add(left_ms.saturating_sub(self.elapsed_ms))
    }

    /// The monotonic deadline of a timer that had `left_ms` to run.
    pub fn deadline(&self, left_ms: u64) -> Instant {
        let left = Duration::from_millis(left_ms.saturating_sub(self.elapsed_ms));
        // A time left no timer could have is a year: far, and no overflow.
        self.now.checked_add(left.min(FAR)).unwrap_or(self.now)
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

    /// A moment known only by its wall clock (a giver that sent no machine reading).
    fn wall(wall_ms: u64) -> Stamp {
        Stamp {
            wall_ms,
            machine_ms: None,
        }
    }

    #[test]
    fn timers_resume_with_the_time_left_less_the_travel() {
        let sent = Snapshot {
            now_ms: 1_000_000,
            now: crate::clock::instant(),
            machine_ms: Some(70_000),
        };
        assert_eq!(sent.left_ms(1_004_000), 4_000);
        assert_eq!(sent.left_ms(999_000), 0);
        assert_eq!(sent.age_ms(990_000), 10_000);
        let here = Stamp {
            wall_ms: 2_000_250,
            machine_ms: Some(70_250),
        };
        let carry = Carry::new(crate::clock::instant(), here, sent.stamp());
        assert_eq!(carry.elapsed_ms, 250);
        assert_eq!(carry.deadline_ms(4_000), 2_004_000);
        assert_eq!(
            carry.deadline_ms(100),
            2_000_250,
            "expired on the way: due now"
        );
        assert_eq!(carry.moment_ms(10_000), 1_990_000);
    }

    /// The next process anchored its wall clock after a step (13 s ahead here, as a nemesis run
    /// saw on a starved machine): the travel is what the machine's monotonic clock says, so a
    /// moment keeps its age. Before, the travel was the difference of the two wall clocks
    /// (bounded to 10 s), added to every age: a dead-man silence of 1.1 s came up 11.1 s.
    #[test]
    fn the_travel_is_measured_on_the_machine_clock_not_the_two_wall_clocks() {
        let sent = Stamp {
            wall_ms: 1_000_000,
            machine_ms: Some(500_000),
        };
        let here = Stamp {
            wall_ms: 1_013_200,
            machine_ms: Some(500_200),
        };
        let carry = Carry::new(crate::clock::instant(), here, sent);
        assert_eq!(carry.elapsed_ms, 200);
        assert_eq!(carry.moment_ms(1_100), 1_013_200 - 1_300, "1.3 s silent");
        let behind = Stamp {
            wall_ms: 900_000,
            machine_ms: Some(500_200),
        };
        assert_eq!(
            Carry::new(crate::clock::instant(), behind, sent).elapsed_ms,
            200
        );
    }

    /// The time left comes from the other process's document: a value no timer could have
    /// (u64::MAX) is a far deadline, not an overflow. Before: `deadline_ms` panicked
    /// ("attempt to add with overflow"; a release build wrapped it to a deadline in the past).
    #[test]
    fn a_time_left_from_the_document_never_overflows() {
        let carry = Carry::new(crate::clock::instant(), wall(2_000_250), wall(2_000_000));
        assert_eq!(carry.deadline_ms(u64::MAX), u64::MAX);
        assert!(carry.deadline(u64::MAX) > carry.now);
    }

    /// Without the giver's machine reading the wall clocks are all there is: a step is bounded.
    #[test]
    fn a_stepped_clock_is_bounded() {
        let backwards = Carry::new(crate::clock::instant(), wall(1_000), wall(5_000));
        assert_eq!(backwards.elapsed_ms, 0);
        let far = Carry::new(crate::clock::instant(), wall(1_000_000), wall(0));
        assert_eq!(far.elapsed_ms, MAX_TRAVEL_MS);
        let machine_far = Stamp {
            wall_ms: 1_000,
            machine_ms: Some(u64::MAX),
        };
        let machine_sent = Stamp {
            wall_ms: 1_000,
            machine_ms: Some(0),
        };
        assert_eq!(
            Carry::new(crate::clock::instant(), machine_far, machine_sent).elapsed_ms,
            MAX_TRAVEL_MS
        );
    }
}
