//! One splice leg as a worker holds it: the socket, at most one partial frame, the output the
//! socket could not take yet, and the leg's timers and state. An idle leg holds no buffer at
//! all: both `partial` and `output` give their memory back as soon as they are empty.

use std::io::{self, IoSlice, Read, Write};
use std::net::TcpStream;
use std::sync::Arc;

use super::timers::LegKey;
use crate::metrics::Counter;
use crate::relay::frames::FrameParser;
use crate::relay::socket::Socket;

/// Something released when the leg ends (its connection unit and gauge; on the phone leg, the
/// host's phone place).
pub type Release = Box<dyn Send>;

/// Where a leg is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LegState {
    /// Frames flow.
    Open,
    /// A close frame is queued or sent; what the peer still sends is read and discarded.
    /// `linger`: once the output is flushed, wait up to the close linger for the peer to
    /// close (we closed first); otherwise (we answered the peer's close) drop at once.
    Closing { linger: bool },
}

/// A leg's counters: by the direction of the frames read from it.
#[derive(Clone)]
pub struct LegCounters {
    pub bytes: Counter,
    pub frames: Counter,
}

pub struct Leg {
    pub key: LegKey,
    pub socket: Arc<Socket>,
    /// The other leg of the pair (its slot in the same worker); `None` once it has ended.
    pub peer: Option<LegKey>,
    pub parser: FrameParser,
    /// The start of a frame not yet whole (bytes read past the last whole frame).
    pub partial: Vec<u8>,
    /// How many bytes of `partial` are filled (a large frame's buffer is sized up front).
    pub filled: usize,
    /// What the next frame needs in all, once known (from the parser); 0 when nothing waits.
    pub needed: usize,
    /// Bytes queued for this leg's socket.
    pub output: Output,
    pub state: LegState,
    /// Reading stopped because the peer's output is over the bound; resumed when it drains.
    pub paused: bool,
    /// The last time the output moved (or began to wait), for the wedge window.
    pub last_progress_ms: u64,
    pub wedge_armed: bool,
    pub linger_armed: bool,
    /// Index of the worker's counters for the frames read from this leg (0: phone → host).
    pub direction: usize,
    /// Readable but not read to `WouldBlock` yet (its per-event budget ran out).
    pub backlogged: bool,
    /// An event reported the peer's end of stream or an error: read to `WouldBlock` or the
    /// end, never stopping at a short read.
    pub hangup_seen: bool,
    pub _release: Vec<Release>,
    pub kind: &'static str,
    /// The host a phone leg belongs to (its place among the host's phones); a handover needs it
    /// to take the place again.
    pub relay_host_id: Option<String>,
}

impl Leg {
    pub fn stream(&self) -> &TcpStream {
        self.socket.stream()
    }

    pub fn is_open(&self) -> bool {
        self.state == LegState::Open
    }
}

/// What one attempt to write the pending output did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Flushed {
    /// Some or all bytes went out (`true`: nothing is left).
    Progress { empty: bool },
    /// The socket takes nothing now; wait for writable.
    Blocked,
    /// The connection failed.
    Failed,
}

/// Bytes waiting for a socket: one vector and a read position. Empty means no allocation.
#[derive(Debug, Default)]
pub struct Output {
    bytes: Vec<u8>,
    start: usize,
}

