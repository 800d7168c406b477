//! The cell's admission mode as the rest of the cell reads it: the applied switch, the raw
//! mode, the dead-man state, the last admit-effective row written, draining.
//!
//! Written by the `switch-watcher` (switch), the `watchdog` (raw mode, dead-man state) and the
//! `claim-loop` (effective row); read by relay threads (admission), the internal API (feed,
//! bookings) and metrics. Atomics and one short mutex; never held across I/O.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::{Mutex, MutexGuard};

use crate::carry::cell::ModeRecord;
use crate::cell::switch::Switch;

/// The dead-man's state as the cell reports it (`dead_man::window::DeadManState` mirrors it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeadManView {
    Off = 0,
    Armed = 1,
    Held = 2,
    Tripped = 3,
}

impl DeadManView {
    pub fn as_str(self) -> &'static str {
        match self {
            DeadManView::Off => "off",
            DeadManView::Armed => "armed",
            DeadManView::Held => "held",
            DeadManView::Tripped => "tripped",
        }
    }

    fn from_u8(value: u8) -> Self {
        match value {
            1 => DeadManView::Armed,
            2 => DeadManView::Held,
            3 => DeadManView::Tripped,
            _ => DeadManView::Off,
        }
    }

    pub const ALL: [DeadManView; 4] = [
        DeadManView::Off,
        DeadManView::Armed,
        DeadManView::Held,
        DeadManView::Tripped,
    ];
}

#[derive(Default)]
pub struct CellMode {
    switch: Mutex<Switch>,
    raw_reserve: AtomicBool,
    effective_reserve: AtomicBool,
    dead_man: AtomicU8,
    draining: AtomicBool,
    /// The dead-man window (0 until the watchdog starts) and the effective last contact at
    /// its last tick, for the status report (`cell::status_report`).
    window_ms: AtomicU64,
    silence_started_ms: AtomicU64,
}

impl CellMode {
    pub fn new() -> Self {
        Self::default()
    }

    fn lock_switch(&self) -> MutexGuard<'_, Switch> {
        self.switch.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn switch(&self) -> Switch {
        *self.lock_switch()
    }

    /// Publishes a newly applied switch. A switch that does not say `reserve` makes the raw
    /// mode `db` at once (SPEC §5.3: raw is `db` unless the switch says `reserve`): admission
    /// and `/internal/reserve` stop trusting bookings now, not at the watchdog's next tick,
    /// which then voids them. Only the watchdog moves the raw mode to `reserve`.
    pub fn set_switch(&self, switch: Switch) {
        *self.lock_switch() = switch;
        if !switch.says_reserve() {
            self.set_raw_reserve(false);
        }
    }

    /// The raw mode (SPEC §5.3): `reserve` only while the switch says so and the dead-man has
    /// not tripped for that generation. Held counts as reserve.
    pub fn raw_is_reserve(&self) -> bool {
        self.raw_reserve.load(Ordering::Acquire)
    }

    pub fn set_raw_reserve(&self, reserve: bool) {
        self.raw_reserve.store(reserve, Ordering::Release)
    }

    /// What this cell's admit-effective row says (last successful write).
    pub fn effective_is_reserve(&self) -> bool {
        self.effective_reserve.load(Ordering::Acquire)
    }

    pub fn set_effective_reserve(&self, reserve: bool) {
        self.effective_reserve.store(reserve, Ordering::Release)
    }

    pub fn dead_man(&self) -> DeadManView {
        DeadManView::from_u8(self.dead_man.load(Ordering::Acquire))
    }

    pub fn set_dead_man(&self, view: DeadManView) {
        self.dead_man.store(view as u8, Ordering::Release)
    }

    /// This cell's dead-man window, published once by the watchdog (0 before it starts).
    pub fn window_ms(&self) -> u64 {
        self.window_ms.load(Ordering::Acquire)
    }

    pub fn set_window_ms(&self, window_ms: u64) {
        self.window_ms.store(window_ms, Ordering::Release)
    }

    /// The effective last contact at the watchdog's last tick: the later of the last contact
    /// and the moment the current reserve generation was armed (`Window::silence_started_ms`).
    pub fn silence_started_ms(&self) -> u64 {
        self.silence_started_ms.load(Ordering::Acquire)
    }

    pub fn set_silence_started_ms(&self, at_ms: u64) {
        self.silence_started_ms.store(at_ms, Ordering::Release)
    }

    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::Acquire)
    }

    pub fn set_draining(&self) {
        self.draining.store(true, Ordering::Release)
    }
}

impl CellMode {
    pub fn record(&self, at: &crate::carry::time::Snapshot) -> ModeRecord {
        let silence_started = self.silence_started_ms();
        ModeRecord {
            switch: self.switch().into(),
            raw_reserve: self.raw_is_reserve(),
            effective_reserve: self.effective_is_reserve(),
            dead_man: self.dead_man().as_str().to_string(),
            silence_started_ago_ms: (silence_started > 0).then(|| at.age_ms(silence_started)),
        }
    }

    /// Takes a handover's mode (the window is the next process's own: its configuration's).
    pub fn restore(&self, record: &ModeRecord, carry: &crate::carry::time::Carry) {
        *self.lock_switch() = record.switch.into();
        self.set_raw_reserve(record.raw_reserve);
        self.set_effective_reserve(record.effective_reserve);
        let view = DeadManView::ALL
            .into_iter()
            .find(|view| view.as_str() == record.dead_man)
            .unwrap_or(DeadManView::Off);
        self.set_dead_man(view);
        if let Some(age) = record.silence_started_ago_ms {
            self.set_silence_started_ms(carry.moment_ms(age));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cell::switch::{AdmitMode, Flags};

    fn switch(generation: u64, admit_mode: AdmitMode) -> Switch {
        Switch {
            generation,
            flags: Flags {
                admit_mode,
                dead_man_trip_slots: None,
            },
        }
    }

    #[test]
    fn leaving_reserve_makes_raw_db_at_once_and_entering_it_waits_for_the_watchdog() {
        let mode = CellMode::new();
        mode.set_switch(switch(1, AdmitMode::Reserve));
        assert!(
            !mode.raw_is_reserve(),
            "the watchdog arms reserve, not the switch"
        );
        mode.set_raw_reserve(true);
        mode.set_switch(switch(2, AdmitMode::Reserve));
        assert!(
            mode.raw_is_reserve(),
            "a new reserve generation keeps reserve"
        );
        mode.set_switch(switch(3, AdmitMode::Db));
        assert!(!mode.raw_is_reserve());
        assert_eq!(mode.switch().generation, 3);
    }
}
