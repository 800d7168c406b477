//! The relay-core benchmark (issues 2 and 12): orca-relay's splice against nginx as a WebSocket
//! reverse proxy, for one bulk stream and for thousands of small-message sessions, and what an
//! idle desktop control socket and an idle paired session cost the relay.
//!
//! Usage:
//!
//! ```text
//! cargo build --release                      # the bench runs target/release/orca-relay
//! cargo bench --bench relay                  # the full run, about 10 minutes
//! cargo bench --bench relay -- --quick       # a smoke run, about a minute
//! cargo bench --bench relay -- --runs 7 --seconds 3 --idle 2000,5000,10000
//! cargo bench --bench relay -- --only sessions,memory                  # issue 12's table
//! cargo bench --bench relay -- --only sessions --sessions 100,1000,4000 --session-runs 5
//! ```
//!
//! Flags (after `--`):
//! - `--quick`: 3 runs of 1 s, 1,500 round trips, idle controls 500,1000,2000.
//! - `--runs N` (5): throughput runs per system; systems alternate run by run.
//! - `--seconds S` (2): seconds of sending per throughput run.
//! - `--round-trips N` (5000): 64-byte round trips per system, split over the runs; within a
//!   run the systems alternate in batches of 100; p50 and p99 are per run, then the median.
//! - `--idle N,N,…` (2000,5000,10000): idle control sockets held at each step (cumulative).
//! - `--sessions N,N,…` (100,1000,4000): the many-sessions mode's K values.
//! - `--session-seconds S` (10), `--session-runs N` (3): per system and K, one run is S seconds;
//!   N runs with the systems alternating run by run; the table shows medians. The memory row
//!   takes N runs too.
//! - `--phones-per-desktop N` (8, the relay's most): relay sessions share ceil(K/N) desktops.
//! - `--loadgen-threads N` (2): the load generator's event-loop threads.
//! - `--memory-pairs N` (500): sessions in the paired-session memory row.
//! - `--only MODE,…`: run only these modes: `splice` (throughput and 64 B RTT), `idle`,
//!   `sessions`, `memory`.
//! - `--skip-nginx`, `--skip-splice`, `--skip-idle`, `--skip-sessions`, `--skip-memory`: leave
//!   a part out. `--quick` also shrinks the new modes: K 100,1000, 1 run of 2 s, 100 pairs.
//!
//! Environment: `ORCA_RELAY_BENCH_NGINX` names the nginx binary (default: `nginx` on `PATH`,
//! then `/usr/sbin/nginx`). `ORCA_RELAY_BENCH_RELAY_ENV="NAME=value;NAME=value"` adds variables
//! to the relay processes' environment (for experiments, e.g. `GLIBC_TUNABLES=…`).
//! `ORCA_RELAY_BENCH_COMPARE=/path/to/another/orca-relay` adds a row for that build in the
//! splice and many-sessions modes (copy the binary aside before a change, then compare both in
//! one run: the fair way to measure a change). Without nginx the nginx rows are left out;
//! install it with
//! `apt-get install -y nginx-light`. nginx runs as a foreground child with a generated config
//! in a temporary prefix (`nginx -p <prefix> -c <conf> -g 'daemon off;'`), never as the system
//! service, and is stopped at the end.
//!
//! What it measures, in one run:
//! 1. Throughput of 64 KiB binary frames phone → desktop (MB/s, median of the runs) through
//!    (a) orca-relay (combined role on SQLite in a temporary data dir; a desktop with a control
//!    socket and a data leg, a phone spliced to it), (b) nginx as an operator would tune it for
//!    WebSocket (`proxy_buffering off`, `proxy_buffer_size 64k`, `worker_processes 2`),
//!    (c) nginx with its default proxy buffers (only the WebSocket headers added), (d) a direct
//!    connection to the bench's own desktop server. The phone and desktop run the same code
//!    everywhere: the phone sends for `--seconds`, then `end`; the desktop counts bytes from
//!    the first frame to `end` and answers with the count and the elapsed time.
//!    The proxy's CPU seconds per GB carried (user + system time of the relay process or the
//!    nginx workers during the runs) is shown too: it is much less sensitive to other load on
//!    the machine than MB/s.
//! 2. 64-byte round trips (phone sends, desktop echoes, phone receives): p50 and p99 in µs
//!    (each the median over the runs of that run's percentile).
//! 3. Idle control sockets: a relay with `ORCA_RELAY_CONNECTION_CAP=12000` holds N desktops
//!    (each assigned through `/v1/assign`, then control upgrade, hello, ack); the table shows
//!    the relay's RSS growth over its baseline per socket, its threads, descriptors and maps.
//!    The client side holds the sockets in this process (a few threads, no reads) with its
//!    descriptor limit raised.
//! 4. Many sessions (`benches/relay/sessions.rs`): K sessions, each a phone and its desktop's
//!    echoing end, exchange 256-byte binary messages in closed loop (the phone sends, the
//!    desktop echoes, the phone receives and sends the next) for `--session-seconds`, through
//!    orca-relay (a fresh combined role with `ORCA_RELAY_CONNECTION_CAP` raised to hold 2K legs
//!    plus the desktops; ceil(K/8) desktops each assigned, upgraded and acked, then per session
//!    an invite on the control, the phone's relay-auth, the conn-open, the data leg's
//!    host-data-auth and the phone's relay-hello), nginx tuned (as in 1, `worker_connections`
//!    raised to 2K+512) to the bench's echo server, and directly to that echo server. Each run
//!    sets up K fresh sessions on one system, checks that every session answers, measures, then
//!    closes them and waits until the middlebox is back to its descriptors and threads; the
//!    systems alternate run by run. The first tenth of a run (at most 1 s) is not counted.
//!    Per system and K (medians over runs): round trips/s; p50, p99, p999 of the round trips
//!    in the run; the middlebox's CPU seconds per million messages (a message is one frame one
//!    way, a round trip two; user + system from `/proc/<pid>/stat`, whose process totals include
//!    threads that have exited; nginx: master and workers); voluntary + involuntary context
//!    switches per message (see below); the middlebox's RSS and threads at the end of the run;
//!    the load generator's CPU (cores on average, CPU seconds per million messages, and its
//!    busiest thread's share of a core, so it can be seen not to be the bottleneck).
//!    Context switches: Linux publishes no per-process total (`/proc/<pid>/status` counts only
//!    the leader thread; exited threads' counts reach only the process's own `getrusage`), so
//!    every thread's `/proc/<pid>/task/<tid>/status` is read before and after the run and the
//!    deltas summed; threads that start or end during a run are counted and reported (their
//!    in-run switches would be partly missing). No session starts or ends during a run, so
//!    normally none do.
//!    The load generator (`benches/relay/loadgen.rs`) is this one process for every system: a
//!    few `mio` event-loop threads (`--loadgen-threads`) drive both ends of every session with
//!    their own WebSocket handshake and framing (client frames masked); set-up uses four
//!    blocking threads before the clock starts.
//!    Reading it on a 2-core machine: the middlebox and the load generator share the cores, so
//!    a run is CPU-bound and round trips/s follow the CPU per message of both (a middlebox that
//!    hands over messages one at a time also costs the load generator more per message: the
//!    `LG s/M` column). p99 at small K depends on how the load generator's loop threads and the
//!    middlebox's threads share the two cores: at K=100, nginx's two workers plus two loop
//!    threads gave p50 0.13 ms but p99 9 ms; with `--loadgen-threads 1`, p99 3.5 ms (the relay's
//!    p99 ratio went from 0.4x to 1.3x, the throughput and CPU ratios stayed put). Compare p99
//!    under both settings.
//! 5. Paired-session memory: N sessions (`--memory-pairs`) each carry one 64 KiB frame each way,
//!    then sit idle 2 s; the growth of the middlebox's RSS and threads over its footprint before
//!    the sessions (after one warm-up session was opened and closed), per session: orca-relay
//!    (a phone leg and a data leg per session; desktops as in 4) against nginx with
//!    `proxy_buffer_size 64k; proxy_buffers 8 64k` (a client and an upstream connection per
//!    WebSocket). A fresh middlebox per run.
//!
//! Targets (the PASS/FAIL column): throughput ≥ 1.0× nginx tuned; 64 B p99 ≤ 1.0× nginx tuned;
//! ≤ 24 KiB RSS per idle control at the largest N; one descriptor per socket. Issue 12's targets
//! for the data-plane rewrite: at every K, round trips/s ≥ 1.0× nginx tuned, CPU per message
//! ≤ 1.0×, p99 ≤ 1.0×; RSS per idle paired session ≤ 0.5× nginx.
//!
//! The machine is usually shared: absolute numbers are noisy, ratios are fairer because the
//! systems alternate run by run. The load average before and after is printed. The many-sessions
//! mode also pairs each relay run with nginx tuned's run of the same round and prints the
//! median of those per-run ratios with a distribution-free 95 % interval (order statistics of
//! the runs; 6 runs or more reach 95 %; 12 gave intervals about 0.1 wide at K=100 on the 2-core
//! machine): an interval that holds 1.0 means this run cannot tell the two apart, whichever
//! side its median fell on.

