//! Long nemesis runs (issue 21): the fleet of `tests/nemesis` under a seeded schedule of
//! overlapping faults for as long as asked, every checker sampling throughout.
//!
//!     cargo bench --bench nemesis -- --minutes 30 [--seed N] [--desktops 12]
//!
//! Needs PostgreSQL's binaries (`scripts/test-postgres.sh start` installs them) and, for the
//! network cut and the slowdown, root. Prints the faults applied per kind, what each checker
//! sampled and the verdict; the history (seed, schedule, every fault and sample) is under
//! `target/tmp/nemesis/`. Exit 1 when a promise broke; the output names the command that
//! replays the run (the same seed and length draw the same schedule).

#[path = "../tests/harness/mod.rs"]
mod harness;
#[path = "../tests/nemesis/mod.rs"]
mod nemesis;

use std::sync::Arc;
use std::time::Duration;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let value = |name: &str| -> Option<String> {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1).cloned())
    };
    let minutes: f64 = value("--minutes").map_or(30.0, |v| v.parse().expect("--minutes: a number"));
    let seed: u64 = value("--seed").map_or_else(
        || orca_relay::clock::system().now_ms() % 1_000_000,
        |v| v.parse().expect("--seed: an integer"),
    );
    let desktops: usize =
        value("--desktops").map_or(12, |v| v.parse().expect("--desktops: an integer"));
    let length = Duration::from_secs_f64(minutes * 60.0);
    eprintln!(
        "nemesis: seed {seed}, {minutes} minutes, {desktops} desktops (history under {})",
        nemesis::history_dir().display()
    );
    let pg = Arc::new(nemesis::postgres::Postgres::start_new());
    let outcome = nemesis::run(
        &pg,
        &nemesis::Settings {
            seed,
            length,
            desktops,
            replay: format!("cargo bench --bench nemesis -- --minutes {minutes} --seed {seed}"),
        },
    );
    println!("{}", outcome.summary());
    println!();
    println!("| fault kind | applied |");
    println!("|---|---:|");
    for (kind, n) in &outcome.applied {
        println!("| {kind} | {n} |");
    }
    println!(
        "| switch-reserve (end of a db flip) | {} |",
        outcome.reserve_writes
    );
    println!(
        "| (skipped: target not in a state to take it) | {} |",
        outcome.skipped
    );
    println!();
    println!("| checker | samples or events judged | violations |");
    println!("|---|---:|---:|");
    for checker in nemesis::history::Checker::ALL {
        let judged = match checker {
            nemesis::history::Checker::FalseTrip => outcome.trips + outcome.helds,
            nemesis::history::Checker::Loss => {
                outcome.clients.streams_completed + outcome.clients.streams_cut_by_design
            }
            _ => outcome.samples.get(checker.as_str()).copied().unwrap_or(0),
        };
        let violations = outcome
            .violations
            .iter()
            .filter(|v| v.checker == checker)
            .count();
        println!(
            "| {} {} | {judged} | {violations} |",
            checker.number(),
            checker.as_str()
        );
    }
    drop(pg);
    if !outcome.passed() {
        std::process::exit(1);
    }
}
