//! A running cell: the part of its wiring shared by the `cell` and `combined` roles (and by a
//! live handover, which stops and starts it in pieces).
//!
//! [`CellRuntime::start`] builds the cell's shared state and starts its named threads:
//! `acceptor`, `pinger`, `lease-renewer`, `reaper`, `switch-watcher`, `watchdog`,
//! `claim-loop`; [`CellRuntime::serve`] starts `heartbeat` once the startup registration has
//! succeeded; relay threads come and go with connections, and a trip starts `reregister`.
//! [`CellRuntime::route`] serves the cell's HTTP endpoints (`/internal/*`).
//! [`CellRuntime::drain`] runs the SIGTERM sequence: the watchdog stops before the final
//! admit-effective write, the claim loop ends after carrying it out, the other threads are
//! joined in reverse start order, and the cell deregisters from its directors.
//!
//! A live handover (`roles/handover.rs`) uses the same parts in pieces: the running process
//! stops its acceptor and its cell-wide threads ([`CellRuntime::quiesce_threads`], which give
//! back their state: the next ping and lease renewal, the applied switch, the dead-man window,
//! the admit-effective writer) and starts them again from that state if the handover fails
//! ([`CellRuntime::restart_threads`]); the next process builds its cell from the handover's
//! record ([`CellSetup::resume`]) and starts the same threads from it once the handover has
//! committed ([`CellRuntime::resume_threads`]).

use std::net::{SocketAddr, TcpListener};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::auth::Verifier;
use crate::carry::cell::CellRecord;
use crate::carry::time::{Carry, Snapshot};
use crate::cell::contact::Contact;
use crate::cell::heartbeat::{self, Heartbeat, LastBeat, Sink};
use crate::cell::internal_api::{CellStatus, InternalApi, InternalApiParts};
use crate::cell::mode::DeadManView;
use crate::cell::status_report::{self, PoolReport, ReportFn, StatusReport};
use crate::cell::switch::{run_switch_watcher, AdmitMode, Switch};
use crate::clock::SharedClock;
use crate::config::Config;
use crate::crash_store::CrashStore;
use crate::dead_man::claim_loop::{self, StoreRow};
use crate::dead_man::reregister::Reregistration;
use crate::dead_man::watchdog::Watchdog;
use crate::dead_man::window::{ClaimResult, Window};
use crate::dead_man::writer::{CellAdmitEffectiveWriter, WriterHandle};
use crate::http::{Reply, Request};
use crate::lifecycle::{Shutdown, ShutdownState};
use crate::liveness::{Beat, Liveness, Standing, BEAT_PERIOD};
use crate::metrics::Registry;
use crate::protocol::{self, CloseCode, RelayToHost};
use crate::readiness::{self, Readiness};
use crate::relay::buffer_budget::BufferBudget;
use crate::relay::context::{Phase, RelayContext};
use crate::relay::metrics::RelayMetrics;
use crate::relay::park::{Parked, Quiesce, Wake};
use crate::relay::socket::{Reaper, Socket};
use crate::relay::splice::{SplicePlane, SpliceTimings};
use crate::relay::{self, pending};
use crate::store::Store;
use crate::threads;

use super::process::RunError;

/// How often a drain waiting out its grace looks whether every desktop has left.
const DRAIN_RECHECK: Duration = Duration::from_millis(100);

/// How soon a drain frame that found its desktop's writer busy is tried again.
const DRAIN_FRAME_RETRY: Duration = Duration::from_millis(5);

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
    /// A live handover's record of the cell, for the next process: the cell is built from it
    /// and starts no thread until [`CellRuntime::resume_threads`].
    pub resume: Option<(CellRecord, Carry)>,
    /// What was built before the connections were known ([`CellRuntime::prepare`]).
    pub parts: CellParts,
    /// Keep connections in the service manager's descriptor store (`crash_store`): its notify
    /// socket, when there is a manager and `ORCA_RELAY_CRASH_STORE` is on.
    pub crash_store: Option<std::ffi::OsString>,
    /// The first connection id this process hands out (above every id kept in the store: a
    /// store name `c<id>` must never stand for two connections).
    pub first_connection_id: u64,
    /// The process's critical threads (every cell-wide thread is one) and its pause clock.
    pub liveness: Liveness,
}

/// What a cell builds before it knows its connections: the reaper, the splice workers, its
/// capacity, the quiesce. A received handover's next process builds it before its `ready`
/// (the running process serves untouched meanwhile), and plans its capacity as a fresh start
/// does: before it holds any carried descriptor, the running process's tasks not counted as
/// its own.
pub struct CellParts {
    reaper: Reaper,
    /// `None` once a cell was built from the parts ([`CellRuntime::start`]).
    reaper_handle: Option<(JoinHandle<()>, Standing)>,
    splice: Arc<SplicePlane>,
    connection_cap: u32,
    relay_threads: usize,
    quiesce: Arc<Quiesce>,
}

impl Drop for CellParts {
    /// Parts no cell was built from (a next process whose handover failed, or a start that
    /// failed after them): their critical threads are stood down and stopped before their
    /// channels go, so their end is not taken for a failure (exit 70) while the process exits
    /// with its own status.
    fn drop(&mut self) {
        if let Some((_, standing)) = self.reaper_handle.take() {
            standing.stand_down();
            self.splice.stop();
        }
    }
}

