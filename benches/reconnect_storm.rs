//! Reconnect-storm benchmark (issue 3; SPEC §5.3, §5.5): 5,000 desktops drop and redial one
//! cell at their seated epoch, as fast as a bounded client pool can, against the real release
//! binary (`target/release/orca-relay`, role `cell`).
//!
//! Usage (the PostgreSQL test server must be started in the same shell):
//!
//!     eval "$(scripts/test-postgres.sh start)"
//!     cargo bench --bench reconnect_storm
//!     scripts/test-postgres.sh stop        # when done
//!
//! Optional: `RECONNECT_STORM_DESKTOPS` (default 5000), `RECONNECT_STORM_CLIENTS` (default 64),
//! `ORCA_RELAY_TEST_ECHO=1` to echo the relay's log.
//!
//! Two rows:
//! 1. **reserve cell on SQLite.** A switch file saying `reserve`, a fake director for the
//!    startup handshake, JWKS from the fixture EC key, and a poller that keeps the dead-man
//!    armed (`GET /internal/seats?reserver=1` with the service token every 500 ms). Each
//!    desktop is booked through `POST /internal/reserve` (batches of 64) and says hello; all
//!    are dropped; all redial at the same epoch. Expected: every redial admitted from memory
//!    (`orca_relay_admissions_total{path="memory"}`) with no SQL
//!    (`orca_relay_admission_sql_statements_total{path="memory"}` stays 0), under 5 s.
//! 2. **db cell on PostgreSQL.** A fresh database, the switch saying `db`, a placement row per
//!    desktop written first (`Store::place_assignment_if_newer`); each desktop says hello
//!    (database admission), all drop, all redial. Reported: admits per second, the peak of
//!    `orca_relay_db_pool{state="waiters"}` sampled every 5 ms during the storm (a lower
//!    bound), upgrades shed with 503, 4429 closes, and that the process is still alive.
//!
//! A refused redial (503 at upgrade, or a 4429 close) is retried like a desktop would: after
//! 2 s (`Retry-After`), at most 10 attempts. The first-attempt refusals are what the table
//! counts; the wall time includes the retries. The bench exits non-zero if a row's process
//! died or the reserve row ran SQL on the memory path.

#[path = "../tests/harness/mod.rs"]
mod harness;
#[path = "../tests/common/pg.rs"]
#[allow(dead_code)]
mod pg;

use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use harness::{
    accepting_director, cell_env, env_refs, es256_token, jwks_server, write_switch, Relay, TempDir,
    SERVICE_TOKEN,
};
use orca_relay::clock;
use orca_relay::store::{Store, StoreConfig};
use tungstenite::client::IntoClientRequest;
use tungstenite::handshake::HandshakeError;
use tungstenite::protocol::WebSocketConfig;
use tungstenite::{Message, WebSocket};

type Ws = WebSocket<TcpStream>;

const EPOCH: i64 = 7;
const MAX_ATTEMPTS: u32 = 10;
const RETRY_AFTER: Duration = Duration::from_secs(2);

struct Desktop {
    user_id: String,
    relay_host_id: String,
    token: String,
}

fn desktops(n: usize) -> Vec<Desktop> {
    (0..n)
        .map(|i| {
            let relay_host_id = format!("storm{i:011}");
            let user_id = format!("storm-user-{i}");
            let token = es256_token(&user_id, &relay_host_id);
            Desktop {
                user_id,
                relay_host_id,
                token,
            }
        })
        .collect()
}

/// One hello's result, as the desktop sees it.
enum Hello {
    Admitted(Box<Ws>),
    /// The upgrade was answered with this HTTP status (503 = shed).
    Refused(u16),
    /// The socket was closed with this code (None: dropped without a close frame).
    Closed(Option<u16>),
    Failed(String),
}

