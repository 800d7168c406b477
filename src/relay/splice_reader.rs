//! The first frame of a splice leg (a phone's `relay-auth`, a data leg's `host-data-auth`), read
//! before the leg is authenticated by the acceptor's pending loop (`relay/pending.rs`): a thin,
//! non-blocking shell over the pure [`FrameParser`] (`relay/frames.rs`).
//!
//! Bounded by what arrived, never by what a client declares: the buffer holds at most
//! [`FIRST_FRAME_MAX_BYTES`] and grows only as bytes come in, and a first frame whose header
//! declares more than that is refused from the header (1009), before its payload is read. A
//! legitimate first frame is a small JSON object (a few hundred bytes).
//!
//! Control frames may come before it: a ping is answered with a pong (the caller writes it), a
//! pong is dropped, a close ends the leg. [`FirstFrameReader::into_parts`] gives what was read
//! past the first frame (frames a client sent early) and the parser (its fragmentation state)
//! to the splice worker that takes the pair over (`relay/splice/`).

use std::io::{self, Read};
use std::net::TcpStream;

use tungstenite::protocol::frame::coding::Data;

use super::frames::{violation_close_code, CloseAnswer, FrameKind, FrameParser, Parsed};
use crate::carry::connection::ReaderRecord;
use crate::protocol::CloseCode;

/// A connection the pending plane has finished with and handed on: the socket (non-blocking
/// still), its id, and the bytes its first-frame reader holds.
pub struct PendingLeg {
    pub id: u64,
    pub stream: TcpStream,
    pub reader: FirstFrameReader,
}

/// The most a first frame (header included) may take, and the most the reader buffers.
pub const FIRST_FRAME_MAX_BYTES: usize = 4 * 1024;
/// One read takes at most this (the rest waits in the kernel for the next).
const READ_CHUNK: usize = 2 * 1024;

/// What the bytes read so far amount to.
#[derive(Debug, PartialEq, Eq)]
pub enum FirstFrame {
    /// The first data frame, a whole text frame: its payload.
    Text(String),
    /// A ping before it: the caller answers with a pong carrying this payload.
    Ping(Vec<u8>),
    /// Not yet a frame: read more when the socket is readable.
    NeedMore,
    /// The client sent a close frame (with its code, if it carried one): answer it with the
    /// same code and end the leg.
    Closed(Option<u16>),
    /// The leg fails with this code: a rule of RFC 6455 broken (1002), a first frame over
    /// [`FIRST_FRAME_MAX_BYTES`] (1009), or one that is not one whole text frame (4401).
    Refused(CloseCode),
}

#[derive(Debug)]
pub struct FirstFrameReader {
    /// Bytes received and not consumed are `buf[start..]`.
    buf: Vec<u8>,
    start: usize,
    parser: FrameParser,
}

impl FirstFrameReader {
    /// A reader starting with `tail` (bytes that arrived after the upgrade head, at most the
    /// head reader's bound). `max_message` is the leg's limit once it is spliced.
    pub fn new(tail: Vec<u8>, max_message: usize) -> FirstFrameReader {
        FirstFrameReader {
            buf: tail,
            start: 0,
            parser: FrameParser::new(max_message),
        }
    }

    /// Bytes buffered and not consumed.
    pub fn buffered(&self) -> usize {
        self.buf.len() - self.start
    }

