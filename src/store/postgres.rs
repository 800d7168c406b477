//! The PostgreSQL backend: every statement the relay sends to PostgreSQL, except the slot
//! claim, which reads as one transaction in [`super::claim`]. Time that machines compare is
//! `relay_now_ms()` (migration 0003: `now()` in ms), never a parameter.
//!
//! Runs on the calling thread with a pooled `postgres::Client`. Each connection carries the
//! configured `application_name` (so an operator can count a process's share of
//! `max_connections` in `pg_stat_activity`), a connect timeout, and a server-side
//! `statement_timeout` set through the startup `options`. TLS follows `DATABASE_URL`'s
//! `sslmode` and `sslrootcert` (or `ORCA_RELAY_DATABASE_CA_FILE`) through [`super::tls`]; a
//! connection refused at the TLS layer is the `orca_relay_store_tls_failed` error.
//!
//! Must never: keep a connection that errored (it is discarded, and after a connection-level
//! failure every idle one is too, since they most likely point at the same dead server), or put
//! the connection string into an error.

use std::sync::Arc;
use std::time::Duration;

use postgres::error::SqlState;
use postgres::{Client, NoTls, Row};

use super::claim::{self, ClaimRequest};
use super::pg_statements::{self, commit, execute, query, query_one, query_opt};
use super::pool::{Connector, Pool, PoolCounts};
use super::tls::DatabaseTlsConnector;
use super::{
    AdmitEffective, Assignment, CellRow, CellRuntime, ClaimOutcome, Heartbeat, HeartbeatOutcome,
    LeaseOutcome, LeaseRow, StatementCounter, StoreConfig, StoreError, CELL_TABLES, LIST_CELLS,
    UNREGISTERED_LEFTOVERS,
};
use crate::clock;
use crate::database_tls::SslMode;

/// The migrations, in order, embedded at build time.
const MIGRATIONS: &[(i64, &str)] = &[
    (1, include_str!("../../sql/postgres/0001_init.sql")),
    (2, include_str!("../../sql/postgres/0002_internal_url.sql")),
    (3, include_str!("../../sql/postgres/0003_db_clock.sql")),
];

/// The advisory-lock key that serialises migrations across processes: the ASCII bytes of
/// "orcamigr". Distinct from the trip-slot key in `claim.rs`.
const MIGRATION_LOCK_KEY: i64 = 0x6f72_6361_6d69_6772;

/// Opens connections with the relay's session settings, over TLS as `sslmode` says.
pub(super) struct PgConnector {
    config: postgres::Config,
    tls: DatabaseTlsConnector,
}

impl Connector for PgConnector {
    type Conn = Client;

    fn connect(&self) -> Result<Client, StoreError> {
        let connected = match &self.tls.make {
            Some(make) => self.config.connect(make.clone()),
            None => self.config.connect(NoTls),
        };
        match connected {
            Ok(client) => {
                self.tls.connected();
                Ok(client)
            }
            Err(error) => Err(self
                .tls
                .failure(&error)
                .unwrap_or_else(|| StoreError::Unavailable(format!("connect failed: {error}")))),
        }
    }

    fn is_usable(&self, conn: &Client) -> bool {
        !conn.is_closed()
    }
}

pub(super) struct PgStore {
    pool: Pool<PgConnector>,
    statements: Arc<StatementCounter>,
    checkout_timeout: Duration,
}

/// True when the error says the connection (not the statement) failed.
fn connection_failed(error: &postgres::Error) -> bool {
    if error.is_closed() {
        return true;
    }
    if let Some(code) = error.code() {
        // Class 08: connection exception; 57P01-57P03: the server is shutting down or starting.
        let code = code.code();
        return code.starts_with("08") || code.starts_with("57P");
    }
    std::error::Error::source(error).is_some_and(|source| source.is::<std::io::Error>())
}

