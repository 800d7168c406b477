//! The director role as a black box on a real PostgreSQL (SPEC §6.2, §5.4, §5.6): real
//! `orca-relay` director processes, fake cells that are local tiny_http servers implementing
//! `/internal/reserve` and `/internal/seats` and recording what they receive, and a local JWKS
//! server with the test EC key (`tests/fixtures/auth/`).
//!
//! Needs `ORCA_RELAY_TEST_DATABASE_URL` (`eval "$(scripts/test-postgres.sh start)"`); each test
//! creates its own database. Waiting is always on a condition with a deadline.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Barrier, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use jsonwebtoken::jwk::Jwk;
use jsonwebtoken::{Algorithm, EncodingKey, Header};
use orca_relay::clock;
use orca_relay::store::{Store, StoreConfig};
use orca_relay::threads;
use serde_json::{json, Value};

mod harness;
use harness::{wait_exit_drained, ProcessLog};

const SERVICE_TOKEN: &str = "director-test-service-token-0123456789";
const ISSUER: &str = "https://auth.director.test";
const EC_PRIVATE_PEM: &str = include_str!("fixtures/auth/ec-p256-private.pem");
const EC_KID: &str = "ec-1";
const DEADLINE: Duration = Duration::from_secs(20);

static NEXT: AtomicU64 = AtomicU64::new(0);

fn unique(prefix: &str) -> String {
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    format!("{prefix}{}{n}", std::process::id())
}

/// Waits for `condition`, polling every 20 ms; panics naming `what` after [`DEADLINE`].
fn wait_until(what: &str, mut condition: impl FnMut() -> bool) {
    let deadline = clock::instant() + DEADLINE;
    while !condition() {
        assert!(clock::instant() < deadline, "timed out waiting for {what}");
        clock::sleep(Duration::from_millis(20));
    }
}

// ---------------------------------------------------------------------------------------------
// PostgreSQL

fn admin_database_url() -> String {
    std::env::var("ORCA_RELAY_TEST_DATABASE_URL").unwrap_or_else(|_| {
        panic!(
            "ORCA_RELAY_TEST_DATABASE_URL is not set: run `eval \"$(scripts/test-postgres.sh start)\"` first"
        )
    })
}

/// The URL of a database named `name` on the test server (which need not exist yet).
fn database_url(name: &str) -> String {
    let admin = admin_database_url();
    let (server, _) = admin.rsplit_once('/').expect("database URL has a path");
    format!("{server}/{name}")
}

fn create_database(name: &str) {
    let mut client = postgres::Client::connect(&admin_database_url(), postgres::NoTls)
        .expect("connect to the test PostgreSQL");
    client
        .batch_execute(&format!("CREATE DATABASE {name}"))
        .expect("create database");
}

/// A new empty database; returns its URL.
fn fresh_database(prefix: &str) -> String {
    let name = unique(&format!("{prefix}_"));
    create_database(&name);
    database_url(&name)
}

fn open_store(url: &str) -> Store {
    Store::open(&StoreConfig::new(Some(url.to_string()), PathBuf::new())).expect("open store")
}

// ---------------------------------------------------------------------------------------------
// JWKS and tokens

fn ec_key() -> EncodingKey {
    EncodingKey::from_ec_pem(EC_PRIVATE_PEM.as_bytes()).expect("EC fixture")
}

/// Serves the JWKS of the test EC key on 127.0.0.1 until dropped.
struct JwksServer {
    url: String,
    _server: TestServer,
}

impl JwksServer {
    fn start() -> JwksServer {
        let mut jwk =
            serde_json::to_value(Jwk::from_encoding_key(&ec_key(), Algorithm::ES256).expect("jwk"))
                .expect("json");
        let object = jwk.as_object_mut().expect("jwk object");
        object.remove("alg");
        object.insert("kid".into(), json!(EC_KID));
        let body = json!({ "keys": [jwk] }).to_string();
        let server = TestServer::start(1, move |request| {
            let response =
                tiny_http::Response::from_string(body.clone()).with_header(json_header());
            let _ = request.respond(response);
        });
        JwksServer {
            url: format!("http://{}/jwks.json", server.addr),
            _server: server,
        }
    }
}

/// An ES256 desktop-control token for (`user_id`, `relay_host_id`).
fn token(user_id: &str, relay_host_id: &str) -> String {
    let claims = json!({
        "sub": user_id,
        "relayHostId": relay_host_id,
        "purpose": "host-control",
        "aud": "orca-relay",
        "iss": ISSUER,
        "exp": clock::system().now_ms() / 1000 + 600,
    });
    let mut header = Header::new(Algorithm::ES256);
    header.kid = Some(EC_KID.to_string());
    jsonwebtoken::encode(&header, &claims, &ec_key()).expect("sign")
}

