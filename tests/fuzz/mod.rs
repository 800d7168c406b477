//! Property targets for every parser of outside bytes ("fuzzing on stable"), shared by
//! `tests/fuzz_properties.rs` (a short seeded campaign inside every `cargo test`) and
//! `benches/fuzz.rs` (a long campaign: `cargo bench --bench fuzz -- --minutes 10`).
//!
//! Each target is a `proptest` strategy and a property. Every property holds: no panic (the
//! runner catches one and shrinks the input), bounded allocation (a counting allocator measures
//! the peak of the code under test on this thread), and a per-target rule: the splice frame
//! parser must agree with tungstenite's reader on random legal and illegal streams cut at random
//! read boundaries; the others must keep their documented contracts on any input.

#![allow(dead_code)]

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::fmt::Debug;
use std::io::{self, Read, Write};
use std::sync::atomic::{AtomicU64, Ordering};

use proptest::prelude::*;
use proptest::test_runner::{Config, RngAlgorithm, TestCaseError, TestRng, TestRunner};

use orca_relay::relay::frames::{FrameKind, FrameParser, Parsed, MAX_HEADER_BYTES};

pub mod splice_model;

// ---------------------------------------------------------------------------------------------
// The harness: targets, seeded runners, a case counter and a per-thread allocation meter.

/// One fuzz target: its name, its cases in the short CI campaign, and one run of `runner`.
pub struct Target {
    pub name: &'static str,
    pub ci_cases: u32,
    pub run: fn(&mut TestRunner) -> Result<(), String>,
}

pub const TARGETS: &[Target] = &[
    Target {
        name: "splice_frames_vs_tungstenite",
        ci_cases: 400,
        run: splice_frames_vs_tungstenite,
    },
    Target {
        name: "splice_frames_random_bytes",
        ci_cases: 400,
        run: splice_frames_random_bytes,
    },
    Target {
        name: "control_messages_json",
        ci_cases: 400,
        run: control_messages_json,
    },
    Target {
        name: "switch_file",
        ci_cases: 400,
        run: switch_file,
    },
    Target {
        name: "env_config",
        ci_cases: 300,
        run: env_config,
    },
    Target {
        name: "jwt_header_and_claims",
        ci_cases: 300,
        run: jwt_header_and_claims,
    },
    Target {
        name: "http_request_head",
        ci_cases: 400,
        run: http_request_head,
    },
    Target {
        name: "upgrade_validation",
        ci_cases: 400,
        run: upgrade_validation,
    },
    Target {
        name: "budget_fleet",
        ci_cases: 300,
        run: budget_fleet,
    },
    Target {
        name: "splice_worker_model",
        ci_cases: 150,
        run: splice_model::splice_worker_model,
    },
];

/// Property calls so far (shrinking steps included), across targets.
pub static CASES: AtomicU64 = AtomicU64::new(0);

/// A runner with a fixed seed: the same seed runs the same cases.
pub fn runner(seed: u64, cases: u32) -> TestRunner {
    let mut bytes = [0u8; 32];
    bytes[..8].copy_from_slice(&seed.to_le_bytes());
    let config = Config {
        cases,
        failure_persistence: None,
        max_shrink_iters: 4096,
        ..Config::default()
    };
    TestRunner::new_with_rng(config, TestRng::from_seed(RngAlgorithm::ChaCha, &bytes))
}

pub(crate) fn check<S>(
    runner: &mut TestRunner,
    strategy: S,
    property: impl Fn(S::Value) -> Result<(), TestCaseError>,
) -> Result<(), String>
where
    S: Strategy,
    S::Value: Debug,
{
    runner
        .run(&strategy, |value| {
            CASES.fetch_add(1, Ordering::Relaxed);
            property(value)
        })
        .map_err(|error| error.to_string())
}

/// Counts this thread's live heap bytes and their peak (install it as the test binary's
/// `#[global_allocator]`). Thread-local, so parallel tests do not disturb each other.
pub struct CountingAlloc;

thread_local! {
    static LIVE: Cell<isize> = const { Cell::new(0) };
    static PEAK: Cell<isize> = const { Cell::new(0) };
}

fn account(delta: isize) {
    let _ = LIVE.try_with(|live| {
        let now = live.get() + delta;
        live.set(now);
        let _ = PEAK.try_with(|peak| {
            if now > peak.get() {
                peak.set(now)
            }
        });
    });
}

// SAFETY: every call is forwarded to the system allocator unchanged; the bookkeeping only
// touches const-initialised thread-locals (no allocation, no panic).
unsafe impl GlobalAlloc for CountingAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let ptr = unsafe { System.alloc(layout) };
        if !ptr.is_null() {
            account(layout.size() as isize);
        }
        ptr
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) };
        account(-(layout.size() as isize));
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        let ptr = unsafe { System.alloc_zeroed(layout) };
        if !ptr.is_null() {
            account(layout.size() as isize);
        }
        ptr
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let new = unsafe { System.realloc(ptr, layout, new_size) };
        if !new.is_null() {
            account(new_size as isize - layout.size() as isize);
        }
        new
    }
}

/// Runs `f` and returns its result and the peak heap bytes it held on this thread (0 when the
/// binary has no counting allocator installed).
pub fn peak_heap<T>(f: impl FnOnce() -> T) -> (T, usize) {
    let start = LIVE.with(Cell::get);
    PEAK.with(|peak| peak.set(start));
    let value = f();
    let peak = PEAK.with(Cell::get);
    (value, (peak - start).max(0) as usize)
}

fn bounded(what: &str, used: usize, limit: usize) -> Result<(), TestCaseError> {
    if used > limit {
        return Err(TestCaseError::fail(format!(
            "{what} held {used} heap bytes, limit {limit}"
        )));
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// The splice frame parser, differential against tungstenite.

/// The leg limit in the differential campaign: small, so size violations are frequent.
const LIMIT: usize = 1024;

/// What a reader made of a stream, at message level.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Event {
    Message { text: bool, payload: Vec<u8> },
    Ping(Vec<u8>),
    Pong(Vec<u8>),
    Close(Option<u16>),
}

/// How a reader's run ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum End {
    /// All bytes consumed, no partial frame (ours).
    Clean,
    /// A partial frame left when the bytes ran out (ours).
    Partial,
    /// The bytes ran out (tungstenite cannot tell a partial frame from none).
    Eof,
    /// A close frame was read: nothing after it counts.
    Closed,
    /// The stream was refused; `utf8` when tungstenite refused invalid UTF-8.
    Refused { size: bool, utf8: bool },
}

/// One frame as our parser saw it: (kind, FIN, payload).
type OurFrame = (FrameKind, bool, Vec<u8>);

