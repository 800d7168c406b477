//! The relay thread of an admitted connection: a desktop's control from its hello on, a phone
//! until its pair is spliced. [`spawn_control`] and [`spawn_phone`] start one for a connection
//! the pending plane authenticated; [`resume`] starts one for a connection a handover deposited
//! (in this process after a failed handover, or in the next one, behind its gate). Every relay
//! thread runs its connection under [`serve_admitted`]: a panic costs that connection a 4429,
//! never the process; a handover's quiesce deposits it with everything it holds.
//!
//! Above `control.rs` and `phone.rs` (it dispatches a stage to them); below the pending plane
//! (`pending.rs`), which starts every relay thread through it.

use std::net::TcpStream;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::context::RelayContext;
use super::control;
use super::control_reader::{self, ControlFrames};
use super::hold::{ConnectionHold, PhonePlace};
use super::park::{Gate, Parked, ParkedConn, Served, Stage};
use super::phone::{self, AdmittedPhone};
use super::socket::Socket;
use super::upgrade::{self, Route};
use crate::auth::HostClaims;
use crate::carry::connection::{ClaimsRecord, ReaderRecord};
use crate::cell::state::SlotGuard;
use crate::protocol::CloseCode;
use crate::threads::Permit;

/// Starts the relay thread of an authenticated desktop control (its 101 is written): it reads
/// the hello, is admitted (SPEC §5.3) and serves the control until it closes (or a handover
/// parks it). The unit and the permit are released as the thread ends.
pub fn spawn_control(
    context: &RelayContext,
    id: u64,
    stream: TcpStream,
    tail: Vec<u8>,
    claims: HostClaims,
    unit: SlotGuard,
    permit: Permit,
) -> std::io::Result<()> {
    let context = context.clone();
    crate::threads::spawn_with_stack(
        format!("relay-{id}"),
        crate::threads::RELAY_STACK_BYTES,
        move || {
            let _permit = permit;
            let _ = stream.set_nonblocking(false);
            let _ = stream.set_write_timeout(Some(Duration::from_millis(context.timings.wedge_ms)));
            let socket = Socket::interruptible(id, stream, context.quiesce.interrupt());
            let hold = ConnectionHold::new(unit, context.metrics.connections("control"));
            let stage = Stage::FirstFrame {
                path: "/v1/host/control".into(),
                claims: Some(ClaimsRecord::from(&claims)),
                reader: ReaderRecord {
                    buffered: tail,
                    ..ReaderRecord::default()
                },
                text: None,
                deadline: clock_deadline(context.timings.first_frame_ms),
            };
            serve_stage(&context, socket, stage, Some(hold), None, None);
        },
    )
    .map(|_| ())
}

/// Starts the relay thread of an authenticated phone (`phone::authenticate`): it tells the
/// host, waits for the data leg and hands the pair to a splice worker. If no thread can be
/// started, the phone is closed and its host's pending entry dropped.
pub fn spawn_phone(context: &RelayContext, phone: AdmittedPhone) -> std::io::Result<()> {
    let id = phone.id;
    let conn_id = phone.conn_id.clone();
    let socket = phone.socket.clone();
    let thread_context = context.clone();
    let AdmittedPhone {
        hold,
        permit,
        admission,
        ..
    } = phone;
    let thread_socket = socket.clone();
    let spawned = crate::threads::spawn_with_stack(
        format!("relay-{id}"),
        crate::threads::RELAY_STACK_BYTES,
        move || {
            let _permit = permit;
            let context = thread_context;
            serve_admitted(
                &context,
                thread_socket,
                "phone",
                Some(hold),
                |socket, hold| phone::serve(&context, socket, admission, hold),
            );
        },
    );
    if spawned.is_err() {
        phone::abandon(context, &conn_id, socket);
    }
    spawned.map(|_| ())
}

/// Deposits a connection with the handover; one the handover no longer takes (it ended while
/// this thread was on its way) goes on, on a new thread.
fn deposit(context: &RelayContext, parked: Parked) {
    match context.quiesce.deposit(parked) {
        // Taken: this thread waits for the handover's end, then ends.
        None => context.quiesce.hold(&context.thread_permits),
        Some(parked) => {
            let id = parked.id;
            if let Err(e) = resume(context, parked, None, None) {
                log::error!("orca_relay_resume_failed conn={id} error={e}");
            }
        }
    }
}

fn clock_deadline(ms: u64) -> Instant {
    crate::clock::instant() + Duration::from_millis(ms)
}

/// An admitted connection from `stage` on: its first frame, a seated control's read loop, a
/// phone waiting for its data leg.
fn serve_stage(
    context: &RelayContext,
    socket: Arc<Socket>,
    stage: Stage,
    hold: Option<ConnectionHold>,
    place: Option<PhonePlace>,
    waiting: Option<phone::Waiting>,
) {
    let kind = stage_kind(&stage);
    serve_admitted(context, socket, kind, hold, |socket, hold| {
        // What a handover's quiesce left owed goes to the socket before anything else (a
        // socket that breaks doing it is shut down, and its reader sees the end).
        let _ = socket.flush_owed();
        run_stage(context, socket, stage, hold, place, waiting)
    });
}

