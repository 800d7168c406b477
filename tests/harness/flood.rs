//! Connection floods from this process (one source address), for the tests and the bench of the
//! pending plane and the reaper (issue 30): bare TCP connects that send nothing, or upgrades the
//! relay refuses, at a fixed rate from one load thread, and the `/health` probe that runs beside
//! them.
//!
//! The load thread paces itself against the clock (the connections due by now are opened, then
//! it sleeps a millisecond); when the relay or the machine cannot keep up it falls behind, and
//! [`FloodReport`] says the rate it reached.

use std::collections::VecDeque;
use std::io::Write;
use std::net::{SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use orca_relay::clock;

use super::raw_http::Conn;

/// What each connection of a flood does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Load {
    /// Connects and sends nothing; closed by this side after [`HOLD`] (the relay may have shed
    /// it long before).
    Bare,
    /// Sends an upgrade the relay refuses, in turn: an unknown path (404), a control with a
    /// token that does not verify (401), a phone whose first frame is not a `relay-auth`
    /// (101, then a 4401 close). Three in four are held [`HOLD`] without reading; the fourth is
    /// closed at once after its request.
    Refusals,
}

/// How long a flood's connection is kept open by this side.
pub const HOLD: Duration = Duration::from_secs(1);
/// A connect that takes longer is counted as failed.
const CONNECT_TIMEOUT: Duration = Duration::from_millis(250);
const KEY: &str = "dGhlIHNhbXBsZSBub25jZQ==";

/// What a flood achieved.
#[derive(Debug, Clone, Copy, Default)]
pub struct FloodReport {
    /// Connections established.
    pub opened: u64,
    /// Connects that failed or timed out.
    pub failed: u64,
    pub seconds: f64,
}

impl FloodReport {
    /// Connections established per second.
    pub fn rate(&self) -> f64 {
        self.opened as f64 / self.seconds.max(f64::EPSILON)
    }
}

pub struct Flood {
    stop: Arc<AtomicBool>,
    thread: JoinHandle<FloodReport>,
}

impl Flood {
    /// Stops the flood (if it is still running) and reports it.
    pub fn finish(self) -> FloodReport {
        self.stop.store(true, Ordering::Release);
        self.thread.join().unwrap_or_default()
    }

    /// Waits for the flood to run its course and reports it.
    pub fn join(self) -> FloodReport {
        self.thread.join().unwrap_or_default()
    }
}

/// Starts a flood of `load` on `addr`: `per_second` connections a second for `seconds`.
pub fn start(addr: &str, load: Load, per_second: u32, seconds: f64) -> Flood {
    let addr: SocketAddr = addr.parse().expect("a socket address");
    let stop = Arc::new(AtomicBool::new(false));
    let flag = stop.clone();
    let thread = orca_relay::threads::spawn("test-flood", move || {
        run(addr, load, per_second, seconds, &flag)
    })
    .expect("spawn the flood");
    Flood { stop, thread }
}

fn run(
    addr: SocketAddr,
    load: Load,
    per_second: u32,
    seconds: f64,
    stop: &AtomicBool,
) -> FloodReport {
    let window = Duration::from_secs_f64(seconds);
    let started = clock::instant();
    let mut held: VecDeque<(Instant, TcpStream)> = VecDeque::new();
    let mut report = FloodReport::default();
    let mut made: u64 = 0;
    while !stop.load(Ordering::Acquire) {
        let elapsed = started.elapsed();
        if elapsed >= window {
            break;
        }
        let due = (elapsed.as_secs_f64() * f64::from(per_second)) as u64;
        while made < due && started.elapsed() < window {
            match open(addr, load, made) {
                Some(Some(stream)) => {
                    report.opened += 1;
                    held.push_back((clock::instant(), stream));
                }
                Some(None) => report.opened += 1,
                None => report.failed += 1,
            }
            made += 1;
            if made.is_multiple_of(64) {
                release(&mut held);
            }
        }
        release(&mut held);
        clock::sleep(Duration::from_millis(1));
    }
    report.seconds = started.elapsed().as_secs_f64();
    report
}

/// Closes the held connections whose time is up (they are in opening order).
fn release(held: &mut VecDeque<(Instant, TcpStream)>) {
    while held.front().is_some_and(|(at, _)| at.elapsed() >= HOLD) {
        held.pop_front();
    }
}

/// Opens connection `n`: `None` when the connect failed, `Some(None)` when it was closed at
/// once, `Some(Some(stream))` when it is to be held.
fn open(addr: SocketAddr, load: Load, n: u64) -> Option<Option<TcpStream>> {
    let mut stream = TcpStream::connect_timeout(&addr, CONNECT_TIMEOUT).ok()?;
    if load == Load::Refusals {
        let _ = stream.write_all(&refused_request(n));
        if n % 4 == 3 {
            return Some(None);
        }
    }
    Some(Some(stream))
}

/// The request of refusal `n`.
pub fn refused_request(n: u64) -> Vec<u8> {
    let upgrade = |path: &str, extra: &str| {
        format!(
            "GET {path} HTTP/1.1\r\nHost: flood\r\nUpgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Version: 13\r\nSec-WebSocket-Key: {KEY}\r\n{extra}\r\n"
        )
        .into_bytes()
    };
    match n % 3 {
        0 => upgrade("/v1/nowhere", ""),
        1 => upgrade("/v1/host/control", "Authorization: Bearer not.a.token\r\n"),
        _ => {
            let mut bytes = upgrade(&format!("/v1/connect/flood{n:010}"), "");
            let mut frame = Vec::new();
            orca_relay::relay::frames::encode_client_frame(
                0x81,
                br#"{"type":"flood"}"#,
                [1, 2, 3, 4],
                &mut frame,
            );
            bytes.extend_from_slice(&frame);
            bytes
        }
    }
}

/// A `/health` probe on a fresh connection every `every` until stopped: the round trips that
/// were answered 200, and how many were not.
pub struct Probe {
    stop: Arc<AtomicBool>,
    thread: JoinHandle<(Vec<Duration>, usize)>,
}

impl Probe {
    pub fn start(http: &str, every: Duration) -> Probe {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let addr = http.to_string();
        let thread = orca_relay::threads::spawn("test-probe", move || {
            let (mut answered, mut failed) = (Vec::new(), 0);
            let started = clock::instant();
            let mut n = 0u32;
            while !flag.load(Ordering::Acquire) {
                let slot = started + every * n;
                let now = clock::instant();
                if slot > now {
                    clock::sleep(slot - now);
                }
                n += 1;
                let begun = clock::instant();
                let outcome = Conn::try_connect(&addr, Duration::from_secs(5))
                    .ok()
                    .and_then(|mut conn| conn.round_trip("/health", Duration::from_secs(5)).ok());
                match outcome {
                    Some(response) if response.status == 200 => answered.push(begun.elapsed()),
                    _ => failed += 1,
                }
            }
            answered.sort();
            (answered, failed)
        })
        .expect("spawn the probe");
        Probe { stop, thread }
    }

    /// Stops the probe: (sorted round trips of the answered probes, unanswered probes).
    pub fn finish(self) -> (Vec<Duration>, usize) {
        self.stop.store(true, Ordering::Release);
        self.thread.join().unwrap_or_default()
    }
}

/// The `p`th percentile of sorted durations (zero when there are none).
pub fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}
