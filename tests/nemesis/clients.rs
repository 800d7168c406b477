//! The fleet's users: desktops placed through `/v1/assign` holding a control socket, each
//! running phone sessions one after another that stream sequence-checked frames both ways, and
//! redialing (back through `/v1/assign`, with backoff) whenever their control ends, as
//! docs/PROTOCOL.md asks of a desktop; now and then one redials of its own accord.
//!
//! Every frame carries its stream, direction and sequence number and a body derived from them,
//! so the receiving side checks each frame byte for byte against the one it expects next: a
//! lost, duplicated, reordered or altered frame is caught at once. A stream ends in one of
//! three ways: completed (both sides got every frame, the phone closed 1000 and the data leg
//! got the documented 4408), closed by a fault that closes it by design (its cell was killed
//! without its descriptor store, drained, or died: then the close code must be the documented
//! one, or the connection simply gone), or a violation of checker 4.
//!
//! A `kill -9` that keeps the cell's descriptor store ([`EndKind::KilledKept`]) is judged as a
//! live handover is: the desktops' controls and spliced pairs stay, every frame arrives once,
//! in order. What may end is only what the restarted relay closes 1012 or cuts (it counts them
//! in its `orca_relay_crash_resumed … closed= cut=` line; the run holds each cell's count of
//! such ends against the sum of its lines, [`ClientCounts::kept_kill_ends`]) and a stream
//! whose pairing was not made when the process died (an invite or a connection still
//! authenticating is not kept: its phone or data leg is refused or finds its connection gone
//! before any frame passed).
//!
//! Desktops reach the directors as they would through a load balancer: a `nemesis-lb` thread
//! checks every director's `/ready` every [`LB_CHECK_EVERY`], and a desktop asks only the
//! directors that answered 200 at the last check (a director that is starting, or whose JWKS
//! or database never answered, is not in the balancer, SPEC §7).

use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use tungstenite::client::IntoClientRequest;
use tungstenite::protocol::frame::coding::CloseCode;
use tungstenite::stream::MaybeTlsStream;
use tungstenite::{Message, WebSocket};

use super::history::{Checker, History};
use super::knowledge::{EndKind, Knowledge};
use super::rng::Rng;
use crate::harness::es256_token;

type Ws = WebSocket<MaybeTlsStream<TcpStream>>;

/// How long a leg may go without the frame it waits for before the stream counts as stalled
/// (a pause is at most 5 s).
const STALL_MS: u64 = 20_000;
/// How long a desktop waits for an answer on its control (invite) or for an attach.
const ANSWER_MS: u64 = 15_000;
/// Close codes a stream or control may end with (docs/PROTOCOL.md; 1012, "service restart",
/// from docs/OPERATIONS.md "Crash survival").
const DOCUMENTED: [u16; 9] = [1000, 1001, 1012, 4401, 4404, 4408, 4409, 4429, 4503];

/// How often the load balancer in front of the directors checks their `/ready`.
pub const LB_CHECK_EVERY: Duration = Duration::from_millis(250);

/// Where the clients find the fleet.
#[derive(Clone)]
pub struct Endpoints {
    /// Each director's base URL (behind the load balancer).
    pub directors: Vec<String>,
    /// Each cell's public URL (`ws://…`), by cell index.
    pub cells: Vec<String>,
}

/// What the desktops did, for the verdict.
#[derive(Debug, Default, Clone)]
pub struct ClientCounts {
    pub streams_completed: u64,
    pub streams_cut_by_design: u64,
    pub frames_checked: u64,
    pub controls_opened: u64,
    pub redials: u64,
    pub voluntary_redials: u64,
    /// Per cell: controls and legs that ended across a kill keeping the store with a 1012
    /// close or cut (gone without a close frame), which the restarted relay must have counted.
    pub kept_kill_ends: Vec<u64>,
    /// Streams that crossed a kill keeping the store (started before, completed after).
    pub streams_across_kills: u64,
}

#[derive(Default)]
struct Shared {
    streams_completed: AtomicU64,
    streams_cut_by_design: AtomicU64,
    frames_checked: AtomicU64,
    controls_opened: AtomicU64,
    redials: AtomicU64,
    voluntary_redials: AtomicU64,
    kept_kill_ends: std::sync::Mutex<Vec<u64>>,
    streams_across_kills: AtomicU64,
}

impl Shared {
    fn counts(&self) -> ClientCounts {
        ClientCounts {
            streams_completed: self.streams_completed.load(Ordering::SeqCst),
            streams_cut_by_design: self.streams_cut_by_design.load(Ordering::SeqCst),
            frames_checked: self.frames_checked.load(Ordering::SeqCst),
            controls_opened: self.controls_opened.load(Ordering::SeqCst),
            redials: self.redials.load(Ordering::SeqCst),
            voluntary_redials: self.voluntary_redials.load(Ordering::SeqCst),
            kept_kill_ends: self.kept_kill_ends.lock().unwrap().clone(),
            streams_across_kills: self.streams_across_kills.load(Ordering::SeqCst),
        }
    }

