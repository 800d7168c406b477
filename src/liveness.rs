//! Liveness that proves progress (SPEC §13): every thread the process cannot live without shows
//! on its own that it is still turning, and the process ends rather than live on without one.
//!
//! Owns: the registry of named beats ([`Liveness`]), each a thread's last beat and its bound;
//! the process's [`PauseClock`]; the test knob that wedges or panics a named thread
//! ([`TestFault`]). Runs on: every critical thread beats from its own loop ([`Beat::beat`]: one
//! relaxed atomic store and a clock read, no lock); `/health` and the `systemd-watchdog` thread
//! judge ([`Liveness::stale`], a short lock over the list). Never: blocks a beating thread,
//! touches a dependency, or judges a thread by its own pause.
//!
//! **Critical threads** (started by [`Liveness::spawn_critical`]): the WebSocket `acceptor`,
//! each `splice-<n>`, the `pinger` and `lease-renewer`, the `reaper`, the `switch-watcher`, the
//! dead-man `watchdog` and its `claim-loop`, the `heartbeat`, the `readiness` prober, the
//! `http-acceptor`, and a director's `feed-poller`, `feed-lister`, `feed-live-<n>` and
//! `feed-suspect-<n>`. Not critical: threads that serve one connection (`relay-<id>`,
//! `http-<n>`: a panic costs that connection), threads that end on their own (`migrator`,
//! `reregister`, `self-placement`, `upgrade-verify`), and the process's own plumbing that waits
//! on nothing it could miss (`signals`, `pause-clock`, `systemd-watchdog`, which systemd itself
//! watches, `handover`, whose failures roll back). ARCHITECTURE.md's thread table says the same.
//!
//! **Beats.** A critical thread beats once per loop turn, and every wait of its loop has a
//! timeout of at most its period ([`BEAT_PERIOD`], 1 s, or its own shorter one), so an idle
//! thread beats too. It is *stale* when it has not beaten for [`stale_bound`] of its period
//! (5 periods, at least 5 s: a thread a loaded machine delays by a few seconds is not wedged,
//! and the bound stays under half of the shipped `WatchdogSec=30`, so a wedge is noticed within
//! one watchdog period). Time spent inside a call whose bound is a dependency's (a database
//! statement, an HTTP call to a director or a cell: [`Beat::waiting`]) is not judged: a
//! database that hangs is not this process wedged, and restarting every cell would not cure it.
//! A pause of the whole process (SIGSTOP, a VM pause) is not a wedge either: staleness counts
//! from the end of the last pause the [`PauseClock`] saw.
//!
//! **Ends.** A critical thread that panics or returns ends the process with exit status
//! [`CRITICAL_EXIT_CODE`] and one ERROR line naming it (`orca_relay_critical_thread_failed
//! thread=… cause=panic|returned`), never leaving a half-process. A thread stopped on purpose
//! (a drain, a live handover's quiesce) is stood down first ([`Standing::stand_down`]): it is
//! judged no more and its end is its stopper's business.

use std::io;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::clock::SharedClock;
use crate::pause_clock::PauseClock;

/// The longest a critical thread's loop waits between two beats.
pub const BEAT_PERIOD: Duration = Duration::from_secs(1);

/// Periods without a beat after which a thread is stale.
pub const STALE_AFTER_PERIODS: u32 = 5;

/// The shortest bound: a loaded machine can keep a thread off the CPU for a second or two.
pub const MIN_STALE_BOUND: Duration = Duration::from_secs(5);

/// The exit status of a process ended by a critical thread's panic or return (`EX_SOFTWARE`):
/// non-zero, so `Restart=on-failure` restarts it; distinct, so `systemctl status` tells it from
/// a refused configuration (1).
pub const CRITICAL_EXIT_CODE: i32 = 70;

/// Set once the role's run has returned (a finished drain, or a start that failed): the process
/// is exiting on its own, and a critical thread that ends now (its channels dropped with the
/// role's state) is not a failure.
static FINISHING: AtomicBool = AtomicBool::new(false);

/// The role's run has returned: from now on a critical thread's end says nothing and exits
/// nothing (`roles::run` calls it; the process exits with the role's own status).
pub fn process_finishing() {
    FINISHING.store(true, Ordering::Release);
}

