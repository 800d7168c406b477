//! Readiness (SPEC §7): `/ready` answered from last-known-good state, so a short auth or SQL
//! blip does not take the cell out of its load balancer.
//!
//! Owns the per-dependency last-success clocks and the process [`Phase`], behind one mutex in
//! [`Readiness`] (a cheap-to-clone handle). The `readiness` thread runs [`run_prober`]: it probes
//! JWKS and SQL on every poll, records the results and logs each grace crossing once. The HTTP
//! workers call [`Readiness::answer`], which reads the recorded state and the clock and computes
//! the verdict (the pure rules live in [`verdict`]).
//!
//! Never: probe a dependency from `GET /ready` (the answer must not block on a dependency that is
//! down, which is exactly when the load balancer is asking); hold the lock while probing; skip
//! the SQL probe because JWKS failed (that let the SQL clock age with no evidence behind it).

mod verdict;

pub use verdict::{
    crossing, reason, verdict, Dependency, DependencyState, DependencyStatus, GraceExit, Phase,
    ReadinessEvent, Snapshot, Verdict,
};

use std::sync::mpsc::Receiver;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use crate::carry::process::{DependencyRecord, ReadinessRecord};
use crate::clock::SharedClock;
use crate::config::Config;
use crate::metrics::Registry;

/// One probe: `Ok` when the dependency answered, else a short reason code from [`reason`]
/// and what the dependency said, if anything. It must bound its own time (JWKS: 2 s HTTP
/// timeout; SQL: a statement timeout), since the prober waits for it.
pub type Probe = Box<dyn Fn() -> Result<(), ProbeFailure> + Send>;

/// Why a probe failed: the short reason `/ready` reports, and the fields the failure line adds
/// (`sqlstate=25006`, `sqlite=SQLITE_FULL`: what the database said; never raw error text).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProbeFailure {
    pub reason: &'static str,
    pub detail: Option<String>,
}

impl From<&'static str> for ProbeFailure {
    fn from(reason: &'static str) -> Self {
        ProbeFailure {
            reason,
            detail: None,
        }
    }
}

impl From<&crate::store::StoreError> for ProbeFailure {
    fn from(error: &crate::store::StoreError) -> Self {
        let fields = error.log_fields();
        // `reason=… sqlstate=…`: the reason is reported on its own, the rest is the detail.
        let detail = fields
            .split_once(' ')
            .map(|(_, code)| code.to_string())
            .filter(|code| !code.is_empty());
        ProbeFailure {
            reason: error.reason_code(),
            detail,
        }
    }
}

/// The probes the prober runs on every poll.
pub struct Probes {
    /// `GET` the JWKS URL and require 2xx; `None` when no JWKS is configured.
    pub jwks: Option<Probe>,
    /// The store's probe under a timeout: it answers and takes writes (`Store::probe`).
    pub sql: Probe,
}

/// A readiness event as the prober logs it: a failure carries what the dependency said
/// (`orca_relay_readiness_grace_entered dependency=sql failure=sql_read_only sqlstate=25006`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProbedEvent {
    pub event: ReadinessEvent,
    pub detail: Option<String>,
}

impl std::fmt::Display for ProbedEvent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.event)?;
        match (&self.detail, &self.event) {
            (
                Some(detail),
                ReadinessEvent::GraceEntered { .. } | ReadinessEvent::DependencyDown { .. },
            ) => write!(f, " {detail}"),
            _ => Ok(()),
        }
    }
}

/// The state behind the lock: what the prober recorded, the phase, and the status of each
/// dependency as of its latest recorded probe (what crossings are measured against).
#[derive(Debug)]
struct Inner {
    snapshot: Snapshot,
    phase: Phase,
    reported: [DependencyStatus; 2],
}

impl Inner {
    /// Records one result and returns the crossing it caused, if any. The previous status is
    /// the one reported at the previous probe, not one recomputed now: a window that expired
    /// between two polls and a recovery on the second poll is still a `recovered` crossing out
    /// of the grace that was logged as entered.
    fn record(
        &mut self,
        dependency: Dependency,
        result: Result<(), &'static str>,
        now_ms: u64,
    ) -> Option<ReadinessEvent> {
        let state = self.snapshot.dependency_mut(dependency);
        if !state.configured {
            return None;
        }
        state.record(result, now_ms);
        let current = state.status(now_ms);
        let previous = std::mem::replace(&mut self.reported[dependency.index()], current);
        crossing(dependency, previous, current)
    }
}

