//! What every role's process does around its own threads: open the store and apply
//! migrations, bind (or take from systemd or a handover) its listeners, build its token
//! verifier, start the readiness prober and the systemd watchdog, serve `/health`, `/ready` and
//! `/metrics`, and finish in order. Used by `cell`, `combined` and `director`; uses none of them.

use std::fmt;
use std::net::TcpListener;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use crate::auth::Verifier;
use crate::clock::SharedClock;
use crate::config::Config;
use crate::liveness::Liveness;
use crate::service_token::ServiceTokens;
use crate::store::{Store, StoreConfig};

/// Why a role could not start or stopped with an error; printed as one line.
#[derive(Debug)]
pub struct RunError(pub String);

impl fmt::Display for RunError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for RunError {}

/// The process's two listeners: handed over by the running process (`handed`: a live
/// handover's WebSocket and HTTP listeners), passed by the service manager (`passed`: named `ws`
/// and `http`, from the optional socket units or the descriptor store: `crash_store::Intake`),
/// or bound here. Returns the WebSocket listener and address, then the HTTP ones (`ws` is `None`
/// for a director).
pub fn listeners(
    config: &Config,
    handed: Option<Handed>,
    passed: std::collections::BTreeMap<String, std::os::fd::OwnedFd>,
    with_ws: bool,
) -> Result<ListenerPair, RunError> {
    let (mut ws, mut http) = (None, None);
    // Not bound by this process: another one (systemd, or the process handing over) holds it.
    let mut http_shared = handed.is_some();
    let (mut ws_from_systemd, mut http_from_systemd) = (false, false);
    if let Some(handed) = handed {
        ws = Some(handed.ws);
        http = Some(handed.http);
        (ws_from_systemd, http_from_systemd) = handed.from_systemd;
    } else {
        let passed = crate::lifecycle::listeners_from(passed).map_err(RunError)?;
        for (name, listener) in passed {
            match name.as_str() {
                "ws" => {
                    ws_from_systemd = true;
                    ws = Some(listener);
                }
                "http" => {
                    http_shared = true;
                    http_from_systemd = true;
                    http = Some(listener);
                }
                other => log::warn!("orca_relay_listen_fd_ignored name={other}"),
            }
        }
        if ws.is_some() || http.is_some() {
            log::info!(
                "orca_relay_listeners_from_systemd ws={} http={}",
                ws.is_some(),
                http.is_some()
            );
        }
    }
    let ws = match ws {
        Some(listener) => Some(listener),
        None if with_ws => Some(bind("ORCA_RELAY_WS_ADDR", config.ws_addr)?),
        None => None,
    };
    let http = match http {
        Some(listener) => listener,
        None => bind("ORCA_RELAY_HTTP_ADDR", config.http_addr)?,
    };
    let address = |variable: &str, listener: &TcpListener| {
        listener
            .local_addr()
            .map_err(|e| RunError(format!("cannot read the {variable} listener address: {e}")))
    };
    let ws = match ws {
        Some(listener) => {
            let addr = address("ORCA_RELAY_WS_ADDR", &listener)?;
            Some((listener, addr))
        }
        None => None,
    };
    let http_addr = address("ORCA_RELAY_HTTP_ADDR", &http)?;
    Ok(ListenerPair {
        ws,
        http: (http, http_addr),
        http_shared,
        ws_from_systemd,
        http_from_systemd,
    })
}

/// The listeners a live handover passed, and whether each is systemd's (as the running
/// process said: `TakeOver::listening`).
pub struct Handed {
    pub ws: TcpListener,
    pub http: TcpListener,
    pub from_systemd: (bool, bool),
}

/// The listeners of a process and their addresses.
pub struct ListenerPair {
    pub ws: Option<(TcpListener, std::net::SocketAddr)>,
    pub http: (TcpListener, std::net::SocketAddr),
    /// Held by systemd's socket units (passed at a start, or carried by a handover since):
    /// their `ListenStream=` decides the address, not the variable.
    pub ws_from_systemd: bool,
    pub http_from_systemd: bool,
    /// The HTTP listener is also held by another process, which goes on accepting when this
    /// one stops: systemd's socket unit (it passed the listener), or the process this one took
    /// over from (its socket unit, if it had one). Stopping then serves the connections
    /// already accepted rather than closing them ([`crate::http::HttpServer::stop_shared`]).
    pub http_shared: bool,
}

impl ListenerPair {
    /// What a handover tells the next process of these listeners.
    pub fn listening(&self) -> Option<crate::handover::Listening> {
        let (_, ws) = self.ws.as_ref()?;
        Some(crate::handover::Listening {
            ws: *ws,
            http: self.http.1,
            ws_from_systemd: self.ws_from_systemd,
            http_from_systemd: self.http_from_systemd,
        })
    }
}

/// Whether a listener bound to `bound` is the one `configured` asks for: the same IP (a
/// wildcard only for a wildcard: `0.0.0.0` is not `127.0.0.1`, nor the reverse) and the same
/// port, any port when the configured one is 0 (the OS picked it at the first start).
pub fn holds(configured: std::net::SocketAddr, bound: std::net::SocketAddr) -> bool {
    configured.ip() == bound.ip() && (configured.port() == 0 || configured.port() == bound.port())
}

