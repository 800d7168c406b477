//! The model-based property test of the splice worker (issue 18).
//!
//! Random interleavings on a few pairs: data messages of random sizes (some larger than the
//! worker's read buffer, some fragmented), pings and pongs from either end, a ping written in
//! the same `write` as data, slow and stalled readers (small socket buffers, so the worker's
//! writes are partial and hit `WouldBlock`, and its output bound is reached), closes and
//! hang-ups. Everything goes to the real worker (`SplicePlane`, in this process) through real
//! loopback sockets. The worker runs with a 4 KiB read buffer and an 8 KiB output bound, so
//! backpressure and large frames come within a few KiB.
//!
//! The reference model is RFC 6455 relaying: what an endpoint receives is, per direction, the
//! data frames its peer sent, once, in order, byte-exact (opcode, FIN bit and payload), unless
//! it closed or hung up itself; then the close the relay documents (4408 when the peer left,
//! its own code echoed acknowledging its close); pongs carry only payloads of pings it sent, in order,
//! and the latest ping of an endpoint still open is answered.

use std::io::{self, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use proptest::prelude::*;
use proptest::test_runner::{TestCaseError, TestRunner};

use orca_relay::relay::frames::{encode_client_frame, FrameParser};
use orca_relay::relay::socket::Socket;
use orca_relay::relay::splice::{LegHandOff, Pair, SplicePlane, SpliceTimings};

/// One thing an endpoint does.
#[derive(Debug, Clone)]
pub enum Act {
    /// A data message in `fragments` frames of these sizes; `ping_at`: a ping written in the
    /// same write, after that many fragments (between fragments is legal; after the last is
    /// the "data + ping in one write" of the issue).
    Send {
        text: bool,
        fragments: Vec<usize>,
        ping_at: Option<usize>,
    },
    Ping,
    Pong,
    /// Reads at most this many bytes (a slow reader; 0 reads nothing).
    Read(usize),
    /// Waits this many microseconds (lets the worker run).
    Pause(u16),
    /// A close frame (1000); nothing is sent after it.
    Close,
    /// `shutdown(SHUT_WR)`: the end of the stream, no close frame.
    HangUp,
}

#[derive(Debug, Clone)]
pub struct Step {
    pub pair: usize,
    /// `true`: the desktop's data leg acts; `false`: the phone.
    pub desktop: bool,
    pub act: Act,
}

#[derive(Debug, Clone)]
pub struct Scenario {
    pub pairs: usize,
    pub steps: Vec<Step>,
}

fn size() -> impl Strategy<Value = usize> {
    prop_oneof![
        6 => 0usize..200,
        3 => 200usize..3_000,
        1 => 3_000usize..20_000,
    ]
}

fn act() -> impl Strategy<Value = Act> {
    prop_oneof![
        8 => (any::<bool>(), prop::collection::vec(size(), 1..4), prop::option::of(0usize..4))
            .prop_map(|(text, fragments, ping_at)| {
                let ping_at = ping_at.map(|at| at.min(fragments.len()));
                Act::Send { text, fragments, ping_at }
            }),
        2 => Just(Act::Ping),
        1 => Just(Act::Pong),
        6 => prop_oneof![0usize..64, 64usize..8_000].prop_map(Act::Read),
        2 => (0u16..2_000).prop_map(Act::Pause),
        1 => prop_oneof![Just(Act::Close), Just(Act::HangUp)],
    ]
}

/// Random interleavings, and (one case in four) the issue's shape with random sizes and
/// timings: a desktop streams to a phone that reads steadily while it sends data and a ping in
/// one write, other pairs busy beside it.
pub fn scenario() -> impl Strategy<Value = Scenario> {
    prop_oneof![3 => random_scenario(), 1 => issue_shaped_scenario()]
}

fn issue_shaped_scenario() -> impl Strategy<Value = Scenario> {
    (
        prop::collection::vec(
            (
                prop::collection::vec(500usize..6_000, 1..4),
                0u16..400,
                0usize..64,
                0u16..300,
            ),
            10..40,
        ),
        random_scenario(),
    )
        .prop_map(|(rounds, noise)| {
            let pairs = noise.pairs.max(1);
            let step = |desktop, act| Step {
                pair: 0,
                desktop,
                act,
            };
            let mut steps = vec![step(false, Act::Read(1 << 20))];
            let mut noise_steps = noise.steps.into_iter();
            for (fragments, before, text, after) in rounds {
                steps.push(step(
                    true,
                    Act::Send {
                        text: false,
                        fragments,
                        ping_at: None,
                    },
                ));
                steps.push(step(false, Act::Pause(before)));
                steps.push(step(
                    false,
                    Act::Send {
                        text: true,
                        fragments: vec![text],
                        ping_at: Some(1),
                    },
                ));
                steps.push(step(false, Act::Pause(after)));
                steps.extend(noise_steps.next().filter(|noise| noise.pair != 0));
            }
            Scenario { pairs, steps }
        })
}

fn random_scenario() -> impl Strategy<Value = Scenario> {
    (1usize..4).prop_flat_map(|pairs| {
        let step = (0..pairs, any::<bool>(), act()).prop_map(|(pair, desktop, act)| Step {
            pair,
            desktop,
            act,
        });
        prop::collection::vec(step, 1..48).prop_map(move |steps| Scenario { pairs, steps })
    })
}

/// A frame as an endpoint receives it: the first header byte and the payload.
type Frame = (u8, Vec<u8>);

/// What an endpoint received, filled by its reader thread.
#[derive(Default)]
struct Received {
    inbuf: Vec<u8>,
    data: Vec<Frame>,
    pongs: Vec<Vec<u8>>,
    close: Option<Option<u16>>,
    after_close: usize,
    eof: bool,
    /// Bytes read so far.
    total: usize,
}

impl Received {
    fn parse(&mut self) {
        loop {
            let Some((first, payload, used)) = server_frame(&self.inbuf) else {
                return;
            };
            self.inbuf.drain(..used);
            if self.close.is_some() {
                self.after_close += 1;
                continue;
            }
            match first & 0x0f {
                0x8 => {
                    let code =
                        (payload.len() >= 2).then(|| u16::from_be_bytes([payload[0], payload[1]]));
                    self.close = Some(code);
                }
                0x9 => {}
                0xa => self.pongs.push(payload),
                _ => self.data.push((first, payload)),
            }
        }
    }
}

/// An endpoint's reader: a thread that reads while it has budget, 1 KiB at a time, so that a
/// slow reader frees room in its socket at any moment of the worker's loop, as a phone on a
/// slow link does. `Act::Read` grants budget; the final phase grants all.
struct Reader {
    received: Arc<Mutex<Received>>,
    budget: Arc<AtomicUsize>,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Reader {
    fn start(stream: TcpStream) -> Reader {
        let received: Arc<Mutex<Received>> = Arc::default();
        let budget = Arc::new(AtomicUsize::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let (received, budget, stop) = (received.clone(), budget.clone(), stop.clone());
            orca_relay::threads::spawn("model-reader", move || {
                let mut buf = [0u8; 256];
                while !stop.load(Ordering::Acquire) {
                    let allowed = budget.load(Ordering::Acquire).min(buf.len());
                    if allowed == 0 {
                        orca_relay::clock::sleep(Duration::from_micros(20));
                        continue;
                    }
                    match (&stream).read(&mut buf[..allowed]) {
                        Ok(0) => {
                            received.lock().unwrap().eof = true;
                            return;
                        }
                        Ok(n) => {
                            budget.fetch_sub(n, Ordering::AcqRel);
                            let mut received = received.lock().unwrap();
                            received.inbuf.extend_from_slice(&buf[..n]);
                            received.total += n;
                            received.parse();
                            drop(received);
                            // A slow link: a few MB/s while there is budget, in small reads,
                            // so room appears in its socket at any moment of the worker's loop.
                            orca_relay::clock::sleep(Duration::from_micros(10));
                        }
                        Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                        Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                            orca_relay::clock::sleep(Duration::from_micros(50))
                        }
                        Err(_) => {
                            received.lock().unwrap().eof = true;
                            return;
                        }
                    }
                }
            })
            .expect("spawn a model reader")
        };
        Reader {
            received,
            budget,
            stop,
            thread: Some(thread),
        }
    }

    fn grant(&self, bytes: usize) {
        let _ = self
            .budget
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |b| {
                Some(b.saturating_add(bytes))
            });
    }
}

