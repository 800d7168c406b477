//! The package as shipped, under a real systemd (issue 22): the `.deb` that
//! `packaging/build-deb.sh` built is installed with dpkg into a private namespace whose PID 1
//! is systemd (`tests/systemd_harness`), the shipped units run unchanged, and an operator's
//! env file (the shipped one with the values an operator fills in) configures them.
//!
//! Two namespaces, side by side (one test each, so `cargo test` runs them concurrently):
//! - **fleet**: a director and a cell on PostgreSQL (a server inside the namespace, see
//!   `systemd_harness::postgres` for why). A bad value fails the cell's start and
//!   `journalctl -p err` names it; both reach `active (running)` through `READY=1`; the journal
//!   has `orca_relay_started` at priority 6 and the cell's lowered-cap WARN at 4; a desktop the
//!   director placed stays connected while the watchdog keeps both units up for 60 s; `kill -9`
//!   is restarted; `systemd-analyze security` rates both at most 1.7.
//! - **combined**: the combined role on SQLite through the cell unit. `kill -HUP` leaves it
//!   active and the desktop connected; `systemctl stop` drains (the desktop sees `drain`, is
//!   not placed on the draining process again, then gets 4503) and exits 0 within
//!   `TimeoutStopSec`, using under 1 s of CPU for its 30 s drain; a SIGSTOPped process is
//!   killed by the watchdog and restarted.
//!
//! The `.deb`: `ORCA_RELAY_TEST_DEB` (scripts/test builds the package before the tests and
//! sets it), else the newest `target/debian/orca-relay_*.deb` if it is newer than every file
//! it is built from. A machine without root, util-linux, systemd or a built package fails in
//! one line saying what to do; these tests never skip.

mod harness;
mod systemd_harness;

use std::path::PathBuf;
use std::time::Duration;

use harness::{
    es256_token, read_close, read_json, send_json, set_read_timeout, token, ws_client, Ws, TEST_KEY,
};
use serde_json::json;
use systemd_harness::package::{
    configure_fleet, installed, traces, JwksServer, CELL, CELL_ENV, DIRECTOR, HTTP_ADDR, WS_ADDR,
};
use systemd_harness::{Entry, Namespace};
use tungstenite::client::IntoClientRequest;

/// The unit's `WatchdogSec=`, `TimeoutStopSec=` and the drain grace the env file leaves at its
/// default: the figures the tests hold the units to.
const WATCHDOG: Duration = Duration::from_secs(30);
const TIMEOUT_STOP: Duration = Duration::from_secs(45);
const DRAIN_GRACE: Duration = Duration::from_secs(30);
/// The most CPU a 30 s drain may use (systemd measured 30.089 s when it spun). Measured from
/// `CPUUsageNSec` before the stop to this long before the grace ends, while the unit still has
/// its cgroup (this systemd logs no "Consumed … CPU time" line without cgroup v2 controllers).
const DRAIN_CPU_LIMIT: Duration = Duration::from_secs(1);
const CPU_SAMPLE_BEFORE_END: Duration = Duration::from_secs(5);
/// `systemd-analyze security`'s overall exposure of both units when this test was written.
const EXPOSURE_LIMIT: f64 = 1.7;
/// How long a unit may take to come back after a kill (RestartSec=2, start-up, a loaded
/// machine).
const RESTART_WAIT: Duration = Duration::from_secs(60);

// ---------------------------------------------------------------------------------------------
// The package

fn host_traces() -> Vec<(String, bool)> {
    traces(&|path| PathBuf::from(path))
}

// ---------------------------------------------------------------------------------------------
// Helpers

/// A desktop of the namespace: placed through `/v1/assign`, its control socket acked.
struct Desktop {
    relay_host_id: String,
    token: String,
    control: Ws,
}