/// Our parser fed `chunks` the way a reader shell is: append, parse every whole frame, keep the
/// rest. Checks on the way that `needed` never exceeds a frame's bound and that the parser
/// itself never allocates.
fn run_ours(chunks: &[&[u8]], limit: usize) -> Result<(Vec<Event>, Vec<OurFrame>, End), String> {
    let mut parser = FrameParser::new(limit);
    let mut buffer: Vec<u8> = Vec::new();
    let mut events = Vec::new();
    let mut frames = Vec::new();
    let mut message: Option<(bool, Vec<u8>)> = None;
    for chunk in chunks {
        buffer.extend_from_slice(chunk);
        loop {
            let (parsed, heap) = peak_heap(|| parser.parse(&mut buffer));
            if heap != 0 {
                return Err(format!("the parser allocated {heap} bytes"));
            }
            match parsed {
                Parsed::Incomplete { needed } => {
                    if needed <= buffer.len() || needed > limit + MAX_HEADER_BYTES {
                        return Err(format!(
                            "needed {needed} with {} buffered (limit {limit})",
                            buffer.len()
                        ));
                    }
                    break;
                }
                Parsed::Violation(violation) => {
                    let size = violation.close_code() == 1009;
                    return Ok((events, frames, End::Refused { size, utf8: false }));
                }
                Parsed::Frame(frame) => {
                    let payload = buffer[frame.payload()].to_vec();
                    buffer.drain(..frame.wire_len());
                    frames.push((frame.kind, frame.fin, payload.clone()));
                    match frame.kind {
                        FrameKind::Data(data) => {
                            use tungstenite::protocol::frame::coding::Data;
                            let open = message.get_or_insert((data == Data::Text, Vec::new()));
                            open.1.extend_from_slice(&payload);
                            if frame.fin {
                                let (text, payload) = message.take().unwrap_or_default();
                                events.push(Event::Message { text, payload });
                            }
                        }
                        FrameKind::Ping => events.push(Event::Ping(payload)),
                        FrameKind::Pong => events.push(Event::Pong(payload)),
                        FrameKind::Close { code } => {
                            events.push(Event::Close(code));
                            return Ok((events, frames, End::Closed));
                        }
                    }
                }
            }
        }
    }
    let end = if buffer.is_empty() {
        End::Clean
    } else {
        End::Partial
    };
    Ok((events, frames, end))
}

/// Bytes handed out in the given chunk sizes; replies are swallowed.
struct Chunked {
    chunks: Vec<Vec<u8>>,
    next: usize,
    offset: usize,
}

impl Read for Chunked {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        while let Some(chunk) = self.chunks.get(self.next) {
            if self.offset < chunk.len() {
                let n = (chunk.len() - self.offset).min(buf.len());
                buf[..n].copy_from_slice(&chunk[self.offset..self.offset + n]);
                self.offset += n;
                return Ok(n);
            }
            self.next += 1;
            self.offset = 0;
        }
        Ok(0)
    }
}

