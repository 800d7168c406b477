//! The splice data plane: a few event-loop workers that forward frames between attached
//! phone/data-leg pairs (SPEC §11 "Data plane").
//!
//! Owns: the `splice-<n>` worker threads (`ORCA_RELAY_SPLICE_WORKERS`, default one per core),
//! each a `mio` (epoll, edge-triggered) loop over the legs it owns ([`worker`]), with one large
//! read buffer shared by all its legs, a deadline heap for the wedge and linger timers
//! ([`timers`]) and per-leg state that is only a partial frame and pending output ([`leg`]).
//!
//! The acceptor's pending loop and the relay threads keep every decision (the upgrade and the
//! credential on the acceptor; admission, the control socket and the attach on the threads).
//! Once a phone and its data leg are paired, the phone's thread hands both sockets, with the
//! bytes their readers had already taken off the wire and their parsers' state, to the
//! least-loaded worker ([`SplicePlane::hand_off`]: a channel and a `mio::Waker`), and ends (a
//! data leg never has a thread). From then on a worker owns the pair outright: no other thread
//! touches those sockets, so no lock is held across I/O, and a worker writes its legs' frames
//! itself, not through the socket's writer mutex.
//!
//! Why event loops here and threads elsewhere: only the forwarding is hot. With a thread per
//! leg, every message woke its leg's thread and an idle paired session held two threads and two
//! zero-filled read buffers (docs/BENCHMARKS.md has the figures, before and after); the
//! decisions are rare and easiest to follow as straight-line code on a thread. No async
//! runtime: each worker is one `mio` loop written out by hand.
//!
//! Never: blocks on a socket (every socket is non-blocking; `WouldBlock` ends a read or write
//! loop, `EINTR` is retried); reads the clock other than through the injected clock; lets one
//! leg's failure (an error, a protocol violation, a panic) end the worker or touch another pair.

pub mod leg;
pub mod parked;
pub mod timers;
pub mod worker;

