//! The booking book behind `POST /internal/reserve` (SPEC §5.3 step 1, §5.4).
//!
//! Owns: the live bookings, each holding ONE unit of the connection cap (a [`SlotGuard`]) from
//! the moment it is booked until it is consumed by a hello, expires, or is voided.
//! Runs on: the HTTP workers (reserve), the relay threads (consume at hello time) and the
//! `watchdog` (void on a trip, when the switch leaves `reserve`, and the periodic expiry). One
//! mutex, held only for map operations; no I/O under it.
//! Must never: take a second unit for a booking it already holds, release a unit twice, or
//! keep a unit for a booking past its expiry once anyone looks (every entry point expires
//! first).
//!
//! The decisions are plain functions of (item, context, now); the clock is the caller's.
//! Expiry is lazy (each call drops what has expired) plus [`Bookings::expire`], which the
//! owner of the book should call periodically (the watchdog's one-second tick), so an expired
//! booking never pins a connection unit for longer than that tick when nobody books or dials.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use crate::carry::cell::BookingRecord;
use crate::cell::state::{ConnectionSlots, SlotGuard};

/// The longest booking a director may ask for (SPEC §5.4 `ttlMs` ≤ 30000).
pub const MAX_BOOKING_TTL_MS: u64 = 30_000;

/// One item of a reserve request, already validated by the handler.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReserveItem {
    pub user_id: String,
    pub relay_host_id: String,
    pub epoch: i64,
    pub ttl_ms: u64,
}

/// What the cell's state says about booking right now, read once per request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReserveContext {
    /// The raw mode is `reserve` (held included): bookings are honoured by admission.
    pub reserve_mode_effective: bool,
    pub draining: bool,
    /// The epoch this host is seated at here, if it is seated here now.
    pub seated_epoch: Option<i64>,
}

/// The answer to one reserve item (SPEC §5.4 outcomes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Booked. `refreshed`: the same (user, host, epoch) was already booked; its TTL was
    /// renewed and no second unit was taken.
    Ok {
        refreshed: bool,
    },
    /// No connection unit left.
    Full,
    Draining,
    /// The cell is not in reserve mode.
    Off,
    /// The host is seated here at a newer epoch than the booking's.
    SeatedNewer {
        epoch: i64,
    },
}

