//! Live handover under a real systemd (issue 23): the shipped `orca-relay-cell.service`,
//! unchanged, its `/usr/bin/orca-relay` the binary under test (a link inside the namespace, so
//! that an "upgrade" is pointing it at the next build), runs the combined role on SQLite in a
//! private namespace whose PID 1 is systemd 252 (`tests/systemd_harness`).
//!
//! `systemctl start` reaches active through `READY=1`; under the load, `systemctl
//! reload` runs `orca-relay handover` (`ExecReload=`): nothing closed or lost, no stream paused
//! a second, `/ready` and `/health` always 200, `MainPID` becomes the next process and its
//! watchdog pings are the ones systemd hears; `kill -9` of the main process is restarted by
//! `Restart=`; `systemctl stop` drains with 4503.

mod handover_kit;
mod harness;
mod systemd_harness;

use std::path::{Path, PathBuf};
use std::time::Duration;

use handover_kit::client::{self, Blocking, OP_CLOSE};
use handover_kit::load::{Identity, Spec};
use handover_kit::remote::RemoteLoad;
use handover_kit::{build_with_note, in_netns, Poller};
use harness::{host_id, token, TEST_KEY};
use serde_json::json;
use systemd_harness::Namespace;

const UNIT: &str = "orca-relay-cell.service";

/// The two scenarios take turns: the load's stall figure is the relay's, not a neighbour
/// restarting a relay of its own beside it on two cores.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());
const WS: &str = "127.0.0.1:8080";
const HTTP: &str = "127.0.0.1:8081";

/// The binary under test as `/usr/bin/orca-relay` (a link in the namespace's `/usr` overlay).
fn point_binary_at(ns: &Namespace, binary: &Path) {
    let link = ns.path("/usr/bin/orca-relay");
    let _ = std::fs::remove_file(&link);
    std::os::unix::fs::symlink(binary, &link).expect("link /usr/bin/orca-relay");
}

/// The user, the binary, the env file (the shipped one, with what an operator of a combined
/// relay fills in) and the shipped unit, unchanged.
fn install(ns: &Namespace) {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    ns.write(
        "/usr/lib/sysusers.d/orca-relay.conf",
        &std::fs::read_to_string(root.join("packaging/orca-relay.sysusers.conf")).unwrap(),
    );
    ns.run_ok(&["systemd-sysusers"]);
    point_binary_at(ns, Path::new(env!("CARGO_BIN_EXE_orca-relay")));
    std::fs::create_dir_all(ns.path("/etc/orca-relay")).unwrap();
    let shipped = std::fs::read_to_string(root.join("packaging/cell.env")).unwrap();
    let operator = format!(
        "{shipped}\n# The test's operator: a combined relay on this machine.\n\
         ORCA_RELAY_ROLE=combined\nDATABASE_URL=\nORCA_RELAY_CELL_ID=combined\nORCA_RELAY_WS_ADDR={WS}\n\
         ORCA_RELAY_HTTP_ADDR={HTTP}\nORCA_RELAY_CELL_URL=ws://{WS}\nORCA_RELAY_DIRECTOR_URLS=\n\
         ORCA_RELAY_SELF_HOSTED_KEY={TEST_KEY}\nORCA_RELAY_PING_MS=2000\n\
         ORCA_RELAY_WEDGE_MS=60000\nORCA_RELAY_CONNECTION_CAP=5000\n\
         ORCA_RELAY_DRAIN_GRACE_MS=2000\nORCA_RELAY_SPLICE_WORKERS=2\n"
    );
    ns.write("/etc/orca-relay/cell.env", &operator);
    ns.add_unit(
        UNIT,
        &std::fs::read_to_string(root.join("systemd/orca-relay-cell.service")).unwrap(),
    );
}

fn netns(ns: &Namespace) -> PathBuf {
    PathBuf::from(format!("/proc/{}/ns/net", ns.pid1()))
}

