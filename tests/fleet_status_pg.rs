//! `orca-relay fleet status` against a real `director` and real `cell` processes on a real
//! PostgreSQL, one cell in each state an operator meets during a director outage:
//! - `a-armed`: reserve, polled by the director (contact), armed;
//! - `t-tripped`: reserve with `deadManTripSlots=1`, its internal URL unreachable (no contact):
//!   its window (1.5 s) passes first, it wins the one slot and trips;
//! - `h-held`: the same, with a 6 s window: the slot is taken, so it is held; before that its
//!   window left counts down in what it reports by heartbeat;
//! - `d-draining`: reserve, polled, a desktop connected, SIGTERM with a 60 s drain grace;
//! - `r-retired`: db mode, killed (SIGKILL), retired after `ORCA_RELAY_CELL_RETIRE_MS` (3 s).
//!
//! The director cannot poll `t-tripped` and `h-held`, so what it knows of their dead-man comes
//! from their heartbeats' status report: the case the report rides on heartbeats for. The table,
//! `--json`, and the summary line are checked against each state; then a wrong token and an
//! unreachable director each give one line and exit 1.
//!
//! Needs `ORCA_RELAY_TEST_DATABASE_URL` (`eval "$(scripts/test-postgres.sh start)"`).

mod common;
mod harness;

use std::collections::HashMap;
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use harness::*;
use serde_json::Value;

const DEADLINE: Duration = Duration::from_secs(30);
const RETIRE_MS: &str = "3000";
/// Where nothing listens: the director's polls of these cells fail at once.
const UNREACHABLE: &str = "http://127.0.0.1:9";