/// The shared readiness state: a cheap clone of one `Arc<Mutex<…>>`. Locks are held only to
/// copy or update a few words; no I/O ever happens under it.
#[derive(Debug, Clone)]
pub struct Readiness {
    inner: Arc<Mutex<Inner>>,
    jwks_configured: bool,
}

impl Readiness {
    /// A process that has probed nothing yet, in [`Phase::Starting`].
    pub fn new(jwks_configured: bool, jwks_grace_ms: u64, sql_grace_ms: u64) -> Self {
        let snapshot = Snapshot::new(jwks_configured, jwks_grace_ms, sql_grace_ms);
        // Statuses before any probe do not depend on the time (never succeeded: no grace).
        let reported = Dependency::ALL.map(|dependency| snapshot.dependency(dependency).status(0));
        Readiness {
            inner: Arc::new(Mutex::new(Inner {
                snapshot,
                phase: Phase::Starting,
                reported,
            })),
            jwks_configured,
        }
    }

    /// Graces from `ORCA_RELAY_READINESS_{JWKS,SQL}_GRACE_MS`; JWKS is skipped without
    /// `ORCA_RELAY_JWKS_URL` (a self-hosted key needs no key fetch).
    pub fn from_config(config: &Config) -> Self {
        Readiness::new(
            config.jwks_url.is_some(),
            config.readiness_jwks_grace_ms,
            config.readiness_sql_grace_ms,
        )
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // The state stays consistent even if a holder panicked: every update is a few stores.
        self.inner
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Records one probe result observed at `now_ms` and returns the crossing it caused, for
    /// the caller to log ([`log_event`]). Results for an unconfigured JWKS are ignored.
    #[must_use = "a grace crossing must be logged"]
    pub fn record(
        &self,
        dependency: Dependency,
        result: Result<(), &'static str>,
        now_ms: u64,
    ) -> Option<ReadinessEvent> {
        self.lock().record(dependency, result, now_ms)
    }

    /// A copy of what has been recorded.
    pub fn snapshot(&self) -> Snapshot {
        self.lock().snapshot
    }

    pub fn phase(&self) -> Phase {
        self.lock().phase
    }

    /// Moves the process to `phase`. Draining is one-way: once SIGTERM has flipped `/ready` to
    /// draining, a late "handshake finished" must not put the cell back into its load balancer.
    pub fn set_phase(&self, phase: Phase) {
        let mut inner = self.lock();
        if inner.phase != Phase::Draining {
            inner.phase = phase;
        }
    }

    /// What `GET /ready` answers at `now_ms`. Reads recorded state only; never probes.
    pub fn answer(&self, now_ms: u64) -> Verdict {
        let (snapshot, phase) = {
            let inner = self.lock();
            (inner.snapshot, inner.phase)
        };
        verdict(&snapshot, phase, now_ms)
    }

    /// One poll: probes JWKS (when configured) and then SQL, whatever JWKS answered, with the
    /// lock released; then records both at `now_ms` and returns the crossings, JWKS first.
    /// A probe that panics counts as a failure instead of killing the prober, which would
    /// otherwise leave the last "healthy" in place forever.
    pub fn probe_once(&self, probes: &Probes, now_ms: u64) -> Vec<ProbedEvent> {
        let jwks = match (&probes.jwks, self.jwks_configured) {
            (Some(probe), true) => Some(run_probe(probe, reason::JWKS_PROBE_PANICKED)),
            // Configured but no probe given: JWKS stays `not_probed`, visible in `/ready`.
            (None, true) | (_, false) => None,
        };
        let sql = run_probe(&probes.sql, reason::SQL_PROBE_PANICKED);

        let mut inner = self.lock();
        let mut events = Vec::new();
        for (dependency, result) in [(Dependency::Jwks, jwks), (Dependency::Sql, Some(sql))] {
            let Some(result) = result else { continue };
            let detail = result
                .as_ref()
                .err()
                .and_then(|failure| failure.detail.clone());
            let recorded = result.map_err(|failure| failure.reason);
            if let Some(event) = inner.record(dependency, recorded, now_ms) {
                events.push(ProbedEvent { event, detail });
            }
        }
        drop(inner);
        events
    }

    /// Registers `orca_relay_readiness_up`, `…_in_grace` and `…_last_success_age_seconds`, each
    /// labelled by `dependency`, sampled at render time. An unconfigured JWKS has no series; a
    /// dependency that never succeeded has no age series (there is no age to report).
    pub fn register_metrics(&self, registry: &Registry, clock: SharedClock) {
        let readiness = self.clone();
        let now = clock.clone();
        registry.sampled_gauge(
            "orca_relay_readiness_up",
            "1 when the dependency's latest probe succeeded.",
            move || {
                readiness.samples(now.now_ms(), |_, status| {
                    Some(f64::from(u8::from(status == DependencyStatus::Healthy)))
                })
            },
        );
        let readiness = self.clone();
        let now = clock.clone();
        registry.sampled_gauge(
            "orca_relay_readiness_in_grace",
            "1 when the dependency is failing but still inside its last-known-good window.",
            move || {
                readiness.samples(now.now_ms(), |_, status| {
                    Some(f64::from(u8::from(matches!(
                        status,
                        DependencyStatus::InGrace { .. }
                    ))))
                })
            },
        );
        let readiness = self.clone();
        registry.sampled_gauge(
            "orca_relay_readiness_last_success_age_seconds",
            "Seconds since the dependency's latest successful probe.",
            move || {
                let now_ms = clock.now_ms();
                readiness.samples(now_ms, |state, _| {
                    let last_success = state.last_success_ms?;
                    Some(now_ms.saturating_sub(last_success) as f64 / 1000.0)
                })
            },
        );
    }

    /// One sample per configured dependency for which `value` gives one.
    fn samples(
        &self,
        now_ms: u64,
        value: impl Fn(&DependencyState, DependencyStatus) -> Option<f64>,
    ) -> Vec<(Vec<(String, String)>, f64)> {
        let snapshot = self.snapshot();
        snapshot
            .statuses(now_ms)
            .into_iter()
            .filter_map(|(dependency, status)| {
                let sample = value(snapshot.dependency(dependency), status)?;
                Some((
                    vec![("dependency".to_string(), dependency.name().to_string())],
                    sample,
                ))
            })
            .collect()
    }
}

fn run_probe(probe: &Probe, panicked: &'static str) -> Result<(), ProbeFailure> {
    crate::threads::catch_panic(probe).unwrap_or(Err(panicked.into()))
}

impl Readiness {
    pub fn state_record(&self, at: &crate::carry::time::Snapshot) -> ReadinessRecord {
        let inner = self.lock();
        let dependencies = Dependency::ALL
            .iter()
            .map(|dependency| {
                let state = inner.snapshot.dependency(*dependency);
                let (reported, reported_failure) = match inner.reported[dependency.index()] {
                    DependencyStatus::Healthy => ("healthy", None),
                    DependencyStatus::InGrace { failure } => ("grace", Some(failure.to_string())),
                    DependencyStatus::Down { failure } => ("down", Some(failure.to_string())),
                };
                DependencyRecord {
                    dependency: dependency.name().to_string(),
                    last_success_ago_ms: state.last_success_ms.map(|at_ms| at.age_ms(at_ms)),
                    last_failure: state.last_failure.map(str::to_string),
                    reported: reported.to_string(),
                    reported_failure,
                }
            })
            .collect();
        ReadinessRecord { dependencies }
    }

