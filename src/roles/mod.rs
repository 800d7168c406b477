//! Role wiring: build the shared state, start every named thread of the role, own their
//! handles, and run the shutdown order. Nothing here makes a decision of its own.

pub mod combined;
pub mod director;

use std::fmt;
use std::net::TcpListener;
use std::path::PathBuf;

use crate::auth::Verifier;
use crate::clock::SharedClock;
use crate::config::{Config, Role};
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

/// Runs the configured role until shutdown.
pub fn run(config: Config) -> Result<(), RunError> {
    match config.role {
        Role::Combined => combined::run(config),
        Role::Director => director::run(config),
        Role::Cell => Err(RunError(format!(
            "the {} role is not available in this build yet",
            config.role.as_str()
        ))),
    }
}

/// The store settings of a role.
pub fn store_config(config: &Config) -> StoreConfig {
    StoreConfig {
        database_url: config.database_url.clone(),
        sqlite_path: config.data_dir.join("relay.db"),
        pool_max: config.pool_max,
        pool_ceiling: config.pool_max,
        application_name: config.application_name(),
        statement_timeout_ms: 5_000,
        connect_timeout_ms: 5_000,
        checkout_timeout_ms: 5_000,
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
    let store = Store::open(&store_config(config))
        .map_err(|e| RunError(format!("cannot open the database: {e}")))?;
    Ok(store)
}

/// Applies migrations: `orca-relay migrate`.
pub fn migrate(config: &Config) -> Result<(), RunError> {
    let store = open_store(config)?;
    store
        .migrate()
        .map_err(|e| RunError(format!("migration failed: {e}")))
}

/// The desktop-token verifier of a role: JWKS when configured; otherwise (combined only) the
/// self-hosted HS256 key from the environment or `$DATA_DIR/self-hosted.key`.
pub fn verifier(config: &Config, clock: &SharedClock) -> Result<Verifier, RunError> {
    if let (Some(url), Some(issuer)) = (&config.jwks_url, &config.auth_issuer) {
        return Ok(Verifier::from_jwks(
            url.clone(),
            issuer.clone(),
            config.auth_audience.clone(),
            clock.clone(),
        ));
    }
    let secret = match &config.self_hosted_key {
        Some(secret) => secret.clone(),
        None => {
            let (secret, path, created) =
                crate::auth::load_or_create_self_hosted_key(&config.data_dir).map_err(|e| {
                    RunError(format!(
                        "cannot read or create the self-hosted key in {}: {e}",
                        config.data_dir.display()
                    ))
                })?;
            log::info!(
                "orca_relay_self_hosted_key path={} created={created}",
                path.display()
            );
            secret
        }
    };
    Ok(Verifier::from_self_hosted_key(
        &secret,
        config.auth_issuer.clone(),
        config.auth_audience.clone(),
        clock.clone(),
    ))
}

/// Binds a listener, naming the variable on failure.
pub fn bind(variable: &str, addr: std::net::SocketAddr) -> Result<TcpListener, RunError> {
    TcpListener::bind(addr).map_err(|e| RunError(format!("cannot bind {variable}={addr}: {e}")))
}

/// Where the self-hosted key lives for a data directory.
pub fn self_hosted_key_path(data_dir: &std::path::Path) -> PathBuf {
    data_dir.join("self-hosted.key")
}
