//! The data plane: the `acceptor` thread (the pending plane), one `relay-<id>` thread per
//! authenticated control and phone until its pair is spliced, and the splice workers.
//!
//! Every connection is **pending** from its accept until its credential is checked, whatever
//! its path (SPEC §12): it lives in the acceptor's table (`pending.rs`,
//! `ORCA_RELAY_PENDING_UPGRADES_MAX`, the oldest shed first when full) with one absolute
//! deadline, and holds no unit of the **connection cap**, no relay thread and no phone place. A
//! desktop's credential is its token (in the head); a phone's and a data leg's is their first
//! frame (an invite, a ticket), read by the acceptor too. Only an authenticated connection takes
//! a unit (and, for a control or a phone, a thread permit and its relay thread), so the cap
//! counts admitted sockets only and nobody without a credential can hold a desktop's place.
//! Every refusal is counted and answered: an HTTP status before the upgrade, a close code after.
//!
//! A panic in a relay thread is caught at the top of the thread: it costs that connection a
//! close (4429), never the process.

pub mod control;
pub mod control_reader;
pub mod data;
pub mod frames;
pub mod park;
pub mod pending;
pub mod phone;
pub mod socket;
pub mod splice;
pub mod splice_reader;
pub mod upgrade;

use std::net::{TcpListener, TcpStream};
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::auth::{HostClaims, Verifier};
use crate::carry::connection::{ClaimsRecord, ReaderRecord};
use crate::cell::bookings::Bookings;
use crate::cell::mode::CellMode;
use crate::cell::seats::{SeatLog, DEFAULT_RING_CAPACITY};
use crate::cell::state::{CellState, ConnectionSlots, Peer, SlotGuard};
use crate::clock::SharedClock;
use crate::config::Timings;
use crate::metrics::{Counter, Gauge, Registry};
use crate::protocol::CloseCode;
use crate::store::Store;
use crate::threads::{Permit, Permits};
use control_reader::{ControlFrames, Deadline};
use park::{Gate, Parked, ParkedConn, Quiesce, Stage, Wake};
use socket::{Reaper, Socket};
use upgrade::Route;

impl Peer for Socket {
    type Attached = phone::Attach;
    fn id(&self) -> u64 {
        self.id
    }
}

/// Where the process is in its life; the acceptor and `/ready` read it.
#[derive(Default)]
pub struct Phase(AtomicU8);

impl Phase {
    pub const STARTING: u8 = 0;
    pub const SERVING: u8 = 1;
    pub const DRAINING: u8 = 2;

    pub fn get(&self) -> u8 {
        self.0.load(Ordering::Acquire)
    }
    pub fn set(&self, phase: u8) {
        self.0.store(phase, Ordering::Release)
    }
}

/// Counters of the data plane (SPEC §5.6).
#[derive(Clone)]
pub struct RelayMetrics {
    registry: Registry,
    pub bytes_phone_to_host: Counter,
    pub bytes_host_to_phone: Counter,
    pub frames_phone_to_host: Counter,
    pub frames_host_to_phone: Counter,
}

impl RelayMetrics {
    pub fn new(registry: &Registry) -> Self {
        let bytes = |direction| {
            registry.counter(
                "orca_relay_splice_bytes_total",
                "Bytes spliced, by direction.",
                &[("direction", direction)],
            )
        };
        let frames = |direction| {
            registry.counter(
                "orca_relay_splice_frames_total",
                "Frames spliced, by direction.",
                &[("direction", direction)],
            )
        };
        for code in CloseCode::ALL {
            registry.counter(
                "orca_relay_closes_total",
                "WebSocket closes sent, by code.",
                &[("code", &code.code().to_string())],
            );
        }
        for path in ["booking", "memory", "database"] {
            registry.counter(
                "orca_relay_admission_sql_statements_total",
                "SQL statements run while admitting hellos, by admission path.",
                &[("path", path)],
            );
        }
        // Every admission series exists from the start, so a scraper sees the family at zero.
        for (path, outcome) in [
            ("booking", "admitted"),
            ("memory", "admitted"),
            ("database", "admitted"),
            ("database", "wrong_cell"),
            ("database", "error"),
        ] {
            registry.counter(
                "orca_relay_admissions_total",
                "Desktop hellos by admission path and outcome.",
                &[("path", path), ("outcome", outcome)],
            );
        }
        for kind in ["control", "phone", "data"] {
            registry.gauge(
                "orca_relay_connections",
                "Open WebSocket connections, by kind.",
                &[("kind", kind)],
            );
        }
        RelayMetrics {
            registry: registry.clone(),
            bytes_phone_to_host: bytes("phone_to_host"),
            bytes_host_to_phone: bytes("host_to_phone"),
            frames_phone_to_host: frames("phone_to_host"),
            frames_host_to_phone: frames("host_to_phone"),
        }
    }

