//! What the harness knows of the fleet over time, independently of what the processes say
//! about themselves: when each process was launched, logged that it started, was killed,
//! terminated or found dead; when each cell was paused, re-armed, flipped to `db`, given a
//! slot count; when PostgreSQL was stopped or cut off. The checkers judge the processes'
//! behaviour against these facts (all times are the history's ms).

use std::sync::Mutex;

/// A time span; `to` is `None` while it lasts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Span {
    pub from: u64,
    pub to: Option<u64>,
}

impl Span {
    fn open(from: u64) -> Span {
        Span { from, to: None }
    }

    pub fn contains(&self, t: u64) -> bool {
        self.from <= t && self.to.is_none_or(|to| t < to)
    }

    fn overlaps(&self, from: u64, to: u64) -> bool {
        self.from <= to && self.to.is_none_or(|end| end >= from)
    }
}

/// How a process's run ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EndKind {
    /// `kill -9` by the nemesis, its descriptor store lost with it (flushed).
    Killed,
    /// `kill -9` by the nemesis of a cell whose descriptor store outlives it: the next run
    /// resumes its controls and spliced pairs (only what the relay closes 1012 or cuts may
    /// end).
    KilledKept,
    /// `SIGTERM` by the nemesis (a cell drains).
    Terminated,
    /// It exited without being asked.
    Died,
}

/// One run (incarnation) of a process.
#[derive(Debug, Clone, Copy)]
pub struct Run {
    pub launched: u64,
    /// When its `orca_relay_started` line arrived.
    pub started: Option<u64>,
    /// When the nemesis signalled it, or when it was found dead.
    pub ended: Option<(u64, EndKind)>,
    /// When the exit was seen, and whether it was clean (code 0).
    pub exited: Option<(u64, bool)>,
    /// A director's feed poller logged that it listed the cells again after failing to
    /// (`orca_relay_director_feed_poller_cells_listed`).
    pub listed: Option<u64>,
    /// A director logged `orca_relay_migrations_applied`: its admin API serves registrations
    /// from then on (503 `starting` before).
    pub migrated: Option<u64>,
}

#[derive(Debug, Clone, Default)]
struct ProcFacts {
    runs: Vec<Run>,
}

impl ProcFacts {
    fn current(&mut self) -> Option<&mut Run> {
        self.runs.last_mut()
    }
}

#[derive(Debug, Clone, Default)]
struct CellFacts {
    process: ProcFacts,
    /// Switch writes with a new generation that says `reserve` (a fresh window): (when,
    /// generation).
    rearms: Vec<(u64, u64)>,
    pauses: Vec<Span>,
    /// `deadManTripSlots` written, from when.
    slots: Vec<(u64, u32)>,
    /// From the operator's `db` record until the record says `reserve` again.
    deliberate_db: Vec<Span>,
}

#[derive(Debug, Default)]
struct Facts {
    directors: Vec<ProcFacts>,
    cells: Vec<CellFacts>,
    /// PostgreSQL stopped (from the stop until the start returned).
    pg_stopped: Vec<Span>,
    /// PostgreSQL cut off (link down or proxy stopped).
    pg_cut: Vec<Span>,
}

pub struct Knowledge {
    facts: Mutex<Facts>,
}

/// Which process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Who {
    Director(usize),
    Cell(usize),
}

impl Knowledge {
    pub fn new(directors: usize, cells: usize, slots: u32) -> Knowledge {
        let mut facts = Facts {
            directors: vec![ProcFacts::default(); directors],
            cells: vec![CellFacts::default(); cells],
            ..Facts::default()
        };
        for cell in &mut facts.cells {
            cell.slots.push((0, slots));
        }
        Knowledge {
            facts: Mutex::new(facts),
        }
    }

    fn with_process<T>(&self, who: Who, f: impl FnOnce(&mut ProcFacts) -> T) -> T {
        let mut facts = self.facts.lock().unwrap();
        match who {
            Who::Director(d) => f(&mut facts.directors[d]),
            Who::Cell(c) => f(&mut facts.cells[c].process),
        }
    }

    pub fn launched(&self, who: Who, t: u64) {
        self.with_process(who, |p| {
            p.runs.push(Run {
                launched: t,
                started: None,
                ended: None,
                exited: None,
                listed: None,
                migrated: None,
            })
        });
    }

    pub fn started(&self, who: Who, t: u64) {
        self.with_process(who, |p| {
            if let Some(run) = p.current() {
                run.started.get_or_insert(t);
            }
        });
    }

    /// A director's poller listed the cells after failing to (its log says so).
    pub fn director_listed(&self, d: usize, t: u64) {
        self.with_process(Who::Director(d), |p| {
            if let Some(run) = p.current() {
                run.listed.get_or_insert(t);
            }
        });
    }

