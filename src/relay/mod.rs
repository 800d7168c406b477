//! The data plane: the `acceptor` thread and one `relay-<id>` thread per WebSocket connection.
//!
//! The acceptor only accepts: it admits each connection into the table of **pending upgrades**
//! (`ORCA_RELAY_PENDING_UPGRADES_MAX`, apart from the connection cap) and hands it to a new relay
//! thread. The upgrade happens on that thread: the head within 5 s of acceptance, the phase,
//! the route, the token, pool pressure, and only then a unit of the **connection cap**, so the
//! cap counts admitted sockets only. Every refusal (404, 426, 401, 503) goes through
//! [`refuse_upgrade`]: counted, answered, handed to the reaper, and everything the connection
//! held is released as the thread returns.
//!
//! When the pending table is full, the socket that has waited longest for its head is shed (closed
//! without an answer, counted) to admit the new one: whoever holds pending entries without
//! finishing a head cannot lock desktops out, and answering needs the head, which is the very
//! thing the shed socket has not sent. When every pending socket is past its head (being
//! authenticated), the newcomer is dropped at once, counted; desktops retry with backoff.
//!
//! A panic in a relay thread is caught at the top of the thread: it costs that connection a
//! close (4429), never the process.

pub mod control;
pub mod control_reader;
pub mod data;
pub mod frames;
pub mod park;
pub mod phone;
pub mod socket;
pub mod splice;
pub mod splice_reader;
pub mod upgrade;

use std::net::{TcpListener, TcpStream};
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::auth::Verifier;
use crate::cell::bookings::Bookings;
use crate::cell::mode::CellMode;
use crate::cell::seats::{SeatLog, DEFAULT_RING_CAPACITY};
use crate::cell::state::{CellState, ConnectionSlots, Peer, SlotGuard};
use crate::clock::SharedClock;
use crate::config::Timings;
use crate::http::table::{Admission, ConnectionTable, Ticket};
use crate::metrics::{Counter, Gauge, Registry};
use crate::protocol::CloseCode;
use crate::store::Store;
use crate::threads::Permits;
use control_reader::{ControlFrames, Deadline};
use park::{Gate, Parked, ParkedConn, Quiesce, ReaderRecord, Stage, Wake};
use socket::{Reaper, Socket};
use splice_reader::{SpliceEvent, SpliceReader};
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
    /// Sockets between accept and admission (or refusal).
    pub pending: Arc<ConnectionTable>,
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
            "Pending upgrades (head not yet complete) closed to admit a newer connection.",
            &[],
        );
        let pending = ConnectionTable::new(pending_upgrades_max as usize);
        {
            let pending = pending.clone();
            registry.sampled_gauge(
                "orca_relay_ws_pending_upgrades",
                "WebSocket connections accepted and not yet admitted or refused.",
                move || vec![(Vec::new(), pending.len() as f64)],
            );
        }
        RelayContext {
            cell_id: cell_id.into(),
            incarnation,
            timings: Arc::new(timings),
            cell: Arc::new(CellState::new(clock.clone())),
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
            pending,
            splice,
            thread_permits,
            admission_failures: Arc::default(),
            quiesce,
            next_id: Arc::new(AtomicU64::new(1)),
        }
    }

    /// The id the next connection gets (a handover carries it, so ids stay unique).
    pub fn next_connection_id(&self) -> u64 {
        self.next_id.load(Ordering::Relaxed)
    }

    /// Ids from `next` on (a received handover: above every carried connection's).
    pub fn continue_ids_from(&self, next: u64) {
        self.next_id.fetch_max(next, Ordering::Relaxed);
    }

    /// Closes `socket` with `code` and counts it.
    pub fn close(&self, socket: &Arc<Socket>, code: CloseCode, reason: &str) {
        if socket.close(code, reason, &self.reaper) {
            self.metrics.close(code);
        }
    }
}

