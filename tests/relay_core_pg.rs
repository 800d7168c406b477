//! Black-box tests of the relay core (SPEC §5.2, §5.3 db mode, §6.1) on the combined role with
//! `DATABASE_URL` pointing at a fresh PostgreSQL database: the real binary, real sockets, a real
//! WebSocket client, and `pg_stat_activity` read from outside the process.
//!
//! Needs `ORCA_RELAY_TEST_DATABASE_URL` (`eval "$(scripts/test-postgres.sh start)"`); each test
//! creates its own database. Waiting is always on a condition with a deadline.

mod common;
mod harness;

use std::collections::BTreeMap;
use std::time::Duration;

use harness::*;
use orca_relay::store::{Store, StoreConfig};
use tungstenite::Message;

/// The `application_name` of the test's own observer connections, so that they are told apart
/// from the relay's in `pg_stat_activity`.
const OBSERVER: &str = "orca-relay-test-observer";

struct PgRelay {
    relay: Relay,
    /// The test's own view of the relay's database.
    store: Store,
    url: String,
    database: String,
    cell_id: String,
}

fn start_combined(cell_id: &str, extra: &[(&str, &str)]) -> PgRelay {
    let url = common::pg::fresh_database(cell_id);
    let mut env = vec![
        ("DATABASE_URL", url.as_str()),
        ("ORCA_RELAY_CELL_ID", cell_id),
    ];
    env.extend_from_slice(extra);
    let relay = Relay::combined(&env);
    assert!(
        wait_until(Duration::from_secs(20), || relay.get("/ready").0 == 200),
        "the combined role never became ready on PostgreSQL; log:\n{}",
        relay.log_text()
    );
    let mut config = StoreConfig::new(Some(url.clone()), std::path::PathBuf::new());
    config.application_name = OBSERVER.to_string();
    config.pool_max = 2;
    config.pool_ceiling = 2;
    let store = Store::open(&config).expect("open the observer store");
    PgRelay {
        relay,
        store,
        database: common::pg::database_name(&url),
        url,
        cell_id: cell_id.to_string(),
    }
}

fn now() -> i64 {
    orca_relay::clock::system().now_ms() as i64
}

fn leases(setup: &PgRelay, relay_host_id: &str) -> usize {
    setup
        .store
        .live_leases_for_host(relay_host_id, now())
        .expect("read the lease rows")
}

/// Client connections to the relay's database by `application_name`, leaving out the test's
/// own observer connections.
fn client_connections_by_name(setup: &PgRelay) -> BTreeMap<String, i64> {
    let mut admin = common::pg::admin_client();
    admin
        .query(
            "SELECT application_name, count(*) FROM pg_stat_activity
             WHERE datname = $1 AND backend_type = 'client backend' AND application_name <> $2
             GROUP BY application_name",
            &[&setup.database, &OBSERVER],
        )
        .expect("read pg_stat_activity")
        .iter()
        .map(|row| (row.get::<_, String>(0), row.get::<_, i64>(1)))
        .collect()
}

fn round_trip(phone: &mut Ws, leg: &mut Ws, message: Message) {
    let what = format!(
        "{} frame of {} B",
        if message.is_text() { "text" } else { "binary" },
        message.len()
    );
    phone.send(message.clone()).expect("phone sends");
    assert_eq!(
        leg.read().expect("leg reads"),
        message,
        "phone->host {what}"
    );
    leg.send(message.clone()).expect("leg sends");
    assert_eq!(
        phone.read().expect("phone reads"),
        message,
        "host->phone {what}"
    );
}

