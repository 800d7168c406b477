//! `cargo bench --bench crash`: crash survival (SPEC §13) at scale, under the real systemd of
//! `tests/systemd_harness` (root). The shipped `orca-relay-cell.service`, unchanged, runs a
//! combined relay (the release binary, SQLite) holding 5,000 desktop controls, 500 of them with
//! a phone session streaming both ways (sequence-checked messages of 1 B to 256 KiB, 5 a second
//! each way); its main process is killed with `kill -9` five times, and the table gives, per
//! kill and then as medians:
//!
//! - **controls kept** and **idle controls kept** (those without a pair), **pairs kept**: the
//!   share of what was open before the kill that is still open after it (a connection the
//!   restart could not resume exactly got 1012, or its end);
//! - **stream pause**: the longest time any kept stream went without a message, from just
//!   before the kill, as the load's clients saw it;
//! - **restarted**: from the kill until systemd has the new main process running (`READY=1`);
//! - **answered again**: from just after the kill until every kept connection was answered
//!   again: each control's WebSocket ping (sent right after the kill) has its pong, and each
//!   kept stream has received a message;
//! - **redials**: desktops and phones whose connection ended, each of which must dial again.
//!
//! The baseline, in the same run on a namespace of its own: the same unit and binary with
//! `ORCA_RELAY_CRASH_STORE=0`, which is what the relay did before the store (main before issue
//! 32): a kill closes every socket and every desktop and phone redials (the load sets all of
//! them up again before the next kill).
//!
//! The load runs in a process of its own (this bench started again with
//! `ORCA_RELAY_LOAD_HELPER`), so the stalls it sees are the relay's. Every kept stream is
//! checked: every message once, in order, byte-exact.
//!
//! Options: `--controls 5000`, `--pairs 500`, `--kills 5`, `--only store` (or `no-store`),
//! `--journal` (after each kill, the unit's journal from the kill on, with times: where the
//! restart's time went).

#[path = "../tests/handover_kit/mod.rs"]
mod handover_kit;
#[path = "../tests/harness/mod.rs"]
mod harness;
#[path = "../tests/systemd_harness/mod.rs"]
mod systemd_harness;

use std::path::{Path, PathBuf};
use std::time::Duration;

use handover_kit::in_netns;
use handover_kit::load::{Identity, Report, Spec};
use handover_kit::remote::RemoteLoad;
use harness::{host_id, token};
use serde_json::json;
use systemd_harness::{package, Namespace};

const UNIT: &str = package::CELL;
const WS: &str = package::WS_ADDR;
const HTTP: &str = package::HTTP_ADDR;

/// One kill's figures.
#[derive(Debug, Clone, Copy, Default)]
struct Kill {
    /// Open before the kill, and still open after it.
    controls: (usize, usize),
    idle: (usize, usize),
    pairs: (usize, usize),
    /// Longest pause of a kept stream, ms (None: no stream kept).
    stream_pause: Option<u64>,
    restarted_ms: u64,
    /// Until every kept connection was answered again, ms (None: none kept).
    answered_ms: Option<u64>,
    /// Desktops (controls) and phones whose connection ended.
    redials: (usize, usize),
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
    let number = |name: &str, default: usize| {
        option(name).map_or(default, |n| {
            n.parse()
                .unwrap_or_else(|_| panic!("{name}: a number, not {n:?}"))
        })
    };
    let controls = number("--controls", 5_000);
    let pairs = number("--pairs", 500);
    let kills = number("--kills", 5);
    let only = option("--only");
    let journal = args.iter().any(|arg| arg == "--journal");
    if let Err(line) = systemd_harness::preflight() {
        eprintln!("{line}");
        std::process::exit(2);
    }
    handover_kit::raise_fd_limit();
    let mut table = Vec::new();
    for (mode, store) in [("store", true), ("no-store", false)] {
        if only.as_deref().is_some_and(|only| only != mode) {
            continue;
        }
        eprintln!("{mode}: {controls} controls, {pairs} streaming pairs, {kills} kills");
        table.push((mode, bench(store, controls, pairs, kills, journal)));
    }
    println!();
    println!("{controls} controls, {pairs} of them with a pair streaming both ways, `kill -9` {kills} times; medians (max):");
    println!();
    println!("| relay | controls kept | idle controls kept | pairs kept | stream pause | restarted | answered again | redials (desktops + phones) |");
    println!("|---|---:|---:|---:|---:|---:|---:|---:|");
    for (mode, runs) in &table {
        let label = if *mode == "store" {
            "crash store (main)"
        } else {
            "`ORCA_RELAY_CRASH_STORE=0` (before issue 32)"
        };
        let share = |pick: fn(&Kill) -> (usize, usize)| {
            let mut values: Vec<f64> = runs
                .iter()
                .map(|run| {
                    let (before, kept) = pick(run);
                    if before == 0 {
                        100.0
                    } else {
                        kept as f64 * 100.0 / before as f64
                    }
                })
                .collect();
            values.sort_by(f64::total_cmp);
            format!("{:.2} % (min {:.2} %)", values[values.len() / 2], values[0])
        };
        let ms = |pick: fn(&Kill) -> Option<u64>| {
            let mut values: Vec<u64> = runs.iter().filter_map(pick).collect();
            values.sort_unstable();
            match values.last() {
                Some(max) => format!("{} ms ({max} ms)", values[values.len() / 2]),
                None => "— (none kept)".into(),
            }
        };
        let redials = |pick: fn(&Kill) -> usize| {
            let mut values: Vec<usize> = runs.iter().map(pick).collect();
            values.sort_unstable();
            (values[values.len() / 2], values[values.len() - 1])
        };
        let (desktops, desktops_max) = redials(|run| run.redials.0);
        let (phones, phones_max) = redials(|run| run.redials.1);
        println!(
            "| {label} | {} | {} | {} | {} | {} | {} | {desktops} + {phones} ({desktops_max} + {phones_max}) |",
            share(|run| run.controls),
            share(|run| run.idle),
            share(|run| run.pairs),
            ms(|run| run.stream_pause),
            ms(|run| Some(run.restarted_ms)),
            ms(|run| run.answered_ms),
        );
    }
    println!();
    for (mode, runs) in &table {
        println!("{mode}, every kill: {runs:?}");
    }
}

