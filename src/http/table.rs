//! The open connections of the HTTP listener, bounded, with the ones waiting for their client
//! kept in the order they started waiting so that the oldest can be shed to make room.
//!
//! Every open connection has an entry (the bound is `ORCA_RELAY_HTTP_CONNECTIONS_MAX`); a
//! connection *waits* while it reads a request head, idles between keep-alive requests, or
//! waits for body bytes (a handler reading the body, or an unread body discarded after the
//! answer), and is *held* while a handler runs. (The WebSocket port keeps its pending
//! connections in the acceptor's own loop, `relay/pending.rs`.)
//!
//! When the table is full, [`ConnectionTable::admit`] sheds the connection that has been
//! waiting longest (its socket is shut down, so the thread reading it wakes at once and ends)
//! and admits the new one; only when every entry is held is the newcomer refused. So clients
//! that open connections and never finish a head cannot keep a client that sends its request
//! promptly out: to shed it they would have to open connections faster than it sends one head.
//!
//! The lock covers the table only: a shed socket is shut down after it is released.

use std::collections::{BTreeMap, HashMap};
use std::net::{Shutdown, TcpStream};
use std::sync::{Arc, Mutex, MutexGuard};

/// A bounded table of connections.
pub struct ConnectionTable {
    capacity: usize,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    entries: HashMap<u64, Entry>,
    /// Waiting entries by the order they started waiting (oldest first): seq → id.
    waiting: BTreeMap<u64, u64>,
    next_id: u64,
    next_seq: u64,
    closed: bool,
}

struct Entry {
    stream: Arc<TcpStream>,
    waiting_seq: Option<u64>,
    /// It has been served a request (it waits now between keep-alive requests).
    served: bool,
}

/// What [`ConnectionTable::admit`] did.
pub enum Admission {
    /// Admitted, waiting; `shed` says whether the oldest waiting connection was shed for it.
    Admitted { ticket: Ticket, shed: bool },
    /// Every entry is held (or the table is closed): the newcomer is refused.
    Full,
}