    pub fn close(&self, code: CloseCode) {
        self.registry
            .counter(
                "orca_relay_closes_total",
                "WebSocket closes sent, by code.",
                &[("code", &code.code().to_string())],
            )
            .inc();
    }

    pub fn connections(&self, kind: &str) -> Gauge {
        self.registry.gauge(
            "orca_relay_connections",
            "Open WebSocket connections, by kind.",
            &[("kind", kind)],
        )
    }

    /// A pending upgrade shed to admit a newer one, or a connection dropped at accept.
    pub fn pending_shed(&self) {
        self.registry
            .counter(
                "orca_relay_ws_pending_upgrades_shed_total",
                "Pending upgrades (head not yet complete) closed to admit a newer connection.",
                &[],
            )
            .inc();
    }

    pub fn dropped_at_accept(&self, reason: &str) {
        self.registry
            .counter(
                "orca_relay_ws_connections_dropped_total",
                "WebSocket connections closed at accept without an answer, by reason.",
                &[("reason", reason)],
            )
            .inc();
    }

    /// An attached pair no splice worker could take (closed 4429).
    pub fn splice_refused(&self, reason: &str) {
        self.registry
            .counter(
                "orca_relay_splice_refused_total",
                "Attached pairs no splice worker could take (both legs closed 4429), by reason.",
                &[("reason", reason)],
            )
            .inc();
    }

    pub fn upgrade_refused(&self, status: u16, reason: &str) {
        self.registry
            .counter(
                "orca_relay_upgrades_refused_total",
                "Upgrades refused with an HTTP status, by status and reason.",
                &[("status", &status.to_string()), ("reason", reason)],
            )
            .inc();
    }

    /// SQL statements run while admitting hellos, by admission path: memory and booking
    /// admissions must stay at zero (SPEC §5.3).
    pub fn admission_statements(&self, path: &str, statements: u64) {
        self.registry
            .counter(
                "orca_relay_admission_sql_statements_total",
                "SQL statements run while admitting hellos, by admission path.",
                &[("path", path)],
            )
            .add(statements);
    }

    pub fn admission(&self, path: &str, outcome: &str) {
        self.registry
            .counter(
                "orca_relay_admissions_total",
                "Desktop hellos by admission path and outcome.",
                &[("path", path), ("outcome", outcome)],
            )
            .inc();
    }
}

/// Everything a relay thread needs; cheap to clone.
#[derive(Clone)]
pub struct RelayContext {
    pub cell_id: Arc<str>,
    pub incarnation: i64,
    pub timings: Arc<Timings>,
    pub cell: Arc<CellState<Socket>>,
    pub verifier: Verifier,
    pub store: Store,
    pub clock: SharedClock,
    pub reaper: Reaper,
    pub slots: Arc<ConnectionSlots>,
    pub phase: Arc<Phase>,
    pub metrics: RelayMetrics,
    /// Reserve-mode admission: the director's bookings, the seat log (feed and memory), and
    /// the mode the watchdog publishes.
    pub bookings: Arc<Bookings>,
    pub seats: Arc<SeatLog>,
    pub mode: Arc<CellMode>,
    /// Sockets between accept and their credential (or refusal), now, and at most
    /// (`ORCA_RELAY_PENDING_UPGRADES_MAX`): the acceptor's table (`pending.rs`).
    pub pending_now: Arc<AtomicUsize>,
    pub pending_upgrades_max: usize,
    /// The event-loop workers attached pairs are handed to.
    pub splice: Arc<splice::SplicePlane>,
    /// Relay threads at most at once: the process's threaded capacity.
    pub thread_permits: Arc<Permits>,
    /// Throttles the log lines of failed admission SQL across every relay thread.
    pub admission_failures: Arc<crate::logging::SharedThrottle>,
    /// A live handover's hold on the relay threads (`relay/park.rs`).
    pub quiesce: Arc<Quiesce>,
    next_id: Arc<AtomicU64>,
}

