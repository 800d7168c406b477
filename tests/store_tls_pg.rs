//! TLS to PostgreSQL (SPEC §11 "Security"): `DATABASE_URL`'s `sslmode` and `sslrootcert`, and
//! `ORCA_RELAY_DATABASE_CA_FILE`, against a real PostgreSQL 15 that this test starts itself with
//! `ssl=on`, a CA and server certificate it generates (rcgen), and a `pg_hba.conf` that admits
//! TCP clients only over `hostssl`. The binaries are the suite's (`ORCA_RELAY_TEST_PG_CTL`, set by
//! `scripts/test-postgres.sh`); the server is a second, throwaway instance in a temp directory,
//! stopped and deleted when the test ends, pass or fail.
//!
//! The cases run the real binary: `orca-relay migrate` for the connection matrix, and the
//! `director`, `cell` and `combined` roles until `/ready` says 200. Which connections really
//! used TLS is read from `pg_stat_ssl` over the server's Unix socket.
//!
//! Like every PostgreSQL test, this fails (never skips) when the suite's PostgreSQL variables
//! are missing.

mod common;
mod harness;

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::Arc;
use std::time::Duration;

use harness::*;

const DEADLINE: Duration = Duration::from_secs(30);

fn env(name: &str) -> String {
    match std::env::var(name) {
        Ok(value) if !value.is_empty() => value,
        _ => panic!(
            "the TLS PostgreSQL test needs {name}; run scripts/test \
             (or: eval \"$(scripts/test-postgres.sh start)\")"
        ),
    }
}

/// A CA: its certificate (PEM) and the issuer that signs with its key.
struct Ca {
    pem: String,
    issuer: rcgen::Issuer<'static, rcgen::KeyPair>,
}

impl Ca {
    fn new(name: &str) -> Ca {
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).expect("CA params");
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, name);
        params.key_usages = vec![
            rcgen::KeyUsagePurpose::KeyCertSign,
            rcgen::KeyUsagePurpose::CrlSign,
            rcgen::KeyUsagePurpose::DigitalSignature,
        ];
        let key = rcgen::KeyPair::generate().expect("CA key");
        let cert = params.self_signed(&key).expect("self-sign the CA");
        Ca {
            pem: cert.pem(),
            issuer: rcgen::Issuer::new(params, key),
        }
    }

    /// A server certificate for `names` (DNS names or IP addresses): (cert PEM, key PEM).
    fn server_cert(&self, names: &[&str]) -> (String, String) {
        let names: Vec<String> = names.iter().map(|n| n.to_string()).collect();
        let mut params = rcgen::CertificateParams::new(names).expect("server params");
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, "orca-relay test database");
        params.use_authority_key_identifier_extension = true;
        params.key_usages = vec![rcgen::KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![rcgen::ExtendedKeyUsagePurpose::ServerAuth];
        let key = rcgen::KeyPair::generate().expect("server key");
        let cert = params.signed_by(&key, &self.issuer).expect("sign");
        (cert.pem(), key.serialize_pem())
    }
}

/// A throwaway PostgreSQL with `ssl=on` and `hostssl`-only TCP access. Dropping it stops the
/// server and deletes its data directory.
struct TlsPostgres {
    data: PathBuf,
    port: u16,
    bindir: PathBuf,
    pg_user: String,
    /// The CA that signed the server certificate, and another one, as PEM files.
    pub right_ca: PathBuf,
    pub other_ca: PathBuf,
    _files: TempDir,
}

fn as_root() -> bool {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() == 0 }
}

