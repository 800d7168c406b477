//! The fleet under test: 2 directors and 6 cells, each a real `orca-relay` process on fixed
//! ports (so a restarted process is the same member, at the same URLs), sharing the nemesis's
//! PostgreSQL; a local JWKS with the test key; the operator's switch files and admit-mode
//! records.
//!
//! A **supervisor** thread plays systemd's part: it starts a process the nemesis wants running
//! (at the time it asked), restarts one that exited without being asked after
//! [`RESTART_MS`] (`Restart=on-failure`), and tells the history and the harness's
//! [`Knowledge`] about every launch and exit. For each cell it also plays the descriptor
//! store (`crate::harness::manager`, one per cell): the cell runs with `NOTIFY_SOCKET`, keeps
//! its listeners and connections there (`FDSTORE=1`), and every start gets them back
//! (`LISTEN_FDS`), as a cell unit's does. The store outlives a `kill -9` that keeps it
//! ([`EndKind::KilledKept`]: the desktops stay) and a death; a drain (a stop) flushes it, and
//! so does a kill that does not keep it ([`EndKind::Killed`], the clock jump's: a restart
//! that lost the store, the desktops redial). Each process's stderr is read line by line by a
//! thread of its own that stamps every line with the history's time and hands it to the
//! [`Observer`] (the checkers), so an event's time is when the harness saw it.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use super::history::{Checker, History};
use super::knowledge::{EndKind, Knowledge, Who};
use super::postgres::free_port;
use crate::harness::manager::Manager;
use crate::harness::{jwks_server, FakeServer, SERVICE_TOKEN, TEST_ISSUER};

pub const DIRECTORS: usize = 2;
pub const CELLS: usize = 6;
/// The fleet's `deadManTripSlots`.
pub const SLOTS: u32 = 2;
/// Each cell's `ORCA_RELAY_DATABASE_POOL_MAX` and `…_RESERVE_MAX`; a director's pool.
pub const CELL_POOL_MAX: u32 = 4;
pub const CELL_POOL_RESERVE_MAX: u32 = 2;
pub const DIRECTOR_POOL_MAX: u32 = 3;

/// The shrunk timings (SPEC §4 knobs). Windows of 2.5-2.9 s: shorter than the longest pause
/// (5 s), longer than most single director restarts; close together, so that in an outage the
/// cells claim their slots at nearly the same time (the claim's lock is what keeps them apart).
pub const DEAD_MAN_BASE_MS: u64 = 2_500;
pub const DEAD_MAN_SPREAD_MS: u64 = 400;
pub const FEED_POLL_MS: u64 = 200;
/// Below five minutes, so a cell whose clock is five minutes ahead and judged slot liveness on
/// its own clock would see every live holder as stale.
pub const TRIP_SLOT_STALE_MS: u64 = 20_000;
const TIMINGS: &[(&str, &str)] = &[
    ("ORCA_RELAY_DEAD_MAN_BASE_MS", "2500"),
    ("ORCA_RELAY_DEAD_MAN_SPREAD_MS", "400"),
    ("ORCA_RELAY_FEED_POLL_MS", "200"),
    ("ORCA_RELAY_TRIP_CLAIM_RETRY_MS", "500"),
    ("ORCA_RELAY_TRIP_SLOT_STALE_MS", "20000"),
    ("ORCA_RELAY_TRIPPED_ROW_FORCE_REFRESH_MS", "5000"),
    ("ORCA_RELAY_ADMIT_EFFECTIVE_REFRESH_MS", "1000"),
    ("ORCA_RELAY_SWITCH_POLL_MS", "100"),
    ("ORCA_RELAY_HEARTBEAT_MS", "500"),
    ("ORCA_RELAY_HEARTBEAT_FRESH_MS", "2000"),
    ("ORCA_RELAY_READINESS_PROBE_MS", "250"),
    ("ORCA_RELAY_DRAIN_GRACE_MS", "1500"),
    ("ORCA_RELAY_HANDSHAKE_TIMEOUT_MS", "2000"),
];

/// Like the units' `RestartSec=2`, shortened: a process that exited without being asked is
/// started again this long after.
pub const RESTART_MS: u64 = 1_000;
/// How often the supervisor looks at its processes.
const SUPERVISE_EVERY: Duration = Duration::from_millis(20);
const START_DEADLINE: Duration = Duration::from_secs(90);

/// Sees every log line of every process, stamped with the history's time.
pub trait Observer: Send + Sync {
    fn line(&self, who: Who, incarnation: u32, t: u64, text: &str);
}

/// What a process is doing, as the supervisor knows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    Down,
    /// Launched, its `orca_relay_started` line not seen yet.
    Starting,
    Up,
    Paused,
    /// Signalled (killed or draining), its exit not seen yet.
    Stopping,
}

#[derive(Debug, Clone, Copy)]
enum Want {
    /// Running, launched no earlier than this time.
    Run {
        at_ms: u64,
    },
    /// Running again this long after the current run has exited.
    AfterExit {
        delay_ms: u64,
    },
    Stopped,
}

