//! The store on PostgreSQL, against the test server of `scripts/test-postgres.sh`: every
//! scenario of `common::store_cases`, plus what only PostgreSQL shows (concurrent migrators,
//! `application_name` and the pool ceiling in `pg_stat_activity`, statement timeouts, the
//! advisory lock). Each test gets its own database. Without ORCA_RELAY_TEST_DATABASE_URL every
//! test here fails.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Barrier};
use std::time::Duration;

use common::pg;
use common::store_cases::{self as cases, Db, STALE_MS};
use orca_relay::clock;
use orca_relay::store::claim::TRIP_SLOT_LOCK_KEY;
use orca_relay::store::{Backend, ClaimOutcome, Store, StoreConfig};
use orca_relay::threads;

fn config(url: &str, application_name: &str) -> StoreConfig {
    StoreConfig {
        pool_max: 4,
        pool_ceiling: 4,
        application_name: application_name.to_string(),
        ..StoreConfig::new(Some(url.to_string()), "unused.db".into())
    }
}

fn migrated_store(name: &str) -> (Store, String) {
    let url = pg::fresh_database(name);
    let store = Store::open(&config(&url, "orca-relay:test:store")).expect("open");
    assert_eq!(store.backend(), Backend::Postgres);
    store.migrate().expect("migrate");
    (store, url)
}

/// A migrated store on a fresh database. PostgreSQL's `now()` cannot be moved, so moving the
/// database's clock forward moves every stamp in the cell tables back instead.
fn migrated(name: &str) -> Db {
    let (store, url) = migrated_store(name);
    let mut admin = pg::connect(&url);
    let advance = move |ms: i64| {
        let shift = format!(
            "UPDATE relay_cells SET registered_at = registered_at - {ms};
             UPDATE relay_cell_runtime SET last_heartbeat_at = last_heartbeat_at - {ms};
             UPDATE relay_cell_admit_modes SET updated_at = updated_at - {ms};
             UPDATE relay_cell_admit_effective SET updated_at = updated_at - {ms};
             UPDATE relay_assignment_activity_leases SET expires_at = expires_at - {ms};"
        );
        admin.batch_execute(&shift).expect("move the stamps back");
    };
    let admin = std::sync::Mutex::new(advance);
    Db::new(store, move |ms| (admin.lock().unwrap())(ms))
}

