//! The checkers: the fleet's promises, judged from the database itself, the processes' logs and
//! metrics, and the harness's own [`Knowledge`] of who was up, paused or cut off.
//!
//! - The **sampler** thread reads the database every [`SAMPLE_EVERY`] over PostgreSQL's Unix
//!   socket (no network fault reaches it): the admit-effective rows counted exactly as
//!   `src/store/claim.rs` counts slot holders, on the database's clock (checker 1), and
//!   `pg_stat_activity` per role against `orca-relay budget` of the fleet's file (checker 2).
//! - Every log line passes through [`Checkers::line`]: a trip or held line is judged against
//!   the directors' reachability (checker 3), a drain's final row write before its
//!   watchdog's stop line is a slot that may outlive the process (checker 1), a panic line is
//!   a violation (checker 6).
//! - [`Checkers::liveness`] judges the fleet after the nemesis stops (checker 5).
//!
//! Checker 4 (streams and close codes) lives with the clients; the supervisor reports deaths
//! (checker 6).

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::net::SocketAddr;
use std::path::Path;
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use super::fleet::{
    Fleet, Observer, Phase, CELLS, CELL_POOL_MAX, CELL_POOL_RESERVE_MAX, DEAD_MAN_BASE_MS,
    DEAD_MAN_SPREAD_MS, DIRECTORS, DIRECTOR_POOL_MAX, FEED_POLL_MS, SLOTS, TRIP_SLOT_STALE_MS,
};
use super::history::{Checker, History};
use super::knowledge::{Knowledge, Who};
use super::postgres::{Postgres, MAX_CONNECTIONS, SUPERUSER_RESERVED};
use crate::harness::SERVICE_TOKEN;

/// How often the sampler reads the database.
pub const SAMPLE_EVERY: Duration = Duration::from_millis(100);
/// After the nemesis stops, the fleet must be whole again within this.
pub const LIVENESS_DEADLINE: Duration = Duration::from_secs(30);
/// Checker 3's tolerances. The last contact before the directors went away may be up to two
/// poll periods (the contact promise, SPEC §11) plus scheduling on a loaded machine before the
/// moment the harness saw the last director go; a director that came back needs two poll
/// periods (plus its first listing) before its polls arrive. Both stay far below a window
/// (2.5 s), so a cell that trips on its own pause, or a poll backoff that outlasts the pause
/// guard's grace, is still caught.
const TRIP_TOLERANCE_BEFORE_MS: u64 = 2 * FEED_POLL_MS + 500;
const TRIP_TOLERANCE_AFTER_MS: u64 = 2 * FEED_POLL_MS + 500;
/// A new slot count reaches a cell within its switch poll; its claims in that time may still
/// use the previous one.
const SLOTS_MARGIN_MS: u64 = 2_000;
/// A claim asked for before a re-arm may commit after it (the database cut off, the cell
/// paused): that far back a re-arm excuses a holder over its cap, provided the cell drops the
/// stale permit and frees the slot within [`STALE_PERMIT_RELEASE_MS`].
const STALE_PERMIT_LOOKBACK_MS: u64 = 15_000;
const STALE_PERMIT_RELEASE_MS: u64 = 1_500;
/// A drained cell's final write lands before it exits; the sample may be this old.
const LEAK_GRACE_MS: u64 = 300;
/// A deliberate `db` flip's full pool shrinks back once the cell is `reserve` again.
const FLIP_MARGIN_MS: u64 = 2_000;

/// The fleet file's budget, as `orca-relay budget` computed it.
#[derive(Debug, Clone)]
pub struct Budget {
    /// The cells line with `k` cells deliberately in `db` (index `k`).
    pub cells_line: Vec<u64>,
    pub directors: u64,
    /// `max_connections` − reserve.
    pub usable: u64,
    pub table: String,
}

