//! The dead-man window (SPEC §5.5): the pure state machine that decides whether a reserve cell
//! has lost its director long enough to fall back to database mode ("trip"), and whether it may.
//!
//! Owns: the armed switch generation, the trip latch, the held/permit bookkeeping.
//! Runs on: the `watchdog` thread, which calls [`Window::tick`] every second with the switch and
//! the last contact, sends [`Action::RequestPermit`] to `claim-loop`, feeds the answers back
//! through [`Window::on_claim_result`], and carries out [`Action::Trip`] (void bookings,
//! re-register) and [`Action::ReleaseSlot`] (ask `claim-loop` to write `reserve` again).
//! Must never: read a clock (time comes in as `now_ms`), do I/O, or trip on a permit that was
//! asked for another generation or another silence.
//!
//! Silence: the cell's *effective* last contact is `max(last contact, the moment the current
//! generation was armed)`; a silence is identified by that timestamp (`silence_started_ms`). A
//! contact moves it, so a permit asked for an older silence can be recognised and dropped.

use sha2::{Digest, Sha256};

use crate::carry::cell::WindowRecord;
use crate::config::Timings;

/// A cell's raw admission mode (SPEC §5.3): `db` unless the switch says `reserve` and the
/// dead-man has not tripped for that generation. Also the value of the admit-effective row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Db,
    Reserve,
}

impl Mode {
    pub fn as_str(self) -> &'static str {
        match self {
            Mode::Db => "db",
            Mode::Reserve => "reserve",
        }
    }
}

/// Where the dead-man stands after the last tick.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeadManState {
    /// The switch does not say `reserve`: the dead-man has nothing to guard (raw mode `db`).
    Off,
    /// Reserve, within the window (raw mode `reserve`).
    Armed,
    /// Reserve, window passed, no permit (yet): stays `reserve` (raw mode `reserve`).
    Held,
    /// Tripped for the current generation, latched until a higher generation re-arms (`db`).
    Tripped,
}

/// One evaluation's inputs, read by the watchdog just before the tick.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TickInput {
    pub now_ms: u64,
    pub switch_generation: u64,
    pub switch_says_reserve: bool,
    /// `deadManTripSlots`: `None` = no cap (trip as soon as the window passes).
    pub slots: Option<u32>,
    /// The last contact (a `reserver=1` feed poll or a real booking), if any since start.
    pub last_contact_ms: Option<u64>,
}

/// The claim loop's answer to an [`Action::RequestPermit`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClaimResult {
    pub generation: u64,
    pub silence_started_ms: u64,
    pub permit: bool,
}

/// What the watchdog must do after a tick or a claim result.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// Ask `claim-loop` for a trip slot for this silence of this generation.
    RequestPermit {
        generation: u64,
        silence_started_ms: u64,
        slots: u32,
    },
    /// Trip now: void bookings, re-register, raw mode `db`, log the tripped line.
    Trip { generation: u64, silent_ms: u64 },
    /// Log `orca_relay_cell_reserve_dead_man_held` (once per silence).
    LogHeld {
        generation: u64,
        silent_ms: u64,
        slots: u32,
    },
    /// A permit was dropped while the cell stays `reserve`. The claim that granted it wrote
    /// this cell's row `db`, so the row now holds a slot the cell will not use and tells the
    /// director's placement path the cell is in `db` mode. The watchdog must ask `claim-loop`
    /// to write `reserve` again (`WriterHandle::release_slot`), which frees the slot.
    ReleaseSlot {
        generation: u64,
        silence_started_ms: u64,
        reason: &'static str,
    },
}

