//! Black-box dead-man tests (seed `dead-man-trip-slots.md`, SPEC §5.5) on a real `cell`
//! process over SQLite, with a fake director, shrunk timings and a peer cell that exists only
//! as rows in the shared database.

mod harness;

use std::sync::Arc;
use std::time::Duration;

use harness::*;
use orca_relay::store::{Store, StoreConfig};

const CELL: &str = "c-under-test";
const PEER: &str = "c-peer";

/// Shrunk timings: a 1.5 s window, claims every 300 ms, fast switch polls and row refreshes.
fn timings() -> Vec<(String, String)> {
    [
        ("ORCA_RELAY_DEAD_MAN_BASE_MS", "1500"),
        ("ORCA_RELAY_DEAD_MAN_SPREAD_MS", "0"),
        ("ORCA_RELAY_TRIP_CLAIM_RETRY_MS", "300"),
        ("ORCA_RELAY_SWITCH_POLL_MS", "50"),
        ("ORCA_RELAY_ADMIT_EFFECTIVE_REFRESH_MS", "200"),
        ("ORCA_RELAY_HEARTBEAT_MS", "200"),
        ("ORCA_RELAY_PING_MS", "200"),
    ]
    .iter()
    .map(|(k, v)| (k.to_string(), v.to_string()))
    .collect()
}

struct Setup {
    relay: Relay,
    store: Store,
    _jwks: FakeServer,
    _director: FakeServer,
}

fn start_cell(flags: serde_json::Value) -> Setup {
    let jwks = jwks_server();
    let director = accepting_director();
    let dir = Arc::new(TempDir::new("dead-man"));
    write_switch(&dir.0.join("switch.json"), CELL, 1, flags);
    let mut env = cell_env(CELL, &jwks, &[&director]);
    env.extend(timings());
    let relay = Relay::start_in(dir.clone(), &env_refs(&env));
    let store = Store::open(&StoreConfig::new(None, dir.0.join("relay.db"))).unwrap();
    Setup {
        relay,
        store,
        _jwks: jwks,
        _director: director,
    }
}

fn now() -> i64 {
    orca_relay::clock::system().now_ms() as i64
}

fn leases_for(store: &Store, relay_host_id: &str) -> usize {
    store.live_leases_for_host(relay_host_id, now()).unwrap()
}

/// A desktop admitted from a booking, as in normal reserve-mode operation.
fn booked_desktop(relay: &Relay, n: u32) -> (String, String, Ws) {
    let relay_host_id = format!("dm{n:014}");
    let user = format!("user-{n}");
    assert_eq!(relay.book(&user, &relay_host_id, 5), "ok");
    let token = es256_token(&user, &relay_host_id);
    let (control, _) = hello(relay, &token, &relay_host_id, 5).expect("booked hello");
    (relay_host_id, token, control)
}

fn metric(relay: &Relay, series: &str) -> f64 {
    relay.metric(series).unwrap_or(0.0)
}