#[path = "../tests/harness/mod.rs"]
mod harness;
#[path = "relay/loadgen.rs"]
mod loadgen;
#[path = "relay/sessions.rs"]
mod sessions;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use tungstenite::client::IntoClientRequest;
use tungstenite::protocol::WebSocketConfig;
use tungstenite::{Bytes, Message, WebSocket};

use harness::{Relay, TempDir, Ws};
use orca_relay::clock;

const FRAME_BYTES: usize = 64 * 1024;
const SMALL_BYTES: usize = 64;
/// Round trips per system before the next system's turn.
const RTT_BATCH: usize = 100;
const RSS_TARGET_KIB: f64 = 24.0;
/// Timings that keep the relay quiet while sockets sit idle for the whole bench: no pings, no
/// silence closes, no lease renewals.
const QUIET_ENV: [(&str, &str); 4] = [
    ("ORCA_RELAY_PING_MS", "86400000"),
    ("ORCA_RELAY_SILENCE_MS", "86400000"),
    ("ORCA_RELAY_LEASE_RENEW_MS", "86400000"),
    ("ORCA_RELAY_LEASE_TTL_MS", "86400000"),
];

/// Starts the combined role with [`QUIET_ENV`], `env`, and whatever
/// `ORCA_RELAY_BENCH_RELAY_ENV` adds (`NAME=value;NAME=value`).
fn start_relay(binary: Option<&Path>, env: &[(&str, &str)]) -> Relay {
    let extra = std::env::var("ORCA_RELAY_BENCH_RELAY_ENV").unwrap_or_default();
    let extra: Vec<(&str, &str)> = extra
        .split(';')
        .filter_map(|pair| pair.split_once('='))
        .collect();
    let all: Vec<(&str, &str)> = QUIET_ENV.iter().chain(env).chain(&extra).copied().collect();
    match binary {
        Some(binary) => Relay::start_binary(binary, Arc::new(TempDir::new("bench-relay")), &all),
        None => Relay::combined(&all),
    }
}

struct Options {
    runs: usize,
    seconds: f64,
    round_trips: usize,
    idle: Vec<usize>,
    nginx: bool,
    splice: bool,
    idle_phase: bool,
    sessions_phase: bool,
    memory_phase: bool,
    sessions: Vec<usize>,
    session_seconds: f64,
    session_runs: usize,
    phones_per_desktop: usize,
    loadgen_threads: usize,
    memory_pairs: usize,
}

