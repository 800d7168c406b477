//! Wiring of a cell: the part shared by the `cell` and `combined` roles.
//!
//! [`CellRuntime::start`] builds the cell's shared state and starts its named threads:
//! `acceptor`, `pinger`, `lease-renewer`, `reaper`, `switch-watcher`, `watchdog`,
//! `claim-loop`; [`CellRuntime::serve`] starts `heartbeat` once the startup registration has
//! succeeded; relay threads come and go with connections, and a trip starts `reregister`. [`CellRuntime::route`] serves the cell's HTTP endpoints (`/internal/*`).
//! [`CellRuntime::drain`] runs the SIGTERM sequence: the watchdog stops before the final
//! admit-effective write, the claim loop ends after carrying it out, the other threads are
//! joined in reverse start order, and the cell deregisters from its directors.

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use tungstenite::Message;

use crate::auth::Verifier;
use crate::cell::contact::Contact;
use crate::cell::heartbeat::{self, Heartbeat, Sink};
use crate::cell::internal_api::{CellStatus, InternalApi, InternalApiParts};
use crate::cell::mode::DeadManView;
use crate::cell::status_report::{self, PoolReport, ReportFn, StatusReport};
use crate::cell::switch::{run_switch_watcher, AdmitMode};
use crate::clock::SharedClock;
use crate::config::Config;
use crate::dead_man::claim_loop::{self, StoreRow};
use crate::dead_man::reregister::Reregistration;
use crate::dead_man::watchdog::Watchdog;
use crate::dead_man::writer::WriterHandle;
use crate::http::{Reply, Request};
use crate::lifecycle::{Shutdown, ShutdownState};
use crate::metrics::Registry;
use crate::protocol::{self, CloseCode, RelayToHost};
use crate::readiness::{self, Readiness};
use crate::relay::socket::{Reaper, Socket};
use crate::relay::splice::{SplicePlane, SpliceTimings};
use crate::relay::{self, Phase, RelayContext};
use crate::store::Store;
use crate::threads;

use super::{service_tokens, RunError};

/// How often a drain waiting out its grace looks whether every desktop has left.
const DRAIN_RECHECK: Duration = Duration::from_millis(100);

/// Everything a cell needs from its role.
pub struct CellSetup<'a> {
    pub config: &'a Config,
    pub clock: SharedClock,
    pub registry: Registry,
    pub store: Store,
    pub verifier: Verifier,
    pub readiness: Readiness,
    pub ws_listener: TcpListener,
    pub cell_url: String,
    /// Where directors reach this cell's `/internal/*` (sent in heartbeats).
    pub internal_url: String,
    pub incarnation: i64,
    /// Where heartbeats go: the directors over HTTP, or the store in the combined role.
    pub heartbeat: Sink,
}

struct Stoppable {
    name: &'static str,
    stop: Sender<()>,
    handle: threads::Watched<()>,
}

impl Stoppable {
    /// Tells the thread to stop and joins it, or leaves it to end with the process if it is
    /// still inside a database call after [`super::FINAL_WRITE_WAIT`] (a drain's exit never
    /// waits on a database that stopped answering).
    fn stop_and_join(self) {
        drop(self.stop);
        self.handle.join_within(self.name, super::FINAL_WRITE_WAIT);
    }
}

/// A running cell.
pub struct CellRuntime {
    pub context: RelayContext,
    pub contact: Contact,
    internal: Option<InternalApi>,
    ws_addr: SocketAddr,
    acceptor_stop: Arc<AtomicBool>,
    acceptor: Mutex<Option<JoinHandle<()>>>,
    threads: Mutex<Vec<Stoppable>>,
    reaper: Mutex<Option<JoinHandle<()>>>,
    writer: Mutex<Option<WriterHandle>>,
    readiness: Readiness,
    /// Starts the `heartbeat` thread; taken by [`CellRuntime::serve`].
    heartbeat: Mutex<Option<PendingHeartbeat>>,
    reregister_stop: Arc<AtomicBool>,
    drain_grace: Duration,
    /// Where the clean exit's deregistration goes (the heartbeat's directors, or the store).
    deregistration: Sink,
}

type PendingHeartbeat = Box<dyn FnOnce() -> Result<Stoppable, RunError> + Send>;

