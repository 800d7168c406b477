//! Fleet membership (SPEC §11): which registered cells are still members, and when a silent
//! one is forgotten. Autoscaling, crashes and renames leave `relay_cells` rows behind every day;
//! without a life cycle the feed poller would poll them (and placement consider them) forever.
//!
//! - **Live**: heard from (heartbeat or registration) within `ORCA_RELAY_CELL_RETIRE_MS`.
//! - **Draining**: live, and its seat feed says `draining` (it got SIGTERM): never a pin.
//! - **Retired**: silent for longer than `RETIRE_MS` on the database's clock. Skipped by the feed
//!   poller and by placement, shown as `retired` by `GET /v1/admin/cells`. Judged only once this
//!   director has itself been up `RETIRE_MS`: cells heartbeat through the director, so after a
//!   director outage every heartbeat is old, and a restart must not retire the whole fleet.
//! - **Forgotten**: silent for longer than `ORCA_RELAY_CELL_FORGET_MS`: every row of the cell
//!   but the operator's admit-mode record is deleted by the `fleet-sweeper` thread
//!   ([`run_sweeper`]), with the same uptime rule. A forgotten cell that comes back registers
//!   again with its next heartbeat, in the mode its operator recorded (SPEC §12).
//!
//! The judgements are pure functions of a [`CellRow`] (whose ages the database computed) and
//! this director's uptime; only [`run_sweeper`] does I/O. Must never: judge a cell by this
//! process's wall clock (ages come from the database), or retire anyone before the director
//! has been up `RETIRE_MS`.

use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::time::Duration;

use crate::clock::SharedClock;
use crate::store::{CellRow, Store};

/// Expired activity leases are deleted once they are this far past their expiry on the
/// database's clock. A lease's expiry is stamped by its cell, whose clock may be off by
/// minutes; the margin keeps a slow cell's live lease from being swept (and a lease the sweep
/// did take is written again by the cell's next renewal, within 30 s).
pub const LEASE_SWEEP_MARGIN_MS: u64 = 3_600_000;

/// The membership knobs (`ORCA_RELAY_CELL_RETIRE_MS`, `ORCA_RELAY_CELL_FORGET_MS`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rules {
    pub retire_ms: u64,
    pub forget_ms: u64,
}

impl Rules {
    pub fn from_config(config: &crate::config::Config) -> Rules {
        Rules {
            retire_ms: config.cell_retire_ms,
            forget_ms: config.cell_forget_ms,
        }
    }

    /// How silent a cell must be to count as retired, or `None` while this director has been
    /// up for less than `retire_ms` (nobody is retired yet).
    pub fn retire_after(&self, director_uptime_ms: u64) -> Option<u64> {
        (director_uptime_ms >= self.retire_ms).then_some(self.retire_ms)
    }

    /// How silent a cell must be to be forgotten, under the same uptime rule.
    pub fn forget_after(&self, director_uptime_ms: u64) -> Option<u64> {
        (director_uptime_ms >= self.retire_ms).then_some(self.forget_ms)
    }

    /// How often the sweeper runs: a tenth of the forget age, between 100 ms (tests) and a
    /// minute (production: 24 h / 10 is far longer than needed; a minute keeps the lease
    /// table small).
    pub fn sweep_period(&self) -> Duration {
        Duration::from_millis((self.forget_ms / 10).clamp(100, 60_000))
    }
}

/// The rules and when this director started (its monotonic clock), which is what every
/// judgement needs; shared by placement, the feed poller and the admin listing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Judge {
    pub rules: Rules,
    pub started_monotonic_ms: u64,
}

impl Judge {
    /// A judge for a director that starts now.
    pub fn starting_now(rules: Rules, clock: &SharedClock) -> Judge {
        Judge {
            rules,
            started_monotonic_ms: clock.monotonic_ms(),
        }
    }

    pub fn uptime_ms(&self, monotonic_now_ms: u64) -> u64 {
        monotonic_now_ms.saturating_sub(self.started_monotonic_ms)
    }

    /// [`Rules::retire_after`] at this moment.
    pub fn retire_after(&self, monotonic_now_ms: u64) -> Option<u64> {
        self.rules.retire_after(self.uptime_ms(monotonic_now_ms))
    }
}

/// A cell's place in the fleet, as `GET /v1/admin/cells` shows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Membership {
    Live,
    Draining,
    Retired,
}

impl Membership {
    pub fn as_str(self) -> &'static str {
        match self {
            Membership::Live => "live",
            Membership::Draining => "draining",
            Membership::Retired => "retired",
        }
    }
}

/// Whether `cell` is retired: silent (database clock) for longer than `retire_after_ms`, which
/// is `None` while retirement is not judged yet ([`Rules::retire_after`]).
pub fn is_retired(cell: &CellRow, retire_after_ms: Option<u64>) -> bool {
    retire_after_ms.is_some_and(|after| cell.silent_ms() > after as i64)
}

/// The cell's membership; `reports_draining` is what its seat feed last said.
pub fn membership(
    cell: &CellRow,
    reports_draining: bool,
    retire_after_ms: Option<u64>,
) -> Membership {
    if is_retired(cell, retire_after_ms) {
        Membership::Retired
    } else if reports_draining {
        Membership::Draining
    } else {
        Membership::Live
    }
}

