//! The live handover at its edges (issue 31, points 3 and 4): a slow or hung peer costs
//! nobody, costs do not grow with the cell, bytes travel as bytes. The scenarios are
//! `handover_kit::edges` (the bench runs them too, on this build and on a baseline).
//!
//! The soak is the issue's figure, on the real binary (combined role, SQLite): 2,000 controls
//! answering pings, 200 pairs streaming both ways, 50 desktops reading slowly (a 4 KiB receive
//! buffer, 4 KiB a second, pinging faster than they read), 8 pairs whose ends read nothing, a
//! new desktop every 20 ms (placed by `/v1/assign`, then its control), and `/ready` and
//! `/health` polled every 50 ms; handovers in a row, each committed within 1 s, no stream and
//! no control paused more than 250 ms, no newcomer refused or kept waiting, nothing lost, the
//! serving process not growing, the cap after each handover a fresh start's; then a next
//! process that stops itself (`SIGSTOP`) right after saying `ready`: abandoned within 3 s with
//! no control paused. The suite runs [`SUITE_HANDOVERS`] handovers; `cargo bench --bench
//! handover -- --soak` runs the issue's twenty (release build) and prints the figures.
//!
//! The focused tests each hold one edge: a desktop that reads slowly (a relay thread blocked
//! in a write to it when the handover begins, and a phone's `conn-open` begun into its full
//! socket during the quiesce), carried connections counted once in the next process's
//! capacity, backpressured output moved without growing the running process or the pause.

mod handover_kit;
mod harness;

use std::time::Duration;

use handover_kit::edges::{self, SoakSpec};
use handover_kit::load::{Load, Spec};
use handover_kit::{build_with_note, hand_over_with, Serving};

/// Handovers in a row in the suite's soak (the bench's `--soak` runs the issue's twenty).
const SUITE_HANDOVERS: usize = 5;

/// The suite runs an unoptimized build, whose handover does its CPU work (the records written
/// and read as JSON above all) about three times slower than the release build the bench runs:
/// the streams' and controls' pauses are held to four times the issue's 250 ms there, and the
/// handover to twice its 1 s (the stopped next process and everything else to the issue's own
/// figures). Waiting on a peer costs seconds (2 s of silence abandons one), and fails either
/// way; the release figures are the bench's (`cargo bench --bench handover -- --soak`,
/// docs/BENCHMARKS.md). A CI run on a busy machine had one round at twice the others' times
/// (a 1,142 ms handover, a 1,220 ms control pause); since the pause was halved the suite's
/// rounds take 270–430 ms, their controls paused 220–430 ms.
const PAUSE_ALLOWANCE: u64 = if cfg!(debug_assertions) { 4 } else { 1 };
const TOOK_ALLOWANCE: u64 = if cfg!(debug_assertions) { 2 } else { 1 };

/// The tests of this binary each take the machine's two cores for their relay and load: they
/// run one at a time, so the pauses and waits they measure are the relay's, not a neighbour
/// test's (the soak's handover took 919 ms, and a newcomer waited 1,025 ms, beside the
/// backpressured test's load).
fn one_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    static ALONE: std::sync::Mutex<()> = std::sync::Mutex::new(());
    ALONE.lock().unwrap_or_else(|e| e.into_inner())
}

/// The issue's soak, [`SUITE_HANDOVERS`] handovers, then a next process stopped after `ready`.
#[test]
fn under_the_issues_load_handovers_pause_nobody_refuse_nobody_and_grow_nothing() {
    let _alone = one_at_a_time();
    let next = build_with_note("soak");
    let mut spec = SoakSpec::issue(SUITE_HANDOVERS, "load_helper");
    spec.pause_allowance = PAUSE_ALLOWANCE;
    spec.took_allowance = TOOK_ALLOWANCE;
    let figures = edges::soak(&spec, None, Some(&next));
    eprintln!("{}", figures.summary());
    assert!(
        figures.over_bounds.is_empty(),
        "over the issue's bounds:\n{}",
        figures.summary()
    );
}

