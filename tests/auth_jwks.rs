//! The JWKS-backed verifier against a real local JWKS server (tiny_http on 127.0.0.1:0) serving
//! an EC P-256 key and an RSA-2048 key whose private halves are the fixtures in
//! `tests/fixtures/auth`. Time is a ManualClock; the server counts the requests it answers, so
//! the refetch rate limit and "no fetch for a refused algorithm" are observed, not assumed.

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use base64::Engine;
use jsonwebtoken::jwk::Jwk;
use jsonwebtoken::{Algorithm, EncodingKey, Header};
use orca_relay::auth::{AuthError, Verifier, UNKNOWN_KID_REFETCH_INTERVAL_MS};
use orca_relay::clock::{self, ManualClock};
use serde_json::{json, Value};

const EC_PRIVATE_PEM: &str = include_str!("fixtures/auth/ec-p256-private.pem");
const RSA_PRIVATE_PEM: &str = include_str!("fixtures/auth/rsa-2048-private.pem");
const RSA_PUBLIC_PEM: &str = include_str!("fixtures/auth/rsa-2048-public.pem");
const EC_PUBLIC_PEM: &str = include_str!("fixtures/auth/ec-p256-public.pem");

const EC_KID: &str = "ec-1";
const RSA_KID: &str = "rsa-1";
const ISSUER: &str = "https://auth.example";
const AUDIENCE: &str = "orca-relay";
const HOST_ID: &str = "host_0123456789A";
const NOW_MS: u64 = 1_800_000_000_000;

// ---------------------------------------------------------------------------------------------
// Keys and tokens

fn ec_key() -> EncodingKey {
    EncodingKey::from_ec_pem(EC_PRIVATE_PEM.as_bytes()).expect("EC fixture")
}

fn rsa_key() -> EncodingKey {
    EncodingKey::from_rsa_pem(RSA_PRIVATE_PEM.as_bytes()).expect("RSA fixture")
}

/// The public JWK of a private key, under `kid` (or none).
fn public_jwk(key: &EncodingKey, alg: Algorithm, kid: Option<&str>) -> Value {
    let mut jwk =
        serde_json::to_value(Jwk::from_encoding_key(key, alg).expect("jwk")).expect("json");
    let object = jwk.as_object_mut().expect("jwk object");
    object.remove("alg");
    if let Some(kid) = kid {
        object.insert("kid".to_string(), json!(kid));
    }
    jwk
}

fn jwks_body(keys: &[Value]) -> String {
    json!({ "keys": keys }).to_string()
}

fn standard_jwks() -> String {
    jwks_body(&[
        public_jwk(&ec_key(), Algorithm::ES256, Some(EC_KID)),
        public_jwk(&rsa_key(), Algorithm::RS256, Some(RSA_KID)),
    ])
}

fn claims() -> Value {
    json!({
        "sub": "user-42",
        "relayHostId": HOST_ID,
        "purpose": "host-control",
        "aud": AUDIENCE,
        "iss": ISSUER,
        "exp": NOW_MS / 1000 + 600,
    })
}

fn sign(alg: Algorithm, kid: Option<&str>, claims: &Value, key: &EncodingKey) -> String {
    let mut header = Header::new(alg);
    header.kid = kid.map(str::to_string);
    jsonwebtoken::encode(&header, claims, key).expect("signs")
}

fn es256(kid: &str, claims: &Value) -> String {
    sign(Algorithm::ES256, Some(kid), claims, &ec_key())
}

fn rs256(kid: &str, claims: &Value) -> String {
    sign(Algorithm::RS256, Some(kid), claims, &rsa_key())
}

fn b64(text: &str) -> String {
    URL_SAFE_NO_PAD.encode(text)
}

/// An HS256 token built by hand with `secret` as the HMAC key: the algorithm-confusion attack,
/// where the secret is a public key anyone can download.
fn hs256_by_hand(kid: &str, claims: &Value, secret: &[u8]) -> String {
    let header = b64(&json!({"alg": "HS256", "typ": "JWT", "kid": kid}).to_string());
    let payload = b64(&claims.to_string());
    let signing_input = format!("{header}.{payload}");
    let key = EncodingKey::from_secret(secret).expect("secret");
    let signature =
        jsonwebtoken::crypto::sign(signing_input.as_bytes(), &key, Algorithm::HS256).expect("hmac");
    format!("{signing_input}.{signature}")
}

// ---------------------------------------------------------------------------------------------
// The JWKS server

/// What the server answers: a status and a body, changeable while it runs.
type Answer = Arc<Mutex<(u16, String)>>;