/// The modes `--only` can name.
const MODES: [&str; 4] = ["splice", "idle", "sessions", "memory"];

impl Options {
    fn parse() -> Result<Options, String> {
        let mut options = Options {
            runs: 5,
            seconds: 2.0,
            round_trips: 5000,
            idle: vec![2000, 5000, 10000],
            nginx: true,
            splice: true,
            idle_phase: true,
            sessions_phase: true,
            memory_phase: true,
            sessions: vec![100, 1000, 4000],
            session_seconds: 10.0,
            session_runs: 3,
            phones_per_desktop: orca_relay::protocol::MAX_PHONES_PER_HOST,
            loadgen_threads: 2,
            memory_pairs: 500,
        };
        let mut args = std::env::args().skip(1);
        while let Some(arg) = args.next() {
            let mut value = |name: &str| args.next().ok_or_else(|| format!("{name} needs a value"));
            match arg.as_str() {
                // cargo bench passes --bench to harness = false targets.
                "--bench" => {}
                "--quick" => {
                    options.runs = 3;
                    options.seconds = 1.0;
                    options.round_trips = 1500;
                    options.idle = vec![500, 1000, 2000];
                    options.sessions = vec![100, 1000];
                    options.session_seconds = 2.0;
                    options.session_runs = 1;
                    options.memory_pairs = 100;
                }
                "--runs" => options.runs = parse_number(&value("--runs")?, "--runs")?,
                "--seconds" => options.seconds = parse_number(&value("--seconds")?, "--seconds")?,
                "--round-trips" => {
                    options.round_trips = parse_number(&value("--round-trips")?, "--round-trips")?
                }
                "--idle" => {
                    options.idle = value("--idle")?
                        .split(',')
                        .map(|n| parse_number(n, "--idle"))
                        .collect::<Result<_, _>>()?
                }
                "--sessions" => {
                    options.sessions = value("--sessions")?
                        .split(',')
                        .map(|n| parse_number(n, "--sessions"))
                        .collect::<Result<_, _>>()?
                }
                "--session-seconds" => {
                    options.session_seconds =
                        parse_number(&value("--session-seconds")?, "--session-seconds")?
                }
                "--session-runs" => {
                    options.session_runs =
                        parse_number(&value("--session-runs")?, "--session-runs")?
                }
                "--phones-per-desktop" => {
                    options.phones_per_desktop =
                        parse_number(&value("--phones-per-desktop")?, "--phones-per-desktop")?
                }
                "--loadgen-threads" => {
                    options.loadgen_threads =
                        parse_number(&value("--loadgen-threads")?, "--loadgen-threads")?
                }
                "--memory-pairs" => {
                    options.memory_pairs =
                        parse_number(&value("--memory-pairs")?, "--memory-pairs")?
                }
                "--only" => {
                    let list = value("--only")?;
                    let modes: Vec<&str> = list.split(',').map(str::trim).collect();
                    if let Some(bad) = modes.iter().find(|m| !MODES.contains(m)) {
                        return Err(format!("--only: unknown mode {bad} (one of {MODES:?})"));
                    }
                    options.splice = modes.contains(&"splice");
                    options.idle_phase = modes.contains(&"idle");
                    options.sessions_phase = modes.contains(&"sessions");
                    options.memory_phase = modes.contains(&"memory");
                }
                "--skip-nginx" => options.nginx = false,
                "--skip-splice" => options.splice = false,
                "--skip-idle" => options.idle_phase = false,
                "--skip-sessions" => options.sessions_phase = false,
                "--skip-memory" => options.memory_phase = false,
                other => return Err(format!("unknown argument {other} (see benches/relay.rs)")),
            }
        }
        if options.runs == 0 || options.seconds <= 0.0 || options.round_trips == 0 {
            return Err("--runs, --seconds and --round-trips must be positive".into());
        }
        if options.session_runs == 0
            || options.session_seconds <= 0.0
            || options.loadgen_threads == 0
            || options.memory_pairs == 0
            || options.sessions.contains(&0)
        {
            return Err(
                "--session-runs, --session-seconds, --loadgen-threads, --memory-pairs \
                        and every --sessions value must be positive"
                    .into(),
            );
        }
        if !(1..=orca_relay::protocol::MAX_PHONES_PER_HOST).contains(&options.phones_per_desktop) {
            return Err(format!(
                "--phones-per-desktop must be 1 to {}",
                orca_relay::protocol::MAX_PHONES_PER_HOST
            ));
        }
        options.idle.sort_unstable();
        Ok(options)
    }
}

fn parse_number<T: std::str::FromStr>(value: &str, name: &str) -> Result<T, String> {
    value
        .trim()
        .parse()
        .map_err(|_| format!("{name}: not a number: {value}"))
}

fn main() {
    let options = match Options::parse() {
        Ok(options) => options,
        Err(e) => {
            eprintln!("relay bench: {e}");
            std::process::exit(2);
        }
    };
    let binary = Path::new(env!("CARGO_BIN_EXE_orca-relay"));
    if !binary.exists() {
        eprintln!(
            "relay bench: {} is missing; build it first with `cargo build --release`",
            binary.display()
        );
        std::process::exit(2);
    }
    let started = clock::instant();
    println!("orca-relay relay-core bench: {}", binary.display());
    println!("load average before: {}", load_average());
    if options.splice {
        splice_phase(&options);
    }
    if options.idle_phase {
        idle_phase(&options);
    }
    if options.sessions_phase {
        sessions::sessions_phase(&options);
    }
    if options.memory_phase {
        sessions::memory_phase(&options);
    }
    println!("load average after: {}", load_average());
    println!("bench took {:.0} s", started.elapsed().as_secs_f64());
}

fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "unknown".into())
}

// ---------------------------------------------------------------------------------------------
// The desktop side: the same loop behind the relay's data leg and in the bench's own server.

/// Serves one desktop connection: echoes binary frames back; between a `sink` text and an
/// `end` text it counts binary bytes instead and then answers `"<bytes> <nanoseconds>"`, the
/// time from the first counted frame to `end`.
fn serve_desktop<S: Read + Write>(mut ws: WebSocket<S>) {
    let mut sinking = false;
    let mut bytes = 0u64;
    let mut first: Option<std::time::Instant> = None;
    loop {
        let message = match ws.read() {
            Ok(message) => message,
            Err(_) => return,
        };
        match message {
            Message::Binary(payload) if sinking => {
                first.get_or_insert_with(clock::instant);
                bytes += payload.len() as u64;
            }
            Message::Binary(payload) => {
                let Ok(()) = ws.send(Message::Binary(payload)) else {
                    return;
                };
            }
            Message::Text(text) if text.as_str() == "sink" => {
                sinking = true;
                bytes = 0;
                first = None;
            }
            Message::Text(text) if text.as_str() == "end" => {
                sinking = false;
                let nanos = first.map_or(0, |t| t.elapsed().as_nanos());
                if ws.send(Message::text(format!("{bytes} {nanos}"))).is_err() {
                    return;
                }
            }
            Message::Close(_) => return,
            _ => {}
        }
    }
}

/// The bench's desktop server: a WebSocket server, one thread per connection.
struct DesktopServer {
    addr: SocketAddr,
}

impl DesktopServer {
    fn start() -> DesktopServer {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind the desktop server");
        let addr = listener.local_addr().expect("desktop server address");
        orca_relay::threads::spawn("bench-desktop-acceptor", move || {
            for stream in listener.incoming() {
                let Ok(stream) = stream else { continue };
                let _ = stream.set_nodelay(true);
                let _ = orca_relay::threads::spawn("bench-desktop", move || {
                    if let Ok(ws) = tungstenite::accept(stream) {
                        serve_desktop(ws);
                    }
                });
            }
        })
        .expect("spawn the desktop server");
        DesktopServer { addr }
    }
}

// ---------------------------------------------------------------------------------------------
// nginx as a foreground child.

struct Nginx {
    child: Child,
    tuned: SocketAddr,
    default: SocketAddr,
    _prefix: TempDir,
}

fn nginx_binary() -> Option<PathBuf> {
    if let Some(path) = std::env::var_os("ORCA_RELAY_BENCH_NGINX") {
        return Some(PathBuf::from(path));
    }
    let on_path = std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|dir| dir.join("nginx"))
            .find(|candidate| candidate.is_file())
    });
    on_path.or_else(|| {
        let sbin = PathBuf::from("/usr/sbin/nginx");
        sbin.is_file().then_some(sbin)
    })
}

fn free_port() -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind a free port");
    listener.local_addr().expect("free port address")
}

fn nginx_config(
    prefix: &Path,
    backend: SocketAddr,
    tuned: SocketAddr,
    default: SocketAddr,
    worker_connections: usize,
) -> String {
    let p = prefix.display();
    // The WebSocket headers every proxy needs; timeouts long enough for the whole bench (they
    // are not buffering settings).
    let websocket = "proxy_pass http://desktop;
            proxy_http_version 1.1;
            proxy_set_header Upgrade $http_upgrade;
            proxy_set_header Connection \"upgrade\";
            proxy_read_timeout 1h;
            proxy_send_timeout 1h;";
    format!(
        "worker_processes 2;
pid {p}/nginx.pid;
error_log {p}/error.log warn;
events {{ worker_connections {worker_connections}; }}
http {{
    access_log off;
    client_body_temp_path {p}/tmp/body;
    proxy_temp_path {p}/tmp/proxy;
    fastcgi_temp_path {p}/tmp/fastcgi;
    uwsgi_temp_path {p}/tmp/uwsgi;
    scgi_temp_path {p}/tmp/scgi;
    upstream desktop {{ server {backend}; }}
    # nginx tuned for WebSocket, as an operator would: 64 KiB proxy buffers, no buffering.
    # (nginx refuses proxy_buffer_size 64k unless proxy_buffers also hold more than 2 x 64k.)
    server {{
        listen {tuned};
        location / {{
            {websocket}
            proxy_buffering off;
            proxy_buffer_size 64k;
            proxy_buffers 8 64k;
        }}
    }}
    # nginx defaults: only the WebSocket headers.
    server {{
        listen {default};
        location / {{
            {websocket}
        }}
    }}
}}
"
    )
}

