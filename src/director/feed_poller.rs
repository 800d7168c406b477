//! The `feed-poller` thread (SPEC §6.2): every `FEED_POLL_MS`, polls every registered cell's
//! seat feed `GET <internal_url>/internal/seats?since=<cursor>&reserver=1` with the service
//! token and a 2 s timeout. That poll is dead-man contact (SPEC §5.5): it is what keeps reserve
//! cells armed, so it goes on from the last known cell list while the database is down.
//!
//! Owns: the [`FeedBoard`] (per cell: the cursor, the modes, `draining`, the counts, the last
//! success, the failures in a row, the lane, and the cell's latest status report from its feed
//! or its heartbeat), which [`super::placement`] reads through
//! [`FeedBoard::snapshot`] and `GET /v1/admin/cells` through [`FeedBoard::status`].
//!
//! **Two lanes** (SPEC §11: unreachable entries never delay a live cell's contact beyond
//! 2 × `FEED_POLL_MS`). A registered cell that accepts TCP and never answers holds a worker
//! for the whole 2 s timeout; with one shared queue, N such entries delayed every live cell by
//! about N / workers × 2 s. So the cells are split, by [`lane_for`]:
//! - the **live lane** (`feed-live-<n>` workers) carries the *responsive* cells: those that
//!   gave an HTTP answer (any status) since their last timed-out poll. Every one is polled every
//!   period. A fast failure (an error status, a refused connection) costs a worker nothing and
//!   keeps a cell here; a timeout moves it out at once, so a cell that stops answering holds a
//!   live worker for one timeout, once;
//! - the **suspect lane** (`feed-suspect-<n>` workers) carries everything else: cells never
//!   heard from since this director started (new registrations, and all of them right after a
//!   director restart), cells whose last poll timed out, and the dead entries autoscaling leaves
//!   behind.
//!
//! **Contact after a fault** (SPEC §12). On the suspect lane, what the poller knows of a cell's
//! life decides when it is polled and in which order ([`Pacing`], [`Rank`]):
//! - a cell that **heartbeats** (a heartbeat within `HEARTBEAT_FRESH_MS`, to this director or,
//!   through the database, to another) is due every round, whatever its failures: a partition
//!   of its internal port ends with a poll within one period of the heal. One of the suspect
//!   workers is kept for such cells ([`SILENT_WORKERS`] is one fewer), so no number of silent
//!   entries can hold all of them;
//! - any other **sign of life** after the last failed poll (a registration) ends the backoff:
//!   the cell is due at once;
//! - a cell **not heard from** since its last failure waits its backoff ([`suspect_backoff_ms`]:
//!   doubling from one period, at most 30 s and at most a quarter of the shortest dead-man
//!   window, so a live cell the director could not see for a moment is never left until its
//!   window has nearly run out).
//!
//! The order of the waiting polls is decided when a worker takes one, from the figures of that
//! moment ([`FeedBoard::rank`]), never when the poll was queued: heartbeating cells first, then
//! other cells heard from since their last failure, then the silent ones; within each, a cell
//! that has answered before ahead of one that never has, then the fewest failures, then the
//! longest waiting.
//!
//! The 2 × `FEED_POLL_MS` bound holds against entries that do not heartbeat, however many. Cells
//! that heartbeat but never answer (a fleet whose internal port a firewall drops) are due every
//! round like a partitioned live cell, and share the suspect workers with it: a cell that has
//! answered before goes first among them, but no fixed set of workers can poll an unbounded
//! number of such cells every period.
//!
//! Retired cells ([`super::membership`]) are not polled at all; cells no longer registered leave
//! the board. Never one thread per cell per poll, never more than one poll in flight per cell.
//!
//! The cell list comes from the database through its own thread, `feed-lister`, which refreshes
//! a [`CellList`] every period; a round reads the latest list without waiting. A database that
//! stops answering without refusing (a partition, a stuck server) holds a listing for a whole
//! connect or statement wait; listed inline, that held every round, and reserve cells went
//! unpolled with their director up (found by the nemesis, `tests/contact_db_hang_pg.rs`).
//! A cell this director saw register or heartbeat after the listing the latest list came from
//! is merged into that list ([`FeedBoard::saw_registered`]): a cell that registered just before
//! the database stopped is polled through the outage (the nemesis again: it held past its
//! window with its director up). The database's ages are read against the time of the listing,
//! so a list kept through an outage does not make its cells look ever freshly heard from.
//!
//! Must never: hold the board's lock across a request, log the service token, or stop (or
//! delay) polling because the database is down or slow.

use std::collections::{HashMap, HashSet};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Duration;

use serde::Deserialize;

use super::membership::{self, Judge};
use super::placement::FeedView;
use crate::cell::status_report::StatusReport;
use crate::clock::SharedClock;
use crate::liveness::{wait_beating, Beat, Liveness, Standing, BEAT_PERIOD};
use crate::logging::KeyedThrottle;
use crate::metrics::Registry;
use crate::service_token::ServiceTokens;
use crate::store::{CellRow, Store};
use crate::threads;

/// Each feed request's timeout (SPEC §6.2).
pub const POLL_TIMEOUT: Duration = Duration::from_secs(2);
/// Workers of the live lane: they only wait on cells that answer (or have just stopped).
pub const LIVE_WORKERS: usize = 4;
/// Workers of the suspect lane: each silent cell holds one for a whole timeout.
pub const SUSPECT_WORKERS: usize = 4;
/// How many suspect workers may poll cells that do not heartbeat at once: one is always left
/// for a cell that does, so a partitioned live cell never queues behind dead entries' timeouts.
pub const SILENT_WORKERS: usize = SUSPECT_WORKERS - 1;
/// The longest wait between two polls of a suspect cell (also bounded by a quarter of the
/// shortest dead-man window, [`Pacing::new`]).
pub const SUSPECT_BACKOFF_MAX_MS: u64 = 30_000;

/// Which workers poll a cell.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lane {
    Live,
    Suspect,
}

impl Lane {
    pub fn as_str(self) -> &'static str {
        match self {
            Lane::Live => "live",
            Lane::Suspect => "suspect",
        }
    }
}

/// The lane of a cell: live while it is responsive (it gave an HTTP answer since its last
/// timed-out poll), suspect otherwise.
pub fn lane_for(responsive: bool) -> Lane {
    if responsive {
        Lane::Live
    } else {
        Lane::Suspect
    }
}

/// How long a suspect cell not heard from waits after its last failure before it is polled
/// again: one period after the first failure, doubling with each further one, at most
/// `backoff_max_ms`. A cell never polled yet is due at once.
pub fn suspect_backoff_ms(consecutive_failures: u32, period_ms: u64, backoff_max_ms: u64) -> u64 {
    match consecutive_failures {
        0 => 0,
        n => period_ms
            .saturating_mul(1u64 << (n - 1).min(20))
            .min(backoff_max_ms),
    }
}

/// The figures that pace the suspect lane.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pacing {
    /// `ORCA_RELAY_FEED_POLL_MS`.
    pub period_ms: u64,
    /// `ORCA_RELAY_HEARTBEAT_FRESH_MS`: a cell heartbeat within this long heartbeats.
    pub heartbeat_fresh_ms: u64,
    /// The longest backoff: 30 s, and at most a quarter of the shortest dead-man window.
    pub backoff_max_ms: u64,
}

impl Pacing {
    /// `shortest_window_ms` is `ORCA_RELAY_DEAD_MAN_BASE_MS` (a window is the base plus a
    /// spread); a cell that reports a shorter window of its own is paced by that one
    /// ([`FeedBoard::rank`]).
    pub fn new(period_ms: u64, heartbeat_fresh_ms: u64, shortest_window_ms: u64) -> Pacing {
        Pacing {
            period_ms,
            heartbeat_fresh_ms,
            backoff_max_ms: SUSPECT_BACKOFF_MAX_MS.min(shortest_window_ms / 4).max(1),
        }
    }

