//! Crash survival under a real systemd (SPEC §13): the shipped `orca-relay-cell.service`,
//! unchanged (its `FileDescriptorStoreMax=`, `Restart=on-failure`, `RestartSec=`), in a private
//! namespace whose PID 1 is systemd 252 (`tests/systemd_harness`), twice:
//! - **combined**: the combined role on SQLite, `/usr/bin/orca-relay` a copy of the binary
//!   under test;
//! - **cell**: the package as built (`.deb` installed with dpkg), a director and a cell on
//!   PostgreSQL (a server inside the namespace), desktop tokens checked against a JWKS.
//!
//! Each time, a thousand desktop controls answering pings (placed through `POST /v1/assign`)
//! and a hundred pairs streaming sequence-numbered messages both ways; the main process is
//! killed with `kill -9` ten times in a row. After each kill ([`survive_ten_kills`]): systemd
//! restarts it (`NRestarts` counts the kills), its `orca_relay_crash_resumed` line resumed
//! exactly the controls and pairs the load still has open, every one of them is answered by the
//! new process (a ping heard, every stream moving, every message once, in order, byte-exact),
//! no desktop said hello again (`orca_relay_admissions_total` of the new process is 0: no
//! redial), whatever was not resumed got 1012 (or, with half a frame on the wire, was cut, as
//! many as the relay counted), the relay's own gauge is back to every open connection and the
//! descriptor store holds exactly those (plus both listeners and the region). Then 200 more
//! desktops connect and close (the store follows), and a stop still drains (4503). The cell
//! also stays the director's one live cell, registered once per start, its feed counting the
//! resumed desktops as seated.
//!
//! The two take turns (a lock): each measures its own relay, not the other's load.

mod handover_kit;
mod harness;
mod systemd_harness;

use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Duration;

use handover_kit::client::{self, Blocking, OP_CLOSE};
use handover_kit::in_netns;
use handover_kit::load::{Identity, Report, Spec};
use handover_kit::remote::RemoteLoad;
use harness::SERVICE_TOKEN;
use serde_json::Value;
use systemd_harness::package::{self, CELL, CELL_ENV, CELL_HTTP_ADDR, DIRECTOR, HTTP_ADDR};
use systemd_harness::Namespace;

const UNIT: &str = CELL;
const WS: &str = package::WS_ADDR;
const CONTROLS: usize = 1_000;
const PAIRS: usize = 100;
const KILLS: usize = 10;
/// Desktops that connect and close after the kills.
const CHURN: usize = 200;
/// Both listeners and the region: what the store holds besides connections.
const STORED_BESIDES: usize = 3;
/// How long a step may take on a loaded machine (a restart, every control pinged again).
const STEP: Duration = Duration::from_secs(30);

/// What both relays' env files set besides their role: pings every second (each kill is
/// judged on the next one), a cap above the load, a short drain, two splice workers.
const TUNING: &[(&str, &str)] = &[
    ("ORCA_RELAY_PING_MS", "1000"),
    ("ORCA_RELAY_WEDGE_MS", "60000"),
    ("ORCA_RELAY_CONNECTION_CAP", "5000"),
    ("ORCA_RELAY_DRAIN_GRACE_MS", "2000"),
    ("ORCA_RELAY_SPLICE_WORKERS", "2"),
];

/// One test at a time.
static TURN: Mutex<()> = Mutex::new(());

/// The relay under test: the cell unit in its namespace.
struct Relay<'a> {
    ns: &'a Namespace,
    /// The relay's own HTTP listener (its `/metrics`).
    http: &'static str,
    /// Where desktops ask to be placed (`POST /v1/assign`).
    director: &'static str,
    /// Tokens the director and the relay accept.
    mint: fn(&str, &str) -> String,
}

/// What one restart's `orca_relay_crash_resumed` line says.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
struct Resumed {
    controls: usize,
    pairs: usize,
    closed: usize,
    cut: usize,
}

