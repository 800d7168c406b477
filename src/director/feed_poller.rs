//! The `feed-poller` thread (SPEC §6.2): every `FEED_POLL_MS`, polls every registered cell's
//! seat feed `GET <internal_url>/internal/seats?since=<cursor>&reserver=1` with the service
//! token and a 2 s timeout. That poll is dead-man contact (SPEC §5.5): it is what keeps reserve
//! cells armed, so it goes on from the last known cell list while the database is down.
//!
//! Owns: the [`FeedBoard`] (per cell: the cursor, the modes, `draining`, the counts, the last
//! success), which [`super::placement`] reads through [`FeedBoard::snapshot`].
//!
//! Threads: `feed-poller` lists the cells and hands each one that has no poll in flight to a
//! fixed set of `feed-poll-<n>` workers ([`POLL_WORKERS`]) through one queue. A slow cell holds
//! one worker for at most its own 2 s timeout; the others keep polling. Never one thread per
//! cell per poll, and never more than one poll in flight per cell.
//!
//! Must never: hold the board's lock across a request, log the service token, or stop polling
//! because the database is down.

use std::collections::HashMap;
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Duration;

use serde::Deserialize;

use super::placement::FeedView;
use crate::clock::SharedClock;
use crate::logging::KeyedThrottle;
use crate::metrics::Registry;
use crate::store::{CellRow, Store};
use crate::threads;

/// Each feed request's timeout (SPEC §6.2).
pub const POLL_TIMEOUT: Duration = Duration::from_secs(2);
/// Worker threads that carry the polls; a fleet of N cells with some silent ones is covered as
/// long as fewer than this many cells are silent at once (each holds a worker for 2 s).
pub const POLL_WORKERS: usize = 4;

/// One cell's entry on the board.
#[derive(Debug, Clone, Default)]
struct CellFeed {
    /// `<incarnation>:<seq>` of the last answer; `None` asks for a full snapshot.
    cursor: Option<String>,
    view: Option<FeedView>,
    in_flight: bool,
    consecutive_failures: u32,
}

/// What the poller knows of every cell; a cheap clone of one `Arc<Mutex<…>>`, locked only to
/// copy or update a few fields.
#[derive(Clone, Default)]
pub struct FeedBoard {
    cells: Arc<Mutex<HashMap<String, CellFeed>>>,
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

    /// Marks a poll of `cell_id` in flight and returns its cursor; `None` if one already is.
    fn begin(&self, cell_id: &str) -> Option<Option<String>> {
        let mut cells = self.lock();
        let feed = cells.entry(cell_id.to_string()).or_default();
        if feed.in_flight {
            return None;
        }
        feed.in_flight = true;
        Some(feed.cursor.clone())
    }

    fn succeed(&self, cell_id: &str, cursor: String, view: FeedView) {
        let mut cells = self.lock();
        let feed = cells.entry(cell_id.to_string()).or_default();
        feed.cursor = Some(cursor);
        feed.view = Some(view);
        feed.in_flight = false;
        feed.consecutive_failures = 0;
    }

