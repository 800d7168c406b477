//! The registration loop against real local servers, with the production timings shrunk
//! (SPEC §8): a director that never answers, one that answers slowly but in time, one that
//! answers HTTP 500, a refused port, and two memberships whose second never answers.
//!
//! The clock is the real system clock, because ureq's timeouts run on real time. The whole
//! file takes about four seconds of wall time.

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use orca_relay::cell::handshake::{
    register_with_directors, Budget, HandshakeError, HandshakeReport, RegisterRequest,
    AGGREGATE_BUDGET_MS, REGISTER_PATH,
};
use orca_relay::clock;
use orca_relay::threads;

const SERVICE_TOKEN: &str = "test-service-token";

/// How far past the budget's exact figure a real run may end: sleep overshoot and scheduling
/// on a shared two-core machine.
const TOLERANCE_MS: u64 = 700;

fn request() -> RegisterRequest {
    RegisterRequest::new("cell-a", "ws://127.0.0.1:9", "test", 1_700_000_000_000)
}

/// Runs the loop with the system clock, recording every backoff it waits through.
fn run(
    memberships: &[String],
    budget: &Budget,
) -> (Result<HandshakeReport, HandshakeError>, Vec<u64>, u64) {
    let waits = Mutex::new(Vec::new());
    let record_and_sleep = |duration: Duration| {
        waits
            .lock()
            .expect("waits lock")
            .push(duration.as_millis() as u64);
        clock::sleep(duration);
    };
    let clock = clock::system();
    let started = clock.now_ms();
    let result = register_with_directors(
        memberships,
        &request(),
        &orca_relay::service_token::ServiceTokens::single(SERVICE_TOKEN),
        budget,
        clock.as_ref(),
        &record_and_sleep,
    );
    let wall_ms = clock.now_ms() - started;
    (result, waits.into_inner().expect("waits lock"), wall_ms)
}

