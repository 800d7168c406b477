//! TEMPORARY stub of the auth API (replaced by the real auth branch).
#![allow(unused_variables)]
use crate::clock::{Clock, SharedClock};
use std::path::{Path, PathBuf};
#[derive(Debug, Clone)]
pub struct HostClaims {
    pub user_id: String,
    pub relay_host_id: String,
    pub expires_at: u64,
}
#[derive(Debug, Clone)]
pub enum AuthError {
    Missing,
    Malformed,
}
impl AuthError {
    pub fn reason_code(&self) -> &'static str {
        "bad_token"
    }
}
impl std::fmt::Display for AuthError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{self:?}")
    }
}
#[derive(Clone)]
pub struct Verifier;
impl Verifier {
    pub fn from_jwks(
        url: String,
        issuer: String,
        audience: String,
        clock: SharedClock,
    ) -> Verifier {
        Verifier
    }
    pub fn from_self_hosted_key(
        secret: &str,
        issuer: Option<String>,
        audience: String,
        clock: SharedClock,
    ) -> Verifier {
        Verifier
    }
    pub fn verify_host_token(&self, bearer_token: &str) -> Result<HostClaims, AuthError> {
        Err(AuthError::Malformed)
    }
    pub fn probe(&self) -> Result<(), &'static str> {
        Ok(())
    }
    pub fn uses_jwks(&self) -> bool {
        false
    }
}
pub fn parse_bearer(authorization_header: Option<&str>) -> Result<&str, AuthError> {
    authorization_header
        .and_then(|h| h.strip_prefix("Bearer "))
        .ok_or(AuthError::Missing)
}
pub fn load_or_create_self_hosted_key(data_dir: &Path) -> std::io::Result<(String, PathBuf, bool)> {
    Ok(("x".repeat(48), data_dir.join("self-hosted.key"), false))
}
pub fn mint_host_token(
    secret: &str,
    issuer: Option<&str>,
    audience: &str,
    user_id: &str,
    relay_host_id: &str,
    ttl_s: u64,
    clock: &dyn Clock,
) -> String {
    String::new()
}