/// The cell-wide threads' state when they are stopped for a live handover: what they go on
/// from, here (the handover failed) or in the next process (as a [`CellRecord`]).
pub struct CellThreadsState {
    pub next_ping: Instant,
    pub next_renewal: Instant,
    pub switch: Switch,
    pub window: Option<Window>,
    pub writer: CellAdmitEffectiveWriter<StoreRow>,
    pub answers: Vec<ClaimResult>,
}

struct Stoppable {
    name: &'static str,
    stop: Sender<()>,
    handle: threads::Watched<()>,
    /// A critical thread: stood down before it is asked to stop.
    standing: Standing,
}

impl Stoppable {
    /// Tells the thread to stop and joins it, or leaves it to end with the process if it is
    /// still inside a database call after [`super::process::FINAL_WRITE_WAIT`] (a drain's exit never
    /// waits on a database that stopped answering).
    fn stop_and_join(self) {
        self.standing.stand_down();
        drop(self.stop);
        self.handle
            .join_within(self.name, super::process::FINAL_WRITE_WAIT);
    }
}

/// A stoppable thread that gives back what it ends with.
struct Returning<T> {
    stop: Sender<()>,
    handle: threads::Watched<T>,
    /// A critical thread: stood down before it is asked to stop.
    standing: Standing,
}

impl<T> Returning<T> {
    /// Stops the thread and waits for what it gives back (a live handover needs it).
    fn stop(self, name: &str) -> Option<T> {
        self.standing.stand_down();
        drop(self.stop);
        self.handle.join(name)
    }

    /// Stops the thread for a drain: joined within [`super::process::FINAL_WRITE_WAIT`], else left to
    /// end with the process (it waits on a database that stopped answering).
    fn stop_within(self, name: &str) {
        self.standing.stand_down();
        drop(self.stop);
        self.handle
            .join_within(name, super::process::FINAL_WRITE_WAIT);
    }
}

/// The cell-wide threads a handover stops and starts again.
struct CellThreads {
    pinger: Returning<Instant>,
    renewer: Returning<Instant>,
    switch: Returning<Switch>,
    watchdog: Returning<(Window, mpsc::Receiver<ClaimResult>)>,
    claim_loop: (
        threads::Watched<CellAdmitEffectiveWriter<StoreRow>>,
        Standing,
    ),
    /// The claim loop's other writer handle (the drain's final write goes through it).
    writer: WriterHandle,
}

/// What the cell-wide threads need to start, apart from their state.
struct ThreadSetup {
    switch_file: std::path::PathBuf,
    switch_poll: Duration,
    pool_max: u32,
    pool_reserve_max: u32,
    /// How long before a ping or a renewal is due at a fresh start.
    ping: Duration,
    renewal: Duration,
}

/// What a stopped acceptor gives back: its listener and its pending connections.
type AcceptorEnd = (TcpListener, Vec<Parked>);

/// A running cell.
pub struct CellRuntime {
    pub context: RelayContext,
    pub contact: Contact,
    internal: Option<InternalApi>,
    ws_addr: SocketAddr,
    acceptor_stop: Arc<Wake>,
    acceptor: Mutex<Option<(JoinHandle<AcceptorEnd>, Standing)>>,
    /// Pending connections (no credential checked yet) for the next acceptor: a handover's,
    /// or this process's own after a failed one.
    carried_pending: Mutex<Vec<Parked>>,
    /// The WebSocket listener while no acceptor runs on it (before a handover's commit, or
    /// while one quiesces).
    idle_listener: Mutex<Option<TcpListener>>,
    threads: Mutex<Vec<Stoppable>>,
    cell_threads: Mutex<Option<CellThreads>>,
    thread_setup: ThreadSetup,
    /// The state a received handover's threads start from (taken by `resume_threads`).
    resumed_state: Mutex<Option<CellThreadsState>>,
    reaper: Mutex<Option<(JoinHandle<()>, Standing)>>,
    readiness: Readiness,
    /// Starts the `heartbeat` thread; taken by [`CellRuntime::serve`].
    heartbeat: Mutex<Option<PendingHeartbeat>>,
    last_beat: LastBeat,
    reregister_stop: Arc<AtomicBool>,
    reregistration: Arc<Mutex<Option<JoinHandle<()>>>>,
    drain_grace: Duration,
    /// Where the clean exit's deregistration goes (the heartbeat's directors, or the store).
    deregistration: Sink,
    /// Held for the whole of a live handover: a drain waits for its outcome.
    pub handover: Mutex<()>,
    /// Set while a live handover has the cell frozen: bookings are refused (503).
    pub frozen: Arc<AtomicBool>,
    store: Store,
    clock: SharedClock,
    registry: Registry,
}

type PendingHeartbeat = Box<dyn FnOnce() -> Result<Stoppable, RunError> + Send>;

