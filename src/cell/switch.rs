//! The switch file (SPEC §5.1): the operator's per-cell flags, and the `switch-watcher` thread
//! that applies them.
//!
//! Owns: the last applied [`Switch`] (inside [`SwitchWatcher`]) and the "what did we last
//! complain about" memory that keeps the unreadable line to one per change of cause.
//! Runs on: the `switch-watcher` thread ([`run_switch_watcher`]); [`parse`] and
//! [`SwitchWatcher::poll`] are pure and run anywhere (tests).
//! Must never: apply a generation that is not strictly higher than the applied one, apply part
//! of a void object, or log the same complaint on every poll.
//!
//! A valid object that can never be applied is reported on the same line, once: a generation
//! below the applied one (`cause=stale_generation`), or the applied generation with different
//! flags (`cause=generation_not_raised`, an edit without a new generation). Neither changes
//! anything; the applied file read again on every poll is quiet.
//!
//! A missing file means the defaults (generation 0, `admitMode` `db`, no trip-slot cap). Because
//! generation 0 is never higher than an applied generation, a file that disappears after a
//! generation was applied **keeps the previous values**: a rename gone wrong or a config manager
//! mid-rewrite must not flip a reserve cell to `db` (and so onto its full database pool) or
//! change its trip cap. The disappearance is logged once (`cause=missing`). A process that
//! starts with no file runs on the defaults, which is the documented meaning of "missing".

use std::fmt;
use std::path::Path;
use std::sync::mpsc::Receiver;
use std::time::Duration;

use serde_json::Value;

use crate::carry::cell::SwitchRecord;
use crate::local_file::{self, LocalFileError, MAX_LOCAL_FILE_BYTES};

/// The largest `deadManTripSlots` an operator may set.
pub const MAX_TRIP_SLOTS: u32 = 64;

/// The switch's admission mode (SPEC §5.1 `admitMode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum AdmitMode {
    #[default]
    Db,
    Reserve,
}

impl AdmitMode {
    pub fn as_str(self) -> &'static str {
        match self {
            AdmitMode::Db => "db",
            AdmitMode::Reserve => "reserve",
        }
    }
}

/// The known flags. `Default` is what a missing file means.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Flags {
    pub admit_mode: AdmitMode,
    /// `None`: no cap, the cell trips as soon as its dead-man window passes (the old behaviour).
    pub dead_man_trip_slots: Option<u32>,
}

impl Flags {
    /// The flags as compact JSON (no spaces, so it is one `key=value` token in a log line).
    pub fn to_log_value(&self) -> String {
        let mut object = serde_json::Map::new();
        object.insert("admitMode".into(), self.admit_mode.as_str().into());
        if let Some(slots) = self.dead_man_trip_slots {
            object.insert("deadManTripSlots".into(), slots.into());
        }
        Value::Object(object).to_string()
    }
}

/// One applied operator write. Generation 0 with default flags is "missing file".
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Switch {
    pub generation: u64,
    pub flags: Flags,
}

impl Switch {
    pub fn says_reserve(&self) -> bool {
        self.flags.admit_mode == AdmitMode::Reserve
    }
}

impl From<Switch> for SwitchRecord {
    fn from(switch: Switch) -> Self {
        SwitchRecord {
            generation: switch.generation,
            reserve: switch.says_reserve(),
            dead_man_trip_slots: switch.flags.dead_man_trip_slots,
        }
    }
}

impl From<SwitchRecord> for Switch {
    fn from(record: SwitchRecord) -> Self {
        Switch {
            generation: record.generation,
            flags: Flags {
                admit_mode: if record.reserve {
                    AdmitMode::Reserve
                } else {
                    AdmitMode::Db
                },
                dead_man_trip_slots: record.dead_man_trip_slots,
            },
        }
    }
}

/// Why a switch object is void. Each has a short cause code for the log line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SwitchError {
    /// Not JSON, not an object, or `flags` not an object.
    BadJson,
    /// `v` missing or not 1.
    BadVersion,
    /// `cellId` missing or not this cell's id.
    WrongCellId,
    /// `generation` missing, negative, fractional or not a number.
    BadGeneration,
    /// `admitMode` not `db` or `reserve`.
    BadAdmitMode,
    /// `deadManTripSlots` not an integer from 0 to 64.
    BadTripSlots,
}

