//! The store: the only module that talks SQL (SPEC §6.1), over PostgreSQL or SQLite.
//!
//! Owns the connection pool ([`pool`]), the migrations embedded from `sql/`, every statement
//! the relay runs, and the trip-slot claim ([`claim`], SPEC §5.5). [`Store`] is a cheap
//! `Clone` handle (an `Arc` inside) shared by every thread that needs the database.
//!
//! Runs on the calling thread: every method blocks for at most the checkout timeout plus one
//! statement timeout. Opening a store opens no connection, so a process whose database is down
//! still starts and reports itself unready instead of crashing.
//!
//! Time that machines compare is the database's: `relay_now_ms()` in SQL (PostgreSQL's `now()`
//! through migration 0003; on SQLite a function the store registers on each connection, reading
//! the store's clock, since every process sharing the file is on one machine). Admit-effective
//! rows, heartbeats, registrations and admit-mode records are stamped with it, and their ages
//! ([`CellRow`]) and the slot claim's freshness are computed with it, so no process's clock
//! (which may be minutes off) ever judges another's row.
//!
//! Must never: hold a lock of the caller's while it runs (callers take snapshots first), log or
//! return a connection string (errors are short lowercase phrases without secrets), or let a
//! connection that errored back into the pool.

pub mod claim;
mod pg_statements;
pub mod pool;
mod postgres;
mod sqlite;
pub mod tls;

use std::fmt;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::clock::SharedClock;
use crate::config::{Config, Role};

/// How to reach the database and how to size the pool.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoreConfig {
    /// `postgres://…`; `None` means SQLite at `sqlite_path`. Its `sslmode` and `sslrootcert`
    /// choose the TLS setting (`crate::database_tls`).
    pub database_url: Option<String>,
    /// `ORCA_RELAY_DATABASE_CA_FILE`: the CA bundle when the URL names none.
    pub database_ca_file: Option<PathBuf>,
    pub sqlite_path: PathBuf,
    pub pool_max: u32,
    /// The initial ceiling (see [`Store::set_pool_ceiling`]); clamped to `1..=pool_max`.
    pub pool_ceiling: u32,
    /// PostgreSQL `application_name`, `orca-relay:<role>:<cellId or director>` (SPEC §6.1).
    pub application_name: String,
    /// PostgreSQL `statement_timeout`; SQLite's `busy_timeout`.
    pub statement_timeout_ms: u64,
    pub connect_timeout_ms: u64,
    /// How long a caller waits for a pooled connection before `sql_pool_exhausted`.
    pub checkout_timeout_ms: u64,
}

impl StoreConfig {
    /// The defaults for a database at `database_url`, or SQLite at `sqlite_path` when `None`.
    pub fn new(database_url: Option<String>, sqlite_path: PathBuf) -> Self {
        StoreConfig {
            database_url,
            database_ca_file: None,
            sqlite_path,
            pool_max: 10,
            pool_ceiling: 10,
            application_name: "orca-relay".to_string(),
            statement_timeout_ms: 5_000,
            connect_timeout_ms: 5_000,
            checkout_timeout_ms: 5_000,
        }
    }

