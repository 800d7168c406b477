//! A flag that `poll(2)` can wait on beside a socket: an eventfd that is readable once set.
//!
//! Stops an accept loop without a connection to itself (during a live handover a listening
//! socket is shared by two processes, and such a connection could land in the other one) and
//! without `shutdown(2)` on the listener (which would stop it for both). Also wakes the relay
//! threads for a handover's quiesce (`relay/park.rs`).

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// The flag: set and cleared by its owner, waited on by `poll`.
pub struct Wake {
    fd: OwnedFd,
    set: AtomicBool,
}

impl std::fmt::Debug for Wake {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Wake").field("set", &self.is_set()).finish()
    }
}

impl Wake {
    pub fn new() -> io::Result<Arc<Wake>> {
        // SAFETY: eventfd(2) with constant flags; the result is checked.
        let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(Arc::new(Wake {
            // SAFETY: a fresh descriptor nothing else owns.
            fd: unsafe { OwnedFd::from_raw_fd(fd) },
            set: AtomicBool::new(false),
        }))
    }

    pub fn set(&self) {
        self.set.store(true, Ordering::SeqCst);
        let one: u64 = 1;
        // SAFETY: an 8-byte write to our eventfd.
        let _ = unsafe {
            libc::write(
                self.fd.as_raw_fd(),
                &one as *const u64 as *const libc::c_void,
                8,
            )
        };
    }

    pub fn clear(&self) {
        self.set.store(false, Ordering::SeqCst);
        let mut value: u64 = 0;
        // SAFETY: an 8-byte read from our non-blocking eventfd resets it.
        let _ = unsafe {
            libc::read(
                self.fd.as_raw_fd(),
                &mut value as *mut u64 as *mut libc::c_void,
                8,
            )
        };
    }

    pub fn is_set(&self) -> bool {
        self.set.load(Ordering::SeqCst)
    }

    pub fn raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }
}

/// What [`wait_acceptable_within`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Acceptable {
    /// A connection waits to be accepted.
    Yes,
    /// Nothing within the wait.
    NotYet,
    /// `stop` is set.
    Stopped,
}

/// Waits at most `wait` until `listener` has a connection to accept or `stop` is set (a loop
/// that must show progress on its own wakes up at least that often).
pub fn wait_acceptable_within(
    listener: &std::net::TcpListener,
    stop: &Wake,
    wait: std::time::Duration,
) -> Acceptable {
    let timeout = wait.as_millis().clamp(1, i32::MAX as u128) as libc::c_int;
    loop {
        if stop.is_set() {
            return Acceptable::Stopped;
        }
        let mut fds = [
            libc::pollfd {
                fd: listener.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: stop.raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        // SAFETY: two valid pollfds for the duration of the call.
        let ready = unsafe { libc::poll(fds.as_mut_ptr(), 2, timeout) };
        if ready < 0 {
            if io::Error::last_os_error().kind() == io::ErrorKind::Interrupted {
                continue;
            }
            // Let accept report what is wrong.
            return if stop.is_set() {
                Acceptable::Stopped
            } else {
                Acceptable::Yes
            };
        }
        if ready == 0 {
            return Acceptable::NotYet;
        }
        if fds[1].revents != 0 {
            continue;
        }
        if fds[0].revents != 0 {
            return Acceptable::Yes;
        }
    }
}