impl Nginx {
    /// Starts nginx proxying to `backend`; each worker holds up to `worker_connections`
    /// connections (both ends of a proxied WebSocket count).
    fn start(
        binary: &Path,
        backend: SocketAddr,
        worker_connections: usize,
    ) -> Result<Nginx, String> {
        let prefix = TempDir::new("bench-nginx");
        std::fs::create_dir_all(prefix.0.join("tmp"))
            .map_err(|e| format!("cannot create the nginx prefix: {e}"))?;
        let (tuned, default) = (free_port(), free_port());
        let conf = prefix.0.join("nginx.conf");
        let config = nginx_config(&prefix.0, backend, tuned, default, worker_connections);
        std::fs::write(&conf, config)
            .map_err(|e| format!("cannot write {}: {e}", conf.display()))?;
        let child = Command::new(binary)
            .arg("-p")
            .arg(&prefix.0)
            .arg("-c")
            .arg(&conf)
            .arg("-e")
            .arg(prefix.0.join("error.log"))
            .args(["-g", "daemon off;"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| format!("cannot start {}: {e}", binary.display()))?;
        let mut nginx = Nginx {
            child,
            tuned,
            default,
            _prefix: prefix,
        };
        // Listening comes before the master forks its workers: wait for both, or a caller that
        // takes the workers' pids (to count their CPU) finds none.
        let master = nginx.child.id();
        let up = harness::wait_until(Duration::from_secs(10), || {
            TcpStream::connect(tuned).is_ok()
                && TcpStream::connect(default).is_ok()
                && children_of(master).len() >= 2
        });
        if !up {
            let mut stderr = String::new();
            if let Some(mut pipe) = nginx.child.stderr.take() {
                let _ = nginx.child.kill();
                let _ = pipe.read_to_string(&mut stderr);
            }
            return Err(format!("nginx did not start listening: {}", stderr.trim()));
        }
        Ok(nginx)
    }
}

impl Drop for Nginx {
    fn drop(&mut self) {
        // SIGTERM lets the master stop its workers (SIGKILL would orphan them).
        // SAFETY: kill(2) on our own child's pid, no memory involved.
        unsafe {
            libc::kill(self.child.id() as libc::pid_t, libc::SIGTERM);
        }
        let stopped = harness::wait_until(Duration::from_secs(5), || {
            matches!(self.child.try_wait(), Ok(Some(_)))
        });
        if !stopped {
            let _ = self.child.kill();
        }
        let _ = self.child.wait();
    }
}

// ---------------------------------------------------------------------------------------------
// Phase 1 and 2: throughput and round trips.

/// One system under test: the phone's socket, whose far end is a desktop running
/// [`serve_desktop`].
struct System {
    name: &'static str,
    phone: Ws,
    /// The proxy's processes, whose CPU time a throughput run costs (none for direct).
    proxy: Vec<u32>,
}

/// User + system CPU time of `pids` (all threads), in seconds.
fn cpu_seconds(pids: &[u32]) -> f64 {
    // SAFETY: sysconf has no preconditions.
    let ticks_per_second = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    let ticks: u64 = pids
        .iter()
        .filter_map(|pid| std::fs::read_to_string(format!("/proc/{pid}/stat")).ok())
        .filter_map(|stat| {
            // Fields after the command name: state is [0], utime [11], stime [12].
            let rest = &stat[stat.rfind(')')? + 1..];
            let fields: Vec<&str> = rest.split_whitespace().collect();
            Some(fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?)
        })
        .sum();
    ticks as f64 / ticks_per_second
}

/// The worker processes of the nginx master `pid`.
fn children_of(pid: u32) -> Vec<u32> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.filter_map(|entry| entry.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|child| {
            std::fs::read_to_string(format!("/proc/{child}/stat"))
                .ok()
                .and_then(|stat| {
                    let rest = &stat[stat.rfind(')')? + 1..];
                    rest.split_whitespace().nth(1)?.parse::<u32>().ok()
                })
                == Some(pid)
        })
        .collect()
}

fn tune_client(ws: &Ws) {
    let stream: &std::net::TcpStream = ws.get_ref();
    let _ = stream.set_nodelay(true);
    let _ = stream.set_read_timeout(Some(Duration::from_secs(30)));
}

fn phone_to(url: &str) -> Ws {
    let ws = harness::ws_connect(url, None).unwrap_or_else(|status| panic!("{url}: {status}"));
    tune_client(&ws);
    ws
}

/// Sends 64 KiB frames for `seconds`, then `end`; returns the desktop's MB/s and byte count.
fn throughput_run(phone: &mut Ws, seconds: f64) -> (f64, f64) {
    let payload = Bytes::from(vec![0x5a; FRAME_BYTES]);
    phone.send(Message::text("sink")).expect("send sink");
    let window = Duration::from_secs_f64(seconds);
    let started = clock::instant();
    while started.elapsed() < window {
        phone
            .send(Message::Binary(payload.clone()))
            .expect("send a frame");
    }
    phone.send(Message::text("end")).expect("send end");
    loop {
        match phone.read().expect("read the desktop's count") {
            Message::Text(text) => {
                let mut parts = text.split_whitespace();
                let bytes: f64 = parts.next().and_then(|b| b.parse().ok()).unwrap_or(0.0);
                let nanos: f64 = parts.next().and_then(|n| n.parse().ok()).unwrap_or(0.0);
                let mbps = if nanos > 0.0 {
                    bytes / (nanos / 1e9) / 1e6
                } else {
                    0.0
                };
                return (mbps, bytes);
            }
            Message::Close(frame) => panic!("closed during a throughput run: {frame:?}"),
            _ => {}
        }
    }
}

/// `count` 64-byte round trips; returns each in µs.
fn round_trips(phone: &mut Ws, count: usize) -> Vec<f64> {
    let payload = Bytes::from(vec![0xa5; SMALL_BYTES]);
    let mut samples = Vec::with_capacity(count);
    for _ in 0..count {
        let started = clock::instant();
        phone
            .send(Message::Binary(payload.clone()))
            .expect("send a small frame");
        loop {
            match phone.read().expect("read the echo") {
                Message::Binary(echo) => {
                    assert_eq!(echo.len(), SMALL_BYTES);
                    break;
                }
                Message::Close(frame) => panic!("closed during round trips: {frame:?}"),
                _ => {}
            }
        }
        samples.push(started.elapsed().as_secs_f64() * 1e6);
    }
    samples
}

fn median(values: &[f64]) -> f64 {
    percentile(values, 50.0)
}