impl ConnectionTable {
    pub fn new(capacity: usize) -> Arc<ConnectionTable> {
        Arc::new(ConnectionTable {
            capacity: capacity.max(1),
            state: Mutex::new(State::default()),
        })
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Open connections in the table.
    pub fn len(&self) -> usize {
        self.lock().entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Connections waiting for a request head.
    pub fn waiting(&self) -> usize {
        self.lock().waiting.len()
    }

    /// Admits `stream` as a waiting connection, shedding the longest-waiting one if the table
    /// is full.
    pub fn admit(self: &Arc<Self>, stream: &Arc<TcpStream>) -> Admission {
        let mut shed_stream = None;
        let ticket = {
            let mut state = self.lock();
            if state.closed {
                return Admission::Full;
            }
            if state.entries.len() >= self.capacity {
                let Some((_, oldest)) = state.waiting.pop_first() else {
                    return Admission::Full;
                };
                shed_stream = state.entries.remove(&oldest).map(|entry| entry.stream);
            }
            let id = state.next_id;
            state.next_id += 1;
            let seq = state.next_seq;
            state.next_seq += 1;
            state.waiting.insert(seq, id);
            state.entries.insert(
                id,
                Entry {
                    stream: stream.clone(),
                    waiting_seq: Some(seq),
                    served: false,
                },
            );
            Ticket {
                table: self.clone(),
                id,
            }
        };
        let shed = shed_stream.is_some();
        if let Some(stream) = shed_stream {
            let _ = stream.shutdown(Shutdown::Both);
        }
        Admission::Admitted { ticket, shed }
    }

    /// Closes the table: nothing more is admitted, every waiting connection is shut down, and
    /// held ones are told so when they next try to wait.
    pub fn close(&self) {
        let streams: Vec<Arc<TcpStream>> = {
            let mut state = self.lock();
            state.closed = true;
            let ids: Vec<u64> = std::mem::take(&mut state.waiting).into_values().collect();
            ids.iter()
                .filter_map(|id| state.entries.remove(id).map(|entry| entry.stream))
                .collect()
        };
        for stream in streams {
            let _ = stream.shutdown(Shutdown::Both);
        }
    }
}

impl ConnectionTable {
    /// Closes the table as a live handover's exit does: nothing more is admitted and no
    /// connection waits for another request, but a connection still waiting for its first
    /// head is left to be served (it was accepted from a listener the next process shares,
    /// and its client expects an answer); idle keep-alive connections are shut down.
    pub fn close_idle(&self) {
        let streams: Vec<Arc<TcpStream>> = {
            let mut state = self.lock();
            state.closed = true;
            let idle: Vec<(u64, u64)> = state
                .waiting
                .iter()
                .filter(|(_, id)| state.entries.get(id).is_some_and(|entry| entry.served))
                .map(|(seq, id)| (*seq, *id))
                .collect();
            idle.iter()
                .filter_map(|(seq, id)| {
                    state.waiting.remove(seq);
                    state.entries.remove(id).map(|entry| entry.stream)
                })
                .collect()
        };
        for stream in streams {
            let _ = stream.shutdown(Shutdown::Both);
        }
    }
}

/// One connection's entry; removed from the table when dropped.
pub struct Ticket {
    table: Arc<ConnectionTable>,
    id: u64,
}

impl Ticket {
    /// Stops waiting (a whole head arrived): the connection can no longer be shed. False when
    /// it was shed (or the table closed) before that.
    pub fn hold(&self) -> bool {
        let mut state = self.table.lock();
        let Some(seq) = state
            .entries
            .get_mut(&self.id)
            .map(|e| e.waiting_seq.take())
        else {
            return false;
        };
        if let Some(seq) = seq {
            state.waiting.remove(&seq);
        }
        true
    }

    /// Waits again (between keep-alive requests), as the newest waiter. False when the entry
    /// is gone or the table is closed: the connection should end.
    pub fn wait(&self) -> bool {
        let mut state = self.table.lock();
        if state.closed {
            return false;
        }
        let seq = state.next_seq;
        let Some(entry) = state.entries.get_mut(&self.id) else {
            return false;
        };
        entry.served = true;
        let previous = entry.waiting_seq.replace(seq);
        if let Some(previous) = previous {
            state.waiting.remove(&previous);
        }
        state.next_seq += 1;
        state.waiting.insert(seq, self.id);
        true
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        let mut state = self.table.lock();
        if let Some(entry) = state.entries.remove(&self.id) {
            if let Some(seq) = entry.waiting_seq {
                state.waiting.remove(&seq);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;
    use std::net::TcpListener;

    fn streams(n: usize) -> (Vec<TcpStream>, Vec<Arc<TcpStream>>) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let mut clients = Vec::new();
        let mut servers = Vec::new();
        for _ in 0..n {
            clients.push(TcpStream::connect(addr).unwrap());
            servers.push(Arc::new(listener.accept().unwrap().0));
        }
        (clients, servers)
    }

    fn admitted(admission: Admission) -> (Ticket, bool) {
        match admission {
            Admission::Admitted { ticket, shed } => (ticket, shed),
            Admission::Full => panic!("refused"),
        }
    }

    fn is_shut_down(stream: &TcpStream) -> bool {
        stream
            .set_read_timeout(Some(std::time::Duration::from_millis(50)))
            .unwrap();
        matches!((&*stream).read(&mut [0u8; 1]), Ok(0))
    }

    #[test]
    fn a_full_table_sheds_its_longest_waiter_and_refuses_when_all_are_held() {
        let (_clients, servers) = streams(5);
        let table = ConnectionTable::new(3);
        let (a, _) = admitted(table.admit(&servers[0]));
        let (b, _) = admitted(table.admit(&servers[1]));
        let (c, _) = admitted(table.admit(&servers[2]));
        // `a` is served and then waits again: now `b` has waited longest.
        assert!(a.hold());
        assert!(a.wait());
        let (d, shed) = admitted(table.admit(&servers[3]));
        assert!(shed);
        assert!(!b.hold(), "b was shed");
        assert!(is_shut_down(&servers[1]));
        assert_eq!(table.len(), 3);
        // Everyone held: the next one is refused.
        assert!(a.hold() && c.hold() && d.hold());
        assert!(matches!(table.admit(&servers[4]), Admission::Full));
        drop(c);
        let (_e, shed) = admitted(table.admit(&servers[4]));
        assert!(!shed);
        assert_eq!((table.len(), table.waiting()), (3, 1));
    }

    #[test]
    fn closing_sheds_waiters_and_stops_held_ones_from_waiting() {
        let (_clients, servers) = streams(2);
        let table = ConnectionTable::new(4);
        let (waiter, _) = admitted(table.admit(&servers[0]));
        let (held, _) = admitted(table.admit(&servers[1]));
        assert!(held.hold());
        table.close();
        assert!(is_shut_down(&servers[0]));
        assert!(!waiter.hold());
        assert!(!held.wait());
        assert!(matches!(table.admit(&servers[0]), Admission::Full));
        drop(held);
        assert!(table.is_empty());
    }
}
