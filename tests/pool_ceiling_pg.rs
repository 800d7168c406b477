//! The hard bound on a cell's database connections (SPEC §5.5 "Hard bound"), black-box: a real
//! `cell` process on PostgreSQL with `POOL_MAX=8` and `POOL_RESERVE_MAX=3`, a fake director,
//! and its dead-man kept armed by `reserver=1` polls from the test. `pg_stat_activity` is
//! sampled from outside the process while bursts of database-bound hellos hit the cell.
//!
//! To make the database work overlap, the test holds a `FOR UPDATE` lock on the placement rows
//! of a burst's hosts: every hello's admission (`SELECT … FOR SHARE` on that row) then blocks
//! inside the database holding its pooled connection, until the test releases the lock.
//!
//! Needs `ORCA_RELAY_TEST_DATABASE_URL` (`eval "$(scripts/test-postgres.sh start)"`).

mod common;
mod harness;

use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use harness::*;
use orca_relay::store::{Store, StoreConfig};

const CELL: &str = "c-pool-ceiling";
const POOL_MAX: i64 = 8;
const RESERVE_MAX: i64 = 3;
/// Desktops per burst.
const BURST: u32 = 20;
/// Every burst's desktops dial this epoch; the cell never booked it and never saw them.
const EPOCH: i64 = 7;
const DEADLINE: Duration = Duration::from_secs(15);
/// How long a burst's lock is held at most: below the cell's 5 s statement timeout, so that no
/// blocked admission times out (a discarded connection's backend may linger in
/// `pg_stat_activity` while its replacement opens) and the bound is read on healthy
/// connections only.
const LOCK_BUDGET: Duration = Duration::from_secs(4);

fn now() -> i64 {
    orca_relay::clock::system().now_ms() as i64
}

