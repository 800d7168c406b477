//! The `combined` role: the director and its one cell in one process, on SQLite by default.
//! The zero-setup way to run the relay on one machine.
//!
//! The director part is the same director as the `director` role (SPEC §3): `/v1/assign` runs
//! [`Placement::Fleet`] over the store's cells, booking seats through the cell's own
//! `/internal/reserve` over HTTP, with a [`FeedPoller`] polling the cell's `/internal/seats`
//! (which is what keeps a reserve cell's dead-man armed, SPEC §5.5). What a remote cell does
//! over the network is done in-process here:
//! - registration: the cell is written into the store at start (retried by `self-record`);
//! - heartbeats: straight into the store (`Sink::Store`);
//! - the operator's admit-mode record (`relay_cell_admit_modes`, SPEC §6.1): the
//!   `self-record` thread writes it from the cell's own switch file whenever the applied
//!   `admitMode` changes, so a combined process whose switch says `reserve` books its desktops.
//!
//! - the drain: placement leaves the cell out from the moment it begins draining
//!   ([`InProcessCell`]), so a desktop that follows its `drain` frame straight back to
//!   `/v1/assign` is never placed on this process again (503 `relay_capacity_exhausted` with
//!   `Retry-After` while it is the only cell).
//!
//! Without `ORCA_RELAY_SERVICE_TOKEN` a random in-process token protects the cell's internal
//! API; the director side holds the same one.
//!
//! Of the director's admin API the combined role serves only `GET /v1/admin/cells` (the fleet
//! listing `orca-relay fleet status` reads: here, the one cell), behind the configured service
//! token. Without one the listing answers 401 `service_token_not_configured`: the generated
//! token is known to nobody outside the process.
//!
//! Threads: the cell's (see `roles/cell_runtime.rs`), `readiness`, `migrator` (until migrations
//! land), `feed-poller` and its workers, `fleet-sweeper`, `self-record`, `self-placement` (at
//! start, until `/ready`'s gate opens), `http-acceptor` and `http-<n>`, `signals`. The main
//! thread waits for SIGTERM and runs the drain: the cell drains (the poller keeps polling
//! meanwhile, so the dead-man stays armed), then the poller and `self-record` stop, then HTTP.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::sync::Arc;
use std::time::Duration;

use crate::cell::heartbeat::Sink;
use crate::cell::mode::CellMode;
use crate::cell::switch::AdmitMode;
use crate::clock;
use crate::config::Config;
use crate::director::admin::AdminContext;
use crate::director::assign::{
    self, AssignContext, Fleet, HttpCellClient, InProcessCell, Placement,
};
use crate::director::feed_poller::{FeedBoard, FeedPoller, FeedPollerConfig, Pacing};
use crate::director::membership::{self, Judge};
use crate::http::{HttpServer, HttpSettings, Reply, Request};
use crate::lifecycle::{self, Shutdown};
use crate::metrics::Registry;
use crate::service_token::ServiceTokens;
use crate::store::Store;
use crate::threads;

use super::cell_runtime::{CellRuntime, CellSetup};
use super::process::{migrate_in_background, open_store, start_prober, url_for_bound, RunError};

/// How long start-up waits for the in-process director to be able to place desktops on the
/// cell (its ready heartbeat in the store, in reserve mode a feed answer), so that `/v1/assign`
/// places desktops as soon as the started line is logged. Past it the process starts anyway;
/// `/ready` keeps answering 503 `starting` until it is placeable (`wait_until_placeable`).
const PLACEABLE_WAIT: Duration = Duration::from_secs(5);

