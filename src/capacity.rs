//! Capacity the process knows: how many connections this process can hold under the kernel's
//! and its own resource limits, and which limit binds first (issue 12).
//!
//! Owns: the pure computation [`compute`] (a struct of limits in, connections and the limiting
//! resource out) and a thin reader [`read_limits`] that fills [`Limits`] from `getrlimit` and
//! small procfs/cgroup files, each read with a byte bound.
//!
//! Runs on: whichever thread calls it (once at start); nothing here is wired into the acceptor
//! yet.
//!
//! Never: spawns, sleeps or holds a lock; reads a file without a byte bound; panics on what
//! the files say (an unreadable or garbled file is an error naming it).
//!
//! ## What a connection costs
//!
//! - Every connection holds one descriptor (its socket).
//! - A connection on its own thread (today every connection; after the data-plane rewrite an
//!   admitted control or a pending upgrade, while a spliced leg holds no thread) holds one kernel
//!   task (counted by `kernel.threads-max`, `kernel.pid_max`, the cgroup's `pids.max` and
//!   `RLIMIT_NPROC`) and [`MAPS_PER_THREAD`] memory maps (counted by `vm.max_map_count`).
//!
//! A thread costs four maps: glibc maps its stack with a one-page guard below it (one `mmap`,
//! then `mprotect(PROT_NONE)` on the guard splits it into two maps), and Rust's std, in the new
//! thread before it runs the closure, maps a signal stack (`SIGSTKSZ` plus a page) for its
//! stack-overflow handler and protects that guard page too (two more). Measured on the
//! development VM by `tests/capacity.rs` for [`crate::threads::RELAY_STACK_BYTES`] stacks.
//! Besides, glibc keeps per-thread malloc arenas (at most 8 per core, each a 64 MiB reservation
//! of two or more maps) and a cache of up to 40 MiB of exited threads' stacks (two maps each):
//! both are bounded and go into the [`Reserve`].
//!
//! ## Why maps matter most
//!
//! When the map count reaches `vm.max_map_count`, only the first two maps of a new thread fail
//! gracefully (`pthread_create` returns `EAGAIN`, `spawn` an error). The signal stack is mapped
//! inside the new thread, outside any `catch_unwind`: its failure is a panic in std's
//! `extern "C"` thread start, which cannot unwind ("failed to initiate panic, error 5") and
//! aborts the process; a first `malloc` that needs a new arena fails the same way ("memory
//! allocation of N bytes failed", abort), and an allocation failure while a panic message is
//! being written can even deadlock. So the process must refuse connections before the count gets
//! near the limit: that is the capacity computed here.
//!
//! ## Memory
//!
//! Every connection's memory is bounded by construction: what it holds in ordinary use (a
//! spliced leg's partial frame and its peer's output, a control's buffer and the stack its
//! thread touches), anything larger drawn from one budget for the whole process
//! (`relay::buffer_budget`); the figures are [`MemoryBounds`], filled by the role from the data
//! plane's constants. The process states the RSS it can reach at its cap
//! (`base + buffer budget + cap x per connection`) and lowers the cap, like the descriptor
//! ceiling, when that exceeds the memory it has: the cgroup's `memory.max` (`MemoryMax=`, the
//! tightest level; v1 `memory.limit_in_bytes`), else `MemTotal`.

use std::fmt;
use std::io;
use std::path::{Path, PathBuf};

/// Memory maps one more thread costs (stack + guard, signal stack + guard).
pub const MAPS_PER_THREAD: u64 = 4;

/// Task ids below this are never handed out again after `pid_max` wraps (the kernel's
/// `RESERVED_PIDS`), so at most `pid_max - 300` tasks exist at once.
pub const RESERVED_PIDS: u64 = 300;

/// Exited threads' stacks glibc keeps mapped for reuse (`glibc.pthread.stack_cache_size`).
pub const GLIBC_STACK_CACHE_BYTES: u64 = 40 * 1024 * 1024;

/// A resource that bounds how many connections the process can hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Resource {
    /// `RLIMIT_NOFILE` (soft, after the start-up raise).
    Descriptors,
    /// `vm.max_map_count`: memory maps of this process.
    MemoryMaps,
    /// `kernel.threads-max`: tasks on the whole machine.
    KernelThreads,
    /// `kernel.pid_max`: task ids on the whole machine.
    PidSpace,
    /// The cgroup's `pids.max` (systemd `TasksMax=`), the tightest level of the hierarchy.
    CgroupPids,
    /// `RLIMIT_NPROC`: tasks of this user (not enforced for root).
    UserProcesses,
    /// The memory the process may use: the cgroup's `memory.max`, else `MemTotal`.
    Memory,
}

impl Resource {
    pub const ALL: [Resource; 6] = [
        Resource::Descriptors,
        Resource::MemoryMaps,
        Resource::KernelThreads,
        Resource::PidSpace,
        Resource::CgroupPids,
        Resource::UserProcesses,
    ];

    /// The limit's name as an operator knows it.
    pub fn name(self) -> &'static str {
        match self {
            Resource::Descriptors => "RLIMIT_NOFILE",
            Resource::MemoryMaps => "vm.max_map_count",
            Resource::KernelThreads => "kernel.threads-max",
            Resource::PidSpace => "kernel.pid_max",
            Resource::CgroupPids => "pids.max",
            Resource::UserProcesses => "RLIMIT_NPROC",
            Resource::Memory => "memory",
        }
    }

    /// How an operator raises it.
    pub fn how_to_raise(self) -> &'static str {
        match self {
            Resource::Descriptors => "LimitNOFILE= in the unit (the process raises its soft limit to the hard limit at start)",
            Resource::MemoryMaps => "sysctl -w vm.max_map_count=262144 (persist in /etc/sysctl.d/)",
            Resource::KernelThreads => "sysctl -w kernel.threads-max=N (persist in /etc/sysctl.d/)",
            Resource::PidSpace => "sysctl -w kernel.pid_max=4194304 (persist in /etc/sysctl.d/)",
            Resource::CgroupPids => "TasksMax= in the unit (or the parent slice's TasksMax=)",
            Resource::UserProcesses => "LimitNPROC= in the unit",
            Resource::Memory => "MemoryMax= in the unit (or the slice's), or a machine with more memory",
        }
    }

    /// Whether a connection pays this resource only when it holds a thread.
    pub fn per_thread(self) -> bool {
        !matches!(self, Resource::Descriptors | Resource::Memory)
    }
}