/// True when the error says the server ended the connection before answering: it closed the
/// socket (its end of a pooled connection it terminated, restarted or lost to a failover), or
/// it said it is shutting down (57P01-57P03) or the connection is gone (class 08). Not a
/// timeout: a server that stopped answering may still be working on what it got.
fn closed_by_server(error: &postgres::Error) -> bool {
    if error.is_closed() {
        return true;
    }
    if let Some(code) = error.code() {
        let code = code.code();
        return code.starts_with("08") || code.starts_with("57P");
    }
    std::error::Error::source(error)
        .and_then(|source| source.downcast_ref::<std::io::Error>())
        .is_some_and(|io| {
            matches!(
                io.kind(),
                std::io::ErrorKind::ConnectionReset
                    | std::io::ErrorKind::ConnectionAborted
                    | std::io::ErrorKind::BrokenPipe
                    | std::io::ErrorKind::UnexpectedEof
            )
        })
}

/// Turns a driver error into a short store error that names what was being done and, when the
/// server said why, its SQLSTATE (`(sqlstate 57P01)`: [`StoreError::code`]).
pub(super) fn store_error(error: &postgres::Error, context: &str) -> StoreError {
    let sqlstate = error
        .code()
        .map(|code| format!(" (sqlstate {})", code.code()))
        .unwrap_or_default();
    if error.code() == Some(&SqlState::QUERY_CANCELED) {
        return StoreError::timed_out(&format!("{context}{sqlstate}"));
    }
    let said = error
        .as_db_error()
        .map_or_else(|| error.to_string(), |db| db.message().to_string());
    if connection_failed(error)
        || error.code() == Some(&SqlState::TOO_MANY_CONNECTIONS)
        || error.code() == Some(&SqlState::READ_ONLY_SQL_TRANSACTION)
    {
        // A write refused by a read-only server (a standby) is an outage of the writable
        // database, not a bad statement: callers retry later, readiness says `sql_read_only`.
        return StoreError::Unavailable(format!("{context}: {said}{sqlstate}"));
    }
    StoreError::Query(format!("{context}: {said}{sqlstate}"))
}

impl PgStore {
    pub(super) fn open(url: &str, config: &StoreConfig) -> Result<PgStore, StoreError> {
        // `sslmode` and `sslrootcert` are ours (the driver knows neither verify-* nor the root
        // certificate); the rest of the URL is the driver's. Config validated both already.
        let ca_file = config
            .database_ca_file
            .as_ref()
            .map(|path| path.display().to_string());
        let (driver_url, tls) =
            crate::database_tls::parse(url, ca_file.as_deref()).map_err(|refused| {
                StoreError::Query(format!(
                    "invalid {} {}: expected {}",
                    refused.variable, refused.value, refused.expected
                ))
            })?;
        let mut pg: postgres::Config = driver_url.parse().map_err(|_| {
            StoreError::Query("DATABASE_URL is not a valid postgres connection string".into())
        })?;
        // Every statement runs under a server-side timeout (SPEC §6.1); keep any options the
        // URL already carries.
        let statement_timeout = format!("-c statement_timeout={}", config.statement_timeout_ms);
        let options = match pg.get_options() {
            Some(existing) if !existing.trim().is_empty() => {
                format!("{existing} {statement_timeout}")
            }
            _ => statement_timeout,
        };
        // The statement timeout is enforced by the server; a server that vanishes without a
        // reset (a dropped route) is caught by the kernel instead: unacknowledged data older
        // than the statement timeout plus the connect timeout ends the connection. A request
        // the server's kernel acknowledged leaves nothing unacknowledged while the answer is
        // awaited: keepalive probes (after 2 s of silence, every second) come under the same
        // timeout, so a server that vanished then (a partition that healed after the server
        // restarted: its reset was lost) ends the call too, where it waited for hours (the
        // kernel's 2-hour keepalive default; found by the nemesis).
        let tcp_user_timeout = config
            .statement_timeout_ms
            .saturating_add(config.connect_timeout_ms);
        pg.options(&options)
            .application_name(&config.application_name)
            .connect_timeout(Duration::from_millis(config.connect_timeout_ms.max(1)))
            .tcp_user_timeout(Duration::from_millis(tcp_user_timeout.max(1)))
            .keepalives(true)
            .keepalives_idle(Duration::from_secs(2))
            .keepalives_interval(Duration::from_secs(1))
            .ssl_mode(match tls.mode {
                SslMode::Disable => postgres::config::SslMode::Disable,
                SslMode::Prefer => postgres::config::SslMode::Prefer,
                SslMode::Require | SslMode::VerifyCa | SslMode::VerifyFull => {
                    postgres::config::SslMode::Require
                }
            });
        let host = match pg.get_hosts().first() {
            Some(postgres::config::Host::Tcp(host)) => host.clone(),
            Some(postgres::config::Host::Unix(path)) => path.display().to_string(),
            None => "localhost".to_string(),
        };
        let tls_connector = DatabaseTlsConnector::new(&tls, host)?;
        log::info!("orca_relay_store_tls {}", tls.summary());
        let connector = PgConnector {
            config: pg,
            tls: tls_connector,
        };
        let pool = Pool::new(connector, config.pool_max);
        pool.set_ceiling(config.pool_ceiling);
        Ok(PgStore {
            pool,
            statements: Arc::new(StatementCounter::default()),
            checkout_timeout: Duration::from_millis(config.checkout_timeout_ms),
        })
    }

