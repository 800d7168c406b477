//! The admit-effective writer (SPEC §5.5 "The admit-effective row"): the decisions of
//! `CellAdmitEffectiveWriter`, the only writer of this cell's `relay_cell_admit_effective` row,
//! and the thin channel shell that runs it on the `claim-loop` thread.
//!
//! Owns: what this process last wrote to the row (mode and time), whether a granted permit is
//! still waiting for the watchdog, and the once-a-minute failure-log throttle.
//! Runs on: the `claim-loop` thread ([`run_claim_loop`]). The watchdog talks to it only through
//! a [`WriterHandle`] (ticks, claim requests, slot releases, bounded: ticks coalesce while a
//! write is slow, see [`Pending`]); answers go
//! back through a callback. Because one thread owns the writer, at most one write or claim is
//! in flight, and a claim queued behind a `reserve` write runs strictly after that write has
//! completed: the write cannot land after the claim and hide the slot from the next claimant.
//! Must never: panic or propagate a failed write (it is retried on the next tick), claim while
//! the pool has waiters or the switch is off `reserve`, hold a lock across the store call, or
//! read a clock itself (time comes in as `now_ms`; the shell reads the injected clock).
//!
//! The permit hold: a permit means the claim transaction already wrote the row `db`. Until the
//! watchdog acts on it, its ticks still say raw mode `reserve`; writing that would free the slot
//! the cell is about to use (another cell could claim it and the cap would be exceeded). So
//! after a permit the row stays `db` until the watchdog either trips (a tick says `tripped`),
//! or drops the permit and asks for a release ([`WriterHandle::release_slot`]), or the switch
//! leaves `reserve`.

use std::fmt;
use std::sync::mpsc::{self, Receiver, SyncSender, TrySendError};
use std::sync::{Arc, Mutex, MutexGuard};

use crate::carry::cell::WriterRecord;
use crate::clock::Clock;
use crate::config::Timings;
use crate::dead_man::window::{ClaimResult, Mode};
use crate::logging::FailureThrottle;

/// Failed writes and claims are logged at most this often (SPEC §5.5: once a minute).
pub const FAILURE_LOG_INTERVAL_MS: u64 = crate::logging::REPEAT_LOG_INTERVAL_MS;

/// The claim transaction's answer (the SQL lives in `store/claim`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClaimAnswer {
    /// Fewer than `slots` other live holders: this cell's row was written `db`.
    Permit,
    /// No slot free: this cell's row was written `reserve` (and so is fresh).
    Refused,
    /// The advisory lock was taken by another claimant; nothing was written.
    LockBusy,
}

/// The database side of the writer. Implemented by the store; faked in tests.
pub trait EffectiveRowStore {
    /// Upserts this cell's row with `mode` and `updated_at = now_ms`.
    fn write_admit_effective(&self, mode: Mode, now_ms: u64) -> Result<(), String>;
    /// Runs the slot claim as one short transaction.
    fn claim_trip_slot(&self, slots: u32, now_ms: u64) -> Result<ClaimAnswer, String>;
    /// Whether anyone is waiting for a database connection right now.
    fn pool_has_waiters(&self) -> bool;
}

impl<T: EffectiveRowStore + ?Sized> EffectiveRowStore for Arc<T> {
    fn write_admit_effective(&self, mode: Mode, now_ms: u64) -> Result<(), String> {
        (**self).write_admit_effective(mode, now_ms)
    }
    fn claim_trip_slot(&self, slots: u32, now_ms: u64) -> Result<ClaimAnswer, String> {
        (**self).claim_trip_slot(slots, now_ms)
    }
    fn pool_has_waiters(&self) -> bool {
        (**self).pool_has_waiters()
    }
}

/// The writer's timing knobs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WriterTimings {
    /// `ADMIT_EFFECTIVE_REFRESH_MS` (15 s).
    pub refresh_ms: u64,
    /// `TRIPPED_ROW_FORCE_REFRESH_MS` (5 min): half of `TRIP_SLOT_STALE_MS` (10 min), so a
    /// tripped holder's row cannot age out of the count even under a long brownout.
    pub tripped_row_force_refresh_ms: u64,
}

impl WriterTimings {
    pub fn from_timings(timings: &Timings) -> WriterTimings {
        WriterTimings {
            refresh_ms: timings.admit_effective_refresh_ms,
            tripped_row_force_refresh_ms: timings.tripped_row_force_refresh_ms,
        }
    }
}

/// What one tick did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TickOutcome {
    /// Nothing was due.
    Idle,
    /// The row was written with this mode.
    Wrote(Mode),
    /// A refresh was due but the pool has waiters.
    SkippedPoolBusy,
    /// The write failed; it is retried on the next tick. `log_line` is the line logged now, if
    /// the once-a-minute limiter let one through.
    Failed {
        mode: Mode,
        log_line: Option<String>,
    },
}