struct ProcState {
    child: Option<Child>,
    incarnation: u32,
    phase: Phase,
    want: Want,
    /// How the nemesis ended the current run, if it did.
    expected: Option<EndKind>,
    launched_at: u64,
    readers: Vec<JoinHandle<()>>,
    /// The process that took over from `child` by a live handover (not our child: the
    /// `handover` command started it; it is ours to reap as the subreaper), while it runs.
    adopted: Option<u32>,
    /// A live handover of the current run under way: `Some(next pid)` once the command said
    /// it committed, `None` inside while its outcome is not known.
    handover: Option<Option<u32>>,
    /// The store was flushed at the last exit: flushed again at the next launch (a datagram
    /// the dead process sent may have been taken in after the flush).
    flushed: bool,
}

impl ProcState {
    /// The pid of the process that is this member now.
    fn pid(&self) -> Option<u32> {
        self.adopted.or(self.child.as_ref().map(Child::id))
    }

    fn running(&self) -> bool {
        self.pid().is_some()
    }
}

/// One log line of some run of a process.
#[derive(Debug, Clone)]
pub struct LogLine {
    pub t: u64,
    pub incarnation: u32,
    pub text: String,
}

/// A member of the fleet, across its runs.
pub struct Proc {
    pub who: Who,
    pub name: String,
    pub http_port: u16,
    pub ws_port: u16,
    pub data_dir: PathBuf,
    env: Vec<(String, String)>,
    binary: PathBuf,
    /// Its wall clock's offset (`ORCA_RELAY_TEST_CLOCK_OFFSET_MS`) from its next launch on.
    clock_offset_ms: AtomicI64,
    /// A cell's descriptor store (directors have none).
    manager: Option<Manager>,
    state: Mutex<ProcState>,
    log: Mutex<Vec<LogLine>>,
}