    /// A director's migrations are applied (its registrations are served).
    pub fn director_migrated(&self, d: usize, t: u64) {
        self.with_process(Who::Director(d), |p| {
            if let Some(run) = p.current() {
                run.migrated.get_or_insert(t);
            }
        });
    }

    pub fn ended(&self, who: Who, t: u64, kind: EndKind) {
        self.with_process(who, |p| {
            if let Some(run) = p.current() {
                run.ended.get_or_insert((t, kind));
            }
        });
    }

    pub fn exited(&self, who: Who, t: u64, clean: bool) {
        self.with_process(who, |p| {
            if let Some(run) = p.current() {
                run.ended.get_or_insert((t, EndKind::Died));
                run.exited.get_or_insert((t, clean));
            }
        });
    }

    /// The process's latest run.
    pub fn current_run(&self, who: Who) -> Option<Run> {
        self.with_process(who, |p| p.runs.last().copied())
    }

    pub fn paused(&self, c: usize, t: u64) {
        self.facts.lock().unwrap().cells[c]
            .pauses
            .push(Span::open(t));
    }

    pub fn resumed(&self, c: usize, t: u64) {
        close_last(&mut self.facts.lock().unwrap().cells[c].pauses, t);
    }

    pub fn rearmed(&self, c: usize, t: u64, generation: u64) {
        self.facts.lock().unwrap().cells[c]
            .rearms
            .push((t, generation));
    }

    pub fn slots_written(&self, c: usize, t: u64, slots: u32) {
        self.facts.lock().unwrap().cells[c].slots.push((t, slots));
    }

    pub fn deliberate_db_began(&self, c: usize, t: u64) {
        self.facts.lock().unwrap().cells[c]
            .deliberate_db
            .push(Span::open(t));
    }

    pub fn deliberate_db_ended(&self, c: usize, t: u64) {
        close_last(&mut self.facts.lock().unwrap().cells[c].deliberate_db, t);
    }

    pub fn pg_stopped(&self, t: u64) {
        self.facts.lock().unwrap().pg_stopped.push(Span::open(t));
    }

    pub fn pg_started(&self, t: u64) {
        close_last(&mut self.facts.lock().unwrap().pg_stopped, t);
    }

    pub fn pg_cut(&self, t: u64) {
        self.facts.lock().unwrap().pg_cut.push(Span::open(t));
    }

    pub fn pg_healed(&self, t: u64) {
        close_last(&mut self.facts.lock().unwrap().pg_cut, t);
    }

    /// PostgreSQL running and reachable at `t`.
    pub fn pg_available_at(&self, t: u64) -> bool {
        let facts = self.facts.lock().unwrap();
        pg_available(&facts, t)
    }

    /// PostgreSQL was unavailable at some time in `from..=to`.
    pub fn pg_unavailable_during(&self, from: u64, to: u64) -> bool {
        let facts = self.facts.lock().unwrap();
        facts
            .pg_stopped
            .iter()
            .chain(&facts.pg_cut)
            .any(|span| span.overlaps(from, to))
    }

    /// The spans in which a director could reach the cells: from its `orca_relay_started`
    /// line, until it was signalled or found dead, once its feed poller knew the cells. Its
    /// poller lists them from the database (then keeps polling from that list through an
    /// outage), so a director that started with the database available (for a second after its
    /// start line) knows them at once; one that started in an outage knows them from the line
    /// saying it listed them again, or once the database had been available for
    /// [`LISTING_MS`] (a reconnect's connect timeout and the listing), whichever comes first.
    pub fn director_able_spans(&self) -> Vec<Span> {
        let facts = self.facts.lock().unwrap();
        let mut spans = Vec::new();
        for director in &facts.directors {
            for run in &director.runs {
                let Some(started) = run.started else { continue };
                let end = run.ended.map(|(t, _)| t);
                let outage_at_start = facts
                    .pg_stopped
                    .iter()
                    .chain(&facts.pg_cut)
                    .any(|span| span.overlaps(run.launched, started + 1_000));
                let from = if outage_at_start {
                    let stable = first_stable_from(&facts, started, LISTING_MS);
                    match (run.listed.filter(|&l| l >= started), stable) {
                        (Some(l), Some(s)) => Some(l.min(s)),
                        (l, s) => l.or(s),
                    }
                } else {
                    Some(started)
                };
                let Some(from) = from else { continue };
                if end.is_some_and(|end| end <= from) {
                    continue;
                }
                spans.push(Span { from, to: end });
            }
        }
        spans
    }

    /// The latest time at or before `x` at which some director could reach the cells.
    pub fn last_able_at_or_before(&self, x: u64) -> Option<u64> {
        self.director_able_spans()
            .iter()
            .filter(|span| span.from <= x)
            .map(|span| span.to.map_or(x, |to| to.min(x)))
            .max()
    }

