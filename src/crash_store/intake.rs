//! What the service manager passed this process at its start (`LISTEN_PID`, `LISTEN_FDS`,
//! `LISTEN_FDNAMES`): the listeners of socket units or of the descriptor store (`ws`, `http`),
//! and after a crash the region (`crash-store.<incarnation>`) and every connection kept
//! (`c<id>`). Matched by name, never by position (the manager hands them back newest first).
//!
//! Never: leaves a descriptor it was given open and unowned (every one is taken here, close on
//! exec; whoever does not use one closes it).

use std::collections::BTreeMap;
use std::os::fd::{FromRawFd, OwnedFd};

/// The first descriptor a manager passes (`SD_LISTEN_FDS_START`).
const LISTEN_FDS_START: i32 = 3;
/// The most descriptors taken from the environment: far above any cap (a value above it is a
/// malformed environment, refused).
const MAX_PASSED: usize = 1 << 20;

/// The descriptors passed at start, by name.
#[derive(Debug, Default)]
pub struct Intake {
    /// `ws`, `http`.
    pub listeners: BTreeMap<String, OwnedFd>,
    /// The newest region (the highest number in its name) and its name; older ones are in
    /// `stale`.
    pub region: Option<(String, OwnedFd)>,
    /// Kept connections by id.
    pub connections: BTreeMap<u64, OwnedFd>,
    /// Descriptors nobody here uses (older regions, unknown names): their names, for the
    /// store to forget them; the descriptors are closed.
    pub stale: Vec<String>,
}

/// The names the manager passed, for `our_pid`, in passing order; `Ok(empty)` when nothing was
/// passed or it was meant for another process.
pub fn parse(
    listen_pid: Option<&str>,
    listen_fds: Option<&str>,
    names: Option<&str>,
    our_pid: u32,
) -> Result<Vec<(i32, String)>, String> {
    let Some(count) = listen_fds.map(str::trim).filter(|s| !s.is_empty()) else {
        return Ok(Vec::new());
    };
    if listen_pid
        .map(str::trim)
        .and_then(|p| p.parse::<u32>().ok())
        != Some(our_pid)
    {
        return Ok(Vec::new());
    }
    let count: usize = count
        .parse()
        .ok()
        .filter(|n| *n <= MAX_PASSED)
        .ok_or_else(|| format!("invalid LISTEN_FDS={count:?}"))?;
    let names: Vec<&str> = names.unwrap_or("").split(':').collect();
    Ok((0..count)
        .map(|index| {
            let name = names
                .get(index)
                .copied()
                .filter(|n| !n.is_empty())
                .unwrap_or("unknown");
            (LISTEN_FDS_START + index as i32, name.to_string())
        })
        .collect())
}

impl Intake {
    /// Takes every descriptor passed to this process (from its environment, once at start).
    pub fn from_environment() -> Result<Intake, String> {
        let passed = parse(
            std::env::var("LISTEN_PID").ok().as_deref(),
            std::env::var("LISTEN_FDS").ok().as_deref(),
            std::env::var("LISTEN_FDNAMES").ok().as_deref(),
            std::process::id(),
        )?;
        let mut intake = Intake::default();
        let mut regions: Vec<(u64, String, OwnedFd)> = Vec::new();
        for (fd, name) in passed {
            // SAFETY: F_SETFD on a descriptor the manager gave this process.
            unsafe { libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC) };
            // SAFETY: the manager passed this descriptor to this process, which now owns it.
            let owned = unsafe { OwnedFd::from_raw_fd(fd) };
            if name == "ws" || name == "http" {
                // A name twice (a socket unit and the store): the first is kept.
                intake.listeners.entry(name).or_insert(owned);
            } else if let Some(moment) = super::region_moment(&name) {
                regions.push((moment, name, owned));
            } else if let Some(id) = super::connection_id(&name) {
                if intake.connections.insert(id, owned).is_some() {
                    // Stored twice under one name: both copies are the same socket.
                }
            } else {
                intake.stale.push(name);
            }
        }
        regions.sort_by_key(|(moment, _, _)| *moment);
        if let Some((_, name, fd)) = regions.pop() {
            intake.region = Some((name, fd));
        }
        intake
            .stale
            .extend(regions.into_iter().map(|(_, name, _)| name));
        Ok(intake)
    }

    /// Whether anything was passed.
    pub fn is_empty(&self) -> bool {
        self.listeners.is_empty()
            && self.region.is_none()
            && self.connections.is_empty()
            && self.stale.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_taken_in_passing_order_for_this_process_only() {
        let passed = parse(Some("7"), Some("3"), Some("c12:ws:crash-store.4"), 7).unwrap();
        assert_eq!(
            passed,
            vec![
                (3, "c12".to_string()),
                (4, "ws".to_string()),
                (5, "crash-store.4".to_string())
            ]
        );
        assert!(
            parse(Some("8"), Some("3"), None, 7).unwrap().is_empty(),
            "another process's descriptors"
        );
        assert_eq!(
            parse(Some("7"), Some("2"), None, 7).unwrap(),
            vec![(3, "unknown".to_string()), (4, "unknown".to_string())]
        );
        assert!(parse(None, None, None, 7).unwrap().is_empty());
        assert!(parse(Some("7"), Some("lots"), None, 7).is_err());
        // Many more than socket activation's 64: a cell's whole store.
        assert_eq!(
            parse(Some("7"), Some("20000"), None, 7).unwrap().len(),
            20_000
        );
    }
}
