//! The command line as an operator uses it: `check-config`, `migrate`, and the `client host` /
//! `client phone` walk-through of the README against a real combined relay.

mod harness;

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::time::Duration;

use harness::*;

fn orca_relay(env: &[(&str, &str)], args: &[&str]) -> std::process::Output {
    let mut command = Command::new(env!("CARGO_BIN_EXE_orca-relay"));
    command
        .env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default());
    for (name, value) in env {
        command.env(name, value);
    }
    command.args(args).output().expect("run orca-relay")
}

#[test]
fn migrate_is_idempotent_and_a_bad_database_url_names_the_variable() {
    let dir = TempDir::new("migrate");
    let data_dir = dir.0.display().to_string();
    let env = [("ORCA_RELAY_DATA_DIR", data_dir.as_str())];
    for _ in 0..2 {
        let out = orca_relay(&env, &["migrate"]);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    assert!(dir.0.join("relay.db").exists());

    let out = orca_relay(&[("DATABASE_URL", "mysql://nope")], &["migrate"]);
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(stderr.contains("DATABASE_URL"), "{stderr}");
}

#[test]
fn client_host_and_client_phone_relay_a_line_through_the_combined_role() {
    let relay = Relay::combined(&[]);
    let director = format!("http://{}", relay.http);
    let data_dir = relay.data_dir.0.display().to_string();
    let mut host = Command::new(env!("CARGO_BIN_EXE_orca-relay"))
        .env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .env("ORCA_RELAY_DATA_DIR", &data_dir)
        .env("ORCA_RELAY_SELF_HOSTED_KEY", TEST_KEY)
        .args(["client", "host", "--director", &director])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("start client host");
    // The host prints the phone's command line, with a fresh invite.
    let mut line = String::new();
    BufReader::new(host.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let words: Vec<&str> = line.split_whitespace().collect();
    assert_eq!(&words[..3], ["orca-relay", "client", "phone"], "{line}");
    let flag = |name: &str| {
        let at = words.iter().position(|w| *w == name).expect(name);
        words[at + 1].to_string()
    };
    assert_eq!(flag("--cell"), format!("ws://{}", relay.ws));

    let mut phone = Command::new(env!("CARGO_BIN_EXE_orca-relay"))
        .env_clear()
        .args([
            "client",
            "phone",
            "--cell",
            &flag("--cell"),
            "--relay-host-id",
            &flag("--relay-host-id"),
            "--invite",
            &flag("--invite"),
        ])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start client phone");
    phone
        .stdin
        .take()
        .unwrap()
        .write_all(b"hello through the relay\nsecond line\n")
        .unwrap();
    let out = phone.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(stdout, "hello through the relay\nsecond line\n");
    assert!(
        relay.metric("orca_relay_splice_frames_total{direction=\"phone_to_host\"}") >= Some(2.0)
    );
    let _ = host.kill();
    let _ = host.wait();
    assert!(wait_until(Duration::from_secs(5), || relay
        .metric("orca_relay_connections{kind=\"control\"}")
        == Some(0.0)));
}

/// Every variable the cell reads, set to `''` the way an env file with blank lines delivers
/// them, plus the role.
fn empty_cell_env() -> Vec<(&'static str, &'static str)> {
    let mut env: Vec<(&str, &str)> = orca_relay::config::VARIABLES
        .iter()
        .map(|name| (*name, ""))
        .collect();
    env.push(("ORCA_RELAY_ROLE", "cell"));
    env
}

#[test]
fn check_config_lists_every_missing_variable_of_a_cell_in_one_run() {
    let out = orca_relay(&empty_cell_env(), &["check-config"]);
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    let lines: Vec<&str> = stderr.lines().collect();
    assert_eq!(
        lines,
        [
            "orca-relay: missing ORCA_RELAY_SERVICE_TOKEN (unset): expected a shared bearer secret (required for the cell and director roles)",
            "orca-relay: missing ORCA_RELAY_JWKS_URL (unset): expected the auth JWKS URL (required for the cell and director roles)",
            "orca-relay: missing ORCA_RELAY_AUTH_ISSUER (unset): expected the token issuer (required with ORCA_RELAY_JWKS_URL, and so for the cell and director roles)",
            "3 problems",
        ],
        "{stderr}"
    );
    assert!(
        !stderr.contains("invalid"),
        "unset is not invalid: {stderr}"
    );
    assert!(out.stdout.is_empty());
}

#[test]
fn check_config_reports_bad_and_missing_values_together() {
    let mut env = empty_cell_env();
    env.extend([
        ("ORCA_RELAY_SERVICE_TOKEN", "s"),
        ("ORCA_RELAY_HANDSHAKE_ATTEMPTS", "three"),
        ("ORCA_RELAY_WS_ADDR", "localhost"),
    ]);
    let out = orca_relay(&env, &["check-config"]);
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("invalid ORCA_RELAY_WS_ADDR=\"localhost\""),
        "{stderr}"
    );
    assert!(
        stderr.contains("invalid ORCA_RELAY_HANDSHAKE_ATTEMPTS=\"three\""),
        "{stderr}"
    );
    assert!(stderr.contains("missing ORCA_RELAY_JWKS_URL"), "{stderr}");
    assert!(
        stderr.contains("missing ORCA_RELAY_AUTH_ISSUER"),
        "{stderr}"
    );
    assert_eq!(stderr.lines().last(), Some("4 problems"), "{stderr}");

    // `run` stops on the same problems, one line each.
    let out = orca_relay(&env, &["run"]);
    assert_eq!(out.status.code(), Some(1));
    let run_stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(run_stderr.lines().count(), 4, "{run_stderr}");
}

#[test]
fn check_config_prints_the_effective_config_and_a_summary_line() {
    let dir = TempDir::new("check-config");
    let data_dir = dir.0.display().to_string();
    let env = [
        ("ORCA_RELAY_DATA_DIR", data_dir.as_str()),
        ("ORCA_RELAY_REGION", "eu-1"),
        ("ORCA_RELAY_DIRECTOR_URLS", ""),
        ("ORCA_RELAY_SELF_HOSTED_KEY", TEST_KEY),
    ];
    let out = orca_relay(&env, &["check-config"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(
        lines.last(),
        Some(&"config ok: role=combined (3 variables set)"),
        "{stdout}"
    );
    // One marker for "unset" everywhere, and secrets masked.
    for unset in [
        "ORCA_RELAY_DIRECTOR_URLS",
        "DATABASE_URL",
        "ORCA_RELAY_JWKS_URL",
        "ORCA_RELAY_SERVICE_TOKEN",
    ] {
        assert!(
            lines.contains(&format!("{unset}=(unset)").as_str()),
            "{unset}: {stdout}"
        );
    }
    assert!(
        lines.contains(&"ORCA_RELAY_SELF_HOSTED_KEY=***"),
        "{stdout}"
    );
    assert!(!stdout.contains(TEST_KEY));
    assert!(
        !stdout.contains("=\n") && lines.iter().all(|l| !l.ends_with('=')),
        "{stdout}"
    );
}
