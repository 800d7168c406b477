//! Process lifecycle: systemd notifications, shutdown signals and the file-descriptor limit
//! (SPEC §8 step 6, §9).
//!
//! Owns: the [`Shutdown`] state every role shares (Running → Draining → Immediate), the
//! `signals` thread that feeds it, and the `sd_notify` datagrams (`READY=1`, `WATCHDOG=1`,
//! `STOPPING=1`, `STATUS=…`).
//!
//! Runs on: the `signals` thread for SIGTERM/SIGINT (and SIGHUP, logged and ignored);
//! notifications go out from whichever thread calls them (one small datagram, no waiting);
//! [`raise_fd_limit`] once at start.
//!
//! Never: does work inside a signal handler (signal-hook's iterator hands each signal to a
//! normal thread); runs a drain callback while holding the shutdown lock; fails or complains
//! when systemd is absent (`NOTIFY_SOCKET` unset means there is no one to tell).

use std::ffi::OsStr;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::net::UnixDatagram;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;
use std::time::Duration;

use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
use signal_hook::iterator::Signals;

use crate::threads;

// ---------------------------------------------------------------------------------------------
// sd_notify
// ---------------------------------------------------------------------------------------------

/// Tells systemd the unit is up (`Type=notify`): sent once registration succeeded and the
/// listeners serve (SPEC §8 step 6).
pub fn notify_ready() {
    notify("READY=1");
}

/// Tells systemd the unit is shutting down, so it stops expecting watchdog pings.
pub fn notify_stopping() {
    notify("STOPPING=1");
}

/// Proves liveness to systemd's `WatchdogSec=`; send every [`watchdog_send_period`].
pub fn notify_watchdog() {
    notify("WATCHDOG=1");
}

/// A one-line status shown by `systemctl status`. Line breaks are flattened, since a newline
/// would start another `KEY=value` assignment in the datagram.
pub fn notify_status(status: &str) {
    notify(&status_message(status));
}

fn status_message(status: &str) -> String {
    let one_line: String = status
        .chars()
        .map(|c| if c == '\n' || c == '\r' { ' ' } else { c })
        .collect();
    format!("STATUS={one_line}")
}

/// Tells systemd that `pid` is the unit's main process from now on (a live handover: the
/// running process names the next one, which `NotifyAccess=main` then lets notify).
pub fn notify_main_pid(pid: u32) {
    notify(&format!("MAINPID={pid}"));
}

/// The `NOTIFY_SOCKET` a live handover's running process had: the next process notifies there
/// whatever environment the `handover` command gave it.
static ADOPTED_NOTIFY_SOCKET: std::sync::OnceLock<std::ffi::OsString> = std::sync::OnceLock::new();

/// The watchdog interval a live handover's running process had (`WATCHDOG_USEC` is set for
/// the unit's main process only, never for `ExecReload=`).
static ADOPTED_WATCHDOG_USEC: std::sync::OnceLock<u64> = std::sync::OnceLock::new();

/// Adopts the running process's `NOTIFY_SOCKET` and watchdog interval (the next process of a
/// live handover, once).
pub fn adopt_systemd(notify_socket: Option<&str>, watchdog_usec: Option<u64>) {
    if let Some(socket) = notify_socket.filter(|s| !s.is_empty()) {
        let _ = ADOPTED_NOTIFY_SOCKET.set(socket.into());
    }
    if let Some(usec) = watchdog_usec.filter(|usec| *usec > 0) {
        let _ = ADOPTED_WATCHDOG_USEC.set(usec);
    }
}

/// The `NOTIFY_SOCKET` in force: adopted from a handover, else the environment's.
pub fn notify_socket() -> Option<std::ffi::OsString> {
    ADOPTED_NOTIFY_SOCKET
        .get()
        .cloned()
        .or_else(|| std::env::var_os("NOTIFY_SOCKET"))
        .filter(|socket| !socket.is_empty())
}

/// The watchdog interval in force, in microseconds (what a handover passes on).
pub fn watchdog_usec() -> Option<u64> {
    ADOPTED_WATCHDOG_USEC
        .get()
        .copied()
        .or_else(|| watchdog_interval_from_env().map(|d| d.as_micros() as u64))
}

/// Waits until systemd has processed every notification sent before (`BARRIER=1`, systemd
/// 246+): a descriptor sent with the message is closed by systemd once it got there. Used
/// before the running process of a handover exits, so that systemd follows `MAINPID=` first.
/// `Ok` without systemd.
pub fn notify_barrier(timeout: Duration) -> io::Result<()> {
    let Some(socket) = notify_socket() else {
        return Ok(());
    };
    let address = parse_notify_socket(&socket)
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "unsupported NOTIFY_SOCKET"))?;
    let mut pipe = [0; 2];
    // SAFETY: pipe2(2) writes two descriptors into the array.
    if unsafe { libc::pipe2(pipe.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(io::Error::last_os_error());
    }
    use std::os::fd::{FromRawFd, OwnedFd};
    // SAFETY: two fresh descriptors.
    let (read_end, write_end) =
        unsafe { (OwnedFd::from_raw_fd(pipe[0]), OwnedFd::from_raw_fd(pipe[1])) };
    let sender = UnixDatagram::unbound()?;
    send_with_fd(&sender, &address, b"BARRIER=1", &write_end)?;
    drop(write_end);
    let mut pollfd = libc::pollfd {
        fd: std::os::fd::AsRawFd::as_raw_fd(&read_end),
        events: 0,
        revents: 0,
    };
    let deadline = crate::clock::instant() + timeout;
    loop {
        let left = deadline.saturating_duration_since(crate::clock::instant());
        if left.is_zero() {
            return Err(io::Error::new(io::ErrorKind::TimedOut, "no barrier"));
        }
        // SAFETY: one valid pollfd; POLLHUP is reported once every write end is closed.
        let ready = unsafe {
            libc::poll(
                &mut pollfd,
                1,
                left.as_millis().clamp(1, i32::MAX as u128) as i32,
            )
        };
        if ready > 0 {
            return Ok(());
        }
        if ready < 0 && io::Error::last_os_error().kind() != io::ErrorKind::Interrupted {
            return Err(io::Error::last_os_error());
        }
    }
}

