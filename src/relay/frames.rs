//! The frame parser of splice legs (phone and host data): RFC 6455 §5 for a server endpoint,
//! pure and incremental, with no I/O and no buffer of its own.
//!
//! A splice leg carries traffic the relay never interprets, so it needs no message assembly:
//! [`FrameParser::parse`] looks at the bytes at the front of the caller's buffer and answers
//! with one whole frame (its payload unmasked in place), "not yet" with the number of bytes the
//! frame needs, or a [`Violation`] with its close code. The caller keeps the unconsumed bytes
//! (at most one partial frame) and calls again when more arrive, however the stream was split.
//! The parser's own state is a few words: the fragmented message in progress (its opcode and
//! length so far) and a violation once one was found. The first-frame reader of the
//! acceptor's pending loop (`relay/splice_reader.rs`) is a thin shell over it; an event-loop
//! worker owns one read buffer and keeps only each leg's partial frame.
//!
//! Rules, each checked as soon as the bytes that decide it have arrived (so an oversized frame
//! is refused from its header, before its payload is read):
//! - every client frame is masked; no RSV bit is set (no extension is ever negotiated);
//! - opcodes 3–7 and 11–15 are reserved;
//! - control frames (close, ping, pong) carry at most 125 bytes and have FIN set; they may
//!   arrive between the fragments of a message;
//! - a continuation frame only inside an open message; no text or binary frame while one is
//!   open;
//! - a 64-bit length has its most significant bit clear;
//! - a frame, and all fragments of one message together, are at most the leg's maximum (8 MiB,
//!   SPEC §5.2): 1009;
//! - a close frame's payload is empty or a valid close code followed by UTF-8.
//!
//! Everything else is 1002. Text frames' payloads are **not** checked for UTF-8: the relay
//! forwards messages opaquely (text stays text), validating would cost a pass over every byte
//! and could only ever refuse what the receiving endpoint, which must check anyway, refuses.
//! Lengths are accepted in any encoding width (RFC 6455 asks senders for the shortest; the
//! relay re-encodes every header it forwards, and tungstenite accepts them too).

use std::ops::Range;

use tungstenite::protocol::frame::coding::Data;

use crate::carry::connection::ParserRecord;
use crate::protocol::CloseCode;

/// The longest frame header: two bytes, an 8-byte extended length and a 4-byte mask.
pub const MAX_HEADER_BYTES: usize = 14;
/// RFC 6455 §5.5: control frames carry at most 125 payload bytes.
pub const MAX_CONTROL_PAYLOAD: usize = 125;

/// A rule a client broke. The leg is failed with [`Violation::close_code`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Violation {
    /// RSV1, RSV2 or RSV3 set: no extension was negotiated.
    ReservedBits,
    /// Opcode 3–7 or 11–15.
    ReservedOpcode(u8),
    /// A client frame without a mask.
    Unmasked,
    /// A close, ping or pong without FIN.
    FragmentedControl,
    /// A control frame longer than 125 bytes.
    ControlTooLong,
    /// A 64-bit length with its most significant bit set.
    LengthHighBit,
    /// A continuation frame with no message open.
    ContinuationWithoutMessage,
    /// A text or binary frame while a fragmented message is still open.
    DataInsideMessage,
    /// One frame longer than the leg's maximum.
    FrameTooLarge,
    /// The fragments of one message together longer than the leg's maximum.
    MessageTooLarge,
    /// A close frame with a 1-byte payload.
    CloseOneByte,
    /// A close code no endpoint may send (RFC 6455 §7.4).
    CloseCodeInvalid(u16),
    /// A close reason that is not UTF-8.
    CloseReasonNotUtf8,
}

impl Violation {
    /// The close code the leg is failed with: 1009 for size, 1002 for everything else.
    pub fn close_code(self) -> u16 {
        match self {
            Violation::FrameTooLarge | Violation::MessageTooLarge => 1009,
            _ => 1002,
        }
    }

