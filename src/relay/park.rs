//! Parking the data plane for a live handover (ARCHITECTURE.md "Live handover").
//!
//! Owns: [`Quiesce`], the handover's hold on the relay threads: an eventfd that every blocking
//! wait of a relay thread polls beside its socket, a flag, and the deposits. While quiescing, a
//! relay thread that reaches its next wait (the point where it has acted on every whole frame
//! it read, and would block for more) deposits its connection as a [`Parked`] (the socket, what
//! its reader holds, where it is in its life, the deadline it waits for, and the unit, place or
//! pending entry it holds) and waits for the handover's end ([`Quiesce::hold`]). Nothing is lost
//! and nothing is released: a deposit is resumed by a new thread, in this process (the handover
//! failed) or the next (it succeeded), through the same [`super::thread::resume`].
//!
//! Runs on: the relay threads (wait, deposit) and the handover's thread (begin, take, end).
//! Never: holds its lock across I/O; loses a deposit (a deposit is only taken by the handover,
//! which either sends it on or resumes it).
//!
//! A stage's record (`carry::connection::StageRecord`) carries deadlines as the time left.

use std::io;
use std::net::TcpStream;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::hold::{ConnectionHold, PhonePlace};
use super::socket::Socket;
use crate::carry::connection::{
    AdmitPathRecord, ClaimsRecord, ControlRecord, InviteRateRecord, ReaderRecord, StageRecord,
    WaitingPhoneRecord,
};
use crate::cell::state::AdmitPath;
use crate::clock;
pub use crate::wake::Wake;

/// Holds the threads of a received handover before their first I/O until the handover has
/// committed ([`Gate::open`]) or failed ([`Gate::abandon`]).
#[derive(Debug, Default)]
pub struct Gate {
    state: Mutex<Option<bool>>,
    changed: std::sync::Condvar,
}

impl Gate {
    pub fn new() -> Arc<Gate> {
        Arc::new(Gate::default())
    }

    pub fn open(&self) {
        *self.state.lock().unwrap_or_else(|e| e.into_inner()) = Some(true);
        self.changed.notify_all();
    }

    pub fn abandon(&self) {
        *self.state.lock().unwrap_or_else(|e| e.into_inner()) = Some(false);
        self.changed.notify_all();
    }

    /// Blocks until the gate is opened (`true`) or abandoned (`false`).
    pub fn wait(&self) -> bool {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if let Some(open) = *state {
                return open;
            }
            state = self.changed.wait(state).unwrap_or_else(|e| e.into_inner());
        }
    }
}

/// The handover's hold on the relay threads. See the module header.
pub struct Quiesce {
    /// Readable while quiescing (it is never read while set).
    wake: Arc<Wake>,
    deposits: Mutex<Vec<Parked>>,
    /// Relay threads that deposited and wait for the handover's end ([`Quiesce::hold`]).
    holding: Mutex<usize>,
    /// Signalled when a thread starts or stops holding (the giver waits on it).
    counted: std::sync::Condvar,
    /// Signalled at the handover's end (the holders wait on it).
    ended: std::sync::Condvar,
}

impl std::fmt::Debug for Quiesce {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Quiesce")
            .field("quiescing", &self.is_quiescing())
            .field("deposited", &self.deposited())
            .finish()
    }
}

impl Quiesce {
    pub fn new() -> io::Result<Arc<Quiesce>> {
        Ok(Arc::new(Quiesce {
            wake: Wake::new()?,
            deposits: Mutex::new(Vec::new()),
            holding: Mutex::new(0),
            counted: std::sync::Condvar::new(),
            ended: std::sync::Condvar::new(),
        }))
    }

    /// Every relay thread deposits at its next wait (and the ones waiting now, at once).
    pub fn begin(&self) {
        self.wake.set();
    }

    /// Back to serving: waits block again. Returns the deposits not taken yet (the caller
    /// resumes them); a deposit made from now on is refused (see [`Quiesce::deposit`]).
    pub fn end(&self) -> Vec<Parked> {
        let mut deposits = self.deposits.lock().unwrap_or_else(|e| e.into_inner());
        {
            // Under the holders' lock: a thread about to hold sees the end.
            let _holding = self.holding.lock().unwrap_or_else(|e| e.into_inner());
            self.wake.clear();
            self.ended.notify_all();
        }
        std::mem::take(&mut *deposits)
    }

