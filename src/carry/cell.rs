//! The records of a cell's state as they outlive its process: the model (seats, invites), the
//! seat log the feed serves, bookings, the admit modes and the applied switch, the dead-man's
//! window, the admit-effective writer, and what the cell-wide threads were due to do next.
//! Moments travel as ages and deadlines as the time left (`carry::time`).
//!
//! Plain data: each owner builds its record (`record`) and restores from it (`restore`).

use serde::{Deserialize, Serialize};

/// The cell's part of a live handover's state document (connections travel apart, with their
/// descriptors).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CellRecord {
    pub model: CellStateRecord,
    pub seat_log: SeatLogRecord,
    pub bookings: Vec<BookingRecord>,
    pub mode: ModeRecord,
    pub contact_ago_ms: Option<u64>,
    pub window: Option<WindowRecord>,
    /// Claim answers the watchdog had not taken yet: (generation, silence's age, permit).
    pub claim_answers: Vec<(u64, u64, bool)>,
    pub writer: Option<WriterRecord>,
    pub next_ping_in_ms: u64,
    pub next_lease_renewal_in_ms: u64,
    /// The last heartbeat: its age and the `ready` it carried.
    pub last_heartbeat: Option<(u64, bool)>,
    pub next_connection_id: u64,
}

/// A seat as a live handover carries it (its control, if any, travels as a connection; its
/// phones as the phones' places).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SeatRecord {
    pub relay_host_id: String,
    pub user_id: String,
    pub epoch: i64,
    pub generation: u64,
    /// How long ago the host left (its memory's age); `None` while seated.
    pub left_ago_ms: Option<u64>,
    pub demoted: bool,
}

/// An invite as a live handover carries it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct InviteRecord {
    pub token: String,
    pub relay_host_id: String,
    pub expires_in_ms: u64,
    pub attempts_left: u32,
}

/// The cell model as a live handover carries it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CellStateRecord {
    pub seats: Vec<SeatRecord>,
    /// Host by host, each host's oldest first (since state version 2; a version-1 document
    /// has them in token order, which only decides which one a new invite replaces).
    pub invites: Vec<InviteRecord>,
    /// The counter of connection ids (`conn-open`), so ids stay unique.
    pub next_conn: u64,
}

/// One change of the ring, as a live handover carries it (timestamps as they were reported).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ChangeRecord {
    pub seq: u64,
    pub kind: String,
    pub user_id: String,
    pub relay_host_id: String,
    pub epoch: i64,
    pub generation: u64,
    pub at_ms: u64,
}

/// A current seat of the feed, as a live handover carries it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct FeedSeatRecord {
    pub relay_host_id: String,
    pub user_id: String,
    pub epoch: i64,
    pub generation: u64,
    pub since_ms: u64,
}

/// The seat log as a live handover carries it: a director's cursor stays valid across it (the
/// incarnation is kept, the sequence goes on).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SeatLogRecord {
    pub seq: u64,
    pub current: Vec<FeedSeatRecord>,
    pub ring: Vec<ChangeRecord>,
}

/// A booking as a live handover carries it: its key and the time left.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct BookingRecord {
    pub user_id: String,
    pub relay_host_id: String,
    pub epoch: i64,
    pub expires_in_ms: u64,
}

/// The mode as a live handover carries it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ModeRecord {
    pub switch: SwitchRecord,
    pub raw_reserve: bool,
    pub effective_reserve: bool,
    /// `off`, `armed`, `held`, `tripped`.
    pub dead_man: String,
    /// The age of the effective last contact at the watchdog's last tick (0: none yet).
    pub silence_started_ago_ms: Option<u64>,
}

/// An applied switch as a live handover carries it (the next process applies nothing again
/// unless the file has a higher generation).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SwitchRecord {
    pub generation: u64,
    pub reserve: bool,
    pub dead_man_trip_slots: Option<u32>,
}

/// The window as a live handover carries it: its generation, latch and held/permit
/// bookkeeping, with every moment as its age. (The window length and the claim retry are the
/// next process's own configuration.)
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct WindowRecord {
    pub generation: Option<u64>,
    pub armed_ago_ms: u64,
    pub tripped: bool,
    pub slots: Option<u32>,
    /// `off`, `armed`, `held`, `tripped`.
    pub state: String,
    pub silence_started_ago_ms: u64,
    /// The silence whose held line was logged (its age).
    pub held_logged_for_ago_ms: Option<u64>,
    /// The last permit request: (the silence it was for, when it was asked), as ages.
    pub last_request_ago_ms: Option<(u64, u64)>,
}

/// What the writer knows, as a live handover carries it: the last row written (its age) and
/// the views that decide the next write, including a permit still held for the watchdog.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct WriterRecord {
    /// The mode of the last row written (`db`, `reserve`) and its age.
    pub row: Option<(String, u64)>,
    pub switch_says_reserve: bool,
    pub raw_reserve: bool,
    pub tripped: bool,
    pub permit_hold: bool,
}