fn spawn_stoppable(
    name: &'static str,
    body: impl FnOnce(mpsc::Receiver<()>) + Send + 'static,
) -> Result<Stoppable, RunError> {
    let (stop, receiver) = mpsc::channel();
    let handle = threads::spawn_watched(name, move || body(receiver))
        .map_err(|e| RunError(format!("cannot start the {name} thread: {e}")))?;
    Ok(Stoppable { name, stop, handle })
}

impl CellRuntime {
    /// Builds the cell and starts its threads. The acceptor answers 503 until
    /// [`CellRuntime::serve`] is called (after the startup handshake).
    pub fn start(setup: CellSetup<'_>) -> Result<CellRuntime, RunError> {
        let config = setup.config;
        let clock = setup.clock.clone();
        let ws_addr = setup
            .ws_listener
            .local_addr()
            .map_err(|e| RunError(format!("cannot read the WebSocket listener address: {e}")))?;
        let (reaper, reaper_handle) = Reaper::start()
            .map_err(|e| RunError(format!("cannot start the reaper thread: {e}")))?;
        let splice = SplicePlane::start(
            config.splice_workers as usize,
            SpliceTimings::new(
                config.timings.wedge_ms,
                relay::socket::CLOSE_LINGER.as_millis() as u64,
                config.splice_idle_ms,
            ),
            clock.clone(),
            relay::RelayMetrics::new(&setup.registry),
        )
        .map_err(|e| RunError(format!("cannot start the splice workers: {e}")))?;
        let (connection_cap, relay_threads) = plan_capacity(config, &setup.registry);
        let context = RelayContext::new(
            &config.cell_id,
            setup.incarnation,
            config.timings.clone(),
            connection_cap,
            config.pending_upgrades_max,
            setup.verifier.clone(),
            setup.store.clone(),
            clock.clone(),
            reaper,
            Arc::new(Phase::default()),
            &setup.registry,
            splice.clone(),
            threads::Permits::new(relay_threads),
        );
        register_cell_metrics(&setup.registry, &setup.store, &context);
        setup
            .store
            .set_pool_ceiling(if config.pool_reserve_max < config.pool_max {
                // Until the watchdog's first tick says otherwise, assume the tighter bound.
                config.pool_reserve_max
            } else {
                config.pool_max
            });

        let acceptor_stop = Arc::new(AtomicBool::new(false));
        let acceptor = {
            let context = context.clone();
            let stop = acceptor_stop.clone();
            let listener = setup.ws_listener;
            threads::spawn("acceptor", move || {
                relay::run_acceptor(listener, context, stop)
            })
            .map_err(|e| RunError(format!("cannot start the acceptor thread: {e}")))?
        };

        let mut started = Vec::new();
        {
            let context = context.clone();
            started.push(spawn_stoppable("pinger", move |stop| {
                relay::control::run_pinger(context, stop)
            })?);
        }
        {
            let context = context.clone();
            started.push(spawn_stoppable("lease-renewer", move |stop| {
                relay::control::run_lease_renewer(context, stop)
            })?);
        }
        {
            let mode = context.mode.clone();
            let path = config.switch_file.clone();
            let cell_id = config.cell_id.clone();
            let period = Duration::from_millis(config.timings.switch_poll_ms);
            started.push(spawn_stoppable("switch-watcher", move |stop| {
                run_switch_watcher(
                    &path,
                    &cell_id,
                    period,
                    |switch| mode.set_switch(switch),
                    stop,
                )
            })?);
        }

        // The claim loop owns the admit-effective writer; the watchdog talks to it by channel.
        let (writer, inbox) = WriterHandle::channel();
        let (answers_tx, answers_rx) = mpsc::channel();
        let row = StoreRow {
            store: setup.store.clone(),
            cell_id: config.cell_id.clone(),
            incarnation: setup.incarnation,
            stale_ms: config.timings.trip_slot_stale_ms,
            mode: context.mode.clone(),
            registry: setup.registry.clone(),
        };
        let claim_timings = config.timings.clone();
        let claim_clock = clock.clone();
        let claim_loop = threads::spawn_watched("claim-loop", move || {
            claim_loop::run(row, &claim_timings, inbox, claim_clock, answers_tx)
        })
        .map_err(|e| RunError(format!("cannot start the claim-loop thread: {e}")))?;

        let contact = Contact::new();
        let reregister_stop = Arc::new(AtomicBool::new(false));
        let on_trip = {
            let context = context.clone();
            let stop = reregister_stop.clone();
            Box::new(move || start_reregistration(&context, stop.clone()))
        };
        {
            let watchdog = Watchdog {
                cell_id: config.cell_id.clone(),
                timings: config.timings.clone(),
                clock: clock.clone(),
                mode: context.mode.clone(),
                contact: contact.clone(),
                bookings: context.bookings.clone(),
                writer: writer.clone(),
                answers: answers_rx,
                store: setup.store.clone(),
                pool_max: config.pool_max,
                pool_reserve_max: config.pool_reserve_max,
                on_trip,
                registry: setup.registry.clone(),
            };
            started.push(spawn_stoppable("watchdog", move |stop| watchdog.run(stop))?);
        }
        // The claim loop ends when the watchdog drops its writer handle; it is joined last.
        let claim_loop_stop = mpsc::channel().0;
        started.insert(
            0,
            Stoppable {
                name: "claim-loop",
                stop: claim_loop_stop,
                handle: claim_loop,
            },
        );

        // The heartbeat starts with [`CellRuntime::serve`]: until the startup registration has
        // succeeded a director has no row for this incarnation to beat against (SPEC §8: until
        // then nothing but the registration goes out).
        // What the feed and the heartbeat report of this cell (`fleet status`).
        let report = report_fn(&context, &contact, &setup.readiness, &setup.store, &clock);
        let heartbeat: PendingHeartbeat = {
            let sample = heartbeat_sampler(
                config,
                &context,
                &setup.readiness,
                (&setup.cell_url, &setup.internal_url),
                (&clock, &report),
            );
            let sink = setup.heartbeat.clone();
            let period = Duration::from_millis(config.timings.heartbeat_ms);
            let clock = clock.clone();
            Box::new(move || {
                spawn_stoppable("heartbeat", move |stop| {
                    heartbeat::run(sink, period, sample, clock, stop)
                })
            })
        };

        let internal = config.service_token.clone().map(|service_tokens| {
            InternalApi::new(
                InternalApiParts {
                    service_tokens,
                    cell_id: config.cell_id.clone(),
                    bookings: context.bookings.clone(),
                    seats: context.seats.clone(),
                    contact: contact.clone(),
                    status: status_fn(&context),
                    report: report.clone(),
                    clock: clock.clone(),
                },
                &setup.registry,
            )
        });

        Ok(CellRuntime {
            context,
            contact,
            internal,
            ws_addr,
            acceptor_stop,
            acceptor: Mutex::new(Some(acceptor)),
            threads: Mutex::new(started),
            reaper: Mutex::new(Some(reaper_handle)),
            writer: Mutex::new(Some(writer)),
            readiness: setup.readiness,
            heartbeat: Mutex::new(Some(heartbeat)),
            reregister_stop,
            drain_grace: Duration::from_millis(config.drain_grace_ms),
            deregistration: setup.heartbeat,
        })
    }