impl Desktop {
    /// Assigns through the director at `director` (retrying its 503s while the cell is not yet
    /// placeable), connects to the placed cell's WebSocket listener and says hello.
    fn connect(ns: &Namespace, director: &str, token: String, relay_host_id: &str) -> Desktop {
        let body = json!({"v":1,"relayHostId":relay_host_id}).to_string();
        let mut answer = (0, String::new());
        let placed = systemd_harness::wait_until(Duration::from_secs(30), || {
            answer = ns.http("POST", director, "/v1/assign", Some(&token), &body);
            answer.0 == 200
        });
        assert!(placed, "assign: {answer:?}");
        let placement: serde_json::Value = serde_json::from_str(&answer.1).unwrap();
        assert_eq!(
            placement["cellUrl"],
            format!("ws://{WS_ADDR}"),
            "{placement}"
        );
        let epoch = placement["assignmentEpoch"].as_i64().unwrap();

        let mut request = format!("ws://{WS_ADDR}/v1/host/control")
            .into_client_request()
            .unwrap();
        request
            .headers_mut()
            .insert("Authorization", format!("Bearer {token}").parse().unwrap());
        let stream = ns.connect(WS_ADDR);
        let mut control = ws_client(request, stream).expect("control upgrade");
        set_read_timeout(&control, Some(Duration::from_secs(20)));
        send_json(
            &mut control,
            json!({"type":"host-hello","v":1,"relayHostId":relay_host_id,"assignmentEpoch":epoch}),
        );
        let ack = read_json(&mut control);
        assert_eq!(ack["type"], "host-hello-ack", "{ack}");
        Desktop {
            relay_host_id: relay_host_id.to_string(),
            token,
            control,
        }
    }

    /// An invite round trip: the control is open and served.
    fn invite(&mut self) {
        send_json(
            &mut self.control,
            json!({"type":"invite-create","reqId":"r1"}),
        );
        let created = read_json(&mut self.control);
        assert_eq!(created["type"], "invite-created", "{created}");
    }

    /// Stays connected for `duration`, answering every ping (the default `PING_MS` is 15 s,
    /// `SILENCE_MS` 75 s: a silent desktop would be closed).
    fn hold_for(&mut self, duration: Duration) {
        let end = orca_relay::clock::instant() + duration;
        loop {
            let left = end.saturating_duration_since(orca_relay::clock::instant());
            if left.is_zero() {
                set_read_timeout(&self.control, Some(Duration::from_secs(20)));
                return;
            }
            set_read_timeout(&self.control, Some(left.max(Duration::from_millis(10))));
            match self.control.read() {
                Ok(tungstenite::Message::Text(text)) => {
                    let message: serde_json::Value = serde_json::from_str(&text).unwrap();
                    assert_eq!(message["type"], "ping", "{message}");
                    send_json(&mut self.control, json!({"type":"pong","t":message["t"]}));
                }
                Ok(other) => panic!("unexpected {other:?} while holding"),
                Err(tungstenite::Error::Io(e))
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                    ) => {}
                Err(e) => panic!("the control dropped while holding: {e}"),
            }
        }
    }
}

/// The unit is `active (running)`. Its `Type=notify` means the manager saw `READY=1` first.
fn assert_running(ns: &Namespace, unit: &str) {
    assert_eq!(ns.show(unit, "Type"), "notify");
    ns.wait_for_state(unit, "active/running", Duration::from_secs(5));
}

/// The unit's first journal line with `event`, from its own process.
fn event(ns: &Namespace, unit: &str, event: &str) -> Entry {
    ns.wait_for_entry(unit, Duration::from_secs(20), |entry| {
        entry.pid.is_some() && entry.message.contains(event)
    })
}

/// `systemd-analyze security`'s overall exposure of a loaded unit.
fn exposure(ns: &Namespace, unit: &str) -> f64 {
    let report = ns.run_ok(&["systemd-analyze", "security", "--no-pager", unit]);
    report
        .lines()
        .find_map(|line| {
            let rest = line.split_once("Overall exposure level for")?.1;
            rest.split_once(':')?
                .1
                .split_whitespace()
                .next()?
                .parse()
                .ok()
        })
        .unwrap_or_else(|| panic!("no overall exposure in:\n{report}"))
}

