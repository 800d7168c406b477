//! One cell-wide budget for the memory of large buffers (`ORCA_RELAY_BUFFER_BUDGET_BYTES`).
//!
//! A connection holds an ordinary amount of buffer memory of its own: a control's read buffer
//! and message up to [`CONTROL_ORDINARY_BYTES`], a spliced leg's partial frame and its peer's
//! pending output up to `splice::LEG_ORDINARY_BYTES`. The capacity plan counts that much per
//! connection. Anything beyond (a 1 MiB control frame, a stream whose reader is slower than its
//! writer) is drawn from this one budget through a [`Lease`] *before* the bytes are read, so
//! memory never grows past what the plan states, whatever the peers send. A connection whose
//! lease cannot grow waits, not read (the kernel's buffers and TCP's window push back on its
//! peer), until another connection gives bytes back; each such wait is counted by side.
//!
//! Leases are taken with one compare-and-swap and given back with one subtraction; nothing
//! blocks on the budget itself (a control's thread waits on its quiesce descriptor with a
//! short timeout, a splice worker retries on a timer).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// What a control reads into without drawing on the budget: its buffer and the message being
/// assembled (desktops' control messages are a few hundred bytes).
pub const CONTROL_ORDINARY_BYTES: usize = 16 * 1024;

/// What a control draws from the budget once its buffer and message may pass the ordinary
/// amount: the most they can hold (a buffer of the largest frame, the message it is copied
/// into, and a message of earlier fragments), at once.
pub const CONTROL_LARGE_LEASE_BYTES: usize =
    3 * crate::protocol::CONTROL_MAX_FRAME_BYTES + 64 * 1024;

/// How often a connection waiting for the budget looks again.
pub const BUDGET_RETRY: std::time::Duration = std::time::Duration::from_millis(20);

/// The smallest budget a process may be given: one control frame of the largest size (its
/// buffer and message) and one splice read, so that every connection can always make progress.
pub const MIN_BUDGET_BYTES: u64 = 4 * 1024 * 1024;

/// The default budget: 256 MiB (256 controls' 1 MiB frames at once, or 200 streams with a full
/// pending output).
pub const DEFAULT_BUDGET_BYTES: u64 = 256 * 1024 * 1024;

/// Allocations of [`LARGE_ALLOCATION_BYTES`] or more are mapped from the kernel and given back
/// to it when freed. glibc's default raises that threshold to the largest block freed (up to
/// 32 MiB), after which large buffers come from per-thread arenas that keep the memory once
/// they are freed: 30 controls flooding 1 MiB frames through a 4 MiB budget left the process
/// 34 MiB larger (measured, `tests/memory_plan.rs`); a budget bounds live buffers, so freed
/// ones must leave. Called once, first thing in `main`.
pub fn large_buffers_from_the_kernel() {
    // SAFETY: mallopt only sets an allocator parameter; nothing has been allocated from
    // another thread yet.
    unsafe {
        libc::mallopt(
            libc::M_MMAP_THRESHOLD,
            LARGE_ALLOCATION_BYTES as libc::c_int,
        );
    }
}

/// See [`large_buffers_from_the_kernel`]: glibc's initial threshold, kept.
pub const LARGE_ALLOCATION_BYTES: usize = 128 * 1024;

/// Which kind of connection waited.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    Control = 0,
    Splice = 1,
}

/// The budget: its limit, what leases hold, and the waits by side.
#[derive(Debug)]
pub struct BufferBudget {
    limit: u64,
    used: AtomicU64,
    peak: AtomicU64,
    waits: [AtomicU64; 2],
}

impl BufferBudget {
    pub fn new(limit: u64) -> Arc<BufferBudget> {
        Arc::new(BufferBudget {
            limit,
            used: AtomicU64::new(0),
            peak: AtomicU64::new(0),
            waits: [AtomicU64::new(0), AtomicU64::new(0)],
        })
    }

    pub fn limit(&self) -> u64 {
        self.limit
    }

    /// Bytes the leases hold now.
    pub fn used(&self) -> u64 {
        self.used.load(Ordering::Relaxed)
    }

    /// The most the leases ever held at once.
    pub fn peak(&self) -> u64 {
        self.peak.load(Ordering::Relaxed)
    }

    /// Times a connection had to wait for the budget, by side.
    pub fn waits(&self, side: Side) -> u64 {
        self.waits[side as usize].load(Ordering::Relaxed)
    }

    /// A connection of `side` starts waiting for the budget.
    pub fn count_wait(&self, side: Side) {
        self.waits[side as usize].fetch_add(1, Ordering::Relaxed);
    }

    fn take(&self, bytes: u64) -> bool {
        let mut used = self.used.load(Ordering::Relaxed);
        loop {
            let Some(next) = used.checked_add(bytes).filter(|&next| next <= self.limit) else {
                return false;
            };
            match self
                .used
                .compare_exchange_weak(used, next, Ordering::AcqRel, Ordering::Relaxed)
            {
                Ok(_) => {
                    self.peak.fetch_max(next, Ordering::Relaxed);
                    return true;
                }
                Err(now) => used = now,
            }
        }
    }

    fn give(&self, bytes: u64) {
        self.used.fetch_sub(bytes, Ordering::AcqRel);
    }
}

/// What one connection holds of the budget; given back when dropped.
#[derive(Debug)]
pub struct Lease {
    budget: Arc<BufferBudget>,
    held: u64,
}

impl Lease {
    pub fn new(budget: &Arc<BufferBudget>) -> Lease {
        Lease {
            budget: budget.clone(),
            held: 0,
        }
    }

    pub fn budget(&self) -> &Arc<BufferBudget> {
        &self.budget
    }

    /// Bytes held.
    pub fn held(&self) -> usize {
        self.held as usize
    }

    /// Holds at least `bytes`: `false` (and nothing changed) if the budget cannot give the
    /// difference.
    pub fn cover(&mut self, bytes: usize) -> bool {
        let bytes = bytes as u64;
        if bytes <= self.held {
            return true;
        }
        if !self.budget.take(bytes - self.held) {
            return false;
        }
        self.held = bytes;
        true
    }

    /// Holds at least `bytes` whatever the budget has left: for memory already held (what a
    /// handover carried), so that it is given back in the usual way.
    pub fn force(&mut self, bytes: usize) {
        let bytes = bytes as u64;
        if bytes > self.held {
            let more = bytes - self.held;
            let now = self.budget.used.fetch_add(more, Ordering::AcqRel) + more;
            self.budget.peak.fetch_max(now, Ordering::Relaxed);
            self.held = bytes;
        }
    }

    /// Holds exactly `bytes` if it held more (gives the rest back).
    pub fn settle(&mut self, bytes: usize) {
        let bytes = bytes as u64;
        if bytes < self.held {
            self.budget.give(self.held - bytes);
            self.held = bytes;
        }
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.settle(0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn leases_draw_on_one_budget_and_give_back_when_settled_or_dropped() {
        let budget = BufferBudget::new(100);
        let mut a = Lease::new(&budget);
        let mut b = Lease::new(&budget);
        assert!(a.cover(60));
        assert!(!b.cover(50), "60 + 50 is over the budget");
        assert_eq!(b.held(), 0);
        assert!(b.cover(40));
        assert!(a.cover(30), "a lease already holding enough takes nothing");
        assert_eq!(budget.used(), 100);
        a.settle(10);
        assert_eq!(budget.used(), 50);
        assert!(b.cover(90));
        drop(b);
        assert_eq!(budget.used(), 10);
        assert_eq!(budget.peak(), 100);
        drop(a);
        assert_eq!(budget.used(), 0);
    }
}
