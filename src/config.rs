//! Typed configuration, read once from the environment at start (SPEC §4).
//!
//! An empty string means unset: systemd env files and container platforms deliver unset values
//! as `''`, and reading `''` as 0 would silently disable a window. A bad value is a
//! [`ConfigError`] that names the variable, the value and the accepted range; a required
//! variable that is unset is a [`ConfigError`] of kind [`Problem::Missing`], never
//! `invalid X=""`. Reading never stops at the first problem: [`Config::from_lookup_all`]
//! collects every one ([`ConfigErrors`]), so `check-config` lists them all in one run and
//! `run` stops with one line per problem.
//!
//! The parsing is pure: [`Config::from_lookup_all`] takes a lookup function, so tests never
//! touch the process environment.
//!
//! Adding a variable is four local edits: its field in [`Config`] (or [`Timings`]), one
//! `r.int(…)` / `r.url(…)` / `r.addr(…)` / `r.text(…)` line in [`Config::from_lookup_all`]
//! (a [`Reader`] records a bad value and hands back the default, so the rest is still read),
//! its name in [`VARIABLES`], and its line in [`Config::describe`].

use std::collections::BTreeMap;
use std::fmt;
use std::net::SocketAddr;
use std::path::PathBuf;

use crate::database_tls::{self, DatabaseTls};
use crate::liveness::TestFault;
use crate::service_token::ServiceTokens;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    Combined,
    Cell,
    Director,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Combined => "combined",
            Role::Cell => "cell",
            Role::Director => "director",
        }
    }

    pub fn runs_cell(self) -> bool {
        matches!(self, Role::Combined | Role::Cell)
    }

    pub fn runs_director(self) -> bool {
        matches!(self, Role::Combined | Role::Director)
    }
}

/// What is wrong with a variable.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Problem {
    /// A required variable is unset (or `''`).
    Missing,
    /// The variable is set to a value outside what is accepted.
    Invalid,
    /// The variable's value is not valid UTF-8 (SPEC §13 "Environment"): refused like any
    /// invalid value, never read as unset. `value` says where the first bad byte is (empty for
    /// a secret), never the bytes.
    NotUtf8,
}

/// A configuration error: one line naming the variable, the value and what is accepted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    pub variable: String,
    pub value: String,
    pub expected: String,
    pub problem: Problem,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.problem {
            Problem::Missing => write!(
                f,
                "missing {} (unset): expected {}",
                self.variable, self.expected
            ),
            Problem::Invalid => write!(
                f,
                "invalid {}={:?}: expected {}",
                self.variable, self.value, self.expected
            ),
            Problem::NotUtf8 if self.value.is_empty() => write!(
                f,
                "invalid {}: the value is not valid UTF-8: expected {}",
                self.variable, self.expected
            ),
            Problem::NotUtf8 => write!(
                f,
                "invalid {}: the value is not valid UTF-8 ({}): expected {}",
                self.variable, self.value, self.expected
            ),
        }
    }
}

impl std::error::Error for ConfigError {}

/// Every problem of one reading of the environment, in the order the variables are read.
/// Never empty.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigErrors(pub Vec<ConfigError>);

impl ConfigErrors {
    /// `1 problem`, `3 problems`: the summary line of `check-config`.
    pub fn summary(&self) -> String {
        match self.0.len() {
            1 => "1 problem".to_string(),
            n => format!("{n} problems"),
        }
    }
}

impl fmt::Display for ConfigErrors {
    /// One line per problem.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (n, error) in self.0.iter().enumerate() {
            if n > 0 {
                writeln!(f)?;
            }
            write!(f, "{error}")?;
        }
        Ok(())
    }
}

impl std::error::Error for ConfigErrors {}

/// The timing knobs. Production values by default; tests and operators may shrink them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Timings {
    pub dead_man_base_ms: u64,
    pub dead_man_spread_ms: u64,
    pub trip_claim_retry_ms: u64,
    pub trip_slot_stale_ms: u64,
    pub tripped_row_force_refresh_ms: u64,
    pub admit_effective_refresh_ms: u64,
    pub seat_memory_ms: u64,
    pub switch_poll_ms: u64,
    pub heartbeat_ms: u64,
    pub heartbeat_fresh_ms: u64,
    pub feed_poll_ms: u64,
    pub readiness_probe_ms: u64,
    pub ping_ms: u64,
    pub silence_ms: u64,
    /// How long the first frame of a WebSocket may take (SPEC §5.2: 2 s).
    pub first_frame_ms: u64,
    /// How long a phone waits for the host's data leg (SPEC §5.2: 10 s).
    pub attach_deadline_ms: u64,
    /// How long a direction may stay undrained before it is closed 4429 (SPEC §5.2: 10 s).
    pub wedge_ms: u64,
    /// Activity lease renewal period and lifetime (SPEC §5.2: 30 s for 105 s).
    pub lease_renew_ms: u64,
    pub lease_ttl_ms: u64,
}

