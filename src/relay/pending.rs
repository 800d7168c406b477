//! The pending plane: every WebSocket connection from its accept until its credential is
//! checked, on the `acceptor` thread, whatever its path (SPEC §12 "Unauthenticated means
//! pending").
//!
//! Why: a connection without a credential must not hold anything a desktop needs. Before this
//! plane, every routed upgrade took a unit of the connection cap and a relay thread, and a phone
//! or data leg proved itself only with its first frame, read with a per-read timeout that every
//! byte and every answered ping restarted: four sockets on `/v1/connect/<any id>` that pinged
//! kept a desktop with a valid token out of a cap of 4 for as long as they liked.
//!
//! One `mio` loop (epoll, edge-triggered) owns the listener and every pending socket. A pending
//! socket holds no unit of the connection cap, no relay thread and no phone place: only an
//! entry here (a few hundred bytes plus what it has sent, bounded) and its descriptor. It goes
//! through:
//! 1. **head**: the upgrade request, read into a buffer that grows with what arrived (at most
//!    [`head::MAX_HEAD_BYTES`]), checked by the pure `upgrade::check`; every refusal is answered
//!    with its status before the close (400, 404, 408, 414, 426, 431, 503, 401);
//! 2. a **desktop control** carries its credential in the head: the token is verified here
//!    (from the cached keys; a token whose key needs a JWKS fetch is verified on one
//!    `upgrade-verify` thread at a time, so the loop never waits on the network), and only then
//!    does the connection take its unit and its thread permit, get its 101 and its relay thread
//!    (`control.rs`);
//! 3. a **phone or data leg** gets its 101 and then sends its credential as its first frame,
//!    read by `splice_reader::FirstFrameReader` (at most a few KiB, never the declared length):
//!    pings are answered, nothing else is; `phone.rs` / `data.rs` check the credential and only
//!    then take the unit, the permit (a phone's thread) and the phone place. A leg gets a few
//!    reads and answered pings per loop turn, then waits in the backlog behind the others.
//!
//! **Deadlines.** One absolute deadline per socket, fixed when it is accepted:
//! [`upgrade::UPGRADE_DEADLINE`] (5 s) for the head and the whole pending life. At the 101 it
//! can only come closer: a splice leg's first frame is due `ORCA_RELAY_FIRST_FRAME_MS` (2 s)
//! after its upgrade and never later than that. The loop sleeps until the nearest deadline
//! (a min-heap), at most a second (the acceptor is a critical thread and beats every turn:
//! `liveness.rs`); bytes, pings and answered pongs never move one. A head that was partly sent
//! gets 408, a first frame that is late 4401.
//!
//! **The bound.** At most `ORCA_RELAY_PENDING_UPGRADES_MAX` sockets, and at most
//! `ORCA_RELAY_PENDING_PER_SOURCE_MAX` from one source address. A newcomer is taken in and what
//! arrived with it is read at once; then, if the table or the newcomer's source is over its
//! bound, the least progressed entry goes (`relay/shedding.rs`: nothing received, then a partial
//! head, then a control waiting for the verifier, then a leg waiting for its first frame, then
//! one whose first frame is arriving; the oldest first within a class; the newcomer's source's
//! own entries first when it is the source that is over). So a phone that got its 101 and waits
//! one round trip for its first frame is never shed for a connect that has sent nothing, one host
//! flooding connects cycles only its own share of the table, and clients that never finish
//! cannot lock out a desktop that sends its head at once. When the least progressed is the
//! newcomer, it is first held beyond the bound for [`NEWCOMER_GRACE`] (at most
//! [`NEWCOMERS_HELD_MAX`] at once, the one held longest giving up its place to a new one), since
//! its first read can race the head its client sent right behind the handshake; judged again
//! once it has got further or its grace is over, it is dropped if it is still the least
//! progressed. Sheds are counted by stage, drops by bound, and
//! logged through a failure throttle. Only a socket whose token is on the verifier thread is not
//! sheddable.
//!
//! Never: blocks on a socket (every write here is non-blocking and small: a 101, a refusal, a
//! pong, a close frame fit a fresh socket's send buffer; one that does not fit ends the
//! connection), waits on the network or the database, or holds the cell's lock across I/O.
//! `EINTR` is retried on every accept, read, write and poll.
//!
//! **A live handover** stops the loop (`stop`) without closing anything: the listener and every
//! pending connection are given back as they were ([`run`]'s answer: the head bytes that have
//! arrived, a splice leg's first-frame reader, each deadline), and the loop of the process that
//! goes on serving starts with them. A control whose token was on the verifier thread is
//! carried as its head and verified again.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, VecDeque};
use std::io::{self, Read};
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::Ordering;
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::Arc;
use std::time::{Duration, Instant};

use mio::unix::SourceFd;
use mio::{Events, Interest, Poll, Token, Waker};

use super::context::{Phase, RelayContext};
use super::frames::CloseAnswer;
use super::park::{self, Parked, ParkedConn, Wake};
use super::refuse::{
    close_later, close_pending, refuse, refuse_at_accept, server_frame, write_now,
};
use super::shedding::{self, Bound, Hold, Progress, ShedOrder};
use super::splice_reader::{FirstFrame, FirstFrameReader, PendingLeg};
use super::upgrade::{self, Refusal, Route, Upgrade};
use super::{data, phone, thread};
use crate::auth::{AuthError, HostClaims};
use crate::clock;
use crate::http::head::{self, HeadError};
use crate::logging::FailureThrottle;
use crate::protocol::CloseCode;

