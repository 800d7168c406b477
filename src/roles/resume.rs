//! Crash survival, the restarted process's side (SPEC §13; ARCHITECTURE.md "Crash survival"):
//! what the crashed process kept in the service manager's descriptor store comes back at start
//! ([`Intake`]), and this resumes every connection whose record is whole and at rest, closes the
//! rest 1012, and takes over the store's bookkeeping. It reads as one sequence: [`after_crash`].
//!
//! The process starts as at any start (its own incarnation, registration, dead-man, trip slot
//! and readiness as after a normal start): nothing of the crashed process's judgement is
//! trusted, only its connections' identities. A resumed control is seated at the generation its
//! desktop knows, with a fresh silence window and a full `invite-create` bucket (outstanding
//! invites and remembered seats are lost); a resumed pair is spliced again with nothing in
//! flight. A connection whose record is missing, torn, or says the process held bytes of it or
//! was writing to it (`carry::crash::IO_*`) cannot be resumed exactly: it gets a 1012 close frame
//! (none if a frame was being written: half a frame may be on the wire) and is shut down.
//!
//! Never: resumes a pair whose desktop's control was not resumed; leaves a stored descriptor
//! that nobody owns (each is resumed, or closed and removed from the store).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::net::TcpStream;
use std::os::fd::OwnedFd;
use std::sync::Arc;
use std::time::Duration;

use crate::carry::connection::ReaderRecord;
use crate::carry::crash::{CrashKind, CrashRecord, IO_WRITING};
use crate::carry::pair::LegRecord;
use crate::cell::seats::{ChangeKind, SeatChange};
use crate::cell::state::Control;
use crate::crash_store::region::Region;
use crate::crash_store::{connection_name, inode_of, CrashStore, Intake};
use crate::protocol::CloseCode;
use crate::relay::context::RelayContext;
use crate::relay::frames::close_frame;
use crate::relay::hold::PhonePlace;
use crate::relay::park::{InviteBucket, Parked, ParkedConn, Stage};
use crate::relay::refuse::write_now;
use crate::relay::socket::Socket;
use crate::relay::splice::parked::{ResumedLeg, ResumedPair};
use crate::relay::thread;

/// What a restart after a crash did with what it was given.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Outcome {
    pub controls: usize,
    pub pairs: usize,
    /// Connections closed 1012.
    pub closed: usize,
    /// Connections that had half a frame on the wire: shut down without a close frame (their
    /// clients see the connection end, 1006).
    pub cut: usize,
}

/// The crash records of a region: connection id → (record, I/O flags).
fn records_of(region: Option<Region>) -> HashMap<u64, (CrashRecord, u32)> {
    let Some(region) = region else {
        return HashMap::new();
    };
    (0..region.slots())
        .filter_map(|index| region.read(index))
        .map(|(record, flags)| (record.id, (record, flags)))
        .collect()
}

/// Resumes what `intake` brought back (see the module header). `store` is this process's own
/// (its region new).
pub fn after_crash(context: &RelayContext, store: &Arc<CrashStore>, intake: Intake) -> Outcome {
    let Intake {
        region,
        connections,
        stale,
        ..
    } = intake;
    // 1. The dead process's records, read from its region (its memfd, from the store).
    let (old_region_name, old_region) = match region {
        Some((name, fd)) => match Region::adopt(fd) {
            Ok(region) => (Some(name), Some(region)),
            Err(e) => {
                log::warn!("orca_relay_crash_store_unreadable name={name} error={e}");
                (Some(name), None)
            }
        },
        None => (None, None),
    };
    // 2. This process's region in the store before anything resumed moves a byte (the dead
    //    one's records are stale from then on); if it cannot be, nothing is resumed.
    let records = match store.keep_region_now() {
        Ok(()) => records_of(old_region),
        Err(e) => {
            log::warn!("orca_relay_crash_store_region_not_kept error={e} resumed=none");
            HashMap::new()
        }
    };
    let mut outcome = Outcome::default();
    // 3. Each kept connection: at rest and whole (resumed below), or closed now.
    let mut controls = Vec::new();
    let mut legs: BTreeMap<u64, (CrashRecord, OwnedFd)> = BTreeMap::new();
    for (id, fd) in connections {
        match records.get(&id) {
            Some((record, 0)) if record.inode == inode_of(&fd) => match record.kind {
                CrashKind::Control if record.control.is_some() => {
                    controls.push((record.clone(), fd))
                }
                CrashKind::Phone | CrashKind::Data if record.peer.is_some() => {
                    legs.insert(id, (record.clone(), fd));
                }
                _ => close_kept(context, store, id, fd, false, &mut outcome),
            },
            Some((_, flags)) => close_kept(
                context,
                store,
                id,
                fd,
                flags & IO_WRITING != 0,
                &mut outcome,
            ),
            None => close_kept(context, store, id, fd, false, &mut outcome),
        }
    }
    // 4. Controls, seated at the generation their desktops know.
    let mut seated = HashSet::new();
    for (record, fd) in controls {
        let id = record.id;
        match resume_control(context, store, record, fd) {
            Some(host) => {
                seated.insert(host);
                outcome.controls += 1;
            }
            None => {
                store.forget(&connection_name(id));
                outcome.closed += 1;
            }
        }
    }
    // 5. Pairs whose two legs name each other and whose desktop was seated again.
    while let Some((phone_id, (phone, phone_fd))) = legs.pop_first() {
        let peer_id = phone.peer.unwrap_or(0);
        let peer = legs.remove(&peer_id);
        let matched = match &peer {
            Some((peer, _)) => {
                peer.peer == Some(phone_id)
                    && peer.kind != phone.kind
                    && peer.relay_host_id == phone.relay_host_id
                    && phone
                        .relay_host_id
                        .as_ref()
                        .is_some_and(|host| seated.contains(host))
            }
            None => false,
        };
        match peer {
            Some((peer, peer_fd)) if matched => {
                let (phone, phone_fd, data, data_fd) = if phone.kind == CrashKind::Phone {
                    (phone, phone_fd, peer, peer_fd)
                } else {
                    (peer, peer_fd, phone, phone_fd)
                };
                resume_pair(context, store, (phone, phone_fd), (data, data_fd));
                outcome.pairs += 1;
            }
            other => {
                close_kept(context, store, phone_id, phone_fd, false, &mut outcome);
                if let Some((peer, peer_fd)) = other {
                    close_kept(context, store, peer.id, peer_fd, false, &mut outcome);
                }
            }
        }
    }
    // 6. The dead process's region out (after this one's, which is in already).
    for name in old_region_name.into_iter().chain(stale) {
        store.forget(&name);
    }
    outcome
}

