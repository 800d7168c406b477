//! The seat log and the seat feed behind `GET /internal/seats` (SPEC §5.4).
//!
//! Owns: the current seats of this cell (who is seated here, at which epoch and control
//! generation, since when), the sequence number of the last change, and a bounded ring of
//! recent changes (`join`, `leave`, `reserve`) so a director that polls often gets only what
//! changed since its cursor.
//! Runs on: the relay threads (join and leave, when a control is seated and unseated), the HTTP
//! workers (reserve, on a booking; and the feed). One mutex, held for map and ring operations
//! only; no I/O under it.
//! Must never: hand out `changes` that do not start right after the caller's cursor. A cursor
//! from another incarnation (the cell restarted), from the future, or older than the ring
//! answers with a `full` snapshot instead, so a director can always resynchronise.
//!
//! A cursor is `<incarnation>:<seq>`: the `incarnation` and `seq` of the feed the director last
//! read. `seq` counts the changes recorded by this incarnation (the first change is 1).

use std::collections::{BTreeMap, VecDeque};
use std::fmt;
use std::sync::{Mutex, MutexGuard};

use crate::carry::cell::{ChangeRecord, FeedSeatRecord, SeatLogRecord};
use serde_json::{json, Value};

/// The ring's default size: at the production poll period (1 s) a cell would need more than
/// 4096 joins, leaves and bookings in one second before a director falls back to a snapshot.
pub const DEFAULT_RING_CAPACITY: usize = 4096;

/// What happened to a seat.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChangeKind {
    /// A control was seated (admitted) here.
    Join,
    /// A control left (its socket ended or was replaced).
    Leave,
    /// A director booked the host here.
    Reserve,
}

impl ChangeKind {
    pub fn as_str(self) -> &'static str {
        match self {
            ChangeKind::Join => "join",
            ChangeKind::Leave => "leave",
            ChangeKind::Reserve => "reserve",
        }
    }
}

/// One change, as recorded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SeatChange {
    pub kind: ChangeKind,
    pub user_id: String,
    pub relay_host_id: String,
    pub epoch: i64,
    /// The control's generation (0 for a reservation, which has no control yet).
    pub generation: u64,
    pub at_ms: u64,
}

/// A seat in a full snapshot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Seat {
    pub user_id: String,
    pub relay_host_id: String,
    pub epoch: i64,
    pub generation: u64,
    pub since_ms: u64,
}

/// A position in this cell's seat log.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cursor {
    pub incarnation: i64,
    pub seq: u64,
}

impl fmt::Display for Cursor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.incarnation, self.seq)
    }
}

/// Parses `<incarnation>:<seq>` (both decimal integers; the incarnation may be negative, the
/// sequence may not). The error is a reason fit for a 400 body.
pub fn parse_cursor(text: &str) -> Result<Cursor, &'static str> {
    let (incarnation, seq) = text
        .split_once(':')
        .ok_or("cursor must be <incarnation>:<seq>")?;
    let digits = incarnation.strip_prefix('-').unwrap_or(incarnation);
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return Err("cursor incarnation must be an integer");
    }
    if seq.is_empty() || !seq.bytes().all(|b| b.is_ascii_digit()) {
        return Err("cursor seq must be a non-negative integer");
    }
    let incarnation = incarnation
        .parse()
        .map_err(|_| "cursor incarnation out of range")?;
    let seq = seq.parse().map_err(|_| "cursor seq out of range")?;
    Ok(Cursor { incarnation, seq })
}

/// What a feed read returns.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Feed {
    pub incarnation: i64,
    /// The sequence number of the last change recorded; the next cursor is
    /// `<incarnation>:<seq>`.
    pub seq: u64,
    /// Seats held now (the `seated` count).
    pub seated: usize,
    pub body: FeedBody,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FeedBody {
    /// Every current seat, ordered by host then user.
    Full(Vec<Seat>),
    /// The changes after the cursor, oldest first.
    Changes(Vec<SeatChange>),
}