fn owned(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

/// Runs `orca-relay fleet status …` as an operator would, with only the service token set:
/// (exit code, stdout, stderr).
fn fleet_status(token: &str, args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_orca-relay"))
        .env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .env("ORCA_RELAY_SERVICE_TOKEN", token)
        .arg("fleet")
        .arg("status")
        .args(args)
        .output()
        .expect("run fleet status");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The table's rows by cell id, each a map from column title to its text, read at the
/// header's column offsets (so alignment is checked too: a value must start at its column).
fn table(stdout: &str) -> (HashMap<String, HashMap<String, String>>, String) {
    let lines: Vec<&str> = stdout.lines().collect();
    assert!(lines.len() >= 2, "a header and a summary:\n{stdout}");
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
    let offsets: Vec<(usize, &str)> = titles
        .iter()
        .map(|title| (header.find(title).expect(title), *title))
        .collect();
    let mut rows = HashMap::new();
    for line in &lines[1..lines.len() - 1] {
        let mut row = HashMap::new();
        for (at, title) in &offsets {
            assert!(
                *at == 0 || line[..*at].ends_with("  "),
                "{title} is not aligned in {line:?}\n{stdout}"
            );
            let value = line[*at..].split("  ").next().unwrap().trim().to_string();
            row.insert(title.to_string(), value);
        }
        rows.insert(row["CELL"].clone(), row);
    }
    (rows, lines[lines.len() - 1].to_string())
}

/// `12.3s`, `850ms`, `1m05s` back to milliseconds.
fn millis(text: &str) -> u64 {
    if text == "0s" {
        return 0;
    }
    if let Some(ms) = text.strip_suffix("ms") {
        return ms.parse().unwrap();
    }
    if let Some((minutes, seconds)) = text.split_once('m') {
        let seconds: u64 = seconds.trim_end_matches('s').parse().unwrap();
        return minutes.parse::<u64>().unwrap() * 60_000 + seconds * 1_000;
    }
    let seconds: f64 = text.trim_end_matches('s').parse().unwrap();
    (seconds * 1_000.0).round() as u64
}

struct Fleet {
    env: Vec<(String, String)>,
    director: Relay,
    _jwks: FakeServer,
}

impl Fleet {
    fn start() -> Fleet {
        let jwks = jwks_server();
        let database_url = common::pg::fresh_database("fleetstatus");
        let env = owned(&[
            ("DATABASE_URL", &database_url),
            ("ORCA_RELAY_SERVICE_TOKEN", SERVICE_TOKEN),
            ("ORCA_RELAY_JWKS_URL", &format!("{}/jwks.json", jwks.url())),
            ("ORCA_RELAY_AUTH_ISSUER", TEST_ISSUER),
            ("ORCA_RELAY_READINESS_PROBE_MS", "200"),
            ("ORCA_RELAY_HEARTBEAT_MS", "200"),
            ("ORCA_RELAY_HEARTBEAT_FRESH_MS", "1500"),
            ("ORCA_RELAY_FEED_POLL_MS", "200"),
            ("ORCA_RELAY_CELL_RETIRE_MS", RETIRE_MS),
            ("ORCA_RELAY_SWITCH_POLL_MS", "50"),
            ("ORCA_RELAY_ADMIT_EFFECTIVE_REFRESH_MS", "200"),
            ("ORCA_RELAY_TRIP_CLAIM_RETRY_MS", "300"),
            ("ORCA_RELAY_DEAD_MAN_SPREAD_MS", "0"),
        ]);
        let mut director_env = env.clone();
        director_env.push(("ORCA_RELAY_ROLE".into(), "director".into()));
        let director =
            Relay::start_in(Arc::new(TempDir::new("director")), &env_refs(&director_env));
        assert!(director
            .wait_for_log("orca_relay_migrations_applied", DEADLINE)
            .is_some());
        Fleet {
            env,
            director,
            _jwks: jwks,
        }
    }

    /// The operator's record of a cell's switch (what the trip-slot claim counts).
    fn record_admit_mode(&self, cell_id: &str, mode: &str) {
        let body = serde_json::json!({"cellId": cell_id, "admitMode": mode});
        let response = ureq::put(&self.director.http_url("/v1/admin/cell-admit-mode"))
            .set("Authorization", &format!("Bearer {SERVICE_TOKEN}"))
            .timeout(Duration::from_secs(10))
            .send_string(&body.to_string())
            .expect("admit mode recorded");
        assert_eq!(response.status(), 200);
    }

    /// A cell with its switch file (`flags`, or none: db mode) and extra env.
    fn cell(&self, cell_id: &str, flags: Option<Value>, extra: &[(&str, &str)]) -> Relay {
        let dir = Arc::new(TempDir::new(cell_id));
        if let Some(flags) = flags {
            write_switch(&dir.0.join("switch.json"), cell_id, 1, flags);
        }
        let mut env = self.env.clone();
        env.extend(owned(&[
            ("ORCA_RELAY_ROLE", "cell"),
            ("ORCA_RELAY_CELL_ID", cell_id),
            ("ORCA_RELAY_REGION", "eu-test"),
            ("ORCA_RELAY_DIRECTOR_URLS", &self.director.http_url("")),
        ]));
        env.extend(owned(extra));
        Relay::start_in(dir, &env_refs(&env))
    }

    fn listing(&self) -> Value {
        let response = ureq::get(&self.director.http_url("/v1/admin/cells"))
            .set("Authorization", &format!("Bearer {SERVICE_TOKEN}"))
            .timeout(Duration::from_secs(10))
            .call()
            .expect("GET /v1/admin/cells");
        serde_json::from_str(&response.into_string().unwrap()).expect("JSON")
    }

    fn url(&self) -> String {
        self.director.http_url("")
    }
}

fn entry(listing: &Value, cell_id: &str) -> Value {
    listing["cells"]
        .as_array()
        .and_then(|cells| cells.iter().find(|cell| cell["cellId"] == cell_id))
        .cloned()
        .unwrap_or(Value::Null)
}

/// Waits until `cell_id`'s listed entry satisfies `condition`; returns that entry.
fn wait_for_entry(
    fleet: &Fleet,
    cell_id: &str,
    what: &str,
    condition: impl Fn(&Value) -> bool,
) -> Value {
    let mut last = Value::Null;
    let met = wait_until(DEADLINE, || {
        last = entry(&fleet.listing(), cell_id);
        condition(&last)
    });
    assert!(
        met,
        "timed out waiting for {cell_id} {what}; last entry: {last}"
    );
    last
}

fn dead_man(entry: &Value) -> &str {
    entry["status"]["deadMan"].as_str().unwrap_or("-")
}

#[test]
fn fleet_status_shows_armed_held_tripped_draining_and_retired_cells_and_their_slots() {
    let fleet = Fleet::start();
    for cell in ["a-armed", "t-tripped", "h-held", "d-draining"] {
        fleet.record_admit_mode(cell, "reserve");
    }
    // Every reserve cell has one trip slot; the windows (SPREAD 0) decide who claims first.
    let capped = || Some(serde_json::json!({"admitMode": "reserve", "deadManTripSlots": 1}));
    let base = "ORCA_RELAY_DEAD_MAN_BASE_MS";
    let unreachable = ("ORCA_RELAY_INTERNAL_URL", UNREACHABLE);
    let _tripped = fleet.cell("t-tripped", capped(), &[(base, "1500"), unreachable]);
    let _armed = fleet.cell("a-armed", capped(), &[(base, "2000")]);
    let draining = fleet.cell(
        "d-draining",
        capped(),
        &[(base, "2000"), ("ORCA_RELAY_DRAIN_GRACE_MS", "60000")],
    );
    let mut retired = fleet.cell("r-retired", None, &[]);
    let _held = fleet.cell("h-held", capped(), &[(base, "6000"), unreachable]);

    // The tripped cell won the one slot: it says so, and the database counts its row.
    let tripped = wait_for_entry(&fleet, "t-tripped", "tripped holding the slot", |e| {
        dead_man(e) == "tripped"
            && e["holdsTripSlot"] == true
            && e["status"]["holdsTripSlot"] == true
    });
    assert_eq!(tripped["status"]["source"], "heartbeat", "{tripped}");
    assert_eq!(tripped["status"]["admitModeRaw"], "db");
    assert_eq!(tripped["status"]["tripSlots"], 1);
    assert_eq!(tripped["status"]["windowLeftMs"], 0);

    // The armed cell is polled: its report comes with the feed, its window full.
    let armed = wait_for_entry(&fleet, "a-armed", "armed by the feed", |e| {
        dead_man(e) == "armed" && e["status"]["source"] == "feed"
    });
    assert_eq!(armed["holdsTripSlot"], false);
    assert_eq!(armed["status"]["windowMs"], 2000);

    // The unpolled cell's window counts down in its heartbeats, in the JSON and the table.
    let first = wait_for_entry(
        &fleet,
        "h-held",
        "armed with its window counting down",
        |e| {
            dead_man(e) == "armed"
                && e["status"]["windowLeftMs"]
                    .as_u64()
                    .is_some_and(|left| (1_500..6_000).contains(&left))
        },
    );
    let first_left = first["status"]["windowLeftMs"].as_u64().unwrap();
    let (code, stdout, stderr) = fleet_status(SERVICE_TOKEN, &["--director", &fleet.url()]);
    assert_eq!(code, 0, "{stdout}{stderr}");
    let (rows, _) = table(&stdout);
    let table_left_first = rows["h-held"]["WINDOW LEFT"].clone();
    wait_for_entry(&fleet, "h-held", "its window left lower by 500 ms", |e| {
        e["status"]["windowLeftMs"]
            .as_u64()
            .is_some_and(|left| left + 500 <= first_left)
    });
    let (code, stdout, stderr) = fleet_status(SERVICE_TOKEN, &["--director", &fleet.url()]);
    assert_eq!(code, 0, "{stdout}{stderr}");
    let (rows, _) = table(&stdout);
    assert!(
        millis(&rows["h-held"]["WINDOW LEFT"]) < millis(&table_left_first),
        "the window left decreases: {table_left_first} then {}\n{stdout}",
        rows["h-held"]["WINDOW LEFT"]
    );

    // Its window passes with the only slot taken: held, not tripped.
    let held = wait_for_entry(&fleet, "h-held", "held", |e| dead_man(e) == "held");
    assert_eq!(held["holdsTripSlot"], false);
    assert_eq!(
        held["status"]["admitModeRaw"], "reserve",
        "a held cell stays reserve"
    );
    assert_eq!(held["status"]["windowLeftMs"], 0);

    // A desktop keeps the draining cell in its drain grace; then it drains.
    let relay_host_id = "fsdraining000001";
    assert_eq!(draining.book("user-d", relay_host_id, 5), "ok");
    let token = es256_token("user-d", relay_host_id);
    let (_control, _) = hello(&draining, &token, relay_host_id, 5).expect("booked hello");
    draining.signal("TERM");
    wait_for_entry(&fleet, "d-draining", "draining", |e| {
        e["state"] == "draining"
    });

    // The db-mode cell dies without a word: retired once silent for RETIRE_MS.
    retired.signal("KILL");
    retired.wait_exit(DEADLINE).expect("killed");
    wait_for_entry(&fleet, "r-retired", "retired", |e| e["state"] == "retired");

    // The table: one row per cell, each state as it is, aligned, not coloured when piped.
    let (code, stdout, stderr) = fleet_status(SERVICE_TOKEN, &["--director", &fleet.url()]);
    assert_eq!(code, 0, "{stdout}{stderr}");
    assert_eq!(stderr, "");
    assert!(
        !stdout.contains('\u{1b}'),
        "piped output is never coloured:\n{stdout}"
    );
    let (rows, summary) = table(&stdout);
    assert_eq!(rows.len(), 5, "{stdout}");
    let expect = |cell: &str, column: &str, value: &str| {
        assert_eq!(rows[cell][column], value, "{cell} {column}:\n{stdout}");
    };
    expect("a-armed", "STATE", "ready");
    expect("a-armed", "DEAD-MAN", "armed");
    expect("a-armed", "ADMIT RAW/EFF", "reserve/reserve");
    expect("a-armed", "SLOT", "no");
    expect("a-armed", "TRIP SLOTS", "1");
    expect("a-armed", "CONNS/CAP", "0/1000");
    expect("a-armed", "REGION", "eu-test");
    assert!(
        millis(&rows["a-armed"]["WINDOW LEFT"]) > 1_000,
        "polled: {stdout}"
    );
    assert!(millis(&rows["a-armed"]["HEARTBEAT"]) < 5_000, "{stdout}");
    expect("t-tripped", "DEAD-MAN", "tripped");
    expect("t-tripped", "ADMIT RAW/EFF", "db/db");
    expect("t-tripped", "SLOT", "yes");
    expect("t-tripped", "TRIP SLOTS", "1");
    expect("t-tripped", "WINDOW LEFT", "0s");
    expect("h-held", "DEAD-MAN", "held");
    expect("h-held", "ADMIT RAW/EFF", "reserve/reserve");
    expect("h-held", "SLOT", "no");
    expect("h-held", "STATE", "ready");
    expect("d-draining", "STATE", "draining");
    expect("d-draining", "CONNS/CAP", "1/1000");
    expect("d-draining", "SLOT", "no");
    expect("r-retired", "STATE", "retired");
    expect("r-retired", "SLOT", "no");
    let pool = &rows["a-armed"]["DB POOL"];
    let (in_use, ceiling) = pool.split_once('/').expect("in use / ceiling");
    assert!(
        in_use.parse::<u32>().unwrap() <= ceiling.parse::<u32>().unwrap() && ceiling == "10",
        "{stdout}"
    );
    assert_eq!(
        summary,
        "5 cells: 3 live (3 ready), 1 draining, 1 retired; dead-man: 2 armed, 1 held, 1 tripped, 0 off, 0 unknown; trip slots taken 1/1",
        "\n{stdout}"
    );

    // --json: the director's listing as it came, parsed back.
    let (code, stdout, stderr) =
        fleet_status(SERVICE_TOKEN, &["--director", &fleet.url(), "--json"]);
    assert_eq!(code, 0, "{stderr}");
    let listing: Value = serde_json::from_str(&stdout).expect("--json prints JSON");
    assert_eq!(listing["v"], 1);
    let state_of = |cell: &str| {
        let cell = entry(&listing, cell);
        (
            cell["state"].as_str().unwrap_or("-").to_string(),
            dead_man(&cell).to_string(),
            cell["holdsTripSlot"].clone(),
        )
    };
    let owned_state = |state: &str, dead_man: &str, holds: bool| {
        (state.to_string(), dead_man.to_string(), Value::Bool(holds))
    };
    assert_eq!(state_of("a-armed"), owned_state("live", "armed", false));
    assert_eq!(state_of("t-tripped"), owned_state("live", "tripped", true));
    assert_eq!(state_of("h-held"), owned_state("live", "held", false));
    assert_eq!(
        state_of("d-draining"),
        owned_state("draining", "armed", false)
    );
    assert_eq!(state_of("r-retired").0, "retired");
    assert_eq!(
        listing["summary"],
        serde_json::json!({
            "cells": 5,
            "byState": {"live": 3, "draining": 1, "retired": 1},
            "ready": 3,
            "byDeadMan": {"off": 0, "armed": 2, "held": 1, "tripped": 1, "unknown": 0},
            "slotsTaken": 1,
            "slots": 1,
        })
    );

    // A wrong token: 401, one line, exit 1.
    let (code, stdout, stderr) = fleet_status("not-the-token", &["--director", &fleet.url()]);
    assert_eq!(code, 1, "{stdout}{stderr}");
    assert_eq!(stdout, "");
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(
        stderr.contains("401") && stderr.contains("refused the service token"),
        "{stderr}"
    );

    // A director that is not there: one line, exit 1, at once.
    let started = orca_relay::clock::instant();
    let (code, _, stderr) = fleet_status(SERVICE_TOKEN, &["--director", UNREACHABLE]);
    assert_eq!(code, 1);
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(
        stderr.contains("director unreachable at http://127.0.0.1:9"),
        "{stderr}"
    );
    assert!(started.elapsed() < Duration::from_secs(10));
}