    /// `n` ends on cell `c` that the relay restarted after a kept kill must have counted.
    fn kept_kill_end(&self, c: usize, n: u64) {
        if n > 0 {
            self.kept_kill_ends.lock().unwrap()[c] += n;
        }
    }
}

/// One desktop's current state, for the liveness check.
pub struct DesktopStatus {
    /// The cell its control is open on (acked), `usize::MAX` while it has none.
    cell: AtomicUsize,
}

impl DesktopStatus {
    pub fn cell(&self) -> Option<usize> {
        match self.cell.load(Ordering::SeqCst) {
            usize::MAX => None,
            c => Some(c),
        }
    }
}

struct Context {
    endpoints: Endpoints,
    /// The directors the load balancer routes to (their `/ready` answered 200 at its last
    /// check).
    in_balancer: std::sync::Mutex<Vec<bool>>,
    history: Arc<History>,
    knowledge: Arc<Knowledge>,
    shared: Arc<Shared>,
    stop: Arc<AtomicBool>,
}

pub struct Clients {
    desktops: Vec<(Arc<DesktopStatus>, JoinHandle<()>)>,
    balancer: Option<JoinHandle<()>>,
    context: Arc<Context>,
}

impl Clients {
    pub fn start(
        seed: u64,
        count: usize,
        endpoints: Endpoints,
        history: Arc<History>,
        knowledge: Arc<Knowledge>,
    ) -> Clients {
        let directors = endpoints.directors.len();
        let shared = Shared {
            kept_kill_ends: std::sync::Mutex::new(vec![0; endpoints.cells.len()]),
            ..Shared::default()
        };
        let context = Arc::new(Context {
            endpoints,
            in_balancer: std::sync::Mutex::new(vec![false; directors]),
            history,
            knowledge,
            shared: Arc::new(shared),
            stop: Arc::default(),
        });
        let balancer = {
            let context = context.clone();
            orca_relay::threads::spawn("nemesis-lb", move || {
                while !context.stop.load(Ordering::SeqCst) {
                    let ready: Vec<bool> = context
                        .endpoints
                        .directors
                        .iter()
                        .map(|director| {
                            ureq::get(&format!("{director}/ready"))
                                .timeout(Duration::from_secs(1))
                                .call()
                                .is_ok_and(|response| response.status() == 200)
                        })
                        .collect();
                    *context.in_balancer.lock().unwrap() = ready;
                    orca_relay::clock::sleep(LB_CHECK_EVERY);
                }
            })
            .expect("spawn the load balancer")
        };
        let desktops = (0..count)
            .map(|i| {
                let status = Arc::new(DesktopStatus {
                    cell: AtomicUsize::new(usize::MAX),
                });
                let desktop = Desktop {
                    index: i,
                    relay_host_id: format!("nemesis{:05}d{i:03}", seed % 100_000),
                    rng: Rng::derive(seed, 1_000 + i as u64),
                    status: status.clone(),
                    context: context.clone(),
                    next_stream: 0,
                };
                let thread =
                    orca_relay::threads::spawn(format!("nemesis-desktop-{i}"), move || {
                        desktop.run()
                    })
                    .expect("spawn a desktop");
                (status, thread)
            })
            .collect();
        Clients {
            desktops,
            balancer: Some(balancer),
            context,
        }
    }

    /// Each desktop's cell, `None` for one without a control.
    pub fn cells(&self) -> Vec<Option<usize>> {
        self.desktops.iter().map(|(s, _)| s.cell()).collect()
    }

    pub fn counts(&self) -> ClientCounts {
        self.context.shared.counts()
    }

    /// Ends every desktop: each finishes or cuts its stream, closes its control 1000.
    pub fn stop(mut self) -> ClientCounts {
        self.context.stop.store(true, Ordering::SeqCst);
        for (_, thread) in std::mem::take(&mut self.desktops) {
            let _ = thread.join();
        }
        if let Some(balancer) = self.balancer.take() {
            let _ = balancer.join();
        }
        self.context.shared.counts()
    }
}

/// How a WebSocket exchange ended.
#[derive(Debug, Clone, PartialEq, Eq)]
enum End {
    /// A close frame, with its code (`None`: a close frame without one).
    Closed(Option<u16>),
    /// The connection went away without a close frame (reset, EOF).
    Gone(String),
    /// Nothing arrived for too long.
    Stalled,
}

impl End {
    fn code(&self) -> Option<u16> {
        match self {
            End::Closed(code) => *code,
            _ => None,
        }
    }
}

/// How an attempt to open a socket went.
enum Opened {
    Open(Box<Ws>),
    /// Answered with an HTTP status instead of 101.
    Refused(u16),
    /// No TCP connection or no answer.
    Unreachable(String),
}