    /// The latest time at or before `x` at which some director could reach cell `c`: a
    /// director able to poll, and the cell serving (from its `orca_relay_started` line until it
    /// was signalled; its own pauses included: a director polling a paused cell reaches it the
    /// moment it resumes, which the pause guard must allow for). A cell still in its start-up
    /// handshake answers its feed 503 (SPEC §8), so no director can reach it then.
    pub fn last_reachable_at_or_before(&self, c: usize, x: u64) -> Option<u64> {
        let able = self.director_able_spans();
        let serving: Vec<Span> = {
            let facts = self.facts.lock().unwrap();
            facts.cells[c]
                .process
                .runs
                .iter()
                .filter_map(|run| {
                    Some(Span {
                        from: run.started?,
                        to: run.ended.map(|(t, _)| t),
                    })
                })
                .collect()
        };
        let mut latest = None;
        for a in &able {
            for s in &serving {
                let from = a.from.max(s.from);
                let to = match (a.to, s.to) {
                    (Some(p), Some(q)) => p.min(q),
                    (Some(p), None) | (None, Some(p)) => p,
                    (None, None) => u64::MAX,
                };
                if from <= x && from <= to {
                    latest = latest.max(Some(to.min(x)));
                }
            }
        }
        latest
    }

    /// Every director was serving registrations (started, migrations applied) and PostgreSQL
    /// available throughout `from..=to`: a cell's registration could not have been refused for
    /// an outage.
    pub fn registration_possible(&self, from: u64, to: u64) -> bool {
        let facts = self.facts.lock().unwrap();
        let every_director = facts.directors.iter().all(|director| {
            director.runs.iter().any(|run| {
                run.started.is_some_and(|s| s <= from)
                    && run.migrated.is_some_and(|m| m <= from)
                    && run.ended.is_none_or(|(t, _)| t >= to)
            })
        });
        every_director
            && !facts
                .pg_stopped
                .iter()
                .chain(&facts.pg_cut)
                .any(|span| span.overlaps(from, to))
    }

    /// The directors' runs and the database's outages overlapping `from..=to`, for a
    /// violation's detail.
    pub fn describe_registration(&self, from: u64, to: u64) -> String {
        let facts = self.facts.lock().unwrap();
        let mut text = format!("from={from} to={to}");
        for (d, director) in facts.directors.iter().enumerate() {
            for run in &director.runs {
                text.push_str(&format!(
                    " d{d}:[launched={} started={:?} migrated={:?} ended={:?}]",
                    run.launched, run.started, run.migrated, run.ended
                ));
            }
        }
        for span in facts.pg_stopped.iter().chain(&facts.pg_cut) {
            if span.overlaps(from, to) {
                text.push_str(&format!(" pg_unavailable={span:?}"));
            }
        }
        text
    }

    /// The latest fresh window of cell `c` at or before `t` for a dead-man line of switch
    /// `generation`: its current run's launch, or the write of a re-arming generation up to
    /// that one (a write the cell had not applied yet when it logged does not count).
    pub fn fresh_window_at_or_before(&self, c: usize, t: u64, generation: Option<u64>) -> u64 {
        let facts = self.facts.lock().unwrap();
        let cell = &facts.cells[c];
        let launched = cell
            .process
            .runs
            .iter()
            .map(|run| run.launched)
            .filter(|&l| l <= t)
            .max()
            .unwrap_or(0);
        let rearmed = cell
            .rearms
            .iter()
            .filter(|(r, g)| *r <= t && generation.is_none_or(|line| *g <= line))
            .map(|(r, _)| *r)
            .max()
            .unwrap_or(0);
        launched.max(rearmed)
    }

    /// How a run of cell `c` that was live at some time in `from..=to` ended by `to`, if one
    /// did (a run already draining at `from` counts). An end that closes connections (a kill
    /// without the store, a drain, a death) comes before [`EndKind::KilledKept`], which keeps
    /// them; a run that died before it started serving (a refused registration) closes
    /// nothing: it held no connection of its own, and the store keeps the earlier run's.
    pub fn cell_disrupted(&self, c: usize, from: u64, to: u64) -> Option<EndKind> {
        let facts = self.facts.lock().unwrap();
        let ends: Vec<EndKind> = facts.cells[c]
            .process
            .runs
            .iter()
            .filter(|run| run.launched <= to && run.exited.is_none_or(|(e, _)| e >= from))
            .filter(|run| run.started.is_some() || !matches!(run.ended, Some((_, EndKind::Died))))
            .filter_map(|run| run.ended)
            .filter(|(t, _)| *t <= to)
            .map(|(_, kind)| kind)
            .collect();
        ends.iter()
            .copied()
            .find(|kind| *kind != EndKind::KilledKept)
            .or(ends.first().copied())
    }

