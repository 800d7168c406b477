//! The example env files (SPEC §4, §9) against the config code they document: every variable is
//! listed, the documented defaults and ranges are the ones `Config::from_lookup` applies, the
//! files load into a valid configuration once the secrets are filled in, and the secrets ship
//! empty so that a forgotten one stops the process instead of running with a known value.

use std::collections::HashMap;
use std::path::Path;

use orca_relay::config::{Config, Role, Timings, VARIABLES};

const CELL_ENV: &str = "packaging/cell.env";
const DIRECTOR_ENV: &str = "packaging/director.env";

/// The variables a director reads; the rest of `VARIABLES` only matter to a cell.
const DIRECTOR_VARIABLES: &[&str] = &[
    "ORCA_RELAY_ROLE",
    "ORCA_RELAY_REGION",
    "ORCA_RELAY_HTTP_ADDR",
    "ORCA_RELAY_HTTP_IDLE_MS",
    "ORCA_RELAY_HTTP_CONNECTIONS_MAX",
    "DATABASE_URL",
    "ORCA_RELAY_DATABASE_CA_FILE",
    "ORCA_RELAY_DATA_DIR",
    "ORCA_RELAY_DATABASE_POOL_MAX",
    "ORCA_RELAY_JWKS_URL",
    "ORCA_RELAY_JWKS_ALLOW_HTTP",
    "ORCA_RELAY_AUTH_ISSUER",
    "ORCA_RELAY_AUTH_AUDIENCE",
    "ORCA_RELAY_SERVICE_TOKEN",
    "ORCA_RELAY_READINESS_JWKS_GRACE_MS",
    "ORCA_RELAY_READINESS_SQL_GRACE_MS",
    "ORCA_RELAY_DRAIN_GRACE_MS",
    "ORCA_RELAY_CELL_RETIRE_MS",
    "ORCA_RELAY_CELL_FORGET_MS",
    "ORCA_RELAY_FEED_POLL_MS",
    "ORCA_RELAY_HEARTBEAT_FRESH_MS",
    "ORCA_RELAY_DEAD_MAN_BASE_MS",
    "ORCA_RELAY_READINESS_PROBE_MS",
    "ORCA_RELAY_TRIP_SLOT_STALE_MS",
];

/// Read by `env_logger`, not by `Config`.
const LOG_VARIABLE: &str = "RUST_LOG";

/// What the operator must add before the service starts (not secrets to the test).
const FILLED_IN: &[(&str, &str)] = &[
    (
        "ORCA_RELAY_SERVICE_TOKEN",
        "0123456789abcdef0123456789abcdef",
    ),
    (
        "ORCA_RELAY_JWKS_URL",
        "https://auth.example.com/.well-known/jwks.json",
    ),
    ("ORCA_RELAY_AUTH_ISSUER", "https://auth.example.com"),
];

/// One assignment in an env file, with the comment block right above it.
struct Entry {
    name: String,
    value: String,
    comment: String,
}

fn load(relative: &str) -> Vec<Entry> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join(relative);
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    let mut entries = Vec::new();
    let mut comment = String::new();
    for line in text.lines() {
        let line = line.trim();
        if line.is_empty() {
            comment.clear();
        } else if let Some(text) = line.strip_prefix('#') {
            comment.push_str(text.trim());
            comment.push('\n');
        } else {
            let (name, value) = line
                .split_once('=')
                .unwrap_or_else(|| panic!("{relative}: not NAME=value: {line}"));
            entries.push(Entry {
                name: name.trim().to_string(),
                value: value.trim().to_string(),
                comment: std::mem::take(&mut comment),
            });
        }
    }
    entries
}

/// The lookup systemd would give the process: every assignment, `''` included, plus `extra`.
fn lookup_of(entries: &[Entry], extra: &[(&str, &str)]) -> HashMap<String, String> {
    let mut map: HashMap<String, String> = entries
        .iter()
        .map(|e| (e.name.clone(), e.value.clone()))
        .collect();
    for (name, value) in extra {
        map.insert(name.to_string(), value.to_string());
    }
    map
}

fn parse(map: &HashMap<String, String>) -> Result<Config, orca_relay::config::ConfigError> {
    Config::from_lookup(&|name| map.get(name).cloned())
}

fn check_names(relative: &str, entries: &[Entry], required: &[&str]) {
    for name in required {
        let count = entries.iter().filter(|e| e.name == *name).count();
        assert_eq!(count, 1, "{relative}: {name} should appear exactly once");
    }
    for entry in entries {
        assert!(
            VARIABLES.contains(&entry.name.as_str()) || entry.name == LOG_VARIABLE,
            "{relative}: {} is not a variable the relay reads",
            entry.name
        );
        assert!(
            entry.comment.contains(&entry.name) && entry.comment.contains("default: "),
            "{relative}: {} needs a comment naming it and its default",
            entry.name
        );
    }
}

#[test]
fn cell_env_lists_every_variable() {
    let entries = load(CELL_ENV);
    let mut all: Vec<&str> = VARIABLES.to_vec();
    all.push(LOG_VARIABLE);
    check_names(CELL_ENV, &entries, &all);
}

#[test]
fn director_env_lists_every_director_variable() {
    let entries = load(DIRECTOR_ENV);
    let mut all: Vec<&str> = DIRECTOR_VARIABLES.to_vec();
    all.push(LOG_VARIABLE);
    check_names(DIRECTOR_ENV, &entries, &all);
}

