//! The nemesis: a seeded fault-injection run over a real fleet (issue 21; SPEC §12 "Nemesis").
//!
//! One run: a fresh database on the nemesis's own PostgreSQL ([`postgres`]); 2 directors and 6
//! reserve cells with `deadManTripSlots=2` and shrunk windows as real processes ([`fleet`]);
//! desktops placed through `/v1/assign` holding controls and streaming sequence-checked frames
//! through phone sessions, redialing when their control ends ([`clients`]); a schedule of
//! overlapping faults drawn from the seed ([`schedule`]) and applied at its times; the
//! checkers sampling the database every 100 ms and judging every trip, stream and exit as it
//! happens, then the fleet's liveness after the nemesis stops ([`checkers`]). Everything goes
//! to a history file under `target/` ([`history`]): seed, schedule, faults as applied,
//! samples, violations, verdict. A failing run prints its seed and the command that replays
//! it. The schedule is a pure function of (seed, length, available kinds); timing on a loaded
//! machine varies.
//!
//! Used by `tests/nemesis_fleet.rs` (the short run in the suite) and `benches/nemesis.rs` (long
//! runs). docs/DEVELOPMENT.md ("The nemesis") says how to run, read and replay one.

#![allow(dead_code)]

pub mod checkers;
pub mod clients;
pub mod fleet;
pub mod history;
pub mod knowledge;
pub mod postgres;
pub mod rng;
pub mod schedule;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::mpsc::{self, Sender};
use std::sync::Arc;
use std::time::Duration;

use checkers::{Checkers, Sampler};
use clients::{ClientCounts, Clients, Endpoints};
use fleet::{Fleet, Phase, CELLS, DIRECTORS, SLOTS};
use history::{Checker, History, Violation};
use knowledge::Knowledge;
use postgres::Postgres;
use schedule::{Fault, FaultKind, Shape, Target};

/// What one run does.
#[derive(Debug, Clone)]
pub struct Settings {
    pub seed: u64,
    /// How long the nemesis injects faults (the fleet's start and the liveness check come on
    /// top).
    pub length: Duration,
    pub desktops: usize,
    /// The command that replays this run, printed when it fails.
    pub replay: String,
}

/// How a run went.
#[derive(Debug)]
pub struct Outcome {
    pub seed: u64,
    pub history: PathBuf,
    pub violations: Vec<Violation>,
    /// Faults applied per kind (a fault whose target was not in a state to take it is skipped).
    pub applied: BTreeMap<FaultKind, usize>,
    pub skipped: usize,
    /// `reserve` writes that ended a deliberate `db` flip.
    pub reserve_writes: usize,
    pub clients: ClientCounts,
    pub trips: u64,
    pub helds: u64,
    pub liveness_ms: Option<u64>,
    pub samples: BTreeMap<&'static str, u64>,
    pub replay: String,
}

impl Outcome {
    pub fn passed(&self) -> bool {
        self.violations.is_empty()
    }

    /// A few lines for the console.
    pub fn summary(&self) -> String {
        let applied: Vec<String> = self
            .applied
            .iter()
            .map(|(kind, n)| format!("{kind}={n}"))
            .collect();
        let mut text = format!(
            "nemesis seed {}: {} ({} violations)\n  faults applied: {} (skipped {}, reserve writes {})\n  trips {} held {} streams completed {} cut by design {} frames checked {} controls {} redials {} (voluntary {})\n  liveness after {:?} ms; samples {:?}\n  history: {}",
            self.seed,
            if self.passed() { "every checker held" } else { "FAILED" },
            self.violations.len(),
            applied.join(" "),
            self.skipped,
            self.reserve_writes,
            self.trips,
            self.helds,
            self.clients.streams_completed,
            self.clients.streams_cut_by_design,
            self.clients.frames_checked,
            self.clients.controls_opened,
            self.clients.redials,
            self.clients.voluntary_redials,
            self.liveness_ms,
            self.samples,
            self.history.display()
        );
        for violation in self.violations.iter().take(12) {
            text.push_str(&format!(
                "\n  VIOLATION t={} checker {} ({}): {}",
                violation.at_ms,
                violation.checker.number(),
                violation.checker.as_str(),
                violation.detail
            ));
        }
        if !self.passed() {
            text.push_str(&format!("\n  replay: {}", self.replay));
        }
        text
    }
}

