//! Readiness from the outside (SPEC §7, seed `readiness-last-known-good.md`): the real binary
//! against a real JWKS server that is stopped and restarted on the same port, and against the
//! real PostgreSQL server stopped and restarted, with the graces shrunk to seconds.
//!
//! The JWKS case runs the combined role on SQLite with a JWKS; it never touches PostgreSQL.
//! The SQL outage stops a PostgreSQL server of its own (`common::pg::Cluster`), never the
//! shared test server, so other test binaries may use that one at the same time.

mod common;
mod harness;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use harness::*;
use serde_json::{json, Value};

/// Both graces, shrunk from 15 and 3 minutes.
const GRACE_MS: u64 = 3000;
const WAIT: Duration = Duration::from_secs(20);

fn shrunk(extra: &[(&str, &str)]) -> Vec<(String, String)> {
    let mut env: Vec<(String, String)> = [
        ("ORCA_RELAY_READINESS_JWKS_GRACE_MS", "3000"),
        ("ORCA_RELAY_READINESS_SQL_GRACE_MS", "3000"),
        ("ORCA_RELAY_READINESS_PROBE_MS", "100"),
        ("ORCA_RELAY_PING_MS", "200"),
    ]
    .iter()
    .map(|(k, v)| (k.to_string(), v.to_string()))
    .collect();
    env.extend(extra.iter().map(|(k, v)| (k.to_string(), v.to_string())));
    env
}

fn ready(relay: &Relay) -> (u16, Value) {
    let (status, body) = relay.get("/ready");
    let value = serde_json::from_str(&body).unwrap_or_else(|e| panic!("/ready {body:?}: {e}"));
    (status, value)
}

/// Waits until `/ready` answers `status` with exactly `body`.
fn wait_ready(relay: &Relay, status: u16, body: &Value) {
    let mut last = (0, Value::Null);
    let reached = wait_until(WAIT, || {
        last = ready(relay);
        last.0 == status && &last.1 == body
    });
    assert!(
        reached,
        "/ready never answered {status} {body}; last {} {}; log:\n{}",
        last.0,
        last.1,
        relay.log_text()
    );
}

fn healthy() -> Value {
    json!({"ok": true})
}

fn degraded(dependency: &str, failure: &str) -> Value {
    json!({"ok": true, "degraded": true, "dependency": [dependency], "failure": {dependency: failure}})
}

fn unavailable(dependency: &str, failure: &str) -> Value {
    json!({"error": "dependency_unavailable", "failures": {dependency: failure}})
}

fn wait_log(relay: &Relay, needle: &str) -> String {
    relay
        .wait_for_log(needle, WAIT)
        .unwrap_or_else(|| panic!("no log line {needle:?}; log:\n{}", relay.log_text()))
}

/// Polls `/health` every 50 ms on its own thread and remembers any answer that was not 200.
struct HealthWatch {
    stop: Arc<AtomicBool>,
    polls: Arc<AtomicU64>,
    failures: Arc<Mutex<Vec<String>>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl HealthWatch {
    fn start(http: &str) -> HealthWatch {
        let url = format!("http://{http}/health");
        let stop = Arc::new(AtomicBool::new(false));
        let polls = Arc::new(AtomicU64::new(0));
        let failures: Arc<Mutex<Vec<String>>> = Arc::default();
        let thread = {
            let (stop, polls, failures) = (stop.clone(), polls.clone(), failures.clone());
            orca_relay::threads::spawn("test-health-watch", move || {
                let agent = ureq::AgentBuilder::new()
                    .timeout(Duration::from_secs(5))
                    .build();
                while !stop.load(Ordering::SeqCst) {
                    match agent.get(&url).call() {
                        Ok(response) if response.status() == 200 => {
                            let body = response.into_string().unwrap_or_default();
                            if body != r#"{"ok":true}"# {
                                failures.lock().unwrap().push(format!("200 {body}"));
                            }
                        }
                        Ok(response) => failures
                            .lock()
                            .unwrap()
                            .push(format!("status {}", response.status())),
                        Err(e) => failures.lock().unwrap().push(e.to_string()),
                    }
                    polls.fetch_add(1, Ordering::SeqCst);
                    // A poll period, not a synchronisation: the watch samples /health.
                    orca_relay::clock::sleep(Duration::from_millis(50));
                }
            })
            .expect("spawn health watch")
        };
        HealthWatch {
            stop,
            polls,
            failures,
            thread: Some(thread),
        }
    }

