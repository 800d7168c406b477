//! The live handover at its edges (issue 31), shared by `tests/handover_soak.rs` and
//! `cargo bench --bench handover`: the issue's soak ([`soak`]), a desktop that reads slowly
//! ([`slow_reader`]), backpressured pairs ([`backpressured`]). Each scenario runs a given build
//! (the one under test, or a baseline built from another revision) and returns its figures; it
//! panics only on what no build may do (lose or reorder a byte, close a connection, refuse a
//! desktop in a run that asserts it), and the caller judges the timings.

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::client::{self, Blocking, OP_PING, OP_PONG};
use super::load::{Identity, Report, Spec};
use super::remote::RemoteLoad;
use super::{footprint, hand_over_with, Footprint, Handover, Poller, Serving};
use crate::harness::{assign, host_id, now_instant, token, wait_until, Relay, TempDir};
use serde_json::json;

const DEADLINE: Duration = Duration::from_secs(60);

/// The load's rhythm in the soak: a stream's gap between two arrivals is at most this plus its
/// pause.
pub const STREAM_INTERVAL: Duration = Duration::from_millis(100);

/// The most any stream or control may pause across a handover (the issue's figure).
pub const PAUSE_BOUND_MS: u64 = 250;

/// `count` desktops placed on a combined relay (`/v1/assign` on its in-process director).
pub fn place(relay: &Relay, count: usize) -> Vec<Identity> {
    (0..count)
        .map(|_| {
            let relay_host_id = host_id();
            let user_id = format!("user-{relay_host_id}");
            let token = token(&user_id, &relay_host_id);
            let epoch = assign(relay, &token, &relay_host_id);
            Identity {
                user_id,
                relay_host_id,
                token,
                epoch,
            }
        })
        .collect()
}

