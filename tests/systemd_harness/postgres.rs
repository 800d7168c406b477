//! A PostgreSQL server inside the namespace, as a unit of its own, for roles that need one.
//!
//! Why inside: the namespace has its own network, so the test server of
//! `scripts/test-postgres.sh` (on the host's loopback) is out of its reach, and giving the
//! namespace a route to the host would let its services reach the host too. The same
//! PostgreSQL binaries run here as a `Type=notify` unit on the namespace's `127.0.0.1:5432`,
//! with its data in the namespace's tmpfs: the fleet's database sits beside the director and
//! the cell as on a small VM, and goes with the namespace.

use std::path::{Path, PathBuf};

use super::{Namespace, STATE_ROOT};

/// The unit the server runs as.
pub const UNIT: &str = "orca-relay-test-postgresql.service";
/// Its address inside the namespace.
pub const ADDR: &str = "127.0.0.1:5432";

/// The PostgreSQL binaries (`initdb`, `postgres`): `ORCA_RELAY_PG_BINDIR`, else the newest
/// `/usr/lib/postgresql/<version>/bin`, as `scripts/test-postgres.sh` finds them.
pub fn bindir() -> Option<PathBuf> {
    if let Ok(dir) = std::env::var("ORCA_RELAY_PG_BINDIR") {
        if !dir.trim().is_empty() {
            return Some(PathBuf::from(dir));
        }
    }
    let mut versions: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .ok()?
        .flatten()
        .map(|entry| entry.path().join("bin"))
        .filter(|bin| bin.join("initdb").is_file() && bin.join("postgres").is_file())
        .collect();
    versions.sort();
    versions.pop()
}

impl Namespace {
    /// Creates a cluster (trust authentication, no durability: a test database), starts it as
    /// [`UNIT`] and returns the `DATABASE_URL` of its `postgres` database.
    pub fn start_postgresql(&self) -> String {
        let bindir = bindir().unwrap_or_else(|| {
            panic!(
                "systemd tests cannot run on this machine: PostgreSQL is not installed; apt-get \
                 install postgresql-15 (scripts/test installs it)"
            )
        });
        let data = format!("{STATE_ROOT}/postgresql");
        let initdb = bindir.join("initdb");
        let postgres = bindir.join("postgres");
        self.run_ok(&["install", "-d", "-o", "postgres", "-m", "700", &data]);
        self.run_ok(&[
            "runuser",
            "-u",
            "postgres",
            "--",
            &initdb.to_string_lossy(),
            "--pgdata",
            &data,
            "--username=postgres",
            "--auth=trust",
            "--encoding=UTF8",
            "--no-locale",
            "--no-sync",
        ]);
        self.add_unit(UNIT, &unit_text(&postgres, &data));
        self.systemctl_ok(&["start", UNIT]);
        format!("postgres://postgres@{ADDR}/postgres?sslmode=disable")
    }
}

fn unit_text(postgres: &Path, data: &str) -> String {
    let (host, port) = ADDR.split_once(':').expect("host:port");
    format!(
        "[Unit]\n\
         Description=PostgreSQL for the orca-relay systemd tests\n\
         \n\
         [Service]\n\
         Type=notify\n\
         User=postgres\n\
         ExecStart={postgres} -D {data} -c listen_addresses={host} -c port={port} \
         -c unix_socket_directories={data} -c max_connections=100 -c fsync=off \
         -c synchronous_commit=off -c full_page_writes=off\n\
         TimeoutStartSec=60\n",
        postgres = postgres.display()
    )
}