/// The next process of a live handover serves on the listeners it is handed, never on new ones:
/// each configured address must be the one its listener is bound to (SPEC §13 "Handover"),
/// except a listener systemd holds, whose socket unit decides its address as at any start.
/// `Err` names the variable: a changed listening address needs a restart.
pub fn check_carried_listeners(
    config: &Config,
    listening: &crate::handover::Listening,
) -> Result<(), RunError> {
    let checks = [
        (
            "ORCA_RELAY_WS_ADDR",
            "WebSocket",
            config.ws_addr,
            listening.ws,
            listening.ws_from_systemd,
        ),
        (
            "ORCA_RELAY_HTTP_ADDR",
            "HTTP",
            config.http_addr,
            listening.http,
            listening.http_from_systemd,
        ),
    ];
    for (variable, which, configured, bound, from_systemd) in checks {
        if !from_systemd && !holds(configured, bound) {
            return Err(RunError(format!(
                "{variable}={configured} is not where the running relay's {which} listener is bound ({bound}), and a handover keeps the listeners: a changed listening address needs a restart"
            )));
        }
    }
    Ok(())
}

/// The next process of a live handover, before it says `ready`: the same role and cell as the
/// running process, and listeners bound where its configuration says
/// ([`check_carried_listeners`]). `Err` is the cause, the setting named.
fn check_running(config: &Config, running: &crate::handover::Running) -> Result<(), RunError> {
    let role = config.role.as_str();
    if running.role != role || running.cell_id != config.cell_id {
        return Err(RunError(format!(
            "the running relay is a {} cell {:?}; this configuration runs a {role} cell {:?} (ORCA_RELAY_ROLE, ORCA_RELAY_CELL_ID: restart to change)",
            running.role, running.cell_id, config.cell_id
        )));
    }
    check_carried_listeners(config, &running.listening)
}

/// The next process of a live handover, before it says `ready` (SPEC §13): the running
/// process's role, cell and listener addresses matched when it said them
/// ([`check_running`]), then its store proven to take writes ([`prove_store_writable`]).
/// `Ok`: whether this build has migrations to apply after the commit.
pub fn prove_before_ready(
    config: &Config,
    store: &Store,
    running: Option<&crate::handover::Running>,
) -> Result<bool, RunError> {
    if let Some(running) = running {
        check_running(config, running)?;
    }
    prove_store_writable(config, store, STORE_PROOF_WAIT)
}

/// What a live handover's next process does first once it has committed, before its gate
/// opens: the first writes outside its memory. The prober starts probing, a self-hosted key
/// made for this process is saved, and the migrations (and `after`) run
/// ([`migrate_after_commit`], waited for when `migrations_pending`). The migrator's handle.
pub fn after_commit(
    prober: &mut Prober,
    key: Option<UnsavedKey>,
    store: &Store,
    migrated: &Migrated,
    after: impl Fn() -> Result<(), crate::store::StoreError> + Send + 'static,
    migrations_pending: bool,
) -> Option<std::thread::JoinHandle<()>> {
    prober.release();
    if let Some(key) = key {
        key.save();
    }
    let wait = migrations_pending.then_some(MIGRATE_AFTER_COMMIT_WAIT);
    migrate_after_commit(store, migrated, after, wait)
}

/// How long the next process of a live handover gives its store to prove it takes writes
/// (well inside the running process's 10 s).
pub const STORE_PROOF_WAIT: std::time::Duration = std::time::Duration::from_secs(3);

/// The next process of a live handover proves, before it says `ready`, that it can write its
/// store ([`Store::write_probe`]: a write that is rolled back, so nothing is left behind),
/// within `within`, and reads whether this build has migrations to apply after the commit
/// (the `Ok` value: then its controls wait for them, [`migrate_after_commit`]). `Err` names
/// the variable: `DATABASE_URL` (a closed port, a standby, a read-only server or role), or
/// `ORCA_RELAY_DATA_DIR` for SQLite.
fn prove_store_writable(
    config: &Config,
    store: &Store,
    within: std::time::Duration,
) -> Result<bool, RunError> {
    let variable = if config.database_url.is_some() {
        "DATABASE_URL"
    } else {
        "ORCA_RELAY_DATA_DIR"
    };
    let (done, result) = std::sync::mpsc::channel();
    let (probe_store, cell_id) = (store.clone(), config.cell_id.clone());
    crate::threads::spawn("store-proof", move || {
        let proof = probe_store
            .write_probe(&cell_id)
            .and_then(|()| probe_store.migrations_pending());
        let _ = done.send(proof);
    })
    .map_err(|e| RunError(format!("cannot start the store-proof thread: {e}")))?;
    match result.recv_timeout(within) {
        Ok(Ok(pending)) => Ok(pending),
        Ok(Err(e)) => Err(RunError(format!(
            "{variable}: the store cannot take writes: {e}"
        ))),
        // The thread is left to its store's own timeouts; this process exits.
        Err(_) => Err(RunError(format!(
            "{variable}: the store did not prove it takes writes within {} s",
            within.as_secs()
        ))),
    }
}

