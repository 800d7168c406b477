//! A small bounded connection pool with an adjustable ceiling.
//!
//! Owns the database connections of one [`Store`](super::Store): at most `max` exist, and
//! checkouts never make more than the current *ceiling* exist. The ceiling is what makes the
//! dead-man budget a guarantee (SPEC §5.5 "Hard bound"): a reserve-mode cell runs under
//! `POOL_RESERVE_MAX`, and only a slot holder or a `db`-mode cell raises it to the full pool.
//! Lowering the ceiling never closes a connection that is in use; connections returned while
//! more than `ceiling` are open are closed instead of kept idle, so the pool shrinks as work
//! finishes.
//!
//! Runs on whichever thread calls [`Pool::checkout`]. Callers that find no free connection wait
//! on a `Condvar` (counted in [`Pool::waiters`], which the admit-effective writer reads to skip
//! refreshes while the pool is busy) until a connection comes back or the timeout passes.
//!
//! Must never: hold its mutex while opening, checking or closing a connection (that is database
//! I/O), or hand out a connection that errored (the guard's [`PooledConnection::discard`] drops
//! it instead of returning it).

use std::ops::{Deref, DerefMut};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::StoreError;
use crate::clock;

/// Opens one connection. The pool calls it without holding its lock.
pub trait Connector: Send + Sync + 'static {
    type Conn: Send + 'static;

    /// Opens a new connection; the error says why, without secrets.
    fn connect(&self) -> Result<Self::Conn, StoreError>;

    /// A cheap, local check (no round trip) that an idle connection is still worth handing out.
    fn is_usable(&self, _conn: &Self::Conn) -> bool {
        true
    }
}

/// Counts under the pool's lock. `open` includes connections being opened right now, so that
/// concurrent checkouts never overshoot the ceiling.
struct PoolState<C> {
    idle: Vec<C>,
    open: u32,
    ceiling: u32,
    waiters: u32,
}

struct Shared<K: Connector> {
    connector: K,
    max: u32,
    state: Mutex<PoolState<K::Conn>>,
    returned: Condvar,
}

/// A bounded pool; cheap to clone (an `Arc` inside).
pub struct Pool<K: Connector> {
    shared: Arc<Shared<K>>,
}

impl<K: Connector> Clone for Pool<K> {
    fn clone(&self) -> Self {
        Pool {
            shared: self.shared.clone(),
        }
    }
}

/// A snapshot of the pool's counts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PoolCounts {
    pub open: u32,
    pub idle: u32,
    pub waiters: u32,
    pub max: u32,
    pub ceiling: u32,
}

impl<K: Connector> Pool<K> {
    /// A pool of at most `max` connections (at least 1), starting with the ceiling at `max`.
    /// Opens nothing until the first checkout.
    pub fn new(connector: K, max: u32) -> Self {
        let max = max.max(1);
        Pool {
            shared: Arc::new(Shared {
                connector,
                max,
                state: Mutex::new(PoolState {
                    idle: Vec::new(),
                    open: 0,
                    ceiling: max,
                    waiters: 0,
                }),
                returned: Condvar::new(),
            }),
        }
    }

    fn lock(&self) -> MutexGuard<'_, PoolState<K::Conn>> {
        // A panic while holding this lock leaves only plain counters behind; keep going.
        self.shared
            .state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Opens connections until `count` are open (or the ceiling), each within `timeout`, and
    /// leaves them idle: a handover's next process starts with the pool the running one had, so
    /// its first admissions do not queue behind connects (and are not shed for it). How many
    /// are open after.
    pub fn warm(&self, count: u32, timeout: Duration) -> u32 {
        let mut held = Vec::new();
        while self.open() < count.min(self.counts().ceiling) {
            match self.checkout(timeout) {
                Ok(conn) => held.push(conn),
                Err(_) => break,
            }
        }
        drop(held);
        self.open()
    }

    /// Takes a connection: an idle one, a new one if fewer than `ceiling` are open, or else the
    /// next one returned within `timeout`.
    pub fn checkout(&self, timeout: Duration) -> Result<PooledConnection<K>, StoreError> {
        let deadline = clock::instant() + timeout;
        let mut state = self.lock();
        loop {
            if let Some(conn) = state.idle.pop() {
                drop(state);
                if self.shared.connector.is_usable(&conn) {
                    return Ok(self.guard(conn, true));
                }
                // Closed behind our back (server restart): drop it outside the lock, try again.
                drop(conn);
                state = self.lock();
                state.open -= 1;
                continue;
            }
            if state.open < state.ceiling {
                state.open += 1;
                drop(state);
                return self.open_counted();
            }
            state = self.wait_returned(state, deadline, timeout)?;
        }
    }