    /// A switch write re-armed cell `c` in `from..=to` (a permit the cell asked for under an
    /// earlier generation is then dropped, and its slot released, SPEC §5.5).
    pub fn rearmed_during(&self, c: usize, from: u64, to: u64) -> bool {
        self.facts.lock().unwrap().cells[c]
            .rearms
            .iter()
            .any(|(r, _)| (from..=to).contains(r))
    }

    /// Cell `c` was paused at some time in `from..=to`.
    pub fn cell_paused_during(&self, c: usize, from: u64, to: u64) -> bool {
        self.facts.lock().unwrap().cells[c]
            .pauses
            .iter()
            .any(|span| span.overlaps(from, to))
    }

    /// Cell `c` is deliberately in `db` at `t` (or was within `margin_ms` of it).
    pub fn deliberate_db(&self, c: usize, t: u64, margin_ms: u64) -> bool {
        self.facts.lock().unwrap().cells[c]
            .deliberate_db
            .iter()
            .any(|span| span.overlaps(t.saturating_sub(margin_ms), t))
    }

    /// Cells deliberately in `db` at `t` (within `margin_ms`).
    pub fn deliberate_db_count(&self, t: u64, margin_ms: u64) -> usize {
        let cells = self.facts.lock().unwrap().cells.len();
        (0..cells)
            .filter(|&c| self.deliberate_db(c, t, margin_ms))
            .count()
    }

    /// The largest `deadManTripSlots` cell `c` had at any time in `from..=to`: the cap its own
    /// claim is judged by.
    pub fn slots_of_during(&self, c: usize, from: u64, to: u64) -> u32 {
        let facts = self.facts.lock().unwrap();
        largest_slots(&facts.cells[c], from, to)
    }

    /// The largest `deadManTripSlots` any cell had at any time in `from..=to`: with mixed
    /// values the cap is the largest set (SPEC §5.5), and a slot taken under a larger value is
    /// kept after the value is lowered.
    pub fn largest_slots_during(&self, from: u64, to: u64) -> u32 {
        let facts = self.facts.lock().unwrap();
        facts
            .cells
            .iter()
            .map(|cell| largest_slots(cell, from, to))
            .max()
            .unwrap_or(0)
    }

    /// Cell `c` left cleanly (drained, exit 0) at least `grace_ms` before `t` and has not been
    /// launched again by `t`, and PostgreSQL was available during its drain (so its final
    /// `reserve` write could land): it must hold no slot.
    pub fn cell_gone_after_drain(&self, c: usize, t: u64, grace_ms: u64) -> Option<u64> {
        let run = self.current_run(Who::Cell(c))?;
        let (ended, kind) = run.ended?;
        let (exited, clean) = run.exited?;
        if kind != EndKind::Terminated || !clean || exited + grace_ms > t {
            return None;
        }
        if self.pg_unavailable_during(ended, exited) {
            return None;
        }
        Some(exited)
    }
}

/// The largest slot count `cell` had in force at any time in `from..=to`.
fn largest_slots(cell: &CellFacts, from: u64, to: u64) -> u32 {
    let in_force_at_from = cell
        .slots
        .iter()
        .rfind(|(t, _)| *t <= from)
        .map(|(_, s)| *s)
        .unwrap_or(0);
    cell.slots
        .iter()
        .filter(|(t, _)| *t > from && *t <= to)
        .map(|(_, s)| *s)
        .fold(in_force_at_from, u32::max)
}

fn close_last(spans: &mut [Span], t: u64) {
    if let Some(span) = spans.iter_mut().rev().find(|s| s.to.is_none()) {
        span.to = Some(t);
    }
}

fn pg_available(facts: &Facts, t: u64) -> bool {
    !facts
        .pg_stopped
        .iter()
        .chain(&facts.pg_cut)
        .any(|span| span.contains(t))
}

/// How long the database must have been available before a director that started in an
/// outage surely knows the cells: the store's connect timeout (5 s) and a listing.
pub const LISTING_MS: u64 = 6_000;

/// The first time at or after `from` by which PostgreSQL had been available for `stable_ms`
/// without a break; `None` while an outage lasts.
fn first_stable_from(facts: &Facts, from: u64, stable_ms: u64) -> Option<u64> {
    let mut candidate = from;
    loop {
        let blocking: Vec<Option<u64>> = facts
            .pg_stopped
            .iter()
            .chain(&facts.pg_cut)
            .filter(|span| {
                span.from <= candidate
                    && span
                        .to
                        .is_none_or(|to| to > candidate.saturating_sub(stable_ms))
            })
            .map(|span| span.to)
            .collect();
        if blocking.is_empty() {
            return Some(candidate);
        }
        let mut next = candidate;
        for to in blocking {
            next = next.max(to? + stable_ms);
        }
        candidate = next;
    }
}