/// Opens the store and applies migrations.
pub fn open_store(config: &Config) -> Result<Store, RunError> {
    if config.database_url.is_none() {
        std::fs::create_dir_all(&config.data_dir).map_err(|e| {
            RunError(format!(
                "cannot create ORCA_RELAY_DATA_DIR {}: {e}",
                config.data_dir.display()
            ))
        })?;
    }
    let store = Store::open(&StoreConfig::from_config(config))
        .map_err(|e| RunError(format!("cannot open the database: {e}")))?;
    Ok(store)
}

/// Applies migrations: `orca-relay migrate`.
pub fn migrate(config: &Config) -> Result<(), RunError> {
    let store = open_store(config)?;
    let migrated = store.migrate();
    stop_on_tls_failure(&migrated)?;
    migrated.map_err(|e| RunError(format!("migration failed: {e}")))
}

/// Ends start-up when the database refused the connection at the TLS layer: an unknown CA, a
/// certificate for another host, a server without TLS under `require`, TLS required under
/// `disable`. Those are configuration mistakes, not an outage, so the error line
/// (`orca_relay_store_tls_failed cause=…`) goes to `systemctl status` instead of a process that
/// waits unready forever. Any other failure passes: a database that is down at boot is
/// retried in the background (SPEC §7).
pub fn stop_on_tls_failure<T>(
    result: &Result<T, crate::store::StoreError>,
) -> Result<(), RunError> {
    match result {
        Err(error) => match error.tls_failure() {
            Some(line) => Err(RunError(format!("cannot connect to the database: {line}"))),
            None => Ok(()),
        },
        Ok(_) => Ok(()),
    }
}

/// The desktop-token verifier of a role: JWKS when configured; otherwise (combined only) the
/// self-hosted HS256 key from the environment or `$DATA_DIR/self-hosted.key`.
pub fn verifier(config: &Config, clock: &SharedClock) -> Result<Verifier, RunError> {
    verifier_for(config, clock, false).map(|(verifier, _)| verifier)
}

/// [`verifier`]; `taking_over`: for a live handover's next process, which writes nothing
/// before the commit, so a self-hosted key file that does not exist yet is not created: the
/// key is held in memory and returned as an [`UnsavedKey`] to save once committed.
pub fn verifier_for(
    config: &Config,
    clock: &SharedClock,
    taking_over: bool,
) -> Result<(Verifier, Option<UnsavedKey>), RunError> {
    if let (Some(url), Some(issuer)) = (&config.jwks_url, &config.auth_issuer) {
        let verifier = Verifier::from_jwks(
            url.clone(),
            issuer.clone(),
            config.auth_audience.clone(),
            clock.clone(),
        );
        return Ok((verifier, None));
    }
    let mut unsaved = None;
    let secret = match &config.self_hosted_key {
        Some(secret) => secret.clone(),
        None => {
            let loaded = if taking_over {
                crate::auth::load_or_generate_self_hosted_key(&config.data_dir)
            } else {
                crate::auth::load_or_create_self_hosted_key(&config.data_dir)
            };
            let (secret, path, created) = loaded.map_err(|e| {
                RunError(format!(
                    "cannot read or create the self-hosted key in {}: {e}",
                    config.data_dir.display()
                ))
            })?;
            if taking_over && created {
                unsaved = Some(UnsavedKey {
                    path,
                    secret: secret.clone(),
                });
            } else {
                log::info!(
                    "orca_relay_self_hosted_key path={} created={created}",
                    path.display()
                );
            }
            secret
        }
    };
    let verifier = Verifier::from_self_hosted_key(
        &secret,
        config.auth_issuer.clone(),
        config.auth_audience.clone(),
        clock.clone(),
    );
    Ok((verifier, unsaved))
}

/// A self-hosted key a live handover's next process made and uses, not yet in its file.
pub struct UnsavedKey {
    path: std::path::PathBuf,
    secret: String,
}

impl UnsavedKey {
    /// Writes the key file once the handover has committed (never over a file: one that
    /// appeared meanwhile is kept, and this process goes on with the key it verifies with).
    pub fn save(self) {
        match crate::auth::save_self_hosted_key(&self.path, &self.secret) {
            Ok(true) => log::info!(
                "orca_relay_self_hosted_key path={} created=true",
                self.path.display()
            ),
            Ok(false) => log::warn!(
                "orca_relay_self_hosted_key_not_saved path={} cause=a_file_appeared_during_the_handover",
                self.path.display()
            ),
            Err(e) => log::warn!(
                "orca_relay_self_hosted_key_not_saved path={} error=\"{e}\"",
                self.path.display()
            ),
        }
    }
}

/// The service tokens this process sends on director↔cell calls: the first of
/// `ORCA_RELAY_SERVICE_TOKEN`'s list, then the next to a peer that refuses it (`""` when unset;
/// config refuses that for cells and directors, and the combined role generates one). Clones
/// share what they learn about each peer.
pub fn service_tokens(config: &Config) -> ServiceTokens {
    config
        .service_token
        .clone()
        .unwrap_or_else(|| ServiceTokens::single(""))
}