const LISTENER: Token = Token(usize::MAX - 1);
const WAKER: Token = Token(usize::MAX);
const STOP: Token = Token(usize::MAX - 2);
/// Accepts per loop turn before the pending sockets get their turn (the listener is then
/// polled again at once).
const ACCEPTS_PER_TURN: usize = 128;
/// One read of a head takes at most this.
const HEAD_CHUNK: usize = 2 * 1024;
/// The loop's wait when the listener keeps failing (not a descriptor shortage): no spinning.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(50);
/// Reads of a splice leg's first frame per loop turn, and pings it may have answered in one: a
/// leg that sends faster than the loop parses (a flood of pongs needs no reading) waits in the
/// backlog behind the others, so it never holds the loop (accepts, other legs, deadlines).
const FIRST_FRAME_READS_PER_TURN: usize = 4;
const PINGS_PER_TURN: usize = 16;
/// A newcomer that would be dropped (every other entry has got further) is first held this
/// long, beyond the bound, for the rest of what its client sent with the connect: the accept
/// races the client's first segment, which arrives right behind the handshake's last ACK.
const NEWCOMER_GRACE: Duration = Duration::from_millis(50);
/// Newcomers held in their grace at most at once (beyond the table's bound: the capacity plan
/// reserves their descriptors with the table's); past it the one held longest is dropped.
pub const NEWCOMERS_HELD_MAX: usize = 64;

/// The `acceptor` thread body: the pending plane, starting with the pending connections a
/// handover carried (`carried`), until `stop` is set. Then the listener and every pending
/// connection are given back as they were: a handover passes them on, a drain closes them
/// ([`close_parked`]).
pub fn run(
    listener: TcpListener,
    context: RelayContext,
    stop: Arc<Wake>,
    carried: Vec<Parked>,
    beat: &crate::liveness::Beat,
) -> (TcpListener, Vec<Parked>) {
    let spare = match listener.try_clone() {
        Ok(spare) => spare,
        Err(e) => {
            log::error!("orca_relay_acceptor_failed error={e}");
            return (listener, carried);
        }
    };
    match Plane::new(listener, context, stop) {
        Ok(mut plane) => {
            drop(spare);
            for parked in carried {
                plane.adopt(parked);
            }
            plane.run(beat);
            let pending = plane.export();
            (plane.listener, pending)
        }
        Err(e) => {
            log::error!("orca_relay_acceptor_failed error={e}");
            (spare, carried)
        }
    }
}

/// Closes the pending connections a stopped acceptor gave back (the drain): a splice leg
/// waiting for its first frame with 4503, the others dropped.
pub fn close_parked(context: &RelayContext, parked: Vec<Parked>) {
    for parked in parked {
        let ParkedConn::Pending(stream) = parked.conn else {
            continue;
        };
        if let park::Stage::FirstFrame { reader, .. } = parked.stage {
            let answer = CloseAnswer::after(&reader.buffered);
            close_pending(context, stream, answer, CloseCode::Draining, "draining");
        }
    }
}

/// The path a splice leg's route came from (carried with a pending leg).
fn route_path(route: &Route) -> String {
    match route {
        Route::Control => "/v1/host/control".into(),
        Route::Phone { relay_host_id } => format!("/v1/connect/{relay_host_id}"),
        Route::DataLeg { conn_id } => format!("/v1/host/data/{conn_id}"),
    }
}

struct Entry {
    stream: TcpStream,
    id: u64,
    /// Accept order: the shedding order within a stage.
    seq: u64,
    deadline: Instant,
    stage: Stage,
    /// Its turn's budget ran out with bytes perhaps still in the socket: it is in the backlog.
    backlogged: bool,
}

enum Stage {
    /// The upgrade head is arriving; `scanned` bytes were searched for its end already.
    Head { buf: Vec<u8>, scanned: usize },
    /// A control's head whose token needs the JWKS fetched: on the verifier thread, or queued
    /// for it. `raw` is the head and its tail as they arrived (what a handover carries).
    Verifying {
        upgrade: Upgrade,
        token: String,
        tail: Vec<u8>,
        raw: Vec<u8>,
    },
    /// A splice leg after its 101, until its first frame.
    FirstFrame {
        route: Route,
        reader: FirstFrameReader,
    },
}

/// A verifier thread's answer: (slot, seq, the verdict).
type Verdict = (usize, u64, Result<HostClaims, AuthError>);

struct Plane {
    poll: Poll,
    listener: TcpListener,
    context: RelayContext,
    stop: Arc<Wake>,
    entries: Vec<Option<Entry>>,
    free: Vec<usize>,
    /// Entries in the table.
    live: usize,
    /// Who is shed when the table or a source is full (every entry by seq), and each seq's
    /// slot.
    shed: ShedOrder<IpAddr>,
    slot_of: HashMap<u64, usize>,
    /// Sheds and drops are logged once, then at most once a minute with a count.
    shed_log: FailureThrottle,
    deadlines: BinaryHeap<Reverse<(Instant, usize, u64)>>,
    next_seq: u64,
    /// One descriptor kept in reserve: when the process is out of descriptors (EMFILE,
    /// ENFILE) it is given up for a moment so that the waiting connection can be accepted,
    /// answered 503 and closed, instead of staying in the backlog until the client gives up.
    spare: Option<std::fs::File>,
    /// The listener may hold more connections than the last turn accepted.
    listener_ready: bool,
    accept_failing: bool,
    spawn_failing: bool,
    /// Controls whose token needs a JWKS fetch: one on the verifier thread, the rest queued.
    verifying: Option<(usize, u64)>,
    verify_queue: VecDeque<(usize, u64)>,
    verdicts: (Sender<Verdict>, Receiver<Verdict>),
    waker: Arc<Waker>,
    scratch: Vec<u8>,
    /// Legs whose turn's budget ran out (slot, seq): read again next turn, since an
    /// edge-triggered registration does not report the bytes they left in the socket.
    backlog: VecDeque<(usize, u64)>,
}

