//! What a cell tells its directors about itself for `orca-relay fleet status`: the `status`
//! object it adds to its seat-feed answer (`GET /internal/seats`) and to its heartbeat
//! (`POST /v1/admin/cell-heartbeat`). Both are additive fields: a director that does not know
//! them ignores them, and a director that does tolerates a cell that lacks them (`null` in its
//! listing, `-` in the table).
//!
//! Why both: a `reserver=1` feed poll *is* dead-man contact, so a cell the director polls is
//! never held and never silent. A cell the director cannot reach (its internal URL blocked, a
//! poller that cannot get through) is exactly the one that goes held or trips, and it still
//! heartbeats to the director (cell → director, which is not contact). So the heartbeat carries
//! the same report, and the director shows whichever arrived last.
//!
//! Floor 3, plain data: built on the HTTP workers and the heartbeat thread from in-memory state
//! only ([`crate::cell::mode::CellMode`], `Contact`, the connection units, the pool's counters,
//! readiness); never from SQL, so the feed stays as cheap as it was.
//!
//! Durations, not timestamps: `windowLeftMs` and `silentMs` come from the cell's own monotonic
//! clock (the watchdog's), so no other machine's clock is compared with them.

use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::cell::mode::DeadManView;

/// The dead-man state as it travels: `off`, `armed`, `held`, `tripped`; anything else a newer
/// cell might send reads as `unknown`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DeadManReport {
    Off,
    Armed,
    Held,
    Tripped,
    #[default]
    #[serde(other)]
    Unknown,
}

impl DeadManReport {
    pub fn as_str(self) -> &'static str {
        match self {
            DeadManReport::Off => "off",
            DeadManReport::Armed => "armed",
            DeadManReport::Held => "held",
            DeadManReport::Tripped => "tripped",
            DeadManReport::Unknown => "unknown",
        }
    }
}

impl From<DeadManView> for DeadManReport {
    fn from(view: DeadManView) -> Self {
        match view {
            DeadManView::Off => DeadManReport::Off,
            DeadManView::Armed => DeadManReport::Armed,
            DeadManView::Held => DeadManReport::Held,
            DeadManView::Tripped => DeadManReport::Tripped,
        }
    }
}

/// The cell's database pool: connections in use (open minus idle) against the ceiling in force
/// (`ORCA_RELAY_DATABASE_POOL_RESERVE_MAX` while reserve or held, the full pool once tripped or
/// in `db` mode), the full pool, and callers waiting.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct PoolReport {
    pub in_use: u32,
    pub ceiling: u32,
    pub max: u32,
    pub waiters: u32,
}

/// The `status` object, version 1 of the feed and the heartbeat (fields are only ever added).
/// Read leniently: a missing field takes its default, an unknown one is ignored.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct StatusReport {
    /// SPEC §5.3's raw mode (`db` or `reserve`) and what this cell's admit-effective row says
    /// (its last successful write), as in the feed's `admitModeRaw` / `admitModeEffective`.
    pub admit_mode_raw: String,
    pub admit_mode_effective: String,
    pub dead_man: DeadManReport,
    /// This cell's dead-man window (base + SHA-256 spread).
    pub window_ms: u64,
    /// Armed: the window minus the silence so far; held or tripped: 0; off: `null`.
    pub window_left_ms: Option<u64>,
    /// Time since the last director contact (or since the reserve generation was armed, if
    /// later) while the switch says reserve; `null` when off.
    pub silent_ms: Option<u64>,
    /// The cell's own view of the trip-slot claim: tripped, and its admit-effective row (last
    /// successful write) says `db`. That row is what other cells' claims count.
    pub holds_trip_slot: bool,
    /// `deadManTripSlots` of the applied switch; `null` when absent (no cap).
    pub trip_slots: Option<u32>,
    /// The applied switch generation (0: none applied, the defaults).
    pub switch_generation: u64,
    /// Connection units in use (sockets and bookings) and `ORCA_RELAY_CONNECTION_CAP`.
    pub connections: u64,
    pub connection_cap: u64,
    pub pool: PoolReport,
    /// `/ready` answers 200 (degraded included).
    pub ready: bool,
}

