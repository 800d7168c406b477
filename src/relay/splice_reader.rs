//! The blocking reader of a splice leg on its relay thread, until the leg is attached: a thin
//! shell over the pure [`FrameParser`] (`relay/frames.rs`) that owns the leg's small read
//! buffer and its socket. It reads the leg's first frame (`relay-auth`, `host-data-auth`);
//! [`SpliceReader::into_parts`] then gives what it read past that frame, and the parser, to the
//! splice worker that takes the pair over (`relay/splice/`).
//!
//! Control frames are handled here too: a ping is answered with a pong through this leg's own
//! writer, a pong is dropped, a close is acknowledged and ends the leg. A rule broken is a
//! [`Violation`]: the caller fails the leg with its code (1002, or 1009 for size).

use std::io::{self, Read};
use std::sync::Arc;
use std::time::Instant;

use tungstenite::protocol::frame::coding::Data;
use tungstenite::Message;

use super::frames::{FrameKind, FrameParser, Parsed, Violation, MAX_HEADER_BYTES};
use super::park::{wait_readable, Quiesce, ReaderRecord, Waited};
use super::socket::{drain_for_linger, Socket};
use crate::protocol::CloseCode;

/// The buffer every splice leg starts with; it grows for larger frames and shrinks back when
/// it is empty again. The relay thread only reads the leg's first frame (a small JSON
/// `relay-auth` or `host-data-auth`); the splice itself runs on the workers (`relay/splice/`),
/// which share one large buffer per worker, so a few KiB are enough here.
const INITIAL_BUFFER: usize = 4 * 1024;

/// What one read produced.
#[derive(Debug, PartialEq, Eq)]
pub enum SpliceEvent<'a> {
    /// A data frame: `Text`, `Binary` or `Continue`, with its FIN bit and unmasked payload.
    Frame {
        data: Data,
        fin: bool,
        payload: &'a [u8],
    },
    /// No frame before the deadline.
    TimedOut,
    /// A handover is quiescing the cell: deposit the connection.
    Quiesce,
    /// The client broke a rule of RFC 6455 (or the leg's size limit).
    Violation(Violation),
    /// The peer closed or the connection failed.
    Gone,
}

/// The close code a leg is failed with for `violation`: 1009 for size, 1002 otherwise.
pub fn violation_close_code(violation: Violation) -> CloseCode {
    match violation.close_code() {
        1009 => CloseCode::TooBig,
        _ => CloseCode::ProtocolError,
    }
}

pub struct SpliceReader {
    socket: Arc<Socket>,
    buf: Vec<u8>,
    start: usize,
    end: usize,
    parser: FrameParser,
    quiesce: Arc<Quiesce>,
}

impl SpliceReader {
    /// A reader over `socket`, starting with `tail` (bytes that arrived after the upgrade head).
    pub fn new(
        socket: Arc<Socket>,
        tail: Vec<u8>,
        max_message: usize,
        quiesce: Arc<Quiesce>,
    ) -> SpliceReader {
        SpliceReader::from_record(
            socket,
            ReaderRecord {
                buffered: tail,
                ..ReaderRecord::default()
            },
            max_message,
            quiesce,
        )
    }

    /// A reader resumed from a handover's record.
    pub fn from_record(
        socket: Arc<Socket>,
        record: ReaderRecord,
        max_message: usize,
        quiesce: Arc<Quiesce>,
    ) -> SpliceReader {
        let mut buf = record.buffered;
        let end = buf.len();
        buf.resize(INITIAL_BUFFER.max(end), 0);
        SpliceReader {
            socket,
            buf,
            start: 0,
            end,
            parser: FrameParser::with_state(max_message, record.parser),
            quiesce,
        }
    }

    /// What a handover carries: the bytes read past the last frame returned, and the parser.
    pub fn record(&self) -> ReaderRecord {
        ReaderRecord {
            buffered: self.buf[self.start..self.end].to_vec(),
            parser: self.parser.state(),
            message: None,
        }
    }

    pub fn socket(&self) -> &Arc<Socket> {
        &self.socket
    }

    /// What a splice worker needs to carry on where this reader stopped: the bytes read past
    /// the last frame returned (a partial frame, or whole frames the client sent early) and
    /// the parser (its fragmentation state).
    pub fn into_parts(self) -> (Vec<u8>, FrameParser) {
        (self.buf[self.start..self.end].to_vec(), self.parser)
    }

    /// The next data frame by `deadline` (control frames are dealt with on the way).
    pub fn read(&mut self, deadline: Instant) -> SpliceEvent<'_> {
        loop {
            match self.parser.parse(&mut self.buf[self.start..self.end]) {
                Parsed::Frame(frame) => {
                    let payload = frame.payload();
                    let (from, to) = (self.start + payload.start, self.start + payload.end);
                    self.start += frame.wire_len();
                    match frame.kind {
                        FrameKind::Data(data) => {
                            return SpliceEvent::Frame {
                                data,
                                fin: frame.fin,
                                payload: &self.buf[from..to],
                            }
                        }
                        FrameKind::Ping => {
                            let payload = self.buf[from..to].to_vec();
                            let _ = self.socket.send(Message::Pong(payload.into()));
                        }
                        FrameKind::Pong => {}
                        FrameKind::Close { .. } => {
                            self.socket.acknowledge_close();
                            return SpliceEvent::Gone;
                        }
                    }
                }
                Parsed::Violation(violation) => return SpliceEvent::Violation(violation),
                Parsed::Incomplete { needed } => {
                    if let Some(event) = self.fill(needed.max(MAX_HEADER_BYTES), deadline) {
                        return event;
                    }
                }
            }
        }
    }

    /// Makes room for a frame of `total` bytes and reads more; an event ends the read.
    fn fill(&mut self, total: usize, deadline: Instant) -> Option<SpliceEvent<'static>> {
        match wait_readable(self.socket.stream(), Some(deadline), &self.quiesce) {
            Waited::Readable => {}
            Waited::TimedOut => return Some(SpliceEvent::TimedOut),
            Waited::Quiesce => return Some(SpliceEvent::Quiesce),
        }
        if self.start == self.end {
            self.start = 0;
            self.end = 0;
            if self.buf.len() > INITIAL_BUFFER {
                // A large frame has passed: give its memory back.
                self.buf = vec![0; INITIAL_BUFFER];
            }
        } else if self.start + total > self.buf.len() {
            self.buf.copy_within(self.start..self.end, 0);
            self.end -= self.start;
            self.start = 0;
        }
        if total > self.buf.len() {
            self.buf.resize(total, 0);
        }
        let mut stream = self.socket.stream();
        match stream.read(&mut self.buf[self.end..]) {
            Ok(0) => Some(SpliceEvent::Gone),
            Ok(n) => {
                self.end += n;
                None
            }
            // A spurious wake-up or a stop and continue: wait again.
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock
                        | io::ErrorKind::TimedOut
                        | io::ErrorKind::Interrupted
                ) =>
            {
                None
            }
            Err(_) => Some(SpliceEvent::Gone),
        }
    }

    /// After closing on an oversized frame, lets the peer finish its write (see
    /// [`drain_for_linger`]).
    pub fn drain_after_close(&mut self) {
        drain_for_linger(self.socket.stream());
    }
}
