//! What outlives a process: the records a running process leaves for the one that comes after
//! it, their versions, and how they are written down and read back.
//!
//! Owns: the records of each kind of connection (`connection`: a stage, what a reader held, a
//! control's identity, a waiting phone; `pair`: a spliced pair's legs), of the cell's state
//! (`cell`) and of the process's own (`process`: readiness clocks, metric totals); the live
//! handover's two documents (`document`); carried time (`time`: a deadline as the time left, a
//! moment as its age, the travel measured on the machine's monotonic clock); and the encoding
//! (JSON; byte buffers beside it, raw, in the order the document lists them: [`Carried`];
//! base64 inside it in the versions before 3: `bytes`), read back only in a version this build
//! knows.
//!
//! Never: moves a record (the transports do: the handover's unix socket, `handover/`), or knows
//! what a record describes beyond its fields (each owner builds its record and restores itself
//! from one: `relay/park.rs`, `relay/splice/worker.rs`, `cell/*`, `dead_man/*`, `readiness`,
//! `metrics`). No file outside this folder knows how a record is encoded.

mod bytes;
pub mod cell;
pub mod connection;
pub mod crash;
pub mod document;
pub mod pair;
pub mod process;
pub mod time;

/// The state document's version this build writes.
///
/// 1. The first.
/// 2. A control carries its `invite-create` bucket (`invites`; a version-1 control resumes with
///    a full one: its process had no limit); invites are listed host by host, oldest first
///    (version 1: by token), at most 8 a host (the oldest of a version-1 host beyond that are
///    dropped); a connection the acceptor's pending loop held (a head arriving, a splice leg's
///    first frame) is one with no `claims` (version 1 had them on relay threads: they go to
///    the pending loop, as a version-2 process would have them); a spliced leg carries its
///    output's frame cursor (version 1: its output taken as ending at a frame boundary), a
///    frame it streams, the control frames owed to it, and its idle clock (version 1: starts
///    at the handover); the pair's desktop for both legs. Later, without a new version (an
///    optional field each side may ignore): `snapshotMachineMs`, the snapshot on the machine's
///    monotonic clock (absent: the travel is measured on the two wall clocks, as before).
/// 3. Byte buffers travel beside the document, raw, not inside it as base64 ([`Carried`]: a
///    connection's reader bytes, a head arriving, a leg's bytes not acted on and its pending
///    output; inside the document each is `""`, its bytes come in the document's order); a
///    connection carries the bytes owed to its socket (`owed`, `owedAgeMs`: a write the
///    quiesce interrupted, frames sent during it; versions 1 and 2: none).
pub const STATE_VERSION: u32 = 3;

/// The versions this build reads (every one from the first).
pub const READS: &[u32] = &[1, 2, 3];

/// The first version whose byte buffers travel beside the document.
const RAW_BYTES_SINCE: u32 = 3;

/// The most one byte buffer beside a document may weigh: more than any connection holds in one
/// (a leg's output at its bound, a control's 1 MiB frame and message); a longer one announced
/// is refused before anything is allocated for it.
pub const MAX_CARRIED_BUFFER: usize = 16 << 20;

/// A document whose byte buffers travel beside it, raw (state version 3 on): each buffer is
/// taken out before the document is written (left empty in it, `""`) and sent after it in the
/// order of [`Carried::byte_fields`]; the reader puts each back in the same order. No buffer is
/// copied on the way (the writer's are moved out and back; the reader's are received into
/// their final place).
pub trait Carried {
    /// Every byte buffer of the document, always in the same order.
    fn byte_fields(&mut self) -> Vec<&mut Vec<u8>>;
    /// The document's state version.
    fn version(&self) -> u32;
}

/// Takes `document`'s byte buffers out and writes it down: (the document, the buffers in its
/// order). The caller sends both, then puts the buffers back with [`put_back`] (a failed
/// handover resumes from them).
pub fn write_parts<T: serde::Serialize + Carried>(
    document: &mut T,
) -> Result<(Vec<u8>, Vec<Vec<u8>>), String> {
    let buffers: Vec<Vec<u8>> = document
        .byte_fields()
        .into_iter()
        .map(std::mem::take)
        .collect();
    match write_document(document) {
        Ok(bytes) => Ok((bytes, buffers)),
        Err(e) => {
            put_back(document, buffers);
            Err(e)
        }
    }
}

