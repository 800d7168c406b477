//! The HTTP/1.1 server of every role: one `http-acceptor` thread and one `http-<n>` thread per
//! open connection, on `httparse`. A thread whose connection has ended waits up to 10 s as a
//! spare (at most 64 of them) and takes the next connection the acceptor hands it, so a burst of
//! connections costs few thread creations (measured by `cargo bench --bench http_edge`: /health
//! p99 under attack went from ~40 ms to under 10 ms on a 2-core machine).
//!
//! Why not `tiny_http` (the design card's choice): 0.12 cannot put a deadline on a connection
//! (there is no hook for accepted sockets, so the only tool was a receive timeout on every read
//! of every connection) and its accept thread ends for good on the listener's timeout. Measured
//! on the combined role before this server: a request on a reused connection went unanswered
//! for 10 s whenever a fresh server had to be started (2 of 30 at one a second), the feed
//! poller timed out the same way (12 of 213 polls), a head trickled one line every 4 s stayed
//! open past 24 s, and idle keep-alive connections closed at 10 s instead of 30 s.
//!
//! What a connection goes through:
//! - **Admission.** The acceptor admits every connection into the [`ConnectionTable`]
//!   (`ORCA_RELAY_HTTP_CONNECTIONS_MAX` entries). When it is full, the connection that has
//!   waited longest for a request head is shed; when every entry is busy serving a request,
//!   the newcomer gets a 503 and is closed. Both are counted, neither is an abort. A thread
//!   that cannot be spawned is a counted refusal too.
//! - **Head.** The whole head within [`HEAD_DEADLINE`] (10 s, SPEC §5.4) from the connection's
//!   acceptance or, on a kept-alive connection, from the first byte of that request; not per
//!   read. A partial head at the deadline gets 408, a request line over [`head::MAX_HEAD_BYTES`]
//!   414, an oversized head 431, a malformed one 400. RFC 9112 §3.2: an HTTP/1.1 request
//!   without exactly one `Host` is 400; a target that starts with `/` is origin form (the path
//!   runs to the first `?`, whatever the query holds), any other is parsed as absolute form
//!   (scheme, authority, path) or refused with 400 (`head::split_target`).
//! - **Body.** `Content-Length` only, read by the handler through [`Request::body`] under its
//!   limit (a longer declared body is 413 without reading it) within [`BODY_DEADLINE`]. While
//!   body bytes are awaited the connection *waits* in the table, so a client that withholds its
//!   body can be shed like a stalled head. `Transfer-Encoding` is refused with 411 and the
//!   connection closed: every caller of this API (directors, cells, `client host`) sends a
//!   length, and a chunked decoder is more input surface for nothing. `Expect: 100-continue` is
//!   honoured on HTTP/1.1 when the handler reads the body, and ignored on HTTP/1.0.
//! - **Unread body.** The answer is written first (RFC 9112 §9.3 lets a server answer before the
//!   body; waiting for it would let a client that withholds it hold the answer and the entry);
//!   then at most [`DISCARD_MAX`] unread bytes are read and dropped within [`DISCARD_DEADLINE`]
//!   (1 s), waiting and sheddable, to keep the connection; a larger body, one still owed a
//!   `100 Continue`, or one that does not arrive in time closes it.
//! - **Answer.** Every request that arrives on a live connection is answered (a panicking
//!   handler is a 500) or its connection closed; a write has [`WRITE_DEADLINE`].
//!
//! Nothing here logs per connection: closes, sheds and refusals are counters
//! (`orca_relay_http_*`), so an attack does not become a log flood. `EINTR` is retried on
//! every accept, read and write.

use std::net::{Shutdown, TcpListener, TcpStream};
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::head::{self, Head, HeadError, HeadReader};
use super::table::{Admission, ConnectionTable, Ticket};
use super::{BodyError, BodySource, Handler, Reply, Request};
use crate::clock;
use crate::config::Config;
use crate::metrics::{Counter, Registry};

/// The whole request head must arrive within this (SPEC §5.4).
pub const HEAD_DEADLINE: Duration = Duration::from_secs(10);
/// The whole body must arrive within this once the head has.
pub const BODY_DEADLINE: Duration = Duration::from_secs(10);
/// An answer must be written within this.
pub const WRITE_DEADLINE: Duration = Duration::from_secs(10);
/// After an answer that closes the connection, what the client still sends is read and dropped
/// for at most this long, so the close does not become a reset that hides the answer.
const CLOSE_LINGER: Duration = Duration::from_millis(500);
/// An unread body up to this size is read and dropped, after the answer, to keep the
/// connection; a larger one closes it.
const DISCARD_MAX: usize = 64 * 1024;
/// How long the rest of an unread body has to arrive after the answer before the connection is
/// closed instead: short, because the client already has its answer and the connection is only
/// worth keeping if the body is on its way.
const DISCARD_DEADLINE: Duration = Duration::from_secs(1);
/// Connection threads run the handlers (JWT checks, SQL, booking calls over HTTPS). Only the
/// pages a thread touches are resident.
const CONNECTION_STACK_BYTES: usize = 512 * 1024;
/// Threads whose connection ended that wait for another, at most, and for how long.
const SPARES_MAX: usize = 64;
const SPARE_WAIT: Duration = Duration::from_secs(10);
/// How long `stop` waits for connections that are still being served.
const STOP_WAIT: Duration = Duration::from_secs(5);
/// The accept queue asked of the kernel (capped by `net.core.somaxconn`): std's 128 overflows
/// when a few hundred clients connect at once, and an overflowed SYN waits a second to retry.
pub const LISTEN_BACKLOG: i32 = 4096;

/// Raises a bound listener's accept queue to [`LISTEN_BACKLOG`] (`listen` again on a
/// listening socket only changes its backlog).
pub fn raise_backlog(listener: &TcpListener) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    // SAFETY: listen(2) on a descriptor we own; it only changes the queue length.
    if unsafe { libc::listen(listener.as_raw_fd(), LISTEN_BACKLOG) } == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// The listener's limits.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HttpSettings {
    /// An idle keep-alive connection is closed after this (`ORCA_RELAY_HTTP_IDLE_MS`).
    pub idle: Duration,
    /// Open connections at most (`ORCA_RELAY_HTTP_CONNECTIONS_MAX`).
    pub connections_max: usize,
}

