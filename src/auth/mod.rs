//! Token checks for desktop control (SPEC 5.2): the [`Verifier`] that turns a bearer token into
//! [`HostClaims`], backed either by the auth service's JWKS (ES256/RS256) or by the combined
//! role's self-hosted HS256 key; plus the self-hosted key file and the token minter that
//! `orca-relay client host` and the tests use.
//!
//! Runs on the relay threads (upgrade of `/v1/host/control`), the HTTP workers, and the
//! readiness prober ([`Verifier::probe`]). A `Verifier` is a cheap clone of one `Arc`.
//!
//! Must never let a token's header choose the algorithm (the key's type does), never hold a lock
//! across the JWKS fetch (see `jwks.rs`), never read the wall clock (expiry is checked against the
//! injected [`Clock`]), and never log a token or a secret.

mod jwks;
mod jwt;

use std::fmt;
use std::fs;
use std::io::{self, Write};
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine;
use jsonwebtoken::{Algorithm, DecodingKey, EncodingKey, Header};

use crate::clock::{Clock, SharedClock};
use crate::local_file::{self, LocalFileError, MAX_LOCAL_FILE_BYTES};

pub use jwks::{
    JWKS_BAD_BODY, JWKS_HTTP_FAILED, JWKS_TIMED_OUT, JWKS_TIMEOUT, JWKS_UNREACHABLE,
    UNKNOWN_KID_REFETCH_INTERVAL_MS,
};
pub use jwt::{
    is_valid_relay_host_id, EXP_LEEWAY_MS, HOST_CONTROL_PURPOSE, MAX_TOKEN_BYTES, RELAY_HOST_ID_LEN,
};

/// File name of the generated self-hosted key under `$ORCA_RELAY_DATA_DIR`.
pub const SELF_HOSTED_KEY_FILE: &str = "self-hosted.key";

/// Random bytes in a generated self-hosted key (64 base64url characters, inside 32–256).
pub const SELF_HOSTED_KEY_BYTES: usize = 48;

/// Accepted length of a self-hosted secret, in characters (SPEC 4).
pub const SELF_HOSTED_KEY_MIN_CHARS: usize = 32;
pub const SELF_HOSTED_KEY_MAX_CHARS: usize = 256;

/// What a verified desktop-control token says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostClaims {
    /// The `sub` claim.
    pub user_id: String,
    /// The `relayHostId` claim: 16 characters of `[A-Za-z0-9_-]`.
    pub relay_host_id: String,
    /// The `exp` claim in milliseconds since the Unix epoch (`exp × 1000`), the unit of
    /// [`Clock::now_ms`]. Verification allows [`EXP_LEEWAY_MS`] past it.
    pub expires_at: u64,
}

/// Why a token was refused. Callers branch on it (every variant closes with 4401 or answers
/// 401) and log [`AuthError::reason_code`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AuthError {
    /// No `Authorization` header.
    Missing,
    /// Not a bearer token, not a JWS, undecodable header or claims, missing `exp` or `sub`.
    Malformed,
    /// The signature does not verify with the key.
    BadSignature,
    /// `exp` is in the past (beyond [`EXP_LEEWAY_MS`]).
    Expired,
    WrongAudience,
    WrongIssuer,
    /// `purpose` is not `host-control`.
    WrongPurpose,
    /// `relayHostId` is missing or not 16 characters of `[A-Za-z0-9_-]`.
    BadHostId,
    /// The JWKS (fetched just now, or recently) has no key with the token's `kid`.
    UnknownKey,
    /// The header's `alg` is not the algorithm pinned for the key (`none`, HS256 against a
    /// JWKS, RS256 against an EC key, …).
    AlgorithmNotAllowed,
    /// No key could be looked up: the JWKS has never been fetched or the fetch just failed.
    KeysUnavailable,
}

impl AuthError {
    /// A short stable code for logs and metrics.
    pub fn reason_code(self) -> &'static str {
        match self {
            AuthError::Missing => "token_missing",
            AuthError::Malformed => "token_malformed",
            AuthError::BadSignature => "token_bad_signature",
            AuthError::Expired => "token_expired",
            AuthError::WrongAudience => "token_wrong_audience",
            AuthError::WrongIssuer => "token_wrong_issuer",
            AuthError::WrongPurpose => "token_wrong_purpose",
            AuthError::BadHostId => "token_bad_host_id",
            AuthError::UnknownKey => "token_unknown_key",
            AuthError::AlgorithmNotAllowed => "token_algorithm_not_allowed",
            AuthError::KeysUnavailable => "token_keys_unavailable",
        }
    }
}

