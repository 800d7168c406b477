//! Named threads. The only module that spawns threads.
//!
//! Every role thread has a name (`acceptor`, `relay-17`, `watchdog`, …) so that `top -H`,
//! panics and logs say which role misbehaved. A panic in a role thread is logged with the
//! thread's name by [`install_panic_logger`]; a panic in a relay thread costs that connection
//! only.

use std::io;
use std::thread::JoinHandle;
use std::time::Duration;

/// How long a stopping process waits for a thread that may be inside a database call (the
/// readiness prober, the feed lister) before it leaves it to end with the process. A probe
/// bounds its own HTTP call (2 s); a database call whose request the server's kernel took and
/// whose answer never comes (a partition that healed after the server restarted, a stuck
/// server or middlebox) has no client-side bound, and a drain's exit must not wait on it
/// (found by the nemesis: two cells drained and never exited).
pub const STOP_WAIT: Duration = Duration::from_secs(3);

/// Stack size for a relay thread: one per WebSocket connection. Only touched pages count
/// towards resident memory; 256 KiB leaves room for the postgres client and RSA verification.
pub const RELAY_STACK_BYTES: usize = 256 * 1024;

/// The part of a relay thread's stack its deepest ordinary path touches (and so keeps
/// resident): measured on controls admitted through SQLite (40 KiB at most in a debug build,
/// `memory_plan`) and PostgreSQL (56 KiB, `relay_core_pg`), and held there by those tests
/// (docs/BENCHMARKS.md, "Memory per connection"); the capacity plan counts this, not the whole
/// stack.
pub const RELAY_STACK_RESIDENT_BYTES: usize = 96 * 1024;

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

/// A job for a spare thread.
pub type Job = Box<dyn FnOnce() + Send>;

/// Threads started ahead of need, each to run one job once they are released: a handover's
/// next process starts a relay thread for every connection it will take before anything
/// pauses, queues each connection's job without waking anyone while the connections wait, and
/// releases them all at the commit. A spare without a job ends then (or when the `Spares` are
/// dropped).
///
/// Each spare waits on a slot of its own, and the release wakes them one by one in the order
/// it decides then: first the jobs whose socket has bytes waiting (a control with a ping to
/// answer), then the others, then the spares without a job. Two thousand threads woken at
/// once by one broadcast fought for one lock, and a control with a ping waited behind idle
/// ones for 15–35 ms.
pub struct Spares {
    slots: Vec<std::sync::Arc<Slot>>,
    queued: std::sync::Mutex<Queued>,
}

#[derive(Default)]
struct Queued {
    /// Each queued job's socket, looked at when released.
    sockets: Vec<std::os::fd::RawFd>,
    released: bool,
}

#[derive(Default)]
struct Slot {
    state: std::sync::Mutex<SlotState>,
    woken: std::sync::Condvar,
}

#[derive(Default)]
struct SlotState {
    job: Option<(String, Job)>,
    released: bool,
}

impl Slot {
    fn release(&self) {
        self.state
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .released = true;
        self.woken.notify_one();
    }
}

impl Spares {
    /// Starts up to `count` spare threads of `stack_bytes` (fewer if a spawn fails: a job then
    /// gets a thread of its own, or fails to as it would have).
    pub fn start(count: usize, stack_bytes: usize) -> Spares {
        let mut slots = Vec::with_capacity(count);
        for _ in 0..count {
            let slot = std::sync::Arc::new(Slot::default());
            let waiting = slot.clone();
            let spawned = spawn_with_stack("relay-spare", stack_bytes, move || {
                let job = {
                    let mut state = waiting.state.lock().unwrap_or_else(|e| e.into_inner());
                    while !state.released {
                        state = waiting.woken.wait(state).unwrap_or_else(|e| e.into_inner());
                    }
                    state.job.take()
                };
                if let Some((name, job)) = job {
                    name_this_thread(&name);
                    job();
                }
            });
            if spawned.is_err() {
                break;
            }
            slots.push(slot);
        }
        Spares {
            slots,
            queued: std::sync::Mutex::new(Queued::default()),
        }
    }

