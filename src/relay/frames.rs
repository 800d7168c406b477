//! The reader of splice legs (phone and host data): WebSocket frames forwarded as they are.
//!
//! A splice leg carries bulk traffic that the relay never interprets, so it does not need
//! tungstenite's message assembly. [`SpliceReader`] parses frame headers with tungstenite's
//! [`FrameHeader`], unmasks each payload in place in its own buffer and hands out the frame
//! (opcode, FIN bit, payload) for the other leg's writer to send unchanged: text stays text,
//! binary stays binary, fragmentation is kept. Compared with tungstenite's reader this saves
//! two passes over every spliced byte (it zero-fills its read buffer before each read and copies
//! each payload out), which is what keeps the splice as fast as nginx.
//!
//! Control frames are handled here: a ping is answered with a pong through the socket's writer,
//! a pong is dropped, a close is acknowledged and ends the leg. Client frames must be masked and
//! carry no reserved bits; anything else is a protocol error. Frames, and the fragments of one
//! message together, are limited to the leg's maximum (8 MiB).

use std::io::{self, Cursor, Read};
use std::sync::Arc;
use std::time::Duration;

use tungstenite::protocol::frame::coding::{Control, Data, OpCode};
use tungstenite::protocol::frame::FrameHeader;
use tungstenite::Message;

use super::socket::{drain_for_linger, Socket};

/// The buffer every splice leg starts with; it grows for larger frames and shrinks back when
/// it is empty again. 256 KiB lets one read take several 64 KiB frames (measured: 0.99-1.04x
/// nginx's throughput against 0.82-0.90x with 64 KiB, `cargo bench --bench relay`); nginx's
/// tuned proxy holds up to 8 x 64 KiB per connection for the same job.
const INITIAL_BUFFER: usize = 256 * 1024;
/// The longest frame header (8-byte length and a mask).
const MAX_HEADER: usize = 14;

/// What one read produced.
#[derive(Debug, PartialEq, Eq)]
pub enum SpliceEvent<'a> {
    /// A data frame: `Text`, `Binary` or `Continue`, with its FIN bit and unmasked payload.
    Frame {
        data: Data,
        fin: bool,
        payload: &'a [u8],
    },
    /// No frame within the socket's read timeout.
    TimedOut,
    /// A frame or message larger than the leg allows.
    TooBig,
    /// A frame no client may send (unmasked, reserved bits or opcodes, a bad control frame).
    Protocol,
    /// The peer closed or the connection failed.
    Gone,
}

pub struct SpliceReader {
    socket: Arc<Socket>,
    buf: Vec<u8>,
    start: usize,
    end: usize,
    max_message: usize,
    /// Bytes of the message being received in fragments so far.
    message_len: usize,
}

/// XORs `payload` with the 4-byte mask, 8 bytes at a time (RFC 6455 §5.3).
pub fn unmask(payload: &mut [u8], mask: [u8; 4]) {
    let wide = u64::from_ne_bytes([
        mask[0], mask[1], mask[2], mask[3], mask[0], mask[1], mask[2], mask[3],
    ]);
    let mut chunks = payload.chunks_exact_mut(8);
    for chunk in &mut chunks {
        let mut word = [0u8; 8];
        word.copy_from_slice(chunk);
        chunk.copy_from_slice(&(u64::from_ne_bytes(word) ^ wide).to_ne_bytes());
    }
    for (i, byte) in chunks.into_remainder().iter_mut().enumerate() {
        *byte ^= mask[i & 3];
    }
}

impl SpliceReader {
    /// A reader over `socket`, starting with `tail` (bytes that arrived after the upgrade head).
    pub fn new(socket: Arc<Socket>, tail: Vec<u8>, max_message: usize) -> SpliceReader {
        let mut buf = tail;
        let end = buf.len();
        buf.resize(INITIAL_BUFFER.max(end), 0);
        SpliceReader {
            socket,
            buf,
            start: 0,
            end,
            max_message,
            message_len: 0,
        }
    }

    pub fn socket(&self) -> &Arc<Socket> {
        &self.socket
    }

