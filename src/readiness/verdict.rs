//! The readiness decision (SPEC §7): per-dependency state, the grace rules, the `/ready` answer
//! and the grace crossings that get logged.
//!
//! Owns nothing shared and runs on whichever thread calls it (the HTTP worker answering
//! `GET /ready`, the readiness prober recording a poll). Every function here is pure: it takes
//! the state and `now_ms` and never reads a clock, a socket or a database.
//!
//! The rules, in one place:
//! - A dependency is *healthy* when its latest probe succeeded.
//! - A failing dependency is *in grace* (still satisfied) while it has succeeded at least once
//!   and `now − last_success < grace`. The window restarts from the latest success. Grace 0
//!   disables the window; a dependency that never succeeded gets no grace, so cold boot gates on
//!   the real dependency.
//! - A dependency that has not been probed yet is failing with reason `not_probed`: before the
//!   prober's first poll the process is not ready.
//! - An unconfigured JWKS (self-hosted key) is skipped: always satisfied, never reported.
//! - Each dependency has its own clock: a healthy JWKS never holds a dead SQL open.

use std::collections::BTreeMap;
use std::fmt;

use serde::Serialize;

/// Short failure reason codes. Probes report one of these (never raw error text), so `/ready`
/// bodies and log lines cannot leak hostnames, credentials or driver messages.
pub mod reason {
    /// The dependency has not been probed yet (the prober's first poll has not finished).
    pub const NOT_PROBED: &str = "not_probed";
    /// The JWKS request failed before an HTTP status arrived (DNS, refused, TLS).
    pub const JWKS_FETCH_FAILED: &str = "jwks_fetch_failed";
    /// The JWKS endpoint answered with a non-2xx status.
    pub const JWKS_HTTP_FAILED: &str = "jwks_http_failed";
    /// The JWKS request did not finish within its 2 s timeout.
    pub const JWKS_TIMED_OUT: &str = "jwks_timed_out";
    /// `SELECT 1` failed.
    pub const SQL_FAILED: &str = "sql_failed";
    /// `SELECT 1` did not finish within its timeout.
    pub const SQL_TIMED_OUT: &str = "sql_timed_out";
    /// The database refused the connection at the TLS layer (`orca_relay_store_tls_failed`).
    pub const SQL_TLS_FAILED: &str = "sql_tls_failed";
    /// `SELECT 1` answers but this process's migrations have not been applied yet.
    pub const SQL_MIGRATIONS_PENDING: &str = "sql_migrations_pending";
    /// The JWKS probe closure panicked; the prober caught it and kept running.
    pub const JWKS_PROBE_PANICKED: &str = "jwks_probe_panicked";
    /// The SQL probe closure panicked; the prober caught it and kept running.
    pub const SQL_PROBE_PANICKED: &str = "sql_probe_panicked";

    /// A reason a live handover carried, as this process's own code: the known ones map to
    /// their constants; another (from a newer build) is kept once, up to a small bound, then
    /// read as `unknown`.
    pub fn intern(text: &str) -> &'static str {
        const KNOWN: [&str; 10] = [
            NOT_PROBED,
            JWKS_FETCH_FAILED,
            JWKS_HTTP_FAILED,
            JWKS_TIMED_OUT,
            SQL_FAILED,
            SQL_TIMED_OUT,
            SQL_TLS_FAILED,
            SQL_MIGRATIONS_PENDING,
            JWKS_PROBE_PANICKED,
            SQL_PROBE_PANICKED,
        ];
        if let Some(known) = KNOWN.iter().find(|known| **known == text) {
            return known;
        }
        static OTHERS: std::sync::Mutex<Vec<&'static str>> = std::sync::Mutex::new(Vec::new());
        let mut others = OTHERS.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(other) = others.iter().find(|other| **other == text) {
            return other;
        }
        if others.len() >= 32 || text.len() > 64 {
            return "unknown";
        }
        let kept: &'static str = Box::leak(text.to_string().into_boxed_str());
        others.push(kept);
        kept
    }
}