struct JwksServer {
    addr: SocketAddr,
    requests: Arc<AtomicUsize>,
    answer: Answer,
    server: Arc<tiny_http::Server>,
    thread: Option<JoinHandle<()>>,
}

impl JwksServer {
    fn start(body: String) -> JwksServer {
        Self::start_at(
            "127.0.0.1:0",
            Arc::new(Mutex::new((200, body))),
            Arc::new(AtomicUsize::new(0)),
        )
    }

    /// Starts a server at `addr`, sharing the answer and the request counter (so a restarted
    /// server keeps counting where the stopped one left off).
    fn start_at(addr: &str, answer: Answer, requests: Arc<AtomicUsize>) -> JwksServer {
        let server = Arc::new(tiny_http::Server::http(addr).expect("bind JWKS server"));
        let addr = server.server_addr().to_ip().expect("an IP listener");
        let thread = {
            let server = Arc::clone(&server);
            let answer = Arc::clone(&answer);
            let requests = Arc::clone(&requests);
            orca_relay::threads::spawn("test-jwks", move || {
                while let Ok(request) = server.recv() {
                    requests.fetch_add(1, Ordering::SeqCst);
                    let (status, body) = answer.lock().expect("answer").clone();
                    let response = tiny_http::Response::from_string(body)
                        .with_status_code(status)
                        .with_header(
                            tiny_http::Header::from_bytes("Content-Type", "application/json")
                                .expect("header"),
                        );
                    let _ = request.respond(response);
                }
            })
            .expect("spawn JWKS server thread")
        };
        JwksServer {
            addr,
            requests,
            answer,
            server,
            thread: Some(thread),
        }
    }

    fn url(&self) -> String {
        format!("http://{}/.well-known/jwks.json", self.addr)
    }

    fn requests(&self) -> usize {
        self.requests.load(Ordering::SeqCst)
    }

    fn answer_with(&self, status: u16, body: String) {
        *self.answer.lock().expect("answer") = (status, body);
    }

    /// Stops the server and waits (with a deadline) until its port refuses connections.
    fn stop(mut self) -> (SocketAddr, Answer, Arc<AtomicUsize>) {
        self.server.unblock();
        if let Some(thread) = self.thread.take() {
            thread.join().expect("JWKS server thread");
        }
        let JwksServer {
            addr,
            requests,
            answer,
            server,
            ..
        } = self;
        drop(server); // the last reference: closes the listener
        wait_until("the JWKS port refuses connections", || {
            TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_err()
        });
        (addr, answer, requests)
    }
}

fn wait_until(what: &str, mut condition: impl FnMut() -> bool) {
    let deadline = clock::instant() + Duration::from_secs(10);
    while !condition() {
        assert!(
            clock::instant() < deadline,
            "timed out waiting until {what}"
        );
        clock::sleep(Duration::from_millis(10));
    }
}

fn verifier_for(url: String, clock: &Arc<ManualClock>) -> Verifier {
    Verifier::from_jwks(url, ISSUER.to_string(), AUDIENCE.to_string(), clock.clone())
}

// ---------------------------------------------------------------------------------------------
// Tests

#[test]
fn verifier_is_a_cheap_shared_handle() {
    fn assert_shareable<T: Clone + Send + Sync + 'static>() {}
    assert_shareable::<Verifier>();
}

#[test]
fn valid_es256_and_rs256_tokens_verify_from_one_fetch() {
    let server = JwksServer::start(standard_jwks());
    let clock = ManualClock::starting_at(NOW_MS);
    let verifier = verifier_for(server.url(), &clock);
    assert!(verifier.uses_jwks());
    assert_eq!(server.requests(), 0, "construction does not fetch");

    let claims_es = verifier
        .verify_host_token(&es256(EC_KID, &claims()))
        .expect("ES256");
    assert_eq!(claims_es.user_id, "user-42");
    assert_eq!(claims_es.relay_host_id, HOST_ID);
    assert_eq!(claims_es.expires_at, (NOW_MS / 1000 + 600) * 1000);

    let shared = verifier.clone();
    let claims_rs = orca_relay::threads::spawn("test-verify", move || {
        shared.verify_host_token(&rs256(RSA_KID, &claims()))
    })
    .expect("spawn")
    .join()
    .expect("join")
    .expect("RS256 from another thread, through a clone");
    assert_eq!(claims_rs, claims_es);

    assert_eq!(
        server.requests(),
        1,
        "one cold-cache fetch served both keys"
    );
}

