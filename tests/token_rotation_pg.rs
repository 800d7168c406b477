//! Rotating the service token without an outage (SPEC §11 "Security"), with the real binaries
//! on a real PostgreSQL: one `director` and two reserve `cell`s, restarted one at a time as an
//! operator rolls an env file through the fleet. `ORCA_RELAY_SERVICE_TOKEN` is a comma list:
//! the first token is sent, any is accepted, and a peer that answers 401 is asked again with
//! the next token, which is then remembered for it. The roll (docs/OPERATIONS.md "Rotating the
//! service token"), the issue's own sequence:
//!
//! | step | director | cells |
//! |---|---|---|
//! | 0 | `A` | `A` |
//! | 1 | `B,A` (accepts both, sends B; falls back to A for each cell, once) | `A` |
//! | 2 | `B,A` | `B,A`, one cell after the other (send B) |
//! | 3 | `B` (sends B, drops A) | `B,A` |
//! | 4 | `B` | `B`, one after the other |
//!
//! After every step every kind of call still succeeds: registration (each restarted cell),
//! heartbeats, seat-feed polls, and a director→cell booking that a desktop then uses. No call
//! fails on its token anywhere; the only 401s are the ones a cell still on `A` answers to the
//! director's first `B` in step 1, at most a few per cell however many polls follow (the
//! director remembers that the cell takes `A`), and the director says so once per cell
//! (`orca_relay_service_token_fallback`). At the end the old token is refused everywhere.

mod common;
mod harness;

use std::net::TcpListener;
use std::sync::Arc;
use std::time::Duration;

use harness::*;
use orca_relay::store::{Store, StoreConfig};
use serde_json::{json, Value};

const DEADLINE: Duration = Duration::from_secs(30);
const A: &str = "service-token-a-0123456789abcdef";
const B: &str = "service-token-b-fedcba9876543210";

fn wait_for(what: &str, condition: impl FnMut() -> bool) {
    assert!(
        wait_until(DEADLINE, condition),
        "timed out waiting for {what}"
    );
}

fn metric(relay: &Relay, series: &str) -> f64 {
    relay.metric(series).unwrap_or(0.0)
}

fn feed_polls(director: &Relay, cell_id: &str, result: &str) -> f64 {
    metric(
        director,
        &format!(
            "orca_relay_director_feed_polls_total{{cell_id=\"{cell_id}\",result=\"{result}\"}}"
        ),
    )
}

fn admin_requests(director: &Relay, route: &str, status: u16) -> f64 {
    metric(
        director,
        &format!(
            "orca_relay_director_admin_requests_total{{route=\"{route}\",status=\"{status}\"}}"
        ),
    )
}

fn free_addr() -> String {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|listener| listener.local_addr())
        .map(|addr| addr.to_string())
        .expect("a free port")
}

/// Log lines that would mean a call failed on its token, anywhere.
const TOKEN_FAILURES: &[&str] = &[
    "unauthorized",
    "status=401",
    "http status 401",
    "orca_relay_assign_reserve_failed",
    "result=http_error",
];

struct Fleet {
    database_url: String,
    jwks_url: String,
    director_addr: String,
    director: Option<Relay>,
    cells: Vec<(String, Arc<TempDir>, Option<Relay>)>,
    /// Per cell: it has answered the director's first token with 401 (step 1) since it started.
    refused_once: Vec<bool>,
    store: Store,
    _jwks: FakeServer,
}

impl Fleet {
    fn shared_env(&self, tokens: &str) -> Vec<(String, String)> {
        [
            ("DATABASE_URL", self.database_url.as_str()),
            ("ORCA_RELAY_SERVICE_TOKEN", tokens),
            ("ORCA_RELAY_JWKS_URL", self.jwks_url.as_str()),
            ("ORCA_RELAY_AUTH_ISSUER", TEST_ISSUER),
            ("ORCA_RELAY_READINESS_PROBE_MS", "200"),
            ("ORCA_RELAY_HEARTBEAT_MS", "100"),
            ("ORCA_RELAY_HEARTBEAT_FRESH_MS", "3000"),
            ("ORCA_RELAY_FEED_POLL_MS", "100"),
            ("ORCA_RELAY_DRAIN_GRACE_MS", "100"),
        ]
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
    }

