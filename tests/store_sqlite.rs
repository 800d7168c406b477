//! The store on SQLite: every scenario of `common::store_cases`, plus what only SQLite has
//! (one file shared by several stores, the write lock as the claim lock).

mod common;

use std::path::PathBuf;
use std::sync::{Arc, Barrier};

use common::store_cases::{self as cases, Db, NOW, STALE_MS};
use orca_relay::clock::ManualClock;
use orca_relay::store::{Backend, ClaimOutcome, Store, StoreConfig};
use orca_relay::threads;

fn config(path: PathBuf) -> StoreConfig {
    StoreConfig {
        pool_max: 4,
        pool_ceiling: 4,
        ..StoreConfig::new(None, path)
    }
}

/// A store on a new file in a directory that does not exist yet.
fn fresh_path(name: &str) -> PathBuf {
    common::temp_dir(name).join("nested").join("relay.db")
}

/// A migrated store on a new file whose `relay_now_ms()` reads a manual clock.
fn migrated(name: &str) -> Db {
    let clock = ManualClock::starting_at(NOW as u64);
    let store = Store::open_with_clock(&config(fresh_path(name)), clock.clone()).expect("open");
    assert_eq!(store.backend(), Backend::Sqlite);
    store.migrate().expect("migrate");
    Db::new(store, move |ms| clock.advance(ms as u64))
}

macro_rules! scenarios {
    ($($name:ident),* $(,)?) => {
        $(
            #[test]
            fn $name() {
                cases::$name(&migrated(stringify!($name)));
            }
        )*
    };
}

scenarios!(
    migrate_is_idempotent,
    only_a_strictly_higher_epoch_replaces_an_assignment,
    leases_renew_expire_move_and_delete,
    cells_register_heartbeat_and_list,
    admit_modes_and_effective_rows,
    every_statement_is_counted,
    deregistration_removes_only_that_incarnation,
    a_heartbeat_carries_what_the_cell_advertises,
    the_write_probe_leaves_nothing_behind,
    silent_cells_are_forgotten_but_their_operators_admit_mode_stays,
    expired_leases_are_swept_after_a_margin,
    a_live_holder_keeps_its_slot,
    a_stale_holder_frees_exactly_one_slot,
    a_holder_whose_switch_says_db_does_not_count,
    rewriting_reserve_frees_the_slot,
    zero_slots_never_permit,
);

#[test]
fn open_connects_lazily_and_creates_the_data_directory() {
    let path = fresh_path("lazy");
    let store = Store::open(&config(path.clone())).expect("open");
    assert_eq!(store.pool_stats().open, 0, "no connection before first use");
    assert!(
        path.parent().unwrap().is_dir(),
        "the parent directory is created"
    );
    store.migrate().unwrap();
    assert!(path.is_file());
    let conn = rusqlite::Connection::open(&path).unwrap();
    let mode: String = conn
        .query_row("PRAGMA journal_mode", [], |row| row.get(0))
        .unwrap();
    assert_eq!(mode, "wal");
}

#[test]
fn several_stores_migrate_one_file_at_once() {
    let path = fresh_path("migrators");
    let barrier = Arc::new(Barrier::new(6));
    let migrators: Vec<_> = (0..6)
        .map(|i| {
            let path = path.clone();
            let barrier = barrier.clone();
            threads::spawn(format!("migrator-{i}"), move || {
                let store = Store::open(&config(path)).expect("open");
                barrier.wait();
                store.migrate()
            })
            .unwrap()
        })
        .collect();
    for migrator in migrators {
        migrator.join().unwrap().expect("every migrator succeeds");
    }
    let store = Store::open(&config(path)).unwrap();
    assert!(store.list_cells().unwrap().is_empty());
}

#[test]
fn a_claim_answers_lock_busy_instead_of_waiting_for_the_write_lock() {
    let path = fresh_path("busy");
    let store = Store::open(&config(path.clone())).unwrap();
    store.migrate().unwrap();
    store.set_admit_mode("c1", "reserve").unwrap();
    let holder = rusqlite::Connection::open(&path).unwrap();
    holder.execute_batch("BEGIN IMMEDIATE").unwrap();
    let started = orca_relay::clock::instant();
    assert_eq!(
        store.claim_trip_slot("c1", 1, 2, STALE_MS).unwrap(),
        ClaimOutcome::LockBusy
    );
    assert!(
        started.elapsed().as_millis() < 2_000,
        "the claim did not wait out the busy timeout"
    );
    holder.execute_batch("COMMIT").unwrap();
    assert_eq!(
        store.admit_effective("c1").unwrap(),
        None,
        "a busy claim writes nothing"
    );
    assert_eq!(
        store.claim_trip_slot("c1", 1, 2, STALE_MS).unwrap(),
        ClaimOutcome::Permit { others_holding: 0 }
    );
}

#[test]
fn eight_cells_racing_on_one_file_get_exactly_two_permits() {
    let path = fresh_path("race");
    Store::open(&config(path.clone()))
        .unwrap()
        .migrate()
        .unwrap();
    let open = move || Store::open(&config(path.clone())).expect("open");
    cases::eight_cells_racing_get_exactly_two_permits(&open, 30);
}

/// On SQLite the database's clock is exact, so the stale window's edge can be tested to the
/// millisecond: a holder's row exactly `TRIP_SLOT_STALE_MS` old still holds; one ms more and
/// its slot is free. Both are judged on the database's clock (`relay_now_ms()` reads the manual
/// clock), never on the claimant's.
#[test]
fn the_stale_edge_is_exact_on_the_database_clock() {
    let db = migrated("stale_edge");
    db.set_admit_mode("holder", "reserve").unwrap();
    db.set_admit_mode("claimant", "reserve").unwrap();
    db.write_admit_effective("holder", 1, "db").unwrap();
    db.advance(STALE_MS);
    assert_eq!(
        db.claim_trip_slot("claimant", 1, 1, STALE_MS).unwrap(),
        ClaimOutcome::Refused { others_holding: 1 },
        "exactly the stale window: still live"
    );
    db.advance(1);
    assert_eq!(
        db.claim_trip_slot("claimant", 1, 1, STALE_MS).unwrap(),
        ClaimOutcome::Permit { others_holding: 0 }
    );
    let row = db.admit_effective("claimant").unwrap().unwrap();
    assert_eq!(
        (row.updated_at, row.age_ms),
        (NOW + STALE_MS + 1, 0),
        "the claim stamped its row with the database's clock"
    );
}

/// A handover's next process whose SQLite file does not exist yet (its migrations come after
/// the commit) proves the directory can take it, and creates nothing.
#[test]
fn the_write_probe_of_a_missing_file_creates_nothing() {
    let path = fresh_path("write_probe_missing");
    let store = Store::open(&config(path.clone())).expect("open");
    store.write_probe("c1").expect("the probe");
    assert!(!path.exists(), "no database file before the commit");
}
