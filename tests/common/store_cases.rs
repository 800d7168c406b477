//! Store scenarios that must hold on both backends. `tests/store_sqlite.rs` and
//! `tests/store_postgres.rs` run each one against a fresh database of their backend.

use std::sync::{Arc, Barrier};
use std::time::Duration;

use orca_relay::clock;
use orca_relay::store::{ClaimOutcome, HeartbeatOutcome, LeaseOutcome, Store};
use orca_relay::threads;

/// "Now" for the scenarios: any fixed instant works, the store takes time as an argument.
pub const NOW: i64 = 1_700_000_000_000;
/// `TRIP_SLOT_STALE_MS`, the production 10 minutes.
pub const STALE_MS: i64 = 600_000;

pub fn migrate_is_idempotent(store: &Store) {
    store.migrate().expect("first migration");
    store.migrate().expect("second migration changes nothing");
    assert!(store.list_cells().expect("tables exist").is_empty());
}

pub fn only_a_strictly_higher_epoch_replaces_an_assignment(store: &Store) {
    assert_eq!(store.assignment("u1", "h1").unwrap(), None);
    assert!(store
        .place_assignment_if_newer("u1", "h1", "c1", 5, NOW)
        .unwrap());
    assert!(
        !store
            .place_assignment_if_newer("u1", "h1", "c2", 5, NOW + 1)
            .unwrap(),
        "the same epoch does not replace"
    );
    assert!(
        !store
            .place_assignment_if_newer("u1", "h1", "c2", 4, NOW + 2)
            .unwrap(),
        "a lower epoch does not replace"
    );
    let row = store.assignment("u1", "h1").unwrap().expect("row");
    assert_eq!(
        (row.cell_id.as_str(), row.epoch, row.updated_at),
        ("c1", 5, NOW)
    );
    assert!(store
        .place_assignment_if_newer("u1", "h1", "c2", 6, NOW + 3)
        .unwrap());
    let row = store.assignment("u1", "h1").unwrap().expect("row");
    assert_eq!(
        (row.cell_id.as_str(), row.epoch, row.updated_at),
        ("c2", 6, NOW + 3)
    );
    assert_eq!(
        (row.user_id.as_str(), row.relay_host_id.as_str()),
        ("u1", "h1")
    );
    assert_eq!(
        store.assignment("u1", "h2").unwrap(),
        None,
        "the key is (user, host)"
    );
}

pub fn leases_renew_expire_move_and_delete(store: &Store) {
    store
        .place_assignment_if_newer("u1", "h1", "c1", 7, NOW)
        .unwrap();
    let renew = |activity: &str, cell: &str, epoch: i64, expires: i64, now: i64| {
        store
            .renew_lease(activity, "u1", "h1", cell, epoch, "control", expires, now)
            .unwrap()
    };
    assert_eq!(
        renew("a1", "c1", 7, NOW + 1_000, NOW),
        LeaseOutcome::Renewed
    );
    assert!(store.lease_exists("a1", NOW).unwrap());
    assert!(store.lease_exists("a1", NOW + 999).unwrap());
    assert!(
        !store.lease_exists("a1", NOW + 1_000).unwrap(),
        "expired at expires_at"
    );
    assert_eq!(
        renew("a1", "c1", 7, NOW + 5_000, NOW + 900),
        LeaseOutcome::Renewed
    );
    assert!(
        store.lease_exists("a1", NOW + 4_000).unwrap(),
        "renewal extends"
    );

    assert_eq!(
        renew("a2", "c1", 6, NOW + 5_000, NOW),
        LeaseOutcome::Moved,
        "an older epoch is not this placement"
    );
    assert!(!store.lease_exists("a2", NOW).unwrap());

    store
        .place_assignment_if_newer("u1", "h1", "c2", 8, NOW + 1)
        .unwrap();
    assert_eq!(
        renew("a1", "c1", 7, NOW + 9_000, NOW + 2),
        LeaseOutcome::Moved
    );
    assert!(
        !store.lease_exists("a1", NOW + 2).unwrap(),
        "a moved lease is deleted"
    );

    assert_eq!(
        renew("a3", "c2", 8, NOW + 9_000, NOW + 3),
        LeaseOutcome::Renewed
    );
    store.delete_lease("a3").unwrap();
    assert!(!store.lease_exists("a3", NOW + 3).unwrap());
    store
        .delete_lease("a3")
        .expect("deleting twice is harmless");
}

