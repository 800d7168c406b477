//! `orca-relay switch show | set | re-arm`: reads and writes this cell's switch file the way
//! the cell expects it written (docs/OPERATIONS.md), so nobody hand-edits JSON during an
//! incident.
//!
//! - The cell id and the file's path come from the configuration the cell runs with
//!   (`ORCA_RELAY_CELL_ID`, `ORCA_RELAY_SWITCH_FILE` or `$ORCA_RELAY_DATA_DIR/switch.json`).
//! - The current file is read with a bound (a regular file of at most 64 KiB, opened without
//!   blocking) and parsed by the cell's own parser ([`crate::cell::switch::parse`]).
//! - A write takes the next generation: one above both the file's and the generation the
//!   running cell reports as applied (`orca_relay_switch_generation` on its `/metrics`, when it
//!   answers), so the write is applied even if the file was rolled back. Flags the tool does
//!   not know are kept as they were.
//! - The new body is validated with the same parser, then written atomically: a temporary file
//!   in the same directory, `fsync`, `rename` over the old file, `fsync` of the directory. An
//!   exclusive lock on the directory keeps two writers from taking the same generation. The
//!   new file keeps the old one's owner and mode, so a write as root stays readable by the cell.
//! - After a write the tool waits (at most two switch polls) for the running cell to report
//!   the generation applied, and says whether it did.
//!
//! [`plan`] (what to write) is pure and unit-tested; the rest is the file and HTTP shell.

use std::fs::File;
use std::io::{self, Read, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::{Map, Value};

use crate::cell::switch::{self, AdmitMode, Flags, Switch, SwitchError, MAX_TRIP_SLOTS};
use crate::config::Config;
use crate::local_file::LocalFileError;

/// The largest switch file read: the cell's own bound on every local file (64 KiB).
pub const MAX_SWITCH_FILE_BYTES: u64 = crate::local_file::MAX_LOCAL_FILE_BYTES;

/// What the operator asked for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SwitchAction {
    Show,
    /// `set`: the flags given change, the others keep their current values.
    Set {
        admit_mode: Option<AdmitMode>,
        /// `Some(None)`: remove the cap (`--trip-slots none`).
        trip_slots: Option<Option<u32>>,
        generation: Option<u64>,
    },
    /// The same flags at the next generation (re-arms a tripped reserve cell).
    ReArm {
        generation: Option<u64>,
    },
}

impl SwitchAction {
    /// Parses the words after `switch` (`--name value` pairs already split).
    pub fn parse(verb: Option<&str>, flags: &[(String, String)]) -> Result<SwitchAction, String> {
        let allowed: &[&str] = match verb {
            Some("show") => &[],
            Some("set") => &["admit-mode", "trip-slots", "generation"],
            Some("re-arm") => &["generation"],
            _ => return Err("usage: orca-relay switch show|set|re-arm [options]".into()),
        };
        if let Some((name, _)) = flags.iter().find(|(n, _)| !allowed.contains(&n.as_str())) {
            return Err(format!(
                "switch {}: unknown option --{name}",
                verb.unwrap_or("")
            ));
        }
        let value = |name: &str| flags.iter().rev().find(|(n, _)| n == name).map(|(_, v)| v);
        let generation = match value("generation") {
            None => None,
            Some(raw) => match raw.parse::<u64>() {
                Ok(g) if g >= 1 => Some(g),
                _ => return Err(format!("--generation {raw:?}: expected an integer from 1")),
            },
        };
        match verb {
            Some("set") => {
                let admit_mode = match value("admit-mode").map(String::as_str) {
                    None => None,
                    Some("reserve") => Some(AdmitMode::Reserve),
                    Some("db") => Some(AdmitMode::Db),
                    Some(other) => {
                        return Err(format!("--admit-mode {other:?}: expected reserve or db"))
                    }
                };
                let trip_slots = match value("trip-slots").map(String::as_str) {
                    None => None,
                    Some("none") => Some(None),
                    Some(raw) => match raw.parse::<u32>() {
                        Ok(n) if n <= MAX_TRIP_SLOTS => Some(Some(n)),
                        _ => {
                            return Err(format!(
                                "--trip-slots {raw:?}: expected an integer from 0 to {MAX_TRIP_SLOTS}, or none"
                            ))
                        }
                    },
                };
                if admit_mode.is_none() && trip_slots.is_none() {
                    return Err("switch set: give --admit-mode and/or --trip-slots".into());
                }
                Ok(SwitchAction::Set {
                    admit_mode,
                    trip_slots,
                    generation,
                })
            }
            Some("re-arm") => Ok(SwitchAction::ReArm { generation }),
            _ => Ok(SwitchAction::Show),
        }
    }
}