use std::io;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{self, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use crate::clock::SharedClock;
use crate::relay::frames::FrameParser;
use crate::relay::metrics::RelayMetrics;
use crate::relay::socket::Socket;
pub use leg::Release;

use crate::relay::buffer_budget::BufferBudget;

/// Reading a leg stops while its peer has this many bytes or more waiting to be written (one
/// frame is always taken whole, so a leg's output is at most this plus one frame). 1 MiB: with
/// 256 KiB, a 4 MiB fragment to a desktop that reads only later left 320 KiB above the bound
/// once the kernel's buffers were full (the socket took 3.87 MiB), so the next fragment's
/// header, whose length makes the message too large (1009), was never read and the pair was
/// closed as wedged instead; the thread-per-leg relay, blocked in its write, saw the 1009
/// (`tests/relay_framing.rs`). nginx's tuned proxy holds up to 8 x 64 KiB per connection.
pub const PENDING_OUTPUT_BOUND: usize = 1024 * 1024;

/// The read buffer of one worker, shared by all its legs: 256 KiB lets one read take several
/// 64 KiB frames, which keeps single-stream throughput at nginx's (measured with the per-leg
/// buffer of the thread-per-leg relay; see docs/BENCHMARKS.md).
pub const READ_BUFFER_BYTES: usize = 256 * 1024;

/// One leg as its relay thread hands it over.
pub struct LegHandOff {
    pub socket: Arc<Socket>,
    /// Bytes the leg's reader had taken off the wire past the last frame it returned.
    pub buffered: Vec<u8>,
    /// The reader's parser (fragmentation state included).
    pub parser: FrameParser,
    /// Dropped when the leg ends: its connection unit, its gauge, the phone's place.
    pub release: Vec<Release>,
}

/// An attached pair.
pub struct Pair {
    pub phone: LegHandOff,
    pub host: LegHandOff,
    /// The desktop the pair belongs to: the pair is closed when its control leaves.
    pub relay_host_id: Arc<str>,
    /// Whether that desktop's control is still here, asked once the worker holds the pair: a
    /// control that left while the pair was on its way (its [`SplicePlane::close_host`] came
    /// first) is seen, since it is unseated before the close is sent.
    pub host_present: Box<dyn Fn() -> bool + Send>,
}

/// What a worker is told.
pub enum Command {
    Splice(Box<Pair>),
    /// A pair a live handover brought, resumed where it was.
    Resume(Box<parked::ResumedPair>),
    /// The control of this desktop has left: close its pairs 4408.
    CloseHost(Arc<str>),
    /// Close every leg 4503 (drain) and end once they are gone.
    Stop,
    /// A live handover: export every leg (as of the snapshot, lending its buffers) and stop
    /// moving bytes until [`Command::Unpark`] (the handover failed; this process goes on with
    /// the buffers given back).
    Park(parked::ParkRequest),
    Unpark(Vec<parked::ParkedPair>),
}

/// Timings and sizes the workers need. Production takes the constants of this module; the
/// model test of the worker shrinks the sizes so that backpressure comes within a few KiB.
#[derive(Debug, Clone, Copy)]
pub struct SpliceTimings {
    /// A leg whose pending output makes no progress for this long is wedged (SPEC §5.2).
    pub wedge_ms: u64,
    /// How long a closed leg waits for the peer to close (SPEC §5.2: 1 s).
    pub linger_ms: u64,
    /// A leg from which nothing arrived for half of this is pinged by the relay, for all of it
    /// is closed 4408 (`ORCA_RELAY_SPLICE_IDLE_MS`).
    pub idle_ms: u64,
    /// A leg is not read while its peer's pending output is at or over this
    /// ([`PENDING_OUTPUT_BOUND`]).
    pub output_bound: usize,
    /// Each worker's read buffer ([`READ_BUFFER_BYTES`]).
    pub read_buffer_bytes: usize,
}

impl SpliceTimings {
    /// The production sizes with the given windows.
    pub fn new(wedge_ms: u64, linger_ms: u64, idle_ms: u64) -> SpliceTimings {
        SpliceTimings {
            wedge_ms,
            linger_ms,
            idle_ms,
            output_bound: PENDING_OUTPUT_BOUND,
            read_buffer_bytes: READ_BUFFER_BYTES,
        }
    }
}

/// The most a leg's pending output holds: reading its peer stops at [`PENDING_OUTPUT_BOUND`],
/// one read adds at most one read buffer's worth of frames (a larger frame is forwarded as it
/// arrives, a read at a time), and a close frame may follow. Its vector never grows past it.
pub const OUTPUT_CAPACITY_BYTES: usize = PENDING_OUTPUT_BOUND + READ_BUFFER_BYTES + 128;

/// What a leg's pending output may hold without its reader drawing on the cell's buffer
/// budget (`relay::buffer_budget`): reads of its peer are cut to what fits in it.
pub const LEG_ORDINARY_OUTPUT_BYTES: usize = 32 * 1024;

/// What reading one leg may hold without a lease: a partial frame kept whole (under
/// [`worker::STREAM_FROM_BYTES`] and a header) plus the rest of one read (at most
/// [`LEG_ORDINARY_OUTPUT_BYTES`]) when the turn's control-frame allowance ran out, and its
/// peer's pending output ([`LEG_ORDINARY_OUTPUT_BYTES`]).
pub const LEG_ORDINARY_BYTES: usize = worker::STREAM_FROM_BYTES
    + crate::relay::frames::MAX_HEADER_BYTES
    + 2 * LEG_ORDINARY_OUTPUT_BYTES;

/// What reading one leg draws from the budget when it needs more than the ordinary amount:
/// the most it can hold, at once (the rest of a read as its partial frame, its peer's output
/// at [`OUTPUT_CAPACITY_BYTES`]), so that a lease never waits for more. About 1.5 MiB.
pub const LEG_LARGE_LEASE_BYTES: usize = READ_BUFFER_BYTES
    + worker::STREAM_FROM_BYTES
    + crate::relay::frames::MAX_HEADER_BYTES
    + OUTPUT_CAPACITY_BYTES;

/// The most memory one spliced leg holds without a lease from the budget, by construction of
/// the worker: [`LEG_ORDINARY_BYTES`], two owed control frames, and its state (the leg, its
/// socket and writer context, its release guards: well under 4 KiB). Anything more is drawn
/// from the budget; `roles::cell_runtime` multiplies the larger of this and a control's
/// ordinary bound by the connection cap, and adds the budget once.
pub const LEG_MEMORY_BOUND_BYTES: u64 = LEG_ORDINARY_BYTES as u64 + 2 * 128 + 4 * 1024;

struct WorkerHandle {
    inbox: Sender<Command>,
    waker: Arc<mio::Waker>,
    legs: Arc<AtomicUsize>,
    /// The worker is a critical thread: stood down before [`SplicePlane::stop`] ends it.
    standing: crate::liveness::Standing,
}

/// The handle to the workers; cheap to share (`Arc`).
pub struct SplicePlane {
    workers: Vec<WorkerHandle>,
    threads: Mutex<Vec<(String, JoinHandle<()>)>>,
    /// The cell's budget for large buffers (the workers' legs and the controls' readers).
    buffers: Arc<BufferBudget>,
}

impl SplicePlane {
    /// Starts `count` workers (`splice-0`, `splice-1`, …), critical threads of `liveness`
    /// (each beats once per loop turn; its idle timers ask `liveness`'s pause clock).
    pub fn start(
        count: usize,
        timings: SpliceTimings,
        clock: SharedClock,
        metrics: RelayMetrics,
        liveness: &crate::liveness::Liveness,
        buffers: Arc<BufferBudget>,
    ) -> io::Result<Arc<SplicePlane>> {
        let mut workers = Vec::new();
        let mut threads = Vec::new();
        for index in 0..count.max(1) {
            let (inbox, receiver) = mpsc::channel();
            let legs = Arc::new(AtomicUsize::new(0));
            let worker = worker::Worker::new(
                index,
                receiver,
                legs.clone(),
                timings,
                clock.clone(),
                metrics.clone(),
                liveness.pauses(),
                buffers.clone(),
            )?;
            let waker = worker.waker();
            let name = format!("splice-{index}");
            let (handle, standing) =
                liveness.spawn_critical(&name, crate::liveness::BEAT_PERIOD, move |beat| {
                    worker.run(beat)
                })?;
            workers.push(WorkerHandle {
                inbox,
                waker,
                legs,
                standing,
            });
            threads.push((name, handle));
        }
        Ok(Arc::new(SplicePlane {
            workers,
            threads: Mutex::new(threads),
            buffers,
        }))
    }

    /// The cell's budget for large buffers.
    pub fn buffers(&self) -> &Arc<BufferBudget> {
        &self.buffers
    }

    /// Legs each worker holds now.
    pub fn legs_per_worker(&self) -> Vec<usize> {
        self.workers
            .iter()
            .map(|worker| worker.legs.load(Ordering::Relaxed))
            .collect()
    }

    /// Gives `pair` to the least-loaded worker. `Err` gives the pair back when no worker can
    /// take it (the plane is stopping or a worker has ended): the caller closes both 4429.
    pub fn hand_off(&self, pair: Pair) -> Result<(), Box<Pair>> {
        let index = timers::least_loaded(&self.legs_per_worker());
        let Some(worker) = self.workers.get(index) else {
            return Err(Box::new(pair));
        };
        // Counted now, so hand-offs in a burst spread across workers.
        worker.legs.fetch_add(2, Ordering::Relaxed);
        match worker.inbox.send(Command::Splice(Box::new(pair))) {
            Ok(()) => {
                let _ = worker.waker.wake();
                Ok(())
            }
            Err(mpsc::SendError(command)) => {
                worker.legs.fetch_sub(2, Ordering::Relaxed);
                match command {
                    Command::Splice(pair) => Err(pair),
                    _ => unreachable!("only a pair was sent"),
                }
            }
        }
    }

    /// Gives a pair a live handover brought to the least-loaded worker; `Err` gives it back
    /// when no worker can take it.
    pub fn resume(&self, pair: parked::ResumedPair) -> Result<(), Box<parked::ResumedPair>> {
        let index = timers::least_loaded(&self.legs_per_worker());
        let Some(worker) = self.workers.get(index) else {
            return Err(Box::new(pair));
        };
        let legs = pair.legs();
        worker.legs.fetch_add(legs, Ordering::Relaxed);
        match worker.inbox.send(Command::Resume(Box::new(pair))) {
            Ok(()) => {
                let _ = worker.waker.wake();
                Ok(())
            }
            Err(mpsc::SendError(command)) => {
                worker.legs.fetch_sub(legs, Ordering::Relaxed);
                match command {
                    Command::Resume(pair) => Err(pair),
                    _ => unreachable!("only a pair was sent"),
                }
            }
        }
    }

    /// The control of `relay_host_id` has left (no newer one took its place): every worker
    /// closes that desktop's pairs 4408.
    pub fn close_host(&self, relay_host_id: &str) {
        let host: Arc<str> = relay_host_id.into();
        for worker in &self.workers {
            if worker.inbox.send(Command::CloseHost(host.clone())).is_ok() {
                let _ = worker.waker.wake();
            }
        }
    }

    /// Parks every worker for a live handover: each stops moving bytes and exports its legs as
    /// of `at`, lending their byte buffers to the records (no copy). Returns the pairs of all of
    /// them; `Err` (with the pairs of those that answered) if a worker did not answer by
    /// `deadline`: the caller unparks with them and fails the handover (a worker whose answer
    /// came too late takes its buffers back itself).
    pub fn park(
        &self,
        at: crate::carry::time::Snapshot,
        deadline: std::time::Instant,
    ) -> Result<Vec<parked::ParkedPair>, (Vec<parked::ParkedPair>, &'static str)> {
        let mut answers = Vec::new();
        let mut failed = None;
        for worker in &self.workers {
            let (reply, answer) = mpsc::channel();
            if worker
                .inbox
                .send(Command::Park(parked::ParkRequest { at, reply }))
                .is_err()
            {
                failed = Some("splice worker gone");
                break;
            }
            let _ = worker.waker.wake();
            answers.push(answer);
        }
        let mut pairs = Vec::new();
        for (index, answer) in answers.into_iter().enumerate() {
            let left = deadline.saturating_duration_since(crate::clock::instant());
            match answer.recv_timeout(left) {
                Ok(parked) => pairs.extend(parked.into_iter().map(|mut pair| {
                    pair.worker = index;
                    pair
                })),
                Err(_) => failed = failed.or(Some("splice worker did not park in time")),
            }
        }
        match failed {
            None => Ok(pairs),
            Some(cause) => Err((pairs, cause)),
        }
    }

    /// Every worker moves bytes again (a failed handover), each with the buffers it lent
    /// (`pairs`, as [`SplicePlane::park`] gave them).
    pub fn unpark(&self, pairs: Vec<parked::ParkedPair>) {
        let mut per_worker: Vec<Vec<parked::ParkedPair>> =
            self.workers.iter().map(|_| Vec::new()).collect();
        for pair in pairs {
            if let Some(mine) = per_worker.get_mut(pair.worker) {
                mine.push(pair);
            }
        }
        for (worker, pairs) in self.workers.iter().zip(per_worker) {
            let _ = worker.inbox.send(Command::Unpark(pairs));
            let _ = worker.waker.wake();
        }
    }

    /// Closes every spliced leg 4503 and joins the workers (the drain's last step).
    pub fn stop(&self) {
        for worker in &self.workers {
            worker.standing.stand_down();
            let _ = worker.inbox.send(Command::Stop);
            let _ = worker.waker.wake();
        }
        let threads: Vec<_> = self
            .threads
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .drain(..)
            .collect();
        for (name, handle) in threads {
            crate::threads::join_logged(&name, handle);
        }
    }
}
