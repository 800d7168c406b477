//! The many-sessions load generator: a few `mio` event-loop threads drive thousands of
//! WebSocket sessions (phones and desktops' echoing ends) in one process, so the load generator
//! is the same for every system under test and is not a thread per socket.
//!
//! The WebSocket handshake and framing are written here (RFC 6455: client frames masked,
//! server frames not). Sessions are set up with blocking sockets ([`connect`], [`send_text`],
//! [`read_frame`]), then handed to a loop with whatever bytes were read past the last frame.
//!
//! A phone keeps one message outstanding: it sends a binary frame, waits for the whole echo,
//! records the round trip, and sends the next (closed loop). An echo end sends every data frame
//! back unchanged (masked when it is a client: the relay's data leg), answers pings, and stops at
//! a close.

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use mio::{Events, Interest, Poll, Token, Waker};

use orca_relay::clock;

pub const OP_TEXT: u8 = 0x1;
pub const OP_BINARY: u8 = 0x2;
pub const OP_CLOSE: u8 = 0x8;
pub const OP_PING: u8 = 0x9;
pub const OP_PONG: u8 = 0xa;

/// Appends one frame with FIN set.
pub fn encode_frame(out: &mut Vec<u8>, opcode: u8, payload: &[u8], mask: Option<[u8; 4]>) {
    encode_frame_fin(out, true, opcode, payload, mask)
}

fn encode_frame_fin(
    out: &mut Vec<u8>,
    fin: bool,
    opcode: u8,
    payload: &[u8],
    mask: Option<[u8; 4]>,
) {
    out.push(if fin { 0x80 } else { 0 } | opcode);
    let mask_bit = if mask.is_some() { 0x80 } else { 0 };
    let len = payload.len();
    if len < 126 {
        out.push(mask_bit | len as u8);
    } else if len <= 0xffff {
        out.push(mask_bit | 126);
        out.extend_from_slice(&(len as u16).to_be_bytes());
    } else {
        out.push(mask_bit | 127);
        out.extend_from_slice(&(len as u64).to_be_bytes());
    }
    match mask {
        Some(key) => {
            out.extend_from_slice(&key);
            let start = out.len();
            out.extend_from_slice(payload);
            apply_mask(&mut out[start..], key);
        }
        None => out.extend_from_slice(payload),
    }
}

fn apply_mask(bytes: &mut [u8], key: [u8; 4]) {
    for (i, byte) in bytes.iter_mut().enumerate() {
        *byte ^= key[i & 3];
    }
}

/// A frame's head.
#[derive(Debug, Clone, Copy)]
pub struct FrameHead {
    pub fin: bool,
    pub opcode: u8,
    pub mask: Option<[u8; 4]>,
    pub header_len: usize,
    pub payload_len: usize,
}

/// Parses the frame head at the start of `buf`; `None` until the whole head is there.
pub fn parse_head(buf: &[u8]) -> Option<FrameHead> {
    if buf.len() < 2 {
        return None;
    }
    let fin = buf[0] & 0x80 != 0;
    let opcode = buf[0] & 0x0f;
    let masked = buf[1] & 0x80 != 0;
    let (payload_len, mut at) = match buf[1] & 0x7f {
        126 => {
            let bytes: [u8; 2] = buf.get(2..4)?.try_into().ok()?;
            (u16::from_be_bytes(bytes) as usize, 4)
        }
        127 => {
            let bytes: [u8; 8] = buf.get(2..10)?.try_into().ok()?;
            (u64::from_be_bytes(bytes) as usize, 10)
        }
        n => (n as usize, 2),
    };
    let mask = if masked {
        let key: [u8; 4] = buf.get(at..at + 4)?.try_into().ok()?;
        at += 4;
        Some(key)
    } else {
        None
    };
    Some(FrameHead {
        fin,
        opcode,
        mask,
        header_len: at,
        payload_len,
    })
}

/// A cheap mask-key source (xorshift); masking only has to be present, not unpredictable, here.
struct Masks(u64);

impl Masks {
    fn next(&mut self) -> [u8; 4] {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 as u32).to_le_bytes()
    }
}

// ---------------------------------------------------------------------------------------------
// Blocking set-up helpers.

