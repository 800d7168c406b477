//! One splice worker: a `splice-<n>` thread running an edge-triggered `mio` loop over the legs
//! it owns.
//!
//! Per readable event a leg is read into the worker's one read buffer (after the leg's partial
//! frame, if it had one), every whole frame is parsed in place by the strict [`FrameParser`]
//! and the data frames go to the peer's socket in one vectored write, headers re-encoded
//! unmasked, payloads untouched; whatever the peer's socket does not take is copied into the
//! peer's pending output, and the bytes after the last whole frame into the leg's partial
//! frame. Pings are answered on the leg itself (at most one pong owed per leg: the latest
//! ping's), pongs dropped, a close acknowledged and the peer closed 4408; a violation closes
//! the leg 1002 (1009 for size) and the peer 4408.
//!
//! **The rule of the loop: a handler never re-enters another connection's handler.** Reading
//! a leg may write (its peer's frames, its own pong or close), but nothing reached from a
//! write ever reads: a leg that a write made readable again (its peer's output drained under
//! the bound) goes on the backlog and is read in its own turn. Within a read, the data frames
//! staged for the peer are forwarded before anything else that can write. (A nested read from
//! a flush once cleared the outer read's staged frames: frames lost without a trace.)
//!
//! Backpressure: a leg is not read while its peer's pending output is at or over the output
//! bound (1 MiB, [`super::PENDING_OUTPUT_BOUND`]); only its peer's output, never its own, so
//! the two directions of a pair stay independent. It stays readable (edge-triggered: the
//! readiness is remembered) and is put on the backlog as soon as the peer's writes bring the
//! output under the bound. A peer whose output makes no progress for the wedge window is
//! dropped and the leg that sends to it closed 4429, as the thread-per-leg relay did with its
//! socket send timeout.
//!
//! Fairness: a leg gets at most [`READS_PER_TURN`] reads and [`CONTROL_FRAMES_PER_TURN`]
//! control frames per turn; a leg with more waits in the backlog behind the other ready legs.
//!
//! Liveness: a leg not heard from for half the idle window (`ORCA_RELAY_SPLICE_IDLE_MS`) is
//! pinged by the relay; one still silent at the end of the window is closed 4408 and its peer
//! 4408. Heard from: anything arrived from it, or, while a frame to it is unfinished (the
//! relay's ping cannot interrupt it), its end acknowledged more of it: a slow download of a
//! large frame is not silence ([`Leg::acknowledged_more`]). Every leg also has TCP keepalive and
//! `TCP_USER_TIMEOUT`. A pair whose desktop's control has left is closed 4408.

use std::collections::VecDeque;
use std::io;
use std::io::IoSlice;
use std::ops::Range;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, TryRecvError};
use std::sync::Arc;
use std::time::Duration;

use mio::unix::SourceFd;
use mio::{Events, Interest, Poll, Token, Waker};
use tungstenite::protocol::frame::coding::OpCode;

use super::leg::{
    read_once, set_liveness, write_slices, ControlFrame, Controls, Flushed, FrameCursor, Leg,
    LegCounters, LegState, Output, ReadOutcome, StreamIn,
};
use super::parked::{ParkRequest, ParkedPair, ResumedLeg, ResumedPair};
use super::timers::{
    after_pause, idle_step, may_read, wedge_due, IdleStep, LegKey, TimerKind, Timers,
};
use super::{
    Command, LegHandOff, Pair, SpliceTimings, LEG_LARGE_LEASE_BYTES, LEG_ORDINARY_OUTPUT_BYTES,
    OUTPUT_CAPACITY_BYTES,
};
use crate::carry::crash::{CrashKind, IO_HOLDING, IO_READING, IO_WRITING};
use crate::carry::pair::{ControlFrameRecord, CursorRecord, LegRecord, PairRecord, StreamInRecord};
use crate::clock::SharedClock;
use crate::protocol::CloseCode;
use crate::relay::buffer_budget::{BufferBudget, Lease, Side};
use crate::relay::frames::{
    close_frame, server_header, unmask_at, violation_close_code, CloseAnswer, FrameKind, Parsed,
};
use crate::relay::metrics::RelayMetrics;
use crate::relay::socket::Socket;

const WAKER: Token = Token(usize::MAX);
/// Reads one leg gets before the other ready legs have their turn.
pub const READS_PER_TURN: usize = 16;
/// Control frames (pings, pongs) one leg may have parsed in one turn: a ping flood costs the
/// other legs of the worker one short turn per loop, and its sender one pong per turn.
pub const CONTROL_FRAMES_PER_TURN: usize = 64;
/// A data frame at least this long (header included) whose payload has not all arrived is
/// forwarded as it arrives rather than kept whole: keeping its first part would copy it out of
/// the shared read buffer and back (measured on one stream of 64 KiB frames: 5 % of the
/// worker's CPU in `memmove`). Smaller frames are kept until whole (a copy of a few KiB at
/// most), so a sender that leaves in the middle of one costs its peer a close, not a drop.
pub const STREAM_FROM_BYTES: usize = 16 * 1024;
/// The least a read without a lease is worth making (smaller room waits for the output to
/// drain).
const MIN_ORDINARY_READ: usize = 4 * 1024;
/// How long a leg keeps its lease after its last read that took all it was allowed.
const LEASE_KEPT_MS: u64 = 1_000;
/// The first byte of a server ping (FIN, opcode 9) and pong (FIN, opcode 10).
const PING: u8 = 0x89;
const PONG: u8 = 0x8a;
/// The payload of the relay's own ping to a quiet leg.
const IDLE_PING_PAYLOAD: &[u8] = b"orca-relay";
/// Events taken per `epoll_wait`.
const EVENTS: usize = 1024;
/// After `Stop`, legs that have not finished their close by then are dropped.
const STOP_GRACE_MS: u64 = 2_000;

/// A data frame ready to go: where it sits in the work area, its new (unmasked, shorter)
/// header written in place just before its payload.
type Staged = Range<usize>;

pub struct Worker {
    index: usize,
    poll: Poll,
    waker: Arc<Waker>,
    inbox: Receiver<Command>,
    load: Arc<AtomicUsize>,
    slots: Vec<Option<Leg>>,
    generations: Vec<u32>,
    free: Vec<u32>,
    buf: Vec<u8>,
    staged: Vec<Staged>,
    timers: Timers,
    backlog: VecDeque<LegKey>,
    timings: SpliceTimings,
    clock: SharedClock,
    metrics: RelayMetrics,
    /// Counters by the direction of the frames read (phone → host, host → phone) and this
    /// loop's frames and bytes not yet added to them: one atomic add per loop turn, not per
    /// frame, so the workers do not bounce the counters' cache line between cores.
    counters: [LegCounters; 2],
    uncounted: [(u64, u64); 2],
    stop_at: Option<u64>,
    inbox_closed: bool,
    /// The clock, read once per loop turn (arrivals are stamped with it).
    now_ms: u64,
    /// Control frames the leg being read has parsed in this turn.
    turn_controls: usize,
    /// A leg is being read (its turn, frames included): no other leg may be read until it
    /// ends (the rule of the loop, checked in debug builds).
    reading: bool,
    /// The process's pauses: a leg whose silence spans one is not judged by it ([`Worker::fire`]).
    pauses: Arc<crate::pause_clock::PauseClock>,
    /// The worker's beat (a critical thread), set when it runs.
    beat: Option<crate::liveness::Beat>,
    /// The cell's budget for large buffers: legs draw on it past their ordinary amount.
    buffers: Arc<BufferBudget>,
}

