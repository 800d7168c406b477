//! `orca-relay fleet status` on a combined relay (its in-process director serves the listing
//! behind the configured service token; without one, one line says what to set), what
//! `switch set` / `re-arm` change in it, colour only on a terminal, and the bounds of the
//! exchange against misbehaving directors: one line and exit 1 for a trickled answer (the whole
//! exchange has one 10 s deadline, not one per read), a silent one, an oversized one, a
//! non-JSON one and a 404.

mod harness;

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::Command;
use std::time::Duration;

use harness::*;
use serde_json::Value;

const TOKEN: &str = "combined-fleet-token";

/// Runs `orca-relay <args>` with exactly `env` (and PATH): (exit code, stdout, stderr).
fn orca(env: &[(&str, &str)], args: &[&str]) -> (i32, String, String) {
    let mut command = Command::new(env!("CARGO_BIN_EXE_orca-relay"));
    command
        .env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default());
    for (name, value) in env {
        command.env(name, value);
    }
    let out = command.args(args).output().expect("run orca-relay");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The one data row of a one-cell table, by column title (read at the header's offsets).
fn only_row(stdout: &str) -> HashMap<String, String> {
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(lines.len(), 3, "header, one cell, summary:\n{stdout}");
    let header = lines[0];
    let titles = [
        "CELL",
        "REGION",
        "STATE",
        "ADMIT RAW/EFF",
        "DEAD-MAN",
        "WINDOW LEFT",
        "SLOT",
        "TRIP SLOTS",
        "HEARTBEAT",
        "CONNS/CAP",
        "DB POOL",
    ];
    titles
        .iter()
        .map(|title| {
            let at = header.find(title).expect(title);
            let value = lines[1][at..].split("  ").next().unwrap().trim();
            (title.to_string(), value.to_string())
        })
        .collect()
}

#[test]
fn a_combined_relay_lists_its_cell_and_switch_writes_show_in_the_next_status() {
    let relay = Relay::combined(&[
        ("ORCA_RELAY_SERVICE_TOKEN", TOKEN),
        ("ORCA_RELAY_SWITCH_POLL_MS", "50"),
        ("ORCA_RELAY_FEED_POLL_MS", "100"),
        ("ORCA_RELAY_ADMIT_EFFECTIVE_REFRESH_MS", "100"),
    ]);
    let data_dir = relay.data_dir.0.display().to_string();
    // The operator's command runs with the relay's own env (no --director: the local one).
    let env = [
        ("ORCA_RELAY_DATA_DIR", data_dir.as_str()),
        ("ORCA_RELAY_HTTP_ADDR", relay.http.as_str()),
        ("ORCA_RELAY_SWITCH_POLL_MS", "50"),
        ("ORCA_RELAY_SERVICE_TOKEN", TOKEN),
    ];
    let status = || {
        let (code, stdout, stderr) = orca(&env, &["fleet", "status"]);
        assert_eq!(code, 0, "{stdout}{stderr}");
        only_row(&stdout)
    };
    let mut row = HashMap::new();
    assert!(
        wait_until(Duration::from_secs(20), || {
            row = status();
            row["DEAD-MAN"] == "off"
        }),
        "{row:?}"
    );
    assert_eq!(row["CELL"], "combined");
    assert_eq!(row["STATE"], "ready");
    assert_eq!(row["ADMIT RAW/EFF"], "db/db");
    assert_eq!(row["WINDOW LEFT"], "-", "off: no window");
    assert_eq!(row["SLOT"], "no");
    assert_eq!(row["TRIP SLOTS"], "none");

    let (code, stdout, stderr) = orca(
        &env,
        &[
            "switch",
            "set",
            "--admit-mode",
            "reserve",
            "--trip-slots",
            "2",
        ],
    );
    assert_eq!(code, 0, "{stdout}{stderr}");
    assert!(
        wait_until(Duration::from_secs(20), || {
            row = status();
            row["DEAD-MAN"] == "armed" && row["ADMIT RAW/EFF"] == "reserve/reserve"
        }),
        "{row:?}"
    );
    assert_eq!(row["TRIP SLOTS"], "2");
    assert_eq!(row["SLOT"], "no");

    let (code, stdout, stderr) = orca(&env, &["switch", "re-arm"]);
    assert_eq!(code, 0, "{stdout}{stderr}");
    // The re-armed generation reaches the listing with the director's next poll.
    let mut listing = Value::Null;
    assert!(
        wait_until(Duration::from_secs(20), || {
            let (code, stdout, stderr) = orca(&env, &["fleet", "status", "--json"]);
            assert_eq!(code, 0, "{stderr}");
            listing = serde_json::from_str(&stdout).expect("--json prints JSON");
            listing["cells"][0]["status"]["switchGeneration"] == 2
        }),
        "{listing}"
    );
    let cell = &listing["cells"][0];
    assert_eq!(cell["status"]["deadMan"], "armed");
    assert_eq!(listing["summary"]["slots"], 2);
    assert_eq!(listing["summary"]["slotsTaken"], 0);

    // Only the listing: the director's other admin routes are not served by a combined relay.
    let (code, _) = relay.post("/v1/admin/cell-heartbeat", Some(TOKEN), "{}");
    assert_eq!(code, 404);
}

#[test]
fn states_are_coloured_on_a_terminal_unless_no_color_is_set() {
    let relay = Relay::combined(&[("ORCA_RELAY_SERVICE_TOKEN", TOKEN)]);
    let command = format!(
        "{} fleet status --director http://{}",
        env!("CARGO_BIN_EXE_orca-relay"),
        relay.http
    );
    // `script` runs the command on a pseudo-terminal and copies what it prints.
    let on_a_terminal = |no_color: Option<&str>| {
        let mut script = Command::new("script");
        script
            .args(["-qec", &command, "/dev/null"])
            .env_clear()
            .env("PATH", std::env::var("PATH").unwrap_or_default())
            .env("TERM", "xterm")
            .env("ORCA_RELAY_SERVICE_TOKEN", TOKEN);
        if let Some(value) = no_color {
            script.env("NO_COLOR", value);
        }
        let out = script.output().expect("run script(1)");
        assert!(out.status.success(), "{out:?}");
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let mut coloured = String::new();
    assert!(
        wait_until(Duration::from_secs(20), || {
            coloured = on_a_terminal(None);
            coloured.contains("\x1b[32mready\x1b[0m")
        }),
        "{coloured:?}"
    );
    let plain = on_a_terminal(Some("1"));
    assert!(plain.contains("ready"), "{plain:?}");
    assert!(!plain.contains('\x1b'), "NO_COLOR=1: {plain:?}");
    let empty = on_a_terminal(Some(""));
    assert!(
        empty.contains('\x1b'),
        "an empty NO_COLOR is unset: {empty:?}"
    );
}

#[test]
fn a_combined_relay_without_a_service_token_says_what_to_set() {
    let relay = Relay::combined(&[]);
    let env = [("ORCA_RELAY_HTTP_ADDR", relay.http.as_str())];
    let (code, stdout, stderr) = orca(&env, &["fleet", "status"]);
    assert_eq!((code, stdout.as_str()), (1, ""), "{stderr}");
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(
        stderr.contains("ORCA_RELAY_SERVICE_TOKEN is not set")
            && stderr.contains(
                "set the same ORCA_RELAY_SERVICE_TOKEN for the relay and for this command"
            ),
        "{stderr}"
    );
    // A token on the command's side only: the relay generated its own, which nobody knows.
    let env = [
        ("ORCA_RELAY_HTTP_ADDR", relay.http.as_str()),
        ("ORCA_RELAY_SERVICE_TOKEN", TOKEN),
    ];
    let (code, _, stderr) = orca(&env, &["fleet", "status"]);
    assert_eq!(code, 1);
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(
        stderr.contains("serves the fleet listing only when ORCA_RELAY_SERVICE_TOKEN is set")
            && stderr.contains("(401)"),
        "{stderr}"
    );
}

/// A fake director on 127.0.0.1:0 that answers every connection with `answer`; its address.
fn fake_director(name: &str, answer: fn(TcpStream)) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    orca_relay::threads::spawn(format!("fake-{name}"), move || {
        for stream in listener.incoming().map_while(Result::ok) {
            let _ = orca_relay::threads::spawn("fake-connection", move || answer(stream));
        }
    })
    .unwrap();
    url
}

/// Reads the request head (up to the blank line).
fn read_head(stream: &mut TcpStream) {
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") && stream.read(&mut byte).is_ok_and(|n| n == 1) {
        head.push(byte[0]);
    }
}