pub fn cells_register_heartbeat_and_list(store: &Store) {
    store
        .register_cell("c1", "ws://c1", "http://c1", "eu", 2, NOW)
        .unwrap();
    store
        .register_cell("c1", "ws://c1", "http://c1", "eu", 2, NOW)
        .unwrap();
    store
        .register_cell("c0", "ws://c0", "http://c0", "us", 1, NOW)
        .unwrap();
    let cells = store.list_cells().unwrap();
    assert_eq!(cells.len(), 2, "registering twice keeps one row");
    assert_eq!(cells[0].cell_id, "c0", "ordered by id");
    let c1 = &cells[1];
    assert_eq!(
        (
            c1.cell_url.as_str(),
            c1.region.as_str(),
            c1.incarnation,
            c1.registered_at
        ),
        ("ws://c1", "eu", 2, NOW)
    );
    assert_eq!(c1.runtime, None);
    assert_eq!(c1.admit_mode, "db", "no switch record reads as db");
    assert_eq!(c1.effective, None);

    store
        .register_cell("c1", "ws://old", "http://c1", "eu", 1, NOW + 1)
        .unwrap();
    assert_eq!(
        store.list_cells().unwrap()[1].cell_url,
        "ws://c1",
        "an older incarnation does not replace the registration"
    );
    store
        .register_cell("c1", "ws://c1b", "http://c1", "eu", 3, NOW + 2)
        .unwrap();
    let c1 = store.list_cells().unwrap().remove(1);
    assert_eq!((c1.cell_url.as_str(), c1.incarnation), ("ws://c1b", 3));

    let beat = |incarnation: i64, connections: i64, now: i64| {
        store
            .heartbeat("c1", incarnation, NOW - 50, true, connections, now)
            .unwrap()
    };
    assert_eq!(
        beat(2, 1, NOW + 3),
        HeartbeatOutcome::StaleIncarnation,
        "older than relay_cells"
    );
    assert_eq!(beat(3, 4, NOW + 4), HeartbeatOutcome::Accepted);
    assert_eq!(beat(3, 5, NOW + 5), HeartbeatOutcome::Accepted);
    assert_eq!(beat(4, 6, NOW + 6), HeartbeatOutcome::Accepted);
    assert_eq!(
        beat(3, 7, NOW + 7),
        HeartbeatOutcome::StaleIncarnation,
        "older than relay_cell_runtime"
    );
    let runtime = store.list_cells().unwrap()[1]
        .runtime
        .clone()
        .expect("runtime");
    assert_eq!(runtime.cell_incarnation, 4);
    assert_eq!(runtime.started_at, NOW - 50);
    assert!(runtime.ready);
    assert_eq!(
        (runtime.connections, runtime.last_heartbeat_at),
        (6, NOW + 6)
    );
    assert_eq!(
        store
            .heartbeat("unregistered", 1, NOW, false, 0, NOW)
            .unwrap(),
        HeartbeatOutcome::Accepted
    );
}

pub fn admit_modes_and_effective_rows(store: &Store) {
    store
        .register_cell("c1", "ws://c1", "http://c1", "eu", 1, NOW)
        .unwrap();
    store.set_admit_mode("c1", "reserve", NOW).unwrap();
    assert_eq!(store.list_cells().unwrap()[0].admit_mode, "reserve");
    store.set_admit_mode("c1", "db", NOW + 1).unwrap();
    assert_eq!(store.list_cells().unwrap()[0].admit_mode, "db");
    let error = store.set_admit_mode("c1", "maybe", NOW).unwrap_err();
    assert!(
        !error.is_unavailable(),
        "a bad mode is a query error: {error}"
    );

    assert_eq!(store.admit_effective("c1").unwrap(), None);
    store
        .write_admit_effective("c1", 3, "reserve", NOW + 2)
        .unwrap();
    store.write_admit_effective("c1", 3, "db", NOW + 3).unwrap();
    let row = store.admit_effective("c1").unwrap().expect("row");
    assert_eq!(
        (row.cell_incarnation, row.mode.as_str(), row.updated_at),
        (3, "db", NOW + 3)
    );
    assert_eq!(store.list_cells().unwrap()[0].effective, Some(row));
    assert!(store
        .write_admit_effective("c1", 3, "tripped", NOW)
        .is_err());
}

