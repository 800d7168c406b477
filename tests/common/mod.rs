//! Helpers shared by the integration tests: each test binary includes this module with
//! `mod common;` and uses what it needs.
#![allow(dead_code)]

pub mod pg;
pub mod store_cases;

use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, Ordering};

/// A new, empty directory under the system temp directory, unique to this call.
pub fn temp_dir(prefix: &str) -> PathBuf {
    static COUNTER: AtomicU32 = AtomicU32::new(0);
    let n = COUNTER.fetch_add(1, Ordering::SeqCst);
    let stamp = orca_relay::clock::system().now_ms();
    let dir = std::env::temp_dir().join(format!(
        "orca-relay-{prefix}-{}-{n}-{stamp}",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("create a temp dir");
    dir
}
