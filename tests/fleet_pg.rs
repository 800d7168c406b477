//! The fleet as a black box on a real PostgreSQL (SPEC §5.1, §5.3, §5.4, §5.6, §6): a real
//! `director` process and real `cell` processes sharing one fresh database, a local JWKS with
//! the test EC key, one service token. The cells register with the director at startup (with
//! their `internalUrl`), heartbeat to it, and the director's feed poller polls their seat feeds
//! (which keeps reserve cells' dead-man armed). Operators speak through the switch files and
//! `PUT /v1/admin/cell-admit-mode`.
//!
//! Needs `ORCA_RELAY_TEST_DATABASE_URL` (`eval "$(scripts/test-postgres.sh start)"`). Every wait
//! is on a condition with a deadline; the only fixed waits are observation windows in which
//! something must *not* happen (a switch file read again and again without effect).

mod common;
mod harness;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use harness::*;
use orca_relay::store::{Store, StoreConfig};
use serde_json::{json, Value};

const DEADLINE: Duration = Duration::from_secs(20);
/// The director's `ORCA_RELAY_HEARTBEAT_FRESH_MS`: a cell silent this long is re-placeable.
const HEARTBEAT_FRESH_MS: &str = "1500";
/// The cells' switch poll; observation windows are several of these.
const SWITCH_POLL_MS: u64 = 50;

fn wait_for(what: &str, condition: impl FnMut() -> bool) {
    assert!(
        wait_until(DEADLINE, condition),
        "timed out waiting for {what}"
    );
}

