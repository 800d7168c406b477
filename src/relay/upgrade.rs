//! The WebSocket upgrade: reading the request head under one deadline, routing, and the HTTP
//! answers that refuse an upgrade (401, 404, 426, 503).
//!
//! The head is read by the reader both listeners share (`http::head`) rather than through
//! tungstenite's handshake, so the whole head has one deadline (a client trickling a byte every
//! few seconds cannot pin the thread), `EINTR` is retried, and the bytes that follow the head
//! (the start of the first frame) are kept.
//!
//! A refusal answers at once and hands the socket to the reaper, which drops it
//! [`REFUSAL_LINGER`] later whatever the client keeps sending: the thread, its pending-upgrade
//! entry and any connection unit are released when the answer is written.

use std::io;
use std::net::TcpStream;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::clock;
use crate::http::head::{self, Head, HeadError, HeadReader};

/// The whole upgrade request must arrive within this (SPEC §5.2: 5 s; stricter than the HTTP
/// port's 10 s).
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

/// A parsed upgrade request.
#[derive(Debug)]
pub struct UpgradeRequest {
    pub path: String,
    pub authorization: Option<String>,
    pub key: Option<String>,
    pub is_websocket: bool,
    /// Bytes that arrived after the head (the start of the first frame).
    pub tail: Vec<u8>,
}

/// Reads one upgrade request head by `deadline` (counted from the connection's acceptance).
pub fn read_head(stream: &TcpStream, deadline: Instant) -> Result<UpgradeRequest, HeadError> {
    let mut reader = HeadReader::new();
    let head = reader.read_head(stream, deadline)?;
    upgrade_request(head, reader.into_buffered())
}

/// Parses an upgrade request from the bytes received so far: `Ok(None)` while the head is
/// incomplete. Pure, the same steps as [`read_head`], so it is fuzzed on its own (`tests/fuzz`).
pub fn parse_head(received: &[u8]) -> Result<Option<UpgradeRequest>, HeadError> {
    match head::parse_head(received)? {
        Some((head, head_len)) => upgrade_request(head, received[head_len..].to_vec()).map(Some),
        None => Ok(None),
    }
}

/// What an upgrade needs of a head; `tail` is what arrived after it (the first frame's start).
fn upgrade_request(head: Head, tail: Vec<u8>) -> Result<UpgradeRequest, HeadError> {
    if head.method != "GET" {
        return Err(HeadError::Malformed);
    }
    let is_websocket = head
        .header("upgrade")
        .is_some_and(|v| v.eq_ignore_ascii_case("websocket"))
        && head.has_token("connection", "upgrade")
        && head.header("sec-websocket-version") == Some("13");
    Ok(UpgradeRequest {
        path: head.target.clone(),
        authorization: head.header("authorization").map(str::to_string),
        key: head.header("sec-websocket-key").map(str::to_string),
        is_websocket,
        tail,
    })
}

/// Maps a request path to an endpoint; `None` is a 404.
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

/// Writes `101 Switching Protocols`.
pub fn accept(stream: &TcpStream, key: &str) -> io::Result<()> {
    let accept = tungstenite::handshake::derive_accept_key(key.as_bytes());
    let response = format!(
        "HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Accept: {accept}\r\n\r\n"
    );
    head::write_all_by(
        stream,
        response.as_bytes(),
        clock::instant() + Duration::from_secs(1),
    )
}

/// The bytes of a refusal: a JSON error body and `Connection: close`.
pub fn refusal(status: u16, reason: &str, retry_after_s: Option<u32>) -> String {
    let body = format!("{{\"error\":\"{reason}\"}}");
    let status_text = match status {
        400 => "Bad Request",
        401 => "Unauthorized",
        404 => "Not Found",
        426 => "Upgrade Required",
        429 => "Too Many Requests",
        503 => "Service Unavailable",
        _ => "Error",
    };
    let retry = retry_after_s
        .map(|s| format!("Retry-After: {s}\r\n"))
        .unwrap_or_default();
    let upgrade = if status == 426 {
        "Upgrade: websocket\r\n"
    } else {
        ""
    };
    format!(
        "HTTP/1.1 {status} {status_text}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n{retry}{upgrade}Connection: close\r\n\r\n{body}",
        body.len()
    )
}

/// Writes a refusal (within 1 s) and closes our side; the caller hands the socket to the
/// reaper, which drops it after [`REFUSAL_LINGER`].
pub fn refuse(stream: &Arc<TcpStream>, status: u16, reason: &str, retry_after_s: Option<u32>) {
    let _ = head::write_all_by(
        stream,
        refusal(status, reason, retry_after_s).as_bytes(),
        clock::instant() + Duration::from_secs(1),
    );
    let _ = stream.shutdown(std::net::Shutdown::Write);
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
}
