//! The data plane: the `acceptor` thread and one `relay-<id>` thread per WebSocket connection.
//!
//! The acceptor takes a connection unit against the cap, then hands the TCP stream to a new
//! relay thread; the upgrade (head deadline, routing, token check at upgrade) and everything
//! after it happen on that thread, so a slow client never delays the acceptor. Over the cap,
//! a short-lived rejection thread answers 503 with `Retry-After: 2` (bounded: past that bound
//! the connection is dropped at once).
//!
//! A panic in a relay thread is caught at the top of the thread: it costs that connection a
//! close (4429), never the process.

pub mod control;
pub mod data;
pub mod frames;
pub mod phone;
pub mod socket;
pub mod upgrade;

use std::net::{TcpListener, TcpStream};
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicU8, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::auth::Verifier;
use crate::cell::bookings::Bookings;
use crate::cell::mode::CellMode;
use crate::cell::seats::{SeatLog, DEFAULT_RING_CAPACITY};
use crate::cell::state::{CellState, ConnectionSlots, Peer, SlotGuard};
use crate::clock::SharedClock;
use crate::config::Timings;
use crate::metrics::{Counter, Gauge, Registry};
use crate::protocol::CloseCode;
use crate::store::Store;
use socket::{Reaper, Socket};
use upgrade::Route;

impl Peer for Socket {
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
    /// Throttles the log lines of failed admission SQL across every relay thread.
    pub admission_failures: Arc<crate::logging::SharedThrottle>,
    next_id: Arc<AtomicU64>,
    rejecting: Arc<AtomicU32>,
}

/// At most this many threads answer over-cap connections with 503 at once; past it the
/// connection is dropped without an answer.
const MAX_REJECTION_THREADS: u32 = 64;

impl RelayContext {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        cell_id: &str,
        incarnation: i64,
        timings: Timings,
        connection_cap: u32,
        verifier: Verifier,
        store: Store,
        clock: SharedClock,
        reaper: Reaper,
        phase: Arc<Phase>,
        registry: &Registry,
    ) -> Self {
        let slots = ConnectionSlots::new(connection_cap);
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
            admission_failures: Arc::default(),
            next_id: Arc::new(AtomicU64::new(1)),
            rejecting: Arc::new(AtomicU32::new(0)),
        }
    }

    /// Closes `socket` with `code` and counts it.
    pub fn close(&self, socket: &Arc<Socket>, code: CloseCode, reason: &str) {
        if socket.close(code, reason, &self.reaper) {
            self.metrics.close(code);
        }
    }
}

