//! Operations from the outside (SPEC §3, §5.6, §9): the SIGTERM drain against a real desktop,
//! the systemd notifications on a real `NOTIFY_SOCKET`, `/metrics` parsed as Prometheus text on
//! the cell and the director, and the command line (`check-config`, `--help`, `budget`).

mod harness;

use std::collections::{BTreeMap, BTreeSet};
use std::process::{Command, Output};
use std::sync::Arc;
use std::time::Duration;

use harness::*;
use serde_json::json;
use tungstenite::Message;

const WAIT: Duration = Duration::from_secs(20);

fn wait_ready(relay: &Relay, status: u16, body: &str) {
    let mut last = (0, String::new());
    let reached = wait_until(WAIT, || {
        last = relay.get("/ready");
        last.0 == status && last.1 == body
    });
    assert!(
        reached,
        "/ready never answered {status} {body}; last {last:?}; log:\n{}",
        relay.log_text()
    );
}

// ---------------------------------------------------------------------------------------------
// Drain (SPEC §9)

#[test]
fn sigterm_drains_desktops_then_closes_them_4503_and_exits_0() {
    let notify = NotifySocket::new();
    let socket = notify.env_value();
    let mut relay = Relay::combined(&[
        ("ORCA_RELAY_DRAIN_GRACE_MS", "1500"),
        ("NOTIFY_SOCKET", &socket),
        ("WATCHDOG_USEC", "400000"),
    ]);
    assert!(notify.wait_for("READY=1", 1, WAIT), "{:?}", notify.drain());
    // WATCHDOG_USEC=400000: a ping every 200 ms, each after the process's own /health check.
    assert!(
        notify.wait_for("WATCHDOG=1", 3, WAIT),
        "{:?}",
        notify.drain()
    );
    wait_ready(&relay, 200, r#"{"ok":true}"#);
    let mut desktop = Desktop::connect(&relay);
    let (mut phone, mut leg) = splice(&relay, &mut desktop);
    phone.send(Message::binary(vec![7u8; 10])).unwrap();
    assert_eq!(leg.read().unwrap(), Message::binary(vec![7u8; 10]));

    relay.signal("TERM");
    let signalled = orca_relay::clock::instant();
    wait_ready(&relay, 503, r#"{"error":"draining"}"#);
    assert!(
        signalled.elapsed() < Duration::from_millis(1000),
        "/ready must turn draining at once, took {:?}",
        signalled.elapsed()
    );
    assert_ne!(
        try_upgrade(&relay.ws_url("/v1/host/control"), Some(&desktop.token)),
        Upgrade::Opened,
        "a draining cell accepts no new connection"
    );
    assert_eq!(relay.get("/health").0, 200);

    let drain = read_json(&mut desktop.control);
    assert_eq!(
        drain,
        json!({"type":"drain","graceMs":1500,"recovery":"resolve-director"})
    );
    assert_eq!(read_close(&mut desktop.control), Some(4503));
    let closed_after = signalled.elapsed();
    assert!(
        closed_after >= Duration::from_millis(1400),
        "closed {closed_after:?} after SIGTERM, before the 1500 ms grace"
    );
    assert_eq!(relay.wait_exit(WAIT), Some(0), "{}", relay.log_text());
    assert!(
        notify.wait_for("STOPPING=1", 1, WAIT),
        "{:?}",
        notify.drain()
    );
    assert_eq!(notify.count("READY=1"), 1);
    assert_eq!(relay.count_log("orca_relay_drain_finished"), 1);
    assert_eq!(relay.count_log("orca_relay_shutdown_immediate"), 0);
}

#[test]
fn a_drain_ends_early_once_the_last_desktop_has_left() {
    let mut relay = Relay::combined(&[("ORCA_RELAY_DRAIN_GRACE_MS", "20000")]);
    let mut desktop = Desktop::connect(&relay);
    relay.signal("TERM");
    let signalled = orca_relay::clock::instant();
    let drain = read_json(&mut desktop.control);
    assert_eq!(drain["type"], "drain", "{drain}");
    assert_eq!(drain["graceMs"], 20000);
    // The desktop goes to its director for a new placement and leaves this cell.
    desktop.control.close(None).unwrap();
    while desktop.control.read().is_ok() {}
    assert_eq!(relay.wait_exit(WAIT), Some(0), "{}", relay.log_text());
    assert!(
        signalled.elapsed() < Duration::from_secs(10),
        "the process waited {:?} although no desktop was left",
        signalled.elapsed()
    );
    let finished = relay
        .wait_for_log("orca_relay_drain_finished", WAIT)
        .unwrap();
    assert_eq!(
        field(&finished, "closed").as_deref(),
        Some("0"),
        "{finished}"
    );
}

#[test]
fn a_second_sigterm_exits_at_once_with_status_0() {
    let mut relay = Relay::combined(&[("ORCA_RELAY_DRAIN_GRACE_MS", "30000")]);
    let mut desktop = Desktop::connect(&relay);
    relay.signal("TERM");
    assert_eq!(read_json(&mut desktop.control)["type"], "drain");
    relay
        .wait_for_log("orca_relay_drain_started", WAIT)
        .expect("drain started");
    let second = orca_relay::clock::instant();
    relay.signal("TERM");
    assert_eq!(relay.wait_exit(WAIT), Some(0), "{}", relay.log_text());
    assert!(
        second.elapsed() < Duration::from_secs(5),
        "the second SIGTERM took {:?}",
        second.elapsed()
    );
    assert_eq!(relay.count_log("orca_relay_shutdown_immediate"), 1);
    assert_eq!(relay.count_log("orca_relay_drain_finished"), 0);
}

/// CPU time (user + system) the process has used so far, from `/proc/<pid>/stat`.
fn cpu_time(pid: u32) -> Duration {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).expect("stat");
    // Fields after the command name (in parentheses, may hold spaces): state is field 3, utime
    // and stime are fields 14 and 15.
    let after_name: Vec<&str> = stat
        .rsplit_once(')')
        .unwrap()
        .1
        .split_whitespace()
        .collect();
    let ticks: u64 =
        after_name[11].parse::<u64>().unwrap() + after_name[12].parse::<u64>().unwrap();
    // SAFETY: sysconf has no preconditions.
    let per_second = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as u64;
    Duration::from_millis(ticks * 1000 / per_second)
}

#[test]
fn a_drain_with_a_desktop_still_connected_sleeps_instead_of_spinning() {
    // systemd measured `Consumed 30.089s CPU time` for a 30 s drain: the wait spun a core.
    let mut relay = Relay::combined(&[("ORCA_RELAY_DRAIN_GRACE_MS", "4000")]);
    let mut desktop = Desktop::connect(&relay);
    relay.signal("TERM");
    assert_eq!(read_json(&mut desktop.control)["type"], "drain");
    let (cpu_before, wall_before) = (cpu_time(relay.pid()), orca_relay::clock::instant());
    // The desktop stays: the drain waits out its grace, then closes it 4503.
    set_read_timeout(&desktop.control, Some(Duration::from_secs(30)));
    let code = read_close(&mut desktop.control);
    if code != Some(4503) {
        relay.wait_exit(WAIT);
        panic!(
            "closed {code:?}, not 4503; the relay's log:\n{}",
            relay.log_text()
        );
    }
    let (cpu, wall) = (cpu_time(relay.pid()) - cpu_before, wall_before.elapsed());
    assert_eq!(relay.wait_exit(WAIT), Some(0), "{}", relay.log_text());
    eprintln!("the drain used {cpu:?} of CPU in {wall:?}");
    // A sleeping wait costs a few milliseconds; a spinning one a core, and still a good
    // share of one on a machine loaded beyond its cores (13 % of 4 s, measured under a
    // release build on both cores): over a twentieth of the wall time either way.
    assert!(
        cpu < wall / 20,
        "the drain used {cpu:?} of CPU in {wall:?} of waiting"
    );
}

#[test]
fn sighup_is_logged_and_ignored_and_the_desktop_stays_connected() {
    // SIGHUP used to kill the process at once (no handler): every desktop dropped, no drain,
    // and systemd's Restart=on-failure does not restart a death by SIGHUP.
    let mut relay = Relay::combined(&[("ORCA_RELAY_PING_MS", "200")]);
    let mut desktop = Desktop::connect(&relay);
    relay.signal("HUP");
    let line = relay
        .wait_for_log("orca_relay_signal_ignored", WAIT)
        .unwrap_or_else(|| panic!("no line for SIGHUP; log:\n{}", relay.log_text()));
    assert!(line.contains("signal=SIGHUP"), "{line}");
    // Still serving the same desktop: pings keep coming and an invite is answered.
    expect_ping(&mut desktop.control);
    desktop.invite();
    assert_eq!(relay.get("/ready").0, 200);
    assert_eq!(relay.wait_exit(Duration::from_millis(10)), None);
    // A second SIGHUP is not a second signal of a shutdown either.
    relay.signal("HUP");
    assert!(wait_until(WAIT, || relay
        .count_log("orca_relay_signal_ignored")
        == 2));
    expect_ping(&mut desktop.control);
    relay.signal("TERM");
    assert_eq!(read_json(&mut desktop.control)["type"], "drain");
    assert_eq!(relay.count_log("orca_relay_shutdown_immediate"), 0);
}

#[test]
fn a_draining_combined_process_places_no_desktop_on_itself() {
    // The in-process director learns of the drain at once, not from its next feed poll (here
    // an hour away) or the cell's next heartbeat.
    let relay = Relay::combined(&[
        ("ORCA_RELAY_DRAIN_GRACE_MS", "20000"),
        ("ORCA_RELAY_FEED_POLL_MS", "3600000"),
    ]);
    let mut desktop = Desktop::connect(&relay);
    relay.signal("TERM");
    let drain = read_json(&mut desktop.control);
    assert_eq!(drain["recovery"], "resolve-director", "{drain}");
    // The desktop does as the drain frame says: back to the director.
    let (status, body) = relay.post(
        "/v1/assign",
        Some(&desktop.token),
        &json!({"v":1,"relayHostId":desktop.relay_host_id,"reconnect":true}).to_string(),
    );
    assert_eq!(
        (status, body.as_str()),
        (503, r#"{"error":"relay_capacity_exhausted"}"#),
        "a draining process placed a desktop on itself"
    );
}

// ---------------------------------------------------------------------------------------------
// /metrics (SPEC §5.6)

/// One sample line.
#[derive(Debug, Clone)]
struct Sample {
    labels: BTreeMap<String, String>,
    value: f64,
}

/// One metric family of a Prometheus text exposition.
#[derive(Debug, Default)]
struct Family {
    help: Option<String>,
    kind: Option<String>,
    samples: Vec<Sample>,
}

impl Family {
    /// Every value the samples carry for `label`.
    fn label_values(&self, label: &str) -> BTreeSet<String> {
        self.samples
            .iter()
            .filter_map(|s| s.labels.get(label).cloned())
            .collect()
    }

    fn value(&self, labels: &[(&str, &str)]) -> Option<f64> {
        self.samples
            .iter()
            .find(|s| {
                s.labels.len() == labels.len()
                    && labels
                        .iter()
                        .all(|(k, v)| s.labels.get(*k).map(String::as_str) == Some(*v))
            })
            .map(|s| s.value)
    }
}

/// Parses the Prometheus text format (version 0.0.4) strictly enough to catch a malformed
/// exposition: `# HELP` and `# TYPE` come before their samples, each family is declared once,
/// every sample belongs to a declared family, label values are quoted and escaped, values
/// are numbers.
fn parse_prometheus(text: &str) -> BTreeMap<String, Family> {
    let mut families: BTreeMap<String, Family> = BTreeMap::new();
    for (number, line) in text.lines().enumerate() {
        let at = || format!("line {}: {line:?}", number + 1);
        if line.trim().is_empty() {
            continue;
        }
        if let Some(rest) = line.strip_prefix("# HELP ") {
            let (name, help) = rest.split_once(' ').unwrap_or((rest, ""));
            let family = families.entry(name.to_string()).or_default();
            assert!(family.help.is_none(), "HELP declared twice, {}", at());
            assert!(family.samples.is_empty(), "HELP after samples, {}", at());
            family.help = Some(help.to_string());
            continue;
        }
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').unwrap_or_else(|| panic!("{}", at()));
            assert!(
                ["counter", "gauge", "histogram", "summary", "untyped"].contains(&kind),
                "unknown type, {}",
                at()
            );
            let family = families.entry(name.to_string()).or_default();
            assert!(family.kind.is_none(), "TYPE declared twice, {}", at());
            assert!(family.samples.is_empty(), "TYPE after samples, {}", at());
            family.kind = Some(kind.to_string());
            continue;
        }
        assert!(!line.starts_with('#'), "unknown comment, {}", at());
        let (name, labels, rest) = match line.find('{') {
            Some(open) => {
                let close = line.rfind('}').unwrap_or_else(|| panic!("{}", at()));
                (
                    &line[..open],
                    parse_labels(&line[open + 1..close])
                        .unwrap_or_else(|e| panic!("{e}, {}", at())),
                    &line[close + 1..],
                )
            }
            None => {
                let (name, rest) = line.split_once(' ').unwrap_or_else(|| panic!("{}", at()));
                (name, BTreeMap::new(), rest)
            }
        };
        assert!(
            name.chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':'),
            "bad metric name, {}",
            at()
        );
        let value: f64 = rest
            .trim()
            .split(' ')
            .next()
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("bad value, {}", at()));
        // A histogram's samples are `<family>_bucket`, `<family>_sum` and `<family>_count`.
        let histogram_family = ["_bucket", "_sum", "_count"].iter().find_map(|suffix| {
            let family = name.strip_suffix(suffix)?;
            families
                .get(family)
                .is_some_and(|f| f.kind.as_deref() == Some("histogram"))
                .then(|| family.to_string())
        });
        let family = families
            .get_mut(histogram_family.as_deref().unwrap_or(name))
            .unwrap_or_else(|| panic!("sample of an undeclared family, {}", at()));
        assert!(
            family.help.is_some() && family.kind.is_some(),
            "sample before HELP and TYPE, {}",
            at()
        );
        family.samples.push(Sample { labels, value });
    }
    families
}

