//! What the live-handover tests and bench share: a second build of the binary, running
//! `orca-relay handover`, following the process that serves after it, the load
//! ([`load`]), `/ready` and `/health` polled every 50 ms, and the process's descriptors,
//! threads and memory.
#![allow(dead_code)]

pub mod client;
pub mod edges;
pub mod fixture;
pub mod load;
pub mod remote;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::harness::{self, Relay};

/// The marker before the build note in the binary (`handover::build_note`).
const NOTE_MARKER: &[u8] = b"ORCA_RELAY_BUILD_NOTE=";

/// A copy of the binary under test whose reported version carries `note` (`0.1.0+note`): a
/// second build, without a second compilation. Written once per note.
pub fn build_with_note(note: &str) -> PathBuf {
    static LOCK: Mutex<()> = Mutex::new(());
    let _guard = LOCK.lock().unwrap();
    assert!(note.len() < 40 && note.bytes().all(|b| b.is_ascii_alphanumeric()));
    let source = Path::new(env!("CARGO_BIN_EXE_orca-relay"));
    let dir = source
        .parent()
        .expect("binary dir")
        .join("handover-builds")
        .join(note);
    std::fs::create_dir_all(&dir).expect("builds dir");
    let target = dir.join("orca-relay");
    let mut bytes = std::fs::read(source).expect("read the binary");
    let at = bytes
        .windows(NOTE_MARKER.len())
        .position(|w| w == NOTE_MARKER)
        .expect("the build-note marker in the binary");
    let start = at + NOTE_MARKER.len();
    for (i, slot) in bytes[start..start + 40].iter_mut().enumerate() {
        *slot = note.as_bytes().get(i).copied().unwrap_or(b' ');
    }
    let temporary = dir.join(format!("orca-relay.{}", std::process::id()));
    std::fs::write(&temporary, &bytes).expect("write the copy");
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&temporary, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    std::fs::rename(&temporary, &target).expect("install the copy");
    target
}

/// Orphaned processes of this test process (the relays that took over after a handover,
/// whose parent, the `handover` command, has exited) become its children, so they are reaped
/// and their exit seen.
pub fn adopt_orphans() {
    // SAFETY: prctl with constant arguments.
    unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) };
}

/// What `orca-relay handover` did.
#[derive(Debug)]
pub struct Handover {
    pub code: i32,
    pub stdout: String,
    pub stderr: String,
    /// The pid that serves now (from the command's line), when it committed.
    pub new_pid: Option<u32>,
    pub took: Duration,
}

/// Runs `binary handover` (default: the binary under test) with the relay's environment plus
/// `extra` (an environment variable set to `''` removes it), and `args`.
pub fn hand_over(
    relay: &Relay,
    binary: Option<&Path>,
    extra: &[(&str, &str)],
    args: &[&str],
) -> Handover {
    let extra: Vec<(&str, &std::ffi::OsStr)> = extra
        .iter()
        .map(|(name, value)| (*name, std::ffi::OsStr::new(*value)))
        .collect();
    hand_over_raw(relay, binary, &extra, args)
}

/// As [`hand_over`], `configure` applied to the command first (a `pre_exec`: the next process
/// inherits what it sets, such as a descriptor limit).
pub fn hand_over_with(
    relay: &Relay,
    binary: Option<&Path>,
    extra: &[(&str, &str)],
    args: &[&str],
    configure: impl FnOnce(&mut Command),
) -> Handover {
    let extra: Vec<(&str, &std::ffi::OsStr)> = extra
        .iter()
        .map(|(name, value)| (*name, std::ffi::OsStr::new(*value)))
        .collect();
    run_handover(relay, binary, &extra, args, configure)
}

/// As [`hand_over`], with values given as raw bytes (a value that is not UTF-8).
pub fn hand_over_raw(
    relay: &Relay,
    binary: Option<&Path>,
    extra: &[(&str, &std::ffi::OsStr)],
    args: &[&str],
) -> Handover {
    run_handover(relay, binary, extra, args, |_| {})
}