pub fn every_statement_is_counted(store: &Store) {
    let before = store.statements_executed();
    let _ = store.pool_stats();
    let _ = store.has_waiters();
    assert_eq!(
        store.statements_executed(),
        before,
        "reading pool counters sends nothing"
    );
    store.ping().unwrap();
    assert_eq!(
        store.statements_executed(),
        before + 1,
        "SELECT 1 is one statement"
    );
    store
        .place_assignment_if_newer("u", "h", "c", 1, NOW)
        .unwrap();
    assert_eq!(store.statements_executed(), before + 2);
    store.claim_trip_slot("c", 1, 1, NOW, STALE_MS).unwrap();
    assert!(
        store.statements_executed() >= before + 5,
        "a claim is a transaction of several statements"
    );
}

fn claim(store: &Store, cell: &str, slots: u32, now: i64) -> ClaimOutcome {
    store
        .claim_trip_slot(cell, 1, slots, now, STALE_MS)
        .unwrap_or_else(|error| panic!("claim by {cell} failed: {error}"))
}

/// Cells whose switch says reserve: the only ones whose `db` row can hold a slot.
fn reserve_cells(store: &Store, cells: &[&str]) {
    for cell in cells {
        store.set_admit_mode(cell, "reserve", NOW).unwrap();
    }
}

pub fn a_live_holder_keeps_its_slot(store: &Store) {
    reserve_cells(store, &["c1", "c2"]);
    assert_eq!(
        claim(store, "c1", 1, NOW),
        ClaimOutcome::Permit { others_holding: 0 }
    );
    assert_eq!(store.admit_effective("c1").unwrap().unwrap().mode, "db");
    assert_eq!(
        claim(store, "c2", 1, NOW + 1_000),
        ClaimOutcome::Refused { others_holding: 1 }
    );
    let refused = store.admit_effective("c2").unwrap().expect("refused row");
    assert_eq!(
        (refused.mode.as_str(), refused.updated_at),
        ("reserve", NOW + 1_000),
        "a refused claim keeps its reserve row fresh"
    );
    assert_eq!(
        claim(store, "c2", 1, NOW + STALE_MS),
        ClaimOutcome::Refused { others_holding: 1 },
        "still live exactly at the stale boundary"
    );
    assert_eq!(
        claim(store, "c1", 1, NOW + 2_000),
        ClaimOutcome::Permit { others_holding: 0 },
        "a holder does not count itself"
    );
}

pub fn a_stale_holder_frees_exactly_one_slot(store: &Store) {
    reserve_cells(store, &["c1", "c2", "c3", "c4"]);
    // c1 tripped and died: its row is one ms older than the stale window. c2 is alive.
    store
        .write_admit_effective("c1", 1, "db", NOW - STALE_MS - 1)
        .unwrap();
    store
        .write_admit_effective("c2", 1, "db", NOW - 1_000)
        .unwrap();
    assert_eq!(
        claim(store, "c3", 2, NOW),
        ClaimOutcome::Permit { others_holding: 1 }
    );
    assert_eq!(
        claim(store, "c4", 2, NOW),
        ClaimOutcome::Refused { others_holding: 2 }
    );
}