/// A director that accepts connections and never answers. Counts accepted connections; each
/// attempt opens one, since ureq never pools a connection that gave no answer.
struct SilentServer {
    addr: SocketAddr,
    accepted: Arc<(Mutex<Vec<TcpStream>>, Condvar)>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl SilentServer {
    fn start() -> SilentServer {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind silent server");
        let addr = listener.local_addr().expect("silent server address");
        let accepted = Arc::new((Mutex::new(Vec::new()), Condvar::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let accepted = accepted.clone();
            let stop = stop.clone();
            threads::spawn("silent-director", move || {
                for stream in listener.incoming() {
                    if stop.load(Ordering::SeqCst) {
                        break;
                    }
                    if let Ok(stream) = stream {
                        // Held open, never answered, until the server is dropped.
                        accepted.0.lock().expect("accepted lock").push(stream);
                        accepted.1.notify_all();
                    }
                }
            })
            .expect("spawn silent server")
        };
        SilentServer {
            addr,
            accepted,
            stop,
            thread: Some(thread),
        }
    }

    fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Waits until `expected` connections were accepted (the kernel completes the TCP
    /// handshake before our thread accepts), then returns how many there were.
    fn accepted_after_waiting_for(&self, expected: usize) -> usize {
        let (lock, changed) = &*self.accepted;
        let guard = lock.lock().expect("accepted lock");
        let (guard, _) = changed
            .wait_timeout_while(guard, Duration::from_secs(5), |streams| {
                streams.len() < expected
            })
            .expect("accepted lock");
        guard.len()
    }
}

impl Drop for SilentServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        // Wake the blocking accept so the thread sees the flag.
        let _ = TcpStream::connect(self.addr);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// What a tiny_http director saw.
#[derive(Debug, Clone)]
struct Seen {
    method: String,
    path: String,
    authorization: Option<String>,
    body: String,
}

/// A director that answers every request with `status` and `body` after `delay`.
struct AnsweringServer {
    server: Arc<tiny_http::Server>,
    seen: Arc<Mutex<Vec<Seen>>>,
    thread: Option<JoinHandle<()>>,
}

impl AnsweringServer {
    fn start(status: u16, body: &'static str, delay: Duration) -> AnsweringServer {
        let server = Arc::new(tiny_http::Server::http("127.0.0.1:0").expect("bind director"));
        let seen = Arc::new(Mutex::new(Vec::new()));
        let thread = {
            let server = server.clone();
            let seen = seen.clone();
            threads::spawn("answering-director", move || {
                for mut request in server.incoming_requests() {
                    let mut request_body = String::new();
                    let _ = request.as_reader().read_to_string(&mut request_body);
                    let authorization = request
                        .headers()
                        .iter()
                        .find(|h| h.field.equiv("Authorization"))
                        .map(|h| h.value.to_string());
                    seen.lock().expect("seen lock").push(Seen {
                        method: request.method().to_string(),
                        path: request.url().to_string(),
                        authorization,
                        body: request_body,
                    });
                    // The director's slowness under test, not synchronisation.
                    clock::sleep(delay);
                    let response = tiny_http::Response::from_string(body).with_status_code(status);
                    let _ = request.respond(response);
                }
            })
            .expect("spawn director")
        };
        AnsweringServer {
            server,
            seen,
            thread: Some(thread),
        }
    }

    fn url(&self) -> String {
        format!(
            "http://{}",
            self.server.server_addr().to_ip().expect("ip listener")
        )
    }

    fn seen(&self) -> Vec<Seen> {
        self.seen.lock().expect("seen lock").clone()
    }
}

impl Drop for AnsweringServer {
    fn drop(&mut self) {
        self.server.unblock();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

#[test]
fn a_silent_director_gets_exactly_the_planned_attempts_then_an_unconfirmed_error() {
    let silent = SilentServer::start();
    let budget = Budget::new(300, 3, 1);
    // 300 + 250 + 300 + 500 + 300.
    assert_eq!(budget.plan_never_answering(), vec![300, 300, 300]);
    assert_eq!(budget.never_answering_elapsed_ms(), 1_650);

    let (result, waits, wall_ms) = run(&[silent.url()], &budget);

    let error = result.expect_err("a silent director cannot confirm the registration");
    match &error {
        HandshakeError::Exhausted {
            attempts,
            per_attempt_ms,
            elapsed_ms,
            aggregate_ms,
            last_silent_director,
        } => {
            assert_eq!(*attempts, 3);
            assert_eq!(*per_attempt_ms, 300);
            assert_eq!(*aggregate_ms, AGGREGATE_BUDGET_MS);
            assert_eq!(last_silent_director, &silent.url());
            assert!(
                (1_650..1_650 + TOLERANCE_MS).contains(elapsed_ms),
                "elapsed {elapsed_ms}ms"
            );
        }
        other => panic!("expected exhaustion, got {other:?}"),
    }
    assert_eq!(waits, vec![250, 500]);
    assert!(wall_ms < 1_650 + TOLERANCE_MS, "wall {wall_ms}ms");
    assert_eq!(silent.accepted_after_waiting_for(3), 3);

    let message = error.to_string();
    for expected in [
        "no response before the per-attempt deadline",
        "3 attempts",
        "per-attempt deadline up to 300ms",
        "40000ms aggregate limit",
        "may still have completed on the director",
    ] {
        assert!(
            message.contains(expected),
            "{expected:?} missing: {message}"
        );
    }
    assert!(!message.to_lowercase().contains("unreachable"), "{message}");
}

#[test]
fn a_slow_director_that_answers_before_the_deadline_succeeds_in_one_attempt() {
    let director = AnsweringServer::start(200, r#"{"ok":true}"#, Duration::from_millis(150));
    let budget = Budget::new(600, 3, 1);

    let (result, waits, _) = run(&[director.url()], &budget);

    let report = result.expect("a slow answer inside the deadline is a success");
    assert_eq!(report.attempts, 1);
    assert!(
        (150..600).contains(&report.elapsed_ms),
        "elapsed {}ms",
        report.elapsed_ms
    );
    assert!(waits.is_empty());
    let seen = director.seen();
    assert_eq!(seen.len(), 1);
    assert_eq!(seen[0].method, "POST");
    assert_eq!(seen[0].path, REGISTER_PATH);
    assert_eq!(
        seen[0].authorization.as_deref(),
        Some("Bearer test-service-token")
    );
    let body: serde_json::Value = serde_json::from_str(&seen[0].body).expect("JSON body");
    assert_eq!(
        body,
        serde_json::json!({
            "v": 1, "cellId": "cell-a", "cellUrl": "ws://127.0.0.1:9",
            "region": "test", "incarnation": 1_700_000_000_000i64,
        })
    );
}

#[test]
fn an_http_500_fails_at_once_after_one_attempt_with_the_status() {
    let director = AnsweringServer::start(500, "database on fire", Duration::ZERO);
    let budget = Budget::new(300, 3, 1);

    let (result, waits, wall_ms) = run(&[director.url()], &budget);

    let error = result.expect_err("HTTP 500 is a definite failure");
    assert_eq!(
        error,
        HandshakeError::HttpStatus {
            director: director.url(),
            status: 500,
            body: "database on fire".to_string(),
        }
    );
    assert_eq!(
        error.to_string(),
        format!(
            "director {} answered HTTP 500 to cell registration: database on fire",
            director.url()
        )
    );
    assert!(waits.is_empty(), "no retry after a definite answer");
    assert_eq!(director.seen().len(), 1);
    assert!(wall_ms < 300, "wall {wall_ms}ms");
}

#[test]
fn a_refused_port_fails_at_once_after_one_attempt_with_the_cause() {
    let free_port = {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        listener.local_addr().expect("address").port()
    };
    let url = format!("http://127.0.0.1:{free_port}");
    let budget = Budget::new(300, 3, 1);

    let (result, waits, wall_ms) = run(std::slice::from_ref(&url), &budget);

    let error = result.expect_err("nothing listens there");
    match &error {
        HandshakeError::Transport { director, cause } => {
            assert_eq!(director, &url);
            assert!(cause.contains("Connection refused"), "{cause}");
        }
        other => panic!("expected a transport failure, got {other:?}"),
    }
    assert!(error
        .to_string()
        .starts_with(&format!("director {url} failed cell registration: ")));
    assert!(waits.is_empty(), "no retry after a refused connection");
    assert!(wall_ms < 300, "wall {wall_ms}ms");
}

#[test]
fn a_silent_second_membership_gets_attempts_shortened_by_the_aggregate_cap() {
    let answering = AnsweringServer::start(200, "", Duration::ZERO);
    let silent = SilentServer::start();
    // 400 ms × 2 memberships = 800 ms per attempt, inside a shrunk 1.5 s aggregate cap:
    // 800, a 250 backoff, then only 450 left, so the second attempt is cut to 450.
    let budget = Budget::new(400, 3, 2).with_aggregate_ms(1_500);
    assert_eq!(budget.plan_never_answering(), vec![800, 450]);
    assert_eq!(budget.never_answering_elapsed_ms(), 1_500);

    let (result, waits, _) = run(&[answering.url(), silent.url()], &budget);

    match result {
        Err(HandshakeError::Exhausted {
            attempts,
            per_attempt_ms,
            elapsed_ms,
            aggregate_ms,
            last_silent_director,
        }) => {
            assert_eq!(attempts, 2);
            assert_eq!(per_attempt_ms, 800);
            assert_eq!(aggregate_ms, 1_500);
            assert_eq!(last_silent_director, silent.url());
            assert!(
                (1_500..1_500 + TOLERANCE_MS).contains(&elapsed_ms),
                "elapsed {elapsed_ms}ms"
            );
        }
        other => panic!("expected exhaustion, got {other:?}"),
    }
    assert_eq!(waits, vec![250], "the 500 ms backoff no longer fits");
    // Every attempt re-registers every membership, in order.
    assert_eq!(answering.seen().len(), 2);
    assert_eq!(silent.accepted_after_waiting_for(2), 2);
}