#[test]
fn claim_failures_map_to_their_errors() {
    let server = JwksServer::start(standard_jwks());
    let clock = ManualClock::starting_at(NOW_MS);
    let verifier = verifier_for(server.url(), &clock);

    let with = |field: &str, value: Value| {
        let mut c = claims();
        c[field] = value;
        c
    };
    let cases = [
        (
            "expired",
            with("exp", json!(NOW_MS / 1000 - 60)),
            AuthError::Expired,
        ),
        (
            "wrong audience",
            with("aud", json!("someone-else")),
            AuthError::WrongAudience,
        ),
        (
            "wrong issuer",
            with("iss", json!("https://evil.example")),
            AuthError::WrongIssuer,
        ),
        (
            "wrong purpose",
            with("purpose", json!("phone-connect")),
            AuthError::WrongPurpose,
        ),
        (
            "host id too short",
            with("relayHostId", json!("short")),
            AuthError::BadHostId,
        ),
        (
            "host id bad char",
            with("relayHostId", json!("host/0123456789A")),
            AuthError::BadHostId,
        ),
    ];
    for (name, claims, expected) in cases {
        assert_eq!(
            verifier.verify_host_token(&es256(EC_KID, &claims)),
            Err(expected),
            "ES256 {name}"
        );
        assert_eq!(
            verifier.verify_host_token(&rs256(RSA_KID, &claims)),
            Err(expected),
            "RS256 {name}"
        );
    }

    // An audience array containing ours is accepted.
    let listed = with("aud", json!(["other", AUDIENCE]));
    assert!(verifier.verify_host_token(&es256(EC_KID, &listed)).is_ok());

    // A token valid now expires when the injected clock passes exp + leeway.
    let token = es256(EC_KID, &claims());
    assert!(verifier.verify_host_token(&token).is_ok());
    clock.advance(600_000 + orca_relay::auth::EXP_LEEWAY_MS);
    assert_eq!(verifier.verify_host_token(&token), Err(AuthError::Expired));
}

#[test]
fn tampered_payload_fails_the_signature() {
    let server = JwksServer::start(standard_jwks());
    let clock = ManualClock::starting_at(NOW_MS);
    let verifier = verifier_for(server.url(), &clock);
    let genuine = es256(EC_KID, &claims());
    let mut other = claims();
    other["sub"] = json!("someone-else");
    let forged_payload = es256(EC_KID, &other);
    let genuine: Vec<&str> = genuine.split('.').collect();
    let forged_payload: Vec<&str> = forged_payload.split('.').collect();
    let spliced = format!("{}.{}.{}", genuine[0], forged_payload[1], genuine[2]);
    assert_eq!(
        verifier.verify_host_token(&spliced),
        Err(AuthError::BadSignature)
    );
}

#[test]
fn alg_none_is_refused_without_a_fetch() {
    let server = JwksServer::start(standard_jwks());
    let clock = ManualClock::starting_at(NOW_MS);
    let verifier = verifier_for(server.url(), &clock);
    let payload = b64(&claims().to_string());
    for header in [
        json!({"alg": "none", "kid": EC_KID}),
        json!({"alg": "none"}),
        json!({"alg": "None", "kid": RSA_KID}),
    ] {
        let header = b64(&header.to_string());
        for token in [
            format!("{header}.{payload}."),
            format!("{header}.{payload}.c2ln"),
        ] {
            assert_eq!(
                verifier.verify_host_token(&token),
                Err(AuthError::AlgorithmNotAllowed),
                "{token:.40}"
            );
        }
    }
    assert_eq!(
        server.requests(),
        0,
        "a refused algorithm never reaches the JWKS"
    );
}

#[test]
fn hs256_keyed_with_a_public_key_is_refused() {
    let server = JwksServer::start(standard_jwks());
    let clock = ManualClock::starting_at(NOW_MS);
    let verifier = verifier_for(server.url(), &clock);
    // Warm the cache so the refusal cannot be blamed on a missing key.
    assert!(verifier
        .verify_host_token(&rs256(RSA_KID, &claims()))
        .is_ok());

    let confused_rsa = hs256_by_hand(RSA_KID, &claims(), RSA_PUBLIC_PEM.as_bytes());
    assert_eq!(
        verifier.verify_host_token(&confused_rsa),
        Err(AuthError::AlgorithmNotAllowed)
    );
    let confused_ec = hs256_by_hand(EC_KID, &claims(), EC_PUBLIC_PEM.as_bytes());
    assert_eq!(
        verifier.verify_host_token(&confused_ec),
        Err(AuthError::AlgorithmNotAllowed)
    );
}