/// One datagram with one descriptor to the socket named by a `NOTIFY_SOCKET` value, without
/// waiting (`EAGAIN` when the manager's socket is full: the caller tries again). The crash
/// store's `FDSTORE=1` messages go out this way.
pub fn notify_with_fd(
    socket: &OsStr,
    message: &str,
    fd: &impl std::os::fd::AsRawFd,
) -> io::Result<()> {
    let address = parse_notify_socket(socket).ok_or_else(|| {
        io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("unsupported NOTIFY_SOCKET {socket:?}"),
        )
    })?;
    let sender = UnixDatagram::unbound()?;
    send_with_fd_flags(
        &sender,
        &address,
        message.as_bytes(),
        fd,
        libc::MSG_DONTWAIT,
    )
}

/// One datagram with one descriptor (`SCM_RIGHTS`) to the notify socket.
fn send_with_fd(
    sender: &UnixDatagram,
    address: &NotifyAddress,
    message: &[u8],
    fd: &impl std::os::fd::AsRawFd,
) -> io::Result<()> {
    send_with_fd_flags(sender, address, message, fd, 0)
}

fn send_with_fd_flags(
    sender: &UnixDatagram,
    address: &NotifyAddress,
    message: &[u8],
    fd: &impl std::os::fd::AsRawFd,
    flags: libc::c_int,
) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    // SAFETY: sockaddr_un is plain old data.
    let mut target: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    target.sun_family = libc::AF_UNIX as libc::sa_family_t;
    let (name, offset): (&[u8], usize) = match address {
        NotifyAddress::Path(path) => (path.as_os_str().as_bytes(), 0),
        // An abstract name starts with a NUL byte.
        NotifyAddress::Abstract(name) => (name.as_slice(), 1),
    };
    if name.len() + offset >= target.sun_path.len() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "NOTIFY_SOCKET too long",
        ));
    }
    for (slot, byte) in target.sun_path[offset..].iter_mut().zip(name) {
        *slot = *byte as libc::c_char;
    }
    let length =
        std::mem::size_of::<libc::sa_family_t>() + offset + name.len() + usize::from(offset == 0);
    let mut iov = libc::iovec {
        iov_base: message.as_ptr() as *mut libc::c_void,
        iov_len: message.len(),
    };
    // SAFETY: a pure size computation.
    let space = unsafe { libc::CMSG_SPACE(std::mem::size_of::<i32>() as u32) } as usize;
    let mut control = vec![0u64; space.div_ceil(8)];
    // SAFETY: plain old data; every pointer below outlives the call.
    let mut header: libc::msghdr = unsafe { std::mem::zeroed() };
    header.msg_name = &mut target as *mut libc::sockaddr_un as *mut libc::c_void;
    header.msg_namelen = length as libc::socklen_t;
    header.msg_iov = &mut iov;
    header.msg_iovlen = 1;
    header.msg_control = control.as_mut_ptr() as *mut libc::c_void;
    header.msg_controllen = space as _;
    let raw = fd.as_raw_fd();
    // SAFETY: the control buffer holds one cmsghdr with one descriptor.
    unsafe {
        let cmsg = libc::CMSG_FIRSTHDR(&header);
        (*cmsg).cmsg_level = libc::SOL_SOCKET;
        (*cmsg).cmsg_type = libc::SCM_RIGHTS;
        (*cmsg).cmsg_len = libc::CMSG_LEN(std::mem::size_of::<i32>() as u32) as _;
        std::ptr::copy_nonoverlapping(
            &raw as *const i32 as *const u8,
            libc::CMSG_DATA(cmsg),
            std::mem::size_of::<i32>(),
        );
    }
    loop {
        // SAFETY: a message whose buffers live for the call.
        let sent =
            unsafe { libc::sendmsg(sender.as_raw_fd(), &header, libc::MSG_NOSIGNAL | flags) };
        if sent >= 0 {
            return Ok(());
        }
        let error = io::Error::last_os_error();
        if error.kind() != io::ErrorKind::Interrupted {
            return Err(error);
        }
    }
}