/// Waits until `check` holds, polling with a short pause, or fails after `what` took 20 s.
fn wait_until(what: &str, mut check: impl FnMut() -> bool) {
    let deadline = clock::instant() + Duration::from_secs(20);
    while !check() {
        assert!(clock::instant() < deadline, "timed out waiting for {what}");
        clock::sleep(Duration::from_millis(20));
    }
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
fn several_processes_migrate_at_once() {
    let url = pg::fresh_database("migrators");
    let barrier = Arc::new(Barrier::new(6));
    let migrators: Vec<_> = (0..6)
        .map(|i| {
            let url = url.clone();
            let barrier = barrier.clone();
            threads::spawn(format!("migrator-{i}"), move || {
                let store = Store::open(&config(&url, "orca-relay:test:migrator")).unwrap();
                store.ping().expect("connect before the race");
                barrier.wait();
                store.migrate()
            })
            .unwrap()
        })
        .collect();
    for migrator in migrators {
        migrator.join().unwrap().expect("every migrator succeeds");
    }
    let row = pg::connect(&url)
        .query_one(
            "SELECT count(*), count(DISTINCT version) FROM schema_migrations",
            &[],
        )
        .unwrap();
    let (applied, versions): (i64, i64) = (row.get(0), row.get(1));
    assert!(versions >= 2, "every migration applied");
    assert_eq!(applied, versions, "each version recorded once");
}

#[test]
fn open_does_not_need_the_database_and_a_dead_server_is_unavailable() {
    // Port 1 on localhost: nothing listens, the connect is refused at once.
    let store = Store::open(&StoreConfig {
        connect_timeout_ms: 1_000,
        ..config(
            "postgres://postgres@127.0.0.1:1/none",
            "orca-relay:test:dead",
        )
    })
    .expect("opening a store does not connect");
    let error = store.ping().unwrap_err();
    assert!(error.is_unavailable(), "{error}");
    assert_eq!(error.reason_code(), "sql_failed");
    assert!(
        !error.to_string().contains("postgres://"),
        "no connection string: {error}"
    );
    assert_eq!(
        store.pool_stats().open,
        0,
        "the failed connect gave its slot back"
    );
}

#[test]
fn connections_carry_the_application_name() {
    let url = pg::fresh_database("appname");
    let name = "orca-relay:cell:appname-c7";
    let store = Store::open(&config(&url, name)).unwrap();
    store.ping().unwrap();
    let mut admin = pg::admin_client();
    assert_eq!(
        pg::connections_named(&mut admin, &pg::database_name(&url), name),
        1
    );
}

#[test]
fn the_pool_ceiling_bounds_connections_in_pg_stat_activity() {
    const CALLERS: usize = 20;
    const MAX: u32 = 6;
    let url = pg::fresh_database("ceiling");
    let database = pg::database_name(&url);
    let name = "orca-relay:cell:ceiling-test";
    let store = Store::open(&StoreConfig {
        pool_max: MAX,
        pool_ceiling: 2,
        checkout_timeout_ms: 30_000,
        ..config(&url, name)
    })
    .unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let callers: Vec<_> = (0..CALLERS)
        .map(|i| {
            let store = store.clone();
            let stop = stop.clone();
            threads::spawn(format!("caller-{i}"), move || {
                while !stop.load(Ordering::SeqCst) {
                    store.ping().expect("ping under load");
                }
            })
            .unwrap()
        })
        .collect();
    let mut admin = pg::admin_client();

    // Ceiling 2: twenty callers queue up, PostgreSQL never sees a third connection.
    let mut saw_waiters = false;
    let mut peak = 0;
    for _ in 0..100 {
        peak = peak.max(pg::connections_named(&mut admin, &database, name));
        saw_waiters |= store.pool_stats().waiters > 0;
    }
    assert!(peak <= 2, "{peak} connections under ceiling 2");
    assert_eq!(peak, 2, "the callers do use both connections");
    assert!(saw_waiters, "callers waited for a connection");
    assert!(store.has_waiters() || store.pool_stats().open == 2);

    // Raised to the max: the waiters open the rest of the pool.
    store.set_pool_ceiling(MAX);
    wait_until("the pool to reach its max", || {
        pg::connections_named(&mut admin, &database, name) == MAX as i64
    });
    assert_eq!(store.pool_stats().open, MAX);

    // Lowered again under load: connections close as they come back.
    store.set_pool_ceiling(2);
    wait_until("the pool to shrink to the ceiling", || {
        pg::connections_named(&mut admin, &database, name) <= 2
    });
    assert!(store.pool_stats().open <= 2);

    stop.store(true, Ordering::SeqCst);
    for caller in callers {
        caller.join().expect("caller panicked");
    }
}

#[test]
fn a_statement_past_the_timeout_is_sql_timed_out() {
    let url = pg::fresh_database("timeout");
    let store = Store::open(&StoreConfig {
        statement_timeout_ms: 300,
        ..config(&url, "orca-relay:test:timeout")
    })
    .unwrap();
    store.migrate().unwrap();
    let mut blocker = pg::connect(&url);
    let mut tx = blocker.transaction().unwrap();
    tx.batch_execute("LOCK TABLE relay_assignments IN ACCESS EXCLUSIVE MODE")
        .unwrap();
    let error = store.assignment("u", "h").unwrap_err();
    assert_eq!(error.reason_code(), "sql_timed_out", "{error}");
    assert!(error.is_unavailable());
    tx.rollback().unwrap();
    assert_eq!(
        store.assignment("u", "h").unwrap(),
        None,
        "works again afterwards"
    );
}

#[test]
fn a_caller_finding_no_free_connection_gets_sql_pool_exhausted() {
    let url = pg::fresh_database("exhausted");
    let store = Store::open(&StoreConfig {
        pool_max: 1,
        pool_ceiling: 1,
        checkout_timeout_ms: 200,
        statement_timeout_ms: 10_000,
        ..config(&url, "orca-relay:test:exhausted")
    })
    .unwrap();
    store.migrate().unwrap();
    let mut blocker = pg::connect(&url);
    let mut tx = blocker.transaction().unwrap();
    tx.batch_execute("LOCK TABLE relay_assignments IN ACCESS EXCLUSIVE MODE")
        .unwrap();
    let busy = store.clone();
    let stuck = threads::spawn("stuck-reader", move || busy.assignment("u", "h")).unwrap();
    wait_until("the only connection to be in use", || {
        let stats = store.pool_stats();
        stats.open == 1 && stats.idle == 0
    });
    let error = store.ping().unwrap_err();
    assert_eq!(error.reason_code(), "sql_pool_exhausted", "{error}");
    assert!(error.is_unavailable());
    tx.rollback().unwrap();
    assert_eq!(stuck.join().unwrap().unwrap(), None);
    store.ping().expect("the connection came back");
}

#[test]
fn a_claim_answers_lock_busy_while_another_transaction_holds_the_lock() {
    let url = pg::fresh_database("lockbusy");
    let store = Store::open(&config(&url, "orca-relay:test:lockbusy")).unwrap();
    store.migrate().unwrap();
    store.set_admit_mode("c1", "reserve").unwrap();
    let mut holder = pg::connect(&url);
    let mut tx = holder.transaction().unwrap();
    tx.execute("SELECT pg_advisory_xact_lock($1)", &[&TRIP_SLOT_LOCK_KEY])
        .unwrap();
    let started = clock::instant();
    assert_eq!(
        store.claim_trip_slot("c1", 1, 2, STALE_MS).unwrap(),
        ClaimOutcome::LockBusy
    );
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "the claim did not wait for the lock"
    );
    assert_eq!(
        store.admit_effective("c1").unwrap(),
        None,
        "a busy claim writes nothing"
    );
    tx.commit().unwrap();
    assert_eq!(
        store.claim_trip_slot("c1", 1, 2, STALE_MS).unwrap(),
        ClaimOutcome::Permit { others_holding: 0 }
    );
}

