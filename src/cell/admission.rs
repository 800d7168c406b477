//! Admission of a desktop's hello (SPEC §5.3).
//!
//! Runs on the hello's relay thread. The database check is a live read of the host's
//! placement row and, when it names this cell at exactly the hello's epoch, the control's
//! activity lease. No lock is held while the store is asked.

use crate::store::{LeaseOutcome, Store, StoreError};

/// The activity kind of a control's lease row.
pub const CONTROL_LEASE_KIND: &str = "control";

/// What the database says about a hello.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DbVerdict {
    /// The row names this cell at this epoch; the lease was taken.
    Admitted,
    /// The row names another cell or epoch (or there is none): 4409.
    WrongCell,
}

pub struct LeaseRequest<'a> {
    pub activity_id: &'a str,
    pub user_id: &'a str,
    pub relay_host_id: &'a str,
    pub cell_id: &'a str,
    pub epoch: i64,
    pub now_ms: i64,
    pub ttl_ms: i64,
}

/// The db-mode check: the placement row must name this cell at exactly this epoch, then the
/// control takes its activity lease in the same transaction.
pub fn check_database(store: &Store, lease: &LeaseRequest<'_>) -> Result<DbVerdict, StoreError> {
    let outcome = store.renew_lease(
        lease.activity_id,
        lease.user_id,
        lease.relay_host_id,
        lease.cell_id,
        lease.epoch,
        CONTROL_LEASE_KIND,
        lease.now_ms + lease.ttl_ms,
        lease.now_ms,
    )?;
    Ok(match outcome {
        LeaseOutcome::Renewed => DbVerdict::Admitted,
        LeaseOutcome::Moved => DbVerdict::WrongCell,
    })
}