/// `count` desktops placed by the combined relay's director, from inside the namespace.
fn place(ns: &Namespace, count: usize) -> Vec<Identity> {
    in_netns(Some(&netns(ns)), move || {
        (0..count)
            .map(|_| {
                let relay_host_id = host_id();
                let user_id = format!("user-{relay_host_id}");
                let token = token(&user_id, &relay_host_id);
                // 503 while the cell is not yet placeable (its first ready heartbeat).
                let mut answer = None;
                systemd_harness::wait_until(Duration::from_secs(30), || {
                    answer = ureq::post(&format!("http://{HTTP}/v1/assign"))
                        .set("Authorization", &format!("Bearer {token}"))
                        .timeout(Duration::from_secs(20))
                        .send_string(&json!({"v":1,"relayHostId":relay_host_id}).to_string())
                        .ok()
                        .and_then(|response| response.into_json::<serde_json::Value>().ok());
                    answer.is_some()
                });
                let answer = answer.expect("assign");
                Identity {
                    user_id,
                    relay_host_id,
                    token,
                    epoch: answer["assignmentEpoch"].as_i64().unwrap(),
                }
            })
            .collect()
    })
}

fn metric_in(ns: &Namespace, series: &'static str) -> Option<f64> {
    in_netns(Some(&netns(ns)), move || handover_kit::metric(HTTP, series))
}

fn version_in(ns: &Namespace) -> Option<String> {
    in_netns(Some(&netns(ns)), || handover_kit::served_version(HTTP))
}

fn alive_inside(ns: &Namespace, pid: u32) -> bool {
    ns.run(&["kill", "-0", &pid.to_string()]).status.success()
}

