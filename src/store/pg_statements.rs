//! Counted PostgreSQL statements: each helper bumps the calling thread's statement counter
//! (which lets admission prove it ran no SQL) and runs one statement. Shared by the backend
//! (`postgres.rs`) and the slot claim (`claim.rs`), so neither imports the other.
//!
//! They also keep, per thread, whether the work in progress may have committed anything: a
//! statement that can write, sent outside a transaction (autocommit), or a `COMMIT`
//! ([`commit`]). `PgStore::with_client` retries work whose pooled connection the server closed
//! only while this is false, so a retry never repeats a write that may have taken effect.

use std::cell::Cell;

use postgres::types::ToSql;
use postgres::{Client, GenericClient, Row, Transaction};

use super::StatementCounter;

type Params<'a> = &'a [&'a (dyn ToSql + Sync)];

thread_local! {
    static MAY_HAVE_COMMITTED: Cell<bool> = const { Cell::new(false) };
}

/// A session statements run in: a bare connection commits each statement on its own, a
/// transaction only at its `COMMIT`.
pub(super) trait Session: GenericClient {
    const AUTOCOMMIT: bool;
}

impl Session for Client {
    const AUTOCOMMIT: bool = true;
}

impl Session for Transaction<'_> {
    const AUTOCOMMIT: bool = false;
}

/// Starts a piece of work on this thread: nothing sent yet can have committed.
pub(super) fn begin_work() {
    MAY_HAVE_COMMITTED.with(|flag| flag.set(false));
}

/// Whether the work since [`begin_work`] sent anything that may have committed.
pub(super) fn may_have_committed() -> bool {
    MAY_HAVE_COMMITTED.with(Cell::get)
}

/// Notes a statement about to be sent on `C`: outside a transaction, anything but a plain
/// `SELECT` may write and commit on its own.
fn note<C: Session>(sql: &str) {
    let reads_only = sql
        .trim_start()
        .get(..6)
        .is_some_and(|word| word.eq_ignore_ascii_case("select"));
    if C::AUTOCOMMIT && !reads_only {
        MAY_HAVE_COMMITTED.with(|flag| flag.set(true));
    }
}

/// Commits `tx`; counts it. From here on the work may have committed, whatever the answer.
pub(super) fn commit(
    tx: Transaction<'_>,
    statements: &StatementCounter,
) -> Result<(), postgres::Error> {
    statements.bump();
    MAY_HAVE_COMMITTED.with(|flag| flag.set(true));
    tx.commit()
}

/// Runs one statement that returns no rows we read; counts it.
pub(super) fn execute<C: Session>(
    client: &mut C,
    statements: &StatementCounter,
    sql: &str,
    params: Params<'_>,
) -> Result<u64, postgres::Error> {
    statements.bump();
    note::<C>(sql);
    client.execute(sql, params)
}

/// Runs one statement and returns exactly one row; counts it.
pub(super) fn query_one<C: Session>(
    client: &mut C,
    statements: &StatementCounter,
    sql: &str,
    params: Params<'_>,
) -> Result<Row, postgres::Error> {
    statements.bump();
    note::<C>(sql);
    client.query_one(sql, params)
}

/// Runs one statement and returns zero or one row; counts it.
pub(super) fn query_opt<C: Session>(
    client: &mut C,
    statements: &StatementCounter,
    sql: &str,
    params: Params<'_>,
) -> Result<Option<Row>, postgres::Error> {
    statements.bump();
    note::<C>(sql);
    client.query_opt(sql, params)
}

pub(super) fn query<C: Session>(
    client: &mut C,
    statements: &StatementCounter,
    sql: &str,
    params: Params<'_>,
) -> Result<Vec<Row>, postgres::Error> {
    statements.bump();
    note::<C>(sql);
    client.query(sql, params)
}
