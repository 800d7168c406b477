//! The live handover's state document, in its two parts: [`Document`] (the listeners, every
//! connection a relay thread or the pending loop deposited, the cell's and the process's state),
//! sent while streams still flow, and [`PairsDocument`] (the spliced pairs and the metrics'
//! totals), sent once the splice workers are parked. Descriptors travel beside a document (by
//! index into the message's descriptors), never inside it; so do, since state version 3, the
//! connections' and legs' byte buffers ([`super::Carried`]).

use serde::{Deserialize, Serialize};

use super::cell::CellRecord;
use super::connection::ConnectionRecord;
use super::pair::PairEntry;
use super::process::{ReadinessRecord, SeriesRecord};
use super::time::Stamp;

/// The listeners' descriptors in the transfer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ListenerIndices {
    pub ws: usize,
    pub http: usize,
    /// The running process's standard error: the next process logs where it did.
    pub stderr: Option<usize>,
}

/// The state document's first part (see ARCHITECTURE.md "The state format"): everything but
/// the spliced pairs, sent while streams still flow.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Document {
    pub v: u32,
    /// `cell` or `combined`: the next process must run the same role.
    pub role: String,
    pub cell_id: String,
    pub incarnation: i64,
    /// When the giver took the snapshot, by its clock (ms since the epoch).
    pub snapshot_ms: u64,
    /// The same moment on the machine's monotonic clock (`clock::machine_ms`), which the
    /// next process measures the travel against (absent from an older build: the wall clocks
    /// are compared then).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub snapshot_machine_ms: Option<u64>,
    pub from_version: String,
    pub listeners: ListenerIndices,
    pub cell: CellRecord,
    pub readiness: ReadinessRecord,
    pub connections: Vec<ConnectionRecord>,
    /// The name of the running process's crash-store region, when it keeps one (the next
    /// process removes it from the service manager's store once it has stored its own). Absent
    /// from an older build, and without a store.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub crash_region: Option<String>,
}

/// The state document's second part: the spliced pairs and the metrics' totals, sent once the
/// splice workers are parked.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PairsDocument {
    pub v: u32,
    pub snapshot_ms: u64,
    /// As in [`Document::snapshot_machine_ms`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub snapshot_machine_ms: Option<u64>,
    pub metrics: Vec<SeriesRecord>,
    pub pairs: Vec<PairEntry>,
}

impl super::Carried for Document {
    fn byte_fields(&mut self) -> Vec<&mut Vec<u8>> {
        self.connections
            .iter_mut()
            .flat_map(ConnectionRecord::byte_fields)
            .collect()
    }

    fn version(&self) -> u32 {
        self.v
    }
}

impl super::Carried for PairsDocument {
    fn byte_fields(&mut self) -> Vec<&mut Vec<u8>> {
        self.pairs
            .iter_mut()
            .flat_map(|entry| entry.pair.byte_fields())
            .collect()
    }

    fn version(&self) -> u32 {
        self.v
    }
}

impl Document {
    /// When the giver took the snapshot.
    pub fn sent_at(&self) -> Stamp {
        Stamp {
            wall_ms: self.snapshot_ms,
            machine_ms: self.snapshot_machine_ms,
        }
    }
}

impl PairsDocument {
    /// When the giver took the pairs' snapshot.
    pub fn sent_at(&self) -> Stamp {
        Stamp {
            wall_ms: self.snapshot_ms,
            machine_ms: self.snapshot_machine_ms,
        }
    }
}