/// How long a thread of `period` may go without beating before it is stale.
pub fn stale_bound(period: Duration) -> Duration {
    (period * STALE_AFTER_PERIODS).max(MIN_STALE_BOUND)
}

const RUNNING: u8 = 0;
/// Inside a call bounded by a dependency ([`Beat::waiting`]).
const WAITING: u8 = 1;
/// Stopped on purpose: not judged, and its end does not end the process.
const STOOD_DOWN: u8 = 2;

/// The registry: cheap to clone.
#[derive(Clone)]
pub struct Liveness(Arc<Shared>);

struct Shared {
    clock: SharedClock,
    pauses: Arc<PauseClock>,
    slots: Mutex<Vec<Arc<Slot>>>,
    fault: Option<TestFault>,
    /// When the registry was made (monotonic ms): a test fault's `@ms` counts from here.
    started_ms: u64,
    /// A critical thread's end ends the process. False for parts run in-process by tests.
    exits: bool,
    /// A critical thread has ended the process (its one line is written).
    ending: AtomicBool,
}

/// One critical thread's beat.
struct Slot {
    name: String,
    bound_ms: u64,
    last_ms: AtomicU64,
    state: AtomicU8,
    /// Found stale by the last judgement (logged once per episode).
    reported: AtomicBool,
}

/// A thread found stale: its name, how long it has been silent and its bound.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stale {
    pub name: String,
    pub silent_ms: u64,
    pub bound_ms: u64,
}

impl Liveness {
    /// The process's registry: a critical thread's end ends the process. Starts the
    /// `pause-clock` thread.
    pub fn new(clock: SharedClock, fault: Option<TestFault>) -> io::Result<Liveness> {
        let liveness = Liveness::with(clock, fault, true);
        liveness.0.pauses.start()?;
        Ok(liveness)
    }

    /// A registry for parts of a process run in-process (tests, benches): a critical thread's
    /// end is logged and the process goes on; no pause clock ticks (no pause is ever seen).
    pub fn detached(clock: SharedClock) -> Liveness {
        Liveness::with(clock, None, false)
    }

    fn with(clock: SharedClock, fault: Option<TestFault>, exits: bool) -> Liveness {
        Liveness(Arc::new(Shared {
            pauses: PauseClock::new(clock.clone()),
            started_ms: clock.monotonic_ms(),
            clock,
            slots: Mutex::new(Vec::new()),
            fault,
            exits,
            ending: AtomicBool::new(false),
        }))
    }

    /// The process's pause clock (the control readers and splice workers ask it).
    pub fn pauses(&self) -> Arc<PauseClock> {
        self.0.pauses.clone()
    }

    /// Registers a beat named `name` for a thread whose loop waits at most `period`.
    pub fn register(&self, name: &str, period: Duration) -> Beat {
        let now = self.0.clock.monotonic_ms();
        let slot = Arc::new(Slot {
            name: name.to_string(),
            bound_ms: stale_bound(period).as_millis() as u64,
            last_ms: AtomicU64::new(now),
            state: AtomicU8::new(RUNNING),
            reported: AtomicBool::new(false),
        });
        lock(&self.0.slots).push(slot.clone());
        let fault = self
            .0
            .fault
            .as_ref()
            .filter(|fault| fault.thread == name)
            .map(|fault| ArmedFault {
                kind: fault.kind,
                at_ms: self.0.started_ms.saturating_add(fault.after_ms),
                fired: AtomicBool::new(false),
            });
        Beat {
            slot,
            clock: self.0.clock.clone(),
            fault,
        }
    }

    fn unregister(&self, slot: &Arc<Slot>) {
        lock(&self.0.slots).retain(|held| !Arc::ptr_eq(held, slot));
    }