impl Relay<'_> {
    fn netns(&self) -> PathBuf {
        PathBuf::from(format!("/proc/{}/ns/net", self.ns.pid1()))
    }

    /// `count` desktops placed by the director, from inside the namespace.
    fn place(&self, count: usize) -> Vec<Identity> {
        handover_kit::place_desktops_with(Some(&self.netns()), self.director, count, self.mint)
    }

    /// Stored descriptors in the unit's store.
    fn stored(&self) -> usize {
        self.ns
            .show(UNIT, "NFileDescriptorStore")
            .parse()
            .unwrap_or(0)
    }

    /// A metric of the relay, summed over its labels (`None`: no answer).
    fn metric_sum(&self, name: &'static str) -> Option<usize> {
        let http = self.http;
        in_netns(Some(&self.netns()), move || {
            handover_kit::metric_sum(http, name).map(|value| value as usize)
        })
    }

    /// Open WebSocket connections by the relay's own gauge.
    fn live_connections(&self) -> usize {
        self.metric_sum("orca_relay_connections").unwrap_or(0)
    }

    /// Every restart's line, in order.
    fn resumed(&self) -> Vec<Resumed> {
        let count = |message: &str, key: &str| {
            harness::field(message, key)
                .and_then(|value| value.parse().ok())
                .unwrap_or(0)
        };
        self.ns
            .journal(UNIT)
            .iter()
            .filter(|entry| entry.message.contains("orca_relay_crash_resumed"))
            .map(|entry| Resumed {
                controls: count(&entry.message, "controls"),
                pairs: count(&entry.message, "pairs"),
                closed: count(&entry.message, "closed"),
                cut: count(&entry.message, "cut"),
            })
            .collect()
    }

    /// Connections the restarts shut down with half a frame on the wire (their `cut=`), in all.
    fn cut_in_journal(&self) -> usize {
        self.resumed().iter().map(|resumed| resumed.cut).sum()
    }

    /// A control connected apart from the load (closed by the test itself). A 503 is tried
    /// again, as a desktop does: a cell in `db` mode sheds a hello while its database pool has
    /// waiters (SPEC §5.3), as it may while a thousand desktops leave at once.
    fn connect_control(&self, desktop: Identity) -> Blocking {
        let http = self.http;
        let (control, refused, refusals) = in_netns(Some(&self.netns()), move || {
            let mut refused = 0;
            let mut refusals = Vec::new();
            let deadline = harness::now_instant() + STEP;
            loop {
                match handover_kit::try_connect_control(WS, &desktop) {
                    Ok(control) => return (Ok(control), refused, refusals),
                    Err(503) if harness::now_instant() < deadline => {
                        refused += 1;
                        if refused == 1 {
                            refusals = handover_kit::metric_lines(
                                http,
                                "orca_relay_upgrades_refused_total",
                            );
                        }
                        orca_relay::clock::sleep(Duration::from_millis(100));
                    }
                    Err(status) => return (Err(status), refused, refusals),
                }
            }
        });
        if refused > 0 {
            eprintln!(
                "a desktop got 503 {refused} times (NRestarts {}): {refusals:?}",
                self.ns.show(UNIT, "NRestarts")
            );
        }
        control.unwrap_or_else(|status| panic!("upgrade: {status} (after {refused} 503s)"))
    }
}

/// What the load still has open: (controls, pairs), a pair being open while both its legs are.
fn still_open(report: &Report) -> (usize, usize) {
    let closed_controls = report
        .closed
        .iter()
        .filter(|c| c.starts_with("control "))
        .count();
    let mut closed_pairs: Vec<&str> = report
        .closed
        .iter()
        .filter_map(|c| c.split_once(" leg of pair ")?.1.split(':').next())
        .collect();
    closed_pairs.sort_unstable();
    closed_pairs.dedup();
    (CONTROLS - closed_controls, PAIRS - closed_pairs.len())
}

/// Legs and controls that ended without a close frame: what the relay counted as `cut`.
fn ended_without_close(report: &Report) -> usize {
    report
        .closed
        .iter()
        .filter(|c| !c.ends_with("closed 1012"))
        .count()
}

