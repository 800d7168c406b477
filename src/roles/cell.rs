//! The `cell` role: bind both listeners, register with every director under the startup budget
//! (SPEC §8), then serve until SIGTERM; or, as the next process of a live handover, take the
//! running cell over. The cell itself is `cell_runtime.rs`.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::cell_runtime::{
    lock, CellRuntime, CellSetup, HANDSHAKE_ATTEMPTS_HELP, HANDSHAKE_RUNS_HELP,
};
use super::process::{service_tokens, RunError};
use crate::cell::heartbeat::Sink;
use crate::config::Config;
use crate::http::{Reply, Request};
use crate::lifecycle::Shutdown;
use crate::metrics::Registry;

/// The `cell` role: bind both listeners, register with every director under the startup
/// budget (SPEC §8), then serve until SIGTERM. With `take_over` this is the next process of a
/// live handover: the listeners, the connections and the cell's state come from the running
/// process (already registered under the same incarnation: no handshake), and the cell serves
/// once the handover has committed.
pub fn run(config: Config, take_over: Option<super::handover::TakeOver>) -> Result<(), RunError> {
    use super::handover::{Giver, GiverParts, Taker};
    use crate::cell::handshake::{register_with_directors_observed, Budget, RegisterRequest};
    use crate::http::{HttpServer, HttpSettings};

    let clock = crate::clock::system();
    let registry = Registry::new();
    let shutdown = Shutdown::new();
    let signals = crate::lifecycle::install_signal_handlers(&shutdown)
        .map_err(|e| RunError(format!("cannot install signal handlers: {e}")))?;
    super::process::raise_fd_limit();
    let liveness = super::process::liveness(&config, &clock)?;
    let (verifier, unsaved_key) =
        super::process::verifier_for(&config, &clock, take_over.is_some())?;
    let store = super::process::open_store(&config)?;
    // The next process of a handover writes nothing outside its memory before the commit: its
    // migrations run after it (`migrate_after_commit`).
    let (migrated, mut migrator) = match &take_over {
        Some(_) => (super::process::carried_schema(), None),
        None => super::process::migrate_in_background(&store, || Ok(()))?,
    };
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
                ("cell", &config.cell_id),
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

    // 1. Both listeners first: /health answers while the handshake runs.
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
    let cell_url = super::process::url_for_bound(&config.cell_url, "ws", config.ws_addr, ws_addr);
    let internal_url =
        super::process::url_for_bound(&config.internal_url, "http", config.http_addr, http_addr);

    let mut prober = super::process::start_prober(
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
    let handler = {
        let process = super::process::ProcessRoutes {
            registry: registry.clone(),
            readiness: readiness.clone(),
            clock: clock.clone(),
            metrics_wait_for_start: true,
            ready_gate: None,
            liveness: liveness.clone(),
        };
        let cell = cell.clone();
        Arc::new(move |request: &mut Request<'_>| {
            cell.route(request)
                .or_else(|| process.route(request))
                .unwrap_or_else(|| Reply::error(404, "not_found"))
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
            // first write outside this process's memory.
            let (received, migrating) = taker.take_over(&cell, &registry, &clock, || {
                super::process::after_commit(
                    &mut prober,
                    unsaved_key,
                    &store,
                    &migrated,
                    || Ok(()),
                    migrations_pending,
                )
            })?;
            migrator = migrating;
            let http = start_http(http_listener)?;
            taker.log_received(received);
            http
        }
        None => {
            let http = start_http(http_listener)?;
            log::info!(
                "orca_relay_listening role=cell cell_id={} ws={ws_addr} http={http_addr}",
                config.cell_id
            );
            // 2. Register with every director under one budget; only deadline expiry is
            // retried.
            let budget = Budget::from_config(&config);
            let request =
                RegisterRequest::new(&config.cell_id, &cell_url, &config.region, incarnation)
                    .with_internal_url(&internal_url);
            registry
                .counter("orca_relay_handshake_runs_total", HANDSHAKE_RUNS_HELP, &[])
                .inc();
            // Registered before the first attempt and updated as each starts: once the cell
            // serves it says how many attempts its start took (while it registers, `/metrics`
            // answers 503 like every path but `/health`, SPEC §8).
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
            http
        }
    };
    crate::lifecycle::notify_ready();
    super::process::start_systemd_watchdog(http_addr, &liveness)?;
    let http = Arc::new(Mutex::new(Some(http)));
    let giver = Giver::start(GiverParts {
        role: "cell",
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
        "orca_relay_started role=cell cell_id={} ws={ws_addr} http={http_addr} cell_url={cell_url} incarnation={incarnation} version={}",
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
    if let Some(http) = lock(&http).take() {
        http.stop_shared(http_shared);
    }
    super::process::finish_process("cell", prober, migrator, signals, &shutdown);
    Ok(())
}
