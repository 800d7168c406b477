//! The many-sessions mode and the paired-session memory row (issue 12); usage and method in
//! the header of `benches/relay.rs`.
//!
//! A session is one phone and its desktop's end: through the relay, the phone leg and the data
//! leg of a desktop whose control socket was assigned, upgraded and acked; through nginx and
//! directly, the phone's WebSocket to the bench's echo server. The load generator
//! ([`super::loadgen`]) drives every session of every system from the same few event-loop
//! threads.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tungstenite::Message;

use super::loadgen::{self, Engine, LoopStats, Role, RunSpec};
use super::{
    cpu_seconds, median, nginx_binary, open_controls, percentile, start_relay, target_line,
    ControlDesktop, Nginx, Options,
};
use crate::harness::Relay;
use orca_relay::clock;

/// Bytes per message in the many-sessions mode.
const MESSAGE_BYTES: usize = 256;
/// The frame each way per session before the memory row's idle measurement.
const MEMORY_FRAME_BYTES: usize = 64 * 1024;
/// Blocking set-up threads (the sessions' own traffic runs on the engine's loops).
const SETUP_THREADS: usize = 4;
/// How many `rate_limited` invite refusals one session's set-up waits out.
const INVITE_RETRIES: u32 = 20;
/// How long a system may take to let go of a run's sessions.
const SETTLE_TIMEOUT: Duration = Duration::from_secs(60);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Relay,
    Nginx,
    Direct,
}

/// One system under test.
struct Target {
    name: &'static str,
    kind: Kind,
    /// Where phones connect (`host:port`).
    addr: String,
    /// The middlebox's processes: the relay, or nginx's master and workers; none for direct.
    pids: Vec<u32>,
    /// A relay's HTTP address (`host:port`), where its desktops are assigned.
    http: Option<String>,
}

impl Target {
    fn relay(name: &'static str, relay: &Relay) -> Target {
        Target {
            name,
            kind: Kind::Relay,
            addr: relay.ws.clone(),
            pids: vec![relay.pid()],
            http: Some(relay.http.clone()),
        }
    }
}

/// The relay's desktops for one K, handed to the set-up threads and back.
type Desktops = Vec<ControlDesktop>;

// ---------------------------------------------------------------------------------------------
// /proc readers.

fn status_field(status: &str, name: &str) -> u64 {
    status
        .lines()
        .find_map(|line| line.strip_prefix(name))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|value| value.parse().ok())
        .unwrap_or(0)
}

/// RSS (KiB), threads and sockets of a set of processes, summed. Sockets, not every
/// descriptor (a database file opened in the middle of the bench is not a session left
/// behind), and not a connection of the processes to themselves: the combined role's director
/// polls its own cell over HTTP on a keep-alive connection that comes and goes.
#[derive(Debug, Clone, Copy, Default)]
struct Footprint {
    rss_kib: u64,
    threads: u64,
    sockets: u64,
}

fn footprint(pids: &[u32]) -> Footprint {
    let mut total = Footprint::default();
    let mut inodes = std::collections::HashSet::new();
    for pid in pids {
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
        total.rss_kib += status_field(&status, "VmRSS:");
        total.threads += status_field(&status, "Threads:");
        for entry in std::fs::read_dir(format!("/proc/{pid}/fd"))
            .into_iter()
            .flatten()
            .flatten()
        {
            if let Ok(target) = std::fs::read_link(entry.path()) {
                let target = target.to_string_lossy();
                if let Some(inode) = target.strip_prefix("socket:[") {
                    inodes.insert(inode.trim_end_matches(']').to_string());
                }
            }
        }
    }
    total.sockets = (inodes.len() as u64).saturating_sub(self_connections(&inodes));
    total
}

/// Sockets among `inodes` (TCP, by `/proc/net/tcp{,6}`) whose peer is also among them.
fn self_connections(inodes: &std::collections::HashSet<String>) -> u64 {
    let mut ends = std::collections::HashSet::new();
    for table in ["/proc/net/tcp", "/proc/net/tcp6"] {
        let text = std::fs::read_to_string(table).unwrap_or_default();
        for line in text.lines().skip(1) {
            let fields: Vec<&str> = line.split_whitespace().collect();
            if fields.len() > 9 && inodes.contains(fields[9]) {
                ends.insert((fields[1].to_string(), fields[2].to_string()));
            }
        }
    }
    ends.iter()
        .filter(|(local, remote)| ends.contains(&(remote.clone(), local.clone())))
        .count() as u64
}

/// One thread's (voluntary, involuntary) context switches and its name.
type Switches = (u64, u64, String);

