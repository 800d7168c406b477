//! The live handover's two sides (ARCHITECTURE.md "Live handover"; SPEC §12).
//!
//! The **giver** is a thread of every running cell or combined process (`handover`): it
//! listens on `$ORCA_RELAY_DATA_DIR/handover.sock` and, for one `orca-relay handover` at a
//! time, waits for the next process to be ready, quiesces the cell, sends the listeners, every
//! connection and the state document, and either commits (the next process owns everything,
//! this one exits 0 without touching a handed connection) or rolls back (this process takes
//! everything back with the same code the next one would have used, and logs one line).
//!
//! The **taker** is the next process's side ([`Taker`]): it says it is ready once its
//! configuration is read and its store open, receives the transfer, rebuilds the cell from the
//! document, puts every connection behind a closed gate, confirms, and opens the gate only once
//! the giver has said `committed`.
//!
//! Never: does I/O on a connection it does not own (the giver after `committed`, the taker
//! before it); shuts a handed descriptor down; leaves a deposit behind (a failed handover
//! resumes every one).

use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::carry::connection::ConnectionRecord;
use crate::carry::crash::CrashKind;
use crate::carry::document::{Document, ListenerIndices, PairsDocument};
use crate::carry::pair::{LegRecord, PairEntry};
use crate::carry::time::{Carry, Snapshot, Stamp};
use crate::carry::{
    put_back, read_parts, write_parts, Carried, MAX_CARRIED_BUFFER, MAX_DOCUMENT, READS,
    STATE_VERSION,
};
use crate::clock::{self, SharedClock};
use crate::handover::wire::{self, Channel};
use crate::handover::{
    self as protocol, body, receive, send, Accepted, Alive, Begin, Cause, Committed, Kind, Outcome,
    Prepare, Ready, Transfer, BEAT, HANDOVER_TIMEOUT, SILENCE,
};
use crate::http::HttpServer;
use crate::metrics::Registry;
use crate::relay::attach::Attach;
use crate::relay::context::{Phase, RelayContext};
use crate::relay::hold::PhonePlace;
use crate::relay::park::{Gate, Parked, ParkedConn, Stage};
use crate::relay::socket::Socket;
use crate::relay::splice::parked::{ParkedPair, ResumedLeg, ResumedPair};
use crate::relay::thread;
use crate::threads;

use super::cell_runtime::{CellRuntime, CellThreadsState};
use super::process::{Handed, RunError};
use crate::config::Config;

/// How long the taker waits for the giver's word after confirming: the giver's own limit plus
/// a margin (the giver commits or rolls back within its 10 s).
const TAKER_WAIT: Duration = Duration::from_secs(20);

/// The machine's monotonic clock (the same for both processes), ms: a next process's signs of
/// life say when they were sent on it. (0 if it cannot be read: then only the handover's
/// whole deadline bounds a silent next process.)
fn machine_ms() -> u64 {
    clock::machine_ms().unwrap_or(0)
}

/// This process's moment, to measure a document's travel against.
fn here(clock: &SharedClock) -> Stamp {
    Stamp {
        wall_ms: clock.now_ms(),
        machine_ms: clock::machine_ms(),
    }
}

// ---------------------------------------------------------------------------------------------
// The giver: the running process.
// ---------------------------------------------------------------------------------------------

/// What the giver needs of its process.
pub struct GiverParts {
    /// `cell` or `combined`.
    pub role: &'static str,
    pub cell: Arc<CellRuntime>,
    /// The HTTP server: stopped (its requests in flight finished) when a handover commits.
    pub http: Arc<Mutex<Option<HttpServer>>>,
    /// A handle on the HTTP listener, to pass on.
    pub http_listener: std::net::TcpListener,
    pub registry: Registry,
    pub clock: SharedClock,
    pub data_dir: PathBuf,
    /// The process's stop: a stop requested before the commit rolls the handover back (this
    /// process then drains); one after it is the next process's.
    pub shutdown: crate::lifecycle::Shutdown,
    /// The listeners as this process holds them: told to the command with the role and cell,
    /// which tells the next process (it refuses another cell, or a configured address they are
    /// not bound to).
    pub listening: protocol::Listening,
}

/// The running `handover` thread.
pub struct Giver {
    stop: Arc<crate::wake::Wake>,
    handle: JoinHandle<()>,
}

impl Giver {
    /// Listens for handovers; `None` (one WARN line) when the socket cannot be bound: the
    /// process serves, it just cannot be handed over.
    pub fn start(parts: GiverParts) -> Option<Giver> {
        let path = protocol::socket_path(&parts.data_dir);
        let listener = match wire::Listener::bind(&path) {
            Ok(listener) => listener,
            Err(e) => {
                log::warn!(
                    "orca_relay_handover_unavailable path={} error={e}",
                    path.display()
                );
                return None;
            }
        };
        let stop = crate::wake::Wake::new().ok()?;
        let thread_stop = stop.clone();
        // A stop (SIGTERM) wakes a handover's waits at once: it rolls back and the drain
        // follows.
        let stopping = crate::wake::Wake::new().ok()?;
        {
            let stopping = stopping.clone();
            parts.shutdown.on_drain(Box::new(move || stopping.set()));
        }
        let handle = threads::spawn("handover", move || {
            // A lasting accept failure (no descriptors left) logs once, then at the throttle's
            // interval with its count.
            let mut failures = crate::logging::FailureThrottle::new();
            let since = clock::instant();
            loop {
                let far = clock::instant() + Duration::from_secs(3600);
                match listener.accept(thread_stop.raw_fd(), far) {
                    Ok(Some(command)) => {
                        failures.success();
                        serve_request(&parts, &listener, command, &stopping)
                    }
                    Ok(None) => return,
                    Err(wire::WireError::TimedOut) => continue,
                    Err(e) => {
                        let now_ms = clock::instant().duration_since(since).as_millis() as u64;
                        if let Some(note) = failures.failure(now_ms) {
                            log::warn!("orca_relay_handover_accept_failed error={e}{note}");
                        }
                        clock::sleep(Duration::from_millis(100));
                    }
                }
            }
        })
        .ok()?;
        Some(Giver { stop, handle })
    }

    /// Stops listening (the drain: no handover starts once it has begun).
    pub fn stop(self) {
        self.stop.set();
        threads::join_logged("handover", self.handle);
    }
}

/// A connection on the handover socket that is not the command being served: refused.
fn refuse(channel: &Channel, cause: &str) {
    let _ = send(
        channel,
        Kind::Refused,
        &Cause {
            token: None,
            cause: cause.to_string(),
        },
        clock::instant() + Duration::from_secs(1),
    );
}

/// The cause of a handover rolled back for a stop requested before its commit.
const STOP_CAUSE: &str =
    "a stop (SIGTERM) was requested during the handover: the running relay drains instead";

