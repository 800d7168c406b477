//! One WebSocket connection: one descriptor, one reader, one locked writer.
//!
//! A connection is one `TcpStream` (std implements `Read` and `Write` for `&TcpStream`, so no
//! second descriptor is needed):
//! - the **reader** belongs to the connection's own relay thread (a control's is
//!   `relay/control_reader.rs`; a splice leg's first frame is read by the pending loop's
//!   `relay/splice_reader.rs`), both over the pure frame parser of `relay/frames.rs`, so that a
//!   live handover can carry what they hold;
//! - the **writer** sits behind a mutex in [`Socket`]; every frame this process sends on the
//!   connection (the pinger, the cell logic, close frames) goes through it, so frames never
//!   interleave. Frames are encoded here (`relay/frames.rs`' server header) and written
//!   straight from the message, header and payload in one vectored write.
//!
//! The control reader's replies (pong, close) are written through the same mutex.
//! [`Socket::send`] has one deadline for the whole call (the wedge window from its start,
//! checked before each write, never a fresh timeout per write); a writer that misses it marks
//! the socket broken and shuts the connection down, so the connection's thread ends and
//! releases what it holds.
//!
//! **A write never waits on its peer past a handover's quiesce.** A socket made with an
//! *interrupt* ([`Socket::interruptible`]: the quiesce's eventfd) never blocks in `write`: it
//! writes without waiting and, when the peer's buffer is full, polls for room beside the
//! interrupt. When the quiesce begins, a write in progress stops where it is and the rest of
//! its frame is kept in the writer as **owed** bytes; a frame sent while the quiesce lasts is
//! owed whole, nothing written. Owed bytes go to the socket first, before anything else: the
//! next send writes them before its own frame, a resumed connection's thread writes them before
//! it reads ([`Socket::flush_owed`]), a handover carries them ([`Socket::owed`],
//! [`Socket::owe`]), a pair handed to a splice worker takes them as the start of its output
//! ([`Socket::take_owed`]), and the writers that never wait (the pinger, the drain, `close`)
//! treat a socket that owes bytes as busy. So a thread blocked on a slow desktop, or waiting
//! for the writer another thread holds, reaches its frame boundary within the CPU work of the
//! frames it has read (ARCHITECTURE.md "Live handover").
//!
//! Cell-wide threads (the pinger, the lease renewer, the drain) never wait on one socket:
//! [`Socket::try_send`] skips a socket another thread is writing, and otherwise writes the
//! frame without blocking (`MSG_DONTWAIT`): a frame that does not fit whole in the socket's
//! buffer shuts the connection down (nothing may follow half a frame, and a desktop that has
//! let its buffer fill is not reading).
//!
//! Closing: [`Socket::close`] never waits either: the close frame goes out without blocking
//! when the writer is free and it fits, and the connection is shut down at once when another
//! thread is writing or it does not fit; then the [`Reaper`] shuts the TCP connection down one
//! second later if the peer never answered. The reader of a closing connection drops it as soon
//! as the peer's answer (its close frame) arrives; a connection nobody reads any more after its
//! close is read by the reaper for that answer ([`Reaper::watch`]). What lingers there is
//! bounded (`relay/closing.rs`): a connection whose peer has gone, or one past
//! `ORCA_RELAY_CLOSING_CONNECTIONS_MAX`, is closed at once instead.

use std::collections::{BinaryHeap, HashMap};
use std::io::{self, Read};
use std::net::{Shutdown, TcpStream};
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, Sender, TryRecvError};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, TryLockError};
use std::time::{Duration, Instant};

use mio::unix::SourceFd;
use mio::{Events, Interest, Poll, Token, Waker};
use tungstenite::Message;

use super::closing::{self, ClosingBound, Verdict};
use super::frames::CloseAnswer;
use crate::carry::crash::{IO_HOLDING, IO_WRITING};
use crate::clock;
use crate::crash_store::CrashSlot;
use crate::protocol::CloseCode;
use crate::wake::Wake;

/// How long a rejected or closed peer has to answer our close frame before the TCP connection
/// is dropped (SPEC §5.2: within 1 s).
pub const CLOSE_LINGER: Duration = Duration::from_secs(1);

/// How often the reaper retries a close frame whose socket another thread was writing.
const CLOSE_RETRY: Duration = Duration::from_millis(10);

/// Why a send failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SendError {
    /// The socket is closing or closed; nothing was written.
    Closed,
    /// The peer did not drain its buffer within the wedge window, or the write failed.
    Wedged,
}

struct Writer {
    broken: bool,
    /// Bytes owed to the socket before anything else (see the module header): the rest of a
    /// frame a quiesce interrupted, then frames sent while it lasted. Empty: nothing owed.
    owed: Vec<u8>,
    /// When the write of the first owed byte's frame began: its deadline runs from then.
    owed_since: Option<Instant>,
}

impl Writer {
    /// `parts` (one frame), from byte `from` on, owed after what is owed already.
    fn owe(&mut self, parts: &[&[u8]], from: usize, since: Instant) {
        let mut skip = from;
        for part in parts {
            let cut = skip.min(part.len());
            self.owed.extend_from_slice(&part[cut..]);
            skip -= cut;
        }
        self.owed_since.get_or_insert(since);
    }
}

/// The shared side of a connection: the descriptor and the one writer.
pub struct Socket {
    pub id: u64,
    stream: TcpStream,
    writer: Mutex<Writer>,
    closing: AtomicBool,
    bytes_out: AtomicU64,
    /// The deadline of one whole [`Socket::send`] (the wedge window), ms; 0: none.
    send_timeout_ms: AtomicU64,
    /// A handover's quiesce: while set, a write stops waiting and what is left is owed.
    interrupt: Option<Arc<Wake>>,
    /// Its slot in the crash store, once this process keeps it there (`crash_store`): every
    /// write marks it, and a socket kept in the service manager's store is shut down when it is
    /// dropped (the manager's copy of the descriptor would otherwise hold the connection open).
    /// While bytes are owed (see the module header) it stays marked `IO_WRITING`: they may end
    /// half a frame already on the wire, and they are in no crash record.
    crash: OnceLock<CrashSlot>,
}