    /// Opens the WebSocket listener for business (after the startup handshake) and starts
    /// the heartbeat.
    pub fn serve(&self) -> Result<(), RunError> {
        if let Some(start_heartbeat) = lock(&self.heartbeat).take() {
            let heartbeat = start_heartbeat()?;
            lock(&self.threads).push(heartbeat);
        }
        self.context.phase.set(Phase::SERVING);
        self.readiness.set_phase(readiness::Phase::Serving);
        Ok(())
    }

    pub fn ws_addr(&self) -> SocketAddr {
        self.ws_addr
    }

    /// The cell's HTTP endpoints; `None` for paths it does not own.
    pub fn route(&self, request: &mut Request<'_>) -> Option<Reply> {
        if !request.path.starts_with("/internal/") {
            return None;
        }
        if self.context.phase.get() == Phase::STARTING {
            return Some(Reply::error(503, "starting"));
        }
        match &self.internal {
            Some(internal) => internal.handle(request),
            None => Some(Reply::error(404, "not_found")),
        }
    }

    /// The SIGTERM sequence (SPEC §9): `/ready` 503 draining, stop accepting, `drain` to every
    /// desktop, wait up to the grace (or until every control has left), close the rest 4503,
    /// final admit-effective write, join the threads.
    pub fn drain(&self, shutdown: &Shutdown) {
        log::info!(
            "orca_relay_drain_started cell_id={} controls={} grace_ms={}",
            self.context.cell_id,
            self.context.cell.control_count(),
            self.drain_grace.as_millis()
        );
        self.readiness.set_phase(readiness::Phase::Draining);
        self.context.phase.set(Phase::DRAINING);
        self.context.mode.set_draining();
        self.acceptor_stop.store(true, Ordering::Release);
        let _ = TcpStream::connect(self.ws_addr);
        if let Some(acceptor) = lock(&self.acceptor).take() {
            threads::join_logged("acceptor", acceptor);
        }
        let drain = protocol::to_json(&RelayToHost::Drain {
            grace_ms: self.drain_grace.as_millis() as u64,
            recovery: "resolve-director".into(),
        });
        for control in self.context.cell.controls() {
            let _ = control.socket.try_send(Message::text(drain.clone()));
        }
        let deadline = crate::clock::instant() + self.drain_grace;
        while self.context.cell.control_count() > 0 && !shutdown.is_immediate() {
            let left = deadline.saturating_duration_since(crate::clock::instant());
            if left.is_zero() {
                break;
            }
            // Sleeps; wakes early only for a second signal, otherwise re-checks the controls
            // every 100 ms (ten wake-ups a second cost no measurable CPU).
            shutdown.wait_while_in(ShutdownState::Draining, left.min(DRAIN_RECHECK));
        }
        let remaining = self.context.cell.controls();
        for control in &remaining {
            self.context
                .close(&control.socket, CloseCode::Draining, "draining");
        }
        // Spliced pairs are closed 4503 too, and the splice workers end.
        self.context.splice.stop();
        self.reregister_stop.store(true, Ordering::Release);
        let mut stoppables: Vec<Stoppable> = lock(&self.threads).drain(..).collect();
        // The watchdog is the claim loop's only other writer: stop it before the final row
        // write, so that the drain's write is the row's last word. A watchdog tick after it
        // would write a tripped cell's `db` back, and its slot would stay taken for
        // `TRIP_SLOT_STALE_MS` after the process is gone.
        if let Some(watchdog) = take_stoppable(&mut stoppables, "watchdog") {
            watchdog.stop_and_join();
        }
        // Final row write: `reserve` when the switch says so, which frees any slot (a draining
        // cell gets no new desktops: its feed says draining), else `db`.
        let switch = self.context.mode.switch();
        if let Some(writer) = lock(&self.writer).take() {
            writer.tick(
                switch.says_reserve(),
                if switch.says_reserve() {
                    crate::dead_man::window::Mode::Reserve
                } else {
                    crate::dead_man::window::Mode::Db
                },
                false,
            );
            writer.release_slot();
            // This was the last handle: the claim loop carries out what is pending, then ends.
        }
        if let Some(claim_loop) = take_stoppable(&mut stoppables, "claim-loop") {
            // Its stop sender is a stand-in: it ends once the last writer handle is gone.
            claim_loop.stop_and_join();
        }
        for stoppable in stoppables.into_iter().rev() {
            stoppable.stop_and_join();
        }
        // The heartbeat has stopped (a beat after this would register the cell again): leave
        // the fleet, so no director polls or places on this process any more.
        heartbeat::deregister(
            &self.deregistration,
            &self.context.cell_id,
            self.context.incarnation,
        );
        log::info!(
            "orca_relay_drain_finished cell_id={} closed={}",
            self.context.cell_id,
            remaining.len()
        );
        let _ = lock(&self.reaper).take();
    }
}