/// A dependency `/ready` gates on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Dependency {
    Jwks,
    Sql,
}

impl Dependency {
    /// Every dependency, in the order they are probed and reported.
    pub const ALL: [Dependency; 2] = [Dependency::Jwks, Dependency::Sql];

    /// The name used in `/ready` bodies, log lines and metric labels.
    pub fn name(self) -> &'static str {
        match self {
            Dependency::Jwks => "jwks",
            Dependency::Sql => "sql",
        }
    }

    pub(crate) fn index(self) -> usize {
        match self {
            Dependency::Jwks => 0,
            Dependency::Sql => 1,
        }
    }
}

impl fmt::Display for Dependency {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// What the process knows about one dependency.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DependencyState {
    /// When the latest successful probe was recorded (ms since the Unix epoch).
    pub last_success_ms: Option<u64>,
    /// The reason code of the latest probe if it failed; a success clears it.
    pub last_failure: Option<&'static str>,
    /// False for JWKS when no JWKS URL is configured: the dependency is skipped.
    pub configured: bool,
    /// The last-known-good window in ms; 0 disables it.
    pub grace_ms: u64,
}

impl DependencyState {
    /// A configured dependency that has not been probed yet.
    pub fn new(grace_ms: u64) -> Self {
        DependencyState {
            last_success_ms: None,
            last_failure: None,
            configured: true,
            grace_ms,
        }
    }

    /// A dependency that is not configured (JWKS under a self-hosted key).
    pub fn unconfigured() -> Self {
        DependencyState {
            configured: false,
            ..DependencyState::new(0)
        }
    }

    /// Applies one probe result observed at `now_ms`.
    pub fn record(&mut self, result: Result<(), &'static str>, now_ms: u64) {
        match result {
            Ok(()) => {
                // The window restarts from the latest success.
                self.last_success_ms = Some(now_ms);
                self.last_failure = None;
            }
            Err(reason) => self.last_failure = Some(reason),
        }
    }

    /// Healthy, in grace or down at `now_ms`.
    pub fn status(&self, now_ms: u64) -> DependencyStatus {
        if !self.configured {
            return DependencyStatus::Healthy;
        }
        let failure = match (self.last_success_ms, self.last_failure) {
            (Some(_), None) => return DependencyStatus::Healthy,
            (None, None) => reason::NOT_PROBED,
            (_, Some(failure)) => failure,
        };
        let in_grace = match self.last_success_ms {
            // A clock that steps backwards counts as "just succeeded" rather than underflowing.
            Some(last_success) => now_ms.saturating_sub(last_success) < self.grace_ms,
            // Never succeeded: no grace, so cold boot gates on the real dependency.
            None => false,
        };
        if in_grace {
            DependencyStatus::InGrace { failure }
        } else {
            DependencyStatus::Down { failure }
        }
    }
}

/// One dependency's standing at an instant.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DependencyStatus {
    /// The latest probe succeeded (or the dependency is not configured).
    Healthy,
    /// The latest probe failed, but the dependency succeeded less than its grace ago.
    InGrace { failure: &'static str },
    /// The latest probe failed (or none ran) and no grace covers it.
    Down { failure: &'static str },
}

impl DependencyStatus {
    /// Whether this dependency lets the process be ready.
    pub fn satisfied(self) -> bool {
        !matches!(self, DependencyStatus::Down { .. })
    }

    /// The failure reason, if the dependency is failing (in grace or down).
    pub fn failure(self) -> Option<&'static str> {
        match self {
            DependencyStatus::Healthy => None,
            DependencyStatus::InGrace { failure } | DependencyStatus::Down { failure } => {
                Some(failure)
            }
        }
    }
}

/// Both dependencies' state: what the prober has recorded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Snapshot {
    dependencies: [DependencyState; 2],
}

impl Snapshot {
    /// A snapshot before any probe: JWKS skipped when not configured.
    pub fn new(jwks_configured: bool, jwks_grace_ms: u64, sql_grace_ms: u64) -> Self {
        let jwks = if jwks_configured {
            DependencyState::new(jwks_grace_ms)
        } else {
            DependencyState::unconfigured()
        };
        Snapshot {
            dependencies: [jwks, DependencyState::new(sql_grace_ms)],
        }
    }