/// A distribution-free interval for the median of `values` (independent runs): the order
/// statistics k and n+1-k, for the largest k whose coverage (one minus twice the chance that a
/// Binomial(n, 1/2) is below k) is still at least `level`. Returns (low, high, coverage);
/// with few values the widest interval, min to max, covers less than `level` (5 values:
/// 93.75 %), and its coverage says so. `None` for fewer than 2 values.
fn median_interval(values: &[f64], level: f64) -> Option<(f64, f64, f64)> {
    let n = values.len();
    if n < 2 {
        return None;
    }
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    // below[j] = P(Binomial(n, 1/2) <= j).
    let mut below = Vec::with_capacity(n);
    let mut term = 0.5f64.powi(n as i32);
    let mut sum = 0.0;
    for j in 0..n {
        sum += term;
        below.push(sum);
        term *= (n - j) as f64 / (j + 1) as f64;
    }
    let coverage = |k: usize| 1.0 - 2.0 * below[k - 1];
    let mut k = 1;
    while k < n / 2 && coverage(k + 1) >= level {
        k += 1;
    }
    Some((sorted[k - 1], sorted[n - k], coverage(k)))
}

fn percentile(values: &[f64], p: f64) -> f64 {
    if values.is_empty() {
        return f64::NAN;
    }
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// A relay with one desktop whose data leg runs [`serve_desktop`], and the phone spliced to it.
fn relay_system(binary: Option<&Path>) -> (Relay, harness::Desktop, Ws) {
    let relay = start_relay(binary, &[]);
    let mut desktop = harness::Desktop::connect(&relay);
    let (phone, leg) = harness::splice(&relay, &mut desktop);
    harness::set_read_timeout(&leg, None);
    let _ = leg.get_ref().set_nodelay(true);
    tune_client(&phone);
    orca_relay::threads::spawn("bench-data-leg", move || serve_desktop(leg))
        .expect("spawn the data leg");
    (relay, desktop, phone)
}

fn splice_phase(options: &Options) {
    let desktop_server = DesktopServer::start();
    let (relay, desktop, phone) = relay_system(None);
    let mut systems = vec![System {
        name: "orca-relay",
        phone,
        proxy: vec![relay.pid()],
    }];
    let compare = std::env::var_os("ORCA_RELAY_BENCH_COMPARE").map(PathBuf::from);
    let compared = compare.as_deref().map(|binary| {
        let (relay, desktop, phone) = relay_system(Some(binary));
        systems.push(System {
            name: "orca-relay compare",
            phone,
            proxy: vec![relay.pid()],
        });
        (relay, desktop)
    });
    let nginx = if options.nginx {
        match nginx_binary() {
            Some(binary) => match Nginx::start(&binary, desktop_server.addr, 1024) {
                Ok(nginx) => Some(nginx),
                Err(e) => {
                    println!("nginx rows left out: {e}");
                    None
                }
            },
            None => {
                println!("nginx rows left out: no nginx (apt-get install -y nginx-light)");
                None
            }
        }
    } else {
        None
    };
    if let Some(nginx) = &nginx {
        let workers = children_of(nginx.child.id());
        systems.push(System {
            name: "nginx tuned (64k)",
            phone: phone_to(&format!("ws://{}/desktop", nginx.tuned)),
            proxy: workers.clone(),
        });
        systems.push(System {
            name: "nginx default",
            phone: phone_to(&format!("ws://{}/desktop", nginx.default)),
            proxy: workers,
        });
    }
    systems.push(System {
        name: "direct",
        phone: phone_to(&format!("ws://{}/desktop", desktop_server.addr)),
        proxy: Vec::new(),
    });

    // Warm up every path (connections, caches, nginx buffers).
    for system in &mut systems {
        round_trips(&mut system.phone, 200);
        throughput_run(&mut system.phone, 0.2);
    }

    let mut mbps: Vec<Vec<f64>> = vec![Vec::new(); systems.len()];
    // Per system: the proxy's CPU seconds and the bytes it carried, over all runs.
    let mut cpu: Vec<(f64, f64)> = vec![(0.0, 0.0); systems.len()];
    // Per system, per run: (p50, p99) of that run's round trips.
    let mut rtts: Vec<Vec<(f64, f64)>> = vec![Vec::new(); systems.len()];
    // Throughput: one run per system per round, the order rotating each round.
    for run in 0..options.runs {
        for k in 0..systems.len() {
            let i = (run + k) % systems.len();
            let before = cpu_seconds(&systems[i].proxy);
            let (rate, bytes) = throughput_run(&mut systems[i].phone, options.seconds);
            cpu[i].0 += cpu_seconds(&systems[i].proxy) - before;
            cpu[i].1 += bytes;
            mbps[i].push(rate);
        }
    }
    // Round trips: each run interleaves small batches of every system, rotating, so a burst of
    // load from elsewhere on the machine lands on every system alike; a run that a long burst
    // spoiled is then outvoted by the median over runs.
    let batches_per_run = options.round_trips.div_ceil(options.runs * RTT_BATCH);
    for _run in 0..options.runs {
        let mut samples: Vec<Vec<f64>> = vec![Vec::new(); systems.len()];
        for batch in 0..batches_per_run {
            for k in 0..systems.len() {
                let i = (batch + k) % systems.len();
                samples[i].extend(round_trips(&mut systems[i].phone, RTT_BATCH));
            }
        }
        for (i, run) in samples.iter().enumerate() {
            rtts[i].push((percentile(run, 50.0), percentile(run, 99.0)));
        }
    }
    let rtt_p50 = |i: usize| median(&rtts[i].iter().map(|r| r.0).collect::<Vec<_>>());
    let rtt_p99 = |i: usize| median(&rtts[i].iter().map(|r| r.1).collect::<Vec<_>>());
    let relay_bytes = relay
        .metric("orca_relay_splice_bytes_total{direction=\"phone_to_host\"}")
        .unwrap_or(0.0);

    let tuned = systems
        .iter()
        .position(|s| s.name.starts_with("nginx tuned"));
    let tuned_mbps = tuned.map(|i| median(&mbps[i]));
    let tuned_p99 = tuned.map(rtt_p99);
    println!();
    println!(
        "throughput: 64 KiB frames phone -> desktop, {} runs x {:.1} s per system (alternating); \
         round trips: 64 B, {} runs x {} per system (alternating batches of {RTT_BATCH}); \
         medians over runs",
        options.runs,
        options.seconds,
        options.runs,
        batches_per_run * RTT_BATCH
    );
    println!(
        "{:<20}{:>13}{:>22}{:>12}{:>12}{:>14}{:>16}  MB/s per run",
        "system",
        "MB/s(median)",
        "ratio-vs-nginx-tuned",
        "rtt p50 µs",
        "rtt p99 µs",
        "p99-vs-tuned",
        "proxy CPU s/GB",
    );
    for (i, system) in systems.iter().enumerate() {
        let m = median(&mbps[i]);
        let ratio = tuned_mbps.map_or("n/a".to_string(), |t| format!("{:.2}x", m / t));
        let p99 = rtt_p99(i);
        let p99_ratio = tuned_p99.map_or("n/a".to_string(), |t| format!("{:.2}x", p99 / t));
        let runs: Vec<String> = mbps[i].iter().map(|v| format!("{v:.0}")).collect();
        let cpu_per_gb = if system.proxy.is_empty() || cpu[i].1 == 0.0 {
            "-".to_string()
        } else {
            format!("{:.2}", cpu[i].0 / (cpu[i].1 / 1e9))
        };
        println!(
            "{:<20}{:>13.0}{:>22}{:>12.0}{:>12.0}{:>14}{:>16}  {}",
            system.name,
            m,
            ratio,
            rtt_p50(i),
            p99,
            p99_ratio,
            cpu_per_gb,
            runs.join(" ")
        );
    }
    println!(
        "(relay counted {:.0} MB spliced phone -> host)",
        relay_bytes / 1e6
    );
    println!();
    if let (Some(t_mbps), Some(t_p99)) = (tuned_mbps, tuned_p99) {
        let relay_mbps = median(&mbps[0]);
        let relay_p99 = rtt_p99(0);
        target_line(
            "splice throughput >= 1.0x nginx tuned",
            format!("{:.2}x", relay_mbps / t_mbps),
            relay_mbps >= t_mbps,
        );
        target_line(
            "64 B rtt p99 <= 1.0x nginx tuned",
            format!("{:.2}x", relay_p99 / t_p99),
            relay_p99 <= t_p99,
        );
    }
    drop(systems);
    drop(nginx);
    drop(compared);
    drop(desktop);
}

fn target_line(target: &str, value: String, pass: bool) {
    println!(
        "target  {target:<44}{value:>12}  {}",
        if pass { "PASS" } else { "FAIL" }
    );
}

// ---------------------------------------------------------------------------------------------
// Phase 3: idle control sockets.

#[derive(Debug, Clone, Copy)]
struct ProcessStats {
    rss_kib: u64,
    threads: u64,
    fds: u64,
    maps: u64,
}

fn process_stats(pid: u32) -> ProcessStats {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find_map(|line| line.strip_prefix(name))
            .and_then(|rest| rest.split_whitespace().next())
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    };
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|dir| dir.count() as u64)
        .unwrap_or(0);
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps"))
        .map(|maps| maps.lines().count() as u64)
        .unwrap_or(0);
    ProcessStats {
        rss_kib: field("VmRSS:"),
        threads: field("Threads:"),
        fds,
        maps,
    }
}

