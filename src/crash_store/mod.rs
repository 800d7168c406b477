//! The crash store: what lets a cell's connections outlive its process (SPEC §13 "Crash
//! survival"). Under systemd (or any manager that speaks its protocol), every listener and every
//! established connection is kept in the service manager's **descriptor store** (`FDSTORE=1`
//! with `FDNAME=`, one datagram per descriptor, `FDSTOREREMOVE=1` as it closes), and what is
//! needed to resume each one is kept in a **region** of shared memory (`region.rs`, records laid
//! out by `carry::crash`) whose memfd is itself in the store. After an abnormal exit the manager
//! restarts the unit and passes everything back (`LISTEN_FDS`, `LISTEN_FDNAMES`: [`Intake`]);
//! `roles/resume.rs` resumes what its record allows and closes the rest 1012.
//!
//! Names in the store: `ws` and `http` (the listeners), `crash-store.<incarnation>` (the region:
//! a restarted process writes a new one, stores it, then removes its predecessor's), and
//! `c<id>` for connection `id`.
//!
//! Owns: the region, its free slots, the `crash-store` thread that talks to the manager (so no
//! connection's thread ever waits on it), and a [`CrashSlot`] per kept connection (dropping it
//! clears the record and removes the descriptor from the store).
//!
//! Never: keeps a database connection or an unauthenticated one; sends anything before this
//! process owns its connections (a live handover's next process starts keeping after the
//! commit); makes a syscall per message (records and flags are memory writes).

pub mod intake;
pub mod region;

use std::collections::VecDeque;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::sync::atomic::Ordering;
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::carry::connection::ParserRecord;
use crate::carry::crash::{CrashKind, CrashRecord, IO_HOLDING};
use crate::metrics::{Counter, Registry};
pub use intake::Intake;
use region::Region;

/// Writers of one slot are serialised by one of these locks (slot index modulo their number).
const WRITE_STRIPES: usize = 64;

/// How long the `crash-store` thread waits before trying a datagram the manager did not take
/// again (its socket buffer full).
const RETRY: Duration = Duration::from_millis(20);
/// How often in a row a datagram is tried before it is given up (counted, logged).
const ATTEMPTS: u32 = 50;

/// The name of connection `id` in the descriptor store.
pub fn connection_name(id: u64) -> String {
    format!("c{id}")
}

/// The connection id a descriptor-store name stands for.
pub fn connection_id(name: &str) -> Option<u64> {
    name.strip_prefix('c')?.parse().ok()
}

/// The name of a region created at `machine_ms` on the machine's monotonic clock: the newest
/// region is the one with the highest number (a restart after a crash, or a live handover's next
/// process, writes a new one, stores it, then removes its predecessor's).
pub fn region_name(machine_ms: u64) -> String {
    format!("crash-store.{machine_ms}")
}

/// The creation moment a region's name carries.
pub fn region_moment(name: &str) -> Option<u64> {
    name.strip_prefix("crash-store.")?.parse().ok()
}

/// What the `crash-store` thread is asked to tell the manager.
enum Op {
    /// Keep `fd` (a duplicate, closed once sent) under `name`.
    Store { name: String, fd: OwnedFd },
    /// Forget every descriptor named `name` (it closed).
    Remove { name: String },
}

/// The crash store of this process.
pub struct CrashStore {
    region: Region,
    region_name: String,
    /// Operations handed to the `crash-store` thread and not yet sent.
    pending: Arc<std::sync::atomic::AtomicUsize>,
    free: Mutex<VecDeque<u32>>,
    stripes: Vec<Mutex<()>>,
    outbox: Mutex<Option<Sender<Op>>>,
    metrics: StoreMetrics,
}

#[derive(Clone)]
struct StoreMetrics {
    kept: Counter,
    removed: Counter,
    refused: Counter,
    failed: Counter,
}