/// One `orca-relay handover`, from its `begin` to its outcome.
fn serve_request(
    parts: &GiverParts,
    listener: &wire::Listener,
    command: Channel,
    stopping: &crate::wake::Wake,
) {
    let started = clock::instant();
    let deadline = started + HANDOVER_TIMEOUT;
    let begin: Begin = match receive(&command, started + Duration::from_secs(2)) {
        Ok((Kind::Begin, message)) => match body(&message) {
            Ok(begin) => begin,
            Err(_) => return,
        },
        Ok((Kind::Ready | Kind::Failed, _)) => {
            return refuse(&command, "no handover is in progress");
        }
        _ => return,
    };
    match parts.cell.context.phase.get() {
        Phase::SERVING => {}
        Phase::STARTING => return refuse(&command, "the running relay is still starting"),
        _ => return refuse(&command, "the running relay is draining"),
    }
    // A drain holds this lock for its whole length: no handover once it has begun.
    let Ok(_in_progress) = parts.cell.handover.try_lock() else {
        return refuse(&command, "the running relay is draining");
    };
    if parts.shutdown.is_draining() {
        return refuse(&command, "the running relay is draining");
    }
    let Some(token) = protocol::token() else {
        return refuse(&command, "no randomness for the handover's token");
    };
    let accepted = Accepted {
        token: token.clone(),
        pid: std::process::id(),
        version: protocol::version(),
        running: Some(protocol::Running {
            role: parts.role.to_string(),
            cell_id: parts.cell.context.cell_id.to_string(),
            listening: parts.listening,
            pid: Some(std::process::id()),
        }),
    };
    if send(&command, Kind::Accepted, &accepted, deadline).is_err() {
        return;
    }
    log::info!(
        "orca_relay_handover_started command_pid={} command_version={}",
        begin.pid,
        begin.version
    );
    let mut flight = InFlight {
        parts,
        command: &command,
        command_open: true,
        next: None,
        last_alive_ms: machine_ms(),
        quiesced: None,
        started,
        deadline,
        stopping,
    };
    // A panic in a step rolls back like any failure: otherwise the relay threads would stay
    // held and the acceptor stopped with nobody to resume them (never half a handover).
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        // A stop requested at any point before the commit ends the handover at the next
        // step (the waits wake for it), and the commit decision itself is taken against it.
        flight
            .wait_for_next(listener, &token)
            .and_then(|()| flight.not_stopping())
            .and_then(|()| flight.prepare_next())
            .and_then(|()| flight.quiesce())
            .and_then(|snapshot| flight.transfer_cell(snapshot))
            .and_then(|()| flight.await_next(Kind::Built))
            .and_then(|()| flight.not_stopping())
            .and_then(|()| flight.park_workers())
            .and_then(|snapshot| flight.transfer_pairs(snapshot))
            .and_then(|()| flight.await_next(Kind::Confirm))
            .and_then(|()| flight.commit())
    }))
    .unwrap_or_else(|_| Err("the running relay's handover thread panicked".into()));
    match result {
        Ok(()) => flight.exit_after_commit(),
        Err(cause) => flight.roll_back(cause),
    }
}

/// What a quiesce stopped, to send on or to start again.
#[derive(Default)]
struct Quiesced {
    threads: Option<CellThreadsState>,
    deposits: Vec<Parked>,
    /// `Some` once the workers were asked to park (they must be unparked on a rollback, with
    /// the buffers they lent).
    pairs: Option<Vec<ParkedPair>>,
    /// The pairs handed over, once committed (their records are freed then).
    released_pairs: usize,
    paused_at: Option<Instant>,
    connections: usize,
    /// Milestones for the log line: deposits done, threads stopped, workers parked, sent.
    phases: Vec<(&'static str, Instant)>,
    /// Each part's document and the bytes beside it, for the log line.
    sizes: Vec<(usize, usize)>,
}

struct InFlight<'a> {
    parts: &'a GiverParts,
    command: &'a Channel,
    /// The command's end is still open (an outcome can be sent).
    command_open: bool,
    next: Option<(Channel, Ready)>,
    /// The next process's last sign of life, on the machine's monotonic clock: its `ready`,
    /// any message, an `alive` (each says when it was sent), a chunk of a transfer taken.
    last_alive_ms: u64,
    quiesced: Option<Quiesced>,
    started: Instant,
    deadline: Instant,
    /// Set when a stop is requested (the process's drain callback).
    stopping: &'a crate::wake::Wake,
}

