//! Where a desktop goes (SPEC §6.2): the pin rule and the choice of a cell, as pure functions
//! of the host's placement row, the registered cells, the feed poller's view and `now_ms`.
//!
//! Owns nothing; runs on the HTTP worker answering `POST /v1/assign`. Must never read a clock,
//! a socket or the database: [`super::assign`] reads them and feeds this module.
//!
//! Ages are the database's (SPEC §11): a heartbeat's and an admit-effective row's age come with
//! the [`CellRow`], computed by `relay_now_ms()`, so a director whose clock is off judges them
//! exactly as one whose clock agrees. Only the feed's age is this director's own (it stamped it).
//!
//! The rules, in order:
//! 1. **Pin.** The row names a *live reserve cell*: its `relay_cell_admit_modes` says `reserve`,
//!    its heartbeat is at most `heartbeat_fresh_ms` old, ready or not, it is not retired, and
//!    its seat feed does not say `draining` (a draining cell has told its desktops to come back
//!    here; holding them to it would answer 503 until it is gone). Ready → answer that
//!    placement with no write ([`Decision::Pin`]); not ready → [`Decision::HomeUnavailable`]
//!    (503 `relay_home_cell_unavailable`), because moving a reserve cell's desktop elsewhere
//!    while the cell still runs would put one desktop on two cells. Once the heartbeat is older
//!    than fresh, the host is placed again.
//! 2. **Place** at epoch (row epoch or 0) + 1. A candidate cell has a fresh heartbeat, says
//!    ready, is not retired, and is not draining by its feed. It is a
//!    - **booking** candidate when its admit mode is `reserve`, its feed answered within
//!      `feed_fresh_ms`, says `admitModeEffective = reserve`, and the cell has an internal URL
//!      (the director books the seat through `/internal/reserve`);
//!    - **database-path** candidate when its admit mode is `db` (a missing row is `db`), or when
//!      its admit mode is `reserve` but its own admit-effective row says `db` for its current
//!      incarnation and was refreshed within `heartbeat_fresh_ms` (a tripped cell, SPEC §5.5).
//!      A held cell's row says `reserve`, so it gets nothing new on this path.
//!
//!    **Booking candidates come first**, then database-path ones: a booking admits the desktop
//!    from the cell's memory without a database read, which is the point of reserve mode; the
//!    database path is the fallback when no reserve cell can take it. Within each group the
//!    order is *power of two choices* on load: draw two, keep the lighter, repeat. Load is the
//!    feed's `connections + bookings` when the feed is fresh (it is at most one poll old), else
//!    the heartbeat's `connections`.
//! 3. No candidate → [`Decision::Exhausted`] (503 `relay_capacity_exhausted`).

use std::collections::HashMap;

use super::membership;
use crate::store::{Assignment, CellRow, MODE_DB, MODE_RESERVE};

/// What the feed poller last learned from one cell's seat feed (SPEC §5.4).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FeedView {
    pub incarnation: i64,
    pub admit_mode_raw: String,
    pub admit_mode_effective: String,
    pub draining: bool,
    pub seated: u64,
    pub bookings: u64,
    pub connections: u64,
    /// When the latest successful poll finished (ms since the Unix epoch).
    pub last_success_ms: u64,
}

/// The times placement judges freshness by.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Params {
    /// This director's clock: only for the feed's age, which this director stamped.
    pub now_ms: u64,
    /// `ORCA_RELAY_HEARTBEAT_FRESH_MS`: a heartbeat (or an admit-effective row) at most this old
    /// (database clock) is fresh.
    pub heartbeat_fresh_ms: u64,
    /// A feed answer at most this old is believed (see [`feed_fresh_ms`]).
    pub feed_fresh_ms: u64,
    /// Cells silent longer than this are retired (skipped); `None` while retirement is not
    /// judged yet (see [`membership::Rules::retire_after`]).
    pub retire_after_ms: Option<u64>,
}

/// How long a feed answer is believed: three missed polls plus one poll's timeout. Older than
/// that, the cell is not answering its director, and a booking would most likely fail.
pub fn feed_fresh_ms(feed_poll_ms: u64, poll_timeout_ms: u64) -> u64 {
    feed_poll_ms
        .saturating_mul(3)
        .saturating_add(poll_timeout_ms)
}

/// How a placement reaches its cell.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Path {
    /// Book the seat through the cell's `/internal/reserve` after writing the row.
    Booking,
    /// Write the row; the cell admits by reading it.
    Database,
}

