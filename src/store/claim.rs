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
//! Runs on the claim loop's thread (the `CellAdmitEffectiveWriter`, which serialises every write
//! of this cell's row). Must never wait for the lock: a busy lock is [`ClaimOutcome::LockBusy`]
//! and the cell asks again later, so a claim holds a connection for a few round trips at most.

use rusqlite::{params, Connection, ErrorCode, TransactionBehavior};

use super::pg_statements::{execute, query_one};
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
    pub now_ms: i64,
    /// `TRIP_SLOT_STALE_MS`: a holder whose row is older than this no longer counts.
    pub stale_ms: i64,
}

impl ClaimRequest<'_> {
    /// Rows refreshed at or after this instant still hold their slot.
    fn fresh_since(&self) -> i64 {
        self.now_ms.saturating_sub(self.stale_ms)
    }
}

/// The slot decision: a permit while fewer than `slots` other cells hold one.
pub fn slot_is_free(others_holding: u32, slots: u32) -> bool {
    others_holding < slots
}

fn to_u32(count: i64) -> u32 {
    u32::try_from(count.max(0)).unwrap_or(u32::MAX)
}

/// The claim on PostgreSQL: one READ COMMITTED transaction (the default), so the count's
/// snapshot is taken after the lock is held and sees the previous holder's commit.
pub(super) fn claim_postgres(
    client: &mut postgres::Client,
    n: &StatementCounter,
    request: &ClaimRequest<'_>,
) -> Result<ClaimOutcome, postgres::Error> {
    n.bump();
    let mut tx = client.transaction()?;

    // 1. The claim lock, without waiting; released by COMMIT or ROLLBACK.
    let locked: bool = query_one(
        &mut tx,
        n,
        "SELECT pg_try_advisory_xact_lock($1)",
        &[&TRIP_SLOT_LOCK_KEY],
    )?
    .try_get(0)?;
    if !locked {
        n.bump();
        tx.rollback()?;
        return Ok(ClaimOutcome::LockBusy);
    }

    // 2. The other cells holding a slot.
    let others_holding: i64 = query_one(
        &mut tx,
        n,
        "SELECT COUNT(*) FROM relay_cell_admit_effective e
         JOIN relay_cell_admit_modes m ON m.cell_id = e.cell_id
         WHERE e.cell_id <> $1
           AND e.mode = 'db'
           AND m.admit_mode = 'reserve'
           AND e.updated_at >= $2",
        &[&request.cell_id, &request.fresh_since()],
    )?
    .try_get(0)?;
    let others_holding = to_u32(others_holding);

    // 3. This cell's row: `db` takes the slot, `reserve` keeps a refused cell's row fresh.
    let permitted = slot_is_free(others_holding, request.slots);
    let mode = if permitted { MODE_DB } else { MODE_RESERVE };
    execute(
        &mut tx,
        n,
        "INSERT INTO relay_cell_admit_effective (cell_id, cell_incarnation, mode, updated_at)
         VALUES ($1, $2, $3, $4)
         ON CONFLICT (cell_id) DO UPDATE
             SET cell_incarnation = excluded.cell_incarnation,
                 mode = excluded.mode,
                 updated_at = excluded.updated_at",
        &[
            &request.cell_id,
            &request.incarnation,
            &mode,
            &request.now_ms,
        ],
    )?;

    // 4. COMMIT releases the lock; the next claimant counts this row.
    n.bump();
    tx.commit()?;
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

    // 2. The other cells holding a slot.
    n.bump();
    let others_holding: i64 = tx.query_row(
        "SELECT COUNT(*) FROM relay_cell_admit_effective e
         JOIN relay_cell_admit_modes m ON m.cell_id = e.cell_id
         WHERE e.cell_id <> ?1
           AND e.mode = 'db'
           AND m.admit_mode = 'reserve'
           AND e.updated_at >= ?2",
        params![request.cell_id, request.fresh_since()],
        |row| row.get(0),
    )?;
    let others_holding = to_u32(others_holding);

    // 3. This cell's row: `db` takes the slot, `reserve` keeps a refused cell's row fresh.
    let permitted = slot_is_free(others_holding, request.slots);
    let mode = if permitted { MODE_DB } else { MODE_RESERVE };
    n.bump();
    tx.execute(
        "INSERT INTO relay_cell_admit_effective (cell_id, cell_incarnation, mode, updated_at)
         VALUES (?1, ?2, ?3, ?4)
         ON CONFLICT (cell_id) DO UPDATE
             SET cell_incarnation = excluded.cell_incarnation,
                 mode = excluded.mode,
                 updated_at = excluded.updated_at",
        params![request.cell_id, request.incarnation, mode, request.now_ms],
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

    #[test]
    fn stale_threshold_does_not_underflow() {
        let request = ClaimRequest {
            cell_id: "c1",
            incarnation: 1,
            slots: 2,
            now_ms: 1_000,
            stale_ms: 600_000,
        };
        assert_eq!(request.fresh_since(), -599_000);
        let huge = ClaimRequest {
            now_ms: i64::MIN + 5,
            stale_ms: i64::MAX,
            ..request
        };
        assert_eq!(huge.fresh_since(), i64::MIN);
    }
}