    pub fn dependency(&self, dependency: Dependency) -> &DependencyState {
        &self.dependencies[dependency.index()]
    }

    pub fn dependency_mut(&mut self, dependency: Dependency) -> &mut DependencyState {
        &mut self.dependencies[dependency.index()]
    }

    /// Each configured dependency with its status at `now_ms`, in [`Dependency::ALL`] order.
    pub fn statuses(&self, now_ms: u64) -> Vec<(Dependency, DependencyStatus)> {
        Dependency::ALL
            .into_iter()
            .filter(|&dependency| self.dependency(dependency).configured)
            .map(|dependency| (dependency, self.dependency(dependency).status(now_ms)))
            .collect()
    }
}

/// Where the process is in its life (SPEC §8, §9).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Listeners are bound but the startup handshake has not finished.
    Starting,
    /// Serving: `/ready` follows the dependencies.
    Serving,
    /// SIGTERM arrived: the load balancer must stop sending new connections.
    Draining,
}

/// The answer to `GET /ready`: an HTTP status and an exact JSON body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verdict {
    pub status: u16,
    pub body: String,
}

impl Verdict {
    /// Whether the process is ready (the heartbeat's `ready` field).
    pub fn ready(&self) -> bool {
        self.status == 200
    }
}

// The bodies are structs rather than `serde_json::json!` maps so the keys keep the order SPEC §7
// writes them in (`serde_json::Map` would sort them).
#[derive(Serialize)]
struct ReadyBody {
    ok: bool,
}

#[derive(Serialize)]
struct DegradedBody {
    ok: bool,
    degraded: bool,
    dependency: Vec<&'static str>,
    failure: BTreeMap<&'static str, &'static str>,
}

#[derive(Serialize)]
struct ErrorBody {
    error: &'static str,
}

#[derive(Serialize)]
struct UnavailableBody {
    error: &'static str,
    failures: BTreeMap<&'static str, &'static str>,
}

fn to_json(body: &impl Serialize) -> String {
    // Structs of bools, static strings, vectors and string maps always serialize.
    serde_json::to_string(body).expect("readiness bodies are plain data")
}

/// The `/ready` answer for this state, phase and instant (SPEC §7).
pub fn verdict(state: &Snapshot, phase: Phase, now_ms: u64) -> Verdict {
    match phase {
        Phase::Starting => {
            return Verdict {
                status: 503,
                body: to_json(&ErrorBody { error: "starting" }),
            }
        }
        Phase::Draining => {
            return Verdict {
                status: 503,
                body: to_json(&ErrorBody { error: "draining" }),
            }
        }
        Phase::Serving => {}
    }
    let statuses = state.statuses(now_ms);
    let failures: BTreeMap<&'static str, &'static str> = statuses
        .iter()
        .filter_map(|&(dependency, status)| Some((dependency.name(), status.failure()?)))
        .collect();
    if statuses.iter().any(|&(_, status)| !status.satisfied()) {
        return Verdict {
            status: 503,
            body: to_json(&UnavailableBody {
                error: "dependency_unavailable",
                failures,
            }),
        };
    }
    if failures.is_empty() {
        return Verdict {
            status: 200,
            body: to_json(&ReadyBody { ok: true }),
        };
    }
    let dependency = statuses
        .iter()
        .filter(|(_, status)| matches!(status, DependencyStatus::InGrace { .. }))
        .map(|(dependency, _)| dependency.name())
        .collect();
    Verdict {
        status: 200,
        body: to_json(&DegradedBody {
            ok: true,
            degraded: true,
            dependency,
            failure: failures,
        }),
    }
}

/// How a dependency left its grace window.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GraceExit {
    /// A probe succeeded again.
    Recovered,
    /// The window ran out while the dependency was still failing.
    Expired,
}

impl GraceExit {
    fn name(self) -> &'static str {
        match self {
            GraceExit::Recovered => "recovered",
            GraceExit::Expired => "expired",
        }
    }
}

