//! Spliced pairs across a live handover (ARCHITECTURE.md "Live handover").
//!
//! A parked worker exports each of its legs as a record (`carry::pair::LegRecord`) beside its socket: the bytes it
//! read and has not acted on (a partial frame, or whole frames a turn's control budget left
//! unparsed), the parser's fragmentation state, a large frame being forwarded as its payload
//! arrives (the payload still to come and its mask), the output its socket has not taken yet,
//! where the socket is in the frames written to it, the control frames owed to it (a pong, the
//! relay's idle ping, one of them perhaps half written), whether its reading is paused by its
//! peer's output (backpressure), whether it is closing, and its timers as the time that has
//! passed since the output last moved (wedge) or since bytes last arrived (idle), or the time
//! left (linger). The next process's worker takes each pair back ([`ResumedPair`]) and goes
//! on: what was owed is written first, the bytes not acted on are parsed, a streamed frame goes
//! on streaming, a paused leg stays paused until its peer drains.

use std::sync::mpsc::Sender;
use std::sync::Arc;

use super::leg::Release;
use super::timers::LegKey;
use crate::carry::pair::{LegRecord, PairRecord};
use crate::carry::time::Snapshot;
use crate::relay::socket::Socket;

/// What a parked worker gives the handover: each pair's record and the legs' sockets (which the
/// worker keeps, untouched, until the handover ends). The record owns the legs' byte buffers
/// (the bytes not acted on, the pending output), lent by the worker: a failed handover gives
/// the pair back to its worker ([`super::SplicePlane::unpark`]), which puts them back in place.
pub struct ParkedPair {
    pub record: PairRecord,
    pub phone: Option<Arc<Socket>>,
    pub host: Option<Arc<Socket>>,
    /// The worker that lent it, and its legs there.
    pub(super) worker: usize,
    pub(super) keys: [Option<LegKey>; 2],
}

/// A handover asks a worker to park: export as of `at`, answer on `reply`.
pub struct ParkRequest {
    pub at: Snapshot,
    pub reply: Sender<Vec<ParkedPair>>,
}

/// One leg to resume: its socket, its record, what it releases when it ends (its unit and
/// gauge; the phone's place), and its timers on this process's clock.
pub struct ResumedLeg {
    pub socket: Arc<Socket>,
    pub record: LegRecord,
    pub release: Vec<Release>,
    /// When the output last moved (the wedge window runs from it).
    pub last_progress_ms: u64,
    /// When a running linger ends.
    pub linger_due_ms: Option<u64>,
    /// When the leg was last heard from (the idle window runs from it).
    pub last_heard_ms: u64,
}

/// A pair a live handover brought to this process.
pub struct ResumedPair {
    pub relay_host_id: Option<String>,
    pub phone: Option<ResumedLeg>,
    pub host: Option<ResumedLeg>,
}

impl ResumedPair {
    pub fn legs(&self) -> usize {
        usize::from(self.phone.is_some()) + usize::from(self.host.is_some())
    }
}
