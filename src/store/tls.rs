//! TLS for the PostgreSQL connections (SPEC §11 "Security"): the rustls client configuration
//! for a [`DatabaseTls`] setting, the bounded read of its CA file, and the one-line cause of a
//! failed connection (`orca_relay_store_tls_failed cause=…`).
//!
//! Runs on the thread that opens a connection (the pool's caller). rustls is the 0.23 with the
//! ring provider that ureq already brings; `tokio-postgres-rustls` adapts it to the driver's
//! `MakeTlsConnect` (it also gives SCRAM's `tls-server-end-point` channel binding).
//!
//! What is checked follows libpq (`database_tls`): `verify-full` checks chain and host name
//! (rustls' own WebPKI verifier); `verify-ca`, and `require` or `prefer` given a CA, check the
//! chain only; `require` and `prefer` without a CA check nothing about the certificate (the
//! handshake signatures are still verified, so the session is at least bound to the key the
//! server showed). `prefer` falls back to plain text only when the server answers the TLS
//! request with "no"; that fallback is the driver's.
//!
//! Must never: read a CA file without a bound, or log a cause more than once while it lasts.

use std::fmt;
use std::sync::{Arc, Mutex};

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::WebPkiSupportedAlgorithms;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{CertificateError, DigitallySignedStruct, RootCertStore, SignatureScheme};
use tokio_postgres_rustls::MakeRustlsConnect;

use super::StoreError;
use crate::database_tls::{CaFile, DatabaseTls, SslMode};

/// The most a CA file may hold. Larger than the 64 KiB of the relay's other local files: a
/// cloud provider's all-region bundle runs to a few hundred KiB (Debian's whole
/// `ca-certificates.crt` is about 215 KiB).
pub const MAX_CA_FILE_BYTES: u64 = 1024 * 1024;

/// Why a connection failed at the TLS layer, as `cause=` says it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TlsCause {
    /// The server's chain does not lead to the configured CA.
    UnknownCa,
    /// The certificate does not name the host in `DATABASE_URL` (`verify-full`).
    HostnameMismatch,
    CertificateExpired,
    CertificateNotYetValid,
    /// Any other certificate problem (bad encoding, not for server use, revoked, …).
    BadCertificate,
    /// `require` or stricter, and the server answered the TLS request with "no".
    ServerWithoutTls,
    /// `disable`, and the server's `pg_hba.conf` admits this client only over TLS.
    ServerRequiresTls,
    /// The handshake failed otherwise (no common version or cipher, an alert from the server).
    HandshakeFailed,
}

impl TlsCause {
    pub fn as_str(self) -> &'static str {
        match self {
            TlsCause::UnknownCa => "unknown_ca",
            TlsCause::HostnameMismatch => "hostname_mismatch",
            TlsCause::CertificateExpired => "certificate_expired",
            TlsCause::CertificateNotYetValid => "certificate_not_yet_valid",
            TlsCause::BadCertificate => "bad_certificate",
            TlsCause::ServerWithoutTls => "server_without_tls",
            TlsCause::ServerRequiresTls => "server_requires_tls",
            TlsCause::HandshakeFailed => "handshake_failed",
        }
    }
}

impl fmt::Display for TlsCause {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The TLS side of the PostgreSQL connector: what to hand the driver, and how to name its
/// failures.
pub(super) struct DatabaseTlsConnector {
    mode: SslMode,
    /// `None` for `disable` (the driver then gets `NoTls`).
    pub(super) make: Option<MakeRustlsConnect>,
    /// `host=` of the failure line: the first host of the URL (never the password).
    host: String,
    /// The cause logged last; cleared by a successful connection, so a cause is logged once
    /// while it lasts and again if it comes back.
    last_logged: Mutex<Option<TlsCause>>,
}

impl DatabaseTlsConnector {
    /// Builds the rustls configuration for `tls`, reading its CA file (bounded). An unreadable
    /// or empty CA file is an error that names the file and where it was set.
    pub(super) fn new(tls: &DatabaseTls, host: String) -> Result<Self, StoreError> {
        let make = if tls.uses_tls() {
            Some(MakeRustlsConnect::new(client_config(tls)?))
        } else {
            None
        };
        Ok(DatabaseTlsConnector {
            mode: tls.mode,
            make,
            host,
            last_logged: Mutex::new(None),
        })
    }