impl fmt::Display for Resource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The process's limits and current usage; `None` is unlimited.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Limits {
    /// `RLIMIT_NOFILE` soft limit (after the raise), and descriptors open now.
    pub descriptors: Option<u64>,
    pub descriptors_in_use: u64,
    /// `vm.max_map_count`, and this process's maps now.
    pub max_map_count: Option<u64>,
    pub maps_in_use: u64,
    /// `kernel.threads-max` and `kernel.pid_max`, and tasks on the machine now.
    pub threads_max: Option<u64>,
    pub pid_max: Option<u64>,
    pub tasks_on_machine: u64,
    /// The cgroup's `pids.max` and `pids.current` at its tightest level (least headroom).
    pub cgroup_pids_max: Option<u64>,
    pub cgroup_pids_current: u64,
    /// `RLIMIT_NPROC` soft limit (`None` for root, which it does not bind), and this
    /// process's threads now (the user's other tasks are not counted: run the cell as its own
    /// user).
    pub nproc: Option<u64>,
    pub process_threads: u64,
    /// The memory the process may use: the cgroup's memory limit at its tightest level, else
    /// the machine's `MemTotal`; `None` when neither could be read as a limit.
    pub memory_bytes: Option<u64>,
}

impl Limits {
    /// The limits as they would read without `tasks` of another process and `descriptors` of
    /// this one counted: the running process a live handover takes over from shares the
    /// machine's and the cgroup's task counts until it exits, the handover's own descriptors
    /// are closed at the commit, and the next process plans as a fresh start does.
    pub fn without(mut self, tasks: u64, descriptors: u64) -> Limits {
        self.tasks_on_machine = self.tasks_on_machine.saturating_sub(tasks);
        self.cgroup_pids_current = self.cgroup_pids_current.saturating_sub(tasks);
        self.descriptors_in_use = self.descriptors_in_use.saturating_sub(descriptors);
        self
    }
}

/// What the process keeps for itself, beyond what it uses at the time of the reading: HTTP
/// connections and workers, the database pool, rejection threads, role threads started later,
/// malloc arenas, the glibc stack cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Reserve {
    pub descriptors: u64,
    pub threads: u64,
    pub maps: u64,
}

impl Reserve {
    /// The reserve of a relay process: 256 descriptors plus the database pool; 128 threads
    /// (up to 64 rejection threads, HTTP workers, re-registration and feed threads); their maps,
    /// glibc's malloc arenas (8 per core, up to 4 maps each), its stack cache for
    /// `stack_bytes` stacks, and 256 more for libraries loaded later.
    pub fn for_relay(cpus: u64, database_pool_max: u64, stack_bytes: u64) -> Reserve {
        let threads = 128;
        let cached_stacks = GLIBC_STACK_CACHE_BYTES / (stack_bytes.max(1) + 4096);
        Reserve {
            descriptors: 256 + database_pool_max,
            threads,
            maps: threads * MAPS_PER_THREAD + 8 * cpus.max(1) * 4 + cached_stacks * 2 + 256,
        }
    }
}

/// One resource's arithmetic.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Figure {
    pub resource: Resource,
    /// The limit (`None`: unlimited).
    pub limit: Option<u64>,
    pub in_use: u64,
    pub reserve: u64,
    /// Units of this resource one connection costs (per thread for the thread resources).
    pub per_connection: u64,
    /// Connections it allows: `(limit - in_use - reserve) / per_connection`; `None`: unlimited.
    pub connections: Option<u64>,
}

impl fmt::Display for Figure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (self.limit, self.connections) {
            (Some(limit), Some(connections)) => write!(
                f,
                "{}: ({limit} - {} in use - {} reserve) / {} = {connections}",
                self.resource, self.in_use, self.reserve, self.per_connection
            ),
            _ => write!(f, "{}: unlimited", self.resource),
        }
    }
}

/// How many connections the process can hold, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Capacity {
    /// Connections when each holds a thread: today's relay (a thread per connection), and the
    /// worst case of the data-plane rewrite (every connection a control or a pending upgrade).
    pub connections: u64,
    /// The resource that gives `connections` (the first in [`Resource::ALL`] order on a tie).
    pub limiting: Resource,
    /// Connections by descriptors alone: spliced legs after the rewrite hold no thread.
    pub descriptors: u64,
    /// Connections holding a thread at once (controls and pending upgrades after the rewrite),
    /// and the thread resource that gives it.
    pub threaded: u64,
    pub threaded_limiting: Resource,
    pub figures: Vec<Figure>,
}

impl Capacity {
    /// The connection cap to run with: `configured`, lowered to [`Capacity::connections`] when
    /// above it; the second value names the limiting resource when it was lowered.
    pub fn cap(&self, configured: u64) -> (u64, Option<Resource>) {
        if configured > self.connections {
            (self.connections, Some(self.limiting))
        } else {
            (configured, None)
        }
    }

    /// One `key=value` line for the log and `check-config`.
    pub fn summary(&self) -> String {
        format!(
            "connections={} limiting={} descriptors={} threaded={} threaded_limiting={}",
            self.connections,
            self.limiting,
            self.descriptors,
            self.threaded,
            self.threaded_limiting
        )
    }
}

fn figure(
    resource: Resource,
    limit: Option<u64>,
    in_use: u64,
    reserve: u64,
    per_connection: u64,
) -> Figure {
    let connections = limit
        .map(|limit| limit.saturating_sub(in_use).saturating_sub(reserve) / per_connection.max(1));
    Figure {
        resource,
        limit,
        in_use,
        reserve,
        per_connection,
        connections,
    }
}

