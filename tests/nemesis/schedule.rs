//! The nemesis's schedule: from a seed and a run length, the faults to inject, when, where and
//! for how long. Pure: the same seed, length and set of available kinds always give the same
//! schedule (timing on a loaded machine may still vary; the history records when each fault
//! was really applied).
//!
//! Faults overlap on purpose (a director dies while a cell is paused and the database restarts
//! under a drain); only two faults on the same *resource* never overlap (one process is not
//! killed while it is already down, the database is not restarted twice at once), because the
//! second could not be applied as drawn.

use std::collections::BTreeMap;
use std::fmt;

use super::rng::Rng;

/// Every fault the nemesis knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum FaultKind {
    /// `kill -9` a director, restart it after the duration.
    DirectorKill,
    /// `SIGSTOP` a cell for the duration (0.2-5 s), then `SIGCONT`.
    CellPause,
    /// `kill -9` a cell, restart it after the duration.
    CellKill,
    /// `SIGTERM` a cell (it drains and exits 0); it is started again the duration after it
    /// exited.
    CellDrain,
    /// PostgreSQL stopped with `pg_ctl stop -m fast` (sessions cut), started after the duration.
    PgRestartFast,
    /// PostgreSQL stopped with `-m immediate` (a crash: recovery at start), started after the
    /// duration.
    PgRestartImmediate,
    /// PostgreSQL unreachable: its network namespace's link goes down for the duration (or the
    /// TCP proxy stops forwarding, without root).
    PgUnreachable,
    /// PostgreSQL slow: its processes get `value` percent (10-30) of one CPU for the duration
    /// (a brownout; cgroup CPU quota).
    PgSlow,
    /// A switch write that re-arms a cell: a new generation, still `reserve`.
    SwitchRearm,
    /// A deliberate `db` flip of a cell (the operator's record, then the switch), and after the
    /// duration the `reserve` write that brings it back (the switch, then the record).
    SwitchDb,
    /// A new `deadManTripSlots` (`value`) on one cell, back to the fleet's value after the
    /// duration. Each write is a new generation (so it re-arms that cell).
    SwitchSlots,
    /// The process restarts with its wall clock `value` ms off (a machine whose clock was
    /// stepped: a running process anchors wall time at start, so only a restart sees a step);
    /// the offset sticks for its later restarts. It is stopped with `kill -9` (a machine that
    /// went down) and started again after the duration.
    ClockJump,
    /// `orca-relay handover` on a cell (issue 23): only when the binary has the command. Drawn
    /// from a stream of its own ([`draw_handovers`]). Its `value` steps the cell's wall clock by
    /// that many ms just before (a time sync, a machine suspended and resumed):
    /// the running process, which anchored its wall time at its start, does not see the step;
    /// the next one does, and must not take it for time the carried state spent travelling.
    /// The offset sticks for the cell's later runs, as with [`FaultKind::ClockJump`].
    CellHandover,
}

impl FaultKind {
    pub const ALL: [FaultKind; 13] = [
        FaultKind::DirectorKill,
        FaultKind::CellPause,
        FaultKind::CellKill,
        FaultKind::CellDrain,
        FaultKind::PgRestartFast,
        FaultKind::PgRestartImmediate,
        FaultKind::PgUnreachable,
        FaultKind::PgSlow,
        FaultKind::SwitchRearm,
        FaultKind::SwitchDb,
        FaultKind::SwitchSlots,
        FaultKind::ClockJump,
        FaultKind::CellHandover,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            FaultKind::DirectorKill => "director-kill",
            FaultKind::CellPause => "cell-pause",
            FaultKind::CellKill => "cell-kill",
            FaultKind::CellDrain => "cell-drain",
            FaultKind::PgRestartFast => "pg-restart-fast",
            FaultKind::PgRestartImmediate => "pg-restart-immediate",
            FaultKind::PgUnreachable => "pg-unreachable",
            FaultKind::PgSlow => "pg-slow",
            FaultKind::SwitchRearm => "switch-rearm",
            FaultKind::SwitchDb => "switch-db",
            FaultKind::SwitchSlots => "switch-slots",
            FaultKind::ClockJump => "clock-jump",
            FaultKind::CellHandover => "cell-handover",
        }
    }

    /// How often the kind is drawn, relative to the others.
    fn weight(self) -> u64 {
        match self {
            FaultKind::DirectorKill => 14,
            FaultKind::CellPause => 14,
            FaultKind::CellKill => 7,
            FaultKind::CellDrain => 7,
            FaultKind::PgRestartFast => 3,
            FaultKind::PgRestartImmediate => 3,
            FaultKind::PgUnreachable => 5,
            FaultKind::PgSlow => 5,
            FaultKind::SwitchRearm => 8,
            FaultKind::SwitchDb => 4,
            FaultKind::SwitchSlots => 4,
            FaultKind::ClockJump => 5,
            FaultKind::CellHandover => 4,
        }
    }
}