/// Where histories go: `target/tmp/nemesis/`.
pub fn history_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("nemesis")
}

/// Whether [`Nemesis::handover`] applies the live handover (issue 23): on since the harness
/// follows a handed-over cell's next process ([`fleet::Proc::hand_over`]). Handovers are drawn
/// from a stream of their own, so turning this off leaves every seed's other faults as they are.
pub const HANDOVER_FAULT_APPLIED: bool = true;

/// The fault kinds this machine and binary can inject: the PostgreSQL slowdown needs the CPU
/// cgroup, the handover needs `orca-relay handover` (issue 23) and the harness's part of it
/// ([`HANDOVER_FAULT_APPLIED`]).
pub fn available_kinds(pg: &Postgres) -> Vec<FaultKind> {
    FaultKind::ALL
        .iter()
        .copied()
        .filter(|kind| match kind {
            FaultKind::PgSlow => pg.can_slow_down(),
            FaultKind::CellHandover => HANDOVER_FAULT_APPLIED && handover_available(),
            _ => true,
        })
        .collect()
}

/// The extension point for the live handover of issue 23: the kind is drawn only when the
/// binary answers `orca-relay handover --help`. Its fault is applied by
/// [`Nemesis::handover`].
pub fn handover_available() -> bool {
    std::process::Command::new(env!("CARGO_BIN_EXE_orca-relay"))
        .args(["handover", "--help"])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

pub const SHAPE: Shape = Shape {
    directors: DIRECTORS,
    cells: CELLS,
    slots: SLOTS,
};

/// Commands to the thread that stops and starts PostgreSQL, so a slow start never holds up
/// the faults scheduled behind it.
enum DbOp {
    Stop(&'static str),
    Start,
}

/// Applies the schedule.
struct Nemesis<'a> {
    fleet: &'a Fleet,
    pg: &'a Arc<Postgres>,
    history: &'a Arc<History>,
    knowledge: &'a Arc<Knowledge>,
    db_ops: Sender<DbOp>,
    slots: Vec<u32>,
    /// Cells flipped to `db` and written back to `reserve`, whose operator's record waits until
    /// their row says `reserve` again.
    returning: Vec<usize>,
    /// Faults whose begin was skipped: their end is skipped too.
    skipped: Vec<usize>,
    applied: BTreeMap<FaultKind, usize>,
    reserve_writes: usize,
}

impl Nemesis<'_> {
    fn begin(&mut self, fault: &Fault) -> bool {
        let h = self.history;
        let k = self.knowledge;
        match (fault.kind, fault.target) {
            (FaultKind::DirectorKill, Target::Director(d)) => self.fleet.directors[d].kill9(k, h),
            (FaultKind::CellPause, Target::Cell(c)) => self.fleet.cells[c].pause(k, h),
            (FaultKind::CellKill, Target::Cell(c)) => self.fleet.cells[c].kill9(k, h),
            (FaultKind::CellDrain, Target::Cell(c)) => {
                let cell = &self.fleet.cells[c];
                let terminated = cell.terminate(k, h);
                if terminated {
                    cell.start_after_exit(fault.duration_ms);
                }
                terminated
            }
            (FaultKind::PgRestartFast, _) => self.db_ops.send(DbOp::Stop("fast")).is_ok(),
            (FaultKind::PgRestartImmediate, _) => self.db_ops.send(DbOp::Stop("immediate")).is_ok(),
            (FaultKind::PgUnreachable, _) => {
                self.pg.set_reachable(false);
                k.pg_cut(h.now_ms());
                true
            }
            (FaultKind::PgSlow, _) => {
                self.pg.set_cpu_limit(Some(fault.value as u32));
                true
            }
            (FaultKind::SwitchRearm, Target::Cell(c)) => {
                self.fleet.write_switch(c, true, self.slots[c]);
                true
            }
            (FaultKind::SwitchDb, Target::Cell(c)) => {
                // The operator records the flip first, so no claim ever counts it as a slot.
                if self.returning.contains(&c) || !self.fleet.record_admit_mode(c, "db") {
                    return false;
                }
                k.deliberate_db_began(c, h.now_ms());
                self.fleet.write_switch(c, false, self.slots[c]);
                true
            }
            (FaultKind::SwitchSlots, Target::Cell(c)) => {
                self.slots[c] = fault.value as u32;
                self.fleet.write_switch(c, true, self.slots[c]);
                true
            }
            (FaultKind::ClockJump, target) => {
                let proc = match target {
                    Target::Director(d) => &self.fleet.directors[d],
                    Target::Cell(c) => &self.fleet.cells[c],
                    Target::Database => return false,
                };
                if proc.phase() != Phase::Up {
                    return false;
                }
                proc.set_clock_offset_ms(fault.value);
                proc.kill9(k, h)
            }
            (FaultKind::CellHandover, Target::Cell(c)) => self.handover(c, fault.value),
            _ => false,
        }
    }

    fn end(&mut self, fault: &Fault) {
        let h = self.history;
        let k = self.knowledge;
        let now = h.now_ms();
        match (fault.kind, fault.target) {
            (FaultKind::DirectorKill, Target::Director(d)) => self.fleet.directors[d].start_at(now),
            (FaultKind::CellPause, Target::Cell(c)) => {
                self.fleet.cells[c].resume(k, h);
            }
            (FaultKind::CellKill, Target::Cell(c)) => self.fleet.cells[c].start_at(now),
            (FaultKind::ClockJump, Target::Director(d)) => self.fleet.directors[d].start_at(now),
            (FaultKind::ClockJump, Target::Cell(c)) => self.fleet.cells[c].start_at(now),
            (FaultKind::PgRestartFast | FaultKind::PgRestartImmediate, _) => {
                let _ = self.db_ops.send(DbOp::Start);
            }
            (FaultKind::PgUnreachable, _) => {
                self.pg.set_reachable(true);
                k.pg_healed(h.now_ms());
            }
            (FaultKind::PgSlow, _) => self.pg.set_cpu_limit(None),
            (FaultKind::SwitchDb, Target::Cell(c)) => {
                self.fleet.write_switch(c, true, self.slots[c]);
                self.reserve_writes += 1;
                self.returning.push(c);
            }
            (FaultKind::SwitchSlots, Target::Cell(c)) => {
                self.slots[c] = SLOTS;
                self.fleet.write_switch(c, true, SLOTS);
            }
            _ => {}
        }
    }

    /// The live handover of issue 23 on cell `c` ([`fleet::Proc::hand_over`]): the command runs
    /// on a thread of its own; the supervisor follows the next process once it committed. The
    /// [`Knowledge`] does not change (the cell serves throughout), so no stream may be cut and
    /// no trip is excused by it. A `step` moves the cell's wall clock first: the next process
    /// starts with it, the running one never sees it.
    fn handover(&mut self, c: usize, step: i64) -> bool {
        let cell = &self.fleet.cells[c];
        if step != 0 {
            cell.set_clock_offset_ms(cell.clock_offset_ms() + step);
        }
        cell.hand_over(self.history)
    }

    /// Puts the operator's record of a cell back to `reserve` once its row says `reserve`
    /// again (a record written before the row would count the cell's `db` row as a slot). The
    /// row is read as the cell reports it (`orca_relay_admit_mode{kind="effective"}`, the row
    /// it last wrote), over HTTP with a deadline: the nemesis never waits on the database,
    /// which one of its own faults may be starving.
    fn settle_returns(&mut self) {
        let mut still = Vec::new();
        for c in std::mem::take(&mut self.returning) {
            let row_reserve = self
                .fleet
                .metrics(knowledge::Who::Cell(c))
                .and_then(|m| m.get("orca_relay_admit_mode{kind=\"effective\"}").copied())
                == Some(1.0);
            if row_reserve && self.fleet.record_admit_mode(c, "reserve") {
                self.knowledge.deliberate_db_ended(c, self.history.now_ms());
            } else {
                still.push(c);
            }
        }
        self.returning = still;
    }
}