/// Each empty line's documented default is the value the config applies when it is unset.
fn check_documented_defaults(relative: &str, role: &str) {
    let entries = load(relative);
    let mut minimal = vec![("ORCA_RELAY_ROLE", role)];
    minimal.extend_from_slice(FILLED_IN);
    let map: HashMap<String, String> = minimal
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    let defaults = parse(&map).expect("minimal config").describe();
    let mut checked = 0;
    for entry in entries.iter().filter(|e| e.value.is_empty()) {
        let Some(default) = defaults.get(entry.name.as_str()) else {
            continue;
        };
        // Numeric defaults only; a default documented as another variable (`= NAME`) is
        // checked by the range test and by config's own tests.
        if default.parse::<u64>().is_err() || entry.comment.contains("default: = ") {
            continue;
        }
        assert!(
            entry.comment.contains(&format!("default: {default}")),
            "{relative}: {} documents a default other than {default}:\n{}",
            entry.name,
            entry.comment
        );
        checked += 1;
    }
    assert!(
        checked >= 5,
        "{relative}: only {checked} numeric defaults checked"
    );
}

#[test]
fn documented_defaults_are_the_config_defaults() {
    check_documented_defaults(CELL_ENV, "cell");
    check_documented_defaults(DIRECTOR_ENV, "director");
}

/// Each documented `range: MIN-MAX` is what the config accepts: both ends pass, one past them
/// fails naming the variable.
fn check_documented_ranges(relative: &str) {
    let entries = load(relative);
    let base = lookup_of(&entries, FILLED_IN);
    let mut checked = 0;
    for entry in &entries {
        let Some(range) = entry
            .comment
            .split("range: ")
            .nth(1)
            .and_then(|r| r.split_whitespace().next())
        else {
            continue;
        };
        let Some((min, max)) = range.split_once('-') else {
            continue;
        };
        let (Ok(min), Ok(max)) = (min.parse::<u64>(), max.parse::<u64>()) else {
            continue;
        };
        let with = |value: u64| {
            let mut map = base.clone();
            map.insert(entry.name.clone(), value.to_string());
            // A pool ceiling must not exceed the pool; test the pool on its own.
            map.remove("ORCA_RELAY_DATABASE_POOL_RESERVE_MAX");
            parse(&map)
        };
        for inside in [min, max] {
            if let Err(e) = with(inside) {
                panic!(
                    "{relative}: {}={inside} is documented as valid: {e}",
                    entry.name
                );
            }
        }
        let mut outside = vec![max + 1];
        if min > 0 {
            outside.push(min - 1);
        }
        for value in outside {
            match with(value) {
                Ok(_) => panic!(
                    "{relative}: {}={value} is outside the documented range {range} but accepted",
                    entry.name
                ),
                Err(e) => assert_eq!(e.variable, entry.name),
            }
        }
        checked += 1;
    }
    assert!(checked >= 5, "{relative}: only {checked} ranges checked");
}

#[test]
fn documented_ranges_are_the_config_ranges() {
    check_documented_ranges(CELL_ENV);
    check_documented_ranges(DIRECTOR_ENV);
}

#[test]
fn cell_env_loads_once_the_secrets_are_filled_in() {
    let entries = load(CELL_ENV);
    let config = parse(&lookup_of(&entries, FILLED_IN)).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(config.role, Role::Cell);
    assert_eq!(config.data_dir, Path::new("/var/lib/orca-relay"));
    assert_eq!(config.director_urls.len(), 2);
    assert!(
        config.database_url.is_some(),
        "a fleet cell uses PostgreSQL"
    );
    // The example leaves every timing at its production value.
    assert_eq!(config.timings, Timings::default());
}

#[test]
fn director_env_loads_once_the_secrets_are_filled_in() {
    let entries = load(DIRECTOR_ENV);
    let config = parse(&lookup_of(&entries, FILLED_IN)).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(config.role, Role::Director);
    assert_eq!(config.pool_max, 3);
    assert_eq!(config.data_dir, Path::new("/var/lib/orca-relay"));
    assert_eq!(config.timings, Timings::default());
}

#[test]
fn shipped_secrets_are_empty_so_a_forgotten_one_stops_the_process() {
    for relative in [CELL_ENV, DIRECTOR_ENV] {
        let entries = load(relative);
        let token = entries
            .iter()
            .find(|e| e.name == "ORCA_RELAY_SERVICE_TOKEN")
            .unwrap();
        assert_eq!(token.value, "", "{relative}: ship no service token");
        let err = parse(&lookup_of(&entries, &[])).unwrap_err();
        assert_eq!(err.variable, "ORCA_RELAY_SERVICE_TOKEN", "{relative}");
        // The database password is an obvious placeholder, not a plausible secret.
        let url = entries.iter().find(|e| e.name == "DATABASE_URL").unwrap();
        assert!(url.value.contains("REPLACE_WITH_PASSWORD"), "{relative}");
        if let Some(key) = entries
            .iter()
            .find(|e| e.name == "ORCA_RELAY_SELF_HOSTED_KEY")
        {
            assert_eq!(
                key.value, "",
                "{relative}: no self-hosted key outside combined"
            );
        }
    }
}