impl Action {
    /// The log line this action stands for, if it has one.
    pub fn log_line(&self, cell_id: &str) -> Option<String> {
        match self {
            Action::RequestPermit { .. } => None,
            Action::Trip {
                generation,
                silent_ms,
            } => Some(format!(
                "orca_relay_cell_reserve_dead_man_tripped cell_id={cell_id} generation={generation} silent_ms={silent_ms}"
            )),
            Action::LogHeld {
                generation,
                silent_ms,
                slots,
            } => Some(format!(
                "orca_relay_cell_reserve_dead_man_held cell_id={cell_id} generation={generation} silent_ms={silent_ms} slots={slots}"
            )),
            Action::ReleaseSlot {
                generation,
                silence_started_ms,
                reason,
            } => Some(format!(
                "orca_relay_cell_dead_man_permit_dropped cell_id={cell_id} generation={generation} silence_started_ms={silence_started_ms} reason={reason}"
            )),
        }
    }
}

/// The cell's dead-man window: base + (first 4 bytes of SHA-256(cell id), big-endian) mod
/// (spread + 1). With the production 60 s + 60 s every cell gets a stable window in 60–120 s,
/// so during a fleet-wide director outage the earliest windows claim slots first.
pub fn window_ms(cell_id: &str, base_ms: u64, spread_ms: u64) -> u64 {
    let digest = Sha256::digest(cell_id.as_bytes());
    let prefix = u32::from_be_bytes([digest[0], digest[1], digest[2], digest[3]]);
    base_ms + u64::from(prefix) % (spread_ms + 1)
}

/// The state machine. See the module header.
#[derive(Debug, Clone)]
pub struct Window {
    window_ms: u64,
    trip_claim_retry_ms: u64,
    /// The generation armed for reserve; `None` while the switch is off reserve.
    generation: Option<u64>,
    /// When the current generation was armed: the floor of the effective contact.
    armed_at_ms: u64,
    tripped: bool,
    slots: Option<u32>,
    state: DeadManState,
    now_ms: u64,
    silence_started_ms: u64,
    /// The silence whose held line was logged.
    held_logged_for: Option<u64>,
    /// The last permit request: (silence it was for, when it was asked).
    last_request: Option<(u64, u64)>,
}

impl Window {
    /// The production window for `cell_id` from the configured timings.
    pub fn new(cell_id: &str, timings: &Timings) -> Window {
        Window::with_window_ms(
            window_ms(
                cell_id,
                timings.dead_man_base_ms,
                timings.dead_man_spread_ms,
            ),
            timings.trip_claim_retry_ms,
        )
    }

    /// A window of exactly `window_ms`, asking for permits at most every `trip_claim_retry_ms`.
    pub fn with_window_ms(window_ms: u64, trip_claim_retry_ms: u64) -> Window {
        Window {
            window_ms,
            trip_claim_retry_ms,
            generation: None,
            armed_at_ms: 0,
            tripped: false,
            slots: None,
            state: DeadManState::Off,
            now_ms: 0,
            silence_started_ms: 0,
            held_logged_for: None,
            last_request: None,
        }
    }

    pub fn state(&self) -> DeadManState {
        self.state
    }

    /// The raw mode (SPEC §5.3) after the last tick.
    pub fn raw_mode(&self) -> Mode {
        match self.state {
            DeadManState::Armed | DeadManState::Held => Mode::Reserve,
            DeadManState::Off | DeadManState::Tripped => Mode::Db,
        }
    }

    pub fn window_ms(&self) -> u64 {
        self.window_ms
    }

    /// How long the cell has been without contact at the last tick (0 when off reserve).
    pub fn silence_ms(&self) -> u64 {
        match self.state {
            DeadManState::Off => 0,
            _ => self.now_ms.saturating_sub(self.silence_started_ms),
        }
    }

    /// The effective last contact at the last tick (the later of the last contact and the
    /// moment the current generation was armed); 0 before the first reserve tick.
    pub fn silence_started_ms(&self) -> u64 {
        self.silence_started_ms
    }

    /// The generation the dead-man is armed for, if the switch says reserve.
    pub fn generation(&self) -> Option<u64> {
        self.generation
    }

