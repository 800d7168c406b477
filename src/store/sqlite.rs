//! The SQLite backend: every statement the relay sends to SQLite, except the slot claim, which
//! reads as one transaction in [`super::claim`].
//!
//! Runs on the calling thread with a pooled `rusqlite::Connection` on one file. The file is in
//! WAL mode with a busy timeout, so several threads and several processes (a combined process
//! and a `migrate` run, say) share it safely; every read-then-write transaction starts with
//! `BEGIN IMMEDIATE`, so two writers never deadlock upgrading read locks.
//!
//! Must never: keep a connection that errored, or wait on the write lock during a claim (the
//! claim runs with a zero busy timeout and answers `LockBusy` instead).

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use rusqlite::functions::FunctionFlags;
use rusqlite::{
    params, Connection, ErrorCode, OpenFlags, OptionalExtension, Row, TransactionBehavior,
};

use super::claim::{self, ClaimRequest};
use super::pool::{Connector, Pool, PoolCounts};
use super::{
    AdmitEffective, Assignment, CellRow, CellRuntime, ClaimOutcome, Heartbeat, HeartbeatOutcome,
    LeaseOutcome, LeaseRow, StatementCounter, StoreConfig, StoreError, CELL_TABLES, LIST_CELLS,
    UNREGISTERED_LEFTOVERS,
};
use crate::clock::{self, SharedClock};

/// The migrations, in order, embedded at build time.
const MIGRATIONS: &[(i64, &str)] = &[
    (1, include_str!("../../sql/sqlite/0001_init.sql")),
    (2, include_str!("../../sql/sqlite/0002_internal_url.sql")),
    (3, include_str!("../../sql/sqlite/0003_db_clock.sql")),
];

/// Opens connections to one database file with the relay's settings.
pub(super) struct SqliteConnector {
    path: std::path::PathBuf,
    busy_timeout: Duration,
    /// What `relay_now_ms()` reads: the database's clock on SQLite.
    clock: SharedClock,
}

impl Connector for SqliteConnector {
    type Conn = Connection;

    fn connect(&self) -> Result<Connection, StoreError> {
        open_connection(&self.path, self.busy_timeout, &self.clock).map_err(|error| {
            StoreError::Unavailable(format!(
                "open sqlite database {} failed: {error}",
                self.path.display()
            ))
        })
    }
}

fn open_connection(
    path: &Path,
    busy_timeout: Duration,
    clock: &SharedClock,
) -> Result<Connection, rusqlite::Error> {
    let flags = OpenFlags::SQLITE_OPEN_READ_WRITE
        | OpenFlags::SQLITE_OPEN_CREATE
        | OpenFlags::SQLITE_OPEN_NO_MUTEX;
    let conn = Connection::open_with_flags(path, flags)?;
    // The busy timeout first: switching to WAL briefly needs a lock another process may hold.
    conn.busy_timeout(busy_timeout)?;
    let _mode: String = conn.query_row("PRAGMA journal_mode = WAL", [], |row| row.get(0))?;
    conn.execute_batch("PRAGMA synchronous = NORMAL; PRAGMA foreign_keys = OFF;")?;
    // The database's clock (PostgreSQL's is `now()`, migration 0003). Not deterministic: SQLite
    // calls it each time a statement evaluates it.
    let clock = clock.clone();
    conn.create_scalar_function("relay_now_ms", 0, FunctionFlags::SQLITE_UTF8, move |_| {
        Ok(i64::try_from(clock.now_ms()).unwrap_or(i64::MAX))
    })?;
    Ok(conn)
}

pub(super) struct SqliteStore {
    /// The database file (its filesystem's free space is part of the readiness probe).
    path: std::path::PathBuf,
    pool: Pool<SqliteConnector>,
    statements: Arc<StatementCounter>,
    checkout_timeout: Duration,
    busy_timeout: Duration,
}

