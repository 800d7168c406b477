//! The load the handover tests and bench put on a relay: desktop controls answering pings and
//! phone/data-leg pairs streaming sequence-checked messages both ways, driven by a couple of
//! `mio` event loops (not a thread per socket).
//!
//! Every message of a stream has a size and bytes that are a function of its sequence number,
//! so the receiving end checks that nothing was lost, duplicated, reordered or changed. Sizes
//! cycle from 1 B to 256 KiB; every fourth message is sent in three fragments with a ping
//! between them. The longest gap between two arrivals on any stream (since [`Load::mark`]) is
//! its stall. A pair can be told to stop reading its desktop end, so that the relay's
//! backpressure is active, and to read again.
//!
//! Besides (issue 31): **stuck pairs**, whose two ends read nothing until the load finishes
//! (both of the relay's outputs fill to their bound and stay there); **slow desktops**, whose
//! control reads through a 4 KiB receive buffer at 4 KiB a second while it sends WebSocket
//! pings faster than it reads their pongs (so the relay's control thread is mostly blocked in a
//! write to it; every pong must come back, in order); and **probes**, controls that send a
//! WebSocket ping every `probe_interval` and time its pong: the longest wait (an unanswered
//! ping counts as it waits) is the control's pause.

use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use mio::{Events, Interest, Poll, Token};

use super::client::{self, Blocking, OP_BINARY, OP_CLOSE, OP_CONTINUE, OP_PING, OP_PONG, OP_TEXT};

/// One desktop: who it is and where it was placed.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct Identity {
    pub user_id: String,
    pub relay_host_id: String,
    pub token: String,
    pub epoch: i64,
}

/// What load to put on.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct Spec {
    pub controls: usize,
    /// Pairs, on the first controls.
    pub pairs: usize,
    /// A stream sends its next message at most this often.
    pub interval: Duration,
    /// Messages a stream has in flight at most.
    pub window: u64,
    /// Message sizes, cycled.
    pub sizes: Vec<usize>,
    /// Event-loop threads.
    pub loops: usize,
    /// Threads setting the sessions up.
    pub setup_threads: usize,
    /// The network namespace to connect from (`/proc/<pid>/ns/net`), if not this one.
    pub netns: Option<std::path::PathBuf>,
    /// Pairs after the streaming ones whose two ends read nothing until the load finishes.
    #[serde(default)]
    pub stuck: usize,
    /// Controls after the paired ones that read slowly (a 4 KiB receive buffer, 4 KiB a
    /// second) and ping faster than they read.
    #[serde(default)]
    pub slow: usize,
    /// Controls after the slow ones that time a WebSocket ping every `probe_interval`.
    #[serde(default)]
    pub probes: usize,
    #[serde(default = "default_probe_interval")]
    pub probe_interval: Duration,
}

fn default_probe_interval() -> Duration {
    Duration::from_millis(50)
}

impl Spec {
    pub fn new(controls: usize, pairs: usize) -> Spec {
        Spec {
            controls,
            pairs,
            interval: Duration::from_millis(200),
            window: 8,
            // From 1 B to 256 KiB, the large ones rare (a mean of about 6 KiB): every size
            // and fragmentation crosses a handover, at a rate a debug build on a shared
            // machine keeps up with.
            sizes: {
                let mut sizes = vec![1, 37, 200, 1_000, 125, 4_096, 60, 9, 700, 3_000, 100, 12];
                sizes.extend([
                    2_048, 500, 90, 30, 1_500, 17, 640, 5_000, 16_384, 64, 2, 300,
                ]);
                sizes.extend([1_200, 40, 800, 6, 2_500, 150, 65_536, 20, 400, 3, 900, 50]);
                sizes.extend([7_000, 11, 260, 4, 1_800, 70, 262_144, 25, 600, 8, 3_500, 45]);
                sizes
            },
            loops: 2,
            setup_threads: 4,
            netns: None,
            stuck: 0,
            slow: 0,
            probes: 0,
            probe_interval: default_probe_interval(),
        }
    }

    /// Controls with a pair: the streaming ones, then the stuck ones.
    fn paired(&self) -> usize {
        self.pairs + self.stuck
    }

    /// What control `index` does.
    fn kind(&self, index: usize) -> ControlKind {
        let slow_from = self.paired();
        let probes_from = slow_from + self.slow;
        if (slow_from..probes_from).contains(&index) {
            ControlKind::Slow
        } else if (probes_from..probes_from + self.probes).contains(&index) {
            ControlKind::Probe
        } else {
            ControlKind::Plain
        }
    }
}

/// What a control does besides answering the relay's pings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ControlKind {
    Plain,
    /// Reads slowly and pings faster than it reads.
    Slow,
    /// Times a ping every `probe_interval`.
    Probe,
}

/// The slow desktops' reading: at most this many bytes a second, read this many at a time.
const SLOW_READ_PER_SECOND: usize = 4 * 1024;
const SLOW_READ_CHUNK: usize = 1024;
/// Their receive buffer.
const SLOW_RECEIVE_BUFFER: usize = 4 * 1024;
/// A stuck pair's end reads this much every so often, and nothing else until the load ends.
const STUCK_SIP_EVERY: Duration = Duration::from_secs(10);
const STUCK_SIP_BYTES: usize = 128 * 1024;
/// A slow desktop's ping: an 8-byte sequence number and filler, the largest control payload.
const SLOW_PING_BYTES: usize = 125;