    /// A short stable name for logs.
    pub fn name(self) -> &'static str {
        match self {
            Violation::ReservedBits => "reserved_bits",
            Violation::ReservedOpcode(_) => "reserved_opcode",
            Violation::Unmasked => "unmasked",
            Violation::FragmentedControl => "fragmented_control",
            Violation::ControlTooLong => "control_too_long",
            Violation::LengthHighBit => "length_high_bit",
            Violation::ContinuationWithoutMessage => "continuation_without_message",
            Violation::DataInsideMessage => "data_inside_message",
            Violation::FrameTooLarge => "frame_too_large",
            Violation::MessageTooLarge => "message_too_large",
            Violation::CloseOneByte => "close_one_byte",
            Violation::CloseCodeInvalid(_) => "close_code_invalid",
            Violation::CloseReasonNotUtf8 => "close_reason_not_utf8",
        }
    }
}

/// What a frame is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FrameKind {
    /// `Text`, `Binary` or `Continue`: forwarded as it is.
    Data(Data),
    Ping,
    Pong,
    /// A valid close frame, with its code if it carried one.
    Close {
        code: Option<u16>,
    },
}

/// One whole frame at the front of the parsed bytes; its payload is unmasked in place.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Frame {
    pub kind: FrameKind,
    pub fin: bool,
    pub header_len: usize,
    pub payload_len: usize,
}

impl Frame {
    /// The frame's size in the input: header and payload (never zero).
    pub fn wire_len(&self) -> usize {
        self.header_len + self.payload_len
    }

    /// Where the (unmasked) payload sits in the parsed bytes.
    pub fn payload(&self) -> Range<usize> {
        self.header_len..self.wire_len()
    }
}

/// The answer to one [`FrameParser::parse`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Parsed {
    /// No whole frame yet: the next frame needs at least `needed` bytes from the start of the
    /// input (the whole frame once its header is known, so a caller can size its buffer once).
    Incomplete { needed: usize },
    /// A whole frame: consume `frame.wire_len()` bytes.
    Frame(Frame),
    /// The stream is refused; every later call answers the same.
    Violation(Violation),
}

/// Per-leg parser state: which data message is open, and a violation once found.
#[derive(Debug, Clone)]
pub struct FrameParser {
    max_message: usize,
    /// The fragmented data message in progress: its opcode and its bytes so far.
    open: Option<(Data, usize)>,
    failed: Option<Violation>,
}

/// RFC 6455 §7.4: the codes an endpoint may put in a close frame. 1004–1006 and 1015 are
/// reserved or must never be sent; 1012–1014 are registered with IANA; 3000–4999 belong to
/// libraries and applications (the relay's own 44xx codes among them).
pub fn close_code_is_valid(code: u16) -> bool {
    matches!(code, 1000..=1003 | 1007..=1014 | 3000..=4999)
}

impl FrameParser {
    /// A parser for a leg whose frames and messages are at most `max_message` bytes.
    pub fn new(max_message: usize) -> FrameParser {
        FrameParser {
            max_message,
            open: None,
            failed: None,
        }
    }

    /// A parser in the state `state` (see [`FrameParser::state`]).
    pub fn with_state(max_message: usize, state: ParserRecord) -> FrameParser {
        let open = match state.open_opcode {
            Some(1) => Some((Data::Text, state.open_len)),
            Some(2) => Some((Data::Binary, state.open_len)),
            _ => None,
        };
        FrameParser {
            max_message,
            open,
            failed: None,
        }
    }

    /// What a handover carries of this parser.
    pub fn state(&self) -> ParserRecord {
        match self.open {
            Some((data, len)) => ParserRecord {
                open_opcode: Some(match data {
                    Data::Text => 1,
                    _ => 2,
                }),
                open_len: len,
            },
            None => ParserRecord::default(),
        }
    }

    /// The opcode of the fragmented message in progress, if one is open.
    pub fn open_message(&self) -> Option<Data> {
        self.open.map(|(data, _)| data)
    }

    /// Parses the frame at the front of `input`. On [`Parsed::Frame`] the payload has been
    /// unmasked in place and the caller consumes `frame.wire_len()` bytes; on
    /// [`Parsed::Incomplete`] nothing was changed and the caller calls again with more.
    pub fn parse(&mut self, input: &mut [u8]) -> Parsed {
        if let Some(violation) = self.failed {
            return Parsed::Violation(violation);
        }
        match self.parse_frame(input) {
            Err(violation) => {
                self.failed = Some(violation);
                Parsed::Violation(violation)
            }
            Ok(parsed) => parsed,
        }
    }