impl Plane {
    fn new(listener: TcpListener, context: RelayContext, stop: Arc<Wake>) -> io::Result<Plane> {
        let _ = crate::http::server::raise_backlog(&listener);
        listener.set_nonblocking(true)?;
        let poll = Poll::new()?;
        poll.registry().register(
            &mut SourceFd(&listener.as_raw_fd()),
            LISTENER,
            Interest::READABLE,
        )?;
        poll.registry()
            .register(&mut SourceFd(&stop.raw_fd()), STOP, Interest::READABLE)?;
        let waker = Arc::new(Waker::new(poll.registry(), WAKER)?);
        let bound = context.pending_upgrades_max.max(1);
        let per_source = context.pending_per_source_max.clamp(1, bound);
        Ok(Plane {
            poll,
            listener,
            context,
            stop,
            entries: Vec::new(),
            free: Vec::new(),
            live: 0,
            shed: ShedOrder::new(bound, per_source, NEWCOMERS_HELD_MAX),
            slot_of: HashMap::new(),
            shed_log: FailureThrottle::new(),
            deadlines: BinaryHeap::new(),
            next_seq: 0,
            spare: open_spare(),
            listener_ready: true,
            accept_failing: false,
            spawn_failing: false,
            verifying: None,
            verify_queue: VecDeque::new(),
            verdicts: mpsc::channel(),
            waker,
            scratch: vec![0; HEAD_CHUNK],
            backlog: VecDeque::new(),
        })
    }