impl SwitchError {
    pub fn cause(&self) -> &'static str {
        match self {
            SwitchError::BadJson => "bad_json",
            SwitchError::BadVersion => "bad_version",
            SwitchError::WrongCellId => "wrong_cell_id",
            SwitchError::BadGeneration => "bad_generation",
            SwitchError::BadAdmitMode => "bad_admit_mode",
            SwitchError::BadTripSlots => "bad_trip_slots",
        }
    }
}

impl fmt::Display for SwitchError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "switch file void: {}", self.cause())
    }
}

impl std::error::Error for SwitchError {}

/// Parses a switch file. Either the whole object is valid or it is void: a known flag with a
/// bad value voids everything, so an operator never gets half of a write. Unknown flags are
/// ignored and returned (sorted) so the caller can report them. An explicit `null`
/// `deadManTripSlots` reads as absent (no cap).
pub fn parse(bytes: &[u8], expected_cell_id: &str) -> Result<(Switch, Vec<String>), SwitchError> {
    let value: Value = serde_json::from_slice(bytes).map_err(|_| SwitchError::BadJson)?;
    let object = value.as_object().ok_or(SwitchError::BadJson)?;
    if object.get("v").and_then(Value::as_u64) != Some(1) {
        return Err(SwitchError::BadVersion);
    }
    if object.get("cellId").and_then(Value::as_str) != Some(expected_cell_id) {
        return Err(SwitchError::WrongCellId);
    }
    let generation = object
        .get("generation")
        .and_then(Value::as_u64)
        .ok_or(SwitchError::BadGeneration)?;

    let empty = serde_json::Map::new();
    let flags_object = match object.get("flags") {
        None | Some(Value::Null) => &empty,
        Some(Value::Object(flags)) => flags,
        Some(_) => return Err(SwitchError::BadJson),
    };
    let mut flags = Flags::default();
    let mut unknown = Vec::new();
    for (name, value) in flags_object {
        match name.as_str() {
            "admitMode" => {
                flags.admit_mode = match value.as_str() {
                    Some("db") => AdmitMode::Db,
                    Some("reserve") => AdmitMode::Reserve,
                    _ => return Err(SwitchError::BadAdmitMode),
                }
            }
            "deadManTripSlots" => {
                flags.dead_man_trip_slots = match value {
                    Value::Null => None,
                    other => match other.as_u64() {
                        Some(slots) if slots <= u64::from(MAX_TRIP_SLOTS) => Some(slots as u32),
                        _ => return Err(SwitchError::BadTripSlots),
                    },
                }
            }
            _ => unknown.push(name.clone()),
        }
    }
    unknown.sort();
    Ok((Switch { generation, flags }, unknown))
}

/// What one poll did.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct SwitchEvent {
    /// The newly applied switch, if this poll applied a strictly higher generation.
    pub applied: Option<Switch>,
    /// The log lines this poll emitted (already sent to `log`), for tests and callers.
    pub log_lines: Vec<String>,
}

/// The complaint a poll would make: a cause code (or `None` for a clean file) and the unknown
/// flags. The unreadable line is logged only when this changes to a non-clean value.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
struct Complaint {
    cause: Option<&'static str>,
    /// What goes with a local-file cause: the file's kind, its size, the OS error.
    detail: String,
    unknown: Vec<String>,
}

/// The state of the `switch-watcher` thread: the applied switch and the last complaint.
#[derive(Debug, Clone)]
pub struct SwitchWatcher {
    cell_id: String,
    applied: Switch,
    last_complaint: Complaint,
}

impl SwitchWatcher {
    /// A watcher that starts on the defaults (generation 0), as if the file were missing.
    pub fn new(cell_id: impl Into<String>) -> Self {
        SwitchWatcher {
            cell_id: cell_id.into(),
            applied: Switch::default(),
            last_complaint: Complaint::default(),
        }
    }

    /// A watcher that goes on from `applied` (a live handover's).
    pub fn resuming(cell_id: impl Into<String>, applied: Switch) -> Self {
        SwitchWatcher {
            applied,
            ..SwitchWatcher::new(cell_id)
        }
    }

    /// The last applied switch.
    pub fn applied(&self) -> Switch {
        self.applied
    }