/// Opens a WebSocket client connection: (stream, bytes read past the response head).
pub fn connect(
    addr: &str,
    path: &str,
    bearer: Option<&str>,
) -> Result<(TcpStream, Vec<u8>), String> {
    let mut stream = TcpStream::connect(addr).map_err(|e| format!("connect {addr}: {e}"))?;
    let _ = stream.set_nodelay(true);
    stream
        .set_read_timeout(Some(Duration::from_secs(30)))
        .map_err(|e| format!("read timeout: {e}"))?;
    let authorization = bearer
        .map(|token| format!("Authorization: Bearer {token}\r\n"))
        .unwrap_or_default();
    let request = format!(
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\
         Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\
         {authorization}\r\n"
    );
    stream
        .write_all(request.as_bytes())
        .map_err(|e| format!("upgrade request to {addr}{path}: {e}"))?;
    let (head, rest) = read_head(&mut stream)?;
    if !head.starts_with("HTTP/1.1 101") {
        let status = head.lines().next().unwrap_or("").to_string();
        return Err(format!("upgrade {addr}{path}: {status}"));
    }
    Ok((stream, rest))
}

/// Reads an HTTP head (at most 16 KiB): (head, bytes after it).
fn read_head(stream: &mut TcpStream) -> Result<(String, Vec<u8>), String> {
    let mut buf = Vec::with_capacity(1024);
    let mut chunk = [0u8; 2048];
    loop {
        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&buf[..end]).into_owned();
            return Ok((head, buf[end + 4..].to_vec()));
        }
        if buf.len() > 16 * 1024 {
            return Err("HTTP head over 16 KiB".into());
        }
        match stream.read(&mut chunk) {
            Ok(0) => return Err("closed before the end of the HTTP head".into()),
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(format!("reading the HTTP head: {e}")),
        }
    }
}

/// Sends one masked text frame.
pub fn send_text(stream: &mut TcpStream, text: &str) -> Result<(), String> {
    let mut out = Vec::with_capacity(text.len() + 14);
    encode_frame(
        &mut out,
        OP_TEXT,
        text.as_bytes(),
        Some([0x37, 0xfa, 0x21, 0x3d]),
    );
    stream
        .write_all(&out)
        .map_err(|e| format!("send a text frame: {e}"))
}