    /// The critical threads that have not beaten within their bound, judged now: staleness
    /// counts from the later of the last beat and the end of the last pause of the process. The
    /// first judgement that finds a thread stale logs it (WARN), the first that finds it beating
    /// again says so (INFO).
    pub fn stale(&self) -> Vec<Stale> {
        let resumed = self.0.pauses.ended_at_ms().unwrap_or(0);
        let now = self.0.clock.monotonic_ms();
        let slots = lock(&self.0.slots).clone();
        let mut stale = Vec::new();
        for slot in slots {
            let judged = slot.state.load(Ordering::Acquire) == RUNNING;
            let from = slot.last_ms.load(Ordering::Relaxed).max(resumed);
            let silent_ms = now.saturating_sub(from);
            if judged && silent_ms > slot.bound_ms {
                if !slot.reported.swap(true, Ordering::AcqRel) {
                    log::warn!(
                        "orca_relay_thread_stale thread={} silent_ms={silent_ms} bound_ms={}",
                        slot.name,
                        slot.bound_ms
                    );
                }
                stale.push(Stale {
                    name: slot.name.clone(),
                    silent_ms,
                    bound_ms: slot.bound_ms,
                });
            } else if slot.reported.swap(false, Ordering::AcqRel) {
                log::info!("orca_relay_thread_progress_again thread={}", slot.name);
            }
        }
        stale
    }

    /// The names of the critical threads registered now (stood-down ones included until they
    /// end).
    pub fn names(&self) -> Vec<String> {
        lock(&self.0.slots)
            .iter()
            .map(|slot| slot.name.clone())
            .collect()
    }

    /// Spawns the critical thread `name` (see the module header) with a role thread's stack;
    /// `body` gets its beat. Returns its handle and its [`Standing`].
    pub fn spawn_critical<T: Send + 'static>(
        &self,
        name: &str,
        period: Duration,
        body: impl FnOnce(Beat) -> T + Send + 'static,
    ) -> io::Result<(std::thread::JoinHandle<T>, Standing)> {
        let (run, standing) = self.critical(name, period, body);
        match crate::threads::spawn(name, run) {
            Ok(handle) => Ok((handle, standing)),
            Err(e) => {
                self.unregister(&standing.0);
                Err(e)
            }
        }
    }

    /// As [`Liveness::spawn_critical`], joinable with a deadline (`threads::Watched`).
    pub fn spawn_critical_watched<T: Send + 'static>(
        &self,
        name: &str,
        period: Duration,
        body: impl FnOnce(Beat) -> T + Send + 'static,
    ) -> io::Result<(crate::threads::Watched<T>, Standing)> {
        let (run, standing) = self.critical(name, period, body);
        match crate::threads::spawn_watched(name, run) {
            Ok(handle) => Ok((handle, standing)),
            Err(e) => {
                self.unregister(&standing.0);
                Err(e)
            }
        }
    }

    /// The body of a critical thread: its beat registered now, a panic or a return that was not
    /// asked for ends the process.
    fn critical<T: Send + 'static>(
        &self,
        name: &str,
        period: Duration,
        body: impl FnOnce(Beat) -> T + Send + 'static,
    ) -> (impl FnOnce() -> T + Send + 'static, Standing) {
        let beat = self.register(name, period);
        let standing = beat.standing();
        let slot = beat.slot.clone();
        let liveness = self.clone();
        let name = name.to_string();
        let run = move || {
            crate::threads::set_critical(true);
            let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| body(beat)));
            crate::threads::set_critical(false);
            let stood_down = slot.state.load(Ordering::Acquire) == STOOD_DOWN;
            liveness.unregister(&slot);
            match outcome {
                Ok(value) => {
                    if !stood_down {
                        liveness.ended(&name, "returned", None);
                    }
                    value
                }
                Err(payload) => {
                    let detail = crate::threads::take_panic_detail();
                    if stood_down {
                        log::error!(
                            "orca_relay_thread_panicked thread={name} detail={}",
                            detail.as_deref().unwrap_or("-")
                        );
                    } else {
                        liveness.ended(&name, "panic", detail.as_deref());
                    }
                    std::panic::resume_unwind(payload)
                }
            }
        };
        (run, standing)
    }

    /// A critical thread ended without being asked to: one ERROR line, then the exit. Only the
    /// first says so; a thread that returns while another's panic unwinds (the panic dropped
    /// what it waited on) is not the cause and says nothing.
    fn ended(&self, name: &str, cause: &str, detail: Option<&str>) {
        if FINISHING.load(Ordering::Acquire) {
            return;
        }
        if cause == "returned" && crate::threads::critical_panic_in_flight() {
            return;
        }
        if self.0.ending.swap(true, Ordering::AcqRel) {
            return;
        }
        let detail = detail.map(|d| d.replace('\n', " "));
        log::error!(
            "orca_relay_critical_thread_failed thread={name} cause={cause} exit_code={CRITICAL_EXIT_CODE} detail={:?}",
            detail.as_deref().unwrap_or("-")
        );
        if self.0.exits {
            log::logger().flush();
            std::process::exit(CRITICAL_EXIT_CODE);
        }
    }
}

