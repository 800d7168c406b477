//! Liveness that proves progress (SPEC §13, issue 32), with the real binary: every thread the
//! process cannot live without shows progress on its own. The test knob
//! `ORCA_RELAY_TEST_FAULT=wedge:THREAD@MS` stops one thread's beat, `panic:THREAD@MS` panics
//! it, at its first beat `MS` ms after the process started.
//!
//! - a wedged critical thread turns `/health` 503 naming it within its bound (5 s), the process
//!   otherwise serving on; every critical thread of the combined role is tried;
//! - `WATCHDOG=1` stops once one is wedged (the gate systemd relies on; `tests/liveness_systemd.rs`
//!   runs it under a real systemd);
//! - a critical thread that panics ends the process with status 70 and exactly one ERROR line
//!   naming it (before: a panicking acceptor left a process that accepted nobody, silently);
//! - a process stopped for longer than the bound and continued is not judged wedged, and a drain
//!   that stops every thread on purpose exits 0 with no such line.
//!
//! Before issue 32 `/health` answered 200 and `WATCHDOG=1` went out whatever the threads did.

mod harness;

use std::sync::Arc;
use std::time::{Duration, Instant};

use harness::*;

/// The combined role's critical threads (one splice worker), as `/health` names them.
const CRITICAL: [&str; 15] = [
    "acceptor",
    "splice-0",
    "pinger",
    "lease-renewer",
    "reaper",
    "switch-watcher",
    "watchdog",
    "claim-loop",
    "heartbeat",
    "readiness",
    "http-acceptor",
    "feed-poller",
    "feed-lister",
    "feed-live-0",
    "feed-suspect-0",
];

/// A thread that has not beaten for this long is stale (`liveness::stale_bound` of a 1 s
/// period).
const BOUND: Duration = Duration::from_secs(5);
/// What a loaded two-core machine adds on top: scheduling, the poll's own period.
const SLACK: Duration = Duration::from_secs(4);
/// When the fault fires: after the process has listened and answered /health 200.
const FAULT_AFTER_MS: u64 = 2_500;

/// Starts a combined relay with `fault` (and `extra`) set, without waiting for its start to
/// finish: the listening line is enough to reach `/health`.
fn relay_with(fault: &str, extra: &[(&str, &str)]) -> Relay {
    let mut env = vec![
        ("ORCA_RELAY_TEST_FAULT", fault),
        ("ORCA_RELAY_SPLICE_WORKERS", "1"),
    ];
    env.extend_from_slice(extra);
    Relay::launch(Arc::new(TempDir::new("liveness")), &env).expect_listening("orca_relay_listening")
}

/// `/health` without panicking on a refused connection (a process that has exited).
fn health(relay: &Relay) -> Option<(u16, String)> {
    let agent = ureq::AgentBuilder::new()
        .timeout(Duration::from_secs(5))
        .build();
    match agent.get(&relay.http_url("/health")).call() {
        Ok(response) => Some((
            response.status(),
            response.into_string().unwrap_or_default(),
        )),
        Err(ureq::Error::Status(status, response)) => {
            Some((status, response.into_string().unwrap_or_default()))
        }
        Err(_) => None,
    }
}

/// Runs `check` for every name in `names`, a few at a time (each starts its own relay).
fn each(names: &[&'static str], check: impl Fn(&'static str) + Sync) {
    for batch in names.chunks(5) {
        std::thread::scope(|scope| {
            let handles: Vec<_> = batch
                .iter()
                .map(|name| {
                    let check = &check;
                    std::thread::Builder::new()
                        .name(format!("case-{name}"))
                        .spawn_scoped(scope, move || check(name))
                        .expect("case thread")
                })
                .collect();
            for handle in handles {
                if let Err(panic) = handle.join() {
                    std::panic::resume_unwind(panic);
                }
            }
        });
    }
}