    pub fn from_config(config: &crate::config::Config) -> Pacing {
        let t = &config.timings;
        Pacing::new(t.feed_poll_ms, t.heartbeat_fresh_ms, t.dead_man_base_ms)
    }
}

/// What the poller knows of a cell's life, best first: the suspect lane serves the smallest.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Life {
    /// A heartbeat within `HEARTBEAT_FRESH_MS`.
    Heartbeating,
    /// Another sign of life (a registration, a heartbeat gone stale since) after its last
    /// failed poll, or no failed poll yet.
    HeardSinceFailure,
    /// Nothing since its last failed poll.
    Silent,
}

/// The order of a waiting poll, taken when a worker takes one: smaller first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Rank {
    pub life: Life,
    /// Never answered (a cell that has answered before is likelier to answer again).
    pub never_answered: bool,
    pub consecutive_failures: u32,
    /// The order in which the polls were queued (first come first).
    pub queued_seq: u64,
}

/// A sign of life that is not a poll.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sign {
    Heartbeat,
    Registration,
}

/// One cell's entry on the board. Times are this director's monotonic ms.
#[derive(Debug, Clone)]
struct CellFeed {
    /// `<incarnation>:<seq>` of the last answer; `None` asks for a full snapshot.
    cursor: Option<String>,
    view: Option<FeedView>,
    /// Queued or being polled.
    in_flight: bool,
    consecutive_failures: u32,
    /// Gave an HTTP answer (any status) since its last timed-out poll.
    responsive: bool,
    lane: Lane,
    /// The latest failed poll, answered poll, heartbeat and any sign of life (heartbeat or
    /// registration), as this director learnt of them.
    failed_at_ms: Option<u64>,
    answered_at_ms: Option<u64>,
    heartbeat_at_ms: Option<u64>,
    heard_at_ms: Option<u64>,
    /// The cell's latest status report, from whichever arrived last: a feed answer or a
    /// heartbeat (`cell::status_report`: a cell this director cannot poll still heartbeats).
    report: Option<ReceivedReport>,
}

impl Default for CellFeed {
    fn default() -> Self {
        CellFeed {
            cursor: None,
            view: None,
            in_flight: false,
            consecutive_failures: 0,
            responsive: false,
            lane: Lane::Suspect,
            failed_at_ms: None,
            answered_at_ms: None,
            heartbeat_at_ms: None,
            heard_at_ms: None,
            report: None,
        }
    }
}

impl CellFeed {
    fn life(&self, now_ms: u64, pacing: &Pacing) -> Life {
        let heartbeating = self
            .heartbeat_at_ms
            .is_some_and(|at| now_ms.saturating_sub(at) < pacing.heartbeat_fresh_ms);
        if heartbeating {
            return Life::Heartbeating;
        }
        let heard_since_failure = match (self.heard_at_ms, self.failed_at_ms) {
            (_, None) => true,
            (Some(heard), Some(failed)) => heard > failed,
            (None, Some(_)) => false,
        };
        if heard_since_failure {
            Life::HeardSinceFailure
        } else {
            Life::Silent
        }
    }

    /// The longest backoff for this cell: the fleet's, or a quarter of the window it reports.
    fn backoff_max_ms(&self, pacing: &Pacing) -> u64 {
        match self.report.as_ref().map(|r| r.report.window_ms) {
            Some(window_ms) if window_ms > 0 => pacing.backoff_max_ms.min(window_ms / 4).max(1),
            _ => pacing.backoff_max_ms,
        }
    }

    /// Whether a suspect cell may be polled at `now_ms`: a sign of life ends its backoff.
    fn suspect_due(&self, now_ms: u64, pacing: &Pacing) -> bool {
        match self.life(now_ms, pacing) {
            Life::Heartbeating | Life::HeardSinceFailure => true,
            Life::Silent => {
                let failed_at = self.failed_at_ms.unwrap_or(0);
                let wait = suspect_backoff_ms(
                    self.consecutive_failures,
                    pacing.period_ms,
                    self.backoff_max_ms(pacing),
                );
                now_ms >= failed_at.saturating_add(wait)
            }
        }
    }
}

/// Where a status report came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReportSource {
    Feed,
    Heartbeat,
}

impl ReportSource {
    pub fn as_str(self) -> &'static str {
        match self {
            ReportSource::Feed => "feed",
            ReportSource::Heartbeat => "heartbeat",
        }
    }
}

/// A cell's status report as this director received it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReceivedReport {
    pub report: StatusReport,
    /// The incarnation of the process that sent it (a report of an earlier one is not shown).
    pub incarnation: i64,
    pub source: ReportSource,
    /// When it arrived, on this director's clock (ms since the epoch): its age is the
    /// director's own measurement, never compared with the cell's clock.
    pub received_ms: u64,
}

/// What `GET /v1/admin/cells` shows of one cell's feed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FeedStatus {
    /// The last successful answer, if any.
    pub view: Option<FeedView>,
    pub consecutive_failures: u32,
    pub lane: Lane,
    /// The latest status report (feed or heartbeat).
    pub report: Option<ReceivedReport>,
}

/// What the poller knows of every cell; a cheap clone of one `Arc<Mutex<…>>`, locked only to
/// copy or update a few fields.
#[derive(Clone, Default)]
pub struct FeedBoard {
    cells: Arc<Mutex<HashMap<String, CellFeed>>>,
    /// The cells this director saw register or heartbeat (the database took the write), kept
    /// until a listing that began after it: merged into the latest list by [`Rounds::round`].
    seen: Arc<Mutex<HashMap<String, (SeenCell, u64)>>>,
}

/// A registration or heartbeat this director served: what polling the cell needs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SeenCell {
    pub cell_id: String,
    pub cell_url: String,
    pub internal_url: String,
    pub region: String,
    pub incarnation: i64,
}

impl SeenCell {
    /// The row a round polls from: just heard from (age 0), no runtime known.
    fn row(&self) -> CellRow {
        CellRow {
            cell_id: self.cell_id.clone(),
            cell_url: self.cell_url.clone(),
            internal_url: Some(self.internal_url.clone()),
            region: self.region.clone(),
            incarnation: self.incarnation,
            registered_at: 0,
            registered_age_ms: 0,
            runtime: None,
            admit_mode: String::new(),
            admit_mode_updated_at: None,
            effective: None,
        }
    }
}

/// One poll to make, built when a worker takes it.
struct PollJob {
    cell_id: String,
    internal_url: String,
    cursor: Option<String>,
    lane: Lane,
    /// Counted against [`SILENT_WORKERS`] (the cell does not heartbeat).
    silent: bool,
}

