//! One splice leg as a worker holds it: the socket, at most one partial frame, the output the
//! socket could not take yet, and the leg's timers and state. An idle leg holds no buffer at
//! all: both `partial` and `output` give their memory back as soon as they are empty.

use std::io::{self, IoSlice, Read, Write};
use std::net::TcpStream;
use std::sync::Arc;

use super::timers::LegKey;
use crate::metrics::Counter;
use crate::relay::frames::{CloseAnswer, FrameParser};
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

/// A frame forwarded as its payload arrives (see [`Leg::stream_in`]).
#[derive(Debug, Clone, Copy)]
pub struct StreamIn {
    pub left: usize,
    pub mask: [u8; 4],
    /// Payload bytes already forwarded (for the mask's phase).
    pub offset: usize,
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
    /// Where the socket is in the frames written to it.
    pub cursor: FrameCursor,
    /// A frame this leg is sending whose payload is forwarded as it arrives (it is larger than
    /// the worker's read buffer): the payload bytes still to come and how to unmask them.
    pub stream_in: Option<StreamIn>,
    /// Control frames the relay owes this leg's socket (a pong, its idle ping); allocated only
    /// while one is owed.
    pub controls: Option<Box<Controls>>,
    /// `partial[parse_from..filled]` holds frames not parsed yet (the turn's control-frame
    /// budget ran out): they are parsed, from where the parsing stopped, before the next read.
    pub unparsed: bool,
    pub parse_from: usize,
    /// When the leg was last heard from, for the idle timeout: bytes arrived on it (anything:
    /// data, ping, pong), or, while a frame to it was unfinished, its end acknowledged more of
    /// what the relay wrote to it ([`Leg::acknowledged_more`]).
    pub last_heard_ms: u64,
    /// Bytes this process wrote to the socket (wrapping), and what of them the peer had
    /// acknowledged at the idle timer's last look (`None`: not looked yet).
    pub bytes_written: u64,
    pub acked_seen: Option<u64>,
    pub idle_armed: bool,
    /// The relay has queued its own ping since the leg was last heard from (it goes out at the
    /// next frame boundary).
    pub idle_pinged: bool,
    /// The desktop (relay host id) the pair belongs to: its pairs close when its control leaves.
    pub host: Arc<str>,
    pub state: LegState,
    /// Reading stopped because the peer's output is over the bound; resumed when it drains.
    pub paused: bool,
    /// The last time the output moved (or began to wait), for the wedge window.
    pub last_progress_ms: u64,
    pub wedge_armed: bool,
    pub linger_armed: bool,
    /// A [`super::timers::TimerKind::Lease`] timer is scheduled.
    pub lease_armed: bool,
    /// Index of the worker's counters for the frames read from this leg (0: phone → host).
    pub direction: usize,
    /// Readable but not read to `WouldBlock` yet (its per-event budget ran out).
    pub backlogged: bool,
    /// An event reported the peer's end of stream or an error: read to `WouldBlock` or the
    /// end, never stopping at a short read.
    pub hangup_seen: bool,
    /// A closing leg: where its client's frames stand, to drop it as soon as its answer to
    /// the relay's close (its close frame) arrives rather than at the end of the linger.
    pub close_answer: Option<Box<CloseAnswer>>,
    pub _release: Vec<Release>,
    pub kind: &'static str,
    /// What reading this leg holds of the cell's buffer budget: beyond the ordinary amount
    /// of its partial frame and its peer's pending output, the most they can hold, at once.
    pub lease: crate::relay::buffer_budget::Lease,
    /// Reading waits for the budget (counted once per wait).
    pub budget_waiting: bool,
    /// Its last read took all it was allowed (more was likely waiting): the next asks for a
    /// lease rather than read a little at a time.
    pub read_full: bool,
    /// When a read last took all it was allowed (the lease is kept a while after).
    pub last_full_ms: u64,
}

impl Leg {
    pub fn stream(&self) -> &TcpStream {
        self.socket.stream()
    }

    pub fn is_open(&self) -> bool {
        self.state == LegState::Open
    }

    /// The socket took `bytes` the relay wrote to it at `now_ms`: the output moved (the wedge
    /// window starts again). Whether its end is reading is for [`Leg::acknowledged_more`] to
    /// say: a socket also takes bytes when the kernel's send buffer grows, with nobody reading.
    pub fn wrote(&mut self, now_ms: u64, bytes: usize) {
        self.last_progress_ms = now_ms;
        self.bytes_written = self.bytes_written.wrapping_add(bytes as u64);
    }

