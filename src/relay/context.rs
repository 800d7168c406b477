//! [`RelayContext`], everything a relay thread, the pending plane and the cell-wide relay
//! threads share (cheap to clone: handles and `Arc`s), and the process's [`Phase`].

use std::sync::atomic::{AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::Arc;

use super::hold::ConnectionHold;
use super::metrics::RelayMetrics;
use super::park::Quiesce;
use super::socket::{Reaper, Socket};
use super::splice;
use crate::auth::Verifier;
use crate::carry::connection::ControlRecord;
use crate::carry::crash::{CrashKind, IO_HOLDING};
use crate::cell::bookings::Bookings;
use crate::cell::mode::CellMode;
use crate::cell::seats::{SeatLog, DEFAULT_RING_CAPACITY};
use crate::cell::state::{CellState, ConnectionSlots};
use crate::clock::SharedClock;
use crate::config::Timings;
use crate::crash_store::CrashStore;
use crate::metrics::Registry;
use crate::protocol::CloseCode;
use crate::store::Store;
use crate::threads::Permits;

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
    /// Sockets between accept and their credential (or refusal), now, at most
    /// (`ORCA_RELAY_PENDING_UPGRADES_MAX`), and at most from one source address
    /// (`ORCA_RELAY_PENDING_PER_SOURCE_MAX`): the acceptor's table (`pending.rs`).
    pub pending_now: Arc<AtomicUsize>,
    pub pending_upgrades_max: usize,
    pub pending_per_source_max: usize,
    /// The event-loop workers attached pairs are handed to.
    pub splice: Arc<splice::SplicePlane>,
    /// Relay threads at most at once: the process's threaded capacity.
    pub thread_permits: Arc<Permits>,
    /// Throttles the log lines of failed admission SQL across every relay thread.
    pub admission_failures: Arc<crate::logging::SharedThrottle>,
    /// A live handover's hold on the relay threads (`relay/park.rs`).
    pub quiesce: Arc<Quiesce>,
    /// The crash store, under a service manager that keeps descriptors (`crash_store`).
    pub crash: Option<Arc<CrashStore>>,
    /// The process's critical threads and its pause clock (`liveness.rs`).
    pub liveness: crate::liveness::Liveness,
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
        pending_per_source_max: u32,
        verifier: Verifier,
        store: Store,
        clock: SharedClock,
        reaper: Reaper,
        phase: Arc<Phase>,
        registry: &Registry,
        splice: Arc<splice::SplicePlane>,
        thread_permits: Arc<Permits>,
        quiesce: Arc<Quiesce>,
        liveness: crate::liveness::Liveness,
    ) -> Self {
        let slots = ConnectionSlots::new(connection_cap);
        for reason in [
            "pending_upgrades_full",
            "pending_source_full",
            "thread_spawn",
            "descriptors",
        ] {
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
            pending_per_source_max: pending_per_source_max as usize,
            splice,
            thread_permits,
            admission_failures: Arc::default(),
            quiesce,
            crash: None,
            liveness,
            next_id: Arc::new(AtomicU64::new(1)),
        }
    }

    /// How a control's silence is judged across this process's own pause: a fresh ping and
    /// one ping period to answer it after the pause, at most the silence window.
    pub fn silence_guard(&self) -> super::control_reader::SilenceGuard {
        super::control_reader::SilenceGuard {
            pauses: self.liveness.pauses(),
            resume_grace: std::time::Duration::from_millis(
                crate::pause_clock::control_resume_grace_ms(
                    self.timings.ping_ms,
                    self.timings.silence_ms,
                ),
            ),
            buffers: self.splice.buffers().clone(),
        }
    }

    /// Closes `socket` with `code` and counts it.
    pub fn close(&self, socket: &Arc<Socket>, code: CloseCode, reason: &str) {
        if socket.close(code, reason, &self.reaper) {
            self.metrics.close(code);
        }
    }

    /// Keeps an admitted connection in the crash store (when there is one): its record in a
    /// slot, its descriptor in the service manager's store. `holding`: not resumable yet (a leg
    /// on its way to being spliced).
    pub fn keep(
        &self,
        socket: &Socket,
        kind: CrashKind,
        control: Option<ControlRecord>,
        host: Option<&str>,
        holding: bool,
    ) {
        self.keep_as(socket, kind, control, host, holding, false)
    }

    /// [`RelayContext::keep`] for a connection whose descriptor the store holds already (a live
    /// handover carried it): only its record is written (this process's memory; nothing is
    /// sent).
    pub fn keep_carried(
        &self,
        socket: &Socket,
        kind: CrashKind,
        control: Option<ControlRecord>,
        host: Option<&str>,
        holding: bool,
    ) {
        self.keep_as(socket, kind, control, host, holding, true)
    }

    fn keep_as(
        &self,
        socket: &Socket,
        kind: CrashKind,
        control: Option<ControlRecord>,
        host: Option<&str>,
        holding: bool,
        stored: bool,
    ) {
        let Some(store) = &self.crash else {
            return;
        };
        let mut record = crate::crash_store::record_of(kind, socket.id, socket.stream());
        record.control = control;
        record.relay_host_id = host.map(str::to_string);
        if let Some(slot) = store.keep(socket.stream(), record, stored) {
            if holding {
                slot.set(IO_HOLDING);
            }
            socket.keep(slot);
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

    /// The unit and gauge of a connection a live handover brought: the unit is taken even
    /// past the cap (the connection exists already).
    pub fn carried_hold(&self, kind: &str) -> ConnectionHold {
        ConnectionHold::new(self.slots.take_forced(), self.metrics.connections(kind))
    }

    /// Ids from `next` on (a received handover: above every carried connection's).
    pub fn continue_ids_from(&self, next: u64) {
        self.next_id.fetch_max(next, Ordering::Relaxed);
    }
}
