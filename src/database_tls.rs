//! How the store talks TLS to PostgreSQL: libpq's `sslmode` and `sslrootcert` read from
//! `DATABASE_URL`, plus `ORCA_RELAY_DATABASE_CA_FILE` as an environment alternative to
//! `sslrootcert` (SPEC §11 "Security").
//!
//! Floor 1, pure: [`parse`] splits a `postgres://` URL into the URL the driver reads (without the
//! two parameters it does not know) and a typed [`DatabaseTls`]. `config.rs` calls it to
//! validate at start and in `check-config`; `store/postgres.rs` calls it again to connect. The
//! CA file itself is read by `store::tls` (a bounded read), never here.
//!
//! The modes mean what they mean to libpq, so an operator's existing URL behaves the same:
//! - `disable`: plain TCP only.
//! - `prefer` (the default): ask for TLS; a server that answers "no TLS" is used in plain text.
//! - `require`: TLS or nothing. Without a CA the certificate is not checked (as libpq); with a CA
//!   (`sslrootcert` or the variable) the chain is checked, as libpq's `verify-ca`.
//! - `verify-ca`: TLS, the chain checked against the CA, not the host name.
//! - `verify-full`: TLS, the chain and the host name (or IP address) checked.
//!
//! Must never: put the URL (it carries the password) into an error; only the offending
//! parameter is quoted.

use std::fmt;
use std::path::PathBuf;

/// The variable an operator sets instead of `sslrootcert` (a path is awkward in a URL).
pub const CA_FILE_VARIABLE: &str = "ORCA_RELAY_DATABASE_CA_FILE";

/// libpq's `sslmode`, the five values the relay honours.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SslMode {
    Disable,
    Prefer,
    Require,
    VerifyCa,
    VerifyFull,
}

impl SslMode {
    pub const ACCEPTED: &'static str = "one of disable, prefer, require, verify-ca, verify-full";

    pub fn parse(value: &str) -> Option<SslMode> {
        match value {
            "disable" => Some(SslMode::Disable),
            "prefer" => Some(SslMode::Prefer),
            "require" => Some(SslMode::Require),
            "verify-ca" => Some(SslMode::VerifyCa),
            "verify-full" => Some(SslMode::VerifyFull),
            _ => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            SslMode::Disable => "disable",
            SslMode::Prefer => "prefer",
            SslMode::Require => "require",
            SslMode::VerifyCa => "verify-ca",
            SslMode::VerifyFull => "verify-full",
        }
    }
}

impl fmt::Display for SslMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Where the CA file was named.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CaSource {
    /// `sslrootcert=` in `DATABASE_URL` (wins, as a connection parameter wins over libpq's
    /// `PGSSLROOTCERT`).
    Sslrootcert,
    /// `ORCA_RELAY_DATABASE_CA_FILE`.
    CaFileVariable,
}

impl CaSource {
    pub fn as_str(self) -> &'static str {
        match self {
            CaSource::Sslrootcert => "sslrootcert",
            CaSource::CaFileVariable => CA_FILE_VARIABLE,
        }
    }
}

/// The CA bundle (PEM) that server certificates are checked against.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CaFile {
    pub path: PathBuf,
    pub source: CaSource,
}

/// The effective TLS setting of the PostgreSQL connections.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DatabaseTls {
    pub mode: SslMode,
    /// Always present for `verify-ca` and `verify-full`; optional otherwise.
    pub ca: Option<CaFile>,
}

impl DatabaseTls {
    /// True when a TLS connection is attempted at all.
    pub fn uses_tls(&self) -> bool {
        self.mode != SslMode::Disable
    }

    /// True when the server's certificate chain must lead to the CA: `verify-ca`,
    /// `verify-full`, and (as libpq does once a root certificate is given) `require` or
    /// `prefer` with a CA.
    pub fn verifies_chain(&self) -> bool {
        match self.mode {
            SslMode::Disable => false,
            SslMode::Prefer | SslMode::Require => self.ca.is_some(),
            SslMode::VerifyCa | SslMode::VerifyFull => true,
        }
    }