#[test]
fn header_alg_must_match_the_key_type() {
    let server = JwksServer::start(standard_jwks());
    let clock = ManualClock::starting_at(NOW_MS);
    let verifier = verifier_for(server.url(), &clock);
    // RS256 header (and a genuine RSA signature) naming the EC key.
    let rs_on_ec = rs256(EC_KID, &claims());
    assert_eq!(
        verifier.verify_host_token(&rs_on_ec),
        Err(AuthError::AlgorithmNotAllowed)
    );
    // ES256 header naming the RSA key.
    let es_on_rsa = es256(RSA_KID, &claims());
    assert_eq!(
        verifier.verify_host_token(&es_on_rsa),
        Err(AuthError::AlgorithmNotAllowed)
    );
    // Algorithms in the right family but not the pinned one.
    let rs384 = sign(Algorithm::RS384, Some(RSA_KID), &claims(), &rsa_key());
    assert_eq!(
        verifier.verify_host_token(&rs384),
        Err(AuthError::AlgorithmNotAllowed)
    );
    let ps256 = sign(Algorithm::PS256, Some(RSA_KID), &claims(), &rsa_key());
    assert_eq!(
        verifier.verify_host_token(&ps256),
        Err(AuthError::AlgorithmNotAllowed)
    );
}

#[test]
fn unknown_kid_refetches_at_most_once_per_interval() {
    let server = JwksServer::start(standard_jwks());
    let clock = ManualClock::starting_at(NOW_MS);
    let verifier = verifier_for(server.url(), &clock);
    assert!(verifier
        .verify_host_token(&es256(EC_KID, &claims()))
        .is_ok());
    assert_eq!(server.requests(), 1);

    // The auth service rotates: the same EC key material now also appears as "ec-2".
    server.answer_with(
        200,
        jwks_body(&[
            public_jwk(&ec_key(), Algorithm::ES256, Some(EC_KID)),
            public_jwk(&ec_key(), Algorithm::ES256, Some("ec-2")),
            public_jwk(&rsa_key(), Algorithm::RS256, Some(RSA_KID)),
        ]),
    );
    clock.advance(UNKNOWN_KID_REFETCH_INTERVAL_MS);

    // First unknown kid: one refetch, which finds the rotated key.
    assert!(verifier
        .verify_host_token(&es256("ec-2", &claims()))
        .is_ok());
    assert_eq!(server.requests(), 2, "an unknown kid triggers one refetch");

    // A second unknown kid inside the interval: refused without a request.
    clock.advance(UNKNOWN_KID_REFETCH_INTERVAL_MS - 1);
    assert_eq!(
        verifier.verify_host_token(&es256("ec-3", &claims())),
        Err(AuthError::UnknownKey)
    );
    assert_eq!(
        verifier.verify_host_token(&es256("ec-4", &claims())),
        Err(AuthError::UnknownKey)
    );
    assert_eq!(server.requests(), 2, "no refetch inside the interval");

    // Known kids keep verifying from the cache without requests.
    assert!(verifier
        .verify_host_token(&rs256(RSA_KID, &claims()))
        .is_ok());
    assert_eq!(server.requests(), 2);

    // Once the interval has passed, the next unknown kid may fetch again.
    clock.advance(1);
    assert_eq!(
        verifier.verify_host_token(&es256("ec-3", &claims())),
        Err(AuthError::UnknownKey)
    );
    assert_eq!(server.requests(), 3);
}

#[test]
fn jwks_outage_keeps_cached_keys_and_probe_recovers() {
    let server = JwksServer::start(standard_jwks());
    let clock = ManualClock::starting_at(NOW_MS);
    let verifier = verifier_for(server.url(), &clock);
    assert_eq!(verifier.probe(), Ok(()));
    assert_eq!(server.requests(), 1);
    assert!(verifier
        .verify_host_token(&es256(EC_KID, &claims()))
        .is_ok());
    assert_eq!(server.requests(), 1, "the probe's fetch filled the cache");

    let (addr, answer, requests) = server.stop();

    // Cached keys keep verifying through the outage.
    assert!(verifier
        .verify_host_token(&es256(EC_KID, &claims()))
        .is_ok());
    assert!(verifier
        .verify_host_token(&rs256(RSA_KID, &claims()))
        .is_ok());
    assert_eq!(verifier.probe(), Err("jwks_unreachable"));
    // An unknown kid cannot be looked up: the refetch fails.
    clock.advance(UNKNOWN_KID_REFETCH_INTERVAL_MS);
    assert_eq!(
        verifier.verify_host_token(&es256("ec-new", &claims())),
        Err(AuthError::KeysUnavailable)
    );
    // The failed probe and refetch did not drop the cache.
    assert!(verifier
        .verify_host_token(&es256(EC_KID, &claims()))
        .is_ok());

    // The server comes back on the same address.
    let server = JwksServer::start_at(&addr.to_string(), answer, requests);
    assert_eq!(verifier.probe(), Ok(()));
    assert_eq!(server.requests(), 2);
    assert!(verifier
        .verify_host_token(&es256(EC_KID, &claims()))
        .is_ok());
}