/// What a claim did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClaimDecision {
    /// Slot granted; the row now says `db`.
    Permit,
    /// No slot; the row now says `reserve` and is fresh.
    Refused,
    /// Not attempted: the pool has waiters, or the switch is off `reserve`, or the cell tripped.
    NotNow,
    /// The lock was busy or the transaction failed; the watchdog asks again later.
    RetryLater,
}

impl ClaimDecision {
    pub fn is_permit(self) -> bool {
        self == ClaimDecision::Permit
    }
}

/// The last row this process wrote successfully (a plain write or a claim).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct RowWritten {
    mode: Mode,
    at_ms: u64,
}

/// `CellAdmitEffectiveWriter`. See the module header.
pub struct CellAdmitEffectiveWriter<S: EffectiveRowStore> {
    store: S,
    timings: WriterTimings,
    row: Option<RowWritten>,
    switch_says_reserve: bool,
    raw_mode: Mode,
    tripped: bool,
    permit_hold: bool,
    failures: FailureThrottle,
}

impl<S: EffectiveRowStore> fmt::Debug for CellAdmitEffectiveWriter<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CellAdmitEffectiveWriter")
            .field("row", &self.row)
            .field("switch_says_reserve", &self.switch_says_reserve)
            .field("raw_mode", &self.raw_mode)
            .field("tripped", &self.tripped)
            .field("permit_hold", &self.permit_hold)
            .finish()
    }
}

impl<S: EffectiveRowStore> CellAdmitEffectiveWriter<S> {
    /// A writer that has written nothing yet: it owes a write on its first tick.
    pub fn new(store: S, timings: WriterTimings) -> Self {
        CellAdmitEffectiveWriter {
            store,
            timings,
            row: None,
            switch_says_reserve: false,
            raw_mode: Mode::Db,
            tripped: false,
            permit_hold: false,
            failures: FailureThrottle::with_interval(FAILURE_LOG_INTERVAL_MS),
        }
    }

    pub fn store(&self) -> &S {
        &self.store
    }

    /// The mode of the last row this process wrote, if any.
    pub fn last_written_mode(&self) -> Option<Mode> {
        self.row.map(|row| row.mode)
    }

    /// One evaluation with the watchdog's view. While the switch says `reserve`: write on the
    /// first tick, on every mode change and every refresh interval (a refresh is skipped while
    /// the pool has waiters, except a tripped cell's `db` row older than the force interval).
    /// Off `reserve`: one `db` write is owed unless this process already wrote `db` (a process
    /// that starts off `reserve` owes it too: its row may still say `reserve` from before).
    pub fn tick(
        &mut self,
        now_ms: u64,
        switch_says_reserve: bool,
        raw_mode: Mode,
        tripped: bool,
    ) -> TickOutcome {
        self.switch_says_reserve = switch_says_reserve;
        self.raw_mode = raw_mode;
        self.tripped = tripped;
        if tripped || !switch_says_reserve {
            self.permit_hold = false;
        }

        if !switch_says_reserve {
            return match self.row {
                Some(row) if row.mode == Mode::Db => TickOutcome::Idle,
                _ => self.write(Mode::Db, now_ms),
            };
        }

        let wanted = if self.permit_hold { Mode::Db } else { raw_mode };
        let Some(row) = self.row.filter(|row| row.mode == wanted) else {
            return self.write(wanted, now_ms); // first write or a mode change: owed
        };
        let age_ms = now_ms.saturating_sub(row.at_ms);
        if age_ms < self.timings.refresh_ms {
            return TickOutcome::Idle;
        }
        if self.store.pool_has_waiters() {
            let force = tripped
                && wanted == Mode::Db
                && age_ms >= self.timings.tripped_row_force_refresh_ms;
            if !force {
                return TickOutcome::SkippedPoolBusy;
            }
        }
        self.write(wanted, now_ms)
    }

    /// Runs one slot claim if allowed (see [`ClaimDecision`]). Uses the switch view of the last
    /// tick, so a writer that has not ticked yet does not claim.
    pub fn claim(&mut self, slots: u32, now_ms: u64) -> ClaimDecision {
        if !self.switch_says_reserve || self.tripped || self.store.pool_has_waiters() {
            return ClaimDecision::NotNow;
        }
        let answer = self.store.claim_trip_slot(slots, now_ms);
        if answer.is_ok() {
            self.database_answered();
        }
        match answer {
            Ok(ClaimAnswer::Permit) => {
                self.row = Some(RowWritten {
                    mode: Mode::Db,
                    at_ms: now_ms,
                });
                self.permit_hold = true;
                ClaimDecision::Permit
            }
            Ok(ClaimAnswer::Refused) => {
                self.row = Some(RowWritten {
                    mode: Mode::Reserve,
                    at_ms: now_ms,
                });
                ClaimDecision::Refused
            }
            Ok(ClaimAnswer::LockBusy) => ClaimDecision::RetryLater,
            Err(error) => {
                if let Some(line) = self.failure_line(
                    now_ms,
                    format_args!("orca_relay_trip_slot_claim_failed slots={slots} error={error:?}"),
                ) {
                    log::warn!("{line}");
                }
                ClaimDecision::RetryLater
            }
        }
    }

