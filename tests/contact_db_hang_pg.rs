//! A director keeps polling its cells while its database hangs (found by the nemesis,
//! `tests/nemesis_fleet.rs` seed 1, issue 21).
//!
//! The feed poll is the dead-man contact (SPEC §5.5, §6.2), and the poller is meant to go on
//! from the last known cell list while the database is down. It did while the database
//! refused connections (a stopped server fails at once), but it listed the cells inline,
//! before every round: a database that stops answering without refusing (a network partition,
//! a server stuck in I/O) held each round for the whole connect or statement wait, so no cell
//! was polled, every reserve cell's window passed with its director up and reachable, and the
//! cells were held or tripped. Here a real director reaches PostgreSQL through a proxy that
//! stops forwarding (a partition in which the proxy's kernel still acknowledges bytes), and a
//! stand-in cell counts the seat-feed polls it gets meanwhile.
//!
//! With the cells listed by a thread of their own, a second gap (the nemesis's 30-minute run,
//! seed 7): a cell that registered with a director just before the database stopped was not in
//! that director's last list, so the director, up and in contact with it, did not poll it
//! until the database came back, and the cell held past its window. A director polls a cell
//! it saw register even when the database cannot list it.
//!
//! And the same run's other defect: two cells drained and never exited, their readiness
//! prober inside a database call that never returned, the drain's end joining it. A cell whose
//! database hangs drains and exits.

mod common;
mod harness;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use harness::*;

const FEED_POLL_MS: u64 = 100;

/// A TCP proxy to PostgreSQL that can stop forwarding (and hold new connections) on demand.
struct HoldingProxy {
    addr: SocketAddr,
    hold: Arc<AtomicBool>,
}

impl HoldingProxy {
    fn start(upstream: SocketAddr) -> HoldingProxy {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind the proxy");
        let addr = listener.local_addr().expect("proxy address");
        let hold = Arc::new(AtomicBool::new(false));
        let flag = hold.clone();
        orca_relay::threads::spawn("test-proxy", move || {
            for client in listener.incoming().map_while(Result::ok) {
                let flag = flag.clone();
                let _ = orca_relay::threads::spawn("test-proxy-conn", move || {
                    let Ok(server) = TcpStream::connect(upstream) else {
                        return;
                    };
                    let (c2, s2) = (client.try_clone().unwrap(), server.try_clone().unwrap());
                    let flag2 = flag.clone();
                    let _ = orca_relay::threads::spawn("test-proxy-up", move || {
                        forward(c2, s2, &flag2)
                    });
                    forward(server, client, &flag);
                });
            }
        })
        .expect("spawn the proxy");
        HoldingProxy { addr, hold }
    }
}

fn forward(mut from: TcpStream, mut to: TcpStream, hold: &AtomicBool) {
    let _ = from.set_read_timeout(Some(Duration::from_millis(20)));
    let mut buf = [0u8; 16 * 1024];
    loop {
        if hold.load(Ordering::SeqCst) {
            orca_relay::clock::sleep(Duration::from_millis(10));
            continue;
        }
        match from.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => {
                if to.write_all(&buf[..n]).is_err() {
                    break;
                }
            }
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock
                        | std::io::ErrorKind::TimedOut
                        | std::io::ErrorKind::Interrupted
                ) => {}
            Err(_) => break,
        }
    }
    let _ = to.shutdown(std::net::Shutdown::Both);
}

fn feed_polls(cell: &FakeServer) -> usize {
    cell.seen()
        .iter()
        .filter(|seen| seen.path.starts_with("/internal/seats") && seen.path.contains("reserver=1"))
        .count()
}

/// The host and port of the test server behind `database_url`.
fn upstream_of(database_url: &str) -> SocketAddr {
    let config: postgres::Config = database_url.parse().expect("a database URL");
    let host = match &config.get_hosts()[0] {
        postgres::config::Host::Tcp(host) => host.clone(),
        other => panic!("a TCP test server, not {other:?}"),
    };
    let port = config.get_ports().first().copied().unwrap_or(5432);
    format!("{host}:{port}").parse().expect("host:port")
}