/// A critical thread's beat, owned by the thread.
pub struct Beat {
    slot: Arc<Slot>,
    clock: SharedClock,
    fault: Option<ArmedFault>,
}

impl Beat {
    /// One loop turn: the thread is making progress.
    #[inline]
    pub fn beat(&self) {
        let now = self.clock.monotonic_ms();
        self.slot.last_ms.store(now, Ordering::Relaxed);
        if let Some(fault) = &self.fault {
            self.fire(fault, now);
        }
    }

    /// Runs `call`, a call bounded by a dependency (a database statement, an HTTP call to a
    /// peer): while it lasts the thread is not judged; it beats when the call returns.
    pub fn waiting<T>(&self, call: impl FnOnce() -> T) -> T {
        let _ =
            self.slot
                .state
                .compare_exchange(RUNNING, WAITING, Ordering::AcqRel, Ordering::Acquire);
        let back = Back(&self.slot);
        let value = call();
        drop(back);
        self.beat();
        value
    }

    /// The handle its stopper keeps.
    pub fn standing(&self) -> Standing {
        Standing(self.slot.clone())
    }

    /// The test fault, once due: a wedge stops the thread here (not beating) until it is stood
    /// down; a panic panics.
    #[cold]
    fn fire(&self, fault: &ArmedFault, now: u64) {
        if now < fault.at_ms || fault.fired.swap(true, Ordering::AcqRel) {
            return;
        }
        log::warn!(
            "orca_relay_test_fault_fired fault={}:{} note=test_knob_never_set_in_production",
            fault.kind.as_str(),
            self.slot.name
        );
        match fault.kind {
            FaultKind::Panic => panic!("test fault panic:{}", self.slot.name),
            FaultKind::Wedge => {
                while self.slot.state.load(Ordering::Acquire) != STOOD_DOWN {
                    crate::clock::sleep(Duration::from_millis(100));
                }
            }
        }
    }
}

/// Waits on `stop` until `until`, beating at least once a [`BEAT_PERIOD`] (a critical
/// thread's wait between two turns); `true` when `stop` fired (a message, or its sender gone).
pub fn wait_beating(
    stop: &std::sync::mpsc::Receiver<()>,
    until: std::time::Instant,
    beat: &Beat,
) -> bool {
    use std::sync::mpsc::RecvTimeoutError;
    loop {
        beat.beat();
        let left = until.saturating_duration_since(crate::clock::instant());
        if left.is_zero() {
            return false;
        }
        match stop.recv_timeout(left.min(BEAT_PERIOD)) {
            Err(RecvTimeoutError::Timeout) => {}
            Ok(()) | Err(RecvTimeoutError::Disconnected) => return true,
        }
    }
}

/// Puts a waiting slot back to running, also when the call unwinds.
struct Back<'a>(&'a Slot);

impl Drop for Back<'_> {
    fn drop(&mut self) {
        let _ =
            self.0
                .state
                .compare_exchange(WAITING, RUNNING, Ordering::AcqRel, Ordering::Acquire);
    }
}

/// What the stopper of a critical thread keeps: [`Standing::stand_down`] before it asks the
/// thread to stop (a drain, a handover's quiesce), so the thread is judged no more and its end
/// does not end the process.
#[derive(Clone)]
pub struct Standing(Arc<Slot>);

impl Standing {
    pub fn stand_down(&self) {
        self.0.state.store(STOOD_DOWN, Ordering::Release);
    }
}

impl std::fmt::Debug for Standing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("Standing").field(&self.0.name).finish()
    }
}

// ---------------------------------------------------------------------------------------------
// The test knob.

/// What a test fault does to its thread.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FaultKind {
    /// The thread stops beating (it sleeps at its next beat until it is stood down).
    Wedge,
    /// The thread panics at its next beat.
    Panic,
}

impl FaultKind {
    pub fn as_str(self) -> &'static str {
        match self {
            FaultKind::Wedge => "wedge",
            FaultKind::Panic => "panic",
        }
    }
}