/// Sends `message` to `$NOTIFY_SOCKET`; a no-op when it is unset or empty. A failure is
/// logged, never fatal: the relay works without systemd, and systemd's own timeouts report a
/// unit that never became ready.
fn notify(message: &str) {
    let Some(socket) = notify_socket() else {
        return;
    };
    static FAILURES: Mutex<Option<crate::logging::FailureThrottle>> = Mutex::new(None);
    static SINCE: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
    let since = *SINCE.get_or_init(crate::clock::instant);
    let outcome = send_notification(&socket, message);
    let mut failures = FAILURES.lock().unwrap_or_else(|e| e.into_inner());
    let failures = failures.get_or_insert_with(crate::logging::FailureThrottle::new);
    match outcome {
        Ok(()) => {
            if let Some(note) = failures.success() {
                log::info!("orca_relay_sd_notify_recovered{note}");
            }
        }
        Err(error) => {
            let now_ms = crate::clock::instant().duration_since(since).as_millis() as u64;
            if let Some(note) = failures.failure(now_ms) {
                let state = message.split('=').next().unwrap_or(message);
                log::warn!("orca_relay_sd_notify_failed state={state} error={error}{note}");
            }
        }
    }
}

/// Where `NOTIFY_SOCKET` points: a filesystem path, or a Linux abstract-namespace name
/// written with a leading `@`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NotifyAddress {
    Path(std::path::PathBuf),
    Abstract(Vec<u8>),
}

/// Parses a `NOTIFY_SOCKET` value. `None` for an empty value or a form we do not speak
/// (`vsock:` and other schemes).
pub fn parse_notify_socket(value: &OsStr) -> Option<NotifyAddress> {
    let bytes = value.as_bytes();
    match bytes.first() {
        Some(b'@') if bytes.len() > 1 => Some(NotifyAddress::Abstract(bytes[1..].to_vec())),
        Some(b'/') => Some(NotifyAddress::Path(std::path::PathBuf::from(value))),
        _ => None,
    }
}

/// How long a notification waits for room in the manager's socket (its queue full: a manager
/// that does not read it) before it is given up: the thread sending it (the watchdog's, the
/// crash store's) is never held longer.
const NOTIFY_WAIT: Duration = Duration::from_millis(200);

/// Sends one datagram to the socket named by a `NOTIFY_SOCKET` value, waiting at most
/// [`NOTIFY_WAIT`] for room. We write it ourselves rather than through the `sd-notify` crate
/// because that crate does not speak the abstract-namespace `@` form that systemd uses in some
/// containers.
pub fn send_notification(socket: &OsStr, message: &str) -> io::Result<()> {
    let address = parse_notify_socket(socket).ok_or_else(|| {
        io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("unsupported NOTIFY_SOCKET {socket:?}"),
        )
    })?;
    let sender = UnixDatagram::unbound()?;
    sender.set_nonblocking(true)?;
    let deadline = crate::clock::instant() + NOTIFY_WAIT;
    let sent = loop {
        let attempt = match &address {
            NotifyAddress::Path(path) => sender.send_to(message.as_bytes(), path),
            NotifyAddress::Abstract(name) => send_to_abstract(&sender, name, message),
        };
        match attempt {
            // An interrupted send sent nothing: send the datagram again.
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e)
                if e.kind() == io::ErrorKind::WouldBlock && crate::clock::instant() < deadline =>
            {
                crate::clock::sleep(Duration::from_millis(5));
            }
            result => break result?,
        }
    };
    if sent != message.len() {
        return Err(io::Error::new(
            io::ErrorKind::WriteZero,
            "short sd_notify datagram",
        ));
    }
    Ok(())
}

#[cfg(target_os = "linux")]
fn send_to_abstract(sender: &UnixDatagram, name: &[u8], message: &str) -> io::Result<usize> {
    use std::os::linux::net::SocketAddrExt;
    let address = std::os::unix::net::SocketAddr::from_abstract_name(name)?;
    sender.send_to_addr(message.as_bytes(), &address)
}

#[cfg(not(target_os = "linux"))]
fn send_to_abstract(_sender: &UnixDatagram, _name: &[u8], _message: &str) -> io::Result<usize> {
    Err(io::Error::new(
        io::ErrorKind::Unsupported,
        "abstract-namespace sockets exist only on Linux",
    ))
}

/// The watchdog timeout systemd set for us (`WatchdogSec=`), from `WATCHDOG_USEC` and
/// `WATCHDOG_PID` (or adopted from a live handover's running process); `None` when the
/// watchdog is off or meant for another process.
pub fn watchdog_interval() -> Option<Duration> {
    if let Some(usec) = ADOPTED_WATCHDOG_USEC.get() {
        return Some(Duration::from_micros(*usec));
    }
    watchdog_interval_from_env()
}

fn watchdog_interval_from_env() -> Option<Duration> {
    let usec = std::env::var("WATCHDOG_USEC").ok();
    let pid = std::env::var("WATCHDOG_PID").ok();
    parse_watchdog_interval(usec.as_deref(), pid.as_deref(), std::process::id())
}

/// The pure part of [`watchdog_interval`]. `usec` must be a positive integer; `pid`, when set
/// and not empty, must equal `our_pid` (systemd sets it so that children do not ping for the
/// service). Anything malformed reads as "no watchdog", as in `sd_watchdog_enabled(3)`.
pub fn parse_watchdog_interval(
    usec: Option<&str>,
    pid: Option<&str>,
    our_pid: u32,
) -> Option<Duration> {
    let usec: u64 = usec
        .map(str::trim)
        .filter(|s| !s.is_empty())?
        .parse()
        .ok()?;
    if usec == 0 {
        return None;
    }
    if let Some(pid) = pid.map(str::trim).filter(|s| !s.is_empty()) {
        if pid.parse::<u32>().ok()? != our_pid {
            return None;
        }
    }
    Some(Duration::from_micros(usec))
}