/// Writes the fleet's file (TOML) and runs `orca-relay budget` on it.
pub fn budget(dir: &Path) -> Budget {
    let mut file = format!(
        "# The nemesis fleet: {DIRECTORS} directors, {CELLS} reserve cells, deadManTripSlots={SLOTS}.\n\
         name = \"nemesis fleet\"\n\
         max_connections = {MAX_CONNECTIONS}\n\
         reserve = {SUPERUSER_RESERVED}\n\
         dead_man_trip_slots = {SLOTS}\n\
         [fixed_consumers]\n\
         directors = {}\n\
         nemesis_checkers = 2\n\
         [[cell_groups]]\n\
         name = \"cells\"\n\
         count = {CELLS}\n\
         pool = {CELL_POOL_MAX}\n\
         mode = \"reserve\"\n\
         measured_peak = {CELL_POOL_RESERVE_MAX}\n",
        DIRECTORS as u32 * DIRECTOR_POOL_MAX
    );
    for k in 1..=CELLS {
        file.push_str(&format!(
            "[[scenarios]]\nname = \"{k} flipped to db\"\nflip_to_db = [{{ group = \"cells\", count = {k} }}]\n"
        ));
    }
    let path = dir.join("nemesis-fleet.toml");
    std::fs::write(&path, file).expect("write the fleet file");
    let output = Command::new(env!("CARGO_BIN_EXE_orca-relay"))
        .arg("budget")
        .arg(&path)
        .output()
        .expect("run orca-relay budget");
    let table = String::from_utf8_lossy(&output.stdout).to_string();
    assert!(
        output.status.success(),
        "orca-relay budget {}: {table}{}",
        path.display(),
        String::from_utf8_lossy(&output.stderr)
    );
    // The table: a `scenario …` header, then one row per scenario (the base fleet first), each
    // ending with the cells line's total, operating, usable and spare.
    let cells_line: Vec<u64> = table
        .lines()
        .skip_while(|line| !line.starts_with("scenario"))
        .skip(1)
        .take_while(|line| !line.trim().is_empty())
        .filter_map(|line| {
            let tokens: Vec<&str> = line.split_whitespace().collect();
            tokens.get(tokens.len().checked_sub(4)?)?.parse().ok()
        })
        .collect();
    assert_eq!(
        cells_line.len(),
        CELLS + 1,
        "one row per scenario in:\n{table}"
    );
    Budget {
        cells_line,
        directors: u64::from(DIRECTORS as u32 * DIRECTOR_POOL_MAX),
        usable: MAX_CONNECTIONS - SUPERUSER_RESERVED,
        table,
    }
}

/// A cell's dead-man window, as the cell computes it (SPEC §5.5).
pub fn window_ms(c: usize) -> u64 {
    orca_relay::dead_man::window::window_ms(&format!("c{c}"), DEAD_MAN_BASE_MS, DEAD_MAN_SPREAD_MS)
}

pub struct Checkers {
    history: Arc<History>,
    knowledge: Arc<Knowledge>,
    pub trips: AtomicU64,
    pub helds: AtomicU64,
    /// Each cell's watchdog as its log lines tell: (the process's run, running). A drain's
    /// final write must come after its watchdog's last line (checker 1).
    watchdogs: Mutex<BTreeMap<usize, (u32, bool)>>,
}

impl Checkers {
    pub fn new(history: Arc<History>, knowledge: Arc<Knowledge>) -> Checkers {
        Checkers {
            history,
            knowledge,
            trips: AtomicU64::new(0),
            helds: AtomicU64::new(0),
            watchdogs: Mutex::new(BTreeMap::new()),
        }
    }

