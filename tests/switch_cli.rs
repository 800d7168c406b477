//! `orca-relay switch show | set | re-arm` against running relays, black-box: what the command
//! writes is what the cell applies (its `/metrics`: applied generation, raw admit mode,
//! dead-man state, trip slots in force).

mod harness;

use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use harness::*;

/// Runs `orca-relay switch …` with the relay's own configuration (as an operator does with the
/// cell's env file): (exit code, stdout, stderr).
fn switch(env: &[(&str, &str)], args: &[&str]) -> (i32, String, String) {
    let mut command = Command::new(env!("CARGO_BIN_EXE_orca-relay"));
    command
        .env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default());
    for (name, value) in env {
        command.env(name, value);
    }
    let out = command
        .arg("switch")
        .args(args)
        .output()
        .expect("run switch");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn metric(relay: &Relay, series: &str) -> f64 {
    relay.metric(series).unwrap_or(f64::NAN)
}

#[test]
fn switch_set_changes_what_a_running_combined_relay_applies() {
    let relay = Relay::combined(&[("ORCA_RELAY_SWITCH_POLL_MS", "50")]);
    let data_dir = relay.data_dir.0.display().to_string();
    let env = [
        ("ORCA_RELAY_DATA_DIR", data_dir.as_str()),
        ("ORCA_RELAY_HTTP_ADDR", relay.http.as_str()),
        ("ORCA_RELAY_SWITCH_POLL_MS", "50"),
    ];
    assert_eq!(metric(&relay, "orca_relay_switch_generation"), 0.0);

    let (code, stdout, stderr) = switch(
        &env,
        &["set", "--admit-mode", "reserve", "--trip-slots", "2"],
    );
    assert_eq!(code, 0, "{stdout}{stderr}");
    assert!(stdout.contains("wrote generation 1"), "{stdout}");
    assert!(
        stdout.contains("the running cell applied generation 1"),
        "{stdout}"
    );
    assert_eq!(metric(&relay, "orca_relay_switch_generation"), 1.0);
    assert_eq!(metric(&relay, "orca_relay_dead_man_trip_slots"), 2.0);
    // The in-process director keeps the cell armed: raw mode reserve.
    assert!(wait_until(Duration::from_secs(5), || metric(
        &relay,
        "orca_relay_admit_mode{kind=\"raw\"}"
    ) == 1.0));
    let file: serde_json::Value =
        serde_json::from_slice(&std::fs::read(relay.data_dir.0.join("switch.json")).unwrap())
            .unwrap();
    assert_eq!(
        file,
        serde_json::json!({"v":1,"cellId":"combined","generation":1,
            "flags":{"admitMode":"reserve","deadManTripSlots":2}})
    );

    // Changing one flag keeps the other.
    let (code, stdout, stderr) = switch(&env, &["set", "--trip-slots", "none"]);
    assert_eq!(code, 0, "{stdout}{stderr}");
    assert_eq!(metric(&relay, "orca_relay_switch_generation"), 2.0);
    assert_eq!(metric(&relay, "orca_relay_dead_man_trip_slots"), -1.0);
    assert_eq!(metric(&relay, "orca_relay_admit_mode{kind=\"raw\"}"), 1.0);

    // A hand-edit gone wrong: the cell ignores the file; `show` says so and what it applied.
    std::fs::write(relay.data_dir.0.join("switch.json"), "{\"v\":1,").unwrap();
    let (code, stdout, _) = switch(&env, &["show"]);
    assert_eq!(code, 1, "{stdout}");
    assert!(stdout.contains("file=void"), "{stdout}");
    assert!(
        stdout.contains("running_cell=generation 2 applied, dead-man armed"),
        "{stdout}"
    );
    // `set` still finds the next generation, from the running cell.
    let (code, stdout, stderr) = switch(&env, &["set", "--admit-mode", "db"]);
    assert_eq!(code, 0, "{stdout}{stderr}");
    assert!(stdout.contains("wrote generation 3"), "{stdout}");
    assert_eq!(metric(&relay, "orca_relay_switch_generation"), 3.0);
    assert_eq!(metric(&relay, "orca_relay_admit_mode{kind=\"raw\"}"), 0.0);
    let (code, stdout, _) = switch(&env, &["show"]);
    assert_eq!(code, 0, "{stdout}");
    assert!(
        stdout.contains("file=generation 3 flags {\"admitMode\":\"db\"}"),
        "{stdout}"
    );
    // Config management rolls the file back to an old generation: the cell ignores it, and
    // the next write goes above what the cell applied, not above the file.
    write_switch(
        &relay.data_dir.0.join("switch.json"),
        "combined",
        1,
        serde_json::json!({"admitMode":"db"}),
    );
    let (code, stdout, stderr) = switch(&env, &["set", "--admit-mode", "reserve"]);
    assert_eq!(code, 0, "{stdout}{stderr}");
    assert!(stdout.contains("wrote generation 4"), "{stdout}");
    assert_eq!(metric(&relay, "orca_relay_switch_generation"), 4.0);
    assert!(wait_until(Duration::from_secs(5), || metric(
        &relay,
        "orca_relay_admit_mode{kind=\"raw\"}"
    ) == 1.0));
    // Nothing but the file is left in the data directory's switch namespace.
    assert!(!std::fs::read_dir(&relay.data_dir.0).unwrap().any(|e| e
        .unwrap()
        .file_name()
        .to_string_lossy()
        .contains(".tmp")));
}

