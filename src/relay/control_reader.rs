//! The reader of a desktop's control socket: RFC 6455 frames through the splice legs' strict
//! parser ([`FrameParser`]), assembled into messages, with the buffer, the parser's state and a
//! message's fragments all ours, so a live handover can carry exactly what was read and not yet
//! acted on ([`Reader::record`], [`Reader::from_record`]).
//!
//! [`ControlFrames`] is pure: bytes in, events out (a text or binary message, a ping to answer,
//! a close, a rule broken). [`Reader`] is its blocking shell on the control's relay thread: it
//! waits for the socket with [`wait_readable`] (so a handover's quiesce wakes it), reads, answers
//! pings through the socket's writer, acknowledges a close.
//!
//! The rules are those of the splice legs (masking, reserved bits and opcodes, control frames
//! ≤ 125 bytes with FIN, continuation only inside an open message, close payloads) with the
//! control's own limit (1 MiB per frame and per message: 1009) and one more: a text message
//! must be UTF-8, since the relay parses control text (1002 otherwise, as before).

use std::io::{self, Read};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tungstenite::protocol::frame::coding::Data;
use tungstenite::Message;

use super::buffer_budget::{
    BufferBudget, Lease, Side, BUDGET_RETRY, CONTROL_LARGE_LEASE_BYTES, CONTROL_ORDINARY_BYTES,
};
use super::frames::{CloseAnswer, FrameKind, FrameParser, Parsed, MAX_HEADER_BYTES};
use super::park::{wait_readable, wait_woken, Quiesce, Waited};
use super::socket::{drain_for_linger, Socket, CLOSE_LINGER};
use crate::carry::connection::ReaderRecord;
use crate::carry::crash::IO_READING;
use crate::clock;
use crate::pause_clock::PauseClock;
use crate::protocol::CONTROL_MAX_FRAME_BYTES;

/// The buffer a control starts with: idle controls are many and their frames small.
const INITIAL_BUFFER: usize = 1024;

/// What the frames read so far amount to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ControlEvent {
    Text(String),
    Binary(Vec<u8>),
    /// A ping to answer with this payload.
    Ping(Vec<u8>),
    Pong,
    /// The peer's close frame, with its code if it carried one.
    Close(Option<u16>),
    /// A frame or message over the limit: 1009.
    TooBig,
    /// A rule of RFC 6455 broken, or text that is not UTF-8: 1002.
    Protocol,
}

/// The pure part: a buffer, the parser and the message being assembled.
#[derive(Debug)]
pub struct ControlFrames {
    buf: Vec<u8>,
    start: usize,
    end: usize,
    parser: FrameParser,
    /// The payload of the fragmented message in progress (its opcode is the parser's).
    message: Vec<u8>,
}

impl ControlFrames {
    /// Starts with `tail`, the bytes that arrived after the upgrade head.
    pub fn new(tail: Vec<u8>) -> ControlFrames {
        ControlFrames::from_record(ReaderRecord {
            buffered: tail,
            ..ReaderRecord::default()
        })
    }

    pub fn from_record(record: ReaderRecord) -> ControlFrames {
        let mut buf = record.buffered;
        let end = buf.len();
        buf.resize(INITIAL_BUFFER.max(end), 0);
        ControlFrames {
            buf,
            start: 0,
            end,
            parser: FrameParser::with_state(CONTROL_MAX_FRAME_BYTES, record.parser),
            message: record.message.unwrap_or_default(),
        }
    }

    /// Whether every byte read has been acted on: nothing buffered, no message open.
    pub fn is_settled(&self) -> bool {
        self.start == self.end && self.parser.open_message().is_none()
    }

    /// What a handover carries: the unread bytes, the parser, the message so far.
    pub fn record(&self) -> ReaderRecord {
        let parser = self.parser.state();
        ReaderRecord {
            buffered: self.buf[self.start..self.end].to_vec(),
            message: parser.open_opcode.map(|_| self.message.clone()),
            parser,
        }
    }

