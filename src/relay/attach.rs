//! How a host's data leg reaches the phone that waits for it: the [`Attach`] message on the
//! phone's pending entry's channel (a bounded channel the cell's model keeps beside the entry),
//! and the `Peer` impl that tells the cell's model (`cell::state`) the socket and message types
//! of this data plane.

use super::socket::Socket;
use super::splice::LegHandOff;
use crate::cell::state::Peer;

/// What a waiting phone hears on its pending entry's channel.
pub enum Attach {
    /// Its host's data leg, ready to be spliced.
    Leg(LegHandOff),
    /// A handover is quiescing the cell.
    Wake,
}

/// Room for a wake and a leg at once: a data leg's send never waits behind a wake.
pub const ATTACH_CHANNEL: usize = 2;

impl Peer for Socket {
    type Attached = Attach;
    fn id(&self) -> u64 {
        self.id
    }
}
