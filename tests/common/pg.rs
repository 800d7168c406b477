//! The PostgreSQL test server (started by `scripts/test-postgres.sh`): its admin URL, a fresh
//! database per test, and stopping and starting the server for restart tests.
//!
//! PostgreSQL tests fail, never skip, when the server is not configured: a skipped test would
//! let a broken claim through.

use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};

use postgres::{Client, NoTls};

const MISSING: &str = "PostgreSQL tests need ORCA_RELAY_TEST_DATABASE_URL; run scripts/test \
     (or: eval \"$(scripts/test-postgres.sh start)\")";

fn env(name: &str) -> String {
    match std::env::var(name) {
        Ok(value) if !value.is_empty() => value,
        _ => panic!("{MISSING} ({name} is unset)"),
    }
}

/// The admin URL (database `postgres`) of the test server.
pub fn admin_url() -> String {
    env("ORCA_RELAY_TEST_DATABASE_URL")
}

/// A connection to the test server as the admin.
pub fn admin_client() -> Client {
    connect(&admin_url())
}

pub fn connect(url: &str) -> Client {
    Client::connect(url, NoTls)
        .unwrap_or_else(|error| panic!("connect to the test PostgreSQL failed: {error}"))
}

/// `url` with its database name replaced by `database`.
pub fn url_for_database(url: &str, database: &str) -> String {
    let (base, query) = match url.split_once('?') {
        Some((base, query)) => (base, Some(query)),
        None => (url, None),
    };
    let scheme_end = base.find("://").map(|i| i + 3).unwrap_or(0);
    let host_part_end = base[scheme_end..]
        .find('/')
        .map(|i| scheme_end + i)
        .unwrap_or(base.len());
    let mut out = format!("{}/{database}", &base[..host_part_end]);
    if let Some(query) = query {
        out.push('?');
        out.push_str(query);
    }
    out
}

/// Creates a new, uniquely named database and returns its URL, so tests never share tables.
pub fn fresh_database(prefix: &str) -> String {
    static COUNTER: AtomicU32 = AtomicU32::new(0);
    let n = COUNTER.fetch_add(1, Ordering::SeqCst);
    let stamp = orca_relay::clock::system().now_ms();
    let clean: String = prefix
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_lowercase()
            } else {
                '_'
            }
        })
        .take(30)
        .collect();
    let name = format!("t_{clean}_{}_{n}_{stamp}", std::process::id());
    admin_client()
        .batch_execute(&format!("CREATE DATABASE \"{name}\""))
        .unwrap_or_else(|error| panic!("create database {name} failed: {error}"));
    url_for_database(&admin_url(), &name)
}

/// The database name in a URL made by [`fresh_database`].
pub fn database_name(url: &str) -> String {
    let base = url.split('?').next().unwrap_or(url);
    base.rsplit('/').next().unwrap_or_default().to_string()
}

/// Connections to `database` that carry `application_name`, as `pg_stat_activity` shows them.
pub fn connections_named(admin: &mut Client, database: &str, application_name: &str) -> i64 {
    admin
        .query_one(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = $1 AND application_name = $2",
            &[&database, &application_name],
        )
        .and_then(|row| row.try_get(0))
        .unwrap_or_else(|error| panic!("read pg_stat_activity failed: {error}"))
}

fn pg_ctl(args: &[&str]) {
    let pg_ctl = env("ORCA_RELAY_TEST_PG_CTL");
    let data = env("ORCA_RELAY_TEST_PGDATA");
    let user = std::env::var("ORCA_RELAY_TEST_PG_USER").unwrap_or_default();
    // SAFETY: geteuid has no preconditions and cannot fail.
    let as_root = unsafe { libc::geteuid() } == 0;
    let mut command = if as_root && !user.is_empty() {
        let mut c = Command::new("runuser");
        c.args(["-u", &user, "--", &pg_ctl]);
        c
    } else {
        Command::new(&pg_ctl)
    };
    command.args(["-D", &data]).args(args);
    // The server keeps its starter's stdout open: never pipe it.
    command
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    let status = command
        .status()
        .unwrap_or_else(|error| panic!("run pg_ctl {args:?} failed: {error}"));
    assert!(status.success(), "pg_ctl {args:?} exited with {status}");
}

/// Stops the test server (fast shutdown: sessions are cut).
pub fn stop_server() {
    pg_ctl(&["stop", "-m", "fast", "-w"]);
}

/// Starts the test server again with the same data and port.
pub fn start_server() {
    let log = format!("{}/log/pg_ctl.log", env("ORCA_RELAY_TEST_PGDATA"));
    pg_ctl(&["-l", &log, "start", "-w"]);
}
