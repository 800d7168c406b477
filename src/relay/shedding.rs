//! Which pending connection the acceptor's full table sheds (issue 30): the pure order over the
//! table's entries, by how far each has got, and the bound on what one source address holds.
//! The acceptor's loop (`relay/pending.rs`) tells it every entry's progress as it changes and
//! asks it for a victim after each newcomer's first read.
//!
//! **The order.** The least progressed entry is shed first: one that has sent nothing, then a
//! partial head, then a control whose valid head waits for the verifier thread, then a leg that
//! got its 101 and waits for its first frame, then a leg whose first frame is arriving; the
//! oldest first within a class. An entry's class is the one it has *now* (the loop updates it as
//! bytes arrive), never the one it had when it was inserted, so a phone that got its 101 is never
//! shed while anything less progressed is in the table, whatever order they came in. A newcomer
//! competes like any entry (after its first read: a client that sent its head with its connect
//! is already upgraded): when it is the least progressed (every other entry has got further, or
//! nothing else in its class is older), the newcomer itself is dropped. nginx and HAProxy never
//! evict a connection that completed its request for one that sent nothing either.
//!
//! **The per-source bound.** One source holds at most `per_source` entries (an IPv4 address; an
//! IPv6 /64, which one host usually owns whole; an IPv4-mapped IPv6 address is its IPv4
//! address). When a newcomer takes its source past the bound, that source's least progressed
//! entry goes (the newcomer itself if it is that), so one host that floods connects sheds its
//! own, and cannot cycle the table and push other sources' connections out.
//!
//! **A newcomer's grace.** A newcomer is read once when it is accepted, and that read can come
//! before the head its client sent right behind the handshake (the accept races the client's
//! first segment). So a newcomer that would be dropped is first *held* (`hold`): counted, beyond
//! the bounds, never a victim, until it has got further or its short grace is over
//! (`release_due`); then it is judged again like a newcomer, and dropped only if it is still the
//! least progressed. At most `max_held` newcomers are held at once; past that the one held
//! longest gives up its place (dropped), so under a flood each still gets the longest grace the
//! room allows.
//!
//! **Pinned.** An entry whose token is on the verifier thread cannot be shed (the thread answers
//! for it): it counts against both bounds but is never a victim. With every entry pinned there
//! is no victim, and the table stays one over its bound until the verdict comes (there is one
//! verifier thread).
//!
//! Never: reads the clock (the caller passes its instants), a socket or anything but its own maps; every operation is a few map
//! updates (O(log n)), so a flood of thousands of connects a second costs the loop nothing that
//! grows with the table.

use std::collections::{BTreeSet, HashMap, VecDeque};
use std::hash::Hash;
use std::net::{IpAddr, Ipv6Addr, SocketAddr};
use std::time::Instant;

/// How far a pending connection has got, least first: the order in which the table sheds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Progress {
    /// Connected, nothing received yet.
    NoBytes,
    /// Part of its upgrade head.
    PartialHead,
    /// A control's whole, valid head whose token waits for the verifier thread.
    Verifying,
    /// A phone or data leg that got its 101 and waits for its first frame.
    Upgraded,
    /// A phone or data leg whose first frame has started to arrive.
    FirstFrame,
}

impl Progress {
    pub const ALL: [Progress; 5] = [
        Progress::NoBytes,
        Progress::PartialHead,
        Progress::Verifying,
        Progress::Upgraded,
        Progress::FirstFrame,
    ];

    /// The `stage` label of `orca_relay_ws_pending_upgrades_shed_total` and the shed log line.
    pub fn label(self) -> &'static str {
        match self {
            Progress::NoBytes => "no_bytes",
            Progress::PartialHead => "partial_head",
            Progress::Verifying => "verifying",
            Progress::Upgraded => "upgraded",
            Progress::FirstFrame => "first_frame",
        }
    }
}

/// The source a connection is counted against: its IPv4 address, or its IPv6 /64.
pub fn source_of(peer: &SocketAddr) -> IpAddr {
    match peer.ip() {
        IpAddr::V4(ip) => IpAddr::V4(ip),
        IpAddr::V6(ip) => match ip.to_ipv4_mapped() {
            Some(ip) => IpAddr::V4(ip),
            None => IpAddr::V6(Ipv6Addr::from(u128::from(ip) & !((1u128 << 64) - 1))),
        },
    }
}