    /// True when the certificate must name the host the URL names: `verify-full` only.
    pub fn verifies_host_name(&self) -> bool {
        self.mode == SslMode::VerifyFull
    }

    /// One line for `check-config` and the start-up log: the mode, what is checked, and the CA
    /// with where it was named.
    pub fn summary(&self) -> String {
        let checks = match (
            self.uses_tls(),
            self.verifies_chain(),
            self.verifies_host_name(),
        ) {
            (false, _, _) => "none",
            (true, false, _) => "encryption_only",
            (true, true, false) => "chain",
            (true, true, true) => "chain_and_host_name",
        };
        let fallback = if self.mode == SslMode::Prefer {
            " plain_if_server_refuses_tls=true"
        } else {
            ""
        };
        match &self.ca {
            Some(ca) => format!(
                "sslmode={} verify={checks}{fallback} ca={} ca_source={}",
                self.mode,
                ca.path.display(),
                ca.source.as_str()
            ),
            None => format!("sslmode={} verify={checks}{fallback} ca=none", self.mode),
        }
    }
}

/// Why a `DATABASE_URL` (or the CA variable) was refused: `variable`, the offending `value`
/// (one parameter, never the whole URL) and what is accepted. `config.rs` turns it into its
/// one-line `ConfigError`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsSettingError {
    pub variable: &'static str,
    pub value: String,
    pub expected: String,
}

fn refuse(variable: &'static str, value: String, expected: impl Into<String>) -> TlsSettingError {
    TlsSettingError {
        variable,
        value,
        expected: expected.into(),
    }
}

/// Parameters libpq knows for client certificates and revocation lists, which the relay does
/// not support: refused by name rather than passed to the driver.
const UNSUPPORTED: &[&str] = &["sslcert", "sslkey", "sslpassword", "sslcrl", "sslcrldir"];

/// Splits `url` into the URL for the driver (without `sslmode` and `sslrootcert`) and the TLS
/// setting. `ca_file_variable` is `ORCA_RELAY_DATABASE_CA_FILE` (already trimmed, `None` when
/// unset); `sslrootcert` in the URL wins over it.
pub fn parse(
    url: &str,
    ca_file_variable: Option<&str>,
) -> Result<(String, DatabaseTls), TlsSettingError> {
    let (base, query) = match url.split_once('?') {
        Some((base, query)) => (base, query),
        None => (url, ""),
    };
    let mut mode = None;
    let mut sslrootcert = None;
    let mut kept = Vec::new();
    for pair in query.split('&').filter(|pair| !pair.is_empty()) {
        let (raw_key, raw_value) = pair.split_once('=').unwrap_or((pair, ""));
        let key = percent_decode(raw_key);
        match key.as_deref() {
            Some("sslmode") => {
                let value = percent_decode(raw_value)
                    .and_then(|value| SslMode::parse(&value).map(|mode| (value, mode)));
                match value {
                    Some((_, parsed)) => mode = Some(parsed),
                    None => {
                        return Err(refuse(
                            "DATABASE_URL",
                            format!("sslmode={raw_value}"),
                            format!("sslmode to be {}", SslMode::ACCEPTED),
                        ))
                    }
                }
            }
            Some("sslrootcert") => match percent_decode(raw_value) {
                Some(path) if path == "system" => {
                    return Err(refuse(
                        "DATABASE_URL",
                        "sslrootcert=system".into(),
                        "sslrootcert to be the path of a PEM CA file (the system store is not \
                         supported; name the database's CA)",
                    ))
                }
                Some(path) => sslrootcert = Some(path).filter(|p| !p.trim().is_empty()),
                None => {
                    return Err(refuse(
                        "DATABASE_URL",
                        format!("sslrootcert={raw_value}"),
                        "sslrootcert to be a percent-encoded file path",
                    ))
                }
            },
            Some(unsupported) if UNSUPPORTED.contains(&unsupported) => {
                return Err(refuse(
                    "DATABASE_URL",
                    format!("{unsupported}=…"),
                    "no client certificate parameters (sslcert, sslkey, sslpassword, sslcrl, \
                     sslcrldir are not supported)",
                ))
            }
            _ => kept.push(pair),
        }
    }
    let mode = mode.unwrap_or(SslMode::Prefer);
    let ca = match (sslrootcert, ca_file_variable) {
        (Some(path), _) => Some(CaFile {
            path: PathBuf::from(path),
            source: CaSource::Sslrootcert,
        }),
        (None, Some(path)) => Some(CaFile {
            path: PathBuf::from(path),
            source: CaSource::CaFileVariable,
        }),
        (None, None) => None,
    };
    if matches!(mode, SslMode::VerifyCa | SslMode::VerifyFull) && ca.is_none() {
        return Err(refuse(
            "DATABASE_URL",
            format!("sslmode={mode}"),
            format!(
                "a CA file for sslmode={mode}: sslrootcert=/path/ca.pem in DATABASE_URL or \
                 {CA_FILE_VARIABLE}=/path/ca.pem"
            ),
        ));
    }
    let driver_url = if kept.is_empty() {
        base.to_string()
    } else {
        format!("{base}?{}", kept.join("&"))
    };
    Ok((driver_url, DatabaseTls { mode, ca }))
}

