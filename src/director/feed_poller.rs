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
//!   behind. They are polled with a backoff ([`suspect_backoff_ms`], doubling up to 30 s), in
//!   the order fewest failures first, then most recently heard from (heartbeat or
//!   registration, on the database's clock) first ([`Queued`]): a new or restarted live cell,
//!   or one that just blipped, is polled by the next free suspect worker (within one timeout),
//!   ahead of any long-dead entry, and its first answer moves it to the live lane.
//!
//! Retired cells ([`super::membership`]) are not polled at all; cells no longer registered leave
//! the board. Never one thread per cell per poll, never more than one poll in flight per cell.
//!
//! The cell list comes from the database through its own thread, `feed-lister`, which refreshes
//! a [`CellList`] every period; a round reads the latest list without waiting. A database that
//! stops answering without refusing (a partition, a stuck server) holds a listing for a whole
//! connect or statement wait; listed inline, that held every round, and reserve cells went
//! unpolled with their director up (found by the nemesis, `tests/contact_db_hang_pg.rs`).
//!
//! Must never: hold the board's lock across a request, log the service token, or stop (or
//! delay) polling because the database is down or slow.

use std::cmp::Ordering as CmpOrdering;
use std::collections::{BinaryHeap, HashMap, HashSet};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Duration;

use serde::Deserialize;

use super::membership::{self, Judge};
use super::placement::FeedView;
use crate::cell::status_report::StatusReport;
use crate::clock::SharedClock;
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
/// The longest wait between two polls of a suspect cell.
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

/// How long a suspect cell waits after its last failure before it is polled again: one period
/// after the first failure, doubling with each further one, at most
/// [`SUSPECT_BACKOFF_MAX_MS`]. A cell never polled yet is due at once.
pub fn suspect_backoff_ms(consecutive_failures: u32, period_ms: u64) -> u64 {
    match consecutive_failures {
        0 => 0,
        n => period_ms
            .saturating_mul(1u64 << (n - 1).min(20))
            .min(SUSPECT_BACKOFF_MAX_MS),
    }
}

/// One cell's entry on the board.
#[derive(Debug, Clone)]
struct CellFeed {
    /// `<incarnation>:<seq>` of the last answer; `None` asks for a full snapshot.
    cursor: Option<String>,
    view: Option<FeedView>,
    in_flight: bool,
    consecutive_failures: u32,
    /// Gave an HTTP answer (any status) since its last timed-out poll.
    responsive: bool,
    /// The suspect lane polls this cell no earlier than this (monotonic ms).
    next_attempt_ms: u64,
    lane: Lane,
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
            next_attempt_ms: 0,
            lane: Lane::Suspect,
            report: None,
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
}

/// One poll to make.
struct PollJob {
    cell_id: String,
    internal_url: String,
    cursor: Option<String>,
    lane: Lane,
    /// Failures in a row before this poll, and how long the database has not heard from the
    /// cell (the suspect lane's order).
    failures: u32,
    silent_ms: u64,
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