impl Path {
    pub fn as_str(self) -> &'static str {
        match self {
            Path::Booking => "booking",
            Path::Database => "database",
        }
    }
}

/// One cell a placement may go to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Candidate {
    pub cell_id: String,
    pub cell_url: String,
    pub internal_url: Option<String>,
    pub path: Path,
    pub load: u64,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// Answer the existing placement; write nothing.
    Pin {
        cell_id: String,
        cell_url: String,
        epoch: i64,
    },
    /// The home cell is a live reserve cell that says it is not ready: 503.
    HomeUnavailable { cell_id: String },
    /// Place at `epoch` on the first candidate; the rest are the fallbacks, in order (each
    /// fallback takes a new epoch, never this one).
    Place {
        epoch: i64,
        candidates: Vec<Candidate>,
    },
    /// No cell can take the desktop: 503 with `Retry-After`.
    Exhausted,
}

/// A small seedable generator (splitmix64) for the power-of-two draw. Tests seed it; the
/// director seeds it from the OS. Not for secrets.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn seeded(seed: u64) -> Rng {
        Rng(seed)
    }

    /// Seeded from the OS; falls back to a fixed seed (the draw only spreads load).
    pub fn from_os() -> Rng {
        let mut bytes = [0u8; 8];
        let seed = match getrandom::fill(&mut bytes) {
            Ok(()) => u64::from_le_bytes(bytes),
            Err(_) => 0x9e37_79b9_7f4a_7c15,
        };
        Rng(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// A number in `0..bound` (`bound` > 0).
    pub fn below(&mut self, bound: usize) -> usize {
        (self.next_u64() % bound as u64) as usize
    }
}

/// A database-computed age (a row stamped by the database an instant after it read its clock
/// can come out a few ms negative) as a `u64`.
fn age(age_ms: i64) -> u64 {
    age_ms.max(0) as u64
}

fn heartbeat_fresh(cell: &CellRow, params: &Params) -> bool {
    cell.runtime
        .as_ref()
        .is_some_and(|runtime| age(runtime.heartbeat_age_ms) <= params.heartbeat_fresh_ms)
}

/// The cell's last seat-feed answer (of any age) says it is draining, for the process that is
/// registered now.
pub fn reports_draining(cell: &CellRow, feeds: &HashMap<String, FeedView>) -> bool {
    feeds
        .get(&cell.cell_id)
        .is_some_and(|feed| feed.draining && feed.incarnation == cell.incarnation)
}

fn fresh_feed<'a>(
    cell: &CellRow,
    feeds: &'a HashMap<String, FeedView>,
    params: &Params,
) -> Option<&'a FeedView> {
    feeds
        .get(&cell.cell_id)
        .filter(|feed| params.now_ms.saturating_sub(feed.last_success_ms) <= params.feed_fresh_ms)
}

/// Rule 1: the pin, if the row names a live reserve cell that is not draining.
pub fn pin(
    current: Option<&Assignment>,
    cells: &[CellRow],
    feeds: &HashMap<String, FeedView>,
    params: &Params,
) -> Option<Decision> {
    let row = current?;
    let home = cells.iter().find(|cell| cell.cell_id == row.cell_id)?;
    if home.admit_mode != MODE_RESERVE
        || !heartbeat_fresh(home, params)
        || membership::is_retired(home, params.retire_after_ms)
        || reports_draining(home, feeds)
    {
        return None;
    }
    let ready = home.runtime.as_ref().is_some_and(|runtime| runtime.ready);
    Some(if ready {
        Decision::Pin {
            cell_id: home.cell_id.clone(),
            cell_url: home.cell_url.clone(),
            epoch: row.epoch,
        }
    } else {
        Decision::HomeUnavailable {
            cell_id: home.cell_id.clone(),
        }
    })
}

/// How a cell could take a new desktop now, if at all.
fn path_of(cell: &CellRow, feed: Option<&FeedView>, params: &Params) -> Option<Path> {
    let runtime = cell.runtime.as_ref()?;
    if !runtime.ready
        || !heartbeat_fresh(cell, params)
        || membership::is_retired(cell, params.retire_after_ms)
        || feed.is_some_and(|feed| feed.draining)
    {
        return None;
    }
    if cell.admit_mode != MODE_RESERVE {
        return Some(Path::Database);
    }
    let booking = feed.is_some_and(|feed| feed.admit_mode_effective == MODE_RESERVE)
        && cell.internal_url.is_some();
    if booking {
        return Some(Path::Booking);
    }
    // A reserve cell on the database path only with its own fresh `db` row for the process
    // that runs now: a tripped cell. A row left by an earlier incarnation says nothing.
    let tripped = cell.effective.as_ref().is_some_and(|effective| {
        effective.mode == MODE_DB
            && (effective.cell_incarnation == runtime.cell_incarnation
                || effective.cell_incarnation == cell.incarnation)
            && age(effective.age_ms) <= params.heartbeat_fresh_ms
    });
    tripped.then_some(Path::Database)
}