    /// A connection succeeded: the next failure is news again.
    pub(super) fn connected(&self) {
        if let Ok(mut last) = self.last_logged.lock() {
            *last = None;
        }
    }

    /// If `error` is a TLS failure: logs `orca_relay_store_tls_failed` (once per cause while it
    /// lasts) and returns the store error carrying the same line.
    pub(super) fn failure(&self, error: &postgres::Error) -> Option<StoreError> {
        let (cause, detail) = classify(error, self.mode)?;
        let line = format!(
            "orca_relay_store_tls_failed cause={cause} sslmode={} host={} detail=\"{}\"",
            self.mode,
            self.host,
            detail.replace('"', "'")
        );
        if self.is_news(cause) {
            log::error!("{line}");
        }
        Some(StoreError::tls_failed(line))
    }

    /// True the first time `cause` is seen since the last success or another cause.
    fn is_news(&self, cause: TlsCause) -> bool {
        match self.last_logged.lock() {
            Ok(mut last) => last.replace(cause) != Some(cause),
            Err(_) => true,
        }
    }
}

/// The rustls client configuration for a TLS mode.
fn client_config(tls: &DatabaseTls) -> Result<rustls::ClientConfig, StoreError> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let algorithms = provider.signature_verification_algorithms;
    let roots = match &tls.ca {
        Some(ca) => Some(load_roots(ca).map_err(StoreError::Query)?),
        None => None,
    };
    let verifier: Arc<dyn ServerCertVerifier> = match (roots, tls.verifies_host_name()) {
        (Some(roots), true) => rustls::client::WebPkiServerVerifier::builder_with_provider(
            Arc::new(roots),
            provider.clone(),
        )
        .build()
        .map_err(|e| StoreError::Query(format!("database TLS setup failed: {e}")))?,
        (Some(roots), false) => Arc::new(ChainOnly { roots, algorithms }),
        (None, _) => Arc::new(NoCertificateCheck { algorithms }),
    };
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| StoreError::Query(format!("database TLS setup failed: {e}")))?
        .dangerous()
        .with_custom_certificate_verifier(verifier)
        .with_no_client_auth();
    Ok(config)
}

/// `check-config`'s view of the database TLS: the effective setting, and the CA file read
/// exactly as a start would read it. `Err` is one line naming the file and where it was set.
pub fn effective_setting(tls: &DatabaseTls) -> Result<String, String> {
    match &tls.ca {
        Some(ca) if tls.uses_tls() => {
            let roots = load_roots(ca)?;
            Ok(format!("{} ca_certificates={}", tls.summary(), roots.len()))
        }
        _ => Ok(tls.summary()),
    }
}

/// Reads the CA bundle: a regular file of at most [`MAX_CA_FILE_BYTES`] holding at least one
/// PEM certificate, every one of which must parse.
fn load_roots(ca: &CaFile) -> Result<RootCertStore, String> {
    let refuse = |what: String| {
        format!(
            "database CA file {} (from {}) {what}",
            ca.path.display(),
            ca.source.as_str()
        )
    };
    let pem = crate::local_file::read_bounded(&ca.path, MAX_CA_FILE_BYTES)
        .map_err(|e| refuse(format!("cannot be read: {e}")))?;
    let mut roots = RootCertStore::empty();
    for cert in CertificateDer::pem_slice_iter(&pem) {
        let cert = cert.map_err(|e| refuse(format!("is not valid PEM: {e}")))?;
        roots
            .add(cert)
            .map_err(|e| refuse(format!("holds a certificate rustls cannot use: {e}")))?;
    }
    if roots.is_empty() {
        return Err(refuse("holds no PEM certificate".into()));
    }
    Ok(roots)
}