impl HttpSettings {
    pub fn from_config(config: &Config) -> HttpSettings {
        HttpSettings {
            idle: Duration::from_millis(config.http_idle_ms),
            connections_max: config.http_connections_max as usize,
        }
    }
}

impl Default for HttpSettings {
    fn default() -> Self {
        HttpSettings {
            idle: Duration::from_secs(30),
            connections_max: 1024,
        }
    }
}

/// Counters of the HTTP listener.
struct HttpMetrics {
    refused_full: Counter,
    refused_thread: Counter,
    shed: Counter,
    accept_failures: Counter,
    handler_panics: Counter,
    close_idle: Counter,
    close_head_timeout: Counter,
    close_head_too_large: Counter,
    close_malformed: Counter,
    close_body_framing: Counter,
    close_body: Counter,
    close_body_withheld: Counter,
}

impl HttpMetrics {
    fn new(registry: &Registry, table: &Arc<ConnectionTable>) -> HttpMetrics {
        let refused = |reason| {
            registry.counter(
                "orca_relay_http_connections_refused_total",
                "HTTP connections refused at accept, by reason.",
                &[("reason", reason)],
            )
        };
        let closed = |reason| {
            registry.counter(
                "orca_relay_http_closes_total",
                "HTTP connections the server closed before or between requests, by reason.",
                &[("reason", reason)],
            )
        };
        let sampled = table.clone();
        registry.sampled_gauge(
            "orca_relay_http_connections",
            "Open HTTP connections: waiting for a request head (or idle) and serving one.",
            move || {
                let (open, waiting) = (sampled.len(), sampled.waiting());
                let row = |state: &str, value: usize| {
                    (vec![("state".to_string(), state.to_string())], value as f64)
                };
                vec![
                    row("waiting", waiting),
                    row("serving", open.saturating_sub(waiting)),
                ]
            },
        );
        HttpMetrics {
            refused_full: refused("full"),
            refused_thread: refused("thread_spawn"),
            shed: registry.counter(
                "orca_relay_http_connections_shed_total",
                "HTTP connections waiting for a request head that were closed to admit a new one.",
                &[],
            ),
            accept_failures: registry.counter(
                "orca_relay_http_accept_failures_total",
                "Failed accepts on the HTTP listener (descriptor or memory exhaustion).",
                &[],
            ),
            handler_panics: registry.counter(
                "orca_relay_http_handler_panics_total",
                "HTTP handlers that panicked (answered 500).",
                &[],
            ),
            close_idle: closed("idle"),
            close_head_timeout: closed("head_timeout"),
            close_head_too_large: closed("head_too_large"),
            close_malformed: closed("malformed"),
            close_body_framing: closed("body_framing"),
            close_body: closed("body_unreadable"),
            close_body_withheld: closed("body_withheld"),
        }
    }
}

struct Shared {
    handler: Handler,
    spares: Spares,
    table: Arc<ConnectionTable>,
    idle: Duration,
    stopping: AtomicBool,
    metrics: HttpMetrics,
    /// Connection threads alive (or about to be); `stop` waits for zero.
    live: Mutex<usize>,
    live_changed: Condvar,
}

/// Counts one connection thread from before it is spawned until its closure is dropped
/// (run to the end, or never run because the spawn failed).
struct Live(Arc<Shared>);

impl Live {
    fn new(shared: &Arc<Shared>) -> Live {
        *shared.live.lock().unwrap_or_else(|e| e.into_inner()) += 1;
        Live(shared.clone())
    }
}

impl Drop for Live {
    fn drop(&mut self) {
        let mut live = self.0.live.lock().unwrap_or_else(|e| e.into_inner());
        *live = live.saturating_sub(1);
        self.0.live_changed.notify_all();
    }
}

/// A running HTTP listener.
pub struct HttpServer {
    shared: Arc<Shared>,
    /// Wakes the acceptor out of its wait to stop it. (Not `shutdown(2)` on the listener: a
    /// live handover's next process, or a systemd socket unit, shares it.)
    wake: Arc<crate::wake::Wake>,
    /// `None` once the acceptor has stopped. A critical thread: stood down before it stops.
    acceptor: Option<(JoinHandle<()>, crate::liveness::Standing)>,
}

impl HttpServer {
    /// Serves `handler` on `listener`; the `http-acceptor` is a critical thread of `liveness`.
    pub fn start(
        listener: TcpListener,
        settings: HttpSettings,
        handler: Handler,
        registry: &Registry,
        liveness: &crate::liveness::Liveness,
    ) -> std::io::Result<HttpServer> {
        // The acceptor waits in `poll` beside its wake; the accept itself never blocks.
        listener.set_nonblocking(true)?;
        let _ = raise_backlog(&listener);
        let wake = crate::wake::Wake::new()?;
        let table = ConnectionTable::new(settings.connections_max);
        let shared = Arc::new(Shared {
            handler,
            spares: Spares::default(),
            metrics: HttpMetrics::new(registry, &table),
            table,
            idle: settings.idle,
            stopping: AtomicBool::new(false),
            live: Mutex::new(0),
            live_changed: Condvar::new(),
        });
        let acceptor = {
            let shared = shared.clone();
            let wake = wake.clone();
            liveness.spawn_critical("http-acceptor", crate::liveness::BEAT_PERIOD, move |beat| {
                run_acceptor(listener, shared, &wake, &beat)
            })?
        };
        Ok(HttpServer {
            shared,
            wake,
            acceptor: Some(acceptor),
        })
    }

    /// Stops accepting, closes waiting and idle connections, lets requests being served finish
    /// (their answers say `Connection: close`), and joins: the acceptor, then every connection
    /// thread (for at most [`STOP_WAIT`]).
    pub fn stop(self) {
        self.stop_closing(false);
    }

    /// As [`HttpServer::stop`], except that, when another process goes on accepting on the
    /// listener (`shared`: a live handover's next process, a socket unit), a connection still
    /// waiting for its first request head is served, not closed: its client chose this process
    /// by chance. A `systemctl restart` under the socket units once answered a `/ready` with
    /// nothing: the old process closed a connection it had accepted before reading its head.
    pub fn stop_shared(self, shared: bool) {
        self.stop_closing(shared);
    }

