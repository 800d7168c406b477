//! `cargo bench --bench handover`: a live handover (`orca-relay handover`, SPEC §12) of a
//! combined relay holding 100, 1,000 and 5,000 desktop controls, 10 % of them with a phone
//! session streaming both ways (sequence-checked messages of 1 B to 256 KiB, 5 a second each
//! way), three handovers each; the table gives the medians of:
//!
//! - **stream pause**: the longest time any stream went without a message across the
//!   handover, as the load's clients saw it (from just before `orca-relay handover` to 2 s
//!   after it returned), next to the same figure over a window without a handover (the load's
//!   own rhythm: a message every 200 ms, on a shared machine);
//! - **streams held**: how long the running process held the streams (its splice workers parked
//!   until the commit: the command's `streams paused` figure);
//! - **handover**: from `begin` to the commit, as the running process measured it, and the
//!   command's whole run (starting the next process included).
//!
//! The release build of the binary under test; the load runs in a process of its own (this
//! bench started again with `ORCA_RELAY_LOAD_HELPER`), so the stalls it sees are the relay's.
//! Every run also checks that nothing was closed, lost or reordered.
//!
//! Then the edges of issue 31, each on this build and on a **baseline** built from another
//! revision (`main` unless `--baseline-rev REV`, or an existing binary with `--baseline PATH`;
//! built once into `target/handover-baseline/<commit>/`):
//!
//! - **slow reader**: a desktop whose control reads nothing through a 4 KiB receive buffer has
//!   its relay thread blocked writing a pong to it, and a phone's `conn-open` waiting behind
//!   it; one handover: how long it took, what it moved, whether every pong and the `conn-open`
//!   reached the desktop and the pair was spliced;
//! - **backpressured**: 8 pairs whose ends read nothing (about 1.25 MiB of output waiting each
//!   way) beside 20 streaming pairs; one handover: how long it took, how long streams were
//!   held, the streaming pairs' longest pause, the running process's memory before and at its
//!   peak while handing over, whether every byte arrived.
//!
//! Options: `--controls 100,1000,5000` (the sizes), `--runs 3`, `--only sizes|edges`,
//! `--baseline PATH`, `--baseline-rev REV`; `--soak [N]` runs only the issue's soak (2,000
//! controls, 200 streaming pairs, 50 slow desktops, 8 stuck pairs, a newcomer every 20 ms, `N`
//! handovers in a row, 20 by default, then a next process stopped after `ready`) and prints
//! its figures, a table of their medians and worst, and whichever bound they broke; with
//! `--baseline PATH` or `--baseline-rev REV` it runs the same soak on that build first and the
//! table sets the two side by side.

#[path = "../tests/handover_kit/mod.rs"]
mod handover_kit;
#[path = "../tests/harness/mod.rs"]
mod harness;

use std::time::Duration;

use std::path::{Path, PathBuf};

use handover_kit::edges::{self, SoakSpec};
use handover_kit::load::{Identity, Spec};
use handover_kit::remote::RemoteLoad;
use handover_kit::{build_with_note, hand_over};
use harness::{assign, host_id, token, wait_until, Relay};

/// One handover's figures, ms.
#[derive(Debug, Clone, Copy)]
struct Run {
    stream_pause: u64,
    held: u64,
    took: u64,
    command: u64,
}