pub fn run(
    mut config: Config,
    take_over: Option<super::handover::TakeOver>,
) -> Result<(), RunError> {
    use super::handover::{Giver, GiverParts, Taker};
    let clock = clock::system();
    let registry = Registry::new();
    let shutdown = Shutdown::new();
    let signals = lifecycle::install_signal_handlers(&shutdown)
        .map_err(|e| RunError(format!("cannot install signal handlers: {e}")))?;
    super::process::raise_fd_limit();
    let liveness = super::process::liveness(&config, &clock)?;
    // The fleet listing is served only with a token the operator knows.
    let token_configured = config.service_token.is_some();
    if config.service_token.is_none() {
        config.service_token = Some(ServiceTokens::single(in_process_token()?));
    }
    // The tokens this process sends (its own internal API accepts the whole list).
    let service_token = super::process::service_tokens(&config);
    let (verifier, unsaved_key) =
        super::process::verifier_for(&config, &clock, take_over.is_some())?;
    let store = open_store(&config)?;
    // Read before the commit: whether this build's migrations are to be applied after it.
    let mut migrations_pending = false;
    // Everything that needs no connection first: a next process says `ready` only once it is
    // built (the running process serves untouched meanwhile).
    let transient = take_over.as_ref().map(super::handover::transient);
    let parts = CellRuntime::prepare(&config, &clock, &registry, transient, &liveness)?;
    let mut taker = match &take_over {
        Some(take_over) => {
            // Before `ready`: what this process would serve, proven (SPEC §13).
            let running = take_over.running.as_ref();
            migrations_pending = super::process::prove_before_ready(&config, &store, running)?;
            Some(Taker::receive(
                take_over,
                ("combined", &config.cell_id),
                &store,
                &clock,
            )?)
        }
        None => None,
    };
    let incarnation = taker.as_ref().map_or_else(
        // Above the previous run's (DATA_DIR/incarnation): a clock stepped back since
        // cannot make this run look older than the last one (cell::incarnation).
        || crate::cell::incarnation::take(&config.data_dir, clock.now_ms()),
        |taker| taker.document.incarnation,
    );
    let director_id = format!("combined-{incarnation}");

    // What the service manager passed, or the handover (`handover::start_listeners`).
    let (intake, listeners) = super::handover::start_listeners(&config, taker.as_mut(), true)?;
    let listening = listeners
        .listening()
        .ok_or_else(|| RunError("no WebSocket listener".into()))?;
    let (ws_listener, ws_addr) = listeners
        .ws
        .ok_or_else(|| RunError("no WebSocket listener".into()))?;
    let (http_listener, http_addr) = listeners.http;
    let http_shared = listeners.http_shared;
    let cell_url = url_for_bound(&config.cell_url, "ws", config.ws_addr, ws_addr);
    // The director is in this process: it reaches the cell's internal API over loopback.
    let internal_url = loopback_url(http_addr);

    // The combined role has no remote director to register with: the cell goes into the store
    // once the schema exists (at once, or when a database that was down at boot answers). The
    // next process of a handover does both only once it has committed (it writes nothing
    // outside its memory before: a rolled-back handover leaves the store as it was).
    let register = {
        let registrar = store.clone();
        let (cell_id, region, cell_url, internal_url) = (
            config.cell_id.clone(),
            config.region.clone(),
            cell_url.clone(),
            internal_url.clone(),
        );
        move || registrar.register_cell(&cell_id, &cell_url, &internal_url, &region, incarnation)
    };
    let (migrated, mut migrator) = match &taker {
        Some(_) => (super::process::carried_schema(), None),
        None => migrate_in_background(&store, register.clone())?,
    };

    let mut prober = start_prober(
        &config,
        &registry,
        &verifier,
        &store,
        &migrated,
        &clock,
        taker
            .as_ref()
            .map(|taker| (&taker.document.readiness, &taker.carry)),
        &liveness,
    )?;
    let readiness = prober.readiness.clone();

    // Copies of the listeners to keep in the descriptor store (the originals go to their
    // servers).
    let ws_kept = ws_listener.try_clone().ok();
    let http_kept = http_listener.try_clone().ok();
    let built = CellRuntime::start(CellSetup {
        config: &config,
        clock: clock.clone(),
        registry: registry.clone(),
        store: store.clone(),
        verifier: verifier.clone(),
        readiness: readiness.clone(),
        ws_listener,
        cell_url: cell_url.clone(),
        internal_url: internal_url.clone(),
        incarnation,
        heartbeat: Sink::Store {
            store: store.clone(),
        },
        resume: taker
            .as_ref()
            .map(|taker| (taker.document.cell.clone(), taker.carry)),
        parts,
        crash_store: super::process::crash_store_socket(&config),
        first_connection_id: super::resume::first_connection_id(&intake),
        liveness: liveness.clone(),
    });
    let cell = Arc::new(match (built, &taker) {
        (Ok(cell), _) => cell,
        (Err(e), Some(taker)) => return Err(taker.fail(&e.0)),
        (Err(e), None) => return Err(e),
    });
    if taker.is_none() {
        // A start after a crash resumes what the store kept; any start keeps its listeners.
        let kept: Vec<(&str, &std::net::TcpListener)> = [("ws", &ws_kept), ("http", &http_kept)]
            .into_iter()
            .filter_map(|(name, listener)| listener.as_ref().map(|listener| (name, listener)))
            .collect();
        super::resume::keep_and_resume(&cell.context, intake, &kept);
    }
    drop((ws_kept, http_kept));
    // A listener the descriptor store keeps is shared with the manager, as a socket unit's is.
    let http_shared = http_shared || cell.context.crash.is_some();

    let board = FeedBoard::new();
    let membership = Judge::starting_now(membership::Rules::from_config(&config), &clock);
    let fleet = Fleet::new(
        director_id.clone(),
        board.clone(),
        Arc::new(HttpCellClient::new(service_token.clone())),
        &config.timings,
        membership,
    )
    .with_in_process_cell(InProcessCell {
        cell_id: config.cell_id.clone(),
        mode: cell.context.mode.clone(),
    });
    let assign_context = Arc::new(AssignContext::new(
        verifier,
        store.clone(),
        clock.clone(),
        Placement::Fleet(fleet),
        &registry,
    ));
    let admin = AdminContext::new(
        store.clone(),
        clock.clone(),
        super::process::service_tokens(&config),
        &registry,
        board.clone(),
        membership,
        config.timings.trip_slot_stale_ms,
    )
    .listing_only(token_configured);
    // `/ready` says 200 only once the in-process director would place a desktop on this cell
    // (its ready heartbeat and, in reserve mode, a feed answer are recorded): see
    // `wait_until_placeable`.
    let placeable = super::process::ServeGate::default();
    if taker.is_some() {
        // The cell was placeable in the running process: `/ready` stays 200 throughout.
        placeable.open();
    }
    let handler = {
        let process = super::process::ProcessRoutes {
            registry: registry.clone(),
            readiness: readiness.clone(),
            clock: clock.clone(),
            metrics_wait_for_start: true,
            ready_gate: Some(placeable.clone()),
            liveness: liveness.clone(),
        };
        let cell = cell.clone();
        let assign_context = assign_context.clone();
        Arc::new(move |request: &mut Request<'_>| {
            if let Some(reply) = cell
                .route(request)
                .or_else(|| process.route(request))
                .or_else(|| admin.handle(request))
            {
                return reply;
            }
            match (request.method, request.path) {
                ("POST", "/v1/assign") => assign::handle(request, &assign_context),
                (_, "/v1/assign") => {
                    Reply::error(405, "method_not_allowed").with_header("Allow", "POST")
                }
                _ => Reply::error(404, "not_found"),
            }
        })
    };
    let giver_http_listener = http_listener
        .try_clone()
        .map_err(|e| RunError(format!("cannot share the HTTP listener: {e}")))?;
    let start_http = |listener| {
        HttpServer::start(
            listener,
            HttpSettings::from_config(&config),
            handler.clone(),
            &registry,
            &liveness,
        )
        .map_err(|e| RunError(format!("cannot start the HTTP listener: {e}")))
    };
    let http = match taker.as_mut() {
        Some(taker) => {
            // Every connection behind the gate, then the commit; only then any I/O, and the
            // first write outside this process's memory (the key file, migrations, the
            // registration with this configuration's URLs).
            let (received, migrating) = taker.take_over(&cell, &registry, &clock, || {
                super::process::after_commit(
                    &mut prober,
                    unsaved_key,
                    &store,
                    &migrated,
                    register,
                    migrations_pending,
                )
            })?;
            migrator = migrating;
            let http = start_http(http_listener)?;
            taker.log_received(received);
            http
        }
        None => start_http(http_listener)?,
    };
    log::info!(
        "orca_relay_listening role=combined cell_id={} ws={ws_addr} http={http_addr}",
        config.cell_id
    );
    super::process::start_systemd_watchdog(http_addr, &liveness)?;

    // The combined role has no remote director to register with: the cell is in the store.
    let record = SelfRecord {
        store: store.clone(),
        cell_id: config.cell_id.clone(),
        cell_url: cell_url.clone(),
        internal_url: internal_url.clone(),
        region: config.region.clone(),
        incarnation,
        mode: cell.context.mode.clone(),
    };
    // Registered by the migration step already, unless the database was down at boot: then
    // the self-record thread registers the cell as soon as it can.
    let registered = migrated.load(std::sync::atomic::Ordering::Acquire);
    if taker.is_none() {
        cell.serve()?;
    }
    let (record_stop, record_stop_rx) = mpsc::channel::<()>();
    let record_thread = {
        let period = Duration::from_millis(config.timings.switch_poll_ms);
        threads::spawn("self-record", move || {
            record.run(registered, period, record_stop_rx)
        })
        .map_err(|e| RunError(format!("cannot start the self-record thread: {e}")))?
    };
    let poller = FeedPoller::start(FeedPollerConfig {
        board,
        store: store.clone(),
        service_token,
        clock: clock.clone(),
        registry: registry.clone(),
        pacing: Pacing::from_config(&config),
        membership,
        liveness: liveness.clone(),
    })
    .map_err(|e| RunError(format!("cannot start the feed poller: {e}")))?;
    let (sweeper_stop, sweeper_stop_rx) = mpsc::channel::<()>();
    let sweeper = {
        let store = store.clone();
        let clock = clock.clone();
        threads::spawn("fleet-sweeper", move || {
            membership::run_sweeper(store, membership.rules, clock, sweeper_stop_rx)
        })
        .map_err(|e| RunError(format!("cannot start the fleet-sweeper thread: {e}")))?
    };
    let (placement_stop, placement_stop_rx) = mpsc::channel::<()>();
    let self_placement = {
        let (store, gate) = (store.clone(), placeable.clone());
        let (context, cell_id) = (assign_context.clone(), config.cell_id.clone());
        threads::spawn("self-placement", move || {
            wait_until_placeable(&store, &context, &cell_id, &gate, placement_stop_rx)
        })
        .map_err(|e| RunError(format!("cannot start the self-placement thread: {e}")))?
    };
    // Ready for systemd once placeable, or after PLACEABLE_WAIT (a database down at boot):
    // `/ready` keeps waiting for the gate either way.
    let waited = clock::instant();
    while !placeable.is_open() && waited.elapsed() < PLACEABLE_WAIT {
        clock::sleep(Duration::from_millis(20));
    }
    if !placeable.is_open() {
        log::warn!(
            "orca_relay_self_placement_pending cell_id={} waited_ms={}",
            config.cell_id,
            PLACEABLE_WAIT.as_millis()
        );
    }

    lifecycle::notify_ready();
    let http = Arc::new(std::sync::Mutex::new(Some(http)));
    let giver = Giver::start(GiverParts {
        role: "combined",
        cell: cell.clone(),
        http: http.clone(),
        http_listener: giver_http_listener,
        registry: registry.clone(),
        clock: clock.clone(),
        data_dir: config.data_dir.clone(),
        shutdown: shutdown.clone(),
        listening,
    });
    log::info!(
        "orca_relay_started role=combined cell_id={} ws={ws_addr} http={http_addr} cell_url={cell_url} internal_url={internal_url} incarnation={incarnation} version={}",
        config.cell_id,
        crate::handover::version()
    );

    // A stop the running process was asked for after its commit decision: drain now.
    if taker.as_ref().is_some_and(|taker| taker.stop_requested()) {
        shutdown.drain_inherited();
    }
    while !shutdown.is_draining() {
        shutdown.wait_timeout(Duration::from_secs(3600));
    }
    cell.drain(&shutdown);
    if let Some(giver) = giver {
        giver.stop();
    }
    drop(placement_stop);
    threads::join_logged("self-placement", self_placement);
    poller.stop();
    drop(sweeper_stop);
    threads::join_logged("fleet-sweeper", sweeper);
    drop(record_stop);
    threads::join_logged("self-record", record_thread);
    let http = http.lock().unwrap_or_else(|e| e.into_inner()).take();
    if let Some(http) = http {
        http.stop_shared(http_shared);
    }
    super::process::finish_process("combined", prober, migrator, signals, &shutdown);
    Ok(())
}