/// Starts the critical thread `name` (it beats at least once a [`BEAT_PERIOD`]).
fn spawn_stoppable(
    liveness: &Liveness,
    name: &'static str,
    body: impl FnOnce(mpsc::Receiver<()>, &Beat) + Send + 'static,
) -> Result<Stoppable, RunError> {
    let (stop, receiver) = mpsc::channel();
    let (handle, standing) = liveness
        .spawn_critical_watched(name, BEAT_PERIOD, move |beat| body(receiver, &beat))
        .map_err(|e| RunError(format!("cannot start the {name} thread: {e}")))?;
    Ok(Stoppable {
        name,
        stop,
        handle,
        standing,
    })
}

/// Starts the critical thread `name`, which gives back what it ends with.
fn spawn_returning<T: Send + 'static>(
    liveness: &Liveness,
    name: &'static str,
    body: impl FnOnce(mpsc::Receiver<()>, &Beat) -> T + Send + 'static,
) -> Result<Returning<T>, RunError> {
    let (stop, receiver) = mpsc::channel();
    let (handle, standing) = liveness
        .spawn_critical_watched(name, BEAT_PERIOD, move |beat| body(receiver, &beat))
        .map_err(|e| RunError(format!("cannot start the {name} thread: {e}")))?;
    Ok(Returning {
        stop,
        handle,
        standing,
    })
}

impl CellRuntime {
    /// Builds what needs no connection ([`CellParts`]): `besides` is what a process about to
    /// take over holds only for the handover (the running process's pid, whose tasks are not
    /// this one's, and descriptors of its own it closes at the commit), not to be counted in its
    /// capacity: a fresh start's plan.
    pub fn prepare(
        config: &Config,
        clock: &SharedClock,
        registry: &Registry,
        besides: Option<(Option<u32>, u64)>,
        liveness: &Liveness,
    ) -> Result<CellParts, RunError> {
        // Refused and closing connections linger there, a descriptor each, at most
        // ORCA_RELAY_CLOSING_CONNECTIONS_MAX of them (reserved by the capacity plan).
        let closing =
            relay::closing::ClosingBound::new(config.closing_connections_max as usize, registry);
        let (reaper, reaper_handle) = Reaper::start_bounded(closing, liveness)
            .map_err(|e| RunError(format!("cannot start the reaper thread: {e}")))?;
        let splice = SplicePlane::start(
            config.splice_workers as usize,
            SpliceTimings::new(
                config.timings.wedge_ms,
                relay::socket::CLOSE_LINGER.as_millis() as u64,
                config.splice_idle_ms,
            ),
            clock.clone(),
            RelayMetrics::new(registry),
            liveness,
            buffer_budget(config, registry),
        )
        .map_err(|e| RunError(format!("cannot start the splice workers: {e}")))?;
        let (connection_cap, relay_threads) = plan_capacity(config, registry, besides);
        let quiesce = Quiesce::new()
            .map_err(|e| RunError(format!("cannot create the handover's eventfd: {e}")))?;
        Ok(CellParts {
            reaper,
            reaper_handle: Some(reaper_handle),
            splice,
            connection_cap,
            relay_threads,
            quiesce,
        })
    }