/// How often to send `WATCHDOG=1`: half the watchdog timeout, as systemd recommends, so one
/// late ping never trips it.
pub fn watchdog_send_period(interval: Duration) -> Duration {
    interval / 2
}

// ---------------------------------------------------------------------------------------------
// Listeners from systemd (LISTEN_FDS)
// ---------------------------------------------------------------------------------------------

/// The listening sockets the service manager passed by name (`ws`, `http`: from the optional
/// socket units or the descriptor store, taken by `crash_store::Intake`). A descriptor that is
/// not a listening TCP socket is an error naming it.
pub fn listeners_from(
    passed: std::collections::BTreeMap<String, std::os::fd::OwnedFd>,
) -> Result<Vec<(String, std::net::TcpListener)>, String> {
    use std::os::fd::AsRawFd;
    let mut listeners = Vec::new();
    for (name, fd) in passed {
        let mut accepting: libc::c_int = 0;
        let mut length = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
        // SAFETY: getsockopt into an int we own; fails cleanly on a descriptor that is not a
        // socket.
        let ok = unsafe {
            libc::getsockopt(
                fd.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_ACCEPTCONN,
                &mut accepting as *mut libc::c_int as *mut libc::c_void,
                &mut length,
            )
        } == 0;
        if !ok || accepting == 0 {
            return Err(format!(
                "descriptor {} ({name}) from systemd is not a listening socket",
                fd.as_raw_fd()
            ));
        }
        listeners.push((name, std::net::TcpListener::from(fd)));
    }
    Ok(listeners)
}

// ---------------------------------------------------------------------------------------------
// Shutdown
// ---------------------------------------------------------------------------------------------

/// Where the process is in its shutdown.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ShutdownState {
    /// Serving normally.
    Running,
    /// The first SIGTERM/SIGINT: `/ready` says draining, listeners stop accepting, desktops
    /// get `drain`, the rest close after the drain grace (SPEC §9).
    Draining,
    /// The second signal: the process exits at once.
    Immediate,
}

type DrainCallback = Arc<dyn Fn() + Send + Sync>;

/// A live handover past its commit decision ([`Shutdown::commit_handover`]): stop signals
/// that arrive from then on are the next process's, not this one's.
#[derive(Debug, Clone, Copy)]
struct Handing {
    /// The next process.
    to_pid: u32,
    /// Stop signals that arrived before the next process was told `committed`.
    stops: u32,
    /// The next process has been sent `committed` (with the stops so far).
    told: bool,
}

/// What one stop signal does ([`Shutdown::advance`]).
enum Step {
    /// The first: the drain begins (with these callbacks to run).
    Drain(Vec<DrainCallback>),
    /// The second: exit at once.
    Immediate,
    /// A handover is past its commit decision: the signal is kept for the next process
    /// (`told` false: it goes with `committed`), or is already the next process's (`told`).
    Handed { to_pid: u32, told: bool },
}

struct ShutdownInner {
    /// Set from a live handover's commit decision until the process exits (or the commit fails).
    handing: Option<Handing>,
    state: ShutdownState,
    /// Run once each when the drain begins (or at once if registered later).
    drain_callbacks: Vec<DrainCallback>,
    /// Closes the `signals` thread's iterator so that thread can be joined.
    signal_handle: Option<signal_hook::iterator::Handle>,
}

/// The shared shutdown state. Cheap to clone: every clone is the same state.
#[derive(Clone)]
pub struct Shutdown {
    shared: Arc<(Mutex<ShutdownInner>, Condvar)>,
}

impl Default for Shutdown {
    fn default() -> Self {
        Shutdown::new()
    }
}

impl std::fmt::Debug for Shutdown {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shutdown")
            .field("state", &self.state())
            .finish()
    }
}

impl Shutdown {
    pub fn new() -> Shutdown {
        Shutdown {
            shared: Arc::new((
                Mutex::new(ShutdownInner {
                    handing: None,
                    state: ShutdownState::Running,
                    drain_callbacks: Vec::new(),
                    signal_handle: None,
                }),
                Condvar::new(),
            )),
        }
    }

    /// The state lock. Nothing panics while holding it, but if something did, the state is
    /// still a plain enum and a list, so we keep using it.
    fn lock(&self) -> MutexGuard<'_, ShutdownInner> {
        self.shared.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub fn state(&self) -> ShutdownState {
        self.lock().state
    }

    /// True once a shutdown was requested (draining, or exiting at once).
    pub fn is_draining(&self) -> bool {
        self.state() != ShutdownState::Running
    }

    pub fn is_immediate(&self) -> bool {
        self.state() == ShutdownState::Immediate
    }

    /// Starts the drain (Running → Draining) and runs the drain callbacks; returns whether
    /// this call started it. Roles and tests use it; signals go through [`Shutdown::request`].
    pub fn begin_drain(&self) -> bool {
        let callbacks = {
            let mut inner = self.lock();
            if inner.state != ShutdownState::Running {
                return false;
            }
            inner.state = ShutdownState::Draining;
            inner.drain_callbacks.clone()
        };
        self.shared.1.notify_all();
        run_callbacks(&callbacks);
        true
    }