#[test]
fn a_cold_verifier_with_jwks_down_reports_keys_unavailable() {
    // Bind and drop a listener to get a port that refuses connections.
    let addr = TcpListener::bind("127.0.0.1:0")
        .expect("bind")
        .local_addr()
        .expect("addr");
    let clock = ManualClock::starting_at(NOW_MS);
    let verifier = verifier_for(format!("http://{addr}/jwks"), &clock);
    assert_eq!(
        verifier.verify_host_token(&es256(EC_KID, &claims())),
        Err(AuthError::KeysUnavailable)
    );
    // Rate limited: the next token inside the interval does not even try, and still says so.
    assert_eq!(
        verifier.verify_host_token(&es256(EC_KID, &claims())),
        Err(AuthError::KeysUnavailable)
    );
    assert_eq!(verifier.probe(), Err("jwks_unreachable"));
}

#[test]
fn probe_classifies_http_and_body_failures_and_keeps_the_cache() {
    let server = JwksServer::start(standard_jwks());
    let clock = ManualClock::starting_at(NOW_MS);
    let verifier = verifier_for(server.url(), &clock);
    assert_eq!(verifier.probe(), Ok(()));

    server.answer_with(503, "unavailable".to_string());
    assert_eq!(verifier.probe(), Err("jwks_http_failed"));
    server.answer_with(404, standard_jwks());
    assert_eq!(verifier.probe(), Err("jwks_http_failed"));
    server.answer_with(200, "<html>not a key set</html>".to_string());
    assert_eq!(verifier.probe(), Err("jwks_bad_body"));
    server.answer_with(200, jwks_body(&[]));
    assert_eq!(verifier.probe(), Err("jwks_bad_body"));

    // None of the failures emptied the cache.
    assert!(verifier
        .verify_host_token(&es256(EC_KID, &claims()))
        .is_ok());

    // A successful probe replaces the set: a key the service withdrew stops verifying.
    server.answer_with(
        200,
        jwks_body(&[public_jwk(&rsa_key(), Algorithm::RS256, Some(RSA_KID))]),
    );
    assert_eq!(verifier.probe(), Ok(()));
    clock.advance(UNKNOWN_KID_REFETCH_INTERVAL_MS);
    assert_eq!(
        verifier.verify_host_token(&es256(EC_KID, &claims())),
        Err(AuthError::UnknownKey)
    );
    assert!(verifier
        .verify_host_token(&rs256(RSA_KID, &claims()))
        .is_ok());
}

#[test]
fn probe_times_out_on_a_silent_server() {
    // A listener that never accepts: the kernel completes the handshake, nobody answers.
    let silent = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = silent.local_addr().expect("addr");
    let clock = ManualClock::starting_at(NOW_MS);
    let verifier = verifier_for(format!("http://{addr}/jwks"), &clock);
    let started = clock::instant();
    assert_eq!(verifier.probe(), Err("jwks_timed_out"));
    let waited = started.elapsed();
    assert!(
        waited >= Duration::from_millis(1_500) && waited < Duration::from_secs(5),
        "the 2 s timeout bounds the probe, waited {waited:?}"
    );
    drop(silent);
}

#[test]
fn a_single_jwk_without_kid_matches_a_token_without_kid() {
    let server = JwksServer::start(jwks_body(&[public_jwk(&ec_key(), Algorithm::ES256, None)]));
    let clock = ManualClock::starting_at(NOW_MS);
    let verifier = verifier_for(server.url(), &clock);
    let token = sign(Algorithm::ES256, None, &claims(), &ec_key());
    assert!(verifier.verify_host_token(&token).is_ok());
    // A token that names a kid does not fall back on the anonymous key.
    assert_eq!(
        verifier.verify_host_token(&es256("named", &claims())),
        Err(AuthError::UnknownKey)
    );
}