/// A fresh 16-character relay host id and its user.
fn new_host() -> (String, String) {
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let host = format!("h{:015}", u64::from(std::process::id()) * 100_000 + n);
    (format!("user-{host}"), host)
}

// ---------------------------------------------------------------------------------------------
// A small tiny_http server on threads

fn json_header() -> tiny_http::Header {
    tiny_http::Header::from_bytes("Content-Type", "application/json").expect("header")
}

struct TestServer {
    addr: std::net::SocketAddr,
    stop: Arc<AtomicBool>,
    workers: Vec<JoinHandle<()>>,
}

impl TestServer {
    fn start(
        workers: usize,
        handle: impl Fn(tiny_http::Request) + Send + Sync + 'static,
    ) -> TestServer {
        let server = Arc::new(tiny_http::Server::http("127.0.0.1:0").expect("bind"));
        let addr = server.server_addr().to_ip().expect("ip listener");
        let stop = Arc::new(AtomicBool::new(false));
        let handle = Arc::new(handle);
        let workers = (0..workers)
            .map(|n| {
                let server = server.clone();
                let stop = stop.clone();
                let handle = handle.clone();
                threads::spawn(format!("test-http-{n}"), move || {
                    while !stop.load(Ordering::Acquire) {
                        if let Ok(Some(request)) = server.recv_timeout(Duration::from_millis(50)) {
                            handle(request);
                        }
                    }
                })
                .expect("spawn test server thread")
            })
            .collect();
        TestServer {
            addr,
            stop,
            workers,
        }
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        for worker in self.workers.drain(..) {
            let _ = worker.join();
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Fake cells

/// One request a fake cell received.
#[derive(Debug, Clone)]
struct Received {
    url: String,
    authorization: Option<String>,
    body: Value,
}

#[derive(Default)]
struct CellState {
    /// What `/internal/reserve` answers every item; `"ok"` by default.
    reserve_outcome: Mutex<String>,
    /// The seat feed's `admitModeRaw` and `admitModeEffective`.
    feed_mode: Mutex<String>,
    /// When set, `/internal/seats` answers 500.
    feed_broken: AtomicBool,
    feed_connections: AtomicU64,
    seq: AtomicU64,
    reserves: Mutex<Vec<Received>>,
    polls: Mutex<Vec<Received>>,
}

/// A cell's `/internal/*` API that answers as told and records every request.
struct FakeCell {
    id: String,
    incarnation: i64,
    internal_url: String,
    state: Arc<CellState>,
    _server: TestServer,
}

impl FakeCell {
    fn start(id: &str, feed_mode: &str) -> FakeCell {
        let state = Arc::new(CellState::default());
        *state.reserve_outcome.lock().unwrap() = "ok".into();
        *state.feed_mode.lock().unwrap() = feed_mode.into();
        let incarnation = 1_700_000_000_000;
        let handler_state = state.clone();
        let cell_id = id.to_string();
        let server = TestServer::start(4, move |mut request| {
            let state = &handler_state;
            let url = request.url().to_string();
            let authorization = request
                .headers()
                .iter()
                .find(|h| h.field.equiv("Authorization"))
                .map(|h| h.value.as_str().to_string());
            let mut text = String::new();
            let _ = request.as_reader().read_to_string(&mut text);
            let body: Value = serde_json::from_str(&text).unwrap_or(Value::Null);
            let received = Received {
                url: url.clone(),
                authorization,
                body,
            };
            let (status, answer) = if url.starts_with("/internal/reserve") {
                let outcome = state.reserve_outcome.lock().unwrap().clone();
                let items = received.body["items"].as_array().map_or(0, Vec::len);
                state.reserves.lock().unwrap().push(received);
                let results: Vec<Value> = (0..items).map(|_| json!({"outcome": outcome})).collect();
                (200, json!({"v": 1, "results": results}))
            } else if url.starts_with("/internal/seats") {
                state.polls.lock().unwrap().push(received);
                if state.feed_broken.load(Ordering::SeqCst) {
                    (500, json!({"error": "broken"}))
                } else {
                    let mode = state.feed_mode.lock().unwrap().clone();
                    let seq = state.seq.fetch_add(1, Ordering::SeqCst) + 1;
                    (
                        200,
                        json!({
                            "v": 1, "cellId": cell_id, "incarnation": incarnation, "seq": seq,
                            "admitModeRaw": mode, "admitModeEffective": mode, "draining": false,
                            "counts": {"seated": 0, "bookings": 0,
                                       "connections": state.feed_connections.load(Ordering::SeqCst)},
                            "changes": [],
                        }),
                    )
                }
            } else {
                (404, json!({"error": "not_found"}))
            };
            let response = tiny_http::Response::from_string(answer.to_string())
                .with_status_code(status)
                .with_header(json_header());
            let _ = request.respond(response);
        });
        FakeCell {
            id: id.to_string(),
            incarnation,
            internal_url: format!("http://{}", server.addr),
            state,
            _server: server,
        }
    }

    fn cell_url(&self) -> String {
        format!("wss://{}.cells.test", self.id)
    }

    fn answer_reserve_with(&self, outcome: &str) {
        *self.state.reserve_outcome.lock().unwrap() = outcome.into();
    }

    fn set_feed_connections(&self, connections: u64) {
        self.state
            .feed_connections
            .store(connections, Ordering::SeqCst);
    }

    fn polls(&self) -> Vec<Received> {
        self.state.polls.lock().unwrap().clone()
    }

    /// Every booked item: (relayHostId, epoch).
    fn booked(&self) -> Vec<(String, i64)> {
        self.state
            .reserves
            .lock()
            .unwrap()
            .iter()
            .flat_map(|received| {
                received.body["items"]
                    .as_array()
                    .cloned()
                    .unwrap_or_default()
                    .into_iter()
                    .map(|item| {
                        (
                            item["relayHostId"].as_str().unwrap_or("").to_string(),
                            item["epoch"].as_i64().unwrap_or(-1),
                        )
                    })
            })
            .collect()
    }

    /// Waits until the director has taken in the current feed answer: two more polls have
    /// arrived, and the director sends a cell's next poll only once the previous answer is on
    /// its board.
    fn wait_for_fresh_feed(&self) {
        let seen = self.polls().len();
        wait_until(&format!("two feed polls of {}", self.id), || {
            self.polls().len() >= seen + 2
        });
    }
}

// ---------------------------------------------------------------------------------------------
// Director processes

struct Director {
    child: Child,
    log: Arc<ProcessLog>,
    http: String,
    _data_dir: TempDir,
}

struct TempDir(PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// An HTTP answer: status, JSON body (Null if not JSON), `Retry-After`.
#[derive(Debug)]
struct Answer {
    status: u16,
    body: Value,
    retry_after: Option<String>,
}

fn answer_of(result: Result<ureq::Response, ureq::Error>) -> Answer {
    let response = match result {
        Ok(response) => response,
        Err(ureq::Error::Status(_, response)) => response,
        Err(e) => panic!("http request failed: {e}"),
    };
    let status = response.status();
    let retry_after = response.header("Retry-After").map(str::to_string);
    let text = response.into_string().unwrap_or_default();
    Answer {
        status,
        body: serde_json::from_str(&text).unwrap_or(Value::Null),
        retry_after,
    }
}

impl Director {
    fn start(database_url: &str, jwks: &JwksServer, env: &[(&str, &str)]) -> Director {
        let data_dir = TempDir(std::env::temp_dir().join(unique("orca-relay-director-")));
        std::fs::create_dir_all(&data_dir.0).expect("data dir");
        let mut command = Command::new(env!("CARGO_BIN_EXE_orca-relay"));
        command
            .env_clear()
            .env("PATH", std::env::var("PATH").unwrap_or_default())
            .env("RUST_LOG", "info")
            .env("ORCA_RELAY_ROLE", "director")
            .env("DATABASE_URL", database_url)
            .env("ORCA_RELAY_SERVICE_TOKEN", SERVICE_TOKEN)
            .env("ORCA_RELAY_JWKS_URL", &jwks.url)
            // The test JWKS server speaks plain HTTP on loopback.
            .env("ORCA_RELAY_JWKS_ALLOW_HTTP", "1")
            .env("ORCA_RELAY_AUTH_ISSUER", ISSUER)
            .env("ORCA_RELAY_HTTP_ADDR", "127.0.0.1:0")
            .env("ORCA_RELAY_DATA_DIR", &data_dir.0)
            .env("ORCA_RELAY_FEED_POLL_MS", "100")
            .env("ORCA_RELAY_READINESS_PROBE_MS", "200")
            .env("ORCA_RELAY_HEARTBEAT_FRESH_MS", "60000");
        for (name, value) in env {
            command.env(name, value);
        }
        command
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        let mut child = command.spawn().expect("start orca-relay");
        let stderr = child.stderr.take().expect("stderr");
        let log = ProcessLog::capture(stderr, "director");
        let mut director = Director {
            child,
            log,
            http: String::new(),
            _data_dir: data_dir,
        };
        let started = director
            .wait_for_log("orca_relay_started")
            .unwrap_or_else(|| panic!("director did not start:\n{}", director.log_text()));
        assert!(started.contains("role=director"), "{started}");
        director.http = started
            .split_whitespace()
            .find_map(|token| token.strip_prefix("http="))
            .expect("http= in the started line")
            .to_string();
        director
    }

    /// Starts a director and waits until `/ready` says 200 (migrations applied, JWKS and SQL
    /// probed).
    fn start_ready(database_url: &str, jwks: &JwksServer, env: &[(&str, &str)]) -> Director {
        let director = Director::start(database_url, jwks, env);
        wait_until("the director to be ready", || {
            director.get("/ready").status == 200
        });
        director
    }

    fn wait_for_log(&self, needle: &str) -> Option<String> {
        self.log.wait_for(needle, DEADLINE)
    }

    fn log_text(&self) -> String {
        self.log.text()
    }

    fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.http)
    }

    fn get(&self, path: &str) -> Answer {
        answer_of(
            ureq::get(&self.url(path))
                .timeout(Duration::from_secs(10))
                .call(),
        )
    }

    fn send(&self, method: &str, path: &str, bearer: Option<&str>, body: &str) -> Answer {
        let mut request = ureq::request(method, &self.url(path))
            .timeout(Duration::from_secs(10))
            .set("Content-Type", "application/json");
        if let Some(token) = bearer {
            request = request.set("Authorization", &format!("Bearer {token}"));
        }
        answer_of(request.send_string(body))
    }

    fn admin(&self, method: &str, path: &str, body: Value) -> Answer {
        self.send(method, path, Some(SERVICE_TOKEN), &body.to_string())
    }

    fn register(&self, cell: &FakeCell, incarnation: i64) -> Answer {
        self.admin(
            "POST",
            "/v1/admin/cells/register",
            json!({"v":1, "cellId": cell.id, "cellUrl": cell.cell_url(), "region": "test",
                   "incarnation": incarnation, "internalUrl": cell.internal_url}),
        )
    }

    fn heartbeat(&self, cell: &FakeCell, incarnation: i64, ready: bool) -> Answer {
        self.admin(
            "POST",
            "/v1/admin/cell-heartbeat",
            json!({"v":1, "cellId": cell.id, "cellUrl": cell.cell_url(), "region": "test",
                   "incarnation": incarnation, "startedAt": incarnation, "ready": ready,
                   "connections": 0}),
        )
    }

    fn set_admit_mode(&self, cell_id: &str, mode: &str) -> Answer {
        self.admin(
            "PUT",
            "/v1/admin/cell-admit-mode",
            json!({"cellId": cell_id, "admitMode": mode}),
        )
    }

    /// Registers and heartbeats `cell` (ready) at its incarnation, with `admit_mode`.
    fn enrol(&self, cell: &FakeCell, admit_mode: &str) {
        assert_eq!(self.register(cell, cell.incarnation).status, 200);
        assert_eq!(self.set_admit_mode(&cell.id, admit_mode).status, 200);
        assert_eq!(self.heartbeat(cell, cell.incarnation, true).status, 200);
    }

    fn assign(&self, user_id: &str, relay_host_id: &str) -> Answer {
        self.send(
            "POST",
            "/v1/assign",
            Some(&token(user_id, relay_host_id)),
            &json!({"v":1, "relayHostId": relay_host_id}).to_string(),
        )
    }

    fn signal(&self, signal: &str) {
        let status = Command::new("kill")
            .args([&format!("-{signal}"), &self.child.id().to_string()])
            .status()
            .expect("kill");
        assert!(status.success());
    }

    /// Waits for the process to exit and its log to be drained.
    fn wait_exit(&mut self) -> Option<i32> {
        wait_exit_drained(&mut self.child, &[&self.log], DEADLINE)
    }
}

impl Drop for Director {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The epoch and cell URL of a 200 assign answer.
fn placement(answer: &Answer) -> (String, i64) {
    assert_eq!(answer.status, 200, "assign: {answer:?}");
    assert_eq!(answer.body["v"], 1);
    (
        answer.body["cellUrl"]
            .as_str()
            .expect("cellUrl")
            .to_string(),
        answer.body["assignmentEpoch"]
            .as_i64()
            .expect("assignmentEpoch"),
    )
}

fn assert_unavailable(answer: &Answer, code: &str) {
    assert_eq!(answer.status, 503, "{answer:?}");
    assert_eq!(answer.body["error"], code, "{answer:?}");
    assert_eq!(answer.retry_after.as_deref(), Some("2"), "{answer:?}");
}

// ---------------------------------------------------------------------------------------------
// Tests

#[test]
fn registration_is_idempotent_and_older_incarnations_are_refused() {
    let jwks = JwksServer::start();
    let url = fresh_database("dir_register");
    let director = Director::start_ready(&url, &jwks, &[]);
    let store = open_store(&url);
    let cell = FakeCell::start("c-reg", "db");

    for _ in 0..2 {
        let answer = director.register(&cell, 100);
        assert_eq!(
            (answer.status, answer.body.clone()),
            (200, json!({"v":1,"ok":true}))
        );
    }
    let cells = store.list_cells().expect("list cells");
    assert_eq!(
        cells.len(),
        1,
        "one registration, however often it is repeated"
    );
    assert_eq!(cells[0].incarnation, 100);
    assert_eq!(
        cells[0].internal_url.as_deref(),
        Some(cell.internal_url.as_str())
    );

    // A restart: a new incarnation replaces the old one.
    assert_eq!(director.register(&cell, 200).status, 200);
    // The old process, late: refused, and the newer registration stays.
    let stale = director.register(&cell, 100);
    assert_eq!(stale.status, 409, "{stale:?}");
    assert_eq!(stale.body["error"], "stale_cell_incarnation");
    assert_eq!(store.list_cells().unwrap()[0].incarnation, 200);

    assert_eq!(director.heartbeat(&cell, 200, true).status, 200);
    let stale = director.heartbeat(&cell, 100, true);
    assert_eq!(stale.status, 409, "{stale:?}");
    assert_eq!(stale.body["error"], "stale_cell_incarnation");
    let runtime = store.list_cells().unwrap()[0].runtime.clone().unwrap();
    assert_eq!(runtime.cell_incarnation, 200);

    // A heartbeat from a cell this database never saw registers it.
    let stranger = FakeCell::start("c-stranger", "db");
    assert_eq!(director.heartbeat(&stranger, 5, true).status, 200);
    let cells = store.list_cells().unwrap();
    let row = cells
        .iter()
        .find(|c| c.cell_id == "c-stranger")
        .expect("registered by heartbeat");
    assert_eq!(row.incarnation, 5);
    assert_eq!(row.runtime.as_ref().map(|r| r.ready), Some(true));
}

#[test]
fn reserve_home_is_pinned_while_it_heartbeats_and_replaced_once_it_goes_quiet() {
    let jwks = JwksServer::start();
    let url = fresh_database("dir_pin");
    let director = Director::start_ready(&url, &jwks, &[("ORCA_RELAY_HEARTBEAT_FRESH_MS", "1000")]);
    let store = open_store(&url);
    let home = FakeCell::start("c-home", "reserve");
    let other = FakeCell::start("c-other", "db");
    director.enrol(&home, "reserve");
    director.enrol(&other, "db");
    home.wait_for_fresh_feed();

    let (user, host) = new_host();
    let first = placement(&director.assign(&user, &host));
    assert_eq!(first, (home.cell_url(), 1), "booking candidates go first");
    assert_eq!(home.booked(), vec![(host.clone(), 1)]);

    // Pinned while the home heartbeats: same epoch, nothing written, nothing booked.
    director.heartbeat(&home, home.incarnation, true);
    director.heartbeat(&other, other.incarnation, true);
    assert_eq!(placement(&director.assign(&user, &host)), first);
    assert_eq!(home.booked().len(), 1);
    assert_eq!(store.assignment(&user, &host).unwrap().unwrap().epoch, 1);

    // Heartbeating but not ready: unavailable, not moved.
    director.heartbeat(&home, home.incarnation, false);
    assert_unavailable(
        &director.assign(&user, &host),
        "relay_home_cell_unavailable",
    );
    assert_eq!(store.assignment(&user, &host).unwrap().unwrap().epoch, 1);

    // The home goes quiet: once its heartbeat is older than 1 s the host is placed again.
    let deadline = clock::instant() + DEADLINE;
    let moved = loop {
        assert!(
            clock::instant() < deadline,
            "the quiet home was never replaced"
        );
        director.heartbeat(&other, other.incarnation, true);
        let answer = director.assign(&user, &host);
        if answer.status == 200 {
            break placement(&answer);
        }
        assert_unavailable(&answer, "relay_home_cell_unavailable");
        clock::sleep(Duration::from_millis(50));
    };
    assert_eq!(moved, (other.cell_url(), 2));
    assert_eq!(home.booked().len(), 1, "the quiet home gets no booking");
    let row = store.assignment(&user, &host).unwrap().unwrap();
    assert_eq!((row.cell_id.as_str(), row.epoch), ("c-other", 2));
}

#[test]
fn a_booking_is_made_at_exactly_the_new_epoch_and_refusals_move_on_at_new_epochs() {
    let jwks = JwksServer::start();
    let url = fresh_database("dir_book");
    let director = Director::start_ready(&url, &jwks, &[]);
    let store = open_store(&url);
    let full = FakeCell::start("c-full", "reserve");
    let off = FakeCell::start("c-off", "reserve");
    let good = FakeCell::start("c-good", "reserve");
    full.answer_reserve_with("full");
    off.answer_reserve_with("off");
    // The good cell is the heaviest, so the two refusing cells are always tried first.
    full.set_feed_connections(0);
    off.set_feed_connections(10);
    good.set_feed_connections(20);
    for cell in [&full, &off, &good] {
        director.enrol(cell, "reserve");
    }
    for cell in [&full, &off, &good] {
        cell.wait_for_fresh_feed();
    }

    // An existing row at epoch 41 on a cell that is gone.
    let (user, host) = new_host();
    assert!(store
        .place_assignment_if_newer(&user, &host, "c-gone", 41, 1)
        .unwrap());
    let answer = placement(&director.assign(&user, &host));
    assert_eq!(answer, (good.cell_url(), 44));
    let refused: BTreeSet<i64> = full
        .booked()
        .into_iter()
        .chain(off.booked())
        .map(|(booked_host, epoch)| {
            assert_eq!(booked_host, host);
            epoch
        })
        .collect();
    assert_eq!(
        refused,
        BTreeSet::from([42, 43]),
        "each refusal cost its own epoch"
    );
    assert_eq!(good.booked(), vec![(host.clone(), 44)]);
    let row = store.assignment(&user, &host).unwrap().unwrap();
    assert_eq!((row.cell_id.as_str(), row.epoch), ("c-good", 44));

    // What a booking carries.
    let reserve = good.state.reserves.lock().unwrap()[0].clone();
    assert_eq!(
        reserve.authorization.as_deref(),
        Some(format!("Bearer {SERVICE_TOKEN}").as_str())
    );
    assert_eq!(reserve.body["v"], 1);
    assert!(reserve.body["directorId"]
        .as_str()
        .is_some_and(|id| !id.is_empty()));
    assert_eq!(
        reserve.body["items"],
        json!([{"userId": user, "relayHostId": host, "epoch": 44, "ttlMs": 30000}])
    );

    // Every cell refusing: exhausted, with Retry-After.
    good.answer_reserve_with("full");
    let (user, host) = new_host();
    assert_unavailable(&director.assign(&user, &host), "relay_capacity_exhausted");
}

#[test]
fn a_held_reserve_cell_gets_nothing_on_the_database_path_a_tripped_one_does() {
    let jwks = JwksServer::start();
    let url = fresh_database("dir_held");
    let director = Director::start_ready(&url, &jwks, &[]);
    let store = open_store(&url);
    let cell = FakeCell::start("c-held", "reserve");
    // No seat feed answer: the cell cannot be booked, only the database path is left.
    cell.state.feed_broken.store(true, Ordering::SeqCst);
    director.enrol(&cell, "reserve");

    // Held: its own row says reserve.
    store
        .write_admit_effective(&cell.id, cell.incarnation, "reserve")
        .unwrap();
    let (user, host) = new_host();
    assert_unavailable(&director.assign(&user, &host), "relay_capacity_exhausted");

    // A `db` row left by an earlier process says nothing about this one.
    store
        .write_admit_effective(&cell.id, cell.incarnation - 1, "db")
        .unwrap();
    assert_unavailable(&director.assign(&user, &host), "relay_capacity_exhausted");
    assert!(store.assignment(&user, &host).unwrap().is_none());

    // Tripped: its row says db for its current incarnation.
    store
        .write_admit_effective(&cell.id, cell.incarnation, "db")
        .unwrap();
    assert_eq!(
        placement(&director.assign(&user, &host)),
        (cell.cell_url(), 1)
    );
    assert!(cell.booked().is_empty(), "database path: no booking");
}

#[test]
fn two_directors_racing_never_place_twice_at_one_epoch_and_epochs_only_grow() {
    const ROUNDS: usize = 25;
    let jwks = JwksServer::start();
    let url = fresh_database("dir_race");
    let directors = [
        Arc::new(Director::start_ready(&url, &jwks, &[])),
        Arc::new(Director::start_ready(&url, &jwks, &[])),
    ];
    let store = open_store(&url);

    /// Runs `ROUNDS` rounds; in each, both directors assign `hosts(round)` at once (released
    /// by a barrier). Returns every answer: (round, director, host, cell URL, epoch).
    fn race(
        directors: &[Arc<Director>; 2],
        hosts: Arc<dyn Fn(usize) -> (String, String) + Send + Sync>,
    ) -> Vec<(usize, usize, String, String, i64)> {
        let barrier = Arc::new(Barrier::new(2));
        let racers: Vec<_> = directors
            .iter()
            .enumerate()
            .map(|(index, director)| {
                let director = director.clone();
                let barrier = barrier.clone();
                let hosts = hosts.clone();
                threads::spawn(format!("racer-{index}"), move || {
                    (0..ROUNDS)
                        .map(|round| {
                            let (user, host) = hosts(round);
                            barrier.wait();
                            let (cell_url, epoch) = placement(&director.assign(&user, &host));
                            (round, index, host, cell_url, epoch)
                        })
                        .collect::<Vec<_>>()
                })
                .expect("spawn racer")
            })
            .collect();
        racers
            .into_iter()
            .flat_map(|racer| racer.join().expect("racer"))
            .collect()
    }

    // Database path, one host: every answer is a placement of its own, so every epoch is
    // answered once, and each director sees its epochs grow.
    let a = FakeCell::start("c-a", "db");
    let b = FakeCell::start("c-b", "db");
    directors[0].enrol(&a, "db");
    directors[0].enrol(&b, "db");
    let (user, host) = new_host();
    let answers = {
        let (user, host) = (user.clone(), host.clone());
        race(&directors, Arc::new(move |_| (user.clone(), host.clone())))
    };
    assert_eq!(answers.len(), 2 * ROUNDS);
    let mut epochs = BTreeSet::new();
    for (round, index, _, _, epoch) in &answers {
        assert!(
            epochs.insert(*epoch),
            "epoch {epoch} answered twice (round {round}, director {index}): {answers:?}"
        );
    }
    for index in 0..2 {
        let mine: Vec<i64> = answers
            .iter()
            .filter(|answer| answer.1 == index)
            .map(|answer| answer.4)
            .collect();
        assert!(
            mine.windows(2).all(|pair| pair[0] < pair[1]),
            "director {index} answered a falling epoch: {mine:?}"
        );
    }
    let row = store.assignment(&user, &host).unwrap().unwrap();
    assert_eq!(
        Some(&row.epoch),
        epochs.last(),
        "the row holds the highest answer"
    );
    assert_eq!(*epochs.last().unwrap(), 2 * ROUNDS as i64);

    // Booking path, a new host per round: exactly one booking per host, both directors answer
    // that placement (one placed it, the other pins it), and no epoch is booked twice.
    let r1 = FakeCell::start("c-r1", "reserve");
    let r2 = FakeCell::start("c-r2", "reserve");
    directors[0].enrol(&r1, "reserve");
    directors[0].enrol(&r2, "reserve");
    for director in &directors {
        director.heartbeat(&a, a.incarnation, false);
        director.heartbeat(&b, b.incarnation, false);
    }
    r1.wait_for_fresh_feed();
    r2.wait_for_fresh_feed();
    let round_hosts: Arc<Vec<(String, String)>> =
        Arc::new((0..ROUNDS).map(|_| new_host()).collect());
    let answers = {
        let round_hosts = round_hosts.clone();
        race(
            &directors,
            Arc::new(move |round| round_hosts[round].clone()),
        )
    };
    let mut booked: Vec<(String, i64)> = r1.booked();
    booked.extend(r2.booked());
    let mut per_host: HashMap<String, Vec<i64>> = HashMap::new();
    for (booked_host, epoch) in &booked {
        per_host
            .entry(booked_host.clone())
            .or_default()
            .push(*epoch);
    }
    let mut answered: BTreeMap<String, BTreeSet<(String, i64)>> = BTreeMap::new();
    for (_, _, answer_host, cell_url, epoch) in &answers {
        answered
            .entry(answer_host.clone())
            .or_default()
            .insert((cell_url.clone(), *epoch));
    }
    for (user, host) in round_hosts.iter() {
        assert_eq!(
            per_host.get(host),
            Some(&vec![1]),
            "host {host}: one booking at epoch 1"
        );
        let row = store.assignment(user, host).unwrap().unwrap();
        let expected_url = if row.cell_id == "c-r1" {
            r1.cell_url()
        } else {
            r2.cell_url()
        };
        assert_eq!(
            answered.get(host),
            Some(&BTreeSet::from([(expected_url, row.epoch)])),
            "both directors answer the one placement of {host}"
        );
    }
}

#[test]
fn hostile_input_is_refused() {
    let jwks = JwksServer::start();
    let url = fresh_database("dir_hostile");
    let director = Director::start_ready(&url, &jwks, &[]);
    let body = json!({"cellId": "c1", "admitMode": "db"}).to_string();

    for bearer in [None, Some("wrong-token"), Some("")] {
        for (method, path) in [
            ("POST", "/v1/admin/cells/register"),
            ("POST", "/v1/admin/cell-heartbeat"),
            ("PUT", "/v1/admin/cell-admit-mode"),
        ] {
            let answer = director.send(method, path, bearer, &body);
            assert_eq!(answer.status, 401, "{method} {path} with {bearer:?}");
        }
    }

    let huge = format!(r#"{{"pad":"{}"}}"#, "x".repeat(17 * 1024));
    for (method, path) in [
        ("POST", "/v1/admin/cells/register"),
        ("POST", "/v1/admin/cell-heartbeat"),
        ("PUT", "/v1/admin/cell-admit-mode"),
    ] {
        let answer = director.send(method, path, Some(SERVICE_TOKEN), &huge);
        assert_eq!(answer.status, 413, "{method} {path}");
    }

    let bad = director.admin(
        "PUT",
        "/v1/admin/cell-admit-mode",
        json!({"cellId": "c1", "admitMode": "maybe"}),
    );
    assert_eq!(bad.status, 400);
    assert_eq!(bad.body["error"], "bad_request");
    assert!(bad.body["reason"]
        .as_str()
        .is_some_and(|r| r.contains("admitMode")));
    let bad = director.admin(
        "POST",
        "/v1/admin/cells/register",
        json!({"v":1, "cellId": "bad id", "cellUrl": "wss://x", "region": "r", "incarnation": 1}),
    );
    assert_eq!(bad.status, 400, "{bad:?}");
    let bad = director.send(
        "POST",
        "/v1/admin/cell-heartbeat",
        Some(SERVICE_TOKEN),
        "{not json",
    );
    assert_eq!(bad.status, 400);

    let (user, host) = new_host();
    let huge_assign = format!(
        r#"{{"v":1,"relayHostId":"{host}","pad":"{}"}}"#,
        "x".repeat(5 * 1024)
    );
    let answer = director.send(
        "POST",
        "/v1/assign",
        Some(&token(&user, &host)),
        &huge_assign,
    );
    assert_eq!(answer.status, 413, "{answer:?}");
    let (_, other_host) = new_host();
    let answer = director.send(
        "POST",
        "/v1/assign",
        Some(&token(&user, &host)),
        &json!({"v":1, "relayHostId": other_host}).to_string(),
    );
    assert_eq!(answer.status, 403, "relayHostId must equal the claim");
    let answer = director.send(
        "POST",
        "/v1/assign",
        None,
        &json!({"v":1, "relayHostId": host}).to_string(),
    );
    assert_eq!(answer.status, 401);
    let answer = director.send(
        "POST",
        "/v1/assign",
        Some("not-a-jwt"),
        &json!({"v":1, "relayHostId": host}).to_string(),
    );
    assert_eq!(answer.status, 401);
    assert_eq!(director.get("/health").status, 200);
}

#[test]
fn the_feed_poller_polls_with_reserver_and_the_service_token_and_follows_the_cursor() {
    let jwks = JwksServer::start();
    let url = fresh_database("dir_feed");
    let director = Director::start_ready(&url, &jwks, &[]);
    let cell = FakeCell::start("c-feed", "reserve");
    assert_eq!(director.register(&cell, cell.incarnation).status, 200);
    wait_until("three feed polls", || cell.polls().len() >= 3);

    let polls = cell.polls();
    for poll in &polls {
        assert_eq!(
            poll.authorization.as_deref(),
            Some(format!("Bearer {SERVICE_TOKEN}").as_str())
        );
        assert!(poll.url.contains("reserver=1"), "{}", poll.url);
    }
    assert!(
        !polls[0].url.contains("since="),
        "the first poll asks for a snapshot: {}",
        polls[0].url
    );
    assert!(
        polls[1]
            .url
            .contains(&format!("since={}:1", cell.incarnation)),
        "the next poll follows the first answer's cursor: {}",
        polls[1].url
    );
    let metrics = ureq::get(&director.url("/metrics"))
        .call()
        .expect("metrics")
        .into_string()
        .expect("metrics text");
    let ok_polls = metrics
        .lines()
        .find_map(|line| {
            line.strip_prefix(
                "orca_relay_director_feed_polls_total{cell_id=\"c-feed\",result=\"ok\"} ",
            )
        })
        .and_then(|value| value.parse::<u64>().ok());
    assert!(ok_polls.is_some_and(|n| n >= 2), "{metrics}");
}

#[test]
fn a_director_starts_without_its_database_and_becomes_ready_when_it_appears() {
    let jwks = JwksServer::start();
    let name = unique("dir_late_");
    let mut director = Director::start(&database_url(&name), &jwks, &[]);
    assert_eq!(director.get("/health").status, 200);
    let ready = director.get("/ready");
    assert_eq!(ready.status, 503, "{ready:?}");
    let (user, host) = new_host();
    assert_eq!(director.assign(&user, &host).status, 503);

    create_database(&name);
    wait_until("the director to become ready", || {
        director.get("/ready").status == 200
    });
    director
        .wait_for_log("orca_relay_migrations_applied")
        .expect("migrations applied once the database exists");

    director.signal("TERM");
    assert_eq!(director.wait_exit(), Some(0), "{}", director.log_text());
    assert!(director
        .log_text()
        .contains("orca_relay_shutdown_finished role=director"));
}