impl RelayContext {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        cell_id: &str,
        incarnation: i64,
        timings: Timings,
        connection_cap: u32,
        pending_upgrades_max: u32,
        verifier: Verifier,
        store: Store,
        clock: SharedClock,
        reaper: Reaper,
        phase: Arc<Phase>,
        registry: &Registry,
        splice: Arc<splice::SplicePlane>,
        thread_permits: Arc<Permits>,
        quiesce: Arc<Quiesce>,
    ) -> Self {
        let slots = ConnectionSlots::new(connection_cap);
        for reason in ["pending_upgrades_full", "thread_spawn", "descriptors"] {
            registry.counter(
                "orca_relay_ws_connections_dropped_total",
                "WebSocket connections closed at accept without an answer, by reason.",
                &[("reason", reason)],
            );
        }
        for reason in ["threads", "descriptors", "connection_cap"] {
            registry.counter(
                "orca_relay_upgrades_refused_total",
                "Upgrades refused with an HTTP status, by status and reason.",
                &[("status", "503"), ("reason", reason)],
            );
        }
        registry.counter(
            "orca_relay_splice_refused_total",
            "Attached pairs no splice worker could take (both legs closed 4429), by reason.",
            &[("reason", "no_worker")],
        );
        {
            let permits = thread_permits.clone();
            registry.sampled_gauge(
                "orca_relay_relay_threads",
                "Relay threads (one per connection until it is spliced), and the most allowed.",
                move || {
                    vec![
                        (
                            vec![("state".to_string(), "running".to_string())],
                            permits.used() as f64,
                        ),
                        (
                            vec![("state".to_string(), "max".to_string())],
                            permits.max() as f64,
                        ),
                    ]
                },
            );
        }
        {
            let splice = splice.clone();
            registry.sampled_gauge(
                "orca_relay_splice_legs",
                "Spliced legs held by each splice worker.",
                move || {
                    splice
                        .legs_per_worker()
                        .into_iter()
                        .enumerate()
                        .map(|(index, legs)| {
                            (vec![("worker".to_string(), index.to_string())], legs as f64)
                        })
                        .collect()
                },
            );
        }
        registry.counter(
            "orca_relay_ws_pending_upgrades_shed_total",
            "Pending connections (no credential checked yet) closed to admit a newer one.",
            &[],
        );
        let pending_now = Arc::new(AtomicUsize::new(0));
        {
            let pending = pending_now.clone();
            registry.sampled_gauge(
                "orca_relay_ws_pending_upgrades",
                "WebSocket connections accepted whose credential is not checked yet.",
                move || vec![(Vec::new(), pending.load(Ordering::Acquire) as f64)],
            );
        }
        let cell = Arc::new(CellState::new(clock.clone()));
        {
            let cell = cell.clone();
            registry.sampled_gauge(
                "orca_relay_invites_outstanding",
                "Invites minted and not yet used up, expired or dropped (at most 8 per desktop).",
                move || vec![(Vec::new(), cell.invite_count() as f64)],
            );
        }
        RelayContext {
            cell_id: cell_id.into(),
            incarnation,
            timings: Arc::new(timings),
            cell,
            verifier,
            store,
            clock,
            reaper,
            bookings: Arc::new(Bookings::new(slots.clone())),
            seats: Arc::new(SeatLog::new(incarnation, DEFAULT_RING_CAPACITY)),
            mode: Arc::new(CellMode::new()),
            slots,
            phase,
            metrics: RelayMetrics::new(registry),
            pending_now,
            pending_upgrades_max: pending_upgrades_max as usize,
            splice,
            thread_permits,
            admission_failures: Arc::default(),
            quiesce,
            next_id: Arc::new(AtomicU64::new(1)),
        }
    }

    /// Closes `socket` with `code` and counts it.
    pub fn close(&self, socket: &Arc<Socket>, code: CloseCode, reason: &str) {
        if socket.close(code, reason, &self.reaper) {
            self.metrics.close(code);
        }
    }

    /// A new connection id (the `relay-<id>` thread's name, the socket's id).
    pub fn next_connection_id(&self) -> u64 {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }

    /// The id the next connection will get (a handover carries it, so ids stay unique).
    pub fn peek_next_connection_id(&self) -> u64 {
        self.next_id.load(Ordering::Relaxed)
    }

    /// Ids from `next` on (a received handover: above every carried connection's).
    pub fn continue_ids_from(&self, next: u64) {
        self.next_id.fetch_max(next, Ordering::Relaxed);
    }
}

