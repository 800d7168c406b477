//! The WebSocket upgrade as pure decisions: whether a request head asks for a WebSocket this
//! relay opens (RFC 6455 §4.2.1), which endpoint, and the bytes of every answer (the 101 and the
//! refusals: 400, 401, 404, 408, 414, 426, 431, 503).
//!
//! The head itself is read by the acceptor's pending loop (`relay/pending.rs`) with the parser
//! both listeners share (`http::head`), under one deadline from the connection's acceptance; the
//! loop writes the answers built here. Nothing in this module does I/O, so every rule is
//! fuzzed on its own (`tests/fuzz`, target `upgrade_validation`).
//!
//! What a head must be (first failed rule answers):
//! 1. a well-formed HTTP/1.x head (else 400; a request line over the head limit 414, a head over
//!    it 431);
//! 2. HTTP/1.1 (RFC 6455 §4.1: "at least 1.1") with exactly one `Host` (RFC 9112 §3.2), method
//!    `GET`, a target in origin or absolute form: else 400;
//! 3. a known endpoint: else 404;
//! 4. `Upgrade: websocket`, `Connection: upgrade` and `Sec-WebSocket-Version: 13`: else 426 with
//!    `Sec-WebSocket-Version: 13` (RFC 6455 §4.4: the version the server speaks);
//! 5. exactly one `Sec-WebSocket-Key`, the base64 of 16 bytes (RFC 6455 §4.1): else 400.

use std::time::Duration;

use base64::Engine;

use crate::http::head::{split_target, Head, HeadError};

/// The whole upgrade request must arrive within this (SPEC §5.2: 5 s; stricter than the HTTP
/// port's 10 s). It is also the bound of a connection's whole pending life: a splice leg's first
/// frame is due within `ORCA_RELAY_FIRST_FRAME_MS` of the upgrade *and* by this deadline.
pub const UPGRADE_DEADLINE: Duration = Duration::from_secs(5);
/// How long a refused client has to read its answer before the TCP connection is dropped
/// (SPEC §5.2 and §11: gone within 1 s whatever the client sends).
pub const REFUSAL_LINGER: Duration = Duration::from_millis(500);

/// The endpoints of the public listener.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Route {
    Control,
    Phone { relay_host_id: String },
    DataLeg { conn_id: String },
}

impl Route {
    pub fn kind(&self) -> &'static str {
        match self {
            Route::Control => "control",
            Route::Phone { .. } => "phone",
            Route::DataLeg { .. } => "data",
        }
    }
}

/// A head that asks for a WebSocket this relay opens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Upgrade {
    pub route: Route,
    /// `Sec-WebSocket-Key`, checked: the base64 of 16 bytes.
    pub key: String,
    /// The `Authorization` header, if any (a desktop's bearer token).
    pub authorization: Option<String>,
}

/// An upgrade refused with an HTTP status: the reason counted in
/// `orca_relay_upgrades_refused_total`, the `error` of the JSON answer, and `Retry-After`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Refusal {
    pub status: u16,
    pub reason: &'static str,
    pub answer: &'static str,
    pub retry_after_s: Option<u32>,
}

impl Refusal {
    /// A 400 (the answer is the reason).
    pub fn bad_request(reason: &'static str) -> Refusal {
        Refusal {
            status: 400,
            reason,
            answer: reason,
            retry_after_s: None,
        }
    }

    /// 503 with `Retry-After: 2`, the reason as the answer.
    pub fn unavailable(reason: &'static str) -> Refusal {
        Refusal {
            status: 503,
            reason,
            answer: reason,
            retry_after_s: Some(2),
        }
    }

    /// The answer to a head that could not be read whole, or `None` when the connection is
    /// closed without one (it ended, or sent nothing before its deadline).
    pub fn for_head_error(error: HeadError) -> Option<Refusal> {
        let refusal = |status, reason| Refusal {
            status,
            reason,
            answer: reason,
            retry_after_s: None,
        };
        match error {
            HeadError::Closed | HeadError::TimedOut { partial: false } => None,
            HeadError::TimedOut { partial: true } => Some(refusal(408, "request_timeout")),
            HeadError::Malformed => Some(refusal(400, "malformed_request")),
            HeadError::TooLarge => Some(refusal(431, "request_head_too_large")),
            HeadError::LineTooLong => Some(refusal(414, "request_line_too_long")),
        }
    }
}

