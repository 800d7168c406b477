//! Role wiring: build the shared state, start every named thread of the role, own their
//! handles, and run the shutdown order. Nothing here makes a decision of its own.

pub mod cell;
pub mod cell_runtime;
pub mod combined;
pub mod director;
pub mod handover;
pub mod process;
pub mod resume;

use crate::config::{Config, Role};
pub use process::RunError;

/// Runs the configured role until shutdown.
pub fn run(config: Config) -> Result<(), RunError> {
    apply_test_clock_offset(&config)?;
    let result = match config.role {
        Role::Combined => combined::run(config, None),
        Role::Cell => cell::run(config, None),
        Role::Director => director::run(config),
    };
    // The process exits with the role's own status: a critical thread ending from here on
    // (what it waited on went with the role) is not a failure of its own.
    crate::liveness::process_finishing();
    result
}

/// Before anything reads the clock: the test knob that runs this process's wall clock off.
fn apply_test_clock_offset(config: &Config) -> Result<(), RunError> {
    if config.test_clock_offset_ms != 0 {
        crate::clock::offset_system_clock(config.test_clock_offset_ms).map_err(RunError)?;
        log::warn!(
            "orca_relay_test_clock_offset offset_ms={} note=test_knob_never_set_in_production",
            config.test_clock_offset_ms
        );
    }
    Ok(())
}

/// The next process of a live handover (`orca-relay run --take-over …`): the configured role,
/// built from the running process's state. Any failure before the commit is reported to the
/// running process, which keeps everything (this process exits 1).
pub fn take_over(config: Config, take_over: handover::TakeOver) -> Result<(), RunError> {
    // The next process runs on the same machine clock as the one it replaces (a handover of a
    // cell whose clock is off keeps it off; found by the nemesis: it fell back to the true
    // clock).
    let result = apply_test_clock_offset(&config).and_then(|()| match config.role {
        Role::Combined => combined::run(config, Some(take_over.clone())),
        Role::Cell => cell::run(config, Some(take_over.clone())),
        Role::Director => Err(RunError(
            "a director holds no connections to hand over: restart it instead".into(),
        )),
    });
    crate::liveness::process_finishing();
    if let (Err(e), false) = (&result, handover::committed()) {
        // The running process is still waiting for this one to be ready, or for its
        // confirmation (a closed socket tells it too).
        handover::report_failed(&take_over.socket, &take_over.token, &e.0);
    }
    result
}