    /// The next event from the bytes at hand, or `Err(needed)`: the next frame needs this many
    /// bytes from the first unread one.
    pub fn next_event(&mut self) -> Result<ControlEvent, usize> {
        loop {
            let open_before = self.parser.open_message();
            match self.parser.parse(&mut self.buf[self.start..self.end]) {
                Parsed::Incomplete { needed } => return Err(needed.max(MAX_HEADER_BYTES)),
                Parsed::Violation(violation) => {
                    return Ok(if violation.close_code() == 1009 {
                        ControlEvent::TooBig
                    } else {
                        ControlEvent::Protocol
                    })
                }
                Parsed::Frame(frame) => {
                    let payload = frame.payload();
                    let (from, to) = (self.start + payload.start, self.start + payload.end);
                    self.start += frame.wire_len();
                    match frame.kind {
                        FrameKind::Ping => {
                            return Ok(ControlEvent::Ping(self.buf[from..to].to_vec()))
                        }
                        FrameKind::Pong => return Ok(ControlEvent::Pong),
                        FrameKind::Close { code } => return Ok(ControlEvent::Close(code)),
                        FrameKind::Data(data) => {
                            let needed = self.message.len() + (to - from);
                            if needed > self.message.capacity() {
                                // Doubling, never past the largest message (its memory bound).
                                let target = (self.message.capacity() * 2)
                                    .clamp(needed, needed.max(CONTROL_MAX_FRAME_BYTES));
                                self.message.reserve_exact(target - self.message.len());
                            }
                            self.message.extend_from_slice(&self.buf[from..to]);
                            if !frame.fin {
                                continue;
                            }
                            let opcode = match data {
                                Data::Continue => open_before.unwrap_or(Data::Binary),
                                other => other,
                            };
                            let payload = std::mem::take(&mut self.message);
                            return Ok(match opcode {
                                Data::Text => match String::from_utf8(payload) {
                                    Ok(text) => ControlEvent::Text(text),
                                    Err(_) => ControlEvent::Protocol,
                                },
                                _ => ControlEvent::Binary(payload),
                            });
                        }
                    }
                }
            }
        }
    }

    /// Gives a large frame's buffer back once every byte of it was taken.
    pub fn release_spare(&mut self) {
        if self.start == self.end {
            self.start = 0;
            self.end = 0;
            if self.buf.len() > INITIAL_BUFFER {
                self.buf = vec![0; INITIAL_BUFFER];
            }
        }
    }

    /// Makes room for the next read toward `needed` bytes from the first unread one (moving
    /// the unread bytes to the front when the frame would not fit); returns the buffer's length
    /// for that read. The buffer doubles with what has arrived, never past the frame, so memory
    /// grows with bytes that arrived, never with the length a header declared.
    pub fn make_room(&mut self, needed: usize) -> usize {
        self.release_spare();
        if self.start + needed > self.buf.len() && self.start > 0 {
            self.buf.copy_within(self.start..self.end, 0);
            self.end -= self.start;
            self.start = 0;
        }
        let len = self.buf.len();
        if self.end < len {
            return len;
        }
        let frame = self.start + needed;
        if frame > len {
            frame.min(len * 2)
        } else {
            len + INITIAL_BUFFER
        }
    }

    /// The memory the reader holds with a buffer of `len` bytes, at most: the buffer, and the
    /// message its data frames are copied into (up to as much again).
    pub fn footprint(&self, len: usize) -> usize {
        let len = len.max(self.buf.len());
        2 * len + self.message.capacity()
    }

    /// The free space of a buffer grown to `len` ([`ControlFrames::make_room`]).
    pub fn space(&mut self, len: usize) -> &mut [u8] {
        if len > self.buf.len() {
            self.buf.resize(len, 0);
        }
        &mut self.buf[self.end..]
    }

    /// `n` bytes were read into the space.
    pub fn filled(&mut self, n: usize) {
        self.end += n;
    }
}

/// What one read produced.
#[derive(Debug)]
pub enum ReadEvent {
    Message(Message),
    /// Nothing arrived before the deadline.
    TimedOut,
    /// A frame larger than the control allows.
    TooBig,
    /// The peer broke a rule of RFC 6455: fail it with 1002.
    Protocol,
    /// The peer closed or the connection failed; nothing more will be read.
    Gone,
    /// A handover is quiescing the cell: deposit the connection.
    Quiesce,
}