/// Decides what a complete upgrade head asks for (the rules in the module header). Pure.
pub fn check(head: &Head) -> Result<Upgrade, Refusal> {
    if head.minor_version != 1 {
        return Err(Refusal::bad_request("http_version"));
    }
    if let Err(reason) = head.host_rule() {
        return Err(Refusal::bad_request(reason));
    }
    if head.method != "GET" {
        return Err(Refusal::bad_request("method"));
    }
    let Some((path, _query)) = split_target(&head.target) else {
        return Err(Refusal::bad_request("bad_request_target"));
    };
    let Some(route) = route(path) else {
        return Err(Refusal {
            status: 404,
            reason: "unknown_path",
            answer: "not_found",
            retry_after_s: None,
        });
    };
    let is_websocket = head.has_token("upgrade", "websocket")
        && head.has_token("connection", "upgrade")
        && head.header_values("sec-websocket-version").count() == 1
        && head.header("sec-websocket-version") == Some("13");
    if !is_websocket {
        return Err(Refusal {
            status: 426,
            reason: "not_websocket",
            answer: "websocket_upgrade_required",
            retry_after_s: None,
        });
    }
    let key = match (
        head.header_values("sec-websocket-key").count(),
        head.header("sec-websocket-key"),
    ) {
        (1, Some(key)) if key_is_valid(key) => key.to_string(),
        _ => return Err(Refusal::bad_request("websocket_key")),
    };
    Ok(Upgrade {
        route,
        key,
        authorization: head.header("authorization").map(str::to_string),
    })
}

/// RFC 6455 §4.1: the key is the base64 (standard alphabet, padded) of 16 random bytes, so
/// exactly 24 characters.
pub fn key_is_valid(key: &str) -> bool {
    key.len() == 24
        && base64::engine::general_purpose::STANDARD
            .decode(key)
            .is_ok_and(|bytes| bytes.len() == 16)
}

/// Maps a request path (without its query) to an endpoint; `None` is a 404.
pub fn route(path: &str) -> Option<Route> {
    let path = path.split('?').next().unwrap_or(path);
    if path == "/v1/host/control" {
        return Some(Route::Control);
    }
    if let Some(host) = path.strip_prefix("/v1/connect/") {
        if crate::config::is_id(host, 128) {
            return Some(Route::Phone {
                relay_host_id: host.to_string(),
            });
        }
        return None;
    }
    if let Some(conn_id) = path.strip_prefix("/v1/host/data/") {
        if crate::config::is_id(conn_id, 128) {
            return Some(Route::DataLeg {
                conn_id: conn_id.to_string(),
            });
        }
    }
    None
}

/// The bytes of `101 Switching Protocols` for a checked key.
pub fn switching_protocols(key: &str) -> String {
    let accept = tungstenite::handshake::derive_accept_key(key.as_bytes());
    format!(
        "HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Accept: {accept}\r\n\r\n"
    )
}