    /// What one SIGTERM/SIGINT does: Running → Draining (running the drain callbacks), then
    /// Draining → Immediate. Returns the new state. Exiting on Immediate is the caller's job
    /// (the `signals` thread), so that this stays testable. Past a handover's commit decision
    /// the state does not move (the request is the next process's).
    pub fn request(&self) -> ShutdownState {
        match self.advance() {
            Step::Drain(callbacks) => {
                run_callbacks(&callbacks);
                ShutdownState::Draining
            }
            Step::Immediate => ShutdownState::Immediate,
            Step::Handed { .. } => self.state(),
        }
    }

    /// Moves one step and returns what to do for it, without doing it.
    fn advance(&self) -> Step {
        let step = {
            let mut inner = self.lock();
            if let Some(handing) = inner.handing.as_mut() {
                if !handing.told {
                    handing.stops += 1;
                }
                return Step::Handed {
                    to_pid: handing.to_pid,
                    told: handing.told,
                };
            }
            match inner.state {
                ShutdownState::Running => {
                    inner.state = ShutdownState::Draining;
                    Step::Drain(inner.drain_callbacks.clone())
                }
                ShutdownState::Draining | ShutdownState::Immediate => {
                    inner.state = ShutdownState::Immediate;
                    Step::Immediate
                }
            }
        };
        self.shared.1.notify_all();
        step
    }

    /// A live handover's commit decision, against a stop (ARCHITECTURE.md "Live handover"):
    /// true when no stop was requested before it, and from now on a stop signal is the next
    /// process's (`to_pid`): one that arrives before it is told `committed` goes with that
    /// word ([`Shutdown::stops_for_commit`]); one after, it hears itself (from systemd, which
    /// signals the whole unit; without systemd this process passes it on). False when a stop
    /// came first: it is honoured here, the handover rolls back and this process drains.
    pub fn commit_handover(&self, to_pid: u32) -> bool {
        let mut inner = self.lock();
        if inner.state != ShutdownState::Running {
            return false;
        }
        inner.handing = Some(Handing {
            to_pid,
            stops: 0,
            told: false,
        });
        true
    }

    /// The stop signals that arrived since the commit decision, for the `committed` word; any
    /// later one is the next process's own.
    pub fn stops_for_commit(&self) -> u32 {
        let mut inner = self.lock();
        match inner.handing.as_mut() {
            Some(handing) => {
                handing.told = true;
                handing.stops
            }
            None => 0,
        }
    }

    /// The commit failed after its decision (the next process went away): this process serves
    /// on, and a stop that arrived meanwhile is its own again (replayed, as its signals would
    /// have been).
    pub fn abandon_handover(&self) {
        let stops = self.lock().handing.take().map_or(0, |h| h.stops);
        for _ in 0..stops.min(2) {
            match self.advance() {
                Step::Drain(callbacks) => {
                    log::info!("orca_relay_shutdown_draining signal=SIGTERM after=handover_failed");
                    notify_stopping();
                    run_callbacks(&callbacks);
                }
                Step::Immediate => {
                    log::warn!(
                        "orca_relay_shutdown_immediate signal=SIGTERM after=handover_failed"
                    );
                    log::logger().flush();
                    std::process::exit(0);
                }
                Step::Handed { .. } => {}
            }
        }
    }

    /// Begins the drain as a first SIGTERM would (the log line, `STOPPING=1`, the callbacks),
    /// for a stop this process inherited from the one it took over from. False when it had
    /// begun already.
    pub fn drain_inherited(&self) -> bool {
        let callbacks = {
            let mut inner = self.lock();
            if inner.state != ShutdownState::Running {
                return false;
            }
            inner.state = ShutdownState::Draining;
            inner.drain_callbacks.clone()
        };
        self.shared.1.notify_all();
        log::info!("orca_relay_shutdown_draining signal=SIGTERM inherited=handover");
        notify_stopping();
        run_callbacks(&callbacks);
        true
    }

    /// Registers something to run when the drain begins, typically unblocking a server so
    /// its accept loop ends. Runs at once, on this thread, if the drain already began.
    pub fn on_drain(&self, callback: Box<dyn Fn() + Send + Sync>) {
        let callback: DrainCallback = Arc::from(callback);
        let run_now = {
            let mut inner = self.lock();
            if inner.state == ShutdownState::Running {
                inner.drain_callbacks.push(callback.clone());
                false
            } else {
                true
            }
        };
        if run_now {
            callback();
        }
    }

    /// Waits up to `timeout` for a shutdown request; returns whether one was made (at once if
    /// it already was). Role loops use it as their tick: `while !shutdown.wait_timeout(tick)`.
    pub fn wait_timeout(&self, timeout: Duration) -> bool {
        self.wait_while_in(ShutdownState::Running, timeout)
    }

    /// Waits up to `timeout` while the state is still `state`; returns whether it has moved
    /// on. The drain waits with `wait_while_in(Draining, …)`: it sleeps until its deadline or
    /// a second signal, where [`Shutdown::wait_timeout`] would return at once (the state is no
    /// longer Running) and turn the drain's wait into a spin.
    pub fn wait_while_in(&self, state: ShutdownState, timeout: Duration) -> bool {
        let guard = self.lock();
        let (guard, _) = self
            .shared
            .1
            .wait_timeout_while(guard, timeout, |inner| inner.state == state)
            .unwrap_or_else(PoisonError::into_inner);
        guard.state != state
    }

