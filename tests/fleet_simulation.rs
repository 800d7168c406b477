//! A seeded fleet simulation of the dead-man trip slots (seed `dead-man-trip-slots.md`, SPEC
//! §5.5): 30 cells over simulated hours on one shared SQLite file, with random director
//! outages, single-cell contact losses, cell restarts (some of them long enough for a tripped
//! holder's row to go stale) and operator re-arms.
//!
//! Each cell runs the REAL pure pieces, exactly as its `watchdog` and `claim-loop` threads do:
//! a [`Window`] and a [`CellAdmitEffectiveWriter`] over the production [`StoreRow`] adapter,
//! so every row write and every slot claim is the real transaction on the real store. Two
//! simplifications: a claim runs synchronously inside the tick that asked for it, and a
//! cell's database brownouts (pool waiters, which skip refreshes and claims) are injected by
//! the scenario instead of coming from its pool.
//!
//! Cells are also paused now and then (SIGSTOP, a VM pause: 5 s to 5 min, often longer than the
//! window), as the watchdog's [`PauseGuard`] sees it: no tick while stopped, and the director's
//! next poll lands one poll period after the process resumes, so on the resume tick the last
//! contact is as old as the pause. A pause alone must never trip or hold a cell: every trip and
//! every held line must come from a silence that overlapped a real outage or partition.
//!
//! After every simulated second the test asserts, from the database itself, that the live slot
//! holders (reserve cells whose own row says `db`, refreshed within `TRIP_SLOT_STALE_MS`) never
//! outnumber `deadManTripSlots`, that each running cell's row agrees with its dead-man state,
//! and that no trip ever closed a desktop socket (desktops per cell are a count that only
//! churn and restarts may lower). Each run also checks that it actually exercised the cap:
//! trips, refusals, a full set of holders, and slots freed by re-arms and by stale rows.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use orca_relay::cell::mode::CellMode;
use orca_relay::clock::{Clock, ManualClock};
use orca_relay::config::Timings;
use orca_relay::dead_man::claim_loop::StoreRow;
use orca_relay::dead_man::pause::PauseGuard;
use orca_relay::dead_man::window::{Action, ClaimResult, DeadManState, Mode, TickInput, Window};
use orca_relay::dead_man::writer::{
    CellAdmitEffectiveWriter, ClaimAnswer, ClaimDecision, EffectiveRowStore, WriterTimings,
};
use orca_relay::metrics::Registry;
use orca_relay::store::{Store, StoreConfig};

const CELLS: usize = 30;
const T0: u64 = 1_700_000_000_000;
/// Simulated time per run.
const SIMULATED_SECONDS: u64 = 2 * 3600;

/// xorshift64: a tiny deterministic generator, so a failing seed replays exactly.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Rng {
        Rng(seed.max(1))
    }

    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x
    }

    /// True with probability 1 / `n`.
    fn one_in(&mut self, n: u64) -> bool {
        self.next().is_multiple_of(n)
    }

    /// Uniform in `low..=high`.
    fn between(&mut self, low: u64, high: u64) -> u64 {
        low + self.next() % (high - low + 1)
    }
}

/// The production adapter, with the scenario's brownouts standing in for pool waiters.
struct SimRow {
    row: StoreRow,
    brownout: Arc<AtomicBool>,
}

impl EffectiveRowStore for SimRow {
    fn write_admit_effective(&self, mode: Mode, now_ms: u64) -> Result<(), String> {
        self.row.write_admit_effective(mode, now_ms)
    }

    fn claim_trip_slot(&self, slots: u32, now_ms: u64) -> Result<ClaimAnswer, String> {
        self.row.claim_trip_slot(slots, now_ms)
    }

    fn pool_has_waiters(&self) -> bool {
        self.brownout.load(Ordering::Relaxed) || self.row.pool_has_waiters()
    }
}

/// One running process of a cell: its watchdog's window and pause guard, its claim loop's
/// writer.
struct Process {
    window: Window,
    pause: PauseGuard,
    writer: CellAdmitEffectiveWriter<SimRow>,
    last_contact_ms: Option<u64>,
}

