//! The desktop control socket `GET /v1/host/control` (SPEC §5.2), on its relay thread, and
//! the two cell-wide threads that serve every control: the `pinger` and the `lease-renewer`.
//!
//! The control thread only reads its own socket. The pinger writes pings through each
//! control's writer with `try_send`, so a wedged desktop never delays the others. The lease
//! renewer renews database-admitted controls' activity leases and closes a control 4503 when
//! its placement has moved.

use std::sync::mpsc::Receiver;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tungstenite::Message;

use super::context::RelayContext;
use super::control_reader::{Deadline, ReadEvent, Reader};
use super::park::Served;
use super::park::{InviteBucket, Stage};
use super::socket::Socket;
use crate::auth::HostClaims;
use crate::carry::connection::{ClaimsRecord, ControlRecord};
use crate::carry::crash::CrashKind;
use crate::cell::admission::{self, DbVerdict, LeaseRequest};
use crate::cell::seats::{ChangeKind, SeatChange};
use crate::cell::state::{random_token, AdmitPath, Control};
use crate::liveness::{wait_beating, Beat};
use crate::logging::FailureThrottle;
use crate::protocol::{
    self, CloseCode, HostToRelay, RelayToHost, INVITE_CREATE_BURST, INVITE_CREATE_REFILL_MS,
    INVITE_MAX_ATTEMPTS,
};
use crate::store::LeaseOutcome;

/// The reason of a control's 4408 for silence (docs/PROTOCOL.md §3).
const SILENT_REASON: &str = "silent: nothing heard (answer pings)";

/// Where a control's first frame stands: not read yet (`text: None`, by `deadline`), or read
/// and not yet acted on (a handover carried it).
pub struct First {
    pub path: String,
    pub text: Option<String>,
    pub deadline: Instant,
}

