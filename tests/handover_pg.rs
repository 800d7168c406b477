//! Live handover of a PostgreSQL cell with its director (SPEC §12, issue 23): the issue's load
//! (1,000 controls admitted through the database, each with its activity lease; 200 streaming
//! pairs, one backpressured) crosses `orca-relay handover` to the next build with nothing
//! closed or lost, no stream paused a second, `/ready` and `/health` always 200, and the
//! cell's registration, leases and admit-effective row those of the same incarnation.
//!
//! Needs `ORCA_RELAY_TEST_DATABASE_URL` (`eval "$(scripts/test-postgres.sh start)"`).

mod common;
mod handover_kit;
mod harness;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use handover_kit::load::{Identity, Load, Spec};
use handover_kit::remote::RemoteLoad;
use handover_kit::{build_with_note, hand_over, Poller, Serving};
use harness::*;
use orca_relay::store::{Store, StoreConfig};

const DEADLINE: Duration = Duration::from_secs(60);

/// The tests take turns: the load test's stall figure is the relay's, not a neighbour's fleet
/// starting beside it on two cores.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn my_turn() -> std::sync::MutexGuard<'static, ()> {
    ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner())
}

fn owned(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

#[test]
fn a_postgres_cell_under_load_hands_over_losing_nothing() {
    let _turn = my_turn();
    handover_kit::raise_fd_limit();
    handover_kit::adopt_orphans();
    let jwks = jwks_server();
    let database_url = common::pg::fresh_database("handover");
    let jwks_url = format!("{}/jwks.json", jwks.url());
    let shared = owned(&[
        ("DATABASE_URL", &database_url),
        ("ORCA_RELAY_SERVICE_TOKEN", SERVICE_TOKEN),
        ("ORCA_RELAY_JWKS_URL", &jwks_url),
        ("ORCA_RELAY_AUTH_ISSUER", TEST_ISSUER),
        ("ORCA_RELAY_HEARTBEAT_MS", "500"),
        ("ORCA_RELAY_FEED_POLL_MS", "200"),
    ]);
    let mut env = shared.clone();
    env.push(("ORCA_RELAY_ROLE".into(), "director".into()));
    let director = Relay::start_in(Arc::new(TempDir::new("director")), &env_refs(&env));
    let mut env = shared.clone();
    env.extend(owned(&[
        ("ORCA_RELAY_ROLE", "cell"),
        ("ORCA_RELAY_CELL_ID", "pg-handed"),
        ("ORCA_RELAY_DIRECTOR_URLS", &director.http_url("")),
        ("ORCA_RELAY_PING_MS", "2000"),
        ("ORCA_RELAY_WEDGE_MS", "60000"),
        ("ORCA_RELAY_CONNECTION_CAP", "20000"),
        ("ORCA_RELAY_DATABASE_POOL_MAX", "20"),
        ("ORCA_RELAY_SPLICE_WORKERS", "2"),
    ]));
    let cell = Relay::start_in(Arc::new(TempDir::new("pg-cell")), &env_refs(&env));
    assert!(wait_until(DEADLINE, || cell.get("/ready").0 == 200));
    let store = Store::open(&StoreConfig::new(Some(database_url), PathBuf::new())).unwrap();
    assert!(wait_until(DEADLINE, || store.list_cells().is_ok_and(
        |cells| cells
            .iter()
            .any(|c| c.cell_id == "pg-handed" && c.runtime.as_ref().is_some_and(|r| r.ready))
    )));

    // 1,000 desktops placed by the director, admitted by the cell from the database.
    let identities: Vec<Identity> = (0..1_000)
        .map(|_| {
            let relay_host_id = host_id();
            let user_id = format!("user-{relay_host_id}");
            let token = es256_token(&user_id, &relay_host_id);
            let epoch = assign(&director, &token, &relay_host_id);
            Identity {
                user_id,
                relay_host_id,
                token,
                epoch,
            }
        })
        .collect();
    let sample = identities[7].relay_host_id.clone();
    let mut load = RemoteLoad::start("load_helper", &cell.ws, Spec::new(1_000, 200), identities);
    let now = || orca_relay::clock::system().now_ms() as i64;
    assert_eq!(store.live_leases_for_host(&sample, now()).unwrap(), 1);
    let row_before = store.admit_effective("pg-handed").unwrap().unwrap();
    orca_relay::clock::sleep(Duration::from_secs(2));
    load.pause_desktop(0);
    orca_relay::clock::sleep(Duration::from_secs(1));
    let next = build_with_note("next");
    let poller = Poller::start(&cell.http);
    load.mark();
    let began = load.elapsed_ms();
    let outcome = hand_over(&cell, Some(&next), &[], &[]);
    let ended = load.elapsed_ms();
    assert_eq!(outcome.code, 0, "{outcome:?}\n{}", cell.log_text());
    let _serving = Serving {
        pid: outcome.new_pid.expect("new pid"),
    };
    assert_eq!(
        handover_kit::served_version(&cell.http).as_deref(),
        Some("0.1.0+next")
    );
    handover_kit::served(|| load.report(), 399, Duration::from_secs(60));
    load.resume_desktop(0);
    handover_kit::served(|| load.report(), 400, Duration::from_secs(60));
    // (While the load still holds its connections.) The same cell for the database and the director: its lease, its row, its registration.
    assert_eq!(store.live_leases_for_host(&sample, now()).unwrap(), 1);
    let row = store.admit_effective("pg-handed").unwrap().unwrap();
    assert_eq!(row.cell_incarnation, row_before.cell_incarnation);
    let cells = store.list_cells().unwrap();
    let registered = cells.iter().find(|c| c.cell_id == "pg-handed").unwrap();
    assert_eq!(registered.incarnation, row_before.cell_incarnation);
    assert!(registered.runtime.as_ref().is_some_and(|r| r.ready));
    assert_eq!(
        cell.count_log("orca_relay_handshake_succeeded"),
        1,
        "no second registration"
    );
    let (asked, failures) = poller.stop();
    let report = load.report();
    let finished = load.finish(Duration::from_secs(60));
    assert!(
        failures.is_empty(),
        "{} of {asked} polls failed: {failures:?}",
        failures.len()
    );
    assert!(finished.closed.is_empty(), "closed: {:?}", finished.closed);
    assert!(finished.violations.is_empty(), "{:?}", finished.violations);
    assert_eq!(
        finished.messages_received, finished.messages_sent,
        "{finished:?}"
    );
    assert_eq!(report.pinged_since_mark, 1_000, "{report:?}");
    assert_eq!(report.streams_flowing_since_mark, 400, "{report:?}");
    assert!(
        report.max_stall_ms < 1_000,
        "{report:?}; {outcome:?}; the handover ran from {began} to {ended} ms"
    );
    eprintln!("{outcome:?}\n{finished:?}");
}

/// The load's own process (`handover_kit::remote`): nothing unless started as one.
#[test]
fn load_helper() {
    handover_kit::remote::helper_main();
}

/// A director and a `cell` on a fresh PostgreSQL database, the cell heartbeating every
/// `heartbeat_ms`: (director, cell, the test's view of the database, its URL).
fn cell_with_director(name: &str, heartbeat_ms: &str) -> (Relay, Relay, Store, String) {
    let jwks = jwks_server();
    let database_url = common::pg::fresh_database(name);
    let jwks_url = format!("{}/jwks.json", jwks.url());
    // The JWKS server lives as long as the test process: both relays read it.
    std::mem::forget(jwks);
    let shared = owned(&[
        ("DATABASE_URL", &database_url),
        ("ORCA_RELAY_SERVICE_TOKEN", SERVICE_TOKEN),
        ("ORCA_RELAY_JWKS_URL", &jwks_url),
        ("ORCA_RELAY_AUTH_ISSUER", TEST_ISSUER),
        ("ORCA_RELAY_HEARTBEAT_MS", heartbeat_ms),
        ("ORCA_RELAY_FEED_POLL_MS", "200"),
        ("ORCA_RELAY_PING_MS", "1000"),
    ]);
    let mut env = shared.clone();
    env.push(("ORCA_RELAY_ROLE".into(), "director".into()));
    let director = Relay::start_in(Arc::new(TempDir::new("director")), &env_refs(&env));
    let mut env = shared;
    env.extend(owned(&[
        ("ORCA_RELAY_ROLE", "cell"),
        ("ORCA_RELAY_CELL_ID", "pg-cell"),
        ("ORCA_RELAY_DIRECTOR_URLS", &director.http_url("")),
    ]));
    let cell = Relay::start_in(Arc::new(TempDir::new("pg-cell")), &env_refs(&env));
    assert!(wait_until(DEADLINE, || cell.get("/ready").0 == 200));
    let store = Store::open(&StoreConfig::new(
        Some(database_url.clone()),
        PathBuf::new(),
    ))
    .unwrap();
    assert!(wait_until(DEADLINE, || store.list_cells().is_ok_and(
        |cells| cells
            .iter()
            .any(|c| c.cell_id == "pg-cell" && c.runtime.as_ref().is_some_and(|r| r.ready))
    )));
    (director, cell, store, database_url)
}

/// A desktop placed by the director: its identity and the `cellUrl` it was given (a 503, as
/// while the director has not yet seen the cell's first beat, is asked again for up to 10 s).
fn placed(director: &Relay) -> (Identity, String) {
    let relay_host_id = host_id();
    let user_id = format!("user-{relay_host_id}");
    let token = es256_token(&user_id, &relay_host_id);
    let mut answer = try_assigned(director, &token, &relay_host_id);
    let deadline = orca_relay::clock::instant() + Duration::from_secs(10);
    while answer.as_ref().is_err_and(|e| e.starts_with("503"))
        && orca_relay::clock::instant() < deadline
    {
        orca_relay::clock::sleep(Duration::from_millis(100));
        answer = try_assigned(director, &token, &relay_host_id);
    }
    let (url, epoch) = answer.unwrap_or_else(|body| panic!("assign: {body}"));
    let identity = Identity {
        user_id,
        relay_host_id,
        token,
        epoch,
    };
    (identity, url)
}

/// `POST /v1/assign` on the director: (cellUrl, epoch).
fn assigned(director: &Relay, token: &str, relay_host_id: &str) -> (String, i64) {
    try_assigned(director, token, relay_host_id).unwrap_or_else(|body| panic!("assign: {body}"))
}

/// `POST /v1/assign` on the director: (cellUrl, epoch), or the answer when it is not a 200.
fn try_assigned(
    director: &Relay,
    token: &str,
    relay_host_id: &str,
) -> Result<(String, i64), String> {
    let (status, body) = director.post(
        "/v1/assign",
        Some(token),
        &serde_json::json!({"v":1,"relayHostId":relay_host_id}).to_string(),
    );
    if status != 200 {
        return Err(format!("{status} {body}"));
    }
    let value: serde_json::Value = serde_json::from_str(&body).unwrap();
    Ok((
        value["cellUrl"].as_str().unwrap().to_string(),
        value["assignmentEpoch"].as_i64().unwrap(),
    ))
}

/// `orca-relay fleet status --json` against the director: each cell's `cellUrl`.
fn fleet_urls(director: &Relay) -> Vec<(String, String)> {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_orca-relay"))
        .env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .env("ORCA_RELAY_SERVICE_TOKEN", SERVICE_TOKEN)
        .args([
            "fleet",
            "status",
            "--json",
            "--director",
            &director.http_url(""),
        ])
        .output()
        .expect("run fleet status");
    assert!(out.status.success(), "{out:?}");
    let listing: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    listing["cells"]
        .as_array()
        .unwrap()
        .iter()
        .map(|cell| {
            (
                cell["cellId"].as_str().unwrap().to_string(),
                cell["cellUrl"].as_str().unwrap_or_default().to_string(),
            )
        })
        .collect()
}

/// What of the cell's registration a write would change.
fn registration(store: &Store) -> (String, Option<String>, String, i64, i64) {
    let cells = store.list_cells().unwrap();
    let row = cells.iter().find(|c| c.cell_id == "pg-cell").unwrap();
    (
        row.cell_url.clone(),
        row.internal_url.clone(),
        row.region.clone(),
        row.incarnation,
        row.registered_at,
    )
}

/// A committed handover that changed `ORCA_RELAY_CELL_URL` is what the directors hand out
/// within one heartbeat of the commit: `/v1/assign` (a new desktop, and one already placed on
/// the cell) and `orca-relay fleet status` show the new URL. Before: the next process never
/// registered again and heartbeats wrote only the runtime row, so the directors kept handing out
/// the old URL for as long as the process ran.
#[test]
fn a_changed_cell_url_reaches_the_directors_within_one_heartbeat() {
    let _turn = my_turn();
    handover_kit::adopt_orphans();
    const HEARTBEAT_MS: u64 = 1_000;
    let (director, cell, store, _) = cell_with_director("handover_url", "1000");
    let old_url = format!("ws://{}", cell.ws);
    let (desktop, url) = placed(&director);
    assert_eq!(url, old_url);
    let new_url = "wss://new-name.example";
    let outcome = hand_over(&cell, None, &[("ORCA_RELAY_CELL_URL", new_url)], &[]);
    let committed = orca_relay::clock::instant();
    assert_eq!(outcome.code, 0, "{outcome:?}\n{}", cell.log_text());
    let _serving = Serving {
        pid: outcome.new_pid.expect("new pid"),
    };
    // A new desktop each time; one refused is asked again (a 503 right after a handover is
    // issue 31's capacity part, not this test's), and every answer is shown on a failure.
    let mut answers = Vec::new();
    let reached = wait_until(Duration::from_secs(10), || {
        let relay_host_id = host_id();
        let token = es256_token(&format!("user-{relay_host_id}"), &relay_host_id);
        let answer = try_assigned(&director, &token, &relay_host_id).map(|(url, _)| url);
        let reached = answer.as_deref() == Ok(new_url);
        answers.push(answer);
        reached
    });
    let took = committed.elapsed();
    assert!(
        reached,
        "the directors still hand out the old URL: {answers:?}\n{}",
        cell.log_text()
    );
    eprintln!("the new URL was handed out {took:?} after the commit");
    // One heartbeat period, and time for the beat's request and a placement on a loaded
    // machine.
    assert!(
        took < Duration::from_millis(HEARTBEAT_MS + 1_000),
        "{took:?} after the commit"
    );
    let (again, _) = assigned(&director, &desktop.token, &desktop.relay_host_id);
    assert_eq!(
        again, new_url,
        "a desktop placed before hears the new URL too"
    );
    assert_eq!(registration(&store).0, new_url);
    assert!(
        fleet_urls(&director).contains(&("pg-cell".to_string(), new_url.to_string())),
        "{:?}",
        fleet_urls(&director)
    );
    assert_eq!(
        director.count_log("orca_relay_director_cell_advertised cell_id=pg-cell"),
        1,
        "{}",
        director.log_text()
    );
}

/// A store the next process cannot write fails the reload with `DATABASE_URL` named, before
/// anything moved: a server whose transactions are read-only (as a standby's are) and a role
/// that may read but not write (only a real write finds that one out). The cell serves on,
/// its desktops answered, its registration unwritten. Before: the handover committed, then
/// every placement on the cell answered 503 while `/ready` stayed 200 for the SQL grace.
#[test]
fn a_store_the_next_process_cannot_write_fails_the_reload() {
    let _turn = my_turn();
    handover_kit::adopt_orphans();
    let (director, cell, store, database_url) = cell_with_director("handover_store", "1000");
    // A role that may log in and read the relay's tables, and write none.
    let mut admin = common::pg::connect(&database_url);
    admin
        .batch_execute(
            "DO $$ BEGIN CREATE ROLE orca_relay_reader LOGIN;
             EXCEPTION WHEN duplicate_object THEN NULL; END $$;
             GRANT SELECT ON ALL TABLES IN SCHEMA public TO orca_relay_reader;",
        )
        .unwrap();
    let reader_url =
        database_url.replacen("postgres://postgres@", "postgres://orca_relay_reader@", 1);
    assert_ne!(reader_url, database_url);
    let read_only_url = format!("{database_url}?options=-c%20default_transaction_read_only%3Don");
    let identities: Vec<Identity> = (0..3).map(|_| placed(&director).0).collect();
    let load = Load::start(&cell.ws, Spec::new(3, 1), identities);
    load.mark();
    handover_kit::served(|| load.report(), 2, DEADLINE);
    for (name, url) in [
        ("read-only", &read_only_url),
        ("no write privilege", &reader_url),
    ] {
        let before = registration(&store);
        let outcome = hand_over(&cell, None, &[("DATABASE_URL", url)], &[]);
        eprintln!("{name}: {} ({:?})", outcome.stderr.trim(), outcome.took);
        assert_eq!(outcome.code, 1, "{name}: {outcome:?}\n{}", cell.log_text());
        assert!(
            outcome.stderr.contains("the running relay keeps serving")
                && outcome
                    .stderr
                    .contains("DATABASE_URL: the store cannot take writes"),
            "{name}: {outcome:?}"
        );
        assert_eq!(registration(&store), before, "{name}: the store untouched");
        load.mark();
        let report = handover_kit::served(|| load.report(), 2, DEADLINE);
        assert_eq!(
            report.pinged_since_mark, 3,
            "{name}: still answered: {report:?}"
        );
        assert_eq!(report.streams_flowing_since_mark, 2, "{name}: {report:?}");
    }
    let finished = load.finish(Duration::from_secs(30));
    assert!(finished.closed.is_empty(), "{:?}", finished.closed);
    assert_eq!(finished.messages_received, finished.messages_sent);
    assert_eq!(cell.count_log("orca_relay_handover_failed"), 2);
    assert_eq!(cell.count_log("orca_relay_handover_committed"), 0);
    assert_eq!(
        cell.count_log("orca_relay_dead_man_stopped"),
        0,
        "refused before ready: the cell never quiesced"
    );
    assert_eq!(cell.get("/ready").0, 200);
    assert_eq!(placed(&director).1, format!("ws://{}", cell.ws));
}