impl Write for Chunked {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        Ok(buf.len())
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// tungstenite's server-side reader over the same chunks, configured with the same limit.
fn run_tungstenite(chunks: &[&[u8]], limit: usize) -> Result<(Vec<Event>, End), String> {
    use tungstenite::error::ProtocolError;
    use tungstenite::protocol::{Role, WebSocketConfig, WebSocketContext};
    use tungstenite::{Error, Message};
    let config = WebSocketConfig::default()
        .max_frame_size(Some(limit))
        .max_message_size(Some(limit));
    let mut context = WebSocketContext::new(Role::Server, Some(config));
    let mut stream = Chunked {
        chunks: chunks.iter().map(|c| c.to_vec()).collect(),
        next: 0,
        offset: 0,
    };
    let mut events = Vec::new();
    loop {
        match context.read(&mut stream) {
            Ok(Message::Text(text)) => events.push(Event::Message {
                text: true,
                payload: text.as_bytes().to_vec(),
            }),
            Ok(Message::Binary(payload)) => events.push(Event::Message {
                text: false,
                payload: payload.to_vec(),
            }),
            Ok(Message::Ping(payload)) => events.push(Event::Ping(payload.to_vec())),
            Ok(Message::Pong(payload)) => events.push(Event::Pong(payload.to_vec())),
            Ok(Message::Close(frame)) => {
                // tungstenite answers a close with an invalid code by rewriting it to this.
                if let Some(frame) = &frame {
                    if u16::from(frame.code) == 1002
                        && frame.reason.as_str() == "Protocol violation"
                    {
                        return Ok((
                            events,
                            End::Refused {
                                size: false,
                                utf8: false,
                            },
                        ));
                    }
                }
                events.push(Event::Close(frame.map(|f| u16::from(f.code))));
                return Ok((events, End::Closed));
            }
            Ok(Message::Frame(_)) => return Err("tungstenite returned a raw frame".into()),
            Err(Error::Protocol(ProtocolError::ResetWithoutClosingHandshake)) => {
                return Ok((events, End::Eof))
            }
            Err(Error::Protocol(_)) => {
                return Ok((
                    events,
                    End::Refused {
                        size: false,
                        utf8: false,
                    },
                ))
            }
            Err(Error::Capacity(_)) => {
                return Ok((
                    events,
                    End::Refused {
                        size: true,
                        utf8: false,
                    },
                ))
            }
            Err(Error::Utf8(_)) => {
                return Ok((
                    events,
                    End::Refused {
                        size: false,
                        utf8: true,
                    },
                ))
            }
            Err(other) => return Err(format!("tungstenite: unexpected {other:?}")),
        }
    }
}

/// One frame to send: the first header byte as the client writes it (right or wrong), the
/// payload, the mask (or none), and how the length is encoded (0 shortest, 1 as 16 bits when
/// it fits, 2 as 64 bits).
#[derive(Debug, Clone)]
struct FrameSpec {
    first: u8,
    payload: Vec<u8>,
    mask: Option<[u8; 4]>,
    length_width: u8,
}

impl FrameSpec {
    fn encode(&self, out: &mut Vec<u8>) {
        out.push(self.first);
        let masked = if self.mask.is_some() { 0x80 } else { 0 };
        let len = self.payload.len();
        match (self.length_width, len) {
            (0, 0..=125) => out.push(masked | len as u8),
            (0 | 1, 0..=65_535) => {
                out.push(masked | 126);
                out.extend_from_slice(&(len as u16).to_be_bytes());
            }
            _ => {
                out.push(masked | 127);
                out.extend_from_slice(&(len as u64).to_be_bytes());
            }
        }
        match self.mask {
            Some(mask) => {
                out.extend_from_slice(&mask);
                out.extend(
                    self.payload
                        .iter()
                        .enumerate()
                        .map(|(i, b)| b ^ mask[i % 4]),
                );
            }
            None => out.extend_from_slice(&self.payload),
        }
    }
}

/// A message a well-behaved client sends: data in fragments with controls between them, or a
/// control frame, or a close.
#[derive(Debug, Clone)]
enum Spec {
    Data {
        text: bool,
        payload: Vec<u8>,
        cuts: Vec<usize>,
        ping_between: bool,
    },
    Ping(Vec<u8>),
    Pong(Vec<u8>),
    Close(Vec<u8>),
}

fn text_payload(max: usize) -> impl Strategy<Value = Vec<u8>> {
    proptest::collection::vec(
        prop_oneof![Just('a'), Just('é'), Just('€'), Just('𝄞'), any::<char>()],
        0..=max / 2,
    )
    .prop_map(|chars| chars.into_iter().collect::<String>().into_bytes())
}

fn close_payload() -> impl Strategy<Value = Vec<u8>> {
    let code = prop_oneof![
        // Valid codes (1014 is left out: tungstenite refuses it, we accept it, IANA lists it).
        prop::sample::select(vec![
            1000u16, 1001, 1002, 1003, 1007, 1008, 1009, 1010, 1011, 1012, 1013, 3000, 3999, 4000,
            4408, 4999
        ]),
        // Invalid ones.
        prop::sample::select(vec![
            0u16, 999, 1004, 1005, 1006, 1015, 1016, 2000, 2999, 5000
        ]),
        any::<u16>(),
    ];
    prop_oneof![
        Just(Vec::new()),
        any::<u8>().prop_map(|b| vec![b]),
        (code.clone(), "[a-z ]{0,20}").prop_map(|(code, reason)| {
            let mut payload = code.to_be_bytes().to_vec();
            payload.extend_from_slice(reason.as_bytes());
            payload
        }),
        (code, proptest::collection::vec(any::<u8>(), 0..10)).prop_map(|(code, reason)| {
            let mut payload = code.to_be_bytes().to_vec();
            payload.extend_from_slice(&reason);
            payload
        }),
    ]
}

fn spec() -> impl Strategy<Value = Spec> {
    let data = (
        any::<bool>(),
        prop_oneof![
            4 => 0usize..64,
            2 => 64usize..400,
            1 => 400usize..LIMIT + 64,
        ],
        proptest::collection::vec(any::<prop::sample::Index>(), 0..4),
        any::<bool>(),
    )
        .prop_flat_map(|(text, len, cuts, ping_between)| {
            let payload = if text {
                text_payload(len).boxed()
            } else {
                proptest::collection::vec(any::<u8>(), len..=len).boxed()
            };
            (Just(text), payload, Just(cuts), Just(ping_between))
        })
        .prop_map(|(text, payload, cuts, ping_between)| {
            let mut cuts: Vec<usize> = cuts.iter().map(|i| i.index(payload.len() + 1)).collect();
            cuts.sort_unstable();
            Spec::Data {
                text,
                payload,
                cuts,
                ping_between,
            }
        });
    prop_oneof![
        8 => data,
        1 => proptest::collection::vec(any::<u8>(), 0..130).prop_map(Spec::Ping),
        1 => proptest::collection::vec(any::<u8>(), 0..20).prop_map(Spec::Pong),
        1 => close_payload().prop_map(Spec::Close),
    ]
}

/// Legal frames for `specs` (a close ends the list).
fn frames_of(specs: &[Spec], masks: &[[u8; 4]], widths: &[u8]) -> Vec<FrameSpec> {
    let mut frames = Vec::new();
    let mut n = 0;
    let mut frame = |first: u8, payload: Vec<u8>| {
        let spec = FrameSpec {
            first,
            payload,
            mask: Some(masks[n % masks.len()]),
            length_width: widths[n % widths.len()],
        };
        n += 1;
        spec
    };
    for spec in specs {
        match spec {
            Spec::Data {
                text,
                payload,
                cuts,
                ping_between,
            } => {
                let mut from = 0;
                let mut ends: Vec<usize> = cuts.clone();
                ends.push(payload.len());
                for (i, to) in ends.iter().enumerate() {
                    let fin = i + 1 == ends.len();
                    let opcode = match (i, text) {
                        (0, true) => 1,
                        (0, false) => 2,
                        _ => 0,
                    };
                    frames.push(frame(
                        opcode | if fin { 0x80 } else { 0 },
                        payload[from..*to].to_vec(),
                    ));
                    if !fin && *ping_between {
                        frames.push(frame(0x89, b"between".to_vec()));
                    }
                    from = *to;
                }
            }
            Spec::Ping(payload) => frames.push(frame(0x89, payload.clone())),
            Spec::Pong(payload) => frames.push(frame(0x8a, payload.clone())),
            Spec::Close(payload) => {
                frames.push(frame(0x88, payload.clone()));
                break;
            }
        }
    }
    frames
}

/// A way to break a legal frame sequence.
#[derive(Debug, Clone)]
enum Defect {
    /// XOR the first header byte of frame `at` (RSV bits, opcode, FIN).
    FirstByte {
        at: prop::sample::Index,
        xor: u8,
    },
    Unmask(prop::sample::Index),
    Drop(prop::sample::Index),
    Duplicate(prop::sample::Index),
    Swap(prop::sample::Index, prop::sample::Index),
    /// A frame with a 64-bit length whose high bit is set.
    HighBitLength(prop::sample::Index),
}

fn defect() -> impl Strategy<Value = Defect> {
    let index = any::<prop::sample::Index>;
    prop_oneof![
        (
            index(),
            prop::sample::select(vec![
                0x80u8, 0x40, 0x20, 0x10, 0x0f, 0x01, 0x02, 0x08, 0x03, 0x0b
            ])
        )
            .prop_map(|(at, xor)| Defect::FirstByte { at, xor }),
        index().prop_map(Defect::Unmask),
        index().prop_map(Defect::Drop),
        index().prop_map(Defect::Duplicate),
        (index(), index()).prop_map(|(a, b)| Defect::Swap(a, b)),
        index().prop_map(Defect::HighBitLength),
    ]
}

/// A stream of frames and the cuts of its read boundaries.
#[derive(Debug, Clone)]
struct StreamCase {
    specs: Vec<Spec>,
    masks: Vec<[u8; 4]>,
    widths: Vec<u8>,
    defects: Vec<Defect>,
    /// Byte flips (offset, xor): garbles the stream below the frame level.
    flips: Vec<(prop::sample::Index, u8)>,
    splits: Vec<usize>,
}

impl StreamCase {
    fn bytes(&self) -> (Vec<u8>, bool) {
        let mut frames = frames_of(&self.specs, &self.masks, &self.widths);
        for defect in &self.defects {
            if frames.is_empty() {
                break;
            }
            let len = frames.len();
            match defect {
                Defect::FirstByte { at, xor } => frames[at.index(len)].first ^= xor,
                Defect::Unmask(at) => frames[at.index(len)].mask = None,
                Defect::Drop(at) => {
                    frames.remove(at.index(len));
                }
                Defect::Duplicate(at) => {
                    let frame = frames[at.index(len)].clone();
                    frames.insert(at.index(len), frame);
                }
                Defect::Swap(a, b) => frames.swap(a.index(len), b.index(len)),
                Defect::HighBitLength(at) => {
                    let at = at.index(len);
                    frames[at].length_width = 2;
                    frames[at].payload.clear();
                    frames[at].first = 0x82;
                    // Encoded below with the length's high bit forced on.
                    frames[at].mask = Some([0xde, 0xad, 0xbe, 0xef]);
                    frames.truncate(at + 1);
                    let mut out = Vec::new();
                    for frame in &frames {
                        frame.encode(&mut out);
                    }
                    // The last frame's 8-byte length starts 2 + 8 + 4 bytes from the end.
                    let high = out.len() - 12;
                    out[high] |= 0x80;
                    return (out, false);
                }
            }
        }
        let mut out = Vec::new();
        for frame in &frames {
            frame.encode(&mut out);
        }
        let garbled = !self.flips.is_empty() && !out.is_empty();
        if garbled {
            let len = out.len();
            for (at, xor) in &self.flips {
                out[at.index(len)] ^= xor | 1;
            }
        }
        (out, garbled)
    }
}

fn stream_case() -> impl Strategy<Value = StreamCase> {
    (
        proptest::collection::vec(spec(), 0..8),
        proptest::collection::vec(any::<[u8; 4]>(), 1..4),
        proptest::collection::vec(
            prop_oneof![6 => Just(0u8), 1 => Just(1u8), 1 => Just(2u8)],
            1..4,
        ),
        prop_oneof![
            3 => Just(Vec::new()),
            2 => proptest::collection::vec(defect(), 1..3),
        ],
        prop_oneof![
            6 => Just(Vec::new()),
            1 => proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..4),
        ],
        proptest::collection::vec(
            prop_oneof![3 => 1usize..16, 2 => 16usize..600, 1 => 600usize..5000],
            0..40,
        ),
    )
        .prop_map(
            |(specs, masks, widths, defects, flips, splits)| StreamCase {
                specs,
                masks,
                widths,
                defects,
                flips,
                splits,
            },
        )
}

