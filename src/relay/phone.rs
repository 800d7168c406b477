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
//!
//! A live handover wakes a waiting phone through the same channel ([`Attach::Wake`]): with the
//! cell's attaches frozen, no data leg can take its pending entry any more, so the phone is
//! deposited as waiting (its entry, place, what its reader holds and its deadline carried)
//! unless a data leg took the entry just before the freeze, in which case its leg is already on
//! the way and the attach goes ahead.

use std::sync::mpsc::{sync_channel, Receiver, RecvTimeoutError, TryRecvError};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tungstenite::Message;

use super::park::Stage;
use super::pending::{close_pending, close_pending_socket, PendingLeg};
use super::socket::Socket;
use super::splice::{LegHandOff, Pair, Release};
use super::{ConnectionHold, RelayContext, Served};
use crate::carry::connection::{ReaderRecord, WaitingPhoneRecord};
use crate::cell::state::{random_token, CellState, Control, Pending, PhoneRefusal};
use crate::protocol::{self, CloseCode, PhoneFirst, RelayToHost};

/// What a waiting phone hears on its pending entry's channel.
pub enum Attach {
    /// Its host's data leg, ready to be spliced.
    Leg(LegHandOff),
    /// A handover is quiescing the cell.
    Wake,
}

/// Room for a wake and a leg at once: a data leg's send never waits behind a wake.
const ATTACH_CHANNEL: usize = 2;

/// One of the host's phone places (at most 8, SPEC §5.2), returned when dropped.
pub struct PhonePlace {
    cell: Arc<CellState<Socket>>,
    relay_host_id: String,
}