fn try_hello(addr: SocketAddr, desktop: &Desktop) -> Hello {
    let stream = match TcpStream::connect_timeout(&addr, Duration::from_secs(10)) {
        Ok(stream) => stream,
        Err(e) => return Hello::Failed(format!("connect: {e}")),
    };
    let _ = stream.set_nodelay(true);
    let _ = stream.set_read_timeout(Some(Duration::from_secs(20)));
    let _ = stream.set_write_timeout(Some(Duration::from_secs(20)));
    let mut request = format!("ws://{addr}/v1/host/control")
        .into_client_request()
        .expect("request");
    request.headers_mut().insert(
        "Authorization",
        format!("Bearer {}", desktop.token).parse().expect("header"),
    );
    // Small buffers: the bench holds thousands of idle sockets.
    let config = WebSocketConfig::default()
        .read_buffer_size(4096)
        .write_buffer_size(0);
    let mut ws = match tungstenite::client::client_with_config(request, stream, Some(config)) {
        Ok((ws, _)) => ws,
        Err(HandshakeError::Failure(tungstenite::Error::Http(response))) => {
            return Hello::Refused(response.status().as_u16())
        }
        Err(e) => return Hello::Failed(format!("upgrade: {e}")),
    };
    let hello = serde_json::json!({"type":"host-hello","v":1,
        "relayHostId":desktop.relay_host_id,"assignmentEpoch":EPOCH});
    if let Err(e) = ws.send(Message::text(hello.to_string())) {
        return Hello::Failed(format!("send hello: {e}"));
    }
    loop {
        match ws.read() {
            Ok(Message::Text(text)) => {
                let value: serde_json::Value = serde_json::from_str(&text).unwrap_or_default();
                if value["type"] == "host-hello-ack" {
                    return Hello::Admitted(Box::new(ws));
                }
            }
            Ok(Message::Close(frame)) => return Hello::Closed(frame.map(|f| u16::from(f.code))),
            Ok(_) => {}
            Err(_) => return Hello::Closed(None),
        }
    }
}

/// What a wave of hellos (seating or redial) saw.
#[derive(Default)]
struct Wave {
    elapsed: Duration,
    admitted: usize,
    /// First-attempt refusals by kind.
    shed_503: usize,
    other_status: usize,
    close_4429: usize,
    close_4409: usize,
    other_close: usize,
    failed: usize,
    retries: usize,
    /// Desktops never admitted after every attempt.
    gave_up: usize,
    sockets: Vec<Ws>,
    samples: Vec<String>,
}

impl Wave {
    fn first_attempt(&mut self, hello: &Hello) {
        match hello {
            Hello::Admitted(_) => {}
            Hello::Refused(503) => self.shed_503 += 1,
            Hello::Refused(_) => self.other_status += 1,
            Hello::Closed(Some(4429)) => self.close_4429 += 1,
            Hello::Closed(Some(4409)) => self.close_4409 += 1,
            Hello::Closed(_) => self.other_close += 1,
            Hello::Failed(_) => self.failed += 1,
        }
    }

    fn merge(&mut self, other: Wave) {
        self.admitted += other.admitted;
        self.shed_503 += other.shed_503;
        self.other_status += other.other_status;
        self.close_4429 += other.close_4429;
        self.close_4409 += other.close_4409;
        self.other_close += other.other_close;
        self.failed += other.failed;
        self.retries += other.retries;
        self.gave_up += other.gave_up;
        self.sockets.extend(other.sockets);
        if self.samples.len() < 5 {
            self.samples.extend(other.samples);
        }
    }
}

/// Says hello for one desktop, retrying refusals as a desktop would.
fn hello_with_retries(addr: SocketAddr, desktop: &Desktop, wave: &mut Wave) {
    for attempt in 1..=MAX_ATTEMPTS {
        let hello = try_hello(addr, desktop);
        if attempt == 1 {
            wave.first_attempt(&hello);
        }
        let retry = match hello {
            Hello::Admitted(ws) => {
                wave.admitted += 1;
                wave.sockets.push(*ws);
                return;
            }
            Hello::Refused(503) | Hello::Closed(Some(4429)) => true,
            Hello::Refused(status) => {
                wave.samples.push(format!("status {status}"));
                false
            }
            Hello::Closed(code) => {
                wave.samples.push(format!("close {code:?}"));
                false
            }
            Hello::Failed(e) => {
                wave.samples.push(e);
                true
            }
        };
        if !retry || attempt == MAX_ATTEMPTS {
            break;
        }
        wave.retries += 1;
        clock::sleep(RETRY_AFTER);
    }
    wave.gave_up += 1;
}

