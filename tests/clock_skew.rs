//! Slot liveness is judged on the database's clock (SPEC §11): two cells whose clocks differ
//! from the database's by ±10 minutes claim and free trip slots exactly as if they agreed.
//!
//! Each cell runs the real `CellAdmitEffectiveWriter` over the production `StoreRow` adapter
//! with its own injected clock (which paces its writer, as in production), against a real
//! store: SQLite, whose `relay_now_ms()` reads a manual "database clock", and PostgreSQL, whose
//! `now()` is real time (there, moving the database's clock forward moves every stamp back).
//! The same scenario runs with the clocks agreeing, with the holder slow and the claimant
//! fast, and the other way round; the claims must answer the same every time. Judged on a
//! cell's clock, the claimant ten minutes fast sees a live holder as stale (and trips past the
//! cap), and the claimant ten minutes slow sees a dead holder as live for twenty minutes more.

mod common;

use std::sync::Arc;

use orca_relay::cell::mode::CellMode;
use orca_relay::clock::{Clock, ManualClock};
use orca_relay::dead_man::claim_loop::StoreRow;
use orca_relay::dead_man::window::Mode;
use orca_relay::dead_man::writer::{CellAdmitEffectiveWriter, ClaimDecision, WriterTimings};
use orca_relay::metrics::Registry;
use orca_relay::store::{Store, StoreConfig};

const MINUTE: i64 = 60_000;
/// `TRIP_SLOT_STALE_MS`, the production 10 minutes.
const STALE_MS: i64 = 10 * MINUTE;
/// Real time PostgreSQL may take between two statements that must see one window.
const MARGIN_MS: i64 = 5_000;
const T0: u64 = 1_800_000_000_000;

/// A store and a way to move its database clock forward.
struct Db {
    store: Store,
    advance: Box<dyn Fn(i64)>,
}

fn sqlite(name: &str) -> Db {
    let clock = ManualClock::starting_at(T0);
    let path = common::temp_dir(name).join("relay.db");
    let store = Store::open_with_clock(&StoreConfig::new(None, path), clock.clone()).unwrap();
    store.migrate().unwrap();
    Db {
        store,
        advance: Box::new(move |ms| clock.advance(ms as u64)),
    }
}

fn postgres(name: &str) -> Db {
    let url = common::pg::fresh_database(name);
    let store = Store::open(&StoreConfig::new(Some(url.clone()), "unused.db".into())).unwrap();
    store.migrate().unwrap();
    let admin = std::sync::Mutex::new(common::pg::connect(&url));
    Db {
        store,
        advance: Box::new(move |ms| {
            admin
                .lock()
                .unwrap()
                .batch_execute(&format!(
                    "UPDATE relay_cell_admit_effective SET updated_at = updated_at - {ms}"
                ))
                .unwrap()
        }),
    }
}

/// One cell: its own clock, its writer over the real store.
struct Cell {
    clock: Arc<ManualClock>,
    writer: CellAdmitEffectiveWriter<StoreRow>,
}

impl Cell {
    fn new(db: &Db, id: &str, offset_ms: i64) -> Cell {
        db.store.set_admit_mode(id, "reserve").unwrap();
        let db_now = db.store.now_ms().unwrap();
        let clock = ManualClock::starting_at((db_now + offset_ms) as u64);
        let row = StoreRow {
            store: db.store.clone(),
            cell_id: id.to_string(),
            incarnation: 1,
            stale_ms: STALE_MS as u64,
            mode: Arc::new(CellMode::new()),
            registry: Registry::new(),
        };
        let timings = WriterTimings {
            refresh_ms: 15_000,
            tripped_row_force_refresh_ms: 300_000,
        };
        let mut cell = Cell {
            clock,
            writer: CellAdmitEffectiveWriter::new(row, timings),
        };
        cell.tick(Mode::Reserve, false);
        cell
    }

    fn tick(&mut self, raw: Mode, tripped: bool) {
        self.writer.tick(self.clock.now_ms(), true, raw, tripped);
    }

    fn claim(&mut self) -> ClaimDecision {
        self.writer.claim(1, self.clock.now_ms())
    }
}

/// The scenario with the holder's and the claimant's clocks `holder_offset` and
/// `claimant_offset` away from the database's; returns every claim's answer.
fn scenario(db: &Db, holder_offset: i64, claimant_offset: i64) -> Vec<ClaimDecision> {
    let mut holder = Cell::new(db, "holder", holder_offset);
    let mut claimant = Cell::new(db, "claimant", claimant_offset);
    let advance = |cells: [&Cell; 2], ms: i64| {
        (db.advance)(ms);
        for cell in cells {
            cell.clock.advance(ms as u64);
        }
    };
    let mut answers = Vec::new();
    // 1. The holder takes the only slot and trips (its row says db).
    answers.push(holder.claim());
    holder.tick(Mode::Db, true);
    // 2. Right away, and just inside the stale window (the holder has not refreshed), the
    //    claimant is refused: the holder is live by the database's clock.
    answers.push(claimant.claim());
    advance([&holder, &claimant], STALE_MS - 2 * MARGIN_MS);
    answers.push(claimant.claim());
    // 3. The holder died: past the window its slot is free, at once, for the claimant.
    advance([&holder, &claimant], 3 * MARGIN_MS);
    answers.push(claimant.claim());
    claimant.tick(Mode::Db, true);
    // 4. And the other way round: the old holder comes back (a new process writes reserve)
    //    and asks; the claimant is live now.
    holder.tick(Mode::Reserve, false);
    answers.push(holder.claim());
    advance([&holder, &claimant], STALE_MS + MARGIN_MS);
    answers.push(holder.claim());
    answers
}

const EXPECTED: [ClaimDecision; 6] = [
    ClaimDecision::Permit,
    ClaimDecision::Refused,
    ClaimDecision::Refused,
    ClaimDecision::Permit,
    ClaimDecision::Refused,
    ClaimDecision::Permit,
];

fn check(open: impl Fn(&str) -> Db) {
    for (holder, claimant) in [
        (0, 0),
        (-10 * MINUTE, 10 * MINUTE),
        (10 * MINUTE, -10 * MINUTE),
        (10 * MINUTE, 10 * MINUTE),
        (-10 * MINUTE, -10 * MINUTE),
    ] {
        let db = open(&format!(
            "skew_{}_{}",
            holder / MINUTE + 10,
            claimant / MINUTE + 10
        ));
        assert_eq!(
            scenario(&db, holder, claimant),
            EXPECTED,
            "holder {} min, claimant {} min off the database's clock",
            holder / MINUTE,
            claimant / MINUTE
        );
    }
}

#[test]
fn skewed_cells_claim_and_free_slots_as_if_they_agreed_on_sqlite() {
    check(sqlite);
}

#[test]
fn skewed_cells_claim_and_free_slots_as_if_they_agreed_on_postgres() {
    check(postgres);
}
