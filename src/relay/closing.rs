//! The descriptors that refused and closing connections hold (issue 30): the bound on what the
//! reaper keeps lingering, and the close at once past it or when the peer has gone.
//!
//! A refused upgrade or pending leg is answered, then lingers 0.5 to 1 s in the reaper
//! (`relay/socket.rs`), so that what its client still sends is read and dropped instead of
//! turning our close into a reset that could destroy the answer; a closing WebSocket waits up to
//! 1 s there for the peer's close frame. Each holds its descriptor meanwhile, outside the
//! connection cap: before this bound, 2,259 refusals a second filled 1,024 descriptors and both
//! listeners failed `accept`. [`ClosingBound`] counts the connections handed to the reaper that
//! are still open (a weak handle each: a connection is open while a handle to its descriptor
//! is) and lets at most `ORCA_RELAY_CLOSING_CONNECTIONS_MAX` of them linger:
//! - a connection whose peer has gone (its FIN or reset arrived: `POLLRDHUP`, `POLLHUP`,
//!   `POLLERR`) has nothing to linger for and is closed at once, whatever the count;
//! - past the bound, a refused connection is closed at once: what is readable now is drained (at
//!   most [`DRAIN_BYTES`]) so that the close is an orderly FIN after the answer; if bytes remain,
//!   the close is abortive (`SO_LINGER` 0: a reset, nothing left for the kernel to keep). A
//!   closing WebSocket past the bound (its close frame already written) is shut down, so its
//!   descriptor goes as soon as its last owner lets go of it.
//!
//! The capacity plan reserves the bound's descriptors (`capacity::plan`, `check-config`), and
//! `/metrics` shows the lingering connections, the bound and the closes at once by reason.
//!
//! Runs on: whichever thread hands a connection to the reaper. Never blocks (the peer check is a
//! `poll` with a zero timeout, the drain non-blocking reads) and holds its lock only across a
//! scan of weak handles.

use std::any::Any;
use std::collections::VecDeque;
use std::io;
use std::net::TcpStream;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::{Arc, Mutex, Weak};

use crate::metrics::{Counter, Registry};

/// What a refused connection past the bound may still have drained before its close: enough
/// for the rest of a head or a first frame, not a flood.
pub const DRAIN_BYTES: usize = 64 * 1024;

/// Whether a connection handed to the reaper may linger.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Within the bound, its peer still there: it waits out its linger.
    Linger,
    /// Its peer has gone: closed at once.
    PeerGone,
    /// The bound is reached: closed at once.
    Full,
}

/// A connection in the reaper, as the bound sees it: open while this still upgrades.
pub type Handle = Weak<dyn Any + Send + Sync>;

/// The bound on connections lingering in the reaper (see the module header).
pub struct ClosingBound {
    max: usize,
    /// The connections admitted to linger, oldest first; those whose descriptor has gone are
    /// dropped from the front as they are met, and from anywhere when the bound is reached.
    lingering: Mutex<VecDeque<Handle>>,
    peer_gone: Counter,
    full: Counter,
}

const CLOSED_AT_ONCE: &str = "orca_relay_closing_closed_at_once_total";
const CLOSED_AT_ONCE_HELP: &str = "Refused or closing connections closed at once instead of lingering in the reaper, by reason: their peer had gone, or ORCA_RELAY_CLOSING_CONNECTIONS_MAX were lingering.";

impl ClosingBound {
    /// At most `max` lingering connections, counted and shown on `registry`.
    pub fn new(max: usize, registry: &Registry) -> Arc<ClosingBound> {
        let counter =
            |reason| registry.counter(CLOSED_AT_ONCE, CLOSED_AT_ONCE_HELP, &[("reason", reason)]);
        let bound = Arc::new(ClosingBound {
            max,
            lingering: Mutex::new(VecDeque::new()),
            peer_gone: counter("peer_gone"),
            full: counter("full"),
        });
        let shown = Arc::downgrade(&bound);
        registry.sampled_gauge(
            "orca_relay_closing_connections",
            "Refused or closing connections lingering in the reaper (each holds a descriptor), and the most allowed (ORCA_RELAY_CLOSING_CONNECTIONS_MAX).",
            move || {
                let Some(bound) = shown.upgrade() else {
                    return Vec::new();
                };
                let state = |name: &str| vec![("state".to_string(), name.to_string())];
                vec![
                    (state("lingering"), bound.lingering() as f64),
                    (state("max"), bound.max as f64),
                ]
            },
        );
        bound
    }

