//! Counted PostgreSQL statements: each helper bumps the calling thread's statement counter
//! (which lets admission prove it ran no SQL) and runs one statement. Shared by the backend
//! (`postgres.rs`) and the slot claim (`claim.rs`), so neither imports the other.

use postgres::types::ToSql;
use postgres::{GenericClient, Row};

use super::StatementCounter;

type Params<'a> = &'a [&'a (dyn ToSql + Sync)];

/// Runs one statement that returns no rows we read; counts it.
pub(super) fn execute(
    client: &mut impl GenericClient,
    statements: &StatementCounter,
    sql: &str,
    params: Params<'_>,
) -> Result<u64, postgres::Error> {
    statements.bump();
    client.execute(sql, params)
}

/// Runs one statement and returns exactly one row; counts it.
pub(super) fn query_one(
    client: &mut impl GenericClient,
    statements: &StatementCounter,
    sql: &str,
    params: Params<'_>,
) -> Result<Row, postgres::Error> {
    statements.bump();
    client.query_one(sql, params)
}

/// Runs one statement and returns zero or one row; counts it.
pub(super) fn query_opt(
    client: &mut impl GenericClient,
    statements: &StatementCounter,
    sql: &str,
    params: Params<'_>,
) -> Result<Option<Row>, postgres::Error> {
    statements.bump();
    client.query_opt(sql, params)
}

pub(super) fn query(
    client: &mut impl GenericClient,
    statements: &StatementCounter,
    sql: &str,
    params: Params<'_>,
) -> Result<Vec<Row>, postgres::Error> {
    statements.bump();
    client.query(sql, params)
}
