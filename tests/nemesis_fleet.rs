//! The short nemesis run (issue 21, SPEC §12 "Nemesis"): a real fleet (2 directors, 6 reserve
//! cells with `deadManTripSlots=2`, the nemesis's own PostgreSQL, desktops streaming through
//! phone sessions) under a seeded schedule of overlapping faults, for each seed of a fixed
//! list that together covers every fault kind, with every checker sampling throughout
//! (`tests/nemesis`). A failing seed prints its history file and the command that replays it.
//!
//! Replay one seed, or try others: `ORCA_RELAY_NEMESIS_SEEDS=7,9 cargo test --test
//! nemesis_fleet -- --nocapture` (`ORCA_RELAY_NEMESIS_ECHO=1` echoes the history live). Long
//! runs: `cargo bench --bench nemesis -- --minutes 30 --seed N`.

mod harness;
mod nemesis;

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use nemesis::knowledge::{EndKind, Knowledge, Span, Who};
use nemesis::postgres::Postgres;
use nemesis::rng::Rng;
use nemesis::schedule::{self, FaultKind, Shape};

/// The seeds of the short run. Together they draw every fault kind (the test checks it); each
/// has outages of every director at once, and each is a regression seed (handovers come from a
/// stream of their own, so enabling them kept every seed's other faults; the list draws 8: 22
/// one, 3013 three, 232 two, 26 two):
/// - 22 applies every kind; it found (failing before the fixes) a director that stopped polling
///   its cells while its database was cut off (`src/director/feed_poller.rs`: the cell list now
///   has a thread of its own) and cells refused `409 stale_cell_incarnation` at every start
///   after a clock jump back (`src/cell/incarnation.rs`); it catches a claim without its lock,
///   a watchdog without its pause guard, and (as every seed with a drain does) a drain whose
///   final write comes before the watchdog stops.
/// - 3013 sets c5 (the longest window, 2735 ms) five minutes fast at 6.7 s; in the outage of
///   every director at 28 s, c0 and c1 take the two slots first and c5 claims after them: a
///   claim that judges slot liveness on the cell's clock sees both holders as stale and takes a
///   third slot, and one that stamps rows with the cell's clock leaves a row five minutes ahead
///   (checker 1 either way). It replaces 207, whose fast cell never claimed while others held
///   slots; 22 fails before the same two fixes 207 did. It hands c5 over at 18 s and 26 s: it
///   found that a handover's next process dropped the test clock offset (the fix is in
///   `roles::take_over`; before it, this seed missed the clock mutation).
/// - 232 has the longest cuts and the most drains; it fails before the feed poller's fix.
/// - 26 has six pauses longer than any window, several of them of armed cells: a watchdog
///   without its pause guard holds there at the resume, since the harness resumes a cell with
///   its watchdog's first tick before any other thread reads the polls that queued while it
///   was stopped (`WatchdogFirst` in `fleet.rs`), on an idle machine as on a loaded one; 22
///   catches it too.
const SEEDS: &[u64] = &[22, 3013, 232, 26];
/// How long the nemesis injects faults per seed.
const LENGTH: Duration = Duration::from_secs(40);
const DESKTOPS: usize = 12;

fn seeds() -> (Vec<u64>, bool) {
    match std::env::var("ORCA_RELAY_NEMESIS_SEEDS") {
        Ok(list) if !list.trim().is_empty() => (
            list.split(',')
                .map(|s| {
                    s.trim()
                        .parse()
                        .expect("ORCA_RELAY_NEMESIS_SEEDS: a comma list of integers")
                })
                .collect(),
            false,
        ),
        _ => (SEEDS.to_vec(), true),
    }
}

#[test]
fn the_fleet_keeps_its_promises_under_random_faults() {
    let (seeds, fixed_list) = seeds();
    let pg = Arc::new(Postgres::start_new());
    let available = nemesis::available_kinds(&pg);
    if fixed_list {
        // The fixed list must draw every kind this machine can inject.
        let drawn: BTreeSet<FaultKind> = seeds
            .iter()
            .flat_map(|&seed| {
                schedule::draw(seed, LENGTH.as_millis() as u64, nemesis::SHAPE, &available)
            })
            .map(|fault| fault.kind)
            .collect();
        let missing: Vec<&FaultKind> = available.iter().filter(|k| !drawn.contains(k)).collect();
        assert!(
            missing.is_empty(),
            "the short run's seeds never draw {missing:?}"
        );
    }
    let mut failed = Vec::new();
    for seed in seeds {
        let outcome = nemesis::run(
            &pg,
            &nemesis::Settings {
                seed,
                length: LENGTH,
                desktops: DESKTOPS,
                replay: format!(
                    "ORCA_RELAY_NEMESIS_SEEDS={seed} cargo test --test nemesis_fleet -- --nocapture"
                ),
            },
        );
        eprintln!("{}", outcome.summary());
        if !outcome.passed() {
            failed.push(outcome.summary());
        }
    }
    assert!(failed.is_empty(), "{}", failed.join("\n"));
}