/// The tightest of `figures` (unlimited ones skipped): (connections, resource).
fn tightest<'a>(figures: impl Iterator<Item = &'a Figure>) -> Option<(u64, Resource)> {
    figures
        .filter_map(|f| Some((f.connections?, f.resource)))
        .fold(None, |best, (n, r)| match best {
            Some((m, _)) if m <= n => best,
            _ => Some((n, r)),
        })
}

/// Computes the capacity from `limits`, keeping `reserve` for the process itself, with
/// `maps_per_thread` maps per thread (normally [`MAPS_PER_THREAD`]).
pub fn compute(limits: &Limits, reserve: Reserve, maps_per_thread: u64) -> Capacity {
    let figures = vec![
        figure(
            Resource::Descriptors,
            limits.descriptors,
            limits.descriptors_in_use,
            reserve.descriptors,
            1,
        ),
        figure(
            Resource::MemoryMaps,
            limits.max_map_count,
            limits.maps_in_use,
            reserve.maps,
            maps_per_thread,
        ),
        figure(
            Resource::KernelThreads,
            limits.threads_max,
            limits.tasks_on_machine,
            reserve.threads,
            1,
        ),
        figure(
            Resource::PidSpace,
            limits.pid_max.map(|max| max.saturating_sub(RESERVED_PIDS)),
            limits.tasks_on_machine,
            reserve.threads,
            1,
        ),
        figure(
            Resource::CgroupPids,
            limits.cgroup_pids_max,
            limits.cgroup_pids_current,
            reserve.threads,
            1,
        ),
        figure(
            Resource::UserProcesses,
            limits.nproc,
            limits.process_threads,
            reserve.threads,
            1,
        ),
    ];
    let (descriptors, _) = tightest(figures.iter().filter(|f| !f.resource.per_thread()))
        .unwrap_or((u64::MAX, Resource::Descriptors));
    let (threaded, threaded_limiting) =
        tightest(figures.iter().filter(|f| f.resource.per_thread()))
            .unwrap_or((u64::MAX, Resource::MemoryMaps));
    let (connections, limiting) =
        tightest(figures.iter()).unwrap_or((u64::MAX, Resource::Descriptors));
    Capacity {
        connections,
        limiting,
        descriptors,
        threaded,
        threaded_limiting,
        figures,
    }
}

/// What a relay process runs with, from its capacity and its configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    pub capacity: Capacity,
    /// Admitted connections at most: a spliced leg holds only a descriptor (no thread), so the
    /// descriptor figure is the ceiling.
    pub ceiling: u64,
    /// The connection cap in force: the configured one, lowered to the ceiling.
    pub cap: u64,
    /// The descriptors kept off the connections, by what they are for.
    pub descriptors_reserved: DescriptorReserve,
    /// The resource the cap was lowered for, when it was.
    pub lowered_by: Option<Resource>,
    /// Relay threads at most at once (controls, pending upgrades, legs not yet spliced): the
    /// threaded figure, so a spawn never gets near the map or task limits, and at most what
    /// the task limits hold for two processes ([`Plan::handover_threads`]).
    pub relay_threads: u64,
    /// Relay threads the task limits hold when a live handover runs two processes of this
    /// one's size (the next one has a relay thread for every carried connection waiting before
    /// the running one's end at its exit), and the task limit that gives it; `None`: no task
    /// limit. The machine's maps are per process and are not halved.
    pub handover_threads: Option<(u64, Resource)>,
    /// The RSS the process can reach at `cap` ([`MemoryBounds::rss_at`]), and the memory it
    /// has (`None`: unknown, not checked).
    pub rss_at_cap: u64,
    pub memory_bytes: Option<u64>,
    pub memory: MemoryBounds,
}

/// The configuration figures the reserve depends on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Needs {
    pub cpus: u64,
    pub database_pool_max: u64,
    /// Sockets before admission (`ORCA_RELAY_PENDING_UPGRADES_MAX`): a descriptor each, and a
    /// relay thread each (they are in the permits, not the reserve).
    pub pending_upgrades_max: u64,
    /// Refused and closing connections lingering in the reaper
    /// (`ORCA_RELAY_CLOSING_CONNECTIONS_MAX`): a descriptor each, no thread.
    pub closing_connections_max: u64,
    /// HTTP connections (`ORCA_RELAY_HTTP_CONNECTIONS_MAX`): a thread each (all reserved) and a
    /// descriptor each (at most [`HTTP_DESCRIPTORS_RESERVED`] reserved).
    pub http_connections_max: u64,
    pub configured_cap: u64,
    pub memory: MemoryBounds,
}

/// The descriptors the plan keeps for the process beyond its admitted connections.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DescriptorReserve {
    /// The process's own (256) and its database pool.
    pub process: u64,
    /// Pending WebSocket connections (`ORCA_RELAY_PENDING_UPGRADES_MAX`).
    pub pending: u64,
    /// Refused and closing connections lingering (`ORCA_RELAY_CLOSING_CONNECTIONS_MAX`).
    pub closing: u64,
    /// HTTP connections (at most [`HTTP_DESCRIPTORS_RESERVED`]).
    pub http: u64,
}

impl DescriptorReserve {
    pub fn total(&self) -> u64 {
        self.process + self.pending + self.closing + self.http
    }
}

impl fmt::Display for DescriptorReserve {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "descriptors reserved: {} = {} process and database pool + {} pending + {} closing + {} HTTP",
            self.total(),
            self.process,
            self.pending,
            self.closing,
            self.http
        )
    }
}

/// What one connection holds in ordinary use, the one budget every larger buffer draws on,
/// and what the process holds besides, in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemoryBounds {
    pub per_connection: u64,
    /// `ORCA_RELAY_BUFFER_BUDGET_BYTES`: counted once, not per connection.
    pub buffers: u64,
    pub base: u64,
}

impl MemoryBounds {
    /// The RSS the process can reach holding `connections`.
    pub fn rss_at(&self, connections: u64) -> u64 {
        self.fixed()
            .saturating_add(connections.saturating_mul(self.per_connection))
    }

