//! Spliced pairs across a live handover (ARCHITECTURE.md "Live handover").
//!
//! A parked worker exports each of its legs as a [`LegRecord`] beside its socket: the bytes it
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

use serde::{Deserialize, Serialize};

use super::leg::Release;
use crate::carry::Snapshot;
use crate::relay::frames::ParserState;
use crate::relay::park::base64_bytes;
use crate::relay::socket::Socket;

/// One leg as a live handover carries it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct LegRecord {
    /// The connection id (logs).
    pub id: u64,
    pub parser: ParserState,
    /// Bytes read past the last whole frame (a frame not yet whole).
    #[serde(with = "base64_bytes")]
    pub partial: Vec<u8>,
    /// What that frame needs in all, once known (0: not yet).
    pub needed: usize,
    /// Bytes queued for this leg's socket, not yet written.
    #[serde(with = "base64_bytes")]
    pub output: Vec<u8>,
    /// `None` while frames flow; `Some(linger)` once a close frame is queued or sent.
    pub closing: Option<bool>,
    /// Reading stopped because the peer's output is over the bound.
    pub paused: bool,
    /// The peer's end of stream or an error was seen.
    pub hangup_seen: bool,
    /// Since the output last moved (or began to wait): the wedge window's elapsed part.
    pub progress_ago_ms: u64,
    /// A closing leg's linger: the time left, if it is running.
    pub linger_left_ms: Option<u64>,
    /// Since state version 2. Where the socket is in the frames written to it: payload bytes
    /// left of the frame being written and the header bytes seen of the next. `None` (version
    /// 1): the pending output is taken as ending at a frame boundary (it held whole frames).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cursor: Option<CursorRecord>,
    /// A frame this leg sends that is forwarded as its payload arrives.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stream_in: Option<StreamInRecord>,
    /// The control frame being written to this leg's socket, and the one waiting.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub control_in_flight: Option<ControlFrameRecord>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub control_next: Option<ControlFrameRecord>,
    /// Since bytes last arrived on this leg (the idle window). `None` (version 1, which had no
    /// idle timeout): the window starts when the leg resumes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub arrival_ago_ms: Option<u64>,
    /// The relay's own idle ping has been sent since the last arrival.
    #[serde(default)]
    pub idle_pinged: bool,
}

/// [`super::leg::FrameCursor`] as a handover carries it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CursorRecord {
    pub left: u64,
    #[serde(with = "base64_bytes")]
    pub head: Vec<u8>,
}

/// [`super::leg::StreamIn`] as a handover carries it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct StreamInRecord {
    pub left: usize,
    pub mask: [u8; 4],
    pub offset: usize,
}

/// A control frame the relay owes a socket: the whole frame and how many bytes went out.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ControlFrameRecord {
    #[serde(with = "base64_bytes")]
    pub frame: Vec<u8>,
    pub written: u8,
}

/// A pair as a live handover carries it. A leg whose peer has ended travels alone (it is
/// closing).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PairRecord {
    /// The desktop the pair belongs to (the phone's place among its phones; its pairs close
    /// when its control leaves).
    pub relay_host_id: Option<String>,
    pub phone: Option<LegRecord>,
    pub host: Option<LegRecord>,
}

/// What a parked worker gives the handover: each pair's record and the legs' sockets (which the
/// worker keeps, untouched, until the handover ends).
pub struct ParkedPair {
    pub record: PairRecord,
    pub phone: Option<Arc<Socket>>,
    pub host: Option<Arc<Socket>>,
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
    /// When bytes last arrived (the idle window runs from it).
    pub last_arrival_ms: u64,
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
