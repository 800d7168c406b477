//! The long fuzz campaign: every property target of `tests/fuzz` (the parsers of outside bytes)
//! for a time budget each, with fresh seeds, printing cases run and failures per target.
//!
//! Usage:
//!
//! ```text
//! cargo bench --bench fuzz -- --minutes 10                         # every target, 10 min each
//! cargo bench --bench fuzz -- --seconds 30 --target switch_file    # one target
//! cargo bench --bench fuzz -- --minutes 10 --targets a,b --seed 7  # a subset, another seed
//! ```
//!
//! Targets run one after the other (one core). Each seed is a batch of 256 cases; the batches
//! use seeds `seed`, `seed + 1`, … so a failure is reproduced by its seed (printed with the
//! shrunk input). A case that runs longer than 60 s is reported as a hang and ends the run with
//! exit code 2. Exit code 1 when any target failed.

#[path = "../tests/fuzz/mod.rs"]
mod fuzz;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

#[global_allocator]
static ALLOCATOR: fuzz::CountingAlloc = fuzz::CountingAlloc;

const BATCH: u32 = 256;
const HANG: Duration = Duration::from_secs(60);

struct Options {
    per_target: Duration,
    targets: Vec<String>,
    seed: u64,
}

fn options() -> Options {
    let mut options = Options {
        per_target: Duration::from_secs(60),
        targets: Vec::new(),
        seed: 1,
    };
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut i = 0;
    while i < args.len() {
        let value = args.get(i + 1).cloned().unwrap_or_default();
        match args[i].as_str() {
            "--minutes" => {
                options.per_target =
                    Duration::from_secs_f64(value.parse::<f64>().expect("--minutes N") * 60.0)
            }
            "--seconds" => {
                options.per_target =
                    Duration::from_secs_f64(value.parse::<f64>().expect("--seconds N"))
            }
            "--target" | "--targets" => {
                options.targets = value.split(',').map(str::to_string).collect()
            }
            "--seed" => options.seed = value.parse().expect("--seed N"),
            // cargo bench passes --bench; anything else is ignored too.
            _ => {
                i += 1;
                continue;
            }
        }
        i += 2;
    }
    options
}

fn main() {
    let options = options();
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    println!(
        "fuzz campaign: {:.0} s per target, seed {}, load average before: {}",
        options.per_target.as_secs_f64(),
        options.seed,
        load.split_whitespace()
            .take(3)
            .collect::<Vec<_>>()
            .join(" ")
    );
    println!(
        "{:<30} {:>12} {:>9} {:>8} {:>10}",
        "target", "cases", "failures", "seconds", "cases/s"
    );
    let mut failed = false;
    for target in fuzz::TARGETS {
        if !options.targets.is_empty() && !options.targets.iter().any(|t| t == target.name) {
            continue;
        }
        let started = orca_relay::clock::instant();
        let before = fuzz::CASES.load(Ordering::Relaxed);
        let mut failures = Vec::new();
        let mut seed = options.seed;
        // A watchdog that notices a case stuck for HANG (the properties have no timeout).
        let progress = Arc::new(AtomicU64::new(before));
        let done = Arc::new(AtomicBool::new(false));
        let watchdog = {
            let (progress, done, name) = (progress.clone(), done.clone(), target.name);
            orca_relay::threads::spawn("fuzz-watchdog", move || {
                let mut last = (
                    progress.load(Ordering::Relaxed),
                    orca_relay::clock::instant(),
                );
                while !done.load(Ordering::Relaxed) {
                    orca_relay::clock::sleep(Duration::from_millis(500));
                    let now = fuzz::CASES.load(Ordering::Relaxed);
                    if now != last.0 {
                        last = (now, orca_relay::clock::instant());
                    } else if last.1.elapsed() > HANG {
                        println!("{name}: a case has run for over {} s: hang", HANG.as_secs());
                        std::process::exit(2);
                    }
                }
            })
            .expect("watchdog thread")
        };
        while started.elapsed() < options.per_target {
            let mut runner = fuzz::runner(seed, BATCH);
            if let Err(failure) = (target.run)(&mut runner) {
                failures.push((seed, failure));
            }
            seed += 1;
        }
        done.store(true, Ordering::Relaxed);
        let _ = watchdog.join();
        let cases = fuzz::CASES.load(Ordering::Relaxed) - before;
        let seconds = started.elapsed().as_secs_f64();
        println!(
            "{:<30} {:>12} {:>9} {:>8.0} {:>10.0}",
            target.name,
            cases,
            failures.len(),
            seconds,
            cases as f64 / seconds
        );
        for (seed, failure) in failures.iter().take(3) {
            println!("  seed {seed}: {failure}");
        }
        failed |= !failures.is_empty();
    }
    if failed {
        std::process::exit(1);
    }
}