/// Books `batch` through the cell's internal API as a director would; all must be `ok`.
fn book(agent: &ureq::Agent, http: &str, batch: &[Desktop]) {
    let items: Vec<serde_json::Value> = batch
        .iter()
        .map(|d| {
            serde_json::json!({"userId":d.user_id,"relayHostId":d.relay_host_id,
                "epoch":EPOCH,"ttlMs":30000})
        })
        .collect();
    let body = serde_json::json!({"v":1,"directorId":"bench-director","items":items});
    let answer: serde_json::Value = agent
        .post(&format!("http://{http}/internal/reserve"))
        .set("Authorization", &format!("Bearer {SERVICE_TOKEN}"))
        .send_json(body)
        .expect("reserve")
        .into_json()
        .expect("reserve answer");
    let results = answer["results"].as_array().expect("results");
    assert!(
        results.iter().all(|r| r["outcome"] == "ok"),
        "bookings refused: {answer}"
    );
}

/// Runs `desktops` through `clients` threads; with `book_first` each thread books its batch
/// of 64 before saying hello for it.
fn wave(relay: &Relay, desktops: &Arc<Vec<Desktop>>, clients: usize, book_first: bool) -> Wave {
    let addr: SocketAddr = relay.ws.parse().expect("ws address");
    let http = relay.http.clone();
    let next = Arc::new(AtomicUsize::new(0));
    let batch = if book_first { 64 } else { 1 };
    let started = clock::instant();
    let threads: Vec<_> = (0..clients)
        .map(|i| {
            let desktops = desktops.clone();
            let next = next.clone();
            let http = http.clone();
            orca_relay::threads::spawn(format!("storm-client-{i}"), move || {
                let agent = ureq::AgentBuilder::new()
                    .timeout(Duration::from_secs(10))
                    .build();
                let mut wave = Wave::default();
                loop {
                    let from = next.fetch_add(batch, Ordering::Relaxed);
                    if from >= desktops.len() {
                        break;
                    }
                    let chunk = &desktops[from..(from + batch).min(desktops.len())];
                    if book_first {
                        book(&agent, &http, chunk);
                    }
                    for desktop in chunk {
                        hello_with_retries(addr, desktop, &mut wave);
                    }
                }
                wave
            })
            .expect("spawn client")
        })
        .collect();
    let mut total = Wave::default();
    for thread in threads {
        total.merge(thread.join().expect("client thread"));
    }
    total.elapsed = started.elapsed();
    total
}

/// Reads `/metrics` once: `series` → value.
fn metrics(relay: &Relay) -> Vec<(String, f64)> {
    let (_, body) = relay.get("/metrics");
    body.lines()
        .filter(|line| !line.starts_with('#'))
        .filter_map(|line| {
            let (series, value) = line.rsplit_once(' ')?;
            Some((series.to_string(), value.parse().ok()?))
        })
        .collect()
}

fn value(metrics: &[(String, f64)], series: &str) -> f64 {
    metrics
        .iter()
        .find(|(name, _)| name == series)
        .map(|(_, v)| *v)
        .unwrap_or(0.0)
}

/// Sums every series of `family` whose labels contain `label`.
fn sum_matching(metrics: &[(String, f64)], family: &str, label: &str) -> f64 {
    metrics
        .iter()
        .filter(|(name, _)| name.starts_with(&format!("{family}{{")) && name.contains(label))
        .map(|(_, v)| *v)
        .sum()
}

fn wait_for(what: &str, timeout: Duration, mut condition: impl FnMut() -> bool) {
    assert!(
        harness::wait_until(timeout, &mut condition),
        "timed out: {what}"
    );
}

fn wait_no_controls(relay: &Relay) {
    wait_for("every control to close", Duration::from_secs(120), || {
        value(&metrics(relay), "orca_relay_connections{kind=\"control\"}") == 0.0
    });
}