    /// Queues `job` for a spare (named `name` from then on), to run once released, with the
    /// socket whose waiting bytes put it first (`socket`); gives the job back when every spare
    /// has one already, or once released.
    pub fn queue(&self, name: String, job: Job, socket: std::os::fd::RawFd) -> Result<(), Job> {
        let mut queued = self.queued.lock().unwrap_or_else(|e| e.into_inner());
        let slot = self.slots.get(queued.sockets.len());
        let Some(slot) = slot.filter(|_| !queued.released) else {
            return Err(job);
        };
        slot.state.lock().unwrap_or_else(|e| e.into_inner()).job = Some((name, job));
        queued.sockets.push(socket);
        Ok(())
    }

    /// Every spare takes its job (or ends without one), in the order of the type's header;
    /// once (a later call does nothing). Returns that order (the spares' indices).
    pub fn release(&self) -> Vec<usize> {
        let mut queued = self.queued.lock().unwrap_or_else(|e| e.into_inner());
        if std::mem::replace(&mut queued.released, true) {
            return Vec::new();
        }
        let mut polled: Vec<libc::pollfd> = queued
            .sockets
            .iter()
            .map(|socket| libc::pollfd {
                fd: *socket,
                events: libc::POLLIN,
                revents: 0,
            })
            .collect();
        // SAFETY: `polled` is a valid array of its length for the call; a zero timeout never
        // waits. A failed poll leaves the order as queued.
        unsafe { libc::poll(polled.as_mut_ptr(), polled.len() as libc::nfds_t, 0) };
        let waiting: Vec<bool> = polled.iter().map(|fd| fd.revents != 0).collect();
        let order = release_order(&waiting, self.slots.len());
        for i in &order {
            self.slots[*i].release();
        }
        order
    }
}

impl Drop for Spares {
    fn drop(&mut self) {
        self.release();
    }
}

/// The order a release wakes `spares` spares in, the queued jobs' sockets having bytes waiting
/// or not (`waiting`, in the order queued): those with bytes, then the other jobs, each in the
/// order queued, then the spares without a job.
fn release_order(waiting: &[bool], spares: usize) -> Vec<usize> {
    let (first, then): (Vec<usize>, Vec<usize>) = (0..waiting.len()).partition(|i| waiting[*i]);
    first
        .into_iter()
        .chain(then)
        .chain(waiting.len()..spares)
        .collect()
}

/// Names the calling thread as the kernel shows it (`top -H`, `/proc/<pid>/task/*/comm`; at
/// most 15 bytes).
fn name_this_thread(name: &str) {
    let mut bytes: Vec<u8> = name.bytes().filter(|b| *b != 0).take(15).collect();
    bytes.push(0);
    // SAFETY: PR_SET_NAME reads a NUL-terminated string of at most 16 bytes.
    unsafe { libc::prctl(libc::PR_SET_NAME, bytes.as_ptr() as libc::c_ulong, 0, 0, 0) };
}

/// A thread whose end can be waited for with a deadline ([`Watched::join_within`]): for threads
/// that may be inside a database call when the process stops (the readiness prober, the feed
/// lister), whose exit must not wait on a database that stopped answering.
pub struct Watched<T> {
    handle: JoinHandle<T>,
    ended: std::sync::mpsc::Receiver<()>,
}

/// Spawns a named role thread that can be joined with a deadline.
pub fn spawn_watched<F, T>(name: impl Into<String>, f: F) -> io::Result<Watched<T>>
where
    F: FnOnce() -> T + Send + 'static,
    T: Send + 'static,
{
    let (ended_sender, ended) = std::sync::mpsc::channel::<()>();
    let handle = spawn(name, move || {
        // Dropped when `f` returns or unwinds: the receiver sees the end.
        let _ended = ended_sender;
        f()
    })?;
    Ok(Watched { handle, ended })
}

impl<T> Watched<T> {
    /// Joins the thread, however long it takes (as [`join_logged`]).
    pub fn join(self, name: &str) -> Option<T> {
        join_logged(name, self.handle)
    }

    /// Joins the thread if it ends within `wait` (its result, a panic logged as by
    /// [`join_logged`]); otherwise leaves it to end with the process, logs
    /// `orca_relay_thread_left thread=<name>` and returns `None`.
    pub fn join_within(self, name: &str, wait: std::time::Duration) -> Option<T> {
        match self.ended.recv_timeout(wait) {
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                log::warn!(
                    "orca_relay_thread_left thread={name} waited_ms={}",
                    wait.as_millis()
                );
                None
            }
            Ok(()) | Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
                join_logged(name, self.handle)
            }
        }
    }
}

