//! The trip-slot claim (SPEC §5.5 "The claim", seed `dead-man-trip-slots.md`).
//!
//! Owns the one short transaction that decides whether this cell may trip: take the claim lock
//! without waiting, count the *other* cells that hold a slot, and write this cell's
//! admit-effective row `db` (a permit) or `reserve` (refused, kept fresh). One function per
//! backend, each reading top to bottom as the transaction it runs.
//!
//! A cell holds a slot while all three hold: its own `relay_cell_admit_effective` row says `db`,
//! its switch record (`relay_cell_admit_modes`) says `reserve`, and the row was refreshed within
//! `TRIP_SLOT_STALE_MS`. Heartbeats are not used: they reach the database through the director,
//! so in a director outage they all go stale and every slot would read as free. With mixed flag
//! values across cells the effective cap is the largest value set, and a cell on an older image
//! that ignores the flag still takes a slot through its `db` row.
//!
//! Time is the database's (SPEC §11 "Slot liveness"): the transaction stamps this cell's row
//! with `relay_now_ms()` and judges the other rows' freshness against `relay_now_ms()`, never
//! against a cell's clock. On PostgreSQL that is `now()`, the transaction's start, so the count
//! and the write see one instant; on SQLite it is the one machine's clock, read inside
//! `BEGIN IMMEDIATE`. A cell ten minutes fast or slow holds and frees slots exactly as one that
//! agrees with the database.
//!
//! Runs on the claim loop's thread (the `CellAdmitEffectiveWriter`, which serialises every write
//! of this cell's row). Must never wait for the lock: a busy lock is [`ClaimOutcome::LockBusy`]
//! and the cell asks again later, so a claim holds a connection for a few round trips at most.

use rusqlite::{params, Connection, ErrorCode, TransactionBehavior};

use super::{ClaimOutcome, StatementCounter, MODE_DB, MODE_RESERVE};

/// The PostgreSQL advisory-lock key every claim takes with `pg_try_advisory_xact_lock`: the
/// ASCII bytes of "orcatrip". All cells of a fleet must use the same key, and nothing else in
/// the database may use it (the migration lock is "orcamigr").
pub const TRIP_SLOT_LOCK_KEY: i64 = 0x6f72_6361_7472_6970;

/// One claim, as the claim loop asks it.
#[derive(Clone, Copy, Debug)]
pub struct ClaimRequest<'a> {
    pub cell_id: &'a str,
    pub incarnation: i64,
    /// `deadManTripSlots`: how many cells may be tripped at once.
    pub slots: u32,
    /// `TRIP_SLOT_STALE_MS`: a holder whose row is older than this (on the database's clock)
    /// no longer counts.
    pub stale_ms: i64,
}

/// The slot decision: a permit while fewer than `slots` other cells hold one.
pub fn slot_is_free(others_holding: u32, slots: u32) -> bool {
    others_holding < slots
}

fn to_u32(count: i64) -> u32 {
    u32::try_from(count.max(0)).unwrap_or(u32::MAX)
}

