//! A small WebSocket client for the handover tests and bench: the handshake and the frames are
//! written here (RFC 6455: client frames masked, server frames not), so a session can be set up
//! with a blocking socket and then driven by an event loop with exactly the bytes it has read.

use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::time::Duration;

pub const OP_CONTINUE: u8 = 0x0;
pub const OP_TEXT: u8 = 0x1;
pub const OP_BINARY: u8 = 0x2;
pub const OP_CLOSE: u8 = 0x8;
pub const OP_PING: u8 = 0x9;
pub const OP_PONG: u8 = 0xa;

/// Appends one masked client frame.
pub fn encode(out: &mut Vec<u8>, fin: bool, opcode: u8, payload: &[u8], mask: [u8; 4]) {
    out.push(if fin { 0x80 } else { 0 } | opcode);
    let len = payload.len();
    if len < 126 {
        out.push(0x80 | len as u8);
    } else if len <= 0xffff {
        out.push(0x80 | 126);
        out.extend_from_slice(&(len as u16).to_be_bytes());
    } else {
        out.push(0x80 | 127);
        out.extend_from_slice(&(len as u64).to_be_bytes());
    }
    out.extend_from_slice(&mask);
    let start = out.len();
    out.extend_from_slice(payload);
    for (i, byte) in out[start..].iter_mut().enumerate() {
        *byte ^= mask[i & 3];
    }
}

/// A masked text frame.
pub fn text_frame(text: &str) -> Vec<u8> {
    let mut out = Vec::new();
    encode(&mut out, true, OP_TEXT, text.as_bytes(), [7, 11, 13, 17]);
    out
}

/// One server frame at the front of `buf`: (fin, opcode, payload range, frame length), or
/// `None` when incomplete.
pub fn parse(buf: &[u8]) -> Option<(bool, u8, std::ops::Range<usize>, usize)> {
    if buf.len() < 2 {
        return None;
    }
    let fin = buf[0] & 0x80 != 0;
    let opcode = buf[0] & 0x0f;
    let masked = buf[1] & 0x80 != 0;
    let (len, mut at) = match buf[1] & 0x7f {
        126 => (u16::from_be_bytes([*buf.get(2)?, *buf.get(3)?]) as usize, 4),
        127 => {
            let bytes: [u8; 8] = buf.get(2..10)?.try_into().ok()?;
            (u64::from_be_bytes(bytes) as usize, 10)
        }
        short => (short as usize, 2),
    };
    if masked {
        at += 4;
    }
    if buf.len() < at + len {
        return None;
    }
    Some((fin, opcode, at..at + len, at + len))
}

/// Connects and upgrades `path` on `addr` (with a bearer token for a control); returns the
/// stream (blocking, with a read timeout) and the bytes read past the 101, or the refusal's
/// status.
pub fn connect(addr: &str, path: &str, bearer: Option<&str>) -> Result<(TcpStream, Vec<u8>), u16> {
    let stream = TcpStream::connect(addr).map_err(|_| 0u16)?;
    upgrade(stream, addr, path, bearer)
}

/// As [`connect`], the socket's receive buffer set to `receive_buffer` bytes before it connects
/// (so the window it offers is that small from the start: set later, the kernel never takes
/// back a window it offered), and its segments to 1,400 bytes, as on a real network (on
/// loopback the 64 KiB segments size the relay's send buffer at megabytes from the start, so
/// its writes to a desktop that reads nothing would block only after thousands of frames).
pub fn connect_with_receive_buffer(
    addr: &str,
    path: &str,
    bearer: Option<&str>,
    receive_buffer: usize,
) -> Result<(TcpStream, Vec<u8>), u16> {
    use std::os::fd::FromRawFd;
    let target: std::net::SocketAddrV4 = addr.parse().map_err(|_| 0u16)?;
    // SAFETY: socket(2), setsockopt(2) and connect(2) on a descriptor this function owns (it
    // becomes the TcpStream's, or is closed on failure), with a sockaddr_in built here.
    let stream = unsafe {
        let fd = libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0);
        if fd < 0 {
            return Err(0);
        }
        let stream = TcpStream::from_raw_fd(fd);
        for (level, name, value) in [
            (
                libc::SOL_SOCKET,
                libc::SO_RCVBUF,
                receive_buffer as libc::c_int,
            ),
            (libc::IPPROTO_TCP, libc::TCP_MAXSEG, 1_400),
        ] {
            libc::setsockopt(
                fd,
                level,
                name,
                (&value as *const libc::c_int).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            );
        }
        let address = libc::sockaddr_in {
            sin_family: libc::AF_INET as libc::sa_family_t,
            sin_port: target.port().to_be(),
            sin_addr: libc::in_addr {
                s_addr: u32::from(*target.ip()).to_be(),
            },
            sin_zero: [0; 8],
        };
        let connected = libc::connect(
            fd,
            (&address as *const libc::sockaddr_in).cast(),
            std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t,
        );
        if connected != 0 {
            return Err(0);
        }
        stream
    };
    upgrade(stream, addr, path, bearer)
}