    /// Ends the `signals` thread (its iterator stops), so it can be joined at shutdown. After
    /// this, SIGTERM/SIGINT are still caught but no longer acted on.
    pub fn close_signal_listener(&self) {
        if let Some(handle) = self.lock().signal_handle.take() {
            handle.close();
        }
    }
}

fn shutdown_state_name(state: ShutdownState) -> &'static str {
    match state {
        ShutdownState::Running => "running",
        ShutdownState::Draining => "draining",
        ShutdownState::Immediate => "exiting",
    }
}

fn run_callbacks(callbacks: &[DrainCallback]) {
    for callback in callbacks {
        callback();
    }
}

fn signal_name(signal: i32) -> &'static str {
    match signal {
        SIGTERM => "SIGTERM",
        SIGINT => "SIGINT",
        SIGHUP => "SIGHUP",
        _ => "other",
    }
}

/// What the process does with a signal it catches (docs/OPERATIONS.md, "Signals").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SignalAction {
    /// SIGTERM, SIGINT: one step of the shutdown (drain, then exit at once).
    Shutdown,
    /// SIGHUP: logged and ignored. Its default action would end the process at once, with no
    /// drain, and systemd counts a death by SIGHUP as a clean exit, so `Restart=on-failure`
    /// would leave the unit dead. It has no meaning yet; the live handover may give it one.
    Ignore,
}

/// The signals the `signals` thread catches.
pub const CAUGHT_SIGNALS: [i32; 3] = [SIGTERM, SIGINT, SIGHUP];

pub fn signal_action(signal: i32) -> SignalAction {
    match signal {
        SIGHUP => SignalAction::Ignore,
        _ => SignalAction::Shutdown,
    }
}

/// Catches SIGTERM, SIGINT and SIGHUP on a thread named `signals`. The first SIGTERM/SIGINT
/// begins the drain (logs `orca_relay_shutdown_draining`, sends `STOPPING=1`, runs the drain
/// callbacks); the second logs `orca_relay_shutdown_immediate` and exits the process with
/// status 0 at once (SPEC §9). SIGHUP logs `orca_relay_signal_ignored signal=SIGHUP` and
/// changes nothing.
pub fn install_signal_handlers(shutdown: &Shutdown) -> io::Result<JoinHandle<()>> {
    let mut signals = Signals::new(CAUGHT_SIGNALS)?;
    shutdown.lock().signal_handle = Some(signals.handle());
    let shutdown = shutdown.clone();
    threads::spawn("signals", move || {
        for signal in signals.forever() {
            let name = signal_name(signal);
            if signal_action(signal) == SignalAction::Ignore {
                // WARN: whoever sent it expected something to happen, and nothing did.
                log::warn!(
                    "orca_relay_signal_ignored signal={name} state={}",
                    shutdown_state_name(shutdown.state())
                );
                continue;
            }
            match shutdown.advance() {
                Step::Drain(callbacks) => {
                    log::info!("orca_relay_shutdown_draining signal={name}");
                    notify_stopping();
                    run_callbacks(&callbacks);
                }
                Step::Immediate => {
                    log::warn!("orca_relay_shutdown_immediate signal={name}");
                    log::logger().flush();
                    std::process::exit(0);
                }
                // Past a handover's commit decision: the next process's stop. Before it is
                // told `committed`, the word carries it; after, systemd signals the whole unit
                // (the next process too), and without systemd it is passed on.
                Step::Handed { to_pid, told } => {
                    let forward = told && notify_socket().is_none();
                    log::info!(
                        "orca_relay_shutdown_handed signal={name} to_pid={to_pid} passed_on={}",
                        if !told {
                            "with_commit"
                        } else if forward {
                            "signal"
                        } else {
                            "by_systemd"
                        }
                    );
                    if forward {
                        // SAFETY: kill(2) on the process this one handed over to.
                        unsafe { libc::kill(to_pid as libc::pid_t, signal) };
                    }
                }
            }
        }
    })
}

// ---------------------------------------------------------------------------------------------
// File descriptors
// ---------------------------------------------------------------------------------------------

/// Raises the soft `RLIMIT_NOFILE` to the hard limit: a cell holds one descriptor per
/// WebSocket connection, and the usual soft default (1024) is far below the connection cap.
/// Returns (old soft limit, new soft limit). An unlimited hard limit is read as the kernel's
/// `fs.nr_open`, the most a process can actually have.
pub fn raise_fd_limit() -> io::Result<(u64, u64)> {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes into the struct we own and pass by pointer.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } != 0 {
        return Err(io::Error::last_os_error());
    }
    let old: u64 = limit.rlim_cur;
    let hard = if limit.rlim_max == libc::RLIM_INFINITY {
        kernel_nr_open().unwrap_or(old)
    } else {
        limit.rlim_max
    };
    if hard <= old {
        return Ok((old, old));
    }
    limit.rlim_cur = hard;
    // SAFETY: setrlimit reads the struct we own; raising the soft limit up to the hard limit
    // needs no privilege.
    if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &limit) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok((old, hard))
}

/// The soft `RLIMIT_NOFILE` (`None` if unreadable or unlimited).
pub fn nofile_limit() -> Option<u64> {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes into the struct we own and pass by pointer.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } != 0
        || limit.rlim_cur == libc::RLIM_INFINITY
    {
        return None;
    }
    Some(limit.rlim_cur)
}