fn run_handover(
    relay: &Relay,
    binary: Option<&Path>,
    extra: &[(&str, &std::ffi::OsStr)],
    args: &[&str],
    configure: impl FnOnce(&mut Command),
) -> Handover {
    let binary = binary.unwrap_or(Path::new(env!("CARGO_BIN_EXE_orca-relay")));
    let mut command = Command::new(binary);
    configure(&mut command);
    command.arg("handover").args(args).env_clear();
    for (name, value) in &relay.env {
        command.env(name, value);
    }
    for (name, value) in extra {
        command.env(name, value);
    }
    let started = harness::now_instant();
    let output = command
        .stdin(Stdio::null())
        .output()
        .expect("run orca-relay handover");
    let stdout = String::from_utf8_lossy(&output.stdout).to_string();
    let new_pid = stdout
        .split("-> pid ")
        .nth(1)
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|pid| pid.parse().ok());
    Handover {
        code: output.status.code().unwrap_or(-1),
        stdout,
        stderr: String::from_utf8_lossy(&output.stderr).to_string(),
        new_pid,
        took: started.elapsed(),
    }
}

/// A process that took over: killed (and reaped) when dropped, unless it exited already.
pub struct Serving {
    pub pid: u32,
}

impl Serving {
    pub fn signal(&self, signal: i32) {
        // SAFETY: kill(2) on a pid this test started (through the handover command).
        unsafe { libc::kill(self.pid as i32, signal) };
    }

    /// Waits for the process to exit; its status.
    pub fn wait_exit(&self, timeout: Duration) -> Option<i32> {
        let deadline = harness::now_instant() + timeout;
        loop {
            let mut status = 0;
            // SAFETY: waitpid on our (adopted) child; WNOHANG.
            let done = unsafe { libc::waitpid(self.pid as i32, &mut status, libc::WNOHANG) };
            if done == self.pid as i32 {
                return Some(if libc::WIFEXITED(status) {
                    libc::WEXITSTATUS(status)
                } else {
                    -1
                });
            }
            if done < 0 || harness::now_instant() >= deadline {
                return None;
            }
            orca_relay::clock::sleep(Duration::from_millis(20));
        }
    }

    pub fn alive(&self) -> bool {
        // SAFETY: signal 0 only checks.
        unsafe { libc::kill(self.pid as i32, 0) == 0 }
    }
}

impl Drop for Serving {
    fn drop(&mut self) {
        if self.alive() {
            self.signal(libc::SIGKILL);
            let _ = self.wait_exit(Duration::from_secs(5));
        }
    }
}

/// Descriptors, threads and resident memory of a process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Footprint {
    pub fds: usize,
    pub threads: usize,
    pub rss_kib: u64,
}

pub fn footprint(pid: u32) -> Footprint {
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, |dir| dir.count());
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find_map(|line| line.strip_prefix(name))
            .and_then(|rest| rest.split_whitespace().next())
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(0)
    };
    Footprint {
        fds,
        threads: field("Threads:") as usize,
        rss_kib: field("VmRSS:"),
    }
}

/// `/ready` and `/health`, each asked every 50 ms on a new connection, through a handover:
/// every answer that is not a 200 (or no answer within 2 s) is a failure.
pub struct Poller {
    stop: Arc<AtomicBool>,
    asked: Arc<AtomicU64>,
    failures: Arc<Mutex<Vec<String>>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

fn get_status(addr: &str, path: &str) -> Result<u16, String> {
    let mut stream = TcpStream::connect(addr).map_err(|e| format!("connect: {e}"))?;
    stream
        .set_read_timeout(Some(Duration::from_secs(2)))
        .map_err(|e| e.to_string())?;
    stream
        .write_all(
            format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").as_bytes(),
        )
        .map_err(|e| format!("write: {e}"))?;
    let mut answer = Vec::new();
    stream
        .read_to_end(&mut answer)
        .map_err(|e| format!("read: {e}"))?;
    let text = String::from_utf8_lossy(&answer);
    text.split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| format!("no status in {text:?}"))
}