fn open(url: &str, bearer: Option<&str>) -> Opened {
    let mut request = match url.into_client_request() {
        Ok(request) => request,
        Err(e) => return Opened::Unreachable(e.to_string()),
    };
    if let Some(token) = bearer {
        request.headers_mut().insert(
            "Authorization",
            format!("Bearer {token}").parse().expect("header value"),
        );
    }
    let Some(addr) = url
        .strip_prefix("ws://")
        .and_then(|rest| rest.split('/').next())
    else {
        return Opened::Unreachable(format!("bad url {url}"));
    };
    let stream = match addr
        .parse()
        .map_err(|e: std::net::AddrParseError| e.to_string())
        .and_then(|addr| {
            TcpStream::connect_timeout(&addr, Duration::from_secs(3)).map_err(|e| e.to_string())
        }) {
        Ok(stream) => stream,
        Err(e) => return Opened::Unreachable(e),
    };
    // The upgrade answer comes within 5 s of the head (SPEC §5.2) unless the cell is paused.
    let _ = stream.set_read_timeout(Some(Duration::from_secs(10)));
    let _ = stream.set_nodelay(true);
    match tungstenite::client(request, MaybeTlsStream::Plain(stream)) {
        Ok((ws, _)) => Opened::Open(Box::new(ws)),
        Err(tungstenite::HandshakeError::Failure(tungstenite::Error::Http(response))) => {
            Opened::Refused(response.status().as_u16())
        }
        Err(e) => Opened::Unreachable(e.to_string()),
    }
}

fn set_timeout(ws: &Ws, timeout: Duration) {
    if let MaybeTlsStream::Plain(stream) = ws.get_ref() {
        let _ = stream.set_read_timeout(Some(timeout));
    }
}

fn is_timeout(error: &tungstenite::Error) -> bool {
    matches!(error, tungstenite::Error::Io(e) if matches!(
        e.kind(),
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut | std::io::ErrorKind::Interrupted
    ))
}

/// One read: `Ok(Some(message))`, `Ok(None)` on a timeout, `Err(end)` when it ended.
fn read(ws: &mut Ws) -> Result<Option<Message>, End> {
    match ws.read() {
        Ok(Message::Close(frame)) => Err(End::Closed(frame.map(|f| u16::from(f.code)))),
        Ok(message) => Ok(Some(message)),
        Err(e) if is_timeout(&e) => Ok(None),
        Err(tungstenite::Error::ConnectionClosed | tungstenite::Error::AlreadyClosed) => {
            Err(End::Gone("closed".into()))
        }
        Err(e) => Err(End::Gone(e.to_string())),
    }
}

fn send_json(ws: &mut Ws, value: serde_json::Value) -> Result<(), End> {
    ws.send(Message::text(value.to_string()))
        .map_err(|e| End::Gone(e.to_string()))
}

// ---------------------------------------------------------------------------------------------
// Frames.

/// Which way a frame goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Direction {
    PhoneToDesktop = 0,
    DesktopToPhone = 1,
}

/// The `seq`th frame of `stream` in `direction`: text or binary, 1 B to 8 KiB of body after a
/// header naming all three; the body's letters follow from all three too, so every frame
/// differs.
fn frame(stream: u64, direction: Direction, seq: u32) -> Message {
    let mut mix = Rng::derive(stream, (u64::from(seq) << 1) | direction as u64);
    let len = mix.between(1, 8 * 1024) as usize;
    let (start, step) = (mix.next() % 26, 1 + mix.next() % 25);
    let mut body = format!("s{stream}:d{}:n{seq}:", direction as u8).into_bytes();
    body.extend((0..len as u64).map(|i| b'a' + ((start + i * step) % 26) as u8));
    if mix.percent(30) {
        Message::text(String::from_utf8(body).expect("ascii"))
    } else {
        Message::binary(body)
    }
}

/// The plan of one phone session: frames each way and the time between two sends.
#[derive(Debug, Clone, Copy)]
struct StreamPlan {
    id: u64,
    frames: u32,
    interval_ms: u64,
}

/// What one leg of a stream saw.
#[derive(Debug)]
struct LegReport {
    sent: u32,
    received: u32,
    end: End,
    /// A frame that was not the one expected next (the first only).
    corrupt: Option<String>,
    /// The leg finished its part: every frame sent and received, closed as documented.
    completed: bool,
}

