//! The cell's in-memory model: seats, controls, phones, invites, pending data legs, connection
//! slots.
//!
//! Owned by no thread: every relay thread, the pinger, the lease renewer and the HTTP handlers
//! share it through one mutex held only for short, I/O-free sections. Sockets are `Arc`s handed
//! out of the lock and written after it is released. This module never imports the data plane
//! (`relay/`): it stores sockets through the [`Peer`] trait the data plane implements.
//!
//! A *seat* remembers a host that is or was seated here (`seatedHereAt`, SPEC §5.3): its epoch,
//! its control generation, when it left, whether it was demoted.
//!
//! *Invites* belong to a host while it has a control here: at most [`MAX_INVITES_PER_HOST`]
//! outstanding (a new one replaces the oldest), all dropped when the control leaves (a newer
//! control of the same host keeps them), each gone at its expiry. Expiry is kept in a queue
//! ordered by expiry time, so the periodic sweep touches only the invites that expire, never
//! every outstanding one (it runs under the lock every admission takes).

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::mpsc::SyncSender;
use std::sync::{Arc, Mutex, MutexGuard};

use crate::carry::cell::{CellStateRecord, InviteRecord, SeatRecord};
use crate::clock::SharedClock;
use crate::protocol::{INVITE_MAX_ATTEMPTS, INVITE_TTL_MS, MAX_PHONES_PER_HOST};

/// Outstanding invites one host may have at once; a new one replaces the oldest. One per phone
/// place (SPEC §5.2: 8 phones per host) is more than pairing needs: a person pairs one phone at
/// a time, and an invite lasts 10 minutes.
pub const MAX_INVITES_PER_HOST: usize = MAX_PHONES_PER_HOST;

/// A connected WebSocket, as the cell model needs to know it.
pub trait Peer: Send + Sync {
    /// What a data leg hands its phone when it attaches (the data plane's own type: the leg's
    /// socket and what it has read so far).
    type Attached: Send;
    fn id(&self) -> u64;
}

/// How a control was admitted (SPEC §5.3).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AdmitPath {
    Booking,
    Memory,
    Database,
}

impl AdmitPath {
    pub fn as_str(self) -> &'static str {
        match self {
            AdmitPath::Booking => "booking",
            AdmitPath::Memory => "memory",
            AdmitPath::Database => "database",
        }
    }
}

/// A live control socket.
pub struct Control<S> {
    pub socket: Arc<S>,
    pub user_id: String,
    pub relay_host_id: String,
    pub epoch: i64,
    pub generation: u64,
    pub admitted_via: AdmitPath,
    /// The activity lease id, for database-admitted controls.
    pub lease_id: Option<String>,
}

impl<S> Clone for Control<S> {
    fn clone(&self) -> Self {
        Control {
            socket: self.socket.clone(),
            user_id: self.user_id.clone(),
            relay_host_id: self.relay_host_id.clone(),
            epoch: self.epoch,
            generation: self.generation,
            admitted_via: self.admitted_via,
            lease_id: self.lease_id.clone(),
        }
    }
}

struct Seat<S> {
    user_id: String,
    epoch: i64,
    generation: u64,
    control: Option<Control<S>>,
    phones: usize,
    left_at_ms: Option<u64>,
    demoted: bool,
    /// This host's outstanding invites (their tokens), oldest first, at most
    /// [`MAX_INVITES_PER_HOST`].
    invites: VecDeque<String>,
}

struct Invite {
    relay_host_id: String,
    expires_at_ms: u64,
    attempts_left: u32,
    /// Its key in the expiry queue.
    expiry: (u64, u64),
}

/// A phone waiting for its host's data leg.
pub struct Pending<S: Peer> {
    pub relay_host_id: String,
    pub ticket: String,
    pub generation: u64,
    pub phone: Arc<S>,
    pub attach: SyncSender<S::Attached>,
}