/// A readiness change worth one log line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReadinessEvent {
    /// Healthy → in grace: `/ready` now answers degraded for this dependency.
    GraceEntered {
        dependency: Dependency,
        failure: &'static str,
    },
    /// In grace → healthy (`recovered`) or → down (`expired`).
    GraceLeft {
        dependency: Dependency,
        grace: GraceExit,
    },
    /// Healthy → down without a window (grace 0, or the window passed between two polls).
    /// Not a grace crossing; logged so that a 503 always has a line explaining it.
    DependencyDown {
        dependency: Dependency,
        failure: &'static str,
    },
    /// Down → healthy: the first success at boot, or a return after an expired window.
    DependencyUp { dependency: Dependency },
}

impl ReadinessEvent {
    /// `info` for good news, `warn` for a dependency failing.
    pub fn level(&self) -> log::Level {
        match self {
            ReadinessEvent::GraceLeft {
                grace: GraceExit::Recovered,
                ..
            }
            | ReadinessEvent::DependencyUp { .. } => log::Level::Info,
            ReadinessEvent::GraceEntered { .. }
            | ReadinessEvent::GraceLeft {
                grace: GraceExit::Expired,
                ..
            }
            | ReadinessEvent::DependencyDown { .. } => log::Level::Warn,
        }
    }
}

/// The log line: the event name, then `key=value` fields.
impl fmt::Display for ReadinessEvent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ReadinessEvent::GraceEntered {
                dependency,
                failure,
            } => write!(
                f,
                "orca_relay_readiness_grace_entered dependency={dependency} failure={failure}"
            ),
            ReadinessEvent::GraceLeft { dependency, grace } => write!(
                f,
                "orca_relay_readiness_grace_left dependency={dependency} grace={}",
                grace.name()
            ),
            ReadinessEvent::DependencyDown {
                dependency,
                failure,
            } => write!(
                f,
                "orca_relay_readiness_dependency_down dependency={dependency} failure={failure}"
            ),
            ReadinessEvent::DependencyUp { dependency } => {
                write!(
                    f,
                    "orca_relay_readiness_dependency_up dependency={dependency}"
                )
            }
        }
    }
}

/// The event, if any, for one dependency moving from `previous` to `current`. At most one per
/// call, so a crossing logs exactly once; a dependency that stays in grace (even with a new
/// failure reason) or stays down logs nothing.
pub fn crossing(
    dependency: Dependency,
    previous: DependencyStatus,
    current: DependencyStatus,
) -> Option<ReadinessEvent> {
    use DependencyStatus::{Down, Healthy, InGrace};
    match (previous, current) {
        (Healthy, Healthy) | (InGrace { .. }, InGrace { .. }) | (Down { .. }, Down { .. }) => None,
        // Down → in grace cannot follow from a probe (only a success moves the window, and a
        // success is healthy), but a stepped clock could produce it; it is still an entry.
        (Healthy | Down { .. }, InGrace { failure }) => Some(ReadinessEvent::GraceEntered {
            dependency,
            failure,
        }),
        (InGrace { .. }, Healthy) => Some(ReadinessEvent::GraceLeft {
            dependency,
            grace: GraceExit::Recovered,
        }),
        (InGrace { .. }, Down { .. }) => Some(ReadinessEvent::GraceLeft {
            dependency,
            grace: GraceExit::Expired,
        }),
        (Healthy, Down { failure }) => Some(ReadinessEvent::DependencyDown {
            dependency,
            failure,
        }),
        (Down { .. }, Healthy) => Some(ReadinessEvent::DependencyUp { dependency }),
    }
}

#[cfg(test)]
mod tests {
    use super::reason::*;
    use super::*;
    use serde_json::{json, Value};

    const JWKS_GRACE: u64 = 900_000;
    const SQL_GRACE: u64 = 180_000;
    const T0: u64 = 1_700_000_000_000;

    fn state() -> Snapshot {
        Snapshot::new(true, JWKS_GRACE, SQL_GRACE)
    }