std::thread_local! {
    /// This thread is one the process cannot live without (`liveness::Liveness::spawn_critical`):
    /// a panic that reaches its top ends the process, with one line saying so.
    static CRITICAL: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    /// [`catch_panic`] calls this thread is inside: a panic there costs one connection, not
    /// the thread.
    static CATCHING: std::cell::Cell<u32> = const { std::cell::Cell::new(0) };
    /// What the last panic on a critical thread said, for its one line.
    static PANIC_DETAIL: std::cell::RefCell<Option<String>> = const { std::cell::RefCell::new(None) };
}

/// Set once a panic escapes a critical thread (it is unwinding towards the line that ends the
/// process): another critical thread that returns meanwhile because of it (a channel the
/// unwinding dropped) is not the cause, and says nothing.
static CRITICAL_PANIC: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Whether a panic has escaped a critical thread in this process.
pub fn critical_panic_in_flight() -> bool {
    CRITICAL_PANIC.load(std::sync::atomic::Ordering::Acquire)
}

/// Marks the calling thread as critical (or not): see [`install_panic_logger`].
pub fn set_critical(critical: bool) {
    let _ = CRITICAL.try_with(|flag| flag.set(critical));
}

/// What the last panic on this critical thread said (taken).
pub fn take_panic_detail() -> Option<String> {
    PANIC_DETAIL
        .try_with(|detail| detail.borrow_mut().take())
        .ok()
        .flatten()
}

/// Runs `f`, catching a panic: for the places that contain a panic to one connection or one
/// probe (a splice worker's handler of one leg, a readiness probe). On a critical thread, a
/// panic caught here is logged as any other; one that escapes to the thread's top is left to
/// the line that ends the process.
pub fn catch_panic<T>(f: impl FnOnce() -> T) -> std::thread::Result<T> {
    let _ = CATCHING.try_with(|depth| depth.set(depth.get() + 1));
    let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
    let _ = CATCHING.try_with(|depth| depth.set(depth.get().saturating_sub(1)));
    outcome
}