    /// The store of a process with this configuration. A cell (or combined process) starts
    /// under its reserve-mode ceiling, the safe side of the hard bound (SPEC §5.5); the claim
    /// loop raises it once the cell is tripped or in `db` mode.
    pub fn from_config(config: &Config) -> Self {
        let ceiling = match config.role {
            Role::Director => config.pool_max,
            Role::Cell | Role::Combined => config.pool_reserve_max,
        };
        StoreConfig {
            pool_max: config.pool_max,
            pool_ceiling: ceiling,
            application_name: config.application_name(),
            database_ca_file: config.database_ca_file.clone(),
            ..StoreConfig::new(
                config.database_url.clone(),
                config.data_dir.join("relay.db"),
            )
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    Sqlite,
    Postgres,
}

/// Why a store call failed. Callers branch on [`StoreError::is_unavailable`] (retry later) and
/// report [`StoreError::reason_code`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StoreError {
    /// The database could not be reached in time: connect failed, the connection broke, a
    /// statement timed out, or the pool had no connection. Retry later.
    Unavailable(String),
    /// The database answered with an error.
    Query(String),
}

/// Message prefixes that [`StoreError::reason_code`] reads; only the constructors below write
/// them, so the two stay in step.
const POOL_EXHAUSTED: &str = "database pool exhausted";
const TIMED_OUT: &str = "database statement timed out";
const READ_ONLY: &str = "database takes no writes";
const DISK_FULL: &str = "database disk full";
/// The event name of a TLS failure (`store::tls`); the message is the whole log line.
const TLS_FAILED: &str = "orca_relay_store_tls_failed ";
/// How a message ends when the database said why: `(sqlstate 25006)` from PostgreSQL,
/// `(sqlite SQLITE_FULL)` from SQLite ([`StoreError::code`]).
const PG_CODE: &str = "(sqlstate ";
const SQLITE_CODE: &str = "(sqlite ";

/// The SQLSTATE of a read-only transaction's refused write (a standby, or
/// `default_transaction_read_only`).
pub const SQLSTATE_READ_ONLY: &str = "25006";

impl StoreError {
    pub fn is_unavailable(&self) -> bool {
        matches!(self, StoreError::Unavailable(_))
    }

    fn message(&self) -> &str {
        match self {
            StoreError::Unavailable(message) | StoreError::Query(message) => message,
        }
    }

    /// `sql_pool_exhausted`, `sql_timed_out`, `sql_tls_failed`, `sql_read_only` (a standby or
    /// a read-only server: writes are refused), `sql_disk_full` (SQLite cannot grow its files)
    /// or `sql_failed`, for logs, metrics and `/ready`.
    pub fn reason_code(&self) -> &'static str {
        let message = self.message();
        match self {
            StoreError::Unavailable(_) if message.starts_with(TLS_FAILED) => "sql_tls_failed",
            StoreError::Unavailable(_) if message.starts_with(POOL_EXHAUSTED) => {
                "sql_pool_exhausted"
            }
            StoreError::Unavailable(_) if message.starts_with(TIMED_OUT) => "sql_timed_out",
            _ if message.starts_with(READ_ONLY) || self.code() == Some(SQLSTATE_READ_ONLY) => {
                "sql_read_only"
            }
            _ if message.starts_with(DISK_FULL) || self.code() == Some("SQLITE_FULL") => {
                "sql_disk_full"
            }
            StoreError::Unavailable(_) | StoreError::Query(_) => "sql_failed",
        }
    }

    /// What the database said the failure was: PostgreSQL's SQLSTATE (`25006`, `57P01`, …) or
    /// SQLite's result code (`SQLITE_FULL`, …); `None` when it said nothing (the connection
    /// broke, the pool was empty).
    pub fn code(&self) -> Option<&str> {
        let message = self.message();
        let (start, marker) = [PG_CODE, SQLITE_CODE]
            .iter()
            .filter_map(|marker| message.rfind(marker).map(|at| (at, *marker)))
            .max_by_key(|(at, _)| *at)?;
        let rest = &message[start + marker.len()..];
        rest.split(')').next().filter(|code| !code.is_empty())
    }

    /// The fields a failure line carries: `reason=… sqlstate=…` (PostgreSQL) or
    /// `reason=… sqlite=…` (SQLite), the code only when the database gave one.
    pub fn log_fields(&self) -> String {
        let reason = self.reason_code();
        match (self.code(), self.message().contains(SQLITE_CODE)) {
            (Some(code), true) => format!("reason={reason} sqlite={code}"),
            (Some(code), false) => format!("reason={reason} sqlstate={code}"),
            (None, _) => format!("reason={reason}"),
        }
    }

    /// The store's readiness probe found a server that answers but takes no writes (a
    /// PostgreSQL standby, or a read-only primary).
    pub(crate) fn read_only(detail: &str) -> Self {
        StoreError::Unavailable(format!(
            "{READ_ONLY}: {detail} {PG_CODE}{SQLSTATE_READ_ONLY})"
        ))
    }