    fn record(
        state: &mut Snapshot,
        dependency: Dependency,
        result: Result<(), &'static str>,
        at: u64,
    ) {
        state.dependency_mut(dependency).record(result, at);
    }

    fn both_healthy_at(at: u64) -> Snapshot {
        let mut s = state();
        record(&mut s, Dependency::Jwks, Ok(()), at);
        record(&mut s, Dependency::Sql, Ok(()), at);
        s
    }

    /// Checks the status, the exact body string, and that the body parses to `expected`.
    fn check(verdict: Verdict, status: u16, expected: Value) {
        assert_eq!(verdict.status, status, "body: {}", verdict.body);
        let parsed: Value = serde_json::from_str(&verdict.body).expect("body is JSON");
        assert_eq!(parsed, expected);
        // Only used for single-key bodies, where the sorted `Value` order is the exact order.
        assert_eq!(verdict.body, expected.to_string());
        assert_eq!(verdict.ready(), status == 200);
    }

    /// Checks the status and the exact body string (key order as SPEC §7 writes it), and that
    /// the body parses to the same JSON as `exact`.
    fn check_exact(verdict: Verdict, status: u16, exact: &str) {
        assert_eq!(verdict.status, status, "body: {}", verdict.body);
        assert_eq!(verdict.body, exact);
        let parsed: Value = serde_json::from_str(&verdict.body).expect("body is JSON");
        let reparsed: Value = serde_json::from_str(exact).expect("expected is JSON");
        assert_eq!(parsed, reparsed);
    }

    #[test]
    fn both_healthy_is_ok() {
        let s = both_healthy_at(T0);
        check(
            verdict(&s, Phase::Serving, T0 + 1),
            200,
            json!({"ok": true}),
        );
    }

    #[test]
    fn before_the_first_probe_the_process_is_not_ready() {
        check_exact(
            verdict(&state(), Phase::Serving, T0),
            503,
            r#"{"error":"dependency_unavailable","failures":{"jwks":"not_probed","sql":"not_probed"}}"#,
        );
    }

    #[test]
    fn starting_and_draining_answer_503_whatever_the_dependencies() {
        let s = both_healthy_at(T0);
        check(
            verdict(&s, Phase::Starting, T0),
            503,
            json!({"error": "starting"}),
        );
        check(
            verdict(&s, Phase::Draining, T0),
            503,
            json!({"error": "draining"}),
        );
        check(
            verdict(&state(), Phase::Starting, T0),
            503,
            json!({"error": "starting"}),
        );
    }

    #[test]
    fn jwks_down_inside_grace_is_degraded_then_503_past_grace() {
        let mut s = both_healthy_at(T0);
        record(&mut s, Dependency::Sql, Ok(()), T0 + JWKS_GRACE); // SQL stays healthy throughout
        record(&mut s, Dependency::Jwks, Err(JWKS_HTTP_FAILED), T0 + 5_000);
        let degraded = r#"{"ok":true,"degraded":true,"dependency":["jwks"],"failure":{"jwks":"jwks_http_failed"}}"#;
        check_exact(verdict(&s, Phase::Serving, T0 + 5_000), 200, degraded);
        // The last instant inside the window: now − last_success = grace − 1.
        check_exact(
            verdict(&s, Phase::Serving, T0 + JWKS_GRACE - 1),
            200,
            degraded,
        );
        // now − last_success = grace is outside (the rule is strictly less than).
        check_exact(
            verdict(&s, Phase::Serving, T0 + JWKS_GRACE),
            503,
            r#"{"error":"dependency_unavailable","failures":{"jwks":"jwks_http_failed"}}"#,
        );
    }

    #[test]
    fn sql_down_inside_grace_is_degraded_with_its_own_shorter_window() {
        let mut s = both_healthy_at(T0);
        record(&mut s, Dependency::Sql, Err(SQL_TIMED_OUT), T0 + 1_000);
        check_exact(
            verdict(&s, Phase::Serving, T0 + SQL_GRACE - 1),
            200,
            r#"{"ok":true,"degraded":true,"dependency":["sql"],"failure":{"sql":"sql_timed_out"}}"#,
        );
        check_exact(
            verdict(&s, Phase::Serving, T0 + SQL_GRACE),
            503,
            r#"{"error":"dependency_unavailable","failures":{"sql":"sql_timed_out"}}"#,
        );
    }