impl FeedBoard {
    pub fn new() -> FeedBoard {
        FeedBoard::default()
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<String, CellFeed>> {
        self.cells.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The latest successful answer of every cell that has given one.
    pub fn snapshot(&self) -> HashMap<String, FeedView> {
        self.lock()
            .iter()
            .filter_map(|(id, feed)| Some((id.clone(), feed.view.clone()?)))
            .collect()
    }

    /// Every cell on the board: its last answer, failures in a row and lane.
    pub fn status(&self) -> HashMap<String, FeedStatus> {
        self.lock()
            .iter()
            .map(|(id, feed)| {
                (
                    id.clone(),
                    FeedStatus {
                        view: feed.view.clone(),
                        consecutive_failures: feed.consecutive_failures,
                        lane: feed.lane,
                        report: feed.report.clone(),
                    },
                )
            })
            .collect()
    }

    /// A sign of life from `cell_id` at `now_ms` (this director's monotonic clock): a heartbeat
    /// or a registration this director served, or one the database reports (through another
    /// director). It ends the cell's backoff ([`CellFeed::suspect_due`]).
    pub fn heard_from(&self, cell_id: &str, sign: Sign, now_ms: u64) {
        let mut cells = self.lock();
        let feed = cells.entry(cell_id.to_string()).or_default();
        feed.heard_at_ms = feed.heard_at_ms.max(Some(now_ms));
        if sign == Sign::Heartbeat {
            feed.heartbeat_at_ms = feed.heartbeat_at_ms.max(Some(now_ms));
        }
    }

    /// A registration or heartbeat of `cell` this director served at `now_ms` (monotonic), the
    /// database having taken it: the cell is polled from the next round, whether or not the
    /// database can list it by then, until a listing that began after this one has it (or has
    /// not: the cell was deregistered or forgotten since).
    pub fn saw_registered(&self, cell: SeenCell, now_ms: u64) {
        if cell.internal_url.is_empty() {
            return;
        }
        let mut seen = self.seen.lock().unwrap_or_else(|e| e.into_inner());
        match seen.get(&cell.cell_id) {
            Some((held, _)) if held.incarnation > cell.incarnation => {}
            _ => {
                seen.insert(cell.cell_id.clone(), (cell, now_ms));
            }
        }
    }

    /// `cell_id`'s incarnations up to `incarnation` deregistered through this director.
    pub fn deregistered(&self, cell_id: &str, incarnation: i64) {
        let mut seen = self.seen.lock().unwrap_or_else(|e| e.into_inner());
        if seen
            .get(cell_id)
            .is_some_and(|(held, _)| held.incarnation <= incarnation)
        {
            seen.remove(cell_id);
        }
    }

    /// `listed` (a listing that began at `listed_at_ms`, monotonic) with the cells seen since
    /// merged in: a seen cell's internal URL and incarnation replace the listed ones, a cell
    /// not listed is added. Seen cells the listing already covers are dropped.
    fn with_seen(&self, listed: &[CellRow], listed_at_ms: Option<u64>) -> Vec<CellRow> {
        let mut seen = self.seen.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(listed_at) = listed_at_ms {
            seen.retain(|_, (_, seen_at)| *seen_at > listed_at);
        }
        let mut cells: Vec<CellRow> = listed.to_vec();
        for (cell, _) in seen.values() {
            match cells.iter_mut().find(|row| row.cell_id == cell.cell_id) {
                Some(row) if row.incarnation <= cell.incarnation => {
                    row.internal_url = Some(cell.internal_url.clone());
                    row.incarnation = cell.incarnation;
                    row.registered_age_ms = 0;
                }
                Some(_) => {}
                None => cells.push(cell.row()),
            }
        }
        cells
    }

    /// Records what the database says of `cell`'s latest heartbeat and registration (their
    /// ages, on its clock, at the listing that began at `listed_at_ms`) as signs of life at
    /// `listed_at_ms` minus those ages.
    fn observe(&self, cell: &CellRow, listed_at_ms: u64) {
        let at = |age_ms: i64| listed_at_ms.saturating_sub(age_ms.max(0) as u64);
        let mut cells = self.lock();
        let feed = cells.entry(cell.cell_id.clone()).or_default();
        let registered = Some(at(cell.registered_age_ms));
        feed.heard_at_ms = feed.heard_at_ms.max(registered);
        if let Some(runtime) = &cell.runtime {
            let beat = Some(at(runtime.heartbeat_age_ms));
            feed.heartbeat_at_ms = feed.heartbeat_at_ms.max(beat);
            feed.heard_at_ms = feed.heard_at_ms.max(beat);
        }
    }

    /// The lane of `cell_id` now, and whether it is due this round (then marked in flight):
    /// not when a poll is already queued or in flight, nor while a silent suspect cell's
    /// backoff runs.
    fn schedule(&self, cell_id: &str, now_ms: u64, pacing: &Pacing) -> (Lane, bool) {
        let mut cells = self.lock();
        let feed = cells.entry(cell_id.to_string()).or_default();
        let lane = lane_for(feed.responsive);
        if feed.in_flight || (lane == Lane::Suspect && !feed.suspect_due(now_ms, pacing)) {
            return (lane, false);
        }
        if lane != feed.lane {
            log::info!(
                "orca_relay_director_feed_lane cell_id={cell_id} lane={} consecutive_failures={}",
                lane.as_str(),
                feed.consecutive_failures
            );
            feed.lane = lane;
        }
        feed.in_flight = true;
        (lane, true)
    }

    /// The rank of a waiting poll of `cell_id` at `now_ms`, or `None` when the cell has left the
    /// board (its poll is dropped).
    fn rank(&self, cell_id: &str, queued_seq: u64, now_ms: u64, pacing: &Pacing) -> Option<Rank> {
        let cells = self.lock();
        // A cell that left the board (and perhaps came back) has no poll queued any more.
        let feed = cells.get(cell_id).filter(|feed| feed.in_flight)?;
        Some(Rank {
            life: feed.life(now_ms, pacing),
            never_answered: feed.answered_at_ms.is_none(),
            consecutive_failures: feed.consecutive_failures,
            queued_seq,
        })
    }

    /// The poll of `cell_id` a worker takes now: the cursor as of now.
    fn job(&self, waiting: &Waiting, lane: Lane, silent: bool) -> PollJob {
        let cursor = self
            .lock()
            .get(&waiting.cell_id)
            .and_then(|feed| feed.cursor.clone());
        PollJob {
            cell_id: waiting.cell_id.clone(),
            internal_url: waiting.internal_url.clone(),
            cursor,
            lane,
            silent,
        }
    }

    /// Keeps the status report a cell's heartbeat carried (received at `now_ms`, this
    /// director's clock), unless a later one has arrived.
    pub fn record_report(
        &self,
        cell_id: &str,
        incarnation: i64,
        report: StatusReport,
        now_ms: u64,
    ) {
        let mut cells = self.lock();
        let feed = cells.entry(cell_id.to_string()).or_default();
        keep_latest(
            &mut feed.report,
            ReceivedReport {
                report,
                incarnation,
                source: ReportSource::Heartbeat,
                received_ms: now_ms,
            },
        );
    }

    /// Records an answered poll at `monotonic_ms`.
    fn succeed(
        &self,
        cell_id: &str,
        cursor: String,
        view: FeedView,
        report: Option<StatusReport>,
        monotonic_ms: u64,
    ) {
        let mut cells = self.lock();
        let feed = cells.entry(cell_id.to_string()).or_default();
        if let Some(report) = report {
            keep_latest(
                &mut feed.report,
                ReceivedReport {
                    report,
                    incarnation: view.incarnation,
                    source: ReportSource::Feed,
                    received_ms: view.last_success_ms,
                },
            );
        }
        feed.cursor = Some(cursor);
        feed.view = Some(view);
        feed.in_flight = false;
        feed.consecutive_failures = 0;
        feed.responsive = true;
        feed.answered_at_ms = Some(monotonic_ms);
        feed.heard_at_ms = feed.heard_at_ms.max(Some(monotonic_ms));
    }

    /// Records a failed poll at `now_ms` (monotonic); returns how many in a row. The cursor is
    /// dropped so the next answer is a full snapshot (a restarted cell may not know the old
    /// one), and a silent suspect cell waits its backoff before the next try. A timeout makes
    /// the cell unresponsive (suspect lane); an HTTP answer, even an error, makes it
    /// responsive and is a sign of life; a refused or reset connection (fast) leaves that as it
    /// was.
    fn fail(&self, cell_id: &str, error: PollError, now_ms: u64) -> u32 {
        let mut cells = self.lock();
        let feed = cells.entry(cell_id.to_string()).or_default();
        feed.cursor = None;
        feed.in_flight = false;
        match error {
            PollError::TimedOut => feed.responsive = false,
            PollError::HttpStatus | PollError::BadBody | PollError::WrongCell => {
                feed.responsive = true;
                feed.answered_at_ms = Some(now_ms);
            }
            PollError::Transport => {}
        }
        feed.consecutive_failures = feed.consecutive_failures.saturating_add(1);
        feed.failed_at_ms = Some(now_ms);
        feed.consecutive_failures
    }

    /// Forgets the cells not in `registered` (deregistered or forgotten), so the board stays
    /// as small as the fleet. A poll in flight for one of them just finds no entry.
    fn retain(&self, registered: &HashSet<&str>) {
        self.lock().retain(|id, _| registered.contains(id.as_str()));
    }
}

/// Replaces `slot` with `received` unless `slot` holds a report that arrived later (a feed
/// answer and a heartbeat can cross).
fn keep_latest(slot: &mut Option<ReceivedReport>, received: ReceivedReport) {
    if slot
        .as_ref()
        .is_none_or(|held| held.received_ms <= received.received_ms)
    {
        *slot = Some(received);
    }
}

/// A cell whose poll is due and waits for a worker of its lane.
#[derive(Debug, Clone)]
struct Waiting {
    cell_id: String,
    internal_url: String,
    seq: u64,
}

/// The polls waiting for one lane's workers. Which one a worker takes is decided when it takes
/// it, by [`FeedBoard::rank`] at that moment ([`JobQueue::take`]).
struct JobQueue {
    lane: Lane,
    state: Mutex<QueueState>,
    ready: Condvar,
    /// How many of this lane's workers may poll cells that do not heartbeat at once.
    silent_workers: usize,
}

#[derive(Default)]
struct QueueState {
    waiting: Vec<Waiting>,
    next_seq: u64,
    /// Polls in progress of cells that do not heartbeat.
    silent_polling: usize,
    closed: bool,
}

impl JobQueue {
    fn new(lane: Lane, silent_workers: usize) -> Arc<JobQueue> {
        Arc::new(JobQueue {
            lane,
            state: Mutex::new(QueueState::default()),
            ready: Condvar::new(),
            silent_workers,
        })
    }

    fn lock(&self) -> MutexGuard<'_, QueueState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn push(&self, cell_id: &str, internal_url: &str) {
        let mut state = self.lock();
        let seq = state.next_seq;
        state.next_seq += 1;
        state.waiting.push(Waiting {
            cell_id: cell_id.to_string(),
            internal_url: internal_url.to_string(),
            seq,
        });
        drop(state);
        self.ready.notify_one();
    }

    /// The best waiting poll by the board's figures at this moment; a cell that does not
    /// heartbeat only while fewer than `silent_workers` such polls are in progress. Waits for
    /// one (re-ranking at least every `recheck`, as heartbeats change the figures); `None`
    /// once the queue is closed (polls still waiting are dropped).
    #[cfg(test)]
    fn take(
        &self,
        board: &FeedBoard,
        pacing: &Pacing,
        clock: &SharedClock,
        recheck: Duration,
    ) -> Option<PollJob> {
        loop {
            match self.take_within(board, pacing, clock, recheck, Duration::from_secs(3600)) {
                Taken::Job(job) => return Some(job),
                Taken::Idle => {}
                Taken::Closed => return None,
            }
        }
    }

    /// As [`JobQueue::take`], waiting at most `wait` (a worker is a critical thread: it beats
    /// between two calls, outside the queue's lock).
    fn take_within(
        &self,
        board: &FeedBoard,
        pacing: &Pacing,
        clock: &SharedClock,
        recheck: Duration,
        wait: Duration,
    ) -> Taken {
        let until = crate::clock::instant() + wait;
        let mut state = self.lock();
        loop {
            if state.closed {
                return Taken::Closed;
            }
            let now = clock.monotonic_ms();
            let silent_allowed = state.silent_polling < self.silent_workers;
            let mut best: Option<(Rank, usize)> = None;
            let mut gone = Vec::new();
            for (index, waiting) in state.waiting.iter().enumerate() {
                let Some(rank) = board.rank(&waiting.cell_id, waiting.seq, now, pacing) else {
                    gone.push(index);
                    continue;
                };
                let silent = rank.life != Life::Heartbeating;
                if silent && !silent_allowed {
                    continue;
                }
                if best.is_none_or(|(held, _)| rank < held) {
                    best = Some((rank, index));
                }
            }
            if let Some((rank, index)) = best {
                let waiting = state.waiting.swap_remove(index);
                let silent = rank.life != Life::Heartbeating;
                if silent {
                    state.silent_polling += 1;
                }
                // Polls of cells that left the board are dropped (indices after `index` moved;
                // they are found again next time).
                return Taken::Job(board.job(&waiting, self.lane, silent));
            }
            for index in gone.into_iter().rev() {
                state.waiting.swap_remove(index);
            }
            let left = until.saturating_duration_since(crate::clock::instant());
            if left.is_zero() {
                return Taken::Idle;
            }
            let wait = if state.waiting.is_empty() {
                left
            } else {
                recheck.min(left)
            };
            state = self
                .ready
                .wait_timeout(state, wait)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// A poll taken by [`JobQueue::take_within`] is over.
    fn finished(&self, job: &PollJob) {
        if job.silent {
            let mut state = self.lock();
            state.silent_polling = state.silent_polling.saturating_sub(1);
            drop(state);
            self.ready.notify_all();
        }
    }

    fn close(&self) {
        self.lock().closed = true;
        self.ready.notify_all();
    }
}

/// What [`JobQueue::take_within`] found.
enum Taken {
    Job(PollJob),
    /// Nothing to take within the wait.
    Idle,
    /// The queue is closed (polls still waiting are dropped).
    Closed,
}

/// The seat feed's answer, read leniently: unknown fields are ignored, and so are the seats
/// themselves (`full` / `changes`), which placement does not use.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct FeedAnswer {
    cell_id: String,
    incarnation: i64,
    seq: u64,
    admit_mode_raw: String,
    admit_mode_effective: String,
    #[serde(default)]
    draining: bool,
    #[serde(default)]
    counts: Counts,
    /// The cell's status report (an additive field; older cells have none). Read on its own,
    /// so a report this director cannot read never costs the poll.
    #[serde(default)]
    status: Option<serde_json::Value>,
}

#[derive(Debug, Default, Deserialize)]
struct Counts {
    #[serde(default)]
    seated: u64,
    #[serde(default)]
    bookings: u64,
    #[serde(default)]
    connections: u64,
}

/// Why one poll failed, as a metric label and log field.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PollError {
    TimedOut,
    Transport,
    HttpStatus,
    BadBody,
    WrongCell,
}

impl PollError {
    fn as_str(self) -> &'static str {
        match self {
            PollError::TimedOut => "timeout",
            PollError::Transport => "transport",
            PollError::HttpStatus => "http_error",
            PollError::BadBody => "bad_body",
            PollError::WrongCell => "wrong_cell",
        }
    }
}

