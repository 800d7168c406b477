//! The fleet through a database failover (SPEC §12, issue 20), on real PostgreSQL servers of
//! the test's own (`common::pg::Cluster`): a primary and its streaming replica, started from the
//! shared test server's installation, with the relay on a libpq multi-host `DATABASE_URL`.
//!
//! - The primary stops and the replica is promoted while desktops are admitted every second:
//!   no admission after the promote is refused because a pooled connection died with the old
//!   primary (each such piece of work is retried once on a fresh connection), and no desktop
//!   connected before loses its control. Before, the first admission after the promote was
//!   refused 4429.
//! - A pool that lands on a standby (a URL without `target_session_attrs=read-write`, the
//!   primary gone, nothing promoted) fails every write: `/ready` turns degraded, then 503 past
//!   the SQL grace, saying `sql_read_only` (SQLSTATE 25006). Before, it stayed 200: its probe
//!   was `SELECT 1`, which a standby answers.
//!
//! Needs `ORCA_RELAY_TEST_DATABASE_URL` (`eval "$(scripts/test-postgres.sh start)"`) for the
//! installation's binaries.

mod common;
mod harness;

use std::sync::Arc;
use std::time::Duration;

use common::pg::Cluster;
use harness::*;
use serde_json::{json, Value};
use tungstenite::Message;

const DEADLINE: Duration = Duration::from_secs(30);

/// A primary with database `relay` and its streaming replica, caught up.
fn primary_and_replica() -> (Cluster, Cluster) {
    let primary = Cluster::primary();
    primary
        .connect("postgres")
        .batch_execute("CREATE DATABASE relay")
        .expect("create the relay database");
    let replica = Cluster::replica_of(&primary);
    assert!(replica.in_recovery(), "the replica is a standby");
    assert!(
        wait_until(DEADLINE, || postgres::Client::connect(
            &replica.url("relay"),
            postgres::NoTls
        )
        .is_ok()),
        "the replica never had the relay database"
    );
    (primary, replica)
}

