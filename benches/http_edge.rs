//! The network-edge benchmark (issues 10 and 19; SPEC §5.4, §11, §12): `/health` and `/ready`
//! round trips on the HTTP port of an idle process next to the same process under attack
//! (slowloris heads, withheld bodies, unauthenticated phone and data legs on the WebSocket
//! port), and 10,000 requests on reused connections with idle gaps of 0 to 29 s.
//!
//! Usage:
//!
//! ```text
//! cargo build --release                       # the bench runs target/release/orca-relay
//! cargo bench --bench http_edge               # the full run, about 5 minutes
//! cargo bench --bench http_edge -- --quick    # a smoke run, about a minute
//! ```
//!
//! Flags (after `--`):
//! - `--quick`: 5 s windows; keep-alive 100 connections × 5 requests, gaps 0–12 s.
//! - `--seconds S` (10): length of each latency window.
//! - `--slowloris N` (2000), `--burst N` (500): the attack's size.
//! - `--withheld N` (2000): connections that withhold their bodies; `--legs N` (2000):
//!   unauthenticated WebSocket legs (half phones, half data legs).
//! - `--flood-rate N` (2500): bare connects a second in the bare-connect row.
//! - `--keepalive-connections N` (1000), `--keepalive-requests N` (10), `--gap-max-ms N`
//!   (29000): the keep-alive run (connections × requests, gaps uniform in 0..=gap-max).
//! - `--skip-attack`, `--skip-keepalive`: leave a part out.
//!
//! Environment: `ORCA_RELAY_BENCH_COMPARE=/path/to/another/orca-relay` runs every row against
//! that build too (copy the binary aside before a change, then compare both in one run).
//!
//! What it measures:
//! 1. **Latency.** The combined role on SQLite; a probe opens a fresh connection every 10 ms,
//!    alternating `GET /health` and `GET /ready`, and times connect → whole answer. Rows:
//!    - *idle*: nothing else talks to the process (the baseline);
//!    - *attack*: 2,000 slowloris sockets (each sends a request line, then one header line a
//!      second, and reconnects when closed) and bursts of 500 clients connecting at the same
//!      instant (every 2.5 s), each sending `GET /health`; once with the default
//!      `ORCA_RELAY_HTTP_CONNECTIONS_MAX` (1024: the slowloris sockets are shed oldest first and
//!      reconnect) and once with 4096 (every slowloris socket is held by its own thread).
//!
//!    - *withheld bodies* (default caps): 2,000 connections, half `POST /v1/assign` with
//!      `Content-Length: 100` and 5 bytes of it, half `GET /health` with `Content-Length: 60000`
//!      and none, each reconnecting when closed (the table of 1,024 sheds them: a connection
//!      waiting for body bytes is sheddable, and an answer never waits for an unread body);
//!    - *phone legs* (default caps: connection cap 1,000, 256 pending): 2,000 WebSocket upgrades
//!      on `/v1/connect/*` and `/v1/host/data/*` that ping, trickle their first frame or declare
//!      an 8 MiB one, each reconnecting when closed; besides the probes, a desktop connects
//!      (assign, upgrade, hello) every 250 ms and its admission time is reported;
//!    - *bare connects* (default caps, issue 30): 2,500 TCP connects a second that send nothing,
//!      from this one load thread (the rate it reached is printed), while 12 desktops pair phones
//!      300 ms away one after another (each phone waits 300 ms after its 101 before its first
//!      frame, as over a mobile network); reported: phones paired of those tried, and the time
//!      from a phone's first frame to its answer (`relay-hello`).
//!
//!    Reported: probes, failures, p50/p99/max per path; the bursts' answered count and p99 (or
//!    the desktops' for the phone-leg attack, the phones' first-frame answers for the bare
//!    connects); the relay's shed and refused counters (for the bare connects: pending
//!    connections shed, and newcomers dropped). Target: p99 under attack ≤ 50 ms (PASS/FAIL).
//! 2. **Keep-alive.** N connections each send M requests with idle gaps drawn uniformly from
//!    0 to 29 s (default idle close 30 s): every request must be answered on its connection.
//!    Reported: answered, unanswered (no answer within 5 s), closed by the server, latency.
//!
//! The bench process holds thousands of sockets: it raises its descriptor limit (and prints it).

#[path = "../tests/harness/mod.rs"]
mod harness;