    /// A relay thread whose connection was taken: it waits here for the handover's end
    /// instead of ending at once, so that no thread's teardown (its stack unmapped, a TLB
    /// shootdown on every core) stands between the quiesce and the transfer. After a commit
    /// the process exits with it parked; after a rollback it ends ([`Quiesce::end`]) and the
    /// connection resumes on a new thread.
    ///
    /// The giver is woken only when its wait may be over (every thread in `permits` holds;
    /// the last holder left): two thousand threads depositing at once would otherwise wake it
    /// two thousand times, each wake a switch and a turn at this lock on the pause's path.
    pub fn hold(&self, permits: &crate::threads::Permits) {
        let mut holding = self.holding.lock().unwrap_or_else(|e| e.into_inner());
        *holding += 1;
        if permits.used() <= *holding {
            self.counted.notify_all();
        }
        while self.wake.is_set() {
            holding = self.ended.wait(holding).unwrap_or_else(|e| e.into_inner());
        }
        *holding -= 1;
        if *holding == 0 {
            self.counted.notify_all();
        }
    }

    /// After [`Quiesce::end`]: waits (until `deadline`) for the holding threads to leave their
    /// hold; `false` if some still hold.
    pub fn wait_released(&self, deadline: Instant) -> bool {
        let mut holding = self.holding.lock().unwrap_or_else(|e| e.into_inner());
        while *holding > 0 {
            let left = deadline.saturating_duration_since(clock::instant());
            if left.is_zero() {
                return false;
            }
            holding = self
                .counted
                .wait_timeout(holding, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        true
    }

    /// Waits until every relay thread (`permits` in use) has deposited and holds, or ended;
    /// `false` at `deadline`. (A thread that ends releases only its permit: the wait looks
    /// again every 5 ms.)
    pub fn wait_all_holding(&self, permits: &crate::threads::Permits, deadline: Instant) -> bool {
        let mut holding = self.holding.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if permits.used() <= *holding {
                return true;
            }
            let left = deadline.saturating_duration_since(clock::instant());
            if left.is_zero() {
                return false;
            }
            holding = self
                .counted
                .wait_timeout(holding, left.min(Duration::from_millis(5)))
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// Relay threads holding (see [`Quiesce::hold`]).
    pub fn holding(&self) -> usize {
        *self.holding.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn is_quiescing(&self) -> bool {
        self.wake.is_set()
    }

    /// The descriptor a wait polls beside its socket.
    pub fn wake_fd(&self) -> RawFd {
        self.wake.raw_fd()
    }

    /// The flag a relay socket's write polls beside the socket (`Socket::interruptible`): set
    /// while quiescing, so no write waits on a peer past the quiesce's start.
    pub fn interrupt(&self) -> Arc<Wake> {
        self.wake.clone()
    }

    /// Deposits a connection. If no handover is quiescing any more (it ended while this thread
    /// was on its way), the connection is given back for the caller to resume: a deposit is
    /// either taken by the handover or never made.
    #[must_use = "a refused deposit must be resumed"]
    pub fn deposit(&self, parked: Parked) -> Option<Parked> {
        let mut deposits = self.deposits.lock().unwrap_or_else(|e| e.into_inner());
        if !self.wake.is_set() {
            return Some(parked);
        }
        deposits.push(parked);
        None
    }

    pub fn deposited(&self) -> usize {
        self.deposits
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .len()
    }

    /// Every deposit so far.
    pub fn take_deposits(&self) -> Vec<Parked> {
        std::mem::take(&mut *self.deposits.lock().unwrap_or_else(|e| e.into_inner()))
    }
}

/// How a wait ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Waited {
    /// The socket has bytes (or an end of stream, or an error) to read.
    Readable,
    /// The deadline passed.
    TimedOut,
    /// A handover is quiescing the cell: deposit and end.
    Quiesce,
}

/// Waits until `stream` is readable, `deadline` passes, or a handover quiesces. `EINTR` (a
/// stop and continue) is retried with the time that is left.
/// Waits at most `timeout`, or until a quiesce begins (the caller looks at it again).
pub fn wait_woken(quiesce: &Quiesce, timeout: std::time::Duration) {
    let mut fds = [libc::pollfd {
        fd: quiesce.wake_fd(),
        events: libc::POLLIN,
        revents: 0,
    }];
    let timeout = timeout.as_millis().clamp(1, i32::MAX as u128) as libc::c_int;
    // SAFETY: one valid pollfd for the duration of the call. EINTR only ends the wait early.
    unsafe { libc::poll(fds.as_mut_ptr(), 1, timeout) };
}

pub fn wait_readable(stream: &TcpStream, deadline: Option<Instant>, quiesce: &Quiesce) -> Waited {
    loop {
        if quiesce.is_quiescing() {
            return Waited::Quiesce;
        }
        let timeout = match deadline {
            None => -1,
            Some(deadline) => {
                let left = deadline.saturating_duration_since(clock::instant());
                if left.is_zero() {
                    return Waited::TimedOut;
                }
                // Rounded up: a wait that ends a little early only loops once more.
                left.as_millis().clamp(1, i32::MAX as u128) as libc::c_int
            }
        };
        let mut fds = [
            libc::pollfd {
                fd: stream.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: quiesce.wake_fd(),
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
            // Anything else: let the read find out what is wrong with the socket.
            return Waited::Readable;
        }
        if fds[0].revents != 0 {
            return Waited::Readable;
        }
        // A quiesce (or a timeout): the loop looks at the flag and the deadline again.
    }
}

/// How a connection's relay thread ended.
pub enum Served {
    /// The connection is closed (or closing); its unit is returned as the thread ends.
    Ended,
    /// The socket went to a splice worker with its unit; nothing more to do here.
    HandedOff,
    /// A handover quiesced the cell at `stage`: the connection is deposited with its unit (and
    /// a phone's place) for whoever resumes it.
    Parked {
        stage: Box<Stage>,
        place: Option<PhonePlace>,
    },
}

impl Served {
    pub fn parked(stage: Stage) -> Served {
        Served::Parked {
            stage: Box::new(stage),
            place: None,
        }
    }
}

/// A connection deposited while quiescing (by its relay thread, or by the acceptor's pending
/// loop). Nothing it holds is released: the unit of the cap and the phone's place travel with
/// it.
pub struct Parked {
    pub id: u64,
    pub conn: ParkedConn,
    pub stage: Stage,
    /// The unit of the cap and the connections gauge (an admitted connection).
    pub hold: Option<ConnectionHold>,
    /// A waiting phone's place among its host's phones.
    pub place: Option<PhonePlace>,
}

/// The descriptor of a parked connection, as its stage holds it.
pub enum ParkedConn {
    /// A pending connection of the acceptor's loop (its credential not checked yet): its
    /// stage is `Upgrading` or a splice leg's `FirstFrame`.
    Pending(TcpStream),
    /// An upgraded WebSocket.
    Socket(Arc<Socket>),
}

impl ParkedConn {
    pub fn raw_fd(&self) -> RawFd {
        match self {
            ParkedConn::Pending(stream) => stream.as_raw_fd(),
            ParkedConn::Socket(socket) => socket.stream().as_raw_fd(),
        }
    }

    /// What the socket owes (a write the quiesce interrupted, frames sent during it) and how
    /// long ago that write began, taken out for a handover's record ([`ParkedConn::give_back_owed`]
    /// puts it back). A pending connection owes nothing.
    pub fn take_owed(&self, now: Instant) -> (Vec<u8>, u64) {
        match self {
            ParkedConn::Pending(_) => (Vec::new(), 0),
            ParkedConn::Socket(socket) => {
                let age = socket.owed_age_ms(now);
                (socket.take_owed(), age)
            }
        }
    }

    pub fn give_back_owed(&self, owed: Vec<u8>, age_ms: u64) {
        if let ParkedConn::Socket(socket) = self {
            socket.owe(owed, Duration::from_millis(age_ms));
        }
    }
}

impl From<&crate::auth::HostClaims> for ClaimsRecord {
    fn from(claims: &crate::auth::HostClaims) -> Self {
        ClaimsRecord {
            user_id: claims.user_id.clone(),
            relay_host_id: claims.relay_host_id.clone(),
            expires_at: claims.expires_at,
        }
    }
}

impl From<&ClaimsRecord> for crate::auth::HostClaims {
    fn from(record: &ClaimsRecord) -> Self {
        crate::auth::HostClaims {
            user_id: record.user_id.clone(),
            relay_host_id: record.relay_host_id.clone(),
            expires_at: record.expires_at,
        }
    }
}

impl From<AdmitPath> for AdmitPathRecord {
    fn from(path: AdmitPath) -> Self {
        match path {
            AdmitPath::Booking => AdmitPathRecord::Booking,
            AdmitPath::Memory => AdmitPathRecord::Memory,
            AdmitPath::Database => AdmitPathRecord::Database,
        }
    }
}

impl From<AdmitPathRecord> for AdmitPath {
    fn from(path: AdmitPathRecord) -> Self {
        match path {
            AdmitPathRecord::Booking => AdmitPath::Booking,
            AdmitPathRecord::Memory => AdmitPath::Memory,
            AdmitPathRecord::Database => AdmitPath::Database,
        }
    }
}

/// A control's `invite-create` token bucket (`control::InviteRate`), its refill moment as an
/// instant.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InviteBucket {
    pub available: u32,
    pub refilled_at: Instant,
}

/// Where a relay thread was in a connection's life when it deposited it.
#[derive(Debug)]
pub enum Stage {
    /// The upgrade head had not fully arrived.
    Upgrading {
        received: Vec<u8>,
        deadline: Instant,
    },
    /// Upgraded; the first frame not fully arrived (`text: None`) or read and not yet acted on
    /// (an attach was frozen): `path` is the upgrade's path, `claims` the control's token.
    FirstFrame {
        path: String,
        claims: Option<ClaimsRecord>,
        reader: ReaderRecord,
        text: Option<String>,
        deadline: Instant,
    },
    /// A seated desktop control in its read loop.
    Control {
        control: ControlRecord,
        reader: ReaderRecord,
        silence_deadline: Instant,
        invites: InviteBucket,
    },
    /// A phone that sent `conn-open` to its host and waits for the data leg.
    PhoneWaiting {
        phone: WaitingPhoneRecord,
        reader: ReaderRecord,
        attach_deadline: Instant,
    },
}

fn left_ms(deadline: Instant, now: Instant) -> u64 {
    deadline.saturating_duration_since(now).as_millis() as u64
}

/// The instant `age_ms` before `now` (`now` itself if the process is younger than that).
fn ago(age_ms: u64, now: Instant) -> Instant {
    now.checked_sub(Duration::from_millis(age_ms))
        .unwrap_or(now)
}

fn deadline_in(left_ms: u64, now: Instant) -> Instant {
    now + Duration::from_millis(left_ms)
}

impl Stage {
    /// The record of this stage at `now`, its byte buffers moved into it (no copy): a
    /// handover sends the record, then gives the buffers back ([`Stage::give_back`]).
    pub fn lend(&mut self, now: Instant) -> StageRecord {
        let mut record = self.record_without_bytes(now);
        match (self, &mut record) {
            (Stage::Upgrading { received, .. }, StageRecord::Upgrading { received: lent, .. }) => {
                *lent = std::mem::take(received)
            }
            (Stage::FirstFrame { reader, .. }, StageRecord::FirstFrame { reader: lent, .. })
            | (Stage::Control { reader, .. }, StageRecord::Control { reader: lent, .. })
            | (
                Stage::PhoneWaiting { reader, .. },
                StageRecord::PhoneWaiting { reader: lent, .. },
            ) => *lent = std::mem::take(reader),
            _ => {}
        }
        record
    }

    /// Takes back the byte buffers [`Stage::lend`] moved into `record`.
    pub fn give_back(&mut self, record: StageRecord) {
        match (self, record) {
            (Stage::Upgrading { received, .. }, StageRecord::Upgrading { received: lent, .. }) => {
                *received = lent
            }
            (Stage::FirstFrame { reader, .. }, StageRecord::FirstFrame { reader: lent, .. })
            | (Stage::Control { reader, .. }, StageRecord::Control { reader: lent, .. })
            | (
                Stage::PhoneWaiting { reader, .. },
                StageRecord::PhoneWaiting { reader: lent, .. },
            ) => *reader = lent,
            _ => {}
        }
    }

    /// The record of this stage at `now` without its byte buffers (their fields empty).
    fn record_without_bytes(&self, now: Instant) -> StageRecord {
        let bare = |reader: &ReaderRecord| ReaderRecord {
            buffered: Vec::new(),
            parser: reader.parser,
            message: reader.message.as_ref().map(|_| Vec::new()),
        };
        match self {
            Stage::Upgrading { deadline, .. } => StageRecord::Upgrading {
                received: Vec::new(),
                deadline_left_ms: left_ms(*deadline, now),
            },
            Stage::FirstFrame {
                path,
                claims,
                reader,
                text,
                deadline,
            } => StageRecord::FirstFrame {
                path: path.clone(),
                claims: claims.clone(),
                reader: bare(reader),
                text: text.clone(),
                deadline_left_ms: left_ms(*deadline, now),
            },
            Stage::Control {
                control,
                reader,
                silence_deadline,
                invites,
            } => StageRecord::Control {
                control: control.clone(),
                reader: bare(reader),
                silence_left_ms: left_ms(*silence_deadline, now),
                invites: Some(InviteRateRecord {
                    available: invites.available,
                    refilled_ago_ms: now
                        .saturating_duration_since(invites.refilled_at)
                        .as_millis() as u64,
                }),
            },
            Stage::PhoneWaiting {
                phone,
                reader,
                attach_deadline,
            } => StageRecord::PhoneWaiting {
                phone: phone.clone(),
                reader: bare(reader),
                attach_left_ms: left_ms(*attach_deadline, now),
            },
        }
    }

    /// The record of this stage at `now` (deadlines as the time left).
    pub fn record(&self, now: Instant) -> StageRecord {
        match self {
            Stage::Upgrading { received, deadline } => StageRecord::Upgrading {
                received: received.clone(),
                deadline_left_ms: left_ms(*deadline, now),
            },
            Stage::FirstFrame {
                path,
                claims,
                reader,
                text,
                deadline,
            } => StageRecord::FirstFrame {
                path: path.clone(),
                claims: claims.clone(),
                reader: reader.clone(),
                text: text.clone(),
                deadline_left_ms: left_ms(*deadline, now),
            },
            Stage::Control {
                control,
                reader,
                silence_deadline,
                invites,
            } => StageRecord::Control {
                control: control.clone(),
                reader: reader.clone(),
                silence_left_ms: left_ms(*silence_deadline, now),
                invites: Some(InviteRateRecord {
                    available: invites.available,
                    refilled_ago_ms: now
                        .saturating_duration_since(invites.refilled_at)
                        .as_millis() as u64,
                }),
            },
            Stage::PhoneWaiting {
                phone,
                reader,
                attach_deadline,
            } => StageRecord::PhoneWaiting {
                phone: phone.clone(),
                reader: reader.clone(),
                attach_left_ms: left_ms(*attach_deadline, now),
            },
        }
    }

    /// Whether the connection belongs to the acceptor's pending loop (no credential checked
    /// yet: an upgrade head arriving, a splice leg's first frame), not to a relay thread.
    pub fn is_pending(&self) -> bool {
        matches!(
            self,
            Stage::Upgrading { .. } | Stage::FirstFrame { claims: None, .. }
        )
    }
}

impl Stage {
    /// The live stage of `record`, with its deadlines counted from `now`, less `elapsed_ms` (the
    /// time the record spent travelling).
    pub fn from_record(record: StageRecord, now: Instant, elapsed_ms: u64) -> Stage {
        let at = |left: u64| deadline_in(left.saturating_sub(elapsed_ms), now);
        match record {
            StageRecord::Upgrading {
                received,
                deadline_left_ms,
            } => Stage::Upgrading {
                received,
                deadline: at(deadline_left_ms),
            },
            StageRecord::FirstFrame {
                path,
                claims,
                reader,
                text,
                deadline_left_ms,
            } => Stage::FirstFrame {
                path,
                claims,
                reader,
                text,
                deadline: at(deadline_left_ms),
            },
            StageRecord::Control {
                control,
                reader,
                silence_left_ms,
                invites,
            } => Stage::Control {
                control,
                reader,
                silence_deadline: at(silence_left_ms),
                invites: match invites {
                    Some(record) => InviteBucket {
                        available: record.available,
                        refilled_at: ago(record.refilled_ago_ms.saturating_add(elapsed_ms), now),
                    },
                    None => InviteBucket {
                        available: crate::protocol::INVITE_CREATE_BURST,
                        refilled_at: now,
                    },
                },
            },
            StageRecord::PhoneWaiting {
                phone,
                reader,
                attach_left_ms,
            } => Stage::PhoneWaiting {
                phone,
                reader,
                attach_deadline: at(attach_left_ms),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    #[test]
    fn a_wait_ends_for_bytes_a_deadline_or_a_quiesce() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let mut client = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (server, _) = listener.accept().unwrap();
        let quiesce = Quiesce::new().unwrap();
        let soon = || Some(clock::instant() + Duration::from_millis(30));
        assert_eq!(wait_readable(&server, soon(), &quiesce), Waited::TimedOut);
        std::io::Write::write_all(&mut client, b"x").unwrap();
        assert_eq!(wait_readable(&server, None, &quiesce), Waited::Readable);
        quiesce.begin();
        assert_eq!(wait_readable(&server, None, &quiesce), Waited::Quiesce);
        assert!(quiesce.end().is_empty());
        assert_eq!(wait_readable(&server, soon(), &quiesce), Waited::Readable);
    }

    #[test]
    fn a_quiesce_wakes_a_thread_already_waiting() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let _client = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (server, _) = listener.accept().unwrap();
        let quiesce = Quiesce::new().unwrap();
        let waiter = {
            let quiesce = quiesce.clone();
            crate::threads::spawn("test-waiter", move || {
                wait_readable(&server, None, &quiesce)
            })
            .unwrap()
        };
        quiesce.begin();
        assert_eq!(waiter.join().unwrap(), Waited::Quiesce);
    }

    /// A control from a version-1 process (no `invite-create` limit then) resumes with a full
    /// bucket.
    #[test]
    fn a_control_without_an_invite_bucket_resumes_with_a_full_one() {
        let record = StageRecord::Control {
            control: ControlRecord {
                claims: ClaimsRecord {
                    user_id: "u".into(),
                    relay_host_id: "h".into(),
                    expires_at: 0,
                },
                epoch: 1,
                generation: 1,
                admitted_via: AdmitPathRecord::Memory,
                lease_id: None,
            },
            reader: ReaderRecord::default(),
            silence_left_ms: 1_000,
            invites: None,
        };
        match Stage::from_record(record, clock::instant(), 0) {
            Stage::Control { invites, .. } => {
                assert_eq!(invites.available, crate::protocol::INVITE_CREATE_BURST)
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn deadlines_travel_as_the_time_left_less_the_transfer() {
        let now = clock::instant();
        let stage = Stage::Upgrading {
            received: b"GET /".to_vec(),
            deadline: now + Duration::from_millis(4_000),
        };
        let record = stage.record(now);
        assert_eq!(
            record,
            StageRecord::Upgrading {
                received: b"GET /".to_vec(),
                deadline_left_ms: 4_000
            }
        );
        let json = serde_json::to_string(&record).unwrap();
        let back: StageRecord = serde_json::from_str(&json).unwrap();
        let later = now + Duration::from_secs(100);
        match Stage::from_record(back, later, 250) {
            Stage::Upgrading { deadline, .. } => {
                assert_eq!(deadline, later + Duration::from_millis(3_750))
            }
            other => panic!("{other:?}"),
        }
    }
}