/// The `fleet-sweeper` thread: every [`Rules::sweep_period`], once this director has been up
/// `RETIRE_MS`, forgets cells silent past `FORGET_MS` and deletes activity leases expired for
/// more than [`LEASE_SWEEP_MARGIN_MS`]. Returns when `stop` fires or its sender is dropped.
/// Several directors sweeping at once is harmless: each delete is idempotent.
pub fn run_sweeper(store: Store, rules: Rules, clock: SharedClock, stop: Receiver<()>) {
    let started = clock.monotonic_ms();
    let mut failing: Option<&'static str> = None;
    loop {
        match stop.recv_timeout(rules.sweep_period()) {
            Err(RecvTimeoutError::Timeout) => {}
            Ok(()) | Err(RecvTimeoutError::Disconnected) => return,
        }
        let uptime = clock.monotonic_ms().saturating_sub(started);
        let Some(forget_after) = rules.forget_after(uptime) else {
            continue;
        };
        let result = store
            .forget_silent_cells(forget_after as i64)
            .and_then(|forgotten| {
                for cell_id in &forgotten {
                    log::info!(
                        "orca_relay_director_cell_forgotten cell_id={cell_id} silent_for_more_than_ms={forget_after}"
                    );
                }
                store.delete_expired_leases(LEASE_SWEEP_MARGIN_MS as i64)
            });
        match result {
            Ok(leases) => {
                if leases > 0 {
                    log::info!("orca_relay_director_leases_swept count={leases}");
                }
                if failing.take().is_some() {
                    log::info!("orca_relay_director_sweep_recovered");
                }
            }
            Err(error) => {
                let reason = error.reason_code();
                if failing != Some(reason) {
                    log::warn!("orca_relay_director_sweep_failed {}", error.log_fields());
                }
                failing = Some(reason);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::CellRuntime;

    const RULES: Rules = Rules {
        retire_ms: 600_000,
        forget_ms: 86_400_000,
    };

    fn cell(registered_age_ms: i64, heartbeat_age_ms: Option<i64>) -> CellRow {
        CellRow {
            cell_id: "c1".into(),
            cell_url: "ws://c1".into(),
            internal_url: Some("http://c1".into()),
            region: "r".into(),
            incarnation: 1,
            registered_at: 0,
            registered_age_ms,
            runtime: heartbeat_age_ms.map(|age| CellRuntime {
                cell_incarnation: 1,
                started_at: 0,
                ready: true,
                connections: 0,
                last_heartbeat_at: 0,
                heartbeat_age_ms: age,
            }),
            admit_mode: "reserve".into(),
            admit_mode_updated_at: None,
            effective: None,
        }
    }

    #[test]
    fn nobody_is_retired_or_forgotten_before_the_director_has_been_up_retire_ms() {
        assert_eq!(RULES.retire_after(0), None);
        assert_eq!(RULES.retire_after(599_999), None);
        assert_eq!(RULES.retire_after(600_000), Some(600_000));
        assert_eq!(RULES.forget_after(599_999), None);
        assert_eq!(RULES.forget_after(600_000), Some(86_400_000));
        // A cell silent for a day right after a director restart is still live.
        let silent_a_day = cell(86_400_000, Some(86_400_000));
        assert!(!is_retired(&silent_a_day, RULES.retire_after(1_000)));
        assert!(is_retired(&silent_a_day, RULES.retire_after(600_000)));
    }

    #[test]
    fn silence_is_the_newer_of_heartbeat_and_registration() {
        let after = RULES.retire_after(u64::MAX);
        // Registered long ago, heartbeats fresh: live.
        assert_eq!(
            membership(&cell(90_000_000, Some(1_000)), false, after),
            Membership::Live
        );
        // Heartbeats stopped 10 min + 1 ms ago: retired.
        assert_eq!(
            membership(&cell(90_000_000, Some(600_001)), false, after),
            Membership::Retired
        );
        // Exactly the retire age is still live.
        assert_eq!(
            membership(&cell(90_000_000, Some(600_000)), false, after),
            Membership::Live
        );
        // Re-registered a moment ago (a new incarnation), old heartbeat row: live.
        assert_eq!(
            membership(&cell(500, Some(700_000)), false, after),
            Membership::Live
        );
        // Registered and never heard from since: judged by the registration.
        assert_eq!(
            membership(&cell(600_001, None), false, after),
            Membership::Retired
        );
        assert_eq!(
            membership(&cell(1_000, None), true, after),
            Membership::Draining
        );
        assert_eq!(
            membership(&cell(700_000, Some(700_000)), true, after),
            Membership::Retired,
            "a retired cell is retired whatever its last feed said"
        );
    }

    #[test]
    fn the_sweep_period_scales_with_the_forget_age() {
        assert_eq!(RULES.sweep_period(), Duration::from_secs(60));
        let short = Rules {
            retire_ms: 500,
            forget_ms: 2_000,
        };
        assert_eq!(short.sweep_period(), Duration::from_millis(200));
        let tiny = Rules {
            retire_ms: 10,
            forget_ms: 10,
        };
        assert_eq!(tiny.sweep_period(), Duration::from_millis(100));
    }
}