/// One parsed answer: the next cursor, the view, and the status report when it had one.
type Parsed = (String, FeedView, Option<StatusReport>);

/// Parses one answer of `cell_id`'s feed into its next cursor, its view and its report.
fn parse_answer(cell_id: &str, body: &str, now_ms: u64) -> Result<Parsed, PollError> {
    let answer: FeedAnswer = serde_json::from_str(body).map_err(|_| PollError::BadBody)?;
    if answer.cell_id != cell_id {
        // The registered internal URL reaches another cell: believing it would book seats
        // on the wrong cell.
        return Err(PollError::WrongCell);
    }
    let cursor = format!("{}:{}", answer.incarnation, answer.seq);
    let report = answer
        .status
        .and_then(|status| serde_json::from_value::<StatusReport>(status).ok());
    Ok((
        cursor,
        FeedView {
            incarnation: answer.incarnation,
            admit_mode_raw: answer.admit_mode_raw,
            admit_mode_effective: answer.admit_mode_effective,
            draining: answer.draining,
            seated: answer.counts.seated,
            bookings: answer.counts.bookings,
            connections: answer.counts.connections,
            last_success_ms: now_ms,
        },
        report,
    ))
}

/// The URL of one poll.
fn feed_url(internal_url: &str, cursor: Option<&str>) -> String {
    let base = internal_url.trim_end_matches('/');
    match cursor {
        Some(cursor) => format!("{base}/internal/seats?since={cursor}&reserver=1"),
        None => format!("{base}/internal/seats?reserver=1"),
    }
}