/// Runs one seed on `pg`; returns how it went (it never panics on a broken promise: the
/// caller decides).
pub fn run(pg: &Arc<Postgres>, settings: &Settings) -> Outcome {
    let label = format!(
        "{}s-{}",
        settings.length.as_secs(),
        orca_relay::clock::system().now_ms()
    );
    let history = History::create(&history_dir(), settings.seed, &label);
    let knowledge = Arc::new(Knowledge::new(DIRECTORS, CELLS, SLOTS));
    let kinds = available_kinds(pg);
    let schedule = schedule::draw(
        settings.seed,
        settings.length.as_millis() as u64,
        SHAPE,
        &kinds,
    );
    history.header(format!(
        "nemesis seed={} length_s={} desktops={} cut={} replay=\"{}\"",
        settings.seed,
        settings.length.as_secs(),
        settings.desktops,
        pg.cut_mechanism(),
        settings.replay
    ));
    for note in &pg.notes {
        history.header(format!("note {note}"));
    }
    history.header(format!(
        "available kinds: {}",
        kinds
            .iter()
            .map(|k| k.as_str())
            .collect::<Vec<_>>()
            .join(" ")
    ));
    history.header(format!(
        "windows_ms: {}",
        (0..CELLS)
            .map(|c| format!("c{c}={}", checkers::window_ms(c)))
            .collect::<Vec<_>>()
            .join(" ")
    ));
    history.header(format!("schedule: {} faults", schedule.len()));
    for fault in &schedule {
        history.header(format!("  {fault}"));
    }

    let database = format!("nemesis_{}", settings.seed);
    pg.create_database(&database);
    let run_dir = history_dir().join(format!("run-{}-{label}", settings.seed));
    let _ = std::fs::remove_dir_all(&run_dir);
    std::fs::create_dir_all(&run_dir).expect("create the run directory");
    let budget = checkers::budget(&run_dir);
    history.header(format!(
        "budget (orca-relay budget):\n{}",
        budget.table.trim_end()
    ));
    let checkers = Arc::new(Checkers::new(history.clone(), knowledge.clone()));
    let mut fleet = Fleet::start(
        pg.fleet_url(&database),
        &run_dir,
        history.clone(),
        knowledge.clone(),
        checkers.clone(),
    );
    let mut sampler = Sampler::start(
        pg.clone(),
        database.clone(),
        budget,
        history.clone(),
        knowledge.clone(),
    );
    let clients = Clients::start(
        settings.seed,
        settings.desktops,
        Endpoints {
            directors: fleet.directors.iter().map(|d| d.http_url("")).collect(),
            cells: fleet.cells.iter().map(|c| c.ws_url()).collect(),
        },
        history.clone(),
        knowledge.clone(),
    );
    let connected = crate::harness::wait_until(Duration::from_secs(60), || {
        clients.cells().iter().all(Option::is_some)
    });
    if !connected {
        history.violation(
            Checker::Liveness,
            format!(
                "not every desktop connected before the nemesis began: {:?}",
                clients.cells()
            ),
        );
    }
    history.event("nemesis_begins");

    // The database's stops and starts run on their own thread, in order.
    let (db_ops, db_rx) = mpsc::channel::<DbOp>();
    let db_thread = {
        let (pg, history, knowledge) = (pg.clone(), history.clone(), knowledge.clone());
        orca_relay::threads::spawn("nemesis-db-ops", move || {
            for op in db_rx {
                match op {
                    DbOp::Stop(mode) => {
                        knowledge.pg_stopped(history.now_ms());
                        pg.stop(mode);
                        history.event(format!("postgres_stopped mode={mode}"));
                    }
                    DbOp::Start => {
                        pg.start();
                        knowledge.pg_started(history.now_ms());
                        history.event("postgres_started");
                    }
                }
            }
        })
        .expect("spawn the database thread")
    };

    let origin = history.now_ms();
    let mut actions: Vec<(u64, usize, bool)> = schedule
        .iter()
        .flat_map(|f| {
            let begin = (origin + f.at_ms, f.id, true);
            let has_end = !matches!(f.kind, FaultKind::SwitchRearm | FaultKind::CellHandover);
            let end = has_end.then_some((origin + f.at_ms + f.duration_ms, f.id, false));
            std::iter::once(begin).chain(end)
        })
        .collect();
    actions.sort();
    let mut nemesis = Nemesis {
        fleet: &fleet,
        pg,
        history: &history,
        knowledge: &knowledge,
        db_ops,
        slots: vec![SLOTS; CELLS],
        returning: Vec::new(),
        skipped: Vec::new(),
        applied: BTreeMap::new(),
        reserve_writes: 0,
    };
    for (at, id, begin) in actions {
        while history.now_ms() < at {
            nemesis.settle_returns();
            let left = at.saturating_sub(history.now_ms());
            orca_relay::clock::sleep(Duration::from_millis(left.min(100)));
        }
        let fault = &schedule[id];
        if begin {
            if nemesis.begin(fault) {
                *nemesis.applied.entry(fault.kind).or_insert(0) += 1;
                history.event(format!("fault_begin {fault}"));
            } else {
                nemesis.skipped.push(id);
                history.event(format!(
                    "fault_skipped {fault} (target not in a state to take it)"
                ));
            }
        } else if !nemesis.skipped.contains(&id) {
            nemesis.end(fault);
            history.event(format!("fault_end fault={id} kind={}", fault.kind));
        }
    }
    let length_end = origin + settings.length.as_millis() as u64;
    while history.now_ms() < length_end {
        nemesis.settle_returns();
        orca_relay::clock::sleep(Duration::from_millis(100));
    }

    // The nemesis stops: every fault is over; make sure of it.
    history.event("nemesis_stops");
    drop(std::mem::replace(&mut nemesis.db_ops, mpsc::channel().0));
    let _ = db_thread.join();
    if !knowledge.pg_available_at(history.now_ms()) {
        pg.set_reachable(true);
        knowledge.pg_healed(history.now_ms());
    }
    pg.set_cpu_limit(None);
    for proc in fleet.all() {
        if proc.phase() == Phase::Paused {
            proc.resume(&knowledge, &history);
        }
        if !proc.wanted_running() {
            proc.start_at(history.now_ms());
        }
    }
    let settle_until = history.now_ms() + checkers::LIVENESS_DEADLINE.as_millis() as u64;
    while !nemesis.returning.is_empty() && history.now_ms() < settle_until {
        nemesis.settle_returns();
        orca_relay::clock::sleep(Duration::from_millis(100));
    }
    let applied = std::mem::take(&mut nemesis.applied);
    let skipped = nemesis.skipped.len();
    let reserve_writes = nemesis.reserve_writes;
    drop(nemesis);

    let liveness_ms = checkers.liveness(&fleet, pg, &database, &|| clients.cells());
    sampler.stop();
    let client_counts = clients.stop();
    fleet.teardown();

    let violations = history.violations();
    let samples: BTreeMap<&'static str, u64> = Checker::ALL
        .iter()
        .map(|c| (c.as_str(), history.samples(*c)))
        .collect();
    let outcome = Outcome {
        seed: settings.seed,
        history: history.path.clone(),
        violations,
        applied,
        skipped,
        reserve_writes,
        clients: client_counts,
        trips: checkers.trips.load(std::sync::atomic::Ordering::Relaxed),
        helds: checkers.helds.load(std::sync::atomic::Ordering::Relaxed),
        liveness_ms,
        samples,
        replay: settings.replay.clone(),
    };
    history.event(format!(
        "verdict {}",
        outcome.summary().replace('\n', "\n    ")
    ));
    if !outcome.passed() || std::env::var_os("ORCA_RELAY_NEMESIS_KEEP_LOGS").is_some() {
        // Every process's whole log beside the history, for the post-mortem.
        for proc in fleet.all() {
            let path = history.path.with_extension(format!("{}.log", proc.name));
            let text: String = proc
                .log_lines()
                .iter()
                .map(|l| format!("t={} run={} {}\n", l.t, l.incarnation, l.text))
                .collect();
            let _ = std::fs::write(&path, text);
        }
        history.header(format!(
            "process logs: {}",
            history.path.with_extension("<process>.log").display()
        ));
    }
    history.flush();
    let _ = std::fs::remove_dir_all(&run_dir);
    outcome
}
