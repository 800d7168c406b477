//! Store scenarios that must hold on both backends. `tests/store_sqlite.rs` and
//! `tests/store_postgres.rs` run each one against a fresh database of their backend.
//!
//! Rows that machines compare are stamped by the database (`relay_now_ms()`, SPEC §11), so a
//! scenario cannot hand the store a time: it moves the database's clock with [`Db::advance`]
//! (on SQLite the store's manual clock moves; on PostgreSQL, whose `now()` a test cannot move,
//! every stamp in the cell tables is moved back by the same amount, which is the same thing to
//! every age and comparison). PostgreSQL's clock also runs on by itself between statements, so
//! a scenario leaves a margin of seconds wherever it claims "still inside a window".

use std::sync::{Arc, Barrier};
use std::time::Duration;

use orca_relay::clock;
use orca_relay::store::{ClaimOutcome, HeartbeatOutcome, LeaseOutcome, Store};
use orca_relay::threads;

/// "Now" for assignments and leases, which are stamped by their writer: any fixed instant.
pub const NOW: i64 = 1_700_000_000_000;
/// `TRIP_SLOT_STALE_MS`, the production 10 minutes.
pub const STALE_MS: i64 = 600_000;
/// Real time a PostgreSQL scenario may take between two statements that must see one window.
const MARGIN_MS: i64 = 5_000;

/// A store under test and a way to move its database clock forward.
pub struct Db {
    pub store: Store,
    advance: Box<dyn Fn(i64)>,
}

impl Db {
    pub fn new(store: Store, advance: impl Fn(i64) + 'static) -> Db {
        Db {
            store,
            advance: Box::new(advance),
        }
    }

    /// Moves the database's clock `ms` forward.
    pub fn advance(&self, ms: i64) {
        (self.advance)(ms)
    }
}

impl std::ops::Deref for Db {
    type Target = Store;
    fn deref(&self) -> &Store {
        &self.store
    }
}

pub fn migrate_is_idempotent(store: &Db) {
    store.migrate().expect("first migration");
    store.migrate().expect("second migration changes nothing");
    assert!(store.list_cells().expect("tables exist").is_empty());
}