    /// Feeds one read of the file ([`read_switch_file`]; `Missing` = no file). Pure apart from
    /// logging.
    pub fn poll(&mut self, read: Result<Vec<u8>, LocalFileError>) -> SwitchEvent {
        let mut event = SwitchEvent::default();
        let parsed = match read {
            Ok(bytes) => parse(&bytes, &self.cell_id).map_err(|error| {
                // Unknown flags are still worth reporting next to a void object.
                (error.cause(), unknown_flags_of(&bytes))
            }),
            Err(LocalFileError::Missing) => {
                // Missing = defaults (generation 0). Never higher than an applied generation,
                // so it changes nothing once something was applied; say so once.
                let complaint = Complaint {
                    cause: (self.applied.generation > 0).then_some("missing"),
                    ..Complaint::default()
                };
                self.complain(complaint, &mut event);
                return event;
            }
            Err(error) => {
                // Not a regular file, over 64 KiB, or unreadable: void, whatever it holds.
                let complaint = Complaint {
                    cause: Some(error.cause()),
                    detail: error.detail(),
                    unknown: Vec::new(),
                };
                self.complain(complaint, &mut event);
                return event;
            }
        };

        match parsed {
            Err((cause, unknown)) => {
                let complaint = Complaint {
                    cause: Some(cause),
                    detail: String::new(),
                    unknown,
                };
                self.complain(complaint, &mut event);
            }
            Ok((switch, unknown)) => {
                // A valid object that will never be applied is an operator mistake worth one
                // line: a generation below the applied one, or the applied generation with
                // other flags (edited without raising the generation).
                let cause = if switch.generation < self.applied.generation {
                    Some("stale_generation")
                } else if switch.generation == self.applied.generation
                    && switch.flags != self.applied.flags
                {
                    Some("generation_not_raised")
                } else if !unknown.is_empty() {
                    Some("unknown_flags")
                } else {
                    None
                };
                let complaint = Complaint {
                    cause,
                    detail: String::new(),
                    unknown,
                };
                self.complain(complaint, &mut event);
                if switch.generation > self.applied.generation {
                    self.applied = switch;
                    let line = format!(
                        "orca_relay_cell_flags_applied cell_id={} generation={} flags={}",
                        self.cell_id,
                        switch.generation,
                        switch.flags.to_log_value()
                    );
                    log::info!("{line}");
                    event.log_lines.push(line);
                    event.applied = Some(switch);
                }
            }
        }
        event
    }

    /// Logs `orca_relay_control_flags_unreadable` when the complaint changes to a non-clean
    /// one; a clean poll resets the memory so the next problem is logged again.
    fn complain(&mut self, complaint: Complaint, event: &mut SwitchEvent) {
        if complaint == self.last_complaint {
            return;
        }
        if let Some(cause) = complaint.cause {
            let unknown = if complaint.unknown.is_empty() {
                "-".to_string()
            } else {
                complaint.unknown.join(",")
            };
            let mut line = format!(
                "orca_relay_control_flags_unreadable cell_id={} cause={cause} unknown={unknown} applied_generation={}",
                self.cell_id, self.applied.generation
            );
            if !complaint.detail.is_empty() {
                line.push_str(&format!(" detail={}", complaint.detail));
            }
            log::warn!("{line}");
            event.log_lines.push(line);
        }
        self.last_complaint = complaint;
    }
}

/// The unknown flag names of a void object, if it is at least a JSON object with a `flags`
/// object; empty otherwise.
fn unknown_flags_of(bytes: &[u8]) -> Vec<String> {
    let Ok(value) = serde_json::from_slice::<Value>(bytes) else {
        return Vec::new();
    };
    let mut unknown: Vec<String> = value
        .get("flags")
        .and_then(Value::as_object)
        .map(|flags| {
            flags
                .keys()
                .filter(|name| !matches!(name.as_str(), "admitMode" | "deadManTripSlots"))
                .cloned()
                .collect()
        })
        .unwrap_or_default();
    unknown.sort();
    unknown
}

/// Reads the switch file: only a regular file of at most 64 KiB, opened without blocking (a
/// FIFO, a device, a directory or a huge file is refused before anything is read).
pub fn read_switch_file(path: &Path) -> Result<Vec<u8>, LocalFileError> {
    local_file::read_bounded(path, MAX_LOCAL_FILE_BYTES)
}