    pub(super) fn statements(&self) -> &StatementCounter {
        &self.statements
    }

    pub(super) fn pool_counts(&self) -> PoolCounts {
        self.pool.counts()
    }

    pub(super) fn set_ceiling(&self, ceiling: u32) {
        self.pool.set_ceiling(ceiling)
    }

    pub(super) fn warm(&self, count: u32) -> u32 {
        self.pool.warm(count, self.checkout_timeout)
    }

    /// Runs `work` on a pooled connection. On error the connection is discarded (and, after a
    /// connection-level failure, every idle one too).
    ///
    /// Work that failed because the server had closed the pooled connection it got (a restart,
    /// a failover, an administrator's `pg_terminate_backend`: the first use of a connection
    /// that sat idle meanwhile) is run once more on a newly opened connection (SPEC §12), but
    /// only if nothing it sent may have committed (`pg_statements::may_have_committed`: no
    /// autocommit write, no `COMMIT` sent). So a failover costs the first caller a reconnect,
    /// not an error, and a write is never applied twice.
    fn with_client<T>(
        &self,
        context: &str,
        mut work: impl FnMut(&mut Client, &StatementCounter) -> Result<T, postgres::Error>,
    ) -> Result<T, StoreError> {
        let mut conn = self.pool.checkout(self.checkout_timeout)?;
        let reused = conn.reused();
        pg_statements::begin_work();
        let error = match work(&mut conn, &self.statements) {
            Ok(value) => return Ok(value),
            Err(error) => error,
        };
        conn.discard();
        drop(conn);
        if connection_failed(&error) {
            self.pool.discard_idle();
        }
        let retry = reused && closed_by_server(&error) && !pg_statements::may_have_committed();
        if !retry {
            return Err(store_error(&error, context));
        }
        log::info!(
            "orca_relay_store_connection_replaced context=\"{context}\" {}",
            store_error(&error, context).log_fields()
        );
        let mut conn = self.pool.checkout_fresh(self.checkout_timeout)?;
        pg_statements::begin_work();
        match work(&mut conn, &self.statements) {
            Ok(value) => Ok(value),
            Err(error) => {
                conn.discard();
                drop(conn);
                if connection_failed(&error) {
                    self.pool.discard_idle();
                }
                Err(store_error(&error, context))
            }
        }
    }

