//! Reading HTTP/1.1 request heads under one deadline for the whole head, for both listeners:
//! the HTTP port (`http::server`, 10 s, SPEC §5.4) and the WebSocket upgrade
//! (`relay::upgrade`, 5 s, SPEC §5.2).
//!
//! A deadline is an instant, not a per-read timeout: before every read the socket's receive
//! timeout is set to the time that is left, so a client trickling one line every few seconds
//! is cut off when the head's time is up, however often it sends. An interrupted call (`EINTR`,
//! e.g. after the process was stopped and continued) is retried, never read as the peer
//! leaving. A head is at most [`MAX_HEAD_BYTES`] with at most [`MAX_HEADERS`] headers.
//!
//! [`HeadReader`] keeps the bytes that arrived after a head (a body, a pipelined request, the
//! first WebSocket frame) for whoever reads next.

use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use crate::clock;

/// A request head larger than this is refused (431 on the HTTP port).
pub const MAX_HEAD_BYTES: usize = 8 * 1024;
/// A request with more header lines than this is refused like an oversized head.
pub const MAX_HEADERS: usize = 64;
/// The reader's first buffer; it grows up to [`MAX_HEAD_BYTES`] only for large heads.
const INITIAL_BUFFER: usize = 1024;
/// The longest single wait in [`read_by`] and [`write_all_by`]. The kernel's timer wheel fires
/// a long socket timeout late by up to an eighth of it (a 30 s idle timeout up to 2 s late at
/// HZ=250); waiting in slices of at most a second keeps every deadline within a few tens of
/// milliseconds, for one wake-up a second per waiting connection.
const WAIT_SLICE: Duration = Duration::from_secs(1);

/// A parsed request head with owned parts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Head {
    pub method: String,
    /// The request target as sent (origin form `/path?query`, or absolute form).
    pub target: String,
    /// `1` for HTTP/1.1, `0` for HTTP/1.0.
    pub minor_version: u8,
    pub headers: Vec<(String, Vec<u8>)>,
}

impl Head {
    /// The first header called `name` (case-insensitive), trimmed; `None` if absent or not
    /// UTF-8.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .and_then(|(_, v)| std::str::from_utf8(v).ok())
            .map(str::trim)
    }

    /// Every value of the headers called `name`, in order.
    pub fn header_values<'a>(&'a self, name: &'a str) -> impl Iterator<Item = &'a [u8]> + 'a {
        self.headers
            .iter()
            .filter(move |(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_slice())
    }

    /// Whether a comma-separated header (`Connection`, `Upgrade`, ...) lists `token`.
    pub fn has_token(&self, name: &str, token: &str) -> bool {
        self.header_values(name).any(|value| {
            value
                .split(|&b| b == b',')
                .any(|part| part.trim_ascii().eq_ignore_ascii_case(token.as_bytes()))
        })
    }

    /// The path and query of the request target ([`split_target`]); `None` when the target is
    /// neither origin form nor absolute form (400).
    pub fn path_and_query(&self) -> Option<(&str, &str)> {
        split_target(&self.target)
    }

    /// RFC 9112 §3.2: an HTTP/1.1 request carries exactly one `Host` header (an HTTP/1.0 one
    /// may carry none, never two). `Err` is the answer's reason: `missing_host`,
    /// `repeated_host`.
    pub fn host_rule(&self) -> Result<(), &'static str> {
        match (self.header_values("host").count(), self.minor_version) {
            (0, 0) | (1, _) => Ok(()),
            (0, _) => Err("missing_host"),
            _ => Err("repeated_host"),
        }
    }
}