/// Context switches of every live thread of `pids`, by thread id.
///
/// `/proc/<pid>/status` counts only the thread-group leader, and Linux publishes no process
/// total of context switches (the counts of exited threads go into the process's own
/// `getrusage`, which only the process itself can read), so each thread is read from
/// `/proc/<pid>/task/<tid>/status` before and after a run and the deltas are summed. A thread
/// that exited during the run loses its in-run switches: the table counts such threads (and new
/// ones) so the reader knows whether it happened. In the many-sessions runs no middlebox thread
/// starts or ends (sessions are set up before and closed after a run).
fn context_switches(pids: &[u32]) -> HashMap<u32, Switches> {
    let mut out = HashMap::new();
    for pid in pids {
        let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
            continue;
        };
        for task in tasks.filter_map(Result::ok) {
            let Some(tid) = task
                .file_name()
                .to_str()
                .and_then(|s| s.parse::<u32>().ok())
            else {
                continue;
            };
            let Ok(status) = std::fs::read_to_string(task.path().join("status")) else {
                continue;
            };
            out.insert(
                tid,
                (
                    status_field(&status, "voluntary_ctxt_switches:"),
                    status_field(&status, "nonvoluntary_ctxt_switches:"),
                    status
                        .lines()
                        .find_map(|line| line.strip_prefix("Name:"))
                        .unwrap_or("")
                        .trim()
                        .to_string(),
                ),
            );
        }
    }
    out
}

/// Context switches between two snapshots: (voluntary, involuntary, names of the threads that
/// ended or started in between).
fn switch_delta(
    before: &HashMap<u32, Switches>,
    after: &HashMap<u32, Switches>,
) -> (u64, u64, Vec<String>) {
    let mut voluntary = 0;
    let mut involuntary = 0;
    let mut churn = Vec::new();
    for (tid, (v, i, name)) in after {
        let (v0, i0) = match before.get(tid) {
            Some((v0, i0, _)) => (*v0, *i0),
            None => {
                churn.push(format!("+{name}"));
                (0, 0)
            }
        };
        voluntary += v.saturating_sub(v0);
        involuntary += i.saturating_sub(i0);
    }
    for (tid, (_, _, name)) in before {
        if !after.contains_key(tid) {
            churn.push(format!("-{name}"));
        }
    }
    (voluntary, involuntary, churn)
}

// ---------------------------------------------------------------------------------------------
// Sessions: set-up and tear-down.

fn read_control(ws: &mut super::IdleSocket, wanted: &str) -> Result<serde_json::Value, String> {
    read_control_of(ws, &[wanted])
}

/// The next control message of one of the `wanted` types (others are skipped).
fn read_control_of(
    ws: &mut super::IdleSocket,
    wanted: &[&str],
) -> Result<serde_json::Value, String> {
    loop {
        match ws.read().map_err(|e| format!("control read: {e}"))? {
            Message::Text(text) => {
                let value: serde_json::Value =
                    serde_json::from_str(&text).map_err(|e| format!("control JSON: {e}"))?;
                if wanted.iter().any(|&w| value["type"] == w) {
                    return Ok(value);
                }
            }
            Message::Close(frame) => return Err(format!("control closed: {frame:?}")),
            _ => {}
        }
    }
}