    /// Opens a connection in a place the caller has counted (`open` already raised); the place
    /// is given back when the connect fails.
    fn open_counted(&self) -> Result<PooledConnection<K>, StoreError> {
        match self.shared.connector.connect() {
            Ok(conn) => Ok(self.guard(conn, false)),
            Err(error) => {
                self.lock().open -= 1;
                self.shared.returned.notify_one();
                Err(error)
            }
        }
    }

    /// Waits, as a counted waiter, until a connection is returned or `deadline` (the pool
    /// exhausted, after `timeout` in all).
    fn wait_returned<'a>(
        &'a self,
        mut state: MutexGuard<'a, PoolState<K::Conn>>,
        deadline: Instant,
        timeout: Duration,
    ) -> Result<MutexGuard<'a, PoolState<K::Conn>>, StoreError> {
        let now = clock::instant();
        if now >= deadline {
            return Err(StoreError::pool_exhausted(timeout, state.open));
        }
        state.waiters += 1;
        let (mut state, _) = self
            .shared
            .returned
            .wait_timeout(state, deadline - now)
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        state.waiters -= 1;
        Ok(state)
    }

    fn guard(&self, conn: K::Conn, reused: bool) -> PooledConnection<K> {
        PooledConnection {
            pool: self.clone(),
            conn: Some(conn),
            broken: false,
            reused,
        }
    }

    /// Takes a newly opened connection, never an idle one: the retry after a pooled
    /// connection turned out dead. An idle connection found while the pool is at its ceiling
    /// is closed to make room (it most likely points at the same dead server).
    pub fn checkout_fresh(&self, timeout: Duration) -> Result<PooledConnection<K>, StoreError> {
        let deadline = clock::instant() + timeout;
        let mut state = self.lock();
        loop {
            if state.open < state.ceiling {
                state.open += 1;
                drop(state);
                return self.open_counted();
            }
            if let Some(conn) = state.idle.pop() {
                state.open -= 1;
                drop(state);
                drop(conn);
                state = self.lock();
                continue;
            }
            state = self.wait_returned(state, deadline, timeout)?;
        }
    }

    /// Sets how many connections may exist, clamped to `1..=max`. Idle connections above the
    /// new ceiling are closed now; busy ones are closed as they come back. Raising it wakes the
    /// waiters so they can open connections.
    pub fn set_ceiling(&self, ceiling: u32) {
        let ceiling = ceiling.clamp(1, self.shared.max);
        let mut surplus = Vec::new();
        {
            let mut state = self.lock();
            state.ceiling = ceiling;
            while state.open > state.ceiling {
                match state.idle.pop() {
                    Some(conn) => {
                        state.open -= 1;
                        surplus.push(conn);
                    }
                    None => break,
                }
            }
        }
        self.shared.returned.notify_all();
        drop(surplus);
    }

    /// Closes every idle connection. Used after an error that says the connection itself
    /// failed: the other idle ones most likely point at the same dead server.
    pub fn discard_idle(&self) {
        let closed = {
            let mut state = self.lock();
            let closed = std::mem::take(&mut state.idle);
            state.open -= closed.len() as u32;
            closed
        };
        if !closed.is_empty() {
            self.shared.returned.notify_all();
        }
        drop(closed);
    }

    pub fn counts(&self) -> PoolCounts {
        let state = self.lock();
        PoolCounts {
            open: state.open,
            idle: state.idle.len() as u32,
            waiters: state.waiters,
            max: self.shared.max,
            ceiling: state.ceiling,
        }
    }

    /// Callers blocked in [`Pool::checkout`] right now.
    pub fn waiters(&self) -> u32 {
        self.lock().waiters
    }

    /// Connections that exist (idle, in use, or being opened).
    pub fn open(&self) -> u32 {
        self.lock().open
    }

    pub fn idle(&self) -> u32 {
        self.lock().idle.len() as u32
    }

    fn give_back(&self, conn: K::Conn, broken: bool) {
        let closing = {
            let mut state = self.lock();
            if broken || state.open > state.ceiling {
                state.open -= 1;
                Some(conn)
            } else {
                state.idle.push(conn);
                None
            }
        };
        self.shared.returned.notify_one();
        // Closing a connection may talk to the server: never under the lock.
        drop(closing);
    }
}

/// A checked-out connection; returns to the pool on drop unless discarded.
pub struct PooledConnection<K: Connector> {
    pool: Pool<K>,
    conn: Option<K::Conn>,
    broken: bool,
    /// Handed out from the idle list (it has sat in the pool; the server may have closed it
    /// meanwhile), rather than opened for this checkout.
    reused: bool,
}