/// Binds a listener, naming the variable on failure.
pub fn bind(variable: &str, addr: std::net::SocketAddr) -> Result<TcpListener, RunError> {
    TcpListener::bind(addr).map_err(|e| RunError(format!("cannot bind {variable}={addr}: {e}")))
}

/// The readiness of a cell process and its running prober.
pub struct Prober {
    pub readiness: crate::readiness::Readiness,
    /// Dropped to stop the prober (first, of the fields that end it: it stands it down).
    pub stop: ProberStop,
    pub handle: crate::threads::Watched<()>,
    /// A live handover's next process: the prober probes nothing until [`Prober::release`]
    /// (after the commit; the carried verdict stands until then, and the SQL probe, a write
    /// transaction on SQLite, is not sent before it).
    held: Option<std::sync::mpsc::Sender<()>>,
    /// The prober is a critical thread: stood down before it is stopped.
    pub standing: crate::liveness::Standing,
}

/// The prober's stop. Dropping it stands the critical thread down before the channel closes,
/// so a start that fails (its `Prober` dropped on the way out) ends with its own error and exit
/// status, not also with the prober reported as a critical thread that returned (exit 70,
/// which raced the handshake failure's exit 1: `handshake_blackbox`).
pub struct ProberStop {
    standing: crate::liveness::Standing,
    _sender: std::sync::mpsc::Sender<()>,
}

impl Drop for ProberStop {
    fn drop(&mut self) {
        self.standing.stand_down();
    }
}

impl Prober {
    /// Lets a held prober start probing (a live handover has committed).
    pub fn release(&mut self) {
        if let Some(held) = self.held.take() {
            let _ = held.send(());
        }
    }
}

/// How long a draining cell waits for each of its threads to end, the claim loop's final
/// admit-effective write above all: the longest a store call takes on a database that answers
/// (a pool checkout, a connect and a statement, 5 s each). A thread still inside a database
/// call after that waits on one that stopped answering; it is left to end with the process
/// (its row, unwritten, stops counting after `TRIP_SLOT_STALE_MS` as a killed cell's does).
pub const FINAL_WRITE_WAIT: std::time::Duration = std::time::Duration::from_secs(15);

/// Builds the process's `Readiness` (graces from the config, metrics registered) and starts the
/// `readiness` prober thread: JWKS (when configured) and SQL, every `READINESS_PROBE_MS`; SQL
/// counts as failing until `migrated` is set. With `resume` (a live handover's next process),
/// the carried state stands and the thread probes only once [`Prober::release`]d.
#[allow(clippy::too_many_arguments)]
pub fn start_prober(
    config: &Config,
    registry: &crate::metrics::Registry,
    verifier: &Verifier,
    store: &Store,
    migrated: &Migrated,
    clock: &SharedClock,
    resume: Option<(
        &crate::carry::process::ReadinessRecord,
        &crate::carry::time::Carry,
    )>,
    liveness: &Liveness,
) -> Result<Prober, RunError> {
    let readiness = crate::readiness::Readiness::from_config(config);
    // A live handover's last-known-good state, before the first probe of this process.
    if let Some((record, carry)) = resume {
        readiness.restore_state(record, carry);
    }
    readiness.register_metrics(registry, clock.clone());
    register_process_metrics(registry, &readiness, clock);
    let period_ms = config.timings.readiness_probe_ms;
    let jwks: Option<crate::readiness::Probe> = if verifier.uses_jwks() {
        let verifier = verifier.clone();
        Some(Box::new(move || verifier.probe().map_err(Into::into)))
    } else {
        None
    };
    let sql_store = store.clone();
    let migrated = migrated.clone();
    let probes = crate::readiness::Probes {
        jwks,
        sql: Box::new(move || {
            sql_store
                .probe()
                .map_err(|e| crate::readiness::ProbeFailure::from(&e))?;
            if migrated.load(std::sync::atomic::Ordering::Acquire) {
                Ok(())
            } else {
                Err(crate::readiness::reason::SQL_MIGRATIONS_PENDING.into())
            }
        }),
    };
    let (stop, receiver) = std::sync::mpsc::channel();
    let prober_readiness = readiness.clone();
    let clock = clock.clone();
    let (held, hold) = match resume {
        Some(_) => {
            let (release, hold) = std::sync::mpsc::channel::<()>();
            (Some(release), Some(hold))
        }
        None => (None, None),
    };
    let (handle, standing) = liveness
        .spawn_critical_watched("readiness", crate::liveness::BEAT_PERIOD, move |beat| {
            if let Some(hold) = hold {
                // Released after the commit, or dropped when the process ends without one;
                // it beats while it waits (a critical thread never goes quiet).
                loop {
                    beat.beat();
                    match hold.recv_timeout(crate::liveness::BEAT_PERIOD) {
                        Err(std::sync::mpsc::RecvTimeoutError::Timeout) => continue,
                        _ => break,
                    }
                }
            }
            crate::readiness::run_prober(
                prober_readiness,
                probes,
                clock,
                std::time::Duration::from_millis(period_ms),
                receiver,
                &beat,
            )
        })
        .map_err(|e| RunError(format!("cannot start the readiness thread: {e}")))?;
    Ok(Prober {
        readiness,
        stop: ProberStop {
            standing: standing.clone(),
            _sender: stop,
        },
        handle,
        held,
        standing,
    })
}