    /// Stops the watch and asserts that every poll answered 200 `{"ok":true}`.
    fn finish(mut self, what: &str) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(thread) = self.thread.take() {
            thread.join().expect("health watch");
        }
        let polls = self.polls.load(Ordering::SeqCst);
        assert!(polls > 10, "{what}: /health was polled only {polls} times");
        let failures = self.failures.lock().unwrap();
        assert!(
            failures.is_empty(),
            "{what}: /health failed during the outage: {failures:?}"
        );
    }
}

#[test]
fn jwks_outage_is_ridden_out_from_the_cached_keys_then_expires_and_recovers() {
    let mut jwks = restartable_jwks_server();
    let jwks_url = format!("{}/jwks.json", jwks.url());
    let env = shrunk(&[
        ("ORCA_RELAY_ROLE", "combined"),
        ("ORCA_RELAY_JWKS_URL", &jwks_url),
        ("ORCA_RELAY_AUTH_ISSUER", TEST_ISSUER),
    ]);
    let relay = Relay::combined(&env_refs(&env));
    let health = HealthWatch::start(&relay.http);
    wait_ready(&relay, 200, &healthy());
    assert!(
        relay
            .wait_for_log(
                "orca_relay_readiness_prober_started period_ms=100 jwks=configured",
                WAIT
            )
            .is_some(),
        "the combined role must probe its JWKS"
    );

    // A desktop connected before the outage, verified with the JWKS key.
    let mut before = Desktop::connect_es256(&relay);
    expect_ping(&mut before.control);

    // Outage 1: the JWKS port refuses connections. Degraded first, from the cached keys.
    jwks.stop();
    let stopped_at = orca_relay::clock::instant();
    wait_log(
        &relay,
        "orca_relay_readiness_grace_entered dependency=jwks failure=jwks_unreachable",
    );
    let (status, body) = ready(&relay);
    let in_grace = stopped_at.elapsed() < Duration::from_millis(GRACE_MS - 300);
    if in_grace {
        assert_eq!(
            (status, body),
            (200, degraded("jwks", "jwks_unreachable")),
            "inside the grace /ready is degraded"
        );
    }

    // While the JWKS is down: the connected desktop keeps answering pings, and a new desktop
    // whose token is signed with the cached key is admitted (assign + upgrade 101 + ack).
    expect_ping(&mut before.control);
    let mut during = Desktop::connect_es256(&relay);
    expect_ping(&mut during.control);
    assert!(!jwks.is_running());

    // Past the grace: 503 with the reason, and one `expired` line.
    wait_ready(&relay, 503, &unavailable("jwks", "jwks_unreachable"));
    let expired_after = stopped_at.elapsed();
    assert!(
        expired_after >= Duration::from_millis(GRACE_MS - 300),
        "503 came {expired_after:?} after the stop, before the {GRACE_MS} ms grace"
    );
    wait_log(
        &relay,
        "orca_relay_readiness_grace_left dependency=jwks grace=expired",
    );
    // Not ready is not disconnected: both desktops are still served.
    expect_ping(&mut before.control);
    expect_ping(&mut during.control);

    // Back: ready again.
    jwks.restart();
    wait_ready(&relay, 200, &healthy());
    wait_log(&relay, "orca_relay_readiness_dependency_up dependency=jwks");

    // Outage 2, shorter than the grace: entered, then left as recovered.
    jwks.stop();
    let entered = "orca_relay_readiness_grace_entered dependency=jwks";
    assert!(
        wait_until(WAIT, || relay.count_log(entered) == 2),
        "second grace entry not logged; log:\n{}",
        relay.log_text()
    );
    jwks.restart();
    wait_log(
        &relay,
        "orca_relay_readiness_grace_left dependency=jwks grace=recovered",
    );
    wait_ready(&relay, 200, &healthy());
    expect_ping(&mut before.control);

    // Exactly one line per crossing, and nothing about SQL, which never failed.
    assert_eq!(relay.count_log(entered), 2, "{}", relay.log_text());
    assert_eq!(
        relay.count_log("orca_relay_readiness_grace_left dependency=jwks grace=expired"),
        1
    );
    assert_eq!(
        relay.count_log("orca_relay_readiness_grace_left dependency=jwks grace=recovered"),
        1
    );
    assert!(
        relay.wait_for_log_count(
            "orca_relay_readiness_dependency_up dependency=jwks",
            2,
            WAIT
        ),
        "cold boot and the return after the expired window:\n{}",
        relay.log_text()
    );
    assert_eq!(relay.count_log("dependency=sql"), 1, "only sql's first up");
    health.finish("jwks outage");
}