impl<K: Connector> PooledConnection<K> {
    /// Marks the connection as failed: it is closed on drop instead of returned.
    pub fn discard(&mut self) {
        self.broken = true;
    }

    /// Whether this connection came from the idle list rather than being opened for this
    /// checkout.
    pub fn reused(&self) -> bool {
        self.reused
    }
}

impl<K: Connector> Deref for PooledConnection<K> {
    type Target = K::Conn;

    fn deref(&self) -> &K::Conn {
        self.conn
            .as_ref()
            .expect("a pooled connection is present until drop")
    }
}

impl<K: Connector> DerefMut for PooledConnection<K> {
    fn deref_mut(&mut self) -> &mut K::Conn {
        self.conn
            .as_mut()
            .expect("a pooled connection is present until drop")
    }
}

impl<K: Connector> Drop for PooledConnection<K> {
    fn drop(&mut self) {
        if let Some(conn) = self.conn.take() {
            self.pool.give_back(conn, self.broken);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::threads;
    use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};

    /// Hands out numbered fake connections and counts how many are alive.
    #[derive(Default)]
    struct FakeConnector {
        opened: AtomicU32,
        alive: Arc<AtomicU32>,
        fail: AtomicBool,
    }

    struct FakeConn {
        id: u32,
        alive: Arc<AtomicU32>,
    }

    impl Drop for FakeConn {
        fn drop(&mut self) {
            self.alive.fetch_sub(1, Ordering::SeqCst);
        }
    }

    impl Connector for Arc<FakeConnector> {
        type Conn = FakeConn;
        fn connect(&self) -> Result<FakeConn, StoreError> {
            if self.fail.load(Ordering::SeqCst) {
                return Err(StoreError::Unavailable("connect refused".into()));
            }
            let id = self.opened.fetch_add(1, Ordering::SeqCst);
            self.alive.fetch_add(1, Ordering::SeqCst);
            Ok(FakeConn {
                id,
                alive: self.alive.clone(),
            })
        }
    }

    fn pool(max: u32) -> (Pool<Arc<FakeConnector>>, Arc<FakeConnector>) {
        let connector = Arc::new(FakeConnector::default());
        (Pool::new(connector.clone(), max), connector)
    }

    const SHORT: Duration = Duration::from_millis(50);
    const LONG: Duration = Duration::from_secs(10);

    /// Waits (on the pool's own counters, with a deadline) until `check` holds.
    fn wait_until(what: &str, mut check: impl FnMut() -> bool) {
        let deadline = clock::instant() + LONG;
        while !check() {
            assert!(clock::instant() < deadline, "timed out waiting for {what}");
            std::thread::yield_now();
        }
    }

    #[test]
    fn opens_lazily_and_reuses_idle_connections() {
        let (pool, connector) = pool(3);
        assert_eq!(
            pool.open(),
            0,
            "nothing is opened before the first checkout"
        );
        let first = pool.checkout(SHORT).unwrap().id;
        assert_eq!((pool.open(), pool.idle()), (1, 1));
        let second = pool.checkout(SHORT).unwrap().id;
        assert_eq!(first, second, "the idle connection is reused");
        assert_eq!(connector.opened.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn checkout_times_out_when_the_ceiling_is_reached() {
        let (pool, _) = pool(4);
        pool.set_ceiling(2);
        let _a = pool.checkout(SHORT).unwrap();
        let _b = pool.checkout(SHORT).unwrap();
        let error = pool
            .checkout(SHORT)
            .err()
            .expect("a third checkout must wait");
        assert_eq!(error.reason_code(), "sql_pool_exhausted");
        assert!(error.is_unavailable());
        assert_eq!(
            pool.open(),
            2,
            "the ceiling, not max, bounds open connections"
        );
        assert_eq!(
            pool.waiters(),
            0,
            "a timed-out caller no longer counts as waiting"
        );
    }

    #[test]
    fn a_waiter_is_counted_and_gets_the_returned_connection() {
        let (pool, _) = pool(1);
        let held = pool.checkout(SHORT).unwrap();
        let held_id = held.id;
        let waiter_pool = pool.clone();
        let waiter = threads::spawn("pool-waiter", move || {
            waiter_pool.checkout(LONG).map(|conn| conn.id)
        })
        .unwrap();
        wait_until("one waiter", || pool.waiters() == 1);
        assert_eq!(pool.counts().waiters, 1);
        drop(held);
        let got = waiter
            .join()
            .unwrap()
            .expect("the waiter gets the connection");
        assert_eq!(got, held_id);
        assert_eq!(pool.waiters(), 0);
    }

    #[test]
    fn lowering_the_ceiling_closes_connections_as_they_come_back() {
        let (pool, connector) = pool(4);
        let held: Vec<_> = (0..4).map(|_| pool.checkout(SHORT).unwrap()).collect();
        assert_eq!(connector.alive.load(Ordering::SeqCst), 4);
        pool.set_ceiling(2);
        assert_eq!(
            pool.open(),
            4,
            "busy connections are not closed under their users"
        );
        drop(held);
        assert_eq!(pool.open(), 2);
        assert_eq!(pool.idle(), 2);
        assert_eq!(
            connector.alive.load(Ordering::SeqCst),
            2,
            "surplus really closed"
        );
    }

    #[test]
    fn lowering_the_ceiling_closes_surplus_idle_connections_at_once() {
        let (pool, connector) = pool(3);
        let held: Vec<_> = (0..3).map(|_| pool.checkout(SHORT).unwrap()).collect();
        drop(held);
        assert_eq!(pool.idle(), 3);
        pool.set_ceiling(1);
        assert_eq!((pool.open(), pool.idle()), (1, 1));
        assert_eq!(connector.alive.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn raising_the_ceiling_wakes_waiters_to_open_connections() {
        let (pool, _) = pool(3);
        pool.set_ceiling(1);
        let _held = pool.checkout(SHORT).unwrap();
        let waiter_pool = pool.clone();
        let waiter = threads::spawn("pool-waiter", move || {
            waiter_pool.checkout(LONG).map(|conn| conn.id)
        })
        .unwrap();
        wait_until("one waiter", || pool.waiters() == 1);
        pool.set_ceiling(3);
        assert!(
            waiter.join().unwrap().is_ok(),
            "the waiter opened a new one"
        );
        assert_eq!(pool.open(), 2);
    }

    #[test]
    fn ceiling_is_clamped_to_max_and_at_least_one() {
        let (pool, _) = pool(5);
        pool.set_ceiling(50);
        assert_eq!(pool.counts().ceiling, 5);
        pool.set_ceiling(0);
        assert_eq!(pool.counts().ceiling, 1);
    }

    #[test]
    fn a_discarded_connection_is_closed_not_returned() {
        let (pool, connector) = pool(2);
        let mut conn = pool.checkout(SHORT).unwrap();
        let broken_id = conn.id;
        conn.discard();
        drop(conn);
        assert_eq!((pool.open(), pool.idle()), (0, 0));
        assert_eq!(connector.alive.load(Ordering::SeqCst), 0);
        let fresh = pool.checkout(SHORT).unwrap();
        assert_ne!(
            fresh.id, broken_id,
            "a new connection replaces the broken one"
        );
    }

    #[test]
    fn a_failed_connect_frees_its_slot() {
        let (pool, connector) = pool(1);
        connector.fail.store(true, Ordering::SeqCst);
        let error = pool.checkout(SHORT).err().expect("connect fails");
        assert_eq!(error.reason_code(), "sql_failed");
        assert_eq!(pool.open(), 0);
        connector.fail.store(false, Ordering::SeqCst);
        assert!(pool.checkout(SHORT).is_ok(), "the slot was given back");
    }

    #[test]
    fn discard_idle_closes_every_idle_connection() {
        let (pool, connector) = pool(3);
        let held: Vec<_> = (0..3).map(|_| pool.checkout(SHORT).unwrap()).collect();
        let mut iter = held.into_iter();
        let busy = iter.next().unwrap();
        drop(iter);
        pool.discard_idle();
        assert_eq!((pool.open(), pool.idle()), (1, 0));
        assert_eq!(connector.alive.load(Ordering::SeqCst), 1);
        drop(busy);
        assert_eq!(pool.idle(), 1);
    }

    #[test]
    fn many_callers_never_exceed_the_ceiling() {
        let (pool, connector) = pool(8);
        pool.set_ceiling(3);
        let peak = Arc::new(AtomicU32::new(0));
        let workers: Vec<_> = (0..16)
            .map(|i| {
                let pool = pool.clone();
                let connector = connector.clone();
                let peak = peak.clone();
                threads::spawn(format!("pool-worker-{i}"), move || {
                    for _ in 0..200 {
                        let conn = pool.checkout(LONG).unwrap();
                        peak.fetch_max(connector.alive.load(Ordering::SeqCst), Ordering::SeqCst);
                        drop(conn);
                    }
                })
                .unwrap()
            })
            .collect();
        for worker in workers {
            worker.join().unwrap();
        }
        assert!(peak.load(Ordering::SeqCst) <= 3, "peak {peak:?}");
        assert_eq!(pool.waiters(), 0);
    }
}
