//! The `director` role (SPEC §3, §6.2): placements, the admin API and the seat-feed poller over
//! PostgreSQL (`DATABASE_URL`) or SQLite when it is unset.
//!
//! Threads: `signals` (SIGTERM/SIGINT → drain), `migrator` (applies migrations, retrying in the
//! background while the database is down), `readiness` (JWKS and SQL probes), `feed-poller`
//! with its `feed-live-<n>`, `feed-suspect-<n>` workers and `feed-lister`, `fleet-sweeper`
//! (forgets long-silent cells, deletes expired leases), `http-acceptor` and `http-<n>`,
//! `pause-clock`, and `systemd-watchdog` when `WatchdogSec=` is set (`WATCHDOG=1` only while
//! every critical thread beats, `liveness.rs`). The main thread waits for the drain and
//! runs the shutdown order: `/ready` says draining, the poller stops, the prober stops, HTTP
//! stops, exit 0.
//!
//! Never crash-loops on a dead database: the process starts, serves `/health` 200 (its threads
//! waiting on the database are not judged stale) and `/ready`
//! 503 (`starting` until migrations are applied, then whatever the SQL probe says), and
//! becomes ready once the database answers. `READY=1` goes to systemd as soon as HTTP serves,
//! so a database outage at boot cannot run the unit into `TimeoutStartSec`.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::Duration;

use crate::clock;
use crate::config::Config;
use crate::director::admin::AdminContext;
use crate::director::assign::{self, AssignContext, Fleet, HttpCellClient, Placement};
use crate::director::feed_poller::{FeedBoard, FeedPoller, FeedPollerConfig, Pacing};
use crate::director::membership::{self, Judge};
use crate::http::{HttpServer, HttpSettings, Reply, Request};
use crate::lifecycle::{self, Shutdown};
use crate::metrics::Registry;
use crate::readiness::{self, Phase, Probes, Readiness};
use crate::store::Store;
use crate::threads;

use super::process::{bind_with_addr, open_store, verifier, RunError};

/// Migration retry backoff: first wait, and the cap it doubles up to.
const MIGRATE_RETRY_FIRST: Duration = Duration::from_millis(500);
const MIGRATE_RETRY_MAX: Duration = Duration::from_secs(10);