fn cut<'a>(bytes: &'a [u8], splits: &[usize]) -> Vec<&'a [u8]> {
    let mut chunks = Vec::new();
    let mut at = 0;
    for split in splits {
        if at >= bytes.len() {
            break;
        }
        let to = (at + split).min(bytes.len());
        chunks.push(&bytes[at..to]);
        at = to;
    }
    if at < bytes.len() {
        chunks.push(&bytes[at..]);
    }
    chunks
}

/// The differential rule: the same events, and the same end, except where tungstenite does
/// what a relay must not (validate text UTF-8, refuse close code 1014) or cannot (tell a
/// truncated frame from a refused one at the end of garbled bytes).
fn agree(case: &StreamCase) -> Result<(), TestCaseError> {
    let (bytes, garbled) = case.bytes();
    let chunks = cut(&bytes, &case.splits);
    let (ours, our_frames, our_end) = run_ours(&chunks, LIMIT).map_err(TestCaseError::fail)?;
    let (theirs, their_end) = run_tungstenite(&chunks, LIMIT).map_err(TestCaseError::fail)?;
    // Split invariance: the whole stream at once gives the same frames.
    let (_, whole_frames, whole_end) =
        run_ours(&[bytes.as_slice()], LIMIT).map_err(TestCaseError::fail)?;
    prop_assert_eq!(
        &whole_frames,
        &our_frames,
        "frames depend on the read split"
    );
    prop_assert_eq!(whole_end, our_end, "the end depends on the read split");

    let prefix_matches = ours.len() >= theirs.len() && ours[..theirs.len()] == theirs[..];
    match their_end {
        End::Refused { utf8: true, .. } => {
            prop_assert!(
                prefix_matches,
                "events differ: ours {ours:?}, theirs {theirs:?}"
            );
            // tungstenite refuses a text message at the first fragment that is not UTF-8; we
            // forward it (the documented difference). After the common prefix ours may only
            // hold control frames (a close included) until that text message (bad) completes,
            // if it ever does.
            let mut rest = ours[theirs.len()..].iter().skip_while(|event| {
                matches!(event, Event::Ping(_) | Event::Pong(_) | Event::Close(_))
            });
            let rest_ok = match rest.next() {
                None => true,
                Some(Event::Message {
                    text: true,
                    payload,
                }) => std::str::from_utf8(payload).is_err(),
                Some(_) => false,
            };
            prop_assert!(
                rest_ok,
                "tungstenite refused UTF-8 after {theirs:?}; ours {ours:?} {our_end:?}"
            );
        }
        End::Refused { .. } => {
            let ours_refused = matches!(our_end, End::Refused { .. }) && ours == theirs;
            let close_1014 = prefix_matches
                && ours.len() == theirs.len() + 1
                && ours.last() == Some(&Event::Close(Some(1014)));
            prop_assert!(
                ours_refused || close_1014,
                "tungstenite refused ({their_end:?}) after {theirs:?}; ours {our_end:?} after {ours:?}; our frames {:?}; stream starts {:02x?}",
                our_frames.iter().map(|(k, fin, p)| (*k, *fin, p.len())).collect::<Vec<_>>(),
                &bytes[..bytes.len().min(40)]
            );
        }
        End::Eof => {
            let ours_clean = matches!(our_end, End::Clean | End::Partial) && ours == theirs;
            let garbled_tail = garbled && matches!(our_end, End::Refused { .. }) && ours == theirs;
            prop_assert!(
                ours_clean || garbled_tail,
                "tungstenite reached the end after {theirs:?}; ours {our_end:?} after {ours:?}"
            );
        }
        End::Closed => {
            prop_assert_eq!(our_end, End::Closed);
            prop_assert_eq!(&ours, &theirs);
        }
        End::Clean | End::Partial => unreachable!("tungstenite reports Eof"),
    }
    Ok(())
}

fn splice_frames_vs_tungstenite(runner: &mut TestRunner) -> Result<(), String> {
    check(runner, stream_case(), |case| agree(&case))
}

/// Raw random bytes (and the real 8 MiB limit): no panic, no allocation, a frame bound.
fn splice_frames_random_bytes(runner: &mut TestRunner) -> Result<(), String> {
    let strategy = (
        proptest::collection::vec(any::<u8>(), 0..2048),
        proptest::collection::vec(1usize..300, 0..20),
    );
    check(runner, strategy, |(bytes, splits)| {
        let chunks = cut(&bytes, &splits);
        run_ours(&chunks, orca_relay::protocol::SPLICE_MAX_FRAME_BYTES)
            .map_err(TestCaseError::fail)?;
        run_ours(&chunks, LIMIT).map_err(TestCaseError::fail)?;
        Ok(())
    })
}

// ---------------------------------------------------------------------------------------------
// Control messages (serde JSON of every first frame and control message).

fn json_value() -> impl Strategy<Value = serde_json::Value> {
    use serde_json::Value;
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        (-1e9f64..1e9).prop_map(Value::from),
        "[ -~]{0,12}".prop_map(Value::String),
        any::<String>().prop_map(Value::String),
    ];
    leaf.prop_recursive(3, 24, 4, |inner| {
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
            proptest::collection::btree_map(
                prop_oneof![
                    prop::sample::select(vec![
                        "type".to_string(),
                        "v".into(),
                        "relayHostId".into(),
                        "assignmentEpoch".into(),
                        "t".into(),
                        "reqId".into(),
                        "credential".into(),
                        "connTicket".into(),
                        "generation".into(),
                    ]),
                    "[a-zA-Z]{0,6}"
                ],
                inner,
                0..5
            )
            .prop_map(|map| Value::Object(map.into_iter().collect())),
        ]
    })
}

