//! The per-worker deadline heap, and the pure decisions of the splice workers.
//!
//! Owns: [`Timers`], a min-heap of (due, leg key, kind). Each leg has at most one live entry
//! per [`TimerKind`] (the leg remembers whether one is armed), so the heap never holds more
//! than two entries per leg however often its output makes progress: progress only moves the
//! leg's own `last_progress`, and a due entry re-checks it ([`wedge_due`]) and is pushed again
//! for the rest of the window instead. Stale entries (a leg that ended; a slot reused) are
//! told apart by the key's generation and dropped when they come due.
//!
//! Runs on: the worker thread that owns it. Never reads the clock: "now" is passed in (the
//! worker takes it from the injected clock), so the tests below are plain arithmetic.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

/// What a timer is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum TimerKind {
    /// The leg has pending output: if it makes no progress for the wedge window, its pair
    /// is closed 4429 (SPEC §5.2).
    Wedge,
    /// The leg sent its close frame and has nothing left to write: drop the TCP connection if
    /// the peer has not closed it by then (SPEC §5.2: within 1 s).
    Linger,
    /// Nothing may have arrived on the leg for a while: ping it, or close it as gone
    /// ([`idle_step`]).
    Idle,
    /// The leg holds a lease of the buffer budget: give it back once its last read that took
    /// all it was allowed is [`super::worker`]'s `LEASE_KEPT_MS` old and what it holds is
    /// ordinary again. The one place a lease goes back (a leg that went quiet after a burst
    /// reads no more, so only a timer sees that).
    Lease,
}

/// A leg's identity in its worker: its slot and that slot's generation, so a timer armed for a
/// leg that has since ended cannot fire on the slot's next tenant.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct LegKey {
    pub slot: u32,
    pub generation: u32,
}

/// A min-heap of deadlines in milliseconds.
#[derive(Debug, Default)]
pub struct Timers {
    heap: BinaryHeap<Reverse<(u64, LegKey, TimerKind)>>,
}

impl Timers {
    pub fn new() -> Timers {
        Timers::default()
    }

    pub fn schedule(&mut self, due_ms: u64, key: LegKey, kind: TimerKind) {
        self.heap.push(Reverse((due_ms, key, kind)));
    }

    /// The earliest deadline, if any.
    pub fn next_due(&self) -> Option<u64> {
        self.heap.peek().map(|Reverse((due, _, _))| *due)
    }

    /// Removes and returns one entry due at `now_ms` or earlier, earliest first.
    pub fn pop_due(&mut self, now_ms: u64) -> Option<(LegKey, TimerKind)> {
        match self.heap.peek() {
            Some(Reverse((due, _, _))) if *due <= now_ms => {
                self.heap.pop().map(|Reverse((_, key, kind))| (key, kind))
            }
            _ => None,
        }
    }

    /// When `key`'s live timer of `kind` is due, if one is scheduled (a linear scan: only a
    /// handover's export asks).
    pub fn due_of(&self, key: LegKey, kind: TimerKind) -> Option<u64> {
        self.heap
            .iter()
            .filter(|Reverse((_, k, t))| *k == key && *t == kind)
            .map(|Reverse((due, _, _))| *due)
            .min()
    }

    pub fn len(&self) -> usize {
        self.heap.len()
    }

    pub fn is_empty(&self) -> bool {
        self.heap.is_empty()
    }
}

/// When a leg with pending output is wedged: `wedge_ms` after its last write progress (or
/// after the output first waited, whichever is later). A write that moves any byte restarts
/// the window, as the socket send timeout of the thread-per-leg relay did.
pub fn wedge_due(last_progress_ms: u64, wedge_ms: u64) -> u64 {
    last_progress_ms.saturating_add(wedge_ms)
}