/// Serves one control socket from its first frame until it closes (or a handover parks it).
pub fn serve(
    context: &RelayContext,
    socket: Arc<Socket>,
    mut reader: Reader,
    claims: HostClaims,
    first: First,
) -> Served {
    let text = match first.text {
        Some(text) => text,
        None => match read_first_text(&mut reader, first.deadline) {
            FirstText::Text(text) => text,
            FirstText::Refused(code) => {
                match code {
                    CloseCode::TooBig => {
                        context.close(&socket, code, "message_too_large");
                        reader.drain_after_close();
                    }
                    CloseCode::ProtocolError => context.close(&socket, code, "protocol error"),
                    _ => {
                        context.close(&socket, code, "first frame");
                        reader.await_close_answer();
                    }
                }
                return Served::Ended;
            }
            FirstText::Quiesce => {
                return Served::parked(Stage::FirstFrame {
                    path: first.path,
                    claims: Some(ClaimsRecord::from(&claims)),
                    reader: reader.record(),
                    text: None,
                    deadline: first.deadline,
                })
            }
        },
    };
    let epoch = match serde_json::from_str::<HostToRelay>(&text) {
        Ok(HostToRelay::HostHello {
            v: 1,
            relay_host_id,
            assignment_epoch,
        }) if relay_host_id == claims.relay_host_id && assignment_epoch >= 0 => assignment_epoch,
        _ => {
            context.close(&socket, CloseCode::BadOuterCredential, "bad hello");
            reader.await_close_answer();
            return Served::Ended;
        }
    };

    let now = context.clock.now_ms();
    let statements_before = crate::store::thread_statements();
    let lease_id = lease_id_of(context, &socket);
    // Reserve mode: a booking, then memory, without the database (SPEC §5.3).
    let reserve_path = if context.mode.raw_is_reserve() {
        if context
            .bookings
            .consume(&claims.user_id, &claims.relay_host_id, epoch, now)
        {
            Some(AdmitPath::Booking)
        } else if context.cell.seated_here_at(
            &claims.user_id,
            &claims.relay_host_id,
            epoch,
            context.timings.seat_memory_ms,
        ) {
            Some(AdmitPath::Memory)
        } else {
            None
        }
    } else {
        None
    };
    let admitted_via = match reserve_path {
        Some(path) => path,
        None => {
            let request = LeaseRequest {
                activity_id: &lease_id,
                user_id: &claims.user_id,
                relay_host_id: &claims.relay_host_id,
                cell_id: &context.cell_id,
                epoch,
                now_ms: now as i64,
                ttl_ms: context.timings.lease_ttl_ms as i64,
            };
            let verdict = admission::check_database(&context.store, &request);
            if verdict.is_ok() {
                if let Some(note) = context.admission_failures.success() {
                    log::info!("orca_relay_admission_recovered{note}");
                }
            }
            match verdict {
                Ok(DbVerdict::Admitted) => AdmitPath::Database,
                Ok(DbVerdict::WrongCell) => {
                    context.metrics.admission("database", "wrong_cell");
                    context.cell.demote(&claims.relay_host_id);
                    context.close(&socket, CloseCode::WrongCell, "wrong cell");
                    reader.await_close_answer();
                    return Served::Ended;
                }
                Err(e) => {
                    context.metrics.admission("database", "error");
                    // Every relay thread shares one throttle: a database outage under a
                    // reconnect storm is one line, then one a minute with a count.
                    if let Some(note) = context.admission_failures.failure(now) {
                        log::warn!(
                            "orca_relay_admission_failed host={} {}{note}",
                            claims.relay_host_id,
                            e.log_fields()
                        );
                    }
                    context.close(&socket, CloseCode::LimitExceeded, "try again");
                    reader.await_close_answer();
                    return Served::Ended;
                }
            }
        }
    };
    context.metrics.admission(admitted_via.as_str(), "admitted");
    context.metrics.admission_statements(
        admitted_via.as_str(),
        crate::store::thread_statements() - statements_before,
    );
    let lease_id = (admitted_via == AdmitPath::Database).then_some(lease_id);

    let seated = context.cell.seat(Control {
        socket: socket.clone(),
        user_id: claims.user_id.clone(),
        relay_host_id: claims.relay_host_id.clone(),
        epoch,
        generation: 0,
        admitted_via,
        lease_id,
    });
    if let Some(old) = seated.replaced {
        context.close(
            &old.socket,
            CloseCode::PeerDropped,
            "replaced by a newer control",
        );
    }
    context.seats.record(SeatChange {
        kind: ChangeKind::Join,
        user_id: claims.user_id.clone(),
        relay_host_id: claims.relay_host_id.clone(),
        epoch,
        generation: seated.generation,
        at_ms: now,
    });
    let generation = seated.generation;
    let ack = protocol::to_json(&RelayToHost::HostHelloAck { v: 1, generation });
    if socket.send(Message::text(ack)).is_err() {
        finish(context, &claims, epoch, generation);
        return Served::Ended;
    }
    // Acknowledged: from here a crash of this process costs the desktop a pause, not a redial.
    context.keep(
        &socket,
        CrashKind::Control,
        Some(ControlRecord {
            claims: ClaimsRecord::from(&claims),
            epoch,
            generation,
            admitted_via: admitted_via.into(),
            lease_id: (admitted_via == AdmitPath::Database).then(|| lease_id_of(context, &socket)),
        }),
        None,
        false,
    );
    log::debug!(
        "orca_relay_control_admitted host={} epoch={epoch} generation={generation} path={}",
        claims.relay_host_id,
        admitted_via.as_str()
    );
    let invites = InviteRate::new(context.clock.now_ms());
    run(
        context,
        &socket,
        reader,
        claims,
        (epoch, generation),
        invites,
    )
}

/// A seated control resumed after a handover: its read loop, where it was. (Its seat already
/// holds it: restored from the handover's state, or never left in this process.)
pub fn resume(
    context: &RelayContext,
    socket: Arc<Socket>,
    reader: Reader,
    control: ControlRecord,
    invites: InviteBucket,
) -> Served {
    let claims = HostClaims::from(&control.claims);
    let invites = InviteRate::resumed(context.clock.now_ms(), invites);
    run(
        context,
        &socket,
        reader,
        claims,
        (control.epoch, control.generation),
        invites,
    )
}