impl fmt::Display for FaultKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What a fault acts on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Target {
    Director(usize),
    Cell(usize),
    Database,
}

impl fmt::Display for Target {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Target::Director(d) => write!(f, "d{d}"),
            Target::Cell(c) => write!(f, "c{c}"),
            Target::Database => f.write_str("db"),
        }
    }
}

/// One fault of the schedule.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fault {
    pub id: usize,
    /// When it begins, in ms after the nemesis starts.
    pub at_ms: u64,
    pub kind: FaultKind,
    pub target: Target,
    /// How long it lasts (down, paused, unreachable, flipped); 0 for a single write.
    pub duration_ms: u64,
    /// The kind's parameter: slots, a clock offset in ms, a CPU percentage; 0 otherwise.
    pub value: i64,
}

impl fmt::Display for Fault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "fault={} at_ms={} kind={} target={} duration_ms={}",
            self.id, self.at_ms, self.kind, self.target, self.duration_ms
        )?;
        if self.value != 0 {
            write!(f, " value={}", self.value)?;
        }
        Ok(())
    }
}

/// The shape of the fleet the schedule is drawn for.
#[derive(Debug, Clone, Copy)]
pub struct Shape {
    pub directors: usize,
    pub cells: usize,
    /// The fleet's `deadManTripSlots`: a slot change draws another value.
    pub slots: u32,
}

/// No fault begins in the first second (the clients settle) and every fault is over this long
/// before the end (the nemesis stops, then liveness is judged).
pub const WARMUP_MS: u64 = 1_000;
pub const COOLDOWN_MS: u64 = 1_500;
/// Time a restarted process needs before the same process takes another fault.
const RESTART_MARGIN_MS: u64 = 4_000;
/// The clock offsets a clock jump draws from (the mutation check of slot liveness needs a cell
/// five minutes ahead).
const CLOCK_OFFSETS_MS: [i64; 5] = [300_000, -300_000, 90_000, -90_000, 0];

/// Something two faults must not act on at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Resource {
    Process(Target),
    CellSwitch(usize),
    PgProcess,
    PgLink,
    PgCpu,
}

