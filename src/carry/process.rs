//! The records of a process's own state as they outlive it: each dependency's readiness clocks
//! and the metrics' totals (the next process goes on counting from them).

use serde::{Deserialize, Serialize};

/// One dependency as a live handover carries it: its last success as an age (so a grace window
/// keeps its deadline), its last failure, and the status last reported (so no crossing is
/// logged twice).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DependencyRecord {
    pub dependency: String,
    pub last_success_ago_ms: Option<u64>,
    pub last_failure: Option<String>,
    /// `healthy`, `grace` or `down`, with the failure reported then.
    pub reported: String,
    pub reported_failure: Option<String>,
}

/// Readiness as a live handover carries it (the phase is the next process's own).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ReadinessRecord {
    pub dependencies: Vec<DependencyRecord>,
}

/// A counter or histogram as a live handover carries it: the next process goes on counting
/// from the running one's totals.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SeriesRecord {
    pub name: String,
    pub help: String,
    pub labels: Vec<(String, String)>,
    /// A counter's value; a histogram's per-bucket counts (the overflow last) and sum.
    pub value: u64,
    #[serde(default)]
    pub bounds: Vec<u64>,
    #[serde(default)]
    pub buckets: Vec<u64>,
}