/// The load's own process (`handover_kit::remote`): nothing unless started as one.
#[test]
fn load_helper() {
    handover_kit::remote::helper_main();
}

/// A desktop whose control reads slowly: the relay's control thread is blocked writing a pong
/// to it (its receive buffer full) and holds the socket's writer, so a phone's `conn-open` to
/// it waits too. A handover begun then commits within a second: the write is interrupted by
/// the quiesce and carried with its unsent bytes (as is every pong the thread answers from the
/// pings it had read, and the phone's `conn-open`), and the next process writes them first.
/// Then the desktop reads: every pong, in order and whole, and the phone's `conn-open`; its
/// data leg completes the pair. (Before: the quiesce waited for the write, and the wedge window
/// ended the desktop: the handover took 8,969 ms and moved no connection.)
#[test]
fn a_desktop_that_reads_slowly_holds_no_handover() {
    let _alone = one_at_a_time();
    let next = build_with_note("slow");
    let figures = edges::slow_reader(None, Some(&next));
    eprintln!("{figures:?}");
    assert_eq!(figures.code, 0, "{figures:?}");
    assert!(figures.pings > 20, "{figures:?}");
    assert!(
        figures.took_ms <= 1_000,
        "the handover took {} ms: {figures:?}",
        figures.took_ms
    );
    assert_eq!(
        figures.moved, 2,
        "the control and its waiting phone: {figures:?}"
    );
    assert!(figures.delivered, "{figures:?}");
}

/// The next process plans its capacity as a fresh start does: the connections it is handed
/// are counted once (in the cap's units), not also as descriptors already in use. With a
/// descriptor limit that binds the cap, 300 carried controls leave the cap and the relay
/// threads where a fresh start has them. (Before: the next process read its descriptors in use
/// with the carried sockets among them and lowered its cap by as many: 833 became 532.)
#[test]
fn carried_connections_count_once_in_the_next_processs_capacity() {
    let _alone = one_at_a_time();
    handover_kit::raise_fd_limit();
    handover_kit::adopt_orphans();
    const NOFILE: u64 = 1_500;
    let relay = edges::start_relay(
        None,
        &[("ORCA_RELAY_CONNECTION_CAP", "100000")],
        Some(NOFILE),
    );
    let fresh_cap = relay.metric("orca_relay_connection_cap").unwrap();
    let fresh_threads = relay
        .metric("orca_relay_relay_threads{state=\"max\"}")
        .unwrap();
    assert!(fresh_cap > 400.0 && fresh_cap < 1_500.0, "cap {fresh_cap}");
    let identities = edges::place(&relay, 300);
    let load = Load::start(&relay.ws, Spec::new(300, 0), identities);
    let outcome = hand_over_with(&relay, None, &[], &[], edges::with_nofile(Some(NOFILE)));
    assert_eq!(outcome.code, 0, "{outcome:?}");
    let _serving = Serving {
        pid: outcome.new_pid.unwrap(),
    };
    assert!(
        outcome.stdout.contains("300 connections"),
        "{}",
        outcome.stdout
    );
    let cap = relay.metric("orca_relay_connection_cap").unwrap();
    let threads = relay
        .metric("orca_relay_relay_threads{state=\"max\"}")
        .unwrap();
    assert_eq!(
        cap, fresh_cap,
        "the cap after the handover is a fresh start's"
    );
    // Maps in use differ by a few between two starts (allocator arenas): within 16 threads,
    // where counting the carried connections again would take 300.
    assert!(
        (threads - fresh_threads).abs() <= 16.0,
        "the relay threads after the handover ({threads}) are a fresh start's ({fresh_threads})"
    );
    let report = load.finish(Duration::from_secs(10));
    assert!(report.closed.is_empty(), "{:?}", report.closed);
}

