//! The startup handshake from the outside (SPEC §8, seed `startup-handshake-budget.md`): the
//! real `cell` binary against fake directors on real sockets (one that never answers, one that
//! answers HTTP 500, one that answers slowly but in time, one that answers when the test lets
//! it), with `READY=1` read from a real unix datagram socket passed as `NOTIFY_SOCKET`; and the
//! systemd unit's `TimeoutStartSec` tied to the handshake's constants.

mod harness;

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use harness::*;
use orca_relay::cell::handshake::{
    AGGREGATE_BUDGET_MS, REGISTER_PATH, STARTUP_RESERVE_MS, TIMEOUT_START_SEC_MS,
};

const WAIT: Duration = Duration::from_secs(20);

/// How a fake director treats a registration (other requests get 200 at once).
#[derive(Clone)]
enum Behaviour {
    /// Reads the request and never answers; the connection stays open.
    Silent,
    /// Answers this status at once.
    Status(u16),
    /// Answers 200 after this long (the director's own latency, not a synchronisation).
    Slow(Duration),
    /// Answers 200 once the test opens the gate.
    Gated(Arc<Gate>),
}

#[derive(Default)]
struct Gate {
    open: Mutex<bool>,
    opened: Condvar,
}

impl Gate {
    fn open(&self) {
        *self.open.lock().unwrap() = true;
        self.opened.notify_all();
    }

    fn wait(&self) {
        let mut open = self.open.lock().unwrap();
        while !*open {
            open = self.opened.wait(open).unwrap();
        }
    }
}

/// A director on a real listener: each connection is served on its own thread, so a held
/// registration never blocks anything else.
struct FakeDirector {
    addr: SocketAddr,
    connections: Arc<AtomicUsize>,
    registrations: Arc<AtomicUsize>,
    answered: Arc<AtomicUsize>,
    stop: Arc<AtomicBool>,
    held: Arc<Mutex<Vec<TcpStream>>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl FakeDirector {
    fn start(behaviour: Behaviour) -> FakeDirector {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind fake director");
        let addr = listener.local_addr().unwrap();
        let connections = Arc::new(AtomicUsize::new(0));
        let registrations = Arc::new(AtomicUsize::new(0));
        let answered = Arc::new(AtomicUsize::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let held: Arc<Mutex<Vec<TcpStream>>> = Arc::default();
        let thread = {
            let (connections, registrations, answered, stop, held) = (
                connections.clone(),
                registrations.clone(),
                answered.clone(),
                stop.clone(),
                held.clone(),
            );
            orca_relay::threads::spawn("test-director", move || {
                for stream in listener.incoming() {
                    if stop.load(Ordering::SeqCst) {
                        break;
                    }
                    let Ok(mut stream) = stream else { continue };
                    connections.fetch_add(1, Ordering::SeqCst);
                    let (registrations, answered, held, behaviour) = (
                        registrations.clone(),
                        answered.clone(),
                        held.clone(),
                        behaviour.clone(),
                    );
                    let _ = orca_relay::threads::spawn("test-director-conn", move || {
                        let Some(path) = read_request_path(&mut stream) else {
                            return;
                        };
                        let status = if path == REGISTER_PATH {
                            registrations.fetch_add(1, Ordering::SeqCst);
                            match behaviour {
                                Behaviour::Silent => {
                                    held.lock().unwrap().push(stream);
                                    return;
                                }
                                Behaviour::Status(status) => status,
                                Behaviour::Slow(latency) => {
                                    orca_relay::clock::sleep(latency);
                                    200
                                }
                                Behaviour::Gated(gate) => {
                                    gate.wait();
                                    200
                                }
                            }
                        } else {
                            200
                        };
                        let body = if status == 200 {
                            r#"{"v":1,"ok":true}"#
                        } else {
                            r#"{"error":"internal"}"#
                        };
                        let answer = format!(
                            "HTTP/1.1 {status} X\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                            body.len()
                        );
                        let _ = std::io::Write::write_all(&mut stream, answer.as_bytes());
                        answered.fetch_add(1, Ordering::SeqCst);
                    });
                }
            })
            .expect("spawn fake director")
        };
        FakeDirector {
            addr,
            connections,
            registrations,
            answered,
            stop,
            held,
            thread: Some(thread),
        }
    }

    fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    fn registrations(&self) -> usize {
        self.registrations.load(Ordering::SeqCst)
    }

    fn connections(&self) -> usize {
        self.connections.load(Ordering::SeqCst)
    }
}

impl Drop for FakeDirector {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        let _ = TcpStream::connect(self.addr);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
        self.held.lock().unwrap().clear();
    }
}

fn env(
    cell_id: &str,
    jwks: &FakeServer,
    director: &FakeDirector,
    extra: &[(&str, &str)],
) -> Vec<(String, String)> {
    let mut env = vec![
        ("ORCA_RELAY_ROLE".to_string(), "cell".to_string()),
        ("ORCA_RELAY_CELL_ID".into(), cell_id.into()),
        ("ORCA_RELAY_SERVICE_TOKEN".into(), SERVICE_TOKEN.into()),
        (
            "ORCA_RELAY_JWKS_URL".into(),
            format!("{}/jwks.json", jwks.url()),
        ),
        ("ORCA_RELAY_AUTH_ISSUER".into(), TEST_ISSUER.into()),
        ("ORCA_RELAY_DIRECTOR_URLS".into(), director.url()),
        ("ORCA_RELAY_READINESS_PROBE_MS".into(), "100".into()),
    ];
    env.extend(extra.iter().map(|(k, v)| (k.to_string(), v.to_string())));
    env
}

fn launch(env: &[(String, String)]) -> Relay {
    Relay::launch(Arc::new(TempDir::new("handshake")), &env_refs(env))
}

/// `elapsed <n>ms` from the exhaustion message.
fn reported_elapsed_ms(text: &str) -> u64 {
    let after = text
        .split("elapsed ")
        .nth(1)
        .unwrap_or_else(|| panic!("no elapsed figure in:\n{text}"));
    after
        .split("ms")
        .next()
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("bad elapsed figure in:\n{text}"))
}

