//! `packaging/monitoring/`: the alert rules pass `promtool check rules` and their unit tests
//! (`promtool test rules`), the dashboard's queries are valid PromQL, and every `orca_relay_*`
//! metric named in either exists on a live relay's `/metrics`. promtool comes from Debian's
//! `prometheus` package (scripts/test installs it); these tests fail, never skip, without it.

mod harness;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use harness::*;

fn monitoring_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("packaging/monitoring")
}

const RULES: &str = "orca-relay.rules.yml";
const RULE_TESTS: &str = "orca-relay.rules.test.yml";
const DASHBOARD: &str = "orca-relay-dashboard.json";

/// Runs promtool; panics with its output unless it succeeds.
fn promtool(args: &[&str], cwd: &Path) -> String {
    let out = Command::new("promtool")
        .args(args)
        .current_dir(cwd)
        .output()
        .unwrap_or_else(|e| {
            panic!(
                "cannot run promtool ({e}): install Debian's prometheus package \
                 (scripts/test does: apt-get install prometheus)"
            )
        });
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "promtool {args:?} failed:\n{text}");
    text
}

#[test]
fn promtool_checks_and_unit_tests_the_alert_rules() {
    let dir = monitoring_dir();
    let checked = promtool(&["check", "rules", RULES], &dir);
    assert!(checked.contains("SUCCESS: 8 rules found"), "{checked}");
    let tested = promtool(&["test", "rules", RULE_TESTS], &dir);
    assert!(tested.contains("SUCCESS"), "{tested}");
}

/// The dashboard's queries, with the `$instance` variable as Grafana would expand "All".
fn dashboard_queries() -> Vec<String> {
    let text = std::fs::read_to_string(monitoring_dir().join(DASHBOARD)).unwrap();
    let dashboard: serde_json::Value = serde_json::from_str(&text).expect("dashboard JSON");
    let mut queries = Vec::new();
    for panel in dashboard["panels"].as_array().expect("panels") {
        for target in panel["targets"].as_array().into_iter().flatten() {
            let expr = target["expr"].as_str().expect("expr");
            queries.push(expr.replace("$instance", ".*"));
        }
    }
    assert!(queries.len() > 20, "{queries:?}");
    queries
}

#[test]
fn the_dashboard_queries_are_valid_promql() {
    // promtool parses every query when it checks them as recording rules.
    let mut rules = String::from("groups:\n  - name: dashboard\n    rules:\n");
    for (n, query) in dashboard_queries().iter().enumerate() {
        rules.push_str(&format!(
            "      - record: dashboard_query_{n}\n        expr: {}\n",
            serde_json::to_string(query).unwrap()
        ));
    }
    let dir = TempDir::new("dashboard-promql");
    std::fs::write(dir.0.join("dashboard.rules.yml"), rules).unwrap();
    promtool(&["check", "rules", "dashboard.rules.yml"], &dir.0);
}

/// Every `orca_relay_…` name in `text`.
fn metric_names(text: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    let mut rest = text;
    while let Some(at) = rest.find("orca_relay_") {
        let name: String = rest[at..]
            .chars()
            .take_while(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == '_')
            .collect();
        rest = &rest[at + name.len()..];
        names.insert(name);
    }
    names
}

#[test]
fn every_metric_in_the_rules_and_the_dashboard_exists_on_a_live_relay() {
    let relay = Relay::combined(&[]);
    // One desktop and one spliced phone, so families created on first use exist too.
    let mut desktop = Desktop::connect(&relay);
    let (_phone, _leg) = splice(&relay, &mut desktop);
    let rules = std::fs::read_to_string(monitoring_dir().join(RULES)).unwrap();
    let dashboard = dashboard_queries().join("\n");
    let named: BTreeSet<String> = metric_names(&rules)
        .into_iter()
        .chain(metric_names(&dashboard))
        .collect();
    assert!(named.len() >= 20, "{named:?}");
    // Some families appear with their first event (the director's first feed poll of the
    // cell comes after its first listing of the cells): wait for them, within a deadline.
    let mut body = String::new();
    let mut missing: Vec<String> = Vec::new();
    wait_until(Duration::from_secs(15), || {
        let (status, text) = relay.get("/metrics");
        assert_eq!(status, 200);
        let exposed: BTreeSet<String> = text
            .lines()
            .filter_map(|line| line.strip_prefix("# TYPE "))
            .filter_map(|line| line.split_whitespace().next())
            .map(str::to_string)
            .collect();
        missing = named.difference(&exposed).cloned().collect();
        body = text;
        missing.is_empty()
    });
    assert!(
        missing.is_empty(),
        "named in packaging/monitoring but not on /metrics: {missing:?}\n/metrics:\n{body}"
    );
}

