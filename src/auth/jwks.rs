//! The JWKS key cache: fetch the auth service's key set over HTTP, turn each usable key into a
//! key pinned to exactly one algorithm (EC P-256 → ES256, RSA → RS256), and keep the last good
//! set in process, found by `kid`.
//!
//! Runs on the readiness prober (the probe refreshes the cache) and, for a token whose `kid` is
//! unknown, on the thread verifying that token (a relay thread or an HTTP worker), which then
//! waits for at most one fetch ([`JWKS_TIMEOUT`]).
//!
//! Never holds the cache lock across the HTTP fetch, never drops a cached set because a fetch
//! failed (during a JWKS outage tokens signed by cached keys keep verifying), and never lets
//! unknown-`kid` tokens fetch more than once per [`UNKNOWN_KID_REFETCH_INTERVAL_MS`].

use std::collections::hash_map::Entry;
use std::collections::HashMap;
use std::io::Read;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine;
use jsonwebtoken::{Algorithm, DecodingKey};
use serde_json::Value;

use super::AuthError;
use crate::clock::SharedClock;

/// Deadline for one JWKS GET, connect and body included (SPEC 7: "GET, 2 s timeout").
pub const JWKS_TIMEOUT: Duration = Duration::from_secs(2);

/// Tokens with a `kid` we do not know (or a cold cache) trigger at most one fetch per 30 s,
/// measured with the injected clock, so a flood of made-up `kid`s cannot turn into a flood of
/// requests to the auth service. Rotated keys still arrive within one readiness probe period.
pub const UNKNOWN_KID_REFETCH_INTERVAL_MS: u64 = 30_000;

/// A JWKS larger than this is refused as a bad body. Real key sets are a few KiB.
pub const MAX_JWKS_BODY_BYTES: u64 = 1024 * 1024;

/// RSA keys with a modulus shorter than 2048 bits are skipped (NIST SP 800-57 minimum).
const MIN_RSA_MODULUS_BYTES: usize = 2048 / 8;

/// Failure codes of a JWKS fetch, reported by `Verifier::probe` to readiness (SPEC 7).
pub const JWKS_HTTP_FAILED: &str = "jwks_http_failed";
pub const JWKS_TIMED_OUT: &str = "jwks_timed_out";
pub const JWKS_UNREACHABLE: &str = "jwks_unreachable";
pub const JWKS_BAD_BODY: &str = "jwks_bad_body";

/// A public key and the one algorithm it may verify.
pub(crate) struct PinnedKey {
    pub algorithm: Algorithm,
    pub key: DecodingKey,
}

/// One fetched key set.
#[derive(Default)]
pub(crate) struct KeySet {
    by_kid: HashMap<String, Arc<PinnedKey>>,
    /// Set only when the JWKS held exactly one usable key and it had no `kid`: then a token
    /// without a `kid` may use it.
    only_key_without_kid: Option<Arc<PinnedKey>>,
}

impl KeySet {
    pub fn find(&self, kid: Option<&str>) -> Option<Arc<PinnedKey>> {
        match kid {
            Some(kid) => self.by_kid.get(kid).cloned(),
            None => self.only_key_without_kid.clone(),
        }
    }

    pub fn len(&self) -> usize {
        self.by_kid.len() + usize::from(self.only_key_without_kid.is_some())
    }

    fn sorted_kids(&self) -> Vec<&str> {
        let mut kids: Vec<&str> = self.by_kid.keys().map(String::as_str).collect();
        kids.sort_unstable();
        kids
    }
}