/// A director reaching its database through a [`HoldingProxy`], and a stand-in cell `cell_id`
/// that answers the seat feed and counts the polls.
struct Setup {
    proxy: HoldingProxy,
    cell: FakeServer,
    director: Relay,
    _jwks: FakeServer,
}

fn setup(name: &str, cell_id: &'static str, feed_poll_ms: u64) -> Setup {
    let database_url = common::pg::fresh_database(name);
    let upstream = upstream_of(&database_url);
    let proxy = HoldingProxy::start(upstream);
    let through_proxy = database_url.replacen(
        &format!("{}", upstream.port()),
        &format!("{}", proxy.addr.port()),
        1,
    );
    assert_ne!(through_proxy, database_url);

    let cell = FakeServer::start(move |seen| {
        if seen.path.starts_with("/internal/seats") {
            (
                200,
                serde_json::json!({"v":1,"cellId":cell_id,"incarnation":1,"seq":0,
                    "admitModeRaw":"reserve","admitModeEffective":"reserve","draining":false,
                    "counts":{},"full":[]})
                .to_string(),
            )
        } else {
            (404, "{}".into())
        }
    });
    let jwks = jwks_server();
    let jwks_url = format!("{}/jwks.json", jwks.url());
    let poll = feed_poll_ms.to_string();
    let director = Relay::start_in(
        Arc::new(TempDir::new(name)),
        &[
            ("ORCA_RELAY_ROLE", "director"),
            ("DATABASE_URL", &through_proxy),
            ("ORCA_RELAY_SERVICE_TOKEN", SERVICE_TOKEN),
            ("ORCA_RELAY_JWKS_URL", &jwks_url),
            ("ORCA_RELAY_AUTH_ISSUER", TEST_ISSUER),
            ("ORCA_RELAY_FEED_POLL_MS", &poll),
        ],
    );
    Setup {
        proxy,
        cell,
        director,
        _jwks: jwks,
    }
}

fn register(setup: &Setup, cell_id: &str) {
    let registration = serde_json::json!({"v":1,"cellId":cell_id,"cellUrl":"ws://127.0.0.1:9",
        "region":"test","incarnation":1,"internalUrl":setup.cell.url()});
    let (status, body) = setup.director.post(
        "/v1/admin/cells/register",
        Some(SERVICE_TOKEN),
        &registration.to_string(),
    );
    assert_eq!(status, 200, "{body}");
}

#[test]
fn a_director_keeps_polling_its_cells_while_its_database_hangs() {
    let setup = setup("contact_db_hang", "c-hang", FEED_POLL_MS);
    register(&setup, "c-hang");
    let cell = &setup.cell;
    assert!(
        wait_until(Duration::from_secs(10), || feed_polls(cell) >= 3),
        "the director polls the registered cell"
    );

    // The database stops answering (nothing refused, nothing answered).
    setup.proxy.hold.store(true, Ordering::SeqCst);
    // Long enough for rounds to begin with a listing that now waits.
    orca_relay::clock::sleep(Duration::from_millis(5 * FEED_POLL_MS));
    let before = feed_polls(cell);
    // An observation window: the polls must go on at their period (SPEC §11: a live cell's
    // contact interval stays within 2 x FEED_POLL_MS).
    orca_relay::clock::sleep(Duration::from_secs(3));
    let during = feed_polls(cell) - before;
    setup.proxy.hold.store(false, Ordering::SeqCst);
    assert!(
        during >= (3_000 / (2 * FEED_POLL_MS)) as usize,
        "{during} polls in 3 s while the database hung (period {FEED_POLL_MS} ms); director log:\n{}",
        setup.director.log_text()
    );
}