struct Inner<S: Peer> {
    seats: HashMap<String, Seat<S>>,
    invites: HashMap<String, Invite>,
    /// Every outstanding invite by (expiry, creation order): the sweep pops what is due.
    invite_expiry: BTreeMap<(u64, u64), String>,
    next_invite: u64,
    pending: HashMap<String, Pending<S>>,
    /// A live handover froze the attaches: no phone is admitted and no pending entry taken
    /// until it ends, so what the handover carries of them cannot change under it.
    frozen: bool,
}

impl<S: Peer> Inner<S> {
    /// Forgets one invite everywhere it is indexed (the host's list is the caller's).
    fn forget_invite(&mut self, token: &str) -> Option<Invite> {
        let invite = self.invites.remove(token)?;
        self.invite_expiry.remove(&invite.expiry);
        Some(invite)
    }

    /// Drops every invite of a host (its control left).
    fn drop_invites_of(&mut self, relay_host_id: &str) {
        let tokens = self
            .seats
            .get_mut(relay_host_id)
            .map(|seat| std::mem::take(&mut seat.invites))
            .unwrap_or_default();
        for token in tokens {
            self.forget_invite(&token);
        }
    }
}

/// Why an invite was not minted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InviteRefusal {
    /// The host has no live control here (it left meanwhile).
    HostOffline,
}

/// Why a phone was refused (SPEC §5.2 phone endpoint).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PhoneRefusal {
    HostOffline,
    BadCredential,
    TooManyPhones,
    /// Not refused: a handover froze the attaches; the phone is carried and admitted after.
    Frozen,
}

/// A handover froze the attaches (see [`CellState::freeze_attaches`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Frozen;

/// What a successful hello replaced.
pub struct Seated<S> {
    pub generation: u64,
    pub replaced: Option<Control<S>>,
}

pub struct CellState<S: Peer> {
    inner: Mutex<Inner<S>>,
    clock: SharedClock,
    next_conn: AtomicU64,
}