fn status_of(director: &str) -> (i32, String, String, Duration) {
    let started = orca_relay::clock::instant();
    let (code, stdout, stderr) = orca(
        &[("ORCA_RELAY_SERVICE_TOKEN", TOKEN)],
        &["fleet", "status", "--director", director],
    );
    (code, stdout, stderr, started.elapsed())
}

#[test]
fn a_trickled_answer_is_cut_at_the_whole_exchange_deadline() {
    // Headers at once, then one byte of body a second: no single read ever waits long, so
    // only a deadline for the whole exchange ends it.
    let director = fake_director("trickle", |mut stream| {
        read_head(&mut stream);
        let head =
            "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n";
        if stream.write_all(head.as_bytes()).is_err() {
            return;
        }
        for _ in 0..60 {
            if stream.write_all(b" ").is_err() {
                return;
            }
            orca_relay::clock::sleep(Duration::from_secs(1));
        }
    });
    let (code, stdout, stderr, took) = status_of(&director);
    assert_eq!((code, stdout.as_str()), (1, ""), "{stderr}");
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(
        stderr.contains("no answer from the director") && stderr.contains("within 10 s"),
        "{stderr}"
    );
    assert!(
        took >= Duration::from_millis(9_500) && took < Duration::from_secs(15),
        "took {took:?}"
    );
}