    /// The watchdog dropped a permit while staying `reserve`: stop holding the `db` row and
    /// write `reserve` now (with the last tick's view), which frees the slot.
    pub fn release_slot(&mut self, now_ms: u64) -> TickOutcome {
        self.permit_hold = false;
        self.tick(
            now_ms,
            self.switch_says_reserve,
            self.raw_mode,
            self.tripped,
        )
    }

    fn write(&mut self, mode: Mode, now_ms: u64) -> TickOutcome {
        match self.store.write_admit_effective(mode, now_ms) {
            Ok(()) => {
                self.database_answered();
                self.row = Some(RowWritten {
                    mode,
                    at_ms: now_ms,
                });
                TickOutcome::Wrote(mode)
            }
            Err(error) => {
                let log_line = self.failure_line(
                    now_ms,
                    format_args!(
                        "orca_relay_admit_effective_write_failed mode={} error={error:?}",
                        mode.as_str()
                    ),
                );
                if let Some(line) = &log_line {
                    log::warn!("{line}");
                }
                TickOutcome::Failed { mode, log_line }
            }
        }
    }

    /// The failure line, if the once-a-minute throttle (shared by writes and claims) lets one
    /// through: the first failure of a run, then at most once a minute with ` repeats=N`.
    fn failure_line(&mut self, now_ms: u64, line: fmt::Arguments<'_>) -> Option<String> {
        let note = self.failures.failure(now_ms)?;
        Some(format!("{line}{note}"))
    }

    /// A write or claim the database answered: ends a run of failures with one line.
    fn database_answered(&mut self) {
        if let Some(note) = self.failures.success() {
            log::info!("orca_relay_admit_effective_recovered{note}");
        }
    }
}

impl<S: EffectiveRowStore> CellAdmitEffectiveWriter<S> {
    pub fn record(&self, at: &crate::carry::time::Snapshot) -> WriterRecord {
        WriterRecord {
            row: self
                .row
                .map(|row| (row.mode.as_str().to_string(), at.age_ms(row.at_ms))),
            switch_says_reserve: self.switch_says_reserve,
            raw_reserve: self.raw_mode == Mode::Reserve,
            tripped: self.tripped,
            permit_hold: self.permit_hold,
        }
    }

    /// Takes a handover's record: the row this cell wrote (so a refresh is due when it would
    /// have been) and a permit still held.
    pub fn restore(&mut self, record: &WriterRecord, carry: &crate::carry::time::Carry) {
        self.row = record.row.as_ref().map(|(mode, age)| RowWritten {
            mode: if mode == "reserve" {
                Mode::Reserve
            } else {
                Mode::Db
            },
            at_ms: carry.moment_ms(*age),
        });
        self.switch_says_reserve = record.switch_says_reserve;
        self.raw_mode = if record.raw_reserve {
            Mode::Reserve
        } else {
            Mode::Db
        };
        self.tripped = record.tripped;
        self.permit_hold = record.permit_hold;
    }
}

/// A request for a trip slot, from the watchdog's [`Action::RequestPermit`].
///
/// [`Action::RequestPermit`]: crate::dead_man::window::Action::RequestPermit
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClaimRequest {
    pub generation: u64,
    pub silence_started_ms: u64,
    pub slots: u32,
}

/// The watchdog's view after one of its ticks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TickView {
    pub switch_says_reserve: bool,
    pub raw_mode: Mode,
    pub tripped: bool,
}

/// What the watchdog has asked of the `claim-loop` thread and the thread has not taken yet.
/// Bounded by construction: a newer tick view supersedes an older one (ticks coalesce while a
/// write is slow), a release is a flag, and a newer claim request supersedes an older one (the
/// window asks again after `TRIP_CLAIM_RETRY_MS` for a request that got no answer).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Pending {
    pub tick: Option<TickView>,
    pub release: bool,
    pub claim: Option<ClaimRequest>,
}

fn lock_pending(pending: &Mutex<Pending>) -> MutexGuard<'_, Pending> {
    pending.lock().unwrap_or_else(|e| e.into_inner())
}

/// The watchdog's handle on the `claim-loop` thread. Cheap to clone; dropping every handle
/// ends the loop (after it has carried out what was pending). Posting never blocks: it updates
/// [`Pending`] and wakes the loop through a channel of one slot; a wake already queued covers
/// the new request too. Each call returns `false` if the loop has gone.
#[derive(Debug, Clone)]
pub struct WriterHandle {
    pending: Arc<Mutex<Pending>>,
    wake: SyncSender<()>,
}

/// The `claim-loop` thread's end of a [`WriterHandle`].
#[derive(Debug)]
pub struct WriterInbox {
    pending: Arc<Mutex<Pending>>,
    wake: Receiver<()>,
}

