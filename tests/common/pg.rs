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

/// A PostgreSQL server of a test's own (its own data directory and port), from the same
/// installation as the shared test server: for what the shared one must never go through, a
/// primary stopped for good and a streaming replica promoted in its place. Stopped and deleted
/// when dropped.
pub struct Cluster {
    pub port: u16,
    data: std::path::PathBuf,
    bindir: std::path::PathBuf,
    user: String,
}

impl Cluster {
    fn bindir() -> std::path::PathBuf {
        std::path::Path::new(&env("ORCA_RELAY_TEST_PG_CTL"))
            .parent()
            .expect("pg_ctl's directory")
            .to_path_buf()
    }

    fn free_port() -> u16 {
        std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|listener| listener.local_addr())
            .map(|addr| addr.port())
            .expect("a free port")
    }

    /// Runs a server binary as the server's OS user; panics naming it unless it succeeds.
    fn run(&self, program: &str, args: &[&str]) {
        let path = self.bindir.join(program);
        // SAFETY: geteuid has no preconditions and cannot fail.
        let as_root = unsafe { libc::geteuid() } == 0;
        let mut command = if as_root && !self.user.is_empty() {
            let mut c = Command::new("runuser");
            c.args(["-u", &self.user, "--"]).arg(&path);
            c
        } else {
            Command::new(&path)
        };
        // A server keeps its starter's stdout open: never pipe it.
        let status = command
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .unwrap_or_else(|error| panic!("run {program} {args:?} failed: {error}"));
        assert!(status.success(), "{program} {args:?} exited with {status}");
    }

    fn new_dir(user: &str) -> std::path::PathBuf {
        static CLUSTERS: AtomicU32 = AtomicU32::new(0);
        let dir = std::env::temp_dir().join(format!(
            "orca-relay-pg-cluster-{}-{}-{}",
            std::process::id(),
            CLUSTERS.fetch_add(1, Ordering::SeqCst),
            orca_relay::clock::system().now_ms()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("create the cluster's data directory");
        if !user.is_empty() && unsafe { libc::geteuid() } == 0 {
            let status = Command::new("chown")
                .args([&format!("{user}:"), dir.to_str().unwrap()])
                .status()
                .expect("chown the data directory");
            assert!(status.success());
        }
        let mut permissions = std::fs::metadata(&dir).unwrap().permissions();
        std::os::unix::fs::PermissionsExt::set_mode(&mut permissions, 0o700);
        std::fs::set_permissions(&dir, permissions).unwrap();
        dir
    }

    fn configure(&self) {
        use std::io::Write;
        let conf = format!(
            "\nlisten_addresses = '127.0.0.1'\nport = {}\nunix_socket_directories = '{}'\n\
             max_connections = 100\nfsync = off\nsynchronous_commit = off\n\
             full_page_writes = off\nwal_level = replica\nmax_wal_senders = 5\n\
             hot_standby = on\n",
            self.port,
            self.data.display()
        );
        std::fs::OpenOptions::new()
            .append(true)
            .open(self.data.join("postgresql.conf"))
            .and_then(|mut file| file.write_all(conf.as_bytes()))
            .expect("configure the cluster");
    }

    /// Starts the server (again, after [`Cluster::stop`]) with the same data and port.
    pub fn start(&self) {
        let log = self.data.join("server.log");
        self.run(
            "pg_ctl",
            &[
                "-D",
                self.data.to_str().unwrap(),
                "-l",
                log.to_str().unwrap(),
                "-w",
                "-t",
                "60",
                "start",
            ],
        );
    }

    /// A new primary, started (initdb with trust authentication, replication allowed from
    /// 127.0.0.1 as initdb's defaults do).
    pub fn primary() -> Cluster {
        let user = std::env::var("ORCA_RELAY_TEST_PG_USER").unwrap_or_default();
        let cluster = Cluster {
            port: Cluster::free_port(),
            data: Cluster::new_dir(&user),
            bindir: Cluster::bindir(),
            user,
        };
        cluster.run(
            "initdb",
            &[
                "-D",
                cluster.data.to_str().unwrap(),
                "-U",
                "postgres",
                "--auth=trust",
                "-E",
                "UTF8",
                "--no-locale",
            ],
        );
        cluster.configure();
        cluster.start();
        cluster
    }

    /// A streaming replica of `primary` (`pg_basebackup -R`), started and caught up.
    pub fn replica_of(primary: &Cluster) -> Cluster {
        let cluster = Cluster {
            port: Cluster::free_port(),
            data: Cluster::new_dir(&primary.user),
            bindir: primary.bindir.clone(),
            user: primary.user.clone(),
        };
        let port = primary.port.to_string();
        cluster.run(
            "pg_basebackup",
            &[
                "-h",
                "127.0.0.1",
                "-p",
                &port,
                "-U",
                "postgres",
                "-D",
                cluster.data.to_str().unwrap(),
                "-R",
                "-X",
                "stream",
                "-c",
                "fast",
            ],
        );
        cluster.configure();
        cluster.start();
        cluster
    }

    /// `postgres://postgres@127.0.0.1:<port>/<database>`.
    pub fn url(&self, database: &str) -> String {
        format!("postgres://postgres@127.0.0.1:{}/{database}", self.port)
    }

    pub fn connect(&self, database: &str) -> Client {
        connect(&self.url(database))
    }

    /// Creates a database named after `prefix` on this server and returns its URL.
    pub fn create_database(&self, prefix: &str) -> String {
        static DATABASES: AtomicU32 = AtomicU32::new(0);
        let name = format!("{prefix}_{}", DATABASES.fetch_add(1, Ordering::SeqCst));
        self.connect("postgres")
            .batch_execute(&format!("CREATE DATABASE \"{name}\""))
            .unwrap_or_else(|error| panic!("create database {name} failed: {error}"));
        self.url(&name)
    }

    /// Stops the server (fast shutdown: every session is ended).
    pub fn stop(&self) {
        self.run(
            "pg_ctl",
            &[
                "-D",
                self.data.to_str().unwrap(),
                "-m",
                "fast",
                "-w",
                "stop",
            ],
        );
    }

    /// Stops the server as a crash would (immediate shutdown): connections are cut, and new
    /// ones are refused at once rather than told it is shutting down.
    pub fn crash(&self) {
        self.run(
            "pg_ctl",
            &[
                "-D",
                self.data.to_str().unwrap(),
                "-m",
                "immediate",
                "-w",
                "stop",
            ],
        );
    }

    /// Promotes a replica to a primary and waits until it accepts writes.
    pub fn promote(&self) {
        self.run(
            "pg_ctl",
            &["-D", self.data.to_str().unwrap(), "-w", "promote"],
        );
    }

    /// Whether the server is a standby (`pg_is_in_recovery()`).
    pub fn in_recovery(&self) -> bool {
        self.connect("postgres")
            .query_one("SELECT pg_is_in_recovery()", &[])
            .and_then(|row| row.try_get(0))
            .expect("ask the server whether it is in recovery")
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let data = self.data.to_str().unwrap_or_default().to_string();
        let path = self.bindir.join("pg_ctl");
        // SAFETY: geteuid has no preconditions and cannot fail.
        let as_root = unsafe { libc::geteuid() } == 0;
        let mut command = if as_root && !self.user.is_empty() {
            let mut c = Command::new("runuser");
            c.args(["-u", &self.user, "--"]).arg(&path);
            c
        } else {
            Command::new(&path)
        };
        let _ = command
            .args(["-D", &data, "-m", "immediate", "-w", "stop"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
        let _ = std::fs::remove_dir_all(&self.data);
    }
}