/// Everything a poll needs, shared by the workers.
struct Poller {
    board: FeedBoard,
    agent: ureq::Agent,
    service_token: ServiceTokens,
    clock: SharedClock,
    registry: Registry,
    pacing: Pacing,
    /// Throttles the failure lines of each cell (`logging::KeyedThrottle`).
    failures: KeyedThrottle,
}

impl Poller {
    fn poll(&self, job: &PollJob) {
        let url = feed_url(&job.internal_url, job.cursor.as_deref());
        let answer = self
            .service_token
            .call_http(&job.internal_url, POLL_TIMEOUT, |token, left| {
                self.agent
                    .get(&url)
                    .timeout(left)
                    .set("Authorization", &format!("Bearer {token}"))
                    .call()
                    .map_err(Box::new)
            })
            .map_err(|error| *error);
        let result = match answer {
            Ok(response) => match response.into_string() {
                Ok(body) => parse_answer(&job.cell_id, &body, self.clock.now_ms()),
                Err(_) => Err(PollError::BadBody),
            },
            Err(ureq::Error::Status(_, _)) => Err(PollError::HttpStatus),
            Err(ureq::Error::Transport(transport)) => {
                Err(if crate::outbound::is_timeout(&transport) {
                    PollError::TimedOut
                } else {
                    PollError::Transport
                })
            }
        };
        let label = match &result {
            Ok(_) => "ok",
            Err(error) => error.as_str(),
        };
        self.registry
            .counter(
                "orca_relay_director_feed_polls_total",
                "Seat-feed polls of each cell, by result.",
                &[("cell_id", &job.cell_id), ("result", label)],
            )
            .inc();
        match result {
            Ok((cursor, view, report)) => {
                self.board.succeed(
                    &job.cell_id,
                    cursor,
                    view,
                    report,
                    self.clock.monotonic_ms(),
                );
                if let Some(note) = self.failures.success(&job.cell_id) {
                    log::info!(
                        "orca_relay_director_feed_poll_recovered cell_id={}{note}",
                        job.cell_id
                    );
                }
            }
            Err(error) => {
                let failures = self
                    .board
                    .fail(&job.cell_id, error, self.clock.monotonic_ms());
                // The first failure of a run, then at most once a minute with a count, then
                // once on recovery: a dead cell polled every second is not a line a second.
                if let Some(note) = self.failures.failure(&job.cell_id, self.clock.now_ms()) {
                    log::warn!(
                        "orca_relay_director_feed_poll_failed cell_id={} result={} consecutive={failures} lane={}{note}",
                        job.cell_id,
                        error.as_str(),
                        job.lane.as_str()
                    );
                }
            }
        }
    }
}

/// The registered cells as the database last listed them: `feed-lister` replaces the list, the
/// coordinator takes the latest one at each round without waiting.
#[derive(Clone, Default)]
struct CellList(Arc<Mutex<Listing>>);

/// One listing: when it began (this director's monotonic ms; `None` before the first) and the
/// cells it returned.
#[derive(Clone, Default)]
struct Listing {
    began_ms: Option<u64>,
    cells: Arc<Vec<CellRow>>,
}

impl CellList {
    fn latest(&self) -> Listing {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    fn replace(&self, began_ms: u64, cells: Vec<CellRow>) {
        *self.0.lock().unwrap_or_else(|e| e.into_inner()) = Listing {
            began_ms: Some(began_ms),
            cells: Arc::new(cells),
        };
    }
}

/// The `feed-lister` thread: lists the registered cells every `period` into `list`, logging a
/// failure once per cause and the recovery once. A failed or slow listing leaves the last list
/// in place: the poll is what keeps reserve cells armed, and a database outage is exactly when
/// that matters.
fn run_lister(
    store: &Store,
    clock: &SharedClock,
    list: &CellList,
    period: Duration,
    stop: Receiver<()>,
    beat: &Beat,
) {
    let mut store_failing: Option<&'static str> = None;
    let mut next = crate::clock::instant();
    loop {
        beat.beat();
        // Taken before the query: a registration this director saw earlier is in the answer.
        let began_ms = clock.monotonic_ms();
        // A listing waits on the database (one that hangs is not this thread stuck).
        match beat.waiting(|| store.list_cells()) {
            Ok(listed) => {
                if store_failing.take().is_some() {
                    log::info!(
                        "orca_relay_director_feed_poller_cells_listed cells={}",
                        listed.len()
                    );
                }
                list.replace(began_ms, listed);
            }
            Err(error) => {
                let reason = error.reason_code();
                if store_failing != Some(reason) {
                    log::warn!(
                        "orca_relay_director_feed_poller_cells_unavailable {} known_cells={}",
                        error.log_fields(),
                        list.latest().cells.len()
                    );
                }
                store_failing = Some(reason);
            }
        }
        let now = crate::clock::instant();
        next += period;
        if next < now {
            next = now;
        }
        if wait_beating(&stop, next, beat) {
            return;
        }
    }
}

/// How to build the poller.
pub struct FeedPollerConfig {
    pub board: FeedBoard,
    pub store: Store,
    pub service_token: ServiceTokens,
    pub clock: SharedClock,
    pub registry: Registry,
    /// `ORCA_RELAY_FEED_POLL_MS` and the rest of the suspect lane's pacing.
    pub pacing: Pacing,
    /// Which cells are retired (not polled).
    pub membership: Judge,
    /// Every poller thread is a critical thread of the process.
    pub liveness: Liveness,
}

/// The running poller: its coordinator and workers. Stop it with [`FeedPoller::stop`].
pub struct FeedPoller {
    stop: Sender<()>,
    coordinator: JoinHandle<()>,
    /// The coordinator's, the lister's and every worker's: stood down before they stop.
    standings: Vec<Standing>,
}

/// What the coordinator needs besides the store.
struct Rounds {
    board: FeedBoard,
    clock: SharedClock,
    period: Duration,
    pacing: Pacing,
    membership: Judge,
    live: Arc<JobQueue>,
    suspect: Arc<JobQueue>,
    registry: Registry,
}

impl FeedPoller {
    /// Starts `feed-poller`, `feed-lister` and the `feed-live-<n>` and `feed-suspect-<n>`
    /// workers.
    pub fn start(config: FeedPollerConfig) -> std::io::Result<FeedPoller> {
        let poller = Arc::new(Poller {
            board: config.board,
            agent: ureq::AgentBuilder::new().timeout(POLL_TIMEOUT).build(),
            service_token: config.service_token,
            clock: config.clock.clone(),
            registry: config.registry.clone(),
            pacing: config.pacing,
            failures: KeyedThrottle::new(),
        });
        let period = Duration::from_millis(config.pacing.period_ms.max(1));
        let live = JobQueue::new(Lane::Live, LIVE_WORKERS);
        let suspect = JobQueue::new(Lane::Suspect, SILENT_WORKERS);
        let liveness = config.liveness;
        let mut standings = Vec::new();
        let mut workers = Vec::with_capacity(LIVE_WORKERS + SUSPECT_WORKERS);
        for (lane, queue, count) in [
            ("live", &live, LIVE_WORKERS),
            ("suspect", &suspect, SUSPECT_WORKERS),
        ] {
            for n in 0..count {
                let poller = poller.clone();
                let queue = queue.clone();
                let name = format!("feed-{lane}-{n}");
                let (worker, standing) =
                    liveness.spawn_critical(&name, BEAT_PERIOD, move |beat| {
                        // Heartbeats change the order of waiting polls: a worker with nothing it
                        // may take looks again every period.
                        loop {
                            beat.beat();
                            let job = match queue.take_within(
                                &poller.board,
                                &poller.pacing,
                                &poller.clock,
                                period,
                                BEAT_PERIOD,
                            ) {
                                Taken::Job(job) => job,
                                Taken::Idle => continue,
                                Taken::Closed => return,
                            };
                            // A poll waits on the cell (2 s at most).
                            beat.waiting(|| poller.poll(&job));
                            queue.finished(&job);
                        }
                    })?;
                workers.push(worker);
                standings.push(standing);
            }
        }
        let (stop, stop_receiver) = mpsc::channel();
        let list = CellList::default();
        let (lister_stop, lister_stop_receiver) = mpsc::channel::<()>();
        let (lister, lister_standing) = {
            let (store, clock, list) = (config.store, config.clock.clone(), list.clone());
            liveness.spawn_critical_watched("feed-lister", BEAT_PERIOD, move |beat| {
                run_lister(&store, &clock, &list, period, lister_stop_receiver, &beat)
            })?
        };
        standings.push(lister_standing);
        let rounds = Rounds {
            board: poller.board.clone(),
            clock: config.clock,
            period,
            pacing: config.pacing,
            membership: config.membership,
            live: live.clone(),
            suspect: suspect.clone(),
            registry: config.registry,
        };
        let (coordinator, coordinator_standing) =
            liveness.spawn_critical("feed-poller", BEAT_PERIOD, move |beat| {
                rounds.run(&list, stop_receiver, &beat);
                // The lister ends after its current listing; one that waits on a database that
                // stopped answering is left to end with the process.
                drop(lister_stop);
                lister.join_within("feed-lister", crate::threads::STOP_WAIT);
                // The queues are closed: each worker ends after its current poll (≤ 2 s).
                live.close();
                suspect.close();
                for worker in workers {
                    threads::join_logged("feed-poll", worker);
                }
            })?;
        standings.push(coordinator_standing);
        Ok(FeedPoller {
            stop,
            coordinator,
            standings,
        })
    }

