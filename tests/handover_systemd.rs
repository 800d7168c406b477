//! Live handover under a real systemd (issues 23 and 31): the shipped `orca-relay-cell.service`,
//! unchanged, runs the combined role on SQLite in a private namespace whose PID 1 is systemd
//! 252 (`tests/systemd_harness`).
//!
//! The load tests install the binary under test as the package does: a copy at
//! `/usr/bin/orca-relay` inside the namespace (replaced by rename, as dpkg does, for an
//! "upgrade" to the next build). Never a link into the build tree: the unit's `PrivateTmp=yes`
//! hides `/tmp`, so a link into a clone under `/tmp` pointed at nothing and the unit could not
//! start. `systemctl start` reaches active through `READY=1`; under the load,
//! `systemctl reload` runs `orca-relay handover` (`ExecReload=`): nothing closed or lost, no
//! stream paused a second, `/ready` and `/health` always 200, `MainPID` becomes the next process
//! and its watchdog pings are the ones systemd hears; `kill -9` of the main process is restarted
//! by `Restart=`; `systemctl stop` drains with 4503.
//!
//! The stop tests install the package as built (`systemd_harness::deb`, dpkg and its
//! maintainer scripts): after a reload, after three, after an upgrade by `dpkg -i` of a second
//! build (whose postinst reloads), `systemctl stop` and `restart` drain every desktop (`drain`,
//! then 4503) and the unit ends inactive, not failed. Before issue 31 the next process was the
//! `handover` command's child, systemd logged "Supervising process N which is not our child"
//! and on stop sent SIGKILL within a millisecond of SIGTERM: no drain, `Result: signal`.

mod handover_kit;
mod harness;
mod systemd_harness;

use std::path::{Path, PathBuf};
use std::time::Duration;

use handover_kit::client::{self, Blocking, OP_CLOSE};
use handover_kit::load::{Identity, Spec};
use handover_kit::remote::RemoteLoad;
use handover_kit::{build_with_note, in_netns, Poller};
use harness::{host_id, token, TempDir};
use serde_json::json;
use systemd_harness::{package, Namespace};

const UNIT: &str = "orca-relay-cell.service";

/// The two scenarios take turns: the load's stall figure is the relay's, not a neighbour
/// restarting a relay of its own beside it on two cores.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());
const WS: &str = "127.0.0.1:8080";
const HTTP: &str = "127.0.0.1:8081";

/// The binary under test installed as `/usr/bin/orca-relay` inside the namespace, as the
/// package installs it: a copy (written beside it, then renamed over it, as dpkg does), never a
/// link into the build tree, which the unit's `PrivateTmp=` hides when the tree is under `/tmp`.
fn point_binary_at(ns: &Namespace, binary: &Path) {
    let installed = ns.path("/usr/bin/orca-relay");
    let unpacked = ns.path("/usr/bin/orca-relay.dpkg-new");
    std::fs::copy(binary, &unpacked).expect("copy the binary into the namespace");
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&unpacked, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    std::fs::rename(&unpacked, &installed).expect("install /usr/bin/orca-relay");
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
    configure(ns);
    ns.add_unit(
        UNIT,
        &std::fs::read_to_string(root.join("systemd/orca-relay-cell.service")).unwrap(),
    );
}

/// The package as built (dpkg, its maintainer scripts included), the cell unit linked where an
/// operator's units live, and the operator's env file.
fn install_package(ns: &Namespace, deb: &Path) {
    ns.install_deb(deb);
    ns.link_unit(&format!("/lib/systemd/system/{UNIT}"));
    configure(ns);
}

