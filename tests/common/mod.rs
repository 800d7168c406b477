//! Helpers shared by the integration tests: each test binary includes this module with
//! `mod common;` and uses what it needs.
#![allow(dead_code)]

pub mod pg;
pub mod store_cases;

use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, Ordering};

/// A new, empty directory, unique to this call, under this test process's own directory in the
/// system temp directory. That directory is removed when the process exits (the test harness
/// ends with `exit`, which runs `atexit` handlers, whether its tests passed or not): a store
/// keeps its file open for as long as the test runs, so nothing sooner can remove it.
pub fn temp_dir(prefix: &str) -> PathBuf {
    static COUNTER: AtomicU32 = AtomicU32::new(0);
    static CLEANUP: std::sync::Once = std::sync::Once::new();
    CLEANUP.call_once(|| {
        // SAFETY: registers a plain function with no arguments; it runs once at exit.
        unsafe {
            libc::atexit(remove_process_dir);
        }
    });
    let n = COUNTER.fetch_add(1, Ordering::SeqCst);
    let dir = process_dir().join(format!("{prefix}-{n}"));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("create a temp dir");
    dir
}

/// `orca-relay-tests-<pid>` in the system temp directory: where [`temp_dir`] makes its dirs.
fn process_dir() -> PathBuf {
    std::env::temp_dir().join(format!("orca-relay-tests-{}", std::process::id()))
}

extern "C" fn remove_process_dir() {
    let _ = std::fs::remove_dir_all(process_dir());
}