impl Output {
    pub fn len(&self) -> usize {
        self.bytes.len() - self.start
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The bytes still to write (a handover carries them).
    pub fn pending(&self) -> &[u8] {
        &self.bytes[self.start..]
    }

    /// Output that a handover carried.
    pub fn carried(bytes: Vec<u8>) -> Output {
        Output { bytes, start: 0 }
    }

    pub fn push(&mut self, bytes: &[u8]) {
        if self.start > 0 && self.start >= self.bytes.len() / 2 {
            self.bytes.drain(..self.start);
            self.start = 0;
        }
        self.bytes.extend_from_slice(bytes);
    }

    /// Writes as much as the socket takes now; `EINTR` is retried, `WouldBlock` ends it.
    pub fn flush(&mut self, stream: &TcpStream) -> Flushed {
        let mut progressed = false;
        let mut stream = stream;
        while self.start < self.bytes.len() {
            match stream.write(&self.bytes[self.start..]) {
                Ok(0) => return Flushed::Failed,
                Ok(n) => {
                    self.start += n;
                    progressed = true;
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(_) => return Flushed::Failed,
            }
        }
        let empty = self.start >= self.bytes.len();
        if empty {
            // An idle leg keeps no buffer.
            self.bytes = Vec::new();
            self.start = 0;
        }
        if progressed || empty {
            Flushed::Progress { empty }
        } else {
            Flushed::Blocked
        }
    }
}

/// The connection failed while writing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WriteFailed;

/// Writes `slices` in as few calls as the socket allows; returns how many bytes went out
/// before it would block. `EINTR` is retried.
pub fn write_slices(stream: &TcpStream, slices: &[IoSlice<'_>]) -> Result<usize, WriteFailed> {
    let total: usize = slices.iter().map(|s| s.len()).sum();
    let mut written = 0;
    let mut stream = stream;
    // Skips what is already written, without mutating the callers' slices.
    let mut first = 0;
    let mut offset = 0;
    while written < total {
        while first < slices.len() && offset >= slices[first].len() {
            offset -= slices[first].len();
            first += 1;
        }
        let end = slices.len().min(first + 512);
        let result = if end - first == 1 {
            // One frame (the common case): a plain write, no iovec to import.
            stream.write(&slices[first][offset..])
        } else if offset == 0 {
            stream.write_vectored(&slices[first..end])
        } else {
            let mut rest: Vec<IoSlice<'_>> = Vec::with_capacity(end - first);
            rest.push(IoSlice::new(&slices[first][offset..]));
            rest.extend(slices[first + 1..end].iter().map(|s| IoSlice::new(s)));
            stream.write_vectored(&rest)
        };
        match result {
            Ok(0) => return Err(WriteFailed),
            Ok(n) => {
                written += n;
                offset += n;
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
            Err(_) => return Err(WriteFailed),
        }
    }
    Ok(written)
}

/// What one read did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReadOutcome {
    Bytes(usize),
    WouldBlock,
    /// End of stream or a failed connection.
    Gone,
}

/// One read; `EINTR` is retried.
pub fn read_once(stream: &TcpStream, into: &mut [u8]) -> ReadOutcome {
    let mut stream = stream;
    loop {
        match stream.read(into) {
            Ok(0) => return ReadOutcome::Gone,
            Ok(n) => return ReadOutcome::Bytes(n),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return ReadOutcome::WouldBlock,
            Err(_) => return ReadOutcome::Gone,
        }
    }
}

/// An unmasked server frame header for `payload_len` bytes (RFC 6455 §5.2): the first byte
/// as given (FIN and opcode), then the shortest length encoding. Returns the header bytes
/// used.
pub fn server_header(first: u8, payload_len: usize, head: &mut [u8; 10]) -> usize {
    head[0] = first;
    if payload_len < 126 {
        head[1] = payload_len as u8;
        2
    } else if payload_len <= u16::MAX as usize {
        head[1] = 126;
        head[2..4].copy_from_slice(&(payload_len as u16).to_be_bytes());
        4
    } else {
        head[1] = 127;
        head[2..10].copy_from_slice(&(payload_len as u64).to_be_bytes());
        10
    }
}

/// A close frame with `code` and `reason` (the reason cut to fit the 125-byte control limit).
pub fn close_frame(code: Option<u16>, reason: &str) -> Vec<u8> {
    let mut payload = Vec::new();
    if let Some(code) = code {
        payload.extend_from_slice(&code.to_be_bytes());
        let mut cut = reason.len().min(123);
        while !reason.is_char_boundary(cut) {
            cut -= 1;
        }
        payload.extend_from_slice(&reason.as_bytes()[..cut]);
    }
    let mut head = [0u8; 10];
    let head_len = server_header(0x88, payload.len(), &mut head);
    let mut frame = head[..head_len].to_vec();
    frame.extend_from_slice(&payload);
    frame
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_use_the_shortest_length() {
        let mut head = [0u8; 10];
        assert_eq!(server_header(0x82, 5, &mut head), 2);
        assert_eq!(&head[..2], &[0x82, 5]);
        assert_eq!(server_header(0x81, 126, &mut head), 4);
        assert_eq!(&head[..4], &[0x81, 126, 0, 126]);
        assert_eq!(server_header(0x02, 70_000, &mut head), 10);
        assert_eq!(&head[..2], &[0x02, 127]);
        assert_eq!(u64::from_be_bytes(head[2..10].try_into().unwrap()), 70_000);
    }

    #[test]
    fn close_frames_carry_the_code_and_a_bounded_reason() {
        assert_eq!(close_frame(None, ""), vec![0x88, 0]);
        assert_eq!(
            close_frame(Some(4408), "peer left")[..4],
            [0x88, 11, 0x11, 0x38]
        );
        let long = close_frame(Some(1000), &"é".repeat(100));
        assert!(long[1] as usize <= 125);
        assert!(std::str::from_utf8(&long[4..]).is_ok());
    }

    #[test]
    fn output_keeps_order_and_frees_its_memory_when_empty() {
        let mut output = Output::default();
        output.push(b"abc");
        output.start = 2;
        output.push(b"def");
        assert_eq!(output.len(), 4);
        assert_eq!(&output.bytes[output.start..], b"cdef");
    }
}