/// The nemesis's 30-minute run (seed 7, t=1,083.8 s): the database stopped 120 ms after a cell
/// registered, before the director's next listing. The period here is long (2 s), so the
/// database stops well before the next listing; the director must poll the cell all the same,
/// within two periods, and keep polling it through the outage.
#[test]
fn a_cell_that_registered_just_before_the_database_stopped_is_polled_through_the_outage() {
    const PERIOD_MS: u64 = 2_000;
    let setup = setup("contact_db_hang_new_cell", "c-new", PERIOD_MS);
    // Let the lister take its first list (the cell is not in it), then register and stop the
    // database at once.
    assert!(
        setup
            .director
            .wait_for_log(
                "orca_relay_director_feed_poller_started",
                Duration::from_secs(30)
            )
            .is_some(),
        "{}",
        setup.director.log_text()
    );
    register(&setup, "c-new");
    setup.proxy.hold.store(true, Ordering::SeqCst);
    let cell = &setup.cell;
    let polled = wait_until(Duration::from_millis(6 * PERIOD_MS), || {
        feed_polls(cell) >= 2
    });
    let polls = feed_polls(cell);
    setup.proxy.hold.store(false, Ordering::SeqCst);
    assert!(
        polled,
        "{polls} polls in {} ms of a cell that registered just before the database stopped \
         (period {PERIOD_MS} ms); director log:\n{}",
        6 * PERIOD_MS,
        setup.director.log_text()
    );
}

/// The nemesis's 30-minute run (its first): two cells drained and never exited; each one's
/// `readiness` thread waited inside a database call (`do_epoll_wait`) and the drain's end was
/// joining it. Here the cell's database stops answering (the proxy holds every byte), its
/// prober's next probe waits, and the cell is sent SIGTERM: it must drain and exit.
#[test]
fn a_cell_whose_database_hangs_drains_and_exits() {
    let database_url = common::pg::fresh_database("drain_db_hang");
    let proxy = HoldingProxy::start(upstream_of(&database_url));
    let through_proxy = database_url.replacen(
        &format!(":{}", upstream_of(&database_url).port()),
        &format!(":{}", proxy.addr.port()),
        1,
    );
    let jwks = jwks_server();
    let jwks_url = format!("{}/jwks.json", jwks.url());
    let director = Relay::start_in(
        Arc::new(TempDir::new("drain-db-hang-director")),
        &[
            ("ORCA_RELAY_ROLE", "director"),
            ("DATABASE_URL", &database_url),
            ("ORCA_RELAY_SERVICE_TOKEN", SERVICE_TOKEN),
            ("ORCA_RELAY_JWKS_URL", &jwks_url),
            ("ORCA_RELAY_AUTH_ISSUER", TEST_ISSUER),
        ],
    );
    let director_url = director.http_url("");
    let mut cell = Relay::start_in(
        Arc::new(TempDir::new("drain-db-hang-cell")),
        &[
            ("ORCA_RELAY_ROLE", "cell"),
            ("ORCA_RELAY_CELL_ID", "c-drain"),
            ("DATABASE_URL", &through_proxy),
            ("ORCA_RELAY_SERVICE_TOKEN", SERVICE_TOKEN),
            ("ORCA_RELAY_JWKS_URL", &jwks_url),
            ("ORCA_RELAY_AUTH_ISSUER", TEST_ISSUER),
            ("ORCA_RELAY_DIRECTOR_URLS", &director_url),
            ("ORCA_RELAY_READINESS_PROBE_MS", "100"),
            ("ORCA_RELAY_DRAIN_GRACE_MS", "500"),
        ],
    );
    assert!(
        wait_until(Duration::from_secs(30), || cell.get("/ready").0 == 200),
        "the cell becomes ready: {}",
        cell.log_text()
    );
    // The database stops answering; a probe that started since waits. Probes succeed every
    // 100 ms until then, so a last success more than a second old is a probe that waits.
    proxy.hold.store(true, Ordering::SeqCst);
    let probe_waits = wait_until(Duration::from_secs(30), || {
        let (_, metrics) = cell.get("/metrics");
        metrics.lines().any(|line| {
            line.starts_with("orca_relay_readiness_last_success_age_seconds{dependency=\"sql\"}")
                && line
                    .rsplit(' ')
                    .next()
                    .and_then(|v| v.parse::<f64>().ok())
                    .is_some_and(|age| age > 1.0)
        })
    });
    assert!(probe_waits, "the SQL probe waits: {}", cell.log_text());
    cell.signal("TERM");
    let exited = cell.wait_exit(Duration::from_secs(30));
    let waits = if exited.is_none() {
        thread_waits(cell.pid())
    } else {
        String::new()
    };
    proxy.hold.store(false, Ordering::SeqCst);
    assert!(
        exited.is_some(),
        "the drained cell did not exit within 30 s while its database hung; its threads \
         wait in {waits}; its log:\n{}",
        cell.log_text()
    );
}

