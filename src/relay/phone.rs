//! The phone leg `GET /v1/connect/<relayHostId>` (SPEC §5.2), on its relay thread.
//!
//! The phone authenticates with an invite; the cell tells the host (`conn-open`) and waits up
//! to the attach deadline for the host's data leg, which announces itself through the pending
//! entry's channel. Then this thread pumps phone → host until either side leaves.

use std::sync::mpsc::sync_channel;
use std::sync::Arc;
use std::time::Duration;

use tungstenite::Message;

use super::data::pump;
use super::socket::Socket;
use super::splice_reader::SpliceReader;
use super::{read_first_splice_text, RelayContext};
use crate::cell::state::{random_token, PhoneRefusal};
use crate::protocol::{self, CloseCode, PhoneFirst, RelayToHost};

pub fn serve(
    context: &RelayContext,
    socket: Arc<Socket>,
    mut reader: SpliceReader,
    relay_host_id: &str,
) {
    let text = match read_first_splice_text(context, &mut reader) {
        Ok(text) => text,
        Err(code) => return context.close(&socket, code, "first frame"),
    };
    let credential = match serde_json::from_str::<PhoneFirst>(&text) {
        Ok(PhoneFirst::RelayAuth { v: 1, credential }) => credential,
        _ => return context.close(&socket, CloseCode::BadOuterCredential, "bad relay-auth"),
    };
    let ticket = random_token();
    let (attach_tx, attach_rx) = sync_channel::<Arc<Socket>>(1);
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
            return context.close(&socket, code, "phone refused");
        }
    };
    // From here on this phone holds one of the host's phone places.
    struct PhonePlace<'a>(&'a RelayContext, &'a str);
    impl Drop for PhonePlace<'_> {
        fn drop(&mut self) {
            self.0.cell.release_phone(self.1);
        }
    }
    let _place = PhonePlace(context, relay_host_id);

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
        return context.close(&socket, CloseCode::HostOffline, "host unavailable");
    }
    let data_leg = match attach_rx.recv_timeout(Duration::from_millis(attach_deadline_ms)) {
        Ok(data_leg) => data_leg,
        Err(_) => {
            if context.cell.abandon_pending(&conn_id) {
                return context.close(&socket, CloseCode::HostOffline, "host did not attach");
            }
            // A data leg took the entry as the deadline passed; its hand-off is on its way.
            match attach_rx.recv_timeout(Duration::from_secs(1)) {
                Ok(data_leg) => data_leg,
                Err(_) => {
                    return context.close(&socket, CloseCode::HostOffline, "host did not attach")
                }
            }
        }
    };
    pump(
        context,
        &mut reader,
        &socket,
        &data_leg,
        super::data::Direction::PhoneToHost,
    );
}