impl TlsPostgres {
    /// Starts a server whose certificate names `127.0.0.1` and `localhost`, signed by
    /// `right_ca`.
    fn start() -> TlsPostgres {
        let pg_ctl = PathBuf::from(env("ORCA_RELAY_TEST_PG_CTL"));
        let bindir = pg_ctl.parent().expect("pg_ctl's directory").to_path_buf();
        let pg_user = std::env::var("ORCA_RELAY_TEST_PG_USER").unwrap_or_default();
        let files = TempDir::new("tls-pg-files");
        let right = Ca::new("orca-relay test CA");
        let other = Ca::new("some other CA");
        let (server_cert, server_key) = right.server_cert(&["127.0.0.1", "localhost"]);
        let right_ca = files.0.join("right-ca.pem");
        let other_ca = files.0.join("other-ca.pem");
        std::fs::write(&right_ca, &right.pem).unwrap();
        std::fs::write(&other_ca, &other.pem).unwrap();

        let data = common::temp_dir("tls-pg-data");
        let mut server = TlsPostgres {
            data,
            port: 0,
            bindir,
            pg_user,
            right_ca,
            other_ca,
            _files: files,
        };
        server.own(&server.data.clone(), 0o700);
        server.run_as_pg_user(
            "initdb",
            &[
                "-D",
                &server.data.display().to_string(),
                "-U",
                "postgres",
                "--auth=trust",
                "-E",
                "UTF8",
                "--no-locale",
            ],
        );
        for (name, body) in [("server.crt", &server_cert), ("server.key", &server_key)] {
            let path = server.data.join(name);
            std::fs::write(&path, body).unwrap();
            server.own(&path, 0o600);
        }
        // TCP only over TLS; the Unix socket stays open for the test's own look at pg_stat_ssl.
        let hba = server.data.join("pg_hba.conf");
        std::fs::write(
            &hba,
            "local all all trust\nhostssl all all 127.0.0.1/32 trust\n",
        )
        .unwrap();
        server.own(&hba, 0o600);
        for attempt in 0..5 {
            server.port = free_port();
            let conf = server.data.join("orca-relay-tls-test.conf");
            std::fs::write(
                &conf,
                format!(
                    "listen_addresses = '127.0.0.1'\nport = {}\nunix_socket_directories = '{}'\n\
                     max_connections = 60\nshared_buffers = 16MB\nfsync = off\n\
                     synchronous_commit = off\nfull_page_writes = off\nssl = on\n\
                     ssl_cert_file = 'server.crt'\nssl_key_file = 'server.key'\n",
                    server.port,
                    server.data.display()
                ),
            )
            .unwrap();
            server.own(&conf, 0o600);
            let main_conf = server.data.join("postgresql.conf");
            let mut text = std::fs::read_to_string(&main_conf).unwrap();
            if !text.contains("orca-relay-tls-test.conf") {
                text.push_str("\ninclude = 'orca-relay-tls-test.conf'\n");
                std::fs::write(&main_conf, text).unwrap();
            }
            let log = server.data.join("server.log").display().to_string();
            if server.try_pg_ctl(&["-l", &log, "-w", "-t", "60", "start"]) {
                return server;
            }
            eprintln!(
                "TLS test PostgreSQL did not start on port {} (attempt {attempt})",
                server.port
            );
        }
        let log = std::fs::read_to_string(server.data.join("server.log")).unwrap_or_default();
        panic!("the TLS test PostgreSQL did not start:\n{log}");
    }