/// Which bound a victim is shed for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Bound {
    /// The whole table (`ORCA_RELAY_PENDING_UPGRADES_MAX`).
    Table,
    /// The newcomer's source (`ORCA_RELAY_PENDING_PER_SOURCE_MAX`).
    Source,
}

/// What [`ShedOrder::hold`] did with a newcomer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Hold {
    /// It is held.
    Held,
    /// It is held in place of the newcomer held longest, whose grace is cut short: the caller
    /// drops that one (`bound`: what it had been held for).
    Replaced { seq: u64, bound: Bound },
    /// Nothing is held (the order keeps no room for held newcomers).
    Refused,
}

/// The entry to shed now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Victim {
    pub seq: u64,
    pub progress: Progress,
    pub bound: Bound,
}

struct Meta<S> {
    progress: Progress,
    source: S,
    /// On the verifier thread: never a victim, for as long as it is in the table.
    pinned: bool,
    /// A newcomer in its grace (see [`ShedOrder::hold`]): not a victim until released.
    held: bool,
}

impl<S> Meta<S> {
    fn sheddable(&self) -> bool {
        !self.pinned && !self.held
    }
}

/// One source's entries.
#[derive(Default)]
struct SourceEntries {
    /// Entries in the table, pinned and held ones too.
    count: usize,
    /// Of those, held in their grace.
    held: usize,
    /// The sheddable ones, least progressed then oldest first.
    order: BTreeSet<(Progress, u64)>,
}

/// The shedding order of the pending table: entries by their accept order (`seq`, unique and
/// rising), their source and their progress.
pub struct ShedOrder<S> {
    bound: usize,
    per_source: usize,
    entries: HashMap<u64, Meta<S>>,
    /// Sheddable entries, least progressed then oldest first.
    order: BTreeSet<(Progress, u64)>,
    sources: HashMap<S, SourceEntries>,
    /// Newcomers in their grace, in the order they were held: (grace over at, seq, progress
    /// when held, the bound they were held for). At most `max_held` of them are held at once
    /// (`held_now`); entries that left or were released are skipped.
    held: VecDeque<(Instant, u64, Progress, Bound)>,
    held_now: usize,
    max_held: usize,
}

impl<S: Hash + Eq + Clone> ShedOrder<S> {
    /// An empty order for a table of `bound` entries, `per_source` of them from one source at
    /// most (both at least 1), with room for `max_held` newcomers in their grace beyond them.
    pub fn new(bound: usize, per_source: usize, max_held: usize) -> ShedOrder<S> {
        ShedOrder {
            bound: bound.max(1),
            per_source: per_source.max(1),
            entries: HashMap::new(),
            order: BTreeSet::new(),
            sources: HashMap::new(),
            held: VecDeque::new(),
            held_now: 0,
            max_held,
        }
    }

    /// Entries in the table, pinned and held ones included.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Entries from `source`.
    pub fn from_source(&self, source: &S) -> usize {
        self.sources.get(source).map_or(0, |entries| entries.count)
    }

    /// A new entry (a newcomer, or a connection a handover carried).
    pub fn insert(&mut self, seq: u64, source: S, progress: Progress) {
        if self.entries.contains_key(&seq) {
            return;
        }
        let entries = self.sources.entry(source.clone()).or_default();
        entries.count += 1;
        entries.order.insert((progress, seq));
        self.order.insert((progress, seq));
        self.entries.insert(
            seq,
            Meta {
                progress,
                source,
                pinned: false,
                held: false,
            },
        );
    }

    /// Takes a sheddable entry out of the order (it stays counted).
    fn unorder(&mut self, seq: u64) {
        let Some(meta) = self.entries.get(&seq) else {
            return;
        };
        let key = (meta.progress, seq);
        self.order.remove(&key);
        if let Some(entries) = self.sources.get_mut(&meta.source) {
            entries.order.remove(&key);
        }
    }

    /// Puts an entry that has become sheddable back in the order.
    fn reorder(&mut self, seq: u64) {
        let Some(meta) = self.entries.get(&seq) else {
            return;
        };
        if !meta.sheddable() {
            return;
        }
        let key = (meta.progress, seq);
        self.order.insert(key);
        if let Some(entries) = self.sources.get_mut(&meta.source) {
            entries.order.insert(key);
        }
    }