/// The CPU the unit has used so far (`CPUUsageNSec`), when the manager can tell (`[not set]`
/// once the unit's cgroup is gone).
fn cpu_usage(ns: &Namespace, unit: &str) -> Option<Duration> {
    ns.show(unit, "CPUUsageNSec")
        .parse::<u64>()
        .ok()
        .filter(|&nanos| nanos != u64::MAX)
        .map(Duration::from_nanos)
}

// ---------------------------------------------------------------------------------------------
// The fleet: a director and a cell on PostgreSQL

#[test]
fn a_director_and_a_cell_on_postgresql_run_as_shipped_under_systemd() {
    let host_before = host_traces();
    let ns = installed("fleet");
    let database_url = ns.start_postgresql();
    let jwks = JwksServer::start(&ns);
    configure_fleet(&ns, &database_url, &jwks);
    let cell_values = [
        // Above what LimitNOFILE=16384 allows: the cell lowers it with one WARN.
        ("ORCA_RELAY_CONNECTION_CAP", "100000"),
        // A bad value first: the start must fail and say why at priority 3.
        ("ORCA_RELAY_HTTP_IDLE_MS", "5"),
    ];
    ns.set_env_values(CELL_ENV, &cell_values);

    // The director: migrations, listener, READY=1.
    ns.systemctl_ok(&["start", DIRECTOR]);
    assert_running(&ns, DIRECTOR);
    // The env file as shipped says `RUST_LOG=`: the default filter, info.
    let started = event(&ns, DIRECTOR, "orca_relay_started");
    assert_eq!(started.priority, 6, "{started}");
    assert!(
        started
            .message
            .starts_with("INFO orca_relay_started role=director"),
        "{started}"
    );

    // A bad value in the env file: the start fails, and the line naming it is an error.
    let refused = ns.systemctl(&["start", CELL]);
    assert!(
        !refused.status.success(),
        "the cell started with HTTP_IDLE_MS=5"
    );
    let mut errors = String::new();
    let named = systemd_harness::wait_until(Duration::from_secs(20), || {
        errors = ns.run_ok(&[
            "journalctl",
            "--no-pager",
            &format!("--unit={CELL}"),
            "--priority=err",
            "--output=cat",
        ]);
        errors
            .lines()
            .any(|l| l.starts_with("orca-relay: invalid ORCA_RELAY_HTTP_IDLE_MS=\"5\""))
    });
    assert!(
        named,
        "journalctl -p err does not name the variable:\n{errors}"
    );
    // Restart=on-failure would retry it every 2 s: the operator stops it and fixes the file.
    ns.systemctl_ok(&["stop", CELL]);
    ns.set_env_values(CELL_ENV, &[("ORCA_RELAY_HTTP_IDLE_MS", "")]);

    // The cell: registered with the director, READY=1.
    ns.systemctl_ok(&["start", CELL]);
    assert_running(&ns, CELL);
    let started = event(&ns, CELL, "orca_relay_started");
    assert_eq!(started.priority, 6, "{started}");
    assert!(
        started
            .message
            .starts_with("INFO orca_relay_started role=cell"),
        "{started}"
    );
    let lowered = event(&ns, CELL, "orca_relay_connection_cap_lowered");
    assert_eq!(lowered.priority, 4, "{lowered}");
    assert!(lowered.message.contains("configured=100000"), "{lowered}");

    // A desktop the director places on the cell.
    let relay_host_id = harness::host_id();
    let user_id = format!("user-{relay_host_id}");
    let mut desktop = Desktop::connect(
        &ns,
        HTTP_ADDR,
        es256_token(&user_id, &relay_host_id),
        &relay_host_id,
    );

    // The watchdog keeps both up for 60 s: same processes, no restart, the desktop served.
    let pids = [ns.main_pid(DIRECTOR), ns.main_pid(CELL)];
    let restarts = [ns.show(DIRECTOR, "NRestarts"), ns.show(CELL, "NRestarts")];
    desktop.hold_for(2 * WATCHDOG);
    desktop.invite();
    assert_eq!([ns.main_pid(DIRECTOR), ns.main_pid(CELL)], pids);
    assert_eq!(
        [ns.show(DIRECTOR, "NRestarts"), ns.show(CELL, "NRestarts")],
        restarts
    );
    for unit in [DIRECTOR, CELL] {
        assert_running(&ns, unit);
        let journal = ns.journal_text(unit);
        assert!(!journal.contains("Watchdog timeout"), "{journal}");
    }

    // kill -9: Restart=on-failure brings the cell back, and the desktop's control outlives the
    // process (the unit's descriptor store): the new process resumes it and answers it.
    let killed = ns.main_pid(CELL);
    let restarts_before: u32 = ns.show(CELL, "NRestarts").parse().unwrap();
    ns.run_ok(&["kill", "-KILL", &killed.to_string()]);
    let restarted = systemd_harness::wait_until(RESTART_WAIT, || {
        ns.show(CELL, "NRestarts").parse::<u32>().unwrap_or(0) > restarts_before
            && ns.show(CELL, "SubState") == "running"
    });
    assert!(
        restarted,
        "kill -9 was not restarted:\n{}",
        ns.journal_text(CELL)
    );
    assert_ne!(ns.main_pid(CELL), killed);
    assert!(ns.journal_text(CELL).contains("status=9/KILL"));
    let resumed = event(&ns, CELL, "orca_relay_crash_resumed");
    assert!(
        resumed.message.contains("controls=1 pairs=0 closed=0"),
        "{resumed}"
    );
    desktop.hold_for(Duration::from_secs(3));
    desktop.invite();

    // The hardening as systemd rates it.
    for unit in [CELL, DIRECTOR] {
        let exposure = exposure(&ns, unit);
        eprintln!("{unit}: systemd-analyze security exposure {exposure}");
        assert!(
            exposure <= EXPOSURE_LIMIT,
            "{unit}: exposure {exposure} > {EXPOSURE_LIMIT}"
        );
    }

    drop(desktop);
    drop(jwks);
    drop(ns);
    assert_eq!(host_traces(), host_before, "the package reached the host");
}