impl Drop for Reader {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// One client endpoint: its socket (non-blocking), what it still has to write, what it sent,
/// and its reader.
struct End {
    stream: TcpStream,
    out: Vec<u8>,
    out_at: usize,
    write_failed: bool,
    reader: Reader,
    sent: Vec<Frame>,
    pings: Vec<Vec<u8>>,
    /// Sent a close frame or hung up: it sends nothing more.
    done_sending: bool,
    /// The code of the close frame it sent, if it sent one.
    sent_close: Option<u16>,
    next_ping: u32,
}

impl End {
    fn new(stream: TcpStream) -> End {
        let reader = Reader::start(stream.try_clone().expect("clone a model socket"));
        End {
            stream,
            out: Vec::new(),
            out_at: 0,
            write_failed: false,
            reader,
            sent: Vec::new(),
            pings: Vec::new(),
            done_sending: false,
            sent_close: None,
            next_ping: 0,
        }
    }

    fn frame(&mut self, first: u8, payload: &[u8]) {
        encode_client_frame(first, payload, [0x11, 0x22, 0x33, 0x44], &mut self.out);
    }

    fn ping(&mut self, tag: u8) {
        self.next_ping += 1;
        let payload = format!("p{tag}-{}", self.next_ping).into_bytes();
        self.frame(0x89, &payload);
        self.pings.push(payload);
    }