/// Decodes `%XX` escapes (and nothing else: `+` stays `+`, as in libpq's URI parser). `None`
/// for a broken escape or bytes that are not UTF-8.
fn percent_decode(raw: &str) -> Option<String> {
    let bytes = raw.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = bytes.get(i + 1..i + 3)?;
            let hex = std::str::from_utf8(hex).ok()?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ok(url: &str, ca_variable: Option<&str>) -> (String, DatabaseTls) {
        parse(url, ca_variable).unwrap_or_else(|e| panic!("{url}: {e:?}"))
    }

    #[test]
    fn default_is_prefer_without_a_ca_as_libpq() {
        let (driver, tls) = ok("postgres://u:p@db:5432/relay", None);
        assert_eq!(driver, "postgres://u:p@db:5432/relay");
        assert_eq!(tls.mode, SslMode::Prefer);
        assert!(tls.uses_tls());
        assert!(!tls.verifies_chain());
        assert!(!tls.verifies_host_name());
    }

    #[test]
    fn every_mode_parses_and_is_stripped_from_the_driver_url() {
        for (value, mode) in [
            ("disable", SslMode::Disable),
            ("prefer", SslMode::Prefer),
            ("require", SslMode::Require),
            ("verify-ca", SslMode::VerifyCa),
            ("verify-full", SslMode::VerifyFull),
        ] {
            let url = format!(
                "postgres://u:p@db/relay?application_name=x&sslmode={value}&sslrootcert=/etc/ca.pem&connect_timeout=3"
            );
            let (driver, tls) = ok(&url, None);
            assert_eq!(tls.mode, mode);
            assert_eq!(
                driver,
                "postgres://u:p@db/relay?application_name=x&connect_timeout=3"
            );
            assert_eq!(
                tls.ca,
                Some(CaFile {
                    path: PathBuf::from("/etc/ca.pem"),
                    source: CaSource::Sslrootcert
                })
            );
        }
    }

    #[test]
    fn what_is_verified_follows_libpq() {
        let tls = |mode, ca: bool| DatabaseTls {
            mode,
            ca: ca.then(|| CaFile {
                path: PathBuf::from("/ca.pem"),
                source: CaSource::CaFileVariable,
            }),
        };
        // (mode, CA given) -> (chain checked, host name checked)
        let table = [
            (SslMode::Disable, false, (false, false)),
            (SslMode::Disable, true, (false, false)),
            (SslMode::Prefer, false, (false, false)),
            (SslMode::Prefer, true, (true, false)),
            (SslMode::Require, false, (false, false)),
            // With a root certificate, libpq's require behaves like verify-ca.
            (SslMode::Require, true, (true, false)),
            (SslMode::VerifyCa, true, (true, false)),
            (SslMode::VerifyFull, true, (true, true)),
        ];
        for (mode, ca, expected) in table {
            let setting = tls(mode, ca);
            assert_eq!(
                (setting.verifies_chain(), setting.verifies_host_name()),
                expected,
                "{mode} with ca={ca}"
            );
        }
    }

    #[test]
    fn sslrootcert_wins_over_the_variable_and_the_variable_serves_alone() {
        let (_, tls) = ok(
            "postgres://db/relay?sslmode=verify-full&sslrootcert=%2Fetc%2Furl%20ca.pem",
            Some("/etc/env-ca.pem"),
        );
        let ca = tls.ca.expect("a CA");
        assert_eq!(ca.path, PathBuf::from("/etc/url ca.pem"));
        assert_eq!(ca.source, CaSource::Sslrootcert);
        let (driver, tls) = ok(
            "postgres://db/relay?sslmode=verify-ca",
            Some("/etc/env-ca.pem"),
        );
        assert_eq!(driver, "postgres://db/relay");
        let ca = tls.ca.expect("a CA");
        assert_eq!(ca.path, PathBuf::from("/etc/env-ca.pem"));
        assert_eq!(ca.source, CaSource::CaFileVariable);
    }

    #[test]
    fn bad_settings_name_the_parameter_and_never_the_password() {
        let cases: &[(&str, &str, &str)] = &[
            (
                "postgres://u:hunter2@db/relay?sslmode=verify",
                "sslmode=verify",
                "disable, prefer, require, verify-ca, verify-full",
            ),
            (
                "postgres://u:hunter2@db/relay?sslmode=",
                "sslmode=",
                "verify-full",
            ),
            (
                "postgres://u:hunter2@db/relay?sslmode=verify-full",
                "sslmode=verify-full",
                CA_FILE_VARIABLE,
            ),
            (
                "postgres://u:hunter2@db/relay?sslmode=verify-ca&sslrootcert=",
                "sslmode=verify-ca",
                "sslrootcert=",
            ),
            (
                "postgres://u:hunter2@db/relay?sslrootcert=system&sslmode=verify-full",
                "sslrootcert=system",
                "path of a PEM CA file",
            ),
            (
                "postgres://u:hunter2@db/relay?sslrootcert=%zz",
                "sslrootcert=%zz",
                "percent-encoded",
            ),
            (
                "postgres://u:hunter2@db/relay?sslcert=/c.pem",
                "sslcert=…",
                "not supported",
            ),
        ];
        for (url, value, expected) in cases {
            let err = parse(url, None).unwrap_err();
            assert_eq!(err.variable, "DATABASE_URL", "{url}");
            assert_eq!(&err.value, value, "{url}");
            assert!(err.expected.contains(expected), "{url}: {}", err.expected);
            assert!(!format!("{err:?}").contains("hunter2"), "{url}");
        }
    }

    #[test]
    fn summary_says_mode_checks_and_ca_source() {
        let (_, tls) = ok(
            "postgres://db/relay?sslmode=verify-full&sslrootcert=/etc/ca.pem",
            None,
        );
        assert_eq!(
            tls.summary(),
            "sslmode=verify-full verify=chain_and_host_name ca=/etc/ca.pem ca_source=sslrootcert"
        );
        let (_, tls) = ok("postgres://db/relay", None);
        assert_eq!(
            tls.summary(),
            "sslmode=prefer verify=encryption_only plain_if_server_refuses_tls=true ca=none"
        );
        let (_, tls) = ok("postgres://db/relay?sslmode=require", Some("/ca.pem"));
        assert_eq!(
            tls.summary(),
            "sslmode=require verify=chain ca=/ca.pem ca_source=ORCA_RELAY_DATABASE_CA_FILE"
        );
        let (_, tls) = ok("postgres://db/relay?sslmode=disable", None);
        assert_eq!(tls.summary(), "sslmode=disable verify=none ca=none");
    }

    #[test]
    fn percent_decoding_is_strict() {
        assert_eq!(percent_decode("a%2Fb"), Some("a/b".into()));
        assert_eq!(percent_decode("a+b"), Some("a+b".into()));
        assert_eq!(percent_decode("%"), None);
        assert_eq!(percent_decode("%4"), None);
        assert_eq!(percent_decode("%ff"), None, "not UTF-8");
    }
}