/// One relay: `kills` kills of the main process under a load of `controls` controls and `pairs`
/// streaming pairs.
fn bench(store: bool, controls: usize, pairs: usize, kills: usize, journal: bool) -> Vec<Kill> {
    let ns = Namespace::boot("crash-bench");
    install(&ns, store, controls + 2 * pairs);
    ns.systemctl_ok(&["start", UNIT]);
    ns.wait_for_state(UNIT, "active/running", Duration::from_secs(60));
    let netns = PathBuf::from(format!("/proc/{}/ns/net", ns.pid1()));
    let started = orca_relay::clock::instant();
    let identities = place(&netns, controls);
    eprintln!("  placed in {:?}", started.elapsed());
    let spec = || {
        let mut spec = Spec::new(controls, pairs);
        spec.netns = Some(netns.clone());
        spec
    };
    let start_load = || {
        let started = orca_relay::clock::instant();
        let load = RemoteLoad::start("crash", WS, spec(), identities.clone());
        eprintln!("  load set up in {:?}", started.elapsed());
        load
    };
    let mut load = start_load();
    let mut results = Vec::new();
    for kill in 1..=kills {
        orca_relay::clock::sleep(Duration::from_secs(3));
        if store {
            // Everything admitted is kept before the kill (the connections, both listeners,
            // the region).
            let live = live_connections(&netns);
            let stored_all = systemd_harness::wait_until(Duration::from_secs(30), || {
                stored(&ns) == live_connections(&netns) + 3
            });
            assert!(stored_all, "stored {} for {live}", stored(&ns));
        }
        let before = load.report();
        let since = orca_relay::clock::system().now_ms() / 1_000;
        let result = kill_once(&ns, &mut load, &before, controls, pairs);
        eprintln!("  kill {kill}: {result:?}");
        if journal {
            let since = format!("--since=@{since}");
            let lines = ns.run(&["journalctl", "-u", UNIT, "-o", "short-precise", &since]);
            eprintln!("{}", String::from_utf8_lossy(&lines.stdout));
        }
        results.push(result);
        if !store && kill < kills {
            // Every desktop and phone dials again: a load of its own.
            drop(load);
            load = start_load();
        }
    }
    let finished = load.finish(Duration::from_secs(60));
    assert!(finished.violations.is_empty(), "{:?}", finished.violations);
    results
}

/// Kills the main process once; what it cost.
fn kill_once(
    ns: &Namespace,
    load: &mut RemoteLoad,
    before: &Report,
    controls: usize,
    pairs: usize,
) -> Kill {
    let (closed_controls, closed_idle, closed_pairs) = closed(before, pairs);
    let open_before = (
        controls - closed_controls,
        controls - pairs - closed_idle,
        pairs - closed_pairs,
    );
    let pid = ns.main_pid(UNIT);
    load.mark();
    let killed = orca_relay::clock::instant();
    ns.run_ok(&["kill", "-9", &pid.to_string()]);
    load.probe();
    let restarted = systemd_harness::wait_until(Duration::from_secs(30), || {
        let now = ns.main_pid(UNIT);
        now != 0 && now != pid && ns.show(UNIT, "SubState") == "running"
    });
    let restarted_ms = killed.elapsed().as_millis() as u64;
    assert!(restarted, "not restarted:\n{}", ns.journal_text(UNIT));
    // Until every connection open before the kill was answered again or ended.
    let mut report = load.report();
    let settled = systemd_harness::wait_until(Duration::from_secs(30), || {
        report = load.report();
        let (c, _, p) = closed(&report, pairs);
        report.probe_answered >= controls - c && report.probe_streams >= 2 * (pairs - p)
    });
    assert!(settled, "not answered again: {report:?}");
    // The closes of the kill, if any came late (a 1012 after the new process ran).
    orca_relay::clock::sleep(Duration::from_millis(500));
    let report = load.report();
    assert!(report.violations.is_empty(), "{:?}", report.violations);
    let (c, i, p) = closed(&report, pairs);
    let kept = (controls - c, controls - pairs - i, pairs - p);
    let phones = report
        .closed
        .iter()
        .filter(|line| line.starts_with("phone"))
        .count()
        - before
            .closed
            .iter()
            .filter(|line| line.starts_with("phone"))
            .count();
    Kill {
        controls: (open_before.0, kept.0),
        idle: (open_before.1, kept.1),
        pairs: (open_before.2, kept.2),
        stream_pause: (kept.2 > 0).then_some(report.max_stall_ms),
        restarted_ms,
        answered_ms: (kept.0 > 0).then_some(report.probe_last_ms),
        redials: (open_before.0 - kept.0, phones),
    }
}

