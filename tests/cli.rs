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

/// A running `client host`: its stdout lines arrive on a channel, its stderr in a
/// `ProcessLog` (read its lines with `wait_for`: one may still be in the pipe).
struct HostPeer {
    child: std::process::Child,
    lines: std::sync::mpsc::Receiver<String>,
    stderr: std::sync::Arc<ProcessLog>,
}

impl HostPeer {
    fn start(env: &[(&str, &str)], args: &[&str]) -> HostPeer {
        let mut command = Command::new(env!("CARGO_BIN_EXE_orca-relay"));
        command
            .env_clear()
            .env("PATH", std::env::var("PATH").unwrap_or_default());
        for (name, value) in env {
            command.env(name, value);
        }
        let mut child = command
            .args(["client", "host"])
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start client host");
        let (sender, lines) = std::sync::mpsc::channel();
        let stdout = child.stdout.take().unwrap();
        orca_relay::threads::spawn("test-host-stdout", move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                let _ = sender.send(line);
            }
        })
        .unwrap();
        let stderr = ProcessLog::capture(child.stderr.take().unwrap(), "client-host");
        HostPeer {
            child,
            lines,
            stderr,
        }
    }

    /// The next phone command the host prints.
    fn next_phone_command(&self, timeout: Duration) -> String {
        self.lines.recv_timeout(timeout).unwrap_or_else(|_| {
            panic!(
                "client host printed no phone command; its stderr:\n{}",
                self.stderr.text()
            )
        })
    }

    fn stderr(&self) -> String {
        self.stderr.text()
    }

    /// Waits for a stderr line containing `needle`.
    fn wait_for_stderr(&self, needle: &str) -> bool {
        self.stderr
            .wait_for(needle, Duration::from_secs(10))
            .is_some()
    }
}