    /// The loop, until stopped: beats once a turn and waits at most a beat period (an idle
    /// acceptor beats too).
    fn run(&mut self, beat: &crate::liveness::Beat) {
        let mut events = Events::with_capacity(1024);
        loop {
            beat.beat();
            let now = clock::instant();
            let next_deadline = self
                .deadlines
                .peek()
                .map(|Reverse((due, _, _))| *due)
                .into_iter()
                .chain(self.shed.next_release())
                .min()
                .map(|due| due.saturating_duration_since(now));
            let timeout = if self.listener_ready || !self.backlog.is_empty() {
                Some(Duration::ZERO)
            } else if self.accept_failing {
                // The listener is retried after a short wait, never in a spin.
                Some(next_deadline.map_or(ACCEPT_BACKOFF, |due| due.min(ACCEPT_BACKOFF)))
            } else {
                next_deadline
            };
            let timeout = Some(timeout.map_or(crate::liveness::BEAT_PERIOD, |wait| {
                wait.min(crate::liveness::BEAT_PERIOD)
            }));
            match self.poll.poll(&mut events, timeout) {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    log::error!("orca_relay_acceptor_poll_failed error={e}");
                    clock::sleep(ACCEPT_BACKOFF);
                    continue;
                }
            }
            if self.stop.is_set() {
                break;
            }
            let mut verdicts = false;
            for event in events.iter() {
                match event.token() {
                    LISTENER => self.listener_ready = true,
                    WAKER => verdicts = true,
                    STOP => {}
                    Token(slot) => self.progress(slot),
                }
            }
            if verdicts {
                self.take_verdicts();
            }
            self.serve_backlog();
            if self.listener_ready || self.accept_failing {
                self.accept_some();
            }
            self.expire_due();
            self.judge_held();
            self.publish();
        }
    }

    fn publish(&self) {
        self.context.pending_now.store(self.live, Ordering::Release);
    }

    // -----------------------------------------------------------------------------------------
    // Accepting.

    fn accept_some(&mut self) {
        for _ in 0..ACCEPTS_PER_TURN {
            let (stream, peer) = match self.listener.accept() {
                Ok(accepted) => accepted,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    self.listener_ready = false;
                    return;
                }
                Err(e) if crate::http::server::accept_error_is_per_connection(&e) => continue,
                Err(e) => {
                    if !self.accept_failing {
                        log::warn!("orca_relay_accept_failed error={e}");
                        self.accept_failing = true;
                    }
                    if out_of_descriptors(&e) && self.spare.take().is_some() {
                        if let Ok((stream, _)) = self.listener.accept() {
                            refuse_at_accept(&self.context, stream, "descriptors");
                        }
                        self.spare = open_spare();
                    }
                    // Retried after a short wait (the poll's timeout), never in a spin.
                    self.listener_ready = false;
                    return;
                }
            };
            self.accept_recovered();
            if self.spare.is_none() {
                self.spare = open_spare();
            }
            self.admit(stream, peer);
        }
        // More may be waiting: the next turn polls without waiting.
        self.listener_ready = true;
    }

    fn accept_recovered(&mut self) {
        if self.accept_failing {
            log::info!("orca_relay_accept_recovered");
            self.accept_failing = false;
        }
    }

    /// Takes a new connection into the table and reads what arrived with it; then, if the
    /// table or the connection's source is over its bound, sheds the least progressed entry
    /// (the newcomer itself when it is that one).
    fn admit(&mut self, stream: TcpStream, peer: SocketAddr) {
        let _ = stream.set_nodelay(true);
        let id = self.context.next_connection_id();
        let deadline = clock::instant() + upgrade::UPGRADE_DEADLINE;
        let head = Stage::Head {
            buf: Vec::new(),
            scanned: 0,
        };
        let source = shedding::source_of(&peer);
        let Some(slot) = self.insert(stream, id, deadline, head, source) else {
            return;
        };
        let seq = self.next_seq - 1;
        // What arrived with the connection is read at once: a client that sent its head with
        // its connect competes as what it is (upgraded, refused, admitted), not as a bare one.
        self.progress(slot);
        self.shed_over_bound(source, seq, true);
    }

    /// Judges again the newcomers whose grace is over or who have got further meanwhile.
    fn judge_held(&mut self) {
        for (seq, source) in self.shed.release_due(clock::instant()) {
            self.shed_over_bound(source, seq, false);
        }
    }

    /// Sheds the entries the order names until the table and `source` are within their
    /// bounds; `newcomer` (the seq of the connection just admitted, or judged again after its
    /// grace) is dropped, not shed, when it is the one, unless it `may_wait` for its grace.
    fn shed_over_bound(&mut self, source: IpAddr, newcomer: u64, may_wait: bool) {
        while let Some(victim) = self.shed.victim(&source) {
            let is_newcomer = victim.seq == newcomer;
            if is_newcomer && may_wait {
                let until = clock::instant() + NEWCOMER_GRACE;
                match self.shed.hold(newcomer, until, victim.bound) {
                    Hold::Held => return,
                    Hold::Replaced { seq, bound } => {
                        // The newcomer held longest gives up its place: dropped as a newcomer.
                        self.close_for_bound(seq, Progress::NoBytes, bound, true);
                        return;
                    }
                    Hold::Refused => {}
                }
            }
            if !self.close_for_bound(victim.seq, victim.progress, victim.bound, is_newcomer) {
                // Not expected: the order and the table disagree. Forget the entry rather than
                // loop.
                self.shed.remove(victim.seq);
            }
            if is_newcomer {
                return;
            }
        }
    }

    /// Closes entry `seq` for `bound`: shed (counted by its `progress`), or dropped as a
    /// `newcomer`; logged through the throttle. False when it is not in the table.
    fn close_for_bound(
        &mut self,
        seq: u64,
        progress: Progress,
        bound: Bound,
        newcomer: bool,
    ) -> bool {
        let Some(entry) = self
            .slot_of
            .get(&seq)
            .copied()
            .and_then(|slot| self.take(slot))
        else {
            return false;
        };
        let _ = entry.stream.shutdown(std::net::Shutdown::Both);
        let metrics = &self.context.metrics;
        if newcomer {
            metrics.dropped_at_accept(match bound {
                Bound::Table => "pending_upgrades_full",
                Bound::Source => "pending_source_full",
            });
        } else {
            metrics.pending_shed(progress.label());
        }
        if bound == Bound::Source {
            metrics.pending_source_full();
        }
        if let Some(note) = self.shed_log.failure(self.context.clock.now_ms()) {
            log::warn!(
                "orca_relay_ws_pending_shed stage={} bound={} newcomer={newcomer} pending={}{note}",
                progress.label(),
                match bound {
                    Bound::Table => "table",
                    Bound::Source => "source",
                },
                self.live
            );
        }
        true
    }

    /// Puts a connection in the table and the poll, last in the shedding order; `None` (the
    /// connection dropped) when the descriptor cannot be made non-blocking or registered.
    fn insert(
        &mut self,
        stream: TcpStream,
        id: u64,
        deadline: Instant,
        stage: Stage,
        source: IpAddr,
    ) -> Option<usize> {
        stream.set_nonblocking(true).ok()?;
        let slot = self.free.pop().unwrap_or_else(|| {
            self.entries.push(None);
            self.entries.len() - 1
        });
        if self
            .poll
            .registry()
            .register(
                &mut SourceFd(&stream.as_raw_fd()),
                Token(slot),
                Interest::READABLE,
            )
            .is_err()
        {
            self.free.push(slot);
            return None;
        }
        let seq = self.next_seq;
        self.next_seq += 1;
        self.live += 1;
        self.shed.insert(seq, source, progress_of(&stage));
        self.slot_of.insert(seq, slot);
        self.entries[slot] = Some(Entry {
            stream,
            id,
            seq,
            deadline,
            stage,
            backlogged: false,
        });
        self.deadlines.push(Reverse((deadline, slot, seq)));
        Some(slot)
    }

    /// Removes an entry from the table and the poll; the caller decides its socket's fate.
    fn take(&mut self, slot: usize) -> Option<Entry> {
        let entry = self.entries.get_mut(slot)?.take()?;
        self.live -= 1;
        self.shed.remove(entry.seq);
        self.slot_of.remove(&entry.seq);
        let _ = self
            .poll
            .registry()
            .deregister(&mut SourceFd(&entry.stream.as_raw_fd()));
        self.free.push(slot);
        Some(entry)
    }

    fn entry(&mut self, slot: usize) -> Option<&mut Entry> {
        self.entries.get_mut(slot)?.as_mut()
    }

    // -----------------------------------------------------------------------------------------
    // Reading.

    /// Reads what the connection has sent and acts on it; then its place in the shedding order
    /// is what it has got to now.
    fn progress(&mut self, slot: usize) {
        let Some(entry) = self.entry(slot) else {
            return;
        };
        let seq = entry.seq;
        match entry.stage {
            Stage::Head { .. } => self.read_head(slot),
            Stage::FirstFrame { .. } => self.read_first_frame(slot),
            // Nothing is read while the token is being checked; the bytes wait in the kernel.
            Stage::Verifying { .. } => {}
        }
        if let Some(entry) = self.entries.get(slot).and_then(Option::as_ref) {
            if entry.seq == seq {
                self.shed.set_progress(seq, progress_of(&entry.stage));
            }
        }
    }

    fn read_head(&mut self, slot: usize) {
        let mut scratch = std::mem::take(&mut self.scratch);
        let outcome = {
            let Some(entry) = self.entry(slot) else {
                self.scratch = scratch;
                return;
            };
            let Stage::Head { buf, scanned } = &mut entry.stage else {
                self.scratch = scratch;
                return;
            };
            read_head_bytes(&entry.stream, buf, scanned, &mut scratch)
        };
        self.scratch = scratch;
        match outcome {
            HeadProgress::Waiting => {}
            HeadProgress::Gone => drop(self.take(slot)),
            HeadProgress::Failed(error) => {
                if let Some(entry) = self.take(slot) {
                    match Refusal::for_head_error(error) {
                        Some(refusal) => refuse(&self.context, entry.stream, &refusal),
                        None => drop(entry),
                    }
                }
            }
            HeadProgress::Complete(head, raw, tail) => self.head_complete(slot, head, raw, tail),
        }
    }

    /// A whole head: the upgrade is decided (see the module header).
    fn head_complete(&mut self, slot: usize, head: head::Head, raw: Vec<u8>, tail: Vec<u8>) {
        let refusal = match self.context.phase.get() {
            Phase::SERVING => None,
            Phase::STARTING => Some(Refusal::unavailable("starting")),
            _ => Some(Refusal::unavailable("draining")),
        };
        let checked = match refusal {
            Some(refusal) => Err(refusal),
            None => upgrade::check(&head),
        };
        let upgrade = match checked {
            Ok(upgrade) => upgrade,
            Err(refusal) => return self.refuse_slot(slot, &refusal),
        };
        match upgrade.route {
            Route::Control => self.control_head(slot, upgrade, raw, tail),
            _ => self.splice_head(slot, upgrade, tail),
        }
    }

    fn refuse_slot(&mut self, slot: usize, refusal: &Refusal) {
        if let Some(entry) = self.take(slot) {
            refuse(&self.context, entry.stream, refusal);
        }
    }

    /// A desktop control's head: its token decides.
    fn control_head(&mut self, slot: usize, upgrade: Upgrade, mut raw: Vec<u8>, tail: Vec<u8>) {
        let token = match crate::auth::parse_bearer(upgrade.authorization.as_deref()) {
            Ok(token) => token.to_string(),
            Err(e) => return self.refuse_slot(slot, &unauthorized(&e)),
        };
        match self.context.verifier.verify_host_token_cached(&token) {
            Some(verdict) => self.control_verified(slot, upgrade, tail, verdict),
            None => {
                let Some(entry) = self.entry(slot) else {
                    return;
                };
                let seq = entry.seq;
                raw.extend_from_slice(&tail);
                entry.stage = Stage::Verifying {
                    upgrade,
                    token,
                    tail,
                    raw,
                };
                self.verify_queue.push_back((slot, seq));
                self.start_verifying();
            }
        }
    }

    /// Hands the next queued token to the verifier thread, if it is free.
    fn start_verifying(&mut self) {
        while self.verifying.is_none() {
            let Some((slot, seq)) = self.verify_queue.pop_front() else {
                return;
            };
            let token = match self.entry(slot) {
                Some(Entry {
                    seq: current,
                    stage: Stage::Verifying { token, .. },
                    ..
                }) if *current == seq => token.clone(),
                _ => continue,
            };
            // The cache may have what it needs by now (another fetch completed).
            if let Some(verdict) = self.context.verifier.verify_host_token_cached(&token) {
                self.apply_verdict(slot, seq, verdict);
                continue;
            }
            let verifier = self.context.verifier.clone();
            let answers = self.verdicts.0.clone();
            let waker = self.waker.clone();
            let spawned = crate::threads::spawn_with_stack(
                "upgrade-verify",
                crate::threads::RELAY_STACK_BYTES,
                move || {
                    let verdict = verifier.verify_host_token(&token);
                    let _ = answers.send((slot, seq, verdict));
                    let _ = waker.wake();
                },
            );
            match spawned {
                Ok(_) => {
                    // In flight: not sheddable (the thread answers for it).
                    self.shed.pin(seq);
                    self.verifying = Some((slot, seq));
                }
                Err(_) => {
                    self.context.metrics.dropped_at_accept("thread_spawn");
                    self.refuse_slot(slot, &Refusal::unavailable("threads"));
                }
            }
        }
    }

    fn take_verdicts(&mut self) {
        while let Ok((slot, seq, verdict)) = self.verdicts.1.try_recv() {
            if self.verifying == Some((slot, seq)) {
                self.verifying = None;
            }
            self.apply_verdict(slot, seq, verdict);
        }
        self.start_verifying();
    }

    fn apply_verdict(&mut self, slot: usize, seq: u64, verdict: Result<HostClaims, AuthError>) {
        let current = self.entry(slot).is_some_and(|entry| {
            entry.seq == seq && matches!(entry.stage, Stage::Verifying { .. })
        });
        if !current {
            // It reached its deadline (or was shed) meanwhile.
            return;
        }
        let Some(entry) = self.entry(slot) else {
            return;
        };
        let stage = std::mem::replace(
            &mut entry.stage,
            Stage::Head {
                buf: Vec::new(),
                scanned: 0,
            },
        );
        if let Stage::Verifying { upgrade, tail, .. } = stage {
            self.control_verified(slot, upgrade, tail, verdict);
        }
    }

    /// A control's token was checked: refused (401), or the connection takes its unit and its
    /// thread and is upgraded.
    fn control_verified(
        &mut self,
        slot: usize,
        upgrade: Upgrade,
        tail: Vec<u8>,
        verdict: Result<HostClaims, AuthError>,
    ) {
        let claims = match verdict {
            Ok(claims) => claims,
            Err(e) => return self.refuse_slot(slot, &unauthorized(&e)),
        };
        let context = &self.context;
        // Under pool pressure, a hello the cell cannot admit without the database (memory or
        // a booking) is shed rather than queued behind the pool (SPEC §5.3).
        let shed = shed_under_pool_pressure(
            context.store.has_waiters(),
            context.mode.raw_is_reserve(),
            || {
                context.cell.remembers(&claims.relay_host_id)
                    || context.bookings.holds(
                        &claims.user_id,
                        &claims.relay_host_id,
                        context.clock.now_ms(),
                    )
            },
        );
        if shed {
            return self.refuse_slot(slot, &Refusal::unavailable("pool_pressure"));
        }
        // Authenticated: the connection cap and the thread permits count from here on.
        let Some(unit) = context.slots.try_take() else {
            return self.refuse_slot(slot, &Refusal::unavailable("connection_cap"));
        };
        let Some(permit) = context.thread_permits.try_take() else {
            return self.refuse_slot(slot, &Refusal::unavailable("threads"));
        };
        let Some(entry) = self.take(slot) else {
            return;
        };
        if !write_now(
            &entry.stream,
            upgrade::switching_protocols(&upgrade.key).as_bytes(),
        ) {
            return;
        }
        let spawned = thread::spawn_control(
            &self.context,
            entry.id,
            entry.stream,
            tail,
            claims,
            unit,
            permit,
        );
        self.note_spawn(spawned);
    }

    fn note_spawn(&mut self, spawned: io::Result<()>) {
        match spawned {
            Ok(()) => self.spawn_failing = false,
            Err(e) => {
                self.context.metrics.dropped_at_accept("thread_spawn");
                if !self.spawn_failing {
                    log::warn!("orca_relay_thread_spawn_failed error={e}");
                    self.spawn_failing = true;
                }
            }
        }
    }

    /// A phone's or data leg's head: upgraded at once (its credential is its first frame), if
    /// the cell could take it at all.
    fn splice_head(&mut self, slot: usize, upgrade: Upgrade, tail: Vec<u8>) {
        let context = &self.context;
        // Only a check, nothing is taken: the unit is taken once the first frame authenticates.
        if context.slots.used() >= context.slots.cap() {
            return self.refuse_slot(slot, &Refusal::unavailable("connection_cap"));
        }
        if matches!(upgrade.route, Route::Phone { .. })
            && context.thread_permits.used() >= context.thread_permits.max()
        {
            return self.refuse_slot(slot, &Refusal::unavailable("threads"));
        }
        let first_frame = Duration::from_millis(context.timings.first_frame_ms);
        let Some(entry) = self.entry(slot) else {
            return;
        };
        if !write_now(
            &entry.stream,
            upgrade::switching_protocols(&upgrade.key).as_bytes(),
        ) {
            drop(self.take(slot));
            return;
        }
        // The first frame is due FIRST_FRAME_MS after the upgrade, and never after the deadline
        // set at accept: the deadline only ever comes closer.
        entry.deadline = entry.deadline.min(clock::instant() + first_frame);
        let (deadline, seq) = (entry.deadline, entry.seq);
        entry.stage = Stage::FirstFrame {
            route: upgrade.route,
            reader: FirstFrameReader::new(tail, crate::protocol::SPLICE_MAX_FRAME_BYTES),
        };
        self.deadlines.push(Reverse((deadline, slot, seq)));
        self.read_first_frame(slot);
    }

    /// Legs whose budget ran out last turn get their next turn, once each.
    fn serve_backlog(&mut self) {
        for _ in 0..self.backlog.len() {
            let Some((slot, seq)) = self.backlog.pop_front() else {
                return;
            };
            match self.entry(slot) {
                Some(entry) if entry.seq == seq => entry.backlogged = false,
                _ => continue,
            }
            self.progress(slot);
        }
    }

    /// The leg's turn is over with bytes perhaps left in its socket: it goes on the backlog.
    fn defer(&mut self, slot: usize) {
        if let Some(entry) = self.entry(slot) {
            if !entry.backlogged {
                entry.backlogged = true;
                let seq = entry.seq;
                self.backlog.push_back((slot, seq));
            }
        }
    }

    fn read_first_frame(&mut self, slot: usize) {
        let (mut reads, mut pings) = (0, 0);
        loop {
            let Some(entry) = self.entry(slot) else {
                return;
            };
            let Stage::FirstFrame { reader, .. } = &mut entry.stage else {
                return;
            };
            // What is buffered first (the head's tail), then what the socket has.
            match reader.take_frame() {
                FirstFrame::NeedMore => {}
                FirstFrame::Ping(payload) => {
                    if !write_now(&entry.stream, &server_frame(0x8A, &payload)) {
                        // A client that does not read its pongs while pending is dropped.
                        drop(self.take(slot));
                        return;
                    }
                    pings += 1;
                    if pings == PINGS_PER_TURN {
                        return self.defer(slot);
                    }
                    continue;
                }
                FirstFrame::Closed(code) => {
                    if let Some(entry) = self.take(slot) {
                        // Answered with its own code (RFC 6455 §5.5.1): the handshake is
                        // complete, so our side ends at once; the descriptor goes with the
                        // client's end of stream (or the linger).
                        let payload = code.map_or(Vec::new(), |code| code.to_be_bytes().to_vec());
                        let _ = write_now(&entry.stream, &server_frame(0x88, &payload));
                        let _ = entry.stream.shutdown(std::net::Shutdown::Write);
                        close_later(&self.context, entry.stream, CloseAnswer::unsynced());
                    }
                    return;
                }
                FirstFrame::Refused(code) => {
                    let answer = reader.close_answer();
                    let reason = match code {
                        CloseCode::TooBig => "first_frame_too_large",
                        _ => "first frame",
                    };
                    if let Some(entry) = self.take(slot) {
                        close_pending(&self.context, entry.stream, answer, code, reason);
                    }
                    return;
                }
                FirstFrame::Text(text) => return self.authenticate(slot, text),
            }
            if reads == FIRST_FRAME_READS_PER_TURN {
                return self.defer(slot);
            }
            reads += 1;
            match reader.fill(&entry.stream) {
                Ok(0) => {
                    drop(self.take(slot));
                    return;
                }
                Ok(_) => continue,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
                Err(_) => {
                    drop(self.take(slot));
                    return;
                }
            }
        }
    }

    /// A splice leg's first frame: its credential is checked by its endpoint.
    fn authenticate(&mut self, slot: usize, text: String) {
        let Some(entry) = self.take(slot) else {
            return;
        };
        let Stage::FirstFrame { route, reader } = entry.stage else {
            return;
        };
        let leg = PendingLeg {
            id: entry.id,
            stream: entry.stream,
            reader,
        };
        match route {
            Route::Phone { relay_host_id } => {
                if let Some(phone) = phone::authenticate(&self.context, leg, &relay_host_id, &text)
                {
                    let spawned = thread::spawn_phone(&self.context, phone);
                    self.note_spawn(spawned);
                }
            }
            Route::DataLeg { conn_id } => data::authenticate(&self.context, leg, &conn_id, &text),
            Route::Control => {}
        }
    }

    // -----------------------------------------------------------------------------------------
    // Deadlines and the end.

    fn expire_due(&mut self) {
        let now = clock::instant();
        while let Some(Reverse((due, slot, seq))) = self.deadlines.peek().copied() {
            if due > now {
                return;
            }
            self.deadlines.pop();
            let current = self
                .entry(slot)
                .is_some_and(|entry| entry.seq == seq && entry.deadline == due);
            if !current {
                continue;
            }
            // A token still on the verifier thread stays `verifying` until its answer comes
            // (and is ignored): one thread at a time, whatever expires.
            let Some(entry) = self.take(slot) else {
                continue;
            };
            match entry.stage {
                Stage::Head { buf, .. } => match Refusal::for_head_error(HeadError::TimedOut {
                    partial: !buf.is_empty(),
                }) {
                    Some(refusal) => refuse(&self.context, entry.stream, &refusal),
                    None => drop(entry.stream),
                },
                Stage::Verifying { .. } => drop(entry.stream),
                Stage::FirstFrame { reader, .. } => close_pending(
                    &self.context,
                    entry.stream,
                    reader.close_answer(),
                    CloseCode::BadOuterCredential,
                    "first frame late",
                ),
            }
        }
        self.start_verifying();
    }

    /// Every pending connection, as it stands, for whoever serves next (the loop has
    /// stopped: nothing is read, written or closed).
    fn export(&mut self) -> Vec<Parked> {
        let mut parked = Vec::new();
        for slot in 0..self.entries.len() {
            let Some(entry) = self.take(slot) else {
                continue;
            };
            let stage = match entry.stage {
                Stage::Head { buf, .. } => park::Stage::Upgrading {
                    received: buf,
                    deadline: entry.deadline,
                },
                // Verified again by whoever serves next (its verifier thread's answer, if one
                // comes, is for a loop that has stopped).
                Stage::Verifying { raw, .. } => park::Stage::Upgrading {
                    received: raw,
                    deadline: entry.deadline,
                },
                Stage::FirstFrame { route, reader } => park::Stage::FirstFrame {
                    path: route_path(&route),
                    claims: None,
                    reader: reader.record(),
                    text: None,
                    deadline: entry.deadline,
                },
            };
            parked.push(Parked {
                id: entry.id,
                conn: ParkedConn::Pending(entry.stream),
                stage,
                hold: None,
                place: None,
            });
        }
        self.verifying = None;
        self.verify_queue.clear();
        self.deadlines.clear();
        self.backlog.clear();
        self.context.pending_now.store(0, Ordering::Release);
        parked
    }

    /// Takes a pending connection a handover carried (or this process's own, after a failed
    /// one) into the table, with its deadline, and goes on with it at once. Carried
    /// connections are never shed to make room for each other.
    fn adopt(&mut self, parked: Parked) {
        let Parked {
            id, conn, stage, ..
        } = parked;
        let ParkedConn::Pending(stream) = conn else {
            return;
        };
        let (stage, deadline, text) = match stage {
            park::Stage::Upgrading { received, deadline } => (
                Stage::Head {
                    buf: received,
                    scanned: 0,
                },
                deadline,
                None,
            ),
            park::Stage::FirstFrame {
                path,
                claims: None,
                reader,
                text,
                deadline,
            } => match upgrade::route(&path) {
                Some(route @ (Route::Phone { .. } | Route::DataLeg { .. })) => (
                    Stage::FirstFrame {
                        route,
                        reader: FirstFrameReader::from_record(
                            reader,
                            crate::protocol::SPLICE_MAX_FRAME_BYTES,
                        ),
                    },
                    deadline,
                    text,
                ),
                _ => return,
            },
            _ => return,
        };
        // Counted against its source like any other; a peer address that cannot be read
        // (the connection has gone) counts against the unspecified one.
        let source = stream
            .peer_addr()
            .map(|peer| shedding::source_of(&peer))
            .unwrap_or(IpAddr::V4(Ipv4Addr::UNSPECIFIED));
        let Some(slot) = self.insert(stream, id, deadline, stage, source) else {
            return;
        };
        match text {
            // A version-1 process carried a first frame it had read and not acted on.
            Some(text) => self.authenticate(slot, text),
            None => self.progress(slot),
        }
        self.publish();
    }
}