/// Every critical thread beats on its own: wedged, it alone is named by `/health` (503) within
/// its bound, and the watchdog is withheld naming it. A wedged `http-acceptor` cannot answer
/// `/health` at all: the probe fails for want of an answer, as a load balancer's would.
#[test]
fn every_critical_thread_that_stops_beating_turns_health_503_naming_it() {
    each(&CRITICAL, |name| {
        let notify = NotifySocket::new();
        let socket = notify.env_value();
        let fault = format!("wedge:{name}@{FAULT_AFTER_MS}");
        let relay = relay_with(
            &fault,
            &[("NOTIFY_SOCKET", &socket), ("WATCHDOG_USEC", "2000000")],
        );
        let failed = |answer: &Option<(u16, String)>| match name {
            "http-acceptor" => answer.is_none(),
            _ => matches!(answer, Some((503, _))),
        };
        // Healthy until the fault fires, then failing within the bound.
        let mut healthy_before = false;
        let mut fired: Option<Instant> = None;
        let mut last = None;
        let turned = wait_until(
            Duration::from_millis(FAULT_AFTER_MS) + BOUND + SLACK * 2,
            || {
                if fired.is_none() && relay.count_log("orca_relay_test_fault_fired") > 0 {
                    fired = Some(now_instant());
                }
                last = health(&relay);
                if fired.is_none() && last == Some((200, r#"{"ok":true}"#.to_string())) {
                    healthy_before = true;
                }
                fired.is_some() && failed(&last)
            },
        );
        assert!(
            turned,
            "{name}: /health still {last:?} with the thread wedged\n{}",
            relay.log_text()
        );
        assert!(
            healthy_before,
            "{name}: /health was never 200 before the fault"
        );
        let fired = fired.expect("the fault fired");
        eprintln!(
            "{name}: /health failed {:?} after the wedge",
            fired.elapsed()
        );
        assert!(
            fired.elapsed() <= BOUND + SLACK,
            "{name}: judged stale only {:?} after the wedge",
            fired.elapsed()
        );
        let stale_line = relay
            .wait_for_log(
                &format!("orca_relay_thread_stale thread={name} "),
                BOUND + SLACK,
            )
            .unwrap_or_else(|| panic!("{name}: the stale thread is logged\n{}", relay.log_text()));
        let silent_ms: u64 = field(&stale_line, "silent_ms").unwrap().parse().unwrap();
        assert!(
            silent_ms > BOUND.as_millis() as u64,
            "{name}: judged stale after {silent_ms} ms, within its bound: {stale_line}"
        );
        assert!(
            relay
                .wait_for_log(
                    &format!("orca_relay_liveness_check_failed stale={name} watchdog=withheld"),
                    SLACK
                )
                .is_some(),
            "{name}: the watchdog is withheld naming it\n{}",
            relay.log_text()
        );
        if name != "http-acceptor" {
            let (_, body) = last.unwrap_or_default();
            let body: serde_json::Value = serde_json::from_str(&body).expect("json body");
            assert_eq!(
                body,
                serde_json::json!({"ok": false, "stale": [name]}),
                "{name}: only the wedged thread is named"
            );
        }
        // A wedge does not end the process: it is left to its supervisor.
        assert_eq!(relay.count_log("orca_relay_critical_thread_failed"), 0);
    });
}

#[test]
fn a_critical_thread_that_panics_ends_the_process_with_one_error_line() {
    each(&CRITICAL, |name| {
        let fault = format!("panic:{name}@{FAULT_AFTER_MS}");
        let mut relay = relay_with(&fault, &[]);
        let code = relay.wait_exit(Duration::from_secs(30));
        let log = relay.log_text();
        assert_eq!(code, Some(70), "{name}: exit status\n{log}");
        let errors: Vec<&str> = log
            .lines()
            .filter(|line| line.contains(" ERROR "))
            .collect();
        assert_eq!(errors.len(), 1, "{name}: one ERROR line, got {errors:#?}");
        assert!(
            errors[0].contains(&format!(
                "orca_relay_critical_thread_failed thread={name} cause=panic exit_code=70"
            )),
            "{name}: {}",
            errors[0]
        );
        assert!(
            errors[0].contains(&format!("test fault panic:{name}")),
            "{name}: the panic's message is in the line: {}",
            errors[0]
        );
    });
}

/// The gate systemd relies on, without systemd: `WATCHDOG=1` goes out every half interval while
/// every critical thread beats, and stops once one is stale.
#[test]
fn watchdog_pings_stop_once_a_critical_thread_is_wedged() {
    let notify = NotifySocket::new();
    let socket = notify.env_value();
    let relay = relay_with(
        "wedge:acceptor@3000",
        &[("NOTIFY_SOCKET", &socket), ("WATCHDOG_USEC", "1000000")],
    );
    assert!(
        notify.wait_for("WATCHDOG=1", 3, Duration::from_secs(20)),
        "{:?}\n{}",
        notify.drain(),
        relay.log_text()
    );
    assert!(
        wait_until(Duration::from_secs(30), || matches!(
            health(&relay),
            Some((503, _))
        )),
        "{}",
        relay.log_text()
    );
    // Give a ping already on its way (every 500 ms) time to arrive, then count.
    orca_relay::clock::sleep(Duration::from_millis(600));
    let before = notify.count("WATCHDOG=1");
    orca_relay::clock::sleep(Duration::from_secs(3));
    assert_eq!(
        notify.count("WATCHDOG=1"),
        before,
        "WATCHDOG=1 kept going with the acceptor wedged"
    );
    assert!(relay
        .wait_for_log("orca_relay_liveness_check_failed stale=acceptor", SLACK)
        .is_some());
}

/// A process stopped for longer than the bound is not wedged: on resume `/health` is 200 and
/// `WATCHDOG=1` goes on. A drain stops every thread on purpose: exit 0, no failure line.
#[test]
fn a_paused_process_is_not_judged_wedged_and_a_drain_ends_cleanly() {
    let notify = NotifySocket::new();
    let socket = notify.env_value();
    let mut relay = Relay::combined(&[
        ("NOTIFY_SOCKET", &socket),
        ("WATCHDOG_USEC", "1000000"),
        ("ORCA_RELAY_DRAIN_GRACE_MS", "500"),
    ]);
    let _desktop = Desktop::connect(&relay);
    assert_eq!(health(&relay), Some((200, r#"{"ok":true}"#.to_string())));
    relay.freeze_for(BOUND + Duration::from_secs(3), || {});
    for _ in 0..20 {
        assert_eq!(
            health(&relay),
            Some((200, r#"{"ok":true}"#.to_string())),
            "{}",
            relay.log_text()
        );
        orca_relay::clock::sleep(Duration::from_millis(50));
    }
    let before = notify.count("WATCHDOG=1");
    assert!(notify.wait_for("WATCHDOG=1", before + 2, Duration::from_secs(10)));
    assert_eq!(relay.count_log("orca_relay_thread_stale"), 0);
    relay.signal("TERM");
    assert_eq!(relay.wait_exit(Duration::from_secs(30)), Some(0));
    let log = relay.log_text();
    assert_eq!(
        relay.count_log("orca_relay_critical_thread_failed"),
        0,
        "{log}"
    );
    assert_eq!(relay.count_log(" ERROR "), 0, "{log}");
}