    /// Whether the peer acknowledged more of what the relay wrote since the last look (the first
    /// look only notes where it stands). Inside a frame that says its end is reading while the
    /// relay's ping cannot reach it (it waits for the end of the frame; a large frame to a slow
    /// phone may take longer than the idle window); the caller asks only then. `false` when the
    /// kernel does not say (`SIOCOUTQ`: bytes written and not yet acknowledged).
    pub fn acknowledged_more(&mut self) -> bool {
        use std::os::fd::AsRawFd;
        let mut unacked: libc::c_int = 0;
        // SAFETY: SIOCOUTQ (TIOCOUTQ) writes one int into a local.
        let asked = unsafe {
            libc::ioctl(
                self.stream().as_raw_fd(),
                libc::TIOCOUTQ,
                &mut unacked as *mut libc::c_int,
            )
        };
        if asked != 0 || unacked < 0 {
            return false;
        }
        // Wrapping: after a handover the queue still holds what the last process wrote.
        let acked = self.bytes_written.wrapping_sub(unacked as u64);
        let more = self
            .acked_seen
            .is_some_and(|seen| (acked.wrapping_sub(seen) as i64) > 0);
        self.acked_seen = Some(acked);
        more
    }

    /// Whether bytes the relay owes or wrote to this leg still wait: in its output, or in the
    /// kernel not yet acknowledged (then the idle timer looks more often, see
    /// [`Leg::acknowledged_more`]).
    pub fn in_flight(&self) -> bool {
        !self.output.is_empty() || self.acked_seen != Some(self.bytes_written)
    }
}

/// What one attempt to write the pending output did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Flushed {
    /// Some or all bytes went out, or there were none to write (`wrote`: how many bytes the
    /// socket took; `empty`: nothing is left).
    Progress { empty: bool, wrote: usize },
    /// The socket takes nothing now; wait for writable.
    Blocked,
    /// The connection failed.
    Failed,
}

/// The longest control frame the relay sends: a 2-byte header and 125 payload bytes.
const CONTROL_FRAME_BYTES: usize = 2 + crate::relay::frames::MAX_CONTROL_PAYLOAD;

/// One control frame the relay sends on its own account (a pong, or its idle ping): whole,
/// at most 127 bytes, with how much of it the socket has taken.
#[derive(Debug, Clone)]
pub struct ControlFrame {
    bytes: [u8; CONTROL_FRAME_BYTES],
    len: u8,
    written: u8,
}

impl ControlFrame {
    /// An unmasked server control frame (`first`: FIN and opcode) with `payload` (at most 125
    /// bytes; longer is cut, which the parser never lets through anyway).
    pub fn new(first: u8, payload: &[u8]) -> ControlFrame {
        let payload = &payload[..payload.len().min(CONTROL_FRAME_BYTES - 2)];
        let mut bytes = [0u8; CONTROL_FRAME_BYTES];
        bytes[0] = first;
        bytes[1] = payload.len() as u8;
        bytes[2..2 + payload.len()].copy_from_slice(payload);
        ControlFrame {
            bytes,
            len: (2 + payload.len()) as u8,
            written: 0,
        }
    }

    fn rest(&self) -> &[u8] {
        &self.bytes[self.written as usize..self.len as usize]
    }

    /// The whole frame and how many of its bytes the socket has taken (a handover carries
    /// them).
    pub fn parts(&self) -> (&[u8], u8) {
        (&self.bytes[..self.len as usize], self.written)
    }

    /// A frame a handover carried; `None` if it is not one the relay could have made.
    pub fn from_parts(frame: &[u8], written: u8) -> Option<ControlFrame> {
        if frame.len() < 2
            || frame.len() > CONTROL_FRAME_BYTES
            || usize::from(written) > frame.len()
        {
            return None;
        }
        let mut bytes = [0u8; CONTROL_FRAME_BYTES];
        bytes[..frame.len()].copy_from_slice(frame);
        Some(ControlFrame {
            bytes,
            len: frame.len() as u8,
            written,
        })
    }
}

/// The control frames a leg owes its socket: at most one being written (once its first byte is
/// out it must be finished before anything else) and at most one waiting. A new pong replaces
/// the waiting one (RFC 6455 §5.5.3: answering only the latest ping is allowed), so a ping flood
/// costs one pending pong, however fast it comes.
#[derive(Debug, Default)]
pub struct Controls {
    in_flight: Option<ControlFrame>,
    next: Option<ControlFrame>,
}