#[test]
fn a_silent_director_exhausts_three_attempts_and_the_cell_exits_with_an_unconfirmed_outcome() {
    let jwks = jwks_server();
    let director = FakeDirector::start(Behaviour::Silent);
    let env = env(
        "c-silent",
        &jwks,
        &director,
        &[
            ("ORCA_RELAY_HANDSHAKE_TIMEOUT_MS", "300"),
            ("ORCA_RELAY_HANDSHAKE_ATTEMPTS", "3"),
        ],
    );
    let started = orca_relay::clock::instant();
    let mut cell = launch(&env);
    let code = cell
        .wait_exit(WAIT)
        .unwrap_or_else(|| panic!("the cell did not give up; log:\n{}", cell.log_text()));
    let wall = started.elapsed();
    let log = cell.log_text();
    assert_ne!(code, 0, "{log}");

    // 300 + 250 + 300 + 500 + 300 ms: three attempts and two backoffs.
    let planned_ms = 3 * 300 + 250 + 500;
    let line = log
        .lines()
        .find(|l| l.starts_with("orca-relay: startup handshake failed"))
        .unwrap_or_else(|| panic!("no failure line on stderr:\n{log}"));
    for needle in [
        "no response before the per-attempt deadline",
        "3 attempts",
        "of the 40000ms aggregate limit",
        "may still have completed on the director",
    ] {
        assert!(line.contains(needle), "{needle:?} missing from: {line}");
    }
    let elapsed_ms = reported_elapsed_ms(line);
    assert!(
        (planned_ms..planned_ms + 1500).contains(&elapsed_ms),
        "elapsed {elapsed_ms} ms, planned {planned_ms} ms: {line}"
    );
    assert!(
        wall < Duration::from_millis(planned_ms + 8000),
        "the process took {wall:?} to exit"
    );
    assert!(
        !log.to_lowercase().contains("unreachable"),
        "a silent director is not unreachable:\n{log}"
    );
    assert_eq!(
        cell.count_log("orca_relay_handshake_attempt_timed_out"),
        2,
        "{log}"
    );
    assert_eq!(director.registrations(), 3, "{log}");
    assert_eq!(
        director.connections(),
        3,
        "only the three registrations may reach a director before the cell registered:\n{log}"
    );
}