#[test]
fn held_while_the_only_slot_is_taken_then_trips_once_the_peer_frees_it() {
    let setup = start_cell(serde_json::json!({"admitMode":"reserve","deadManTripSlots":1}));
    let relay = &setup.relay;
    // The peer holds the only slot: its operator record says reserve, its own row says db.
    setup.store.set_admit_mode(PEER, "reserve").unwrap();
    setup.store.write_admit_effective(PEER, 1, "db").unwrap();

    let mut director = DirectorPolls::start(relay);
    assert!(wait_until(Duration::from_secs(5), || metric(
        relay,
        "orca_relay_admit_mode{kind=\"raw\"}"
    ) == 1.0));
    let (host, token, mut control) = booked_desktop(relay, 1);
    assert_eq!(
        metric(
            relay,
            "orca_relay_admissions_total{path=\"booking\",outcome=\"admitted\"}"
        ),
        1.0
    );

    // The director goes quiet. The window passes; the claim is refused: held.
    director.stop();
    assert!(
        relay
            .wait_for_log(
                "orca_relay_cell_reserve_dead_man_held",
                Duration::from_secs(10)
            )
            .is_some(),
        "{}",
        relay.log_text()
    );
    assert!(wait_until(Duration::from_secs(10), || metric(
        relay,
        "orca_relay_trip_slot_claims_total{result=\"refused\"}"
    ) >= 3.0));
    assert_eq!(
        metric(relay, "orca_relay_dead_man_state{state=\"held\"}"),
        1.0
    );
    assert_eq!(
        metric(relay, "orca_relay_admit_mode{kind=\"raw\"}"),
        1.0,
        "held stays reserve"
    );
    assert_eq!(
        relay.count_log("orca_relay_cell_reserve_dead_man_held"),
        1,
        "logged once per silence"
    );
    assert_eq!(
        relay.count_log("orca_relay_cell_reserve_dead_man_tripped"),
        0
    );
    assert_eq!(leases_for(&setup.store, &host), 0, "nothing re-registered");
    // The row stays reserve and fresh.
    let row = setup.store.admit_effective(CELL).unwrap().unwrap();
    assert_eq!(row.mode, "reserve");
    assert!(now() - row.updated_at < 2_000);

    // The desktop keeps its socket (it still hears pings) ...
    expect_ping(&mut control);
    drop(control);
    // ... and a redial at the same epoch comes back from memory, with no SQL for it.
    let memory_before = metric(
        relay,
        "orca_relay_admissions_total{path=\"memory\",outcome=\"admitted\"}",
    );
    let (control, _) = hello(relay, &token, &host, 5).expect("memory redial while held");
    assert_eq!(
        metric(
            relay,
            "orca_relay_admissions_total{path=\"memory\",outcome=\"admitted\"}"
        ),
        memory_before + 1.0
    );
    assert_eq!(
        metric(
            relay,
            "orca_relay_admission_sql_statements_total{path=\"memory\"}"
        ),
        0.0
    );

    // The peer is re-armed: it writes reserve and frees the slot. This cell trips and
    // re-registers its desktop, closing no socket.
    setup
        .store
        .write_admit_effective(PEER, 1, "reserve")
        .unwrap();
    let tripped = relay
        .wait_for_log(
            "orca_relay_cell_reserve_dead_man_tripped",
            Duration::from_secs(10),
        )
        .expect("trips once the slot is free");
    assert!(tripped.contains("cell_id=c-under-test"), "{tripped}");
    assert!(relay
        .wait_for_log("orca_relay_cell_reregistered", Duration::from_secs(10))
        .is_some());
    assert!(wait_until(Duration::from_secs(5), || leases_for(
        &setup.store,
        &host
    ) == 1));
    assert_eq!(
        setup.store.admit_effective(CELL).unwrap().unwrap().mode,
        "db"
    );
    assert_eq!(
        metric(relay, "orca_relay_dead_man_state{state=\"tripped\"}"),
        1.0
    );
    let mut control = control;
    expect_ping(&mut control); // the socket survived the trip
}

#[test]
fn slot_zero_never_trips() {
    let setup = start_cell(serde_json::json!({"admitMode":"reserve","deadManTripSlots":0}));
    let relay = &setup.relay;
    let (_host, _token, mut control) = {
        let mut director = DirectorPolls::start(relay);
        assert!(wait_until(Duration::from_secs(5), || metric(
            relay,
            "orca_relay_admit_mode{kind=\"raw\"}"
        ) == 1.0));
        let desktop = booked_desktop(relay, 2);
        director.stop();
        desktop
    };
    assert!(relay
        .wait_for_log(
            "orca_relay_cell_reserve_dead_man_held",
            Duration::from_secs(10)
        )
        .is_some());
    // Ten windows of silence: no claim is ever made, nothing trips.
    let silence_started = orca_relay::clock::instant();
    while silence_started.elapsed() < Duration::from_millis(15 * 1000 / 2) {
        expect_ping(&mut control);
    }
    assert_eq!(
        relay.count_log("orca_relay_cell_reserve_dead_man_tripped"),
        0
    );
    assert_eq!(
        metric(
            relay,
            "orca_relay_trip_slot_claims_total{result=\"permit\"}"
        ),
        0.0
    );
    assert_eq!(
        metric(
            relay,
            "orca_relay_trip_slot_claims_total{result=\"refused\"}"
        ),
        0.0
    );
    assert_eq!(
        metric(relay, "orca_relay_dead_man_state{state=\"held\"}"),
        1.0
    );
}

#[test]
fn without_the_flag_the_cell_trips_as_before() {
    let setup = start_cell(serde_json::json!({"admitMode":"reserve"}));
    let relay = &setup.relay;
    let mut director = DirectorPolls::start(relay);
    assert!(wait_until(Duration::from_secs(5), || metric(
        relay,
        "orca_relay_admit_mode{kind=\"raw\"}"
    ) == 1.0));
    let (host, _token, mut control) = booked_desktop(relay, 3);
    director.stop();
    assert!(relay
        .wait_for_log(
            "orca_relay_cell_reserve_dead_man_tripped",
            Duration::from_secs(10)
        )
        .is_some());
    assert_eq!(relay.count_log("orca_relay_cell_reserve_dead_man_held"), 0);
    assert!(wait_until(Duration::from_secs(5), || leases_for(
        &setup.store,
        &host
    ) == 1));
    expect_ping(&mut control); // no socket closed by the trip
                               // Contact after the trip does not re-arm: the trip is latched.
    let mut director = DirectorPolls::start(relay);
    orca_relay::clock::sleep(Duration::from_millis(500));
    assert_eq!(metric(relay, "orca_relay_admit_mode{kind=\"raw\"}"), 0.0);
    director.stop();
    // Only a new switch write saying reserve re-arms, and it frees the slot (row reserve).
    write_switch(
        &relay.data_dir.0.join("switch.json"),
        CELL,
        2,
        serde_json::json!({"admitMode":"reserve"}),
    );
    let mut director = DirectorPolls::start(relay);
    assert!(wait_until(Duration::from_secs(5), || metric(
        relay,
        "orca_relay_admit_mode{kind=\"raw\"}"
    ) == 1.0));
    assert!(wait_until(Duration::from_secs(5), || setup
        .store
        .admit_effective(CELL)
        .unwrap()
        .is_some_and(|row| row.mode == "reserve")));
    director.stop();
}