/// What the idle timer of a leg does when it comes due.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IdleStep {
    /// Heard from recently: look again at `until`.
    Wait { until: u64 },
    /// Quiet for half the window: the relay pings the leg (any endpoint answers a ping with a
    /// pong, RFC 6455 §5.5.2), and looks again at `then`, the end of the window.
    Ping { then: u64 },
    /// Nothing at all arrived for the whole window, the answer to the relay's ping included,
    /// and the socket took nothing of an unfinished frame: the leg is gone.
    Silent,
}

/// The idle decision for a leg last heard from at `last_heard_ms` (its last byte arrived, or its
/// socket took more of an unfinished frame), with the relay's own ping already queued
/// (`pinged`) or not, an idle window of `idle_ms`, at `now_ms`. Half the window without hearing
/// from it brings the relay's ping; the whole window, the close. So a session that is idle but
/// present survives whatever its own keepalive (an endpoint that answers pings needs none), one
/// whose endpoint vanished or stopped reading is closed within `idle_ms`, and one reading a
/// frame longer than the window (the ping waits behind it) is heard from all along.
pub fn idle_step(last_heard_ms: u64, pinged: bool, idle_ms: u64, now_ms: u64) -> IdleStep {
    let half = last_heard_ms.saturating_add(idle_ms / 2);
    let end = last_heard_ms.saturating_add(idle_ms);
    if now_ms >= end {
        IdleStep::Silent
    } else if now_ms >= half && !pinged {
        IdleStep::Ping { then: end }
    } else if now_ms >= half {
        IdleStep::Wait { until: end }
    } else {
        IdleStep::Wait { until: half }
    }
}

/// A leg's idle bookkeeping (when it was last heard from and whether the relay's ping is out)
/// once this process's last pause, ended at `pause_end_ms`, is taken into account: a silence
/// that spans the pause (the pause ended after it was last heard from) did not happen while the process ran, so
/// the leg is judged as if it had been quiet for half the window when the pause ended: the
/// relay's ping goes out at once and the leg has the other half to answer it. Any other leg is
/// as it was. (Without it a quiet pair that answers every ping was closed 4408 on SIGCONT.)
pub fn after_pause(
    last_heard_ms: u64,
    pinged: bool,
    pause_end_ms: Option<u64>,
    idle_ms: u64,
) -> (u64, bool) {
    match pause_end_ms {
        Some(end) if end >= last_heard_ms => {
            let judged_from = end.saturating_sub(idle_ms / 2).max(last_heard_ms);
            if judged_from > last_heard_ms {
                (judged_from, false)
            } else {
                (last_heard_ms, pinged)
            }
        }
        _ => (last_heard_ms, pinged),
    }
}

/// Whether a leg may be read now: only while its peer's pending output is under `bound`.
/// Above it, reading stops until the peer is writable again and drains below the bound, so a
/// reader that does not read slows only the leg that sends to it (backpressure per direction).
pub fn may_read(peer_pending_bytes: usize, bound: usize) -> bool {
    peer_pending_bytes < bound
}

