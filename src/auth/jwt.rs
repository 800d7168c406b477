//! The pure half of token verification: split a compact JWS, read its header, check a signature
//! with a key and an algorithm chosen by the caller, and check the desktop-control claims against
//! an injected "now".
//!
//! Runs on whichever thread verifies a token (a relay thread at upgrade time, an HTTP worker).
//! It never does I/O, never reads the clock (the caller passes `now_ms`), and never lets the
//! header's `alg` choose an algorithm: the header's `alg` is only compared with the algorithm the
//! caller pinned from the key.

use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine;
use jsonwebtoken::{Algorithm, DecodingKey};
use serde_json::Value;

use super::{AuthError, HostClaims};

/// Tokens longer than this are refused before any decoding. A desktop token is a few hundred
/// bytes; 8 KiB leaves room for large RSA signatures and extra claims while bounding the work an
/// unauthenticated peer can cause.
pub const MAX_TOKEN_BYTES: usize = 8 * 1024;

/// Clock skew tolerated on `exp`: a token stays valid until `exp + 30 s`. Desktops and the auth
/// service do not share a clock; 30 s is small next to token lifetimes (minutes to hours).
pub const EXP_LEEWAY_MS: u64 = 30_000;

/// The only `purpose` claim a desktop-control token may carry (SPEC 5.2).
pub const HOST_CONTROL_PURPOSE: &str = "host-control";

/// `relayHostId` is exactly this many characters of `[A-Za-z0-9_-]` (SPEC 5.2).
pub const RELAY_HOST_ID_LEN: usize = 16;

/// The parts of a compact JWS, borrowed from the token, plus the two header fields we read.
#[derive(Debug)]
pub(crate) struct TokenParts<'a> {
    /// `base64(header) "." base64(payload)`: the bytes the signature covers.
    pub signing_input: &'a str,
    pub payload_b64: &'a str,
    pub signature_b64: &'a str,
    /// The header's `alg`, exactly as sent (never used to choose an algorithm).
    pub alg: String,
    pub kid: Option<String>,
}

/// What the claims must say.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ClaimRules<'a> {
    /// `Some`: `iss` must equal it. `None`: `iss` is not checked (self-hosted key, no issuer).
    pub issuer: Option<&'a str>,
    pub audience: &'a str,
}

/// The JOSE name of the algorithms this module verifies.
pub(crate) fn algorithm_name(algorithm: Algorithm) -> &'static str {
    match algorithm {
        Algorithm::HS256 => "HS256",
        Algorithm::ES256 => "ES256",
        Algorithm::RS256 => "RS256",
        // Never pinned by this crate; named anyway so a comparison can never match by accident.
        _ => "unsupported",
    }
}

/// Splits a compact JWS and reads `alg` and `kid` from its header.
pub(crate) fn split_token(token: &str) -> Result<TokenParts<'_>, AuthError> {
    if token.is_empty() || token.len() > MAX_TOKEN_BYTES {
        return Err(AuthError::Malformed);
    }
    let mut segments = token.split('.');
    let (Some(header_b64), Some(payload_b64), Some(signature_b64), None) = (
        segments.next(),
        segments.next(),
        segments.next(),
        segments.next(),
    ) else {
        return Err(AuthError::Malformed);
    };
    if header_b64.is_empty() || payload_b64.is_empty() {
        return Err(AuthError::Malformed);
    }
    let header = decode_json_object(header_b64)?;
    let alg = match header.get("alg") {
        Some(Value::String(alg)) => alg.clone(),
        _ => return Err(AuthError::Malformed),
    };
    let kid = match header.get("kid") {
        None | Some(Value::Null) => None,
        Some(Value::String(kid)) => Some(kid.clone()),
        Some(_) => return Err(AuthError::Malformed),
    };
    // RFC 7515 4.1.11: a recipient must refuse a token whose `crit` names an extension it does
    // not understand, and we understand none.
    if header.contains_key("crit") {
        return Err(AuthError::Malformed);
    }
    let signing_input = &token[..header_b64.len() + 1 + payload_b64.len()];
    Ok(TokenParts {
        signing_input,
        payload_b64,
        signature_b64,
        alg,
        kid,
    })
}