    /// The connections `memory` holds (0 when it holds not even the base and the budget).
    pub fn connections_in(&self, memory: u64) -> u64 {
        memory.saturating_sub(self.fixed()) / self.per_connection.max(1)
    }

    fn fixed(&self) -> u64 {
        self.base.saturating_add(self.buffers)
    }
}

/// Descriptors kept for HTTP connections, whatever `ORCA_RELAY_HTTP_CONNECTIONS_MAX` says: enough
/// for `/health`, `/ready`, `/metrics` and the internal API when the WebSocket side is full.
/// Running out of descriptors is a refusal (both acceptors answer or back off), not an abort,
/// so the descriptor reserve need not cover the worst case; running out of threads or maps
/// aborts, so every HTTP connection's thread is in the thread reserve.
pub const HTTP_DESCRIPTORS_RESERVED: u64 = 128;

/// The plan for `limits` and `needs`: the relay reserve plus the descriptors of pending
/// upgrades and of refused or closing connections lingering in the reaper, some descriptors for
/// HTTP, and every HTTP connection's thread, so `/health` and the upgrade path still have what
/// they need when the WebSocket side is full and refusals arrive at any rate.
pub fn plan(limits: &Limits, needs: Needs) -> Plan {
    let mut reserve = Reserve::for_relay(
        needs.cpus,
        needs.database_pool_max,
        crate::threads::RELAY_STACK_BYTES as u64,
    );
    let descriptors_reserved = DescriptorReserve {
        process: reserve.descriptors,
        pending: needs.pending_upgrades_max,
        closing: needs.closing_connections_max,
        http: needs.http_connections_max.min(HTTP_DESCRIPTORS_RESERVED),
    };
    reserve.descriptors = descriptors_reserved.total();
    reserve.threads += needs.http_connections_max;
    reserve.maps += needs.http_connections_max * MAPS_PER_THREAD;
    let capacity = compute(limits, reserve, MAPS_PER_THREAD);
    let handover_threads = handover_threads(limits, reserve.threads);
    let ceiling = capacity.descriptors;
    let (mut cap, mut lowered_by) = if needs.configured_cap > ceiling {
        (ceiling, Some(Resource::Descriptors))
    } else {
        (needs.configured_cap, None)
    };
    // Then memory: the RSS the process can reach at its cap must fit in what it has.
    if let Some(memory) = limits.memory_bytes {
        if needs.memory.rss_at(cap) > memory {
            cap = needs.memory.connections_in(memory).max(1);
            lowered_by = Some(Resource::Memory);
        }
    }
    Plan {
        relay_threads: handover_threads.map_or(capacity.threaded, |(threads, _)| {
            threads.min(capacity.threaded)
        }),
        handover_threads,
        capacity,
        ceiling,
        cap,
        descriptors_reserved,
        lowered_by,
        rss_at_cap: needs.memory.rss_at(cap),
        memory_bytes: limits.memory_bytes,
        memory: needs.memory,
    }
}

/// Relay threads the task limits (`kernel.threads-max`, `kernel.pid_max`, the cgroup's
/// `pids.max`, `RLIMIT_NPROC`) hold when two processes of this one's size run at once: every
/// task of this process (`process_threads` now, its `reserve`, its relay threads) counted
/// twice, the rest of what each limit counts once. `None`: no task limit.
fn handover_threads(limits: &Limits, reserve: u64) -> Option<(u64, Resource)> {
    let own = limits.process_threads;
    [
        (
            Resource::KernelThreads,
            limits.threads_max,
            limits.tasks_on_machine,
        ),
        (
            Resource::PidSpace,
            limits.pid_max.map(|max| max.saturating_sub(RESERVED_PIDS)),
            limits.tasks_on_machine,
        ),
        (
            Resource::CgroupPids,
            limits.cgroup_pids_max,
            limits.cgroup_pids_current,
        ),
        (
            Resource::UserProcesses,
            limits.nproc,
            limits.process_threads,
        ),
    ]
    .into_iter()
    .filter_map(|(resource, limit, in_use)| {
        let left = limit?
            .saturating_sub(in_use)
            .saturating_sub(own)
            .saturating_sub(2 * reserve);
        Some((left / 2, resource))
    })
    .min_by_key(|(threads, _)| *threads)
}

impl Plan {
    /// The resource that bounds the relay threads.
    pub fn threads_limited_by(&self) -> Resource {
        match self.handover_threads {
            Some((threads, resource)) if threads < self.capacity.threaded => resource,
            _ => self.capacity.threaded_limiting,
        }
    }

    /// The `key=value` fields of the start-up line and `check-config`.
    pub fn summary(&self) -> String {
        format!(
            "connections={} limited_by={} cap={} relay_threads={} threads_limited_by={}{} rss_at_cap={} memory={} per_connection_bytes={}",
            self.ceiling,
            Resource::Descriptors,
            self.cap,
            self.relay_threads,
            self.threads_limited_by(),
            if self.threads_limited_by().per_thread()
                && self.threads_limited_by() != Resource::MemoryMaps
            {
                " threads_counted=twice_for_handover"
            } else {
                ""
            },
            self.rss_at_cap,
            self.memory_bytes
                .map_or_else(|| "unknown".to_string(), |m| m.to_string()),
            self.memory.per_connection
        )
    }

    /// The live handover's task arithmetic as `check-config` prints it.
    pub fn handover_figure(&self) -> String {
        match self.handover_threads {
            Some((threads, resource)) => format!(
                "live handover: both processes' tasks at once (every task of this one twice): {resource} holds {threads} relay threads each"
            ),
            None => "live handover: no task limit binds two processes at once".to_string(),
        }
    }

    /// The memory arithmetic as `check-config` prints it.
    pub fn memory_figure(&self) -> String {
        format!(
            "memory: {} base + {} buffer budget + {} connections x {} bytes = {} bytes at the cap, of {}",
            self.memory.base,
            self.memory.buffers,
            self.cap,
            self.memory.per_connection,
            self.rss_at_cap,
            self.memory_bytes.map_or_else(
                || "unknown".to_string(),
                |m| format!("{m} the process may use")
            )
        )
    }
}

