//! A cell's incarnation: the number that orders the runs of one cell (SPEC §6.1
//! `relay_cells.incarnation`, the registration of §8, the heartbeat of §5.6). A director refuses
//! a registration or heartbeat of a lower incarnation than the one it stored (`409
//! stale_cell_incarnation`), so a late message of a run that is gone never overrides the live
//! one.
//!
//! It is the run's start time on this process's clock, raised above the previous run's, which
//! is kept in `$ORCA_RELAY_DATA_DIR/incarnation`. The start time alone went backwards when the
//! machine's clock did (an NTP step, a VM restored from a snapshot): the restarted cell was
//! refused at every start and crash-looped until its clock passed the old start (found by the
//! nemesis with a clock five minutes behind; `tests/cell_restart_clock.rs`).
//!
//! Runs once, at start, on the main thread. A data directory that cannot be read or written
//! falls back to the clock alone, with one warning.

use std::path::Path;

use crate::local_file;

/// The file in the data directory that keeps the last run's incarnation.
pub const FILE: &str = "incarnation";

/// The next run's incarnation: now, or one above the previous run's when that is later.
pub fn next(now_ms: u64, previous: Option<i64>) -> i64 {
    let now = i64::try_from(now_ms).unwrap_or(i64::MAX);
    previous.map_or(now, |previous| now.max(previous.saturating_add(1)))
}

/// Takes this run's incarnation: reads the previous one from `data_dir`, computes the next and
/// writes it back (write and rename) before anything is registered with it.
pub fn take(data_dir: &Path, now_ms: u64) -> i64 {
    let path = data_dir.join(FILE);
    let previous = local_file::read_bounded_to_string(&path, 64)
        .ok()
        .and_then(|text| text.trim().parse::<i64>().ok());
    let incarnation = next(now_ms, previous);
    let saved = std::fs::create_dir_all(data_dir).and_then(|()| {
        let tmp = data_dir.join(format!("{FILE}.tmp"));
        std::fs::write(&tmp, format!("{incarnation}\n"))?;
        std::fs::rename(&tmp, &path)
    });
    if let Err(e) = saved {
        log::warn!(
            "orca_relay_incarnation_not_saved path={} error=\"{e}\" note=a_restart_with_a_clock_stepped_back_may_be_refused",
            path.display()
        );
    }
    incarnation
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_next_incarnation_is_now_unless_the_last_run_was_later() {
        assert_eq!(next(5_000, None), 5_000);
        assert_eq!(next(5_000, Some(4_000)), 5_000);
        assert_eq!(next(5_000, Some(5_000)), 5_001);
        assert_eq!(next(5_000, Some(305_000)), 305_001, "a clock stepped back");
        assert_eq!(next(5_000, Some(i64::MAX)), i64::MAX);
    }

    #[test]
    fn each_run_takes_a_higher_incarnation_than_the_last_whatever_the_clock() {
        let dir = std::env::temp_dir().join(format!(
            "orca-relay-incarnation-{}-{}",
            std::process::id(),
            crate::clock::system().now_ms()
        ));
        let first = take(&dir, 1_000_000);
        let second = take(&dir, 700_000);
        let third = take(&dir, 2_000_000);
        assert_eq!((first, second, third), (1_000_000, 1_000_001, 2_000_000));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