/// The path and query of a request target (RFC 9112 §3.2). A target that starts with `/` is in
/// origin form: the path is everything up to the first `?`, whatever follows (a `://` in the
/// query is only a query). Any other target must be in absolute form, parsed as RFC 3986 says:
/// a scheme (a letter, then letters, digits, `+`, `-`, `.`), `://`, a non-empty authority up to
/// the first `/` or `?`, then the path (`/` when empty) up to the first `?`. Anything else
/// (authority form, asterisk form, a relative path) is `None`.
pub fn split_target(target: &str) -> Option<(&str, &str)> {
    if target.starts_with('/') {
        return Some(target.split_once('?').unwrap_or((target, "")));
    }
    let (scheme, rest) = target.split_once("://")?;
    let mut scheme_chars = scheme.chars();
    let scheme_ok = scheme_chars.next().is_some_and(|c| c.is_ascii_alphabetic())
        && scheme_chars.all(|c| c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.'));
    if !scheme_ok {
        return None;
    }
    let authority_end = rest.find(['/', '?']).unwrap_or(rest.len());
    if authority_end == 0 {
        return None;
    }
    let after = &rest[authority_end..];
    let (path, query) = after.split_once('?').unwrap_or((after, ""));
    Some((if path.is_empty() { "/" } else { path }, query))
}

/// Why no head came.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HeadError {
    /// The deadline passed; `partial` says whether any byte of this head had arrived.
    TimedOut { partial: bool },
    /// The peer closed or reset the connection (or it was shut down here).
    Closed,
    /// Not an HTTP/1.x request head.
    Malformed,
    /// Larger than [`MAX_HEAD_BYTES`] or more than [`MAX_HEADERS`] headers (431).
    TooLarge,
    /// The request line alone is longer than [`MAX_HEAD_BYTES`] (414, RFC 9112 §3).
    LineTooLong,
}

/// Why `received`, [`MAX_HEAD_BYTES`] or more without a complete head, is refused: the request
/// line alone is too long (no line end yet) or the header block is.
pub fn oversized(received: &[u8]) -> HeadError {
    if received.contains(&b'\n') {
        HeadError::TooLarge
    } else {
        HeadError::LineTooLong
    }
}

/// How one read under a deadline ended without data.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReadError {
    TimedOut,
    Closed,
}

/// The time left until `deadline`, or `None` once it has passed.
fn remaining(deadline: Instant) -> Option<Duration> {
    deadline
        .checked_duration_since(clock::instant())
        .filter(|left| !left.is_zero())
}

/// One read that returns by `deadline`: `Ok(0)` is the peer's end of stream. The receive
/// timeout is set to what is left before each attempt; `EINTR` is retried.
pub fn read_by(stream: &TcpStream, buf: &mut [u8], deadline: Instant) -> Result<usize, ReadError> {
    loop {
        let left = remaining(deadline).ok_or(ReadError::TimedOut)?;
        stream
            .set_read_timeout(Some(left.min(WAIT_SLICE)))
            .map_err(|_| ReadError::Closed)?;
        match (&*stream).read(buf) {
            Ok(n) => return Ok(n),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            // The timeout fired (or a spurious wake-up): the loop checks the deadline again.
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) =>
            {
                continue
            }
            Err(_) => return Err(ReadError::Closed),
        }
    }
}

