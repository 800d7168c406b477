//! Crash survival under a real systemd (SPEC §13): the shipped `orca-relay-cell.service`,
//! unchanged (its `FileDescriptorStoreMax=`, `Restart=on-failure`, `RestartSec=`), runs the
//! combined role on SQLite with `/usr/bin/orca-relay` a copy of the binary under test, in a
//! private namespace whose PID 1 is systemd 252 (`tests/systemd_harness`).
//!
//! A thousand desktop controls answering pings and a hundred pairs streaming sequence-numbered
//! messages both ways; the main process is killed with `kill -9` ten times in a row. After each
//! kill: systemd restarts it, every control is answered again by the new process (its next
//! ping), every stream goes on with every message once, in order, byte-exact, and whatever was
//! not resumed got 1012; `NRestarts` counts the kills; the descriptor store holds exactly the live
//! connections (plus both listeners and the region), before and after 200 of them close.

mod handover_kit;
mod harness;
mod systemd_harness;

use std::path::{Path, PathBuf};
use std::time::Duration;

use handover_kit::client::{self, Blocking, OP_CLOSE};
use handover_kit::in_netns;
use handover_kit::load::{Identity, Spec};
use handover_kit::remote::RemoteLoad;
use harness::{host_id, token, TEST_KEY};
use serde_json::json;
use systemd_harness::Namespace;

const UNIT: &str = "orca-relay-cell.service";
const WS: &str = "127.0.0.1:8080";
const HTTP: &str = "127.0.0.1:8081";
const CONTROLS: usize = 1_000;
const PAIRS: usize = 100;
const KILLS: usize = 10;