/// Closes a kept connection that cannot be resumed: a 1012 close frame (unless a frame was
/// being written: `cut`), the TCP connection shut down, its descriptor removed from the store.
fn close_kept(
    context: &RelayContext,
    store: &CrashStore,
    id: u64,
    fd: OwnedFd,
    cut: bool,
    outcome: &mut Outcome,
) {
    restart_close(context, TcpStream::from(fd), cut);
    store.forget(&connection_name(id));
    if cut {
        outcome.cut += 1;
    } else {
        outcome.closed += 1;
    }
}

/// A 1012 close frame without waiting, our side shut, and the connection dropped by the reaper
/// once the client answered (or a moment later), as every close is. When `cut` (half a frame is
/// on the wire: no close frame may follow it), the connection is shut down at once.
fn restart_close(context: &RelayContext, stream: TcpStream, cut: bool) {
    let _ = stream.set_nonblocking(true);
    if cut {
        let _ = stream.shutdown(std::net::Shutdown::Both);
        return;
    }
    let code = CloseCode::ServiceRestart;
    let _ = write_now(&stream, &close_frame(Some(code.code()), "service restart"));
    context.metrics.close(code);
    let _ = stream.shutdown(std::net::Shutdown::Write);
    context
        .reaper
        .schedule_stream(Arc::new(stream), crate::relay::socket::CLOSE_LINGER);
}

/// A control's socket as this process's, its writes under the wedge window and interrupted by
/// a handover's quiesce, as every control the relay serves (`relay/socket.rs`).
fn socket_of(context: &RelayContext, id: u64, fd: OwnedFd) -> Arc<Socket> {
    let stream = TcpStream::from(fd);
    let _ = stream.set_nonblocking(false);
    let _ = stream.set_write_timeout(Some(Duration::from_millis(context.timings.wedge_ms)));
    Socket::interruptible(id, stream, context.quiesce.interrupt())
}

/// Seats a control again and starts its relay thread; its host, or `None` when it cannot be
/// seated (a newer control of the same host was resumed: this one is closed 1012).
fn resume_control(
    context: &RelayContext,
    store: &Arc<CrashStore>,
    record: CrashRecord,
    fd: OwnedFd,
) -> Option<String> {
    let control = record.control.clone()?;
    let host = control.claims.relay_host_id.clone();
    let socket = socket_of(context, record.id, fd);
    let seated = context.cell.resume_seat(Control {
        socket: socket.clone(),
        user_id: control.claims.user_id.clone(),
        relay_host_id: host.clone(),
        epoch: control.epoch,
        generation: control.generation,
        admitted_via: control.admitted_via.into(),
        lease_id: control.lease_id.clone(),
    });
    if !seated {
        if let Ok(stream) = socket.stream().try_clone() {
            restart_close(context, stream, false);
        }
        return None;
    }
    context.seats.record(SeatChange {
        kind: ChangeKind::Join,
        user_id: control.claims.user_id.clone(),
        relay_host_id: host.clone(),
        epoch: control.epoch,
        generation: control.generation,
        at_ms: context.clock.now_ms(),
    });
    if let Some(slot) = store.keep(socket.stream(), record.clone(), true) {
        socket.keep(slot);
    }
    let now = crate::clock::instant();
    let parked = Parked {
        id: record.id,
        conn: ParkedConn::Socket(socket),
        stage: Stage::Control {
            control,
            reader: ReaderRecord {
                buffered: record.partial,
                parser: record.parser,
                message: None,
            },
            silence_deadline: now + Duration::from_millis(context.timings.silence_ms),
            invites: InviteBucket {
                available: crate::protocol::INVITE_CREATE_BURST,
                refilled_at: now,
            },
        },
        hold: Some(context.carried_hold("control")),
        place: None,
    };
    if let Err(e) = thread::resume(context, parked, None, None) {
        log::error!(
            "orca_relay_crash_resume_failed conn={} error={e}",
            record.id
        );
    }
    Some(host)
}