/// Draws the schedule of a run of `length_ms` from `seed`, using only `available` kinds.
pub fn draw(seed: u64, length_ms: u64, shape: Shape, available: &[FaultKind]) -> Vec<Fault> {
    let mut rng = Rng::derive(seed, 0x5C4E_D01E);
    let mut busy: BTreeMap<Resource, u64> = BTreeMap::new();
    let mut faults: Vec<Fault> = Vec::new();
    let last_end = length_ms.saturating_sub(COOLDOWN_MS);
    // The handover is drawn apart, from a stream of its own, once the rest is drawn: a seed
    // draws the same other faults whether or not the binary can hand over.
    let handover = available.contains(&FaultKind::CellHandover);
    let available: Vec<FaultKind> = available
        .iter()
        .copied()
        .filter(|k| *k != FaultKind::CellHandover)
        .collect();
    let available = available.as_slice();
    let total_weight: u64 = available.iter().map(|k| k.weight()).sum();
    if total_weight == 0 {
        return faults;
    }
    let mut t = WARMUP_MS;
    loop {
        t += rng.between(150, 1_800);
        if t >= last_end {
            break;
        }
        let mut pick = rng.next() % total_weight;
        let kind = *available
            .iter()
            .find(|k| {
                if pick < k.weight() {
                    true
                } else {
                    pick -= k.weight();
                    false
                }
            })
            .expect("a kind under the total weight");
        let mut drawn = draw_one(&mut rng, kind, shape);
        // A director outage: half the director kills take every director down together, each
        // long enough for the cells' windows to pass with no director to poll them.
        let outage = kind == FaultKind::DirectorKill && shape.directors > 1 && rng.percent(50);
        if outage {
            drawn.1 = rng.between(3_500, 7_000);
        }
        // A busy target: try the others of the same kind in turn.
        let candidates = targets(kind, shape);
        let first = candidates
            .iter()
            .position(|c| *c == drawn.0)
            .unwrap_or_default();
        let free = (0..candidates.len())
            .map(|i| candidates[(first + i) % candidates.len()])
            .find(|target| {
                busy.get(&resource(kind, *target))
                    .is_none_or(|&free_at| free_at <= t)
            });
        let Some(target) = free else { continue };
        drawn.0 = target;
        let (target, mut duration_ms, value) = drawn;
        if t + duration_ms > last_end {
            duration_ms = last_end - t;
        }
        let margin = match kind {
            FaultKind::DirectorKill
            | FaultKind::CellKill
            | FaultKind::CellDrain
            | FaultKind::ClockJump
            | FaultKind::CellHandover => RESTART_MARGIN_MS,
            FaultKind::CellPause => 500,
            _ => 200,
        };
        busy.insert(resource(kind, target), t + duration_ms + margin);
        faults.push(Fault {
            id: faults.len(),
            at_ms: t,
            kind,
            target,
            duration_ms,
            value,
        });
        if outage {
            let Target::Director(first) = target else {
                unreachable!()
            };
            for other in
                (1..shape.directors).map(|i| Target::Director((first + i) % shape.directors))
            {
                let at_ms = t + rng.between(0, 500);
                let free = busy
                    .get(&Resource::Process(other))
                    .is_none_or(|&free_at| free_at <= at_ms);
                if !free || at_ms >= last_end {
                    continue;
                }
                let duration_ms = rng.between(3_500, 7_000).min(last_end - at_ms);
                busy.insert(
                    Resource::Process(other),
                    at_ms + duration_ms + RESTART_MARGIN_MS,
                );
                faults.push(Fault {
                    id: faults.len(),
                    at_ms,
                    kind,
                    target: other,
                    duration_ms,
                    value: 0,
                });
            }
            // Now and then the database slows down just as the cells' windows pass: their
            // claims then overlap in the database, which is what the claim's lock is for.
            let slow_at = t + 1_800;
            let slow = available.contains(&FaultKind::PgSlow)
                && rng.percent(50)
                && busy
                    .get(&Resource::PgCpu)
                    .is_none_or(|&free_at| free_at <= slow_at)
                && slow_at + 3_000 < last_end;
            if slow {
                busy.insert(Resource::PgCpu, slow_at + 3_000 + 200);
                faults.push(Fault {
                    id: faults.len(),
                    at_ms: slow_at,
                    kind: FaultKind::PgSlow,
                    target: Target::Database,
                    duration_ms: 3_000,
                    value: rng.between(10, 20) as i64,
                });
            }
        }
    }
    if handover {
        draw_handovers(seed, last_end, shape, &mut busy, &mut faults);
    }
    faults.sort_by_key(|f| (f.at_ms, f.id));
    for (id, fault) in faults.iter_mut().enumerate() {
        fault.id = id;
    }
    faults
}

/// Live handovers, from their own stream: one every 3-12 s, each of a cell whose process no
/// other fault touches from the handover to [`RESTART_MARGIN_MS`] after it (a handover of a
/// cell that is down, paused or draining is refused by design and teaches nothing).
fn draw_handovers(
    seed: u64,
    last_end: u64,
    shape: Shape,
    busy: &mut BTreeMap<Resource, u64>,
    faults: &mut Vec<Fault>,
) {
    let mut rng = Rng::derive(seed, 0x4A4D_0FE2);
    // The steps from a stream of their own: the handovers' times and cells stay as they were.
    let mut steps = Rng::derive(seed, 0x57E9_C10C);
    let mut t = WARMUP_MS;
    loop {
        t += rng.between(3_000, 12_000);
        if t >= last_end {
            break;
        }
        let first = rng.below(shape.cells);
        let free = (0..shape.cells)
            .map(|i| Target::Cell((first + i) % shape.cells))
            .find(|target| {
                let span = (t.saturating_sub(RESTART_MARGIN_MS), t + RESTART_MARGIN_MS);
                busy.get(&Resource::Process(*target))
                    .is_none_or(|&free_at| free_at <= span.0)
                    && !faults.iter().any(|f| {
                        resource(f.kind, f.target) == Resource::Process(*target)
                            && f.at_ms < span.1
                            && f.at_ms + f.duration_ms + RESTART_MARGIN_MS > span.0
                    })
            });
        let Some(target) = free else { continue };
        busy.insert(Resource::Process(target), t + RESTART_MARGIN_MS);
        // Two thirds ahead, a third behind: ahead by more than the handover's 10 s limit of
        // travel is what a travel measured on the two wall clocks would take whole.
        let step = steps.between(10_000, 20_000) as i64;
        let value = if steps.below(3) < 2 { step } else { -step };
        faults.push(Fault {
            id: faults.len(),
            at_ms: t,
            kind: FaultKind::CellHandover,
            target,
            duration_ms: 0,
            value,
        });
    }
}