impl<S: Peer> CellState<S> {
    pub fn new(clock: SharedClock) -> Self {
        CellState {
            inner: Mutex::new(Inner {
                seats: HashMap::new(),
                invites: HashMap::new(),
                invite_expiry: BTreeMap::new(),
                next_invite: 0,
                pending: HashMap::new(),
                frozen: false,
            }),
            clock,
            next_conn: AtomicU64::new(1),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Inner<S>> {
        self.inner
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    pub fn now_ms(&self) -> u64 {
        self.clock.now_ms()
    }

    /// Is this host seated here now at this epoch, or did it leave here at this epoch within
    /// `memory_ms` without being demoted? (`seatedHereAt`, SPEC §5.3 step 2.)
    pub fn seated_here_at(
        &self,
        user_id: &str,
        relay_host_id: &str,
        epoch: i64,
        memory_ms: u64,
    ) -> bool {
        let now = self.now_ms();
        let inner = self.lock();
        let Some(seat) = inner.seats.get(relay_host_id) else {
            return false;
        };
        if seat.user_id != user_id || seat.epoch != epoch || seat.demoted {
            return false;
        }
        if seat.control.is_some() {
            return true;
        }
        seat.left_at_ms
            .is_some_and(|left| now.saturating_sub(left) <= memory_ms)
    }

    /// Does this cell remember the host at all (any epoch)? Used to decide whether a hello can
    /// hope for memory admission before the database is asked.
    pub fn remembers(&self, relay_host_id: &str) -> bool {
        self.lock()
            .seats
            .get(relay_host_id)
            .is_some_and(|seat| !seat.demoted)
    }

    /// Seats an admitted control: generation + 1, the older control (if any) is returned so the
    /// caller closes it 4408 outside the lock.
    pub fn seat(&self, control_template: Control<S>) -> Seated<S> {
        let mut inner = self.lock();
        let seat = inner
            .seats
            .entry(control_template.relay_host_id.clone())
            .or_insert_with(|| Seat {
                user_id: control_template.user_id.clone(),
                epoch: control_template.epoch,
                generation: 0,
                control: None,
                phones: 0,
                left_at_ms: None,
                demoted: false,
                invites: VecDeque::new(),
            });
        seat.generation += 1;
        seat.user_id = control_template.user_id.clone();
        seat.epoch = control_template.epoch;
        seat.demoted = false;
        seat.left_at_ms = None;
        let mut control = control_template;
        control.generation = seat.generation;
        let replaced = seat.control.replace(control);
        Seated {
            generation: seat.generation,
            replaced,
        }
    }

    /// A control socket ended. Only the current control of that generation unseats the host
    /// (and drops its invites); the removed control is returned (its lease, if any, is the
    /// caller's to delete).
    pub fn unseat(&self, relay_host_id: &str, generation: u64) -> Option<Control<S>> {
        let now = self.now_ms();
        let mut inner = self.lock();
        let seat = inner.seats.get_mut(relay_host_id)?;
        if seat.control.as_ref().map(|c| c.generation) != Some(generation) {
            return None;
        }
        seat.left_at_ms = Some(now);
        let control = seat.control.take();
        inner.drop_invites_of(relay_host_id);
        control
    }

    /// After a trip, a memory- or booking-admitted control now holds a database lease.
    pub fn promote_to_database(
        &self,
        relay_host_id: &str,
        generation: u64,
        lease_id: String,
    ) -> bool {
        let mut inner = self.lock();
        let Some(control) = inner
            .seats
            .get_mut(relay_host_id)
            .and_then(|seat| seat.control.as_mut())
            .filter(|control| control.generation == generation)
        else {
            return false;
        };
        control.admitted_via = AdmitPath::Database;
        control.lease_id = Some(lease_id);
        true
    }

    /// The host was refused with 4409 here: memory must not admit it again.
    pub fn demote(&self, relay_host_id: &str) {
        if let Some(seat) = self.lock().seats.get_mut(relay_host_id) {
            seat.demoted = true;
        }
    }

    /// Forgets seats that left longer than `memory_ms` ago and invites past their expiry
    /// (called periodically). Returns how many invites expired: the sweep's work on invites is
    /// that many steps, whatever else is outstanding.
    pub fn expire(&self, memory_ms: u64) -> usize {
        let now = self.now_ms();
        let mut inner = self.lock();
        inner.seats.retain(|_, seat| {
            seat.control.is_some()
                || seat.phones > 0
                || seat
                    .left_at_ms
                    .is_some_and(|left| now.saturating_sub(left) <= memory_ms)
        });
        let mut expired = 0;
        while let Some(entry) = inner.invite_expiry.first_entry() {
            if entry.key().0 > now {
                break;
            }
            let token = entry.remove();
            if let Some(invite) = inner.invites.remove(&token) {
                if let Some(seat) = inner.seats.get_mut(&invite.relay_host_id) {
                    seat.invites.retain(|held| *held != token);
                }
            }
            expired += 1;
        }
        expired
    }

    /// Invites outstanding in the whole cell.
    pub fn invite_count(&self) -> usize {
        self.lock().invites.len()
    }

    pub fn control(&self, relay_host_id: &str) -> Option<Control<S>> {
        self.lock()
            .seats
            .get(relay_host_id)
            .and_then(|seat| seat.control.clone())
    }

    /// Every live control (cloned out of the lock).
    pub fn controls(&self) -> Vec<Control<S>> {
        self.lock()
            .seats
            .values()
            .filter_map(|seat| seat.control.clone())
            .collect()
    }

    pub fn control_count(&self) -> usize {
        self.lock()
            .seats
            .values()
            .filter(|seat| seat.control.is_some())
            .count()
    }

    /// Records an invite for a host that has a live control here; past
    /// [`MAX_INVITES_PER_HOST`] its oldest invite is replaced. Returns the expiry time.
    pub fn create_invite(&self, relay_host_id: &str, token: String) -> Result<u64, InviteRefusal> {
        let expires_at_ms = self.now_ms() + INVITE_TTL_MS;
        let mut inner = self.lock();
        let inner = &mut *inner;
        let seat = inner
            .seats
            .get_mut(relay_host_id)
            .filter(|seat| seat.control.is_some())
            .ok_or(InviteRefusal::HostOffline)?;
        let replaced = if seat.invites.len() >= MAX_INVITES_PER_HOST {
            seat.invites.pop_front()
        } else {
            None
        };
        seat.invites.push_back(token.clone());
        if let Some(oldest) = replaced {
            inner.forget_invite(&oldest);
        }
        let expiry = (expires_at_ms, inner.next_invite);
        inner.next_invite += 1;
        inner.invite_expiry.insert(expiry, token.clone());
        inner.invites.insert(
            token,
            Invite {
                relay_host_id: relay_host_id.to_string(),
                expires_at_ms,
                attempts_left: INVITE_MAX_ATTEMPTS,
                expiry,
            },
        );
        Ok(expires_at_ms)
    }

    /// A phone presents an invite: checks host online, credential, phone count, then takes a
    /// phone place and registers the pending data leg. Returns the control to notify.
    pub fn admit_phone(
        &self,
        relay_host_id: &str,
        credential: &str,
        phone: Arc<S>,
        ticket: String,
        attach: SyncSender<S::Attached>,
    ) -> Result<(String, Control<S>), PhoneRefusal> {
        let now = self.now_ms();
        let mut inner = self.lock();
        if inner.frozen {
            return Err(PhoneRefusal::Frozen);
        }
        let control = inner
            .seats
            .get(relay_host_id)
            .and_then(|seat| seat.control.clone())
            .ok_or(PhoneRefusal::HostOffline)?;
        let invite = inner
            .invites
            .get_mut(credential)
            .filter(|invite| {
                invite.relay_host_id == relay_host_id
                    && invite.expires_at_ms > now
                    && invite.attempts_left > 0
            })
            .ok_or(PhoneRefusal::BadCredential)?;
        invite.attempts_left -= 1;
        let seat = inner
            .seats
            .get_mut(relay_host_id)
            .ok_or(PhoneRefusal::HostOffline)?;
        if seat.phones >= MAX_PHONES_PER_HOST {
            return Err(PhoneRefusal::TooManyPhones);
        }
        seat.phones += 1;
        let conn_id = format!(
            "{:x}-{}",
            self.next_conn.fetch_add(1, Ordering::Relaxed),
            phone.id()
        );
        inner.pending.insert(
            conn_id.clone(),
            Pending {
                relay_host_id: relay_host_id.to_string(),
                ticket,
                generation: control.generation,
                phone,
                attach,
            },
        );
        Ok((conn_id, control))
    }

    /// A phone leg ended: its place is returned.
    pub fn release_phone(&self, relay_host_id: &str) {
        if let Some(seat) = self.lock().seats.get_mut(relay_host_id) {
            seat.phones = seat.phones.saturating_sub(1);
        }
    }

    /// A phone gave up waiting: removes its pending entry. `false` means a data leg took it
    /// first (the attach message is on its way).
    pub fn abandon_pending(&self, conn_id: &str) -> bool {
        self.lock().pending.remove(conn_id).is_some()
    }

    /// A data leg authenticates: the ticket and generation must match the pending entry and
    /// the host's live control. `Err(Frozen)` while a handover has the attaches frozen.
    pub fn take_pending(
        &self,
        conn_id: &str,
        ticket: &str,
        generation: u64,
    ) -> Result<Option<Pending<S>>, Frozen> {
        let mut inner = self.lock();
        if inner.frozen {
            return Err(Frozen);
        }
        let matches = inner.pending.get(conn_id).is_some_and(|pending| {
            crate::http::constant_time_eq(pending.ticket.as_bytes(), ticket.as_bytes())
                && pending.generation == generation
        });
        if !matches {
            return Ok(None);
        }
        let Some(pending) = inner.pending.remove(conn_id) else {
            return Ok(None);
        };
        let live = inner
            .seats
            .get(&pending.relay_host_id)
            .and_then(|seat| seat.control.as_ref())
            .is_some_and(|control| control.generation == generation);
        if live {
            Ok(Some(pending))
        } else {
            Ok(None)
        }
    }

    /// Freezes the attaches for a live handover: phones are not admitted and pending entries
    /// not taken (both callers deposit their connection instead), and every waiting phone is
    /// woken with `wake()` on its channel.
    pub fn freeze_attaches(&self, wake: impl Fn() -> S::Attached) {
        let mut inner = self.lock();
        inner.frozen = true;
        for pending in inner.pending.values() {
            // A full channel already holds a leg or a wake: either wakes the phone.
            let _ = pending.attach.try_send(wake());
        }
    }

    /// The handover ended (either way): attaches go on.
    pub fn thaw_attaches(&self) {
        self.lock().frozen = false;
    }

    /// Whether a phone's pending entry is still waiting for its data leg.
    pub fn pending_present(&self, conn_id: &str) -> bool {
        self.lock().pending.contains_key(conn_id)
    }

    /// Puts a waiting phone's pending entry back (a phone resumed after a handover, with a
    /// channel of its new thread).
    pub fn restore_pending(&self, conn_id: &str, pending: Pending<S>) {
        self.lock().pending.insert(conn_id.to_string(), pending);
    }

    /// A phone place for a phone a handover brought: counted even past the limit (it is
    /// connected already); returned by [`CellState::release_phone`].
    pub fn take_phone_place(&self, relay_host_id: &str) {
        if let Some(seat) = self.lock().seats.get_mut(relay_host_id) {
            seat.phones += 1;
        }
    }

    pub fn phone_count(&self, relay_host_id: &str) -> usize {
        self.lock()
            .seats
            .get(relay_host_id)
            .map(|seat| seat.phones)
            .unwrap_or(0)
    }
}

impl<S: Peer> CellState<S> {
    /// What a handover carries of the model at `at` (pending entries and live controls travel
    /// with their connections).
    pub fn record(&self, at: &crate::carry::time::Snapshot) -> CellStateRecord {
        let inner = self.lock();
        let mut seats: Vec<SeatRecord> = inner
            .seats
            .iter()
            .map(|(relay_host_id, seat)| SeatRecord {
                relay_host_id: relay_host_id.clone(),
                user_id: seat.user_id.clone(),
                epoch: seat.epoch,
                generation: seat.generation,
                left_ago_ms: seat.left_at_ms.map(|left| at.age_ms(left)),
                demoted: seat.demoted,
            })
            .collect();
        seats.sort_by(|a, b| a.relay_host_id.cmp(&b.relay_host_id));
        let invites: Vec<InviteRecord> = seats
            .iter()
            .filter_map(|record| inner.seats.get(&record.relay_host_id))
            .flat_map(|seat| seat.invites.iter())
            .filter_map(|token| {
                let invite = inner.invites.get(token)?;
                Some(InviteRecord {
                    token: token.clone(),
                    relay_host_id: invite.relay_host_id.clone(),
                    expires_in_ms: at.left_ms(invite.expires_at_ms),
                    attempts_left: invite.attempts_left,
                })
            })
            .collect();
        CellStateRecord {
            seats,
            invites,
            next_conn: self.next_conn.load(Ordering::Relaxed),
        }
    }

    /// Rebuilds the model from a handover's record (into a cell that has none yet). Controls
    /// are put back with [`CellState::restore_control`], phone places with
    /// [`CellState::take_phone_place`].
    pub fn restore(&self, record: CellStateRecord, carry: &crate::carry::time::Carry) {
        let mut inner = self.lock();
        for seat in record.seats {
            inner.seats.insert(
                seat.relay_host_id,
                Seat {
                    user_id: seat.user_id,
                    epoch: seat.epoch,
                    generation: seat.generation,
                    control: None,
                    phones: 0,
                    left_at_ms: seat.left_ago_ms.map(|age| carry.moment_ms(age)),
                    demoted: seat.demoted,
                    invites: VecDeque::new(),
                },
            );
        }
        let inner = &mut *inner;
        for invite in record.invites {
            let Some(seat) = inner.seats.get_mut(&invite.relay_host_id) else {
                continue;
            };
            // At most the host's bound (a version-1 process had none): the oldest go.
            let replaced = if seat.invites.len() >= MAX_INVITES_PER_HOST {
                seat.invites.pop_front()
            } else {
                None
            };
            seat.invites.push_back(invite.token.clone());
            if let Some(oldest) = replaced {
                inner.forget_invite(&oldest);
            }
            let expires_at_ms = carry.deadline_ms(invite.expires_in_ms);
            let expiry = (expires_at_ms, inner.next_invite);
            inner.next_invite += 1;
            inner.invite_expiry.insert(expiry, invite.token.clone());
            inner.invites.insert(
                invite.token,
                Invite {
                    relay_host_id: invite.relay_host_id,
                    expires_at_ms,
                    attempts_left: invite.attempts_left,
                    expiry,
                },
            );
        }
        self.next_conn
            .fetch_max(record.next_conn, Ordering::Relaxed);
    }

    /// Puts a carried control back in its seat (same host, same generation). False when the
    /// seat does not know it.
    /// Seats a control a restarted process resumed after a crash, at the generation its record
    /// (and its desktop) knows; `false` when a newer control of that host is seated already.
    /// Nothing else of the crashed process's cell is carried: the seat has no invites and no
    /// memory of other hosts.
    pub fn resume_seat(&self, control: Control<S>) -> bool {
        let mut inner = self.lock();
        let seat = inner
            .seats
            .entry(control.relay_host_id.clone())
            .or_insert_with(|| Seat {
                user_id: control.user_id.clone(),
                epoch: control.epoch,
                generation: control.generation,
                control: None,
                phones: 0,
                left_at_ms: None,
                demoted: false,
                invites: VecDeque::new(),
            });
        if seat.control.is_some() && seat.generation >= control.generation {
            return false;
        }
        seat.generation = control.generation;
        seat.user_id = control.user_id.clone();
        seat.epoch = control.epoch;
        seat.left_at_ms = None;
        seat.control = Some(control);
        true
    }

    pub fn restore_control(&self, control: Control<S>) -> bool {
        let mut inner = self.lock();
        let Some(seat) = inner
            .seats
            .get_mut(&control.relay_host_id)
            .filter(|seat| seat.generation == control.generation && seat.control.is_none())
        else {
            return false;
        };
        seat.left_at_ms = None;
        seat.control = Some(control);
        true
    }
}

/// WebSocket connections (and, in reserve mode, bookings) held against the connection cap.
/// Every unit taken is returned exactly once, by dropping its [`SlotGuard`].
pub struct ConnectionSlots {
    used: AtomicU32,
    cap: u32,
}

impl ConnectionSlots {
    pub fn new(cap: u32) -> Arc<Self> {
        Arc::new(ConnectionSlots {
            used: AtomicU32::new(0),
            cap,
        })
    }

    pub fn try_take(self: &Arc<Self>) -> Option<SlotGuard> {
        let mut current = self.used.load(Ordering::Acquire);
        loop {
            if current >= self.cap {
                return None;
            }
            match self.used.compare_exchange_weak(
                current,
                current + 1,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => {
                    return Some(SlotGuard {
                        slots: self.clone(),
                    })
                }
                Err(actual) => current = actual,
            }
        }
    }

    /// A unit even past the cap: for a connection or booking a handover brought, which exists
    /// already (the cap may have been lowered by the new configuration). New connections still
    /// see the cap.
    pub fn take_forced(self: &Arc<Self>) -> SlotGuard {
        self.used.fetch_add(1, Ordering::AcqRel);
        SlotGuard {
            slots: self.clone(),
        }
    }

    pub fn used(&self) -> u32 {
        self.used.load(Ordering::Acquire)
    }

    pub fn cap(&self) -> u32 {
        self.cap
    }
}

/// One unit of the connection cap; returned on drop.
pub struct SlotGuard {
    slots: Arc<ConnectionSlots>,
}

impl Drop for SlotGuard {
    fn drop(&mut self) {
        self.slots.used.fetch_sub(1, Ordering::AcqRel);
    }
}

/// The OS random source failed: no secret can be minted, and the operation that needed one is
/// refused (an invite, a phone's ticket).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NoRandomness;

/// A random URL-safe secret of 32 bytes (invite tokens, tickets). `Err` when the OS random
/// source fails: never a constant or a partly random value in its place.
pub fn random_token() -> Result<String, NoRandomness> {
    token_from(|bytes| getrandom::fill(bytes).map_err(|_| NoRandomness))
}

/// [`random_token`] over the given source, logged (throttled) when it fails.
fn token_from(
    fill: impl FnOnce(&mut [u8]) -> Result<(), NoRandomness>,
) -> Result<String, NoRandomness> {
    use base64::Engine;
    static FAILURES: std::sync::OnceLock<crate::logging::SharedThrottle> =
        std::sync::OnceLock::new();
    let mut bytes = [0u8; 32];
    match fill(&mut bytes) {
        Ok(()) => Ok(base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(bytes)),
        Err(error) => {
            let throttle = FAILURES.get_or_init(crate::logging::SharedThrottle::new);
            if let Some(note) = throttle.failure(crate::clock::system().now_ms()) {
                log::error!("orca_relay_random_failed refused=token{note}");
            }
            Err(error)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::ManualClock;

    struct FakePeer(u64);
    impl Peer for FakePeer {
        type Attached = Arc<FakePeer>;
        fn id(&self) -> u64 {
            self.0
        }
    }

    fn control(host: &str, epoch: i64, id: u64) -> Control<FakePeer> {
        Control {
            socket: Arc::new(FakePeer(id)),
            user_id: "u1".into(),
            relay_host_id: host.into(),
            epoch,
            generation: 0,
            admitted_via: AdmitPath::Database,
            lease_id: None,
        }
    }

    #[test]
    fn a_second_hello_takes_the_next_generation_and_returns_the_old_control() {
        let state = CellState::new(ManualClock::starting_at(0));
        let first = state.seat(control("h", 1, 1));
        assert_eq!(first.generation, 1);
        assert!(first.replaced.is_none());
        let second = state.seat(control("h", 1, 2));
        assert_eq!(second.generation, 2);
        assert_eq!(second.replaced.map(|c| c.socket.id()), Some(1));
        assert!(
            state.unseat("h", 1).is_none(),
            "the replaced control does not unseat the new one"
        );
        assert!(state.control("h").is_some());
    }

    #[test]
    fn memory_admits_the_same_epoch_within_the_window_only() {
        let clock = ManualClock::starting_at(0);
        let state = CellState::new(clock.clone());
        let seated = state.seat(control("h", 4, 1));
        assert!(state.seated_here_at("u1", "h", 4, 600_000));
        assert!(!state.seated_here_at("u1", "h", 5, 600_000));
        assert!(!state.seated_here_at("u2", "h", 4, 600_000));
        state.unseat("h", seated.generation);
        clock.advance(600_000);
        assert!(state.seated_here_at("u1", "h", 4, 600_000));
        clock.advance(1);
        assert!(!state.seated_here_at("u1", "h", 4, 600_000));
    }

    #[test]
    fn a_demoted_seat_is_not_admitted_from_memory() {
        let state = CellState::new(ManualClock::starting_at(0));
        let seated = state.seat(control("h", 4, 1));
        state.unseat("h", seated.generation);
        state.demote("h");
        assert!(!state.seated_here_at("u1", "h", 4, 600_000));
    }

    #[test]
    fn slots_are_returned_exactly_once() {
        let slots = ConnectionSlots::new(2);
        let a = slots.try_take().unwrap();
        let _b = slots.try_take().unwrap();
        assert!(slots.try_take().is_none());
        drop(a);
        assert_eq!(slots.used(), 1);
        assert!(slots.try_take().is_some());
    }

    #[test]
    fn tokens_are_random_and_url_safe() {
        let a = random_token().unwrap();
        assert_eq!(a.len(), 43);
        assert_ne!(a, random_token().unwrap());
        assert!(a
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_'));
    }

    #[test]
    fn a_failing_random_source_mints_nothing() {
        // The source fails after writing part of the buffer: no token at all, not a weak one.
        let failing = |bytes: &mut [u8]| {
            bytes[..4].copy_from_slice(&[1, 2, 3, 4]);
            Err(NoRandomness)
        };
        assert_eq!(token_from(failing), Err(NoRandomness));
        assert!(token_from(|_| Ok(())).is_ok());
    }

    fn seated(state: &CellState<FakePeer>, host: &str) -> u64 {
        state.seat(control(host, 1, 1)).generation
    }

    #[test]
    fn invites_are_bounded_per_host_the_oldest_replaced() {
        let state = CellState::new(ManualClock::starting_at(0));
        seated(&state, "h");
        seated(&state, "other");
        state.create_invite("other", "o".into()).unwrap();
        for n in 0..MAX_INVITES_PER_HOST + 3 {
            state.create_invite("h", format!("t{n}")).unwrap();
        }
        assert_eq!(state.invite_count(), MAX_INVITES_PER_HOST + 1);
        let (tx, _rx) = std::sync::mpsc::sync_channel(1);
        let admit = |credential: &str| {
            state
                .admit_phone(
                    "h",
                    credential,
                    Arc::new(FakePeer(9)),
                    "k".into(),
                    tx.clone(),
                )
                .map(|_| ())
        };
        // The three oldest were replaced; the newest admits.
        assert_eq!(admit("t0"), Err(PhoneRefusal::BadCredential));
        assert_eq!(admit("t2"), Err(PhoneRefusal::BadCredential));
        assert!(admit(&format!("t{}", MAX_INVITES_PER_HOST + 2)).is_ok());
        assert_eq!(
            state.create_invite("nobody", "n".into()),
            Err(InviteRefusal::HostOffline)
        );
    }

    #[test]
    fn invites_go_when_the_control_leaves_not_when_it_is_replaced() {
        let state = CellState::new(ManualClock::starting_at(0));
        let first = seated(&state, "h");
        state.create_invite("h", "a".into()).unwrap();
        // A newer control of the same host keeps the host's invites.
        let second = seated(&state, "h");
        assert!(state.unseat("h", first).is_none());
        assert_eq!(state.invite_count(), 1);
        state.unseat("h", second);
        assert_eq!(state.invite_count(), 0);
        assert_eq!(state.expire(600_000), 0, "nothing left to expire");
    }

    #[test]
    fn the_expiry_sweep_touches_only_what_expires() {
        let clock = ManualClock::starting_at(0);
        let state = CellState::new(clock.clone());
        for host in 0..100 {
            seated(&state, &format!("h{host}"));
        }
        state.create_invite("h0", "early".into()).unwrap();
        clock.advance(1_000);
        for host in 0..100 {
            for n in 0..MAX_INVITES_PER_HOST - 1 {
                state
                    .create_invite(&format!("h{host}"), format!("{host}-{n}"))
                    .unwrap();
            }
        }
        let outstanding = state.invite_count();
        assert_eq!(outstanding, 100 * (MAX_INVITES_PER_HOST - 1) + 1);
        clock.advance(INVITE_TTL_MS - 1_000);
        assert_eq!(state.expire(600_000), 1, "only the early invite is due");
        assert_eq!(state.invite_count(), outstanding - 1);
        clock.advance(1_000);
        assert_eq!(state.expire(600_000), outstanding - 1);
        assert_eq!(state.invite_count(), 0);
    }
}
