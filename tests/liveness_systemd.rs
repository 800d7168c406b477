//! Liveness under a real systemd (SPEC §13, issue 32): the shipped `orca-relay-cell.service`,
//! its `/usr/bin/orca-relay` the binary under test, runs the combined role on SQLite in a
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
//! Before issue 32 the watchdog thread sent `WATCHDOG=1` whenever the process's own `GET
//! /health` answered, which it always did: a wedged cell ran on, serving nobody.

mod harness;
mod systemd_harness;

use std::path::Path;
use std::time::{Duration, Instant};

use harness::TEST_KEY;
use systemd_harness::Namespace;

const UNIT: &str = "orca-relay-cell.service";
const WS: &str = "127.0.0.1:8080";
const HTTP: &str = "127.0.0.1:8081";
/// When the fault fires in each process: after it has started and answered `/health`.
const FAULT_AFTER_MS: u64 = 3_000;

/// The user, the binary, the shipped env file (with a combined relay's values and `fault`), the
/// shipped unit unchanged, and a drop-in with a short watchdog interval.
fn install(ns: &Namespace, fault: &str) {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    ns.write(
        "/usr/lib/sysusers.d/orca-relay.conf",
        &std::fs::read_to_string(root.join("packaging/orca-relay.sysusers.conf")).unwrap(),
    );
    ns.run_ok(&["systemd-sysusers"]);
    let link = ns.path("/usr/bin/orca-relay");
    let _ = std::fs::remove_file(&link);
    std::os::unix::fs::symlink(env!("CARGO_BIN_EXE_orca-relay"), &link)
        .expect("link /usr/bin/orca-relay");
    std::fs::create_dir_all(ns.path("/etc/orca-relay")).unwrap();
    let shipped = std::fs::read_to_string(root.join("packaging/cell.env")).unwrap();
    let operator = format!(
        "{shipped}\n# The test's operator: a combined relay on this machine.\n\
         ORCA_RELAY_ROLE=combined\nDATABASE_URL=\nORCA_RELAY_CELL_ID=combined\nORCA_RELAY_WS_ADDR={WS}\n\
         ORCA_RELAY_HTTP_ADDR={HTTP}\nORCA_RELAY_CELL_URL=ws://{WS}\nORCA_RELAY_DIRECTOR_URLS=\n\
         ORCA_RELAY_SELF_HOSTED_KEY={TEST_KEY}\nORCA_RELAY_SPLICE_WORKERS=2\n\
         ORCA_RELAY_DRAIN_GRACE_MS=500\nORCA_RELAY_TEST_FAULT={fault}\n"
    );
    ns.write("/etc/orca-relay/cell.env", &operator);
    ns.add_unit(
        UNIT,
        &std::fs::read_to_string(root.join("systemd/orca-relay-cell.service")).unwrap(),
    );
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

/// Starts the unit with `fault` set; waits for the fault to fire in the first process and for
/// systemd to restart the unit (the journal saying `what_ended_it`); checks the restarted
/// process serves. Returns the namespace and how long the restart took from the fault.
fn restarted_after(fault: &str, what_ended_it: &str) -> (Namespace, Duration) {
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
    // The new process serves (until its own fault fires).
    assert!(
        systemd_harness::wait_until(Duration::from_secs(30), || {
            let pid = ns.main_pid(UNIT);
            pid != 0 && pid != first && health(&ns) == 200
        }),
        "{fault}: the restarted process does not serve; journal:\n{}",
        ns.journal_text(UNIT)
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