/// Splices a pair again, both legs at rest (nothing in flight, no frame half read or written).
fn resume_pair(
    context: &RelayContext,
    store: &Arc<CrashStore>,
    (phone, phone_fd): (CrashRecord, OwnedFd),
    (data, data_fd): (CrashRecord, OwnedFd),
) {
    let host = phone.relay_host_id.clone().unwrap_or_default();
    let now_ms = context.clock.now_ms();
    let leg = |record: CrashRecord, fd: OwnedFd, kind: &str| -> ResumedLeg {
        let socket = Socket::new_splice(record.id, TcpStream::from(fd));
        let mut release: Vec<crate::relay::splice::Release> =
            vec![Box::new(context.carried_hold(kind))];
        if kind == "phone" {
            release.push(Box::new(PhonePlace::carried(&context.cell, &host)));
        }
        let leg_record = LegRecord {
            id: record.id,
            parser: record.parser,
            partial: Vec::new(),
            needed: 0,
            output: Vec::new(),
            closing: None,
            paused: false,
            hangup_seen: false,
            progress_ago_ms: 0,
            linger_left_ms: None,
            cursor: None,
            stream_in: None,
            control_in_flight: None,
            control_next: None,
            arrival_ago_ms: Some(0),
            idle_pinged: false,
        };
        if let Some(slot) = store.keep(socket.stream(), record, true) {
            socket.keep(slot);
        }
        ResumedLeg {
            socket,
            record: leg_record,
            release,
            last_progress_ms: now_ms,
            linger_due_ms: None,
            last_heard_ms: now_ms,
        }
    };
    let pair = ResumedPair {
        relay_host_id: Some(host.clone()),
        phone: Some(leg(phone, phone_fd, "phone")),
        host: Some(leg(data, data_fd, "data")),
    };
    if context.splice.resume(pair).is_err() {
        log::error!("orca_relay_crash_resume_failed host={host} reason=no_splice_worker");
    }
}

/// The first connection id this process may hand out: above every id the store kept (a store
/// name `c<id>` must never stand for two connections).
pub fn first_connection_id(intake: &Intake) -> u64 {
    intake
        .connections
        .keys()
        .max()
        .map_or(1, |last| last.saturating_add(1))
}

/// At a start that is not a live handover's: keeps the listeners in the store, resumes what
/// the store brought back (see [`after_crash`]) and logs what became of it. With the crash store
/// off (`ORCA_RELAY_CRASH_STORE=0`, or no manager to keep anything), whatever was kept before is
/// closed 1012 and forgotten.
pub fn keep_and_resume(
    context: &RelayContext,
    intake: Intake,
    listeners: &[(&str, &std::net::TcpListener)],
) {
    let passed = intake.connections.len();
    match &context.crash {
        Some(store) => {
            for (name, listener) in listeners {
                use std::os::fd::AsFd;
                if let Err(e) = store.keep_descriptor(name, listener.as_fd()) {
                    log::warn!("orca_relay_crash_store_listener_not_kept name={name} error={e}");
                }
            }
            let outcome = after_crash(context, store, intake);
            if passed > 0 {
                log::info!(
                    "orca_relay_crash_resumed controls={} pairs={} closed={} cut={}",
                    outcome.controls,
                    outcome.pairs,
                    outcome.closed,
                    outcome.cut
                );
            }
        }
        None => {
            for (id, fd) in intake.connections {
                restart_close(context, TcpStream::from(fd), false);
                forget_without_store(&connection_name(id));
            }
            for name in intake
                .region
                .map(|(name, _)| name)
                .into_iter()
                .chain(intake.stale)
            {
                forget_without_store(&name);
            }
            if passed > 0 {
                log::info!(
                    "orca_relay_crash_resumed controls=0 pairs=0 closed={passed} cut=0 store=off"
                );
            }
        }
    }
}

/// Removes a name from the manager's store with no crash store running (it was turned off).
fn forget_without_store(name: &str) {
    if let Some(socket) = crate::lifecycle::notify_socket() {
        let _ = crate::lifecycle::send_notification(
            &socket,
            &format!("FDSTOREREMOVE=1\nFDNAME={name}"),
        );
    }
}
