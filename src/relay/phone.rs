//! The phone leg `GET /v1/connect/<relayHostId>` (SPEC §5.2), on its relay thread until the
//! pair is spliced.
//!
//! The phone authenticates with an invite; the cell tells the host (`conn-open`) and waits up
//! to the attach deadline for the host's data leg, which announces itself through the pending
//! entry's channel with its socket and what its reader had read. Then this thread hands the
//! pair to a splice worker (`relay/splice/`) and ends: the phone's place and both connection
//! units travel with the pair and are released when its legs end.

use std::sync::mpsc::sync_channel;
use std::sync::Arc;
use std::time::Duration;

use tungstenite::Message;

use super::socket::Socket;
use super::splice::{LegHandOff, Pair, Release};
use super::splice_reader::SpliceReader;
use super::{read_first_splice_text, ConnectionHold, RelayContext, Served};
use crate::cell::state::{random_token, CellState, PhoneRefusal};
use crate::protocol::{self, CloseCode, PhoneFirst, RelayToHost};

/// One of the host's phone places (at most 8, SPEC §5.2), returned when dropped.
struct PhonePlace {
    cell: Arc<CellState<Socket>>,
    relay_host_id: String,
}

impl Drop for PhonePlace {
    fn drop(&mut self) {
        self.cell.release_phone(&self.relay_host_id);
    }
}

pub fn serve(
    context: &RelayContext,
    socket: Arc<Socket>,
    mut reader: SpliceReader,
    relay_host_id: &str,
    hold: &mut Option<ConnectionHold>,
) -> Served {
    let text = match read_first_splice_text(context, &mut reader) {
        Ok(text) => text,
        Err(code) => {
            context.close(&socket, code, "first frame");
            return Served::Ended;
        }
    };
    let credential = match serde_json::from_str::<PhoneFirst>(&text) {
        Ok(PhoneFirst::RelayAuth { v: 1, credential }) => credential,
        _ => {
            context.close(&socket, CloseCode::BadOuterCredential, "bad relay-auth");
            return Served::Ended;
        }
    };
    let ticket = random_token();
    let (attach_tx, attach_rx) = sync_channel::<LegHandOff>(1);
    let admitted = context.cell.admit_phone(
        relay_host_id,
        &credential,
        socket.clone(),
        ticket.clone(),
        attach_tx,
    );
    let (conn_id, control) = match admitted {
        Ok(admitted) => admitted,
        Err(refusal) => {
            let code = match refusal {
                PhoneRefusal::HostOffline => CloseCode::HostOffline,
                PhoneRefusal::BadCredential => CloseCode::BadOuterCredential,
                PhoneRefusal::TooManyPhones => CloseCode::LimitExceeded,
            };
            context.close(&socket, code, "phone refused");
            return Served::Ended;
        }
    };
    // From here on this phone holds one of the host's phone places.
    let place = PhonePlace {
        cell: context.cell.clone(),
        relay_host_id: relay_host_id.to_string(),
    };

    let attach_deadline_ms = context.timings.attach_deadline_ms;
    let open = RelayToHost::ConnOpen {
        conn_id: conn_id.clone(),
        conn_ticket: ticket,
        attach_deadline_ms,
    };
    if control
        .socket
        .send(Message::text(protocol::to_json(&open)))
        .is_err()
    {
        context.cell.abandon_pending(&conn_id);
        context.close(&socket, CloseCode::HostOffline, "host unavailable");
        return Served::Ended;
    }
    let host = match attach_rx.recv_timeout(Duration::from_millis(attach_deadline_ms)) {
        Ok(host) => host,
        Err(_) => {
            if context.cell.abandon_pending(&conn_id) {
                context.close(&socket, CloseCode::HostOffline, "host did not attach");
                return Served::Ended;
            }
            // A data leg took the entry as the deadline passed; its hand-off is on its way.
            match attach_rx.recv_timeout(Duration::from_secs(1)) {
                Ok(host) => host,
                Err(_) => {
                    context.close(&socket, CloseCode::HostOffline, "host did not attach");
                    return Served::Ended;
                }
            }
        }
    };
    let (buffered, parser) = reader.into_parts();
    let mut release: Vec<Release> = vec![Box::new(place)];
    if let Some(hold) = hold.take() {
        release.push(Box::new(hold));
    }
    let phone = LegHandOff {
        socket: socket.clone(),
        buffered,
        parser,
        release,
    };
    let cell = context.cell.clone();
    let host_id = relay_host_id.to_string();
    let pair = Pair {
        phone,
        host,
        relay_host_id: relay_host_id.into(),
        host_present: Box::new(move || cell.control(&host_id).is_some()),
    };
    match context.splice.hand_off(pair) {
        Ok(()) => Served::HandedOff,
        Err(pair) => {
            // No worker can take it (the cell is stopping): a transient failure, retry.
            log::warn!("orca_relay_splice_hand_off_failed conn={}", socket.id);
            context.metrics.splice_refused("no_worker");
            context.close(
                &pair.phone.socket,
                CloseCode::LimitExceeded,
                "internal error",
            );
            context.close(
                &pair.host.socket,
                CloseCode::LimitExceeded,
                "internal error",
            );
            Served::Ended
        }
    }
}