    /// Builds the cell and starts its threads. The acceptor answers 503 until
    /// [`CellRuntime::serve`] is called (after the startup handshake). With
    /// [`CellSetup::resume`], the cell is rebuilt from a live handover's record and nothing is
    /// started until [`CellRuntime::resume_threads`].
    pub fn start(setup: CellSetup<'_>) -> Result<CellRuntime, RunError> {
        let config = setup.config;
        let clock = setup.clock.clone();
        let ws_addr = setup
            .ws_listener
            .local_addr()
            .map_err(|e| RunError(format!("cannot read the WebSocket listener address: {e}")))?;
        let mut parts = setup.parts;
        let reaper_handle = parts
            .reaper_handle
            .take()
            .ok_or_else(|| RunError("the cell's parts were used already".into()))?;
        let (reaper, splice, quiesce) = (
            parts.reaper.clone(),
            parts.splice.clone(),
            parts.quiesce.clone(),
        );
        let (connection_cap, relay_threads) = (parts.connection_cap, parts.relay_threads);
        drop(parts);
        let liveness = setup.liveness.clone();
        let mut context = RelayContext::new(
            &config.cell_id,
            setup.incarnation,
            config.timings.clone(),
            connection_cap,
            config.pending_upgrades_max,
            config.pending_per_source_max,
            setup.verifier.clone(),
            setup.store.clone(),
            clock.clone(),
            reaper,
            Arc::new(Phase::default()),
            &setup.registry,
            splice.clone(),
            threads::Permits::new(relay_threads),
            quiesce,
            liveness.clone(),
        );
        context.continue_ids_from(setup.first_connection_id);
        if let Some(notify_socket) = &setup.crash_store {
            // A slot for every connection the cap admits, and the pending plane's share.
            let slots = connection_cap.saturating_add(config.pending_upgrades_max);
            let store = CrashStore::start(slots, notify_socket.clone(), &setup.registry)
                .map_err(|e| RunError(format!("cannot start the crash store: {e}")))?;
            context.crash = Some(store);
        }
        register_cell_metrics(&setup.registry, &setup.store, &context);
        let contact = Contact::new();
        let acceptor_stop = Wake::new()
            .map_err(|e| RunError(format!("cannot create the acceptor's eventfd: {e}")))?;

        let thread_setup = ThreadSetup {
            switch_file: config.switch_file.clone(),
            switch_poll: Duration::from_millis(config.timings.switch_poll_ms),
            pool_max: config.pool_max,
            pool_reserve_max: config.pool_reserve_max,
            ping: Duration::from_millis(config.timings.ping_ms),
            renewal: Duration::from_millis(config.timings.lease_renew_ms),
        };
        let make_writer = || {
            let row = StoreRow {
                store: setup.store.clone(),
                cell_id: config.cell_id.clone(),
                incarnation: setup.incarnation,
                stale_ms: config.timings.trip_slot_stale_ms,
                mode: context.mode.clone(),
                registry: setup.registry.clone(),
            };
            claim_loop::writer(row, &config.timings)
        };
        // A fresh start's writer; a received handover builds its own from the record.
        let writer = setup.resume.is_none().then(make_writer);
        let mut last_beat = None;
        let mut resumed_state = None;
        if let Some((record, carry)) = &setup.resume {
            // The model first: seats, invites, the seat log, bookings (with their units), the
            // mode and the last contact, each timer moved to this process's clock.
            context.cell.restore(record.model.clone(), carry);
            context.seats.restore(record.seat_log.clone());
            context.bookings.restore(record.bookings.clone(), carry);
            context.mode.restore(&record.mode, carry);
            if let Some(age) = record.contact_ago_ms {
                contact.record(carry.moment_ms(age));
            }
            context.continue_ids_from(record.next_connection_id);
            let mut resumed_writer = make_writer();
            if let Some(writer_record) = &record.writer {
                resumed_writer.restore(writer_record, carry);
            }
            let window = record.window.as_ref().map(|window| {
                Window::new(&config.cell_id, &config.timings).restored(window, carry)
            });
            let answers = record
                .claim_answers
                .iter()
                .map(|(generation, silence_age, permit)| ClaimResult {
                    generation: *generation,
                    silence_started_ms: carry.moment_ms(*silence_age),
                    permit: *permit,
                })
                .collect();
            last_beat = record
                .last_heartbeat
                .map(|(age, ready)| (carry.instant_ago(age), ready));
            resumed_state = Some(CellThreadsState {
                next_ping: carry.deadline(record.next_ping_in_ms),
                next_renewal: carry.deadline(record.next_lease_renewal_in_ms),
                switch: context.mode.switch(),
                window,
                writer: resumed_writer,
                answers,
            });
        }
        let resuming = resumed_state.is_some();
        let last_beat = LastBeat::starting_at(last_beat);
        // The pool's ceiling: until the watchdog's first tick says otherwise, the tighter
        // bound (a received handover knows the mode already).
        let reserve_ceiling = if resuming {
            context.mode.raw_is_reserve()
        } else {
            config.pool_reserve_max < config.pool_max
        };
        setup.store.set_pool_ceiling(if reserve_ceiling {
            config.pool_reserve_max.min(config.pool_max)
        } else {
            config.pool_max
        });

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
            let last_beat = last_beat.clone();
            let liveness = liveness.clone();
            Box::new(move || {
                spawn_stoppable(&liveness, "heartbeat", move |stop, beat| {
                    heartbeat::run(sink, period, sample, clock, stop, last_beat, beat)
                })
            })
        };

        let frozen = Arc::new(AtomicBool::new(false));
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