/// What the load saw.
#[derive(Debug, Clone, Default, serde::Serialize, serde::Deserialize)]
pub struct Report {
    pub controls: usize,
    pub pairs: usize,
    /// Controls and legs closed by the relay (or whose connection ended), with the close code.
    pub closed: Vec<String>,
    /// Messages that arrived out of order, short, long or changed.
    pub violations: Vec<String>,
    pub messages_sent: u64,
    pub messages_received: u64,
    pub bytes_received: u64,
    /// The longest gap between arrivals on one stream since the mark (backpressured streams
    /// left out), ms.
    pub max_stall_ms: u64,
    /// Controls that heard a ping since the mark.
    pub pinged_since_mark: usize,
    /// The longest gaps: (when the gap ended, ms since the load started; its length, ms).
    pub worst_gaps: Vec<(u64, u64)>,
    /// Streams that received a message since the mark.
    pub streams_flowing_since_mark: usize,
    /// Controls whose WebSocket ping of the latest [`Load::probe`] was answered (a pong).
    #[serde(default)]
    pub probe_answered: usize,
    /// Streams that received a message since the latest probe.
    #[serde(default)]
    pub probe_streams: usize,
    /// The longest time from the probe to a control's pong or a stream's first message after
    /// it, over those counted, ms.
    #[serde(default)]
    pub probe_last_ms: u64,
    /// The longest a probe's ping waited for its pong since the mark (an unanswered one counts
    /// as it waits), ms: the controls' pause.
    #[serde(default)]
    pub max_control_pause_ms: u64,
    /// The slow desktops' pongs received, in order.
    #[serde(default)]
    pub slow_pongs: u64,
}

#[derive(Default)]
struct SinceMark {
    mark: Option<Instant>,
    pinged: usize,
    flowing: usize,
}

impl Shared {
    /// Counts a control pinged (`stream` false) or a stream moving since `mark`, if `mark` is
    /// still the current one.
    fn count_since(&self, mark: Instant, stream: bool) {
        let mut since = self.since_mark.lock().unwrap();
        if since.mark == Some(mark) {
            if stream {
                since.flowing += 1;
            } else {
                since.pinged += 1;
            }
        }
    }
}

#[derive(Default)]
struct Shared {
    stop: AtomicBool,
    stop_sending: AtomicBool,
    /// The mark, as ms since `origin`; 0: none.
    mark_ms: AtomicU64,
    /// Pairs whose desktop end does not read (indices).
    paused: Mutex<Vec<usize>>,
    /// Pairs ever paused: their streams' stalls are by design, left out of the figure.
    excluded: Mutex<Vec<usize>>,
    closed: Mutex<Vec<String>>,
    violations: Mutex<Vec<String>>,
    sent: AtomicU64,
    received: AtomicU64,
    bytes_received: AtomicU64,
    max_stall_ms: AtomicU64,
    max_control_pause_ms: AtomicU64,
    slow_pongs: AtomicU64,
    worst_gaps: Mutex<Vec<(u64, u64)>>,
    /// Controls pinged and streams moving since the current mark, counted under the lock by
    /// the loops for the mark they saw (a loop's turn that began before a new mark counts
    /// nothing into it).
    since_mark: Mutex<SinceMark>,
    /// Streams whose receiving end has everything its sender sent (after stop_sending).
    drained: AtomicUsize,
    /// The latest probe, as ms since `origin` (plus one); 0: none. Each loop pings its open
    /// controls once per probe (payload `probe <ms>`) and counts the pongs that carry it.
    probe_ms: AtomicU64,
    probe_answered: AtomicUsize,
    probe_streams: AtomicUsize,
    probe_last_ms: AtomicU64,
}

/// The running load.
pub struct Load {
    shared: Arc<Shared>,
    origin: Instant,
    threads: Vec<JoinHandle<()>>,
    spec: Spec,
    pub identities: Vec<Identity>,
}

/// Bytes that messages are cut from: a message is a window of them at an offset that depends
/// on its stream and sequence number (cheap to make and to check, and a lost, repeated or
/// shifted byte shows).
fn pattern() -> &'static [u8] {
    static PATTERN: std::sync::OnceLock<Vec<u8>> = std::sync::OnceLock::new();
    PATTERN.get_or_init(|| {
        let mut state: u64 = 0x9e37_79b9_7f4a_7c15;
        (0..(1usize << 20))
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                state as u8
            })
            .collect()
    })
}

/// Message `seq` of a stream (`salt` tells streams apart).
fn message_bytes(seq: u64, size: usize, salt: u64) -> &'static [u8] {
    let offset = (seq.wrapping_mul(7_919) ^ salt.wrapping_mul(104_729)) as usize % (1 << 19);
    &pattern()[offset..offset + size]
}

fn message(seq: u64, size: usize, salt: u64) -> Vec<u8> {
    message_bytes(seq, size, salt).to_vec()
}

fn size_of(spec_sizes: &[usize], seq: u64, salt: u64) -> usize {
    spec_sizes[((seq + salt * 7) % spec_sizes.len() as u64) as usize]
}

/// A control's index and its sockets (its control, and its pair's legs).
type Sessions = (usize, Vec<(Blocking, Role)>);

enum Role {
    Control {
        index: usize,
        kind: ControlKind,
    },
    /// A leg of pair `pair`; `desktop`: the data leg.
    Leg {
        pair: usize,
        desktop: bool,
    },
}

struct Stream {
    next_seq: u64,
    last_send: Option<Instant>,
    expected: u64,
    assembling: Option<Vec<u8>>,
    last_arrival: Option<Instant>,
    /// The mark this stream was last counted as moving for.
    flowing_since: Option<Instant>,
    /// The probe this stream was last counted as moving for.
    probed: u64,
    salt_out: u64,
    salt_in: u64,
}