#[test]
fn eight_cells_racing_get_exactly_two_permits() {
    let url = pg::fresh_database("race");
    Store::open(&config(&url, "orca-relay:test:race"))
        .unwrap()
        .migrate()
        .unwrap();
    let open = move || Store::open(&config(&url, "orca-relay:test:race")).expect("open");
    cases::eight_cells_racing_get_exactly_two_permits(&open, 30);
}

/// Ends every session `application_name` holds on `database` (what a restart, a failover or
/// an administrator's `pg_terminate_backend` does to a pool's idle connections) and waits
/// until the server has let them go.
fn terminate_sessions(database: &str, application_name: &str) {
    let mut admin = pg::admin_client();
    admin
        .execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity
             WHERE datname = $1 AND application_name = $2",
            &[&database, &application_name],
        )
        .unwrap();
    wait_until("the sessions to end", || {
        pg::connections_named(&mut admin, database, application_name) == 0
    });
}

/// SPEC §12: work whose pooled connection the server had closed is retried once on a fresh
/// connection, when nothing it sent may have committed (issue 20: the first admission after a
/// promote refused for a dead pooled connection). A write that may have committed on its own
/// (an autocommit statement) is never repeated: it fails instead.
#[test]
fn work_on_a_pooled_connection_the_server_closed_is_retried_once_unless_it_may_have_committed() {
    let url = pg::fresh_database("closed_pooled");
    let database = pg::database_name(&url);
    let name = "orca-relay:test:closed-pooled";
    let store = Store::open(&config(&url, name)).unwrap();
    store.migrate().unwrap();
    assert!(store
        .place_assignment_if_newer("u1", "h1", "c1", 1, 0)
        .unwrap());

    // A write in a transaction: retried, applied once.
    terminate_sessions(&database, name);
    assert!(
        store
            .place_assignment_if_newer("u1", "h1", "c2", 2, 0)
            .expect("retried on a fresh connection"),
        "the retry placed the row"
    );
    let placed = store.assignment("u1", "h1").unwrap().unwrap();
    assert_eq!((placed.cell_id.as_str(), placed.epoch), ("c2", 2));

    // A read: retried.
    terminate_sessions(&database, name);
    assert_eq!(store.list_cells().expect("retried").len(), 0);

    // An autocommit write (a lease deletion) may have committed before the connection broke:
    // the caller gets the failure, never a second delete.
    terminate_sessions(&database, name);
    let error = store.delete_lease("gone").unwrap_err();
    assert!(error.is_unavailable(), "{error}");
    // The next call finds a fresh connection.
    store.delete_lease("gone").expect("a fresh connection");
}

