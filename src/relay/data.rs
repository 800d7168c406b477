//! The host data leg `GET /v1/host/data/<connId>` (SPEC §5.2).
//!
//! Its credential is its first frame, `host-data-auth` with the ticket of a waiting phone, read
//! by the acceptor's pending loop; [`authenticate`] checks it there (the ticket and generation
//! must match the pending phone and the host's live control) and only then does the leg take a
//! unit of the connection cap. It needs no thread of its own: its socket, what its reader read
//! past the first frame and its unit go to the phone's thread through the pending entry's
//! channel, and from there with the pair to a splice worker (`relay/splice/`).

use super::attach::Attach;
use super::context::RelayContext;
use super::frames::CloseAnswer;
use super::hold::ConnectionHold;
use super::refuse::{close_pending, close_pending_socket};
use super::socket::Socket;
use super::splice::LegHandOff;
use super::splice_reader::PendingLeg;
use crate::carry::crash::CrashKind;
use crate::protocol::{CloseCode, DataLegFirst};

/// Checks a data leg's first frame on the acceptor's thread and, if it authenticates, passes
/// the leg to its phone's thread; otherwise closes it with its code.
pub fn authenticate(context: &RelayContext, leg: PendingLeg, conn_id: &str, text: &str) {
    let PendingLeg { id, stream, reader } = leg;
    let (ticket, generation) = match serde_json::from_str::<DataLegFirst>(text) {
        Ok(DataLegFirst::HostDataAuth {
            v: 1,
            conn_ticket,
            generation,
        }) => (conn_ticket, generation),
        _ => {
            return close_pending(
                context,
                stream,
                reader.close_answer(),
                CloseCode::BadOuterCredential,
                "bad host-data-auth",
            )
        }
    };
    // The unit first, so a full cap refuses the leg without using up the phone's entry.
    let Some(unit) = context.slots.try_take() else {
        return close_pending(
            context,
            stream,
            reader.close_answer(),
            CloseCode::LimitExceeded,
            "connection cap",
        );
    };
    let pending = match context.cell.take_pending(conn_id, &ticket, generation) {
        Ok(Some(pending)) => pending,
        Ok(None) => {
            return close_pending(
                context,
                stream,
                reader.close_answer(),
                CloseCode::BadOuterCredential,
                "unknown connection",
            )
        }
        // Attaches freeze only while the acceptor is parked: not met here.
        Err(_) => {
            return close_pending(
                context,
                stream,
                reader.close_answer(),
                CloseCode::LimitExceeded,
                "try again",
            )
        }
    };
    let (buffered, parser) = reader.into_parts();
    let hold = ConnectionHold::new(unit, context.metrics.connections("data"));
    let socket = Socket::new_splice(id, stream);
    context.keep(
        &socket,
        CrashKind::Data,
        None,
        Some(&pending.relay_host_id),
        true,
    );
    let leg = LegHandOff {
        socket,
        buffered,
        parser,
        release: vec![Box::new(hold)],
    };
    if let Err(refused) = pending.attach.try_send(Attach::Leg(leg)) {
        // The phone's thread gave up: the leg (and the unit in it) goes.
        let (std::sync::mpsc::TrySendError::Full(attach)
        | std::sync::mpsc::TrySendError::Disconnected(attach)) = refused;
        if let Attach::Leg(leg) = attach {
            close_pending_socket(
                context,
                leg.socket.clone(),
                CloseAnswer::after(&leg.buffered),
                CloseCode::PeerDropped,
                "phone left",
            );
        }
    }
}