use std::io::{ErrorKind, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Barrier, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use harness::flood::{self, Load};
use harness::raw_http::{Conn, ReadError};
use harness::{Desktop, Relay, TempDir};
use orca_relay::clock;

const TARGET_P99: Duration = Duration::from_millis(50);
const PROBE_EVERY: Duration = Duration::from_millis(10);
const ANSWER_TIMEOUT: Duration = Duration::from_secs(5);
const TRICKLE_EVERY: Duration = Duration::from_secs(1);
const BURST_EVERY: Duration = Duration::from_millis(2500);

struct Options {
    seconds: f64,
    slowloris: usize,
    burst: usize,
    withheld: usize,
    legs: usize,
    flood_rate: u32,
    keepalive_connections: usize,
    keepalive_requests: usize,
    gap_max_ms: u64,
    attack: bool,
    keepalive: bool,
}

impl Options {
    fn parse() -> Result<Options, String> {
        let mut options = Options {
            seconds: 10.0,
            slowloris: 2000,
            burst: 500,
            withheld: 2000,
            legs: 2000,
            flood_rate: 2500,
            keepalive_connections: 1000,
            keepalive_requests: 10,
            gap_max_ms: 29_000,
            attack: true,
            keepalive: true,
        };
        let mut args = std::env::args().skip(1);
        while let Some(arg) = args.next() {
            let mut value = |name: &str| args.next().ok_or_else(|| format!("{name} needs a value"));
            match arg.as_str() {
                "--bench" => {}
                "--quick" => {
                    options.seconds = 5.0;
                    options.keepalive_connections = 100;
                    options.keepalive_requests = 5;
                    options.gap_max_ms = 12_000;
                }
                "--seconds" => options.seconds = number(&value("--seconds")?, "--seconds")?,
                "--slowloris" => options.slowloris = number(&value("--slowloris")?, "--slowloris")?,
                "--burst" => options.burst = number(&value("--burst")?, "--burst")?,
                "--withheld" => options.withheld = number(&value("--withheld")?, "--withheld")?,
                "--legs" => options.legs = number(&value("--legs")?, "--legs")?,
                "--flood-rate" => {
                    options.flood_rate = number(&value("--flood-rate")?, "--flood-rate")?
                }
                "--keepalive-connections" => {
                    options.keepalive_connections = number(
                        &value("--keepalive-connections")?,
                        "--keepalive-connections",
                    )?
                }
                "--keepalive-requests" => {
                    options.keepalive_requests =
                        number(&value("--keepalive-requests")?, "--keepalive-requests")?
                }
                "--gap-max-ms" => {
                    options.gap_max_ms = number(&value("--gap-max-ms")?, "--gap-max-ms")?
                }
                "--skip-attack" => options.attack = false,
                "--skip-keepalive" => options.keepalive = false,
                other => {
                    return Err(format!(
                        "unknown argument {other} (see benches/http_edge.rs)"
                    ))
                }
            }
        }
        if options.seconds <= 0.0 {
            return Err("--seconds must be positive".into());
        }
        Ok(options)
    }
}

fn number<T: std::str::FromStr>(value: &str, name: &str) -> Result<T, String> {
    value
        .trim()
        .parse()
        .map_err(|_| format!("{name}: not a number: {value}"))
}

fn main() {
    let options = match Options::parse() {
        Ok(options) => options,
        Err(e) => {
            eprintln!("http_edge bench: {e}");
            std::process::exit(2);
        }
    };
    let binary = PathBuf::from(env!("CARGO_BIN_EXE_orca-relay"));
    if !binary.exists() {
        eprintln!(
            "http_edge bench: {} is missing; build it first with `cargo build --release`",
            binary.display()
        );
        std::process::exit(2);
    }
    let mut systems = vec![("orca-relay".to_string(), binary)];
    if let Some(other) = std::env::var_os("ORCA_RELAY_BENCH_COMPARE") {
        systems.push(("compare".to_string(), PathBuf::from(other)));
    }
    let limit = orca_relay::lifecycle::raise_fd_limit()
        .map(|(_, now)| now.to_string())
        .unwrap_or_else(|e| format!("unknown ({e})"));
    let started = clock::instant();
    println!("orca-relay network-edge bench");
    for (name, path) in &systems {
        println!("  {name}: {}", path.display());
    }
    println!(
        "descriptor limit: {limit}; load average before: {}",
        load_average()
    );
    if options.attack {
        latency_section(&options, &systems);
    }
    if options.keepalive {
        keepalive_section(&options, &systems);
    }
    println!("load average after: {}", load_average());
    println!("bench took {:.0} s", started.elapsed().as_secs_f64());
}

fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "unknown".into())
}