impl Outcome {
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Ok { .. } => "ok",
            Outcome::Full => "full",
            Outcome::Draining => "draining",
            Outcome::Off => "off",
            Outcome::SeatedNewer { .. } => "seated-newer",
        }
    }

    pub fn is_ok(self) -> bool {
        matches!(self, Outcome::Ok { .. })
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct Key {
    user_id: String,
    relay_host_id: String,
    epoch: i64,
}

struct Booking {
    expires_at_ms: u64,
    /// Held for as long as the booking lives; dropping the booking returns the unit.
    _unit: SlotGuard,
}

/// The cell's live bookings.
pub struct Bookings {
    slots: Arc<ConnectionSlots>,
    book: Mutex<HashMap<Key, Booking>>,
}

impl Bookings {
    /// A book drawing its units from `slots` (the same cap the acceptor draws from).
    pub fn new(slots: Arc<ConnectionSlots>) -> Self {
        Bookings {
            slots,
            book: Mutex::new(HashMap::new()),
        }
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<Key, Booking>> {
        self.book
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Books one item. Order of refusals: draining, off, seated-newer, then the unit (full).
    /// `ttl_ms` is clamped to [`MAX_BOOKING_TTL_MS`] (the handler refuses larger ones).
    pub fn reserve(&self, item: ReserveItem, context: ReserveContext, now_ms: u64) -> Outcome {
        if context.draining {
            return Outcome::Draining;
        }
        if !context.reserve_mode_effective {
            return Outcome::Off;
        }
        if let Some(seated) = context.seated_epoch.filter(|&seated| seated > item.epoch) {
            return Outcome::SeatedNewer { epoch: seated };
        }
        let expires_at_ms = now_ms.saturating_add(item.ttl_ms.min(MAX_BOOKING_TTL_MS));
        let key = Key {
            user_id: item.user_id,
            relay_host_id: item.relay_host_id,
            epoch: item.epoch,
        };
        let mut book = self.lock();
        // Dropping the expired bookings returns their units first, so a booking at the cap can
        // use a unit that an expired one was still pinning. (Returning a unit is one atomic
        // decrement: fine under the lock.)
        drop_expired(&mut book, now_ms);
        if let Some(booking) = book.get_mut(&key) {
            booking.expires_at_ms = expires_at_ms;
            return Outcome::Ok { refreshed: true };
        }
        match self.slots.try_take() {
            Some(unit) => {
                book.insert(
                    key,
                    Booking {
                        expires_at_ms,
                        _unit: unit,
                    },
                );
                Outcome::Ok { refreshed: false }
            }
            None => Outcome::Full,
        }
    }

    /// A hello for exactly (user, host, epoch): a live booking admits once and is consumed.
    ///
    /// Returns `true` when a booking was consumed. Its unit is released here rather than
    /// handed over, because the relay already holds a unit for the control's socket (taken at
    /// accept); keeping both would count one desktop twice against the cap.
    pub fn consume(&self, user_id: &str, relay_host_id: &str, epoch: i64, now_ms: u64) -> bool {
        let key = Key {
            user_id: user_id.to_string(),
            relay_host_id: relay_host_id.to_string(),
            epoch,
        };
        let mut book = self.lock();
        drop_expired(&mut book, now_ms);
        book.remove(&key).is_some()
    }

    /// Does this user hold a live booking for this host (any epoch)? Known at upgrade time,
    /// before the hello names its epoch: such a hello can be admitted without the database.
    pub fn holds(&self, user_id: &str, relay_host_id: &str, now_ms: u64) -> bool {
        self.lock().iter().any(|(key, booking)| {
            key.user_id == user_id
                && key.relay_host_id == relay_host_id
                && booking.expires_at_ms > now_ms
        })
    }

    /// Drops every booking whose TTL has passed, returning its unit. Returns how many.
    pub fn expire(&self, now_ms: u64) -> usize {
        drop_expired(&mut self.lock(), now_ms)
    }

    /// Drops every booking (a dead-man trip; the switch leaving `reserve`), returning all
    /// units. Returns how many were voided.
    pub fn void_all(&self) -> usize {
        let voided: Vec<Booking> = self.lock().drain().map(|(_, booking)| booking).collect();
        voided.len()
    }

    /// Bookings currently held (each holds one unit), expired-but-not-yet-swept included.
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl Bookings {
    /// The live bookings at `at`, for a handover.
    pub fn record(&self, at: &crate::carry::time::Snapshot) -> Vec<BookingRecord> {
        let mut records: Vec<BookingRecord> = self
            .lock()
            .iter()
            .filter(|(_, booking)| booking.expires_at_ms > at.now_ms)
            .map(|(key, booking)| BookingRecord {
                user_id: key.user_id.clone(),
                relay_host_id: key.relay_host_id.clone(),
                epoch: key.epoch,
                expires_in_ms: at.left_ms(booking.expires_at_ms),
            })
            .collect();
        records.sort_by(|a, b| (&a.relay_host_id, a.epoch).cmp(&(&b.relay_host_id, b.epoch)));
        records
    }

    /// Books what a handover carried, each with a unit of the cap (taken even past it: the
    /// director was told `ok`), for the time it had left.
    pub fn restore(&self, records: Vec<BookingRecord>, carry: &crate::carry::time::Carry) {
        let mut book = self.lock();
        for record in records {
            let expires_at_ms = carry.deadline_ms(record.expires_in_ms);
            if expires_at_ms <= carry.now_ms {
                continue;
            }
            book.insert(
                Key {
                    user_id: record.user_id,
                    relay_host_id: record.relay_host_id,
                    epoch: record.epoch,
                },
                Booking {
                    expires_at_ms,
                    _unit: self.slots.take_forced(),
                },
            );
        }
    }
}

/// Removes the expired bookings (dropping each returns its unit); returns how many.
fn drop_expired(book: &mut HashMap<Key, Booking>, now_ms: u64) -> usize {
    let before = book.len();
    book.retain(|_, booking| booking.expires_at_ms > now_ms);
    before - book.len()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::{Clock, ManualClock};

    fn item(user: &str, host: &str, epoch: i64, ttl_ms: u64) -> ReserveItem {
        ReserveItem {
            user_id: user.into(),
            relay_host_id: host.into(),
            epoch,
            ttl_ms,
        }
    }

    const RESERVE: ReserveContext = ReserveContext {
        reserve_mode_effective: true,
        draining: false,
        seated_epoch: None,
    };

    #[test]
    fn a_booking_holds_one_unit_until_consumed_once() {
        let slots = ConnectionSlots::new(10);
        let bookings = Bookings::new(slots.clone());
        let clock = ManualClock::starting_at(1_000);
        let outcome = bookings.reserve(item("u", "h", 3, 10_000), RESERVE, clock.now_ms());
        assert_eq!(outcome, Outcome::Ok { refreshed: false });
        assert_eq!(slots.used(), 1);
        assert!(
            !bookings.consume("u", "h", 4, clock.now_ms()),
            "other epoch"
        );
        assert!(
            !bookings.consume("u2", "h", 3, clock.now_ms()),
            "other user"
        );
        assert!(
            !bookings.consume("u", "h2", 3, clock.now_ms()),
            "other host"
        );
        assert_eq!(slots.used(), 1);
        assert!(bookings.consume("u", "h", 3, clock.now_ms()));
        assert_eq!(slots.used(), 0, "consuming returns the unit");
        assert!(
            !bookings.consume("u", "h", 3, clock.now_ms()),
            "admits once"
        );
        assert_eq!(slots.used(), 0, "released exactly once");
        assert!(bookings.is_empty());
    }

    #[test]
    fn booking_the_same_triple_twice_refreshes_without_a_second_unit() {
        let slots = ConnectionSlots::new(10);
        let bookings = Bookings::new(slots.clone());
        let clock = ManualClock::starting_at(0);
        bookings.reserve(item("u", "h", 3, 10_000), RESERVE, clock.now_ms());
        clock.advance(8_000);
        let again = bookings.reserve(item("u", "h", 3, 10_000), RESERVE, clock.now_ms());
        assert_eq!(again, Outcome::Ok { refreshed: true });
        assert_eq!(slots.used(), 1);
        assert_eq!(bookings.len(), 1);
        // The first booking would have expired at 10 000; the refresh moved it to 18 000.
        clock.set(17_999);
        assert_eq!(bookings.expire(clock.now_ms()), 0);
        assert_eq!(slots.used(), 1);
        clock.set(18_000);
        assert_eq!(bookings.expire(clock.now_ms()), 1);
        assert_eq!(slots.used(), 0);
        // A different epoch is a different booking with its own unit.
        bookings.reserve(item("u", "h", 3, 10_000), RESERVE, clock.now_ms());
        bookings.reserve(item("u", "h", 4, 10_000), RESERVE, clock.now_ms());
        assert_eq!(slots.used(), 2);
    }

    #[test]
    fn expiry_releases_units_and_an_expired_booking_does_not_admit() {
        let slots = ConnectionSlots::new(10);
        let bookings = Bookings::new(slots.clone());
        let clock = ManualClock::starting_at(0);
        bookings.reserve(item("u", "a", 1, 1_000), RESERVE, clock.now_ms());
        bookings.reserve(item("u", "b", 1, 5_000), RESERVE, clock.now_ms());
        assert_eq!(slots.used(), 2);
        clock.advance(1_000);
        assert!(
            !bookings.consume("u", "a", 1, clock.now_ms()),
            "expired at exactly its TTL"
        );
        assert_eq!(slots.used(), 1, "the expired booking's unit came back");
        assert_eq!(bookings.expire(clock.now_ms()), 0, "not released twice");
        assert_eq!(slots.used(), 1);
        clock.advance(4_000);
        assert_eq!(bookings.expire(clock.now_ms()), 1);
        assert_eq!(slots.used(), 0);
        assert!(bookings.is_empty());
    }

    #[test]
    fn the_ttl_is_clamped_to_thirty_seconds() {
        let slots = ConnectionSlots::new(10);
        let bookings = Bookings::new(slots.clone());
        bookings.reserve(item("u", "h", 1, 3_600_000), RESERVE, 0);
        assert_eq!(bookings.expire(MAX_BOOKING_TTL_MS - 1), 0);
        assert_eq!(bookings.expire(MAX_BOOKING_TTL_MS), 1);
        assert_eq!(slots.used(), 0);
    }

    #[test]
    fn void_all_returns_every_unit_once() {
        let slots = ConnectionSlots::new(10);
        let bookings = Bookings::new(slots.clone());
        for host in ["a", "b", "c"] {
            bookings.reserve(item("u", host, 1, 10_000), RESERVE, 0);
        }
        // A socket's own unit is not the book's to return.
        let _socket = slots.try_take().unwrap();
        assert_eq!(slots.used(), 4);
        assert_eq!(bookings.void_all(), 3);
        assert_eq!(slots.used(), 1);
        assert_eq!(bookings.void_all(), 0);
        assert_eq!(slots.used(), 1);
        assert!(
            !bookings.consume("u", "a", 1, 0),
            "voided bookings do not admit"
        );
    }

    #[test]
    fn each_refusal_takes_no_unit() {
        let slots = ConnectionSlots::new(1);
        let bookings = Bookings::new(slots.clone());
        let draining = ReserveContext {
            draining: true,
            ..RESERVE
        };
        let off = ReserveContext {
            reserve_mode_effective: false,
            ..RESERVE
        };
        let seated_at_7 = ReserveContext {
            seated_epoch: Some(7),
            ..RESERVE
        };
        let cases = [
            (draining, 5, Outcome::Draining),
            (off, 5, Outcome::Off),
            // Draining wins over off: the director should stop booking here at all.
            (
                ReserveContext {
                    draining: true,
                    reserve_mode_effective: false,
                    ..RESERVE
                },
                5,
                Outcome::Draining,
            ),
            (seated_at_7, 5, Outcome::SeatedNewer { epoch: 7 }),
        ];
        for (context, epoch, expected) in cases {
            assert_eq!(
                bookings.reserve(item("u", "h", epoch, 10_000), context, 0),
                expected
            );
            assert_eq!(slots.used(), 0, "{expected:?} took a unit");
        }
        // Seated at the same or an older epoch is not newer: the booking goes through.
        assert!(bookings
            .reserve(item("u", "h", 7, 10_000), seated_at_7, 0)
            .is_ok());
        assert_eq!(slots.used(), 1);
        // The cap is reached: the next distinct booking is full and takes nothing.
        assert_eq!(
            bookings.reserve(item("u", "other", 1, 10_000), RESERVE, 0),
            Outcome::Full
        );
        assert_eq!(slots.used(), 1);
        assert_eq!(bookings.len(), 1);
        // ...but refreshing the booking that holds the unit still works at the cap.
        assert_eq!(
            bookings.reserve(item("u", "h", 7, 10_000), RESERVE, 0),
            Outcome::Ok { refreshed: true }
        );
    }

    #[test]
    fn an_expired_booking_frees_its_unit_for_the_next_booking_at_the_cap() {
        let slots = ConnectionSlots::new(1);
        let bookings = Bookings::new(slots.clone());
        assert!(bookings
            .reserve(item("u", "a", 1, 1_000), RESERVE, 0)
            .is_ok());
        assert_eq!(
            bookings.reserve(item("u", "b", 1, 1_000), RESERVE, 999),
            Outcome::Full
        );
        assert!(bookings
            .reserve(item("u", "b", 1, 1_000), RESERVE, 1_000)
            .is_ok());
        assert_eq!(slots.used(), 1);
        assert_eq!(bookings.len(), 1);
    }

    #[test]
    fn outcome_names_match_the_wire() {
        assert_eq!(Outcome::Ok { refreshed: true }.as_str(), "ok");
        assert_eq!(Outcome::Full.as_str(), "full");
        assert_eq!(Outcome::Draining.as_str(), "draining");
        assert_eq!(Outcome::Off.as_str(), "off");
        assert_eq!(Outcome::SeatedNewer { epoch: 1 }.as_str(), "seated-newer");
    }

    #[test]
    fn holds_sees_a_live_booking_of_any_epoch_for_that_user_and_host() {
        let slots = ConnectionSlots::new(10);
        let bookings = Bookings::new(slots);
        let item = ReserveItem {
            user_id: "u".into(),
            relay_host_id: "h".into(),
            epoch: 4,
            ttl_ms: 1_000,
        };
        let context = ReserveContext {
            reserve_mode_effective: true,
            draining: false,
            seated_epoch: None,
        };
        assert!(bookings.reserve(item, context, 0).is_ok());
        assert!(bookings.holds("u", "h", 999));
        assert!(!bookings.holds("other", "h", 999));
        assert!(!bookings.holds("u", "h", 1_000), "expired");
    }
}