/// The parts of the feed's answer that come from outside the seat log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FeedHeader<'a> {
    pub cell_id: &'a str,
    pub admit_mode_raw: &'a str,
    pub admit_mode_effective: &'a str,
    pub draining: bool,
    pub bookings: usize,
    pub connections: u64,
}

impl Feed {
    /// The JSON answer of `GET /internal/seats` (SPEC §5.4).
    pub fn to_json(&self, header: &FeedHeader<'_>) -> Value {
        let mut answer = json!({
            "v": 1,
            "cellId": header.cell_id,
            "incarnation": self.incarnation,
            "seq": self.seq,
            "admitModeRaw": header.admit_mode_raw,
            "admitModeEffective": header.admit_mode_effective,
            "draining": header.draining,
            "counts": {
                "seated": self.seated,
                "bookings": header.bookings,
                "connections": header.connections,
            },
        });
        let (key, list): (&str, Vec<Value>) = match &self.body {
            FeedBody::Full(seats) => (
                "full",
                seats
                    .iter()
                    .map(|seat| {
                        json!({
                            "userId": seat.user_id,
                            "relayHostId": seat.relay_host_id,
                            "epoch": seat.epoch,
                            "generation": seat.generation,
                            "since": seat.since_ms,
                        })
                    })
                    .collect(),
            ),
            FeedBody::Changes(changes) => (
                "changes",
                changes
                    .iter()
                    .map(|change| {
                        json!({
                            "kind": change.kind.as_str(),
                            "userId": change.user_id,
                            "relayHostId": change.relay_host_id,
                            "epoch": change.epoch,
                            "generation": change.generation,
                            "at": change.at_ms,
                        })
                    })
                    .collect(),
            ),
        };
        if let Value::Object(object) = &mut answer {
            object.insert(key.to_string(), Value::Array(list));
        }
        answer
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Current {
    epoch: i64,
    generation: u64,
    since_ms: u64,
}

struct Inner {
    seq: u64,
    /// (relay host id, user id) → the seat. Ordered so snapshots are stable.
    current: BTreeMap<(String, String), Current>,
    /// The last `capacity` changes with their sequence numbers, oldest first.
    ring: VecDeque<(u64, SeatChange)>,
}

/// This incarnation's seat log.
pub struct SeatLog {
    incarnation: i64,
    capacity: usize,
    inner: Mutex<Inner>,
}

impl SeatLog {
    /// A log for this incarnation keeping the last `capacity` changes (at least one).
    pub fn new(incarnation: i64, capacity: usize) -> Self {
        let capacity = capacity.max(1);
        SeatLog {
            incarnation,
            capacity,
            inner: Mutex::new(Inner {
                seq: 0,
                current: BTreeMap::new(),
                ring: VecDeque::with_capacity(capacity.min(DEFAULT_RING_CAPACITY)),
            }),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    pub fn incarnation(&self) -> i64 {
        self.incarnation
    }

    /// Records a change and returns its sequence number.
    ///
    /// A `join` seats the host (replacing any earlier seat of the same user and host); a
    /// `leave` unseats it only if it names the current generation, so the leave of a control
    /// that a newer one replaced does not unseat the newer one; a `reserve` changes no seat.
    pub fn record(&self, change: SeatChange) -> u64 {
        let mut inner = self.lock();
        let key = (change.relay_host_id.clone(), change.user_id.clone());
        match change.kind {
            ChangeKind::Join => {
                inner.current.insert(
                    key,
                    Current {
                        epoch: change.epoch,
                        generation: change.generation,
                        since_ms: change.at_ms,
                    },
                );
            }
            ChangeKind::Leave => {
                if inner
                    .current
                    .get(&key)
                    .is_some_and(|seat| seat.generation == change.generation)
                {
                    inner.current.remove(&key);
                }
            }
            ChangeKind::Reserve => {}
        }
        inner.seq += 1;
        let seq = inner.seq;
        if inner.ring.len() == self.capacity {
            inner.ring.pop_front();
        }
        inner.ring.push_back((seq, change));
        seq
    }

    /// The epoch this user's host is seated at here now, if it is.
    pub fn seated_epoch(&self, user_id: &str, relay_host_id: &str) -> Option<i64> {
        self.lock()
            .current
            .get(&(relay_host_id.to_string(), user_id.to_string()))
            .map(|seat| seat.epoch)
    }

    /// Seats held now.
    pub fn seated(&self) -> usize {
        self.lock().current.len()
    }

    /// The feed after `since`: the changes when the cursor is this incarnation's and the ring
    /// still holds every change after it; otherwise a full snapshot.
    pub fn feed(&self, since: Option<Cursor>) -> Feed {
        let inner = self.lock();
        let changes = since
            .filter(|cursor| cursor.incarnation == self.incarnation)
            .and_then(|cursor| changes_after(&inner, cursor.seq));
        let body = match changes {
            Some(changes) => FeedBody::Changes(changes),
            None => FeedBody::Full(
                inner
                    .current
                    .iter()
                    .map(|((relay_host_id, user_id), seat)| Seat {
                        user_id: user_id.clone(),
                        relay_host_id: relay_host_id.clone(),
                        epoch: seat.epoch,
                        generation: seat.generation,
                        since_ms: seat.since_ms,
                    })
                    .collect(),
            ),
        };
        Feed {
            incarnation: self.incarnation,
            seq: inner.seq,
            seated: inner.current.len(),
            body,
        }
    }
}

impl SeatLog {
    pub fn record_state(&self) -> SeatLogRecord {
        let inner = self.lock();
        SeatLogRecord {
            seq: inner.seq,
            current: inner
                .current
                .iter()
                .map(|((relay_host_id, user_id), seat)| FeedSeatRecord {
                    relay_host_id: relay_host_id.clone(),
                    user_id: user_id.clone(),
                    epoch: seat.epoch,
                    generation: seat.generation,
                    since_ms: seat.since_ms,
                })
                .collect(),
            ring: inner
                .ring
                .iter()
                .map(|(seq, change)| ChangeRecord {
                    seq: *seq,
                    kind: change.kind.as_str().to_string(),
                    user_id: change.user_id.clone(),
                    relay_host_id: change.relay_host_id.clone(),
                    epoch: change.epoch,
                    generation: change.generation,
                    at_ms: change.at_ms,
                })
                .collect(),
        }
    }

    /// Rebuilds the log from a handover's record (the newest `capacity` changes are kept).
    pub fn restore(&self, record: SeatLogRecord) {
        let mut inner = self.lock();
        inner.seq = record.seq;
        inner.current = record
            .current
            .into_iter()
            .map(|seat| {
                (
                    (seat.relay_host_id, seat.user_id),
                    Current {
                        epoch: seat.epoch,
                        generation: seat.generation,
                        since_ms: seat.since_ms,
                    },
                )
            })
            .collect();
        inner.ring.clear();
        let skip = record.ring.len().saturating_sub(self.capacity);
        for change in record.ring.into_iter().skip(skip) {
            let kind = match change.kind.as_str() {
                "join" => ChangeKind::Join,
                "leave" => ChangeKind::Leave,
                _ => ChangeKind::Reserve,
            };
            inner.ring.push_back((
                change.seq,
                SeatChange {
                    kind,
                    user_id: change.user_id,
                    relay_host_id: change.relay_host_id,
                    epoch: change.epoch,
                    generation: change.generation,
                    at_ms: change.at_ms,
                },
            ));
        }
    }
}

/// The changes after `seq`, or `None` when the ring no longer holds all of them (or `seq` is
/// from the future).
fn changes_after(inner: &Inner, seq: u64) -> Option<Vec<SeatChange>> {
    if seq > inner.seq {
        return None;
    }
    // The oldest change the ring can still give; with an empty ring that is the next one.
    let oldest = inner
        .ring
        .front()
        .map(|(oldest, _)| *oldest)
        .unwrap_or(inner.seq + 1);
    if seq + 1 < oldest {
        return None;
    }
    Some(
        inner
            .ring
            .iter()
            .filter(|(change_seq, _)| *change_seq > seq)
            .map(|(_, change)| change.clone())
            .collect(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn change(kind: ChangeKind, host: &str, epoch: i64, generation: u64, at_ms: u64) -> SeatChange {
        SeatChange {
            kind,
            user_id: "u1".into(),
            relay_host_id: host.into(),
            epoch,
            generation,
            at_ms,
        }
    }

    fn changes(feed: &Feed) -> Vec<(ChangeKind, String, u64)> {
        match &feed.body {
            FeedBody::Changes(changes) => changes
                .iter()
                .map(|c| (c.kind, c.relay_host_id.clone(), c.at_ms))
                .collect(),
            FeedBody::Full(_) => panic!("expected changes, got a full snapshot"),
        }
    }

    fn full(feed: &Feed) -> Vec<(String, i64, u64, u64)> {
        match &feed.body {
            FeedBody::Full(seats) => seats
                .iter()
                .map(|s| (s.relay_host_id.clone(), s.epoch, s.generation, s.since_ms))
                .collect(),
            FeedBody::Changes(_) => panic!("expected a full snapshot, got changes"),
        }
    }

    #[test]
    fn cursors_parse_or_name_what_is_wrong() {
        assert_eq!(
            parse_cursor("1700000000000:42"),
            Ok(Cursor {
                incarnation: 1_700_000_000_000,
                seq: 42
            })
        );
        assert_eq!(
            parse_cursor("-3:0"),
            Ok(Cursor {
                incarnation: -3,
                seq: 0
            })
        );
        for bad in [
            "", "12", "a:1", "1:b", ":1", "1:", "1:-1", "+1:2", "1:2:3", "1: 2",
        ] {
            assert!(parse_cursor(bad).is_err(), "{bad:?} parsed");
        }
        assert_eq!(
            parse_cursor("1:99999999999999999999999"),
            Err("cursor seq out of range")
        );
        let cursor = Cursor {
            incarnation: 9,
            seq: 4,
        };
        assert_eq!(parse_cursor(&cursor.to_string()), Ok(cursor));
    }

    #[test]
    fn no_cursor_gives_the_current_seats() {
        let log = SeatLog::new(7, 16);
        log.record(change(ChangeKind::Join, "a", 1, 1, 100));
        log.record(change(ChangeKind::Join, "b", 2, 1, 200));
        log.record(change(ChangeKind::Reserve, "c", 3, 0, 250));
        log.record(change(ChangeKind::Leave, "a", 1, 1, 300));
        let feed = log.feed(None);
        assert_eq!(feed.incarnation, 7);
        assert_eq!(feed.seq, 4);
        assert_eq!(feed.seated, 1);
        assert_eq!(full(&feed), vec![("b".to_string(), 2, 1, 200)]);
    }

    #[test]
    fn a_current_cursor_gets_only_what_changed_after_it() {
        let log = SeatLog::new(7, 16);
        let first = log.feed(None);
        assert_eq!(first.seq, 0);
        assert_eq!(
            changes(&log.feed(Some(Cursor {
                incarnation: 7,
                seq: 0
            }))),
            vec![],
            "an empty log has nothing after 0"
        );
        log.record(change(ChangeKind::Join, "a", 1, 1, 100));
        log.record(change(ChangeKind::Reserve, "b", 2, 0, 150));
        let feed = log.feed(Some(Cursor {
            incarnation: 7,
            seq: 0,
        }));
        assert_eq!(feed.seq, 2);
        assert_eq!(
            changes(&feed),
            vec![
                (ChangeKind::Join, "a".to_string(), 100),
                (ChangeKind::Reserve, "b".to_string(), 150)
            ]
        );
        log.record(change(ChangeKind::Leave, "a", 1, 1, 300));
        let feed = log.feed(Some(Cursor {
            incarnation: 7,
            seq: 2,
        }));
        assert_eq!(
            changes(&feed),
            vec![(ChangeKind::Leave, "a".to_string(), 300)]
        );
        let caught_up = log.feed(Some(Cursor {
            incarnation: 7,
            seq: 3,
        }));
        assert_eq!(changes(&caught_up), vec![]);
    }

    #[test]
    fn another_incarnation_a_future_cursor_or_a_too_old_one_gets_a_snapshot() {
        let log = SeatLog::new(7, 3);
        for (n, host) in ["a", "b", "c", "d", "e"].iter().enumerate() {
            log.record(change(ChangeKind::Join, host, 1, 1, n as u64));
        }
        // The ring holds seq 3, 4, 5: a cursor at 2 still gets everything after it.
        let at = |seq| {
            log.feed(Some(Cursor {
                incarnation: 7,
                seq,
            }))
        };
        assert_eq!(changes(&at(2)).len(), 3);
        assert_eq!(full(&at(1)).len(), 5, "seq 2 fell out of the ring");
        assert_eq!(full(&at(0)).len(), 5);
        assert_eq!(full(&at(6)).len(), 5, "a cursor from the future");
        let other = log.feed(Some(Cursor {
            incarnation: 6,
            seq: 5,
        }));
        assert_eq!(
            full(&other).len(),
            5,
            "a cursor from an earlier incarnation"
        );
    }

    #[test]
    fn the_leave_of_a_replaced_control_does_not_unseat_the_new_one() {
        let log = SeatLog::new(1, 16);
        log.record(change(ChangeKind::Join, "h", 4, 1, 100));
        log.record(change(ChangeKind::Join, "h", 4, 2, 200));
        log.record(change(ChangeKind::Leave, "h", 4, 1, 210));
        assert_eq!(log.seated_epoch("u1", "h"), Some(4));
        assert_eq!(full(&log.feed(None)), vec![("h".to_string(), 4, 2, 200)]);
        log.record(change(ChangeKind::Leave, "h", 4, 2, 300));
        assert_eq!(log.seated_epoch("u1", "h"), None);
        assert_eq!(log.seated(), 0);
    }

    #[test]
    fn seated_epoch_is_per_user_and_host() {
        let log = SeatLog::new(1, 16);
        log.record(change(ChangeKind::Join, "h", 9, 1, 100));
        assert_eq!(log.seated_epoch("u1", "h"), Some(9));
        assert_eq!(log.seated_epoch("u2", "h"), None);
        assert_eq!(log.seated_epoch("u1", "other"), None);
        log.record(change(ChangeKind::Reserve, "x", 3, 0, 100));
        assert_eq!(log.seated_epoch("u1", "x"), None, "a booking is not a seat");
    }

    #[test]
    fn the_json_has_the_spec_shape() {
        let log = SeatLog::new(5, 16);
        log.record(change(ChangeKind::Join, "h", 2, 1, 100));
        let header = FeedHeader {
            cell_id: "c7",
            admit_mode_raw: "reserve",
            admit_mode_effective: "db",
            draining: false,
            bookings: 3,
            connections: 4,
        };
        let snapshot = log.feed(None).to_json(&header);
        assert_eq!(
            snapshot,
            json!({"v":1,"cellId":"c7","incarnation":5,"seq":1,"admitModeRaw":"reserve",
                   "admitModeEffective":"db","draining":false,
                   "counts":{"seated":1,"bookings":3,"connections":4},
                   "full":[{"userId":"u1","relayHostId":"h","epoch":2,"generation":1,"since":100}]})
        );
        let delta = log
            .feed(Some(Cursor {
                incarnation: 5,
                seq: 0,
            }))
            .to_json(&header);
        assert_eq!(
            delta["changes"],
            json!([{"kind":"join","userId":"u1","relayHostId":"h","epoch":2,"generation":1,"at":100}])
        );
        assert!(delta.get("full").is_none());
    }
}
