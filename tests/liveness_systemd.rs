//! Liveness under a real systemd (SPEC §13, issue 32): the shipped `orca-relay-cell.service`,
//! its `/usr/bin/orca-relay` a copy of the binary under test, runs the combined role on SQLite in a
//! private namespace whose PID 1 is systemd 252 (`tests/systemd_harness`). A drop-in shortens
//! `WatchdogSec=` to 3 s (the shipped 30 s would make each case take a minute); the test knob
//! `ORCA_RELAY_TEST_FAULT` (in the env file) wedges or panics one critical thread a few seconds
//! after each start.
//!
//! - a wedged acceptor, splice worker or dead-man watchdog stops `WATCHDOG=1`: systemd kills the
//!   process ("Watchdog timeout") and `Restart=on-failure` starts a new one (`NRestarts`);
//! - a critical thread's panic ends the process with status 70 and one ERROR line (priority 3 in
//!   the journal): `Restart=on-failure` starts a new one.
//!
//! Either way the connections outlive the process (the descriptor store, crash survival): the
//! desktops' controls and their streaming pairs connected before the fault are resumed by the new
//! process (its next ping answered, every message once, in order), whatever was not got 1012.
//! The env file loses the fault once the load is connected, so the restarted process runs clean.
//!
//! Before issue 32 the watchdog thread sent `WATCHDOG=1` whenever the process's own `GET
//! /health` answered, which it always did: a wedged cell ran on, serving nobody.

mod handover_kit;
mod harness;
mod systemd_harness;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use handover_kit::load::Spec;
use handover_kit::remote::RemoteLoad;
use systemd_harness::{package, Namespace};

const UNIT: &str = package::CELL;
const WS: &str = package::WS_ADDR;
const HTTP: &str = package::HTTP_ADDR;
/// When the fault fires in the first process: after it has started, answered `/health` and
/// taken the load.
const FAULT_AFTER_MS: u64 = 6_000;
/// The load that must outlive the process: desktops' controls, the first few with a streaming
/// pair each.
const CONTROLS: usize = 40;
const PAIRS: usize = 8;

/// The user, the binary, the shipped env file (with a combined relay's values and `fault`), the
/// shipped unit unchanged, and a drop-in with a short watchdog interval.
fn install(ns: &Namespace, fault: &str) {
    package::install_binary(ns, Path::new(env!("CARGO_BIN_EXE_orca-relay")));
    package::configure_combined(ns);
    let values = [
        ("ORCA_RELAY_SPLICE_WORKERS", "2"),
        ("ORCA_RELAY_DRAIN_GRACE_MS", "500"),
        ("ORCA_RELAY_PING_MS", "1000"),
    ];
    ns.set_env_values(package::CELL_ENV, &values);
    ns.write(
        "/etc/orca-relay/cell.env.clean",
        &ns.read(package::CELL_ENV),
    );
    ns.set_env_values(package::CELL_ENV, &[("ORCA_RELAY_TEST_FAULT", fault)]);
    // Beside the unit, in the search path's first directory.
    let drop_in = "/srv/units/orca-relay-cell.service.d";
    std::fs::create_dir_all(ns.path(drop_in)).unwrap();
    ns.write(
        &format!("{drop_in}/watchdog.conf"),
        "[Service]\n# The test's: the shipped 30 s, shortened.\nWatchdogSec=3s\n",
    );
    ns.systemctl_ok(&["daemon-reload"]);
}

/// `GET /health` inside the namespace: the status, or 0 when nothing answered.
fn health(ns: &Namespace) -> u16 {
    ns.in_network(|| {
        ureq::get(&format!("http://{HTTP}/health"))
            .timeout(Duration::from_secs(5))
            .call()
            .map(|response| response.status())
            .or_else(|e| match e {
                ureq::Error::Status(status, _) => Ok(status),
                ureq::Error::Transport(_) => Err(()),
            })
            .unwrap_or(0)
    })
}

fn restarts(ns: &Namespace) -> u32 {
    ns.show(UNIT, "NRestarts").parse().unwrap_or(0)
}

fn netns(ns: &Namespace) -> PathBuf {
    PathBuf::from(format!("/proc/{}/ns/net", ns.pid1()))
}