fn owned(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

/// One desktop's way in: `/v1/assign` at the director, then the control's hello at the cell.
/// `Ok` with the control once acknowledged; `Err` says what refused it.
fn admit(director: &Relay, cell: &Relay) -> Result<Ws, String> {
    let host = host_id();
    let user = format!("user-{host}");
    let token = es256_token(&user, &host);
    let (status, body) = director.post(
        "/v1/assign",
        Some(&token),
        &json!({"v":1,"relayHostId":host}).to_string(),
    );
    if status != 200 {
        return Err(format!("assign {status}: {body}"));
    }
    let answer: Value = serde_json::from_str(&body).map_err(|e| e.to_string())?;
    let epoch = answer["assignmentEpoch"].as_i64().unwrap_or_default();
    let mut control = ws_connect(&cell.ws_url("/v1/host/control"), Some(&token))
        .map_err(|status| format!("control upgrade {status}"))?;
    send_json(
        &mut control,
        json!({"type":"host-hello","v":1,"relayHostId":host,"assignmentEpoch":epoch}),
    );
    loop {
        match control.read() {
            Ok(Message::Text(text)) => {
                let value: Value = serde_json::from_str(&text).map_err(|e| e.to_string())?;
                match value["type"].as_str() {
                    Some("host-hello-ack") => return Ok(control),
                    Some("ping") => continue,
                    _ => return Err(format!("hello answered {value}")),
                }
            }
            Ok(Message::Close(frame)) => {
                return Err(format!(
                    "hello refused {:?}",
                    frame.map(|f| u16::from(f.code))
                ))
            }
            Ok(_) => continue,
            Err(e) => return Err(format!("hello: {e}")),
        }
    }
}

#[test]
fn a_promoted_replica_takes_over_and_no_admission_after_the_promote_is_refused() {
    let (primary, replica) = primary_and_replica();
    let jwks = jwks_server();
    let database_url = format!(
        "postgres://postgres@127.0.0.1:{},127.0.0.1:{}/relay?target_session_attrs=read-write",
        primary.port, replica.port
    );
    let shared = owned(&[
        ("DATABASE_URL", &database_url),
        ("ORCA_RELAY_SERVICE_TOKEN", SERVICE_TOKEN),
        ("ORCA_RELAY_JWKS_URL", &format!("{}/jwks.json", jwks.url())),
        ("ORCA_RELAY_AUTH_ISSUER", TEST_ISSUER),
        ("ORCA_RELAY_HEARTBEAT_MS", "500"),
        ("ORCA_RELAY_FEED_POLL_MS", "500"),
    ]);
    let mut env = shared.clone();
    env.push(("ORCA_RELAY_ROLE".into(), "director".into()));
    env.push(("ORCA_RELAY_READINESS_PROBE_MS".into(), "500".into()));
    let director = Relay::start_in(Arc::new(TempDir::new("failover-director")), &env_refs(&env));
    assert!(director
        .wait_for_log("orca_relay_migrations_applied", DEADLINE)
        .is_some());
    // The cell's own pool is what a failover leaves dead connections in: nothing but
    // admissions uses it between two of its (rare, here) probes and refreshes.
    let mut env = shared.clone();
    env.extend(owned(&[
        ("ORCA_RELAY_ROLE", "cell"),
        ("ORCA_RELAY_CELL_ID", "failover-cell"),
        ("ORCA_RELAY_DIRECTOR_URLS", &director.http_url("")),
        ("ORCA_RELAY_READINESS_PROBE_MS", "60000"),
        ("ORCA_RELAY_ADMIT_EFFECTIVE_REFRESH_MS", "60000"),
        ("ORCA_RELAY_LEASE_RENEW_MS", "60000"),
        ("ORCA_RELAY_PING_MS", "300"),
    ]));
    let cell = Relay::start_in(Arc::new(TempDir::new("failover-cell")), &env_refs(&env));

    // Desktops admitted before: the cell's pool holds connections to the primary.
    let mut before = Vec::new();
    let first = orca_relay::clock::instant();
    while before.len() < 3 {
        match admit(&director, &cell) {
            Ok(control) => before.push(control),
            Err(refused) => assert!(
                first.elapsed() < DEADLINE,
                "the fleet never admitted a desktop: {refused}\n--- cell:\n{}\n--- director:\n{}",
                cell.log_text(),
                director.log_text()
            ),
        }
    }

    primary.stop();
    replica.promote();
    assert!(!replica.in_recovery(), "promoted");

    // One admission a second after the promote, for eight seconds: none refused.
    let mut refused = Vec::new();
    let mut after = Vec::new();
    for n in 0..8 {
        match admit(&director, &cell) {
            Ok(control) => after.push(control),
            Err(why) => refused.push(format!("admission {n} after the promote: {why}")),
        }
        // The pace of the issue's check: a desktop a second.
        orca_relay::clock::sleep(Duration::from_secs(1));
    }
    assert!(
        refused.is_empty(),
        "{refused:#?}\n--- cell:\n{}\n--- director:\n{}",
        cell.log_text(),
        director.log_text()
    );
    // Every control, from before and after the promote, is still served.
    for control in before.iter_mut().chain(after.iter_mut()) {
        expect_ping(control);
    }
    assert!(
        cell.wait_for_log("orca_relay_store_connection_replaced", DEADLINE)
            .is_some(),
        "the cell's dead pooled connection was replaced:\n{}",
        cell.log_text()
    );
}

#[test]
fn a_pool_that_lands_on_a_standby_turns_ready_degraded_then_503() {
    const GRACE_MS: u64 = 3_000;
    let (primary, replica) = primary_and_replica();
    // No target_session_attrs: once the primary is gone, new connections land on the standby.
    let database_url = format!(
        "postgres://postgres@127.0.0.1:{},127.0.0.1:{}/relay",
        primary.port, replica.port
    );
    let relay = Relay::combined(&[
        ("DATABASE_URL", &database_url),
        ("ORCA_RELAY_READINESS_PROBE_MS", "200"),
        ("ORCA_RELAY_READINESS_SQL_GRACE_MS", &GRACE_MS.to_string()),
    ]);
    assert!(wait_until(DEADLINE, || relay.get("/ready").0 == 200));

    // The primary dies (a crash: its port refuses at once, with no shutting-down answer),
    // so every new connection lands on the standby, which answers and refuses writes.
    // Timed from before the crash: the last successful probe (the start of the grace) was at
    // most one probe period before it, and the crash itself may take a while on a loaded machine.
    let stopped = orca_relay::clock::instant();
    primary.crash();
    let degraded =
        r#"{"ok":true,"degraded":true,"dependency":["sql"],"failure":{"sql":"sql_read_only"}}"#;
    let unavailable = r#"{"error":"dependency_unavailable","failures":{"sql":"sql_read_only"}}"#;
    let mut seen_degraded = false;
    let answer = loop {
        let answer = relay.get("/ready");
        if answer == (200, degraded.to_string()) {
            seen_degraded = true;
        }
        if answer.0 == 503 {
            break answer;
        }
        assert!(
            stopped.elapsed() < DEADLINE,
            "/ready never turned 503 on the standby: {answer:?}\n{}",
            relay.log_text()
        );
        orca_relay::clock::sleep(Duration::from_millis(50));
    };
    assert_eq!(
        answer,
        (503, unavailable.to_string()),
        "{}",
        relay.log_text()
    );
    assert!(
        seen_degraded,
        "degraded inside the grace first:\n{}",
        relay.log_text()
    );
    assert!(
        stopped.elapsed() >= Duration::from_millis(GRACE_MS - 500),
        "503 before the grace ran out"
    );
    let entered = relay
        .wait_for_log(
            "orca_relay_readiness_grace_entered dependency=sql",
            DEADLINE,
        )
        .expect("the grace line");
    assert!(
        entered.contains("failure=sql_read_only sqlstate=25006"),
        "{entered}"
    );
    assert!(replica.in_recovery(), "nothing was promoted");
}

/// Issue 30: a director whose database is gone refuses every heartbeat and `/v1/assign` 503,
/// and logs the run once per kind (then at most once a minute with a count), and once more
/// when the database answers again, with how many failed. Before, each refusal was a WARN
/// line: 48 in an 8.2 s failover.
#[test]
fn a_database_outage_costs_the_director_one_line_per_kind_and_one_on_recovery() {
    const REFUSED: usize = 12;
    let cluster = Cluster::primary();
    cluster
        .connect("postgres")
        .batch_execute("CREATE DATABASE relay")
        .expect("create the relay database");
    let jwks = jwks_server();
    let director = Relay::start_in(
        Arc::new(TempDir::new("outage-director")),
        &[
            ("ORCA_RELAY_ROLE", "director"),
            ("DATABASE_URL", &cluster.url("relay")),
            ("ORCA_RELAY_SERVICE_TOKEN", SERVICE_TOKEN),
            ("ORCA_RELAY_JWKS_URL", &format!("{}/jwks.json", jwks.url())),
            ("ORCA_RELAY_AUTH_ISSUER", TEST_ISSUER),
        ],
    );
    let cell = json!({"v":1,"cellId":"outage-cell","cellUrl":"ws://127.0.0.1:9","region":"test",
        "incarnation":1,"internalUrl":"http://127.0.0.1:9"});
    let (status, body) = director.post(
        "/v1/admin/cells/register",
        Some(SERVICE_TOKEN),
        &cell.to_string(),
    );
    assert_eq!(status, 200, "{body}");
    let mut beat = cell.clone();
    beat["startedAt"] = json!(1);
    beat["ready"] = json!(true);
    beat["connections"] = json!(0);
    let heartbeat = || {
        director.post(
            "/v1/admin/cell-heartbeat",
            Some(SERVICE_TOKEN),
            &beat.to_string(),
        )
    };
    let assign = || {
        let host = host_id();
        let token = es256_token(&format!("user-{host}"), &host);
        director.post(
            "/v1/assign",
            Some(&token),
            &json!({"v":1,"relayHostId":host}).to_string(),
        )
    };
    assert_eq!(heartbeat().0, 200, "{}", director.log_text());

    cluster.stop();
    let store_down = |(status, body): (u16, String)| {
        assert_eq!(status, 503, "{body}");
        assert!(body.contains("relay_store_unavailable"), "{body}");
    };
    for _ in 0..REFUSED {
        store_down(heartbeat());
        store_down(assign());
    }
    assert_eq!(
        director.count_log("orca_relay_director_admin_store_failed"),
        1,
        "one line for {REFUSED} refused heartbeats:\n{}",
        director.log_text()
    );
    assert_eq!(
        director.count_log("orca_relay_assign_store_failed"),
        1,
        "one line for {REFUSED} refused assigns:\n{}",
        director.log_text()
    );

    cluster.start();
    // The pool reconnects on the next request; a refusal until then counts too.
    let answered = |request: &dyn Fn() -> (u16, String)| {
        let mut refused = REFUSED;
        loop {
            let (status, body) = request();
            if !body.contains("relay_store_unavailable") {
                assert_eq!(status, 200, "{body}\n{}", director.log_text());
                return refused;
            }
            refused += 1;
            assert!(refused < REFUSED + 1_000, "{}", director.log_text());
        }
    };
    let refused = answered(&heartbeat);
    let recovered = director
        .wait_for_log("orca_relay_director_admin_store_recovered", DEADLINE)
        .unwrap_or_else(|| panic!("no recovery line:\n{}", director.log_text()));
    assert_eq!(
        field(&recovered, "failures"),
        Some(refused.to_string()),
        "{recovered}"
    );
    let refused = answered(&assign);
    let recovered = director
        .wait_for_log("orca_relay_assign_store_recovered", DEADLINE)
        .unwrap_or_else(|| panic!("no recovery line:\n{}", director.log_text()));
    assert_eq!(
        field(&recovered, "failures"),
        Some(refused.to_string()),
        "{recovered}"
    );
    assert_eq!(
        director.count_log("orca_relay_director_admin_store_failed"),
        1
    );
    assert_eq!(director.count_log("orca_relay_assign_store_failed"), 1);
}