/// Drain's admit-effective write is the cell's last (SPEC §11 "Slot liveness"): a tripped cell
/// stopped with SIGTERM leaves its row `reserve`, so its slot is free at once, not after
/// `TRIP_SLOT_STALE_MS`. Twenty times in a row, each time with a heartbeat to a slow director
/// in flight (joining that thread takes a while, and the watchdog used to keep writing `db`
/// meanwhile), and each time a held peer takes the slot on its next claim.
#[test]
fn a_tripped_cell_that_exits_frees_its_slot_every_time() {
    let jwks = jwks_server();
    // Registrations are answered at once, heartbeats only after 400 ms: one is always in flight.
    let director = FakeServer::start(|seen| {
        if seen.path.ends_with("/cell-heartbeat") {
            orca_relay::clock::sleep(Duration::from_millis(400));
        }
        (200, r#"{"v":1,"ok":true}"#.to_string())
    });
    let dir = Arc::new(TempDir::new("drain-slot"));
    write_switch(
        &dir.0.join("switch.json"),
        CELL,
        1,
        serde_json::json!({"admitMode":"reserve","deadManTripSlots":1}),
    );
    let mut env = cell_env(CELL, &jwks, &[&director]);
    env.extend(
        [
            ("ORCA_RELAY_DEAD_MAN_BASE_MS", "600"),
            ("ORCA_RELAY_DEAD_MAN_SPREAD_MS", "0"),
            ("ORCA_RELAY_TRIP_CLAIM_RETRY_MS", "100"),
            ("ORCA_RELAY_SWITCH_POLL_MS", "50"),
            ("ORCA_RELAY_ADMIT_EFFECTIVE_REFRESH_MS", "100"),
            ("ORCA_RELAY_HEARTBEAT_MS", "100"),
            ("ORCA_RELAY_DRAIN_GRACE_MS", "0"),
        ]
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string())),
    );
    let store = Store::open(&StoreConfig::new(None, dir.0.join("relay.db"))).unwrap();
    store.migrate().unwrap();
    // Both cells are reserve cells by the operator's record: a `db` row of either holds a slot.
    store.set_admit_mode(CELL, "reserve").unwrap();
    store.set_admit_mode(PEER, "reserve").unwrap();
    for round in 0..20 {
        let mut relay = Relay::start_in(dir.clone(), &env_refs(&env));
        assert!(
            relay
                .wait_for_log(
                    "orca_relay_cell_reserve_dead_man_tripped",
                    Duration::from_secs(10)
                )
                .is_some(),
            "round {round}: no trip\n{}",
            relay.log_text()
        );
        assert!(wait_until(Duration::from_secs(5), || store
            .admit_effective(CELL)
            .unwrap()
            .is_some_and(|row| row.mode == "db")));
        // The peer is held: the only slot is this cell's.
        assert!(matches!(
            store.claim_trip_slot(PEER, 1, 1, 600_000).unwrap(),
            orca_relay::store::ClaimOutcome::Refused { others_holding: 1 }
        ));

        relay.signal("TERM");
        assert_eq!(relay.wait_exit(Duration::from_secs(10)), Some(0));
        let row = store.admit_effective(CELL).unwrap().unwrap();
        assert_eq!(
            row.mode,
            "reserve",
            "round {round}: the exited cell's row still holds the slot\n{}",
            relay.log_text()
        );
        // The held peer's next claim takes the slot at once.
        assert!(
            matches!(
                store.claim_trip_slot(PEER, 1, 1, 600_000).unwrap(),
                orca_relay::store::ClaimOutcome::Permit { others_holding: 0 }
            ),
            "round {round}"
        );
        // The peer is re-armed (writes reserve), so the next round's cell can trip again.
        store.write_admit_effective(PEER, 1, "reserve").unwrap();
    }
}