/// The bytes of a refusal: a JSON error body and `Connection: close`; a 426 names the upgrade
/// and the version this relay speaks. A 401's body is the director's for the same token
/// (`{"error":"unauthorized","reason":…}`, the reason being the token's fault).
pub fn refusal(refusal: &Refusal) -> String {
    let body = if refusal.status == 401 {
        format!(
            "{{\"error\":\"{}\",\"reason\":\"{}\"}}",
            refusal.answer, refusal.reason
        )
    } else {
        format!("{{\"error\":\"{}\"}}", refusal.answer)
    };
    let status = refusal.status;
    let status_text = match status {
        400 => "Bad Request",
        401 => "Unauthorized",
        404 => "Not Found",
        408 => "Request Timeout",
        414 => "URI Too Long",
        426 => "Upgrade Required",
        429 => "Too Many Requests",
        431 => "Request Header Fields Too Large",
        503 => "Service Unavailable",
        _ => "Error",
    };
    let retry = refusal
        .retry_after_s
        .map(|s| format!("Retry-After: {s}\r\n"))
        .unwrap_or_default();
    let upgrade = if status == 426 {
        "Upgrade: websocket\r\nSec-WebSocket-Version: 13\r\n"
    } else {
        ""
    };
    format!(
        "HTTP/1.1 {status} {status_text}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n{retry}{upgrade}Connection: close\r\n\r\n{body}",
        body.len()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routes() {
        assert_eq!(route("/v1/host/control"), Some(Route::Control));
        assert_eq!(
            route("/v1/connect/abcdefghijklmnop"),
            Some(Route::Phone {
                relay_host_id: "abcdefghijklmnop".into()
            })
        );
        assert_eq!(
            route("/v1/host/data/1-2"),
            Some(Route::DataLeg {
                conn_id: "1-2".into()
            })
        );
        assert_eq!(route("/v1/connect/"), None);
        assert_eq!(route("/v1/connect/a/b"), None);
        assert_eq!(route("/"), None);
        assert_eq!(route("/v1/host/control/x"), None);
    }

    fn head(text: &str) -> Head {
        crate::http::head::parse_head(text.as_bytes())
            .expect("well formed")
            .expect("complete")
            .0
    }

    const GOOD: &str = "GET /v1/connect/abcdefghijklmnop HTTP/1.1\r\nHost: r\r\nUpgrade: websocket\r\nConnection: keep-alive, Upgrade\r\nSec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n";

    #[test]
    fn each_rule_has_its_answer() {
        let checked = |text: &str| check(&head(text)).map_err(|r| (r.status, r.reason));
        assert_eq!(
            checked(GOOD).map(|u| u.route.kind()),
            Ok("phone"),
            "the good head"
        );
        let cases: [(String, (u16, &str)); 11] = [
            (GOOD.replace("HTTP/1.1", "HTTP/1.0"), (400, "http_version")),
            (GOOD.replace("Host: r\r\n", ""), (400, "missing_host")),
            (
                GOOD.replace("Host: r\r\n", "Host: r\r\nHost: s\r\n"),
                (400, "repeated_host"),
            ),
            (GOOD.replacen("GET", "POST", 1), (400, "method")),
            (
                GOOD.replace("/v1/connect/abcdefghijklmnop", "v1/connect/x"),
                (400, "bad_request_target"),
            ),
            (
                GOOD.replace("/v1/connect/", "/v2/connect/"),
                (404, "unknown_path"),
            ),
            (
                GOOD.replace("Upgrade: websocket\r\n", ""),
                (426, "not_websocket"),
            ),
            (
                GOOD.replace("Version: 13", "Version: 8"),
                (426, "not_websocket"),
            ),
            (
                GOOD.replace("dGhlIHNhbXBsZSBub25jZQ==", ""),
                (400, "websocket_key"),
            ),
            (
                GOOD.replace("dGhlIHNhbXBsZSBub25jZQ==", "AAAAAAAAAAAAAAAAAAAA"),
                (400, "websocket_key"),
            ),
            (
                GOOD.replace(
                    "\r\n\r\n",
                    "\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n",
                ),
                (400, "websocket_key"),
            ),
        ];
        for (text, expected) in cases {
            assert_eq!(checked(&text).err(), Some(expected), "{text}");
        }
    }

    #[test]
    fn keys_are_base64_of_sixteen_bytes() {
        assert!(key_is_valid("dGhlIHNhbXBsZSBub25jZQ=="));
        assert!(key_is_valid("AAAAAAAAAAAAAAAAAAAAAA=="));
        for bad in [
            "",
            "dGhlIHNhbXBsZSBub25jZQ",
            "dGhlIHNhbXBsZSBub25jZQ==x",
            "AAAAAAAAAAAAAAAAAAAAAAAA",
            "dGhlIHNhbXBsZSBub25jZQ=!",
            "dGhl IHNhbXBsZSBub25jZQ=",
        ] {
            assert!(!key_is_valid(bad), "{bad:?}");
        }
    }

    #[test]
    fn a_426_names_the_version_and_every_refusal_closes() {
        let text = refusal(&Refusal {
            status: 426,
            reason: "not_websocket",
            answer: "websocket_upgrade_required",
            retry_after_s: None,
        });
        assert!(
            text.starts_with("HTTP/1.1 426 Upgrade Required\r\n"),
            "{text}"
        );
        assert!(text.contains("\r\nSec-WebSocket-Version: 13\r\n"), "{text}");
        assert!(text.contains("\r\nConnection: close\r\n"), "{text}");
        let text = refusal(&Refusal::unavailable("connection_cap"));
        assert!(text.contains("\r\nRetry-After: 2\r\n"), "{text}");
        assert!(!text.contains("Sec-WebSocket-Version"), "{text}");
    }
}