/// A random service token for a combined process started without one: 32 bytes from the OS,
/// base64url. Never a fixed fallback: the token guards `/internal/*` on the HTTP listener.
fn in_process_token() -> Result<String, RunError> {
    use base64::Engine;
    let mut bytes = [0u8; 32];
    getrandom::fill(&mut bytes)
        .map_err(|e| RunError(format!("cannot generate the in-process service token: {e}")))?;
    Ok(base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(bytes))
}

/// `http://<addr>` with an unspecified address (`0.0.0.0`, `::`) replaced by loopback.
fn loopback_url(addr: SocketAddr) -> String {
    let ip = match addr.ip() {
        IpAddr::V4(ip) if ip.is_unspecified() => IpAddr::V4(Ipv4Addr::LOCALHOST),
        IpAddr::V6(ip) if ip.is_unspecified() => IpAddr::V6(Ipv6Addr::LOCALHOST),
        ip => ip,
    };
    format!("http://{}", SocketAddr::new(ip, addr.port()))
}

/// The `self-placement` thread: every 20 ms, until the in-process director would place a new
/// desktop on this cell as a placement judges it (the store shows this incarnation heartbeating
/// ready, and in reserve mode the feed poller has an answer saying so:
/// `assign::Fleet::places_on`), then opens `gate`, which `/ready` waits for. Returns then, or
/// when `stop` fires or its sender is dropped.
fn wait_until_placeable(
    store: &Store,
    context: &AssignContext,
    cell_id: &str,
    gate: &super::process::ServeGate,
    stop: Receiver<()>,
) {
    let Placement::Fleet(fleet) = &context.placement else {
        gate.open();
        return;
    };
    loop {
        let placeable = store.list_cells().is_ok_and(|cells| {
            fleet.places_on(
                &cells,
                cell_id,
                context.clock.now_ms(),
                context.clock.monotonic_ms(),
            )
        });
        if placeable {
            gate.open();
            log::info!("orca_relay_self_placement_ready cell_id={cell_id}");
            return;
        }
        match stop.recv_timeout(Duration::from_millis(20)) {
            Err(RecvTimeoutError::Timeout) => {}
            Ok(()) | Err(RecvTimeoutError::Disconnected) => return,
        }
    }
}