impl StoreMetrics {
    fn new(registry: &Registry) -> StoreMetrics {
        let counter = |name: &str, help: &str| registry.counter(name, help, &[]);
        StoreMetrics {
            kept: counter(
                "orca_relay_crash_store_kept_total",
                "Descriptors handed to the service manager's descriptor store (connections, listeners, the region).",
            ),
            removed: counter(
                "orca_relay_crash_store_removed_total",
                "Descriptors removed from the descriptor store as their connection closed.",
            ),
            refused: counter(
                "orca_relay_crash_store_refused_total",
                "Connections kept in no record: the region was full (closed 1012 after a crash, never resumed).",
            ),
            failed: counter(
                "orca_relay_crash_store_failed_total",
                "Datagrams to the service manager that could not be sent (a descriptor not kept or not removed).",
            ),
        }
    }
}

impl CrashStore {
    /// A store with a new region of `slots` slots, talking to the manager at `notify_socket`
    /// (the `crash-store` thread starts now; nothing is sent until the first `keep`).
    pub fn start(
        slots: u32,
        notify_socket: std::ffi::OsString,
        registry: &Registry,
    ) -> io::Result<Arc<CrashStore>> {
        let region = Region::create(slots)?;
        let (outbox, inbox) = mpsc::channel();
        let metrics = StoreMetrics::new(registry);
        let pending = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        {
            let metrics = metrics.clone();
            let pending = pending.clone();
            crate::threads::spawn("crash-store", move || {
                run_notifier(notify_socket, inbox, metrics, pending)
            })?;
        }
        let store = Arc::new(CrashStore {
            free: Mutex::new((0..region.slots()).collect()),
            region,
            region_name: region_name(crate::clock::machine_ms().unwrap_or(0)),
            pending,
            stripes: (0..WRITE_STRIPES).map(|_| Mutex::new(())).collect(),
            outbox: Mutex::new(Some(outbox)),
            metrics,
        });
        {
            let store = store.clone();
            registry.sampled_gauge(
                "orca_relay_crash_store_slots",
                "Crash-store slots: in use, in use by a connection a crash now could not resume (a read or a write under way, bytes held), and in all.",
                move || {
                    let total = store.region.slots() as f64;
                    let free = store.lock_free().len() as f64;
                    // Free slots have no flags: every slot is looked at, no lock taken.
                    let unsettled = (0..store.region.slots())
                        .filter(|index| store.region.io(*index).load(Ordering::Relaxed) != 0)
                        .count() as f64;
                    vec![
                        (vec![("state".into(), "used".into())], total - free),
                        (vec![("state".into(), "unsettled".into())], unsettled),
                        (vec![("state".into(), "total".into())], total),
                    ]
                },
            );
        }
        Ok(store)
    }

    fn lock_free(&self) -> std::sync::MutexGuard<'_, VecDeque<u32>> {
        self.free.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn send(&self, op: Op) {
        let outbox = self.outbox.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(outbox) = outbox.as_ref() {
            self.pending.fetch_add(1, Ordering::AcqRel);
            if outbox.send(op).is_err() {
                self.pending.fetch_sub(1, Ordering::AcqRel);
            }
        }
    }

    /// Keeps the region's memfd in the store under its name.
    pub fn keep_region(&self) -> io::Result<()> {
        self.keep_descriptor(&self.region_name, self.region.memfd().as_fd())
    }

    /// The name this process's region is kept under.
    pub fn region_name(&self) -> &str {
        &self.region_name
    }

    /// Waits (until `timeout`) for the `crash-store` thread to have sent everything handed to
    /// it: a live handover's running process, before it gives its connections away, so that no
    /// removal of a connection it closed is lost with it.
    pub fn wait_sent(&self, timeout: Duration) -> bool {
        let deadline = crate::clock::instant() + timeout;
        while self.pending.load(Ordering::Acquire) > 0 {
            if crate::clock::instant() >= deadline {
                return false;
            }
            crate::clock::sleep(Duration::from_millis(1));
        }
        true
    }

