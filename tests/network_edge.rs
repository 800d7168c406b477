//! The network edge against the real binary (SPEC §5.2, §5.4, §11 "Network edge"): keep-alive
//! requests are answered across idle gaps, a request head has one deadline for the whole head
//! (10 s on the HTTP port, 5 s for the WebSocket upgrade), idle keep-alive connections close at
//! `ORCA_RELAY_HTTP_IDLE_MS`, refused and unauthenticated sockets never keep a desktop out,
//! stalled clients never delay `/health`, a stop/continue of the process drops nothing, and an
//! idle process logs nothing at WARN or ERROR.
//!
//! The full 10,000-request keep-alive run with idle gaps up to 29 s is in
//! `cargo bench --bench http_edge`; the suite runs a shorter one whose gaps still cross the old
//! 10 s failure point.

mod harness;

use std::io::Write;
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use harness::raw_http::Conn;
use harness::*;
use orca_relay::clock;

const ANSWER_WITHIN: Duration = Duration::from_secs(2);

fn secs(s: f64) -> Duration {
    Duration::from_secs_f64(s)
}

/// Sends `requests` GETs on one connection, waiting `gap` before each, and returns how many
/// were answered 200 on that same connection (stops at the first that was not).
fn reused_connection(addr: &str, gaps: &[Duration], path: &str) -> Result<usize, String> {
    let mut conn = Conn::connect(addr);
    for (n, gap) in gaps.iter().enumerate() {
        clock::sleep(*gap);
        let started = clock::instant();
        match conn.round_trip(path, ANSWER_WITHIN) {
            Ok(response) if response.status == 200 => {}
            Ok(response) => return Err(format!("request {n}: status {}", response.status)),
            Err(e) => {
                return Err(format!(
                    "request {n} after a {gap:?} gap: {e:?} after {:?}",
                    started.elapsed()
                ))
            }
        }
    }
    Ok(gaps.len())
}

#[test]
fn keep_alive_requests_across_idle_gaps_are_all_answered() {
    let relay = Relay::combined(&[]);
    let addr = relay.http.clone();
    // One connection a second for 24 s (the reproduction lost 2 of 30), one with idle
    // gaps past the old 10 s failure point, one mixing back-to-back requests with long gaps.
    let plans: Vec<(Vec<Duration>, &str)> = vec![
        (
            std::iter::once(Duration::ZERO)
                .chain(std::iter::repeat_n(secs(1.0), 23))
                .collect(),
            "/health",
        ),
        (vec![Duration::ZERO, secs(11.0), secs(12.5)], "/ready"),
        (
            vec![
                Duration::ZERO,
                Duration::ZERO,
                secs(5.0),
                Duration::ZERO,
                secs(15.0),
                Duration::ZERO,
                secs(0.3),
            ],
            "/health",
        ),
    ];
    let clients: Vec<_> = plans
        .into_iter()
        .enumerate()
        .map(|(n, (gaps, path))| {
            let addr = addr.clone();
            orca_relay::threads::spawn(format!("test-keepalive-{n}"), move || {
                reused_connection(&addr, &gaps, path)
            })
            .unwrap()
        })
        .collect();
    // Pipelined: five requests in one write, five answers in order.
    let mut conn = Conn::connect(&addr);
    conn.send(
        b"GET /health HTTP/1.1\r\nHost: r\r\n\r\n"
            .repeat(5)
            .as_slice(),
    )
    .unwrap();
    for n in 0..5 {
        let response = conn.read_response(ANSWER_WITHIN).unwrap();
        assert_eq!(response.status, 200, "pipelined request {n}");
    }
    for client in clients {
        let answered = client.join().unwrap();
        assert!(answered.is_ok(), "{answered:?}");
    }
}

/// Sends `first` and then one header line every `every` until the server closes; returns how
/// long after connecting the connection was closed.
fn trickle_until_closed(addr: &str, first: &str, every: Duration) -> Duration {
    trickle_on_until_closed(Conn::connect(addr), first, every)
}

/// As [`trickle_until_closed`] on a connection already open (a kept-alive one); returns how
/// long after `first` was sent the connection was closed.
fn trickle_on_until_closed(mut conn: Conn, first: &str, every: Duration) -> Duration {
    let started = clock::instant();
    conn.send(first.as_bytes()).unwrap();
    let mut writer = conn.stream.try_clone().unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let trickler = {
        let stop = stop.clone();
        orca_relay::threads::spawn("test-trickle", move || {
            let mut n = 0;
            loop {
                clock::sleep(every);
                if stop.load(Ordering::Acquire)
                    || writer
                        .write_all(format!("X-Trickle-{n}: 1\r\n").as_bytes())
                        .is_err()
                {
                    return n;
                }
                n += 1;
            }
        })
        .unwrap()
    };
    let closed = conn.wait_closed(Duration::from_secs(30));
    let elapsed = started.elapsed();
    eprintln!("trickled head closed after {elapsed:?}");
    stop.store(true, Ordering::Release);
    let lines = trickler.join().unwrap();
    assert_eq!(closed, Ok(()), "still open after {elapsed:?}");
    assert!(lines >= 1, "the head was trickled ({lines} lines)");
    elapsed
}

