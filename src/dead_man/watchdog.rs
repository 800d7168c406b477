//! The `watchdog` thread: the dead-man ticker (SPEC §5.5).
//!
//! Every tick (1 s in production) it reads the applied switch and the last contact, feeds the
//! pure [`Window`], and carries out what the window decides: ask `claim-loop` for a permit,
//! log a held cell once per silence, trip (void bookings, lift the pool ceiling, start
//! re-registration, close no socket), or release a dropped permit's slot. It publishes the raw
//! mode and the dead-man state to [`CellMode`] and sets the pool ceiling: a reserve (or held)
//! cell runs on `ORCA_RELAY_DATABASE_POOL_RESERVE_MAX`, a tripped or `db` cell on the full pool.
//! It never touches the database itself and never blocks on the claim loop.
//!
//! A gap in its own ticks (the process was stopped: SIGSTOP, a VM pause, a debugger) is told
//! from director silence by [`PauseGuard`]: it logs `orca_relay_dead_man_pause_detected` and
//! gives contact one `FEED_POLL_MS` to resume before the window judges silence again.

use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::Arc;
use std::time::Duration;

use crate::cell::bookings::Bookings;
use crate::cell::contact::Contact;
use crate::cell::mode::{CellMode, DeadManView};
use crate::clock::SharedClock;
use crate::config::Timings;
use crate::dead_man::pause::PauseGuard;
use crate::dead_man::window::{Action, ClaimResult, DeadManState, Mode, TickInput, Window};
use crate::dead_man::writer::{ClaimRequest, WriterHandle};
use crate::metrics::{Gauge, Registry};
use crate::store::Store;

/// The tick period: 1 s in production; shrunk timings tick proportionally faster so tests of
/// a 2 s window are not quantised by a 1 s tick.
pub fn tick_period(timings: &Timings) -> Duration {
    Duration::from_millis((timings.dead_man_base_ms / 20).clamp(10, 1_000))
}

pub struct Watchdog {
    pub cell_id: String,
    pub timings: Timings,
    pub clock: SharedClock,
    pub mode: Arc<CellMode>,
    pub contact: Contact,
    pub bookings: Arc<Bookings>,
    pub writer: WriterHandle,
    pub answers: Receiver<ClaimResult>,
    pub store: Store,
    pub pool_max: u32,
    pub pool_reserve_max: u32,
    /// Starts re-registration of memory- and booking-admitted controls after a trip.
    pub on_trip: Box<dyn Fn() + Send>,
    pub registry: Registry,
    /// The window to go on with (a live handover's, or this process's own after a failed
    /// one); `None` starts a fresh one.
    pub window: Option<Window>,
}

fn view(state: DeadManState) -> DeadManView {
    match state {
        DeadManState::Off => DeadManView::Off,
        DeadManState::Armed => DeadManView::Armed,
        DeadManState::Held => DeadManView::Held,
        DeadManState::Tripped => DeadManView::Tripped,
    }
}