#[test]
fn systemctl_reload_hands_over_under_load_and_systemd_follows_the_next_process() {
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    handover_kit::raise_fd_limit();
    let ns = Namespace::boot("handover");
    install(&ns);
    ns.systemctl_ok(&["start", UNIT]);
    ns.wait_for_state(UNIT, "active/running", Duration::from_secs(30));
    let first = ns.main_pid(UNIT);
    assert!(first > 0);
    let netns = netns(&ns);

    let identities = place(&ns, 1_000);
    let mut spec = Spec::new(1_000, 200);
    spec.netns = Some(netns.clone());
    let mut load = RemoteLoad::start("load_helper", WS, spec, identities);
    // The upgrade lands on disk; the running process is the old build.
    let next = build_with_note("next");
    point_binary_at(&ns, &next);
    orca_relay::clock::sleep(Duration::from_secs(2));
    load.pause_desktop(0);
    orca_relay::clock::sleep(Duration::from_secs(1));
    let watchdog_before = ns.show(UNIT, "WatchdogTimestampMonotonic");
    let poller = Poller::start_in(HTTP, Some(&netns));
    load.mark();
    let began = load.elapsed_ms();
    let reload = ns.systemctl(&["reload", UNIT]);
    let ended = load.elapsed_ms();
    assert!(
        reload.status.success(),
        "systemctl reload: {reload:?}\n{}",
        ns.journal_text(UNIT)
    );
    let second = ns.main_pid(UNIT);
    assert_ne!(second, first, "MainPID is the next process");
    assert_eq!(version_in(&ns).as_deref(), Some("0.1.0+next"));
    ns.wait_for_state(UNIT, "active/running", Duration::from_secs(5));
    assert!(
        systemd_harness::wait_until(Duration::from_secs(15), || !alive_inside(&ns, first)),
        "the old process exits"
    );
    handover_kit::served(|| load.report(), 399, Duration::from_secs(60));
    load.resume_desktop(0);
    handover_kit::served(|| load.report(), 400, Duration::from_secs(60));
    let (asked, failures) = poller.stop();
    let report = load.report();
    let finished = load.finish(Duration::from_secs(60));
    assert!(
        failures.is_empty(),
        "{} of {asked} polls failed: {failures:?}",
        failures.len()
    );
    assert!(finished.closed.is_empty(), "closed: {:?}", finished.closed);
    assert!(finished.violations.is_empty(), "{:?}", finished.violations);
    assert_eq!(
        finished.messages_received, finished.messages_sent,
        "{finished:?}"
    );
    assert_eq!(report.pinged_since_mark, 1_000, "{report:?}");
    assert!(
        report.max_stall_ms < 1_000,
        "{report:?}; the reload ran from {began} to {ended} ms"
    );
    // The watchdog follows: systemd hears WATCHDOG=1 from the next process (the old one is
    // gone), within the send period (half of WatchdogSec=30).
    assert!(
        systemd_harness::wait_until(Duration::from_secs(20), || {
            ns.show(UNIT, "WatchdogTimestampMonotonic") != watchdog_before
        }),
        "no watchdog ping after the handover:\n{}",
        ns.journal_text(UNIT)
    );
    ns.wait_for_state(UNIT, "active/running", Duration::from_secs(5));
    assert_eq!(ns.main_pid(UNIT), second);
    assert!(metric_in(&ns, "orca_relay_ready").is_some());

    // An upgrade of the package while the cell runs: the postinst hands over (reload) to the
    // new binary on disk.
    let upgrade = build_with_note("upgrade");
    point_binary_at(&ns, &upgrade);
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    ns.write(
        "/srv/postinst",
        &std::fs::read_to_string(root.join("packaging/debian/postinst")).unwrap(),
    );
    let postinst = ns.run(&["sh", "/srv/postinst", "configure", "0.1.0"]);
    assert!(postinst.status.success(), "postinst: {postinst:?}");
    let third = ns.main_pid(UNIT);
    assert_ne!(
        third, second,
        "the postinst's reload moved the main process"
    );
    assert_eq!(version_in(&ns).as_deref(), Some("0.1.0+upgrade"));
    ns.wait_for_state(UNIT, "active/running", Duration::from_secs(5));
    let second = third;

    // kill -9 of the main process: Restart= starts a new one.
    ns.run_ok(&["kill", "-9", &second.to_string()]);
    assert!(
        systemd_harness::wait_until(Duration::from_secs(60), || {
            let pid = ns.main_pid(UNIT);
            pid != 0 && pid != second && ns.show(UNIT, "SubState") == "running"
        }),
        "not restarted:\n{}",
        ns.journal_text(UNIT)
    );

    // systemctl stop drains: the desktop hears `drain`, then 4503.
    let desktop = place(&ns, 1).remove(0);
    let mut control = in_netns(Some(&netns), move || {
        let (stream, rest) =
            client::connect(WS, "/v1/host/control", Some(&desktop.token)).expect("upgrade");
        let mut control = Blocking::new(stream, rest);
        control
            .send_json(
                json!({"type":"host-hello","v":1,"relayHostId":desktop.relay_host_id,
                "assignmentEpoch":desktop.epoch}),
            )
            .unwrap();
        assert_eq!(control.json().unwrap()["type"], "host-hello-ack");
        control
    });
    ns.systemctl_ok(&["stop", UNIT]);
    let mut saw_drain = false;
    let code = loop {
        match control.frame() {
            Ok((_, OP_CLOSE, payload)) => break u16::from_be_bytes([payload[0], payload[1]]),
            Ok((_, _, payload)) => {
                saw_drain |= String::from_utf8_lossy(&payload).contains("\"drain\"");
            }
            Err(e) => panic!("no close frame: {e}"),
        }
    };
    assert!(saw_drain, "a drain frame first");
    assert_eq!(code, 4503);
    ns.wait_for_state(UNIT, "inactive/dead", Duration::from_secs(10));
    assert_eq!(ns.show(UNIT, "ExecMainStatus"), "0");
    eprintln!("{finished:?}");
}