#[test]
fn http_head_trickled_one_line_every_4_s_is_closed_at_10_s() {
    let relay = Relay::combined(&[]);
    let elapsed = trickle_until_closed(
        &relay.http,
        "GET /health HTTP/1.1\r\nHost: relay\r\n",
        secs(4.0),
    );
    assert!(
        elapsed >= secs(9.5) && elapsed <= secs(10.5),
        "closed after {elapsed:?}, not at the 10 s head deadline"
    );
}

/// The head deadline holds for every request on a kept-alive connection, not only the first
/// (issue 20: a later request's deadline raised from 10 s to 60 s was caught by nothing). The
/// idle close is a minute here, so only the head deadline can close the connection in time.
#[test]
fn a_later_request_head_on_a_kept_alive_connection_is_closed_at_10_s() {
    let relay = Relay::combined(&[("ORCA_RELAY_HTTP_IDLE_MS", "60000")]);
    let mut conn = Conn::connect(&relay.http);
    for _ in 0..2 {
        let answer = conn.round_trip("/health", ANSWER_WITHIN).unwrap();
        assert_eq!(answer.status, 200);
    }
    let elapsed =
        trickle_on_until_closed(conn, "GET /health HTTP/1.1\r\nHost: relay\r\n", secs(4.0));
    assert!(
        elapsed >= secs(9.5) && elapsed <= secs(15.0),
        "a later request's head was closed after {elapsed:?}, not at the 10 s head deadline"
    );
}

#[test]
fn websocket_upgrade_head_trickled_every_2_s_is_closed_at_5_s() {
    let relay = Relay::combined(&[]);
    let elapsed = trickle_until_closed(
        &relay.ws,
        "GET /v1/host/control HTTP/1.1\r\nHost: relay\r\n",
        secs(2.0),
    );
    assert!(
        elapsed >= secs(4.5) && elapsed <= secs(5.5),
        "closed after {elapsed:?}, not at the 5 s upgrade deadline"
    );
}

#[test]
fn an_idle_keep_alive_connection_is_closed_at_http_idle_ms_not_before() {
    let relay = Relay::combined(&[("ORCA_RELAY_HTTP_IDLE_MS", "3000")]);
    // Not before: a request 2.5 s into the idle time is answered on the same connection.
    let answered = reused_connection(&relay.http, &[Duration::ZERO, secs(2.5)], "/health");
    assert_eq!(answered, Ok(2));
    // At: the connection closes 3 s after the last answer.
    let mut conn = Conn::connect(&relay.http);
    conn.round_trip("/health", ANSWER_WITHIN).unwrap();
    let idle_from = clock::instant();
    assert_eq!(conn.wait_closed(Duration::from_secs(15)), Ok(()));
    let idle = idle_from.elapsed();
    eprintln!("idle keep-alive closed after {idle:?}");
    assert!(
        idle >= secs(2.95) && idle <= secs(3.5),
        "closed after {idle:?} idle, not at ORCA_RELAY_HTTP_IDLE_MS=3000"
    );
}

/// One refused upgrade that keeps sending a byte every 50 ms: (time from the answer until the
/// TCP connection is gone, i.e. a write fails with a reset, and the status).
fn refused_then_trickling(addr: &str) -> (Duration, u16) {
    let mut conn = Conn::connect(addr);
    conn.send(b"GET /nope HTTP/1.1\r\nHost: relay\r\n\r\n")
        .unwrap();
    let response = conn.read_response(Duration::from_secs(10)).unwrap();
    let answered = clock::instant();
    while conn.send(b"x").is_ok() && answered.elapsed() < Duration::from_secs(10) {
        clock::sleep(Duration::from_millis(50));
    }
    (answered.elapsed(), response.status)
}