/// Parses a JWKS body. Keys we cannot or must not use (other curves, encryption keys, small
/// RSA moduli, a declared `alg` other than the one we pin) are skipped; a set with no usable key
/// at all is a bad body.
pub(crate) fn parse_jwks(body: &[u8]) -> Result<KeySet, &'static str> {
    let document: Value = serde_json::from_slice(body).map_err(|_| JWKS_BAD_BODY)?;
    let Some(keys) = document.get("keys").and_then(Value::as_array) else {
        return Err(JWKS_BAD_BODY);
    };
    let mut usable: Vec<(Option<String>, PinnedKey)> = Vec::new();
    for key in keys {
        match parse_key(key) {
            Ok(parsed) => usable.push(parsed),
            Err(reason) => log::debug!(
                "orca_relay_jwks_key_skipped kid={} reason={reason}",
                key.get("kid").and_then(Value::as_str).unwrap_or("-")
            ),
        }
    }
    let mut set = KeySet::default();
    if usable.len() == 1 && usable[0].0.is_none() {
        let (_, key) = usable.remove(0);
        set.only_key_without_kid = Some(Arc::new(key));
        return Ok(set);
    }
    for (kid, key) in usable {
        match kid {
            // A kid-less key among several cannot be told apart from the others.
            None => log::debug!("orca_relay_jwks_key_skipped kid=- reason=no_kid_among_several"),
            Some(kid) => match set.by_kid.entry(kid) {
                Entry::Occupied(taken) => log::debug!(
                    "orca_relay_jwks_key_skipped kid={} reason=duplicate_kid",
                    taken.key()
                ),
                Entry::Vacant(slot) => {
                    slot.insert(Arc::new(key));
                }
            },
        }
    }
    if set.len() == 0 {
        return Err(JWKS_BAD_BODY);
    }
    Ok(set)
}

fn parse_key(jwk: &Value) -> Result<(Option<String>, PinnedKey), &'static str> {
    let field = |name: &str| jwk.get(name).and_then(Value::as_str);
    let kid = match jwk.get("kid") {
        None | Some(Value::Null) => None,
        Some(Value::String(kid)) => Some(kid.clone()),
        Some(_) => return Err("kid_not_a_string"),
    };
    if matches!(field("use"), Some(usage) if usage != "sig") {
        return Err("not_a_signing_key");
    }
    let (algorithm, key) = match field("kty") {
        Some("EC") => {
            if field("crv") != Some("P-256") {
                return Err("unsupported_curve");
            }
            let (Some(x), Some(y)) = (field("x"), field("y")) else {
                return Err("missing_coordinates");
            };
            let coordinate_ok = |c: &str| URL_SAFE_NO_PAD.decode(c).is_ok_and(|b| b.len() == 32);
            if !coordinate_ok(x) || !coordinate_ok(y) {
                return Err("bad_coordinates");
            }
            let key = DecodingKey::from_ec_components(x, y).map_err(|_| "bad_coordinates")?;
            // Building a verifier parses the point, so a point not on the curve is refused here
            // rather than at every verification. The empty signature itself never verifies.
            if jsonwebtoken::crypto::verify("", b"", &key, Algorithm::ES256).is_err() {
                return Err("point_not_on_curve");
            }
            (Algorithm::ES256, key)
        }
        Some("RSA") => {
            let (Some(n), Some(e)) = (field("n"), field("e")) else {
                return Err("missing_modulus_or_exponent");
            };
            let modulus = URL_SAFE_NO_PAD.decode(n).map_err(|_| "bad_modulus")?;
            let significant = modulus.iter().skip_while(|b| **b == 0).count();
            if significant < MIN_RSA_MODULUS_BYTES {
                return Err("rsa_key_too_small");
            }
            let key = DecodingKey::from_rsa_components(n, e).map_err(|_| "bad_exponent")?;
            (Algorithm::RS256, key)
        }
        _ => return Err("unsupported_key_type"),
    };
    // A key that declares an algorithm is used for that algorithm only; if it is not the one we
    // pin for its type (PS256 on an RSA key, say) we do not use the key at all.
    if let Some(declared) = field("alg") {
        if declared != super::jwt::algorithm_name(algorithm) {
            return Err("declared_alg_not_pinned_alg");
        }
    }
    Ok((kid, PinnedKey { algorithm, key }))
}