/// The switch file as it is on disk.
#[derive(Debug, Clone, PartialEq)]
pub enum Current {
    /// No file: the cell runs on the defaults.
    Missing,
    /// A valid object; `extra_flags` are the flags this tool does not know, kept on a write.
    Valid {
        switch: Switch,
        extra_flags: Map<String, Value>,
    },
    /// A file the cell ignores (it keeps its last applied values).
    Void(SwitchError),
    /// Something at the path that is not read (a FIFO, a device, a directory, too large,
    /// unreadable): the cell ignores it too. The `cause=… detail=…` the cell logs for it.
    Unreadable(String),
}

/// Reads and parses the current file.
pub fn read_current(path: &Path, cell_id: &str) -> Current {
    let bytes = match crate::local_file::read_bounded(path, MAX_SWITCH_FILE_BYTES) {
        Ok(bytes) => bytes,
        Err(LocalFileError::Missing) => return Current::Missing,
        Err(e) => return Current::Unreadable(format!("cause={} detail={}", e.cause(), e.detail())),
    };
    match switch::parse(&bytes, cell_id) {
        Ok((switch, unknown)) => {
            let flags = serde_json::from_slice::<Value>(&bytes)
                .ok()
                .and_then(|value| value.get("flags").and_then(Value::as_object).cloned())
                .unwrap_or_default();
            let extra_flags = flags
                .into_iter()
                .filter(|(name, _)| unknown.contains(name))
                .collect();
            Current::Valid {
                switch,
                extra_flags,
            }
        }
        Err(e) => Current::Void(e),
    }
}

/// What a write will put in the file.
#[derive(Debug, Clone, PartialEq)]
pub struct Planned {
    pub switch: Switch,
    pub extra_flags: Map<String, Value>,
}

/// Decides the next file from the current one, the generation the running cell reports as
/// applied (if it answered) and the action. Pure.
pub fn plan(
    current: &Current,
    applied: Option<u64>,
    action: &SwitchAction,
) -> Result<Planned, String> {
    let (flags, extra_flags, file_generation) = match (current, action) {
        (_, SwitchAction::Show) => return Err("show writes nothing".into()),
        (Current::Valid { switch, extra_flags }, _) => {
            (switch.flags, extra_flags.clone(), Some(switch.generation))
        }
        (Current::Missing, SwitchAction::ReArm { .. }) => {
            return Err("there is no switch file: nothing to re-arm (use switch set --admit-mode reserve)".into())
        }
        (Current::Missing, _) => (Flags::default(), Map::new(), Some(0)),
        (Current::Void(e), SwitchAction::ReArm { .. }) => {
            return Err(format!(
                "the switch file is void ({}): the cell ignores it, so its flags cannot be re-armed; write new ones with switch set",
                e.cause()
            ))
        }
        (Current::Unreadable(reason), SwitchAction::ReArm { .. }) => {
            return Err(format!(
                "the switch file cannot be read ({reason}): the cell ignores it, so its flags cannot be re-armed; write new ones with switch set"
            ))
        }
        (Current::Void(_) | Current::Unreadable(_), _) => (Flags::default(), Map::new(), None),
    };
    let (new_flags, explicit) = match action {
        SwitchAction::Show => unreachable!("handled above"),
        SwitchAction::ReArm { generation } => {
            if flags.admit_mode != AdmitMode::Reserve {
                return Err("the switch says admitMode db: re-arming applies to reserve cells only (use switch set --admit-mode reserve)".into());
            }
            (flags, *generation)
        }
        SwitchAction::Set {
            admit_mode,
            trip_slots,
            generation,
        } => {
            let mut flags = flags;
            if let Some(mode) = admit_mode {
                flags.admit_mode = *mode;
            }
            if let Some(slots) = trip_slots {
                flags.dead_man_trip_slots = *slots;
            }
            (flags, *generation)
        }
    };
    // The highest generation known to be taken: the file's and the running cell's.
    let taken = match (file_generation, applied) {
        (Some(file), Some(applied)) => Some(file.max(applied)),
        (file, applied) => file.or(applied),
    };
    let generation = match (explicit, taken) {
        (Some(explicit), Some(taken)) if explicit <= taken => {
            return Err(format!(
                "--generation {explicit} is not above generation {taken}, which is already taken"
            ))
        }
        (Some(explicit), _) => explicit,
        (None, Some(taken)) => taken
            .checked_add(1)
            .ok_or("the generation cannot go higher")?,
        (None, None) => {
            return Err("the switch file is void and no running cell reported its applied generation: pass --generation N above the generation the cell last applied (its orca_relay_cell_flags_applied log line)".into())
        }
    };
    Ok(Planned {
        switch: Switch {
            generation,
            flags: new_flags,
        },
        extra_flags,
    })
}