    /// The lane of `cell_id` now, and the poll to make this round, marked in flight: `None`
    /// when a poll is already in flight, or a suspect cell's backoff is not over.
    fn schedule(
        &self,
        cell_id: &str,
        internal_url: &str,
        silent_ms: u64,
        now_ms: u64,
    ) -> (Lane, Option<PollJob>) {
        let mut cells = self.lock();
        let feed = cells.entry(cell_id.to_string()).or_default();
        let lane = lane_for(feed.responsive);
        if feed.in_flight || (lane == Lane::Suspect && now_ms < feed.next_attempt_ms) {
            return (lane, None);
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
        let job = PollJob {
            cell_id: cell_id.to_string(),
            internal_url: internal_url.to_string(),
            cursor: feed.cursor.clone(),
            lane,
            failures: feed.consecutive_failures,
            silent_ms,
        };
        (lane, Some(job))
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

    fn succeed(&self, cell_id: &str, cursor: String, view: FeedView, report: Option<StatusReport>) {
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
        feed.next_attempt_ms = 0;
    }

    /// Records a failed poll at `now_ms` (monotonic); returns how many in a row. The cursor is
    /// dropped so the next answer is a full snapshot (a restarted cell may not know the old
    /// one), and the suspect lane waits its backoff before the next try. A timeout makes the
    /// cell unresponsive (suspect lane); an HTTP answer, even an error, makes it responsive; a
    /// refused or reset connection (fast) leaves that as it was.
    fn fail(&self, cell_id: &str, error: PollError, now_ms: u64, period_ms: u64) -> u32 {
        let mut cells = self.lock();
        let feed = cells.entry(cell_id.to_string()).or_default();
        feed.cursor = None;
        feed.in_flight = false;
        match error {
            PollError::TimedOut => feed.responsive = false,
            PollError::HttpStatus | PollError::BadBody | PollError::WrongCell => {
                feed.responsive = true
            }
            PollError::Transport => {}
        }
        feed.consecutive_failures = feed.consecutive_failures.saturating_add(1);
        feed.next_attempt_ms =
            now_ms.saturating_add(suspect_backoff_ms(feed.consecutive_failures, period_ms));
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

/// A queue of polls for one lane's workers: the fewest failures first, then first come.
struct JobQueue {
    state: Mutex<QueueState>,
    ready: Condvar,
}

#[derive(Default)]
struct QueueState {
    jobs: BinaryHeap<Queued>,
    next_seq: u64,
    closed: bool,
}

/// A queued poll. The queue serves the fewest failures first, then the cell heard from most
/// recently (alive by another sign: a heartbeat, a registration), then first come.
struct Queued {
    key: (u32, u64, u64),
    job: PollJob,
}

impl PartialEq for Queued {
    fn eq(&self, other: &Self) -> bool {
        self.key == other.key
    }
}
impl Eq for Queued {}
impl PartialOrd for Queued {
    fn partial_cmp(&self, other: &Self) -> Option<CmpOrdering> {
        Some(self.cmp(other))
    }
}
impl Ord for Queued {
    fn cmp(&self, other: &Self) -> CmpOrdering {
        // BinaryHeap pops the greatest: the smallest key is the greatest.
        other.key.cmp(&self.key)
    }
}

impl JobQueue {
    fn new() -> Arc<JobQueue> {
        Arc::new(JobQueue {
            state: Mutex::new(QueueState::default()),
            ready: Condvar::new(),
        })
    }

    fn lock(&self) -> MutexGuard<'_, QueueState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn push(&self, job: PollJob) {
        let mut state = self.lock();
        let seq = state.next_seq;
        state.next_seq += 1;
        let key = (job.failures, job.silent_ms, seq);
        state.jobs.push(Queued { key, job });
        drop(state);
        self.ready.notify_one();
    }

    /// The next job; `None` once the queue is closed (jobs still queued are dropped).
    fn pop(&self) -> Option<PollJob> {
        let mut state = self.lock();
        loop {
            if state.closed {
                return None;
            }
            if let Some(queued) = state.jobs.pop() {
                return Some(queued.job);
            }
            state = self.ready.wait(state).unwrap_or_else(|e| e.into_inner());
        }
    }

    fn close(&self) {
        self.lock().closed = true;
        self.ready.notify_all();
    }
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
    period_ms: u64,
    /// Throttles the failure lines of each cell (`logging::KeyedThrottle`).
    failures: KeyedThrottle,
}

impl Poller {
    fn poll(&self, job: &PollJob) {
        let url = feed_url(&job.internal_url, job.cursor.as_deref());
        let answer = self
            .service_token
            .call_http(&job.internal_url, |token| {
                self.agent
                    .get(&url)
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
                self.board.succeed(&job.cell_id, cursor, view, report);
                if let Some(note) = self.failures.success(&job.cell_id) {
                    log::info!(
                        "orca_relay_director_feed_poll_recovered cell_id={}{note}",
                        job.cell_id
                    );
                }
            }
            Err(error) => {
                let failures = self.board.fail(
                    &job.cell_id,
                    error,
                    self.clock.monotonic_ms(),
                    self.period_ms,
                );
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
struct CellList(Arc<Mutex<Arc<Vec<CellRow>>>>);

impl CellList {
    fn latest(&self) -> Arc<Vec<CellRow>> {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    fn replace(&self, cells: Vec<CellRow>) {
        *self.0.lock().unwrap_or_else(|e| e.into_inner()) = Arc::new(cells);
    }
}

/// The `feed-lister` thread: lists the registered cells every `period` into `list`, logging a
/// failure once per cause and the recovery once. A failed or slow listing leaves the last list
/// in place: the poll is what keeps reserve cells armed, and a database outage is exactly when
/// that matters.
fn run_lister(store: &Store, list: &CellList, period: Duration, stop: Receiver<()>) {
    let mut store_failing: Option<&'static str> = None;
    let mut next = crate::clock::instant();
    loop {
        match store.list_cells() {
            Ok(listed) => {
                if store_failing.take().is_some() {
                    log::info!(
                        "orca_relay_director_feed_poller_cells_listed cells={}",
                        listed.len()
                    );
                }
                list.replace(listed);
            }
            Err(error) => {
                let reason = error.reason_code();
                if store_failing != Some(reason) {
                    log::warn!(
                        "orca_relay_director_feed_poller_cells_unavailable reason={reason} known_cells={}",
                        list.latest().len()
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
        match stop.recv_timeout(next - now) {
            Err(RecvTimeoutError::Timeout) => {}
            Ok(()) | Err(RecvTimeoutError::Disconnected) => return,
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
    /// `ORCA_RELAY_FEED_POLL_MS`.
    pub period: Duration,
    /// Which cells are retired (not polled).
    pub membership: Judge,
}

/// The running poller: its coordinator and workers. Stop it with [`FeedPoller::stop`].
pub struct FeedPoller {
    stop: Sender<()>,
    coordinator: JoinHandle<()>,
}

/// What the coordinator needs besides the store.
struct Rounds {
    board: FeedBoard,
    clock: SharedClock,
    period: Duration,
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
            period_ms: config.period.as_millis() as u64,
            failures: KeyedThrottle::new(),
        });
        let live = JobQueue::new();
        let suspect = JobQueue::new();
        let mut workers = Vec::with_capacity(LIVE_WORKERS + SUSPECT_WORKERS);
        for (lane, queue, count) in [
            ("live", &live, LIVE_WORKERS),
            ("suspect", &suspect, SUSPECT_WORKERS),
        ] {
            for n in 0..count {
                let poller = poller.clone();
                let queue = queue.clone();
                workers.push(threads::spawn(format!("feed-{lane}-{n}"), move || {
                    while let Some(job) = queue.pop() {
                        poller.poll(&job);
                    }
                })?);
            }
        }
        let (stop, stop_receiver) = mpsc::channel();
        let list = CellList::default();
        let (lister_stop, lister_stop_receiver) = mpsc::channel::<()>();
        let lister = {
            let (store, list, period) = (config.store, list.clone(), config.period);
            threads::spawn("feed-lister", move || {
                run_lister(&store, &list, period, lister_stop_receiver)
            })?
        };
        let rounds = Rounds {
            board: poller.board.clone(),
            clock: config.clock,
            period: config.period,
            membership: config.membership,
            live: live.clone(),
            suspect: suspect.clone(),
            registry: config.registry,
        };
        let coordinator = threads::spawn("feed-poller", move || {
            rounds.run(&list, stop_receiver);
            // The lister ends after its current listing (bounded by the store's timeouts).
            drop(lister_stop);
            threads::join_logged("feed-lister", lister);
            // The queues are closed: each worker ends after its current poll (≤ 2 s).
            live.close();
            suspect.close();
            for worker in workers {
                threads::join_logged("feed-poll", worker);
            }
        })?;
        Ok(FeedPoller { stop, coordinator })
    }

    /// Stops polling and joins every poller thread (at most one poll timeout).
    pub fn stop(self) {
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
    fn run(&self, list: &CellList, stop: Receiver<()>) {
        log::info!(
            "orca_relay_director_feed_poller_started period_ms={} live_workers={LIVE_WORKERS} suspect_workers={SUSPECT_WORKERS}",
            self.period.as_millis()
        );
        let mut next_round = crate::clock::instant();
        loop {
            self.round(&list.latest());
            let now = crate::clock::instant();
            next_round += self.period;
            if next_round < now {
                next_round = now;
            }
            match stop.recv_timeout(next_round - now) {
                Err(RecvTimeoutError::Timeout) => {}
                Ok(()) | Err(RecvTimeoutError::Disconnected) => break,
            }
        }
        log::info!("orca_relay_director_feed_poller_stopped");
    }

    /// Hands every due cell to its lane.
    fn round(&self, cells: &[CellRow]) {
        let now = self.clock.monotonic_ms();
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
            let silent_ms = cell.silent_ms().max(0) as u64;
            let (lane, job) = self
                .board
                .schedule(&cell.cell_id, internal_url, silent_ms, now);
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
            if let Some(job) = job {
                queue.push(job);
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

    #[test]
    fn one_poll_in_flight_per_cell_and_a_failure_asks_for_a_full_snapshot() {
        let board = FeedBoard::new();
        let (lane, job) = board.schedule("c7", "http://c7", 50, 0);
        assert_eq!(lane, Lane::Suspect, "not heard from yet");
        let job = job.expect("due");
        assert_eq!((job.cursor, job.failures, job.silent_ms), (None, 0, 50));
        assert!(
            board.schedule("c7", "http://c7", 0, 0).1.is_none(),
            "already in flight"
        );
        let (cursor, view) = answer("c7", 10);
        board.succeed("c7", cursor, view.clone(), None);
        assert_eq!(board.snapshot().get("c7"), Some(&view));
        let (lane, job) = board.schedule("c7", "http://c7", 0, 0);
        assert_eq!(lane, Lane::Live, "answered: the live lane");
        assert_eq!(job.unwrap().cursor, Some("5:2".to_string()));
        assert_eq!(board.fail("c7", PollError::HttpStatus, 0, 1_000), 1);
        let (lane, job) = board.schedule("c7", "http://c7", 0, 0);
        assert_eq!(lane, Lane::Live, "an error status is still an answer");
        assert_eq!(job.unwrap().cursor, None, "cursor dropped after a failure");
        assert_eq!(
            board.snapshot().get("c7"),
            Some(&view),
            "the last good view stays; placement judges its age"
        );
        assert_eq!(board.fail("c7", PollError::TimedOut, 0, 1_000), 2);
        assert_eq!(
            board.schedule("c7", "http://c7", 0, 0).0,
            Lane::Suspect,
            "a timeout moves it off the live lane at once"
        );
    }

    #[test]
    fn only_an_answer_puts_a_cell_on_the_live_lane_and_only_a_timeout_takes_it_off() {
        assert_eq!(lane_for(true), Lane::Live);
        assert_eq!(lane_for(false), Lane::Suspect);
        let board = FeedBoard::new();
        board.schedule("c1", "http://c1", 0, 0);
        board.fail("c1", PollError::Transport, 0, 1_000);
        assert_eq!(
            board.schedule("c1", "http://c1", 0, 1_000).0,
            Lane::Suspect,
            "refused, never answered: suspect"
        );
        let (cursor, view) = answer("c1", 0);
        board.succeed("c1", cursor, view, None);
        board.fail("c1", PollError::Transport, 0, 1_000);
        assert_eq!(
            board.schedule("c1", "http://c1", 0, 0).0,
            Lane::Live,
            "a refused connection costs a worker nothing: it stays"
        );
    }

    #[test]
    fn suspect_cells_back_off_doubling_to_thirty_seconds() {
        assert_eq!(suspect_backoff_ms(0, 1_000), 0);
        assert_eq!(suspect_backoff_ms(1, 1_000), 1_000);
        assert_eq!(suspect_backoff_ms(2, 1_000), 2_000);
        assert_eq!(suspect_backoff_ms(5, 1_000), 16_000);
        assert_eq!(suspect_backoff_ms(6, 1_000), 30_000);
        assert_eq!(suspect_backoff_ms(u32::MAX, 1_000), 30_000);

        let board = FeedBoard::new();
        let (lane, job) = board.schedule("dead", "http://dead", 900_000, 0);
        assert_eq!((lane, job.is_some()), (Lane::Suspect, true));
        board.fail("dead", PollError::TimedOut, 0, 1_000);
        board.fail("dead", PollError::TimedOut, 0, 1_000);
        assert!(board
            .schedule("dead", "http://dead", 900_000, 1_999)
            .1
            .is_none());
        assert!(board
            .schedule("dead", "http://dead", 900_000, 2_000)
            .1
            .is_some());
    }

    #[test]
    fn the_suspect_queue_serves_the_fewest_failures_first() {
        let queue = JobQueue::new();
        for (cell, failures, silent_ms) in [
            ("old-dead", 9, 3_600_000),
            ("blip", 1, 3_000),
            ("registered-dead", 0, 900_000),
            ("new-live", 0, 200),
            ("dead", 9, 3_600_000),
        ] {
            queue.push(PollJob {
                cell_id: cell.into(),
                internal_url: String::new(),
                cursor: None,
                lane: Lane::Suspect,
                failures,
                silent_ms,
            });
        }
        let order: Vec<String> = (0..5).map(|_| queue.pop().unwrap().cell_id).collect();
        assert_eq!(
            order,
            vec!["new-live", "registered-dead", "blip", "old-dead", "dead"]
        );
        queue.close();
        assert!(queue.pop().is_none());
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
        board.succeed("c7", cursor, view, parsed);
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
    fn cells_no_longer_registered_leave_the_board() {
        let board = FeedBoard::new();
        board.schedule("a", "http://a", 0, 0);
        board.schedule("b", "http://b", 0, 0);
        board.retain(&HashSet::from(["b"]));
        assert_eq!(board.status().keys().collect::<Vec<_>>(), vec!["b"]);
    }
}