/// The `acceptor` thread body: accepts until `stop` is set, then gives the listener back (a
/// live handover passes it on, or starts a new acceptor on it). It never reads from a
/// connection, and a connection it accepted is always served: stopping never drops one (during
/// a handover, new connections wait in the listener's backlog for whichever process accepts
/// next).
pub fn run_acceptor(listener: TcpListener, context: RelayContext, stop: Arc<Wake>) -> TcpListener {
    let _ = crate::http::server::raise_backlog(&listener);
    // Waits go through `poll` beside the stop's eventfd; the accept itself never blocks.
    let _ = listener.set_nonblocking(true);
    // One descriptor kept in reserve: when the process is out of descriptors (EMFILE, ENFILE)
    // it is given up for a moment so that the waiting connection can be accepted, answered
    // 503 and closed, instead of staying in the backlog until the client gives up.
    let mut spare = open_spare();
    // Resource exhaustion is logged once per run of failures.
    let mut accept_failing = false;
    let mut spawn_failing = false;
    loop {
        if !park::wait_acceptable(&listener, &stop) {
            break;
        }
        let stream = match listener.accept() {
            Ok((stream, _)) => stream,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
            Err(e) if crate::http::server::accept_error_is_per_connection(&e) => continue,
            Err(e) => {
                if !accept_failing {
                    log::warn!("orca_relay_accept_failed error={e}");
                    accept_failing = true;
                }
                if out_of_descriptors(&e) && spare.take().is_some() {
                    if let Ok((stream, _)) = listener.accept() {
                        let _ = stream.set_nonblocking(false);
                        refuse_at_accept(&context, stream, "descriptors");
                    }
                    spare = open_spare();
                    continue;
                }
                // Anything else: back off briefly instead of spinning.
                crate::clock::sleep(Duration::from_millis(50));
                continue;
            }
        };
        let _ = stream.set_nonblocking(false);
        if accept_failing {
            log::info!("orca_relay_accept_recovered");
            accept_failing = false;
        }
        if spare.is_none() {
            spare = open_spare();
        }
        let accepted = crate::clock::instant();
        let _ = stream.set_nodelay(true);
        // A relay thread only with a permit: the thread capacity is never reached by a spawn.
        let Some(permit) = context.thread_permits.try_take() else {
            refuse_at_accept(&context, stream, "threads");
            continue;
        };
        let stream = Arc::new(stream);
        let ticket = match context.pending.admit(&stream) {
            Admission::Admitted { ticket, shed } => {
                if shed {
                    context.metrics.pending_shed();
                }
                ticket
            }
            Admission::Full => {
                context.metrics.dropped_at_accept("pending_upgrades_full");
                continue;
            }
        };
        let id = context.next_id.fetch_add(1, Ordering::Relaxed);
        let thread_context = context.clone();
        let spawned = crate::threads::spawn_with_stack(
            format!("relay-{id}"),
            crate::threads::RELAY_STACK_BYTES,
            move || {
                let _permit = permit;
                serve_connection(thread_context, stream, ticket, id, accepted)
            },
        );
        match spawned {
            Ok(_) => spawn_failing = false,
            Err(e) => {
                // The stream and its pending entry were moved into the closure and dropped.
                context.metrics.dropped_at_accept("thread_spawn");
                if !spawn_failing {
                    log::warn!("orca_relay_thread_spawn_failed error={e}");
                    spawn_failing = true;
                }
            }
        }
    }
    let _ = listener.set_nonblocking(false);
    listener
}

fn open_spare() -> Option<std::fs::File> {
    std::fs::File::open("/dev/null").ok()
}

fn out_of_descriptors(error: &std::io::Error) -> bool {
    matches!(
        error.raw_os_error(),
        Some(libc::EMFILE) | Some(libc::ENFILE)
    )
}

/// Refuses a connection on the acceptor itself, before any head is read: a thread or a
/// descriptor could not be had. 503 with `Retry-After: 2`, counted; the answer fits the empty
/// socket buffer of a new connection, so the write does not wait.
fn refuse_at_accept(context: &RelayContext, stream: TcpStream, reason: &str) {
    context.metrics.upgrade_refused(503, reason);
    let stream = Arc::new(stream);
    let _ = stream.set_nonblocking(true);
    let _ = std::io::Write::write(
        &mut &*stream,
        upgrade::refusal(503, reason, Some(2)).as_bytes(),
    );
    let _ = stream.shutdown(std::net::Shutdown::Write);
    context
        .reaper
        .schedule_stream(stream, upgrade::REFUSAL_LINGER);
}

