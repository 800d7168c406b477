//! One splice worker: a `splice-<n>` thread running an edge-triggered `mio` loop over the legs
//! it owns.
//!
//! Per readable event a leg is read into the worker's one read buffer (after the leg's partial
//! frame, if it had one), every whole frame is parsed in place by the strict [`FrameParser`]
//! and the data frames go to the peer's socket in one vectored write, headers re-encoded
//! unmasked, payloads untouched; whatever the peer's socket does not take is copied into the
//! peer's pending output, and the bytes after the last whole frame into the leg's partial
//! frame. Pings are answered on the leg itself, pongs dropped, a close acknowledged and the
//! peer closed 4408; a violation closes the leg 1002 (1009 for size) and the peer 4408.
//!
//! Backpressure: a leg is not read while its peer's pending output is at or over
//! [`PENDING_OUTPUT_BOUND`]; it stays readable (edge-triggered: the readiness is remembered)
//! and is read again as soon as the peer's writes bring the output under the bound. A peer
//! whose output makes no progress for the wedge window is dropped and the leg that sends to it
//! closed 4429, as the thread-per-leg relay did with its socket send timeout.
//!
//! Fairness: a leg gets at most [`READS_PER_TURN`] reads per turn; a leg with more to read
//! waits in the backlog behind the other ready legs.

use std::collections::VecDeque;
use std::io;
use std::io::IoSlice;
use std::ops::Range;
use std::os::fd::AsRawFd;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, TryRecvError};
use std::sync::Arc;
use std::time::Duration;

use mio::unix::SourceFd;
use mio::{Events, Interest, Poll, Token, Waker};
use tungstenite::protocol::frame::coding::OpCode;

use super::carry::{LegRecord, PairRecord, ParkRequest, ParkedPair, ResumedLeg, ResumedPair};
use super::leg::{
    close_frame, read_once, server_header, write_slices, Flushed, Leg, LegCounters, LegState,
    Output, ReadOutcome,
};
use super::timers::{may_read, wedge_due, LegKey, TimerKind, Timers};
use super::{Command, LegHandOff, Pair, SpliceTimings, PENDING_OUTPUT_BOUND, READ_BUFFER_BYTES};
use crate::clock::SharedClock;
use crate::protocol::CloseCode;
use crate::relay::frames::{FrameKind, Parsed};
use crate::relay::RelayMetrics;

const WAKER: Token = Token(usize::MAX);
/// Reads one leg gets before the other ready legs have their turn.
pub const READS_PER_TURN: usize = 16;
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
}