fn owned(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

/// A metric's value, 0 when the series is absent.
fn metric(relay: &Relay, series: &str) -> f64 {
    relay.metric(series).unwrap_or(0.0)
}

fn admissions(relay: &Relay, path: &str, outcome: &str) -> f64 {
    metric(
        relay,
        &format!("orca_relay_admissions_total{{path=\"{path}\",outcome=\"{outcome}\"}}"),
    )
}

fn admission_sql(relay: &Relay, path: &str) -> f64 {
    metric(
        relay,
        &format!("orca_relay_admission_sql_statements_total{{path=\"{path}\"}}"),
    )
}

fn raw_mode(relay: &Relay) -> f64 {
    metric(relay, "orca_relay_admit_mode{kind=\"raw\"}")
}

fn bookings(relay: &Relay) -> f64 {
    metric(relay, "orca_relay_bookings")
}

fn controls(relay: &Relay) -> f64 {
    metric(relay, "orca_relay_connections{kind=\"control\"}")
}

fn cell_url(cell: &Relay) -> String {
    format!("ws://{}", cell.ws)
}

fn switch_path(cell: &Relay) -> PathBuf {
    cell.data_dir.0.join("switch.json")
}

/// One director and its cells on a fresh database.
struct Fleet {
    director: Relay,
    cells: Vec<Relay>,
    store: Store,
    _jwks: FakeServer,
}

impl Fleet {
    /// Starts the director, waits for its migrations, then starts each `(cell id, switch
    /// admitMode)` with generation 1 of its switch file.
    fn start(prefix: &str, cells: &[(&str, &str)]) -> Fleet {
        Fleet::start_with(prefix, cells, &[])
    }

    /// As [`Fleet::start`], with `cell_env` added to every cell's environment.
    fn start_with(prefix: &str, cells: &[(&str, &str)], cell_env: &[(&str, &str)]) -> Fleet {
        let jwks = jwks_server();
        let database_url = common::pg::fresh_database(prefix);
        let jwks_url = format!("{}/jwks.json", jwks.url());
        let shared = owned(&[
            ("DATABASE_URL", &database_url),
            ("ORCA_RELAY_SERVICE_TOKEN", SERVICE_TOKEN),
            ("ORCA_RELAY_JWKS_URL", &jwks_url),
            ("ORCA_RELAY_AUTH_ISSUER", TEST_ISSUER),
            ("ORCA_RELAY_READINESS_PROBE_MS", "200"),
            ("ORCA_RELAY_HEARTBEAT_MS", "200"),
            ("ORCA_RELAY_HEARTBEAT_FRESH_MS", HEARTBEAT_FRESH_MS),
            ("ORCA_RELAY_FEED_POLL_MS", "100"),
        ]);
        let mut env = shared.clone();
        env.push(("ORCA_RELAY_ROLE".into(), "director".into()));
        let director = Relay::start_in(Arc::new(TempDir::new("director")), &env_refs(&env));
        assert!(
            director
                .wait_for_log("orca_relay_migrations_applied", DEADLINE)
                .is_some(),
            "director migrations: {}",
            director.log_text()
        );
        let director_url = director.http_url("");
        let cells = cells
            .iter()
            .map(|(cell_id, admit_mode)| {
                let dir = Arc::new(TempDir::new(cell_id));
                write_switch(
                    &dir.0.join("switch.json"),
                    cell_id,
                    1,
                    json!({ "admitMode": admit_mode }),
                );
                let mut env = shared.clone();
                env.extend(owned(&[
                    ("ORCA_RELAY_ROLE", "cell"),
                    ("ORCA_RELAY_CELL_ID", cell_id),
                    ("ORCA_RELAY_DIRECTOR_URLS", &director_url),
                    ("ORCA_RELAY_SWITCH_POLL_MS", &SWITCH_POLL_MS.to_string()),
                    ("ORCA_RELAY_ADMIT_EFFECTIVE_REFRESH_MS", "200"),
                ]));
                env.extend(owned(cell_env));
                Relay::start_in(dir, &env_refs(&env))
            })
            .collect();
        let store = Store::open(&StoreConfig::new(Some(database_url), PathBuf::new()))
            .expect("open the test store");
        Fleet {
            director,
            cells,
            store,
            _jwks: jwks,
        }
    }

    /// `PUT /v1/admin/cell-admit-mode` with the service token: the operator's record.
    fn record_admit_mode(&self, cell_id: &str, admit_mode: &str) {
        let answer = ureq::put(&self.director.http_url("/v1/admin/cell-admit-mode"))
            .set("Authorization", &format!("Bearer {SERVICE_TOKEN}"))
            .timeout(Duration::from_secs(10))
            .send_string(&json!({"cellId": cell_id, "admitMode": admit_mode}).to_string());
        assert!(
            matches!(&answer, Ok(response) if response.status() == 200),
            "admit-mode record for {cell_id}: {answer:?}"
        );
    }

    /// Waits until the director can place on `cell_id` as it should: registered with an
    /// internal URL, heartbeating ready, and (for a reserve cell) its feed polled twice more
    /// after the cell published `admitModeEffective = reserve`.
    fn wait_placeable(&self, cell: &Relay, cell_id: &str, reserve: bool) {
        wait_for(&format!("{cell_id} registered and ready"), || {
            self.store.list_cells().is_ok_and(|cells| {
                cells.iter().any(|row| {
                    row.cell_id == cell_id
                        && row.internal_url.is_some()
                        && row.runtime.as_ref().is_some_and(|runtime| runtime.ready)
                        && (row.admit_mode == "reserve") == reserve
                })
            })
        });
        if reserve {
            wait_for(&format!("{cell_id} effective reserve"), || {
                metric(cell, "orca_relay_admit_mode{kind=\"effective\"}") == 1.0
            });
            let polls = format!(
                "orca_relay_director_feed_polls_total{{cell_id=\"{cell_id}\",result=\"ok\"}}"
            );
            let seen = metric(&self.director, &polls);
            wait_for(&format!("two more feed polls of {cell_id}"), || {
                metric(&self.director, &polls) >= seen + 2.0
            });
        }
    }
}

/// `POST /v1/assign` on the director: (cellUrl, assignmentEpoch).
fn assign(director: &Relay, token: &str, relay_host_id: &str) -> (String, i64) {
    let (status, body) = director.post(
        "/v1/assign",
        Some(token),
        &json!({"v":1,"relayHostId":relay_host_id}).to_string(),
    );
    assert_eq!(status, 200, "assign: {body}");
    let value: Value = serde_json::from_str(&body).unwrap();
    (
        value["cellUrl"].as_str().unwrap().to_string(),
        value["assignmentEpoch"].as_i64().unwrap(),
    )
}

/// A desktop identity: (user, host, ES256 token).
fn desktop(n: u32) -> (String, String, String) {
    let relay_host_id = host_id();
    let user = format!("fleet-user-{n}-{relay_host_id}");
    let token = es256_token(&user, &relay_host_id);
    (user, relay_host_id, token)
}

/// Closes a control from the desktop's side and waits until the cell has let it go.
fn hang_up(cell: &Relay, mut control: Ws) {
    let _ = control.close(None);
    let _ = read_close(&mut control);
    wait_for("the control to leave the cell", || controls(cell) == 0.0);
}

/// The epochs of the `reserve` changes for `relay_host_id` in a cell's seat feed.
fn booked_epochs(cell: &Relay, relay_host_id: &str) -> Vec<i64> {
    let started = cell
        .wait_for_log("orca_relay_started", DEADLINE)
        .expect("started line");
    let incarnation = field(&started, "incarnation").expect("incarnation=");
    // A plain poll (no `reserver=1`): reading the feed is not dead-man contact.
    let (status, body) = cell.internal_get(&format!("/internal/seats?since={incarnation}:0"));
    assert_eq!(status, 200, "{body}");
    let feed: Value = serde_json::from_str(&body).unwrap();
    feed["changes"]
        .as_array()
        .unwrap_or_else(|| panic!("changes since seq 0: {feed}"))
        .iter()
        .filter(|change| change["kind"] == "reserve" && change["relayHostId"] == relay_host_id)
        .map(|change| change["epoch"].as_i64().unwrap())
        .collect()
}

#[test]
fn reserve_cell_admits_from_booking_then_memory_and_the_host_moves_only_when_its_cell_dies() {
    let mut fleet = Fleet::start("fleet", &[("cell-a", "reserve"), ("cell-b", "db")]);
    fleet.record_admit_mode("cell-a", "reserve");
    fleet.record_admit_mode("cell-b", "db");
    fleet.wait_placeable(&fleet.cells[1], "cell-b", false);
    fleet.wait_placeable(&fleet.cells[0], "cell-a", true);
    let (director, store) = (&fleet.director, &fleet.store);
    let (first, rest) = fleet.cells.split_at_mut(1);
    let (a, b) = (&mut first[0], &rest[0]);

    // 1. Placed through the director on the reserve cell, booked at exactly the new epoch.
    let (user, host, token) = desktop(1);
    let (url, epoch) = assign(director, &token, &host);
    assert_eq!((url.as_str(), epoch), (cell_url(a).as_str(), 1));
    let row = store.assignment(&user, &host).unwrap().expect("row");
    assert_eq!((row.cell_id.as_str(), row.epoch), ("cell-a", 1));
    assert_eq!(
        booked_epochs(a, &host),
        vec![1],
        "one booking, at the epoch answered"
    );
    assert_eq!(bookings(a), 1.0);
    assert!(director
        .wait_for_log(
            &format!("orca_relay_host_placed host={host} cell_id=cell-a epoch=1 path=booking"),
            DEADLINE
        )
        .is_some());

    // The hello is admitted once from the booking, which is consumed, with no SQL.
    let (control, _) = hello(a, &token, &host, epoch).expect("booked hello");
    assert_eq!(admissions(a, "booking", "admitted"), 1.0);
    assert_eq!(admissions(a, "database", "admitted"), 0.0);
    assert_eq!(admission_sql(a, "booking"), 0.0);
    assert_eq!(bookings(a), 0.0, "the booking was consumed");

    // The other cell refuses that epoch: the row names cell-a.
    assert_eq!(hello(b, &token, &host, epoch).err(), Some(Some(4409)));
    assert_eq!(admissions(b, "database", "wrong_cell"), 1.0);

    // 2. The desktop drops and redials at the same epoch: memory, not the (consumed) booking,
    // and the cell runs no SQL for it.
    hang_up(a, control);
    let (control, _) = hello(a, &token, &host, epoch).expect("redial from memory");
    assert_eq!(admissions(a, "memory", "admitted"), 1.0);
    assert_eq!(admissions(a, "booking", "admitted"), 1.0, "booked once");
    assert_eq!(admission_sql(a, "memory"), 0.0);
    assert_eq!(admissions(a, "database", "admitted"), 0.0);

    // 3. The pin: while cell-a heartbeats, assign answers the same cell and epoch, and books
    // nothing new.
    for _ in 0..3 {
        assert_eq!(assign(director, &token, &host), (cell_url(a), epoch));
    }
    assert_eq!(bookings(a), 0.0);
    assert_eq!(booked_epochs(a, &host), vec![1]);
    assert_eq!(store.assignment(&user, &host).unwrap().unwrap().epoch, 1);

    // 4. An epoch the cell does not know falls through to the database, which disagrees.
    hang_up(a, control);
    assert_eq!(hello(a, &token, &host, epoch + 5).err(), Some(Some(4409)));
    assert_eq!(admissions(a, "database", "wrong_cell"), 1.0);

    // 5. The switch leaves reserve: bookings are voided and refused; an earlier booking no
    // longer admits, the hello falls to the database check.
    let (user3, host3, token3) = desktop(3);
    let (url3, epoch3) = assign(director, &token3, &host3);
    assert_eq!(url3, cell_url(a));
    let (user4, host4, token4) = desktop(4);
    assert_eq!(a.book(&user4, &host4, 9), "ok", "a booking no row backs");
    assert_eq!(bookings(a), 2.0);
    write_switch(&switch_path(a), "cell-a", 2, json!({"admitMode": "db"}));
    // The raw mode turns `db` as the switch applies; from then on bookings are neither taken
    // nor honoured, and the watchdog's next tick voids (and returns the units of) the rest.
    wait_for("cell-a raw db", || raw_mode(a) == 0.0);
    assert_eq!(a.book(&user3, &host3, epoch3 + 1), "off");
    let (_control3, _) = hello(a, &token3, &host3, epoch3).expect("the row still agrees");
    assert_eq!(
        admissions(a, "database", "admitted"),
        1.0,
        "via the database"
    );
    assert_eq!(
        admissions(a, "booking", "admitted"),
        1.0,
        "not the voided booking"
    );
    assert_eq!(hello(a, &token4, &host4, 9).err(), Some(Some(4409)));
    assert_eq!(admissions(a, "database", "wrong_cell"), 2.0);
    wait_for("bookings voided", || bookings(a) == 0.0);
    let _ = user3;

    // 6. cell-a dies. Until its heartbeat is older than HEARTBEAT_FRESH_MS the host stays
    // pinned; then it is placed again, on cell-b, at a higher epoch.
    a.signal("KILL");
    assert!(a.wait_exit(DEADLINE).is_some());
    let mut moved = None;
    wait_for("the host to move to cell-b", || {
        let (url, new_epoch) = assign(director, &token, &host);
        if url == cell_url(a) {
            assert_eq!(new_epoch, epoch, "pinned answers keep the epoch");
            false
        } else {
            moved = Some((url, new_epoch));
            true
        }
    });
    let (url, new_epoch) = moved.unwrap();
    assert_eq!(url, cell_url(b));
    assert!(new_epoch > epoch, "{new_epoch} > {epoch}");
    let row = store.assignment(&user, &host).unwrap().unwrap();
    assert_eq!((row.cell_id.as_str(), row.epoch), ("cell-b", new_epoch));
    let (_control, _) = hello(b, &token, &host, new_epoch).expect("admitted on cell-b");
    assert_eq!(admissions(b, "database", "admitted"), 1.0);
}

/// One way of writing the switch file.
type SwitchWrite = fn(&Path);

/// Reads the cell's log lines for one cause of the unreadable-switch line.
fn unreadable(cell: &Relay, cause: &str) -> usize {
    cell.count_log(&format!(
        "orca_relay_control_flags_unreadable cell_id=cell-h cause={cause} "
    ))
}

#[test]
fn hostile_input_against_a_cell_changes_nothing() {
    let fleet = Fleet::start("hostile", &[("cell-h", "reserve")]);
    let cell = &fleet.cells[0];
    fleet.record_admit_mode("cell-h", "reserve");
    wait_for("cell-h raw reserve", || raw_mode(cell) == 1.0);
    // A live booking: any switch that got applied as `db` would void it.
    let (user, host, _) = desktop(9);
    assert_eq!(cell.book(&user, &host, 4), "ok");

    // The internal API: the token first, then the size, then the shape.
    let item = |epoch: i64, ttl: u64| json!({"userId": user, "relayHostId": host, "epoch": epoch, "ttlMs": ttl});
    let reserve_body =
        |items: Vec<Value>| json!({"v": 1, "directorId": "hostile", "items": items}).to_string();
    let good = reserve_body(vec![item(5, 1000)]);
    assert_eq!(cell.post("/internal/reserve", None, &good).0, 401);
    assert_eq!(cell.post("/internal/reserve", Some("wrong"), &good).0, 401);
    assert_eq!(cell.get("/internal/seats?reserver=1").0, 401);
    let huge = format!("{{\"pad\":\"{}\"}}", "x".repeat(16 * 1024));
    assert_eq!(
        cell.post("/internal/reserve", Some(SERVICE_TOKEN), &huge).0,
        413
    );
    let bad_request = |(status, body): (u16, String), reason: &str| {
        assert_eq!(status, 400, "{body}");
        let value: Value = serde_json::from_str(&body).unwrap();
        let said = value["reason"].as_str().unwrap_or_default();
        assert!(said.contains(reason), "{said:?} should mention {reason:?}");
    };
    let many: Vec<Value> = (0..65).map(|_| item(5, 1000)).collect();
    bad_request(
        cell.post(
            "/internal/reserve",
            Some(SERVICE_TOKEN),
            &reserve_body(many),
        ),
        "too_many_items",
    );
    bad_request(
        cell.post(
            "/internal/reserve",
            Some(SERVICE_TOKEN),
            &reserve_body(vec![item(-1, 1000)]),
        ),
        "epoch",
    );
    bad_request(
        cell.post(
            "/internal/reserve",
            Some(SERVICE_TOKEN),
            &reserve_body(vec![item(5, 30_001)]),
        ),
        "ttlMs",
    );
    for cursor in ["garbage", "1:-1", "x:1", ":"] {
        bad_request(
            cell.internal_get(&format!("/internal/seats?since={cursor}&reserver=1")),
            "cursor",
        );
    }
    assert_eq!(bookings(cell), 1.0, "nothing hostile booked or voided");
    assert_eq!(
        metric(cell, "orca_relay_cell_internal_unauthorized_total"),
        3.0
    );

    // The switch file: each void or stale write leaves the applied generation in place and is
    // said once, however often the watcher reads it.
    let path = switch_path(cell);
    let writes: [(&str, SwitchWrite); 4] = [
        ("bad_admit_mode", |path| {
            write_switch(path, "cell-h", 2, json!({"admitMode": "DB"}))
        }),
        ("wrong_cell_id", |path| {
            write_switch(path, "cell-other", 2, json!({"admitMode": "db"}))
        }),
        ("stale_generation", |path| {
            write_switch(path, "cell-h", 0, json!({"admitMode": "db"}))
        }),
        ("bad_json", |path| {
            let tmp = path.with_extension("tmp");
            std::fs::write(
                &tmp,
                br#"{"v":1,"cellId":"cell-h","generation":3,"flags":{"#,
            )
            .unwrap();
            std::fs::rename(&tmp, path).unwrap();
        }),
    ];
    for (cause, write) in &writes {
        write(&path);
        wait_for(&format!("the {cause} line"), || {
            unreadable(cell, cause) == 1
        });
        // Observation window: the watcher reads the same file several more times.
        orca_relay::clock::sleep(Duration::from_millis(SWITCH_POLL_MS * 6));
        assert_eq!(unreadable(cell, cause), 1, "{cause} said once");
        assert_eq!(raw_mode(cell), 1.0, "{cause} changed nothing");
        assert_eq!(bookings(cell), 1.0, "{cause} voided nothing");
    }
    assert_eq!(cell.count_log("orca_relay_cell_flags_applied"), 1);

    // A proper write with a higher generation is applied: the watcher was reading all along.
    write_switch(&path, "cell-h", 3, json!({"admitMode": "db"}));
    wait_for("generation 3 applied", || {
        raw_mode(cell) == 0.0 && bookings(cell) == 0.0
    });
    assert!(
        cell.wait_for_log_count("orca_relay_cell_flags_applied", 2, DEADLINE),
        "generation 3 applied once:\n{}",
        cell.log_text()
    );
    for (cause, _) in &writes {
        assert_eq!(unreadable(cell, cause), 1, "{cause} said once in all");
    }
}

/// SPEC §11 "A draining cell is never a pin": the drain frame sends desktops back to the
/// director, which must place them on another cell at once, not answer 503
/// `relay_home_cell_unavailable` until the draining cell is gone. Then the cell deregisters on
/// its clean exit: the director forgets it at once, without waiting for it to retire.
#[test]
fn a_desktop_of_a_draining_cell_is_placed_elsewhere_within_a_second() {
    let mut fleet = Fleet::start_with(
        "drain_pin",
        &[("cell-d", "reserve"), ("cell-e", "db")],
        &[("ORCA_RELAY_DRAIN_GRACE_MS", "10000")],
    );
    fleet.record_admit_mode("cell-d", "reserve");
    fleet.record_admit_mode("cell-e", "db");
    fleet.wait_placeable(&fleet.cells[1], "cell-e", false);
    fleet.wait_placeable(&fleet.cells[0], "cell-d", true);
    let (director, store) = (&fleet.director, &fleet.store);
    let (first, rest) = fleet.cells.split_at_mut(1);
    let (d, e) = (&mut first[0], &rest[0]);

    // Booked on the reserve cell, connected, pinned there while it runs.
    let (_user, host, token) = desktop(20);
    let (url, epoch) = assign(director, &token, &host);
    assert_eq!(url, cell_url(d));
    let (mut control, _) = hello(d, &token, &host, epoch).expect("booked hello");
    assert_eq!(
        assign(director, &token, &host),
        (cell_url(d), epoch),
        "pinned"
    );

    // SIGTERM: the cell tells its desktops to go back to the director.
    d.signal("TERM");
    let drain = read_json(&mut control);
    assert_eq!(drain["type"], "drain", "{drain}");
    assert_eq!(drain["recovery"], "resolve-director");

    // The desktop asks (as a client would, retrying fast): a new placement within 1 s.
    let asked = orca_relay::clock::instant();
    let mut answers = Vec::new();
    let placed = loop {
        let (status, body) = director.post(
            "/v1/assign",
            Some(&token),
            &json!({"v":1,"relayHostId":host,"reconnect":true}).to_string(),
        );
        if status == 200 {
            let value: Value = serde_json::from_str(&body).unwrap();
            let url = value["cellUrl"].as_str().unwrap().to_string();
            if url == cell_url(e) {
                break (url, value["assignmentEpoch"].as_i64().unwrap());
            }
        }
        answers.push((status, body));
        assert!(
            asked.elapsed() < Duration::from_secs(1),
            "no new placement within 1 s; answers: {answers:?}"
        );
        orca_relay::clock::sleep(Duration::from_millis(50));
    };
    let elapsed = asked.elapsed();
    assert!(placed.1 > epoch, "a new epoch: {placed:?}");
    eprintln!("drain_pin: placed on cell-e {elapsed:?} after asking ({answers:?} before)");
    let (_moved, _) = hello(e, &token, &host, placed.1).expect("admitted on cell-e");

    // The old control goes; the draining cell finishes early and deregisters on its way out.
    let _ = control.close(None);
    assert_eq!(d.wait_exit(DEADLINE), Some(0), "{}", d.log_text());
    assert!(d
        .wait_for_log("orca_relay_cell_deregistered cell_id=cell-d", DEADLINE)
        .is_some());
    assert!(director
        .wait_for_log(
            "orca_relay_director_cell_deregistered cell_id=cell-d",
            DEADLINE
        )
        .is_some());
    let cells = store.list_cells().unwrap();
    assert_eq!(
        cells.iter().map(|c| c.cell_id.as_str()).collect::<Vec<_>>(),
        vec!["cell-e"],
        "the exited cell is no longer registered"
    );
    // Its row says reserve (the drain's last write): it holds no trip slot.
    assert_eq!(
        store.admit_effective("cell-d").unwrap().map(|row| row.mode),
        Some("reserve".to_string())
    );
}