#[test]
fn a_silent_director_is_given_up_on_at_the_deadline() {
    let director = fake_director("silent", |mut stream| {
        read_head(&mut stream);
        // Holds the connection open without a word until the client leaves.
        let mut rest = [0u8; 64];
        while stream.read(&mut rest).is_ok_and(|n| n > 0) {}
    });
    let (code, _, stderr, took) = status_of(&director);
    assert_eq!(code, 1, "{stderr}");
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(stderr.contains("no answer from the director"), "{stderr}");
    assert!(
        took >= Duration::from_millis(9_500) && took < Duration::from_secs(15),
        "took {took:?}"
    );
}

#[test]
fn oversized_malformed_and_missing_listings_are_one_line_each() {
    let oversized = fake_director("oversized", |mut stream| {
        read_head(&mut stream);
        let length = 9 * 1024 * 1024;
        let head = format!("HTTP/1.1 200 OK\r\nContent-Length: {length}\r\n\r\n");
        let _ = stream.write_all(head.as_bytes());
        let chunk = vec![b' '; 64 * 1024];
        for _ in 0..(length / chunk.len()) {
            if stream.write_all(&chunk).is_err() {
                return;
            }
        }
    });
    let (code, _, stderr, took) = status_of(&oversized);
    assert_eq!(code, 1, "{stderr}");
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(
        stderr.contains("the body exceeds 8388608 bytes"),
        "{stderr}"
    );
    assert!(
        took < Duration::from_secs(10),
        "refused as it arrived: {took:?}"
    );

    let not_json = fake_director("not-json", |mut stream| {
        read_head(&mut stream);
        let _ = stream.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello");
    });
    let (code, _, stderr, _) = status_of(&not_json);
    assert_eq!(code, 1);
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(
        stderr.contains("bad answer from the director") && stderr.contains("not JSON"),
        "{stderr}"
    );

    let older = fake_director("older", |mut stream| {
        read_head(&mut stream);
        let body = r#"{"error":"not_found"}"#;
        let _ = stream.write_all(
            format!(
                "HTTP/1.1 404 Not Found\r\nContent-Length: {}\r\n\r\n{body}",
                body.len()
            )
            .as_bytes(),
        );
    });
    let (code, _, stderr, _) = status_of(&older);
    assert_eq!(code, 1);
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(stderr.contains("answered 404 not_found"), "{stderr}");
}