/// The process's capacity at start (`capacity.rs`): logged as one line, the configured
/// connection cap lowered to the ceiling with one WARN naming the limit, gauges for
/// `/metrics`. Returns the cap in force and the relay-thread permits.
fn plan_capacity(config: &Config, registry: &Registry) -> (u32, usize) {
    let configured = config.connection_cap;
    let plan = match crate::capacity::read_limits() {
        Ok(limits) => crate::capacity::plan(&limits, capacity_needs(config)),
        Err(e) => {
            // Without the figures, the configuration is trusted: a relay thread for every
            // admitted or pending connection.
            log::warn!("orca_relay_capacity_unknown error={e}");
            let permits = configured as usize + config.pending_upgrades_max as usize;
            return (configured, permits);
        }
    };
    log::info!("orca_relay_capacity {}", plan.summary());
    if let Some(resource) = plan.lowered_by {
        log::warn!(
            "orca_relay_connection_cap_lowered configured={configured} cap={} limited_by={resource} rss_at_cap={} memory={} raise=\"{}\"",
            plan.cap,
            plan.rss_at_cap,
            plan.memory_bytes.map_or_else(|| "unknown".to_string(), |m| m.to_string()),
            resource.how_to_raise()
        );
    }
    let ceiling = plan.ceiling;
    let (rss_at_cap, memory) = (plan.rss_at_cap, plan.memory_bytes);
    registry.sampled_gauge(
        "orca_relay_capacity_rss_at_cap_bytes",
        "The RSS the process can reach at its connection cap (every connection at its memory bound).",
        move || vec![(Vec::new(), rss_at_cap as f64)],
    );
    if let Some(memory) = memory {
        registry.sampled_gauge(
            "orca_relay_capacity_memory_bytes",
            "The memory the process may use: the cgroup's memory.max, else MemTotal.",
            move || vec![(Vec::new(), memory as f64)],
        );
    }
    registry.sampled_gauge(
        "orca_relay_capacity_connections",
        "Connections the process's limits allow (descriptors; a spliced leg holds no thread).",
        move || vec![(Vec::new(), ceiling as f64)],
    );
    let cap = u32::try_from(plan.cap).unwrap_or(configured);
    let permits = usize::try_from(plan.relay_threads).unwrap_or(usize::MAX);
    (cap, permits)
}