    /// No bound (a reaper started without one; peers that have gone are still closed at once).
    pub fn unbounded() -> Arc<ClosingBound> {
        Arc::new(ClosingBound {
            max: usize::MAX,
            lingering: Mutex::new(VecDeque::new()),
            peer_gone: Counter::default(),
            full: Counter::default(),
        })
    }

    /// Whether the connection on `fd` (whose owner `handle` points at) may linger; counted when
    /// it may not.
    pub fn admit(&self, fd: RawFd, handle: Handle) -> Verdict {
        if peer_gone(fd) {
            self.peer_gone.inc();
            return Verdict::PeerGone;
        }
        let mut lingering = self.lingering.lock().unwrap_or_else(|e| e.into_inner());
        while lingering
            .front()
            .is_some_and(|handle| handle.strong_count() == 0)
        {
            lingering.pop_front();
        }
        if lingering.len() >= self.max {
            lingering.retain(|handle| handle.strong_count() > 0);
        }
        if lingering.len() >= self.max {
            drop(lingering);
            self.full.inc();
            return Verdict::Full;
        }
        lingering.push_back(handle);
        Verdict::Linger
    }

    /// Connections lingering now.
    pub fn lingering(&self) -> usize {
        let mut lingering = self.lingering.lock().unwrap_or_else(|e| e.into_inner());
        lingering.retain(|handle| handle.strong_count() > 0);
        lingering.len()
    }
}

/// Whether the peer of `fd` has gone: its FIN or a reset has arrived (an interrupted or failed
/// check says no).
pub fn peer_gone(fd: RawFd) -> bool {
    let mut poll = libc::pollfd {
        fd,
        events: libc::POLLRDHUP,
        revents: 0,
    };
    // SAFETY: poll reads and writes the one pollfd we own, for the duration of the call; a zero
    // timeout never waits.
    let ready = unsafe { libc::poll(&mut poll, 1, 0) };
    ready > 0 && poll.revents & (libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR) != 0
}

/// Closes a refused connection now: what it has sent is drained (at most [`DRAIN_BYTES`],
/// without waiting), so the close follows the answer with a FIN; if more remains unread (or
/// `abortive`), the close is a reset (`SO_LINGER` 0) and the kernel keeps nothing.
pub fn close_at_once(stream: Arc<TcpStream>, abortive: bool) {
    let drained = drain_now(&stream);
    if abortive || !drained {
        set_linger_zero(stream.as_raw_fd());
    }
    drop(stream);
}

/// Reads and drops what the socket holds, without waiting; true when nothing is left unread
/// (it would block, or the peer closed).
fn drain_now(stream: &TcpStream) -> bool {
    let mut scratch = [0u8; 4096];
    let mut drained = 0;
    while drained < DRAIN_BYTES {
        // SAFETY: recv writes at most `scratch.len()` bytes into the buffer we own; the
        // descriptor is owned by `stream` for the duration of the call.
        let n = unsafe {
            libc::recv(
                stream.as_raw_fd(),
                scratch.as_mut_ptr().cast(),
                scratch.len(),
                libc::MSG_DONTWAIT,
            )
        };
        match n {
            0 => return true,
            n if n > 0 => drained += n as usize,
            _ => {
                let error = io::Error::last_os_error();
                match error.kind() {
                    io::ErrorKind::Interrupted => {}
                    io::ErrorKind::WouldBlock => return true,
                    _ => return false,
                }
            }
        }
    }
    false
}