/// `ORCA_RELAY_TEST_FAULT=KIND:THREAD[@MS]`, a test knob: the critical thread named `THREAD`
/// (as `/health` and the thread table name it: `acceptor`, `splice-0`, `watchdog`, …) wedges
/// or panics at its first beat `MS` milliseconds (default 0) after the process started. Never
/// set in production; a process started with one logs `orca_relay_test_fault` at WARN.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TestFault {
    pub kind: FaultKind,
    pub thread: String,
    pub after_ms: u64,
}

struct ArmedFault {
    kind: FaultKind,
    at_ms: u64,
    fired: AtomicBool,
}

impl TestFault {
    /// What the knob accepts, for the configuration's error line.
    pub const EXPECTED: &'static str =
        "wedge:THREAD or panic:THREAD, optionally @MS (THREAD: a critical thread's name, [a-z0-9-], MS: 0-86400000)";

    pub fn parse(text: &str) -> Option<TestFault> {
        let (kind, rest) = text.trim().split_once(':')?;
        let kind = match kind {
            "wedge" => FaultKind::Wedge,
            "panic" => FaultKind::Panic,
            _ => return None,
        };
        let (thread, after_ms) = match rest.split_once('@') {
            Some((thread, ms)) => (thread, ms.parse::<u64>().ok()?),
            None => (rest, 0),
        };
        let named = !thread.is_empty()
            && thread.len() <= 64
            && thread
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-');
        (named && after_ms <= 86_400_000).then(|| TestFault {
            kind,
            thread: thread.to_string(),
            after_ms,
        })
    }
}