    /// Keeps a descriptor that has no record (a listener) under `name`.
    pub fn keep_descriptor(&self, name: &str, fd: BorrowedFd<'_>) -> io::Result<()> {
        let fd = fd.try_clone_to_owned()?;
        self.send(Op::Store {
            name: name.to_string(),
            fd,
        });
        Ok(())
    }

    /// Forgets every descriptor named `name` (a predecessor's region, a connection closed
    /// before it could be resumed).
    pub fn forget(&self, name: &str) {
        self.send(Op::Remove {
            name: name.to_string(),
        });
    }

    /// Keeps connection `record.id`: a slot with its record, and its descriptor in the store
    /// (`stored` when the descriptor is there already: a resumed connection). `None` when the
    /// region is full (counted): the connection is then kept nowhere and dies with the process.
    pub fn keep(
        self: &Arc<Self>,
        socket: &impl AsRawFd,
        record: CrashRecord,
        stored: bool,
    ) -> Option<CrashSlot> {
        let Some(index) = self.lock_free().pop_front() else {
            self.metrics.refused.inc();
            return None;
        };
        let slot = CrashSlot {
            store: self.clone(),
            index,
            id: record.id,
        };
        slot.write(&record);
        if !stored {
            // SAFETY: the caller's socket is open for the duration of this call.
            let fd = unsafe { BorrowedFd::borrow_raw(socket.as_raw_fd()) };
            match fd.try_clone_to_owned() {
                Ok(fd) => self.send(Op::Store {
                    name: connection_name(record.id),
                    fd,
                }),
                Err(_) => self.metrics.failed.inc(),
            }
        }
        Some(slot)
    }

    /// Stops the `crash-store` thread once it has sent what it was given (the process is
    /// ending: a drain). Later calls send nothing.
    pub fn stop(&self) {
        self.outbox.lock().unwrap_or_else(|e| e.into_inner()).take();
    }

    pub fn region(&self) -> &Region {
        &self.region
    }
}

/// One kept connection's slot: its record and I/O flags. Dropping it (the connection's socket
/// is gone) clears the record and removes the descriptor from the store.
pub struct CrashSlot {
    store: Arc<CrashStore>,
    index: u32,
    id: u64,
}

impl std::fmt::Debug for CrashSlot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CrashSlot")
            .field("index", &self.index)
            .field("id", &self.id)
            .finish()
    }
}

impl CrashSlot {
    /// Rewrites the record (an identity that changed: a lease, a pairing, a parser's open
    /// message). A record that does not fit leaves the connection holding (not resumable).
    pub fn write(&self, record: &CrashRecord) {
        let stripe = &self.store.stripes[self.index as usize % WRITE_STRIPES];
        let _writing = stripe.lock().unwrap_or_else(|e| e.into_inner());
        if self.store.region.write(self.index, record).is_err() {
            // Kept with no usable record: marked so that a restart closes it 1012.
            self.store.region.write(self.index, &bare(record)).ok();
            self.set(IO_HOLDING);
            self.store.metrics.refused.inc();
        }
    }

    /// Sets I/O flags (`carry::crash::IO_*`).
    pub fn set(&self, flags: u32) {
        self.store
            .region
            .io(self.index)
            .fetch_or(flags, Ordering::AcqRel);
    }

    /// Clears I/O flags.
    pub fn clear(&self, flags: u32) {
        self.store
            .region
            .io(self.index)
            .fetch_and(!flags, Ordering::AcqRel);
    }

    /// Sets exactly `flags` (the rest cleared).
    pub fn assign(&self, flags: u32) {
        self.store
            .region
            .io(self.index)
            .store(flags, Ordering::Release);
    }

    pub fn flags(&self) -> u32 {
        self.store.region.io(self.index).load(Ordering::Acquire)
    }

    pub fn id(&self) -> u64 {
        self.id
    }
}