    pub(super) fn migrate(&self) -> Result<(), StoreError> {
        self.with_client("migrate", |client, n| {
            n.bump();
            let mut tx = client.transaction()?;
            // Held until COMMIT: a second process migrating at once waits here, then finds
            // every version applied.
            execute(
                &mut tx,
                n,
                "SELECT pg_advisory_xact_lock($1)",
                &[&MIGRATION_LOCK_KEY],
            )?;
            n.bump();
            tx.batch_execute(
                "CREATE TABLE IF NOT EXISTS schema_migrations (
                     version    BIGINT PRIMARY KEY,
                     applied_at BIGINT NOT NULL
                 )",
            )?;
            for (version, sql) in MIGRATIONS {
                let applied = query_opt(
                    &mut tx,
                    n,
                    "SELECT version FROM schema_migrations WHERE version = $1",
                    &[version],
                )?;
                if applied.is_none() {
                    n.bump();
                    tx.batch_execute(sql)?;
                    let now = clock::system().now_ms() as i64;
                    execute(
                        &mut tx,
                        n,
                        "INSERT INTO schema_migrations (version, applied_at) VALUES ($1, $2)",
                        &[version, &now],
                    )?;
                }
            }
            commit(tx, n)
        })
    }

    /// Whether a migration of this build is not applied yet (read only; no `schema_migrations`
    /// table: all of them).
    pub(super) fn migrations_pending(&self) -> Result<bool, StoreError> {
        self.with_client("read applied migrations", |client, n| {
            let rows = match query(client, n, "SELECT version FROM schema_migrations", &[]) {
                Ok(rows) => rows,
                Err(error) if error.code() == Some(&SqlState::UNDEFINED_TABLE) => return Ok(true),
                Err(error) => return Err(error),
            };
            let applied: Vec<i64> = rows
                .iter()
                .map(|row| row.try_get(0))
                .collect::<Result<_, _>>()?;
            Ok(MIGRATIONS
                .iter()
                .any(|(version, _)| !applied.contains(version)))
        })
    }

    pub(super) fn ping(&self) -> Result<(), StoreError> {
        self.with_client("ping", |client, n| {
            query_one(client, n, "SELECT 1", &[]).map(|_| ())
        })
    }

    /// The readiness probe: one round trip asking whether this server takes writes. A standby
    /// (in recovery) answers `SELECT 1` happily and refuses every write; so does a primary
    /// whose transactions default to read-only.
    pub(super) fn probe(&self) -> Result<(), StoreError> {
        let (in_recovery, read_only) = self.with_client("probe", |client, n| {
            let row = query_one(
                client,
                n,
                "SELECT pg_is_in_recovery(), current_setting('transaction_read_only') = 'on'",
                &[],
            )?;
            Ok((row.try_get::<_, bool>(0)?, row.try_get::<_, bool>(1)?))
        })?;
        match (in_recovery, read_only) {
            (true, _) => Err(StoreError::read_only(
                "the server is a standby (in recovery)",
            )),
            (false, true) => Err(StoreError::read_only(
                "the server's transactions are read-only",
            )),
            (false, false) => Ok(()),
        }
    }

    /// A live handover's next process proves it can write ([`super::Store::write_probe`]), in
    /// one transaction that is rolled back: the probe's question (a standby, a read-only
    /// server or role), then a real write, of the cell's own registration row to itself (a
    /// role without the right to write is refused there; the row lock is held for the
    /// transaction only, nothing changes). A database without the schema yet (its migrations
    /// come after the commit) is judged by the question alone.
    pub(super) fn write_probe(&self, cell_id: &str) -> Result<(), StoreError> {
        let (in_recovery, read_only) = self.with_client("write probe", |client, n| {
            n.bump();
            let mut tx = client.transaction()?;
            let row = query_one(
                &mut tx,
                n,
                "SELECT pg_is_in_recovery(), current_setting('transaction_read_only') = 'on'",
                &[],
            )?;
            let flags: (bool, bool) = (row.try_get(0)?, row.try_get(1)?);
            if flags == (false, false) {
                let written = execute(
                    &mut tx,
                    n,
                    "UPDATE relay_cells SET cell_url = cell_url WHERE cell_id = $1",
                    &[&cell_id],
                );
                match written {
                    Ok(_) => {}
                    Err(error) if error.code() == Some(&SqlState::UNDEFINED_TABLE) => {}
                    Err(error) => return Err(error),
                }
            }
            n.bump();
            tx.rollback()?;
            Ok(flags)
        })?;
        match (in_recovery, read_only) {
            (true, _) => Err(StoreError::read_only(
                "the server is a standby (in recovery)",
            )),
            (false, true) => Err(StoreError::read_only(
                "the server's transactions are read-only",
            )),
            (false, false) => Ok(()),
        }
    }

    pub(super) fn now_ms(&self) -> Result<i64, StoreError> {
        self.with_client("read the database clock", |client, n| {
            query_one(client, n, "SELECT relay_now_ms()", &[])?.try_get(0)
        })
    }

    pub(super) fn assignment(
        &self,
        user_id: &str,
        relay_host_id: &str,
    ) -> Result<Option<Assignment>, StoreError> {
        self.with_client("read assignment", |client, n| {
            let row = query_opt(
                client,
                n,
                "SELECT cell_id, assignment_epoch, updated_at FROM relay_assignments
                 WHERE user_id = $1 AND relay_host_id = $2",
                &[&user_id, &relay_host_id],
            )?;
            row.map(|row| {
                Ok(Assignment {
                    user_id: user_id.to_string(),
                    relay_host_id: relay_host_id.to_string(),
                    cell_id: row.try_get(0)?,
                    epoch: row.try_get(1)?,
                    updated_at: row.try_get(2)?,
                })
            })
            .transpose()
        })
    }

    pub(super) fn place_assignment_if_newer(
        &self,
        user_id: &str,
        relay_host_id: &str,
        cell_id: &str,
        epoch: i64,
        now_ms: i64,
    ) -> Result<bool, StoreError> {
        // In a transaction, so that a pooled connection found closed is retried (nothing
        // commits before COMMIT) instead of failing the placement.
        self.with_client("place assignment", |client, n| {
            n.bump();
            let mut tx = client.transaction()?;
            let written = execute(
                &mut tx,
                n,
                "INSERT INTO relay_assignments
                     (user_id, relay_host_id, cell_id, assignment_epoch, updated_at)
                 VALUES ($1, $2, $3, $4, $5)
                 ON CONFLICT (user_id, relay_host_id) DO UPDATE
                     SET cell_id = excluded.cell_id,
                         assignment_epoch = excluded.assignment_epoch,
                         updated_at = excluded.updated_at
                     WHERE relay_assignments.assignment_epoch < excluded.assignment_epoch",
                &[&user_id, &relay_host_id, &cell_id, &epoch, &now_ms],
            )?;
            commit(tx, n)?;
            Ok(written == 1)
        })
    }

    pub(super) fn renew_lease(&self, lease: &LeaseRow<'_>) -> Result<LeaseOutcome, StoreError> {
        self.with_client("renew lease", |client, n| {
            n.bump();
            let mut tx = client.transaction()?;
            // FOR SHARE: a placement that would move the desktop waits for this transaction,
            // so a lease is never renewed for a row that has already moved on.
            let still_here = query_opt(
                &mut tx,
                n,
                "SELECT 1 FROM relay_assignments
                 WHERE user_id = $1 AND relay_host_id = $2 AND cell_id = $3
                   AND assignment_epoch = $4
                 FOR SHARE",
                &[
                    &lease.user_id,
                    &lease.relay_host_id,
                    &lease.cell_id,
                    &lease.epoch,
                ],
            )?
            .is_some();
            let outcome = if still_here {
                execute(
                    &mut tx,
                    n,
                    "INSERT INTO relay_assignment_activity_leases
                         (activity_id, user_id, relay_host_id, cell_id, activity_kind,
                          expires_at, updated_at)
                     VALUES ($1, $2, $3, $4, $5, $6, $7)
                     ON CONFLICT (activity_id) DO UPDATE
                         SET user_id = excluded.user_id,
                             relay_host_id = excluded.relay_host_id,
                             cell_id = excluded.cell_id,
                             activity_kind = excluded.activity_kind,
                             expires_at = excluded.expires_at,
                             updated_at = excluded.updated_at",
                    &[
                        &lease.activity_id,
                        &lease.user_id,
                        &lease.relay_host_id,
                        &lease.cell_id,
                        &lease.kind,
                        &lease.expires_at,
                        &lease.now_ms,
                    ],
                )?;
                LeaseOutcome::Renewed
            } else {
                execute(
                    &mut tx,
                    n,
                    "DELETE FROM relay_assignment_activity_leases WHERE activity_id = $1",
                    &[&lease.activity_id],
                )?;
                LeaseOutcome::Moved
            };
            commit(tx, n)?;
            Ok(outcome)
        })
    }

    pub(super) fn delete_lease(&self, activity_id: &str) -> Result<(), StoreError> {
        self.with_client("delete lease", |client, n| {
            execute(
                client,
                n,
                "DELETE FROM relay_assignment_activity_leases WHERE activity_id = $1",
                &[&activity_id],
            )
            .map(|_| ())
        })
    }

    pub(super) fn lease_exists(&self, activity_id: &str, now_ms: i64) -> Result<bool, StoreError> {
        self.with_client("read lease", |client, n| {
            let row = query_opt(
                client,
                n,
                "SELECT 1 FROM relay_assignment_activity_leases
                 WHERE activity_id = $1 AND expires_at > $2",
                &[&activity_id, &now_ms],
            )?;
            Ok(row.is_some())
        })
    }

    pub(super) fn live_leases_for_host(
        &self,
        relay_host_id: &str,
        now_ms: i64,
    ) -> Result<usize, StoreError> {
        self.with_client("count leases", |client, n| {
            let row = query_opt(
                client,
                n,
                "SELECT COUNT(*) FROM relay_assignment_activity_leases
                 WHERE relay_host_id = $1 AND expires_at > $2",
                &[&relay_host_id, &now_ms],
            )?;
            Ok(row.map(|row| row.get::<_, i64>(0)).unwrap_or(0) as usize)
        })
    }

    pub(super) fn register_cell(
        &self,
        cell_id: &str,
        cell_url: &str,
        internal_url: Option<&str>,
        region: &str,
        incarnation: i64,
    ) -> Result<(), StoreError> {
        // One write in a transaction: retried on a fresh connection if the pooled one was
        // closed (a director answering 503 to a registration stops the cell's start).
        self.with_client("register cell", |client, n| {
            n.bump();
            let mut tx = client.transaction()?;
            execute(
                &mut tx,
                n,
                "INSERT INTO relay_cells
                     (cell_id, cell_url, internal_url, region, incarnation, registered_at)
                 VALUES ($1, $2, $3, $4, $5, relay_now_ms())
                 ON CONFLICT (cell_id) DO UPDATE
                     SET cell_url = excluded.cell_url,
                         internal_url = COALESCE(excluded.internal_url, relay_cells.internal_url),
                         region = excluded.region,
                         incarnation = excluded.incarnation,
                         registered_at = excluded.registered_at
                     WHERE relay_cells.incarnation <= excluded.incarnation",
                &[&cell_id, &cell_url, &internal_url, &region, &incarnation],
            )?;
            commit(tx, n)
        })
    }

    pub(super) fn deregister_cell(
        &self,
        cell_id: &str,
        incarnation: i64,
    ) -> Result<bool, StoreError> {
        self.with_client("deregister cell", |client, n| {
            n.bump();
            let mut tx = client.transaction()?;
            let removed = execute(
                &mut tx,
                n,
                "DELETE FROM relay_cells WHERE cell_id = $1 AND incarnation = $2",
                &[&cell_id, &incarnation],
            )?;
            execute(
                &mut tx,
                n,
                "DELETE FROM relay_cell_runtime WHERE cell_id = $1 AND cell_incarnation <= $2",
                &[&cell_id, &incarnation],
            )?;
            commit(tx, n)?;
            Ok(removed == 1)
        })
    }

    pub(super) fn forget_silent_cells(&self, silent_ms: i64) -> Result<Vec<String>, StoreError> {
        self.with_client("forget silent cells", |client, n| {
            n.bump();
            let mut tx = client.transaction()?;
            // 1. Registered cells silent past the age: every row they have.
            let silent: Vec<String> = query(
                &mut tx,
                n,
                "SELECT c.cell_id FROM relay_cells c
                 LEFT JOIN relay_cell_runtime r ON r.cell_id = c.cell_id
                 WHERE relay_now_ms() - GREATEST(c.registered_at,
                                                 COALESCE(r.last_heartbeat_at, c.registered_at))
                       > $1",
                &[&silent_ms],
            )?
            .iter()
            .map(|row| row.try_get(0))
            .collect::<Result<_, _>>()?;
            for table in CELL_TABLES {
                execute(
                    &mut tx,
                    n,
                    &format!("DELETE FROM {table} WHERE cell_id = ANY($1)"),
                    &[&silent],
                )?;
            }
            // 2. Rows left by cells no longer registered, untouched for as long.
            for (table, stamp) in UNREGISTERED_LEFTOVERS {
                execute(
                    &mut tx,
                    n,
                    &format!(
                        "DELETE FROM {table}
                         WHERE cell_id NOT IN (SELECT cell_id FROM relay_cells)
                           AND relay_now_ms() - {stamp} > $1"
                    ),
                    &[&silent_ms],
                )?;
            }
            commit(tx, n)?;
            Ok(silent)
        })
    }

    pub(super) fn delete_expired_leases(&self, expired_for_ms: i64) -> Result<u64, StoreError> {
        self.with_client("delete expired leases", |client, n| {
            execute(
                client,
                n,
                "DELETE FROM relay_assignment_activity_leases
                 WHERE expires_at < relay_now_ms() - $1",
                &[&expired_for_ms],
            )
        })
    }

    pub(super) fn heartbeat(
        &self,
        beat: &Heartbeat<'_>,
    ) -> Result<(HeartbeatOutcome, bool), StoreError> {
        self.with_client("record heartbeat", |client, n| {
            n.bump();
            let mut tx = client.transaction()?;
            let registered = query_opt(
                &mut tx,
                n,
                "SELECT incarnation FROM relay_cells WHERE cell_id = $1",
                &[&beat.cell_id],
            )?;
            let Some(row) = registered else {
                return Ok((HeartbeatOutcome::Unregistered, false));
            };
            let registered_incarnation: i64 = row.try_get(0)?;
            if beat.incarnation < registered_incarnation {
                return Ok((HeartbeatOutcome::StaleIncarnation, false));
            }
            if beat.incarnation > registered_incarnation {
                // This incarnation's registration is not in the database (a lost write):
                // accepted, the row would name the old incarnation for good.
                return Ok((HeartbeatOutcome::Unregistered, false));
            }
            // The WHERE makes the runtime check and the write one atomic step.
            let written = execute(
                &mut tx,
                n,
                "INSERT INTO relay_cell_runtime
                     (cell_id, cell_incarnation, started_at, ready, connections, last_heartbeat_at)
                 VALUES ($1, $2, $3, $4, $5, relay_now_ms())
                 ON CONFLICT (cell_id) DO UPDATE
                     SET cell_incarnation = excluded.cell_incarnation,
                         started_at = excluded.started_at,
                         ready = excluded.ready,
                         connections = excluded.connections,
                         last_heartbeat_at = excluded.last_heartbeat_at
                     WHERE relay_cell_runtime.cell_incarnation <= excluded.cell_incarnation",
                &[
                    &beat.cell_id,
                    &beat.incarnation,
                    &beat.started_at,
                    &beat.ready,
                    &beat.connections,
                ],
            )?;
            // What the cell advertises now (a live handover may have changed it): the
            // registration follows, written only when it differs.
            let mut advertised = 0;
            if let (1, Some(ad)) = (written, &beat.advertised) {
                advertised = execute(
                    &mut tx,
                    n,
                    "UPDATE relay_cells
                        SET cell_url = $2, region = $3,
                            internal_url = COALESCE($4::text, internal_url)
                      WHERE cell_id = $1 AND incarnation = $5
                        AND (cell_url <> $2 OR region <> $3
                             OR ($4::text IS NOT NULL
                                 AND internal_url IS DISTINCT FROM $4::text))",
                    &[
                        &beat.cell_id,
                        &ad.cell_url,
                        &ad.region,
                        &ad.internal_url,
                        &beat.incarnation,
                    ],
                )?;
            }
            commit(tx, n)?;
            Ok(if written == 1 {
                (HeartbeatOutcome::Accepted, advertised == 1)
            } else {
                (HeartbeatOutcome::StaleIncarnation, false)
            })
        })
    }

    pub(super) fn set_admit_mode(&self, cell_id: &str, admit_mode: &str) -> Result<(), StoreError> {
        self.with_client("set admit mode", |client, n| {
            n.bump();
            let mut tx = client.transaction()?;
            execute(
                &mut tx,
                n,
                "INSERT INTO relay_cell_admit_modes (cell_id, admit_mode, updated_at)
                 VALUES ($1, $2, relay_now_ms())
                 ON CONFLICT (cell_id) DO UPDATE
                     SET admit_mode = excluded.admit_mode, updated_at = excluded.updated_at",
                &[&cell_id, &admit_mode],
            )?;
            commit(tx, n)
        })
    }

    pub(super) fn list_cells(&self) -> Result<Vec<CellRow>, StoreError> {
        self.with_client("list cells", |client, n| {
            let rows = query(client, n, LIST_CELLS, &[])?;
            rows.iter().map(cell_row).collect()
        })
    }

    pub(super) fn write_admit_effective(
        &self,
        cell_id: &str,
        incarnation: i64,
        mode: &str,
    ) -> Result<(), StoreError> {
        self.with_client("write admit-effective row", |client, n| {
            n.bump();
            let mut tx = client.transaction()?;
            execute(
                &mut tx,
                n,
                "INSERT INTO relay_cell_admit_effective (cell_id, cell_incarnation, mode, updated_at)
                 VALUES ($1, $2, $3, relay_now_ms())
                 ON CONFLICT (cell_id) DO UPDATE
                     SET cell_incarnation = excluded.cell_incarnation,
                         mode = excluded.mode,
                         updated_at = excluded.updated_at",
                &[&cell_id, &incarnation, &mode],
            )?;
            commit(tx, n)
        })
    }

    pub(super) fn admit_effective(
        &self,
        cell_id: &str,
    ) -> Result<Option<AdmitEffective>, StoreError> {
        self.with_client("read admit-effective row", |client, n| {
            let row = query_opt(
                client,
                n,
                "SELECT cell_incarnation, mode, updated_at, relay_now_ms() - updated_at
                 FROM relay_cell_admit_effective
                 WHERE cell_id = $1",
                &[&cell_id],
            )?;
            row.map(|row| {
                Ok(AdmitEffective {
                    cell_incarnation: row.try_get(0)?,
                    mode: row.try_get(1)?,
                    updated_at: row.try_get(2)?,
                    age_ms: row.try_get(3)?,
                })
            })
            .transpose()
        })
    }

    pub(super) fn claim_trip_slot(
        &self,
        request: &ClaimRequest<'_>,
    ) -> Result<ClaimOutcome, StoreError> {
        self.with_client("claim trip slot", |client, n| {
            claim::claim_postgres(client, n, request)
        })
    }
}