/// What the in-process director keeps in the store on the cell's behalf: its registration and
/// the operator's admit-mode record following the switch file.
struct SelfRecord {
    store: Store,
    cell_id: String,
    cell_url: String,
    internal_url: String,
    region: String,
    incarnation: i64,
    mode: Arc<CellMode>,
}

impl SelfRecord {
    /// Registers the cell; false (logged) when the store did not take it.
    fn register(&self) -> bool {
        match self.store.register_cell(
            &self.cell_id,
            &self.cell_url,
            &self.internal_url,
            &self.region,
            self.incarnation,
        ) {
            Ok(()) => true,
            Err(e) => {
                log::warn!(
                    "orca_relay_self_registration_deferred cell_id={} {}",
                    self.cell_id,
                    e.log_fields()
                );
                false
            }
        }
    }

    /// The `self-record` thread: every `period` (the switch poll), registers the cell if that
    /// has not succeeded yet, and writes the admit-mode record when the applied switch's
    /// `admitMode` differs from the last one written. A failed write is retried next period
    /// and logged once per run of failures.
    fn run(&self, mut registered: bool, period: Duration, stop: Receiver<()>) {
        let mut recorded: Option<AdmitMode> = None;
        let mut failing = false;
        loop {
            if !registered {
                registered = self.register();
                if registered {
                    log::info!(
                        "orca_relay_self_registered cell_id={} incarnation={}",
                        self.cell_id,
                        self.incarnation
                    );
                }
            }
            let wanted = self.mode.switch().flags.admit_mode;
            if recorded != Some(wanted) {
                match self.store.set_admit_mode(&self.cell_id, wanted.as_str()) {
                    Ok(()) => {
                        log::info!(
                            "orca_relay_self_admit_mode_recorded cell_id={} admit_mode={}",
                            self.cell_id,
                            wanted.as_str()
                        );
                        recorded = Some(wanted);
                        failing = false;
                    }
                    Err(e) => {
                        if !failing {
                            log::warn!(
                                "orca_relay_self_admit_mode_failed cell_id={} {}",
                                self.cell_id,
                                e.log_fields()
                            );
                        }
                        failing = true;
                    }
                }
            }
            match stop.recv_timeout(period) {
                Err(RecvTimeoutError::Timeout) => {}
                Ok(()) | Err(RecvTimeoutError::Disconnected) => return,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_internal_url_reaches_an_unspecified_listener_over_loopback() {
        let cases = [
            ("0.0.0.0:8081", "http://127.0.0.1:8081"),
            ("[::]:8081", "http://[::1]:8081"),
            ("10.0.0.7:9000", "http://10.0.0.7:9000"),
            ("127.0.0.1:1234", "http://127.0.0.1:1234"),
        ];
        for (addr, url) in cases {
            assert_eq!(loopback_url(addr.parse().unwrap()), url, "{addr}");
        }
    }

    #[test]
    fn the_in_process_token_is_random_and_long() {
        let (a, b) = (in_process_token().unwrap(), in_process_token().unwrap());
        assert_ne!(a, b);
        assert_eq!(a.len(), 43, "32 bytes base64url without padding");
    }
}