impl Controls {
    pub fn is_empty(&self) -> bool {
        self.in_flight.is_none() && self.next.is_none()
    }

    /// Queues `frame` as the waiting one, replacing what waited.
    pub fn replace_next(&mut self, frame: ControlFrame) {
        self.next = Some(frame);
    }

    /// Whether the waiting frame starts with `first` (the relay's own ping, say).
    pub fn next_is(&self, first: u8) -> bool {
        self.next
            .as_ref()
            .is_some_and(|frame| frame.bytes[0] == first)
    }

    pub fn drop_next(&mut self) {
        self.next = None;
    }

    /// The frame being written and the one waiting (a handover carries them).
    pub fn parts(&self) -> (Option<&ControlFrame>, Option<&ControlFrame>) {
        (self.in_flight.as_ref(), self.next.as_ref())
    }

    pub fn from_parts(in_flight: Option<ControlFrame>, next: Option<ControlFrame>) -> Controls {
        Controls { in_flight, next }
    }
}

/// Where a leg's socket is in the stream of server frames the relay writes to it: how many
/// bytes are left of the frame being written, or the header bytes seen so far. Every byte
/// written to the socket (frames forwarded, streamed payload, close frames) passes through it,
/// so a control frame is put on the wire only between two frames, never inside one (a frame
/// streamed as its payload arrives may be open for a while).
#[derive(Debug, Default, Clone)]
pub struct FrameCursor {
    /// Bytes left of the current frame's payload (and, while `have` is 0, nothing else).
    left: u64,
    /// The header being written, when it is cut between two writes.
    head: [u8; 10],
    have: u8,
}

impl FrameCursor {
    pub fn at_boundary(&self) -> bool {
        self.left == 0 && self.have == 0
    }

    /// Payload bytes left of the frame being written, and the header bytes seen of the next
    /// (a handover carries them).
    pub fn parts(&self) -> (u64, &[u8]) {
        (self.left, &self.head[..self.have as usize])
    }

    /// A cursor a handover carried (a header of more than 10 bytes is cut: never made).
    pub fn from_parts(left: u64, head: &[u8]) -> FrameCursor {
        let mut cursor = FrameCursor {
            left,
            ..FrameCursor::default()
        };
        let have = head.len().min(cursor.head.len());
        cursor.head[..have].copy_from_slice(&head[..have]);
        cursor.have = have as u8;
        cursor
    }

    /// A cursor that knows only that the next `bytes` to be written end at a frame boundary
    /// (output carried from a process that did not track frames: its queue held whole frames,
    /// the first perhaps partly written).
    pub fn opaque(bytes: u64) -> FrameCursor {
        FrameCursor {
            left: bytes,
            ..FrameCursor::default()
        }
    }

    /// At most how many bytes may be written before the next boundary (at least 1 when not at
    /// a boundary).
    fn to_boundary(&self) -> usize {
        if self.have == 0 {
            usize::try_from(self.left).unwrap_or(usize::MAX)
        } else {
            // The rest of the header first (its length is then known).
            let need = match self.head[1] & 0x7f {
                126 => 4,
                127 => 10,
                _ => 2,
            };
            if self.have >= 2 {
                usize::from(need - self.have.min(need)).max(1)
            } else {
                1
            }
        }
    }

    /// `bytes` went out, in order.
    pub fn consume(&mut self, mut bytes: &[u8]) {
        while !bytes.is_empty() {
            if self.left > 0 {
                let k = (self.left.min(bytes.len() as u64)) as usize;
                self.left -= k as u64;
                bytes = &bytes[k..];
                continue;
            }
            self.head[self.have as usize] = bytes[0];
            self.have += 1;
            bytes = &bytes[1..];
            if self.have < 2 {
                continue;
            }
            let need = match self.head[1] & 0x7f {
                126 => 4,
                127 => 10,
                _ => 2,
            };
            if self.have < need {
                continue;
            }
            self.left = match need {
                4 => u64::from(u16::from_be_bytes([self.head[2], self.head[3]])),
                10 => u64::from_be_bytes(self.head[2..10].try_into().unwrap_or([0; 8])),
                _ => u64::from(self.head[1] & 0x7f),
            };
            self.have = 0;
        }
    }
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