fn parse_labels(text: &str) -> Result<BTreeMap<String, String>, String> {
    let mut labels = BTreeMap::new();
    let mut chars = text.chars().peekable();
    loop {
        let name: String = std::iter::from_fn(|| chars.next_if(|c| *c != '=')).collect();
        if name.is_empty() {
            return if chars.peek().is_none() && labels.is_empty() {
                Ok(labels)
            } else {
                Err("empty label name".into())
            };
        }
        if chars.next() != Some('=') || chars.next() != Some('"') {
            return Err(format!("label {name} is not name=\"value\""));
        }
        let mut value = String::new();
        loop {
            match chars.next() {
                Some('\\') => match chars.next() {
                    Some('n') => value.push('\n'),
                    Some(c @ ('\\' | '"')) => value.push(c),
                    other => return Err(format!("bad escape {other:?}")),
                },
                Some('"') => break,
                Some(c) => value.push(c),
                None => return Err(format!("unterminated value of {name}")),
            }
        }
        if labels.insert(name.clone(), value).is_some() {
            return Err(format!("label {name} repeated"));
        }
        match chars.next() {
            None => return Ok(labels),
            Some(',') if chars.peek().is_none() => return Ok(labels),
            Some(',') => {}
            Some(other) => return Err(format!("unexpected {other:?} after a label")),
        }
    }
}

