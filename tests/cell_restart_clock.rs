//! A cell restarted on a machine whose clock was stepped back re-registers (found by the
//! nemesis, `tests/nemesis_fleet.rs` seed 1, issue 21).
//!
//! A cell's incarnation orders its runs: a director refuses a registration or heartbeat of a
//! lower incarnation than the one it stored (`409 stale_cell_incarnation`), so a late message
//! of a dead run can never override the live one. It used to be the start time on the cell's
//! own wall clock, so a cell restarted after its clock went back (an NTP correction, a VM
//! restored from a snapshot) presented a lower incarnation than its previous run, was refused
//! at every start and crash-looped until its clock passed the old start time: minutes, or
//! hours. The real binary is started twice on the same data directory against a real director,
//! the second time with its clock five minutes behind (the test knob
//! `ORCA_RELAY_TEST_CLOCK_OFFSET_MS`).

mod harness;

use std::sync::Arc;
use std::time::Duration;

use harness::*;

fn director(jwks: &FakeServer) -> Relay {
    let jwks_url = format!("{}/jwks.json", jwks.url());
    Relay::start_in(
        Arc::new(TempDir::new("restart-clock-director")),
        &[
            ("ORCA_RELAY_ROLE", "director"),
            ("ORCA_RELAY_SERVICE_TOKEN", SERVICE_TOKEN),
            ("ORCA_RELAY_JWKS_URL", &jwks_url),
            ("ORCA_RELAY_AUTH_ISSUER", TEST_ISSUER),
        ],
    )
}

fn start_cell(dir: &Arc<TempDir>, jwks: &FakeServer, director: &Relay, offset_ms: i64) -> Relay {
    let jwks_url = format!("{}/jwks.json", jwks.url());
    let director_url = director.http_url("");
    let offset = offset_ms.to_string();
    Relay::launch(
        dir.clone(),
        &[
            ("ORCA_RELAY_ROLE", "cell"),
            ("ORCA_RELAY_CELL_ID", "c-clock"),
            ("ORCA_RELAY_SERVICE_TOKEN", SERVICE_TOKEN),
            ("ORCA_RELAY_JWKS_URL", &jwks_url),
            ("ORCA_RELAY_AUTH_ISSUER", TEST_ISSUER),
            ("ORCA_RELAY_DIRECTOR_URLS", &director_url),
            ("ORCA_RELAY_HANDSHAKE_TIMEOUT_MS", "3000"),
            ("ORCA_RELAY_TEST_CLOCK_OFFSET_MS", &offset),
        ],
    )
}

/// Starts the cell and waits for it to serve, or for its handshake to fail.
fn started(cell: &mut Relay) -> Result<(), String> {
    let ok = wait_until(Duration::from_secs(30), || {
        cell.count_log("orca_relay_started") > 0
            || cell.count_log("orca_relay_handshake_failed") > 0
    });
    if ok && cell.count_log("orca_relay_started") > 0 {
        Ok(())
    } else {
        Err(cell.log_text())
    }
}

#[test]
fn a_cell_restarted_with_its_clock_stepped_back_registers_again() {
    let jwks = jwks_server();
    let director = director(&jwks);
    let dir = Arc::new(TempDir::new("restart-clock-cell"));
    let mut first = start_cell(&dir, &jwks, &director, 0);
    started(&mut first).expect("the first run starts");
    drop(first);
    // The machine's clock went back five minutes; the cell restarts on the same data.
    let mut second = start_cell(&dir, &jwks, &director, -300_000);
    if let Err(log) = started(&mut second) {
        panic!("the restarted cell must register again:\n{log}");
    }
    // And once more with the clock right again (five minutes ahead of the last run).
    drop(second);
    let mut third = start_cell(&dir, &jwks, &director, 0);
    started(&mut third).expect("the third run starts");
}

#[test]
fn a_cell_restarted_after_its_clock_ran_ahead_registers_again() {
    let jwks = jwks_server();
    let director = director(&jwks);
    let dir = Arc::new(TempDir::new("restart-clock-ahead"));
    let mut first = start_cell(&dir, &jwks, &director, 300_000);
    started(&mut first).expect("the first run starts");
    drop(first);
    // The clock was corrected: the next start is five minutes "earlier" than the last one.
    let mut second = start_cell(&dir, &jwks, &director, 0);
    if let Err(log) = started(&mut second) {
        panic!("the restarted cell must register again:\n{log}");
    }
}