impl fmt::Display for AuthError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            AuthError::Missing => "missing bearer token",
            AuthError::Malformed => "malformed token",
            AuthError::BadSignature => "bad token signature",
            AuthError::Expired => "token expired",
            AuthError::WrongAudience => "wrong token audience",
            AuthError::WrongIssuer => "wrong token issuer",
            AuthError::WrongPurpose => "wrong token purpose",
            AuthError::BadHostId => "bad relay host id in token",
            AuthError::UnknownKey => "unknown token signing key",
            AuthError::AlgorithmNotAllowed => "token algorithm not allowed",
            AuthError::KeysUnavailable => "token signing keys unavailable",
        })
    }
}

impl std::error::Error for AuthError {}

/// Verifies desktop-control tokens. Clone it freely: clones share one key cache.
#[derive(Clone)]
pub struct Verifier {
    inner: Arc<VerifierInner>,
}

struct VerifierInner {
    issuer: Option<String>,
    audience: String,
    clock: SharedClock,
    keys: KeySource,
}

enum KeySource {
    Jwks(jwks::JwksSource),
    /// `None` when the secret was empty: every token is then refused with `KeysUnavailable`.
    SelfHosted(Option<DecodingKey>),
}

/// The only algorithms a JWKS-backed verifier considers; anything else is refused before a key
/// is looked up, so `alg: none` or HS256 tokens never trigger a JWKS fetch.
const JWKS_ALGORITHMS: [Algorithm; 2] = [Algorithm::ES256, Algorithm::RS256];

impl Verifier {
    /// A verifier backed by the auth service's JWKS. Does not fetch: the first token or the first
    /// [`Verifier::probe`] does, so a process whose JWKS is down still starts.
    pub fn from_jwks(
        url: String,
        issuer: String,
        audience: String,
        clock: SharedClock,
    ) -> Verifier {
        let source = jwks::JwksSource::new(url, Arc::clone(&clock));
        Verifier {
            inner: Arc::new(VerifierInner {
                issuer: Some(issuer),
                audience,
                clock,
                keys: KeySource::Jwks(source),
            }),
        }
    }

    /// A verifier for HS256 tokens signed with the combined role's self-hosted secret. With no
    /// `issuer`, `iss` is not checked.
    pub fn from_self_hosted_key(
        secret: &str,
        issuer: Option<String>,
        audience: String,
        clock: SharedClock,
    ) -> Verifier {
        let key = DecodingKey::from_secret(secret.as_bytes()).ok();
        if key.is_none() {
            log::error!("orca_relay_self_hosted_key_unusable reason=empty_secret");
        }
        Verifier {
            inner: Arc::new(VerifierInner {
                issuer,
                audience,
                clock,
                keys: KeySource::SelfHosted(key),
            }),
        }
    }

    /// Whether this verifier uses a JWKS (and so whether readiness probes it).
    pub fn uses_jwks(&self) -> bool {
        matches!(self.inner.keys, KeySource::Jwks(_))
    }

    /// Verifies a desktop-control token (the part after `Bearer `). With a JWKS, an unknown
    /// `kid` may fetch the key set (rate limited, [`JWKS_TIMEOUT`]).
    pub fn verify_host_token(&self, bearer_token: &str) -> Result<HostClaims, AuthError> {
        self.verify_inner(bearer_token, true)
            .unwrap_or(Err(AuthError::KeysUnavailable))
    }

    /// As [`Verifier::verify_host_token`] without ever waiting on the network: `None` when the
    /// answer needs a JWKS fetch (call [`Verifier::verify_host_token`] where waiting is fine).
    pub fn verify_host_token_cached(
        &self,
        bearer_token: &str,
    ) -> Option<Result<HostClaims, AuthError>> {
        self.verify_inner(bearer_token, false)
    }