/// The env file: the shipped one, with what an operator of a combined relay fills in.
fn configure(ns: &Namespace) {
    package::configure_combined(ns);
    ns.set_env_values(
        package::CELL_ENV,
        &[
            ("ORCA_RELAY_PING_MS", "2000"),
            ("ORCA_RELAY_WEDGE_MS", "60000"),
            ("ORCA_RELAY_CONNECTION_CAP", "5000"),
            ("ORCA_RELAY_DRAIN_GRACE_MS", "2000"),
            ("ORCA_RELAY_SPLICE_WORKERS", "2"),
        ],
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
        handover_kit::connect_control(WS, &desktop)
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
        handover_kit::connect_control(WS, &desktop)
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
        handover_kit::connect_control(WS, &desktop)
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

// ---------------------------------------------------------------------------------------------
// Stop and restart after reloads (issue 31): the package as built.

/// `count` desktops with their controls open (placed, upgraded, hello acknowledged).
fn desktops(ns: &Namespace, count: usize) -> Vec<Blocking> {
    let placed = place(ns, count);
    in_netns(Some(&netns(ns)), move || {
        placed
            .into_iter()
            .map(|desktop| {
                let (stream, rest) =
                    client::connect(WS, "/v1/host/control", Some(&desktop.token)).expect("upgrade");
                stream
                    .set_read_timeout(Some(Duration::from_secs(20)))
                    .unwrap();
                let mut control = Blocking::new(stream, rest);
                control
                    .send_json(json!({"type":"host-hello","v":1,
                        "relayHostId":desktop.relay_host_id,"assignmentEpoch":desktop.epoch}))
                    .unwrap();
                assert_eq!(control.json().unwrap()["type"], "host-hello-ack");
                control
            })
            .collect()
    })
}

/// What each desktop heard until its control closed: a `drain`, then which close code (`None`:
/// the connection ended without a close frame).
fn heard(controls: Vec<Blocking>) -> Vec<(bool, Option<u16>)> {
    controls
        .into_iter()
        .map(|mut control| {
            let mut saw_drain = false;
            loop {
                match control.frame() {
                    Ok((_, OP_CLOSE, payload)) if payload.len() >= 2 => {
                        break (
                            saw_drain,
                            Some(u16::from_be_bytes([payload[0], payload[1]])),
                        )
                    }
                    Ok((_, OP_CLOSE, _)) => break (saw_drain, None),
                    Ok((_, _, payload)) => {
                        saw_drain |= String::from_utf8_lossy(&payload).contains("\"drain\"");
                    }
                    Err(_) => break (saw_drain, None),
                }
            }
        })
        .collect()
}

/// How many times systemd said it supervises a process that is not its child.
fn aliens(ns: &Namespace) -> usize {
    ns.journal_text(UNIT).matches("not our child").count()
}

/// Reloads `times` times, each moving the main process (the reload succeeds, MainPID changes).
fn reload(ns: &Namespace, times: usize) {
    for round in 1..=times {
        let before = ns.main_pid(UNIT);
        let reload = ns.systemctl(&["reload", UNIT]);
        assert!(
            reload.status.success(),
            "reload {round}: {reload:?}\n{}",
            ns.journal_text(UNIT)
        );
        assert_ne!(
            ns.main_pid(UNIT),
            before,
            "reload {round} moved the main process"
        );
        ns.wait_for_state(UNIT, "active/running", Duration::from_secs(10));
    }
}

/// The problems of one stop or restart: a desktop that did not hear `drain` then 4503, a unit
/// that ended failed (or, after a restart, not running again), systemd supervising a process
/// that is not its child.
fn judge(
    ns: &Namespace,
    what: &str,
    heard: &[(bool, Option<u16>)],
    restarted: bool,
    aliens_before: usize,
) -> Vec<String> {
    let mut problems = Vec::new();
    let drained = heard
        .iter()
        .filter(|(drain, close)| *drain && *close == Some(4503))
        .count();
    if drained != heard.len() {
        problems.push(format!(
            "{what}: {drained} of {} desktops heard drain then 4503: {heard:?}",
            heard.len()
        ));
    }
    if restarted {
        ns.wait_for_state(UNIT, "active/running", Duration::from_secs(30));
    } else {
        let state = format!(
            "{}/{}",
            ns.show(UNIT, "ActiveState"),
            ns.show(UNIT, "SubState")
        );
        if state != "inactive/dead" {
            problems.push(format!("{what}: the unit ended {state}"));
        }
    }
    let result = ns.show(UNIT, "Result");
    if result != "success" {
        problems.push(format!("{what}: Result={result}"));
    }
    if aliens(ns) > aliens_before {
        problems.push(format!(
            "{what}: systemd supervised a process that is not its child"
        ));
    }
    problems
}

/// After one reload, after three, `systemctl stop` drains every desktop and the unit ends
/// inactive (not failed); after a reload, `systemctl restart` drains them too and the unit
/// runs again. Before: SIGKILL within a millisecond of the SIGTERM, no `drain`, no 4503, the
/// unit `failed (Result: signal)`.
#[test]
fn stop_and_restart_after_reloads_drain_every_desktop() {
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let ns = Namespace::boot("handover-stop");
    install_package(&ns, &systemd_harness::deb::deb());
    let mut problems = Vec::new();
    for (what, reloads, restart) in [
        ("stop after a reload", 1, false),
        ("stop after three reloads", 3, false),
        ("restart after a reload", 1, true),
    ] {
        ns.systemctl_ok(&["start", UNIT]);
        ns.wait_for_state(UNIT, "active/running", Duration::from_secs(30));
        let controls = desktops(&ns, 5);
        let aliens_before = aliens(&ns);
        reload(&ns, reloads);
        let before = ns.main_pid(UNIT);
        let stop = ns.systemctl(&[if restart { "restart" } else { "stop" }, UNIT]);
        if !stop.status.success() {
            problems.push(format!("{what}: {stop:?}"));
        }
        problems.extend(judge(&ns, what, &heard(controls), restart, aliens_before));
        if restart {
            assert_ne!(ns.main_pid(UNIT), before);
            ns.systemctl_ok(&["stop", UNIT]);
        }
    }
    assert!(
        problems.is_empty(),
        "{}\n{}",
        problems.join("\n"),
        ns.journal_text(UNIT)
    );
}

/// An upgrade by `dpkg -i` of a second build of the package (the postinst reloads: a live
/// handover to the new binary), then `systemctl stop`: every desktop drains, the unit ends
/// inactive. Before: as after any reload, SIGKILL and `failed (Result: signal)`, after every
/// upgrade.
#[test]
fn stop_after_an_upgrade_by_dpkg_drains_every_desktop() {
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let deb = systemd_harness::deb::deb();
    let ns = Namespace::boot("handover-upgrade");
    install_package(&ns, &deb);
    ns.systemctl_ok(&["start", UNIT]);
    ns.wait_for_state(UNIT, "active/running", Duration::from_secs(30));
    let version = version_in(&ns).expect("the served version");
    let controls = desktops(&ns, 5);
    let before = ns.main_pid(UNIT);
    let aliens_before = aliens(&ns);
    let builds = TempDir::new("debs");
    let upgrade = systemd_harness::deb::upgraded(&deb, "upgrade", &builds.0);
    let dpkg = ns.install_deb(&upgrade);
    assert_ne!(
        ns.main_pid(UNIT),
        before,
        "the postinst's reload moved the main process:\n{dpkg}\n{}",
        ns.journal_text(UNIT)
    );
    assert_eq!(
        version_in(&ns),
        Some(format!("{version}+upgrade")),
        "the new build serves"
    );
    ns.wait_for_state(UNIT, "active/running", Duration::from_secs(10));
    let stop = ns.systemctl(&["stop", UNIT]);
    let mut problems = Vec::new();
    if !stop.status.success() {
        problems.push(format!("stop after the upgrade: {stop:?}"));
    }
    problems.extend(judge(
        &ns,
        "stop after the upgrade",
        &heard(controls),
        false,
        aliens_before,
    ));
    assert!(
        problems.is_empty(),
        "{}\n{}",
        problems.join("\n"),
        ns.journal_text(UNIT)
    );
}

/// The load's own process (`handover_kit::remote`): nothing unless started as one.
#[test]
fn load_helper() {
    handover_kit::remote::helper_main();
}