/// The body of the `switch-watcher` thread: reads `path` every `period`, publishes each newly
/// applied switch, and returns when `stop` receives or its sender is dropped, with the switch
/// it applied last. Nothing is published for the starting switch (`applied`: the defaults, or
/// what a live handover carried), which consumers start on too.
pub fn run_switch_watcher(
    path: &Path,
    cell_id: &str,
    period: Duration,
    publish: impl Fn(Switch),
    stop: Receiver<()>,
    applied: Switch,
    beat: &crate::liveness::Beat,
) -> Switch {
    let mut watcher = SwitchWatcher::resuming(cell_id, applied);
    loop {
        beat.beat();
        let event = watcher.poll(read_switch_file(path));
        if let Some(switch) = event.applied {
            publish(switch);
        }
        // A critical thread: it beats at least once a beat period while it waits.
        if crate::liveness::wait_beating(&stop, crate::clock::instant() + period, beat) {
            return watcher.applied();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc;
    use std::sync::{Arc, Mutex};

    type Read = Result<Vec<u8>, LocalFileError>;

    fn file(generation: i64, flags: &str) -> Read {
        Ok(
            format!(r#"{{"v":1,"cellId":"c7","generation":{generation},"flags":{flags}}}"#)
                .into_bytes(),
        )
    }

    fn missing() -> Read {
        Err(LocalFileError::Missing)
    }

    fn reserve(generation: u64, slots: Option<u32>) -> Switch {
        Switch {
            generation,
            flags: Flags {
                admit_mode: AdmitMode::Reserve,
                dead_man_trip_slots: slots,
            },
        }
    }

    #[test]
    fn parses_the_spec_example() {
        let bytes = br#"{"v":1, "cellId":"c7", "generation":12,
            "flags":{"admitMode":"reserve", "deadManTripSlots":2}}"#;
        let (switch, unknown) = parse(bytes, "c7").unwrap();
        assert_eq!(switch, reserve(12, Some(2)));
        assert!(unknown.is_empty());
    }

    #[test]
    fn absent_flags_are_the_defaults() {
        let (switch, _) = parse(br#"{"v":1,"cellId":"c7","generation":3}"#, "c7").unwrap();
        assert_eq!(switch.flags, Flags::default());
        let (switch, _) = parse(
            br#"{"v":1,"cellId":"c7","generation":3,"flags":{"deadManTripSlots":null}}"#,
            "c7",
        )
        .unwrap();
        assert_eq!(switch.flags.dead_man_trip_slots, None);
        let (switch, _) = parse(
            br#"{"v":1,"cellId":"c7","generation":3,"flags":{"deadManTripSlots":0}}"#,
            "c7",
        )
        .unwrap();
        assert_eq!(switch.flags.dead_man_trip_slots, Some(0));
    }

    #[test]
    fn void_objects_name_their_cause() {
        let cases: &[(&str, &str)] = &[
            ("not json", "bad_json"),
            ("[1,2]", "bad_json"),
            (
                r#"{"v":1,"cellId":"c7","generation":1,"flags":[]}"#,
                "bad_json",
            ),
            (r#"{"v":2,"cellId":"c7","generation":1}"#, "bad_version"),
            (r#"{"cellId":"c7","generation":1}"#, "bad_version"),
            (r#"{"v":1,"cellId":"c8","generation":1}"#, "wrong_cell_id"),
            (r#"{"v":1,"generation":1}"#, "wrong_cell_id"),
            (r#"{"v":1,"cellId":"c7"}"#, "bad_generation"),
            (r#"{"v":1,"cellId":"c7","generation":-1}"#, "bad_generation"),
            (
                r#"{"v":1,"cellId":"c7","generation":1.5}"#,
                "bad_generation",
            ),
            (
                r#"{"v":1,"cellId":"c7","generation":"3"}"#,
                "bad_generation",
            ),
            (
                r#"{"v":1,"cellId":"c7","generation":1,"flags":{"admitMode":"Reserve"}}"#,
                "bad_admit_mode",
            ),
            (
                r#"{"v":1,"cellId":"c7","generation":1,"flags":{"admitMode":null}}"#,
                "bad_admit_mode",
            ),
            (
                r#"{"v":1,"cellId":"c7","generation":1,"flags":{"deadManTripSlots":65}}"#,
                "bad_trip_slots",
            ),
            (
                r#"{"v":1,"cellId":"c7","generation":1,"flags":{"deadManTripSlots":-1}}"#,
                "bad_trip_slots",
            ),
            (
                r#"{"v":1,"cellId":"c7","generation":1,"flags":{"deadManTripSlots":2.5}}"#,
                "bad_trip_slots",
            ),
            (
                r#"{"v":1,"cellId":"c7","generation":1,"flags":{"deadManTripSlots":"2"}}"#,
                "bad_trip_slots",
            ),
        ];
        for (text, cause) in cases {
            let error = parse(text.as_bytes(), "c7").unwrap_err();
            assert_eq!(error.cause(), *cause, "{text}");
        }
    }

    #[test]
    fn applies_only_strictly_higher_generations() {
        let mut watcher = SwitchWatcher::new("c7");
        let event = watcher.poll(file(5, r#"{"admitMode":"reserve"}"#));
        assert_eq!(event.applied, Some(reserve(5, None)));
        assert_eq!(
            event.log_lines,
            vec![
                r#"orca_relay_cell_flags_applied cell_id=c7 generation=5 flags={"admitMode":"reserve"}"#
            ]
        );

        // The same generation with different content is not a new operator write: nothing
        // changes, and the mistake is said once.
        let event = watcher.poll(file(5, r#"{"admitMode":"db"}"#));
        assert_eq!(event.applied, None);
        assert_eq!(event.log_lines.len(), 1, "{:?}", event.log_lines);
        assert!(event.log_lines[0].contains("cause=generation_not_raised"));
        assert_eq!(
            watcher.poll(file(5, r#"{"admitMode":"db"}"#)),
            SwitchEvent::default()
        );
        // A lower generation changes nothing either, and is said once.
        let event = watcher.poll(file(4, r#"{"admitMode":"db"}"#));
        assert_eq!(event.applied, None);
        assert_eq!(event.log_lines.len(), 1, "{:?}", event.log_lines);
        assert!(event.log_lines[0].contains("cause=stale_generation"));
        assert!(event.log_lines[0].contains("applied_generation=5"));
        assert_eq!(
            watcher.poll(file(4, r#"{"admitMode":"db"}"#)),
            SwitchEvent::default()
        );
        assert_eq!(watcher.applied(), reserve(5, None));
        // The applied file itself, re-read on every poll, is quiet.
        assert_eq!(
            watcher.poll(file(5, r#"{"admitMode":"reserve"}"#)),
            SwitchEvent::default()
        );
        assert_eq!(
            watcher.poll(file(5, r#"{"admitMode":"reserve"}"#)),
            SwitchEvent::default()
        );

        let event = watcher.poll(file(6, r#"{"admitMode":"reserve","deadManTripSlots":2}"#));
        assert_eq!(event.applied, Some(reserve(6, Some(2))));
        assert_eq!(watcher.applied(), reserve(6, Some(2)));
    }

    #[test]
    fn a_void_object_keeps_the_previous_values() {
        let mut watcher = SwitchWatcher::new("c7");
        watcher.poll(file(5, r#"{"admitMode":"reserve","deadManTripSlots":2}"#));
        let before = watcher.applied();
        let void_reads: Vec<Read> = vec![
            file(9, r#"{"admitMode":"maybe","deadManTripSlots":1}"#),
            Ok(br#"{"v":1,"cellId":"c8","generation":9,"flags":{"admitMode":"db"}}"#.to_vec()),
            Ok(br#"{"v":1,"cellId":"c7","generation":9,"flags":{"admitMode":"db""#.to_vec()),
            file(9, r#"{"admitMode":"db","deadManTripSlots":99}"#),
            Err(LocalFileError::Unreadable(std::io::Error::from(
                std::io::ErrorKind::PermissionDenied,
            ))),
            Err(LocalFileError::NotRegular("fifo")),
            Err(LocalFileError::TooLarge {
                size: 70_000,
                limit: MAX_LOCAL_FILE_BYTES,
            }),
        ];
        for read in void_reads {
            let event = watcher.poll(read);
            assert_eq!(event.applied, None);
            assert_eq!(watcher.applied(), before);
        }
    }

    #[test]
    fn a_missing_file_is_defaults_at_start_and_keeps_an_applied_generation() {
        let mut watcher = SwitchWatcher::new("c7");
        let event = watcher.poll(missing());
        assert_eq!(
            event,
            SwitchEvent::default(),
            "missing at start: defaults, quiet"
        );
        assert_eq!(watcher.applied(), Switch::default());

        watcher.poll(file(3, r#"{"admitMode":"reserve"}"#));
        let event = watcher.poll(missing());
        assert_eq!(event.applied, None);
        assert_eq!(
            watcher.applied(),
            reserve(3, None),
            "keeps the previous values"
        );
        assert_eq!(event.log_lines.len(), 1);
        assert!(
            event.log_lines[0].contains("cause=missing"),
            "{:?}",
            event.log_lines
        );
        assert_eq!(watcher.poll(missing()), SwitchEvent::default(), "said once");
    }

    #[test]
    fn the_unreadable_line_is_logged_once_per_change_of_cause() {
        let mut watcher = SwitchWatcher::new("c7");
        watcher.poll(file(1, r#"{"admitMode":"reserve"}"#));
        let bad_mode = || file(2, r#"{"admitMode":"maybe"}"#);
        let wrong_cell = || Ok(br#"{"v":1,"cellId":"c9","generation":2}"#.to_vec());

        let mut lines = Vec::new();
        for read in [bad_mode(), bad_mode(), bad_mode()] {
            lines.extend(watcher.poll(read).log_lines);
        }
        assert_eq!(lines.len(), 1, "{lines:?}");
        assert!(lines[0].starts_with("orca_relay_control_flags_unreadable "));
        assert!(lines[0].contains("cause=bad_admit_mode"));
        assert!(lines[0].contains("applied_generation=1"));

        let mut lines = Vec::new();
        for read in [wrong_cell(), wrong_cell()] {
            lines.extend(watcher.poll(read).log_lines);
        }
        assert_eq!(lines.len(), 1, "a new cause is logged once: {lines:?}");
        assert!(lines[0].contains("cause=wrong_cell_id"));

        // Back to the first cause: that is a change again.
        let lines = watcher.poll(bad_mode()).log_lines;
        assert_eq!(lines.len(), 1);

        // A clean file (the applied one, read again) resets the memory quietly.
        assert_eq!(
            watcher.poll(file(1, r#"{"admitMode":"reserve"}"#)),
            SwitchEvent::default()
        );
        assert_eq!(watcher.poll(bad_mode()).log_lines.len(), 1);
    }

    #[test]
    fn unknown_flags_are_ignored_and_reported_once() {
        let mut watcher = SwitchWatcher::new("c7");
        let read = || file(2, r#"{"admitMode":"reserve","zeta":1,"alpha":true}"#);
        let event = watcher.poll(read());
        assert_eq!(
            event.applied,
            Some(reserve(2, None)),
            "unknown flags do not void"
        );
        assert_eq!(event.log_lines.len(), 2, "{:?}", event.log_lines);
        assert!(event.log_lines[0].contains("cause=unknown_flags unknown=alpha,zeta"));
        assert!(event.log_lines[1].starts_with("orca_relay_cell_flags_applied "));
        assert_eq!(
            watcher.poll(read()),
            SwitchEvent::default(),
            "not on every poll"
        );

        let (_, unknown) = parse(read().unwrap().as_slice(), "c7").unwrap();
        assert_eq!(unknown, vec!["alpha".to_string(), "zeta".to_string()]);

        // Unknown flags next to a void value are reported in that line too.
        let event = watcher.poll(file(3, r#"{"admitMode":"x","beta":1}"#));
        assert!(event.log_lines[0].contains("cause=bad_admit_mode unknown=beta"));
    }

    /// Replaces whatever is at `path` with what `make` creates at a fresh name, atomically where
    /// the kind allows (a directory cannot be renamed over a file).
    fn replace_with(path: &Path, make: impl FnOnce(&Path)) {
        let tmp = path.with_extension("next");
        let _ = std::fs::remove_dir_all(&tmp);
        let _ = std::fs::remove_file(&tmp);
        make(&tmp);
        if std::fs::rename(&tmp, path).is_err() {
            let _ = std::fs::remove_dir_all(path);
            let _ = std::fs::remove_file(path);
            std::fs::rename(&tmp, path).unwrap();
        }
    }

    #[test]
    fn hostile_switch_paths_are_said_once_keep_the_applied_state_and_a_later_write_applies() {
        let dir =
            std::env::temp_dir().join(format!("orca-relay-switch-hostile-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("switch.json");
        let write = |generation: u64| {
            let body = format!(
                r#"{{"v":1,"cellId":"c7","generation":{generation},"flags":{{"admitMode":"reserve","deadManTripSlots":{generation}}}}}"#
            );
            replace_with(&path, |tmp| std::fs::write(tmp, body).unwrap());
        };
        let mut watcher = SwitchWatcher::new("c7");
        write(1);
        assert_eq!(
            watcher.poll(read_switch_file(&path)).applied,
            Some(reserve(1, Some(1)))
        );

        type Make = Box<dyn Fn(&Path)>;
        let hostile: Vec<(&str, &str, Make)> = vec![
            (
                "not_regular_file",
                "character_device",
                Box::new(|tmp| std::os::unix::fs::symlink("/dev/zero", tmp).unwrap()),
            ),
            (
                "not_regular_file",
                "fifo",
                Box::new(|tmp| {
                    let c_path =
                        std::ffi::CString::new(tmp.as_os_str().as_encoded_bytes()).unwrap();
                    // SAFETY: a valid NUL-terminated path; mkfifo only creates a node.
                    assert_eq!(unsafe { libc::mkfifo(c_path.as_ptr(), 0o600) }, 0);
                }),
            ),
            (
                "not_regular_file",
                "directory",
                Box::new(|tmp| std::fs::create_dir(tmp).unwrap()),
            ),
            (
                "too_large",
                "66560>65536",
                Box::new(|tmp| {
                    // Valid JSON, only too long: the size alone voids it.
                    let mut body = br#"{"v":1,"cellId":"c7","generation":99,"pad":""#.to_vec();
                    body.resize(65 * 1024 - 2, b'x');
                    body.extend_from_slice(b"\"}");
                    std::fs::write(tmp, body).unwrap()
                }),
            ),
            // The tests run as root, for whom no permission bit makes a file unreadable: a
            // symlink to itself cannot be opened (ELOOP) by anyone.
            (
                "unreadable",
                "errno_40",
                Box::new(|tmp| {
                    let target = tmp.with_file_name("switch.json");
                    std::os::unix::fs::symlink(target, tmp).unwrap()
                }),
            ),
        ];
        let mut generation = 1;
        for (cause, detail, make) in hostile {
            replace_with(&path, make);
            let mut lines = Vec::new();
            for _ in 0..3 {
                let event = watcher.poll(read_switch_file(&path));
                assert_eq!(event.applied, None, "{detail}");
                lines.extend(event.log_lines);
            }
            assert_eq!(
                lines.len(),
                1,
                "{detail}: one line for three polls: {lines:?}"
            );
            assert!(
                lines[0].starts_with(&format!(
                    "orca_relay_control_flags_unreadable cell_id=c7 cause={cause} unknown=- applied_generation={generation} detail={detail}"
                )),
                "{}",
                lines[0]
            );
            assert_eq!(
                watcher.applied(),
                reserve(generation, Some(generation as u32))
            );
            generation += 1;
            write(generation);
            let event = watcher.poll(read_switch_file(&path));
            assert_eq!(
                event.applied,
                Some(reserve(generation, Some(generation as u32))),
                "a valid write after {detail} is applied"
            );
        }
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn the_thread_body_reads_the_file_and_publishes_applied_switches() {
        let dir = std::env::temp_dir().join(format!("orca-relay-switch-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("switch.json");
        std::fs::write(
            &path,
            br#"{"v":1,"cellId":"c7","generation":4,"flags":{"admitMode":"reserve"}}"#,
        )
        .unwrap();
        let published = Arc::new(Mutex::new(Vec::new()));
        let sink = published.clone();
        let (stop_tx, stop_rx) = mpsc::channel();
        // The stop signal is already queued: the body polls once, then returns.
        stop_tx.send(()).unwrap();
        let liveness = crate::liveness::Liveness::detached(crate::clock::system());
        let beat = liveness.register("switch-watcher", crate::liveness::BEAT_PERIOD);
        let applied = run_switch_watcher(
            &path,
            "c7",
            Duration::from_secs(60),
            move |switch| sink.lock().unwrap().push(switch),
            stop_rx,
            Switch::default(),
            &beat,
        );
        assert_eq!(*published.lock().unwrap(), vec![reserve(4, None)]);
        assert_eq!(applied, reserve(4, None), "what it applied comes back");
        // Started from a carried switch of the same generation, it applies nothing again.
        let again = Arc::new(Mutex::new(Vec::new()));
        let sink = again.clone();
        let (stop_tx, stop_rx) = mpsc::channel();
        stop_tx.send(()).unwrap();
        run_switch_watcher(
            &path,
            "c7",
            Duration::from_secs(60),
            move |switch| sink.lock().unwrap().push(switch),
            stop_rx,
            applied,
            &beat,
        );
        assert!(again.lock().unwrap().is_empty());
        std::fs::remove_dir_all(&dir).ok();
    }
}