/// The `acceptor` thread body: accepts until `stop` is set (the listener is unblocked by a
/// connection from the shutdown path).
pub fn run_acceptor(listener: TcpListener, context: RelayContext, stop: Arc<AtomicBool>) {
    for stream in listener.incoming() {
        if stop.load(Ordering::Acquire) {
            break;
        }
        let stream = match stream {
            Ok(stream) => stream,
            Err(e) => {
                // EMFILE and friends: back off briefly instead of spinning.
                log::warn!("orca_relay_accept_failed error={e}");
                crate::clock::sleep(Duration::from_millis(50));
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        let id = context.next_id.fetch_add(1, Ordering::Relaxed);
        if context.phase.get() != Phase::SERVING {
            let reason = if context.phase.get() == Phase::STARTING {
                "starting"
            } else {
                "draining"
            };
            reject_in_background(&context, stream, reason);
            continue;
        }
        let Some(slot) = context.slots.try_take() else {
            reject_in_background(&context, stream, "connection_cap");
            continue;
        };
        let thread_context = context.clone();
        let spawned = crate::threads::spawn_with_stack(
            format!("relay-{id}"),
            crate::threads::RELAY_STACK_BYTES,
            move || serve_connection(thread_context, stream, id, slot),
        );
        if let Err(e) = spawned {
            // The slot and stream were moved into the closure and are dropped with it.
            log::warn!("orca_relay_thread_spawn_failed error={e}");
        }
    }
}

fn reject_in_background(context: &RelayContext, stream: TcpStream, reason: &'static str) {
    if context.rejecting.fetch_add(1, Ordering::AcqRel) >= MAX_REJECTION_THREADS {
        context.rejecting.fetch_sub(1, Ordering::AcqRel);
        return;
    }
    let rejecting = context.rejecting.clone();
    let metrics = context.metrics.clone();
    let spawned = crate::threads::spawn_with_stack("reject", 64 * 1024, move || {
        let _ = upgrade::read_head(&stream, Duration::from_secs(1));
        metrics.upgrade_refused(503, reason);
        upgrade::refuse(&stream, 503, reason, Some(2));
        rejecting.fetch_sub(1, Ordering::AcqRel);
    });
    if spawned.is_err() {
        context.rejecting.fetch_sub(1, Ordering::AcqRel);
    }
}

/// One connection, from upgrade to close. The slot is released when this returns.
fn serve_connection(context: RelayContext, stream: TcpStream, id: u64, slot: SlotGuard) {
    let request = match upgrade::read_head(&stream, upgrade::UPGRADE_DEADLINE) {
        Ok(request) => request,
        Err(_) => return,
    };
    let Some(route) = upgrade::route(&request.path) else {
        context.metrics.upgrade_refused(404, "unknown_path");
        upgrade::refuse(&stream, 404, "not_found", None);
        return;
    };
    let Some(key) = request.key.clone().filter(|_| request.is_websocket) else {
        context.metrics.upgrade_refused(426, "not_websocket");
        upgrade::refuse(&stream, 426, "websocket_upgrade_required", None);
        return;
    };
    // The desktop's token is checked before the upgrade: a bad token never gets a socket.
    let claims = if route == Route::Control {
        let verified = crate::auth::parse_bearer(request.authorization.as_deref())
            .and_then(|token| context.verifier.verify_host_token(token));
        match verified {
            Ok(claims) => Some(claims),
            Err(e) => {
                context.metrics.upgrade_refused(401, e.reason_code());
                upgrade::refuse(&stream, 401, "bad_outer_credential", None);
                return;
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
            context.metrics.upgrade_refused(503, "pool_pressure");
            upgrade::refuse(&stream, 503, "pool_pressure", Some(2));
            return;
        }
    }
    if upgrade::accept(&stream, &key).is_err() {
        return;
    }
    let _ = stream.set_write_timeout(Some(Duration::from_millis(context.timings.wedge_ms)));
    // Control sockets read small JSON through tungstenite; splice legs forward frames as they
    // are through their own reader (relay/frames.rs).
    let (socket, leg) = match &route {
        Route::Control => {
            let (socket, reader) = Socket::new_control(id, stream, request.tail);
            (socket, Leg::Control(reader))
        }
        _ => {
            let (socket, reader) = Socket::new_splice(id, stream, request.tail);
            (socket, Leg::Splice(reader))
        }
    };
    let gauge = context.metrics.connections(route.kind());
    gauge.inc();
    let outcome = std::panic::catch_unwind(AssertUnwindSafe(|| match (route.clone(), leg) {
        (Route::Control, Leg::Control(reader)) => control::serve(
            &context,
            socket.clone(),
            reader,
            claims.expect("checked above"),
        ),
        (Route::Phone { relay_host_id }, Leg::Splice(reader)) => {
            phone::serve(&context, socket.clone(), reader, &relay_host_id)
        }
        (Route::DataLeg { conn_id }, Leg::Splice(reader)) => {
            data::serve(&context, socket.clone(), reader, &conn_id)
        }
        _ => context.close(&socket, CloseCode::LimitExceeded, "internal error"),
    }));
    if outcome.is_err() {
        log::error!(
            "orca_relay_connection_panicked conn={id} kind={}",
            route.kind()
        );
        context.close(&socket, CloseCode::LimitExceeded, "internal error");
    }
    gauge.dec();
    // Make sure the peer is gone before the slot is returned.
    if !socket.is_closing() {
        context.close(&socket, CloseCode::Normal, "");
    }
    drop(slot);
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

/// The reader a connection gets, by endpoint.
enum Leg {
    Control(socket::Reader),
    Splice(frames::SpliceReader),
}

/// Reads the first frame of a splice leg within the first-frame deadline: it must be one
/// whole text frame.
pub(crate) fn read_first_splice_text(
    context: &RelayContext,
    reader: &mut frames::SpliceReader,
) -> Result<String, CloseCode> {
    reader.set_read_timeout(Some(Duration::from_millis(context.timings.first_frame_ms)));
    match reader.read() {
        frames::SpliceEvent::Frame {
            data: tungstenite::protocol::frame::coding::Data::Text,
            fin: true,
            payload,
        } => String::from_utf8(payload.to_vec()).map_err(|_| CloseCode::BadOuterCredential),
        frames::SpliceEvent::TooBig => Err(CloseCode::TooBig),
        _ => Err(CloseCode::BadOuterCredential),
    }
}

/// Reads the first frame of a control socket within the first-frame deadline: it must be a
/// text frame.
pub(crate) fn read_first_text(
    context: &RelayContext,
    reader: &mut socket::Reader,
) -> Result<String, CloseCode> {
    let _ = reader
        .socket()
        .stream()
        .set_read_timeout(Some(Duration::from_millis(context.timings.first_frame_ms)));
    match reader.read() {
        socket::ReadEvent::Message(tungstenite::Message::Text(text)) => Ok(text.to_string()),
        socket::ReadEvent::TooBig => Err(CloseCode::TooBig),
        _ => Err(CloseCode::BadOuterCredential),
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