    /// Checker 3: a trip or held line at `t` must come after a silence at least as long as the
    /// cell's window in which no director could reach it: every director down or without the
    /// cell list, or the cell still starting (its own pauses do not count: a director polling a
    /// paused cell reaches it the moment it resumes).
    fn judge_trip(&self, c: usize, t: u64, what: &str, generation: Option<u64>) {
        let window = window_ms(c);
        let judged_at = t.saturating_sub(TRIP_TOLERANCE_AFTER_MS);
        let last_reachable = self.knowledge.last_reachable_at_or_before(c, judged_at);
        let fresh = self.knowledge.fresh_window_at_or_before(c, t, generation);
        let silence_from = last_reachable.unwrap_or(0).max(fresh);
        let silence = t.saturating_sub(silence_from);
        self.history.event(format!(
            "dead_man cell=c{c} {what} window_ms={window} unreachable_since={silence_from} (last reachable={last_reachable:?}, fresh window={fresh})"
        ));
        if silence + TRIP_TOLERANCE_BEFORE_MS < window {
            let paused =
                self.knowledge
                    .cell_paused_during(c, silence_from.saturating_sub(window), t);
            self.history.violation(
                Checker::FalseTrip,
                format!(
                    "c{c} {what} at t={t}, but a director could reach it until t={silence_from} ({silence} ms of unreachability against a window of {window} ms; the cell was paused in that time: {paused})"
                ),
            );
        }
    }

    /// Checker 5: after the nemesis stops, within [`LIVENESS_DEADLINE`]: every process up,
    /// `/ready` 200 everywhere, every desktop connected, every cell armed or tripped holding a
    /// slot by the claim's rule (none held, none tripped without a slot), and `orca-relay fleet
    /// status` agreeing with the database. Returns how long it took.
    pub fn liveness(
        &self,
        fleet: &Fleet,
        pg: &Postgres,
        database: &str,
        desktops: &dyn Fn() -> Vec<Option<usize>>,
    ) -> Option<u64> {
        let started = self.history.now_ms();
        let deadline = started + LIVENESS_DEADLINE.as_millis() as u64;
        let mut admin = None;
        loop {
            let problems = self.liveness_problems(fleet, pg, database, desktops, &mut admin);
            let now = self.history.now_ms();
            if problems.is_empty() {
                self.history
                    .event(format!("liveness ok after_ms={}", now - started));
                return Some(now - started);
            }
            if now > deadline {
                let stuck: Vec<String> = fleet
                    .all()
                    .filter(|p| p.phase() != Phase::Up)
                    .map(|p| format!("{} threads: {}", p.name, p.thread_states()))
                    .collect();
                self.history.violation(
                    Checker::Liveness,
                    format!(
                        "the fleet was not whole {} s after the nemesis stopped: {}\n{}",
                        LIVENESS_DEADLINE.as_secs(),
                        problems.join("; "),
                        stuck.join("\n")
                    ),
                );
                return None;
            }
            orca_relay::clock::sleep(Duration::from_millis(250));
        }
    }

