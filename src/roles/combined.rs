//! The `combined` role: one cell and the director's `/v1/assign` in one process, on SQLite by
//! default. The zero-setup way to run the relay on one machine.
//!
//! Threads: `acceptor`, `relay-<id>` per connection, `pinger`, `lease-renewer`, `reaper`,
//! `http-<n>`; the main thread waits for a signal and runs the shutdown order.

use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::Arc;

use crate::clock;
use crate::config::Config;
use crate::director::assign::{self, AssignContext, Placement, Target};
use crate::http::{HttpServer, Reply, Request};
use crate::metrics::Registry;
use crate::relay::socket::Reaper;
use crate::relay::{self, Phase, RelayContext};
use crate::threads;

use super::{bind, open_store, verifier, RunError};

pub fn run(config: Config) -> Result<(), RunError> {
    let clock = clock::system();
    let incarnation = clock.now_ms() as i64;
    let registry = Registry::new();
    let verifier = verifier(&config, &clock)?;
    let store = open_store(&config)?;
    store
        .migrate()
        .map_err(|e| RunError(format!("migration failed: {e}")))?;

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

    let (reaper, reaper_handle) =
        Reaper::start().map_err(|e| RunError(format!("cannot start the reaper thread: {e}")))?;
    let phase = Arc::new(Phase::default());
    let context = RelayContext::new(
        &config.cell_id,
        incarnation,
        config.timings.clone(),
        config.connection_cap,
        verifier.clone(),
        store.clone(),
        clock.clone(),
        reaper,
        phase.clone(),
        &registry,
    );
    register_store_metrics(&registry, &store, &context);

    let acceptor_stop = Arc::new(AtomicBool::new(false));
    let acceptor = {
        let context = context.clone();
        let stop = acceptor_stop.clone();
        threads::spawn("acceptor", move || {
            relay::run_acceptor(ws_listener, context, stop)
        })
        .map_err(|e| RunError(format!("cannot start the acceptor thread: {e}")))?
    };
    let (pinger_stop, pinger_rx) = mpsc::channel::<()>();
    let pinger = {
        let context = context.clone();
        threads::spawn("pinger", move || {
            relay::control::run_pinger(context, pinger_rx)
        })
        .map_err(|e| RunError(format!("cannot start the pinger thread: {e}")))?
    };
    let (renewer_stop, renewer_rx) = mpsc::channel::<()>();
    let renewer = {
        let context = context.clone();
        threads::spawn("lease-renewer", move || {
            relay::control::run_lease_renewer(context, renewer_rx)
        })
        .map_err(|e| RunError(format!("cannot start the lease-renewer thread: {e}")))?
    };

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
        let phase = phase.clone();
        let assign_context = assign_context.clone();
        Arc::new(move |request: &mut Request<'_>| {
            route(request, &registry, &phase, &assign_context)
        })
    };
    let http = HttpServer::start(http_listener, 4, handler)
        .map_err(|e| RunError(format!("cannot start the HTTP listener: {e}")))?;

    phase.set(Phase::SERVING);
    log::info!(
        "orca_relay_started role=combined cell_id={} ws={ws_addr} http={http_addr} cell_url={cell_url} incarnation={incarnation}",
        config.cell_id
    );

    wait_for_signal();

    // Shutdown order: stop admitting, close every socket, stop the cell threads, then HTTP.
    log::info!("orca_relay_shutdown_started role=combined");
    phase.set(Phase::DRAINING);
    acceptor_stop.store(true, Ordering::Release);
    let _ = TcpStream::connect(ws_addr);
    threads::join_logged("acceptor", acceptor);
    for control in context.cell.controls() {
        context.close(
            &control.socket,
            crate::protocol::CloseCode::Draining,
            "draining",
        );
    }
    drop(pinger_stop);
    drop(renewer_stop);
    threads::join_logged("pinger", pinger);
    threads::join_logged("lease-renewer", renewer);
    http.stop();
    drop(context);
    drop(assign_context);
    let _ = reaper_handle;
    log::info!("orca_relay_shutdown_finished role=combined");
    Ok(())
}

fn wait_for_signal() {
    use signal_hook::consts::{SIGINT, SIGTERM};
    match signal_hook::iterator::Signals::new([SIGTERM, SIGINT]) {
        Ok(mut signals) => {
            let _ = signals.forever().next();
        }
        Err(e) => {
            log::error!("orca_relay_signals_unavailable error={e}");
            loop {
                clock::sleep(std::time::Duration::from_secs(3600));
            }
        }
    }
}

fn register_store_metrics(
    registry: &Registry,
    store: &crate::store::Store,
    context: &RelayContext,
) {
    let pool = store.clone();
    registry.sampled_gauge(
        "orca_relay_db_pool",
        "Database pool connections and waiters.",
        move || {
            let stats = pool.pool_stats();
            let row = |state: &str, value: u32| {
                (vec![("state".to_string(), state.to_string())], value as f64)
            };
            vec![
                row("open", stats.open),
                row("idle", stats.idle),
                row("waiters", stats.waiters),
                row("max", stats.max),
                row("ceiling", stats.ceiling),
            ]
        },
    );
    let statements = store.clone();
    registry.sampled_gauge(
        "orca_relay_db_statements",
        "SQL statements this process has sent to the database.",
        move || vec![(vec![], statements.statements_executed() as f64)],
    );
    let slots = context.slots.clone();
    registry.sampled_gauge(
        "orca_relay_connection_units",
        "Connection units in use against the cap.",
        move || vec![(vec![], slots.used() as f64)],
    );
}

fn route(
    request: &mut Request<'_>,
    registry: &Registry,
    phase: &Phase,
    assign_context: &AssignContext,
) -> Reply {
    match (request.method, request.path) {
        ("GET", "/health") => Reply::json(200, r#"{"ok":true}"#),
        ("GET", "/ready") => match phase.get() {
            Phase::STARTING => Reply::error(503, "starting"),
            Phase::DRAINING => Reply::error(503, "draining"),
            _ => Reply::json(200, r#"{"ok":true}"#),
        },
        ("GET", "/metrics") => Reply::text(200, registry.render()),
        ("POST", "/v1/assign") => assign::handle(request, assign_context),
        _ => Reply::error(404, "not_found"),
    }
}