    #[test]
    fn never_succeeded_is_503_at_once() {
        let mut s = state();
        record(&mut s, Dependency::Jwks, Ok(()), T0);
        record(&mut s, Dependency::Sql, Err(SQL_FAILED), T0);
        check_exact(
            verdict(&s, Phase::Serving, T0),
            503,
            r#"{"error":"dependency_unavailable","failures":{"sql":"sql_failed"}}"#,
        );
    }

    #[test]
    fn grace_zero_is_503_at_once() {
        let mut s = Snapshot::new(true, 0, 0);
        record(&mut s, Dependency::Jwks, Ok(()), T0);
        record(&mut s, Dependency::Sql, Ok(()), T0);
        record(&mut s, Dependency::Jwks, Err(JWKS_TIMED_OUT), T0);
        check_exact(
            verdict(&s, Phase::Serving, T0),
            503,
            r#"{"error":"dependency_unavailable","failures":{"jwks":"jwks_timed_out"}}"#,
        );
    }

    #[test]
    fn both_failing_inside_grace_reports_both_as_degraded() {
        let mut s = both_healthy_at(T0);
        record(&mut s, Dependency::Jwks, Err(JWKS_HTTP_FAILED), T0 + 1);
        record(&mut s, Dependency::Sql, Err(SQL_FAILED), T0 + 1);
        check_exact(
            verdict(&s, Phase::Serving, T0 + 10_000),
            200,
            r#"{"ok":true,"degraded":true,"dependency":["jwks","sql"],"failure":{"jwks":"jwks_http_failed","sql":"sql_failed"}}"#,
        );
    }

    #[test]
    fn not_ready_reports_every_failing_dependency_including_one_still_in_grace() {
        let mut s = both_healthy_at(T0);
        record(&mut s, Dependency::Jwks, Err(JWKS_HTTP_FAILED), T0 + 1);
        record(&mut s, Dependency::Sql, Err(SQL_FAILED), T0 + 1);
        // SQL's 3 min window is over; JWKS's 15 min window is not.
        check_exact(
            verdict(&s, Phase::Serving, T0 + SQL_GRACE),
            503,
            r#"{"error":"dependency_unavailable","failures":{"jwks":"jwks_http_failed","sql":"sql_failed"}}"#,
        );
    }

    #[test]
    fn a_healthy_jwks_never_holds_a_dead_sql_open() {
        let mut s = both_healthy_at(T0);
        record(&mut s, Dependency::Sql, Err(SQL_FAILED), T0 + 1);
        // JWKS keeps succeeding long after SQL's last success.
        for step in 1..=100 {
            record(&mut s, Dependency::Jwks, Ok(()), T0 + step * 5_000);
            record(&mut s, Dependency::Sql, Err(SQL_FAILED), T0 + step * 5_000);
        }
        let now = T0 + 100 * 5_000;
        assert_eq!(
            s.dependency(Dependency::Jwks).status(now),
            DependencyStatus::Healthy
        );
        check_exact(
            verdict(&s, Phase::Serving, now),
            503,
            r#"{"error":"dependency_unavailable","failures":{"sql":"sql_failed"}}"#,
        );
    }

    #[test]
    fn the_window_restarts_from_the_latest_success() {
        let mut s = both_healthy_at(T0);
        record(&mut s, Dependency::Sql, Err(SQL_FAILED), T0 + 1_000);
        record(&mut s, Dependency::Sql, Ok(()), T0 + 100_000);
        record(&mut s, Dependency::Sql, Err(SQL_FAILED), T0 + 105_000);
        // Measured from T0 this would have expired; from the success at +100 s it has not.
        let now = T0 + SQL_GRACE + 50_000;
        assert_eq!(
            s.dependency(Dependency::Sql).status(now),
            DependencyStatus::InGrace {
                failure: SQL_FAILED
            }
        );
        assert!(verdict(&s, Phase::Serving, now).ready());
        assert!(!verdict(&s, Phase::Serving, T0 + 100_000 + SQL_GRACE).ready());
    }