#[test]
fn refused_upgrades_that_trickle_never_keep_a_desktop_out() {
    let relay = Relay::combined(&[("ORCA_RELAY_CONNECTION_CAP", "20")]);
    // A few measured refusals: the TCP connection is gone within 1 s whatever the client sends.
    let measured: Vec<_> = (0..10)
        .map(|n| {
            let ws = relay.ws.clone();
            orca_relay::threads::spawn(format!("test-refused-{n}"), move || {
                refused_then_trickling(&ws)
            })
            .unwrap()
        })
        .collect();
    // A thousand more: refused (404), then a byte every 50 ms each.
    let stop = Arc::new(AtomicBool::new(false));
    let flood = {
        let ws = relay.ws.clone();
        let stop = stop.clone();
        orca_relay::threads::spawn("test-refused-flood", move || {
            let mut sockets: Vec<TcpStream> = Vec::new();
            for _ in 0..1000 {
                if let Ok(mut stream) = TcpStream::connect(&ws) {
                    let _ = stream.write_all(b"GET /nope HTTP/1.1\r\nHost: relay\r\n\r\n");
                    let _ = stream.set_nonblocking(true);
                    sockets.push(stream);
                }
            }
            let opened = sockets.len();
            while !stop.load(Ordering::Acquire) {
                sockets.retain_mut(|s| match s.write(b"x") {
                    Ok(_) => true,
                    Err(e) => e.kind() == std::io::ErrorKind::WouldBlock,
                });
                clock::sleep(Duration::from_millis(50));
            }
            opened
        })
        .unwrap()
    };
    // While they trickle, desktops are admitted, each within 1 s.
    wait_until(Duration::from_secs(10), || {
        relay
            .metric("orca_relay_upgrades_refused_total{status=\"404\",reason=\"unknown_path\"}")
            .unwrap_or(0.0)
            >= 200.0
    });
    let mut desktops = Vec::new();
    for _ in 0..5 {
        let started = clock::instant();
        desktops.push(Desktop::connect(&relay));
        let took = started.elapsed();
        assert!(took < Duration::from_secs(1), "a desktop took {took:?}");
    }
    stop.store(true, Ordering::Release);
    assert_eq!(flood.join().unwrap(), 1000, "every flood socket connected");
    for thread in measured {
        let (gone_after, status) = thread.join().unwrap();
        eprintln!("refused connection gone {gone_after:?} after its answer");
        assert_eq!(status, 404);
        assert!(
            gone_after <= Duration::from_secs(1),
            "a refused connection stayed {gone_after:?} after its answer"
        );
    }
    // The connection cap counts only admitted sockets: five desktops, nothing else.
    assert!(wait_until(Duration::from_secs(5), || relay
        .metric("orca_relay_ws_pending_upgrades")
        == Some(0.0)));
    assert_eq!(
        relay.metric("orca_relay_connections{kind=\"control\"}"),
        Some(5.0)
    );
}

#[test]
fn unauthenticated_sockets_past_the_pending_bound_never_lock_desktops_out() {
    let relay = Relay::combined(&[
        ("ORCA_RELAY_CONNECTION_CAP", "2"),
        ("ORCA_RELAY_PENDING_UPGRADES_MAX", "16"),
    ]);
    // A hundred sockets that start an upgrade and stall, more than the pending bound.
    let mut stalled = Vec::new();
    for _ in 0..100 {
        let mut stream = TcpStream::connect(&relay.ws).unwrap();
        stream
            .write_all(b"GET /v1/host/control HTTP/1.1\r\nHost: relay\r\n")
            .unwrap();
        stalled.push(stream);
    }
    // Shed by stage (issue 30): a stalled head is shed as a partial head, or with nothing
    // received if it is shed before its bytes are read.
    let shed = || {
        ["no_bytes", "partial_head"]
            .iter()
            .map(|stage| {
                relay
                    .metric(&format!(
                        "orca_relay_ws_pending_upgrades_shed_total{{stage=\"{stage}\"}}"
                    ))
                    .unwrap_or(0.0)
            })
            .sum::<f64>()
    };
    assert!(wait_until(Duration::from_secs(5), || shed() >= 84.0));
    assert!(
        relay
            .metric("orca_relay_ws_pending_upgrades")
            .unwrap_or(99.0)
            <= 16.0
    );
    // The cap of 2 counts admitted sockets only: both desktops get in, each within 1 s.
    for _ in 0..2 {
        let started = clock::instant();
        let desktop = Desktop::connect(&relay);
        let took = started.elapsed();
        assert!(took < Duration::from_secs(1), "a desktop took {took:?}");
        std::mem::forget(desktop.control);
    }
    // A third is over the cap: 503 with Retry-After, counted.
    let third = host_id();
    let token = token("user-third", &third);
    assign(&relay, &token, &third);
    assert_eq!(
        try_upgrade(&relay.ws_url("/v1/host/control"), Some(&token)),
        Upgrade::Status(503)
    );
    assert_eq!(
        relay.metric("orca_relay_upgrades_refused_total{status=\"503\",reason=\"connection_cap\"}"),
        Some(1.0)
    );
}