impl WriterInbox {
    /// Waits until something is pending, then takes all of it; `None` once every handle is
    /// gone and nothing is left.
    pub fn next(&self) -> Option<Pending> {
        self.wake.recv().ok()?;
        Some(std::mem::take(&mut *lock_pending(&self.pending)))
    }

    /// As [`WriterInbox::next`], waiting at most `wait`: `Some(None)` when nothing came.
    pub fn next_within(&self, wait: std::time::Duration) -> Option<Option<Pending>> {
        match self.wake.recv_timeout(wait) {
            Ok(()) => Some(Some(std::mem::take(&mut *lock_pending(&self.pending)))),
            Err(mpsc::RecvTimeoutError::Timeout) => Some(None),
            Err(mpsc::RecvTimeoutError::Disconnected) => None,
        }
    }
}

impl WriterHandle {
    /// A handle and the receiving end to give to [`run_claim_loop`].
    pub fn channel() -> (WriterHandle, WriterInbox) {
        let pending = Arc::new(Mutex::new(Pending::default()));
        let (wake, woken) = mpsc::sync_channel(1);
        (
            WriterHandle {
                pending: pending.clone(),
                wake,
            },
            WriterInbox {
                pending,
                wake: woken,
            },
        )
    }

    pub fn tick(&self, switch_says_reserve: bool, raw_mode: Mode, tripped: bool) -> bool {
        self.post(|pending| {
            pending.tick = Some(TickView {
                switch_says_reserve,
                raw_mode,
                tripped,
            })
        })
    }

    pub fn request_claim(&self, request: ClaimRequest) -> bool {
        self.post(|pending| pending.claim = Some(request))
    }

    pub fn release_slot(&self) -> bool {
        self.post(|pending| pending.release = true)
    }

    fn post(&self, update: impl FnOnce(&mut Pending)) -> bool {
        update(&mut lock_pending(&self.pending));
        match self.wake.try_send(()) {
            Ok(()) | Err(TrySendError::Full(())) => true,
            Err(TrySendError::Disconnected(())) => false,
        }
    }
}

/// The body of the `claim-loop` thread: carries out what is pending, one write or claim at a
/// time, until every [`WriterHandle`] is dropped. What was pending together runs in this
/// order: the latest tick view, then a release (with that view), then the latest claim request,
/// which gets exactly one answer through `answer` (`permit: false` unless the claim granted a
/// slot). A release before the claim: a permit the window dropped must be let go before a new
/// one is asked for, never after it (that would free the new slot).
pub fn run_claim_loop<S: EffectiveRowStore>(
    writer: &mut CellAdmitEffectiveWriter<S>,
    inbox: WriterInbox,
    clock: &dyn Clock,
    answer: impl Fn(ClaimResult),
) {
    run_claim_loop_beating(writer, inbox, clock, answer, None)
}

/// [`run_claim_loop`] on a critical thread: it beats at least once a beat period while it
/// waits, and is not judged while a write or a claim waits on the database.
pub fn run_claim_loop_beating<S: EffectiveRowStore>(
    writer: &mut CellAdmitEffectiveWriter<S>,
    inbox: WriterInbox,
    clock: &dyn Clock,
    answer: impl Fn(ClaimResult),
    beat: Option<&crate::liveness::Beat>,
) {
    loop {
        let pending = match beat {
            None => inbox.next(),
            Some(beat) => {
                beat.beat();
                match inbox.next_within(crate::liveness::BEAT_PERIOD) {
                    Some(Some(pending)) => Some(pending),
                    Some(None) => continue,
                    None => None,
                }
            }
        };
        let Some(pending) = pending else {
            return;
        };
        match beat {
            Some(beat) => beat.waiting(|| carry_out(writer, pending, clock, &answer)),
            None => carry_out(writer, pending, clock, &answer),
        }
    }
}