/// The `acceptor` thread body: the pending plane (`pending.rs`), starting with connections a
/// handover carried (`carried`), until `stop` is set; then the listener and every pending
/// connection are given back, as they were (a handover passes them on; a drain closes them,
/// [`pending::close_parked`]).
pub fn run_acceptor(
    listener: TcpListener,
    context: RelayContext,
    stop: Arc<Wake>,
    carried: Vec<Parked>,
) -> (TcpListener, Vec<Parked>) {
    pending::run(listener, context, stop, carried)
}

/// Starts the relay thread of an authenticated desktop control (its 101 is written): it reads
/// the hello, is admitted (SPEC §5.3) and serves the control until it closes (or a handover
/// parks it). The unit and the permit are released as the thread ends.
fn spawn_control(
    context: &RelayContext,
    id: u64,
    stream: TcpStream,
    tail: Vec<u8>,
    claims: HostClaims,
    unit: SlotGuard,
    permit: Permit,
) -> std::io::Result<()> {
    let context = context.clone();
    crate::threads::spawn_with_stack(
        format!("relay-{id}"),
        crate::threads::RELAY_STACK_BYTES,
        move || {
            let _permit = permit;
            let _ = stream.set_nonblocking(false);
            let _ = stream.set_write_timeout(Some(Duration::from_millis(context.timings.wedge_ms)));
            let socket = Socket::new_control(id, stream);
            let hold = ConnectionHold::new(unit, context.metrics.connections("control"));
            let stage = Stage::FirstFrame {
                path: "/v1/host/control".into(),
                claims: Some(ClaimsRecord::from(&claims)),
                reader: ReaderRecord {
                    buffered: tail,
                    ..ReaderRecord::default()
                },
                text: None,
                deadline: clock_deadline(context.timings.first_frame_ms),
            };
            serve_stage(&context, socket, stage, Some(hold), None, None);
        },
    )
    .map(|_| ())
}

/// Deposits a connection with the handover; one the handover no longer takes (it ended while
/// this thread was on its way) goes on, on a new thread.
fn deposit(context: &RelayContext, parked: Parked) {
    match context.quiesce.deposit(parked) {
        // Taken: this thread waits for the handover's end, then ends.
        None => context.quiesce.hold(),
        Some(parked) => {
            let id = parked.id;
            if let Err(e) = resume(context, parked, None) {
                log::error!("orca_relay_resume_failed conn={id} error={e}");
            }
        }
    }
}

fn clock_deadline(ms: u64) -> Instant {
    crate::clock::instant() + Duration::from_millis(ms)
}

/// An admitted connection from `stage` on: its first frame, a seated control's read loop, a
/// phone waiting for its data leg.
fn serve_stage(
    context: &RelayContext,
    socket: Arc<Socket>,
    stage: Stage,
    hold: Option<ConnectionHold>,
    place: Option<phone::PhonePlace>,
    waiting: Option<phone::Waiting>,
) {
    let kind = stage_kind(&stage);
    serve_admitted(context, socket, kind, hold, |socket, hold| {
        run_stage(context, socket, stage, hold, place, waiting)
    });
}

/// Runs an admitted connection's relay-thread body under `catch_unwind`: a panic costs the
/// connection a 4429 and is logged; a handover's quiesce deposits it with everything it holds.
/// Unless the body handed the socket on (or parked it), the socket is closed before its unit
/// (in `hold`) is returned.
pub(crate) fn serve_admitted(
    context: &RelayContext,
    socket: Arc<Socket>,
    kind: &str,
    hold: Option<ConnectionHold>,
    body: impl FnOnce(Arc<Socket>, &mut Option<ConnectionHold>) -> Served,
) {
    let id = socket.id;
    let mut hold = hold;
    let outcome = std::panic::catch_unwind(AssertUnwindSafe(|| body(socket.clone(), &mut hold)));
    match outcome {
        Ok(Served::HandedOff) => return,
        Ok(Served::Parked { stage, place }) => {
            let parked = Parked {
                id,
                conn: ParkedConn::Socket(socket),
                stage: *stage,
                hold,
                place,
            };
            return deposit(context, parked);
        }
        Ok(Served::Ended) => {}
        Err(_) => {
            log::error!("orca_relay_connection_panicked conn={id} kind={kind}");
            context.close(&socket, CloseCode::LimitExceeded, "internal error");
        }
    }
    // Make sure the peer is gone before the unit is returned.
    if !socket.is_closing() {
        context.close(&socket, CloseCode::Normal, "");
    }
    drop(hold);
}