impl InFlight<'_> {
    /// `Err` once a stop has been requested: the handover rolls back and the drain follows.
    fn not_stopping(&self) -> Result<(), String> {
        if self.parts.shutdown.is_draining() {
            return Err(STOP_CAUSE.into());
        }
        Ok(())
    }

    /// Waits for the next process's `ready` (or its `failed`, or the command's `abort`).
    fn wait_for_next(&mut self, listener: &wire::Listener, token: &str) -> Result<(), String> {
        loop {
            self.not_stopping()?;
            let stops = [self.command.as_raw_fd(), self.stopping.raw_fd()];
            let arrived = match listener.accept_until(&stops, self.deadline) {
                Ok(arrived) => arrived,
                Err(wire::WireError::TimedOut) => {
                    return Err("the new process was not ready within 10 s".into())
                }
                Err(e) => return Err(format!("the handover socket failed: {e}")),
            };
            let Some(channel) = arrived else {
                self.not_stopping()?;
                // The command spoke (or went away): only an abort is expected.
                return Err(self.command_cause());
            };
            let first = receive(
                &channel,
                self.deadline.min(clock::instant() + Duration::from_secs(2)),
            );
            match first {
                Ok((Kind::Ready, message)) => match body::<Ready>(&message) {
                    Ok(ready) if ready.token == token => {
                        self.last_alive_ms = machine_ms();
                        if !ready.reads.contains(&STATE_VERSION) {
                            let cause = format!(
                                "the new process ({}) cannot read state version {STATE_VERSION}",
                                ready.version
                            );
                            self.next = Some((channel, ready));
                            return Err(cause);
                        }
                        self.next = Some((channel, ready));
                        return Ok(());
                    }
                    _ => refuse(&channel, "not the handover in progress"),
                },
                Ok((Kind::Failed, message)) => match body::<Cause>(&message) {
                    Ok(cause) if cause.token.as_deref() == Some(token) => return Err(cause.cause),
                    _ => refuse(&channel, "not the handover in progress"),
                },
                Ok((Kind::Begin, _)) => refuse(&channel, "another handover is in progress"),
                _ => {}
            }
        }
    }

    /// Tells the next process what it will take (the relay threads it will need) and waits,
    /// serving untouched, for it to have them waiting. A next process that hangs after its
    /// `ready` is abandoned here, before anything has paused.
    fn prepare_next(&mut self) -> Result<(), String> {
        let (next, _) = self.next.as_ref().ok_or("no new process")?;
        let context = &self.parts.cell.context;
        let prepare = Prepare {
            threads: context.thread_permits.used(),
            pool_open: context.store.pool_stats().open,
            descriptors: crate::lifecycle::descriptors_in_use(),
        };
        send(next, Kind::Prepare, &prepare, self.step_deadline())
            .map_err(|e| format!("the new process did not take its preparation: {e}"))?;
        self.await_next(Kind::Prepared)
    }

    /// Until when the next process may say nothing: [`SILENCE`] after its last sign of life,
    /// and never past the handover's deadline.
    fn alive_until(&self) -> Instant {
        let silent = machine_ms().saturating_sub(self.last_alive_ms);
        let left = SILENCE.saturating_sub(Duration::from_millis(silent));
        (clock::instant() + left).min(self.deadline)
    }

    /// The deadline of one message to the next process: a receiver that takes nothing for
    /// [`SILENCE`] is not there.
    fn step_deadline(&self) -> Instant {
        (clock::instant() + SILENCE).min(self.deadline)
    }

    /// Why the command spoke up: its abort's cause, or that it went away.
    fn command_cause(&mut self) -> String {
        match receive(self.command, clock::instant() + Duration::from_secs(1)) {
            Ok((Kind::Abort, message)) => body::<Cause>(&message)
                .map(|cause| cause.cause)
                .unwrap_or_else(|_| "the handover command aborted".into()),
            _ => {
                self.command_open = false;
                "the handover command went away".into()
            }
        }
    }

    /// Quiesces the cell's connections: bookings refused, the cell-wide threads stopped, the
    /// acceptor stopped, attaches frozen, every relay thread deposited. Spliced pairs still
    /// flow.
    /// Returns the snapshot's moment.
    fn quiesce(&mut self) -> Result<Snapshot, String> {
        let cell = &self.parts.cell;
        let context = &cell.context;
        cell.frozen.store(true, Ordering::Release);
        let quiesced = self.quiesced.insert(Quiesced::default());
        // The cell-wide threads first: none of them writes to (or closes) a connection once it
        // is deposited.
        quiesced.threads = cell.quiesce_threads();
        quiesced.phases.push(("threads", clock::instant()));
        // The acceptor's pending connections (no credential checked yet) as they stand.
        quiesced.deposits = cell.stop_acceptor();
        // Quiescing before the attaches freeze: a waiting phone woken by the freeze must find
        // the quiesce begun, or it would take the wake for nothing and wait on.
        context.quiesce.begin();
        context.cell.freeze_attaches(|| Attach::Wake);
        let all_parked = context
            .quiesce
            .wait_all_holding(&context.thread_permits, self.deadline);
        if !all_parked {
            return Err(format!(
                "{} connections did not reach a frame boundary within 10 s",
                context
                    .thread_permits
                    .used()
                    .saturating_sub(context.quiesce.holding())
            ));
        }
        quiesced.deposits.extend(context.quiesce.take_deposits());
        quiesced.connections = quiesced.deposits.len();
        quiesced.phases.push(("deposited", clock::instant()));
        Ok(Snapshot {
            now_ms: self.parts.clock.now_ms(),
            now: clock::instant(),
            machine_ms: clock::machine_ms(),
        })
    }

    /// Parks the splice workers (last: streams pause only from here). Returns the snapshot's
    /// moment for the pairs.
    fn park_workers(&mut self) -> Result<Snapshot, String> {
        let context = &self.parts.cell.context;
        let quiesced = self.quiesced.as_mut().ok_or("not quiesced")?;
        let snapshot = Snapshot {
            now_ms: self.parts.clock.now_ms(),
            now: clock::instant(),
            machine_ms: clock::machine_ms(),
        };
        quiesced.paused_at = Some(clock::instant());
        // Whatever the workers lent (their legs' buffers) is kept for a rollback, even when one
        // did not answer in time.
        let parked = context.splice.park(snapshot, self.deadline);
        let (pairs, failed) = match parked {
            Ok(pairs) => (pairs, None),
            Err((pairs, cause)) => (pairs, Some(cause)),
        };
        quiesced.pairs = Some(pairs);
        if let Some(cause) = failed {
            return Err(cause.to_string());
        }
        quiesced.phases.push(("parked", clock::instant()));
        Ok(snapshot)
    }

    /// Sends the listeners, every deposited connection and the cell's state.
    fn transfer_cell(&mut self, snapshot: Snapshot) -> Result<(), String> {
        let parts = self.parts;
        let cell = &parts.cell;
        let quiesced = self.quiesced.as_mut().ok_or("not quiesced")?;
        let ws = cell
            .idle_listener_fd()
            .ok_or("the WebSocket listener is not idle")?;
        let mut fds: Vec<RawFd> = vec![ws, parts.http_listener.as_raw_fd(), 2];
        let listeners = ListenerIndices {
            ws: 0,
            http: 1,
            stderr: Some(2),
        };
        // Each record takes its connection's byte buffers (what its reader holds, what its
        // socket owes) out of the deposit, no copy; they go back once sent.
        let mut connections = Vec::new();
        for parked in &mut quiesced.deposits {
            let (owed, owed_age_ms) = parked.conn.take_owed(snapshot.now);
            connections.push(ConnectionRecord {
                fd: fds.len(),
                id: parked.id,
                stage: parked.stage.lend(snapshot.now),
                owed,
                owed_age_ms,
            });
            fds.push(parked.conn.raw_fd());
        }
        let quiesced = self.quiesced.as_ref().ok_or("not quiesced")?;
        let threads = quiesced
            .threads
            .as_ref()
            .ok_or("the cell's threads were not running")?;
        let mut document = Document {
            v: STATE_VERSION,
            role: parts.role.to_string(),
            cell_id: cell.context.cell_id.to_string(),
            incarnation: cell.context.incarnation,
            snapshot_ms: snapshot.now_ms,
            snapshot_machine_ms: snapshot.machine_ms,
            from_version: protocol::version(),
            listeners,
            cell: cell.record(&snapshot, threads),
            readiness: cell.readiness().state_record(&snapshot),
            connections,
            crash_region: cell
                .context
                .crash
                .as_ref()
                .map(|store| store.region_name().to_string()),
        };
        let sent = self.send_part(&mut document, &fds, "sent");
        // The buffers back where they were (a failed handover resumes from the deposits).
        let quiesced = self.quiesced.as_mut().ok_or("not quiesced")?;
        for (parked, record) in quiesced.deposits.iter_mut().zip(document.connections) {
            parked.conn.give_back_owed(record.owed, record.owed_age_ms);
            parked.stage.give_back(record.stage);
        }
        sent
    }

    /// Sends the spliced pairs' sockets and state, and the metrics' totals. The records own
    /// the legs' buffers (the parked workers lent them): they are sent as they are and kept
    /// for a rollback.
    fn transfer_pairs(&mut self, snapshot: Snapshot) -> Result<(), String> {
        let quiesced = self.quiesced.as_mut().ok_or("not quiesced")?;
        let mut fds: Vec<RawFd> = Vec::new();
        let mut pairs = Vec::new();
        for pair in quiesced.pairs.iter_mut().flatten() {
            let mut index_of = |socket: &Option<Arc<Socket>>| {
                socket.as_ref().map(|socket| {
                    fds.push(socket.stream().as_raw_fd());
                    fds.len() - 1
                })
            };
            let phone_fd = index_of(&pair.phone);
            let host_fd = index_of(&pair.host);
            pairs.push(PairEntry {
                phone_fd,
                host_fd,
                pair: std::mem::take(&mut pair.record),
            });
        }
        let mut document = PairsDocument {
            v: STATE_VERSION,
            snapshot_ms: snapshot.now_ms,
            snapshot_machine_ms: snapshot.machine_ms,
            metrics: self.parts.registry.record(),
            pairs,
        };
        let sent = self.send_part(&mut document, &fds, "pairs sent");
        let quiesced = self.quiesced.as_mut().ok_or("not quiesced")?;
        for (pair, entry) in quiesced.pairs.iter_mut().flatten().zip(document.pairs) {
            pair.record = entry.pair;
        }
        sent
    }

    /// One part of the state: its header, its descriptors, its document and the byte buffers
    /// beside it (taken out of it for the sending, put back after).
    fn send_part<T: Serialize + Carried>(
        &mut self,
        document: &mut T,
        fds: &[RawFd],
        milestone: &'static str,
    ) -> Result<(), String> {
        let (next, ready) = self.next.as_ref().ok_or("no new process")?;
        let (bytes, raw) = write_parts(document)?;
        let raw_lengths: Vec<usize> = raw.iter().map(Vec::len).collect();
        let header = Transfer {
            version: STATE_VERSION,
            document_bytes: bytes.len(),
            fds: fds.len(),
            notify_socket: crate::lifecycle::notify_socket()
                .and_then(|socket| socket.into_string().ok()),
            watchdog_usec: crate::lifecycle::watchdog_usec(),
            from_pid: std::process::id(),
            from_version: protocol::version(),
            memfd_raw: ready
                .bytes_in_memfd
                .then(|| protocol::raw_in_memfd(&raw_lengths)),
            raw: raw_lengths,
        };
        let sent =
            protocol::send_transfer(next, &header, &bytes, fds, &raw, (SILENCE, self.deadline));
        put_back(document, raw);
        sent.map_err(|e| match e {
            wire::WireError::TimedOut if clock::instant() < self.deadline => format!(
                "the new process took nothing of the transfer for {} s",
                SILENCE.as_secs()
            ),
            e => format!("the transfer to the new process failed: {e}"),
        })?;
        // Taking the transfer is a sign of life.
        self.last_alive_ms = machine_ms();
        if let Some(quiesced) = self.quiesced.as_mut() {
            quiesced.phases.push((milestone, clock::instant()));
            quiesced
                .sizes
                .push((bytes.len(), header.raw.iter().sum::<usize>()));
        }
        Ok(())
    }

    /// Waits for the next process's `prepared`, `built` or `confirm` (`wanted`), reading its
    /// signs of life: one silent for [`SILENCE`] is abandoned.
    fn await_next(&mut self, wanted: Kind) -> Result<(), String> {
        let next_fd = self
            .next
            .as_ref()
            .map(|(next, _)| next.as_raw_fd())
            .ok_or("no new process")?;
        loop {
            self.not_stopping()?;
            let mut watched: Vec<RawFd> = vec![next_fd, self.stopping.raw_fd()];
            if self.command_open {
                watched.push(self.command.as_raw_fd());
            }
            let until = self.alive_until();
            let ready = wire::wait_readable(&watched, until).map_err(|e| match e {
                wire::WireError::TimedOut if clock::instant() >= self.deadline => {
                    "the new process did not confirm within 10 s".to_string()
                }
                wire::WireError::TimedOut => format!(
                    "the new process said nothing for {} s (waiting for {wanted:?})",
                    SILENCE.as_secs()
                ),
                other => format!("waiting for the new process failed: {other}"),
            })?;
            if ready.get(1).copied().unwrap_or(false) {
                continue;
            }
            if ready.get(2).copied().unwrap_or(false) {
                let cause = self.command_cause();
                if self.command_open {
                    return Err(cause);
                }
                // The command went away: the handover goes on without it.
                continue;
            }
            let (next, _) = self.next.as_ref().ok_or("no new process")?;
            let received = receive(next, self.alive_until());
            if let Ok((Kind::Alive, message)) = &received {
                let sent = body::<Alive>(message).map_or(0, |alive| alive.machine_ms);
                self.last_alive_ms = self.last_alive_ms.max(sent);
                continue;
            }
            if received.is_ok() {
                self.last_alive_ms = machine_ms();
            }
            return match received {
                Ok((kind, _)) if kind == wanted => Ok(()),
                Ok((Kind::Failed, message)) => Err(body::<Cause>(&message)
                    .map(|cause| cause.cause)
                    .unwrap_or_else(|_| "the new process failed".into())),
                Ok(_) => Err(format!(
                    "the new process sent something other than {wanted:?}"
                )),
                Err(wire::WireError::Closed) => {
                    Err("the new process exited before confirming".into())
                }
                Err(e) => Err(format!("the new process's answer failed: {e}")),
            };
        }
    }

    /// The commit point: decided against a stop (one requested before rolls back: this
    /// process drains), systemd follows the next process first, then `committed`, carrying a
    /// stop that arrived since the decision (the next process drains at once).
    fn commit(&mut self) -> Result<(), String> {
        let (next, ready) = self.next.as_ref().ok_or("no new process")?;
        // Every removal of a connection this process closed reaches the manager's store before
        // the next process owns it (and this one exits without a word more).
        if let Some(store) = &self.parts.cell.context.crash {
            store.wait_sent(Duration::from_millis(500));
        }
        let shutdown = &self.parts.shutdown;
        if !shutdown.commit_handover(ready.pid) {
            return Err(STOP_CAUSE.into());
        }
        let under_systemd = crate::lifecycle::notify_socket().is_some();
        if under_systemd {
            crate::lifecycle::notify_main_pid(ready.pid);
            if let Err(e) = crate::lifecycle::notify_barrier(Duration::from_secs(2)) {
                log::warn!("orca_relay_handover_barrier_failed error={e}");
            }
        }
        let committed = Committed {
            stop: shutdown.stops_for_commit() > 0,
        };
        let sent = send(
            next,
            Kind::Committed,
            &committed,
            clock::instant() + Duration::from_secs(2),
        );
        if let Err(e) = sent {
            if under_systemd {
                crate::lifecycle::notify_main_pid(std::process::id());
                let _ = crate::lifecycle::notify_barrier(Duration::from_secs(2));
            }
            // Serving on: a stop that came meanwhile is this process's again.
            shutdown.abandon_handover();
            return Err(format!("the new process went away before the commit: {e}"));
        }
        if committed.stop {
            log::info!(
                "orca_relay_handover_stop_passed_on to_pid={} note=the_new_process_drains",
                ready.pid
            );
        }
        Ok(())
    }

    /// The milestones as `name:ms,…` from the start (the log line's `phases_ms`).
    fn phases(&self) -> String {
        let Some(quiesced) = self.quiesced.as_ref() else {
            return "-".into();
        };
        quiesced
            .phases
            .iter()
            .map(|(name, at)| format!("{name}:{}", at.duration_since(self.started).as_millis()))
            .collect::<Vec<_>>()
            .join(",")
    }

    fn outcome(&self, committed: bool, cause: Option<String>) -> Outcome {
        let quiesced = self.quiesced.as_ref();
        Outcome {
            committed,
            cause,
            new_pid: self.next.as_ref().map(|(_, ready)| ready.pid),
            new_version: self.next.as_ref().map(|(_, ready)| ready.version.clone()),
            connections: quiesced.map_or(0, |q| q.connections),
            pairs: quiesced.map_or(0, |q| q.pairs.as_ref().map_or(q.released_pairs, Vec::len)),
            paused_ms: quiesced
                .and_then(|q| q.paused_at)
                .map_or(0, |at| at.elapsed().as_millis() as u64),
            took_ms: self.started.elapsed().as_millis() as u64,
        }
    }

    /// Committed: the next process owns every connection. This one tells the command, stops
    /// beating, lets its HTTP requests in flight finish (the listener stays open for the next
    /// process) and exits 0 without touching a handed connection (no destructor runs).
    fn exit_after_commit(mut self) -> ! {
        // The pairs' buffers the workers lent are the next process's now: freed at once, not
        // held while this process finishes its requests.
        if let Some(quiesced) = self.quiesced.as_mut() {
            quiesced.released_pairs = quiesced.pairs.take().map_or(0, |pairs| pairs.len());
        }
        // No new HTTP connection for this process from now on: once the command has the
        // outcome, every request is the next process's.
        let http = self
            .parts
            .http
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        let http = http.map(|mut http| {
            http.stop_accepting();
            http
        });
        let outcome = self.outcome(true, None);
        let phases = self.phases();
        let sizes = self.quiesced.as_ref().map_or_else(String::new, |quiesced| {
            quiesced
                .sizes
                .iter()
                .map(|(document, raw)| format!("{document}+{raw}"))
                .collect::<Vec<_>>()
                .join(",")
        });
        log::info!(
            "orca_relay_handover_committed to_pid={} to_version={} connections={} pairs={} paused_ms={} took_ms={} phases_ms={phases} bytes={sizes}",
            outcome.new_pid.unwrap_or(0),
            outcome.new_version.as_deref().unwrap_or("-"),
            outcome.connections,
            outcome.pairs,
            outcome.paused_ms,
            outcome.took_ms
        );
        if self.command_open {
            let _ = send(
                self.command,
                Kind::Outcome,
                &outcome,
                clock::instant() + Duration::from_secs(1),
            );
        }
        self.parts.cell.stop_heartbeat();
        if let Some(http) = http {
            http.stop_shared(true);
        }
        log::info!(
            "orca_relay_shutdown_finished role={} handed_over=true",
            self.parts.role
        );
        log::logger().flush();
        std::process::exit(0)
    }

    /// Failed before the commit: the next process is told (it exits touching nothing), every
    /// connection resumes here where it was, the threads start again from their state, one
    /// line is logged and the command hears the cause.
    fn roll_back(mut self, cause: String) {
        if let Some((next, _)) = &self.next {
            let _ = send(
                next,
                Kind::Rollback,
                &Cause {
                    token: None,
                    cause: cause.clone(),
                },
                clock::instant() + Duration::from_secs(1),
            );
        }
        let cell = &self.parts.cell;
        let context = &cell.context;
        let outcome = self.outcome(false, Some(cause.clone()));
        if let Some(quiesced) = self.quiesced.take() {
            let mut deposits = quiesced.deposits;
            deposits.extend(context.quiesce.end());
            // The threads that held their deposited connections end first: the connections
            // resume on new threads, never beside the old ones (the thread bound holds).
            if !context
                .quiesce
                .wait_released(clock::instant() + Duration::from_secs(10))
            {
                log::warn!(
                    "orca_relay_handover_threads_lingering threads={}",
                    context.quiesce.holding()
                );
            }
            context.cell.thaw_attaches();
            let (pending, deposits): (Vec<Parked>, Vec<Parked>) = deposits
                .into_iter()
                .partition(|parked| parked.stage.is_pending());
            cell.carry_pending(pending);
            resume_all(context, deposits, None);
            if let Some(pairs) = quiesced.pairs {
                context.splice.unpark(pairs);
            }
            if let Some(threads) = quiesced.threads {
                if let Err(e) = cell.restart_threads(threads) {
                    log::error!("orca_relay_handover_restart_failed error={e}");
                }
            }
            cell.resume_reregistration();
            if let Err(e) = cell.start_acceptor() {
                log::error!("orca_relay_handover_restart_failed error={e}");
            }
        }
        cell.frozen.store(false, Ordering::Release);
        log::warn!(
            "orca_relay_handover_failed cause={:?} new_pid={} paused_ms={} took_ms={}",
            cause,
            outcome.new_pid.unwrap_or(0),
            outcome.paused_ms,
            outcome.took_ms
        );
        if self.command_open {
            let _ = send(
                self.command,
                Kind::Outcome,
                &outcome,
                clock::instant() + Duration::from_secs(1),
            );
        }
    }
}