    fn liveness_problems(
        &self,
        fleet: &Fleet,
        pg: &Postgres,
        database: &str,
        desktops: &dyn Fn() -> Vec<Option<usize>>,
        admin: &mut Option<postgres::Client>,
    ) -> Vec<String> {
        let mut problems = Vec::new();
        for proc in fleet.all() {
            if proc.phase() != Phase::Up {
                problems.push(format!("{} is {:?}", proc.name, proc.phase()));
            } else if fleet.get(proc.who, "/ready").map(|(s, _)| s) != Some(200) {
                problems.push(format!("{} /ready is not 200", proc.name));
            }
        }
        let offline: Vec<usize> = desktops()
            .iter()
            .enumerate()
            .filter(|(_, cell)| cell.is_none())
            .map(|(i, _)| i)
            .collect();
        if !offline.is_empty() {
            problems.push(format!("desktops without a control: {offline:?}"));
        }
        if admin.is_none() {
            *admin = pg.admin(database);
        }
        let Some(client) = admin.as_mut() else {
            problems.push("the database does not answer".into());
            return problems;
        };
        let holders = match read_rows(client) {
            Ok(rows) => holders(&rows),
            Err(e) => {
                *admin = None;
                problems.push(format!("reading the database failed: {e}"));
                return problems;
            }
        };
        let mut tripped = 0;
        for c in 0..CELLS {
            match fleet.dead_man_state(c).as_deref() {
                Some("armed") => {}
                Some("tripped") => {
                    tripped += 1;
                    if !holders.contains(&c) {
                        problems.push(format!("c{c} is tripped without holding a slot"));
                    }
                }
                other => problems.push(format!("c{c} dead-man is {other:?}")),
            }
        }
        if holders.len() > SLOTS as usize {
            problems.push(format!("{} slot holders: {holders:?}", holders.len()));
        }
        for director in &fleet.directors {
            match fleet_status(&director.http_url("")) {
                Ok(listing) => {
                    let summary = &listing["summary"];
                    let expect = |key: &str, value: u64| -> Option<String> {
                        let got = pointer(summary, key);
                        (got != Some(value)).then(|| {
                            format!("fleet status via {}: {key} is {got:?}, the database and metrics say {value}", director.name)
                        })
                    };
                    let disagreements: Vec<String> = [
                        expect("/cells", CELLS as u64),
                        expect("/byState/live", CELLS as u64),
                        expect("/ready", CELLS as u64),
                        expect("/slotsTaken", holders.len() as u64),
                        expect("/byDeadMan/tripped", tripped),
                        expect("/byDeadMan/held", 0),
                        expect("/byDeadMan/armed", CELLS as u64 - tripped),
                    ]
                    .into_iter()
                    .flatten()
                    .collect();
                    if !disagreements.is_empty() {
                        // Which cell: each one's state, incarnation and report as listed.
                        let cells: Vec<String> = listing["cells"]
                            .as_array()
                            .map(|cells| {
                                cells
                                    .iter()
                                    .map(|cell| {
                                        format!(
                                            "{}:{}:inc={}:report={}",
                                            cell["cellId"].as_str().unwrap_or("?"),
                                            cell["state"].as_str().unwrap_or("?"),
                                            cell["incarnation"],
                                            cell["status"]
                                        )
                                    })
                                    .collect()
                            })
                            .unwrap_or_default();
                        problems.extend(disagreements);
                        problems.push(format!(
                            "cells as {} lists them: {}",
                            director.name,
                            cells.join(" ")
                        ));
                    }
                }
                Err(e) => problems.push(format!("fleet status via {}: {e}", director.name)),
            }
        }
        problems
    }
}

impl Checkers {
    /// Checker 1, a drained cell's slot: the drain writes the row's last word only once the
    /// watchdog, its only other writer, has stopped; a watchdog tick after the final write
    /// would write a tripped cell's `db` back, and the slot would outlive the process by
    /// `TRIP_SLOT_STALE_MS`. That tick needs a race of microseconds, so the order is judged
    /// from the lines each thread writes itself (one process's lines keep their order).
    fn judge_drain_order(&self, c: usize, incarnation: u32, text: &str) {
        let mut watchdogs = self.watchdogs.lock().unwrap_or_else(|e| e.into_inner());
        if text.contains("orca_relay_dead_man_started ") {
            watchdogs.insert(c, (incarnation, true));
        } else if text.contains("orca_relay_dead_man_stopped ") {
            watchdogs.insert(c, (incarnation, false));
        } else if text.contains("orca_relay_drain_final_write ")
            && watchdogs.get(&c) == Some(&(incarnation, true))
        {
            self.history.violation(
                Checker::Bound,
                format!(
                    "c{c} (run {incarnation}) wrote its drain's final row while its watchdog still ran: a tick after it could write a tripped cell's db back, a slot outliving the process"
                ),
            );
        }
    }
}