/// GETs and parses the key set, classifying failures into the readiness reason codes.
pub(crate) fn fetch_key_set(agent: &ureq::Agent, url: &str) -> Result<KeySet, &'static str> {
    let response = match agent.get(url).call() {
        Ok(response) => response,
        Err(ureq::Error::Status(_, _)) => return Err(JWKS_HTTP_FAILED),
        Err(ureq::Error::Transport(transport)) => return Err(classify_transport(&transport)),
    };
    if !(200..300).contains(&response.status()) {
        return Err(JWKS_HTTP_FAILED);
    }
    let mut body = Vec::new();
    if let Err(error) = response
        .into_reader()
        .take(MAX_JWKS_BODY_BYTES + 1)
        .read_to_end(&mut body)
    {
        return Err(if crate::outbound::is_timeout_io(&error) {
            JWKS_TIMED_OUT
        } else {
            JWKS_HTTP_FAILED
        });
    }
    if body.len() as u64 > MAX_JWKS_BODY_BYTES {
        return Err(JWKS_BAD_BODY);
    }
    parse_jwks(&body)
}

fn classify_transport(transport: &ureq::Transport) -> &'static str {
    if crate::outbound::is_timeout(transport) {
        return JWKS_TIMED_OUT;
    }
    match transport.kind() {
        ureq::ErrorKind::InvalidUrl
        | ureq::ErrorKind::UnknownScheme
        | ureq::ErrorKind::Dns
        | ureq::ErrorKind::InsecureRequestHttpsOnly
        | ureq::ErrorKind::ConnectionFailed
        | ureq::ErrorKind::InvalidProxyUrl
        | ureq::ErrorKind::ProxyConnect
        | ureq::ErrorKind::ProxyUnauthorized => JWKS_UNREACHABLE,
        _ => JWKS_HTTP_FAILED,
    }
}

/// Whether a token-triggered fetch may run now. Pure, so the rate limit is tested directly.
pub(crate) fn refetch_allowed(last_token_fetch_ms: Option<u64>, now_ms: u64) -> bool {
    match last_token_fetch_ms {
        None => true,
        Some(last) => now_ms.saturating_sub(last) >= UNKNOWN_KID_REFETCH_INTERVAL_MS,
    }
}

/// The shared cache state. Locked only to read or swap it, never across a fetch.
#[derive(Default)]
struct CacheState {
    /// The last successfully fetched set; `None` until the first success.
    keys: Option<Arc<KeySet>>,
    /// When a token last triggered a fetch (unknown `kid` or cold cache). Probe fetches do not
    /// count: they run at the prober's own pace.
    last_token_fetch_ms: Option<u64>,
}

/// What started a fetch, for the log line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum FetchTrigger {
    Probe,
    UnknownKid,
    ColdCache,
}

impl FetchTrigger {
    fn as_str(self) -> &'static str {
        match self {
            FetchTrigger::Probe => "probe",
            FetchTrigger::UnknownKid => "unknown_kid",
            FetchTrigger::ColdCache => "cold_cache",
        }
    }
}

/// The JWKS URL, its HTTP agent and the cached keys.
pub(crate) struct JwksSource {
    url: String,
    agent: ureq::Agent,
    clock: SharedClock,
    state: Mutex<CacheState>,
}

impl JwksSource {
    /// Does not fetch: a process whose JWKS is down still starts.
    pub fn new(url: String, clock: SharedClock) -> JwksSource {
        let agent = ureq::AgentBuilder::new()
            .timeout(JWKS_TIMEOUT)
            // Fetches are seconds apart; a pooled connection would only go stale in between.
            .max_idle_connections(0)
            .build();
        JwksSource {
            url,
            agent,
            clock,
            state: Mutex::new(CacheState::default()),
        }
    }

    pub fn url(&self) -> &str {
        &self.url
    }

