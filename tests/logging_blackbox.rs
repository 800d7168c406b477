//! Logs as journald sees them, on the real binary: `<N>` syslog priorities when stderr is the
//! journal stream, and a repeated failure (heartbeats to a director that keeps refusing them)
//! logged once, not once per beat, then once on recovery.

mod harness;

use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use harness::*;

/// Starts the combined role with stderr going to `log_path`; `journal_stream` is the value of
/// `JOURNAL_STREAM`, computed from the file when `None`.
fn combined_logging_to_file(
    dir: &TempDir,
    log_path: &std::path::Path,
    journal_stream: Option<&str>,
) -> std::process::Child {
    use std::os::unix::fs::MetadataExt;
    let file = std::fs::File::create(log_path).expect("log file");
    let metadata = file.metadata().expect("log file metadata");
    let stream = journal_stream
        .map(str::to_string)
        .unwrap_or_else(|| format!("{}:{}", metadata.dev(), metadata.ino()));
    Command::new(env!("CARGO_BIN_EXE_orca-relay"))
        .env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .env("RUST_LOG", "info")
        .env("INVOCATION_ID", "0123456789abcdef0123456789abcdef")
        .env("JOURNAL_STREAM", stream)
        .env("ORCA_RELAY_WS_ADDR", "127.0.0.1:0")
        .env("ORCA_RELAY_HTTP_ADDR", "127.0.0.1:0")
        .env("ORCA_RELAY_DATA_DIR", &dir.0)
        .env("ORCA_RELAY_SELF_HOSTED_KEY", TEST_KEY)
        .env("ORCA_RELAY_SWITCH_POLL_MS", "50")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::from(file))
        .spawn()
        .expect("start orca-relay")
}

/// Runs a combined relay whose switch file is void (one WARN line) until it has logged that
/// line and started, stops it with SIGTERM, and returns its log.
fn log_of_a_short_run(journal_stream: Option<&str>) -> String {
    let dir = TempDir::new("journal");
    std::fs::write(dir.0.join("switch.json"), "not json").unwrap();
    let log_path = dir.0.join("stderr.log");
    let mut child = combined_logging_to_file(&dir, &log_path, journal_stream);
    let read = || std::fs::read_to_string(&log_path).unwrap_or_default();
    let started = wait_until(Duration::from_secs(30), || {
        let text = read();
        text.contains("orca_relay_started") && text.contains("orca_relay_control_flags_unreadable")
    });
    let _ = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status();
    let exited = wait_until(Duration::from_secs(30), || {
        matches!(child.try_wait(), Ok(Some(_)))
    });
    if !exited {
        let _ = child.kill();
    }
    let _ = child.wait();
    let text = read();
    assert!(started, "the relay never started; log:\n{text}");
    assert!(exited, "the relay did not exit on SIGTERM; log:\n{text}");
    text
}

#[test]
fn under_journald_every_line_starts_with_its_syslog_priority() {
    let text = log_of_a_short_run(None);
    let mut levels_seen = Vec::new();
    for line in text.lines() {
        let (priority, rest) = line
            .strip_prefix('<')
            .and_then(|l| l.split_once('>'))
            .unwrap_or_else(|| panic!("no <N> prefix: {line:?}\nlog:\n{text}"));
        let level = rest.split_whitespace().next().unwrap_or_default();
        let expected = match level {
            "ERROR" => "3",
            "WARN" => "4",
            "INFO" => "6",
            "DEBUG" | "TRACE" => "7",
            other => panic!("no level after the prefix ({other:?}): {line:?}"),
        };
        assert_eq!(priority, expected, "{line}");
        // Under systemd journald stamps the line: no timestamp of our own.
        assert!(rest.starts_with(level), "{line}");
        levels_seen.push(level.to_string());
    }
    assert!(levels_seen.iter().any(|l| l == "WARN"), "{text}");
    assert!(levels_seen.iter().any(|l| l == "INFO"), "{text}");
    assert!(
        text.contains("<4>WARN orca_relay_control_flags_unreadable"),
        "{text}"
    );
    assert!(text.contains("<6>INFO orca_relay_started"), "{text}");
}

