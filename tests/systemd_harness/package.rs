//! The package as an operator installs it: the `.deb` under test in a fresh namespace
//! ([`installed`]), a JWKS for desktop tokens inside it ([`JwksServer`]), and the values an
//! operator fills into the shipped env files for a director and a cell on one PostgreSQL
//! ([`configure_fleet`]). Without the package, the pieces it would install around a build of
//! the binary ([`install_binary`]), and a combined relay's env file ([`configure_combined`]).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::Namespace;
use crate::harness::{jwks_body, SERVICE_TOKEN, TEST_ISSUER, TEST_KEY};

pub const CELL: &str = "orca-relay-cell.service";
pub const DIRECTOR: &str = "orca-relay-director.service";
pub const CELL_ENV: &str = "/etc/orca-relay/cell.env";
pub const DIRECTOR_ENV: &str = "/etc/orca-relay/director.env";
/// Where the package installs its units.
pub const UNIT_DIR: &str = "/lib/systemd/system";

/// The listeners as the shipped env files set them (inside the namespace, on its own network).
pub const WS_ADDR: &str = "127.0.0.1:8080";
pub const HTTP_ADDR: &str = "127.0.0.1:8081";
/// The fleet's cell moves its HTTP listener off the director's port (one machine, two roles).
pub const CELL_HTTP_ADDR: &str = "127.0.0.1:8082";

/// What installing the package would leave on a machine: whether each is there, for the host
/// (before and after) and inside the namespace.
pub fn traces(root: &dyn Fn(&str) -> PathBuf) -> Vec<(String, bool)> {
    let passwd = std::fs::read_to_string(root("/etc/passwd")).unwrap_or_default();
    let mut found = vec![(
        "user orca-relay in /etc/passwd".to_string(),
        passwd.lines().any(|line| line.starts_with("orca-relay:")),
    )];
    for path in [
        "/usr/bin/orca-relay",
        "/lib/systemd/system/orca-relay-cell.service",
        "/etc/orca-relay/cell.env",
        "/var/lib/dpkg/info/orca-relay.list",
        "/var/lib/orca-relay",
    ] {
        found.push((path.to_string(), root(path).exists()));
    }
    found
}

/// A namespace with the package installed (dpkg, maintainer scripts included) and both
/// units linked where an operator's units live.
pub fn installed(label: &str) -> Namespace {
    // The machine first (root, util-linux, systemd), then the package: each fails in one line.
    let ns = Namespace::boot(label);
    let dpkg = ns.install_deb(&super::deb::deb());
    // Everything the package puts on a machine is there, the postinst's user included.
    for (what, present) in traces(&|path| ns.path(path)) {
        if what != "/var/lib/orca-relay" {
            assert!(present, "{what} missing after dpkg -i:\n{dpkg}");
        }
    }
    for unit in [CELL, DIRECTOR] {
        ns.link_unit(&format!("{UNIT_DIR}/{unit}"));
    }
    ns
}

/// Without the package: the user, `binary` copied to `/usr/bin/orca-relay` (a copy, as the
/// package installs it: the unit's private `/tmp` hides a binary built under `/tmp`, which a
/// link would point into) and the shipped cell unit, unchanged.
pub fn install_binary(ns: &Namespace, binary: &Path) {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    ns.write(
        "/usr/lib/sysusers.d/orca-relay.conf",
        &std::fs::read_to_string(root.join("packaging/orca-relay.sysusers.conf")).unwrap(),
    );
    ns.run_ok(&["systemd-sysusers"]);
    let target = ns.path("/usr/bin/orca-relay");
    let _ = std::fs::remove_file(&target);
    std::fs::copy(binary, &target).expect("install /usr/bin/orca-relay");
    ns.add_unit(
        CELL,
        &std::fs::read_to_string(root.join("systemd/orca-relay-cell.service")).unwrap(),
    );
}