fn main() {
    if std::env::var_os(handover_kit::remote::HELPER_ENV).is_some() {
        handover_kit::remote::helper_main();
        return;
    }
    let args: Vec<String> = std::env::args().collect();
    let option = |name: &str| {
        args.iter()
            .position(|arg| arg == name)
            .and_then(|at| args.get(at + 1))
            .cloned()
    };
    let sizes: Vec<usize> = option("--controls")
        .unwrap_or_else(|| "100,1000,5000".into())
        .split(',')
        .map(|size| size.trim().parse().expect("--controls: numbers"))
        .collect();
    let runs: usize = option("--runs").map_or(3, |runs| runs.parse().expect("--runs: a number"));
    handover_kit::raise_fd_limit();
    handover_kit::adopt_orphans();
    let baseline_of = |default: Option<&str>| match option("--baseline") {
        Some(path) => Some((PathBuf::from(&path), path)),
        None => {
            let rev = option("--baseline-rev").or(default.map(str::to_string))?;
            baseline_binary(&rev).map(|path| (path, rev))
        }
    };
    if let Some(at) = args.iter().position(|arg| arg == "--soak") {
        let handovers = args.get(at + 1).and_then(|n| n.parse().ok()).unwrap_or(20);
        // The baseline's soak first (its own build every round), when one is asked for.
        let baseline = baseline_of(None).map(|(path, name)| {
            let spec = SoakSpec::issue(handovers, "handover");
            (name, edges::soak(&spec, Some(&path), None))
        });
        let next = build_with_note("soak");
        let figures = edges::soak(&SoakSpec::issue(handovers, "handover"), None, Some(&next));
        println!();
        if let Some((name, baseline)) = &baseline {
            println!("baseline {name}:\n{}", baseline.summary());
            println!("this build:");
        }
        println!("{}", figures.summary());
        soak_table(
            baseline
                .as_ref()
                .map(|(name, figures)| (name.as_str(), figures)),
            &figures,
        );
        if figures.over_bounds.is_empty() {
            println!("every bound of issue 31 held");
        }
        return;
    }
    let only = option("--only");
    if only.as_deref() != Some("sizes") {
        let baseline = baseline_of(Some("main"));
        edge_rows(
            baseline
                .as_ref()
                .map(|(path, name)| (path.as_path(), name.as_str())),
        );
        if only.as_deref() == Some("edges") {
            return;
        }
    }
    let mut table = Vec::new();
    for &controls in &sizes {
        let (baseline, results) = bench(controls, runs);
        table.push((controls, baseline, results));
    }
    println!();
    println!(
        "| controls | streaming pairs | stream pause (no handover) | stream pause | streams held | handover | command |"
    );
    println!("|---:|---:|---:|---:|---:|---:|---:|");
    for (controls, baseline, results) in &table {
        let median = |pick: fn(&Run) -> u64| {
            let mut values: Vec<u64> = results.iter().map(pick).collect();
            values.sort_unstable();
            values[values.len() / 2]
        };
        println!(
            "| {controls} | {} | {baseline} ms | {} ms | {} ms | {} ms | {} ms |",
            controls / 10,
            median(|run| run.stream_pause),
            median(|run| run.held),
            median(|run| run.took),
            median(|run| run.command),
        );
    }
    println!();
    println!(
        "medians of {runs}; every run: {}",
        table
            .iter()
            .map(|(controls, _, results)| format!("{controls}: {results:?}"))
            .collect::<Vec<_>>()
            .join("; ")
    );
}

/// `controls` desktops placed on the relay's in-process director.
fn place(relay: &Relay, controls: usize) -> Vec<Identity> {
    (0..controls)
        .map(|_| {
            let relay_host_id = host_id();
            let user_id = format!("user-{relay_host_id}");
            let token = token(&user_id, &relay_host_id);
            let epoch = assign(relay, &token, &relay_host_id);
            Identity {
                user_id,
                relay_host_id,
                token,
                epoch,
            }
        })
        .collect()
}