#[test]
fn a_journal_stream_inherited_for_another_file_adds_no_prefix() {
    // systemd passes JOURNAL_STREAM on to children whose stderr may point elsewhere.
    let text = log_of_a_short_run(Some("0:0"));
    assert!(
        text.contains("WARN orca_relay_control_flags_unreadable"),
        "{text}"
    );
    for line in text.lines() {
        assert!(!line.starts_with('<'), "{line}");
    }
}

/// A director that accepts registrations and refuses heartbeats with 500 while `refusing` is
/// set; counts the heartbeats it saw.
fn director_refusing_heartbeats(refusing: Arc<AtomicBool>) -> FakeServer {
    FakeServer::start(move |seen| {
        if seen.path.ends_with("/cell-heartbeat") && refusing.load(Ordering::SeqCst) {
            (500, r#"{"error":"internal"}"#.to_string())
        } else {
            (200, r#"{"v":1,"ok":true}"#.to_string())
        }
    })
}

#[test]
fn heartbeats_refused_many_times_are_logged_once_then_once_on_recovery() {
    let jwks = jwks_server();
    let refusing = Arc::new(AtomicBool::new(true));
    let director = director_refusing_heartbeats(refusing.clone());
    let mut env = cell_env("c-throttle", &jwks, &[&director]);
    env.push(("ORCA_RELAY_HEARTBEAT_MS".into(), "20".into()));
    let relay = Relay::start_in(Arc::new(TempDir::new("throttle")), &env_refs(&env));
    let heartbeats = || {
        director
            .seen()
            .iter()
            .filter(|s| s.path.ends_with("/cell-heartbeat"))
            .count()
    };
    // Twenty refused beats, well inside a minute.
    assert!(
        wait_until(Duration::from_secs(30), || heartbeats() >= 20),
        "the cell kept beating"
    );
    assert!(relay
        .wait_for_log("orca_relay_heartbeat_failed", Duration::from_secs(5))
        .is_some());
    assert_eq!(
        relay.count_log("orca_relay_heartbeat_failed"),
        1,
        "one line for the whole run of failures:\n{}",
        relay.log_text()
    );
    refusing.store(false, Ordering::SeqCst);
    let recovered = relay
        .wait_for_log("orca_relay_heartbeat_recovered", Duration::from_secs(10))
        .unwrap_or_else(|| panic!("no recovery line:\n{}", relay.log_text()));
    let failures: u64 = field(&recovered, "failures").unwrap().parse().unwrap();
    assert!(failures >= 20, "{recovered}");
    let beats = heartbeats();
    assert!(wait_until(Duration::from_secs(10), || heartbeats() >= beats + 5));
    assert_eq!(relay.count_log("orca_relay_heartbeat_recovered"), 1);
    assert_eq!(relay.count_log("orca_relay_heartbeat_failed"), 1);
}

/// The harness never hands a test a log before the lines it needs can have arrived: `wait_exit`
/// returns only once the process's output has been read to its end (issue 20: a start-up error
/// read from a log whose last line was still in the pipe, on a loaded machine). The script
/// exits at once after a burst the reader is still behind on, and leaves a child that writes
/// the last line half a second later through the same pipe: both must be in the log.
#[test]
fn wait_exit_returns_only_once_every_line_written_is_in_the_log() {
    use std::os::unix::fs::PermissionsExt;
    let dir = Arc::new(TempDir::new("drained"));
    let script = dir.0.join("noisy.sh");
    std::fs::write(
        &script,
        "#!/bin/sh\n\
         yes 'burst line' | head -n 100000 >&2\n\
         (sleep 0.5; echo 'the last line' >&2) &\n\
         exit 3\n",
    )
    .unwrap();
    std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
    let mut process = Relay::launch_binary(&script, dir, &[]);
    assert_eq!(process.wait_exit(Duration::from_secs(60)), Some(3));
    assert_eq!(process.count_log("burst line"), 100_000);
    assert_eq!(process.count_log("the last line"), 1);
}

// ---------------------------------------------------------------------------------------------
// What the packaged env files ship (issue 22): `RUST_LOG=` empty, and a start that fails.

#[test]
fn an_empty_rust_log_means_the_default_filter_info() {
    // packaging/cell.env ships `RUST_LOG=` and systemd passes it on as ''; SPEC §4: '' is unset.
    let relay = Relay::combined(&[("RUST_LOG", "")]);
    assert!(
        relay.count_log("INFO orca_relay_started") == 1,
        "{}",
        relay.log_text()
    );
}

/// Runs the binary to its exit with stderr going to a file that `JOURNAL_STREAM` names (as
/// under systemd); returns (exit code, stderr).
fn run_to_exit_under_journald(args: &[&str], env: &[(&str, &str)]) -> (Option<i32>, String) {
    use std::os::unix::fs::MetadataExt;
    let dir = TempDir::new("fatal");
    let log_path = dir.0.join("stderr.log");
    let file = std::fs::File::create(&log_path).expect("log file");
    let metadata = file.metadata().expect("log file metadata");
    let mut child = Command::new(env!("CARGO_BIN_EXE_orca-relay"))
        .args(args)
        .env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .env("INVOCATION_ID", "0123456789abcdef0123456789abcdef")
        .env(
            "JOURNAL_STREAM",
            format!("{}:{}", metadata.dev(), metadata.ino()),
        )
        .env("ORCA_RELAY_WS_ADDR", "127.0.0.1:0")
        .env("ORCA_RELAY_HTTP_ADDR", "127.0.0.1:0")
        .env("ORCA_RELAY_DATA_DIR", &dir.0)
        .env("ORCA_RELAY_SELF_HOSTED_KEY", TEST_KEY)
        .envs(env.iter().copied())
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::from(file))
        .spawn()
        .expect("start orca-relay");
    let exited = wait_until(Duration::from_secs(30), || {
        matches!(child.try_wait(), Ok(Some(_)))
    });
    if !exited {
        let _ = child.kill();
    }
    let status = child.wait().expect("wait");
    (status.code(), std::fs::read_to_string(&log_path).unwrap())
}

#[test]
fn under_journald_a_fatal_start_line_is_filed_as_an_error() {
    // A bad value: one line naming it, at priority 3 so that `journalctl -p err` shows it.
    let (code, text) = run_to_exit_under_journald(&["run"], &[("ORCA_RELAY_HTTP_IDLE_MS", "5")]);
    assert_eq!(code, Some(78), "{text}");
    let line = text
        .lines()
        .find(|l| l.contains("ORCA_RELAY_HTTP_IDLE_MS"))
        .unwrap_or_else(|| panic!("no line names the variable:\n{text}"));
    assert!(
        line.starts_with("<3>orca-relay: invalid ORCA_RELAY_HTTP_IDLE_MS=\"5\""),
        "{line}"
    );

    // A start that fails after the configuration was read (the WebSocket port is taken).
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap().to_string();
    let (code, text) = run_to_exit_under_journald(&["run"], &[("ORCA_RELAY_WS_ADDR", &addr)]);
    assert_eq!(code, Some(1), "{text}");
    let last = text.lines().last().unwrap_or_default();
    assert!(
        last.starts_with("<3>orca-relay: ") && last.contains(&addr),
        "the refusal, last, at priority 3: {last:?}\n{text}"
    );

    // A command line the binary cannot parse (systemd would run it from a drop-in's ExecStart).
    let (code, text) = run_to_exit_under_journald(&["no-such-command"], &[]);
    assert_eq!(code, Some(2), "{text}");
    assert!(text.starts_with("<3>orca-relay: "), "{text}");
}