/// What one wake of the claim loop found pending, in order.
fn carry_out<S: EffectiveRowStore>(
    writer: &mut CellAdmitEffectiveWriter<S>,
    pending: Pending,
    clock: &dyn Clock,
    answer: &impl Fn(ClaimResult),
) {
    if let Some(view) = pending.tick {
        writer.tick(
            clock.now_ms(),
            view.switch_says_reserve,
            view.raw_mode,
            view.tripped,
        );
    }
    if pending.release {
        writer.release_slot(clock.now_ms());
    }
    if let Some(request) = pending.claim {
        let decision = writer.claim(request.slots, clock.now_ms());
        answer(ClaimResult {
            generation: request.generation,
            silence_started_ms: request.silence_started_ms,
            permit: decision.is_permit(),
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::ManualClock;
    use crate::dead_man::window::{Action, DeadManState, TickInput, Window};
    use crate::threads;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::mpsc::Sender;
    use std::time::Duration;

    const T0: u64 = 1_700_000_000_000;
    const TIMINGS: WriterTimings = WriterTimings {
        refresh_ms: 15_000,
        tripped_row_force_refresh_ms: 300_000,
    };

    /// A blocking point inside `write_admit_effective`: the store says when it entered and
    /// waits for the test to release it.
    struct Gate {
        entered: Sender<()>,
        release: Receiver<()>,
    }

    /// A store that records every call in order.
    struct FakeStore {
        calls: Mutex<Vec<String>>,
        pool_busy: AtomicBool,
        fail_writes: AtomicBool,
        answer: Mutex<Result<ClaimAnswer, String>>,
        gate: Mutex<Option<Gate>>,
    }

    impl FakeStore {
        fn new() -> Arc<FakeStore> {
            Arc::new(FakeStore {
                calls: Mutex::new(Vec::new()),
                pool_busy: AtomicBool::new(false),
                fail_writes: AtomicBool::new(false),
                answer: Mutex::new(Ok(ClaimAnswer::Refused)),
                gate: Mutex::new(None),
            })
        }

        fn calls(&self) -> Vec<String> {
            self.calls.lock().unwrap().clone()
        }

        fn take_calls(&self) -> Vec<String> {
            std::mem::take(&mut *self.calls.lock().unwrap())
        }

        fn record(&self, call: String) {
            self.calls.lock().unwrap().push(call);
        }
    }

    impl EffectiveRowStore for FakeStore {
        fn write_admit_effective(&self, mode: Mode, now_ms: u64) -> Result<(), String> {
            let at = (now_ms - T0) / 1_000;
            self.record(format!("write {} @{at}", mode.as_str()));
            if let Some(gate) = self.gate.lock().unwrap().as_ref() {
                gate.entered.send(()).unwrap();
                gate.release
                    .recv_timeout(Duration::from_secs(10))
                    .expect("the test releases the write");
                self.record(format!("write {} done", mode.as_str()));
            }
            if self.fail_writes.load(Ordering::SeqCst) {
                return Err("connection refused".into());
            }
            Ok(())
        }

        fn claim_trip_slot(&self, slots: u32, now_ms: u64) -> Result<ClaimAnswer, String> {
            self.record(format!("claim {slots} @{}", (now_ms - T0) / 1_000));
            self.answer.lock().unwrap().clone()
        }

        fn pool_has_waiters(&self) -> bool {
            self.pool_busy.load(Ordering::SeqCst)
        }
    }

    fn writer(store: &Arc<FakeStore>) -> CellAdmitEffectiveWriter<Arc<FakeStore>> {
        CellAdmitEffectiveWriter::new(store.clone(), TIMINGS)
    }

    fn at(seconds: u64) -> u64 {
        T0 + seconds * 1_000
    }

    #[test]
    fn reserve_rows_are_written_first_on_change_and_every_refresh() {
        let store = FakeStore::new();
        let mut w = writer(&store);
        for s in 0..=31 {
            w.tick(at(s), true, Mode::Reserve, false);
        }
        w.tick(at(32), true, Mode::Db, true);
        w.tick(at(33), true, Mode::Db, true);
        assert_eq!(
            store.calls(),
            vec![
                "write reserve @0",
                "write reserve @15",
                "write reserve @30",
                "write db @32"
            ]
        );
    }

    #[test]
    fn the_db_write_is_owed_once_after_leaving_reserve() {
        let store = FakeStore::new();
        let mut w = writer(&store);
        w.tick(at(0), true, Mode::Reserve, false);
        store.pool_busy.store(true, Ordering::SeqCst);
        store.fail_writes.store(true, Ordering::SeqCst);
        for s in 1..=2 {
            w.tick(at(s), false, Mode::Db, false);
        }
        store.fail_writes.store(false, Ordering::SeqCst);
        for s in 3..=100 {
            w.tick(at(s), false, Mode::Db, false);
        }
        assert_eq!(
            store.calls(),
            vec![
                "write reserve @0",
                "write db @1",
                "write db @2",
                "write db @3"
            ],
            "owed (even past a busy pool), retried after a failure, then exactly once"
        );

        // A tripped cell already wrote db: leaving reserve owes nothing.
        let store = FakeStore::new();
        let mut w = writer(&store);
        w.tick(at(0), true, Mode::Db, true);
        for s in 1..=100 {
            w.tick(at(s), false, Mode::Db, false);
        }
        assert_eq!(store.calls(), vec!["write db @0"]);

        // A process that starts off reserve owes one db write (its row may be stale).
        let store = FakeStore::new();
        let mut w = writer(&store);
        for s in 0..=100 {
            w.tick(at(s), false, Mode::Db, false);
        }
        assert_eq!(store.calls(), vec!["write db @0"]);
    }

    #[test]
    fn a_tripped_row_is_refreshed_past_a_saturated_pool_after_5_minutes_a_reserve_row_is_not() {
        let store = FakeStore::new();
        let mut w = writer(&store);
        w.tick(at(0), true, Mode::Db, true);
        store.pool_busy.store(true, Ordering::SeqCst);
        let mut skipped = 0;
        for s in 1..=600 {
            if w.tick(at(s), true, Mode::Db, true) == TickOutcome::SkippedPoolBusy {
                skipped += 1;
            }
        }
        assert_eq!(
            store.calls(),
            vec!["write db @0", "write db @300", "write db @600"]
        );
        assert!(
            skipped > 500,
            "refreshes in between were skipped: {skipped}"
        );

        let store = FakeStore::new();
        let mut w = writer(&store);
        w.tick(at(0), true, Mode::Reserve, false);
        store.pool_busy.store(true, Ordering::SeqCst);
        for s in 1..=900 {
            w.tick(at(s), true, Mode::Reserve, false);
        }
        assert_eq!(store.take_calls(), vec!["write reserve @0"]);
        store.pool_busy.store(false, Ordering::SeqCst);
        assert_eq!(
            w.tick(at(901), true, Mode::Reserve, false),
            TickOutcome::Wrote(Mode::Reserve)
        );
    }

    #[test]
    fn a_mode_change_is_written_even_while_the_pool_is_busy() {
        let store = FakeStore::new();
        let mut w = writer(&store);
        store.pool_busy.store(true, Ordering::SeqCst);
        w.tick(at(0), true, Mode::Reserve, false);
        w.tick(at(1), true, Mode::Db, true);
        assert_eq!(store.calls(), vec!["write reserve @0", "write db @1"]);
    }

    #[test]
    fn failures_are_retried_next_tick_and_logged_at_most_once_a_minute() {
        let store = FakeStore::new();
        let mut w = writer(&store);
        store.fail_writes.store(true, Ordering::SeqCst);
        let mut logged_at = Vec::new();
        for s in 0..150 {
            match w.tick(at(s), true, Mode::Reserve, false) {
                TickOutcome::Failed { mode, log_line } => {
                    assert_eq!(mode, Mode::Reserve);
                    if let Some(line) = log_line {
                        assert!(line.starts_with(
                            "orca_relay_admit_effective_write_failed mode=reserve error="
                        ));
                        // After the first line, each says how many failed since the last.
                        assert_eq!(line.ends_with(" repeats=60"), s > 0, "{line}");
                        logged_at.push(s);
                    }
                }
                other => panic!("expected a failure at {s}, got {other:?}"),
            }
        }
        assert_eq!(store.take_calls().len(), 150, "retried on every tick");
        assert_eq!(logged_at, vec![0, 60, 120]);

        store.fail_writes.store(false, Ordering::SeqCst);
        assert_eq!(
            w.tick(at(150), true, Mode::Reserve, false),
            TickOutcome::Wrote(Mode::Reserve)
        );
        assert_eq!(
            w.tick(at(151), true, Mode::Reserve, false),
            TickOutcome::Idle
        );
    }

    #[test]
    fn no_claim_while_the_pool_has_waiters_or_the_switch_is_off_reserve() {
        let store = FakeStore::new();
        let mut w = writer(&store);
        assert_eq!(w.claim(2, at(0)), ClaimDecision::NotNow, "before any tick");
        w.tick(at(0), false, Mode::Db, false);
        assert_eq!(
            w.claim(2, at(1)),
            ClaimDecision::NotNow,
            "switch off reserve"
        );
        w.tick(at(2), true, Mode::Reserve, false);
        store.pool_busy.store(true, Ordering::SeqCst);
        assert_eq!(w.claim(2, at(3)), ClaimDecision::NotNow, "pool has waiters");
        store.pool_busy.store(false, Ordering::SeqCst);
        w.tick(at(4), true, Mode::Db, true);
        assert_eq!(w.claim(2, at(5)), ClaimDecision::NotNow, "already tripped");
        assert!(!store.calls().iter().any(|c| c.starts_with("claim")));

        w.tick(at(6), true, Mode::Reserve, false);
        assert_eq!(w.claim(2, at(7)), ClaimDecision::Refused);
        *store.answer.lock().unwrap() = Ok(ClaimAnswer::LockBusy);
        assert_eq!(w.claim(2, at(8)), ClaimDecision::RetryLater);
        *store.answer.lock().unwrap() = Err("timeout".into());
        assert_eq!(w.claim(2, at(9)), ClaimDecision::RetryLater);
    }

    #[test]
    fn a_permit_keeps_the_db_row_until_the_watchdog_trips_or_releases() {
        let store = FakeStore::new();
        let mut w = writer(&store);
        w.tick(at(0), true, Mode::Reserve, false);
        *store.answer.lock().unwrap() = Ok(ClaimAnswer::Permit);
        assert_eq!(w.claim(1, at(1)), ClaimDecision::Permit);
        assert_eq!(w.last_written_mode(), Some(Mode::Db));
        // The watchdog has not seen the permit yet: its ticks still say reserve. Writing
        // reserve now would free the slot the cell is about to trip on.
        for s in 2..=10 {
            assert_eq!(w.tick(at(s), true, Mode::Reserve, false), TickOutcome::Idle);
        }
        // The watchdog drops the permit: reserve is written at once.
        assert_eq!(w.release_slot(at(11)), TickOutcome::Wrote(Mode::Reserve));
        assert_eq!(
            store.take_calls(),
            vec!["write reserve @0", "claim 1 @1", "write reserve @11"]
        );

        // Next time the watchdog trips: the row stays db and is refreshed as db.
        assert_eq!(w.claim(1, at(20)), ClaimDecision::Permit);
        assert_eq!(w.tick(at(21), true, Mode::Db, true), TickOutcome::Idle);
        assert_eq!(
            w.tick(at(35), true, Mode::Db, true),
            TickOutcome::Wrote(Mode::Db)
        );
        // Re-armed by a new generation: reserve is written, which frees the slot.
        assert_eq!(
            w.tick(at(36), true, Mode::Reserve, false),
            TickOutcome::Wrote(Mode::Reserve)
        );
    }

    /// The watchdog and the writer, one second at a time, as the two threads would run them.
    #[test]
    fn a_refused_claim_keeps_the_reserve_row_fresh_and_the_watchdog_retries_after_30_s() {
        let store = FakeStore::new();
        let mut w = writer(&store);
        let mut window = Window::with_window_ms(90_000, 30_000);
        for s in 0..=160 {
            let now = at(s);
            let actions = window.tick(TickInput {
                now_ms: now,
                switch_generation: 3,
                switch_says_reserve: true,
                slots: Some(2),
                last_contact_ms: Some(T0),
            });
            w.tick(
                now,
                true,
                window.raw_mode(),
                window.state() == DeadManState::Tripped,
            );
            for action in actions {
                if let Action::RequestPermit {
                    generation,
                    silence_started_ms,
                    slots,
                } = action
                {
                    let decision = w.claim(slots, now);
                    assert_eq!(decision, ClaimDecision::Refused);
                    let follow_up = window.on_claim_result(
                        ClaimResult {
                            generation,
                            silence_started_ms,
                            permit: decision.is_permit(),
                        },
                        now,
                    );
                    assert!(follow_up.is_empty());
                }
            }
            assert_eq!(window.raw_mode(), Mode::Reserve);
        }
        assert_eq!(window.state(), DeadManState::Held);
        assert_eq!(
            store.calls(),
            vec![
                "write reserve @0",
                "write reserve @15",
                "write reserve @30",
                "write reserve @45",
                "write reserve @60",
                "write reserve @75",
                "write reserve @90",
                "claim 2 @91",
                // The refused claim wrote a fresh reserve row at 91, so the refresh is due at
                // 106, not 105.
                "write reserve @106",
                "write reserve @121",
                "claim 2 @121",
                "write reserve @136",
                "write reserve @151",
                "claim 2 @151",
            ]
        );
    }

    /// Waits for the gate's "entered" signal with a deadline.
    fn wait_entered(entered: &Receiver<()>) {
        entered
            .recv_timeout(Duration::from_secs(10))
            .expect("the write started");
    }

    #[test]
    fn the_claim_waits_for_an_in_flight_reserve_write() {
        let store = FakeStore::new();
        let (entered_tx, entered_rx) = mpsc::channel();
        let (release_tx, release_rx) = mpsc::channel();
        *store.gate.lock().unwrap() = Some(Gate {
            entered: entered_tx,
            release: release_rx,
        });
        *store.answer.lock().unwrap() = Ok(ClaimAnswer::Permit);

        let clock = ManualClock::starting_at(T0);
        let (handle, commands) = WriterHandle::channel();
        let (answers_tx, answers_rx) = mpsc::channel();
        let thread_store = store.clone();
        let thread_clock = clock.clone();
        let claim_loop = threads::spawn("claim-loop", move || {
            let mut w = CellAdmitEffectiveWriter::new(thread_store, TIMINGS);
            run_claim_loop(&mut w, commands, &*thread_clock, move |result| {
                answers_tx.send(result).unwrap();
            });
        })
        .unwrap();

        // The first tick starts a reserve write, which blocks inside the store.
        assert!(handle.tick(true, Mode::Reserve, false));
        wait_entered(&entered_rx);

        // While it is in flight the watchdog asks for a slot from its own thread.
        let watchdog_handle = handle.clone();
        let request = ClaimRequest {
            generation: 7,
            silence_started_ms: T0,
            slots: 2,
        };
        let watchdog =
            threads::spawn("watchdog", move || watchdog_handle.request_claim(request)).unwrap();
        assert!(watchdog.join().unwrap(), "the request was queued");
        // The write is still blocked on the gate, so no claim can have run.
        assert_eq!(answers_rx.try_recv(), Err(mpsc::TryRecvError::Empty));
        assert_eq!(store.calls(), vec!["write reserve @0"]);

        release_tx.send(()).unwrap();
        let answer = answers_rx
            .recv_timeout(Duration::from_secs(10))
            .expect("the claim ran after the write");
        assert_eq!(
            answer,
            ClaimResult {
                generation: 7,
                silence_started_ms: T0,
                permit: true
            }
        );
        assert_eq!(
            store.calls(),
            vec!["write reserve @0", "write reserve done", "claim 2 @0"],
            "the claim ran strictly after the reserve write completed"
        );

        drop(handle);
        claim_loop.join().unwrap();
    }

    #[test]
    fn ticks_coalesce_while_a_write_is_slow_and_nothing_else_is_lost() {
        let store = FakeStore::new();
        let (entered_tx, entered_rx) = mpsc::channel();
        let (release_tx, release_rx) = mpsc::channel();
        *store.gate.lock().unwrap() = Some(Gate {
            entered: entered_tx,
            release: release_rx,
        });
        *store.answer.lock().unwrap() = Ok(ClaimAnswer::Refused);
        let clock = ManualClock::starting_at(T0);
        let (handle, inbox) = WriterHandle::channel();
        let (answers_tx, answers_rx) = mpsc::channel();
        let thread_store = store.clone();
        let thread_clock = clock.clone();
        let claim_loop = threads::spawn("claim-loop", move || {
            let mut w = CellAdmitEffectiveWriter::new(thread_store, TIMINGS);
            run_claim_loop(&mut w, inbox, &*thread_clock, move |result| {
                answers_tx.send(result).unwrap();
            });
        })
        .unwrap();

        assert!(handle.tick(true, Mode::Reserve, false));
        wait_entered(&entered_rx);
        // The write hangs (a slow database). The watchdog goes on ticking, many times over,
        // and asks for two claims (the second supersedes the first) and a release. Posting
        // never blocks and keeps one of each, however long the write takes.
        for n in 0..100_000u64 {
            let mode = if n % 2 == 0 { Mode::Reserve } else { Mode::Db };
            assert!(handle.tick(true, mode, false));
        }
        assert!(handle.tick(true, Mode::Reserve, false));
        for generation in [1, 2] {
            assert!(handle.request_claim(ClaimRequest {
                generation,
                silence_started_ms: T0,
                slots: 1,
            }));
        }
        assert!(handle.release_slot());
        release_tx.send(()).unwrap();
        drop(handle);
        claim_loop.join().unwrap();
        // The latest view said reserve, as the row already does: no further write; then the
        // release (nothing to free), then exactly one claim, answered once.
        assert_eq!(
            store.calls(),
            vec!["write reserve @0", "write reserve done", "claim 1 @0"]
        );
        let answers: Vec<ClaimResult> = answers_rx.try_iter().collect();
        assert_eq!(
            answers,
            vec![ClaimResult {
                generation: 2,
                silence_started_ms: T0,
                permit: false
            }]
        );
    }

    #[test]
    fn what_was_posted_before_the_last_handle_dropped_is_still_carried_out() {
        let store = FakeStore::new();
        let clock = ManualClock::starting_at(T0);
        let (handle, inbox) = WriterHandle::channel();
        // Posted and dropped before the loop even starts: a drain's final write.
        assert!(handle.tick(true, Mode::Reserve, false));
        assert!(handle.release_slot());
        drop(handle);
        let mut w = CellAdmitEffectiveWriter::new(store.clone(), TIMINGS);
        run_claim_loop(&mut w, inbox, &*clock, |_| {});
        assert_eq!(store.calls(), vec!["write reserve @0"]);
    }

    #[test]
    fn a_release_posted_with_a_new_claim_runs_before_it_and_never_frees_the_new_slot() {
        let store = FakeStore::new();
        *store.answer.lock().unwrap() = Ok(ClaimAnswer::Permit);
        let clock = ManualClock::starting_at(T0);
        let mut w = writer(&store);
        w.tick(T0, true, Mode::Reserve, false);
        // An earlier permit the window is about to drop: the row says db, held.
        assert_eq!(w.claim(1, T0), ClaimDecision::Permit);
        store.take_calls();
        // In one watchdog iteration: the next tick, a new claim for the new silence, and the
        // release of the dropped permit. The loop takes them together.
        let (handle, inbox) = WriterHandle::channel();
        assert!(handle.tick(true, Mode::Reserve, false));
        assert!(handle.request_claim(ClaimRequest {
            generation: 1,
            silence_started_ms: T0 + 5_000,
            slots: 1,
        }));
        assert!(handle.release_slot());
        drop(handle);
        let answers = std::cell::RefCell::new(Vec::new());
        run_claim_loop(&mut w, inbox, &*clock, |result| {
            answers.borrow_mut().push(result)
        });
        assert_eq!(
            store.calls(),
            vec!["write reserve @0", "claim 1 @0"],
            "the old permit's slot is let go first, then the new claim takes one"
        );
        assert_eq!(answers.into_inner().len(), 1);
        assert_eq!(
            w.last_written_mode(),
            Some(Mode::Db),
            "the new permit's db row stands"
        );
    }
}
