//! TEMPORARY stub of the store API (replaced by the real store branch).
#![allow(unused_variables)]
use std::path::PathBuf;

#[derive(Debug, Clone)]
pub struct StoreConfig {
    pub database_url: Option<String>,
    pub sqlite_path: PathBuf,
    pub pool_max: u32,
    pub pool_ceiling: u32,
    pub application_name: String,
    pub statement_timeout_ms: u64,
    pub connect_timeout_ms: u64,
    pub checkout_timeout_ms: u64,
}
#[derive(Debug, Clone)]
pub enum StoreError {
    Unavailable(String),
    Query(String),
}
impl std::fmt::Display for StoreError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{self:?}")
    }
}
impl StoreError {
    pub fn is_unavailable(&self) -> bool {
        matches!(self, StoreError::Unavailable(_))
    }
    pub fn reason_code(&self) -> &'static str {
        "sql_failed"
    }
}
#[derive(Debug, Clone)]
pub struct Assignment {
    pub user_id: String,
    pub relay_host_id: String,
    pub cell_id: String,
    pub epoch: i64,
    pub updated_at: i64,
}
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LeaseOutcome {
    Renewed,
    Moved,
}
#[derive(Debug, Clone, Copy, Default)]
pub struct PoolStats {
    pub open: u32,
    pub idle: u32,
    pub waiters: u32,
    pub max: u32,
    pub ceiling: u32,
}
#[derive(Clone)]
pub struct Store;
impl Store {
    pub fn open(config: &StoreConfig) -> Result<Store, StoreError> {
        Ok(Store)
    }
    pub fn migrate(&self) -> Result<(), StoreError> {
        Ok(())
    }
    pub fn ping(&self) -> Result<(), StoreError> {
        Ok(())
    }
    pub fn pool_stats(&self) -> PoolStats {
        PoolStats::default()
    }
    pub fn has_waiters(&self) -> bool {
        false
    }
    pub fn statements_executed(&self) -> u64 {
        0
    }
    pub fn assignment(
        &self,
        user_id: &str,
        relay_host_id: &str,
    ) -> Result<Option<Assignment>, StoreError> {
        Ok(None)
    }
    pub fn place_assignment_if_newer(
        &self,
        user_id: &str,
        relay_host_id: &str,
        cell_id: &str,
        epoch: i64,
        now_ms: i64,
    ) -> Result<bool, StoreError> {
        Ok(true)
    }
    #[allow(clippy::too_many_arguments)]
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
        Ok(LeaseOutcome::Renewed)
    }
    pub fn delete_lease(&self, activity_id: &str) -> Result<(), StoreError> {
        Ok(())
    }
}
