//! The `claim-loop` thread: the cell's [`CellAdmitEffectiveWriter`] over the real store.
//!
//! One thread carries out what the watchdog asked, one at a time, so every write of this cell's
//! `relay_cell_admit_effective` row and every slot claim is serialised by construction: a
//! claim sent while a `reserve` write is in flight runs after that write has landed.
//! The adapter publishes what the row says to [`CellMode`] and counts claims by result.

use std::sync::mpsc::Sender;
use std::sync::Arc;

use crate::cell::mode::CellMode;
use crate::clock::SharedClock;
use crate::config::Timings;
use crate::dead_man::window::{ClaimResult, Mode};
use crate::dead_man::writer::{
    run_claim_loop_beating, CellAdmitEffectiveWriter, ClaimAnswer, EffectiveRowStore, WriterInbox,
    WriterTimings,
};
use crate::metrics::Registry;
use crate::store::{ClaimOutcome, Store};

/// This cell's row, written through the shared store.
pub struct StoreRow {
    pub store: Store,
    pub cell_id: String,
    pub incarnation: i64,
    pub stale_ms: u64,
    pub mode: Arc<CellMode>,
    pub registry: Registry,
}

/// Every result a trip-slot claim can have; their sum is the number of claim attempts.
pub const CLAIM_RESULTS: [&str; 4] = ["permit", "refused", "lock_busy", "error"];

fn claims_counter(registry: &Registry, result: &str) -> crate::metrics::Counter {
    registry.counter(
        "orca_relay_trip_slot_claims_total",
        "Trip-slot claims by result.",
        &[("result", result)],
    )
}

/// Creates every claim-result series at zero, so a scraper sees the family before any trip.
pub fn register_metrics(registry: &Registry) {
    for result in CLAIM_RESULTS {
        claims_counter(registry, result);
    }
}

impl StoreRow {
    fn count_claim(&self, result: &str) {
        claims_counter(&self.registry, result).inc();
    }
}

/// The row is stamped, and other rows judged, with the database's clock (SPEC §11): the
/// writer's `now_ms` (this cell's clock) only paces the writer and is not sent.
impl EffectiveRowStore for StoreRow {
    fn write_admit_effective(&self, mode: Mode, _now_ms: u64) -> Result<(), String> {
        self.store
            .write_admit_effective(&self.cell_id, self.incarnation, mode.as_str())
            .map_err(|e| e.to_string())?;
        self.mode.set_effective_reserve(mode == Mode::Reserve);
        Ok(())
    }

    fn claim_trip_slot(&self, slots: u32, _now_ms: u64) -> Result<ClaimAnswer, String> {
        let outcome = self.store.claim_trip_slot(
            &self.cell_id,
            self.incarnation,
            slots,
            self.stale_ms as i64,
        );
        match outcome {
            Ok(ClaimOutcome::Permit { others_holding }) => {
                self.count_claim("permit");
                self.mode.set_effective_reserve(false);
                log::info!(
                    "orca_relay_trip_slot_permit cell_id={} slots={slots} others_holding={others_holding}",
                    self.cell_id
                );
                Ok(ClaimAnswer::Permit)
            }
            Ok(ClaimOutcome::Refused { others_holding }) => {
                self.count_claim("refused");
                self.mode.set_effective_reserve(true);
                log::info!(
                    "orca_relay_trip_slot_refused cell_id={} slots={slots} others_holding={others_holding}",
                    self.cell_id
                );
                Ok(ClaimAnswer::Refused)
            }
            Ok(ClaimOutcome::LockBusy) => {
                self.count_claim("lock_busy");
                Ok(ClaimAnswer::LockBusy)
            }
            Err(e) => {
                self.count_claim("error");
                Err(e.to_string())
            }
        }
    }

    fn pool_has_waiters(&self) -> bool {
        self.store.has_waiters()
    }
}

/// The body of the `claim-loop` thread; ends when the watchdog drops its handle, giving the
/// writer back (a live handover carries what it knows).
pub fn run(
    mut writer: CellAdmitEffectiveWriter<StoreRow>,
    inbox: WriterInbox,
    clock: SharedClock,
    answers: Sender<ClaimResult>,
    beat: &crate::liveness::Beat,
) -> CellAdmitEffectiveWriter<StoreRow> {
    run_claim_loop_beating(
        &mut writer,
        inbox,
        clock.as_ref(),
        move |result| {
            let _ = answers.send(result);
        },
        Some(beat),
    );
    writer
}

/// A fresh writer for this cell's row.
pub fn writer(row: StoreRow, timings: &Timings) -> CellAdmitEffectiveWriter<StoreRow> {
    CellAdmitEffectiveWriter::new(row, WriterTimings::from_timings(timings))
}