type IdleSocket = WebSocket<TcpStream>;

/// A desktop with an acked control socket.
struct ControlDesktop {
    ws: IdleSocket,
    relay_host_id: String,
    generation: u64,
}

/// Assigns, connects and acks one desktop; returns its control socket, which the caller keeps
/// without reading (or uses for invites).
fn control_desktop(
    relay_ws: &str,
    agent: &ureq::Agent,
    http: &str,
) -> Result<ControlDesktop, String> {
    let relay_host_id = harness::host_id();
    let user_id = format!("user-{relay_host_id}");
    let token = harness::token(&user_id, &relay_host_id);
    let body = serde_json::json!({"v":1,"relayHostId":relay_host_id}).to_string();
    let answer = agent
        .post(&format!("http://{http}/v1/assign"))
        .set("Authorization", &format!("Bearer {token}"))
        .set("Content-Type", "application/json")
        .send_string(&body)
        .map_err(|e| format!("assign: {e}"))?
        .into_string()
        .map_err(|e| format!("assign body: {e}"))?;
    let epoch = serde_json::from_str::<serde_json::Value>(&answer)
        .ok()
        .and_then(|v| v["assignmentEpoch"].as_i64())
        .ok_or_else(|| format!("assign answer: {answer}"))?;

    let stream = TcpStream::connect(relay_ws).map_err(|e| format!("connect: {e}"))?;
    stream
        .set_read_timeout(Some(Duration::from_secs(30)))
        .map_err(|e| format!("read timeout: {e}"))?;
    let mut request = format!("ws://{relay_ws}/v1/host/control")
        .into_client_request()
        .map_err(|e| format!("request: {e}"))?;
    request.headers_mut().insert(
        "Authorization",
        format!("Bearer {token}")
            .parse()
            .map_err(|_| "authorization header".to_string())?,
    );
    // Small buffers: this process holds thousands of these.
    let config = WebSocketConfig::default()
        .read_buffer_size(4096)
        .write_buffer_size(0);
    let (mut ws, _) = tungstenite::client::client_with_config(request, stream, Some(config))
        .map_err(|e| format!("control upgrade: {e}"))?;
    let hello = serde_json::json!({"type":"host-hello","v":1,"relayHostId":relay_host_id,"assignmentEpoch":epoch});
    ws.send(Message::text(hello.to_string()))
        .map_err(|e| format!("hello: {e}"))?;
    loop {
        match ws.read().map_err(|e| format!("ack: {e}"))? {
            Message::Text(text) if text.contains("host-hello-ack") => {
                let generation = serde_json::from_str::<serde_json::Value>(&text)
                    .ok()
                    .and_then(|ack| ack["generation"].as_u64())
                    .ok_or_else(|| format!("ack without a generation: {text}"))?;
                return Ok(ControlDesktop {
                    ws,
                    relay_host_id,
                    generation,
                });
            }
            Message::Close(frame) => return Err(format!("closed before the ack: {frame:?}")),
            _ => {}
        }
    }
}