/// One relay session: invite, phone relay-auth, conn-open, data leg host-data-auth,
/// relay-hello; then the phone and the data leg go to the engine.
fn relay_session(ws: &str, desktop: &mut ControlDesktop, engine: &Engine) -> Result<(), String> {
    // A desktop may create 8 invites at once, then one a second (`invite-refused`
    // `rate_limited` with `retryAfterMs`): short runs come back to a desktop before its bucket
    // is full again, so a refusal waits as it says and asks again.
    let mut refusals = 0;
    let created = loop {
        desktop
            .ws
            .send(Message::text(r#"{"type":"invite-create","reqId":"b"}"#))
            .map_err(|e| format!("invite-create: {e}"))?;
        let answer = read_control_of(&mut desktop.ws, &["invite-created", "invite-refused"])?;
        if answer["type"] == "invite-created" {
            break answer;
        }
        refusals += 1;
        if answer["reason"] != "rate_limited" || refusals > INVITE_RETRIES {
            return Err(format!("invite refused: {answer}"));
        }
        let wait_ms = answer["retryAfterMs"].as_u64().unwrap_or(1_000).min(5_000);
        clock::sleep(Duration::from_millis(wait_ms));
    };
    let invite = created["inviteToken"]
        .as_str()
        .ok_or("invite-created without a token")?
        .to_string();
    let (mut phone, mut phone_buf) =
        loadgen::connect(ws, &format!("/v1/connect/{}", desktop.relay_host_id), None)?;
    let auth = serde_json::json!({"type":"relay-auth","v":1,"credential":invite});
    loadgen::send_text(&mut phone, &auth.to_string())?;
    let open = read_control(&mut desktop.ws, "conn-open")?;
    let (Some(conn_id), Some(ticket)) = (open["connId"].as_str(), open["connTicket"].as_str())
    else {
        return Err(format!("conn-open without an id or ticket: {open}"));
    };
    let (mut leg, leg_buf) = loadgen::connect(ws, &format!("/v1/host/data/{conn_id}"), None)?;
    let auth = serde_json::json!({"type":"host-data-auth","v":1,"connTicket":ticket,"generation":desktop.generation});
    loadgen::send_text(&mut leg, &auth.to_string())?;
    let (opcode, payload) = loadgen::read_frame(&mut phone, &mut phone_buf)?;
    if opcode != loadgen::OP_TEXT || !String::from_utf8_lossy(&payload).contains("relay-hello") {
        return Err(format!(
            "expected relay-hello, got opcode {opcode}: {}",
            String::from_utf8_lossy(&payload)
        ));
    }
    engine.add(phone, Role::Phone, phone_buf);
    engine.add(leg, Role::Echo { mask: true }, leg_buf);
    Ok(())
}

/// Opens `k` sessions on `target` and waits until the engine holds both ends of each.
fn open_sessions(
    target: &Target,
    k: usize,
    desktops: &mut Desktops,
    phones_per_desktop: usize,
    engine: &Arc<Engine>,
) -> Result<(), String> {
    match target.kind {
        Kind::Relay => {
            // Desktop d carries sessions d*ppd .. (d+1)*ppd; each set-up thread takes every
            // SETUP_THREADS-th desktop.
            let mut shares: Vec<Vec<(usize, ControlDesktop)>> =
                (0..SETUP_THREADS).map(|_| Vec::new()).collect();
            for (d, desktop) in std::mem::take(desktops).into_iter().enumerate() {
                shares[d % SETUP_THREADS].push((d, desktop));
            }
            let handles: Vec<_> = shares
                .into_iter()
                .enumerate()
                .map(|(t, mut share)| {
                    let ws = target.addr.clone();
                    let engine = engine.clone();
                    orca_relay::threads::spawn(format!("bench-setup-{t}"), move || {
                        let mut failure = None;
                        'desktops: for (d, desktop) in &mut share {
                            let phones =
                                phones_per_desktop.min(k.saturating_sub(*d * phones_per_desktop));
                            for _ in 0..phones {
                                if let Err(e) = relay_session(&ws, desktop, &engine) {
                                    failure = Some(e);
                                    break 'desktops;
                                }
                            }
                        }
                        (share, failure)
                    })
                    .expect("spawn a set-up thread")
                })
                .collect();
            let mut back = Vec::new();
            let mut failure = None;
            for handle in handles {
                let (share, failed) = handle.join().expect("a set-up thread panicked");
                back.extend(share);
                failure = failure.or(failed);
            }
            back.sort_by_key(|(d, _)| *d);
            desktops.extend(back.into_iter().map(|(_, desktop)| desktop));
            if let Some(e) = failure {
                return Err(e);
            }
        }
        Kind::Nginx | Kind::Direct => {
            let handles: Vec<_> = (0..SETUP_THREADS)
                .map(|t| {
                    let share = (t..k).step_by(SETUP_THREADS).count();
                    let addr = target.addr.clone();
                    let engine = engine.clone();
                    orca_relay::threads::spawn(format!("bench-setup-{t}"), move || {
                        for _ in 0..share {
                            let (phone, buf) = loadgen::connect(&addr, "/desktop", None)?;
                            engine.add(phone, Role::Phone, buf);
                        }
                        Ok::<(), String>(())
                    })
                    .expect("spawn a set-up thread")
                })
                .collect();
            for handle in handles {
                handle.join().expect("a set-up thread panicked")?;
            }
        }
    }
    if !engine.wait_registered(2 * k, Duration::from_secs(60)) {
        return Err(format!(
            "{}: the engine did not get both ends of {k} sessions",
            target.name
        ));
    }
    Ok(())
}

/// Closes every session and waits until the middlebox is back to `baseline` descriptors and
/// threads (its per-session threads ended, its sockets closed).
fn close_sessions(engine: &Engine, target: &Target, baseline: Footprint) {
    engine.clear();
    if target.pids.is_empty() {
        return;
    }
    let settled = crate::harness::wait_until(SETTLE_TIMEOUT, || {
        let now = footprint(&target.pids);
        now.sockets <= baseline.sockets && now.threads <= baseline.threads
    });
    if !settled {
        let now = footprint(&target.pids);
        println!(
            "  ({}: still {} sockets / {} threads after closing, baseline {} / {})",
            target.name, now.sockets, now.threads, baseline.sockets, baseline.threads
        );
    }
}

// ---------------------------------------------------------------------------------------------
// One run.

/// What one measured run of one system gave.
#[derive(Debug, Clone)]
struct RunResult {
    rate: f64,
    p50: f64,
    p99: f64,
    p999: f64,
    /// Middlebox CPU seconds per million messages (a message = one 256 B frame one way).
    cpu_per_million: Option<f64>,
    /// (voluntary, involuntary) context switches per message.
    switches: Option<(f64, f64)>,
    /// Middlebox threads that started (`+name`) or ended (`-name`) during the run.
    churn: Vec<String>,
    rss_kib: u64,
    threads: u64,
    /// Load generator: CPU cores used on average, its busiest loop thread's share of a core,
    /// and its CPU seconds per million messages.
    loadgen_cores: f64,
    loadgen_busiest: f64,
    loadgen_per_million: f64,
}

fn merge(stats: &[LoopStats]) -> (Vec<f64>, u64, u64, u64) {
    let samples = stats
        .iter()
        .flat_map(|s| s.samples_us.iter().map(|&us| us as f64))
        .collect();
    let in_window = stats.iter().map(|s| s.in_window).sum();
    let completed = stats.iter().map(|s| s.completed).sum();
    let errors = stats.iter().map(|s| s.errors).sum();
    (samples, in_window, completed, errors)
}

/// Round trips of `payload` bytes on every open session, `rounds` each; panics unless every
/// session answered.
fn round_trips_everywhere(engine: &Engine, payload: usize, rounds: u64, what: &str) {
    let now = clock::instant();
    engine.start_run(&RunSpec {
        payload,
        count_from: now,
        count_until: now,
        max_rounds: Some(rounds),
        sending: Arc::new(AtomicBool::new(true)),
    });
    let stats = engine.collect();
    let phones: usize = stats.iter().map(|s| s.phones).sum();
    let (_, _, completed, errors) = merge(&stats);
    assert!(
        errors == 0 && completed == phones as u64 * rounds,
        "{what}: {completed} of {} round trips came back, {errors} sessions lost",
        phones as u64 * rounds
    );
}

fn measure_run(engine: &Engine, target: &Target, seconds: f64) -> RunResult {
    // Every session answers before the clock starts.
    round_trips_everywhere(engine, MESSAGE_BYTES, 2, target.name);
    let cpu_before = cpu_seconds(&target.pids);
    let switches_before = context_switches(&target.pids);
    let sending = Arc::new(AtomicBool::new(true));
    let started = clock::instant();
    // The first tenth (at most 1 s) is a ramp: it is run but not counted.
    let count_from = started + Duration::from_secs_f64((seconds / 10.0).min(1.0));
    let count_until = started + Duration::from_secs_f64(seconds);
    engine.start_run(&RunSpec {
        payload: MESSAGE_BYTES,
        count_from,
        count_until,
        max_rounds: None,
        sending: sending.clone(),
    });
    clock::sleep(count_until.saturating_duration_since(clock::instant()));
    sending.store(false, Ordering::Release);
    let stats = engine.collect();
    let elapsed = started.elapsed().as_secs_f64();
    let cpu = cpu_seconds(&target.pids) - cpu_before;
    let switches_after = context_switches(&target.pids);
    let held = footprint(&target.pids);

    let (samples, in_window, completed, errors) = merge(&stats);
    assert!(
        errors == 0,
        "{}: {errors} sessions lost during a run",
        target.name
    );
    let messages = 2.0 * completed as f64;
    let window = (count_until - count_from).as_secs_f64();
    let loadgen_cpu: f64 = stats.iter().map(|s| s.cpu_seconds).sum();
    let busiest = stats.iter().map(|s| s.cpu_seconds).fold(0.0, f64::max);
    let (voluntary, involuntary, churn) = switch_delta(&switches_before, &switches_after);
    let middlebox = !target.pids.is_empty();
    RunResult {
        rate: in_window as f64 / window,
        p50: percentile(&samples, 50.0),
        p99: percentile(&samples, 99.0),
        p999: percentile(&samples, 99.9),
        cpu_per_million: middlebox.then(|| cpu / messages * 1e6),
        switches: middlebox.then(|| (voluntary as f64 / messages, involuntary as f64 / messages)),
        churn,
        rss_kib: held.rss_kib,
        threads: held.threads,
        loadgen_cores: loadgen_cpu / elapsed,
        loadgen_busiest: busiest / elapsed,
        loadgen_per_million: loadgen_cpu / messages * 1e6,
    }
}

// ---------------------------------------------------------------------------------------------
// The mode.

fn fd_limit_allows(sessions: usize, phones_per_desktop: usize) -> bool {
    let needed = (2 * sessions + sessions.div_ceil(phones_per_desktop) + 300) as u64;
    match orca_relay::lifecycle::raise_fd_limit() {
        Ok((_, soft)) if soft >= needed => true,
        Ok((_, soft)) => {
            println!("many sessions: {sessions} sessions need {needed} descriptors here, the limit is {soft}: left out");
            false
        }
        Err(e) => {
            println!("many sessions: cannot raise the descriptor limit: {e}");
            false
        }
    }
}

/// The relay's environment for holding `sessions` sessions with `desktops` desktops.
fn relay_cap(sessions: usize, desktops: usize) -> String {
    (2 * sessions + desktops + 64).max(1000).to_string()
}

fn start_nginx(backend: std::net::SocketAddr, sessions: usize) -> Option<Nginx> {
    let binary = match nginx_binary() {
        Some(binary) => binary,
        None => {
            println!("nginx rows left out: no nginx (apt-get install -y nginx-light)");
            return None;
        }
    };
    // One worker may end up with every connection: both ends of every session.
    match Nginx::start(&binary, backend, 2 * sessions + 512) {
        Ok(nginx) => Some(nginx),
        Err(e) => {
            println!("nginx rows left out: {e}");
            None
        }
    }
}

fn nginx_pids(nginx: &Nginx) -> Vec<u32> {
    let master = nginx.child.id();
    let mut pids = vec![master];
    pids.extend(super::children_of(master));
    pids
}

struct Row {
    name: &'static str,
    runs: Vec<RunResult>,
}

impl Row {
    fn median_of(&self, f: impl Fn(&RunResult) -> Option<f64>) -> Option<f64> {
        let values: Vec<f64> = self.runs.iter().filter_map(f).collect();
        (!values.is_empty()).then(|| median(&values))
    }
}

fn ratio(value: Option<f64>, baseline: Option<f64>) -> String {
    match (value, baseline) {
        (Some(v), Some(b)) if b > 0.0 => format!("{:.2}x", v / b),
        _ => "-".into(),
    }
}

fn or_dash(value: Option<f64>, digits: usize) -> String {
    value.map_or("-".into(), |v| format!("{v:.digits$}"))
}

pub fn sessions_phase(options: &Options) {
    let largest = options.sessions.iter().copied().max().unwrap_or(0);
    let sessions: Vec<usize> = options
        .sessions
        .iter()
        .copied()
        .filter(|&k| fd_limit_allows(k, options.phones_per_desktop))
        .collect();
    if sessions.is_empty() {
        return;
    }
    let ppd = options.phones_per_desktop;
    let engine = Arc::new(Engine::start(options.loadgen_threads));
    let echo = loadgen::start_echo_server(engine.clone());
    let relay = start_relay(
        None,
        &[(
            "ORCA_RELAY_CONNECTION_CAP",
            &relay_cap(largest, largest.div_ceil(ppd)),
        )],
    );
    // Another build of the relay, measured in the same run (`ORCA_RELAY_BENCH_COMPARE`).
    let compared = std::env::var_os("ORCA_RELAY_BENCH_COMPARE").map(|binary| {
        start_relay(
            Some(std::path::Path::new(&binary)),
            &[(
                "ORCA_RELAY_CONNECTION_CAP",
                &relay_cap(largest, largest.div_ceil(ppd)),
            )],
        )
    });
    let nginx = if options.nginx {
        start_nginx(echo, largest)
    } else {
        None
    };
    let mut targets = vec![Target::relay("orca-relay", &relay)];
    if let Some(compared) = &compared {
        targets.push(Target::relay("orca-relay compare", compared));
    }
    if let Some(nginx) = &nginx {
        targets.push(Target {
            name: "nginx tuned (64k)",
            kind: Kind::Nginx,
            addr: nginx.tuned.to_string(),
            pids: nginx_pids(nginx),
            http: None,
        });
    }
    targets.push(Target {
        name: "direct",
        kind: Kind::Direct,
        addr: echo.to_string(),
        pids: Vec::new(),
        http: None,
    });

    println!();
    println!(
        "many sessions: {MESSAGE_BYTES} B round trips in closed loop (phone sends, desktop \
         echoes, phone receives), {} runs x {:.0} s per system and K, systems alternating run \
         by run; relay sessions on ceil(K/{ppd}) desktops ({ppd} phones each); load generator: \
         {} event-loop threads in this process",
        options.session_runs,
        options.session_seconds,
        engine.threads()
    );
    let mut tables: Vec<(usize, Vec<Row>)> = Vec::new();
    for &k in &sessions {
        let started = clock::instant();
        // Each relay target holds its own desktops; the others need none.
        let mut desktops: Vec<Desktops> = targets
            .iter()
            .map(|t| match &t.http {
                Some(http) => open_controls(&t.addr, http, k.div_ceil(ppd), SETUP_THREADS),
                None => Vec::new(),
            })
            .collect();
        // Let the controls' threads park before the baselines are taken.
        clock::sleep(Duration::from_millis(300));
        let baselines: Vec<Footprint> = targets.iter().map(|t| footprint(&t.pids)).collect();
        let mut rows: Vec<Row> = targets
            .iter()
            .map(|t| Row {
                name: t.name,
                runs: Vec::new(),
            })
            .collect();
        for run in 0..options.session_runs {
            for j in 0..targets.len() {
                let i = (run + j) % targets.len();
                let target = &targets[i];
                open_sessions(target, k, &mut desktops[i], ppd, &engine)
                    .unwrap_or_else(|e| panic!("{} K={k}: {e}", target.name));
                let result = measure_run(&engine, target, options.session_seconds);
                close_sessions(&engine, target, baselines[i]);
                println!(
                    "  K={k} run {} {:<18} {:>9.0} rt/s  p50 {:>6.0} µs  p99 {:>6.0} µs  \
                     p999 {:>6.0} µs  loadgen {:.2} cores",
                    run + 1,
                    target.name,
                    result.rate,
                    result.p50,
                    result.p99,
                    result.p999,
                    result.loadgen_cores
                );
                rows[i].runs.push(result);
            }
        }
        drop(desktops);
        println!(
            "  (K={k} took {:.0} s, load average {})",
            started.elapsed().as_secs_f64(),
            super::load_average()
        );
        tables.push((k, rows));
    }
    let retries = super::CONTROL_RETRIES.load(Ordering::Relaxed);
    if retries > 0 {
        let shed = relay
            .metric("orca_relay_upgrades_refused_total{status=\"503\",reason=\"pool_pressure\"}")
            .unwrap_or(0.0);
        println!(
            "  ({retries} control upgrades were answered 503 and retried; the relay counted {shed:.0} \
             refused for pool_pressure)"
        );
    }
    print_sessions_tables(options, &tables);
    drop(nginx);
    drop(compared);
    drop(relay);
}

fn print_sessions_tables(options: &Options, tables: &[(usize, Vec<Row>)]) {
    println!();
    println!(
        "many sessions, medians of {} runs x {:.0} s; a message is one {MESSAGE_BYTES} B frame \
         one way (a round trip is two); CPU and context switches are the middlebox's (relay \
         process; nginx master + workers); RSS and threads held at the end of the run; \
         ratios vs nginx tuned; LG: the load generator (this process's loop threads): cores used, \
         its busiest loop thread's share of a core, CPU seconds per million messages",
        options.session_runs, options.session_seconds
    );
    println!(
        "{:>5} {:<18}{:>10}{:>7}{:>8}{:>8}{:>7}{:>9}{:>10}{:>7}{:>15}{:>9}{:>8}{:>9}{:>8}{:>9}  rt/s per run",
        "K",
        "system",
        "rt/s",
        "ratio",
        "p50 µs",
        "p99 µs",
        "ratio",
        "p999 µs",
        "CPU s/M",
        "ratio",
        "ctx/msg v+i",
        "RSS MiB",
        "threads",
        "LG cores",
        "LG max",
        "LG s/M",
    );
    let mut verdicts = Vec::new();
    let mut paired = Vec::new();
    for (k, rows) in tables {
        let tuned = rows.iter().find(|r| r.name.starts_with("nginx tuned"));
        let base_rate = tuned.and_then(|r| r.median_of(|x| Some(x.rate)));
        let base_p99 = tuned.and_then(|r| r.median_of(|x| Some(x.p99)));
        let base_cpu = tuned.and_then(|r| r.median_of(|x| x.cpu_per_million));
        for row in rows {
            let rate = row.median_of(|x| Some(x.rate));
            let p99 = row.median_of(|x| Some(x.p99));
            let cpu = row.median_of(|x| x.cpu_per_million);
            let voluntary = row.median_of(|x| x.switches.map(|s| s.0));
            let involuntary = row.median_of(|x| x.switches.map(|s| s.1));
            let switches = match (voluntary, involuntary) {
                (Some(v), Some(i)) => format!("{v:.3}+{i:.3}"),
                _ => "-".into(),
            };
            let middlebox = row.runs.iter().any(|x| x.cpu_per_million.is_some());
            let rss = middlebox
                .then(|| row.median_of(|x| Some(x.rss_kib as f64 / 1024.0)))
                .flatten();
            let threads = middlebox
                .then(|| row.median_of(|x| Some(x.threads as f64)))
                .flatten();
            let per_run: Vec<String> = row.runs.iter().map(|x| format!("{:.0}", x.rate)).collect();
            println!(
                "{:>5} {:<18}{:>10}{:>7}{:>8}{:>8}{:>7}{:>9}{:>10}{:>7}{:>15}{:>9}{:>8}{:>9}{:>8}{:>9}  {}",
                k,
                row.name,
                or_dash(rate, 0),
                ratio(rate, base_rate),
                or_dash(row.median_of(|x| Some(x.p50)), 0),
                or_dash(p99, 0),
                ratio(p99, base_p99),
                or_dash(row.median_of(|x| Some(x.p999)), 0),
                or_dash(cpu, 2),
                ratio(cpu, base_cpu),
                switches,
                or_dash(rss, 1),
                or_dash(threads, 0),
                or_dash(row.median_of(|x| Some(x.loadgen_cores)), 2),
                row.median_of(|x| Some(x.loadgen_busiest))
                    .map_or("-".into(), |b| format!("{:.0}%", b * 100.0)),
                or_dash(row.median_of(|x| Some(x.loadgen_per_million)), 2),
                per_run.join(" ")
            );
            let churn: Vec<&str> = row
                .runs
                .iter()
                .flat_map(|x| x.churn.iter().map(String::as_str))
                .collect();
            if !churn.is_empty() {
                println!(
                    "      ({} middlebox threads started (+) or ended (-) during {}'s runs, their \
                     in-run context switches partly missing: {})",
                    churn.len(),
                    row.name,
                    churn.join(" ")
                );
            }
            if row.name == "orca-relay" {
                if let (Some(rate), Some(base)) = (rate, base_rate) {
                    verdicts.push((*k, "round trips/s >= 1.0x nginx", rate / base, rate >= base));
                }
                if let (Some(cpu), Some(base)) = (cpu, base_cpu) {
                    verdicts.push((*k, "CPU per message <= 1.0x nginx", cpu / base, cpu <= base));
                }
                if let (Some(p99), Some(base)) = (p99, base_p99) {
                    verdicts.push((*k, "p99 <= 1.0x nginx", p99 / base, p99 <= base));
                }
            }
        }
        if let Some(tuned) = tuned {
            for row in rows.iter().filter(|r| r.name.starts_with("orca-relay")) {
                paired.push((*k, row.name, paired_ratios(row, tuned)));
            }
        }
    }
    println!();
    for (k, target, value, pass) in verdicts {
        target_line(&format!("K={k} {target}"), format!("{value:.2}x"), pass);
    }
    print_paired(&paired);
}

/// One relay row's paired ratios at one K: (K, row name, (round trips/s, CPU per message)).
type Paired<'a> = (usize, &'a str, (Vec<f64>, Vec<f64>));