#[test]
fn stalled_http_clients_arriving_in_a_burst_never_delay_health() {
    let relay = Relay::combined(&[("ORCA_RELAY_HTTP_CONNECTIONS_MAX", "32")]);
    // Two hundred clients that start a head and stall, all at once, far past the cap.
    let mut stalled = Vec::new();
    for _ in 0..200 {
        let mut stream = TcpStream::connect(&relay.http).unwrap();
        let _ = stream.write_all(b"GET /health HTTP/1.1\r\nHost: relay\r\n");
        stalled.push(stream);
    }
    for n in 0..40 {
        let path = if n % 2 == 0 { "/health" } else { "/ready" };
        let started = clock::instant();
        let mut conn = Conn::connect(&relay.http);
        let response = conn.round_trip(path, Duration::from_secs(5));
        let took = started.elapsed();
        assert_eq!(response.map(|r| r.status).ok(), Some(200), "{path}");
        assert!(took < Duration::from_millis(500), "{path} took {took:?}");
    }
    assert!(
        relay
            .metric("orca_relay_http_connections_shed_total")
            .unwrap_or(0.0)
            >= 168.0,
        "stalled heads were shed to make room"
    );
}

#[test]
fn an_idle_process_logs_no_warning_and_its_feed_poller_never_times_out() {
    let relay = Relay::combined(&[]);
    // The workload is sixty seconds of nothing.
    clock::sleep(Duration::from_secs(60));
    let log = relay.log_text();
    let loud: Vec<&str> = log
        .lines()
        .filter(|line| {
            line.split_whitespace()
                .take(2)
                .any(|token| token == "WARN" || token == "ERROR")
        })
        .collect();
    assert!(loud.is_empty(), "WARN/ERROR lines while idle:\n{loud:#?}");
    let polls = |result: &str| {
        relay
            .metric(&format!(
                "orca_relay_director_feed_polls_total{{cell_id=\"combined\",result=\"{result}\"}}"
            ))
            .unwrap_or(0.0)
    };
    assert_eq!(polls("timeout"), 0.0, "feed poll timeouts");
    assert!(polls("ok") >= 50.0, "feed polls ok: {}", polls("ok"));
}

/// The process state letter from /proc (`T` while stopped).
fn process_state(pid: u32) -> char {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|stat| {
            stat.rsplit_once(')')
                .and_then(|(_, rest)| rest.trim_start().chars().next())
        })
        .unwrap_or('?')
}

fn stop_and_continue(relay: &Relay) {
    relay.signal("STOP");
    assert!(wait_until(Duration::from_secs(5), || process_state(
        relay.pid()
    ) == 'T'));
    relay.signal("CONT");
    assert!(wait_until(Duration::from_secs(5), || process_state(
        relay.pid()
    ) != 'T'));
}

#[test]
fn a_stop_and_continue_drops_no_request_and_no_connection() {
    let relay = Relay::combined(&[]);
    // An idle keep-alive connection, a half-sent head on each port, a request sent while the
    // process is stopped.
    let mut idle = Conn::connect(&relay.http);
    idle.round_trip("/health", ANSWER_WITHIN).unwrap();
    let mut half = Conn::connect(&relay.http);
    half.send(b"GET /ready HTTP/1.1\r\n").unwrap();
    let mut upgrade = Conn::connect(&relay.ws);
    upgrade
        .send(b"GET /v1/host/control HTTP/1.1\r\nHost: relay\r\n")
        .unwrap();
    for round in 0..3 {
        stop_and_continue(&relay);
        let answer = idle.round_trip("/health", ANSWER_WITHIN);
        assert_eq!(answer.map(|r| r.status).ok(), Some(200), "round {round}");
    }
    half.send(b"Host: relay\r\n\r\n").unwrap();
    assert_eq!(
        half.read_response(ANSWER_WITHIN).map(|r| r.status).ok(),
        Some(200)
    );
    // The upgrade head completes after the pauses: answered (401 without a token), not dropped.
    upgrade
        .send(b"Upgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n")
        .unwrap();
    assert_eq!(
        upgrade.read_response(ANSWER_WITHIN).map(|r| r.status).ok(),
        Some(401)
    );
    // A request sent while the process is stopped is answered once it continues.
    relay.signal("STOP");
    assert!(wait_until(Duration::from_secs(5), || process_state(
        relay.pid()
    ) == 'T'));
    let mut during = Conn::connect(&relay.http);
    during.get("/health").unwrap();
    idle.get("/health").unwrap();
    relay.signal("CONT");
    assert_eq!(
        during.read_response(ANSWER_WITHIN).map(|r| r.status).ok(),
        Some(200)
    );
    assert_eq!(
        idle.read_response(ANSWER_WITHIN).map(|r| r.status).ok(),
        Some(200)
    );
    let desktop = Desktop::connect(&relay);
    drop(desktop);
}