fn stage_kind(stage: &Stage) -> &'static str {
    match stage {
        Stage::Upgrading { .. } => "upgrading",
        Stage::FirstFrame { path, .. } => upgrade::route(path).map_or("unknown", |r| r.kind()),
        Stage::Control { .. } => "control",
        Stage::PhoneWaiting { .. } => "phone",
    }
}

fn run_stage(
    context: &RelayContext,
    socket: Arc<Socket>,
    stage: Stage,
    hold: &mut Option<ConnectionHold>,
    place: Option<phone::PhonePlace>,
    waiting: Option<phone::Waiting>,
) -> Served {
    match stage {
        Stage::FirstFrame {
            path,
            claims,
            reader,
            text,
            deadline,
        } => match upgrade::route(&path) {
            Some(Route::Control) => {
                let Some(claims) = claims else {
                    context.close(&socket, CloseCode::LimitExceeded, "internal error");
                    return Served::Ended;
                };
                let reader = control_reader::Reader::new(
                    socket.clone(),
                    ControlFrames::from_record(reader),
                    context.quiesce.clone(),
                );
                control::serve(
                    context,
                    socket,
                    reader,
                    (&claims).into(),
                    control::First {
                        path,
                        text,
                        deadline,
                    },
                )
            }
            // A splice leg's first frame is read by the acceptor's pending loop, never here.
            Some(Route::Phone { .. } | Route::DataLeg { .. }) | None => {
                context.close(&socket, CloseCode::LimitExceeded, "internal error");
                Served::Ended
            }
        },
        Stage::Control {
            control,
            reader,
            silence_deadline,
            invites,
        } => {
            let reader = control_reader::Reader::resume(
                socket.clone(),
                reader,
                context.quiesce.clone(),
                silence_deadline,
                Duration::from_millis(context.timings.silence_ms),
            );
            control::resume(context, socket, reader, control, invites)
        }
        Stage::PhoneWaiting {
            phone,
            reader,
            attach_deadline,
        } => {
            let waiting =
                waiting.unwrap_or_else(|| phone::restore_waiting(context, &socket, &phone));
            phone::resume_waiting(
                context,
                socket,
                reader,
                hold,
                place,
                (phone, waiting),
                attach_deadline,
            )
        }
        Stage::Upgrading { .. } => {
            context.close(&socket, CloseCode::LimitExceeded, "internal error");
            Served::Ended
        }
    }
}

/// Resumes a deposited connection on a new relay thread: in this process after a failed
/// handover, or in the next one (which holds each thread at `gate` until the handover has
/// committed). A resumed connection always gets its thread: the permit is taken even past the
/// bound, since the connection exists already. `Err` when no thread could be started.
pub fn resume(
    context: &RelayContext,
    parked: Parked,
    gate: Option<Arc<Gate>>,
) -> std::io::Result<()> {
    let permit = context.thread_permits.take_forced();
    let thread_context = context.clone();
    let id = parked.id;
    // A waiting phone's pending entry is put back now, before any other resumed connection
    // runs: a data leg resumed beside it must find the entry with a live channel.
    let waiting = match (&parked.conn, &parked.stage) {
        (ParkedConn::Socket(socket), Stage::PhoneWaiting { phone, .. }) => {
            Some(phone::restore_waiting(context, socket, phone))
        }
        _ => None,
    };
    crate::threads::spawn_with_stack(
        format!("relay-{id}"),
        crate::threads::RELAY_STACK_BYTES,
        move || {
            let _permit = permit;
            if let Some(gate) = gate {
                if !gate.wait() {
                    // The handover did not commit: this process touches nothing and exits.
                    return;
                }
            }
            let Parked {
                id,
                conn,
                stage,
                hold,
                place,
            } = parked;
            match conn {
                ParkedConn::Socket(socket) => {
                    serve_stage(&thread_context, socket, stage, hold, place, waiting)
                }
                // A pending connection belongs to the acceptor's loop (`pending::run`).
                ParkedConn::Pending(stream) => {
                    log::error!("orca_relay_resume_misrouted conn={id}");
                    drop(stream);
                }
            }
        },
    )
    .map(|_| ())
}