    /// The next data frame (control frames are dealt with on the way).
    pub fn read(&mut self) -> SpliceEvent<'_> {
        loop {
            match self.parse() {
                Parsed::Data {
                    data,
                    fin,
                    from,
                    to,
                } => {
                    return SpliceEvent::Frame {
                        data,
                        fin,
                        payload: &self.buf[from..to],
                    }
                }
                Parsed::Handled => continue,
                Parsed::Event(event) => return event,
                Parsed::NeedMore(total) => {
                    if let Some(event) = self.fill(total) {
                        return event;
                    }
                }
            }
        }
    }

    /// Parses one complete frame at the front of the buffer, if there is one.
    fn parse(&mut self) -> Parsed {
        let mut cursor = Cursor::new(&self.buf[self.start..self.end]);
        let (header, length) = match FrameHeader::parse(&mut cursor) {
            Ok(Some(parsed)) => parsed,
            Ok(None) => return Parsed::NeedMore(MAX_HEADER),
            Err(_) => return Parsed::Event(SpliceEvent::Protocol),
        };
        let header_len = cursor.position() as usize;
        if length > self.max_message as u64 {
            return Parsed::Event(SpliceEvent::TooBig);
        }
        let length = length as usize;
        let Some(mask) = header.mask else {
            return Parsed::Event(SpliceEvent::Protocol);
        };
        if header.rsv1 || header.rsv2 || header.rsv3 {
            return Parsed::Event(SpliceEvent::Protocol);
        }
        let total = header_len + length;
        if self.end - self.start < total {
            return Parsed::NeedMore(total);
        }
        let from = self.start + header_len;
        let to = from + length;
        unmask(&mut self.buf[from..to], mask);
        self.start += total;
        match header.opcode {
            OpCode::Data(data @ (Data::Text | Data::Binary | Data::Continue)) => {
                self.message_len = if data == Data::Continue {
                    self.message_len + length
                } else {
                    length
                };
                if self.message_len > self.max_message {
                    return Parsed::Event(SpliceEvent::TooBig);
                }
                Parsed::Data {
                    data,
                    fin: header.is_final,
                    from,
                    to,
                }
            }
            OpCode::Control(control) => {
                if !header.is_final || length > 125 {
                    return Parsed::Event(SpliceEvent::Protocol);
                }
                match control {
                    Control::Ping => {
                        let payload = self.buf[from..to].to_vec();
                        let _ = self.socket.send(Message::Pong(payload.into()));
                        Parsed::Handled
                    }
                    Control::Pong => Parsed::Handled,
                    Control::Close => {
                        self.socket.acknowledge_close();
                        Parsed::Event(SpliceEvent::Gone)
                    }
                    Control::Reserved(_) => Parsed::Event(SpliceEvent::Protocol),
                }
            }
            OpCode::Data(Data::Reserved(_)) => Parsed::Event(SpliceEvent::Protocol),
        }
    }

    /// Makes room for a frame of `total` bytes and reads more; an event ends the read.
    fn fill(&mut self, total: usize) -> Option<SpliceEvent<'static>> {
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
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) =>
            {
                Some(SpliceEvent::TimedOut)
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => None,
            Err(_) => Some(SpliceEvent::Gone),
        }
    }

    /// After closing on an oversized frame, lets the peer finish its write (see
    /// [`drain_for_linger`]).
    pub fn drain_after_close(&mut self) {
        drain_for_linger(self.socket.stream());
    }

    /// Sets how long one read may wait (`None`: forever).
    pub fn set_read_timeout(&self, timeout: Option<Duration>) {
        let _ = self.socket.stream().set_read_timeout(timeout);
    }
}

enum Parsed {
    Data {
        data: Data,
        fin: bool,
        from: usize,
        to: usize,
    },
    Handled,
    Event(SpliceEvent<'static>),
    NeedMore(usize),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unmask_matches_the_bytewise_definition() {
        let mask = [0x12, 0x34, 0x56, 0x78];
        for len in [0usize, 1, 3, 7, 8, 9, 15, 16, 17, 1000] {
            let original: Vec<u8> = (0..len).map(|i| (i * 7 + 3) as u8).collect();
            let mut fast = original.clone();
            unmask(&mut fast, mask);
            let slow: Vec<u8> = original
                .iter()
                .enumerate()
                .map(|(i, b)| b ^ mask[i & 3])
                .collect();
            assert_eq!(fast, slow, "len {len}");
            unmask(&mut fast, mask);
            assert_eq!(fast, original, "unmasking twice restores the payload");
        }
    }
}
