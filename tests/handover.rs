//! Live handover (SPEC §12, issue 23) on the real binary: `orca-relay handover` replaces a
//! serving relay with another build, under load, without closing a connection or losing a
//! byte; the state of the cell goes with it; every failure before the commit leaves the
//! running process serving everything.
//!
//! The "next build" is a copy of the binary with another build note (its version reads
//! `0.1.0+next`). Load comes from a couple of `mio` loops (`handover_kit::load`); `/ready` and
//! `/health` are asked every 50 ms on fresh connections throughout.

mod handover_kit;
mod harness;

use std::time::Duration;

use handover_kit::load::{Identity, Load, Spec};
use handover_kit::{build_with_note, hand_over, Poller, Serving};
use harness::*;

const DEADLINE: Duration = Duration::from_secs(60);

/// Test timings: pings every second (a control's liveness shows within one), a wedge window
/// long enough for a desktop that stops reading during the test.
fn load_env() -> Vec<(&'static str, &'static str)> {
    vec![
        ("ORCA_RELAY_PING_MS", "1000"),
        ("ORCA_RELAY_WEDGE_MS", "60000"),
        ("ORCA_RELAY_CONNECTION_CAP", "20000"),
        ("ORCA_RELAY_SPLICE_WORKERS", "2"),
        ("RUST_LOG", "info"),
    ]
}

/// `count` desktops placed on a combined relay (`/v1/assign` on its in-process director).
fn place(relay: &Relay, count: usize) -> Vec<Identity> {
    (0..count)
        .map(|_| {
            let relay_host_id = host_id();
            let user_id = format!("user-{relay_host_id}");
            let token = token(&user_id, &relay_host_id);
            let epoch = assign(relay, &token, &relay_host_id);
            Identity {
                user_id,
                relay_host_id,
                token,
                epoch,
            }
        })
        .collect()
}

fn combined_under_load(controls: usize, pairs: usize) -> (Relay, Load) {
    handover_kit::raise_fd_limit();
    handover_kit::adopt_orphans();
    let relay = Relay::combined(&load_env());
    assert!(wait_until(DEADLINE, || relay.get("/ready").0 == 200));
    let identities = place(&relay, controls);
    let load = Load::start(&relay.ws, Spec::new(controls, pairs), identities);
    (relay, load)
}

#[test]
fn a_combined_relay_under_load_hands_over_to_the_next_build_losing_nothing() {
    let (relay, load) = combined_under_load(1000, 200);
    let next = build_with_note("next");
    orca_relay::clock::sleep(Duration::from_secs(2));
    load.pause_desktop(0);
    orca_relay::clock::sleep(Duration::from_secs(1));
    let poller = Poller::start(&relay.http);
    load.mark();
    let before = handover_kit::served_version(&relay.http);
    let outcome = hand_over(&relay, Some(&next), &[], &[]);
    assert_eq!(outcome.code, 0, "{outcome:?}\n{}", relay.log_text());
    let serving = Serving {
        pid: outcome.new_pid.expect("the new pid"),
    };
    orca_relay::clock::sleep(Duration::from_secs(3));
    load.resume_desktop(0);
    orca_relay::clock::sleep(Duration::from_secs(2));
    let (asked, failures) = poller.stop();
    let after = handover_kit::served_version(&relay.http);
    let report = load.report();
    let finished = load.finish(Duration::from_secs(60));
    assert_eq!(before.as_deref(), Some("0.1.0"));
    assert_eq!(after.as_deref(), Some("0.1.0+next"));
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
    assert_eq!(report.pinged_since_mark, 1000, "{report:?}");
    assert_eq!(report.streams_flowing_since_mark, 400, "{report:?}");
    assert!(report.max_stall_ms < 1000, "{report:?}");
    eprintln!("report {report:?}\nfinished {finished:?}\nhandover {outcome:?}");
    drop(serving);
}