/// How a connection's relay thread ended.
pub enum Served {
    /// The connection is closed (or closing); its unit is returned as the thread ends.
    Ended,
    /// The socket went to a splice worker with its unit; nothing more to do here.
    HandedOff,
    /// A handover quiesced the cell at `stage`: the connection is deposited with its unit (and
    /// a phone's place) for whoever resumes it.
    Parked {
        stage: Box<Stage>,
        place: Option<phone::PhonePlace>,
    },
}

impl Served {
    pub fn parked(stage: Stage) -> Served {
        Served::Parked {
            stage: Box::new(stage),
            place: None,
        }
    }
}

/// A connection's unit of the cap and its place in the connections gauge, released together
/// when dropped: at the end of the relay thread, or of the splice leg it was handed to.
pub struct ConnectionHold {
    _slot: SlotGuard,
    gauge: Gauge,
}

impl ConnectionHold {
    /// Counts the connection in `gauge` until dropped.
    pub fn new(slot: SlotGuard, gauge: Gauge) -> ConnectionHold {
        gauge.inc();
        ConnectionHold { _slot: slot, gauge }
    }

    /// The unit and gauge of a connection a live handover brought: the unit is taken even
    /// past the cap (the connection exists already).
    pub fn carried(context: &RelayContext, kind: &str) -> ConnectionHold {
        let gauge = context.metrics.connections(kind);
        gauge.inc();
        ConnectionHold {
            _slot: context.slots.take_forced(),
            gauge,
        }
    }
}

impl Drop for ConnectionHold {
    fn drop(&mut self) {
        self.gauge.dec();
    }
}

/// Whether a desktop's control upgrade is shed with 503 under database pool pressure (SPEC
/// §5.3): only a hello the cell may admit without the database (from memory or a booking) gets
/// past waiters, and only a cell whose raw mode is `reserve` admits that way. In `db` mode every
/// hello needs the database, so a remembered desktop would only queue behind the pool like any
/// other. `admissible_without_sql` is asked only under pressure.
pub fn shed_under_pool_pressure(
    pool_has_waiters: bool,
    raw_reserve: bool,
    admissible_without_sql: impl FnOnce() -> bool,
) -> bool {
    pool_has_waiters && !(raw_reserve && admissible_without_sql())
}

/// How reading a splice leg's or a control's first frame ended.
pub(crate) enum FirstFrame {
    Text(String),
    /// Refused with this code (late, not text, malformed, a rule broken).
    Refused(CloseCode),
    /// A handover quiesced the cell.
    Quiesce,
}

/// Reads the first frame of a control socket by `deadline`: it must be a text frame.
pub(crate) fn read_first_text(
    reader: &mut control_reader::Reader,
    deadline: Instant,
) -> FirstFrame {
    use control_reader::ReadEvent;
    match reader.read(Deadline::At(deadline)) {
        ReadEvent::Message(tungstenite::Message::Text(text)) => FirstFrame::Text(text.to_string()),
        ReadEvent::TooBig => FirstFrame::Refused(CloseCode::TooBig),
        ReadEvent::Protocol => FirstFrame::Refused(CloseCode::ProtocolError),
        ReadEvent::Quiesce => FirstFrame::Quiesce,
        _ => FirstFrame::Refused(CloseCode::BadOuterCredential),
    }
}

#[cfg(test)]
mod tests {
    use super::shed_under_pool_pressure;

    #[test]
    fn only_a_reserve_cell_lets_remembered_desktops_past_pool_waiters() {
        // (waiters, raw reserve, remembered) -> shed
        let cases = [
            ((false, true, true), false),
            ((false, false, false), false),
            ((true, true, true), false),
            ((true, true, false), true),
            ((true, false, true), true),
            ((true, false, false), true),
        ];
        for ((waiters, reserve, remembered), shed) in cases {
            assert_eq!(
                shed_under_pool_pressure(waiters, reserve, || remembered),
                shed,
                "waiters={waiters} reserve={reserve} remembered={remembered}"
            );
        }
    }
}