impl Proc {
    pub fn http_url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.http_port)
    }

    pub fn ws_url(&self) -> String {
        format!("ws://127.0.0.1:{}", self.ws_port)
    }

    pub fn phase(&self) -> Phase {
        self.state.lock().unwrap().phase
    }

    /// The pid of the current run, while it has one.
    pub fn pid(&self) -> Option<u32> {
        self.state.lock().unwrap().pid()
    }

    /// Each thread of the current run with where it waits in the kernel (`comm:wchan`), for a
    /// post-mortem of a process that does not exit or start.
    pub fn thread_states(&self) -> String {
        let Some(pid) = self.pid() else {
            return "no process".into();
        };
        let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
            return "gone".into();
        };
        let mut states: Vec<String> = tasks
            .filter_map(Result::ok)
            .map(|task| {
                let read = |name: &str| {
                    std::fs::read_to_string(task.path().join(name))
                        .unwrap_or_default()
                        .trim()
                        .to_string()
                };
                format!("{}:{}", read("comm"), read("wchan"))
            })
            .collect();
        states.sort();
        format!("{} sockets: {}", states.join(" "), tcp_sockets(pid))
    }

    pub fn incarnation(&self) -> u32 {
        self.state.lock().unwrap().incarnation
    }

    pub fn clock_offset_ms(&self) -> i64 {
        self.clock_offset_ms.load(Ordering::SeqCst)
    }

    pub fn set_clock_offset_ms(&self, offset_ms: i64) {
        self.clock_offset_ms.store(offset_ms, Ordering::SeqCst);
    }

    /// Whether the nemesis wants it running (it may still be starting or restarting).
    pub fn wanted_running(&self) -> bool {
        matches!(
            self.state.lock().unwrap().want,
            Want::Run { .. } | Want::AfterExit { .. }
        )
    }

    pub fn log_lines(&self) -> Vec<LogLine> {
        self.log.lock().unwrap().clone()
    }

    /// The last `n` lines, for a violation's detail.
    pub fn log_tail(&self, n: usize) -> String {
        let log = self.log.lock().unwrap();
        log.iter()
            .rev()
            .take(n)
            .rev()
            .map(|l| {
                format!(
                    "    [{} #{} t={}] {}",
                    self.name, l.incarnation, l.t, l.text
                )
            })
            .collect::<Vec<_>>()
            .join("\n")
    }

    fn signal(&self, state: &ProcState, signal: i32) -> bool {
        let Some(pid) = state.pid() else {
            return false;
        };
        // SAFETY: kill has no memory-safety preconditions; the pid is our own child (or adopted
        // one), not yet reaped (the supervisor reaps it under the same lock).
        unsafe { libc::kill(pid as libc::pid_t, signal) == 0 }
    }

    /// `kill -9`; it stays down until [`Proc::start_at`]. With `keep_store` (a cell) its
    /// descriptor store outlives it and the next run resumes its connections
    /// ([`EndKind::KilledKept`]); without, the store is flushed once it is dead (its
    /// connections close, as after any kill without a store).
    pub fn kill9(&self, k: &Knowledge, history: &History, keep_store: bool) -> bool {
        let mut state = self.state.lock().unwrap();
        if !state.running() || state.expected.is_some() || state.handover.is_some() {
            return false;
        }
        // The harness's knowledge first: a client that sees its socket reset the moment the
        // signal lands must already find the kill recorded.
        let t = history.now_ms();
        let kind = if keep_store && self.manager.is_some() {
            EndKind::KilledKept
        } else {
            EndKind::Killed
        };
        k.ended(self.who, t, kind);
        if state.phase == Phase::Paused {
            if let Who::Cell(c) = self.who {
                k.resumed(c, t);
            }
        }
        state.expected = Some(kind);
        state.want = Want::Stopped;
        state.phase = Phase::Stopping;
        self.signal(&state, libc::SIGKILL);
        history.event(format!(
            "signal proc={} incarnation={} signal=KILL store={}",
            self.name,
            state.incarnation,
            match (&self.manager, kind) {
                (None, _) => "none",
                (Some(_), EndKind::KilledKept) => "kept",
                _ => "flushed",
            }
        ));
        true
    }

    /// `SIGTERM` (a cell drains, a director shuts down); it stays down until
    /// [`Proc::start_at`].
    pub fn terminate(&self, k: &Knowledge, history: &History) -> bool {
        let mut state = self.state.lock().unwrap();
        // A drain of a serving process (a SIGTERM during the start-up handshake is not acted
        // on until the handshake ends; that is the signal handling's business, not this run's).
        if !state.running()
            || state.expected.is_some()
            || state.handover.is_some()
            || state.phase != Phase::Up
        {
            return false;
        }
        let t = history.now_ms();
        k.ended(self.who, t, EndKind::Terminated);
        state.expected = Some(EndKind::Terminated);
        state.want = Want::Stopped;
        state.phase = Phase::Stopping;
        self.signal(&state, libc::SIGTERM);
        history.event(format!(
            "signal proc={} incarnation={} signal=TERM",
            self.name, state.incarnation
        ));
        true
    }

    /// `SIGSTOP` a running cell.
    pub fn pause(&self, k: &Knowledge, history: &History) -> bool {
        let mut state = self.state.lock().unwrap();
        if state.phase != Phase::Up || state.handover.is_some() {
            return false;
        }
        let t = history.now_ms();
        if let Who::Cell(c) = self.who {
            k.paused(c, t);
        }
        state.phase = Phase::Paused;
        self.signal(&state, libc::SIGSTOP);
        history.event(format!(
            "signal proc={} incarnation={} signal=STOP",
            self.name, state.incarnation
        ));
        true
    }

    /// `SIGCONT` a paused cell.
    pub fn resume(&self, k: &Knowledge, history: &History) -> bool {
        let mut state = self.state.lock().unwrap();
        if state.phase != Phase::Paused {
            return false;
        }
        let t = history.now_ms();
        let favoured = match (self.who, state.pid()) {
            (Who::Cell(_), Some(pid)) => WatchdogFirst::arrange(pid),
            _ => None,
        };
        self.signal(&state, libc::SIGCONT);
        state.phase = Phase::Up;
        if let Who::Cell(c) = self.who {
            k.resumed(c, t);
        }
        let watchdog_first = favoured.map(WatchdogFirst::release).is_some();
        history.event(format!(
            "signal proc={} incarnation={} signal=CONT watchdog_first={watchdog_first}",
            self.name, state.incarnation
        ));
        true
    }

    /// Wants it running from `at_ms` on (once its current run has exited).
    pub fn start_at(&self, at_ms: u64) {
        self.state.lock().unwrap().want = Want::Run { at_ms };
    }

    /// Wants it running again `delay_ms` after its current run exits (a drain takes as long
    /// as it takes; the process then stays down for the fault's duration).
    pub fn start_after_exit(&self, delay_ms: u64) {
        let mut state = self.state.lock().unwrap();
        state.want = if state.running() {
            Want::AfterExit { delay_ms }
        } else {
            Want::Run { at_ms: 0 }
        };
    }

    /// `orca-relay handover` of a serving cell (SPEC §12): the command, run with the cell's
    /// environment, finds it through its data directory's socket and starts the next process,
    /// which takes every connection and becomes this member (same ports, same incarnation for
    /// the fleet, the same log: it writes to the stderr it is handed); the old one exits 0. The
    /// command runs on a thread of its own; the supervisor follows the new pid once the command
    /// says it committed. A refusal or a rollback leaves the old process serving (recorded,
    /// not a violation: the old process keeps every connection either way, which the clients'
    /// checks hold it to).
    pub fn hand_over(self: &Arc<Self>, history: &Arc<History>) -> bool {
        let mut state = self.state.lock().unwrap();
        if !matches!(self.who, Who::Cell(_))
            || state.phase != Phase::Up
            || state.expected.is_some()
            || state.handover.is_some()
            || !state.running()
        {
            return false;
        }
        state.handover = Some(None);
        let from = state.pid().unwrap_or(0);
        let incarnation = state.incarnation;
        drop(state);
        history.event(format!(
            "handover proc={} incarnation={incarnation} from_pid={from} clock_offset_ms={}",
            self.name,
            self.clock_offset_ms()
        ));
        let mut command = Command::new(&self.binary);
        command
            .arg("handover")
            .env_clear()
            .env("PATH", std::env::var("PATH").unwrap_or_default())
            .env("RUST_LOG", "info")
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .env(
                "ORCA_RELAY_TEST_CLOCK_OFFSET_MS",
                self.clock_offset_ms().to_string(),
            )
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            // The next process writes here until it takes the cell's stderr; a failure's cause
            // is also in the cell's own log (`orca_relay_handover_failed cause=…`).
            .stderr(Stdio::null());
        let (proc, history) = (self.clone(), history.clone());
        let spawned =
            orca_relay::threads::spawn(format!("nemesis-handover-{}", self.name), move || {
                let output = command.output();
                let (line, next) = match &output {
                    Ok(out) => {
                        let text = format!(
                            "{} (status {})",
                            String::from_utf8_lossy(&out.stdout).trim(),
                            out.status
                        );
                        let next = out
                            .status
                            .success()
                            .then(|| {
                                text.split("-> pid ")
                                    .nth(1)
                                    .and_then(|rest| rest.split_whitespace().next())
                                    .and_then(|pid| pid.parse::<u32>().ok())
                            })
                            .flatten();
                        (text.replace('\n', " | "), next)
                    }
                    Err(e) => (format!("cannot run the command: {e}"), None),
                };
                let mut state = proc.state.lock().unwrap();
                state.handover = next.map(Some);
                history.event(format!(
                    "handover_outcome proc={} committed={} next_pid={next:?} output={line:?}",
                    proc.name,
                    next.is_some()
                ));
            });
        if spawned.is_err() {
            self.state.lock().unwrap().handover = None;
            return false;
        }
        true
    }

    /// One supervisor turn: reap an exit, launch when wanted.
    fn supervise(
        self: &Arc<Self>,
        now: u64,
        k: &Arc<Knowledge>,
        history: &Arc<History>,
        observer: &Arc<dyn Observer>,
    ) {
        use std::os::unix::process::ExitStatusExt;
        let mut state = self.state.lock().unwrap();
        // While a handover's outcome is not known, the running process's exit waits to be
        // judged (it exits 0 right after a commit, before the command says so).
        let exited = if state.handover == Some(None) {
            None
        } else if let Some(pid) = state.adopted {
            let mut status = 0;
            // SAFETY: waitpid writes the status through the pointer; WNOHANG never blocks.
            let reaped = unsafe { libc::waitpid(pid as libc::pid_t, &mut status, libc::WNOHANG) };
            (reaped == pid as libc::pid_t).then(|| std::process::ExitStatus::from_raw(status))
        } else {
            match state.child.as_mut().map(Child::try_wait) {
                Some(Ok(Some(status))) => Some(status),
                _ => None,
            }
        };
        if let (Some(status), Some(Some(next))) = (exited, state.handover) {
            // The old process of a committed handover: it exits 0 and the next one is this
            // member now, on the same log (it writes to the stderr it was handed).
            state.child = None;
            state.handover = None;
            state.adopted = Some(next);
            history.event(format!(
                "exit proc={} incarnation={} code={:?} signal={:?} expected=handover next_pid={next}",
                self.name,
                state.incarnation,
                status.code(),
                status.signal()
            ));
            if status.code() != Some(0) {
                history.violation(
                    Checker::Deaths,
                    format!(
                        "{} exited {status} after handing over (it must exit 0)\n{}",
                        self.name,
                        self.log_tail(15)
                    ),
                );
            }
            return;
        }
        if let Some(status) = exited {
            state.child = None;
            state.adopted = None;
            state.handover = None;
            // Judge the exit on everything the run wrote: wait (without the lock, which the
            // reader takes on a start line) until its stderr has been read to the end.
            if let Some(reader) = state.readers.pop() {
                drop(state);
                let deadline = orca_relay::clock::instant() + Duration::from_secs(5);
                while !reader.is_finished() && orca_relay::clock::instant() < deadline {
                    orca_relay::clock::sleep(Duration::from_millis(5));
                }
                state = self.state.lock().unwrap();
                if reader.is_finished() {
                    let _ = reader.join();
                } else {
                    state.readers.push(reader);
                }
            }
            let clean = status.code() == Some(0);
            let expected = state.expected.take();
            // systemd flushes a unit's store when it stops (a drain); a kill without the store
            // loses it. A kill that keeps it and a death (`Restart=on-failure`) do not.
            if let (Some(manager), Some(EndKind::Killed | EndKind::Terminated)) =
                (&self.manager, expected)
            {
                manager.flush();
                state.flushed = true;
            }
            let was = state.phase;
            state.phase = Phase::Down;
            k.exited(self.who, now, clean);
            history.event(format!(
                "exit proc={} incarnation={} code={:?} signal={:?} expected={expected:?}",
                self.name,
                state.incarnation,
                status.code(),
                status.signal()
            ));
            if let Want::AfterExit { delay_ms } = state.want {
                state.want = Want::Run {
                    at_ms: now + delay_ms,
                };
            }
            match expected {
                Some(EndKind::Killed | EndKind::KilledKept) => {}
                Some(EndKind::Terminated) => {
                    if !clean {
                        history.violation(
                            Checker::Deaths,
                            format!(
                                "{} exited {status} after SIGTERM (a drain must exit 0)\n{}",
                                self.name,
                                self.log_tail(15)
                            ),
                        );
                    }
                }
                Some(EndKind::Died) | None => {
                    let refused = was == Phase::Starting
                        && self.log.lock().unwrap().iter().any(|l| {
                            l.incarnation == state.incarnation
                                && l.text.contains("orca_relay_handshake_failed")
                        });
                    if refused && !k.registration_possible(state.launched_at, now) {
                        history.event(format!(
                            "start_refused proc={} incarnation={} cause=director_or_database_unavailable (SPEC §8: a refused registration exits non-zero; restarted as systemd would)",
                            self.name, state.incarnation
                        ));
                    } else {
                        history.violation(
                            Checker::Deaths,
                            format!(
                                "{} died ({status}) without being killed (refused registration: {refused}; {})\n{}",
                                self.name,
                                k.describe_registration(state.launched_at, now),
                                self.log_tail(20)
                            ),
                        );
                    }
                    state.want = Want::Run {
                        at_ms: now + RESTART_MS,
                    };
                }
            }
        }
        if !state.running() {
            if let Want::Run { at_ms } = state.want {
                if now >= at_ms {
                    self.launch(&mut state, now, k, history, observer);
                }
            }
        }
    }

    fn launch(
        self: &Arc<Self>,
        state: &mut ProcState,
        now: u64,
        k: &Arc<Knowledge>,
        history: &Arc<History>,
        observer: &Arc<dyn Observer>,
    ) {
        state.incarnation += 1;
        let incarnation = state.incarnation;
        let offset = self.clock_offset_ms();
        if std::mem::take(&mut state.flushed) {
            if let Some(manager) = &self.manager {
                manager.flush();
            }
        }
        // A cell starts under its store's manager (`/bin/sh` exports `LISTEN_PID` and becomes
        // the relay: the same pid), with what the store holds.
        let handoff = self.manager.as_ref().map(Manager::handoff);
        let mut command = match &handoff {
            Some(handoff) => {
                let mut command = Command::new("/bin/sh");
                handoff.wrap(&mut command, &self.binary);
                command
            }
            None => Command::new(&self.binary),
        };
        command
            .env_clear()
            .env("PATH", std::env::var("PATH").unwrap_or_default())
            .env("RUST_LOG", "info")
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .envs(handoff.iter().flat_map(|handoff| handoff.env()))
            .env("ORCA_RELAY_TEST_CLOCK_OFFSET_MS", offset.to_string())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        let mut child = command
            .spawn()
            .unwrap_or_else(|e| panic!("start {}: {e}", self.name));
        let stored = handoff.as_ref().map_or(0, |handoff| handoff.count());
        drop(handoff);
        let stderr = child.stderr.take().expect("piped stderr");
        k.launched(self.who, now);
        history.event(format!(
            "launch proc={} incarnation={incarnation} pid={} clock_offset_ms={offset} stored_fds={stored}",
            self.name,
            child.id()
        ));
        state.child = Some(child);
        state.phase = Phase::Starting;
        state.expected = None;
        state.launched_at = now;
        let proc = self.clone();
        let (k, history, observer) = (k.clone(), history.clone(), observer.clone());
        let reader = orca_relay::threads::spawn(format!("nemesis-log-{}", self.name), move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                let t = history.logged_at(&line, history.now_ms());
                if line.contains("orca_relay_started ") {
                    let mut state = proc.state.lock().unwrap();
                    if state.incarnation == incarnation && state.phase == Phase::Starting {
                        state.phase = Phase::Up;
                        k.started(proc.who, t);
                        history.event(format!(
                            "started proc={} incarnation={incarnation}",
                            proc.name
                        ));
                    }
                }
                observer.line(proc.who, incarnation, t, &line);
                proc.log.lock().unwrap().push(LogLine {
                    t,
                    incarnation,
                    text: line,
                });
            }
        })
        .expect("spawn a log reader");
        state.readers.push(reader);
    }
}

