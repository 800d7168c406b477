//! The security settings as an operator meets them (SPEC §11 "Security"), through the real
//! binary: `check-config` and a start both refuse a plain-HTTP JWKS unless
//! `ORCA_RELAY_JWKS_ALLOW_HTTP=1`, refuse a bad `sslmode` in one line, show the effective
//! database TLS (and read its CA file as a start would), and mask every service token of a
//! rotation list.
//!
//! No database is touched: `check-config` does not connect, and the refused starts stop before
//! they would.

mod harness;

use std::collections::BTreeMap;
use std::process::{Command, Output};

use harness::TempDir;

fn run(args: &[&str], env: &[(&str, &str)]) -> Output {
    let data = TempDir::new("secure-config");
    Command::new(env!("CARGO_BIN_EXE_orca-relay"))
        .args(args)
        .env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .env("ORCA_RELAY_DATA_DIR", &data.0)
        .env("ORCA_RELAY_WS_ADDR", "127.0.0.1:0")
        .env("ORCA_RELAY_HTTP_ADDR", "127.0.0.1:0")
        .envs(env.iter().copied())
        .output()
        .expect("run orca-relay")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// Exit 1 (`run`: 78, EX_CONFIG) with exactly one non-empty stderr line containing every
/// needle (besides `check-config`'s `1 problem` summary); nothing on stdout.
fn refused_in_one_line(output: &Output, needles: &[&str], what: &str) -> String {
    let stderr = text(&output.stderr);
    let refused = if what == "run" { 78 } else { 1 };
    assert_eq!(output.status.code(), Some(refused), "{what}: {stderr}");
    let lines: Vec<&str> = stderr
        .lines()
        .filter(|l| !l.trim().is_empty() && l.trim() != "1 problem")
        .collect();
    assert_eq!(lines.len(), 1, "{what}: one line, got {stderr:?}");
    for needle in needles {
        assert!(
            lines[0].contains(needle),
            "{what}: {needle:?} in {}",
            lines[0]
        );
    }
    assert!(output.stdout.is_empty(), "{what}: nothing printed");
    lines[0].to_string()
}

fn printed(output: &Output) -> BTreeMap<String, String> {
    assert_eq!(output.status.code(), Some(0), "{}", text(&output.stderr));
    text(&output.stdout)
        .lines()
        .filter_map(|line| line.split_once('='))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

const DIRECTOR: &[(&str, &str)] = &[
    ("ORCA_RELAY_ROLE", "director"),
    ("ORCA_RELAY_SERVICE_TOKEN", "t"),
    ("ORCA_RELAY_AUTH_ISSUER", "https://auth.example"),
];

#[test]
fn a_plain_http_jwks_url_is_refused_by_check_config_and_at_start_unless_allowed() {
    let http_jwks = ("ORCA_RELAY_JWKS_URL", "http://auth.example/jwks.json");
    let mut env = DIRECTOR.to_vec();
    env.push(http_jwks);
    for command in ["check-config", "run"] {
        let output = run(&[command], &env);
        refused_in_one_line(
            &output,
            &[
                "ORCA_RELAY_JWKS_URL",
                "http://auth.example/jwks.json",
                "https://",
                "ORCA_RELAY_JWKS_ALLOW_HTTP=1",
            ],
            command,
        );
    }
    // The combined role with a JWKS is held to the same rule.
    let output = run(
        &["check-config"],
        &[
            http_jwks,
            ("ORCA_RELAY_AUTH_ISSUER", "https://auth.example"),
        ],
    );
    refused_in_one_line(&output, &["ORCA_RELAY_JWKS_URL"], "combined");

    env.push(("ORCA_RELAY_JWKS_ALLOW_HTTP", "1"));
    let lines = printed(&run(&["check-config"], &env));
    assert_eq!(
        lines["ORCA_RELAY_JWKS_URL"],
        "http://auth.example/jwks.json"
    );
    assert_eq!(lines["ORCA_RELAY_JWKS_ALLOW_HTTP"], "1");

    let mut https = DIRECTOR.to_vec();
    https.push(("ORCA_RELAY_JWKS_URL", "https://auth.example/jwks.json"));
    let lines = printed(&run(&["check-config"], &https));
    assert_eq!(lines["ORCA_RELAY_JWKS_ALLOW_HTTP"], "0");
}

#[test]
fn database_tls_settings_are_checked_and_the_effective_mode_is_shown() {
    let password = "db-password-that-must-not-print";
    let bad_mode = format!("postgres://relay:{password}@db.internal/relay?sslmode=verify");
    let output = run(&["check-config"], &[("DATABASE_URL", &bad_mode)]);
    let line = refused_in_one_line(
        &output,
        &[
            "DATABASE_URL",
            "sslmode=verify",
            "disable, prefer, require, verify-ca, verify-full",
        ],
        "a bad sslmode",
    );
    assert!(!line.contains(password), "{line}");

    // verify-full with no CA anywhere: refused at config time, naming both places a CA goes.
    let no_ca = "postgres://relay@db.internal/relay?sslmode=verify-full";
    refused_in_one_line(
        &run(&["check-config"], &[("DATABASE_URL", no_ca)]),
        &[
            "sslmode=verify-full",
            "sslrootcert",
            "ORCA_RELAY_DATABASE_CA_FILE",
        ],
        "verify-full without a CA",
    );

    // A real CA file: read and counted, as a start would.
    let dir = TempDir::new("secure-config-ca");
    let ca = dir.0.join("db-ca.pem");
    let key = rcgen::KeyPair::generate().unwrap();
    let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
    params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    std::fs::write(&ca, params.self_signed(&key).unwrap().pem()).unwrap();
    let url = format!(
        "postgres://relay:{password}@db.internal/relay?sslmode=verify-full&sslrootcert={}",
        ca.display()
    );
    let output = run(&["check-config"], &[("DATABASE_URL", &url)]);
    let stdout = text(&output.stdout);
    assert!(!stdout.contains(password), "{stdout}");
    let lines = printed(&output);
    assert_eq!(lines["ORCA_RELAY_DATABASE_CA_FILE"], "(unset)");
    let effective = stdout
        .lines()
        .find_map(|line| line.strip_prefix("effective database_tls: "))
        .unwrap_or_else(|| panic!("no effective database_tls line:\n{stdout}"));
    assert_eq!(
        effective,
        format!(
            "sslmode=verify-full verify=chain_and_host_name ca={} ca_source=sslrootcert ca_certificates=1",
            ca.display()
        )
    );

    // The same CA through the variable, with require: the chain is checked (libpq's rule).
    let output = run(
        &["check-config"],
        &[
            (
                "DATABASE_URL",
                "postgres://relay@db.internal/relay?sslmode=require",
            ),
            ("ORCA_RELAY_DATABASE_CA_FILE", &ca.display().to_string()),
        ],
    );
    let stdout = text(&output.stdout);
    assert!(
        stdout.contains(&format!(
            "effective database_tls: sslmode=require verify=chain ca={} ca_source=ORCA_RELAY_DATABASE_CA_FILE ca_certificates=1",
            ca.display()
        )),
        "{stdout}"
    );

    // A CA file that is not there: one line naming it, from check-config and from a start.
    let missing = dir.0.join("missing.pem");
    let url = format!(
        "postgres://relay@127.0.0.1:1/relay?sslmode=verify-ca&sslrootcert={}",
        missing.display()
    );
    for command in ["check-config", "migrate"] {
        refused_in_one_line(
            &run(&[command], &[("DATABASE_URL", &url)]),
            &[
                &missing.display().to_string(),
                "sslrootcert",
                "no such file",
            ],
            command,
        );
    }

    // SQLite: no TLS to speak of.
    let output = run(&["check-config"], &[]);
    assert!(
        text(&output.stdout).contains("effective database_tls: none (SQLite)"),
        "{}",
        text(&output.stdout)
    );
}

#[test]
fn a_rotation_list_of_service_tokens_is_accepted_and_masked() {
    let mut env = DIRECTOR.to_vec();
    env.push(("ORCA_RELAY_JWKS_URL", "https://auth.example/jwks.json"));
    env.push((
        "ORCA_RELAY_SERVICE_TOKEN",
        "new-secret-token,old-secret-token",
    ));
    let output = run(&["check-config"], &env);
    assert!(!text(&output.stdout).contains("secret"));
    let lines = printed(&output);
    assert_eq!(lines["ORCA_RELAY_SERVICE_TOKEN"], "***,***");

    let last = env.len() - 1;
    env[last] = ("ORCA_RELAY_SERVICE_TOKEN", "new-secret-token,");
    let line = refused_in_one_line(
        &run(&["check-config"], &env),
        &["ORCA_RELAY_SERVICE_TOKEN", "comma list"],
        "an empty item",
    );
    assert!(!line.contains("secret"), "{line}");
}