impl Worker {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        index: usize,
        inbox: Receiver<Command>,
        load: Arc<AtomicUsize>,
        timings: SpliceTimings,
        clock: SharedClock,
        metrics: RelayMetrics,
        pauses: Arc<crate::pause_clock::PauseClock>,
        buffers: Arc<BufferBudget>,
    ) -> io::Result<Worker> {
        let poll = Poll::new()?;
        let waker = Arc::new(Waker::new(poll.registry(), WAKER)?);
        let phone_counters = LegCounters {
            bytes: metrics.bytes_phone_to_host.clone(),
            frames: metrics.frames_phone_to_host.clone(),
        };
        let host_counters = LegCounters {
            bytes: metrics.bytes_host_to_phone.clone(),
            frames: metrics.frames_host_to_phone.clone(),
        };
        Ok(Worker {
            index,
            poll,
            waker,
            inbox,
            load,
            slots: Vec::new(),
            generations: Vec::new(),
            free: Vec::new(),
            buf: Vec::new(),
            staged: Vec::new(),
            timers: Timers::new(),
            backlog: VecDeque::new(),
            timings,
            clock,
            metrics,
            counters: [phone_counters, host_counters],
            uncounted: [(0, 0); 2],
            stop_at: None,
            inbox_closed: false,
            now_ms: 0,
            turn_controls: 0,
            reading: false,
            pauses,
            beat: None,
            buffers,
        })
    }

    pub fn waker(&self) -> Arc<Waker> {
        self.waker.clone()
    }

    fn now(&self) -> u64 {
        self.now_ms
    }

    fn read_buffer_bytes(&self) -> usize {
        self.timings
            .read_buffer_bytes
            .max(crate::relay::frames::MAX_HEADER_BYTES)
    }

    fn output_bound(&self) -> usize {
        self.timings.output_bound
    }

    /// The loop: wait for events or the next deadline, serve them, fire due timers. Beats once
    /// a turn, and waits at most a beat period.
    pub fn run(mut self, beat: crate::liveness::Beat) {
        let mut events = Events::with_capacity(EVENTS);
        self.beat = Some(beat);
        loop {
            self.beat();
            self.now_ms = self.clock.now_ms();
            let now = self.now();
            if let Some(stop_at) = self.stop_at {
                if self.live_legs() == 0 || now >= stop_at {
                    break;
                }
            } else if self.inbox_closed && self.live_legs() == 0 {
                break;
            }
            let timeout = if self.backlog.is_empty() {
                [self.timers.next_due(), self.stop_at]
                    .into_iter()
                    .flatten()
                    .min()
                    .map_or(crate::liveness::BEAT_PERIOD, |due| {
                        Duration::from_millis(due.saturating_sub(now))
                    })
                    .min(crate::liveness::BEAT_PERIOD)
            } else {
                Duration::ZERO
            };
            let timeout = Some(timeout);
            let polled = self.poll.poll(&mut events, timeout);
            self.now_ms = self.clock.now_ms();
            match polled {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    log::error!(
                        "orca_relay_splice_poll_failed worker={} error={e}",
                        self.index
                    );
                    break;
                }
            }
            for event in events.iter() {
                if event.token() == WAKER {
                    self.take_commands();
                    continue;
                }
                let Some(key) = self.key_of(event.token()) else {
                    continue;
                };
                let hangup = event.is_read_closed() || event.is_error();
                let readable = event.is_readable() || hangup;
                let writable = event.is_writable() || event.is_write_closed();
                if hangup {
                    if let Some(leg) = self.leg(key) {
                        leg.hangup_seen = true;
                    }
                }
                self.guarded(key, |worker| {
                    if writable {
                        worker.flush(key);
                    }
                    if readable {
                        worker.read(key);
                    }
                });
            }
            self.serve_backlog();
            self.fire_timers();
            self.publish_counts();
        }
        self.publish_counts();
        // Whatever is left (stop grace over, or the plane gone) is dropped.
        let keys: Vec<LegKey> = self.slots.iter().flatten().map(|leg| leg.key).collect();
        for key in keys {
            self.remove(key);
        }
    }

    /// One loop turn (or one wait of a parked worker): the thread is making progress.
    fn beat(&self) {
        if let Some(beat) = &self.beat {
            beat.beat();
        }
    }

    fn live_legs(&self) -> usize {
        self.slots.iter().flatten().count()
    }

    /// Runs `body` for `key`; a panic costs that leg and its peer, never the worker. Once it
    /// is done, the pair's crash-store flags say what the legs hold ([`Worker::settle`]); the
    /// reads and writes it made marked them as they went (`IO_READING` before a read,
    /// `IO_WRITING` before a write).
    fn guarded(&mut self, key: LegKey, body: impl FnOnce(&mut Worker)) {
        self.guarded_body(key, body);
        self.settle(key);
    }

    /// The pair of `key` in the crash store once a handler is done: a leg is resumable after a
    /// crash only if the process holds nothing of it (no partial frame, no unparsed frames, no
    /// frame streaming through, no output or owed control frame, no message open, not
    /// closing: otherwise `IO_HOLDING`), and its socket is at a frame boundary (otherwise
    /// `IO_WRITING`: half a frame is on the wire, and no close frame may follow it).
    fn settle(&mut self, key: LegKey) {
        let peer = self.leg(key).and_then(|leg| leg.peer);
        for key in std::iter::once(key).chain(peer) {
            let Some(leg) = self.leg(key) else { continue };
            let Some(slot) = leg.socket.crash_slot() else {
                continue;
            };
            let holding = !leg.is_open()
                || leg.peer.is_none()
                || leg.filled > 0
                || leg.unparsed
                || leg.stream_in.is_some()
                || !leg.output.is_empty()
                || leg.controls.is_some()
                || leg.parser.open_message().is_some();
            let cut = !leg.cursor.at_boundary();
            let flags = if holding { IO_HOLDING } else { 0 } | if cut { IO_WRITING } else { 0 };
            slot.assign(flags);
        }
    }

    /// Writes both legs' crash records as a pair (each names the other), once spliced.
    fn record_pair(&mut self, phone: LegKey, host: LegKey) {
        let ids = [phone, host].map(|key| self.leg(key).map(|leg| leg.socket.id));
        for (key, peer_id) in [(phone, ids[1]), (host, ids[0])] {
            let Some(leg) = self.leg(key) else { continue };
            let Some(slot) = leg.socket.crash_slot() else {
                continue;
            };
            let kind = if leg.kind == "phone" {
                CrashKind::Phone
            } else {
                CrashKind::Data
            };
            let mut record =
                crate::crash_store::record_of(kind, leg.socket.id, leg.socket.stream());
            record.relay_host_id = Some(leg.host.to_string());
            record.peer = peer_id;
            slot.write(&record);
        }
    }

    fn guarded_body(&mut self, key: LegKey, body: impl FnOnce(&mut Worker)) {
        let outcome = crate::threads::catch_panic(|| body(self));
        if outcome.is_err() {
            log::error!(
                "orca_relay_splice_leg_panicked worker={} slot={}",
                self.index,
                key.slot
            );
            self.reading = false;
            let buffer_bytes = self.read_buffer_bytes();
            if self.buf.len() != buffer_bytes {
                self.buf = vec![0; buffer_bytes];
            }
            let peer = self.leg(key).and_then(|leg| leg.peer);
            self.remove(key);
            if let Some(peer) = peer {
                self.remove(peer);
            }
        }
    }

    fn take_commands(&mut self) {
        loop {
            match self.inbox.try_recv() {
                Ok(command) => self.obey(command),
                Err(TryRecvError::Empty) => return,
                Err(TryRecvError::Disconnected) => {
                    self.inbox_closed = true;
                    return;
                }
            }
        }
    }

    fn obey(&mut self, command: Command) {
        match command {
            Command::Splice(pair) => self.add_pair(*pair),
            Command::Resume(pair) => self.add_resumed(*pair),
            Command::CloseHost(host) => self.close_host(&host),
            Command::Stop => self.stop(),
            Command::Park(request) => self.park(request),
            // A handover that gave up on this worker's answer: it took its buffers back then.
            Command::Unpark(pairs) => self.take_back(pairs),
        }
    }

    /// A live handover: export every leg and move nothing until unparked (the handover
    /// failed) or the process exits (it succeeded). Commands that arrive meanwhile wait.
    fn park(&mut self, request: ParkRequest) {
        self.publish_counts();
        let exported = self.export(&request.at);
        if let Err(std::sync::mpsc::SendError(exported)) = request.reply.send(exported) {
            // Nobody takes the answer (the handover gave up waiting): the buffers come back.
            self.take_back(exported);
            return;
        }
        let mut waiting = Vec::new();
        loop {
            // A parked worker is waiting on purpose, and beats while it waits.
            self.beat();
            match self.inbox.recv_timeout(crate::liveness::BEAT_PERIOD) {
                Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {}
                Ok(Command::Unpark(pairs)) => {
                    self.take_back(pairs);
                    break;
                }
                Ok(Command::Park(again)) => {
                    // Everything is lent already.
                    let _ = again.reply.send(Vec::new());
                }
                Ok(other) => waiting.push(other),
                Err(_) => {
                    self.inbox_closed = true;
                    break;
                }
            }
        }
        // The clock moved while parked.
        self.now_ms = self.clock.now_ms();
        for command in waiting {
            self.obey(command);
        }
    }

    /// Every pair (or lone closing leg) this worker holds, as of `at`, each leg's byte buffers
    /// (the bytes not acted on, the pending output) lent to its record, not copied: the worker
    /// moves nothing until unparked, and then takes them back ([`Worker::take_back`]). Called
    /// between two turns: no leg is being read, nothing is staged.
    fn export(&mut self, at: &crate::carry::time::Snapshot) -> Vec<ParkedPair> {
        let mut groups: Vec<(Arc<str>, [Option<LegKey>; 2])> = Vec::new();
        for leg in self.slots.iter().flatten() {
            // Each pair once: from its phone leg, or from a leg whose peer has ended.
            let peer = leg.peer.and_then(|peer| {
                self.slots
                    .get(peer.slot as usize)?
                    .as_ref()
                    .filter(|p| p.key == peer)
            });
            if leg.kind != "phone" && peer.is_some() {
                continue;
            }
            let keys = if leg.kind == "phone" {
                [Some(leg.key), peer.map(|peer| peer.key)]
            } else {
                [peer.map(|peer| peer.key), Some(leg.key)]
            };
            groups.push((leg.host.clone(), keys));
        }
        groups
            .into_iter()
            .map(|(host, keys)| {
                let [(phone, phone_socket), (host_leg, host_socket)] = keys.map(|key| {
                    key.and_then(|key| self.lend(key, at))
                        .map_or((None, None), |(record, socket)| {
                            (Some(record), Some(socket))
                        })
                });
                ParkedPair {
                    record: PairRecord {
                        relay_host_id: Some(host.to_string()).filter(|host| !host.is_empty()),
                        phone,
                        host: host_leg,
                    },
                    phone: phone_socket,
                    host: host_socket,
                    worker: 0,
                    keys,
                }
            })
            .collect()
    }

    /// One leg's record with its buffers moved into it, and its socket.
    fn lend(
        &mut self,
        key: LegKey,
        at: &crate::carry::time::Snapshot,
    ) -> Option<(LegRecord, Arc<Socket>)> {
        let mut record = {
            let leg = self.slots.get(key.slot as usize)?.as_ref()?;
            self.leg_record(leg, at)
        };
        let leg = self.leg(key)?;
        // What was read and not acted on: unparsed whole frames from where parsing stopped,
        // or the start of a frame not yet whole; the leg keeps it from byte 0 once given back.
        let filled = leg.filled.min(leg.partial.len());
        let from = if leg.unparsed {
            leg.parse_from.min(filled)
        } else {
            0
        };
        let mut partial = std::mem::take(&mut leg.partial);
        partial.truncate(filled);
        partial.drain(..from);
        leg.filled = 0;
        leg.parse_from = 0;
        record.partial = partial;
        record.output = leg.output.take_pending();
        Some((record, leg.socket.clone()))
    }

    /// A failed handover gives back what the legs lent ([`Worker::export`]): each leg's bytes
    /// not acted on and its pending output, where they were.
    fn take_back(&mut self, pairs: Vec<ParkedPair>) {
        for pair in pairs {
            let records = [pair.record.phone, pair.record.host];
            for (key, record) in pair.keys.into_iter().zip(records) {
                let (Some(key), Some(record)) = (key, record) else {
                    continue;
                };
                let Some(leg) = self.leg(key) else { continue };
                leg.filled = record.partial.len();
                leg.partial = record.partial;
                leg.parse_from = 0;
                leg.output = Output::carried(record.output);
            }
        }
    }

    /// A leg's record, its byte buffers left empty (see [`Worker::lend`]).
    fn leg_record(&self, leg: &Leg, at: &crate::carry::time::Snapshot) -> LegRecord {
        let linger_left_ms = if leg.linger_armed {
            self.timers
                .due_of(leg.key, TimerKind::Linger)
                .map(|due| at.left_ms(due))
        } else {
            None
        };
        let control = |frame: Option<&ControlFrame>| {
            frame.map(|frame| {
                let (bytes, written) = frame.parts();
                ControlFrameRecord {
                    frame: bytes.to_vec(),
                    written,
                }
            })
        };
        let (in_flight, next) = leg
            .controls
            .as_deref()
            .map_or((None, None), |controls| controls.parts());
        let (left, head) = leg.cursor.parts();
        LegRecord {
            id: leg.socket.id,
            parser: leg.parser.state(),
            partial: Vec::new(),
            needed: if leg.unparsed { 0 } else { leg.needed },
            output: Vec::new(),
            closing: match leg.state {
                LegState::Open => None,
                LegState::Closing { linger } => Some(linger),
            },
            paused: leg.paused,
            hangup_seen: leg.hangup_seen,
            progress_ago_ms: at.age_ms(leg.last_progress_ms),
            linger_left_ms,
            cursor: Some(CursorRecord {
                left,
                head: head.to_vec(),
            }),
            stream_in: leg.stream_in.map(|stream| StreamInRecord {
                left: stream.left,
                mask: stream.mask,
                offset: stream.offset,
            }),
            control_in_flight: control(in_flight),
            control_next: control(next),
            arrival_ago_ms: Some(at.age_ms(leg.last_heard_ms)),
            idle_pinged: leg.idle_pinged,
        }
    }

    /// Takes a pair a live handover brought: its legs as they were, registered, what was owed
    /// written first, the bytes not acted on parsed, their timers going on, then read.
    fn add_resumed(&mut self, pair: ResumedPair) {
        let buffer_bytes = self.read_buffer_bytes();
        if self.buf.len() != buffer_bytes {
            self.buf = vec![0; buffer_bytes];
        }
        let host: Arc<str> = pair.relay_host_id.as_deref().unwrap_or_default().into();
        let mut keys = Vec::new();
        for (resumed, kind) in [(pair.phone, "phone"), (pair.host, "data")] {
            let Some(resumed) = resumed else {
                keys.push(None);
                continue;
            };
            let key = self.allocate();
            let leg = self.resumed_leg(key, resumed, kind, host.clone());
            self.slots[key.slot as usize] = Some(leg);
            keys.push(Some(key));
        }
        if let [Some(phone), Some(host)] = keys[..] {
            for (key, peer) in [(phone, host), (host, phone)] {
                if let Some(leg) = self.leg(key) {
                    leg.peer = Some(peer);
                }
            }
            self.record_pair(phone, host);
            // What a handover carried is already in memory: a reader past its ordinary
            // amount holds its lease even if the budget is short.
            for key in [phone, host] {
                if !self.within_ordinary(key) {
                    if let Some(leg) = self.leg(key) {
                        leg.lease.force(LEG_LARGE_LEASE_BYTES);
                    }
                }
            }
        }
        let keys: Vec<LegKey> = keys.into_iter().flatten().collect();
        for key in &keys {
            let Some(leg) = self.leg(*key) else { continue };
            let fd = leg.stream().as_raw_fd();
            let registered = leg.stream().set_nonblocking(true).and_then(|()| {
                self.poll.registry().register(
                    &mut SourceFd(&fd),
                    Token(key.slot as usize),
                    Interest::READABLE | Interest::WRITABLE,
                )
            });
            if let Err(e) = registered {
                log::warn!("orca_relay_splice_register_failed error={e}");
            }
        }
        let (wedge_ms, now) = (self.timings.wedge_ms, self.now());
        for key in &keys {
            let Some(leg) = self.leg(*key) else { continue };
            let wedge = (!leg.output.is_empty()).then(|| wedge_due(leg.last_progress_ms, wedge_ms));
            leg.wedge_armed = wedge.is_some();
            // The idle step looks at the carried arrival and goes on from there.
            leg.idle_armed = leg.is_open();
            let idle = leg.idle_armed;
            if let Some(due) = wedge {
                self.timers.schedule(due, *key, TimerKind::Wedge);
            }
            if idle {
                self.timers.schedule(now, *key, TimerKind::Idle);
            }
        }
        // What was owed first, then the bytes not acted on, then what the sockets have.
        for key in &keys {
            let key = *key;
            self.guarded(key, |worker| worker.flush(key));
        }
        for key in keys {
            self.guarded(key, |worker| {
                worker.turn_controls = 0;
                worker.reading = true;
                worker.process_carried(key);
                worker.reading = false;
                worker.read(key);
            });
        }
    }

    fn resumed_leg(
        &mut self,
        key: LegKey,
        resumed: ResumedLeg,
        kind: &'static str,
        host: Arc<str>,
    ) -> Leg {
        let record = resumed.record;
        let filled = record.partial.len();
        let state = match record.closing {
            None => LegState::Open,
            Some(linger) => LegState::Closing { linger },
        };
        let linger_armed = match resumed.linger_due_ms {
            Some(due) => {
                self.timers.schedule(due, key, TimerKind::Linger);
                true
            }
            None => false,
        };
        let cursor = match &record.cursor {
            Some(cursor) => FrameCursor::from_parts(cursor.left, &cursor.head),
            None => FrameCursor::opaque(record.output.len() as u64),
        };
        let control = |frame: &Option<ControlFrameRecord>| {
            frame
                .as_ref()
                .and_then(|frame| ControlFrame::from_parts(&frame.frame, frame.written))
        };
        let controls = Controls::from_parts(
            control(&record.control_in_flight),
            control(&record.control_next),
        );
        Leg {
            key,
            socket: resumed.socket,
            peer: None,
            parser: crate::relay::frames::FrameParser::with_state(
                crate::protocol::SPLICE_MAX_FRAME_BYTES,
                record.parser,
            ),
            partial: record.partial,
            filled,
            needed: 0,
            output: Output::carried(record.output),
            cursor,
            stream_in: record.stream_in.map(|stream| StreamIn {
                left: stream.left,
                mask: stream.mask,
                offset: stream.offset,
            }),
            controls: (!controls.is_empty()).then(|| Box::new(controls)),
            unparsed: false,
            parse_from: 0,
            last_heard_ms: resumed.last_heard_ms,
            bytes_written: 0,
            acked_seen: None,
            idle_armed: false,
            idle_pinged: record.idle_pinged,
            host,
            state,
            paused: record.paused,
            last_progress_ms: resumed.last_progress_ms,
            wedge_armed: false,
            linger_armed,
            lease_armed: false,
            direction: if kind == "phone" { 0 } else { 1 },
            backlogged: false,
            hangup_seen: record.hangup_seen,
            // A handover does not carry where a closing leg's frames stood: its end of stream
            // or its linger ends it.
            close_answer: record.closing.map(|_| Box::new(CloseAnswer::unsynced())),
            _release: resumed.release,
            kind,
            lease: Lease::new(&self.buffers),
            budget_waiting: false,
            read_full: false,
            last_full_ms: 0,
        }
    }

    fn stop(&mut self) {
        if self.stop_at.is_some() {
            return;
        }
        self.stop_at = Some(self.now() + STOP_GRACE_MS);
        let keys: Vec<LegKey> = self
            .slots
            .iter()
            .flatten()
            .filter(|leg| leg.is_open())
            .map(|leg| leg.key)
            .collect();
        for key in keys {
            self.close(key, CloseCode::Draining, "draining", true);
        }
    }

    /// The desktop `host`'s control has left: each of its pairs is closed 4408 (SPEC §5.2
    /// "the other side of a splice left"), freeing the phone's place.
    fn close_host(&mut self, host: &str) {
        let keys: Vec<LegKey> = self
            .slots
            .iter()
            .flatten()
            .filter(|leg| leg.is_open() && &*leg.host == host)
            .map(|leg| leg.key)
            .collect();
        for key in keys {
            self.guarded(key, |worker| {
                worker.close(key, CloseCode::PeerDropped, "host left", true)
            });
        }
    }

    // -----------------------------------------------------------------------------------------
    // Legs.

    fn key_of(&self, token: Token) -> Option<LegKey> {
        let slot = u32::try_from(token.0).ok()?;
        let generation = *self.generations.get(slot as usize)?;
        Some(LegKey { slot, generation })
    }

    fn leg(&mut self, key: LegKey) -> Option<&mut Leg> {
        self.slots
            .get_mut(key.slot as usize)?
            .as_mut()
            .filter(|leg| leg.key == key)
    }

    fn allocate(&mut self) -> LegKey {
        let slot = match self.free.pop() {
            Some(slot) => slot,
            None => {
                self.slots.push(None);
                self.generations.push(0);
                (self.slots.len() - 1) as u32
            }
        };
        LegKey {
            slot,
            generation: self.generations[slot as usize],
        }
    }

    fn add_pair(&mut self, pair: Pair) {
        let buffer_bytes = self.read_buffer_bytes();
        if self.buf.len() != buffer_bytes {
            self.buf = vec![0; buffer_bytes];
        }
        let phone_key = self.allocate();
        let phone = self.make_leg(phone_key, pair.phone, "phone", pair.relay_host_id.clone());
        self.slots[phone_key.slot as usize] = Some(phone);
        let host_key = self.allocate();
        let host = self.make_leg(host_key, pair.host, "data", pair.relay_host_id.clone());
        self.slots[host_key.slot as usize] = Some(host);
        for (key, peer) in [(phone_key, host_key), (host_key, phone_key)] {
            if let Some(leg) = self.leg(key) {
                leg.peer = Some(peer);
            }
        }
        self.record_pair(phone_key, host_key);
        let mut failed = false;
        for key in [phone_key, host_key] {
            if let Some(leg) = self.leg(key) {
                let fd = leg.stream().as_raw_fd();
                if let Err(e) = set_liveness(leg.stream()) {
                    // The idle timeout still ends a vanished leg.
                    log::debug!("orca_relay_splice_keepalive_failed error={e}");
                }
                let nonblocking = leg.stream().set_nonblocking(true);
                let token = Token(key.slot as usize);
                let registered = nonblocking.and_then(|()| {
                    self.poll.registry().register(
                        &mut SourceFd(&fd),
                        token,
                        Interest::READABLE | Interest::WRITABLE,
                    )
                });
                if let Err(e) = registered {
                    log::warn!("orca_relay_splice_register_failed error={e}");
                    failed = true;
                }
            }
        }
        if failed || self.stop_at.is_some() {
            for key in [phone_key, host_key] {
                self.close(key, CloseCode::LimitExceeded, "internal error", false);
                self.remove(key);
            }
            return;
        }
        if !(pair.host_present)() {
            // The desktop left while the pair was on its way here.
            for key in [phone_key, host_key] {
                self.close(key, CloseCode::PeerDropped, "host left", true);
            }
            return;
        }
        let now = self.now();
        let idle_due = now + self.timings.idle_ms / 2;
        let wedge_ms = self.timings.wedge_ms;
        for key in [phone_key, host_key] {
            let mut owed = false;
            if let Some(leg) = self.leg(key) {
                leg.idle_armed = true;
                owed = !leg.output.is_empty();
                if owed {
                    leg.last_progress_ms = now;
                    leg.wedge_armed = true;
                }
            }
            self.timers.schedule(idle_due, key, TimerKind::Idle);
            if owed {
                self.timers
                    .schedule(wedge_due(now, wedge_ms), key, TimerKind::Wedge);
                self.guarded(key, |worker| worker.flush(key));
            }
        }
        // Bytes the relay threads had read past the attach are parsed first; then both legs
        // are read (an edge-triggered registration may not report data that arrived before).
        for key in [phone_key, host_key] {
            self.guarded(key, |worker| {
                worker.turn_controls = 0;
                worker.reading = true;
                worker.process_carried(key);
                worker.reading = false;
                worker.read(key);
            });
        }
    }

    fn make_leg(
        &self,
        key: LegKey,
        handoff: LegHandOff,
        kind: &'static str,
        host: std::sync::Arc<str>,
    ) -> Leg {
        let direction = if kind == "phone" { 0 } else { 1 };
        let filled = handoff.buffered.len();
        // What a handover's quiesce left owed on the socket (the rest of a relay-hello the
        // phone did not take yet) is the start of its output: written before any frame, and
        // it ends at a frame boundary.
        let owed = handoff.socket.take_owed();
        let cursor = FrameCursor::opaque(owed.len() as u64);
        Leg {
            key,
            socket: handoff.socket,
            peer: None,
            parser: handoff.parser,
            partial: handoff.buffered,
            filled,
            needed: 0,
            output: Output::carried(owed),
            cursor,
            stream_in: None,
            controls: None,
            unparsed: false,
            parse_from: 0,
            last_heard_ms: self.now(),
            bytes_written: 0,
            acked_seen: None,
            idle_armed: false,
            idle_pinged: false,
            host,
            state: LegState::Open,
            paused: false,
            last_progress_ms: 0,
            wedge_armed: false,
            linger_armed: false,
            lease_armed: false,
            direction,
            backlogged: false,
            hangup_seen: false,
            close_answer: None,
            _release: handoff.release,
            kind,
            lease: Lease::new(&self.buffers),
            budget_waiting: false,
            read_full: false,
            last_full_ms: 0,
        }
    }

    /// Ends a leg now: deregistered, its TCP connection shut down, its unit released.
    fn remove(&mut self, key: LegKey) {
        let Some(slot) = self.slots.get_mut(key.slot as usize) else {
            return;
        };
        if slot.as_ref().is_none_or(|leg| leg.key != key) {
            return;
        }
        let Some(leg) = slot.take() else {
            return;
        };
        let fd = leg.stream().as_raw_fd();
        let _ = self.poll.registry().deregister(&mut SourceFd(&fd));
        leg.socket.shutdown();
        self.generations[key.slot as usize] = key.generation.wrapping_add(1);
        self.free.push(key.slot);
        self.load.fetch_sub(1, Ordering::Relaxed);
        if let Some(peer) = leg.peer {
            if let Some(peer_leg) = self.leg(peer) {
                peer_leg.peer = None;
            }
        }
        // Dropping `leg` releases its connection unit, gauge and (phone) place.
    }

    /// Queues a close frame on `key` (once) and counts it; `linger`: we close first, so wait
    /// for the peer's answer up to the linger once the output is flushed.
    fn close(&mut self, key: LegKey, code: CloseCode, reason: &str, linger: bool) {
        let Some(leg) = self.leg(key) else {
            return;
        };
        if !leg.is_open() {
            return;
        }
        // Where the client's frames stand when the relay closes: in the middle of a frame it
        // streams, or at the start of what was kept unparsed or incomplete.
        let answer = match &leg.stream_in {
            Some(stream) => CloseAnswer::skipping(stream.left as u64),
            None if leg.unparsed => CloseAnswer::after(&leg.partial[leg.parse_from..leg.filled]),
            None => CloseAnswer::after(&leg.partial[..leg.filled]),
        };
        leg.close_answer = Some(Box::new(answer));
        leg.state = LegState::Closing { linger };
        leg.partial = Vec::new();
        leg.filled = 0;
        leg.needed = 0;
        leg.unparsed = false;
        let peer = leg.peer;
        if leg.stream_in.take().is_some() {
            // It was in the middle of a frame to its peer, which can never be finished: the
            // peer gets what was queued for it and then loses its connection (no close frame
            // may follow half a frame).
            if let Some(peer) = peer {
                self.abort(peer, CloseCode::PeerDropped);
            }
        }
        if peer.is_some_and(|peer| self.leg(peer).is_some_and(|p| p.stream_in.is_some())) {
            // Its peer was in the middle of a frame to it (a large frame forwarded as it
            // arrives): the same, for this leg.
            return self.abort(key, code);
        }
        self.push_output(key, &close_frame(Some(code.code()), reason));
        self.metrics.close(code);
        self.flush(key);
    }

    /// Ends `key` without a close frame (it is in the middle of a frame that will never be
    /// finished): what is queued for it is still written, then the connection is dropped.
    fn abort(&mut self, key: LegKey, code: CloseCode) {
        let Some(leg) = self.leg(key) else {
            return;
        };
        if leg.is_open() {
            leg.state = LegState::Closing { linger: false };
            leg.partial = Vec::new();
            leg.filled = 0;
            leg.needed = 0;
            leg.unparsed = false;
            self.metrics.close(code);
        }
        let Some(leg) = self.leg(key) else {
            return;
        };
        if leg.output.is_empty() {
            self.remove(key);
        } else {
            self.flush(key);
        }
    }

    /// The leg's peer is told it left (4408), unless the peer is already closing.
    fn close_peer(&mut self, key: LegKey) {
        if let Some(peer) = self.leg(key).and_then(|leg| leg.peer) {
            self.close(peer, CloseCode::PeerDropped, "peer left", true);
        }
    }

    /// The leg's connection ended (end of stream, an error): its peer is closed 4408.
    fn gone(&mut self, key: LegKey) {
        self.close_peer(key);
        self.remove(key);
    }

    fn push_output(&mut self, key: LegKey, bytes: &[u8]) {
        let now = self.now();
        let wedge_ms = self.timings.wedge_ms;
        let limit = self.output_limit(key);
        let Some(leg) = self.leg(key) else {
            return;
        };
        if leg.output.is_empty() {
            leg.last_progress_ms = now;
        }
        leg.output.push(bytes, limit);
        if !leg.wedge_armed {
            leg.wedge_armed = true;
            let due = wedge_due(leg.last_progress_ms, wedge_ms);
            self.timers.schedule(due, key, TimerKind::Wedge);
        }
    }

    /// Owes `key`'s socket `frame` (a pong, the relay's ping): it replaces the control frame
    /// that waited, if any, and goes out at the next frame boundary of the leg's output.
    fn queue_control(&mut self, key: LegKey, frame: ControlFrame) {
        if let Some(leg) = self.leg(key) {
            leg.controls
                .get_or_insert_with(Box::default)
                .replace_next(frame);
        }
    }

    // -----------------------------------------------------------------------------------------
    // Writing.

    /// Writes the leg's pending output and control frames. When that brings the output under
    /// the bound, a peer paused by it goes on the backlog: it is never read from here (the
    /// rule of the loop).
    fn flush(&mut self, key: LegKey) {
        let now = self.now();
        let linger_ms = self.timings.linger_ms;
        let bound = self.output_bound();
        let Some(leg) = self.leg(key) else {
            return;
        };
        if leg.output.is_empty() && leg.controls.is_none() {
            return;
        }
        if let Some(slot) = leg.socket.crash_slot() {
            slot.set(IO_WRITING);
        }
        let inside_frame = !leg.cursor.at_boundary();
        let flushed = match leg.controls.as_deref_mut() {
            Some(controls) => leg
                .output
                .flush(leg.socket.stream(), controls, &mut leg.cursor),
            None => leg.output.flush(
                leg.socket.stream(),
                &mut Controls::default(),
                &mut leg.cursor,
            ),
        };
        if leg
            .controls
            .as_ref()
            .is_some_and(|controls| controls.is_empty())
        {
            leg.controls = None;
        }
        let empty = match flushed {
            Flushed::Failed => return self.gone(key),
            Flushed::Blocked => return,
            Flushed::Progress { empty, wrote } => {
                leg.wrote(now, wrote);
                // Room in the socket for pending output: its end may be reading. Inside a frame
                // (the relay's ping cannot reach it) that counts as hearing from it; see the
                // idle timer.
                let inside_frame = inside_frame || !leg.cursor.at_boundary();
                if wrote > 0 && leg.acknowledged_more() && inside_frame {
                    leg.last_heard_ms = now;
                }
                empty
            }
        };
        let (state, pending, peer) = (leg.state, leg.output.len(), leg.peer);
        // A closing leg is done once its output is out (a control frame still owed then can
        // only be one that must wait for a frame boundary that will never come).
        let drained = empty || (pending == 0 && !leg.is_open());
        if drained {
            match state {
                LegState::Open => {}
                LegState::Closing { linger: false } => return self.remove(key),
                LegState::Closing { linger: true } => {
                    if let Some(leg) = self.leg(key) {
                        if leg.close_answer.as_ref().is_some_and(|a| a.answered()) {
                            // The client's answer came while our close was still going out.
                            return self.remove(key);
                        }
                        if !leg.linger_armed {
                            leg.linger_armed = true;
                            self.timers
                                .schedule(now + linger_ms, key, TimerKind::Linger);
                        }
                    }
                }
            }
        }
        if let Some(peer) = peer {
            if may_read(pending, bound) {
                self.resume(peer);
            }
        }
    }

    /// A leg paused by its peer's output may read again: it goes on the backlog, to be read in
    /// its own turn.
    fn resume(&mut self, key: LegKey) {
        let Some(leg) = self.leg(key) else {
            return;
        };
        if !leg.paused {
            return;
        }
        leg.paused = false;
        if !leg.backlogged {
            leg.backlogged = true;
            self.backlog.push_back(key);
        }
    }

    /// Sends the staged frames of `from` to its peer: straight from the work area in one
    /// vectored write when nothing is queued before them, the rest copied into the peer's
    /// pending output.
    fn forward(&mut self, from: LegKey, work: &[u8]) {
        if self.staged.is_empty() {
            return;
        }
        let staged = std::mem::take(&mut self.staged);
        let peer = self.leg(from).and_then(|leg| leg.peer);
        let peer = peer.filter(|peer| self.slots_open(*peer));
        let mut failed = false;
        // How much of the staged frames the write took: the rest is copied straight from
        // `work` into the peer's output (no vector of its own, which at a read's size would be
        // mapped and unmapped every time: `buffer_budget::large_buffers_from_the_kernel`).
        let mut skip_written = None;
        let mut owes_control = false;
        if let Some(peer) = peer {
            let now = self.now();
            // Most reads hold a frame or two: their slices live on the stack.
            let mut on_stack = [IoSlice::new(&[]); 16];
            let mut on_heap = Vec::new();
            let slices: &[IoSlice<'_>] = if staged.len() <= on_stack.len() {
                for (slot, frame) in on_stack.iter_mut().zip(&staged) {
                    *slot = IoSlice::new(&work[frame.clone()]);
                }
                &on_stack[..staged.len()]
            } else {
                on_heap.extend(
                    staged
                        .iter()
                        .map(|frame| IoSlice::new(&work[frame.clone()])),
                );
                &on_heap
            };
            let mut written = 0;
            if let Some(leg) = self.leg(peer) {
                owes_control = leg.controls.is_some();
                // A control frame owed to the peer goes first: the frames are queued behind it.
                if leg.output.is_empty() && !owes_control {
                    if let Some(slot) = leg.socket.crash_slot() {
                        slot.set(IO_WRITING);
                    }
                    match write_slices(leg.socket.stream(), slices) {
                        Ok(n) => {
                            written = n;
                            let mut left = n;
                            for slice in slices {
                                let k = left.min(slice.len());
                                leg.cursor.consume(&slice[..k]);
                                left -= k;
                                if left == 0 {
                                    break;
                                }
                            }
                            if n > 0 {
                                leg.wrote(now, n);
                            }
                        }
                        Err(_) => failed = true,
                    }
                }
            }
            if !failed {
                skip_written = Some(written);
            }
        }
        if let Some(peer) = peer {
            if failed {
                // The peer's connection failed: it is gone, and this leg is told (4408).
                self.gone(peer);
            } else if let Some(mut skip) = skip_written {
                let mut pushed = false;
                for frame in &staged {
                    let len = frame.end - frame.start;
                    if skip >= len {
                        skip -= len;
                        continue;
                    }
                    self.push_output(peer, &work[frame.start + skip..frame.end]);
                    skip = 0;
                    pushed = true;
                }
                if pushed && owes_control {
                    self.flush(peer);
                }
            }
        }
        self.staged = recycle(staged);
    }

    fn slots_open(&mut self, key: LegKey) -> bool {
        self.leg(key).is_some_and(|leg| leg.is_open())
    }

    // -----------------------------------------------------------------------------------------
    // Reading.

    /// Reads `key` until `WouldBlock`, backpressure, the end of its turn (reads or control
    /// frames), or its end.
    fn read(&mut self, key: LegKey) {
        debug_assert!(!self.reading, "a handler re-entered another's");
        self.reading = true;
        self.read_turn(key);
        self.reading = false;
        // A leg that streams keeps its lease (and its peer's output its vector) from turn to
        // turn; its lease timer gives it back once it has not filled a read for a while
        // (`TimerKind::Lease`). (Freeing and mapping the vector at every drain of a 3 GB/s
        // stream cost a third more CPU per byte.)
    }

    /// How much one read of `key` may take, its peer's output holding `peer_pending` bytes:
    /// what fits in the ordinary amount, or a whole read buffer once its lease holds the most
    /// reading it can need. `None`: not even [`MIN_ORDINARY_READ`] fits and the budget cannot
    /// give the lease; the leg waits (counted) until its peer's output drains, whose flush
    /// resumes it.
    fn read_allowance(&mut self, key: LegKey, peer_pending: usize) -> Option<usize> {
        let whole = self.read_buffer_bytes();
        let now = self.now();
        let leg = self.leg(key)?;
        if leg.lease.held() > 0 {
            return Some(whole);
        }
        let room = LEG_ORDINARY_OUTPUT_BYTES.saturating_sub(peer_pending + 128);
        // Small messages never touch the budget: a lease is asked for only once a read filled
        // what the ordinary amount allowed, or nothing fits in it.
        if room >= whole || (room >= MIN_ORDINARY_READ && !leg.read_full) {
            return Some(room.min(whole));
        }
        if leg.lease.cover(LEG_LARGE_LEASE_BYTES) {
            leg.budget_waiting = false;
            if !leg.lease_armed {
                leg.lease_armed = true;
                self.timers
                    .schedule(now.saturating_add(LEASE_KEPT_MS), key, TimerKind::Lease);
            }
            return Some(whole);
        }
        if room >= MIN_ORDINARY_READ {
            return Some(room);
        }
        if !leg.budget_waiting {
            leg.budget_waiting = true;
            self.buffers.count_wait(Side::Splice);
        }
        None
    }

    /// The most the output of `key` may grow to: what the lease of its reader (its peer)
    /// covers.
    fn output_limit(&mut self, key: LegKey) -> usize {
        let reader = self.leg(key).and_then(|leg| leg.peer);
        match reader.and_then(|reader| self.leg(reader)) {
            Some(reader) if reader.lease.held() > 0 => OUTPUT_CAPACITY_BYTES,
            _ => LEG_ORDINARY_OUTPUT_BYTES,
        }
    }

    /// Whether what reading `key` holds (its partial frame, its peer's output) is within the
    /// ordinary amount.
    fn within_ordinary(&mut self, key: LegKey) -> bool {
        let Some(leg) = self.leg(key) else {
            return true;
        };
        let (partial, peer) = (leg.partial.capacity(), leg.peer);
        let output = peer
            .and_then(|peer| self.leg(peer))
            .map_or(0, |peer| peer.output.capacity());
        partial <= STREAM_FROM_BYTES + crate::relay::frames::MAX_HEADER_BYTES
            && output <= LEG_ORDINARY_OUTPUT_BYTES
    }

    /// Gives the lease of `key`'s reading back once what it holds is ordinary again (its
    /// peer's output, if empty, freed first). While the lease is held the output keeps its
    /// vector: a stream does not map and unmap it at every drain.
    fn settle_lease(&mut self, key: LegKey) {
        if self.leg(key).is_none_or(|leg| leg.lease.held() == 0) {
            return;
        }
        if let Some(peer) = self.leg(key).and_then(|leg| leg.peer) {
            if let Some(peer) = self.leg(peer) {
                peer.output.shrink_if_empty(LEG_ORDINARY_OUTPUT_BYTES);
            }
        }
        if self.within_ordinary(key) {
            if let Some(leg) = self.leg(key) {
                leg.lease.settle(0);
            }
        }
    }

    fn read_turn(&mut self, key: LegKey) {
        self.turn_controls = 0;
        let bound = self.output_bound();
        for _ in 0..READS_PER_TURN {
            let Some(leg) = self.leg(key) else {
                return;
            };
            if !leg.is_open() {
                return self.discard(key);
            }
            // Paused only by the peer's output (the data it would forward), never by its own:
            // the two directions of a pair stay independent.
            let peer = leg.peer;
            let peer_pending = match peer {
                Some(peer) => self.leg(peer).map_or(0, |p| p.output.len()),
                None => 0,
            };
            let allowance = match may_read(peer_pending, bound) {
                true => self.read_allowance(key, peer_pending),
                false => None,
            };
            let Some(allowance) = allowance else {
                if let Some(leg) = self.leg(key) {
                    leg.paused = true;
                }
                return;
            };
            if !self.read_step(key, allowance) {
                return;
            }
            if self.turn_controls >= CONTROL_FRAMES_PER_TURN {
                break;
            }
        }
        if let Some(leg) = self.leg(key) {
            if !leg.backlogged {
                leg.backlogged = true;
                self.backlog.push_back(key);
            }
        }
    }

    /// Something arrived on `key`: it is alive (the idle window starts again).
    fn arrived(&mut self, key: LegKey) {
        let now = self.now();
        if let Some(leg) = self.leg(key) {
            leg.last_heard_ms = now;
            leg.idle_pinged = false;
            // The relay's own ping, not sent yet, is no longer needed.
            if let Some(controls) = leg.controls.as_deref_mut() {
                if controls.next_is(PING) {
                    controls.drop_next();
                }
                if controls.is_empty() {
                    leg.controls = None;
                }
            }
        }
    }

    /// One read and the frames it completes; `false` when reading has to stop.
    /// One read of at most `allowance` bytes ([`Worker::read_allowance`]); whether the leg may
    /// have more to read.
    fn read_step(&mut self, key: LegKey, allowance: usize) -> bool {
        let now = self.now();
        let buffer_len = self.read_buffer_bytes();
        if self.buf.len() != buffer_len {
            self.buf = vec![0; buffer_len];
        }
        let Some(leg) = self.leg(key) else {
            return false;
        };
        if leg.unparsed {
            // Frames left from the last turn: parsed, from where it stopped, before anything
            // more is read.
            leg.unparsed = false;
            let from = std::mem::take(&mut leg.parse_from);
            let work = std::mem::take(&mut leg.partial);
            let filled = std::mem::take(&mut leg.filled);
            leg.needed = 0;
            self.process_own(key, work, filled, from);
            return true;
        }
        if let Some(stream) = leg.stream_in {
            // The payload of a large frame: forwarded as it arrives, unmasked in place; what
            // follows it in the same read is parsed as usual.
            let hangup = leg.hangup_seen;
            let mut work = std::mem::take(&mut self.buf);
            let Some(leg) = self.leg(key) else {
                self.buf = work;
                return false;
            };
            if let Some(slot) = leg.socket.crash_slot() {
                slot.set(IO_READING);
            }
            let space = allowance.min(work.len());
            let outcome = read_once(leg.socket.stream(), &mut work[..space]);
            let more = match outcome {
                ReadOutcome::Bytes(n) => {
                    leg.read_full = n == space;
                    if leg.read_full {
                        leg.last_full_ms = now;
                    }
                    let k = stream.left.min(n);
                    unmask_at(&mut work[..k], stream.mask, stream.offset);
                    leg.stream_in = (k < stream.left).then_some(StreamIn {
                        left: stream.left - k,
                        offset: stream.offset + k,
                        ..stream
                    });
                    self.arrived(key);
                    self.staged.clear();
                    self.staged.push(0..k);
                    self.count_bytes(key, k as u64);
                    if let Some(at) = self.process(key, &mut work[..n], k) {
                        self.keep_unparsed(key, work[at..n].to_vec(), 0);
                    }
                    n == space || hangup || self.leg(key).is_some_and(|leg| leg.unparsed)
                }
                ReadOutcome::WouldBlock => false,
                ReadOutcome::Gone => {
                    self.buf = work;
                    self.gone(key);
                    return false;
                }
            };
            self.buf = work;
            more
        } else {
            let have = leg.filled;
            let mut work = std::mem::take(&mut self.buf);
            let Some(leg) = self.leg(key) else {
                self.buf = work;
                return false;
            };
            work[..have].copy_from_slice(&leg.partial[..have]);
            let hangup = leg.hangup_seen;
            let space = (work.len() - have).min(allowance);
            if let Some(slot) = leg.socket.crash_slot() {
                slot.set(IO_READING);
            }
            let outcome = read_once(leg.socket.stream(), &mut work[have..have + space]);
            let more = match outcome {
                ReadOutcome::Bytes(n) => {
                    leg.read_full = n == space;
                    if leg.read_full {
                        leg.last_full_ms = now;
                    }
                    leg.partial = Vec::new();
                    leg.filled = 0;
                    leg.needed = 0;
                    self.arrived(key);
                    if let Some(at) = self.process(key, &mut work[..have + n], 0) {
                        self.keep_unparsed(key, work[at..have + n].to_vec(), 0);
                    }
                    // A read shorter than the space drained the socket (as nginx assumes):
                    // bytes that arrive later bring a new edge, so the read that would only
                    // say `WouldBlock` is saved. Not once the peer has hung up: its end of
                    // stream may have come with the data, in the same edge. Not when the
                    // turn's control budget left frames unparsed either.
                    n == space || hangup || self.leg(key).is_some_and(|leg| leg.unparsed)
                }
                ReadOutcome::WouldBlock => false,
                ReadOutcome::Gone => {
                    self.buf = work;
                    self.gone(key);
                    return false;
                }
            };
            self.buf = work;
            more
        }
    }

    /// Parses the bytes the relay thread handed over with the leg.
    fn process_carried(&mut self, key: LegKey) {
        let Some(leg) = self.leg(key) else {
            return;
        };
        if leg.filled == 0 {
            leg.partial = Vec::new();
            return;
        }
        let work = std::mem::take(&mut leg.partial);
        let filled = leg.filled;
        leg.filled = 0;
        self.process_own(key, work, filled, 0);
    }

    /// Processes `work[from..filled]`, a buffer of the leg's own; what the control budget left
    /// unparsed stays in it (no copy).
    fn process_own(&mut self, key: LegKey, mut work: Vec<u8>, filled: usize, from: usize) {
        if let Some(at) = self.process(key, &mut work[..filled], from) {
            work.truncate(filled);
            self.keep_unparsed(key, work, at);
        }
    }

    /// The turn's control budget ran out at `bytes[from..]`: those frames wait, unparsed, for
    /// the leg's next turn (behind the other ready legs). They arrived: the memory is theirs.
    fn keep_unparsed(&mut self, key: LegKey, bytes: Vec<u8>, from: usize) {
        if let Some(leg) = self.leg(key) {
            if leg.is_open() && from < bytes.len() {
                leg.filled = bytes.len();
                leg.partial = bytes;
                leg.parse_from = from;
                leg.needed = 0;
                leg.unparsed = true;
            }
        }
    }

    /// Handles whole frames at the front of `work` (until the turn's control budget runs out);
    /// keeps the rest as the leg's partial frame (or unparsed frames). The data frames are
    /// forwarded first, then the pong owed (if any) is written.
    ///
    /// Starts at `from`; returns where it stopped when the control budget ran out (the caller
    /// keeps `work[at..]` unparsed).
    fn process(&mut self, key: LegKey, work: &mut [u8], from: usize) -> Option<usize> {
        let stopped = self.process_frames(key, work, from);
        if self.leg(key).is_some_and(|leg| leg.controls.is_some()) {
            self.flush(key);
        }
        stopped
    }

    fn process_frames(&mut self, key: LegKey, work: &mut [u8], from: usize) -> Option<usize> {
        let buffer_len = self.read_buffer_bytes();
        let mut at = from;
        let mut stopped = None;
        let mut frames = 0u64;
        let mut bytes = 0u64;
        // `staged` may already hold the payload of a frame streamed in this read.
        loop {
            let budget_spent = self.turn_controls >= CONTROL_FRAMES_PER_TURN;
            let Some(leg) = self.leg(key) else {
                self.staged.clear();
                return None;
            };
            if !leg.is_open() {
                break;
            }
            if budget_spent && at < work.len() {
                // The turn's budget is spent: the rest waits for the leg's next turn.
                stopped = Some(at);
                break;
            }
            match leg.parser.parse(&mut work[at..]) {
                Parsed::Frame(frame) => {
                    let payload = at + frame.header_len..at + frame.wire_len();
                    at += frame.wire_len();
                    match frame.kind {
                        FrameKind::Data(data) => {
                            let first =
                                u8::from(OpCode::Data(data)) | if frame.fin { 0x80 } else { 0 };
                            let mut head = [0u8; 10];
                            let head_len = server_header(first, payload.len(), &mut head);
                            // The client's header had a 4-byte mask (the parser refuses an
                            // unmasked frame) and a length at least as wide as the shortest,
                            // so the new header always fits in its place and the frame goes
                            // out as one slice.
                            let start = payload.start - head_len;
                            work[start..payload.start].copy_from_slice(&head[..head_len]);
                            frames += 1;
                            bytes += payload.len() as u64;
                            self.staged.push(start..payload.end);
                        }
                        FrameKind::Ping => {
                            // Owed, not written here: one pong per leg at most, the latest
                            // ping's, written once the staged frames are forwarded.
                            self.turn_controls += 1;
                            self.queue_control(key, ControlFrame::new(PONG, &work[payload]));
                        }
                        FrameKind::Pong => self.turn_controls += 1,
                        FrameKind::Close { code } => {
                            self.forward(key, work);
                            self.close_peer(key);
                            // Answered with the client's own code (RFC 6455 §5.5.1: a library
                            // reports an empty answer as 1005); the peer initiated, so no
                            // linger once it is written.
                            if let Some(leg) = self.leg(key) {
                                if leg.is_open() {
                                    leg.state = LegState::Closing { linger: false };
                                    self.push_output(key, &close_frame(code, ""));
                                    self.flush(key);
                                }
                            }
                            self.count(key, frames, bytes);
                            return None;
                        }
                    }
                }
                Parsed::Incomplete { needed } => {
                    let leg = self.leg(key)?;
                    if needed > buffer_len || needed >= STREAM_FROM_BYTES {
                        if let Some(start) = leg.parser.begin_stream(&work[at..]) {
                            // Larger than the read buffer, or large enough that keeping its
                            // first part would cost two copies of it: its header goes to the
                            // peer now and its payload as it arrives (memory follows the bytes
                            // that arrived, never the length the header declares).
                            let payload_start = at + start.header_len;
                            let have = work.len() - payload_start;
                            unmask_at(&mut work[payload_start..], start.mask, 0);
                            let mut head = [0u8; 10];
                            let head_len = server_header(start.first, start.payload_len, &mut head);
                            let frame_start = payload_start - head_len;
                            work[frame_start..payload_start].copy_from_slice(&head[..head_len]);
                            leg.stream_in = Some(StreamIn {
                                left: start.payload_len - have,
                                mask: start.mask,
                                offset: have,
                            });
                            frames += 1;
                            bytes += have as u64;
                            self.staged.push(frame_start..work.len());
                            break;
                        }
                    }
                    // Only what arrived is kept: at most a frame that fits the read buffer.
                    let rest = &work[at..];
                    leg.partial = rest.to_vec();
                    leg.filled = rest.len();
                    leg.needed = needed;
                    break;
                }
                Parsed::Violation(violation) => {
                    self.forward(key, work);
                    let leg = self.leg(key)?;
                    let (id, kind) = (leg.socket.id, leg.kind);
                    log::info!(
                        "orca_relay_splice_protocol_violation conn={id} rule={} kind={kind}",
                        violation.name()
                    );
                    let code = violation_close_code(violation);
                    self.close(key, code, violation.name(), true);
                    if let Some(leg) = self.leg(key) {
                        // The refused frame's header is at `at`: its rest is skipped by the
                        // length it declares, then the client's answer comes.
                        leg.close_answer = Some(Box::new(CloseAnswer::after(&work[at..])));
                    }
                    self.close_peer(key);
                    self.count(key, frames, bytes);
                    return None;
                }
            }
        }
        self.forward(key, work);
        self.count(key, frames, bytes);
        stopped
    }

    /// Streamed payload bytes forwarded (the frame itself was counted when it began).
    fn count_bytes(&mut self, key: LegKey, bytes: u64) {
        if let Some(leg) = self.leg(key) {
            self.uncounted[leg.direction].1 += bytes;
        }
    }

    fn count(&mut self, key: LegKey, frames: u64, bytes: u64) {
        if frames == 0 && bytes == 0 {
            return;
        }
        if let Some(leg) = self.leg(key) {
            let direction = leg.direction;
            let (f, b) = &mut self.uncounted[direction];
            *f += frames;
            *b += bytes;
        }
    }

    /// Adds this turn's frames and bytes to the shared counters.
    fn publish_counts(&mut self) {
        for (counters, (frames, bytes)) in self.counters.iter().zip(self.uncounted.iter_mut()) {
            if *frames > 0 {
                counters.frames.add(*frames);
                counters.bytes.add(*bytes);
                *frames = 0;
                *bytes = 0;
            }
        }
    }

    /// A closing leg: what the peer still sends is read and thrown away (so a client in the
    /// middle of a large write can finish it and read our close frame), until it closes.
    fn discard(&mut self, key: LegKey) {
        let buffer_len = self.read_buffer_bytes();
        if self.buf.len() != buffer_len {
            self.buf = vec![0; buffer_len];
        }
        for _ in 0..READS_PER_TURN {
            let mut work = std::mem::take(&mut self.buf);
            let outcome = match self.leg(key) {
                Some(leg) => read_once(leg.socket.stream(), &mut work),
                None => ReadOutcome::WouldBlock,
            };
            let answered = match (outcome, self.leg(key)) {
                (ReadOutcome::Bytes(n), Some(leg)) => leg
                    .close_answer
                    .as_mut()
                    .is_some_and(|answer| answer.feed(&work[..n])),
                _ => false,
            };
            self.buf = work;
            match outcome {
                ReadOutcome::Bytes(_) if answered => {
                    // The client answered the close: the handshake is complete, the
                    // connection ends now (once our close frame is out).
                    if self.leg(key).is_some_and(|leg| leg.output.is_empty()) {
                        return self.remove(key);
                    }
                }
                ReadOutcome::Bytes(_) => {}
                ReadOutcome::WouldBlock => return,
                ReadOutcome::Gone => return self.remove(key),
            }
        }
        if let Some(leg) = self.leg(key) {
            if !leg.backlogged {
                leg.backlogged = true;
                self.backlog.push_back(key);
            }
        }
    }

    fn serve_backlog(&mut self) {
        for _ in 0..self.backlog.len() {
            let Some(key) = self.backlog.pop_front() else {
                return;
            };
            let Some(leg) = self.leg(key) else {
                continue;
            };
            leg.backlogged = false;
            if leg.paused {
                continue;
            }
            self.guarded(key, |worker| worker.read(key));
        }
    }

    // -----------------------------------------------------------------------------------------
    // Timers.

    fn fire_timers(&mut self) {
        let now = self.now();
        while let Some((key, kind)) = self.timers.pop_due(now) {
            self.guarded(key, |worker| worker.fire(key, kind, now));
        }
    }

    fn fire(&mut self, key: LegKey, kind: TimerKind, now: u64) {
        let wedge_ms = self.timings.wedge_ms;
        let idle_ms = self.timings.idle_ms;
        // Asked before the leg is borrowed; only an idle timer uses it.
        let pause_end = match kind {
            TimerKind::Idle => self
                .pauses
                .ended_ago_ms()
                .map(|ago| now.saturating_sub(ago)),
            TimerKind::Wedge | TimerKind::Linger | TimerKind::Lease => None,
        };
        let Some(leg) = self.leg(key) else {
            return;
        };
        match kind {
            TimerKind::Lease => {
                leg.lease_armed = false;
                if leg.lease.held() == 0 {
                    return;
                }
                let due = leg.last_full_ms.saturating_add(LEASE_KEPT_MS);
                if now >= due {
                    self.settle_lease(key);
                }
                // Still held (a read filled since, or what it holds is not ordinary yet: a
                // partial frame, its peer's output): looked at again later.
                if let Some(leg) = self.leg(key).filter(|leg| leg.lease.held() > 0) {
                    leg.lease_armed = true;
                    let again = if now < due {
                        due
                    } else {
                        now.saturating_add(LEASE_KEPT_MS)
                    };
                    self.timers.schedule(again, key, TimerKind::Lease);
                }
            }
            TimerKind::Linger => {
                leg.linger_armed = false;
                if !leg.is_open() {
                    self.remove(key);
                }
            }
            TimerKind::Wedge => {
                if leg.output.is_empty() {
                    leg.wedge_armed = false;
                    return;
                }
                let due = wedge_due(leg.last_progress_ms, wedge_ms);
                if now < due {
                    self.timers.schedule(due, key, TimerKind::Wedge);
                    return;
                }
                self.wedged(key);
            }
            TimerKind::Idle => {
                if !leg.is_open() {
                    leg.idle_armed = false;
                    return;
                }
                if leg.paused {
                    // Not read while its peer's output is at the bound: what it sent (the
                    // answer to our ping too) waits unread in the kernel, so its silence cannot
                    // be judged. It counts as heard from; once resumed it gets a whole window.
                    // (The wedge window ends a pair whose reader stopped, TCP keepalive one
                    // whose end vanished.)
                    leg.last_heard_ms = now;
                    leg.idle_pinged = false;
                }
                // While a frame to the leg is unfinished the relay's ping cannot reach it (it
                // waits for the frame's end): the leg is heard from while its end acknowledges
                // more of the frame (looked at here and whenever its pending output finds room
                // in the socket), so a slow download is judged by its last progress, never by
                // when the ping was queued. (A socket's taking bytes is not enough: it takes
                // them when the kernel's send buffer grows, with nobody reading. Between frames
                // acknowledgements do not count: the ping goes out, and only an endpoint that
                // reads it answers, while its kernel acknowledges bytes nobody reads.)
                let inside_frame = !leg.cursor.at_boundary();
                if leg.acknowledged_more() && inside_frame {
                    leg.last_heard_ms = now;
                }
                // This process's own pause is not the leg's silence: a silence that spans one
                // is judged from a fresh ping, sent now, and half a window for its answer.
                let (last_heard, pinged) =
                    after_pause(leg.last_heard_ms, leg.idle_pinged, pause_end, idle_ms);
                leg.last_heard_ms = last_heard;
                leg.idle_pinged = pinged;
                // While bytes of an unfinished frame are in flight, the acknowledgements are
                // looked at every quarter window (a reader that stops is then closed within
                // 1.25 windows of its last progress at the latest); any other leg costs one
                // look per half window.
                let look = (inside_frame && leg.in_flight())
                    .then(|| now.saturating_add((idle_ms / 4).max(1)));
                let next = |due: u64| look.map_or(due, |look| look.min(due));
                match idle_step(leg.last_heard_ms, leg.idle_pinged, idle_ms, now) {
                    IdleStep::Wait { until } => {
                        self.timers.schedule(next(until), key, TimerKind::Idle)
                    }
                    IdleStep::Ping { then } => {
                        leg.idle_pinged = true;
                        self.timers.schedule(next(then), key, TimerKind::Idle);
                        self.queue_control(key, ControlFrame::new(PING, IDLE_PING_PAYLOAD));
                        self.flush(key);
                    }
                    IdleStep::Silent => self.silent(key),
                }
            }
        }
    }

    /// Nothing at all arrived on `key` for the idle window, not even the answer to the relay's
    /// ping: it is gone (a phone that roamed away sends no FIN). It is closed 4408 and its
    /// peer told (4408), which frees the pair's units and the phone's place.
    fn silent(&mut self, key: LegKey) {
        let idle_ms = self.timings.idle_ms;
        let Some(leg) = self.leg(key) else {
            return;
        };
        log::info!(
            "orca_relay_splice_idle conn={} kind={} idle_ms={idle_ms}",
            leg.socket.id,
            leg.kind,
        );
        self.close_peer(key);
        self.close(key, CloseCode::PeerDropped, "silent", true);
    }

    /// `key` did not drain its output within the wedge window: it is dropped, and the leg
    /// that sends to it closed 4429 (SPEC §5.2 "wedged"); no other pair notices.
    fn wedged(&mut self, key: LegKey) {
        let Some(leg) = self.leg(key) else {
            return;
        };
        let (stalled_id, stalled_kind, sender) = (leg.socket.id, leg.kind, leg.peer);
        if let Some(sender) = sender {
            let sender_id = self.leg(sender).map_or(0, |leg| leg.socket.id);
            let direction = if stalled_kind == "phone" {
                "HostToPhone"
            } else {
                "PhoneToHost"
            };
            log::info!(
                "orca_relay_splice_wedged conn={sender_id} peer={stalled_id} direction={direction}"
            );
            self.close(sender, CloseCode::LimitExceeded, "wedged", true);
        }
        self.remove(key);
    }
}

/// The staged list back, emptied, so its allocation is reused.
fn recycle(mut staged: Vec<Staged>) -> Vec<Staged> {
    staged.clear();
    staged
}