    /// The five steps of SPEC §5.5, in order.
    pub fn tick(&mut self, input: TickInput) -> Vec<Action> {
        self.now_ms = input.now_ms;

        // 1. Switch not reserve: db, forget the generation (and with it any trip).
        if !input.switch_says_reserve {
            self.generation = None;
            self.tripped = false;
            self.held_logged_for = None;
            self.last_request = None;
            self.state = DeadManState::Off;
            return Vec::new();
        }

        // 2. A new generation saying reserve: a fresh window, any trip cleared (re-armed).
        if self.generation != Some(input.switch_generation) {
            self.generation = Some(input.switch_generation);
            self.armed_at_ms = input.now_ms;
            self.tripped = false;
            self.held_logged_for = None;
            self.last_request = None;
        }
        let generation = input.switch_generation;
        self.slots = input.slots;
        self.silence_started_ms = input.last_contact_ms.unwrap_or(0).max(self.armed_at_ms);

        // 3. Tripped for this generation: latched, contact does not re-arm.
        if self.tripped {
            self.state = DeadManState::Tripped;
            return Vec::new();
        }

        // 4. Within the window: reserve. A held cell whose contact returned is armed again.
        let silent_ms = input.now_ms.saturating_sub(self.silence_started_ms);
        if silent_ms <= self.window_ms {
            self.state = DeadManState::Armed;
            return Vec::new();
        }

        // 5. The window passed.
        let Some(slots) = input.slots else {
            self.tripped = true;
            self.state = DeadManState::Tripped;
            return vec![Action::Trip {
                generation,
                silent_ms,
            }];
        };
        self.state = DeadManState::Held;
        let mut actions = Vec::new();
        if self.held_logged_for != Some(self.silence_started_ms) {
            self.held_logged_for = Some(self.silence_started_ms);
            actions.push(Action::LogHeld {
                generation,
                silent_ms,
                slots,
            });
        }
        if slots > 0 && self.permit_request_due(input.now_ms) {
            self.last_request = Some((self.silence_started_ms, input.now_ms));
            actions.push(Action::RequestPermit {
                generation,
                silence_started_ms: self.silence_started_ms,
                slots,
            });
        }
        actions
    }

    /// Due on a new silence, or `trip_claim_retry_ms` after the last request for this one.
    fn permit_request_due(&self, now_ms: u64) -> bool {
        match self.last_request {
            Some((silence, asked_at)) if silence == self.silence_started_ms => {
                now_ms.saturating_sub(asked_at) >= self.trip_claim_retry_ms
            }
            _ => true,
        }
    }

    /// Takes the claim loop's answer. The permit is judged against the state of the last tick,
    /// so the watchdog should tick with fresh contact before delivering answers.
    ///
    /// - A refusal: nothing to do; the cell stays held and asks again when the retry is due.
    /// - A permit for the current generation and the current silence, while held: trip.
    /// - Any other permit is dropped. If the cell is still `reserve` (not tripped), the claim
    ///   left its row saying `db`, so [`Action::ReleaseSlot`] asks for a `reserve` write. If
    ///   the cell is tripped or the switch left reserve, the row should say `db` anyway and
    ///   nothing is released.
    pub fn on_claim_result(&mut self, result: ClaimResult, now_ms: u64) -> Vec<Action> {
        if !result.permit {
            return Vec::new();
        }
        let Some(generation) = self.generation else {
            return Vec::new(); // Switch off reserve: the db row is owed anyway.
        };
        if self.tripped {
            return Vec::new(); // Already db for this generation; the row says db.
        }
        let release = |reason| {
            vec![Action::ReleaseSlot {
                generation: result.generation,
                silence_started_ms: result.silence_started_ms,
                reason,
            }]
        };
        if result.generation != generation {
            return release("earlier_generation");
        }
        if result.silence_started_ms != self.silence_started_ms {
            return release("contact_returned");
        }
        if self.slots == Some(0) {
            return release("slots_zero");
        }
        if self.state != DeadManState::Held {
            return release("not_held");
        }
        self.tripped = true;
        self.state = DeadManState::Tripped;
        self.now_ms = self.now_ms.max(now_ms);
        vec![Action::Trip {
            generation,
            silent_ms: now_ms.saturating_sub(self.silence_started_ms),
        }]
    }
}