/// The process's highest open descriptor number plus one (0 if `/proc/self/fd` cannot be
/// read); at most the descriptor limit's worth of entries is looked at.
pub fn descriptors_in_use() -> usize {
    let Ok(entries) = std::fs::read_dir("/proc/self/fd") else {
        return 0;
    };
    entries
        .take(nofile_limit().unwrap_or(1 << 20) as usize)
        .filter_map(|entry| entry.ok()?.file_name().to_str()?.parse::<usize>().ok())
        .max()
        .map_or(0, |highest| highest + 1)
}

/// Grows this process's descriptor table to hold `more` descriptors past its highest open one
/// (within the descriptor limit), by duplicating `fd` that high and closing the copy: a
/// handover's next process does it before anything pauses. Receiving two thousand descriptors
/// into a table that doubles as they come made the kernel grow it six times, each time waiting
/// for an RCU grace period (the table is shared by two thousand threads): 40–50 ms of the
/// controls' pause on two busy cores. A table never shrinks.
pub fn grow_descriptor_table(more: usize, fd: std::os::fd::RawFd) {
    if more == 0 {
        return;
    }
    let limit = nofile_limit().unwrap_or(1024) as usize;
    let target = descriptors_in_use()
        .saturating_add(more)
        .min(limit.saturating_sub(1));
    let Ok(target) = libc::c_int::try_from(target) else {
        return;
    };
    // SAFETY: F_DUPFD_CLOEXEC on a descriptor this process owns; the copy is closed at once.
    let copy = unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, target) };
    if copy >= 0 {
        // SAFETY: the copy was just made and nothing else knows it.
        unsafe { libc::close(copy) };
    }
}