impl Observer for Checkers {
    fn line(&self, who: Who, incarnation: u32, t: u64, text: &str) {
        let name = match who {
            Who::Director(d) => format!("d{d}"),
            Who::Cell(c) => format!("c{c}"),
        };
        if text.contains("panicked") {
            self.history.violation(
                Checker::Deaths,
                format!("{name} (run {incarnation}) logged a panic: {text}"),
            );
        }
        if let Who::Director(d) = who {
            if text.contains("orca_relay_director_feed_poller_cells_listed") {
                self.knowledge.director_listed(d, t);
            }
            if text.contains("orca_relay_migrations_applied") {
                self.knowledge.director_migrated(d, t);
            }
        }
        if let Who::Cell(c) = who {
            // The line names the switch generation it was judged under.
            let generation = text
                .split_whitespace()
                .find_map(|field| field.strip_prefix("generation="))
                .and_then(|g| g.parse().ok());
            self.judge_drain_order(c, incarnation, text);
            if text.contains("orca_relay_cell_reserve_dead_man_tripped") {
                self.trips.fetch_add(1, Ordering::Relaxed);
                self.judge_trip(c, t, "tripped", generation);
            } else if text.contains("orca_relay_cell_reserve_dead_man_held") {
                self.helds.fetch_add(1, Ordering::Relaxed);
                self.judge_trip(c, t, "held", generation);
            }
        }
    }
}

/// `orca-relay fleet status --director URL --json`: the listing (`summary`, `cells`).
fn fleet_status(director: &str) -> Result<serde_json::Value, String> {
    let output = Command::new(env!("CARGO_BIN_EXE_orca-relay"))
        .args(["fleet", "status", "--director", director, "--json"])
        .env_clear()
        .env("ORCA_RELAY_SERVICE_TOKEN", SERVICE_TOKEN)
        .output()
        .map_err(|e| e.to_string())?;
    if !output.status.success() {
        return Err(String::from_utf8_lossy(&output.stderr).trim().to_string());
    }
    serde_json::from_slice(&output.stdout).map_err(|e| e.to_string())
}

fn pointer(value: &serde_json::Value, path: &str) -> Option<u64> {
    value.pointer(path)?.as_u64()
}

/// How far ahead of the database's clock a row's stamp may seem (the stamp is the writing
/// transaction's time, the sample's clock is read later: never ahead, in truth).
const STAMP_AHEAD_TOLERANCE_MS: i64 = 1_000;

/// One admit-effective row with the operator's record and its age on the database's clock.
#[derive(Debug, Clone)]
struct Row {
    cell: usize,
    mode: String,
    admit_mode: String,
    age_ms: i64,
}

fn read_rows(client: &mut postgres::Client) -> Result<Vec<Row>, String> {
    let rows = client
        .query(
            "SELECT e.cell_id, e.mode, COALESCE(m.admit_mode, 'db'), relay_now_ms() - e.updated_at
             FROM relay_cell_admit_effective e
             LEFT JOIN relay_cell_admit_modes m ON m.cell_id = e.cell_id",
            &[],
        )
        .map_err(|e| e.to_string())?;
    Ok(rows
        .iter()
        .filter_map(|row| {
            let id: String = row.try_get(0).ok()?;
            Some(Row {
                cell: id.strip_prefix('c')?.parse().ok()?,
                mode: row.try_get(1).ok()?,
                admit_mode: row.try_get(2).ok()?,
                age_ms: row.try_get(3).ok()?,
            })
        })
        .collect())
}

/// The live slot holders, exactly as the claim counts them (`src/store/claim.rs`): the row says
/// `db`, the operator's record says `reserve`, refreshed within `TRIP_SLOT_STALE_MS` on the
/// database's clock.
fn holders(rows: &[Row]) -> BTreeSet<usize> {
    rows.iter()
        .filter(|r| {
            r.mode == "db" && r.admit_mode == "reserve" && r.age_ms <= TRIP_SLOT_STALE_MS as i64
        })
        .map(|r| r.cell)
        .collect()
}