    /// The store's readiness probe found the SQLite database's filesystem out of space.
    pub(crate) fn disk_full(detail: &str) -> Self {
        StoreError::Unavailable(format!("{DISK_FULL}: {detail} {SQLITE_CODE}SQLITE_FULL)"))
    }

    pub(crate) fn pool_exhausted(waited: Duration, open: u32) -> Self {
        StoreError::Unavailable(format!(
            "{POOL_EXHAUSTED}: no connection free within {} ms ({open} open)",
            waited.as_millis()
        ))
    }

    /// The `orca_relay_store_tls_failed cause=…` line when the connection failed at the TLS
    /// layer (unknown CA, host name mismatch, a server without TLS under `require`, …): a
    /// configuration problem, which start-up reports and stops on (`roles`).
    pub fn tls_failure(&self) -> Option<&str> {
        match self {
            StoreError::Unavailable(message) if message.starts_with(TLS_FAILED) => Some(message),
            _ => None,
        }
    }

    /// A connection refused at the TLS layer; `line` is the whole `orca_relay_store_tls_failed`
    /// event. Unavailable: a running process retries it like an outage (the server's
    /// certificate may be rotated back), and `/ready` rides it out within the SQL grace.
    pub(crate) fn tls_failed(line: String) -> Self {
        debug_assert!(line.starts_with(TLS_FAILED));
        StoreError::Unavailable(line)
    }

    pub(crate) fn timed_out(context: &str) -> Self {
        StoreError::Unavailable(format!("{TIMED_OUT}: {context}"))
    }
}

impl fmt::Display for StoreError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StoreError::Unavailable(message) => write!(f, "database unavailable: {message}"),
            StoreError::Query(message) => write!(f, "database query failed: {message}"),
        }
    }
}

impl std::error::Error for StoreError {}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PoolStats {
    pub open: u32,
    pub idle: u32,
    pub waiters: u32,
    pub max: u32,
    pub ceiling: u32,
}

