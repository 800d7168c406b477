//! Named threads. The only module that spawns threads.
//!
//! Every role thread has a name (`acceptor`, `relay-17`, `watchdog`, …) so that `top -H`,
//! panics and logs say which role misbehaved. A panic in a role thread is logged with the
//! thread's name by [`install_panic_logger`]; a panic in a relay thread costs that connection
//! only.

use std::io;
use std::thread::JoinHandle;

/// Stack size for a relay thread: one per WebSocket connection. Only touched pages count
/// towards resident memory; 256 KiB leaves room for the postgres client and RSA verification.
pub const RELAY_STACK_BYTES: usize = 256 * 1024;

/// Stack size for the long-lived role threads.
pub const ROLE_STACK_BYTES: usize = 1024 * 1024;

/// Spawns a named role thread with the default role stack.
pub fn spawn<F, T>(name: impl Into<String>, f: F) -> io::Result<JoinHandle<T>>
where
    F: FnOnce() -> T + Send + 'static,
    T: Send + 'static,
{
    spawn_with_stack(name, ROLE_STACK_BYTES, f)
}

/// Spawns a named thread with an explicit stack size.
pub fn spawn_with_stack<F, T>(
    name: impl Into<String>,
    stack_bytes: usize,
    f: F,
) -> io::Result<JoinHandle<T>>
where
    F: FnOnce() -> T + Send + 'static,
    T: Send + 'static,
{
    std::thread::Builder::new()
        .name(name.into())
        .stack_size(stack_bytes)
        .spawn(f)
}

/// Logs panics with the thread's name instead of only printing them to stderr, so that a
/// panicking role thread shows up in the journal as an event.
pub fn install_panic_logger() {
    let default_hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let thread = std::thread::current();
        let name = thread.name().unwrap_or("unnamed");
        log::error!("orca_relay_thread_panicked thread={name} detail={info}");
        if std::env::var_os("ORCA_RELAY_PANIC_BACKTRACE").is_some() {
            default_hook(info);
        }
    }));
}

/// Joins a thread and logs (rather than propagates) its panic.
pub fn join_logged<T>(name: &str, handle: JoinHandle<T>) -> Option<T> {
    match handle.join() {
        Ok(value) => Some(value),
        Err(_) => {
            log::error!("orca_relay_thread_join_failed thread={name}");
            None
        }
    }
}