/// Builds the cell's report now; provided by the role wiring (`roles::cell_runtime`).
pub type ReportFn = Arc<dyn Fn() -> StatusReport + Send + Sync>;

/// The window left at `now_ms` (see [`StatusReport::window_left_ms`]). `silence_started_ms` is
/// the effective last contact: the later of the last contact and the moment the current
/// reserve generation was armed.
pub fn window_left_ms(
    state: DeadManView,
    window_ms: u64,
    silence_started_ms: u64,
    now_ms: u64,
) -> Option<u64> {
    match state {
        DeadManView::Off => None,
        DeadManView::Armed => {
            Some(window_ms.saturating_sub(now_ms.saturating_sub(silence_started_ms)))
        }
        DeadManView::Held | DeadManView::Tripped => Some(0),
    }
}

/// The silence at `now_ms` while the switch says reserve; `None` when off.
pub fn silent_ms(state: DeadManView, silence_started_ms: u64, now_ms: u64) -> Option<u64> {
    match state {
        DeadManView::Off => None,
        _ => Some(now_ms.saturating_sub(silence_started_ms)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn the_window_left_counts_down_while_armed_and_is_zero_once_past() {
        let cases = [
            (DeadManView::Off, 10_000, None),
            (DeadManView::Armed, 10_000, Some(60_000)),
            (DeadManView::Armed, 25_000, Some(45_000)),
            (DeadManView::Armed, 200_000, Some(0)),
            (DeadManView::Held, 80_000, Some(0)),
            (DeadManView::Tripped, 80_000, Some(0)),
        ];
        for (state, now, left) in cases {
            assert_eq!(
                window_left_ms(state, 60_000, 10_000, now),
                left,
                "{state:?} at {now}"
            );
        }
        assert_eq!(
            window_left_ms(DeadManView::Armed, 60_000, 20_000, 10_000),
            Some(60_000),
            "a contact stamped after now (two workers racing) is no silence"
        );
        assert_eq!(silent_ms(DeadManView::Held, 10_000, 80_000), Some(70_000));
        assert_eq!(silent_ms(DeadManView::Off, 10_000, 80_000), None);
    }

    #[test]
    fn the_report_travels_in_camel_case_and_reads_back_leniently() {
        let report = StatusReport {
            admit_mode_raw: "reserve".into(),
            admit_mode_effective: "reserve".into(),
            dead_man: DeadManReport::Held,
            window_ms: 61_000,
            window_left_ms: Some(0),
            silent_ms: Some(75_000),
            holds_trip_slot: false,
            trip_slots: Some(2),
            switch_generation: 12,
            connections: 40,
            connection_cap: 1_000,
            pool: PoolReport {
                in_use: 2,
                ceiling: 4,
                max: 10,
                waiters: 0,
            },
            ready: true,
        };
        let value = serde_json::to_value(&report).unwrap();
        assert_eq!(
            value,
            json!({"admitModeRaw": "reserve", "admitModeEffective": "reserve",
                   "deadMan": "held", "windowMs": 61_000, "windowLeftMs": 0, "silentMs": 75_000,
                   "holdsTripSlot": false, "tripSlots": 2, "switchGeneration": 12,
                   "connections": 40, "connectionCap": 1_000,
                   "pool": {"inUse": 2, "ceiling": 4, "max": 10, "waiters": 0},
                   "ready": true})
        );
        assert_eq!(
            serde_json::from_value::<StatusReport>(value).unwrap(),
            report
        );
        // A newer cell: an unknown state and extra fields; an older one: fields missing.
        let newer: StatusReport = serde_json::from_value(
            json!({"deadMan": "sleeping", "somethingNew": [1], "tripSlots": null}),
        )
        .unwrap();
        assert_eq!(newer.dead_man, DeadManReport::Unknown);
        assert_eq!(newer.trip_slots, None);
        assert_eq!(newer.pool, PoolReport::default());
        assert!(serde_json::from_value::<StatusReport>(json!({"windowMs": "x"})).is_err());
    }
}