impl Watchdog {
    /// The thread body; returns when `stop` receives or its sender is dropped, with the window
    /// as it stands and the channel of claim answers (a live handover carries the window and
    /// the answers not taken yet).
    /// Beats once a tick (a critical thread; its tick is at most a second).
    pub fn run(
        mut self,
        stop: Receiver<()>,
        beat: &crate::liveness::Beat,
    ) -> (Window, Receiver<ClaimResult>) {
        let mut window = self
            .window
            .take()
            .unwrap_or_else(|| Window::new(&self.cell_id, &self.timings));
        let period = tick_period(&self.timings);
        self.registry
            .gauge(
                "orca_relay_dead_man_window_ms",
                "This cell's dead-man window (base + SHA-256 spread).",
                &[],
            )
            .set(window.window_ms() as i64);
        self.mode.set_window_ms(window.window_ms());
        let silence: Gauge = self.registry.gauge(
            "orca_relay_dead_man_silence_ms",
            "Time since the last director contact while the switch says reserve.",
            &[],
        );
        let mut ceiling = None;
        // A pause of this process (SIGSTOP, a VM pause) is not director silence: after a tick
        // gap, contact gets one feed-poll period (the director's next poll) to resume.
        let mut pause = PauseGuard::new(period.as_millis() as u64, self.timings.feed_poll_ms);
        log::info!(
            "orca_relay_dead_man_started cell_id={} window_ms={}",
            self.cell_id,
            window.window_ms()
        );
        loop {
            beat.beat();
            match stop.recv_timeout(period) {
                Err(RecvTimeoutError::Timeout) => {}
                _ => {
                    // Its last word: no tick, so no write of this cell's row, comes after this
                    // line (a drain's final write must come after it).
                    log::info!(
                        "orca_relay_dead_man_stopped cell_id={} state={}",
                        self.cell_id,
                        window.state().as_str()
                    );
                    return (window, self.answers);
                }
            }
            let observed = pause.observe(self.clock.monotonic_ms());
            if let Some(gap_ms) = observed.pause_gap_ms {
                log::warn!(
                    "orca_relay_dead_man_pause_detected cell_id={} gap_ms={gap_ms} resume_grace_ms={}",
                    self.cell_id,
                    self.timings.feed_poll_ms
                );
            }
            if !observed.judge_silence {
                // Neither the window nor a claim answer is judged until contact has had its
                // chance; answers wait in their channel.
                continue;
            }
            let now = self.clock.now_ms();
            let switch = self.mode.switch();
            let says_reserve = switch.says_reserve();
            let actions = window.tick(TickInput {
                now_ms: now,
                switch_generation: switch.generation,
                switch_says_reserve: says_reserve,
                slots: switch.flags.dead_man_trip_slots,
                last_contact_ms: self.contact.last(),
            });
            self.writer.tick(
                says_reserve,
                window.raw_mode(),
                window.state() == DeadManState::Tripped,
            );
            self.carry_out(actions);
            while let Ok(result) = self.answers.try_recv() {
                let actions = window.on_claim_result(result, now);
                self.carry_out(actions);
            }

            let reserve = window.raw_mode() == Mode::Reserve;
            self.mode.set_raw_reserve(reserve);
            self.mode.set_dead_man(view(window.state()));
            self.mode
                .set_silence_started_ms(window.silence_started_ms());
            silence.set(if says_reserve {
                window.silence_ms() as i64
            } else {
                0
            });
            let wanted = if reserve {
                self.pool_reserve_max
            } else {
                self.pool_max
            };
            if ceiling != Some(wanted) {
                self.store.set_pool_ceiling(wanted);
                ceiling = Some(wanted);
            }
            if !says_reserve {
                let voided = self.bookings.void_all();
                if voided > 0 {
                    log::info!(
                        "orca_relay_bookings_voided cell_id={} count={voided} reason=switch_not_reserve",
                        self.cell_id
                    );
                }
            }
            self.bookings.expire(now);
        }
    }

    fn carry_out(&self, actions: Vec<Action>) {
        for action in actions {
            let line = action.log_line(&self.cell_id);
            match action {
                Action::RequestPermit {
                    generation,
                    silence_started_ms,
                    slots,
                } => {
                    self.writer.request_claim(ClaimRequest {
                        generation,
                        silence_started_ms,
                        slots,
                    });
                }
                Action::LogHeld { .. } => {
                    if let Some(line) = line {
                        log::warn!("{line}");
                    }
                }
                Action::Trip { .. } => {
                    let voided = self.bookings.void_all();
                    if let Some(line) = line {
                        log::warn!("{line} bookings_voided={voided}");
                    }
                    // Raw mode db at once: admission stops trusting memory before the next
                    // tick, and the full pool opens for re-registration.
                    self.mode.set_raw_reserve(false);
                    self.mode.set_dead_man(DeadManView::Tripped);
                    self.store.set_pool_ceiling(self.pool_max);
                    self.writer.tick(true, Mode::Db, true);
                    (self.on_trip)();
                }
                Action::ReleaseSlot { .. } => {
                    if let Some(line) = line {
                        log::info!("{line}");
                    }
                    self.writer.release_slot();
                }
            }
        }
    }
}