struct Cell {
    id: String,
    /// The operator's switch generation (always `reserve` in this fleet).
    generation: u64,
    incarnations: i64,
    process: Option<Process>,
    /// While down: when the process comes back.
    up_at_ms: u64,
    /// This cell alone hears nothing from the director until then.
    partitioned_until_ms: u64,
    /// This cell's database pool has waiters until then.
    brownout_until_ms: u64,
    /// The process is stopped (SIGSTOP) until then: no tick, no contact.
    paused_until_ms: u64,
    /// The last second at which this cell really could not hear its director (an outage or a
    /// partition): a trip or a held line needs a silence that overlaps one.
    last_unreachable_ms: u64,
    brownout: Arc<AtomicBool>,
    /// Connected desktops: only churn and restarts lower it, never a trip.
    desktops: u64,
}

#[derive(Default, Debug)]
struct Tally {
    trips: u64,
    permits: u64,
    refusals: u64,
    lock_busy_or_not_now: u64,
    held_lines: u64,
    released_permits: u64,
    restarts: u64,
    restarts_while_tripped: u64,
    rearms: u64,
    rearms_while_tripped: u64,
    outages: u64,
    brownouts: u64,
    pauses: u64,
    /// Pauses longer than the longest window (120 s).
    pauses_past_window: u64,
    /// Ticks that found a pause and held off judging silence.
    pauses_detected: u64,
    /// Steps at which the live holders filled every slot.
    steps_at_cap: u64,
    /// Slots freed because a holder that was down let its row go stale.
    stale_frees: u64,
    max_holders: u64,
}

struct Fleet {
    store: Store,
    probe: rusqlite::Connection,
    clock: Arc<ManualClock>,
    timings: Timings,
    slots: u32,
    cells: Vec<Cell>,
    rng: Rng,
    director_down_until_ms: u64,
    tally: Tally,
    _dir: TempDir,
}