pub fn only_a_strictly_higher_epoch_replaces_an_assignment(store: &Db) {
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

pub fn leases_renew_expire_move_and_delete(store: &Db) {
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

pub fn cells_register_heartbeat_and_list(store: &Db) {
    store
        .register_cell("c1", "ws://c1", "http://c1", "eu", 2)
        .unwrap();
    store
        .register_cell("c1", "ws://c1", "http://c1", "eu", 2)
        .unwrap();
    store
        .register_cell("c0", "ws://c0", "http://c0", "us", 1)
        .unwrap();
    let cells = store.list_cells().unwrap();
    assert_eq!(cells.len(), 2, "registering twice keeps one row");
    assert_eq!(cells[0].cell_id, "c0", "ordered by id");
    let c1 = &cells[1];
    assert_eq!(
        (c1.cell_url.as_str(), c1.region.as_str(), c1.incarnation),
        ("ws://c1", "eu", 2)
    );
    let db_now = store.now_ms().unwrap();
    assert!(
        (0..MARGIN_MS).contains(&(db_now - c1.registered_at)),
        "stamped by the database: {} vs {db_now}",
        c1.registered_at
    );
    assert!((0..MARGIN_MS).contains(&c1.registered_age_ms));
    assert_eq!(c1.runtime, None);
    assert_eq!(c1.admit_mode, "db", "no switch record reads as db");
    assert_eq!(c1.admit_mode_updated_at, None);
    assert_eq!(c1.effective, None);

    store
        .register_cell("c1", "ws://old", "http://c1", "eu", 1)
        .unwrap();
    assert_eq!(
        store.list_cells().unwrap()[1].cell_url,
        "ws://c1",
        "an older incarnation does not replace the registration"
    );
    store
        .register_cell("c1", "ws://c1b", "http://c1", "eu", 3)
        .unwrap();
    let c1 = store.list_cells().unwrap().remove(1);
    assert_eq!((c1.cell_url.as_str(), c1.incarnation), ("ws://c1b", 3));

    let beat = |incarnation: i64, connections: i64| {
        store
            .heartbeat("c1", incarnation, NOW - 50, true, connections)
            .unwrap()
    };
    assert_eq!(
        beat(2, 1),
        HeartbeatOutcome::StaleIncarnation,
        "older than relay_cells"
    );
    assert_eq!(beat(3, 4), HeartbeatOutcome::Accepted);
    assert_eq!(beat(3, 5), HeartbeatOutcome::Accepted);
    // A newer incarnation than the registration: its registration is not in the database (a
    // write the database lost: an immediate restart with asynchronous commit, a failover to a
    // replica that lagged). Accepting the beat would leave relay_cells naming the old
    // incarnation for good (a handed-over process never registers again), and every listing
    // would drop the cell's reports as another incarnation's. Nothing is written; the caller
    // registers it from the beat and beats again.
    assert_eq!(
        beat(4, 6),
        HeartbeatOutcome::Unregistered,
        "newer than relay_cells"
    );
    let c1 = store.list_cells().unwrap().remove(1);
    assert_eq!(c1.incarnation, 3, "a heartbeat never registers by itself");
    assert_eq!(c1.runtime.as_ref().map(|r| r.cell_incarnation), Some(3));
    store
        .register_cell("c1", "ws://c1b", "http://c1", "eu", 4)
        .unwrap();
    assert_eq!(beat(4, 6), HeartbeatOutcome::Accepted);
    assert_eq!(
        beat(3, 7),
        HeartbeatOutcome::StaleIncarnation,
        "older than the registration"
    );
    let runtime = store.list_cells().unwrap()[1]
        .runtime
        .clone()
        .expect("runtime");
    assert_eq!(runtime.cell_incarnation, 4);
    assert_eq!(runtime.started_at, NOW - 50);
    assert!(runtime.ready);
    assert_eq!(runtime.connections, 6);
    assert!((0..MARGIN_MS).contains(&runtime.heartbeat_age_ms));
    // The heartbeat's age is the database's: a minute on, it is a minute old.
    store.advance(60_000);
    let c1 = store.list_cells().unwrap().remove(1);
    let age = c1.runtime.as_ref().unwrap().heartbeat_age_ms;
    assert!((60_000..60_000 + MARGIN_MS).contains(&age), "{age}");
    assert_eq!(
        c1.silent_ms(),
        age,
        "silence is the newer of beat and registration"
    );
    assert_eq!(
        store.heartbeat("unregistered", 1, NOW, false, 0).unwrap(),
        HeartbeatOutcome::Unregistered,
        "a heartbeat never creates a cell"
    );
    assert_eq!(store.list_cells().unwrap().len(), 2);
}

pub fn deregistration_removes_only_that_incarnation(store: &Db) {
    store
        .register_cell("c1", "ws://c1", "http://c1", "eu", 5)
        .unwrap();
    store.heartbeat("c1", 5, NOW, true, 0).unwrap();
    store.set_admit_mode("c1", "reserve").unwrap();
    store.write_admit_effective("c1", 5, "reserve").unwrap();
    assert!(
        !store.deregister_cell("c1", 4).unwrap(),
        "an older process's exit leaves the newer registration alone"
    );
    assert_eq!(store.list_cells().unwrap().len(), 1);
    assert!(store.deregister_cell("c1", 5).unwrap());
    assert!(store.list_cells().unwrap().is_empty());
    assert!(!store.deregister_cell("c1", 5).unwrap(), "idempotent");
    assert_eq!(
        store.heartbeat("c1", 5, NOW, true, 0).unwrap(),
        HeartbeatOutcome::Unregistered
    );
    // The operator's record and the cell's own row stay until the cell is forgotten.
    store
        .register_cell("c1", "ws://c1", "http://c1", "eu", 6)
        .unwrap();
    let c1 = store.list_cells().unwrap().remove(0);
    assert_eq!(c1.admit_mode, "reserve");
    assert_eq!(c1.effective.map(|e| e.mode), Some("reserve".to_string()));
    assert_eq!(
        c1.runtime, None,
        "the runtime row went with the registration"
    );
}

pub fn silent_cells_are_forgotten_but_their_operators_admit_mode_stays(store: &Db) {
    const FORGET_MS: i64 = 86_400_000;
    // "gone": registered, heartbeat, records, a slot row, a lease; then silent for a day.
    store
        .register_cell("gone", "ws://gone", "http://gone", "eu", 1)
        .unwrap();
    store.heartbeat("gone", 1, NOW, true, 0).unwrap();
    store.set_admit_mode("gone", "reserve").unwrap();
    store.write_admit_effective("gone", 1, "db").unwrap();
    store
        .place_assignment_if_newer("u1", "h1", "gone", 1, NOW)
        .unwrap();
    store
        .renew_lease("a1", "u1", "h1", "gone", 1, "control", NOW, NOW)
        .unwrap();
    // "never": registered, never heard from again. "left": deregistered, its rows remain.
    store
        .register_cell("never", "ws://never", "http://never", "eu", 1)
        .unwrap();
    store
        .register_cell("left", "ws://left", "http://left", "eu", 1)
        .unwrap();
    store.set_admit_mode("left", "reserve").unwrap();
    store.write_admit_effective("left", 1, "reserve").unwrap();
    store.deregister_cell("left", 1).unwrap();

    store.advance(FORGET_MS - 60_000);
    // "alive": registered long ago, heartbeating now.
    store
        .register_cell("alive", "ws://alive", "http://alive", "eu", 1)
        .unwrap();
    store.advance(60_000 - 1_000);
    store.heartbeat("alive", 1, NOW, true, 0).unwrap();
    assert_eq!(
        store.forget_silent_cells(FORGET_MS).unwrap(),
        Vec::<String>::new(),
        "nobody is a day silent yet"
    );
    store.advance(1_000 + 1);
    let mut forgotten = store.forget_silent_cells(FORGET_MS).unwrap();
    forgotten.sort();
    assert_eq!(forgotten, vec!["gone", "never"]);
    let cells = store.list_cells().unwrap();
    assert_eq!(
        cells.iter().map(|c| c.cell_id.as_str()).collect::<Vec<_>>(),
        vec!["alive"]
    );
    assert_eq!(store.admit_effective("gone").unwrap(), None);
    assert_eq!(
        store.admit_effective("left").unwrap(),
        None,
        "left-over rows go too"
    );
    assert!(!store.lease_exists("a1", 0).unwrap(), "its leases went");
    // The placement row belongs to the host, not the cell: it stays (it keeps the epochs).
    assert_eq!(store.assignment("u1", "h1").unwrap().unwrap().epoch, 1);
    // A forgotten cell that comes back simply registers again, in the mode its operator
    // recorded (issue 20: a reserve cell back after a long absence was placed as `db`, outside
    // the trip-slot bound and the budget). So does one that deregistered and stayed away.
    store
        .register_cell("gone", "ws://gone", "http://gone", "eu", 2)
        .unwrap();
    store
        .register_cell("left", "ws://left", "http://left", "eu", 2)
        .unwrap();
    let cells = store.list_cells().unwrap();
    assert_eq!(
        cells
            .iter()
            .map(|c| (c.cell_id.as_str(), c.admit_mode.as_str()))
            .collect::<Vec<_>>(),
        vec![("alive", "db"), ("gone", "reserve"), ("left", "reserve")]
    );
}

pub fn expired_leases_are_swept_after_a_margin(store: &Db) {
    store
        .place_assignment_if_newer("u1", "h1", "c1", 1, NOW)
        .unwrap();
    let db_now = store.now_ms().unwrap();
    for (activity, expires_at) in [("old", db_now - 1_000), ("live", db_now + 105_000)] {
        assert_eq!(
            store
                .renew_lease(activity, "u1", "h1", "c1", 1, "control", expires_at, db_now)
                .unwrap(),
            LeaseOutcome::Renewed
        );
    }
    assert_eq!(
        store.delete_expired_leases(3_600_000).unwrap(),
        0,
        "expired, but not by the margin yet"
    );
    store.advance(3_600_000);
    assert_eq!(store.delete_expired_leases(3_600_000).unwrap(), 1);
    // (Expiry 0: does the row exist at all.)
    assert!(!store.lease_exists("old", 0).unwrap());
    assert!(store.lease_exists("live", 0).unwrap());
}

pub fn admit_modes_and_effective_rows(store: &Db) {
    store
        .register_cell("c1", "ws://c1", "http://c1", "eu", 1)
        .unwrap();
    store.set_admit_mode("c1", "reserve").unwrap();
    assert_eq!(store.list_cells().unwrap()[0].admit_mode, "reserve");
    store.set_admit_mode("c1", "db").unwrap();
    let c1 = store.list_cells().unwrap().remove(0);
    assert_eq!(c1.admit_mode, "db");
    let db_now = store.now_ms().unwrap();
    assert!((0..MARGIN_MS).contains(&(db_now - c1.admit_mode_updated_at.unwrap())));
    let error = store.set_admit_mode("c1", "maybe").unwrap_err();
    assert!(
        !error.is_unavailable(),
        "a bad mode is a query error: {error}"
    );

    assert_eq!(store.admit_effective("c1").unwrap(), None);
    store.write_admit_effective("c1", 3, "reserve").unwrap();
    store.advance(2_000);
    store.write_admit_effective("c1", 3, "db").unwrap();
    let row = store.admit_effective("c1").unwrap().expect("row");
    assert_eq!((row.cell_incarnation, row.mode.as_str()), (3, "db"));
    assert!(
        (0..MARGIN_MS).contains(&row.age_ms),
        "just written: {row:?}"
    );
    let db_now = store.now_ms().unwrap();
    assert!((0..MARGIN_MS).contains(&(db_now - row.updated_at)));
    let listed = store.list_cells().unwrap()[0].effective.clone().unwrap();
    assert_eq!(
        (listed.mode.as_str(), listed.updated_at),
        (row.mode.as_str(), row.updated_at)
    );
    assert!(store.write_admit_effective("c1", 3, "tripped").is_err());
}

pub fn every_statement_is_counted(store: &Db) {
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
    // On PostgreSQL the write is a transaction (BEGIN, INSERT, COMMIT), so that work whose
    // pooled connection the server closed can be retried without risking a second commit.
    let placement = match store.backend() {
        orca_relay::store::Backend::Postgres => 3,
        orca_relay::store::Backend::Sqlite => 1,
    };
    assert_eq!(store.statements_executed(), before + 1 + placement);
    store.claim_trip_slot("c", 1, 1, STALE_MS).unwrap();
    assert!(
        store.statements_executed() >= before + 5,
        "a claim is a transaction of several statements"
    );
}

fn claim(store: &Store, cell: &str, slots: u32) -> ClaimOutcome {
    store
        .claim_trip_slot(cell, 1, slots, STALE_MS)
        .unwrap_or_else(|error| panic!("claim by {cell} failed: {error}"))
}

/// Cells whose switch says reserve: the only ones whose `db` row can hold a slot.
fn reserve_cells(store: &Store, cells: &[&str]) {
    for cell in cells {
        store.set_admit_mode(cell, "reserve").unwrap();
    }
}

pub fn a_live_holder_keeps_its_slot(store: &Db) {
    reserve_cells(store, &["c1", "c2"]);
    assert_eq!(
        claim(store, "c1", 1),
        ClaimOutcome::Permit { others_holding: 0 }
    );
    assert_eq!(store.admit_effective("c1").unwrap().unwrap().mode, "db");
    store.advance(1_000);
    assert_eq!(
        claim(store, "c2", 1),
        ClaimOutcome::Refused { others_holding: 1 }
    );
    let refused = store
        .admit_effective("c2")
        .expect("read")
        .expect("refused row");
    assert_eq!(refused.mode, "reserve");
    assert!(
        (0..MARGIN_MS).contains(&refused.age_ms),
        "a refused claim keeps its reserve row fresh: {refused:?}"
    );
    // The holder's row is just inside the stale window (by the database's clock).
    store.advance(STALE_MS - 1_000 - MARGIN_MS);
    assert_eq!(
        claim(store, "c2", 1),
        ClaimOutcome::Refused { others_holding: 1 },
        "still live inside the stale window"
    );
    assert_eq!(
        claim(store, "c1", 1),
        ClaimOutcome::Permit { others_holding: 0 },
        "a holder does not count itself"
    );
}

pub fn a_stale_holder_frees_exactly_one_slot(store: &Db) {
    reserve_cells(store, &["c1", "c2", "c3", "c4"]);
    // c1 tripped and died: by the claims its row is one ms past the stale window. c2 is alive.
    store.write_admit_effective("c1", 1, "db").unwrap();
    store.advance(STALE_MS - 1_000 + 1);
    store.write_admit_effective("c2", 1, "db").unwrap();
    store.advance(1_000);
    assert_eq!(
        claim(store, "c3", 2),
        ClaimOutcome::Permit { others_holding: 1 }
    );
    assert_eq!(
        claim(store, "c4", 2),
        ClaimOutcome::Refused { others_holding: 2 }
    );
}

pub fn a_holder_whose_switch_says_db_does_not_count(store: &Db) {
    reserve_cells(store, &["c2"]);
    store.set_admit_mode("c1", "db").unwrap();
    store.write_admit_effective("c1", 1, "db").unwrap();
    // c9 has a db row and no switch record at all, which also means db.
    store.write_admit_effective("c9", 1, "db").unwrap();
    assert_eq!(
        claim(store, "c2", 1),
        ClaimOutcome::Permit { others_holding: 0 }
    );
}

pub fn rewriting_reserve_frees_the_slot(store: &Db) {
    reserve_cells(store, &["c1", "c2"]);
    assert_eq!(
        claim(store, "c1", 1),
        ClaimOutcome::Permit { others_holding: 0 }
    );
    assert_eq!(
        claim(store, "c2", 1),
        ClaimOutcome::Refused { others_holding: 1 }
    );
    // c1 is re-armed (or restarted): it writes reserve, and its slot is free again.
    store.write_admit_effective("c1", 2, "reserve").unwrap();
    assert_eq!(
        claim(store, "c2", 1),
        ClaimOutcome::Permit { others_holding: 0 }
    );
}

pub fn zero_slots_never_permit(store: &Db) {
    reserve_cells(store, &["c1"]);
    assert_eq!(
        claim(store, "c1", 0),
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
        for cell in &cells {
            admin.write_admit_effective(cell, 1, "reserve").unwrap();
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
                        match store.claim_trip_slot(&cell, 1, SLOTS, STALE_MS) {
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

/// A live handover's next process applies a changed URL, region or internal URL without
/// registering again (SPEC §13): its heartbeat carries them into the registration, only for the
/// registered incarnation and only when they differ; an older incarnation's beat never rewrites
/// it, and a beat that does not say its internal URL keeps the stored one.
pub fn a_heartbeat_carries_what_the_cell_advertises(store: &Db) {
    use orca_relay::store::Advertised;
    store
        .register_cell("c1", "ws://c1", "http://c1", "eu", 5)
        .unwrap();
    let said = |url, region, internal| Advertised {
        cell_url: url,
        region,
        internal_url: internal,
    };
    let beat = |incarnation, advertised| {
        store
            .heartbeat_advertised("c1", incarnation, NOW, true, 0, advertised)
            .unwrap()
    };
    let row = || store.list_cells().unwrap().remove(0);
    assert_eq!(
        beat(5, said("ws://c1", "eu", Some("http://c1"))),
        (HeartbeatOutcome::Accepted, false),
        "nothing changed, nothing written"
    );
    let registered_at = row().registered_at;
    assert_eq!(
        beat(5, said("wss://new-name", "eu-2", Some("http://c1-new"))),
        (HeartbeatOutcome::Accepted, true)
    );
    let c1 = row();
    assert_eq!(
        (
            c1.cell_url.as_str(),
            c1.region.as_str(),
            c1.internal_url.as_deref()
        ),
        ("wss://new-name", "eu-2", Some("http://c1-new"))
    );
    assert_eq!(c1.incarnation, 5);
    assert_eq!(c1.registered_at, registered_at, "not a new registration");
    assert_eq!(
        beat(5, said("wss://newer", "eu-2", None)),
        (HeartbeatOutcome::Accepted, true)
    );
    assert_eq!(row().internal_url.as_deref(), Some("http://c1-new"));
    assert_eq!(
        beat(4, said("ws://old-process", "eu", Some("http://old"))),
        (HeartbeatOutcome::StaleIncarnation, false)
    );
    assert_eq!(
        row().cell_url,
        "wss://newer",
        "an older incarnation rewrites nothing"
    );
    assert_eq!(
        beat(6, said("ws://unregistered", "eu", None)).0,
        HeartbeatOutcome::Unregistered
    );
    assert_eq!(row().cell_url, "wss://newer");
}

/// The proof a handover's next process gives before `ready` (SPEC §13) takes writes and leaves
/// nothing behind: the registration it writes to itself is as it was, on a store with the
/// cell and without it.
pub fn the_write_probe_leaves_nothing_behind(store: &Db) {
    store.write_probe("c1").unwrap();
    assert!(store.list_cells().unwrap().is_empty());
    store
        .register_cell("c1", "ws://c1", "http://c1", "eu", 5)
        .unwrap();
    let before = store.list_cells().unwrap();
    let statements = store.statements_executed();
    store.write_probe("c1").unwrap();
    assert!(
        store.statements_executed() > statements,
        "it asked the database"
    );
    let after = store.list_cells().unwrap();
    let row = |cells: &[orca_relay::store::CellRow]| {
        let c = &cells[0];
        (
            c.cell_url.clone(),
            c.internal_url.clone(),
            c.region.clone(),
            c.incarnation,
            c.registered_at,
        )
    };
    assert_eq!(row(&after), row(&before));
}