// The harness's pure parts.

const SHAPE: Shape = nemesis::SHAPE;

#[test]
fn the_same_seed_gives_the_same_numbers() {
    let a: Vec<u64> = (0..5).scan(Rng::new(7), |r, _| Some(r.next())).collect();
    let b: Vec<u64> = (0..5).scan(Rng::new(7), |r, _| Some(r.next())).collect();
    assert_eq!(a, b);
    assert_ne!(Rng::derive(7, 1).next(), Rng::derive(7, 2).next());
}

#[test]
fn a_seed_always_draws_the_same_schedule() {
    let a = schedule::draw(42, 60_000, SHAPE, &FaultKind::ALL);
    let b = schedule::draw(42, 60_000, SHAPE, &FaultKind::ALL);
    assert_eq!(a, b);
    assert_ne!(a, schedule::draw(43, 60_000, SHAPE, &FaultKind::ALL));
}

#[test]
fn faults_fit_the_run_and_never_share_a_resource() {
    for seed in 0..50 {
        let faults = schedule::draw(seed, 40_000, SHAPE, &FaultKind::ALL);
        assert!(!faults.is_empty());
        for fault in &faults {
            assert!(fault.at_ms >= schedule::WARMUP_MS);
            assert!(
                fault.at_ms + fault.duration_ms <= 40_000 - schedule::COOLDOWN_MS,
                "{fault}"
            );
        }
        for (i, a) in faults.iter().enumerate() {
            for b in &faults[i + 1..] {
                if schedule::resource(a.kind, a.target) == schedule::resource(b.kind, b.target) {
                    assert!(b.at_ms >= a.at_ms + a.duration_ms, "{a} / {b}");
                }
            }
        }
    }
}

#[test]
fn only_available_kinds_are_drawn() {
    let faults = schedule::draw(7, 120_000, SHAPE, &[FaultKind::CellPause]);
    assert!(faults.iter().all(|f| f.kind == FaultKind::CellPause));
}

#[test]
fn a_director_started_during_an_outage_becomes_able_once_it_has_the_cell_list() {
    let k = Knowledge::new(1, 1, 2);
    k.pg_cut(50);
    k.launched(Who::Director(0), 100);
    k.started(Who::Director(0), 200);
    assert!(k.director_able_spans().is_empty());
    // Healed: able once the database has answered for a reconnect's worth of time...
    k.pg_healed(900);
    let stable = 900 + nemesis::knowledge::LISTING_MS;
    assert_eq!(
        k.director_able_spans(),
        vec![Span {
            from: stable,
            to: None
        }]
    );
    // ...or from its line saying it listed the cells, when that comes first.
    k.director_listed(0, 1_000);
    assert_eq!(
        k.director_able_spans(),
        vec![Span {
            from: 1_000,
            to: None
        }]
    );
    k.ended(Who::Director(0), 2_000, EndKind::Killed);
    assert_eq!(k.last_able_at_or_before(5_000), Some(2_000));
    assert_eq!(k.last_able_at_or_before(1_500), Some(1_500));
    assert_eq!(k.last_able_at_or_before(800), None);
    // A cell is reachable only while it serves (not in its start-up handshake).
    k.launched(Who::Cell(0), 1_000);
    k.started(Who::Cell(0), 1_200);
    assert_eq!(k.last_reachable_at_or_before(0, 1_100), None);
    assert_eq!(k.last_reachable_at_or_before(0, 1_500), Some(1_500));
    assert_eq!(k.last_reachable_at_or_before(0, 9_000), Some(2_000));
}

#[test]
fn the_largest_slot_count_since_a_time_counts_what_was_in_force_then() {
    let k = Knowledge::new(1, 2, 2);
    k.slots_written(0, 1_000, 3);
    k.slots_written(0, 2_000, 2);
    assert_eq!(k.largest_slots_during(500, 900), 2);
    assert_eq!(k.largest_slots_during(500, 1_500), 3);
    assert_eq!(k.largest_slots_during(1_500, 3_000), 3);
    assert_eq!(k.largest_slots_during(2_500, 3_000), 2);
}

#[test]
fn log_timestamps_are_read_as_utc_milliseconds() {
    use nemesis::history::parse_timestamp_ms;
    assert_eq!(parse_timestamp_ms("1970-01-01T00:00:00.000Z"), Some(0));
    assert_eq!(
        parse_timestamp_ms("2026-12-01T16:05:28.217Z"),
        Some(1_796_141_128_217)
    );
    assert_eq!(
        parse_timestamp_ms("2000-02-29T23:59:59.5Z"),
        Some(951_868_799_500)
    );
    assert_eq!(parse_timestamp_ms("INFO"), None);
}
