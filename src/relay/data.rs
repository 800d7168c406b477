//! The host data leg `GET /v1/host/data/<connId>` (SPEC §5.2), on its relay thread until it
//! attaches.
//!
//! The leg authenticates with the ticket of a pending phone; then the phone hears
//! `relay-hello`, and this thread hands its socket, what its reader took off the wire past the
//! first frame, and its connection unit to the phone's thread (the pending entry's channel),
//! which hands the pair to a splice worker (`relay/splice/`). This thread then ends.

use std::sync::Arc;

use tungstenite::Message;

use super::socket::Socket;
use super::splice::LegHandOff;
use super::splice_reader::SpliceReader;
use super::{read_first_splice_text, ConnectionHold, RelayContext, Served};
use crate::protocol::{self, CloseCode, DataLegFirst};

pub fn serve(
    context: &RelayContext,
    socket: Arc<Socket>,
    mut reader: SpliceReader,
    conn_id: &str,
    hold: &mut Option<ConnectionHold>,
) -> Served {
    let text = match read_first_splice_text(context, &mut reader) {
        Ok(text) => text,
        Err(code) => {
            context.close(&socket, code, "first frame");
            return Served::Ended;
        }
    };
    let (ticket, generation) = match serde_json::from_str::<DataLegFirst>(&text) {
        Ok(DataLegFirst::HostDataAuth {
            v: 1,
            conn_ticket,
            generation,
        }) => (conn_ticket, generation),
        _ => {
            context.close(&socket, CloseCode::BadOuterCredential, "bad host-data-auth");
            return Served::Ended;
        }
    };
    let Some(pending) = context.cell.take_pending(conn_id, &ticket, generation) else {
        context.close(&socket, CloseCode::BadOuterCredential, "unknown connection");
        return Served::Ended;
    };
    let phone = pending.phone;
    // The phone hears relay-hello before any spliced frame: it is sent before the hand-off.
    if phone
        .send(Message::text(protocol::relay_hello_json()))
        .is_err()
    {
        context.close(&socket, CloseCode::PeerDropped, "phone left");
        return Served::Ended;
    }
    let (buffered, parser) = reader.into_parts();
    let leg = LegHandOff {
        socket: socket.clone(),
        buffered,
        parser,
        release: hold
            .take()
            .map(|hold| Box::new(hold) as super::splice::Release)
            .into_iter()
            .collect(),
    };
    if pending.attach.send(leg).is_err() {
        // The phone's thread gave up; the hand-off (and the unit in it) was dropped.
        context.close(&socket, CloseCode::PeerDropped, "phone left");
        return Served::Ended;
    }
    Served::HandedOff
}