#[test]
fn sql_outage_degrades_then_expires_and_a_process_born_during_it_waits_without_crashing() {
    let server = common::pg::Cluster::primary();
    let running_db = server.create_database("readiness_sql");
    let cold_db = server.create_database("readiness_cold");

    let running = Relay::combined(&env_refs(&shrunk(&[("DATABASE_URL", &running_db)])));
    wait_ready(&running, 200, &healthy());
    let mut before = Desktop::connect(&running);
    let health = HealthWatch::start(&running.http);

    // The last success came at most one probe period before the stop began (pg_ctl's fast
    // stop itself takes a while), so the window ends no sooner than the grace after this.
    let stopped_at = orca_relay::clock::instant();
    server.stop();

    // Degraded inside the SQL grace.
    let entered = wait_log(
        &running,
        "orca_relay_readiness_grace_entered dependency=sql",
    );
    let failure = field(&entered, "failure").expect("failure= in the grace line");
    assert!(
        ["sql_failed", "sql_timed_out"].contains(&failure.as_str()),
        "{entered}"
    );
    if stopped_at.elapsed() < Duration::from_millis(GRACE_MS - 300) {
        assert_eq!(ready(&running), (200, degraded("sql", &failure)));
    }

    // A process started while the database is down still starts, serves /health and answers
    // /ready 503 instead of crash-looping.
    let cold_dir = Arc::new(TempDir::new("cold"));
    let mut cold = Relay::start_in(cold_dir, &env_refs(&shrunk(&[("DATABASE_URL", &cold_db)])));
    let cold_health = HealthWatch::start(&cold.http);
    wait_ready(&cold, 503, &unavailable("sql", "sql_failed"));

    // Past the grace: 503 with the reason, one `expired` line.
    wait_ready(&running, 503, &unavailable("sql", &failure));
    assert!(stopped_at.elapsed() >= Duration::from_millis(GRACE_MS - 300));
    wait_log(
        &running,
        "orca_relay_readiness_grace_left dependency=sql grace=expired",
    );
    assert_eq!(ready(&cold), (503, unavailable("sql", "sql_failed")));
    assert!(
        cold.wait_exit(Duration::ZERO).is_none(),
        "the process born during the outage exited; log:\n{}",
        cold.log_text()
    );

    // The database comes back: both become ready and serve desktops.
    server.start();
    wait_ready(&running, 200, &healthy());
    wait_log(
        &running,
        "orca_relay_readiness_dependency_up dependency=sql",
    );
    wait_ready(&cold, 200, &healthy());
    let mut after = Desktop::connect(&running);
    expect_ping(&mut after.control);
    // Readiness answers from the prober; the in-process director places on the cell once the
    // cell's ready heartbeat has reached the store, a moment later.
    let probe_host = host_id();
    let probe_token = token("placeable-probe", &probe_host);
    let body = serde_json::json!({"v":1,"relayHostId":probe_host}).to_string();
    assert!(
        wait_until(Duration::from_secs(10), || cold
            .post("/v1/assign", Some(&probe_token), &body)
            .0
            == 200),
        "the cell born during the outage never became placeable; log:\n{}",
        cold.log_text()
    );
    let mut first_on_cold = Desktop::connect(&cold);
    expect_ping(&mut first_on_cold.control);
    expect_ping(&mut before.control);

    assert_eq!(
        running.count_log("orca_relay_readiness_grace_entered dependency=sql"),
        1
    );
    assert_eq!(
        running.count_log("orca_relay_readiness_grace_left dependency=sql grace=expired"),
        1
    );
    assert_eq!(
        running.count_log("orca_relay_readiness_grace_left dependency=sql grace=recovered"),
        0
    );
    assert_eq!(
        running.count_log("dependency=jwks"),
        0,
        "no JWKS configured"
    );
    assert_eq!(
        cold.count_log("orca_relay_readiness_grace_entered"),
        0,
        "a process that never succeeded gets no grace"
    );
    health.finish("sql outage, running process");
    cold_health.finish("sql outage, process born during it");
}