    /// `None` only when `may_fetch` is false and the key needs a fetch.
    fn verify_inner(
        &self,
        bearer_token: &str,
        may_fetch: bool,
    ) -> Option<Result<HostClaims, AuthError>> {
        let inner = &*self.inner;
        let parts = match jwt::split_token(bearer_token) {
            Ok(parts) => parts,
            Err(e) => return Some(Err(e)),
        };
        let (algorithm, key): (Algorithm, KeyRef<'_>) = match &inner.keys {
            KeySource::SelfHosted(key) => {
                if parts.alg != jwt::algorithm_name(Algorithm::HS256) {
                    return Some(Err(AuthError::AlgorithmNotAllowed));
                }
                let Some(key) = key.as_ref() else {
                    return Some(Err(AuthError::KeysUnavailable));
                };
                (Algorithm::HS256, KeyRef::Borrowed(key))
            }
            KeySource::Jwks(source) => {
                if !JWKS_ALGORITHMS
                    .iter()
                    .any(|alg| jwt::algorithm_name(*alg) == parts.alg)
                {
                    return Some(Err(AuthError::AlgorithmNotAllowed));
                }
                let kid = parts.kid.as_deref();
                let pinned = if may_fetch {
                    source.key_for(kid)
                } else {
                    source.cached_key_for(kid)?
                };
                let pinned = match pinned {
                    Ok(pinned) => pinned,
                    Err(e) => return Some(Err(e)),
                };
                // The key decides the algorithm; the header only has to agree with it.
                if jwt::algorithm_name(pinned.algorithm) != parts.alg {
                    return Some(Err(AuthError::AlgorithmNotAllowed));
                }
                (pinned.algorithm, KeyRef::Pinned(pinned))
            }
        };
        if let Err(e) = jwt::check_signature(&parts, key.get(), algorithm) {
            return Some(Err(e));
        }
        let rules = jwt::ClaimRules {
            issuer: inner.issuer.as_deref(),
            audience: &inner.audience,
        };
        Some(jwt::check_claims(
            parts.payload_b64,
            rules,
            inner.clock.now_ms(),
        ))
    }

    /// The readiness probe: GET the JWKS ([`JWKS_TIMEOUT`]); a 2xx with at least one usable key
    /// refreshes the cache and is `Ok`. Errors are the codes `jwks_http_failed`,
    /// `jwks_timed_out`, `jwks_unreachable`, `jwks_bad_body`; the cached keys stay on failure.
    /// Always `Ok` for the self-hosted verifier.
    pub fn probe(&self) -> Result<(), &'static str> {
        match &self.inner.keys {
            KeySource::SelfHosted(_) => Ok(()),
            KeySource::Jwks(source) => source.refresh(jwks::FetchTrigger::Probe).map(|_| ()),
        }
    }
}

impl fmt::Debug for Verifier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let inner = &*self.inner;
        let mut debug = f.debug_struct("Verifier");
        match &inner.keys {
            KeySource::Jwks(source) => debug.field("jwks_url", &source.url()),
            // Never print the secret.
            KeySource::SelfHosted(_) => debug.field("self_hosted_key", &"<redacted>"),
        };
        debug
            .field("issuer", &inner.issuer)
            .field("audience", &inner.audience)
            .finish()
    }
}

enum KeyRef<'a> {
    Borrowed(&'a DecodingKey),
    Pinned(Arc<jwks::PinnedKey>),
}

impl KeyRef<'_> {
    fn get(&self) -> &DecodingKey {
        match self {
            KeyRef::Borrowed(key) => key,
            KeyRef::Pinned(pinned) => &pinned.key,
        }
    }
}

/// Extracts the token from an `Authorization` header value: `Bearer <token>` (scheme
/// case-insensitive, RFC 7235). No header → `Missing`; anything else → `Malformed`.
pub fn parse_bearer(authorization_header: Option<&str>) -> Result<&str, AuthError> {
    let header = authorization_header.ok_or(AuthError::Missing)?.trim();
    let (scheme, token) = header.split_once(' ').ok_or(AuthError::Malformed)?;
    if !scheme.eq_ignore_ascii_case("bearer") {
        return Err(AuthError::Malformed);
    }
    let token = token.trim();
    if token.is_empty() || token.contains(char::is_whitespace) {
        return Err(AuthError::Malformed);
    }
    Ok(token)
}