#[test]
fn an_http_500_ends_the_start_at_once_after_one_attempt() {
    let jwks = jwks_server();
    let director = FakeDirector::start(Behaviour::Status(500));
    let env = env(
        "c-500",
        &jwks,
        &director,
        &[
            ("ORCA_RELAY_HANDSHAKE_TIMEOUT_MS", "5000"),
            ("ORCA_RELAY_HANDSHAKE_ATTEMPTS", "3"),
        ],
    );
    let started = orca_relay::clock::instant();
    let mut cell = launch(&env);
    let code = cell.wait_exit(WAIT).expect("the cell exits");
    let log = cell.log_text();
    assert_ne!(code, 0, "{log}");
    assert!(
        started.elapsed() < Duration::from_millis(5000),
        "an HTTP error must not wait for the attempt deadline:\n{log}"
    );
    let line = log
        .lines()
        .find(|l| l.starts_with("orca-relay: startup handshake failed"))
        .unwrap_or_else(|| panic!("no failure line on stderr:\n{log}"));
    assert!(line.contains("answered HTTP 500"), "{line}");
    assert!(line.contains(&director.url()), "{line}");
    assert_eq!(director.registrations(), 1, "never retried:\n{log}");
    assert_eq!(cell.count_log("orca_relay_handshake_attempt_timed_out"), 0);
}

#[test]
fn a_slow_director_that_answers_inside_the_deadline_lets_the_cell_start() {
    let jwks = jwks_server();
    let director = FakeDirector::start(Behaviour::Slow(Duration::from_millis(200)));
    let env = env(
        "c-slow",
        &jwks,
        &director,
        &[
            // The answer takes 200 ms; the deadline leaves room for a loaded CI machine.
            ("ORCA_RELAY_HANDSHAKE_TIMEOUT_MS", "2000"),
            ("ORCA_RELAY_HANDSHAKE_ATTEMPTS", "3"),
        ],
    );
    let cell = launch(&env).expect_listening("orca_relay_started");
    let line = cell
        .wait_for_log("orca_relay_handshake_succeeded", WAIT)
        .expect("success line");
    assert_eq!(field(&line, "attempts").as_deref(), Some("1"), "{line}");
    let elapsed: u64 = field(&line, "elapsed_ms").unwrap().parse().unwrap();
    assert!((200..2000).contains(&elapsed), "{line}");
    assert_eq!(director.registrations(), 1);
    assert!(wait_until(WAIT, || cell.get("/ready").0 == 200));
}

