//! The records of one connection as they outlive its process: where it was in its life (its
//! [`StageRecord`]), what its reader held, who it is (a desktop's claims, a control's place in
//! the cell, a waiting phone's pending entry). Deadlines travel as the time left, moments as
//! their age (`carry::time`), so that no two processes' clocks are compared.
//!
//! Plain data: the relay builds these from its live connections and rebuilds connections from
//! them (`relay/park.rs`); how they are written down is this room's business alone.

use serde::{Deserialize, Serialize};

/// What a parser carries across a handover: the fragmented message in progress, if any. (A
/// parser that found a violation is not carried: its leg is closing.)
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ParserRecord {
    /// The opcode of the open message (1 text, 2 binary), if one is open.
    pub open_opcode: Option<u8>,
    /// Its bytes so far.
    pub open_len: usize,
}

/// What a desktop's token said, as far as the relay uses it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ClaimsRecord {
    pub user_id: String,
    pub relay_host_id: String,
    pub expires_at: u64,
}

/// What a frame reader had: bytes read past the last frame it acted on (at most one partial
/// frame, or frames not yet looked at) and the parser's fragmentation state; a control reader
/// also has the fragments of a message it is assembling.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ReaderRecord {
    #[serde(with = "super::bytes::base64_bytes")]
    pub buffered: Vec<u8>,
    pub parser: ParserRecord,
    /// A control reader's message in progress: its fragments' payload so far.
    #[serde(default, with = "super::bytes::base64_option")]
    pub message: Option<Vec<u8>>,
}

/// A control's identity in the cell (its seat holds it).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ControlRecord {
    pub claims: ClaimsRecord,
    pub epoch: i64,
    pub generation: u64,
    pub admitted_via: AdmitPathRecord,
    pub lease_id: Option<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum AdmitPathRecord {
    Booking,
    Memory,
    Database,
}

/// A control's `invite-create` bucket (`relay::park::InviteBucket`) as a record: the refill
/// moment as its age.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct InviteRateRecord {
    pub available: u32,
    pub refilled_ago_ms: u64,
}

/// A phone waiting for its host's data leg: its pending entry in the cell.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct WaitingPhoneRecord {
    pub relay_host_id: String,
    pub conn_id: String,
    pub ticket: String,
    pub generation: u64,
}

/// Where a connection was in its life (`relay::park::Stage`) as a record: deadlines as the time
/// left.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "stage", rename_all = "camelCase")]
pub enum StageRecord {
    #[serde(rename_all = "camelCase")]
    Upgrading {
        #[serde(with = "super::bytes::base64_bytes")]
        received: Vec<u8>,
        deadline_left_ms: u64,
    },
    #[serde(rename_all = "camelCase")]
    FirstFrame {
        path: String,
        claims: Option<ClaimsRecord>,
        reader: ReaderRecord,
        text: Option<String>,
        deadline_left_ms: u64,
    },
    #[serde(rename_all = "camelCase")]
    Control {
        control: ControlRecord,
        reader: ReaderRecord,
        silence_left_ms: u64,
        /// Since state version 2: the control's `invite-create` bucket. A version-1 process had
        /// no limit: its controls resume with a full bucket.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        invites: Option<InviteRateRecord>,
    },
    #[serde(rename_all = "camelCase")]
    PhoneWaiting {
        phone: WaitingPhoneRecord,
        reader: ReaderRecord,
        attach_left_ms: u64,
    },
}

/// A connection a relay thread deposited: its descriptor's index and where it was.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ConnectionRecord {
    pub fd: usize,
    pub id: u64,
    pub stage: StageRecord,
    /// Since state version 3: bytes owed to the socket before anything else (the rest of a
    /// frame whose write the quiesce interrupted, and frames sent during it), and how long ago
    /// their write began (its deadline goes on from there). Version 2 and before: none (a
    /// write finished before its thread deposited).
    #[serde(default, with = "super::bytes::base64_bytes")]
    pub owed: Vec<u8>,
    #[serde(default)]
    pub owed_age_ms: u64,
}

impl ConnectionRecord {
    /// Its byte buffers, in the order a document lists them ([`super::Carried`]).
    pub(super) fn byte_fields(&mut self) -> Vec<&mut Vec<u8>> {
        let mut fields = vec![&mut self.owed];
        match &mut self.stage {
            StageRecord::Upgrading { received, .. } => fields.push(received),
            StageRecord::FirstFrame { reader, .. }
            | StageRecord::Control { reader, .. }
            | StageRecord::PhoneWaiting { reader, .. } => {
                fields.push(&mut reader.buffered);
                if let Some(message) = reader.message.as_mut() {
                    fields.push(message);
                }
            }
        }
        fields
    }
}
