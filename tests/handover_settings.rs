//! A live handover proves what the next process will serve before anything moves (SPEC §13
//! "Handover", issue 31): a setting it cannot honour (a listening address it does not hold, a
//! store it cannot write, a value that is not UTF-8) fails the reload with the variable named,
//! the running process serving untouched and nothing written to the store; nothing the next
//! process writes outside its memory happens before the commit, so a rolled-back handover with
//! a changed `ORCA_RELAY_CELL_URL` leaves the old URL in the database, and a committed one
//! advertises the new one. Combined role on SQLite; the cell role with a director on
//! PostgreSQL is in `tests/handover_pg.rs`.

mod handover_kit;
mod harness;

use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::time::Duration;

use handover_kit::load::{Identity, Load, Spec};
use handover_kit::{hand_over, hand_over_raw, Handover, Serving};
use harness::*;
use orca_relay::store::{CellRow, Store, StoreConfig};

const DEADLINE: Duration = Duration::from_secs(60);

/// A placed desktop and the URL `/v1/assign` gave it.
fn placed(relay: &Relay) -> (Identity, String) {
    let relay_host_id = host_id();
    let user_id = format!("user-{relay_host_id}");
    let token = token(&user_id, &relay_host_id);
    let (url, epoch) = assigned(relay, &token, &relay_host_id);
    (
        Identity {
            user_id,
            relay_host_id,
            token,
            epoch,
        },
        url,
    )
}

/// `POST /v1/assign`: (cellUrl, epoch).
fn assigned(relay: &Relay, token: &str, relay_host_id: &str) -> (String, i64) {
    let (status, body) = relay.post(
        "/v1/assign",
        Some(token),
        &serde_json::json!({"v":1,"relayHostId":relay_host_id}).to_string(),
    );
    assert_eq!(status, 200, "assign: {body}");
    let value: serde_json::Value = serde_json::from_str(&body).unwrap();
    (
        value["cellUrl"].as_str().unwrap().to_string(),
        value["assignmentEpoch"].as_i64().unwrap(),
    )
}

/// The combined relay's own registration, read from its SQLite database.
fn registration(relay: &Relay) -> CellRow {
    let store = Store::open(&StoreConfig::new(None, relay.data_dir.0.join("relay.db"))).unwrap();
    let cells = store.list_cells().unwrap();
    cells
        .into_iter()
        .find(|cell| cell.cell_id == "combined")
        .expect("the combined cell is registered")
}