/// One size: the baseline pause and `runs` handovers.
fn bench(controls: usize, runs: usize) -> (u64, Vec<Run>) {
    let pairs = controls / 10;
    eprintln!("{controls} controls, {pairs} streaming pairs: setting up");
    let relay = Relay::combined(&[
        ("ORCA_RELAY_CONNECTION_CAP", "50000"),
        ("ORCA_RELAY_PENDING_UPGRADES_MAX", "4096"),
        ("ORCA_RELAY_WEDGE_MS", "60000"),
    ]);
    assert!(wait_until(Duration::from_secs(60), || relay
        .get("/ready")
        .0
        == 200));
    let identities = place(&relay, controls);
    let mut load = RemoteLoad::start(
        "handover",
        &relay.ws,
        Spec::new(controls, pairs),
        identities,
    );
    // The other build: the version alternates with each handover.
    let builds = [Some(build_with_note("bench")), None];
    clock_sleep(Duration::from_secs(3));
    // The load's own rhythm over a window as long as a handover's.
    load.mark();
    clock_sleep(Duration::from_secs(4));
    let baseline = load.report().max_stall_ms;
    let mut results = Vec::new();
    let mut previous: Option<handover_kit::Serving> = None;
    let mut logged: Vec<String> = Vec::new();
    for run in 0..runs {
        load.mark();
        let binary = builds[run % 2].as_deref();
        let outcome = hand_over(&relay, binary, &[], &[]);
        assert_eq!(outcome.code, 0, "handover: {outcome:?}");
        clock_sleep(Duration::from_secs(2));
        let report = load.report();
        assert!(report.closed.is_empty(), "closed: {:?}", report.closed);
        assert!(report.violations.is_empty(), "{:?}", report.violations);
        let figure = |after: &str| -> u64 {
            outcome
                .stdout
                .split(after)
                .nth(1)
                .and_then(|rest| rest.split_whitespace().next())
                .and_then(|ms| ms.parse().ok())
                .unwrap_or_else(|| panic!("no {after:?} in {:?}", outcome.stdout))
        };
        let result = Run {
            stream_pause: report.max_stall_ms,
            held: figure("streams paused "),
            took: figure("ms, "),
            command: outcome.took.as_millis() as u64,
        };
        eprintln!("  run {}: {result:?}", run + 1);
        // Where the time went, as both processes logged it.
        for line in relay.log_text().lines().filter(|line| {
            line.contains("orca_relay_handover_committed")
                || line.contains("orca_relay_handover_received")
        }) {
            if !logged.contains(&line.to_string()) {
                eprintln!("    {line}");
                logged.push(line.to_string());
            }
        }
        results.push(result);
        // The process that served before exits by itself; the one that serves now is killed
        // at the end.
        let serving = outcome.new_pid.map(|pid| handover_kit::Serving { pid });
        if let Some(old) = previous.replace(serving.expect("the new pid")) {
            let _ = old.wait_exit(Duration::from_secs(15));
        }
        clock_sleep(Duration::from_secs(1));
    }
    let finished = load.finish(Duration::from_secs(60));
    assert!(finished.closed.is_empty(), "closed: {:?}", finished.closed);
    assert!(finished.violations.is_empty(), "{:?}", finished.violations);
    assert_eq!(finished.messages_received, finished.messages_sent);
    (baseline, results)
}

/// The slow-reader and backpressured rows, for this build and the baseline.
/// The command's line (the figures keep its standard error after it), fit for a table cell.
fn first_line(text: &str) -> String {
    text.lines().next().unwrap_or_default().replace('|', "/")
}

fn edge_rows(baseline: Option<(&Path, &str)>) {
    let mut builds: Vec<(String, Option<&Path>)> = vec![("this build".into(), None)];
    match baseline {
        Some((path, name)) => builds.push((format!("baseline {name}"), Some(path))),
        None => eprintln!("no baseline: the edge rows show this build only"),
    }
    let mut slow = Vec::new();
    let mut backpressured = Vec::new();
    for (name, binary) in &builds {
        eprintln!("{name}: slow reader");
        slow.push((name.clone(), edges::slow_reader(*binary, None)));
        eprintln!("{name}: backpressured");
        backpressured.push((
            name.clone(),
            edges::backpressured(*binary, None, 8, 20, "handover"),
        ));
    }
    println!();
    println!("slow reader: a desktop's relay thread blocked writing to it, a phone's conn-open behind it");
    println!();
    println!("| build | handover | connections moved | everything delivered | outcome |");
    println!("|---|---:|---:|---|---|");
    for (name, figures) in &slow {
        println!(
            "| {name} | {} ms | {} | {} | {} |",
            figures.took_ms,
            figures.moved,
            if figures.delivered { "yes" } else { "no" },
            first_line(figures.failure.as_deref().unwrap_or(figures.line.as_str()))
        );
    }
    println!();
    println!("backpressured: 8 pairs whose ends read nothing (about 1.25 MiB waiting each way), 20 streaming pairs");
    println!();
    println!(
        "| build | handover | streams held | stream pause | running process RSS (before -> peak) | every byte arrived | outcome |"
    );
    println!("|---|---:|---:|---:|---:|---|---|");
    for (name, figures) in &backpressured {
        println!(
            "| {name} | {} ms | {} ms | {} ms | {} -> {} MiB | {} | {} |",
            figures.took_ms,
            figures.paused_ms,
            figures.stream_pause_ms,
            figures.rss_before_kib / 1024,
            figures.rss_peak_kib / 1024,
            if figures.delivered { "yes" } else { "no" },
            first_line(&figures.line)
        );
    }
    println!();
}