    /// Gives `path` to the server's OS user (when the test runs as root) with `mode`.
    fn own(&self, path: &Path, mode: u32) {
        use std::os::unix::fs::PermissionsExt;
        if as_root() && !self.pg_user.is_empty() {
            let name = std::ffi::CString::new(self.pg_user.clone()).unwrap();
            // SAFETY: getpwnam reads a NUL-terminated name; the result is checked for null and
            // only read before any other passwd call on this thread.
            let (uid, gid) = unsafe {
                let entry = libc::getpwnam(name.as_ptr());
                assert!(!entry.is_null(), "no OS user {}", self.pg_user);
                ((*entry).pw_uid, (*entry).pw_gid)
            };
            std::os::unix::fs::chown(path, Some(uid), Some(gid)).expect("chown to the pg user");
        }
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).expect("chmod");
    }

    fn command(&self, program: &str) -> Command {
        let binary = self.bindir.join(program);
        let mut command = if as_root() && !self.pg_user.is_empty() {
            let mut c = Command::new("runuser");
            c.args(["-u", &self.pg_user, "--"]).arg(binary);
            c
        } else {
            Command::new(binary)
        };
        // The server keeps its starter's stdout open: never pipe it.
        command
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        command
    }

    fn run_as_pg_user(&self, program: &str, args: &[&str]) {
        let status = self.command(program).args(args).status().expect(program);
        assert!(status.success(), "{program} {args:?}: {status}");
    }

    fn try_pg_ctl(&self, args: &[&str]) -> bool {
        self.command("pg_ctl")
            .arg("-D")
            .arg(&self.data)
            .args(args)
            .status()
            .is_ok_and(|status| status.success())
    }

    /// `postgres://postgres@<host>:<port>/postgres` plus `query`.
    fn url(&self, host: &str, query: &str) -> String {
        let mut url = format!("postgres://postgres@{host}:{}/postgres", self.port);
        if !query.is_empty() {
            url.push('?');
            url.push_str(query);
        }
        url
    }

    /// The server's own view over the Unix socket (no TLS needed there).
    fn admin(&self) -> postgres::Client {
        postgres::Client::connect(
            &format!(
                "host={} port={} user=postgres dbname=postgres",
                self.data.display(),
                self.port
            ),
            postgres::NoTls,
        )
        .expect("connect over the Unix socket")
    }

    /// (connections, of which over TLS) carrying `application_name`.
    fn connections(&self, application_name: &str) -> (i64, i64) {
        let row = self
            .admin()
            .query_one(
                "SELECT count(*), count(*) FILTER (WHERE s.ssl)
                   FROM pg_stat_activity a JOIN pg_stat_ssl s USING (pid)
                  WHERE a.application_name = $1",
                &[&application_name],
            )
            .expect("read pg_stat_ssl");
        (row.get(0), row.get(1))
    }
}

impl Drop for TlsPostgres {
    fn drop(&mut self) {
        self.try_pg_ctl(&["-m", "immediate", "-w", "-t", "60", "stop"]);
        let _ = std::fs::remove_dir_all(&self.data);
    }
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|listener| listener.local_addr())
        .map(|addr| addr.port())
        .expect("a free port")
}