fn start(binary: &Path, env: &[(&str, &str)]) -> Relay {
    Relay::start_binary(binary, Arc::new(TempDir::new("bench-edge")), env)
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

fn ms(d: Duration) -> String {
    format!("{:.1}", d.as_secs_f64() * 1000.0)
}

/// One GET on a fresh connection: the time from connect to the whole answer.
fn fresh_round_trip(addr: &str, path: &str) -> Option<Duration> {
    let started = clock::instant();
    let mut conn = Conn::try_connect(addr, ANSWER_TIMEOUT).ok()?;
    match conn.round_trip(path, ANSWER_TIMEOUT) {
        Ok(response) if response.status == 200 => Some(started.elapsed()),
        _ => None,
    }
}

/// The relay's value of one metric series (0 when absent or unreachable).
fn scrape(relay: &Relay, series: &str) -> u64 {
    let Some(body) = fresh_get_body(&relay.http, "/metrics") else {
        return 0;
    };
    body.lines()
        .find_map(|line| {
            line.strip_prefix(series)?
                .strip_prefix(' ')?
                .trim()
                .parse::<f64>()
                .ok()
        })
        .unwrap_or(0.0) as u64
}

fn fresh_get_body(addr: &str, path: &str) -> Option<String> {
    let mut conn = Conn::try_connect(addr, ANSWER_TIMEOUT).ok()?;
    conn.round_trip(path, ANSWER_TIMEOUT)
        .ok()
        .map(|r| r.body_text())
}

// ---------------------------------------------------------------------------------------------
// The attack.

struct Slowloris {
    stop: Arc<AtomicBool>,
    thread: JoinHandle<(usize, u64)>,
}

/// `n` sockets that send a request line and then one header line every second, reconnecting
/// when the relay closes them. Returns once all are open.
fn start_slowloris(addr: &str, n: usize) -> Slowloris {
    let stop = Arc::new(AtomicBool::new(false));
    let (opened_tx, opened_rx) = std::sync::mpsc::channel();
    let thread = {
        let addr = addr.to_string();
        let stop = stop.clone();
        orca_relay::threads::spawn("bench-slowloris", move || {
            let open = |addr: &str| -> Option<TcpStream> {
                let mut conn = Conn::try_connect(addr, Duration::from_secs(1)).ok()?;
                conn.send(b"GET /health HTTP/1.1\r\nHost: bench\r\n").ok()?;
                conn.stream.set_nonblocking(true).ok()?;
                Some(conn.stream)
            };
            let mut sockets: Vec<Option<TcpStream>> = (0..n).map(|_| open(&addr)).collect();
            let _ = opened_tx.send(sockets.iter().filter(|s| s.is_some()).count());
            let mut reconnects = 0u64;
            let mut line = 0u64;
            while !stop.load(Ordering::Acquire) {
                let round = clock::instant();
                line += 1;
                for slot in sockets.iter_mut() {
                    let alive = match slot {
                        None => false,
                        Some(stream) => {
                            let mut sink = [0u8; 512];
                            let open = match stream.read(&mut sink) {
                                Err(e) => e.kind() == ErrorKind::WouldBlock,
                                // Closed, or answered (408): either way the relay is done with it.
                                Ok(_) => false,
                            };
                            open && stream
                                .write_all(format!("X-Slow-{line}: 1\r\n").as_bytes())
                                .is_ok()
                        }
                    };
                    if !alive {
                        *slot = open(&addr);
                        reconnects += 1;
                    }
                }
                let spent = round.elapsed();
                if spent < TRICKLE_EVERY {
                    clock::sleep(TRICKLE_EVERY - spent);
                }
            }
            (sockets.iter().filter(|s| s.is_some()).count(), reconnects)
        })
        .expect("spawn slowloris")
    };
    let opened = opened_rx.recv().unwrap_or(0);
    if opened < n {
        println!("  (slowloris: only {opened} of {n} sockets opened)");
    }
    Slowloris { stop, thread }
}

#[derive(Default)]
struct BurstStats {
    clients: usize,
    answered: usize,
    latencies: Vec<Duration>,
}

struct Bursts {
    stop: Arc<AtomicBool>,
    thread: JoinHandle<BurstStats>,
}

/// Every [`BURST_EVERY`], `n` clients released at the same instant, each connecting and
/// sending `GET /health`.
fn start_bursts(addr: &str, n: usize) -> Bursts {
    let stop = Arc::new(AtomicBool::new(false));
    let thread = {
        let addr = addr.to_string();
        let stop = stop.clone();
        orca_relay::threads::spawn("bench-bursts", move || {
            let mut stats = BurstStats::default();
            while !stop.load(Ordering::Acquire) {
                let round = clock::instant();
                let barrier = Arc::new(Barrier::new(n + 1));
                let results = Arc::new(Mutex::new(Vec::with_capacity(n)));
                let clients: Vec<_> = (0..n)
                    .filter_map(|i| {
                        let (addr, barrier, results) =
                            (addr.clone(), barrier.clone(), results.clone());
                        orca_relay::threads::spawn_with_stack(
                            format!("bench-burst-{i}"),
                            64 * 1024,
                            move || {
                                barrier.wait();
                                let result = fresh_round_trip(&addr, "/health");
                                results.lock().unwrap().push(result);
                            },
                        )
                        .ok()
                    })
                    .collect();
                if clients.len() < n {
                    println!("  (burst: only {} of {n} client threads)", clients.len());
                    // Let the barrier go with the threads that exist.
                    for _ in clients.len()..n {
                        let barrier = barrier.clone();
                        let _ = orca_relay::threads::spawn_with_stack(
                            "bench-burst-pad",
                            64 * 1024,
                            move || {
                                barrier.wait();
                            },
                        );
                    }
                }
                barrier.wait();
                for client in clients {
                    let _ = client.join();
                }
                for result in results.lock().unwrap().drain(..) {
                    stats.clients += 1;
                    if let Some(latency) = result {
                        stats.answered += 1;
                        stats.latencies.push(latency);
                    }
                }
                let spent = round.elapsed();
                if spent < BURST_EVERY && !stop.load(Ordering::Acquire) {
                    clock::sleep(BURST_EVERY - spent);
                }
            }
            stats
        })
        .expect("spawn bursts")
    };
    Bursts { stop, thread }
}

/// A background attacker: stopped by the flag, its thread returns (sockets open at the end,
/// reconnects).
struct Attacker {
    stop: Arc<AtomicBool>,
    thread: JoinHandle<(usize, u64)>,
}

/// Keeps `n` sockets open with `open(i)`; every `every`, `tick(i, stream)` writes the next bytes
/// (false: give the socket up) after what the relay sent is read and dropped; a socket the
/// relay closed is opened again.
fn start_attacker(
    name: &str,
    n: usize,
    every: Duration,
    open: impl Fn(usize) -> Option<TcpStream> + Send + 'static,
    tick: impl Fn(usize, &mut TcpStream) -> bool + Send + 'static,
) -> Attacker {
    let stop = Arc::new(AtomicBool::new(false));
    let (opened_tx, opened_rx) = std::sync::mpsc::channel();
    let thread = {
        let stop = stop.clone();
        orca_relay::threads::spawn(format!("bench-{name}"), move || {
            let mut sockets: Vec<Option<TcpStream>> = (0..n).map(&open).collect();
            let _ = opened_tx.send(sockets.iter().filter(|s| s.is_some()).count());
            let mut reconnects = 0u64;
            let mut sink = [0u8; 4096];
            while !stop.load(Ordering::Acquire) {
                let round = clock::instant();
                for (i, slot) in sockets.iter_mut().enumerate() {
                    let alive = match slot {
                        None => false,
                        Some(stream) => {
                            let open = loop {
                                match stream.read(&mut sink) {
                                    Ok(0) => break false,
                                    // A WebSocket close frame from the relay ends it too.
                                    Ok(n) if sink[..n].contains(&0x88) => break false,
                                    Ok(_) => continue,
                                    Err(e) if e.kind() == ErrorKind::WouldBlock => break true,
                                    Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                                    Err(_) => break false,
                                }
                            };
                            open && tick(i, stream)
                        }
                    };
                    if !alive {
                        *slot = open(i);
                        reconnects += 1;
                    }
                }
                let spent = round.elapsed();
                if spent < every {
                    clock::sleep(every - spent);
                }
            }
            (sockets.iter().filter(|s| s.is_some()).count(), reconnects)
        })
        .expect("spawn attacker")
    };
    let opened = opened_rx.recv().unwrap_or(0);
    if opened < n {
        println!("  ({name}: only {opened} of {n} sockets opened)");
    }
    Attacker { stop, thread }
}

impl Attacker {
    fn finish(self) -> (usize, u64) {
        self.stop.store(true, Ordering::Release);
        self.thread.join().unwrap_or((0, 0))
    }
}

/// `n` connections that withhold their bodies, reconnecting when closed.
fn start_withheld(addr: &str, n: usize) -> Attacker {
    let addr = addr.to_string();
    start_attacker(
        "withheld",
        n,
        Duration::from_millis(250),
        move |i| {
            let mut conn = Conn::try_connect(&addr, Duration::from_secs(1)).ok()?;
            let request: &[u8] = if i % 2 == 0 {
                b"POST /v1/assign HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"v\":"
            } else {
                b"GET /health HTTP/1.1\r\nHost: bench\r\nContent-Length: 60000\r\n\r\n"
            };
            conn.send(request).ok()?;
            conn.stream.set_nonblocking(true).ok()?;
            Some(conn.stream)
        },
        |_, _| true,
    )
}

/// `n` unauthenticated WebSocket legs (half phones, half data legs) that ping, trickle their
/// first frame or declare an 8 MiB one, reconnecting when closed.
fn start_legs(addr: &str, n: usize) -> Attacker {
    const KEY: &str = "dGhlIHNhbXBsZSBub25jZQ==";
    let addr = addr.to_string();
    let mask = [0x11, 0x22, 0x33, 0x44];
    start_attacker(
        "legs",
        n,
        Duration::from_millis(400),
        move |i| {
            let mut conn = Conn::try_connect(&addr, Duration::from_secs(1)).ok()?;
            let path = if i % 2 == 0 {
                format!("/v1/connect/bench{i:011}")
            } else {
                format!("/v1/host/data/{i:x}-{i}")
            };
            let mut bytes = format!(
                "GET {path} HTTP/1.1\r\nHost: bench\r\nUpgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Version: 13\r\nSec-WebSocket-Key: {KEY}\r\n\r\n"
            )
            .into_bytes();
            match (i / 2) % 3 {
                0 => {}
                1 => {
                    bytes.extend_from_slice(&[0x81, 0x80 | 126, 0, 200]);
                    bytes.extend_from_slice(&mask);
                }
                _ => {
                    bytes.extend_from_slice(&[0x81, 0x80 | 127]);
                    bytes.extend_from_slice(&(8u64 << 20).to_be_bytes());
                    bytes.extend_from_slice(&mask);
                }
            }
            conn.send(&bytes).ok()?;
            conn.stream.set_nonblocking(true).ok()?;
            Some(conn.stream)
        },
        move |i, stream| {
            let next: Vec<u8> = if (i / 2) % 3 == 0 {
                let mut ping = vec![0x89, 0x80 | 2];
                ping.extend_from_slice(&mask);
                ping.extend_from_slice(&[b'h' ^ mask[0], b'i' ^ mask[1]]);
                ping
            } else {
                vec![b'x']
            };
            // A partial write would cut a frame: such a socket is given up (and opened again).
            match stream.write(&next) {
                Ok(n) => n == next.len(),
                Err(e) => e.kind() == ErrorKind::WouldBlock,
            }
        },
    )
}

/// A desktop connecting every 250 ms (assign, upgrade, hello) until stopped: the admission
/// times of those that got in, and how many did not.
fn start_desktops(relay: &Relay) -> (Arc<AtomicBool>, JoinHandle<(Vec<Duration>, usize)>) {
    let stop = Arc::new(AtomicBool::new(false));
    let (ws, http) = (relay.ws.clone(), relay.http.clone());
    let flag = stop.clone();
    let thread = orca_relay::threads::spawn("bench-desktops", move || {
        let mut admitted = Vec::new();
        let mut failed = 0;
        while !flag.load(Ordering::Acquire) {
            let started = clock::instant();
            let outcome = std::panic::catch_unwind(|| {
                let relay_host_id = harness::host_id();
                let token = harness::token(&format!("user-{relay_host_id}"), &relay_host_id);
                let body = format!(r#"{{"v":1,"relayHostId":"{relay_host_id}"}}"#);
                let answer = ureq::post(&format!("http://{http}/v1/assign"))
                    .timeout(ANSWER_TIMEOUT)
                    .set("Authorization", &format!("Bearer {token}"))
                    .send_string(&body)
                    .ok()?
                    .into_string()
                    .ok()?;
                let epoch = serde_json::from_str::<serde_json::Value>(&answer)
                    .ok()?["assignmentEpoch"]
                    .as_i64()?;
                let mut control =
                    harness::ws_connect(&format!("ws://{ws}/v1/host/control"), Some(&token))
                        .ok()?;
                harness::send_json(
                    &mut control,
                    serde_json::json!({"type":"host-hello","v":1,"relayHostId":relay_host_id,"assignmentEpoch":epoch}),
                );
                let ack = harness::read_json(&mut control);
                (ack["type"] == "host-hello-ack").then_some(control)
            });
            match outcome {
                Ok(Some(_control)) => admitted.push(started.elapsed()),
                _ => failed += 1,
            }
            let spent = started.elapsed();
            if spent < Duration::from_millis(250) {
                clock::sleep(Duration::from_millis(250) - spent);
            }
        }
        admitted.sort();
        (admitted, failed)
    })
    .expect("spawn desktops");
    (stop, thread)
}

/// Probes for `seconds`: a fresh connection every [`PROBE_EVERY`], alternating the paths.
/// Returns (latencies per path, failures per path).
fn probe(addr: &str, seconds: f64) -> [(Vec<Duration>, usize); 2] {
    let mut out: [(Vec<Duration>, usize); 2] = Default::default();
    let started = clock::instant();
    let window = Duration::from_secs_f64(seconds);
    let mut n = 0usize;
    while started.elapsed() < window {
        let slot = started + PROBE_EVERY * n as u32;
        let now = clock::instant();
        if slot > now {
            clock::sleep(slot - now);
        }
        let which = n % 2;
        match fresh_round_trip(addr, PATHS[which]) {
            Some(latency) => out[which].0.push(latency),
            None => out[which].1 += 1,
        }
        n += 1;
    }
    for (latencies, _) in out.iter_mut() {
        latencies.sort();
    }
    out
}

const PATHS: [&str; 2] = ["/health", "/ready"];

/// What a latency scenario runs beside the probes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Attack {
    None,
    Slowloris,
    Withheld,
    Legs,
    BareFlood,
}

/// Desktops pairing phones 300 ms away beside the bare-connect flood.
const SLOW_PHONE_DESKTOPS: usize = 12;
/// The phones' round trip: each waits this long after its 101 before its first frame.
const PHONE_RTT: Duration = Duration::from_millis(300);

/// `desktops` desktops, each pairing one phone after another until `stop`: every phone waits
/// [`PHONE_RTT`] after its 101, then sends its first frame; the time from that frame to its
/// answer (`relay-hello`) of each phone that paired, and how many phones were tried.
fn slow_phones(relay: &Relay, desktops: usize, stop: &AtomicBool) -> (Vec<Duration>, usize) {
    let mut answers = Vec::new();
    let mut tried = 0;
    // A phone that is shed ends in a caught panic of the harness's client; counted, not printed.
    let hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    std::thread::scope(|scope| {
        let threads: Vec<_> = (0..desktops)
            .map(|_| {
                scope.spawn(|| {
                    let (mut answers, mut tried) = (Vec::new(), 0);
                    let mut desktop = None;
                    while !stop.load(Ordering::Acquire) {
                        if desktop.is_none() {
                            desktop =
                                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                                    Desktop::connect(relay)
                                }))
                                .ok();
                            if desktop.is_none() {
                                // Not admitted: counted as a phone that could not pair.
                                tried += 1;
                                clock::sleep(Duration::from_millis(250));
                                continue;
                            }
                        }
                        let Some(host) = desktop.as_mut() else {
                            continue;
                        };
                        tried += 1;
                        let answered =
                            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                                pair_slow_phone(relay, host)
                            }));
                        match answered {
                            Ok(Some(took)) => answers.push(took),
                            // A phone that was shed leaves its desktop waiting: start afresh.
                            _ => desktop = None,
                        }
                    }
                    (answers, tried)
                })
            })
            .collect();
        for thread in threads {
            let (some, n) = thread.join().unwrap_or_default();
            answers.extend(some);
            tried += n;
        }
    });
    std::panic::set_hook(hook);
    answers.sort();
    (answers, tried)
}