impl Drop for HostPeer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Runs a printed phone command exactly as printed (through `sh -c`, nothing in the
/// environment but PATH), feeds it `input` and returns what it printed.
fn run_printed_phone_command(line: &str, input: &str) -> String {
    let mut phone = Command::new("sh")
        .args(["-c", line])
        .env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start the printed phone command");
    phone
        .stdin
        .take()
        .unwrap()
        .write_all(input.as_bytes())
        .unwrap();
    let out = phone.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "{line}: exit {:?}: {}",
        out.status.code(),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn word_after(line: &str, flag: &str) -> String {
    let words: Vec<&str> = line.split_whitespace().collect();
    let at = words.iter().position(|w| *w == flag).expect(flag);
    words[at + 1].to_string()
}

/// README "Try it by hand": the combined relay with nothing configured (it generates its
/// self-hosted key), `client host` with no flags, then the phone command it prints, run as
/// printed.
#[test]
fn the_readme_walk_through_runs_as_written() {
    let relay = Relay::combined(&[("ORCA_RELAY_SELF_HOSTED_KEY", "")]);
    let data_dir = relay.data_dir.0.display().to_string();
    // The defaults the README relies on: the director at the configured HTTP address, the key
    // in the data directory.
    let host = HostPeer::start(
        &[
            ("ORCA_RELAY_DATA_DIR", data_dir.as_str()),
            ("ORCA_RELAY_HTTP_ADDR", relay.http.as_str()),
        ],
        &[],
    );
    let line = host.next_phone_command(Duration::from_secs(20));
    let executable = std::fs::canonicalize(env!("CARGO_BIN_EXE_orca-relay")).unwrap();
    assert!(
        line.starts_with(&format!("{} client phone ", executable.display())),
        "the command names the running executable: {line}"
    );
    assert_eq!(word_after(&line, "--cell"), format!("ws://{}", relay.ws));

    let echoed = run_printed_phone_command(&line, "hello through the relay\nsecond line\n");
    assert_eq!(echoed, "hello through the relay\nsecond line\n");
    assert!(
        relay.metric("orca_relay_splice_frames_total{direction=\"phone_to_host\"}") >= Some(2.0)
    );
    drop(host);
    assert!(wait_until(Duration::from_secs(5), || relay
        .metric("orca_relay_connections{kind=\"control\"}")
        == Some(0.0)));
}

#[test]
fn every_subcommand_answers_help() {
    for args in [
        &["--help"][..],
        &["run", "--help"],
        &["migrate", "--help"],
        &["check-config", "--help"],
        &["budget", "--help"],
        &["client", "--help"],
        &["client", "host", "--help"],
        &["client", "host", "-h"],
        &["client", "phone", "--help"],
        &["client", "phone", "--cell", "ws://x", "--help"],
        &["fleet", "--help"],
        &["fleet", "status", "--help"],
        &["fleet", "status", "--director", "--help"],
    ] {
        let out = orca_relay(&[], args);
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert_eq!(
            out.status.code(),
            Some(0),
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(stdout.contains("usage:"), "{args:?}: {stdout}");
        let named = args.iter().take_while(|a| !a.starts_with('-')).count();
        if named > 0 {
            let usage = format!("orca-relay {}", args[..named].join(" "));
            assert!(stdout.contains(&usage), "{args:?} names {usage}: {stdout}");
        }
    }
}

/// SIGTERM drains the relay: the host leaves on the drain frame (so the drain ends long before
/// its grace), asks the director again while the relay is down, and once the relay is back on
/// the same addresses reconnects and prints a phone command that works. It stops only when
/// told to, with exit 0.
#[test]
fn client_host_follows_a_drain_back_to_the_director_and_reconnects() {
    let relay = Relay::combined(&[("ORCA_RELAY_DRAIN_GRACE_MS", "20000")]);
    let (ws, http) = (relay.ws.clone(), relay.http.clone());
    let data_dir = relay.data_dir.clone();
    let director = format!("http://{http}");
    let host = HostPeer::start(
        &[("ORCA_RELAY_SELF_HOSTED_KEY", TEST_KEY)],
        &["--director", &director],
    );
    let first = host.next_phone_command(Duration::from_secs(20));
    assert_eq!(run_printed_phone_command(&first, "before\n"), "before\n");

    let mut relay = relay;
    let drain_started = orca_relay::clock::instant();
    relay.signal("TERM");
    assert_eq!(relay.wait_exit(Duration::from_secs(15)), Some(0));
    assert!(
        drain_started.elapsed() < Duration::from_secs(10),
        "the host left on the drain frame, not at the end of the 20 s grace"
    );
    assert!(
        host.wait_for_stderr("draining"),
        "stderr: {}",
        host.stderr()
    );

    let relay = Relay::start_in(
        data_dir,
        &[
            ("ORCA_RELAY_WS_ADDR", ws.as_str()),
            ("ORCA_RELAY_HTTP_ADDR", http.as_str()),
        ],
    );
    let second = host.next_phone_command(Duration::from_secs(30));
    assert_eq!(word_after(&second, "--cell"), format!("ws://{ws}"));
    assert_eq!(run_printed_phone_command(&second, "after\n"), "after\n");
    assert_eq!(
        relay.metric("orca_relay_connections{kind=\"control\"}"),
        Some(1.0)
    );

    let mut host = host;
    let _ = Command::new("kill")
        .args(["-TERM", &host.child.id().to_string()])
        .status();
    let exit = wait_exit_drained(&mut host.child, &[&host.stderr], Duration::from_secs(10));
    assert_eq!(exit, Some(0), "stderr: {}", host.stderr());
    assert!(wait_until(Duration::from_secs(5), || relay
        .metric("orca_relay_connections{kind=\"control\"}")
        == Some(0.0)));
}

/// A cell that closes the control with 4503 without a drain frame (a moved lease): the host
/// goes back to the director with `"reconnect":true` and lands on the cell it names next.
#[test]
fn client_host_follows_a_4503_close_back_to_the_director() {
    let relay = Relay::combined(&[]);
    // A cell that acks nothing: it reads the hello and closes 4503.
    let fake_cell = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let fake_cell_url = format!("ws://{}", fake_cell.local_addr().unwrap());
    orca_relay::threads::spawn("test-fake-cell", move || {
        if let Ok((stream, _)) = fake_cell.accept() {
            let mut ws = tungstenite::accept(stream).expect("fake cell upgrade");
            let _ = ws.read();
            let _ = ws.close(Some(tungstenite::protocol::CloseFrame {
                code: tungstenite::protocol::frame::coding::CloseCode::from(4503),
                reason: "lease moved".into(),
            }));
            while ws.read().is_ok() {}
        }
    })
    .unwrap();
    let real_director = relay.http_url("/v1/assign");
    let director = FakeServer::start(move |seen| {
        let asked_before = seen.body.contains("\"reconnect\":true");
        if !asked_before {
            let body = serde_json::json!({"v":1,"cellUrl":fake_cell_url,"assignmentEpoch":1});
            return (200, body.to_string());
        }
        let response = ureq::post(&real_director)
            .set("Authorization", seen.authorization.as_deref().unwrap_or(""))
            .send_string(&seen.body);
        match response {
            Ok(response) => (200, response.into_string().unwrap()),
            Err(e) => (502, e.to_string()),
        }
    });
    let host = HostPeer::start(
        &[("ORCA_RELAY_SELF_HOSTED_KEY", TEST_KEY)],
        &["--director", &director.url()],
    );
    let line = host.next_phone_command(Duration::from_secs(20));
    assert_eq!(word_after(&line, "--cell"), format!("ws://{}", relay.ws));
    assert!(host.wait_for_stderr("4503"), "{}", host.stderr());
    let assigns = director.seen();
    assert_eq!(assigns.len(), 2, "{assigns:?}");
    assert!(!assigns[0].body.contains("reconnect"));
    assert!(assigns[1].body.contains("\"reconnect\":true"));
    assert_eq!(run_printed_phone_command(&line, "ok\n"), "ok\n");
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

    // `run` stops on the same problems, one line each, with EX_CONFIG (78: the units do not
    // restart a process for a configuration that will be refused again).
    let out = orca_relay(&env, &["run"]);
    assert_eq!(out.status.code(), Some(78));
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

/// SPEC §13 "Environment": a value that is not valid UTF-8 is refused like any invalid value,
/// by `check-config` and at every start, in one line naming the variable (the raw bytes are not
/// printed: a secret's neither). Before: it was read as unset, so `CONNECTION_CAP=10000` with a
/// stray byte became the default 1,000 and `check-config` said `config ok`.
#[test]
fn a_value_that_is_not_utf8_is_refused_by_check_config_and_at_start() {
    use std::ffi::OsStr;
    use std::os::unix::ffi::OsStrExt;
    let dir = TempDir::new("not-utf8");
    // A `run` that does not refuse serves until killed: it is given 10 s to exit.
    let run = |name: &str, bytes: &[u8], args: &[&str]| {
        let mut child = Command::new(env!("CARGO_BIN_EXE_orca-relay"))
            .env_clear()
            .env("PATH", std::env::var("PATH").unwrap_or_default())
            .env("ORCA_RELAY_DATA_DIR", &dir.0)
            .env("ORCA_RELAY_SELF_HOSTED_KEY", TEST_KEY)
            .env("ORCA_RELAY_WS_ADDR", "127.0.0.1:0")
            .env("ORCA_RELAY_HTTP_ADDR", "127.0.0.1:0")
            .env(name, OsStr::from_bytes(bytes))
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("run orca-relay");
        let exited = wait_until(Duration::from_secs(10), || {
            child.try_wait().ok().flatten().is_some()
        });
        if !exited {
            let _ = child.kill();
        }
        child.wait_with_output().expect("the output")
    };
    for (name, bytes) in [
        ("ORCA_RELAY_CONNECTION_CAP", &b"10000\xff"[..]),
        ("DATABASE_URL", &b"postgres://relay:s\xe9cret@db/relay"[..]),
    ] {
        for args in [&["check-config"][..], &["run"][..]] {
            let out = run(name, bytes, args);
            let stderr = String::from_utf8_lossy(&out.stderr);
            assert_eq!(out.status.code(), Some(1), "{name} {args:?}: {stderr}");
            let line = format!("orca-relay: invalid {name}: the value is not valid UTF-8");
            assert!(
                stderr.lines().any(|l| l.starts_with(&line)),
                "{name} {args:?}: {stderr}"
            );
            assert!(
                !out.stderr
                    .windows(2)
                    .any(|w| w == b"\xff\n" || w[0] == 0xe9)
                    && !stderr.contains("cret"),
                "no raw bytes, no secret: {stderr}"
            );
            assert!(
                !String::from_utf8_lossy(&out.stdout).contains("config ok"),
                "{name} {args:?}"
            );
        }
    }
}