/// Runs `orca-relay migrate` with `DATABASE_URL` (and `extra`).
fn migrate(database_url: &str, extra: &[(&str, &str)]) -> Output {
    let data = TempDir::new("tls-migrate");
    Command::new(env!("CARGO_BIN_EXE_orca-relay"))
        .arg("migrate")
        .env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .env("RUST_LOG", "info")
        .env("ORCA_RELAY_DATA_DIR", &data.0)
        .env("DATABASE_URL", database_url)
        .envs(extra.iter().copied())
        .output()
        .expect("run orca-relay migrate")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// What a connection attempt must end in.
#[derive(Debug)]
enum Expect {
    Connects,
    /// Fails; stderr names `orca_relay_store_tls_failed cause=<cause>`.
    TlsFails(&'static str),
}

fn check(case: &str, database_url: &str, extra: &[(&str, &str)], expect: Expect) {
    let output = migrate(database_url, extra);
    let stderr = text(&output.stderr);
    match expect {
        Expect::Connects => assert_eq!(
            output.status.code(),
            Some(0),
            "{case}: migrate should connect:\n{stderr}"
        ),
        Expect::TlsFails(cause) => {
            assert_eq!(
                output.status.code(),
                Some(1),
                "{case}: migrate should fail:\n{stderr}"
            );
            let needle = format!("orca_relay_store_tls_failed cause={cause} ");
            let last = stderr.lines().last().unwrap_or_default();
            assert!(
                last.starts_with("orca-relay: ") && last.contains(&needle),
                "{case}: the error line must name the cause ({needle}):\n{stderr}"
            );
            let event = format!("ERROR {needle}");
            assert!(
                stderr.lines().any(|line| line.contains(&event)),
                "{case}: the log must carry the event ({needle}):\n{stderr}"
            );
        }
    }
}

#[test]
fn the_sslmode_matrix_against_a_hostssl_only_server() {
    let server = TlsPostgres::start();
    let right = server.right_ca.display().to_string();
    let other = server.other_ca.display().to_string();
    let url = |host: &str, query: &str| server.url(host, query);
    // The certificate names 127.0.0.1 and localhost; `hostaddr` sends the TCP connection to
    // 127.0.0.1 while TLS checks another name, as a certificate issued for another host would.
    let wrong_name =
        |query: &str| server.url("db.other.example", &format!("hostaddr=127.0.0.1&{query}"));

    check(
        "require, no CA",
        &url("127.0.0.1", "sslmode=require"),
        &[],
        Expect::Connects,
    );
    check(
        "verify-full, the right CA in sslrootcert",
        &url(
            "127.0.0.1",
            &format!("sslmode=verify-full&sslrootcert={right}"),
        ),
        &[],
        Expect::Connects,
    );
    check(
        "verify-full by DNS name, the right CA in ORCA_RELAY_DATABASE_CA_FILE",
        &url("localhost", "sslmode=verify-full"),
        &[("ORCA_RELAY_DATABASE_CA_FILE", &right)],
        Expect::Connects,
    );
    check(
        "verify-full, another CA",
        &url(
            "127.0.0.1",
            &format!("sslmode=verify-full&sslrootcert={other}"),
        ),
        &[],
        Expect::TlsFails("unknown_ca"),
    );
    check(
        "verify-ca, another CA",
        &url("127.0.0.1", "sslmode=verify-ca"),
        &[("ORCA_RELAY_DATABASE_CA_FILE", &other)],
        Expect::TlsFails("unknown_ca"),
    );
    check(
        "require with another CA checks the chain, as libpq",
        &url("127.0.0.1", &format!("sslmode=require&sslrootcert={other}")),
        &[],
        Expect::TlsFails("unknown_ca"),
    );
    check(
        "verify-full, the right CA, a certificate for another host name",
        &wrong_name(&format!("sslmode=verify-full&sslrootcert={right}")),
        &[],
        Expect::TlsFails("hostname_mismatch"),
    );
    check(
        "verify-ca does not check the host name",
        &wrong_name(&format!("sslmode=verify-ca&sslrootcert={right}")),
        &[],
        Expect::Connects,
    );
    check(
        "prefer (the default) uses TLS when the server offers it",
        &url("127.0.0.1", ""),
        &[],
        Expect::Connects,
    );
    check(
        "disable against a hostssl-only server",
        &url("127.0.0.1", "sslmode=disable"),
        &[],
        Expect::TlsFails("server_requires_tls"),
    );
}

#[test]
fn against_a_server_without_tls_prefer_connects_and_require_names_the_cause() {
    // The suite's own server has no TLS.
    let admin = common::pg::admin_url();
    let database = common::pg::fresh_database("tls_plain");
    check("default (prefer)", &database, &[], Expect::Connects);
    let with = |query: &str| {
        let separator = if database.contains('?') { '&' } else { '?' };
        format!("{database}{separator}{query}")
    };
    check("prefer", &with("sslmode=prefer"), &[], Expect::Connects);
    check(
        "require",
        &with("sslmode=require"),
        &[],
        Expect::TlsFails("server_without_tls"),
    );
    assert!(!admin.is_empty());
}

/// `/ready` 200 within the deadline.
fn wait_ready(relay: &Relay, what: &str) {
    assert!(
        wait_until(DEADLINE, || relay.get("/ready").0 == 200),
        "{what} never became ready: {:?}\n{}",
        relay.get("/ready"),
        relay.log_text()
    );
}

#[test]
fn every_role_runs_over_require_and_verify_full() {
    let server = TlsPostgres::start();
    let jwks = jwks_server();
    let director_stub = accepting_director();
    let jwks_url = format!("{}/jwks.json", jwks.url());
    let require = server.url("127.0.0.1", "sslmode=require");
    let verify_full = server.url(
        "localhost",
        &format!(
            "sslmode=verify-full&sslrootcert={}",
            server.right_ca.display()
        ),
    );

    let director = Relay::start_in(
        Arc::new(TempDir::new("tls-director")),
        &[
            ("ORCA_RELAY_ROLE", "director"),
            ("DATABASE_URL", &require),
            ("ORCA_RELAY_SERVICE_TOKEN", SERVICE_TOKEN),
            ("ORCA_RELAY_JWKS_URL", &jwks_url),
            ("ORCA_RELAY_AUTH_ISSUER", TEST_ISSUER),
            ("ORCA_RELAY_READINESS_PROBE_MS", "100"),
        ],
    );
    let cell = Relay::start_in(
        Arc::new(TempDir::new("tls-cell")),
        &[
            ("ORCA_RELAY_ROLE", "cell"),
            ("ORCA_RELAY_CELL_ID", "tls-cell"),
            ("DATABASE_URL", &verify_full),
            ("ORCA_RELAY_SERVICE_TOKEN", SERVICE_TOKEN),
            ("ORCA_RELAY_JWKS_URL", &jwks_url),
            ("ORCA_RELAY_AUTH_ISSUER", TEST_ISSUER),
            ("ORCA_RELAY_DIRECTOR_URLS", &director_stub.url()),
            ("ORCA_RELAY_READINESS_PROBE_MS", "100"),
        ],
    );
    let combined = Relay::combined(&[
        ("ORCA_RELAY_CELL_ID", "tls-combined"),
        ("DATABASE_URL", &require),
        ("ORCA_RELAY_READINESS_PROBE_MS", "100"),
    ]);
    wait_ready(&director, "the director");
    wait_ready(&cell, "the cell");
    wait_ready(&combined, "the combined role");

    // A desktop goes through the combined role end to end: placement row and db-mode admission
    // in PostgreSQL, over TLS.
    let desktop = Desktop::connect(&combined);
    assert!(desktop.epoch > 0);

    for (application_name, what) in [
        ("orca-relay:director:director", "director"),
        ("orca-relay:cell:tls-cell", "cell"),
        ("orca-relay:combined:tls-combined", "combined"),
    ] {
        let (total, over_tls) = server.connections(application_name);
        assert!(total > 0, "the {what} holds no connection");
        assert_eq!(over_tls, total, "every {what} connection uses TLS");
    }
    for relay in [&director, &cell, &combined] {
        assert_eq!(
            relay.count_log("orca_relay_store_tls_failed"),
            0,
            "{}",
            relay.log_text()
        );
    }
}

#[test]
fn a_role_whose_database_tls_fails_stops_at_start_with_the_cause() {
    let server = TlsPostgres::start();
    let other_ca = server.url(
        "127.0.0.1",
        &format!(
            "sslmode=verify-full&sslrootcert={}",
            server.other_ca.display()
        ),
    );
    for role in ["combined", "cell", "director"] {
        let jwks = jwks_server();
        let director_stub = accepting_director();
        let jwks_url = format!("{}/jwks.json", jwks.url());
        let mut env = vec![
            ("ORCA_RELAY_ROLE", role),
            ("DATABASE_URL", other_ca.as_str()),
            ("ORCA_RELAY_SERVICE_TOKEN", SERVICE_TOKEN),
        ];
        let director_url = director_stub.url();
        if role != "combined" {
            env.extend([
                ("ORCA_RELAY_JWKS_URL", jwks_url.as_str()),
                ("ORCA_RELAY_AUTH_ISSUER", TEST_ISSUER),
                ("ORCA_RELAY_DIRECTOR_URLS", director_url.as_str()),
            ]);
        }
        let mut relay = Relay::launch(Arc::new(TempDir::new("tls-fails")), &env);
        let code = relay.wait_exit(DEADLINE);
        let log = relay.log_text();
        assert_eq!(code, Some(1), "{role}: must stop at start:\n{log}");
        let last = log.lines().last().unwrap_or_default();
        assert!(
            last.starts_with("orca-relay: ")
                && last.contains("orca_relay_store_tls_failed cause=unknown_ca "),
            "{role}: the start-up error must name the cause:\n{log}"
        );
    }
}