/// The relay's unit started (its env file configured for its role, plus [`TUNING`]), the load
/// on it, ten `kill -9`s, the churn and the drain (see the module header).
/// `after_kill(kill, open_controls)` checks what else the role promises once the restarted
/// process has resumed everything.
fn survive_ten_kills(relay: &Relay, mut after_kill: impl FnMut(usize, usize)) {
    let ns = relay.ns;
    let journal = || ns.journal_text(UNIT);
    ns.set_env_values(CELL_ENV, TUNING);
    ns.systemctl_ok(&["start", UNIT]);
    ns.wait_for_state(UNIT, "active/running", STEP);
    let identities = relay.place(CONTROLS);
    let mut spec = Spec::new(CONTROLS, PAIRS);
    spec.netns = Some(relay.netns());
    let mut load = RemoteLoad::start("load_helper", WS, spec, identities);
    // The load runs: every control pinged, every stream moving, nothing closed.
    load.mark();
    let report = handover_kit::served(|| load.report(), 2 * PAIRS, STEP);
    assert!(
        report.pinged_since_mark >= CONTROLS
            && report.streams_flowing_since_mark >= 2 * PAIRS
            && report.closed.is_empty(),
        "the load did not start: {report:?}"
    );
    // Everything admitted is kept.
    let expected = CONTROLS + 2 * PAIRS;
    assert!(
        systemd_harness::wait_until(STEP, || relay.stored() == expected + STORED_BESIDES),
        "stored {} for {expected} connections:\n{}",
        relay.stored(),
        journal()
    );

    for kill in 1..=KILLS {
        let before = ns.main_pid(UNIT);
        ns.run_ok(&["kill", "-9", &before.to_string()]);
        assert!(
            systemd_harness::wait_until(STEP, || {
                let pid = ns.main_pid(UNIT);
                pid != 0 && pid != before && ns.show(UNIT, "SubState") == "running"
            }),
            "kill {kill}: not restarted:\n{}",
            journal()
        );
        assert_eq!(ns.show(UNIT, "NRestarts"), kill.to_string(), "kill {kill}");
        let mut resumed = Vec::new();
        assert!(
            systemd_harness::wait_until(STEP, || {
                resumed = relay.resumed();
                resumed.len() == kill
            }),
            "kill {kill}: {resumed:?}\n{}",
            journal()
        );
        // From here on every ping and message comes from the new process (the old one died at
        // least `RestartSec=500ms` ago; what it wrote was read long since).
        load.mark();
        // Every connection the restart did not resume reached the load as closed, and nothing
        // else closed.
        let gone: usize = resumed.iter().map(|r| r.closed + r.cut).sum();
        let mut report = load.report();
        assert!(
            systemd_harness::wait_until(STEP, || {
                report = load.report();
                report.closed.len() >= gone
            }),
            "kill {kill}: the relay closed {gone}, the load saw {:?}",
            report.closed
        );
        assert_eq!(
            report.closed.len(),
            gone,
            "kill {kill}: {:?}",
            report.closed
        );
        // Exactly what the load still has open was resumed.
        let (open_controls, open_pairs) = still_open(&report);
        let this = resumed[kill - 1];
        assert_eq!(
            (this.controls, this.pairs),
            (open_controls, open_pairs),
            "kill {kill}: {this:?}, the load has {:?} closed",
            report.closed
        );
        // Every one of them is answered by the new process.
        assert!(
            systemd_harness::wait_until(STEP, || {
                report = load.report();
                report.pinged_since_mark >= open_controls
                    && report.streams_flowing_since_mark >= 2 * open_pairs
            }),
            "kill {kill}: {report:?}\n{}",
            journal()
        );
        assert!(report.violations.is_empty(), "{:?}", report.violations);
        // Nothing redialed: no desktop said hello to the new process.
        let mut admissions = None;
        systemd_harness::wait_until(STEP, || {
            admissions = relay.metric_sum("orca_relay_admissions_total");
            admissions.is_some()
        });
        assert_eq!(admissions, Some(0), "kill {kill}");
        // What was not resumed got 1012, but a leg that had half a frame on the wire at the
        // kill (no close frame may follow it: its client sees the connection end): as many of
        // those as the relay counted `cut`.
        assert_eq!(
            ended_without_close(&report),
            relay.cut_in_journal(),
            "kill {kill}: {:?}",
            report.closed
        );
        // The relay holds every open connection again, and the store exactly those.
        let open = open_controls + 2 * open_pairs;
        assert!(
            systemd_harness::wait_until(STEP, || {
                relay.live_connections() == open && relay.stored() == open + STORED_BESIDES
            }),
            "kill {kill}: live {}, stored {} for {open} open",
            relay.live_connections(),
            relay.stored()
        );
        after_kill(kill, open_controls);
        eprintln!("kill {kill}: {this:?}; {gone} closed in all");
    }
    // Idle controls are kept (a control closed at a kill was one the relay was writing to or
    // reading from at that very moment).
    let closed_so_far = load.report().closed.len();
    assert!(
        closed_so_far * 100 <= (CONTROLS + 2 * PAIRS) * KILLS,
        "{closed_so_far} closed over {KILLS} kills"
    );

    // 200 closes: the store follows.
    let controls: Vec<Blocking> = relay
        .place(CHURN)
        .into_iter()
        .map(|d| relay.connect_control(d))
        .collect();
    let with_extra = relay.live_connections();
    assert!(systemd_harness::wait_until(STEP, || {
        relay.stored() == with_extra + STORED_BESIDES
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
        systemd_harness::wait_until(STEP, || {
            let live = relay.live_connections();
            relay.stored() == live + STORED_BESIDES && live + CHURN == with_extra
        }),
        "after {CHURN} closes: stored {}, live {}",
        relay.stored(),
        relay.live_connections()
    );

    let finished = load.finish(Duration::from_secs(60));
    assert!(finished.violations.is_empty(), "{:?}", finished.violations);
    assert_eq!(
        ended_without_close(&finished),
        relay.cut_in_journal(),
        "{:?}",
        finished.closed
    );
    // A stop still drains: what is left hears 4503 (the load finished: a control of our own).
    let desktop = relay.place(1).remove(0);
    let mut control = relay.connect_control(desktop);
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

#[test]
fn kill_9_ten_times_costs_the_desktops_a_pause_not_a_redial() {
    let _turn = TURN.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    handover_kit::raise_fd_limit();
    let ns = Namespace::boot("crash");
    package::install_binary(&ns, Path::new(env!("CARGO_BIN_EXE_orca-relay")));
    package::configure_combined(&ns);
    let relay = Relay {
        ns: &ns,
        http: HTTP_ADDR,
        director: HTTP_ADDR,
        mint: harness::token,
    };
    survive_ten_kills(&relay, |_, _| {});
}

/// The director's view of its cells (`GET /v1/admin/cells`).
fn listed_cells(ns: &Namespace) -> Vec<Value> {
    let (status, body) = ns.http("GET", HTTP_ADDR, "/v1/admin/cells", Some(SERVICE_TOKEN), "");
    assert_eq!(status, 200, "{body}");
    let listing: Value = serde_json::from_str(&body).expect("a listing");
    listing["cells"].as_array().cloned().unwrap_or_default()
}

/// Journal lines of `unit` that contain `event`.
fn count_events(ns: &Namespace, unit: &str, event: &str) -> usize {
    ns.journal(unit)
        .iter()
        .filter(|entry| entry.message.contains(event))
        .count()
}

#[test]
fn a_cell_on_postgresql_killed_ten_times_keeps_its_desktops_and_its_director() {
    let _turn = TURN.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    handover_kit::raise_fd_limit();
    let ns = package::installed("crash-cell");
    let database_url = ns.start_postgresql();
    let jwks = package::JwksServer::start(&ns);
    package::configure_fleet(&ns, &database_url, &jwks);
    ns.systemctl_ok(&["start", DIRECTOR]);
    ns.wait_for_state(DIRECTOR, "active/running", STEP);
    let relay = Relay {
        ns: &ns,
        http: CELL_HTTP_ADDR,
        director: HTTP_ADDR,
        mint: harness::es256_token,
    };
    let mut incarnation = 0;
    survive_ten_kills(&relay, |kill, open_controls| {
        // The director still has its one cell, live and ready, at the new incarnation, its
        // feed counting every resumed desktop as seated.
        let mut cells = Vec::new();
        let listed = systemd_harness::wait_until(STEP, || {
            cells = listed_cells(&ns);
            let [cell] = cells.as_slice() else {
                return false;
            };
            let now = cell["incarnation"].as_i64().unwrap_or(0);
            now > incarnation
                && cell["state"] == "live"
                && cell["ready"] == true
                && cell["feed"]["incarnation"] == now
                && cell["feed"]["counts"]["seated"] == open_controls
        });
        assert!(listed, "kill {kill}: {cells:#?}");
        incarnation = cells[0]["incarnation"].as_i64().unwrap();
        // Registered once per start (the first and each restart's), nothing more.
        let registered = || {
            count_events(
                &ns,
                DIRECTOR,
                "orca_relay_director_cell_registered cell_id=",
            )
        };
        systemd_harness::wait_until(STEP, || registered() > kill);
        assert_eq!(
            registered(),
            kill + 1,
            "kill {kill}:\n{}",
            ns.journal_text(DIRECTOR)
        );
        assert_eq!(
            count_events(
                &ns,
                DIRECTOR,
                "orca_relay_director_cell_registered_by_heartbeat"
            ),
            0
        );
        assert_eq!(ns.show(DIRECTOR, "NRestarts"), "0");
    });
    drop(jwks);
}

/// The load's own process (`handover_kit::remote`): nothing unless started as one.
#[test]
fn load_helper() {
    handover_kit::remote::helper_main();
}