/// The read loop of a seated control, until it closes or a handover parks it.
fn run(
    context: &RelayContext,
    socket: &Arc<Socket>,
    mut reader: Reader,
    claims: HostClaims,
    (epoch, generation): (i64, u64),
    mut invites: InviteRate,
) -> Served {
    let silence = Duration::from_millis(context.timings.silence_ms);
    // Frames this control sent that the relay ignores: the first is logged, then at most one
    // line a minute with how many since (a desktop's loop must not fill the journal).
    let mut ignored = FailureThrottle::new();
    loop {
        let ignore = |ignored: &mut FailureThrottle, reason: &str| {
            if let Some(note) = ignored.failure(context.clock.now_ms()) {
                log::info!(
                    "orca_relay_control_frame_ignored host={} reason={reason}{note}",
                    claims.relay_host_id
                );
            }
        };
        match reader.read(Deadline::Silence(silence)) {
            ReadEvent::Message(Message::Text(text)) => {
                if !handle_message(context, socket, &claims, text.as_str(), &mut invites) {
                    ignore(&mut ignored, "unknown_type");
                }
            }
            ReadEvent::Message(Message::Binary(_)) => ignore(&mut ignored, "binary"),
            ReadEvent::Message(_) => {}
            ReadEvent::TimedOut => {
                // 4408 like a replaced control's, with a reason of its own: a desktop that
                // forgot to answer pings can tell.
                context.close(socket, CloseCode::PeerDropped, SILENT_REASON);
                reader.await_close_answer();
                break;
            }
            ReadEvent::TooBig => {
                context.close(socket, CloseCode::TooBig, "message_too_large");
                reader.drain_after_close();
                break;
            }
            ReadEvent::Protocol => {
                context.close(socket, CloseCode::ProtocolError, "protocol error");
                break;
            }
            ReadEvent::Gone => break,
            ReadEvent::Quiesce => {
                // A control being closed (replaced, drained) is not carried: it ends here.
                let seated = context
                    .cell
                    .control(&claims.relay_host_id)
                    .filter(|control| control.generation == generation);
                let Some(seated) = seated.filter(|_| !socket.is_closing()) else {
                    break;
                };
                return Served::parked(Stage::Control {
                    control: ControlRecord {
                        claims: ClaimsRecord::from(&claims),
                        epoch,
                        generation,
                        admitted_via: seated.admitted_via.into(),
                        lease_id: seated.lease_id,
                    },
                    reader: reader.record(),
                    silence_deadline: reader.silence_deadline(silence),
                    invites: invites.bucket(context.clock.now_ms()),
                });
            }
        }
        if socket.is_closing() {
            // Another thread closed it (a newer control, the drain, a moved lease).
            reader.await_close_answer();
            break;
        }
    }
    finish(context, &claims, epoch, generation);
    Served::Ended
}

/// The activity lease id of a database-admitted control.
fn lease_id_of(context: &RelayContext, socket: &Socket) -> String {
    format!(
        "control:{}:{}:{}",
        context.cell_id, context.incarnation, socket.id
    )
}

fn finish(context: &RelayContext, claims: &HostClaims, epoch: i64, generation: u64) {
    let Some(control) = context.cell.unseat(&claims.relay_host_id, generation) else {
        return;
    };
    // No newer control took its place: the desktop has left this cell, and its spliced pairs
    // are closed 4408 (they would otherwise outlive it, holding its phones' places).
    context.splice.close_host(&claims.relay_host_id);
    context.seats.record(SeatChange {
        kind: ChangeKind::Leave,
        user_id: claims.user_id.clone(),
        relay_host_id: claims.relay_host_id.clone(),
        epoch,
        generation,
        at_ms: context.clock.now_ms(),
    });
    if let Some(lease_id) = control.lease_id.as_deref() {
        if let Err(e) = context.store.delete_lease(lease_id) {
            // The lease expires on its own within its TTL.
            log::info!(
                "orca_relay_lease_delete_failed host={} {}",
                claims.relay_host_id,
                e.log_fields()
            );
        }
    }
}

/// The rate of one control's `invite-create`: a token bucket of [`INVITE_CREATE_BURST`],
/// refilled by one every [`INVITE_CREATE_REFILL_MS`]. Pure (times are passed in); it lives on
/// the control's own thread, so it needs no lock.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InviteRate {
    available: u32,
    /// When the bucket was last refilled up to.
    refilled_at_ms: u64,
}

impl InviteRate {
    pub fn new(now_ms: u64) -> InviteRate {
        InviteRate {
            available: INVITE_CREATE_BURST,
            refilled_at_ms: now_ms,
        }
    }

    /// The bucket as a handover carries it (its refill moment as an instant).
    pub fn bucket(&self, now_ms: u64) -> InviteBucket {
        let ago = Duration::from_millis(now_ms.saturating_sub(self.refilled_at_ms));
        let now = crate::clock::instant();
        InviteBucket {
            available: self.available,
            refilled_at: now.checked_sub(ago).unwrap_or(now),
        }
    }