fn lock_writer(writer: &Mutex<Writer>) -> MutexGuard<'_, Writer> {
    writer
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl Socket {
    /// The shared side of an upgraded stream: the descriptor and its one writer.
    fn wrap(id: u64, stream: TcpStream, interrupt: Option<Arc<Wake>>) -> Arc<Socket> {
        let send_timeout = stream.write_timeout().ok().flatten();
        Arc::new(Socket {
            id,
            writer: Mutex::new(Writer {
                broken: false,
                owed: Vec::new(),
                owed_since: None,
            }),
            closing: AtomicBool::new(false),
            bytes_out: AtomicU64::new(0),
            send_timeout_ms: AtomicU64::new(send_timeout.map_or(0, |t| t.as_millis() as u64)),
            interrupt,
            stream,
            crash: OnceLock::new(),
        })
    }

    /// Keeps this connection's crash-store slot with it (once).
    pub fn keep(&self, slot: CrashSlot) {
        if self.is_closing() {
            slot.set(IO_HOLDING);
        }
        if !lock_writer(&self.writer).owed.is_empty() {
            slot.set(IO_WRITING);
        }
        let _ = self.crash.set(slot);
    }

    /// Its crash-store slot, if this process keeps it in one.
    pub fn crash_slot(&self) -> Option<&CrashSlot> {
        self.crash.get()
    }

    fn mark(&self, flags: u32) {
        if let Some(slot) = self.crash.get() {
            slot.set(flags);
        }
    }

    fn unmark(&self, flags: u32) {
        if let Some(slot) = self.crash.get() {
            slot.clear(flags);
        }
    }

    /// Wraps an upgraded control socket. Its reader is built by the caller
    /// (`relay/control_reader.rs`). Its writes block (within the send timeout) and are never
    /// interrupted: the relay's own sockets are made with [`Socket::interruptible`].
    pub fn new_control(id: u64, stream: TcpStream) -> Arc<Socket> {
        Socket::wrap(id, stream, None)
    }

    /// Wraps an upgraded splice leg (phone or host data). Its reader is built by the caller
    /// (`relay/splice_reader.rs`), which forwards frames as they are.
    pub fn new_splice(id: u64, stream: TcpStream) -> Arc<Socket> {
        Socket::wrap(id, stream, None)
    }

    /// Wraps an upgraded socket that relay threads write (a control, a phone until its pair is
    /// spliced): a write stops waiting when `interrupt` (a handover's quiesce) is set, and the
    /// rest of its frame is owed (see the module header).
    pub fn interruptible(id: u64, stream: TcpStream, interrupt: Arc<Wake>) -> Arc<Socket> {
        Socket::wrap(id, stream, Some(interrupt))
    }

    /// The deadline of one whole [`Socket::send`] from now on (the wedge window).
    pub fn set_send_timeout(&self, timeout: Duration) {
        self.send_timeout_ms
            .store(timeout.as_millis() as u64, Ordering::Relaxed);
    }

    fn send_timeout(&self) -> Option<Duration> {
        match self.send_timeout_ms.load(Ordering::Relaxed) {
            0 => None,
            ms => Some(Duration::from_millis(ms)),
        }
    }

    fn interrupted(&self) -> bool {
        self.interrupt.as_ref().is_some_and(|wake| wake.is_set())
    }

    pub fn stream(&self) -> &TcpStream {
        &self.stream
    }

    /// The peer sent a close frame (with `code`, if it carried one): answer it (once) with the
    /// same code, as RFC 6455 §5.5.1 says an endpoint "typically" does (a library reports the
    /// answer's code as the close's: an empty answer reads as 1005), and stop sending. What is
    /// owed goes first; the answer waits at most [`CLOSE_LINGER`] for the peer (and not past a
    /// quiesce: the connection is closing, it is not carried).
    pub fn acknowledge_close(&self, code: Option<u16>) {
        if self.closing.swap(true, Ordering::AcqRel) {
            return;
        }
        self.mark(IO_HOLDING);
        let mut writer = lock_writer(&self.writer);
        if writer.broken || self.interrupted() {
            return;
        }
        let frame = crate::relay::frames::close_frame(code, "");
        let owed = std::mem::take(&mut writer.owed);
        let deadline = Some(clock::instant() + CLOSE_LINGER);
        let interrupt = self.interrupt.as_deref();
        if write_waiting(&self.stream, &[&owed, &frame], deadline, interrupt) != Wrote::All {
            writer.broken = true;
        }
    }

    pub fn is_closing(&self) -> bool {
        self.closing.load(Ordering::Acquire)
    }

    pub fn bytes_out(&self) -> u64 {
        self.bytes_out.load(Ordering::Relaxed)
    }

    /// Sends one message within one deadline for the whole call: the socket's send timeout
    /// (the wedge window), counted from the start of the call.
    pub fn send(&self, message: Message) -> Result<(), SendError> {
        if self.is_closing() {
            return Err(SendError::Closed);
        }
        let mut writer = lock_writer(&self.writer);
        self.send_locked(&mut writer, message)
    }

    /// Sends one text message without ever waiting, for the cell-wide threads (pinger, lease
    /// renewer, drain): `Ok(false)` when another thread is writing this socket (skipped); the
    /// frame is written with `MSG_DONTWAIT`, and one that does not fit whole in the socket's
    /// buffer shuts the connection down (`Err(Wedged)`): its reader sees the end and the
    /// control leaves as any lost connection does.
    pub fn try_send(&self, message: Message) -> Result<bool, SendError> {
        if self.is_closing() {
            return Err(SendError::Closed);
        }
        let mut writer = match self.writer.try_lock() {
            Ok(writer) => writer,
            Err(TryLockError::WouldBlock) => return Ok(false),
            Err(TryLockError::Poisoned(poisoned)) => poisoned.into_inner(),
        };
        if writer.broken {
            return Err(SendError::Wedged);
        }
        if self.is_closing() {
            return Err(SendError::Closed);
        }
        if !writer.owed.is_empty() {
            // Its thread writes what is owed first: skipped, like a busy writer.
            return Ok(false);
        }
        let frame = match &message {
            Message::Text(text) => server_frame(0x81, text.as_bytes()),
            Message::Binary(payload) => server_frame(0x82, payload),
            // Only text goes through here; anything else takes the ordinary path.
            _ => return self.send_locked(&mut writer, message).map(|()| true),
        };
        self.mark(IO_WRITING);
        if send_without_waiting(&self.stream, &frame) {
            self.unmark(IO_WRITING);
            self.bytes_out
                .fetch_add(message.len() as u64, Ordering::Relaxed);
            Ok(true)
        } else {
            writer.broken = true;
            drop(writer);
            self.shutdown();
            Err(SendError::Wedged)
        }
    }

    /// Sends `text` to each of `owed` whose writer is free, and keeps in `owed` those whose
    /// writer another thread held (a ping, an answer): the caller tries them again soon, so a
    /// frame that must arrive (the drain's) is never dropped for a moment's contention.
    /// Sockets that are closing or wedged leave `owed` unsent: nothing can reach them.
    pub fn send_to_each_free(owed: &mut Vec<Arc<Socket>>, text: &str) {
        owed.retain(|socket| matches!(socket.try_send(Message::text(text)), Ok(false)));
    }

    fn send_locked(&self, writer: &mut Writer, message: Message) -> Result<(), SendError> {
        if writer.broken {
            return Err(SendError::Wedged);
        }
        // A close frame may have gone out while this sender waited for the lock: nothing may
        // follow it.
        if self.is_closing() {
            return Err(SendError::Closed);
        }
        let len = message.len() as u64;
        let (head, head_len, payload) = match encode(&message) {
            Some(encoded) => encoded,
            None => return Err(SendError::Closed),
        };
        let frame: [&[u8]; 2] = [&head[..head_len], payload];
        let started = clock::instant();
        // A crash from here until the frame is out (and nothing is owed) would leave half of
        // it on the wire, or lose it.
        self.mark(IO_WRITING);
        if self.interrupted() {
            // A quiesce: nothing is written, the frame is owed whole after what is owed.
            writer.owe(&frame, 0, started);
            self.bytes_out.fetch_add(len, Ordering::Relaxed);
            return Ok(());
        }
        if !writer.owed.is_empty() {
            match self.write_owed(writer) {
                Ok(true) => {}
                Ok(false) => {
                    writer.owe(&frame, 0, started);
                    self.bytes_out.fetch_add(len, Ordering::Relaxed);
                    return Ok(());
                }
                Err(e) => return Err(e),
            }
        }
        let deadline = self.send_timeout().map(|timeout| started + timeout);
        match write_waiting(&self.stream, &frame, deadline, self.interrupt.as_deref()) {
            Wrote::All => self.unmark(IO_WRITING),
            Wrote::Interrupted(written) => writer.owe(&frame, written, started),
            Wrote::TimedOut(_) | Wrote::Failed => return Err(self.break_down(writer)),
        }
        self.bytes_out.fetch_add(len, Ordering::Relaxed);
        Ok(())
    }

    /// The deadline passed or the write failed, perhaps in the middle of a frame: nothing
    /// more can reach the peer. Shut the connection down (a close frame cannot follow half a
    /// frame, and the writer is stuck), so its reader ends and the connection releases its
    /// seat and unit now, not at its silence.
    fn break_down(&self, writer: &mut Writer) -> SendError {
        writer.broken = true;
        writer.owed = Vec::new();
        self.shutdown();
        SendError::Wedged
    }

    /// Writes what is owed, within the deadline of the write it was part of: `Ok(true)` all
    /// written, `Ok(false)` interrupted again (the rest still owed).
    fn write_owed(&self, writer: &mut Writer) -> Result<bool, SendError> {
        let since = writer.owed_since.unwrap_or_else(clock::instant);
        let deadline = self.send_timeout().map(|timeout| since + timeout);
        let wrote = write_waiting(
            &self.stream,
            &[&writer.owed],
            deadline,
            self.interrupt.as_deref(),
        );
        match wrote {
            Wrote::All => {
                writer.owed = Vec::new();
                writer.owed_since = None;
                Ok(true)
            }
            Wrote::Interrupted(written) => {
                writer.owed.drain(..written);
                Ok(false)
            }
            Wrote::TimedOut(_) | Wrote::Failed => Err(self.break_down(writer)),
        }
    }

    /// Writes what the socket owes (a resumed connection, before anything else), waiting for
    /// the peer within the deadline of the write the bytes were part of. `Ok` also when a
    /// quiesce interrupts it again (the rest stays owed).
    pub fn flush_owed(&self) -> Result<(), SendError> {
        let mut writer = lock_writer(&self.writer);
        if writer.broken {
            return Err(SendError::Wedged);
        }
        if writer.owed.is_empty() || self.interrupted() {
            return Ok(());
        }
        if self.write_owed(&mut writer)? {
            self.unmark(IO_WRITING);
        }
        Ok(())
    }

    /// How long ago the write of what the socket owes began (0: nothing owed), for a
    /// handover's record.
    pub fn owed_age_ms(&self, now: Instant) -> u64 {
        let writer = lock_writer(&self.writer);
        writer.owed_since.map_or(0, |since| {
            now.saturating_duration_since(since).as_millis() as u64
        })
    }

    /// Bytes a handover carried as owed (their write began `age` ago): written first.
    pub fn owe(&self, bytes: Vec<u8>, age: Duration) {
        if bytes.is_empty() {
            return;
        }
        let mut writer = lock_writer(&self.writer);
        self.mark(IO_WRITING);
        let now = clock::instant();
        writer.owed = bytes;
        writer.owed_since = Some(now.checked_sub(age).unwrap_or(now));
    }

    /// Takes what the socket owes: a phone handed to a splice worker, whose leg writes it
    /// before anything else (the worker writes the socket from then on), or a handover's
    /// record (given back with [`Socket::owe`]).
    pub fn take_owed(&self) -> Vec<u8> {
        let mut writer = lock_writer(&self.writer);
        writer.owed_since = None;
        std::mem::take(&mut writer.owed)
    }

    /// Sends the close frame once (later calls do nothing) and schedules the TCP connection to
    /// be dropped after [`CLOSE_LINGER`]. Returns whether this call was the one that closed.
    /// Never waits: with another thread mid-write (its frame cannot be interrupted), the reaper
    /// writes the close frame once that writer is done (within the linger); a close frame that
    /// does not fit in the socket's buffer now shuts the connection down at once.
    pub fn close(self: &Arc<Self>, code: CloseCode, reason: &str, reaper: &Reaper) -> bool {
        if self.closing.swap(true, Ordering::AcqRel) {
            return false;
        }
        self.mark(IO_HOLDING);
        let sent = match self.writer.try_lock() {
            Ok(writer) if !writer.broken && !writer.owed.is_empty() => {
                // Owed bytes go first: the reaper writes them and the close frame as the peer
                // takes them, within the linger.
                drop(writer);
                reaper.close_frames.fetch_add(1, Ordering::AcqRel);
                reaper.send(
                    Doomed::CloseFrame(self.clone(), close_frame_bytes(code.code(), reason)),
                    Duration::ZERO,
                );
                return true;
            }
            Ok(mut writer) => {
                let sent = !writer.broken && {
                    let frame = close_frame_bytes(code.code(), reason);
                    send_without_waiting(&self.stream, &frame)
                };
                if !sent {
                    writer.broken = true;
                }
                sent
            }
            Err(TryLockError::Poisoned(poisoned)) => {
                poisoned.into_inner().broken = true;
                false
            }
            Err(TryLockError::WouldBlock) => {
                // Another thread is writing this socket (a message, a ping): the reaper sends
                // the close frame once it is done, within the linger.
                reaper.close_frames.fetch_add(1, Ordering::AcqRel);
                reaper.send(
                    Doomed::CloseFrame(self.clone(), close_frame_bytes(code.code(), reason)),
                    CLOSE_RETRY,
                );
                return true;
            }
        };
        if sent {
            reaper.schedule(self.clone(), CLOSE_LINGER);
        } else {
            self.shutdown();
        }
        true
    }

    /// The reaper's later attempt at a close frame `close` could not write: `Ok(true)` sent,
    /// `Ok(false)` the writer is still busy, `Err(())` the connection is broken.
    fn try_close_frame(&self, frame: &[u8]) -> Result<bool, ()> {
        let mut writer = match self.writer.try_lock() {
            Ok(writer) => writer,
            Err(TryLockError::WouldBlock) => return Ok(false),
            Err(TryLockError::Poisoned(poisoned)) => poisoned.into_inner(),
        };
        if writer.broken {
            return Err(());
        }
        if !writer.owed.is_empty() {
            // What is owed first, as far as the socket takes it now (a deadline already
            // passed: no waiting).
            let now = Some(clock::instant());
            match write_waiting(&self.stream, &[&writer.owed], now, None) {
                Wrote::All => {
                    writer.owed = Vec::new();
                    writer.owed_since = None;
                }
                Wrote::Interrupted(written) | Wrote::TimedOut(written) => {
                    writer.owed.drain(..written);
                    return Ok(false);
                }
                Wrote::Failed => {
                    writer.broken = true;
                    return Err(());
                }
            }
        }
        if send_without_waiting(&self.stream, frame) {
            return Ok(true);
        }
        writer.broken = true;
        Err(())
    }

    /// Drops the TCP connection now (both directions); the reader thread wakes with an error.
    pub fn shutdown(&self) {
        self.closing.store(true, Ordering::Release);
        self.mark(IO_HOLDING);
        let _ = self.stream.shutdown(Shutdown::Both);
    }
}