/// The optional socket units: systemd holds both listeners and passes them by name; the
/// first connection starts the cell; a restart refuses nobody (`/health` asked every 50 ms
/// through it never fails); a reload hands the systemd-held listeners over like its own.
#[test]
fn the_socket_units_hold_the_listeners_through_restarts_and_reloads() {
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let ns = Namespace::boot("handover-sockets");
    install(&ns);
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    for socket in ["orca-relay-cell-ws.socket", "orca-relay-cell-http.socket"] {
        ns.add_unit(
            socket,
            &std::fs::read_to_string(root.join("systemd").join(socket)).unwrap(),
        );
        ns.systemctl_ok(&["start", socket]);
    }
    assert_eq!(ns.show(UNIT, "ActiveState"), "inactive");
    let netns = netns(&ns);
    // The first request starts the cell (socket activation) and is answered.
    let (status, _) = in_netns(Some(&netns), || {
        let mut status = (0, String::new());
        systemd_harness::wait_until(Duration::from_secs(60), || {
            status = ureq::get(&format!("http://{HTTP}/health"))
                .timeout(Duration::from_secs(30))
                .call()
                .map(|r| (r.status(), String::new()))
                .unwrap_or((0, String::new()));
            status.0 == 200
        });
        status
    });
    assert_eq!(status, 200);
    ns.wait_for_state(UNIT, "active/running", Duration::from_secs(30));
    ns.wait_for_entry(UNIT, Duration::from_secs(10), |entry| {
        entry
            .message
            .contains("orca_relay_listeners_from_systemd ws=true http=true")
    });
    let desktop = place(&ns, 1).remove(0);
    let mut control = in_netns(Some(&netns), move || {
        let (stream, rest) =
            client::connect(WS, "/v1/host/control", Some(&desktop.token)).expect("upgrade");
        let mut control = Blocking::new(stream, rest);
        control
            .send_json(
                json!({"type":"host-hello","v":1,"relayHostId":desktop.relay_host_id,
                "assignmentEpoch":desktop.epoch}),
            )
            .unwrap();
        assert_eq!(control.json().unwrap()["type"], "host-hello-ack");
        control
    });
    // A restart drains the control, but the listeners stay open: no request is refused.
    let poller = Poller::start_in(HTTP, Some(&netns));
    let before = ns.main_pid(UNIT);
    ns.systemctl_ok(&["restart", UNIT]);
    ns.wait_for_state(UNIT, "active/running", Duration::from_secs(30));
    assert_ne!(ns.main_pid(UNIT), before);
    orca_relay::clock::sleep(Duration::from_secs(1));
    let (asked, failures) = poller.stop();
    assert!(asked > 0);
    // `/ready` says 503 while the old process drains and the new one starts; what must not
    // happen is a request refused or left unanswered.
    let unanswered: Vec<&String> = failures
        .iter()
        .filter(|failure| !failure.ends_with(" 503"))
        .collect();
    assert!(
        unanswered.is_empty(),
        "{} of {asked} requests unanswered through a restart: {unanswered:?}",
        unanswered.len()
    );
    assert!(
        !failures.iter().any(|f| f.starts_with("/health")),
        "{failures:?}"
    );
    let code = loop {
        match control.frame() {
            Ok((_, OP_CLOSE, payload)) => break u16::from_be_bytes([payload[0], payload[1]]),
            Ok(_) => continue,
            Err(e) => panic!("no close frame: {e}"),
        }
    };
    assert_eq!(code, 4503, "a restart still drains");
    // A reload hands the systemd-held listeners over with the connections.
    let desktop = place(&ns, 1).remove(0);
    let mut control = in_netns(Some(&netns), move || {
        let (stream, rest) =
            client::connect(WS, "/v1/host/control", Some(&desktop.token)).expect("upgrade");
        let mut control = Blocking::new(stream, rest);
        control
            .send_json(
                json!({"type":"host-hello","v":1,"relayHostId":desktop.relay_host_id,
                "assignmentEpoch":desktop.epoch}),
            )
            .unwrap();
        assert_eq!(control.json().unwrap()["type"], "host-hello-ack");
        control
    });
    let pid = ns.main_pid(UNIT);
    let reload = ns.systemctl(&["reload", UNIT]);
    assert!(
        reload.status.success(),
        "{reload:?}\n{}",
        ns.journal_text(UNIT)
    );
    assert_ne!(ns.main_pid(UNIT), pid);
    control
        .send_json(json!({"type":"invite-create","reqId":"after"}))
        .unwrap();
    assert_eq!(control.json().unwrap()["type"], "invite-created");
}

/// The load's own process (`handover_kit::remote`): nothing unless started as one.
#[test]
fn load_helper() {
    handover_kit::remote::helper_main();
}