/// Control upgrades answered 503 (the relay sheds hellos while its database pool has waiters)
/// and retried, as a desktop would.
static CONTROL_RETRIES: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// Opens `count` more desktops' controls on `threads` client threads; a 503 is retried after
/// 100 ms (at most 100 times per desktop).
fn open_controls(ws: &str, http: &str, count: usize, threads: usize) -> Vec<ControlDesktop> {
    let per_thread = count.div_ceil(threads);
    let mut handles = Vec::new();
    for t in 0..threads {
        let share = per_thread.min(count.saturating_sub(t * per_thread));
        let ws = ws.to_string();
        let http = http.to_string();
        let handle = orca_relay::threads::spawn(format!("bench-idle-{t}"), move || {
            let agent = ureq::AgentBuilder::new()
                .timeout(Duration::from_secs(30))
                .build();
            let mut sockets = Vec::with_capacity(share);
            for _ in 0..share {
                let mut attempts = 0;
                loop {
                    match control_desktop(&ws, &agent, &http) {
                        Ok(socket) => {
                            sockets.push(socket);
                            break;
                        }
                        Err(e) if e.contains("503") && attempts < 100 => {
                            attempts += 1;
                            CONTROL_RETRIES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                            clock::sleep(Duration::from_millis(100));
                        }
                        Err(e) => return Err(e),
                    }
                }
            }
            Ok(sockets)
        })
        .expect("spawn an idle client thread");
        handles.push(handle);
    }
    let mut all = Vec::with_capacity(count);
    for handle in handles {
        match handle.join() {
            Ok(Ok(sockets)) => all.extend(sockets),
            Ok(Err(e)) => panic!("idle control failed after {} sockets: {e}", all.len()),
            Err(_) => panic!("an idle client thread panicked"),
        }
    }
    all
}

fn idle_phase(options: &Options) {
    match orca_relay::lifecycle::raise_fd_limit() {
        Ok((_, soft)) => {
            let largest = options.idle.last().copied().unwrap_or(0) as u64;
            if soft < largest + 200 {
                println!("idle controls: descriptor limit {soft} is too low for {largest} sockets");
                return;
            }
        }
        Err(e) => {
            println!("idle controls: cannot raise the descriptor limit: {e}");
            return;
        }
    }
    let largest = options.idle.last().copied().unwrap_or(0);
    let cap = (largest + largest / 5).max(1000).to_string();
    let relay = start_relay(None, &[("ORCA_RELAY_CONNECTION_CAP", &cap)]);
    let pid = relay.pid();
    // Readiness settles and the first assign warms the store before the baseline.
    let _warm = open_controls(&relay.ws, &relay.http, 1, 1);
    clock::sleep(Duration::from_millis(500));
    let baseline = process_stats(pid);
    println!();
    println!(
        "idle controls: baseline RSS {} KiB, {} threads, {} fds, {} maps",
        baseline.rss_kib, baseline.threads, baseline.fds, baseline.maps
    );
    println!(
        "{:<16}{:>16}{:>10}{:>8}{:>8}{:>12}{:>10}",
        "idle controls", "RSS KiB/socket", "threads", "fds", "maps", "fds/socket", "open s"
    );
    let mut held: Vec<ControlDesktop> = Vec::new();
    let mut last = None;
    for &n in &options.idle {
        let started = clock::instant();
        let more = open_controls(&relay.ws, &relay.http, n.saturating_sub(held.len()), 4);
        held.extend(more);
        let opened = started.elapsed().as_secs_f64();
        // Let the relay threads park in their reads.
        clock::sleep(Duration::from_millis(500));
        let stats = process_stats(pid);
        let per_socket = stats.rss_kib.saturating_sub(baseline.rss_kib) as f64 / n as f64;
        let fds_per_socket = stats.fds.saturating_sub(baseline.fds) as f64 / n as f64;
        println!(
            "{:<16}{:>16.1}{:>10}{:>8}{:>8}{:>12.3}{:>10.1}",
            n, per_socket, stats.threads, stats.fds, stats.maps, fds_per_socket, opened
        );
        last = Some((n, per_socket, fds_per_socket));
    }
    let connections = relay
        .metric("orca_relay_connections{kind=\"control\"}")
        .unwrap_or(0.0);
    println!("(relay reports {connections:.0} open control connections)");
    if let Some((n, per_socket, fds_per_socket)) = last {
        println!();
        target_line(
            &format!("RSS per idle control at {n} <= {RSS_TARGET_KIB} KiB"),
            format!("{per_socket:.1} KiB"),
            per_socket <= RSS_TARGET_KIB,
        );
        target_line(
            "one fd per idle control",
            format!("{fds_per_socket:.3}"),
            (fds_per_socket - 1.0).abs() < 0.01,
        );
    }
    drop(held);
    drop(relay);
}