/// Keeps the dead-man armed: a `reserver=1` seat-feed poll every 500 ms, with a cursor so
/// each answer carries only the changes.
struct DirectorPoller {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl DirectorPoller {
    fn start(relay: &Relay) -> DirectorPoller {
        let stop = Arc::new(AtomicBool::new(false));
        let http = relay.http.clone();
        let flag = stop.clone();
        let thread = orca_relay::threads::spawn("bench-director-poller", move || {
            let agent = ureq::AgentBuilder::new()
                .timeout(Duration::from_secs(5))
                .build();
            let mut cursor: Option<String> = None;
            while !flag.load(Ordering::Acquire) {
                let mut url = format!("http://{http}/internal/seats?reserver=1");
                if let Some(cursor) = &cursor {
                    url.push_str(&format!("&since={cursor}"));
                }
                let answer = agent
                    .get(&url)
                    .set("Authorization", &format!("Bearer {SERVICE_TOKEN}"))
                    .call()
                    .ok()
                    .and_then(|response| response.into_json::<serde_json::Value>().ok());
                if let Some(answer) = answer {
                    if let (Some(incarnation), Some(seq)) =
                        (answer["incarnation"].as_i64(), answer["seq"].as_u64())
                    {
                        cursor = Some(format!("{incarnation}:{seq}"));
                    }
                }
                clock::sleep(Duration::from_millis(500));
            }
        })
        .expect("spawn poller");
        DirectorPoller {
            stop,
            thread: Some(thread),
        }
    }
}

impl Drop for DirectorPoller {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// Samples `orca_relay_db_pool{state="waiters"}` every 5 ms until dropped; keeps the peak.
/// Waiters come and go within milliseconds, so the peak is a lower bound; the shed count is
/// the direct evidence of pool pressure.
struct WaiterSampler {
    stop: Arc<AtomicBool>,
    peak: Arc<AtomicU64>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl WaiterSampler {
    fn start(relay: &Relay) -> WaiterSampler {
        let stop = Arc::new(AtomicBool::new(false));
        let peak = Arc::new(AtomicU64::new(0));
        let url = relay.http_url("/metrics");
        let (flag, max) = (stop.clone(), peak.clone());
        let thread = orca_relay::threads::spawn("bench-waiter-sampler", move || {
            let agent = ureq::AgentBuilder::new()
                .timeout(Duration::from_secs(5))
                .build();
            while !flag.load(Ordering::Acquire) {
                if let Some(body) = agent
                    .get(&url)
                    .call()
                    .ok()
                    .and_then(|r| r.into_string().ok())
                {
                    let waiters = body
                        .lines()
                        .find_map(|l| l.strip_prefix("orca_relay_db_pool{state=\"waiters\"} "))
                        .and_then(|v| v.trim().parse::<f64>().ok())
                        .unwrap_or(0.0);
                    max.fetch_max(waiters as u64, Ordering::Relaxed);
                }
                clock::sleep(Duration::from_millis(5));
            }
        })
        .expect("spawn sampler");
        WaiterSampler {
            stop,
            peak,
            thread: Some(thread),
        }
    }

    fn finish(mut self) -> u64 {
        self.stop.store(true, Ordering::Release);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
        self.peak.load(Ordering::Relaxed)
    }
}

/// One row of the table.
struct Row {
    label: &'static str,
    seat: Wave,
    redial: Wave,
    memory_admits: f64,
    database_admits: f64,
    booking_admits: f64,
    memory_sql: f64,
    database_sql: f64,
    peak_waiters: u64,
    shed_metric: f64,
    closes_4429_metric: f64,
    alive: bool,
    load: String,
}

fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|text| {
            text.split_whitespace()
                .take(3)
                .collect::<Vec<_>>()
                .join(" ")
        })
        .unwrap_or_else(|_| "?".to_string())
}

/// Drops every seated desktop, waits for the cell to see them gone, then redials them all.
fn storm(
    relay: &Relay,
    desktops: &Arc<Vec<Desktop>>,
    clients: usize,
    seat: Wave,
    label: &'static str,
) -> Row {
    println!(
        "reconnect_storm: {label}: seated {} in {:.2} s; dropping all",
        seat.admitted,
        seat.elapsed.as_secs_f64()
    );
    if seat.admitted < desktops.len() {
        println!(
            "reconnect_storm: {label}: seating: {} shed, {} closed 4429, {} gave up; samples {:?}",
            seat.shed_503, seat.close_4429, seat.gave_up, seat.samples
        );
    }
    let mut seat = seat;
    drop(std::mem::take(&mut seat.sockets));
    wait_no_controls(relay);

    let before = metrics(relay);
    let load = load_average();
    let sampler = WaiterSampler::start(relay);
    let redial = wave(relay, desktops, clients, false);
    let peak_waiters = sampler.finish();
    let after = metrics(relay);
    let delta = |series: &str| value(&after, series) - value(&before, series);
    let delta_sum = |family: &str, label: &str| {
        sum_matching(&after, family, label) - sum_matching(&before, family, label)
    };
    let alive = relay_alive(relay);
    println!(
        "reconnect_storm: {label}: redialed {} in {:.2} s (load {load})",
        redial.admitted,
        redial.elapsed.as_secs_f64()
    );
    Row {
        label,
        memory_admits: delta("orca_relay_admissions_total{path=\"memory\",outcome=\"admitted\"}"),
        database_admits: delta(
            "orca_relay_admissions_total{path=\"database\",outcome=\"admitted\"}",
        ),
        booking_admits: delta("orca_relay_admissions_total{path=\"booking\",outcome=\"admitted\"}"),
        memory_sql: value(
            &after,
            "orca_relay_admission_sql_statements_total{path=\"memory\"}",
        ),
        database_sql: delta("orca_relay_admission_sql_statements_total{path=\"database\"}"),
        peak_waiters,
        shed_metric: delta_sum("orca_relay_upgrades_refused_total", "status=\"503\""),
        closes_4429_metric: delta("orca_relay_closes_total{code=\"4429\"}"),
        alive,
        load,
        seat,
        redial,
    }
}

fn relay_alive(relay: &Relay) -> bool {
    let healthy = ureq::get(&relay.http_url("/health"))
        .timeout(Duration::from_secs(5))
        .call()
        .map(|r| r.status() == 200)
        .unwrap_or(false);
    healthy && relay.count_log("panicked") == 0
}

fn cell_environment(
    cell_id: &str,
    jwks: &harness::FakeServer,
    director: &harness::FakeServer,
    extra: &[(&str, String)],
    n: usize,
) -> Vec<(String, String)> {
    let mut env = cell_env(cell_id, jwks, &[director]);
    // Every seat and every booking holds a unit: room for all of them and then some.
    env.push((
        "ORCA_RELAY_CONNECTION_CAP".into(),
        (2 * n + 1_000).to_string(),
    ));
    env.push(("ORCA_RELAY_SWITCH_POLL_MS".into(), "100".into()));
    for (name, value) in extra {
        env.push((name.to_string(), value.clone()));
    }
    env
}

fn reserve_row(desktops: &Arc<Vec<Desktop>>, clients: usize) -> Row {
    const CELL: &str = "storm-reserve";
    let jwks = jwks_server();
    let director = accepting_director();
    let dir = Arc::new(TempDir::new("reconnect-storm-reserve"));
    write_switch(
        &dir.0.join("switch.json"),
        CELL,
        1,
        serde_json::json!({"admitMode":"reserve"}),
    );
    let env = cell_environment(CELL, &jwks, &director, &[], desktops.len());
    let relay = Relay::start_in(dir, &env_refs(&env));
    let _poller = DirectorPoller::start(&relay);
    wait_for("raw mode reserve", Duration::from_secs(30), || {
        value(&metrics(&relay), "orca_relay_admit_mode{kind=\"raw\"}") == 1.0
    });
    let seat = wave(&relay, desktops, clients, true);
    assert_eq!(
        seat.admitted,
        desktops.len(),
        "every booked desktop is seated ({:?})",
        seat.samples
    );
    let row = storm(&relay, desktops, clients, seat, "reserve cell, SQLite");
    assert_eq!(
        value(
            &metrics(&relay),
            "orca_relay_dead_man_state{state=\"armed\"}"
        ),
        1.0,
        "the dead-man stayed armed through the storm"
    );
    row
}

fn database_row(desktops: &Arc<Vec<Desktop>>, clients: usize) -> Row {
    const CELL: &str = "storm-db";
    let url = pg::fresh_database("reconnect_storm");
    let store = Store::open(&StoreConfig::new(
        Some(url.clone()),
        PathBuf::from("unused.db"),
    ))
    .expect("open store");
    store.migrate().expect("migrate");
    let placed = clock::instant();
    let now = clock::system().now_ms() as i64;
    for desktop in desktops.iter() {
        store
            .place_assignment_if_newer(&desktop.user_id, &desktop.relay_host_id, CELL, EPOCH, now)
            .expect("placement row");
    }
    println!(
        "reconnect_storm: placed {} desktops in {:.2} s",
        desktops.len(),
        placed.elapsed().as_secs_f64()
    );

    let jwks = jwks_server();
    let director = accepting_director();
    let dir = Arc::new(TempDir::new("reconnect-storm-db"));
    write_switch(
        &dir.0.join("switch.json"),
        CELL,
        1,
        serde_json::json!({"admitMode":"db"}),
    );
    let env = cell_environment(
        CELL,
        &jwks,
        &director,
        &[("DATABASE_URL", url)],
        desktops.len(),
    );
    let relay = Relay::start_in(dir, &env_refs(&env));
    let seat = wave(&relay, desktops, clients, false);
    storm(&relay, desktops, clients, seat, "db cell, PostgreSQL")
}

fn main() {
    let n: usize = std::env::var("RECONNECT_STORM_DESKTOPS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(5_000);
    let clients: usize = std::env::var("RECONNECT_STORM_CLIENTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(64);
    match orca_relay::lifecycle::raise_fd_limit() {
        Ok((old, new)) => println!("reconnect_storm: fd soft limit {old} -> {new}"),
        Err(e) => println!("reconnect_storm: fd limit unchanged: {e}"),
    }
    // Fail before the first row if PostgreSQL is not configured.
    let _ = pg::admin_url();
    let started = clock::instant();
    let minted = clock::instant();
    let desktops = Arc::new(desktops(n));
    println!(
        "reconnect_storm: minted {n} ES256 tokens in {:.2} s; load average {}",
        minted.elapsed().as_secs_f64(),
        load_average()
    );

    let rows = [
        reserve_row(&desktops, clients),
        database_row(&desktops, clients),
    ];

    println!();
    println!("reconnect storm: {n} desktops redial one cell at their seated epoch, {clients} client threads");
    println!(
        "| cell | seat s | redial s | admitted | admits/s | by path (memory/booking/db) | SQL memory path | SQL db path | peak pool waiters | shed 503 (client/metric) | 4429 (client/metric) | other refusals | retries | gave up | alive |"
    );
    println!("|---|---:|---:|---:|---:|---|---:|---:|---:|---|---|---:|---:|---:|:---:|");
    for row in &rows {
        let r = &row.redial;
        println!(
            "| {} | {:.2} | {:.2} | {}/{} | {:.0} | {}/{}/{} | {} | {} | {} | {}/{} | {}/{} | {} | {} | {} | {} |",
            row.label,
            row.seat.elapsed.as_secs_f64(),
            r.elapsed.as_secs_f64(),
            r.admitted,
            n,
            r.admitted as f64 / r.elapsed.as_secs_f64().max(1e-9),
            row.memory_admits,
            row.booking_admits,
            row.database_admits,
            row.memory_sql,
            row.database_sql,
            row.peak_waiters,
            r.shed_503,
            row.shed_metric,
            r.close_4429,
            row.closes_4429_metric,
            r.other_status + r.close_4409 + r.other_close + r.failed,
            r.retries,
            r.gave_up,
            if row.alive { "yes" } else { "NO" },
        );
    }
    for row in &rows {
        println!("{}: load average at storm start: {}", row.label, row.load);
        if !row.redial.samples.is_empty() {
            println!("{}: sample refusals: {:?}", row.label, row.redial.samples);
        }
    }
    println!(
        "reconnect_storm: total {:.1} s; load average now {}",
        started.elapsed().as_secs_f64(),
        load_average()
    );

    let reserve = &rows[0];
    let mut failures = Vec::new();
    if reserve.memory_sql != 0.0 {
        failures.push(format!(
            "memory path ran {} SQL statements",
            reserve.memory_sql
        ));
    }
    if reserve.memory_admits as usize != n {
        failures.push(format!(
            "{} of {n} redials admitted from memory",
            reserve.memory_admits
        ));
    }
    if reserve.redial.elapsed > Duration::from_secs(5) {
        println!(
            "note: the reserve redial took {:.2} s, over the 5 s target",
            reserve.redial.elapsed.as_secs_f64()
        );
    }
    for row in &rows {
        if !row.alive {
            failures.push(format!(
                "{}: the process died or a thread panicked",
                row.label
            ));
        }
    }
    if !failures.is_empty() {
        eprintln!("reconnect_storm FAILED: {failures:?}");
        std::process::exit(1);
    }
}