    /// Takes a handover's last-known-good state: a dependency inside its grace window stays in
    /// it with the same deadline, and `/ready` answers as it did before the first probe here.
    pub fn restore_state(&self, record: &ReadinessRecord, carry: &crate::carry::time::Carry) {
        let mut inner = self.lock();
        for dependency in Dependency::ALL {
            let Some(carried) = record
                .dependencies
                .iter()
                .find(|d| d.dependency == dependency.name())
            else {
                continue;
            };
            let state = inner.snapshot.dependency_mut(dependency);
            if !state.configured {
                continue;
            }
            state.last_success_ms = carried.last_success_ago_ms.map(|age| carry.moment_ms(age));
            state.last_failure = carried.last_failure.as_deref().map(reason::intern);
            let failure = carried
                .reported_failure
                .as_deref()
                .map_or(reason::NOT_PROBED, reason::intern);
            inner.reported[dependency.index()] = match carried.reported.as_str() {
                "healthy" => DependencyStatus::Healthy,
                "grace" => DependencyStatus::InGrace { failure },
                _ => DependencyStatus::Down { failure },
            };
        }
    }
}

/// Logs one readiness event at its level (`info` for recoveries, `warn` for failures).
pub fn log_event(event: &ProbedEvent) {
    log::log!(event.event.level(), "{event}");
}

/// The body of the `readiness` thread: polls both dependencies every `period` until a message
/// arrives on `stop` or its sender is dropped. The first poll runs at once, so a healthy process
/// becomes ready without waiting a period. The wait starts after the probes return, so a slow
/// probe stretches the period rather than overlapping the next poll.
pub fn run_prober(
    readiness: Readiness,
    probes: Probes,
    clock: SharedClock,
    period: Duration,
    stop: Receiver<()>,
    beat: &crate::liveness::Beat,
) {
    log::info!(
        "orca_relay_readiness_prober_started period_ms={} jwks={}",
        period.as_millis(),
        if readiness.jwks_configured {
            "configured"
        } else {
            "skipped"
        }
    );
    loop {
        beat.beat();
        // The probes wait on the JWKS and the database (bounded by their own timeouts, or by
        // the database's): not this thread being stuck.
        for event in beat.waiting(|| readiness.probe_once(&probes, clock.now_ms())) {
            log_event(&event);
        }
        // A critical thread: it beats at least once a beat period while it waits.
        if crate::liveness::wait_beating(&stop, crate::clock::instant() + period, beat) {
            break;
        }
    }
    log::info!("orca_relay_readiness_prober_stopped");
}

#[cfg(test)]
mod tests {
    use super::reason::*;
    use super::*;
    use crate::clock::{Clock, ManualClock};
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::mpsc;

