//! Dead entries never starve live cells (SPEC §11 "Fleet membership"), on a real PostgreSQL
//! with a real `director` and two real reserve `cell`s with short dead-man windows, plus 200
//! registered cells whose internal URL accepts TCP and never answers (what autoscaling leaves
//! behind every day: each such poll holds a worker for its whole 2 s timeout).
//!
//! Over two minutes (the issue's figure; every other fleet test is seconds) no live cell holds
//! or trips, and every interval between two `reserver=1` polls the cells receive stays within
//! 2 × `FEED_POLL_MS` (the cells' `orca_relay_dead_man_contact_interval_ms`). Before the
//! poller had lanes, one shared queue of 4 workers polled a live cell about every
//! 200 / 4 × 2 s = 100 s, and both cells tripped within seconds.
//!
//! Needs `ORCA_RELAY_TEST_DATABASE_URL` (`eval "$(scripts/test-postgres.sh start)"`).

mod common;
mod harness;

use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use harness::*;
use orca_relay::store::{Store, StoreConfig};
use serde_json::json;

const DEADLINE: Duration = Duration::from_secs(30);
const DEAD_ENTRIES: usize = 200;
/// The production poll period: the bound under test is 2 × this.
const FEED_POLL_MS: u64 = 1_000;
/// The live cells' dead-man window: short, so any starvation trips or holds them.
const WINDOW_MS: &str = "5000";
const OBSERVE: Duration = Duration::from_secs(120);

fn wait_for(what: &str, condition: impl FnMut() -> bool) {
    assert!(
        wait_until(DEADLINE, condition),
        "timed out waiting for {what}"
    );
}

fn metric(relay: &Relay, series: &str) -> f64 {
    relay.metric(series).unwrap_or(0.0)
}