/// One way an upgrade is refused: the status, the reason counted in
/// `orca_relay_upgrades_refused_total`, the `error` of the answer, and `Retry-After`.
struct Refusal<'a> {
    status: u16,
    reason: &'a str,
    answer: &'a str,
    retry_after_s: Option<u32>,
}

impl<'a> Refusal<'a> {
    /// 503 with `Retry-After: 2`, the reason as the answer.
    fn unavailable(reason: &'a str) -> Self {
        Refusal {
            status: 503,
            reason,
            answer: reason,
            retry_after_s: Some(2),
        }
    }
}

/// Refuses an upgrade: counted, answered, our side closed, and the socket handed to the reaper,
/// which drops it [`upgrade::REFUSAL_LINGER`] later whatever the client sends. The caller
/// returns at once, releasing its pending entry (and any unit). Every refusal of the WebSocket
/// port after accept goes through here.
fn refuse_upgrade(context: &RelayContext, stream: Arc<TcpStream>, refusal: Refusal<'_>) {
    context
        .metrics
        .upgrade_refused(refusal.status, refusal.reason);
    upgrade::refuse(
        &stream,
        refusal.status,
        refusal.answer,
        refusal.retry_after_s,
    );
    context
        .reaper
        .schedule_stream(stream, upgrade::REFUSAL_LINGER);
}

/// One connection, from upgrade to close. The pending entry is released once the connection is
/// admitted or refused; the connection unit, taken only at admission, when this returns.
fn serve_connection(
    context: RelayContext,
    stream: Arc<TcpStream>,
    pending: Ticket,
    id: u64,
    accepted: Instant,
) {
    upgrade_from(
        context,
        stream,
        pending,
        id,
        Vec::new(),
        accepted + upgrade::UPGRADE_DEADLINE,
    )
}

/// How reading an upgrade head ended.
enum HeadRead {
    Request(upgrade::UpgradeRequest),
    /// A handover quiesced the cell: what had arrived of the head.
    Quiesce(Vec<u8>),
    /// Timed out, closed, malformed: the connection is dropped.
    Failed,
}

/// Reads the upgrade head by `deadline`, starting with what had already arrived (`received`),
/// parking at a handover's quiesce.
fn read_upgrade_head(
    context: &RelayContext,
    stream: &TcpStream,
    mut received: Vec<u8>,
    deadline: Instant,
) -> HeadRead {
    use std::io::Read;
    loop {
        match upgrade::parse_head(&received) {
            Ok(Some(request)) => return HeadRead::Request(request),
            Ok(None) => {}
            Err(_) => return HeadRead::Failed,
        }
        if received.len() >= crate::http::head::MAX_HEAD_BYTES {
            return HeadRead::Failed;
        }
        match park::wait_readable(stream, Some(deadline), &context.quiesce) {
            park::Waited::Readable => {}
            park::Waited::TimedOut => return HeadRead::Failed,
            park::Waited::Quiesce => return HeadRead::Quiesce(received),
        }
        let mut chunk = [0u8; 1024];
        let room = (crate::http::head::MAX_HEAD_BYTES - received.len()).min(chunk.len());
        match (&*stream).read(&mut chunk[..room]) {
            Ok(0) => return HeadRead::Failed,
            Ok(n) => received.extend_from_slice(&chunk[..n]),
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::Interrupted | std::io::ErrorKind::WouldBlock
                ) => {}
            Err(_) => return HeadRead::Failed,
        }
    }
}