/// The shipped `cell.env` with what an operator of a combined relay on this machine fills in:
/// SQLite, the tests' self-hosted key (`harness::token`), the listeners on [`WS_ADDR`] and
/// [`HTTP_ADDR`], no directors.
pub fn configure_combined(ns: &Namespace) {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    std::fs::create_dir_all(ns.path("/etc/orca-relay")).unwrap();
    ns.write(
        CELL_ENV,
        &std::fs::read_to_string(root.join("packaging/cell.env")).unwrap(),
    );
    let cell_url = format!("ws://{WS_ADDR}");
    ns.set_env_values(
        CELL_ENV,
        &[
            ("ORCA_RELAY_ROLE", "combined"),
            ("DATABASE_URL", ""),
            ("ORCA_RELAY_CELL_ID", "combined"),
            ("ORCA_RELAY_WS_ADDR", WS_ADDR),
            ("ORCA_RELAY_HTTP_ADDR", HTTP_ADDR),
            ("ORCA_RELAY_CELL_URL", &cell_url),
            ("ORCA_RELAY_DIRECTOR_URLS", ""),
            ("ORCA_RELAY_SELF_HOSTED_KEY", TEST_KEY),
        ],
    );
}

/// A JWKS server with the tests' EC key, listening inside the namespace.
pub struct JwksServer {
    server: Arc<tiny_http::Server>,
    thread: Option<std::thread::JoinHandle<()>>,
    pub url: String,
}

impl JwksServer {
    pub fn start(ns: &Namespace) -> JwksServer {
        let listener = ns.listen("127.0.0.1:0");
        let url = format!("http://{}/jwks.json", listener.local_addr().unwrap());
        let server = Arc::new(tiny_http::Server::from_listener(listener, None).expect("JWKS"));
        let body = jwks_body();
        let thread = {
            let server = server.clone();
            orca_relay::threads::spawn("test-jwks", move || {
                while let Ok(request) = server.recv() {
                    let _ = request.respond(tiny_http::Response::from_string(body.clone()));
                }
            })
            .expect("spawn the JWKS server")
        };
        JwksServer {
            server,
            thread: Some(thread),
            url,
        }
    }
}

impl Drop for JwksServer {
    fn drop(&mut self) {
        self.server.unblock();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// Fills in the shipped env files for a director (on [`HTTP_ADDR`]) and a cell registered with
/// it (WebSocket on [`WS_ADDR`], HTTP on [`CELL_HTTP_ADDR`]), both on `database_url`, desktop
/// tokens checked against `jwks` (the tests' ES256 key, `harness::es256_token`), the tests'
/// service token.
pub fn configure_fleet(ns: &Namespace, database_url: &str, jwks: &JwksServer) {
    let secrets = [
        ("DATABASE_URL", database_url),
        ("ORCA_RELAY_SERVICE_TOKEN", SERVICE_TOKEN),
        ("ORCA_RELAY_JWKS_URL", jwks.url.as_str()),
        // The test's JWKS speaks plain HTTP inside the namespace.
        ("ORCA_RELAY_JWKS_ALLOW_HTTP", "1"),
        ("ORCA_RELAY_AUTH_ISSUER", TEST_ISSUER),
    ];
    ns.set_env_values(DIRECTOR_ENV, &secrets);
    ns.set_env_values(CELL_ENV, &secrets);
    let cell_http_url = format!("http://{CELL_HTTP_ADDR}");
    let cell_url = format!("ws://{WS_ADDR}");
    let director_url = format!("http://{HTTP_ADDR}");
    ns.set_env_values(
        CELL_ENV,
        &[
            ("ORCA_RELAY_HTTP_ADDR", "0.0.0.0:8082"),
            ("ORCA_RELAY_INTERNAL_URL", cell_http_url.as_str()),
            ("ORCA_RELAY_CELL_URL", cell_url.as_str()),
            ("ORCA_RELAY_DIRECTOR_URLS", director_url.as_str()),
        ],
    );
}