impl Worker {
    pub fn new(
        index: usize,
        inbox: Receiver<Command>,
        load: Arc<AtomicUsize>,
        timings: SpliceTimings,
        clock: SharedClock,
        metrics: RelayMetrics,
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
        })
    }

    pub fn waker(&self) -> Arc<Waker> {
        self.waker.clone()
    }

    fn now(&self) -> u64 {
        self.clock.now_ms()
    }

    /// The loop: wait for events or the next deadline, serve them, fire due timers.
    pub fn run(mut self) {
        let mut events = Events::with_capacity(EVENTS);
        loop {
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
                    .map(|due| Duration::from_millis(due.saturating_sub(now)))
            } else {
                Some(Duration::ZERO)
            };
            match self.poll.poll(&mut events, timeout) {
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

    fn live_legs(&self) -> usize {
        self.slots.iter().flatten().count()
    }

    /// Runs `body` for `key`; a panic costs that leg and its peer, never the worker.
    fn guarded(&mut self, key: LegKey, body: impl FnOnce(&mut Worker)) {
        let outcome = std::panic::catch_unwind(AssertUnwindSafe(|| body(self)));
        if outcome.is_err() {
            log::error!(
                "orca_relay_splice_leg_panicked worker={} slot={}",
                self.index,
                key.slot
            );
            if self.buf.len() != READ_BUFFER_BYTES {
                self.buf = vec![0; READ_BUFFER_BYTES];
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
            Command::Stop => self.stop(),
            Command::Park(request) => self.park(request),
            Command::Unpark => {}
        }
    }

    /// A live handover: export every leg and move nothing until unparked (the handover
    /// failed) or the process exits (it succeeded). Commands that arrive meanwhile wait.
    fn park(&mut self, request: ParkRequest) {
        self.publish_counts();
        let exported = self.export(&request.at);
        if request.reply.send(exported).is_err() {
            return;
        }
        let mut waiting = Vec::new();
        loop {
            match self.inbox.recv() {
                Ok(Command::Unpark) => break,
                Ok(Command::Park(again)) => {
                    let _ = again.reply.send(self.export(&again.at));
                }
                Ok(other) => waiting.push(other),
                Err(_) => {
                    self.inbox_closed = true;
                    break;
                }
            }
        }
        for command in waiting {
            self.obey(command);
        }
    }

    /// Every pair (or lone closing leg) this worker holds, as of `at`.
    fn export(&self, at: &crate::carry::Snapshot) -> Vec<ParkedPair> {
        let mut pairs = Vec::new();
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
            let (phone, host) = if leg.kind == "phone" {
                (Some(leg), peer)
            } else {
                (peer, Some(leg))
            };
            let record_of = |leg: &Leg| self.leg_record(leg, at);
            pairs.push(ParkedPair {
                record: PairRecord {
                    relay_host_id: phone.and_then(|leg| leg.relay_host_id.clone()),
                    phone: phone.map(record_of),
                    host: host.map(record_of),
                },
                phone: phone.map(|leg| leg.socket.clone()),
                host: host.map(|leg| leg.socket.clone()),
            });
        }
        pairs
    }

    fn leg_record(&self, leg: &Leg, at: &crate::carry::Snapshot) -> LegRecord {
        let linger_left_ms = if leg.linger_armed {
            self.timers
                .due_of(leg.key, TimerKind::Linger)
                .map(|due| at.left_ms(due))
        } else {
            None
        };
        LegRecord {
            id: leg.socket.id,
            parser: leg.parser.state(),
            partial: leg.partial[..leg.filled.min(leg.partial.len())].to_vec(),
            needed: leg.needed,
            output: leg.output.pending().to_vec(),
            closing: match leg.state {
                LegState::Open => None,
                LegState::Closing { linger } => Some(linger),
            },
            paused: leg.paused,
            hangup_seen: leg.hangup_seen,
            progress_ago_ms: at.age_ms(leg.last_progress_ms),
            linger_left_ms,
        }
    }

    /// Takes a pair a live handover brought: its legs as they were, registered, their output
    /// written first, their timers going on, then read.
    fn add_resumed(&mut self, pair: ResumedPair) {
        if self.buf.is_empty() {
            self.buf = vec![0; READ_BUFFER_BYTES];
        }
        let relay_host_id = pair.relay_host_id;
        let mut keys = Vec::new();
        for (resumed, kind) in [(pair.phone, "phone"), (pair.host, "data")] {
            let Some(resumed) = resumed else {
                keys.push(None);
                continue;
            };
            let key = self.allocate();
            let leg = self.resumed_leg(key, resumed, kind, relay_host_id.clone());
            self.slots[key.slot as usize] = Some(leg);
            keys.push(Some(key));
        }
        if let [Some(phone), Some(host)] = keys[..] {
            for (key, peer) in [(phone, host), (host, phone)] {
                if let Some(leg) = self.leg(key) {
                    leg.peer = Some(peer);
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
        let wedge_ms = self.timings.wedge_ms;
        for key in &keys {
            let Some(leg) = self.leg(*key) else { continue };
            if !leg.output.is_empty() {
                leg.wedge_armed = true;
                let due = wedge_due(leg.last_progress_ms, wedge_ms);
                self.timers.schedule(due, *key, TimerKind::Wedge);
            }
        }
        for key in keys {
            self.guarded(key, |worker| {
                worker.flush(key);
                worker.read(key);
            });
        }
    }

    fn resumed_leg(
        &mut self,
        key: LegKey,
        resumed: ResumedLeg,
        kind: &'static str,
        relay_host_id: Option<String>,
    ) -> Leg {
        let record = resumed.record;
        let filled = record.partial.len();
        let mut partial = record.partial;
        if record.needed > filled {
            partial.reserve(record.needed.min(crate::protocol::SPLICE_MAX_FRAME_BYTES) - filled);
        }
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
        Leg {
            key,
            socket: resumed.socket,
            peer: None,
            parser: crate::relay::frames::FrameParser::with_state(
                crate::protocol::SPLICE_MAX_FRAME_BYTES,
                record.parser,
            ),
            partial,
            filled,
            needed: record.needed,
            output: super::leg::Output::carried(record.output),
            state,
            paused: record.paused,
            last_progress_ms: resumed.last_progress_ms,
            wedge_armed: false,
            linger_armed,
            direction: if kind == "phone" { 0 } else { 1 },
            backlogged: false,
            hangup_seen: record.hangup_seen,
            _release: resumed.release,
            kind,
            relay_host_id: if kind == "phone" { relay_host_id } else { None },
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
        if self.buf.is_empty() {
            self.buf = vec![0; READ_BUFFER_BYTES];
        }
        let phone_key = self.allocate();
        let phone = self.make_leg(phone_key, pair.phone, "phone");
        self.slots[phone_key.slot as usize] = Some(phone);
        let host_key = self.allocate();
        let host = self.make_leg(host_key, pair.host, "data");
        self.slots[host_key.slot as usize] = Some(host);
        for (key, peer) in [(phone_key, host_key), (host_key, phone_key)] {
            if let Some(leg) = self.leg(key) {
                leg.peer = Some(peer);
            }
        }
        let mut failed = false;
        for key in [phone_key, host_key] {
            if let Some(leg) = self.leg(key) {
                let fd = leg.stream().as_raw_fd();
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
        // Bytes the relay threads had read past the attach are parsed first; then both legs
        // are read (an edge-triggered registration may not report data that arrived before).
        for key in [phone_key, host_key] {
            self.guarded(key, |worker| {
                worker.process_carried(key);
                worker.read(key);
            });
        }
    }

    fn make_leg(&self, key: LegKey, handoff: LegHandOff, kind: &'static str) -> Leg {
        let direction = if kind == "phone" { 0 } else { 1 };
        let filled = handoff.buffered.len();
        Leg {
            key,
            socket: handoff.socket,
            peer: None,
            parser: handoff.parser,
            partial: handoff.buffered,
            filled,
            needed: 0,
            output: Output::default(),
            state: LegState::Open,
            paused: false,
            last_progress_ms: 0,
            wedge_armed: false,
            linger_armed: false,
            direction,
            backlogged: false,
            hangup_seen: false,
            _release: handoff.release,
            kind,
            relay_host_id: handoff.relay_host_id,
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
        leg.state = LegState::Closing { linger };
        leg.partial = Vec::new();
        leg.filled = 0;
        leg.needed = 0;
        self.push_output(key, &close_frame(Some(code.code()), reason));
        self.metrics.close(code);
        self.flush(key);
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
        let Some(leg) = self.leg(key) else {
            return;
        };
        if leg.output.is_empty() {
            leg.last_progress_ms = now;
        }
        leg.output.push(bytes);
        if !leg.wedge_armed {
            leg.wedge_armed = true;
            let due = wedge_due(leg.last_progress_ms, wedge_ms);
            self.timers.schedule(due, key, TimerKind::Wedge);
        }
    }

    // -----------------------------------------------------------------------------------------
    // Writing.

    /// Writes the leg's pending output; on progress, a peer paused by this output may read
    /// again.
    fn flush(&mut self, key: LegKey) {
        let now = self.now();
        let linger_ms = self.timings.linger_ms;
        let Some(leg) = self.leg(key) else {
            return;
        };
        if leg.output.is_empty() {
            return;
        }
        let flushed = leg.output.flush(leg.socket.stream());
        let empty = match flushed {
            Flushed::Failed => return self.gone(key),
            Flushed::Blocked => return,
            Flushed::Progress { empty } => {
                leg.last_progress_ms = now;
                empty
            }
        };
        let (state, pending, peer) = (leg.state, leg.output.len(), leg.peer);
        if empty {
            match state {
                LegState::Open => {}
                LegState::Closing { linger: false } => return self.remove(key),
                LegState::Closing { linger: true } => {
                    if let Some(leg) = self.leg(key) {
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
            if may_read(pending, PENDING_OUTPUT_BOUND) {
                let resumed = match self.leg(peer) {
                    Some(p) if p.paused => {
                        p.paused = false;
                        true
                    }
                    _ => false,
                };
                if resumed {
                    self.read(peer);
                }
            }
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
        let mut rest = Vec::new();
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
                if leg.output.is_empty() {
                    match write_slices(leg.socket.stream(), slices) {
                        Ok(n) => {
                            written = n;
                            if n > 0 {
                                leg.last_progress_ms = now;
                            }
                        }
                        Err(_) => failed = true,
                    }
                }
            }
            if !failed {
                let mut skip = written;
                for slice in slices {
                    if skip >= slice.len() {
                        skip -= slice.len();
                        continue;
                    }
                    rest.extend_from_slice(&slice[skip..]);
                    skip = 0;
                }
            }
        }
        self.staged = recycle(staged);
        if let Some(peer) = peer {
            if failed {
                // The peer's connection failed: it is gone, and this leg is told (4408).
                self.gone(peer);
            } else if !rest.is_empty() {
                self.push_output(peer, &rest);
            }
        }
    }

    fn slots_open(&mut self, key: LegKey) -> bool {
        self.leg(key).is_some_and(|leg| leg.is_open())
    }

    // -----------------------------------------------------------------------------------------
    // Reading.

    /// Reads `key` until `WouldBlock`, backpressure, the end of its turn, or its end.
    fn read(&mut self, key: LegKey) {
        for _ in 0..READS_PER_TURN {
            let Some(leg) = self.leg(key) else {
                return;
            };
            if !leg.is_open() {
                return self.discard(key);
            }
            let peer = leg.peer;
            let peer_pending = match peer {
                Some(peer) => self.leg(peer).map_or(0, |p| p.output.len()),
                None => 0,
            };
            if !may_read(peer_pending, PENDING_OUTPUT_BOUND) {
                if let Some(leg) = self.leg(key) {
                    leg.paused = true;
                }
                return;
            }
            if !self.read_step(key) {
                return;
            }
        }
        if let Some(leg) = self.leg(key) {
            if !leg.backlogged {
                leg.backlogged = true;
                self.backlog.push_back(key);
            }
        }
    }

    /// One read and the frames it completes; `false` when reading has to stop.
    fn read_step(&mut self, key: LegKey) -> bool {
        if self.buf.len() != READ_BUFFER_BYTES {
            self.buf = vec![0; READ_BUFFER_BYTES];
        }
        let buffer_len = self.buf.len();
        let Some(leg) = self.leg(key) else {
            return false;
        };
        if leg.needed > buffer_len {
            // A frame larger than the shared buffer grows in the leg's own partial buffer,
            // read straight into it, and is given back once forwarded.
            let needed = leg.needed;
            if leg.partial.len() < needed {
                leg.partial.resize(needed, 0);
            }
            let filled = leg.filled;
            let hangup = leg.hangup_seen;
            match read_once(leg.socket.stream(), &mut leg.partial[filled..needed]) {
                ReadOutcome::Bytes(n) => {
                    leg.filled += n;
                    if leg.filled < needed {
                        // A short read drained the socket: the next bytes bring a new edge.
                        return n == needed - filled || hangup;
                    }
                    let mut work = std::mem::take(&mut leg.partial);
                    leg.filled = 0;
                    leg.needed = 0;
                    self.process(key, &mut work[..needed]);
                    true
                }
                ReadOutcome::WouldBlock => false,
                ReadOutcome::Gone => {
                    self.gone(key);
                    false
                }
            }
        } else {
            let have = leg.filled;
            let mut work = std::mem::take(&mut self.buf);
            let Some(leg) = self.leg(key) else {
                self.buf = work;
                return false;
            };
            work[..have].copy_from_slice(&leg.partial[..have]);
            let hangup = leg.hangup_seen;
            let space = work.len() - have;
            let outcome = read_once(leg.socket.stream(), &mut work[have..]);
            let more = match outcome {
                ReadOutcome::Bytes(n) => {
                    leg.partial = Vec::new();
                    leg.filled = 0;
                    leg.needed = 0;
                    self.process(key, &mut work[..have + n]);
                    // A read shorter than the space drained the socket (as nginx assumes):
                    // bytes that arrive later bring a new edge, so the read that would only
                    // say `WouldBlock` is saved. Not once the peer has hung up: its end of
                    // stream may have come with the data, in the same edge.
                    n == space || hangup
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
        let mut work = std::mem::take(&mut leg.partial);
        let filled = leg.filled;
        leg.filled = 0;
        self.process(key, &mut work[..filled]);
    }

    /// Handles every whole frame at the front of `work`; keeps the rest as the leg's partial
    /// frame.
    fn process(&mut self, key: LegKey, work: &mut [u8]) {
        let mut at = 0;
        let mut frames = 0u64;
        let mut bytes = 0u64;
        self.staged.clear();
        loop {
            let Some(leg) = self.leg(key) else {
                return;
            };
            if !leg.is_open() {
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
                            let mut head = [0u8; 10];
                            let head_len = server_header(0x8a, payload.len(), &mut head);
                            let mut pong = head[..head_len].to_vec();
                            pong.extend_from_slice(&work[payload]);
                            self.push_output(key, &pong);
                            self.flush(key);
                        }
                        FrameKind::Pong => {}
                        FrameKind::Close { .. } => {
                            self.forward(key, work);
                            self.close_peer(key);
                            // Acknowledged with an empty close frame, as the threaded relay
                            // did; the peer initiated, so no linger once it is written.
                            if let Some(leg) = self.leg(key) {
                                if leg.is_open() {
                                    leg.state = LegState::Closing { linger: false };
                                    self.push_output(key, &close_frame(None, ""));
                                    self.flush(key);
                                }
                            }
                            self.count(key, frames, bytes);
                            return;
                        }
                    }
                }
                Parsed::Incomplete { needed } => {
                    let rest = &work[at..];
                    let leg = match self.leg(key) {
                        Some(leg) => leg,
                        None => return,
                    };
                    if !rest.is_empty() {
                        let mut partial = Vec::with_capacity(if needed > READ_BUFFER_BYTES {
                            needed
                        } else {
                            rest.len()
                        });
                        partial.extend_from_slice(rest);
                        leg.partial = partial;
                    }
                    leg.filled = rest.len();
                    leg.needed = needed;
                    break;
                }
                Parsed::Violation(violation) => {
                    self.forward(key, work);
                    let (id, kind) = match self.leg(key) {
                        Some(leg) => (leg.socket.id, leg.kind),
                        None => return,
                    };
                    log::info!(
                        "orca_relay_splice_protocol_violation conn={id} rule={} kind={kind}",
                        violation.name()
                    );
                    let code = crate::relay::splice_reader::violation_close_code(violation);
                    self.close(key, code, violation.name(), true);
                    self.close_peer(key);
                    self.count(key, frames, bytes);
                    return;
                }
            }
        }
        self.forward(key, work);
        self.count(key, frames, bytes);
    }

    fn count(&mut self, key: LegKey, frames: u64, bytes: u64) {
        if frames == 0 {
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
        if self.buf.len() != READ_BUFFER_BYTES {
            self.buf = vec![0; READ_BUFFER_BYTES];
        }
        for _ in 0..READS_PER_TURN {
            let mut work = std::mem::take(&mut self.buf);
            let outcome = match self.leg(key) {
                Some(leg) => read_once(leg.socket.stream(), &mut work),
                None => ReadOutcome::WouldBlock,
            };
            self.buf = work;
            match outcome {
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
        let Some(leg) = self.leg(key) else {
            return;
        };
        match kind {
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
        }
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