/// Checks the signature with `key` under `algorithm`, which the caller chose from the key.
pub(crate) fn check_signature(
    parts: &TokenParts<'_>,
    key: &DecodingKey,
    algorithm: Algorithm,
) -> Result<(), AuthError> {
    if parts.signature_b64.is_empty() {
        return Err(AuthError::BadSignature);
    }
    if URL_SAFE_NO_PAD.decode(parts.signature_b64).is_err() {
        return Err(AuthError::Malformed);
    }
    match jsonwebtoken::crypto::verify(
        parts.signature_b64,
        parts.signing_input.as_bytes(),
        key,
        algorithm,
    ) {
        Ok(true) => Ok(()),
        // Ok(false) is a wrong signature; Err is a signature of the wrong shape for the key (an
        // ECDSA signature that is not 64 bytes, say): both mean "not signed by this key".
        Ok(false) | Err(_) => Err(AuthError::BadSignature),
    }
}

/// Checks the desktop-control claims of an already signature-checked payload.
///
/// Order: expiry, issuer, audience, purpose, subject, host id; the first failure is returned.
pub(crate) fn check_claims(
    payload_b64: &str,
    rules: ClaimRules<'_>,
    now_ms: u64,
) -> Result<HostClaims, AuthError> {
    let claims = decode_json_object(payload_b64)?;

    let exp_s = match claims.get("exp") {
        Some(Value::Number(n)) => match (n.as_u64(), n.as_f64()) {
            (Some(exp), _) => exp,
            (None, Some(exp)) if exp.is_finite() && exp >= 0.0 => exp.floor() as u64,
            _ => return Err(AuthError::Malformed),
        },
        _ => return Err(AuthError::Malformed),
    };
    let expires_at_ms = exp_s.saturating_mul(1000);
    if now_ms >= expires_at_ms.saturating_add(EXP_LEEWAY_MS) {
        return Err(AuthError::Expired);
    }

    if let Some(issuer) = rules.issuer {
        match claims.get("iss") {
            Some(Value::String(iss)) if iss == issuer => {}
            _ => return Err(AuthError::WrongIssuer),
        }
    }

    let audience_ok = match claims.get("aud") {
        Some(Value::String(aud)) => aud == rules.audience,
        Some(Value::Array(auds)) => auds.iter().any(|aud| aud.as_str() == Some(rules.audience)),
        _ => false,
    };
    if !audience_ok {
        return Err(AuthError::WrongAudience);
    }

    match claims.get("purpose") {
        Some(Value::String(purpose)) if purpose == HOST_CONTROL_PURPOSE => {}
        _ => return Err(AuthError::WrongPurpose),
    }

    let user_id = match claims.get("sub") {
        Some(Value::String(sub)) if !sub.is_empty() => sub.clone(),
        _ => return Err(AuthError::Malformed),
    };

    let relay_host_id = match claims.get("relayHostId") {
        Some(Value::String(id)) if is_valid_relay_host_id(id) => id.clone(),
        _ => return Err(AuthError::BadHostId),
    };

    Ok(HostClaims {
        user_id,
        relay_host_id,
        expires_at: expires_at_ms,
    })
}