/// Writes all of `bytes` by `deadline` (a client that does not read cannot hold the writer
/// longer); `EINTR` is retried.
pub fn write_all_by(stream: &TcpStream, bytes: &[u8], deadline: Instant) -> io::Result<()> {
    let mut written = 0;
    while written < bytes.len() {
        let left = remaining(deadline).ok_or_else(|| io::Error::from(io::ErrorKind::TimedOut))?;
        stream.set_write_timeout(Some(left.min(WAIT_SLICE)))?;
        match (&*stream).write(&bytes[written..]) {
            Ok(0) => return Err(io::Error::from(io::ErrorKind::WriteZero)),
            Ok(n) => written += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) =>
            {
                continue
            }
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Reads request heads from one connection, keeping what arrives after each head.
#[derive(Debug, Default)]
pub struct HeadReader {
    buf: Vec<u8>,
    /// Unconsumed bytes are `buf[start..end]`.
    start: usize,
    end: usize,
    /// Bytes of `buf[start..]` already searched for the end of the head.
    scanned: usize,
}

impl HeadReader {
    pub fn new() -> HeadReader {
        HeadReader::default()
    }

    /// The bytes received and not yet consumed.
    pub fn buffered(&self) -> &[u8] {
        &self.buf[self.start..self.end]
    }

    /// Marks `n` buffered bytes as consumed.
    pub fn consume(&mut self, n: usize) {
        self.start = (self.start + n).min(self.end);
        self.scanned = 0;
        if self.start == self.end {
            self.start = 0;
            self.end = 0;
        }
    }

    /// The buffered bytes, handing the reader over (the start of a WebSocket stream).
    pub fn into_buffered(self) -> Vec<u8> {
        self.buf[self.start..self.end].to_vec()
    }

    /// Waits until at least one byte is buffered (an idle keep-alive connection waiting for
    /// its next request), at most until `until`.
    pub fn wait_for_bytes(&mut self, stream: &TcpStream, until: Instant) -> Result<(), HeadError> {
        if self.start < self.end {
            return Ok(());
        }
        self.fill(stream, until).map_err(|e| match e {
            ReadError::TimedOut => HeadError::TimedOut { partial: false },
            ReadError::Closed => HeadError::Closed,
        })
    }

    /// Reads one whole request head by `deadline` and consumes it.
    pub fn read_head(&mut self, stream: &TcpStream, deadline: Instant) -> Result<Head, HeadError> {
        loop {
            if let Some(head) = self.parse()? {
                return Ok(head);
            }
            if self.end - self.start >= MAX_HEAD_BYTES {
                return Err(oversized(self.buffered()));
            }
            let partial = self.start < self.end;
            self.fill(stream, deadline).map_err(|e| match e {
                ReadError::TimedOut => HeadError::TimedOut { partial },
                ReadError::Closed => HeadError::Closed,
            })?;
        }
    }

    /// Reads exactly `len` body bytes (buffered ones first) into `out` by `deadline`.
    pub fn read_body(
        &mut self,
        stream: &TcpStream,
        len: usize,
        deadline: Instant,
        out: &mut Vec<u8>,
    ) -> Result<(), ReadError> {
        let from_buffer = len.min(self.end - self.start);
        out.extend_from_slice(&self.buf[self.start..self.start + from_buffer]);
        self.consume(from_buffer);
        let mut left = len - from_buffer;
        let mut chunk = [0u8; 4096];
        while left > 0 {
            let want = left.min(chunk.len());
            match read_by(stream, &mut chunk[..want], deadline)? {
                0 => return Err(ReadError::Closed),
                n => {
                    out.extend_from_slice(&chunk[..n]);
                    left -= n;
                }
            }
        }
        Ok(())
    }

    /// Reads and drops `len` body bytes by `deadline`.
    pub fn discard_body(
        &mut self,
        stream: &TcpStream,
        len: usize,
        deadline: Instant,
    ) -> Result<(), ReadError> {
        let from_buffer = len.min(self.end - self.start);
        self.consume(from_buffer);
        let mut left = len - from_buffer;
        let mut chunk = [0u8; 4096];
        while left > 0 {
            let want = left.min(chunk.len());
            match read_by(stream, &mut chunk[..want], deadline)? {
                0 => return Err(ReadError::Closed),
                n => left -= n,
            }
        }
        Ok(())
    }

    /// One read into the free end of the buffer (compacting and growing it, up to the head
    /// limit, first).
    fn fill(&mut self, stream: &TcpStream, deadline: Instant) -> Result<(), ReadError> {
        if self.start > 0 && self.end == self.buf.len() {
            self.buf.copy_within(self.start..self.end, 0);
            self.end -= self.start;
            self.start = 0;
        }
        if self.end == self.buf.len() {
            let grown = (self.buf.len() * 2).clamp(INITIAL_BUFFER, MAX_HEAD_BYTES);
            self.buf.resize(grown.max(self.end + 1), 0);
        }
        match read_by(stream, &mut self.buf[self.end..], deadline)? {
            0 => Err(ReadError::Closed),
            n => {
                self.end += n;
                Ok(())
            }
        }
    }

    /// A complete head from the buffer, if one is there. The buffer is searched for the blank
    /// line first (from where the last search stopped), so a head trickled byte by byte is not
    /// parsed again for every byte.
    fn parse(&mut self) -> Result<Option<Head>, HeadError> {
        let pending = &self.buf[self.start..self.end];
        let from = self.scanned.saturating_sub(3);
        let blank_line = pending[from..]
            .windows(2)
            .any(|pair| pair == b"\n\n" || pair == b"\n\r");
        self.scanned = pending.len();
        if !blank_line {
            return Ok(None);
        }
        match parse_head(pending)? {
            Some((head, head_len)) => {
                self.consume(head_len);
                Ok(Some(head))
            }
            None => Ok(None),
        }
    }
}

/// Parses a request head at the front of `received`: `Ok(None)` while it is incomplete, else
/// the head and its length in bytes. Pure (no I/O), so it is fuzzed on its own (`tests/fuzz`);
/// the reader bounds what it is given to [`MAX_HEAD_BYTES`].
pub fn parse_head(received: &[u8]) -> Result<Option<(Head, usize)>, HeadError> {
    let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut request = httparse::Request::new(&mut headers);
    match request.parse(received) {
        Ok(httparse::Status::Complete(head_len)) => {
            let head = Head {
                method: request.method.unwrap_or_default().to_string(),
                target: request.path.unwrap_or("/").to_string(),
                minor_version: request.version.unwrap_or(1),
                headers: request
                    .headers
                    .iter()
                    .map(|h| (h.name.to_string(), h.value.to_vec()))
                    .collect(),
            };
            Ok(Some((head, head_len)))
        }
        Ok(httparse::Status::Partial) => Ok(None),
        Err(httparse::Error::TooManyHeaders) => Err(HeadError::TooLarge),
        Err(_) => Err(HeadError::Malformed),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    /// A connected pair: (client, server side).
    fn pair() -> (TcpStream, TcpStream) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let client = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (server, _) = listener.accept().unwrap();
        (client, server)
    }

    fn soon() -> Instant {
        clock::instant() + Duration::from_secs(5)
    }

    #[test]
    fn reads_a_head_and_keeps_what_follows() {
        let (mut client, server) = pair();
        client
            .write_all(b"POST /a/b?x=1 HTTP/1.1\r\nHost: h\r\nContent-Length: 3\r\nConnection: keep-alive, Upgrade\r\n\r\nabcGET /next HTTP/1.0\r\n\r\n")
            .unwrap();
        let mut reader = HeadReader::new();
        let head = reader.read_head(&server, soon()).unwrap();
        assert_eq!(head.method, "POST");
        assert_eq!(head.path_and_query(), Some(("/a/b", "x=1")));
        assert_eq!(head.minor_version, 1);
        assert_eq!(head.header("content-length"), Some("3"));
        assert!(head.has_token("connection", "upgrade"));
        assert!(!head.has_token("connection", "close"));
        let mut body = Vec::new();
        reader.read_body(&server, 3, soon(), &mut body).unwrap();
        assert_eq!(body, b"abc");
        let next = reader.read_head(&server, soon()).unwrap();
        assert_eq!((next.target.as_str(), next.minor_version), ("/next", 0));
        assert!(reader.buffered().is_empty());
    }

    #[test]
    fn a_head_in_many_pieces_is_put_together() {
        let (mut client, server) = pair();
        let head = b"GET /health HTTP/1.1\r\nHost: h\r\nX-Long: ".to_vec();
        let mut full = head.clone();
        full.extend(std::iter::repeat_n(b'a', 3000));
        full.extend_from_slice(b"\r\n\r\n");
        let writer = crate::threads::spawn("test-pieces", move || {
            for piece in full.chunks(700) {
                client.write_all(piece).unwrap();
                clock::sleep(Duration::from_millis(5));
            }
            client
        })
        .unwrap();
        let mut reader = HeadReader::new();
        let parsed = reader.read_head(&server, soon()).unwrap();
        assert_eq!(parsed.header("x-long").map(str::len), Some(3000));
        drop(writer.join().unwrap());
    }

    #[test]
    fn absolute_targets_give_their_path() {
        let head = |target: &str| Head {
            method: "GET".into(),
            target: target.into(),
            minor_version: 1,
            headers: Vec::new(),
        };
        assert_eq!(head("http://h:1/x?y").path_and_query(), Some(("/x", "y")));
        assert_eq!(head("http://h:1").path_and_query(), Some(("/", "")));
        assert_eq!(head("https://h?q").path_and_query(), Some(("/", "q")));
        assert_eq!(head("/only").path_and_query(), Some(("/only", "")));
    }

    #[test]
    fn an_origin_form_target_is_never_read_as_absolute_form() {
        // (target, path and query) — origin form is everything that starts with `/`.
        let cases: [(&str, Option<(&str, &str)>); 10] = [
            (
                "/v1/assign?u=://x/metrics",
                Some(("/v1/assign", "u=://x/metrics")),
            ),
            ("/a://b/metrics", Some(("/a://b/metrics", ""))),
            ("//x/metrics", Some(("//x/metrics", ""))),
            (
                "/health?x=http://x/metrics",
                Some(("/health", "x=http://x/metrics")),
            ),
            ("http://relay/metrics?x=1", Some(("/metrics", "x=1"))),
            ("health", None),
            ("x://", None),
            ("://x/metrics", None),
            ("1http://x/metrics", None),
            ("*", None),
        ];
        for (target, expected) in cases {
            assert_eq!(split_target(target), expected, "{target}");
        }
    }

    #[test]
    fn host_is_required_once_on_http_1_1() {
        let head = |minor_version: u8, hosts: usize| Head {
            method: "GET".into(),
            target: "/".into(),
            minor_version,
            headers: (0..hosts)
                .map(|n| ("Host".to_string(), format!("h{n}").into_bytes()))
                .collect(),
        };
        assert_eq!(head(1, 1).host_rule(), Ok(()));
        assert_eq!(head(1, 0).host_rule(), Err("missing_host"));
        assert_eq!(head(1, 2).host_rule(), Err("repeated_host"));
        assert_eq!(head(0, 0).host_rule(), Ok(()));
        assert_eq!(head(0, 1).host_rule(), Ok(()));
        assert_eq!(head(0, 2).host_rule(), Err("repeated_host"));
    }

    #[test]
    fn oversized_malformed_and_closed_heads_are_told_apart() {
        let mut long_header = b"GET / HTTP/1.1\r\nX: ".to_vec();
        long_header.extend_from_slice(&[b'a'; MAX_HEAD_BYTES]);
        let cases: [(&[u8], HeadError); 5] = [
            (&[b'a'; MAX_HEAD_BYTES + 10], HeadError::LineTooLong),
            (&long_header, HeadError::TooLarge),
            (b"NOT A REQUEST\r\n\r\n", HeadError::Malformed),
            (b"GET / HTTP/1.1\r\nHost: h\r\n", HeadError::Closed),
            (b"", HeadError::Closed),
        ];
        for (bytes, expected) in cases {
            let (mut client, server) = pair();
            client.write_all(bytes).unwrap();
            client.shutdown(std::net::Shutdown::Write).unwrap();
            let got = HeadReader::new().read_head(&server, soon());
            assert_eq!(
                got.err(),
                Some(expected),
                "{:?}",
                &bytes[..bytes.len().min(20)]
            );
        }
        let (mut client, server) = pair();
        let mut many = b"GET / HTTP/1.1\r\n".to_vec();
        for n in 0..=MAX_HEADERS {
            many.extend_from_slice(format!("X-{n}: 1\r\n").as_bytes());
        }
        many.extend_from_slice(b"\r\n");
        client.write_all(&many).unwrap();
        assert_eq!(
            HeadReader::new().read_head(&server, soon()).err(),
            Some(HeadError::TooLarge)
        );
    }

    #[test]
    fn the_deadline_is_for_the_whole_head_not_each_read() {
        // A byte every 40 ms keeps every single read short; the 300 ms deadline still ends it.
        let (mut client, server) = pair();
        let trickle = crate::threads::spawn("test-trickle", move || {
            for byte in b"GET / HTTP/1.1\r\nX-Slow: aaaaaaaaaaaaaaaaaaaaaaaa" {
                if client.write_all(&[*byte]).is_err() {
                    break;
                }
                clock::sleep(Duration::from_millis(40));
            }
        })
        .unwrap();
        let started = clock::instant();
        let got = HeadReader::new().read_head(&server, started + Duration::from_millis(300));
        let took = started.elapsed();
        assert_eq!(got.err(), Some(HeadError::TimedOut { partial: true }));
        assert!(
            took >= Duration::from_millis(290) && took < Duration::from_millis(600),
            "{took:?}"
        );
        drop(server);
        let _ = trickle.join();
    }

    #[test]
    fn waiting_for_the_next_request_ends_at_its_deadline_or_the_first_byte() {
        let (mut client, server) = pair();
        let mut reader = HeadReader::new();
        let started = clock::instant();
        assert_eq!(
            reader.wait_for_bytes(&server, started + Duration::from_millis(100)),
            Err(HeadError::TimedOut { partial: false })
        );
        assert!(started.elapsed() >= Duration::from_millis(95));
        client.write_all(b"G").unwrap();
        assert_eq!(reader.wait_for_bytes(&server, soon()), Ok(()));
        assert_eq!(reader.buffered(), b"G");
    }
}