    fn start_director(&mut self, tokens: &str) {
        let mut env = self.shared_env(tokens);
        env.push(("ORCA_RELAY_ROLE".into(), "director".into()));
        env.push(("ORCA_RELAY_HTTP_ADDR".into(), self.director_addr.clone()));
        let director =
            Relay::start_in(Arc::new(TempDir::new("rotation-director")), &env_refs(&env));
        assert!(
            director
                .wait_for_log("orca_relay_migrations_applied", DEADLINE)
                .is_some(),
            "{}",
            director.log_text()
        );
        self.director = Some(director);
    }

    fn start_cell(&mut self, index: usize, tokens: &str) {
        let mut env = self.shared_env(tokens);
        let (cell_id, dir, _) = &self.cells[index];
        env.extend(
            [
                ("ORCA_RELAY_ROLE", "cell"),
                ("ORCA_RELAY_CELL_ID", cell_id.as_str()),
                (
                    "ORCA_RELAY_DIRECTOR_URLS",
                    &format!("http://{}", self.director_addr),
                ),
                ("ORCA_RELAY_SWITCH_POLL_MS", "50"),
                ("ORCA_RELAY_ADMIT_EFFECTIVE_REFRESH_MS", "200"),
            ]
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string())),
        );
        // Start-up includes the registration with the director, under the token sent now.
        let cell = Relay::start_in(dir.clone(), &env_refs(&env));
        self.cells[index].2 = Some(cell);
        self.refused_once[index] = false;
    }

    fn director(&self) -> &Relay {
        self.director.as_ref().expect("a running director")
    }

    fn cell(&self, index: usize) -> &Relay {
        self.cells[index].2.as_ref().expect("a running cell")
    }

    /// Checks that `relay` never refused or was refused a token, then stops it with SIGTERM
    /// (a rolling restart) and waits for it to exit 0.
    fn retire(relay: &mut Relay, what: &str, refusals_allowed: bool) {
        assert_no_token_failure(relay, what, refusals_allowed);
        relay.signal("TERM");
        assert_eq!(relay.wait_exit(DEADLINE), Some(0), "{what} exit");
    }

    fn restart_director(&mut self, tokens: &str) {
        let mut old = self.director.take().expect("a running director");
        Fleet::retire(&mut old, "the director", false);
        drop(old);
        self.start_director(tokens);
    }

    fn restart_cell(&mut self, index: usize, tokens: &str) {
        let mut old = self.cells[index].2.take().expect("a running cell");
        let what = format!("cell {}", self.cells[index].0);
        Fleet::retire(&mut old, &what, self.refused_once[index]);
        drop(old);
        self.start_cell(index, tokens);
    }

    /// Every call works now: each cell registered (in the store) and heartbeating ready,
    /// polled by the director (two more successful polls), and a fresh desktop is placed
    /// through a director→cell booking and admitted by that booking.
    fn check_every_call(&self, step: &str) {
        let director = self.director();
        let heartbeats = admin_requests(director, "heartbeat", 200);
        for (index, (cell_id, _, _)) in self.cells.iter().enumerate() {
            let cell = self.cell(index);
            wait_for(&format!("{step}: {cell_id} registered and ready"), || {
                self.store.list_cells().is_ok_and(|rows| {
                    rows.iter().any(|row| {
                        row.cell_id == *cell_id
                            && row.internal_url.is_some()
                            && row.runtime.as_ref().is_some_and(|runtime| runtime.ready)
                    })
                })
            });
            wait_for(&format!("{step}: {cell_id} effective reserve"), || {
                metric(cell, "orca_relay_admit_mode{kind=\"effective\"}") == 1.0
            });
            let polls = feed_polls(director, cell_id, "ok");
            wait_for(&format!("{step}: two more feed polls of {cell_id}"), || {
                feed_polls(director, cell_id, "ok") >= polls + 2.0
            });
        }
        wait_for(&format!("{step}: heartbeats accepted"), || {
            admin_requests(director, "heartbeat", 200) >= heartbeats + 2.0
        });

        // A booking: the director asks a reserve cell with its service token; the desktop's
        // hello is admitted from it.
        let booked = metric(
            director,
            "orca_relay_director_reserve_total{outcome=\"ok\"}",
        );
        let relay_host_id = host_id();
        let user_id = format!("rotation-{relay_host_id}");
        let token = es256_token(&user_id, &relay_host_id);
        let (status, body) = director.post(
            "/v1/assign",
            Some(&token),
            &json!({"v":1,"relayHostId":relay_host_id}).to_string(),
        );
        assert_eq!(status, 200, "{step}: assign: {body}");
        let answer: Value = serde_json::from_str(&body).unwrap();
        let cell_url = answer["cellUrl"].as_str().unwrap();
        let epoch = answer["assignmentEpoch"].as_i64().unwrap();
        assert_eq!(
            metric(
                director,
                "orca_relay_director_reserve_total{outcome=\"ok\"}"
            ),
            booked + 1.0,
            "{step}: one booking asked and granted"
        );
        let cell = (0..self.cells.len())
            .map(|index| self.cell(index))
            .find(|cell| format!("ws://{}", cell.ws) == cell_url)
            .unwrap_or_else(|| panic!("{step}: {cell_url} is none of the cells"));
        let admitted = metric(
            cell,
            "orca_relay_admissions_total{path=\"booking\",outcome=\"admitted\"}",
        );
        let (mut control, _) = hello(cell, &token, &relay_host_id, epoch)
            .unwrap_or_else(|code| panic!("{step}: the booked hello was refused: {code:?}"));
        assert_eq!(
            metric(
                cell,
                "orca_relay_admissions_total{path=\"booking\",outcome=\"admitted\"}"
            ),
            admitted + 1.0,
            "{step}: admitted from the booking"
        );
        let _ = control.close(None);

        assert_no_token_failure(director, &format!("{step}: the director"), false);
        for index in 0..self.cells.len() {
            assert_no_token_failure(
                self.cell(index),
                &format!("{step}: cell {index}"),
                self.refused_once[index],
            );
        }
    }
}