/// Set once this process's migrations (and the step that has to follow them) are done. Until
/// then the SQL readiness probe fails with `sql_migrations_pending`: a database that answers
/// `SELECT 1` but has no tables yet cannot admit anyone, so `/ready` must not say 200.
pub type Migrated = std::sync::Arc<std::sync::atomic::AtomicBool>;

/// Applies migrations and then runs `after` (the combined role registers its cell there),
/// now, or, when the database does not answer, in the background until both succeed, so a
/// process whose database is down at boot still starts (SPEC §7) instead of crash-looping. An
/// error the database answered to the migrations (a broken migration) stops start-up.
pub fn migrate_in_background(
    store: &Store,
    after: impl Fn() -> Result<(), crate::store::StoreError> + Send + 'static,
) -> Result<(Migrated, Option<std::thread::JoinHandle<()>>), RunError> {
    use std::sync::atomic::Ordering;
    let migrated = Migrated::default();
    let first = store.migrate();
    stop_on_tls_failure(&first)?;
    let first = match first {
        Ok(()) => after(),
        Err(e) if !e.is_unavailable() => {
            return Err(RunError(format!("migration failed: {e}")));
        }
        Err(e) => Err(e),
    };
    let first_failure = match first {
        Ok(()) => {
            migrated.store(true, Ordering::Release);
            return Ok((migrated, None));
        }
        Err(e) => e.log_fields(),
    };
    log::warn!("orca_relay_migrations_pending {first_failure}");
    let store = store.clone();
    let done = migrated.clone();
    crate::threads::spawn("migrator", move || {
        let mut delay = std::time::Duration::from_millis(250);
        loop {
            crate::clock::sleep(delay);
            match store.migrate().and_then(|()| after()) {
                Ok(()) => {
                    done.store(true, Ordering::Release);
                    log::info!("orca_relay_migrations_applied after_retry=true");
                    return;
                }
                Err(_) => delay = (delay * 2).min(std::time::Duration::from_secs(5)),
            }
        }
    })
    .map(|handle| (migrated, Some(handle)))
    .map_err(|e| RunError(format!("cannot start the migrator thread: {e}")))
}

/// The migrations of a live handover's next process have not run before the commit (it writes
/// nothing outside its memory until then): the schema the running process served on stands in.
pub fn carried_schema() -> Migrated {
    Migrated::new(std::sync::atomic::AtomicBool::new(true))
}

/// How long a committed next process with migrations to apply waits for them before it opens
/// its gate.
pub const MIGRATE_AFTER_COMMIT_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

/// A live handover's next process, right after the commit and before any of its threads that
/// use the store start (the gate still closed; the spliced pairs, which use none, already
/// flowing): applies this build's migrations and runs `after` (the combined role registers its
/// cell) on the `migrator` thread. When migrations were pending (`wait`: read before the
/// commit), it waits up to that long for the first attempt, so nothing of this build runs on
/// the older schema; otherwise nothing waits (the migrations are a no-op, `after` a write
/// the heartbeat would make too). An attempt that fails or takes longer goes on in the
/// background, `migrated` unset until it succeeds (`/ready` then counts the SQL dependency as
/// failing, under its grace), a migration the database refuses included: the process owns its
/// connections now and cannot stop.
fn migrate_after_commit(
    store: &Store,
    migrated: &Migrated,
    after: impl Fn() -> Result<(), crate::store::StoreError> + Send + 'static,
    wait: Option<std::time::Duration>,
) -> Option<std::thread::JoinHandle<()>> {
    use std::sync::atomic::Ordering;
    let (first, first_done) = std::sync::mpsc::channel();
    let store = store.clone();
    let done = migrated.clone();
    let spawned = crate::threads::spawn("migrator", move || {
        let mut delay = std::time::Duration::from_millis(250);
        let mut failures = 0u32;
        loop {
            match store.migrate().and_then(|()| after()) {
                Ok(()) => {
                    done.store(true, Ordering::Release);
                    if failures > 0 || wait.is_some() {
                        log::info!(
                            "orca_relay_migrations_applied after_handover=true after_retry={}",
                            failures > 0
                        );
                    }
                    let _ = first.send(());
                    return;
                }
                Err(e) => {
                    if failures == 0 {
                        done.store(false, Ordering::Release);
                        log::warn!(
                            "orca_relay_migrations_pending after_handover=true {}",
                            e.log_fields()
                        );
                        let _ = first.send(());
                    }
                    failures += 1;
                }
            }
            crate::clock::sleep(delay);
            delay = (delay * 2).min(std::time::Duration::from_secs(5));
        }
    });
    match spawned {
        Ok(handle) => {
            if let Some(wait) = wait {
                if first_done.recv_timeout(wait).is_err() {
                    log::warn!(
                        "orca_relay_migrations_slow after_handover=true waited_ms={}",
                        wait.as_millis()
                    );
                }
            }
            Some(handle)
        }
        Err(e) => {
            migrated.store(false, Ordering::Release);
            log::error!("orca_relay_migrator_spawn_failed error={e}");
            None
        }
    }
}

