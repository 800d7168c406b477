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

use handover_kit::load::{Identity, Spec};
use handover_kit::remote::RemoteLoad;
use handover_kit::{build_with_note, hand_over, Poller, Serving};
use harness::*;
use orca_relay::store::{Store, StoreConfig};

const DEADLINE: Duration = Duration::from_secs(60);

fn owned(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

#[test]
fn a_postgres_cell_under_load_hands_over_losing_nothing() {
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