impl Drop for Socket {
    /// A socket kept in the service manager's store is shut down as it goes: the manager's
    /// copy of the descriptor would keep the connection open, and its peer would never see it
    /// end. (Its slot, dropped next, clears the record and removes the copy.) Not while a
    /// critical thread's panic unwinds: the process is ending, and the connection is the next
    /// process's to resume (its record stays, flags and all).
    fn drop(&mut self) {
        if self.crash.get().is_some() && !crate::threads::critical_panic_in_flight() {
            let _ = self.stream.shutdown(Shutdown::Both);
        }
    }
}

/// An unmasked server frame (RFC 6455 §5.2): `first` (FIN and opcode), the shortest length,
/// the payload.
fn server_frame(first: u8, payload: &[u8]) -> Vec<u8> {
    let mut head = [0u8; 10];
    let head_len = crate::relay::frames::server_header(first, payload.len(), &mut head);
    let mut frame = Vec::with_capacity(head_len + payload.len());
    frame.extend_from_slice(&head[..head_len]);
    frame.extend_from_slice(payload);
    frame
}

/// A close frame with `code` and `reason` (cut to the 125-byte control limit).
fn close_frame_bytes(code: u16, reason: &str) -> Vec<u8> {
    crate::relay::frames::close_frame(Some(code), reason)
}