/// Runs one leg: sends `plan.frames` frames in `sends`, checks `plan.frames` frames in
/// `receives`. The phone closes 1000 once it has everything; the data leg then waits for the
/// relay's 4408.
fn run_leg(
    ws: &mut Ws,
    plan: StreamPlan,
    sends: Direction,
    receives: Direction,
    context: &Context,
) -> LegReport {
    let phone = sends == Direction::PhoneToDesktop;
    set_timeout(ws, Duration::from_millis(20));
    let (mut sent, mut received) = (0u32, 0u32);
    let mut corrupt = None;
    let mut next_send = context.history.now_ms();
    let mut last_progress = context.history.now_ms();
    let mut closing_since: Option<u64> = None;
    loop {
        let now = context.history.now_ms();
        let stopping = context.stop.load(Ordering::SeqCst);
        if phone
            && closing_since.is_none()
            && ((sent == plan.frames && received == plan.frames) || stopping)
        {
            // Everything arrived (or the run ends): the phone hangs up normally.
            let _ = ws.close(Some(tungstenite::protocol::CloseFrame {
                code: CloseCode::Normal,
                reason: "done".into(),
            }));
            closing_since = Some(now);
        }
        if closing_since.is_none() && sent < plan.frames && now >= next_send && !stopping {
            if let Err(end) = ws
                .send(frame(plan.id, sends, sent))
                .map_err(|e| End::Gone(e.to_string()))
            {
                return LegReport {
                    sent,
                    received,
                    end,
                    corrupt,
                    completed: false,
                };
            }
            sent += 1;
            next_send = now + plan.interval_ms;
        }
        match read(ws) {
            Ok(Some(message @ (Message::Text(_) | Message::Binary(_)))) => {
                last_progress = now;
                let expected = frame(plan.id, receives, received);
                if corrupt.is_none() && message != expected {
                    let got = match &message {
                        Message::Text(t) => format!("text {} bytes: {:.40}", t.len(), t.as_str()),
                        Message::Binary(b) => format!(
                            "binary {} bytes: {:.40}",
                            b.len(),
                            String::from_utf8_lossy(b)
                        ),
                        _ => String::new(),
                    };
                    corrupt = Some(format!("frame {received} of stream {} ({receives:?}) was not the one expected: got {got}", plan.id));
                }
                received += 1;
                context
                    .shared
                    .frames_checked
                    .fetch_add(1, Ordering::Relaxed);
            }
            Ok(Some(_)) => {}
            Ok(None) => {
                let waiting_since = last_progress.max(closing_since.unwrap_or(0));
                if now.saturating_sub(waiting_since) > STALL_MS {
                    return LegReport {
                        sent,
                        received,
                        end: End::Stalled,
                        corrupt,
                        completed: false,
                    };
                }
            }
            Err(end) => {
                // The phone's close is answered with a close frame (with or without the code).
                let completed = sent == plan.frames
                    && received == plan.frames
                    && corrupt.is_none()
                    && if phone {
                        closing_since.is_some() && matches!(end, End::Closed(None | Some(1000)))
                    } else {
                        end == End::Closed(Some(4408))
                    };
                return LegReport {
                    sent,
                    received,
                    end,
                    corrupt,
                    completed,
                };
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// A desktop.

/// Whether a stream that did not complete ended as a kill keeping the store allows, and if
/// so how many of its connections the restarted relay must have closed 1012 or cut. Each leg
/// completed its part, or ended with a 1012 close or gone (counted); a phone refused before
/// `relay-hello` (its invite, or its connection still authenticating, was not kept; counted
/// when refused 1012); or a leg gone while no frame had passed either way (the pair may not
/// have been spliced yet: a data leg still authenticating is not kept). A stall, another close
/// code or a corrupt frame is never by design.
fn kept_kill_stream_ends(reports: &[LegDone]) -> Option<u64> {
    let nothing_passed = reports.iter().all(|report| match report {
        LegDone::Phone(leg) | LegDone::Data(leg) => leg.received == 0,
        _ => true,
    });
    let mut counted = 0;
    for report in reports {
        match report {
            LegDone::Phone(leg) | LegDone::Data(leg) => {
                if leg.corrupt.is_some() {
                    return None;
                }
                match &leg.end {
                    _ if leg.completed => {}
                    End::Closed(Some(1012)) => counted += 1,
                    End::Gone(_) if nothing_passed => {}
                    End::Gone(_) => counted += 1,
                    _ => return None,
                }
            }
            LegDone::PhoneRefused(_, code) | LegDone::DataRefused(_, code) => {
                if *code == Some(1012) {
                    counted += 1;
                }
            }
        }
    }
    Some(counted)
}

/// Messages from a stream's leg threads to its desktop.
enum LegDone {
    Phone(LegReport),
    Data(LegReport),
    /// The phone could not get its session (an upgrade refusal, a close before `relay-hello`).
    PhoneRefused(String, Option<u16>),
    DataRefused(String, Option<u16>),
}

/// A stream in progress on a desktop's control.
struct Stream {
    plan: StreamPlan,
    cell: usize,
    started_ms: u64,
    phone: Option<JoinHandle<()>>,
    data: Option<JoinHandle<()>>,
    reports: Vec<LegDone>,
    expected_reports: usize,
    done_tx: Sender<LegDone>,
    done_rx: Receiver<LegDone>,
    invited_at: u64,
    invite_answered: bool,
    attached: bool,
}

struct Desktop {
    index: usize,
    relay_host_id: String,
    rng: Rng,
    status: Arc<DesktopStatus>,
    context: Arc<Context>,
    next_stream: u64,
}

/// How a control socket's life ended.
enum ControlEnd {
    Ended(End),
    Voluntary,
    Stopping,
}

impl Desktop {
    fn user_id(&self) -> String {
        format!("user-{}", self.relay_host_id)
    }

    fn event(&self, text: String) {
        self.context
            .history
            .event(format!("desktop={} {text}", self.index));
    }

    fn violation(&self, text: String) {
        self.context
            .history
            .violation(Checker::Loss, format!("desktop {}: {text}", self.index));
    }

    fn run(mut self) {
        let mut failures = 0u32;
        let mut reconnect = false;
        while !self.context.stop.load(Ordering::SeqCst) {
            let token = es256_token(&self.user_id(), &self.relay_host_id);
            let Some((cell, epoch)) = self.assign(&token, reconnect) else {
                failures += 1;
                self.backoff(failures);
                continue;
            };
            reconnect = true;
            match self.hello(cell, &token, epoch) {
                Ok((mut control, generation)) => {
                    failures = 0;
                    self.context
                        .shared
                        .controls_opened
                        .fetch_add(1, Ordering::Relaxed);
                    let opened_ms = self.context.history.now_ms();
                    self.status.cell.store(cell, Ordering::SeqCst);
                    self.event(format!(
                        "control_open cell=c{cell} epoch={epoch} generation={generation}"
                    ));
                    let end = self.hold(&mut control, cell, generation, opened_ms);
                    self.status.cell.store(usize::MAX, Ordering::SeqCst);
                    match end {
                        ControlEnd::Stopping => return,
                        ControlEnd::Voluntary => {
                            self.context
                                .shared
                                .voluntary_redials
                                .fetch_add(1, Ordering::Relaxed);
                            self.event(format!("control_redial cell=c{cell} voluntary=true"));
                        }
                        ControlEnd::Ended(end) => {
                            self.context.shared.redials.fetch_add(1, Ordering::Relaxed);
                            self.judge_control_end(cell, opened_ms, &end);
                            failures += 1;
                            self.backoff(failures);
                        }
                    }
                }
                Err(refusal) => {
                    self.event(format!("control_refused cell=c{cell} {refusal}"));
                    failures += 1;
                    self.backoff(failures);
                }
            }
        }
    }

    /// Waits 100 ms to 2 s, growing with failures in a row, with jitter.
    fn backoff(&mut self, failures: u32) {
        let ceiling = (100u64 << failures.min(5)).min(2_000);
        let wait = self.rng.between(ceiling / 2, ceiling);
        let until = self.context.history.now_ms() + wait;
        while self.context.history.now_ms() < until && !self.context.stop.load(Ordering::SeqCst) {
            orca_relay::clock::sleep(Duration::from_millis(20));
        }
    }

    /// `POST /v1/assign` through the load balancer: on a director in it (the other one when
    /// the first does not answer 200): (cell index, epoch).
    fn assign(&mut self, token: &str, reconnect: bool) -> Option<(usize, i64)> {
        let in_balancer = self.context.in_balancer.lock().unwrap().clone();
        let directors: Vec<String> = self
            .context
            .endpoints
            .directors
            .iter()
            .zip(in_balancer)
            .filter(|(_, ready)| *ready)
            .map(|(url, _)| url.clone())
            .collect();
        if directors.is_empty() {
            // The balancer has no backend: it answers 503 itself.
            return None;
        }
        let first = self.rng.below(directors.len());
        for i in 0..directors.len() {
            let director = &directors[(first + i) % directors.len()];
            let body = serde_json::json!({"v": 1, "relayHostId": self.relay_host_id, "reconnect": reconnect});
            let answer = ureq::post(&format!("{director}/v1/assign"))
                .set("Authorization", &format!("Bearer {token}"))
                .set("Content-Type", "application/json")
                .timeout(Duration::from_secs(5))
                .send_string(&body.to_string());
            match answer {
                Ok(response) => {
                    let value: serde_json::Value = response.into_json().ok()?;
                    let url = value["cellUrl"].as_str()?;
                    let Some(cell) = self.context.endpoints.cells.iter().position(|c| c == url)
                    else {
                        self.violation(format!("/v1/assign placed on an unknown cell {url}"));
                        return None;
                    };
                    return Some((cell, value["assignmentEpoch"].as_i64()?));
                }
                // 503: capacity exhausted, home cell unavailable, database unavailable,
                // starting; all documented, all retried.
                Err(ureq::Error::Status(503, _)) => {}
                Err(ureq::Error::Status(status, response)) => {
                    let body = response.into_string().unwrap_or_default();
                    self.violation(format!("/v1/assign answered {status}: {body}"));
                }
                Err(_) => {}
            }
        }
        None
    }

    /// Opens the control on `cell` and says hello: (socket, generation), or why not.
    fn hello(&self, cell: usize, token: &str, epoch: i64) -> Result<(Ws, u64), String> {
        let url = format!("{}/v1/host/control", self.context.endpoints.cells[cell]);
        let mut control = match open(&url, Some(token)) {
            Opened::Open(ws) => *ws,
            Opened::Refused(status) => {
                // 503: starting, draining, cap, pool pressure. Anything else is a bug.
                if status != 503 {
                    self.violation(format!("control upgrade on c{cell} answered {status}"));
                }
                return Err(format!("upgrade_status={status}"));
            }
            Opened::Unreachable(e) => return Err(format!("unreachable=\"{e}\"")),
        };
        let hello = serde_json::json!({"type":"host-hello","v":1,"relayHostId":self.relay_host_id,"assignmentEpoch":epoch});
        send_json(&mut control, hello).map_err(|e| format!("hello_send={e:?}"))?;
        set_timeout(&control, Duration::from_millis(200));
        let deadline = self.context.history.now_ms() + ANSWER_MS;
        loop {
            match read(&mut control) {
                Ok(Some(Message::Text(text))) => {
                    let value: serde_json::Value = serde_json::from_str(&text).unwrap_or_default();
                    if value["type"] == "host-hello-ack" {
                        return Ok((control, value["generation"].as_u64().unwrap_or(0)));
                    }
                }
                Ok(_) => {}
                Err(End::Closed(code)) => {
                    // 4409 (placement moved or not yet seen), 4429 (try again), 4503
                    // (draining) are documented refusals of a hello; 4401 is not (the token
                    // is valid).
                    if !matches!(code, Some(4409 | 4429 | 4503)) {
                        self.violation(format!("hello on c{cell} closed with {code:?}"));
                    }
                    return Err(format!("hello_close={code:?}"));
                }
                Err(end) => return Err(format!("hello_end={end:?}")),
            }
            if self.context.history.now_ms() > deadline {
                return Err("hello_unanswered".into());
            }
        }
    }

    /// Holds an acked control: answers pings, runs streams one after another, until the
    /// control ends, the desktop redials of its own accord, or the run stops.
    fn hold(
        &mut self,
        control: &mut Ws,
        cell: usize,
        generation: u64,
        opened_ms: u64,
    ) -> ControlEnd {
        set_timeout(control, Duration::from_millis(30));
        let mut stream: Option<Stream> = None;
        let mut next_stream_at = self.context.history.now_ms() + self.rng.between(0, 500);
        // Now and then a desktop hangs up and redials by itself.
        let redial_at = self
            .rng
            .percent(30)
            .then(|| self.context.history.now_ms() + self.rng.between(5_000, 40_000));
        // After `drain` the desktop starts nothing new and waits for the close (4503).
        let mut drained = false;
        loop {
            let now = self.context.history.now_ms();
            let stopping = self.context.stop.load(Ordering::SeqCst);
            match read(control) {
                Ok(Some(Message::Text(text))) => {
                    let value: serde_json::Value = serde_json::from_str(&text).unwrap_or_default();
                    match value["type"].as_str() {
                        Some("ping") => {
                            let _ = send_json(
                                control,
                                serde_json::json!({"type":"pong","t":value["t"]}),
                            );
                        }
                        Some("invite-created") => {
                            if let Some(s) = stream.as_mut() {
                                s.invite_answered = true;
                                let invite = value["inviteToken"]
                                    .as_str()
                                    .unwrap_or_default()
                                    .to_string();
                                s.phone = Some(self.spawn_phone(s, invite));
                            }
                        }
                        Some("conn-open") => {
                            if let Some(s) = stream.as_mut() {
                                s.attached = true;
                                let conn_id =
                                    value["connId"].as_str().unwrap_or_default().to_string();
                                let ticket =
                                    value["connTicket"].as_str().unwrap_or_default().to_string();
                                s.data = Some(self.spawn_data(s, conn_id, ticket, generation));
                            }
                        }
                        Some("drain") => drained = true,
                        _ => {}
                    }
                }
                Ok(_) => {}
                Err(end) => {
                    if let Some(s) = stream.take() {
                        self.finish_stream(s, opened_ms);
                    }
                    return ControlEnd::Ended(end);
                }
            }
            if let Some(s) = stream.as_mut() {
                while let Ok(done) = s.done_rx.try_recv() {
                    s.reports.push(done);
                }
                let refused = s
                    .reports
                    .iter()
                    .any(|r| matches!(r, LegDone::PhoneRefused(..) | LegDone::DataRefused(..)));
                let expected = if refused {
                    s.reports.len().max(1)
                } else {
                    s.expected_reports
                };
                let unanswered = !s.invite_answered && now > s.invited_at + ANSWER_MS;
                if s.reports.len() >= expected || unanswered {
                    if unanswered {
                        self.violation(format!(
                            "c{cell} never answered invite-create within {ANSWER_MS} ms"
                        ));
                    }
                    let s = stream.take().expect("a stream");
                    self.finish_stream(s, opened_ms);
                    next_stream_at = now + self.rng.between(100, 1_000);
                }
            }
            if stream.is_none() {
                if stopping {
                    let _ = control.close(None);
                    return ControlEnd::Stopping;
                }
                if redial_at.is_some_and(|at| now >= at) {
                    let _ = control.close(None);
                    return ControlEnd::Voluntary;
                }
                if now >= next_stream_at && !drained {
                    let plan = StreamPlan {
                        id: ((self.index as u64) << 32) | self.next_stream,
                        frames: self.rng.between(10, 60) as u32,
                        interval_ms: self.rng.between(40, 150),
                    };
                    self.next_stream += 1;
                    let req_id = format!("r{}", plan.id);
                    if send_json(
                        control,
                        serde_json::json!({"type":"invite-create","reqId":req_id}),
                    )
                    .is_ok()
                    {
                        let (done_tx, done_rx) = mpsc::channel();
                        stream = Some(Stream {
                            plan,
                            cell,
                            started_ms: now,
                            phone: None,
                            data: None,
                            reports: Vec::new(),
                            expected_reports: 2,
                            done_tx,
                            done_rx,
                            invited_at: now,
                            invite_answered: false,
                            attached: false,
                        });
                    }
                }
            }
        }
    }

    fn spawn_phone(&self, s: &Stream, invite: String) -> JoinHandle<()> {
        let url = format!(
            "{}/v1/connect/{}",
            self.context.endpoints.cells[s.cell], self.relay_host_id
        );
        let (plan, tx, context) = (s.plan, s.done_tx.clone(), self.context.clone());
        orca_relay::threads::spawn(format!("nemesis-phone-{}", self.index), move || {
            let mut ws = match open(&url, None) {
                Opened::Open(ws) => *ws,
                Opened::Refused(status) => {
                    return drop(tx.send(LegDone::PhoneRefused(
                        format!("upgrade_status={status}"),
                        None,
                    )))
                }
                Opened::Unreachable(e) => {
                    return drop(
                        tx.send(LegDone::PhoneRefused(format!("unreachable=\"{e}\""), None)),
                    )
                }
            };
            if send_json(
                &mut ws,
                serde_json::json!({"type":"relay-auth","v":1,"credential":invite}),
            )
            .is_err()
            {
                return drop(tx.send(LegDone::PhoneRefused("auth_send_failed".into(), None)));
            }
            set_timeout(&ws, Duration::from_millis(200));
            let deadline = context.history.now_ms() + ANSWER_MS;
            loop {
                match read(&mut ws) {
                    Ok(Some(Message::Text(text))) => {
                        let value: serde_json::Value =
                            serde_json::from_str(&text).unwrap_or_default();
                        if value["type"] == "relay-hello" {
                            break;
                        }
                    }
                    Ok(_) => {}
                    Err(end) => {
                        return drop(tx.send(LegDone::PhoneRefused(format!("{end:?}"), end.code())))
                    }
                }
                if context.history.now_ms() > deadline {
                    return drop(tx.send(LegDone::PhoneRefused("no_relay_hello".into(), None)));
                }
            }
            let report = run_leg(
                &mut ws,
                plan,
                Direction::PhoneToDesktop,
                Direction::DesktopToPhone,
                &context,
            );
            let _ = tx.send(LegDone::Phone(report));
        })
        .expect("spawn a phone")
    }

    fn spawn_data(
        &self,
        s: &Stream,
        conn_id: String,
        ticket: String,
        generation: u64,
    ) -> JoinHandle<()> {
        let url = format!(
            "{}/v1/host/data/{conn_id}",
            self.context.endpoints.cells[s.cell]
        );
        let (plan, tx, context) = (s.plan, s.done_tx.clone(), self.context.clone());
        orca_relay::threads::spawn(format!("nemesis-data-{}", self.index), move || {
            let mut ws = match open(&url, None) {
                Opened::Open(ws) => *ws,
                Opened::Refused(status) => return drop(tx.send(LegDone::DataRefused(format!("upgrade_status={status}"), None))),
                Opened::Unreachable(e) => return drop(tx.send(LegDone::DataRefused(format!("unreachable=\"{e}\""), None))),
            };
            let auth = serde_json::json!({"type":"host-data-auth","v":1,"connTicket":ticket,"generation":generation});
            if send_json(&mut ws, auth).is_err() {
                return drop(tx.send(LegDone::DataRefused("auth_send_failed".into(), None)));
            }
            let report = run_leg(&mut ws, plan, Direction::DesktopToPhone, Direction::PhoneToDesktop, &context);
            let _ = tx.send(LegDone::Data(report));
        })
        .expect("spawn a data leg")
    }

    /// Joins a stream's legs and judges how it ended (its control opened at `opened_ms`).
    fn finish_stream(&self, mut s: Stream, opened_ms: u64) {
        for handle in [s.phone.take(), s.data.take()].into_iter().flatten() {
            let _ = handle.join();
        }
        while let Ok(done) = s.done_rx.try_recv() {
            s.reports.push(done);
        }
        let now = self.context.history.now_ms();
        let (c, id) = (s.cell, s.plan.id);
        let mut completed = 0;
        let mut notes = Vec::new();
        let mut codes = Vec::new();
        for report in &s.reports {
            match report {
                LegDone::Phone(leg) | LegDone::Data(leg) => {
                    let side = if matches!(report, LegDone::Phone(_)) {
                        "phone"
                    } else {
                        "data"
                    };
                    if let Some(corrupt) = &leg.corrupt {
                        // Never by design: what arrives must be exactly what was sent.
                        self.violation(format!("stream {id} on c{c}: {corrupt}"));
                    }
                    if leg.completed {
                        completed += 1;
                    }
                    codes.extend(leg.end.code());
                    notes.push(format!(
                        "{side}:sent={}:received={}:end={:?}",
                        leg.sent, leg.received, leg.end
                    ));
                }
                LegDone::PhoneRefused(why, code) | LegDone::DataRefused(why, code) => {
                    codes.extend(*code);
                    notes.push(format!("refused:{why}"));
                }
            }
        }
        for code in &codes {
            if !DOCUMENTED.contains(code) {
                self.violation(format!(
                    "stream {id} on c{c} closed with undocumented code {code}"
                ));
            }
        }
        let summary = notes.join(" ");
        if completed == 2 {
            self.context
                .shared
                .streams_completed
                .fetch_add(1, Ordering::Relaxed);
            if self.context.knowledge.cell_disrupted(c, s.started_ms, now)
                == Some(EndKind::KilledKept)
            {
                self.context
                    .shared
                    .streams_across_kills
                    .fetch_add(1, Ordering::Relaxed);
            }
            return;
        }
        if self.context.stop.load(Ordering::SeqCst) {
            self.event(format!(
                "stream_cut stream={id} cell=c{c} cause=run_stopping {summary}"
            ));
            return;
        }
        // Cut short: by design only if its cell was killed, drained or died meanwhile.
        let disruption = self.context.knowledge.cell_disrupted(c, opened_ms, now);
        let by_design = match disruption {
            Some(EndKind::Killed | EndKind::Died) => true,
            // Across a kill that kept the store, as across a handover: only what the restarted
            // relay closed 1012 or cut, or a pairing it never had.
            Some(EndKind::KilledKept) => match kept_kill_stream_ends(&s.reports) {
                Some(counted) => {
                    self.context.shared.kept_kill_end(c, counted);
                    true
                }
                None => false,
            },
            // A drain closes every leg 4503 (or drops one that does not close in time).
            Some(EndKind::Terminated) => codes
                .iter()
                .all(|code| *code == 4503 || *code == 1000 || *code == 4408),
            None => false,
        };
        if by_design {
            self.context
                .shared
                .streams_cut_by_design
                .fetch_add(1, Ordering::Relaxed);
            self.event(format!(
                "stream_cut stream={id} cell=c{c} cause={disruption:?} {summary}"
            ));
        } else {
            let paused = self
                .context
                .knowledge
                .cell_paused_during(c, s.started_ms, now);
            self.violation(format!(
                "stream {id} on c{c} ended early with no fault that closes it by design (started t={}, ended t={now}, cell paused meanwhile={paused}): {summary}",
                s.started_ms
            ));
        }
    }

    /// Judges how an acked control ended.
    fn judge_control_end(&self, cell: usize, opened_ms: u64, end: &End) {
        let now = self.context.history.now_ms();
        let disruption = self.context.knowledge.cell_disrupted(cell, opened_ms, now);
        let by_design = match (end, disruption) {
            // Kept in the store, a control outlives the kill: only the restarted relay's 1012
            // (a control it cannot resume) or its cut (a frame half written) ends it.
            (End::Closed(Some(1012)) | End::Gone(_), Some(EndKind::KilledKept)) => {
                self.context.shared.kept_kill_end(cell, 1);
                true
            }
            (_, Some(EndKind::KilledKept)) => false,
            (End::Gone(_) | End::Stalled, Some(_)) => true,
            // A drain sends `drain`, then closes 4503.
            (End::Closed(Some(4503)), Some(EndKind::Terminated)) => true,
            (End::Closed(_), Some(EndKind::Killed | EndKind::Died)) => true,
            _ => false,
        };
        self.event(format!(
            "control_end cell=c{cell} end={end:?} disruption={disruption:?}"
        ));
        if let Some(code) = end.code() {
            if !DOCUMENTED.contains(&code) {
                self.violation(format!(
                    "control on c{cell} closed with undocumented code {code}"
                ));
                return;
            }
        }
        if !by_design {
            let paused = self
                .context
                .knowledge
                .cell_paused_during(cell, opened_ms, now);
            self.violation(format!(
                "control on c{cell} (open since t={opened_ms}) ended {end:?} with no fault that closes it by design (cell paused meanwhile={paused})"
            ));
        }
    }
}