    fn lock(&self) -> MutexGuard<'_, CacheState> {
        // The state is two plain values swapped whole, so a panic elsewhere cannot leave it
        // half-written: recover from poisoning rather than failing every later token.
        self.state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// The key for a token's `kid` from the cache alone: `None` when [`JwksSource::key_for`]
    /// would fetch the set (the kid is unknown and a token-triggered fetch is allowed now), so a
    /// caller that must not wait on the network (the acceptor's pending loop) can hand the
    /// token to a thread that may.
    pub fn cached_key_for(&self, kid: Option<&str>) -> Option<Result<Arc<PinnedKey>, AuthError>> {
        let now_ms = self.clock.now_ms();
        let state = self.lock();
        if let Some(key) = state.keys.as_ref().and_then(|keys| keys.find(kid)) {
            return Some(Ok(key));
        }
        if refetch_allowed(state.last_token_fetch_ms, now_ms) {
            return None;
        }
        Some(Err(match state.keys {
            Some(_) => AuthError::UnknownKey,
            None => AuthError::KeysUnavailable,
        }))
    }

    /// The key for a token's `kid`, fetching the set again (rate limited) if it is unknown.
    pub fn key_for(&self, kid: Option<&str>) -> Result<Arc<PinnedKey>, AuthError> {
        let now_ms = self.clock.now_ms();
        let trigger = {
            let mut state = self.lock();
            if let Some(key) = state.keys.as_ref().and_then(|keys| keys.find(kid)) {
                return Ok(key);
            }
            if !refetch_allowed(state.last_token_fetch_ms, now_ms) {
                return Err(match state.keys {
                    Some(_) => AuthError::UnknownKey,
                    None => AuthError::KeysUnavailable,
                });
            }
            // Claim the slot before fetching, so concurrent unknown-kid tokens fetch once.
            state.last_token_fetch_ms = Some(now_ms);
            match state.keys {
                Some(_) => FetchTrigger::UnknownKid,
                None => FetchTrigger::ColdCache,
            }
        };
        match self.refresh(trigger) {
            Ok(keys) => keys.find(kid).ok_or(AuthError::UnknownKey),
            Err(_) => Err(AuthError::KeysUnavailable),
        }
    }