    fn act(&mut self, act: &Act, tag: u8, counter: &mut u64) {
        if let Act::Read(n) = act {
            self.reader.grant(*n);
            return;
        }
        if self.done_sending {
            return;
        }
        match act {
            Act::Send {
                text,
                fragments,
                ping_at,
            } => {
                let count = fragments.len();
                for (index, &len) in fragments.iter().enumerate() {
                    if *ping_at == Some(index) {
                        self.ping(tag);
                    }
                    let opcode = match (index, text) {
                        (0, true) => 0x01,
                        (0, false) => 0x02,
                        _ => 0x00,
                    };
                    let first = opcode | if index + 1 == count { 0x80 } else { 0 };
                    *counter += 1;
                    let payload = numbered(*counter, len);
                    self.frame(first, &payload);
                    self.sent.push((first, payload));
                }
                if *ping_at == Some(count) {
                    self.ping(tag);
                }
            }
            Act::Ping => self.ping(tag),
            Act::Pong => self.frame(0x8a, b"unsolicited"),
            Act::Read(_) => {}
            Act::Pause(micros) => {
                orca_relay::clock::sleep(Duration::from_micros(u64::from(*micros)))
            }
            Act::Close => {
                self.frame(0x88, &1000u16.to_be_bytes());
                self.done_sending = true;
                self.sent_close = Some(1000);
            }
            Act::HangUp => {
                self.flush();
                self.done_sending = true;
                // What is still queued is lost with the hang-up.
                if self.out_at < self.out.len() {
                    self.forget_unsent();
                }
                let _ = self.stream.shutdown(Shutdown::Write);
            }
        }
        self.flush();
    }

    /// Forgets the data frames not wholly written before a hang-up: the relay never sees them
    /// whole (a frame cut by the end of the stream is not forwarded).
    fn forget_unsent(&mut self) {
        let mut at = 0;
        let mut lost = 0;
        while at < self.out.len() {
            let (first, len) = client_frame_len(&self.out[at..]);
            if at + len > self.out_at && first & 0x08 == 0 {
                lost += 1;
            }
            at += len;
        }
        let keep = self.sent.len() - lost;
        self.sent.truncate(keep);
        self.out.clear();
        self.out_at = 0;
    }