/// The worst order for a cell's resume: its watchdog's first tick after `SIGCONT` runs before
/// any other thread of the cell, so before the directors' polls that queued in its sockets
/// while it was stopped are read (their contact would otherwise refresh the silence first and
/// hide a watchdog that judges it at once). Which thread runs first after a `SIGCONT` is the
/// scheduler's choice: on a loaded machine the watchdog often wins, on an idle one the threads
/// woken first (the oldest) usually do, so without this the pause guard (SPEC §11) was tested
/// only on loaded machines. For the resume, every thread of the cell is pinned to one CPU and
/// the watchdog runs `SCHED_FIFO` there, so it runs its tick to its next wait before the others
/// run; then each thread gets its own CPU mask back and the watchdog its normal policy. Needs
/// root (`CAP_SYS_NICE`); without it the resume is a plain `SIGCONT`.
struct WatchdogFirst {
    pid: u32,
    watchdog: i32,
    /// Each thread's CPU mask before the resume.
    masks: Vec<(i32, libc::cpu_set_t)>,
}

impl WatchdogFirst {
    /// Pins the stopped process `pid`'s threads to one CPU and makes its watchdog `SCHED_FIFO`;
    /// `None` (nothing changed) if it has no watchdog thread or the calls are refused.
    fn arrange(pid: u32) -> Option<WatchdogFirst> {
        let tids = task_ids(pid);
        let watchdog = *tids
            .iter()
            .find(|tid| thread_name(pid, **tid).as_deref() == Some("watchdog"))?;
        let mut masks = Vec::new();
        for &tid in &tids {
            // SAFETY: a zeroed cpu_set_t is a valid empty set; the calls only read and write
            // the set passed by pointer with its true size.
            let mut mask: libc::cpu_set_t = unsafe { std::mem::zeroed() };
            let size = std::mem::size_of::<libc::cpu_set_t>();
            if unsafe { libc::sched_getaffinity(tid, size, &mut mask) } != 0 {
                continue;
            }
            let mut one: libc::cpu_set_t = unsafe { std::mem::zeroed() };
            unsafe { libc::CPU_SET(0, &mut one) };
            if unsafe { libc::sched_setaffinity(tid, size, &one) } == 0 {
                masks.push((tid, mask));
            }
        }
        let fifo = libc::sched_param { sched_priority: 1 };
        // SAFETY: sched_setscheduler reads the parameter struct passed by pointer.
        if unsafe { libc::sched_setscheduler(watchdog, libc::SCHED_FIFO, &fifo) } != 0 {
            WatchdogFirst {
                pid,
                watchdog: 0,
                masks,
            }
            .restore();
            return None;
        }
        Some(WatchdogFirst {
            pid,
            watchdog,
            masks,
        })
    }