/// A placement: which cell serves this desktop, at which assignment epoch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Assignment {
    pub user_id: String,
    pub relay_host_id: String,
    pub cell_id: String,
    pub epoch: i64,
    pub updated_at: i64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LeaseOutcome {
    Renewed,
    /// The assignment row no longer names this cell at this epoch; the lease was deleted.
    Moved,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HeartbeatOutcome {
    Accepted,
    /// An older incarnation than the one stored: a process that has since been replaced.
    StaleIncarnation,
    /// This incarnation has no registration: the cell has none (never registered here,
    /// deregistered, or forgotten), or the row names an older incarnation (the registration
    /// was lost: an immediate restart of a database with asynchronous commit, a failover to a
    /// replica that lagged). Nothing was written; register it first. Accepting the beat would
    /// leave the row naming the old incarnation for good (a handed-over process never
    /// registers again), and every listing would drop the cell's status reports as another
    /// incarnation's.
    Unregistered,
}

/// The answer to a trip-slot claim (SPEC §5.5 "The claim").
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ClaimOutcome {
    /// This cell's row now says `db`; `others_holding` other cells held a slot.
    Permit { others_holding: u32 },
    /// Every slot is held; this cell's row was refreshed as `reserve`.
    Refused { others_holding: u32 },
    /// Another claim held the lock; nothing was written. Ask again later.
    LockBusy,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CellRuntime {
    pub cell_incarnation: i64,
    pub started_at: i64,
    pub ready: bool,
    pub connections: i64,
    /// Stamped by the database when the heartbeat was recorded.
    pub last_heartbeat_at: i64,
    /// How old that heartbeat is on the database's clock (read with the row).
    pub heartbeat_age_ms: i64,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AdmitEffective {
    pub cell_incarnation: i64,
    pub mode: String,
    /// Stamped by the database when the row was written.
    pub updated_at: i64,
    /// How old the row is on the database's clock (read with the row).
    pub age_ms: i64,
}

/// One registered cell with everything the director knows about it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CellRow {
    pub cell_id: String,
    /// The public WebSocket URL desktops and phones dial.
    pub cell_url: String,
    /// The base URL of the cell's HTTP listener (`/internal/*`, SPEC §5.4); `None` when the
    /// cell registered without one, so it can be neither booked nor polled.
    pub internal_url: Option<String>,
    pub region: String,
    pub incarnation: i64,
    /// Stamped by the database at the (latest) registration.
    pub registered_at: i64,
    /// How old the registration is on the database's clock.
    pub registered_age_ms: i64,
    pub runtime: Option<CellRuntime>,
    /// The operator's switch record; `"db"` when there is no row (SPEC §6.1).
    pub admit_mode: String,
    /// When the operator's record was written (database clock); `None` without a record.
    pub admit_mode_updated_at: Option<i64>,
    pub effective: Option<AdmitEffective>,
}

impl CellRow {
    /// How long the database has heard nothing from the cell: the age of its latest heartbeat,
    /// or of its registration when that is newer (or it never heartbeat).
    pub fn silent_ms(&self) -> i64 {
        match &self.runtime {
            Some(runtime) => runtime.heartbeat_age_ms.min(self.registered_age_ms),
            None => self.registered_age_ms,
        }
    }
}

/// The two admit modes a row may hold.
pub const MODE_DB: &str = "db";
pub const MODE_RESERVE: &str = "reserve";

fn check_mode(mode: &str) -> Result<(), StoreError> {
    if mode == MODE_DB || mode == MODE_RESERVE {
        Ok(())
    } else {
        Err(StoreError::Query(format!(
            "admit mode {mode:?} is not \"db\" or \"reserve\""
        )))
    }
}

/// Every registered cell with its runtime, records and ages on the database's clock. The
/// column order is the one both backends' `cell_row` reads.
pub(crate) const LIST_CELLS: &str =
    "SELECT c.cell_id, c.cell_url, c.region, c.incarnation, c.registered_at,
        r.cell_incarnation, r.started_at, r.ready, r.connections, r.last_heartbeat_at,
        m.admit_mode,
        e.cell_incarnation, e.mode, e.updated_at,
        c.internal_url,
        relay_now_ms() - c.registered_at,
        relay_now_ms() - r.last_heartbeat_at,
        relay_now_ms() - e.updated_at,
        m.updated_at
 FROM relay_cells c
 LEFT JOIN relay_cell_runtime r ON r.cell_id = c.cell_id
 LEFT JOIN relay_cell_admit_modes m ON m.cell_id = c.cell_id
 LEFT JOIN relay_cell_admit_effective e ON e.cell_id = c.cell_id
 ORDER BY c.cell_id";

/// The tables keyed by `cell_id` whose rows belong to the cell's process: forgetting a cell
/// deletes them all. Not `relay_cell_admit_modes`: that row is the operator's record of the
/// cell's switch (SPEC §12), so a cell that comes back after a long absence is placed in the
/// mode its operator set (a reserve cell inside the trip-slot bound and the budget), not as
/// `db`. It holds one row per cell id an operator ever recorded, so it grows only with the
/// operator's own writes.
pub(crate) const CELL_TABLES: [&str; 4] = [
    "relay_cells",
    "relay_cell_runtime",
    "relay_cell_admit_effective",
    "relay_assignment_activity_leases",
];

/// The per-cell tables a deregistered cell leaves rows in, with the column stamped by the
/// database that says how long the row has been untouched (the operator's admit-mode record
/// stays, as above).
pub(crate) const UNREGISTERED_LEFTOVERS: [(&str, &str); 2] = [
    ("relay_cell_runtime", "last_heartbeat_at"),
    ("relay_cell_admit_effective", "updated_at"),
];

thread_local! {
    static THREAD_STATEMENTS: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// Statements the calling thread has sent to the database, over every store. A relay thread
/// reads it before and after admitting a hello to count that hello's SQL.
pub fn thread_statements() -> u64 {
    THREAD_STATEMENTS.with(|count| count.get())
}

/// Counts every statement sent to the database (tests use it to prove a path ran no SQL).
#[derive(Default)]
pub(crate) struct StatementCounter(AtomicU64);

impl StatementCounter {
    pub(crate) fn bump(&self) {
        self.0.fetch_add(1, Ordering::Relaxed);
        THREAD_STATEMENTS.with(|count| count.set(count.get() + 1));
    }

    fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

enum Engine {
    Sqlite(sqlite::SqliteStore),
    Postgres(postgres::PgStore),
}

/// A handle to the database; clone it freely.
#[derive(Clone)]
pub struct Store {
    engine: Arc<Engine>,
}

/// Runs the same method on whichever backend this store uses.
macro_rules! dispatch {
    ($self:ident, $store:ident => $call:expr) => {
        match &*$self.engine {
            Engine::Sqlite($store) => $call,
            Engine::Postgres($store) => $call,
        }
    };
}

impl Store {
    /// Builds the store without connecting: connections open lazily on first use. SQLite's
    /// `relay_now_ms()` reads the system clock.
    pub fn open(config: &StoreConfig) -> Result<Store, StoreError> {
        Store::open_with_clock(config, crate::clock::system())
    }

    /// As [`Store::open`], with the clock SQLite's `relay_now_ms()` reads (tests and the
    /// fleet simulation drive it by hand). PostgreSQL always uses its own `now()`.
    pub fn open_with_clock(
        config: &StoreConfig,
        db_clock: SharedClock,
    ) -> Result<Store, StoreError> {
        let engine = match &config.database_url {
            Some(url) => Engine::Postgres(postgres::PgStore::open(url, config)?),
            None => Engine::Sqlite(sqlite::SqliteStore::open(config, db_clock)?),
        };
        Ok(Store {
            engine: Arc::new(engine),
        })
    }

    pub fn backend(&self) -> Backend {
        match &*self.engine {
            Engine::Sqlite(_) => Backend::Sqlite,
            Engine::Postgres(_) => Backend::Postgres,
        }
    }

    /// Applies the embedded `sql/` migrations; safe to run again and from several processes
    /// at once.
    pub fn migrate(&self) -> Result<(), StoreError> {
        dispatch!(self, store => store.migrate())
    }

    /// Whether a migration of this build is not applied to the database yet. Reads only (a
    /// live handover's next process asks before its commit, to know whether its controls must
    /// wait for [`Store::migrate`] after it).
    pub fn migrations_pending(&self) -> Result<bool, StoreError> {
        dispatch!(self, store => store.migrations_pending())
    }

    /// `SELECT 1`.
    pub fn ping(&self) -> Result<(), StoreError> {
        dispatch!(self, store => store.ping())
    }

    /// The readiness probe (SPEC §7, §12): the database answers and can take writes. On
    /// PostgreSQL a server in recovery (a standby) or one whose transactions are read-only fails
    /// it (`sql_read_only`, SQLSTATE 25006); on SQLite a write transaction must commit and the
    /// database's filesystem must have room for the files to grow (`sql_disk_full`,
    /// `SQLITE_FULL`). Either way `/ready` treats it as the SQL dependency failing, under the
    /// same grace as an outage.
    pub fn probe(&self) -> Result<(), StoreError> {
        dispatch!(self, store => store.probe())
    }

    /// The proof a live handover's next process gives before it says `ready` (SPEC §13): the
    /// store takes writes, shown by writing and rolling back, so nothing is left behind. On
    /// PostgreSQL, [`Store::probe`]'s question and then the cell's own `relay_cells` row
    /// written to itself (a role that may not write fails here); on SQLite, the probe's write
    /// transaction rolled back, or, with no database file yet, a directory it can be created
    /// in, and room on the filesystem either way. Bounded by the store's timeouts (connect,
    /// statement, busy).
    pub fn write_probe(&self, cell_id: &str) -> Result<(), StoreError> {
        match &*self.engine {
            Engine::Sqlite(store) => store.write_probe(),
            Engine::Postgres(store) => store.write_probe(cell_id),
        }
    }

    /// The database's clock, `relay_now_ms()` (operators and tests).
    pub fn now_ms(&self) -> Result<i64, StoreError> {
        dispatch!(self, store => store.now_ms())
    }

    pub fn pool_stats(&self) -> PoolStats {
        let counts = dispatch!(self, store => store.pool_counts());
        PoolStats {
            open: counts.open,
            idle: counts.idle,
            waiters: counts.waiters,
            max: counts.max,
            ceiling: counts.ceiling,
        }
    }

    /// Opens pooled connections until `count` are open (at most the ceiling) and leaves them
    /// idle; how many are open after. Connecting only: nothing is written.
    pub fn warm_pool(&self, count: u32) -> u32 {
        dispatch!(self, store => store.warm(count))
    }

    /// True while some caller waits for a pooled connection.
    pub fn has_waiters(&self) -> bool {
        self.pool_stats().waiters > 0
    }

    /// Caps how many connections may exist (`1..=pool_max`); see [`pool::Pool::set_ceiling`].
    pub fn set_pool_ceiling(&self, ceiling: u32) {
        dispatch!(self, store => store.set_ceiling(ceiling))
    }

    /// Statements sent to the database so far by this store (transaction control included).
    pub fn statements_executed(&self) -> u64 {
        dispatch!(self, store => store.statements().get())
    }

    pub fn assignment(
        &self,
        user_id: &str,
        relay_host_id: &str,
    ) -> Result<Option<Assignment>, StoreError> {
        dispatch!(self, store => store.assignment(user_id, relay_host_id))
    }

    /// Inserts the placement, or replaces a row with a strictly lower epoch, in one statement.
    /// True if the row was written.
    pub fn place_assignment_if_newer(
        &self,
        user_id: &str,
        relay_host_id: &str,
        cell_id: &str,
        epoch: i64,
        now_ms: i64,
    ) -> Result<bool, StoreError> {
        dispatch!(self, store => store.place_assignment_if_newer(user_id, relay_host_id, cell_id, epoch, now_ms))
    }

    /// In one transaction: if the assignment row names `cell_id` at `epoch`, upserts the lease
    /// ([`LeaseOutcome::Renewed`]); otherwise deletes it ([`LeaseOutcome::Moved`]).
    #[allow(clippy::too_many_arguments)] // one value per column of the lease row
    pub fn renew_lease(
        &self,
        activity_id: &str,
        user_id: &str,
        relay_host_id: &str,
        cell_id: &str,
        epoch: i64,
        kind: &str,
        expires_at: i64,
        now_ms: i64,
    ) -> Result<LeaseOutcome, StoreError> {
        let lease = LeaseRow {
            activity_id,
            user_id,
            relay_host_id,
            cell_id,
            epoch,
            kind,
            expires_at,
            now_ms,
        };
        dispatch!(self, store => store.renew_lease(&lease))
    }

    pub fn delete_lease(&self, activity_id: &str) -> Result<(), StoreError> {
        dispatch!(self, store => store.delete_lease(activity_id))
    }

    /// True if the lease exists and has not expired at `now_ms`.
    pub fn lease_exists(&self, activity_id: &str, now_ms: i64) -> Result<bool, StoreError> {
        dispatch!(self, store => store.lease_exists(activity_id, now_ms))
    }

    /// Unexpired activity leases of one host (operators and tests).
    pub fn live_leases_for_host(
        &self,
        relay_host_id: &str,
        now_ms: i64,
    ) -> Result<usize, StoreError> {
        dispatch!(self, store => store.live_leases_for_host(relay_host_id, now_ms))
    }

    /// Records the cell, stamped with the database's clock; re-registering is harmless. An
    /// older incarnation never replaces a newer one. `internal_url` is the base URL of the
    /// cell's HTTP listener; `""` means the cell did not say, and keeps whatever URL an earlier
    /// registration stored.
    pub fn register_cell(
        &self,
        cell_id: &str,
        cell_url: &str,
        internal_url: &str,
        region: &str,
        incarnation: i64,
    ) -> Result<(), StoreError> {
        let internal_url = Some(internal_url).filter(|url| !url.is_empty());
        dispatch!(self, store => store.register_cell(cell_id, cell_url, internal_url, region, incarnation))
    }

    /// Deletes the registration and runtime row of this incarnation of the cell (a clean exit;
    /// a newer incarnation's rows are left alone). The admit-mode record and the
    /// admit-effective row stay until the cell is forgotten. True if a registration went.
    pub fn deregister_cell(&self, cell_id: &str, incarnation: i64) -> Result<bool, StoreError> {
        dispatch!(self, store => store.deregister_cell(cell_id, incarnation))
    }

    /// Forgets every cell the database has not heard from for more than `silent_ms`
    /// ([`CellRow::silent_ms`]): all of its rows (registration, runtime, admit-effective row,
    /// activity leases) except the operator's admit-mode record ([`CELL_TABLES`]). Rows of
    /// cells no longer registered are deleted once untouched for as long. Returns the ids of the
    /// registered cells forgotten.
    pub fn forget_silent_cells(&self, silent_ms: i64) -> Result<Vec<String>, StoreError> {
        dispatch!(self, store => store.forget_silent_cells(silent_ms))
    }

    /// Deletes activity leases that expired more than `expired_for_ms` ago on the database's
    /// clock (the margin covers cells whose clocks run slow: a lease is stamped by its cell).
    /// Returns how many went.
    pub fn delete_expired_leases(&self, expired_for_ms: i64) -> Result<u64, StoreError> {
        dispatch!(self, store => store.delete_expired_leases(expired_for_ms))
    }

    /// Records a heartbeat, stamped with the database's clock, unless it comes from an older
    /// incarnation than the one stored in `relay_cell_runtime` or `relay_cells`, or this
    /// incarnation is not the registered one (no row, or a row of an older incarnation:
    /// [`HeartbeatOutcome::Unregistered`]).
    pub fn heartbeat(
        &self,
        cell_id: &str,
        incarnation: i64,
        started_at: i64,
        ready: bool,
        connections: i64,
    ) -> Result<HeartbeatOutcome, StoreError> {
        let beat = Heartbeat {
            cell_id,
            incarnation,
            started_at,
            ready,
            connections,
            advertised: None,
        };
        dispatch!(self, store => store.heartbeat(&beat)).map(|(outcome, _)| outcome)
    }

    /// [`Store::heartbeat`], and the cell's registration made to say what it advertises now,
    /// in the same step and only for the registered incarnation (an older one never rewrites
    /// it). The flag: the registration changed (a handover applied a new URL or region).
    pub fn heartbeat_advertised(
        &self,
        cell_id: &str,
        incarnation: i64,
        started_at: i64,
        ready: bool,
        connections: i64,
        advertised: Advertised<'_>,
    ) -> Result<(HeartbeatOutcome, bool), StoreError> {
        let beat = Heartbeat {
            cell_id,
            incarnation,
            started_at,
            ready,
            connections,
            advertised: Some(advertised),
        };
        dispatch!(self, store => store.heartbeat(&beat))
    }

    /// The operator's switch record for a cell: `db` or `reserve` (stamped with the database's
    /// clock).
    pub fn set_admit_mode(&self, cell_id: &str, admit_mode: &str) -> Result<(), StoreError> {
        check_mode(admit_mode)?;
        dispatch!(self, store => store.set_admit_mode(cell_id, admit_mode))
    }

    /// Every registered cell, ordered by id.
    pub fn list_cells(&self) -> Result<Vec<CellRow>, StoreError> {
        dispatch!(self, store => store.list_cells())
    }

    /// Writes this cell's admit-effective row, stamped with the database's clock (only the
    /// cell's writer calls this, SPEC §5.5).
    pub fn write_admit_effective(
        &self,
        cell_id: &str,
        incarnation: i64,
        mode: &str,
    ) -> Result<(), StoreError> {
        check_mode(mode)?;
        dispatch!(self, store => store.write_admit_effective(cell_id, incarnation, mode))
    }

    pub fn admit_effective(&self, cell_id: &str) -> Result<Option<AdmitEffective>, StoreError> {
        dispatch!(self, store => store.admit_effective(cell_id))
    }

    /// The trip-slot claim, one short transaction stamped and judged on the database's clock
    /// (SPEC §5.5 "The claim", §11; see [`claim`]).
    pub fn claim_trip_slot(
        &self,
        cell_id: &str,
        incarnation: i64,
        slots: u32,
        stale_ms: i64,
    ) -> Result<ClaimOutcome, StoreError> {
        let request = claim::ClaimRequest {
            cell_id,
            incarnation,
            slots,
            stale_ms,
        };
        match &*self.engine {
            Engine::Sqlite(store) => store.claim_trip_slot(&request),
            Engine::Postgres(store) => store.claim_trip_slot(&request),
        }
    }
}

/// The arguments of [`Store::renew_lease`], passed to the backends as one value.
pub(crate) struct LeaseRow<'a> {
    pub activity_id: &'a str,
    pub user_id: &'a str,
    pub relay_host_id: &'a str,
    pub cell_id: &'a str,
    pub epoch: i64,
    pub kind: &'a str,
    pub expires_at: i64,
    pub now_ms: i64,
}

/// The arguments of [`Store::heartbeat`], passed to the backends as one value.
pub(crate) struct Heartbeat<'a> {
    pub cell_id: &'a str,
    pub incarnation: i64,
    pub started_at: i64,
    pub ready: bool,
    pub connections: i64,
    pub advertised: Option<Advertised<'a>>,
}

/// What a cell advertises, as its heartbeat says it (SPEC §5.6): a live handover applies a
/// changed `ORCA_RELAY_CELL_URL`, `ORCA_RELAY_REGION` or `ORCA_RELAY_INTERNAL_URL` without a
/// new registration, so the beat carries it to the cell's `relay_cells` row.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Advertised<'a> {
    pub cell_url: &'a str,
    pub region: &'a str,
    /// `None`: the cell did not say (an older build); the stored one stays.
    pub internal_url: Option<&'a str>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reason_codes_follow_the_constructors() {
        let exhausted = StoreError::pool_exhausted(Duration::from_millis(5), 3);
        assert_eq!(exhausted.reason_code(), "sql_pool_exhausted");
        assert!(exhausted.is_unavailable());
        let timed_out = StoreError::timed_out("claim");
        assert_eq!(timed_out.reason_code(), "sql_timed_out");
        assert!(timed_out.is_unavailable());
        let refused = StoreError::Unavailable("connect refused".into());
        assert_eq!(refused.reason_code(), "sql_failed");
        let tls = StoreError::tls_failed(
            "orca_relay_store_tls_failed cause=unknown_ca sslmode=verify-full".into(),
        );
        assert_eq!(tls.reason_code(), "sql_tls_failed");
        assert!(tls.is_unavailable(), "a running process retries it");
        assert_eq!(
            tls.tls_failure(),
            Some("orca_relay_store_tls_failed cause=unknown_ca sslmode=verify-full")
        );
        assert_eq!(refused.tls_failure(), None);
        let query = StoreError::Query("syntax".into());
        assert_eq!(query.reason_code(), "sql_failed");
        assert!(!query.is_unavailable());
        assert_eq!(
            exhausted.to_string(),
            "database unavailable: database pool exhausted: no connection free within 5 ms (3 open)"
        );
    }

    #[test]
    fn application_name_names_role_and_cell() {
        let lookup = |name: &str| match name {
            "ORCA_RELAY_CELL_ID" => Some("c7".to_string()),
            "ORCA_RELAY_DATABASE_POOL_MAX" => Some("16".to_string()),
            "ORCA_RELAY_DATABASE_POOL_RESERVE_MAX" => Some("12".to_string()),
            _ => None,
        };
        let config = Config::from_lookup(&lookup).expect("valid config");
        let store = StoreConfig::from_config(&config);
        assert_eq!(store.application_name, "orca-relay:combined:c7");
        assert_eq!((store.pool_max, store.pool_ceiling), (16, 12));
        assert_eq!(store.sqlite_path, config.data_dir.join("relay.db"));
    }
}