    fn flush(&mut self) {
        while self.out_at < self.out.len() && !self.write_failed {
            match (&self.stream).write(&self.out[self.out_at..]) {
                Ok(0) => self.write_failed = true,
                Ok(n) => self.out_at += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(_) => self.write_failed = true,
            }
        }
        if self.out_at == self.out.len() {
            self.out.clear();
            self.out_at = 0;
        }
    }
}

/// (first byte, total length) of a masked client frame we queued.
fn client_frame_len(bytes: &[u8]) -> (u8, usize) {
    let (head, len) = match bytes[1] & 0x7f {
        126 => (4, u16::from_be_bytes([bytes[2], bytes[3]]) as usize),
        127 => (
            10,
            u64::from_be_bytes(bytes[2..10].try_into().unwrap()) as usize,
        ),
        short => (2, short as usize),
    };
    (bytes[0], head + 4 + len)
}

/// One unmasked server frame at the front of `bytes`: (first byte, payload, bytes used).
fn server_frame(bytes: &[u8]) -> Option<(u8, Vec<u8>, usize)> {
    let second = *bytes.get(1)?;
    let (head, len) = match second & 0x7f {
        126 => (
            4,
            u16::from_be_bytes(bytes.get(2..4)?.try_into().ok()?) as usize,
        ),
        127 => (
            10,
            u64::from_be_bytes(bytes.get(2..10)?.try_into().ok()?) as usize,
        ),
        short => (2, short as usize),
    };
    let payload = bytes.get(head..head + len)?.to_vec();
    Some((bytes[0], payload, head + len))
}

/// A payload that says which frame it is.
fn numbered(seq: u64, len: usize) -> Vec<u8> {
    let mut payload: Vec<u8> = (0..len).map(|i| (seq as usize + i) as u8).collect();
    let tag = seq.to_be_bytes();
    let n = len.min(8);
    payload[..n].copy_from_slice(&tag[8 - n..]);
    payload
}

fn set_buffer(stream: &TcpStream, option: libc::c_int, bytes: libc::c_int) {
    set_option(stream, libc::SOL_SOCKET, option, bytes);
}

fn set_option(socket: &impl AsRawFd, level: libc::c_int, option: libc::c_int, bytes: libc::c_int) {
    // SAFETY: setsockopt reads one int from a pointer to a local.
    unsafe {
        libc::setsockopt(
            socket.as_raw_fd(),
            level,
            option,
            (&bytes as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        );
    }
}

/// A connected pair of loopback sockets: (client end, relay end), both with small buffers.
fn socket_pair(listener: &TcpListener) -> (TcpStream, TcpStream) {
    let client = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
    let (server, _) = listener.accept().unwrap();
    set_buffer(&client, libc::SO_RCVBUF, 4096);
    set_buffer(&client, libc::SO_SNDBUF, 8192);
    set_buffer(&server, libc::SO_SNDBUF, 4096);
    set_buffer(&server, libc::SO_RCVBUF, 8192);
    client.set_nonblocking(true).unwrap();
    (client, server)
}

/// The worker's settings in the model: sizes small enough that a few KiB reach every limit.
pub fn model_timings() -> SpliceTimings {
    SpliceTimings {
        wedge_ms: 60_000,
        // The model's endpoints never answer a close frame; a leg the relay closed waits this
        // long for them before its TCP connection is dropped (and, with bytes still unread
        // from the client, reset: a slow reader would then lose the tail of what it was sent,
        // as SPEC §5.2's 1 s allows). Longer than any case, so that is not what is checked.
        linger_ms: 60_000,
        idle_ms: 600_000,
        output_bound: 8 * 1024,
        read_buffer_bytes: 4 * 1024,
    }
}

/// Runs `scenario` against a fresh worker; `Err` describes how the relay broke the model.
pub fn run_scenario(scenario: &Scenario) -> Result<(), String> {
    let plane = SplicePlane::start(
        1,
        model_timings(),
        orca_relay::clock::system(),
        orca_relay::relay::metrics::RelayMetrics::new(&orca_relay::metrics::Registry::new()),
        &orca_relay::liveness::Liveness::detached(orca_relay::clock::system()),
        orca_relay::relay::buffer_budget::BufferBudget::new(
            orca_relay::relay::buffer_budget::DEFAULT_BUDGET_BYTES,
        ),
    )
    .map_err(|e| format!("start: {e}"))?;
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    // Small segments (the connections inherit it): with loopback's 64 KiB MSS, receivers with
    // buffers this small would hold back their window updates (silly-window avoidance) and
    // leave data in the kernel until a zero-window probe, which is not what is under test.
    set_option(&listener, libc::IPPROTO_TCP, libc::TCP_MAXSEG, 1024);
    // ends[2 * pair] is the phone, ends[2 * pair + 1] the desktop's data leg.
    let mut ends = Vec::new();
    for pair in 0..scenario.pairs {
        let (phone_client, phone_server) = socket_pair(&listener);
        let (desktop_client, desktop_server) = socket_pair(&listener);
        let leg = |id: u64, stream: TcpStream| LegHandOff {
            socket: Socket::new_splice(id, stream),
            buffered: Vec::new(),
            parser: FrameParser::new(orca_relay::protocol::SPLICE_MAX_FRAME_BYTES),
            release: Vec::new(),
        };
        let handed = plane.hand_off(Pair {
            phone: leg(2 * pair as u64, phone_server),
            host: leg(2 * pair as u64 + 1, desktop_server),
            relay_host_id: Arc::from("model-host"),
            host_present: Box::new(|| true),
        });
        if handed.is_err() {
            return Err("hand-off refused".into());
        }
        ends.push(End::new(phone_client));
        ends.push(End::new(desktop_client));
    }
    let mut counter = 0u64;
    for step in &scenario.steps {
        let index = 2 * step.pair + usize::from(step.desktop);
        ends[index].act(&step.act, index as u8, &mut counter);
        for end in ends.iter_mut() {
            end.flush();
        }
    }
    // Every endpoint now reads all it gets and writes all it has, until the model is met or
    // nothing has moved for a while.
    for end in &ends {
        end.reader.grant(usize::MAX);
    }
    let deadline = orca_relay::clock::instant() + Duration::from_secs(10);
    let mut quiet_since = orca_relay::clock::instant();
    let mut last_progress = 0;
    let verdict: Result<(), String> = loop {
        for end in ends.iter_mut() {
            end.flush();
        }
        let progress: usize = ends
            .iter()
            .map(|end| end.reader.received.lock().unwrap().total + end.out_at)
            .sum();
        if progress != last_progress {
            last_progress = progress;
            quiet_since = orca_relay::clock::instant();
        }
        let now = orca_relay::clock::instant();
        let give_up = now >= deadline || now.duration_since(quiet_since) > Duration::from_secs(5);
        let verdict = check(&ends, give_up);
        if verdict.is_ok() || give_up {
            break verdict.map_err(|e| {
                let waiting: Vec<usize> = ends
                    .iter()
                    .map(|end| {
                        let mut buf = vec![0u8; 1 << 20];
                        end.stream.peek(&mut buf).unwrap_or(0)
                    })
                    .collect();
                format!("{e} [bytes waiting in each client socket: {waiting:?}]")
            });
        }
        orca_relay::clock::sleep(Duration::from_micros(300));
    };
    drop(ends);
    plane.stop();
    verdict
}

/// The model: `Ok` when every endpoint got what RFC 6455 relaying owes it. With `final_check`
/// false, it only says whether the run may stop waiting (the same rules).
fn check(ends: &[End], final_check: bool) -> Result<(), String> {
    for (index, end) in ends.iter().enumerate() {
        let sender = &ends[index ^ 1];
        let receiver = end.reader.received.lock().unwrap();
        let (pings, done_sending, write_failed) = (&end.pings, end.done_sending, end.write_failed);
        let who = format!(
            "pair {} {}",
            index / 2,
            if index % 2 == 0 { "phone" } else { "desktop" }
        );
        if receiver.after_close > 0 {
            return Err(format!(
                "{who}: {} frames after the close",
                receiver.after_close
            ));
        }
        // Data: a prefix of what the peer sent, byte-exact, in order, each once.
        for (at, got) in receiver.data.iter().enumerate() {
            match sender.sent.get(at) {
                Some(sent) if sent == got => {}
                Some(sent) => {
                    return Err(format!(
                        "{who}: frame {at} is 0x{:02x} len {} (tag {:?}), the peer sent 0x{:02x} len {} (tag {:?}); {} of {} received",
                        got.0,
                        got.1.len(),
                        &got.1[..got.1.len().min(8)],
                        sent.0,
                        sent.1.len(),
                        &sent.1[..sent.1.len().min(8)],
                        receiver.data.len(),
                        sender.sent.len()
                    ))
                }
                None => return Err(format!("{who}: frame {at} was never sent")),
            }
        }
        let closed_itself = done_sending;
        // Everything, unless it closed or hung up itself (then the relay owes it nothing more).
        if !closed_itself && receiver.data.len() < sender.sent.len() {
            return Err(format!(
                "{who}: {} of {} data frames arrived (close {:?}, eof {}, {} bytes unparsed: {:x?}, {} queued to send by the peer)",
                receiver.data.len(),
                sender.sent.len(),
                receiver.close,
                receiver.eof,
                receiver.inbuf.len(),
                &receiver.inbuf[..receiver.inbuf.len().min(12)],
                sender.out.len() - sender.out_at,
            ));
        }
        // The close: 4408 when the peer left first; its own code echoed acknowledging its own
        // close (PROTOCOL.md: never an empty close frame, which libraries report as 1005).
        match receiver.close {
            None | Some(Some(4408)) => {}
            Some(Some(code)) if end.sent_close == Some(code) => {}
            Some(None) if closed_itself && end.sent_close.is_none() => {}
            Some(code) => return Err(format!("{who}: close {code:?}")),
        }
        // A peer that left in the middle of a frame forwarded as it arrived (larger than the
        // read buffer) leaves half a frame: the connection is dropped, no close may follow.
        let cut_mid_frame = receiver.eof && !receiver.inbuf.is_empty();
        if sender.done_sending && !closed_itself && receiver.close.is_none() && !cut_mid_frame {
            return Err(format!(
                "{who}: {}",
                if final_check {
                    "its peer left and it was never told (4408)"
                } else {
                    "waiting for the 4408"
                }
            ));
        }
        // Pongs: payloads of its own pings, in order; the latest ping answered while open.
        let mut from = 0;
        for pong in &receiver.pongs {
            match pings[from..].iter().position(|ping| ping == pong) {
                Some(at) => from += at + 1,
                None => {
                    return Err(format!(
                        "{who}: pong {:?} answers no ping of its own after #{from}",
                        String::from_utf8_lossy(pong)
                    ))
                }
            }
        }
        let ended = receiver.close.is_some() || receiver.eof;
        if !ended && !closed_itself && !write_failed {
            if let Some(last) = pings.last() {
                if receiver.pongs.last() != Some(last) {
                    return Err(format!(
                        "{who}: its latest ping {:?} was not answered ({} pongs for {} pings)",
                        String::from_utf8_lossy(last),
                        receiver.pongs.len(),
                        pings.len()
                    ));
                }
            }
        }
    }
    Ok(())
}

/// The proptest target (`tests/fuzz/mod.rs` lists it).
pub fn splice_worker_model(runner: &mut TestRunner) -> Result<(), String> {
    super::check(runner, scenario(), |scenario| {
        run_scenario(&scenario).map_err(TestCaseError::fail)
    })
}

/// The issue's reproduction as a fixed scenario: a desktop streams to a slowly reading phone
/// that sends text and a ping in one write, again and again.
pub fn ping_after_data_under_backpressure() -> Scenario {
    let mut steps = Vec::new();
    let step = |desktop, act| Step {
        pair: 0,
        desktop,
        act,
    };
    steps.push(step(false, Act::Read(400_000)));
    for round in 0..40u16 {
        steps.push(step(
            true,
            Act::Send {
                text: false,
                fragments: vec![3_000, 3_000, 3_000],
                ping_at: None,
            },
        ));
        // The phone's write lands while its reader is at work, at a different moment each
        // round.
        steps.push(step(false, Act::Pause(round * 10 % 400)));
        steps.push(step(
            false,
            Act::Send {
                text: true,
                fragments: vec![20],
                ping_at: Some(1),
            },
        ));
        steps.push(step(false, Act::Pause(200)));
    }
    Scenario { pairs: 1, steps }
}