/// Logs panics with the thread's name instead of only printing them to stderr, so that a
/// panicking role thread shows up in the journal as an event. A panic on a critical thread
/// that nothing inside it catches ends the process: its detail goes into that one line
/// (`orca_relay_critical_thread_failed`, `liveness.rs`) instead of a second one here.
pub fn install_panic_logger() {
    let default_hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let thread = std::thread::current();
        let name = thread.name().unwrap_or("unnamed");
        let escapes_critical = CRITICAL.try_with(|flag| flag.get()).unwrap_or(false)
            && CATCHING.try_with(|depth| depth.get()).unwrap_or(0) == 0;
        if escapes_critical {
            CRITICAL_PANIC.store(true, std::sync::atomic::Ordering::Release);
            let _ = PANIC_DETAIL.try_with(|detail| *detail.borrow_mut() = Some(info.to_string()));
        } else {
            log::error!("orca_relay_thread_panicked thread={name} detail={info}");
        }
        // Set and not empty (SPEC §4: '' is unset).
        if std::env::var("ORCA_RELAY_PANIC_BACKTRACE").is_ok_and(|v| !v.trim().is_empty()) {
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

/// A bounded count of threads of one kind (relay threads): taken before a spawn, returned when
/// the [`Permit`] drops at the end of the thread. The bound is the process's computed threaded
/// capacity (`capacity.rs`), so a spawn never gets near `vm.max_map_count` or a task limit,
/// where a new thread's signal-stack mapping fails inside std's thread start and aborts the
/// process: running out of permits is a refusal, never an abort.
#[derive(Debug)]
pub struct Permits {
    max: usize,
    used: std::sync::atomic::AtomicUsize,
    /// Notified when the last permit is returned (a live handover waits for every relay thread
    /// to have deposited its connection or ended).
    idle: std::sync::Mutex<()>,
    became_idle: std::sync::Condvar,
}

/// One taken permit; dropping it gives it back.
#[derive(Debug)]
pub struct Permit(std::sync::Arc<Permits>);

impl Permits {
    pub fn new(max: usize) -> std::sync::Arc<Permits> {
        std::sync::Arc::new(Permits {
            max,
            used: std::sync::atomic::AtomicUsize::new(0),
            idle: std::sync::Mutex::new(()),
            became_idle: std::sync::Condvar::new(),
        })
    }

    /// A permit if fewer than `max` are out.
    pub fn try_take(self: &std::sync::Arc<Self>) -> Option<Permit> {
        use std::sync::atomic::Ordering;
        self.used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
                (used < self.max).then_some(used + 1)
            })
            .ok()
            .map(|_| Permit(self.clone()))
    }

    /// A permit even past `max`: for a connection that exists already and must keep a thread
    /// (one resumed after a handover). New connections still see the bound.
    pub fn take_forced(self: &std::sync::Arc<Self>) -> Permit {
        self.used.fetch_add(1, std::sync::atomic::Ordering::AcqRel);
        Permit(self.clone())
    }

    pub fn used(&self) -> usize {
        self.used.load(std::sync::atomic::Ordering::Acquire)
    }

    pub fn max(&self) -> usize {
        self.max
    }

    /// Waits until no permit is out, or `deadline` passes; returns whether none is.
    pub fn wait_idle(&self, deadline: std::time::Instant) -> bool {
        let mut guard = self.idle.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if self.used() == 0 {
                return true;
            }
            let left = deadline.saturating_duration_since(crate::clock::instant());
            if left.is_zero() {
                return false;
            }
            guard = self
                .became_idle
                .wait_timeout(guard, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        let before = self
            .0
            .used
            .fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
        if before == 1 {
            // Under the lock, so a waiter between its check and its wait cannot miss it.
            let _guard = self.0.idle.lock().unwrap_or_else(|e| e.into_inner());
            self.0.became_idle.notify_all();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spares_wake_the_jobs_with_bytes_waiting_first() {
        assert_eq!(
            release_order(&[false, true, false, true], 6),
            vec![1, 3, 0, 2, 4, 5]
        );
        // With real sockets: the second and the fourth have bytes waiting when released.
        use std::io::Write;
        let pairs: Vec<_> = (0..4)
            .map(|_| std::os::unix::net::UnixStream::pair().unwrap())
            .collect();
        let spares = Spares::start(5, 64 * 1024);
        let (ran, order_ran) = std::sync::mpsc::channel();
        for (i, (ours, _)) in pairs.iter().enumerate() {
            let ran = ran.clone();
            let job: Job = Box::new(move || ran.send(i).unwrap());
            let socket = std::os::fd::AsRawFd::as_raw_fd(ours);
            assert!(spares.queue(format!("job-{i}"), job, socket).is_ok());
        }
        for i in [1, 3] {
            (&pairs[i].1).write_all(b"ping").unwrap();
        }
        assert_eq!(spares.release(), vec![1, 3, 0, 2, 4]);
        let mut done: Vec<usize> = (0..4)
            .map(|_| order_ran.recv_timeout(Duration::from_secs(10)).unwrap())
            .collect();
        done.sort();
        assert_eq!(done, vec![0, 1, 2, 3], "every job ran once");
        let late: Job = Box::new(|| {});
        assert!(spares.queue("late".into(), late, 0).is_err(), "released");
        assert!(spares.release().is_empty(), "released once");
    }

    #[test]
    fn a_watched_thread_is_joined_when_it_ends_and_left_when_it_does_not() {
        let quick = spawn_watched("quick", || 7).expect("spawn");
        assert_eq!(
            quick.join_within("quick", std::time::Duration::from_secs(30)),
            Some(7)
        );
        let (release, blocked) = std::sync::mpsc::channel::<()>();
        let stuck = spawn_watched("stuck", move || {
            let _ = blocked.recv();
        })
        .expect("spawn");
        let started = crate::clock::instant();
        assert_eq!(
            stuck.join_within("stuck", std::time::Duration::from_millis(50)),
            None
        );
        assert!(started.elapsed() < std::time::Duration::from_secs(30));
        drop(release);
    }

    #[test]
    fn permits_are_bounded_and_returned_on_drop() {
        let permits = Permits::new(2);
        let first = permits.try_take().expect("first");
        let second = permits.try_take().expect("second");
        assert!(
            permits.try_take().is_none(),
            "a third permit over the bound"
        );
        assert_eq!(permits.used(), 2);
        drop(first);
        assert_eq!(permits.used(), 1);
        let third = permits
            .try_take()
            .expect("a returned permit is taken again");
        drop((second, third));
        assert_eq!(permits.used(), 0);
        assert!(Permits::new(0).try_take().is_none());
    }
}
