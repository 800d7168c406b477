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
pub mod data;
pub mod frames;
pub mod pending;
pub mod phone;
pub mod socket;
pub mod splice;
pub mod splice_reader;
pub mod upgrade;

use std::net::{TcpListener, TcpStream};
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::auth::{HostClaims, Verifier};
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
use socket::{Reaper, Socket};

impl Peer for Socket {
    type Attached = splice::LegHandOff;
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
}

/// The `acceptor` thread body: the pending plane (`pending.rs`) until `stop` is set (the
/// listener is woken by a connection from the shutdown path).
pub fn run_acceptor(listener: TcpListener, context: RelayContext, stop: Arc<AtomicBool>) {
    pending::run(listener, context, stop)
}

/// Starts the relay thread of an authenticated desktop control (its 101 is written): it reads
/// the hello, is admitted (SPEC §5.3) and serves the control until it closes. The unit and the
/// permit are released as the thread ends.
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
            // Control sockets read small JSON through tungstenite.
            let (socket, reader) = Socket::new_control(id, stream, tail);
            let hold = ConnectionHold::new(unit, context.metrics.connections("control"));
            run_guarded(&context, &socket, "control", Some(hold), |_| {
                control::serve(&context, socket.clone(), reader, claims);
                Served::Ended
            });
        },
    )
    .map(|_| ())
}

/// Runs a relay thread's body under `catch_unwind`: a panic costs the connection a 4429 and is
/// logged. Unless the body handed the socket on, the socket is closed before its unit (in
/// `hold`) is returned.
fn run_guarded(
    context: &RelayContext,
    socket: &Arc<Socket>,
    kind: &str,
    hold: Option<ConnectionHold>,
    body: impl FnOnce(&mut Option<ConnectionHold>) -> Served,
) {
    let mut hold = hold;
    let outcome = std::panic::catch_unwind(AssertUnwindSafe(|| body(&mut hold)));
    match outcome {
        Ok(Served::HandedOff) => return,
        Ok(Served::Ended) => {}
        Err(_) => {
            log::error!(
                "orca_relay_connection_panicked conn={} kind={kind}",
                socket.id
            );
            context.close(socket, CloseCode::LimitExceeded, "internal error");
        }
    }
    // Make sure the peer is gone before the unit is returned.
    if !socket.is_closing() {
        context.close(socket, CloseCode::Normal, "");
    }
    drop(hold);
}

/// How a connection's relay thread ended.
pub enum Served {
    /// The connection is closed (or closing); its unit is returned as the thread ends.
    Ended,
    /// The socket went to a splice worker with its unit; nothing more to do here.
    HandedOff,
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

/// Reads the first frame of a control socket by the first-frame deadline (one instant from
/// the upgrade, whatever arrives before it): it must be a text frame.
pub(crate) fn read_first_text(
    context: &RelayContext,
    reader: &mut socket::Reader,
) -> Result<String, CloseCode> {
    let deadline = crate::clock::instant() + Duration::from_millis(context.timings.first_frame_ms);
    reader.set_deadline(Some(deadline));
    let event = reader.read();
    reader.set_deadline(None);
    match event {
        socket::ReadEvent::Message(tungstenite::Message::Text(text)) => Ok(text.to_string()),
        socket::ReadEvent::TooBig => Err(CloseCode::TooBig),
        socket::ReadEvent::Protocol => Err(CloseCode::ProtocolError),
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