/// True when the error says the file or the connection (not the statement) failed.
fn connection_failed(error: &rusqlite::Error) -> bool {
    matches!(
        error.sqlite_error_code(),
        Some(
            ErrorCode::CannotOpen
                | ErrorCode::SystemIoFailure
                | ErrorCode::DiskFull
                | ErrorCode::NotADatabase
                | ErrorCode::DatabaseCorrupt
                | ErrorCode::PermissionDenied
                | ErrorCode::ReadOnly
        )
    )
}

/// SQLite's name of a primary result code (`SQLITE_FULL`), as its documentation spells it.
fn code_name(code: ErrorCode) -> &'static str {
    match code {
        ErrorCode::InternalMalfunction => "SQLITE_INTERNAL",
        ErrorCode::PermissionDenied => "SQLITE_PERM",
        ErrorCode::OperationAborted => "SQLITE_ABORT",
        ErrorCode::DatabaseBusy => "SQLITE_BUSY",
        ErrorCode::DatabaseLocked => "SQLITE_LOCKED",
        ErrorCode::OutOfMemory => "SQLITE_NOMEM",
        ErrorCode::ReadOnly => "SQLITE_READONLY",
        ErrorCode::OperationInterrupted => "SQLITE_INTERRUPT",
        ErrorCode::SystemIoFailure => "SQLITE_IOERR",
        ErrorCode::DatabaseCorrupt => "SQLITE_CORRUPT",
        ErrorCode::NotFound => "SQLITE_NOTFOUND",
        ErrorCode::DiskFull => "SQLITE_FULL",
        ErrorCode::CannotOpen => "SQLITE_CANTOPEN",
        ErrorCode::FileLockingProtocolFailed => "SQLITE_PROTOCOL",
        ErrorCode::SchemaChanged => "SQLITE_SCHEMA",
        ErrorCode::TooBig => "SQLITE_TOOBIG",
        ErrorCode::ConstraintViolation => "SQLITE_CONSTRAINT",
        ErrorCode::TypeMismatch => "SQLITE_MISMATCH",
        ErrorCode::ApiMisuse => "SQLITE_MISUSE",
        ErrorCode::NoLargeFileSupport => "SQLITE_NOLFS",
        ErrorCode::AuthorizationForStatementDenied => "SQLITE_AUTH",
        ErrorCode::ParameterOutOfRange => "SQLITE_RANGE",
        ErrorCode::NotADatabase => "SQLITE_NOTADB",
        _ => "SQLITE_ERROR",
    }
}

/// Turns a rusqlite error into a store error that names what was being done and, when SQLite
/// gave one, its result code (`(sqlite SQLITE_FULL)`: [`StoreError::code`]).
fn store_error(error: &rusqlite::Error, context: &str) -> StoreError {
    let code = error
        .sqlite_error_code()
        .map(|code| format!(" (sqlite {})", code_name(code)))
        .unwrap_or_default();
    if claim::is_busy(error) {
        // The busy timeout ran out: SQLite's form of a statement timeout.
        return StoreError::timed_out(&format!("{context}: {error}{code}"));
    }
    if connection_failed(error) {
        return StoreError::Unavailable(format!("{context}: {error}{code}"));
    }
    StoreError::Query(format!("{context}: {error}{code}"))
}

/// The free space below which the database's filesystem counts as full for the readiness
/// probe: SQLite grows its file and its write-ahead log a page (4 KiB) or a few at a time, so
/// with less than this left the next growth fails (`SQLITE_FULL`) even if this probe's own
/// write still fits.
pub const DISK_FULL_BELOW_BYTES: u64 = 256 * 1024;