/// One phone 300 ms away paired with `desktop`: the time from its first frame to its answer.
fn pair_slow_phone(relay: &Relay, desktop: &mut Desktop) -> Option<Duration> {
    let invite = desktop.invite();
    let mut phone = harness::ws_connect(
        &relay.ws_url(&format!("/v1/connect/{}", desktop.relay_host_id)),
        None,
    )
    .ok()?;
    clock::sleep(PHONE_RTT);
    let sent = clock::instant();
    harness::send_json(
        &mut phone,
        serde_json::json!({"type":"relay-auth","v":1,"credential":invite}),
    );
    harness::set_read_timeout(&desktop.control, Some(ANSWER_TIMEOUT));
    let (conn_id, ticket) = desktop.conn_open();
    let _leg = desktop.data_leg(relay, &conn_id, &ticket);
    harness::set_read_timeout(&phone, Some(ANSWER_TIMEOUT));
    let hello = harness::read_json(&mut phone);
    (hello["type"] == "relay-hello").then(|| sent.elapsed())
}

/// The sum of every series of a metric family (both builds: the shed counter gained a label).
fn scrape_family(relay: &Relay, family: &str) -> u64 {
    let Some(body) = fresh_get_body(&relay.http, "/metrics") else {
        return 0;
    };
    body.lines()
        .filter(|line| {
            line.strip_prefix(family)
                .is_some_and(|rest| rest.starts_with(' ') || rest.starts_with('{'))
        })
        .filter_map(|line| line.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>() as u64
}

fn latency_section(options: &Options, systems: &[(String, PathBuf)]) {
    println!();
    println!(
        "1. /health and /ready round trips, fresh connection each, one every {} ms for {} s",
        PROBE_EVERY.as_millis(),
        options.seconds
    );
    println!(
        "   attack: {} slowloris sockets (a header line a second, reconnecting) + bursts of {} clients every {} ms",
        options.slowloris,
        options.burst,
        BURST_EVERY.as_millis()
    );
    println!();
    println!(
        "{:<11} {:<24} {:<8} {:>6} {:>6} {:>8} {:>8} {:>8} {:>13} {:>10} {:>7} {:>7}  target",
        "system",
        "scenario",
        "path",
        "probes",
        "failed",
        "p50 ms",
        "p99 ms",
        "max ms",
        "burst answ.",
        "burst p99",
        "shed",
        "refused"
    );
    // (name, HTTP connections max, attack)
    let scenarios: [(&str, Option<&str>, Attack); 6] = [
        ("idle", None, Attack::None),
        ("attack, cap 1024 (def.)", None, Attack::Slowloris),
        ("attack, cap 4096", Some("4096"), Attack::Slowloris),
        ("withheld bodies (def.)", None, Attack::Withheld),
        ("phone legs (def.)", None, Attack::Legs),
        ("bare connects (def.)", None, Attack::BareFlood),
    ];
    for (name, binary) in systems {
        for (scenario, cap, kind) in scenarios {
            let attack = kind != Attack::None;
            let env: Vec<(&str, &str)> = cap
                .map(|cap| vec![("ORCA_RELAY_HTTP_CONNECTIONS_MAX", cap)])
                .unwrap_or_default();
            let relay = start(binary, &env);
            let (slowloris, bursts) = if kind == Attack::Slowloris {
                (
                    Some(start_slowloris(&relay.http, options.slowloris)),
                    Some(start_bursts(&relay.http, options.burst)),
                )
            } else {
                (None, None)
            };
            let attacker = match kind {
                Attack::Withheld => Some(start_withheld(&relay.http, options.withheld)),
                Attack::Legs => Some(start_legs(&relay.ws, options.legs)),
                _ => None,
            };
            let desktops = (kind == Attack::Legs).then(|| start_desktops(&relay));
            let flood = (kind == Attack::BareFlood)
                .then(|| flood::start(&relay.ws, Load::Bare, options.flood_rate, options.seconds));
            let phones_stop = AtomicBool::new(false);
            let (results, phones) = std::thread::scope(|scope| {
                let phones = (kind == Attack::BareFlood).then(|| {
                    scope.spawn(|| slow_phones(&relay, SLOW_PHONE_DESKTOPS, &phones_stop))
                });
                let results = probe(&relay.http, options.seconds);
                phones_stop.store(true, Ordering::Release);
                (
                    results,
                    phones.map(|phones| phones.join().unwrap_or_default()),
                )
            });
            let flood = flood.map(flood::Flood::finish);
            let burst = bursts.map(|bursts| {
                bursts.stop.store(true, Ordering::Release);
                let mut stats = bursts.thread.join().unwrap_or_default();
                stats.latencies.sort();
                stats
            });
            let burst = burst.or_else(|| {
                phones.map(|(latencies, tried)| BurstStats {
                    clients: tried,
                    answered: latencies.len(),
                    latencies,
                })
            });
            let burst = burst.or_else(|| {
                desktops.map(|(stop, thread)| {
                    stop.store(true, Ordering::Release);
                    let (latencies, failed) = thread.join().unwrap_or_default();
                    BurstStats {
                        clients: latencies.len() + failed,
                        answered: latencies.len(),
                        latencies,
                    }
                })
            });
            let slow = slowloris
                .map(|slowloris| {
                    slowloris.stop.store(true, Ordering::Release);
                    slowloris.thread.join().unwrap_or((0, 0))
                })
                .or_else(|| attacker.map(Attacker::finish));
            let (shed, refused) = if kind == Attack::BareFlood {
                (
                    scrape_family(&relay, "orca_relay_ws_pending_upgrades_shed_total"),
                    scrape_family(&relay, "orca_relay_ws_connections_dropped_total"),
                )
            } else if kind == Attack::Legs {
                (
                    scrape_family(&relay, "orca_relay_ws_pending_upgrades_shed_total"),
                    scrape(
                        &relay,
                        "orca_relay_upgrades_refused_total{status=\"503\",reason=\"connection_cap\"}",
                    ),
                )
            } else {
                (
                    scrape(&relay, "orca_relay_http_connections_shed_total"),
                    scrape(
                        &relay,
                        "orca_relay_http_connections_refused_total{reason=\"full\"}",
                    ),
                )
            };
            drop(relay);
            for (which, (latencies, failed)) in results.iter().enumerate() {
                let p99 = percentile(latencies, 99.0);
                let verdict = if !attack {
                    "baseline"
                } else if p99 <= TARGET_P99 && *failed == 0 {
                    "PASS"
                } else {
                    "FAIL"
                };
                let (answered, burst_p99) = match &burst {
                    Some(stats) => (
                        format!("{}/{}", stats.answered, stats.clients),
                        ms(percentile(&stats.latencies, 99.0)),
                    ),
                    None => ("-".into(), "-".into()),
                };
                println!(
                    "{:<11} {:<24} {:<8} {:>6} {:>6} {:>8} {:>8} {:>8} {:>13} {:>10} {:>7} {:>7}  {verdict}",
                    name,
                    scenario,
                    PATHS[which],
                    latencies.len() + failed,
                    failed,
                    ms(percentile(latencies, 50.0)),
                    ms(p99),
                    ms(latencies.last().copied().unwrap_or_default()),
                    answered,
                    burst_p99,
                    if attack { shed.to_string() } else { "-".into() },
                    if attack { refused.to_string() } else { "-".into() },
                );
            }
            if let Some((open, reconnects)) = slow {
                let what = match kind {
                    Attack::Slowloris => "slowloris sockets",
                    Attack::Withheld => "withheld-body connections",
                    _ => "unauthenticated legs",
                };
                println!(
                    "{:<11} {:<24} {what} open at the end: {open}, reconnects: {reconnects}",
                    "", ""
                );
            }
            if let (Some(report), Some(stats)) = (flood, &burst) {
                println!(
                    "{:<11} {:<24} bare connects {:.0}/s reached ({} in {:.1} s, {} failed); phones paired {}/{}, first frame to relay-hello p50 {} ms, p99 {} ms (the burst columns above; shed = pending connections shed, refused = newcomers dropped)",
                    "",
                    "",
                    report.rate(),
                    report.opened,
                    report.seconds,
                    report.failed,
                    stats.answered,
                    stats.clients,
                    ms(percentile(&stats.latencies, 50.0)),
                    ms(percentile(&stats.latencies, 99.0))
                );
            }
            if kind == Attack::Legs {
                if let Some(stats) = &burst {
                    println!(
                        "{:<11} {:<24} desktops admitted {}/{}, p50 {} ms, p99 {} ms (the burst columns above; shed = pending legs shed, refused = 503 connection_cap)",
                        "",
                        "",
                        stats.answered,
                        stats.clients,
                        ms(percentile(&stats.latencies, 50.0)),
                        ms(percentile(&stats.latencies, 99.0))
                    );
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Keep-alive.

#[derive(Default)]
struct KeepaliveStats {
    answered: u64,
    unanswered: u64,
    closed: u64,
    latencies: Vec<Duration>,
}

/// A small deterministic generator (xorshift64*), so every run draws the same gaps.
fn next_random(state: &mut u64) -> u64 {
    *state ^= *state >> 12;
    *state ^= *state << 25;
    *state ^= *state >> 27;
    state.wrapping_mul(0x2545_f491_4f6c_dd1d)
}

fn keepalive_run(binary: &Path, options: &Options) -> (KeepaliveStats, Duration) {
    let relay = start(binary, &[]);
    let started = clock::instant();
    let sent = Arc::new(AtomicU64::new(0));
    let clients: Vec<_> = (0..options.keepalive_connections)
        .map(|i| {
            let addr = relay.http.clone();
            let requests = options.keepalive_requests;
            let gap_max = options.gap_max_ms;
            let sent = sent.clone();
            orca_relay::threads::spawn_with_stack(
                format!("bench-keepalive-{i}"),
                128 * 1024,
                move || {
                    let mut stats = KeepaliveStats::default();
                    let mut seed = 0x9e37_79b9_7f4a_7c15u64 ^ (i as u64 + 1);
                    let mut conn = Conn::try_connect(&addr, ANSWER_TIMEOUT).ok();
                    for n in 0..requests {
                        // The first request goes at once; the others after a gap of 0..=gap_max.
                        if n > 0 {
                            let gap = next_random(&mut seed) % (gap_max + 1);
                            clock::sleep(Duration::from_millis(gap));
                        }
                        let Some(c) = conn.as_mut() else {
                            stats.unanswered += 1;
                            conn = Conn::try_connect(&addr, ANSWER_TIMEOUT).ok();
                            continue;
                        };
                        sent.fetch_add(1, Ordering::Relaxed);
                        let begun = clock::instant();
                        match c.round_trip(PATHS[n % 2], ANSWER_TIMEOUT) {
                            Ok(response) if response.status == 200 => {
                                stats.answered += 1;
                                stats.latencies.push(begun.elapsed());
                            }
                            Err(ReadError::Closed) => {
                                stats.closed += 1;
                                conn = Conn::try_connect(&addr, ANSWER_TIMEOUT).ok();
                            }
                            Ok(_) | Err(_) => {
                                stats.unanswered += 1;
                                conn = Conn::try_connect(&addr, ANSWER_TIMEOUT).ok();
                            }
                        }
                    }
                    stats
                },
            )
            .expect("spawn keep-alive client")
        })
        .collect();
    let mut total = KeepaliveStats::default();
    for client in clients {
        if let Ok(stats) = client.join() {
            total.answered += stats.answered;
            total.unanswered += stats.unanswered;
            total.closed += stats.closed;
            total.latencies.extend(stats.latencies);
        }
    }
    total.latencies.sort();
    (total, started.elapsed())
}

fn keepalive_section(options: &Options, systems: &[(String, PathBuf)]) {
    println!();
    println!(
        "2. keep-alive: {} connections x {} requests, idle gaps uniform in 0..={} ms (idle close 30000 ms)",
        options.keepalive_connections, options.keepalive_requests, options.gap_max_ms
    );
    println!();
    println!(
        "{:<11} {:>9} {:>9} {:>11} {:>9} {:>8} {:>8} {:>8} {:>8}  target",
        "system",
        "requests",
        "answered",
        "unanswered",
        "closed",
        "p50 ms",
        "p99 ms",
        "max ms",
        "took s"
    );
    for (name, binary) in systems {
        let (stats, took) = keepalive_run(binary, options);
        let requests = stats.answered + stats.unanswered + stats.closed;
        let verdict = if stats.unanswered == 0 && stats.closed == 0 {
            "PASS"
        } else {
            "FAIL"
        };
        println!(
            "{:<11} {:>9} {:>9} {:>11} {:>9} {:>8} {:>8} {:>8} {:>8.0}  {verdict}",
            name,
            requests,
            stats.answered,
            stats.unanswered,
            stats.closed,
            ms(percentile(&stats.latencies, 50.0)),
            ms(percentile(&stats.latencies, 99.0)),
            ms(stats.latencies.last().copied().unwrap_or_default()),
            took.as_secs_f64()
        );
    }
}