/// Reads a self-hosted key file: a regular file of at most 64 KiB (never a FIFO or a device),
/// trimmed. The length rule (32–256 characters) is the caller's.
pub fn read_self_hosted_key(path: &Path) -> Result<String, LocalFileError> {
    local_file::read_bounded_to_string(path, MAX_LOCAL_FILE_BYTES)
        .map(|text| text.trim().to_string())
}

/// Reads `$DATA_DIR/self-hosted.key`, or creates it (48 random bytes, base64url, mode 0600,
/// creating the directory if missing). Returns the secret, the file's path, and whether it was
/// created just now. A file that exists but does not hold a 32–256 character secret is an
/// `InvalidData` error naming the path; it is never overwritten.
pub fn load_or_create_self_hosted_key(data_dir: &Path) -> io::Result<(String, PathBuf, bool)> {
    let path = data_dir.join(SELF_HOSTED_KEY_FILE);
    fs::create_dir_all(data_dir).map_err(|e| {
        io::Error::new(
            e.kind(),
            format!("create data directory {}: {e}", data_dir.display()),
        )
    })?;
    let secret = generate_self_hosted_key()?;
    if save_self_hosted_key(&path, &secret)? {
        return Ok((secret, path, true));
    }
    let existing = read_existing_self_hosted_key(&path)?;
    Ok((existing, path, false))
}

/// The self-hosted key of a live handover's next process, which writes nothing before the
/// commit: the file's when it exists (read as [`load_or_create_self_hosted_key`] reads it),
/// otherwise a new one held in memory only. Returns the secret, the file's path, and whether
/// the key is new (then [`save_self_hosted_key`] writes it once the handover has committed).
pub fn load_or_generate_self_hosted_key(data_dir: &Path) -> io::Result<(String, PathBuf, bool)> {
    let path = data_dir.join(SELF_HOSTED_KEY_FILE);
    match fs::symlink_metadata(&path) {
        Ok(_) => read_existing_self_hosted_key(&path).map(|existing| (existing, path, false)),
        Err(error) if error.kind() == io::ErrorKind::NotFound => {
            Ok((generate_self_hosted_key()?, path, true))
        }
        Err(error) => Err(io::Error::new(
            error.kind(),
            format!("read self-hosted key {}: {error}", path.display()),
        )),
    }
}

/// 48 random bytes, base64url.
fn generate_self_hosted_key() -> io::Result<String> {
    let mut random = [0u8; SELF_HOSTED_KEY_BYTES];
    getrandom::fill(&mut random)
        .map_err(|e| io::Error::other(format!("read OS randomness for self-hosted key: {e}")))?;
    Ok(URL_SAFE_NO_PAD.encode(random))
}

/// Writes `secret` as a new key file at `path` (mode 0600); `false` when a file is there
/// already (it is never overwritten).
pub fn save_self_hosted_key(path: &Path, secret: &str) -> io::Result<bool> {
    // create_new + mode 0600: the file is never visible with wider permissions, and two
    // processes starting at once cannot both write a key (the loser reads the winner's).
    let created = fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path);
    let with_path = |error: io::Error, action: &str| {
        io::Error::new(
            error.kind(),
            format!("{action} self-hosted key {}: {error}", path.display()),
        )
    };
    match created {
        Ok(mut file) => {
            file.write_all(format!("{secret}\n").as_bytes())
                .and_then(|()| file.sync_all())
                .map_err(|e| with_path(e, "write"))?;
            Ok(true)
        }
        Err(error) if error.kind() == io::ErrorKind::AlreadyExists => Ok(false),
        Err(error) => Err(with_path(error, "create")),
    }
}