/// What the capacity's reserve depends on in `config`.
pub fn capacity_needs(config: &Config) -> crate::capacity::Needs {
    crate::capacity::Needs {
        cpus: std::thread::available_parallelism().map_or(1, |n| n.get() as u64),
        database_pool_max: config.pool_max as u64,
        pending_upgrades_max: config.pending_upgrades_max as u64,
        http_connections_max: config.http_connections_max as u64,
        configured_cap: config.connection_cap as u64,
        memory: memory_bounds(config),
    }
}

/// A control connection's most memory: its thread's stack, and tungstenite's read buffer and
/// message for a frame of at most 1 MiB (SPEC §5.2), plus its state.
pub const CONTROL_MEMORY_BOUND_BYTES: u64 = threads::RELAY_STACK_BYTES as u64
    + 2 * crate::protocol::CONTROL_MAX_FRAME_BYTES as u64
    + 16 * 1024;

/// The process's memory beyond its connections: 64 MiB for the binary, allocator arenas, the
/// database pool and caches; each splice worker's read buffer and events; each pending upgrade
/// and HTTP connection (a thread's stack and a bounded head and body).
pub const BASE_MEMORY_BYTES: u64 = 64 * 1024 * 1024;

/// What the process can hold in memory per connection and besides (`capacity::MemoryBounds`):
/// a connection is a spliced leg or a control, whichever bound is larger.
pub fn memory_bounds(config: &Config) -> crate::capacity::MemoryBounds {
    let per_thread_connection = threads::RELAY_STACK_BYTES as u64 + 32 * 1024;
    crate::capacity::MemoryBounds {
        per_connection: relay::splice::LEG_MEMORY_BOUND_BYTES.max(CONTROL_MEMORY_BOUND_BYTES),
        base: BASE_MEMORY_BYTES
            + config.splice_workers as u64 * (relay::splice::READ_BUFFER_BYTES as u64 + 64 * 1024)
            + (config.pending_upgrades_max as u64 + config.http_connections_max as u64)
                * per_thread_connection,
    }
}

/// Removes the named thread from `stoppables`, if it is there.
fn take_stoppable(stoppables: &mut Vec<Stoppable>, name: &str) -> Option<Stoppable> {
    let at = stoppables.iter().position(|s| s.name == name)?;
    Some(stoppables.remove(at))
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|e| e.into_inner())
}