/// Refusals a cell still on the old token may answer when a director starts sending the new
/// one first: the first feed poll and perhaps a booking or a second poll in flight before the
/// director learnt which token the cell takes. Without that memory it would be one per poll.
const FALLBACK_REFUSALS_MAX: f64 = 3.0;

/// No call failed on its token. With `refusals_allowed` (a cell on the old token while the
/// director leads with the new one), the cell's 401s are allowed, but only a few.
fn assert_no_token_failure(relay: &Relay, what: &str, refusals_allowed: bool) {
    let log = relay.log_text();
    for needle in TOKEN_FAILURES {
        if refusals_allowed && ["unauthorized", "status=401"].contains(needle) {
            continue;
        }
        assert!(
            !log.contains(needle),
            "{what}: a call failed on its token ({needle}):\n{log}"
        );
    }
    let (_, metrics) = relay.get("/metrics");
    if refusals_allowed {
        let refusals = metric(relay, "orca_relay_cell_internal_unauthorized_total");
        assert!(
            refusals <= FALLBACK_REFUSALS_MAX,
            "{what}: {refusals} refused calls: the director does not remember the token a cell takes"
        );
    }
    for line in metrics.lines().filter(|line| !line.starts_with('#')) {
        let refused = ((!refusals_allowed
            && line.starts_with("orca_relay_cell_internal_unauthorized_total"))
            || line.contains("status=\"401\"")
            || line.contains("result=\"http_error\"")
            || line.contains("outcome=\"failed\""))
            && !line.ends_with(" 0");
        assert!(!refused, "{what}: {line}");
    }
}