// ---------------------------------------------------------------------------------------------
// The combined role on SQLite

#[test]
fn the_combined_role_on_sqlite_drains_ignores_sighup_and_is_watched_under_systemd() {
    let ns = installed("combined");
    ns.set_env_values(
        CELL_ENV,
        &[
            ("ORCA_RELAY_ROLE", "combined"),
            ("ORCA_RELAY_CELL_URL", "ws://127.0.0.1:8080"),
            ("ORCA_RELAY_DIRECTOR_URLS", ""),
            ("DATABASE_URL", ""),
            ("ORCA_RELAY_SELF_HOSTED_KEY", TEST_KEY),
        ],
    );
    ns.systemctl_ok(&["start", CELL]);
    assert_running(&ns, CELL);
    let started = event(&ns, CELL, "orca_relay_started");
    assert_eq!(started.priority, 6, "{started}");
    assert!(
        started
            .message
            .starts_with("INFO orca_relay_started role=combined"),
        "{started}"
    );
    // The state directory belongs to the package's user; SQLite lives in it.
    assert!(ns.path("/var/lib/orca-relay/relay.db").exists());
    let owner = ns.run_ok(&["stat", "--format=%U %a", "/var/lib/orca-relay"]);
    assert_eq!(owner.trim(), "orca-relay 750");

    let relay_host_id = harness::host_id();
    let user_id = format!("user-{relay_host_id}");
    let mut desktop = Desktop::connect(
        &ns,
        HTTP_ADDR,
        token(&user_id, &relay_host_id),
        &relay_host_id,
    );

    // kill -HUP: logged, ignored; same process, the desktop still served.
    let pid = ns.main_pid(CELL);
    ns.run_ok(&["kill", "-HUP", &pid.to_string()]);
    let ignored = event(&ns, CELL, "orca_relay_signal_ignored signal=SIGHUP");
    assert_eq!(ignored.priority, 4, "{ignored}");
    desktop.invite();
    assert_running(&ns, CELL);
    assert_eq!(ns.main_pid(CELL), pid);
    assert_eq!(ns.show(CELL, "NRestarts"), "0");

    // systemctl stop: the drain, with the desktop connected.
    let cpu_before_stop = cpu_usage(&ns, CELL);
    let stop_started = orca_relay::clock::instant();
    ns.systemctl_ok(&["stop", "--no-block", CELL]);
    let drain = read_json(&mut desktop.control);
    assert_eq!(
        drain,
        json!({"type":"drain","graceMs":30000,"recovery":"resolve-director"})
    );
    // Back to the director, as the drain frame says: not placed on the draining process.
    let (status, body) = ns.http(
        "POST",
        HTTP_ADDR,
        "/v1/assign",
        Some(&desktop.token),
        &json!({"v":1,"relayHostId":desktop.relay_host_id,"reconnect":true}).to_string(),
    );
    assert_eq!(
        (status, body.as_str()),
        (503, r#"{"error":"relay_capacity_exhausted"}"#)
    );
    // The desktop stays. Near the end of the grace (the unit is still `deactivating`, its
    // cgroup still counts) the CPU the drain used so far: a drain that spins uses a core.
    desktop.hold_for(
        (stop_started + DRAIN_GRACE - CPU_SAMPLE_BEFORE_END)
            .saturating_duration_since(orca_relay::clock::instant()),
    );
    let drained_for = stop_started.elapsed();
    let cpu_now = cpu_usage(&ns, CELL);
    assert_eq!(ns.show(CELL, "ActiveState"), "deactivating");
    let drain_cpu = cpu_now
        .zip(cpu_before_stop)
        .map(|(now, before)| now.saturating_sub(before))
        .expect("CPUUsageNSec is known while the unit runs");
    eprintln!("the drain used {drain_cpu:?} of CPU in its first {drained_for:?}");
    assert!(
        drain_cpu < DRAIN_CPU_LIMIT,
        "the drain used {drain_cpu:?} of CPU in its first {drained_for:?}"
    );
    // After the grace: 4503.
    set_read_timeout(&desktop.control, Some(Duration::from_secs(30)));
    assert_eq!(read_close(&mut desktop.control), Some(4503));
    ns.wait_for_state(CELL, "inactive/dead", TIMEOUT_STOP);
    let stopped_after = stop_started.elapsed();
    eprintln!("systemctl stop to inactive: {stopped_after:?}");
    assert!(
        stopped_after >= DRAIN_GRACE,
        "stopped after {stopped_after:?}"
    );
    // Exit 0 within TimeoutStopSec (a SIGKILL after it would be Result=timeout).
    assert_eq!(ns.show(CELL, "Result"), "success");
    assert_eq!(ns.show(CELL, "ExecMainStatus"), "0");
    let finished = event(&ns, CELL, "orca_relay_drain_finished");
    assert!(finished.message.contains("closed=1"), "{finished}");

    // The watchdog kills a process that stopped answering (SIGSTOP) and systemd restarts it.
    ns.systemctl_ok(&["start", CELL]);
    assert_running(&ns, CELL);
    let frozen = ns.main_pid(CELL);
    let restarts_before: u32 = ns.show(CELL, "NRestarts").parse().unwrap();
    ns.run_ok(&["kill", "-STOP", &frozen.to_string()]);
    // WATCHDOG=1 comes every 15 s: the kill follows within 30 s of the stop.
    let restarted = systemd_harness::wait_until(WATCHDOG + RESTART_WAIT, || {
        ns.show(CELL, "NRestarts").parse::<u32>().unwrap_or(0) > restarts_before
            && ns.show(CELL, "SubState") == "running"
    });
    assert!(
        restarted,
        "the watchdog did not restart it:\n{}",
        ns.journal_text(CELL)
    );
    assert_ne!(ns.main_pid(CELL), frozen);
    let journal = ns.journal_text(CELL);
    assert!(journal.contains("Watchdog timeout"), "{journal}");
    drop(desktop);
}