/// Samples the cell's connections in `pg_stat_activity` every few milliseconds on its own
/// thread, keeping the latest value and the peak since the last [`Sampler::reset`].
struct Sampler {
    running: Arc<AtomicBool>,
    latest: Arc<AtomicI64>,
    peak: Arc<AtomicI64>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Sampler {
    fn start(database: &str, application_name: &str) -> Sampler {
        let running = Arc::new(AtomicBool::new(true));
        let latest = Arc::new(AtomicI64::new(0));
        let peak = Arc::new(AtomicI64::new(0));
        let thread = {
            let (running, latest, peak) = (running.clone(), latest.clone(), peak.clone());
            let (database, application_name) = (database.to_string(), application_name.to_string());
            let mut admin = common::pg::admin_client();
            orca_relay::threads::spawn("test-pg-sampler", move || {
                while running.load(Ordering::Acquire) {
                    let count =
                        common::pg::connections_named(&mut admin, &database, &application_name);
                    latest.store(count, Ordering::Release);
                    peak.fetch_max(count, Ordering::AcqRel);
                    orca_relay::clock::sleep(Duration::from_millis(5));
                }
            })
            .unwrap()
        };
        Sampler {
            running,
            latest,
            peak,
            thread: Some(thread),
        }
    }

    fn latest(&self) -> i64 {
        self.latest.load(Ordering::Acquire)
    }

    fn peak(&self) -> i64 {
        self.peak.load(Ordering::Acquire)
    }

    /// Starts a new peak from the current count.
    fn reset(&self) {
        self.peak.store(self.latest(), Ordering::Release);
    }
}

impl Drop for Sampler {
    fn drop(&mut self) {
        self.running.store(false, Ordering::Release);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

struct Setup {
    relay: Relay,
    store: Store,
    url: String,
    database: String,
    application_name: String,
    _jwks: FakeServer,
    _director: FakeServer,
}

fn start_cell() -> Setup {
    let url = common::pg::fresh_database("pool_ceiling");
    // The cell migrates at start; doing it first lets the test write placement rows at once.
    let mut config = StoreConfig::new(Some(url.clone()), std::path::PathBuf::new());
    config.application_name = "orca-relay-test-observer".into();
    config.pool_max = 2;
    config.pool_ceiling = 2;
    let store = Store::open(&config).unwrap();
    store.migrate().unwrap();

    let jwks = jwks_server();
    let director = accepting_director();
    let dir = Arc::new(TempDir::new("pool-ceiling"));
    write_switch(
        &dir.0.join("switch.json"),
        CELL,
        1,
        serde_json::json!({"admitMode":"reserve"}),
    );
    let mut env = cell_env(CELL, &jwks, &[&director]);
    for (name, value) in [
        ("DATABASE_URL", url.as_str()),
        ("ORCA_RELAY_DATABASE_POOL_MAX", "8"),
        ("ORCA_RELAY_DATABASE_POOL_RESERVE_MAX", "3"),
        ("ORCA_RELAY_DEAD_MAN_BASE_MS", "2000"),
        ("ORCA_RELAY_DEAD_MAN_SPREAD_MS", "0"),
        ("ORCA_RELAY_SWITCH_POLL_MS", "50"),
        ("ORCA_RELAY_ADMIT_EFFECTIVE_REFRESH_MS", "200"),
        ("ORCA_RELAY_HEARTBEAT_MS", "200"),
    ] {
        env.push((name.to_string(), value.to_string()));
    }
    let relay = Relay::start_in(dir, &env_refs(&env));
    Setup {
        relay,
        store,
        database: common::pg::database_name(&url),
        url,
        application_name: format!("orca-relay:cell:{CELL}"),
        _jwks: jwks,
        _director: director,
    }
}

fn metric(relay: &Relay, series: &str) -> f64 {
    relay.metric(series).unwrap_or(0.0)
}

/// What one burst's desktops met before every one of them was acked.
struct BurstReport {
    /// 503 at upgrade (shed under pool pressure), retried.
    shed: u32,
    /// Other refusals (a close code or a dropped socket), retried.
    other: u32,
}

/// Database-bound hellos held inside the database until [`Burst::release`].
struct Burst {
    locker: postgres::Client,
    dialers: Vec<std::thread::JoinHandle<Result<(), String>>>,
    shed: Arc<AtomicU32>,
    other: Arc<AtomicU32>,
}

impl Burst {
    /// Writes placement rows for `BURST` new desktops naming the cell at [`EPOCH`], locks those
    /// rows, and starts every desktop dialling at once; a refused desktop dials again.
    fn fire(setup: &Setup, round: u32) -> Burst {
        let pid = std::process::id();
        let desktops: Vec<(String, String)> = (0..BURST)
            .map(|i| {
                (
                    format!("pool-{round}-{i}"),
                    format!("p{round}{i:02}{pid:012}"),
                )
            })
            .collect();
        for (user, host) in &desktops {
            assert!(setup
                .store
                .place_assignment_if_newer(user, host, CELL, EPOCH, now())
                .unwrap());
        }
        let mut locker = common::pg::connect(&setup.url);
        locker.batch_execute("BEGIN").unwrap();
        let locked = locker
            .query(
                "SELECT 1 FROM relay_assignments WHERE user_id LIKE $1 FOR UPDATE",
                &[&format!("pool-{round}-%")],
            )
            .unwrap();
        assert_eq!(locked.len(), BURST as usize);

        let shed = Arc::new(AtomicU32::new(0));
        let other = Arc::new(AtomicU32::new(0));
        let dialers = desktops
            .into_iter()
            .map(|(user, host)| {
                let token = es256_token(&user, &host);
                let ws = setup.relay.ws.clone();
                let (shed, other) = (shed.clone(), other.clone());
                orca_relay::threads::spawn(format!("test-dial-{host}"), move || {
                    let relay = RelayAddress { ws };
                    let deadline = orca_relay::clock::instant() + DEADLINE;
                    loop {
                        match relay.hello(&token, &host) {
                            Ok(()) => return Ok(()),
                            Err(Some(503)) => shed.fetch_add(1, Ordering::Relaxed),
                            Err(_) => other.fetch_add(1, Ordering::Relaxed),
                        };
                        if orca_relay::clock::instant() >= deadline {
                            return Err(format!("desktop {host} was never admitted"));
                        }
                        // Shed hellos are told Retry-After: 2; retry sooner to keep the pressure on.
                        orca_relay::clock::sleep(Duration::from_millis(100));
                    }
                })
                .unwrap()
            })
            .collect();
        Burst {
            locker,
            dialers,
            shed,
            other,
        }
    }

    /// Releases the lock and waits until every desktop of the burst has been acked.
    fn release(mut self) -> BurstReport {
        self.locker.batch_execute("COMMIT").unwrap();
        for dialer in self.dialers {
            dialer.join().unwrap().unwrap();
        }
        BurstReport {
            shed: self.shed.load(Ordering::Relaxed),
            other: self.other.load(Ordering::Relaxed),
        }
    }
}

/// Just the WebSocket listener's address, so dialler threads need not share the [`Relay`].
struct RelayAddress {
    ws: String,
}

impl RelayAddress {
    /// One hello at [`EPOCH`]: `Ok` once acked (the socket is then closed), else the close code
    /// or upgrade status.
    fn hello(&self, token: &str, relay_host_id: &str) -> Result<(), Option<u16>> {
        let url = format!("ws://{}/v1/host/control", self.ws);
        let mut control = ws_connect(&url, Some(token)).map_err(Some)?;
        send_json(
            &mut control,
            serde_json::json!({"type":"host-hello","v":1,"relayHostId":relay_host_id,"assignmentEpoch":EPOCH}),
        );
        loop {
            match control.read() {
                Ok(tungstenite::Message::Text(text)) if text.contains("host-hello-ack") => {
                    let _ = control.close(None);
                    return Ok(());
                }
                Ok(tungstenite::Message::Close(frame)) => {
                    return Err(frame.map(|f| u16::from(f.code)))
                }
                Ok(_) => {}
                Err(_) => return Err(None),
            }
        }
    }
}

/// The cell's connections that are blocked on a lock inside PostgreSQL right now.
fn blocked_on_lock(setup: &Setup) -> i64 {
    common::pg::admin_client()
        .query_one(
            "SELECT count(*) FROM pg_stat_activity
             WHERE datname = $1 AND application_name = $2 AND wait_event_type = 'Lock'",
            &[&setup.database, &setup.application_name],
        )
        .unwrap()
        .get(0)
}

/// A burst against a reserve-mode cell: the pool fills to its ceiling and callers queue
/// behind it, yet the cell never holds more than `RESERVE_MAX` connections.
fn burst_stays_under_the_reserve_ceiling(setup: &Setup, sampler: &Sampler, round: u32) {
    let relay = &setup.relay;
    sampler.reset();
    let burst = Burst::fire(setup, round);
    // Saturated: every connection the ceiling allows is stuck on the lock and more hellos
    // wait for one (or the bound is already broken).
    let saturated = wait_until(LOCK_BUDGET, || {
        sampler.peak() > RESERVE_MAX
            || (blocked_on_lock(setup) >= RESERVE_MAX
                && metric(relay, "orca_relay_db_pool{state=\"waiters\"}") >= 1.0)
    });
    assert!(
        saturated,
        "round {round}: the pool never filled up within {LOCK_BUDGET:?}"
    );
    let report = burst.release();
    eprintln!(
        "round {round} (reserve): peak {} connections, {} shed and {} other refusals retried",
        sampler.peak(),
        report.shed,
        report.other
    );
    assert!(
        sampler.peak() <= RESERVE_MAX,
        "round {round}: a reserve cell held {} connections, above its ceiling {RESERVE_MAX}",
        sampler.peak()
    );
}

#[test]
fn a_reserve_cell_never_exceeds_its_pool_ceiling_and_a_tripped_cell_reaches_its_full_pool() {
    let setup = start_cell();
    let relay = &setup.relay;
    let sampler = Sampler::start(&setup.database, &setup.application_name);

    // Armed, reserve: the hellos fall through memory and bookings to the database.
    let mut director = DirectorPolls::start(relay);
    assert!(wait_until(DEADLINE, || metric(
        relay,
        "orca_relay_admit_mode{kind=\"raw\"}"
    ) == 1.0));
    burst_stays_under_the_reserve_ceiling(&setup, &sampler, 0);
    assert_eq!(
        metric(relay, "orca_relay_db_pool{state=\"ceiling\"}"),
        RESERVE_MAX as f64
    );
    assert_eq!(
        metric(
            relay,
            "orca_relay_admissions_total{path=\"database\",outcome=\"admitted\"}"
        ),
        BURST as f64,
        "every desktop of the burst was admitted through the database"
    );
    assert_eq!(
        relay.count_log("orca_relay_cell_reserve_dead_man_tripped"),
        0
    );

    // The director goes quiet; with no deadManTripSlots the cell trips after its window, and
    // a tripped cell reaches its full pool.
    director.stop();
    assert!(relay
        .wait_for_log("orca_relay_cell_reserve_dead_man_tripped", DEADLINE)
        .is_some());
    sampler.reset();
    let burst = Burst::fire(&setup, 1);
    let budget = orca_relay::clock::instant() + LOCK_BUDGET;
    let left = || budget.saturating_duration_since(orca_relay::clock::instant());
    let above = wait_until(left(), || sampler.latest() > RESERVE_MAX);
    assert!(
        above,
        "a tripped cell never held more than {RESERVE_MAX} connections (peak {})",
        sampler.peak()
    );
    // Give the rest of the pool the chance to open; the full pool is the most it may take.
    wait_until(left(), || sampler.latest() >= POOL_MAX);

    // Re-armed while those connections are busy: a new switch generation saying reserve, with
    // the director back. The ceiling drops at once, but no connection is closed under its
    // user; the ones above the ceiling are closed as they are returned.
    write_switch(
        &relay.data_dir.0.join("switch.json"),
        CELL,
        2,
        serde_json::json!({"admitMode":"reserve"}),
    );
    let _director = DirectorPolls::start(relay);
    assert!(
        wait_until(left(), || metric(
            relay,
            "orca_relay_admit_mode{kind=\"raw\"}"
        ) == 1.0
            && metric(relay, "orca_relay_db_pool{state=\"ceiling\"}")
                == RESERVE_MAX as f64),
        "the re-armed cell did not lower its ceiling within {LOCK_BUDGET:?}"
    );
    let busy = sampler.latest();
    let report = burst.release();
    eprintln!(
        "round 1 (tripped): peak {} connections, {busy} still open at re-arm, {} shed and {} \
         other refusals retried",
        sampler.peak(),
        report.shed,
        report.other
    );
    assert!(
        sampler.peak() <= POOL_MAX,
        "peak {} above the full pool",
        sampler.peak()
    );
    assert!(
        busy > RESERVE_MAX,
        "busy connections were closed under their users at re-arm ({busy} left)"
    );
    assert!(
        wait_until(DEADLINE, || sampler.latest() <= RESERVE_MAX),
        "the re-armed cell still holds {} connections after they were returned",
        sampler.latest()
    );
    burst_stays_under_the_reserve_ceiling(&setup, &sampler, 2);
}
