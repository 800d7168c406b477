//! A raw HTTP/1.1 client over one `TcpStream`, for tests and benches that must see exactly what
//! happens on one connection: whether a request on a reused connection is answered, when the
//! server closes, what a refusal looks like. (ureq hides all of that behind its pool.)

use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

/// One parsed response.
#[derive(Debug, Clone)]
pub struct Response {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Response {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    pub fn body_text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}

/// How reading a response ended when it did not produce one.
#[derive(Debug, PartialEq, Eq)]
pub enum ReadError {
    /// The server closed (EOF or reset) before a whole response arrived.
    Closed,
    /// Nothing (or not enough) arrived before the timeout.
    TimedOut,
    /// The bytes were not an HTTP response.
    Malformed,
}

/// A client connection that keeps bytes read past one response for the next.
pub struct Conn {
    pub stream: TcpStream,
    buf: Vec<u8>,
}

impl Conn {
    pub fn connect(addr: &str) -> Conn {
        Conn::try_connect(addr, Duration::from_secs(10)).expect("connect")
    }

    /// Connects within `timeout` (benches count a failure instead of panicking).
    pub fn try_connect(addr: &str, timeout: Duration) -> io::Result<Conn> {
        let addr: std::net::SocketAddr = addr
            .parse()
            .map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
        let stream = TcpStream::connect_timeout(&addr, timeout)?;
        let _ = stream.set_nodelay(true);
        Ok(Conn {
            stream,
            buf: Vec::new(),
        })
    }

    pub fn send(&mut self, bytes: &[u8]) -> io::Result<()> {
        self.stream.write_all(bytes)
    }

    /// `GET path HTTP/1.1` with a Host header and nothing else.
    pub fn get(&mut self, path: &str) -> io::Result<()> {
        self.send(format!("GET {path} HTTP/1.1\r\nHost: relay\r\n\r\n").as_bytes())
    }

    /// Reads one response (for a request that was not HEAD) within `timeout`.
    pub fn read_response(&mut self, timeout: Duration) -> Result<Response, ReadError> {
        self.read_response_to(timeout, false)
    }

    /// Reads one response; `head` says the request was HEAD (no body follows).
    pub fn read_response_to(
        &mut self,
        timeout: Duration,
        head: bool,
    ) -> Result<Response, ReadError> {
        let deadline = orca_relay::clock::instant() + timeout;
        loop {
            let mut headers = [httparse::EMPTY_HEADER; 64];
            let mut response = httparse::Response::new(&mut headers);
            match response.parse(&self.buf) {
                Ok(httparse::Status::Complete(head_len)) => {
                    let status = response.code.unwrap_or(0);
                    let headers: Vec<(String, String)> = response
                        .headers
                        .iter()
                        .map(|h| {
                            (
                                h.name.to_string(),
                                String::from_utf8_lossy(h.value).trim().to_string(),
                            )
                        })
                        .collect();
                    let length = if head || status == 100 || status == 204 || status == 304 {
                        0
                    } else {
                        headers
                            .iter()
                            .find(|(n, _)| n.eq_ignore_ascii_case("content-length"))
                            .and_then(|(_, v)| v.parse::<usize>().ok())
                            .unwrap_or(0)
                    };
                    while self.buf.len() < head_len + length {
                        self.fill(deadline)?;
                    }
                    let body = self.buf[head_len..head_len + length].to_vec();
                    self.buf.drain(..head_len + length);
                    return Ok(Response {
                        status,
                        headers,
                        body,
                    });
                }
                Ok(httparse::Status::Partial) => self.fill(deadline)?,
                Err(_) => return Err(ReadError::Malformed),
            }
        }
    }

    fn fill(&mut self, deadline: Instant) -> Result<(), ReadError> {
        loop {
            let remaining = deadline.saturating_duration_since(orca_relay::clock::instant());
            if remaining.is_zero() {
                return Err(ReadError::TimedOut);
            }
            self.stream
                .set_read_timeout(Some(remaining))
                .map_err(|_| ReadError::Closed)?;
            let mut chunk = [0u8; 4096];
            match self.stream.read(&mut chunk) {
                Ok(0) => return Err(ReadError::Closed),
                Ok(n) => {
                    self.buf.extend_from_slice(&chunk[..n]);
                    return Ok(());
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
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

    /// Waits until the server closes the connection (EOF or reset) and discards whatever else
    /// arrives; `Err(TimedOut)` if it is still open after `timeout`.
    pub fn wait_closed(&mut self, timeout: Duration) -> Result<(), ReadError> {
        let deadline = orca_relay::clock::instant() + timeout;
        loop {
            match self.fill(deadline) {
                Ok(()) => self.buf.clear(),
                Err(ReadError::Closed) => return Ok(()),
                Err(other) => return Err(other),
            }
        }
    }

    /// GET and read the answer in one go.
    pub fn round_trip(&mut self, path: &str, timeout: Duration) -> Result<Response, ReadError> {
        self.get(path).map_err(|_| ReadError::Closed)?;
        self.read_response(timeout)
    }
}