fn kernel_nr_open() -> Option<u64> {
    crate::local_file::read_bounded_to_string(std::path::Path::new("/proc/sys/fs/nr_open"), 64)
        .ok()?
        .trim()
        .parse()
        .ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_grown_descriptor_table_holds_the_descriptors_to_come() {
        let table_size = || {
            let path = std::path::Path::new("/proc/self/status");
            let status = crate::local_file::read_bounded_to_string(path, 64 * 1024).unwrap();
            status
                .lines()
                .find_map(|line| line.strip_prefix("FDSize:"))
                .and_then(|size| size.trim().parse::<usize>().ok())
                .unwrap()
        };
        let _ = raise_fd_limit();
        let limit = nofile_limit().unwrap_or(1024) as usize;
        let wanted = (descriptors_in_use() + 3_000).min(limit);
        let file = std::fs::File::open("/dev/null").unwrap();
        grow_descriptor_table(3_000, std::os::fd::AsRawFd::as_raw_fd(&file));
        assert!(
            table_size() >= wanted,
            "a table of {} for {wanted}",
            table_size()
        );
    }

    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::mpsc;

    #[test]
    fn watchdog_interval_parsing() {
        let pid = 4242;
        let cases: &[(Option<&str>, Option<&str>, Option<Duration>)] = &[
            (None, None, None),
            (Some(""), None, None),
            (Some("0"), None, None),
            (Some("abc"), None, None),
            (Some("-5"), None, None),
            (Some("30000000"), None, Some(Duration::from_secs(30))),
            (Some(" 30000000 "), Some(""), Some(Duration::from_secs(30))),
            (
                Some("30000000"),
                Some("4242"),
                Some(Duration::from_secs(30)),
            ),
            (Some("30000000"), Some("4243"), None),
            (Some("30000000"), Some("not-a-pid"), None),
        ];
        for &(usec, watchdog_pid, expected) in cases {
            assert_eq!(
                parse_watchdog_interval(usec, watchdog_pid, pid),
                expected,
                "WATCHDOG_USEC={usec:?} WATCHDOG_PID={watchdog_pid:?}"
            );
        }
        assert_eq!(
            watchdog_send_period(Duration::from_secs(30)),
            Duration::from_secs(15)
        );
    }

    #[test]
    fn notify_socket_forms() {
        assert_eq!(
            parse_notify_socket(OsStr::new("/run/systemd/notify")),
            Some(NotifyAddress::Path("/run/systemd/notify".into()))
        );
        assert_eq!(
            parse_notify_socket(OsStr::new("@/org/freedesktop/systemd1/notify/123")),
            Some(NotifyAddress::Abstract(
                b"/org/freedesktop/systemd1/notify/123".to_vec()
            ))
        );
        assert_eq!(parse_notify_socket(OsStr::new("")), None);
        assert_eq!(parse_notify_socket(OsStr::new("@")), None);
        assert_eq!(parse_notify_socket(OsStr::new("vsock:2:1234")), None);
        assert!(send_notification(OsStr::new("relative/path"), "READY=1").is_err());
    }

    #[test]
    fn status_is_one_line() {
        assert_eq!(
            status_message("registered\nwith 2 directors"),
            "STATUS=registered with 2 directors"
        );
    }

    #[test]
    fn first_request_drains_and_second_is_immediate() {
        let shutdown = Shutdown::new();
        assert_eq!(shutdown.state(), ShutdownState::Running);
        assert!(!shutdown.is_draining());

        assert_eq!(shutdown.request(), ShutdownState::Draining);
        assert!(shutdown.is_draining());
        assert!(!shutdown.is_immediate());

        assert_eq!(shutdown.clone().request(), ShutdownState::Immediate);
        assert!(shutdown.is_draining());
        assert!(shutdown.is_immediate());
        assert_eq!(shutdown.request(), ShutdownState::Immediate);
    }

    /// A live handover's commit decision against a stop (issue 31): a stop first refuses the
    /// commit (the handover rolls back, this process drains); a stop after the decision does
    /// not move this process (it goes with `committed`, counted until the word is sent); a
    /// commit that then fails gives the stop back to this process.
    #[test]
    fn a_stop_before_the_commit_decision_refuses_it_and_one_after_goes_with_it() {
        let stopped_first = Shutdown::new();
        assert_eq!(stopped_first.request(), ShutdownState::Draining);
        assert!(!stopped_first.commit_handover(42));

        let shutdown = Shutdown::new();
        assert!(shutdown.commit_handover(42));
        assert_eq!(shutdown.request(), ShutdownState::Running);
        assert!(!shutdown.is_draining(), "the stop is the next process's");
        assert_eq!(shutdown.stops_for_commit(), 1);
        // After the word: not counted any more (systemd, or this process, signals the next).
        assert_eq!(shutdown.request(), ShutdownState::Running);
        assert_eq!(shutdown.stops_for_commit(), 1);

        let failed = Shutdown::new();
        assert!(failed.commit_handover(42));
        failed.request();
        assert!(!failed.is_draining());
        failed.abandon_handover();
        assert_eq!(
            failed.state(),
            ShutdownState::Draining,
            "the stop is honoured here"
        );
    }

    #[test]
    fn drain_callbacks_run_exactly_once_and_late_ones_run_at_once() {
        let shutdown = Shutdown::new();
        let calls = Arc::new(AtomicUsize::new(0));
        let counter = calls.clone();
        shutdown.on_drain(Box::new(move || {
            counter.fetch_add(1, Ordering::SeqCst);
        }));
        assert_eq!(calls.load(Ordering::SeqCst), 0);

        assert!(shutdown.begin_drain());
        assert_eq!(calls.load(Ordering::SeqCst), 1);
        assert!(!shutdown.begin_drain(), "already draining");
        assert_eq!(shutdown.request(), ShutdownState::Immediate);
        assert_eq!(calls.load(Ordering::SeqCst), 1, "escalation does not rerun");

        let late = calls.clone();
        shutdown.on_drain(Box::new(move || {
            late.fetch_add(10, Ordering::SeqCst);
        }));
        assert_eq!(calls.load(Ordering::SeqCst), 11);
    }

    #[test]
    fn wait_timeout_times_out_while_running() {
        let shutdown = Shutdown::new();
        assert!(!shutdown.wait_timeout(Duration::from_millis(20)));
        shutdown.begin_drain();
        assert!(shutdown.wait_timeout(Duration::ZERO));
    }

    #[test]
    fn the_drain_waits_until_its_deadline_or_a_second_signal() {
        let shutdown = Shutdown::new();
        shutdown.begin_drain();
        // Draining: the drain's wait sleeps its whole timeout (wait_timeout returns at once).
        let started = crate::clock::instant();
        assert!(!shutdown.wait_while_in(ShutdownState::Draining, Duration::from_millis(200)));
        assert!(started.elapsed() >= Duration::from_millis(200));
        assert!(
            shutdown.wait_timeout(Duration::from_secs(30)),
            "no wait once draining"
        );
        // A second signal wakes it.
        let (go, ready) = mpsc::channel::<()>();
        let second = {
            let shutdown = shutdown.clone();
            threads::spawn("test-second-signal", move || {
                ready.recv().expect("go signal");
                shutdown.request();
            })
            .expect("spawn")
        };
        let started = crate::clock::instant();
        go.send(()).expect("signaller alive");
        assert!(shutdown.wait_while_in(ShutdownState::Draining, Duration::from_secs(30)));
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "woken by the second signal, not the timeout"
        );
        assert!(shutdown.is_immediate());
        second.join().expect("signaller joined");
    }

    #[test]
    fn sighup_is_ignored_and_the_shutdown_signals_step_the_shutdown() {
        assert_eq!(signal_action(SIGHUP), SignalAction::Ignore);
        assert_eq!(signal_action(SIGTERM), SignalAction::Shutdown);
        assert_eq!(signal_action(SIGINT), SignalAction::Shutdown);
        assert!(CAUGHT_SIGNALS.contains(&SIGHUP));
    }

    #[test]
    fn wait_timeout_wakes_when_another_thread_begins_the_drain() {
        let shutdown = Shutdown::new();
        let (go, ready) = mpsc::channel::<()>();
        let drainer = {
            let shutdown = shutdown.clone();
            threads::spawn("test-drainer", move || {
                ready.recv().expect("go signal");
                shutdown.begin_drain();
            })
            .expect("spawn")
        };
        let started = crate::clock::instant();
        go.send(()).expect("drainer alive");
        assert!(shutdown.wait_timeout(Duration::from_secs(30)));
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "woken by the state change, not the timeout"
        );
        drainer.join().expect("drainer joined");
    }

    #[test]
    fn the_fd_soft_limit_is_raised_to_the_hard_limit() {
        let (old, new) = raise_fd_limit().expect("raise fd limit");
        assert!(new >= old);
        let mut limit = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: as in raise_fd_limit.
        assert_eq!(
            unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) },
            0
        );
        assert_eq!(limit.rlim_cur, new);
        // A second call finds nothing left to raise.
        assert_eq!(raise_fd_limit().expect("raise again"), (new, new));
    }
}