/// Bytes an unprivileged writer may still use on the filesystem holding `path`.
fn available_bytes(path: &Path) -> std::io::Result<u64> {
    use std::os::unix::ffi::OsStrExt;
    let c_path = std::ffi::CString::new(path.as_os_str().as_bytes())
        .map_err(|_| std::io::Error::from(std::io::ErrorKind::InvalidInput))?;
    // SAFETY: `c_path` is a valid NUL-terminated string and `stat` a plain struct the call
    // fills in; nothing is retained after it returns.
    let mut stat: libc::statvfs = unsafe { std::mem::zeroed() };
    if unsafe { libc::statvfs(c_path.as_ptr(), &mut stat) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok((stat.f_bavail as u64).saturating_mul(stat.f_frsize as u64))
}

/// Runs one statement (cached per connection); counts it.
fn execute(
    conn: &Connection,
    n: &StatementCounter,
    sql: &str,
    params: impl rusqlite::Params,
) -> Result<usize, rusqlite::Error> {
    n.bump();
    conn.prepare_cached(sql)?.execute(params)
}

/// Runs one statement and maps its first row, if any; counts it.
fn query_opt<T>(
    conn: &Connection,
    n: &StatementCounter,
    sql: &str,
    params: impl rusqlite::Params,
    map: impl FnOnce(&Row<'_>) -> Result<T, rusqlite::Error>,
) -> Result<Option<T>, rusqlite::Error> {
    n.bump();
    conn.prepare_cached(sql)?.query_row(params, map).optional()
}

impl SqliteStore {
    pub(super) fn open(
        config: &StoreConfig,
        clock: SharedClock,
    ) -> Result<SqliteStore, StoreError> {
        if let Some(parent) = config.sqlite_path.parent() {
            if !parent.as_os_str().is_empty() {
                std::fs::create_dir_all(parent).map_err(|error| {
                    StoreError::Unavailable(format!(
                        "create data directory {} failed: {error}",
                        parent.display()
                    ))
                })?;
            }
        }
        let busy_timeout = Duration::from_millis(config.statement_timeout_ms);
        let pool = Pool::new(
            SqliteConnector {
                path: config.sqlite_path.clone(),
                busy_timeout,
                clock,
            },
            config.pool_max,
        );
        pool.set_ceiling(config.pool_ceiling);
        Ok(SqliteStore {
            path: config.sqlite_path.clone(),
            pool,
            statements: Arc::new(StatementCounter::default()),
            checkout_timeout: Duration::from_millis(config.checkout_timeout_ms),
            busy_timeout,
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

    /// Runs `work` on a pooled connection; on error the connection is discarded.
    fn with_conn<T>(
        &self,
        context: &str,
        work: impl FnOnce(&mut Connection, &StatementCounter) -> Result<T, rusqlite::Error>,
    ) -> Result<T, StoreError> {
        let mut conn = self.pool.checkout(self.checkout_timeout)?;
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
        self.with_conn("migrate", |conn, n| {
            // BEGIN IMMEDIATE takes the write lock up front: a second process migrating at
            // once waits here (busy timeout), then finds every version applied.
            n.bump();
            let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
            n.bump();
            tx.execute_batch(
                "CREATE TABLE IF NOT EXISTS schema_migrations (
                     version    BIGINT PRIMARY KEY,
                     applied_at BIGINT NOT NULL
                 )",
            )?;
            for (version, sql) in MIGRATIONS {
                let applied = query_opt(
                    &tx,
                    n,
                    "SELECT version FROM schema_migrations WHERE version = ?1",
                    params![version],
                    |row| row.get::<_, i64>(0),
                )?;
                if applied.is_none() {
                    n.bump();
                    tx.execute_batch(sql)?;
                    let now = clock::system().now_ms() as i64;
                    execute(
                        &tx,
                        n,
                        "INSERT INTO schema_migrations (version, applied_at) VALUES (?1, ?2)",
                        params![version, now],
                    )?;
                }
            }
            n.bump();
            tx.commit()
        })
    }

    /// Whether a migration of this build is not applied yet (read only: a database file that
    /// does not exist is not created; it has every migration to come).
    pub(super) fn migrations_pending(&self) -> Result<bool, StoreError> {
        if std::fs::symlink_metadata(&self.path).is_err() {
            return Ok(true);
        }
        self.with_conn("read applied migrations", |conn, n| {
            let table = query_opt(
                conn,
                n,
                "SELECT name FROM sqlite_master WHERE type = 'table' AND name = 'schema_migrations'",
                [],
                |row| row.get::<_, String>(0),
            )?;
            if table.is_none() {
                return Ok(true);
            }
            n.bump();
            let mut statement = conn.prepare_cached("SELECT version FROM schema_migrations")?;
            let applied = statement
                .query_map([], |row| row.get::<_, i64>(0))?
                .collect::<Result<Vec<i64>, _>>()?;
            Ok(MIGRATIONS
                .iter()
                .any(|(version, _)| !applied.contains(version)))
        })
    }

    pub(super) fn ping(&self) -> Result<(), StoreError> {
        self.with_conn("ping", |conn, n| {
            query_opt(conn, n, "SELECT 1", [], |row| row.get::<_, i64>(0)).map(|_| ())
        })
    }

    /// The readiness probe: a write transaction that must commit (it rewrites the header's
    /// `user_version` with its own value), and room on the database's filesystem for the next
    /// growth of its files ([`DISK_FULL_BELOW_BYTES`]).
    pub(super) fn probe(&self) -> Result<(), StoreError> {
        self.with_conn("probe", |conn, n| {
            n.bump();
            let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
            n.bump();
            let version: i64 = tx.query_row("PRAGMA user_version", [], |row| row.get(0))?;
            n.bump();
            tx.execute_batch(&format!("PRAGMA user_version = {version}"))?;
            n.bump();
            tx.commit()
        })?;
        self.check_room()
    }

    /// A live handover's next process proves it can write ([`super::Store::write_probe`]): the
    /// probe's write transaction, rolled back (nothing of it reaches the file), and room on
    /// the filesystem. A database file that does not exist yet (its migrations come after the
    /// commit) is not created: its directory must be one this process may create it in.
    pub(super) fn write_probe(&self) -> Result<(), StoreError> {
        match std::fs::symlink_metadata(&self.path) {
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => {
                use std::os::unix::ffi::OsStrExt;
                let directory = self.directory();
                let c_path = std::ffi::CString::new(directory.as_os_str().as_bytes())
                    .map_err(|_| StoreError::Unavailable("a data directory with a NUL".into()))?;
                // SAFETY: `c_path` is a valid NUL-terminated string; access(2) only reads it.
                if unsafe { libc::access(c_path.as_ptr(), libc::W_OK | libc::X_OK) } != 0 {
                    return Err(StoreError::Unavailable(format!(
                        "cannot create {} in {}: {}",
                        self.path.display(),
                        directory.display(),
                        std::io::Error::last_os_error()
                    )));
                }
            }
            _ => self.with_conn("write probe", |conn, n| {
                n.bump();
                let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
                n.bump();
                let version: i64 = tx.query_row("PRAGMA user_version", [], |row| row.get(0))?;
                n.bump();
                tx.execute_batch(&format!("PRAGMA user_version = {version}"))?;
                n.bump();
                tx.rollback()
            })?,
        }
        self.check_room()
    }

    /// The directory the database file is in.
    fn directory(&self) -> &Path {
        self.path
            .parent()
            .filter(|parent| !parent.as_os_str().is_empty())
            .unwrap_or(Path::new("."))
    }

    /// Room for the database's files to grow (`sql_disk_full` below the threshold).
    fn check_room(&self) -> Result<(), StoreError> {
        let directory = self.directory();
        match available_bytes(directory) {
            Ok(available) if available < DISK_FULL_BELOW_BYTES => Err(StoreError::disk_full(
                &format!(
                    "{available} bytes left on the filesystem of {} (at least {DISK_FULL_BELOW_BYTES} needed)",
                    self.path.display()
                ),
            )),
            // A filesystem that cannot say is judged by the write above alone.
            Ok(_) | Err(_) => Ok(()),
        }
    }

    pub(super) fn now_ms(&self) -> Result<i64, StoreError> {
        self.with_conn("read the database clock", |conn, n| {
            query_opt(conn, n, "SELECT relay_now_ms()", [], |row| row.get(0))
                .map(|now| now.unwrap_or_default())
        })
    }

    pub(super) fn assignment(
        &self,
        user_id: &str,
        relay_host_id: &str,
    ) -> Result<Option<Assignment>, StoreError> {
        self.with_conn("read assignment", |conn, n| {
            query_opt(
                conn,
                n,
                "SELECT cell_id, assignment_epoch, updated_at FROM relay_assignments
                 WHERE user_id = ?1 AND relay_host_id = ?2",
                params![user_id, relay_host_id],
                |row| {
                    Ok(Assignment {
                        user_id: user_id.to_string(),
                        relay_host_id: relay_host_id.to_string(),
                        cell_id: row.get(0)?,
                        epoch: row.get(1)?,
                        updated_at: row.get(2)?,
                    })
                },
            )
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
        self.with_conn("place assignment", |conn, n| {
            let written = execute(
                conn,
                n,
                "INSERT INTO relay_assignments
                     (user_id, relay_host_id, cell_id, assignment_epoch, updated_at)
                 VALUES (?1, ?2, ?3, ?4, ?5)
                 ON CONFLICT (user_id, relay_host_id) DO UPDATE
                     SET cell_id = excluded.cell_id,
                         assignment_epoch = excluded.assignment_epoch,
                         updated_at = excluded.updated_at
                     WHERE relay_assignments.assignment_epoch < excluded.assignment_epoch",
                params![user_id, relay_host_id, cell_id, epoch, now_ms],
            )?;
            Ok(written == 1)
        })
    }

    pub(super) fn renew_lease(&self, lease: &LeaseRow<'_>) -> Result<LeaseOutcome, StoreError> {
        self.with_conn("renew lease", |conn, n| {
            // IMMEDIATE: the check and the write see the same assignment row.
            n.bump();
            let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
            let still_here = query_opt(
                &tx,
                n,
                "SELECT 1 FROM relay_assignments
                 WHERE user_id = ?1 AND relay_host_id = ?2 AND cell_id = ?3
                   AND assignment_epoch = ?4",
                params![
                    lease.user_id,
                    lease.relay_host_id,
                    lease.cell_id,
                    lease.epoch
                ],
                |row| row.get::<_, i64>(0),
            )?
            .is_some();
            let outcome = if still_here {
                execute(
                    &tx,
                    n,
                    "INSERT INTO relay_assignment_activity_leases
                         (activity_id, user_id, relay_host_id, cell_id, activity_kind,
                          expires_at, updated_at)
                     VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)
                     ON CONFLICT (activity_id) DO UPDATE
                         SET user_id = excluded.user_id,
                             relay_host_id = excluded.relay_host_id,
                             cell_id = excluded.cell_id,
                             activity_kind = excluded.activity_kind,
                             expires_at = excluded.expires_at,
                             updated_at = excluded.updated_at",
                    params![
                        lease.activity_id,
                        lease.user_id,
                        lease.relay_host_id,
                        lease.cell_id,
                        lease.kind,
                        lease.expires_at,
                        lease.now_ms
                    ],
                )?;
                LeaseOutcome::Renewed
            } else {
                execute(
                    &tx,
                    n,
                    "DELETE FROM relay_assignment_activity_leases WHERE activity_id = ?1",
                    params![lease.activity_id],
                )?;
                LeaseOutcome::Moved
            };
            n.bump();
            tx.commit()?;
            Ok(outcome)
        })
    }

    pub(super) fn delete_lease(&self, activity_id: &str) -> Result<(), StoreError> {
        self.with_conn("delete lease", |conn, n| {
            execute(
                conn,
                n,
                "DELETE FROM relay_assignment_activity_leases WHERE activity_id = ?1",
                params![activity_id],
            )
            .map(|_| ())
        })
    }

    pub(super) fn lease_exists(&self, activity_id: &str, now_ms: i64) -> Result<bool, StoreError> {
        self.with_conn("read lease", |conn, n| {
            let row = query_opt(
                conn,
                n,
                "SELECT 1 FROM relay_assignment_activity_leases
                 WHERE activity_id = ?1 AND expires_at > ?2",
                params![activity_id, now_ms],
                |row| row.get::<_, i64>(0),
            )?;
            Ok(row.is_some())
        })
    }

    pub(super) fn live_leases_for_host(
        &self,
        relay_host_id: &str,
        now_ms: i64,
    ) -> Result<usize, StoreError> {
        self.with_conn("count leases", |conn, n| {
            let row = query_opt(
                conn,
                n,
                "SELECT COUNT(*) FROM relay_assignment_activity_leases
                 WHERE relay_host_id = ?1 AND expires_at > ?2",
                params![relay_host_id, now_ms],
                |row| row.get::<_, i64>(0),
            )?;
            Ok(row.unwrap_or(0) as usize)
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
        self.with_conn("register cell", |conn, n| {
            execute(
                conn,
                n,
                "INSERT INTO relay_cells
                     (cell_id, cell_url, internal_url, region, incarnation, registered_at)
                 VALUES (?1, ?2, ?3, ?4, ?5, relay_now_ms())
                 ON CONFLICT (cell_id) DO UPDATE
                     SET cell_url = excluded.cell_url,
                         internal_url = COALESCE(excluded.internal_url, relay_cells.internal_url),
                         region = excluded.region,
                         incarnation = excluded.incarnation,
                         registered_at = excluded.registered_at
                     WHERE relay_cells.incarnation <= excluded.incarnation",
                params![cell_id, cell_url, internal_url, region, incarnation],
            )
            .map(|_| ())
        })
    }

    pub(super) fn deregister_cell(
        &self,
        cell_id: &str,
        incarnation: i64,
    ) -> Result<bool, StoreError> {
        self.with_conn("deregister cell", |conn, n| {
            n.bump();
            let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
            let removed = execute(
                &tx,
                n,
                "DELETE FROM relay_cells WHERE cell_id = ?1 AND incarnation = ?2",
                params![cell_id, incarnation],
            )?;
            execute(
                &tx,
                n,
                "DELETE FROM relay_cell_runtime WHERE cell_id = ?1 AND cell_incarnation <= ?2",
                params![cell_id, incarnation],
            )?;
            n.bump();
            tx.commit()?;
            Ok(removed == 1)
        })
    }

    pub(super) fn forget_silent_cells(&self, silent_ms: i64) -> Result<Vec<String>, StoreError> {
        self.with_conn("forget silent cells", |conn, n| {
            n.bump();
            let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
            // 1. Registered cells silent past the age: every row they have.
            let silent: Vec<String> = {
                n.bump();
                let mut statement = tx.prepare_cached(
                    "SELECT c.cell_id FROM relay_cells c
                     LEFT JOIN relay_cell_runtime r ON r.cell_id = c.cell_id
                     WHERE relay_now_ms() - MAX(c.registered_at,
                                                COALESCE(r.last_heartbeat_at, c.registered_at))
                           > ?1",
                )?;
                let ids = statement.query_map(params![silent_ms], |row| row.get(0))?;
                ids.collect::<Result<_, _>>()?
            };
            for cell_id in &silent {
                for table in CELL_TABLES {
                    execute(
                        &tx,
                        n,
                        &format!("DELETE FROM {table} WHERE cell_id = ?1"),
                        params![cell_id],
                    )?;
                }
            }
            // 2. Rows left by cells no longer registered, untouched for as long.
            for (table, stamp) in UNREGISTERED_LEFTOVERS {
                execute(
                    &tx,
                    n,
                    &format!(
                        "DELETE FROM {table}
                         WHERE cell_id NOT IN (SELECT cell_id FROM relay_cells)
                           AND relay_now_ms() - {stamp} > ?1"
                    ),
                    params![silent_ms],
                )?;
            }
            n.bump();
            tx.commit()?;
            Ok(silent)
        })
    }

    pub(super) fn delete_expired_leases(&self, expired_for_ms: i64) -> Result<u64, StoreError> {
        self.with_conn("delete expired leases", |conn, n| {
            execute(
                conn,
                n,
                "DELETE FROM relay_assignment_activity_leases
                 WHERE expires_at < relay_now_ms() - ?1",
                params![expired_for_ms],
            )
            .map(|deleted| deleted as u64)
        })
    }

    pub(super) fn heartbeat(
        &self,
        beat: &Heartbeat<'_>,
    ) -> Result<(HeartbeatOutcome, bool), StoreError> {
        self.with_conn("record heartbeat", |conn, n| {
            let registered = query_opt(
                conn,
                n,
                "SELECT incarnation FROM relay_cells WHERE cell_id = ?1",
                params![beat.cell_id],
                |row| row.get::<_, i64>(0),
            )?;
            let Some(registered) = registered else {
                return Ok((HeartbeatOutcome::Unregistered, false));
            };
            if beat.incarnation < registered {
                return Ok((HeartbeatOutcome::StaleIncarnation, false));
            }
            if beat.incarnation > registered {
                // This incarnation's registration is not in the database (a lost write):
                // accepted, the row would name the old incarnation for good.
                return Ok((HeartbeatOutcome::Unregistered, false));
            }
            // The WHERE makes the runtime check and the write one atomic step.
            let written = execute(
                conn,
                n,
                "INSERT INTO relay_cell_runtime
                     (cell_id, cell_incarnation, started_at, ready, connections, last_heartbeat_at)
                 VALUES (?1, ?2, ?3, ?4, ?5, relay_now_ms())
                 ON CONFLICT (cell_id) DO UPDATE
                     SET cell_incarnation = excluded.cell_incarnation,
                         started_at = excluded.started_at,
                         ready = excluded.ready,
                         connections = excluded.connections,
                         last_heartbeat_at = excluded.last_heartbeat_at
                     WHERE relay_cell_runtime.cell_incarnation <= excluded.cell_incarnation",
                params![
                    beat.cell_id,
                    beat.incarnation,
                    beat.started_at,
                    beat.ready,
                    beat.connections
                ],
            )?;
            // What the cell advertises now (a live handover may have changed it): the
            // registration follows, written only when it differs.
            let mut advertised = 0;
            if let (1, Some(ad)) = (written, &beat.advertised) {
                advertised = execute(
                    conn,
                    n,
                    "UPDATE relay_cells
                        SET cell_url = ?2, region = ?3,
                            internal_url = COALESCE(?4, internal_url)
                      WHERE cell_id = ?1 AND incarnation = ?5
                        AND (cell_url <> ?2 OR region <> ?3
                             OR (?4 IS NOT NULL AND internal_url IS NOT ?4))",
                    params![
                        beat.cell_id,
                        ad.cell_url,
                        ad.region,
                        ad.internal_url,
                        beat.incarnation
                    ],
                )?;
            }
            Ok(if written == 1 {
                (HeartbeatOutcome::Accepted, advertised == 1)
            } else {
                (HeartbeatOutcome::StaleIncarnation, false)
            })
        })
    }

    pub(super) fn set_admit_mode(&self, cell_id: &str, admit_mode: &str) -> Result<(), StoreError> {
        self.with_conn("set admit mode", |conn, n| {
            execute(
                conn,
                n,
                "INSERT INTO relay_cell_admit_modes (cell_id, admit_mode, updated_at)
                 VALUES (?1, ?2, relay_now_ms())
                 ON CONFLICT (cell_id) DO UPDATE
                     SET admit_mode = excluded.admit_mode, updated_at = excluded.updated_at",
                params![cell_id, admit_mode],
            )
            .map(|_| ())
        })
    }

    pub(super) fn list_cells(&self) -> Result<Vec<CellRow>, StoreError> {
        self.with_conn("list cells", |conn, n| {
            n.bump();
            let mut statement = conn.prepare_cached(LIST_CELLS)?;
            let rows = statement.query_map([], cell_row)?;
            rows.collect()
        })
    }

    pub(super) fn write_admit_effective(
        &self,
        cell_id: &str,
        incarnation: i64,
        mode: &str,
    ) -> Result<(), StoreError> {
        self.with_conn("write admit-effective row", |conn, n| {
            execute(
                conn,
                n,
                "INSERT INTO relay_cell_admit_effective (cell_id, cell_incarnation, mode, updated_at)
                 VALUES (?1, ?2, ?3, relay_now_ms())
                 ON CONFLICT (cell_id) DO UPDATE
                     SET cell_incarnation = excluded.cell_incarnation,
                         mode = excluded.mode,
                         updated_at = excluded.updated_at",
                params![cell_id, incarnation, mode],
            )
            .map(|_| ())
        })
    }

    pub(super) fn admit_effective(
        &self,
        cell_id: &str,
    ) -> Result<Option<AdmitEffective>, StoreError> {
        self.with_conn("read admit-effective row", |conn, n| {
            query_opt(
                conn,
                n,
                "SELECT cell_incarnation, mode, updated_at, relay_now_ms() - updated_at
                 FROM relay_cell_admit_effective
                 WHERE cell_id = ?1",
                params![cell_id],
                |row| {
                    Ok(AdmitEffective {
                        cell_incarnation: row.get(0)?,
                        mode: row.get(1)?,
                        updated_at: row.get(2)?,
                        age_ms: row.get(3)?,
                    })
                },
            )
        })
    }

    pub(super) fn claim_trip_slot(
        &self,
        request: &ClaimRequest<'_>,
    ) -> Result<ClaimOutcome, StoreError> {
        let busy_timeout = self.busy_timeout;
        self.with_conn("claim trip slot", |conn, n| {
            // Never wait for the write lock during a claim: busy means another claim (or
            // writer) holds it, and the cell asks again later.
            conn.busy_timeout(Duration::ZERO)?;
            let outcome = claim::claim_sqlite(conn, n, request);
            conn.busy_timeout(busy_timeout)?;
            outcome
        })
    }
}

fn cell_row(row: &Row<'_>) -> Result<CellRow, rusqlite::Error> {
    let runtime = match row.get::<_, Option<i64>>(5)? {
        Some(cell_incarnation) => Some(CellRuntime {
            cell_incarnation,
            started_at: row.get(6)?,
            ready: row.get(7)?,
            connections: row.get(8)?,
            last_heartbeat_at: row.get(9)?,
            heartbeat_age_ms: row.get(16)?,
        }),
        None => None,
    };
    let effective = match row.get::<_, Option<i64>>(11)? {
        Some(cell_incarnation) => Some(AdmitEffective {
            cell_incarnation,
            mode: row.get(12)?,
            updated_at: row.get(13)?,
            age_ms: row.get(17)?,
        }),
        None => None,
    };
    Ok(CellRow {
        cell_id: row.get(0)?,
        cell_url: row.get(1)?,
        internal_url: row.get(14)?,
        region: row.get(2)?,
        incarnation: row.get(3)?,
        registered_at: row.get(4)?,
        registered_age_ms: row.get(15)?,
        runtime,
        admit_mode: row
            .get::<_, Option<String>>(10)?
            .unwrap_or_else(|| super::MODE_DB.to_string()),
        admit_mode_updated_at: row.get(18)?,
        effective,
    })
}