/// The process's liveness registry (its critical threads, its pause clock), with the test
/// knob `ORCA_RELAY_TEST_FAULT` armed when set (one WARN line says so).
pub fn liveness(config: &Config, clock: &SharedClock) -> Result<Liveness, RunError> {
    if let Some(fault) = &config.test_fault {
        log::warn!("orca_relay_test_fault fault={fault} note=test_knob_never_set_in_production");
    }
    Liveness::new(clock.clone(), config.test_fault.clone())
        .map_err(|e| RunError(format!("cannot start the pause-clock thread: {e}")))
}

/// Starts the systemd watchdog thread when `WATCHDOG_USEC` is set: every half interval it
/// sends `WATCHDOG=1` only while every critical thread has beaten within its bound
/// (`Liveness::stale` finds none) and its own `GET /health` on the HTTP listener got an answer
/// (the HTTP server accepts and serves; the answer's status is the same judgement again), so a
/// wedged process stops petting the watchdog and systemd kills it (SIGABRT) and restarts it.
/// A failed check is logged once (the stale threads, or the request's error), again only when
/// what fails changes, and once more when the checks pass again.
pub fn start_systemd_watchdog(
    http_addr: std::net::SocketAddr,
    liveness: &Liveness,
) -> Result<(), RunError> {
    let Some(interval) = crate::lifecycle::watchdog_interval() else {
        return Ok(());
    };
    let period = crate::lifecycle::watchdog_send_period(interval);
    let url = format!("http://{http_addr}/health");
    let liveness = liveness.clone();
    crate::threads::spawn("systemd-watchdog", move || {
        let agent = ureq::AgentBuilder::new()
            .timeout(std::time::Duration::from_secs(2))
            .build();
        // What the last failed check said: a failure is logged once, and again only when
        // what fails changes (a wedged HTTP acceptor first fails the request, then its beat).
        let mut failing: Option<String> = None;
        loop {
            let stale = liveness.stale();
            let failure = if stale.is_empty() {
                match agent.get(&url).call() {
                    Ok(_) | Err(ureq::Error::Status(..)) => None,
                    Err(e) => Some(format!("url={url} error={:?}", e.to_string())),
                }
            } else {
                let names: Vec<&str> = stale.iter().map(|s| s.name.as_str()).collect();
                Some(format!("stale={}", names.join(",")))
            };
            match failure {
                None => {
                    crate::lifecycle::notify_watchdog();
                    if failing.take().is_some() {
                        log::info!("orca_relay_liveness_check_recovered");
                    }
                }
                Some(failure) => {
                    if failing.as_ref() != Some(&failure) {
                        log::warn!("orca_relay_liveness_check_failed {failure} watchdog=withheld");
                    }
                    failing = Some(failure);
                }
            }
            crate::clock::sleep(period);
        }
    })
    .map(|_| ())
    .map_err(|e| RunError(format!("cannot start the systemd-watchdog thread: {e}")))
}

/// A bound listener and its real address (port 0 asks the OS for a free one).
pub fn bind_with_addr(
    variable: &str,
    addr: std::net::SocketAddr,
) -> Result<(TcpListener, std::net::SocketAddr), RunError> {
    let listener = bind(variable, addr)?;
    let bound = listener
        .local_addr()
        .map_err(|e| RunError(format!("cannot read the {variable} listener address: {e}")))?;
    Ok((listener, bound))
}

/// A URL that defaults to `<scheme>://<configured addr>`: when the operator asked for port 0,
/// the listener's real address stands in for the default.
pub fn url_for_bound(
    configured_url: &str,
    scheme: &str,
    configured: std::net::SocketAddr,
    bound: std::net::SocketAddr,
) -> String {
    if configured.port() == 0 && configured_url == format!("{scheme}://{configured}") {
        format!("{scheme}://{bound}")
    } else {
        configured_url.to_string()
    }
}

/// A gate `/ready` waits for beyond the readiness verdict: closed until the role can serve what
/// `/ready` advertises. The combined role opens it once its own director would place a desktop
/// on its cell (`director::assign::Fleet::places_on`); before that, a 200 would send the load
/// balancer a client the process answers 503 `relay_capacity_exhausted`.
#[derive(Clone, Default)]
pub struct ServeGate(Arc<AtomicBool>);

impl ServeGate {
    pub fn open(&self) {
        self.0.store(true, Ordering::Release);
    }

    pub fn is_open(&self) -> bool {
        self.0.load(Ordering::Acquire)
    }
}

/// The endpoints every role serves: `/health` (touches nothing), `/ready` (the readiness
/// verdict, never blocking on a dependency) and `/metrics`; and, while the process starts,
/// the answer to every other request (SPEC §8: until registration succeeds, `/health` 200,
/// everything else 503), so a role's own routes and its 404 come after it.
pub struct ProcessRoutes {
    pub registry: crate::metrics::Registry,
    pub readiness: crate::readiness::Readiness,
    pub clock: SharedClock,
    /// `/metrics` answers 503 `starting` while readiness is in its starting phase, as every
    /// other path does (SPEC §8: a cell in its startup handshake serves only `/health`). The
    /// director's starting phase is its wait for the database (migrations), which may last:
    /// it keeps `/metrics`, so `orca_relay_ready` stays visible to the alert that watches it.
    pub metrics_wait_for_start: bool,
    /// See [`ServeGate`]; `None`: `/ready` is the readiness verdict alone.
    pub ready_gate: Option<ServeGate>,
    /// `/health` answers 503 naming the critical threads that have not beaten within their
    /// bound (SPEC §13).
    pub liveness: Liveness,
}