/// The local ports of this machine's ESTABLISHED TCP connections to `server`: a backend whose
/// client port is not among them belongs to a process that is gone (killed during a cut: its
/// FIN has not reached the server yet), and no running process holds it.
fn established_client_ports(server: SocketAddr) -> HashSet<u16> {
    let SocketAddr::V4(server) = server else {
        return HashSet::new();
    };
    let remote = format!(
        "{:08X}:{:04X}",
        u32::from_le_bytes(server.ip().octets()),
        server.port()
    );
    std::fs::read_to_string("/proc/net/tcp")
        .unwrap_or_default()
        .lines()
        .skip(1)
        .filter_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let (local, rem, state) = (fields.get(1)?, fields.get(2)?, fields.get(3)?);
            if *rem != remote || *state != "01" {
                return None;
            }
            u16::from_str_radix(local.rsplit_once(':')?.1, 16).ok()
        })
        .collect()
}

/// The sampler thread (checkers 1 and 2).
pub struct Sampler {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

struct SamplerState {
    holding_since: BTreeMap<usize, u64>,
    last_summary: String,
    last_written: u64,
    reported: HashSet<String>,
    /// Holders over their own cap that a recent re-arm may release at once (a dropped permit
    /// of an earlier generation): cell → (first seen, the violation if it stays).
    stale_permits: BTreeMap<usize, (u64, String)>,
    failures: u64,
    samples: u64,
    sample_ms_total: u64,
    sample_ms_max: u64,
}

impl Sampler {
    pub fn start(
        pg: Arc<Postgres>,
        database: String,
        budget: Budget,
        history: Arc<History>,
        knowledge: Arc<Knowledge>,
    ) -> Sampler {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let thread = orca_relay::threads::spawn("nemesis-sampler", move || {
            let filter_zombies = pg.cut_mechanism() == "namespace";
            let server = pg.fleet_addr();
            let mut admin: Option<postgres::Client> = None;
            let state = Mutex::new(SamplerState {
                holding_since: BTreeMap::new(),
                last_summary: String::new(),
                last_written: 0,
                reported: HashSet::new(),
                stale_permits: BTreeMap::new(),
                failures: 0,
                samples: 0,
                sample_ms_total: 0,
                sample_ms_max: 0,
            });
            while !flag.load(Ordering::SeqCst) {
                let t = history.now_ms();
                if admin.is_none() {
                    admin = pg.admin(&database);
                }
                if let Some(client) = admin.as_mut() {
                    let result = sample(
                        client,
                        &database,
                        t,
                        &budget,
                        &history,
                        &knowledge,
                        &mut state.lock().unwrap(),
                        filter_zombies.then_some(server),
                    );
                    if let Err(e) = result {
                        admin = None;
                        let mut state = state.lock().unwrap();
                        state.failures += 1;
                        if state.failures == 1 || state.failures.is_multiple_of(50) {
                            history.event(format!(
                                "sample_failed failures={} error=\"{e}\"",
                                state.failures
                            ));
                        }
                    }
                }
                let spent = history.now_ms() - t;
                {
                    let mut state = state.lock().unwrap();
                    state.samples += 1;
                    state.sample_ms_total += spent;
                    state.sample_ms_max = state.sample_ms_max.max(spent);
                }
                orca_relay::clock::sleep(SAMPLE_EVERY.saturating_sub(Duration::from_millis(spent)));
            }
            let state = state.lock().unwrap();
            history.event(format!(
                "sampler_stopped samples={} mean_ms={} max_ms={} failures={}",
                state.samples,
                state.sample_ms_total / state.samples.max(1),
                state.sample_ms_max,
                state.failures
            ));
        })
        .expect("spawn the sampler");
        Sampler {
            stop,
            thread: Some(thread),
        }
    }