fn owned(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

/// A listener that accepts every connection and never answers (nor closes) it: the internal
/// URL of every dead entry. Each entry's URL has its own path, so they are 200 distinct URLs.
struct BlackHole {
    addr: std::net::SocketAddr,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl BlackHole {
    fn start() -> BlackHole {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind the black hole");
        let addr = listener.local_addr().unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let thread = orca_relay::threads::spawn("test-black-hole", move || {
            let held: Mutex<Vec<TcpStream>> = Mutex::default();
            for stream in listener.incoming() {
                if flag.load(Ordering::SeqCst) {
                    break;
                }
                if let Ok(stream) = stream {
                    let mut held = held.lock().unwrap();
                    // The poller gave up on the oldest long ago (2 s timeout).
                    if held.len() >= 2_000 {
                        held.drain(..1_000);
                    }
                    held.push(stream);
                }
            }
        })
        .expect("spawn the black hole");
        BlackHole {
            addr,
            stop,
            thread: Some(thread),
        }
    }
}

impl Drop for BlackHole {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        let _ = TcpStream::connect(self.addr);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// (intervals over 2 × FEED_POLL_MS, all intervals) so far, from the cell's histogram.
fn contact_intervals(cell: &Relay) -> (f64, f64) {
    let bound = 2 * FEED_POLL_MS;
    let within = metric(
        cell,
        &format!("orca_relay_dead_man_contact_interval_ms_bucket{{le=\"{bound}\"}}"),
    );
    let all = metric(
        cell,
        "orca_relay_dead_man_contact_interval_ms_bucket{le=\"+Inf\"}",
    );
    (all - within, all)
}

/// Feed polls of the dead entries so far (every result), from the director's counters.
fn dead_polls(director: &Relay) -> f64 {
    let (_, text) = director.get("/metrics");
    text.lines()
        .filter(|line| line.starts_with("orca_relay_director_feed_polls_total{cell_id=\"dead-"))
        .filter_map(|line| line.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

#[test]
fn two_hundred_dead_entries_never_delay_a_live_cells_contact_for_two_minutes() {
    let jwks = jwks_server();
    let hole = BlackHole::start();
    let database_url = common::pg::fresh_database("dead_entries");
    let jwks_url = format!("{}/jwks.json", jwks.url());
    let feed_poll = FEED_POLL_MS.to_string();
    let shared = owned(&[
        ("DATABASE_URL", &database_url),
        ("ORCA_RELAY_SERVICE_TOKEN", SERVICE_TOKEN),
        ("ORCA_RELAY_JWKS_URL", &jwks_url),
        ("ORCA_RELAY_AUTH_ISSUER", TEST_ISSUER),
        ("ORCA_RELAY_READINESS_PROBE_MS", "500"),
        ("ORCA_RELAY_HEARTBEAT_MS", "1000"),
        ("ORCA_RELAY_FEED_POLL_MS", &feed_poll),
    ]);
    let mut env = shared.clone();
    env.push(("ORCA_RELAY_ROLE".into(), "director".into()));
    let director = Relay::start_in(Arc::new(TempDir::new("director")), &env_refs(&env));
    assert!(director
        .wait_for_log("orca_relay_migrations_applied", DEADLINE)
        .is_some());

    // The dead entries: registered (as a cell's start-up would have), never heard from again.
    let store = Store::open(&StoreConfig::new(Some(database_url), PathBuf::new())).unwrap();
    for n in 0..DEAD_ENTRIES {
        store
            .register_cell(
                &format!("dead-{n:03}"),
                "ws://127.0.0.1:9",
                &format!("http://{}/dead-{n:03}", hole.addr),
                "gone",
                1,
            )
            .unwrap();
    }

    let director_url = director.http_url("");
    let cells: Vec<Relay> = ["live-1", "live-2"]
        .iter()
        .map(|cell_id| {
            let dir = Arc::new(TempDir::new(cell_id));
            write_switch(
                &dir.0.join("switch.json"),
                cell_id,
                1,
                json!({"admitMode": "reserve"}),
            );
            let mut env = shared.clone();
            env.extend(owned(&[
                ("ORCA_RELAY_ROLE", "cell"),
                ("ORCA_RELAY_CELL_ID", cell_id),
                ("ORCA_RELAY_DIRECTOR_URLS", &director_url),
                ("ORCA_RELAY_DEAD_MAN_BASE_MS", WINDOW_MS),
                ("ORCA_RELAY_DEAD_MAN_SPREAD_MS", "0"),
                ("ORCA_RELAY_SWITCH_POLL_MS", "100"),
            ]));
            let cell = Relay::start_in(dir, &env_refs(&env));
            let answer = ureq::put(&director.http_url("/v1/admin/cell-admit-mode"))
                .set("Authorization", &format!("Bearer {SERVICE_TOKEN}"))
                .send_string(&json!({"cellId": cell_id, "admitMode": "reserve"}).to_string());
            assert!(matches!(&answer, Ok(r) if r.status() == 200), "{answer:?}");
            cell
        })
        .collect();
    for cell in &cells {
        assert!(
            wait_until(DEADLINE, || {
                metric(cell, "orca_relay_dead_man_state{state=\"armed\"}") == 1.0
                    && contact_intervals(cell).1 >= 3.0
            }),
            "the cell was not armed and polled: {:?}\n{}\n--- director:\n{}",
            contact_intervals(cell),
            cell.log_text(),
            director
                .log_text()
                .lines()
                .filter(|l| !l.contains("dead-"))
                .collect::<Vec<_>>()
                .join("\n")
        );
    }
    wait_for("every dead entry on the suspect lane", || {
        metric(
            &director,
            "orca_relay_director_feed_cells{lane=\"suspect\"}",
        ) == DEAD_ENTRIES as f64
    });
    assert_eq!(
        metric(&director, "orca_relay_director_feed_cells{lane=\"live\"}"),
        2.0
    );

    let before: Vec<(f64, f64)> = cells.iter().map(contact_intervals).collect();
    let dead_before = dead_polls(&director);
    let started = orca_relay::clock::instant();
    while started.elapsed() < OBSERVE {
        for cell in &cells {
            assert_eq!(
                cell.count_log("orca_relay_cell_reserve_dead_man_tripped")
                    + cell.count_log("orca_relay_cell_reserve_dead_man_held"),
                0,
                "a live cell lost its director to dead entries after {:?}:\n{}",
                started.elapsed(),
                cell.log_text()
            );
        }
        // An observation window: the claim is that nothing happens in it.
        orca_relay::clock::sleep(Duration::from_secs(2));
    }

    for (cell, (late_before, all_before)) in cells.iter().zip(before) {
        let (late, all) = contact_intervals(cell);
        let (_, text) = cell.get("/metrics");
        let buckets: Vec<&str> = text
            .lines()
            .filter(|l| l.starts_with("orca_relay_dead_man_contact_interval_ms"))
            .collect();
        let director_lines: Vec<String> = director
            .log_text()
            .lines()
            .filter(|l| l.contains("live-"))
            .map(str::to_string)
            .collect();
        assert_eq!(
            late - late_before,
            0.0,
            "contact intervals over {} ms during the two minutes: {buckets:#?}\n{director_lines:#?}",
            2 * FEED_POLL_MS
        );
        // About one poll a second: the cell really was polled all along.
        assert!(
            all - all_before >= OBSERVE.as_secs() as f64 * 0.9,
            "{} polls in {OBSERVE:?}",
            all - all_before
        );
        assert_eq!(
            metric(cell, "orca_relay_dead_man_state{state=\"armed\"}"),
            1.0
        );
    }
    // The dead entries were polled too (and timed out), on their own lane.
    let dead = dead_polls(&director) - dead_before;
    assert!(dead >= 100.0, "only {dead} polls of dead entries");
}