fn scrape(relay: &Relay) -> BTreeMap<String, Family> {
    let (status, body) = relay.get("/metrics");
    assert_eq!(status, 200, "{body}");
    parse_prometheus(&body)
}

/// The family `name` of type `kind`, whose samples carry at least `values` for `label`.
fn require<'a>(
    families: &'a BTreeMap<String, Family>,
    name: &str,
    kind: &str,
    label: Option<(&str, &[&str])>,
) -> &'a Family {
    let family = families
        .get(name)
        .unwrap_or_else(|| panic!("no family {name}; have {:?}", families.keys()));
    assert_eq!(family.kind.as_deref(), Some(kind), "{name}");
    assert!(
        !family.help.as_deref().unwrap_or_default().is_empty(),
        "{name} has no help text"
    );
    assert!(!family.samples.is_empty(), "{name} has no samples");
    if kind == "counter" {
        assert!(
            name.ends_with("_total"),
            "counter {name} must end in _total"
        );
    }
    if let Some((label, values)) = label {
        let have = family.label_values(label);
        for value in values {
            assert!(
                have.contains(*value),
                "{name} lacks {label}=\"{value}\"; has {have:?}"
            );
        }
    }
    family
}

#[test]
fn the_cell_serves_every_metric_family_of_the_spec_from_the_start() {
    let jwks = jwks_server();
    let director = accepting_director();
    let env = cell_env("c-metrics", &jwks, &[&director]);
    let mut relay = Relay::start_in(Arc::new(TempDir::new("metrics")), &env_refs(&env));
    wait_ready(&relay, 200, r#"{"ok":true}"#);
    let families = scrape(&relay);

    let connections = require(
        &families,
        "orca_relay_connections",
        "gauge",
        Some(("kind", &["control", "phone", "data"])),
    );
    assert_eq!(connections.value(&[("kind", "control")]), Some(0.0));
    let admissions = require(
        &families,
        "orca_relay_admissions_total",
        "counter",
        Some(("path", &["booking", "memory", "database"])),
    );
    assert!(admissions.label_values("outcome").contains("admitted"));
    assert_eq!(
        admissions.value(&[("path", "booking"), ("outcome", "admitted")]),
        Some(0.0)
    );
    for name in [
        "orca_relay_splice_bytes_total",
        "orca_relay_splice_frames_total",
    ] {
        require(
            &families,
            name,
            "counter",
            Some(("direction", &["phone_to_host", "host_to_phone"])),
        );
    }
    require(
        &families,
        "orca_relay_closes_total",
        "counter",
        Some(("code", &["4401", "4409", "4503"])),
    );
    require(
        &families,
        "orca_relay_admit_mode",
        "gauge",
        Some(("kind", &["raw", "effective"])),
    );
    let dead_man = require(
        &families,
        "orca_relay_dead_man_state",
        "gauge",
        Some(("state", &["armed", "held", "tripped"])),
    );
    assert_eq!(
        dead_man.samples.iter().map(|s| s.value).sum::<f64>(),
        1.0,
        "one-hot: {dead_man:?}"
    );
    require(
        &families,
        "orca_relay_trip_slot_claims_total",
        "counter",
        Some(("result", &["permit", "refused", "lock_busy", "error"])),
    );
    require(
        &families,
        "orca_relay_readiness_up",
        "gauge",
        Some(("dependency", &["jwks", "sql"])),
    );
    require(
        &families,
        "orca_relay_readiness_in_grace",
        "gauge",
        Some(("dependency", &["jwks", "sql"])),
    );
    require(
        &families,
        "orca_relay_db_pool",
        "gauge",
        Some(("state", &["open", "idle", "waiters", "max"])),
    );
    let attempts = require(&families, "orca_relay_handshake_attempts", "gauge", None);
    assert_eq!(attempts.value(&[]), Some(1.0), "one director, one attempt");

    relay.signal("TERM");
    assert_eq!(relay.wait_exit(WAIT), Some(0), "{}", relay.log_text());
}

#[test]
fn the_director_serves_metrics_pings_the_watchdog_and_exits_0_on_sigterm() {
    let jwks = jwks_server();
    let notify = NotifySocket::new();
    let socket = notify.env_value();
    let jwks_url = format!("{}/jwks.json", jwks.url());
    let mut director = Relay::start_in(
        Arc::new(TempDir::new("director")),
        &[
            ("ORCA_RELAY_ROLE", "director"),
            ("ORCA_RELAY_SERVICE_TOKEN", SERVICE_TOKEN),
            ("ORCA_RELAY_JWKS_URL", &jwks_url),
            ("ORCA_RELAY_AUTH_ISSUER", TEST_ISSUER),
            ("ORCA_RELAY_READINESS_PROBE_MS", "100"),
            ("NOTIFY_SOCKET", &socket),
            ("WATCHDOG_USEC", "400000"),
        ],
    );
    wait_ready(&director, 200, r#"{"ok":true}"#);
    assert_eq!(director.get("/health").0, 200);
    let families = scrape(&director);
    require(
        &families,
        "orca_relay_readiness_up",
        "gauge",
        Some(("dependency", &["jwks", "sql"])),
    );
    require(
        &families,
        "orca_relay_db_pool",
        "gauge",
        Some(("state", &["open", "idle", "waiters", "max"])),
    );
    assert!(notify.wait_for("READY=1", 1, WAIT), "{:?}", notify.drain());
    assert!(
        notify.wait_for("WATCHDOG=1", 2, WAIT),
        "the director never pinged the systemd watchdog: {:?}",
        notify.drain()
    );

    director.signal("TERM");
    assert_eq!(director.wait_exit(WAIT), Some(0), "{}", director.log_text());
    assert!(
        notify.wait_for("STOPPING=1", 1, WAIT),
        "{:?}",
        notify.drain()
    );
    assert_eq!(
        director.count_log("orca_relay_shutdown_finished role=director"),
        1
    );
}

// ---------------------------------------------------------------------------------------------
// The command line (SPEC §3, §4)

fn run_binary(args: &[&str], env: &[(&str, &str)]) -> Output {
    let data = TempDir::new("cli");
    Command::new(env!("CARGO_BIN_EXE_orca-relay"))
        .args(args)
        .env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .env("ORCA_RELAY_DATA_DIR", &data.0)
        .envs(env.iter().copied())
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("run orca-relay")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

#[test]
fn check_config_names_the_one_bad_variable_on_one_line_and_exits_1() {
    let cases: &[(&str, &str)] = &[
        ("ORCA_RELAY_ROLE", "proxy"),
        ("ORCA_RELAY_CELL_ID", "bad id!"),
        ("ORCA_RELAY_WS_ADDR", "not-an-address"),
        ("ORCA_RELAY_CONNECTION_CAP", "0"),
        ("ORCA_RELAY_DATABASE_POOL_MAX", "101"),
        ("ORCA_RELAY_READINESS_JWKS_GRACE_MS", "-1"),
        ("ORCA_RELAY_READINESS_SQL_GRACE_MS", "3600001"),
        ("ORCA_RELAY_HANDSHAKE_TIMEOUT_MS", "twelve"),
        ("ORCA_RELAY_HANDSHAKE_ATTEMPTS", "0"),
        ("ORCA_RELAY_DRAIN_GRACE_MS", "1.5"),
        ("DATABASE_URL", "mysql://db/relay"),
        ("ORCA_RELAY_SELF_HOSTED_KEY", "too-short"),
    ];
    for (variable, value) in cases {
        let output = run_binary(&["check-config"], &[(variable, value)]);
        let stderr = text(&output.stderr);
        assert_eq!(
            output.status.code(),
            Some(1),
            "{variable}={value:?}: {stderr}"
        );
        let lines: Vec<&str> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
        // One line for the problem, then the summary line.
        assert_eq!(
            lines.len(),
            2,
            "{variable}={value:?}: one problem line and the summary, got {stderr:?}"
        );
        assert_eq!(lines[1], "1 problem", "{stderr}");
        assert!(
            lines[0].contains(variable),
            "{variable}={value:?}: the line must name the variable: {}",
            lines[0]
        );
        assert!(
            output.stdout.is_empty(),
            "{variable}: no configuration is printed for a bad one"
        );
    }
}

#[test]
fn check_config_prints_the_effective_configuration_with_secrets_masked() {
    let service_token = "service-token-that-must-not-print";
    let password = "db-password-that-must-not-print";
    let database_url = format!("postgres://relay:{password}@db.internal:5432/relay");
    let output = run_binary(
        &["check-config"],
        &[
            ("ORCA_RELAY_ROLE", "cell"),
            ("ORCA_RELAY_CELL_ID", "c-eu-1"),
            ("ORCA_RELAY_SERVICE_TOKEN", service_token),
            ("ORCA_RELAY_JWKS_URL", "https://auth.example/jwks.json"),
            ("ORCA_RELAY_AUTH_ISSUER", "https://auth.example"),
            ("ORCA_RELAY_DIRECTOR_URLS", "http://d1:8081,http://d2:8081"),
            ("DATABASE_URL", &database_url),
            // An empty value means unset: the default applies.
            ("ORCA_RELAY_HANDSHAKE_TIMEOUT_MS", ""),
            ("ORCA_RELAY_READINESS_SQL_GRACE_MS", ""),
        ],
    );
    let stdout = text(&output.stdout);
    assert_eq!(output.status.code(), Some(0), "{}", text(&output.stderr));
    let lines: BTreeMap<&str, &str> = stdout
        .lines()
        .filter_map(|line| line.split_once('='))
        .collect();
    assert_eq!(lines.get("ORCA_RELAY_ROLE"), Some(&"cell"));
    assert_eq!(lines.get("ORCA_RELAY_CELL_ID"), Some(&"c-eu-1"));
    assert_eq!(lines.get("ORCA_RELAY_SERVICE_TOKEN"), Some(&"***"));
    assert_eq!(
        lines.get("DATABASE_URL"),
        Some(&"postgres://relay:***@db.internal:5432/relay")
    );
    assert_eq!(lines.get("ORCA_RELAY_HANDSHAKE_TIMEOUT_MS"), Some(&"12000"));
    assert_eq!(lines.get("ORCA_RELAY_HANDSHAKE_ATTEMPTS"), Some(&"3"));
    assert_eq!(
        lines.get("ORCA_RELAY_READINESS_SQL_GRACE_MS"),
        Some(&"180000")
    );
    assert_eq!(
        lines.get("ORCA_RELAY_READINESS_JWKS_GRACE_MS"),
        Some(&"900000")
    );
    assert!(!stdout.contains(service_token), "{stdout}");
    assert!(!stdout.contains(password), "{stdout}");
}

#[test]
fn help_lists_the_subcommands_and_the_env_file() {
    let output = run_binary(&["--help"], &[]);
    assert_eq!(output.status.code(), Some(0));
    let help = text(&output.stdout);
    for needle in [
        "run",
        "migrate",
        "check-config",
        "budget FILE",
        "client host",
        "client phone",
        "--version",
        "/etc/orca-relay/",
        ".env",
        "ORCA_RELAY_ROLE",
    ] {
        assert!(help.contains(needle), "--help lacks {needle:?}:\n{help}");
    }
    let version = run_binary(&["--version"], &[]);
    assert_eq!(version.status.code(), Some(0));
    assert_eq!(
        text(&version.stdout).trim(),
        format!("orca-relay {}", env!("CARGO_PKG_VERSION"))
    );
    let unknown = run_binary(&["frobnicate"], &[]);
    assert_ne!(unknown.status.code(), Some(0));
    assert!(text(&unknown.stderr).contains("--help"));
}

#[test]
fn budget_prints_the_seed_rows() {
    let output = run_binary(&["budget", "packaging/fleet-seed.json"], &[]);
    let stdout = text(&output.stdout);
    assert_eq!(output.status.code(), Some(0), "{}", text(&output.stderr));
    let rows: &[(&str, &str, &[&str])] = &[
        (
            "main today",
            "6x10 + 16x8 + 7x16 = 300",
            &["455", "490", "35"],
        ),
        (
            "plus C36/C37 at 16",
            "6x10 + 16x8 + 9x16 = 332",
            &["487", "490", "3"],
        ),
        (
            "same fleet, deadManTripSlots=2",
            "76 + 128 + 8x12 + 2x4 = 308",
            &["463", "490", "27"],
        ),
        (
            "plus two more Asia cells at 12",
            "76 + 128 + 10x12 + 2x4 = 332",
            &["487", "490", "3"],
        ),
        (
            "two-cell Asia roll batch in an outage",
            "108 + 128 + 6x12 + 2x4 = 316",
            &["471", "490", "19"],
        ),
    ];
    for (scenario, cells, figures) in rows {
        let line = stdout
            .lines()
            .find(|l| l.starts_with(scenario))
            .unwrap_or_else(|| panic!("no row {scenario:?}:\n{stdout}"));
        assert!(line.contains(cells), "{line}");
        let tail: Vec<&str> = line.split_whitespace().rev().take(3).collect();
        let expected: Vec<&str> = figures.iter().rev().copied().collect();
        assert_eq!(tail, expected, "{line}");
    }
    assert!(stdout.contains("usable 490"), "{stdout}");
}

/// The names of the process's threads (`/proc/<pid>/task/*/comm`).
fn thread_names(pid: u32) -> Vec<String> {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .map(|tasks| {
            tasks
                .filter_map(|task| std::fs::read_to_string(task.ok()?.path().join("comm")).ok())
                .map(|name| name.trim().to_string())
                .collect()
        })
        .unwrap_or_default()
}

/// A process started by the socket units stops without closing a connection it accepted but
/// whose request head had not been read: systemd holds the listener and the next process goes
/// on accepting, so that client chose this process by chance and is answered. Before, a
/// `systemctl restart` under the socket units answered one `/ready` of 124 with nothing
/// (`tests/handover_systemd.rs`, under load): the old process's HTTP stop closed it.
#[test]
fn a_stop_serves_a_connection_accepted_on_a_listener_from_systemd() {
    use std::io::{Read, Write};
    use std::os::fd::AsRawFd;
    use std::os::unix::process::CommandExt;
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let fd = listener.as_raw_fd();
    // systemd's LISTEN_PID names the process it passes the descriptors to: the shell's pid,
    // which `exec` keeps.
    let dir = Arc::new(TempDir::new("socket-unit"));
    let script = dir.0.join("socket-activated.sh");
    std::fs::write(
        &script,
        format!(
            "#!/bin/sh\nLISTEN_PID=$$ exec {} \"$@\"\n",
            env!("CARGO_BIN_EXE_orca-relay")
        ),
    )
    .unwrap();
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    let mut relay = Relay::launch_binary_with(
        &script,
        dir,
        &[("LISTEN_FDS", "1"), ("LISTEN_FDNAMES", "http")],
        move |command| {
            // SAFETY: dup2 and fcntl are async-signal-safe; fd 3 is where systemd puts the
            // first socket, open across the exec (dup2 onto itself would keep close-on-exec).
            unsafe {
                command.pre_exec(move || {
                    if fd != 3 && libc::dup2(fd, 3) < 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    if libc::fcntl(3, libc::F_SETFD, 0) < 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    Ok(())
                });
            }
        },
    )
    .expect_listening("orca_relay_started");
    assert_eq!(
        relay.count_log("orca_relay_listeners_from_systemd ws=false http=true"),
        1
    );
    assert_eq!(relay.http, listener.local_addr().unwrap().to_string());

    // A connection the relay accepts (a descriptor more in it) whose head is half sent.
    let fds = || std::fs::read_dir(format!("/proc/{}/fd", relay.pid())).map_or(0, Iterator::count);
    let before = fds();
    let mut client = std::net::TcpStream::connect(&relay.http).unwrap();
    client.write_all(b"GET /health HTTP/1.1\r\n").unwrap();
    assert!(wait_until(WAIT, || fds() > before), "never accepted");
    relay.signal("TERM");
    // The HTTP server stops accepting (its acceptor thread ends), then deals with the
    // connections it holds: the rest of the head comes after that.
    assert!(
        wait_until(WAIT, || !thread_names(relay.pid())
            .iter()
            .any(|n| n == "http-acceptor")),
        "the HTTP acceptor never stopped"
    );
    client.write_all(b"Host: relay\r\n\r\n").unwrap();
    client.set_read_timeout(Some(WAIT)).unwrap();
    let mut answer = Vec::new();
    let _ = client.read_to_end(&mut answer);
    let answer = String::from_utf8_lossy(&answer);
    assert!(
        answer.starts_with("HTTP/1.1 200"),
        "answered {answer:?}; the relay's log:\n{}",
        relay.log_text()
    );
    assert_eq!(relay.wait_exit(WAIT), Some(0), "{}", relay.log_text());
}