impl DeadManState {
    pub fn as_str(self) -> &'static str {
        match self {
            DeadManState::Off => "off",
            DeadManState::Armed => "armed",
            DeadManState::Held => "held",
            DeadManState::Tripped => "tripped",
        }
    }

    fn parse(text: &str) -> DeadManState {
        match text {
            "armed" => DeadManState::Armed,
            "held" => DeadManState::Held,
            "tripped" => DeadManState::Tripped,
            _ => DeadManState::Off,
        }
    }
}

impl Window {
    pub fn record(&self, at: &crate::carry::time::Snapshot) -> WindowRecord {
        WindowRecord {
            generation: self.generation,
            armed_ago_ms: at.age_ms(self.armed_at_ms),
            tripped: self.tripped,
            slots: self.slots,
            state: self.state.as_str().to_string(),
            silence_started_ago_ms: at.age_ms(self.silence_started_ms),
            held_logged_for_ago_ms: self.held_logged_for.map(|silence| at.age_ms(silence)),
            last_request_ago_ms: self
                .last_request
                .map(|(silence, asked)| (at.age_ms(silence), at.age_ms(asked))),
        }
    }

    /// This window (its length and retry from the configuration) in the state a handover
    /// carried: the same generation, latch, held line and permit request, every moment moved to
    /// this process's clock by its age, so the window, a held cell's next claim and the latch
    /// go on as they were.
    pub fn restored(mut self, record: &WindowRecord, carry: &crate::carry::time::Carry) -> Window {
        self.generation = record.generation;
        self.armed_at_ms = carry.moment_ms(record.armed_ago_ms);
        self.tripped = record.tripped;
        self.slots = record.slots;
        self.state = DeadManState::parse(&record.state);
        self.now_ms = carry.now_ms;
        self.silence_started_ms = carry.moment_ms(record.silence_started_ago_ms);
        self.held_logged_for = record
            .held_logged_for_ago_ms
            .map(|age| carry.moment_ms(age));
        self.last_request = record
            .last_request_ago_ms
            .map(|(silence, asked)| (carry.moment_ms(silence), carry.moment_ms(asked)));
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const WINDOW: u64 = 90_000;
    const RETRY: u64 = 30_000;
    const T0: u64 = 1_700_000_000_000;

    fn window() -> Window {
        Window::with_window_ms(WINDOW, RETRY)
    }

    fn reserve(
        now_ms: u64,
        generation: u64,
        slots: Option<u32>,
        contact: Option<u64>,
    ) -> TickInput {
        TickInput {
            now_ms,
            switch_generation: generation,
            switch_says_reserve: true,
            slots,
            last_contact_ms: contact,
        }
    }

    /// Ticks every second from `from` to `to` inclusive and collects the actions with their time.
    fn tick_range(
        w: &mut Window,
        from: u64,
        to: u64,
        input: impl Fn(u64) -> TickInput,
    ) -> Vec<(u64, Action)> {
        let mut out = Vec::new();
        let mut now = from;
        while now <= to {
            out.extend(w.tick(input(now)).into_iter().map(|a| (now, a)));
            now += 1_000;
        }
        out
    }

    fn permit_requests(actions: &[(u64, Action)]) -> Vec<(u64, u64)> {
        actions
            .iter()
            .filter_map(|(at, a)| match a {
                Action::RequestPermit {
                    silence_started_ms, ..
                } => Some((*at, *silence_started_ms)),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn window_is_base_plus_hash_mod_spread() {
        // printf c7 | sha256sum → f28d5b0d…; 0xf28d5b0d = 4069350157; 4069350157 % 60001 = 22336.
        assert_eq!(window_ms("c7", 60_000, 60_000), 82_336);
        // printf c8 | sha256sum → 7ed6a837…; 2127996983 % 60001 = 1517.
        assert_eq!(window_ms("c8", 60_000, 60_000), 61_517);
        // printf c1 | sha256sum → d0f631ca…; 3505795530 % 60001 = 57102.
        assert_eq!(window_ms("c1", 60_000, 60_000), 117_102);
        assert_eq!(window_ms("c7", 60_000, 0), 60_000, "no spread: the base");
    }

    #[test]
    fn windows_spread_cells_within_60_to_120_seconds() {
        let timings = Timings::default();
        let a = Window::new("c7", &timings).window_ms();
        let b = Window::new("c8", &timings).window_ms();
        assert_ne!(a, b);
        for id in ["c7", "c8", "c1", "c32", "asia-3", "combined"] {
            let w = Window::new(id, &timings).window_ms();
            assert!((60_000..=120_000).contains(&w), "{id}: {w}");
        }
    }

    #[test]
    fn without_the_flag_trips_at_exactly_window_plus_one() {
        let mut w = window();
        assert!(w.tick(reserve(T0, 1, None, None)).is_empty());
        assert_eq!(w.state(), DeadManState::Armed);
        assert_eq!(w.raw_mode(), Mode::Reserve);
        let contact = T0 + 5_000;
        assert!(w
            .tick(reserve(contact + WINDOW, 1, None, Some(contact)))
            .is_empty());
        assert_eq!(
            w.state(),
            DeadManState::Armed,
            "exactly the window is still reserve"
        );
        assert_eq!(w.silence_ms(), WINDOW);
        let actions = w.tick(reserve(contact + WINDOW + 1, 1, None, Some(contact)));
        assert_eq!(
            actions,
            vec![Action::Trip {
                generation: 1,
                silent_ms: WINDOW + 1
            }]
        );
        assert_eq!(w.state(), DeadManState::Tripped);
        assert_eq!(w.raw_mode(), Mode::Db);
        assert_eq!(
            actions[0].log_line("c7").unwrap(),
            "orca_relay_cell_reserve_dead_man_tripped cell_id=c7 generation=1 silent_ms=90001"
        );
        assert!(w
            .tick(reserve(contact + WINDOW + 2, 1, None, Some(contact)))
            .is_empty());
    }

    #[test]
    fn a_fresh_generation_counts_silence_from_its_arming_not_an_old_contact() {
        let mut w = window();
        // The last contact was long ago; arming at T0 still gives a full window.
        assert!(w.tick(reserve(T0, 1, None, Some(T0 - 500_000))).is_empty());
        assert!(w
            .tick(reserve(T0 + WINDOW, 1, None, Some(T0 - 500_000)))
            .is_empty());
        assert_eq!(w.tick(reserve(T0 + WINDOW + 1, 1, None, None)).len(), 1);
    }

    #[test]
    fn held_until_a_permit_then_latched() {
        let mut w = window();
        w.tick(reserve(T0, 1, Some(2), Some(T0)));
        let actions = w.tick(reserve(T0 + WINDOW + 1, 1, Some(2), Some(T0)));
        assert_eq!(
            actions,
            vec![
                Action::LogHeld {
                    generation: 1,
                    silent_ms: WINDOW + 1,
                    slots: 2
                },
                Action::RequestPermit {
                    generation: 1,
                    silence_started_ms: T0,
                    slots: 2
                },
            ]
        );
        assert_eq!(w.state(), DeadManState::Held);
        assert_eq!(w.raw_mode(), Mode::Reserve, "held stays reserve");

        // Refused: still held.
        let refusal = ClaimResult {
            generation: 1,
            silence_started_ms: T0,
            permit: false,
        };
        assert!(w.on_claim_result(refusal, T0 + WINDOW + 2).is_empty());
        assert_eq!(w.state(), DeadManState::Held);

        // Permit: trip and latch.
        let permit = ClaimResult {
            permit: true,
            ..refusal
        };
        let at = T0 + WINDOW + 31_000;
        w.tick(reserve(at, 1, Some(2), Some(T0)));
        assert_eq!(
            w.on_claim_result(permit, at),
            vec![Action::Trip {
                generation: 1,
                silent_ms: WINDOW + 31_000
            }]
        );
        assert_eq!(w.state(), DeadManState::Tripped);
        assert_eq!(w.raw_mode(), Mode::Db);

        // Contact after the trip does not re-arm, nor does the same generation again.
        let back = at + 10_000;
        let actions = tick_range(&mut w, back, back + 600_000, |now| {
            reserve(now, 1, Some(2), Some(now))
        });
        assert!(actions.is_empty(), "{actions:?}");
        assert_eq!(w.state(), DeadManState::Tripped);

        // Only a higher generation saying reserve re-arms.
        let later = back + 700_000;
        assert!(w.tick(reserve(later, 2, Some(2), Some(back))).is_empty());
        assert_eq!(w.state(), DeadManState::Armed);
        assert_eq!(w.raw_mode(), Mode::Reserve);
    }

    #[test]
    fn slot_zero_never_trips_nor_asks() {
        let mut w = window();
        let actions = tick_range(&mut w, T0, T0 + 30 * 60_000, |now| {
            reserve(now, 4, Some(0), Some(T0))
        });
        assert!(permit_requests(&actions).is_empty());
        assert!(!actions
            .iter()
            .any(|(_, a)| matches!(a, Action::Trip { .. })));
        let held: Vec<_> = actions
            .iter()
            .filter(|(_, a)| matches!(a, Action::LogHeld { .. }))
            .collect();
        assert_eq!(held.len(), 1, "held once for the one silence");
        assert_eq!(held[0].0, T0 + WINDOW + 1_000, "first tick past the window");
        assert_eq!(w.state(), DeadManState::Held);
        assert_eq!(w.raw_mode(), Mode::Reserve);
        // A cap of 0 never asks, so a permit can only be stray; it still must not trip the cell.
        let stray = ClaimResult {
            generation: 4,
            silence_started_ms: T0,
            permit: true,
        };
        assert!(matches!(
            w.on_claim_result(stray, T0 + 30 * 60_000)[..],
            [Action::ReleaseSlot {
                reason: "slots_zero",
                ..
            }]
        ));
        assert_eq!(w.state(), DeadManState::Held);
    }

    #[test]
    fn a_permit_for_a_silence_that_contact_ended_is_dropped_and_released() {
        let mut w = window();
        w.tick(reserve(T0, 1, Some(1), Some(T0)));
        let past = T0 + WINDOW + 1;
        assert_eq!(
            permit_requests(&tick_range(&mut w, past, past, |now| reserve(
                now,
                1,
                Some(1),
                Some(T0)
            )))
            .len(),
            1
        );
        // The director comes back before the answer arrives.
        let contact = past + 500;
        w.tick(reserve(past + 1_000, 1, Some(1), Some(contact)));
        assert_eq!(
            w.state(),
            DeadManState::Armed,
            "contact returned: armed again"
        );
        let late_permit = ClaimResult {
            generation: 1,
            silence_started_ms: T0,
            permit: true,
        };
        let actions = w.on_claim_result(late_permit, past + 1_500);
        assert_eq!(
            actions,
            vec![Action::ReleaseSlot {
                generation: 1,
                silence_started_ms: T0,
                reason: "contact_returned"
            }]
        );
        assert!(actions[0]
            .log_line("c7")
            .unwrap()
            .starts_with("orca_relay_cell_dead_man_permit_dropped cell_id=c7 "));
        assert_eq!(w.state(), DeadManState::Armed);
        assert_eq!(w.raw_mode(), Mode::Reserve);

        // Even if the new silence has also passed its window, the old permit stays void.
        let second = contact + WINDOW + 1;
        let actions = w.tick(reserve(second, 1, Some(1), Some(contact)));
        assert_eq!(w.state(), DeadManState::Held);
        assert!(actions.contains(&Action::RequestPermit {
            generation: 1,
            silence_started_ms: contact,
            slots: 1
        }));
        assert!(matches!(
            w.on_claim_result(late_permit, second)[..],
            [Action::ReleaseSlot {
                reason: "contact_returned",
                ..
            }]
        ));
        assert_eq!(w.state(), DeadManState::Held);
    }

    #[test]
    fn a_permit_for_an_earlier_generation_is_dropped_and_released() {
        let mut w = window();
        w.tick(reserve(T0, 1, Some(1), None));
        w.tick(reserve(T0 + WINDOW + 1, 1, Some(1), None));
        // An operator writes generation 2 (still reserve) before the answer arrives.
        let rearmed = T0 + WINDOW + 2_000;
        w.tick(reserve(rearmed, 2, Some(1), None));
        assert_eq!(w.state(), DeadManState::Armed);
        let old = ClaimResult {
            generation: 1,
            silence_started_ms: T0,
            permit: true,
        };
        assert_eq!(
            w.on_claim_result(old, rearmed + 100),
            vec![Action::ReleaseSlot {
                generation: 1,
                silence_started_ms: T0,
                reason: "earlier_generation"
            }]
        );
        assert_eq!(w.state(), DeadManState::Armed);
    }

    #[test]
    fn a_permit_after_the_switch_left_reserve_is_dropped_without_release() {
        let mut w = window();
        w.tick(reserve(T0, 1, Some(1), None));
        w.tick(reserve(T0 + WINDOW + 1, 1, Some(1), None));
        let off = TickInput {
            switch_says_reserve: false,
            ..reserve(T0 + WINDOW + 2_000, 2, Some(1), None)
        };
        w.tick(off);
        let permit = ClaimResult {
            generation: 1,
            silence_started_ms: T0,
            permit: true,
        };
        assert!(w.on_claim_result(permit, T0 + WINDOW + 2_500).is_empty());
        assert_eq!(w.state(), DeadManState::Off);
    }

    #[test]
    fn held_logs_once_per_silence() {
        let mut w = window();
        let contact_returns = T0 + 200_000;
        let actions = tick_range(&mut w, T0, T0 + 400_000, |now| {
            let contact = if now < contact_returns {
                T0
            } else {
                contact_returns
            };
            reserve(now, 1, Some(1), Some(contact))
        });
        let held: Vec<u64> = actions
            .iter()
            .filter(|(_, a)| matches!(a, Action::LogHeld { .. }))
            .map(|(at, _)| *at)
            .collect();
        // Once for the first silence, once again for the second (after contact re-armed it).
        assert_eq!(
            held,
            vec![T0 + WINDOW + 1_000, contact_returns + WINDOW + 1_000]
        );
        let line = actions
            .iter()
            .find(|(_, a)| matches!(a, Action::LogHeld { .. }))
            .and_then(|(_, a)| a.log_line("c7"))
            .unwrap();
        assert_eq!(
            line,
            "orca_relay_cell_reserve_dead_man_held cell_id=c7 generation=1 silent_ms=91000 slots=1"
        );
    }

    #[test]
    fn permit_requests_are_spaced_by_the_retry_interval() {
        let mut w = window();
        let actions = tick_range(&mut w, T0, T0 + WINDOW + 100_000, |now| {
            reserve(now, 1, Some(3), Some(T0))
        });
        let first = T0 + WINDOW + 1_000;
        assert_eq!(
            permit_requests(&actions),
            vec![
                (first, T0),
                (first + RETRY, T0),
                (first + 2 * RETRY, T0),
                (first + 3 * RETRY, T0)
            ]
        );
    }

    #[test]
    fn switch_leaving_reserve_is_off_and_db_and_forgets_the_trip() {
        let mut w = window();
        w.tick(reserve(T0, 1, None, None));
        w.tick(reserve(T0 + WINDOW + 1, 1, None, None));
        assert_eq!(w.state(), DeadManState::Tripped);
        let off = TickInput {
            switch_says_reserve: false,
            ..reserve(T0 + WINDOW + 2, 2, None, None)
        };
        assert!(w.tick(off).is_empty());
        assert_eq!(w.state(), DeadManState::Off);
        assert_eq!(w.raw_mode(), Mode::Db);
        assert_eq!(w.generation(), None);
        assert_eq!(w.silence_ms(), 0);
        // Back to reserve with a new generation: a fresh window.
        let later = T0 + 1_000_000;
        assert!(w.tick(reserve(later, 3, None, None)).is_empty());
        assert_eq!(w.state(), DeadManState::Armed);
        assert_eq!(w.tick(reserve(later + WINDOW + 1, 3, None, None)).len(), 1);
    }
}