    /// Stops polling and joins every poller thread (at most one poll timeout).
    pub fn stop(self) {
        for standing in &self.standings {
            standing.stand_down();
        }
        let _ = self.stop.send(());
        threads::join_logged("feed-poller", self.coordinator);
    }
}

impl Rounds {
    fn cells_gauge(&self, lane: &str) -> crate::metrics::Gauge {
        self.registry.gauge(
            "orca_relay_director_feed_cells",
            "Registered cells by feed-poller lane (retired cells are not polled).",
            &[("lane", lane)],
        )
    }

    /// One round every period, at a fixed rate (a slow round does not push the next ones back),
    /// over the latest list `feed-lister` has (never waiting for the database).
    fn run(&self, list: &CellList, stop: Receiver<()>, beat: &Beat) {
        log::info!(
            "orca_relay_director_feed_poller_started period_ms={} live_workers={LIVE_WORKERS} suspect_workers={SUSPECT_WORKERS}",
            self.period.as_millis()
        );
        let mut next_round = crate::clock::instant();
        loop {
            beat.beat();
            let listing = list.latest();
            let cells = self.board.with_seen(&listing.cells, listing.began_ms);
            self.round(&cells, listing.began_ms);
            let now = crate::clock::instant();
            next_round += self.period;
            if next_round < now {
                next_round = now;
            }
            if wait_beating(&stop, next_round, beat) {
                break;
            }
        }
        log::info!("orca_relay_director_feed_poller_stopped");
    }

    /// Hands every due cell to its lane; `listed_at_ms` is when the listing began.
    fn round(&self, cells: &[CellRow], listed_at_ms: Option<u64>) {
        let now = self.clock.monotonic_ms();
        let listed_at = listed_at_ms.unwrap_or(now).min(now);
        let retire_after = self.membership.retire_after(now);
        let registered: HashSet<&str> = cells.iter().map(|c| c.cell_id.as_str()).collect();
        self.board.retain(&registered);
        let (mut retired, mut live, mut suspect) = (0, 0, 0);
        for cell in cells {
            if membership::is_retired(cell, retire_after) {
                retired += 1;
                continue;
            }
            let Some(internal_url) = &cell.internal_url else {
                continue;
            };
            self.board.observe(cell, listed_at);
            let (lane, due) = self.board.schedule(&cell.cell_id, now, &self.pacing);
            let queue = match lane {
                Lane::Live => {
                    live += 1;
                    &self.live
                }
                Lane::Suspect => {
                    suspect += 1;
                    &self.suspect
                }
            };
            if due {
                queue.push(&cell.cell_id, internal_url);
            }
        }
        self.cells_gauge("retired").set(retired);
        self.cells_gauge("live").set(live);
        self.cells_gauge("suspect").set(suspect);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn answers_parse_leniently_into_the_next_cursor() {
        let body = r#"{"v":1,"cellId":"c7","incarnation":1700,"seq":42,
            "admitModeRaw":"reserve","admitModeEffective":"reserve","draining":false,
            "counts":{"seated":3,"bookings":1,"connections":5,"future":9},
            "changes":[{"kind":"join","userId":"u","relayHostId":"h","epoch":1}],
            "somethingNew":{"x":1}}"#;
        let (cursor, view, report) = parse_answer("c7", body, 99).expect("parses");
        assert_eq!(cursor, "1700:42");
        assert_eq!(report, None, "an older cell sends no status");
        assert_eq!(
            view,
            FeedView {
                incarnation: 1700,
                admit_mode_raw: "reserve".into(),
                admit_mode_effective: "reserve".into(),
                draining: false,
                seated: 3,
                bookings: 1,
                connections: 5,
                last_success_ms: 99,
            }
        );
        let minimal = r#"{"cellId":"c7","incarnation":1,"seq":0,"admitModeRaw":"db","admitModeEffective":"db","full":[]}"#;
        assert!(parse_answer("c7", minimal, 0).is_ok());
    }