fn cell_row(row: &Row) -> Result<CellRow, postgres::Error> {
    let runtime_incarnation: Option<i64> = row.try_get(5)?;
    let runtime = match runtime_incarnation {
        Some(cell_incarnation) => Some(CellRuntime {
            cell_incarnation,
            started_at: row.try_get(6)?,
            ready: row.try_get(7)?,
            connections: row.try_get(8)?,
            last_heartbeat_at: row.try_get(9)?,
            heartbeat_age_ms: row.try_get(16)?,
        }),
        None => None,
    };
    let admit_mode: Option<String> = row.try_get(10)?;
    let effective_incarnation: Option<i64> = row.try_get(11)?;
    let effective = match effective_incarnation {
        Some(cell_incarnation) => Some(AdmitEffective {
            cell_incarnation,
            mode: row.try_get(12)?,
            updated_at: row.try_get(13)?,
            age_ms: row.try_get(17)?,
        }),
        None => None,
    };
    Ok(CellRow {
        cell_id: row.try_get(0)?,
        cell_url: row.try_get(1)?,
        internal_url: row.try_get(14)?,
        region: row.try_get(2)?,
        incarnation: row.try_get(3)?,
        registered_at: row.try_get(4)?,
        registered_age_ms: row.try_get(15)?,
        runtime,
        admit_mode: admit_mode.unwrap_or_else(|| super::MODE_DB.to_string()),
        admit_mode_updated_at: row.try_get(18)?,
        effective,
    })
}