    /// After the `SIGCONT`: waits (at most 1 s) until the watchdog has run its tick and waits
    /// again, then restores every thread.
    fn release(self) {
        let deadline = orca_relay::clock::instant() + Duration::from_secs(1);
        while orca_relay::clock::instant() < deadline {
            let state = thread_state(self.pid, self.watchdog);
            if !matches!(state, Some('R' | 'T' | 't')) {
                break;
            }
            orca_relay::clock::sleep(Duration::from_millis(1));
        }
        self.restore();
    }

    fn restore(&self) {
        if self.watchdog != 0 {
            let other = libc::sched_param { sched_priority: 0 };
            // SAFETY: as in `arrange`.
            unsafe { libc::sched_setscheduler(self.watchdog, libc::SCHED_OTHER, &other) };
        }
        let size = std::mem::size_of::<libc::cpu_set_t>();
        for (tid, mask) in &self.masks {
            // SAFETY: as in `arrange`.
            unsafe { libc::sched_setaffinity(*tid, size, mask) };
        }
    }
}

fn task_ids(pid: u32) -> Vec<i32> {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .map(|dir| {
            dir.filter_map(Result::ok)
                .filter_map(|e| e.file_name().to_str().and_then(|n| n.parse().ok()))
                .collect()
        })
        .unwrap_or_default()
}