    /// One read of what the socket has, into room up to the bound (`Ok(0)`: the peer closed;
    /// `WouldBlock` on a non-blocking socket with nothing there). An interrupted read is retried.
    pub fn fill(&mut self, stream: &TcpStream) -> io::Result<usize> {
        if self.start > 0 {
            self.buf.drain(..self.start);
            self.start = 0;
        }
        let room = FIRST_FRAME_MAX_BYTES.saturating_sub(self.buf.len());
        if room == 0 {
            // The bound is full without a frame: `next` refuses it; nothing more is read.
            return Err(io::ErrorKind::WouldBlock.into());
        }
        let mut chunk = [0u8; READ_CHUNK];
        let want = room.min(READ_CHUNK);
        loop {
            match (&*stream).read(&mut chunk[..want]) {
                Ok(n) => {
                    self.buf.extend_from_slice(&chunk[..n]);
                    return Ok(n);
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            }
        }
    }

    /// The next thing the buffered bytes amount to.
    pub fn take_frame(&mut self) -> FirstFrame {
        loop {
            let parsed = self.parser.parse(&mut self.buf[self.start..]);
            match parsed {
                Parsed::Frame(frame) => {
                    let payload = frame.payload();
                    let (from, to) = (self.start + payload.start, self.start + payload.end);
                    self.start += frame.wire_len();
                    match frame.kind {
                        FrameKind::Data(Data::Text) if frame.fin => {
                            return match std::str::from_utf8(&self.buf[from..to]) {
                                Ok(text) => FirstFrame::Text(text.to_string()),
                                Err(_) => FirstFrame::Refused(CloseCode::BadOuterCredential),
                            };
                        }
                        FrameKind::Data(_) => {
                            return FirstFrame::Refused(CloseCode::BadOuterCredential)
                        }
                        FrameKind::Ping => return FirstFrame::Ping(self.buf[from..to].to_vec()),
                        FrameKind::Pong => continue,
                        FrameKind::Close { code } => return FirstFrame::Closed(code),
                    }
                }
                Parsed::Violation(violation) => {
                    return FirstFrame::Refused(violation_close_code(violation))
                }
                Parsed::Incomplete { needed } => {
                    if needed > FIRST_FRAME_MAX_BYTES {
                        return FirstFrame::Refused(CloseCode::TooBig);
                    }
                    return FirstFrame::NeedMore;
                }
            }
        }
    }

    /// What a live handover carries of a leg still waiting for its first frame: the bytes
    /// buffered and not consumed, and the parser's state.
    pub fn record(&self) -> ReaderRecord {
        ReaderRecord {
            buffered: self.buf[self.start..].to_vec(),
            parser: self.parser.state(),
            message: None,
        }
    }

    /// The reader a handover carried (its buffer is bounded as ever: what does not fit is
    /// refused as a first frame over the bound would be).
    pub fn from_record(record: ReaderRecord, max_message: usize) -> FirstFrameReader {
        FirstFrameReader {
            buf: record.buffered,
            start: 0,
            parser: FrameParser::with_state(max_message, record.parser),
        }
    }

    /// Where the client's frames stand, for the reaper that waits for its answer to a close:
    /// the unconsumed bytes start at a frame boundary (perhaps with a frame too large to
    /// read, whose header says how much of it is still to come).
    pub fn close_answer(&self) -> CloseAnswer {
        CloseAnswer::after(&self.buf[self.start..])
    }

    /// What a splice worker needs to carry on where this reader stopped: the bytes read past
    /// the first frame (frames the client sent early, perhaps a partial one) and the parser.
    pub fn into_parts(mut self) -> (Vec<u8>, FrameParser) {
        self.buf.drain(..self.start);
        (self.buf, self.parser)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::relay::frames::encode_client_frame;

    fn frame(first: u8, payload: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        encode_client_frame(first, payload, [9, 8, 7, 6], &mut out);
        out
    }

    #[test]
    fn pings_come_out_then_the_text_frame_and_what_followed_is_kept() {
        let mut bytes = frame(0x89, b"p1");
        bytes.extend(frame(0x8A, b"ignored"));
        bytes.extend(frame(0x81, br#"{"type":"relay-auth"}"#));
        bytes.extend(frame(0x82, b"early"));
        let mut reader = FirstFrameReader::new(bytes, 1 << 20);
        assert_eq!(reader.take_frame(), FirstFrame::Ping(b"p1".to_vec()));
        assert_eq!(
            reader.take_frame(),
            FirstFrame::Text(r#"{"type":"relay-auth"}"#.into())
        );
        let (rest, _parser) = reader.into_parts();
        assert_eq!(rest, frame(0x82, b"early"));
    }

    #[test]
    fn a_declared_length_over_the_bound_is_refused_from_the_header() {
        let mut header = vec![0x81, 0x80 | 127];
        header.extend_from_slice(&(8u64 << 20).to_be_bytes());
        header.extend_from_slice(&[1, 2, 3, 4]);
        let mut reader = FirstFrameReader::new(header, 8 << 20);
        assert_eq!(reader.take_frame(), FirstFrame::Refused(CloseCode::TooBig));
        assert!(
            reader.buffered() < 64,
            "nothing was allocated for the payload"
        );
        // Just under the bound is fine; binary, fragments and bad UTF-8 are 4401.
        let text = vec![b'a'; FIRST_FRAME_MAX_BYTES - 8];
        let mut reader = FirstFrameReader::new(frame(0x81, &text), 8 << 20);
        assert!(matches!(reader.take_frame(), FirstFrame::Text(_)));
        for bytes in [
            frame(0x82, b"{}"),
            frame(0x01, b"{"),
            frame(0x81, &[0xff, 0xfe]),
        ] {
            let mut reader = FirstFrameReader::new(bytes, 8 << 20);
            assert_eq!(
                reader.take_frame(),
                FirstFrame::Refused(CloseCode::BadOuterCredential)
            );
        }
        let mut reader = FirstFrameReader::new(frame(0x88, &[]), 8 << 20);
        assert_eq!(reader.take_frame(), FirstFrame::Closed(None));
        let mut reader = FirstFrameReader::new(frame(0x88, &[0x0f, 0xa0]), 8 << 20);
        assert_eq!(reader.take_frame(), FirstFrame::Closed(Some(4000)));
        // An unmasked frame breaks RFC 6455: 1002.
        let mut reader = FirstFrameReader::new(vec![0x81, 0x02, b'{', b'}'], 8 << 20);
        assert_eq!(
            reader.take_frame(),
            FirstFrame::Refused(CloseCode::ProtocolError)
        );
    }

    #[test]
    fn fill_reads_no_more_than_the_bound() {
        use std::io::Write;
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let mut client = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (server, _) = listener.accept().unwrap();
        client
            .write_all(&vec![0x81; 3 * FIRST_FRAME_MAX_BYTES])
            .unwrap();
        server.set_nonblocking(true).unwrap();
        let mut reader = FirstFrameReader::new(Vec::new(), 8 << 20);
        let until = crate::clock::instant() + std::time::Duration::from_secs(5);
        while reader.buffered() < FIRST_FRAME_MAX_BYTES && crate::clock::instant() < until {
            let _ = reader.fill(&server);
        }
        assert_eq!(reader.buffered(), FIRST_FRAME_MAX_BYTES);
        assert!(
            reader.fill(&server).is_err(),
            "a full bound reads nothing more"
        );
    }
}