/// The user, the binary (copied into the namespace's `/usr/bin`, as the package installs it), the
/// shipped env file with what an operator of a combined relay fills in, and the shipped unit.
fn install(ns: &Namespace) {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    ns.write(
        "/usr/lib/sysusers.d/orca-relay.conf",
        &std::fs::read_to_string(root.join("packaging/orca-relay.sysusers.conf")).unwrap(),
    );
    ns.run_ok(&["systemd-sysusers"]);
    let target = ns.path("/usr/bin/orca-relay");
    let _ = std::fs::remove_file(&target);
    std::fs::copy(env!("CARGO_BIN_EXE_orca-relay"), &target).expect("install the binary");
    std::fs::create_dir_all(ns.path("/etc/orca-relay")).unwrap();
    let shipped = std::fs::read_to_string(root.join("packaging/cell.env")).unwrap();
    let operator = format!(
        "{shipped}\n# The test's operator: a combined relay on this machine.\n\
         ORCA_RELAY_ROLE=combined\nDATABASE_URL=\nORCA_RELAY_CELL_ID=combined\nORCA_RELAY_WS_ADDR={WS}\n\
         ORCA_RELAY_HTTP_ADDR={HTTP}\nORCA_RELAY_CELL_URL=ws://{WS}\nORCA_RELAY_DIRECTOR_URLS=\n\
         ORCA_RELAY_SELF_HOSTED_KEY={TEST_KEY}\nORCA_RELAY_PING_MS=1000\n\
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

/// Stored descriptors in the unit's store.
fn stored(ns: &Namespace) -> usize {
    ns.show(UNIT, "NFileDescriptorStore").parse().unwrap_or(0)
}

/// Open WebSocket connections by the relay's own gauge.
fn live_connections(ns: &Namespace) -> usize {
    in_netns(Some(&netns(ns)), || {
        ["control", "phone", "data"]
            .iter()
            .map(|kind| {
                handover_kit::metric(HTTP, &format!("orca_relay_connections{{kind=\"{kind}\"}}"))
                    .unwrap_or(0.0) as usize
            })
            .sum()
    })
}

/// Connections the restarts shut down with half a frame on the wire (their `cut=`), in all.
fn cut_in_journal(ns: &Namespace) -> usize {
    ns.journal(UNIT)
        .iter()
        .filter(|entry| entry.message.contains("orca_relay_crash_resumed"))
        .filter_map(|entry| harness::field(&entry.message, "cut")?.parse::<usize>().ok())
        .sum()
}

/// A control connected apart from the load (closed by the test itself).
fn connect_control(ns: &Namespace, desktop: Identity) -> Blocking {
    in_netns(Some(&netns(ns)), move || {
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
    })
}

#[test]
fn kill_9_ten_times_costs_the_desktops_a_pause_not_a_redial() {
    handover_kit::raise_fd_limit();
    let ns = Namespace::boot("crash");
    install(&ns);
    ns.systemctl_ok(&["start", UNIT]);
    ns.wait_for_state(UNIT, "active/running", Duration::from_secs(30));
    let netns = netns(&ns);

    let identities = place(&ns, CONTROLS);
    let mut spec = Spec::new(CONTROLS, PAIRS);
    spec.netns = Some(netns.clone());
    let mut load = RemoteLoad::start("load_helper", WS, spec, identities);
    orca_relay::clock::sleep(Duration::from_secs(2));
    // Everything admitted is kept: the connections, both listeners, the region.
    let expected = CONTROLS + 2 * PAIRS;
    assert!(
        systemd_harness::wait_until(Duration::from_secs(30), || stored(&ns) == expected + 3),
        "stored {} for {expected} connections:\n{}",
        stored(&ns),
        ns.journal_text(UNIT)
    );

    let mut closed_so_far = 0;
    for kill in 1..=KILLS {
        let before = ns.main_pid(UNIT);
        load.mark();
        ns.run_ok(&["kill", "-9", &before.to_string()]);
        assert!(
            systemd_harness::wait_until(Duration::from_secs(30), || {
                let pid = ns.main_pid(UNIT);
                pid != 0 && pid != before && ns.show(UNIT, "SubState") == "running"
            }),
            "kill {kill}: not restarted:\n{}",
            ns.journal_text(UNIT)
        );
        assert_eq!(ns.show(UNIT, "NRestarts"), kill.to_string(), "kill {kill}");
        ns.wait_for_entry(UNIT, Duration::from_secs(30), |entry| {
            entry.message.contains("orca_relay_crash_resumed")
        });
        let report = load.report();
        let closed = report.closed.len();
        // Every control still open hears the new process's ping and answers it.
        let open_controls = CONTROLS
            - report
                .closed
                .iter()
                .filter(|c| c.starts_with("control"))
                .count();
        assert!(
            systemd_harness::wait_until(Duration::from_secs(20), || {
                load.report().pinged_since_mark >= open_controls
            }),
            "kill {kill}: {:?}\n{}",
            load.report(),
            ns.journal_text(UNIT)
        );
        // What was not resumed got 1012, but a leg that had half a frame on the wire at the
        // kill (no close frame may follow it: its client sees the connection end): as many of
        // those as the relay counted `cut`.
        let ended = report
            .closed
            .iter()
            .filter(|c| !c.ends_with("closed 1012"))
            .count();
        assert_eq!(
            ended,
            cut_in_journal(&ns),
            "kill {kill}: {:?}\n{}",
            report.closed,
            ns.journal_text(UNIT)
        );
        assert!(report.violations.is_empty(), "{:?}", report.violations);
        closed_so_far = closed;
        eprintln!("kill {kill}: {closed} closed 1012 in all");
    }
    // Idle controls are kept (a control closed at a kill was one the relay was writing to or
    // reading from at that very moment).
    assert!(
        closed_so_far * 100 <= (CONTROLS + 2 * PAIRS) * KILLS,
        "{closed_so_far} closed over {KILLS} kills"
    );
    // The store holds what lives, and nothing of what closed (1012 and all).
    assert!(
        systemd_harness::wait_until(Duration::from_secs(20), || {
            stored(&ns) == live_connections(&ns) + 3
        }),
        "stored {} for {} live connections",
        stored(&ns),
        live_connections(&ns)
    );

    // 200 closes: the store follows.
    let extra = place(&ns, 200);
    let controls: Vec<Blocking> = extra.into_iter().map(|d| connect_control(&ns, d)).collect();
    let with_extra = live_connections(&ns);
    assert!(systemd_harness::wait_until(Duration::from_secs(20), || {
        stored(&ns) == with_extra + 3
    }));
    for mut control in controls {
        let mut close = Vec::new();
        client::encode(
            &mut close,
            true,
            OP_CLOSE,
            &1000u16.to_be_bytes(),
            [1, 2, 3, 4],
        );
        control.send(&close).ok();
        // Until the relay's answer (or the end).
        while let Ok((_, opcode, _)) = control.frame() {
            if opcode == OP_CLOSE {
                break;
            }
        }
    }
    assert!(
        systemd_harness::wait_until(Duration::from_secs(20), || {
            stored(&ns) == live_connections(&ns) + 3 && live_connections(&ns) + 200 == with_extra
        }),
        "after 200 closes: stored {}, live {}",
        stored(&ns),
        live_connections(&ns)
    );

    let finished = load.finish(Duration::from_secs(60));
    assert!(finished.violations.is_empty(), "{:?}", finished.violations);
    assert_eq!(
        finished
            .closed
            .iter()
            .filter(|c| !c.ends_with("closed 1012"))
            .count(),
        cut_in_journal(&ns),
        "{:?}",
        finished.closed
    );
    // A stop still drains: what is left hears 4503 (the load finished: a control of our own).
    let desktop = place(&ns, 1).remove(0);
    let mut control = connect_control(&ns, desktop);
    ns.systemctl_ok(&["stop", UNIT]);
    let code = loop {
        match control.frame() {
            Ok((_, OP_CLOSE, payload)) => break u16::from_be_bytes([payload[0], payload[1]]),
            Ok(_) => continue,
            Err(e) => panic!("no close frame: {e}"),
        }
    };
    assert_eq!(code, 4503);
    ns.wait_for_state(UNIT, "inactive/dead", Duration::from_secs(10));
    eprintln!("{finished:?}");
}

/// The load's own process (`handover_kit::remote`): nothing unless started as one.
#[test]
fn load_helper() {
    handover_kit::remote::helper_main();
}
