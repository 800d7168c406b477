//! The host data leg `GET /v1/host/data/<connId>` and the splice pump (SPEC §5.2).
//!
//! Each leg's relay thread pumps its own socket into the other leg's writer: frames pass
//! unchanged (text stays text, binary stays binary). Either side leaving closes the other
//! 4408. A write that cannot make progress for the wedge window marks that direction wedged:
//! the stalled peer is dropped and the sender closed 4429, and no other pair notices.

use std::sync::Arc;

use tungstenite::Message;

use super::socket::{SendError, Socket};
use super::splice_reader::{violation_close_code, SpliceEvent, SpliceReader};
use super::{read_first_splice_text, RelayContext};
use crate::protocol::{self, CloseCode, DataLegFirst};

#[derive(Debug, Clone, Copy)]
pub enum Direction {
    PhoneToHost,
    HostToPhone,
}

pub fn serve(context: &RelayContext, socket: Arc<Socket>, mut reader: SpliceReader, conn_id: &str) {
    let text = match read_first_splice_text(context, &mut reader) {
        Ok(text) => text,
        Err(code) => return context.close(&socket, code, "first frame"),
    };
    let (ticket, generation) = match serde_json::from_str::<DataLegFirst>(&text) {
        Ok(DataLegFirst::HostDataAuth {
            v: 1,
            conn_ticket,
            generation,
        }) => (conn_ticket, generation),
        _ => return context.close(&socket, CloseCode::BadOuterCredential, "bad host-data-auth"),
    };
    let Some(pending) = context.cell.take_pending(conn_id, &ticket, generation) else {
        return context.close(&socket, CloseCode::BadOuterCredential, "unknown connection");
    };
    let phone = pending.phone;
    // The phone hears relay-hello before any spliced frame: it is sent before the hand-off.
    if phone
        .send(Message::text(protocol::relay_hello_json()))
        .is_err()
        || pending.attach.send(socket.clone()).is_err()
    {
        return context.close(&socket, CloseCode::PeerDropped, "phone left");
    }
    pump(
        context,
        &mut reader,
        &socket,
        &phone,
        Direction::HostToPhone,
    );
}

/// Forwards every data frame read from `from` to `to`, unchanged, until one side ends.
pub fn pump(
    context: &RelayContext,
    reader: &mut SpliceReader,
    from: &Arc<Socket>,
    to: &Arc<Socket>,
    direction: Direction,
) {
    reader.set_read_timeout(None);
    let (bytes, frames) = match direction {
        Direction::PhoneToHost => (
            &context.metrics.bytes_phone_to_host,
            &context.metrics.frames_phone_to_host,
        ),
        Direction::HostToPhone => (
            &context.metrics.bytes_host_to_phone,
            &context.metrics.frames_host_to_phone,
        ),
    };
    loop {
        match reader.read() {
            SpliceEvent::Frame { data, fin, payload } => match to.send_frame(data, fin, payload) {
                Ok(()) => {
                    bytes.add(payload.len() as u64);
                    frames.inc();
                }
                Err(SendError::Wedged) => {
                    log::info!(
                        "orca_relay_splice_wedged conn={} peer={} direction={direction:?}",
                        from.id,
                        to.id
                    );
                    // Close the sender first: the stalled side's own thread will notice the
                    // shutdown and must not win the race with a 4408.
                    context.close(from, CloseCode::LimitExceeded, "wedged");
                    to.shutdown();
                    return;
                }
                Err(SendError::Closed) => {
                    context.close(from, CloseCode::PeerDropped, "peer left");
                    return;
                }
            },
            SpliceEvent::TimedOut => {}
            SpliceEvent::Violation(violation) => {
                log::info!(
                    "orca_relay_splice_protocol_violation conn={} rule={} direction={direction:?}",
                    from.id,
                    violation.name()
                );
                let code = violation_close_code(violation);
                context.close(from, code, violation.name());
                context.close(to, CloseCode::PeerDropped, "peer left");
                if code == CloseCode::TooBig {
                    reader.drain_after_close();
                }
                return;
            }
            SpliceEvent::Gone => {
                context.close(to, CloseCode::PeerDropped, "peer left");
                return;
            }
        }
        if from.is_closing() {
            return;
        }
    }
}
