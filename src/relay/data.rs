//! The host data leg `GET /v1/host/data/<connId>` (SPEC §5.2), on its relay thread until it
//! attaches.
//!
//! The leg authenticates with the ticket of a pending phone; then the phone hears
//! `relay-hello`, and this thread hands its socket, what its reader took off the wire past the
//! first frame, and its connection unit to the phone's thread (the pending entry's channel),
//! which hands the pair to a splice worker (`relay/splice/`). This thread then ends. While a
//! live handover has the attaches frozen, the leg is deposited with its first frame read and
//! not yet acted on.

use std::sync::Arc;
use std::time::Instant;

use tungstenite::Message;

use super::park::Stage;
use super::phone::Attach;
use super::socket::Socket;
use super::splice::LegHandOff;
use super::splice_reader::SpliceReader;
use super::{read_first_splice_text, ConnectionHold, FirstFrame, RelayContext, Served};
use crate::protocol::{self, CloseCode, DataLegFirst};

/// Where a data leg's first frame stands: not read yet (`text: None`, by `deadline`), or read
/// and not yet acted on (a handover carried it).
pub struct First {
    pub path: String,
    pub text: Option<String>,
    pub deadline: Instant,
}

pub fn serve(
    context: &RelayContext,
    socket: Arc<Socket>,
    mut reader: SpliceReader,
    conn_id: &str,
    hold: &mut Option<ConnectionHold>,
    first: First,
) -> Served {
    let text = match first.text {
        Some(text) => text,
        None => match read_first_splice_text(&mut reader, first.deadline) {
            FirstFrame::Text(text) => text,
            FirstFrame::Refused(code) => {
                context.close(&socket, code, "first frame");
                return Served::Ended;
            }
            FirstFrame::Quiesce => {
                return Served::parked(Stage::FirstFrame {
                    path: first.path,
                    claims: None,
                    reader: reader.record(),
                    text: None,
                    deadline: first.deadline,
                })
            }
        },
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
    let pending = match context.cell.take_pending(conn_id, &ticket, generation) {
        Ok(Some(pending)) => pending,
        Ok(None) => {
            context.close(&socket, CloseCode::BadOuterCredential, "unknown connection");
            return Served::Ended;
        }
        Err(_frozen) => {
            // A handover froze the attaches: carried with its first frame, acted on after.
            return Served::parked(Stage::FirstFrame {
                path: first.path,
                claims: None,
                reader: reader.record(),
                text: Some(text),
                deadline: first.deadline,
            });
        }
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
        relay_host_id: None,
    };
    if pending.attach.send(Attach::Leg(leg)).is_err() {
        // The phone's thread gave up; the hand-off (and the unit in it) was dropped.
        context.close(&socket, CloseCode::PeerDropped, "phone left");
        return Served::Ended;
    }
    Served::HandedOff
}