    /// For a data frame whose header is complete but whose payload is not all in `input` (the
    /// caller saw [`Parsed::Incomplete`] with `needed` past the header): takes the frame as
    /// consumed (its fragmentation state committed) and returns its header, so that the caller
    /// forwards the payload as it arrives instead of holding the whole frame. `None` for
    /// anything else (a control frame is never this large; the stream is then untouched).
    pub fn begin_stream(&mut self, input: &[u8]) -> Option<StreamStart> {
        if self.failed.is_some() {
            return None;
        }
        let Ok(Ok(head)) = self.head(input) else {
            return None;
        };
        let FrameKind::Data(data) = head.kind else {
            return None;
        };
        if input.len() >= head.header_len + head.length {
            return None;
        }
        self.commit_data(data, head.fin, head.message_before + head.length);
        Some(StreamStart {
            first: u8::from(tungstenite::protocol::frame::coding::OpCode::Data(data))
                | if head.fin { 0x80 } else { 0 },
            header_len: head.header_len,
            payload_len: head.length,
            mask: head.mask,
        })
    }

    /// The fragmentation state after a data frame: a message stays open until its FIN.
    fn commit_data(&mut self, data: Data, fin: bool, message_so_far: usize) {
        let message_data = match (data, self.open) {
            (Data::Continue, Some((open, _))) => open,
            _ => data,
        };
        self.open = (!fin).then_some((message_data, message_so_far));
    }

    /// The frame header at the front of `input`, checked; `Ok(Err(needed))` when it is not all
    /// there yet.
    fn head(&self, input: &[u8]) -> Result<Result<Head, usize>, Violation> {
        let (first, second) = match input {
            [first, second, ..] => (*first, *second),
            _ => return Ok(Err(2)),
        };
        if first & 0x70 != 0 {
            return Err(Violation::ReservedBits);
        }
        let fin = first & 0x80 != 0;
        let opcode = first & 0x0f;
        let kind = match opcode {
            0 => FrameKind::Data(Data::Continue),
            1 => FrameKind::Data(Data::Text),
            2 => FrameKind::Data(Data::Binary),
            8 => FrameKind::Close { code: None },
            9 => FrameKind::Ping,
            10 => FrameKind::Pong,
            reserved => return Err(Violation::ReservedOpcode(reserved)),
        };
        if second & 0x80 == 0 {
            return Err(Violation::Unmasked);
        }
        let short_length = second & 0x7f;
        // Bytes of the message this frame belongs to, before it.
        let mut message_before = 0;
        match kind {
            FrameKind::Data(Data::Continue) => match self.open {
                Some((_, so_far)) => message_before = so_far,
                None => return Err(Violation::ContinuationWithoutMessage),
            },
            FrameKind::Data(_) => {
                if self.open.is_some() {
                    return Err(Violation::DataInsideMessage);
                }
            }
            _ => {
                if !fin {
                    return Err(Violation::FragmentedControl);
                }
            }
        }
        let (extended, length) = match short_length {
            126 => match input.get(2..4) {
                Some(bytes) => (2, u64::from(u16::from_be_bytes([bytes[0], bytes[1]]))),
                None => return Ok(Err(4)),
            },
            127 => match input.get(2..10) {
                Some(bytes) => {
                    let mut be = [0u8; 8];
                    be.copy_from_slice(bytes);
                    let length = u64::from_be_bytes(be);
                    if length >> 63 != 0 {
                        return Err(Violation::LengthHighBit);
                    }
                    (8, length)
                }
                None => return Ok(Err(10)),
            },
            short => (0, u64::from(short)),
        };
        // The decoded length counts, not the 7-bit field: a small control payload may be
        // encoded in 16 or 64 bits (not the shortest form, accepted as for data frames).
        let control = !matches!(kind, FrameKind::Data(_));
        if control && length > MAX_CONTROL_PAYLOAD as u64 {
            return Err(Violation::ControlTooLong);
        }
        // Size checks before any payload is read: an oversized frame is refused from its header.
        let length = match usize::try_from(length) {
            Ok(length) if length <= self.max_message => length,
            _ => return Err(Violation::FrameTooLarge),
        };
        if message_before + length > self.max_message {
            return Err(Violation::MessageTooLarge);
        }
        let header_len = 2 + extended + 4;
        let mut mask = [0u8; 4];
        match input.get(header_len - 4..header_len) {
            Some(bytes) => mask.copy_from_slice(bytes),
            // The whole frame is needed, as soon as its length is known (so a caller can size
            // its buffer once).
            None => return Ok(Err(header_len + length)),
        }
        Ok(Ok(Head {
            kind,
            fin,
            header_len,
            length,
            message_before,
            mask,
        }))
    }