/// Reads one whole frame from `stream`, `buf` holding bytes already read; what is read past the
/// frame stays in `buf`. Returns (opcode, unmasked payload).
pub fn read_frame(stream: &mut TcpStream, buf: &mut Vec<u8>) -> Result<(u8, Vec<u8>), String> {
    let mut chunk = [0u8; 4096];
    loop {
        if let Some(head) = parse_head(buf) {
            let end = head.header_len + head.payload_len;
            if buf.len() >= end {
                let mut payload = buf[head.header_len..end].to_vec();
                if let Some(key) = head.mask {
                    apply_mask(&mut payload, key);
                }
                buf.drain(..end);
                return Ok((head.opcode, payload));
            }
        }
        match stream.read(&mut chunk) {
            Ok(0) => return Err("closed while waiting for a frame".into()),
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(format!("reading a frame: {e}")),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The engine: a few event loops.

/// What a connection handed to the engine does.
#[derive(Debug, Clone, Copy)]
pub enum Role {
    /// Sends, waits for the echo, records the round trip, repeats.
    Phone,
    /// Sends every data frame back; `mask` when this end is a WebSocket client.
    Echo { mask: bool },
}

/// One run: what the phones send and which completions count.
#[derive(Clone)]
pub struct RunSpec {
    pub payload: usize,
    /// Completions in `[count_from, count_until)` count towards the rate and the latency samples.
    pub count_from: Instant,
    pub count_until: Instant,
    /// Round trips per phone in this run at most (`None`: until `sending` is cleared).
    pub max_rounds: Option<u64>,
    pub sending: Arc<AtomicBool>,
}

/// What one loop saw in a run.
#[derive(Debug, Default)]
pub struct LoopStats {
    /// Round-trip times of the counted completions, in µs.
    pub samples_us: Vec<u32>,
    /// Completions inside the counting window.
    pub in_window: u64,
    /// All completions in the run.
    pub completed: u64,
    /// Phones that lost their connection with a message outstanding.
    pub errors: u64,
    /// This loop thread's CPU seconds (user + system) during the run.
    pub cpu_seconds: f64,
    pub phones: usize,
    pub echoes: usize,
}

enum Command {
    Add(TcpStream, Role, Vec<u8>),
    Start(RunSpec),
    Collect(Sender<LoopStats>),
    Clear(Sender<()>),
    Stop,
}

struct LoopHandle {
    commands: Sender<Command>,
    waker: Arc<Waker>,
    thread: Option<JoinHandle<()>>,
}

impl LoopHandle {
    fn send(&self, command: Command) {
        if self.commands.send(command).is_ok() {
            let _ = self.waker.wake();
        }
    }
}

/// The load generator's event loops.
pub struct Engine {
    loops: Vec<LoopHandle>,
    next: AtomicUsize,
    /// Connections registered with a loop since the last [`Engine::clear`].
    registered: Arc<AtomicUsize>,
}

const WAKER: Token = Token(usize::MAX);

impl Engine {
    pub fn start(threads: usize) -> Engine {
        let registered = Arc::new(AtomicUsize::new(0));
        let loops = (0..threads.max(1))
            .map(|i| {
                let poll = Poll::new().expect("create a mio poll");
                let waker =
                    Arc::new(Waker::new(poll.registry(), WAKER).expect("create a mio waker"));
                let (commands, receiver) = channel();
                let counter = registered.clone();
                let thread = orca_relay::threads::spawn(format!("bench-loop-{i}"), move || {
                    EventLoop::new(poll, receiver, counter, i as u64).run()
                })
                .expect("spawn a load-generator loop");
                LoopHandle {
                    commands,
                    waker,
                    thread: Some(thread),
                }
            })
            .collect();
        Engine {
            loops,
            next: AtomicUsize::new(0),
            registered,
        }
    }

    pub fn threads(&self) -> usize {
        self.loops.len()
    }

    /// Hands a set-up connection to the next loop (round robin).
    pub fn add(&self, stream: TcpStream, role: Role, leftover: Vec<u8>) {
        let i = self.next.fetch_add(1, Ordering::Relaxed) % self.loops.len();
        self.loops[i].send(Command::Add(stream, role, leftover));
    }

    /// Waits until `count` connections are registered.
    pub fn wait_registered(&self, count: usize, timeout: Duration) -> bool {
        crate::harness::wait_until(timeout, || self.registered.load(Ordering::Acquire) >= count)
    }

    pub fn start_run(&self, spec: &RunSpec) {
        for handle in &self.loops {
            handle.send(Command::Start(spec.clone()));
        }
    }

    /// Waits until every phone's outstanding message came back (call after clearing
    /// `sending`, or with `max_rounds`); returns each loop's figures.
    pub fn collect(&self) -> Vec<LoopStats> {
        let receivers: Vec<Receiver<LoopStats>> = self
            .loops
            .iter()
            .map(|handle| {
                let (tx, rx) = channel();
                handle.send(Command::Collect(tx));
                rx
            })
            .collect();
        receivers
            .into_iter()
            .map(|rx| {
                rx.recv_timeout(Duration::from_secs(60))
                    .expect("a load-generator loop did not finish its run in 60 s")
            })
            .collect()
    }

    /// Closes every connection.
    pub fn clear(&self) {
        let receivers: Vec<Receiver<()>> = self
            .loops
            .iter()
            .map(|handle| {
                let (tx, rx) = channel();
                handle.send(Command::Clear(tx));
                rx
            })
            .collect();
        for rx in receivers {
            let _ = rx.recv_timeout(Duration::from_secs(30));
        }
        self.registered.store(0, Ordering::Release);
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        for handle in &mut self.loops {
            handle.send(Command::Stop);
            if let Some(thread) = handle.thread.take() {
                let _ = thread.join();
            }
        }
    }
}

struct Conn {
    stream: mio::net::TcpStream,
    role: Role,
    inbuf: Vec<u8>,
    out: Vec<u8>,
    out_at: usize,
    /// Phone: when the outstanding message was sent.
    sent_at: Option<Instant>,
    /// Phone: round trips in this run.
    rounds: u64,
}

struct Run {
    spec: RunSpec,
    stats: LoopStats,
    cpu_at_start: f64,
    outstanding: usize,
    collect: Option<Sender<LoopStats>>,
}

struct EventLoop {
    poll: Poll,
    commands: Receiver<Command>,
    registered: Arc<AtomicUsize>,
    conns: Vec<Option<Conn>>,
    free: Vec<usize>,
    scratch: Vec<u8>,
    payload: Vec<u8>,
    masks: Masks,
    run: Option<Run>,
}

/// This thread's CPU time (user + system), in seconds.
fn thread_cpu_seconds() -> f64 {
    // SAFETY: getrusage writes into the struct we own.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: as above; RUSAGE_THREAD is the calling thread.
    if unsafe { libc::getrusage(libc::RUSAGE_THREAD, &mut usage) } != 0 {
        return 0.0;
    }
    let seconds = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    seconds(usage.ru_utime) + seconds(usage.ru_stime)
}

enum Step {
    Keep,
    Close,
}

impl EventLoop {
    fn new(
        poll: Poll,
        commands: Receiver<Command>,
        registered: Arc<AtomicUsize>,
        seed: u64,
    ) -> Self {
        EventLoop {
            poll,
            commands,
            registered,
            conns: Vec::new(),
            free: Vec::new(),
            scratch: vec![0u8; 256 * 1024],
            payload: Vec::new(),
            masks: Masks(0x9e37_79b9_7f4a_7c15 ^ (seed + 1).wrapping_mul(0x2545_f491_4f6c_dd1d)),
            run: None,
        }
    }

    fn run(mut self) {
        let mut events = Events::with_capacity(1024);
        loop {
            match self.poll.poll(&mut events, None) {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => panic!("load-generator poll failed: {e}"),
            }
            for event in events.iter() {
                if event.token() == WAKER {
                    continue;
                }
                let index = event.token().0;
                if let Step::Close = self.service(index) {
                    self.close(index);
                }
            }
            while let Ok(command) = self.commands.try_recv() {
                match command {
                    Command::Add(stream, role, leftover) => self.add(stream, role, leftover),
                    Command::Start(spec) => self.start(spec),
                    Command::Collect(reply) => {
                        if let Some(run) = &mut self.run {
                            run.collect = Some(reply);
                        } else {
                            let _ = reply.send(LoopStats::default());
                        }
                    }
                    Command::Clear(reply) => {
                        self.conns.clear();
                        self.free.clear();
                        self.run = None;
                        let _ = reply.send(());
                    }
                    Command::Stop => return,
                }
            }
            self.maybe_finish();
        }
    }

    fn add(&mut self, stream: TcpStream, role: Role, leftover: Vec<u8>) {
        if stream.set_nonblocking(true).is_err() {
            return;
        }
        let mut stream = mio::net::TcpStream::from_std(stream);
        let index = self.free.pop().unwrap_or_else(|| {
            self.conns.push(None);
            self.conns.len() - 1
        });
        if self
            .poll
            .registry()
            .register(
                &mut stream,
                Token(index),
                Interest::READABLE | Interest::WRITABLE,
            )
            .is_err()
        {
            self.free.push(index);
            return;
        }
        self.conns[index] = Some(Conn {
            stream,
            role,
            inbuf: leftover,
            out: Vec::new(),
            out_at: 0,
            sent_at: None,
            rounds: 0,
        });
        self.registered.fetch_add(1, Ordering::AcqRel);
        // Bytes read during the set-up may already hold a frame.
        if let Step::Close = self.service(index) {
            self.close(index);
        }
    }

    fn start(&mut self, spec: RunSpec) {
        self.payload = vec![0xa5; spec.payload];
        let mut run = Run {
            stats: LoopStats::default(),
            cpu_at_start: thread_cpu_seconds(),
            outstanding: 0,
            collect: None,
            spec,
        };
        self.run = None;
        let mut failed = Vec::new();
        for index in 0..self.conns.len() {
            let Some(conn) = self.conns[index].as_mut() else {
                continue;
            };
            conn.rounds = 0;
            match conn.role {
                Role::Echo { .. } => run.stats.echoes += 1,
                Role::Phone => {
                    run.stats.phones += 1;
                    if run.spec.max_rounds == Some(0) || !run.spec.sending.load(Ordering::Acquire) {
                        continue;
                    }
                    let mask = self.masks.next();
                    encode_frame(&mut conn.out, OP_BINARY, &self.payload, Some(mask));
                    conn.sent_at = Some(clock::instant());
                    run.outstanding += 1;
                    if let Step::Close = flush(conn) {
                        failed.push(index);
                    }
                }
            }
        }
        self.run = Some(run);
        for index in failed {
            self.close(index);
        }
    }

    /// Answers a pending collect once nothing is outstanding.
    fn maybe_finish(&mut self) {
        let done = self
            .run
            .as_ref()
            .is_some_and(|run| run.collect.is_some() && run.outstanding == 0);
        if !done {
            return;
        }
        if let Some(mut run) = self.run.take() {
            run.stats.cpu_seconds = thread_cpu_seconds() - run.cpu_at_start;
            if let Some(reply) = run.collect.take() {
                let _ = reply.send(run.stats);
            }
        }
    }

    fn close(&mut self, index: usize) {
        if let Some(conn) = self.conns[index].take() {
            if let (Role::Phone, Some(_)) = (conn.role, conn.sent_at) {
                if let Some(run) = &mut self.run {
                    run.outstanding = run.outstanding.saturating_sub(1);
                    run.stats.errors += 1;
                }
            }
            self.free.push(index);
        }
    }

    /// Reads everything available, handles whole frames, writes what is pending.
    fn service(&mut self, index: usize) -> Step {
        let Some(conn) = self.conns.get_mut(index).and_then(Option::as_mut) else {
            return Step::Keep;
        };
        if let Step::Close = flush(conn) {
            return Step::Close;
        }
        let mut open = true;
        loop {
            match conn.stream.read(&mut self.scratch) {
                Ok(0) => {
                    open = false;
                    break;
                }
                Ok(n) => conn.inbuf.extend_from_slice(&self.scratch[..n]),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(_) => {
                    open = false;
                    break;
                }
            }
        }
        let mut at = 0;
        while let Some(head) = parse_head(&conn.inbuf[at..]) {
            let start = at + head.header_len;
            let end = start + head.payload_len;
            if conn.inbuf.len() < end {
                break;
            }
            if let Some(key) = head.mask {
                apply_mask(&mut conn.inbuf[start..end], key);
            }
            at = end;
            match (conn.role, head.opcode) {
                (_, OP_CLOSE) => return Step::Close,
                (Role::Echo { mask }, OP_PING) => {
                    let key = mask.then(|| self.masks.next());
                    let payload = conn.inbuf[start..end].to_vec();
                    encode_frame(&mut conn.out, OP_PONG, &payload, key);
                }
                (Role::Echo { mask }, 0..=2) => {
                    let key = mask.then(|| self.masks.next());
                    let (inbuf, out) = (&conn.inbuf, &mut conn.out);
                    encode_frame_fin(out, head.fin, head.opcode, &inbuf[start..end], key);
                }
                (Role::Phone, OP_BINARY) => {
                    let now = clock::instant();
                    let Some(sent_at) = conn.sent_at.take() else {
                        continue;
                    };
                    let Some(run) = self.run.as_mut() else {
                        continue;
                    };
                    run.outstanding = run.outstanding.saturating_sub(1);
                    run.stats.completed += 1;
                    conn.rounds += 1;
                    if now >= run.spec.count_from && now < run.spec.count_until {
                        run.stats.in_window += 1;
                        let micros = now.duration_since(sent_at).as_micros();
                        run.stats
                            .samples_us
                            .push(micros.min(u32::MAX as u128) as u32);
                    }
                    let more = run.spec.sending.load(Ordering::Acquire)
                        && run.spec.max_rounds.is_none_or(|max| conn.rounds < max);
                    if more {
                        let mask = self.masks.next();
                        encode_frame(&mut conn.out, OP_BINARY, &self.payload, Some(mask));
                        conn.sent_at = Some(clock::instant());
                        run.outstanding += 1;
                    }
                }
                _ => {}
            }
        }
        if at > 0 {
            conn.inbuf.drain(..at);
        }
        if let Step::Close = flush(conn) {
            return Step::Close;
        }
        if open {
            Step::Keep
        } else {
            Step::Close
        }
    }
}

/// Writes pending output until done or the socket is full.
fn flush(conn: &mut Conn) -> Step {
    while conn.out_at < conn.out.len() {
        match conn.stream.write(&conn.out[conn.out_at..]) {
            Ok(0) => return Step::Close,
            Ok(n) => conn.out_at += n,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Step::Keep,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(_) => return Step::Close,
        }
    }
    conn.out.clear();
    conn.out_at = 0;
    Step::Keep
}

// ---------------------------------------------------------------------------------------------
// The desktops' echo server (for nginx and direct).

/// Accepts WebSocket connections, answers the upgrade, and hands each to the engine as an echo
/// end. Runs until the process exits.
pub fn start_echo_server(engine: Arc<Engine>) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind the echo server");
    let addr = listener.local_addr().expect("echo server address");
    orca_relay::threads::spawn("bench-echo-acceptor", move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { continue };
            let _ = stream.set_nodelay(true);
            let _ = stream.set_read_timeout(Some(Duration::from_secs(10)));
            let Ok((head, rest)) = read_head(&mut stream) else {
                continue;
            };
            let key = head.lines().find_map(|line| {
                let (name, value) = line.split_once(':')?;
                name.trim()
                    .eq_ignore_ascii_case("sec-websocket-key")
                    .then(|| value.trim().to_string())
            });
            let Some(key) = key else { continue };
            let accept = tungstenite::handshake::derive_accept_key(key.as_bytes());
            let answer = format!(
                "HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\
                 Sec-WebSocket-Accept: {accept}\r\n\r\n"
            );
            if stream.write_all(answer.as_bytes()).is_err() {
                continue;
            }
            engine.add(stream, Role::Echo { mask: false }, rest);
        }
    })
    .expect("spawn the echo acceptor");
    addr
}