/// The WebSocket upgrade of `path` on a connected stream.
fn upgrade(
    mut stream: TcpStream,
    addr: &str,
    path: &str,
    bearer: Option<&str>,
) -> Result<(TcpStream, Vec<u8>), u16> {
    let _ = stream.set_nodelay(true);
    stream
        .set_read_timeout(Some(Duration::from_secs(20)))
        .map_err(|_| 0u16)?;
    let auth = bearer
        .map(|token| format!("Authorization: Bearer {token}\r\n"))
        .unwrap_or_default();
    let request = format!(
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\
         Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n{auth}\r\n"
    );
    stream.write_all(request.as_bytes()).map_err(|_| 0u16)?;
    let mut received = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        if let Some(end) = received.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&received[..end]).to_string();
            let status: u16 = head
                .split_whitespace()
                .nth(1)
                .and_then(|s| s.parse().ok())
                .unwrap_or(0);
            if status != 101 {
                return Err(status);
            }
            let rest = received[end + 4..].to_vec();
            return Ok((stream, rest));
        }
        match stream.read(&mut chunk) {
            Ok(0) | Err(_) => return Err(0),
            Ok(n) => received.extend_from_slice(&chunk[..n]),
        }
    }
}

/// A blocking reader of server frames over a stream, starting with `buffered`.
pub struct Blocking {
    pub stream: TcpStream,
    pub buffered: Vec<u8>,
}

impl Blocking {
    pub fn new(stream: TcpStream, buffered: Vec<u8>) -> Blocking {
        Blocking { stream, buffered }
    }

    /// The next frame: (fin, opcode, payload).
    pub fn frame(&mut self) -> io::Result<(bool, u8, Vec<u8>)> {
        loop {
            if let Some((fin, opcode, payload, len)) = parse(&self.buffered) {
                let out = self.buffered[payload].to_vec();
                self.buffered.drain(..len);
                return Ok((fin, opcode, out));
            }
            let mut chunk = [0u8; 65536];
            let n = self.stream.read(&mut chunk)?;
            if n == 0 {
                return Err(io::ErrorKind::UnexpectedEof.into());
            }
            self.buffered.extend_from_slice(&chunk[..n]);
        }
    }

    /// The next text message as JSON, skipping relay pings (answered) and WebSocket control
    /// frames.
    pub fn json(&mut self) -> io::Result<serde_json::Value> {
        loop {
            let (_, opcode, payload) = self.frame()?;
            match opcode {
                OP_TEXT => {
                    let value: serde_json::Value = serde_json::from_slice(&payload)
                        .map_err(|_| io::Error::from(io::ErrorKind::InvalidData))?;
                    if value["type"] == "ping" {
                        let pong = serde_json::json!({"type":"pong","t":value["t"]});
                        self.send(&text_frame(&pong.to_string()))?;
                        continue;
                    }
                    return Ok(value);
                }
                OP_CLOSE => {
                    let code = payload
                        .get(..2)
                        .map(|b| u16::from_be_bytes([b[0], b[1]]))
                        .unwrap_or(0);
                    return Err(io::Error::other(format!("closed {code}")));
                }
                _ => continue,
            }
        }
    }

    pub fn send(&mut self, bytes: &[u8]) -> io::Result<()> {
        self.stream.write_all(bytes)
    }

    pub fn send_json(&mut self, value: serde_json::Value) -> io::Result<()> {
        self.send(&text_frame(&value.to_string()))
    }
}