/// Until when a read may wait.
#[derive(Debug, Clone, Copy)]
pub enum Deadline {
    /// A fixed instant (the first frame's).
    At(Instant),
    /// This long after the last byte heard (the control's silence window).
    Silence(Duration),
}

/// How a control's silence is judged across this process's own pause (SPEC §13): a silence
/// that spans the pause is judged only `resume_grace` after it ended, a fresh ping and its
/// answer time (`pause_clock::control_resume_grace_ms`).
#[derive(Clone)]
pub struct SilenceGuard {
    pub pauses: Arc<PauseClock>,
    pub resume_grace: Duration,
    /// The cell's budget for large buffers (a control draws on it for frames past the
    /// ordinary amount).
    pub buffers: Arc<BufferBudget>,
}

/// The reading side of a control, owned by its relay thread.
pub struct Reader {
    socket: Arc<Socket>,
    frames: ControlFrames,
    quiesce: Arc<Quiesce>,
    /// When the last bytes arrived (or the reader started).
    last_heard: Instant,
    guard: SilenceGuard,
    /// Silence is not judged before this (set once a silence window ran out across a pause).
    judged_from: Option<Instant>,
    /// What the reader holds of the cell's buffer budget.
    lease: Lease,
}

impl Reader {
    pub fn new(
        socket: Arc<Socket>,
        frames: ControlFrames,
        quiesce: Arc<Quiesce>,
        guard: SilenceGuard,
    ) -> Reader {
        Reader {
            socket,
            frames,
            quiesce,
            last_heard: clock::instant(),
            lease: Lease::new(&guard.buffers),
            guard,
            judged_from: None,
        }
    }

    /// A reader resumed from a handover's record, `silence_deadline` being when the silence
    /// window ends.
    pub fn resume(
        socket: Arc<Socket>,
        record: ReaderRecord,
        quiesce: Arc<Quiesce>,
        silence_deadline: Instant,
        silence: Duration,
        guard: SilenceGuard,
    ) -> Reader {
        // The window left is what the last byte heard left over: carried, not restarted.
        let last_heard = silence_deadline
            .checked_sub(silence)
            .unwrap_or_else(clock::instant);
        Reader {
            socket,
            frames: ControlFrames::from_record(record),
            quiesce,
            last_heard,
            lease: Lease::new(&guard.buffers),
            guard,
            judged_from: None,
        }
    }

    pub fn socket(&self) -> &Arc<Socket> {
        &self.socket
    }

    pub fn record(&self) -> ReaderRecord {
        self.frames.record()
    }

    /// When the silence window ends (`silence` after the last byte heard, or later once a
    /// pause of this process was found in it).
    pub fn silence_deadline(&self, silence: Duration) -> Instant {
        let window = self.last_heard + silence;
        self.judged_from.map_or(window, |from| window.max(from))
    }

    /// The silence window ran out: if this process's own pause is in it, silence is judged
    /// again a fresh ping and its answer time after the pause ended, and `true` says to go on
    /// waiting (the socket is looked at again then; what the desktop sent meanwhile is read).
    fn judged_after_pause(&mut self, silence: Duration) -> bool {
        let now = clock::instant();
        let heard_ago = now.saturating_duration_since(self.last_heard).as_millis() as u64;
        let left = crate::pause_clock::silent_in(
            heard_ago,
            silence.as_millis() as u64,
            self.guard.pauses.ended_ago_ms(),
            self.guard.resume_grace.as_millis() as u64,
        );
        if left == 0 {
            return false;
        }
        self.judged_from = Some(now + Duration::from_millis(left));
        true
    }

    /// Holds what a buffer of `len` bytes may need beyond the control's ordinary amount: the
    /// largest frame's worst case, drawn from the cell's budget at once (a lease that holds it
    /// never waits for more, so waiting readers cannot hold each other up). While the budget
    /// cannot give it, the control is not read (counted); its silence is not judged meanwhile
    /// (the wait is this process's, not the desktop's).
    fn hold_buffer(&mut self, len: usize) -> Result<(), ReadEvent> {
        if self.frames.footprint(len) <= CONTROL_ORDINARY_BYTES
            || self.lease.cover(CONTROL_LARGE_LEASE_BYTES)
        {
            return Ok(());
        }
        self.lease.budget().count_wait(Side::Control);
        loop {
            if self.quiesce.is_quiescing() {
                return Err(ReadEvent::Quiesce);
            }
            if self.socket.is_closing() {
                // Closed meanwhile (a newer control, the drain): nothing more will be read.
                return Err(ReadEvent::Gone);
            }
            wait_woken(&self.quiesce, BUDGET_RETRY);
            if self.lease.cover(CONTROL_LARGE_LEASE_BYTES) {
                self.last_heard = clock::instant();
                self.judged_from = None;
                return Ok(());
            }
        }
    }