/// How far a pending connection has got: its place in the shedding order.
fn progress_of(stage: &Stage) -> Progress {
    match stage {
        Stage::Head { buf, .. } if buf.is_empty() => Progress::NoBytes,
        Stage::Head { .. } => Progress::PartialHead,
        Stage::Verifying { .. } => Progress::Verifying,
        Stage::FirstFrame { reader, .. } if reader.buffered() == 0 => Progress::Upgraded,
        Stage::FirstFrame { .. } => Progress::FirstFrame,
    }
}

/// How reading a head went.
enum HeadProgress {
    /// Not whole yet; the socket has nothing more now.
    Waiting,
    /// The client closed or reset.
    Gone,
    Failed(HeadError),
    /// The head, its bytes, and what followed it in the buffer.
    Complete(head::Head, Vec<u8>, Vec<u8>),
}

/// Reads what the socket has into `buf` (never past [`head::MAX_HEAD_BYTES`]) and parses the
/// head once its end has arrived.
fn read_head_bytes(
    stream: &TcpStream,
    buf: &mut Vec<u8>,
    scanned: &mut usize,
    scratch: &mut [u8],
) -> HeadProgress {
    loop {
        // The end of the head is searched in what is new (the last 3 bytes again), so a head
        // trickled byte by byte is not parsed again for every byte.
        let from = scanned.saturating_sub(3);
        let ended = buf[from..]
            .windows(2)
            .any(|pair| pair == b"\n\n" || pair == b"\n\r");
        *scanned = buf.len();
        if ended {
            match head::parse_head(buf) {
                Ok(Some((parsed, len))) => {
                    let tail = buf.split_off(len);
                    return HeadProgress::Complete(parsed, std::mem::take(buf), tail);
                }
                Ok(None) => {}
                Err(error) => return HeadProgress::Failed(error),
            }
        }
        if buf.len() >= head::MAX_HEAD_BYTES {
            return HeadProgress::Failed(head::oversized(buf));
        }
        let want = (head::MAX_HEAD_BYTES - buf.len()).min(scratch.len());
        match (&*stream).read(&mut scratch[..want]) {
            Ok(0) => return HeadProgress::Gone,
            Ok(n) => buf.extend_from_slice(&scratch[..n]),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return HeadProgress::Waiting,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(_) => return HeadProgress::Gone,
        }
    }
}

