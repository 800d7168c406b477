//! The records of a spliced pair as they outlive its process: each leg's bytes read and not
//! acted on (a partial frame, or whole frames a turn's control budget left unparsed), its
//! parser's fragmentation state, a large frame being forwarded as its payload arrives, the
//! output its socket has not taken yet and where the socket is in the frames written to it, the
//! control frames owed to it, whether it is paused or closing, and its timers as the time passed
//! or left.
//!
//! Plain data: a parked splice worker builds these (`relay/splice/worker.rs`) and a worker of
//! the next process resumes from them.

use serde::{Deserialize, Serialize};

use super::bytes::base64_bytes;
use super::connection::ParserRecord;

/// One leg as a live handover carries it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct LegRecord {
    /// The connection id (logs).
    pub id: u64,
    pub parser: ParserRecord,
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
    /// Since the leg was last heard from (the idle window: bytes arrived, or its end
    /// acknowledged more of an unfinished frame). `None` (version 1, which had no
    /// idle timeout): the window starts when the leg resumes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub arrival_ago_ms: Option<u64>,
    /// The relay's own idle ping has been sent since the last arrival.
    #[serde(default)]
    pub idle_pinged: bool,
}

/// A splice leg's frame cursor (`relay::splice::leg::FrameCursor`) as a record.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CursorRecord {
    pub left: u64,
    #[serde(with = "base64_bytes")]
    pub head: Vec<u8>,
}

/// A frame forwarded as its payload arrives (`relay::splice::leg::StreamIn`) as a record.
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
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PairRecord {
    /// The desktop the pair belongs to (the phone's place among its phones; its pairs close
    /// when its control leaves).
    pub relay_host_id: Option<String>,
    pub phone: Option<LegRecord>,
    pub host: Option<LegRecord>,
}

impl PairRecord {
    /// Its legs' byte buffers (the bytes not acted on, the pending output), in the order a
    /// document lists them ([`super::Carried`]). A cursor's header and the owed control frames
    /// (a few bytes each) stay in the document.
    pub(super) fn byte_fields(&mut self) -> Vec<&mut Vec<u8>> {
        let mut fields = Vec::new();
        for leg in [self.phone.as_mut(), self.host.as_mut()]
            .into_iter()
            .flatten()
        {
            fields.push(&mut leg.partial);
            fields.push(&mut leg.output);
        }
        fields
    }
}

/// A spliced pair: its legs' descriptors' indices and the pair as the worker had it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PairEntry {
    pub phone_fd: Option<usize>,
    pub host_fd: Option<usize>,
    pub pair: PairRecord,
}
