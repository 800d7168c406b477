//! The WebSocket upgrade: reading the request head under one deadline, routing, and the HTTP
//! answers that refuse an upgrade (401, 404, 503).
//!
//! We read the head ourselves (with `httparse`) rather than through tungstenite's handshake so
//! that the whole head has one deadline (a client trickling a byte every few seconds cannot pin
//! the thread) and so that each endpoint's reader gets its own buffer sizes.

use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use crate::clock;

/// The whole upgrade request must arrive within this (SPEC §5.2: 5 s).
pub const UPGRADE_DEADLINE: Duration = Duration::from_secs(5);
/// A request head larger than this is refused.
const MAX_HEAD_BYTES: usize = 8 * 1024;

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

#[derive(Debug, PartialEq, Eq)]
pub enum HeadError {
    TimedOut,
    Malformed,
    TooLarge,
    Closed,
}

/// Reads one request head within `deadline`.
pub fn read_head(stream: &TcpStream, deadline: Duration) -> Result<UpgradeRequest, HeadError> {
    let started = clock::instant();
    let mut buf = vec![0u8; 1024];
    let mut filled = 0;
    loop {
        let remaining = deadline
            .checked_sub(started.elapsed())
            .filter(|d| !d.is_zero())
            .ok_or(HeadError::TimedOut)?;
        stream
            .set_read_timeout(Some(remaining))
            .map_err(|_| HeadError::Closed)?;
        if filled == buf.len() {
            if buf.len() >= MAX_HEAD_BYTES {
                return Err(HeadError::TooLarge);
            }
            buf.resize((buf.len() * 2).min(MAX_HEAD_BYTES), 0);
        }
        let n = match (&*stream).read(&mut buf[filled..]) {
            Ok(0) => return Err(HeadError::Closed),
            Ok(n) => n,
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) =>
            {
                return Err(HeadError::TimedOut)
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(_) => return Err(HeadError::Closed),
        };
        filled += n;
        let mut headers = [httparse::EMPTY_HEADER; 32];
        let mut request = httparse::Request::new(&mut headers);
        match request.parse(&buf[..filled]) {
            Ok(httparse::Status::Complete(head_len)) => {
                if request.method != Some("GET") {
                    return Err(HeadError::Malformed);
                }
                let header = |name: &str| {
                    request
                        .headers
                        .iter()
                        .find(|h| h.name.eq_ignore_ascii_case(name))
                        .and_then(|h| std::str::from_utf8(h.value).ok())
                        .map(|v| v.trim().to_string())
                };
                let upgrade = header("upgrade").unwrap_or_default();
                let connection = header("connection").unwrap_or_default();
                let is_websocket = upgrade.eq_ignore_ascii_case("websocket")
                    && connection
                        .split(',')
                        .any(|token| token.trim().eq_ignore_ascii_case("upgrade"))
                    && header("sec-websocket-version").as_deref() == Some("13");
                return Ok(UpgradeRequest {
                    path: request.path.unwrap_or("/").to_string(),
                    authorization: header("authorization"),
                    key: header("sec-websocket-key"),
                    is_websocket,
                    tail: buf[head_len..filled].to_vec(),
                });
            }
            Ok(httparse::Status::Partial) => {}
            Err(_) => return Err(HeadError::Malformed),
        }
    }
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
    (&*stream).write_all(response.as_bytes())
}

/// Writes a refusal and leaves the connection for the caller to drop.
pub fn refuse(stream: &TcpStream, status: u16, reason: &str, retry_after_s: Option<u32>) {
    let body = format!("{{\"error\":\"{reason}\"}}");
    let status_text = match status {
        400 => "Bad Request",
        401 => "Unauthorized",
        404 => "Not Found",
        426 => "Upgrade Required",
        503 => "Service Unavailable",
        _ => "Error",
    };
    let retry = retry_after_s
        .map(|s| format!("Retry-After: {s}\r\n"))
        .unwrap_or_default();
    let response = format!(
        "HTTP/1.1 {status} {status_text}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n{retry}Connection: close\r\n\r\n{body}",
        body.len()
    );
    let _ = stream.set_write_timeout(Some(Duration::from_secs(1)));
    let _ = (&*stream).write_all(response.as_bytes());
    let _ = stream.shutdown(std::net::Shutdown::Write);
    // Read what the client still sends (briefly) so the close is not turned into a reset that
    // would hide the answer from it.
    let _ = stream.set_read_timeout(Some(Duration::from_millis(200)));
    let mut sink = [0u8; 512];
    loop {
        match (&*stream).read(&mut sink) {
            Ok(0) => break,
            Ok(_) => {}
            // A stop and continue interrupts the read (signal(7)); it is not the client leaving.
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(_) => break,
        }
    }
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