// ---------------------------------------------------------------------------------------------
// The reader.

/// Small procfs and cgroup files are read up to this many bytes.
const SMALL_FILE_BYTES: u64 = 16 * 1024;
/// `/proc/self/maps` is read up to this many bytes (65,530 maps are about 7 MB).
const MAPS_FILE_BYTES: u64 = 64 * 1024 * 1024;
/// `/proc/self/fd` is listed up to this many entries.
const FD_ENTRIES: u64 = 10_000_000;

/// A procfs or cgroup file, through the relay's one bounded reader of local files; the error
/// names the path.
fn read_bounded(path: &Path, limit: u64) -> io::Result<String> {
    crate::local_file::read_bounded_to_string(path, limit).map_err(|e| {
        let kind = match &e {
            crate::local_file::LocalFileError::Missing => io::ErrorKind::NotFound,
            crate::local_file::LocalFileError::Unreadable(error) => error.kind(),
            _ => io::ErrorKind::InvalidData,
        };
        io::Error::new(kind, format!("{}: {e}", path.display()))
    })
}

fn invalid(path: &Path, text: &str) -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidData,
        format!("{}: not a number: {:?}", path.display(), text.trim()),
    )
}

/// A number file (`max_map_count`, `pids.current`); `max` reads as unlimited.
fn read_number(path: &Path) -> io::Result<Option<u64>> {
    let text = read_bounded(path, SMALL_FILE_BYTES)?;
    match text.trim() {
        "max" => Ok(None),
        value => value.parse().map(Some).map_err(|_| invalid(path, &text)),
    }
}

/// The tasks (threads) of process `pid` (`/proc/<pid>/status`).
pub fn process_tasks(pid: u32) -> io::Result<u64> {
    let path = PathBuf::from(format!("/proc/{pid}/status"));
    let status = read_bounded(&path, SMALL_FILE_BYTES)?;
    status
        .lines()
        .find_map(|line| line.strip_prefix("Threads:"))
        .and_then(|value| value.trim().parse().ok())
        .ok_or_else(|| invalid(&path, &status))
}