/// Puts the buffers [`write_parts`] took back into `document`.
pub fn put_back<T: Carried>(document: &mut T, buffers: Vec<Vec<u8>>) {
    for (field, buffer) in document.byte_fields().into_iter().zip(buffers) {
        *field = buffer;
    }
}

/// Reads a document of any version this build knows, with the byte buffers that came beside it
/// (none before version 3, whose buffers are inside it).
pub fn read_parts<T: serde::de::DeserializeOwned + Carried>(
    bytes: &[u8],
    buffers: Vec<Vec<u8>>,
    reads: &[u32],
) -> Result<T, String> {
    let mut document: T = read_document(bytes, reads)?;
    if document.version() < RAW_BYTES_SINCE {
        if !buffers.is_empty() {
            return Err(format!(
                "byte buffers beside a state document of version {}",
                document.version()
            ));
        }
        return Ok(document);
    }
    let fields = document.byte_fields().len();
    if fields != buffers.len() {
        return Err(format!(
            "the state document lists {fields} byte buffers, {} came",
            buffers.len()
        ));
    }
    put_back(&mut document, buffers);
    Ok(document)
}

/// The most a state document may weigh (pending output is bounded per leg; this bounds a
/// document that lies about its size).
pub const MAX_DOCUMENT: usize = 1 << 30;

/// Writes a document (or any record) down.
pub fn write_document<T: serde::Serialize>(document: &T) -> Result<Vec<u8>, String> {
    serde_json::to_vec(document).map_err(|e| format!("cannot write the state document: {e}"))
}

/// Reads a part of the state document of any version this build knows, upgraded to the
/// current one.
pub fn read_document<T: serde::de::DeserializeOwned>(
    bytes: &[u8],
    reads: &[u32],
) -> Result<T, String> {
    #[derive(serde::Deserialize)]
    struct Version {
        v: u32,
    }
    let version: Version = serde_json::from_slice(bytes)
        .map_err(|e| format!("the state document is not readable: {e}"))?;
    if !reads.contains(&version.v) {
        return Err(format!(
            "state version {} is not one this build reads ({})",
            version.v,
            reads
                .iter()
                .map(u32::to_string)
                .collect::<Vec<_>>()
                .join(", ")
        ));
    }
    serde_json::from_slice(bytes).map_err(|e| {
        format!(
            "the state document (version {}) is not readable: {e}",
            version.v
        )
    })
}

#[cfg(test)]
mod tests {
    use super::document::{Document, PairsDocument};
    use super::*;

    #[test]
    fn only_known_versions_are_read() {
        let document = br#"{"v":99}"#;
        let error = read_document::<Document>(document, READS).unwrap_err();
        assert!(error.contains("state version 99"), "{error}");
        assert!(read_document::<PairsDocument>(b"not json", READS).is_err());
    }

    /// The state a version-1 build sent (`tests/fixtures/handover/v1`, captured from the build
    /// before the format's last change) reads as this version: its controls carry no
    /// `invite-create` bucket (they resume with a full one: `relay::park`).
    #[test]
    fn a_version_1_document_reads() {
        let cell = include_bytes!("../../tests/fixtures/handover/v1/cell.json");
        let pairs = include_bytes!("../../tests/fixtures/handover/v1/pairs.json");
        let document = read_document::<Document>(cell, READS).unwrap();
        assert_eq!(document.v, 1);
        let controls: Vec<_> = document
            .connections
            .iter()
            .filter_map(|record| match &record.stage {
                connection::StageRecord::Control { invites, .. } => Some(invites),
                _ => None,
            })
            .collect();
        assert_eq!(controls.len(), 3);
        assert!(controls.iter().all(|invites| invites.is_none()));
        let pairs = read_document::<PairsDocument>(pairs, READS).unwrap();
        assert_eq!(pairs.pairs.len(), 1);
        assert!(read_document::<Document>(cell, &[2]).is_err());
    }
}