fn targets(kind: FaultKind, shape: Shape) -> Vec<Target> {
    match kind {
        FaultKind::DirectorKill => (0..shape.directors).map(Target::Director).collect(),
        FaultKind::PgRestartFast
        | FaultKind::PgRestartImmediate
        | FaultKind::PgUnreachable
        | FaultKind::PgSlow => vec![Target::Database],
        FaultKind::ClockJump => (0..shape.cells)
            .map(Target::Cell)
            .chain((0..shape.directors).map(Target::Director))
            .collect(),
        _ => (0..shape.cells).map(Target::Cell).collect(),
    }
}

pub fn resource(kind: FaultKind, target: Target) -> Resource {
    match (kind, target) {
        (
            FaultKind::SwitchRearm | FaultKind::SwitchDb | FaultKind::SwitchSlots,
            Target::Cell(c),
        ) => Resource::CellSwitch(c),
        (FaultKind::PgRestartFast | FaultKind::PgRestartImmediate, _) => Resource::PgProcess,
        (FaultKind::PgUnreachable, _) => Resource::PgLink,
        (FaultKind::PgSlow, _) => Resource::PgCpu,
        (_, target) => Resource::Process(target),
    }
}

/// (target, duration, value) of one fault of `kind`.
fn draw_one(rng: &mut Rng, kind: FaultKind, shape: Shape) -> (Target, u64, i64) {
    let cell = Target::Cell(rng.below(shape.cells));
    match kind {
        FaultKind::DirectorKill => (
            Target::Director(rng.below(shape.directors)),
            rng.between(300, 6_000),
            0,
        ),
        FaultKind::CellPause => (cell, rng.between(200, 5_000), 0),
        FaultKind::CellKill => (cell, rng.between(300, 4_000), 0),
        FaultKind::CellDrain => (cell, rng.between(300, 3_000), 0),
        FaultKind::PgRestartFast | FaultKind::PgRestartImmediate => {
            (Target::Database, rng.between(0, 3_000), 0)
        }
        FaultKind::PgUnreachable => (Target::Database, rng.between(500, 8_000), 0),
        FaultKind::PgSlow => (
            Target::Database,
            rng.between(2_000, 8_000),
            rng.between(10, 30) as i64,
        ),
        FaultKind::SwitchRearm | FaultKind::CellHandover => (cell, 0, 0),
        FaultKind::SwitchDb => (cell, rng.between(2_000, 10_000), 0),
        FaultKind::SwitchSlots => {
            let others: Vec<u32> = (1..=shape.slots + 1)
                .filter(|s| *s != shape.slots)
                .collect();
            let slots = others[rng.below(others.len())];
            (cell, rng.between(3_000, 12_000), i64::from(slots))
        }
        FaultKind::ClockJump => {
            let target = if rng.percent(80) {
                cell
            } else {
                Target::Director(rng.below(shape.directors))
            };
            let offset = CLOCK_OFFSETS_MS[rng.below(CLOCK_OFFSETS_MS.len())];
            (target, rng.between(300, 1_500), offset)
        }
    }
}

/// Faults per kind.
pub fn count_by_kind<'a>(
    faults: impl IntoIterator<Item = &'a Fault>,
) -> BTreeMap<FaultKind, usize> {
    let mut counts = BTreeMap::new();
    for fault in faults {
        *counts.entry(fault.kind).or_insert(0) += 1;
    }
    counts
}