/// `getrlimit`'s soft limit; `None` for `RLIM_INFINITY`.
fn soft_rlimit(resource: libc::__rlimit_resource_t) -> io::Result<Option<u64>> {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes into the struct we own and pass by pointer.
    if unsafe { libc::getrlimit(resource, &mut limit) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok((limit.rlim_cur != libc::RLIM_INFINITY).then_some(limit.rlim_cur))
}

/// The cgroup directories of this process's `pids` controller, from its own cgroup up to the
/// root: cgroup v2 (`0::/path`, under `/sys/fs/cgroup` or its `unified` mount) and v1
/// (`N:…pids…:/path`, under `/sys/fs/cgroup/pids`), whichever exist.
pub fn pids_cgroup_dirs(proc_self_cgroup: &str, root: &Path) -> Vec<PathBuf> {
    let mut dirs = Vec::new();
    for line in proc_self_cgroup.lines() {
        let mut parts = line.splitn(3, ':');
        let (Some(_id), Some(controllers), Some(path)) = (parts.next(), parts.next(), parts.next())
        else {
            continue;
        };
        let bases: Vec<PathBuf> = if controllers.is_empty() {
            vec![root.to_path_buf(), root.join("unified")]
        } else if controllers.split(',').any(|c| c == "pids") {
            vec![root.join("pids")]
        } else {
            continue;
        };
        for base in bases {
            let mut dir = base.join(path.trim_start_matches('/'));
            loop {
                if dir.join("pids.max").is_file() {
                    dirs.push(dir.clone());
                }
                if dir == base || !dir.pop() {
                    break;
                }
            }
        }
    }
    dirs
}

/// The tightest `pids.max` level among `dirs`: (max, current) of the level with the least
/// headroom; `(None, 0)` when every level is unlimited.
fn read_cgroup_pids(dirs: &[PathBuf]) -> io::Result<(Option<u64>, u64)> {
    let mut tightest: (Option<u64>, u64) = (None, 0);
    for dir in dirs {
        let Some(max) = read_number(&dir.join("pids.max"))? else {
            continue;
        };
        let current = read_number(&dir.join("pids.current"))?.unwrap_or(0);
        let headroom = max.saturating_sub(current);
        if tightest
            .0
            .is_none_or(|m| headroom < m.saturating_sub(tightest.1))
        {
            tightest = (Some(max), current);
        }
    }
    Ok(tightest)
}

/// The cgroup directories of this process's memory controller, from its own cgroup up to the
/// root, with the file that holds the limit: cgroup v2 `memory.max`, v1
/// `memory.limit_in_bytes` (under `/sys/fs/cgroup/memory`).
pub fn memory_cgroup_files(proc_self_cgroup: &str, root: &Path) -> Vec<PathBuf> {
    let mut files = Vec::new();
    for line in proc_self_cgroup.lines() {
        let mut parts = line.splitn(3, ':');
        let (Some(_id), Some(controllers), Some(path)) = (parts.next(), parts.next(), parts.next())
        else {
            continue;
        };
        let bases: Vec<(PathBuf, &str)> = if controllers.is_empty() {
            vec![
                (root.to_path_buf(), "memory.max"),
                (root.join("unified"), "memory.max"),
            ]
        } else if controllers.split(',').any(|c| c == "memory") {
            vec![(root.join("memory"), "memory.limit_in_bytes")]
        } else {
            continue;
        };
        for (base, name) in bases {
            let mut dir = base.join(path.trim_start_matches('/'));
            loop {
                if dir.join(name).is_file() {
                    files.push(dir.join(name));
                }
                if dir == base || !dir.pop() {
                    break;
                }
            }
        }
    }
    files
}

/// The smallest memory limit among `files` (`max`, and v1's "no limit" of nearly 2^63, are no
/// limit), then `MemTotal` from `meminfo` when no level limits.
fn read_memory(files: &[PathBuf], meminfo: &str) -> Option<u64> {
    let cgroup = files
        .iter()
        .filter_map(|file| read_number(file).ok().flatten())
        .filter(|&limit| limit < 1 << 60)
        .min();
    let total = meminfo
        .lines()
        .find_map(|line| line.strip_prefix("MemTotal:"))
        .and_then(|value| {
            value
                .trim()
                .trim_end_matches("kB")
                .trim()
                .parse::<u64>()
                .ok()
        })
        .map(|kib| kib * 1024);
    match (cgroup, total) {
        (Some(cgroup), Some(total)) => Some(cgroup.min(total)),
        (cgroup, total) => cgroup.or(total),
    }
}

/// Fills [`Limits`] for this process from `getrlimit`, `/proc` and the cgroup files.
pub fn read_limits() -> io::Result<Limits> {
    let proc_sys = Path::new("/proc/sys");
    let descriptors_in_use = std::fs::read_dir("/proc/self/fd")?
        .take(FD_ENTRIES as usize)
        .count() as u64;
    let maps = read_bounded(Path::new("/proc/self/maps"), MAPS_FILE_BYTES)?;
    // The vsyscall page is listed but is not one of the process's maps.
    let maps_in_use = maps
        .lines()
        .filter(|line| !line.ends_with("[vsyscall]"))
        .count() as u64;
    let loadavg_path = Path::new("/proc/loadavg");
    let loadavg = read_bounded(loadavg_path, SMALL_FILE_BYTES)?;
    // "0.10 0.20 0.30 2/345 6789": the fourth field is runnable/all tasks.
    let tasks_on_machine = loadavg
        .split_whitespace()
        .nth(3)
        .and_then(|field| field.split_once('/'))
        .and_then(|(_, all)| all.parse().ok())
        .ok_or_else(|| invalid(loadavg_path, &loadavg))?;
    let status_path = Path::new("/proc/self/status");
    let status = read_bounded(status_path, SMALL_FILE_BYTES)?;
    let process_threads = status
        .lines()
        .find_map(|line| line.strip_prefix("Threads:"))
        .and_then(|value| value.trim().parse().ok())
        .ok_or_else(|| invalid(status_path, &status))?;
    let cgroup = read_bounded(Path::new("/proc/self/cgroup"), SMALL_FILE_BYTES)?;
    let (cgroup_pids_max, cgroup_pids_current) =
        read_cgroup_pids(&pids_cgroup_dirs(&cgroup, Path::new("/sys/fs/cgroup")))?;
    let meminfo = read_bounded(Path::new("/proc/meminfo"), SMALL_FILE_BYTES).unwrap_or_default();
    let memory_bytes = read_memory(
        &memory_cgroup_files(&cgroup, Path::new("/sys/fs/cgroup")),
        &meminfo,
    );
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    Ok(Limits {
        descriptors: soft_rlimit(libc::RLIMIT_NOFILE)?,
        descriptors_in_use,
        max_map_count: read_number(&proc_sys.join("vm/max_map_count"))?,
        maps_in_use,
        threads_max: read_number(&proc_sys.join("kernel/threads-max"))?,
        pid_max: read_number(&proc_sys.join("kernel/pid_max"))?,
        tasks_on_machine,
        cgroup_pids_max,
        cgroup_pids_current,
        nproc: if root {
            None
        } else {
            soft_rlimit(libc::RLIMIT_NPROC)?
        },
        process_threads,
        memory_bytes,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The development VM at rest: fd limit 20,000, max_map_count 65,530, threads-max 192,730,
    /// pid_max 32,768, no cgroup limit, root (no NPROC).
    fn machine() -> Limits {
        Limits {
            descriptors: Some(20_000),
            descriptors_in_use: 20,
            max_map_count: Some(65_530),
            maps_in_use: 200,
            threads_max: Some(192_730),
            pid_max: Some(32_768),
            tasks_on_machine: 300,
            cgroup_pids_max: None,
            cgroup_pids_current: 0,
            nproc: None,
            process_threads: 20,
            memory_bytes: Some(64 * GIB),
        }
    }

    const GIB: u64 = 1 << 30;
    const MIB: u64 = 1 << 20;

    const NO_RESERVE: Reserve = Reserve {
        descriptors: 0,
        threads: 0,
        maps: 0,
    };

    fn connections_of(capacity: &Capacity, resource: Resource) -> Option<u64> {
        capacity
            .figures
            .iter()
            .find(|f| f.resource == resource)
            .and_then(|f| f.connections)
    }

    #[test]
    fn each_resource_limits_in_turn() {
        // (change to the machine, limiting resource, connections)
        type Change = fn(&mut Limits);
        let cases: [(&str, Change, Resource, u64); 6] = [
            (
                "maps on the VM",
                |_| {},
                Resource::MemoryMaps,
                (65_530 - 200) / 4,
            ),
            (
                "descriptors",
                |l| l.descriptors = Some(5_000),
                Resource::Descriptors,
                5_000 - 20,
            ),
            (
                "threads-max",
                |l| l.threads_max = Some(10_300),
                Resource::KernelThreads,
                10_000,
            ),
            (
                "pid_max",
                |l| l.pid_max = Some(8_000),
                Resource::PidSpace,
                8_000 - 300 - 300,
            ),
            (
                "cgroup",
                |l| {
                    l.cgroup_pids_max = Some(4_915);
                    l.cgroup_pids_current = 15;
                },
                Resource::CgroupPids,
                4_900,
            ),
            (
                "nproc",
                |l| l.nproc = Some(1_000),
                Resource::UserProcesses,
                980,
            ),
        ];
        for (what, change, resource, connections) in cases {
            let mut limits = machine();
            change(&mut limits);
            let capacity = compute(&limits, NO_RESERVE, MAPS_PER_THREAD);
            assert_eq!(capacity.limiting, resource, "{what}: {capacity:?}");
            assert_eq!(capacity.connections, connections, "{what}");
            assert_eq!(
                connections_of(&capacity, resource),
                Some(connections),
                "{what}"
            );
        }
    }

    #[test]
    fn descriptors_and_threads_are_separate_bounds() {
        let capacity = compute(&machine(), NO_RESERVE, MAPS_PER_THREAD);
        // Spliced legs after the rewrite: descriptors only.
        assert_eq!(capacity.descriptors, 20_000 - 20);
        // Threads: maps bind before pid_max (32,468) and threads-max.
        assert_eq!(capacity.threaded, (65_530 - 200) / 4);
        assert_eq!(capacity.threaded_limiting, Resource::MemoryMaps);
        assert_eq!(capacity.connections, capacity.threaded);
    }

    #[test]
    fn an_unlimited_cgroup_and_nproc_do_not_limit() {
        let capacity = compute(&machine(), NO_RESERVE, MAPS_PER_THREAD);
        assert_eq!(connections_of(&capacity, Resource::CgroupPids), None);
        assert_eq!(connections_of(&capacity, Resource::UserProcesses), None);
        let text: Vec<String> = capacity.figures.iter().map(|f| f.to_string()).collect();
        assert!(
            text.contains(&"pids.max: unlimited".to_string()),
            "{text:?}"
        );
    }

    #[test]
    fn the_reserve_and_usage_come_off_every_limit() {
        let reserve = Reserve {
            descriptors: 300,
            threads: 100,
            maps: 1_000,
        };
        let capacity = compute(&machine(), reserve, MAPS_PER_THREAD);
        assert_eq!(capacity.descriptors, 20_000 - 20 - 300);
        assert_eq!(
            connections_of(&capacity, Resource::MemoryMaps),
            Some((65_530 - 200 - 1_000) / 4)
        );
        assert_eq!(
            connections_of(&capacity, Resource::KernelThreads),
            Some(192_730 - 300 - 100)
        );
        // Usage above the limit leaves nothing, not an underflow.
        let mut full = machine();
        full.maps_in_use = 70_000;
        let capacity = compute(&full, reserve, MAPS_PER_THREAD);
        assert_eq!(capacity.connections, 0);
        assert_eq!(capacity.limiting, Resource::MemoryMaps);
    }

    #[test]
    fn a_cap_above_capacity_is_lowered_and_names_the_limit() {
        let capacity = compute(&machine(), NO_RESERVE, MAPS_PER_THREAD);
        assert_eq!(
            capacity.cap(20_000),
            (16_332, Some(Resource::MemoryMaps)),
            "{}",
            capacity.summary()
        );
        // Between the thread bound and the descriptor bound: still lowered to the thread bound.
        assert_eq!(capacity.cap(18_000), (16_332, Some(Resource::MemoryMaps)));
        assert_eq!(capacity.cap(1_000), (1_000, None));
        assert_eq!(capacity.cap(16_332), (16_332, None));
        assert_eq!(Resource::MemoryMaps.name(), "vm.max_map_count");
        assert!(capacity.summary().contains("limiting=vm.max_map_count"));
    }

    #[test]
    fn everything_unlimited_is_still_a_number() {
        let limits = Limits {
            descriptors: None,
            max_map_count: None,
            threads_max: None,
            pid_max: None,
            ..machine()
        };
        let capacity = compute(&limits, NO_RESERVE, MAPS_PER_THREAD);
        assert_eq!(capacity.connections, u64::MAX);
    }

    #[test]
    fn the_relay_reserve_covers_arenas_and_the_stack_cache() {
        let reserve = Reserve::for_relay(2, 10, 256 * 1024);
        assert_eq!(reserve.descriptors, 266);
        assert_eq!(reserve.threads, 128);
        // 128 threads x 4 + 16 arenas x 4 + 157 cached stacks x 2 + 256.
        assert_eq!(reserve.maps, 512 + 64 + 314 + 256);
    }

    #[test]
    fn cgroup_directories_v1_v2_and_hybrid() {
        let root = Path::new("/sys/fs/cgroup");
        // Paths that do not exist on the test machine give no directory.
        assert!(pids_cgroup_dirs("0::/nowhere/at/all\n", root).is_empty());
        assert!(pids_cgroup_dirs("garbage\n4:memory:/x\n", root).is_empty());
    }

    #[test]
    fn cgroup_levels_pick_the_least_headroom() {
        let dir = std::env::temp_dir().join(format!("orca-relay-capacity-{}", std::process::id()));
        let child = dir.join("system.slice/orca-relay-cell.service");
        std::fs::create_dir_all(&child).unwrap();
        std::fs::write(dir.join("pids.max"), "max\n").unwrap();
        std::fs::write(dir.join("pids.current"), "900\n").unwrap();
        std::fs::write(dir.join("system.slice/pids.max"), "1000\n").unwrap();
        std::fs::write(dir.join("system.slice/pids.current"), "900\n").unwrap();
        std::fs::write(child.join("pids.max"), "4915\n").unwrap();
        std::fs::write(child.join("pids.current"), "30\n").unwrap();
        let dirs = pids_cgroup_dirs("0::/system.slice/orca-relay-cell.service\n", &dir);
        assert_eq!(dirs.len(), 3, "{dirs:?}");
        // The slice has 100 left, the service 4,885: the slice binds.
        assert_eq!(read_cgroup_pids(&dirs).unwrap(), (Some(1000), 900));
        std::fs::write(child.join("pids.max"), "bogus\n").unwrap();
        assert!(read_cgroup_pids(&dirs).is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    fn needs(cap: u64) -> Needs {
        Needs {
            cpus: 2,
            database_pool_max: 10,
            pending_upgrades_max: 256,
            closing_connections_max: 256,
            http_connections_max: 1024,
            configured_cap: cap,
            memory: MemoryBounds {
                per_connection: 2 * MIB,
                buffers: 0,
                base: 512 * MIB,
            },
        }
    }

    #[test]
    fn the_cap_is_lowered_to_what_memory_holds_at_the_worst_case() {
        // 24 GiB: (24 GiB - 512 MiB) / 2 MiB = 12,032 connections.
        let plan = plan_with_memory(Some(24 * GIB), 15_000);
        assert_eq!(
            (plan.cap, plan.lowered_by),
            (12_032, Some(Resource::Memory))
        );
        assert!(plan.rss_at_cap <= 24 * GIB);
        assert_eq!(plan.rss_at_cap, 512 * MIB + 12_032 * 2 * MIB);
        // Descriptors first, then memory: 19,074 by descriptors, fewer by memory.
        assert_eq!(plan.ceiling, 19_074);
        // Enough memory: the cap stands, and the RSS at it is stated.
        let kept = plan_with_memory(Some(64 * GIB), 15_000);
        assert_eq!((kept.cap, kept.lowered_by), (15_000, None));
        assert!(kept
            .summary()
            .contains(&format!("rss_at_cap={}", 512 * MIB + 30_000 * MIB)));
        // Unknown memory: nothing is lowered for it.
        let unknown = plan_with_memory(None, 15_000);
        assert_eq!((unknown.cap, unknown.lowered_by), (15_000, None));
        assert!(unknown.summary().contains("memory=unknown"));
        // Not even the base fits: one connection, never zero.
        assert_eq!(plan_with_memory(Some(100 * MIB), 1_000).cap, 1);
    }

    /// A live handover runs two processes of the same size: the task limits hold every task
    /// of this process twice (the rest of what they count once), and the relay threads are
    /// bounded by that; the maps are per process and stay whole. The cell unit's `TasksMax=`
    /// (23,040) holds its sizing (10,000 controls and 256 pending upgrades) that way.
    #[test]
    fn the_task_limits_hold_two_processes_for_a_handover() {
        let mut limits = machine();
        limits.cgroup_pids_max = Some(11_520);
        limits.cgroup_pids_current = 40;
        limits.process_threads = 40;
        let halved = plan(&limits, needs(10_000));
        // (11,520 - 40 in the cgroup - 40 of ours - 2 x 1,152 reserved) / 2.
        assert_eq!(halved.handover_threads, Some((4_568, Resource::CgroupPids)));
        assert_eq!(halved.relay_threads, 4_568);
        assert!(halved
            .summary()
            .contains("threads_limited_by=pids.max threads_counted=twice_for_handover"));
        assert!(halved.handover_figure().contains("pids.max holds 4568"));
        limits.cgroup_pids_max = Some(23_040);
        let unit = plan(&limits, needs(10_000));
        assert!(unit.relay_threads >= 10_000 + 256, "{}", unit.summary());
        // No task limit: the maps alone.
        let unlimited = Limits {
            threads_max: None,
            pid_max: None,
            ..machine()
        };
        let plan = plan(&unlimited, needs(10_000));
        assert_eq!(plan.handover_threads, None);
        assert_eq!(plan.relay_threads, plan.capacity.threaded);
        assert_eq!(plan.threads_limited_by(), Resource::MemoryMaps);
    }

    fn plan_with_memory(memory: Option<u64>, cap: u64) -> Plan {
        let mut limits = machine();
        limits.memory_bytes = memory;
        plan(&limits, needs(cap))
    }

    #[test]
    fn memory_comes_from_the_tightest_cgroup_level_else_memtotal() {
        let dir = std::env::temp_dir().join(format!("orca-memory-{}", std::process::id()));
        let unit = dir.join("system.slice/orca-relay-cell.service");
        std::fs::create_dir_all(&unit).unwrap();
        std::fs::write(dir.join("memory.max"), "max\n").unwrap();
        std::fs::write(dir.join("system.slice/memory.max"), "8589934592\n").unwrap();
        std::fs::write(unit.join("memory.max"), "max\n").unwrap();
        let files = memory_cgroup_files("0::/system.slice/orca-relay-cell.service\n", &dir);
        assert_eq!(files.len(), 3);
        let meminfo = "MemTotal:       24684544 kB\nMemFree: 1 kB\n";
        assert_eq!(read_memory(&files, meminfo), Some(8 * GIB));
        std::fs::write(dir.join("system.slice/memory.max"), "max\n").unwrap();
        assert_eq!(read_memory(&files, meminfo), Some(24_684_544 * 1024));
        // cgroup v1's "unlimited".
        std::fs::write(dir.join("system.slice/memory.max"), "9223372036854771712\n").unwrap();
        assert_eq!(read_memory(&files, meminfo), Some(24_684_544 * 1024));
        assert_eq!(read_memory(&[], "garbage"), None);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn the_plan_lowers_a_cap_above_the_descriptor_ceiling_and_bounds_relay_threads() {
        let plan = plan(&machine(), needs(20_000));
        // 20,000 - 20 in use - (256 + 10 + 256 pending + 256 closing + 128 HTTP) = 19,074.
        assert_eq!(plan.ceiling, 19_074);
        assert_eq!(plan.cap, 19_074);
        assert_eq!(
            plan.descriptors_reserved.to_string(),
            "descriptors reserved: 906 = 266 process and database pool + 256 pending + 256 closing + 128 HTTP"
        );
        assert_eq!(plan.lowered_by, Some(Resource::Descriptors));
        // Maps bind one process's threads: (65,530 - 200 - reserve) / 4, the reserve holding
        // the HTTP threads' maps too.
        assert_eq!(plan.capacity.threaded_limiting, Resource::MemoryMaps);
        assert_eq!(plan.capacity.threaded, (65_530 - 200 - 5_242) / 4);
        // The task ids bind two of them (a handover): (32,768 - 300 reserved - 300 on the
        // machine - 20 of ours - 2 x 1,152 reserved) / 2.
        assert_eq!(
            plan.handover_threads,
            Some((14_922, Resource::PidSpace)),
            "{}",
            plan.summary()
        );
        assert_eq!(plan.relay_threads, 14_922);
        assert_eq!(plan.threads_limited_by(), Resource::PidSpace);
        assert!(plan.summary().contains("threads_limited_by=kernel.pid_max"));
        let kept = super::plan(&machine(), needs(1_000));
        assert_eq!((kept.cap, kept.lowered_by), (1_000, None));
        assert!(kept
            .summary()
            .contains("connections=19074 limited_by=RLIMIT_NOFILE cap=1000"));
    }
}