    /// Takes the bytes still to write out, leaving the output empty (a handover lends them to
    /// its record; the written ones before them are dropped in place, no copy elsewhere).
    pub fn take_pending(&mut self) -> Vec<u8> {
        let mut bytes = std::mem::take(&mut self.bytes);
        bytes.drain(..self.start.min(bytes.len()));
        self.start = 0;
        bytes
    }

    /// Queues `bytes`, the vector doubling but never past `limit` (the memory its reader's
    /// lease covers: [`super::LEG_ORDINARY_OUTPUT_BYTES`] without one, at most
    /// [`super::OUTPUT_CAPACITY_BYTES`]) unless the bytes themselves need more.
    pub fn push(&mut self, bytes: &[u8], limit: usize) {
        if self.is_empty() {
            self.bytes.clear();
            self.start = 0;
        } else if self.start > 0 && self.start >= self.bytes.len() / 2 {
            self.bytes.drain(..self.start);
            self.start = 0;
        }
        let needed = self.bytes.len() + bytes.len();
        if needed > self.bytes.capacity() {
            let target = (self.bytes.capacity() * 2).clamp(needed, needed.max(limit));
            self.bytes.reserve_exact(target - self.bytes.len());
        }
        self.bytes.extend_from_slice(bytes);
    }

    /// The memory the output holds.
    pub fn capacity(&self) -> usize {
        self.bytes.capacity()
    }

    /// Frees the vector of an empty output that grew past `ordinary` (a large lease's).
    pub fn shrink_if_empty(&mut self, ordinary: usize) {
        if self.is_empty() && self.bytes.capacity() > ordinary {
            self.bytes = Vec::new();
            self.start = 0;
        }
    }