/// Each thread of process `pid` with where it waits in the kernel (`comm:wchan`).
fn thread_waits(pid: u32) -> String {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return "(gone)".into();
    };
    let mut waits: Vec<String> = tasks
        .filter_map(Result::ok)
        .map(|task| {
            let read = |name: &str| {
                std::fs::read_to_string(task.path().join(name))
                    .unwrap_or_default()
                    .trim()
                    .to_string()
            };
            format!("{}:{}", read("comm"), read("wchan"))
        })
        .collect();
    waits.sort();
    waits.join(" ")
}

/// Issue 32: a thread that waits on the database is not a wedged thread. A combined relay whose
/// database stops answering (the proxy holds every byte) has its readiness prober, claim loop,
/// heartbeat and feed lister all inside database calls for longer than a thread's 5 s bound:
/// `/health` stays 200 throughout (an autohealing probe that replaced every cell whose database
/// hangs would not cure the database), and nothing is logged stale.
#[test]
fn a_process_whose_database_hangs_is_not_judged_wedged() {
    let database_url = common::pg::fresh_database("liveness_db_hang");
    let proxy = HoldingProxy::start(upstream_of(&database_url));
    let through_proxy = database_url.replacen(
        &format!(":{}", upstream_of(&database_url).port()),
        &format!(":{}", proxy.addr.port()),
        1,
    );
    let relay = Relay::start_in(
        Arc::new(TempDir::new("liveness-db-hang")),
        &[
            ("DATABASE_URL", &through_proxy),
            ("ORCA_RELAY_READINESS_PROBE_MS", "100"),
            ("ORCA_RELAY_HEARTBEAT_MS", "200"),
            ("ORCA_RELAY_FEED_POLL_MS", "200"),
            ("ORCA_RELAY_ADMIT_EFFECTIVE_REFRESH_MS", "200"),
        ],
    );
    assert_eq!(relay.get("/health"), (200, r#"{"ok":true}"#.to_string()));
    proxy.hold.store(true, Ordering::SeqCst);
    let held = orca_relay::clock::instant();
    let mut answers = Vec::new();
    while held.elapsed() < Duration::from_secs(9) {
        answers.push(relay.get("/health"));
        orca_relay::clock::sleep(Duration::from_millis(250));
    }
    // The calls were waiting all along (the prober's last success is as old as the hold),
    // not the threads idle.
    let sql_age = relay
        .metric("orca_relay_readiness_last_success_age_seconds{dependency=\"sql\"}")
        .unwrap_or(0.0);
    proxy.hold.store(false, Ordering::SeqCst);
    let failed: Vec<_> = answers.iter().filter(|answer| answer.0 != 200).collect();
    assert!(
        failed.is_empty(),
        "{} of {} /health answers failed while the database hung: {failed:?}\n{}",
        failed.len(),
        answers.len(),
        relay.log_text()
    );
    assert_eq!(
        relay.count_log("orca_relay_thread_stale"),
        0,
        "{}",
        relay.log_text()
    );
    assert!(
        sql_age > 8.0,
        "the SQL probe's last success was {sql_age} s old"
    );
}