/// Exactly [`RELAY_HOST_ID_LEN`] characters of `[A-Za-z0-9_-]`.
pub fn is_valid_relay_host_id(id: &str) -> bool {
    id.len() == RELAY_HOST_ID_LEN
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

fn decode_json_object(segment_b64: &str) -> Result<serde_json::Map<String, Value>, AuthError> {
    let bytes = URL_SAFE_NO_PAD
        .decode(segment_b64)
        .map_err(|_| AuthError::Malformed)?;
    match serde_json::from_slice::<Value>(&bytes) {
        Ok(Value::Object(map)) => Ok(map),
        _ => Err(AuthError::Malformed),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const NOW_MS: u64 = 1_800_000_000_000;

    fn b64(value: &Value) -> String {
        URL_SAFE_NO_PAD.encode(value.to_string())
    }

    fn good_claims() -> Value {
        json!({
            "sub": "user-1",
            "relayHostId": "host_0123456789A",
            "purpose": "host-control",
            "aud": "orca-relay",
            "iss": "https://auth.example",
            "exp": NOW_MS / 1000 + 600,
        })
    }

    fn rules() -> ClaimRules<'static> {
        ClaimRules {
            issuer: Some("https://auth.example"),
            audience: "orca-relay",
        }
    }

    /// The good claims with `field` set to `value`, or removed when `value` is `None`.
    fn check_with(field: &str, value: Option<Value>) -> Result<HostClaims, AuthError> {
        let mut claims = good_claims();
        let object = claims.as_object_mut().expect("object");
        match value {
            Some(value) => object.insert(field.to_string(), value),
            None => object.remove(field),
        };
        check_claims(&b64(&claims), rules(), NOW_MS)
    }

    #[test]
    fn good_claims_pass_and_expiry_is_reported_in_ms() {
        let claims = check_with("unused", None).expect("valid");
        assert_eq!(claims.user_id, "user-1");
        assert_eq!(claims.relay_host_id, "host_0123456789A");
        assert_eq!(claims.expires_at, (NOW_MS / 1000 + 600) * 1000);
    }

    #[test]
    fn each_claim_maps_to_its_error() {
        use AuthError::*;
        let cases = [
            ("exp", Some(json!(NOW_MS / 1000 - 31)), Expired),
            ("exp", None, Malformed),
            ("exp", Some(json!("soon")), Malformed),
            ("iss", Some(json!("https://evil.example")), WrongIssuer),
            ("iss", None, WrongIssuer),
            ("aud", Some(json!("other")), WrongAudience),
            ("aud", Some(json!(["a", "b"])), WrongAudience),
            ("aud", None, WrongAudience),
            ("purpose", Some(json!("phone")), WrongPurpose),
            ("purpose", None, WrongPurpose),
            ("sub", Some(json!("")), Malformed),
            ("sub", None, Malformed),
            ("relayHostId", Some(json!("host_0123456789")), BadHostId),
            ("relayHostId", Some(json!("host.0123456789A")), BadHostId),
            ("relayHostId", Some(json!(1234567890123456u64)), BadHostId),
            ("relayHostId", None, BadHostId),
        ];
        for (field, value, expected) in cases {
            let shown = format!("{field}={value:?}");
            assert_eq!(
                check_with(field, value).map(|_| ()),
                Err(expected),
                "{shown}"
            );
        }
    }

    #[test]
    fn expiry_leeway_is_thirty_seconds() {
        let exp_s = NOW_MS / 1000;
        let at = |now_ms| {
            let mut claims = good_claims();
            claims["exp"] = json!(exp_s);
            check_claims(&b64(&claims), rules(), now_ms).map(|_| ())
        };
        assert_eq!(at(NOW_MS + EXP_LEEWAY_MS - 1), Ok(()));
        assert_eq!(at(NOW_MS + EXP_LEEWAY_MS), Err(AuthError::Expired));
    }

    #[test]
    fn audience_array_containing_ours_passes_and_issuer_is_optional_without_rule() {
        let mut claims = good_claims();
        claims["aud"] = json!(["other", "orca-relay"]);
        claims.as_object_mut().expect("object").remove("iss");
        let no_issuer_rule = ClaimRules {
            issuer: None,
            audience: "orca-relay",
        };
        assert!(check_claims(&b64(&claims), no_issuer_rule, NOW_MS).is_ok());
    }

    #[test]
    fn split_refuses_bad_shapes() {
        let header = b64(&json!({"alg": "ES256", "kid": "k"}));
        let payload = b64(&good_claims());
        let cases = [
            String::new(),
            "a.b".to_string(),
            format!("{header}.{payload}.sig.extra"),
            format!(".{payload}.sig"),
            format!("{}.{payload}.sig", b64(&json!({"kid": "k"}))),
            format!("{}.{payload}.sig", b64(&json!({"alg": 5}))),
            format!("{}.{payload}.sig", b64(&json!({"alg": "ES256", "kid": 7}))),
            format!(
                "{}.{payload}.sig",
                b64(&json!({"alg": "ES256", "crit": ["exp"]}))
            ),
            format!("{}.{payload}.sig", URL_SAFE_NO_PAD.encode("[1,2]")),
            format!("not base64!.{payload}.sig"),
            format!("{header}.{payload}.{}", "A".repeat(MAX_TOKEN_BYTES)),
        ];
        for token in cases {
            assert_eq!(
                split_token(&token).map(|_| ()),
                Err(AuthError::Malformed),
                "{token:.60}"
            );
        }
    }

    #[test]
    fn split_reads_alg_kid_and_the_signing_input() {
        let header = b64(&json!({"alg": "none", "kid": "k1"}));
        let token = format!("{header}.{}.", b64(&good_claims()));
        let parts = split_token(&token).expect("splits");
        assert_eq!(parts.alg, "none");
        assert_eq!(parts.kid.as_deref(), Some("k1"));
        assert_eq!(parts.signature_b64, "");
        assert_eq!(parts.signing_input, &token[..token.len() - 1]);
    }

    #[test]
    fn relay_host_id_shape() {
        assert!(is_valid_relay_host_id("AZaz09_-AZaz09_-"));
        assert!(!is_valid_relay_host_id("AZaz09_-AZaz09_"));
        assert!(!is_valid_relay_host_id("AZaz09_-AZaz09_-x"));
        // 14 ASCII bytes plus a two-byte character: 16 bytes, still refused.
        assert!(!is_valid_relay_host_id("AZaz09_-AZaz09é"));
    }
}