/// Runs an admitted connection's relay-thread body under `catch_unwind`: a panic costs the
/// connection a 4429 and is logged; a handover's quiesce deposits it with everything it holds.
/// Unless the body handed the socket on (or parked it), the socket is closed before its unit
/// (in `hold`) is returned.
pub(crate) fn serve_admitted(
    context: &RelayContext,
    socket: Arc<Socket>,
    kind: &str,
    hold: Option<ConnectionHold>,
    body: impl FnOnce(Arc<Socket>, &mut Option<ConnectionHold>) -> Served,
) {
    let id = socket.id;
    let mut hold = hold;
    let outcome = std::panic::catch_unwind(AssertUnwindSafe(|| body(socket.clone(), &mut hold)));
    match outcome {
        Ok(Served::HandedOff) => return,
        Ok(Served::Parked { stage, place }) => {
            let parked = Parked {
                id,
                conn: ParkedConn::Socket(socket),
                stage: *stage,
                hold,
                place,
            };
            return deposit(context, parked);
        }
        Ok(Served::Ended) => {}
        Err(_) => {
            log::error!("orca_relay_connection_panicked conn={id} kind={kind}");
            context.close(&socket, CloseCode::LimitExceeded, "internal error");
        }
    }
    // Make sure the peer is gone before the unit is returned.
    if !socket.is_closing() {
        context.close(&socket, CloseCode::Normal, "");
    }
    drop(hold);
}

fn stage_kind(stage: &Stage) -> &'static str {
    match stage {
        Stage::Upgrading { .. } => "upgrading",
        Stage::FirstFrame { path, .. } => upgrade::route(path).map_or("unknown", |r| r.kind()),
        Stage::Control { .. } => "control",
        Stage::PhoneWaiting { .. } => "phone",
    }
}

fn run_stage(
    context: &RelayContext,
    socket: Arc<Socket>,
    stage: Stage,
    hold: &mut Option<ConnectionHold>,
    place: Option<PhonePlace>,
    waiting: Option<phone::Waiting>,
) -> Served {
    match stage {
        Stage::FirstFrame {
            path,
            claims,
            reader,
            text,
            deadline,
        } => match upgrade::route(&path) {
            Some(Route::Control) => {
                let Some(claims) = claims else {
                    context.close(&socket, CloseCode::LimitExceeded, "internal error");
                    return Served::Ended;
                };
                let reader = control_reader::Reader::new(
                    socket.clone(),
                    ControlFrames::from_record(reader),
                    context.quiesce.clone(),
                    context.silence_guard(),
                );
                control::serve(
                    context,
                    socket,
                    reader,
                    (&claims).into(),
                    control::First {
                        path,
                        text,
                        deadline,
                    },
                )
            }
            // A splice leg's first frame is read by the acceptor's pending loop, never here.
            Some(Route::Phone { .. } | Route::DataLeg { .. }) | None => {
                context.close(&socket, CloseCode::LimitExceeded, "internal error");
                Served::Ended
            }
        },
        Stage::Control {
            control,
            reader,
            silence_deadline,
            invites,
        } => {
            let reader = control_reader::Reader::resume(
                socket.clone(),
                reader,
                context.quiesce.clone(),
                silence_deadline,
                Duration::from_millis(context.timings.silence_ms),
                context.silence_guard(),
            );
            control::resume(context, socket, reader, control, invites)
        }
        Stage::PhoneWaiting {
            phone,
            reader,
            attach_deadline,
        } => {
            let waiting =
                waiting.unwrap_or_else(|| phone::restore_waiting(context, &socket, &phone));
            phone::resume_waiting(
                context,
                socket,
                reader,
                hold,
                place,
                (phone, waiting),
                attach_deadline,
            )
        }
        Stage::Upgrading { .. } => {
            context.close(&socket, CloseCode::LimitExceeded, "internal error");
            Served::Ended
        }
    }
}

/// Resumes a deposited connection on a new relay thread: in this process after a failed
/// handover, or in the next one (which holds each thread at `gate` until the handover has
/// committed; while there is one, the thread is one of `spares`, started before anything
/// paused and released at the commit).
/// A resumed connection always gets its thread: the permit is taken even past the bound, since
/// the connection exists already. `Err` when no thread could be started.
pub fn resume(
    context: &RelayContext,
    parked: Parked,
    gate: Option<Arc<Gate>>,
    spares: Option<&crate::threads::Spares>,
) -> std::io::Result<()> {
    let permit = context.thread_permits.take_forced();
    let thread_context = context.clone();
    let id = parked.id;
    let socket_fd = parked.conn.raw_fd();
    // A waiting phone's pending entry is put back now, before any other resumed connection
    // runs: a data leg resumed beside it must find the entry with a live channel.
    let waiting = match (&parked.conn, &parked.stage) {
        (ParkedConn::Socket(socket), Stage::PhoneWaiting { phone, .. }) => {
            Some(phone::restore_waiting(context, socket, phone))
        }
        _ => None,
    };
    let body = move || {
        {
            let _permit = permit;
            if let Some(gate) = gate {
                if !gate.wait() {
                    // The handover did not commit: this process touches nothing and exits.
                    return;
                }
            }
            let Parked {
                id,
                conn,
                stage,
                hold,
                place,
            } = parked;
            match conn {
                ParkedConn::Socket(socket) => {
                    serve_stage(&thread_context, socket, stage, hold, place, waiting)
                }
                // A pending connection belongs to the acceptor's loop (`pending::run`).
                ParkedConn::Pending(stream) => {
                    log::error!("orca_relay_resume_misrouted conn={id}");
                    drop(stream);
                }
            }
        }
    };
    let name = format!("relay-{id}");
    let job: crate::threads::Job = match spares {
        Some(spares) => match spares.queue(name.clone(), Box::new(body), socket_fd) {
            Ok(()) => return Ok(()),
            Err(job) => job,
        },
        None => Box::new(body),
    };
    crate::threads::spawn_with_stack(name, crate::threads::RELAY_STACK_BYTES, job).map(|_| ())
}