    const T0: u64 = 1_700_000_000_000;
    const JWKS_GRACE: u64 = 900_000;
    const SQL_GRACE: u64 = 180_000;
    const POLL: u64 = 5_000;

    /// A probe whose answer the test sets, counting its calls.
    #[derive(Clone)]
    struct FakeProbe {
        answer: Arc<Mutex<Result<(), &'static str>>>,
        calls: Arc<AtomicUsize>,
    }

    impl FakeProbe {
        fn new() -> Self {
            FakeProbe {
                answer: Arc::new(Mutex::new(Ok(()))),
                calls: Arc::new(AtomicUsize::new(0)),
            }
        }
        fn answer(&self, answer: Result<(), &'static str>) {
            *self.answer.lock().unwrap() = answer;
        }
        fn calls(&self) -> usize {
            self.calls.load(Ordering::SeqCst)
        }
        fn probe(&self) -> Probe {
            let fake = self.clone();
            Box::new(move || {
                fake.calls.fetch_add(1, Ordering::SeqCst);
                fake.answer.lock().unwrap().map_err(ProbeFailure::from)
            })
        }
    }

    struct Rig {
        readiness: Readiness,
        clock: Arc<ManualClock>,
        jwks: FakeProbe,
        sql: FakeProbe,
        probes: Probes,
    }

    impl Rig {
        fn new(jwks_grace_ms: u64, sql_grace_ms: u64) -> Self {
            let readiness = Readiness::new(true, jwks_grace_ms, sql_grace_ms);
            readiness.set_phase(Phase::Serving);
            let (jwks, sql) = (FakeProbe::new(), FakeProbe::new());
            let probes = Probes {
                jwks: Some(jwks.probe()),
                sql: sql.probe(),
            };
            Rig {
                readiness,
                clock: ManualClock::starting_at(T0),
                jwks,
                sql,
                probes,
            }
        }