        let runtime = CellRuntime {
            context,
            contact,
            internal,
            ws_addr,
            acceptor_stop,
            acceptor: Mutex::new(None),
            carried_pending: Mutex::new(Vec::new()),
            idle_listener: Mutex::new(Some(setup.ws_listener)),
            threads: Mutex::new(Vec::new()),
            cell_threads: Mutex::new(None),
            thread_setup,
            resumed_state: Mutex::new(resumed_state),
            reaper: Mutex::new(Some(reaper_handle)),
            readiness: setup.readiness,
            heartbeat: Mutex::new(Some(heartbeat)),
            last_beat,
            reregister_stop: Arc::new(AtomicBool::new(false)),
            reregistration: Arc::default(),
            drain_grace: Duration::from_millis(config.drain_grace_ms),
            deregistration: setup.heartbeat,
            handover: Mutex::new(()),
            frozen,
            store: setup.store,
            clock,
            registry: setup.registry,
        };
        if let Some(writer) = writer {
            runtime.start_acceptor()?;
            let now = crate::clock::instant();
            runtime.restart_threads(CellThreadsState {
                next_ping: now + runtime.thread_setup.ping,
                next_renewal: now + runtime.thread_setup.renewal,
                switch: Switch::default(),
                window: None,
                writer,
                answers: Vec::new(),
            })?;
        }
        Ok(runtime)
    }

    /// Starts the acceptor on the idle listener (at start, after a received handover has
    /// committed, or after a failed one).
    pub fn start_acceptor(&self) -> Result<(), RunError> {
        let Some(listener) = lock(&self.idle_listener).take() else {
            return Ok(());
        };
        let carried = std::mem::take(&mut *lock(&self.carried_pending));
        self.acceptor_stop.clear();
        let context = self.context.clone();
        let stop = self.acceptor_stop.clone();
        let acceptor = self
            .context
            .liveness
            .spawn_critical("acceptor", BEAT_PERIOD, move |beat| {
                pending::run(listener, context, stop, carried, &beat)
            })
            .map_err(|e| RunError(format!("cannot start the acceptor thread: {e}")))?;
        *lock(&self.acceptor) = Some(acceptor);
        Ok(())
    }

    /// Stops the acceptor (no connection it accepted is dropped; new ones wait in the
    /// backlog), keeps the listener, and gives back the pending connections it held, as they
    /// were.
    pub fn stop_acceptor(&self) -> Vec<Parked> {
        let acceptor = lock(&self.acceptor).take();
        if let Some((_, standing)) = &acceptor {
            standing.stand_down();
        }
        self.acceptor_stop.set();
        if let Some((acceptor, _)) = acceptor {
            if let Some((listener, pending)) = threads::join_logged("acceptor", acceptor) {
                *lock(&self.idle_listener) = Some(listener);
                return pending;
            }
        }
        Vec::new()
    }

    /// Pending connections for the next acceptor to start with ([`CellRuntime::start_acceptor`]).
    pub fn carry_pending(&self, pending: Vec<Parked>) {
        lock(&self.carried_pending).extend(pending);
    }

    /// The WebSocket listener's descriptor, for a live handover (the acceptor stopped).
    pub fn idle_listener_fd(&self) -> Option<std::os::fd::RawFd> {
        use std::os::fd::AsRawFd;
        lock(&self.idle_listener).as_ref().map(|l| l.as_raw_fd())
    }

    /// Starts the cell-wide threads from `state`: `pinger`, `lease-renewer`,
    /// `switch-watcher`, `claim-loop` and `watchdog`.
    pub fn restart_threads(&self, state: CellThreadsState) -> Result<(), RunError> {
        let context = &self.context;
        let liveness = &context.liveness;
        let setup = &self.thread_setup;
        let pinger = {
            let context = context.clone();
            let next = state.next_ping;
            spawn_returning(liveness, "pinger", move |stop, beat| {
                relay::control::run_pinger(context, stop, next, beat)
            })?
        };
        let renewer = {
            let context = context.clone();
            let next = state.next_renewal;
            spawn_returning(liveness, "lease-renewer", move |stop, beat| {
                relay::control::run_lease_renewer(context, stop, next, beat)
            })?
        };
        let switch = {
            let mode = context.mode.clone();
            let path = setup.switch_file.clone();
            let cell_id = context.cell_id.to_string();
            let period = setup.switch_poll;
            let applied = state.switch;
            spawn_returning(liveness, "switch-watcher", move |stop, beat| {
                run_switch_watcher(
                    &path,
                    &cell_id,
                    period,
                    |switch| mode.set_switch(switch),
                    stop,
                    applied,
                    beat,
                )
            })?
        };
        // The claim loop owns the admit-effective writer; the watchdog talks to it by channel.
        let (writer, inbox) = WriterHandle::channel();
        let (answers_tx, answers_rx) = mpsc::channel();
        for answer in state.answers {
            let _ = answers_tx.send(answer);
        }
        let claim_clock = self.clock.clone();
        let claim_writer = state.writer;
        let claim_loop = liveness
            .spawn_critical_watched("claim-loop", BEAT_PERIOD, move |beat| {
                claim_loop::run(claim_writer, inbox, claim_clock, answers_tx, &beat)
            })
            .map_err(|e| RunError(format!("cannot start the claim-loop thread: {e}")))?;
        let on_trip = {
            let context = context.clone();
            let stop = self.reregister_stop.clone();
            let running = self.reregistration.clone();
            Box::new(move || start_reregistration(&context, stop.clone(), &running))
        };
        let watchdog = Watchdog {
            cell_id: context.cell_id.to_string(),
            timings: (*context.timings).clone(),
            clock: self.clock.clone(),
            mode: context.mode.clone(),
            contact: self.contact.clone(),
            bookings: context.bookings.clone(),
            writer: writer.clone(),
            answers: answers_rx,
            store: self.store.clone(),
            pool_max: setup.pool_max,
            pool_reserve_max: setup.pool_reserve_max,
            on_trip,
            registry: self.registry.clone(),
            window: state.window,
        };
        let watchdog = spawn_returning(liveness, "watchdog", move |stop, beat| {
            watchdog.run(stop, beat)
        })?;
        *lock(&self.cell_threads) = Some(CellThreads {
            pinger,
            renewer,
            switch,
            watchdog,
            claim_loop,
            writer,
        });
        Ok(())
    }

    /// Stops the cell-wide threads for a live handover and returns their state: the next ping
    /// and renewal, the applied switch, the watchdog's window (and any claim answer it had not
    /// taken), and the admit-effective writer once the claim loop has carried out what was
    /// pending. Also stops a running re-registration. `None` if they were not running.
    pub fn quiesce_threads(&self) -> Option<CellThreadsState> {
        self.stop_reregistration();
        let threads = lock(&self.cell_threads).take()?;
        let now = crate::clock::instant();
        let next_ping = threads.pinger.stop("pinger").unwrap_or(now);
        let next_renewal = threads.renewer.stop("lease-renewer").unwrap_or(now);
        let switch = threads
            .switch
            .stop("switch-watcher")
            .unwrap_or_else(|| self.context.mode.switch());
        // The watchdog first (the claim loop's other writer), then the loop ends once the last
        // handle is gone; answers it gives after the watchdog stopped wait in the channel.
        let watched = threads.watchdog.stop("watchdog");
        let (claim_loop, claim_standing) = threads.claim_loop;
        claim_standing.stand_down();
        drop(threads.writer);
        let writer = claim_loop.join("claim-loop")?;
        let (window, answers) = match watched {
            Some((window, answers)) => (Some(window), answers.try_iter().collect()),
            None => (None, Vec::new()),
        };
        Some(CellThreadsState {
            next_ping,
            next_renewal,
            switch,
            window,
            writer,
            answers,
        })
    }

    /// After a received handover committed: starts the acceptor, the cell-wide threads from
    /// the carried state, the heartbeat, a re-registration a tripped cell still owes, and
    /// serves.
    pub fn resume_threads(&self) -> Result<(), RunError> {
        if let Some(state) = lock(&self.resumed_state).take() {
            self.restart_threads(state)?;
        }
        self.resume_reregistration();
        // Serving before the acceptor starts: a connection that waited in the backlog through
        // the handover must not be told the cell is starting.
        self.serve()?;
        self.start_acceptor()
    }

    /// A tripped cell whose memory- or booking-admitted controls were not all re-registered
    /// when a handover stopped it goes on (the controls admitted by the database are skipped).
    pub fn resume_reregistration(&self) {
        let owed = self.context.mode.dead_man() == DeadManView::Tripped
            && self
                .context
                .cell
                .controls()
                .iter()
                .any(|control| control.admitted_via != crate::cell::state::AdmitPath::Database);
        if owed {
            self.reregister_stop.store(false, Ordering::Release);
            start_reregistration(
                &self.context,
                self.reregister_stop.clone(),
                &self.reregistration,
            );
        }
    }

    fn stop_reregistration(&self) {
        self.reregister_stop.store(true, Ordering::Release);
        if let Some(handle) = lock(&self.reregistration).take() {
            threads::join_logged("reregister", handle);
        }
    }

    /// What a live handover carries of the cell at `at` (with the stopped threads' `state`).
    pub fn record(&self, at: &Snapshot, state: &CellThreadsState) -> CellRecord {
        CellRecord {
            model: self.context.cell.record(at),
            seat_log: self.context.seats.record_state(),
            bookings: self.context.bookings.record(at),
            mode: self.context.mode.record(at),
            contact_ago_ms: self.contact.last().map(|last| at.age_ms(last)),
            window: state.window.as_ref().map(|window| window.record(at)),
            claim_answers: state
                .answers
                .iter()
                .map(|answer| {
                    (
                        answer.generation,
                        at.age_ms(answer.silence_started_ms),
                        answer.permit,
                    )
                })
                .collect(),
            writer: Some(state.writer.record(at)),
            next_ping_in_ms: at.left_of(state.next_ping),
            next_lease_renewal_in_ms: at.left_of(state.next_renewal),
            last_heartbeat: self.last_beat.get().map(|(sent, ready)| {
                (
                    at.now.saturating_duration_since(sent).as_millis() as u64,
                    ready,
                )
            }),
            next_connection_id: self.context.peek_next_connection_id(),
        }
    }

    /// Opens the WebSocket listener for business (after the startup handshake) and starts
    /// the heartbeat. Serving first: the heartbeat's first sample is taken at its start, and a
    /// handover's next process whose first beat said not ready would be left out of placement
    /// until its next one (`relay_capacity_exhausted` right after a commit: issue 31).
    pub fn serve(&self) -> Result<(), RunError> {
        self.context.phase.set(Phase::SERVING);
        self.readiness.set_phase(readiness::Phase::Serving);
        if let Some(start_heartbeat) = lock(&self.heartbeat).take() {
            let heartbeat = start_heartbeat()?;
            lock(&self.threads).push(heartbeat);
        }
        Ok(())
    }

    /// Stops the heartbeat without waiting for a beat in flight (a committed handover: the
    /// next process beats from now on).
    pub fn stop_heartbeat(&self) {
        let mut threads = lock(&self.threads);
        if let Some(at) = threads.iter().position(|t| t.name == "heartbeat") {
            let heartbeat = threads.remove(at);
            heartbeat.standing.stand_down();
            drop(heartbeat.stop);
        }
    }

    pub fn ws_addr(&self) -> SocketAddr {
        self.ws_addr
    }

    pub fn readiness(&self) -> &Readiness {
        &self.readiness
    }

    /// The cell's HTTP endpoints; `None` for paths it does not own.
    pub fn route(&self, request: &mut Request<'_>) -> Option<Reply> {
        if !request.path.starts_with("/internal/") {
            return None;
        }
        if self.context.phase.get() == Phase::STARTING {
            return Some(Reply::error(503, "starting"));
        }
        // A booking taken while a handover holds the cell would miss its snapshot.
        if request.path == "/internal/reserve" && self.frozen.load(Ordering::Acquire) {
            return Some(Reply::error(503, "handover").with_header("Retry-After", "1"));
        }
        match &self.internal {
            Some(internal) => internal.handle(request),
            None => Some(Reply::error(404, "not_found")),
        }
    }

    /// The drain's final row write: `reserve` when the switch says so, which frees any slot (a
    /// draining cell gets no new desktops: its feed says draining), else `db`. Its line comes
    /// after the watchdog's `orca_relay_dead_man_stopped`: the fault-injection run
    /// (`tests/nemesis`, checker 1) judges the order from the two lines.
    fn final_row_write(&self, writer: &WriterHandle) {
        let switch = self.context.mode.switch();
        let mode = if switch.says_reserve() {
            crate::dead_man::window::Mode::Reserve
        } else {
            crate::dead_man::window::Mode::Db
        };
        log::info!(
            "orca_relay_drain_final_write cell_id={} mode={}",
            self.context.cell_id,
            mode.as_str()
        );
        writer.tick(switch.says_reserve(), mode, false);
        writer.release_slot();
    }

    /// The SIGTERM sequence (SPEC §9): `/ready` 503 draining, stop accepting, `drain` to every
    /// desktop, wait up to the grace (or until every control has left), close the rest 4503,
    /// final admit-effective write, join the threads. A live handover in progress finishes
    /// first (if it commits, this process exits before draining).
    pub fn drain(&self, shutdown: &Shutdown) {
        let _handover = lock(&self.handover);
        log::info!(
            "orca_relay_drain_started cell_id={} controls={} grace_ms={}",
            self.context.cell_id,
            self.context.cell.control_count(),
            self.drain_grace.as_millis()
        );
        self.readiness.set_phase(readiness::Phase::Draining);
        self.context.phase.set(Phase::DRAINING);
        self.context.mode.set_draining();
        // The acceptor keeps answering through the grace: a new upgrade is refused 503
        // draining at once (a stopped acceptor would leave it unanswered in the backlog).
        let drain = protocol::to_json(&RelayToHost::Drain {
            grace_ms: self.drain_grace.as_millis() as u64,
            recovery: "resolve-director".into(),
        });
        // Every desktop gets the drain frame: one whose writer another thread held at that
        // moment (the pinger, an answer) is tried again within a few ms, never skipped (it
        // would learn of the drain only from its 4503 at the end of the grace).
        let mut owed: Vec<_> = self
            .context
            .cell
            .controls()
            .into_iter()
            .map(|control| control.socket)
            .collect();
        Socket::send_to_each_free(&mut owed, &drain);
        let deadline = crate::clock::instant() + self.drain_grace;
        while self.context.cell.control_count() > 0 && !shutdown.is_immediate() {
            let left = deadline.saturating_duration_since(crate::clock::instant());
            if left.is_zero() {
                break;
            }
            // Sleeps; wakes early only for a second signal, otherwise re-checks the controls
            // every 100 ms (ten wake-ups a second cost no measurable CPU), sooner while a
            // drain frame is owed.
            let recheck = if owed.is_empty() {
                DRAIN_RECHECK
            } else {
                DRAIN_FRAME_RETRY
            };
            shutdown.wait_while_in(ShutdownState::Draining, left.min(recheck));
            Socket::send_to_each_free(&mut owed, &drain);
        }
        // Stop accepting; pending connections (no credential yet) are closed: a splice leg
        // waiting for its first frame with 4503.
        let pending = self.stop_acceptor();
        relay::pending::close_parked(&self.context, pending);
        let remaining = self.context.cell.controls();
        for control in &remaining {
            self.context
                .close(&control.socket, CloseCode::Draining, "draining");
        }
        // A close frame the reaper still owes (its writer was busy) goes out before the exit.
        self.context
            .reaper
            .wait_for_close_frames(crate::relay::socket::CLOSE_LINGER);
        // Spliced pairs are closed 4503 too, and the splice workers end.
        self.context.splice.stop();
        self.stop_reregistration();
        let cell_threads = lock(&self.cell_threads).take();
        if let Some(cell_threads) = cell_threads {
            // Each joined within FINAL_WRITE_WAIT (the claim loop's final write above all), so
            // the drain's exit never waits on a database that stopped answering.
            cell_threads.pinger.stop_within("pinger");
            cell_threads.renewer.stop_within("lease-renewer");
            cell_threads.switch.stop_within("switch-watcher");
            // The watchdog is the claim loop's only other writer: stop it before the final
            // row write, so that the drain's write is the row's last word. A watchdog tick
            // after it would write a tripped cell's `db` back, and its slot would stay taken
            // for `TRIP_SLOT_STALE_MS` after the process is gone.
            cell_threads.watchdog.stop_within("watchdog");
            let writer = cell_threads.writer;
            self.final_row_write(&writer);
            // This was the last handle: the claim loop carries out what is pending, then ends.
            let (claim_loop, claim_standing) = cell_threads.claim_loop;
            claim_standing.stand_down();
            drop(writer);
            claim_loop.join_within("claim-loop", super::process::FINAL_WRITE_WAIT);
        }
        let stoppables: Vec<Stoppable> = lock(&self.threads).drain(..).collect();
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
        // The reaper ends once the last handle to it goes, with the process: not a failure.
        if let Some((_, standing)) = lock(&self.reaper).take() {
            standing.stand_down();
        }
    }
}