/// The upgrade, from the head (what of it had arrived: `received`) to admission, then the
/// connection's life.
fn upgrade_from(
    context: RelayContext,
    stream: Arc<TcpStream>,
    pending: Ticket,
    id: u64,
    received: Vec<u8>,
    deadline: Instant,
) {
    let request = match read_upgrade_head(&context, &stream, received, deadline) {
        HeadRead::Request(request) => request,
        HeadRead::Quiesce(received) => {
            let parked = Parked {
                id,
                conn: ParkedConn::Upgrading { stream, pending },
                stage: Stage::Upgrading { received, deadline },
                hold: None,
                place: None,
            };
            return deposit(&context, parked);
        }
        HeadRead::Failed => return,
    };
    if !pending.hold() {
        // Shed while its head arrived: already shut down.
        return;
    }
    match context.phase.get() {
        Phase::SERVING => {}
        Phase::STARTING => {
            return refuse_upgrade(&context, stream, Refusal::unavailable("starting"))
        }
        _ => return refuse_upgrade(&context, stream, Refusal::unavailable("draining")),
    }
    let Some(route) = upgrade::route(&request.path) else {
        let refusal = Refusal {
            status: 404,
            reason: "unknown_path",
            answer: "not_found",
            retry_after_s: None,
        };
        return refuse_upgrade(&context, stream, refusal);
    };
    let Some(key) = request.key.clone().filter(|_| request.is_websocket) else {
        let refusal = Refusal {
            status: 426,
            reason: "not_websocket",
            answer: "websocket_upgrade_required",
            retry_after_s: None,
        };
        return refuse_upgrade(&context, stream, refusal);
    };
    // The desktop's token is checked before the upgrade: a bad token never gets a socket.
    let claims = if route == Route::Control {
        let verified = crate::auth::parse_bearer(request.authorization.as_deref())
            .and_then(|token| context.verifier.verify_host_token(token));
        match verified {
            Ok(claims) => Some(claims),
            Err(e) => {
                let refusal = Refusal {
                    status: 401,
                    reason: e.reason_code(),
                    answer: "bad_outer_credential",
                    retry_after_s: None,
                };
                return refuse_upgrade(&context, stream, refusal);
            }
        }
    } else {
        None
    };
    if let Some(claims) = &claims {
        // Under pool pressure, a hello the cell cannot admit without the database (memory or
        // a booking) is shed rather than queued behind the pool (SPEC §5.3).
        let shed = shed_under_pool_pressure(
            context.store.has_waiters(),
            context.mode.raw_is_reserve(),
            || {
                context.cell.remembers(&claims.relay_host_id)
                    || context.bookings.holds(
                        &claims.user_id,
                        &claims.relay_host_id,
                        context.clock.now_ms(),
                    )
            },
        );
        if shed {
            return refuse_upgrade(&context, stream, Refusal::unavailable("pool_pressure"));
        }
    }
    // Admitted: the connection cap counts from here on.
    let Some(slot) = context.slots.try_take() else {
        return refuse_upgrade(&context, stream, Refusal::unavailable("connection_cap"));
    };
    drop(pending);
    let Ok(stream) = Arc::try_unwrap(stream) else {
        // Only a shed entry keeps a second handle, and a shed socket never gets this far.
        return;
    };
    if upgrade::accept(&stream, &key).is_err() {
        return;
    }
    let _ = stream.set_write_timeout(Some(Duration::from_millis(context.timings.wedge_ms)));
    let socket = Socket::new_control(id, stream);
    let gauge = context.metrics.connections(route.kind());
    gauge.inc();
    // The unit and the gauge travel with a splice leg to its worker; a control keeps them here.
    let hold = Some(ConnectionHold { _slot: slot, gauge });
    let first_frame = clock_deadline(context.timings.first_frame_ms);
    let reader = ReaderRecord {
        buffered: request.tail,
        ..ReaderRecord::default()
    };
    let stage = Stage::FirstFrame {
        path: request.path,
        claims: claims.as_ref().map(park::ClaimsRecord::from),
        reader,
        text: None,
        deadline: first_frame,
    };
    serve_stage(&context, socket, stage, hold, None, None);
}