/// The 401 for a token that did not verify.
fn unauthorized(error: &AuthError) -> Refusal {
    Refusal {
        status: 401,
        reason: error.reason_code(),
        answer: "unauthorized",
        retry_after_s: None,
    }
}

fn open_spare() -> Option<std::fs::File> {
    std::fs::File::open("/dev/null").ok()
}

fn out_of_descriptors(error: &io::Error) -> bool {
    matches!(
        error.raw_os_error(),
        Some(libc::EMFILE) | Some(libc::ENFILE)
    )
}

/// Whether a desktop's control upgrade is shed with 503 under database pool pressure (SPEC
/// §5.3): only a hello the cell may admit without the database (from memory or a booking) gets
/// past waiters, and only a cell whose raw mode is `reserve` admits that way. In `db` mode every
/// hello needs the database, so a remembered desktop would only queue behind the pool like any
/// other. `admissible_without_sql` is asked only under pressure.
pub fn shed_under_pool_pressure(
    pool_has_waiters: bool,
    raw_reserve: bool,
    admissible_without_sql: impl FnOnce() -> bool,
) -> bool {
    pool_has_waiters && !(raw_reserve && admissible_without_sql())
}

#[cfg(test)]
mod tests {
    use super::shed_under_pool_pressure;

    #[test]
    fn only_a_reserve_cell_lets_remembered_desktops_past_pool_waiters() {
        // (waiters, raw reserve, remembered) -> shed
        let cases = [
            ((false, true, true), false),
            ((false, false, false), false),
            ((true, true, true), false),
            ((true, true, false), true),
            ((true, false, true), true),
            ((true, false, false), true),
        ];
        for ((waiters, reserve, remembered), shed) in cases {
            assert_eq!(
                shed_under_pool_pressure(waiters, reserve, || remembered),
                shed,
                "waiters={waiters} reserve={reserve} remembered={remembered}"
            );
        }
    }
}