/// Writes `frame` whole without blocking (`MSG_DONTWAIT`, `MSG_NOSIGNAL`); `EINTR` is retried.
/// `false` when it did not all fit (then part of it may be on the wire: the caller must not
/// write anything after it) or the connection failed.
fn send_without_waiting(stream: &TcpStream, frame: &[u8]) -> bool {
    let fd = stream.as_raw_fd();
    let mut sent = 0;
    while sent < frame.len() {
        let rest = &frame[sent..];
        // SAFETY: send reads at most `rest.len()` bytes from a live slice; the descriptor is
        // owned by `stream` for the duration of the call.
        let n = unsafe {
            libc::send(
                fd,
                rest.as_ptr().cast(),
                rest.len(),
                libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL,
            )
        };
        if n > 0 {
            sent += n as usize;
            continue;
        }
        let error = io::Error::last_os_error();
        if n < 0 && error.kind() == io::ErrorKind::Interrupted {
            continue;
        }
        return false;
    }
    true
}

/// The frame of `message`: its header (and how many bytes of it) and its payload, which is
/// written from the message as it is (server frames are unmasked). `None` for a raw frame,
/// which the relay never sends.
fn encode(message: &Message) -> Option<([u8; 10], usize, &[u8])> {
    let (first, payload): (u8, &[u8]) = match message {
        Message::Text(text) => (0x81, text.as_bytes()),
        Message::Binary(payload) => (0x82, payload),
        Message::Ping(payload) => (0x89, payload),
        Message::Pong(payload) => (0x8a, payload),
        Message::Close(_) | Message::Frame(_) => return None,
    };
    let mut head = [0u8; 10];
    let head_len = crate::relay::frames::server_header(first, payload.len(), &mut head);
    Some((head, head_len, payload))
}

/// How a write that may wait ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Wrote {
    All,
    /// The interrupt was set while the socket took nothing: this many bytes were written.
    Interrupted(usize),
    /// The deadline passed: this many bytes were written.
    TimedOut(usize),
    Failed,
}