/// The combined role's `/ready` says 200 only once its own director would place a desktop on
/// its cell (issue 20: a 503 `relay_capacity_exhausted` 85 ms after the first 200, the cell's
/// ready heartbeat not yet in the store). Each run starts a relay, asks `/ready` as fast as a
/// load balancer could, and places a desktop the moment it says 200.
#[test]
fn a_combined_relays_first_ready_200_is_followed_by_a_placement_not_a_503() {
    for run in 0..10 {
        let relay = Relay::launch(Arc::new(TempDir::new("first-ready")), &[])
            .expect_listening("orca_relay_listening");
        let started = orca_relay::clock::instant();
        while ready(&relay).0 != 200 {
            assert!(started.elapsed() < WAIT, "run {run}: never ready");
            orca_relay::clock::sleep(Duration::from_millis(1));
        }
        let host = host_id();
        let (status, body) = relay.post(
            "/v1/assign",
            Some(&token("first-ready", &host)),
            &json!({"v":1,"relayHostId":host}).to_string(),
        );
        assert_eq!(
            status,
            200,
            "run {run}: the first placement after /ready said 200: {body}\n{}",
            relay.log_text()
        );
    }
}

/// A tmpfs of `bytes` mounted at `path` (the tests run as root), unmounted when dropped.
struct SmallDisk {
    path: std::path::PathBuf,
}

impl SmallDisk {
    fn mount(path: &std::path::Path, bytes: u64) -> SmallDisk {
        std::fs::create_dir_all(path).unwrap();
        let status = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={bytes}")])
            .arg("tmpfs")
            .arg(path)
            .status()
            .expect("run mount");
        assert!(
            status.success(),
            "mount a {bytes}-byte tmpfs at {} (this test runs as root): {status}",
            path.display()
        );
        SmallDisk {
            path: path.to_path_buf(),
        }
    }

    /// Writes a file until the filesystem refuses (ENOSPC).
    fn fill(&self) -> std::path::PathBuf {
        use std::io::Write;
        let filler = self.path.join("filler");
        let mut file = std::fs::File::create(&filler).unwrap();
        let chunk = vec![0u8; 64 * 1024];
        loop {
            match file.write(&chunk) {
                Ok(0) | Err(_) => break,
                Ok(_) => {}
            }
        }
        let _ = file.sync_all();
        filler
    }
}

impl Drop for SmallDisk {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount")
            .arg("-l")
            .arg(&self.path)
            .status();
    }
}

/// SPEC §12: a SQLite database whose disk is full cannot take writes; the readiness probe says
/// so (`sql_disk_full`, `SQLITE_FULL` in the line), `/ready` turns degraded, then 503 past the
/// SQL grace, and ready again once there is room. Before, its probe was `SELECT 1`, which a
/// full disk answers, and `/ready` stayed 200 while every write failed.
#[test]
fn a_full_sqlite_disk_turns_ready_degraded_then_503_and_back() {
    const GRACE_MS: u64 = 2_000;
    let base = TempDir::new("full-disk");
    let disk = SmallDisk::mount(&base.0.join("disk"), 8 * 1024 * 1024);
    let grace = GRACE_MS.to_string();
    let relay = Relay::start_in(
        Arc::new(TempDir(disk.path.clone())),
        &[
            ("ORCA_RELAY_READINESS_PROBE_MS", "100"),
            ("ORCA_RELAY_READINESS_SQL_GRACE_MS", &grace),
        ],
    );
    wait_ready(&relay, 200, &healthy());

    let filler = disk.fill();
    let filled = orca_relay::clock::instant();
    wait_ready(&relay, 200, &degraded("sql", "sql_disk_full"));
    wait_ready(&relay, 503, &unavailable("sql", "sql_disk_full"));
    assert!(
        filled.elapsed() >= Duration::from_millis(GRACE_MS - 300),
        "503 before the grace ran out"
    );
    let entered = wait_log(&relay, "orca_relay_readiness_grace_entered dependency=sql");
    assert!(
        entered.contains("failure=sql_disk_full sqlite=SQLITE_FULL"),
        "{entered}"
    );

    std::fs::remove_file(filler).unwrap();
    wait_ready(&relay, 200, &healthy());
}