    fn parse_frame(&mut self, input: &mut [u8]) -> Result<Parsed, Violation> {
        let head = match self.head(input)? {
            Ok(head) => head,
            Err(needed) => return Ok(Parsed::Incomplete { needed }),
        };
        let total = head.header_len + head.length;
        if input.len() < total {
            return Ok(Parsed::Incomplete { needed: total });
        }
        let payload = &mut input[head.header_len..total];
        unmask(payload, head.mask);
        let kind = match head.kind {
            FrameKind::Close { .. } => FrameKind::Close {
                code: close_code(payload)?,
            },
            FrameKind::Data(data) => {
                self.commit_data(data, head.fin, head.message_before + head.length);
                head.kind
            }
            other => other,
        };
        Ok(Parsed::Frame(Frame {
            kind,
            fin: head.fin,
            header_len: head.header_len,
            payload_len: head.length,
        }))
    }
}

/// A checked frame header.
struct Head {
    kind: FrameKind,
    fin: bool,
    header_len: usize,
    length: usize,
    message_before: usize,
    mask: [u8; 4],
}

/// The header of a data frame forwarded as its payload arrives ([`FrameParser::begin_stream`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StreamStart {
    /// The first header byte the relay sends: FIN and opcode.
    pub first: u8,
    /// The client header's length (mask included): the payload starts there.
    pub header_len: usize,
    pub payload_len: usize,
    pub mask: [u8; 4],
}

/// Unmasks `payload`, whose first byte is byte `offset` of its frame's payload.
pub fn unmask_at(payload: &mut [u8], mask: [u8; 4], offset: usize) {
    let rotated = [
        mask[offset % 4],
        mask[(offset + 1) % 4],
        mask[(offset + 2) % 4],
        mask[(offset + 3) % 4],
    ];
    unmask(payload, rotated);
}