pub fn a_holder_whose_switch_says_db_does_not_count(store: &Store) {
    reserve_cells(store, &["c2"]);
    store.set_admit_mode("c1", "db", NOW).unwrap();
    store.write_admit_effective("c1", 1, "db", NOW).unwrap();
    // c9 has a db row and no switch record at all, which also means db.
    store.write_admit_effective("c9", 1, "db", NOW).unwrap();
    assert_eq!(
        claim(store, "c2", 1, NOW),
        ClaimOutcome::Permit { others_holding: 0 }
    );
}

pub fn rewriting_reserve_frees_the_slot(store: &Store) {
    reserve_cells(store, &["c1", "c2"]);
    assert_eq!(
        claim(store, "c1", 1, NOW),
        ClaimOutcome::Permit { others_holding: 0 }
    );
    assert_eq!(
        claim(store, "c2", 1, NOW),
        ClaimOutcome::Refused { others_holding: 1 }
    );
    // c1 is re-armed (or restarted): it writes reserve, and its slot is free again.
    store
        .write_admit_effective("c1", 2, "reserve", NOW + 1)
        .unwrap();
    assert_eq!(
        claim(store, "c2", 1, NOW + 2),
        ClaimOutcome::Permit { others_holding: 0 }
    );
}

pub fn zero_slots_never_permit(store: &Store) {
    reserve_cells(store, &["c1"]);
    assert_eq!(
        claim(store, "c1", 0, NOW),
        ClaimOutcome::Refused { others_holding: 0 }
    );
    assert_eq!(
        store.admit_effective("c1").unwrap().unwrap().mode,
        "reserve"
    );
}

/// Eight cells claim at once, each through its own store (its own connection), released
/// together by a barrier; a claimant told `LockBusy` asks again at once. Exactly `slots`
/// permits every round: without the claim lock, claimants that overlap all count the same
/// holders and more than `slots` of them trip.
pub fn eight_cells_racing_get_exactly_two_permits(open: &dyn Fn() -> Store, rounds: usize) {
    const CELLS: usize = 8;
    const SLOTS: u32 = 2;
    let cells: Vec<String> = (0..CELLS).map(|i| format!("race-{i}")).collect();
    let admin = open();
    let names: Vec<&str> = cells.iter().map(String::as_str).collect();
    reserve_cells(&admin, &names);
    let stores: Vec<Store> = (0..CELLS).map(|_| open()).collect();
    for store in &stores {
        store.ping().expect("warm the connection before the race");
    }
    for round in 0..rounds {
        let now = NOW + round as i64 * 10;
        for cell in &cells {
            admin
                .write_admit_effective(cell, 1, "reserve", now)
                .unwrap();
        }
        let barrier = Arc::new(Barrier::new(CELLS));
        let claimants: Vec<_> = stores
            .iter()
            .zip(&cells)
            .map(|(store, cell)| {
                let store = store.clone();
                let cell = cell.clone();
                let barrier = barrier.clone();
                threads::spawn(format!("claimant-{cell}"), move || {
                    barrier.wait();
                    let deadline = clock::instant() + Duration::from_secs(20);
                    loop {
                        match store.claim_trip_slot(&cell, 1, SLOTS, now + 1, STALE_MS) {
                            Ok(ClaimOutcome::LockBusy) => {
                                assert!(clock::instant() < deadline, "{cell} never got the lock");
                            }
                            Ok(outcome) => return outcome,
                            Err(error) => panic!("claim by {cell} failed: {error}"),
                        }
                    }
                })
                .expect("spawn a claimant")
            })
            .collect();
        let outcomes: Vec<ClaimOutcome> = claimants
            .into_iter()
            .map(|claimant| claimant.join().expect("claimant panicked"))
            .collect();
        let permits = outcomes
            .iter()
            .filter(|o| matches!(o, ClaimOutcome::Permit { .. }))
            .count();
        assert_eq!(
            permits, SLOTS as usize,
            "round {round}: {permits} permits for {SLOTS} slots: {outcomes:?}"
        );
        let db_rows = cells
            .iter()
            .filter(|cell| admin.admit_effective(cell).unwrap().unwrap().mode == "db")
            .count();
        assert_eq!(
            db_rows, SLOTS as usize,
            "round {round}: rows agree with the permits"
        );
    }
}