    /// The entry's progress now; it takes its place in the order by it.
    pub fn set_progress(&mut self, seq: u64, progress: Progress) {
        let Some(meta) = self.entries.get(&seq) else {
            return;
        };
        if meta.progress == progress {
            return;
        }
        let sheddable = meta.sheddable();
        if sheddable {
            self.unorder(seq);
        }
        if let Some(meta) = self.entries.get_mut(&seq) {
            meta.progress = progress;
        }
        if sheddable {
            self.reorder(seq);
        }
    }

    /// The entry can no longer be shed (its token is on the verifier thread); it still counts.
    pub fn pin(&mut self, seq: u64) {
        if self.entries.get(&seq).is_some_and(Meta::sheddable) {
            self.unorder(seq);
        }
        if let Some(meta) = self.entries.get_mut(&seq) {
            meta.pinned = true;
        }
    }

    /// Gives a newcomer that would be dropped (for `bound`) its grace: its first read may have
    /// come before the rest of what its client sent with the connect (the accept races the
    /// client's first segment), so it is held, counted but not sheddable, until `until` or
    /// until it has got further, whichever is first; then [`ShedOrder::release_due`] hands it
    /// back to be judged as a newcomer once more. With `max_held` newcomers already held, the
    /// one held longest gives up its place (its grace is cut short, the caller drops it): so
    /// under a flood every newcomer still gets the longest grace the room allows.
    pub fn hold(&mut self, seq: u64, until: Instant, bound: Bound) -> Hold {
        if self.max_held == 0 || self.entries.get(&seq).is_none_or(|meta| meta.held) {
            return Hold::Refused;
        }
        let mut replaced = None;
        if self.held_now >= self.max_held {
            while let Some((_, oldest, _, oldest_bound)) = self.held.pop_front() {
                if self.unhold(oldest) {
                    replaced = Some(Hold::Replaced {
                        seq: oldest,
                        bound: oldest_bound,
                    });
                    break;
                }
            }
        }
        let Some(meta) = self.entries.get(&seq) else {
            return Hold::Refused;
        };
        let progress = meta.progress;
        if meta.sheddable() {
            self.unorder(seq);
        }
        if let Some(meta) = self.entries.get_mut(&seq) {
            meta.held = true;
            if let Some(entries) = self.sources.get_mut(&meta.source) {
                entries.held += 1;
            }
        }
        self.held_now += 1;
        self.held.push_back((until, seq, progress, bound));
        replaced.unwrap_or(Hold::Held)
    }

    /// Ends an entry's grace (it is sheddable again); false when it was not held.
    fn unhold(&mut self, seq: u64) -> bool {
        let Some(meta) = self.entries.get_mut(&seq) else {
            return false;
        };
        if !meta.held {
            return false;
        }
        meta.held = false;
        self.held_now -= 1;
        if let Some(entries) = self.sources.get_mut(&meta.source) {
            entries.held -= 1;
        }
        self.reorder(seq);
        true
    }

    /// Ends the grace of the held entries that have got further than they were when held, and
    /// of those whose grace is over at `now`: they are sheddable again, and returned (seq and
    /// source) for the caller to judge each as a newcomer ([`ShedOrder::victim`]), in the order
    /// they were held.
    pub fn release_due(&mut self, now: Instant) -> Vec<(u64, S)> {
        let mut released = Vec::new();
        let mut kept = VecDeque::with_capacity(self.held.len());
        for (until, seq, progress, bound) in std::mem::take(&mut self.held) {
            let Some(meta) = self.entries.get(&seq) else {
                continue;
            };
            if !meta.held {
                continue;
            }
            if until > now && meta.progress == progress {
                kept.push_back((until, seq, progress, bound));
                continue;
            }
            let source = meta.source.clone();
            self.unhold(seq);
            released.push((seq, source));
        }
        self.held = kept;
        released
    }

    /// When the next grace ends, if any entry is held.
    pub fn next_release(&self) -> Option<Instant> {
        self.held.iter().map(|(until, _, _, _)| *until).min()
    }