impl PhonePlace {
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

/// An authenticated phone, as its relay thread takes it over.
struct Admitted {
    conn_id: String,
    control: Control<Socket>,
    ticket: String,
    attach: Receiver<Attach>,
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
    let (attach_tx, attach_rx) = sync_channel::<Attach>(ATTACH_CHANNEL);
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
                // Attaches freeze only while the acceptor is parked: not met here.
                PhoneRefusal::TooManyPhones | PhoneRefusal::Frozen => CloseCode::LimitExceeded,
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
            super::serve_admitted(&context, socket, "phone", Some(hold), |socket, hold| {
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

/// The phone's relay thread: `conn-open` to the host, the wait for its data leg (or a
/// handover's quiesce), `relay-hello`, the hand-off to a splice worker.
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
        conn_ticket: ticket.clone(),
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
    let waiting = WaitingPhoneRecord {
        relay_host_id: control.relay_host_id.clone(),
        conn_id,
        ticket,
        generation: control.generation,
    };
    let reader = ReaderRecord {
        buffered,
        parser: parser.state(),
        message: None,
    };
    let deadline = crate::clock::instant() + Duration::from_millis(attach_deadline_ms);
    wait_for_leg(
        context, socket, reader, hold, place, waiting, attach, deadline,
    )
}

/// A waiting phone's channel, its pending entry put back ([`restore_waiting`]).
pub struct Waiting(Receiver<Attach>);

/// Puts a waiting phone's pending entry back in the cell with a new channel (a phone resumed
/// after a handover). Done before the phone's thread starts, so that a data leg resumed beside
/// it finds the entry.
pub fn restore_waiting(
    context: &RelayContext,
    socket: &Arc<Socket>,
    waiting: &WaitingPhoneRecord,
) -> Waiting {
    let (attach_tx, attach_rx) = sync_channel::<Attach>(ATTACH_CHANNEL);
    context.cell.restore_pending(
        &waiting.conn_id,
        Pending {
            relay_host_id: waiting.relay_host_id.clone(),
            ticket: waiting.ticket.clone(),
            generation: waiting.generation,
            phone: socket.clone(),
            attach: attach_tx,
        },
    );
    Waiting(attach_rx)
}

/// A waiting phone resumed after a handover: it waits for the rest of its attach deadline.
pub fn resume_waiting(
    context: &RelayContext,
    socket: Arc<Socket>,
    reader: ReaderRecord,
    hold: &mut Option<ConnectionHold>,
    place: Option<PhonePlace>,
    (waiting, channel): (WaitingPhoneRecord, Waiting),
    deadline: Instant,
) -> Served {
    let place = place.unwrap_or_else(|| PhonePlace::carried(&context.cell, &waiting.relay_host_id));
    wait_for_leg(
        context, socket, reader, hold, place, waiting, channel.0, deadline,
    )
}

/// Waits for the host's data leg by `deadline`, then `relay-hello` and the hand-off; or parks
/// at a handover's quiesce. `reader` holds what the phone sent past its `relay-auth`.
#[allow(clippy::too_many_arguments)]
fn wait_for_leg(
    context: &RelayContext,
    socket: Arc<Socket>,
    reader: ReaderRecord,
    hold: &mut Option<ConnectionHold>,
    place: PhonePlace,
    waiting: WaitingPhoneRecord,
    attach_rx: Receiver<Attach>,
    deadline: Instant,
) -> Served {
    let conn_id = waiting.conn_id.clone();
    let host = loop {
        let left = deadline.saturating_duration_since(crate::clock::instant());
        match attach_rx.recv_timeout(left) {
            Ok(Attach::Leg(host)) => break host,
            Ok(Attach::Wake) => {
                if !context.quiesce.is_quiescing() {
                    continue;
                }
                if let Ok(Attach::Leg(host)) = attach_rx.try_recv() {
                    break host;
                }
                if context.cell.pending_present(&conn_id) {
                    return Served::Parked {
                        stage: Box::new(Stage::PhoneWaiting {
                            phone: waiting,
                            reader,
                            attach_deadline: deadline,
                        }),
                        place: Some(place),
                    };
                }
                // A data leg took the entry just before the freeze: its leg is on its way.
                match attach_rx.recv_timeout(Duration::from_secs(1)) {
                    Ok(Attach::Leg(host)) => break host,
                    _ => {
                        context.close(&socket, CloseCode::HostOffline, "host did not attach");
                        return Served::Ended;
                    }
                }
            }
            Err(RecvTimeoutError::Timeout) | Err(RecvTimeoutError::Disconnected) => {
                if context.cell.abandon_pending(&conn_id) {
                    context.close(&socket, CloseCode::HostOffline, "host did not attach");
                    return Served::Ended;
                }
                // A data leg took the entry as the deadline passed; its hand-off is on its way.
                match receive_leg(&attach_rx, Duration::from_secs(1)) {
                    Some(host) => break host,
                    None => {
                        context.close(&socket, CloseCode::HostOffline, "host did not attach");
                        return Served::Ended;
                    }
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
        buffered: reader.buffered,
        parser: super::frames::FrameParser::with_state(
            crate::protocol::SPLICE_MAX_FRAME_BYTES,
            reader.parser,
        ),
        release,
    };
    let cell = context.cell.clone();
    let host_id = waiting.relay_host_id.clone();
    let pair = Pair {
        phone,
        host,
        relay_host_id: waiting.relay_host_id.as_str().into(),
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

/// The next leg on the channel within `wait` (wakes skipped).
fn receive_leg(attach_rx: &Receiver<Attach>, wait: Duration) -> Option<LegHandOff> {
    let deadline = crate::clock::instant() + wait;
    loop {
        match attach_rx.try_recv() {
            Ok(Attach::Leg(host)) => return Some(host),
            Ok(Attach::Wake) => continue,
            Err(TryRecvError::Disconnected) => return None,
            Err(TryRecvError::Empty) => {}
        }
        let left = deadline.saturating_duration_since(crate::clock::instant());
        match attach_rx.recv_timeout(left) {
            Ok(Attach::Leg(host)) => return Some(host),
            Ok(Attach::Wake) => continue,
            Err(_) => return None,
        }
    }
}