pub fn run(config: Config) -> Result<(), RunError> {
    let clock = clock::system();
    let incarnation = clock.now_ms() as i64;
    let director_id = format!("director-{incarnation}");
    let registry = Registry::new();
    let service_tokens = config.service_token.clone().ok_or_else(|| {
        RunError("ORCA_RELAY_SERVICE_TOKEN is required for the director role".into())
    })?;
    // Calls to cells carry the first token, then the next to a cell that refuses it; the admin
    // API accepts any of them.
    let service_token = service_tokens.clone();
    let verifier = verifier(&config, &clock)?;
    let store = open_store(&config)?;
    // One connection now, so a database that refuses our TLS stops start-up with the cause
    // (`super::process::stop_on_tls_failure`); a database that is down is left to the migrator.
    super::process::stop_on_tls_failure(&store.ping())?;

    let shutdown = Shutdown::new();
    let signals = lifecycle::install_signal_handlers(&shutdown)
        .map_err(|e| RunError(format!("cannot install signal handlers: {e}")))?;
    super::process::raise_fd_limit();
    let liveness = super::process::liveness(&config, &clock)?;
    let (http_listener, http_addr) = bind_with_addr("ORCA_RELAY_HTTP_ADDR", config.http_addr)?;

    let readiness = Readiness::from_config(&config);
    readiness.register_metrics(&registry, clock.clone());
    super::process::register_process_metrics(&registry, &readiness, &clock);
    super::process::register_store_metrics(&registry, &store);

    // Migrations in the background: until they are applied `/ready` says starting and the
    // store-backed routes answer 503.
    let migrated = Arc::new(AtomicBool::new(false));
    let migrator = {
        let store = store.clone();
        let migrated = migrated.clone();
        let readiness = readiness.clone();
        let shutdown = shutdown.clone();
        threads::spawn("migrator", move || {
            run_migrator(&store, &migrated, &readiness, &shutdown)
        })
        .map_err(|e| RunError(format!("cannot start the migrator thread: {e}")))?
    };

    let (prober_stop, prober_stop_rx) = mpsc::channel::<()>();
    let (prober, prober_standing) = {
        let jwks_verifier = verifier.clone();
        let sql_store = store.clone();
        let probes = Probes {
            jwks: Some(Box::new(move || jwks_verifier.probe().map_err(Into::into))),
            sql: Box::new(move || {
                sql_store
                    .probe()
                    .map_err(|e| readiness::ProbeFailure::from(&e))
            }),
        };
        let readiness = readiness.clone();
        let clock = clock.clone();
        let period = Duration::from_millis(config.timings.readiness_probe_ms);
        liveness
            .spawn_critical_watched("readiness", crate::liveness::BEAT_PERIOD, move |beat| {
                readiness::run_prober(readiness, probes, clock, period, prober_stop_rx, &beat)
            })
            .map_err(|e| RunError(format!("cannot start the readiness thread: {e}")))?
    };

    let membership = Judge::starting_now(membership::Rules::from_config(&config), &clock);
    let board = FeedBoard::new();
    let poller = FeedPoller::start(FeedPollerConfig {
        board: board.clone(),
        store: store.clone(),
        service_token: service_token.clone(),
        clock: clock.clone(),
        registry: registry.clone(),
        pacing: Pacing::from_config(&config),
        membership,
        liveness: liveness.clone(),
    })
    .map_err(|e| RunError(format!("cannot start the feed poller: {e}")))?;

    let fleet = Fleet::new(
        director_id.clone(),
        board.clone(),
        Arc::new(HttpCellClient::new(service_token.clone())),
        &config.timings,
        membership,
    );
    let (sweeper_stop, sweeper_stop_rx) = mpsc::channel::<()>();
    let sweeper = {
        let store = store.clone();
        let clock = clock.clone();
        threads::spawn("fleet-sweeper", move || {
            membership::run_sweeper(store, membership.rules, clock, sweeper_stop_rx)
        })
        .map_err(|e| RunError(format!("cannot start the fleet-sweeper thread: {e}")))?
    };
    let routes = Arc::new(Routes {
        assign: AssignContext::new(
            verifier,
            store.clone(),
            clock.clone(),
            Placement::Fleet(fleet),
            &registry,
        ),
        admin: AdminContext::new(
            store.clone(),
            clock.clone(),
            service_tokens,
            &registry,
            board,
            membership,
            config.timings.trip_slot_stale_ms,
        ),
        process: super::process::ProcessRoutes {
            registry: registry.clone(),
            readiness: readiness.clone(),
            clock: clock.clone(),
            metrics_wait_for_start: false,
            ready_gate: None,
            liveness: liveness.clone(),
        },
        migrated,
    });
    let handler = {
        let routes = routes.clone();
        Arc::new(move |request: &mut Request<'_>| routes.route(request))
    };
    let http = HttpServer::start(
        http_listener,
        HttpSettings::from_config(&config),
        handler,
        &registry,
        &liveness,
    )
    .map_err(|e| RunError(format!("cannot start the HTTP listener: {e}")))?;

    log::info!(
        "orca_relay_started role=director director_id={director_id} http={http_addr} backend={} incarnation={incarnation}",
        match store.backend() {
            crate::store::Backend::Postgres => "postgres",
            crate::store::Backend::Sqlite => "sqlite",
        }
    );
    lifecycle::notify_ready();
    super::process::start_systemd_watchdog(http_addr, &liveness)?;

    while !shutdown.wait_timeout(Duration::from_secs(3600)) {}

    // Shutdown order: stop saying ready, stop the poller (no more contact with cells), stop
    // the prober and the migrator, then HTTP.
    log::info!("orca_relay_shutdown_started role=director");
    readiness.set_phase(Phase::Draining);
    poller.stop();
    drop(sweeper_stop);
    threads::join_logged("fleet-sweeper", sweeper);
    prober_standing.stand_down();
    drop(prober_stop);
    prober.join_within("readiness", crate::threads::STOP_WAIT);
    threads::join_logged("migrator", migrator);
    http.stop();
    shutdown.close_signal_listener();
    threads::join_logged("signals", signals);
    log::info!("orca_relay_shutdown_finished role=director");
    Ok(())
}

/// Applies migrations, retrying with a doubling backoff until they succeed or shutdown starts;
/// then moves readiness to serving.
fn run_migrator(store: &Store, migrated: &AtomicBool, readiness: &Readiness, shutdown: &Shutdown) {
    let mut wait = MIGRATE_RETRY_FIRST;
    let mut last_reason: Option<&'static str> = None;
    loop {
        match store.migrate() {
            Ok(()) => {
                migrated.store(true, Ordering::Release);
                readiness.set_phase(Phase::Serving);
                log::info!("orca_relay_migrations_applied role=director");
                return;
            }
            Err(error) => {
                let reason = error.reason_code();
                if last_reason != Some(reason) {
                    log::warn!(
                        "orca_relay_migrations_failed {} retry_ms={} error={error}",
                        error.log_fields(),
                        wait.as_millis()
                    );
                    last_reason = Some(reason);
                }
            }
        }
        if shutdown.wait_timeout(wait) {
            return;
        }
        wait = (wait * 2).min(MIGRATE_RETRY_MAX);
    }
}

/// The director's HTTP routes.
struct Routes {
    assign: AssignContext,
    admin: AdminContext,
    process: super::process::ProcessRoutes,
    migrated: Arc<AtomicBool>,
}

impl Routes {
    fn route(&self, request: &mut Request<'_>) -> Reply {
        if let Some(reply) = self.process.route(request) {
            return reply;
        }
        let store_route = request.path == "/v1/assign" || request.path.starts_with("/v1/admin/");
        if store_route && !self.migrated.load(Ordering::Acquire) {
            return Reply::error(503, "starting").with_header("Retry-After", "2");
        }
        if let Some(reply) = self.admin.handle(request) {
            return reply;
        }
        match (request.method, request.path) {
            ("POST", "/v1/assign") => assign::handle(request, &self.assign),
            (_, "/v1/assign") => {
                Reply::error(405, "method_not_allowed").with_header("Allow", "POST")
            }
            _ => Reply::error(404, "not_found"),
        }
    }
}
