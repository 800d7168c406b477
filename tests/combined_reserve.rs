//! The combined role runs the same director as the `director` role, in-process with its one
//! cell (SPEC §3): on SQLite with a switch file saying `reserve`, `/v1/assign` books the
//! desktop on the cell through its own `/internal/reserve`, the hello is admitted from the
//! booking, a redial from memory, and the in-process feed poller keeps the dead-man armed.

mod harness;

use std::sync::Arc;
use std::time::Duration;

use harness::*;

const DEADLINE: Duration = Duration::from_secs(20);
/// The shrunk dead-man window (base, no spread).
const WINDOW_MS: u64 = 1_500;

fn wait_for(what: &str, condition: impl FnMut() -> bool) {
    assert!(
        wait_until(DEADLINE, condition),
        "timed out waiting for {what}"
    );
}

fn metric(relay: &Relay, series: &str) -> f64 {
    relay.metric(series).unwrap_or(0.0)
}

fn admissions(relay: &Relay, path: &str) -> f64 {
    metric(
        relay,
        &format!("orca_relay_admissions_total{{path=\"{path}\",outcome=\"admitted\"}}"),
    )
}

fn armed(relay: &Relay) -> bool {
    metric(relay, "orca_relay_dead_man_state{state=\"armed\"}") == 1.0
}

/// A new desktop: assigned, then its hello; returns (host, token, epoch, control).
fn booked_desktop(relay: &Relay) -> (String, String, i64, Ws) {
    let relay_host_id = host_id();
    let token = token(&format!("user-{relay_host_id}"), &relay_host_id);
    let epoch = assign(relay, &token, &relay_host_id);
    assert!(relay
        .wait_for_log(
            &format!("orca_relay_host_placed host={relay_host_id} cell_id=combined epoch={epoch} path=booking"),
            DEADLINE
        )
        .is_some());
    let (control, _) = hello(relay, &token, &relay_host_id, epoch).expect("booked hello");
    (relay_host_id, token, epoch, control)
}

#[test]
fn a_reserve_combined_process_books_admits_from_booking_and_memory_and_stays_armed() {
    let dir = Arc::new(TempDir::new("combined-reserve"));
    write_switch(
        &dir.0.join("switch.json"),
        "combined",
        1,
        serde_json::json!({"admitMode": "reserve"}),
    );
    let window = WINDOW_MS.to_string();
    let relay = Relay::start_in(
        dir,
        &[
            ("ORCA_RELAY_DEAD_MAN_BASE_MS", window.as_str()),
            ("ORCA_RELAY_DEAD_MAN_SPREAD_MS", "0"),
            ("ORCA_RELAY_FEED_POLL_MS", "100"),
            ("ORCA_RELAY_SWITCH_POLL_MS", "50"),
            ("ORCA_RELAY_HEARTBEAT_MS", "200"),
            ("ORCA_RELAY_ADMIT_EFFECTIVE_REFRESH_MS", "200"),
            ("ORCA_RELAY_READINESS_PROBE_MS", "200"),
        ],
    );
    assert_eq!(
        metric(&relay, "orca_relay_dead_man_window_ms"),
        WINDOW_MS as f64,
        "the window is really this short"
    );
    // The in-process admin record follows the switch, and the in-process poller sees the
    // cell publish `reserve` before the first assign.
    assert!(relay
        .wait_for_log(
            "orca_relay_self_admit_mode_recorded cell_id=combined admit_mode=reserve",
            DEADLINE
        )
        .is_some());
    wait_for("effective reserve", || {
        metric(&relay, "orca_relay_admit_mode{kind=\"effective\"}") == 1.0
    });
    let polls = "orca_relay_director_feed_polls_total{cell_id=\"combined\",result=\"ok\"}";
    let seen = metric(&relay, polls);
    wait_for("two more feed polls", || {
        metric(&relay, polls) >= seen + 2.0
    });

    // Assign → a booking at the new epoch → the hello is admitted from it.
    let (host, token, epoch, mut control) = booked_desktop(&relay);
    assert_eq!(epoch, 1);
    assert_eq!(admissions(&relay, "booking"), 1.0);
    assert_eq!(admissions(&relay, "database"), 0.0);
    assert_eq!(metric(&relay, "orca_relay_bookings"), 0.0, "consumed");

    // Drop and redial at the same epoch → memory, no SQL.
    let _ = control.close(None);
    let _ = read_close(&mut control);
    wait_for("the control to leave", || {
        metric(&relay, "orca_relay_connections{kind=\"control\"}") == 0.0
    });
    let (_control, _) = hello(&relay, &token, &host, epoch).expect("redial from memory");
    assert_eq!(admissions(&relay, "memory"), 1.0);
    assert_eq!(
        metric(
            &relay,
            "orca_relay_admission_sql_statements_total{path=\"memory\"}"
        ),
        0.0
    );

    // The dead-man stays armed across several windows: the poller's `reserver=1` polls are
    // contact. (A fixed observation window: the claim is that nothing happens in it.)
    let observe_until = orca_relay::clock::instant() + Duration::from_millis(WINDOW_MS * 3);
    while orca_relay::clock::instant() < observe_until {
        assert!(armed(&relay), "dead-man left armed:\n{}", relay.log_text());
        orca_relay::clock::sleep(Duration::from_millis(100));
    }
    assert_eq!(
        relay.count_log("orca_relay_cell_reserve_dead_man_tripped"),
        0
    );
    assert_eq!(metric(&relay, "orca_relay_admit_mode{kind=\"raw\"}"), 1.0);

    // Still booking after those windows.
    let (_, _, epoch2, _control2) = booked_desktop(&relay);
    assert_eq!(epoch2, 1);
    assert_eq!(admissions(&relay, "booking"), 2.0);
}