/// Text that is sometimes JSON of the right shape, sometimes close to it, sometimes anything.
fn control_text() -> impl Strategy<Value = String> {
    let kinds = prop::sample::select(vec![
        "host-hello",
        "pong",
        "invite-create",
        "relay-auth",
        "host-data-auth",
        "host-hello-ack",
        "ping",
        "invite-created",
        "conn-open",
        "drain",
        "surprise",
    ]);
    prop_oneof![
        (kinds, json_value()).prop_map(|(kind, value)| {
            let mut object = match value {
                serde_json::Value::Object(object) => object,
                other => {
                    let mut object = serde_json::Map::new();
                    object.insert("v".into(), other);
                    object
                }
            };
            object.insert("type".into(), kind.into());
            serde_json::Value::Object(object).to_string()
        }),
        json_value().prop_map(|value| value.to_string()),
        any::<String>(),
        "[{}\\[\\]\":,0-9a-z -]{0,64}",
    ]
}

fn control_messages_json(runner: &mut TestRunner) -> Result<(), String> {
    use orca_relay::protocol::{DataLegFirst, HostToRelay, PhoneFirst, RelayToHost};
    fn round_trip<T>(text: &str) -> Result<(), TestCaseError>
    where
        T: serde::de::DeserializeOwned + serde::Serialize + PartialEq + Debug,
    {
        if let Ok(value) = serde_json::from_str::<T>(text) {
            let again: T = serde_json::from_str(&orca_relay::protocol::to_json(&value))
                .map_err(|e| TestCaseError::fail(format!("re-parse of {value:?}: {e}")))?;
            prop_assert_eq!(again, value);
        }
        Ok(())
    }
    check(runner, control_text(), |text| {
        let (result, heap) = peak_heap(|| -> Result<(), TestCaseError> {
            round_trip::<HostToRelay>(&text)?;
            round_trip::<RelayToHost>(&text)?;
            round_trip::<PhoneFirst>(&text)?;
            round_trip::<DataLegFirst>(&text)?;
            Ok(())
        });
        result?;
        // Control frames are at most 1 MiB; parsing one may hold a few times its size.
        bounded("control JSON", heap, 64 * 1024 + 32 * text.len())
    })
}

// ---------------------------------------------------------------------------------------------
// The switch file.

fn switch_file(runner: &mut TestRunner) -> Result<(), String> {
    use orca_relay::cell::switch::{parse, SwitchWatcher};
    use orca_relay::local_file::LocalFileError;
    let file = prop_oneof![
        (
            any::<i64>(),
            json_value(),
            prop::sample::select(vec!["c7", "c8", ""])
        )
            .prop_map(|(generation, flags, cell)| {
                serde_json::json!({"v":1,"cellId":cell,"generation":generation,"flags":flags})
                    .to_string()
                    .into_bytes()
            }),
        (
            0u64..20,
            prop::sample::select(vec!["db", "reserve", "x"]),
            0u64..70
        )
            .prop_map(|(generation, mode, slots)| {
                serde_json::json!({"v":1,"cellId":"c7","generation":generation,
                    "flags":{"admitMode":mode,"deadManTripSlots":slots}})
                .to_string()
                .into_bytes()
            }),
        json_value().prop_map(|value| value.to_string().into_bytes()),
        proptest::collection::vec(any::<u8>(), 0..256),
    ];
    let read = prop_oneof![
        8 => file.prop_map(Ok),
        1 => Just(Err(0u8)),
        1 => Just(Err(1u8)),
    ];
    check(runner, proptest::collection::vec(read, 1..12), |reads| {
        let mut watcher = SwitchWatcher::new("c7");
        for read in reads {
            let before = watcher.applied();
            let valid = match &read {
                Ok(bytes) => parse(bytes, "c7").ok().map(|(switch, _)| switch),
                Err(_) => None,
            };
            let read = match read {
                Ok(bytes) => Ok(bytes),
                Err(0) => Err(LocalFileError::Missing),
                Err(_) => Err(LocalFileError::NotRegular("fifo")),
            };
            let (event, heap) = peak_heap(|| watcher.poll(read));
            bounded("switch poll", heap, 256 * 1024)?;
            prop_assert!(event.log_lines.len() <= 2, "{:?}", event.log_lines);
            let after = watcher.applied();
            prop_assert!(after.generation >= before.generation);
            match (event.applied, valid) {
                (Some(applied), Some(valid)) => {
                    prop_assert_eq!(applied, valid);
                    prop_assert!(valid.generation > before.generation);
                }
                (Some(applied), None) => {
                    return Err(TestCaseError::fail(format!(
                        "applied {applied:?} from a void read"
                    )))
                }
                (None, _) => prop_assert_eq!(after, before),
            }
        }
        Ok(())
    })
}

// ---------------------------------------------------------------------------------------------
// The environment configuration.

/// Every variable `config.rs` reads, found in its source, so a new one is fuzzed too.
fn config_variables() -> Vec<String> {
    let source = include_str!("../../src/config.rs");
    let mut names: Vec<String> = source
        .split('"')
        .filter(|token| {
            (token.starts_with("ORCA_RELAY_") || *token == "DATABASE_URL" || *token == "RUST_LOG")
                && token
                    .chars()
                    .all(|c| c.is_ascii_uppercase() || c == '_' || c.is_ascii_digit())
        })
        .map(str::to_string)
        .collect();
    names.sort();
    names.dedup();
    names
}

fn env_value() -> impl Strategy<Value = String> {
    prop_oneof![
        Just(String::new()),
        Just(" ".to_string()),
        prop::sample::select(vec![
            "0",
            "1",
            "-1",
            "3600000",
            "3600001",
            "18446744073709551616",
            "1e3",
            "0x10",
            "combined",
            "cell",
            "director",
            "db",
            "reserve",
            "true",
            "127.0.0.1:0",
            "[::1]:80",
            "http://x",
            "https://x/y",
            "ws://h:1",
            "postgres://u@h/db",
            "a,b,,c",
            "x".repeat(300).leak(),
        ])
        .prop_map(str::to_string),
        any::<u64>().prop_map(|n| n.to_string()),
        "[ -~]{0,40}",
        any::<String>(),
    ]
}

fn env_config(runner: &mut TestRunner) -> Result<(), String> {
    let names = config_variables();
    let count = names.len();
    let strategy = proptest::collection::btree_map(0..count, env_value(), 0..count.min(12));
    check(runner, strategy, move |chosen| {
        let env: std::collections::HashMap<String, String> = chosen
            .iter()
            .map(|(i, value)| (names[*i].clone(), value.clone()))
            .collect();
        let lookup = |name: &str| env.get(name).cloned();
        let (result, heap) = peak_heap(|| orca_relay::config::Config::from_lookup(&lookup));
        bounded("config", heap, 256 * 1024)?;
        if let Err(error) = result {
            // The error names the variable it is about (one that was set).
            let message = error.to_string();
            prop_assert!(
                message.contains("ORCA_RELAY_") || message.contains("DATABASE_URL"),
                "{message}"
            );
            prop_assert!(!message.contains('\n'), "one line: {message:?}");
        }
        Ok(())
    })
}