#[test]
fn desktop_phone_and_lease_lifecycle_on_postgres() {
    let setup = start_combined("pgcore", &[]);
    let relay = &setup.relay;

    // A desktop gets an epoch from /v1/assign, connects and is acked; its db-mode admission
    // took the control's activity lease.
    let mut desktop = Desktop::connect(relay);
    assert_eq!(desktop.generation, 1);
    assert!(desktop.epoch >= 1);
    assert_eq!(
        leases(&setup, &desktop.relay_host_id),
        1,
        "lease while connected"
    );
    assert_eq!(
        relay.metric("orca_relay_admissions_total{path=\"database\",outcome=\"admitted\"}"),
        Some(1.0)
    );

    // A phone with an invite is spliced; frames pass unchanged both ways.
    let (mut phone, mut leg) = splice(relay, &mut desktop);
    for size in [1usize, 64 * 1024, 8 * 1024 * 1024] {
        let binary: Vec<u8> = (0..size).map(|n| (n * 31 + 7) as u8).collect();
        round_trip(&mut phone, &mut leg, Message::binary(binary));
        let text: String = (0..size).map(|n| (b'a' + (n % 26) as u8) as char).collect();
        round_trip(&mut phone, &mut leg, Message::text(text));
    }

    // A hello at the wrong epoch is refused 4409 and takes no lease.
    let other_host = host_id();
    let other_token = token(&format!("user-{other_host}"), &other_host);
    let epoch = assign(relay, &other_token, &other_host);
    assert_eq!(
        hello(relay, &other_token, &other_host, epoch + 1).err(),
        Some(Some(4409))
    );
    assert_eq!(leases(&setup, &other_host), 0);

    // Every PostgreSQL connection of the process carries its application name.
    let expected = format!("orca-relay:combined:{}", setup.cell_id);
    let names = client_connections_by_name(&setup);
    assert!(
        names.get(&expected).is_some_and(|count| *count >= 1),
        "no connection named {expected}: {names:?}"
    );
    assert_eq!(
        names.keys().collect::<Vec<_>>(),
        vec![&expected],
        "every connection of the process is named {expected}"
    );
    assert_eq!(
        common::pg::connections_named(&mut common::pg::admin_client(), &setup.database, &expected),
        names[&expected]
    );

    // The desktop leaves: its lease row goes with it.
    drop(phone);
    drop(leg);
    let host = desktop.relay_host_id.clone();
    drop(desktop);
    assert!(
        wait_until(Duration::from_secs(10), || leases(&setup, &host) == 0),
        "the lease row outlived the control"
    );
}

#[test]
fn a_moved_placement_drains_the_control_then_closes_it_4503() {
    let setup = start_combined("pgmove", &[("ORCA_RELAY_LEASE_RENEW_MS", "200")]);
    let relay = &setup.relay;
    let mut desktop = Desktop::connect(relay);
    let host = desktop.relay_host_id.clone();
    assert_eq!(leases(&setup, &host), 1);
    // Renewals keep the lease while the placement stands: its row is written again.
    let mut db = common::pg::connect(&setup.url);
    let mut lease_updated_at = || -> i64 {
        db.query_one(
            "SELECT updated_at FROM relay_assignment_activity_leases WHERE relay_host_id = $1",
            &[&host],
        )
        .expect("one lease row")
        .get(0)
    };
    let taken_at = lease_updated_at();
    assert!(
        wait_until(Duration::from_secs(5), || lease_updated_at() > taken_at),
        "the lease is renewed"
    );
    assert_eq!(relay.count_log("orca_relay_control_lease_moved"), 0);

    // The placement moves: the same host is assigned again at a new epoch.
    let moved_to = assign(relay, &desktop.token, &host);
    assert!(moved_to > desktop.epoch, "{moved_to} > {}", desktop.epoch);
    let drain = read_json(&mut desktop.control);
    assert_eq!(drain["type"], "drain", "{drain}");
    assert_eq!(drain["recovery"], "resolve-director", "{drain}");
    assert_eq!(read_close(&mut desktop.control), Some(4503));
    assert!(relay
        .wait_for_log("orca_relay_control_lease_moved", Duration::from_secs(5))
        .is_some());
    assert!(
        wait_until(Duration::from_secs(5), || leases(&setup, &host) == 0),
        "the moved control's lease row is gone"
    );

    // Recovering through the director: the new epoch is admitted with a fresh lease.
    let (_control, _) = hello(relay, &desktop.token, &host, moved_to).expect("new epoch");
    assert_eq!(leases(&setup, &host), 1);
}

/// A control admitted through the database runs its SQL (the `postgres` client, its runtime
/// included) on its relay thread: that stack still fits what the capacity plan counts per
/// connection (`threads::RELAY_STACK_RESIDENT_BYTES`), measured as the resident part of every
/// relay thread's stack mapping after 20 database admissions.
#[test]
fn database_admitted_controls_stay_within_the_planned_stack() {
    let setup = start_combined("pgstack", &[]);
    let relay = &setup.relay;
    let desktops: Vec<Desktop> = (0..20).map(|_| Desktop::connect(relay)).collect();
    assert_eq!(
        relay.metric("orca_relay_admissions_total{path=\"database\",outcome=\"admitted\"}"),
        Some(20.0)
    );
    let (stacks, most, mean) = relay_stacks(relay.pid());
    eprintln!("{stacks} relay stacks: {most} bytes resident at most, {mean} on average");
    assert!(stacks >= 20, "{stacks} relay stacks");
    assert!(
        most <= orca_relay::threads::RELAY_STACK_RESIDENT_BYTES as u64,
        "a database-admitted control's stack holds {most} bytes, over what the plan counts"
    );
    drop(desktops);
}
