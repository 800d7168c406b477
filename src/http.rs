//! The HTTP listener (every role): `tiny_http` with named worker threads `http-<n>`.
//!
//! Handlers are plain functions of a request returning a [`Reply`]; a panic in a handler is a
//! 500 for that request, not a dead process. Slow clients never reach a worker: `tiny_http`
//! reads each request on its own connection thread and queues only complete requests.
//!
//! Stalled clients: the listening socket carries a 10 s receive and send timeout, which Linux
//! copies onto every accepted connection, so a connection whose request head stalls for 10 s
//! (or an idle keep-alive connection) is closed by `tiny_http`'s own read error. The same
//! timeout also makes `accept` return `EAGAIN` after 10 idle seconds, which ends `tiny_http`'s
//! accept thread; the workers notice the error and start a fresh `tiny_http::Server` on the
//! same listening socket (no connection is lost: the kernel keeps the backlog). Connections the
//! old server accepted keep sending their requests to it, so the workers keep serving retired
//! servers too, until none of their connections can be left (no request for twice the
//! connection timeout): a keep-alive client such as a director's feed poller is never left
//! without an answer.

use std::io::Read;
use std::net::TcpListener;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

/// Receive and send timeout of every HTTP connection (SPEC §5.4: a request head that has not
/// arrived within 10 s is closed).
pub const CONNECTION_TIMEOUT: Duration = Duration::from_secs(10);

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

/// What a handler sees of a request.
pub struct Request<'a> {
    pub method: &'a str,
    pub path: &'a str,
    pub query: &'a str,
    pub authorization: Option<&'a str>,
    inner: &'a mut tiny_http::Request,
}

#[derive(Debug, PartialEq, Eq)]
pub enum BodyError {
    TooLarge,
    Unreadable,
}