// ---------------------------------------------------------------------------------------------
// JWT header and claims (the self-hosted HS256 verifier; the JWKS one shares the parsing).

const SECRET: &str = "fuzz-secret-0123456789abcdef0123456789";
const NOW_MS: u64 = 1_800_000_000_000;

fn hmac_sha256(key: &[u8], message: &[u8]) -> Vec<u8> {
    use sha2::{Digest, Sha256};
    let mut block = [0u8; 64];
    if key.len() > 64 {
        block[..32].copy_from_slice(&Sha256::digest(key));
    } else {
        block[..key.len()].copy_from_slice(key);
    }
    let inner_key: Vec<u8> = block.iter().map(|b| b ^ 0x36).collect();
    let outer_key: Vec<u8> = block.iter().map(|b| b ^ 0x5c).collect();
    let mut inner = Sha256::new();
    inner.update(&inner_key);
    inner.update(message);
    let mut outer = Sha256::new();
    outer.update(&outer_key);
    outer.update(inner.finalize());
    outer.finalize().to_vec()
}

fn b64(bytes: &[u8]) -> String {
    use base64::Engine;
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(bytes)
}

fn jwt_token() -> impl Strategy<Value = String> {
    let header = prop_oneof![
        json_value(),
        (
            prop::sample::select(vec!["HS256", "none", "RS256", "ES256", "HS512", ""]),
            json_value()
        )
            .prop_map(|(alg, extra)| serde_json::json!({"alg":alg,"typ":"JWT","kid":extra})),
    ];
    let exp = prop_oneof![
        Just(serde_json::json!(NOW_MS / 1000 + 600)),
        Just(serde_json::json!(NOW_MS / 1000 - 600)),
        json_value(),
    ];
    let claims = prop_oneof![
        json_value(),
        (
            exp,
            prop::sample::select(vec!["host-control", "other", ""]),
            prop::sample::select(vec!["abcdefghijklmnop", "short", "abcdefghijklmno!", ""]),
            prop::sample::select(vec!["orca-relay", "else"]),
            json_value()
        )
            .prop_map(|(exp, purpose, host, aud, sub)| {
                serde_json::json!({"sub":sub,"relayHostId":host,"purpose":purpose,"aud":aud,"exp":exp})
            }),
    ];
    let signed = (header, claims, any::<bool>()).prop_map(|(header, claims, good_key)| {
        let signing_input = format!(
            "{}.{}",
            b64(header.to_string().as_bytes()),
            b64(claims.to_string().as_bytes())
        );
        let key: &[u8] = if good_key {
            SECRET.as_bytes()
        } else {
            b"wrong"
        };
        format!(
            "{signing_input}.{}",
            b64(&hmac_sha256(key, signing_input.as_bytes()))
        )
    });
    prop_oneof![
        4 => signed,
        1 => "[A-Za-z0-9_.=-]{0,80}",
        1 => any::<String>(),
        1 => proptest::collection::vec("[A-Za-z0-9_-]{0,20}", 0..6).prop_map(|parts| parts.join(".")),
    ]
}

fn jwt_header_and_claims(runner: &mut TestRunner) -> Result<(), String> {
    use orca_relay::auth::{is_valid_relay_host_id, parse_bearer, Verifier};
    let clock = orca_relay::clock::ManualClock::starting_at(NOW_MS);
    let verifier = Verifier::from_self_hosted_key(SECRET, None, "orca-relay".into(), clock);
    check(
        runner,
        (jwt_token(), any::<bool>()),
        |(token, as_header)| {
            let (result, heap) = peak_heap(|| {
                let header = format!("Bearer {token}");
                let token = if as_header {
                    match parse_bearer(Some(&header)) {
                        Ok(token) => token.to_string(),
                        Err(_) => return None,
                    }
                } else {
                    token.clone()
                };
                Some(verifier.verify_host_token(&token))
            });
            bounded("token check", heap, 64 * 1024 + 16 * token.len())?;
            if let Some(Ok(claims)) = result {
                // Whatever passed is a host-control token for this audience, live, well formed.
                prop_assert!(is_valid_relay_host_id(&claims.relay_host_id), "{claims:?}");
                prop_assert!(!claims.user_id.is_empty(), "{claims:?}");
                prop_assert!(
                    claims.expires_at + orca_relay::auth::EXP_LEEWAY_MS >= NOW_MS,
                    "{claims:?}"
                );
            }
            Ok(())
        },
    )
}

// ---------------------------------------------------------------------------------------------
// The HTTP request head both listeners read (`http::head::parse_head`), its target forms and
// its Host rule (RFC 9112 §3.2), against reference models written here independently.

/// The reference model of a request target's path and query: origin form is anything that
/// starts with `/` (path up to the first `?`); absolute form is scheme (a letter, then letters,
/// digits, `+-.`), `://`, a non-empty authority up to `/` or `?`, a path (`/` when empty) up to
/// `?`; anything else is refused. Written as a scan, unlike the code under test.
fn model_target(target: &str) -> Option<(String, String)> {
    let bytes = target.as_bytes();
    let split_query = |rest: &str| -> (String, String) {
        match rest.find('?') {
            Some(q) => (rest[..q].to_string(), rest[q + 1..].to_string()),
            None => (rest.to_string(), String::new()),
        }
    };
    if bytes.first() == Some(&b'/') {
        return Some(split_query(target));
    }
    let mut i = 0;
    if !bytes.first()?.is_ascii_alphabetic() {
        return None;
    }
    while i < bytes.len() && (bytes[i].is_ascii_alphanumeric() || b"+-.".contains(&bytes[i])) {
        i += 1;
    }
    if !target[i..].starts_with("://") {
        return None;
    }
    i += 3;
    let authority_start = i;
    while i < bytes.len() && bytes[i] != b'/' && bytes[i] != b'?' {
        i += 1;
    }
    if i == authority_start {
        return None;
    }
    let (path, query) = split_query(&target[i..]);
    Some((if path.is_empty() { "/".into() } else { path }, query))
}

/// The reference model of the Host rule: HTTP/1.1 needs exactly one, HTTP/1.0 at most one.
fn model_host(version: u8, hosts: usize) -> Result<(), &'static str> {
    match (version, hosts) {
        (_, 1) | (0, 0) => Ok(()),
        (_, 0) => Err("missing_host"),
        _ => Err("repeated_host"),
    }
}