    #[test]
    fn bad_or_foreign_answers_are_failures() {
        assert_eq!(parse_answer("c7", "nope", 0), Err(PollError::BadBody));
        assert_eq!(
            parse_answer("c7", r#"{"cellId":"c7"}"#, 0),
            Err(PollError::BadBody)
        );
        let other = r#"{"cellId":"c8","incarnation":1,"seq":0,"admitModeRaw":"db","admitModeEffective":"db"}"#;
        assert_eq!(parse_answer("c7", other, 0), Err(PollError::WrongCell));
    }

    #[test]
    fn the_url_carries_the_cursor_and_reserver() {
        assert_eq!(
            feed_url("http://10.0.0.7:8081/", None),
            "http://10.0.0.7:8081/internal/seats?reserver=1"
        );
        assert_eq!(
            feed_url("http://10.0.0.7:8081", Some("17:4")),
            "http://10.0.0.7:8081/internal/seats?since=17:4&reserver=1"
        );
    }

    fn answer(cell_id: &str, now_ms: u64) -> (String, FeedView) {
        let (cursor, view, _) = parse_answer(
            cell_id,
            &format!(
                r#"{{"cellId":"{cell_id}","incarnation":5,"seq":2,"admitModeRaw":"db","admitModeEffective":"db"}}"#
            ),
            now_ms,
        )
        .unwrap();
        (cursor, view)
    }

    /// Pacing of the tests: 1 s period, heartbeats fresh for 45 s, a 60 s shortest window.
    fn pacing() -> Pacing {
        Pacing::new(1_000, 45_000, 60_000)
    }

    /// Schedules `cell_id` at `now_ms`: its lane and whether it is due.
    fn schedule(board: &FeedBoard, cell_id: &str, now_ms: u64) -> (Lane, bool) {
        board.schedule(cell_id, now_ms, &pacing())
    }

    fn cursor_of(board: &FeedBoard, cell_id: &str) -> Option<String> {
        board.lock()[cell_id].cursor.clone()
    }

    #[test]
    fn one_poll_in_flight_per_cell_and_a_failure_asks_for_a_full_snapshot() {
        let board = FeedBoard::new();
        assert_eq!(
            schedule(&board, "c7", 0),
            (Lane::Suspect, true),
            "not heard from yet"
        );
        assert_eq!(cursor_of(&board, "c7"), None);
        assert!(!schedule(&board, "c7", 0).1, "already in flight");
        let (cursor, view) = answer("c7", 10);
        board.succeed("c7", cursor, view.clone(), None, 0);
        assert_eq!(board.snapshot().get("c7"), Some(&view));
        assert_eq!(
            schedule(&board, "c7", 0),
            (Lane::Live, true),
            "answered: the live lane"
        );
        assert_eq!(cursor_of(&board, "c7"), Some("5:2".to_string()));
        assert_eq!(board.fail("c7", PollError::HttpStatus, 0), 1);
        assert_eq!(
            schedule(&board, "c7", 0),
            (Lane::Live, true),
            "an error status is still an answer"
        );
        assert_eq!(
            cursor_of(&board, "c7"),
            None,
            "cursor dropped after a failure"
        );
        assert_eq!(
            board.snapshot().get("c7"),
            Some(&view),
            "the last good view stays; placement judges its age"
        );
        assert_eq!(board.fail("c7", PollError::TimedOut, 0), 2);
        assert_eq!(
            schedule(&board, "c7", 0).0,
            Lane::Suspect,
            "a timeout moves it off the live lane at once"
        );
    }

    #[test]
    fn only_an_answer_puts_a_cell_on_the_live_lane_and_only_a_timeout_takes_it_off() {
        assert_eq!(lane_for(true), Lane::Live);
        assert_eq!(lane_for(false), Lane::Suspect);
        let board = FeedBoard::new();
        schedule(&board, "c1", 0);
        board.fail("c1", PollError::Transport, 0);
        assert_eq!(
            schedule(&board, "c1", 1_000).0,
            Lane::Suspect,
            "refused, never answered: suspect"
        );
        let (cursor, view) = answer("c1", 0);
        board.succeed("c1", cursor, view, None, 1_000);
        board.fail("c1", PollError::Transport, 1_000);
        assert_eq!(
            schedule(&board, "c1", 1_000).0,
            Lane::Live,
            "a refused connection costs a worker nothing: it stays"
        );
    }

    #[test]
    fn silent_cells_back_off_doubling_to_a_quarter_of_the_shortest_window() {
        assert_eq!(suspect_backoff_ms(0, 1_000, 30_000), 0);
        assert_eq!(suspect_backoff_ms(1, 1_000, 30_000), 1_000);
        assert_eq!(suspect_backoff_ms(2, 1_000, 30_000), 2_000);
        assert_eq!(suspect_backoff_ms(5, 1_000, 30_000), 16_000);
        assert_eq!(suspect_backoff_ms(6, 1_000, 30_000), 30_000);
        assert_eq!(suspect_backoff_ms(u32::MAX, 1_000, 30_000), 30_000);
        // The cap: 30 s, and a quarter of the shortest window (the production 60 s: 15 s).
        assert_eq!(pacing().backoff_max_ms, 15_000);
        assert_eq!(Pacing::new(1_000, 45_000, 600_000).backoff_max_ms, 30_000);
        assert_eq!(Pacing::new(1_000, 45_000, 8_000).backoff_max_ms, 2_000);

        let board = FeedBoard::new();
        schedule(&board, "dead", 0);
        for _ in 0..9 {
            board.fail("dead", PollError::TimedOut, 0);
        }
        assert!(!schedule(&board, "dead", 14_999).1, "backing off");
        assert!(schedule(&board, "dead", 15_000).1, "never past 60 s / 4");

        // A cell that reports a shorter window of its own is paced by it.
        let board = FeedBoard::new();
        schedule(&board, "short", 0);
        board.record_report(
            "short",
            1,
            StatusReport {
                window_ms: 4_000,
                ..StatusReport::default()
            },
            0,
        );
        for _ in 0..9 {
            board.fail("short", PollError::TimedOut, 0);
        }
        assert!(!schedule(&board, "short", 999).1);
        assert!(schedule(&board, "short", 1_000).1, "a quarter of its 4 s");
    }

    #[test]
    fn any_sign_of_life_ends_the_backoff() {
        let board = FeedBoard::new();
        let silent_cell = |board: &FeedBoard, cell: &str| {
            schedule(board, cell, 0);
            for _ in 0..5 {
                board.fail(cell, PollError::TimedOut, 10_000);
            }
            assert!(!schedule(board, cell, 10_001).1, "{cell}: backing off");
        };
        // A heartbeat this director served.
        silent_cell(&board, "beat");
        board.heard_from("beat", Sign::Heartbeat, 10_500);
        assert!(schedule(&board, "beat", 10_600).1, "a heartbeat ends it");
        // A registration.
        silent_cell(&board, "registered");
        board.heard_from("registered", Sign::Registration, 10_500);
        assert!(schedule(&board, "registered", 10_600).1);
        // A heartbeat another director recorded, seen in the database's ages.
        silent_cell(&board, "elsewhere");
        let mut row = cell_row("elsewhere", 60_000);
        row.runtime = Some(crate::store::CellRuntime {
            cell_incarnation: 1,
            started_at: 0,
            ready: true,
            connections: 0,
            last_heartbeat_at: 0,
            heartbeat_age_ms: 300,
        });
        board.observe(&row, 11_000);
        assert!(schedule(&board, "elsewhere", 11_000).1);
        // A registration older than the failures is not news.
        silent_cell(&board, "old");
        board.observe(&cell_row("old", 5_000), 11_000);
        assert!(!schedule(&board, "old", 11_000).1);
    }

    #[test]
    fn a_cell_that_heartbeats_is_due_every_round_whatever_its_polls_did() {
        let board = FeedBoard::new();
        schedule(&board, "partitioned", 0);
        let (cursor, view) = answer("partitioned", 0);
        board.succeed("partitioned", cursor, view, None, 0);
        let mut now: u64 = 1_000;
        for _ in 0..40 {
            board.heard_from("partitioned", Sign::Heartbeat, now.saturating_sub(500));
            assert!(schedule(&board, "partitioned", now).1, "due at {now}");
            now += 2_000;
            board.fail("partitioned", PollError::TimedOut, now);
            now += 1_000;
        }
        // Its heartbeats stop: past HEARTBEAT_FRESH_MS it backs off like any silent cell.
        now += 45_000;
        assert!(schedule(&board, "partitioned", now).1);
        board.fail("partitioned", PollError::TimedOut, now);
        assert!(!schedule(&board, "partitioned", now + 1).1);
    }

    fn cell_row(cell_id: &str, registered_age_ms: i64) -> CellRow {
        CellRow {
            cell_id: cell_id.into(),
            cell_url: String::new(),
            internal_url: Some(format!("http://{cell_id}")),
            region: String::new(),
            incarnation: 1,
            registered_at: 0,
            registered_age_ms,
            runtime: None,
            admit_mode: "reserve".into(),
            admit_mode_updated_at: None,
            effective: None,
        }
    }

    fn taken(queue: &JobQueue, board: &FeedBoard, clock: &SharedClock) -> PollJob {
        queue
            .take(board, &pacing(), clock, Duration::from_millis(1))
            .expect("a poll")
    }

    /// Issue 20: a live cell registered a moment before 150 silent ones waited behind all of
    /// them, because a queued poll kept the rank it had when it was queued. The rank is taken
    /// when a worker takes a poll: the live cell's heartbeat, which came after all of them were
    /// queued, puts it first.
    #[test]
    fn the_order_of_waiting_polls_is_decided_when_a_worker_takes_one() {
        let manual = crate::clock::ManualClock::starting_at(100_000);
        let clock: SharedClock = manual.clone();
        let board = FeedBoard::new();
        let queue = JobQueue::new(Lane::Suspect, SILENT_WORKERS);
        board.observe(&cell_row("live", 900), 100_000);
        assert!(schedule(&board, "live", 100_000).1);
        queue.push("live", "http://live");
        for n in 0..150 {
            let cell = format!("silent-{n:03}");
            board.observe(&cell_row(&cell, 0), 100_000);
            assert!(schedule(&board, &cell, 100_000).1);
            queue.push(&cell, "http://silent");
        }
        board.heard_from("live", Sign::Heartbeat, 100_050);
        manual.advance(100);
        assert_eq!(taken(&queue, &board, &clock).cell_id, "live");

        // A cell that answered before goes ahead of one that never did, then fewer failures.
        let board = FeedBoard::new();
        let queue = JobQueue::new(Lane::Suspect, SUSPECT_WORKERS);
        for (cell, answered, failures) in
            [("never", false, 0), ("blip", true, 2), ("flaky", true, 1)]
        {
            schedule(&board, cell, 0);
            if answered {
                let (cursor, view) = answer(cell, 0);
                board.succeed(cell, cursor, view, None, 0);
            }
            for _ in 0..failures {
                schedule(&board, cell, 0);
                board.fail(cell, PollError::TimedOut, 0);
            }
            board.heard_from(cell, Sign::Registration, 1);
            assert!(schedule(&board, cell, 2).1 || board.lock()[cell].in_flight);
            queue.push(cell, "http://x");
        }
        let order: Vec<String> = (0..3)
            .map(|_| taken(&queue, &board, &clock).cell_id)
            .collect();
        assert_eq!(order, vec!["flaky", "blip", "never"]);
        queue.close();
        assert!(queue
            .take(&board, &pacing(), &clock, Duration::from_millis(1))
            .is_none());
    }

    #[test]
    fn one_suspect_worker_is_always_left_for_a_cell_that_heartbeats() {
        let clock: SharedClock = crate::clock::ManualClock::starting_at(0);
        let board = FeedBoard::new();
        let queue = JobQueue::new(Lane::Suspect, 1);
        for cell in ["dead-1", "dead-2"] {
            schedule(&board, cell, 0);
            board.fail(cell, PollError::TimedOut, 0);
            board.heard_from(cell, Sign::Registration, 1);
            assert!(schedule(&board, cell, 5).1);
            queue.push(cell, "http://dead");
        }
        let first = taken(&queue, &board, &clock);
        assert!(first.silent);
        // The one silent worker is busy: a heartbeating cell queued later is taken, the other
        // dead entry waits.
        schedule(&board, "beating", 5);
        board.heard_from("beating", Sign::Heartbeat, 5);
        queue.push("beating", "http://beating");
        let second = taken(&queue, &board, &clock);
        assert_eq!((second.cell_id.as_str(), second.silent), ("beating", false));
        assert_eq!(queue.lock().waiting.len(), 1);
        queue.finished(&first);
        assert_eq!(taken(&queue, &board, &clock).cell_id, "dead-2");
    }

    #[test]
    fn a_poll_of_a_cell_that_left_the_board_is_dropped() {
        let clock: SharedClock = crate::clock::ManualClock::starting_at(0);
        let board = FeedBoard::new();
        let queue = JobQueue::new(Lane::Suspect, SUSPECT_WORKERS);
        for cell in ["gone", "here"] {
            schedule(&board, cell, 0);
            queue.push(cell, "http://x");
        }
        board.retain(&HashSet::from(["here"]));
        assert_eq!(taken(&queue, &board, &clock).cell_id, "here");
        // "gone" registers again: its old queued poll is not a second one in flight.
        board.heard_from("gone", Sign::Registration, 1);
        queue.close();
        assert!(queue
            .take(&board, &pacing(), &clock, Duration::from_millis(1))
            .is_none());
        assert!(!board.lock()["gone"].in_flight);
    }

    #[test]
    fn the_latest_report_wins_whether_it_came_by_feed_or_heartbeat() {
        use crate::cell::status_report::DeadManReport;
        let report = |dead_man| StatusReport {
            dead_man,
            ..StatusReport::default()
        };
        let body = |state: &str| {
            format!(
                r#"{{"cellId":"c7","incarnation":5,"seq":1,"admitModeRaw":"reserve",
                "admitModeEffective":"reserve","status":{{"deadMan":"{state}","windowMs":9}}}}"#
            )
        };
        let (cursor, view, parsed) = parse_answer("c7", &body("armed"), 1_000).unwrap();
        assert_eq!(parsed.as_ref().map(|r| r.window_ms), Some(9));
        let board = FeedBoard::new();
        board.succeed("c7", cursor, view, parsed, 0);
        let status = |board: &FeedBoard| board.status()["c7"].report.clone().unwrap();
        assert_eq!(status(&board).source, ReportSource::Feed);
        assert_eq!(status(&board).incarnation, 5);
        board.record_report("c7", 5, report(DeadManReport::Held), 2_000);
        assert_eq!(status(&board).report.dead_man, DeadManReport::Held);
        assert_eq!(
            (status(&board).source, status(&board).received_ms),
            (ReportSource::Heartbeat, 2_000)
        );
        board.record_report("c7", 5, report(DeadManReport::Armed), 1_500);
        assert_eq!(
            status(&board).report.dead_man,
            DeadManReport::Held,
            "an answer that crossed a later one does not replace it"
        );
        // A report this director cannot read costs the report, never the poll.
        let odd = r#"{"cellId":"c7","incarnation":5,"seq":2,"admitModeRaw":"db",
            "admitModeEffective":"db","status":{"windowMs":"soon"}}"#;
        let (_, _, parsed) = parse_answer("c7", odd, 3_000).expect("the poll still succeeds");
        assert_eq!(parsed, None);
    }

    #[test]
    fn a_cell_seen_registering_is_polled_until_a_later_listing_covers_it() {
        let board = FeedBoard::new();
        let seen = |cell_id: &str, url: &str, incarnation| SeenCell {
            cell_id: cell_id.into(),
            cell_url: String::new(),
            internal_url: url.into(),
            region: String::new(),
            incarnation,
        };
        let ids = |cells: &[CellRow]| {
            let mut ids: Vec<(String, Option<String>)> = cells
                .iter()
                .map(|c| (c.cell_id.clone(), c.internal_url.clone()))
                .collect();
            ids.sort();
            ids
        };
        let listed = vec![cell_row("old", 0), cell_row("moved", 0)];
        board.saw_registered(seen("new", "http://new", 1), 1_000);
        board.saw_registered(seen("moved", "http://moved-2", 2), 1_000);
        board.saw_registered(seen("no-url", "", 1), 1_000);
        let merged = board.with_seen(&listed, Some(900));
        assert_eq!(
            ids(&merged),
            vec![
                ("moved".into(), Some("http://moved-2".into())),
                ("new".into(), Some("http://new".into())),
                ("old".into(), Some("http://old".into())),
            ],
            "a listing older than the registrations: merged in"
        );
        // A listing that began after them is the truth: "new" was forgotten since.
        assert_eq!(
            ids(&board.with_seen(&listed, Some(1_001))),
            vec![
                ("moved".into(), Some("http://moved".into())),
                ("old".into(), Some("http://old".into())),
            ]
        );
        // A deregistration through this director ends it at once.
        board.saw_registered(seen("gone", "http://gone", 3), 2_000);
        board.deregistered("gone", 3);
        assert_eq!(ids(&board.with_seen(&[], Some(1_500))), vec![]);
    }

    #[test]
    fn cells_no_longer_registered_leave_the_board() {
        let board = FeedBoard::new();
        schedule(&board, "a", 0);
        schedule(&board, "b", 0);
        board.retain(&HashSet::from(["b"]));
        assert_eq!(board.status().keys().collect::<Vec<_>>(), vec!["b"]);
    }
}
