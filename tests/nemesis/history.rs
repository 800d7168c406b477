//! The run's history: its seed, its schedule, every fault as it was applied, every process
//! start and exit, every checker sample that changed something, every violation and the
//! verdict, one line each (`t=<ms since the nemesis's origin> <event> key=value…`), written to a
//! file under `target/` as it happens, so a run that hangs or dies still leaves its record.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// The checkers, numbered as in the issue and docs/OPERATIONS.md.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Checker {
    /// 1: live slot holders never exceed `deadManTripSlots`; no slot outlives a clean exit.
    Bound,
    /// 2: connections per role within `orca-relay budget` of the fleet file.
    Budget,
    /// 3: a cell trips (or is held) only after no director could reach it for its window.
    FalseTrip,
    /// 4: every stream byte-exact unless a fault closed it by design; documented close codes.
    Loss,
    /// 5: after the nemesis stops, the fleet is whole again within the stated time.
    Liveness,
    /// 6: no process died unless the nemesis killed it; no panic in any log.
    Deaths,
}

impl Checker {
    pub const ALL: [Checker; 6] = [
        Checker::Bound,
        Checker::Budget,
        Checker::FalseTrip,
        Checker::Loss,
        Checker::Liveness,
        Checker::Deaths,
    ];

    pub fn number(self) -> u8 {
        self as u8 + 1
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Checker::Bound => "bound",
            Checker::Budget => "budget",
            Checker::FalseTrip => "no-false-trip",
            Checker::Loss => "no-loss",
            Checker::Liveness => "liveness",
            Checker::Deaths => "no-unexpected-death",
        }
    }
}

/// One broken promise.
#[derive(Debug, Clone)]
pub struct Violation {
    pub at_ms: u64,
    pub checker: Checker,
    pub detail: String,
}

pub struct History {
    origin: Instant,
    /// The wall clock (ms since the epoch) at `origin`, to place the processes' own log
    /// timestamps on the history's time line.
    origin_wall_ms: u64,
    pub path: PathBuf,
    file: Mutex<Option<BufWriter<File>>>,
    violations: Mutex<Vec<Violation>>,
    /// Samples taken by each checker (checkers that ran at all).
    samples: [AtomicU64; 6],
    echo: bool,
}

impl History {
    /// A new history file `<dir>/seed-<seed>-<label>.log` (replacing one of the same name).
    pub fn create(dir: &Path, seed: u64, label: &str) -> Arc<History> {
        std::fs::create_dir_all(dir).expect("create the nemesis history directory");
        let path = dir.join(format!("seed-{seed}-{label}.log"));
        let file = File::create(&path)
            .unwrap_or_else(|e| panic!("create the history file {}: {e}", path.display()));
        Arc::new(History {
            origin: orca_relay::clock::instant(),
            origin_wall_ms: orca_relay::clock::system().now_ms(),
            path,
            file: Mutex::new(Some(BufWriter::new(file))),
            violations: Mutex::default(),
            samples: Default::default(),
            echo: std::env::var_os("ORCA_RELAY_NEMESIS_ECHO").is_some(),
        })
    }

    /// Milliseconds since this history began: the time base of every fact of the run.
    pub fn now_ms(&self) -> u64 {
        self.origin.elapsed().as_millis() as u64
    }

    /// When a process logged `line`, on the history's time line: from the line's own timestamp
    /// (`2026-12-01T16:05:28.217Z …`, the process's real wall clock, which the test knob does
    /// not move), so a reader thread that a loaded machine delays does not move the event;
    /// `read_at` when the line has none.
    pub fn logged_at(&self, line: &str, read_at: u64) -> u64 {
        match line.split_whitespace().next().and_then(parse_timestamp_ms) {
            Some(wall_ms) => wall_ms.saturating_sub(self.origin_wall_ms).min(read_at),
            None => read_at,
        }
    }

    /// A header line, without a time.
    pub fn header(&self, text: impl AsRef<str>) {
        self.write(text.as_ref());
    }

    /// One event at the current time.
    pub fn event(&self, text: impl AsRef<str>) {
        self.write(&format!("t={} {}", self.now_ms(), text.as_ref()));
    }

    /// One broken promise: recorded, written at once, and kept for the verdict.
    pub fn violation(&self, checker: Checker, detail: impl Into<String>) {
        let at_ms = self.now_ms();
        let detail = detail.into();
        self.write(&format!(
            "t={at_ms} VIOLATION checker={} ({}) {detail}",
            checker.number(),
            checker.as_str()
        ));
        self.violations.lock().unwrap().push(Violation {
            at_ms,
            checker,
            detail,
        });
    }

    pub fn violations(&self) -> Vec<Violation> {
        self.violations.lock().unwrap().clone()
    }

    /// Counts one sample of `checker` (the verdict says how many each took).
    pub fn sampled(&self, checker: Checker) {
        self.samples[checker as usize].fetch_add(1, Ordering::Relaxed);
    }

    pub fn samples(&self, checker: Checker) -> u64 {
        self.samples[checker as usize].load(Ordering::Relaxed)
    }

    pub fn flush(&self) {
        if let Some(file) = self.file.lock().unwrap().as_mut() {
            let _ = file.flush();
        }
    }

    fn write(&self, line: &str) {
        if self.echo {
            eprintln!("[nemesis] {line}");
        }
        if let Some(file) = self.file.lock().unwrap().as_mut() {
            let _ = writeln!(file, "{line}");
        }
    }
}

impl Drop for History {
    fn drop(&mut self) {
        self.flush();
    }
}

/// `YYYY-MM-DDTHH:MM:SS.mmmZ` as ms since the Unix epoch (UTC).
pub fn parse_timestamp_ms(text: &str) -> Option<u64> {
    let text = text.strip_suffix('Z')?;
    let (date, time) = text.split_once('T')?;
    let mut date = date.splitn(3, '-').map(|p| p.parse::<i64>().ok());
    let (year, month, day) = (date.next()??, date.next()??, date.next()??);
    let (hms, millis) = time.split_once('.').unwrap_or((time, "0"));
    let mut hms = hms.splitn(3, ':').map(|p| p.parse::<i64>().ok());
    let (hour, minute, second) = (hms.next()??, hms.next()??, hms.next()??);
    let millis: i64 = format!("{millis:0<3}").get(..3)?.parse().ok()?;
    // Days from the civil date (Howard Hinnant's algorithm).
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (month + 9) % 12;
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    let ms = ((days * 24 + hour) * 60 + minute) * 60_000 + second * 1_000 + millis;
    u64::try_from(ms).ok()
}