fn thread_name(pid: u32, tid: i32) -> Option<String> {
    std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/comm"))
        .ok()
        .map(|name| name.trim().to_string())
}

/// The thread's scheduling state letter (`R`, `S`, `T`, ...), from its `stat`.
fn thread_state(pid: u32, tid: i32) -> Option<char> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/stat")).ok()?;
    // The name is in parentheses and may hold spaces: the state follows the last ')'.
    stat.rsplit_once(')')?.1.trim_start().chars().next()
}

/// The whole fleet and its supervisor.
pub struct Fleet {
    pub directors: Vec<Arc<Proc>>,
    pub cells: Vec<Arc<Proc>>,
    /// Each cell's switch generation last written.
    generations: Vec<AtomicU64>,
    pub database_url: String,
    history: Arc<History>,
    knowledge: Arc<Knowledge>,
    stop: Arc<AtomicBool>,
    supervisor: Option<JoinHandle<()>>,
    _jwks: FakeServer,
}

impl Fleet {
    /// Starts the directors (waits for their migrations), writes every cell's switch file
    /// (`reserve`, `deadManTripSlots` = [`SLOTS`]), starts the cells, records them `reserve`
    /// with the directors, and waits until every cell is armed.
    pub fn start(
        database_url: String,
        dir: &Path,
        history: Arc<History>,
        knowledge: Arc<Knowledge>,
        observer: Arc<dyn Observer>,
    ) -> Fleet {
        // A handed-over cell's next process is started by the `handover` command, which exits
        // once it is done: this process adopts it (and reaps it) as the subreaper.
        // SAFETY: prctl with PR_SET_CHILD_SUBREAPER takes an integer and touches no memory.
        unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) };
        let jwks = jwks_server();
        let binary = PathBuf::from(env!("CARGO_BIN_EXE_orca-relay"));
        let shared: Vec<(String, String)> = [
            ("DATABASE_URL", database_url.as_str()),
            ("ORCA_RELAY_SERVICE_TOKEN", SERVICE_TOKEN),
            ("ORCA_RELAY_JWKS_URL", &format!("{}/jwks.json", jwks.url())),
            ("ORCA_RELAY_AUTH_ISSUER", TEST_ISSUER),
            ("ORCA_RELAY_JWKS_ALLOW_HTTP", "1"),
        ]
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .chain(TIMINGS.iter().map(|(k, v)| (k.to_string(), v.to_string())))
        .collect();
        // `ORCA_RELAY_CRASH_STORE` from the test's environment reaches the cells (`=0`: they
        // keep nothing, the check that a kill keeping the store is judged strictly).
        let crash_store: Vec<(String, String)> = std::env::var("ORCA_RELAY_CRASH_STORE")
            .ok()
            .map(|value| ("ORCA_RELAY_CRASH_STORE".to_string(), value))
            .into_iter()
            .collect();
        let make = |who: Who, name: String, ws: bool, extra: Vec<(String, String)>| {
            let data_dir = dir.join(&name);
            std::fs::create_dir_all(&data_dir).expect("create a process's data directory");
            let http_port = free_port();
            let ws_port = if ws { free_port() } else { 0 };
            let mut env = shared.clone();
            env.push(("ORCA_RELAY_DATA_DIR".into(), data_dir.display().to_string()));
            env.push((
                "ORCA_RELAY_HTTP_ADDR".into(),
                format!("127.0.0.1:{http_port}"),
            ));
            if ws {
                env.push(("ORCA_RELAY_WS_ADDR".into(), format!("127.0.0.1:{ws_port}")));
            }
            env.extend(extra);
            Arc::new(Proc {
                who,
                name,
                http_port,
                ws_port,
                data_dir,
                env,
                binary: binary.clone(),
                clock_offset_ms: AtomicI64::new(0),
                manager: matches!(who, Who::Cell(_)).then(Manager::start),
                state: Mutex::new(ProcState {
                    child: None,
                    incarnation: 0,
                    phase: Phase::Down,
                    want: Want::Stopped,
                    expected: None,
                    launched_at: 0,
                    readers: Vec::new(),
                    adopted: None,
                    handover: None,
                    flushed: false,
                }),
                log: Mutex::default(),
            })
        };
        let directors: Vec<Arc<Proc>> = (0..DIRECTORS)
            .map(|d| {
                make(
                    Who::Director(d),
                    format!("d{d}"),
                    false,
                    vec![
                        ("ORCA_RELAY_ROLE".into(), "director".into()),
                        (
                            "ORCA_RELAY_DATABASE_POOL_MAX".into(),
                            DIRECTOR_POOL_MAX.to_string(),
                        ),
                    ],
                )
            })
            .collect();
        let director_urls = directors
            .iter()
            .map(|d| d.http_url(""))
            .collect::<Vec<_>>()
            .join(",");
        let cells: Vec<Arc<Proc>> = (0..CELLS)
            .map(|c| {
                make(
                    Who::Cell(c),
                    format!("c{c}"),
                    true,
                    vec![
                        ("ORCA_RELAY_ROLE".into(), "cell".into()),
                        ("ORCA_RELAY_CELL_ID".into(), format!("c{c}")),
                        ("ORCA_RELAY_DIRECTOR_URLS".into(), director_urls.clone()),
                        (
                            "ORCA_RELAY_DATABASE_POOL_MAX".into(),
                            CELL_POOL_MAX.to_string(),
                        ),
                        (
                            "ORCA_RELAY_DATABASE_POOL_RESERVE_MAX".into(),
                            CELL_POOL_RESERVE_MAX.to_string(),
                        ),
                    ]
                    .into_iter()
                    .chain(crash_store.clone())
                    .collect(),
                )
            })
            .collect();
        let stop = Arc::new(AtomicBool::new(false));
        let supervisor = {
            let procs: Vec<Arc<Proc>> = directors.iter().chain(&cells).cloned().collect();
            let (stop, k, history) = (stop.clone(), knowledge.clone(), history.clone());
            orca_relay::threads::spawn("nemesis-supervisor", move || {
                while !stop.load(Ordering::SeqCst) {
                    let now = history.now_ms();
                    for proc in &procs {
                        proc.supervise(now, &k, &history, &observer);
                    }
                    orca_relay::clock::sleep(SUPERVISE_EVERY);
                }
            })
            .expect("spawn the supervisor")
        };
        let fleet = Fleet {
            generations: (0..CELLS).map(|_| AtomicU64::new(0)).collect(),
            directors,
            cells,
            database_url,
            history,
            knowledge,
            stop,
            supervisor: Some(supervisor),
            _jwks: jwks,
        };
        for director in &fleet.directors {
            director.start_at(0);
        }
        fleet.wait_for(
            "both directors started and migrated",
            START_DEADLINE,
            || {
                fleet.directors.iter().all(|d| d.phase() == Phase::Up)
                    && fleet.directors.iter().any(|d| {
                        d.log_lines()
                            .iter()
                            .any(|l| l.text.contains("orca_relay_migrations_applied"))
                    })
            },
        );
        for c in 0..CELLS {
            fleet.write_switch(c, true, SLOTS);
        }
        for cell in &fleet.cells {
            cell.start_at(0);
        }
        fleet.wait_for("every cell started", START_DEADLINE, || {
            fleet.cells.iter().all(|c| c.phase() == Phase::Up)
        });
        for c in 0..CELLS {
            let recorded = crate::harness::wait_until(Duration::from_secs(30), || {
                fleet.record_admit_mode(c, "reserve")
            });
            assert!(recorded, "record c{c} reserve with a director");
        }
        fleet.wait_for("every cell armed", START_DEADLINE, || {
            (0..CELLS).all(|c| fleet.dead_man_state(c).as_deref() == Some("armed"))
        });
        fleet
    }

    fn wait_for(&self, what: &str, deadline: Duration, condition: impl FnMut() -> bool) {
        if !crate::harness::wait_until(deadline, condition) {
            let tails: Vec<String> = self.all().map(|p| p.log_tail(8)).collect();
            panic!(
                "the fleet never got to: {what} (history {})\n{}",
                self.history.path.display(),
                tails.join("\n")
            );
        }
        self.history.event(format!("fleet_ready what=\"{what}\""));
    }

    pub fn all(&self) -> impl Iterator<Item = &Arc<Proc>> {
        self.directors.iter().chain(&self.cells)
    }

    pub fn proc(&self, who: Who) -> &Arc<Proc> {
        match who {
            Who::Director(d) => &self.directors[d],
            Who::Cell(c) => &self.cells[c],
        }
    }

    /// Writes cell `c`'s switch file atomically with the next generation, as operators do.
    pub fn write_switch(&self, c: usize, reserve: bool, slots: u32) -> u64 {
        let generation = self.generations[c].fetch_add(1, Ordering::SeqCst) + 1;
        let body = serde_json::json!({
            "v": 1,
            "cellId": format!("c{c}"),
            "generation": generation,
            "flags": {
                "admitMode": if reserve { "reserve" } else { "db" },
                "deadManTripSlots": slots,
            },
        });
        let path = self.cells[c].data_dir.join("switch.json");
        let tmp = path.with_extension("json.tmp");
        std::fs::write(&tmp, body.to_string()).expect("write the switch file");
        std::fs::rename(&tmp, &path).expect("rename the switch file");
        let t = self.history.now_ms();
        if reserve {
            self.knowledge.rearmed(c, t, generation);
        }
        self.knowledge.slots_written(c, t, slots);
        self.history.event(format!(
            "switch_write cell=c{c} generation={generation} admitMode={} slots={slots}",
            if reserve { "reserve" } else { "db" }
        ));
        generation
    }

    /// The operator's record (`PUT /v1/admin/cell-admit-mode`) through the first director that
    /// answers; whether one did.
    pub fn record_admit_mode(&self, c: usize, mode: &str) -> bool {
        for director in &self.directors {
            if director.phase() != Phase::Up {
                continue;
            }
            let answer = ureq::put(&director.http_url("/v1/admin/cell-admit-mode"))
                .set("Authorization", &format!("Bearer {SERVICE_TOKEN}"))
                .timeout(Duration::from_secs(2))
                .send_string(
                    &serde_json::json!({"cellId": format!("c{c}"), "admitMode": mode}).to_string(),
                );
            if matches!(&answer, Ok(response) if response.status() == 200) {
                self.history.event(format!(
                    "admit_mode_record cell=c{c} mode={mode} via={}",
                    director.name
                ));
                return true;
            }
        }
        false
    }

    /// A GET on a process's HTTP listener: (status, body), `None` without an answer.
    pub fn get(&self, who: Who, path: &str) -> Option<(u16, String)> {
        http_get(&self.proc(who).http_url(path))
    }

    /// Every sample of a process's `/metrics`, `series{labels}` → value.
    pub fn metrics(&self, who: Who) -> Option<BTreeMap<String, f64>> {
        let (status, body) = self.get(who, "/metrics")?;
        if status != 200 {
            return None;
        }
        Some(
            body.lines()
                .filter(|l| !l.starts_with('#'))
                .filter_map(|l| {
                    let (series, value) = l.rsplit_once(' ')?;
                    Some((series.to_string(), value.trim().parse().ok()?))
                })
                .collect(),
        )
    }

    /// A cell's dead-man state from its `/metrics` (`off`, `armed`, `held`, `tripped`).
    pub fn dead_man_state(&self, c: usize) -> Option<String> {
        let metrics = self.metrics(Who::Cell(c))?;
        ["off", "armed", "held", "tripped"]
            .iter()
            .find(|state| {
                metrics.get(&format!("orca_relay_dead_man_state{{state=\"{state}\"}}"))
                    == Some(&1.0)
            })
            .map(|s| s.to_string())
    }

    /// Stops the supervisor, kills every process and waits for their output to be read to
    /// the end.
    pub fn teardown(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(supervisor) = self.supervisor.take() {
            let _ = supervisor.join();
        }
        for proc in self.directors.iter().chain(&self.cells) {
            let (child, adopted, readers) = {
                let mut state = proc.state.lock().unwrap();
                (
                    state.child.take(),
                    state.adopted.take(),
                    std::mem::take(&mut state.readers),
                )
            };
            if let Some(pid) = adopted {
                // SAFETY: as in `Proc::signal`; then reaped (it is ours as the subreaper).
                unsafe {
                    libc::kill(pid as libc::pid_t, libc::SIGKILL);
                    libc::waitpid(pid as libc::pid_t, std::ptr::null_mut(), 0);
                }
            }
            if let Some(mut child) = child {
                let _ = child.kill();
                let _ = child.wait();
            }
            for reader in readers {
                let _ = reader.join();
            }
            if let Some(manager) = &proc.manager {
                manager.flush();
            }
        }
    }
}