/// Resumes deposited connections, waiting phones first (their pending entries must be back
/// before a data leg looks for them).
fn resume_all(context: &RelayContext, deposits: Vec<Parked>, gate: Option<Arc<Gate>>) {
    let (waiting, others): (Vec<Parked>, Vec<Parked>) = deposits
        .into_iter()
        .partition(|parked| matches!(parked.stage, Stage::PhoneWaiting { .. }));
    for parked in waiting.into_iter().chain(others) {
        let id = parked.id;
        if let Err(e) = thread::resume(context, parked, gate.clone(), None) {
            log::error!("orca_relay_handover_resume_failed conn={id} error={e}");
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The taker: the next process.
// ---------------------------------------------------------------------------------------------

/// A fault a test asks the next process to fake (`orca-relay handover --test-fault …`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// Exits with status 3 before doing anything.
    ExitAtStart,
    /// Aborts once half the descriptors have arrived.
    DieAfterHalf,
    /// Reads no state version (as a build that does not know the running one's).
    RejectStateVersion,
    /// Never confirms (the running process's 10 s run out).
    NeverConfirm,
    /// Stops itself (`SIGSTOP`) right after saying `ready`: a next process that hangs.
    StopAfterReady,
}

impl Fault {
    pub fn parse(text: &str) -> Option<Fault> {
        match text {
            "exit-at-start" => Some(Fault::ExitAtStart),
            "die-after-half" => Some(Fault::DieAfterHalf),
            "reject-state-version" => Some(Fault::RejectStateVersion),
            "never-confirm" => Some(Fault::NeverConfirm),
            "stop-after-ready" => Some(Fault::StopAfterReady),
            _ => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Fault::ExitAtStart => "exit-at-start",
            Fault::DieAfterHalf => "die-after-half",
            Fault::RejectStateVersion => "reject-state-version",
            Fault::NeverConfirm => "never-confirm",
            Fault::StopAfterReady => "stop-after-ready",
        }
    }
}

/// Set once this process (as the next one of a handover) has been told `committed`.
static COMMITTED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Whether this process took over with a committed handover (after which its failures are its
/// own, not the handover's).
pub fn committed() -> bool {
    COMMITTED.load(Ordering::Acquire)
}

/// How the next process was started: `orca-relay run --take-over <socket> --handover-fd <fd>
/// [--running <json>]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TakeOver {
    pub socket: PathBuf,
    /// The command's line to this process (an inherited unix socket): the token arrives on it,
    /// and `committed` goes back on it (see [`read_token`]).
    pub line: RawFd,
    /// Read from the line (empty until then).
    pub token: String,
    pub fault: Option<Fault>,
    /// The running process, as it told the command (`None` from a command or a running
    /// process before issue 31: the cell and the addresses are then checked on what is
    /// received, after `ready`).
    pub running: Option<protocol::Running>,
}

/// The longest token read from the command's line.
const MAX_TOKEN: u64 = 1024;

/// How long the next process waits for its token: the command writes it as soon as it has
/// reaped the process that started this one.
const TOKEN_WAIT: Duration = Duration::from_secs(10);

/// The command's line, kept to tell it `committed` (then closed).
static COMMAND_LINE: Mutex<Option<std::os::unix::net::UnixStream>> = Mutex::new(None);

/// Takes the command's line (descriptor `fd`, inherited) and reads the one-time token from it
/// up to its end. The command writes it only once this process is an orphan (its parent is
/// the one that reaps orphans: systemd under systemd), so nothing this process says can make
/// it the unit's main process before that. The token never travels on a command line.
pub fn read_token(fd: RawFd) -> Result<String, String> {
    use std::io::Read;
    use std::os::fd::FromRawFd;
    let mut stat: libc::stat = unsafe {
        // SAFETY: plain old data, filled by fstat below.
        std::mem::zeroed()
    };
    // SAFETY: fstat(2) into a struct we own; fails cleanly on a descriptor that is not open.
    if unsafe { libc::fstat(fd, &mut stat) } != 0 || stat.st_mode & libc::S_IFMT != libc::S_IFSOCK {
        return Err(format!(
            "--handover-fd {fd} is not the handover command's line (start the next process with `orca-relay handover`)"
        ));
    }
    // SAFETY: F_SETFD on an inherited descriptor: not passed on to any process this one
    // starts.
    unsafe { libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC) };
    // SAFETY: the descriptor was inherited for this process alone, which owns it from here.
    let line = unsafe { std::os::unix::net::UnixStream::from_raw_fd(fd) };
    let deadline = clock::instant() + TOKEN_WAIT;
    let mut token = Vec::new();
    let mut buf = [0u8; 256];
    loop {
        let left = deadline.saturating_duration_since(clock::instant());
        if left.is_zero() {
            return Err("no token from the handover command within 10 s".into());
        }
        let _ = line.set_read_timeout(Some(left));
        match (&line)
            .take(MAX_TOKEN + 1 - token.len() as u64)
            .read(&mut buf)
        {
            Ok(0) => break,
            Ok(n) => {
                token.extend_from_slice(&buf[..n]);
                if token.len() as u64 > MAX_TOKEN {
                    return Err("the handover command's token is too long".into());
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(format!("cannot read the handover command's token: {e}")),
        }
    }
    let token = String::from_utf8(token)
        .ok()
        .filter(|token| !token.is_empty() && token.bytes().all(|b| b.is_ascii_graphic()))
        .ok_or("the handover command sent no usable token")?;
    *COMMAND_LINE.lock().unwrap_or_else(|e| e.into_inner()) = Some(line);
    Ok(token)
}

/// Tells the command this process was committed (it owns everything now), then closes the
/// line. The command relies on it when the running process went away without an outcome.
fn tell_command_committed() {
    use std::io::Write;
    let line = COMMAND_LINE
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .take();
    if let Some(line) = line {
        let _ = line.set_write_timeout(Some(Duration::from_secs(1)));
        let _ = (&line).write_all(protocol::COMMITTED_WORD);
    }
}

/// The next process's side of the handover, from `ready` to the giver's word.
pub struct Taker {
    channel: Channel,
    token: String,
    /// What the running process said of its listeners (through the command).
    listening: Option<protocol::Listening>,
    fault: Option<Fault>,
    pub gate: Arc<Gate>,
    pub document: Document,
    pub carry: Carry,
    reads: Vec<u32>,
    pub header: Transfer,
    fds: Vec<Option<OwnedFd>>,
    /// Pairs to hand to the splice workers once committed.
    pairs: Vec<ResumedPair>,
    pub received_at: Instant,
    /// Milestones for the log line (from `received_at`).
    marks: Vec<(&'static str, Instant)>,
    /// Relay threads started before anything paused, waiting for the connections.
    spares: Option<threads::Spares>,
    /// The signs of life, until the outcome.
    beats: Option<Beats>,
    /// The running process was asked to stop after its commit decision: this one drains as
    /// soon as it serves.
    stop_requested: bool,
}

/// A take-over that could not go on: tell the giver (which rolls back) and stop.
pub fn report_failed(socket: &std::path::Path, token: &str, cause: &str) {
    let deadline = clock::instant() + Duration::from_secs(2);
    if let Ok(channel) = Channel::connect_trusted(socket, deadline) {
        let _ = send(
            &channel,
            Kind::Failed,
            &Cause {
                token: Some(token.to_string()),
                cause: cause.to_string(),
            },
            deadline,
        );
    }
}

/// What the next process holds now only for the handover, not to count in its capacity as a
/// fresh start would not: the running process's pid, as it told the command (its tasks; `None`
/// from an older command or running process), and the descriptors of the handover itself (the
/// command's line, closed at the commit).
pub fn transient(take_over: &TakeOver) -> (Option<u32>, u64) {
    let line = COMMAND_LINE
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .is_some();
    (
        take_over.running.as_ref().and_then(|running| running.pid),
        u64::from(line),
    )
}

/// The next process's signs of life ([`Kind::Alive`] every [`BEAT`]), from its `ready` until
/// the outcome, on a thread of their own: the running process abandons a next process silent
/// for [`SILENCE`], whatever step it is in.
struct Beats {
    stop: std::sync::mpsc::Sender<()>,
    handle: JoinHandle<()>,
}

impl Beats {
    fn start(channel: &Channel) -> Option<Beats> {
        let channel = channel.try_clone().ok()?;
        let (stop, stopped) = std::sync::mpsc::channel::<()>();
        let handle = threads::spawn("handover-beat", move || loop {
            match stopped.recv_timeout(BEAT) {
                Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {}
                _ => return,
            }
            let alive = Alive {
                machine_ms: machine_ms(),
            };
            if send(&channel, Kind::Alive, &alive, clock::instant() + BEAT).is_err() {
                return;
            }
        })
        .ok()?;
        Some(Beats { stop, handle })
    }

    fn stop(self) {
        drop(self.stop);
        threads::join_logged("handover-beat", self.handle);
    }
}

/// The listeners a cell or combined process starts with, and what the service manager passed
/// besides: socket units' listeners, or after a crash everything the descriptor store kept; a
/// handover's next process gets its own from the handover (`taker`) and nothing from the store.
pub fn start_listeners(
    config: &Config,
    taker: Option<&mut Taker>,
    with_ws: bool,
) -> Result<(crate::crash_store::Intake, super::process::ListenerPair), RunError> {
    let mut intake = match &taker {
        Some(_) => crate::crash_store::Intake::default(),
        None => crate::crash_store::Intake::from_environment().map_err(RunError)?,
    };
    let passed = std::mem::take(&mut intake.listeners);
    let handed = taker.map(|taker| taker.listeners(config)).transpose()?;
    let listeners = super::process::listeners(config, handed, passed, with_ws)?;
    Ok((intake, listeners))
}

impl Taker {
    /// Says `ready` (with everything built that needs no connection), keeps saying it is alive,
    /// starts the relay threads the running process says it will need (waiting, before
    /// anything pauses), and receives the cell's part of the transfer; `Err` is the cause
    /// (already told to the running process when it can hear it).
    pub fn receive(
        take_over: &TakeOver,
        (role, cell_id): (&str, &str),
        store: &crate::store::Store,
        clock: &SharedClock,
    ) -> Result<Taker, RunError> {
        let deadline = clock::instant() + TAKER_WAIT;
        // Only a listener of this user hears the token (`connect_trusted`).
        let channel = Channel::connect_trusted(&take_over.socket, deadline).map_err(|e| {
            RunError(format!(
                "cannot reach the running relay at {}: {e}",
                take_over.socket.display()
            ))
        })?;
        let reads: Vec<u32> = if take_over.fault == Some(Fault::RejectStateVersion) {
            Vec::new()
        } else {
            READS.to_vec()
        };
        let ready = Ready {
            token: take_over.token.clone(),
            pid: std::process::id(),
            version: protocol::version(),
            reads: reads.clone(),
            bytes_in_memfd: true,
        };
        send(&channel, Kind::Ready, &ready, deadline)
            .map_err(|e| RunError(format!("the running relay did not hear ready: {e}")))?;
        let beats = Beats::start(&channel);
        if take_over.fault == Some(Fault::StopAfterReady) {
            // A test's fault: a next process that hangs right after saying ready.
            // SAFETY: raise(2) with a constant signal.
            unsafe { libc::raise(libc::SIGSTOP) };
        }
        let mut spares = None;
        let header: Transfer = loop {
            match receive(&channel, deadline) {
                Ok((Kind::Prepare, message)) => {
                    let prepare: Prepare = body(&message)
                        .map_err(|e| RunError(format!("a malformed preparation: {e}")))?;
                    spares = Some(threads::Spares::start(
                        prepare.threads,
                        threads::RELAY_STACK_BYTES,
                    ));
                    store.warm_pool(prepare.pool_open);
                    crate::lifecycle::grow_descriptor_table(
                        prepare.descriptors,
                        channel.as_raw_fd(),
                    );
                    send(&channel, Kind::Prepared, &serde_json::json!({}), deadline).map_err(
                        |e| RunError(format!("the running relay did not hear prepared: {e}")),
                    )?;
                }
                Ok((Kind::Transfer, message)) => {
                    break body(&message)
                        .map_err(|e| RunError(format!("a malformed transfer header: {e}")))?
                }
                Ok((Kind::Rollback | Kind::Refused, message)) => {
                    let cause = body::<Cause>(&message).map(|c| c.cause).unwrap_or_default();
                    return Err(RunError(format!("the running relay rolled back: {cause}")));
                }
                Ok(_) => {
                    return Err(RunError(
                        "an unexpected message instead of a transfer".into(),
                    ))
                }
                Err(e) => return Err(RunError(format!("no transfer came: {e}"))),
            }
        };
        let half = header.fds / 2;
        let fault = take_over.fault;
        let limits = (MAX_DOCUMENT, MAX_CARRIED_BUFFER);
        let received = protocol::receive_transfer(&channel, header, limits, deadline, |n| {
            if fault == Some(Fault::DieAfterHalf) && n >= half {
                // A test's fault: die with half the descriptors received.
                std::process::abort();
            }
        })
        .map_err(|e| RunError(format!("the transfer failed: {e}")))?;
        let fail = |channel: &Channel, cause: String| {
            let _ = send(
                channel,
                Kind::Failed,
                &Cause {
                    token: Some(take_over.token.clone()),
                    cause: cause.clone(),
                },
                clock::instant() + Duration::from_secs(2),
            );
            RunError(cause)
        };
        let document: Document = match read_parts(&received.document, received.raw, &reads) {
            Ok(document) => document,
            Err(cause) => return Err(fail(&channel, cause)),
        };
        if document.role != role || document.cell_id != cell_id {
            let cause = format!(
                "the running relay is a {} cell {:?}; this configuration runs a {role} cell {cell_id:?} (restart to change)",
                document.role, document.cell_id
            );
            return Err(fail(&channel, cause));
        }
        let received_at = clock::instant();
        let carry = Carry::new(received_at, here(clock), document.sent_at());
        crate::lifecycle::adopt_systemd(
            received.header.notify_socket.as_deref(),
            received.header.watchdog_usec,
        );
        Ok(Taker {
            channel,
            token: take_over.token.clone(),
            listening: take_over.running.as_ref().map(|running| running.listening),
            fault,
            gate: Gate::new(),
            document,
            carry,
            reads,
            header: received.header,
            fds: received.fds.into_iter().map(Some).collect(),
            pairs: Vec::new(),
            received_at,
            marks: Vec::new(),
            spares,
            beats,
            stop_requested: false,
        })
    }

    /// Notes a milestone of the rebuild.
    pub fn mark(&mut self, name: &'static str) {
        self.marks.push((name, clock::instant()));
    }

    /// The milestones as `name:ms,…` since the transfer arrived.
    pub fn phases(&self) -> String {
        self.marks
            .iter()
            .map(|(name, at)| format!("{name}:{}", at.duration_since(self.received_at).as_millis()))
            .collect::<Vec<_>>()
            .join(",")
    }

    /// The next process's whole take-over once the transfer is read: every connection behind
    /// the gate, the pairs, the commit, `after_commit` (this process's first writes outside
    /// its memory: migrations, registration, files; the spliced pairs already flowing, every
    /// other connection still behind the gate), then the gate and the cell's threads.
    /// `((pairs, descriptors), what after_commit returned)`.
    pub fn take_over<T>(
        &mut self,
        cell: &CellRuntime,
        registry: &Registry,
        clock: &SharedClock,
        after_commit: impl FnOnce() -> T,
    ) -> Result<((usize, usize), T), RunError> {
        if let Err(e) = self.import_connections(cell) {
            return Err(self.fail(&e.0));
        }
        self.receive_pairs(cell, registry, clock)?;
        let committed = self.commit(cell)?;
        // This process's crash-store region replaces the running one's in the manager's store
        // (every carried connection's record is in it already), before the gate opens: from
        // then on the running process's records are stale.
        if let Some(store) = &cell.context.crash {
            if let Err(e) = store.keep_region_now() {
                log::warn!("orca_relay_crash_store_region_not_kept error={e}");
            }
            if let Some(old) = &self.document.crash_region {
                store.forget(old);
            }
        }
        let after = after_commit();
        self.mark("after commit");
        self.gate.open();
        // The spare threads take their connections; those without one end.
        if let Some(spares) = self.spares.take() {
            spares.release();
        }
        cell.resume_threads()?;
        Ok((committed, after))
    }

    /// Whether the running process passed on a stop with `committed`: the caller begins the
    /// drain ([`crate::lifecycle::Shutdown::drain_inherited`]) once it serves.
    pub fn stop_requested(&self) -> bool {
        self.stop_requested
    }

    /// The line of a take-over done (logged once the HTTP listener serves too).
    pub fn log_received(&self, (pairs, descriptors): (usize, usize)) {
        log::info!(
            "orca_relay_handover_received from_pid={} from_version={} descriptors={descriptors} pairs={pairs} rebuilt_ms={} phases_ms={}",
            self.header.from_pid,
            self.header.from_version,
            self.received_at.elapsed().as_millis(),
            self.phases()
        );
    }

    pub fn fail(&self, cause: &str) -> RunError {
        let _ = send(
            &self.channel,
            Kind::Failed,
            &Cause {
                token: Some(self.token.clone()),
                cause: cause.to_string(),
            },
            clock::instant() + Duration::from_secs(2),
        );
        RunError(cause.to_string())
    }

    fn take_fd(&mut self, index: usize) -> Result<OwnedFd, RunError> {
        self.fds
            .get_mut(index)
            .and_then(Option::take)
            .ok_or_else(|| self.fail(&format!("descriptor {index} missing from the transfer")))
    }

    /// The listeners (WebSocket, HTTP), and the running process's standard error adopted as
    /// this one's (its logs go where the running process's went). A configured address they
    /// are not bound to is refused (`process::check_carried_listeners`): checked before
    /// `ready` already when the command said what the running process listens on, and here,
    /// on the listeners themselves, in any case (a running process or a command before issue
    /// 31 did not say).
    pub fn listeners(&mut self, config: &Config) -> Result<Handed, RunError> {
        let indices = self.document.listeners.clone();
        if let Some(stderr) = indices.stderr {
            let fd = self.take_fd(stderr)?;
            // SAFETY: dup2 onto our standard error; both descriptors are valid.
            unsafe { libc::dup2(fd.as_raw_fd(), 2) };
        }
        let ws = std::net::TcpListener::from(self.take_fd(indices.ws)?);
        let http = std::net::TcpListener::from(self.take_fd(indices.http)?);
        let from_systemd = self
            .listening
            .map_or((false, false), |l| (l.ws_from_systemd, l.http_from_systemd));
        let bound = |listener: &std::net::TcpListener| {
            listener
                .local_addr()
                .map_err(|e| format!("cannot read a received listener's address: {e}"))
        };
        let held = bound(&ws).and_then(|ws| {
            Ok(protocol::Listening {
                ws,
                http: bound(&http)?,
                ws_from_systemd: from_systemd.0,
                http_from_systemd: from_systemd.1,
            })
        });
        let checked = held
            .map_err(RunError)
            .and_then(|held| super::process::check_carried_listeners(config, &held));
        if let Err(e) = checked {
            return Err(self.fail(&e.0));
        }
        Ok(Handed {
            ws,
            http,
            from_systemd,
        })
    }

    /// Gives every carried connection to a relay thread held at the gate, and prepares every
    /// pair for the splice workers; nothing does I/O until [`Taker::commit`] opens the gate.
    pub fn import_connections(&mut self, cell: &CellRuntime) -> Result<(), RunError> {
        self.mark("built");
        let context = &cell.context;
        let now = clock::instant();
        let records = std::mem::take(&mut self.document.connections);
        let mut deposits = Vec::new();
        let mut pending = Vec::new();
        for record in records {
            let fd = self.take_fd(record.fd)?;
            let stream = std::net::TcpStream::from(fd);
            let stage = Stage::from_record(record.stage, now, self.carry.elapsed_ms);
            let wedge = Duration::from_millis(context.timings.wedge_ms);
            let parked = match stage {
                // The acceptor's pending loop takes these once the handover has committed.
                stage if stage.is_pending() => {
                    pending.push(Parked {
                        id: record.id,
                        conn: ParkedConn::Pending(stream),
                        stage,
                        hold: None,
                        place: None,
                    });
                    continue;
                }
                stage => {
                    let _ = stream.set_write_timeout(Some(wedge));
                    let socket =
                        Socket::interruptible(record.id, stream, context.quiesce.interrupt());
                    // What its socket owed when the quiesce began goes out first, its write's
                    // deadline going on from when it began.
                    let owed_age = record.owed_age_ms.saturating_add(self.carry.elapsed_ms);
                    socket.owe(record.owed, Duration::from_millis(owed_age));
                    let kind = stage_kind(&stage);
                    let place = match &stage {
                        Stage::PhoneWaiting { phone, .. } => {
                            Some(PhonePlace::carried(&context.cell, &phone.relay_host_id))
                        }
                        _ => None,
                    };
                    // In this process's crash store (its own memory until the commit; the
                    // descriptor is in the manager's store already).
                    match &stage {
                        Stage::Control { control, .. } => context.keep_carried(
                            &socket,
                            CrashKind::Control,
                            Some(control.clone()),
                            None,
                            false,
                        ),
                        Stage::PhoneWaiting { phone, .. } => context.keep_carried(
                            &socket,
                            CrashKind::Phone,
                            None,
                            Some(&phone.relay_host_id),
                            true,
                        ),
                        _ => {}
                    }
                    if let Stage::Control { control, .. } = &stage {
                        let restored = context.cell.restore_control(crate::cell::state::Control {
                            socket: socket.clone(),
                            user_id: control.claims.user_id.clone(),
                            relay_host_id: control.claims.relay_host_id.clone(),
                            epoch: control.epoch,
                            generation: control.generation,
                            admitted_via: control.admitted_via.into(),
                            lease_id: control.lease_id.clone(),
                        });
                        if !restored {
                            return Err(self.fail(&format!(
                                "control {} of host {} has no seat in the state",
                                record.id, control.claims.relay_host_id
                            )));
                        }
                    }
                    Parked {
                        id: record.id,
                        conn: ParkedConn::Socket(socket),
                        stage,
                        hold: Some(context.carried_hold(kind)),
                        place,
                    }
                }
            };
            deposits.push(parked);
        }
        let (waiting, others): (Vec<Parked>, Vec<Parked>) = deposits
            .into_iter()
            .partition(|parked| matches!(parked.stage, Stage::PhoneWaiting { .. }));
        for parked in waiting.into_iter().chain(others) {
            let id = parked.id;
            thread::resume(
                context,
                parked,
                Some(self.gate.clone()),
                self.spares.as_ref(),
            )
            .map_err(|e| self.fail(&format!("cannot start a thread for connection {id}: {e}")))?;
        }
        cell.carry_pending(pending);
        self.mark("threads");
        Ok(())
    }

    /// Says `built`, receives the spliced pairs and the metrics' totals (the running process
    /// parks its splice workers only now), and prepares each pair for a splice worker (handed
    /// over at the commit).
    pub fn receive_pairs(
        &mut self,
        cell: &CellRuntime,
        registry: &Registry,
        clock: &SharedClock,
    ) -> Result<(), RunError> {
        let deadline = clock::instant() + TAKER_WAIT;
        send(&self.channel, Kind::Built, &serde_json::json!({}), deadline)
            .map_err(|e| RunError(format!("the running relay did not hear built: {e}")))?;
        let header: Transfer = match receive(&self.channel, deadline) {
            Ok((Kind::Transfer, message)) => {
                body(&message).map_err(|e| RunError(format!("a malformed transfer header: {e}")))?
            }
            Ok((Kind::Rollback | Kind::Refused, _)) | Err(_) => {
                log::logger().flush();
                std::process::exit(1);
            }
            Ok(_) => return Err(self.fail("an unexpected message instead of the pairs")),
        };
        let limits = (MAX_DOCUMENT, MAX_CARRIED_BUFFER);
        let received = protocol::receive_transfer(&self.channel, header, limits, deadline, |_| {})
            .map_err(|e| self.fail(&format!("the pairs' transfer failed: {e}")))?;
        self.mark("pairs received");
        let document: PairsDocument =
            match read_parts(&received.document, received.raw, &self.reads) {
                Ok(document) => document,
                Err(cause) => return Err(self.fail(&cause)),
            };
        registry.restore(&document.metrics);
        let carry = Carry::new(clock::instant(), here(clock), document.sent_at());
        self.fds = received.fds.into_iter().map(Some).collect();
        let context = &cell.context;
        for entry in document.pairs {
            let mut leg = |fd: Option<usize>,
                           record: Option<LegRecord>,
                           kind: &'static str,
                           host: Option<&str>|
             -> Result<Option<ResumedLeg>, RunError> {
                let (Some(fd), Some(record)) = (fd, record) else {
                    return Ok(None);
                };
                let stream = std::net::TcpStream::from(self.take_fd(fd)?);
                let socket = Socket::new_splice(record.id, stream);
                // The worker writes the pair's records once it has it (`record_pair`).
                let crash_kind = if kind == "phone" {
                    CrashKind::Phone
                } else {
                    CrashKind::Data
                };
                context.keep_carried(&socket, crash_kind, None, None, true);
                let mut release: Vec<crate::relay::splice::Release> =
                    vec![Box::new(context.carried_hold(kind))];
                if let Some(host) = host {
                    release.push(Box::new(PhonePlace::carried(&context.cell, host)));
                }
                Ok(Some(ResumedLeg {
                    socket,
                    last_progress_ms: carry.moment_ms(record.progress_ago_ms),
                    linger_due_ms: record.linger_left_ms.map(|left| carry.deadline_ms(left)),
                    // A version-1 leg had no idle window: it starts now.
                    last_heard_ms: record
                        .arrival_ago_ms
                        .map_or(carry.now_ms, |ago| carry.moment_ms(ago)),
                    record,
                    release,
                }))
            };
            let host_id = entry.pair.relay_host_id.clone();
            let phone = leg(
                entry.phone_fd,
                entry.pair.phone,
                "phone",
                host_id.as_deref(),
            )?;
            let host = leg(entry.host_fd, entry.pair.host, "data", None)?;
            self.pairs.push(ResumedPair {
                relay_host_id: host_id,
                phone,
                host,
            });
        }
        self.mark("pairs");
        Ok(())
    }

    /// Confirms and waits for the giver's word. `committed`: the pairs go to the splice
    /// workers and this process owns everything (its caller opens the gate). A `rollback` (or a refusal) ends this
    /// process at once with status 1, having touched nothing; so does a giver that went away
    /// without a word (it may have failed to send its `rollback` and be serving again: only a
    /// `committed` read here makes this process an owner).
    pub fn commit(&mut self, cell: &CellRuntime) -> Result<(usize, usize), RunError> {
        if self.fault == Some(Fault::NeverConfirm) {
            // A test's fault: never confirm; the giver's clock runs out and it rolls back.
            let _ = receive(&self.channel, clock::instant() + TAKER_WAIT);
            std::process::exit(1);
        }
        let deadline = clock::instant() + TAKER_WAIT;
        send(
            &self.channel,
            Kind::Confirm,
            &serde_json::json!({}),
            deadline,
        )
        .map_err(|e| RunError(format!("the running relay did not hear confirm: {e}")))?;
        match receive(&self.channel, deadline) {
            Ok((Kind::Committed, message)) => {
                // An older running process sends `{}`: no stop.
                self.stop_requested = body::<Committed>(&message).is_ok_and(|c| c.stop);
            }
            Ok(_) | Err(_) => {
                // Rolled back (or no word): exit without touching a connection.
                log::logger().flush();
                std::process::exit(1);
            }
        }
        COMMITTED.store(true, Ordering::Release);
        tell_command_committed();
        self.mark("committed");
        if let Some(beats) = self.beats.take() {
            beats.stop();
        }
        // The streams first: a thousand relay threads waking at once at the gate must not
        // stand between a splice worker and its pairs.
        let pairs = std::mem::take(&mut self.pairs);
        let count = pairs.len();
        for pair in pairs {
            if let Err(pair) = cell.context.splice.resume(pair) {
                log::error!(
                    "orca_relay_handover_pair_dropped host={}",
                    pair.relay_host_id.as_deref().unwrap_or("-")
                );
            }
        }
        Ok((count, self.header.fds))
    }
}

fn stage_kind(stage: &Stage) -> &'static str {
    match stage {
        Stage::Control { .. } => "control",
        Stage::PhoneWaiting { .. } => "phone",
        Stage::FirstFrame { path, .. } => {
            crate::relay::upgrade::route(path).map_or("control", |r| r.kind())
        }
        Stage::Upgrading { .. } => "pending",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn faults_parse_by_name() {
        for fault in [
            Fault::ExitAtStart,
            Fault::DieAfterHalf,
            Fault::RejectStateVersion,
            Fault::NeverConfirm,
            Fault::StopAfterReady,
        ] {
            assert_eq!(Fault::parse(fault.as_str()), Some(fault));
        }
        assert_eq!(Fault::parse("other"), None);
    }
}
