//! The HTTP listener of every role: our own small HTTP/1.1 server (`server.rs`) on `httparse`,
//! the request-head reader both listeners share (`head.rs`), and the bounded connection table
//! both acceptors admit through (`table.rs`).
//!
//! Handlers are plain functions of a [`Request`] returning a [`Reply`]; a panic in a handler is a
//! 500 for that request, not a dead process. See `server.rs` for the deadlines (whole head 10 s,
//! body 10 s, idle keep-alive `ORCA_RELAY_HTTP_IDLE_MS`) and why this is not `tiny_http`.

pub mod head;
pub mod server;
pub mod table;

use std::sync::Arc;

pub use server::{HttpServer, HttpSettings};

/// An HTTP answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reply {
    pub status: u16,
    pub content_type: &'static str,
    pub body: String,
    pub headers: Vec<(&'static str, String)>,
}

impl Reply {
    pub fn json(status: u16, body: impl Into<String>) -> Reply {
        Reply {
            status,
            content_type: "application/json",
            body: body.into(),
            headers: Vec::new(),
        }
    }

    pub fn error(status: u16, code: &str) -> Reply {
        Reply::json(status, serde_json::json!({ "error": code }).to_string())
    }

    pub fn text(status: u16, body: impl Into<String>) -> Reply {
        Reply {
            status,
            content_type: "text/plain; version=0.0.4",
            body: body.into(),
            headers: Vec::new(),
        }
    }

    pub fn with_header(mut self, name: &'static str, value: impl Into<String>) -> Reply {
        self.headers.push((name, value.into()));
        self
    }
}

/// What a handler sees of a request. `HEAD` requests reach handlers as `GET` (the server
/// drops the body of the answer).
pub struct Request<'a> {
    pub method: &'a str,
    pub path: &'a str,
    pub query: &'a str,
    pub authorization: Option<&'a str>,
    body: &'a mut (dyn BodySource + 'a),
}

/// Where a request's body comes from: the connection (`server.rs`) or, in tests, memory.
pub trait BodySource {
    /// The whole body, refusing one longer than `limit` bytes without reading it.
    fn read_body(&mut self, limit: usize) -> Result<Vec<u8>, BodyError>;
}

/// A body held in memory (tests of handlers).
impl BodySource for Vec<u8> {
    fn read_body(&mut self, limit: usize) -> Result<Vec<u8>, BodyError> {
        if self.len() > limit {
            return Err(BodyError::TooLarge);
        }
        Ok(std::mem::take(self))
    }
}

#[derive(Debug, PartialEq, Eq)]
pub enum BodyError {
    TooLarge,
    Unreadable,
}

impl<'a> Request<'a> {
    /// A request as the server hands it to a handler.
    pub fn new(
        method: &'a str,
        path: &'a str,
        query: &'a str,
        authorization: Option<&'a str>,
        body: &'a mut (dyn BodySource + 'a),
    ) -> Request<'a> {
        Request {
            method,
            path,
            query,
            authorization,
            body,
        }
    }

    /// Reads the body, refusing more than `limit` bytes (by its `Content-Length`, before
    /// reading any of it).
    pub fn body(&mut self, limit: usize) -> Result<Vec<u8>, BodyError> {
        self.body.read_body(limit)
    }

    /// Reads and parses a JSON body under `limit` bytes; the error is the reply to send.
    pub fn json<T: serde::de::DeserializeOwned>(&mut self, limit: usize) -> Result<T, Reply> {
        let body = self.body(limit).map_err(|e| match e {
            BodyError::TooLarge => Reply::error(413, "body_too_large"),
            BodyError::Unreadable => Reply::error(400, "unreadable_body"),
        })?;
        serde_json::from_slice(&body).map_err(|e| {
            Reply::json(
                400,
                serde_json::json!({"error": "bad_request", "reason": e.to_string()}).to_string(),
            )
        })
    }

    /// Query parameter by name (no percent-decoding: our parameters are plain tokens).
    pub fn query_param(&self, name: &str) -> Option<&str> {
        self.query.split('&').find_map(|pair| {
            let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
            (key == name).then_some(value)
        })
    }
}

pub type Handler = Arc<dyn Fn(&mut Request<'_>) -> Reply + Send + Sync>;

/// Compares secrets without an early exit on the first differing byte.
pub fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Compares a bearer token (scheme in any case) with the expected secret in constant time.
pub fn bearer_matches(authorization: Option<&str>, expected: &str) -> bool {
    let presented = crate::service_token::bearer_credentials(authorization).unwrap_or("");
    constant_time_eq(presented.as_bytes(), expected.as_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bearer_compare() {
        assert!(bearer_matches(Some("Bearer s3cret"), "s3cret"));
        assert!(bearer_matches(Some("bearer s3cret"), "s3cret"));
        assert!(!bearer_matches(Some("Bearer s3cre"), "s3cret"));
        assert!(!bearer_matches(Some("s3cret"), "s3cret"));
        assert!(!bearer_matches(None, "s3cret"));
    }
}