#[test]
fn the_combined_role_publishes_the_handshake_series_at_zero() {
    // The combined role has no remote director to register with: the series exist (dashboards
    // and alerts need no special case) and say so with zeros.
    let relay = Relay::combined(&[]);
    assert_eq!(relay.metric("orca_relay_handshake_attempts"), Some(0.0));
    assert_eq!(relay.metric("orca_relay_handshake_runs_total"), Some(0.0));
    assert_eq!(relay.metric("orca_relay_ready"), Some(1.0));
    assert_eq!(relay.metric("orca_relay_switch_generation"), Some(0.0));
    assert_eq!(relay.metric("orca_relay_dead_man_trip_slots"), Some(-1.0));
    let started = relay
        .metric("orca_relay_process_start_time_seconds")
        .expect("start time");
    let now = orca_relay::clock::system().now_ms() as f64 / 1000.0;
    assert!(
        started <= now && now - started < 120.0,
        "{started} vs {now}"
    );
}

/// The series of a Prometheus text exposition that appear more than once (a family's `# HELP`
/// or `# TYPE` line, or a sample's name with its labels): Prometheus keeps one of two samples of
/// a series, so a repeated one is a lost value.
fn repeated_series(text: &str) -> Vec<String> {
    let mut seen = BTreeSet::new();
    let mut repeated = Vec::new();
    for line in text.lines().filter(|line| !line.trim().is_empty()) {
        let key = match line.strip_prefix("# ") {
            Some(comment) => comment.splitn(3, ' ').take(2).collect::<Vec<_>>().join(" "),
            None => line
                .rsplit_once(' ')
                .map_or(line, |(series, _)| series)
                .to_string(),
        };
        if !seen.insert(key.clone()) {
            repeated.push(key);
        }
    }
    repeated
}

/// Every role's `/metrics` exports each series once (issue 20: a cell's and the combined role's
/// `orca_relay_connection_cap` was registered twice).
#[test]
fn every_role_exports_each_series_once() {
    assert_eq!(
        repeated_series("# HELP a x\n# TYPE a gauge\na 1\na{k=\"v\"} 2\na 3\n"),
        vec!["a"],
        "the check itself finds a repeat"
    );
    let combined = Relay::combined(&[]);
    let mut desktop = Desktop::connect(&combined);
    let (_phone, _leg) = splice(&combined, &mut desktop);

    let jwks = jwks_server();
    let director_stub = accepting_director();
    let cell = Relay::start_in(
        std::sync::Arc::new(TempDir::new("series-cell")),
        &env_refs(&cell_env("series-cell", &jwks, &[&director_stub])),
    );
    let jwks_url = format!("{}/jwks.json", jwks.url());
    let director = Relay::start_in(
        std::sync::Arc::new(TempDir::new("series-director")),
        &[
            ("ORCA_RELAY_ROLE", "director"),
            ("ORCA_RELAY_SERVICE_TOKEN", SERVICE_TOKEN),
            ("ORCA_RELAY_JWKS_URL", &jwks_url),
            ("ORCA_RELAY_AUTH_ISSUER", TEST_ISSUER),
        ],
    );
    for (role, relay) in [
        ("combined", &combined),
        ("cell", &cell),
        ("director", &director),
    ] {
        let (status, body) = relay.get("/metrics");
        assert_eq!(status, 200, "{role}: {body}");
        assert!(body.contains("# TYPE orca_relay_ready gauge"), "{role}");
        let repeated = repeated_series(&body);
        assert!(
            repeated.is_empty(),
            "{role} exports these more than once: {repeated:?}\n{body}"
        );
    }
}