    /// The bucket a handover carried, at `now_ms`.
    pub fn resumed(now_ms: u64, bucket: InviteBucket) -> InviteRate {
        let ago = crate::clock::instant()
            .saturating_duration_since(bucket.refilled_at)
            .as_millis() as u64;
        InviteRate {
            available: bucket.available.min(INVITE_CREATE_BURST),
            refilled_at_ms: now_ms.saturating_sub(ago),
        }
    }

    /// Takes one creation at `now_ms`: `Ok`, or `Err(ms)` to wait before the next is allowed.
    pub fn take(&mut self, now_ms: u64) -> Result<(), u64> {
        let elapsed = now_ms.saturating_sub(self.refilled_at_ms);
        let refills = elapsed / INVITE_CREATE_REFILL_MS;
        if refills > 0 {
            let refills = u32::try_from(refills).unwrap_or(u32::MAX);
            self.available = self
                .available
                .saturating_add(refills)
                .min(INVITE_CREATE_BURST);
            self.refilled_at_ms += u64::from(refills) * INVITE_CREATE_REFILL_MS;
        }
        if self.available == INVITE_CREATE_BURST {
            // A full bucket does not bank time for later.
            self.refilled_at_ms = now_ms;
        }
        if self.available == 0 {
            return Err(
                INVITE_CREATE_REFILL_MS.saturating_sub(now_ms.saturating_sub(self.refilled_at_ms))
            );
        }
        self.available -= 1;
        Ok(())
    }
}

/// Acts on one text message of a seated control; `false` when it is not one the relay acts
/// on (an unknown `type`, malformed JSON, a second hello): ignored, the caller logs it.
fn handle_message(
    context: &RelayContext,
    socket: &Arc<Socket>,
    claims: &HostClaims,
    text: &str,
    invites: &mut InviteRate,
) -> bool {
    match serde_json::from_str::<HostToRelay>(text) {
        Ok(HostToRelay::Pong { .. }) => true,
        Ok(HostToRelay::InviteCreate { req_id }) => {
            let refused = |reason: &str, retry_after_ms: u64| RelayToHost::InviteRefused {
                req_id: req_id.clone(),
                reason: reason.to_string(),
                retry_after_ms,
            };
            let reply = match invites.take(context.clock.now_ms()) {
                Err(wait_ms) => refused("rate_limited", wait_ms),
                Ok(()) => match random_token() {
                    Err(_) => refused("unavailable", INVITE_CREATE_REFILL_MS),
                    Ok(token) => match context
                        .cell
                        .create_invite(&claims.relay_host_id, token.clone())
                    {
                        Ok(expires_at) => RelayToHost::InviteCreated {
                            req_id: req_id.clone(),
                            invite_token: token,
                            expires_at,
                            max_attempts: INVITE_MAX_ATTEMPTS,
                        },
                        Err(_) => refused("host_offline", INVITE_CREATE_REFILL_MS),
                    },
                },
            };
            let _ = socket.send(Message::text(protocol::to_json(&reply)));
            true
        }
        Ok(HostToRelay::HostHello { .. }) | Err(_) => false,
    }
}

/// The `pinger` thread body: from `next` on, every `ping_ms`, a ping to every control that is
/// not mid-write. Returns when stopped, with when the next ping was due (a handover carries
/// it).
/// Beats at least once a beat period while it waits (a critical thread).
pub fn run_pinger(
    context: RelayContext,
    stop: Receiver<()>,
    mut next: Instant,
    beat: &Beat,
) -> Instant {
    let period = Duration::from_millis(context.timings.ping_ms);
    loop {
        if wait_beating(&stop, next, beat) {
            return next;
        }
        let ping = protocol::to_json(&RelayToHost::Ping {
            t: context.clock.now_ms(),
        });
        for control in context.cell.controls() {
            let _ = control.socket.try_send(Message::text(ping.clone()));
        }
        context.cell.expire(context.timings.seat_memory_ms);
        next = crate::clock::instant() + period;
    }
}

