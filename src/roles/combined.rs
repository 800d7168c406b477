//! The `combined` role: one cell and the director's `/v1/assign` in one process, on SQLite by
//! default. The zero-setup way to run the relay on one machine.
//!
//! Threads: the cell's (see `roles/cell.rs`), `readiness`, `migrator` (until migrations land),
//! `http-<n>`, `signals`; the main thread waits for SIGTERM and runs the drain.

use std::sync::Arc;

use crate::cell::heartbeat::Sink;
use crate::clock;
use crate::config::Config;
use crate::director::assign::{self, AssignContext, Placement, Target};
use crate::http::{HttpServer, Reply, Request};
use crate::lifecycle::{self, Shutdown};
use crate::metrics::Registry;
use crate::readiness::Readiness;
use crate::threads;

use super::cell::{CellRuntime, CellSetup};
use super::{bind, migrate_in_background, open_store, start_prober, verifier, RunError};

pub fn run(config: Config) -> Result<(), RunError> {
    let clock = clock::system();
    let incarnation = clock.now_ms() as i64;
    let registry = Registry::new();
    let shutdown = Shutdown::new();
    let signals = lifecycle::install_signal_handlers(&shutdown)
        .map_err(|e| RunError(format!("cannot install signal handlers: {e}")))?;
    let verifier = verifier(&config, &clock)?;
    let store = open_store(&config)?;

    let ws_listener = bind("ORCA_RELAY_WS_ADDR", config.ws_addr)?;
    let http_listener = bind("ORCA_RELAY_HTTP_ADDR", config.http_addr)?;
    let ws_addr = ws_listener
        .local_addr()
        .map_err(|e| RunError(format!("cannot read the WebSocket listener address: {e}")))?;
    let http_addr = http_listener
        .local_addr()
        .map_err(|e| RunError(format!("cannot read the HTTP listener address: {e}")))?;
    // With port 0 the operator asked for any free port: the URL follows the real one.
    let cell_url =
        if config.ws_addr.port() == 0 && config.cell_url == format!("ws://{}", config.ws_addr) {
            format!("ws://{ws_addr}")
        } else {
            config.cell_url.clone()
        };

    // The combined role has no remote director to register with: the cell goes into the store
    // once the schema exists (at once, or when a database that was down at boot answers).
    let (migrated, migrator) = {
        let registrar = store.clone();
        let (cell_id, region, cell_url) = (
            config.cell_id.clone(),
            config.region.clone(),
            cell_url.clone(),
        );
        migrate_in_background(&store, move || {
            registrar.register_cell(
                &cell_id,
                &cell_url,
                &format!("http://{http_addr}"),
                &region,
                incarnation,
                incarnation,
            )
        })?
    };

    let readiness = Readiness::from_config(&config);
    readiness.register_metrics(&registry, clock.clone());
    let (prober_stop, prober) = start_prober(
        &readiness,
        &verifier,
        &store,
        &migrated,
        &clock,
        config.timings.readiness_probe_ms,
    )?;

    let cell = Arc::new(CellRuntime::start(CellSetup {
        config: &config,
        clock: clock.clone(),
        registry: registry.clone(),
        store: store.clone(),
        verifier: verifier.clone(),
        readiness: readiness.clone(),
        ws_listener,
        cell_url: cell_url.clone(),
        incarnation,
        heartbeat: Sink::Store(store.clone()),
    })?);

    let assign_context = Arc::new(AssignContext::new(
        verifier,
        store.clone(),
        clock.clone(),
        Placement::LocalCell(Target {
            cell_id: config.cell_id.clone(),
            cell_url: cell_url.clone(),
        }),
        &registry,
    ));
    let handler = {
        let registry = registry.clone();
        let readiness = readiness.clone();
        let cell = cell.clone();
        let clock = clock.clone();
        Arc::new(move |request: &mut Request<'_>| {
            if let Some(reply) = cell.route(request) {
                return reply;
            }
            match (request.method, request.path) {
                ("GET", "/health") => Reply::json(200, r#"{"ok":true}"#),
                ("GET", "/ready") => {
                    let verdict = readiness.answer(clock.now_ms());
                    Reply::json(verdict.status, verdict.body)
                }
                ("GET", "/metrics") => Reply::text(200, registry.render()),
                ("POST", "/v1/assign") => assign::handle(request, &assign_context),
                _ => Reply::error(404, "not_found"),
            }
        })
    };
    let http = HttpServer::start(http_listener, 4, handler)
        .map_err(|e| RunError(format!("cannot start the HTTP listener: {e}")))?;
    super::start_systemd_watchdog(http_addr)?;

    cell.serve()?;
    lifecycle::notify_ready();
    log::info!(
        "orca_relay_started role=combined cell_id={} ws={ws_addr} http={http_addr} cell_url={cell_url} incarnation={incarnation}",
        config.cell_id
    );

    while !shutdown.is_draining() {
        shutdown.wait_timeout(std::time::Duration::from_secs(3600));
    }
    cell.drain(&shutdown);
    http.stop();
    finish(prober_stop, prober, migrator, signals, &shutdown)
}

fn finish(
    prober_stop: std::sync::mpsc::Sender<()>,
    prober: std::thread::JoinHandle<()>,
    migrator: Option<std::thread::JoinHandle<()>>,
    signals: std::thread::JoinHandle<()>,
    shutdown: &Shutdown,
) -> Result<(), RunError> {
    drop(prober_stop);
    threads::join_logged("readiness", prober);
    if let Some(migrator) = migrator.filter(|m| m.is_finished()) {
        threads::join_logged("migrator", migrator);
    }
    shutdown.close_signal_listener();
    threads::join_logged("signals", signals);
    log::info!("orca_relay_shutdown_finished role=combined");
    Ok(())
}