    /// The entry left the table.
    pub fn remove(&mut self, seq: u64) {
        if self.entries.get(&seq).is_some_and(Meta::sheddable) {
            self.unorder(seq);
        }
        let Some(meta) = self.entries.remove(&seq) else {
            return;
        };
        if meta.held {
            self.held_now -= 1;
        }
        if let Some(entries) = self.sources.get_mut(&meta.source) {
            entries.count -= 1;
            if meta.held {
                entries.held -= 1;
            }
            if entries.count == 0 {
                self.sources.remove(&meta.source);
            }
        }
    }

    /// The entry to shed now that a newcomer from `source` is in (or is judged again after its
    /// grace): the least progressed (oldest first) of that source's sheddable entries when the
    /// source holds more than its bound, else of the whole table's when it holds more than its
    /// bound; `None` when both are within their bounds (or no candidate is sheddable). Held
    /// entries are beyond the bounds by design: only the others are counted against them.
    pub fn victim(&self, source: &S) -> Option<Victim> {
        if let Some(entries) = self.sources.get(source) {
            if entries.count - entries.held > self.per_source {
                if let Some(&(progress, seq)) = entries.order.first() {
                    return Some(Victim {
                        seq,
                        progress,
                        bound: Bound::Source,
                    });
                }
            }
        }
        if self.entries.len() - self.held_now > self.bound {
            if let Some(&(progress, seq)) = self.order.first() {
                return Some(Victim {
                    seq,
                    progress,
                    bound: Bound::Table,
                });
            }
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use Progress::*;

    /// One arrival: (seq, source, progress).
    type Arrival = (u64, u8, Progress);

    /// Fills an order from entries, in their arrival order.
    fn order(bound: usize, per_source: usize, entries: &[Arrival]) -> ShedOrder<u8> {
        let mut order = ShedOrder::new(bound, per_source, 4);
        for &(seq, source, progress) in entries {
            order.insert(seq, source, progress);
        }
        order
    }

    /// What the table sheds when `newcomer` (the last arrival) comes in.
    fn shed(order: &mut ShedOrder<u8>, newcomer: Arrival) -> Option<(u64, Bound)> {
        order.insert(newcomer.0, newcomer.1, newcomer.2);
        let victim = order.victim(&newcomer.1)?;
        order.remove(victim.seq);
        Some((victim.seq, victim.bound))
    }

    #[test]
    fn the_least_progressed_goes_first_and_the_oldest_within_a_class() {
        // (entries in arrival order, the newcomer, what is shed) with a table of 4.
        let cases: [(&[Arrival], Arrival, Option<u64>); 7] = [
            // Room: nothing is shed.
            (&[(1, 1, Upgraded)], (2, 1, NoBytes), None),
            // Oldest first within the class.
            (
                &[
                    (1, 1, NoBytes),
                    (2, 2, NoBytes),
                    (3, 3, NoBytes),
                    (4, 4, NoBytes),
                ],
                (5, 5, NoBytes),
                Some(1),
            ),
            // A partial head outlives a bare connect, whatever their order.
            (
                &[
                    (1, 1, PartialHead),
                    (2, 2, NoBytes),
                    (3, 3, Upgraded),
                    (4, 4, Upgraded),
                ],
                (5, 5, PartialHead),
                Some(2),
            ),
            // Every entry is further on than the bare newcomer: the newcomer is dropped.
            (
                &[
                    (1, 1, Upgraded),
                    (2, 2, FirstFrame),
                    (3, 3, Verifying),
                    (4, 4, PartialHead),
                ],
                (5, 5, NoBytes),
                Some(5),
            ),
            // A newcomer that is already upgraded sheds the partial head.
            (
                &[
                    (1, 1, Upgraded),
                    (2, 2, FirstFrame),
                    (3, 3, Verifying),
                    (4, 4, PartialHead),
                ],
                (5, 5, Upgraded),
                Some(4),
            ),
            // Upgraded legs among themselves: the oldest.
            (
                &[
                    (1, 1, Upgraded),
                    (2, 2, Upgraded),
                    (3, 3, FirstFrame),
                    (4, 4, FirstFrame),
                ],
                (5, 5, Upgraded),
                Some(1),
            ),
            // A verifying control goes before an upgraded leg, after a partial head.
            (
                &[
                    (1, 1, Upgraded),
                    (2, 2, Verifying),
                    (3, 3, Upgraded),
                    (4, 4, FirstFrame),
                ],
                (5, 5, FirstFrame),
                Some(2),
            ),
        ];
        for (entries, newcomer, expected) in cases {
            let mut table = order(4, 4, entries);
            let shed = shed(&mut table, newcomer).map(|(seq, _)| seq);
            assert_eq!(shed, expected, "{entries:?} + {newcomer:?}");
            assert!(table.len() <= 4);
        }
    }

    /// The worst arrival order: every progressed entry came first, then a flood of bare
    /// connects, one after the other; and entries that progress after they were inserted are
    /// ordered by what they are now.
    #[test]
    fn progressed_entries_outlive_any_number_of_bare_connects_whatever_their_arrival() {
        let mut table = ShedOrder::new(16, 16, 4);
        // Twelve phones arrive first (bare at accept), then get their 101.
        for seq in 0..12 {
            table.insert(seq, 1u8, NoBytes);
        }
        for seq in 0..12 {
            table.set_progress(seq, Upgraded);
        }
        let mut shed = Vec::new();
        for seq in 12..10_012 {
            table.insert(seq, 1, NoBytes);
            if let Some(victim) = table.victim(&1) {
                assert_eq!(victim.progress, NoBytes, "seq {seq}");
                table.remove(victim.seq);
                shed.push(victim.seq);
            }
        }
        assert!(shed.iter().all(|&seq| seq >= 12), "a phone was shed");
        assert_eq!(shed.len(), 10_000 - 4);
        // The bare connects were shed oldest first.
        assert!(shed.windows(2).all(|pair| pair[0] < pair[1]));
        for seq in 0..12 {
            assert!(table.entries.contains_key(&seq), "phone {seq} is still in");
        }
        // A phone whose first frame starts arriving stays past an upgraded one.
        table.set_progress(3, FirstFrame);
        let keep: Vec<u64> = (0..12).filter(|&seq| seq != 3).collect();
        for &seq in &keep {
            table.set_progress(seq, Upgraded);
        }
        for seq in 12..10_012 {
            table.remove(seq);
        }
        for seq in 20_000..20_020 {
            table.insert(seq, 1, Upgraded);
            if let Some(victim) = table.victim(&1) {
                table.remove(victim.seq);
            }
        }
        assert!(
            table.entries.contains_key(&3),
            "the arriving first frame was shed"
        );
    }

    #[test]
    fn one_source_sheds_its_own_entries_past_its_bound() {
        // A table of 8, 3 per source. Source 2 holds three bare connects, source 1 floods.
        let mut table = order(8, 3, &[(1, 2, NoBytes), (2, 2, NoBytes), (3, 2, NoBytes)]);
        for seq in 10..1_000 {
            let shed = shed(&mut table, (seq, 1, NoBytes));
            if seq >= 13 {
                // Source 1's oldest goes; source 2's older bare connects stay.
                assert_eq!(shed, Some((seq - 3, Bound::Source)), "seq {seq}");
            } else {
                assert_eq!(shed, None);
            }
        }
        assert_eq!(table.from_source(&2), 3);
        assert_eq!(table.from_source(&1), 3);
        // A source whose entries have all got further drops its own bare newcomer.
        let mut table = order(
            8,
            2,
            &[(1, 1, Upgraded), (2, 1, FirstFrame), (3, 2, NoBytes)],
        );
        assert_eq!(shed(&mut table, (4, 1, NoBytes)), Some((4, Bound::Source)));
        assert_eq!(table.from_source(&1), 2);
        // The table bound still holds across sources: the oldest bare connect anywhere goes.
        let mut table = order(3, 2, &[(1, 1, NoBytes), (2, 2, Upgraded), (3, 3, NoBytes)]);
        assert_eq!(
            shed(&mut table, (4, 4, PartialHead)),
            Some((1, Bound::Table))
        );
    }

    #[test]
    fn a_pinned_entry_counts_but_is_never_shed() {
        let mut table = order(2, 2, &[(1, 1, Verifying)]);
        table.pin(1);
        // A progress change of a pinned entry does not make it sheddable again.
        table.set_progress(1, Verifying);
        assert_eq!(shed(&mut table, (2, 1, Upgraded)), None);
        // Full: the oldest sheddable entry goes, never the pinned one.
        assert_eq!(shed(&mut table, (3, 2, Upgraded)), Some((2, Bound::Table)));
        // A table of one whose entry is pinned: the newcomer goes.
        let mut table = order(1, 1, &[(1, 1, Verifying)]);
        table.pin(1);
        assert_eq!(
            shed(&mut table, (2, 1, FirstFrame)),
            Some((2, Bound::Source))
        );
        table.remove(1);
        assert!(table.is_empty());
        assert_eq!(table.from_source(&1), 0);
    }

    #[test]
    fn a_newcomer_that_would_be_dropped_gets_its_grace_then_is_judged_again() {
        let now = crate::clock::instant();
        let grace = std::time::Duration::from_millis(50);
        // A table of 2 holding two partial heads: a bare newcomer is the least progressed.
        let mut table = order(2, 2, &[(1, 1, PartialHead), (2, 2, PartialHead)]);
        table.insert(3, 3, NoBytes);
        assert_eq!(table.victim(&3).map(|v| v.seq), Some(3));
        assert_eq!(table.hold(3, now + grace, Bound::Table), Hold::Held);
        // Held: beyond the bound, and nobody is shed for it meanwhile.
        assert_eq!(table.victim(&3), None);
        assert_eq!(table.len(), 3);
        assert!(table.release_due(now).is_empty());
        // Its head arrives: released at once and judged again: the oldest partial head goes.
        table.set_progress(3, PartialHead);
        assert_eq!(table.release_due(now), vec![(3, 3)]);
        assert_eq!(table.victim(&3).map(|v| v.seq), Some(1));
        table.remove(1);
        assert_eq!(table.victim(&3), None);
        // A bare newcomer whose grace runs out with nothing received: it is the one dropped.
        table.insert(4, 4, NoBytes);
        assert_eq!(table.hold(4, now + grace, Bound::Table), Hold::Held);
        assert_eq!(table.next_release(), Some(now + grace));
        assert_eq!(table.release_due(now + grace), vec![(4, 4)]);
        assert_eq!(table.victim(&4).map(|v| v.seq), Some(4));
        table.remove(4);
        assert_eq!(table.next_release(), None);
        // The per-source bound counts held entries apart too.
        let mut table = order(8, 1, &[(1, 1, Upgraded)]);
        table.insert(2, 1, NoBytes);
        assert_eq!(
            table.victim(&1).map(|v| (v.seq, v.bound)),
            Some((2, Bound::Source))
        );
        assert_eq!(table.hold(2, now + grace, Bound::Source), Hold::Held);
        assert_eq!(table.victim(&1), None);
        // At most max_held (4) at once: a fifth takes the place of the one held longest (the
        // caller drops it); a held entry that leaves frees its place.
        let mut table = order(1, 1, &[(1, 1, Upgraded)]);
        for seq in 2..6 {
            table.insert(seq, seq as u8, NoBytes);
            assert_eq!(table.hold(seq, now + grace, Bound::Table), Hold::Held);
        }
        table.insert(6, 6, NoBytes);
        assert_eq!(
            table.hold(6, now + grace, Bound::Table),
            Hold::Replaced {
                seq: 2,
                bound: Bound::Table
            }
        );
        table.remove(2);
        table.remove(3);
        table.insert(7, 7, NoBytes);
        assert_eq!(table.hold(7, now + grace, Bound::Table), Hold::Held);
        assert_eq!(table.len(), 5);
        // No room at all: nothing is held.
        let mut table: ShedOrder<u8> = ShedOrder::new(1, 1, 0);
        table.insert(1, 1, NoBytes);
        assert_eq!(table.hold(1, now + grace, Bound::Table), Hold::Refused);
    }

    #[test]
    fn sources_are_ipv4_addresses_and_ipv6_prefixes() {
        let source = |addr: &str| source_of(&addr.parse().unwrap()).to_string();
        assert_eq!(source("203.0.113.7:4000"), "203.0.113.7");
        assert_eq!(source("[2001:db8:1:2:aaaa::1]:4000"), "2001:db8:1:2::");
        assert_eq!(
            source("[2001:db8:1:2:bbbb::9]:4001"),
            source("[2001:db8:1:2::5]:1")
        );
        assert_ne!(source("[2001:db8:1:3::1]:1"), source("[2001:db8:1:2::1]:1"));
        assert_eq!(source("[::ffff:198.51.100.4]:80"), "198.51.100.4");
    }
}