    /// Records a failed poll; returns how many in a row. The cursor is dropped so the next
    /// answer is a full snapshot (a restarted cell may not know the old one).
    fn fail(&self, cell_id: &str) -> u32 {
        let mut cells = self.lock();
        let feed = cells.entry(cell_id.to_string()).or_default();
        feed.cursor = None;
        feed.in_flight = false;
        feed.consecutive_failures = feed.consecutive_failures.saturating_add(1);
        feed.consecutive_failures
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

/// Parses one answer of `cell_id`'s feed into its next cursor and view.
fn parse_answer(cell_id: &str, body: &str, now_ms: u64) -> Result<(String, FeedView), PollError> {
    let answer: FeedAnswer = serde_json::from_str(body).map_err(|_| PollError::BadBody)?;
    if answer.cell_id != cell_id {
        // The registered internal URL reaches another cell: believing it would book seats
        // on the wrong cell.
        return Err(PollError::WrongCell);
    }
    let cursor = format!("{}:{}", answer.incarnation, answer.seq);
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

struct PollJob {
    cell_id: String,
    internal_url: String,
    cursor: Option<String>,
}

/// Everything a poll needs, shared by the workers.
struct Poller {
    board: FeedBoard,
    agent: ureq::Agent,
    service_token: String,
    clock: SharedClock,
    registry: Registry,
    /// Throttles the failure lines of each cell (`logging::KeyedThrottle`).
    failures: KeyedThrottle,
}

impl Poller {
    fn poll(&self, job: &PollJob) {
        let url = feed_url(&job.internal_url, job.cursor.as_deref());
        let result = match self
            .agent
            .get(&url)
            .set("Authorization", &format!("Bearer {}", self.service_token))
            .call()
        {
            Ok(response) => match response.into_string() {
                Ok(body) => parse_answer(&job.cell_id, &body, self.clock.now_ms()),
                Err(_) => Err(PollError::BadBody),
            },
            Err(ureq::Error::Status(_, _)) => Err(PollError::HttpStatus),
            Err(ureq::Error::Transport(transport)) => Err(if is_timeout(&transport) {
                PollError::TimedOut
            } else {
                PollError::Transport
            }),
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
            Ok((cursor, view)) => {
                self.board.succeed(&job.cell_id, cursor, view);
                if let Some(note) = self.failures.success(&job.cell_id) {
                    log::info!(
                        "orca_relay_director_feed_poll_recovered cell_id={}{note}",
                        job.cell_id
                    );
                }
            }
            Err(error) => {
                let failures = self.board.fail(&job.cell_id);
                // The first failure of a run, then at most once a minute with a count, then
                // once on recovery: a dead cell polled every second is not a line a second.
                if let Some(note) = self.failures.failure(&job.cell_id, self.clock.now_ms()) {
                    log::warn!(
                        "orca_relay_director_feed_poll_failed cell_id={} result={} consecutive={failures}{note}",
                        job.cell_id,
                        error.as_str()
                    );
                }
            }
        }
    }
}

fn is_timeout(transport: &ureq::Transport) -> bool {
    use std::error::Error;
    let mut source = transport.source();
    while let Some(error) = source {
        if let Some(io) = error.downcast_ref::<std::io::Error>() {
            if matches!(
                io.kind(),
                std::io::ErrorKind::TimedOut | std::io::ErrorKind::WouldBlock
            ) {
                return true;
            }
        }
        source = error.source();
    }
    transport.to_string().contains("timed out")
}

/// How to build the poller.
pub struct FeedPollerConfig {
    pub board: FeedBoard,
    pub store: Store,
    pub service_token: String,
    pub clock: SharedClock,
    pub registry: Registry,
    /// `ORCA_RELAY_FEED_POLL_MS`.
    pub period: Duration,
}

/// The running poller: its coordinator and workers. Stop it with [`FeedPoller::stop`].
pub struct FeedPoller {
    stop: Sender<()>,
    coordinator: JoinHandle<()>,
}

impl FeedPoller {
    /// Starts `feed-poller` and its `feed-poll-<n>` workers.
    pub fn start(config: FeedPollerConfig) -> std::io::Result<FeedPoller> {
        let poller = Arc::new(Poller {
            board: config.board,
            agent: ureq::AgentBuilder::new().timeout(POLL_TIMEOUT).build(),
            service_token: config.service_token,
            clock: config.clock,
            registry: config.registry,
            failures: KeyedThrottle::new(),
        });
        let (job_sender, job_receiver) = mpsc::channel::<PollJob>();
        let job_receiver = Arc::new(Mutex::new(job_receiver));
        let mut workers = Vec::with_capacity(POLL_WORKERS);
        for n in 0..POLL_WORKERS {
            let poller = poller.clone();
            let jobs = job_receiver.clone();
            workers.push(threads::spawn(format!("feed-poll-{n}"), move || {
                run_worker(&poller, &jobs)
            })?);
        }
        let (stop, stop_receiver) = mpsc::channel();
        let store = config.store;
        let period = config.period;
        let board = poller.board.clone();
        let coordinator = threads::spawn("feed-poller", move || {
            run_coordinator(&store, &board, job_sender, period, stop_receiver);
            // The job queue is closed: each worker ends after its current poll (≤ 2 s).
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

fn run_worker(poller: &Poller, jobs: &Mutex<Receiver<PollJob>>) {
    loop {
        // The lock is held only while waiting for the next job, never during a poll.
        let job = jobs.lock().unwrap_or_else(|e| e.into_inner()).recv();
        match job {
            Ok(job) => poller.poll(&job),
            Err(_) => return,
        }
    }
}

fn run_coordinator(
    store: &Store,
    board: &FeedBoard,
    jobs: Sender<PollJob>,
    period: Duration,
    stop: Receiver<()>,
) {
    log::info!(
        "orca_relay_director_feed_poller_started period_ms={} workers={POLL_WORKERS}",
        period.as_millis()
    );
    let mut cells: Vec<CellRow> = Vec::new();
    let mut store_failing: Option<&'static str> = None;
    loop {
        match store.list_cells() {
            Ok(listed) => {
                if store_failing.take().is_some() {
                    log::info!(
                        "orca_relay_director_feed_poller_cells_listed cells={}",
                        listed.len()
                    );
                }
                cells = listed;
            }
            Err(error) => {
                // Keep polling the cells we knew: the poll is what keeps them armed, and a
                // database outage is exactly when that matters.
                let reason = error.reason_code();
                if store_failing != Some(reason) {
                    log::warn!(
                        "orca_relay_director_feed_poller_cells_unavailable reason={reason} known_cells={}",
                        cells.len()
                    );
                }
                store_failing = Some(reason);
            }
        }
        for cell in &cells {
            let Some(internal_url) = &cell.internal_url else {
                continue;
            };
            if let Some(cursor) = board.begin(&cell.cell_id) {
                let job = PollJob {
                    cell_id: cell.cell_id.clone(),
                    internal_url: internal_url.clone(),
                    cursor,
                };
                if jobs.send(job).is_err() {
                    return;
                }
            }
        }
        match stop.recv_timeout(period) {
            Err(RecvTimeoutError::Timeout) => {}
            Ok(()) | Err(RecvTimeoutError::Disconnected) => break,
        }
    }
    log::info!("orca_relay_director_feed_poller_stopped");
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
        let (cursor, view) = parse_answer("c7", body, 99).expect("parses");
        assert_eq!(cursor, "1700:42");
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

    #[test]
    fn one_poll_in_flight_per_cell_and_a_failure_asks_for_a_full_snapshot() {
        let board = FeedBoard::new();
        assert_eq!(board.begin("c7"), Some(None));
        assert_eq!(board.begin("c7"), None, "already in flight");
        let (cursor, view) = parse_answer(
            "c7",
            r#"{"cellId":"c7","incarnation":5,"seq":2,"admitModeRaw":"db","admitModeEffective":"db"}"#,
            10,
        )
        .unwrap();
        board.succeed("c7", cursor, view.clone());
        assert_eq!(board.snapshot().get("c7"), Some(&view));
        assert_eq!(board.begin("c7"), Some(Some("5:2".to_string())));
        assert_eq!(board.fail("c7"), 1);
        assert_eq!(
            board.begin("c7"),
            Some(None),
            "cursor dropped after a failure"
        );
        assert_eq!(
            board.snapshot().get("c7"),
            Some(&view),
            "the last good view stays; placement judges its age"
        );
    }
}