impl Poller {
    pub fn start(http: &str) -> Poller {
        Poller::start_in(http, None)
    }

    /// As [`Poller::start`], from inside the network namespace `netns`.
    pub fn start_in(http: &str, netns: Option<&Path>) -> Poller {
        let netns = netns.map(Path::to_path_buf);
        let stop = Arc::new(AtomicBool::new(false));
        let asked = Arc::new(AtomicU64::new(0));
        let failures: Arc<Mutex<Vec<String>>> = Arc::default();
        let thread = {
            let (stop, asked, failures, http) = (
                stop.clone(),
                asked.clone(),
                failures.clone(),
                http.to_string(),
            );
            orca_relay::threads::spawn("ready-poller", move || {
                if let Some(netns) = &netns {
                    join_netns(netns);
                }
                while !stop.load(Ordering::SeqCst) {
                    for path in ["/ready", "/health"] {
                        asked.fetch_add(1, Ordering::SeqCst);
                        match get_status(&http, path) {
                            Ok(200) => {}
                            Ok(status) => failures.lock().unwrap().push(format!("{path} {status}")),
                            Err(e) => failures.lock().unwrap().push(format!("{path} {e}")),
                        }
                    }
                    orca_relay::clock::sleep(Duration::from_millis(50));
                }
            })
            .unwrap()
        };
        Poller {
            stop,
            asked,
            failures,
            thread: Some(thread),
        }
    }

    /// Stops; (requests asked, failures).
    pub fn stop(mut self) -> (u64, Vec<String>) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
        (
            self.asked.load(Ordering::SeqCst),
            self.failures.lock().unwrap().clone(),
        )
    }
}

impl Drop for Poller {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// Joins this thread to the network namespace at `netns` (`/proc/<pid>/ns/net`): sockets it
/// opens from now on belong to that network (the systemd tests' namespaces).
pub fn join_netns(netns: &Path) {
    use std::os::fd::AsRawFd;
    let file = std::fs::File::open(netns).expect("open the network namespace");
    // SAFETY: setns changes only this thread's network namespace, to the one the descriptor
    // names.
    let joined = unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) };
    assert_eq!(joined, 0, "setns: {}", std::io::Error::last_os_error());
}

/// Runs `what` on a thread in the network namespace `netns` (or this one's, for `None`).
pub fn in_netns<T: Send + 'static>(
    netns: Option<&Path>,
    what: impl FnOnce() -> T + Send + 'static,
) -> T {
    let netns = netns.map(Path::to_path_buf);
    orca_relay::threads::spawn("test-in-netns", move || {
        if let Some(netns) = &netns {
            join_netns(netns);
        }
        what()
    })
    .expect("spawn")
    .join()
    .expect("the thread in the namespace panicked")
}

/// Raises this test process's descriptor limit to its hard limit (thousands of client
/// sockets).
pub fn raise_fd_limit() {
    let _ = orca_relay::lifecycle::raise_fd_limit();
}

/// The body of `/metrics` at `http`.
fn metrics_text(http: &str) -> Option<String> {
    ureq::get(&format!("http://{http}/metrics"))
        .timeout(Duration::from_secs(10))
        .call()
        .ok()?
        .into_string()
        .ok()
}

/// The value of one series in a process's `/metrics` at `http`.
pub fn metric(http: &str, series: &str) -> Option<f64> {
    metrics_text(http)?.lines().find_map(|line| {
        line.strip_prefix(series)?
            .strip_prefix(' ')?
            .trim()
            .parse()
            .ok()
    })
}

/// The sum of every series of the metric `name` (all its labels) at `http`.
pub fn metric_sum(http: &str, name: &str) -> Option<f64> {
    let text = metrics_text(http)?;
    Some(
        text.lines()
            .filter(|line| {
                line.strip_prefix(name)
                    .is_some_and(|rest| rest.starts_with(['{', ' ']))
            })
            .filter_map(|line| line.rsplit(' ').next()?.parse::<f64>().ok())
            .sum(),
    )
}