        /// Advances the clock by `ms`, polls once and returns the log lines of the poll.
        fn poll_after(&self, ms: u64) -> Vec<String> {
            self.clock.advance(ms);
            self.readiness
                .probe_once(&self.probes, self.clock.now_ms())
                .iter()
                .map(ToString::to_string)
                .collect()
        }

        fn answer(&self) -> Verdict {
            self.readiness.answer(self.clock.now_ms())
        }
    }

    fn lines(lines: &[&str]) -> Vec<String> {
        lines.iter().map(|line| line.to_string()).collect()
    }

    #[test]
    fn cold_boot_gates_on_the_real_dependencies() {
        let rig = Rig::new(JWKS_GRACE, SQL_GRACE);
        assert_eq!(
            rig.answer().body,
            r#"{"error":"dependency_unavailable","failures":{"jwks":"not_probed","sql":"not_probed"}}"#
        );
        rig.sql.answer(Err(SQL_FAILED));
        assert_eq!(
            rig.poll_after(0),
            lines(&["orca_relay_readiness_dependency_up dependency=jwks"])
        );
        assert_eq!(rig.answer().status, 503, "never succeeded: no grace");
        assert!(
            rig.poll_after(POLL).is_empty(),
            "still down logs nothing more"
        );
        rig.sql.answer(Ok(()));
        assert_eq!(
            rig.poll_after(POLL),
            lines(&["orca_relay_readiness_dependency_up dependency=sql"])
        );
        assert_eq!(
            rig.answer(),
            Verdict {
                status: 200,
                body: r#"{"ok":true}"#.into()
            }
        );
    }