/// A directory removed when dropped.
struct TempDir(std::path::PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

impl Fleet {
    fn new(seed: u64, slots: u32) -> Fleet {
        let dir = std::env::temp_dir().join(format!(
            "orca-relay-fleet-sim-{}-{seed}-{slots}-{}",
            std::process::id(),
            orca_relay::clock::system().now_ms()
        ));
        std::fs::create_dir_all(&dir).expect("create the simulation directory");
        let path = dir.join("relay.db");
        // The database's clock (`relay_now_ms()`, which stamps and judges the slot rows) is
        // the simulation's clock: simulated hours pass in seconds.
        let clock = ManualClock::starting_at(T0);
        let store = Store::open_with_clock(&StoreConfig::new(None, path.clone()), clock.clone())
            .expect("open SQLite");
        store.migrate().expect("migrate");
        let probe = rusqlite::Connection::open(&path).expect("open the probe connection");
        let cells = (0..CELLS)
            .map(|i| {
                let id = format!("sim-c{i:02}");
                // The operator's record of the switch: every cell of this fleet is reserve.
                store.set_admit_mode(&id, "reserve").expect("admit mode");
                Cell {
                    id,
                    generation: 1,
                    incarnations: 0,
                    process: None,
                    up_at_ms: T0,
                    partitioned_until_ms: 0,
                    brownout_until_ms: 0,
                    paused_until_ms: 0,
                    last_unreachable_ms: 0,
                    brownout: Arc::new(AtomicBool::new(false)),
                    desktops: 0,
                }
            })
            .collect();
        Fleet {
            store,
            probe,
            clock,
            timings: Timings::default(),
            slots,
            cells,
            rng: Rng::new(seed),
            director_down_until_ms: 0,
            tally: Tally::default(),
            _dir: TempDir(dir),
        }
    }

    fn now(&self) -> u64 {
        self.clock.now_ms()
    }

    /// A new incarnation: a fresh window and a writer that has written nothing, so its first
    /// tick writes `reserve` (and with it frees any slot the previous incarnation held).
    fn start_process(&mut self, index: usize) {
        let cell = &mut self.cells[index];
        cell.incarnations += 1;
        let row = StoreRow {
            store: self.store.clone(),
            cell_id: cell.id.clone(),
            incarnation: cell.incarnations,
            stale_ms: self.timings.trip_slot_stale_ms,
            mode: Arc::new(CellMode::new()),
            registry: Registry::new(),
        };
        let row = SimRow {
            row,
            brownout: cell.brownout.clone(),
        };
        // The watchdog ticks every second; after a pause contact gets one feed-poll period.
        cell.process = Some(Process {
            window: Window::new(&cell.id, &self.timings),
            pause: PauseGuard::new(1_000, self.timings.feed_poll_ms),
            writer: CellAdmitEffectiveWriter::new(row, WriterTimings::from_timings(&self.timings)),
            last_contact_ms: None,
        });
    }

    /// Outages, partitions, restarts, re-arms and desktop churn for this second.
    fn scenario(&mut self) {
        let now = self.now();
        // A fleet-wide director outage about every 20 minutes, 30 s to 30 min long: long enough,
        // often, for every window (60-120 s) to pass.
        if now >= self.director_down_until_ms && self.rng.one_in(1_200) {
            self.director_down_until_ms = now + self.rng.between(30, 1_800) * 1_000;
            self.tally.outages += 1;
        }
        for index in 0..CELLS {
            let up = self.cells[index].process.is_some();
            if !up {
                if now >= self.cells[index].up_at_ms {
                    self.start_process(index);
                }
                continue;
            }
            // One cell loses its director alone for 1-10 minutes.
            if self.rng.one_in(7_200) {
                self.cells[index].partitioned_until_ms = now + self.rng.between(60, 600) * 1_000;
            }
            // A database brownout of 1-20 minutes: refreshes and claims wait, except a tripped
            // row's forced refresh every 5 minutes.
            if self.rng.one_in(7_200) {
                self.cells[index].brownout_until_ms = now + self.rng.between(60, 1_200) * 1_000;
                self.tally.brownouts += 1;
            }
            let cell = &self.cells[index];
            cell.brownout
                .store(now < cell.brownout_until_ms, Ordering::Relaxed);
            // A pause of the process (a VM migration, a debugger): 5 s to 5 min, about once
            // per cell-hour; the director stays up unless an outage happens to overlap.
            if now >= cell.paused_until_ms && self.rng.one_in(3_600) {
                let pause = self.rng.between(5, 300) * 1_000;
                self.cells[index].paused_until_ms = now + pause;
                self.tally.pauses += 1;
                self.tally.pauses_past_window += (pause > 120_000) as u64;
            }
            let cell = &mut self.cells[index];
            if now < self.director_down_until_ms || now < cell.partitioned_until_ms {
                cell.last_unreachable_ms = now;
            }
            // A restart, about 1.5 times per cell over two hours in total fleet-wide: down
            // for 0-15 minutes (past 10, a tripped holder's row goes stale while it is away).
            if self.rng.one_in(5_400) {
                let tripped = self.state(index) == Some(DeadManState::Tripped);
                self.tally.restarts += 1;
                self.tally.restarts_while_tripped += tripped as u64;
                let cell = &mut self.cells[index];
                cell.process = None;
                cell.paused_until_ms = 0; // a stopped process can be killed too
                cell.desktops = 0; // the process exit closes every socket
                cell.up_at_ms = now + self.rng.between(0, 900) * 1_000;
                continue;
            }
            // Re-arms: operators re-arm tripped cells some minutes after the director is back,
            // and occasionally rewrite a healthy cell's switch too.
            let tripped = self.state(index) == Some(DeadManState::Tripped);
            let director_up = now >= self.director_down_until_ms;
            let rearm = (tripped && director_up && self.rng.one_in(600)) || self.rng.one_in(14_400);
            if rearm {
                self.tally.rearms += 1;
                self.tally.rearms_while_tripped += tripped as u64;
                self.cells[index].generation += 1;
                self.store
                    .set_admit_mode(&self.cells[index].id, "reserve")
                    .expect("admit mode");
            }
            // Desktop churn.
            let cell = &mut self.cells[index];
            if self.rng.one_in(3) {
                cell.desktops += 1;
            }
            if cell.desktops > 0 && self.rng.one_in(4) {
                cell.desktops -= 1;
            }
        }
    }

    fn state(&self, index: usize) -> Option<DeadManState> {
        self.cells[index]
            .process
            .as_ref()
            .map(|process| process.window.state())
    }

    /// One watchdog tick of one cell, with the claim-loop commands run synchronously.
    fn tick_cell(&mut self, index: usize) {
        let now = self.now();
        let slots = self.slots;
        let director_up = now >= self.director_down_until_ms;
        let cell = &mut self.cells[index];
        if now < cell.paused_until_ms {
            return; // stopped: no tick, no poll answered
        }
        let generation = cell.generation;
        // The director's poll reaches a resumed process one poll period after it resumes.
        let contact = director_up
            && now >= cell.partitioned_until_ms
            && now >= cell.paused_until_ms + self.timings.feed_poll_ms;
        let desktops_before = cell.desktops;
        let last_unreachable_ms = cell.last_unreachable_ms;
        let Some(process) = cell.process.as_mut() else {
            return;
        };
        if contact {
            process.last_contact_ms = Some(now);
        }
        if !process.pause.observe(now).judge_silence {
            self.tally.pauses_detected += 1;
            return;
        }
        let id = cell.id.clone();
        let check = |silent_ms: u64| {
            assert!(
                last_unreachable_ms >= now.saturating_sub(silent_ms),
                "{id} tripped or held at {now} after a silence of {silent_ms} ms with its director \
                 reachable throughout (last unreachable at {last_unreachable_ms}): a pause read \
                 as director silence"
            );
        };
        let actions = process.window.tick(TickInput {
            now_ms: now,
            switch_generation: generation,
            switch_says_reserve: true,
            slots: Some(slots),
            last_contact_ms: process.last_contact_ms,
        });
        process.writer.tick(
            now,
            true,
            process.window.raw_mode(),
            process.window.state() == DeadManState::Tripped,
        );
        let mut queue: std::collections::VecDeque<Action> = actions.into();
        while let Some(action) = queue.pop_front() {
            match action {
                Action::RequestPermit {
                    generation,
                    silence_started_ms,
                    slots,
                } => {
                    let decision = process.writer.claim(slots, now);
                    match decision {
                        ClaimDecision::Permit => self.tally.permits += 1,
                        ClaimDecision::Refused => self.tally.refusals += 1,
                        ClaimDecision::NotNow | ClaimDecision::RetryLater => {
                            self.tally.lock_busy_or_not_now += 1
                        }
                    }
                    queue.extend(process.window.on_claim_result(
                        ClaimResult {
                            generation,
                            silence_started_ms,
                            permit: decision.is_permit(),
                        },
                        now,
                    ));
                }
                Action::Trip { silent_ms, .. } => {
                    // What the watchdog does on a trip: raw mode db, the writer told at once,
                    // re-registration started. Nothing here closes a socket.
                    check(silent_ms);
                    self.tally.trips += 1;
                    process.writer.tick(now, true, Mode::Db, true);
                }
                Action::LogHeld { silent_ms, .. } => {
                    check(silent_ms);
                    self.tally.held_lines += 1;
                }
                Action::ReleaseSlot { .. } => {
                    self.tally.released_permits += 1;
                    process.writer.release_slot(now);
                }
            }
        }
        assert_eq!(
            cell.desktops, desktops_before,
            "a dead-man tick (trip included) closed a desktop socket on {}",
            cell.id
        );
    }

    /// Live slot holders, counted with the claim's own predicate (SPEC §5.5).
    fn live_holders(&self) -> u64 {
        let fresh_since = self.now() as i64 - self.timings.trip_slot_stale_ms as i64;
        let count: i64 = self
            .probe
            .query_row(
                "SELECT COUNT(*) FROM relay_cell_admit_effective e
                 JOIN relay_cell_admit_modes m ON m.cell_id = e.cell_id
                 WHERE e.mode = 'db' AND m.admit_mode = 'reserve' AND e.updated_at >= ?1",
                [fresh_since],
                |row| row.get(0),
            )
            .expect("count live holders");
        count as u64
    }

    /// The mode each running cell's own row says.
    fn row_mode(&self, cell_id: &str) -> Option<String> {
        self.store
            .admit_effective(cell_id)
            .expect("read the admit-effective row")
            .map(|row| row.mode)
    }

    /// The cells whose `db` row stopped counting during the last second (aged past
    /// `TRIP_SLOT_STALE_MS`).
    fn holders_gone_stale(&self) -> Vec<String> {
        let fresh_since = self.now() as i64 - self.timings.trip_slot_stale_ms as i64;
        let mut statement = self
            .probe
            .prepare(
                "SELECT e.cell_id FROM relay_cell_admit_effective e
                 JOIN relay_cell_admit_modes m ON m.cell_id = e.cell_id
                 WHERE e.mode = 'db' AND m.admit_mode = 'reserve'
                   AND e.updated_at < ?1 AND e.updated_at >= ?1 - 1000",
            )
            .expect("prepare");
        let rows = statement
            .query_map([fresh_since], |row| row.get::<_, String>(0))
            .expect("query stale holders");
        rows.map(|row| row.expect("cell id")).collect()
    }

    fn run(mut self, seed: u64) -> Tally {
        let mut order: Vec<usize> = (0..CELLS).collect();
        for step in 0..SIMULATED_SECONDS {
            self.clock.advance(1_000);
            self.scenario();
            // A different interleaving of the cells every second (Fisher-Yates).
            for i in (1..order.len()).rev() {
                let j = (self.rng.next() % (i as u64 + 1)) as usize;
                order.swap(i, j);
            }
            for &index in &order {
                self.tick_cell(index);
            }

            let holders = self.live_holders();
            assert!(
                holders <= u64::from(self.slots),
                "seed {seed:#x} slots {} step {step}: {holders} live slot holders",
                self.slots
            );
            self.tally.max_holders = self.tally.max_holders.max(holders);
            self.tally.steps_at_cap += (holders == u64::from(self.slots)) as u64;

            // Only a holder that is not running lets its row go stale: a running tripped cell
            // refreshes it every 15 s.
            for id in self.holders_gone_stale() {
                let running = self
                    .cells
                    .iter()
                    .any(|cell| cell.id == id && cell.process.is_some());
                assert!(
                    !running,
                    "seed {seed:#x} step {step}: {id} is running but its db row went stale"
                );
                self.tally.stale_frees += 1;
            }

            let tripped_running = (0..CELLS)
                .filter(|&i| self.state(i) == Some(DeadManState::Tripped))
                .count() as u64;
            assert!(
                tripped_running <= u64::from(self.slots),
                "seed {seed:#x} step {step}: {tripped_running} running cells tripped"
            );
            // Each running cell's row agrees with its dead-man state; a restarted cell's first
            // act was writing `reserve`.
            for index in 0..CELLS {
                let Some(state) = self.state(index) else {
                    continue;
                };
                let expected = match state {
                    DeadManState::Tripped => "db",
                    DeadManState::Armed | DeadManState::Held => "reserve",
                    // Started, then stopped before its first tick: nothing written yet.
                    DeadManState::Off if self.now() < self.cells[index].paused_until_ms => continue,
                    DeadManState::Off => unreachable!("the switch always says reserve"),
                };
                let id = &self.cells[index].id;
                assert_eq!(
                    self.row_mode(id).as_deref(),
                    Some(expected),
                    "seed {seed:#x} step {step}: {id} is {state:?}"
                );
            }
        }
        self.tally
    }
}

fn simulate(seed: u64, slots: u32) -> Tally {
    let tally = Fleet::new(seed, slots).run(seed);
    eprintln!("fleet_simulation seed={seed:#x} slots={slots} {tally:?}");
    tally
}

#[test]
fn the_cap_holds_across_seeded_fleet_histories() {
    let mut stale_frees = 0;
    for (seed, slots) in [(0x5eed_0001, 2), (0x5eed_0002, 1), (0x5eed_0003, 3)] {
        let tally = simulate(seed, slots);
        stale_frees += tally.stale_frees;
        // The run exercised the cap rather than passing vacuously.
        assert!(tally.outages > 0, "{tally:?}");
        assert!(tally.trips > 0, "seed {seed}: nobody tripped: {tally:?}");
        assert!(
            tally.refusals > 0,
            "seed {seed}: no claim refused: {tally:?}"
        );
        assert_eq!(tally.max_holders, u64::from(slots), "{tally:?}");
        assert!(tally.steps_at_cap > 0, "{tally:?}");
        assert!(tally.rearms_while_tripped > 0, "{tally:?}");
        assert!(tally.restarts > 0, "{tally:?}");
        assert_eq!(
            tally.permits, tally.trips,
            "seed {seed}: every permit was for the current silence and tripped"
        );
        assert!(tally.brownouts > 0, "{tally:?}");
        assert!(tally.pauses_past_window > 0, "{tally:?}");
        assert!(tally.pauses_detected > 0, "{tally:?}");
    }
    assert!(
        stale_frees > 0,
        "some holder died tripped and its slot aged out"
    );
}

#[test]
fn slot_zero_never_trips_anyone() {
    let tally = simulate(0x5eed_0000, 0);
    assert!(tally.outages > 0 && tally.held_lines > 0, "{tally:?}");
    assert_eq!(tally.trips, 0, "{tally:?}");
    assert_eq!(tally.permits + tally.refusals, 0, "slot 0 never claims");
    assert_eq!(tally.max_holders, 0);
}