    /// Fetches the set and, on success, replaces the cached one. On failure the cached set stays.
    pub fn refresh(&self, trigger: FetchTrigger) -> Result<Arc<KeySet>, &'static str> {
        let fetched = fetch_key_set(&self.agent, &self.url);
        match fetched {
            Ok(keys) => {
                let keys = Arc::new(keys);
                let previous = self.lock().keys.replace(Arc::clone(&keys));
                let changed = previous.is_none_or(|previous| {
                    previous.sorted_kids() != keys.sorted_kids() || previous.len() != keys.len()
                });
                if changed {
                    log::info!(
                        "orca_relay_jwks_keys_loaded keys={} kids={} trigger={}",
                        keys.len(),
                        keys.sorted_kids().join(","),
                        trigger.as_str()
                    );
                }
                Ok(keys)
            }
            Err(reason) => {
                // Probe failures are reported by readiness (grace crossings); logging each one
                // here would repeat every probe period during an outage.
                if trigger == FetchTrigger::Probe {
                    log::debug!("orca_relay_jwks_fetch_failed failure={reason} trigger=probe");
                } else {
                    log::warn!(
                        "orca_relay_jwks_fetch_failed failure={reason} trigger={}",
                        trigger.as_str()
                    );
                }
                Err(reason)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    // A valid P-256 public point (the generator G).
    const GX: &str = "axfR8uEsQkf4vOblY6RA8ncDfYEt6zOg9KE5RdiYwpY";
    const GY: &str = "T-NC4v4af5uO5-tKfA-eFivOM1drMV7Oy7ZAaDe_UfU";

    fn rsa_n(bits: usize) -> String {
        let mut modulus = vec![0xC5u8; bits / 8];
        modulus[bits / 8 - 1] |= 1;
        URL_SAFE_NO_PAD.encode(modulus)
    }

    fn ec(kid: Option<&str>) -> Value {
        let mut key = json!({"kty": "EC", "crv": "P-256", "x": GX, "y": GY});
        if let Some(kid) = kid {
            key["kid"] = json!(kid);
        }
        key
    }

    fn parse(keys: Value) -> Result<KeySet, &'static str> {
        parse_jwks(json!({ "keys": keys }).to_string().as_bytes())
    }

    #[test]
    fn keys_are_pinned_by_type() {
        let set = parse(json!([
            ec(Some("ec1")),
            {"kty": "RSA", "kid": "rsa1", "n": rsa_n(2048), "e": "AQAB"},
        ]))
        .expect("parses");
        assert_eq!(set.len(), 2);
        let ec_key = set.find(Some("ec1")).expect("ec key");
        assert_eq!(ec_key.algorithm, Algorithm::ES256);
        let rsa_key = set.find(Some("rsa1")).expect("rsa key");
        assert_eq!(rsa_key.algorithm, Algorithm::RS256);
        assert!(set.find(None).is_none(), "no kid-less key to fall back on");
        assert!(set.find(Some("other")).is_none());
    }

    #[test]
    fn unusable_keys_are_skipped() {
        let set = parse(json!([
            ec(Some("good")),
            {"kty": "EC", "kid": "p384", "crv": "P-384", "x": GX, "y": GY},
            {"kty": "EC", "kid": "enc", "use": "enc", "crv": "P-256", "x": GX, "y": GY},
            {"kty": "EC", "kid": "off-curve", "crv": "P-256", "x": GX, "y": GX},
            {"kty": "EC", "kid": "ps", "alg": "ES384", "crv": "P-256", "x": GX, "y": GY},
            {"kty": "RSA", "kid": "small", "n": rsa_n(1024), "e": "AQAB"},
            {"kty": "RSA", "kid": "pss", "alg": "PS256", "n": rsa_n(2048), "e": "AQAB"},
            {"kty": "oct", "kid": "hmac", "k": "c2VjcmV0"},
            {"kty": "OKP", "kid": "ed", "crv": "Ed25519", "x": GX},
            ec(None),
        ]))
        .expect("one usable key is enough");
        assert_eq!(set.sorted_kids(), vec!["good"]);
        assert!(
            set.find(None).is_none(),
            "a kid-less key among several is not used"
        );
    }

    #[test]
    fn a_single_key_without_kid_matches_a_token_without_kid() {
        let set = parse(json!([ec(None)])).expect("parses");
        assert!(set.find(None).is_some());
        assert!(set.find(Some("any")).is_none());
    }

    #[test]
    fn bodies_without_usable_keys_are_bad() {
        for body in [
            "not json".to_string(),
            json!({"nokeys": []}).to_string(),
            json!({"keys": {}}).to_string(),
            json!({"keys": []}).to_string(),
            json!({"keys": [{"kty": "oct", "k": "c2VjcmV0"}]}).to_string(),
        ] {
            assert_eq!(
                parse_jwks(body.as_bytes()).map(|s| s.len()),
                Err(JWKS_BAD_BODY),
                "{body}"
            );
        }
    }

    #[test]
    fn refetch_is_rate_limited_to_one_per_interval() {
        assert!(refetch_allowed(None, 0));
        assert!(!refetch_allowed(Some(1_000), 1_000));
        assert!(!refetch_allowed(
            Some(1_000),
            1_000 + UNKNOWN_KID_REFETCH_INTERVAL_MS - 1
        ));
        assert!(refetch_allowed(
            Some(1_000),
            1_000 + UNKNOWN_KID_REFETCH_INTERVAL_MS
        ));
        // A clock that went backwards never unlocks a refetch early.
        assert!(!refetch_allowed(Some(5_000), 1_000));
    }
}