    #[test]
    fn jwks_blip_is_degraded_then_recovered_with_one_line_per_crossing() {
        let rig = Rig::new(JWKS_GRACE, SQL_GRACE);
        rig.poll_after(0);
        rig.jwks.answer(Err(JWKS_TIMED_OUT));
        assert_eq!(
            rig.poll_after(POLL),
            lines(&["orca_relay_readiness_grace_entered dependency=jwks failure=jwks_timed_out"])
        );
        // Repeated failing polls inside the window, even with a new reason, log nothing more.
        rig.jwks.answer(Err(JWKS_HTTP_FAILED));
        for _ in 0..20 {
            assert!(rig.poll_after(POLL).is_empty());
        }
        assert_eq!(
            rig.answer().body,
            r#"{"ok":true,"degraded":true,"dependency":["jwks"],"failure":{"jwks":"jwks_http_failed"}}"#
        );
        rig.jwks.answer(Ok(()));
        assert_eq!(
            rig.poll_after(POLL),
            lines(&["orca_relay_readiness_grace_left dependency=jwks grace=recovered"])
        );
        assert_eq!(rig.answer().body, r#"{"ok":true}"#);
    }

    #[test]
    fn sql_outage_longer_than_its_grace_expires_once() {
        let rig = Rig::new(JWKS_GRACE, SQL_GRACE);
        rig.poll_after(0);
        rig.sql.answer(Err(SQL_FAILED));
        assert_eq!(
            rig.poll_after(POLL),
            lines(&["orca_relay_readiness_grace_entered dependency=sql failure=sql_failed"])
        );
        let mut logged = Vec::new();
        // 3 min of failing polls from the last success at T0; the poll at T0 + 180 s is out.
        for _ in 0..(SQL_GRACE / POLL - 1) {
            logged.extend(rig.poll_after(POLL));
            if rig.clock.now_ms() - T0 < SQL_GRACE {
                assert!(rig.answer().ready());
            }
        }
        assert_eq!(rig.clock.now_ms(), T0 + SQL_GRACE);
        assert_eq!(
            logged,
            lines(&["orca_relay_readiness_grace_left dependency=sql grace=expired"])
        );
        assert_eq!(
            rig.answer(),
            Verdict {
                status: 503,
                body: r#"{"error":"dependency_unavailable","failures":{"sql":"sql_failed"}}"#
                    .into()
            }
        );
        assert!(
            rig.poll_after(POLL).is_empty(),
            "down and staying down logs nothing"
        );
        rig.sql.answer(Ok(()));
        assert_eq!(
            rig.poll_after(POLL),
            lines(&["orca_relay_readiness_dependency_up dependency=sql"])
        );
    }

    #[test]
    fn expiry_between_polls_then_recovery_closes_the_logged_grace() {
        // A probe period longer than the remaining window: the entry was logged, so the exit
        // must be too, even though the poll that sees the success never saw "expired".
        let rig = Rig::new(JWKS_GRACE, 10_000);
        rig.poll_after(0);
        rig.sql.answer(Err(SQL_FAILED));
        assert_eq!(rig.poll_after(POLL).len(), 1);
        rig.sql.answer(Ok(()));
        assert_eq!(
            rig.poll_after(60_000),
            lines(&["orca_relay_readiness_grace_left dependency=sql grace=recovered"])
        );
    }

    #[test]
    fn jwks_recovering_as_sql_fails_logs_both_crossings() {
        let rig = Rig::new(JWKS_GRACE, SQL_GRACE);
        rig.poll_after(0);
        rig.jwks.answer(Err(JWKS_HTTP_FAILED));
        rig.poll_after(POLL);
        rig.jwks.answer(Ok(()));
        rig.sql.answer(Err(SQL_TIMED_OUT));
        assert_eq!(
            rig.poll_after(POLL),
            lines(&[
                "orca_relay_readiness_grace_left dependency=jwks grace=recovered",
                "orca_relay_readiness_grace_entered dependency=sql failure=sql_timed_out",
            ])
        );
        assert_eq!(
            rig.answer().body,
            r#"{"ok":true,"degraded":true,"dependency":["sql"],"failure":{"sql":"sql_timed_out"}}"#
        );
    }

    #[test]
    fn sql_is_probed_on_every_poll_even_when_jwks_fails() {
        let rig = Rig::new(JWKS_GRACE, SQL_GRACE);
        rig.jwks.answer(Err(JWKS_TIMED_OUT));
        for _ in 0..3 {
            rig.poll_after(POLL);
        }
        assert_eq!(rig.jwks.calls(), 3);
        assert_eq!(rig.sql.calls(), 3);
        // The SQL clock is fed by the SQL probe: SQL is healthy while JWKS never was.
        assert_eq!(
            rig.answer().body,
            r#"{"error":"dependency_unavailable","failures":{"jwks":"jwks_timed_out"}}"#
        );
        assert_eq!(
            rig.readiness
                .snapshot()
                .dependency(Dependency::Sql)
                .last_success_ms,
            Some(T0 + 3 * POLL)
        );
    }

    #[test]
    fn a_healthy_jwks_never_holds_a_dead_sql_open() {
        let rig = Rig::new(JWKS_GRACE, SQL_GRACE);
        rig.poll_after(0);
        rig.sql.answer(Err(SQL_FAILED));
        for _ in 0..(SQL_GRACE / POLL) {
            rig.poll_after(POLL);
        }
        assert_eq!(rig.answer().status, 503);
        assert_eq!(
            rig.readiness
                .snapshot()
                .dependency(Dependency::Jwks)
                .last_success_ms,
            Some(rig.clock.now_ms())
        );
    }

    #[test]
    fn grace_zero_goes_down_at_once_without_grace_lines() {
        let rig = Rig::new(0, 0);
        rig.poll_after(0);
        rig.jwks.answer(Err(JWKS_HTTP_FAILED));
        rig.sql.answer(Err(SQL_FAILED));
        assert_eq!(
            rig.poll_after(POLL),
            lines(&[
                "orca_relay_readiness_dependency_down dependency=jwks failure=jwks_http_failed",
                "orca_relay_readiness_dependency_down dependency=sql failure=sql_failed",
            ])
        );
        assert_eq!(
            rig.answer().body,
            r#"{"error":"dependency_unavailable","failures":{"jwks":"jwks_http_failed","sql":"sql_failed"}}"#
        );
    }

    #[test]
    fn unconfigured_jwks_is_never_probed_or_reported() {
        let readiness = Readiness::new(false, JWKS_GRACE, SQL_GRACE);
        readiness.set_phase(Phase::Serving);
        let (jwks, sql) = (FakeProbe::new(), FakeProbe::new());
        jwks.answer(Err(JWKS_HTTP_FAILED));
        let probes = Probes {
            jwks: Some(jwks.probe()),
            sql: sql.probe(),
        };
        let events: Vec<ReadinessEvent> = readiness
            .probe_once(&probes, T0)
            .into_iter()
            .map(|probed| probed.event)
            .collect();
        assert_eq!(
            events,
            vec![ReadinessEvent::DependencyUp {
                dependency: Dependency::Sql
            }]
        );
        assert_eq!(jwks.calls(), 0);
        assert_eq!(readiness.answer(T0).body, r#"{"ok":true}"#);
        assert_eq!(
            readiness.record(Dependency::Jwks, Err(JWKS_HTTP_FAILED), T0),
            None
        );
        assert_eq!(readiness.answer(T0).body, r#"{"ok":true}"#);
    }

    #[test]
    fn a_panicking_probe_is_a_failure_and_the_other_is_still_probed() {
        let readiness = Readiness::new(true, JWKS_GRACE, SQL_GRACE);
        readiness.set_phase(Phase::Serving);
        let sql = FakeProbe::new();
        let probes = Probes {
            jwks: Some(Box::new(|| panic!("probe bug"))),
            sql: sql.probe(),
        };
        readiness.probe_once(&probes, T0);
        assert_eq!(sql.calls(), 1);
        assert_eq!(
            readiness.answer(T0).body,
            r#"{"error":"dependency_unavailable","failures":{"jwks":"jwks_probe_panicked"}}"#
        );
    }

    #[test]
    fn phase_starts_starting_and_draining_is_one_way() {
        let readiness = Readiness::new(false, JWKS_GRACE, SQL_GRACE);
        assert!(readiness.record(Dependency::Sql, Ok(()), T0).is_some());
        assert_eq!(readiness.answer(T0).body, r#"{"error":"starting"}"#);
        readiness.set_phase(Phase::Serving);
        assert_eq!(readiness.answer(T0).body, r#"{"ok":true}"#);
        readiness.set_phase(Phase::Draining);
        readiness.set_phase(Phase::Serving);
        assert_eq!(readiness.phase(), Phase::Draining);
        assert_eq!(
            readiness.answer(T0),
            Verdict {
                status: 503,
                body: r#"{"error":"draining"}"#.into()
            }
        );
    }

    #[test]
    fn metrics_sample_each_dependency() {
        let rig = Rig::new(JWKS_GRACE, SQL_GRACE);
        let registry = Registry::new();
        rig.readiness.register_metrics(&registry, rig.clock.clone());
        let text = registry.render();
        assert!(text.contains("orca_relay_readiness_up{dependency=\"jwks\"} 0\n"));
        assert!(!text.contains("orca_relay_readiness_last_success_age_seconds{"));

        rig.poll_after(0);
        rig.jwks.answer(Err(JWKS_HTTP_FAILED));
        rig.poll_after(1_500);
        let text = registry.render();
        for line in [
            "orca_relay_readiness_up{dependency=\"jwks\"} 0\n",
            "orca_relay_readiness_up{dependency=\"sql\"} 1\n",
            "orca_relay_readiness_in_grace{dependency=\"jwks\"} 1\n",
            "orca_relay_readiness_in_grace{dependency=\"sql\"} 0\n",
            "orca_relay_readiness_last_success_age_seconds{dependency=\"jwks\"} 1.5\n",
            "orca_relay_readiness_last_success_age_seconds{dependency=\"sql\"} 0\n",
        ] {
            assert!(text.contains(line), "missing {line:?} in\n{text}");
        }
    }

    #[test]
    fn empty_grace_variables_mean_the_defaults_not_zero() {
        let config = Config::from_lookup(&|name| match name {
            "ORCA_RELAY_READINESS_JWKS_GRACE_MS" | "ORCA_RELAY_READINESS_SQL_GRACE_MS" => {
                Some(String::new())
            }
            "ORCA_RELAY_JWKS_URL" => Some("https://auth.example/.well-known/jwks.json".into()),
            "ORCA_RELAY_AUTH_ISSUER" => Some("https://auth.example".into()),
            _ => None,
        })
        .expect("config with empty graces parses");
        let readiness = Readiness::from_config(&config);
        let snapshot = readiness.snapshot();
        assert_eq!(snapshot.dependency(Dependency::Jwks).grace_ms, 900_000);
        assert_eq!(snapshot.dependency(Dependency::Sql).grace_ms, 180_000);
        assert!(snapshot.dependency(Dependency::Jwks).configured);
        // And it behaves as a window: a blip right after a success stays ready.
        readiness.set_phase(Phase::Serving);
        let _ = readiness.record(Dependency::Jwks, Ok(()), T0);
        let _ = readiness.record(Dependency::Sql, Ok(()), T0);
        let _ = readiness.record(Dependency::Sql, Err(SQL_FAILED), T0 + POLL);
        assert!(readiness.answer(T0 + POLL).ready());
    }

    #[test]
    fn without_a_jwks_url_jwks_is_skipped() {
        let config = Config::from_lookup(&|_| None).expect("defaults parse");
        let readiness = Readiness::from_config(&config);
        assert!(!readiness.snapshot().dependency(Dependency::Jwks).configured);
    }

    /// Runs the prober on its own thread with probes that report each call on a channel.
    fn spawn_prober(
        period: Duration,
    ) -> (
        mpsc::Sender<()>,
        mpsc::Receiver<&'static str>,
        std::thread::JoinHandle<()>,
        Readiness,
    ) {
        let readiness = Readiness::new(true, JWKS_GRACE, SQL_GRACE);
        readiness.set_phase(Phase::Serving);
        let (called, calls) = mpsc::channel();
        let jwks_called = called.clone();
        let probes = Probes {
            jwks: Some(Box::new(move || {
                let _ = jwks_called.send("jwks");
                Err(JWKS_TIMED_OUT.into())
            })),
            sql: Box::new(move || {
                let _ = called.send("sql");
                Ok(())
            }),
        };
        let (stop_tx, stop_rx) = mpsc::channel();
        let clock: SharedClock = ManualClock::starting_at(T0);
        let handle = crate::threads::spawn("readiness", {
            let readiness = readiness.clone();
            let liveness = crate::liveness::Liveness::detached(clock.clone());
            move || {
                let beat = liveness.register("readiness", crate::liveness::BEAT_PERIOD);
                run_prober(readiness, probes, clock, period, stop_rx, &beat)
            }
        })
        .expect("spawn the prober");
        (stop_tx, calls, handle, readiness)
    }

    const DEADLINE: Duration = Duration::from_secs(10);

    #[test]
    fn prober_probes_both_every_poll_and_stops_on_a_message() {
        let (stop, calls, handle, readiness) = spawn_prober(Duration::from_millis(1));
        let mut seen = Vec::new();
        while seen.len() < 6 {
            seen.push(
                calls
                    .recv_timeout(DEADLINE)
                    .expect("the prober keeps polling"),
            );
        }
        assert_eq!(seen, ["jwks", "sql", "jwks", "sql", "jwks", "sql"]);
        stop.send(()).expect("prober is listening");
        handle.join().expect("prober exits cleanly");
        assert_eq!(
            readiness.answer(T0).body,
            r#"{"error":"dependency_unavailable","failures":{"jwks":"jwks_timed_out"}}"#
        );
    }

    #[test]
    fn prober_polls_at_once_and_stops_when_the_sender_is_dropped() {
        // A period far longer than the test: the first poll must not wait for it, and dropping
        // the stop sender must end the wait.
        let (stop, calls, handle, _) = spawn_prober(Duration::from_secs(3_600));
        assert_eq!(calls.recv_timeout(DEADLINE), Ok("jwks"));
        assert_eq!(calls.recv_timeout(DEADLINE), Ok("sql"));
        drop(stop);
        handle.join().expect("prober exits cleanly");
    }
}