/// The process's capacity at start (`capacity.rs`): logged as one line, the configured
/// connection cap lowered to the ceiling with one WARN naming the limit, gauges for
/// `/metrics`. Returns the cap in force and the relay-thread permits.
fn plan_capacity(
    config: &Config,
    registry: &Registry,
    besides: Option<(Option<u32>, u64)>,
) -> (u32, usize) {
    let configured = config.connection_cap;
    // The running process a handover takes over from shares the machine's and the cgroup's
    // task counts with this one until it exits: its tasks are not this process's to count;
    // nor are the handover's own descriptors.
    let (giver, descriptors) = besides.unwrap_or((None, 0));
    let tasks = giver.map_or(0, |pid| crate::capacity::process_tasks(pid).unwrap_or(0));
    let plan = match crate::capacity::read_limits() {
        Ok(limits) => {
            crate::capacity::plan(&limits.without(tasks, descriptors), capacity_needs(config))
        }
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
    let reserved = plan.descriptors_reserved;
    registry.sampled_gauge(
        "orca_relay_capacity_descriptors_reserved",
        "Descriptors the capacity plan keeps off the connection cap, by what they are for.",
        move || {
            [
                ("process", reserved.process),
                ("pending", reserved.pending),
                ("closing", reserved.closing),
                ("http", reserved.http),
            ]
            .into_iter()
            .map(|(what, n)| (vec![("for".to_string(), what.to_string())], n as f64))
            .collect()
        },
    );
    let bounds = plan.memory;
    registry.sampled_gauge(
        "orca_relay_capacity_per_connection_bytes",
        "The memory the plan counts for each connection (what an idle or ordinarily busy one holds; larger buffers draw on the buffer budget).",
        move || vec![(Vec::new(), bounds.per_connection as f64)],
    );
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
        // The table, and the newcomers held beyond it in their grace.
        pending_upgrades_max: config.pending_upgrades_max as u64
            + relay::pending::NEWCOMERS_HELD_MAX as u64,
        closing_connections_max: config.closing_connections_max as u64,
        http_connections_max: config.http_connections_max as u64,
        configured_cap: config.connection_cap as u64,
        memory: memory_bounds(config),
    }
}