/// Deposits a connection with the handover; one the handover no longer takes (it ended while
/// this thread was on its way) goes on, on a new thread.
fn deposit(context: &RelayContext, parked: Parked) {
    if let Some(parked) = context.quiesce.deposit(parked) {
        let id = parked.id;
        if let Err(e) = resume(context, parked, None) {
            log::error!("orca_relay_resume_failed conn={id} error={e}");
        }
    }
}

fn clock_deadline(ms: u64) -> Instant {
    crate::clock::instant() + Duration::from_millis(ms)
}

/// An admitted connection from `stage` on: its first frame, a seated control's read loop, a
/// phone waiting for its data leg. A panic costs this connection a close (4429); a handover's
/// quiesce deposits it with everything it holds.
fn serve_stage(
    context: &RelayContext,
    socket: Arc<Socket>,
    stage: Stage,
    hold: Option<ConnectionHold>,
    place: Option<phone::PhonePlace>,
    waiting: Option<phone::Waiting>,
) {
    let id = socket.id;
    let kind = stage_kind(&stage);
    let mut hold = hold;
    let outcome = std::panic::catch_unwind(AssertUnwindSafe(|| {
        run_stage(context, socket.clone(), stage, &mut hold, place, waiting)
    }));
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
            Some(Route::Phone { relay_host_id }) => {
                let reader = SpliceReader::from_record(
                    socket.clone(),
                    reader,
                    crate::protocol::SPLICE_MAX_FRAME_BYTES,
                    context.quiesce.clone(),
                );
                phone::serve(
                    context,
                    socket,
                    reader,
                    &relay_host_id,
                    hold,
                    phone::First {
                        path,
                        text,
                        deadline,
                    },
                )
            }
            Some(Route::DataLeg { conn_id }) => {
                let reader = SpliceReader::from_record(
                    socket.clone(),
                    reader,
                    crate::protocol::SPLICE_MAX_FRAME_BYTES,
                    context.quiesce.clone(),
                );
                data::serve(
                    context,
                    socket,
                    reader,
                    &conn_id,
                    hold,
                    data::First {
                        path,
                        text,
                        deadline,
                    },
                )
            }
            None => {
                context.close(&socket, CloseCode::LimitExceeded, "internal error");
                Served::Ended
            }
        },
        Stage::Control {
            control,
            reader,
            silence_deadline,
        } => {
            let reader = control_reader::Reader::resume(
                socket.clone(),
                reader,
                context.quiesce.clone(),
                silence_deadline,
                Duration::from_millis(context.timings.silence_ms),
            );
            control::resume(context, socket, reader, control)
        }
        Stage::PhoneWaiting {
            phone,
            reader,
            attach_deadline,
        } => {
            let reader = SpliceReader::from_record(
                socket.clone(),
                reader,
                crate::protocol::SPLICE_MAX_FRAME_BYTES,
                context.quiesce.clone(),
            );
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
            match (conn, stage) {
                (
                    ParkedConn::Upgrading { stream, pending },
                    Stage::Upgrading { received, deadline },
                ) => upgrade_from(thread_context, stream, pending, id, received, deadline),
                (ParkedConn::Socket(socket), stage) => {
                    serve_stage(&thread_context, socket, stage, hold, place, waiting)
                }
                (ParkedConn::Upgrading { .. }, _) => {}
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

/// Reads the first frame of a splice leg by `deadline`: it must be one whole text frame.
pub(crate) fn read_first_splice_text(reader: &mut SpliceReader, deadline: Instant) -> FirstFrame {
    match reader.read(deadline) {
        SpliceEvent::Frame {
            data: tungstenite::protocol::frame::coding::Data::Text,
            fin: true,
            payload,
        } => match String::from_utf8(payload.to_vec()) {
            Ok(text) => FirstFrame::Text(text),
            Err(_) => FirstFrame::Refused(CloseCode::BadOuterCredential),
        },
        SpliceEvent::Violation(violation) => {
            FirstFrame::Refused(splice_reader::violation_close_code(violation))
        }
        SpliceEvent::Quiesce => FirstFrame::Quiesce,
        _ => FirstFrame::Refused(CloseCode::BadOuterCredential),
    }
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