impl ProcessRoutes {
    /// `/health`, `/ready` and `/metrics`; while starting, every other request too (503
    /// `starting`, `Retry-After: 2`: unknown paths, other methods, the role's own routes).
    /// `None`: the caller routes on.
    pub fn route(&self, request: &crate::http::Request<'_>) -> Option<crate::http::Reply> {
        use crate::http::Reply;
        let starting = self.readiness.phase() == crate::readiness::Phase::Starting;
        match (request.method, request.path) {
            ("GET", "/health") => Some(health(&self.liveness)),
            ("GET", "/ready") => {
                let verdict = self.readiness.answer(self.clock.now_ms());
                let gated = self.ready_gate.as_ref().is_some_and(|gate| !gate.is_open());
                if verdict.status == 200 && gated {
                    return Some(Reply::json(503, r#"{"error":"starting"}"#));
                }
                Some(Reply::json(verdict.status, verdict.body))
            }
            ("GET", "/metrics") if !(self.metrics_wait_for_start && starting) => {
                Some(Reply::text(200, self.registry.render()))
            }
            _ if starting => Some(Reply::error(503, "starting").with_header("Retry-After", "2")),
            _ => None,
        }
    }
}

/// `/health`: 200 `{"ok":true}` while every critical thread beats; 503
/// `{"ok":false,"stale":[…]}` naming the ones that have not within their bound, so the
/// autohealing probe fails for a wedged process. It touches no dependency (SPEC §7): the
/// judgement reads the beats in memory.
fn health(liveness: &Liveness) -> crate::http::Reply {
    let stale = liveness.stale();
    if stale.is_empty() {
        return crate::http::Reply::json(200, r#"{"ok":true}"#);
    }
    let names: Vec<&str> = stale.iter().map(|s| s.name.as_str()).collect();
    let body = serde_json::json!({ "ok": false, "stale": names });
    crate::http::Reply::json(503, body.to_string())
}

/// Raises the soft descriptor limit to the hard one (one descriptor per WebSocket; the unit's
/// `LimitNOFILE=` sets the hard limit), logging what changed.
pub fn raise_fd_limit() {
    match crate::lifecycle::raise_fd_limit() {
        Ok((old, new)) if old != new => {
            log::info!("orca_relay_fd_limit_raised from={old} to={new}")
        }
        Ok(_) => {}
        Err(e) => log::warn!("orca_relay_fd_limit_unchanged error={e}"),
    }
}

/// Metrics of the process itself, on every role: when it started (a restart shows as a new
/// value) and whether `/ready` answers 200 now (degraded included).
pub fn register_process_metrics(
    registry: &crate::metrics::Registry,
    readiness: &crate::readiness::Readiness,
    clock: &SharedClock,
) {
    let started_s = clock.now_ms() as f64 / 1000.0;
    registry.sampled_gauge(
        "orca_relay_process_start_time_seconds",
        "Start time of the process since the Unix epoch, in seconds.",
        move || vec![(vec![], started_s)],
    );
    let version = crate::handover::version();
    registry.sampled_gauge(
        "orca_relay_build_info",
        "1, labelled with this build's version (a live handover shows the new one at once).",
        move || vec![(vec![("version".to_string(), version.clone())], 1.0)],
    );
    let readiness = readiness.clone();
    let clock = clock.clone();
    registry.sampled_gauge(
        "orca_relay_ready",
        "1 when /ready answers 200 (degraded included); 0 while starting, draining or failing.",
        move || {
            let ready = readiness.answer(clock.now_ms()).status == 200;
            vec![(vec![], f64::from(u8::from(ready)))]
        },
    );
}

/// The store's metrics, on every role: pool connections, ceiling and waiters, and the SQL
/// statements this process has sent.
pub fn register_store_metrics(registry: &crate::metrics::Registry, store: &Store) {
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
}

/// The end of a cell process's shutdown order, after the cell drained and HTTP stopped: stop
/// the prober, join what has finished, close the signal listener.
pub fn finish_process(
    role: &str,
    prober: Prober,
    migrator: Option<std::thread::JoinHandle<()>>,
    signals: std::thread::JoinHandle<()>,
    shutdown: &crate::lifecycle::Shutdown,
) {
    prober.standing.stand_down();
    drop(prober.stop);
    // A probe still waiting on a database that stopped answering is left to end with the
    // process (STOP_WAIT).
    prober
        .handle
        .join_within("readiness", crate::threads::STOP_WAIT);
    // A migrator still retrying against a dead database is left to end with the process.
    if let Some(migrator) = migrator.filter(|m| m.is_finished()) {
        crate::threads::join_logged("migrator", migrator);
    }
    shutdown.close_signal_listener();
    crate::threads::join_logged("signals", signals);
    log::info!("orca_relay_shutdown_finished role={role}");
}

/// The service manager's notify socket, when this process keeps its connections in the
/// manager's descriptor store (`crash_store`): `ORCA_RELAY_CRASH_STORE` on and a manager there
/// (a live handover's next process has adopted the running one's). Making the store sends
/// nothing: a handover's next process writes to the manager only once it owns the connections.
pub fn crash_store_socket(config: &Config) -> Option<std::ffi::OsString> {
    if !config.crash_store {
        return None;
    }
    crate::lifecycle::notify_socket()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::http::Request;
    use crate::readiness::{Phase, Readiness};

    fn routes(metrics_wait_for_start: bool) -> ProcessRoutes {
        ProcessRoutes {
            registry: crate::metrics::Registry::new(),
            readiness: Readiness::new(false, 1_000, 1_000),
            clock: crate::clock::ManualClock::starting_at(1_000),
            metrics_wait_for_start,
            ready_gate: None,
            liveness: Liveness::detached(crate::clock::ManualClock::starting_at(1_000)),
        }
    }

    fn status(routes: &ProcessRoutes, method: &str, path: &str) -> Option<u16> {
        let mut body = Vec::new();
        let request = Request::new(method, path, "", None, &mut body);
        routes.route(&request).map(|reply| reply.status)
    }

    /// A handover keeps its listeners: the configured address must be the one each is bound
    /// to (port 0: any port), a wildcard only for a wildcard; a systemd-held listener's
    /// address is its socket unit's.
    #[test]
    fn a_configured_address_is_held_only_by_the_listener_bound_to_it() {
        let addr = |text: &str| text.parse::<std::net::SocketAddr>().unwrap();
        assert!(holds(addr("127.0.0.1:8080"), addr("127.0.0.1:8080")));
        assert!(holds(addr("127.0.0.1:0"), addr("127.0.0.1:41234")));
        assert!(holds(addr("0.0.0.0:8080"), addr("0.0.0.0:8080")));
        assert!(holds(addr("[::]:8080"), addr("[::]:8080")));
        assert!(!holds(addr("127.0.0.1:9090"), addr("127.0.0.1:8080")));
        assert!(!holds(addr("0.0.0.0:8080"), addr("127.0.0.1:8080")));
        assert!(!holds(addr("127.0.0.1:8080"), addr("0.0.0.0:8080")));
        assert!(!holds(addr("10.0.0.5:0"), addr("127.0.0.1:8080")));
        assert!(!holds(addr("[::]:8080"), addr("0.0.0.0:8080")));

        let config = crate::config::Config::from_lookup(&|name| match name {
            "ORCA_RELAY_WS_ADDR" => Some("0.0.0.0:8080".into()),
            "ORCA_RELAY_HTTP_ADDR" => Some("127.0.0.1:0".into()),
            _ => None,
        })
        .unwrap();
        let mut listening = crate::handover::Listening {
            ws: addr("0.0.0.0:8080"),
            http: addr("127.0.0.1:40001"),
            ws_from_systemd: false,
            http_from_systemd: false,
        };
        assert!(check_carried_listeners(&config, &listening).is_ok());
        listening.ws = addr("127.0.0.1:8080");
        let refused = check_carried_listeners(&config, &listening).unwrap_err().0;
        assert!(
            refused.starts_with("ORCA_RELAY_WS_ADDR=0.0.0.0:8080 is not where")
                && refused.ends_with("a changed listening address needs a restart"),
            "{refused}"
        );
        listening.ws_from_systemd = true;
        assert!(check_carried_listeners(&config, &listening).is_ok());
        listening.http = addr("127.0.0.2:40001");
        let refused = check_carried_listeners(&config, &listening).unwrap_err().0;
        assert!(refused.starts_with("ORCA_RELAY_HTTP_ADDR="), "{refused}");
    }

    /// SPEC §8: until registration succeeds, `/health` 200 and everything else 503, whatever
    /// the path or method; the director keeps `/metrics` through its wait for the database.
    #[test]
    fn while_starting_everything_but_health_answers_503() {
        for (routes, metrics) in [(routes(true), 503), (routes(false), 200)] {
            assert_eq!(status(&routes, "GET", "/health"), Some(200));
            assert_eq!(status(&routes, "GET", "/ready"), Some(503));
            assert_eq!(status(&routes, "GET", "/metrics"), Some(metrics));
            for (method, path) in [
                ("GET", "/no-such-path"),
                ("POST", "/metrics"),
                ("POST", "/health"),
                ("POST", "/v1/assign"),
                ("GET", "/v1/admin/cells"),
                ("PUT", "/internal/seats"),
            ] {
                assert_eq!(status(&routes, method, path), Some(503), "{method} {path}");
            }
            routes.readiness.set_phase(Phase::Serving);
            assert_eq!(status(&routes, "GET", "/metrics"), Some(200));
            assert_eq!(
                status(&routes, "GET", "/no-such-path"),
                None,
                "the role's 404"
            );
            assert_eq!(
                status(&routes, "POST", "/v1/assign"),
                None,
                "the role's route"
            );
        }
    }
}