/// `SO_LINGER` on with a zero timeout: the close resets the connection and frees it at once.
fn set_linger_zero(fd: RawFd) {
    let linger = libc::linger {
        l_onoff: 1,
        l_linger: 0,
    };
    // SAFETY: setsockopt reads the `linger` value we own for the duration of the call.
    unsafe {
        libc::setsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_LINGER,
            (&linger as *const libc::linger).cast(),
            std::mem::size_of::<libc::linger>() as libc::socklen_t,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::net::TcpListener;
    use std::time::Duration;

    /// A connected pair: (our side, the peer's).
    fn pair() -> (Arc<TcpStream>, TcpStream) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let peer = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (ours, _) = listener.accept().unwrap();
        (Arc::new(ours), peer)
    }

    fn handle(stream: &Arc<TcpStream>) -> Handle {
        let weak: Weak<TcpStream> = Arc::downgrade(stream);
        weak
    }

    #[test]
    fn at_most_max_linger_and_a_closed_one_frees_its_place() {
        let bound = ClosingBound::unbounded();
        let bound = ClosingBound {
            max: 2,
            lingering: Mutex::new(VecDeque::new()),
            peer_gone: bound.peer_gone.clone(),
            full: bound.full.clone(),
        };
        let pairs: Vec<_> = (0..3).map(|_| pair()).collect();
        let verdicts: Vec<Verdict> = pairs
            .iter()
            .map(|(ours, _)| bound.admit(ours.as_raw_fd(), handle(ours)))
            .collect();
        assert_eq!(verdicts, [Verdict::Linger, Verdict::Linger, Verdict::Full]);
        assert_eq!((bound.lingering(), bound.full.get()), (2, 1));
        // The reaper lets the second go: its place is free again.
        let mut pairs = pairs;
        let (second, _peer) = pairs.remove(1);
        drop(second);
        let (third, _) = &pairs[1];
        assert_eq!(
            bound.admit(third.as_raw_fd(), handle(third)),
            Verdict::Linger
        );
        assert_eq!(bound.lingering(), 2);
    }

    #[test]
    fn a_peer_that_has_gone_is_never_kept() {
        let bound = ClosingBound::unbounded();
        let (ours, peer) = pair();
        assert!(!peer_gone(ours.as_raw_fd()));
        drop(peer);
        // The FIN crosses loopback at once; wait for it rather than assume.
        let gone = (0..100).any(|_| {
            crate::clock::sleep(Duration::from_millis(10));
            peer_gone(ours.as_raw_fd())
        });
        assert!(gone);
        assert_eq!(
            bound.admit(ours.as_raw_fd(), handle(&ours)),
            Verdict::PeerGone
        );
        assert_eq!(bound.peer_gone.get(), 1);
        assert_eq!(bound.lingering(), 0);
    }

    #[test]
    fn a_close_at_once_ends_with_a_fin_after_the_answer_when_nothing_is_left_unread() {
        // Nothing unread: the peer reads the answer, then the end of the stream.
        let (ours, mut peer) = pair();
        peer.write_all(b"GET / HTTP/1.1\r\n\r\n").unwrap();
        crate::clock::sleep(Duration::from_millis(50));
        (&*ours)
            .write_all(b"HTTP/1.1 404 Not Found\r\n\r\n")
            .unwrap();
        close_at_once(ours, false);
        peer.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut answer = Vec::new();
        peer.read_to_end(&mut answer).unwrap();
        assert_eq!(answer, b"HTTP/1.1 404 Not Found\r\n\r\n");
        // Abortive: the peer sees a reset, not an orderly end.
        let (ours, mut peer) = pair();
        close_at_once(ours, true);
        peer.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut rest = Vec::new();
        let error = peer.read_to_end(&mut rest).unwrap_err();
        assert_eq!(error.kind(), io::ErrorKind::ConnectionReset);
    }
}