/// Rule 2's candidates, booking first, each group in power-of-two-choices order. Cells named
/// in `excluded` (they refused a booking during this request) are left out.
pub fn candidates(
    cells: &[CellRow],
    feeds: &HashMap<String, FeedView>,
    params: &Params,
    excluded: &[String],
    rng: &mut Rng,
) -> Vec<Candidate> {
    let mut booking = Vec::new();
    let mut database = Vec::new();
    for cell in cells {
        if excluded.contains(&cell.cell_id) {
            continue;
        }
        let feed = fresh_feed(cell, feeds, params);
        let Some(path) = path_of(cell, feed, params) else {
            continue;
        };
        let load = match feed {
            Some(feed) => feed.connections.saturating_add(feed.bookings),
            None => cell
                .runtime
                .as_ref()
                .map_or(0, |runtime| runtime.connections.max(0) as u64),
        };
        let candidate = Candidate {
            cell_id: cell.cell_id.clone(),
            cell_url: cell.cell_url.clone(),
            internal_url: cell.internal_url.clone(),
            path,
            load,
        };
        match path {
            Path::Booking => booking.push(candidate),
            Path::Database => database.push(candidate),
        }
    }
    let mut ordered = power_of_two_order(booking, rng);
    ordered.extend(power_of_two_order(database, rng));
    ordered
}

/// Orders `pool` by repeated power-of-two draws: pick two at random, the lighter goes next
/// (the first drawn on a tie).
fn power_of_two_order(mut pool: Vec<Candidate>, rng: &mut Rng) -> Vec<Candidate> {
    let mut ordered = Vec::with_capacity(pool.len());
    while pool.len() > 1 {
        let first = rng.below(pool.len());
        let mut second = rng.below(pool.len() - 1);
        if second >= first {
            second += 1;
        }
        let pick = if pool[second].load < pool[first].load {
            second
        } else {
            first
        };
        ordered.push(pool.remove(pick));
    }
    ordered.extend(pool);
    ordered
}