struct Conn {
    socket: mio::net::TcpStream,
    inbuf: Vec<u8>,
    /// Where the unparsed bytes of `inbuf` start.
    in_start: usize,
    out: Vec<u8>,
    out_start: usize,
    role: Role,
    closed: bool,
    /// The mark this control was last counted as pinged for.
    pinged_since: Option<Instant>,
    /// The probe (its `probe_ms`) this control was pinged for, and whether it was answered.
    probed: u64,
    probe_answered: bool,
    stream: Option<Stream>,
    mask: u32,
    /// A leg of a stuck pair: reads nothing until the load finishes.
    stuck: bool,
    /// A probe's ping in flight (when it was sent), and when the last one went.
    probe_sent: Option<Instant>,
    last_probe: Option<Instant>,
    /// A slow desktop's reading allowance (bytes) and when it was last topped up; its pings
    /// queued and the next pong it expects.
    read_budget: usize,
    budget_at: Option<Instant>,
    pings_queued: u64,
    next_pong: u64,
}

impl Conn {
    fn kind(&self) -> Option<ControlKind> {
        match self.role {
            Role::Control { kind, .. } => Some(kind),
            Role::Leg { .. } => None,
        }
    }

    fn queue(&mut self, bytes: &[u8]) {
        if self.out_start > 0 && self.out_start * 2 >= self.out.len() {
            self.out.drain(..self.out_start);
            self.out_start = 0;
        }
        self.out.extend_from_slice(bytes);
    }

    fn pending(&self) -> usize {
        self.out.len() - self.out_start
    }

    fn next_mask(&mut self) -> [u8; 4] {
        self.mask = self.mask.wrapping_mul(1_103_515_245).wrapping_add(12_345);
        self.mask.to_be_bytes()
    }