/// Writes `parts` (one frame, or owed bytes) whole, never blocking in `write`: each time the
/// socket takes nothing, polls it for room beside `interrupt`, until `deadline`. `EINTR` is
/// retried. Stops, with what it wrote, when `interrupt` is set and the socket takes nothing.
fn write_waiting(
    stream: &TcpStream,
    parts: &[&[u8]],
    deadline: Option<Instant>,
    interrupt: Option<&Wake>,
) -> Wrote {
    let total: usize = parts.iter().map(|part| part.len()).sum();
    let fd = stream.as_raw_fd();
    let mut written = 0;
    while written < total {
        // The parts from `written` on.
        let mut iov: [libc::iovec; 4] = [libc::iovec {
            iov_base: std::ptr::null_mut(),
            iov_len: 0,
        }; 4];
        let mut count = 0;
        let mut skip = written;
        for part in parts {
            if count == iov.len() {
                break;
            }
            let cut = skip.min(part.len());
            skip -= cut;
            let rest = &part[cut..];
            if !rest.is_empty() {
                iov[count] = libc::iovec {
                    iov_base: rest.as_ptr() as *mut libc::c_void,
                    iov_len: rest.len(),
                };
                count += 1;
            }
        }
        // SAFETY: a zeroed msghdr pointing at `count` iovecs over live slices of `parts`,
        // which outlive the call; sendmsg only reads them.
        let n = unsafe {
            let mut header: libc::msghdr = std::mem::zeroed();
            header.msg_iov = iov.as_mut_ptr();
            header.msg_iovlen = count as _;
            libc::sendmsg(fd, &header, libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL)
        };
        if n > 0 {
            written += n as usize;
            continue;
        }
        let error = io::Error::last_os_error();
        match error.kind() {
            io::ErrorKind::Interrupted if n < 0 => continue,
            io::ErrorKind::WouldBlock if n < 0 => {}
            _ => return Wrote::Failed,
        }
        if interrupt.is_some_and(Wake::is_set) {
            return Wrote::Interrupted(written);
        }
        let timeout = match deadline {
            None => -1,
            Some(deadline) => {
                let left = deadline.saturating_duration_since(clock::instant());
                if left.is_zero() {
                    return Wrote::TimedOut(written);
                }
                // Rounded up: a wait that ends a little early only loops once more.
                left.as_millis().clamp(1, i32::MAX as u128) as libc::c_int
            }
        };
        let mut fds = [
            libc::pollfd {
                fd,
                events: libc::POLLOUT,
                revents: 0,
            },
            libc::pollfd {
                fd: interrupt.map_or(-1, Wake::raw_fd),
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        // SAFETY: two pollfds (a negative descriptor is ignored) for the duration of the call.
        let ready = unsafe { libc::poll(fds.as_mut_ptr(), 2, timeout) };
        if ready < 0 && io::Error::last_os_error().kind() != io::ErrorKind::Interrupted {
            return Wrote::Failed;
        }
        // Room, an error (the next sendmsg finds out), the interrupt or the deadline: the loop
        // looks again.
    }
    Wrote::All
}

/// Reads and discards what the peer still sends, for at most [`CLOSE_LINGER`]: after a 1009
/// close, a client mid-way through an oversized frame can finish its write and read the close
/// frame instead of seeing its connection reset. Returns early once `answer` has seen the
/// client's answer to the close (the rest of the frame skipped by its header).
pub fn drain_for_linger(stream: &TcpStream, answer: &mut CloseAnswer) {
    let started = clock::instant();
    let mut scratch = [0u8; 16 * 1024];
    let mut stream = stream;
    while let Some(left) = CLOSE_LINGER.checked_sub(started.elapsed()) {
        if answer.answered() || left.is_zero() || stream.set_read_timeout(Some(left)).is_err() {
            return;
        }
        match stream.read(&mut scratch) {
            Ok(0) => return,
            Ok(n) => {
                answer.feed(&scratch[..n]);
            }
            // A stop and continue: read again until the linger is up.
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(_) => return,
        }
    }
}

/// Drops TCP connections whose close handshake did not finish in time, and refused upgrades
/// once their answer has had time to arrive. One thread, `reaper`: a `mio` loop over the
/// connections it watches ([`Reaper::watch`]: closed by the relay and read by nobody else),
/// each dropped as soon as its client's answer to the close arrives.
#[derive(Clone)]
pub struct Reaper {
    sender: Sender<(u64, Doomed)>,
    /// Close frames handed to the reaper and not yet written or given up.
    close_frames: Arc<AtomicU64>,
    /// Wakes the thread for each entry sent; the last handle's drop wakes it to end.
    wake: Arc<ReaperWake>,
    /// What may linger here (`relay/closing.rs`).
    closing: Arc<ClosingBound>,
}

/// The reaper thread's waker: dropped with the last [`Reaper`] handle (after its sender), it
/// wakes the thread, which then finds the channel closed and ends.
struct ReaperWake(Waker);

impl Drop for ReaperWake {
    fn drop(&mut self) {
        let _ = self.0.wake();
    }
}

/// The reaper's waker token (watched connections take tokens from 0 up).
const REAPER_WAKER: Token = Token(usize::MAX);
/// Reads of one watched connection per loop turn: a client that is still sending fast (the
/// rest of an oversized frame) waits behind the others instead of holding the reaper.
const WATCH_READS_PER_TURN: usize = 4;
/// One read of a watched connection takes at most this.
const WATCH_READ_BYTES: usize = 16 * 1024;

/// What the reaper drops.
enum Doomed {
    /// A WebSocket connection that sent its close frame.
    Socket(Arc<Socket>),
    /// A refused upgrade: our answer is written, our side shut down.
    Stream(Arc<TcpStream>),
    /// A closing WebSocket connection whose close frame is still to be written (its writer
    /// was busy): retried every `CLOSE_RETRY` for up to `CLOSE_LINGER`, then dropped.
    CloseFrame(Arc<Socket>, Vec<u8>),
    /// A connection (a `Socket` or a `Stream`) to read for its client's answer to our close.
    Watched(Box<Watch>),
    /// The end of the linger of watched connection `token`, if it is still watched then.
    Watching(usize),
}

/// A closed connection the reaper reads: what it is, and where its client's frames stand.
struct Watch {
    doomed: Doomed,
    answer: CloseAnswer,
}

impl Doomed {
    fn shutdown(&self) {
        match self {
            Doomed::Socket(socket) => socket.shutdown(),
            Doomed::Stream(stream) => {
                let _ = stream.shutdown(Shutdown::Both);
            }
            Doomed::CloseFrame(socket, _) => socket.shutdown(),
            Doomed::Watched(watch) => watch.doomed.shutdown(),
            // The reaper's table holds the connection.
            Doomed::Watching(_) => {}
        }
    }

    /// The descriptor of a connection.
    fn fd(&self) -> Option<RawFd> {
        match self {
            Doomed::Socket(socket) | Doomed::CloseFrame(socket, _) => {
                Some(socket.stream().as_raw_fd())
            }
            Doomed::Stream(stream) => Some(stream.as_raw_fd()),
            Doomed::Watched(watch) => watch.doomed.fd(),
            Doomed::Watching(_) => None,
        }
    }

    /// Acts on a due entry at `now` (ms since the reaper's start); `Some` is what to do next
    /// and when. `first_due` is when a close frame was first retried, for its give-up time.
    fn act(self, now: u64, first_due: u64) -> Option<(u64, u64, Doomed)> {
        let Doomed::CloseFrame(socket, frame) = self else {
            self.shutdown();
            return None;
        };
        match socket.try_close_frame(&frame) {
            Ok(true) => Some((
                now + CLOSE_LINGER.as_millis() as u64,
                now,
                Doomed::Socket(socket),
            )),
            Ok(false) if now < first_due + CLOSE_LINGER.as_millis() as u64 => Some((
                now + CLOSE_RETRY.as_millis() as u64,
                first_due,
                Doomed::CloseFrame(socket, frame),
            )),
            _ => {
                socket.shutdown();
                None
            }
        }
    }
}

/// A reaper entry: when it is due, when it was first due (a retried close frame's start), what.
struct Due(u64, u64, Doomed);

impl PartialEq for Due {
    fn eq(&self, other: &Self) -> bool {
        self.0 == other.0
    }
}
impl Eq for Due {}
impl PartialOrd for Due {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Due {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        // A min-heap on the due time.
        other.0.cmp(&self.0)
    }
}

impl Reaper {
    /// Starts the `reaper` thread without a bound on what lingers (peers that have gone are
    /// still closed at once), a critical thread of `liveness`; it ends when every `Reaper`
    /// handle is dropped (with the process: the cell's context holds one for its whole life).
    /// Also returns its [`crate::liveness::Standing`]: stood down at the end of a drain, before
    /// the last handle goes.
    pub fn start(
        liveness: &crate::liveness::Liveness,
    ) -> io::Result<(
        Reaper,
        (std::thread::JoinHandle<()>, crate::liveness::Standing),
    )> {
        Reaper::start_bounded(ClosingBound::unbounded(), liveness)
    }

    /// Starts the `reaper` thread with `closing` bounding the connections that linger.
    pub fn start_bounded(
        closing: Arc<ClosingBound>,
        liveness: &crate::liveness::Liveness,
    ) -> io::Result<(
        Reaper,
        (std::thread::JoinHandle<()>, crate::liveness::Standing),
    )> {
        let (sender, receiver) = mpsc::channel();
        let poll = Poll::new()?;
        let waker = Waker::new(poll.registry(), REAPER_WAKER)?;
        let close_frames = Arc::new(AtomicU64::new(0));
        let owed = close_frames.clone();
        let thread =
            liveness.spawn_critical("reaper", crate::liveness::BEAT_PERIOD, move |beat| {
                run_reaper(receiver, &owed, poll, &beat)
            })?;
        Ok((
            Reaper {
                sender,
                close_frames,
                wake: Arc::new(ReaperWake(waker)),
                closing,
            },
            thread,
        ))
    }

    /// Drops `socket`, which the relay has closed and nobody else reads any more, as soon as
    /// its client has answered the close (its close frame has arrived whole, or its end of
    /// stream), and at the latest `after` from now. `answer` knows where the client's frames
    /// stand.
    pub fn watch(&self, socket: Arc<Socket>, answer: CloseAnswer, after: Duration) {
        let watch = Watch {
            doomed: Doomed::Socket(socket),
            answer,
        };
        self.send(Doomed::Watched(Box::new(watch)), after);
    }

    /// [`Reaper::watch`] for a connection the pending plane closed (not wrapped in a
    /// [`Socket`]).
    pub fn watch_stream(&self, stream: Arc<TcpStream>, answer: CloseAnswer, after: Duration) {
        let watch = Watch {
            doomed: Doomed::Stream(stream),
            answer,
        };
        self.send(Doomed::Watched(Box::new(watch)), after);
    }

    /// Waits (at most `limit`) until every close frame handed to the reaper is written or given
    /// up: the drain calls it before the process exits.
    pub fn wait_for_close_frames(&self, limit: Duration) {
        let until = clock::instant() + limit;
        while self.close_frames.load(Ordering::Acquire) > 0 && clock::instant() < until {
            clock::sleep(CLOSE_RETRY);
        }
    }

    pub fn schedule(&self, socket: Arc<Socket>, after: Duration) {
        self.send(Doomed::Socket(socket), after);
    }

    /// Drops a refused connection `after` from now (the descriptor closes with the last
    /// handle).
    pub fn schedule_stream(&self, stream: Arc<TcpStream>, after: Duration) {
        self.send(Doomed::Stream(stream), after);
    }

    fn send(&self, doomed: Doomed, after: Duration) {
        let Some(doomed) = self.linger_or_close(doomed) else {
            return;
        };
        let due = monotonic_ms() + after.as_millis() as u64;
        match self.sender.send((due, doomed)) {
            Ok(()) => {
                let _ = self.wake.0.wake();
            }
            Err(mpsc::SendError((_, doomed))) => {
                if matches!(doomed, Doomed::CloseFrame(..)) {
                    self.close_frames.fetch_sub(1, Ordering::AcqRel);
                }
                doomed.shutdown();
            }
        }
    }
}

impl Reaper {
    /// `doomed` back when it may linger here; otherwise (its peer has gone, or the closing
    /// bound is reached) it is closed now and `None`. A close frame still owed (at most one
    /// per authenticated connection whose writer was busy) is written first, not counted.
    fn linger_or_close(&self, doomed: Doomed) -> Option<Doomed> {
        let Some((fd, handle)) = doomed.lingering_handle() else {
            return Some(doomed);
        };
        match self.closing.admit(fd, handle) {
            Verdict::Linger => Some(doomed),
            verdict => {
                doomed.close_at_once(verdict);
                None
            }
        }
    }
}

impl Doomed {
    /// The descriptor a lingering connection holds, and a handle that is alive while it is
    /// open.
    fn lingering_handle(&self) -> Option<(std::os::fd::RawFd, closing::Handle)> {
        use std::os::fd::AsRawFd;
        match self {
            Doomed::Socket(socket) => {
                let handle: std::sync::Weak<Socket> = Arc::downgrade(socket);
                Some((socket.stream().as_raw_fd(), handle))
            }
            Doomed::Stream(stream) => {
                let handle: std::sync::Weak<TcpStream> = Arc::downgrade(stream);
                Some((stream.as_raw_fd(), handle))
            }
            Doomed::CloseFrame(..) => None,
            Doomed::Watched(watch) => watch.doomed.lingering_handle(),
            Doomed::Watching(_) => None,
        }
    }

    /// Closes a connection that may not linger: a refused one drained and dropped (abortively
    /// past the bound), a WebSocket (its close frame written) shut down.
    fn close_at_once(self, verdict: Verdict) {
        match self {
            Doomed::Stream(stream) => closing::close_at_once(stream, verdict == Verdict::Full),
            Doomed::Watched(watch) => watch.doomed.close_at_once(verdict),
            doomed => doomed.shutdown(),
        }
    }
}

fn monotonic_ms() -> u64 {
    static START: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
    START.get_or_init(clock::instant).elapsed().as_millis() as u64
}

fn run_reaper(
    receiver: Receiver<(u64, Doomed)>,
    close_frames: &AtomicU64,
    mut poll: Poll,
    beat: &crate::liveness::Beat,
) {
    let mut heap: BinaryHeap<Due> = BinaryHeap::new();
    let mut watched = Watched::default();
    let mut events = Events::with_capacity(256);
    loop {
        beat.beat();
        let now = monotonic_ms();
        while heap.peek().is_some_and(|due| due.0 <= now) {
            if let Some(Due(_, first, doomed)) = heap.pop() {
                if let Doomed::Watching(token) = doomed {
                    // The linger is over: dropped whether or not the client answered.
                    watched.end(&poll, token);
                    continue;
                }
                let was_close_frame = matches!(doomed, Doomed::CloseFrame(..));
                let next = doomed.act(now, first);
                if was_close_frame && !matches!(next, Some((_, _, Doomed::CloseFrame(..)))) {
                    close_frames.fetch_sub(1, Ordering::AcqRel);
                }
                if let Some((due, first, doomed)) = next {
                    heap.push(Due(due, first, doomed));
                }
            }
        }
        // Watched connections that had more to read than one turn takes.
        for token in std::mem::take(&mut watched.ready) {
            watched.read(&poll, token);
        }
        let wait = if watched.ready.is_empty() {
            heap.peek()
                .map(|due| Duration::from_millis(due.0.saturating_sub(now)))
                .unwrap_or(crate::liveness::BEAT_PERIOD)
                .min(crate::liveness::BEAT_PERIOD)
        } else {
            Duration::ZERO
        };
        match poll.poll(&mut events, Some(wait)) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => {
                // Not expected of epoll; wait out the nearest entry rather than spin.
                log::warn!("orca_relay_reaper_poll_failed error={e}");
                clock::sleep(wait.min(CLOSE_RETRY));
            }
        }
        for event in events.iter() {
            if event.token() != REAPER_WAKER {
                watched.read(&poll, event.token().0);
            }
        }
        loop {
            match receiver.try_recv() {
                Ok((due, Doomed::Watched(watch))) => {
                    let doomed = watched.start(&poll, *watch);
                    heap.push(Due(due, due, doomed));
                }
                Ok((due, doomed)) => heap.push(Due(due, due, doomed)),
                Err(TryRecvError::Empty) => break,
                Err(TryRecvError::Disconnected) => {
                    for Due(_, _, doomed) in heap.drain() {
                        doomed.shutdown();
                    }
                    for (_, watch) in watched.table.drain() {
                        watch.doomed.shutdown();
                    }
                    return;
                }
            }
        }
    }
}

/// The connections the reaper reads for their client's answer, by token.
#[derive(Default)]
struct Watched {
    table: HashMap<usize, Watch>,
    next_token: usize,
    /// Tokens with more to read than their last turn took.
    ready: Vec<usize>,
    scratch: Vec<u8>,
}

impl Watched {
    /// Registers `watch` with the poll (the readiness of bytes already there is reported
    /// too); returns the heap entry for its linger. A connection that cannot be registered is
    /// simply dropped at the linger's end.
    fn start(&mut self, poll: &Poll, watch: Watch) -> Doomed {
        let Some(fd) = watch.doomed.fd() else {
            return watch.doomed;
        };
        let token = self.next_token;
        self.next_token = (self.next_token + 1) % REAPER_WAKER.0;
        let registered =
            poll.registry()
                .register(&mut SourceFd(&fd), Token(token), Interest::READABLE);
        if registered.is_err() {
            return watch.doomed;
        }
        self.table.insert(token, watch);
        Doomed::Watching(token)
    }

    /// Reads what `token`'s client sent (at most a few reads a turn); drops the connection once
    /// its answer, its end of stream or an error arrives.
    fn read(&mut self, poll: &Poll, token: usize) {
        if self.scratch.is_empty() {
            self.scratch = vec![0; WATCH_READ_BYTES];
        }
        let Some(watch) = self.table.get_mut(&token) else {
            return;
        };
        let Some(fd) = watch.doomed.fd() else {
            return self.end(poll, token);
        };
        for _ in 0..WATCH_READS_PER_TURN {
            // SAFETY: recv writes at most `scratch.len()` bytes into a live buffer; the
            // descriptor is owned by the watched connection, which the table holds.
            let n = unsafe {
                libc::recv(
                    fd,
                    self.scratch.as_mut_ptr().cast(),
                    self.scratch.len(),
                    libc::MSG_DONTWAIT,
                )
            };
            if n > 0 {
                if watch.answer.feed(&self.scratch[..n as usize]) {
                    return self.end(poll, token);
                }
                continue;
            }
            if n < 0 {
                match io::Error::last_os_error().kind() {
                    io::ErrorKind::WouldBlock => return,
                    io::ErrorKind::Interrupted => continue,
                    _ => {}
                }
            }
            // The end of stream, or the connection failed.
            return self.end(poll, token);
        }
        self.ready.push(token);
    }

    /// Drops `token`'s connection now (if it is still watched).
    fn end(&mut self, poll: &Poll, token: usize) {
        if let Some(watch) = self.table.remove(&token) {
            if let Some(fd) = watch.doomed.fd() {
                let _ = poll.registry().deregister(&mut SourceFd(&fd));
            }
            watch.doomed.shutdown();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;

    /// A connected pair: the relay's side wrapped as a control socket, and the peer's stream.
    fn socket_pair() -> (Arc<Socket>, TcpStream) {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let peer = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (ours, _) = listener.accept().unwrap();
        peer.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        (Socket::new_control(1, ours), peer)
    }

    /// A write to a peer that reads nothing, and a sender waiting for the writer behind it,
    /// both return as soon as the interrupt (a handover's quiesce) is set: the rest of the
    /// first frame and the whole second one are owed, a send during the interrupt is owed
    /// whole, and once the peer reads they arrive first, whole and in order.
    #[test]
    fn an_interrupted_write_owes_the_rest_of_its_frame_and_it_goes_first() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let mut peer = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (ours, _) = listener.accept().unwrap();
        let interrupt = Wake::new().unwrap();
        let socket = Socket::interruptible(1, ours, interrupt.clone());
        socket.set_send_timeout(Duration::from_secs(60));
        let big = vec![7u8; 8 << 20];
        let send = |message: Message| {
            let socket = socket.clone();
            crate::threads::spawn("test-sender", move || socket.send(message)).unwrap()
        };
        let first = send(Message::binary(big.clone()));
        // The second sender waits for the writer the first one holds, writing a frame the
        // peer's buffers cannot take.
        while socket.writer.try_lock().is_ok() {
            std::thread::yield_now();
        }
        let senders = [first, send(Message::text("second"))];
        let set_at = clock::instant();
        interrupt.set();
        for sender in senders {
            assert_eq!(sender.join().unwrap(), Ok(()));
        }
        assert!(
            set_at.elapsed() < Duration::from_secs(5),
            "the senders waited {:?} on a peer that reads nothing",
            set_at.elapsed()
        );
        assert_eq!(socket.send(Message::text("third")), Ok(()));
        assert!(socket.owed_age_ms(clock::instant()) < 60_000);
        // Back to serving: what is owed goes first, then the next frame.
        interrupt.clear();
        let reader = crate::threads::spawn("test-peer", move || {
            peer.set_read_timeout(Some(Duration::from_secs(30)))
                .unwrap();
            let mut bytes = Vec::new();
            let _ = (&mut peer).take((8 << 20) + 64).read_to_end(&mut bytes);
            bytes
        })
        .unwrap();
        socket.flush_owed().unwrap();
        socket.send(Message::text("fourth")).unwrap();
        socket.shutdown();
        let bytes = reader.join().unwrap();
        let mut expected = Vec::new();
        let mut head = [0u8; 10];
        let n = crate::relay::frames::server_header(0x82, big.len(), &mut head);
        expected.extend_from_slice(&head[..n]);
        expected.extend_from_slice(&big);
        for text in ["second", "third", "fourth"] {
            expected.extend_from_slice(&server_frame(0x81, text.as_bytes()));
        }
        assert_eq!(bytes.len(), expected.len());
        assert!(bytes == expected, "the frames whole and in order");
    }

    /// A socket kept in the crash store stays marked `IO_WRITING` while it owes bytes (half a
    /// frame may be on the wire, and the owed bytes are in no record: a crash then must close
    /// it 1012, never resume it), and is unmarked once what it owed is written.
    #[test]
    fn a_socket_that_owes_bytes_is_not_resumable_after_a_crash_until_they_are_written() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let mut peer = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (ours, _) = listener.accept().unwrap();
        let interrupt = Wake::new().unwrap();
        let socket = Socket::interruptible(1, ours, interrupt.clone());
        socket.set_send_timeout(Duration::from_secs(60));
        let registry = crate::metrics::Registry::new();
        let store =
            crate::crash_store::CrashStore::start(4, "/nonexistent/notify".into(), &registry)
                .unwrap();
        let record = crate::crash_store::record_of(
            crate::carry::crash::CrashKind::Control,
            1,
            socket.stream(),
        );
        socket.keep(store.keep(socket.stream(), record, true).unwrap());
        let flags = || socket.crash_slot().unwrap().flags();
        socket.send(Message::text("at rest")).unwrap();
        assert_eq!(flags() & IO_WRITING, 0, "a whole frame written: resumable");
        interrupt.set();
        socket.send(Message::text("during a quiesce")).unwrap();
        assert_ne!(flags() & IO_WRITING, 0, "owed: not resumable");
        interrupt.clear();
        socket.flush_owed().unwrap();
        assert_eq!(flags() & IO_WRITING, 0, "written: resumable again");
        // A connection a handover carried with bytes owed, kept after they were given to it.
        let record = crate::crash_store::record_of(
            crate::carry::crash::CrashKind::Control,
            2,
            socket.stream(),
        );
        let (other, _) = {
            let _ = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
            listener.accept().unwrap()
        };
        let carried = Socket::interruptible(2, other, interrupt.clone());
        carried.owe(b"owed".to_vec(), Duration::ZERO);
        carried.keep(store.keep(carried.stream(), record, true).unwrap());
        assert_ne!(carried.crash_slot().unwrap().flags() & IO_WRITING, 0);
        let mut bytes = vec![0u8; 2 + "at rest".len() + 2 + "during a quiesce".len()];
        peer.read_exact(&mut bytes).unwrap();
    }

    #[test]
    fn a_frame_for_a_busy_writer_stays_owed_until_the_writer_is_free() {
        let (socket, mut peer) = socket_pair();
        let text = r#"{"type":"drain"}"#;
        let mut owed = vec![socket.clone()];
        // Another thread (the pinger) holds the writer: the frame is not dropped, it is owed.
        let writer = lock_writer(&socket.writer);
        Socket::send_to_each_free(&mut owed, text);
        assert_eq!(owed.len(), 1, "still owed while the writer is busy");
        drop(writer);
        Socket::send_to_each_free(&mut owed, text);
        assert!(owed.is_empty(), "sent once the writer is free");
        let mut bytes = vec![0u8; 2 + text.len()];
        peer.read_exact(&mut bytes).unwrap();
        assert_eq!(bytes, server_frame(0x81, text.as_bytes()));
    }

    #[test]
    fn a_close_while_another_thread_writes_still_sends_its_close_frame() {
        let liveness = crate::liveness::Liveness::detached(crate::clock::system());
        let (reaper, _reaper_thread) = Reaper::start(&liveness).unwrap();
        let (socket, mut peer) = socket_pair();
        // Another thread (a sender of this socket) holds the writer for a moment.
        let writer = lock_writer(&socket.writer);
        assert!(socket.close(CloseCode::PeerDropped, "replaced", &reaper));
        assert_eq!(reaper.close_frames.load(Ordering::Acquire), 1, "owed");
        drop(writer);
        // The drain waits for what is owed before the process exits.
        reaper.wait_for_close_frames(Duration::from_secs(5));
        assert_eq!(reaper.close_frames.load(Ordering::Acquire), 0, "written");
        let mut bytes = Vec::new();
        let _ = (&mut peer).take(64).read_to_end(&mut bytes);
        let expected = close_frame_bytes(CloseCode::PeerDropped.code(), "replaced");
        assert_eq!(
            bytes, expected,
            "the close frame, then the end of the connection"
        );
    }
}