/// The claim on PostgreSQL: one READ COMMITTED transaction (the default), so the count's
/// snapshot is taken after the lock is held and sees the previous holder's commit. Every
/// statement is counted (`n.bump()`) as it is sent.
pub(super) fn claim_postgres(
    client: &mut postgres::Client,
    n: &StatementCounter,
    request: &ClaimRequest<'_>,
) -> Result<ClaimOutcome, postgres::Error> {
    n.bump();
    let mut tx = client.transaction()?;

    // 1. The claim lock, without waiting; released by COMMIT or ROLLBACK.
    n.bump();
    let locked: bool = tx
        .query_one(
            "SELECT pg_try_advisory_xact_lock($1)",
            &[&TRIP_SLOT_LOCK_KEY],
        )?
        .try_get(0)?;
    if !locked {
        n.bump();
        tx.rollback()?;
        return Ok(ClaimOutcome::LockBusy);
    }

    // 2. The other cells holding a slot: fresh on the database's clock.
    n.bump();
    let others_holding: i64 = tx
        .query_one(
            "SELECT COUNT(*) FROM relay_cell_admit_effective e
             JOIN relay_cell_admit_modes m ON m.cell_id = e.cell_id
             WHERE e.cell_id <> $1
               AND e.mode = 'db'
               AND m.admit_mode = 'reserve'
               AND e.updated_at >= relay_now_ms() - $2",
            &[&request.cell_id, &request.stale_ms],
        )?
        .try_get(0)?;
    let others_holding = to_u32(others_holding);

    // 3. This cell's row, stamped by the database: `db` takes the slot, `reserve` keeps a
    //    refused cell's row fresh.
    let permitted = slot_is_free(others_holding, request.slots);
    let mode = if permitted { MODE_DB } else { MODE_RESERVE };
    n.bump();
    tx.execute(
        "INSERT INTO relay_cell_admit_effective (cell_id, cell_incarnation, mode, updated_at)
         VALUES ($1, $2, $3, relay_now_ms())
         ON CONFLICT (cell_id) DO UPDATE
             SET cell_incarnation = excluded.cell_incarnation,
                 mode = excluded.mode,
                 updated_at = excluded.updated_at",
        &[&request.cell_id, &request.incarnation, &mode],
    )?;

    // 4. COMMIT releases the lock; the next claimant counts this row.
    super::pg_statements::commit(tx, n)?;
    Ok(if permitted {
        ClaimOutcome::Permit { others_holding }
    } else {
        ClaimOutcome::Refused { others_holding }
    })
}

/// The claim on SQLite: the same steps inside `BEGIN IMMEDIATE`, whose write lock plays the
/// advisory lock's part. The caller sets the connection's busy timeout to zero first, so a
/// held lock answers `SQLITE_BUSY` at once instead of waiting.
pub(super) fn claim_sqlite(
    conn: &mut Connection,
    n: &StatementCounter,
    request: &ClaimRequest<'_>,
) -> Result<ClaimOutcome, rusqlite::Error> {
    // 1. The claim lock (the database's write lock), without waiting.
    n.bump();
    let tx = match conn.transaction_with_behavior(TransactionBehavior::Immediate) {
        Ok(tx) => tx,
        Err(error) if is_busy(&error) => return Ok(ClaimOutcome::LockBusy),
        Err(error) => return Err(error),
    };

    // 2. The other cells holding a slot: fresh on the database's clock.
    n.bump();
    let others_holding: i64 = tx.query_row(
        "SELECT COUNT(*) FROM relay_cell_admit_effective e
         JOIN relay_cell_admit_modes m ON m.cell_id = e.cell_id
         WHERE e.cell_id <> ?1
           AND e.mode = 'db'
           AND m.admit_mode = 'reserve'
           AND e.updated_at >= relay_now_ms() - ?2",
        params![request.cell_id, request.stale_ms],
        |row| row.get(0),
    )?;
    let others_holding = to_u32(others_holding);

    // 3. This cell's row, stamped by the database: `db` takes the slot, `reserve` keeps a
    //    refused cell's row fresh.
    let permitted = slot_is_free(others_holding, request.slots);
    let mode = if permitted { MODE_DB } else { MODE_RESERVE };
    n.bump();
    tx.execute(
        "INSERT INTO relay_cell_admit_effective (cell_id, cell_incarnation, mode, updated_at)
         VALUES (?1, ?2, ?3, relay_now_ms())
         ON CONFLICT (cell_id) DO UPDATE
             SET cell_incarnation = excluded.cell_incarnation,
                 mode = excluded.mode,
                 updated_at = excluded.updated_at",
        params![request.cell_id, request.incarnation, mode],
    )?;

    // 4. COMMIT releases the write lock.
    n.bump();
    tx.commit()?;
    Ok(if permitted {
        ClaimOutcome::Permit { others_holding }
    } else {
        ClaimOutcome::Refused { others_holding }
    })
}

pub(super) fn is_busy(error: &rusqlite::Error) -> bool {
    matches!(
        error.sqlite_error_code(),
        Some(ErrorCode::DatabaseBusy | ErrorCode::DatabaseLocked)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_slot_is_free_only_below_the_flag() {
        assert!(slot_is_free(0, 2));
        assert!(slot_is_free(1, 2));
        assert!(!slot_is_free(2, 2));
        assert!(!slot_is_free(3, 2));
        assert!(!slot_is_free(0, 0), "deadManTripSlots=0 never trips");
    }
}