/// Every series of the metric `name` at `http` (diagnostics).
pub fn metric_lines(http: &str, name: &str) -> Vec<String> {
    metrics_text(http)
        .unwrap_or_default()
        .lines()
        .filter(|line| line.starts_with(name))
        .map(str::to_string)
        .collect()
}

/// The build's version as the process at `http` reports it.
pub fn served_version(http: &str) -> Option<String> {
    metrics_text(http)?.lines().find_map(|line| {
        let rest = line.strip_prefix("orca_relay_build_info{version=\"")?;
        Some(rest.split('"').next()?.to_string())
    })
}

/// A desktop's control on the relay at `ws` (from this thread's network): upgraded with its
/// token, its hello acknowledged.
pub fn connect_control(ws: &str, desktop: &load::Identity) -> client::Blocking {
    try_connect_control(ws, desktop).expect("upgrade")
}

/// [`connect_control`], or the status that refused the upgrade (0: no connection).
pub fn try_connect_control(ws: &str, desktop: &load::Identity) -> Result<client::Blocking, u16> {
    let (stream, rest) = client::connect(ws, "/v1/host/control", Some(&desktop.token))?;
    let mut control = client::Blocking::new(stream, rest);
    control
        .send_json(serde_json::json!({"type":"host-hello","v":1,
            "relayHostId":desktop.relay_host_id,"assignmentEpoch":desktop.epoch}))
        .unwrap();
    assert_eq!(control.json().unwrap()["type"], "host-hello-ack");
    Ok(control)
}

/// The load's report once every control has heard a ping and `streams` streams have moved
/// since the mark (or, after `timeout`, as it stands, for the caller's assertions to name what
/// is missing). A wait on the load itself, not on a figure of wall time: a loaded machine only
/// makes it longer.
pub fn served(
    mut report: impl FnMut() -> load::Report,
    streams: usize,
    timeout: Duration,
) -> load::Report {
    let deadline = harness::now_instant() + timeout;
    loop {
        let now = report();
        let served =
            now.pinged_since_mark >= now.controls && now.streams_flowing_since_mark >= streams;
        if served || harness::now_instant() >= deadline || !now.closed.is_empty() {
            return now;
        }
        orca_relay::clock::sleep(Duration::from_millis(100));
    }
}

/// `count` desktops placed through `POST /v1/assign` of the relay at `http` (a combined relay's
/// director), connecting from `netns` when given; each retried for up to 30 s (the relay may
/// still be starting).
pub fn place_desktops(netns: Option<&Path>, http: &str, count: usize) -> Vec<load::Identity> {
    place_desktops_with(netns, http, count, harness::token)
}

/// [`place_desktops`] with tokens from `mint(user_id, relay_host_id)` (a director that checks
/// them against a JWKS: `harness::es256_token`).
pub fn place_desktops_with(
    netns: Option<&Path>,
    http: &str,
    count: usize,
    mint: fn(&str, &str) -> String,
) -> Vec<load::Identity> {
    let http = http.to_string();
    in_netns(netns, move || {
        (0..count)
            .map(|_| {
                let relay_host_id = harness::host_id();
                let user_id = format!("user-{relay_host_id}");
                let token = mint(&user_id, &relay_host_id);
                let mut answer = None;
                harness::wait_until(Duration::from_secs(30), || {
                    answer = ureq::post(&format!("http://{http}/v1/assign"))
                        .set("Authorization", &format!("Bearer {token}"))
                        .timeout(Duration::from_secs(20))
                        .send_string(
                            &serde_json::json!({"v":1,"relayHostId":relay_host_id}).to_string(),
                        )
                        .ok()
                        .and_then(|response| response.into_json::<serde_json::Value>().ok());
                    answer.is_some()
                });
                let answer = answer.expect("assign");
                load::Identity {
                    user_id,
                    relay_host_id,
                    token,
                    epoch: answer["assignmentEpoch"].as_i64().unwrap(),
                }
            })
            .collect()
    })
}