impl Drop for Fleet {
    fn drop(&mut self) {
        self.teardown();
    }
}

/// The TCP sockets of process `pid` as the kernel sees them (`/proc/net/tcp`): local and remote
/// address, state, send and receive queues, timer: where a stuck call is waiting.
fn tcp_sockets(pid: u32) -> String {
    let inodes: Vec<String> = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .into_iter()
        .flatten()
        .filter_map(Result::ok)
        .filter_map(|fd| std::fs::read_link(fd.path()).ok())
        .filter_map(|target| {
            let target = target.display().to_string();
            Some(
                target
                    .strip_prefix("socket:[")?
                    .strip_suffix(']')?
                    .to_string(),
            )
        })
        .collect();
    let table = std::fs::read_to_string(format!("/proc/{pid}/net/tcp")).unwrap_or_default();
    table
        .lines()
        .skip(1)
        .filter_map(|line| {
            let f: Vec<&str> = line.split_whitespace().collect();
            let inode = f.get(9)?;
            inodes.iter().any(|i| i == inode).then(|| {
                format!(
                    "[{}->{} st={} queues={} timer={} retrans={}]",
                    f.get(1).unwrap_or(&""),
                    f.get(2).unwrap_or(&""),
                    f.get(3).unwrap_or(&""),
                    f.get(4).unwrap_or(&""),
                    f.get(5).unwrap_or(&""),
                    f.get(6).unwrap_or(&"")
                )
            })
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// A GET with a 2 s deadline: (status, body), `None` without an answer.
pub fn http_get(url: &str) -> Option<(u16, String)> {
    match ureq::get(url).timeout(Duration::from_secs(2)).call() {
        Ok(response) => {
            let status = response.status();
            Some((status, response.into_string().unwrap_or_default()))
        }
        Err(ureq::Error::Status(status, response)) => {
            Some((status, response.into_string().unwrap_or_default()))
        }
        Err(_) => None,
    }
}