fn start_reregistration(context: &RelayContext, stop: Arc<AtomicBool>) {
    let refuse_context = context.clone();
    let job = Arc::new(Reregistration::<Socket> {
        cell: context.cell.clone(),
        store: context.store.clone(),
        cell_id: context.cell_id.to_string(),
        incarnation: context.incarnation,
        timings: (*context.timings).clone(),
        clock: context.clock.clone(),
        refuse: Arc::new(move |control| {
            refuse_context.close(&control.socket, CloseCode::WrongCell, "placement moved")
        }),
        stop,
    });
    if let Err(e) = threads::spawn("reregister", move || {
        job.run();
    }) {
        log::error!("orca_relay_reregister_spawn_failed error={e}");
    }
}

fn status_fn(context: &RelayContext) -> crate::cell::internal_api::StatusFn {
    let mode = context.mode.clone();
    let slots = context.slots.clone();
    Arc::new(move || {
        let raw = if mode.raw_is_reserve() {
            AdmitMode::Reserve
        } else {
            AdmitMode::Db
        };
        CellStatus {
            admit_mode_raw: raw,
            admit_mode_effective: if mode.effective_is_reserve() {
                AdmitMode::Reserve
            } else {
                AdmitMode::Db
            },
            reserve_mode_effective: mode.raw_is_reserve(),
            draining: mode.is_draining(),
            connections: slots.used() as u64,
        }
    })
}

/// The cell's status report (`cell::status_report`), from in-memory state only: the mode and
/// dead-man published by the watchdog and the claim loop, the last contact, the connection
/// units, the pool's counters and readiness. No SQL: the seat feed calls it on every poll.
fn report_fn(
    context: &RelayContext,
    contact: &Contact,
    readiness: &Readiness,
    store: &Store,
    clock: &SharedClock,
) -> ReportFn {
    let mode = context.mode.clone();
    let slots = context.slots.clone();
    let contact = contact.clone();
    let readiness = readiness.clone();
    let store = store.clone();
    let clock = clock.clone();
    Arc::new(move || {
        let now = clock.now_ms();
        let state = mode.dead_man();
        let window_ms = mode.window_ms();
        // The watchdog's effective contact at its last tick, or a contact since.
        let silence_started = mode.silence_started_ms().max(contact.last().unwrap_or(0));
        let switch = mode.switch();
        let pool = store.pool_stats();
        let mode_name = |reserve: bool| if reserve { "reserve" } else { "db" };
        StatusReport {
            admit_mode_raw: mode_name(mode.raw_is_reserve()).into(),
            admit_mode_effective: mode_name(mode.effective_is_reserve()).into(),
            dead_man: state.into(),
            window_ms,
            window_left_ms: status_report::window_left_ms(state, window_ms, silence_started, now),
            silent_ms: status_report::silent_ms(state, silence_started, now),
            holds_trip_slot: state == DeadManView::Tripped && !mode.effective_is_reserve(),
            trip_slots: switch.flags.dead_man_trip_slots,
            switch_generation: switch.generation,
            connections: slots.used() as u64,
            connection_cap: u64::from(slots.cap()),
            pool: PoolReport {
                in_use: pool.open.saturating_sub(pool.idle),
                ceiling: pool.ceiling,
                max: pool.max,
                waiters: pool.waiters,
            },
            ready: readiness.answer(now).status == 200,
        }
    })
}

fn heartbeat_sampler(
    config: &Config,
    context: &RelayContext,
    readiness: &Readiness,
    (cell_url, internal_url): (&str, &str),
    (clock, report): (&SharedClock, &ReportFn),
) -> impl Fn() -> Heartbeat + Send + 'static {
    let cell_id = config.cell_id.clone();
    let cell_url = cell_url.to_string();
    let internal_url = internal_url.to_string();
    let region = config.region.clone();
    let incarnation = context.incarnation;
    let readiness = readiness.clone();
    let slots = context.slots.clone();
    let clock = clock.clone();
    let report = report.clone();
    move || Heartbeat {
        v: 1,
        cell_id: cell_id.clone(),
        cell_url: cell_url.clone(),
        region: region.clone(),
        incarnation,
        started_at: incarnation,
        ready: readiness.answer(clock.now_ms()).status == 200,
        connections: slots.used() as i64,
        internal_url: Some(internal_url.clone()),
        status: Some(report()),
    }
}