/// Starts the unit with `fault` set and the load connected; waits for the fault to fire in the
/// first process and for systemd to restart the unit (the journal saying `what_ended_it`);
/// checks the restarted process serves and resumed the load. Returns the namespace and how long
/// the restart took from the fault.
fn restarted_after(fault: &str, what_ended_it: &str) -> (Namespace, Duration) {
    handover_kit::raise_fd_limit();
    let ns = Namespace::boot("liveness");
    install(&ns, fault);
    ns.systemctl_ok(&["start", UNIT]);
    ns.wait_for_state(UNIT, "active/running", Duration::from_secs(30));
    let first = ns.main_pid(UNIT);
    assert!(first > 0);
    // The drop-in's interval, in force while the unit runs.
    assert_eq!(ns.show(UNIT, "WatchdogUSec"), "3s");
    assert_eq!(health(&ns), 200, "{}", ns.journal_text(UNIT));
    assert_eq!(restarts(&ns), 0);
    // The load, connected before the fault fires; the next start reads an env file without it.
    let identities = handover_kit::place_desktops(Some(&netns(&ns)), HTTP, CONTROLS);
    let mut spec = Spec::new(CONTROLS, PAIRS);
    spec.netns = Some(netns(&ns));
    let mut load = RemoteLoad::start("load_helper", WS, spec, identities);
    assert!(
        systemd_harness::wait_until(Duration::from_secs(20), || {
            ns.show(UNIT, "NFileDescriptorStore") == (CONTROLS + 2 * PAIRS + 3).to_string()
        }),
        "{fault}: the load was not all kept before the fault: {} stored",
        ns.show(UNIT, "NFileDescriptorStore")
    );
    assert!(
        !ns.journal_text(UNIT)
            .contains("orca_relay_test_fault_fired"),
        "{fault}: the fault fired before the load was connected; raise FAULT_AFTER_MS"
    );
    std::fs::rename(
        ns.path("/etc/orca-relay/cell.env.clean"),
        ns.path("/etc/orca-relay/cell.env"),
    )
    .unwrap();
    // Until systemd restarts it; when the fault fired in the first process is noted on the way.
    let mut fired: Option<Instant> = None;
    let restarted = systemd_harness::wait_until(Duration::from_secs(60), || {
        if fired.is_none()
            && ns.journal(UNIT).iter().any(|entry| {
                entry.pid == Some(first) && entry.message.contains("orca_relay_test_fault_fired")
            })
        {
            fired = Some(orca_relay::clock::instant());
        }
        restarts(&ns) >= 1
    });
    assert!(
        restarted,
        "{fault}: not restarted within a minute; journal:\n{}",
        ns.journal_text(UNIT)
    );
    let took = fired.map_or(Duration::MAX, |at| at.elapsed());
    eprintln!("{fault}: restarted {took:?} after the fault fired");
    ns.wait_for_entry(UNIT, Duration::from_secs(10), |entry| {
        entry.message.contains(what_ended_it)
    });
    // The new process serves, and pings every control it resumed: the first ping a control
    // hears after the mark is the new process's (the old one is gone).
    assert!(
        systemd_harness::wait_until(Duration::from_secs(30), || {
            let pid = ns.main_pid(UNIT);
            pid != 0 && pid != first && health(&ns) == 200
        }),
        "{fault}: the restarted process does not serve; journal:\n{}",
        ns.journal_text(UNIT)
    );
    load.mark();
    let resumed = ns.wait_for_entry(UNIT, Duration::from_secs(10), |entry| {
        entry.pid != Some(first) && entry.message.contains("orca_relay_crash_resumed")
    });
    eprintln!("{fault}: {}", resumed.message);
    let cut: usize = harness::field(&resumed.message, "cut")
        .and_then(|n| n.parse().ok())
        .unwrap_or(0);
    let report = load.report();
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
        "{fault}: resumed controls not pinged by the new process: {:?}\n{}",
        load.report(),
        ns.journal_text(UNIT)
    );
    let finished = load.finish(Duration::from_secs(30));
    assert!(finished.violations.is_empty(), "{:?}", finished.violations);
    // What was not resumed got 1012, but a leg with half a frame on the wire (`cut`).
    assert_eq!(
        finished
            .closed
            .iter()
            .filter(|c| !c.ends_with("closed 1012"))
            .count(),
        cut,
        "{fault}: {:?}",
        finished.closed
    );
    // Idle controls are kept: at most the few the process was reading or writing at the fault.
    assert!(
        finished.closed.len() * 10 <= CONTROLS + 2 * PAIRS,
        "{fault}: {} of {} connections closed: {:?}",
        finished.closed.len(),
        CONTROLS + 2 * PAIRS,
        finished.closed
    );
    (ns, took)
}

/// A wedged thread of `name`: killed by the watchdog within the thread's bound (5 s) plus
/// `WatchdogSec=` (3 s) plus `RestartSec=` (2 s), and some slack for a loaded machine.
fn watchdog_kills_and_restarts_a_wedged(name: &str) {
    let (ns, took) = restarted_after(
        &format!("wedge:{name}@{FAULT_AFTER_MS}"),
        "Watchdog timeout",
    );
    assert!(
        took < Duration::from_secs(20),
        "wedge:{name}: restarted {took:?} after the wedge"
    );
    let journal = ns.journal(UNIT);
    assert!(
        journal.iter().any(|entry| entry.message.contains(&format!(
            "orca_relay_liveness_check_failed stale={name} watchdog=withheld"
        ))),
        "wedge:{name}: the withheld watchdog names the thread:\n{}",
        ns.journal_text(UNIT)
    );
    assert!(
        !journal
            .iter()
            .any(|entry| entry.message.contains("orca_relay_critical_thread_failed")),
        "a wedge is not a panic"
    );
}

#[test]
fn the_watchdog_kills_and_restarts_a_cell_whose_acceptor_is_wedged() {
    watchdog_kills_and_restarts_a_wedged("acceptor");
}

#[test]
fn the_watchdog_kills_and_restarts_a_cell_whose_splice_worker_is_wedged() {
    watchdog_kills_and_restarts_a_wedged("splice-1");
}

#[test]
fn the_watchdog_kills_and_restarts_a_cell_whose_dead_man_watchdog_is_wedged() {
    watchdog_kills_and_restarts_a_wedged("watchdog");
}

#[test]
fn a_critical_thread_that_panics_ends_the_process_and_restart_on_failure_restarts_it() {
    let (ns, took) = restarted_after(
        &format!("panic:splice-0@{FAULT_AFTER_MS}"),
        "status=70/SOFTWARE",
    );
    assert!(
        took < Duration::from_secs(15),
        "restarted {took:?} after the panic"
    );
    let errors: Vec<String> = ns
        .journal(UNIT)
        .into_iter()
        .filter(|entry| entry.priority <= 3 && entry.message.contains("orca_relay_"))
        .map(|entry| entry.message)
        .collect();
    assert!(
        errors.first().is_some_and(|line| line.contains(
            "orca_relay_critical_thread_failed thread=splice-0 cause=panic exit_code=70"
        )),
        "the first process's one ERROR line: {errors:#?}"
    );
}

/// The load's own process (`handover_kit::remote`): nothing unless started as one.
#[test]
fn load_helper() {
    handover_kit::remote::helper_main();
}
