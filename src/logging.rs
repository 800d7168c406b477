//! Logging to stderr for journald: one line per event, `LEVEL target event key=value…`.
//!
//! No timestamps by default when running under systemd (journald stamps every line); set
//! `ORCA_RELAY_LOG_TIMESTAMPS=1` to add them elsewhere.

use std::io::Write;

pub fn init() {
    let timestamps = std::env::var_os("INVOCATION_ID").is_none()
        || std::env::var("ORCA_RELAY_LOG_TIMESTAMPS").is_ok_and(|v| v == "1");
    let mut builder =
        env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("info"));
    builder.format(move |buf, record| {
        if timestamps {
            let ts = buf.timestamp_millis();
            writeln!(buf, "{ts} {} {}", record.level(), record.args())
        } else {
            writeln!(buf, "{} {}", record.level(), record.args())
        }
    });
    let _ = builder.try_init();
    crate::threads::install_panic_logger();
}