/// Eight pairs whose two ends read nothing hold about 1.25 MiB of output each way in the
/// relay. A handover moves it as bytes (beside the document, raw, lent by the parked workers
/// rather than copied), not as base64 inside the state document: the running process does not
/// grow while it hands over, the other pairs' streams pause briefly, and every byte arrives
/// once the stuck ends read again. (Before: the handover rolled back, the new process did not
/// confirm within 10 s; the issue measured 8 such pairs taking the running process from 31 to
/// 94 MiB and pausing the streams 126 ms in a release build; at 1,000 such legs the document
/// would exceed its 1 GiB bound and every handover fail.)
#[test]
fn backpressured_output_moves_as_bytes_without_growing_the_running_process() {
    let _alone = one_at_a_time();
    let figures = edges::backpressured(None, None, 8, 20, "load_helper");
    eprintln!("{figures:?}");
    assert_eq!(figures.code, 0, "{figures:?}");
    assert!(
        figures.rss_peak_kib <= figures.rss_before_kib + 16 * 1024,
        "the running process grew while handing over: {figures:?}"
    );
    assert!(figures.paused_ms <= 100, "{figures:?}");
    assert!(figures.delivered, "{figures:?}");
}

/// A next process that stops (`SIGSTOP`) right after saying `ready` is abandoned after 2 s of
/// silence: the running process had not begun its quiesce (it waits for `prepared` first), so
/// no control pauses and every newcomer is admitted meanwhile; it rolls back within 3 s and
/// keeps serving. (Before: the running process quiesced on `ready` and waited its whole 10 s
/// for a confirmation: every control was frozen for 10.5-11.4 s and 82 of 795 new desktops
/// failed.)
#[test]
fn a_next_process_stopped_after_ready_is_abandoned_in_2_s_and_pauses_nobody() {
    let _alone = one_at_a_time();
    handover_kit::raise_fd_limit();
    handover_kit::adopt_orphans();
    let relay = edges::start_relay(None, &[("ORCA_RELAY_PING_MS", "2000")], None);
    let mut spec = Spec::new(60, 10);
    spec.probes = 50;
    let identities = edges::place(&relay, spec.controls);
    let load = Load::start(&relay.ws, spec, identities);
    let newcomers = edges::Newcomers::start(&relay);
    orca_relay::clock::sleep(Duration::from_secs(1));
    load.mark();
    let outcome = hand_over_with(
        &relay,
        None,
        &[],
        &["--test-fault", "stop-after-ready"],
        |_| {},
    );
    assert_eq!(outcome.code, 1, "{outcome:?}");
    assert!(relay.wait_for_log_count("orca_relay_handover_failed", 1, Duration::from_secs(30)));
    let line = relay
        .log_text()
        .lines()
        .rfind(|line| line.contains("orca_relay_handover_failed"))
        .unwrap_or_default()
        .to_string();
    let took_ms = edges::number_after(&line, "took_ms=").unwrap_or(u64::MAX);
    // The load goes on a while after the rollback.
    orca_relay::clock::sleep(Duration::from_secs(1));
    let report = load.report();
    let joined = newcomers.stop();
    eprintln!(
        "{line}\ncontrol pause {} ms, stream gap {} ms, {} newcomers",
        report.max_control_pause_ms,
        report.max_stall_ms,
        joined.len()
    );
    assert!(line.contains("said nothing for 2 s"), "{line}");
    assert!(line.contains("paused_ms=0"), "nothing paused: {line}");
    assert!(took_ms <= 3_000, "rolled back after {took_ms} ms: {line}");
    assert!(
        report.max_control_pause_ms <= edges::PAUSE_BOUND_MS,
        "a control paused {} ms: {report:?}",
        report.max_control_pause_ms
    );
    let troubles = edges::troubled(&joined, 1_000);
    assert!(troubles.is_empty(), "newcomers: {troubles:?}");
    assert!(joined.len() > 50, "{} newcomers", joined.len());
    let finished = load.finish(Duration::from_secs(30));
    assert!(finished.closed.is_empty(), "{:?}", finished.closed);
    assert_eq!(finished.messages_received, finished.messages_sent);
}
