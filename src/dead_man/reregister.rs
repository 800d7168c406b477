//! Re-registration after a trip (SPEC §5.5 "Trip"), on the `reregister` thread.
//!
//! A tripped cell runs in `db` mode, so every control it admitted from a booking or from
//! memory must now be backed by the database like a db-mode control: its placement row names
//! this cell at its epoch, and it holds an activity lease. Controls are processed with bounded
//! parallelism (a few worker threads), retried while the database does not answer, and closed
//! 4409 only after repeated definite refusals (the row names another cell or a newer epoch).
//! No socket is closed for any other reason.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::cell::admission::CONTROL_LEASE_KIND;
use crate::cell::state::{AdmitPath, CellState, Control, Peer};
use crate::clock::{self, SharedClock};
use crate::config::Timings;
use crate::store::{LeaseOutcome, Store};

/// Worker threads re-registering at once: bounded so a trip does not flood the pool.
pub const PARALLELISM: usize = 4;
/// Definite refusals before a control is closed 4409.
pub const REFUSALS_BEFORE_CLOSE: u32 = 3;
const RETRY_INITIAL: Duration = Duration::from_millis(200);
const RETRY_CAP: Duration = Duration::from_secs(5);

/// Closes a control whose placement definitely moved.
pub type Refuse<S> = Arc<dyn Fn(&Control<S>) + Send + Sync>;

pub struct Reregistration<S: Peer + 'static> {
    pub cell: Arc<CellState<S>>,
    pub store: Store,
    pub cell_id: String,
    pub incarnation: i64,
    pub timings: Timings,
    pub clock: SharedClock,
    /// Closes a control 4409 after repeated definite refusals.
    pub refuse: Refuse<S>,
    pub stop: Arc<AtomicBool>,
}

/// What happened to each control.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Report {
    pub registered: u32,
    pub refused: u32,
    pub gone: u32,
}

impl<S: Peer + 'static> Reregistration<S> {
    /// Re-registers every memory- or booking-admitted control; returns when all are done.
    pub fn run(self: Arc<Self>) -> Report {
        let queue: Vec<Control<S>> = self
            .cell
            .controls()
            .into_iter()
            .filter(|control| control.admitted_via != AdmitPath::Database)
            .collect();
        let total = queue.len();
        let queue = Arc::new(Mutex::new(queue));
        let report = Arc::new(Mutex::new(Report::default()));
        let mut workers = Vec::new();
        for n in 0..PARALLELISM.min(total.max(1)) {
            let this = self.clone();
            let queue = queue.clone();
            let report = report.clone();
            let spawned = crate::threads::spawn(format!("reregister-{n}"), move || loop {
                let next = queue.lock().unwrap_or_else(|e| e.into_inner()).pop();
                let Some(control) = next else { return };
                let outcome = this.register_one(&control);
                let mut report = report.lock().unwrap_or_else(|e| e.into_inner());
                match outcome {
                    One::Registered => report.registered += 1,
                    One::Refused => report.refused += 1,
                    One::Gone => report.gone += 1,
                }
            });
            match spawned {
                Ok(handle) => workers.push(handle),
                Err(e) => log::error!("orca_relay_reregister_spawn_failed error={e}"),
            }
        }
        for worker in workers {
            crate::threads::join_logged("reregister", worker);
        }
        let report = *report.lock().unwrap_or_else(|e| e.into_inner());
        log::info!(
            "orca_relay_cell_reregistered cell_id={} controls={total} registered={} refused={} gone={}",
            self.cell_id,
            report.registered,
            report.refused,
            report.gone
        );
        report
    }

    fn still_current(&self, control: &Control<S>) -> bool {
        self.cell
            .control(&control.relay_host_id)
            .is_some_and(|live| live.generation == control.generation)
    }

    fn register_one(&self, control: &Control<S>) -> One {
        let lease_id = format!(
            "control:{}:{}:{}",
            self.cell_id,
            self.incarnation,
            control.socket.id()
        );
        let mut refusals = 0;
        let mut backoff = RETRY_INITIAL;
        loop {
            if self.stop.load(Ordering::Acquire) || !self.still_current(control) {
                return One::Gone;
            }
            let now = self.clock.now_ms() as i64;
            let attempt = self
                .store
                .place_assignment_if_newer(
                    &control.user_id,
                    &control.relay_host_id,
                    &self.cell_id,
                    control.epoch,
                    now,
                )
                .and_then(|_| {
                    self.store.renew_lease(
                        &lease_id,
                        &control.user_id,
                        &control.relay_host_id,
                        &self.cell_id,
                        control.epoch,
                        CONTROL_LEASE_KIND,
                        now + self.timings.lease_ttl_ms as i64,
                        now,
                    )
                });
            match attempt {
                Ok(LeaseOutcome::Renewed) => {
                    self.cell.promote_to_database(
                        &control.relay_host_id,
                        control.generation,
                        lease_id,
                    );
                    return One::Registered;
                }
                Ok(LeaseOutcome::Moved) => {
                    refusals += 1;
                    if refusals >= REFUSALS_BEFORE_CLOSE {
                        log::info!(
                            "orca_relay_reregister_refused host={} epoch={}",
                            control.relay_host_id,
                            control.epoch
                        );
                        self.cell.demote(&control.relay_host_id);
                        (self.refuse)(control);
                        return One::Refused;
                    }
                }
                Err(e) => {
                    log::info!(
                        "orca_relay_reregister_retry host={} {}",
                        control.relay_host_id,
                        e.log_fields()
                    );
                }
            }
            clock::sleep(backoff);
            backoff = (backoff * 2).min(RETRY_CAP);
        }
    }
}

enum One {
    Registered,
    Refused,
    Gone,
}