#[test]
fn until_registration_succeeds_only_health_answers_and_ready_1_waits_for_it() {
    let jwks = jwks_server();
    let gate = Arc::new(Gate::default());
    let director = FakeDirector::start(Behaviour::Gated(gate.clone()));
    let notify = NotifySocket::new();
    let env = env(
        "c-gated",
        &jwks,
        &director,
        &[
            ("ORCA_RELAY_HANDSHAKE_TIMEOUT_MS", "20000"),
            ("ORCA_RELAY_HANDSHAKE_ATTEMPTS", "1"),
            ("NOTIFY_SOCKET", &notify.env_value()),
        ],
    );
    let cell = launch(&env).expect_listening("orca_relay_listening");
    assert!(
        wait_until(WAIT, || director.registrations() == 1),
        "no registration arrived; log:\n{}",
        cell.log_text()
    );

    // The registration is outstanding: the listeners are bound but only /health says yes.
    assert_eq!(cell.get("/health"), (200, r#"{"ok":true}"#.to_string()));
    assert_eq!(
        cell.get("/ready"),
        (503, r#"{"error":"starting"}"#.to_string())
    );
    assert_eq!(cell.internal_get("/internal/seats").0, 503);
    let token = es256_token("u-gated", "h-gated-0000001");
    assert_eq!(
        try_upgrade(&cell.ws_url("/v1/host/control"), Some(&token)),
        Upgrade::Status(503)
    );
    assert_eq!(
        try_upgrade(&cell.ws_url("/v1/connect/h-gated-0000001"), None),
        Upgrade::Status(503)
    );
    // `/metrics` too (SPEC §8: everything but /health answers 503 until registration), and
    // so do paths nobody serves, other methods and the director's routes: a starting cell
    // says "starting" to whatever it is asked, never 404 (issue 30).
    let starting = (503, r#"{"error":"starting"}"#.to_string());
    assert_eq!(cell.get("/metrics"), starting);
    assert_eq!(cell.get("/no-such-path"), starting);
    assert_eq!(cell.get("/v1/admin/cells"), starting);
    assert_eq!(cell.post("/metrics", None, "{}"), starting);
    assert_eq!(cell.post("/health", None, "{}"), starting);
    assert_eq!(cell.post("/v1/assign", None, "{}"), starting);
    // Nothing but the descriptor store's bookkeeping (the listeners and the crash-store
    // region, kept from the start): no READY=1, no STATUS=.
    let early: Vec<String> = notify
        .drain()
        .into_iter()
        .filter(|message| !message.starts_with("FDSTORE=1\n"))
        .collect();
    assert!(
        early.is_empty(),
        "nothing may reach systemd before registration: {early:?}"
    );
    assert_eq!(cell.count_log("orca_relay_started"), 0);

    // The director answers: READY=1 follows, then the cell serves.
    gate.open();
    assert!(
        notify.wait_for("READY=1", 1, WAIT),
        "no READY=1 after registration; got {:?}; log:\n{}",
        notify.drain(),
        cell.log_text()
    );
    assert!(director.answered.load(Ordering::SeqCst) >= 1);
    let cell = cell.expect_listening("orca_relay_started");
    assert!(wait_until(WAIT, || cell.get("/ready")
        == (200, r#"{"ok":true}"#.to_string())));
    assert_eq!(notify.count("READY=1"), 1);
    assert_eq!(cell.metric("orca_relay_handshake_attempts"), Some(1.0));
    // Serving: a path nobody serves is a plain 404 again.
    assert_eq!(
        cell.get("/no-such-path"),
        (404, r#"{"error":"not_found"}"#.to_string())
    );
}

/// `TimeoutStartSec=` of a unit file, in milliseconds (`45`, `45s`, `1min 30s` are not all
/// supported: plain seconds with an optional `s`, which is what the units use).
fn timeout_start_ms(unit: &str) -> u64 {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(unit);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{unit}: {e}"));
    let values: Vec<&str> = text
        .lines()
        .filter_map(|line| line.trim().strip_prefix("TimeoutStartSec="))
        .collect();
    assert_eq!(values.len(), 1, "{unit} must set TimeoutStartSec once");
    let value = values[0].trim();
    let seconds: u64 = value
        .strip_suffix('s')
        .unwrap_or(value)
        .trim()
        .parse()
        .unwrap_or_else(|e| panic!("{unit}: TimeoutStartSec={value}: {e}"));
    seconds * 1000
}

#[test]
fn the_cell_unit_start_timeout_is_the_handshake_budget_plus_its_reserve() {
    let unit_ms = timeout_start_ms("systemd/orca-relay-cell.service");
    assert_eq!(
        unit_ms, TIMEOUT_START_SEC_MS,
        "systemd/orca-relay-cell.service and cell::handshake::TIMEOUT_START_SEC_MS disagree"
    );
    assert_eq!(
        AGGREGATE_BUDGET_MS + STARTUP_RESERVE_MS,
        unit_ms,
        "the aggregate cap plus the start-up reserve must be the unit's TimeoutStartSec"
    );
    assert_eq!(AGGREGATE_BUDGET_MS, 40_000, "SPEC §8: a 40 s aggregate cap");
}