/// The cell's one budget for large buffers, with its gauges and wait counters on `/metrics`.
fn buffer_budget(config: &Config, registry: &Registry) -> Arc<BufferBudget> {
    use relay::buffer_budget::Side;
    let budget = BufferBudget::new(config.buffer_budget_bytes);
    let gauge = budget.clone();
    registry.sampled_gauge(
        "orca_relay_buffer_budget_bytes",
        "The budget large buffers draw on (ORCA_RELAY_BUFFER_BUDGET_BYTES): its limit, what leases hold now, and the most they held.",
        move || {
            [("limit", gauge.limit()), ("used", gauge.used()), ("peak", gauge.peak())]
                .into_iter()
                .map(|(state, n)| (vec![("state".to_string(), state.to_string())], n as f64))
                .collect()
        },
    );
    let waits = budget.clone();
    registry.sampled_counter(
        "orca_relay_buffer_budget_waits_total",
        "Times a connection waited, not read, because the buffer budget could not give its lease, by side.",
        move || {
            [("control", Side::Control), ("splice", Side::Splice)]
                .into_iter()
                .map(|(side, s)| (vec![("side".to_string(), side.to_string())], waits.waits(s) as f64))
                .collect()
        },
    );
    budget
}

/// A control connection's memory in ordinary use: the part of its thread's stack it touches
/// ([`threads::RELAY_STACK_RESIDENT_BYTES`]), its reader's buffer and message up to the
/// ordinary amount (larger frames draw on the buffer budget), and its state.
pub const CONTROL_MEMORY_BOUND_BYTES: u64 = threads::RELAY_STACK_RESIDENT_BYTES as u64
    + relay::buffer_budget::CONTROL_ORDINARY_BYTES as u64
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
        buffers: config.buffer_budget_bytes,
        base: BASE_MEMORY_BYTES
            + config.splice_workers as u64 * (relay::splice::READ_BUFFER_BYTES as u64 + 64 * 1024)
            + (config.pending_upgrades_max as u64 + config.http_connections_max as u64)
                * per_thread_connection,
    }
}

pub(super) fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|e| e.into_inner())
}

/// Starts the `reregister` thread (after a trip, or to finish one a handover interrupted); its
/// handle is kept in `running` so that a handover or the drain can stop and join it.
fn start_reregistration(
    context: &RelayContext,
    stop: Arc<AtomicBool>,
    running: &Arc<Mutex<Option<JoinHandle<()>>>>,
) {
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
    match threads::spawn("reregister", move || {
        job.run();
    }) {
        Ok(handle) => {
            let previous = lock(running).replace(handle);
            if let Some(previous) = previous.filter(|h| h.is_finished()) {
                threads::join_logged("reregister", previous);
            }
        }
        Err(e) => log::error!("orca_relay_reregister_spawn_failed error={e}"),
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
    super::process::register_store_metrics(registry, store);
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

pub const HANDSHAKE_RUNS_HELP: &str =
    "Startup handshakes run; 0 in the combined role, whose director is in-process.";
pub const HANDSHAKE_ATTEMPTS_HELP: &str =
    "Attempts the startup handshake has started; 0 in the combined role, which has none.";