#[test]
fn switch_re_arm_re_arms_a_tripped_cell() {
    const CELL: &str = "c-rearm";
    let jwks = jwks_server();
    let director = accepting_director();
    let dir = Arc::new(TempDir::new("rearm"));
    let mut env = cell_env(CELL, &jwks, &[&director]);
    env.extend(
        [
            ("ORCA_RELAY_DEAD_MAN_BASE_MS", "1500"),
            ("ORCA_RELAY_DEAD_MAN_SPREAD_MS", "0"),
            ("ORCA_RELAY_SWITCH_POLL_MS", "50"),
            ("ORCA_RELAY_ADMIT_EFFECTIVE_REFRESH_MS", "200"),
        ]
        .map(|(k, v)| (k.to_string(), v.to_string())),
    );
    let relay = Relay::start_in(dir.clone(), &env_refs(&env));
    // The operator's command runs with the cell's env file.
    let data_dir = dir.0.display().to_string();
    let mut operator = env_refs(&env);
    operator.push(("ORCA_RELAY_DATA_DIR", &data_dir));
    operator.push(("ORCA_RELAY_HTTP_ADDR", &relay.http));

    let (code, stdout, _) = switch(&operator, &["re-arm"]);
    assert_eq!(code, 1, "nothing to re-arm without a file: {stdout}");

    let (code, stdout, stderr) = switch(&operator, &["set", "--admit-mode", "reserve"]);
    assert_eq!(code, 0, "{stdout}{stderr}");
    // No director polls this cell: its window passes and, without a trip-slot cap, it trips.
    assert!(
        wait_until(Duration::from_secs(15), || metric(
            &relay,
            "orca_relay_dead_man_state{state=\"tripped\"}"
        ) == 1.0),
        "{}",
        relay.log_text()
    );
    assert_eq!(metric(&relay, "orca_relay_admit_mode{kind=\"raw\"}"), 0.0);
    let (code, stdout, _) = switch(&operator, &["show"]);
    assert_eq!(code, 0);
    assert!(stdout.contains("dead-man tripped"), "{stdout}");

    // The director is back (contact alone does not re-arm: the trip is latched) …
    let _polls = DirectorPolls::start(&relay);
    let (code, stdout, stderr) = switch(&operator, &["re-arm"]);
    assert_eq!(code, 0, "{stdout}{stderr}");
    assert!(stdout.contains("wrote generation 2"), "{stdout}");
    // … and the new generation re-arms it.
    assert!(
        wait_until(Duration::from_secs(5), || metric(
            &relay,
            "orca_relay_dead_man_state{state=\"armed\"}"
        ) == 1.0),
        "{}",
        relay.log_text()
    );
    assert_eq!(metric(&relay, "orca_relay_admit_mode{kind=\"raw\"}"), 1.0);
    let file: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.0.join("switch.json")).unwrap()).unwrap();
    assert_eq!(file["generation"], 2);
    assert_eq!(file["cellId"], CELL);
    assert_eq!(file["flags"], serde_json::json!({"admitMode":"reserve"}));
}