    /// The next message. Pings are answered and pongs dropped on the way.
    pub fn read(&mut self, deadline: Deadline) -> ReadEvent {
        // The message handed out last was acted on: a large frame's memory goes back to the
        // budget once nothing of it is left.
        self.frames.release_spare();
        if self.frames.footprint(0) <= CONTROL_ORDINARY_BYTES {
            self.lease.settle(0);
        }
        loop {
            let needed = match self.frames.next_event() {
                Ok(ControlEvent::Text(text)) => return ReadEvent::Message(Message::text(text)),
                Ok(ControlEvent::Binary(bytes)) => {
                    return ReadEvent::Message(Message::Binary(bytes.into()))
                }
                Ok(ControlEvent::Ping(payload)) => {
                    let _ = self.socket.send(Message::Pong(payload.into()));
                    continue;
                }
                Ok(ControlEvent::Pong) => continue,
                Ok(ControlEvent::Close(code)) => {
                    // Our answer echoes its code; or it was the answer to our own close. Either
                    // way the closing handshake is complete: the connection ends now (the
                    // server closes TCP first, RFC 6455 §7.1.1).
                    self.socket.acknowledge_close(code);
                    self.socket.shutdown();
                    return ReadEvent::Gone;
                }
                Ok(ControlEvent::TooBig) => return ReadEvent::TooBig,
                Ok(ControlEvent::Protocol) => return ReadEvent::Protocol,
                Err(needed) => needed,
            };
            // Every message read so far was handed out and acted on (this is the next call):
            // unless part of a frame waits here, a crash now loses nothing of this control's.
            if self.frames.is_settled() {
                if let Some(slot) = self.socket.crash_slot() {
                    slot.clear(IO_READING);
                }
            }
            let len = self.frames.make_room(needed);
            if let Err(event) = self.hold_buffer(len) {
                return event;
            }
            let until = match deadline {
                Deadline::At(at) => at,
                Deadline::Silence(silence) => self.silence_deadline(silence),
            };
            match wait_readable(self.socket.stream(), Some(until), &self.quiesce) {
                Waited::Readable => {}
                Waited::TimedOut => match deadline {
                    Deadline::Silence(silence) if self.judged_after_pause(silence) => continue,
                    _ => return ReadEvent::TimedOut,
                },
                Waited::Quiesce => return ReadEvent::Quiesce,
            }
            let space = self.frames.space(len);
            if let Some(slot) = self.socket.crash_slot() {
                slot.set(IO_READING);
            }
            let mut stream = self.socket.stream();
            match stream.read(space) {
                Ok(0) => return ReadEvent::Gone,
                Ok(n) => {
                    self.frames.filled(n);
                    self.last_heard = clock::instant();
                    self.judged_from = None;
                }
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::Interrupted | io::ErrorKind::WouldBlock
                    ) => {}
                Err(_) => return ReadEvent::Gone,
            }
        }
    }

    /// After closing on an oversized frame, discards what the peer is still sending (for at
    /// most the close linger) so that it can finish its write and read our close frame instead
    /// of seeing its connection reset; the connection ends as soon as its answer to the close
    /// has arrived (the unread bytes start with the oversized frame's header).
    pub fn drain_after_close(&mut self) {
        let frames = &self.frames;
        let mut answer = CloseAnswer::after(&frames.buf[frames.start..frames.end]);
        drain_for_linger(self.socket.stream(), &mut answer);
        self.socket.shutdown();
    }

    /// After the relay closed this control (from this thread or another): reads what the
    /// desktop still sends, ignoring it, until its answer to the close (its close frame), its
    /// end of stream or the close linger; then the connection ends. A library reports the
    /// close when the connection ends, so it does at once rather than a linger later.
    pub fn await_close_answer(&mut self) {
        let until = clock::instant() + CLOSE_LINGER;
        while let ReadEvent::Message(_) = self.read(Deadline::At(until)) {}
        self.socket.shutdown();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::relay::frames::encode_client_frame;

    fn frame(first: u8, payload: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        encode_client_frame(first, payload, [1, 2, 3, 4], &mut out);
        out
    }

    /// Every event `stream` gives, fed in pieces of `step` bytes.
    fn events(stream: &[u8], step: usize) -> Vec<ControlEvent> {
        let mut frames = ControlFrames::new(Vec::new());
        let mut out = Vec::new();
        let mut fed = 0;
        loop {
            match frames.next_event() {
                Ok(event) => {
                    let end = matches!(event, ControlEvent::TooBig | ControlEvent::Protocol);
                    out.push(event);
                    if end {
                        return out;
                    }
                }
                Err(needed) => {
                    if fed == stream.len() {
                        return out;
                    }
                    let take = step.min(stream.len() - fed);
                    let len = frames.make_room(needed);
                    let space = frames.space(len);
                    let take = take.min(space.len());
                    space[..take].copy_from_slice(&stream[fed..fed + take]);
                    frames.filled(take);
                    fed += take;
                }
            }
        }
    }

    #[test]
    fn the_control_reader_enforces_the_rfc_6455_rules_of_the_splice_parser() {
        use ControlEvent::{Protocol, TooBig};
        let half = CONTROL_MAX_FRAME_BYTES / 2;
        let mut high_bit = vec![0x82, 0xff, 0x80, 0, 0, 0, 0, 0, 0, 0];
        high_bit.extend_from_slice(&[1, 2, 3, 4]);
        let cases: Vec<(&str, Vec<u8>, ControlEvent)> = vec![
            ("unmasked", vec![0x81, 0x01, b'x'], Protocol),
            ("rsv1", frame(0xc1, b"x"), Protocol),
            ("rsv3", frame(0x91, b"x"), Protocol),
            ("opcode 3", frame(0x83, b"x"), Protocol),
            ("opcode 11", frame(0x8b, b""), Protocol),
            ("ping 126 bytes", frame(0x89, &[0; 126]), Protocol),
            ("ping without FIN", frame(0x09, b""), Protocol),
            ("continuation first", frame(0x80, b"x"), Protocol),
            (
                "text inside an open message",
                [frame(0x01, b"a"), frame(0x81, b"b")].concat(),
                Protocol,
            ),
            ("64-bit length with the high bit set", high_bit, Protocol),
            (
                "frame over 1 MiB",
                frame(0x82, &vec![0; CONTROL_MAX_FRAME_BYTES + 1]),
                TooBig,
            ),
            (
                "message over 1 MiB in fragments",
                [frame(0x02, &vec![0; half]), frame(0x80, &vec![0; half + 1])].concat(),
                TooBig,
            ),
            ("close with one byte", frame(0x88, &[3]), Protocol),
            (
                "close code 1005",
                frame(0x88, &1005u16.to_be_bytes()),
                Protocol,
            ),
            (
                "close reason not UTF-8",
                frame(0x88, &[0x03, 0xe8, 0xff]),
                Protocol,
            ),
            ("text not UTF-8", frame(0x81, &[0xff]), Protocol),
        ];
        for (name, stream, expected) in cases {
            for step in [1, 7, usize::MAX] {
                assert_eq!(
                    events(&stream, step),
                    vec![expected.clone()],
                    "{name} step {step}"
                );
            }
        }
    }

    #[test]
    fn fragments_with_a_ping_between_them_make_one_message() {
        let stream = [
            frame(0x01, b"{\"ty"),
            frame(0x89, b"p"),
            frame(0x80, b"pe\":1}"),
            frame(0x82, b"\x00\x01"),
            frame(0x8a, b""),
            frame(0x88, &1000u16.to_be_bytes()),
        ]
        .concat();
        for step in [1, 3, usize::MAX] {
            assert_eq!(
                events(&stream, step),
                vec![
                    ControlEvent::Ping(b"p".to_vec()),
                    ControlEvent::Text("{\"type\":1}".into()),
                    ControlEvent::Binary(vec![0, 1]),
                    ControlEvent::Pong,
                    ControlEvent::Close(Some(1000)),
                ],
                "step {step}"
            );
        }
    }

    #[test]
    fn the_buffer_grows_with_the_bytes_that_arrived_not_with_the_declared_length() {
        let whole = frame(0x82, &vec![7; CONTROL_MAX_FRAME_BYTES]);
        let mut frames = ControlFrames::new(whole[..100].to_vec());
        let mut fed = 100;
        let mut largest = 0;
        loop {
            match frames.next_event() {
                Ok(event) => {
                    assert_eq!(
                        event,
                        ControlEvent::Binary(vec![7; CONTROL_MAX_FRAME_BYTES])
                    );
                    break;
                }
                Err(needed) => {
                    let len = frames.make_room(needed);
                    // At most twice what has arrived (and a header's worth).
                    assert!(len <= 2 * fed + INITIAL_BUFFER, "{len} for {fed} bytes");
                    largest = largest.max(len);
                    let space = frames.space(len);
                    let take = space.len().min(whole.len() - fed);
                    space[..take].copy_from_slice(&whole[fed..fed + take]);
                    frames.filled(take);
                    fed += take;
                }
            }
        }
        assert!(largest <= whole.len() + INITIAL_BUFFER);
        // Once the frame was taken, its memory goes back (and so does its lease).
        frames.release_spare();
        assert!(frames.footprint(0) <= CONTROL_ORDINARY_BYTES);
    }

    #[test]
    fn a_control_waiting_for_the_budget_ends_when_its_socket_is_closed() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let mut client = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (server, _) = listener.accept().unwrap();
        // The header of a 1 MiB frame and a little of it: the reader needs a large buffer.
        let whole = frame(0x82, &vec![1; CONTROL_MAX_FRAME_BYTES]);
        std::io::Write::write_all(&mut client, &whole[..64 * 1024]).unwrap();
        let buffers = BufferBudget::new(crate::relay::buffer_budget::MIN_BUDGET_BYTES);
        let mut hog = Lease::new(&buffers);
        assert!(hog.cover(crate::relay::buffer_budget::MIN_BUDGET_BYTES as usize));
        let socket = Socket::new_control(1, server);
        let mut reader = Reader::new(
            socket.clone(),
            ControlFrames::new(Vec::new()),
            Quiesce::new().unwrap(),
            SilenceGuard {
                pauses: PauseClock::new(crate::clock::system()),
                resume_grace: Duration::from_secs(1),
                buffers: buffers.clone(),
            },
        );
        let (done, read) = std::sync::mpsc::channel();
        crate::threads::spawn("test-budget-wait", move || {
            let _ = done.send(reader.read(Deadline::Silence(Duration::from_secs(60))));
        })
        .unwrap();
        let waited = clock::instant() + Duration::from_secs(10);
        while buffers.waits(Side::Control) == 0 && clock::instant() < waited {
            clock::sleep(Duration::from_millis(5));
        }
        assert_eq!(
            buffers.waits(Side::Control),
            1,
            "the reader waits for the budget"
        );
        socket.shutdown();
        let ended = read.recv_timeout(Duration::from_secs(10));
        assert!(matches!(ended, Ok(ReadEvent::Gone)), "{ended:?}");
    }

    #[test]
    fn a_record_carries_the_partial_frame_and_the_message_so_far() {
        let stream = [frame(0x01, b"hel"), frame(0x80, b"lo")].concat();
        // Everything but the last 3 bytes: the first fragment is taken, the second is partial.
        let cut = stream.len() - 3;
        let mut frames = ControlFrames::new(stream[..cut].to_vec());
        assert!(frames.next_event().is_err());
        let record = frames.record();
        assert_eq!(record.message.as_deref(), Some(&b"hel"[..]));
        assert_eq!(record.parser.open_opcode, Some(1));
        let json = serde_json::to_string(&record).unwrap();
        let mut resumed = ControlFrames::from_record(serde_json::from_str(&json).unwrap());
        let len = resumed.make_room(3);
        let space = resumed.space(len);
        space[..3].copy_from_slice(&stream[cut..]);
        resumed.filled(3);
        assert_eq!(resumed.next_event(), Ok(ControlEvent::Text("hello".into())));
    }
}