/// Request targets that probe the forms: origin targets whose query or path hold `://`,
/// absolute targets, and junk.
fn request_target() -> impl Strategy<Value = String> {
    let piece = prop::sample::select(vec![
        "/",
        "//",
        "/v1/assign",
        "/metrics",
        "/v1/admin/cells",
        "?",
        "u=",
        "://",
        "http",
        "https",
        "ws",
        "x",
        "relay:8081",
        "@",
        "#",
        "%2F",
        "*",
        ":",
        "1h",
        "+",
    ]);
    prop_oneof![
        proptest::collection::vec(piece.clone(), 0..8).prop_map(|parts| parts.concat()),
        proptest::collection::vec(piece, 0..6).prop_map(|parts| format!("/{}", parts.concat())),
        "[ -~&&[^ ]]{0,40}",
    ]
}

fn http_request_head(runner: &mut TestRunner) -> Result<(), String> {
    use orca_relay::http::head::{parse_head, split_target, MAX_HEAD_BYTES};
    let good = "GET /v1/connect/abcdefghijklmnop HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: keep-alive, Upgrade\r\nSec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nAuthorization: Bearer abc\r\n\r\n";
    let head = prop_oneof![
        // A real head with random edits.
        proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 0..6).prop_map(
            move |edits| {
                let mut bytes = good.as_bytes().to_vec();
                for (at, byte) in edits {
                    let i = at.index(bytes.len());
                    bytes[i] = byte;
                }
                bytes
            }
        ),
        // Header lines from pieces.
        proptest::collection::vec(
            (
                prop::sample::select(vec![
                    "Host",
                    "host",
                    "HOST",
                    "Upgrade",
                    "Connection",
                    "Authorization",
                    "Sec-WebSocket-Key",
                    "Sec-WebSocket-Version",
                    "Expect",
                    "X"
                ]),
                "[ -~]{0,30}"
            ),
            0..40
        )
        .prop_map(|headers| {
            let mut text = String::from("GET /v1/host/control?x=1 HTTP/1.1\r\n");
            for (name, value) in headers {
                text.push_str(&format!("{name}: {value}\r\n"));
            }
            text.push_str("\r\n");
            text.into_bytes()
        }),
        // Targets in every form, versions, 0 to 3 Host headers.
        (
            request_target(),
            prop::sample::select(vec!["HTTP/1.1", "HTTP/1.0"]),
            0..4usize
        )
            .prop_map(|(target, version, hosts)| {
                let mut text = format!("GET {target} {version}\r\n");
                for n in 0..hosts {
                    text.push_str(&format!("Host: h{n}\r\n"));
                }
                text.push_str("\r\n");
                text.into_bytes()
            }),
        proptest::collection::vec(any::<u8>(), 0..512),
    ];
    check(
        runner,
        (head, proptest::collection::vec(any::<u8>(), 0..32)),
        |(head, tail)| {
            let mut bytes = head.clone();
            bytes.extend_from_slice(&tail);
            bytes.truncate(MAX_HEAD_BYTES);
            // Every prefix (as the bytes arrive) parses without panic; once complete, the rest of
            // the bytes are the tail, the target's form and the Host rule are the models'.
            let mut completed_at = None;
            for end in 0..=bytes.len() {
                let (result, heap) = peak_heap(|| parse_head(&bytes[..end]));
                bounded("head parse", heap, 4 * 1024 + 2 * end)?;
                match result {
                    Ok(Some((parsed, len))) => {
                        let at = *completed_at.get_or_insert(len);
                        prop_assert_eq!(len, at, "the head's end moved");
                        let ours = split_target(&parsed.target)
                            .map(|(path, query)| (path.to_string(), query.to_string()));
                        prop_assert_eq!(
                            &ours,
                            &model_target(&parsed.target),
                            "{:?}",
                            parsed.target
                        );
                        if let Some((path, _)) = &ours {
                            prop_assert!(path.starts_with('/'), "path {path:?}");
                            // Origin form is never rerouted by what its query holds.
                            if parsed.target.starts_with('/') {
                                prop_assert!(parsed.target.starts_with(path.as_str()));
                            }
                        }
                        let hosts = parsed
                            .headers
                            .iter()
                            .filter(|(name, _)| name.eq_ignore_ascii_case("host"))
                            .count();
                        prop_assert_eq!(
                            parsed.host_rule(),
                            model_host(parsed.minor_version, hosts)
                        );
                    }
                    Ok(None) => prop_assert!(completed_at.is_none(), "complete, then partial"),
                    Err(_) => break,
                }
            }
            Ok(())
        },
    )
}

// ---------------------------------------------------------------------------------------------
// The WebSocket upgrade's validation (`relay::upgrade::check`): against a model of RFC 6455
// §4.2.1 written here, and differential against tungstenite's server handshake.

/// One generated upgrade head, kept as its pieces for the model.
#[derive(Debug, Clone)]
struct UpgradeCase {
    method: &'static str,
    version: u8,
    target: String,
    headers: Vec<(&'static str, String)>,
}

impl UpgradeCase {
    fn text(&self) -> String {
        let mut text = format!(
            "{} {} HTTP/1.{}\r\n",
            self.method, self.target, self.version
        );
        for (name, value) in &self.headers {
            text.push_str(&format!("{name}: {value}\r\n"));
        }
        text.push_str("\r\n");
        text
    }

    fn values(&self, name: &str) -> Vec<&str> {
        self.headers
            .iter()
            .filter(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.trim())
            .collect()
    }
}

/// The model: the status and reason `check` must answer, in the order of the module header.
fn model_upgrade(case: &UpgradeCase) -> Result<&'static str, (u16, &'static str)> {
    use base64::Engine;
    if case.version != 1 {
        return Err((400, "http_version"));
    }
    model_host(1, case.values("host").len()).map_err(|reason| (400, reason))?;
    if case.method != "GET" {
        return Err((400, "method"));
    }
    let Some((path, _)) = model_target(&case.target) else {
        return Err((400, "bad_request_target"));
    };
    let route = if path == "/v1/host/control" {
        "control"
    } else if path.strip_prefix("/v1/connect/").is_some_and(|id| {
        !id.is_empty()
            && id.len() <= 128
            && id
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
    }) {
        "phone"
    } else if path.strip_prefix("/v1/host/data/").is_some_and(|id| {
        !id.is_empty()
            && id.len() <= 128
            && id
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
    }) {
        "data"
    } else {
        return Err((404, "unknown_path"));
    };
    let lists = |name: &str, token: &str| {
        case.values(name).iter().any(|value| {
            value
                .split(',')
                .any(|part| part.trim().eq_ignore_ascii_case(token))
        })
    };
    let versions = case.values("sec-websocket-version");
    if !(lists("upgrade", "websocket") && lists("connection", "upgrade") && versions == ["13"]) {
        return Err((426, "not_websocket"));
    }
    let keys = case.values("sec-websocket-key");
    let key_ok = keys.len() == 1
        && keys[0].len() == 24
        && base64::engine::general_purpose::STANDARD
            .decode(keys[0])
            .is_ok_and(|key| key.len() == 16);
    if !key_ok {
        return Err((400, "websocket_key"));
    }
    Ok(route)
}