    /// Stops accepting (the acceptor returns at once and closes its listener: the port stops
    /// taking connections unless another process holds it too, a live handover's next process
    /// or a socket unit, which then goes on accepting). Connections already accepted are
    /// served on.
    pub fn stop_accepting(&mut self) {
        self.shared.stopping.store(true, Ordering::Release);
        if let Some((acceptor, standing)) = self.acceptor.take() {
            standing.stand_down();
            self.wake.set();
            crate::threads::join_logged("http-acceptor", acceptor);
        }
    }

    fn stop_closing(mut self, serve_fresh: bool) {
        self.stop_accepting();
        if serve_fresh {
            self.shared.table.close_idle();
        } else {
            self.shared.table.close();
        }
        self.shared.spares.stop();
        let deadline = clock::instant() + STOP_WAIT;
        let mut live = self.shared.live.lock().unwrap_or_else(|e| e.into_inner());
        while *live > 0 {
            let left = deadline.saturating_duration_since(clock::instant());
            if left.is_zero() {
                log::warn!("orca_relay_http_stop_incomplete connections={}", *live);
                return;
            }
            live = self
                .shared
                .live_changed
                .wait_timeout(live, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }
}

/// Whether an accept error concerns only the connection being accepted (the next accept can
/// succeed at once).
pub fn accept_error_is_per_connection(error: &std::io::Error) -> bool {
    use std::io::ErrorKind;
    matches!(
        error.kind(),
        ErrorKind::Interrupted | ErrorKind::ConnectionAborted | ErrorKind::ConnectionReset
    ) || matches!(error.raw_os_error(), Some(libc::EPROTO) | Some(libc::EPERM))
}

fn run_acceptor(
    listener: TcpListener,
    shared: Arc<Shared>,
    wake: &crate::wake::Wake,
    beat: &crate::liveness::Beat,
) {
    static NEXT_THREAD: AtomicU64 = AtomicU64::new(1);
    // Resource exhaustion is logged once per run of failures, not per attempt.
    let mut accept_failing = false;
    let mut spawn_failing = false;
    loop {
        // A critical thread: it beats once a turn and waits at most a beat period.
        beat.beat();
        match crate::wake::wait_acceptable_within(&listener, wake, crate::liveness::BEAT_PERIOD) {
            crate::wake::Acceptable::Yes => {}
            crate::wake::Acceptable::NotYet => continue,
            crate::wake::Acceptable::Stopped => return,
        }
        let stream = match listener.accept() {
            Ok((stream, _)) => {
                let _ = stream.set_nonblocking(false);
                stream
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
            Err(e) if accept_error_is_per_connection(&e) => continue,
            Err(e) => {
                if shared.stopping.load(Ordering::Acquire) {
                    return;
                }
                shared.metrics.accept_failures.inc();
                if !accept_failing {
                    log::warn!("orca_relay_http_accept_failed error={e}");
                    accept_failing = true;
                }
                // EMFILE and friends: back off briefly instead of spinning.
                clock::sleep(Duration::from_millis(50));
                continue;
            }
        };
        // A connection accepted is served, even while stopping: with a shared listener (a
        // live handover) dropping it would fail a request the other process would have served.
        if accept_failing {
            log::info!("orca_relay_http_accept_recovered");
            accept_failing = false;
        }
        let accepted = clock::instant();
        let _ = stream.set_nodelay(true);
        let stream = Arc::new(stream);
        let ticket = match shared.table.admit(&stream) {
            Admission::Admitted { ticket, shed } => {
                if shed {
                    shared.metrics.shed.inc();
                }
                ticket
            }
            Admission::Full => {
                shared.metrics.refused_full.inc();
                refuse_at_once(&stream);
                continue;
            }
        };
        let job = Job {
            stream,
            ticket,
            accepted,
        };
        // A spare thread takes it if one is waiting; otherwise a new thread.
        let Err(job) = shared.spares.hand_off(job) else {
            continue;
        };
        let id = NEXT_THREAD.fetch_add(1, Ordering::Relaxed);
        let live = Live::new(&shared);
        let thread_shared = shared.clone();
        let spawned = crate::threads::spawn_with_stack(
            format!("http-{id}"),
            CONNECTION_STACK_BYTES,
            move || {
                let _live = live;
                run_connection_thread(&thread_shared, job);
            },
        );
        match spawned {
            // Connection threads are joined through `Live`, not their handles.
            Ok(_) => spawn_failing = false,
            Err(e) => {
                // The closure (ticket, stream, live count) was dropped: the connection is closed.
                shared.metrics.refused_thread.inc();
                if !spawn_failing {
                    log::warn!("orca_relay_http_thread_spawn_failed error={e}");
                    spawn_failing = true;
                }
            }
        }
    }
}

/// One accepted connection on its way to a thread.
struct Job {
    stream: Arc<TcpStream>,
    ticket: Ticket,
    accepted: Instant,
}

/// Connection threads whose connection has ended wait here (at most [`SPARES_MAX`] of them, each
/// for at most [`SPARE_WAIT`]) for the next one, so a burst of connections mostly skips thread
/// creation. Still one connection per thread at a time.
#[derive(Default)]
struct Spares {
    state: Mutex<SpareState>,
    wake: Condvar,
}

#[derive(Default)]
struct SpareState {
    jobs: std::collections::VecDeque<Job>,
    idle: usize,
    stopping: bool,
}

impl Spares {
    fn lock(&self) -> std::sync::MutexGuard<'_, SpareState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Gives `job` to a waiting spare thread, or hands it back when none is free.
    fn hand_off(&self, job: Job) -> Result<(), Job> {
        let mut state = self.lock();
        if state.idle > state.jobs.len() && !state.stopping {
            state.jobs.push_back(job);
            self.wake.notify_one();
            Ok(())
        } else {
            Err(job)
        }
    }

    /// The next connection for a thread whose connection ended; `None`: the thread ends.
    fn next_job(&self) -> Option<Job> {
        let mut state = self.lock();
        if state.idle >= SPARES_MAX || state.stopping {
            return None;
        }
        state.idle += 1;
        let deadline = clock::instant() + SPARE_WAIT;
        loop {
            // Jobs first: one handed off is always taken, even by a thread about to leave.
            if let Some(job) = state.jobs.pop_front() {
                state.idle -= 1;
                return Some(job);
            }
            let left = deadline.saturating_duration_since(clock::instant());
            if left.is_zero() || state.stopping {
                state.idle -= 1;
                return None;
            }
            state = self
                .wake
                .wait_timeout(state, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    fn stop(&self) {
        self.lock().stopping = true;
        self.wake.notify_all();
    }
}

/// A connection thread: its first connection, then others handed to it while it is a spare.
fn run_connection_thread(shared: &Shared, first: Job) {
    let mut job = first;
    loop {
        serve_connection(shared, &job.stream, &job.ticket, job.accepted);
        drop(job);
        match shared.spares.next_job() {
            Some(next) => job = next,
            None => return,
        }
    }
}

/// The 503 for a connection refused at accept, written without blocking the acceptor (it
/// fits in a fresh socket's send buffer).
fn refuse_at_once(stream: &TcpStream) {
    use std::io::{Read, Write};
    let _ = stream.set_nonblocking(true);
    // Whatever of the request is already here is read, so the close is not a reset.
    let mut sink = [0u8; 4096];
    while matches!((&*stream).read(&mut sink), Ok(n) if n > 0) {}
    let _ = (&*stream).write(&render(
        &Reply::error(503, "http_connections_full").with_header("Retry-After", "1"),
        false,
        Connection::Close,
    ));
    let _ = stream.shutdown(Shutdown::Write);
}

/// How a request's exchange ended.
enum Outcome {
    KeepAlive,
    /// Answered; the connection closes (after a short linger).
    Close,
    /// The connection is unusable (a write failed).
    Gone,
}

fn serve_connection(shared: &Shared, stream: &TcpStream, ticket: &Ticket, accepted: Instant) {
    let mut reader = HeadReader::new();
    let mut head_deadline = accepted + HEAD_DEADLINE;
    loop {
        let head = match reader.read_head(stream, head_deadline) {
            Ok(head) => head,
            Err(error) => return close_without_request(shared, stream, error),
        };
        if !ticket.hold() {
            // Shed while its head arrived: the socket is already shut down.
            return;
        }
        match serve_request(shared, stream, ticket, &mut reader, head) {
            Outcome::KeepAlive => {}
            Outcome::Close => return linger_close(stream),
            Outcome::Gone => return,
        }
        if !ticket.wait() {
            return;
        }
        match reader.wait_for_bytes(stream, clock::instant() + shared.idle) {
            Ok(()) => {}
            Err(HeadError::TimedOut { .. }) => {
                shared.metrics.close_idle.inc();
                let _ = stream.shutdown(Shutdown::Both);
                return;
            }
            Err(_) => return,
        }
        head_deadline = clock::instant() + HEAD_DEADLINE;
    }
}

/// A connection that ended before a whole head: answered where an answer helps.
fn close_without_request(shared: &Shared, stream: &TcpStream, error: HeadError) {
    let m = &shared.metrics;
    let reply = match error {
        HeadError::Closed => return,
        HeadError::TimedOut { partial: false } => {
            m.close_head_timeout.inc();
            return;
        }
        HeadError::TimedOut { partial: true } => {
            m.close_head_timeout.inc();
            let _ = head::write_all_by(
                stream,
                &render(
                    &Reply::error(408, "request_timeout"),
                    false,
                    Connection::Close,
                ),
                clock::instant() + Duration::from_secs(1),
            );
            let _ = stream.shutdown(Shutdown::Both);
            return;
        }
        HeadError::TooLarge => {
            m.close_head_too_large.inc();
            Reply::error(431, "request_head_too_large")
        }
        HeadError::LineTooLong => {
            m.close_head_too_large.inc();
            Reply::error(414, "request_line_too_long")
        }
        HeadError::Malformed => {
            m.close_malformed.inc();
            Reply::error(400, "malformed_request")
        }
    };
    if head::write_all_by(
        stream,
        &render(&reply, false, Connection::Close),
        clock::instant() + WRITE_DEADLINE,
    )
    .is_ok()
    {
        linger_close(stream);
    }
}

/// The body length a request declares, or the answer that refuses it.
fn body_length(head: &Head) -> Result<usize, Reply> {
    if head.header_values("transfer-encoding").next().is_some() {
        return Err(Reply::error(411, "length_required"));
    }
    let mut length: Option<usize> = None;
    for value in head.header_values("content-length") {
        let parsed = std::str::from_utf8(value)
            .ok()
            .map(str::trim)
            .filter(|v| !v.is_empty() && v.bytes().all(|b| b.is_ascii_digit()))
            .and_then(|v| v.parse::<usize>().ok());
        match (parsed, length) {
            (None, _) => return Err(Reply::error(400, "bad_content_length")),
            (Some(n), Some(previous)) if n != previous => {
                return Err(Reply::error(400, "bad_content_length"))
            }
            (Some(n), _) => length = Some(n),
        }
    }
    Ok(length.unwrap_or(0))
}

/// The body as a handler reads it, straight from the connection.
struct ConnectionBody<'s> {
    reader: &'s mut HeadReader,
    stream: &'s TcpStream,
    /// The connection's entry: it *waits* (sheddable, like a stalled head) while body bytes are
    /// awaited, and is held again once they are in.
    ticket: &'s Ticket,
    remaining: usize,
    deadline: Instant,
    /// `Expect: 100-continue` was sent (on HTTP/1.1) and no interim answer yet.
    continue_owed: bool,
    /// A read failed part-way (or the connection was shed while waiting): it cannot be reused.
    broken: bool,
    /// Refused as too large: it is never read, so the connection closes after the answer.
    refused: bool,
}

impl BodySource for ConnectionBody<'_> {
    fn read_body(&mut self, limit: usize) -> Result<Vec<u8>, BodyError> {
        if self.remaining > limit {
            self.refused = true;
            return Err(BodyError::TooLarge);
        }
        if self.broken {
            return Err(BodyError::Unreadable);
        }
        if self.continue_owed {
            self.continue_owed = false;
            if head::write_all_by(self.stream, b"HTTP/1.1 100 Continue\r\n\r\n", self.deadline)
                .is_err()
            {
                self.broken = true;
                return Err(BodyError::Unreadable);
            }
        }
        let mut body = Vec::with_capacity(self.remaining);
        // A client that withholds its body must not hold an entry the table cannot shed: while
        // the bytes are awaited the connection waits like a stalled head.
        let waiting = self.remaining > self.reader.buffered().len();
        if waiting && !self.ticket.wait() {
            self.broken = true;
            return Err(BodyError::Unreadable);
        }
        let read = self
            .reader
            .read_body(self.stream, self.remaining, self.deadline, &mut body);
        if read.is_err() || (waiting && !self.ticket.hold()) {
            self.broken = true;
            return Err(BodyError::Unreadable);
        }
        self.remaining = 0;
        Ok(body)
    }
}

/// Answers a request the server refuses before any handler sees it, and closes.
fn refuse_request(stream: &TcpStream, reply: Reply) -> Outcome {
    match head::write_all_by(
        stream,
        &render(&reply, false, Connection::Close),
        clock::instant() + WRITE_DEADLINE,
    ) {
        Ok(()) => Outcome::Close,
        Err(_) => Outcome::Gone,
    }
}

fn serve_request(
    shared: &Shared,
    stream: &TcpStream,
    ticket: &Ticket,
    reader: &mut HeadReader,
    head: Head,
) -> Outcome {
    let mut keep_alive = if head.minor_version >= 1 {
        !head.has_token("connection", "close")
    } else {
        head.has_token("connection", "keep-alive")
    };
    let http10_keep_alive = head.minor_version == 0 && keep_alive;
    // RFC 9112 §3.2: exactly one Host on HTTP/1.1; a target in origin or absolute form.
    if let Err(reason) = head.host_rule() {
        shared.metrics.close_malformed.inc();
        return refuse_request(stream, Reply::error(400, reason));
    }
    let Some((path, query)) = head.path_and_query() else {
        shared.metrics.close_malformed.inc();
        return refuse_request(stream, Reply::error(400, "bad_request_target"));
    };
    let length = match body_length(&head) {
        Ok(length) => length,
        Err(reply) => {
            shared.metrics.close_body_framing.inc();
            return refuse_request(stream, reply);
        }
    };
    let head_only = head.method == "HEAD";
    let method = if head_only {
        "GET"
    } else {
        head.method.as_str()
    };
    let authorization = head.header("authorization");
    let mut body = ConnectionBody {
        reader,
        stream,
        ticket,
        remaining: length,
        deadline: clock::instant() + BODY_DEADLINE,
        // `Expect` is an HTTP/1.1 field: an HTTP/1.0 client gets no interim answer (RFC 9110
        // §10.1.1).
        continue_owed: length > 0
            && head.minor_version >= 1
            && head
                .header("expect")
                .is_some_and(|v| v.eq_ignore_ascii_case("100-continue")),
        broken: false,
        refused: false,
    };
    let reply = {
        let mut request = Request::new(method, path, query, authorization, &mut body);
        let handler = &shared.handler;
        std::panic::catch_unwind(AssertUnwindSafe(|| handler(&mut request))).unwrap_or_else(|_| {
            shared.metrics.handler_panics.inc();
            log::error!("orca_relay_http_handler_panicked path={path}");
            Reply::error(500, "internal_error")
        })
    };
    // A body the handler did not read is dropped after the answer (never before it: a client
    // that withholds it would otherwise hold the answer and the entry), and only if it is small
    // and the client is not waiting for a 100 first; else the connection closes.
    let unread = body.remaining;
    if body.broken {
        shared.metrics.close_body.inc();
        keep_alive = false;
    } else if body.refused || (unread > 0 && (body.continue_owed || unread > DISCARD_MAX)) {
        keep_alive = false;
    }
    if shared.stopping.load(Ordering::Acquire) {
        keep_alive = false;
    }
    let connection = match (keep_alive, http10_keep_alive) {
        (false, _) => Connection::Close,
        (true, true) => Connection::KeepAlive,
        (true, false) => Connection::Default,
    };
    if head::write_all_by(
        stream,
        &render(&reply, head_only, connection),
        clock::instant() + WRITE_DEADLINE,
    )
    .is_err()
    {
        return Outcome::Gone;
    }
    if !keep_alive {
        return Outcome::Close;
    }
    if unread > 0 {
        // The rest of the body gets a short while, waiting (sheddable) like an idle connection.
        if !ticket.wait() {
            return Outcome::Gone;
        }
        let discarded =
            body.reader
                .discard_body(stream, unread, clock::instant() + DISCARD_DEADLINE);
        if discarded.is_err() {
            shared.metrics.close_body_withheld.inc();
            return Outcome::Close;
        }
    }
    Outcome::KeepAlive
}

/// Closes after an answer: our side first (FIN after the answer), then reads and drops what the
/// client still sends for at most [`CLOSE_LINGER`], so our close does not reset the connection
/// before the client has read the answer.
fn linger_close(stream: &TcpStream) {
    let _ = stream.shutdown(Shutdown::Write);
    let deadline = clock::instant() + CLOSE_LINGER;
    let mut sink = [0u8; 4096];
    let mut drained = 0;
    while drained < DISCARD_MAX {
        match head::read_by(stream, &mut sink, deadline) {
            Ok(0) | Err(_) => return,
            Ok(n) => drained += n,
        }
    }
}

/// The `Connection` header of an answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Connection {
    /// HTTP/1.1 keeps the connection without saying so.
    Default,
    /// An HTTP/1.0 client asked to keep it.
    KeepAlive,
    Close,
}

fn reason_phrase(status: u16) -> &'static str {
    match status {
        200 => "OK",
        201 => "Created",
        202 => "Accepted",
        204 => "No Content",
        400 => "Bad Request",
        401 => "Unauthorized",
        403 => "Forbidden",
        404 => "Not Found",
        405 => "Method Not Allowed",
        408 => "Request Timeout",
        414 => "URI Too Long",
        409 => "Conflict",
        411 => "Length Required",
        413 => "Content Too Large",
        429 => "Too Many Requests",
        431 => "Request Header Fields Too Large",
        500 => "Internal Server Error",
        502 => "Bad Gateway",
        503 => "Service Unavailable",
        504 => "Gateway Timeout",
        _ => "Status",
    }
}

/// Headers the server writes itself; a handler's copy is dropped.
const SERVER_HEADERS: [&str; 4] = [
    "content-length",
    "content-type",
    "connection",
    "transfer-encoding",
];

/// The answer's bytes: status line, headers, and the body unless `head_only`.
fn render(reply: &Reply, head_only: bool, connection: Connection) -> Vec<u8> {
    use std::fmt::Write;
    let mut out = String::with_capacity(128 + reply.body.len());
    let _ = write!(
        out,
        "HTTP/1.1 {} {}\r\nContent-Type: {}\r\nContent-Length: {}\r\n",
        reply.status,
        reason_phrase(reply.status),
        reply.content_type,
        reply.body.len()
    );
    for (name, value) in &reply.headers {
        let forbidden = SERVER_HEADERS.iter().any(|h| name.eq_ignore_ascii_case(h));
        let unsafe_text = |text: &str| text.bytes().any(|b| b == b'\r' || b == b'\n');
        if !forbidden && !unsafe_text(name) && !unsafe_text(value) {
            let _ = write!(out, "{name}: {value}\r\n");
        }
    }
    match connection {
        Connection::Default => {}
        Connection::KeepAlive => out.push_str("Connection: keep-alive\r\n"),
        Connection::Close => out.push_str("Connection: close\r\n"),
    }
    out.push_str("\r\n");
    if !head_only {
        out.push_str(&reply.body);
    }
    out.into_bytes()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::net::SocketAddr;

    /// A server on 127.0.0.1:0 with a handler that echoes what it saw, reads bodies under
    /// 16 bytes on `/small`, panics on `/panic`, holds `/gate` until the fixture's gate opens,
    /// and ignores the body elsewhere.
    struct Fixture {
        addr: SocketAddr,
        server: Option<HttpServer>,
        registry: Registry,
        gate: Arc<(Mutex<bool>, Condvar)>,
    }

    impl Fixture {
        fn start(settings: HttpSettings) -> Fixture {
            let listener = TcpListener::bind("127.0.0.1:0").unwrap();
            let addr = listener.local_addr().unwrap();
            let registry = Registry::new();
            let gate: Arc<(Mutex<bool>, Condvar)> = Arc::default();
            let handler_gate = gate.clone();
            let handler: Handler = Arc::new(move |request: &mut Request<'_>| match request.path {
                "/panic" => panic!("handler panic on purpose"),
                "/gate" => {
                    let (open, changed) = &*handler_gate;
                    let mut open = open.lock().unwrap();
                    while !*open {
                        open = changed.wait(open).unwrap();
                    }
                    Reply::text(200, "through")
                }
                "/small" => match request.body(16) {
                    Ok(body) => Reply::text(200, String::from_utf8_lossy(&body).into_owned()),
                    Err(BodyError::TooLarge) => Reply::error(413, "body_too_large"),
                    Err(BodyError::Unreadable) => Reply::error(400, "unreadable_body"),
                },
                _ => Reply::text(
                    200,
                    format!(
                        "{} {} {} {}",
                        request.method,
                        request.path,
                        request.query,
                        request.authorization.unwrap_or("-")
                    ),
                )
                .with_header("X-Injected", "a\r\nX-Evil: 1"),
            });
            let liveness = crate::liveness::Liveness::detached(crate::clock::system());
            let server =
                HttpServer::start(listener, settings, handler, &registry, &liveness).unwrap();
            Fixture {
                addr,
                server: Some(server),
                registry,
                gate,
            }
        }

        fn open_gate(&self) {
            *self.gate.0.lock().unwrap() = true;
            self.gate.1.notify_all();
        }

        /// Waits until the table holds `waiting` waiting entries.
        fn wait_for_waiting(&self, waiting: usize) -> bool {
            let table = &self.server.as_ref().unwrap().shared.table;
            let until = crate::clock::instant() + Duration::from_secs(5);
            while table.waiting() != waiting && crate::clock::instant() < until {
                crate::clock::sleep(Duration::from_millis(5));
            }
            table.waiting() == waiting
        }

        /// Waits until the table holds `len` connections: a client sees its answer's close a
        /// moment before the server's thread gives the connection's entry back.
        fn wait_for_len(&self, len: usize) -> bool {
            let table = &self.server.as_ref().unwrap().shared.table;
            let until = crate::clock::instant() + Duration::from_secs(5);
            while table.len() != len && crate::clock::instant() < until {
                crate::clock::sleep(Duration::from_millis(5));
            }
            table.len() == len
        }

        fn connect(&self) -> TcpStream {
            let stream = TcpStream::connect(self.addr).unwrap();
            stream
                .set_read_timeout(Some(Duration::from_secs(5)))
                .unwrap();
            stream
        }

        fn counter(&self, line: &str) -> u64 {
            self.registry
                .render()
                .lines()
                .find_map(|l| l.strip_prefix(line)?.strip_prefix(' ')?.parse().ok())
                .unwrap_or(0)
        }
    }

    impl Drop for Fixture {
        fn drop(&mut self) {
            self.open_gate();
            if let Some(server) = self.server.take() {
                server.stop();
            }
        }
    }

    /// Reads everything until the server closes.
    fn read_to_close(stream: &mut TcpStream) -> String {
        let mut out = Vec::new();
        let _ = stream.take(1 << 20).read_to_end(&mut out);
        String::from_utf8_lossy(&out).into_owned()
    }

    /// Sends `requests` on one connection, then `Connection: close` last, and returns the text.
    fn exchange(fixture: &Fixture, bytes: &[u8]) -> String {
        let mut stream = fixture.connect();
        stream.write_all(bytes).unwrap();
        read_to_close(&mut stream)
    }

    #[test]
    fn keep_alive_pipelining_head_and_http_1_0() {
        let fixture = Fixture::start(HttpSettings::default());
        let text = exchange(
            &fixture,
            b"GET /a?x=1 HTTP/1.1\r\nHost: h\r\nAuthorization: Bearer t\r\n\r\n\
              HEAD /b HTTP/1.1\r\nHost: h\r\n\r\n\
              GET /c HTTP/1.1\r\nHost: h\r\nConnection: close\r\n\r\n",
        );
        let answers: Vec<&str> = text.split("HTTP/1.1 ").skip(1).collect();
        assert_eq!(answers.len(), 3, "{text}");
        assert!(
            answers[0].ends_with("GET /a x=1 Bearer t"),
            "{}",
            answers[0]
        );
        assert!(!answers[0].contains("Connection:"));
        // HEAD: GET's headers and length, no body.
        assert!(
            answers[1].contains("Content-Length: 9\r\n"),
            "{}",
            answers[1]
        );
        assert!(answers[1].ends_with("\r\n\r\n"), "{}", answers[1]);
        assert!(answers[2].contains("Connection: close\r\n"));
        // A handler cannot inject headers.
        assert!(!text.contains("X-Evil"));
        // HTTP/1.0 closes unless asked to keep alive.
        let text = exchange(&fixture, b"GET /d HTTP/1.0\r\n\r\nGET /e HTTP/1.0\r\n\r\n");
        assert_eq!(text.matches("HTTP/1.1 200").count(), 1, "{text}");
        assert!(text.contains("Connection: close"));
        let text = exchange(
            &fixture,
            b"GET /d HTTP/1.0\r\nConnection: keep-alive\r\n\r\nGET /e HTTP/1.0\r\n\r\n",
        );
        assert_eq!(text.matches("HTTP/1.1 200").count(), 2, "{text}");
        assert!(text.contains("Connection: keep-alive"));
    }

    #[test]
    fn bodies_by_length_and_refusals() {
        let fixture = Fixture::start(HttpSettings::default());
        // Read by the handler; an unread small body is dropped and the connection kept.
        let text = exchange(
            &fixture,
            b"POST /small HTTP/1.1\r\nHost: h\r\nContent-Length: 5\r\n\r\nhello\
              POST /other HTTP/1.1\r\nHost: h\r\nContent-Length: 3\r\n\r\nabc\
              GET /last HTTP/1.1\r\nHost: h\r\nConnection: close\r\n\r\n",
        );
        assert_eq!(text.matches("HTTP/1.1 200").count(), 3, "{text}");
        assert!(text.contains("\r\n\r\nhello"));
        // Over the handler's limit: 413 without reading, then the connection closes.
        let text = exchange(
            &fixture,
            b"POST /small HTTP/1.1\r\nHost: h\r\nContent-Length: 17\r\n\r\n01234567890123456",
        );
        assert!(text.starts_with("HTTP/1.1 413 "), "{text}");
        assert!(text.contains("Connection: close"));
        // Transfer-Encoding is refused with 411 and the connection closed.
        let text = exchange(
            &fixture,
            b"POST /small HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
        );
        assert!(text.starts_with("HTTP/1.1 411 "), "{text}");
        assert_eq!(text.matches("HTTP/1.1").count(), 1);
        // Bad and conflicting lengths.
        for bad in [
            "Content-Length: x1\r\n",
            "Content-Length: 1\r\nContent-Length: 2\r\n",
        ] {
            let text = exchange(
                &fixture,
                format!("POST /small HTTP/1.1\r\nHost: h\r\n{bad}\r\nab").as_bytes(),
            );
            assert!(text.starts_with("HTTP/1.1 400 "), "{bad}: {text}");
        }
        // Malformed and oversized heads.
        let text = exchange(&fixture, b"BLAH\r\n\r\n");
        assert!(text.starts_with("HTTP/1.1 400 "), "{text}");
        let mut huge = b"GET / HTTP/1.1\r\nHost: h\r\nX: ".to_vec();
        huge.extend(std::iter::repeat_n(b'a', head::MAX_HEAD_BYTES));
        let text = exchange(&fixture, &huge);
        assert!(text.starts_with("HTTP/1.1 431 "), "{text}");
        assert_eq!(
            fixture.counter("orca_relay_http_closes_total{reason=\"body_framing\"}"),
            3
        );
    }

    #[test]
    fn expect_continue_is_answered_when_the_handler_reads() {
        let fixture = Fixture::start(HttpSettings::default());
        let mut stream = fixture.connect();
        stream
            .write_all(b"POST /small HTTP/1.1\r\nHost: h\r\nContent-Length: 2\r\nExpect: 100-continue\r\n\r\n")
            .unwrap();
        let mut interim = [0u8; 25];
        stream.read_exact(&mut interim).unwrap();
        assert_eq!(&interim, b"HTTP/1.1 100 Continue\r\n\r\n");
        stream.write_all(b"ok").unwrap();
        let mut answer = [0u8; 12];
        stream.read_exact(&mut answer).unwrap();
        assert_eq!(&answer, b"HTTP/1.1 200");
    }

    #[test]
    fn a_panicking_handler_is_a_500_and_the_server_lives_on() {
        let fixture = Fixture::start(HttpSettings::default());
        let text = exchange(
            &fixture,
            b"GET /panic HTTP/1.1\r\nHost: h\r\n\r\nGET /fine HTTP/1.1\r\nHost: h\r\nConnection: close\r\n\r\n",
        );
        assert!(text.starts_with("HTTP/1.1 500 "), "{text}");
        assert!(text.contains("GET /fine"), "{text}");
        assert_eq!(fixture.counter("orca_relay_http_handler_panics_total"), 1);
    }

    #[test]
    fn a_full_table_sheds_waiting_heads_and_refuses_when_every_connection_is_busy() {
        let fixture = Fixture::start(HttpSettings {
            idle: Duration::from_secs(30),
            connections_max: 2,
        });
        // Two stalled heads fill the table; a third client is served by shedding the oldest.
        let mut stalled: Vec<TcpStream> = (0..2)
            .map(|_| {
                let mut stream = fixture.connect();
                stream.write_all(b"GET / HTTP/1.1\r\nHost: h\r\n").unwrap();
                stream
            })
            .collect();
        let text = exchange(
            &fixture,
            b"GET /x HTTP/1.1\r\nHost: h\r\nConnection: close\r\n\r\n",
        );
        assert!(text.starts_with("HTTP/1.1 200 "), "{text}");
        assert_eq!(read_to_close(&mut stalled[0]), "", "the oldest was shed");
        assert_eq!(fixture.counter("orca_relay_http_connections_shed_total"), 1);
        assert!(
            fixture.wait_for_len(1),
            "only the second stalled head is left"
        );
        // A connection that withholds its body waits like a stalled head: it is shed too.
        let mut withholding = fixture.connect();
        withholding
            .write_all(b"POST /small HTTP/1.1\r\nHost: h\r\nContent-Length: 4\r\n\r\nab")
            .unwrap();
        assert!(fixture.wait_for_waiting(2));
        let text = exchange(
            &fixture,
            b"GET /x HTTP/1.1\r\nHost: h\r\nConnection: close\r\n\r\n",
        );
        assert!(text.starts_with("HTTP/1.1 200 "), "{text}");
        assert_eq!(fixture.counter("orca_relay_http_connections_shed_total"), 2);
        assert!(
            fixture.wait_for_len(1),
            "only the withholding connection is left"
        );
        // Two connections busy in a handler cannot be shed: the next one is refused.
        let mut busy: Vec<TcpStream> = (0..2)
            .map(|_| {
                let mut stream = fixture.connect();
                stream
                    .write_all(b"GET /gate HTTP/1.1\r\nHost: h\r\n\r\n")
                    .unwrap();
                stream
            })
            .collect();
        assert!(fixture.wait_for_waiting(0));
        let text = exchange(&fixture, b"GET /x HTTP/1.1\r\nHost: h\r\n\r\n");
        assert!(text.starts_with("HTTP/1.1 503 "), "{text}");
        assert_eq!(
            fixture.counter("orca_relay_http_connections_refused_total{reason=\"full\"}"),
            1
        );
        fixture.open_gate();
        for stream in &mut busy {
            let mut answer = [0u8; 12];
            stream.read_exact(&mut answer).unwrap();
            assert_eq!(&answer, b"HTTP/1.1 200");
        }
        let _ = read_to_close(&mut withholding);
    }

    #[test]
    fn the_answer_comes_before_an_unread_body_which_gets_a_short_while() {
        let fixture = Fixture::start(HttpSettings::default());
        // 3 of 10 declared bytes: answered at once, closed once the short wait is over.
        let mut stream = fixture.connect();
        let started = crate::clock::instant();
        stream
            .write_all(b"GET /x HTTP/1.1\r\nHost: h\r\nContent-Length: 10\r\n\r\nabc")
            .unwrap();
        let mut answer = [0u8; 12];
        stream.read_exact(&mut answer).unwrap();
        assert_eq!(&answer, b"HTTP/1.1 200");
        assert!(
            started.elapsed() < DISCARD_DEADLINE,
            "{:?}",
            started.elapsed()
        );
        let rest = read_to_close(&mut stream);
        assert!(!rest.contains("Connection: close"), "{rest}");
        assert!(started.elapsed() >= DISCARD_DEADLINE);
        assert_eq!(
            fixture.counter("orca_relay_http_closes_total{reason=\"body_withheld\"}"),
            1
        );
        // More than the discard bound: answered, and closed at once (the answer says so).
        let text = exchange(
            &fixture,
            b"GET /x HTTP/1.1\r\nHost: h\r\nContent-Length: 1000000\r\n\r\n",
        );
        assert!(text.starts_with("HTTP/1.1 200 "), "{text}");
        assert!(text.contains("Connection: close"), "{text}");
    }

    #[test]
    fn host_target_line_and_expect_rules() {
        let fixture = Fixture::start(HttpSettings::default());
        let status = |bytes: &[u8]| {
            let text = exchange(&fixture, bytes);
            text.split(' ').nth(1).unwrap_or("").to_string()
        };
        assert_eq!(status(b"GET /x HTTP/1.1\r\n\r\n"), "400");
        assert_eq!(
            status(b"GET /x HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n"),
            "400"
        );
        assert_eq!(status(b"GET /x HTTP/1.0\r\n\r\n"), "200");
        assert_eq!(status(b"GET x HTTP/1.1\r\nHost: h\r\n\r\n"), "400");
        let rerouted = exchange(
            &fixture,
            b"GET /v1/assign?u=://x/panic HTTP/1.1\r\nHost: h\r\nConnection: close\r\n\r\n",
        );
        assert!(
            rerouted.ends_with("GET /v1/assign u=://x/panic -"),
            "{rerouted}"
        );
        let absolute = exchange(
            &fixture,
            b"GET http://h/y?z HTTP/1.1\r\nHost: h\r\nConnection: close\r\n\r\n",
        );
        assert!(absolute.ends_with("GET /y z -"), "{absolute}");
        let mut long_line = b"GET /".to_vec();
        long_line.extend(std::iter::repeat_n(b'a', head::MAX_HEAD_BYTES));
        assert_eq!(status(&long_line), "414");
        // HTTP/1.0 with Expect: no interim answer; the body is read when it comes.
        let mut stream = fixture.connect();
        stream
            .write_all(b"POST /small HTTP/1.0\r\nContent-Length: 2\r\nExpect: 100-continue\r\n\r\n")
            .unwrap();
        stream
            .set_read_timeout(Some(Duration::from_millis(300)))
            .unwrap();
        let mut early = [0u8; 8];
        assert!(
            stream.read(&mut early).is_err(),
            "an interim answer on HTTP/1.0"
        );
        stream.write_all(b"ok").unwrap();
        stream
            .set_read_timeout(Some(Duration::from_secs(5)))
            .unwrap();
        let text = read_to_close(&mut stream);
        assert!(
            text.starts_with("HTTP/1.1 200 ") && text.ends_with("ok"),
            "{text}"
        );
    }

    #[test]
    fn a_thread_whose_connection_ended_serves_the_next_one_and_stop_ends_it() {
        let mut fixture = Fixture::start(HttpSettings::default());
        let shared = fixture.server.as_ref().unwrap().shared.clone();
        let spare_waiting = || {
            let until = crate::clock::instant() + Duration::from_secs(5);
            while shared.spares.lock().idle != 1 && crate::clock::instant() < until {
                crate::clock::sleep(Duration::from_millis(5));
            }
            shared.spares.lock().idle == 1
        };
        for n in 0..3 {
            let text = exchange(
                &fixture,
                b"GET /x HTTP/1.1\r\nHost: h\r\nConnection: close\r\n\r\n",
            );
            assert!(text.starts_with("HTTP/1.1 200 "), "{text}");
            assert!(spare_waiting(), "connection {n}");
            assert_eq!(
                *shared.live.lock().unwrap(),
                1,
                "one thread served them all"
            );
        }
        let started = crate::clock::instant();
        fixture.server.take().unwrap().stop();
        assert!(started.elapsed() < Duration::from_secs(2));
        assert_eq!(*shared.live.lock().unwrap(), 0);
    }

    #[test]
    fn stop_closes_idle_connections_and_joins() {
        let mut fixture = Fixture::start(HttpSettings::default());
        let mut idle = fixture.connect();
        idle.write_all(b"GET /a HTTP/1.1\r\nHost: h\r\n\r\n")
            .unwrap();
        let mut first = [0u8; 12];
        idle.read_exact(&mut first).unwrap();
        let started = crate::clock::instant();
        fixture.server.take().unwrap().stop();
        assert!(started.elapsed() < Duration::from_secs(2));
        let rest = read_to_close(&mut idle);
        assert!(rest.ends_with("GET /a  -"), "{rest}");
        assert!(TcpStream::connect(fixture.addr).is_err());
    }
}