/// Controls, idle controls (no pair) and pairs (either leg) the load saw closed so far.
fn closed(report: &Report, pairs: usize) -> (usize, usize, usize) {
    let index = |line: &str, prefix: &str| -> Option<usize> {
        line.strip_prefix(prefix)?.split(':').next()?.parse().ok()
    };
    let controls: Vec<usize> = report
        .closed
        .iter()
        .filter_map(|line| index(line, "control "))
        .collect();
    let mut legs: Vec<usize> = report
        .closed
        .iter()
        .filter_map(|line| {
            index(line, "phone leg of pair ").or_else(|| index(line, "data leg of pair "))
        })
        .collect();
    legs.sort_unstable();
    legs.dedup();
    let idle = controls.iter().filter(|&&index| index >= pairs).count();
    (controls.len(), idle, legs.len())
}

/// The user, the binary (the release build, copied where the package installs it), the shipped
/// env file with what an operator of a combined relay fills in, and the shipped unit.
fn install(ns: &Namespace, store: bool, connections: usize) {
    package::install_binary(ns, Path::new(env!("CARGO_BIN_EXE_orca-relay")));
    package::configure_combined(ns);
    // The cap counts every WebSocket connection; the pending upgrades are raised so that the
    // load's set-up (and the baseline's redials) is not refused.
    let cap = (connections + 1_000).to_string();
    ns.set_env_values(
        package::CELL_ENV,
        &[
            ("ORCA_RELAY_CRASH_STORE", if store { "1" } else { "0" }),
            ("ORCA_RELAY_CONNECTION_CAP", &cap),
            ("ORCA_RELAY_PENDING_UPGRADES_MAX", "1024"),
            ("ORCA_RELAY_WEDGE_MS", "60000"),
        ],
    );
}

/// `count` desktops placed by the combined relay's director, from inside the namespace, on a
/// few threads.
fn place(netns: &Path, count: usize) -> Vec<Identity> {
    let threads = 4;
    let chunks: Vec<_> = (0..threads)
        .map(|thread| {
            let netns = netns.to_path_buf();
            let share = count / threads + usize::from(thread < count % threads);
            orca_relay::threads::spawn("bench-place", move || {
                in_netns(Some(&netns), move || {
                    (0..share).map(|_| place_one()).collect::<Vec<_>>()
                })
            })
            .expect("spawn")
        })
        .collect();
    chunks
        .into_iter()
        .flat_map(|chunk| chunk.join().expect("placing desktops"))
        .collect()
}

fn place_one() -> Identity {
    let relay_host_id = host_id();
    let user_id = format!("user-{relay_host_id}");
    let token = token(&user_id, &relay_host_id);
    let mut answer = None;
    systemd_harness::wait_until(Duration::from_secs(30), || {
        answer = ureq::post(&format!("http://{HTTP}/v1/assign"))
            .set("Authorization", &format!("Bearer {token}"))
            .timeout(Duration::from_secs(20))
            .send_string(&json!({"v":1,"relayHostId":relay_host_id}).to_string())
            .ok()
            .and_then(|response| response.into_json::<serde_json::Value>().ok());
        answer.is_some()
    });
    let answer = answer.expect("assign");
    Identity {
        user_id,
        relay_host_id,
        token,
        epoch: answer["assignmentEpoch"].as_i64().unwrap(),
    }
}

/// Stored descriptors in the unit's store.
fn stored(ns: &Namespace) -> usize {
    ns.show(UNIT, "NFileDescriptorStore").parse().unwrap_or(0)
}

/// Open WebSocket connections by the relay's own gauge.
fn live_connections(netns: &Path) -> usize {
    in_netns(Some(netns), || {
        ["control", "phone", "data"]
            .iter()
            .map(|kind| {
                handover_kit::metric(HTTP, &format!("orca_relay_connections{{kind=\"{kind}\"}}"))
                    .unwrap_or(0.0) as usize
            })
            .sum()
    })
}