/// An existing key file's secret: 32–256 characters, else an `InvalidData` error naming the
/// path; a file others may read is logged.
fn read_existing_self_hosted_key(path: &Path) -> io::Result<String> {
    let existing = read_self_hosted_key(path).map_err(|e| {
        io::Error::new(
            io::ErrorKind::InvalidData,
            format!("read self-hosted key {}: {e}", path.display()),
        )
    })?;
    let chars = existing.chars().count();
    if !(SELF_HOSTED_KEY_MIN_CHARS..=SELF_HOSTED_KEY_MAX_CHARS).contains(&chars) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!(
                "self-hosted key {} holds {chars} characters, expected {SELF_HOSTED_KEY_MIN_CHARS}-{SELF_HOSTED_KEY_MAX_CHARS}",
                path.display()
            ),
        ));
    }
    if let Ok(metadata) = fs::metadata(path) {
        let mode = metadata.permissions().mode() & 0o777;
        if mode & 0o077 != 0 {
            log::warn!(
                "orca_relay_self_hosted_key_permissive path={} mode={mode:o}",
                path.display()
            );
        }
    }
    Ok(existing)
}

#[derive(serde::Serialize)]
struct MintedClaims<'a> {
    sub: &'a str,
    #[serde(rename = "relayHostId")]
    relay_host_id: &'a str,
    purpose: &'a str,
    aud: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    iss: Option<&'a str>,
    iat: u64,
    exp: u64,
}