impl Drop for CrashSlot {
    fn drop(&mut self) {
        {
            let stripe = &self.store.stripes[self.index as usize % WRITE_STRIPES];
            let _writing = stripe.lock().unwrap_or_else(|e| e.into_inner());
            self.store.region.clear(self.index);
        }
        self.store.lock_free().push_back(self.index);
        self.store.send(Op::Remove {
            name: connection_name(self.id),
        });
    }
}

/// The record of a connection whose full record does not fit: who it is, nothing more.
fn bare(record: &CrashRecord) -> CrashRecord {
    CrashRecord {
        kind: record.kind,
        id: record.id,
        inode: record.inode,
        parser: ParserRecord::default(),
        control: None,
        relay_host_id: None,
        peer: None,
        partial: Vec::new(),
    }
}

/// The inode of a socket (what a record and a stored descriptor are matched by).
pub fn inode_of(fd: &impl AsRawFd) -> u64 {
    // SAFETY: fstat into a struct we own.
    let mut stat: libc::stat = unsafe { std::mem::zeroed() };
    if unsafe { libc::fstat(fd.as_raw_fd(), &mut stat) } != 0 {
        return 0;
    }
    stat.st_ino
}

/// A record of a connection `kind` with id `id` on `socket`, nothing else known yet.
pub fn record_of(kind: CrashKind, id: u64, socket: &impl AsRawFd) -> CrashRecord {
    CrashRecord {
        kind,
        id,
        inode: inode_of(socket),
        parser: ParserRecord::default(),
        control: None,
        relay_host_id: None,
        peer: None,
        partial: Vec::new(),
    }
}

/// The `crash-store` thread: sends each operation to the manager in order (a store always
/// before the removal of the same name), trying a datagram the manager's socket did not take
/// again for a moment; gives one up (counted, logged throttled) rather than wait forever.
fn run_notifier(
    notify_socket: std::ffi::OsString,
    inbox: Receiver<Op>,
    metrics: StoreMetrics,
    pending: Arc<std::sync::atomic::AtomicUsize>,
) {
    let mut failures = crate::logging::FailureThrottle::new();
    let since = crate::clock::instant();
    for op in inbox {
        let (message, fd) = match &op {
            Op::Store { name, fd } => (format!("FDSTORE=1\nFDNAME={name}"), Some(fd)),
            Op::Remove { name } => (format!("FDSTOREREMOVE=1\nFDNAME={name}"), None),
        };
        let mut attempt = 0;
        let outcome = loop {
            attempt += 1;
            let sent = match fd {
                Some(fd) => crate::lifecycle::notify_with_fd(&notify_socket, &message, fd),
                None => crate::lifecycle::send_notification(&notify_socket, &message),
            };
            match sent {
                Err(e)
                    if attempt < ATTEMPTS
                        && matches!(e.raw_os_error(), Some(libc::EAGAIN) | Some(libc::ENOBUFS)) =>
                {
                    crate::clock::sleep(RETRY);
                }
                other => break other,
            }
        };
        let now_ms = crate::clock::instant().duration_since(since).as_millis() as u64;
        match outcome {
            Ok(()) => {
                match op {
                    Op::Store { .. } => metrics.kept.inc(),
                    Op::Remove { .. } => metrics.removed.inc(),
                }
                if let Some(note) = failures.success() {
                    log::info!("orca_relay_crash_store_recovered{note}");
                }
            }
            Err(e) => {
                metrics.failed.inc();
                if let Some(note) = failures.failure(now_ms) {
                    log::warn!("orca_relay_crash_store_send_failed error={e}{note}");
                }
            }
        }
        pending.fetch_sub(1, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        assert_eq!(connection_id(&connection_name(123)), Some(123));
        assert_eq!(connection_id("ws"), None);
        assert_eq!(connection_id("crash-store.5"), None);
        assert_eq!(region_name(17), "crash-store.17");
        assert_eq!(region_moment(&region_name(17)), Some(17));
    }
}