/// A `pre_exec` giving a command (and the processes it starts) the descriptor limit `nofile`;
/// none for `None`.
pub fn with_nofile(nofile: Option<u64>) -> impl FnOnce(&mut std::process::Command) {
    move |command| {
        let Some(nofile) = nofile else { return };
        use std::os::unix::process::CommandExt;
        // SAFETY: setrlimit is async-signal-safe; the closure runs in the child before exec.
        unsafe {
            command.pre_exec(move || {
                let limit = libc::rlimit {
                    rlim_cur: nofile,
                    rlim_max: nofile,
                };
                if libc::setrlimit(libc::RLIMIT_NOFILE, &limit) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
    }
}

/// A combined relay of `binary` (the build under test for `None`) with `env`, under `nofile`.
pub fn start_relay(binary: Option<&Path>, env: &[(&str, &str)], nofile: Option<u64>) -> Relay {
    let binary = binary.unwrap_or(Path::new(env!("CARGO_BIN_EXE_orca-relay")));
    let relay = Relay::launch_binary_with(
        binary,
        Arc::new(TempDir::new("relay")),
        env,
        with_nofile(nofile),
    )
    .expect_listening("orca_relay_started");
    assert!(
        wait_until(DEADLINE, || relay.get("/ready").0 == 200),
        "never ready: {}",
        relay.log_text()
    );
    relay
}

/// The number after `after` in `text` (`took_ms=123` → 123).
pub fn number_after(text: &str, after: &str) -> Option<u64> {
    text.split(after)
        .nth(1)?
        .split(|c: char| !c.is_ascii_digit())
        .next()?
        .parse()
        .ok()
}

/// The last `lines` lines of `text`.
pub fn tail(text: &str, lines: usize) -> String {
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

// ---------------------------------------------------------------------------------------------
// Newcomers: a new desktop every 20 ms, placed and connected as a desktop does.

/// One newcomer's fate.
#[derive(Debug, Clone)]
pub struct Joined {
    /// Milliseconds since the newcomers started.
    at_ms: u64,
    took_ms: u64,
    failure: Option<String>,
}

/// A new desktop every 20 ms: `POST /v1/assign`, then its control and hello, acknowledged.
/// Each stays connected for a while (the last 100 are kept), so the relay sees joins and
/// leaves throughout.
pub struct Newcomers {
    stop: Arc<AtomicBool>,
    joined: Arc<Mutex<Vec<Joined>>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

fn assign_quietly(http: &str, token: &str, relay_host_id: &str) -> Result<i64, String> {
    let body = json!({"v":1,"relayHostId":relay_host_id}).to_string();
    let answer = ureq::post(&format!("http://{http}/v1/assign"))
        .timeout(Duration::from_secs(10))
        .set("Content-Type", "application/json")
        .set("Authorization", &format!("Bearer {token}"))
        .send_string(&body);
    match answer {
        Ok(response) => {
            let value: serde_json::Value = response
                .into_json()
                .map_err(|e| format!("assign body: {e}"))?;
            value["assignmentEpoch"]
                .as_i64()
                .ok_or_else(|| format!("assign: {value}"))
        }
        Err(ureq::Error::Status(status, response)) => Err(format!(
            "assign {status}: {}",
            response.into_string().unwrap_or_default()
        )),
        Err(e) => Err(format!("assign: {e}")),
    }
}

impl Newcomers {
    pub fn start(relay: &Relay) -> Newcomers {
        let stop = Arc::new(AtomicBool::new(false));
        let joined: Arc<Mutex<Vec<Joined>>> = Arc::default();
        let (ws, http, flag, record) = (
            relay.ws.clone(),
            relay.http.clone(),
            stop.clone(),
            joined.clone(),
        );
        let thread = orca_relay::threads::spawn("test-newcomers", move || {
            let started = now_instant();
            let mut kept = std::collections::VecDeque::new();
            while !flag.load(Ordering::SeqCst) {
                let began = now_instant();
                let relay_host_id = host_id();
                let user_id = format!("user-{relay_host_id}");
                let token = token(&user_id, &relay_host_id);
                let outcome = assign_quietly(&http, &token, &relay_host_id).and_then(|epoch| {
                    let (stream, rest) = client::connect(&ws, "/v1/host/control", Some(&token))
                        .map_err(|status| format!("upgrade refused: {status}"))?;
                    let mut control = Blocking::new(stream, rest);
                    let hello = json!({"type":"host-hello","v":1,
                        "relayHostId":relay_host_id,"assignmentEpoch":epoch});
                    let ack = control
                        .send_json(hello)
                        .and_then(|()| control.json())
                        .map_err(|e| format!("hello: {e}"))?;
                    if ack["type"] != "host-hello-ack" {
                        return Err(format!("hello answered {ack}"));
                    }
                    Ok(control)
                });
                let took_ms = began.elapsed().as_millis() as u64;
                let at_ms = began.duration_since(started).as_millis() as u64;
                let failure = match outcome {
                    Ok(control) => {
                        kept.push_back(control);
                        if kept.len() > 100 {
                            kept.pop_front();
                        }
                        None
                    }
                    Err(e) => Some(e),
                };
                record.lock().unwrap().push(Joined {
                    at_ms,
                    took_ms,
                    failure,
                });
                orca_relay::clock::sleep(Duration::from_millis(20));
            }
        })
        .unwrap();
        Newcomers {
            stop,
            joined,
            thread: Some(thread),
        }
    }

    /// What happened to every newcomer so far.
    pub fn so_far(&self) -> Vec<Joined> {
        self.joined.lock().unwrap().clone()
    }

    pub fn stop(mut self) -> Vec<Joined> {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
        self.so_far()
    }
}

/// The newcomers that failed or waited longer than `bound_ms`, as lines.
pub fn troubled(joined: &[Joined], bound_ms: u64) -> Vec<String> {
    joined
        .iter()
        .filter(|j| j.failure.is_some() || j.took_ms > bound_ms)
        .map(|j| {
            format!(
                "at {} ms, took {} ms: {}",
                j.at_ms,
                j.took_ms,
                j.failure.as_deref().unwrap_or("admitted late")
            )
        })
        .collect()
}

// ---------------------------------------------------------------------------------------------
// The soak.

/// The issue's load and what to do with it.
#[derive(Debug, Clone)]
pub struct SoakSpec {
    pub handovers: usize,
    /// Then a next process that stops itself right after `ready`.
    pub stop_next: bool,
    pub controls: usize,
    pub pairs: usize,
    pub stuck: usize,
    pub slow: usize,
    pub probes: usize,
    /// The descriptor limit of every process, with a configured cap above what it allows: the
    /// cap in force is then the descriptor ceiling, and a handover that counts a carried
    /// connection twice shows in it.
    pub nofile: u64,
    /// The calling binary's helper test (`handover_kit::remote`).
    pub helper: &'static str,
    /// How many times the issue's stream and control pause bounds a figure may take before it
    /// is over (1: the issue's figures; an unoptimized build's CPU work is slower).
    pub pause_allowance: u64,
    /// The same for the handover's own time (`begin` to commit, the issue's 1 s).
    pub took_allowance: u64,
}

impl SoakSpec {
    /// The issue's figures.
    pub fn issue(handovers: usize, helper: &'static str) -> SoakSpec {
        SoakSpec {
            handovers,
            stop_next: true,
            controls: 2_000,
            pairs: 200,
            stuck: 8,
            slow: 50,
            probes: 100,
            nofile: 8_192,
            helper,
            pause_allowance: 1,
            took_allowance: 1,
        }
    }
}

/// One handover of the soak.
#[derive(Debug, Clone)]
pub struct Round {
    /// The command's line.
    pub line: String,
    /// From `begin` to the commit, as the running process measured it.
    pub took_ms: u64,
    /// The streams' longest gap less the load's rhythm.
    pub stream_pause_ms: u64,
    /// The controls' longest pause (a probe's ping unanswered).
    pub control_pause_ms: u64,
    pub cap: f64,
}

/// What one soak saw.
#[derive(Debug)]
pub struct SoakFigures {
    pub rounds: Vec<Round>,
    pub fresh_cap: f64,
    /// The serving process after each handover, and the connections it took (newcomers come
    /// and go: a hundred are connected at a time).
    pub footprints: Vec<(Footprint, u64)>,
    pub newcomers: usize,
    pub newcomer_worst_ms: u64,
    pub stopped: Option<StoppedFigures>,
    pub finished: Report,
    /// Each figure over the issue's bound, as a line (empty: every bound held).
    pub over_bounds: Vec<String>,
}

#[derive(Debug)]
pub struct StoppedFigures {
    /// From `begin` to the rollback, as the running process measured it.
    pub took_ms: u64,
    pub control_pause_ms: u64,
    pub command: Handover,
}

impl SoakFigures {
    /// One line per handover, then the rest.
    pub fn summary(&self) -> String {
        let mut out = String::new();
        for (i, round) in self.rounds.iter().enumerate() {
            out += &format!(
                "handover {}: took {} ms, stream pause {} ms, control pause {} ms, cap {} (fresh {}): {}\n",
                i + 1,
                round.took_ms,
                round.stream_pause_ms,
                round.control_pause_ms,
                round.cap,
                self.fresh_cap,
                round.line
            );
        }
        if let Some(stopped) = &self.stopped {
            out += &format!(
                "stopped after ready: rolled back in {} ms, control pause {} ms, command exit {} in {} ms\n",
                stopped.took_ms,
                stopped.control_pause_ms,
                stopped.command.code,
                stopped.command.took.as_millis()
            );
        }
        let (first, last) = (self.footprints.first(), self.footprints.last());
        out += &format!(
            "footprint {first:?} -> {last:?}; {} newcomers, the slowest {} ms; {} messages sent, {} received, {} slow pongs\n",
            self.newcomers,
            self.newcomer_worst_ms,
            self.finished.messages_sent,
            self.finished.messages_received,
            self.finished.slow_pongs
        );
        for line in &self.over_bounds {
            out += &format!("over a bound: {line}\n");
        }
        out
    }
}

/// The issue's load on a fresh combined relay of `binary` (the build under test for `None`;
/// each handover starts the same build, `next` every other time when given), `spec.handovers`
/// in a row, then (with `spec.stop_next`) a next process that stops itself after `ready`.
/// Panics on a connection closed, a byte lost or reordered, a failed poll or a growing
/// process; collects every timing over the issue's bounds (and every newcomer refused or kept
/// waiting over 1 s) in [`SoakFigures::over_bounds`].
pub fn soak(spec: &SoakSpec, binary: Option<&Path>, next: Option<&Path>) -> SoakFigures {
    super::raise_fd_limit();
    super::adopt_orphans();
    let env = [
        ("ORCA_RELAY_PING_MS", "2000"),
        // Stuck pairs hold their output for the whole soak: no wedge within it.
        ("ORCA_RELAY_WEDGE_MS", "600000"),
        ("ORCA_RELAY_CONNECTION_CAP", "100000"),
        ("ORCA_RELAY_SPLICE_WORKERS", "2"),
    ];
    let relay = start_relay(binary, &env, Some(spec.nofile));
    // A fresh start's cap (the descriptor ceiling under the limit).
    let fresh_cap = relay
        .metric("orca_relay_connection_cap")
        .expect("the cap in /metrics");
    let mut load_spec = Spec::new(spec.controls, spec.pairs);
    load_spec.stuck = spec.stuck;
    load_spec.slow = spec.slow;
    load_spec.probes = spec.probes;
    load_spec.interval = STREAM_INTERVAL;
    let identities = place(&relay, load_spec.controls);
    let mut load = RemoteLoad::start(spec.helper, &relay.ws, load_spec, identities);
    // The stuck pairs' outputs fill, the slow desktops' threads block in their writes.
    orca_relay::clock::sleep(Duration::from_secs(5));
    let poller = Poller::start(&relay.http);
    let newcomers = Newcomers::start(&relay);
    let mut serving: Option<Serving> = None;
    let mut rounds = Vec::new();
    let mut footprints = Vec::new();
    let mut over_bounds = Vec::new();
    let streams = spec.pairs * 2;
    let mut log_seen = relay.log_text().lines().count();
    for round in 1..=spec.handovers {
        load.mark();
        let build = if round % 2 == 1 {
            next.or(binary)
        } else {
            binary
        };
        let outcome = hand_over_with(&relay, build, &[], &[], with_nofile(Some(spec.nofile)));
        assert_eq!(
            outcome.code,
            0,
            "round {round}: {outcome:?}\nlog:\n{}",
            tail(&relay.log_text(), 60)
        );
        let took_ms = number_after(&outcome.stdout, "ms, ").unwrap_or(u64::MAX);
        let now_serving = Serving {
            pid: outcome.new_pid.expect("the new pid"),
        };
        if let Some(previous) = serving.replace(now_serving) {
            assert_eq!(
                previous.wait_exit(Duration::from_secs(15)),
                Some(0),
                "round {round}: the old process exits 0"
            );
        }
        // Every control heard from and every stream moved since the mark, after the commit.
        let report = super::served(|| load.report(), streams, DEADLINE);
        let cap = relay.metric("orca_relay_connection_cap").unwrap_or(-1.0);
        let stream_pause_ms = report
            .max_stall_ms
            .saturating_sub(STREAM_INTERVAL.as_millis() as u64);
        eprintln!(
            "round {round}: took {took_ms} ms, stream pause {stream_pause_ms} ms (longest gap {} ms), control pause {} ms, cap {cap}; {}",
            report.max_stall_ms,
            report.max_control_pause_ms,
            outcome.stdout.trim()
        );
        let log = relay.log_text();
        for event in [
            "orca_relay_handover_committed",
            "orca_relay_handover_received",
        ] {
            if let Some(line) = log.lines().rfind(|line| line.contains(event)) {
                eprintln!("    {line}");
            }
        }
        // Whatever went wrong since the last round, as the processes logged it.
        for line in log.lines().skip(log_seen) {
            if line.contains(" WARN ") || line.contains(" ERROR ") {
                eprintln!("    {line}");
            }
        }
        log_seen = log.lines().count();
        assert!(report.closed.is_empty(), "closed: {:?}", report.closed);
        assert!(report.violations.is_empty(), "{:?}", report.violations);
        let took_bound = 1_000 * spec.took_allowance;
        if took_ms > took_bound {
            over_bounds.push(format!(
                "round {round}: the handover took {took_ms} ms (bound {took_bound} ms)"
            ));
        }
        let pause_bound = PAUSE_BOUND_MS * spec.pause_allowance;
        if stream_pause_ms > pause_bound {
            over_bounds.push(format!(
                "round {round}: a stream paused {stream_pause_ms} ms (bound {pause_bound} ms)"
            ));
        }
        if report.max_control_pause_ms > pause_bound {
            over_bounds.push(format!(
                "round {round}: a control paused {} ms (bound {pause_bound} ms)",
                report.max_control_pause_ms
            ));
        }
        if cap != fresh_cap {
            over_bounds.push(format!(
                "round {round}: the cap is {cap}, a fresh start's {fresh_cap}"
            ));
        }
        rounds.push(Round {
            line: outcome.stdout.trim().to_string(),
            took_ms,
            stream_pause_ms,
            control_pause_ms: report.max_control_pause_ms,
            cap,
        });
        orca_relay::clock::sleep(Duration::from_millis(500));
        if let Some(serving) = &serving {
            let moved = number_after(&outcome.stdout, "), ").unwrap_or(0);
            footprints.push((footprint(serving.pid), moved));
        }
    }
    let stopped = spec.stop_next.then(|| {
        load.mark();
        let failed_before = relay.count_log("orca_relay_handover_failed");
        let command = hand_over_with(
            &relay,
            binary,
            &[],
            &["--test-fault", "stop-after-ready"],
            with_nofile(Some(spec.nofile)),
        );
        assert_eq!(command.code, 1, "a stopped next process: {command:?}");
        assert!(relay.wait_for_log_count(
            "orca_relay_handover_failed",
            failed_before + 1,
            DEADLINE
        ));
        let line = relay
            .log_text()
            .lines()
            .rfind(|line| line.contains("orca_relay_handover_failed"))
            .unwrap_or_default()
            .to_string();
        let took_ms = number_after(&line, "took_ms=").unwrap_or(u64::MAX);
        let report = load.report();
        eprintln!(
            "stopped after ready: rolled back in {took_ms} ms, control pause {} ms; {line}",
            report.max_control_pause_ms
        );
        if took_ms > 3_000 {
            over_bounds.push(format!(
                "a stopped next process: rolled back after {took_ms} ms"
            ));
        }
        if report.max_control_pause_ms > PAUSE_BOUND_MS {
            over_bounds.push(format!(
                "a stopped next process: a control paused {} ms",
                report.max_control_pause_ms
            ));
        }
        StoppedFigures {
            took_ms,
            control_pause_ms: report.max_control_pause_ms,
            command,
        }
    });
    let joined = newcomers.stop();
    over_bounds.extend(troubled(&joined, 1_000));
    let (asked, failures) = poller.stop();
    let finished = load.finish(Duration::from_secs(120));
    assert!(
        failures.is_empty(),
        "{} of {asked} polls failed: {failures:?}",
        failures.len()
    );
    assert!(finished.closed.is_empty(), "closed: {:?}", finished.closed);
    assert!(finished.violations.is_empty(), "{:?}", finished.violations);
    assert_eq!(
        finished.messages_received, finished.messages_sent,
        "every message sent arrived: {finished:?}"
    );
    assert!(
        spec.slow == 0 || finished.slow_pongs > 0,
        "the slow desktops pinged: {finished:?}"
    );
    // The serving process does not grow from one handover to the next: its descriptors and
    // threads beyond one per connection it took (a control: a socket and a thread), its
    // memory within noise.
    if let (Some((first, at_first)), Some((last, at_last))) =
        (footprints.first(), footprints.last())
    {
        let beyond = |n: usize, connections: u64| n as i64 - connections as i64;
        assert!(
            beyond(last.fds, *at_last) <= beyond(first.fds, *at_first) + 30,
            "descriptors {first:?} ({at_first} connections) -> {last:?} ({at_last})"
        );
        assert!(
            beyond(last.threads, *at_last) <= beyond(first.threads, *at_first) + 30,
            "threads {first:?} ({at_first} connections) -> {last:?} ({at_last})"
        );
        assert!(
            last.rss_kib <= first.rss_kib + first.rss_kib / 4,
            "memory {first:?} -> {last:?}"
        );
    }
    SoakFigures {
        rounds,
        fresh_cap,
        footprints,
        newcomers: joined.len(),
        newcomer_worst_ms: joined.iter().map(|j| j.took_ms).max().unwrap_or(0),
        stopped,
        finished,
        over_bounds,
    }
}

// ---------------------------------------------------------------------------------------------
// A desktop that reads slowly.

/// A client ping of the largest control payload: an 8-byte sequence number and filler.
const PING_PAYLOAD: usize = 125;

fn ping_frame(seq: u64) -> Vec<u8> {
    let mut payload = seq.to_be_bytes().to_vec();
    payload.resize(PING_PAYLOAD, b'p');
    let mut out = Vec::new();
    client::encode(&mut out, true, OP_PING, &payload, [3, 1, 4, 1]);
    out
}

/// A desktop seated on a combined relay, with an invite for one phone: (identity, control,
/// generation, invite).
fn seated_desktop(relay: &Relay) -> (Identity, Blocking, u64, String) {
    let identity = place(relay, 1).remove(0);
    let (stream, rest) =
        client::connect(&relay.ws, "/v1/host/control", Some(&identity.token)).expect("upgrade");
    let mut control = Blocking::new(stream, rest);
    control
        .send_json(
            json!({"type":"host-hello","v":1,"relayHostId":identity.relay_host_id,
            "assignmentEpoch":identity.epoch}),
        )
        .unwrap();
    let ack = control.json().unwrap();
    assert_eq!(ack["type"], "host-hello-ack");
    let generation = ack["generation"].as_u64().unwrap();
    control
        .send_json(json!({"type":"invite-create","reqId":"slow"}))
        .unwrap();
    let invite = control.json().unwrap()["inviteToken"]
        .as_str()
        .unwrap()
        .to_string();
    (identity, control, generation, invite)
}

/// Writes pings on `stream` (non-blocking) until the relay has taken none for 300 ms: its
/// control thread is then blocked writing a pong into our full receive buffer, and reads
/// nothing more. Returns the pings whole on the wire and the bytes of the one cut short.
fn ping_until_the_relay_blocks(stream: &std::net::TcpStream) -> (u64, Vec<u8>) {
    use std::io::Write;
    // Our own send buffer stays large: a relay that only holds back a small window update
    // (its receiver's silly-window avoidance) never leaves it full for 300 ms; a relay that
    // reads nothing does.
    stream.set_nonblocking(true).unwrap();
    let mut written: u64 = 0;
    let mut out: Vec<u8> = Vec::new();
    let mut seq = 0u64;
    let mut idle_since = now_instant();
    loop {
        if out.is_empty() {
            out = ping_frame(seq);
            seq += 1;
        }
        match (&*stream).write(&out) {
            Ok(n) => {
                out.drain(..n);
                if out.is_empty() {
                    written += 1;
                }
                idle_since = now_instant();
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if idle_since.elapsed() >= Duration::from_millis(300) {
                    stream.set_nonblocking(false).unwrap();
                    return (written, out);
                }
                orca_relay::clock::sleep(Duration::from_millis(10));
            }
            Err(e) => panic!("ping: {e}"),
        }
    }
}

/// Whether a relay thread of process `pid` waits to write: in `poll(2)` (x86_64's syscall 7)
/// with a timeout within the wedge window (10 s), where a thread waiting to read waits its
/// silence window (75 s); or, in a build whose writes block (a baseline), in `write(2)`,
/// `writev(2)`, `sendto(2)` or `sendmsg(2)` (1, 20, 44, 46). Read from
/// `/proc/<pid>/task/*/syscall`.
fn a_relay_thread_waits_to_write(pid: u32) -> bool {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return false;
    };
    tasks.flatten().any(|task| {
        let comm = std::fs::read_to_string(task.path().join("comm")).unwrap_or_default();
        let syscall = std::fs::read_to_string(task.path().join("syscall")).unwrap_or_default();
        let fields: Vec<&str> = syscall.split_whitespace().collect();
        let timeout = fields
            .get(3)
            .and_then(|arg| u64::from_str_radix(arg.trim_start_matches("0x"), 16).ok());
        let polling = fields.first() == Some(&"7") && timeout.is_some_and(|ms| ms <= 10_000);
        let writing = matches!(fields.first(), Some(&("1" | "20" | "44" | "46")));
        comm.starts_with("relay-") && (polling || writing)
    })
}

/// Server frames read in bulk (tens of thousands of small ones): (opcode, payload).
struct Frames {
    buf: Vec<u8>,
    at: usize,
    chunk: Vec<u8>,
}

impl Frames {
    fn new(buffered: Vec<u8>) -> Frames {
        Frames {
            buf: buffered,
            at: 0,
            chunk: vec![0u8; 256 * 1024],
        }
    }

    fn next(&mut self, stream: &std::net::TcpStream) -> std::io::Result<(u8, Vec<u8>)> {
        loop {
            if let Some((_, opcode, payload, len)) = client::parse(&self.buf[self.at..]) {
                let body = self.buf[self.at + payload.start..self.at + payload.end].to_vec();
                self.at += len;
                return Ok((opcode, body));
            }
            self.buf.drain(..self.at);
            self.at = 0;
            let n = std::io::Read::read(&mut &*stream, &mut self.chunk)?;
            if n == 0 {
                return Err(std::io::ErrorKind::UnexpectedEof.into());
            }
            self.buf.extend_from_slice(&self.chunk[..n]);
        }
    }
}

/// What [`slow_reader`] saw.
#[derive(Debug, Clone)]
pub struct SlowReaderFigures {
    /// Pings whole on the wire when the relay's control thread was blocked in its write.
    pub pings: u64,
    /// The command's exit status and line, and the handover's length as the running process
    /// measured it.
    pub code: i32,
    pub line: String,
    pub took_ms: u64,
    /// Connections the handover moved (the slow desktop's control, its waiting phone).
    pub moved: u64,
    /// Every pong arrived, whole and in order, then the phone's `conn-open`, and the pair was
    /// spliced: nothing the relay owed the desktop was lost.
    pub delivered: bool,
    /// What went wrong after the handover, if anything.
    pub failure: Option<String>,
}

/// A desktop whose control reads nothing for a while: it pings, reading none of the pongs,
/// until the relay's control thread is blocked writing a pong to it (seen in `/proc`) and reads
/// no more, and a phone's `conn-open` waits behind that write for the socket's writer. Then a
/// handover (to `next`, the same build for `None`) of a relay of `binary`; then the desktop
/// reads up to the `conn-open` and attaches the phone.
pub fn slow_reader(binary: Option<&Path>, next: Option<&Path>) -> SlowReaderFigures {
    super::adopt_orphans();
    let relay = start_relay(
        binary,
        &[
            ("ORCA_RELAY_PING_MS", "60000"),
            ("ORCA_RELAY_ATTACH_DEADLINE_MS", "120000"),
        ],
        None,
    );
    // On loopback a relay that answered every ping it could read sometimes only holds back
    // a window update (its receiver's silly-window avoidance against 64 KiB segments) when
    // the desktop's writes stop: then the desktop tries again, until the relay's thread is
    // seen waiting to write.
    let mut attempts = 0;
    let (identity, mut control, generation, invite, pings, cut) = loop {
        attempts += 1;
        let (identity, control, generation, invite) = seated_desktop(&relay);
        let (pings, cut) = ping_until_the_relay_blocks(&control.stream);
        if a_relay_thread_waits_to_write(relay.pid()) {
            break (identity, control, generation, invite, pings, cut);
        }
        assert!(
            attempts < 8,
            "no desktop got the relay's thread to wait on its write"
        );
    };
    let cut_short = !cut.is_empty();
    // A phone: its thread writes conn-open into the desktop's socket, behind the pong.
    let (stream, rest) = client::connect(
        &relay.ws,
        &format!("/v1/connect/{}", identity.relay_host_id),
        None,
    )
    .expect("phone upgrade");
    let mut phone = Blocking::new(stream, rest);
    phone
        .send_json(json!({"type":"relay-auth","v":1,"credential":invite}))
        .unwrap();
    orca_relay::clock::sleep(Duration::from_millis(500));
    let outcome = hand_over_with(&relay, next.or(binary), &[], &[], |_| {});
    let mut figures = SlowReaderFigures {
        pings,
        code: outcome.code,
        line: format!("{}\n{}", outcome.stdout.trim(), outcome.stderr.trim()),
        took_ms: number_after(&outcome.stdout, "ms, ").unwrap_or(0),
        moved: number_after(&outcome.stdout, "), ").unwrap_or(0),
        delivered: false,
        failure: None,
    };
    let _serving = outcome.new_pid.map(|pid| Serving { pid });
    // The desktop reads, and finishes its cut ping meanwhile (the relay reads it once it has
    // written what it owes).
    let finisher = {
        let stream = control.stream.try_clone().unwrap();
        orca_relay::threads::spawn("test-cut-ping", move || {
            std::io::Write::write_all(&mut &stream, &cut).map_err(|e| e.to_string())
        })
        .unwrap()
    };
    // Up to the phone's conn-open: the pongs the relay had written, then what was owed when
    // the quiesce began (the rest of a pong, a pong for each ping its thread had read) and the
    // conn-open owed behind them, every one whole and in order. (The pongs for the pings
    // still unread in the relay's buffers follow; reading them all would only time the relay
    // answering tens of thousands of pings.)
    let pings = pings + u64::from(cut_short);
    let mut pongs = 0u64;
    let mut conn_open = None;
    let mut frames = Frames::new(std::mem::take(&mut control.buffered));
    while conn_open.is_none() {
        let (opcode, payload) = match frames.next(&control.stream) {
            Ok(frame) => frame,
            Err(e) => {
                figures.failure = Some(format!(
                    "the desktop's next frame after {pongs} of {pings} pongs: {e}"
                ));
                return figures;
            }
        };
        match opcode {
            OP_PONG => {
                let mut expected = pongs.to_be_bytes().to_vec();
                expected.resize(PING_PAYLOAD, b'p');
                assert_eq!(payload, expected, "pong {pongs} whole and in order");
                pongs += 1;
            }
            client::OP_TEXT => {
                let value: serde_json::Value = serde_json::from_slice(&payload).unwrap();
                if value["type"] == "conn-open" {
                    conn_open = Some(value);
                }
            }
            client::OP_CLOSE => {
                figures.failure = Some(format!("closed after {pongs} of {pings} pongs"));
                return figures;
            }
            other => panic!("frame {other} on the control"),
        }
    }
    if let Err(e) = finisher.join().unwrap() {
        figures.failure = Some(format!("the cut ping's rest: {e}"));
        return figures;
    }
    let open = conn_open.unwrap();
    let (stream, rest) = client::connect(
        &relay.ws,
        &format!("/v1/host/data/{}", open["connId"].as_str().unwrap()),
        None,
    )
    .expect("data leg");
    let mut leg = Blocking::new(stream, rest);
    leg.send_json(json!({"type":"host-data-auth","v":1,
        "connTicket":open["connTicket"],"generation":generation}))
        .unwrap();
    match phone.json() {
        Ok(hello) if hello["type"] == "relay-hello" => figures.delivered = true,
        other => figures.failure = Some(format!("the phone heard {other:?}")),
    }
    figures
}

// ---------------------------------------------------------------------------------------------
// Backpressured output.

/// The highest resident memory `pid` reached while sampled, every 2 ms, until it exits or
/// `stop` is set: a thread of the test process.
fn sample_rss(pid: u32, stop: Arc<AtomicBool>) -> std::thread::JoinHandle<u64> {
    orca_relay::threads::spawn("test-rss", move || {
        let mut peak = 0;
        while !stop.load(Ordering::SeqCst) {
            let now = footprint(pid).rss_kib;
            if now == 0 {
                break;
            }
            peak = peak.max(now);
            orca_relay::clock::sleep(Duration::from_millis(2));
        }
        peak
    })
    .unwrap()
}

/// What [`backpressured`] saw.
#[derive(Debug, Clone)]
pub struct BackpressureFigures {
    pub code: i32,
    pub line: String,
    pub took_ms: u64,
    /// How long the streams were held (the command's `streams paused`), and the longest gap a
    /// streaming pair saw less the load's rhythm.
    pub paused_ms: u64,
    pub stream_pause_ms: u64,
    /// The running process's resident memory before the handover, and its peak until it
    /// exited (or rolled back).
    pub rss_before_kib: u64,
    pub rss_peak_kib: u64,
    /// Every message the stuck pairs had waiting arrived once their ends read again.
    pub delivered: bool,
}

/// `stuck` pairs whose two ends read nothing (about 1.25 MiB of output each way waiting in the
/// relay) beside `streaming` pairs, on a relay of `binary`; one handover (to `next`, the same
/// build for `None`); the running process's memory sampled throughout.
pub fn backpressured(
    binary: Option<&Path>,
    next: Option<&Path>,
    stuck: usize,
    streaming: usize,
    helper: &'static str,
) -> BackpressureFigures {
    super::raise_fd_limit();
    super::adopt_orphans();
    let relay = start_relay(
        binary,
        &[
            ("ORCA_RELAY_WEDGE_MS", "600000"),
            ("ORCA_RELAY_SPLICE_WORKERS", "2"),
            ("ORCA_RELAY_CONNECTION_CAP", "100000"),
        ],
        None,
    );
    let mut spec = Spec::new(streaming + stuck, streaming);
    spec.stuck = stuck;
    spec.interval = STREAM_INTERVAL;
    let identities = place(&relay, spec.controls);
    let mut load = RemoteLoad::start(helper, &relay.ws, spec, identities);
    // The stuck pairs' outputs fill to their bound.
    orca_relay::clock::sleep(Duration::from_secs(5));
    let old = relay.pid();
    let rss_before_kib = footprint(old).rss_kib;
    let stop = Arc::new(AtomicBool::new(false));
    let sampler = sample_rss(old, stop.clone());
    load.mark();
    let outcome = hand_over_with(&relay, next.or(binary), &[], &[], |_| {});
    let serving = outcome.new_pid.map(|pid| Serving { pid });
    if outcome.code == 0 {
        // The running process exits once it has handed over (its resident memory reads 0).
        wait_until(Duration::from_secs(30), || footprint(old).rss_kib == 0);
    }
    stop.store(true, Ordering::SeqCst);
    let rss_peak_kib = sampler.join().unwrap();
    let report = super::served(|| load.report(), streaming * 2, DEADLINE);
    let finished = load.finish(Duration::from_secs(120));
    assert!(finished.violations.is_empty(), "{:?}", finished.violations);
    drop(serving);
    BackpressureFigures {
        code: outcome.code,
        line: format!("{}\n{}", outcome.stdout.trim(), outcome.stderr.trim()),
        took_ms: number_after(&outcome.stdout, "ms, ").unwrap_or(0),
        paused_ms: number_after(&outcome.stdout, "streams paused ").unwrap_or(0),
        stream_pause_ms: report
            .max_stall_ms
            .saturating_sub(STREAM_INTERVAL.as_millis() as u64),
        rss_before_kib,
        rss_peak_kib,
        delivered: finished.closed.is_empty()
            && report.closed.is_empty()
            && finished.messages_received == finished.messages_sent,
    }
}