/// Per run, a relay row's value over nginx tuned's in the same run (the systems of a run are
/// measured back to back, so a drift of the machine between runs cancels out): round trips/s
/// and CPU per message.
fn paired_ratios(row: &Row, tuned: &Row) -> (Vec<f64>, Vec<f64>) {
    let pairs = row.runs.iter().zip(&tuned.runs);
    let rates = pairs.clone().map(|(r, t)| r.rate / t.rate).collect();
    let cpus = pairs
        .filter_map(|(r, t)| Some(r.cpu_per_million? / t.cpu_per_million?))
        .collect();
    (rates, cpus)
}

/// The paired ratios' medians with a distribution-free 95 % interval: an interval that holds
/// 1.0 is parity within this run's noise, whichever side the median fell.
fn print_paired(paired: &[Paired<'_>]) {
    if paired.is_empty() {
        return;
    }
    println!();
    println!(
        "paired by run (each run's ratio to nginx tuned in the same run), median and its 95 % \
         interval (order statistics; fewer than 6 runs cover less, as shown):"
    );
    for (k, name, (rates, cpus)) in paired {
        let describe = |values: &[f64]| match super::median_interval(values, 0.95) {
            Some((low, high, coverage)) => format!(
                "{:.2}x [{low:.2}, {high:.2}] ({:.1} %)",
                median(values),
                coverage * 100.0
            ),
            None => "-".into(),
        };
        println!(
            "  K={k:<5} {name:<19} rt/s {:<30} CPU per message {:<30} {} runs",
            describe(rates),
            describe(cpus),
            rates.len()
        );
    }
}

// ---------------------------------------------------------------------------------------------
// The paired-session memory row.

/// RSS and threads per idle paired session: `pairs` sessions each carry one 64 KiB frame each
/// way, then sit idle; the growth over the middlebox's footprint before the sessions (one
/// session was opened and closed before, so first-use allocations are not counted), divided by
/// `pairs`. Returns (KiB per session, threads per session).
fn idle_pair_cost(
    engine: &Arc<Engine>,
    target: &Target,
    desktops: &mut Desktops,
    pairs: usize,
    phones_per_desktop: usize,
) -> (f64, f64) {
    let empty = footprint(&target.pids);
    open_sessions(target, 1, desktops, phones_per_desktop, engine)
        .unwrap_or_else(|e| panic!("{} warm-up: {e}", target.name));
    round_trips_everywhere(engine, MEMORY_FRAME_BYTES, 1, target.name);
    close_sessions(engine, target, empty);
    clock::sleep(Duration::from_millis(500));
    let before = footprint(&target.pids);
    open_sessions(target, pairs, desktops, phones_per_desktop, engine)
        .unwrap_or_else(|e| panic!("{} pairs: {e}", target.name));
    round_trips_everywhere(engine, MEMORY_FRAME_BYTES, 1, target.name);
    // Idle: the legs' threads park, nothing is in flight.
    clock::sleep(Duration::from_secs(2));
    let after = footprint(&target.pids);
    close_sessions(engine, target, before);
    let per = |a: u64, b: u64| (a as f64 - b as f64) / pairs as f64;
    (
        per(after.rss_kib, before.rss_kib),
        per(after.threads, before.threads),
    )
}

pub fn memory_phase(options: &Options) {
    let pairs = options.memory_pairs;
    let ppd = options.phones_per_desktop;
    if !fd_limit_allows(pairs, ppd) {
        return;
    }
    let engine = Arc::new(Engine::start(options.loadgen_threads));
    let echo = loadgen::start_echo_server(engine.clone());
    let mut relay_runs = Vec::new();
    let mut nginx_runs = Vec::new();
    for run in 0..options.session_runs {
        // A fresh middlebox per run: freed memory is not always given back to the system.
        let mut order = vec![Kind::Relay, Kind::Nginx];
        if run % 2 == 1 {
            order.reverse();
        }
        for kind in order {
            match kind {
                Kind::Relay => {
                    let relay = start_relay(
                        None,
                        &[(
                            "ORCA_RELAY_CONNECTION_CAP",
                            &relay_cap(pairs, pairs.div_ceil(ppd)),
                        )],
                    );
                    let mut desktops =
                        open_controls(&relay.ws, &relay.http, pairs.div_ceil(ppd), SETUP_THREADS);
                    clock::sleep(Duration::from_millis(300));
                    let target = Target::relay("orca-relay", &relay);
                    relay_runs.push(idle_pair_cost(&engine, &target, &mut desktops, pairs, ppd));
                }
                Kind::Nginx => {
                    if !options.nginx {
                        continue;
                    }
                    let Some(nginx) = start_nginx(echo, pairs) else {
                        continue;
                    };
                    let target = Target {
                        name: "nginx tuned (64k)",
                        kind: Kind::Nginx,
                        addr: nginx.tuned.to_string(),
                        pids: nginx_pids(&nginx),
                        http: None,
                    };
                    nginx_runs.push(idle_pair_cost(
                        &engine,
                        &target,
                        &mut Vec::new(),
                        pairs,
                        ppd,
                    ));
                }
                Kind::Direct => {}
            }
        }
    }
    let summary = |runs: &[(f64, f64)]| {
        (!runs.is_empty()).then(|| {
            (
                median(&runs.iter().map(|r| r.0).collect::<Vec<_>>()),
                median(&runs.iter().map(|r| r.1).collect::<Vec<_>>()),
                runs.iter()
                    .map(|r| format!("{:.0}", r.0))
                    .collect::<Vec<_>>()
                    .join(" "),
            )
        })
    };
    println!();
    println!(
        "paired-session memory: one {} KiB frame each way per session, then idle; growth of the \
         middlebox's RSS (relay process; nginx master + workers) over its footprint before the \
         sessions; medians of {} runs, a fresh middlebox per run",
        MEMORY_FRAME_BYTES / 1024,
        options.session_runs
    );
    println!(
        "{:<56}{:>22}{:>17}{:>8}  KiB per run",
        "system", "RSS KiB/idle session", "threads/session", "ratio"
    );
    let relay = summary(&relay_runs);
    let nginx = summary(&nginx_runs);
    let base = nginx.as_ref().map(|n| n.0);
    for (name, row) in [
        (format!("orca-relay ({pairs} pairs)"), &relay),
        (
            format!("nginx proxy_buffer_size 64k; proxy_buffers 8 64k ({pairs})"),
            &nginx,
        ),
    ] {
        if let Some((rss, threads, runs)) = row {
            println!(
                "{:<56}{:>22.0}{:>17.2}{:>8}  {}",
                name,
                rss,
                threads,
                ratio(Some(*rss), base),
                runs
            );
        }
    }
    if let (Some((rss, _, _)), Some(base)) = (&relay, base) {
        println!();
        target_line(
            "RSS per idle paired session <= 0.5x nginx",
            format!("{:.2}x", rss / base),
            *rss <= 0.5 * base,
        );
    }
}
