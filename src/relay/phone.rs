//! The phone leg `GET /v1/connect/<relayHostId>` (SPEC §5.2).
//!
//! Its credential is its first frame, `relay-auth` with an invite, read by the acceptor's
//! pending loop; [`authenticate`] checks it there (the host online, the invite live, fewer than
//! 8 phones: all in memory, under the cell's lock) and only then does the phone take a unit of
//! the connection cap, a relay-thread permit and one of the host's phone places. Its relay
//! thread ([`serve`]) tells the host (`conn-open`), waits up to the attach deadline for the
//! host's data leg (which `data.rs` passes through the pending entry's channel), sends the
//! phone `relay-hello`, hands the pair to a splice worker (`relay/splice/`) and ends: the
//! phone's place and both connection units travel with the pair and are released when its legs
//! end.

use std::sync::mpsc::{sync_channel, Receiver};
use std::sync::Arc;
use std::time::Duration;

use tungstenite::Message;

use super::pending::{close_pending, close_pending_socket, PendingLeg};
use super::socket::Socket;
use super::splice::{LegHandOff, Pair, Release};
use super::{run_guarded, ConnectionHold, RelayContext, Served};
use crate::cell::state::{random_token, CellState, Control, PhoneRefusal};
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

/// An authenticated phone, as its relay thread takes it over.
struct Admitted {
    conn_id: String,
    control: Control<Socket>,
    ticket: String,
    attach: Receiver<LegHandOff>,
    /// What the first-frame reader read past `relay-auth`, and its parser.
    buffered: Vec<u8>,
    parser: super::frames::FrameParser,
    place: PhonePlace,
}

/// Checks a phone's first frame on the acceptor's thread and, if it authenticates, starts its
/// relay thread. `None` when it was refused (closed with its code); otherwise the spawn's
/// result.
pub(super) fn authenticate(
    context: &RelayContext,
    leg: PendingLeg,
    relay_host_id: &str,
    text: &str,
) -> Option<std::io::Result<()>> {
    let PendingLeg { id, stream, reader } = leg;
    let credential = match serde_json::from_str::<PhoneFirst>(text) {
        Ok(PhoneFirst::RelayAuth { v: 1, credential }) => credential,
        _ => {
            close_pending(
                context,
                stream,
                CloseCode::BadOuterCredential,
                "bad relay-auth",
            );
            return None;
        }
    };
    // The cap unit and the thread permit are taken just before the invite is checked (in
    // memory, on this loop; both go back at once on a refusal), so that once `admit_phone` has
    // registered the phone with its host nothing can refuse it any more. At a full cap a phone
    // is therefore refused 4429 before its invite is looked at.
    let Some(unit) = context.slots.try_take() else {
        close_pending(context, stream, CloseCode::LimitExceeded, "connection cap");
        return None;
    };
    let Some(permit) = context.thread_permits.try_take() else {
        close_pending(context, stream, CloseCode::LimitExceeded, "no thread");
        return None;
    };
    let Ok(ticket) = random_token() else {
        close_pending(context, stream, CloseCode::LimitExceeded, "try again");
        return None;
    };
    let socket = Socket::new_splice(id, stream);
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
            close_pending_socket(context, socket, code, "phone refused");
            return None;
        }
    };
    // From here on this phone holds one of the host's phone places.
    let place = PhonePlace {
        cell: context.cell.clone(),
        relay_host_id: relay_host_id.to_string(),
    };
    let hold = ConnectionHold::new(unit, context.metrics.connections("phone"));
    let (buffered, parser) = reader.into_parts();
    let admitted = Admitted {
        conn_id: conn_id.clone(),
        control,
        ticket,
        attach: attach_rx,
        buffered,
        parser,
        place,
    };
    let thread_context = context.clone();
    let thread_socket = socket.clone();
    let spawned = crate::threads::spawn_with_stack(
        format!("relay-{id}"),
        crate::threads::RELAY_STACK_BYTES,
        move || {
            let _permit = permit;
            let context = thread_context;
            let socket = thread_socket;
            run_guarded(&context, &socket.clone(), "phone", Some(hold), |hold| {
                serve(&context, socket, admitted, hold)
            });
        },
    );
    if spawned.is_err() {
        // The closure (place, unit, permit) is gone; the host's pending entry goes too.
        context.cell.abandon_pending(&conn_id);
        close_pending_socket(context, socket, CloseCode::LimitExceeded, "try again");
    }
    Some(spawned.map(|_| ()))
}

/// The phone's relay thread: `conn-open` to the host, the wait for its data leg, `relay-hello`,
/// the hand-off to a splice worker.
fn serve(
    context: &RelayContext,
    socket: Arc<Socket>,
    admitted: Admitted,
    hold: &mut Option<ConnectionHold>,
) -> Served {
    let Admitted {
        conn_id,
        control,
        ticket,
        attach,
        buffered,
        parser,
        place,
    } = admitted;
    // The pending loop read it without blocking; this thread writes with the wedge window.
    let _ = socket.stream().set_nonblocking(false);
    let _ = socket
        .stream()
        .set_write_timeout(Some(Duration::from_millis(context.timings.wedge_ms)));
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
    let host = match attach.recv_timeout(Duration::from_millis(attach_deadline_ms)) {
        Ok(host) => host,
        Err(_) => {
            if context.cell.abandon_pending(&conn_id) {
                context.close(&socket, CloseCode::HostOffline, "host did not attach");
                return Served::Ended;
            }
            // A data leg took the entry as the deadline passed; its hand-off is on its way.
            match attach.recv_timeout(Duration::from_secs(1)) {
                Ok(host) => host,
                Err(_) => {
                    context.close(&socket, CloseCode::HostOffline, "host did not attach");
                    return Served::Ended;
                }
            }
        }
    };
    // The phone hears relay-hello before any spliced frame: it is sent before the hand-off.
    if socket
        .send(Message::text(protocol::relay_hello_json()))
        .is_err()
    {
        context.close(&host.socket, CloseCode::PeerDropped, "phone left");
        return Served::Ended;
    }
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
    let host_id = control.relay_host_id.clone();
    let pair = Pair {
        phone,
        host,
        relay_host_id: control.relay_host_id.as_str().into(),
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