/// The code of a close frame's (unmasked) payload: none, or a valid code and a UTF-8 reason.
fn close_code(payload: &[u8]) -> Result<Option<u16>, Violation> {
    match payload {
        [] => Ok(None),
        [_] => Err(Violation::CloseOneByte),
        [high, low, reason @ ..] => {
            let code = u16::from_be_bytes([*high, *low]);
            if !close_code_is_valid(code) {
                return Err(Violation::CloseCodeInvalid(code));
            }
            if std::str::from_utf8(reason).is_err() {
                return Err(Violation::CloseReasonNotUtf8);
            }
            Ok(Some(code))
        }
    }
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

/// Writes one masked client frame (header, mask and masked payload) to `out`: what a
/// well-behaved client sends. For tests and fuzz drivers; `first` is the first header byte
/// (FIN, RSV bits and opcode) as the caller wants it, right or wrong.
pub fn encode_client_frame(first: u8, payload: &[u8], mask: [u8; 4], out: &mut Vec<u8>) {
    out.push(first);
    let length = payload.len();
    if length < 126 {
        out.push(0x80 | length as u8);
    } else if let Ok(short) = u16::try_from(length) {
        out.push(0x80 | 126);
        out.extend_from_slice(&short.to_be_bytes());
    } else {
        out.push(0x80 | 127);
        out.extend_from_slice(&(length as u64).to_be_bytes());
    }
    out.extend_from_slice(&mask);
    let start = out.len();
    out.extend_from_slice(payload);
    unmask(&mut out[start..], mask);
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

/// The close code a leg is failed with for `violation`: 1009 for size, 1002 otherwise.
pub fn violation_close_code(violation: Violation) -> CloseCode {
    match violation.close_code() {
        1009 => CloseCode::TooBig,
        _ => CloseCode::ProtocolError,
    }
}

/// Watches what a client still sends after the relay's close frame for its answer, a close
/// frame of its own (RFC 6455 §5.5.1), so that the TCP connection is dropped as soon as the
/// closing handshake is complete rather than a fixed linger later. Whole frames are skipped by
/// their headers: nothing is kept but the few bytes of one header, whatever a frame declares,
/// and nothing is checked (the connection is closing; the worst a wrong guess does is drop it
/// early). The answer counts once its last byte has arrived, so that no unread byte turns the
/// relay's close of the socket into a reset.
#[derive(Debug, Clone)]
pub struct CloseAnswer {
    /// Payload bytes of the current frame still to come.
    skip: u64,
    /// The header being read, and how many of its bytes have arrived.
    head: [u8; MAX_HEADER_BYTES],
    have: usize,
    /// The frame whose payload is being skipped is the client's close.
    closing: bool,
    answered: bool,
    /// Not known to be at a frame boundary: only the end of stream (or the linger) ends it.
    unsynced: bool,
}

impl CloseAnswer {
    /// Bytes that start at a frame boundary: `unread` (already read past the last whole
    /// frame), then what the socket brings.
    pub fn after(unread: &[u8]) -> CloseAnswer {
        let mut answer = CloseAnswer::skipping(0);
        answer.feed(unread);
        answer
    }

    /// Bytes that start `left` bytes before the end of a frame's payload (a frame in the
    /// middle of arriving), then go on at a frame boundary.
    pub fn skipping(left: u64) -> CloseAnswer {
        CloseAnswer {
            skip: left,
            head: [0; MAX_HEADER_BYTES],
            have: 0,
            closing: false,
            answered: false,
            unsynced: false,
        }
    }

    /// Bytes whose frame boundaries are not known (after a frame the relay could not parse):
    /// never answered; the connection ends with its end of stream or the linger.
    pub fn unsynced() -> CloseAnswer {
        CloseAnswer {
            unsynced: true,
            ..CloseAnswer::skipping(0)
        }
    }

    /// Whether the client's close frame has arrived whole.
    pub fn answered(&self) -> bool {
        self.answered
    }

    /// Takes the next bytes the client sent; true once its close frame has arrived whole.
    pub fn feed(&mut self, mut bytes: &[u8]) -> bool {
        if self.unsynced {
            return false;
        }
        loop {
            if self.answered {
                return true;
            }
            if self.skip > 0 {
                let n = bytes
                    .len()
                    .min(usize::try_from(self.skip).unwrap_or(usize::MAX));
                self.skip -= n as u64;
                bytes = &bytes[n..];
                if self.skip > 0 {
                    return false;
                }
            }
            if self.closing {
                self.answered = true;
                continue;
            }
            if bytes.is_empty() {
                return false;
            }
            // The header: two bytes, then the extended length and the mask they announce.
            let take = 2usize.saturating_sub(self.have).min(bytes.len());
            self.head[self.have..self.have + take].copy_from_slice(&bytes[..take]);
            self.have += take;
            bytes = &bytes[take..];
            if self.have < 2 {
                return false;
            }
            let extended = match self.head[1] & 0x7f {
                126 => 2,
                127 => 8,
                _ => 0,
            };
            let mask = if self.head[1] & 0x80 != 0 { 4 } else { 0 };
            let need = 2 + extended + mask;
            let take = (need - self.have).min(bytes.len());
            self.head[self.have..self.have + take].copy_from_slice(&bytes[..take]);
            self.have += take;
            bytes = &bytes[take..];
            if self.have < need {
                return false;
            }
            let length = match self.head[1] & 0x7f {
                126 => u64::from(u16::from_be_bytes([self.head[2], self.head[3]])),
                127 => {
                    let mut wide = [0u8; 8];
                    wide.copy_from_slice(&self.head[2..10]);
                    u64::from_be_bytes(wide)
                }
                short => u64::from(short),
            };
            self.closing = self.head[0] & 0x0f == 0x8;
            self.skip = length;
            self.have = 0;
        }
    }
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
    fn a_close_answer_is_found_after_whole_frames_however_the_bytes_are_split() {
        let mut stream = Vec::new();
        encode_client_frame(0x82, &[7; 70_000], [1, 2, 3, 4], &mut stream);
        encode_client_frame(0x89, b"ping", [5, 6, 7, 8], &mut stream);
        encode_client_frame(0x01, &[1; 300], [1, 1, 1, 1], &mut stream);
        let before_close = stream.len();
        encode_client_frame(0x88, &[0x03, 0xe8, b'o', b'k'], [9, 9, 9, 9], &mut stream);
        for step in [1, 3, 13, 4096, usize::MAX] {
            let mut answer = CloseAnswer::after(&[]);
            let mut fed = 0;
            for chunk in stream.chunks(step.min(stream.len())) {
                fed += chunk.len();
                let done = answer.feed(chunk);
                assert_eq!(done, fed == stream.len(), "step {step} after {fed} bytes");
            }
            assert!(answer.answered());
        }
        // Unread bytes first (a frame boundary), the rest from the socket.
        let mut answer = CloseAnswer::after(&stream[..before_close + 1]);
        assert!(!answer.answered());
        assert!(answer.feed(&stream[before_close + 1..]));
        // An empty close frame, and one with an unmasked (rule-breaking) header before it.
        let mut answer = CloseAnswer::after(&[0x81, 0x02, b'h', b'i']);
        assert!(answer.feed(&[0x88, 0x80, 0, 0, 0, 0]));
        // A 64-bit length is skipped by its count, not kept.
        let mut answer = CloseAnswer::after(&[0x82, 0xff, 0, 0, 0, 1, 0, 0, 0, 0, 1, 2, 3, 4]);
        assert!(!answer.feed(&[0; 4096]));
        assert_eq!(answer.skip, (1 << 32) - 4096);
    }

    #[test]
    fn a_close_answer_after_the_rest_of_a_frame_or_without_a_boundary() {
        let mut close = Vec::new();
        encode_client_frame(0x88, &[0x0f, 0xa0], [1, 2, 3, 4], &mut close);
        let mut answer = CloseAnswer::skipping(5);
        assert!(!answer.feed(&[0x88; 5]), "the rest of a frame is payload");
        assert!(answer.feed(&close));
        let mut answer = CloseAnswer::unsynced();
        assert!(!answer.feed(&close));
        assert!(!answer.answered());
    }

    const MAX: usize = 1000;
    const MASK: [u8; 4] = [0x12, 0x34, 0x56, 0x78];

    fn frame(first: u8, payload: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        encode_client_frame(first, payload, MASK, &mut out);
        out
    }

    /// Feeds `stream` through a fresh parser one byte at a time (the hardest split) and returns
    /// the frames (kind, FIN, payload) and the violation that ended it, if any.
    type Seen = Vec<(FrameKind, bool, Vec<u8>)>;

    fn check(stream: &[u8]) -> (Seen, Option<Violation>) {
        let mut parser = FrameParser::new(MAX);
        let mut buffer = Vec::new();
        let mut frames = Vec::new();
        for byte in stream {
            buffer.push(*byte);
            loop {
                match parser.parse(&mut buffer) {
                    Parsed::Incomplete { needed } => {
                        assert!(needed > buffer.len(), "needed {needed} <= {}", buffer.len());
                        break;
                    }
                    Parsed::Frame(frame) => {
                        frames.push((frame.kind, frame.fin, buffer[frame.payload()].to_vec()));
                        buffer.drain(..frame.wire_len());
                    }
                    Parsed::Violation(violation) => return (frames, Some(violation)),
                }
            }
        }
        assert!(buffer.is_empty(), "a partial frame was left over");
        (frames, None)
    }

    fn refused(stream: &[u8]) -> Violation {
        match check(stream) {
            (_, Some(violation)) => violation,
            (frames, None) => panic!(
                "accepted: {:?}",
                frames
                    .iter()
                    .map(|(kind, fin, payload)| (*kind, *fin, payload.len()))
                    .collect::<Vec<_>>()
            ),
        }
    }

    #[test]
    fn unmask_matches_the_bytewise_definition() {
        for len in [0usize, 1, 3, 7, 8, 9, 15, 16, 17, 1000] {
            let original: Vec<u8> = (0..len).map(|i| (i * 7 + 3) as u8).collect();
            let mut fast = original.clone();
            unmask(&mut fast, MASK);
            let slow: Vec<u8> = original
                .iter()
                .enumerate()
                .map(|(i, b)| b ^ MASK[i & 3])
                .collect();
            assert_eq!(fast, slow, "len {len}");
            unmask(&mut fast, MASK);
            assert_eq!(fast, original, "unmasking twice restores the payload");
        }
    }

    #[test]
    fn legal_frames_pass_unchanged_with_fragments_and_controls_between_them() {
        let mut stream = Vec::new();
        stream.extend(frame(0x82, &[1, 2, 3]));
        stream.extend(frame(0x01, b"frag"));
        stream.extend(frame(0x89, b"ping between fragments"));
        // A 2-byte ping with its length in 16 bits: not the shortest form, still legal.
        stream.extend([0x89, 0xfe, 0, 2, 0, 0, 0, 0, b'h', b'i']);
        stream.extend(frame(0x00, b"men"));
        stream.extend(frame(0x8a, b""));
        stream.extend(frame(0x80, b"ted"));
        stream.extend(frame(0x81, &[0xff, 0xfe])); // not UTF-8: forwarded opaquely
        stream.extend(frame(0x82, &vec![9; 300])); // 16-bit length
        stream.extend(frame(0x88, &[0x03, 0xe8, b'o', b'k']));
        let (frames, violation) = check(&stream);
        assert_eq!(violation, None);
        let expected: Seen = vec![
            (FrameKind::Data(Data::Binary), true, vec![1, 2, 3]),
            (FrameKind::Data(Data::Text), false, b"frag".to_vec()),
            (FrameKind::Ping, true, b"ping between fragments".to_vec()),
            (FrameKind::Ping, true, b"hi".to_vec()),
            (FrameKind::Data(Data::Continue), false, b"men".to_vec()),
            (FrameKind::Pong, true, Vec::new()),
            (FrameKind::Data(Data::Continue), true, b"ted".to_vec()),
            (FrameKind::Data(Data::Text), true, vec![0xff, 0xfe]),
            (FrameKind::Data(Data::Binary), true, vec![9; 300]),
            (
                FrameKind::Close { code: Some(1000) },
                true,
                b"\x03\xe8ok".to_vec(),
            ),
        ];
        assert_eq!(frames, expected);
    }

    #[test]
    fn each_rfc_6455_rule_is_a_violation_with_its_code() {
        let open = frame(0x01, b"a"); // a text message left open
        let cases: Vec<(&str, Vec<u8>, Violation)> = vec![
            ("unmasked", vec![0x82, 0x01, 0x00], Violation::Unmasked),
            ("rsv1", frame(0xc2, b"x"), Violation::ReservedBits),
            ("rsv2", frame(0xa2, b"x"), Violation::ReservedBits),
            ("rsv3", frame(0x92, b"x"), Violation::ReservedBits),
            ("opcode 3", frame(0x83, b"x"), Violation::ReservedOpcode(3)),
            ("opcode 7", frame(0x87, b"x"), Violation::ReservedOpcode(7)),
            ("opcode 11", frame(0x8b, b""), Violation::ReservedOpcode(11)),
            ("opcode 15", frame(0x8f, b""), Violation::ReservedOpcode(15)),
            (
                "ping 126 bytes",
                frame(0x89, &[0; 126]),
                Violation::ControlTooLong,
            ),
            (
                "pong without FIN",
                frame(0x0a, b""),
                Violation::FragmentedControl,
            ),
            (
                "close without FIN",
                frame(0x08, b""),
                Violation::FragmentedControl,
            ),
            (
                "continuation first",
                frame(0x80, b"x"),
                Violation::ContinuationWithoutMessage,
            ),
            (
                "continuation after a finished message",
                [frame(0x81, b"a"), frame(0x80, b"b")].concat(),
                Violation::ContinuationWithoutMessage,
            ),
            (
                "text inside an open message",
                [open.clone(), frame(0x81, b"b")].concat(),
                Violation::DataInsideMessage,
            ),
            (
                "binary inside an open message",
                [open.clone(), frame(0x02, b"b")].concat(),
                Violation::DataInsideMessage,
            ),
            (
                "64-bit length with the high bit set",
                vec![0x82, 0xff, 0x80, 0, 0, 0, 0, 0, 0, 0],
                Violation::LengthHighBit,
            ),
            (
                "frame over the limit",
                frame(0x82, &[0; MAX + 1]),
                Violation::FrameTooLarge,
            ),
            (
                "message over the limit in fragments",
                [frame(0x02, &[0; MAX / 2]), frame(0x80, &[0; MAX / 2 + 1])].concat(),
                Violation::MessageTooLarge,
            ),
            (
                "message over the limit in three fragments",
                [
                    frame(0x01, &[b'a'; 400]),
                    frame(0x00, &[b'b'; 400]),
                    frame(0x80, &[b'c'; 201]),
                ]
                .concat(),
                Violation::MessageTooLarge,
            ),
            (
                "close with one byte",
                frame(0x88, &[3]),
                Violation::CloseOneByte,
            ),
            (
                "close code 1005",
                frame(0x88, &[0x03, 0xed]),
                Violation::CloseCodeInvalid(1005),
            ),
            (
                "close code 999",
                frame(0x88, &999u16.to_be_bytes()),
                Violation::CloseCodeInvalid(999),
            ),
            (
                "close code 5000",
                frame(0x88, &5000u16.to_be_bytes()),
                Violation::CloseCodeInvalid(5000),
            ),
            (
                "close reason not UTF-8",
                frame(0x88, &[0x03, 0xe8, 0xff]),
                Violation::CloseReasonNotUtf8,
            ),
        ];
        for (name, stream, expected) in cases {
            let violation = refused(&stream);
            assert_eq!(violation, expected, "{name}");
            let code = if matches!(
                expected,
                Violation::FrameTooLarge | Violation::MessageTooLarge
            ) {
                1009
            } else {
                1002
            };
            assert_eq!(violation.close_code(), code, "{name}");
        }
    }

    #[test]
    fn oversized_frames_are_refused_from_the_header_alone() {
        let mut parser = FrameParser::new(crate::protocol::SPLICE_MAX_FRAME_BYTES);
        // 8 MiB + 1 declared, no payload sent.
        let mut header = vec![0x82, 0xff];
        header.extend_from_slice(&(8u64 * 1024 * 1024 + 1).to_be_bytes());
        assert_eq!(
            parser.parse(&mut header.clone()),
            Parsed::Violation(Violation::FrameTooLarge)
        );
        // Exactly 8 MiB is fine: the parser asks for the whole frame.
        let mut parser = FrameParser::new(crate::protocol::SPLICE_MAX_FRAME_BYTES);
        let mut header = vec![0x82, 0xff];
        header.extend_from_slice(&(8u64 * 1024 * 1024).to_be_bytes());
        header.extend_from_slice(&MASK);
        assert_eq!(
            parser.parse(&mut header),
            Parsed::Incomplete {
                needed: 14 + 8 * 1024 * 1024
            }
        );
    }

    #[test]
    fn a_violation_is_final() {
        let mut parser = FrameParser::new(MAX);
        let mut bad = vec![0x82, 0x01, 0x00];
        assert_eq!(
            parser.parse(&mut bad),
            Parsed::Violation(Violation::Unmasked)
        );
        let mut good = frame(0x82, b"x");
        assert_eq!(
            parser.parse(&mut good),
            Parsed::Violation(Violation::Unmasked)
        );
    }

    #[test]
    fn valid_close_codes() {
        for code in [
            1000, 1001, 1002, 1003, 1007, 1011, 1012, 1013, 1014, 3000, 4408, 4999,
        ] {
            assert!(close_code_is_valid(code), "{code}");
        }
        for code in [
            0,
            999,
            1004,
            1005,
            1006,
            1015,
            1016,
            2000,
            2999,
            5000,
            u16::MAX,
        ] {
            assert!(!close_code_is_valid(code), "{code}");
        }
    }

    #[test]
    fn the_idle_parser_is_small() {
        assert!(std::mem::size_of::<FrameParser>() <= 48);
    }
}