    /// Writes as much as the socket takes now, with `controls` put on the wire at the first
    /// frame boundary (`cursor`); `EINTR` is retried, `WouldBlock` ends it.
    pub fn flush(
        &mut self,
        stream: &TcpStream,
        controls: &mut Controls,
        cursor: &mut FrameCursor,
    ) -> Flushed {
        let mut wrote = 0;
        let mut stream = stream;
        loop {
            if let Some(control) = &mut controls.in_flight {
                match stream.write(control.rest()) {
                    Ok(0) => return Flushed::Failed,
                    Ok(n) => {
                        control.written += n as u8;
                        wrote += n;
                        if control.written < control.len {
                            continue;
                        }
                        controls.in_flight = None;
                    }
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                    Err(_) => return Flushed::Failed,
                }
            }
            if controls.next.is_some() && cursor.at_boundary() {
                controls.in_flight = controls.next.take();
                continue;
            }
            if self.is_empty() {
                break;
            }
            // With a control frame waiting, only up to the next boundary.
            let end = if controls.next.is_some() {
                self.start + cursor.to_boundary().min(self.len())
            } else {
                self.bytes.len()
            };
            match stream.write(&self.bytes[self.start..end]) {
                Ok(0) => return Flushed::Failed,
                Ok(n) => {
                    cursor.consume(&self.bytes[self.start..self.start + n]);
                    self.start += n;
                    wrote += n;
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(_) => return Flushed::Failed,
            }
        }
        let empty = self.is_empty() && controls.is_empty();
        // An idle leg keeps no buffer; one past the ordinary amount is kept while its reader's
        // lease covers it (the worker frees it when it gives the lease back), so a stream does
        // not unmap and map it again at every drain.
        if self.is_empty() && self.bytes.capacity() <= super::LEG_ORDINARY_OUTPUT_BYTES {
            self.bytes = Vec::new();
            self.start = 0;
        }
        if wrote > 0 || empty {
            Flushed::Progress { empty, wrote }
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

/// TCP keepalive on a spliced leg: the first probe after this much idle time, then probes
/// this far apart, this many unanswered before the kernel drops the connection.
pub const KEEPALIVE_IDLE_S: i32 = 30;
pub const KEEPALIVE_INTERVAL_S: i32 = 10;
pub const KEEPALIVE_PROBES: i32 = 3;
/// `TCP_USER_TIMEOUT`: data (or a keepalive probe) unacknowledged this long drops the
/// connection. A phone that vanished (no FIN ever comes) is thus found within about a minute
/// (30 s idle, then 30 s of probes), or 30 s after the relay last wrote to it, and at the latest
/// by the splice idle timeout.
pub const USER_TIMEOUT_MS: u32 = 30_000;

fn set_option(fd: i32, level: i32, name: i32, value: i32) -> io::Result<()> {
    // SAFETY: setsockopt reads `size_of::<c_int>()` bytes from a pointer to a local int.
    let result = unsafe {
        libc::setsockopt(
            fd,
            level,
            name,
            (&value as *const i32).cast(),
            std::mem::size_of::<i32>() as libc::socklen_t,
        )
    };
    if result == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Turns on TCP keepalive and `TCP_USER_TIMEOUT` for a spliced leg.
pub fn set_liveness(stream: &TcpStream) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    let fd = stream.as_raw_fd();
    set_option(fd, libc::SOL_SOCKET, libc::SO_KEEPALIVE, 1)?;
    set_option(fd, libc::IPPROTO_TCP, libc::TCP_KEEPIDLE, KEEPALIVE_IDLE_S)?;
    set_option(
        fd,
        libc::IPPROTO_TCP,
        libc::TCP_KEEPINTVL,
        KEEPALIVE_INTERVAL_S,
    )?;
    set_option(fd, libc::IPPROTO_TCP, libc::TCP_KEEPCNT, KEEPALIVE_PROBES)?;
    set_option(
        fd,
        libc::IPPROTO_TCP,
        libc::TCP_USER_TIMEOUT,
        USER_TIMEOUT_MS as i32,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn get_option(stream: &TcpStream, level: i32, name: i32) -> i32 {
        use std::os::fd::AsRawFd;
        let mut value: i32 = 0;
        let mut len = std::mem::size_of::<i32>() as libc::socklen_t;
        // SAFETY: getsockopt writes at most `len` bytes into a local int.
        let result = unsafe {
            libc::getsockopt(
                stream.as_raw_fd(),
                level,
                name,
                (&mut value as *mut i32).cast(),
                &mut len,
            )
        };
        assert_eq!(result, 0);
        value
    }

    #[test]
    fn a_spliced_leg_has_tcp_keepalive_and_a_user_timeout() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let _client = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (leg, _) = listener.accept().unwrap();
        set_liveness(&leg).unwrap();
        assert_eq!(get_option(&leg, libc::SOL_SOCKET, libc::SO_KEEPALIVE), 1);
        assert_eq!(
            get_option(&leg, libc::IPPROTO_TCP, libc::TCP_KEEPIDLE),
            KEEPALIVE_IDLE_S
        );
        assert_eq!(
            get_option(&leg, libc::IPPROTO_TCP, libc::TCP_KEEPINTVL),
            KEEPALIVE_INTERVAL_S
        );
        assert_eq!(
            get_option(&leg, libc::IPPROTO_TCP, libc::TCP_KEEPCNT),
            KEEPALIVE_PROBES
        );
        assert_eq!(
            get_option(&leg, libc::IPPROTO_TCP, libc::TCP_USER_TIMEOUT),
            USER_TIMEOUT_MS as i32
        );
    }

    #[test]
    fn output_keeps_order_and_frees_its_memory_when_empty() {
        let mut output = Output::default();
        output.push(b"abc", 8);
        output.start = 2;
        output.push(b"def", 8);
        assert_eq!(output.len(), 4);
        assert_eq!(&output.bytes[output.start..], b"cdef");
    }

    #[test]
    fn the_cursor_finds_frame_boundaries_however_the_writes_cut_them() {
        let mut frames = Vec::new();
        let mut head = [0u8; 10];
        for len in [3usize, 0, 200, 70_000, 125] {
            let n = crate::relay::frames::server_header(0x82, len, &mut head);
            frames.extend_from_slice(&head[..n]);
            frames.extend(std::iter::repeat_n(7u8, len));
        }
        let ends = [5usize, 7, 211, 211 + 70_010, 211 + 70_010 + 127];
        for cut in [1usize, 2, 3, 7, 100, 4096, 100_000] {
            let mut cursor = FrameCursor::default();
            let mut at = 0;
            while at < frames.len() {
                let next = (at + cut).min(frames.len());
                cursor.consume(&frames[at..next]);
                at = next;
                assert_eq!(
                    cursor.at_boundary(),
                    ends.contains(&at),
                    "cut {cut} at {at}"
                );
            }
        }
        // Bytes to the boundary: the rest of the payload, or of a header cut in two.
        let mut cursor = FrameCursor::default();
        cursor.consume(&frames[7..9]);
        assert_eq!(cursor.to_boundary(), 2);
        cursor.consume(&frames[9..11]);
        assert_eq!(cursor.to_boundary(), 200);
    }
}