/// Issue 30: work whose connection the server closed while it waited for its `COMMIT`'s answer
/// may have committed, so it is never run again on a fresh connection: the caller gets the
/// failure. Here a deferred constraint trigger holds the `COMMIT` on an advisory lock the test
/// holds, the test terminates that backend, then lets the lock go (a retry would now commit).
#[test]
fn work_whose_connection_the_server_closed_at_commit_is_not_retried() {
    const LOCK: i64 = 30_042;
    let url = pg::fresh_database("closed_at_commit");
    let database = pg::database_name(&url);
    let name = "orca-relay:test:closed-at-commit";
    let store = Store::open(&config(&url, name)).unwrap();
    store.migrate().unwrap();
    // The pool keeps this connection: the next call reuses it.
    assert!(store
        .place_assignment_if_newer("u1", "h1", "c1", 1, 0)
        .unwrap());
    let mut holder = pg::connect(&url);
    holder
        .batch_execute(&format!(
            "CREATE FUNCTION wait_at_commit() RETURNS trigger LANGUAGE plpgsql AS $$
             BEGIN
                 PERFORM pg_advisory_lock({LOCK});
                 PERFORM pg_advisory_unlock({LOCK});
                 RETURN NULL;
             END $$;
             CREATE CONSTRAINT TRIGGER wait_at_commit AFTER INSERT OR UPDATE ON relay_assignments
                 DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION wait_at_commit();
             SELECT pg_advisory_lock({LOCK});"
        ))
        .unwrap();
    let statements_before = store.statements_executed();
    let placing = {
        let store = store.clone();
        threads::spawn("test-place", move || {
            store.place_assignment_if_newer("u1", "h1", "c2", 2, 0)
        })
        .unwrap()
    };
    // The store's backend waits at its COMMIT, in the trigger, for the lock.
    let mut admin = pg::admin_client();
    let mut waiting: Option<i32> = None;
    wait_until("the COMMIT to wait for the lock", || {
        waiting = admin
            .query_opt(
                "SELECT pid FROM pg_stat_activity
                 WHERE datname = $1 AND application_name = $2
                   AND query = 'COMMIT' AND wait_event_type = 'Lock'",
                &[&database, &name],
            )
            .unwrap()
            .map(|row| row.get(0));
        waiting.is_some()
    });
    admin
        .execute("SELECT pg_terminate_backend($1)", &[&waiting.unwrap()])
        .unwrap();
    // From here a COMMIT would go through: only a retry could place the row now.
    holder
        .batch_execute(&format!("SELECT pg_advisory_unlock({LOCK})"))
        .unwrap();
    let error = placing
        .join()
        .unwrap()
        .expect_err("a COMMIT that may have committed is not sent again");
    assert!(error.is_unavailable(), "{error}");
    assert_eq!(
        store.statements_executed() - statements_before,
        3,
        "BEGIN, INSERT, COMMIT once"
    );
    let row = store.assignment("u1", "h1").unwrap().unwrap();
    assert_eq!((row.cell_id.as_str(), row.epoch), ("c1", 1), "not placed");
}

/// SPEC §12: the readiness probe fails on a server that answers but takes no writes, with
/// the SQLSTATE in what it reports; a write refused there carries it too.
#[test]
fn the_probe_fails_on_a_read_only_server_and_failures_carry_the_sqlstate() {
    let url = pg::fresh_database("read_only");
    let store = Store::open(&config(&url, "orca-relay:test:read-only")).unwrap();
    store.migrate().unwrap();
    store.probe().expect("a primary takes writes");
    let database = pg::database_name(&url);
    pg::admin_client()
        .batch_execute(&format!(
            "ALTER DATABASE \"{database}\" SET default_transaction_read_only = on"
        ))
        .unwrap();
    // Sessions opened from now on are read-only; drop the pool's.
    terminate_sessions(&database, "orca-relay:test:read-only");
    let error = store.probe().unwrap_err();
    assert_eq!(error.reason_code(), "sql_read_only", "{error}");
    assert_eq!(error.code(), Some("25006"));
    assert_eq!(error.log_fields(), "reason=sql_read_only sqlstate=25006");
    let refused = store
        .place_assignment_if_newer("u1", "h1", "c1", 1, 0)
        .unwrap_err();
    assert!(refused.is_unavailable(), "{refused}");
    assert_eq!(refused.code(), Some("25006"), "{refused}");
    assert_eq!(refused.reason_code(), "sql_read_only");
}

/// A handover's next process whose database has no schema yet (its migrations come after the
/// commit) proves it by the readiness question alone, and creates nothing.
#[test]
fn the_write_probe_of_a_database_without_the_schema_creates_nothing() {
    let url = pg::fresh_database("write_probe_empty");
    let store = Store::open(&config(&url, "orca-relay:test:store")).expect("open");
    store.write_probe("c1").expect("the probe");
    let mut admin = pg::connect(&url);
    let tables: i64 = admin
        .query_one(
            "SELECT count(*) FROM pg_tables WHERE schemaname = 'public'",
            &[],
        )
        .unwrap()
        .get(0);
    assert_eq!(tables, 0, "nothing created");
}