/// The whole decision. `allow_pin` is false when this request itself wrote the current row
/// and then failed to book it: the next candidate must get a new epoch, not a pin.
pub fn decide(
    current: Option<&Assignment>,
    cells: &[CellRow],
    feeds: &HashMap<String, FeedView>,
    params: &Params,
    excluded: &[String],
    allow_pin: bool,
    rng: &mut Rng,
) -> Decision {
    if allow_pin {
        if let Some(decision) = pin(current, cells, feeds, params) {
            return decision;
        }
    }
    let candidates = candidates(cells, feeds, params, excluded, rng);
    if candidates.is_empty() {
        return Decision::Exhausted;
    }
    Decision::Place {
        epoch: current.map_or(0, |row| row.epoch) + 1,
        candidates,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::{AdmitEffective, CellRuntime};

    const NOW: u64 = 1_800_000_000_000;
    const FRESH: u64 = 45_000;
    const PARAMS: Params = Params {
        now_ms: NOW,
        heartbeat_fresh_ms: FRESH,
        feed_fresh_ms: 5_000,
        retire_after_ms: Some(600_000),
    };

    /// A registered cell (incarnation 7) that heartbeat `age` ms ago.
    fn cell(id: &str, admit_mode: &str, ready: bool, age: u64, connections: i64) -> CellRow {
        CellRow {
            cell_id: id.to_string(),
            cell_url: format!("wss://{id}.example"),
            internal_url: Some(format!("http://{id}.internal")),
            region: "r".into(),
            incarnation: 7,
            registered_at: (NOW - 3_600_000) as i64,
            registered_age_ms: 3_600_000,
            runtime: Some(CellRuntime {
                cell_incarnation: 7,
                started_at: (NOW - 3_600_000) as i64,
                ready,
                connections,
                // The director's clock and the database's differ by an hour here: only the
                // database's age may count.
                last_heartbeat_at: (NOW + 3_600_000 - age) as i64,
                heartbeat_age_ms: age as i64,
            }),
            admit_mode: admit_mode.to_string(),
            admit_mode_updated_at: None,
            effective: None,
        }
    }

    fn with_effective(mut cell: CellRow, mode: &str, incarnation: i64, age: u64) -> CellRow {
        cell.effective = Some(AdmitEffective {
            cell_incarnation: incarnation,
            mode: mode.to_string(),
            updated_at: (NOW - 3_600_000 - age) as i64,
            age_ms: age as i64,
        });
        cell
    }

    fn feed(effective: &str, connections: u64, age: u64) -> FeedView {
        FeedView {
            incarnation: 7,
            admit_mode_raw: effective.to_string(),
            admit_mode_effective: effective.to_string(),
            draining: false,
            seated: connections,
            bookings: 0,
            connections,
            last_success_ms: NOW - age,
        }
    }

    fn feeds(entries: &[(&str, FeedView)]) -> HashMap<String, FeedView> {
        entries
            .iter()
            .map(|(id, view)| (id.to_string(), view.clone()))
            .collect()
    }

    fn row(cell_id: &str, epoch: i64) -> Assignment {
        Assignment {
            user_id: "u".into(),
            relay_host_id: "host_0123456789A".into(),
            cell_id: cell_id.into(),
            epoch,
            updated_at: 0,
        }
    }

    fn decide_simple(
        current: Option<&Assignment>,
        cells: &[CellRow],
        feeds: &HashMap<String, FeedView>,
    ) -> Decision {
        decide(
            current,
            cells,
            feeds,
            &PARAMS,
            &[],
            true,
            &mut Rng::seeded(1),
        )
    }

    /// The cells and paths of a placement, in order.
    fn placed(decision: &Decision) -> (i64, Vec<(&str, Path)>) {
        match decision {
            Decision::Place { epoch, candidates } => (
                *epoch,
                candidates
                    .iter()
                    .map(|c| (c.cell_id.as_str(), c.path))
                    .collect(),
            ),
            other => panic!("expected a placement, got {other:?}"),
        }
    }

    #[test]
    fn live_reserve_home_is_pinned_without_a_new_epoch() {
        let cells = [
            cell("a", "reserve", true, FRESH, 5),
            cell("b", "db", true, 0, 0),
        ];
        assert_eq!(
            decide_simple(Some(&row("a", 4)), &cells, &HashMap::new()),
            Decision::Pin {
                cell_id: "a".into(),
                cell_url: "wss://a.example".into(),
                epoch: 4
            }
        );
    }

    #[test]
    fn live_reserve_home_that_is_not_ready_is_unavailable_not_moved() {
        let cells = [
            cell("a", "reserve", false, 1_000, 5),
            cell("b", "db", true, 0, 0),
        ];
        assert_eq!(
            decide_simple(Some(&row("a", 4)), &cells, &HashMap::new()),
            Decision::HomeUnavailable {
                cell_id: "a".into()
            }
        );
    }

    #[test]
    fn stale_heartbeat_home_is_placed_again_at_the_next_epoch() {
        let cells = [
            cell("a", "reserve", true, FRESH + 1, 0),
            cell("b", "db", true, 0, 0),
        ];
        assert_eq!(
            placed(&decide_simple(Some(&row("a", 4)), &cells, &HashMap::new())),
            (5, vec![("b", Path::Database)])
        );
    }

    #[test]
    fn db_home_is_placed_again_and_without_a_row_the_epoch_is_one() {
        let cells = [cell("b", "db", true, 0, 0)];
        assert_eq!(
            placed(&decide_simple(Some(&row("b", 9)), &cells, &HashMap::new())),
            (10, vec![("b", Path::Database)])
        );
        assert_eq!(
            placed(&decide_simple(None, &cells, &HashMap::new())),
            (1, vec![("b", Path::Database)])
        );
    }

    #[test]
    fn pin_can_be_refused_by_the_caller() {
        let cells = [cell("a", "reserve", true, 0, 0)];
        let decision = decide(
            Some(&row("a", 4)),
            &cells,
            &feeds(&[("a", feed("reserve", 0, 0))]),
            &PARAMS,
            &[],
            false,
            &mut Rng::seeded(1),
        );
        assert_eq!(placed(&decision), (5, vec![("a", Path::Booking)]));
    }

    #[test]
    fn booking_candidates_come_before_the_database_path() {
        let cells = [
            cell("a", "db", true, 0, 0),
            cell("b", "reserve", true, 0, 900),
        ];
        let decision = decide_simple(None, &cells, &feeds(&[("b", feed("reserve", 900, 0))]));
        assert_eq!(
            placed(&decision),
            (1, vec![("b", Path::Booking), ("a", Path::Database)])
        );
    }

    #[test]
    fn a_reserve_cell_needs_a_fresh_reserve_feed_and_an_internal_url_to_be_booked() {
        let mut no_url = cell("c", "reserve", true, 0, 0);
        no_url.internal_url = None;
        let cells = [
            cell("a", "reserve", true, 0, 0),
            cell("b", "reserve", true, 0, 0),
            no_url,
            cell("d", "reserve", true, 0, 0),
        ];
        let views = feeds(&[
            ("a", feed("reserve", 0, 5_001)),
            ("b", feed("db", 0, 0)),
            ("c", feed("reserve", 0, 0)),
        ]);
        assert_eq!(
            decide_simple(None, &cells, &views),
            Decision::Exhausted,
            "stale feed, feed saying db (no fresh db row), no internal URL, no feed at all"
        );
    }

    #[test]
    fn held_reserve_cell_gets_nothing_on_the_database_path() {
        // Held: switch reserve, its row says reserve; and no fresh reserve feed to book on.
        let held = with_effective(cell("a", "reserve", true, 0, 0), "reserve", 7, 0);
        assert_eq!(
            decide_simple(None, &[held], &HashMap::new()),
            Decision::Exhausted
        );
    }

    #[test]
    fn tripped_reserve_cell_takes_the_database_path_only_with_a_fresh_db_row_of_this_process() {
        let tripped = with_effective(cell("a", "reserve", true, 0, 0), "db", 7, FRESH);
        assert_eq!(
            placed(&decide_simple(None, &[tripped], &HashMap::new())),
            (1, vec![("a", Path::Database)])
        );
        let old_row = with_effective(cell("a", "reserve", true, 0, 0), "db", 7, FRESH + 1);
        assert_eq!(
            decide_simple(None, &[old_row], &HashMap::new()),
            Decision::Exhausted
        );
        let earlier_process = with_effective(cell("a", "reserve", true, 0, 0), "db", 6, 0);
        assert_eq!(
            decide_simple(None, &[earlier_process], &HashMap::new()),
            Decision::Exhausted
        );
        // The registered incarnation also counts (a cell that registered but has not yet
        // heartbeat from its new process).
        let mut registered = with_effective(cell("a", "reserve", true, 0, 0), "db", 8, 0);
        registered.incarnation = 8;
        assert_eq!(
            placed(&decide_simple(None, &[registered], &HashMap::new())),
            (1, vec![("a", Path::Database)])
        );
    }

    #[test]
    fn unready_stale_unknown_or_draining_cells_are_not_candidates() {
        let mut never_beat = cell("d", "db", true, 0, 0);
        never_beat.runtime = None;
        let cells = [
            cell("a", "db", false, 0, 0),
            cell("b", "db", true, FRESH + 1, 0),
            cell("c", "db", true, 0, 0),
            never_beat,
        ];
        let mut draining = feed("db", 0, 0);
        draining.draining = true;
        assert_eq!(
            decide_simple(None, &cells, &feeds(&[("c", draining)])),
            Decision::Exhausted
        );
    }

    #[test]
    fn excluded_cells_are_skipped() {
        let cells = [cell("a", "db", true, 0, 0), cell("b", "db", true, 0, 0)];
        let decision = decide(
            None,
            &cells,
            &HashMap::new(),
            &PARAMS,
            &["a".to_string()],
            true,
            &mut Rng::seeded(3),
        );
        assert_eq!(placed(&decision), (1, vec![("b", Path::Database)]));
    }

    #[test]
    fn power_of_two_prefers_the_lighter_of_two_whatever_the_seed() {
        let cells = [cell("a", "db", true, 0, 50), cell("b", "db", true, 0, 10)];
        for seed in 0..50 {
            let decision = decide(
                None,
                &cells,
                &HashMap::new(),
                &PARAMS,
                &[],
                true,
                &mut Rng::seeded(seed),
            );
            assert_eq!(
                placed(&decision).1,
                vec![("b", Path::Database), ("a", Path::Database)]
            );
        }
    }

    #[test]
    fn fresh_feed_load_beats_the_heartbeat_count() {
        // The heartbeat says a is empty, but its feed (newer) says it holds 100.
        let cells = [cell("a", "db", true, 0, 0), cell("b", "db", true, 0, 10)];
        let decision = decide_simple(None, &cells, &feeds(&[("a", feed("db", 100, 0))]));
        assert_eq!(
            placed(&decision).1,
            vec![("b", Path::Database), ("a", Path::Database)]
        );
    }

    #[test]
    fn power_of_two_spreads_over_many_cells_and_never_picks_the_heaviest_first() {
        let cells: Vec<CellRow> = (0..10)
            .map(|n| cell(&format!("c{n}"), "db", true, 0, n * 10))
            .collect();
        let mut rng = Rng::seeded(42);
        let mut firsts = std::collections::BTreeSet::new();
        for _ in 0..200 {
            let decision = decide(None, &cells, &HashMap::new(), &PARAMS, &[], true, &mut rng);
            let (_, order) = placed(&decision);
            assert_eq!(order.len(), 10, "every candidate is listed once");
            assert_ne!(order[0].0, "c9", "the heaviest always loses its draw");
            firsts.insert(order[0].0.to_string());
        }
        assert!(firsts.len() > 3, "the draw spreads: {firsts:?}");
    }

    #[test]
    fn feed_freshness_is_three_polls_and_a_timeout() {
        assert_eq!(feed_fresh_ms(1_000, 2_000), 5_000);
    }

    #[test]
    fn a_draining_home_is_never_a_pin_and_its_desktop_is_placed_elsewhere_at_once() {
        let cells = [
            cell("a", "reserve", true, 0, 5),
            cell("b", "db", true, 0, 0),
        ];
        let mut draining = feed("reserve", 5, 0);
        draining.draining = true;
        assert_eq!(
            placed(&decide_simple(
                Some(&row("a", 4)),
                &cells,
                &feeds(&[("a", draining.clone())])
            )),
            (5, vec![("b", Path::Database)])
        );
        // Not ready either (its /ready says draining): still placed elsewhere, never a 503.
        let unready = [
            cell("a", "reserve", false, 0, 5),
            cell("b", "db", true, 0, 0),
        ];
        assert_eq!(
            placed(&decide_simple(
                Some(&row("a", 4)),
                &unready,
                &feeds(&[("a", draining.clone())])
            )),
            (5, vec![("b", Path::Database)])
        );
        // A draining feed of an earlier process says nothing about the one registered now.
        let mut earlier = draining;
        earlier.incarnation = 6;
        assert!(matches!(
            decide_simple(Some(&row("a", 4)), &cells, &feeds(&[("a", earlier)])),
            Decision::Pin { .. }
        ));
    }

    #[test]
    fn retired_cells_are_neither_pins_nor_candidates_once_retirement_is_judged() {
        let mut silent = cell("a", "reserve", true, 0, 0);
        silent.registered_age_ms = 600_001;
        if let Some(runtime) = silent.runtime.as_mut() {
            runtime.heartbeat_age_ms = 600_001;
        }
        // With a freshness window longer than the retire age, only retirement excludes it.
        let long_fresh = Params {
            heartbeat_fresh_ms: 10_000_000,
            ..PARAMS
        };
        let cells = [silent.clone(), cell("b", "db", true, 0, 0)];
        let decide_with = |params: &Params| {
            decide(
                Some(&row("a", 2)),
                &cells,
                &HashMap::new(),
                params,
                &[],
                true,
                &mut Rng::seeded(1),
            )
        };
        assert_eq!(
            placed(&decide_with(&long_fresh)),
            (3, vec![("b", Path::Database)])
        );
        // Before the director has been up the retire age, nobody is retired.
        let not_yet = Params {
            retire_after_ms: None,
            ..long_fresh
        };
        assert!(matches!(decide_with(&not_yet), Decision::Pin { .. }));
    }

    #[test]
    fn freshness_is_judged_on_the_database_age_not_the_director_clock() {
        // Stamps far from the director's now, ages fresh: fresh.
        let mut skewed = with_effective(cell("a", "reserve", true, 1_000, 0), "db", 7, 1_000);
        if let Some(runtime) = skewed.runtime.as_mut() {
            runtime.last_heartbeat_at = (NOW - 86_400_000) as i64;
        }
        if let Some(effective) = skewed.effective.as_mut() {
            effective.updated_at = (NOW + 86_400_000) as i64;
        }
        assert_eq!(
            placed(&decide_simple(None, &[skewed], &HashMap::new())),
            (1, vec![("a", Path::Database)])
        );
    }
}
