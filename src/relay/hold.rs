//! What an admitted connection holds, released when dropped: its unit of the connection cap
//! and its place in the connections gauge ([`ConnectionHold`]), and a phone's place among its
//! host's phones ([`PhonePlace`]). Each travels with its connection (a relay thread, a splice
//! leg, a handover's deposit), so that it is released exactly once, when the connection ends.

use std::sync::Arc;

use super::socket::Socket;
use crate::cell::state::{CellState, SlotGuard};
use crate::metrics::Gauge;

/// A connection's unit of the cap and its place in the connections gauge, released together
/// when dropped: at the end of the relay thread, or of the splice leg it was handed to.
pub struct ConnectionHold {
    _slot: SlotGuard,
    gauge: Gauge,
}

impl ConnectionHold {
    /// Counts the connection in `gauge` until dropped.
    pub fn new(slot: SlotGuard, gauge: Gauge) -> ConnectionHold {
        gauge.inc();
        ConnectionHold { _slot: slot, gauge }
    }
}

impl Drop for ConnectionHold {
    fn drop(&mut self) {
        self.gauge.dec();
    }
}

/// One of the host's phone places (at most 8, SPEC §5.2), returned when dropped.
pub struct PhonePlace {
    cell: Arc<CellState<Socket>>,
    relay_host_id: String,
}

impl PhonePlace {
    /// The place `CellState::admit_phone` took for an admitted phone.
    pub fn taken(cell: &Arc<CellState<Socket>>, relay_host_id: &str) -> PhonePlace {
        PhonePlace {
            cell: cell.clone(),
            relay_host_id: relay_host_id.to_string(),
        }
    }

    /// A place for a phone a handover brought (taken past the limit if need be: the phone is
    /// connected already).
    pub fn carried(cell: &Arc<CellState<Socket>>, relay_host_id: &str) -> PhonePlace {
        cell.take_phone_place(relay_host_id);
        PhonePlace {
            cell: cell.clone(),
            relay_host_id: relay_host_id.to_string(),
        }
    }
}

impl Drop for PhonePlace {
    fn drop(&mut self) {
        self.cell.release_phone(&self.relay_host_id);
    }
}