    #[test]
    fn unconfigured_jwks_is_satisfied_and_never_reported() {
        let mut s = Snapshot::new(false, JWKS_GRACE, SQL_GRACE);
        assert_eq!(
            s.statuses(T0),
            vec![(
                Dependency::Sql,
                DependencyStatus::Down {
                    failure: NOT_PROBED
                }
            )]
        );
        check_exact(
            verdict(&s, Phase::Serving, T0),
            503,
            r#"{"error":"dependency_unavailable","failures":{"sql":"not_probed"}}"#,
        );
        record(&mut s, Dependency::Sql, Ok(()), T0);
        check(verdict(&s, Phase::Serving, T0), 200, json!({"ok": true}));
        record(&mut s, Dependency::Sql, Err(SQL_FAILED), T0 + 1);
        check_exact(
            verdict(&s, Phase::Serving, T0 + 2),
            200,
            r#"{"ok":true,"degraded":true,"dependency":["sql"],"failure":{"sql":"sql_failed"}}"#,
        );
    }

    #[test]
    fn crossings_follow_the_table() {
        use DependencyStatus::{Down, Healthy, InGrace};
        let jwks = Dependency::Jwks;
        let in_grace = InGrace {
            failure: JWKS_HTTP_FAILED,
        };
        let down = Down {
            failure: JWKS_HTTP_FAILED,
        };
        let cases: [(DependencyStatus, DependencyStatus, Option<&str>); 10] = [
            (Healthy, Healthy, None),
            (
                Healthy,
                in_grace,
                Some("orca_relay_readiness_grace_entered dependency=jwks failure=jwks_http_failed"),
            ),
            (
                in_grace,
                Healthy,
                Some("orca_relay_readiness_grace_left dependency=jwks grace=recovered"),
            ),
            (
                in_grace,
                down,
                Some("orca_relay_readiness_grace_left dependency=jwks grace=expired"),
            ),
            // A new reason inside the window is not a new crossing.
            (
                in_grace,
                InGrace {
                    failure: JWKS_TIMED_OUT,
                },
                None,
            ),
            (
                down,
                Down {
                    failure: JWKS_TIMED_OUT,
                },
                None,
            ),
            (
                Healthy,
                down,
                Some(
                    "orca_relay_readiness_dependency_down dependency=jwks failure=jwks_http_failed",
                ),
            ),
            (
                down,
                Healthy,
                Some("orca_relay_readiness_dependency_up dependency=jwks"),
            ),
            (
                Down {
                    failure: NOT_PROBED,
                },
                Healthy,
                Some("orca_relay_readiness_dependency_up dependency=jwks"),
            ),
            (
                down,
                in_grace,
                Some("orca_relay_readiness_grace_entered dependency=jwks failure=jwks_http_failed"),
            ),
        ];
        for (previous, current, expected) in cases {
            let line = crossing(jwks, previous, current).map(|event| event.to_string());
            assert_eq!(line.as_deref(), expected, "{previous:?} -> {current:?}");
        }
    }

    #[test]
    fn recovered_logs_at_info_and_failures_at_warn() {
        let sql = Dependency::Sql;
        let recovered = ReadinessEvent::GraceLeft {
            dependency: sql,
            grace: GraceExit::Recovered,
        };
        let expired = ReadinessEvent::GraceLeft {
            dependency: sql,
            grace: GraceExit::Expired,
        };
        let entered = ReadinessEvent::GraceEntered {
            dependency: sql,
            failure: SQL_FAILED,
        };
        assert_eq!(recovered.level(), log::Level::Info);
        assert_eq!(expired.level(), log::Level::Warn);
        assert_eq!(entered.level(), log::Level::Warn);
        assert_eq!(
            ReadinessEvent::DependencyUp { dependency: sql }.level(),
            log::Level::Info
        );
    }
}