    pub fn stop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

impl Drop for Sampler {
    fn drop(&mut self) {
        self.stop();
    }
}

/// One sample: checker 1 (bound, and no slot outliving a clean exit) and checker 2 (budget).
#[allow(clippy::too_many_arguments)]
fn sample(
    client: &mut postgres::Client,
    database: &str,
    t: u64,
    budget: &Budget,
    history: &History,
    knowledge: &Knowledge,
    state: &mut SamplerState,
    zombie_filter: Option<SocketAddr>,
) -> Result<(), String> {
    let rows = read_rows(client)?;
    let activity = client
        .query(
            "SELECT COALESCE(application_name, ''), COALESCE(client_port, -1)
             FROM pg_stat_activity WHERE datname = $1 AND backend_type = 'client backend'",
            &[&database],
        )
        .map_err(|e| e.to_string())?;

    // Checker 1: the seed's bound, deliberate `db` flips excepted.
    // Slot liveness is judged on the database's clock, so every row is stamped by it: a row
    // stamped ahead of it (a cell's own clock, five minutes fast) would count as a live holder
    // for minutes after its cell stopped refreshing it, past `TRIP_SLOT_STALE_MS`.
    for row in rows.iter().filter(|r| r.age_ms < -STAMP_AHEAD_TOLERANCE_MS) {
        if state.reported.insert(format!("stamp:{}", row.cell)) {
            history.violation(
                Checker::Bound,
                format!(
                    "c{}'s admit-effective row is stamped {} ms ahead of the database's clock (mode {}): slot liveness is not judged on the database's clock",
                    row.cell, -row.age_ms, row.mode
                ),
            );
        }
    }
    let all_holders = holders(&rows);
    let holders: BTreeSet<usize> = all_holders
        .iter()
        .copied()
        .filter(|&c| !knowledge.deliberate_db(c, t, 0))
        .collect();
    state.holding_since.retain(|c, _| holders.contains(c));
    let arrivals: Vec<usize> = holders
        .iter()
        .copied()
        .filter(|c| !state.holding_since.contains_key(c))
        .collect();
    for &c in &holders {
        state.holding_since.entry(c).or_insert(t);
    }
    // Each claim is granted only while fewer than the claimant's own `deadManTripSlots` hold a
    // slot, so a new holder never makes more holders than its own cap allows (a cap lowered
    // later keeps the slots taken under the higher one, and a value set on another cell never
    // widens this cell's).
    // Several arrivals between two samples: in the order most favourable to the fleet (the
    // smallest caps first), each must still fit its own cap.
    let mut caps: Vec<(u32, usize)> = arrivals
        .iter()
        .map(|&c| {
            (
                knowledge.slots_of_during(c, t.saturating_sub(SLOTS_MARGIN_MS), t),
                c,
            )
        })
        .collect();
    caps.sort();
    let already = holders.len() - arrivals.len();
    for (k, &(own, c)) in caps.iter().enumerate() {
        let holders_then = already + k + 1;
        if holders_then as u32 > own {
            let detail = format!(
                "c{c} took a trip slot as holder number {holders_then} ({holders:?}) with its deadManTripSlots at {own}"
            );
            if knowledge.rearmed_during(c, t.saturating_sub(STALE_PERMIT_LOOKBACK_MS), t) {
                // Claimed under the generation before a re-arm (a larger cap, a claim held up by
                // an outage or a pause): the cell drops that permit and frees the slot at once.
                state.stale_permits.entry(c).or_insert((t, detail));
            } else if state.reported.insert(format!("arrival:{c}:{t}")) {
                history.violation(Checker::Bound, detail);
            }
        }
    }
    let stale: Vec<(usize, u64, String)> = state
        .stale_permits
        .iter()
        .map(|(c, (since, detail))| (*c, *since, detail.clone()))
        .collect();
    for (c, since, detail) in stale {
        if !holders.contains(&c) {
            state.stale_permits.remove(&c);
            history.event(format!(
                "stale_permit_released cell=c{c} held_ms={}",
                t - since
            ));
        } else if t > since + STALE_PERMIT_RELEASE_MS {
            state.stale_permits.remove(&c);
            history.violation(
                Checker::Bound,
                format!("{detail}; still holding {} ms later", t - since),
            );
        }
    }
    let oldest = state.holding_since.values().copied().min().unwrap_or(t);
    let bound = knowledge.largest_slots_during(oldest.saturating_sub(1_000), t);
    history.sampled(Checker::Bound);
    // A stale permit being released does not count (above).
    let counted = holders
        .iter()
        .filter(|c| !state.stale_permits.contains_key(c))
        .count();
    if counted as u32 > bound {
        let key = format!("bound:{holders:?}");
        if state.reported.insert(key) {
            let detail: Vec<String> = rows
                .iter()
                .map(|r| format!("c{}:{}/{}:{}ms", r.cell, r.mode, r.admit_mode, r.age_ms))
                .collect();
            history.violation(
                Checker::Bound,
                format!(
                    "{} cells hold a trip slot ({holders:?}) but deadManTripSlots is {bound}; rows: {}",
                    holders.len(),
                    detail.join(" ")
                ),
            );
        }
    }
    for &c in &all_holders {
        if let Some(exited) = knowledge.cell_gone_after_drain(c, t, LEAK_GRACE_MS) {
            let key = format!("leak:{c}:{exited}");
            if state.reported.insert(key) {
                history.violation(
                    Checker::Bound,
                    format!(
                        "c{c} drained and exited at t={exited}, yet its row still holds a trip slot at t={t} (the drain's write must be the row's last word)"
                    ),
                );
            }
        }
    }

    // Checker 2: the budget per role.
    let live_ports = zombie_filter.map(established_client_ports);
    let mut directors = 0u64;
    let mut cells = 0u64;
    let mut per_cell: BTreeMap<String, u64> = BTreeMap::new();
    let mut zombies = 0u64;
    let mut others = 0u64;
    for row in &activity {
        let name: String = row.get(0);
        let port: i32 = row.get(1);
        let live = live_ports
            .as_ref()
            .is_none_or(|ports| u16::try_from(port).is_ok_and(|p| ports.contains(&p)));
        if name.starts_with("orca-relay:") && !live {
            zombies += 1;
            continue;
        }
        if name == "orca-relay:director:director" {
            directors += 1;
        } else if let Some(cell) = name.strip_prefix("orca-relay:cell:") {
            cells += 1;
            *per_cell.entry(cell.to_string()).or_insert(0) += 1;
        } else {
            others += 1;
        }
    }
    let flipped = knowledge.deliberate_db_count(t, FLIP_MARGIN_MS);
    let cells_line = budget.cells_line[flipped.min(CELLS)];
    history.sampled(Checker::Budget);
    let mut over = Vec::new();
    if directors > budget.directors {
        over.push(format!("directors hold {directors} > {}", budget.directors));
    }
    if cells > cells_line {
        over.push(format!(
            "cells hold {cells} > the budget's cells line {cells_line} ({flipped} flipped to db)"
        ));
    }
    for (cell, n) in &per_cell {
        if *n > u64::from(CELL_POOL_MAX) {
            over.push(format!("{cell} holds {n} > its pool {CELL_POOL_MAX}"));
        }
    }
    if directors + cells + others > budget.usable {
        over.push(format!(
            "{} connections > usable {}",
            directors + cells + others,
            budget.usable
        ));
    }
    if !over.is_empty() {
        let key = format!("budget:{over:?}");
        if state.reported.insert(key) {
            history.violation(
                Checker::Budget,
                format!("{}; per cell {per_cell:?}", over.join("; ")),
            );
        }
    }

    let summary = format!(
        "holders={holders:?} bound={bound} directors={directors} cells={cells} per_cell={per_cell:?} zombies={zombies} flipped={flipped}"
    );
    if summary != state.last_summary || t >= state.last_written + 5_000 {
        history.event(format!("sample {summary}"));
        state.last_summary = summary;
        state.last_written = t;
    }
    Ok(())
}