/// Metrics of the cell's shared state (SPEC §5.6).
pub fn register_cell_metrics(registry: &Registry, store: &Store, context: &RelayContext) {
    claim_loop::register_metrics(registry);
    super::register_store_metrics(registry, store);
    let slots = context.slots.clone();
    registry.sampled_gauge(
        "orca_relay_connection_units",
        "Connection units (sockets and bookings) in use against the cap.",
        move || vec![(vec![], slots.used() as f64)],
    );
    let mode = context.mode.clone();
    registry.sampled_gauge(
        "orca_relay_admit_mode",
        "Admission mode: raw (SPEC 5.3) and effective (this cell's admit-effective row), 1 = reserve.",
        move || {
            vec![
                (
                    vec![("kind".to_string(), "raw".to_string())],
                    mode.raw_is_reserve() as u8 as f64,
                ),
                (
                    vec![("kind".to_string(), "effective".to_string())],
                    mode.effective_is_reserve() as u8 as f64,
                ),
            ]
        },
    );
    let mode = context.mode.clone();
    registry.sampled_gauge(
        "orca_relay_dead_man_state",
        "Dead-man state, one-hot: off, armed, held, tripped.",
        move || {
            let current = mode.dead_man();
            crate::cell::mode::DeadManView::ALL
                .iter()
                .map(|state| {
                    (
                        vec![("state".to_string(), state.as_str().to_string())],
                        (*state == current) as u8 as f64,
                    )
                })
                .collect()
        },
    );
    let bookings = context.bookings.clone();
    registry.sampled_gauge(
        "orca_relay_bookings",
        "Live bookings holding a connection unit.",
        move || vec![(vec![], bookings.len() as f64)],
    );
    let mode = context.mode.clone();
    registry.sampled_gauge(
        "orca_relay_switch_generation",
        "Generation of the applied switch file (0: none applied, the defaults).",
        move || vec![(vec![], mode.switch().generation as f64)],
    );
    let mode = context.mode.clone();
    registry.sampled_gauge(
        "orca_relay_dead_man_trip_slots",
        "deadManTripSlots in force from the applied switch; -1 when absent (no cap).",
        move || {
            let slots = mode.switch().flags.dead_man_trip_slots;
            vec![(vec![], slots.map_or(-1.0, f64::from))]
        },
    );
    // Registered here only (once per process): the cap in force, ORCA_RELAY_CONNECTION_CAP
    // lowered to what the process's limits allow (`plan_capacity`).
    let slots = context.slots.clone();
    registry.sampled_gauge(
        "orca_relay_connection_cap",
        "The connection cap in force (ORCA_RELAY_CONNECTION_CAP, lowered to the capacity): connection units this cell holds at most.",
        move || vec![(vec![], f64::from(slots.cap()))],
    );
    // The startup handshake's series exist in every cell process: the `cell` role counts its
    // run and attempts (`run` below); the combined role has no remote director, so both stay 0.
    registry.counter("orca_relay_handshake_runs_total", HANDSHAKE_RUNS_HELP, &[]);
    registry.gauge(
        "orca_relay_handshake_attempts",
        HANDSHAKE_ATTEMPTS_HELP,
        &[],
    );
}

const HANDSHAKE_RUNS_HELP: &str =
    "Startup handshakes run; 0 in the combined role, whose director is in-process.";
const HANDSHAKE_ATTEMPTS_HELP: &str =
    "Attempts the startup handshake has started; 0 in the combined role, which has none.";