impl Default for Timings {
    fn default() -> Self {
        Timings {
            dead_man_base_ms: 60_000,
            dead_man_spread_ms: 60_000,
            trip_claim_retry_ms: 30_000,
            trip_slot_stale_ms: 600_000,
            tripped_row_force_refresh_ms: 300_000,
            admit_effective_refresh_ms: 15_000,
            seat_memory_ms: 600_000,
            switch_poll_ms: 5_000,
            heartbeat_ms: 15_000,
            heartbeat_fresh_ms: 45_000,
            feed_poll_ms: 1_000,
            readiness_probe_ms: 5_000,
            ping_ms: 15_000,
            silence_ms: 75_000,
            first_frame_ms: 2_000,
            attach_deadline_ms: 10_000,
            wedge_ms: 10_000,
            lease_renew_ms: 30_000,
            lease_ttl_ms: 105_000,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    pub role: Role,
    pub cell_id: String,
    pub region: String,
    pub ws_addr: SocketAddr,
    pub http_addr: SocketAddr,
    pub cell_url: String,
    /// The base URL of this process's HTTP listener as directors reach it (`/internal/*`,
    /// SPEC §5.4); sent in the cell's registration.
    pub internal_url: String,
    pub director_urls: Vec<String>,
    pub database_url: Option<String>,
    /// `DATABASE_URL`'s `sslmode` and `sslrootcert`, or `ORCA_RELAY_DATABASE_CA_FILE`
    /// (validated here; the store reads the same URL again to connect). `None` on SQLite.
    pub database_tls: Option<DatabaseTls>,
    /// `ORCA_RELAY_DATABASE_CA_FILE`: the CA bundle when the URL names none.
    pub database_ca_file: Option<PathBuf>,
    pub data_dir: PathBuf,
    pub pool_max: u32,
    pub pool_reserve_max: u32,
    pub jwks_url: Option<String>,
    /// `ORCA_RELAY_JWKS_ALLOW_HTTP=1`: a `http://` JWKS URL is accepted (tests, local use).
    pub jwks_allow_http: bool,
    pub auth_issuer: Option<String>,
    pub auth_audience: String,
    pub self_hosted_key: Option<String>,
    /// The comma list: the first is sent, any is accepted.
    pub service_token: Option<ServiceTokens>,
    pub switch_file: PathBuf,
    pub connection_cap: u32,
    /// Pre-authentication sockets on the WebSocket port at most, apart from the connection cap
    /// (SPEC §11).
    pub pending_upgrades_max: u32,
    /// Of those, at most this many from one source address (an IPv6 /64): one host that
    /// floods connects sheds its own (issue 30).
    pub pending_per_source_max: u32,
    /// Descriptors held at most by refused and closing connections waiting out their linger in
    /// the reaper; past it (or once the peer has gone) a socket is closed at once (issue 30).
    pub closing_connections_max: u32,
    /// Event-loop threads that splice attached phone/data pairs (SPEC §11); default: cores.
    pub splice_workers: u32,
    /// The one budget large buffers draw on (a control's frame past 16 KiB, a leg's pending
    /// output past 32 KiB); each connection is planned at its ordinary amount (issue 30).
    pub buffer_budget_bytes: u64,
    /// Under a service manager that keeps descriptors (systemd's `FileDescriptorStoreMax=`),
    /// every listener and connection is kept in its store so that a crash costs a pause, not a
    /// redial (SPEC §13, `crash_store`); `ORCA_RELAY_CRASH_STORE=0` turns it off.
    pub crash_store: bool,
    /// A spliced leg from which nothing arrived for half of this is pinged by the relay; for
    /// all of it, its pair is closed 4408 (SPEC §12).
    pub splice_idle_ms: u64,
    /// An idle keep-alive connection on the HTTP port is closed after this (SPEC §11).
    pub http_idle_ms: u64,
    /// Open connections on the HTTP port at most.
    pub http_connections_max: u32,
    pub readiness_jwks_grace_ms: u64,
    pub readiness_sql_grace_ms: u64,
    pub handshake_timeout_ms: u64,
    pub handshake_attempts: u32,
    pub drain_grace_ms: u64,
    /// Director: a cell not heard from (heartbeat or registration, database clock) for this
    /// long is retired: no longer polled or placed on (judged once the director has been up
    /// this long).
    pub cell_retire_ms: u64,
    /// Director: a cell silent this long is forgotten: its rows are deleted, except the
    /// operator's admit-mode record.
    pub cell_forget_ms: u64,
    pub timings: Timings,
    /// `ORCA_RELAY_TEST_CLOCK_OFFSET_MS`, a test knob: this process's wall clock runs this far
    /// ahead (negative: behind), as if its machine's clock were off. Never set in production;
    /// the fault-injection test (`tests/nemesis`) uses it.
    pub test_clock_offset_ms: i64,
    /// `ORCA_RELAY_TEST_FAULT`, a test knob: a critical thread to wedge or panic
    /// (`liveness::TestFault`), so the tests can prove the liveness checks. Never set in
    /// production.
    pub test_fault: Option<TestFault>,
}

/// Every variable the relay reads, in the order `check-config` prints them.
pub const VARIABLES: &[&str] = &[
    "ORCA_RELAY_ROLE",
    "ORCA_RELAY_CELL_ID",
    "ORCA_RELAY_REGION",
    "ORCA_RELAY_WS_ADDR",
    "ORCA_RELAY_HTTP_ADDR",
    "ORCA_RELAY_CELL_URL",
    "ORCA_RELAY_INTERNAL_URL",
    "ORCA_RELAY_DIRECTOR_URLS",
    "DATABASE_URL",
    "ORCA_RELAY_DATABASE_CA_FILE",
    "ORCA_RELAY_DATA_DIR",
    "ORCA_RELAY_DATABASE_POOL_MAX",
    "ORCA_RELAY_DATABASE_POOL_RESERVE_MAX",
    "ORCA_RELAY_JWKS_URL",
    "ORCA_RELAY_JWKS_ALLOW_HTTP",
    "ORCA_RELAY_AUTH_ISSUER",
    "ORCA_RELAY_AUTH_AUDIENCE",
    "ORCA_RELAY_SELF_HOSTED_KEY",
    "ORCA_RELAY_SERVICE_TOKEN",
    "ORCA_RELAY_SWITCH_FILE",
    "ORCA_RELAY_CONNECTION_CAP",
    "ORCA_RELAY_PENDING_UPGRADES_MAX",
    "ORCA_RELAY_PENDING_PER_SOURCE_MAX",
    "ORCA_RELAY_CLOSING_CONNECTIONS_MAX",
    "ORCA_RELAY_SPLICE_WORKERS",
    "ORCA_RELAY_BUFFER_BUDGET_BYTES",
    "ORCA_RELAY_CRASH_STORE",
    "ORCA_RELAY_SPLICE_IDLE_MS",
    "ORCA_RELAY_HTTP_IDLE_MS",
    "ORCA_RELAY_HTTP_CONNECTIONS_MAX",
    "ORCA_RELAY_READINESS_JWKS_GRACE_MS",
    "ORCA_RELAY_READINESS_SQL_GRACE_MS",
    "ORCA_RELAY_HANDSHAKE_TIMEOUT_MS",
    "ORCA_RELAY_HANDSHAKE_ATTEMPTS",
    "ORCA_RELAY_DRAIN_GRACE_MS",
    "ORCA_RELAY_CELL_RETIRE_MS",
    "ORCA_RELAY_CELL_FORGET_MS",
    "ORCA_RELAY_DEAD_MAN_BASE_MS",
    "ORCA_RELAY_DEAD_MAN_SPREAD_MS",
    "ORCA_RELAY_TRIP_CLAIM_RETRY_MS",
    "ORCA_RELAY_TRIP_SLOT_STALE_MS",
    "ORCA_RELAY_TRIPPED_ROW_FORCE_REFRESH_MS",
    "ORCA_RELAY_ADMIT_EFFECTIVE_REFRESH_MS",
    "ORCA_RELAY_SEAT_MEMORY_MS",
    "ORCA_RELAY_SWITCH_POLL_MS",
    "ORCA_RELAY_HEARTBEAT_MS",
    "ORCA_RELAY_HEARTBEAT_FRESH_MS",
    "ORCA_RELAY_FEED_POLL_MS",
    "ORCA_RELAY_READINESS_PROBE_MS",
    "ORCA_RELAY_PING_MS",
    "ORCA_RELAY_SILENCE_MS",
    "ORCA_RELAY_FIRST_FRAME_MS",
    "ORCA_RELAY_ATTACH_DEADLINE_MS",
    "ORCA_RELAY_WEDGE_MS",
    "ORCA_RELAY_LEASE_RENEW_MS",
    "ORCA_RELAY_LEASE_TTL_MS",
    "ORCA_RELAY_TEST_CLOCK_OFFSET_MS",
    "ORCA_RELAY_TEST_FAULT",
];

/// How `check-config` shows a variable that is unset and has no default.
pub const UNSET: &str = "(unset)";

const SECRET_VARIABLES: &[&str] = &[
    "ORCA_RELAY_SELF_HOSTED_KEY",
    "ORCA_RELAY_SERVICE_TOKEN",
    "DATABASE_URL",
];

/// Reads one variable, treating `''` (and whitespace only) as unset.
fn get(lookup: &dyn Fn(&str) -> Option<String>, name: &str) -> Option<String> {
    lookup(name)
        .map(|v| v.trim().to_string())
        .filter(|v| !v.is_empty())
}

fn error(name: &str, value: &str, expected: impl Into<String>) -> ConfigError {
    ConfigError {
        variable: name.to_string(),
        value: value.to_string(),
        expected: expected.into(),
        problem: Problem::Invalid,
    }
}

/// A value that is not valid UTF-8: where its first bad byte is (not for a secret), never the
/// bytes themselves.
fn not_utf8(name: &str, raw: &[u8]) -> ConfigError {
    let at = match std::str::from_utf8(raw) {
        Err(e) if !SECRET_VARIABLES.contains(&name) => {
            let offset = e.valid_up_to();
            format!("byte 0x{:02x} at offset {offset}", raw[offset])
        }
        _ => String::new(),
    };
    ConfigError {
        variable: name.to_string(),
        value: at,
        expected: "text (set it again in UTF-8, or unset it)".to_string(),
        problem: Problem::NotUtf8,
    }
}

fn missing(name: &str, expected: impl Into<String>) -> ConfigError {
    ConfigError {
        variable: name.to_string(),
        value: String::new(),
        expected: expected.into(),
        problem: Problem::Missing,
    }
}

/// Reads variables and collects every problem instead of stopping at the first: a bad value
/// is recorded and the variable's default stands in, so the rest of the environment is still
/// read (and checked against something sensible).
pub struct Reader<'a> {
    lookup: &'a dyn Fn(&str) -> Option<String>,
    problems: Vec<ConfigError>,
}

impl<'a> Reader<'a> {
    pub fn new(lookup: &'a dyn Fn(&str) -> Option<String>) -> Self {
        Reader {
            lookup,
            problems: Vec::new(),
        }
    }

    /// The trimmed value, `None` when unset or `''`.
    pub fn text(&self, name: &str) -> Option<String> {
        get(self.lookup, name)
    }

    /// The value of a parse, or `fallback` with the problem recorded.
    pub fn check<T>(&mut self, result: Result<T, ConfigError>, fallback: T) -> T {
        match result {
            Ok(value) => value,
            Err(problem) => {
                self.problems.push(problem);
                fallback
            }
        }
    }

    /// An integer in `min..=max`; unset gives `default`, a bad value is recorded.
    pub fn int(&mut self, name: &str, default: u64, min: u64, max: u64) -> u64 {
        let parsed = parse_int_in(self.lookup, name, default, min, max);
        self.check(parsed, default)
    }

    /// A signed integer in `min..=max`; unset gives 0, a bad value is recorded.
    pub fn signed(&mut self, name: &str, min: i64, max: i64) -> i64 {
        let parsed = match get(self.lookup, name) {
            None => Ok(0),
            Some(raw) => match raw.parse::<i64>() {
                Ok(v) if (min..=max).contains(&v) => Ok(v),
                _ => Err(error(name, &raw, format!("an integer from {min} to {max}"))),
            },
        };
        self.check(parsed, 0)
    }

    /// An address; unset gives `default`.
    pub fn addr(&mut self, name: &str, default: SocketAddr) -> SocketAddr {
        let parsed = parse_addr(self.lookup, name, &default.to_string());
        self.check(parsed, default)
    }

    /// An optional URL with one of `schemes`.
    pub fn url(&mut self, name: &str, schemes: &[&str]) -> Option<String> {
        let parsed = parse_url(self.lookup, name, schemes);
        self.check(parsed, None)
    }

    /// Records a bad value.
    pub fn invalid(&mut self, name: &str, value: &str, expected: impl Into<String>) {
        self.problems.push(error(name, value, expected));
    }

    /// Records a required variable that is unset.
    pub fn missing(&mut self, name: &str, expected: impl Into<String>) {
        self.problems.push(missing(name, expected));
    }

    /// Problems recorded so far.
    pub fn problem_count(&self) -> usize {
        self.problems.len()
    }