/// The release binary of revision `rev` of this repository, built once into
/// `target/handover-baseline/<commit>/` (`git archive`, then `cargo build --release`); `None`
/// (with the reason) when the revision or the build is not to be had.
/// The soak's figures as a table: median and worst of each, against the baseline's in the same
/// run when there is one (the ratio is this build's median over the baseline's).
fn soak_table(baseline: Option<(&str, &edges::SoakFigures)>, figures: &edges::SoakFigures) {
    let stats = |figures: &edges::SoakFigures, pick: Pick| {
        let mut values: Vec<u64> = figures.rounds.iter().map(pick).collect();
        values.sort_unstable();
        let median = values.get(values.len() / 2).copied().unwrap_or(0);
        let worst = values.last().copied().unwrap_or(0);
        let over = values.iter().filter(|v| **v > 250).count();
        (median, worst, over, values.len())
    };
    type Pick = fn(&edges::Round) -> u64;
    let rows: [(&str, Pick); 3] = [
        ("handover (`begin` to commit)", |round| round.took_ms),
        ("stream pause", |round| round.stream_pause_ms),
        ("control pause", |round| round.control_pause_ms),
    ];
    println!();
    match baseline {
        Some((name, _)) => {
            println!("| figure | {name}: median | worst | over 250 ms | this build: median | worst | over 250 ms | median ratio |");
            println!("|---|---:|---:|---:|---:|---:|---:|---:|");
        }
        None => {
            println!("| figure | median | worst | over 250 ms |");
            println!("|---|---:|---:|---:|");
        }
    }
    for (name, pick) in rows {
        let (median, worst, over, rounds) = stats(figures, pick);
        match baseline {
            Some((_, base)) => {
                let (b_median, b_worst, b_over, b_rounds) = stats(base, pick);
                println!(
                    "| {name} | {b_median} ms | {b_worst} ms | {b_over} of {b_rounds} | {median} ms | {worst} ms | {over} of {rounds} | {:.2}x |",
                    median as f64 / b_median.max(1) as f64
                );
            }
            None => println!("| {name} | {median} ms | {worst} ms | {over} of {rounds} |"),
        }
    }
}

fn baseline_binary(rev: &str) -> Option<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let git = |args: &[&str]| {
        std::process::Command::new("git")
            .args(args)
            .current_dir(root)
            .output()
            .ok()
            .filter(|out| out.status.success())
    };
    let Some(commit) = git(&["rev-parse", "--verify", &format!("{rev}^{{commit}}")])
        .map(|out| String::from_utf8_lossy(&out.stdout).trim().to_string())
    else {
        eprintln!("no baseline: revision {rev} is not in this repository");
        return None;
    };
    let dir = root.join("target/handover-baseline").join(&commit);
    let binary = dir.join("target/release/orca-relay");
    if binary.is_file() {
        return Some(binary);
    }
    let source = dir.join("source");
    let _ = std::fs::remove_dir_all(&source);
    std::fs::create_dir_all(&source).ok()?;
    eprintln!(
        "building the baseline {rev} ({commit}) into {}",
        dir.display()
    );
    let archived = std::process::Command::new("sh")
        .arg("-c")
        .arg(format!(
            "git -C '{}' archive --format=tar {commit} | tar -x -C '{}'",
            root.display(),
            source.display()
        ))
        .status()
        .is_ok_and(|status| status.success());
    let built = archived
        && std::process::Command::new(env!("CARGO"))
            .args(["build", "--release", "--bin", "orca-relay"])
            .current_dir(&source)
            .env("CARGO_TARGET_DIR", dir.join("target"))
            .status()
            .is_ok_and(|status| status.success());
    if !built || !binary.is_file() {
        eprintln!("no baseline: building {rev} failed");
        return None;
    }
    Some(binary)
}

fn clock_sleep(duration: Duration) {
    orca_relay::clock::sleep(duration);
}