#[test]
fn the_service_token_rotates_process_by_process_with_no_call_failing() {
    let jwks = jwks_server();
    let database_url = common::pg::fresh_database("token_rotation");
    let store = Store::open(&StoreConfig::new(
        Some(database_url.clone()),
        std::path::PathBuf::new(),
    ))
    .expect("open the test store");
    let mut fleet = Fleet {
        database_url,
        jwks_url: format!("{}/jwks.json", jwks.url()),
        director_addr: free_addr(),
        director: None,
        refused_once: vec![false; 2],
        cells: ["rot-a", "rot-b"]
            .iter()
            .map(|cell_id| {
                let dir = Arc::new(TempDir::new(cell_id));
                write_switch(
                    &dir.0.join("switch.json"),
                    cell_id,
                    1,
                    json!({"admitMode": "reserve"}),
                );
                (cell_id.to_string(), dir, None)
            })
            .collect(),
        store,
        _jwks: jwks,
    };

    // Step 0: everyone on A.
    fleet.start_director(A);
    fleet.start_cell(0, A);
    fleet.start_cell(1, A);
    for (cell_id, _, _) in &fleet.cells {
        let answer = ureq::put(&fleet.director().http_url("/v1/admin/cell-admit-mode"))
            .set("Authorization", &format!("Bearer {A}"))
            .timeout(Duration::from_secs(10))
            .send_string(&json!({"cellId": cell_id, "admitMode": "reserve"}).to_string());
        assert!(
            matches!(&answer, Ok(response) if response.status() == 200),
            "{answer:?}"
        );
    }
    fleet.check_every_call("step 0 (all on A)");

    // Step 1: the director accepts B and sends it first; the cells, still on A, refuse it once
    // each and are called with A from then on.
    fleet.restart_director(&format!("{B},{A}"));
    fleet.refused_once = vec![true; 2];
    fleet.check_every_call("step 1 (director B,A)");
    for (cell_id, _, _) in &fleet.cells {
        let log = fleet.director().log_text();
        assert!(
            log.lines()
                .any(|line| line.contains("orca_relay_service_token_fallback")
                    && line.contains("token_index=1")
                    && fleet
                        .store
                        .list_cells()
                        .is_ok_and(|rows| rows.iter().any(|row| {
                            row.cell_id == *cell_id
                                && row
                                    .internal_url
                                    .as_deref()
                                    .is_some_and(|url| line.contains(url))
                        }))),
            "the director says once that {cell_id} takes the second token:\n{log}"
        );
    }

    // Step 2: the cells send B, one after the other; each registers with B.
    fleet.restart_cell(0, &format!("{B},{A}"));
    fleet.check_every_call("step 2a (cell rot-a B,A)");
    fleet.restart_cell(1, &format!("{B},{A}"));
    fleet.check_every_call("step 2b (cells B,A)");

    // Step 3: the director sends B and drops A.
    fleet.restart_director(B);
    fleet.check_every_call("step 3 (director B)");

    // Step 4: the cells drop A.
    fleet.restart_cell(0, B);
    fleet.check_every_call("step 4a (cell rot-a B)");
    fleet.restart_cell(1, B);
    fleet.check_every_call("step 4b (cells B)");

    // The old token is refused everywhere now.
    let (status, _) = fleet.director().post(
        "/v1/admin/cell-heartbeat",
        Some(A),
        &json!({"v":1}).to_string(),
    );
    assert_eq!(status, 401, "the director refuses A");
    for index in 0..fleet.cells.len() {
        let (status, _) = fleet.cell(index).post(
            "/internal/reserve",
            Some(A),
            &json!({"v":1,"directorId":"x","items":[]}).to_string(),
        );
        assert_eq!(status, 401, "cell {index} refuses A");
    }
}