fn upgrade_case() -> impl Strategy<Value = UpgradeCase> {
    use base64::Engine;
    let key = prop_oneof![
        3 => proptest::collection::vec(any::<u8>(), 16).prop_map(|bytes| base64::engine::general_purpose::STANDARD.encode(bytes)),
        1 => proptest::collection::vec(any::<u8>(), 0..24).prop_map(|bytes| base64::engine::general_purpose::STANDARD.encode(bytes)),
        1 => proptest::collection::vec(any::<u8>(), 16).prop_map(|bytes| base64::engine::general_purpose::STANDARD_NO_PAD.encode(bytes)),
        1 => proptest::collection::vec(any::<u8>(), 16).prop_map(|bytes| base64::engine::general_purpose::URL_SAFE.encode(bytes)),
        1 => "[ -~]{0,30}",
    ];
    let header = prop_oneof![
        Just(("Host", "relay".to_string())),
        prop::sample::select(vec!["websocket", "WebSocket", "websocket, h2c", "h2c", ""])
            .prop_map(|v| ("Upgrade", v.to_string())),
        prop::sample::select(vec![
            "Upgrade",
            "keep-alive, Upgrade",
            "upgrade",
            "keep-alive",
            ""
        ])
        .prop_map(|v| ("Connection", v.to_string())),
        prop::sample::select(vec!["13", "8", "13, 8", " 13", ""])
            .prop_map(|v| ("Sec-WebSocket-Version", v.to_string())),
        key.clone().prop_map(|v| ("Sec-WebSocket-Key", v)),
        Just(("Authorization", "Bearer abc".to_string())),
    ];
    let full = vec![
        ("Host", "relay".to_string()),
        ("Upgrade", "websocket".to_string()),
        ("Connection", "Upgrade".to_string()),
        ("Sec-WebSocket-Version", "13".to_string()),
    ];
    (
        prop::sample::select(vec!["GET", "GET", "GET", "POST", "get", "HEAD"]),
        prop_oneof![4 => Just(1u8), 1 => Just(0u8)],
        prop_oneof![
            3 => prop::sample::select(vec![
                "/v1/host/control".to_string(),
                "/v1/connect/abcdefghijklmnop".to_string(),
                "/v1/host/data/1-2?x=1".to_string(),
                "ws://relay/v1/connect/abcdefghijklmnop".to_string(),
                "/v1/connect/a/b".to_string(),
            ]),
            1 => request_target(),
        ],
        prop::bool::ANY,
        proptest::collection::vec(header, 0..4),
        key,
    )
        .prop_map(move |(method, version, target, start_full, extra, key)| {
            let mut headers = if start_full { full.clone() } else { Vec::new() };
            if start_full {
                headers.push(("Sec-WebSocket-Key", key));
            }
            headers.extend(extra);
            UpgradeCase {
                method,
                version,
                target,
                headers,
            }
        })
}

fn upgrade_validation(runner: &mut TestRunner) -> Result<(), String> {
    use orca_relay::http::head::parse_head;
    use orca_relay::relay::upgrade::{check as check_upgrade, switching_protocols};
    check(runner, upgrade_case(), |case| {
        let text = case.text();
        let Ok(Some((head, _))) = parse_head(text.as_bytes()) else {
            // Pieces httparse refuses (a space in a target): the reader answers 400 itself.
            return Ok(());
        };
        let ours = check_upgrade(&head);
        let model = model_upgrade(&case);
        prop_assert_eq!(
            ours.as_ref()
                .map(|u| u.route.kind())
                .map_err(|r| (r.status, r.reason)),
            model,
            "{}",
            text
        );
        // Differential: whatever we open, tungstenite's server handshake opens too, with the
        // same Sec-WebSocket-Accept (tungstenite reads the first of repeated headers and takes
        // `Upgrade` as one value, so only single-valued heads are compared).
        if let Ok(upgrade) = &ours {
            let single = ["upgrade", "connection", "sec-websocket-version"]
                .iter()
                .all(|name| case.values(name).len() == 1)
                && !case.values("upgrade")[0].contains(',');
            let mut request = tungstenite::http::Request::builder()
                .method(case.method)
                .uri(case.target.as_str())
                .version(tungstenite::http::Version::HTTP_11);
            for (name, value) in &case.headers {
                request = request.header(*name, value.as_str());
            }
            if let (true, Ok(request)) = (single, request.body(())) {
                let theirs = tungstenite::handshake::server::create_response(&request);
                prop_assert!(
                    theirs.is_ok(),
                    "tungstenite refuses what we open: {theirs:?}\n{text}"
                );
                let accept = theirs
                    .ok()
                    .and_then(|response| response.headers().get("Sec-WebSocket-Accept").cloned());
                let ours_101 = switching_protocols(&upgrade.key);
                prop_assert!(
                    accept.is_some_and(|accept| ours_101.contains(&format!(
                        "Sec-WebSocket-Accept: {}\r\n",
                        accept.to_str().unwrap_or("?")
                    ))),
                    "accept keys differ\n{ours_101}"
                );
            }
        }
        Ok(())
    })
}

// ---------------------------------------------------------------------------------------------
// The budget tool's fleet file.

fn budget_fleet(runner: &mut TestRunner) -> Result<(), String> {
    use orca_relay::budget;
    let seed = include_str!("../../packaging/fleet-seed.json");
    let seed_toml = include_str!("../../packaging/fleet-seed.toml");
    let edited = |text: &'static str| {
        proptest::collection::vec(
            (
                any::<prop::sample::Index>(),
                "[0-9a-z\\[\\]{}\",:= .-]{0,3}",
            ),
            0..4,
        )
        .prop_map(move |edits| {
            let mut text = text.to_string();
            for (at, piece) in edits {
                let mut i = at.index(text.len() + 1);
                while !text.is_char_boundary(i) {
                    i -= 1;
                }
                text.insert_str(i, &piece);
            }
            text
        })
    };
    let numbers =
        proptest::collection::vec(prop_oneof![any::<u64>(), 0u64..100, Just(u64::MAX)], 1..30)
            .prop_map(move |numbers| {
                // The seed fleet with its numbers replaced, in order.
                let mut out = String::new();
                let mut numbers = numbers.into_iter().cycle();
                let mut in_number = false;
                for c in seed.chars() {
                    if c.is_ascii_digit() {
                        if !in_number {
                            out.push_str(&numbers.next().unwrap_or(0).to_string());
                            in_number = true;
                        }
                    } else {
                        in_number = false;
                        out.push(c);
                    }
                }
                out
            });
    let text = prop_oneof![
        edited(seed),
        edited(seed_toml),
        numbers,
        json_value().prop_map(|v| v.to_string()),
        any::<String>(),
    ];
    check(runner, text, |text| {
        let (result, heap) = peak_heap(|| {
            budget::parse_fleet_any(&text, "fuzz")
                .and_then(|fleet| budget::plan(&fleet))
                .map(|plan| budget::render(&plan))
        });
        bounded("budget", heap, 1024 * 1024 + 64 * text.len())?;
        if let Err(error) = result {
            prop_assert!(!error.to_string().is_empty());
        }
        Ok(())
    })
}