/// What of a registration a write would change.
fn written(row: &CellRow) -> (String, Option<String>, String, i64, i64) {
    (
        row.cell_url.clone(),
        row.internal_url.clone(),
        row.region.clone(),
        row.incarnation,
        row.registered_at,
    )
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn ready(relay: &Relay) {
    assert!(
        wait_until(DEADLINE, || relay.get("/ready").0 == 200),
        "never ready: {}",
        relay.log_text()
    );
}

/// Each setting the next process cannot honour fails the reload with the variable named, before
/// the next process says `ready` (the running one never quiesces): the running process goes on
/// serving its desktops (every control answers its pings, every stream flows), its version
/// unchanged, its registration in the store unwritten.
/// Before: a changed WebSocket or HTTP address and a database nobody answers at were committed
/// (the new address advertised where nothing listens; every placement 503 while `/ready` said
/// 200), a value that is not UTF-8 was read as unset, and another cell id was refused only once
/// every connection had paused.
#[test]
fn a_setting_the_next_process_cannot_honour_fails_the_reload_and_touches_nothing() {
    handover_kit::adopt_orphans();
    type Case = (&'static str, Vec<(&'static str, Vec<u8>)>, &'static str);
    let moved = |port: u16| format!("127.0.0.1:{port}").into_bytes();
    let cases: Vec<Case> = vec![
        (
            "another WebSocket address",
            vec![("ORCA_RELAY_WS_ADDR", moved(free_port()))],
            "ORCA_RELAY_WS_ADDR",
        ),
        (
            "another HTTP address",
            vec![("ORCA_RELAY_HTTP_ADDR", moved(free_port()))],
            "ORCA_RELAY_HTTP_ADDR",
        ),
        (
            "a database nobody answers at",
            vec![(
                "DATABASE_URL",
                format!("postgres://relay@127.0.0.1:{}/relay", free_port()).into_bytes(),
            )],
            "DATABASE_URL",
        ),
        (
            "another cell id",
            vec![("ORCA_RELAY_CELL_ID", b"another".to_vec())],
            "ORCA_RELAY_CELL_ID",
        ),
        (
            "a value that is not UTF-8",
            vec![("ORCA_RELAY_CONNECTION_CAP", b"10000\xff".to_vec())],
            "invalid ORCA_RELAY_CONNECTION_CAP: the value is not valid UTF-8",
        ),
    ];
    let runs: Vec<_> = cases
        .into_iter()
        .map(|(name, extra, named)| {
            orca_relay::threads::spawn("test-refused-setting", move || {
                let relay = Relay::combined(&[("ORCA_RELAY_PING_MS", "1000")]);
                ready(&relay);
                let identities: Vec<Identity> = (0..4).map(|_| placed(&relay).0).collect();
                let load = Load::start(&relay.ws, Spec::new(4, 2), identities);
                load.mark();
                // Two pairs: four streams, one each way.
                handover_kit::served(|| load.report(), 4, DEADLINE);
                let before = registration(&relay);
                let extra: Vec<(&str, &OsStr)> = extra
                    .iter()
                    .map(|(variable, value)| (*variable, OsStr::from_bytes(value)))
                    .collect();
                let outcome = hand_over_raw(&relay, None, &extra, &[]);
                // Served after the refusal: every control pinged, every stream moving.
                load.mark();
                let report = handover_kit::served(|| load.report(), 4, DEADLINE);
                let finished = load.finish(Duration::from_secs(30));
                let after = registration(&relay);
                (name, named, relay, outcome, report, finished, before, after)
            })
            .unwrap()
        })
        .collect();
    for run in runs {
        let (name, named, relay, outcome, report, finished, before, after) = run.join().unwrap();
        let log = relay.log_text();
        eprintln!("{name}: {} ({:?})", outcome.stderr.trim(), outcome.took);
        assert_eq!(outcome.code, 1, "{name}: {outcome:?}\n{log}");
        assert!(
            outcome.stderr.contains("the running relay keeps serving")
                && outcome.stderr.contains(named),
            "{name}: the variable named: {outcome:?}\n{log}"
        );
        assert_eq!(
            relay.count_log("orca_relay_handover_failed"),
            1,
            "{name}\n{log}"
        );
        assert_eq!(
            relay.count_log("orca_relay_handover_committed"),
            0,
            "{name}"
        );
        // Refused before the next process said `ready`: the running one never quiesced (the
        // quiesce stops the cell-wide threads, the dead-man's among them).
        assert_eq!(
            relay.count_log("orca_relay_dead_man_stopped"),
            0,
            "{name}: refused only after the quiesce\n{log}"
        );
        assert!(finished.closed.is_empty(), "{name}: {:?}", finished.closed);
        assert!(
            finished.violations.is_empty(),
            "{name}: {:?}",
            finished.violations
        );
        assert_eq!(finished.messages_received, finished.messages_sent, "{name}");
        assert_eq!(
            report.pinged_since_mark, 4,
            "{name}: still answered: {report:?}"
        );
        assert_eq!(report.streams_flowing_since_mark, 4, "{name}: {report:?}");
        assert_eq!(
            handover_kit::served_version(&relay.http).as_deref(),
            Some("0.1.0"),
            "{name}: the same process serves"
        );
        assert_eq!(
            written(&after),
            written(&before),
            "{name}: the store untouched"
        );
        // The running process still places desktops on the address it serves.
        let (_, url) = placed(&relay);
        assert_eq!(url, format!("ws://{}", relay.ws), "{name}");
        assert_eq!(relay.get("/ready").0, 200, "{name}");
    }
}

/// The newest migration's row and what it made, gone: as a database looks to a build with a
/// migration it has not applied (the next build's, in an upgrade).
fn forget_the_newest_migration(relay: &Relay) {
    let db = rusqlite::Connection::open(relay.data_dir.0.join("relay.db")).unwrap();
    db.busy_timeout(Duration::from_secs(10)).unwrap();
    db.execute_batch(
        "DELETE FROM schema_migrations WHERE version = 3;
         DROP INDEX relay_assignment_activity_leases_by_expiry;",
    )
    .unwrap();
}

/// Whether the newest migration is applied: (its row, its index).
fn newest_migration(relay: &Relay) -> (bool, bool) {
    let db = rusqlite::Connection::open(relay.data_dir.0.join("relay.db")).unwrap();
    db.busy_timeout(Duration::from_secs(10)).unwrap();
    let count = |sql: &str| db.query_row(sql, [], |row| row.get::<_, i64>(0)).unwrap() > 0;
    (
        count("SELECT count(*) FROM schema_migrations WHERE version = 3"),
        count(
            "SELECT count(*) FROM sqlite_master
              WHERE name = 'relay_assignment_activity_leases_by_expiry'",
        ),
    )
}

/// Nothing the next process writes outside its memory happens before the commit. A handover
/// that rolls back after the next process built everything (it never confirms, the running
/// one's 10 s run out) leaves the database as it was: the old URL registered and handed out by
/// `/v1/assign`, a migration of the next build not applied. The same handover committed
/// registers the new URL, which `/v1/assign` then hands out, and applies the migration. Before:
/// the next process migrated and registered its new URL before the commit, so the running
/// process went on serving with `/v1/assign` sending desktops to `wss://new-name…`. The
/// running process's heartbeats are an hour apart here, so none of its own writes hides one.
#[test]
fn a_rolled_back_handover_leaves_the_database_as_it_was() {
    handover_kit::adopt_orphans();
    let relay = Relay::combined(&[
        ("ORCA_RELAY_HEARTBEAT_MS", "3600000"),
        ("ORCA_RELAY_HEARTBEAT_FRESH_MS", "7200000"),
    ]);
    ready(&relay);
    let old_url = format!("ws://{}", relay.ws);
    let before = registration(&relay);
    assert_eq!(before.cell_url, old_url);
    forget_the_newest_migration(&relay);
    let new_url = "wss://new-name.example";
    let outcome: Handover = hand_over(
        &relay,
        None,
        &[("ORCA_RELAY_CELL_URL", new_url)],
        &["--test-fault", "never-confirm"],
    );
    assert_eq!(outcome.code, 1, "{outcome:?}\n{}", relay.log_text());
    assert!(
        outcome.stderr.contains("did not confirm within 10 s"),
        "{outcome:?}"
    );
    let after = registration(&relay);
    assert_eq!(
        written(&after),
        written(&before),
        "the registration unwritten"
    );
    assert_eq!(
        newest_migration(&relay),
        (false, false),
        "no migration before the commit"
    );
    let (_, url) = placed(&relay);
    assert_eq!(url, old_url, "/v1/assign hands out the URL that is served");

    // Committed: the new URL registered and handed out, the migration applied.
    let outcome = hand_over(&relay, None, &[("ORCA_RELAY_CELL_URL", new_url)], &[]);
    assert_eq!(outcome.code, 0, "{outcome:?}\n{}", relay.log_text());
    let _serving = Serving {
        pid: outcome.new_pid.expect("the new pid"),
    };
    assert!(
        wait_until(DEADLINE, || registration(&relay).cell_url == new_url),
        "{}",
        relay.log_text()
    );
    let (_, url) = placed(&relay);
    assert_eq!(url, new_url);
    assert_eq!(
        newest_migration(&relay),
        (true, true),
        "{}",
        relay.log_text()
    );
    assert!(
        relay.count_log("orca_relay_migrations_applied after_handover=true") == 1,
        "{}",
        relay.log_text()
    );
}