impl Request<'_> {
    /// Reads the body, refusing more than `limit` bytes.
    pub fn body(&mut self, limit: usize) -> Result<Vec<u8>, BodyError> {
        if self.inner.body_length().is_some_and(|len| len > limit) {
            return Err(BodyError::TooLarge);
        }
        let mut body = Vec::new();
        self.inner
            .as_reader()
            .take(limit as u64 + 1)
            .read_to_end(&mut body)
            .map_err(|_| BodyError::Unreadable)?;
        if body.len() > limit {
            return Err(BodyError::TooLarge);
        }
        Ok(body)
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

/// Compares a bearer token with the expected secret in constant time.
pub fn bearer_matches(authorization: Option<&str>, expected: &str) -> bool {
    let presented = authorization
        .and_then(|value| value.strip_prefix("Bearer "))
        .unwrap_or("");
    constant_time_eq(presented.as_bytes(), expected.as_bytes())
}

/// A running HTTP listener.
pub struct HttpServer {
    stop: Arc<AtomicBool>,
    workers: Vec<JoinHandle<()>>,
}

struct Shared {
    listener: TcpListener,
    current: Mutex<Arc<tiny_http::Server>>,
    /// Servers replaced after their accept thread ended, with when each last had a request:
    /// their keep-alive connections still queue requests on them.
    retired: Mutex<Vec<(Arc<tiny_http::Server>, std::time::Instant)>>,
}

/// A retired server with no request for this long has no connection left: each of them is
/// closed by its read timeout after [`CONNECTION_TIMEOUT`] without a request.
const RETIRED_SERVER_IDLE: Duration = Duration::from_secs(2 * CONNECTION_TIMEOUT.as_secs());

fn set_socket_timeouts(listener: &TcpListener) {
    use std::os::fd::AsRawFd;
    let tv = libc::timeval {
        tv_sec: CONNECTION_TIMEOUT.as_secs() as libc::time_t,
        tv_usec: 0,
    };
    for option in [libc::SO_RCVTIMEO, libc::SO_SNDTIMEO] {
        // SAFETY: setsockopt on a valid descriptor with a correctly sized timeval.
        unsafe {
            libc::setsockopt(
                listener.as_raw_fd(),
                libc::SOL_SOCKET,
                option,
                &tv as *const libc::timeval as *const libc::c_void,
                std::mem::size_of::<libc::timeval>() as libc::socklen_t,
            );
        }
    }
}

fn new_server(listener: &TcpListener) -> std::io::Result<Arc<tiny_http::Server>> {
    let clone = listener.try_clone()?;
    tiny_http::Server::from_listener(clone, None)
        .map(Arc::new)
        .map_err(|e| std::io::Error::other(e.to_string()))
}

impl HttpServer {
    /// Serves `handler` on `listener` with `workers` named threads.
    pub fn start(
        listener: TcpListener,
        workers: usize,
        handler: Handler,
    ) -> std::io::Result<HttpServer> {
        set_socket_timeouts(&listener);
        let server = new_server(&listener)?;
        let shared = Arc::new(Shared {
            listener,
            current: Mutex::new(server),
            retired: Mutex::new(Vec::new()),
        });
        let stop = Arc::new(AtomicBool::new(false));
        let mut handles = Vec::new();
        for n in 0..workers {
            let shared = shared.clone();
            let stop = stop.clone();
            let handler = handler.clone();
            handles.push(crate::threads::spawn(format!("http-{n}"), move || {
                run_worker(&shared, &stop, &handler)
            })?);
        }
        Ok(HttpServer {
            stop,
            workers: handles,
        })
    }

    /// Stops the workers and joins them.
    pub fn stop(self) {
        self.stop.store(true, Ordering::Release);
        for handle in self.workers {
            crate::threads::join_logged("http", handle);
        }
    }
}

fn run_worker(shared: &Shared, stop: &AtomicBool, handler: &Handler) {
    while !stop.load(Ordering::Acquire) {
        let server = shared
            .current
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        match server.recv_timeout(Duration::from_millis(200)) {
            Ok(Some(request)) => serve(request, handler),
            Ok(None) => serve_retired(shared, handler),
            Err(_) => {
                // tiny_http's accept thread ended (idle accept timeout): start a fresh server on
                // the same listening socket, once; the old one keeps its connections.
                let mut current = shared.current.lock().unwrap_or_else(|e| e.into_inner());
                if Arc::ptr_eq(&current, &server) {
                    match new_server(&shared.listener) {
                        Ok(fresh) => {
                            let old = std::mem::replace(&mut *current, fresh);
                            drop(current);
                            shared
                                .retired
                                .lock()
                                .unwrap_or_else(|e| e.into_inner())
                                .push((old, crate::clock::instant()));
                        }
                        Err(e) => {
                            log::error!("orca_relay_http_restart_failed error={e}");
                            drop(current);
                            crate::clock::sleep(Duration::from_millis(100));
                        }
                    }
                }
            }
        }
    }
}

/// Serves what is waiting on retired servers (requests of connections they accepted), and
/// drops those that can have no connection left.
fn serve_retired(shared: &Shared, handler: &Handler) {
    let waiting: Vec<tiny_http::Request> = {
        let mut retired = shared.retired.lock().unwrap_or_else(|e| e.into_inner());
        let now = crate::clock::instant();
        let mut waiting = Vec::new();
        for (server, last_request) in retired.iter_mut() {
            while let Ok(Some(request)) = server.try_recv() {
                waiting.push(request);
                *last_request = now;
            }
        }
        retired.retain(|(_, last_request)| now.duration_since(*last_request) < RETIRED_SERVER_IDLE);
        waiting
    };
    for request in waiting {
        serve(request, handler);
    }
}

fn serve(mut request: tiny_http::Request, handler: &Handler) {
    let method = request.method().as_str().to_string();
    let url = request.url().to_string();
    let (path, query) = url.split_once('?').unwrap_or((&url, ""));
    let authorization = request
        .headers()
        .iter()
        .find(|h| h.field.equiv("Authorization"))
        .map(|h| h.value.as_str().to_string());
    let reply = {
        let mut view = Request {
            method: &method,
            path,
            query,
            authorization: authorization.as_deref(),
            inner: &mut request,
        };
        std::panic::catch_unwind(AssertUnwindSafe(|| handler(&mut view))).unwrap_or_else(|_| {
            log::error!("orca_relay_http_handler_panicked path={path}");
            Reply::error(500, "internal_error")
        })
    };
    let mut response = tiny_http::Response::from_string(reply.body)
        .with_status_code(reply.status)
        .with_header(content_type(reply.content_type));
    for (name, value) in reply.headers {
        if let Ok(header) = tiny_http::Header::from_bytes(name.as_bytes(), value.as_bytes()) {
            response = response.with_header(header);
        }
    }
    let _ = request.respond(response);
}

fn content_type(value: &str) -> tiny_http::Header {
    tiny_http::Header::from_bytes(&b"Content-Type"[..], value.as_bytes()).unwrap_or_else(|_| {
        tiny_http::Header::from_bytes(&b"X-Bad"[..], &b"1"[..]).expect("static header")
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bearer_compare() {
        assert!(bearer_matches(Some("Bearer s3cret"), "s3cret"));
        assert!(!bearer_matches(Some("Bearer s3cre"), "s3cret"));
        assert!(!bearer_matches(Some("s3cret"), "s3cret"));
        assert!(!bearer_matches(None, "s3cret"));
    }
}