/// The `lease-renewer` thread body: every `lease_renew_ms`, renews the lease of every
/// database-admitted control; a moved placement closes that control 4503. From `next` on;
/// returns when stopped, with when the next renewal was due (a handover carries it).
/// Beats at least once a beat period while it waits and between two renewals; a renewal is a
/// database call, not judged while it lasts (a critical thread).
pub fn run_lease_renewer(
    context: RelayContext,
    stop: Receiver<()>,
    mut next: Instant,
    beat: &Beat,
) -> Instant {
    let period = Duration::from_millis(context.timings.lease_renew_ms);
    let mut renew_failures = crate::logging::FailureThrottle::new();
    loop {
        if wait_beating(&stop, next, beat) {
            return next;
        }
        next = crate::clock::instant() + period;
        for control in context.cell.controls() {
            beat.beat();
            // A pass over thousands of leases takes a while: a stop (a drain, a handover) is
            // heard between two renewals; the pass is then due again at once.
            if !matches!(stop.try_recv(), Err(std::sync::mpsc::TryRecvError::Empty)) {
                return crate::clock::instant();
            }
            let Some(lease_id) = control.lease_id.as_deref() else {
                continue;
            };
            let now = context.clock.now_ms() as i64;
            let outcome = beat.waiting(|| {
                context.store.renew_lease(
                    lease_id,
                    &control.user_id,
                    &control.relay_host_id,
                    &context.cell_id,
                    control.epoch,
                    admission::CONTROL_LEASE_KIND,
                    now + context.timings.lease_ttl_ms as i64,
                    now,
                )
            });
            if outcome.is_ok() {
                if let Some(note) = renew_failures.success() {
                    log::info!("orca_relay_lease_renew_recovered{note}");
                }
            }
            match outcome {
                Ok(LeaseOutcome::Renewed) => {}
                Ok(LeaseOutcome::Moved) => {
                    log::info!(
                        "orca_relay_control_lease_moved host={} epoch={}",
                        control.relay_host_id,
                        control.epoch
                    );
                    let drain = RelayToHost::Drain {
                        grace_ms: 0,
                        recovery: "resolve-director".into(),
                    };
                    let _ = control
                        .socket
                        .try_send(Message::text(protocol::to_json(&drain)));
                    context.close(&control.socket, CloseCode::Draining, "lease moved");
                }
                Err(e) => {
                    // The lease outlives a few missed renewals; try again next period. While
                    // the database is down every control fails: one line, then one a minute.
                    if let Some(note) = renew_failures.failure(context.clock.now_ms()) {
                        log::warn!(
                            "orca_relay_lease_renew_failed host={} {}{note}",
                            control.relay_host_id,
                            e.log_fields()
                        );
                    }
                }
            }
        }
    }
}

/// How reading a splice leg's or a control's first frame ended.
enum FirstText {
    Text(String),
    /// Refused with this code (late, not text, malformed, a rule broken).
    Refused(CloseCode),
    /// A handover quiesced the cell.
    Quiesce,
}

/// Reads the first frame of a control socket by `deadline`: it must be a text frame.
fn read_first_text(reader: &mut Reader, deadline: Instant) -> FirstText {
    match reader.read(Deadline::At(deadline)) {
        ReadEvent::Message(tungstenite::Message::Text(text)) => FirstText::Text(text.to_string()),
        ReadEvent::TooBig => FirstText::Refused(CloseCode::TooBig),
        ReadEvent::Protocol => FirstText::Refused(CloseCode::ProtocolError),
        ReadEvent::Quiesce => FirstText::Quiesce,
        _ => FirstText::Refused(CloseCode::BadOuterCredential),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn invite_creation_is_a_burst_then_one_a_refill_period() {
        let mut rate = InviteRate::new(1_000);
        for n in 0..INVITE_CREATE_BURST {
            assert_eq!(rate.take(1_000), Ok(()), "burst {n}");
        }
        assert_eq!(rate.take(1_000), Err(INVITE_CREATE_REFILL_MS));
        assert_eq!(rate.take(1_400), Err(INVITE_CREATE_REFILL_MS - 400));
        assert_eq!(rate.take(1_000 + INVITE_CREATE_REFILL_MS), Ok(()));
        assert!(rate.take(1_000 + INVITE_CREATE_REFILL_MS).is_err());
        // 10,000 requests within the first second take the burst; the second's first, one more.
        let mut rate = InviteRate::new(0);
        let allowed = (0..10_000u64).filter(|n| rate.take(n / 10).is_ok()).count();
        assert_eq!(allowed, INVITE_CREATE_BURST as usize);
        assert_eq!(rate.take(INVITE_CREATE_REFILL_MS), Ok(()));
        // A long quiet spell refills the burst, never more.
        let mut rate = InviteRate::new(0);
        for _ in 0..INVITE_CREATE_BURST {
            rate.take(0).unwrap();
        }
        let later = 100 * INVITE_CREATE_REFILL_MS;
        let allowed = (0..100).filter(|_| rate.take(later).is_ok()).count();
        assert_eq!(allowed, INVITE_CREATE_BURST as usize);
    }
}
