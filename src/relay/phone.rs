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

use super::attach::{Attach, ATTACH_CHANNEL};
use super::context::RelayContext;
use super::frames::CloseAnswer;
use super::frames::FrameParser;
use super::hold::{ConnectionHold, PhonePlace};
use super::park::{Served, Stage};
use super::refuse::{close_pending, close_pending_socket};
use super::socket::{Socket, CLOSE_LINGER};
use super::splice::{LegHandOff, Pair, Release};
use super::splice_reader::PendingLeg;
use crate::carry::connection::{ReaderRecord, WaitingPhoneRecord};
use crate::carry::crash::CrashKind;
use crate::cell::state::{random_token, Control, Pending, PhoneRefusal};
use crate::protocol::{self, CloseCode, PhoneFirst, RelayToHost};
use crate::threads::Permit;

/// An authenticated phone, as its relay thread takes it over: everything it holds (its unit,
/// its thread permit, its host's phone place, its pending entry in the cell).
pub struct AdmittedPhone {
    pub id: u64,
    pub socket: Arc<Socket>,
    pub conn_id: String,
    pub hold: ConnectionHold,
    pub permit: Permit,
    /// What its relay thread serves it with ([`serve`]).
    pub admission: Admission,
}

/// An admitted phone's part of the cell: its host's control, its ticket, the channel its data
/// leg comes on, what the first-frame reader read past `relay-auth` (and its parser), its
/// phone place.
pub struct Admission {
    conn_id: String,
    control: Control<Socket>,
    ticket: String,
    attach: Receiver<Attach>,
    buffered: Vec<u8>,
    parser: FrameParser,
    place: PhonePlace,
}

/// Checks a phone's first frame on the acceptor's thread. `Some` when it authenticates (its
/// relay thread is started by the caller: `thread::spawn_phone`); `None` when it was refused
/// (closed with its code).
pub fn authenticate(
    context: &RelayContext,
    leg: PendingLeg,
    relay_host_id: &str,
    text: &str,
) -> Option<AdmittedPhone> {
    let PendingLeg { id, stream, reader } = leg;
    let credential = match serde_json::from_str::<PhoneFirst>(text) {
        Ok(PhoneFirst::RelayAuth { v: 1, credential }) => credential,
        _ => {
            close_pending(
                context,
                stream,
                reader.close_answer(),
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
        close_pending(
            context,
            stream,
            reader.close_answer(),
            CloseCode::LimitExceeded,
            "connection cap",
        );
        return None;
    };
    let Some(permit) = context.thread_permits.try_take() else {
        close_pending(
            context,
            stream,
            reader.close_answer(),
            CloseCode::LimitExceeded,
            "no thread",
        );
        return None;
    };
    let Ok(ticket) = random_token() else {
        close_pending(
            context,
            stream,
            reader.close_answer(),
            CloseCode::LimitExceeded,
            "try again",
        );
        return None;
    };
    // Its relay thread writes it (relay-hello) until the pair is spliced: a quiesce
    // interrupts a write to a phone that does not read (the rest is owed, and the splice
    // worker writes it first).
    let socket = Socket::interruptible(id, stream, context.quiesce.interrupt());
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
            close_pending_socket(
                context,
                socket,
                reader.close_answer(),
                code,
                "phone refused",
            );
            return None;
        }
    };
    // From here on this phone holds one of the host's phone places.
    let place = PhonePlace::taken(&context.cell, relay_host_id);
    let hold = ConnectionHold::new(unit, context.metrics.connections("phone"));
    // Kept from now on, holding (not resumable) until a splice worker has the pair.
    context.keep(&socket, CrashKind::Phone, None, Some(relay_host_id), true);
    let (buffered, parser) = reader.into_parts();
    Some(AdmittedPhone {
        id,
        socket,
        conn_id: conn_id.clone(),
        hold,
        permit,
        admission: Admission {
            conn_id,
            control,
            ticket,
            attach: attach_rx,
            buffered,
            parser,
            place,
        },
    })
}

/// A phone whose relay thread could not be started: its host's pending entry goes, and the
/// phone is closed (its place, unit and permit went with the thread's closure).
pub fn abandon(context: &RelayContext, conn_id: &str, socket: Arc<Socket>) {
    context.cell.abandon_pending(conn_id);
    // What the phone sent past its first frame went with the thread's closure: its answer
    // to the close is not looked for (its end of stream or the linger ends it).
    close_pending_socket(
        context,
        socket,
        CloseAnswer::unsynced(),
        CloseCode::LimitExceeded,
        "try again",
    );
}

/// The phone's relay thread: `conn-open` to the host, the wait for its data leg (or a
/// handover's quiesce), `relay-hello`, the hand-off to a splice worker.
pub fn serve(
    context: &RelayContext,
    socket: Arc<Socket>,
    admission: Admission,
    hold: &mut Option<ConnectionHold>,
) -> Served {
    let Admission {
        conn_id,
        control,
        ticket,
        attach,
        buffered,
        parser,
        place,
    } = admission;
    // The pending loop read it without blocking; this thread writes with the wedge window.
    let _ = socket.stream().set_nonblocking(false);
    socket.set_send_timeout(Duration::from_millis(context.timings.wedge_ms));
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
        close_phone(
            context,
            &socket,
            &buffered,
            CloseCode::HostOffline,
            "host unavailable",
        );
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
                        close_phone(
                            context,
                            &socket,
                            &reader.buffered,
                            DID_NOT_ATTACH.0,
                            DID_NOT_ATTACH.1,
                        );
                        return Served::Ended;
                    }
                }
            }
            Err(RecvTimeoutError::Timeout) | Err(RecvTimeoutError::Disconnected) => {
                if context.cell.abandon_pending(&conn_id) {
                    close_phone(
                        context,
                        &socket,
                        &reader.buffered,
                        DID_NOT_ATTACH.0,
                        DID_NOT_ATTACH.1,
                    );
                    return Served::Ended;
                }
                // A data leg took the entry as the deadline passed; its hand-off is on its way.
                match receive_leg(&attach_rx, Duration::from_secs(1)) {
                    Some(host) => break host,
                    None => {
                        close_phone(
                            context,
                            &socket,
                            &reader.buffered,
                            DID_NOT_ATTACH.0,
                            DID_NOT_ATTACH.1,
                        );
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
        close_phone(
            context,
            &host.socket,
            &host.buffered,
            CloseCode::PeerDropped,
            "phone left",
        );
        return Served::Ended;
    }
    let mut release: Vec<Release> = vec![Box::new(place)];
    if let Some(hold) = hold.take() {
        release.push(Box::new(hold));
    }
    let phone = LegHandOff {
        socket: socket.clone(),
        buffered: reader.buffered,
        parser: FrameParser::with_state(crate::protocol::SPLICE_MAX_FRAME_BYTES, reader.parser),
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

/// The close of a phone whose data leg did not come in time.
const DID_NOT_ATTACH: (CloseCode, &str) = (CloseCode::HostOffline, "host did not attach");

/// Closes a leg from the phone's thread, which reads it no more: the reaper reads it for the
/// client's answer and drops the connection then (`unread`: the bytes read past its last whole
/// frame).
fn close_phone(
    context: &RelayContext,
    socket: &Arc<Socket>,
    unread: &[u8],
    code: CloseCode,
    reason: &str,
) {
    context.close(socket, code, reason);
    context
        .reaper
        .watch(socket.clone(), CloseAnswer::after(unread), CLOSE_LINGER);
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