/// The `cell` role: bind both listeners, register with every director under the startup
/// budget (SPEC §8), then serve until SIGTERM.
pub fn run(config: Config) -> Result<(), RunError> {
    use crate::cell::handshake::{register_with_directors_observed, Budget, RegisterRequest};
    use crate::http::{HttpServer, HttpSettings};

    let clock = crate::clock::system();
    let incarnation = crate::cell::incarnation::take(&config.data_dir, clock.now_ms());
    let registry = Registry::new();
    let shutdown = Shutdown::new();
    let signals = crate::lifecycle::install_signal_handlers(&shutdown)
        .map_err(|e| RunError(format!("cannot install signal handlers: {e}")))?;
    super::raise_fd_limit();
    let verifier = super::verifier(&config, &clock)?;
    let store = super::open_store(&config)?;
    let (migrated, migrator) = super::migrate_in_background(&store, || Ok(()))?;

    // 1. Both listeners first: /health answers while the handshake runs.
    let (ws_listener, ws_addr) = super::bind_with_addr("ORCA_RELAY_WS_ADDR", config.ws_addr)?;
    let (http_listener, http_addr) =
        super::bind_with_addr("ORCA_RELAY_HTTP_ADDR", config.http_addr)?;
    let cell_url = super::url_for_bound(&config.cell_url, "ws", config.ws_addr, ws_addr);
    let internal_url =
        super::url_for_bound(&config.internal_url, "http", config.http_addr, http_addr);

    let prober = super::start_prober(&config, &registry, &verifier, &store, &migrated, &clock)?;
    let readiness = prober.readiness.clone();
    let cell = Arc::new(CellRuntime::start(CellSetup {
        config: &config,
        clock: clock.clone(),
        registry: registry.clone(),
        store: store.clone(),
        verifier,
        readiness: readiness.clone(),
        ws_listener,
        cell_url: cell_url.clone(),
        internal_url: internal_url.clone(),
        incarnation,
        heartbeat: Sink::Directors {
            urls: config.director_urls.clone(),
            service_token: service_tokens(&config),
        },
    })?);
    let handler = {
        let process = super::ProcessRoutes {
            registry: registry.clone(),
            readiness: readiness.clone(),
            clock: clock.clone(),
            metrics_wait_for_start: true,
            ready_gate: None,
        };
        let cell = cell.clone();
        Arc::new(move |request: &mut Request<'_>| {
            cell.route(request)
                .or_else(|| process.route(request))
                .unwrap_or_else(|| Reply::error(404, "not_found"))
        })
    };
    let http = HttpServer::start(
        http_listener,
        HttpSettings::from_config(&config),
        handler,
        &registry,
    )
    .map_err(|e| RunError(format!("cannot start the HTTP listener: {e}")))?;
    log::info!(
        "orca_relay_listening role=cell cell_id={} ws={ws_addr} http={http_addr}",
        config.cell_id
    );

    // 2. Register with every director under one budget; only deadline expiry is retried.
    let budget = Budget::from_config(&config);
    let request = RegisterRequest::new(&config.cell_id, &cell_url, &config.region, incarnation)
        .with_internal_url(&internal_url);
    registry
        .counter("orca_relay_handshake_runs_total", HANDSHAKE_RUNS_HELP, &[])
        .inc();
    // Registered before the first attempt and updated as each starts, so a scrape during a
    // slow handshake shows how far it got.
    let attempts = registry.gauge(
        "orca_relay_handshake_attempts",
        HANDSHAKE_ATTEMPTS_HELP,
        &[],
    );
    let report = register_with_directors_observed(
        &config.director_urls,
        &request,
        &service_tokens(&config),
        &budget,
        clock.as_ref(),
        &crate::clock::sleep,
        &|attempt| attempts.set(i64::from(attempt)),
    );
    let report = match report {
        Ok(report) => report,
        Err(e) => {
            log::error!(
                "orca_relay_handshake_failed cell_id={} error={e}",
                config.cell_id
            );
            return Err(RunError(format!("startup handshake failed: {e}")));
        }
    };
    log::info!(
        "orca_relay_handshake_succeeded cell_id={} memberships={} attempts={} elapsed_ms={}",
        config.cell_id,
        config.director_urls.len(),
        report.attempts,
        report.elapsed_ms
    );

    // 3. Serve.
    cell.serve()?;
    crate::lifecycle::notify_ready();
    super::start_systemd_watchdog(http_addr)?;
    log::info!(
        "orca_relay_started role=cell cell_id={} ws={ws_addr} http={http_addr} cell_url={cell_url} incarnation={incarnation}",
        config.cell_id
    );
    while !shutdown.is_draining() {
        shutdown.wait_timeout(Duration::from_secs(3600));
    }
    cell.drain(&shutdown);
    http.stop();
    super::finish_process("cell", prober, migrator, signals, &shutdown);
    Ok(())
}