/// The worker a new pair goes to: the one with the fewest legs (the first on a tie).
pub fn least_loaded(legs_per_worker: &[usize]) -> usize {
    legs_per_worker
        .iter()
        .enumerate()
        .min_by_key(|(index, legs)| (**legs, *index))
        .map_or(0, |(index, _)| index)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(slot: u32) -> LegKey {
        LegKey {
            slot,
            generation: 1,
        }
    }

    #[test]
    fn timers_come_due_earliest_first_and_not_before_their_time() {
        let mut timers = Timers::new();
        timers.schedule(300, key(3), TimerKind::Wedge);
        timers.schedule(100, key(1), TimerKind::Linger);
        timers.schedule(200, key(2), TimerKind::Wedge);
        assert_eq!(timers.next_due(), Some(100));
        assert_eq!(timers.pop_due(99), None);
        assert_eq!(timers.pop_due(250), Some((key(1), TimerKind::Linger)));
        assert_eq!(timers.pop_due(250), Some((key(2), TimerKind::Wedge)));
        assert_eq!(timers.pop_due(250), None);
        assert_eq!(timers.next_due(), Some(300));
        assert_eq!(timers.pop_due(300), Some((key(3), TimerKind::Wedge)));
        assert!(timers.is_empty());
        assert_eq!(timers.next_due(), None);
    }

    #[test]
    fn equal_deadlines_all_come_due() {
        let mut timers = Timers::new();
        for slot in 0..5 {
            timers.schedule(50, key(slot), TimerKind::Wedge);
        }
        let mut fired = Vec::new();
        while let Some((key, _)) = timers.pop_due(50) {
            fired.push(key.slot);
        }
        fired.sort();
        assert_eq!(fired, vec![0, 1, 2, 3, 4]);
    }

    #[test]
    fn the_wedge_window_restarts_with_each_progress() {
        assert_eq!(wedge_due(1_000, 10_000), 11_000);
        assert_eq!(wedge_due(5_000, 10_000), 15_000);
        assert_eq!(wedge_due(u64::MAX - 1, 10_000), u64::MAX);
    }

    #[test]
    fn a_quiet_leg_is_pinged_at_half_the_window_and_closed_at_its_end() {
        let idle = 120_000;
        assert_eq!(
            idle_step(1_000, false, idle, 30_000),
            IdleStep::Wait { until: 61_000 }
        );
        assert_eq!(
            idle_step(1_000, false, idle, 61_000),
            IdleStep::Ping { then: 121_000 }
        );
        assert_eq!(
            idle_step(1_000, true, idle, 61_000),
            IdleStep::Wait { until: 121_000 }
        );
        assert_eq!(idle_step(1_000, true, idle, 121_000), IdleStep::Silent);
        assert_eq!(idle_step(1_000, false, idle, 500_000), IdleStep::Silent);
        // A byte that arrived after the ping starts the window again.
        assert_eq!(
            idle_step(100_000, false, idle, 121_000),
            IdleStep::Wait { until: 160_000 }
        );
    }

    #[test]
    fn a_silence_that_spans_the_process_pause_gets_a_fresh_ping_and_half_a_window() {
        let idle = 1_000;
        // Heard at 10 000, pinged at 10 500, stopped from 10 600 to 30 600: on resume the leg
        // is judged from 30 100, so the relay pings it now and closes it at 31 100 if it never
        // answers.
        let (from, pinged) = after_pause(10_000, true, Some(30_600), idle);
        assert_eq!((from, pinged), (30_100, false));
        assert_eq!(
            idle_step(from, pinged, idle, 30_600),
            IdleStep::Ping { then: 31_100 }
        );
        assert_eq!(idle_step(from, true, idle, 31_100), IdleStep::Silent);
        // A pause shorter than half a window moves nothing closer, nor anything at all.
        assert_eq!(
            after_pause(10_000, false, Some(10_300), idle),
            (10_000, false)
        );
        assert_eq!(
            after_pause(10_000, true, Some(10_300), idle),
            (10_000, true)
        );
        // A pause that ended before the last arrival, or none: as it was.
        assert_eq!(after_pause(10_000, true, Some(9_000), idle), (10_000, true));
        assert_eq!(after_pause(10_000, true, None, idle), (10_000, true));
    }

    #[test]
    fn backpressure_stops_reading_at_the_bound_and_resumes_below_it() {
        let bound = 256 * 1024;
        assert!(may_read(0, bound));
        assert!(may_read(bound - 1, bound));
        assert!(!may_read(bound, bound));
        assert!(!may_read(8 * 1024 * 1024, bound));
    }

    #[test]
    fn a_new_pair_goes_to_the_least_loaded_worker() {
        assert_eq!(least_loaded(&[4, 2, 6]), 1);
        assert_eq!(least_loaded(&[3, 3, 3]), 0);
        assert_eq!(least_loaded(&[5, 0, 0]), 1);
        assert_eq!(least_loaded(&[7]), 0);
        assert_eq!(least_loaded(&[]), 0);
    }
}
