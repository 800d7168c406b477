//! Black-box: hostile things at the switch path (SPEC §5.1, §11): a symlink to `/dev/zero`, a
//! FIFO, a directory, a 65 KiB file, a path nobody can open. Each is one
//! `orca_relay_control_flags_unreadable` line, the applied generation stays, the process stays
//! small, and the next valid write is applied (the watcher never blocks).
//!
//! `ORCA_RELAY_TEST_BINARY=/path/to/orca-relay` runs it against another build.

mod harness;

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use harness::*;

fn start_relay(env: &[(&str, &str)]) -> Relay {
    let dir = Arc::new(TempDir::new("switch"));
    match std::env::var_os("ORCA_RELAY_TEST_BINARY") {
        Some(binary) => Relay::start_binary(Path::new(&binary), dir, env),
        None => Relay::start_in(dir, env),
    }
}

/// Replaces whatever is at `path` with what `make` creates next to it, atomically: the two
/// names are exchanged (`renameat2(RENAME_EXCHANGE)`, which also swaps a file with a directory,
/// where a plain rename fails), so the watcher never sees the path missing in between (that
/// would be a `cause=missing` line of its own).
fn replace_with(path: &Path, make: impl FnOnce(&Path)) {
    let tmp = path.with_extension("next");
    let _ = std::fs::remove_dir_all(&tmp);
    let _ = std::fs::remove_file(&tmp);
    make(&tmp);
    let c_tmp = std::ffi::CString::new(tmp.as_os_str().as_encoded_bytes()).unwrap();
    let c_path = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).unwrap();
    // SAFETY: two valid NUL-terminated paths; renameat2 only renames.
    let exchanged = unsafe {
        libc::renameat2(
            libc::AT_FDCWD,
            c_tmp.as_ptr(),
            libc::AT_FDCWD,
            c_path.as_ptr(),
            libc::RENAME_EXCHANGE,
        )
    };
    assert_eq!(
        exchanged,
        0,
        "exchange {tmp:?} and {path:?}: {}",
        std::io::Error::last_os_error()
    );
    // `tmp` now names what was at `path`.
    let _ = std::fs::remove_dir_all(&tmp);
    let _ = std::fs::remove_file(&tmp);
}

fn mkfifo(path: &Path) {
    let c_path = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).unwrap();
    // SAFETY: a valid NUL-terminated path; mkfifo only creates a node.
    assert_eq!(unsafe { libc::mkfifo(c_path.as_ptr(), 0o600) }, 0);
}

fn resident_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|line| line.strip_prefix("VmRSS:"))
        .and_then(|rest| rest.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap()
}

#[test]
fn hostile_switch_paths_are_one_line_each_and_the_next_write_applies() {
    let relay = start_relay(&[("ORCA_RELAY_SWITCH_POLL_MS", "50")]);
    let path = relay.data_dir.0.join("switch.json");
    let wait = Duration::from_secs(10);
    let applied = |generation: u64| {
        format!("orca_relay_cell_flags_applied cell_id=combined generation={generation} ")
    };
    write_switch(&path, "combined", 1, serde_json::json!({"admitMode":"db"}));
    assert!(relay.wait_for_log(&applied(1), wait).is_some());
    let rss_before = resident_kib(relay.pid());

    type Make = fn(&Path);
    let hostile: [(&str, Make); 5] = [
        (
            "cause=not_regular_file unknown=- applied_generation=1 detail=character_device",
            |tmp| std::os::unix::fs::symlink("/dev/zero", tmp).unwrap(),
        ),
        (
            "cause=not_regular_file unknown=- applied_generation=2 detail=fifo",
            mkfifo,
        ),
        (
            "cause=not_regular_file unknown=- applied_generation=3 detail=directory",
            |tmp| std::fs::create_dir(tmp).unwrap(),
        ),
        (
            "cause=too_large unknown=- applied_generation=4 detail=66560>65536",
            |tmp| std::fs::write(tmp, vec![b' '; 65 * 1024]).unwrap(),
        ),
        // Root can open any file whatever its mode bits: a symlink to itself (ELOOP) is a path
        // that exists and that nobody can open.
        (
            "cause=unreadable unknown=- applied_generation=5 detail=errno_40",
            |tmp| std::os::unix::fs::symlink(tmp.with_file_name("switch.json"), tmp).unwrap(),
        ),
    ];
    let mut generation = 1;
    for (line, make) in hostile {
        replace_with(&path, make);
        let needle = format!("orca_relay_control_flags_unreadable cell_id=combined {line}");
        assert!(
            relay.wait_for_log(&needle, wait).is_some(),
            "no line {needle:?} in:\n{}",
            relay.log_text()
        );
        generation += 1;
        let body = serde_json::json!({"v":1,"cellId":"combined","generation":generation,"flags":{"admitMode":"db"}});
        replace_with(&path, |tmp| std::fs::write(tmp, body.to_string()).unwrap());
        assert!(
            relay.wait_for_log(&applied(generation), wait).is_some(),
            "generation {generation} not applied after {line}:\n{}",
            relay.log_text()
        );
        assert_eq!(relay.count_log(&needle), 1, "{line}: said once");
    }
    assert_eq!(
        relay.count_log("orca_relay_control_flags_unreadable"),
        5,
        "{}",
        relay.log_text()
    );
    // `/dev/zero` was never read: the process did not grow (the old reader grew by gigabytes).
    let rss_after = resident_kib(relay.pid());
    assert!(
        rss_after < rss_before + 32 * 1024,
        "RSS {rss_before} KiB -> {rss_after} KiB"
    );
}