/// Mints an HS256 desktop-control token with the self-hosted secret, valid for `ttl_s` seconds
/// from `clock`'s now.
///
/// # Panics
///
/// If `secret` is empty. Secrets come from `ORCA_RELAY_SELF_HOSTED_KEY` (validated to 32–256
/// characters) or [`load_or_create_self_hosted_key`] (same check), so this is a programming error.
pub fn mint_host_token(
    secret: &str,
    issuer: Option<&str>,
    audience: &str,
    user_id: &str,
    relay_host_id: &str,
    ttl_s: u64,
    clock: &dyn Clock,
) -> String {
    let now_s = clock.now_ms() / 1000;
    let claims = MintedClaims {
        sub: user_id,
        relay_host_id,
        purpose: HOST_CONTROL_PURPOSE,
        aud: audience,
        iss: issuer,
        iat: now_s,
        exp: now_s.saturating_add(ttl_s),
    };
    let key = EncodingKey::from_secret(secret.as_bytes())
        .expect("mint_host_token needs a non-empty secret");
    // HS256 with an HMAC key and a struct of strings and integers cannot fail to encode.
    jsonwebtoken::encode(&Header::new(Algorithm::HS256), &claims, &key)
        .expect("HS256 encoding of plain claims")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::ManualClock;

    const SECRET: &str = "0123456789abcdef0123456789abcdef-self-hosted";
    const HOST_ID: &str = "host_0123456789A";
    const NOW_MS: u64 = 1_800_000_000_000;

    fn self_hosted(issuer: Option<&str>, clock: &Arc<ManualClock>) -> Verifier {
        Verifier::from_self_hosted_key(
            SECRET,
            issuer.map(str::to_string),
            "orca-relay".to_string(),
            clock.clone(),
        )
    }

    #[test]
    fn self_hosted_round_trip() {
        let clock = ManualClock::starting_at(NOW_MS);
        let token = mint_host_token(SECRET, None, "orca-relay", "u1", HOST_ID, 600, &*clock);
        let claims = self_hosted(None, &clock)
            .verify_host_token(&token)
            .expect("verifies");
        assert_eq!(
            claims,
            HostClaims {
                user_id: "u1".to_string(),
                relay_host_id: HOST_ID.to_string(),
                expires_at: NOW_MS + 600_000,
            }
        );
        assert!(!self_hosted(None, &clock).uses_jwks());
        assert_eq!(self_hosted(None, &clock).probe(), Ok(()));
    }

    #[test]
    fn self_hosted_refuses_wrong_secret_and_expired() {
        let clock = ManualClock::starting_at(NOW_MS);
        let verifier = self_hosted(None, &clock);
        let forged = mint_host_token(
            "another-secret-of-enough-length-0123456789",
            None,
            "orca-relay",
            "u1",
            HOST_ID,
            600,
            &*clock,
        );
        assert_eq!(
            verifier.verify_host_token(&forged),
            Err(AuthError::BadSignature)
        );

        let token = mint_host_token(SECRET, None, "orca-relay", "u1", HOST_ID, 600, &*clock);
        clock.advance(600_000 + EXP_LEEWAY_MS);
        assert_eq!(verifier.verify_host_token(&token), Err(AuthError::Expired));
    }

    #[test]
    fn self_hosted_checks_issuer_only_when_configured() {
        let clock = ManualClock::starting_at(NOW_MS);
        let no_iss = mint_host_token(SECRET, None, "orca-relay", "u1", HOST_ID, 600, &*clock);
        let other_iss = mint_host_token(
            SECRET,
            Some("other"),
            "orca-relay",
            "u1",
            HOST_ID,
            600,
            &*clock,
        );
        let right_iss = mint_host_token(
            SECRET,
            Some("relay"),
            "orca-relay",
            "u1",
            HOST_ID,
            600,
            &*clock,
        );

        let unchecked = self_hosted(None, &clock);
        assert!(unchecked.verify_host_token(&no_iss).is_ok());
        assert!(unchecked.verify_host_token(&other_iss).is_ok());

        let checked = self_hosted(Some("relay"), &clock);
        assert!(checked.verify_host_token(&right_iss).is_ok());
        assert_eq!(
            checked.verify_host_token(&other_iss),
            Err(AuthError::WrongIssuer)
        );
        assert_eq!(
            checked.verify_host_token(&no_iss),
            Err(AuthError::WrongIssuer)
        );
    }

    #[test]
    fn self_hosted_refuses_other_algorithms_and_audiences() {
        let clock = ManualClock::starting_at(NOW_MS);
        let verifier = self_hosted(None, &clock);
        let token = mint_host_token(SECRET, None, "orca-relay", "u1", HOST_ID, 600, &*clock);
        let (_, rest) = token.split_once('.').expect("jws");
        for alg in ["none", "HS384", "ES256", "RS256", "hs256"] {
            let header = URL_SAFE_NO_PAD.encode(format!(r#"{{"alg":"{alg}","typ":"JWT"}}"#));
            assert_eq!(
                verifier.verify_host_token(&format!("{header}.{rest}")),
                Err(AuthError::AlgorithmNotAllowed),
                "{alg}"
            );
        }
        let other_aud = mint_host_token(SECRET, None, "someone", "u1", HOST_ID, 600, &*clock);
        assert_eq!(
            verifier.verify_host_token(&other_aud),
            Err(AuthError::WrongAudience)
        );
    }

    #[test]
    fn empty_self_hosted_secret_refuses_everything() {
        let clock = ManualClock::starting_at(NOW_MS);
        let verifier =
            Verifier::from_self_hosted_key("", None, "orca-relay".to_string(), clock.clone());
        let token = mint_host_token(SECRET, None, "orca-relay", "u1", HOST_ID, 600, &*clock);
        assert_eq!(
            verifier.verify_host_token(&token),
            Err(AuthError::KeysUnavailable)
        );
    }

    #[test]
    fn parse_bearer_cases() {
        assert_eq!(parse_bearer(None), Err(AuthError::Missing));
        assert_eq!(parse_bearer(Some("Bearer abc.def.ghi")), Ok("abc.def.ghi"));
        assert_eq!(parse_bearer(Some("bearer   abc ")), Ok("abc"));
        assert_eq!(parse_bearer(Some("BEARER abc")), Ok("abc"));
        for bad in ["", "Bearer", "Bearer ", "Basic abc", "abc", "Bearer a b"] {
            assert_eq!(
                parse_bearer(Some(bad)),
                Err(AuthError::Malformed),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn error_codes_and_phrases_are_distinct() {
        let all = [
            AuthError::Missing,
            AuthError::Malformed,
            AuthError::BadSignature,
            AuthError::Expired,
            AuthError::WrongAudience,
            AuthError::WrongIssuer,
            AuthError::WrongPurpose,
            AuthError::BadHostId,
            AuthError::UnknownKey,
            AuthError::AlgorithmNotAllowed,
            AuthError::KeysUnavailable,
        ];
        let codes: std::collections::HashSet<_> = all.iter().map(|e| e.reason_code()).collect();
        let phrases: std::collections::HashSet<_> = all.iter().map(|e| e.to_string()).collect();
        assert_eq!(codes.len(), all.len());
        assert_eq!(phrases.len(), all.len());
        for phrase in phrases {
            assert_eq!(phrase, phrase.to_lowercase());
            assert!(!phrase.ends_with('.'));
        }
    }

    #[test]
    fn debug_never_prints_the_secret() {
        let clock = ManualClock::starting_at(NOW_MS);
        let printed = format!("{:?}", self_hosted(None, &clock));
        assert!(!printed.contains(SECRET));
    }

    fn temp_dir(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!(
            "orca-relay-auth-{name}-{}-{}",
            std::process::id(),
            crate::clock::system().now_ms()
        ));
        let _ = fs::remove_dir_all(&dir);
        dir
    }

    #[test]
    fn self_hosted_key_is_created_0600_then_reused() {
        let dir = temp_dir("create").join("nested");
        let (secret, path, created) = load_or_create_self_hosted_key(&dir).expect("creates");
        assert!(created);
        assert_eq!(path, dir.join(SELF_HOSTED_KEY_FILE));
        assert_eq!(secret.len(), 64, "48 bytes base64url without padding");
        assert!(URL_SAFE_NO_PAD.decode(&secret).is_ok_and(|b| b.len() == 48));
        let mode = fs::metadata(&path).expect("metadata").permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);

        let (again, path_again, created_again) =
            load_or_create_self_hosted_key(&dir).expect("reads");
        assert!(!created_again);
        assert_eq!(again, secret);
        assert_eq!(path_again, path);
        let _ = fs::remove_dir_all(dir.parent().expect("parent"));
    }

    /// A live handover's next process writes nothing before the commit: with no key file it
    /// holds a new key in memory, written only by `save_self_hosted_key` (never over a file).
    #[test]
    fn a_next_process_generates_a_missing_key_without_writing_it() {
        let dir = temp_dir("generate");
        fs::create_dir_all(&dir).expect("dir");
        let (secret, path, generated) = load_or_generate_self_hosted_key(&dir).expect("generates");
        assert!(generated);
        assert!(!path.exists(), "nothing written before the commit");
        assert!(save_self_hosted_key(&path, &secret).expect("saves"));
        let mode = fs::metadata(&path).expect("metadata").permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        assert!(!save_self_hosted_key(&path, "another").expect("kept"));
        let (read, _, generated) = load_or_generate_self_hosted_key(&dir).expect("reads");
        assert!(!generated);
        assert_eq!(read, secret);
        let _ = fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_short_existing_key_file_is_an_error_naming_the_path() {
        let dir = temp_dir("short");
        fs::create_dir_all(&dir).expect("dir");
        fs::write(dir.join(SELF_HOSTED_KEY_FILE), "too-short\n").expect("write");
        let error = load_or_create_self_hosted_key(&dir).expect_err("refused");
        assert_eq!(error.kind(), io::ErrorKind::InvalidData);
        assert!(error.to_string().contains(SELF_HOSTED_KEY_FILE), "{error}");
        let _ = fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_key_path_that_is_no_small_regular_file_is_an_error_without_reading_it() {
        let dir = temp_dir("hostile");
        fs::create_dir_all(&dir).expect("dir");
        let path = dir.join(SELF_HOSTED_KEY_FILE);
        // Before: /dev/zero grew the process without end, a FIFO blocked the start for good.
        std::os::unix::fs::symlink("/dev/zero", &path).expect("symlink");
        let error = load_or_create_self_hosted_key(&dir).expect_err("refused");
        assert_eq!(error.kind(), io::ErrorKind::InvalidData);
        assert!(
            error
                .to_string()
                .ends_with("not a regular file but a character_device"),
            "{error}"
        );
        fs::remove_file(&path).expect("remove");
        let c_path = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).expect("path");
        // SAFETY: a valid NUL-terminated path; mkfifo only creates a node.
        assert_eq!(unsafe { libc::mkfifo(c_path.as_ptr(), 0o600) }, 0);
        let error = load_or_create_self_hosted_key(&dir).expect_err("refused");
        assert!(
            error.to_string().ends_with("not a regular file but a fifo"),
            "{error}"
        );
        fs::remove_file(&path).expect("remove");
        fs::write(&path, vec![b'k'; 65 * 1024]).expect("write");
        let error = load_or_create_self_hosted_key(&dir).expect_err("refused");
        assert!(error.to_string().contains("too large"), "{error}");
        let _ = fs::remove_dir_all(&dir);
    }
}