/// Names the TLS failure in a driver error, if it is one.
fn classify(error: &postgres::Error, mode: SslMode) -> Option<(TlsCause, String)> {
    // A server whose pg_hba.conf admits this client only over TLS refuses a plain connection
    // with 28000 and "… no encryption" (PostgreSQL 12 and later).
    if let Some(db) = error.as_db_error() {
        let refused_plain = db.code()
            == &postgres::error::SqlState::INVALID_AUTHORIZATION_SPECIFICATION
            && db.message().ends_with("no encryption");
        if refused_plain && mode == SslMode::Disable {
            return Some((TlsCause::ServerRequiresTls, db.message().to_string()));
        }
        return None;
    }
    let mut source: Option<&(dyn std::error::Error + 'static)> = std::error::Error::source(error);
    while let Some(current) = source {
        if let Some(rustls_error) = as_rustls_error(current) {
            return Some((cause_of(rustls_error), rustls_error.to_string()));
        }
        // The driver's own words when the server answers the TLS request with "no" (the
        // message is not typed; a test against a real server keeps this in step).
        if current.to_string() == "server does not support TLS" {
            return Some((
                TlsCause::ServerWithoutTls,
                format!("the server does not offer TLS and sslmode={mode} requires it"),
            ));
        }
        source = current.source();
    }
    None
}

/// The rustls error inside `error`, directly or inside an `io::Error` (tokio-rustls wraps it
/// so; `io::Error::source` skips the wrapped error itself, hence `get_ref`).
fn as_rustls_error<'a>(error: &'a (dyn std::error::Error + 'static)) -> Option<&'a rustls::Error> {
    if let Some(rustls_error) = error.downcast_ref::<rustls::Error>() {
        return Some(rustls_error);
    }
    error
        .downcast_ref::<std::io::Error>()
        .and_then(|io| io.get_ref())
        .and_then(|inner| inner.downcast_ref::<rustls::Error>())
}

fn cause_of(error: &rustls::Error) -> TlsCause {
    match error {
        rustls::Error::InvalidCertificate(certificate) => match certificate {
            CertificateError::UnknownIssuer => TlsCause::UnknownCa,
            CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. } => {
                TlsCause::HostnameMismatch
            }
            CertificateError::Expired | CertificateError::ExpiredContext { .. } => {
                TlsCause::CertificateExpired
            }
            CertificateError::NotValidYet | CertificateError::NotValidYetContext { .. } => {
                TlsCause::CertificateNotYetValid
            }
            _ => TlsCause::BadCertificate,
        },
        _ => TlsCause::HandshakeFailed,
    }
}

/// `require`/`prefer` without a CA: any certificate (libpq's behaviour), but the handshake
/// signatures must verify against the key the server presented.
#[derive(Debug)]
struct NoCertificateCheck {
    algorithms: WebPkiSupportedAlgorithms,
}

/// `verify-ca` (and `require`/`prefer` with a CA): the chain must lead to the CA; the name is
/// not checked.
#[derive(Debug)]
struct ChainOnly {
    roots: RootCertStore,
    algorithms: WebPkiSupportedAlgorithms,
}

impl ServerCertVerifier for NoCertificateCheck {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(message, cert, dss, &self.algorithms)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(message, cert, dss, &self.algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.algorithms.supported_schemes()
    }
}

impl ServerCertVerifier for ChainOnly {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let cert = rustls::server::ParsedCertificate::try_from(end_entity)?;
        rustls::client::verify_server_cert_signed_by_trust_anchor(
            &cert,
            &self.roots,
            intermediates,
            now,
            self.algorithms.all,
        )?;
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(message, cert, dss, &self.algorithms)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(message, cert, dss, &self.algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.algorithms.supported_schemes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::database_tls::CaSource;
    use std::path::PathBuf;

    /// This process's directory for the CA files of its tests; the test removes it.
    fn unit_dir() -> PathBuf {
        std::env::temp_dir().join(format!("orca-relay-tls-unit-{}", std::process::id()))
    }

    fn temp_file(name: &str, body: &[u8]) -> PathBuf {
        let dir = unit_dir();
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join(name);
        std::fs::write(&path, body).unwrap();
        path
    }

    fn ca(path: PathBuf) -> CaFile {
        CaFile {
            path,
            source: CaSource::CaFileVariable,
        }
    }

    #[test]
    fn ca_files_are_read_with_a_bound_and_must_hold_a_certificate() {
        let empty = temp_file("empty.pem", b"");
        let error = load_roots(&ca(empty.clone())).unwrap_err();
        assert!(error.contains("holds no PEM certificate"), "{error}");
        assert!(error.contains(&empty.display().to_string()), "{error}");
        assert!(error.contains("ORCA_RELAY_DATABASE_CA_FILE"), "{error}");

        let big = temp_file("big.pem", &vec![b'x'; MAX_CA_FILE_BYTES as usize + 1]);
        let error = load_roots(&ca(big)).unwrap_err();
        assert!(error.contains("at most 1048576"), "{error}");

        let directory = std::env::temp_dir();
        let error = load_roots(&ca(directory)).unwrap_err();
        assert!(error.contains("not a regular file"), "{error}");

        let missing = std::env::temp_dir().join("orca-relay-no-such-ca.pem");
        let error = load_roots(&ca(missing)).unwrap_err();
        assert!(error.contains("no such file"), "{error}");

        let garbage = temp_file(
            "garbage.pem",
            b"-----BEGIN CERTIFICATE-----\nnot base64!\n-----END CERTIFICATE-----\n",
        );
        assert!(load_roots(&ca(garbage)).is_err());
        let _ = std::fs::remove_dir_all(unit_dir());
    }

    #[test]
    fn a_cause_is_news_once_while_it_lasts() {
        let tls = DatabaseTls {
            mode: SslMode::Disable,
            ca: None,
        };
        let connector = DatabaseTlsConnector::new(&tls, "db".into()).unwrap();
        assert!(connector.make.is_none(), "disable hands the driver NoTls");
        assert!(connector.is_news(TlsCause::UnknownCa));
        assert!(!connector.is_news(TlsCause::UnknownCa));
        assert!(
            connector.is_news(TlsCause::HostnameMismatch),
            "another cause"
        );
        assert!(connector.is_news(TlsCause::UnknownCa), "and back");
        connector.connected();
        assert!(connector.is_news(TlsCause::UnknownCa), "after a success");
    }

    #[test]
    fn rustls_errors_map_to_causes() {
        let cases = [
            (CertificateError::UnknownIssuer, TlsCause::UnknownCa),
            (
                CertificateError::NotValidForName,
                TlsCause::HostnameMismatch,
            ),
            (CertificateError::Expired, TlsCause::CertificateExpired),
            (
                CertificateError::NotValidYet,
                TlsCause::CertificateNotYetValid,
            ),
            (CertificateError::BadEncoding, TlsCause::BadCertificate),
        ];
        for (certificate, cause) in cases {
            let error = rustls::Error::InvalidCertificate(certificate);
            assert_eq!(cause_of(&error), cause);
            // As tokio-rustls hands it to the driver: inside an io::Error.
            let io = std::io::Error::new(std::io::ErrorKind::InvalidData, error);
            let io: &(dyn std::error::Error + 'static) = &io;
            assert!(as_rustls_error(io).is_some());
        }
        assert_eq!(
            cause_of(&rustls::Error::AlertReceived(
                rustls::AlertDescription::HandshakeFailure
            )),
            TlsCause::HandshakeFailed
        );
    }
}