impl std::fmt::Display for TestFault {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}:{}@{}",
            self.kind.as_str(),
            self.thread,
            self.after_ms
        )
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|e| e.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::ManualClock;

    fn names(stale: &[Stale]) -> Vec<&str> {
        stale.iter().map(|s| s.name.as_str()).collect()
    }

    #[test]
    fn a_thread_is_stale_past_five_periods_or_five_seconds() {
        assert_eq!(stale_bound(Duration::from_secs(1)), Duration::from_secs(5));
        assert_eq!(
            stale_bound(Duration::from_millis(50)),
            Duration::from_secs(5)
        );
        assert_eq!(stale_bound(Duration::from_secs(3)), Duration::from_secs(15));
    }

    #[test]
    fn a_thread_that_stops_beating_is_stale_and_one_waiting_on_a_dependency_is_not() {
        let clock = ManualClock::starting_at(1_000);
        let liveness = Liveness::detached(clock.clone());
        let acceptor = liveness.register("acceptor", BEAT_PERIOD);
        let claim = liveness.register("claim-loop", BEAT_PERIOD);
        let worker = liveness.register("splice-0", BEAT_PERIOD);
        for _ in 0..10 {
            clock.advance(1_000);
            acceptor.beat();
            claim.beat();
            worker.beat();
        }
        assert!(liveness.stale().is_empty());
        // The worker wedges; the claim loop waits on the database for a minute.
        claim.waiting(|| {
            for _ in 0..60 {
                clock.advance(1_000);
                acceptor.beat();
            }
            assert_eq!(names(&liveness.stale()), vec!["splice-0"]);
        });
        let stale = liveness.stale();
        assert_eq!(names(&stale), vec!["splice-0"], "the call's end is a beat");
        assert_eq!(stale[0].silent_ms, 60_000);
        assert_eq!(stale[0].bound_ms, 5_000);
        // Exactly at the bound is not stale yet.
        worker.beat();
        clock.advance(5_000);
        acceptor.beat();
        claim.beat();
        assert!(liveness.stale().is_empty());
        clock.advance(1);
        assert_eq!(names(&liveness.stale()), vec!["splice-0"]);
    }

    #[test]
    fn a_stood_down_thread_is_not_judged() {
        let clock = ManualClock::starting_at(0);
        let liveness = Liveness::detached(clock.clone());
        let pinger = liveness.register("pinger", BEAT_PERIOD);
        pinger.standing().stand_down();
        clock.advance(600_000);
        assert!(liveness.stale().is_empty());
        // A call that ends after the stand-down leaves it stood down.
        pinger.waiting(|| ());
        clock.advance(600_000);
        assert!(liveness.stale().is_empty());
    }

    #[test]
    fn staleness_counts_from_the_end_of_the_process_pause() {
        let clock = ManualClock::starting_at(0);
        let liveness = Liveness::detached(clock.clone());
        let worker = liveness.register("splice-0", BEAT_PERIOD);
        let pauses = liveness.pauses();
        // The ticker runs, in steps of its tick.
        let run_for = |ms: u64| {
            for _ in 0..ms / 250 {
                clock.advance(250);
                pauses.tick();
            }
        };
        pauses.tick();
        run_for(3_000);
        worker.beat();
        // Stopped 20 s: the first look after the resume finds the ticker silent, a pause
        // ending now; the worker is judged from there.
        clock.advance(20_000);
        assert!(liveness.stale().is_empty(), "just resumed");
        run_for(5_000);
        assert!(
            liveness.stale().is_empty(),
            "within the bound after the resume"
        );
        // The ticker's first tick after the stop saw the gap too, 250 ms after the resume.
        run_for(500);
        assert_eq!(names(&liveness.stale()), vec!["splice-0"]);
        worker.beat();
        assert!(liveness.stale().is_empty());
    }

    #[test]
    fn a_critical_thread_that_returns_unasked_is_reported_and_one_stood_down_is_not() {
        let liveness = Liveness::detached(crate::clock::system());
        let (handle, _standing) = liveness
            .spawn_critical("test-returns", BEAT_PERIOD, |beat| {
                beat.beat();
                7
            })
            .expect("spawn");
        assert_eq!(handle.join().ok(), Some(7));
        assert!(liveness.names().is_empty(), "unregistered at its end");
        let (stop, stopped) = std::sync::mpsc::channel::<()>();
        let (handle, standing) = liveness
            .spawn_critical("test-stopped", BEAT_PERIOD, move |beat| {
                while let Err(std::sync::mpsc::RecvTimeoutError::Timeout) =
                    stopped.recv_timeout(BEAT_PERIOD)
                {
                    beat.beat();
                }
            })
            .expect("spawn");
        assert_eq!(liveness.names(), vec!["test-stopped".to_string()]);
        standing.stand_down();
        drop(stop);
        assert!(handle.join().is_ok());
        assert!(liveness.names().is_empty());
    }

    #[test]
    fn test_faults_parse_by_kind_thread_and_delay() {
        assert_eq!(
            TestFault::parse("wedge:acceptor"),
            Some(TestFault {
                kind: FaultKind::Wedge,
                thread: "acceptor".into(),
                after_ms: 0
            })
        );
        assert_eq!(
            TestFault::parse("panic:splice-0@2500"),
            Some(TestFault {
                kind: FaultKind::Panic,
                thread: "splice-0".into(),
                after_ms: 2_500
            })
        );
        assert_eq!(
            TestFault::parse("panic:splice-0@2500").unwrap().to_string(),
            "panic:splice-0@2500"
        );
        for bad in [
            "",
            "wedge",
            "wedge:",
            "hang:acceptor",
            "wedge:Acceptor",
            "wedge:accep tor",
            "wedge:acceptor@",
            "wedge:acceptor@-1",
            "wedge:acceptor@86400001",
            "wedge:acceptor@1@2",
        ] {
            assert_eq!(TestFault::parse(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn a_wedge_fault_stops_the_beat_until_the_thread_is_stood_down() {
        let clock = ManualClock::starting_at(0);
        let fault = TestFault::parse("wedge:acceptor@3000");
        let liveness = Liveness::with(clock.clone(), fault, false);
        let other = liveness.register("pinger", BEAT_PERIOD);
        let beat = liveness.register("acceptor", BEAT_PERIOD);
        let standing = beat.standing();
        clock.advance(2_999);
        beat.beat();
        other.beat();
        clock.advance(1);
        let (wedged, done) = std::sync::mpsc::channel();
        let thread = crate::threads::spawn("test-wedged", move || {
            beat.beat();
            let _ = wedged.send(());
            beat.beat();
        })
        .expect("spawn");
        assert!(
            done.recv_timeout(Duration::from_millis(300)).is_err(),
            "wedged"
        );
        clock.advance(6_000);
        other.beat();
        assert_eq!(names(&liveness.stale()), vec!["acceptor"]);
        standing.stand_down();
        assert!(done.recv_timeout(Duration::from_secs(10)).is_ok());
        thread.join().expect("join");
        assert!(liveness.stale().is_empty());
    }
}