    fn finish<T>(self, value: T) -> Result<T, ConfigErrors> {
        if self.problems.is_empty() {
            Ok(value)
        } else {
            Err(ConfigErrors(self.problems))
        }
    }
}

/// The most splice workers a process may run (one event loop each).
pub const MAX_SPLICE_WORKERS: u64 = 256;

/// `ORCA_RELAY_SPLICE_IDLE_MS` when unset: 2 minutes (see the field).
pub const DEFAULT_SPLICE_IDLE_MS: u64 = 120_000;

/// `ORCA_RELAY_SPLICE_WORKERS` when unset: one event loop per core the process may use.
pub fn default_splice_workers() -> u64 {
    std::thread::available_parallelism()
        .map_or(1, |n| n.get() as u64)
        .min(MAX_SPLICE_WORKERS)
}

/// Parses an integer in `min..=max`; unset gives `default`.
pub fn parse_int_in(
    lookup: &dyn Fn(&str) -> Option<String>,
    name: &str,
    default: u64,
    min: u64,
    max: u64,
) -> Result<u64, ConfigError> {
    match get(lookup, name) {
        None => Ok(default),
        Some(raw) => match raw.parse::<u64>() {
            Ok(v) if (min..=max).contains(&v) => Ok(v),
            _ => Err(error(name, &raw, format!("an integer from {min} to {max}"))),
        },
    }
}

fn parse_addr(
    lookup: &dyn Fn(&str) -> Option<String>,
    name: &str,
    default: &str,
) -> Result<SocketAddr, ConfigError> {
    let raw = get(lookup, name).unwrap_or_else(|| default.to_string());
    raw.parse()
        .map_err(|_| error(name, &raw, "an IP address and port such as 127.0.0.1:8080"))
}

fn parse_url(
    lookup: &dyn Fn(&str) -> Option<String>,
    name: &str,
    schemes: &[&str],
) -> Result<Option<String>, ConfigError> {
    match get(lookup, name) {
        None => Ok(None),
        Some(raw) => {
            if is_url_with_scheme(&raw, schemes) {
                Ok(Some(raw.trim_end_matches('/').to_string()))
            } else {
                Err(error(
                    name,
                    &raw,
                    format!("a URL starting with {}", schemes.join(" or ")),
                ))
            }
        }
    }
}

fn is_url_with_scheme(raw: &str, schemes: &[&str]) -> bool {
    schemes.iter().any(|scheme| {
        raw.strip_prefix(scheme)
            .and_then(|rest| rest.strip_prefix("://"))
            .is_some_and(|rest| !rest.is_empty() && !rest.contains(char::is_whitespace))
    })
}

/// Cell ids and relay host ids share one alphabet.
pub fn is_id(value: &str, max_len: usize) -> bool {
    !value.is_empty()
        && value.len() <= max_len
        && value
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

/// A `0`/`1` switch; unset is `0`.
/// A `0`/`1` flag that is `default` when unset.
fn parse_flag_default(
    lookup: &dyn Fn(&str) -> Option<String>,
    name: &str,
    default: bool,
) -> Result<bool, ConfigError> {
    match get(lookup, name).as_deref() {
        None => Ok(default),
        Some("0") => Ok(false),
        Some("1") => Ok(true),
        Some(other) => Err(error(name, other, "0 or 1")),
    }
}

fn parse_flag(lookup: &dyn Fn(&str) -> Option<String>, name: &str) -> Result<bool, ConfigError> {
    match get(lookup, name).as_deref() {
        None | Some("0") => Ok(false),
        Some("1") => Ok(true),
        Some(other) => Err(error(name, other, "0 or 1")),
    }
}

/// The JWKS URL: `https://`, or `http://` only with `ORCA_RELAY_JWKS_ALLOW_HTTP=1` (desktop
/// tokens are only as good as the keys they are checked against).
fn parse_jwks_url(
    lookup: &dyn Fn(&str) -> Option<String>,
    allow_http: bool,
) -> Result<Option<String>, ConfigError> {
    let name = "ORCA_RELAY_JWKS_URL";
    if allow_http {
        return parse_url(lookup, name, &["https", "http"]);
    }
    match parse_url(lookup, name, &["https"]) {
        Ok(url) => Ok(url),
        Err(mut refused) => {
            if is_url_with_scheme(&refused.value, &["http"]) {
                refused.expected = "an https:// URL (http:// only with \
                                    ORCA_RELAY_JWKS_ALLOW_HTTP=1, for tests and local use)"
                    .to_string();
            }
            Err(refused)
        }
    }
}

/// `DATABASE_URL`'s TLS parameters (see [`database_tls::parse`]), and the rest of the URL as the
/// driver will read it. A refusal names the parameter, never the whole URL (it carries the
/// password).
fn parse_database_tls(
    url: &str,
    ca_file: Option<&std::path::Path>,
) -> Result<DatabaseTls, ConfigError> {
    let ca_file = ca_file.map(|path| path.display().to_string());
    let (driver_url, tls) = database_tls::parse(url, ca_file.as_deref())
        .map_err(|refused| error(refused.variable, &refused.value, refused.expected))?;
    if let Err(refused) = driver_url.parse::<postgres::Config>() {
        // The driver's own words name the option ("unknown option `x`"), never the password.
        let says = match std::error::Error::source(&refused) {
            Some(cause) => format!("{refused}: {cause}"),
            None => refused.to_string(),
        };
        return Err(error(
            "DATABASE_URL",
            "<masked>",
            format!("a postgres:// URL the driver accepts (it says: {says})"),
        ));
    }
    Ok(tls)
}

impl Config {
    /// Reads the configuration from the process environment: every problem, or the config.
    pub fn from_env() -> Result<Config, ConfigErrors> {
        Config::from_os_lookup_all(&|name| std::env::var_os(name))
    }

    /// Reads the configuration through `lookup` of raw values (the environment's bytes),
    /// collecting every problem. A value that is not valid UTF-8 is a problem of its own
    /// ([`Problem::NotUtf8`], SPEC §13), never read as unset (it once was: a stray byte in
    /// `ORCA_RELAY_CONNECTION_CAP=10000` made the cap the default 1,000).
    pub fn from_os_lookup_all(
        lookup: &dyn Fn(&str) -> Option<std::ffi::OsString>,
    ) -> Result<Config, ConfigErrors> {
        let refused: std::cell::RefCell<Vec<ConfigError>> = Default::default();
        let text = |name: &str| match lookup(name)?.into_string() {
            Ok(text) => Some(text),
            Err(raw) => {
                use std::os::unix::ffi::OsStrExt;
                let mut refused = refused.borrow_mut();
                if !refused.iter().any(|e| e.variable == name) {
                    refused.push(not_utf8(name, raw.as_bytes()));
                }
                None
            }
        };
        let read = Config::from_lookup_all(&text);
        let mut problems = refused.into_inner();
        if problems.is_empty() {
            return read;
        }
        if let Err(ConfigErrors(others)) = read {
            // The refused variable was read as unset meanwhile: a `missing` line for it would
            // be a second, wrong, line about the same variable.
            let others: Vec<ConfigError> = others
                .into_iter()
                .filter(|other| !problems.iter().any(|p| p.variable == other.variable))
                .collect();
            problems.extend(others);
        }
        Err(ConfigErrors(problems))
    }

    /// `lookup` over raw values, as text: a value that is not valid UTF-8 reads as unset. For
    /// counting what is set ([`Config::variables_set`]) once [`Config::from_os_lookup_all`] has
    /// refused any such value.
    pub fn text_lookup(
        lookup: &dyn Fn(&str) -> Option<std::ffi::OsString>,
        name: &str,
    ) -> Option<String> {
        lookup(name).and_then(|raw| raw.into_string().ok())
    }

    /// Reads the configuration through `lookup` (pure; tests pass a map); the first problem
    /// only. [`Config::from_lookup_all`] has them all.
    pub fn from_lookup(lookup: &dyn Fn(&str) -> Option<String>) -> Result<Config, ConfigError> {
        Config::from_lookup_all(lookup).map_err(|errors| {
            errors
                .0
                .into_iter()
                .next()
                .unwrap_or_else(|| error("environment", "", "a valid configuration"))
        })
    }

    /// How many of [`VARIABLES`] are set (not unset, not `''`) in `lookup`.
    pub fn variables_set(lookup: &dyn Fn(&str) -> Option<String>) -> usize {
        VARIABLES
            .iter()
            .filter(|name| get(lookup, name).is_some())
            .count()
    }

    /// Reads the configuration through `lookup`, collecting every problem.
    pub fn from_lookup_all(
        lookup: &dyn Fn(&str) -> Option<String>,
    ) -> Result<Config, ConfigErrors> {
        let mut r = Reader::new(lookup);
        let role = match r.text("ORCA_RELAY_ROLE").as_deref() {
            None | Some("combined") => Role::Combined,
            Some("cell") => Role::Cell,
            Some("director") => Role::Director,
            Some(other) => {
                r.invalid("ORCA_RELAY_ROLE", other, "one of combined, cell, director");
                // Read the rest as the default role would.
                Role::Combined
            }
        };
        let cell_id = r
            .text("ORCA_RELAY_CELL_ID")
            .unwrap_or_else(|| "combined".into());
        if !is_id(&cell_id, 128) {
            r.invalid(
                "ORCA_RELAY_CELL_ID",
                &cell_id,
                "1-128 characters from [A-Za-z0-9_-]",
            );
        }
        let region = r
            .text("ORCA_RELAY_REGION")
            .unwrap_or_else(|| "default".into());
        let ws_addr = r.addr("ORCA_RELAY_WS_ADDR", ([127, 0, 0, 1], 8080).into());
        let http_addr = r.addr("ORCA_RELAY_HTTP_ADDR", ([127, 0, 0, 1], 8081).into());
        let cell_url = r
            .url("ORCA_RELAY_CELL_URL", &["ws", "wss"])
            .unwrap_or_else(|| format!("ws://{ws_addr}"));
        let internal_url = r
            .url("ORCA_RELAY_INTERNAL_URL", &["http", "https"])
            .unwrap_or_else(|| format!("http://{http_addr}"));
        let director_urls = match r.text("ORCA_RELAY_DIRECTOR_URLS") {
            None => Vec::new(),
            Some(raw) => {
                let parts: Vec<&str> = raw
                    .split(',')
                    .map(str::trim)
                    .filter(|p| !p.is_empty())
                    .collect();
                if parts
                    .iter()
                    .all(|part| is_url_with_scheme(part, &["http", "https"]))
                {
                    parts
                        .iter()
                        .map(|part| part.trim_end_matches('/').to_string())
                        .collect()
                } else {
                    r.invalid(
                        "ORCA_RELAY_DIRECTOR_URLS",
                        &raw,
                        "a comma-separated list of http:// or https:// URLs",
                    );
                    Vec::new()
                }
            }
        };
        let database_url = r.check(
            parse_url(lookup, "DATABASE_URL", &["postgres", "postgresql"]).map_err(
                |mut refused| {
                    // The URL carries the password: the error shows it masked.
                    refused.value = mask("DATABASE_URL", &refused.value);
                    refused
                },
            ),
            None,
        );
        let database_ca_file = r.text(database_tls::CA_FILE_VARIABLE).map(PathBuf::from);
        let database_tls = match &database_url {
            Some(url) => {
                let parsed = parse_database_tls(url, database_ca_file.as_deref()).map(Some);
                r.check(parsed, None)
            }
            None => None,
        };
        let data_dir = PathBuf::from(
            r.text("ORCA_RELAY_DATA_DIR")
                .unwrap_or_else(|| "./data".into()),
        );
        let default_pool = if role == Role::Director { 3 } else { 10 };
        let problems_before = r.problem_count();
        let pool_max = r.int("ORCA_RELAY_DATABASE_POOL_MAX", default_pool, 1, 100) as u32;
        // Against a bad POOL_MAX the ceiling is checked against the widest pool, not the
        // default that stood in for it, so one mistake is not reported twice.
        let ceiling_bound = if r.problem_count() > problems_before {
            100
        } else {
            pool_max as u64
        };
        let pool_reserve_max = r.int(
            "ORCA_RELAY_DATABASE_POOL_RESERVE_MAX",
            pool_max as u64,
            1,
            ceiling_bound,
        ) as u32;
        let jwks_allow_http = r.check(parse_flag(lookup, "ORCA_RELAY_JWKS_ALLOW_HTTP"), false);
        let jwks_url = r.check(parse_jwks_url(lookup, jwks_allow_http), None);
        let auth_issuer = r.text("ORCA_RELAY_AUTH_ISSUER");
        let auth_audience = r
            .text("ORCA_RELAY_AUTH_AUDIENCE")
            .unwrap_or_else(|| "orca-relay".into());
        let self_hosted_key = r.text("ORCA_RELAY_SELF_HOSTED_KEY");
        if let Some(key) = &self_hosted_key {
            if role != Role::Combined {
                r.invalid(
                    "ORCA_RELAY_SELF_HOSTED_KEY",
                    "<set>",
                    "unset outside the combined role (cells and directors use ORCA_RELAY_JWKS_URL)",
                );
            } else if !(32..=256).contains(&key.len()) {
                r.invalid(
                    "ORCA_RELAY_SELF_HOSTED_KEY",
                    "<masked>",
                    "a secret of 32 to 256 characters",
                );
            }
        }
        // A comma list: the first is sent, any is accepted. The refusal never shows a token.
        let service_token = match r.text("ORCA_RELAY_SERVICE_TOKEN") {
            None => None,
            Some(raw) => match ServiceTokens::parse(&raw) {
                Ok(tokens) => Some(tokens),
                Err(expected) => {
                    r.invalid("ORCA_RELAY_SERVICE_TOKEN", "<masked>", expected);
                    None
                }
            },
        };
        if role != Role::Combined && r.text("ORCA_RELAY_SERVICE_TOKEN").is_none() {
            r.missing(
                "ORCA_RELAY_SERVICE_TOKEN",
                "a shared bearer secret (required for the cell and director roles)",
            );
        }
        // The JWKS and its issuer: both required for a cell or director; the issuer whenever a
        // JWKS is set. A JWKS URL that is set but invalid still needs its issuer.
        let jwks_set = r.text("ORCA_RELAY_JWKS_URL").is_some();
        if role != Role::Combined && !jwks_set {
            r.missing(
                "ORCA_RELAY_JWKS_URL",
                "the auth JWKS URL (required for the cell and director roles)",
            );
        }
        if (jwks_set || role != Role::Combined) && auth_issuer.is_none() {
            r.missing(
                "ORCA_RELAY_AUTH_ISSUER",
                "the token issuer (required with ORCA_RELAY_JWKS_URL, and so for the cell and director roles)",
            );
        }
        let switch_file = r
            .text("ORCA_RELAY_SWITCH_FILE")
            .map(PathBuf::from)
            .unwrap_or_else(|| data_dir.join("switch.json"));
        let connection_cap = r.int("ORCA_RELAY_CONNECTION_CAP", 1000, 1, 100_000) as u32;
        let pending_upgrades_max = r.int("ORCA_RELAY_PENDING_UPGRADES_MAX", 256, 1, 100_000) as u32;
        // A quarter of the default table: a phone holds its place about one round trip, so one
        // address (a carrier NAT) still starts about 200 phones a second at 300 ms.
        let pending_per_source_max =
            r.int("ORCA_RELAY_PENDING_PER_SOURCE_MAX", 64, 1, 100_000) as u32;
        let closing_connections_max =
            r.int("ORCA_RELAY_CLOSING_CONNECTIONS_MAX", 256, 0, 100_000) as u32;
        let splice_workers = r.int(
            "ORCA_RELAY_SPLICE_WORKERS",
            default_splice_workers(),
            1,
            MAX_SPLICE_WORKERS,
        ) as u32;
        let buffer_budget_bytes = r.int(
            "ORCA_RELAY_BUFFER_BUDGET_BYTES",
            crate::relay::buffer_budget::DEFAULT_BUDGET_BYTES,
            crate::relay::buffer_budget::MIN_BUDGET_BYTES,
            1 << 40,
        );
        let crash_store = r.check(
            parse_flag_default(lookup, "ORCA_RELAY_CRASH_STORE", true),
            true,
        );
        // 2 minutes: the relay pings a leg quiet for 60 s (every endpoint answers a ping), and
        // endpoints' own keepalives of 30-60 s arrive well within it; a vanished phone frees
        // its places within it at the latest.
        let splice_idle_ms = r.int(
            "ORCA_RELAY_SPLICE_IDLE_MS",
            DEFAULT_SPLICE_IDLE_MS,
            100,
            86_400_000,
        );
        let hour = 3_600_000;
        let http_idle_ms = r.int("ORCA_RELAY_HTTP_IDLE_MS", 30_000, 100, hour);
        let http_connections_max =
            r.int("ORCA_RELAY_HTTP_CONNECTIONS_MAX", 1024, 1, 100_000) as u32;
        let readiness_jwks_grace_ms = r.int("ORCA_RELAY_READINESS_JWKS_GRACE_MS", 900_000, 0, hour);
        let readiness_sql_grace_ms = r.int("ORCA_RELAY_READINESS_SQL_GRACE_MS", 180_000, 0, hour);
        let handshake_timeout_ms = r.int(
            "ORCA_RELAY_HANDSHAKE_TIMEOUT_MS",
            12_000,
            1,
            u32::MAX as u64,
        );
        let handshake_attempts = r.int("ORCA_RELAY_HANDSHAKE_ATTEMPTS", 3, 1, 1_000) as u32;
        let drain_grace_ms = r.int("ORCA_RELAY_DRAIN_GRACE_MS", 30_000, 0, hour);
        // Retire: 1 s (tests) to 7 days; forget: from the retire age (a cell is retired before
        // it is forgotten) to 90 days.
        let day = 86_400_000;
        let cell_retire_ms = r.int("ORCA_RELAY_CELL_RETIRE_MS", 600_000, 1_000, 7 * day);
        let cell_forget_ms = r.int(
            "ORCA_RELAY_CELL_FORGET_MS",
            day.max(cell_retire_ms),
            cell_retire_ms,
            90 * day,
        );

        let d = Timings::default();
        let timings = Timings {
            dead_man_base_ms: r.int("ORCA_RELAY_DEAD_MAN_BASE_MS", d.dead_man_base_ms, 1, day),
            dead_man_spread_ms: r.int(
                "ORCA_RELAY_DEAD_MAN_SPREAD_MS",
                d.dead_man_spread_ms,
                0,
                day,
            ),
            trip_claim_retry_ms: r.int(
                "ORCA_RELAY_TRIP_CLAIM_RETRY_MS",
                d.trip_claim_retry_ms,
                1,
                day,
            ),
            trip_slot_stale_ms: r.int(
                "ORCA_RELAY_TRIP_SLOT_STALE_MS",
                d.trip_slot_stale_ms,
                1,
                day,
            ),
            tripped_row_force_refresh_ms: r.int(
                "ORCA_RELAY_TRIPPED_ROW_FORCE_REFRESH_MS",
                d.tripped_row_force_refresh_ms,
                1,
                day,
            ),
            admit_effective_refresh_ms: r.int(
                "ORCA_RELAY_ADMIT_EFFECTIVE_REFRESH_MS",
                d.admit_effective_refresh_ms,
                1,
                day,
            ),
            seat_memory_ms: r.int("ORCA_RELAY_SEAT_MEMORY_MS", d.seat_memory_ms, 1, day),
            switch_poll_ms: r.int("ORCA_RELAY_SWITCH_POLL_MS", d.switch_poll_ms, 1, day),
            heartbeat_ms: r.int("ORCA_RELAY_HEARTBEAT_MS", d.heartbeat_ms, 1, day),
            heartbeat_fresh_ms: r.int(
                "ORCA_RELAY_HEARTBEAT_FRESH_MS",
                d.heartbeat_fresh_ms,
                1,
                day,
            ),
            feed_poll_ms: r.int("ORCA_RELAY_FEED_POLL_MS", d.feed_poll_ms, 1, day),
            readiness_probe_ms: r.int(
                "ORCA_RELAY_READINESS_PROBE_MS",
                d.readiness_probe_ms,
                1,
                day,
            ),
            ping_ms: r.int("ORCA_RELAY_PING_MS", d.ping_ms, 1, day),
            silence_ms: r.int("ORCA_RELAY_SILENCE_MS", d.silence_ms, 1, day),
            first_frame_ms: r.int("ORCA_RELAY_FIRST_FRAME_MS", d.first_frame_ms, 1, day),
            attach_deadline_ms: r.int(
                "ORCA_RELAY_ATTACH_DEADLINE_MS",
                d.attach_deadline_ms,
                1,
                day,
            ),
            wedge_ms: r.int("ORCA_RELAY_WEDGE_MS", d.wedge_ms, 1, day),
            lease_renew_ms: r.int("ORCA_RELAY_LEASE_RENEW_MS", d.lease_renew_ms, 1, day),
            lease_ttl_ms: r.int("ORCA_RELAY_LEASE_TTL_MS", d.lease_ttl_ms, 1, day),
        };
        // A test knob: a day either way covers every skew a test needs.
        let test_clock_offset_ms =
            r.signed("ORCA_RELAY_TEST_CLOCK_OFFSET_MS", -(day as i64), day as i64);
        let test_fault = r.text("ORCA_RELAY_TEST_FAULT").and_then(|raw| {
            let parsed = TestFault::parse(&raw)
                .ok_or_else(|| error("ORCA_RELAY_TEST_FAULT", &raw, TestFault::EXPECTED));
            r.check(parsed.map(Some), None)
        });

        r.finish(Config {
            role,
            cell_id,
            region,
            ws_addr,
            http_addr,
            cell_url,
            internal_url,
            director_urls,
            database_url,
            database_tls,
            database_ca_file,
            data_dir,
            pool_max,
            pool_reserve_max,
            jwks_url,
            jwks_allow_http,
            auth_issuer,
            auth_audience,
            self_hosted_key,
            service_token,
            switch_file,
            connection_cap,
            pending_upgrades_max,
            pending_per_source_max,
            closing_connections_max,
            buffer_budget_bytes,
            splice_workers,
            crash_store,
            splice_idle_ms,
            http_idle_ms,
            http_connections_max,
            readiness_jwks_grace_ms,
            readiness_sql_grace_ms,
            handshake_timeout_ms,
            handshake_attempts,
            drain_grace_ms,
            cell_retire_ms,
            cell_forget_ms,
            timings,
            test_clock_offset_ms,
            test_fault,
        })
    }

    /// The application name every PostgreSQL connection of this process carries (SPEC §6.1).
    pub fn application_name(&self) -> String {
        match self.role {
            Role::Director => "orca-relay:director:director".to_string(),
            role => format!("orca-relay:{}:{}", role.as_str(), self.cell_id),
        }
    }

    /// The effective configuration as `variable=value` lines with secrets masked.
    pub fn describe(&self) -> BTreeMap<&'static str, String> {
        let opt = |v: &Option<String>| v.clone().unwrap_or_else(|| UNSET.to_string());
        let t = &self.timings;
        let mut out = BTreeMap::new();
        out.insert("ORCA_RELAY_ROLE", self.role.as_str().to_string());
        out.insert("ORCA_RELAY_CELL_ID", self.cell_id.clone());
        out.insert("ORCA_RELAY_REGION", self.region.clone());
        out.insert("ORCA_RELAY_WS_ADDR", self.ws_addr.to_string());
        out.insert("ORCA_RELAY_HTTP_ADDR", self.http_addr.to_string());
        out.insert("ORCA_RELAY_CELL_URL", self.cell_url.clone());
        out.insert("ORCA_RELAY_INTERNAL_URL", self.internal_url.clone());
        out.insert(
            "ORCA_RELAY_DIRECTOR_URLS",
            if self.director_urls.is_empty() {
                UNSET.to_string()
            } else {
                self.director_urls.join(",")
            },
        );
        out.insert("DATABASE_URL", opt(&self.database_url));
        out.insert(
            database_tls::CA_FILE_VARIABLE,
            opt(&self
                .database_ca_file
                .as_ref()
                .map(|path| path.display().to_string())),
        );
        out.insert("ORCA_RELAY_DATA_DIR", self.data_dir.display().to_string());
        out.insert("ORCA_RELAY_DATABASE_POOL_MAX", self.pool_max.to_string());
        out.insert(
            "ORCA_RELAY_DATABASE_POOL_RESERVE_MAX",
            self.pool_reserve_max.to_string(),
        );
        out.insert("ORCA_RELAY_JWKS_URL", opt(&self.jwks_url));
        out.insert(
            "ORCA_RELAY_JWKS_ALLOW_HTTP",
            if self.jwks_allow_http { "1" } else { "0" }.to_string(),
        );
        out.insert("ORCA_RELAY_AUTH_ISSUER", opt(&self.auth_issuer));
        out.insert("ORCA_RELAY_AUTH_AUDIENCE", self.auth_audience.clone());
        out.insert("ORCA_RELAY_SELF_HOSTED_KEY", opt(&self.self_hosted_key));
        out.insert(
            "ORCA_RELAY_SERVICE_TOKEN",
            opt(&self.service_token.as_ref().map(|_| "***".to_string())),
        );
        out.insert(
            "ORCA_RELAY_SWITCH_FILE",
            self.switch_file.display().to_string(),
        );
        out.insert("ORCA_RELAY_CONNECTION_CAP", self.connection_cap.to_string());
        out.insert(
            "ORCA_RELAY_PENDING_UPGRADES_MAX",
            self.pending_upgrades_max.to_string(),
        );
        out.insert(
            "ORCA_RELAY_PENDING_PER_SOURCE_MAX",
            self.pending_per_source_max.to_string(),
        );
        out.insert(
            "ORCA_RELAY_CLOSING_CONNECTIONS_MAX",
            self.closing_connections_max.to_string(),
        );
        out.insert("ORCA_RELAY_SPLICE_WORKERS", self.splice_workers.to_string());
        out.insert(
            "ORCA_RELAY_BUFFER_BUDGET_BYTES",
            self.buffer_budget_bytes.to_string(),
        );
        out.insert(
            "ORCA_RELAY_CRASH_STORE",
            if self.crash_store { "1" } else { "0" }.to_string(),
        );
        out.insert("ORCA_RELAY_SPLICE_IDLE_MS", self.splice_idle_ms.to_string());
        out.insert("ORCA_RELAY_HTTP_IDLE_MS", self.http_idle_ms.to_string());
        out.insert(
            "ORCA_RELAY_HTTP_CONNECTIONS_MAX",
            self.http_connections_max.to_string(),
        );
        out.insert(
            "ORCA_RELAY_READINESS_JWKS_GRACE_MS",
            self.readiness_jwks_grace_ms.to_string(),
        );
        out.insert(
            "ORCA_RELAY_READINESS_SQL_GRACE_MS",
            self.readiness_sql_grace_ms.to_string(),
        );
        out.insert(
            "ORCA_RELAY_HANDSHAKE_TIMEOUT_MS",
            self.handshake_timeout_ms.to_string(),
        );
        out.insert(
            "ORCA_RELAY_HANDSHAKE_ATTEMPTS",
            self.handshake_attempts.to_string(),
        );
        out.insert("ORCA_RELAY_DRAIN_GRACE_MS", self.drain_grace_ms.to_string());
        out.insert("ORCA_RELAY_CELL_RETIRE_MS", self.cell_retire_ms.to_string());
        out.insert("ORCA_RELAY_CELL_FORGET_MS", self.cell_forget_ms.to_string());
        for (name, value) in [
            ("ORCA_RELAY_DEAD_MAN_BASE_MS", t.dead_man_base_ms),
            ("ORCA_RELAY_DEAD_MAN_SPREAD_MS", t.dead_man_spread_ms),
            ("ORCA_RELAY_TRIP_CLAIM_RETRY_MS", t.trip_claim_retry_ms),
            ("ORCA_RELAY_TRIP_SLOT_STALE_MS", t.trip_slot_stale_ms),
            (
                "ORCA_RELAY_TRIPPED_ROW_FORCE_REFRESH_MS",
                t.tripped_row_force_refresh_ms,
            ),
            (
                "ORCA_RELAY_ADMIT_EFFECTIVE_REFRESH_MS",
                t.admit_effective_refresh_ms,
            ),
            ("ORCA_RELAY_SEAT_MEMORY_MS", t.seat_memory_ms),
            ("ORCA_RELAY_SWITCH_POLL_MS", t.switch_poll_ms),
            ("ORCA_RELAY_HEARTBEAT_MS", t.heartbeat_ms),
            ("ORCA_RELAY_HEARTBEAT_FRESH_MS", t.heartbeat_fresh_ms),
            ("ORCA_RELAY_FEED_POLL_MS", t.feed_poll_ms),
            ("ORCA_RELAY_READINESS_PROBE_MS", t.readiness_probe_ms),
            ("ORCA_RELAY_PING_MS", t.ping_ms),
            ("ORCA_RELAY_SILENCE_MS", t.silence_ms),
            ("ORCA_RELAY_FIRST_FRAME_MS", t.first_frame_ms),
            ("ORCA_RELAY_ATTACH_DEADLINE_MS", t.attach_deadline_ms),
            ("ORCA_RELAY_WEDGE_MS", t.wedge_ms),
            ("ORCA_RELAY_LEASE_RENEW_MS", t.lease_renew_ms),
            ("ORCA_RELAY_LEASE_TTL_MS", t.lease_ttl_ms),
        ] {
            out.insert(name, value.to_string());
        }
        out.insert(
            "ORCA_RELAY_TEST_CLOCK_OFFSET_MS",
            self.test_clock_offset_ms.to_string(),
        );
        out.insert(
            "ORCA_RELAY_TEST_FAULT",
            self.test_fault
                .as_ref()
                .map_or_else(|| UNSET.to_string(), ToString::to_string),
        );
        for secret in SECRET_VARIABLES {
            if let Some(value) = out.get_mut(secret) {
                if value != UNSET {
                    *value = mask(secret, value);
                }
            }
        }
        // Masked above; shown once more as one `***` per token, so a rotation in progress
        // reads `***,***`.
        if let Some(tokens) = &self.service_token {
            out.insert(
                "ORCA_RELAY_SERVICE_TOKEN",
                vec!["***"; tokens.len()].join(","),
            );
        }
        out
    }
}

fn mask(name: &str, value: &str) -> String {
    if name == "DATABASE_URL" {
        // Keep host and database visible; hide the password.
        if let Some((scheme, rest)) = value.split_once("://") {
            if let Some((userinfo, host)) = rest.rsplit_once('@') {
                let user = userinfo.split(':').next().unwrap_or("");
                return format!("{scheme}://{user}:***@{host}");
            }
        }
        return value.to_string();
    }
    "***".to_string()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn parse(pairs: &[(&str, &str)]) -> Result<Config, ConfigError> {
        let map: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        Config::from_lookup(&move |name| map.get(name).cloned())
    }

    #[test]
    fn defaults_are_the_production_values() {
        let config = parse(&[]).unwrap();
        assert_eq!(config.role, Role::Combined);
        assert_eq!(config.cell_id, "combined");
        assert_eq!(config.pool_max, 10);
        assert_eq!(config.pool_reserve_max, 10);
        assert_eq!(config.readiness_jwks_grace_ms, 900_000);
        assert_eq!(config.readiness_sql_grace_ms, 180_000);
        assert_eq!(config.handshake_timeout_ms, 12_000);
        assert_eq!(config.handshake_attempts, 3);
        assert_eq!(config.cell_url, "ws://127.0.0.1:8080");
        assert_eq!(config.internal_url, "http://127.0.0.1:8081");
        assert_eq!(config.switch_file, PathBuf::from("./data/switch.json"));
        assert_eq!(config.timings, Timings::default());
        assert_eq!(config.pending_upgrades_max, 256);
        assert_eq!(config.pending_per_source_max, 64);
        assert_eq!(config.closing_connections_max, 256);
        assert_eq!(config.http_idle_ms, 30_000);
        assert_eq!(config.http_connections_max, 1024);
        assert_eq!(config.cell_retire_ms, 600_000);
        assert_eq!(config.cell_forget_ms, 86_400_000);
        assert_eq!(config.splice_workers as u64, default_splice_workers());
        assert_eq!(
            parse(&[("ORCA_RELAY_SPLICE_WORKERS", "")])
                .unwrap()
                .splice_workers as u64,
            default_splice_workers()
        );
        assert_eq!(
            parse(&[("ORCA_RELAY_SPLICE_WORKERS", "3")])
                .unwrap()
                .splice_workers,
            3
        );
    }

    #[test]
    fn membership_ages_are_bounded_and_forget_is_never_before_retire() {
        let config = parse(&[
            ("ORCA_RELAY_CELL_RETIRE_MS", "2000"),
            ("ORCA_RELAY_CELL_FORGET_MS", "5000"),
        ])
        .unwrap();
        assert_eq!(
            (config.cell_retire_ms, config.cell_forget_ms),
            (2_000, 5_000)
        );
        let config = parse(&[
            ("ORCA_RELAY_CELL_RETIRE_MS", ""),
            ("ORCA_RELAY_CELL_FORGET_MS", ""),
        ])
        .unwrap();
        assert_eq!(
            (config.cell_retire_ms, config.cell_forget_ms),
            (600_000, 86_400_000)
        );
        let err = parse(&[
            ("ORCA_RELAY_CELL_RETIRE_MS", "60000"),
            ("ORCA_RELAY_CELL_FORGET_MS", "59999"),
        ])
        .unwrap_err();
        assert_eq!(
            err.to_string(),
            "invalid ORCA_RELAY_CELL_FORGET_MS=\"59999\": expected an integer from 60000 to 7776000000"
        );
        let err = parse(&[("ORCA_RELAY_CELL_RETIRE_MS", "999")]).unwrap_err();
        assert_eq!(err.variable, "ORCA_RELAY_CELL_RETIRE_MS");
        assert!(err.to_string().contains("from 1000 to 604800000"), "{err}");
    }

    /// SPEC §13: bytes that are not UTF-8 are a problem naming the variable, never unset; the
    /// variable gets no second (`missing`) line; a secret's line says nothing of its bytes.
    #[test]
    fn a_value_that_is_not_utf8_is_refused_never_read_as_unset() {
        use std::ffi::OsString;
        use std::os::unix::ffi::OsStringExt;
        let raw = |pairs: &[(&str, &[u8])]| {
            let map: HashMap<String, OsString> = pairs
                .iter()
                .map(|(k, v)| (k.to_string(), OsString::from_vec(v.to_vec())))
                .collect();
            Config::from_os_lookup_all(&move |name| map.get(name).cloned())
        };
        let errors = raw(&[("ORCA_RELAY_CONNECTION_CAP", b"10000\xff")]).unwrap_err();
        assert_eq!(errors.0.len(), 1, "{errors}");
        assert_eq!(errors.0[0].problem, Problem::NotUtf8);
        assert_eq!(
            errors.0[0].to_string(),
            "invalid ORCA_RELAY_CONNECTION_CAP: the value is not valid UTF-8 (byte 0xff at offset 5): expected text (set it again in UTF-8, or unset it)"
        );
        // A cell whose required token is not UTF-8: one line, not also `missing`.
        let errors = raw(&[
            ("ORCA_RELAY_ROLE", b"cell"),
            ("ORCA_RELAY_SERVICE_TOKEN", b"s\xe9cret"),
            ("ORCA_RELAY_JWKS_URL", b"https://auth/jwks.json"),
            ("ORCA_RELAY_AUTH_ISSUER", b"https://auth"),
            ("DATABASE_URL", b"postgres://db/relay"),
            ("ORCA_RELAY_DIRECTOR_URLS", b"http://d:8081"),
        ])
        .unwrap_err();
        assert_eq!(
            errors.to_string(),
            "invalid ORCA_RELAY_SERVICE_TOKEN: the value is not valid UTF-8: expected text (set it again in UTF-8, or unset it)"
        );
        assert!(raw(&[("ORCA_RELAY_CONNECTION_CAP", b"10000")]).is_ok());
    }

    #[test]
    fn empty_string_means_unset_never_zero() {
        let config = parse(&[
            ("ORCA_RELAY_READINESS_JWKS_GRACE_MS", ""),
            ("ORCA_RELAY_READINESS_SQL_GRACE_MS", "  "),
            ("ORCA_RELAY_HANDSHAKE_TIMEOUT_MS", ""),
            ("ORCA_RELAY_HANDSHAKE_ATTEMPTS", ""),
            ("ORCA_RELAY_ROLE", ""),
        ])
        .unwrap();
        assert_eq!(config.readiness_jwks_grace_ms, 900_000);
        assert_eq!(config.readiness_sql_grace_ms, 180_000);
        assert_eq!(config.handshake_timeout_ms, 12_000);
        assert_eq!(config.handshake_attempts, 3);
    }

    #[test]
    fn values_are_trimmed() {
        let config = parse(&[
            ("ORCA_RELAY_HANDSHAKE_TIMEOUT_MS", " 1000 "),
            ("ORCA_RELAY_HANDSHAKE_ATTEMPTS", "100"),
        ])
        .unwrap();
        assert_eq!(config.handshake_timeout_ms, 1_000);
        assert_eq!(config.handshake_attempts, 100);
    }

    #[test]
    fn bad_values_name_the_variable_value_and_range() {
        let cases: &[(&str, &str, &str)] = &[
            ("ORCA_RELAY_HANDSHAKE_TIMEOUT_MS", "0", "an integer from 1"),
            ("ORCA_RELAY_HANDSHAKE_ATTEMPTS", "-1", "an integer from 1"),
            (
                "ORCA_RELAY_HANDSHAKE_ATTEMPTS",
                "three",
                "an integer from 1",
            ),
            (
                "ORCA_RELAY_READINESS_SQL_GRACE_MS",
                "3600001",
                "0 to 3600000",
            ),
            ("ORCA_RELAY_DATABASE_POOL_MAX", "101", "1 to 100"),
            ("ORCA_RELAY_ROLE", "proxy", "combined, cell, director"),
            ("ORCA_RELAY_CELL_ID", "c 7", "[A-Za-z0-9_-]"),
            ("ORCA_RELAY_WS_ADDR", "localhost", "IP address and port"),
            ("DATABASE_URL", "mysql://x", "postgres"),
            ("ORCA_RELAY_INTERNAL_URL", "ws://10.0.0.7:8081", "http"),
            ("ORCA_RELAY_SELF_HOSTED_KEY", "short", "32 to 256"),
            ("ORCA_RELAY_HTTP_IDLE_MS", "99", "100 to 3600000"),
            ("ORCA_RELAY_HTTP_CONNECTIONS_MAX", "0", "1 to 100000"),
            ("ORCA_RELAY_PENDING_UPGRADES_MAX", "100001", "1 to 100000"),
            ("ORCA_RELAY_PENDING_PER_SOURCE_MAX", "0", "1 to 100000"),
            (
                "ORCA_RELAY_CLOSING_CONNECTIONS_MAX",
                "100001",
                "0 to 100000",
            ),
            ("ORCA_RELAY_SPLICE_WORKERS", "0", "1 to 256"),
        ];
        for (name, value, expected) in cases {
            let err = parse(&[(name, value)]).unwrap_err();
            assert_eq!(&err.variable, name, "{name}={value}");
            let line = err.to_string();
            assert!(line.contains(name), "{line}");
            assert!(line.contains(expected), "{line} should mention {expected}");
            assert!(!line.contains('\n'));
        }
    }

    #[test]
    fn internal_url_follows_the_http_listener_unless_set() {
        let config = parse(&[("ORCA_RELAY_HTTP_ADDR", "10.0.0.7:9000")]).unwrap();
        assert_eq!(config.internal_url, "http://10.0.0.7:9000");
        let config = parse(&[("ORCA_RELAY_INTERNAL_URL", "https://c7.internal:8443/")]).unwrap();
        assert_eq!(config.internal_url, "https://c7.internal:8443");
    }

    #[test]
    fn grace_zero_disables_and_is_accepted() {
        let config = parse(&[("ORCA_RELAY_READINESS_JWKS_GRACE_MS", "0")]).unwrap();
        assert_eq!(config.readiness_jwks_grace_ms, 0);
    }

    #[test]
    fn reserve_ceiling_defaults_to_pool_and_may_not_exceed_it() {
        let config = parse(&[("ORCA_RELAY_DATABASE_POOL_MAX", "16")]).unwrap();
        assert_eq!(config.pool_reserve_max, 16);
        let config = parse(&[
            ("ORCA_RELAY_DATABASE_POOL_MAX", "16"),
            ("ORCA_RELAY_DATABASE_POOL_RESERVE_MAX", "12"),
        ])
        .unwrap();
        assert_eq!(config.pool_reserve_max, 12);
        let err = parse(&[
            ("ORCA_RELAY_DATABASE_POOL_MAX", "16"),
            ("ORCA_RELAY_DATABASE_POOL_RESERVE_MAX", "17"),
        ])
        .unwrap_err();
        assert_eq!(err.variable, "ORCA_RELAY_DATABASE_POOL_RESERVE_MAX");
    }

    #[test]
    fn cell_and_director_need_service_token_and_jwks() {
        let err = parse(&[("ORCA_RELAY_ROLE", "cell")]).unwrap_err();
        assert_eq!(err.variable, "ORCA_RELAY_SERVICE_TOKEN");
        let err = parse(&[
            ("ORCA_RELAY_ROLE", "director"),
            ("ORCA_RELAY_SERVICE_TOKEN", "s"),
        ])
        .unwrap_err();
        assert_eq!(err.variable, "ORCA_RELAY_JWKS_URL");
        let config = parse(&[
            ("ORCA_RELAY_ROLE", "director"),
            ("ORCA_RELAY_SERVICE_TOKEN", "s"),
            ("ORCA_RELAY_JWKS_URL", "https://127.0.0.1:9/jwks"),
            ("ORCA_RELAY_AUTH_ISSUER", "https://auth"),
        ])
        .unwrap();
        assert_eq!(config.pool_max, 3, "directors default to a pool of 3");
    }

    fn parse_all(pairs: &[(&str, &str)]) -> Result<Config, ConfigErrors> {
        let map: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        Config::from_lookup_all(&move |name| map.get(name).cloned())
    }

    #[test]
    fn every_problem_is_reported_in_one_reading() {
        let errors = parse_all(&[
            ("ORCA_RELAY_ROLE", "cell"),
            ("ORCA_RELAY_CELL_ID", "c 7"),
            ("ORCA_RELAY_DATABASE_POOL_MAX", "0"),
            ("ORCA_RELAY_PING_MS", "soon"),
            ("ORCA_RELAY_DIRECTOR_URLS", "director.internal"),
        ])
        .unwrap_err();
        let found: Vec<(&str, Problem)> = errors
            .0
            .iter()
            .map(|e| (e.variable.as_str(), e.problem))
            .collect();
        assert_eq!(
            found,
            vec![
                ("ORCA_RELAY_CELL_ID", Problem::Invalid),
                ("ORCA_RELAY_DIRECTOR_URLS", Problem::Invalid),
                ("ORCA_RELAY_DATABASE_POOL_MAX", Problem::Invalid),
                ("ORCA_RELAY_SERVICE_TOKEN", Problem::Missing),
                ("ORCA_RELAY_JWKS_URL", Problem::Missing),
                ("ORCA_RELAY_AUTH_ISSUER", Problem::Missing),
                ("ORCA_RELAY_PING_MS", Problem::Invalid),
            ]
        );
        assert_eq!(errors.summary(), "7 problems");
        assert_eq!(errors.to_string().lines().count(), 7);
        // `from_lookup` keeps answering with the first.
        let first =
            parse(&[("ORCA_RELAY_ROLE", "cell"), ("ORCA_RELAY_CELL_ID", "c 7")]).unwrap_err();
        assert_eq!(first.variable, "ORCA_RELAY_CELL_ID");
    }

    #[test]
    fn unset_is_missing_and_never_invalid_empty() {
        for role in ["cell", "director"] {
            let errors = parse_all(&[
                ("ORCA_RELAY_ROLE", role),
                ("ORCA_RELAY_SERVICE_TOKEN", ""),
                ("ORCA_RELAY_JWKS_URL", "  "),
            ])
            .unwrap_err();
            assert_eq!(errors.0.len(), 3, "{errors}");
            for error in &errors.0 {
                assert_eq!(error.problem, Problem::Missing);
                let line = error.to_string();
                assert!(line.starts_with("missing ORCA_RELAY_"), "{line}");
                assert!(line.contains("(unset)"), "{line}");
                assert!(!line.contains("\"\""), "{line}");
            }
        }
        let error = parse_all(&[("ORCA_RELAY_JWKS_URL", "https://auth/jwks")]).unwrap_err();
        assert_eq!(error.0[0].variable, "ORCA_RELAY_AUTH_ISSUER");
        assert_eq!(error.0[0].problem, Problem::Missing);
        assert_eq!(error.summary(), "1 problem");
    }

    #[test]
    fn a_bad_pool_max_does_not_make_a_good_ceiling_look_bad() {
        let errors = parse_all(&[
            ("ORCA_RELAY_DATABASE_POOL_MAX", "200"),
            ("ORCA_RELAY_DATABASE_POOL_RESERVE_MAX", "50"),
        ])
        .unwrap_err();
        assert_eq!(errors.0.len(), 1, "{errors}");
        assert_eq!(errors.0[0].variable, "ORCA_RELAY_DATABASE_POOL_MAX");
    }

    #[test]
    fn unset_variables_without_a_default_read_the_same() {
        let described = parse(&[]).unwrap().describe();
        for name in [
            "ORCA_RELAY_DIRECTOR_URLS",
            "DATABASE_URL",
            "ORCA_RELAY_JWKS_URL",
            "ORCA_RELAY_AUTH_ISSUER",
            "ORCA_RELAY_SELF_HOSTED_KEY",
            "ORCA_RELAY_SERVICE_TOKEN",
        ] {
            assert_eq!(described[name], UNSET, "{name}");
        }
        assert!(described.values().all(|v| !v.is_empty()));
        let counted = Config::variables_set(&|name| match name {
            "ORCA_RELAY_REGION" => Some("eu".into()),
            "ORCA_RELAY_CELL_ID" => Some(" ".into()),
            _ => None,
        });
        assert_eq!(counted, 1, "'' and blanks are unset");
    }

    #[test]
    fn a_plain_http_jwks_url_needs_the_explicit_allowance() {
        let jwks = [
            ("ORCA_RELAY_JWKS_URL", "http://auth.internal/jwks.json"),
            ("ORCA_RELAY_AUTH_ISSUER", "https://auth"),
        ];
        let err = parse(&jwks).unwrap_err();
        assert_eq!(err.variable, "ORCA_RELAY_JWKS_URL");
        let line = err.to_string();
        assert!(line.contains("https://"), "{line}");
        assert!(line.contains("ORCA_RELAY_JWKS_ALLOW_HTTP=1"), "{line}");
        let mut pairs = jwks.to_vec();
        pairs.push(("ORCA_RELAY_JWKS_ALLOW_HTTP", "1"));
        let config = parse(&pairs).unwrap();
        assert_eq!(
            config.jwks_url.as_deref(),
            Some("http://auth.internal/jwks.json")
        );
        assert!(config.jwks_allow_http);
        for refused in ["0", ""] {
            let mut pairs = jwks.to_vec();
            pairs.push(("ORCA_RELAY_JWKS_ALLOW_HTTP", refused));
            assert_eq!(
                parse(&pairs).unwrap_err().variable,
                "ORCA_RELAY_JWKS_URL",
                "ALLOW_HTTP={refused:?}"
            );
        }
        let err = parse(&[("ORCA_RELAY_JWKS_ALLOW_HTTP", "yes")]).unwrap_err();
        assert_eq!(err.variable, "ORCA_RELAY_JWKS_ALLOW_HTTP");
        assert!(err.to_string().contains("0 or 1"));
        // https needs nothing, and another scheme is refused as before.
        let config = parse(&[
            ("ORCA_RELAY_JWKS_URL", "https://auth/jwks.json"),
            ("ORCA_RELAY_AUTH_ISSUER", "https://auth"),
        ])
        .unwrap();
        assert!(!config.jwks_allow_http);
        let err = parse(&[("ORCA_RELAY_JWKS_URL", "ftp://auth/jwks.json")]).unwrap_err();
        assert!(err.to_string().contains("https"), "{err}");
    }

    #[test]
    fn database_tls_is_validated_with_one_line_that_hides_the_password() {
        let config = parse(&[(
            "DATABASE_URL",
            "postgres://relay:hunter2@db:5432/relay?sslmode=verify-full&sslrootcert=/etc/ca.pem",
        )])
        .unwrap();
        let tls = config
            .database_tls
            .expect("a PostgreSQL URL has a TLS setting");
        assert_eq!(tls.mode, crate::database_tls::SslMode::VerifyFull);
        let config = parse(&[("DATABASE_URL", "postgres://db/relay")]).unwrap();
        assert_eq!(
            config.database_tls.map(|tls| tls.mode),
            Some(crate::database_tls::SslMode::Prefer),
            "prefer by default, as libpq"
        );
        assert_eq!(parse(&[]).unwrap().database_tls, None, "SQLite has none");
        let config = parse(&[
            ("DATABASE_URL", "postgres://db/relay?sslmode=verify-ca"),
            ("ORCA_RELAY_DATABASE_CA_FILE", "/etc/orca-relay/db-ca.pem"),
        ])
        .unwrap();
        assert_eq!(
            config.database_ca_file,
            Some(PathBuf::from("/etc/orca-relay/db-ca.pem"))
        );
        for (url, needle) in [
            (
                "postgres://relay:hunter2@db/relay?sslmode=verify",
                "DATABASE_URL=\"sslmode=verify\": expected sslmode to be one of disable, prefer, require, verify-ca, verify-full",
            ),
            (
                "postgres://relay:hunter2@db/relay?sslmode=verify-full",
                "ORCA_RELAY_DATABASE_CA_FILE",
            ),
            ("postgres://relay:hunter2@db/relay?frobnicate=1", "frobnicate"),
            ("mysql://relay:hunter2@db/relay", "postgres"),
        ] {
            let err = parse(&[("DATABASE_URL", url)]).unwrap_err();
            assert_eq!(err.variable, "DATABASE_URL", "{url}");
            let line = err.to_string();
            assert!(line.contains(needle), "{url}: {line}");
            assert!(!line.contains("hunter2"), "{url}: {line}");
            assert!(!line.contains('\n'));
        }
    }

    #[test]
    fn the_test_clock_offset_is_signed_and_bounded() {
        assert_eq!(parse(&[]).unwrap().test_clock_offset_ms, 0);
        assert_eq!(
            parse(&[("ORCA_RELAY_TEST_CLOCK_OFFSET_MS", "-300000")])
                .unwrap()
                .test_clock_offset_ms,
            -300_000
        );
        let config = parse(&[("ORCA_RELAY_TEST_CLOCK_OFFSET_MS", "300000")]).unwrap();
        assert_eq!(
            config.describe()["ORCA_RELAY_TEST_CLOCK_OFFSET_MS"],
            "300000"
        );
        for bad in ["86400001", "-86400001", "5m", "1.5"] {
            let err = parse(&[("ORCA_RELAY_TEST_CLOCK_OFFSET_MS", bad)]).unwrap_err();
            assert_eq!(err.variable, "ORCA_RELAY_TEST_CLOCK_OFFSET_MS", "{bad}");
            assert!(err.to_string().contains("-86400000 to 86400000"), "{err}");
        }
    }

    #[test]
    fn the_test_fault_names_a_kind_and_a_thread() {
        assert_eq!(parse(&[]).unwrap().test_fault, None);
        assert_eq!(
            parse(&[("ORCA_RELAY_TEST_FAULT", "")]).unwrap().test_fault,
            None
        );
        let config = parse(&[("ORCA_RELAY_TEST_FAULT", "wedge:acceptor@2000")]).unwrap();
        assert_eq!(
            config.test_fault,
            Some(TestFault {
                kind: crate::liveness::FaultKind::Wedge,
                thread: "acceptor".into(),
                after_ms: 2_000,
            })
        );
        assert_eq!(
            config.describe()["ORCA_RELAY_TEST_FAULT"],
            "wedge:acceptor@2000"
        );
        for bad in ["hang:acceptor", "acceptor", "panic:", "panic:splice-0@soon"] {
            let err = parse(&[("ORCA_RELAY_TEST_FAULT", bad)]).unwrap_err();
            assert_eq!(err.variable, "ORCA_RELAY_TEST_FAULT", "{bad}");
            assert!(err.to_string().contains("wedge:THREAD"), "{err}");
        }
    }

    #[test]
    fn the_service_token_is_a_comma_list() {
        let config = parse(&[("ORCA_RELAY_SERVICE_TOKEN", "new-token, old-token")]).unwrap();
        let tokens = config.service_token.clone().unwrap();
        assert_eq!(tokens.sent(), "new-token");
        assert!(tokens.accepts(Some("Bearer old-token")));
        assert_eq!(config.describe()["ORCA_RELAY_SERVICE_TOKEN"], "***,***");
        let config = parse(&[("ORCA_RELAY_SERVICE_TOKEN", "only")]).unwrap();
        assert_eq!(config.describe()["ORCA_RELAY_SERVICE_TOKEN"], "***");
        let err = parse(&[("ORCA_RELAY_SERVICE_TOKEN", "new-token,,old-token")]).unwrap_err();
        assert_eq!(err.variable, "ORCA_RELAY_SERVICE_TOKEN");
        assert!(!err.to_string().contains("new-token"), "{err}");
    }

    #[test]
    fn describe_masks_secrets() {
        let config = parse(&[
            ("ORCA_RELAY_SELF_HOSTED_KEY", "k".repeat(40).as_str()),
            ("DATABASE_URL", "postgres://relay:hunter2@db:5432/relay"),
        ])
        .unwrap();
        let described = config.describe();
        assert_eq!(described["ORCA_RELAY_SELF_HOSTED_KEY"], "***");
        assert_eq!(
            described["DATABASE_URL"],
            "postgres://relay:***@db:5432/relay"
        );
        assert_eq!(described.len(), VARIABLES.len());
    }
}