/// The file body of `planned` for `cell_id`, checked with the cell's parser.
pub fn render(cell_id: &str, planned: &Planned) -> Result<Vec<u8>, String> {
    let mut flags = planned.extra_flags.clone();
    flags.insert(
        "admitMode".into(),
        planned.switch.flags.admit_mode.as_str().into(),
    );
    flags.remove("deadManTripSlots");
    if let Some(slots) = planned.switch.flags.dead_man_trip_slots {
        flags.insert("deadManTripSlots".into(), slots.into());
    }
    let body = serde_json::json!({
        "v": 1,
        "cellId": cell_id,
        "generation": planned.switch.generation,
        "flags": Value::Object(flags),
    });
    let mut bytes = serde_json::to_vec_pretty(&body).map_err(|e| e.to_string())?;
    bytes.push(b'\n');
    match switch::parse(&bytes, cell_id) {
        Ok((parsed, _)) if parsed == planned.switch => Ok(bytes),
        Ok(_) => Err("the new switch file does not read back as written".into()),
        Err(e) => Err(format!("the new switch file would be void: {e}")),
    }
}

/// Writes `bytes` to `path` atomically (see the module header).
pub fn write_atomically(path: &Path, bytes: &[u8]) -> Result<(), String> {
    let directory = match path.parent() {
        Some(parent) if !parent.as_os_str().is_empty() => parent.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let name = path
        .file_name()
        .ok_or_else(|| format!("{} names no file", path.display()))?;
    let dir = File::open(&directory)
        .map_err(|e| format!("cannot open the directory {}: {e}", directory.display()))?;
    lock_exclusively(&dir, &directory)?;
    let temporary = directory.join(format!(
        ".{}.tmp-{}",
        name.to_string_lossy(),
        std::process::id()
    ));
    let result = write_and_rename(path, &temporary, bytes, &dir);
    if result.is_err() {
        let _ = std::fs::remove_file(&temporary);
    }
    result
    // The lock goes with `dir`.
}

fn write_and_rename(path: &Path, temporary: &Path, bytes: &[u8], dir: &File) -> Result<(), String> {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let shown = temporary.display();
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(temporary)
        .map_err(|e| format!("cannot create {shown}: {e}"))?;
    file.write_all(bytes)
        .map_err(|e| format!("cannot write {shown}: {e}"))?;
    // Keep the old file's mode and owner, so the cell can still read it.
    if let Ok(old) = std::fs::metadata(path) {
        let _ = file.set_permissions(std::fs::Permissions::from_mode(old.mode() & 0o7777));
        let _ = std::os::unix::fs::fchown(&file, Some(old.uid()), Some(old.gid()));
    }
    file.sync_all()
        .map_err(|e| format!("cannot fsync {shown}: {e}"))?;
    std::fs::rename(temporary, path)
        .map_err(|e| format!("cannot rename {shown} to {}: {e}", path.display()))?;
    dir.sync_all()
        .map_err(|e| format!("cannot fsync the directory of {}: {e}", path.display()))
}

/// An exclusive advisory lock on the directory, waiting at most 2 s for another writer.
fn lock_exclusively(dir: &File, shown: &Path) -> Result<(), String> {
    use std::os::fd::AsRawFd;
    let deadline = crate::clock::instant() + Duration::from_secs(2);
    loop {
        // SAFETY: flock on a descriptor this function borrows; no memory is shared.
        let locked = unsafe { libc::flock(dir.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0;
        if locked {
            return Ok(());
        }
        let error = io::Error::last_os_error();
        match error.kind() {
            io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted
                if crate::clock::instant() < deadline =>
            {
                crate::clock::sleep(Duration::from_millis(20));
            }
            _ => {
                return Err(format!(
                    "cannot lock {} (another switch write in progress?): {error}",
                    shown.display()
                ))
            }
        }
    }
}

/// What the running cell reports on its `/metrics`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CellReport {
    pub applied_generation: u64,
    pub dead_man: Option<String>,
    pub trip_slots: Option<i64>,
}

/// Reads the cell's report from a Prometheus text body.
pub fn parse_report(metrics: &str) -> Option<CellReport> {
    let value = |series: &str| {
        metrics.lines().find_map(|line| {
            line.strip_prefix(series)?
                .strip_prefix(' ')?
                .trim()
                .parse::<f64>()
                .ok()
        })
    };
    let applied_generation = value("orca_relay_switch_generation")? as u64;
    let dead_man = ["off", "armed", "held", "tripped"]
        .into_iter()
        .find(|state| {
            value(&format!("orca_relay_dead_man_state{{state=\"{state}\"}}")) == Some(1.0)
        })
        .map(str::to_string);
    Some(CellReport {
        applied_generation,
        dead_man,
        trip_slots: value("orca_relay_dead_man_trip_slots").map(|v| v as i64),
    })
}

/// `http://<HTTP_ADDR>/metrics`, with an unspecified address replaced by loopback.
fn metrics_url(http_addr: SocketAddr) -> String {
    let ip = match http_addr.ip() {
        IpAddr::V4(ip) if ip.is_unspecified() => IpAddr::V4(Ipv4Addr::LOCALHOST),
        IpAddr::V6(ip) if ip.is_unspecified() => IpAddr::V6(Ipv6Addr::LOCALHOST),
        ip => ip,
    };
    format!("http://{}/metrics", SocketAddr::new(ip, http_addr.port()))
}

/// Asks the running cell (best effort, 2 s).
fn ask_cell(url: &str) -> Option<CellReport> {
    let response = ureq::get(url).timeout(Duration::from_secs(2)).call().ok()?;
    let mut body = String::new();
    response
        .into_reader()
        .take(4 * 1024 * 1024)
        .read_to_string(&mut body)
        .ok()?;
    parse_report(&body)
}

fn describe_current(current: &Current) -> String {
    match current {
        Current::Missing => "missing (the defaults: admitMode db, no trip-slot cap)".into(),
        Current::Valid { switch, .. } => format!(
            "generation {} flags {}",
            switch.generation,
            switch.flags.to_log_value()
        ),
        Current::Void(e) => {
            format!("void ({e}): the cell ignores it and keeps its last applied values")
        }
        Current::Unreadable(reason) => {
            format!("unreadable ({reason}): the cell ignores it and keeps its last applied values")
        }
    }
}

/// Runs the action for the cell configured in `config`, printing what it finds and does to
/// `out`; `Err` is the one-line reason it failed.
pub fn run(config: &Config, action: &SwitchAction, out: &mut dyn Write) -> Result<(), String> {
    let path = &config.switch_file;
    let url = metrics_url(config.http_addr);
    let current = read_current(path, &config.cell_id);
    let report = ask_cell(&url);
    let mut say = |line: String| {
        let _ = writeln!(out, "{line}");
        let _ = out.flush();
    };
    if *action == SwitchAction::Show {
        say(format!("switch_file={}", path.display()));
        say(format!("cell_id={}", config.cell_id));
        say(format!("file={}", describe_current(&current)));
        say(match &report {
            Some(report) => format!(
                "running_cell=generation {} applied, dead-man {}, deadManTripSlots in force {}",
                report.applied_generation,
                report.dead_man.as_deref().unwrap_or("unknown"),
                match report.trip_slots {
                    Some(slots) if slots >= 0 => slots.to_string(),
                    Some(_) => "none (no cap)".to_string(),
                    None => "unknown".to_string(),
                }
            ),
            None => format!("running_cell=no answer from {url}"),
        });
        return match current {
            Current::Void(_) => Err("the switch file is void".into()),
            Current::Unreadable(_) => Err("the switch file cannot be read".into()),
            _ => Ok(()),
        };
    }
    let planned = plan(
        &current,
        report.as_ref().map(|r| r.applied_generation),
        action,
    )?;
    let bytes = render(&config.cell_id, &planned)?;
    write_atomically(path, &bytes)?;
    let generation = planned.switch.generation;
    say(format!(
        "switch: wrote generation {generation} flags {} to {}",
        planned.switch.flags.to_log_value(),
        path.display()
    ));
    if report.is_none() {
        say(format!(
            "switch: no running cell answered at {url}; a cell applies the file when it starts"
        ));
        return Ok(());
    }
    // The cell reads the file every SWITCH_POLL_MS: wait for two polls at most.
    let poll = Duration::from_millis(config.timings.switch_poll_ms);
    let waited = poll * 2 + Duration::from_secs(1);
    let deadline = crate::clock::instant() + waited;
    loop {
        let applied = ask_cell(&url).map(|r| r.applied_generation);
        if applied.is_some_and(|applied| applied >= generation) {
            say(format!(
                "switch: the running cell applied generation {generation}"
            ));
            return Ok(());
        }
        if crate::clock::instant() >= deadline {
            return Err(format!(
                "the running cell has not applied generation {generation} after {} ms; look for orca_relay_control_flags_unreadable in its log",
                waited.as_millis()
            ));
        }
        crate::clock::sleep(Duration::from_millis(100).min(poll));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reserve(generation: u64, slots: Option<u32>) -> Current {
        Current::Valid {
            switch: Switch {
                generation,
                flags: Flags {
                    admit_mode: AdmitMode::Reserve,
                    dead_man_trip_slots: slots,
                },
            },
            extra_flags: Map::new(),
        }
    }

    fn set(mode: Option<AdmitMode>, slots: Option<Option<u32>>) -> SwitchAction {
        SwitchAction::Set {
            admit_mode: mode,
            trip_slots: slots,
            generation: None,
        }
    }

    #[test]
    fn set_takes_the_next_generation_and_keeps_flags_it_was_not_given() {
        let planned = plan(&reserve(12, Some(2)), None, &set(Some(AdmitMode::Db), None)).unwrap();
        assert_eq!(planned.switch.generation, 13);
        assert_eq!(planned.switch.flags.admit_mode, AdmitMode::Db);
        assert_eq!(planned.switch.flags.dead_man_trip_slots, Some(2));

        let planned = plan(&reserve(12, Some(2)), None, &set(None, Some(None))).unwrap();
        assert_eq!(
            planned.switch.flags.dead_man_trip_slots, None,
            "--trip-slots none"
        );
        assert_eq!(planned.switch.flags.admit_mode, AdmitMode::Reserve);

        let planned = plan(
            &Current::Missing,
            None,
            &set(Some(AdmitMode::Reserve), Some(Some(0))),
        )
        .unwrap();
        assert_eq!(
            planned.switch.generation, 1,
            "a missing file is generation 0"
        );
    }

    #[test]
    fn the_generation_goes_above_what_the_running_cell_applied() {
        // The file was rolled back to 7 after the cell applied 12.
        let planned = plan(
            &reserve(7, None),
            Some(12),
            &SwitchAction::ReArm { generation: None },
        )
        .unwrap();
        assert_eq!(planned.switch.generation, 13);
        let err = plan(
            &reserve(7, None),
            Some(12),
            &SwitchAction::ReArm {
                generation: Some(12),
            },
        )
        .unwrap_err();
        assert!(err.contains("not above generation 12"), "{err}");
        let planned = plan(
            &reserve(7, None),
            Some(12),
            &SwitchAction::ReArm {
                generation: Some(20),
            },
        )
        .unwrap();
        assert_eq!(planned.switch.generation, 20);
    }

    #[test]
    fn re_arm_writes_the_same_flags_and_refuses_what_it_cannot_re_arm() {
        let planned = plan(
            &reserve(4, Some(3)),
            None,
            &SwitchAction::ReArm { generation: None },
        )
        .unwrap();
        assert_eq!(
            planned.switch,
            Switch {
                generation: 5,
                flags: Flags {
                    admit_mode: AdmitMode::Reserve,
                    dead_man_trip_slots: Some(3)
                }
            }
        );
        let rearm = SwitchAction::ReArm { generation: None };
        assert!(plan(&Current::Missing, None, &rearm).is_err());
        assert!(plan(&Current::Void(SwitchError::BadJson), Some(3), &rearm).is_err());
        let db = Current::Valid {
            switch: Switch {
                generation: 2,
                flags: Flags::default(),
            },
            extra_flags: Map::new(),
        };
        assert!(plan(&db, None, &rearm)
            .unwrap_err()
            .contains("admitMode db"));
    }

    #[test]
    fn a_void_file_needs_the_cells_generation_or_an_explicit_one() {
        let void = Current::Void(SwitchError::WrongCellId);
        let action = set(Some(AdmitMode::Reserve), None);
        assert!(plan(&void, None, &action)
            .unwrap_err()
            .contains("--generation"));
        assert_eq!(plan(&void, Some(9), &action).unwrap().switch.generation, 10);
        let explicit = SwitchAction::Set {
            admit_mode: Some(AdmitMode::Reserve),
            trip_slots: None,
            generation: Some(30),
        };
        assert_eq!(plan(&void, None, &explicit).unwrap().switch.generation, 30);
    }

    #[test]
    fn the_rendered_file_reads_back_with_the_cells_parser_and_keeps_unknown_flags() {
        let mut extra = Map::new();
        extra.insert("futureFlag".into(), serde_json::json!({"x": 1}));
        let planned = Planned {
            switch: Switch {
                generation: 8,
                flags: Flags {
                    admit_mode: AdmitMode::Reserve,
                    dead_man_trip_slots: Some(2),
                },
            },
            extra_flags: extra,
        };
        let bytes = render("c7", &planned).unwrap();
        let (parsed, unknown) = switch::parse(&bytes, "c7").unwrap();
        assert_eq!(parsed, planned.switch);
        assert_eq!(unknown, vec!["futureFlag".to_string()]);
    }

    #[test]
    fn options_are_checked_when_parsed() {
        let pairs = |list: &[(&str, &str)]| -> Vec<(String, String)> {
            list.iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect()
        };
        assert_eq!(
            SwitchAction::parse(
                Some("set"),
                &pairs(&[("admit-mode", "reserve"), ("trip-slots", "2")])
            ),
            Ok(SwitchAction::Set {
                admit_mode: Some(AdmitMode::Reserve),
                trip_slots: Some(Some(2)),
                generation: None
            })
        );
        assert!(SwitchAction::parse(Some("set"), &pairs(&[("admit-mode", "maybe")])).is_err());
        assert!(SwitchAction::parse(Some("set"), &pairs(&[("trip-slots", "65")])).is_err());
        assert!(SwitchAction::parse(Some("set"), &pairs(&[])).is_err());
        assert!(SwitchAction::parse(Some("re-arm"), &pairs(&[("admit-mode", "db")])).is_err());
        assert!(SwitchAction::parse(Some("re-arm"), &pairs(&[("generation", "0")])).is_err());
        assert_eq!(
            SwitchAction::parse(Some("show"), &pairs(&[])),
            Ok(SwitchAction::Show)
        );
        assert!(SwitchAction::parse(Some("flip"), &pairs(&[])).is_err());
    }

    #[test]
    fn reads_are_bounded_to_regular_files() {
        let dir = std::env::temp_dir().join(format!("orca-switch-read-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let big = dir.join("big.json");
        std::fs::write(&big, vec![b' '; (MAX_SWITCH_FILE_BYTES + 1) as usize]).unwrap();
        assert_eq!(
            read_current(&big, "c7"),
            Current::Unreadable("cause=too_large detail=65537>65536".into())
        );
        assert_eq!(
            read_current(&dir, "c7"),
            Current::Unreadable("cause=not_regular_file detail=directory".into())
        );
        assert_eq!(read_current(&dir.join("none.json"), "c7"), Current::Missing);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn writes_replace_the_file_whole_and_leave_no_temporary_behind() {
        let dir = std::env::temp_dir().join(format!("orca-switch-write-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("switch.json");
        write_atomically(&path, b"first\n").unwrap();
        write_atomically(&path, b"second\n").unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"second\n");
        let names: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, vec![std::ffi::OsString::from("switch.json")]);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn the_cells_report_is_read_from_its_metrics() {
        let body = "# TYPE orca_relay_switch_generation gauge\norca_relay_switch_generation 12\n\
                    orca_relay_dead_man_state{state=\"armed\"} 0\n\
                    orca_relay_dead_man_state{state=\"tripped\"} 1\n\
                    orca_relay_dead_man_trip_slots -1\n";
        assert_eq!(
            parse_report(body),
            Some(CellReport {
                applied_generation: 12,
                dead_man: Some("tripped".into()),
                trip_slots: Some(-1)
            })
        );
        assert_eq!(parse_report("orca_relay_up 1\n"), None);
    }
}