    fn flush(&mut self) -> io::Result<()> {
        while self.out_start < self.out.len() {
            match self.socket.write(&self.out[self.out_start..]) {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(n) => self.out_start += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        if self.out_start == self.out.len() {
            self.out.clear();
            self.out_start = 0;
        }
        Ok(())
    }
}

impl Load {
    /// Connects every control (hello and ack), splices the pairs, then hands every socket to
    /// the event loops. `identities` must have `spec.controls` entries, placed already.
    pub fn start(ws: &str, spec: Spec, identities: Vec<Identity>) -> Load {
        assert_eq!(identities.len(), spec.controls);
        let origin = crate::harness::now_instant();
        let identities = Arc::new(identities);
        // Controls and pairs in parallel chunks.
        let next = Arc::new(AtomicUsize::new(0));
        let sessions: Arc<Mutex<Vec<Sessions>>> = Arc::default();
        let mut setup = Vec::new();
        for _ in 0..spec.setup_threads.max(1) {
            let (next, sessions, identities, ws, spec) = (
                next.clone(),
                sessions.clone(),
                identities.clone(),
                ws.to_string(),
                spec.clone(),
            );
            setup.push(
                orca_relay::threads::spawn("load-setup", move || {
                    if let Some(netns) = spec.netns.as_deref() {
                        super::join_netns(netns);
                    }
                    loop {
                        let index = next.fetch_add(1, Ordering::Relaxed);
                        if index >= spec.controls {
                            return;
                        }
                        let session = set_up(
                            &ws,
                            &identities[index],
                            index,
                            index < spec.paired(),
                            spec.kind(index),
                        );
                        sessions.lock().unwrap().push((index, session));
                    }
                })
                .unwrap(),
            );
        }
        for thread in setup {
            thread.join().expect("a load session failed to set up");
        }
        let mut sessions = std::mem::take(&mut *sessions.lock().unwrap());
        sessions.sort_by_key(|(index, _)| *index);
        let shared = Arc::new(Shared::default());
        let mut per_loop: Vec<Vec<(Blocking, Role)>> =
            (0..spec.loops.max(1)).map(|_| Vec::new()).collect();
        let loops = per_loop.len();
        for (index, session) in sessions {
            per_loop[index % loops].extend(session);
        }
        let threads = per_loop
            .into_iter()
            .map(|conns| {
                let (shared, spec) = (shared.clone(), spec.clone());
                orca_relay::threads::spawn("load-loop", move || {
                    run_loop(conns, shared, spec, origin)
                })
                .unwrap()
            })
            .collect();
        Load {
            shared,
            origin,
            threads,
            spec,
            identities: Arc::try_unwrap(identities).unwrap_or_else(|a| (*a).clone()),
        }
    }

    /// Milliseconds since the load started (to place [`Report::worst_gaps`]).
    pub fn elapsed_ms(&self) -> u64 {
        self.origin.elapsed().as_millis() as u64
    }

    /// From now on: stalls are measured, and pings and arrivals are counted.
    pub fn mark(&self) {
        let mut since = self.shared.since_mark.lock().unwrap();
        self.shared.max_stall_ms.store(0, Ordering::SeqCst);
        self.shared.max_control_pause_ms.store(0, Ordering::SeqCst);
        let ms = self.origin.elapsed().as_millis() as u64 + 1;
        *since = SinceMark {
            mark: Some(mark_instant(self.origin, ms)),
            pinged: 0,
            flowing: 0,
        };
        self.shared.mark_ms.store(ms, Ordering::SeqCst);
    }

    /// From now on: every open control gets a WebSocket ping, and the time until each one's
    /// pong (and each stream's first message) arrives is measured: how long until every
    /// connection is answered again, say across a crash of the relay.
    pub fn probe(&self) {
        let s = &self.shared;
        // Counters first, then the probe the loops act on (a pong of an older probe carries
        // another payload and is not counted).
        s.probe_answered.store(0, Ordering::SeqCst);
        s.probe_streams.store(0, Ordering::SeqCst);
        s.probe_last_ms.store(0, Ordering::SeqCst);
        let ms = self.origin.elapsed().as_millis() as u64 + 1;
        s.probe_ms.store(ms, Ordering::SeqCst);
    }

    /// The desktop end of `pair` stops reading (backpressure builds up in the relay).
    pub fn pause_desktop(&self, pair: usize) {
        self.shared.excluded.lock().unwrap().push(pair);
        self.shared.paused.lock().unwrap().push(pair);
    }

    pub fn resume_desktop(&self, pair: usize) {
        self.shared.paused.lock().unwrap().retain(|p| *p != pair);
    }

    pub fn report(&self) -> Report {
        let s = &self.shared;
        let (pinged, flowing) = {
            let since = s.since_mark.lock().unwrap();
            (since.pinged, since.flowing)
        };
        Report {
            // The slow desktops hear the relay's pings late by design: not counted.
            controls: self.spec.controls - self.spec.slow,
            pairs: self.spec.pairs,
            closed: s.closed.lock().unwrap().clone(),
            violations: s.violations.lock().unwrap().clone(),
            messages_sent: s.sent.load(Ordering::SeqCst),
            messages_received: s.received.load(Ordering::SeqCst),
            bytes_received: s.bytes_received.load(Ordering::SeqCst),
            max_stall_ms: s.max_stall_ms.load(Ordering::SeqCst),
            pinged_since_mark: pinged,
            worst_gaps: s.worst_gaps.lock().unwrap().clone(),
            streams_flowing_since_mark: flowing,
            probe_answered: s.probe_answered.load(Ordering::SeqCst),
            probe_streams: s.probe_streams.load(Ordering::SeqCst),
            probe_last_ms: s.probe_last_ms.load(Ordering::SeqCst),
            max_control_pause_ms: s.max_control_pause_ms.load(Ordering::SeqCst),
            slow_pongs: s.slow_pongs.load(Ordering::SeqCst),
        }
    }

    /// Stops sending (stuck pairs and slow desktops read again, at full speed), waits (up to
    /// `timeout`) until every message sent has arrived and every slow desktop has the pong of
    /// every ping it sent, stops the loops and reports.
    pub fn finish(mut self, timeout: Duration) -> Report {
        self.shared.stop_sending.store(true, Ordering::SeqCst);
        self.shared.paused.lock().unwrap().clear();
        let streams = self.spec.paired() * 2 + self.spec.slow;
        let deadline = crate::harness::now_instant() + timeout;
        while crate::harness::now_instant() < deadline
            && self.shared.drained.load(Ordering::SeqCst) < streams
        {
            orca_relay::clock::sleep(Duration::from_millis(20));
        }
        let report = self.report();
        self.shared.stop.store(true, Ordering::SeqCst);
        for thread in self.threads.drain(..) {
            let _ = thread.join();
        }
        report
    }
}

impl Drop for Load {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        for thread in self.threads.drain(..) {
            let _ = thread.join();
        }
    }
}

/// One control (and its pair when `paired`): blocking handshakes, then the sockets with what
/// was read past the last message.
fn set_up(
    ws: &str,
    identity: &Identity,
    index: usize,
    paired: bool,
    kind: ControlKind,
) -> Vec<(Blocking, Role)> {
    // A slow desktop's receive buffer is set before it connects: the window it offers is that
    // small from the start (set later, the kernel never takes back a window it offered).
    let path = "/v1/host/control";
    let (stream, rest) = if kind == ControlKind::Slow {
        client::connect_with_receive_buffer(ws, path, Some(&identity.token), SLOW_RECEIVE_BUFFER)
    } else {
        client::connect(ws, path, Some(&identity.token))
    }
    .unwrap_or_else(|status| panic!("control {index} upgrade refused: {status}"));
    let mut control = Blocking::new(stream, rest);
    control
        .send_json(serde_json::json!({"type":"host-hello","v":1,
            "relayHostId":identity.relay_host_id,"assignmentEpoch":identity.epoch}))
        .unwrap();
    let ack = control
        .json()
        .unwrap_or_else(|e| panic!("control {index}: {e}"));
    assert_eq!(ack["type"], "host-hello-ack", "control {index}: {ack}");
    let generation = ack["generation"].as_u64().unwrap();
    let mut out = Vec::new();
    if paired {
        control
            .send_json(serde_json::json!({"type":"invite-create","reqId":"r"}))
            .unwrap();
        let created = control.json().unwrap();
        let invite = created["inviteToken"].as_str().unwrap().to_string();
        let (stream, rest) =
            client::connect(ws, &format!("/v1/connect/{}", identity.relay_host_id), None)
                .unwrap_or_else(|status| panic!("phone {index} upgrade refused: {status}"));
        let mut phone = Blocking::new(stream, rest);
        phone
            .send_json(serde_json::json!({"type":"relay-auth","v":1,"credential":invite}))
            .unwrap();
        let open = control.json().unwrap();
        assert_eq!(open["type"], "conn-open", "{open}");
        let conn_id = open["connId"].as_str().unwrap();
        let ticket = open["connTicket"].as_str().unwrap();
        let (stream, rest) = client::connect(ws, &format!("/v1/host/data/{conn_id}"), None)
            .unwrap_or_else(|status| panic!("data leg {index} upgrade refused: {status}"));
        let mut leg = Blocking::new(stream, rest);
        leg.send_json(serde_json::json!({"type":"host-data-auth","v":1,
            "connTicket":ticket,"generation":generation}))
            .unwrap();
        let hello = phone.json().unwrap();
        assert_eq!(hello["type"], "relay-hello", "{hello}");
        out.push((
            phone,
            Role::Leg {
                pair: index,
                desktop: false,
            },
        ));
        out.push((
            leg,
            Role::Leg {
                pair: index,
                desktop: true,
            },
        ));
    }
    out.insert(0, (control, Role::Control { index, kind }));
    out
}

fn run_loop(sessions: Vec<(Blocking, Role)>, shared: Arc<Shared>, spec: Spec, origin: Instant) {
    let mut poll = Poll::new().unwrap();
    let mut conns: Vec<Conn> = Vec::new();
    // (pair, desktop) -> index in `conns`
    let mut legs: HashMap<(usize, bool), usize> = HashMap::new();
    for (i, (blocking, role)) in sessions.into_iter().enumerate() {
        blocking.stream.set_nonblocking(true).unwrap();
        let mut socket = mio::net::TcpStream::from_std(blocking.stream);
        poll.registry()
            .register(
                &mut socket,
                Token(i),
                Interest::READABLE | Interest::WRITABLE,
            )
            .unwrap();
        let stuck = matches!(role, Role::Leg { pair, .. } if pair >= spec.pairs);
        let stream = match role {
            Role::Leg { pair, desktop } => {
                legs.insert((pair, desktop), i);
                // Salts: phone->host streams and host->phone streams of each pair differ.
                let out_salt = pair as u64 * 2 + u64::from(desktop);
                let in_salt = pair as u64 * 2 + u64::from(!desktop);
                Some(Stream {
                    next_seq: 0,
                    last_send: None,
                    expected: 0,
                    assembling: None,
                    last_arrival: None,
                    flowing_since: None,
                    probed: 0,
                    salt_out: out_salt,
                    salt_in: in_salt,
                })
            }
            Role::Control { .. } => None,
        };
        conns.push(Conn {
            socket,
            inbuf: blocking.buffered,
            in_start: 0,
            out: Vec::new(),
            out_start: 0,
            role,
            closed: false,
            pinged_since: None,
            probed: 0,
            probe_answered: false,
            stream,
            mask: i as u32 + 1,
            stuck,
            probe_sent: None,
            last_probe: None,
            read_budget: SLOW_READ_CHUNK,
            budget_at: None,
            pings_queued: 0,
            next_pong: 0,
        });
    }
    let slow: Vec<usize> = (0..conns.len())
        .filter(|&i| conns[i].kind() == Some(ControlKind::Slow))
        .collect();
    let probes: Vec<usize> = (0..conns.len())
        .filter(|&i| conns[i].kind() == Some(ControlKind::Probe))
        .collect();
    let mut released = false;
    let mut events = Events::with_capacity(1024);
    let mut scratch = vec![0u8; 256 * 1024];
    let mut drained_reported: Vec<bool> = vec![false; conns.len()];
    // Every connection is read once at the start (bytes read during setup are in `inbuf`).
    let mut to_read: Vec<usize> = (0..conns.len()).collect();
    let mut paused_before: Vec<usize> = Vec::new();
    while !shared.stop.load(Ordering::SeqCst) {
        let _ = poll.poll(&mut events, Some(Duration::from_millis(5)));
        for event in events.iter() {
            let i = event.token().0;
            if event.is_writable() {
                let conn = &mut conns[i];
                if !conn.closed && conn.flush().is_err() {
                    mark_closed(&shared, conn, "write failed");
                }
            }
            if event.is_readable() || event.is_read_closed() || event.is_error() {
                to_read.push(i);
            }
        }
        let paused: Vec<usize> = shared.paused.lock().unwrap().clone();
        // A desktop that reads again: read what waited (no new edge will come for it).
        for pair in paused_before.iter().filter(|p| !paused.contains(p)) {
            if let Some(&i) = legs.get(&(*pair, true)) {
                to_read.push(i);
            }
        }
        paused_before = paused.clone();
        let now = crate::harness::now_instant();
        let mark_ms = shared.mark_ms.load(Ordering::SeqCst);
        let mark = (mark_ms > 0).then(|| mark_instant(origin, mark_ms));
        let finishing = shared.stop_sending.load(Ordering::SeqCst);
        if finishing && !released {
            // Stuck pairs and slow desktops read again, everything that waited.
            released = true;
            to_read.extend((0..conns.len()).filter(|&i| conns[i].stuck));
            to_read.extend(slow.iter().copied());
        }
        // A stuck end takes a sip now and then: one read of more than a segment, so its window
        // opens for a moment. (A window shut for 30 s is the relay's TCP_USER_TIMEOUT on a
        // spliced leg: the kernel resets the connection, as it should a peer that vanished.)
        let mut sipping = Vec::new();
        if !finishing {
            for (i, conn) in conns.iter_mut().enumerate() {
                if conn.stuck && !conn.closed {
                    let since = *conn.budget_at.get_or_insert(now);
                    if now.saturating_duration_since(since) >= STUCK_SIP_EVERY {
                        conn.budget_at = Some(now);
                        sipping.push(i);
                    }
                }
            }
        }
        for &i in &sipping {
            read_conn(
                &mut conns[i],
                &mut scratch,
                Some(STUCK_SIP_BYTES),
                &shared,
                &spec,
                now,
                mark,
                origin,
            );
        }
        // A new probe: a ping on every open control.
        let probe = shared.probe_ms.load(Ordering::SeqCst);
        if probe > 0 {
            for conn in conns.iter_mut() {
                if conn.closed
                    || conn.probed == probe
                    || conn.stream.is_some()
                    || conn.kind() != Some(ControlKind::Plain)
                {
                    continue;
                }
                conn.probed = probe;
                conn.probe_answered = false;
                let mask = conn.next_mask();
                let mut out = Vec::new();
                client::encode(
                    &mut out,
                    true,
                    OP_PING,
                    format!("probe {probe}").as_bytes(),
                    mask,
                );
                conn.queue(&out);
            }
        }
        // A slow desktop reads a chunk whenever its allowance has one (no edge comes for the
        // bytes it left unread).
        if !finishing {
            for &i in &slow {
                let conn = &mut conns[i];
                let since = conn.budget_at.get_or_insert(now);
                let earned = now.saturating_duration_since(*since).as_millis() as usize
                    * SLOW_READ_PER_SECOND
                    / 1000;
                if earned > 0 {
                    conn.read_budget = (conn.read_budget + earned).min(SLOW_READ_CHUNK);
                    conn.budget_at = Some(now);
                }
                if conn.read_budget >= SLOW_READ_CHUNK {
                    to_read.push(i);
                }
            }
        }
        to_read.sort_unstable();
        to_read.dedup();
        for i in std::mem::take(&mut to_read) {
            let skip = matches!(conns[i].role, Role::Leg { pair, desktop: true } if paused.contains(&pair))
                || (conns[i].stuck && !finishing);
            if skip || conns[i].closed {
                continue;
            }
            let limit = (!finishing && conns[i].kind() == Some(ControlKind::Slow)).then(|| {
                let limit = conns[i].read_budget;
                conns[i].read_budget = 0;
                limit
            });
            read_conn(
                &mut conns[i],
                &mut scratch,
                limit,
                &shared,
                &spec,
                now,
                mark,
                origin,
            );
        }
        if !finishing {
            for &i in &slow {
                let conn = &mut conns[i];
                // Pings faster than the pongs are read, while the relay takes them.
                if !conn.closed && conn.pending() < 512 {
                    let mut payload = conn.pings_queued.to_be_bytes().to_vec();
                    payload.resize(SLOW_PING_BYTES, b's');
                    let mask = conn.next_mask();
                    let mut out = Vec::new();
                    client::encode(&mut out, true, OP_PING, &payload, mask);
                    conn.queue(&out);
                    conn.pings_queued += 1;
                }
            }
        }
        for &i in &probes {
            let conn = &mut conns[i];
            if conn.closed {
                continue;
            }
            match conn.probe_sent {
                // An unanswered ping counts as it waits.
                Some(sent) if mark.is_some_and(|mark| now >= mark) => {
                    let waited = now.saturating_duration_since(sent).as_millis() as u64;
                    shared
                        .max_control_pause_ms
                        .fetch_max(waited, Ordering::SeqCst);
                }
                Some(_) => {}
                None if conn.last_probe.is_none_or(|last| {
                    now.saturating_duration_since(last) >= spec.probe_interval
                }) =>
                {
                    let mask = conn.next_mask();
                    let mut out = Vec::new();
                    client::encode(&mut out, true, OP_PING, b"probe", mask);
                    conn.queue(&out);
                    conn.probe_sent = Some(now);
                    conn.last_probe = Some(now);
                }
                None => {}
            }
        }
        // Send what is due.
        if !shared.stop_sending.load(Ordering::SeqCst) {
            for i in 0..conns.len() {
                let (pair, desktop) = match conns[i].role {
                    Role::Leg { pair, desktop } => (pair, desktop),
                    Role::Control { .. } => continue,
                };
                let Some(&peer) = legs.get(&(pair, !desktop)) else {
                    continue;
                };
                let peer_expected = conns[peer].stream.as_ref().map_or(0, |s| s.expected);
                // A stuck pair's end sends until its own queue is full.
                while send_due(&mut conns[i], peer_expected, &shared, &spec, now) && conns[i].stuck
                {
                }
            }
        }
        for conn in conns.iter_mut() {
            if !conn.closed && conn.pending() > 0 && conn.flush().is_err() {
                mark_closed(&shared, conn, "write failed");
            }
        }
        if shared.stop_sending.load(Ordering::SeqCst) {
            for &i in &slow {
                let conn = &conns[i];
                if !drained_reported[i] && (conn.next_pong >= conn.pings_queued || conn.closed) {
                    drained_reported[i] = true;
                    shared.drained.fetch_add(1, Ordering::SeqCst);
                }
            }
            for i in 0..conns.len() {
                if drained_reported[i] {
                    continue;
                }
                let (pair, desktop) = match conns[i].role {
                    Role::Leg { pair, desktop } => (pair, desktop),
                    Role::Control { .. } => continue,
                };
                let Some(&peer) = legs.get(&(pair, !desktop)) else {
                    continue;
                };
                let sent = conns[peer].stream.as_ref().map_or(0, |s| s.next_seq);
                let got = conns[i].stream.as_ref().map_or(0, |s| s.expected);
                if got >= sent || conns[i].closed {
                    drained_reported[i] = true;
                    shared.drained.fetch_add(1, Ordering::SeqCst);
                }
            }
        }
    }
}

/// The instant of the mark taken `mark_ms` (less one) after `origin`.
fn mark_instant(origin: Instant, mark_ms: u64) -> Instant {
    origin + Duration::from_millis(mark_ms - 1)
}

fn mark_closed(shared: &Shared, conn: &mut Conn, why: &str) {
    if conn.closed {
        return;
    }
    conn.closed = true;
    let who = match conn.role {
        Role::Control { index, .. } => format!("control {index}"),
        Role::Leg { pair, desktop } => {
            format!(
                "{} leg of pair {pair}",
                if desktop { "data" } else { "phone" }
            )
        }
    };
    shared.closed.lock().unwrap().push(format!("{who}: {why}"));
}

/// Reads `conn` to `WouldBlock` (or, with `limit`, one read of at most that many bytes) and
/// handles every whole frame.
#[allow(clippy::too_many_arguments)]
fn read_conn(
    conn: &mut Conn,
    scratch: &mut [u8],
    limit: Option<usize>,
    shared: &Shared,
    spec: &Spec,
    now: Instant,
    mark: Option<Instant>,
    origin: Instant,
) {
    loop {
        // Frames first (bytes may be waiting from setup or an earlier read).
        while let Some((fin, opcode, payload, len)) = client::parse(&conn.inbuf[conn.in_start..]) {
            let at = conn.in_start;
            let body = conn.inbuf[at + payload.start..at + payload.end].to_vec();
            conn.in_start += len;
            handle_frame(conn, fin, opcode, body, shared, spec, now, mark, origin);
            if conn.closed {
                return;
            }
        }
        if conn.in_start > 0 {
            conn.inbuf.drain(..conn.in_start);
            conn.in_start = 0;
        }
        if limit == Some(0) {
            return;
        }
        let room = limit.unwrap_or(scratch.len()).min(scratch.len());
        match conn.socket.read(&mut scratch[..room]) {
            Ok(0) => return mark_closed(shared, conn, "connection ended"),
            Ok(n) if limit.is_some() => {
                conn.inbuf.extend_from_slice(&scratch[..n]);
                while let Some((fin, opcode, payload, len)) =
                    client::parse(&conn.inbuf[conn.in_start..])
                {
                    let at = conn.in_start;
                    let body = conn.inbuf[at + payload.start..at + payload.end].to_vec();
                    conn.in_start += len;
                    handle_frame(conn, fin, opcode, body, shared, spec, now, mark, origin);
                    if conn.closed {
                        return;
                    }
                }
                return;
            }
            Ok(n) => conn.inbuf.extend_from_slice(&scratch[..n]),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return mark_closed(shared, conn, &format!("read failed: {e}")),
        }
    }
}

#[allow(clippy::too_many_arguments)]
fn handle_frame(
    conn: &mut Conn,
    fin: bool,
    opcode: u8,
    body: Vec<u8>,
    shared: &Shared,
    spec: &Spec,
    now: Instant,
    mark: Option<Instant>,
    origin: Instant,
) {
    match opcode {
        OP_CLOSE => {
            let code = body
                .get(..2)
                .map(|b| u16::from_be_bytes([b[0], b[1]]))
                .unwrap_or(0);
            mark_closed(shared, conn, &format!("closed {code}"));
        }
        OP_PING => {
            let mask = conn.next_mask();
            let mut out = Vec::new();
            client::encode(&mut out, true, OP_PONG, &body, mask);
            conn.queue(&out);
        }
        OP_PONG => {
            let probe = shared.probe_ms.load(Ordering::SeqCst);
            if probe > 0
                && conn.probed == probe
                && !conn.probe_answered
                && body == format!("probe {probe}").as_bytes()
            {
                conn.probe_answered = true;
                shared.probe_answered.fetch_add(1, Ordering::SeqCst);
                let took = now.saturating_duration_since(mark_instant(origin, probe));
                shared
                    .probe_last_ms
                    .fetch_max(took.as_millis() as u64, Ordering::SeqCst);
                return;
            }
            match conn.kind() {
                Some(ControlKind::Probe) => {
                    if let Some(sent) = conn.probe_sent.take() {
                        if mark.is_some_and(|mark| now >= mark) {
                            let waited = now.saturating_duration_since(sent).as_millis() as u64;
                            shared
                                .max_control_pause_ms
                                .fetch_max(waited, Ordering::SeqCst);
                        }
                    }
                }
                Some(ControlKind::Slow) => {
                    let seq = body
                        .get(..8)
                        .map(|b| u64::from_be_bytes(b.try_into().unwrap_or([0; 8])));
                    if seq != Some(conn.next_pong) || body.len() != SLOW_PING_BYTES {
                        let who = match conn.role {
                            Role::Control { index, .. } => index,
                            Role::Leg { .. } => 0,
                        };
                        shared.violations.lock().unwrap().push(format!(
                            "slow control {who}: pong {seq:?} ({} bytes), expected {}",
                            body.len(),
                            conn.next_pong
                        ));
                    }
                    conn.next_pong += 1;
                    shared.slow_pongs.fetch_add(1, Ordering::Relaxed);
                }
                _ => {}
            }
        }
        OP_TEXT if matches!(conn.role, Role::Control { .. }) => {
            let value: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
            if value["type"] == "ping" {
                let pong = serde_json::json!({"type":"pong","t":value["t"]}).to_string();
                let mask = conn.next_mask();
                let mut out = Vec::new();
                client::encode(&mut out, true, OP_TEXT, pong.as_bytes(), mask);
                conn.queue(&out);
                // A slow desktop hears its pings late by design: not counted.
                let counted = conn.kind() != Some(ControlKind::Slow);
                if let Some(mark) = mark.filter(|mark| counted && conn.pinged_since != Some(*mark))
                {
                    conn.pinged_since = Some(mark);
                    shared.count_since(mark, false);
                }
            }
        }
        _ if matches!(conn.role, Role::Control { .. }) => {}
        OP_BINARY | OP_TEXT | OP_CONTINUE => {
            let Some(stream) = conn.stream.as_mut() else {
                return;
            };
            let part = match (opcode, stream.assembling.take()) {
                (OP_CONTINUE, Some(mut so_far)) => {
                    so_far.extend_from_slice(&body);
                    so_far
                }
                (OP_CONTINUE, None) => {
                    shared
                        .violations
                        .lock()
                        .unwrap()
                        .push("a continuation with no message open".into());
                    return;
                }
                (_, Some(_)) => {
                    shared
                        .violations
                        .lock()
                        .unwrap()
                        .push("a new message inside an open one".into());
                    body
                }
                (_, None) => body,
            };
            if !fin {
                stream.assembling = Some(part);
                return;
            }
            let seq = stream.expected;
            let size = size_of(&spec.sizes, seq, stream.salt_in);
            if part.len() != size || part != message_bytes(seq, size, stream.salt_in) {
                shared.violations.lock().unwrap().push(format!(
                    "stream salt {} message {seq}: {} bytes, expected {size}{}",
                    stream.salt_in,
                    part.len(),
                    if part.len() == size {
                        " (bytes differ)"
                    } else {
                        ""
                    }
                ));
            }
            stream.expected += 1;
            shared.received.fetch_add(1, Ordering::Relaxed);
            shared
                .bytes_received
                .fetch_add(part.len() as u64, Ordering::Relaxed);
            if let Some(mark) = mark {
                if let Some(last) = stream.last_arrival {
                    if last >= mark || now >= mark {
                        let gap = now.saturating_duration_since(last.max(mark)).as_millis() as u64;
                        let backpressured = match conn.role {
                            Role::Leg { pair, .. } => {
                                pair >= spec.pairs
                                    || shared.excluded.lock().unwrap().contains(&pair)
                            }
                            Role::Control { .. } => false,
                        };
                        if !backpressured {
                            shared.max_stall_ms.fetch_max(gap, Ordering::SeqCst);
                            if gap >= 300 {
                                let at = now.saturating_duration_since(origin).as_millis() as u64;
                                let mut worst = shared.worst_gaps.lock().unwrap();
                                worst.push((at, gap));
                                worst.sort_by_key(|gap| std::cmp::Reverse(gap.1));
                                worst.truncate(12);
                            }
                        }
                    }
                }
                if stream.flowing_since != Some(mark) && now >= mark {
                    stream.flowing_since = Some(mark);
                    shared.count_since(mark, true);
                }
            }
            let probe = shared.probe_ms.load(Ordering::SeqCst);
            let probed_at = (probe > 0).then(|| mark_instant(origin, probe));
            if let Some(at) = probed_at.filter(|at| stream.probed != probe && now >= *at) {
                stream.probed = probe;
                shared.probe_streams.fetch_add(1, Ordering::SeqCst);
                shared.probe_last_ms.fetch_max(
                    now.saturating_duration_since(at).as_millis() as u64,
                    Ordering::SeqCst,
                );
            }
            stream.last_arrival = Some(now);
        }
        _ => {}
    }
}

/// Queues the stream's next message if it is due; whether it did.
fn send_due(
    conn: &mut Conn,
    peer_expected: u64,
    shared: &Shared,
    spec: &Spec,
    now: Instant,
) -> bool {
    if conn.closed || conn.pending() > 4 * 1024 * 1024 {
        return false;
    }
    let Some(stream) = conn.stream.as_ref() else {
        return false;
    };
    if conn.stuck {
        // A stuck pair sends as fast as the relay takes it (its peer reads nothing): the
        // relay's output to the peer fills to its bound and the rest waits in the kernel.
        if conn.pending() >= 256 * 1024 {
            return false;
        }
    } else {
        if stream.next_seq >= peer_expected + spec.window {
            return false;
        }
        if stream
            .last_send
            .is_some_and(|last| now.saturating_duration_since(last) < spec.interval)
        {
            return false;
        }
    }
    let seq = stream.next_seq;
    let salt = stream.salt_out;
    let size = size_of(&spec.sizes, seq, salt);
    let payload = message(seq, size, salt);
    let mut out = Vec::with_capacity(size + 64);
    if seq % 4 == 1 && size >= 3 {
        // Three fragments with a ping between the first two.
        let (a, rest) = payload.split_at(size / 3);
        let (b, c) = rest.split_at(rest.len() / 2);
        let mask = conn.next_mask();
        client::encode(&mut out, false, OP_BINARY, a, mask);
        let mask = conn.next_mask();
        client::encode(&mut out, true, OP_PING, b"between", mask);
        let mask = conn.next_mask();
        client::encode(&mut out, false, OP_CONTINUE, b, mask);
        let mask = conn.next_mask();
        client::encode(&mut out, true, OP_CONTINUE, c, mask);
    } else {
        let mask = conn.next_mask();
        client::encode(&mut out, true, OP_BINARY, &payload, mask);
    }
    conn.queue(&out);
    if let Some(stream) = conn.stream.as_mut() {
        stream.next_seq += 1;
        stream.last_send = Some(now);
    }
    shared.sent.fetch_add(1, Ordering::Relaxed);
    true
}
